"""PaTH attention: softmax attention whose relative positions are accumulated Householder transforms.

logit(i, j) = scale * q_i^T H_i H_{i-1} ... H_{j+1} k_j  + G_i - G_j   for j <= i (the product is I for j = i),
H_s = I - beta_s w_s w_s^T, G = cumsum(g) (PaTH-FoX's forget gate; 0 without g), o_i = sum_j softmax_j(logit) v_j.

Non-standard here:
- The forget gate is added after the scale (FoX's convention: a log-decay is a log-probability weight, not a
  dot product). fla scales it with the dot product, (q^T P k + G_i - G_j) * scale: pass fla g / scale to match.
- w is used as given (the layer l2-normalises it); beta in (0, 2) keeps every H_s a contraction (2: a
  reflection) but is not range-checked (that would sync the device on every call).
- impl "naive" is the decode view, token by token: every new H_t is applied to all keys seen so far, then the
  query reads the transformed keys. impl "chunk" is the paper's blockwise UT form: inside a chunk the Householder
  products are I - W^T T W with T = (I + strict_tril(diag(beta) W W^T))^{-1} diag(beta) (one triangular solve),
  which gives the intra-chunk logits in closed form and end-of-chunk keys / start-of-chunk queries; queries are
  then carried back through whole-chunk products to reach earlier chunks. Both materialise [T, T] logits per head:
  they are the float64 references a kernel is tested against, not fast paths.
- GQA: q and g have HQ heads, k, v, w, beta have H (query head h reads kv head h // (HQ / H)).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .dispatch import resolve_impl
from .softmax_family import check_softmax_inputs, compute_dtype, per_sequence, to_query_heads
from .validate import CHUNK_SIZES


def path_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    *,
    g: torch.Tensor | None = None,
    beta: torch.Tensor,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    impl: str = "auto",
) -> torch.Tensor:
    """PaTH attention (PaTH-FoX with g). Returns o [B, T, HQ, V] in the input dtype.

    q: [B, T, HQ, K]; k, w: [B, T, H, K] (w unit-norm for a Householder); v: [B, T, H, V]; g: [B, T, HQ] log
    forget gate (<= 0) or None; beta: [B, T, H] in (0, 2); scale: on q^T P k, default K ** -0.5; cu_seqlens: int
    [N+1] offsets of sequences packed in one row (B == 1), each attending only inside itself; chunk_size: 16, 32,
    64 or 128 (impl "chunk"); impl: "auto" (-> "chunk") | "naive" | "chunk"."""
    B, T, HQ, H, K, V = check_softmax_inputs(
        q, k, v, per_token={"w": (w, "kv_vec"), "beta": (beta, "kv"), "g": (g, "q")}, cu_seqlens=cu_seqlens,
        impl=impl)
    if beta is None:
        raise ValueError("beta: expected a [B, T, H] tensor, got None")
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_size: expected one of {CHUNK_SIZES}, got {chunk_size}")
    impl = resolve_impl("path_attention", impl, q.device)
    if T == 0:
        return v.new_zeros(B, 0, HQ, V)
    cd, groups, out_dtype = compute_dtype(q), HQ // H, q.dtype
    scale = K**-0.5 if scale is None else float(scale)
    q, g = q.to(cd), None if g is None else g.to(cd)
    k, v, w, beta = (to_query_heads(x.to(cd), groups) for x in (k, v, w, beta))
    if impl == "naive":
        core = lambda q, k, v, w, beta, g: path_naive(q, k, v, w, beta, g, scale)  # noqa: E731
    else:
        core = lambda q, k, v, w, beta, g: path_chunk(q, k, v, w, beta, g, scale, chunk_size)  # noqa: E731
    return per_sequence(core, cu_seqlens, q, k, v, w, beta, g).to(out_dtype)


def path_naive(q, k, v, w, beta, g, scale: float) -> torch.Tensor:
    """Token by token. All inputs per query head: q, k, w [B, T, H, K]; v [B, T, H, V]; beta, g [B, T, H]."""
    B, T, H, K = q.shape
    G = None if g is None else g.cumsum(1)
    keys = q.new_zeros(B, 0, H, K)  # keys j < t, each already multiplied by H_{t-1} ... H_{j+1}
    outs = []
    for t in range(T):
        wt = w[:, t, None]  # [B, 1, H, K]
        keys = keys - beta[:, t, None, :, None] * (keys * wt).sum(-1, keepdim=True) * wt  # H_t on every old key
        keys = torch.cat([keys, k[:, t : t + 1]], dim=1)
        logit = scale * torch.einsum("bhk,bjhk->bhj", q[:, t], keys)
        if G is not None:
            logit = logit + (G[:, t, :, None] - G[:, : t + 1].transpose(1, 2))
        outs.append(torch.einsum("bhj,bjhv->bhv", logit.softmax(-1), v[:, : t + 1]))
    return torch.stack(outs, dim=1)


def _blocks(x: torch.Tensor, C: int) -> torch.Tensor:
    """[B, T, H, ...] -> [B, H, n, C, ...], zero-padded to n * C steps (a zero w and beta give H = I)."""
    T = x.shape[1]
    pad = -T % C
    x = x.movedim(1, 2)
    if pad:
        x = F.pad(x, (0, 0) * (x.dim() - 3) + (0, pad))
    return x.reshape(*x.shape[:2], -1, C, *x.shape[3:])


def path_chunk(q, k, v, w, beta, g, scale: float, C: int) -> torch.Tensor:
    """The blockwise UT form (module docstring). Shapes as path_naive's."""
    B, T, H, K = q.shape
    qb, kb, wb, bb = (_blocks(x, C) for x in (q, k, w, beta))  # [B, H, n, C, K], beta [B, H, n, C]
    n = qb.shape[2]
    incl = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()  # row >= column
    strict = incl.tril(-1)
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    L = (bb[..., None] * (wb @ wb.transpose(-1, -2))).masked_fill(~strict, 0)
    # T_c: H_b ... H_a = I - sum_{a <= s <= t <= b} T_c[t, s] w_t w_s^T for every run a..b inside the chunk
    Tc = torch.linalg.solve_triangular(eye + L, torch.diag_embed(bb), upper=False, unitriangular=True)
    qwT = (qb @ wb.transpose(-1, -2)).masked_fill(~incl, 0) @ Tc  # [i, s]: sum_{s <= t <= i} (q_i.w_t) T[t, s]
    wk = (wb @ kb.transpose(-1, -2)).masked_fill(~strict, 0)  # [s, j]: w_s.k_j for s > j
    Twk = Tc @ wk  # [t, j]: sum_{j < s <= t} T[t, s] (w_s.k_j)
    intra = qb @ kb.transpose(-1, -2) - qwT @ wk
    q_start = qb - qwT @ wb  # (H_a ... H_i q_i): the query carried back to its chunk's start
    k_end = kb - Twk.transpose(-1, -2) @ wb  # H_{e-1} ... H_{j+1} k_j: the key carried to its chunk's end

    blocks = {(c, c): intra[:, :, c] for c in range(n)}
    carried = q_start[:, :, 1:]  # queries of chunks 1.. carried back over d - 1 whole chunks (d = 1 first)
    for d in range(1, n):
        for c in range(d, n):
            blocks[(c, c - d)] = carried[:, :, c - d] @ k_end[:, :, c - d].transpose(-1, -2)
        # x^T (H_e ... H_a) = x^T - (x^T W^T) T W over the whole chunk c - d, for the query chunks still going
        m = slice(1, n - d)
        carried = carried[:, :, 1:]
        carried = carried - (carried @ wb[:, :, m].transpose(-1, -2)) @ Tc[:, :, m] @ wb[:, :, m]
    zero = q.new_zeros(B, H, C, C)
    rows = [torch.cat([blocks.get((c, j), zero) for j in range(n)], dim=-1) for c in range(n)]
    logit = scale * torch.cat(rows, dim=-2)[..., :T, :T]  # [B, H, T, T]
    if g is not None:
        G = g.cumsum(1).transpose(1, 2)  # [B, H, T]
        logit = logit + (G[..., :, None] - G[..., None, :])
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    p = logit.masked_fill(~causal, float("-inf")).softmax(-1)
    return (p @ v.transpose(1, 2)).transpose(1, 2)
