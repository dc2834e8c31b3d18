"""The layer glue with its kernel choice: short conv (+ decode step), RMSNorm (also with the residual add before it),
gated RMSNorm, the delta-rule gates, SwiGLU's silu(gate) * up, attention's RoPE on q and k and its sigmoid output
gate, each on its fused Triton kernel (`hybridlm.ops.triton.{conv,norm,add_norm,gates,swiglu,rope}`) or on the
PyTorch op (`hybridlm.ops.rope` for the last two).

Non-standard here:
- `impl` is the layer's: "triton" always takes the kernel (it refuses CPU tensors outside TRITON_INTERPRET=1 and
  float64); "auto" takes it on CUDA for float16/bfloat16/float32 inputs when triton imports; "torch", "naive" and
  "chunk" (the recurrence impls a layer passes on) take the PyTorch op. The choice is a test of the input's device
  and dtype, not a walk of `hybridlm.ops.dispatch`'s backend table (no glue op has more than the two ways, and it
  runs in every layer of every step); its log line is the table's: `dispatch.log_choice`, once per (op, device
  type, choice, reason), into the one set of logged choices.
  `hybridlm.ops.linear_ce` (the LM head's loss) picks its Triton cross-entropy kernel with `use_triton` too.
- The PyTorch gates and silu(gate) * up live here (the other glue ops have theirs in `conv.py` / `norm.py`):
  they are what the layers computed inline, with the same rounding; silu(gate) * up saves only gate and up.
- `causal_conv1d(..., cu_seqlens=)` on PyTorch convolves the packed documents one by one, each from its own
  initial state, as the kernel does; `split=` returns the output as three tensors (views of one on PyTorch).
- `recurrent_decode_step` runs a cached one-token step of GDN / KDA on the fused step kernel, updating the state
  in place, when the recurrence impl resolves to Triton for these inputs; `step_impl` is the impl of the others.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from . import conv as _conv
from . import norm as _norm
from . import rope as _rope
from .dispatch import log_choice, resolve_impl
from .offsets import host_offsets

try:  # the fused kernels (importing them registers their custom ops)
    from . import triton as _tk
    from .triton import add_norm as _taddnorm
    from .triton import ce as _tce
    from .triton import conv as _tconv
    from .triton import gates as _tgates
    from .triton import norm as _tnorm
    from .triton import rope as _trope
    from .triton import swiglu as _tswiglu

    _TRITON_ERROR = None
except ImportError as _e:  # no triton: the PyTorch ops only
    _tk = _tconv = _tgates = _tnorm = _taddnorm = _tswiglu = _tce = _trope = None
    _TRITON_ERROR = repr(_e)

IMPLS = ("auto", "torch", "triton", "naive", "chunk")


def use_triton(op: str, impl: str, x: torch.Tensor) -> bool:
    """True when `impl` resolves to the Triton kernel of glue op `op` for input x (see the module docstring)."""
    if impl not in IMPLS:
        raise ValueError(f"impl: expected one of {IMPLS}, got {impl!r}")
    if impl == "triton":
        if _TRITON_ERROR is not None:
            raise RuntimeError(f"impl: 'triton' was asked for {op}, but the Triton glue kernels do not import "
                               f"({_TRITON_ERROR})")
        return True
    if impl != "auto":
        return False
    why = None
    if x.device.type != "cuda":
        why = f"on {x.device.type}"
    elif x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        why = f"{x.dtype} inputs"
    elif _TRITON_ERROR is not None:
        why = "triton does not import"
    log_choice(op, x.device.type, "torch" if why else "triton",
               None if why is None else f"Triton kernel not used: {why}")
    return why is None


# ---------------------------------------------------------------------------------------------------- conv


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, activation: str | None = None,
    initial_state: torch.Tensor | None = None, output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None, split: tuple[int, int, int] | None = None, impl: str = "auto",
):
    """`hybridlm.ops.causal_conv1d` with packed documents and a split output. x: [B, T, C]; weight: [C, W];
    initial_state: [N, C, W] (N = B, or the documents of cu_seqlens [N+1] with B == 1).
    Returns (y [B, T, C], or with split=(C0, C1, C2) three tensors [B, T, C0], [B, T, C1], [B, T, C2];
    final state [N, C, W] if output_final_state else None)."""
    if use_triton("causal_conv1d", impl, x):
        return _tconv.causal_conv1d(x, weight, bias, activation=activation, initial_state=initial_state,
                                    output_final_state=output_final_state, cu_seqlens=cu_seqlens, split=split)
    if cu_seqlens is None:
        y, ht = _conv.causal_conv1d(x, weight, bias, activation=activation, initial_state=initial_state,
                                    output_final_state=output_final_state)
    else:
        bounds = host_offsets(cu_seqlens)
        parts = [_conv.causal_conv1d(x[:, s:e], weight, bias, activation=activation, output_final_state=True,
                                     initial_state=None if initial_state is None else initial_state[n:n + 1])
                 for n, (s, e) in enumerate(zip(bounds, bounds[1:]))]
        y = torch.cat([p[0] for p in parts], dim=1)
        ht = torch.cat([p[1] for p in parts], dim=0) if output_final_state else None
    return (y if split is None else tuple(y.split(list(split), dim=-1))), ht


def causal_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None = None, *, activation: str | None = None,
                         impl: str = "auto") -> torch.Tensor:
    """One decode step, conv_state [B, C, W] updated in place. x: [B, C]. Returns y [B, C]."""
    if use_triton("causal_conv1d_update", impl, x):
        return _tconv.causal_conv1d_update(x, conv_state, weight, bias, activation=activation)
    return _conv.causal_conv1d_update(x, conv_state, weight, bias, activation=activation)


# ---------------------------------------------------------------------------------------------------- norms


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6, *, zero_centered: bool = False,
             cast_before_weight: bool = True, out_dtype: torch.dtype | None = None,
             impl: str = "auto") -> torch.Tensor:
    """`hybridlm.ops.rms_norm` (x: [..., D], weight [D] or None), on the fused kernel or PyTorch."""
    fn = _tnorm.rms_norm if use_triton("rms_norm", impl, x) else _norm.rms_norm
    return fn(x, weight, eps, zero_centered=zero_centered, cast_before_weight=cast_before_weight,
              out_dtype=out_dtype)


def add_rms_norm(x: torch.Tensor, branch: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6, *,
                 zero_centered: bool = False, cast_before_weight: bool = True,
                 out_dtype: torch.dtype | None = None, impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """`hybridlm.ops.add_rms_norm` (x, branch: [..., D]; weight [D] or None) -> (y, x + branch), on the fused kernel
    (the add and the norm in one pass each way) or PyTorch."""
    fn = _taddnorm.add_rms_norm if use_triton("add_rms_norm", impl, x) else _norm.add_rms_norm
    return fn(x, branch, weight, eps, zero_centered=zero_centered, cast_before_weight=cast_before_weight,
              out_dtype=out_dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6, *,
                   activation: str = "silu", fp32_output: bool = False, impl: str = "auto") -> torch.Tensor:
    """`hybridlm.ops.gated_rms_norm` (x, gate: [..., D]; weight [D] or None), on the fused kernel or PyTorch."""
    fn = _tnorm.gated_rms_norm if use_triton("gated_rms_norm", impl, x) else _norm.gated_rms_norm
    return fn(x, gate, weight, eps, activation=activation, fp32_output=fp32_output)


# ---------------------------------------------------------------------------------------------------- gates


def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, *,
              beta_scale: float = 1.0, impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Gated DeltaNet's gates: g = -exp(A_log) * softplus(a + dt_bias) in float32, beta = beta_scale * sigmoid(b).
    a, b: [B, T, HV]; A_log, dt_bias: [HV]. Returns (g [B, T, HV] float32, beta [B, T, HV] in b's dtype)."""
    if use_triton("gdn_gates", impl, a):
        return _tgates.gdn_gates(a, b, A_log, dt_bias, beta_scale=beta_scale)
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    beta = b.sigmoid()
    if beta_scale != 1.0:
        beta = beta * beta_scale
    return g, beta


