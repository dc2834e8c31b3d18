"""`hybridlm demo`: run each reference op once on random inputs and show that its two algorithms agree.

Non-standard here: nothing; it exists so a fresh install can check the maths in a second without training.
"""

from __future__ import annotations

import argparse
import time

import torch

from .ops import (
    comba,
    delta_rule,
    deltaformer_attention,
    gated_delta_rule,
    gated_linear_attention,
    kda,
    linear_attention,
    mesa_net,
    path_attention,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seq-len", type=int, default=200, help="sequence length T of the random inputs")
    parser.add_argument("--seed", type=int, default=0, help="random seed")


def run(args: argparse.Namespace) -> int:
    torch.manual_seed(args.seed)
    B, T, H, HV, K, V = 2, args.seq_len, 2, 4, 32, 48
    d = torch.float64
    q, k, v = torch.randn(B, T, H, K, dtype=d), torch.randn(B, T, H, K, dtype=d), torch.randn(B, T, HV, V, dtype=d)
    g, gk = -torch.rand(B, T, HV, dtype=d), -torch.rand(B, T, HV, K, dtype=d)
    beta = torch.rand(B, T, HV, dtype=d)
    p, w = torch.randn(B, T, H, K, dtype=d), torch.randn(B, T, H, K, dtype=d)  # Comba's read key, PaTH's directions
    ops = {
        "gated_delta_rule": (gated_delta_rule, dict(g=g, beta=beta)),
        "kda": (kda, dict(g=gk, beta=beta)),
        "delta_rule": (delta_rule, dict(beta=beta)),
        "gated_linear_attention": (gated_linear_attention, dict(g=gk, beta=beta)),
        "linear_attention": (linear_attention, {}),
        "comba": (lambda q, k, v, **kw: comba(q, k, v, p, **kw), dict(g=g, beta=beta)),
        "mesa_net": (mesa_net, dict(g=g, beta=beta, lamb=torch.rand(HV, K, dtype=d) + 0.25)),
        # softmax-attention forms: as many query as key heads here, no state
        "path_attention": (lambda q, k, v, use_qk_l2norm, **kw: (path_attention(
            q, k, v[:, :, :H], w, beta=2 * beta[:, :, :H], **kw), None), {}),
        "deltaformer_attention": (lambda q, k, v, use_qk_l2norm, **kw: (deltaformer_attention(
            q, k, v[:, :, :H], beta=beta[:, :, :H], **kw), None), {}),
    }
    print(f"float64, B={B} T={T} H={H} HV={HV} K={K} V={V}, q/k L2-normalised")
    print(f"{'op':<24}{'naive ms':>10}{'chunk ms':>10}{'rel. diff':>12}")
    for name, (fn, kw) in ops.items():
        times, outs = [], []
        for impl in ("naive", "chunk"):
            t0 = time.perf_counter()
            o, _ = fn(q, k, v, use_qk_l2norm=True, impl=impl, **kw)
            times.append(1e3 * (time.perf_counter() - t0))
            outs.append(o)
        err = ((outs[1] - outs[0]).norm() / outs[0].norm()).item()
        print(f"{name:<24}{times[0]:>10.1f}{times[1]:>10.1f}{err:>12.1e}")
    return 0
