"""Triton RMSNorm and gated RMSNorm, forward and backward, over rows of any width up to MAX_D.

Same contract and the same rounding points as `hybridlm.ops.rms_norm` / `gated_rms_norm`, which differ per
released model. Non-standard here: the kernel emulates each rounding of the reference, so it agrees with it to
a few ulps in bf16, not just to bf16 tolerance:
- CAST_Y: x_hat is rounded to x's dtype before the weight (Llama-style `w * x_hat.to(dtype)`; the SiLU-gated norm).
- W_LOWP: the weight multiply happens in x's dtype (weight rounded to it, product rounded): `rms_norm` "llama"
  kind always, the SiLU-gated norm when the weight has x's dtype (a module cast to bf16), as PyTorch promotes.
- ZC: zero-centred weight, x_hat * (1 + w) in fp32 (Qwen3-Next).
- ACT: 0 none, 1 SiLU, 2 sigmoid gate, applied in fp32; the result is cast to x's dtype once.
- out_dtype (`rms_norm`; the module passes autocast's dtype): float32 x is computed as above (in fp32) and cast
  once to out_dtype when it is stored, the value a following autocast Linear would have made of the fp32 output,
  without the fp32 copy; the backward takes dy in out_dtype and returns dx in x's dtype.
The backward uses the reference's rounded intermediates where its autograd does (the casts themselves pass the
gradient unchanged); dweight is reduced through per-program fp32 partials summed on the host (deterministic).
Rows: x [..., D] is flattened to [M, D]; the rstd of each row is saved (fp32 [M]).
Custom ops: `hybridlm::norm_fwd`, `hybridlm::norm_bwd`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .conv import _check_device, _check_tensor
from .custom import call, custom_op
from .tune import LaunchTable, cdiv, next_pow2

MAX_D = 16384
POISON = False  # tests set this: outputs start as NaN so an unwritten element shows
ACTS = {None: 0, "silu": 1, "sigmoid": 2}
NARROW_D = 256  # rows this wide or narrower take the narrow-row backward setting (measured at D = 128 only)
DWP_BYTES = 32 << 20  # cap of the backward's fp32 dweight partials [NP, D]


@dataclass
class NormLaunch(LaunchTable):
    """Launch settings of the norm kernels; None picks by row width (`_blocks`, `_blocks_bwd`, `_bwd_programs`).
    `scripts/gpu_check_glue.py --sweep-norm` times alternatives."""

    fwd_elems: int = 4096  # elements per forward program (BM = fwd_elems / BD rows, 1 to 64): the fastest tried
    fwd_warps: int | None = None  # None: 4, or 8 for programs over 4096 elements
    bwd_elems: int | None = None  # None: 1024 for rows up to NARROW_D, else 2048 (4096-element blocks spill)
    bwd_warps: int | None = None  # None: 4 for rows up to NARROW_D, 8 up to 4096, 16 wider
    # None: 64 for rows up to NARROW_D, else 4; the backward's programs loop over every NP-th row block, NP = this
    # times the SM count (capped by DWP_BYTES), each summing its dweight partial elementwise over its blocks
    bwd_programs_per_sm: int | None = None


TUNE = NormLaunch()


@triton.jit
def _norm_rows(x, gate, w, o_m, o_d, m, D, eps, HAS_W: tl.constexpr, ZC: tl.constexpr, CAST_Y: tl.constexpr,
               W_LOWP: tl.constexpr, ACT: tl.constexpr):
    """Rows o_m -> (x_hat fp32, x_hat as the weight sees it, effective weight [BD], pre-gate value, act(gate),
    gate fp32, rstd)."""
    b_x = tl.load(x + o_m[:, None] * D + o_d[None, :], mask=m, other=0.0).to(tl.float32)
    return _norm_vals(b_x, x.dtype.element_ty, gate, w, o_m, o_d, m, D, eps, HAS_W, ZC, CAST_Y, W_LOWP, ACT)


@triton.jit
def _norm_vals(b_x, DT: tl.constexpr, gate, w, o_m, o_d, m, D, eps, HAS_W: tl.constexpr, ZC: tl.constexpr,
               CAST_Y: tl.constexpr, W_LOWP: tl.constexpr, ACT: tl.constexpr):
    """`_norm_rows` of loaded rows b_x (fp32 [BM, BD], zero outside the mask) whose dtype is DT."""
    b_r = tl.rsqrt(tl.sum(b_x * b_x, 1) / D + eps)
    b_xh = b_x * b_r[:, None]
    b_yc = b_xh
    if CAST_Y:
        b_yc = b_xh.to(DT).to(tl.float32)
    b_w = tl.full([o_d.shape[0]], 1.0, dtype=tl.float32)
    b_u = b_yc
    if HAS_W:
        b_w = tl.load(w + o_d, mask=o_d < D, other=0.0).to(tl.float32)
        if ZC:
            b_w = 1.0 + b_w
        if W_LOWP:
            b_w = b_w.to(DT).to(tl.float32)
        b_u = b_yc * b_w[None, :]
        if W_LOWP:
            b_u = b_u.to(DT).to(tl.float32)
    b_g = tl.zeros_like(b_u)
    b_a = tl.full(b_u.shape, 1.0, dtype=tl.float32)
    if ACT > 0:
        b_g = tl.load(gate + o_m[:, None] * D + o_d[None, :], mask=m, other=0.0).to(tl.float32)
        b_a = tl.sigmoid(b_g)
        if ACT == 1:
            b_a = b_g * b_a
    return b_xh, b_yc, b_w, b_u, b_a, b_g, b_r


@triton.jit
def _norm_fwd(x, gate, w, y, rstd, M, D, eps, BM: tl.constexpr, BD: tl.constexpr, HAS_W: tl.constexpr,
              ZC: tl.constexpr, CAST_Y: tl.constexpr, W_LOWP: tl.constexpr, ACT: tl.constexpr):
    """Grid (M / BM): y = [w *] x_hat [* act(gate)] for a block of BM rows."""
    i_m = tl.program_id(0)
    o_m = (i_m * BM + tl.arange(0, BM)).to(tl.int64)
    o_d = tl.arange(0, BD)
    m = (o_m < M)[:, None] & (o_d < D)[None, :]
    _, _, _, b_u, b_a, _, b_r = _norm_rows(x, gate, w, o_m, o_d, m, D, eps, HAS_W, ZC, CAST_Y, W_LOWP, ACT)
    tl.store(y + o_m[:, None] * D + o_d[None, :], (b_u * b_a).to(y.dtype.element_ty), mask=m)
    tl.store(rstd + o_m, b_r, mask=o_m < M)


@triton.jit
def _rms_dx(b_du, b_xh, b_w, b_r, D):
    """dx fp32 [BM, BD] of the rows from the gradient b_du of x_hat * w (x_hat, w, rstd as `_norm_rows` gives)."""
    b_dxh = b_du * b_w[None, :]
    return b_r[:, None] * (b_dxh - b_xh * (tl.sum(b_dxh * b_xh, 1) / D)[:, None])


@triton.jit
def _norm_bwd(x, gate, w, dy, dx, dg, dwp, M, D, eps, NP, BM: tl.constexpr, BD: tl.constexpr,
              HAS_W: tl.constexpr, ZC: tl.constexpr, CAST_Y: tl.constexpr, W_LOWP: tl.constexpr, ACT: tl.constexpr):
    """Grid (NP): program p takes row blocks p, p + NP, ...; writes dx, dgate there and its dweight partial to
    row p of dwp [NP, D]: summed elementwise over the blocks ([BM, BD] fp32) and over rows once at the end, so
    looping over many blocks costs no row reduction per block."""
    i_p = tl.program_id(0)
    o_d = tl.arange(0, BD)
    b_dwa = tl.zeros([BM, BD], dtype=tl.float32)
    for i_m in range(i_p, tl.cdiv(M, BM), NP):
        o_m = (i_m * BM + tl.arange(0, BM)).to(tl.int64)
        m = (o_m < M)[:, None] & (o_d < D)[None, :]
        b_xh, b_yc, b_w, b_u, b_a, b_g, b_r = _norm_rows(x, gate, w, o_m, o_d, m, D, eps, HAS_W, ZC, CAST_Y,
                                                         W_LOWP, ACT)
        b_do = tl.load(dy + o_m[:, None] * D + o_d[None, :], mask=m, other=0.0).to(tl.float32)
        if ACT > 0:
            b_s = tl.sigmoid(b_g)
            if ACT == 1:
                b_da = b_s * (1.0 + b_g * (1.0 - b_s))
            else:
                b_da = b_s * (1.0 - b_s)
            tl.store(dg + o_m[:, None] * D + o_d[None, :], (b_do * b_u * b_da).to(dg.dtype.element_ty), mask=m)
        b_du = b_do * b_a  # gradient of the pre-gate value
        b_dwa += b_du * b_yc
        b_dx = _rms_dx(b_du, b_xh, b_w, b_r, D)
        tl.store(dx + o_m[:, None] * D + o_d[None, :], b_dx.to(dx.dtype.element_ty), mask=m)
    if HAS_W:
        tl.store(dwp + i_p.to(tl.int64) * D + o_d, tl.sum(b_dwa, 0), mask=o_d < D)


def _out(shape, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if POISON:
        return torch.full(shape, float("nan"), device=like.device, dtype=dtype)
    return torch.empty(shape, device=like.device, dtype=dtype)


def _blocks(D: int) -> tuple[int, int, int]:
    """Forward (BD, BM, num_warps): about 4K elements per program (one row when D is that wide)."""
    BD = next_pow2(D)
    BM = max(1, min(64, TUNE.fwd_elems // BD))
    return BD, BM, TUNE.fwd_warps or (4 if BD * BM <= 4096 else 8)


def _blocks_bwd(D: int) -> tuple[int, int, int]:
    """Backward (BD, BM, num_warps): rows up to NARROW_D wide 1K elements per program at 4 warps; wider ones about
    2K elements at 8 warps, 16 warps for rows of 8K and more (sm_90 compile, bf16: D=128 72 registers, D=2048 63,
    D=8192 107, no spills; D=16384 spills 48 B; the forward's 4K-element blocks spill here)."""
    BD = next_pow2(D)
    narrow = BD <= NARROW_D
    elems = TUNE.bwd_elems or (1024 if narrow else 2048)
    warps = TUNE.bwd_warps or (4 if narrow else 8 if BD <= 4096 else 16)
    return BD, max(1, min(64, elems // BD)), warps


def _bwd_programs(M: int, BM: int, BD: int, sms: int) -> int:
    """Programs of the backward (each loops over every NP-th row block): `TUNE.bwd_programs_per_sm` times the SM
    count, with the fp32 dweight partials [NP, BD] kept within DWP_BYTES."""
    per_sm = TUNE.bwd_programs_per_sm
    if per_sm is None:
        per_sm = 64 if BD <= NARROW_D else 4
    if not isinstance(per_sm, int) or per_sm < 1:
        raise ValueError(f"norm.TUNE.bwd_programs_per_sm: expected None or a positive int, got {per_sm!r}")
    NP = min(cdiv(M, BM), per_sm * sms)
    return max(1, min(NP, DWP_BYTES // (4 * BD)))


@custom_op("norm_fwd")
def norm_fwd(x: torch.Tensor, gate: torch.Tensor | None, weight: torch.Tensor | None, eps: float, zc: bool,
             cast_y: bool, w_lowp: bool, act: int, out_dtype: torch.dtype | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """x, gate: [M, D]; weight: [D]. Returns (y [M, D] in out_dtype (default x's dtype), rstd [M] fp32); the
    rounding points of x's dtype come first, the cast to out_dtype last."""
    M, D = x.shape
    BD, BM, nw = _blocks(D)
    y = _out((M, D), x, out_dtype or x.dtype)
    rstd = _out((M,), x, torch.float32)
    if M > 0:
        _norm_fwd[(cdiv(M, BM),)](
            x, gate if gate is not None else x, weight if weight is not None else x, y, rstd, M, D, eps,
            BM=BM, BD=BD, HAS_W=weight is not None, ZC=zc, CAST_Y=cast_y, W_LOWP=w_lowp, ACT=act, num_warps=nw)
    return y, rstd


@norm_fwd.register_fake
def _(x, gate, weight, eps, zc, cast_y, w_lowp, act, out_dtype=None):
    return torch.empty_like(x, dtype=out_dtype or x.dtype), x.new_empty(x.shape[0], dtype=torch.float32)


@custom_op("norm_bwd")
def norm_bwd(dy: torch.Tensor, x: torch.Tensor, gate: torch.Tensor | None, weight: torch.Tensor | None, eps: float,
             zc: bool, cast_y: bool, w_lowp: bool, act: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (dx [M, D], dgate [M, D] or empty, dweight [D] or empty), each in its input's dtype (dy may have
    another dtype: the forward's out_dtype)."""
    M, D = x.shape
    BD, BM, nw = _blocks_bwd(D)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.device.type == "cuda" else 1
    NP = _bwd_programs(M, BM, BD, sms)
    dx = _out((M, D), x, x.dtype)
    dg = _out((M, D), x, gate.dtype) if gate is not None else x.new_empty(0)
    # every program writes its whole partial row (an empty allocation, not zeros: 32 MiB less traffic at the cap)
    dwp = (torch.empty if M > 0 else torch.zeros)(NP, D, device=x.device, dtype=torch.float32)
    if M > 0:
        _norm_bwd[(NP,)](
            x, gate if gate is not None else x, weight if weight is not None else x, dy.contiguous(), dx,
            dg if gate is not None else dx, dwp, M, D, eps, NP, BM=BM, BD=BD, HAS_W=weight is not None, ZC=zc,
            CAST_Y=cast_y, W_LOWP=w_lowp, ACT=act, num_warps=nw)
    dw = dwp.sum(0).to(weight.dtype) if weight is not None else x.new_empty(0)
    return dx, dg, dw


@norm_bwd.register_fake
def _(dy, x, gate, weight, eps, zc, cast_y, w_lowp, act):
    dg = torch.empty_like(gate) if gate is not None else x.new_empty(0)
    dw = torch.empty_like(weight) if weight is not None else x.new_empty(0)
    return torch.empty_like(x), dg, dw


class _Norm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gate, weight, eps, zc, cast_y, w_lowp, act, out_dtype):
        y, _ = call("norm_fwd", x, gate, weight, eps, zc, cast_y, w_lowp, act, out_dtype)
        ctx.save_for_backward(x, gate, weight)
        ctx.args = (eps, zc, cast_y, w_lowp, act)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, gate, weight = ctx.saved_tensors
        dx, dg, dw = call("norm_bwd", dy, x, gate, weight, *ctx.args)
        return dx, (dg if gate is not None else None), (dw if weight is not None else None), *([None] * 6)


def check_rows(x: torch.Tensor, weight: torch.Tensor | None, out_dtype, **like_x: torch.Tensor | None) -> int:
    """The checks of a norm kernel's inputs: x [..., D] (D in 1..MAX_D), weight [D] or None, out_dtype, and each
    named tensor of like_x (None skipped) of x's shape; one-line errors naming the argument. Returns D."""
    if out_dtype is not None and (not out_dtype.is_floating_point or out_dtype == torch.float64):
        raise ValueError(f"out_dtype: expected float16, bfloat16 or float32, got {out_dtype}")
    _check_tensor("x", x)
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x: expected shape [..., D] with D >= 1, got {tuple(x.shape)}")
    D = x.shape[-1]
    if D > MAX_D:
        raise ValueError(f"x: the Triton norm takes rows of width D <= {MAX_D}, got D={D}")
    for name, t in like_x.items():
        if t is None:
            continue
        _check_tensor(name, t)
        if t.shape != x.shape:
            raise ValueError(f"{name}: expected the shape of x {tuple(x.shape)}, got {tuple(t.shape)}")
    if weight is not None:
        _check_tensor("weight", weight)
        if tuple(weight.shape) != (D,):
            raise ValueError(f"weight: expected shape ({D},) ([D]), got {tuple(weight.shape)}")
    _check_device("x", x)
    return D


def _run(x, gate, weight, eps, zc, cast_y, w_lowp, act, out_dtype=None):
    D = check_rows(x, weight, out_dtype, gate=gate)
    shape = x.shape
    x2 = x.reshape(-1, D).contiguous()
    g2 = gate.reshape(-1, D).contiguous() if gate is not None else None
    w = weight.contiguous() if weight is not None else None
    out = None if out_dtype == x.dtype else out_dtype
    if out is not None and x.dtype != torch.float32:
        # x already low precision: its own rounding points, then the cast (one more pass, a rare mix)
        return _Norm.apply(x2, g2, w, float(eps), zc, cast_y, w_lowp, act, None).view(shape).to(out)
    y = _Norm.apply(x2, g2, w, float(eps), zc, cast_y, w_lowp, act, out)
    return y.view(shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6, *, zero_centered: bool = False,
             cast_before_weight: bool = True, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """As `hybridlm.ops.rms_norm`. x: [..., D] (float16/bfloat16/float32, D <= MAX_D); weight: [D] or None.
    Returns [..., D] in out_dtype (default x's dtype; float32 x is rounded to it once, in the store);
    differentiable in x and weight, the gradients in their own dtypes."""
    if weight is None:
        return _run(x, None, None, eps, False, False, False, 0, out_dtype)
    if zero_centered:
        return _run(x, None, weight, eps, True, False, False, 0, out_dtype)
    return _run(x, None, weight, eps, False, cast_before_weight, cast_before_weight, 0, out_dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6, *,
                   activation: str = "silu", fp32_output: bool = False) -> torch.Tensor:
    """As `hybridlm.ops.gated_rms_norm`: RMSNorm(x) * act(gate) per row. x, gate: [..., D] (D <= MAX_D);
    weight: [D] (plain w) or None. Returns [..., D] in x's dtype; differentiable in x, gate and weight."""
    if activation not in ("silu", "sigmoid"):
        raise ValueError(f"activation: expected 'silu' or 'sigmoid', got {activation!r}")
    act = ACTS[activation]
    if fp32_output:
        return _run(x, gate, weight, eps, False, False, False, act)
    w_lowp = weight is not None and weight.dtype == x.dtype and x.dtype != torch.float32
    return _run(x, gate, weight, eps, False, True, w_lowp, act)


__all__ = ["rms_norm", "gated_rms_norm", "norm_fwd", "norm_bwd", "MAX_D"]