# ---------------------------------------------------------------------------------------------------- SwiGLU


class _SiluMul(torch.autograd.Function):
    """silu(gate) * up that keeps only gate and up for the backward (autograd's graph would also keep silu(gate)
    and the product: two more [.., I] tensors per MLP). The backward recomputes silu(gate) and runs the same ops
    autograd runs (mul, silu_backward), so the gradients are bit-identical."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: torch.Tensor):
        gate, up = ctx.saved_tensors
        d_gate = torch.ops.aten.silu_backward(dy * up, gate) if ctx.needs_input_grad[0] else None
        d_up = dy * F.silu(gate) if ctx.needs_input_grad[1] else None
        return d_gate, d_up


def silu_mul(gate: torch.Tensor, up: torch.Tensor, *, impl: str = "auto") -> torch.Tensor:
    """silu(gate) * up, gate and up: [..., I]. On PyTorch in training (same dtypes and shapes, grad needed) through
    `_SiluMul`, which saves less."""
    if use_triton("silu_mul", impl, gate):
        return _tswiglu.silu_mul(gate, up)
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad) and gate.dtype == up.dtype \
            and gate.shape == up.shape:
        return _SiluMul.apply(gate, up)
    return F.silu(gate) * up


# ---------------------------------------------------------------------------------------------------- attention


def rotary(q: torch.Tensor, k: torch.Tensor, position_ids: torch.Tensor, *, rotary_dim: int, theta: float,
           impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on the first rotary_dim channels of q [B, T, nH, hd] and k [B, T, nKV, hd] at position_ids [B|1, T]
    -> q, k [B, T, h, hd]: on the fused kernel (one launch each way, contiguous outputs) or the PyTorch reference
    (`hybridlm.ops.rope.rope_ref`: transposed views of [B, h, T, hd] tensors)."""
    if use_triton("rotary", impl, q):
        return _trope.rotary(q, k, position_ids, rotary_dim=rotary_dim, theta=theta)
    return _rope.rope_ref(q, k, position_ids, rotary_dim=rotary_dim, theta=theta)


