"""Prototype, not used by the library: KDA's two decay products in fla's layout, to count and check them before any
kernel is restructured (BENCHMARKS.md, Next steps of 2026-11-25 06:40).

    rows: out_i = sum_{j < i} M_ij y_j e^{b_i - b_j}     cols: out_j = sum_{i > j} M_ij y_i e^{b_i - b_j}

(per key channel; b the cumulative log-decay of a chunk). The library's kernels (`kda_kernels._rows_prod_blk`,
`_cols_prod_blk`) take a whole chunk per program and form the off-diagonal 16-row blocks by three masked
[BT, BT] x [BT, BK] dots, each computing 16 block pairs for 1-3 useful ones. Here one program takes one 16-row
(rows) or 16-column (cols) block of one chunk and key block: its off-diagonal part is one [16, BT] x [BT, BK] dot
through the block's edge (rows: r = b at the row before the block; cols: r = b at the block's last row; both
factors e^{b_i - r}, e^{r - b_j} <= 1 for any decay, the other pairs masked), its diagonal block the exact pairwise
loop. Every exponent is a direct sum of g (no difference of cumulative sums). Two more ways for the diagonal
blocks, exact at any decay: all 16 x 16 pairs of a block at once as a [16, 16, BK] product (`_diag3d_exps`, a scan
of g down the block; "3d" in the table), in the row-block kernels (D3) and in a copy of the library's whole-chunk
walk with every chunk in one launch and no bound (`_lib3d_products`).

H100, 2026-11-25 18:20 UTC (`--gpu --decay 4 --rep 50`, B4 T4096 H16 K128 bf16, both products): row blocks 1487 us,
row blocks 3d 2592, lib 3d 2224 (4 warps) / 3631 (8), against the library's 16-row dot (DIAG 1) 1120, half blocks
(DIAG 4) 1219, exact (DIAG 2) 2830. fla's layout is slower here than the library's dot launches, so the backward
kernels keep theirs (BENCHMARKS.md, 2026-11-25 fourth session).

Layout here (not the library's): M [NC, BT, BT] fp32, y [NC, BT, K], g [NC, BT, K] fp32 log-decays <= 0, out
[NC, BT, K] fp32, for NC chunks (heads folded in); grid (NC, BT // 16, K // BK).

    TRITON_INTERPRET=1 python scripts/kda_rowblock_proto.py [--decay 30]     (against float64, on the CPU; the
                                                                           library's functions beside it)
    python scripts/kda_rowblock_proto.py --compile [--warps 1,2,4]         (sm_90 registers and stack, no GPU)
    python scripts/kda_rowblock_proto.py --gpu --decay 4                   (CUDA: time both ways, bf16)
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl

from hybridlm.ops.triton import kda_kernels as kk
from hybridlm.ops.triton.gdn_kernels import _op


@triton.jit
def _block_program(K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr):
    """This program's chunk ic, the first row (rows product) or column (cols product) b0 of its 16-wide block, its key
    channels offs, the chunk's offset in y / g / out, and the in-block positions 0..15."""
    ic = tl.program_id(0)
    offs = tl.program_id(2) * BK + tl.arange(0, BK)
    return ic, tl.program_id(1) * 16, offs, ic.to(tl.int64) * BT * K, tl.arange(0, 16)


