"""Triton residual add + RMSNorm in one pass: x_new = x + branch, y = rms_norm(x_new), forward and backward.

Same contract and rounding as `hybridlm.ops.add_rms_norm` (torch's add, then `rms_norm`); the norm's rounding
points (CAST_Y, W_LOWP, ZC, out_dtype) are those of `hybridlm.ops.triton.norm`, whose row helpers and launch table
(`norm.TUNE`) this file uses. Non-standard here:
- x_new has torch's promoted dtype of (x, branch) and its value: the fp32 sum rounded once to that dtype (a float32
  residual plus a bf16 branch is the exact float32 add torch's promotion makes).
- The backward takes dy and the gradient of x_new (None where x_new is not used, e.g. before the final norm) and
  writes, per row block, d_total = d_xnew + d_norm with autograd's rounding: d_norm rounded to x_new's dtype, the
  sum rounded to it, then d_total cast to x's dtype (dx) and to branch's dtype (dbranch). dweight as the norm's.
- Only x_new is saved (and the weight): the norm is recomputed from it in the backward, as the norm does from x.
Custom ops: `hybridlm::add_norm_fwd`, `hybridlm::add_norm_bwd`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .custom import call, custom_op
from .norm import _blocks, _blocks_bwd, _bwd_programs, _norm_rows, _norm_vals, _out, _rms_dx, check_rows
from .tune import cdiv


@triton.jit
def _add_norm_fwd(x, b, w, y, xn, M, D, eps, BM: tl.constexpr, BD: tl.constexpr, HAS_W: tl.constexpr,
                  ZC: tl.constexpr, CAST_Y: tl.constexpr, W_LOWP: tl.constexpr):
    """Grid (M / BM): x_new = x + b rounded to x_new's dtype, stored; y = [w *] x_hat(x_new), stored."""
    i_m = tl.program_id(0)
    o_m = (i_m * BM + tl.arange(0, BM)).to(tl.int64)
    o_d = tl.arange(0, BD)
    m = (o_m < M)[:, None] & (o_d < D)[None, :]
    o = o_m[:, None] * D + o_d[None, :]
    XT = xn.dtype.element_ty
    b_s = tl.load(x + o, mask=m, other=0.0).to(tl.float32) + tl.load(b + o, mask=m, other=0.0).to(tl.float32)
    b_s = b_s.to(XT)
    tl.store(xn + o, b_s, mask=m)
    _, _, _, b_u, _, _, _ = _norm_vals(b_s.to(tl.float32), XT, x, w, o_m, o_d, m, D, eps, HAS_W, ZC, CAST_Y,
                                       W_LOWP, 0)
    tl.store(y + o, b_u.to(y.dtype.element_ty), mask=m)


@triton.jit
def _add_norm_bwd(xn, w, dy, dxn, dx, db, dwp, M, D, eps, NP, BM: tl.constexpr, BD: tl.constexpr,
                  HAS_W: tl.constexpr, ZC: tl.constexpr, CAST_Y: tl.constexpr, W_LOWP: tl.constexpr,
                  HAS_DXN: tl.constexpr):
    """Grid (NP): program p takes row blocks p, p + NP, ...; writes dx, dbranch there and its dweight partial to
    row p of dwp [NP, D] (the norm backward's plan)."""
    i_p = tl.program_id(0)
    o_d = tl.arange(0, BD)
    XT = xn.dtype.element_ty
    b_dwa = tl.zeros([BM, BD], dtype=tl.float32)
    for i_m in range(i_p, tl.cdiv(M, BM), NP):
        o_m = (i_m * BM + tl.arange(0, BM)).to(tl.int64)
        m = (o_m < M)[:, None] & (o_d < D)[None, :]
        o = o_m[:, None] * D + o_d[None, :]
        b_xh, b_yc, b_w, _, _, _, b_r = _norm_rows(xn, xn, w, o_m, o_d, m, D, eps, HAS_W, ZC, CAST_Y, W_LOWP, 0)
        b_do = tl.load(dy + o, mask=m, other=0.0).to(tl.float32)
        b_dwa += b_do * b_yc
        b_d = _rms_dx(b_do, b_xh, b_w, b_r, D).to(XT)  # the norm's dx, in x_new's dtype as autograd holds it
        if HAS_DXN:
            b_d = (b_d.to(tl.float32) + tl.load(dxn + o, mask=m, other=0.0).to(tl.float32)).to(XT)
        tl.store(dx + o, b_d.to(dx.dtype.element_ty), mask=m)
        tl.store(db + o, b_d.to(db.dtype.element_ty), mask=m)
    if HAS_W:
        tl.store(dwp + i_p.to(tl.int64) * D + o_d, tl.sum(b_dwa, 0), mask=o_d < D)


