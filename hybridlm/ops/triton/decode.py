"""One decode step of the gated delta rule (GDN: a scalar log-decay per token and value head; KDA, CHANNEL: one per
key channel) for N sequences, each on its own row of a state pool, updated in place:
    S <- e^{g} S,   S <- S + k (beta (v - S^T k))^T,   o = scale S^T q.
Non-standard: the state rows are picked by state_indices (a serving engine's slots), one program per (V block,
sequence, value head); the fp32 state is read and written once.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _decode_step(
    q, k, v, g, beta, pool, idx, o, scale,
    H, HV, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, L2: tl.constexpr, CHANNEL: tl.constexpr = False,
):
    iv = tl.program_id(0)
    inh = tl.program_id(1)
    n = inh // HV
    ihv = inh % HV
    ih = ihv // (HV // H)
    offs_k = tl.arange(0, K)
    offs_v = iv * BV + tl.arange(0, BV)
    slot = tl.load(idx + n).to(tl.int64)
    sp = pool + (slot * HV + ihv) * K * V + offs_k[:, None] * V + offs_v[None, :]
    S = tl.load(sp)
    qq = tl.load(q + (n * H + ih) * K + offs_k).to(tl.float32)
    kk = tl.load(k + (n * H + ih) * K + offs_k).to(tl.float32)
    if L2:
        qq = qq * tl.rsqrt(tl.sum(qq * qq, 0) + 1e-6)
        kk = kk * tl.rsqrt(tl.sum(kk * kk, 0) + 1e-6)
    vv = tl.load(v + (n * HV + ihv) * V + offs_v).to(tl.float32)
    if CHANNEL:  # KDA: one log-decay per key channel, g [N, HV, K]
        dec = tl.exp(tl.load(g + (n * HV + ihv) * K + offs_k).to(tl.float32))[:, None]
    else:
        dec = tl.exp(tl.load(g + n * HV + ihv).to(tl.float32))
    bb = tl.load(beta + n * HV + ihv).to(tl.float32)
    S = S * dec
    u = bb * (vv - tl.sum(S * kk[:, None], 0))
    S = S + kk[:, None] * u[None, :]
    oo = tl.sum(S * qq[:, None], 0) * scale
    tl.store(sp, S)
    tl.store(o + (n * HV + ihv) * V + offs_v, oo.to(o.dtype.element_ty))
