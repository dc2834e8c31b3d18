"""Public functional API of the delta-rule family: one function per recurrence, one gate order everywhere.

Non-standard here:
- Gates are keyword-only and always in the order `g` (log-decay, <= 0) then `beta` (write strength).
- `impl` is explicit: "naive" (token loop), "chunk" (WY/UT in PyTorch), "triton" (GPU kernels, registered by
  `hybridlm.ops.triton` when it imports), "gluon" (gated_delta_rule and kda only: the Hopper forwards of
  `hybridlm.ops.gluon.gdn_fwd` and `kda_fwd`, no autograd), "auto" (for those two the Gluon forward when no gradient is
  needed and it takes the inputs: sm_90, bf16/fp16, K 64 or 128, V 64 to 256; else triton on CUDA when a kernel
  exists for the op and takes the inputs; else chunk). Training keeps the Triton forward and backward: the Gluon
  forward does not write what the Triton backward reads. Every call goes one way, `hybridlm.ops.dispatch`: the
  inputs checked and cast once, the backend chosen from one table, "auto"'s choice logged once per (op, device
  type, impl, reason a faster path was not taken), never changed silently afterwards.
- q and k are cast to v's dtype (fla's callers pass float32 q, k with 16-bit v), and the op then runs as on inputs
  all in v's dtype; o comes back in v's dtype. v's dtype rather than the promoted one: 16-bit values keep the
  16-bit kernels, and o is in the dtype of the values it mixes (as in fla).
- Compute dtype is float64 for float64 values and float32 otherwise; the state is kept in that dtype. An
  initial_state in a narrower float (bf16, fp16; float32 for a float64 state) is upcast for the compute and the
  final state comes back in the state dtype; a wider one is refused rather than rounded. A state_pool must be in the
  state dtype (no cast): it is read and written in place across calls, so a 16-bit pool would round each
  sequence's state at the end of every call, and a chunked prefill would depend on where it was cut.
- cu_seqlens may be int32 or int64 and may be an inference tensor (`torch.inference_mode`), which has no version
  counter for `hybridlm.ops.offsets` to key its host copy by: it is copied into a normal tensor once a call.
- Values are not range-checked (g <= 0, beta in (0, 2)): that would need a device sync on every call.
"""

from __future__ import annotations

import torch

# the dispatch's table and choice, re-exported: hybridlm.ops.triton registers its kernels in TRITON_KERNELS and
# TRITON_SUPPORTS, and the other ops choose their impl with resolve_impl
from .dispatch import (  # noqa: F401
    GLUON_OPS,
    TRITON_KERNELS,
    TRITON_SUPPORTS,
    dispatch,
    gluon_unsupported_reason,
    resolve_impl,
)

