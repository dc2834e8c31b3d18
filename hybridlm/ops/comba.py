"""Comba (Hu et al. 2025, "Improving Bilinear RNNs with Closed-loop Control"): a delta rule whose read uses its
own key `p` and whose decay touches only the state it keeps, not the state it reads.

    u_t = beta_t (v_t - S_{t-1}^T p_t)          read the undecayed state with p_t
    S_t = e^{g_t} S_{t-1} + k_t u_t^T            decay, then write
    o_t = S_t^T q_t

i.e. the transition is e^{g_t} I - beta_t k_t p_t^T (scalar plus low rank), against Gated DeltaNet's
e^{g_t} (I - beta_t k_t k_t^T). The output correction of the paper (q_t - d p_t) is the layer's
(`hybridlm.layers.comba`); the op takes q as given. This is fla's `chunk_comba` / `fused_recurrent_comba` (its
`naive_recurrent_comba` decays before the read, which its kernels do not).

Non-standard here:
- Reference and chunk form live in this file (neither is shared with the five ops of `recurrence.py`: the read
  key and the read's decay differ); the public function follows their conventions (keyword-only g before beta,
  `impl`, compute dtype, varlen, GVA, errors of `validate.py`).
- `use_qk_l2norm` normalises p as well as q and k (as fla's kernels do).
- Chunk form: the UT transform with A_ij = beta_i p_i^T k_j e^{b_{i-1} - b_j} (j < i), where b is the cumulative
  log-decay inside the chunk; the exponent stops one step short of i because the read does not see step i's decay.
  Every materialised factor is exp of a non-positive number (no division by a decay).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from .dispatch import resolve_impl
from .norm import l2norm
from .offsets import host_offsets
from .validate import check_float, check_recurrence_inputs, check_same_device


def comba_naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: torch.Tensor, *, g: torch.Tensor,
                beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token, as the paper writes it. Heads expanded, q scaled, one dtype.

    q, k, p: [B, T, HV, K]; v: [B, T, HV, V]; g, beta: [B, T, HV]; state: [B, HV, K, V].
    Returns o [B, T, HV, V] and the final state."""
    S = state
    outs = []
    for t in range(q.shape[1]):
        r_t = torch.einsum("bhk,bhkv->bhv", p[:, t], S)  # what the state (before this step's decay) says for p_t
        u_t = beta[:, t, :, None] * (v[:, t] - r_t)
        S = S * g[:, t, :, None, None].exp() + k[:, t, :, :, None] * u_t[:, :, None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(v.shape)
    return o, S


def _decay_matrix(rows: torch.Tensor, cols: torch.Tensor, strict: bool, dtype: torch.dtype) -> torch.Tensor:
    """exp(rows_i - cols_j) for j <= i (j < i if strict), else 0. rows, cols: [..., C] float64, with
    rows_i <= cols_j wherever kept. Masked before exp: no inf, no NaN gradient."""
    C = rows.shape[-1]
    keep = torch.ones(C, C, dtype=torch.bool, device=rows.device).tril(-1 if strict else 0)
    diff = (rows[..., :, None] - cols[..., None, :]).to(dtype)
    return diff.masked_fill(~keep, float("-inf")).exp()


def comba_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: torch.Tensor, *, g: torch.Tensor,
                beta: torch.Tensor, state: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunkwise form (same contract as `comba_naive`). Within a chunk from state S0, with b_i = g_1 + ... + g_i
    and b_{i-1} its exclusive version:
        S_i = e^{b_i} S0 + sum_{j<=i} e^{b_i - b_j} k_j u_j^T
        u_i = beta_i v_i - beta_i e^{b_{i-1}} S0^T p_i - sum_{j<i} beta_i e^{b_{i-1} - b_j} (p_i . k_j) u_j
    so (I + A) U = diag(beta) V - diag(beta) (P * e^{b_{i-1}}) S0, solved once for each right-hand side."""
    B, T, HV, K = q.shape
    C = chunk_size
    pad = (-T) % C
    NC = (T + pad) // C
    dtype = q.dtype

    # 0. Whole chunks, [B, HV, NC, C, D]; a padded step has k = p = v = 0 and g = 0: it changes nothing.
    def to_chunks(x: torch.Tensor) -> torch.Tensor:
        x = F.pad(x, (0, 0, 0, 0, 0, pad))
        return x.reshape(B, NC, C, HV, x.shape[-1]).permute(0, 3, 1, 2, 4)

    q, k, v, p = (to_chunks(x) for x in (q, k, v, p))
    gc, bt = (to_chunks(x.unsqueeze(-1))[..., 0] for x in (g, beta))  # [B, HV, NC, C]

    # 1. Cumulative log-decay in float64 (the differences below lose nothing to long sums), inclusive and exclusive.
    b = gc.double().cumsum(dim=-1)
    b_prev = F.pad(b[..., :-1], (1, 0))  # b_{i-1}, 0 at the chunk start: same partial sums, so b_prev_i <= b_j, j < i
    b_last = b[..., -1:]

    # 2. Queries on keys inside the chunk (j <= i) and the read keys on keys (j < i).
    P = (q @ k.transpose(-1, -2)) * _decay_matrix(b, b, strict=False, dtype=dtype)
    A = bt[..., None] * (p @ k.transpose(-1, -2)) * _decay_matrix(b_prev, b, strict=True, dtype=dtype)

    # 3. The UT transform: U = U0 - W S0.
    unit_lower = A + torch.eye(C, dtype=dtype, device=q.device)
    U0 = torch.linalg.solve_triangular(unit_lower, bt[..., None] * v, upper=False, unitriangular=True)
    W = torch.linalg.solve_triangular(unit_lower, (bt * b_prev.to(dtype).exp())[..., None] * p, upper=False,
                                      unitriangular=True)

    # 4. Sweep the chunks, carrying the state.
    q_dec = q * b.to(dtype).exp()[..., None]  # queries read S0 through the decay since the chunk start
    k_dec = k * (b_last - b).to(dtype).exp()[..., None]  # writes decay until the chunk end
    chunk_decay = b_last.to(dtype).exp()[..., None]  # [B, HV, NC, 1, 1]
    S = state
    outs = []
    for n in range(NC):
        U = U0[:, :, n] - W[:, :, n] @ S
        outs.append(q_dec[:, :, n] @ S + P[:, :, n] @ U)
        S = S * chunk_decay[:, :, n] + k_dec[:, :, n].transpose(-1, -2) @ U
    o = torch.stack(outs, dim=2) if outs else v.new_zeros(B, HV, 0, C, v.shape[-1])
    return o.reshape(B, HV, NC * C, v.shape[-1])[:, :, :T].transpose(1, 2), S


def _check_p(p: torch.Tensor | None, k: torch.Tensor) -> None:
    if p is None:
        raise ValueError(f"p: expected the read keys, a tensor of the shape of k {tuple(k.shape)} ([B, T, H, K]), "
                         "got None")
    check_float("p", p)
    if tuple(p.shape) != tuple(k.shape):
        raise ValueError(f"p: expected the shape of k {tuple(k.shape)} ([B, T, H, K]), got {tuple(p.shape)}")
    if p.dtype != k.dtype:
        raise TypeError(f"p: expected the dtype of k {k.dtype}, got {p.dtype}")
    check_same_device(k=k, p=p)


def comba(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    p: torch.Tensor,
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Comba: S_t = e^{g_t} S_{t-1} + beta_t k_t (v_t - S_{t-1}^T p_t)^T,  o_t = S_t^T q_t.

    q, k, p: [B, T, H, K] (p: the read keys; the paper's p_t = d k_t with d in (0, 1)); v: [B, T, HV, V] with HV a
    multiple of H; g: [B, T, HV] log-decay (<= 0); beta: [B, T, HV].
    scale: multiplies q after the optional l2 norm; default K ** -0.5.
    initial_state: [N, HV, K, V] in float32 (float64 for float64 inputs); N = B or the number of varlen sequences.
    output_final_state: also return the state after the last step, else None.
    cu_seqlens: int32/int64 [N+1] offsets of sequences packed in one row (B must be 1).
    use_qk_l2norm: normalise q, k and p over K as x * rsqrt(sum(x^2) + 1e-6) first.
    chunk_size: 16, 32, 64 or 128 (impl="chunk"). impl: "auto" (= "chunk": no Triton kernel) | "naive" | "chunk".
    recompute: run the op under torch.utils.checkpoint (only the inputs are kept for the backward).
    Returns (o [B, T, HV, V] in the input dtype, final_state or None)."""
    dims = check_recurrence_inputs(q, k, v, g=g, g_kind="scalar", beta=beta, initial_state=initial_state,
                                   cu_seqlens=cu_seqlens, chunk_size=chunk_size, impl=impl)
    _check_p(p, k)
    if beta is None:
        raise ValueError("beta: expected a write-strength tensor of shape [B, T, HV], got None")
    impl = resolve_impl("comba", impl, q.device, q, v)
    cd = torch.float64 if q.dtype == torch.float64 else torch.float32
    if initial_state is not None and initial_state.dtype != cd:
        raise TypeError(f"initial_state: expected dtype {cd} for {q.dtype} inputs, got {initial_state.dtype}")

    def run(q, k, v, p, g, beta, initial_state):
        return _run(q, k, v, p, g, beta, initial_state, dims=dims, cd=cd, scale=scale, cu_seqlens=cu_seqlens,
                    use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size, impl=impl)

    if recompute and torch.is_grad_enabled():
        o, final = torch.utils.checkpoint.checkpoint(run, q, k, v, p, g, beta, initial_state, use_reentrant=False)
    else:
        o, final = run(q, k, v, p, g, beta, initial_state)
    return o.to(q.dtype), (final if output_final_state else None)


def _run(q, k, v, p, g, beta, initial_state, *, dims, cd, scale, cu_seqlens, use_qk_l2norm, chunk_size, impl):
    """The PyTorch body of `comba`: compute dtype, l2 norm, scale, GVA, then each sequence from its own state."""
    H, HV = dims.H, dims.HV
    q, k, v, p, g, beta = (x.to(cd) for x in (q, k, v, p, g, beta))
    if use_qk_l2norm:
        q, k, p = l2norm(q), l2norm(k), l2norm(p)
    q = q * (dims.K**-0.5 if scale is None else float(scale))
    if HV != H:  # grouped value attention: value head h reads key head h // (HV / H)
        q, k, p = (x.repeat_interleave(HV // H, dim=2) for x in (q, k, p))
    state = initial_state if initial_state is not None else q.new_zeros(dims.N, HV, dims.K, dims.V)
    core = comba_naive if impl == "naive" else comba_chunk
    kw = {} if impl == "naive" else {"chunk_size": chunk_size}
    if cu_seqlens is None:
        return core(q, k, v, p, g=g, beta=beta, state=state, **kw)
    bounds = host_offsets(cu_seqlens)
    outs, finals = [], []
    for n in range(dims.N):
        s, e = bounds[n], bounds[n + 1]
        o_n, f_n = core(q[:, s:e], k[:, s:e], v[:, s:e], p[:, s:e], g=g[:, s:e], beta=beta[:, s:e],
                        state=state[n : n + 1], **kw)
        outs.append(o_n)
        finals.append(f_n)
    return torch.cat(outs, dim=1), torch.cat(finals, dim=0)
