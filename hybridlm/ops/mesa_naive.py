"""MesaNet's token-by-token reference: the yardstick the chunked form is tested against.

Non-standard here:
- The memory is a least-squares problem, not a matrix that is read: two states are kept, the key covariance
  H_t = e^{g_t} H_{t-1} + beta_t k_t k_t^T  [K, K] and the key-value covariance G_t = e^{g_t} G_{t-1} + beta_t k_t v_t^T
  [K, V], and every token solves (H_t + diag(lambda)) x_t = q_t, o_t = G_t^T x_t (the output of the ridge-regression
  fit of all keys seen so far to their values, evaluated at q_t).
- The solve is exact (torch.linalg.solve) unless `cg_iters` asks for conjugate gradient on the explicit matrix,
  the approximation the paper and fla use; `conjugate_gradient` is shared with the chunked form, which feeds it a
  different matrix-vector product (chunk states + intra-chunk terms, no per-token matrix).
Everything runs in the dtype it is given, so a float64 call is exact to rounding.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def _safe_div(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den where den > 0, else 0: a converged (or zero) right-hand side stops the iteration instead of giving
    0 / 0, and the masked branch divides by 1 so that autograd sees no NaN either."""
    ok = den > 0
    return torch.where(ok, num / torch.where(ok, den, torch.ones_like(den)), torch.zeros_like(num))


def conjugate_gradient(matvec: Callable[[torch.Tensor], torch.Tensor], b: torch.Tensor, iters: int) -> torch.Tensor:
    """`iters` steps of conjugate gradient for A x = b from x = 0, batched over every leading dim of b [..., K].

    matvec(p [..., K]) -> A p [..., K] with A symmetric positive definite (H + diag(lambda), lambda > 0). K steps
    solve a K x K system exactly in exact arithmetic; fewer give the approximation the layer trains with."""
    x = torch.zeros_like(b)
    r, p = b, b
    delta = (r * r).sum(-1, keepdim=True)
    for _ in range(iters):
        ap = matvec(p)
        alpha = _safe_div(delta, (p * ap).sum(-1, keepdim=True))
        x = x + alpha * p
        r = r - alpha * ap
        delta_new = (r * r).sum(-1, keepdim=True)
        p = r + _safe_div(delta_new, delta) * p
        delta = delta_new
    return x


def mesa_naive(
    q_BTHK: torch.Tensor,
    k_BTHK: torch.Tensor,
    v_BTHV: torch.Tensor,
    *,
    g: torch.Tensor,
    beta: torch.Tensor,
    lamb: torch.Tensor,
    h_BHKK: torch.Tensor,
    s_BHKV: torch.Tensor,
    cg_iters: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One batch of equal-length sequences, heads already expanded and q already scaled / normalised.

    q, k: [B, T, H, K]; v: [B, T, H, V]; g, beta: [B, T, H]; lamb: [H, K]; h: [B, H, K, K] (key covariance),
    s: [B, H, K, V] (key-value covariance). Returns o [B, T, H, V] and the final (h, s)."""
    Hs, Gs = h_BHKK, s_BHKV
    reg = torch.diag_embed(lamb)  # [H, K, K]
    outs = []
    for t in range(q_BTHK.shape[1]):
        q_t, k_t, v_t = q_BTHK[:, t], k_BTHK[:, t], v_BTHV[:, t]
        decay = g[:, t].exp()[..., None, None]
        kb = beta[:, t, :, None] * k_t
        # 1. forget, then add this token to both sufficient statistics of the regression
        Hs = decay * Hs + kb.unsqueeze(-1) * k_t.unsqueeze(-2)
        Gs = decay * Gs + kb.unsqueeze(-1) * v_t.unsqueeze(-2)
        # 2. the regularised solve: x_t = (H_t + diag(lambda))^{-1} q_t
        A = Hs + reg
        if cg_iters is None:
            x = torch.linalg.solve(A, q_t.unsqueeze(-1)).squeeze(-1)
        else:
            x = conjugate_gradient(lambda p, A=A: (A @ p.unsqueeze(-1)).squeeze(-1), q_t, cg_iters)
        # 3. read out: o_t = G_t^T x_t
        outs.append(torch.einsum("bhk,bhkv->bhv", x, Gs))
    o = torch.stack(outs, dim=1) if outs else v_BTHV.new_zeros(v_BTHV.shape)
    return o, Hs, Gs