def sigmoid_gate(o: torch.Tensor, gate: torch.Tensor, *, impl: str = "auto") -> torch.Tensor:
    """Attention's output gate o [B, T, h, d] * sigmoid(gate [B, T, h, d or 1]), on the fused kernel (contiguous
    output; gate may be a strided slice of the projection) or PyTorch."""
    if use_triton("sigmoid_gate", impl, o):
        return _trope.sigmoid_gate(o, gate)
    return _rope.sigmoid_gate_ref(o, gate)


# ---------------------------------------------------------------------------------------------------- decode


def recurrent_decode_step(op: str, impl: str, state: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor,
                          v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor | None:
    """One cached decode token of `op` ("gated_delta_rule" or "kda") on the fused Triton step kernel, updating
    state [B, HV, K, V] in place (read once, written once, no copy), when the recurrence impl resolves to "triton"
    for these inputs (impl="auto" on CUDA for head dims it takes, or "triton"). Returns o [B, 1, HV, V], or None:
    then the caller runs the op as usual. q, k: [B, 1, H, K]; v: [B, 1, HV, V]; g: [B, 1, HV] (GDN) or
    [B, 1, HV, K] (KDA)."""
    if state is None or q.shape[1] != 1 or torch.is_grad_enabled() and q.requires_grad:
        return None
    # "auto" resolves to "triton" only for inputs the kernels take; an explicit "triton" they do not take raises
    if resolve_impl(op, impl, q.device, q, v) != "triton" or not state.is_contiguous():
        return None
    idx = torch.arange(q.shape[0], device=q.device, dtype=torch.int32)
    step = _tk.fused_recurrent_kda_update if op == "kda" else _tk.fused_recurrent_gated_delta_rule_update
    o = step(q[:, 0], k[:, 0], v[:, 0], g=g[:, 0], beta=beta[:, 0], state_pool=state, state_indices=idx,
             use_qk_l2norm=True, impl="triton")  # decided above: no second choice (or log line) in the step
    return o[:, None]


def step_impl(impl: str, cached: bool, T: int) -> str:
    """The recurrence impl for one call: a single cached decode step uses the token loop ("naive", the recurrent
    form: nothing to chunk) unless a kernel was asked for explicitly; prefill / continuation keep `impl`."""
    if cached and T == 1 and impl in ("auto", "chunk"):
        return "naive"
    return impl
