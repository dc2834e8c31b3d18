"""Host side of the Triton gated delta rule: torch.library custom ops, autograd, and the public entry point.

- `chunk_gated_delta_rule(q, k, v, g=, beta=, ...)`: same contract as `hybridlm.ops.gated_delta_rule`
  (registered there as impl="triton"); differentiable in q, k, v, g, beta and initial_state.
- `gdn_decode` / `decode_launch`: the multi-token decode kernel's custom op and launch (GDN's and KDA's), behind
  the public decode entries of `decode_entry.py`.

The forward chains the stages of docs/math.md's chunked algorithm, one file each (b = cumsum of g in a chunk,
gamma = e^b, bL = b at the chunk's last token, ^: l2-normalised):
    T = (I + strict_lower(diag(beta) K^ K^^T e^{b_i - b_j}))^{-1}   `ut_solve._kkt_solve`
    W = T diag(beta gamma) K^,  U = T diag(beta) V                  `wy._wu_fwd`
    Vn = U - W S,  S' = e^{bL} S + (K^ e^{bL - b})^T Vn             `state_pass._recur_fwd` (serial over chunks)
    O = diag(gamma) Q^ S + (Q^ K^^T e^{b_i - b_j}, j <= i) Vn         `chunk_out._out_fwd_raw` (every chunk at once)
(W is kept as W / m, m a power of two near e^b of the chunk's first token: `chunk_jit._chunk_scale`.)
The backward: `state_pass._recur_bwd` (dS', dVn, serial in reverse; on sm_90 with 16-bit inputs the Gluon chain
`hybridlm.ops.gluon.gdn_bwd` instead, `_gluon_chain`), then `chunk_bwd` (every chunk at once).
`dh0_without_dht` runs that serial pass alone with no final-state cotangent: the initial-state gradient that
context parallelism needs before its one backward (D, `hybridlm.ops.context_parallel`); a differentiable call
with an initial state offers it from its saved buffers (`offer_dh0`, a no-op outside that op's tracked forward).

Custom ops (so torch.compile traces through them, with fake kernels for shapes):
`hybridlm::gdn_chunk_fwd`, `hybridlm::gdn_chunk_bwd`, `hybridlm::gdn_chunk_bwd_rc`, `hybridlm::gdn_decode`.
Intermediates kept for the backward: T [NC, HV, BT, BT] (16-bit for 16-bit inputs, else fp32), and in the storage
dtype (the input dtype; fp32 for fp32 inputs) W [Ttot, HV, K], the chunk-initial states [NC, HV, K, V], the
corrected values Vn [Ttot, HV, V] and the intra-chunk attention P [NC, HV, BT, BT]; no scaled copies of q and k
(the backward reads the raw ones). NC is bounded by Ttot // BT + N so the fake kernels need no data.

Head dims: the chunk kernels are built for K, V in NATIVE_DIMS (64, 128, 256). Any other K, V up to 256 (OLMo-Hybrid
7B's 96 / 192, small research models' 16-48) runs them on inputs zero-padded to the next native dim (`pad_heads`,
exact, KDA's too), so these dims take exactly the kernels and launch settings checked on the GPU at 64/128/256,
at the padded dims' cost; the decode step masks its loads and stores instead (no copy of the state pool).
"""

import functools
import math
import os
from dataclasses import dataclass

import torch
import triton
from triton.runtime.errors import OutOfResources

from ..context_parallel import offer_dh0, wants_dh0
from ..launch import launcher
from . import chunk_bwd, chunk_out, decode, state_pass, ut_solve, wy
from .chunk_layout import Layout, layout, max_chunks
from .custom import call, custom_op
from .tune import LaunchTable, cdiv, next_pow2

# head dims the kernels' blocks are built for; any K, V in 1..MAX_HEAD_DIM run zero-padded to the next of these
# (`padded_dim`, `pad_heads`)
NATIVE_DIMS = (64, 128, 256)
MAX_HEAD_DIM = NATIVE_DIMS[-1]
BT_CHOICES = (64, 32, 16)


@dataclass
class GDNLaunch(LaunchTable):
    """Launch settings of the GDN kernels (scripts/gpu_tune.py sweeps them; sm_90 = scripts/compile_sm90.py)."""

    kkt_warps: int = 1  # `_kkt_solve`: at key block 32 one warp holds it in 240 registers, unspilled; 4 were slower
    kkt_bk: int = 32  # `_kkt_solve`'s key block
    wu_warps: int = 8  # `_wu_fwd`
    wu_bk: int = 64  # `_wu_fwd`'s key block (at most 32 for fp32 inputs: their IEEE dots spill at 64)
    wu_stages: int = 1  # `_wu_fwd`'s num_stages (2 pipelines its K-block loads)
    fwd_warps: int = 4  # `_recur_fwd`; 8 where its chunk loop runs once (`_state_warps`)
    fwd_bv: int | None = None  # `_recur_fwd`'s V block (None: `_recur_bv`'s rule)
    fwd_stages: int = 2  # num_stages of both state passes: 1 miscompiles on an H100, so it is refused
    out_bv: int = 128  # `_out_fwd_raw`'s V block: below 64 (at 4 warps) it gave a wrong o on an H100, refused
    out_warps: int = 4  # `_out_fwd_raw`
    rbwd_warps: int = 4  # `_recur_bwd`; 8 where its chunk loop runs once
    rbwd_bv: int | None = None  # `_recur_bwd`'s V block (None: `_recur_bv`'s rule at one program per SM)
    bwd_warps: int = 4  # both chunk-backward launches (8 with a 128-register cap was 7% slower)
    bwd_bk: int = 64  # their key block (>= the V block: smaller gave a wrong dk on an H100, refused)
    bwd_bv: int | None = None  # their V block (None: 64, 32 at V 64)
    bwd_stages: int = 1  # their num_stages (2 pipelines the V and K loops: no gain measured)
    gluon_chain: bool = True  # sm_90 16-bit: the state-gradient chain in Gluon where it takes the inputs
    gluon_chunk_bwd: bool = True  # sm_90 16-bit: the chunk backward in Gluon where it takes the inputs
    gluon_train_fwd: bool = True  # sm_90 16-bit: the training forward in Gluon where its chain fills the GPU


