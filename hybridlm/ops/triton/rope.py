"""Triton kernels for attention's RoPE on q and k (one launch each way) and its sigmoid output gate.

    q: [B, T, nH, hd], k: [B, T, nKV, hd] (any strides, unit channel stride: views of a fused projection),
    position_ids: [B|1, T] -> q, k rotated, contiguous [B, T, h, hd] in their own dtypes
    o: [B, T, h, d], gate: [B, T, h, d or 1] (any strides) -> o * sigmoid(gate), contiguous

Non-standard here:
- cos/sin are computed in the kernel from the position ids (8 bytes a token) instead of read from the float32
  [B, T, rd] tables (8 rd bytes a token: 1 KB at rd 128, a fifth of what q and k move at 8 + 2 bf16 heads, plus
  the kernels that build them); the sin/cos cost stays under the memory time (once per token and program, for
  `TUNE.heads` heads). The angle is the reference's float32 product position * inv_freq (`inv_freq` from
  `hybridlm.ops.rope`, made on the device by the same PyTorch ops, cached): bit-identical to the tables' angle.
  It is then reduced to [-pi, pi] in float64 (2 pi as two float32 constants whose sum is exact in float64), so the
  float32 sin/cos see a small argument whichever way the backend lowers them (an approximate sin/cos loses
  accuracy for the large angles of long contexts); the part of the reduced angle that float32 drops is added back
  to first order (cos(a + e) = cos a - e sin a), which keeps float32 inputs as close to float64 as PyTorch's
  float32 cos/sin.
- Arithmetic in float32, one rounding to the output dtype. The PyTorch path rounds cos/sin to the input dtype and
  rounds each product and the sum: in bf16 the two differ by an ulp or two, and the kernel is the closer to float64.
- The backward is the rotation's transpose (sin negated), the same kernel body; the rotated pass-through channels
  (rd < hd) are copied. Nothing is saved for it but the position ids.
- The output gate: float32 sigmoid and product, one rounding (PyTorch rounds sigmoid(gate) first). Its backward
  recomputes sigmoid(gate) from the saved gate (a view of the projection output, which the attention already
  keeps) instead of saving sigmoid(gate); a headwise gate's gradient is summed over d in the kernel.
Custom ops: `hybridlm::rope_fwd`, `hybridlm::rope_bwd`, `hybridlm::sigmoid_gate_fwd`, `hybridlm::sigmoid_gate_bwd`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..rope import inv_freq
from .conv import _check_device, _check_tensor
from .custom import call, custom_op
from .tune import LaunchTable, cdiv, next_pow2

POISON = False  # tests set this: outputs start as NaN so an unwritten element shows
TWO_PI_HI = tl.constexpr(6.2831854820251465)  # float32(2 pi)
TWO_PI_LO = tl.constexpr(-1.7484555314695172e-07)  # float32(2 pi - TWO_PI_HI): HI + LO is 2 pi to ~2^-48
INV_TWO_PI = tl.constexpr(0.15915494309189535)


@dataclass
class RopeLaunch(LaunchTable):
    """Launch settings of the RoPE and gate kernels (not measured yet: `scripts_tmp/rope_time.py` times them)."""

    bt: int = 16  # tokens per RoPE program
    heads: int = 4  # heads per RoPE program (q heads then k heads; cos/sin computed once for them)
    warps: int = 4  # RoPE and gate programs
    gate_rows: int = 16  # (token, head) rows per gate program


TUNE = RopeLaunch()


@triton.jit
def _rotate_head(x, y, o_m, m_ok, o_b, o_t, sxb, sxt, sxh, h, H, b_c, b_s, HD, HALF,
                 BH: tl.constexpr, BR: tl.constexpr, HAS_REST: tl.constexpr):
    """Head h of x (strides sxb, sxt, sxh, channels contiguous) for the tokens o_m (batch o_b, time o_t) -> the
    contiguous y [M, H, HD]: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s) on the first 2 HALF channels, the rest copied."""
    o_i = tl.arange(0, BH)
    m = m_ok[:, None] & (o_i < HALF)[None, :]
    px = x + (o_b * sxb + o_t * sxt + h * sxh)[:, None]
    py = y + (o_m * H * HD + h * HD)[:, None]
    b_x1 = tl.load(px + o_i[None, :], mask=m, other=0.0).to(tl.float32)
    b_x2 = tl.load(px + HALF + o_i[None, :], mask=m, other=0.0).to(tl.float32)
    tl.store(py + o_i[None, :], (b_x1 * b_c - b_x2 * b_s).to(y.dtype.element_ty), mask=m)
    tl.store(py + HALF + o_i[None, :], (b_x2 * b_c + b_x1 * b_s).to(y.dtype.element_ty), mask=m)
    if HAS_REST:
        o_r = 2 * HALF + tl.arange(0, BR)
        mr = m_ok[:, None] & (o_r < HD)[None, :]
        tl.store(py + o_r[None, :], tl.load(px + o_r[None, :], mask=mr).to(y.dtype.element_ty), mask=mr)


@triton.jit
def _rope_body(q, k, qo, ko, pos, freq, M, T, sqb, sqt, sqh, skb, skt, skh, spb, spt, NH, NKV, HD, HALF,
               BT: tl.constexpr, BH: tl.constexpr, BR: tl.constexpr, HG: tl.constexpr, HAS_REST: tl.constexpr,
               SIGN: tl.constexpr):
    """Grid (M / BT, (NH + NKV) / HG): BT tokens, HG heads of [q heads | k heads]. SIGN -1 rotates backwards."""
    i_t, i_g = tl.program_id(0), tl.program_id(1)
    o_m = (i_t * BT + tl.arange(0, BT)).to(tl.int64)
    m_ok = o_m < M
    o_b, o_t = o_m // T, o_m % T
    b_p = tl.load(pos + o_b * spb + o_t * spt, mask=m_ok, other=0).to(tl.float32)
    o_i = tl.arange(0, BH)
    b_f = tl.load(freq + o_i, mask=o_i < HALF, other=0.0)
    b_a = (b_p[:, None] * b_f[None, :]).to(tl.float64)  # the reference's float32 angle, exactly
    b_n = tl.floor(b_a * INV_TWO_PI + 0.5)
    b_r = (b_a - b_n * TWO_PI_HI) - b_n * TWO_PI_LO
    b_rh = b_r.to(tl.float32)
    b_rl = (b_r - b_rh.to(tl.float64)).to(tl.float32)  # what rounding the angle to float32 lost: first order
    b_c0, b_s0 = tl.cos(b_rh), tl.sin(b_rh)
    b_c, b_s = b_c0 - b_s0 * b_rl, (b_s0 + b_c0 * b_rl) * SIGN
    for j in tl.static_range(HG):
        h = i_g * HG + j
        if h < NH:
            _rotate_head(q, qo, o_m, m_ok, o_b, o_t, sqb, sqt, sqh, h, NH, b_c, b_s, HD, HALF, BH, BR, HAS_REST)
        elif h < NH + NKV:
            _rotate_head(k, ko, o_m, m_ok, o_b, o_t, skb, skt, skh, h - NH, NKV, b_c, b_s, HD, HALF, BH, BR,
                         HAS_REST)


@triton.jit
def _rope_fwd(q, k, qo, ko, pos, freq, M, T, sqb, sqt, sqh, skb, skt, skh, spb, spt, NH, NKV, HD, HALF,
              BT: tl.constexpr, BH: tl.constexpr, BR: tl.constexpr, HG: tl.constexpr, HAS_REST: tl.constexpr):
    _rope_body(q, k, qo, ko, pos, freq, M, T, sqb, sqt, sqh, skb, skt, skh, spb, spt, NH, NKV, HD, HALF, BT, BH, BR,
               HG, HAS_REST, 1.0)


@triton.jit
def _rope_bwd(q, k, qo, ko, pos, freq, M, T, sqb, sqt, sqh, skb, skt, skh, spb, spt, NH, NKV, HD, HALF,
              BT: tl.constexpr, BH: tl.constexpr, BR: tl.constexpr, HG: tl.constexpr, HAS_REST: tl.constexpr):
    _rope_body(q, k, qo, ko, pos, freq, M, T, sqb, sqt, sqh, skb, skt, skh, spb, spt, NH, NKV, HD, HALF, BT, BH, BR,
               HG, HAS_REST, -1.0)


_FREQ: dict[tuple, torch.Tensor] = {}


def _freq(rd: int, theta: float, device: torch.device) -> torch.Tensor:
    """`inv_freq` on the device, made once per (device, rd, theta)."""
    key = (device, rd, theta)
    if key not in _FREQ:
        _FREQ[key] = inv_freq(rd, theta, device)
    return _FREQ[key]


def _unit_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 or x.shape[-1] == 1 else x.contiguous()


def _out(shape, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if POISON:
        return torch.full(shape, float("nan"), device=like.device, dtype=dtype)
    return torch.empty(shape, device=like.device, dtype=dtype)


def _rope(kernel, q, k, position_ids, rd, theta):
    q, k = _unit_stride(q), _unit_stride(k)
    B, T, NH, HD = q.shape
    NKV = k.shape[2]
    qo, ko = _out(q.shape, q, q.dtype), _out(k.shape, k, k.dtype)
    M = B * T
    if M == 0:
        return qo, ko
    HALF = rd // 2
    BH = next_pow2(HALF)
    rest = HD - rd
    BR = next_pow2(rest) if rest else 1
    HG = max(1, min(TUNE.heads, NH + NKV))
    spb = position_ids.stride(0) if position_ids.shape[0] > 1 else 0
    kernel[(cdiv(M, TUNE.bt), cdiv(NH + NKV, HG))](
        q, k, qo, ko, position_ids, _freq(rd, float(theta), q.device), M, T, *q.stride()[:3], *k.stride()[:3], spb,
        position_ids.stride(1), NH, NKV, HD, HALF, BT=TUNE.bt, BH=BH, BR=BR, HG=HG, HAS_REST=rest > 0,
        num_warps=TUNE.warps)
    return qo, ko


@custom_op("rope_fwd")
def rope_fwd(q: torch.Tensor, k: torch.Tensor, position_ids: torch.Tensor, rotary_dim: int,
             theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, T, nH, hd], k [B, T, nKV, hd], position_ids [B|1, T] -> q, k rotated (contiguous)."""
    return _rope(_rope_fwd, q, k, position_ids, rotary_dim, theta)


