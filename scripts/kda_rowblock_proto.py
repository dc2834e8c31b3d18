"""Prototype, not used by the library: KDA's two decay products in fla's layout, to count and check them before any
kernel is restructured (BENCHMARKS.md, Next steps of 2026-11-25 06:40).

    rows: out_i = sum_{j < i} M_ij y_j e^{b_i - b_j}     cols: out_j = sum_{i > j} M_ij y_i e^{b_i - b_j}

(per key channel; b the cumulative log-decay of a chunk). The library's kernels (`kda_kernels._rows_prod_blk`,
`_cols_prod_blk`) take a whole chunk per program and form the off-diagonal 16-row blocks by three masked
[BT, BT] x [BT, BK] dots, each computing 16 block pairs for 1-3 useful ones. Here one program takes one 16-row
(rows) or 16-column (cols) block of one chunk and key block: its off-diagonal part is one [16, BT] x [BT, BK] dot
through the block's edge (rows: r = b at the row before the block; cols: r = b at the block's last row; both
factors e^{b_i - r}, e^{r - b_j} <= 1 for any decay, the other pairs masked), its diagonal block the exact pairwise
loop. Every exponent is a direct sum of g (no difference of cumulative sums).

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


@triton.jit
def _cols_prod_colblock(M, y, g, out, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr):
    """The transposed product out_j = sum_{i > j} M_ij y_i e^{b_i - b_j}, one program per 16-column block J: the rows
    after the block through r = b at its last row (e^{b_i - r} = e^{g of rows 16 J + 16 .. i}, e^{r - b_j} = e^{g of
    rows j+1 .. 16 J + 15}, both <= 1), the block's own rows exactly."""
    ic = tl.program_id(0)
    c0 = tl.program_id(1) * 16  # this program's columns c0 .. c0 + 15
    offs = tl.program_id(2) * BK + tl.arange(0, BK)
    base = ic.to(tl.int64) * BT * K
    pos = tl.arange(0, 16)
    cols = c0 + pos
    rows = tl.arange(0, BT)
    end = c0 + 16  # the first row after the block
    g_rows = tl.load(g + base + rows[:, None] * K + offs[None, :], mask=(rows >= end)[:, None], other=0.0)
    xe = tl.where((rows >= end)[:, None], tl.exp(tl.cumsum(g_rows, 0)), 0.0)
    g_next = tl.load(g + base + tl.minimum(cols + 1, BT - 1)[:, None] * K + offs[None, :],
                     mask=(pos < 15)[:, None], other=0.0)
    ye = tl.exp(tl.cumsum(g_next, 0, reverse=True))
    y_all = tl.load(y + base + rows[:, None] * K + offs[None, :]).to(tl.float32)
    p_M = M + ic.to(tl.int64) * BT * BT
    m_cols = tl.load(p_M + rows[:, None] * BT + cols[None, :])  # [BT, 16]: M's columns of the block
    m_off = tl.where((rows >= end)[:, None], m_cols, 0.0)
    acc = tl.dot(tl.trans(m_off), y_all * xe, input_precision="ieee") * ye
    # the block's own rows, exactly: row p of the block for its columns j < p; run_j = g of rows j+1..p
    run = tl.zeros([16, BK], dtype=tl.float32)
    for p in range(16):
        g_p = tl.load(g + base + (c0 + p) * K + offs)
        run += tl.where((pos < p)[:, None], g_p[None, :], 0.0)
        y_p = tl.load(y + base + (c0 + p) * K + offs).to(tl.float32)
        m_p = tl.load(p_M + (c0 + p) * BT + cols)
        acc += tl.where((pos < p)[:, None], m_p[:, None] * y_p[None, :] * tl.exp(run), 0.0)
    tl.store(out + base + cols[:, None] * K + offs[None, :], acc)


def products(M: torch.Tensor, y: torch.Tensor, g: torch.Tensor, BK: int = 32, warps: int = 4):
    """M [NC, BT, BT], y [NC, BT, K], g [NC, BT, K] -> (rows, cols) [NC, BT, K] fp32 (the two kernels above)."""
    NC, BT, K = y.shape
    res = []
    for kern in (_rows_prod_rowblock, _cols_prod_colblock):
        out = torch.full((NC, BT, K), float("nan"), device=y.device)
        kern[(NC, BT // 16, K // BK)](M.contiguous(), y.contiguous(), g.contiguous(), out, K=K, BT=BT, BK=BK,
                                      num_warps=warps)
        res.append(out)
    return res


def products_ref(M: torch.Tensor, y: torch.Tensor, g: torch.Tensor):
    """Both sums in float64 from the [NC, BT, BT, K] factors e^{b_i - b_j}, i > j (exponents of the other pairs masked
    before exp)."""
    M, y, g = M.double(), y.double(), g.double()
    BT = y.shape[1]
    b = g.cumsum(1)
    expo = b[:, :, None, :] - b[:, None, :, :]
    strict = torch.ones(BT, BT, dtype=torch.bool).tril(-1)[None, :, :, None].to(y.device)
    E = expo.masked_fill(~strict, float("-inf")).exp()
    return torch.einsum("cij,cjk,cijk->cik", M, y, E), torch.einsum("cij,cik,cijk->cjk", M, y, E)


def check(decay: float, seed: int) -> tuple[float, float]:
    """Relative RMS errors of the rows and cols products against float64 on one random draw."""
    gen = torch.Generator().manual_seed(seed)
    NC, BT, K = 6, 64, 64
    M = torch.randn(NC, BT, BT, generator=gen)
    y = torch.randn(NC, BT, K, generator=gen)
    g = -decay * torch.rand(NC, BT, K, generator=gen)
    return tuple(((a.double() - b).norm() / b.norm()).item() for a, b in zip(products(M, y, g), products_ref(M, y, g)))


def compile_counts(warps: list[int]) -> None:
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from compile_sm90 import compile_one

    sig = {"M": "*fp32", "y": "*bf16", "g": "*fp32", "out": "*fp32", "K": "constexpr", "BT": "constexpr",
           "BK": "constexpr"}
    for kern in (_rows_prod_rowblock, _cols_prod_colblock):
        for bk in (32, 64):
            for w in warps:
                res = compile_one(kern, sig, {"K": 128, "BT": 64, "BK": bk}, w, 1, div16=("M", "y", "g", "out"))
                print(f"{kern.__name__} BK {bk} warps {w}: regs {res['regs']}, stack {res['stack']} B, "
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
            e_rows, e_cols = check(decay, seed)
            worst = max(worst, e_rows, e_cols)
            print(f"seed {seed} decay {decay}: rel RMS vs float64 rows {e_rows:.2e}, cols {e_cols:.2e}", flush=True)
    print("PASS" if worst <= 1e-5 else "FAIL", f"worst {worst:.2e} (fp32 bar 1e-5)")
    return 0 if worst <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
