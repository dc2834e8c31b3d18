"""Public functional API of the delta-rule family: one function per recurrence, one gate order everywhere.

Non-standard here:
- Gates are keyword-only and always in the order `g` (log-decay, <= 0) then `beta` (write strength).
- `impl` is explicit: "naive" (token loop), "chunk" (WY/UT in PyTorch), "triton" (GPU kernels, registered by
  `hybridlm.ops.triton` when it imports), "gluon" (gated_delta_rule only: the Hopper forward of
  `hybridlm.ops.gluon.gdn_fwd`, no autograd), "auto" (for gated_delta_rule the Gluon forward when no gradient is
  needed and it takes the inputs: sm_90, bf16/fp16, K 64 or 128, V 64 to 256; else triton on CUDA when a kernel
  exists for the op and takes the inputs; else chunk). Training keeps the Triton forward and backward: the Gluon
  forward does not write what the Triton backward reads. The choice "auto" makes is logged once per (op, device
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

import logging
from collections.abc import Callable

import torch
import torch.utils.checkpoint

from .chunk import recurrence_chunk
from .naive import recurrence_naive
from .norm import l2norm
from .offsets import host_offsets, remember_offsets
from .validate import (
    IMPLS,
    Dims,
    check_recurrence_inputs,
    check_state_dtype,
    check_state_pool,
    state_dtype,
)

log = logging.getLogger("hybridlm.ops")

# op name -> callable with the public signature; filled by hybridlm.ops.triton when its kernels import.
TRITON_KERNELS: dict[str, Callable] = {}
# op name -> (q, v) -> None when the kernel takes these inputs, else the reason it does not (impl="auto" then
# falls back to "chunk" and logs why once; an explicit impl="triton" raises the kernel's own error instead)
TRITON_SUPPORTS: dict[str, Callable] = {}
# ops with a forward-only Gluon kernel (impl="gluon"; "auto" takes it where no gradient is needed)
GLUON_OPS = ("gated_delta_rule",)
_LOGGED: set[tuple] = set()


def _gdn_fwd():
    """hybridlm.ops.gluon.gdn_fwd, or None when it does not import (no triton). Imported on first use, not with
    this module: it pulls in Triton, which CPU-only installs may lack."""
    try:
        from .gluon import gdn_fwd
    except ImportError:
        return None
    return gdn_fwd


def gluon_unsupported_reason(q: torch.Tensor, v: torch.Tensor) -> str | None:
    """None when the Gluon GDN forward takes inputs like q and v on this machine, else why not in a few words."""
    mod = _gdn_fwd()
    return "triton does not import" if mod is None else mod.unsupported_reason(q, v)


def gluon_choice(device_type: str, needs_grad: bool, reason: str | None) -> tuple[bool, str | None]:
    """impl="auto"'s rule for the Gluon forward: (take it, why not for the log). It runs on CUDA only and has no
    backward, so off CUDA or with gradients needed the usual choice stands with nothing to log (that is expected,
    not a fallback); otherwise `reason` (gluon_unsupported_reason) decides and is logged when not None."""
    if device_type != "cuda" or needs_grad:
        return False, None
    return reason is None, reason


def _needs_grad(*xs: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in xs)


def resolve_impl(op: str, impl: str, device: torch.device, q: torch.Tensor | None = None,
                 v: torch.Tensor | None = None, *, needs_grad: bool = True) -> str:
    """Turn impl="auto" into a concrete choice and refuse impossible explicit ones. With q and v given, "auto"
    uses the Triton kernel only for inputs it supports (head dims, dtype) and logs the fallback once.
    needs_grad: whether gradients will flow through this call. The default keeps callers that do not say off the
    forward-only Gluon kernel; the ops pass what their inputs need."""
    if impl == "gluon":
        if op not in GLUON_OPS:
            others = tuple(i for i in IMPLS if i != "gluon")
            raise ValueError(f"impl: expected one of {others} for {op} ('gluon' runs {', '.join(GLUON_OPS)} only), "
                             "got 'gluon'")
        if needs_grad:
            raise RuntimeError(f"impl: 'gluon' was asked for {op}, but it is forward only and these inputs need "
                               "gradients (use impl='triton' or 'auto' for training, or run under torch.no_grad)")
        why = None if q is None else gluon_unsupported_reason(q, v)
        if why is not None:
            raise RuntimeError(f"impl: 'gluon' was asked for {op}, but the Gluon forward does not take these inputs "
                               f"here: {why}")
    if impl == "triton" and op not in TRITON_KERNELS:
        raise RuntimeError(
            f"impl: 'triton' was asked for {op}, but no Triton kernel is registered for it "
            "(import hybridlm.ops.triton on a machine with triton installed)"
        )
    if impl == "auto":
        impl = "triton" if (device.type == "cuda" and op in TRITON_KERNELS) else "chunk"
        whys = []
        if impl == "triton" and q is not None and op in TRITON_SUPPORTS:
            why = TRITON_SUPPORTS[op](q, v)
            if why is not None:
                impl = "chunk"
                whys.append(f"Triton kernel not used: {why}")
        # under torch.compile the Triton kernels trace as custom ops with fake kernels; the Gluon launch is plain
        # Python, so compiled code keeps the Triton path
        if op in GLUON_OPS and q is not None and not torch.compiler.is_compiling():
            reason = gluon_unsupported_reason(q, v) if device.type == "cuda" and not needs_grad else None
            take, why = gluon_choice(device.type, needs_grad, reason)
            if take:
                impl, whys = "gluon", []
            elif why is not None:
                whys.insert(0, f"Gluon forward not used: {why}")
        why = "; ".join(whys) or None
        key = (op, device.type, impl, why)
        if key not in _LOGGED:
            _LOGGED.add(key)
            log.info("hybridlm.ops.%s: impl='auto' picked %r on %s%s", op, impl, device.type,
                     f" ({why})" if why else "")
    return impl


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _run(
    op: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    g: torch.Tensor | None,
    beta: torch.Tensor | None,
    delta: bool,
    dims: Dims,
    scale: float | None,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    cu_seqlens: torch.Tensor | None,
    use_qk_l2norm: bool,
    chunk_size: int,
    impl: str,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Shared body of the five ops for the PyTorch paths (naive, chunk)."""
    cd = _compute_dtype(q)
    _check_state_dtype(q, initial_state)
    H, HV, K, V, N = dims.H, dims.HV, dims.K, dims.V, dims.N
    out_dtype = q.dtype
    scale = K**-0.5 if scale is None else float(scale)

    # Everything in the compute dtype; q/k normalised (eps inside the rsqrt, as transformers and fla), q scaled.
    q, k, v = q.to(cd), k.to(cd), v.to(cd)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * scale
    if HV != H:  # grouped value attention: value head h reads key head h // (HV / H)
        q, k = q.repeat_interleave(HV // H, dim=2), k.repeat_interleave(HV // H, dim=2)
    if g is not None:
        g = g.to(cd)
        if g.dim() == 3:
            g = g.unsqueeze(-1)  # scalar per head: [B, T, HV, 1]
    if beta is not None:
        beta = beta.to(cd)

    state = initial_state if initial_state is not None else q.new_zeros(N, HV, K, V)
    core = recurrence_naive if impl == "naive" else recurrence_chunk
    kwargs = {} if impl == "naive" else {"chunk_size": chunk_size}

    if cu_seqlens is None:
        o, final = core(q, k, v, g=g, beta=beta, delta=delta, state_BHKV=state, **kwargs)
    else:  # varlen: each packed sequence starts from its own state
        bounds = host_offsets(cu_seqlens)
        outs, finals = [], []
        for n in range(N):
            s, e = bounds[n], bounds[n + 1]
            o_n, f_n = core(
                q[:, s:e],
                k[:, s:e],
                v[:, s:e],
                g=None if g is None else g[:, s:e],
                beta=None if beta is None else beta[:, s:e],
                delta=delta,
                state_BHKV=state[n : n + 1],
                **kwargs,
            )
            outs.append(o_n)
            finals.append(f_n)
        o, final = torch.cat(outs, dim=1), torch.cat(finals, dim=0)
    return o.to(out_dtype), (final if output_final_state else None)


def _dispatch(op: str, g_kind: str, delta: bool, q, k, v, *, g, beta, scale, initial_state, output_final_state,
              cu_seqlens, use_qk_l2norm, chunk_size, impl, recompute=False, state_pool=None, state_indices=None):
    cu_seqlens = _versioned(cu_seqlens)
    dims = check_recurrence_inputs(
        q, k, v, g=g, g_kind=g_kind, beta=beta, initial_state=initial_state, cu_seqlens=cu_seqlens,
        chunk_size=chunk_size, impl=impl, mixed_qk=True,
    )
    needs_grad = _needs_grad(q, k, v, g, beta, initial_state)
    if initial_state is not None:
        check_state_dtype("initial_state", initial_state, v.dtype)
        initial_state = initial_state.to(state_dtype(v.dtype))
    q, k = q.to(v.dtype), k.to(v.dtype)
    cu_seqlens = _int32_offsets(cu_seqlens)
    impl = resolve_impl(op, impl, q.device, q, v, needs_grad=needs_grad)
    if state_pool is None and state_indices is None:
        return _dispatch_checked(op, delta, dims, q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                                 output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                 use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size, impl=impl, recompute=recompute)
    check_state_pool(state_pool, state_indices, initial_state=initial_state, dims=dims, dtype=_compute_dtype(q),
                     device=q.device)
    if impl == "gluon" and dims.T > 0 and state_pool.is_contiguous():
        # the Gluon forward reads and writes the pool's rows itself: no gather, no scatter
        return _gdn_fwd().gated_delta_rule_fwd(
            q, k, v, g=g, beta=beta, scale=scale, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
            use_qk_l2norm=use_qk_l2norm, state_pool=state_pool, state_indices=state_indices,
        )
    # a pool of states (chunked prefill in a server): sequence n starts from row state_indices[n] and its final
    # state is written back there; one gather before, one scatter after, any impl
    rows = state_indices.long()  # index_copy_ takes int64 rows only
    h0 = state_pool.index_select(0, rows)
    o, final = _dispatch_checked(op, delta, dims, q, k, v, g=g, beta=beta, scale=scale, initial_state=h0,
                                 output_final_state=True, cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm,
                                 chunk_size=chunk_size, impl=impl, recompute=recompute)
    state_pool.index_copy_(0, rows, final.detach())
    return o, (final if output_final_state else None)


def _versioned(cu_seqlens):
    """An inference tensor (no version counter, so never recorded by `host_offsets`) as a normal copy, so that the
    offsets are read once per call and the copy may be saved for a backward; anything else as it is."""
    if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.is_inference():
        with torch.inference_mode(False):
            return cu_seqlens.clone()
    return cu_seqlens


def _int32_offsets(cu_seqlens: torch.Tensor | None) -> torch.Tensor | None:
    """Validated offsets as the int32 tensor the kernels read, the host copy recorded with it: int64 offsets would
    otherwise be converted, and read back, in every kernel call."""
    if cu_seqlens is None or cu_seqlens.dtype == torch.int32:
        return cu_seqlens
    with torch.inference_mode(False):  # a normal tensor, so that the record holds under inference_mode too
        cu32 = cu_seqlens.to(torch.int32)
    return remember_offsets(cu32, host_offsets(cu_seqlens))


def _check_state_dtype(q: torch.Tensor, initial_state: torch.Tensor | None) -> None:
    cd = _compute_dtype(q)
    if initial_state is not None and initial_state.dtype != cd:
        raise TypeError(f"initial_state: expected dtype {cd} for {q.dtype} inputs, got {initial_state.dtype}")


def _dispatch_checked(op: str, delta: bool, dims: Dims, q, k, v, *, g, beta, scale, initial_state,
                      output_final_state, cu_seqlens, use_qk_l2norm, chunk_size, impl, recompute):
    """The op on checked inputs with a resolved impl (not "auto")."""
    out_dtype = q.dtype
    if dims.T == 0:  # nothing to run: empty output, state passed through
        _check_state_dtype(q, initial_state)
        cd = _compute_dtype(q)
        final = initial_state if initial_state is not None else q.new_zeros(dims.N, dims.HV, dims.K, dims.V, dtype=cd)
        return v.new_zeros(dims.B, 0, dims.HV, dims.V, dtype=out_dtype), (final if output_final_state else None)
    if impl == "triton":
        return TRITON_KERNELS[op](
            q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm,
            recompute=recompute,
        )
    if impl == "gluon":  # forward only (resolve_impl refused gradients); recompute has nothing to keep
        _check_state_dtype(q, initial_state)
        return _gdn_fwd().gated_delta_rule_fwd(
            q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm,
        )

    def run(q, k, v, g, beta, initial_state):
        return _run(
            op, q, k, v, g=g, beta=beta, delta=delta, dims=dims, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm,
            chunk_size=chunk_size, impl=impl,
        )

    if recompute and torch.is_grad_enabled():  # the PyTorch paths: the same contract through autograd's checkpoint
        return torch.utils.checkpoint.checkpoint(run, q, k, v, g, beta, initial_state, use_reentrant=False)
    return run(q, k, v, g, beta, initial_state)


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
    impl: "auto" | "naive" | "chunk" | "triton" | "gluon" (gated_delta_rule only: the sm_90 forward, no autograd;
    "auto" takes it when no gradient is needed and it takes the inputs, see the module docstring).
    recompute: keep only the inputs for the backward and compute the forward's intermediates again there (less
    activation memory for one more forward of this op; the Triton kernels rerun their forward kernels, the PyTorch
    paths run under torch.utils.checkpoint). Outputs and gradients are the same.
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated DeltaNet: S_t = e^{g_t} S_{t-1} + beta_t k_t (v_t - e^{g_t} S_{t-1}^T k_t)^T,  o_t = S_t^T q_t.

    g: [B, T, HV] log-decay (<= 0), one per value head; beta: [B, T, HV] write strength in (0, 2)
    (beta > 1 gives the transition negative eigenvalues, as OLMo-Hybrid allows)."""
    return _dispatch("gated_delta_rule", "scalar", True, q, k, v, g=g, beta=beta, scale=scale,
                     initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                     use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size, impl=impl,
                     recompute=recompute, state_pool=state_pool, state_indices=state_indices)


def kda(
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Kimi Delta Attention: the gated delta rule with one log-decay per key channel,
    S_t = diag(e^{g_t}) S_{t-1} + beta_t k_t (v_t - (diag(e^{g_t}) S_{t-1})^T k_t)^T.

    g: [B, T, HV, K] log-decay (<= 0); beta: [B, T, HV]."""
    return _dispatch("kda", "channel", True, q, k, v, g=g, beta=beta, scale=scale,
                     initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                     use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size, impl=impl,
                     recompute=recompute, state_pool=state_pool, state_indices=state_indices)


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
    return _dispatch("delta_rule", "none", True, q, k, v, g=None, beta=beta, scale=scale,
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
    return _dispatch("gated_linear_attention", "scalar_or_channel", False, q, k, v, g=g, beta=beta, scale=scale,
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
    return _dispatch("linear_attention", "none", False, q, k, v, g=None, beta=None, scale=scale,
                     initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                     use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size, impl=impl,
                     recompute=recompute, state_pool=state_pool, state_indices=state_indices)


for _f in (gated_delta_rule, kda, delta_rule, gated_linear_attention, linear_attention):
    _f.__doc__ = (_f.__doc__ or "") + "\n" + _COMMON_DOC
