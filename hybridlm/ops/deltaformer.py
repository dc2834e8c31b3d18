"""DeltaFormer attention: softmax attention over values rewritten by a delta rule in the softmax kernel's space.

u_i = v_i - beta_i * sum_{j < i} softmax_{j < i}(scale q_i.k_j) u_j   (u_0 = v_0),
o_i = sum_{j <= i} softmax_{j <= i}(scale q_i.k_j) u_j.

Non-standard here:
- The write step reads with the query q_i, as fla computes it (its naive and its kernels); the paper's delta rule
  reads the memory with k_i (kappa(k_i, k_j)): pass q = k to get that for u, which also changes o.
- The write softmax is over the strictly earlier keys (normalised over j < i), the read softmax over j <= i:
  two different normalisations of the same scores, again as fla.
- impl "naive" is the recursion token by token; impl "chunk" solves (I + diag(beta) P_strict) u = v for all u at
  once (P_strict the strictly causal softmax matrix, unit lower triangular system) and then runs one causal
  attention over u. Both materialise [T, T] scores per head: float64 references, not fast paths.
- GQA: q and beta have HQ heads (u depends on q, so it is per query head), k and v have H.
"""

from __future__ import annotations

import torch

from .dispatch import resolve_impl
from .softmax_family import check_softmax_inputs, compute_dtype, per_sequence, to_query_heads


def deltaformer_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    beta: torch.Tensor,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """DeltaFormer attention. Returns o [B, T, HQ, V] in the input dtype.

    q: [B, T, HQ, K]; k: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, HQ] write strength (the layer keeps it in
    (0, 1)); scale: default K ** -0.5, used by both softmaxes; cu_seqlens: int [N+1] offsets of sequences packed in
    one row (B == 1); impl: "auto" (-> "chunk") | "naive" | "chunk"."""
    B, T, HQ, H, K, V = check_softmax_inputs(q, k, v, per_token={"beta": (beta, "q")}, cu_seqlens=cu_seqlens,
                                             impl=impl)
    if beta is None:
        raise ValueError("beta: expected a [B, T, HQ] tensor, got None")
    impl = resolve_impl("deltaformer_attention", impl, q.device)
    if T == 0:
        return v.new_zeros(B, 0, HQ, V)
    cd, groups, out_dtype = compute_dtype(q), HQ // H, q.dtype
    scale = K**-0.5 if scale is None else float(scale)
    q, beta = q.to(cd), beta.to(cd)
    k, v = (to_query_heads(x.to(cd), groups) for x in (k, v))
    core = deltaformer_naive if impl == "naive" else deltaformer_chunk
    return per_sequence(lambda q, k, v, beta: core(q, k, v, beta, scale), cu_seqlens, q, k, v, beta).to(out_dtype)


def deltaformer_naive(q, k, v, beta, scale: float) -> torch.Tensor:
    """Token by token. Per query head: q, k [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]."""
    T = q.shape[1]
    us, outs = [], []
    for i in range(T):
        s = scale * torch.einsum("bhk,bjhk->bhj", q[:, i], k[:, : i + 1])  # [B, H, i + 1]
        if i == 0:
            u = v[:, 0]
        else:
            read = torch.einsum("bhj,bjhv->bhv", s[..., :i].softmax(-1), torch.stack(us, dim=1))
            u = v[:, i] - beta[:, i, :, None] * read
        us.append(u)
        outs.append(torch.einsum("bhj,bjhv->bhv", s.softmax(-1), torch.stack(us, dim=1)))
    return torch.stack(outs, dim=1)


def deltaformer_chunk(q, k, v, beta, scale: float) -> torch.Tensor:
    """One triangular solve for every u, then one causal attention. Shapes as deltaformer_naive's."""
    T = q.shape[1]
    s = scale * q.transpose(1, 2) @ k.permute(0, 2, 3, 1)  # [B, H, T, T]
    idx = torch.arange(T, device=q.device)
    causal = idx[None, :] <= idx[:, None]
    strict = idx[None, :] < idx[:, None]
    # row 0 has no earlier key: let it see itself for a finite softmax, then zero it with the strict mask
    p_strict = s.masked_fill(~(strict | (idx == 0)[None, :] & (idx == 0)[:, None]), float("-inf")).softmax(-1)
    p_strict = p_strict * strict
    m = torch.eye(T, dtype=q.dtype, device=q.device) + beta.transpose(1, 2)[..., None] * p_strict
    u = torch.linalg.solve_triangular(m, v.transpose(1, 2), upper=False, unitriangular=True)  # [B, H, T, V]
    p = s.masked_fill(~causal, float("-inf")).softmax(-1)
    return (p @ u).transpose(1, 2)
