"""Host side of the Triton Kimi Delta Attention kernels: forward, backward and the decode step.

- `chunk_kda(q, k, v, g=, beta=, ...)`: same contract as `hybridlm.ops.kda` (g [B, T, HV, K] per-channel
  log-decay, float32); differentiable in q, k, v, g, beta and initial_state.
- `kda_decode`: the custom op of the decode kernel with per-channel decay, behind `fused_recurrent_kda_update`
  (`decode_entry.py`).

The stages are GDN's (`gdn.py`) where the per-channel decay allows: the UT solve (`ut_solve._solve_blocks`), the
serial state passes (`state_pass`, CHANNEL) and the decode step; the chunk-local work with the decay inside
products over channels is KDA's own (`kda_prep`, `kda_bwd`, the decay forms in `kda_decay`):
    Qg, Kd, P, A  `kda_prep._kda_prep_ap`   T = (I + A)^{-1}  `_solve_blocks`   W, U  `kda_prep._kda_prep_wu`
    Vn, S         `state_pass._recur_fwd`   O = Qg S + P Vn   `chunk_out._out_fwd`
Backward: `state_pass._recur_bwd`, then `kda_bwd._kda_bwd_out_blk` and `_kda_bwd_state_blk`. `dh0_without_dht`:
the serial pass alone with no final-state cotangent, offered to context parallelism as GDN's (`gdn.py`).

Kimi's gate inside the kernels (`chunk_kda(..., A_log=, dt_bias=, lower_bound=)`, g then the raw gate; `Gate`): no
launch of its own either way. The prep's first launch (`_kda_prep_ap`, DIAG 3, whose every program runs over its
whole chunk) computes g from raw, A_log and dt_bias in fp32 and writes it where a separate gate launch would have;
every later launch and the backward read that g. Written, not recomputed: the kernels read g in several layouts
(row tiles, the next row, single rows of each 16-row block) and sum their exponents from it, so recomputing it
would put a softplus into each of those reads. The state backward's last pass, where dg is final (the reverse
cumsum), multiplies it by dg/draw and writes the raw gate's gradient in raw's dtype instead of dg; the row sums
for dt_bias ([chunks, HV, K]) and A_log ([chunks, HV]) are fp32 partials per (chunk, head) summed here (no
atomics: deterministic). Bytes an element of [B, T, HV, K] against the gates kernel's two launches, for bf16 raw:
forward 6 -> 6 (raw read, g written) with the prep's first g read now from what the same program just wrote, and
one launch fewer; backward 12 -> 4 (dg's fp32 write, the gates kernel's dg and raw reads and draw write become a
raw read and a draw write in the state backward), and one launch fewer. The decode step (`kda_decode`) still
takes g: the layer's cached token computes it first (`hybridlm.ops.kda_gate`, fused=True).

Custom ops (torch.library, with fake kernels): `hybridlm::kda_chunk_fwd`, `hybridlm::kda_chunk_bwd`,
`hybridlm::kda_chunk_bwd_rc`, `hybridlm::kda_decode`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..context_parallel import offer_dh0, wants_dh0
from ..launch import launcher
from . import chunk_out, gdn, kda_bwd, kda_prep, state_pass, ut_solve
from .chunk_layout import max_chunks
from .custom import call, custom_op
from .tune import LaunchTable

# the launches of each K-blocked kernel, in order (`kda_decay._diag_pass`): the whole chunk by one dot, its diagonal
# blocks by one dot, by their 8-row halves' dots, the rest exactly; each takes the chunks the earlier ones left
DIAG_MODES = (3, 1, 4, 2)


@dataclass
class KDALaunch(LaunchTable):
    """Launch settings of the KDA kernels (scripts/gpu_tune.py sweeps them; sm_90 = scripts/compile_sm90.py)."""

    bk: int = 32  # key block of the K-blocked prep and backward (16, 32 or 64; at most K)
    prep_warps: int = 4  # the prep's launches (8 spill less on sm_90 but ran the forward 25% slower)
    bwd_warps: int = 8  # both backward kernels: 4 reads shared memory out of bounds on sm_90, refused on CUDA
    state_warps: int = 4  # both state passes; 8 where their chunk loop runs once (`gdn._state_warps`)
    out_bv: int = 64  # `_out_fwd`'s V block
    out_warps: int = 8  # `_out_fwd`


TUNE = KDALaunch()


def _chunk_size(K: int, dtype: torch.dtype) -> int:
    """Chunk length: 64, but 32 above K=128 where the intermediates are float32 (`_numerics`). sm_90 compile
    (compile_sm90.py, K=V=256 fp32, V block 16): at 64 the sequential kernels need 228 KB of shared memory (the H100
    allows 227 KB), at 32 118 KB. Fixed per (K, dtype), not found by trial, so the fake kernel's saved shapes
    match."""
    return 32 if K > 128 and _numerics(dtype)[0] == torch.float32 else 64


def _numerics(dtype: torch.dtype) -> tuple[torch.dtype, str]:
    """(dtype of the intermediates, dot precision) for inputs of dtype. bfloat16 as GDN (`gdn._store_dtype`,
    `gdn._prec`): 16-bit intermediates, tf32 where an operand is fp32. float16 takes the float32 path (float32
    intermediates, IEEE dots): the per-channel decay products are [BT, BT] dots of factors up to e^60 whose row and
    column sums cancel in dg, and fla's masked varlen test put dt_bias's gradient 1.6% off with float16
    intermediates and tf32 dots (H100), 0.7% with 3xTF32 dots (H200; fla's bar: 0.5%; docs/fla.md). float32
    intermediates with tf32 or 3xTF32 dots are not an option on sm_90: the state backward then needs 260 KB of
    shared memory, and under 3xTF32 a one-chunk GVA case hit an illegal memory access (H200)."""
    if dtype == torch.float16:
        return torch.float32, "ieee"
    return gdn._store_dtype(dtype), gdn._prec(dtype)


@custom_op("kda_chunk_fwd")
def kda_chunk_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None, scale: float, use_qk_l2norm: bool,
    output_final_state: bool, save: bool, A_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
) -> list[torch.Tensor]:
    """Returns [o [B, T, HV, V], final_state [N, HV, K, V] fp32 or empty] and, when save, the intermediates of
    the backward: T, W, chunk states, Vn, Qg, Kd, P, bL (per chunk and channel) and, with Kimi's gate (A_log [HV]
    given: g is the raw gate, dt_bias [HV, KR], `Gate`), the log-decay g [tokens, HV, K] fp32 its first launch
    made."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    BT = _chunk_size(K, q.dtype)
    dev = q.device
    lay = gdn.layout(cu_seqlens, B, T, BT, dev)
    N, Ttot, nc = lay.N, lay.Ttot, lay.nc
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    f32 = torch.float32
    gate = None
    if A_log is not None:  # g is the raw gate: the prep's first launch writes the log-decay to gf
        gate = Gate(g, A_log.contiguous(), dt_bias.contiguous(), lower_bound)
        g = gdn._out((Ttot, HV, K), q, f32)
    sd, prec = _numerics(q.dtype)
    lowp = sd != f32
    NCb = max_chunks(Ttot, N, BT) if save else max(nc, 1)
    e = lambda *s, dt=sd: torch.empty(*s, device=dev, dtype=dt)  # noqa: E731
    Tb, Pb, BLb = e(NCb, HV, BT, BT, dt=f32), e(NCb, HV, BT, BT), e(NCb, HV, K, dt=f32)
    Wb, Ub, Qg, Kd = e(Ttot, HV, K), e(Ttot, HV, V), e(Ttot, HV, K), e(Ttot, HV, K)
    hb, vn = e(NCb, HV, K, V), e(Ttot, HV, V)
    o = gdn._out((B, T, HV, V), q, q.dtype)
    ht = gdn._out((N, HV, K, V), q, f32) if output_final_state else q.new_empty(0, dtype=f32)
    if nc > 0:
        _prep(q, k, v, g, beta, Tb, Wb, Ub, Qg, Kd, Pb, BLb, lay, scale, use_qk_l2norm, prec, gate)
    h0 = initial_state.contiguous() if initial_state is not None else ht
    BV = gdn._recur_bv(K, V, N * HV, dev)
    launcher(state_pass._recur_fwd)[(V // BV, N * HV)](
        BLb, Wb, Ub, Kd, Kd, h0, ht, hb, vn, lay.cu_t, lay.chunk_off, lay.nch,
        H=H, HV=HV, K=K, V=V, BT=BT, BV=BV, PREC=prec, HAS_H0=initial_state is not None,
        STORE_HT=output_final_state, LOWP=lowp, CHANNEL=True,
        num_warps=gdn._state_warps(TUNE.state_warps, dev, lay.nch), num_stages=gdn.fwd_stages(),
    )
    if nc > 0:
        BVo = min(TUNE.out_bv, V)
        launcher(chunk_out._out_fwd)[(V // BVo, nc, HV)](
            Qg, Pb, hb, vn, o, lay.cu_t, lay.chunk_seq, lay.chunk_start,
            HV=HV, K=K, V=V, BT=BT, BV=BVo, PREC=prec, LOWP=lowp, num_warps=TUNE.out_warps, num_stages=1,
        )
    if not save:
        return [o, ht]
    return [o, ht, Tb, Wb, hb, vn, Qg, Kd, Pb, BLb] + ([g] if gate is not None else [])


def _bwd_warps(dev: torch.device) -> int:
    """TUNE.bwd_warps of the backward launches. Refused on CUDA below 8: at 4 warps compute-sanitizer (H100, Triton
    3.6) shows `_kda_bwd_out_blk` reading shared memory out of bounds (1 KB at 116 KB, in a reduction), then
    infinite gradients or an illegal memory access."""
    w = TUNE.bwd_warps
    if dev.type == "cuda" and w < 8:
        raise ValueError(f"kda.TUNE.bwd_warps: expected 8 or more on CUDA (4 reads shared memory out of bounds in "
                         f"_kda_bwd_out_blk on sm_90), got {w}")
    return w


def _redo(nc: int, HV: int, dev: torch.device) -> torch.Tensor:
    """The int32 [chunks, HV] marks that pass chunks from one launch of a K-blocked kernel to the next
    (`kda_decay._diag_pass`); its first launch writes every entry."""
    return torch.empty(max(nc, 1), HV, device=dev, dtype=torch.int32)


@dataclass
class Gate:
    """Kimi's gate taken inside the kernels: g = -exp(A_log[h]) softplus(raw + dt_bias[h]), or with lower_bound
    lower_bound sigmoid(exp(A_log[h]) (raw + dt_bias[h])) (`hybridlm.ops.kda_gate`, `kda_decay._kimi_gate`)."""

    raw: torch.Tensor  # [B, T, HV, K] (K padded as q, k), any float dtype
    A_log: torch.Tensor  # [HV] (zeros for lower_bound without A_log: exp(A_log) = 1)
    dt_bias: torch.Tensor  # [HV, KR], KR the unpadded head dim (zeros for no bias)
    lower_bound: float | None  # the sigmoid form's bound (< 0), or None: the softplus form

    def args(self) -> dict:
        """The gate's launch arguments of `_kda_prep_ap` and `_kda_bwd_state_blk`."""
        lb = self.lower_bound
        return dict(raw=self.raw, A_log=self.A_log, dt_bias=self.dt_bias, KR=self.dt_bias.shape[1],
                    lb=0.0 if lb is None else float(lb), LB=lb is not None)


def _no_gate(g: torch.Tensor) -> dict:
    """The gate's launch arguments where there is none (never read: GATE is off)."""
    return dict(raw=g, A_log=g, dt_bias=g, KR=0, lb=0.0, LB=False)


def _prep(q, k, v, g, beta, Tb, Wb, Ub, Qg, Kd, Pb, BLb, lay, scale: float, l2: bool, prec: str,
          gate: Gate | None = None) -> None:
    """Everything of each chunk that does not depend on the state (T, W, U, Qg, Kd, P, bL); with gate, the first
    launch writes g (the buffer g) from the raw gate first."""
    H, K, HV, V = q.shape[2], q.shape[3], v.shape[2], v.shape[3]
    BT = Tb.shape[-1]
    grid = (lay.nc, HV)
    chunks = (lay.cu_t, lay.chunk_seq, lay.chunk_start)
    BK = gdn.key_block(TUNE.bk, "bk", K)
    redo = _redo(lay.nc, HV, q.device)
    for mode in DIAG_MODES:
        first = gate is not None and mode == DIAG_MODES[0]  # the first launch makes g for every later one
        ga = gate.args() if first else _no_gate(g)
        launcher(kda_prep._kda_prep_ap)[grid](q, k, g, beta, Tb, Qg, Kd, Pb, BLb, redo, *chunks, scale, **ga, H=H,
                                              HV=HV, K=K, BT=BT, BK=BK, L2=l2, PREC=prec, DIAG=mode, GATE=first,
                                              num_warps=TUNE.prep_warps, num_stages=1)
    launcher(ut_solve._solve_blocks)[grid](Tb, HV, BT=BT, PREC=prec, num_warps=1, num_stages=1)
    launcher(kda_prep._kda_prep_wu)[grid](k, v, g, beta, Tb, Wb, Ub, *chunks, H=H, HV=HV, K=K, V=V, BT=BT, BK=BK,
                                          BV=min(V, 64), L2=l2, PREC=prec, num_warps=TUNE.prep_warps, num_stages=1)


@kda_chunk_fwd.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm, output_final_state, save, A_log=None,
      dt_bias=None, lower_bound=None):
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    f32 = torch.float32
    ht = q.new_empty(N, HV, K, V, dtype=f32) if output_final_state else q.new_empty(0, dtype=f32)
    out = [q.new_empty(B, T, HV, V), ht]
    if save:
        BT, sd, Tt = _chunk_size(K, q.dtype), _numerics(q.dtype)[0], B * T
        NC = max_chunks(Tt, N, BT)
        out += [q.new_empty(NC, HV, BT, BT, dtype=f32), q.new_empty(Tt, HV, K, dtype=sd),
                q.new_empty(NC, HV, K, V, dtype=sd), q.new_empty(Tt, HV, V, dtype=sd),
                q.new_empty(Tt, HV, K, dtype=sd), q.new_empty(Tt, HV, K, dtype=sd),
                q.new_empty(NC, HV, BT, BT, dtype=sd), q.new_empty(NC, HV, K, dtype=f32)]
        if A_log is not None:
            out.append(q.new_empty(Tt, HV, K, dtype=f32))
    return out


@custom_op("kda_chunk_bwd")
def kda_chunk_bwd(
    do: torch.Tensor, dht: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    g: torch.Tensor, beta: torch.Tensor, saved: list[torch.Tensor], cu_seqlens: torch.Tensor | None, scale: float,
    use_qk_l2norm: bool, has_h0: bool, A_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
) -> list[torch.Tensor]:
    """Returns [dq, dk, dv, dg, dbeta, dinitial_state or empty, dA_log, ddt_bias]; with Kimi's gate (A_log given,
    g the raw gate) dg is the raw gate's gradient and dA_log [HV], ddt_bias [HV, KR] follow, else they are
    empty."""
    return _bwd_impl(do, dht, q, k, v, g, beta, list(saved), cu_seqlens, scale, use_qk_l2norm, has_h0,
                     _gate(g, A_log, dt_bias, lower_bound))


@custom_op("kda_chunk_bwd_rc")
def kda_chunk_bwd_rc(
    do: torch.Tensor, dht: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    g: torch.Tensor, beta: torch.Tensor, cu_seqlens: torch.Tensor | None, scale: float, use_qk_l2norm: bool,
    has_h0: bool, h0: torch.Tensor | None, A_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
) -> list[torch.Tensor]:
    """kda_chunk_bwd for recompute=True: reruns the forward inside, so that W, Qg, Kd and P are freed before the
    chunk backward's own buffers exist."""
    saved = kda_chunk_fwd(q, k, v, g, beta, h0, cu_seqlens, scale, use_qk_l2norm, False, True, A_log, dt_bias,
                          lower_bound)[2:]
    return _bwd_impl(do, dht, q, k, v, g, beta, saved, cu_seqlens, scale, use_qk_l2norm, has_h0,
                     _gate(g, A_log, dt_bias, lower_bound))


def _gate(raw, A_log, dt_bias, lower_bound) -> Gate | None:
    return None if A_log is None else Gate(raw.contiguous(), A_log.contiguous(), dt_bias.contiguous(), lower_bound)


def _bwd_impl(do, dht, q, k, v, g, beta, saved: list[torch.Tensor | None], cu_seqlens, scale: float,
              use_qk_l2norm: bool, has_h0: bool, gate: Gate | None = None) -> list[torch.Tensor]:
    """saved: the forward's [T, W, h, Vn, Qg, Kd, P, bL] (and with gate the g it made; g is then the raw gate);
    W, Qg, Kd and P serve only the state recurrence's backward, so their entries are cleared after its launch
    (freed when the list holds the only references)."""
    Tb, Wb, hb, vn, Qg, Kd, Pb, BLb = saved[:8]
    if gate is not None:
        g = saved[8]
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    BT = Tb.shape[-1]
    dev = q.device
    lay = gdn.layout(cu_seqlens, B, T, BT, dev)
    N, Ttot, nc = lay.N, lay.Ttot, lay.nc
    q, k, v, g, beta, do = (x.contiguous() for x in (q, k, v, g, beta, do))
    dht = dht.contiguous() if dht is not None else None  # e.g. the expanded ones of ht.sum()'s backward
    f32 = torch.float32
    prec = _numerics(q.dtype)[1]
    dhb = torch.empty_like(hb)
    dvn = torch.empty(Ttot, HV, V, device=dev, dtype=hb.dtype)
    lowp = hb.dtype != f32
    dh0 = gdn._out((N, HV, K, V), q, f32) if has_h0 else q.new_empty(0, dtype=f32)
    _state_grad_pass(do, dht, BLb, Wb, Qg, Kd, Pb, dh0, dhb, dvn, lay, H, HV, has_h0)
    saved[1] = saved[4] = saved[5] = saved[6] = Wb = Qg = Kd = Pb = None
    dq, dk, dg = (gdn._out((Ttot, HV, K), q, f32) for _ in range(3))
    # with the gate, dg is the kernels' scratch and the state backward's last pass writes the raw gate's gradient
    ga, draw, dAp, ddtp = _no_gate(g), dg, dg, dg
    if gate is not None:
        ga = gate.args()
        draw = gdn._out((B, T, HV, K), q, gate.raw.dtype)
        dAp, ddtp = gdn._out((max(nc, 1), HV), q, f32), gdn._out((max(nc, 1), HV, K), q, f32)
    # dv is written once per chunk (one launch of the decay forms takes each chunk), so in the input dtype: no
    # fp32 copy and no cast kernel after (GDN's backward does the same)
    dv = gdn._out((B, T, HV, V), q, v.dtype)
    db = gdn._out((B, T, HV), q, f32)
    chunks = (lay.cu_t, lay.chunk_seq, lay.chunk_start)
    if nc > 0:
        bw = _bwd_warps(dev)
        BK = gdn.key_block(TUNE.bk, "bk", K)
        redo = _redo(nc, HV, dev)
        for mode in DIAG_MODES:
            launcher(kda_bwd._kda_bwd_out_blk)[(nc, HV)](
                q, k, g, hb, vn, do, dq, dk, dg, redo, *chunks, scale, H=H, HV=HV, K=K, V=V, BT=BT, BK=BK,
                BV=min(V, 64), L2=use_qk_l2norm, PREC=prec, LOWP=lowp, DIAG=mode, num_warps=bw, num_stages=1,
            )
        # the output backward's launches have written redo's marks (same g, same key blocks): the state backward
        # reads them instead of recomputing them
        for mode in DIAG_MODES:
            launcher(kda_bwd._kda_bwd_state_blk)[(nc, HV)](
                k, v, g, beta, Tb, BLb, hb, dhb, vn, dvn, dk, dv, dg, db, redo, *chunks, **ga, draw=draw, dAp=dAp,
                ddtp=ddtp, H=H, HV=HV, K=K, V=V, BT=BT, BK=BK, BV=min(V, 64), L2=use_qk_l2norm, PREC=prec,
                LOWP=lowp, DIAG=mode, MARKED=True, GATE=gate is not None, num_warps=bw, num_stages=1,
            )
    del dhb, dvn  # read: freed before the GVA sums and casts, as in the GDN backward
    dA = ddt = q.new_empty(0, dtype=f32)
    if gate is not None:
        del dg
        dg = draw
        if nc == 0:
            dAp.zero_(), ddtp.zero_()
        dA = dAp.sum(0).to(gate.A_log.dtype)
        ddt = ddtp[..., : gate.dt_bias.shape[1]].sum(0).to(gate.dt_bias.dtype)
    return [gdn.gva_sum(dq, B, T, H, q.dtype), gdn.gva_sum(dk, B, T, H, k.dtype), dv,
            dg.view(B, T, HV, K), db.to(beta.dtype), dh0, dA, ddt]


def _state_grad_pass(do, dht, BLb, Wb, Qg, Kd, Pb, dh0, dhb, dvn, lay, H: int, HV: int, has_h0: bool) -> None:
    """`state_pass._recur_bwd` (CHANNEL) over every sequence: dS' of every chunk into dhb, dVn into dvn and, with
    has_h0, the initial-state gradient into dh0; from dht (None: no final-state cotangent)."""
    K, V, BT = dhb.shape[2], dhb.shape[3], Pb.shape[-1]
    BV = gdn._recur_bv(K, V, lay.N * HV, do.device, per_sm=1)
    launcher(state_pass._recur_bwd)[(V // BV, lay.N * HV)](
        BLb, Wb, Qg, Kd, Pb, do, dht if dht is not None else dvn, dh0, dhb, dvn, lay.cu_t, lay.chunk_off,
        lay.nch, H=H, HV=HV, K=K, V=V, BT=BT, BV=BV, PREC=_numerics(do.dtype)[1],
        HAS_DHT=dht is not None, STORE_DH0=has_h0, LOWP=dhb.dtype != torch.float32, CHANNEL=True,
        num_warps=gdn._state_warps(TUNE.state_warps, do.device, lay.nch), num_stages=gdn.fwd_stages(),
    )


def dh0_without_dht(do: torch.Tensor, q: torch.Tensor, saved: list[torch.Tensor], cu_seqlens: torch.Tensor | None
                    ) -> torch.Tensor:
    """The chunk backward's initial-state gradient [N, HV, K, V] fp32 for the output cotangent do [B, T, HV, V]
    and no final-state cotangent, from the forward's saved [T, W, h, Vn, Qg, Kd, P, bL] (h for its shape): the
    state-gradient chain alone (context parallelism's D, `hybridlm.ops.context_parallel`)."""
    Tb, Wb, hb, vn, Qg, Kd, Pb, BLb = saved[:8]
    B, T, H, K = q.shape
    HV, V = do.shape[2], do.shape[3]
    lay = gdn.layout(cu_seqlens, B, T, Tb.shape[-1], q.device)
    dhb = torch.empty_like(hb)
    dvn = torch.empty(lay.Ttot, HV, V, device=q.device, dtype=hb.dtype)
    dh0 = gdn._out((lay.N, HV, K, V), q, torch.float32)
    _state_grad_pass(do.contiguous(), None, BLb, Wb, Qg, Kd, Pb, dh0, dhb, dvn, lay, H, HV, True)
    return dh0


def _offered_dh0(node, K: int, V: int, do: torch.Tensor) -> torch.Tensor:
    """`dh0_without_dht` of the _ChunkKDA call whose backward node (its ctx) is node, for do [B, T, HV, V] of the
    unpadded output; the initial-state gradient [N, HV, K, V] of the unpadded state."""
    q, k, v, g, beta, cu, h0, _, _, *saved = node.saved_tensors
    do = torch.nn.functional.pad(do, (0, v.shape[-1] - V))
    return dh0_without_dht(do, q, saved, cu)[..., :K, :V]


@kda_chunk_bwd.register_fake
def _(do, dht, q, k, v, g, beta, saved, cu_seqlens, scale, use_qk_l2norm, has_h0, A_log=None, dt_bias=None,
      lower_bound=None):
    return _bwd_fake(q, k, v, g, beta, cu_seqlens, has_h0, A_log, dt_bias)


@kda_chunk_bwd_rc.register_fake
def _(do, dht, q, k, v, g, beta, cu_seqlens, scale, use_qk_l2norm, has_h0, h0, A_log=None, dt_bias=None,
      lower_bound=None):
    return _bwd_fake(q, k, v, g, beta, cu_seqlens, has_h0, A_log, dt_bias)


def _bwd_fake(q, k, v, g, beta, cu_seqlens, has_h0, A_log, dt_bias):
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    dh0 = q.new_empty(N, HV, K, V, dtype=torch.float32) if has_h0 else q.new_empty(0, dtype=torch.float32)
    gated = A_log is not None
    none = q.new_empty(0, dtype=torch.float32)
    return [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), q.new_empty(B, T, HV, K,
            dtype=g.dtype if gated else torch.float32), torch.empty_like(beta), dh0,
            torch.empty_like(A_log) if gated else none, torch.empty_like(dt_bias) if gated else none]


class _ChunkKDA(torch.autograd.Function):
    """recompute: keep only the inputs (and the initial state) for the backward and rerun the forward kernels
    there, as `gdn._ChunkGDN` does."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm, output_final_state,
                recompute, A_log, dt_bias, lower_bound):
        grad = any(ctx.needs_input_grad[:6]) or any(ctx.needs_input_grad[11:13])
        o, ht, *saved = call("kda_chunk_fwd", q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm,
                             output_final_state, grad and not recompute, A_log, dt_bias, lower_bound)
        ctx.recompute = grad and recompute
        ctx.save_for_backward(q, k, v, g, beta, cu_seqlens, initial_state, A_log, dt_bias,
                              *([] if ctx.recompute else saved))
        ctx.scale, ctx.l2, ctx.has_h0, ctx.g_dtype = scale, use_qk_l2norm, initial_state is not None, g.dtype
        ctx.lower_bound = lower_bound
        if not output_final_state:
            ctx.mark_non_differentiable(ht)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, cu, h0, A_log, dt_bias, *saved = ctx.saved_tensors
        if dht is not None and dht.numel() == 0:
            dht = None
        gate = (A_log, dt_bias, ctx.lower_bound)
        if ctx.recompute:
            dq, dk, dv, dg, db, dh0, dA, ddt = call("kda_chunk_bwd_rc", do, dht, q, k, v, g, beta, cu, ctx.scale,
                                                    ctx.l2, ctx.has_h0, h0, *gate)
        else:
            dq, dk, dv, dg, db, dh0, dA, ddt = call("kda_chunk_bwd", do, dht, q, k, v, g, beta, saved, cu,
                                                    ctx.scale, ctx.l2, ctx.has_h0, *gate)
        if A_log is None:
            dA = ddt = None
        return (dq, dk, dv, dg.to(ctx.g_dtype), db, (dh0 if ctx.has_h0 else None), None, None, None, None, None,
                dA, ddt, None)


def unsupported_reason(q: torch.Tensor, v: torch.Tensor) -> str | None:
    """None when the KDA kernels take these inputs, else why not."""
    return gdn.unsupported_reason(q, v)


def chunk_kda(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, g: torch.Tensor, beta: torch.Tensor,
    scale: float | None = None, initial_state: torch.Tensor | None = None, output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None, use_qk_l2norm: bool = False, recompute: bool = False,
    A_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None, lower_bound: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA forward on the Triton kernels. Shapes as `hybridlm.ops.kda` (g: [B, T, HV, K]); recompute: keep
    only the inputs for the backward and rerun the forward kernels there. With A_log [HV] or lower_bound, g is
    Kimi's raw gate (any float dtype; dt_bias [HV * K] or None) and the kernels take the gate inside
    (`hybridlm.ops.kda_gate`; arguments checked by the caller): the prep's first launch writes the log-decay, the
    state backward's last pass the gradients of raw, A_log and dt_bias."""
    K, V = q.shape[-1], v.shape[-1]
    gdn._check_dims(K, V)
    gdn._check_device(q)
    if q.dtype == torch.float64:
        raise TypeError("q: the Triton kernels take float16/bfloat16/float32 inputs, got float64")
    gated = A_log is not None or lower_bound is not None
    if not gated and dt_bias is not None:
        raise ValueError("A_log: expected a tensor [HV] for the gate (dt_bias was given without A_log or "
                         "lower_bound), got None")
    if not gated and g.dtype != torch.float32:
        raise TypeError(f"g: the KDA kernels take float32 log-decays, got {g.dtype}")
    if gated:
        HV = g.shape[-2]
        A_log = A_log.reshape(HV) if A_log is not None else g.new_zeros(HV, dtype=torch.float32)
        dt_bias = dt_bias.reshape(HV, K) if dt_bias is not None else g.new_zeros(HV, K, dtype=torch.float32)
        lower_bound = None if lower_bound is None else float(lower_bound)
    if initial_state is not None and initial_state.dtype != torch.float32:
        raise TypeError(f"initial_state: expected dtype torch.float32 for {q.dtype} inputs, got {initial_state.dtype}")
    scale = K**-0.5 if scale is None else float(scale)
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(torch.int32)
    # contiguous copies of views made here, before autograd saves them, so the backward does not copy them again
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    q, k, v, g, initial_state = gdn.pad_heads(q, k, v, g, initial_state, channel=True)
    o, ht = _ChunkKDA.apply(q, k, v, g, beta, initial_state, cu_seqlens, scale, bool(use_qk_l2norm),
                            bool(output_final_state), bool(recompute), A_log, dt_bias, lower_bound)
    if initial_state is not None and not recompute and wants_dh0() and o.grad_fn is not None:  # saved buffers give D
        offer_dh0(functools.partial(_offered_dh0, o.grad_fn, K, V))
    o, ht = gdn.unpad_outputs(o, ht, K, V, output_final_state)
    return o, (ht if output_final_state else None)


@custom_op("kda_decode", mutates_args=("state_pool", "intermediate_states"))
def kda_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state_pool: torch.Tensor, state_indices: torch.Tensor, scale: float, use_qk_l2norm: bool,
    intermediate_states: torch.Tensor | None = None, num_accepted: torch.Tensor | None = None,
) -> torch.Tensor:
    return gdn.decode_launch(q, k, v, g, beta, state_pool, state_indices, scale, use_qk_l2norm, channel=True,
                             inter=intermediate_states, acc=num_accepted)


@kda_decode.register_fake
def _(q, k, v, g, beta, state_pool, state_indices, scale, use_qk_l2norm, intermediate_states=None,
      num_accepted=None):
    return gdn.decode_fake(q, v)


__all__ = ["chunk_kda", "kda_chunk_fwd", "kda_chunk_bwd", "kda_decode",
           "unsupported_reason"]
