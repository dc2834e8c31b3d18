"""Multi-token decode cases shared by tests/ops/test_multi_token_decode.py (the PyTorch path in process, and the
kernel on a GPU) and tests/ops/triton/interp_decode.py (the Triton kernel under TRITON_INTERPRET=1): fresh inputs,
the call with its intermediate-state buffer NaN-poisoned, and every result against T one-token steps of the float64
token-loop reference (`hybridlm.ops` impl="naive", one call per token from the previous token's state).

A case is named "{op}_T{T}_{mode}" (op gdn or kda, T 1..8, mode in MODES: what is kept, see hybridlm/ops/decode.py;
"both": intermediate states and accepted counts, with a scale that is not the default) or "{op}_one" (3-d
inputs, one token);
q/k l2-normalised for even T, raw (scaled to norm ~1, so the delta rule stays stable) for odd T. GVA: HV = 2H.
Returns per case the largest relative error over tokens of o and of the intermediate states, the largest over the
written pool rows, and whether every other row kept its bits.
"""

from __future__ import annotations

import torch
from float64_check import F64, rel_f64

from hybridlm.ops import gated_delta_rule, kda

MODES = ("final", "intermediate", "accepted", "both")
DIMS = {"gdn": (16, 32), "kda": (32, 16)}  # (K, V): below, at and across the kernel's 16/32 blocks


def case_names() -> list[str]:
    """Every op and T in "both", and in one of the other modes in turn (so each mode meets both l2 settings)."""
    names = [f"{op}_T{T}_{m}" for j, op in enumerate(("gdn", "kda")) for T in range(1, 9)
             for m in (MODES[(T + j) % 3], "both")]
    return names + ["gdn_one", "kda_one"]


def parse(name: str) -> tuple[str, int, str]:
    """(op, T, mode); "{op}_one" is T 1 in the final mode, called with 3-d inputs."""
    parts = name.split("_")
    if parts[1] == "one":
        return parts[0], 1, "one"
    return parts[0], int(parts[1][1:]), parts[2]


def inputs(op: str, T: int, gen: torch.Generator, *, N: int, H: int, HV: int, K: int, V: int, P: int,
           dtype: torch.dtype, device: str, l2: bool) -> dict:
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    qs = 1.0 if l2 else K**-0.5
    g = -1.5 * torch.rand(N, T, HV, *((K,) if op == "kda" else ()), generator=gen)
    x = dict(q=qs * r(N, T, H, K), k=qs * r(N, T, H, K), v=r(N, T, HV, V), g=g,
             beta=torch.rand(N, T, HV, generator=gen))
    x = {n: t.to(device=device, dtype=torch.float32 if n == "g" and op == "kda" else dtype) for n, t in x.items()}
    x["pool"] = r(P, HV, K, V).to(device)
    x["idx"] = torch.randperm(P, generator=gen)[:N].to(device=device, dtype=torch.int32 if T % 2 else torch.int64)
    return x


def reference(op: str, x: dict, scale: float, l2: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """T one-token float64 steps: o [N, T, HV, V] and the state after each token ([N, HV, K, V] each)."""
    fn = kda if op == "kda" else gated_delta_rule
    S = x["pool"][x["idx"].long()].to(F64)
    outs, states = [], []
    for t in range(x["q"].shape[1]):
        step = {n: x[n][:, t : t + 1].to(F64) for n in ("q", "k", "v", "g", "beta")}
        o, S = fn(step["q"], step["k"], step["v"], g=step["g"], beta=step["beta"], scale=scale, initial_state=S,
                  output_final_state=True, use_qk_l2norm=l2, impl="naive")
        outs.append(o)
        states.append(S)
    return torch.cat(outs, dim=1), states


def run_case(name: str, call, seed: int, *, N: int = 3, H: int = 2, HV: int = 4, dims: tuple[int, int] | None = None,
             P: int = 7, dtype: torch.dtype = torch.float32, device: str = "cpu") -> dict[str, float]:
    """call(op, q, k, v, g=, beta=, state_pool=, state_indices=, scale=, use_qk_l2norm=, intermediate_states=,
    num_accepted=) -> o runs the decode under test."""
    op, T, mode = parse(name)
    K, V = dims or DIMS[op]
    gen = torch.Generator().manual_seed(seed)
    l2 = T % 2 == 0
    x = inputs(op, T, gen, N=N, H=H, HV=HV, K=K, V=V, P=P, dtype=dtype, device=device, l2=l2)
    scale = 0.75 if mode == "both" else K**-0.5
    inter = None
    if mode in ("intermediate", "both"):
        inter = torch.full((N, T, HV, K, V), float("nan"), device=device)
    acc = None
    if mode == "accepted":  # none, all, and one in between
        acc = torch.tensor([0, T, int(torch.randint(1, T + 1, (), generator=gen))] * N)[:N]
    elif mode == "both":
        acc = torch.randint(0, T + 1, (N,), generator=gen)
    if acc is not None:
        acc = acc[torch.randperm(N, generator=gen)].to(device=device, dtype=torch.int64 if T % 2 else torch.int32)
    pool0 = x["pool"].clone()
    args = [x[n] for n in ("q", "k", "v")]
    gates = dict(g=x["g"], beta=x["beta"])
    if mode == "one":
        args, gates = [a[:, 0] for a in args], {n: t[:, 0] for n, t in gates.items()}
    o = call(op, *args, **gates, state_pool=x["pool"], state_indices=x["idx"], scale=scale, use_qk_l2norm=l2,
             intermediate_states=inter, num_accepted=acc)
    o_ref, states = reference(op, {**x, "pool": pool0}, scale, l2)
    if mode == "one":
        o = o[:, None]
    res = {"o": max(rel_f64(o[:, t], o_ref[:, t]) for t in range(T)),
           "o_shape_ok": float(tuple(o.shape) == (N, T, HV, V))}
    if inter is not None:
        res["states"] = max(rel_f64(inter[:, t], states[t]) for t in range(T))
    # the state each sequence's row must hold now (None: the row keeps its bits)
    counts = [T] * N if acc is None else acc.tolist()
    want = [None if mode == "intermediate" or c == 0 else states[c - 1][n] for n, c in enumerate(counts)]
    rows = x["idx"].long().tolist()
    res["pool"] = max([rel_f64(x["pool"][r], w) for r, w in zip(rows, want) if w is not None], default=0.0)
    kept = [r for r, w in zip(rows, want) if w is None] + [r for r in range(P) if r not in rows]
    res["others_unchanged"] = float(torch.equal(x["pool"][kept], pool0[kept]))
    return res
