"""ShortConv: causal depthwise conv over time (the conv in front of q, k, v in GDN / KDA).

Non-standard here: the weight is stored as `[C, 1, W]` (a torch Conv1d weight, the checkpoint layout) and the
op is sequence-first. Packed documents (`cu_seqlens`) are convolved one by one, so a document never reads the
tail of the previous one. `split=(C0, C1, C2)` returns the output as three tensors (the layer's q, k, v): on the fused
training path the kernel writes them as three contiguous tensors and reads their gradients as they are, so the
recurrence copies no strided views and autograd concatenates no gradients; elsewhere they are views of one output.
`use_fused_glue` is the switch every layer uses for its glue (conv, gates, gated norm, SwiGLU): the fused Triton
kernels of `hybridlm.ops.triton.{conv,gates,norm,swiglu}` when the layer's impl resolves to "triton", else the
PyTorch reference.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from hybridlm.ops import causal_conv1d, causal_conv1d_update
from hybridlm.ops.offsets import host_offsets

try:  # the fused glue kernels (registers their custom ops); imported here so forward() holds no import
    from hybridlm.ops.triton import conv as tconv
    from hybridlm.ops.triton import gates as tgates
    from hybridlm.ops.triton import norm as tnorm
    from hybridlm.ops.triton import swiglu as tswiglu

    _GLUE_ERROR = None
except ImportError as _e:  # no triton: the reference glue only
    tconv = tgates = tnorm = tswiglu = None
    _GLUE_ERROR = repr(_e)

log = logging.getLogger("hybridlm.layers")
_GLUE_LOGGED: set[tuple] = set()


def use_fused_glue(impl: str, x: torch.Tensor, where: str, auto: bool = True) -> bool:
    """True when `impl` resolves to the fused Triton glue for input x: impl="triton" always (the kernels refuse
    CPU tensors outside TRITON_INTERPRET=1, and raise for float64), impl="auto" on CUDA for float16/bfloat16/
    float32 when triton imports and the kernel is cleared for "auto" (`auto`; False for a kernel not yet checked
    on a GPU); "naive" and "chunk" never. The choice "auto" makes is logged once per (where, device type, dtype)."""
    if impl == "triton":
        if _GLUE_ERROR is not None:
            raise RuntimeError(f"impl: 'triton' was asked for {where}, but the Triton glue kernels do not import "
                               f"({_GLUE_ERROR})")
        return True
    if impl != "auto":
        return False
    why = None
    if x.device.type != "cuda":
        why = f"on {x.device.type}"
    elif x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        why = f"{x.dtype} inputs"
    elif _GLUE_ERROR is not None:
        why = "triton does not import"
    elif not auto:
        why = "its kernel is not yet cleared for impl='auto'"
    key = (where, x.device.type, x.dtype)
    if key not in _GLUE_LOGGED and not torch.compiler.is_compiling():  # logged by the first eager call
        _GLUE_LOGGED.add(key)
        log.info("hybridlm.layers.%s: impl='auto' picked the %s glue on %s%s", where,
                 "PyTorch reference" if why else "fused Triton", x.device.type, f" ({why})" if why else "")
    return why is None


class ShortConv(nn.Module):
    def __init__(self, channels: int, kernel_size: int = 4, activation: str | None = "silu", impl: str = "auto"):
        super().__init__()
        self.activation, self.impl = activation, impl
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None, cache=None,
                impl: str | None = None, split: tuple[int, int, int] | None = None):
        """x: [B, T, C] -> [B, T, C], or with split=(C0, C1, C2) three tensors [B, T, C0], [B, T, C1], [B, T, C2].
        cu_seqlens: int [N+1] offsets of documents packed in one row (B == 1).
        cache: an object with a `.conv` attribute ([B, C, W] or None): one token updates it in place (decode
        step); several tokens continue from it (prefill / multi-token continuation) and replace it.
        impl: the owning layer's impl (default self.impl); see `use_fused_glue`."""
        w = self.weight.squeeze(1)
        if use_fused_glue(self.impl if impl is None else impl, x, "ShortConv"):
            if cache is None:  # no cache: the kernel itself writes q, k, v as tensors of their own
                return tconv.causal_conv1d(x, w, activation=self.activation, cu_seqlens=cu_seqlens, split=split)[0]
            y = self._fused_cached(x, w, cu_seqlens, cache)
        else:
            y = self._reference(x, w, cu_seqlens, cache)
        return y if split is None else tuple(y.split(list(split), dim=-1))

    def _reference(self, x, w, cu_seqlens, cache):
        if cache is not None:
            if cu_seqlens is not None:
                raise ValueError("cu_seqlens: packed documents cannot be combined with a generation cache")
            if cache.conv is not None and x.shape[1] == 1:
                return causal_conv1d_update(x[:, 0], cache.conv, w, activation=self.activation)[:, None]
            y, cache.conv = causal_conv1d(x, w, activation=self.activation, initial_state=cache.conv,
                                          output_final_state=True)
            return y
        if cu_seqlens is None:
            return causal_conv1d(x, w, activation=self.activation)[0]
        bounds = host_offsets(cu_seqlens)
        parts = [causal_conv1d(x[:, s:e], w, activation=self.activation)[0] for s, e in zip(bounds, bounds[1:])]
        return torch.cat(parts, dim=1)

    def _fused_cached(self, x, w, cu_seqlens, cache):
        if cu_seqlens is not None:
            raise ValueError("cu_seqlens: packed documents cannot be combined with a generation cache")
        if cache.conv is not None and x.shape[1] == 1:
            return tconv.causal_conv1d_update(x[:, 0], cache.conv, w, activation=self.activation)[:, None]
        y, cache.conv = tconv.causal_conv1d(x, w, activation=self.activation, initial_state=cache.conv,
                                            output_final_state=True)
        return y


