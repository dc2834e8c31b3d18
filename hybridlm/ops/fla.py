"""fla-core 0.6.0's call signatures over our ops: `chunk_gated_delta_rule`, `fused_recurrent_gated_delta_rule`,
`chunk_kda` and `fused_recurrent_kda`, so that code written against `fla.ops` runs on hybridlm by changing its
import (docs/fla.md lists what maps to what and what differs).

Non-standard here (everything else is `gated_delta_rule` / `kda` / `delta_rule` with impl="auto"):
- Argument names, order, defaults, return values and the checks are fla 0.6.0's, including its error types
  (some are bare `assert`s, `head_first` raises DeprecationWarning as an exception) and the unknown keywords it
  ignores through `**kwargs`. These functions take gates positionally, after v: `g` then `beta`.
- What our ops do not take is done here in PyTorch, under autograd: the sigmoid on beta
  (`use_beta_sigmoid_in_kernel`, x2 with `allow_neg_eigval`), GDN's gate from raw inputs (`use_gate_in_kernel`
  with A_log / dt_bias; KDA's goes to `kda`'s own gate arguments), the V-first state layout (`state_v_first`),
  a beta or decay per value channel (fused_recurrent only), and chunk_kda's `return_intermediate_states` (the op
  is run chunk by chunk).
- Input dtypes follow fla, not our ops' rule: q, k, v of different dtypes are promoted to the widest
  (`_common_dtype`; our ops would cast q and k to v's dtype, rounding an fp32 q that fla reads whole), and the
  initial state goes in the compute dtype (`_state_in`). A `cu_seqlens_cpu` is recorded as the host copy of
  `cu_seqlens` (`_offsets_for_op`; one made under torch.inference_mode is cloned first, since our offset record
  keeps no inference tensor).
- Outputs come back in fla's dtypes (q's for the chunk functions, v's for the fused_recurrent ones); the final
  state is float32, or float64 for float64 inputs (fla's kernels take no float64; ours do).
- fused_recurrent_* are differentiable (fla's have no backward); cp_context (context parallelism) is refused.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F

from .kda_gate import check_kda_gate, kda_gate
from .offsets import host_offsets, remember_offsets
from .recurrence import delta_rule, gated_delta_rule, kda

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "chunk_kda", "fused_recurrent_kda"]


# ---------------------------------------------------------------------------------------------------------------
# shared pieces
# ---------------------------------------------------------------------------------------------------------------

def _compute_dtype(*xs: torch.Tensor | None) -> torch.dtype:
    """The dtype our ops compute in for these inputs: float64 when any is float64, else float32."""
    return torch.float64 if any(x is not None and x.dtype == torch.float64 for x in xs) else torch.float32


def _common_dtype(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """q, k, v in one dtype (the widest of the three): fla reads each in its own dtype and computes in float32, so
    promoting loses nothing, where our ops' own rule (q and k cast to v's dtype) would round a wider q or k."""
    dt = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    return q.to(dt), k.to(dt), v.to(dt)


def _state_in(initial_state: torch.Tensor | None, state_v_first: bool, cd: torch.dtype) -> torch.Tensor | None:
    """fla's initial state ([N, HV, K, V], or [N, HV, V, K] V-first, any float dtype) as our ops take it:
    [N, HV, K, V] in the compute dtype."""
    if initial_state is None:
        return None
    h0 = initial_state.transpose(-1, -2) if state_v_first else initial_state
    return h0.to(cd)


def _state_out(state: torch.Tensor | None, state_v_first: bool) -> torch.Tensor | None:
    if state is None or not state_v_first:
        return state
    return state.transpose(-1, -2).contiguous()


def _offsets_for_op(cu_seqlens: torch.Tensor | None, cu_seqlens_cpu: torch.Tensor | None):
    """cu_seqlens with cu_seqlens_cpu, when given, recorded as its host copy, so the op reads no offsets back from
    the device. The record keeps no inference tensor (it has no version counter), so one made under
    inference_mode is cloned outside it first; without cu_seqlens_cpu the ops take it as it is."""
    if cu_seqlens is None or cu_seqlens_cpu is None:
        return cu_seqlens
    if torch.is_inference(cu_seqlens):
        with torch.inference_mode(False):
            cu_seqlens = cu_seqlens.clone()
    return remember_offsets(cu_seqlens, cu_seqlens_cpu.detach().cpu())


def _beta_in(beta: torch.Tensor, use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool) -> torch.Tensor:
    if not use_beta_sigmoid_in_kernel:
        return beta
    b = torch.sigmoid(beta.float() if beta.dtype in (torch.float16, torch.bfloat16) else beta)
    return b * 2 if allow_neg_eigval else b


def _gdn_gate(g: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None, cd: torch.dtype) -> torch.Tensor:
    """Gated DeltaNet's decay from raw inputs: -exp(A_log) * softplus(g + dt_bias); g [B, T, HV], A_log and
    dt_bias [HV]."""
    x = g.to(cd)
    if dt_bias is not None:
        x = x + dt_bias.to(cd)
    return -A_log.to(cd).exp() * F.softplus(x)


def _gate_args(A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, lower_bound: float | None,
               on: bool) -> dict:
    """KDA's gate keywords for `kda`, A_log flattened to [HV] and dt_bias to [HV * K]: fla reads them through
    `.view(H, 1)` and `.view(H, K)`, so its callers pass any shape of that many elements (its tests: A_log
    [1, 1, H, 1])."""
    if not on:
        return {}
    flat = lambda t: None if t is None else t.reshape(-1)  # noqa: E731
    return dict(A_log=flat(A_log), dt_bias=flat(dt_bias), lower_bound=lower_bound)


def _kda_gate(g: torch.Tensor, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
              lower_bound: float | None, cd: torch.dtype) -> torch.Tensor:
    """KDA's per-channel decay from raw inputs, for the paths that cannot hand the gate to `kda` itself (one call
    per chunk, one value head per value channel): the op's own gate function, checked as the op checks it."""
    check_kda_gate(g, A_log, dt_bias, lower_bound)
    return kda_gate(g, A_log, dt_bias, lower_bound, dtype=cd)