@custom_op("add_norm_fwd")
def add_norm_fwd(x: torch.Tensor, branch: torch.Tensor, weight: torch.Tensor | None, eps: float, zc: bool,
                 cast_y: bool, w_lowp: bool, out_dtype: torch.dtype | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """x, branch: [M, D]; weight: [D]. Returns (y [M, D] in out_dtype (default x_new's dtype), x_new [M, D] in
    the promoted dtype of x and branch)."""
    M, D = x.shape
    BD, BM, nw = _blocks(D)
    xn = _out((M, D), x, torch.promote_types(x.dtype, branch.dtype))
    y = _out((M, D), x, out_dtype or xn.dtype)
    if M > 0:
        _add_norm_fwd[(cdiv(M, BM),)](x, branch, weight if weight is not None else x, y, xn, M, D, eps, BM=BM,
                                      BD=BD, HAS_W=weight is not None, ZC=zc, CAST_Y=cast_y, W_LOWP=w_lowp,
                                      num_warps=nw)
    return y, xn


@add_norm_fwd.register_fake
def _(x, branch, weight, eps, zc, cast_y, w_lowp, out_dtype=None):
    xn = torch.empty_like(x, dtype=torch.promote_types(x.dtype, branch.dtype))
    return torch.empty_like(xn, dtype=out_dtype or xn.dtype), xn


@custom_op("add_norm_bwd")
def add_norm_bwd(dy: torch.Tensor, dxn: torch.Tensor | None, xn: torch.Tensor, weight: torch.Tensor | None,
                 eps: float, zc: bool, cast_y: bool, w_lowp: bool, x_dtype: torch.dtype, branch_dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dy: [M, D] (the forward's out_dtype); dxn: [M, D] in x_new's dtype or None. Returns (dx in x_dtype,
    dbranch in branch_dtype, dweight [D] in weight's dtype or empty)."""
    M, D = xn.shape
    BD, BM, nw = _blocks_bwd(D)
    sms = torch.cuda.get_device_properties(xn.device).multi_processor_count if xn.device.type == "cuda" else 1
    NP = _bwd_programs(M, BM, BD, sms)
    dx, db = _out((M, D), xn, x_dtype), _out((M, D), xn, branch_dtype)
    dwp = (torch.empty if M > 0 else torch.zeros)(NP, D, device=xn.device, dtype=torch.float32)
    if M > 0:
        _add_norm_bwd[(NP,)](xn, weight if weight is not None else xn, dy.contiguous(),
                             dxn.contiguous() if dxn is not None else xn, dx, db, dwp, M, D, eps, NP, BM=BM, BD=BD,
                             HAS_W=weight is not None, ZC=zc, CAST_Y=cast_y, W_LOWP=w_lowp,
                             HAS_DXN=dxn is not None, num_warps=nw)
    dw = dwp.sum(0).to(weight.dtype) if weight is not None else xn.new_empty(0)
    return dx, db, dw


@add_norm_bwd.register_fake
def _(dy, dxn, xn, weight, eps, zc, cast_y, w_lowp, x_dtype, branch_dtype):
    dw = torch.empty_like(weight) if weight is not None else xn.new_empty(0)
    return torch.empty_like(xn, dtype=x_dtype), torch.empty_like(xn, dtype=branch_dtype), dw


class _AddNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, branch, weight, eps, zc, cast_y, w_lowp, out_dtype):
        y, xn = call("add_norm_fwd", x, branch, weight, eps, zc, cast_y, w_lowp, out_dtype)
        ctx.set_materialize_grads(False)  # an unused x_new (the final norm's) sends None: no zeros to read
        ctx.save_for_backward(xn, weight)
        ctx.args = (eps, zc, cast_y, w_lowp, x.dtype, branch.dtype)
        return y, xn

    @staticmethod
    def backward(ctx, dy, dxn):
        xn, weight = ctx.saved_tensors
        if dy is None:
            dy = torch.zeros((), device=xn.device, dtype=xn.dtype).expand(xn.shape)
        dx, db, dw = call("add_norm_bwd", dy, dxn, xn, weight, *ctx.args)
        return dx, db, (dw if weight is not None else None), *([None] * 5)


def add_rms_norm(x: torch.Tensor, branch: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6, *,
                 zero_centered: bool = False, cast_before_weight: bool = True,
                 out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """As `hybridlm.ops.add_rms_norm`. x, branch: [..., D] (float16/bfloat16/float32, D <= MAX_D); weight: [D] or
    None. Returns (y [..., D] in out_dtype (default x_new's), x_new [..., D]); differentiable in x, branch, weight."""
    check_rows(x, weight, out_dtype, branch=branch)
    shape, D = x.shape, x.shape[-1]
    x2, b2 = x.reshape(-1, D).contiguous(), branch.reshape(-1, D).contiguous()
    w = weight.contiguous() if weight is not None else None
    zc = weight is not None and zero_centered
    cast_y = weight is not None and not zero_centered and cast_before_weight
    xn_dtype = torch.promote_types(x.dtype, branch.dtype)
    out = None if out_dtype == xn_dtype else out_dtype
    late = out is not None and xn_dtype != torch.float32  # low-precision x_new: its own rounding, then the cast
    y, xn = _AddNorm.apply(x2, b2, w, float(eps), zc, cast_y, cast_y, None if late else out)
    y = y.view(shape)
    return (y.to(out) if late else y), xn.view(shape)


__all__ = ["add_rms_norm", "add_norm_fwd", "add_norm_bwd"]