@rope_fwd.register_fake
def _(q, k, position_ids, rotary_dim, theta):
    return q.new_empty(q.shape), k.new_empty(k.shape)


@custom_op("rope_bwd")
def rope_bwd(dq: torch.Tensor, dk: torch.Tensor, position_ids: torch.Tensor, rotary_dim: int,
             theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of rope_fwd's outputs -> those of its inputs (the transposed rotation), contiguous."""
    return _rope(_rope_bwd, dq, dk, position_ids, rotary_dim, theta)


@rope_bwd.register_fake
def _(dq, dk, position_ids, rotary_dim, theta):
    return dq.new_empty(dq.shape), dk.new_empty(dk.shape)


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, position_ids, rotary_dim, theta):
        ctx.save_for_backward(position_ids)
        ctx.args = (rotary_dim, theta)
        return call("rope_fwd", q, k, position_ids, rotary_dim, theta)

    @staticmethod
    def backward(ctx, dq, dk):
        (position_ids,) = ctx.saved_tensors
        dq, dk = call("rope_bwd", dq, dk, position_ids, *ctx.args)
        return dq, dk, None, None, None


def rotary(q: torch.Tensor, k: torch.Tensor, position_ids: torch.Tensor, *, rotary_dim: int,
           theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """As `hybridlm.ops.rope.rope_ref`: q [B, T, nH, hd], k [B, T, nKV, hd] (float16/bfloat16/float32, each its own),
    position_ids [B|1, T] (integer or float), rotary_dim even, 2 <= rotary_dim <= hd. Returns q, k rotated,
    contiguous, in their dtypes; differentiable in q and k."""
    _check_tensor("q", q)
    _check_tensor("k", k)
    if q.dim() != 4 or k.dim() != 4 or k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        raise ValueError(f"q, k: expected [B, T, nH, hd] and [B, T, nKV, hd], got {tuple(q.shape)} and "
                         f"{tuple(k.shape)}")
    B, T, _, hd = q.shape
    if not isinstance(rotary_dim, int) or rotary_dim % 2 or not 2 <= rotary_dim <= hd:
        raise ValueError(f"rotary_dim: expected an even int in 2..{hd} (the head dim), got {rotary_dim!r}")
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 \
            or position_ids.shape[0] not in (1, B) or position_ids.shape[1] != T:
        got = tuple(position_ids.shape) if isinstance(position_ids, torch.Tensor) else type(position_ids).__name__
        raise ValueError(f"position_ids: expected shape [{B} or 1, {T}], got {got}")
    if position_ids.device != q.device or k.device != q.device:
        raise ValueError(f"position_ids, k: expected q's device {q.device}, got {position_ids.device} and {k.device}")
    _check_device("q", q)
    return _Rope.apply(q, k, position_ids, rotary_dim, float(theta))


# ---------------------------------------------------------------------------------------------------- gate


@triton.jit
def _gate_rows(o, g, o_r, m_r, o_d, m, T, NH, sob, sot, soh, sgb, sgt, sgh, HEADWISE: tl.constexpr):
    """Offsets of rows o_r (row = (b, t, h)) in o and g, and g's values (fp32 [BR, BD], or [BR, 1] headwise)."""
    o_h = o_r % NH
    o_bt = o_r // NH
    o_b, o_t = o_bt // T, o_bt % T
    po = (o_b * sob + o_t * sot + o_h * soh)[:, None] + o_d[None, :]
    pg = (o_b * sgb + o_t * sgt + o_h * sgh)[:, None]
    if HEADWISE:
        b_g = tl.load(g + pg, mask=m_r[:, None], other=0.0).to(tl.float32)
    else:
        b_g = tl.load(g + pg + o_d[None, :], mask=m, other=0.0).to(tl.float32)
    return po, pg, b_g


@triton.jit
def _gate_fwd(o, g, y, R, T, NH, D, sob, sot, soh, sgb, sgt, sgh, BR: tl.constexpr, BD: tl.constexpr,
              HEADWISE: tl.constexpr):
    """Grid (R / BR): y = o * sigmoid(g) for BR rows of D channels (y contiguous [R, D])."""
    o_r = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    o_d = tl.arange(0, BD)
    m_r = o_r < R
    m = m_r[:, None] & (o_d < D)[None, :]
    po, _, b_g = _gate_rows(o, g, o_r, m_r, o_d, m, T, NH, sob, sot, soh, sgb, sgt, sgh, HEADWISE)
    b_o = tl.load(o + po, mask=m, other=0.0).to(tl.float32)
    tl.store(y + o_r[:, None] * D + o_d[None, :], (b_o * tl.sigmoid(b_g)).to(y.dtype.element_ty), mask=m)


@triton.jit
def _gate_bwd(o, g, dy, do, dg, R, T, NH, D, sob, sot, soh, sgb, sgt, sgh, syb, syt, syh, BR: tl.constexpr,
              BD: tl.constexpr, HEADWISE: tl.constexpr):
    """Grid (R / BR): do = dy s, dg = dy o s (1 - s) (summed over the row headwise), s = sigmoid(g); do contiguous
    [R, D], dg contiguous [R, D] or [R]."""
    o_r = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    o_d = tl.arange(0, BD)
    m_r = o_r < R
    m = m_r[:, None] & (o_d < D)[None, :]
    po, _, b_g = _gate_rows(o, g, o_r, m_r, o_d, m, T, NH, sob, sot, soh, sgb, sgt, sgh, HEADWISE)
    o_h = o_r % NH
    o_bt = o_r // NH
    py = (o_bt // T * syb + o_bt % T * syt + o_h * syh)[:, None] + o_d[None, :]
    b_o = tl.load(o + po, mask=m, other=0.0).to(tl.float32)
    b_dy = tl.load(dy + py, mask=m, other=0.0).to(tl.float32)
    b_s = tl.sigmoid(b_g)
    tl.store(do + o_r[:, None] * D + o_d[None, :], (b_dy * b_s).to(do.dtype.element_ty), mask=m)
    b_dg = b_dy * b_o
    if HEADWISE:
        b_s1 = tl.reshape(b_s, [BR])
        tl.store(dg + o_r, (tl.sum(b_dg, 1) * b_s1 * (1.0 - b_s1)).to(dg.dtype.element_ty), mask=m_r)
    else:
        tl.store(dg + o_r[:, None] * D + o_d[None, :], (b_dg * b_s * (1.0 - b_s)).to(dg.dtype.element_ty), mask=m)


def _gate_launch(o: torch.Tensor):
    R, D = o.shape[0] * o.shape[1] * o.shape[2], o.shape[3]
    BD = next_pow2(D)
    BR = max(1, TUNE.gate_rows * 128 // BD) if BD > 128 else TUNE.gate_rows
    return R, D, BR, BD, (cdiv(R, BR),)


@custom_op("sigmoid_gate_fwd")
def sigmoid_gate_fwd(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """o [B, T, h, d], gate [B, T, h, d or 1] -> o * sigmoid(gate), contiguous, in their promoted dtype."""
    o, gate = _unit_stride(o), _unit_stride(gate)
    y = _out(o.shape, o, torch.promote_types(o.dtype, gate.dtype))
    R, D, BR, BD, grid = _gate_launch(o)
    if R > 0:
        _gate_fwd[grid](o, gate, y, R, o.shape[1], o.shape[2], D, *o.stride()[:3], *gate.stride()[:3], BR=BR, BD=BD,
                        HEADWISE=gate.shape[3] == 1 and D > 1, num_warps=TUNE.warps)
    return y


@sigmoid_gate_fwd.register_fake
def _(o, gate):
    return o.new_empty(o.shape, dtype=torch.promote_types(o.dtype, gate.dtype))


@custom_op("sigmoid_gate_bwd")
def sigmoid_gate_bwd(dy: torch.Tensor, o: torch.Tensor, gate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (do in o's dtype, dgate in gate's dtype), contiguous."""
    dy, o, gate = _unit_stride(dy), _unit_stride(o), _unit_stride(gate)
    do, dg = _out(o.shape, o, o.dtype), _out(gate.shape, gate, gate.dtype)
    R, D, BR, BD, grid = _gate_launch(o)
    if R > 0:
        _gate_bwd[grid](o, gate, dy, do, dg, R, o.shape[1], o.shape[2], D, *o.stride()[:3], *gate.stride()[:3],
                        *dy.stride()[:3], BR=BR, BD=BD, HEADWISE=gate.shape[3] == 1 and D > 1, num_warps=TUNE.warps)
    return do, dg


@sigmoid_gate_bwd.register_fake
def _(dy, o, gate):
    return o.new_empty(o.shape), gate.new_empty(gate.shape)


class _SigmoidGate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, o, gate):
        ctx.save_for_backward(o, gate)
        return call("sigmoid_gate_fwd", o, gate)

    @staticmethod
    def backward(ctx, dy):
        o, gate = ctx.saved_tensors
        return call("sigmoid_gate_bwd", dy, o, gate)


def sigmoid_gate(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """As `hybridlm.ops.rope.sigmoid_gate_ref`: o [B, T, h, d] * sigmoid(gate [B, T, h, d or 1]) (float16/bfloat16/
    float32, any strides). Returns [B, T, h, d] contiguous; differentiable in o and gate."""
    _check_tensor("o", o)
    _check_tensor("gate", gate)
    if o.dim() != 4 or gate.dim() != 4 or gate.shape[:3] != o.shape[:3] or gate.shape[3] not in (1, o.shape[3]):
        raise ValueError(f"gate: expected shape [B, T, h, d or 1] with o's [B, T, h, d] = {tuple(o.shape)}, got "
                         f"{tuple(gate.shape)}")
    _check_device("o", o)
    return _SigmoidGate.apply(o, gate)


__all__ = ["rotary", "sigmoid_gate", "rope_fwd", "rope_bwd", "sigmoid_gate_fwd", "sigmoid_gate_bwd", "TUNE"]
