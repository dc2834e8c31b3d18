"""Token-by-token references for the delta-rule family: the yardstick every faster path is tested against.

Non-standard here: one loop serves all five recurrences. A step is always
    1. decay   S <- diag(exp(g_t)) S               (g_t scalar per head, or one value per key channel)
    2. read    r_t = S^T k_t                         (what the memory already says about k_t)
    3. write   S <- S + k_t u_t^T,  u_t = beta_t (v_t - r_t)   (delta rule)   or   u_t = beta_t v_t   (Hebbian)
    4. output  o_t = S^T q_t
and each op only chooses whether g exists, whether it is per channel, and whether the write is a delta.
The order (decay before the read) is transformers' and seed 000's.
Everything runs in the dtype it is given, so a float64 call is exact to rounding; no padding, no chunking.
"""

from __future__ import annotations

import torch


def recurrence_naive(
    q_BTHK: torch.Tensor,
    k_BTHK: torch.Tensor,
    v_BTHV: torch.Tensor,
    *,
    g: torch.Tensor | None,
    beta: torch.Tensor | None,
    delta: bool,
    state_BHKV: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch of equal-length sequences, heads already expanded (q/k have HV heads), already scaled.

    q, k: [B, T, HV, K]; v: [B, T, HV, V]; g: None, [B, T, HV, 1] or [B, T, HV, K] (log-decay);
    beta: None or [B, T, HV]; state: [B, HV, K, V]. Returns o [B, T, HV, V] and the final state, in the input dtype.
    """
    S = state_BHKV
    outs = []
    for t in range(q_BTHK.shape[1]):
        q_t, k_t, v_t = q_BTHK[:, t], k_BTHK[:, t], v_BTHV[:, t]
        # 1. decay (a per-channel g scales rows of S: key channel i forgets at its own rate)
        if g is not None:
            S = S * g[:, t].exp().unsqueeze(-1)
        # 2. read what the memory predicts for this key
        r_t = torch.einsum("bhk,bhkv->bhv", k_t, S)
        # 3. write: the delta rule writes only the prediction error
        u_t = v_t - r_t if delta else v_t
        if beta is not None:
            u_t = beta[:, t].unsqueeze(-1) * u_t
        S = S + k_t.unsqueeze(-1) * u_t.unsqueeze(-2)
        # 4. read out with the query
        outs.append(torch.einsum("bhk,bhkv->bhv", q_t, S))
    o = torch.stack(outs, dim=1) if outs else v_BTHV.new_zeros(v_BTHV.shape)
    return o, S
