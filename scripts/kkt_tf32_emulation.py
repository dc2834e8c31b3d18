"""CPU emulation of `_kkt_solve`'s solve at each dot precision: the relative error of T = (I + A)^{-1} against float64,
before and after T's bf16 store, on chunks like the GPU check's (bf16 keys, l2-normalised; beta up to 2; log-decays
logsigmoid(N(3, 1))). tf32 dots are emulated by rounding both operands to 10 mantissa bits (fp32 products and sums);
tf32x3 by the hi/lo split's three products. The same block algorithm as the kernel: diagonal [16, 16] blocks by
doubling, then T_IJ = -T_II sum_M A_IM T_MJ.

    python scripts/kkt_tf32_emulation.py [--seeds 20]
"""

from __future__ import annotations

import argparse
import statistics

import torch

F32 = torch.float32
PLANS = {"tf32 (default)": ("tf32", "tf32"), "diag tf32x3": ("tf32x3", "tf32"), "tf32x3": ("tf32x3", "tf32x3"),
         "ieee": ("ieee", "ieee")}


def tf32(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> the nearest value with a 10-bit mantissa (ties away), as fp32."""
    bits = x.contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(F32)


def mm(a: torch.Tensor, b: torch.Tensor, prec: str) -> torch.Tensor:
    if prec == "ieee":
        return a @ b
    ah, bh = tf32(a), tf32(b)
    if prec == "tf32":
        return ah @ bh
    return ah @ bh + ah @ tf32(b - bh) + tf32(a - ah) @ bh


def inv16(A: torch.Tensor, prec: str) -> torch.Tensor:
    """(I + A)^{-1} of a strictly lower [16, 16] block by doubling (`_solve_doubling` at BT 16)."""
    r = torch.arange(16)
    T = torch.eye(16, dtype=F32)
    for s in range(4):
        sel = ((r[:, None] >> (s + 1)) == (r[None, :] >> (s + 1))) & (((r[:, None] >> s) & 1) == 1) \
            & (((r[None, :] >> s) & 1) == 0)
        T = T - mm(mm(T, torch.where(sel, A, 0.0), prec), T, prec)
    return T


def solve(A: torch.Tensor, dprec: str, sprec: str) -> torch.Tensor:
    blk = lambda i, j: A[16 * i:16 * i + 16, 16 * j:16 * j + 16]  # noqa: E731
    T = {(i, i): inv16(blk(i, i), dprec) for i in range(4)}
    for i in range(1, 4):
        for j in range(i - 1, -1, -1):
            acc = sum(mm(blk(i, m), T[m, j], sprec) for m in range(j, i))
            T[i, j] = -mm(T[i, i], acc, sprec)
    out = torch.zeros(64, 64, dtype=F32)
    for (i, j), t in T.items():
        out[16 * i:16 * i + 16, 16 * j:16 * j + 16] = t
    return out


def chunk_a(K: int, seed: int) -> torch.Tensor:
    """A = strict_lower(beta_i (k_i . k_j) e^{b_i - b_j}) of one 64-token chunk, float64."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(64, K, generator=g).to(torch.bfloat16).double()
    k = k / k.norm(dim=1, keepdim=True)
    beta = 2 * torch.rand(64, generator=g, dtype=torch.float64)
    b = torch.nn.functional.logsigmoid(torch.randn(64, generator=g, dtype=torch.float64) + 3).cumsum(0)
    return torch.tril(beta[:, None] * (k @ k.T) * torch.exp(b[:, None] - b[None, :]), -1)


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x - ref).norm() / ref.norm()).item()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=20, help="chunks per key width")
    args = ap.parse_args(argv)
    for K in (128, 256):
        errs: dict[str, list[tuple[float, float]]] = {}
        for seed in range(args.seeds):
            A = chunk_a(K, seed)
            ref = torch.linalg.inv(torch.eye(64, dtype=torch.float64) + A)
            for name, (dp, sp) in PLANS.items():
                T = solve(A.float(), dp, sp).double()
                errs.setdefault(name, []).append((_rel(T, ref), _rel(T.to(torch.bfloat16).double(), ref)))
        for name, v in errs.items():
            print(f"K={K} {name:15} T error median {statistics.median(x[0] for x in v):.2e} "
                  f"(max {max(x[0] for x in v):.2e}); after the bf16 store {statistics.median(x[1] for x in v):.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
