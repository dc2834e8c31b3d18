"""Decode of the gated delta rule (GDN: a scalar log-decay per token and value head; KDA, CHANNEL: one per key
channel) for N sequences of T tokens each (T = 1: one decode step; T > 1: speculative / multi-token-prediction draft
tokens), each sequence on its own row of a state pool. Per token:
    S <- e^{g} S,   S <- S + k (beta (v - S^T k))^T,   o = scale S^T q.
Non-standard: the state rows are picked by state_indices (a serving engine's slots), one program per (V block,
sequence, value head); the fp32 state block is read once, every token's inputs are loaded beside it as [T, *]
tiles before the first update (so their latencies overlap instead of adding up token by token), the T tokens run
on it in registers (the loop unrolled: T is a constexpr), and it is written where the caller keeps it:
- INTER: after every token to inter [N, T, HV, K, V] (the pool is then only read, unless ACC);
- ACC: to the pool row after token acc[n] - 1 only (acc[n] = 0 or out of 1..T: the row is not written);
- neither: to the pool row after the last token.
Any K, V: the key block BK is K's next power of two and the V blocks may pass V; loads there read 0 (a zero key
channel adds nothing to S^T k, the norms or o) and stores are masked, while every stride uses the real K and V.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _row(x, rows, t: tl.constexpr):
    """Row t of a [TP, B] tile as a [B] vector (a masked sum: T is at most 8, so this is a few adds a channel)."""
    return tl.sum(tl.where(rows[:, None] == t, x, 0.0), 0)


@triton.jit
def _decode_step(
    q, k, v, g, beta, pool, idx, o, inter, acc, scale,
    H, HV, T: tl.constexpr, TP: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, L2: tl.constexpr, CHANNEL: tl.constexpr = False, INTER: tl.constexpr = False,
    ACC: tl.constexpr = False,
):
    iv = tl.program_id(0)
    inh = tl.program_id(1)
    n = inh // HV
    ihv = inh % HV
    ih = ihv // (HV // H)
    offs_k = tl.arange(0, BK)
    offs_v = iv * BV + tl.arange(0, BV)
    rows = tl.arange(0, TP)
    mk = offs_k < K
    mv = offs_v < V
    mt = rows < T
    ms = mk[:, None] & mv[None, :]
    tile = offs_k[:, None] * V + offs_v[None, :]
    # every token's inputs first, as [TP, *] tiles (rows past T read 0): their loads are in flight together with
    # the state's, instead of one token's latency after another inside the token loop
    nt = n.to(tl.int64) * T + rows  # the rows of this sequence's tokens in the [N, T, ...] inputs
    qk_off = (nt[:, None] * H + ih) * K + offs_k[None, :]
    m_tk = mt[:, None] & mk[None, :]
    Q = tl.load(q + qk_off, mask=m_tk, other=0.0).to(tl.float32)
    Kt = tl.load(k + qk_off, mask=m_tk, other=0.0).to(tl.float32)
    Vt = tl.load(v + (nt[:, None] * HV + ihv) * V + offs_v[None, :], mask=mt[:, None] & mv[None, :],
                 other=0.0).to(tl.float32)
    if CHANNEL:  # KDA: one log-decay per key channel, g [N, T, HV, K]
        G = tl.load(g + (nt[:, None] * HV + ihv) * K + offs_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
    else:
        G = tl.load(g + nt * HV + ihv, mask=mt, other=0.0).to(tl.float32)
    Bt = tl.load(beta + nt * HV + ihv, mask=mt, other=0.0).to(tl.float32)
    if L2:
        Q = Q * tl.rsqrt(tl.sum(Q * Q, 1) + 1e-6)[:, None]
        Kt = Kt * tl.rsqrt(tl.sum(Kt * Kt, 1) + 1e-6)[:, None]
    slot = tl.load(idx + n).to(tl.int64)
    sp = pool + (slot * HV + ihv) * K * V + tile
    S = tl.load(sp, mask=ms, other=0.0)
    if ACC:
        na = tl.load(acc + n).to(tl.int32)
    for t in tl.static_range(T):
        qq = _row(Q, rows, t)
        kk = _row(Kt, rows, t)
        vv = _row(Vt, rows, t)
        if CHANNEL:
            S = S * tl.exp(_row(G, rows, t))[:, None]
        else:
            S = S * tl.exp(tl.sum(tl.where(rows == t, G, 0.0), 0))
        bb = tl.sum(tl.where(rows == t, Bt, 0.0), 0)
        u = bb * (vv - tl.sum(S * kk[:, None], 0))
        S = S + kk[:, None] * u[None, :]
        oo = tl.sum(S * qq[:, None], 0) * scale
        row = n.to(tl.int64) * T + t
        tl.store(o + (row * HV + ihv) * V + offs_v, oo.to(o.dtype.element_ty), mask=mv)
        if INTER:
            tl.store(inter + (row * HV + ihv) * K * V + tile, S, mask=ms)
        if ACC:  # a predicated-off store moves no bytes: the row is written once, at the accepted token
            tl.store(sp, S, mask=ms & (na == t + 1))
    if not INTER and not ACC:
        tl.store(sp, S, mask=ms)
