"""MesaNet in chunks: the two covariances at chunk starts, intra-chunk terms, and a batched per-token solve.

Non-standard here:
- Inside a chunk with local cumulative log-decays b_i = g_1 + ... + g_i, the state a token sees is the chunk-start
  state decayed plus a masked sum over the chunk,
      H_i = e^{b_i} H_0 + sum_{j <= i} M_ij k_j k_j^T,   G_i = e^{b_i} G_0 + sum_{j <= i} M_ij k_j v_j^T,
      M_ij = e^{b_i - b_j} beta_j,
  so only the chunk-start states run sequentially (one [K, K] and one [K, V] update per chunk); all tokens of
  all chunks are then solved at once. Every exponent is <= 0 (nothing overflows in float32).
- The exact solve materialises H_i + diag(lambda) for every token ([.., C, K, K] per chunk, O(T K^2) memory) and
  LU-solves them batched; its backward is written out (`_StructuredSolve`): each dA_i is rank one, so the
  gradients are chunk matmuls instead of a [.., C, K, K] gradient pushed back through the product that built A.
  With `cg_iters` the system is never formed: conjugate gradient only needs
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
        x = _StructuredSolve.apply(q, h0, decay.squeeze(-1), M, k, lamb)
    else:
        kt = k.transpose(-1, -2)

        def matvec(p: torch.Tensor) -> torch.Tensor:
            return decay * torch.einsum("bhnkj,bhncj->bhnck", h0, p) + (M * (p @ kt)) @ k + lam * p

        x = conjugate_gradient(matvec, q, cg_iters)
    o = decay * torch.einsum("bhnck,bhnkv->bhncv", x, s0) + (M * (x @ k.transpose(-1, -2))) @ v
    o = o.movedim(1, 3).reshape(B, -1, H, v.shape[-1])[:, :T]
    return o, h_final, s_final


class _StructuredSolve(torch.autograd.Function):
    """x_i = A_i^{-1} q_i with A_i = d_i H_0 + sum_j M_ij k_j k_j^T + diag(lambda), for every token of every chunk.

    The backward uses that the gradient of each A_i is rank one, dA_i = -y_i x_i^T with y_i = A_i^{-T} dx_i, so the
    gradients of H_0, d, M, k and lambda are chunk matmuls (O(C^2 K + C K^2) per chunk); autograd through the
    materialised A_i would form dA [.., C, K, K] and push it back through the C^2 K^2 product that built A.
    q, k: [B, H, N, C, K]; h0: [B, H, N, K, K]; d: [B, H, N, C]; M: [B, H, N, C, C]; lamb: [H, K]."""

    @staticmethod
    def forward(ctx, q, h0, d, M, k, lamb):
        A = d[..., None, None] * h0.unsqueeze(3) + torch.einsum("bhnij,bhnjk,bhnjl->bhnikl", M, k, k)
        A.diagonal(dim1=-2, dim2=-1).add_(lamb[None, :, None, None, :])
        # no error check (it would sync with the device): A is positive definite for lambda > 0 and H_0 a
        # covariance, and any state this op returns is one
        lu, piv, _ = torch.linalg.lu_factor_ex(A)
        x = torch.linalg.lu_solve(lu, piv, q.unsqueeze(-1)).squeeze(-1)
        ctx.save_for_backward(lu, piv, x, h0, d, M, k)
        return x

    @staticmethod
    def backward(ctx, dx):
        lu, piv, x, h0, d, M, k = ctx.saved_tensors
        y = torch.linalg.lu_solve(lu, piv, dx.unsqueeze(-1), adjoint=True).squeeze(-1)  # dq
        kt = k.transpose(-1, -2)
        xk, yk = x @ kt, y @ kt  # [.., C(i), C(j)]: x_i . k_j, y_i . k_j
        d_d = -torch.einsum("bhnck,bhnkl,bhncl->bhnc", y, h0, x)
        d_h0 = -(y * d.unsqueeze(-1)).transpose(-1, -2) @ x
        d_M = -(yk * xk)
        d_k = -((M * xk).transpose(-1, -2) @ y + (M * yk).transpose(-1, -2) @ x)
        d_lamb = -(y * x).sum(dim=(0, 2, 3))
        return y, d_h0, d_d, d_M, d_k, d_lamb


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