def _renamed_layout_flag(state_v_first: bool, kwargs: dict) -> bool:
    """fla's old name for state_v_first, still taken with a DeprecationWarning."""
    if "transpose_state_layout" in kwargs:
        if state_v_first:
            raise ValueError("Cannot pass both `state_v_first` and the deprecated `transpose_state_layout`.")
        warnings.warn("`transpose_state_layout` is deprecated and renamed to `state_v_first`.",
                      DeprecationWarning, stacklevel=3)
        state_v_first = kwargs.pop("transpose_state_layout")
    return state_v_first


def _check_varlen(q: torch.Tensor, initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None) -> None:
    if cu_seqlens is None:
        return
    if q.shape[0] != 1:
        raise ValueError(f"The batch size is expected to be 1 rather than {q.shape[0]} when using `cu_seqlens`. "
                         "Please flatten variable-length inputs before processing.")
    if initial_state is not None and initial_state.shape[0] != len(cu_seqlens) - 1:
        raise ValueError(f"The number of initial states is expected to be equal to the number of input sequences, "
                         f"i.e., {len(cu_seqlens) - 1} rather than {initial_state.shape[0]}.")


def _check_neg_eigval(allow_neg_eigval: bool, use_beta_sigmoid_in_kernel: bool) -> None:
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`.")


def _refuse_cp(cp_context, initial_state, output_final_state) -> None:
    """fla's checks on a context-parallel call, then our refusal: the ops here run on one device."""
    if cp_context is None:
        return
    assert initial_state is None, "Initial state is not supported for CP"
    assert output_final_state is False, "Output final state is not supported for CP"
    raise NotImplementedError("cp_context: context parallelism is not supported by hybridlm.ops.fla; "
                              "expected None")


def _run_op(q, k, v, *, g, beta, per_channel: bool, scale, initial_state, output_final_state, cu_seqlens,
            use_qk_l2norm, chunk_size=64):
    """One of our ops on q, k, v of one dtype, a state in the compute dtype and layout [N, HV, K, V]: kda for a
    per-channel decay, gated_delta_rule for a per-head one, delta_rule for none."""
    common = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                  cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size)
    if g is None:
        return delta_rule(q, k, v, beta=beta, **common)
    op = kda if per_channel else gated_delta_rule
    return op(q, k, v, g=g, beta=beta, **common)


def _run_per_value_channel(q, k, v, *, g_head, g_key, g_value, beta, scale, initial_state, output_final_state,
                           cu_seqlens, use_qk_l2norm):
    """The recurrence with a decay or beta per value channel, on our ops that take them per head: the columns of
    the state S [K, V] evolve independently of each other, so every value channel becomes a value head of width 1
    (HV * V heads; head h * V + c still reads key head h // (HV / H)). Gates add in log space.
    g_head [B, T, HV], g_key [B, T, HV, K], g_value [B, T, HV, V], beta [B, T, HV] or [B, T, HV, V]; all optional
    but beta. initial_state [N, HV, K, V]."""
    B, T, HV, V = v.shape
    K = k.shape[-1]

    def per_col(x):  # [B, T, HV] or [B, T, HV, V] -> [B, T, HV * V]
        if x.dim() == 3:
            x = x.unsqueeze(-1).expand(B, T, HV, V)
        return x.reshape(B, T, HV * V)

    gs = None
    for x in (g_head, g_value):
        if x is not None:
            gs = per_col(x) if gs is None else gs + per_col(x)
    g = gs
    if g_key is not None:
        gk = g_key.unsqueeze(3).expand(B, T, HV, V, K).reshape(B, T, HV * V, K)
        g = gk if gs is None else gk + gs.unsqueeze(-1)
    h0 = None
    if initial_state is not None:
        N = initial_state.shape[0]
        h0 = initial_state.transpose(-1, -2).reshape(N, HV * V, K, 1)
    o, ht = _run_op(q, k, v.reshape(B, T, HV * V, 1), g=g, beta=per_col(beta), per_channel=g_key is not None,
                    scale=scale, initial_state=h0, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                    use_qk_l2norm=use_qk_l2norm)
    o = o.reshape(B, T, HV, V)
    if ht is not None:
        ht = ht.reshape(ht.shape[0], HV, V, K).transpose(-1, -2).contiguous()
    return o, ht


def _run_with_chunk_states(q, k, v, *, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm, chunk_size):
    """kda chunk by chunk, keeping the state at the start of every chunk (fla's `h`): h [B, NT, HV, K, V] with NT
    = ceil(T / chunk_size), or [1, sum over sequences of their chunk counts, HV, K, V] for varlen, sequence by
    sequence. Our ops return no states inside a sequence, so each chunk is one call (all sequences together).
    Inference only (fla asserts inference mode): the buffers are filled in place. Returns (o, final_state, h)."""
    B, T, HV, V = v.shape
    K = k.shape[-1]
    N = B if cu_seqlens is None else len(host_offsets(cu_seqlens)) - 1
    cd = _compute_dtype(q)
    state = initial_state if initial_state is not None else q.new_zeros(N, HV, K, V, dtype=cd)
    state = state.clone()
    o = torch.empty_like(v)
    common = dict(scale=scale, output_final_state=True, use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size)
    if cu_seqlens is None:
        hs = []
        for s in range(0, T, chunk_size):
            e = min(T, s + chunk_size)
            hs.append(state.clone())
            o[:, s:e], state = kda(q[:, s:e], k[:, s:e], v[:, s:e], g=g[:, s:e], beta=beta[:, s:e],
                                   initial_state=state, **common)
        h = torch.stack(hs, dim=1) if hs else state.new_zeros(B, 0, HV, K, V)
        return o, state, h
    c = host_offsets(cu_seqlens)
    n_chunks = [math.ceil((c[n + 1] - c[n]) / chunk_size) for n in range(N)]
    first = [sum(n_chunks[:n]) for n in range(N)]
    h = state.new_zeros(1, sum(n_chunks), HV, K, V)
    for r in range(max(n_chunks, default=0)):
        active = [n for n in range(N) if n_chunks[n] > r]
        spans = [(c[n] + r * chunk_size, min(c[n + 1], c[n] + (r + 1) * chunk_size)) for n in active]
        idx = torch.cat([torch.arange(s, e) for s, e in spans]).to(q.device)
        bounds = [0]
        for s, e in spans:
            bounds.append(bounds[-1] + e - s)
        with torch.inference_mode(False):  # a tensor with a version counter, for our offset cache
            cu_r = remember_offsets(torch.tensor(bounds, device=q.device), bounds)
        rows = torch.tensor(active, device=q.device)
        for n in active:
            h[0, first[n] + r] = state[n]
        o_r, f_r = kda(q[:, idx], k[:, idx], v[:, idx], g=g[:, idx], beta=beta[:, idx],
                       initial_state=state.index_select(0, rows), cu_seqlens=cu_r, **common)
        o[:, idx] = o_r
        state.index_copy_(0, rows, f_r)
    return o, state, h


# ---------------------------------------------------------------------------------------------------------------
# the four public functions
# ---------------------------------------------------------------------------------------------------------------

def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    chunk_indices: torch.LongTensor | None = None,
    cp_context: object | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated DeltaNet with fla's `chunk_gated_delta_rule` signature, on `hybridlm.ops.gated_delta_rule`.

    q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV] log-decay, or the raw gate input with
    `use_gate_in_kernel=True` (keyword, with `A_log` [HV] and optional `dt_bias` [HV]: -exp(A_log) *
    softplus(g + dt_bias)); beta: [B, T, HV], or logits with `use_beta_sigmoid_in_kernel` (2 * sigmoid with
    `allow_neg_eigval`). initial_state: [N, HV, K, V] ([N, HV, V, K] with `state_v_first`), any float dtype.
    Keyword `chunk_size`: 16, 32 or 64. cu_seqlens_cpu: host copy of cu_seqlens (saves a sync); chunk_indices is
    not needed here and ignored. Returns (o [B, T, HV, V] in q's dtype, final state or None)."""
    state_v_first = _renamed_layout_flag(state_v_first, kwargs)
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k must have the same number of heads, but got q.shape[2]={q.shape[2]} and "
                         f"k.shape[2]={k.shape[2]}")
    H, HV = q.shape[2], v.shape[2]
    if HV % H != 0:
        raise ValueError(f"For GVA, num_v_heads (HV={HV}) must be evenly divisible by num_heads (H={H}), "
                         f"but got HV % H = {HV % H}")
    if "head_first" in kwargs:  # fla 0.6.0 raises the warning class itself
        raise DeprecationWarning("head_first has been removed. Inputs must be in `[B, T, H, ...]` format.")
    chunk_size = kwargs.pop("chunk_size", 64)
    if chunk_size not in (16, 32, 64):
        raise ValueError(f"`chunk_size` must be 16, 32, or 64 for Gated Delta Rule, got {chunk_size}.")
    _refuse_cp(cp_context, initial_state, output_final_state)
    _check_varlen(q, initial_state, cu_seqlens)
    use_gate_in_kernel = kwargs.get("use_gate_in_kernel", False)
    A_log, dt_bias = kwargs.get("A_log"), kwargs.get("dt_bias")
    if use_gate_in_kernel:
        assert A_log is not None, "A_log must be provided when use_gate_in_kernel=True."
    _check_neg_eigval(allow_neg_eigval, use_beta_sigmoid_in_kernel)

    out_dtype = q.dtype
    q, k, v = _common_dtype(q, k, v)
    cd = _compute_dtype(q)
    if use_gate_in_kernel:
        g = _gdn_gate(g, A_log, dt_bias, cd)
    o, ht = gated_delta_rule(
        q, k, v, g=g, beta=_beta_in(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval), scale=scale,
        initial_state=_state_in(initial_state, state_v_first, cd), output_final_state=output_final_state,
        cu_seqlens=_offsets_for_op(cu_seqlens, cu_seqlens_cpu), use_qk_l2norm=use_qk_l2norm_in_kernel,
        chunk_size=chunk_size,
    )
    return o.to(out_dtype), _state_out(ht, state_v_first)


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    gk: torch.Tensor | None = None,
    gv: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    scale: float = None,
    initial_state: torch.Tensor = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated DeltaNet with fla's `fused_recurrent_gated_delta_rule` signature. Every decay is optional and they
    multiply: g [B, T, HV] (or raw with `use_gate_in_kernel`, A_log [HV], dt_bias [HV]), gk [B, T, HV, K] per key
    channel, gv [B, T, HV, V] per value channel. beta: [B, T, HV] or [B, T, HV, V] (ones when None). Runs on
    gated_delta_rule, kda or delta_rule (per-value gates and betas as one value head per channel). Returns
    (o [B, T, HV, V] in v's dtype, final state or None); differentiable."""
    state_v_first = _renamed_layout_flag(state_v_first, kwargs)
    _check_varlen(q, initial_state, cu_seqlens)
    if use_gate_in_kernel:
        if A_log is None:
            raise ValueError("`A_log` must be provided when `use_gate_in_kernel=True`.")
        if g is None:
            raise ValueError("`g` (raw pre-activation) must be provided when `use_gate_in_kernel=True`.")
    _check_neg_eigval(allow_neg_eigval, use_beta_sigmoid_in_kernel)

    out_dtype = v.dtype
    q, k, v = _common_dtype(q, k, v)
    cd = _compute_dtype(q)
    if beta is None:
        beta = torch.ones(v.shape[:3], dtype=v.dtype, device=v.device)
    beta = _beta_in(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    if g is not None and use_gate_in_kernel:
        g = _gdn_gate(g, A_log, dt_bias, cd)
    h0 = _state_in(initial_state, state_v_first, cd)
    cu = _offsets_for_op(cu_seqlens, None)
    if gv is not None or beta.dim() == 4:
        o, ht = _run_per_value_channel(q, k, v, g_head=g, g_key=gk, g_value=gv, beta=beta, scale=scale,
                                       initial_state=h0, output_final_state=output_final_state, cu_seqlens=cu,
                                       use_qk_l2norm=use_qk_l2norm_in_kernel)
    else:
        decay = g
        if gk is not None:
            decay = gk if g is None else gk + g.to(cd).unsqueeze(-1)
        o, ht = _run_op(q, k, v, g=decay, beta=beta, per_channel=gk is not None, scale=scale, initial_state=h0,
                        output_final_state=output_final_state, cu_seqlens=cu,
                        use_qk_l2norm=use_qk_l2norm_in_kernel)
    return o.to(out_dtype), _state_out(ht, state_v_first)


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    cp_context: object | None = None,
    use_graph: bool = False,
    max_num_seqs: int | None = None,
    **kwargs,
):
    """Kimi Delta Attention with fla's `chunk_kda` signature, on `hybridlm.ops.kda`.

    g: [B, T, HV, K] log-decay, or raw with `use_gate_in_kernel` (keywords `A_log` [HV], `dt_bias` [HV * K]; with
    `lower_bound` the gate is lower_bound * sigmoid(exp(A_log) * (g + dt_bias)), A_log optional). beta: [B, T, HV].
    initial_state: float32 [N, HV, K, V] ([N, HV, V, K] with `state_v_first`; float64 also taken for float64
    inputs). Keyword `chunk_size`: 32 or 64. `safe_gate` only checks lower_bound's range (our kernels need no
    bounded gate); `disable_recompute`, `use_graph` are accepted and change nothing here.
    Returns (o in q's dtype, final state or None), and with `return_intermediate_states` (inference mode only)
    also h: the state at the start of every chunk, [B, NT, HV, K, V] (V, K with state_v_first) in k's dtype."""
    state_v_first = _renamed_layout_flag(state_v_first, kwargs)
    _refuse_cp(cp_context, initial_state, output_final_state)
    _check_varlen(q, initial_state, cu_seqlens)
    if initial_state is not None:
        assert initial_state.dtype == torch.float32 or (
            initial_state.dtype == q.dtype == torch.float64), "initial_state must be in float32."
    A_log, dt_bias = None, None
    if use_gate_in_kernel:
        A_log, dt_bias = kwargs.get("A_log"), kwargs.get("dt_bias")
        if A_log is None and lower_bound is None:
            raise ValueError("`A_log` must be provided when `use_gate_in_kernel=True` and `lower_bound` is not set.")
    chunk_size = kwargs.pop("chunk_size", 64)
    if chunk_size not in (32, 64):
        raise ValueError(f"`chunk_size` must be either 32 or 64 for KDA, got {chunk_size}.")
    if safe_gate and use_gate_in_kernel:
        if lower_bound is None:
            raise ValueError("`lower_bound` must be specified when `safe_gate=True` and `use_gate_in_kernel=True`.")
        if not (-5 <= lower_bound < 0):
            raise ValueError(f"`lower_bound` must be in the safe range [-5, 0), got {lower_bound}.")
    _check_neg_eigval(allow_neg_eigval, use_beta_sigmoid_in_kernel)
    B, T, H, K = q.shape
    HV = v.shape[2]
    assert q.shape == k.shape, f"q and k must have the same shape, got q={q.shape} vs k={k.shape}"
    assert K <= 256, f"Currently we only support key headdim <=256 for KDA, got {K}."
    assert HV % H == 0, f"For GVA, num_v_heads (HV={HV}) must be evenly divisible by num_qk_heads (H={H})"
    assert g.shape == (B, T, HV, K), f"g must have shape [B, T, HV, K]={[B, T, HV, K]}, got {list(g.shape)}"
    assert beta.shape == (B, T, HV), f"beta must have shape [B, T, HV]={[B, T, HV]}, got {list(beta.shape)}"
    if use_graph and cu_seqlens is not None:
        n_seqs = cu_seqlens.shape[0] - 1 if max_num_seqs is None else max_num_seqs
        assert cu_seqlens.shape[0] - 1 == n_seqs, (
            f"cu_seqlens must be padded with zero-length tail sequences to exactly max_num_seqs + 1 entries, "
            f"got {cu_seqlens.shape[0] - 1} sequences with max_num_seqs={n_seqs}")
    if return_intermediate_states:
        assert torch.is_inference_mode_enabled(), "return_intermediate_states is only allowed in inference mode"
        assert disable_recompute is False, "return_intermediate_states must be used with disable_recompute=False"

    out_dtype, h_dtype = q.dtype, k.dtype
    q, k, v = _common_dtype(q, k, v)
    cd = _compute_dtype(q)
    gate = _gate_args(A_log, dt_bias, lower_bound, use_gate_in_kernel)
    beta = _beta_in(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    h0 = _state_in(initial_state, state_v_first, cd)
    cu = _offsets_for_op(cu_seqlens, cu_seqlens_cpu)
    if return_intermediate_states:
        if use_gate_in_kernel:
            g = _kda_gate(g, **_gate_args(A_log, dt_bias, lower_bound, True), cd=cd)
        o, ht, h = _run_with_chunk_states(q, k, v, g=g, beta=beta, scale=scale, initial_state=h0, cu_seqlens=cu,
                                          use_qk_l2norm=use_qk_l2norm_in_kernel, chunk_size=chunk_size)
        h = (h.transpose(-1, -2) if state_v_first else h).to(h_dtype).contiguous()
        return o.to(out_dtype), (_state_out(ht, state_v_first) if output_final_state else None), h
    o, ht = kda(q, k, v, g=g, beta=beta, **gate, scale=scale, initial_state=h0,
                output_final_state=output_final_state, cu_seqlens=cu, use_qk_l2norm=use_qk_l2norm_in_kernel,
                chunk_size=chunk_size)
    return o.to(out_dtype), _state_out(ht, state_v_first)


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Kimi Delta Attention with fla's `fused_recurrent_kda` signature, on `hybridlm.ops.kda`. g [B, T, HV, K]
    (raw with `use_gate_in_kernel`: A_log [HV], dt_bias [HV * K], lower_bound as in chunk_kda); beta [B, T, HV]
    or [B, T, HV, V]; initial_state any float dtype. Returns (o in v's dtype, final state or None);
    differentiable."""
    state_v_first = _renamed_layout_flag(state_v_first, kwargs)
    _check_varlen(q, initial_state, cu_seqlens)
    _check_neg_eigval(allow_neg_eigval, use_beta_sigmoid_in_kernel)
    if use_gate_in_kernel and A_log is None and lower_bound is None:
        # fla 0.6.0 computes -e * softplus(g + dt_bias) here (a missing A_log read as 1); chunk_kda refuses it
        raise ValueError("`A_log` must be provided when `use_gate_in_kernel=True` and `lower_bound` is not set.")

    out_dtype = v.dtype
    q, k, v = _common_dtype(q, k, v)
    cd = _compute_dtype(q)
    gate = _gate_args(A_log, dt_bias, lower_bound, use_gate_in_kernel)
    beta = _beta_in(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    h0 = _state_in(initial_state, state_v_first, cd)
    cu = _offsets_for_op(cu_seqlens, None)
    if beta.dim() == 4:
        if use_gate_in_kernel:
            g = _kda_gate(g, **_gate_args(A_log, dt_bias, lower_bound, True), cd=cd)
        o, ht = _run_per_value_channel(q, k, v, g_head=None, g_key=g, g_value=None, beta=beta, scale=scale,
                                       initial_state=h0, output_final_state=output_final_state, cu_seqlens=cu,
                                       use_qk_l2norm=use_qk_l2norm_in_kernel)
    else:
        o, ht = kda(q, k, v, g=g, beta=beta, **gate, scale=scale, initial_state=h0,
                    output_final_state=output_final_state, cu_seqlens=cu, use_qk_l2norm=use_qk_l2norm_in_kernel)
    return o.to(out_dtype), _state_out(ht, state_v_first)
