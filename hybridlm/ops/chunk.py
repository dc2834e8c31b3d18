"""The chunkwise (WY / UT transform) form of the delta-rule family, in plain PyTorch.

Non-standard here: written as numbered steps that follow the derivation in docs/math.md, and exact in float64
(every decay factor that is materialised is exp of a non-positive number, so nothing overflows and nothing is
divided by a decay). It is the reference the Triton kernels are checked against at scale and the fast CPU path.

Within a chunk of C steps starting from state S0, with b_i = sum_{s<=i} g_s (log-decay accumulated inside the
chunk, per key channel or per head) the recurrence unrolls to
    S_i = diag(e^{b_i}) S0 + sum_{j<=i} diag(e^{b_i - b_j}) k_j u_j^T
and the delta rule's u_i = beta_i (v_i - S_{i-1}'^T k_i) becomes a unit lower-triangular system
    (I + A) U = diag(beta) (V - (K * e^{b}) S0),   A_ij = beta_i k_i^T diag(e^{b_i - b_j}) k_j  (j < i)
so with T = (I + A)^{-1} (the UT transform), U = T diag(beta) V - T diag(beta) (K * e^b) S0 = U0 - W S0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _pairwise_decay(b: torch.Tensor, inclusive: bool, dtype: torch.dtype) -> torch.Tensor:
    """b: [..., C, D] cumulative log-decay in float64 (D = 1 or K). Returns exp(b_i - b_j) in `dtype` as
    [..., C, C, D] for j <= i (j < i if not inclusive) and 0 elsewhere. Masking happens before exp, so no inf ever
    appears."""
    C = b.shape[-2]
    diff = (b.unsqueeze(-2) - b.unsqueeze(-3)).to(dtype)  # [..., i, j, D]
    keep = torch.ones(C, C, dtype=torch.bool, device=b.device).tril(0 if inclusive else -1)
    return diff.masked_fill(~keep[..., None], float("-inf")).exp()


def _decayed_products(x: torch.Tensor, y: torch.Tensor, decay: torch.Tensor) -> torch.Tensor:
    """sum_d x_id y_jd decay_ijd, for x, y [..., C, K] and decay [..., C, C, D] with D in {1, K}."""
    if decay.shape[-1] == 1:  # scalar decay: one matmul, then scale
        return (x @ y.transpose(-1, -2)) * decay[..., 0]
    return torch.einsum("...id,...jd,...ijd->...ij", x, y, decay)


def _masked_products(x: torch.Tensor, y: torch.Tensor, b: torch.Tensor, inclusive: bool, sub: int = 16) -> torch.Tensor:
    """sum_d x_id y_jd e^{b_id - b_jd} for j <= i (j < i if not inclusive), else 0. x, y: [..., C, K];
    b: [..., C, D] in float64 (see step 1 of `recurrence_chunk`); the result is in x's dtype.

    Scalar decay (D = 1) is one matmul. Per-channel decay (D = K) would need the [C, C, K] tensor of factors; instead
    split the chunk into sub-blocks of `sub` steps: diagonal sub-blocks use the exact pairwise form, and an
    off-diagonal block (rows i after column block c) factors e^{b_i - b_j} = e^{b_i - r_c} e^{r_c - b_j} through
    r_c = b at the end of block c. Since b does not increase, both factors are <= 1: exact, no overflow, two matmuls.
    """
    if b.shape[-1] == 1:
        return _decayed_products(x, y, _pairwise_decay(b, inclusive, x.dtype))
    C, K = x.shape[-2:]
    S = min(sub, C)
    NS = C // S
    lead = x.shape[:-2]
    xs, ys, bs = (t.reshape(*lead, NS, S, K) for t in (x, y, b))
    # diagonal sub-blocks, exact pairwise: [..., NS, S, S] placed on the block diagonal
    diag = _decayed_products(xs, ys, _pairwise_decay(bs, inclusive, x.dtype))
    eye = torch.eye(NS, dtype=x.dtype, device=x.device).view(NS, 1, NS, 1)
    out = (diag.unsqueeze(-2) * eye).reshape(*lead, C, C)
    if NS == 1:
        return out
    # off-diagonal blocks through the reference point r_c of each column block c
    r = bs[..., -1, :]  # [..., NS, K]
    y_f = ys * (r.unsqueeze(-2) - bs).to(x.dtype).exp()  # [..., NS, S, K], factors <= 1
    later = (torch.arange(C, device=x.device) // S)[None, :] > torch.arange(NS, device=x.device)[:, None]  # [NS, C]
    expo = (b.unsqueeze(-3) - r.unsqueeze(-2)).to(x.dtype).masked_fill(~later[..., None], float("-inf"))
    x_f = x.unsqueeze(-3) * expo.exp()  # rows not after block c are exactly 0
    off = x_f @ y_f.transpose(-1, -2)  # [..., NS (column block), C (row), S]
    return out + off.movedim(-3, -2).reshape(*lead, C, C)


def recurrence_chunk(
    q_BTHK: torch.Tensor,
    k_BTHK: torch.Tensor,
    v_BTHV: torch.Tensor,
    *,
    g: torch.Tensor | None,
    beta: torch.Tensor | None,
    delta: bool,
    state_BHKV: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `naive.recurrence_naive`: heads expanded, q scaled, one dtype. T is padded inside."""
    B, T, HV, K = q_BTHK.shape
    V = v_BTHV.shape[-1]
    C = chunk_size
    pad = (-T) % C
    NC = (T + pad) // C
    dtype = q_BTHK.dtype
    if g is None:
        g = q_BTHK.new_zeros(B, T, HV, 1)
    if beta is None:
        beta = q_BTHK.new_ones(B, T, HV)

    # 0. Pad to whole chunks. A padded step has k = v = 0 and g = 0: it neither decays nor writes the state.
    def to_chunks(x: torch.Tensor) -> torch.Tensor:  # [B, T, HV, D] -> [B, HV, NC, C, D]
        x = F.pad(x, (0, 0, 0, 0, 0, pad))
        return x.reshape(B, NC, C, HV, x.shape[-1]).permute(0, 3, 1, 2, 4)

    q, k, v, gc = (to_chunks(x) for x in (q_BTHK, k_BTHK, v_BTHV, g))
    bt = to_chunks(beta.unsqueeze(-1))  # [B, HV, NC, C, 1]

    # 1. Cumulative log-decay inside each chunk: b_i = g_1 + ... + g_i (<= 0, non-increasing). Kept in float64
    #    whatever the dtype: every decay factor below is e^{b_i - b_j}, and a float32 difference of two long sums
    #    keeps only |b| * 6e-8 of absolute precision, which is the factor's relative error (2e-4 after 128 steps
    #    of -30: o was off by 3e-5 and dg by 8e-5). Each exponent is cast to the working dtype after the difference,
    #    so autograd also sums its gradient into b (rows minus columns) in float64; an fp32 (hi, lo) pair, as the
    #    Triton kernels use, gave the same forward but dg off by 2e-5 here (and KDA only 7% faster on the CPU).
    b = gc.double().cumsum(dim=-2)  # [B, HV, NC, C, D]
    eb = b.to(dtype).exp()
    b_last = b[..., -1:, :]  # [B, HV, NC, 1, D]
    chunk_decay = b_last.to(dtype).exp().transpose(-1, -2)  # [B, HV, NC, D, 1]: the state's decay over a chunk

    # 2. Intra-chunk attention of queries on keys, with the decay between the two positions (j <= i).
    P = _masked_products(q, k, b, inclusive=True)  # [B, HV, NC, C, C]

    # 3. The UT transform. Delta rule: solve (I + A) X = RHS once for the values and once for the keys that read
    #    the chunk's initial state. Hebbian write: u is just beta * v and no key reads the state.
    if delta:
        A = bt * _masked_products(k, k, b, inclusive=False)  # strictly lower
        eye = torch.eye(C, dtype=dtype, device=q.device)
        unit_lower = A + eye
        U0 = torch.linalg.solve_triangular(unit_lower, bt * v, upper=False, unitriangular=True)
        W = torch.linalg.solve_triangular(unit_lower, bt * k * eb, upper=False, unitriangular=True)
    else:
        U0, W = bt * v, None

    # 4. Sweep the chunks in order, carrying the state.
    q_dec = q * eb  # queries read the chunk-initial state through the decay since the chunk start
    k_dec = k * (b_last - b).to(dtype).exp()  # keys written now are decayed until the chunk end
    S = state_BHKV
    outs = []
    for n in range(NC):
        U = U0[:, :, n] if W is None else U0[:, :, n] - W[:, :, n] @ S  # 4a. the writes, corrected for S0
        outs.append(q_dec[:, :, n] @ S + P[:, :, n] @ U)  # 4b. read S0 + intra-chunk contributions
        S = S * chunk_decay[:, :, n] + k_dec[:, :, n].transpose(-1, -2) @ U  # 4c. next state
    o = torch.stack(outs, dim=2) if outs else v.new_zeros(B, HV, 0, C, V)
    o = o.reshape(B, HV, NC * C, V)[:, :, :T].transpose(1, 2)
    return o, S