TUNE = GDNLaunch()
# tests set this: kernel outputs are filled with NaN before each launch, so an unwritten element shows
POISON = False
# (K, V, dtype, "fwd" | "bwd") -> the largest chunk size whose kernels fit this device (found on first use)
_BT_OK: dict[tuple, int] = {}


def _bt_for(K: int, V: int, dtype: torch.dtype, save: bool) -> int:
    bt = _BT_OK.get((K, V, dtype, "fwd"), 64)
    if save:
        bt = min(bt, _BT_OK.get((K, V, dtype, "bwd"), bt))
    return bt


def _prec(dtype: torch.dtype) -> str:
    """Dot precision: fp32 inputs take IEEE fp32 dots (the fp32 bars are 1e-5); 16-bit inputs tf32 where an operand
    is fp32 (their 16-bit operands are exact in it)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _store_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype of the intermediates W, U, chunk states and Vn, and of the state passes' dot operands: the input dtype
    (16-bit inputs: 16-bit tensor-core operands; fp32 stays fp32)."""
    return dtype


def _t_dtype(sd: torch.dtype) -> torch.dtype:
    """dtype of the T = (I + A)^{-1} the training forward keeps for the backward: the storage dtype sd, since every
    later dot rounds T to it (the same values, half the bytes for 16-bit inputs: 66 MiB less at B8 T2048 HV32).
    T is solved in fp32 either way."""
    return sd