@triton.jit
def _rows_prod_rowblock(M, y, g, out, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
                        LOWP: tl.constexpr, D3: tl.constexpr = False):
    """out_i = sum_{j < i} M_ij y_j e^{b_i - b_j}, one program per 16-row block I: the columns before the block
    through r = b at the row before it, the block's own columns exactly."""
    ic, r0, offs, base, pos = _block_program(K, BT, BK)  # this program's rows r0 .. r0 + 15
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
    acc = tl.dot(_op(m_off, y.dtype.element_ty, LOWP), _op(y_all * ye, y.dtype.element_ty, LOWP),
                 input_precision=PREC) * xe
    if D3:  # the diagonal block exactly, every pair at once (`_diag3d`)
        acc += _diag3d_rows(tl.load(p_M + rows[:, None] * BT + (r0 + pos)[None, :]),
                            tl.load(y + base + rows[:, None] * K + offs[None, :]).to(tl.float32), g_blk)
        tl.store(out + base + rows[:, None] * K + offs[None, :], acc)
        return
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
def _cols_prod_colblock(M, y, g, out, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
                        LOWP: tl.constexpr, D3: tl.constexpr = False):
    """The transposed product out_j = sum_{i > j} M_ij y_i e^{b_i - b_j}, one program per 16-column block J: the rows
    after the block through r = b at its last row (e^{b_i - r} = e^{g of rows 16 J + 16 .. i}, e^{r - b_j} = e^{g of
    rows j+1 .. 16 J + 15}, both <= 1), the block's own rows exactly."""
    ic, c0, offs, base, pos = _block_program(K, BT, BK)  # this program's columns c0 .. c0 + 15
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
    acc = tl.dot(tl.trans(_op(m_off, y.dtype.element_ty, LOWP)), _op(y_all * xe, y.dtype.element_ty, LOWP),
                 input_precision=PREC) * ye
    if D3:  # the block's own rows exactly, every pair at once (`_diag3d`)
        g_own = tl.load(g + base + cols[:, None] * K + offs[None, :])
        acc += _diag3d_cols(tl.load(p_M + cols[:, None] * BT + cols[None, :]),
                            tl.load(y + base + cols[:, None] * K + offs[None, :]).to(tl.float32), g_own)
        tl.store(out + base + cols[:, None] * K + offs[None, :], acc)
        return
    # the block's own rows, exactly: row p of the block for its columns j < p; run_j = g of rows j+1..p
    run = tl.zeros([16, BK], dtype=tl.float32)
    for p in range(16):
        g_p = tl.load(g + base + (c0 + p) * K + offs)
        run += tl.where((pos < p)[:, None], g_p[None, :], 0.0)
        y_p = tl.load(y + base + (c0 + p) * K + offs).to(tl.float32)
        m_p = tl.load(p_M + (c0 + p) * BT + cols)
        acc += tl.where((pos < p)[:, None], m_p[:, None] * y_p[None, :] * tl.exp(run), 0.0)
    tl.store(out + base + cols[:, None] * K + offs[None, :], acc)


@triton.jit
def _diag3d_exps(g16):
    """E [16, 16, BK] = e^{b_i - b_j} for i > j of one 16-row block (0 elsewhere) from its g [16, BK]: every exponent a
    direct sum of g over rows j+1..i, by one scan down axis 0 of [i, j, k] = g_i where i > j (no difference of
    cumulative sums, so exact as the pairwise loop is); all pairs at once instead of 16 dependent steps."""
    i = tl.arange(0, 16)[:, None, None]
    j = tl.arange(0, 16)[None, :, None]
    D = tl.cumsum(tl.where(i > j, g16[:, None, :], 0.0), 0)
    return tl.exp(tl.where(i > j, D, float("-inf")))


@triton.jit
def _diag3d_rows(m16, y16, g16):
    """out_i = sum_{j < i} m_ij y_j e^{b_i - b_j} within one 16-row block: m16 [16, 16], y16 / g16 [16, BK]."""
    return tl.sum(m16[:, :, None] * y16[None, :, :] * _diag3d_exps(g16), 1)


@triton.jit
def _diag3d_cols(m16, y16, g16):
    """out_j = sum_{i > j} m_ij y_i e^{b_i - b_j} within one 16-row block (the transposed partner)."""
    return tl.sum(m16[:, :, None] * y16[:, None, :] * _diag3d_exps(g16), 0)