def decode_step(op: str, impl: str, cache, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor) -> torch.Tensor | None:
    """One cached decode token on the fused Triton step kernel, updating cache.recurrent in place (the state is
    read once and written once, no copy), when the recurrence impl resolves to "triton" for these inputs
    (impl="auto" on CUDA for head dims it takes, or "triton"). Returns o [B, 1, HV, V], or None: then the caller
    runs the op as usual. q, k: [B, 1, H, K]; v: [B, 1, HV, V]; g: [B, 1, HV] (GDN) or [B, 1, HV, K] (KDA)."""
    state = None if cache is None else cache.recurrent
    if state is None or q.shape[1] != 1 or torch.is_grad_enabled() and q.requires_grad:
        return None
    from hybridlm.ops.recurrence import TRITON_SUPPORTS, resolve_impl

    if resolve_impl(op, impl, q.device, q, v) != "triton" or not state.is_contiguous():
        return None
    if op in TRITON_SUPPORTS and TRITON_SUPPORTS[op](q, v) is not None:
        return None  # inputs the kernels do not take: the op path decides (an explicit "triton" raises there)
    from hybridlm.ops import triton as tk

    idx = torch.arange(q.shape[0], device=q.device, dtype=torch.int32)
    step = tk.fused_recurrent_kda_update if op == "kda" else tk.fused_recurrent_gated_delta_rule_update
    o = step(q[:, 0], k[:, 0], v[:, 0], g=g[:, 0], beta=beta[:, 0], state_pool=state, state_indices=idx,
             use_qk_l2norm=True)
    return o[:, None]


def step_impl(impl: str, cache, T: int) -> str:
    """The recurrence impl for one call: a single cached decode step uses the token loop ("naive", the recurrent
    form: nothing to chunk) unless a kernel was asked for explicitly; prefill / continuation keep `impl`."""
    if cache is not None and T == 1 and impl in ("auto", "chunk"):
        return "naive"
    return impl