def _out(shape, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if POISON:
        return torch.full(shape, float("nan"), device=like.device, dtype=dtype)
    return torch.empty(shape, device=like.device, dtype=dtype)


def fwd_stages() -> int:
    """TUNE.fwd_stages, the pipeline stages of the state passes: one stage gave wrong outputs and an illegal memory
    access on an H100 (at K=256, and at K=V=128 B4 T4096 H16; the CPU interpreter computes it correctly), so it is
    refused."""
    st = TUNE.fwd_stages
    if st < 2:
        raise ValueError(f"gdn.TUNE.fwd_stages: expected >= 2 (one stage miscompiles on an H100), got {st}")
    return st


def _state_warps(warps: int, dev: torch.device, nch: int) -> int:
    """num_warps of a state pass (GDN's TUNE.fwd_warps / rbwd_warps, KDA's state_warps) whose chunk loop runs nch
    times: on CUDA a setting below 8 warps only when nch >= fwd_stages, else 8. Triton 3.6 compiles these kernels at
    4 warps to out-of-bounds shared-memory reads in the state-update dot when the software-pipelined loop runs fewer
    times than it has stages (H100, B2 H2 HV4 K128 V128 bf16: T = 1, 63, 64 stop with an illegal memory access,
    compute-sanitizer shows invalid `__shared__` reads at the state update; T = 65 and more match float64)."""
    if warps < 8 and dev.type == "cuda" and nch < fwd_stages():
        return 8
    return warps


def _recur_bv(K: int, V: int, programs: int, dev: torch.device, bv: int | None = None, per_sm: int = 2) -> int:
    """V block of a state pass: bv when set, else 32 (16 above K=128), halved to 16 while the halved grid
    (programs = sequences x value heads, times V/BV) still runs in one wave of per_sm programs per SM: few sequences
    x heads leave SMs idle otherwise, and the passes are latency-bound (one chunk after another).
    per_sm: what fits one SM (sm_90, K=V=128 bf16): `_recur_fwd` at BV 16 two programs, `_recur_bwd` one (with 2,
    B1 T32768 H32 took BV 16 in the backward, two waves: forward+backward 10.5 ms against 9.6 at BV 32)."""
    if bv:
        return min(bv, V)
    # sm_90: 32 keeps the [K, BV] fp32 state in registers; at K=256 the two pipeline stages need 236-240 KB of
    # shared memory at 32 (over the 227 KB an H100 program may have), 222-224 KB at 16
    bv = min(32 if K <= 128 else 16, V)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 1
    while bv > 16 and programs * (V // (bv // 2)) <= sms * per_sm:
        bv //= 2
    return bv


def key_block(bk: int, name: str, K: int) -> int:
    """The key-channel block `bk` (the table field `name`) of a K-blocked launch (GDN's and KDA's), at most K."""
    b = min(bk, K)
    if b not in (16, 32, 64, 128, 256) or K % b:
        raise ValueError(f"TUNE.{name}: expected a power of two >= 16 dividing K={K}, got {bk}")
    return b


def kblock_bwd_blocks(K: int, V: int) -> tuple[int, int]:
    """(key block, V block) of the chunk backward: TUNE.bwd_bk (at most K) and TUNE.bwd_bv or 64 (32 at V = 64:
    sm_90, one V block unrolls the loops and spills). Key blocks smaller than the V block are refused: on an H100
    (Triton 3.6) key blocks of 32 with V blocks of 64 gave a wrong dk (rel RMS 0.04 to inf) at several shapes, while
    32/32 and 64/64 were exact; the CPU interpreter gets every combination right, so the cause is not known."""
    bk = key_block(TUNE.bwd_bk, "bwd_bk", K)
    bv = min(TUNE.bwd_bv or min(64, V // 2), V)
    if bk < bv:
        raise ValueError(f"TUNE.bwd_bk={bk} with V block {bv} (TUNE.bwd_bv={TUNE.bwd_bv}, V={V}): the chunk "
                         f"backward needs a key block >= the V block (smaller ones gave a wrong dk on an H100); set "
                         f"TUNE.bwd_bv <= {bk} or TUNE.bwd_bk >= {bv}")
    return bk, bv


def _fwd_impl(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None, scale: float, use_qk_l2norm: bool,
    output_final_state: bool, save: bool, BT: int,
) -> tuple[torch.Tensor, ...]:
    """Returns (o, final_state or empty, T, W, h, Vn, P, G); the last six are empty unless save. G [chunks, HV, 4, BT]
    fp32: the Gluon state-gradient chain's gate rows (`gluon.gdn_bwd.gate_rows`), written wherever that chain could
    take the backward (`_chain_rows`), else left unwritten."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dev, f32 = q.device, torch.float32
    lay = layout(cu_seqlens, B, T, BT, dev)
    N, Ttot, nc = lay.N, lay.Ttot, lay.nc
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    sd = _store_dtype(q.dtype)
    lowp = sd != f32  # 16-bit dot operands for 16-bit inputs
    prec = _prec(q.dtype)
    NCb = max_chunks(Ttot, N, BT) if save else max(nc, 1)
    e = lambda *s, dt=sd: torch.empty(*s, device=dev, dtype=dt)  # noqa: E731
    Tb = e(NCb, HV, BT, BT, dt=_t_dtype(sd) if save else f32)
    Wb, hb, vn = e(Ttot, HV, K), e(NCb, HV, K, V), e(Ttot, HV, V)
    Pb = e(NCb if save else 0, HV, BT, BT)
    Gb = e(NCb if save else 0, HV, 4, BT, dt=f32)
    if save and nc > 0 and _gluon_train_fwd(q, v, N, BT):
        from ..gluon import gdn_fwd

        o, ht = gdn_fwd.training_forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                                         use_qk_l2norm, (Tb, Wb, hb, vn, Pb, Gb))
        return o, ht if ht is not None else q.new_empty(0, dtype=f32), Tb, Wb, hb, vn, Pb, Gb
    if save and nc > 0 and _chain_rows(q, v, BT):
        from ..gluon import gdn_bwd

        gdn_bwd.gate_rows(q, k, g, Gb, lay, scale, use_qk_l2norm)
    Ub = e(Ttot, HV, V)
    sk, rk = e(Ttot, HV, dt=f32), e(Ttot, HV, dt=f32)  # the state write's key scales, the keys' inverse norms
    o = _out((B, T, HV, V), q, q.dtype)
    ht = _out((N, HV, K, V), q, f32) if output_final_state else q.new_empty(0, dtype=f32)
    if nc > 0:
        _kkt_launch(k, g, beta, Tb, lay, H, HV, K, BT, use_qk_l2norm, prec)
        bk = key_block(TUNE.wu_bk, "wu_bk", K)
        launcher(wy._wu_fwd)[(nc, HV)](
            k, v, g, beta, Tb, Wb, Ub, sk, rk, lay.cu_t, lay.chunk_seq, lay.chunk_start,
            H=H, HV=HV, K=K, V=V, BT=BT, BK=min(bk, 32) if q.dtype == f32 else bk, BV=min(V, 64), L2=use_qk_l2norm,
            PREC=prec, LOWP=lowp, num_warps=TUNE.wu_warps, num_stages=TUNE.wu_stages,
        )
    h0 = initial_state.contiguous() if initial_state is not None else ht
    BV = _recur_bv(K, V, N * HV, dev, TUNE.fwd_bv)
    launcher(state_pass._recur_fwd)[(V // BV, N * HV)](
        g, Wb, Ub, k, sk, h0, ht, hb, vn, lay.cu_t, lay.chunk_off, lay.nch,
        H=H, HV=HV, K=K, V=V, BT=BT, BV=BV, PREC=prec, HAS_H0=initial_state is not None,
        STORE_HT=output_final_state, LOWP=lowp, num_warps=_state_warps(TUNE.fwd_warps, dev, lay.nch),
        num_stages=fwd_stages(),
    )
    if nc > 0:
        _output_pass(q, k, g, rk, hb, vn, o, Pb, lay, H, HV, K, V, BT, scale, use_qk_l2norm, prec, lowp, save)
    if not save:  # distinct empties: custom-op outputs may not alias
        return o, ht, e(0, dt=f32), e(0), e(0), e(0), e(0), e(0, dt=f32)
    return o, ht, Tb, Wb, hb, vn, Pb, Gb


def _kkt_launch(k, g, beta, Tb, lay: Layout, H: int, HV: int, K: int, BT: int, l2: bool, prec: str) -> None:
    """T = (I + A)^{-1} of every chunk and value head into Tb, from k, g and beta (`_kkt_solve`)."""
    bk = key_block(TUNE.kkt_bk, "kkt_bk", K)
    launcher(ut_solve._kkt_solve)[(lay.nc, HV)](
        k, g, beta, Tb, lay.cu_t, lay.chunk_seq, lay.chunk_start,
        H=H, HV=HV, K=K, BT=BT, BK=min(bk, 32) if k.dtype == torch.float32 else bk, L2=l2, PREC=prec,
        num_warps=TUNE.kkt_warps, num_stages=1,
    )


def _output_pass(q, k, g, rk, hb, vn, o, Pb, lay: Layout, H: int, HV: int, K: int, V: int, BT: int,
                 scale: float, l2: bool, prec: str, lowp: bool, save: bool) -> None:
    """O of every chunk at once from the raw q and k (`_out_fwd_raw`); with save also P into Pb."""
    BV = min(TUNE.out_bv, V)
    if q.is_cuda and BV < min(64, V):
        raise ValueError(f"gdn.TUNE.out_bv: expected >= 64 on CUDA (V block 32 at 4 warps gave a wrong output on an "
                         f"H100), got {TUNE.out_bv}")
    launcher(chunk_out._out_fwd_raw)[(V // BV, lay.nc, HV)](
        q, k, g, rk, hb, vn, o, Pb, lay.cu_t, lay.chunk_seq, lay.chunk_start, scale,
        H=H, HV=HV, K=K, V=V, BT=BT, BV=BV, PREC=prec, LOWP=lowp, L2=l2, STORE_P=save,
        num_warps=TUNE.out_warps, num_stages=1,
    )


@custom_op("gdn_chunk_fwd")
def gdn_chunk_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None, scale: float, use_qk_l2norm: bool,
    output_final_state: bool, save: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor]:
    """Returns (o, final_state or empty, T, W, h, Vn, P, G); the last six are empty unless save (`_fwd_impl`)."""
    K, V = q.shape[-1], v.shape[-1]
    first = _bt_for(K, V, q.dtype, save)
    err = None
    for BT in (b for b in BT_CHOICES if b <= first):
        try:
            out = _fwd_impl(q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm, output_final_state,
                            save, BT)
        except OutOfResources as e:  # the kernels did not fit this block size on this device: try a smaller one
            err = e
            continue
        _BT_OK[(K, V, q.dtype, "fwd")] = BT
        return out
    raise err


@gdn_chunk_fwd.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm, output_final_state, save):
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    BT = _bt_for(K, V, q.dtype, save)
    NC = max_chunks(B * T, N, BT)
    f32 = torch.float32
    o = q.new_empty(B, T, HV, V)
    ht = q.new_empty(N, HV, K, V, dtype=f32) if output_final_state else q.new_empty(0, dtype=f32)
    sd = _store_dtype(q.dtype)
    if save:
        return (o, ht, q.new_empty(NC, HV, BT, BT, dtype=_t_dtype(sd)), q.new_empty(B * T, HV, K, dtype=sd),
                q.new_empty(NC, HV, K, V, dtype=sd), q.new_empty(B * T, HV, V, dtype=sd),
                q.new_empty(NC, HV, BT, BT, dtype=sd), q.new_empty(NC, HV, 4, BT, dtype=f32))
    return (o, ht, q.new_empty(0, dtype=f32), *(q.new_empty(0, dtype=sd) for _ in range(4)),
            q.new_empty(0, dtype=f32))


def _bwd_impl(
    do: torch.Tensor, dht: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    g: torch.Tensor, beta: torch.Tensor, saved: list[torch.Tensor | None],
    cu_seqlens: torch.Tensor | None, scale: float, use_qk_l2norm: bool, has_h0: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (dq, dk, dv, dg, dbeta, dinitial_state or empty). saved: the forward's [T, W, h, Vn, P, G]; W, P and
    G serve only the state recurrence's backward, so their entries are cleared after its launch: when the list
    holds the only references (recompute), their memory is free before dq, dk, dv are allocated."""
    Tb, Wb, hb, vn, Pb, Gb = saved
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    G = HV // H
    BT = Tb.shape[-1]
    dev = q.device
    lay = layout(cu_seqlens, B, T, BT, dev)
    N, Ttot, nc = lay.N, lay.Ttot, lay.nc
    q, k, v, g, beta, do = (x.contiguous() for x in (q, k, v, g, beta, do))
    dht = dht.contiguous() if dht is not None else None  # e.g. the expanded ones of ht.sum()'s backward
    f32 = torch.float32
    prec = _prec(q.dtype)
    dhb = torch.empty_like(hb)
    dvn = torch.empty(Ttot, HV, V, device=dev, dtype=hb.dtype)
    lowp = hb.dtype != f32  # 16-bit dot operands for 16-bit intermediates
    dh0 = _out((N, HV, K, V), q, f32) if has_h0 else q.new_empty(0, dtype=f32)
    _state_grad_pass(do, dht, q, k, g, Wb, Pb, Gb, dh0, dhb, dvn, lay, HV, V, scale, use_qk_l2norm, has_h0)
    saved[1] = saved[4] = saved[5] = Wb = Pb = Gb = None
    # the kernels write dq, dv in the input dtype (with GVA dq per value head, as fla writes it, summed over each
    # key head's value heads in fp32 below: 128 MiB less than fp32 partials at B8 T2048 HV32 bf16). dk is written
    # once per value head but its partial sum between the two launches is parked in fp32: with GVA dk itself
    # holds it, so it is fp32; without, dk is in the input dtype beside an fp32 dkp.
    gd = f32 if G > 1 else q.dtype
    # the chunk backward writes dq in its second launch only: it allocates dq there, after freeing dS and dVn
    dq = None if nc > 0 else _out((Ttot, HV, K), q, q.dtype)
    dk = _out((Ttot, HV, K), q, gd)
    dkp = dk if gd == f32 else None  # allocated where a launch parks dk's part in it (`_chunk_bwd`)
    dv = _out((B, T, HV, V), q, v.dtype)
    dg = _out((B, T, HV), q, f32)
    db = _out((B, T, HV), q, f32)
    if nc > 0:
        state_grads = [dhb, dvn]  # the only references from here on: the function frees them after their last read
        dhb = dvn = None
        dq = _chunk_bwd(q, k, v, g, beta, Tb, hb, state_grads, vn, do, dk, dkp, dv, dg, db, lay, scale,
                        H, HV, K, V, BT, use_qk_l2norm, prec, lowp)
    # the state gradients are read: free them before the GVA sums, where this layer's backward peaks otherwise (H100,
    # GDN layer B8 T2048 HV32: 264 + 128 MiB still allocated there)
    dhb = dvn = None
    return (gva_sum(dq, B, T, H, q.dtype), gva_sum(dk, B, T, H, k.dtype), dv.to(v.dtype), dg.to(g.dtype),
            db.to(beta.dtype), dh0)


def _state_grad_pass(do, dht, q, k, g, Wb, Pb, Gb, dh0, dhb, dvn, lay: Layout, HV: int, V: int, scale: float,
                     l2: bool, has_h0: bool) -> None:
    """`state_pass._recur_bwd` over every sequence: dS' of every chunk into dhb, dVn into dvn and, with has_h0, the
    initial-state gradient into dh0; from dht (None: no final-state cotangent). Gb: the forward's gate rows for the
    Gluon chain (`_fwd_impl` wrote them wherever that chain can run: `_chain_rows` takes every input it takes)."""
    H, K, BT = q.shape[2], q.shape[3], Pb.shape[-1]
    if _gluon_chain(q, k, do, Wb, Pb):
        from ..gluon import gdn_bwd

        gdn_bwd.state_grad_chain(do, dht, q, k, Gb, Wb, Pb, dh0, dhb, dvn, lay, has_h0)
        return
    BV = _recur_bv(K, V, lay.N * HV, q.device, TUNE.rbwd_bv, per_sm=1)
    launcher(state_pass._recur_bwd)[(V // BV, lay.N * HV)](
        g, Wb, q, k, Pb, do, dht if dht is not None else dvn, dh0, dhb, dvn, lay.cu_t, lay.chunk_off, lay.nch,
        H=H, HV=HV, K=K, V=V, BT=BT, BV=BV, PREC=_prec(q.dtype), HAS_DHT=dht is not None, STORE_DH0=has_h0,
        LOWP=dhb.dtype != torch.float32, num_warps=_state_warps(TUNE.rbwd_warps, q.device, lay.nch),
        num_stages=fwd_stages(), scale=scale, L2=l2,
    )


def _gluon_chain(q: torch.Tensor, k: torch.Tensor, do: torch.Tensor, Wb: torch.Tensor, Pb: torch.Tensor) -> bool:
    """Whether the state-gradient chain runs in Gluon (`hybridlm.ops.gluon.gdn_bwd`) instead of `_recur_bwd`:
    TUNE.gluon_chain and the Gluon chain takes the inputs (sm_90, 16-bit, K 64/128, V 64-256, chunks of 64)."""
    if not TUNE.gluon_chain or not q.is_cuda or q.dtype not in (torch.bfloat16, torch.float16):
        return False
    from ..gluon import gdn_bwd

    return gdn_bwd.unsupported_reason(q, k, do, Wb, Pb) is None


def _chain_rows(q: torch.Tensor, v: torch.Tensor, BT: int) -> bool:
    """Whether a saving forward writes the Gluon state-gradient chain's gate rows: wherever that chain could take
    the backward (`_gluon_chain` asks this and more: TUNE.gluon_chain, do's dtype, alignment), so that it always
    finds them written."""
    if BT != 64 or not q.is_cuda or q.dtype not in (torch.bfloat16, torch.float16):
        return False
    from ..gluon import gdn_fwd

    return gdn_fwd.unsupported_reason(q, v) is None


def _gluon_train_fwd(q: torch.Tensor, v: torch.Tensor, N: int, BT: int) -> bool:
    """Whether a training forward runs in Gluon (`hybridlm.ops.gluon.gdn_fwd.training_forward`) instead of the four
    Triton launches: TUNE.gluon_train_fwd and `gdn_fwd.train_reason` finds nothing (sm_90, 16-bit, K 64/128, V 64 to
    256, chunks of 64, chain programs filling the GPU)."""
    if not TUNE.gluon_train_fwd or not q.is_cuda or q.dtype not in (torch.bfloat16, torch.float16):
        return False
    from ..gluon import gdn_fwd

    return gdn_fwd.train_reason(q, v, N, BT) is None


def _gluon_chunk(q: torch.Tensor, v: torch.Tensor, BT: int) -> bool:
    """Whether the chunk backward runs in Gluon (`hybridlm.ops.gluon.gdn_bwd.chunk_grads`) instead of the two Triton
    launches: TUNE.gluon_chunk_bwd and the Gluon kernels take the inputs (sm_90, 16-bit, K 64/128, V 64/128, chunks
    of 64)."""
    if not TUNE.gluon_chunk_bwd or not q.is_cuda or q.dtype not in (torch.bfloat16, torch.float16):
        return False
    from ..gluon import gdn_bwd

    return gdn_bwd.chunk_unsupported_reason(q, v, BT) is None


def dh0_without_dht(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, Wb: torch.Tensor,
                    hb: torch.Tensor, Pb: torch.Tensor, Gb: torch.Tensor, cu_seqlens: torch.Tensor | None,
                    scale: float, use_qk_l2norm: bool) -> torch.Tensor:
    """The chunk backward's initial-state gradient [N, HV, K, V] fp32 for the output cotangent do [B, T, HV, V]
    and no final-state cotangent, from the forward's saved W, chunk states (their shape only), P and gate rows:
    the state-gradient chain alone (context parallelism's D, `hybridlm.ops.context_parallel`)."""
    B, T, H, K = q.shape
    HV, V = do.shape[2], do.shape[3]
    lay = layout(cu_seqlens, B, T, Pb.shape[-1], q.device)
    dhb = torch.empty_like(hb)
    dvn = torch.empty(lay.Ttot, HV, V, device=q.device, dtype=hb.dtype)
    dh0 = _out((lay.N, HV, K, V), q, torch.float32)
    _state_grad_pass(do.contiguous(), None, q, k, g, Wb, Pb, Gb, dh0, dhb, dvn, lay, HV, V, scale, use_qk_l2norm,
                     True)
    return dh0


def _offered_dh0(node, K: int, V: int, do: torch.Tensor) -> torch.Tensor:
    """`dh0_without_dht` of the _ChunkGDN call whose backward node (its ctx) is node, for do [B, T, HV, V] of the
    unpadded output; the initial-state gradient [N, HV, K, V] of the unpadded state."""
    q, k, v, g, beta, Tb, Wb, hb, vn, Pb, Gb, cu, h0 = node.saved_tensors
    do = torch.nn.functional.pad(do, (0, v.shape[-1] - V))
    try:
        dh0 = dh0_without_dht(do, q, k, g, Wb, hb, Pb, Gb, cu, node.scale, node.l2)
    except OutOfResources as e:  # as the backward does: smaller chunks, the forward's intermediates recomputed
        dh0 = _bwd_recomputed(do, None, q, k, v, g, beta, cu, node.scale, node.l2, True, h0,
                              [b for b in BT_CHOICES if b < Tb.shape[-1]], e)[5]
    return dh0[..., :K, :V]


def gva_sum(dx: torch.Tensor, B: int, T: int, H: int, dtype: torch.dtype) -> torch.Tensor:
    """dq or dk per value head [B*T, HV, K] -> per key head [B, T, H, K] in dtype: each key head's HV / H value heads
    summed in fp32 (GVA), cast as soon as the sum exists so that one fp32 sum is alive at a time."""
    G, K = dx.shape[1] // H, dx.shape[2]
    if G == 1:
        return dx.view(B, T, H, K).to(dtype)
    return dx.view(B, T, H, G, K).sum(3, dtype=torch.float32).to(dtype)


def _chunk_bwd(q, k, v, g, beta, Tb, hb, state_grads: list, vn, do, dk, dkp, dv, dg, db, lay: Layout,
               scale: float, H: int, HV: int, K: int, V: int, BT: int, l2: bool, prec: str,
               lowp: bool) -> torch.Tensor:
    """The chunk backward walking K in blocks of TUNE.bwd_bk channels: `_chunk_bwd_state_blk` (dv, dbeta final; dk's
    part in dkp, dg's per-row part in dg, dKK + dKK^T parked [BT, BT], with l2norm the l2 backward's row sums of its
    dk part in a [tokens, HV] fp32 buffer) then `_chunk_bwd_out_blk` (dq, dk, dg).
    state_grads: [dS, dVn], emptied here; the first launch is their last reader, so they are freed before dq (the
    second launch's) is allocated: the GDN layer's backward peak falls by dq's bytes (128 MiB at B8 T2048 HV32
    bf16). Where `_gluon_chunk` takes the inputs, one Gluon launch (`gluon.gdn_bwd.chunk_grads`) writes the same
    outputs instead; it reads dS and dVn while it writes dq, so dq is allocated beside them there. Returns dq
    [tokens, HV, K] in the input dtype."""
    dhb, dvn = state_grads
    state_grads.clear()
    gluon = _gluon_chunk(q, v, BT)
    if dkp is None:  # the Gluon kernel at V >= 128 parks dk's part in shared memory: dk stands in, never touched
        dkp = dk if gluon and V >= 128 else torch.empty(lay.Ttot, HV, K, device=q.device, dtype=torch.float32)
    if gluon:
        from ..gluon import gdn_bwd

        dq = _out((lay.Ttot, HV, K), q, q.dtype)
        gdn_bwd.chunk_grads(q, k, v, g, beta, Tb, hb, dhb, vn, dvn, do, dq, dk, dkp, dv, dg, db, lay, scale, l2)
        return dq
    dkk = torch.empty(lay.nc, HV, BT, BT, device=q.device, dtype=hb.dtype if lowp else torch.float32)
    dsk = torch.empty(lay.Ttot, HV, device=q.device, dtype=torch.float32) if l2 else dg
    BK, BV = kblock_bwd_blocks(K, V)
    stages = TUNE.bwd_stages
    if not isinstance(stages, int) or stages < 1:
        raise ValueError(f"gdn.TUNE.bwd_stages: expected an int >= 1, got {stages!r}")
    common = dict(H=H, HV=HV, K=K, V=V, BT=BT, BK=BK, BV=BV, L2=l2, PREC=prec, LOWP=lowp, num_stages=stages,
                  num_warps=TUNE.bwd_warps)
    chunks = (lay.cu_t, lay.chunk_seq, lay.chunk_start)
    launcher(chunk_bwd._chunk_bwd_state_blk)[(lay.nc, HV)](
        k, v, g, beta, Tb, hb, dhb, vn, dvn, dkp, dv, dg, db, dkk, dsk, *chunks, **common)
    dhb = dvn = None
    dq = _out((lay.Ttot, HV, K), q, q.dtype)
    launcher(chunk_bwd._chunk_bwd_out_blk)[(lay.nc, HV)](
        q, k, g, hb, vn, do, dq, dk, dkp, dg, dkk, dsk, *chunks, scale, **common)
    return dq


@custom_op("gdn_chunk_bwd")
def gdn_chunk_bwd(
    do: torch.Tensor, dht: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    g: torch.Tensor, beta: torch.Tensor, Tb: torch.Tensor, Wb: torch.Tensor, hb: torch.Tensor, vn: torch.Tensor,
    Pb: torch.Tensor, Gb: torch.Tensor, cu_seqlens: torch.Tensor | None, scale: float, use_qk_l2norm: bool,
    has_h0: bool, h0: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (dq, dk, dv, dg, dbeta, dinitial_state or empty)."""
    try:
        return _bwd_impl(do, dht, q, k, v, g, beta, [Tb, Wb, hb, vn, Pb, Gb], cu_seqlens, scale, use_qk_l2norm,
                         has_h0)
    except OutOfResources as e:
        err = e
    # the backward kernels need a smaller chunk than the forward used: recompute the forward's intermediates
    return _bwd_recomputed(do, dht, q, k, v, g, beta, cu_seqlens, scale, use_qk_l2norm, has_h0, h0,
                           [b for b in BT_CHOICES if b < Tb.shape[-1]], err)


def _bwd_recomputed(do, dht, q, k, v, g, beta, cu_seqlens, scale, use_qk_l2norm, has_h0, h0, chunk_sizes,
                    err: Exception | None):
    """The backward from the inputs alone: the forward's intermediates are made here (chunk sizes tried in order)
    and held only by the list handed to _bwd_impl, which frees what the chunk backward does not read."""
    K, V = q.shape[-1], v.shape[-1]
    for BT in chunk_sizes:
        try:
            saved = list(_fwd_impl(q, k, v, g, beta, h0, cu_seqlens, scale, use_qk_l2norm, False, True, BT)[2:])
            out = _bwd_impl(do, dht, q, k, v, g, beta, saved, cu_seqlens, scale, use_qk_l2norm, has_h0)
        except OutOfResources as e:
            err = e
            continue
        _BT_OK[(K, V, q.dtype, "bwd")] = BT
        return out
    raise err


@custom_op("gdn_chunk_bwd_rc")
def gdn_chunk_bwd_rc(
    do: torch.Tensor, dht: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    g: torch.Tensor, beta: torch.Tensor, cu_seqlens: torch.Tensor | None, scale: float, use_qk_l2norm: bool,
    has_h0: bool, h0: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """gdn_chunk_bwd for recompute=True: reruns the forward inside, so that W and P (~0.4 KB per token and value
    head at K=V=128, 16-bit) are freed before the chunk backward's own buffers exist."""
    K, V = q.shape[-1], v.shape[-1]
    first = _bt_for(K, V, q.dtype, True)
    return _bwd_recomputed(do, dht, q, k, v, g, beta, cu_seqlens, scale, use_qk_l2norm, has_h0, h0,
                           [b for b in BT_CHOICES if b <= first], None)


@gdn_chunk_bwd_rc.register_fake
def _(do, dht, q, k, v, g, beta, cu_seqlens, scale, use_qk_l2norm, has_h0, h0):
    return _bwd_fake(q, k, v, g, beta, cu_seqlens, has_h0)


@gdn_chunk_bwd.register_fake
def _(do, dht, q, k, v, g, beta, Tb, Wb, hb, vn, Pb, Gb, cu_seqlens, scale, use_qk_l2norm, has_h0, h0):
    return _bwd_fake(q, k, v, g, beta, cu_seqlens, has_h0)


def _bwd_fake(q, k, v, g, beta, cu_seqlens, has_h0):
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    dh0 = q.new_empty(N, HV, K, V, dtype=torch.float32) if has_h0 else q.new_empty(0, dtype=torch.float32)
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g),
            torch.empty_like(beta), dh0)


class _ChunkGDN(torch.autograd.Function):
    """recompute: keep only the inputs for the backward and run the forward kernels again there (its intermediates
    T, W, the chunk states, Vn, P are ~1.3 KB per token and value head at K=V=128 16-bit; fla keeps ~0.13 KB
    and recomputes the rest too). The rerun includes the output pass, whose result is dropped."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm, output_final_state,
                recompute):
        grad = any(ctx.needs_input_grad[:6])
        o, ht, *saved = call("gdn_chunk_fwd",
            q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm, output_final_state,
            grad and not recompute,
        )
        ctx.recompute = grad and recompute
        ctx.save_for_backward(q, k, v, g, beta, *([] if ctx.recompute else saved), cu_seqlens, initial_state)
        ctx.scale, ctx.l2, ctx.has_h0 = scale, use_qk_l2norm, initial_state is not None
        if not output_final_state:
            ctx.mark_non_differentiable(ht)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, *saved, cu, h0 = ctx.saved_tensors
        if dht is not None and dht.numel() == 0:
            dht = None
        if ctx.recompute:
            dq, dk, dv, dg, db, dh0 = call("gdn_chunk_bwd_rc",
                do, dht, q, k, v, g, beta, cu, ctx.scale, ctx.l2, ctx.has_h0, h0)
        else:
            dq, dk, dv, dg, db, dh0 = call("gdn_chunk_bwd",
                do, dht, q, k, v, g, beta, *saved, cu, ctx.scale, ctx.l2, ctx.has_h0, h0)
        return dq, dk, dv, dg, db, (dh0 if ctx.has_h0 else None), None, None, None, None, None


def _check_device(x: torch.Tensor) -> None:
    if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(f"impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1 for the CPU interpreter), "
                           f"got q on {x.device}")


def unsupported_reason(q: torch.Tensor, v: torch.Tensor) -> str | None:
    """None when the chunk kernels take these inputs, else why not (used by impl="auto")."""
    K, V = q.shape[-1], v.shape[-1]
    if not (1 <= K <= MAX_HEAD_DIM and 1 <= V <= MAX_HEAD_DIM):
        return f"head dims K={K}, V={V} not in 1..{MAX_HEAD_DIM}"
    if q.dtype == torch.float64:
        return "float64 inputs"
    return None


def _check_dims(K: int, V: int) -> None:
    if not 1 <= K <= MAX_HEAD_DIM:
        raise ValueError(f"q/k: the Triton kernels support head dim K in 1..{MAX_HEAD_DIM}, got K={K}")
    if not 1 <= V <= MAX_HEAD_DIM:
        raise ValueError(f"v: the Triton kernels support head dim V in 1..{MAX_HEAD_DIM}, got V={V}")


def padded_dim(d: int) -> int:
    """The head dim the chunk kernels run a dim d (1..MAX_HEAD_DIM) at: the smallest of NATIVE_DIMS >= d."""
    return next(n for n in NATIVE_DIMS if n >= d)


def pad_heads(q, k, v, g, initial_state, *, channel: bool):
    """q, k [B, T, H, K], v [B, T, HV, V], initial_state [N, HV, K, V] (or None) and, with channel (KDA's
    per-channel log-decay), g [B, T, HV, K] zero-padded to K, V = `padded_dim` (autograd slices the gradients back).
    Exact: zero key channels add nothing to K K^T, Q K^T, the l2 norms or the state products, and zero value
    columns never reach the real ones (each value column is its own recurrence); a zero log-decay on a padded key
    channel decays nothing that is ever written."""
    K, V = q.shape[-1], v.shape[-1]
    dk, dv = padded_dim(K) - K, padded_dim(V) - V
    pad = torch.nn.functional.pad
    if dk:
        q, k = pad(q, (0, dk)), pad(k, (0, dk))
        if channel:
            g = pad(g, (0, dk))
    if dv:
        v = pad(v, (0, dv))
    if initial_state is not None and (dk or dv):
        initial_state = pad(initial_state, (0, dv, 0, dk))
    return q, k, v, g, initial_state


def unpad_outputs(o: torch.Tensor, ht: torch.Tensor, K: int, V: int, output_final_state: bool):
    """o [.., Vp] and the final state [N, HV, Kp, Vp] of a padded run cut back to V and K, V (contiguous)."""
    if o.shape[-1] != V:
        o = o[..., :V].contiguous()
    if output_final_state and tuple(ht.shape[-2:]) != (K, V):
        ht = ht[..., :K, :V].contiguous()
    return o, ht


def chunk_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, g: torch.Tensor, beta: torch.Tensor,
    scale: float | None = None, initial_state: torch.Tensor | None = None, output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None, use_qk_l2norm: bool = False, recompute: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked gated delta rule on the Triton kernels. Shapes as `hybridlm.ops.gated_delta_rule`; recompute: keep
    only the inputs for the backward and rerun the forward kernels there (less memory, one more forward)."""
    K, V = q.shape[-1], v.shape[-1]
    _check_dims(K, V)
    _check_device(q)
    if q.dtype == torch.float64:
        raise TypeError("q: the Triton kernels take float16/bfloat16/float32 inputs, got float64")
    if initial_state is not None and initial_state.dtype != torch.float32:
        raise TypeError(f"initial_state: expected dtype torch.float32 for {q.dtype} inputs, got {initial_state.dtype}")
    scale = K**-0.5 if scale is None else float(scale)
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(torch.int32)
    # the kernels read contiguous rows: copy views (q, k, v split from one conv output) here, before autograd saves
    # them, so the backward reads the saved copies instead of copying again (and the conv output can be freed)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    q, k, v, g, initial_state = pad_heads(q, k, v, g, initial_state, channel=False)
    o, ht = _ChunkGDN.apply(q, k, v, g, beta, initial_state, cu_seqlens, scale, bool(use_qk_l2norm),
                            bool(output_final_state), bool(recompute))
    if initial_state is not None and not recompute and wants_dh0() and o.grad_fn is not None:  # saved buffers give D
        offer_dh0(functools.partial(_offered_dh0, o.grad_fn, K, V))
    o, ht = unpad_outputs(o, ht, K, V, output_final_state)
    return o, (ht if output_final_state else None)


@custom_op("gdn_decode", mutates_args=("state_pool", "intermediate_states"))
def gdn_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state_pool: torch.Tensor, state_indices: torch.Tensor, scale: float, use_qk_l2norm: bool,
    intermediate_states: torch.Tensor | None = None, num_accepted: torch.Tensor | None = None,
) -> torch.Tensor:
    return decode_launch(q, k, v, g, beta, state_pool, state_indices, scale, use_qk_l2norm, channel=False,
                         inter=intermediate_states, acc=num_accepted)


def decode_launch(q, k, v, g, beta, state_pool, state_indices, scale: float, l2: bool, *, channel: bool,
                  inter: torch.Tensor | None = None, acc: torch.Tensor | None = None):
    """`decode._decode_step` over (V blocks, N * HV) for q [N, T, H, K] (or [N, H, K]: T = 1, the layout is the
    same); any K, V up to MAX_HEAD_DIM (key block the next power of two, V blocks masked at V's end). Returns
    o [N, T, HV, V] (or [N, HV, V]) in q's dtype. Draft tokens (T > 1) run at one warp a program, so the token
    loop's reductions stay inside a warp (H100, N64 T4 HV32 K=V=128, only the pool written: 71% of copy bandwidth
    at one warp, 36% at four; every state to a buffer: 87% either way); one token keeps four warps (90-91% of copy
    at N256, as at one)."""
    one = q.dim() == 3
    N, T, H, K = (q.shape[0], 1, *q.shape[1:]) if one else q.shape
    HV, V = v.shape[-2], v.shape[-1]
    BK = max(16, next_pow2(K))
    BV = min(32 if BK <= 128 else 16, max(16, next_pow2(V)))
    o = _out((N, HV, V) if one else (N, T, HV, V), q, q.dtype)
    if N > 0:  # an unused pointer argument gets a tensor that is never read
        decode._decode_step[(cdiv(V, BV), N * HV)](
            q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(), state_pool,
            state_indices, o, o if inter is None else inter, state_indices if acc is None else acc, scale,
            H=H, HV=HV, T=T, TP=max(2, next_pow2(T)), K=K, V=V, BK=BK, BV=BV, L2=l2, CHANNEL=channel,
            INTER=inter is not None, ACC=acc is not None, num_warps=4 if T == 1 else 1,
        )
    return o


@gdn_decode.register_fake
def _(q, k, v, g, beta, state_pool, state_indices, scale, use_qk_l2norm, intermediate_states=None,
      num_accepted=None):
    return decode_fake(q, v)


def decode_fake(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return q.new_empty(*q.shape[:-2], v.shape[-2], v.shape[-1])


def flops_chunk_fwd(B: int, T: int, HV: int, K: int, V: int, BT: int = 64) -> float:
    """Matmul flops of one chunked forward as these kernels do it (per chunk: KK^T, T solve ~ BT^3/3,
    W, U, W S, Q K^T, Q S, P Vn, K^T Vn)."""
    nc = B * HV * math.ceil(T / BT)
    per = 2 * (BT * BT * K) + (BT**3) / 3 * 2 + 2 * BT * BT * K + 2 * BT * BT * V
    per += 2 * BT * K * V + 2 * BT * BT * K + 2 * BT * K * V + 2 * BT * BT * V + 2 * BT * K * V
    return nc * per


__all__ = ["chunk_gated_delta_rule", "unsupported_reason", "padded_dim",
           "gdn_chunk_fwd", "gdn_chunk_bwd",
           "gdn_decode", "flops_chunk_fwd", "triton"]
