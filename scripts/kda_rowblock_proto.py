"""Prototype, not used by the library: one of KDA's decay products in fla's layout, to count and check it before any
kernel is restructured (BENCHMARKS.md, Next steps of 2026-11-25 06:40).

    out_i = sum_{j < i} M_ij y_j e^{b_i - b_j}       (per key channel; b the cumulative log-decay of a chunk)

The library's kernels (`kda_kernels._rows_prod_blk`) take a whole chunk per program and form the off-diagonal 16-row
blocks by three masked [BT, BT] x [BT, BK] dots, each computing 16 block pairs for 1-3 useful ones. Here one program
takes one 16-row block I of one chunk and key block: its off-diagonal part is one [16, BT] x [BT, BK] dot through
the block's first row (e^{b_i - b_j} = e^{b_i - r} e^{r - b_j}, r = b at row 16 I - 1: both factors <= 1 for any
decay, columns at and after 16 I masked), its diagonal block the exact pairwise loop, one in-block column at a time.
Every exponent is a direct sum of g (no difference of cumulative sums).

Layout here (not the library's): M [NC, BT, BT] fp32, y [NC, BT, K], g [NC, BT, K] fp32 log-decays <= 0, out
[NC, BT, K] fp32, for NC chunks (heads folded in); grid (NC, BT // 16, K // BK).

    TRITON_INTERPRET=1 python scripts/kda_rowblock_proto.py [--decay 30]     (against float64, on the CPU)
    python scripts/kda_rowblock_proto.py --compile [--warps 1,2,4]         (sm_90 registers and stack, no GPU)
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _rows_prod_rowblock(M, y, g, out, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr):
    ic = tl.program_id(0)
    r0 = tl.program_id(1) * 16  # this program's rows r0 .. r0 + 15
    offs = tl.program_id(2) * BK + tl.arange(0, BK)
    base = ic.to(tl.int64) * BT * K
    pos = tl.arange(0, 16)
    rows = r0 + pos
    cols = tl.arange(0, BT)
    # off-diagonal: e^{b_i - r} = e^{g of rows r0..i} for the block's rows, e^{r - b_j} = e^{g of rows j+1..r0-1}
    # for the columns before it (0 at and after r0)
    g_blk = tl.load(g + base + rows[:, None] * K + offs[None, :])
    xe = tl.exp(tl.cumsum(g_blk, 0))
    g_next = tl.load(g + base + (cols + 1)[:, None] * K + offs[None, :], mask=(cols + 1 < r0)[:, None], other=0.0)
    ye = tl.where((cols < r0)[:, None], tl.exp(tl.cumsum(g_next, 0, reverse=True)), 0.0)
    y_all = tl.load(y + base + cols[:, None] * K + offs[None, :]).to(tl.float32)
    p_M = M + ic.to(tl.int64) * BT * BT
    m_rows = tl.load(p_M + rows[:, None] * BT + cols[None, :])
    m_off = tl.where(cols[None, :] < r0, m_rows, 0.0)
    acc = tl.dot(m_off, y_all * ye, input_precision="ieee") * xe
    # the diagonal block, exactly: column j of the block for its rows i > j; run_i = g of rows j+1..i
    run = tl.zeros([16, BK], dtype=tl.float32)
    for jj in range(16):
        j = 15 - jj
        g_j1 = tl.load(g + base + tl.minimum(r0 + j + 1, BT - 1) * K + offs)  # unused when j = 15
        run += tl.where((pos > j)[:, None], g_j1[None, :], 0.0)
        y_j = tl.load(y + base + (r0 + j) * K + offs).to(tl.float32)
        m_j = tl.load(p_M + rows * BT + r0 + j)
        acc += tl.where((pos > j)[:, None], m_j[:, None] * y_j[None, :] * tl.exp(run), 0.0)
    tl.store(out + base + rows[:, None] * K + offs[None, :], acc)


def rows_prod(M: torch.Tensor, y: torch.Tensor, g: torch.Tensor, BK: int = 32, warps: int = 4) -> torch.Tensor:
    """M [NC, BT, BT], y [NC, BT, K], g [NC, BT, K] -> out [NC, BT, K] fp32 (the kernel above)."""
    NC, BT, K = y.shape
    out = torch.full((NC, BT, K), float("nan"), device=y.device)
    _rows_prod_rowblock[(NC, BT // 16, K // BK)](M.contiguous(), y.contiguous(), g.contiguous(), out, K=K, BT=BT,
                                                  BK=BK, num_warps=warps)
    return out


def rows_prod_ref(M: torch.Tensor, y: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The same sum in float64 from the [NC, BT, BT, K] factors (exponents of pairs j >= i masked before exp)."""
    M, y, g = M.double(), y.double(), g.double()
    BT = y.shape[1]
    b = g.cumsum(1)
    expo = b[:, :, None, :] - b[:, None, :, :]
    strict = torch.ones(BT, BT, dtype=torch.bool).tril(-1)[None, :, :, None].to(y.device)
    E = expo.masked_fill(~strict, float("-inf")).exp()
    return torch.einsum("cij,cjk,cijk->cik", M, y, E)


def check(decay: float, seed: int) -> float:
    gen = torch.Generator().manual_seed(seed)
    NC, BT, K = 6, 64, 64
    M = torch.randn(NC, BT, BT, generator=gen)
    y = torch.randn(NC, BT, K, generator=gen)
    g = -decay * torch.rand(NC, BT, K, generator=gen)
    got, ref = rows_prod(M, y, g).double(), rows_prod_ref(M, y, g)
    return ((got - ref).norm() / ref.norm()).item()


def compile_counts(warps: list[int]) -> None:
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from compile_sm90 import compile_one

    sig = {"M": "*fp32", "y": "*bf16", "g": "*fp32", "out": "*fp32", "K": "constexpr", "BT": "constexpr",
           "BK": "constexpr"}
    for bk in (32, 64):
        for w in warps:
            res = compile_one(_rows_prod_rowblock, sig, {"K": 128, "BT": 64, "BK": bk}, w, 1,
                              div16=("M", "y", "g", "out"))
            print(f"_rows_prod_rowblock BK {bk} warps {w}: regs {res['regs']}, stack {res['stack']} B, "
                  f"shared {res['shared'] / 1024:.1f} KB", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decay", type=float, default=30.0, help="log-decays uniform in [-decay, 0) a step and channel")
    ap.add_argument("--seeds", type=int, default=2, help="how many random draws to check")
    ap.add_argument("--compile", action="store_true", help="print sm_90 register counts instead of checking")
    ap.add_argument("--warps", default="1,2,4", help="num_warps values for --compile")
    args = ap.parse_args(argv)
    if args.compile:
        compile_counts([int(w) for w in args.warps.split(",")])
        return 0
    worst = 0.0
    for seed in range(args.seeds):
        for decay in (0.1, 5.0, args.decay):
            err = check(decay, seed)
            worst = max(worst, err)
            print(f"seed {seed} decay {decay}: rel RMS vs float64 {err:.2e}", flush=True)
    print("PASS" if worst <= 1e-5 else "FAIL", f"worst {worst:.2e} (fp32 bar 1e-5)")
    return 0 if worst <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
