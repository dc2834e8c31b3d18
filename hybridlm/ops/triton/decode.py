"""One decode step of the gated delta rule (GDN: a scalar log-decay per token and value head; KDA, CHANNEL: one per
key channel) for N sequences, each on its own row of a state pool, updated in place:
    S <- e^{g} S,   S <- S + k (beta (v - S^T k))^T,   o = scale S^T q.
Non-standard: the state rows are picked by state_indices (a serving engine's slots), one program per (V block,
sequence, value head); the fp32 state is read and written once. Any K, V: the key block BK is K's next power of
two and the V blocks may pass V; loads there read 0 (a zero key channel adds nothing to S^T k, the norms or o) and
stores are masked, while every stride uses the real K and V.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _decode_step(
    q, k, v, g, beta, pool, idx, o, scale,
    H, HV, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, L2: tl.constexpr,
    CHANNEL: tl.constexpr = False,
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
    slot = tl.load(idx + n).to(tl.int64)
    sp = pool + (slot * HV + ihv) * K * V + offs_k[:, None] * V + offs_v[None, :]
    S = tl.load(sp, mask=ms, other=0.0)
    qq = tl.load(q + (n * H + ih) * K + offs_k, mask=mk, other=0.0).to(tl.float32)
    kk = tl.load(k + (n * H + ih) * K + offs_k, mask=mk, other=0.0).to(tl.float32)
    if L2:
        qq = qq * tl.rsqrt(tl.sum(qq * qq, 0) + 1e-6)
        kk = kk * tl.rsqrt(tl.sum(kk * kk, 0) + 1e-6)
    vv = tl.load(v + (n * HV + ihv) * V + offs_v, mask=mv, other=0.0).to(tl.float32)
    if CHANNEL:  # KDA: one log-decay per key channel, g [N, HV, K]
        dec = tl.exp(tl.load(g + (n * HV + ihv) * K + offs_k, mask=mk, other=0.0).to(tl.float32))[:, None]
    else:
        dec = tl.exp(tl.load(g + n * HV + ihv).to(tl.float32))
    bb = tl.load(beta + n * HV + ihv).to(tl.float32)
    S = S * dec
    u = bb * (vv - tl.sum(S * kk[:, None], 0))
    S = S + kk[:, None] * u[None, :]
    oo = tl.sum(S * qq[:, None], 0) * scale
    tl.store(sp, S, mask=ms)
    tl.store(o + (n * HV + ihv) * V + offs_v, oo.to(o.dtype.element_ty), mask=mv)
