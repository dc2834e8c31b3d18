"""Triton kernel for the delta-rule gates: the log-decay g and the write strength beta in one pass, with backward.

    g[..., h, k] = -exp(A_log[h]) * softplus(a[..., h, k] + dt_bias[h, k])   (fp32 out)
    beta[..., h] = beta_scale * sigmoid(b[..., h])                            (out in b's dtype)

Non-standard here:
- One kernel for both layers: GatedDeltaNet has one decay per value head (KG = 1: a [.., HV], dt_bias [HV]);
  Kimi's KDA has one per key channel (KG = head dim: a = f [.., H * KG] before the bias, dt_bias [H * KG],
  A_log one per head). softplus(x) = x for x > 20, log1p(e^x) else, as F.softplus and Kimi's code write it
  (log1p computed stably in fp32: e^x is rounded away from 1 + e^x for very negative x).
- `kda_decay` is g alone (`hybridlm.ops.kda_gate` with fused=True: a cached KDA decode token's gate; the chunked
  KDA op takes its gate inside its own kernels): b has no columns, so the beta part of both kernels is masked off;
  the decay's head count is A_log's, not b's.
- beta_scale 2 is OLMo-Hybrid's layout (negative eigenvalues); the scale multiplies in fp32 before the cast.
- Backward: da, db per element; dA_log and ddt_bias are row sums, reduced through per-program fp32 partials
  summed on the host (deterministic).
Custom ops: `hybridlm::gates_fwd`, `hybridlm::gates_bwd`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .conv import _check_device, _check_tensor
from .custom import call, custom_op
from .tune import cdiv, next_pow2

POISON = False  # tests set this: outputs start as NaN so an unwritten element shows
MAX_COLS = 16384


@triton.jit
def _softplus(x):
    """(softplus(x), its derivative sigmoid(x)); x for x > 20 (derivative 1)."""
    e = tl.exp(-tl.abs(x))  # in (0, 1]
    u = 1.0 + e
    l1p = tl.where(u == 1.0, e, tl.log(u) * e / tl.where(u == 1.0, 1.0, u - 1.0))  # log1p(e), accurate for small e
    sp = tl.where(x > 20.0, x, tl.maximum(x, 0.0) + l1p)
    s = tl.where(x >= 0, 1.0 / u, e / u)
    return sp, tl.where(x > 20.0, 1.0, s)


@triton.jit
def _gates_fwd(a, A_log, dt_bias, b, g, beta, M, D, HV, KG, scale, BM: tl.constexpr, BD: tl.constexpr,
               BH: tl.constexpr):
    """Grid (M / BM): rows of a [M, D = HV * KG] -> g, rows of b [M, HV] -> beta."""
    i_m = tl.program_id(0)
    o_m = (i_m * BM + tl.arange(0, BM)).to(tl.int64)
    o_d = tl.arange(0, BD)
    m = (o_m < M)[:, None] & (o_d < D)[None, :]
    b_A = -tl.exp(tl.load(A_log + o_d // KG, mask=o_d < D, other=0.0).to(tl.float32))
    b_x = tl.load(a + o_m[:, None] * D + o_d[None, :], mask=m, other=0.0).to(tl.float32)
    b_x += tl.load(dt_bias + o_d, mask=o_d < D, other=0.0).to(tl.float32)[None, :]
    b_sp, _ = _softplus(b_x)
    tl.store(g + o_m[:, None] * D + o_d[None, :], b_A[None, :] * b_sp, mask=m)
    o_h = tl.arange(0, BH)
    mh = (o_m < M)[:, None] & (o_h < HV)[None, :]
    b_b = tl.load(b + o_m[:, None] * HV + o_h[None, :], mask=mh, other=0.0).to(tl.float32)
    tl.store(beta + o_m[:, None] * HV + o_h[None, :], (scale * tl.sigmoid(b_b)).to(beta.dtype.element_ty), mask=mh)


@triton.jit
def _gates_bwd(a, A_log, dt_bias, b, dg, dbeta, da, db, dAp, ddtp, M, D, HV, KG, scale, NP,
               BM: tl.constexpr, BD: tl.constexpr, BH: tl.constexpr):
    """Grid (NP): program p takes row blocks p, p + NP, ...; writes da, db there and its column sums of
    dg * g (-> dA_log) and da (-> ddt_bias) to row p of dAp, ddtp [NP, D]."""
    i_p = tl.program_id(0)
    o_d = tl.arange(0, BD)
    o_h = tl.arange(0, BH)
    b_A = -tl.exp(tl.load(A_log + o_d // KG, mask=o_d < D, other=0.0).to(tl.float32))
    b_dt = tl.load(dt_bias + o_d, mask=o_d < D, other=0.0).to(tl.float32)
    b_sA = tl.zeros([BD], dtype=tl.float32)
    b_sdt = tl.zeros([BD], dtype=tl.float32)
    for i_m in range(i_p, tl.cdiv(M, BM), NP):
        o_m = (i_m * BM + tl.arange(0, BM)).to(tl.int64)
        m = (o_m < M)[:, None] & (o_d < D)[None, :]
        b_x = tl.load(a + o_m[:, None] * D + o_d[None, :], mask=m, other=0.0).to(tl.float32) + b_dt[None, :]
        b_sp, b_s = _softplus(b_x)
        b_dg = tl.load(dg + o_m[:, None] * D + o_d[None, :], mask=m, other=0.0).to(tl.float32)
        b_da = b_dg * b_A[None, :] * b_s
        tl.store(da + o_m[:, None] * D + o_d[None, :], b_da.to(da.dtype.element_ty), mask=m)
        b_sA += tl.sum(b_dg * b_A[None, :] * b_sp, 0)  # d g / d A_log = g
        b_sdt += tl.sum(b_da, 0)
        mh = (o_m < M)[:, None] & (o_h < HV)[None, :]
        b_b = tl.load(b + o_m[:, None] * HV + o_h[None, :], mask=mh, other=0.0).to(tl.float32)
        b_sb = tl.sigmoid(b_b)
        b_dbeta = tl.load(dbeta + o_m[:, None] * HV + o_h[None, :], mask=mh, other=0.0).to(tl.float32)
        tl.store(db + o_m[:, None] * HV + o_h[None, :], (b_dbeta * scale * b_sb * (1.0 - b_sb)).to(
            db.dtype.element_ty), mask=mh)
    tl.store(dAp + i_p.to(tl.int64) * D + o_d, b_sA, mask=o_d < D)
    tl.store(ddtp + i_p.to(tl.int64) * D + o_d, b_sdt, mask=o_d < D)


def _out(shape, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if POISON:
        return torch.full(shape, float("nan"), device=like.device, dtype=dtype)
    return torch.empty(shape, device=like.device, dtype=dtype)


def _blocks(D: int, HV: int) -> tuple[int, int, int]:
    BD, BH = next_pow2(D), next_pow2(max(HV, 1))
    return BD, BH, max(1, min(64, 4096 // BD))


@custom_op("gates_fwd")
def gates_fwd(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, scale: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """a: [M, HV * KG]; b: [M, HV]; A_log: [HV]; dt_bias: [HV * KG]. Returns (g [M, HV * KG] fp32, beta [M, HV])."""
    M, D = a.shape
    HV, NA = b.shape[1], A_log.numel()
    BD, BH, BM = _blocks(D, HV)
    g = _out((M, D), a, torch.float32)
    beta = _out((M, HV), a, b.dtype)
    if M > 0:
        _gates_fwd[(cdiv(M, BM),)](a, A_log, dt_bias, b, g, beta, M, D, HV, D // NA, scale, BM=BM, BD=BD,
                                          BH=BH, num_warps=4)
    return g, beta


@gates_fwd.register_fake
def _(a, b, A_log, dt_bias, scale):
    return a.new_empty(a.shape, dtype=torch.float32), torch.empty_like(b)


@custom_op("gates_bwd")
def gates_bwd(dg: torch.Tensor, dbeta: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
              dt_bias: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (da, db, dA_log, ddt_bias), each in its input's dtype."""
    M, D = a.shape
    HV, NA = b.shape[1], A_log.numel()
    BD, BH, BM = _blocks(D, HV)
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count if a.device.type == "cuda" else 1
    NP = max(1, min(cdiv(M, BM), 4 * sms))
    da = _out((M, D), a, a.dtype)
    db = _out((M, HV), a, b.dtype)
    dAp = torch.zeros(NP, D, device=a.device, dtype=torch.float32)
    ddtp = torch.zeros(NP, D, device=a.device, dtype=torch.float32)
    if M > 0:
        _gates_bwd[(NP,)](a, A_log, dt_bias, b, dg.contiguous(), dbeta.contiguous(), da, db, dAp, ddtp, M, D, HV,
                          D // NA, scale, NP, BM=BM, BD=BD, BH=BH, num_warps=4)
    dA = dAp.sum(0).view(NA, D // NA).sum(1).to(A_log.dtype)
    return da, db, dA, ddtp.sum(0).to(dt_bias.dtype)


@gates_bwd.register_fake
def _(dg, dbeta, a, b, A_log, dt_bias, scale):
    return torch.empty_like(a), torch.empty_like(b), torch.empty_like(A_log), torch.empty_like(dt_bias)


class _Gates(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, A_log, dt_bias, scale):
        g, beta = call("gates_fwd", a, b, A_log, dt_bias, scale)
        ctx.save_for_backward(a, b, A_log, dt_bias)
        ctx.scale = scale
        return g, beta

    @staticmethod
    def backward(ctx, dg, dbeta):
        a, b, A_log, dt_bias = ctx.saved_tensors
        if dg is None:
            dg = torch.zeros(a.shape, device=a.device, dtype=torch.float32)
        if dbeta is None:
            dbeta = torch.zeros_like(b)
        da, db, dA, ddt = call("gates_bwd", dg, dbeta, a, b, A_log, dt_bias, ctx.scale)
        return da, db, dA, ddt, None


def _check(a, b, A_log, dt_bias, HV: int, KG: int) -> None:
    for name, x in (("a", a), ("b", b), ("A_log", A_log), ("dt_bias", dt_bias)):
        _check_tensor(name, x)
    if HV * KG > MAX_COLS:
        raise ValueError(f"a: expected at most {MAX_COLS} gate channels per token, got {HV * KG}")
    if A_log.numel() != HV:
        raise ValueError(f"A_log: expected {HV} elements (one per head), got shape {tuple(A_log.shape)}")
    if dt_bias.numel() != HV * KG:
        raise ValueError(f"dt_bias: expected {HV * KG} elements, got shape {tuple(dt_bias.shape)}")


def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, *,
              beta_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """GatedDeltaNet gates. a, b: [B, T, HV]; A_log, dt_bias: [HV].
    Returns (g [B, T, HV] fp32, beta [B, T, HV] in b's dtype); differentiable in all four inputs."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise TypeError(f"a, b: expected torch.Tensors, got {type(a).__name__}, {type(b).__name__}")
    if a.dim() < 1 or b.shape != a.shape:
        raise ValueError(f"b: expected the shape of a [B, T, HV] {tuple(a.shape)}, got {tuple(b.shape)}")
    HV = a.shape[-1]
    _check(a, b, A_log, dt_bias, HV, 1)
    if tuple(A_log.shape) != (HV,) or tuple(dt_bias.shape) != (HV,):
        raise ValueError(f"A_log, dt_bias: expected shape ({HV},) ([HV]), got {tuple(A_log.shape)}, "
                         f"{tuple(dt_bias.shape)}")
    _check_device("a", a)
    g, beta = _Gates.apply(a.reshape(-1, HV).contiguous(), b.reshape(-1, HV).contiguous(), A_log.contiguous(),
                           dt_bias.contiguous(), float(beta_scale))
    return g.view(a.shape), beta.view(b.shape)


def kda_gates(f: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, *,
              beta_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Kimi's channel-wise gates. f: [B, T, H * K] (the low-rank projection, before dt_bias); b: [B, T, H];
    A_log: H elements (any shape, e.g. [1, 1, H, 1]); dt_bias: [H * K].
    Returns (g [B, T, H, K] fp32, beta [B, T, H] in b's dtype); differentiable in all four inputs."""
    if not isinstance(f, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise TypeError(f"f, b: expected torch.Tensors, got {type(f).__name__}, {type(b).__name__}")
    if f.dim() < 1 or b.dim() != f.dim() or b.shape[:-1] != f.shape[:-1] or f.shape[-1] % max(b.shape[-1], 1):
        raise ValueError(f"f, b: expected [B, T, H * K] and [B, T, H], got {tuple(f.shape)}, {tuple(b.shape)}")
    H = b.shape[-1]
    K = f.shape[-1] // H
    _check(f, b, A_log, dt_bias, H, K)
    _check_device("f", f)
    g, beta = _Gates.apply(f.reshape(-1, H * K).contiguous(), b.reshape(-1, H).contiguous(),
                           A_log.reshape(H), dt_bias.reshape(H * K), float(beta_scale))
    return g.view(*f.shape[:-1], H, K), beta.view(b.shape)


def kda_decay(raw: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """Kimi's log-decay alone: raw [..., HV, K]; A_log [HV]; dt_bias [HV * K] (checked by the caller,
    `hybridlm.ops.kda_gate`). Returns g [..., HV, K] fp32; differentiable in all three."""
    HV, K = raw.shape[-2], raw.shape[-1]
    _check_device("g", raw)
    a = raw.reshape(-1, HV * K).contiguous()
    g, _ = _Gates.apply(a, a.new_empty(a.shape[0], 0), A_log.contiguous(), dt_bias.contiguous(), 1.0)
    return g.view(raw.shape)


__all__ = ["gdn_gates", "kda_gates", "kda_decay", "gates_fwd", "gates_bwd"]