@triton.jit
def _lib3d_products(M, y, g, out_r, out_c, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
                    LOWP: tl.constexpr):
    """Both sums per chunk as the library's kernels walk them (one program per chunk, key blocks in a loop, the
    off-diagonal blocks by `kda_kernels._off_parts` and three masked dots each), but the diagonal 16-row blocks by
    `_diag3d_rows` / `_diag3d_cols`, one block at a time, for any decay: no dot bound, so no marks and one launch."""
    ic = tl.program_id(0)
    rows = tl.arange(0, BT)
    c16 = tl.arange(0, 16)
    base = ic.to(tl.int64) * BT * K
    Mt = tl.load(M + ic.to(tl.int64) * BT * BT + rows[:, None] * BT + rows[None, :])
    Mt = tl.where(rows[:, None] > rows[None, :], Mt, 0.0)
    DT: tl.constexpr = y.dtype.element_ty
    for k0 in range(0, K, BK):
        offs = k0 + tl.arange(0, BK)
        gg = tl.load(g + base + rows[:, None] * K + offs[None, :])
        gn = tl.load(g + base + (rows + 1)[:, None] * K + offs[None, :], mask=(rows < BT - 1)[:, None], other=0.0)
        yr = tl.load(y + base + rows[:, None] * K + offs[None, :]).to(tl.float32)
        x1 = tl.zeros([BT, BK], dtype=tl.float32)
        x2 = tl.zeros([BT, BK], dtype=tl.float32)
        E, Yf, Tb = kk._off_parts(gg, gn, BT)
        for cb in tl.static_range(BT // 16 - 1):
            xe, ye = kk._off_exps_from(E, Yf, Tb, cb, BT)
            x1 += tl.dot(_op(Mt, DT, LOWP), _op(yr * ye, DT, LOWP), input_precision=PREC) * xe
            x2 += tl.dot(tl.trans(_op(Mt, DT, LOWP)), _op(yr * xe, DT, LOWP), input_precision=PREC) * ye
        tl.store(out_r + base + rows[:, None] * K + offs[None, :], x1)
        tl.store(out_c + base + rows[:, None] * K + offs[None, :], x2)
        tl.debug_barrier()
        for n in tl.static_range(BT // 16):  # the diagonal blocks, their tiles read back from memory (L1)
            r16 = n * 16 + c16
            m16 = tl.load(M + ic.to(tl.int64) * BT * BT + r16[:, None] * BT + r16[None, :])
            m16 = tl.where(c16[:, None] > c16[None, :], m16, 0.0)
            y16 = tl.load(y + base + r16[:, None] * K + offs[None, :]).to(tl.float32)
            g16 = tl.load(g + base + r16[:, None] * K + offs[None, :])
            E3 = _diag3d_exps(g16)
            p_r = out_r + base + r16[:, None] * K + offs[None, :]
            p_c = out_c + base + r16[:, None] * K + offs[None, :]
            tl.store(p_r, tl.load(p_r) + tl.sum(m16[:, :, None] * y16[None, :, :] * E3, 1))
            tl.store(p_c, tl.load(p_c) + tl.sum(m16[:, :, None] * y16[:, None, :] * E3, 0))


def lib3d_products(M: torch.Tensor, y: torch.Tensor, g: torch.Tensor, BK: int = 32, warps: int = 8,
                   prec: str = "ieee", lowp: bool = False):
    """(rows, cols) by `_lib3d_products`."""
    NC, BT, K = y.shape
    res = [torch.full((NC, BT, K), float("nan"), device=y.device) for _ in range(2)]
    _lib3d_products[(NC,)](M.contiguous(), y.contiguous(), g.contiguous(), *res, K=K, BT=BT, BK=BK, PREC=prec,
                           LOWP=lowp, num_warps=warps)
    return res


@triton.jit
def _lib_products(M, y, g, out_r, out_c, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
                  LOWP: tl.constexpr, DIAG: tl.constexpr):
    """The same two sums by the library's per-chunk functions (`kda_kernels._rows_prod_blk`, `_cols_prod_blk`), in
    the diagonal mode DIAG (1: the 16-row dot, valid only within its bound; 4: half blocks; 2: exact), one program
    per chunk walking the key blocks, as the backward kernels call them. y and g as one sequence of NC * BT rows,
    one head."""
    ic = tl.program_id(0)
    bos = ic * BT
    rows = tl.arange(0, BT)
    r64 = (bos + rows).to(tl.int64)
    Mt = tl.load(M + ic.to(tl.int64) * BT * BT + rows[:, None] * BT + rows[None, :])
    Mt = tl.where(rows[:, None] > rows[None, :], Mt, 0.0)  # the library's callers pass M strictly lower
    band_r = kk._diag_band(Mt, BT, DIAG)
    band_c = kk._diag_band(tl.trans(Mt), BT, DIAG)
    DT: tl.constexpr = y.dtype.element_ty
    for k0 in range(0, K, BK):
        offs = k0 + tl.arange(0, BK)
        gg, gn = kk._g_blk(g, r64, BT, 0, 1, K, k0, BK, BT)
        yr = tl.load(y + r64[:, None] * K + offs[None, :]).to(tl.float32)
        x1 = kk._rows_prod_blk(Mt, band_r, yr, gg, gn, y, g, bos, BT, 0, K, k0, 1, K, k0, BK, BT, True, PREC, DT,
                               LOWP, DIAG)
        x2 = kk._cols_prod_blk(Mt, band_c, yr, gg, gn, y, g, bos, BT, 0, K, k0, 1, K, k0, BK, BT, True, PREC, DT,
                               LOWP, DIAG)
        tl.store(out_r + r64[:, None] * K + offs[None, :], x1)
        tl.store(out_c + r64[:, None] * K + offs[None, :], x2)


def lib_products(M: torch.Tensor, y: torch.Tensor, g: torch.Tensor, diag: int, BK: int = 32, warps: int = 8,
                 prec: str = "ieee", lowp: bool = False):
    """(rows, cols) by `_lib_products` (8 warps and key block 32: the backward kernels' launch)."""
    NC, BT, K = y.shape
    res = [torch.full((NC, BT, K), float("nan"), device=y.device) for _ in range(2)]
    _lib_products[(NC,)](M.contiguous(), y.contiguous(), g.contiguous(), *res, K=K, BT=BT, BK=BK, PREC=prec,
                         LOWP=lowp, DIAG=diag, num_warps=warps)
    return res


def products(M: torch.Tensor, y: torch.Tensor, g: torch.Tensor, BK: int = 32, warps: int = 4, prec: str = "ieee",
             lowp: bool = False, d3: bool = False):
    """M [NC, BT, BT], y [NC, BT, K], g [NC, BT, K] -> (rows, cols) [NC, BT, K] fp32 (the two kernels above; lowp:
    the off-diagonal dot's operands in y's 16-bit dtype, as the library's backward with bf16 inputs)."""
    NC, BT, K = y.shape
    res = []
    for kern in (_rows_prod_rowblock, _cols_prod_colblock):
        out = torch.full((NC, BT, K), float("nan"), device=y.device)
        kern[(NC, BT // 16, K // BK)](M.contiguous(), y.contiguous(), g.contiguous(), out, K=K, BT=BT, BK=BK,
                                      PREC=prec, LOWP=lowp, D3=d3, num_warps=warps)
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


def draw(decay: float, seed: int, NC: int = 6, BT: int = 64, K: int = 64, device="cpu", dtype=torch.float32):
    gen = torch.Generator(device=device).manual_seed(seed)
    M = torch.randn(NC, BT, BT, generator=gen, device=device)
    y = torch.randn(NC, BT, K, generator=gen, device=device).to(dtype)
    g = -decay * torch.rand(NC, BT, K, generator=gen, device=device)
    return M, y, g


def errors(got, M, y, g) -> tuple[float, float]:
    return tuple(((a.double() - b).norm() / b.norm()).item() for a, b in zip(got, products_ref(M, y, g)))


def check(decay: float, seed: int) -> dict:
    """Relative RMS errors of (rows, cols) against float64 on one draw: the prototype, and the library's functions in
    each diagonal mode whose bound the draw meets (the 16-row dot only below ~7 a step)."""
    M, y, g = draw(decay, seed)
    res = {"rowblock": errors(products(M, y, g), M, y, g), "rowblock 3d": errors(products(M, y, g, d3=True), M, y, g),
           "lib 3d": errors(lib3d_products(M, y, g), M, y, g)}
    for diag in ((1, 4, 2) if decay <= 4 else (2,)):
        res[f"lib DIAG {diag}"] = errors(lib_products(M, y, g, diag), M, y, g)
    return res


def compile_counts(warps: list[int]) -> None:
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from compile_sm90 import compile_one

    sig = {"M": "*fp32", "y": "*bf16", "g": "*fp32", "out": "*fp32", "K": "constexpr", "BT": "constexpr",
           "BK": "constexpr", "PREC": "constexpr", "LOWP": "constexpr"}
    # the bf16 backward's dots (tf32, the off-diagonal operands in 16 bits) and the fp32 inputs' (IEEE fp32)
    for prec, lowp in (("tf32", True), ("ieee", False)):
        for kern in (_rows_prod_rowblock, _cols_prod_colblock):
            for bk in (32, 64):
                for w in warps:
                    cx = {"K": 128, "BT": 64, "BK": bk, "PREC": prec, "LOWP": lowp}
                    res = compile_one(kern, sig, cx, w, 1, div16=("M", "y", "g", "out"))
                    print(f"{kern.__name__} {prec}{' 16-bit' if lowp else ''} BK {bk} warps {w}: regs {res['regs']}, "
                          f"stack {res['stack']} B, shared {res['shared'] / 1024:.1f} KB", flush=True)


def gpu_time(decay: float, rep: int) -> None:
    """On CUDA: both products at B4 T4096 H16 K128 (4096 chunks) in bf16 with log-decays uniform in [-decay, 0), the
    prototype against the library's functions in each diagonal mode, as the bf16 backward runs them (tf32 dots,
    16-bit off-diagonal operands); errors against float64 on the first 32 chunks first."""
    from triton.testing import do_bench

    M, y, g = draw(decay, 0, NC=4096, K=128, device="cuda", dtype=torch.bfloat16)
    variants = {"rowblock (4 warps)": lambda: products(M, y, g, prec="tf32", lowp=True),
                "rowblock 3d (4 warps)": lambda: products(M, y, g, prec="tf32", lowp=True, d3=True),
                "rowblock 3d BK 16": lambda: products(M, y, g, BK=16, prec="tf32", lowp=True, d3=True),
                "lib 3d (8 warps)": lambda: lib3d_products(M, y, g, prec="tf32", lowp=True),
                "lib 3d (4 warps)": lambda: lib3d_products(M, y, g, warps=4, prec="tf32", lowp=True)}
    for diag in (1, 4, 2):
        variants[f"lib DIAG {diag} (8 warps)"] = lambda d=diag: lib_products(M, y, g, d, prec="tf32", lowp=True)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, decay {decay}")
    for name, fn in variants.items():
        got = [x[:32] for x in fn()]
        e = errors(got, M[:32], y[:32], g[:32])
        ms = do_bench(fn, rep=rep)
        print(f"{name:<22} {ms * 1e3:8.1f} us   rel RMS rows {e[0]:.2e} cols {e[1]:.2e}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decay", type=float, default=30.0, help="log-decays uniform in [-decay, 0) a step and channel")
    ap.add_argument("--seeds", type=int, default=2, help="how many random draws to check")
    ap.add_argument("--compile", action="store_true", help="print sm_90 register counts instead of checking")
    ap.add_argument("--warps", default="1,2,4", help="num_warps values for --compile")
    ap.add_argument("--gpu", action="store_true",
                    help="time the prototype against the library's functions on CUDA (--decay 4: every mode valid)")
    ap.add_argument("--rep", type=int, default=100, help="do_bench rep in ms for --gpu")
    args = ap.parse_args(argv)
    if args.gpu:
        gpu_time(args.decay, args.rep)
        return 0
    if args.compile:
        compile_counts([int(w) for w in args.warps.split(",")])
        return 0
    worst = 0.0
    for seed in range(args.seeds):
        for decay in (0.1, 4.0, args.decay):
            for name, (e_rows, e_cols) in check(decay, seed).items():
                worst = max(worst, e_rows, e_cols)
                print(f"seed {seed} decay {decay} {name:<11}: rel RMS vs float64 rows {e_rows:.2e}, cols {e_cols:.2e}",
                      flush=True)
    print("PASS" if worst <= 1e-5 else "FAIL", f"worst {worst:.2e} (fp32 bar 1e-5)")
    return 0 if worst <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
