"""MesaNet in chunks: the two covariances at chunk starts, intra-chunk terms, and a batched per-token solve.

Non-standard here:
- Inside a chunk with local cumulative log-decays b_i = g_1 + ... + g_i, the state a token sees is the chunk-start
  state decayed plus a masked sum over the chunk,
      H_i = e^{b_i} H_0 + sum_{j <= i} M_ij k_j k_j^T,   G_i = e^{b_i} G_0 + sum_{j <= i} M_ij k_j v_j^T,
      M_ij = e^{b_i - b_j} beta_j,
  so only the chunk-start states run sequentially (one [K, K] and one [K, V] update per chunk); all tokens of
  all chunks are then solved at once. Every exponent is <= 0 (nothing overflows in float32).
- The exact solve materialises H_i + diag(lambda) for every token ([.., C, K, K] per chunk, O(T K^2) memory) and
  calls torch.linalg.solve batched. With `cg_iters` the system is never formed: conjugate gradient only needs
  (H_i + diag(lambda)) p = e^{b_i} H_0 p + sum_j M_ij k_j (k_j . p) + lambda * p, chunk matmuls as in fla's kernel.
- The output uses the same split: o_i = e^{b_i} G_0^T x_i + sum_j M_ij (k_j . x_i) v_j.
- T is padded to a multiple of the chunk with k = v = q = 0, g = 0, beta = 0: a padded token writes nothing and
  decays nothing, so the final states are those after the last real token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .mesa_naive import conjugate_gradient


def _to_chunks(x: torch.Tensor, C: int) -> torch.Tensor:
    """[B, T, H, ...] (T a multiple of C) -> [B, H, N, C, ...]."""
    B, T, H = x.shape[:3]
    return x.reshape(B, T // C, C, H, *x.shape[3:]).movedim(3, 1)


def _pad_time(x: torch.Tensor, pad: int) -> torch.Tensor:
    if pad == 0:
        return x
    return F.pad(x, [0, 0] * (x.dim() - 2) + [0, pad])


def mesa_chunk(
    q_BTHK: torch.Tensor,
    k_BTHK: torch.Tensor,
    v_BTHV: torch.Tensor,
    *,
    g: torch.Tensor,
    beta: torch.Tensor,
    lamb: torch.Tensor,
    h_BHKK: torch.Tensor,
    s_BHKV: torch.Tensor,
    chunk_size: int = 64,
    cg_iters: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as `mesa_naive`: q, k [B, T, H, K]; v [B, T, H, V]; g, beta [B, T, H]; lamb [H, K];
    h [B, H, K, K]; s [B, H, K, V]. Returns o [B, T, H, V] and the final (h, s)."""
    B, T, H, K = q_BTHK.shape
    if T == 0:  # an empty packed sequence: its state passes through
        return v_BTHV.new_zeros(v_BTHV.shape), h_BHKK, s_BHKV
    C = chunk_size
    pad = (-T) % C
    q, k, v, g, beta = (_to_chunks(_pad_time(x, pad), C) for x in (q_BTHK, k_BTHK, v_BTHV, g, beta))
    # q, k: [B, H, N, C, K]; v: [B, H, N, C, V]; g, beta: [B, H, N, C]
    b = g.cumsum(-1)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    # M_ij = e^{b_i - b_j} beta_j for j <= i (the exponent is masked before exp: above the diagonal it is positive)
    M = (b.unsqueeze(-1) - b.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp() * beta.unsqueeze(-2)
    h0, s0 = _chunk_starts(k, v, b, beta, h_BHKK, s_BHKV)  # [B, H, N, K, K], [B, H, N, K, V]
    h_final, s_final = _advance(h0[:, :, -1], s0[:, :, -1], k[:, :, -1], v[:, :, -1], b[:, :, -1], beta[:, :, -1])
    decay = b.exp().unsqueeze(-1)  # [B, H, N, C, 1]
    lam = lamb[None, :, None, None, :]  # [1, H, 1, 1, K]

    if cg_iters is None:
        A = decay.unsqueeze(-1) * h0.unsqueeze(3) + torch.einsum("bhnij,bhnjk,bhnjl->bhnikl", M, k, k)
        A = A + torch.diag_embed(lam.expand(B, H, A.shape[2], C, K))
        x = torch.linalg.solve(A, q.unsqueeze(-1)).squeeze(-1)
    else:
        kt = k.transpose(-1, -2)

        def matvec(p: torch.Tensor) -> torch.Tensor:
            return decay * torch.einsum("bhnkj,bhncj->bhnck", h0, p) + (M * (p @ kt)) @ k + lam * p

        x = conjugate_gradient(matvec, q, cg_iters)
    o = decay * torch.einsum("bhnck,bhnkv->bhncv", x, s0) + (M * (x @ k.transpose(-1, -2))) @ v
    o = o.movedim(1, 3).reshape(B, -1, H, v.shape[-1])[:, :T]
    return o, h_final, s_final


def _advance(h: torch.Tensor, s: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: torch.Tensor,
             beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The states after one chunk: h [B, H, K, K], s [B, H, K, V]; k [B, H, C, K]; v [B, H, C, V]; b, beta [B, H, C].
    Token j reaches the chunk end decayed by e^{b_C - b_j}."""
    last = b[..., -1:]
    kw = k * ((last - b).exp() * beta).unsqueeze(-1)
    carry = last.exp().unsqueeze(-1)
    return carry * h + kw.transpose(-1, -2) @ k, carry * s + kw.transpose(-1, -2) @ v


def _chunk_starts(k, v, b, beta, h, s) -> tuple[torch.Tensor, torch.Tensor]:
    """The states every chunk starts from (the only sequential part): [B, H, N, K, K] and [B, H, N, K, V]."""
    hs, ss = [], []
    for n in range(k.shape[2]):
        hs.append(h)
        ss.append(s)
        if n + 1 < k.shape[2]:
            h, s = _advance(h, s, k[:, :, n], v[:, :, n], b[:, :, n], beta[:, :, n])
    return torch.stack(hs, dim=2), torch.stack(ss, dim=2)