_COMMON_DOC = """
    q, k: [B, T, H, K]; v: [B, T, HV, V] with HV a multiple of H (value head h reads key head h // (HV / H)).
    q and k may be in another floating dtype than v: they are cast to v's dtype, which the op computes in.
    scale: multiplies q after the optional l2 norm; default K ** -0.5.
    initial_state: [N, HV, K, V], N = B or the number of varlen sequences; the state is float32 (float64 for float64
    v): a narrower float (bf16, fp16) is upcast, a wider one refused.
    output_final_state: also return the state after the last step ([N, HV, K, V], in the state dtype); otherwise
    None is returned.
    cu_seqlens: int32/int64 [N+1] offsets of sequences packed into one row (B must be 1), FlashAttention-style;
    inference tensors are taken.
    use_qk_l2norm: normalise q and k over K as x * rsqrt(sum(x^2) + 1e-6) before the recurrence.
    chunk_size: 16, 32, 64 or 128, used by impl="chunk".
    state_pool, state_indices: instead of initial_state, a pool [P, HV, K, V] (in the state dtype, not cast: it is
    updated in place) and int rows [N]:
    sequence n starts from state_pool[state_indices[n]] and its final state is written back there in place
    (chunked prefill and continuation in a server; rows distinct and in range, not checked).
    impl: "auto" | "naive" | "chunk" | "triton" | "gluon" (gated_delta_rule, kda: the sm_90 forward, no autograd;
    "auto" takes it when no gradient is needed and it takes the inputs, see the module docstring).
    recompute: keep only the inputs for the backward and compute the forward's intermediates again there (less
    activation memory for one more forward of this op; the Triton kernels rerun their forward kernels, the PyTorch
    paths run under torch.utils.checkpoint). Outputs and gradients are the same.
    cp_group (gated_delta_rule, kda): a torch.distributed ProcessGroup over which the sequence is split (context
    parallelism, `hybridlm.ops.context_parallel`): each rank passes its contiguous slice in rank order (under varlen
    equal slices and the global cu_seqlens) and gets its slice of o; initial_state applies at the start of the whole
    sequence, is passed by every rank and its gradient is the sum over ranks; the final state is the last rank's,
    returned on every rank (count its gradient on one); every rank must backpropagate through its o. No state pool.
    Returns (o [B, T, HV, V] in v's dtype, final_state or None).
"""


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm: bool = False,
    chunk_size: int = 64,
    impl: str = "auto",
    recompute: bool = False,
    state_pool: torch.Tensor | None = None,
    state_indices: torch.Tensor | None = None,
    cp_group=None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated DeltaNet: S_t = e^{g_t} S_{t-1} + beta_t k_t (v_t - e^{g_t} S_{t-1}^T k_t)^T,  o_t = S_t^T q_t.

    g: [B, T, HV] log-decay (<= 0), one per value head; beta: [B, T, HV] write strength in (0, 2)
    (beta > 1 gives the transition negative eigenvalues, as OLMo-Hybrid allows)."""
    return dispatch("gated_delta_rule", "scalar", True, q, k, v, g=g, beta=beta, scale=scale,
                     initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                     use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size, impl=impl,
                     recompute=recompute, state_pool=state_pool, state_indices=state_indices, cp_group=cp_group)


def kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm: bool = False,
    chunk_size: int = 64,
    impl: str = "auto",
    recompute: bool = False,
    state_pool: torch.Tensor | None = None,
    state_indices: torch.Tensor | None = None,
    cp_group=None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Kimi Delta Attention: the gated delta rule with one log-decay per key channel,
    S_t = diag(e^{g_t}) S_{t-1} + beta_t k_t (v_t - (diag(e^{g_t}) S_{t-1})^T k_t)^T.

    g: [B, T, HV, K] log-decay (<= 0); beta: [B, T, HV].
    Kimi's gate inside the op: with A_log ([HV]) or lower_bound given, g is the raw gate input and the log-decay
    is -exp(A_log) * softplus(g + dt_bias), or lower_bound * sigmoid(exp(A_log) * (g + dt_bias)) with lower_bound
    (< 0; A_log may then be None: exp(A_log) = 1); dt_bias: [HV * K] or None (`hybridlm.ops.kda_gate`). Gradients
    reach g, A_log and dt_bias."""
    return dispatch("kda", "channel", True, q, k, v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias,
                     lower_bound=lower_bound, scale=scale,
                     initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                     use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size, impl=impl,
                     recompute=recompute, state_pool=state_pool, state_indices=state_indices, cp_group=cp_group)


def delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm: bool = False,
    chunk_size: int = 64,
    impl: str = "auto",
    recompute: bool = False,
    state_pool: torch.Tensor | None = None,
    state_indices: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """DeltaNet (no decay): S_t = S_{t-1} + beta_t k_t (v_t - S_{t-1}^T k_t)^T. beta: [B, T, HV]."""
    return dispatch("delta_rule", "none", True, q, k, v, g=None, beta=beta, scale=scale,
                     initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                     use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size, impl=impl,
                     recompute=recompute, state_pool=state_pool, state_indices=state_indices)


def gated_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    g: torch.Tensor,
    beta: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm: bool = False,
    chunk_size: int = 64,
    impl: str = "auto",
    recompute: bool = False,
    state_pool: torch.Tensor | None = None,
    state_indices: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated linear attention (Hebbian write, no delta): S_t = diag(e^{g_t}) S_{t-1} + beta_t k_t v_t^T.

    This is seed 002's lambda/eta update: lambda_t = e^{g_t}, eta_t = beta_t. g: [B, T, HV] (scalar decay,
    Mamba2-like) or [B, T, HV, K] (per channel, GLA); beta: optional [B, T, HV] write gate (1 when None)."""
    return dispatch("gated_linear_attention", "scalar_or_channel", False, q, k, v, g=g, beta=beta, scale=scale,
                     initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                     use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size, impl=impl,
                     recompute=recompute, state_pool=state_pool, state_indices=state_indices)


def linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm: bool = False,
    chunk_size: int = 64,
    impl: str = "auto",
    recompute: bool = False,
    state_pool: torch.Tensor | None = None,
    state_indices: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Plain (unnormalised) linear attention: S_t = S_{t-1} + k_t v_t^T, o_t = S_t^T q_t."""
    return dispatch("linear_attention", "none", False, q, k, v, g=None, beta=None, scale=scale,
                     initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                     use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size, impl=impl,
                     recompute=recompute, state_pool=state_pool, state_indices=state_indices)


for _f in (gated_delta_rule, kda, delta_rule, gated_linear_attention, linear_attention):
    _f.__doc__ = (_f.__doc__ or "") + "\n" + _COMMON_DOC
