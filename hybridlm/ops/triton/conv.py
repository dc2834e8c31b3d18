"""Triton causal depthwise conv1d (+ SiLU) over time: training/prefill forward and backward, and the decode step.

Same contract as `hybridlm.ops.causal_conv1d` / `causal_conv1d_update` (x: [B, T, C], weight [C, W] with
`weight[:, W-1]` on the current token, state = the last W inputs [N, C, W]). Non-standard here:
- varlen: `cu_seqlens` [N+1] packs N documents in one row (B == 1); every document starts from its own
  initial state (zeros when none is given, as `hybridlm.layers.ShortConv` convolves documents one by one), so the
  conv never reads across a document boundary; final states are per document [N, C, W]. The offsets are read on
  the host once per call (checked: 0 to T, non-decreasing), as the reference's per-document loop does.
- Arithmetic is fp32; the weight, bias and initial state are first rounded to x's dtype (the reference casts
  them to x.dtype before its conv).
- The forward saves nothing of size [B, T, C] but its inputs. The backward is one kernel whose programs each walk a
  token range of one document in blocks taken as four phases (rows t, t+4, t+8, ... of a block in one tile): then
  dx_t = sum_s w[:, W-1-s] * dpre_{t+s}, dpre = dy * act'(pre), adds whole tiles with no shifted rows. Each tile's
  dpre is computed once from the block's inputs, read once; only the W-1 rows after a block are computed twice
  (the 357M layer's conv on an H200: 165 us against 282 for a serial walk keeping shifted rows in a global ring).
  dweight/dbias are per-program fp32 partials, added up on the host (deterministic, no atomics). Gradients flow
  to x, weight, bias and initial_state; the returned final state is not differentiable.
- `causal_conv1d_update(..., state_indices=)` reads and writes rows of a conv-state pool [P, C, W] in place, like
  `fused_recurrent_gated_delta_rule_update` does for the recurrent state.
- `causal_conv1d(..., split=(C0, C1, C2))` writes y as three tensors (a layer's q, k, v) and reads their gradients
  as they are: each program's channel block lies in one part (`split_block`), whose base pointer, row stride and
  first channel it picks once (`_part`).
Custom ops: `hybridlm::conv_fwd`, `hybridlm::conv_bwd`, `hybridlm::conv_fwd_split`, `hybridlm::conv_bwd_split`,
`hybridlm::conv_decode` (mutates the pool).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..offsets import host_offsets
from .custom import call, custom_op
from .tune import LaunchTable, cdiv, next_pow2

MAX_W = 8  # kernel widths 1..MAX_W (Qwen3-Next / Kimi / OLMo use 4)
POISON = False  # tests set this: outputs start as NaN so an unwritten element shows
BC = 64  # channel block of the final-state and decode kernels


@dataclass
class ConvLaunch(LaunchTable):
    """Launch settings of the conv kernels (`scripts/gpu_check_glue.py --sweep-conv` times alternatives)."""

    fwd_bt: int = 16  # forward token block: 16 x 256 at 4 warps was the fastest forward tried on an H100
    fwd_bc: int = 256  # forward channel block; a split output takes the largest power of two <= it dividing C0, C1
    fwd_warps: int = 4  # 8 was slower where both were timed (64 x 64 blocks: 0.447 against 0.320 ms)
    # backward times: H200, the 357M layer's conv ([1, 16384, 3072] bf16 split 1024 x 3, W4, SiLU, 16 documents)
    bwd_bt: int = 32  # backward token block, four phases of bt / 4 rows (a power of two >= 4): 165 us against 229 at 64
    bwd_bc: int = 64  # backward channel block (a split may take less): 165 us against 196 at 128
    bwd_warps: int = 4  # backward warps: (at bt 64) 229 us against 218 at 8
    bwd_chunk: int = 512  # tokens a backward program walks (a multiple of bwd_bt): (at bt 64) 229 us against 282 at 256

TUNE = ConvLaunch()


# ----------------------------------------------------------------------------------------------------- kernels


@triton.jit
def _load_hist(x, h0, bos, L, i_n, pos, o_c, m_c, C, W: tl.constexpr, HAS_H0: tl.constexpr):
    """Input at in-document positions pos [R] for channels o_c [BC] -> [R, BC] fp32. pos < 0 reads the initial
    state (column W + pos), or 0 without one; pos >= L reads 0."""
    m_in = (pos >= 0) & (pos < L)
    p_x = x + (bos + pos)[:, None] * C + o_c[None, :]
    b_x = tl.load(p_x, mask=m_in[:, None] & m_c[None, :], other=0.0).to(tl.float32)
    if HAS_H0:
        m_h = (pos < 0) & (pos >= -W)
        p_h = h0 + i_n.to(tl.int64) * C * W + o_c[None, :] * W + (W + pos)[:, None]
        b_h = tl.load(p_h, mask=m_h[:, None] & m_c[None, :], other=0.0)
        b_x += b_h.to(x.dtype.element_ty).to(tl.float32)  # the reference casts the state to x's dtype
    return b_x


@triton.jit
def _pre_act(x, w, bias, h0, bos, L, i_n, pos, o_c, m_c, C, W: tl.constexpr, HAS_BIAS: tl.constexpr,
             HAS_H0: tl.constexpr):
    """bias + sum_i w[:, i] * x_{pos-(W-1)+i} -> [R, BC] fp32 (weight and bias rounded to x's dtype)."""
    b_y = tl.zeros([pos.shape[0], o_c.shape[0]], dtype=tl.float32)
    if HAS_BIAS:
        b_y += tl.load(bias + o_c, mask=m_c, other=0.0).to(x.dtype.element_ty).to(tl.float32)[None, :]
    for i in tl.static_range(W):
        b_w = tl.load(w + o_c * W + i, mask=m_c, other=0.0).to(x.dtype.element_ty).to(tl.float32)
        b_y += b_w[None, :] * _load_hist(x, h0, bos, L, i_n, pos - (W - 1) + i, o_c, m_c, C, W, HAS_H0)
    return b_y


@triton.jit
def _dpre(x, w, bias, h0, dy, dys, dyc, bos, L, i_n, pos, o_c, m_c, C, W: tl.constexpr, HAS_BIAS: tl.constexpr,
          HAS_H0: tl.constexpr, SILU: tl.constexpr):
    """dpre = dy * act'(pre) at in-document positions pos [R] -> [R, BC] fp32 (0 outside 0..L-1), pre recomputed.
    dy: the gradient's base pointer, dys its row stride, dyc the channel its column 0 holds (`_part`)."""
    m = ((pos >= 0) & (pos < L))[:, None] & m_c[None, :]
    b_dp = tl.load(dy + (bos + pos)[:, None] * dys + (o_c - dyc)[None, :], mask=m, other=0.0).to(tl.float32)
    if SILU:
        b_dp = _silu_grad(b_dp, _pre_act(x, w, bias, h0, bos, L, i_n, pos, o_c, m_c, C, W, HAS_BIAS, HAS_H0))
    return b_dp


@triton.jit
def _silu_grad(dy, pre):
    """dy * silu'(pre), fp32."""
    sg = tl.sigmoid(pre)
    return dy * sg * (1.0 + pre * (1.0 - sg))


@triton.jit
def _dx_recompute(x, w, bias, h0, dy, dys, dyc, bos, L, i_n, pos, o_c, m_c, C, W: tl.constexpr,
                  HAS_BIAS: tl.constexpr, HAS_H0: tl.constexpr, SILU: tl.constexpr):
    """(dx, dpre) at positions pos [R]: dx = sum_s w[:, W-1-s] * dpre_{pos+s} with every dpre recomputed from x
    and dy (no [T, C] scratch), dpre at pos itself for the weight's gradient; the weight is rounded to x's dtype
    as in the forward."""
    DT = x.dtype.element_ty
    b_dp = _dpre(x, w, bias, h0, dy, dys, dyc, bos, L, i_n, pos, o_c, m_c, C, W, HAS_BIAS, HAS_H0, SILU)
    b_w = tl.load(w + o_c * W + (W - 1), mask=m_c, other=0.0).to(DT).to(tl.float32)
    b_dx = b_w[None, :] * b_dp
    for s in tl.static_range(1, W):
        b_w = tl.load(w + o_c * W + (W - 1 - s), mask=m_c, other=0.0).to(DT).to(tl.float32)
        b_dx += b_w[None, :] * _dpre(x, w, bias, h0, dy, dys, dyc, bos, L, i_n, pos + s, o_c, m_c, C, W, HAS_BIAS,
                                     HAS_H0, SILU)
    return b_dx, b_dp


@triton.jit
def _part(p0, p1, p2, c0, C0, C1, C, SPLIT: tl.constexpr):
    """Where channel c0 (a program's first; its channel block lies in one part) lives when the C channels are kept
    as three tensors of C0, C1 and C - C0 - C1 channels (SPLIT: q, k and v of a layer) instead of one (p0):
    (that part's base pointer, its row stride, the channel its column 0 holds)."""
    p, stride, first = p0, C + 0 * C0, 0 * C0
    if SPLIT:
        p, stride = p0, C0
        if c0 >= C0:
            p, stride, first = p1, C1, C0
        if c0 >= C0 + C1:
            p, stride, first = p2, C - C0 - C1, C0 + C1
    return p, stride, first


@triton.jit
def _conv_fwd(x, w, bias, h0, y, y1, y2, cu, C, C0, C1, W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
              HAS_BIAS: tl.constexpr, HAS_H0: tl.constexpr, SILU: tl.constexpr, SPLIT: tl.constexpr = False):
    """Grid (C / BC, max document length / BT, N): one [BT, BC] block of one document. SPLIT: y is written as three
    tensors y, y1, y2 of C0, C1 and C - C0 - C1 channels (`_part`; BC divides C0 and C1)."""
    i_c, i_t, i_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos = tl.load(cu + i_n).to(tl.int64)
    L = tl.load(cu + i_n + 1).to(tl.int64) - bos
    o_t = i_t * BT + tl.arange(0, BT)
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    b_y = _pre_act(x, w, bias, h0, bos, L, i_n, o_t, o_c, m_c, C, W, HAS_BIAS, HAS_H0)
    if SILU:
        b_y = b_y * tl.sigmoid(b_y)
    yp, ys, yc = _part(y, y1, y2, i_c * BC, C0, C1, C, SPLIT)
    p_y = yp + (bos + o_t)[:, None] * ys + (o_c - yc)[None, :]
    tl.store(p_y, b_y.to(y.dtype.element_ty), mask=(o_t < L)[:, None] & m_c[None, :])


@triton.jit
def _conv_final_state(x, h0, ht, cu, C, W: tl.constexpr, WP: tl.constexpr, BC: tl.constexpr,
                      HAS_H0: tl.constexpr):
    """Grid (C / BC, N): ht[n, :, j] = input at position L - W + j (from the initial state when < 0)."""
    i_c, i_n = tl.program_id(0), tl.program_id(1)
    bos = tl.load(cu + i_n).to(tl.int64)
    L = tl.load(cu + i_n + 1).to(tl.int64) - bos
    o_j = tl.arange(0, WP)
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    b_s = _load_hist(x, h0, bos, L, i_n, L - W + o_j, o_c, m_c, C, W, HAS_H0)  # [WP, BC]
    p_s = ht + i_n.to(tl.int64) * C * W + o_c[None, :] * W + o_j[:, None]
    tl.store(p_s, b_s.to(ht.dtype.element_ty), mask=(o_j < W)[:, None] & m_c[None, :])


@triton.jit
def _conv_bwd(x, w, bias, h0, dy, dy1, dy2, dx, dwp, dbp, cu, C, C0, C1, NS, CH, W: tl.constexpr,
              WP: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, HAS_BIAS: tl.constexpr,
              HAS_H0: tl.constexpr, SILU: tl.constexpr, SPLIT: tl.constexpr = False):
    """Grid (C / BC, NS, N): program (c, s, n) takes tokens [s * CH, (s + 1) * CH) of document n (CH a multiple of
    BT) in blocks of BT = 4 R rows, each block as four phases: phase p holds rows t0 + 4 k + p (k < R), so that
    dx_t = sum_s w[:, W-1-s] * dpre_{t+s} needs no shifted rows. A block reads its inputs as 2 W + 2 tiles [R, BC]
    (tile m: rows t0 + 4 k + m - (W - 1)) once; then for j < W + 3 the dpre = dy * act'(pre) of rows t0 + 4 k + j
    is one tile, made once from tiles j.. j + W - 1, and adds w[:, W-1-(j-p)] times itself to phase p's dx for
    every p with 0 <= j - p < W. The W - 1 tiles past the block's four phases are the only recomputed dpre (the
    next block's rows). No scratch, no barrier, no order between blocks. Partial dweight [BC, W] / dbias [BC] sums
    (elementwise [R, BC] accumulators, summed over rows once at the end) go to row n * NS + s of dwp [N * NS, C, W]
    / dbp [N * NS, C] (programs past their document's end write zeros). SPLIT: dy comes as three tensors dy, dy1,
    dy2 (`_part`)."""
    i_c, i_s, i_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    DT = x.dtype.element_ty
    R: tl.constexpr = BT // 4
    dyp, dys, dyc = _part(dy, dy1, dy2, i_c * BC, C0, C1, C, SPLIT)
    bos = tl.load(cu + i_n).to(tl.int64)
    L = tl.load(cu + i_n + 1).to(tl.int64) - bos
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    o_j = tl.arange(0, WP)
    o_k = 4 * tl.arange(0, R)
    i_p = (i_n * NS + i_s).to(tl.int64)
    c0 = i_s * CH
    nb = tl.cdiv(tl.minimum(c0 + CH, L) - c0, BT)  # blocks of this program; <= 0 past the document's end
    taps = ()  # the weight's columns [1, BC], rounded to x's dtype as the forward rounds them
    sums = ()  # dweight's elementwise partial sums, a tap each
    for i in tl.static_range(W):
        taps = taps + (tl.load(w + o_c * W + i, mask=m_c, other=0.0).to(DT).to(tl.float32)[None, :],)
        sums = sums + (tl.zeros([R, BC], dtype=tl.float32),)
    b_bias = tl.zeros([1, BC], dtype=tl.float32)
    if HAS_BIAS:
        b_bias += tl.load(bias + o_c, mask=m_c, other=0.0).to(DT).to(tl.float32)[None, :]
    b_ab = tl.zeros([R, BC], dtype=tl.float32)
    for b in range(0, nb):
        base = c0 + b * BT + o_k
        xs = ()
        for m in tl.static_range(2 * W + 2):
            xs = xs + (_load_hist(x, h0, bos, L, i_n, base + m - (W - 1), o_c, m_c, C, W, HAS_H0),)
        dxs = ()  # the four phases' dx
        for _ in tl.static_range(4):
            dxs = dxs + (tl.zeros([R, BC], dtype=tl.float32),)
        for j in tl.static_range(W + 3):
            pos = base + j
            m = ((pos >= 0) & (pos < L))[:, None] & m_c[None, :]
            b_dp = tl.load(dyp + (bos + pos)[:, None] * dys + (o_c - dyc)[None, :], mask=m, other=0.0)
            b_dp = b_dp.to(tl.float32)
            if SILU:
                b_p = b_bias + taps[0] * xs[j]
                for i in tl.static_range(1, W):
                    b_p += taps[i] * xs[j + i]
                b_dp = _silu_grad(b_dp, b_p)
            if j < 4:  # one of the block's own rows: the weight's and bias's sums
                b_ab += b_dp
                acc = ()
                for i in tl.static_range(W):
                    acc = acc + (sums[i] + b_dp * xs[j + i],)
                sums = acc
            acc = ()
            for p in tl.static_range(4):
                if p <= j and j - p < W:
                    acc = acc + (dxs[p] + taps[W - 1 - (j - p)] * b_dp,)
                else:
                    acc = acc + (dxs[p],)
            dxs = acc
        p_dx = dx + (bos + base)[:, None] * C + o_c[None, :]
        for p in tl.static_range(4):
            tl.store(p_dx + p * C, dxs[p].to(dx.dtype.element_ty), mask=(base + p < L)[:, None] & m_c[None, :])
    b_dw = tl.zeros([BC, WP], dtype=tl.float32)
    for i in tl.static_range(W):
        b_dw += tl.where(o_j[None, :] == i, tl.sum(sums[i], 0)[:, None], 0.0)
    tl.store(dwp + i_p * C * W + o_c[:, None] * W + o_j[None, :], b_dw, mask=m_c[:, None] & (o_j < W)[None, :])
    if HAS_BIAS:
        tl.store(dbp + i_p * C + o_c, tl.sum(b_ab, 0), mask=m_c)


@triton.jit
def _conv_bwd_h0(x, w, bias, h0, dy, dy1, dy2, dh0, cu, C, C0, C1, W: tl.constexpr, WP: tl.constexpr,
                 BC: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, SPLIT: tl.constexpr = False):
    """Grid (C / BC, N): dh0[n, :, j] = gradient of the input at position j - W (column 0 is never read: 0), from
    dpre recomputed."""
    i_c, i_n = tl.program_id(0), tl.program_id(1)
    bos = tl.load(cu + i_n).to(tl.int64)
    L = tl.load(cu + i_n + 1).to(tl.int64) - bos
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    o_j = tl.arange(0, WP)
    dyp, dys, dyc = _part(dy, dy1, dy2, i_c * BC, C0, C1, C, SPLIT)
    b_dh, _ = _dx_recompute(x, w, bias, h0, dyp, dys, dyc, bos, L, i_n, o_j - W, o_c, m_c, C, W, HAS_BIAS, True, SILU)
    p_dh = dh0 + i_n.to(tl.int64) * C * W + o_c[None, :] * W + o_j[:, None]
    tl.store(p_dh, b_dh.to(dh0.dtype.element_ty), mask=(o_j < W)[:, None] & m_c[None, :])


@triton.jit
def _conv_decode(x, state, idx, w, bias, y, C, W: tl.constexpr, WP: tl.constexpr, BC: tl.constexpr,
                 HAS_IDX: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    """Grid (C / BC, N): shift state row idx[n] left by one, append x[n], y[n] = act(bias + <state, w>)."""
    i_c, i_n = tl.program_id(0), tl.program_id(1)
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    o_j = tl.arange(0, WP)
    if HAS_IDX:
        i_r = tl.load(idx + i_n).to(tl.int64)
    else:
        i_r = i_n.to(tl.int64)
    p_s = state + i_r * C * W + o_c[:, None] * W + o_j[None, :]
    m_s = m_c[:, None] & (o_j < W)[None, :]
    b_s = tl.load(p_s + 1, mask=m_c[:, None] & (o_j + 1 < W)[None, :], other=0.0)  # columns 1.. moved left
    b_x = tl.load(x + i_n.to(tl.int64) * C + o_c, mask=m_c, other=0.0)
    b_s = tl.where(o_j[None, :] == W - 1, b_x.to(state.dtype.element_ty)[:, None], b_s)
    tl.store(p_s, b_s, mask=m_s)
    DT = x.dtype.element_ty
    b_w = tl.load(w + o_c[:, None] * W + o_j[None, :], mask=m_s, other=0.0).to(DT).to(tl.float32)
    b_y = tl.sum(b_s.to(DT).to(tl.float32) * b_w, 1)
    if HAS_BIAS:
        b_y += tl.load(bias + o_c, mask=m_c, other=0.0).to(DT).to(tl.float32)
    if SILU:
        b_y = b_y * tl.sigmoid(b_y)
    tl.store(y + i_n.to(tl.int64) * C + o_c, b_y.to(y.dtype.element_ty), mask=m_c)


# ------------------------------------------------------------------------------------------------------- host


def _out(shape, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if POISON:
        return torch.full(shape, float("nan"), device=like.device, dtype=dtype)
    return torch.empty(shape, device=like.device, dtype=dtype)


def _layout(x: torch.Tensor, cu_seqlens: torch.Tensor | None) -> tuple[torch.Tensor, int, int]:
    """(cu int32 [N+1] on x's device, N, longest document). Without cu_seqlens no host sync is needed."""
    B, T, _ = x.shape
    if cu_seqlens is None:
        return torch.arange(0, (B + 1) * T, max(T, 1), device=x.device, dtype=torch.int32)[: B + 1], B, T
    bounds = host_offsets(cu_seqlens)  # one host sync per offsets tensor (hybridlm.ops.offsets), none if registered
    cu = cu_seqlens.to(device=x.device, dtype=torch.int32)
    if bounds[0] != 0 or bounds[-1] != T or any(e < s for s, e in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens: expected non-decreasing offsets from 0 to T={T}, got {bounds}")
    return cu, len(bounds) - 1, max(e - s for s, e in zip(bounds, bounds[1:]))


def split_block(C0: int, C1: int, bc: int) -> int:
    """The channel block of a launch that writes or reads q, k, v as three tensors of C0, C1 and C - C0 - C1
    channels: the largest power of two <= bc (and >= 16) dividing C0 and C1, so that no block straddles two of
    them; 0 when there is none (the caller then keeps one tensor)."""
    while bc >= 16:
        if C0 % bc == 0 and C1 % bc == 0:
            return bc
        bc //= 2
    return 0


def _fwd_launch(x, weight, bias, initial_state, cu_seqlens, silu: bool, output_final_state: bool, ys, C0: int,
                C1: int) -> torch.Tensor:
    """The forward into ys (one [B, T, C] tensor, or with C0 > 0 three of C0, C1 and C - C0 - C1 channels);
    returns the final state [N, C, W] (or an empty tensor)."""
    B, T, C = x.shape
    W = weight.shape[1]
    x, weight = x.contiguous(), weight.contiguous()
    cu, N, Lmax = _layout(x, cu_seqlens)
    h0 = initial_state.contiguous() if initial_state is not None else x
    b = bias.contiguous() if bias is not None else x
    split = C0 > 0
    if Lmax > 0 and N > 0:
        FBT = TUNE.fwd_bt
        FBC = split_block(C0, C1, TUNE.fwd_bc) if split else TUNE.fwd_bc
        y0, y1, y2 = ys if split else (ys[0],) * 3
        _conv_fwd[(cdiv(C, FBC), cdiv(Lmax, FBT), N)](
            x, weight, b, h0, y0, y1, y2, cu, C, C0, C1, W=W, BT=FBT, BC=FBC, HAS_BIAS=bias is not None,
            HAS_H0=initial_state is not None, SILU=silu, SPLIT=split, num_warps=TUNE.fwd_warps)
    if not output_final_state:
        return x.new_empty(0)
    ht = _out((N, C, W), x, x.dtype)
    if N > 0:
        _conv_final_state[(cdiv(C, BC), N)](
            x, h0, ht, cu, C, W=W, WP=next_pow2(W), BC=BC, HAS_H0=initial_state is not None,
            num_warps=4)
    return ht


def _final_state_fake(x, weight, cu_seqlens, output_final_state):
    N = x.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return x.new_empty(N, x.shape[2], weight.shape[1]) if output_final_state else x.new_empty(0)


@custom_op("conv_fwd")
def conv_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, initial_state: torch.Tensor | None,
             cu_seqlens: torch.Tensor | None, silu: bool, output_final_state: bool
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (y [B, T, C] in x's dtype, final state [N, C, W] in x's dtype, or an empty tensor)."""
    y = _out(tuple(x.shape), x, x.dtype)
    return y, _fwd_launch(x, weight, bias, initial_state, cu_seqlens, silu, output_final_state, (y,), 0, 0)


@conv_fwd.register_fake
def _(x, weight, bias, initial_state, cu_seqlens, silu, output_final_state):
    return torch.empty_like(x), _final_state_fake(x, weight, cu_seqlens, output_final_state)


@custom_op("conv_fwd_split")
def conv_fwd_split(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None, silu: bool,
                   output_final_state: bool, C0: int, C1: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`conv_fwd` with y written as three tensors [B, T, C0], [B, T, C1], [B, T, C - C0 - C1] (a layer's q, k, v,
    each contiguous: no split views for the recurrence to copy); `split_block` finds blocks for C0, C1."""
    B, T, C = x.shape
    ys = tuple(_out((B, T, c), x, x.dtype) for c in (C0, C1, C - C0 - C1))
    return (*ys, _fwd_launch(x, weight, bias, initial_state, cu_seqlens, silu, output_final_state, ys, C0, C1))


@conv_fwd_split.register_fake
def _(x, weight, bias, initial_state, cu_seqlens, silu, output_final_state, C0, C1):
    B, T, C = x.shape
    return (*(x.new_empty(B, T, c) for c in (C0, C1, C - C0 - C1)),
            _final_state_fake(x, weight, cu_seqlens, output_final_state))


def _bwd_launch(dys, x, weight, bias, initial_state, cu_seqlens, silu: bool, need_dh0: bool, C0: int, C1: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward from dys (dy [B, T, C], or with C0 > 0 its three parts as `conv_fwd_split` wrote y)."""
    B, T, C = x.shape
    W = weight.shape[1]
    WP = next_pow2(W)
    x, weight = x.contiguous(), weight.contiguous()
    split = C0 > 0
    dys = tuple(d.contiguous() for d in dys)
    dy, dy1, dy2 = dys if split else (dys[0],) * 3
    cu, N, Lmax = _layout(x, cu_seqlens)
    h0 = initial_state.contiguous() if initial_state is not None else x
    b = bias.contiguous() if bias is not None else x
    BC1 = split_block(C0, C1, TUNE.bwd_bc) if split else TUNE.bwd_bc
    NC = cdiv(C, BC1)
    BT = TUNE.bwd_bt
    if BT < 4 or BT & (BT - 1):
        raise ValueError(f"conv.TUNE.bwd_bt: expected a power of two >= 4 (four phases of R rows), got {BT}")
    CH = cdiv(max(TUNE.bwd_chunk, 1), BT) * BT
    NS = cdiv(max(Lmax, 1), CH)
    dx = _out((B, T, C), x, x.dtype)
    dwp = torch.empty(N * NS, C, W, device=x.device, dtype=torch.float32)
    dbp = torch.empty(N * NS, C, device=x.device, dtype=torch.float32) if bias is not None else dwp
    if N > 0:
        _conv_bwd[(NC, NS, N)](x, weight, b, h0, dy, dy1, dy2, dx, dwp, dbp, cu, C, C0, C1, NS, CH, W=W, WP=WP, BT=BT,
                               BC=BC1, HAS_BIAS=bias is not None, HAS_H0=initial_state is not None, SILU=silu,
                               SPLIT=split, num_warps=TUNE.bwd_warps, num_stages=1)
    dw = dwp.sum(0).to(weight.dtype)
    db = dbp.sum(0).to(bias.dtype) if bias is not None else x.new_empty(0)
    dh0 = x.new_empty(0)
    if need_dh0 and initial_state is not None:
        dh0 = _out(tuple(initial_state.shape), x, initial_state.dtype)
        if N > 0:
            _conv_bwd_h0[(NC, N)](x, weight, b, h0, dy, dy1, dy2, dh0, cu, C, C0, C1, W=W, WP=WP, BC=BC1,
                                  HAS_BIAS=bias is not None, SILU=silu, SPLIT=split, num_warps=4)
    return dx, dw, db, dh0


def _bwd_fake(x, weight, bias, initial_state, need_dh0):
    db = torch.empty_like(bias) if bias is not None else x.new_empty(0)
    dh0 = torch.empty_like(initial_state) if (need_dh0 and initial_state is not None) else x.new_empty(0)
    return torch.empty_like(x), torch.empty_like(weight), db, dh0


@custom_op("conv_bwd")
def conv_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None, silu: bool, need_dh0: bool
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (dx, dweight, dbias or empty, dinitial_state or empty), each in its input's dtype."""
    return _bwd_launch((dy,), x, weight, bias, initial_state, cu_seqlens, silu, need_dh0, 0, 0)


@conv_bwd.register_fake
def _(dy, x, weight, bias, initial_state, cu_seqlens, silu, need_dh0):
    return _bwd_fake(x, weight, bias, initial_state, need_dh0)


@custom_op("conv_bwd_split")
def conv_bwd_split(dy0: torch.Tensor, dy1: torch.Tensor, dy2: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None, initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
                   silu: bool, need_dh0: bool, C0: int, C1: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`conv_bwd` with dy as the three parts `conv_fwd_split` wrote (no cat of the layer's dq, dk, dv)."""
    return _bwd_launch((dy0, dy1, dy2), x, weight, bias, initial_state, cu_seqlens, silu, need_dh0, C0, C1)


@conv_bwd_split.register_fake
def _(dy0, dy1, dy2, x, weight, bias, initial_state, cu_seqlens, silu, need_dh0, C0, C1):
    return _bwd_fake(x, weight, bias, initial_state, need_dh0)


class _CausalConv1d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, initial_state, cu_seqlens, silu, output_final_state):
        y, ht = call("conv_fwd", x, weight, bias, initial_state, cu_seqlens, silu, output_final_state)
        ctx.save_for_backward(x, weight, bias, initial_state, cu_seqlens)
        ctx.silu = silu
        ctx.mark_non_differentiable(ht)
        return y, ht

    @staticmethod
    def backward(ctx, dy, _dht):
        x, weight, bias, h0, cu = ctx.saved_tensors
        need_dh0 = h0 is not None and ctx.needs_input_grad[3]
        dx, dw, db, dh0 = call("conv_bwd", dy, x, weight, bias, h0, cu, ctx.silu, need_dh0)
        return dx, dw, (db if bias is not None else None), (dh0 if need_dh0 else None), None, None, None


class _CausalConv1dSplit(torch.autograd.Function):
    """The conv with its output as three tensors (`conv_fwd_split`); gradients of the parts that got none are
    zeros."""

    @staticmethod
    def forward(ctx, x, weight, bias, initial_state, cu_seqlens, silu, output_final_state, C0, C1):
        *ys, ht = call("conv_fwd_split", x, weight, bias, initial_state, cu_seqlens, silu,
                                                    output_final_state, C0, C1)
        ctx.save_for_backward(x, weight, bias, initial_state, cu_seqlens)
        ctx.silu, ctx.C0, ctx.C1 = silu, C0, C1
        ctx.mark_non_differentiable(ht)
        return (*ys, ht)

    @staticmethod
    def backward(ctx, dy0, dy1, dy2, _dht):
        x, weight, bias, h0, cu = ctx.saved_tensors
        need_dh0 = h0 is not None and ctx.needs_input_grad[3]
        B, T, C = x.shape
        sizes = (ctx.C0, ctx.C1, C - ctx.C0 - ctx.C1)
        dys = [d if d is not None else x.new_zeros(B, T, c) for d, c in zip((dy0, dy1, dy2), sizes)]
        dx, dw, db, dh0 = call("conv_bwd_split", *dys, x, weight, bias, h0, cu, ctx.silu, need_dh0,
                                                            ctx.C0, ctx.C1)
        return (dx, dw, (db if bias is not None else None), (dh0 if need_dh0 else None), None, None, None, None,
                None)


def _check_device(name: str, x: torch.Tensor) -> None:
    if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(f"{name}: the Triton glue kernels need CUDA tensors (or TRITON_INTERPRET=1 for the CPU "
                           f"interpreter), got a tensor on {x.device}")


def _check_tensor(name: str, x, dtypes=(torch.float16, torch.bfloat16, torch.float32)) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype in {[str(d) for d in dtypes]}, got {x.dtype}")


def _activation(activation: str | None) -> bool:
    if activation not in (None, "silu"):
        raise ValueError(f"activation: expected None or 'silu', got {activation!r}")
    return activation == "silu"


def _check_weight(weight: torch.Tensor, bias: torch.Tensor | None, C: int) -> int:
    _check_tensor("weight", weight)
    if weight.dim() != 2 or weight.shape[0] != C:
        raise ValueError(f"weight: expected shape [C={C}, W], got {tuple(weight.shape)}")
    W = weight.shape[1]
    if not 1 <= W <= MAX_W:
        raise ValueError(f"weight: expected a kernel width W in 1..{MAX_W}, got W={W}")
    if bias is not None:
        _check_tensor("bias", bias)
        if tuple(bias.shape) != (C,):
            raise ValueError(f"bias: expected shape ({C},) ([C]), got {tuple(bias.shape)}")
    return W


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, activation: str | None = None,
    initial_state: torch.Tensor | None = None, output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None, split: tuple[int, int, int] | None = None,
) -> tuple[torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor | None]:
    """y_t = act(bias + sum_{i<W} weight[:, i] * x_{t-(W-1)+i}), inputs before a document's start taken from its
    initial state (or 0). Differentiable in x, weight, bias, initial_state.

    x: [B, T, C] (float16/bfloat16/float32); weight: [C, W]; bias: [C] or None; activation: None or "silu";
    initial_state: [N, C, W]; cu_seqlens: int [N+1] offsets of documents packed in one row (B == 1), else N = B.
    split: (C0, C1, C2) summing to C: y comes back as three tensors [B, T, C0], [B, T, C1], [B, T, C2] (a layer's
    q, k, v), each written contiguous by the kernel when the launches' channel blocks fit C0 and C1 (`split_block`;
    else the parts are views of one y, the same values), and their gradients read as they are (no cat).
    Returns (y [B, T, C] or the three parts, in x's dtype; final state [N, C, W] in x's dtype if
    output_final_state else None)."""
    _check_tensor("x", x)
    if x.dim() != 3:
        raise ValueError(f"x: expected rank 3 ([B, T, C]), got shape {tuple(x.shape)}")
    B, T, C = x.shape
    W = _check_weight(weight, bias, C)
    silu = _activation(activation)
    N = B
    if cu_seqlens is not None:
        if cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens: expected int32/int64 [N+1] with N >= 1, got {cu_seqlens.dtype} "
                             f"{tuple(cu_seqlens.shape)}")
        if B != 1:
            raise ValueError(f"x: expected B == 1 with cu_seqlens, got shape {tuple(x.shape)}")
        N = cu_seqlens.numel() - 1
    if initial_state is not None:
        _check_tensor("initial_state", initial_state)
        if tuple(initial_state.shape) != (N, C, W):
            raise ValueError(f"initial_state: expected shape {(N, C, W)} ([N, C, W]), got "
                             f"{tuple(initial_state.shape)}")
    _check_device("x", x)
    if split is not None:
        sizes = tuple(split)
        if len(sizes) != 3 or any(not isinstance(c, int) or c < 1 for c in sizes) or sum(sizes) != C:
            raise ValueError(f"split: expected three positive channel counts summing to C={C}, got {split!r}")
        C0, C1 = sizes[0], sizes[1]
        if split_block(C0, C1, TUNE.fwd_bc) and split_block(C0, C1, TUNE.bwd_bc):
            *ys, ht = _CausalConv1dSplit.apply(x, weight, bias, initial_state, cu_seqlens, silu,
                                               bool(output_final_state), C0, C1)
            return tuple(ys), (ht if output_final_state else None)
    y, ht = _CausalConv1d.apply(x, weight, bias, initial_state, cu_seqlens, silu, bool(output_final_state))
    if split is not None:
        y = tuple(y.split(list(split), dim=-1))
    return y, (ht if output_final_state else None)


@custom_op("conv_decode", mutates_args=("conv_state",))
def conv_decode(x: torch.Tensor, conv_state: torch.Tensor, state_indices: torch.Tensor | None,
                weight: torch.Tensor, bias: torch.Tensor | None, silu: bool) -> torch.Tensor:
    N, C = x.shape
    W = weight.shape[1]
    y = _out((N, C), x, x.dtype)
    if N > 0:
        _conv_decode[(cdiv(C, BC), N)](
            x.contiguous(), conv_state, state_indices if state_indices is not None else x, weight.contiguous(),
            bias.contiguous() if bias is not None else x, y, C, W=W, WP=next_pow2(W), BC=BC,
            HAS_IDX=state_indices is not None, HAS_BIAS=bias is not None, SILU=silu, num_warps=4)
    return y


@conv_decode.register_fake
def _(x, conv_state, state_indices, weight, bias, silu):
    return torch.empty_like(x)


def causal_conv1d_update(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
    activation: str | None = None, state_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode step, updating the conv state in place. Not differentiable.

    x: [N, C]; conv_state: [N, C, W] (row n for sequence n), or a pool [P, C, W] with state_indices int32/int64
    [N] (distinct rows; sequence n reads and writes conv_state[state_indices[n]]). Returns y [N, C] in x's dtype."""
    _check_tensor("x", x)
    if x.dim() != 2:
        raise ValueError(f"x: expected rank 2 ([N, C]), got shape {tuple(x.shape)}")
    N, C = x.shape
    W = _check_weight(weight, bias, C)
    silu = _activation(activation)
    _check_tensor("conv_state", conv_state)
    if conv_state.dim() != 3 or tuple(conv_state.shape[1:]) != (C, W):
        raise ValueError(f"conv_state: expected shape [P, {C}, {W}] ([P, C, W]), got {tuple(conv_state.shape)}")
    if not conv_state.is_contiguous():
        raise ValueError("conv_state: expected a contiguous tensor (it is updated in place)")
    if state_indices is None:
        if conv_state.shape[0] != N:
            raise ValueError(f"conv_state: expected shape {(N, C, W)} without state_indices, got "
                             f"{tuple(conv_state.shape)}")
    elif state_indices.dtype not in (torch.int32, torch.int64) or tuple(state_indices.shape) != (N,):
        raise ValueError(f"state_indices: expected int32/int64 [{N}], got {state_indices.dtype} "
                         f"{tuple(state_indices.shape)}")
    _check_device("x", x)
    idx = state_indices.contiguous() if state_indices is not None else None
    return call("conv_decode", x, conv_state, idx, weight, bias, silu)


__all__ = ["causal_conv1d", "causal_conv1d_update", "conv_fwd", "conv_bwd", "conv_decode"]
