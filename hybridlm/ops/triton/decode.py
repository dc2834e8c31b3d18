"""Decode of the gated delta rule (GDN: a scalar log-decay per token and value head; KDA, CHANNEL: one per key
channel) for N sequences of T tokens each (T = 1: one decode step; T > 1: speculative / multi-token-prediction draft
tokens), each sequence on its own row of a state pool. Per token:
    S <- e^{g} S,   S <- S + k (beta (v - S^T k))^T,   o = scale S^T q.
Non-standard: the state rows are picked by state_indices (a serving engine's slots), one program per (V block,
sequence, value head); the fp32 state block is read once, the T tokens run on it in registers (the loop unrolled:
T is a constexpr, so T = 1 is the one-step kernel with no loop), and it is written where the caller keeps it:
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
def _decode_step(
    q, k, v, g, beta, pool, idx, o, inter, acc, scale,
    H, HV, T: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    L2: tl.constexpr, CHANNEL: tl.constexpr = False, INTER: tl.constexpr = False, ACC: tl.constexpr = False,
):
    iv = tl.program_id(0)
    inh = tl.program_id(1)
    n = inh // HV
    ihv = inh % HV
    ih = ihv // (HV // H)
    offs_k = tl.arange(0, BK)
    offs_v = iv * BV + tl.arange(0, BV)
    mk = offs_k < K
    mv = offs_v < V
    ms = mk[:, None] & mv[None, :]
    tile = offs_k[:, None] * V + offs_v[None, :]
    slot = tl.load(idx + n).to(tl.int64)
    sp = pool + (slot * HV + ihv) * K * V + tile
    S = tl.load(sp, mask=ms, other=0.0)
    if ACC:
        na = tl.load(acc + n).to(tl.int32)
    for t in tl.static_range(T):
        nt = n.to(tl.int64) * T + t  # row of token t in the [N, T, ...] inputs
        qq = tl.load(q + (nt * H + ih) * K + offs_k, mask=mk, other=0.0).to(tl.float32)
        kk = tl.load(k + (nt * H + ih) * K + offs_k, mask=mk, other=0.0).to(tl.float32)
        if L2:
            qq = qq * tl.rsqrt(tl.sum(qq * qq, 0) + 1e-6)
            kk = kk * tl.rsqrt(tl.sum(kk * kk, 0) + 1e-6)
        vv = tl.load(v + (nt * HV + ihv) * V + offs_v, mask=mv, other=0.0).to(tl.float32)
        if CHANNEL:  # KDA: one log-decay per key channel, g [N, T, HV, K]
            dec = tl.exp(tl.load(g + (nt * HV + ihv) * K + offs_k, mask=mk, other=0.0).to(tl.float32))[:, None]
        else:
            dec = tl.exp(tl.load(g + nt * HV + ihv).to(tl.float32))
        bb = tl.load(beta + nt * HV + ihv).to(tl.float32)
        S = S * dec
        u = bb * (vv - tl.sum(S * kk[:, None], 0))
        S = S + kk[:, None] * u[None, :]
        oo = tl.sum(S * qq[:, None], 0) * scale
        tl.store(o + (nt * HV + ihv) * V + offs_v, oo.to(o.dtype.element_ty), mask=mv)
        if INTER:
            tl.store(inter + (nt * HV + ihv) * K * V + tile, S, mask=ms)
        if ACC:  # a predicated-off store moves no bytes: the row is written once, at the accepted token
            tl.store(sp, S, mask=ms & (na == t + 1))
    if not INTER and not ACC:
        tl.store(sp, S, mask=ms)
