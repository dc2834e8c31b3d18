"""Host side of the Triton gated delta rule: torch.library custom ops, autograd, and the public entry points.

- `chunk_gated_delta_rule(q, k, v, g=, beta=, ...)`: same contract as `hybridlm.ops.gated_delta_rule`
  (registered there as impl="triton"); differentiable in q, k, v, g, beta and initial_state.
- `fused_recurrent_gated_delta_rule_update(q, k, v, g=, beta=, state_pool=, state_indices=, ...)`: one decode
  step for N sequences, each reading and updating `state_pool[state_indices[n]]` in place; returns o.

Custom ops (so torch.compile traces through them, with fake kernels for shapes):
`hybridlm::gdn_chunk_fwd`, `hybridlm::gdn_chunk_bwd`, `hybridlm::gdn_decode` (mutates the pool).
Intermediates kept for the backward: T per chunk [NC, HV, BT, BT] (fp32), and in the storage dtype (the input
dtype; fp32 for fp32 inputs) W [Ttot, HV, K], the chunk-initial states [NC, HV, K, V], the corrected values
Vn [Ttot, HV, V], Qg and Kd [Ttot, HV, K] and the intra-chunk attention P [NC, HV, BT, BT]; NC is bounded by
Ttot // BT + N so the fake kernels need no data.
"""

import math
import os
from typing import NamedTuple

import torch
import triton
from triton.runtime.errors import OutOfResources

from ..offsets import host_offsets
from . import gdn_kernels as kern

SUPPORTED_DIMS = (64, 128, 256)


BT_CHOICES = (64, 32, 16)
# launch knobs of the per-chunk backward kernel (scripts/gpu_tune_gdn.py sweeps them)
# (H100, B4 T4096 H16 D128 bf16, BT 32: warps 8 / BV 64 gave fwd+bwd 8.4 ms, warps 8 / BV 32 61.6 ms; 2026-11-22)
# fwd_bv: V block of the forward recurrence (grid V/BV x sequences x heads); fwd_warps: its warps;
# bwd_variant: "twophase" (dq first, then the state/UT part) or "onephase" (one V loop) chunk backward kernel,
#   or "statefirst": `_chunk_bwd_state` (state write, W, UT transform) then `_chunk_bwd_out` (output paths, and
#   the finish), k/q read after the V loops (sm_90 compile, K=V=128 bf16, 8 warps, with the launcher's alignment
#   hints: 255 regs / 0 B and 225 / 0 B of stack at BV 32, where twophase phase 2 spills 400 B at BV 64);
#   bwd_ut_dots (statefirst): the UT transform's two dKK dots into dk in the state launch, else dKK [BT, BT] is
#   parked in scratch (+16 KB per chunk and head at bf16) and they run in the output launch (BV 64 then);
#   bwd_out_warps: warps of the output launch (None: bwd_warps; sm_90 compile at 16: 128 regs, no spills)
#   or "kblock" (default): the state-first plan walking K in blocks of bwd_bk channels (`_chunk_bwd_state_blk`,
#   `_chunk_bwd_out_blk`, V block bwd_bv or 64 (32 at V 64)), launched with ptxas' register cap bwd_maxnreg
#   (16-bit inputs): sm_90 compile, K=V=128 bf16, 8 warps, bk 32, BV 64: 128 regs / 0 B of stack in both launches
#   under the cap (two programs per multiprocessor; uncapped ptxas takes 154 and 176), where statefirst takes 255
#   and 225 (one); at bk 64 the cap spills (128 / 48 B). HBM: +16.5 KB per chunk and head (dKK + dKK^T parked,
#   2 x 8 KB, and a [BT] row sum), +4.7% of the plan's 354 KB. Measured (H100, B4 T4096 H16, fwd+bwd, 2026-11-23):
#   statefirst 2.838 ms, kblock bk 64 capped 2.803 (default), uncapped 2.962, bk 32 BV 32 3.279, bk 32 BV 64 2.853
#   (dk wrong on the GPU: refused, see kblock_bwd_blocks): the spills were not what cost the time
# bwd_split: run the two phases as two launches (sm_90 compile: spills 2.4 KB -> 0.2 / 2.1 KB per thread)
# bwd_lowp: the same for the backward's per-V-block dots
# fwd_lowp: round the forward recurrence's dot operands to the 16-bit input dtype (else fp32/tf32 operands)
# store_fp32: keep W, U, the chunk states and Vn in fp32 even for 16-bit inputs (more bytes, less rounding)
# fwd_split_o: the sequential kernel carries only the state (two dots per chunk) and `_out_fwd` computes the
#   output of every chunk in parallel from the stored chunk states (inference then stores them too)
TUNE = {"bwd_warps": 4, "bwd_bv": None, "fwd_bv": None, "fwd_warps": 4, "fwd_stages": 2, "store_fp32": False,
        "prep_warps": None, "fwd_lowp": True, "bwd_lowp": True, "bwd_split": True,
        "fwd_split_o": True, "out_bv": 64, "out_warps": 8, "prep_split": True, "solve_interleave": True,
        "solve_warps": 1, "prep_lowp": True, "bwd_ut_dots": True, "bwd_out_warps": None,
        "prep_variant": "kblock", "prep_bk": 64, "prep_stages": 1, "bwd_variant": "kblock", "bwd_bk": 64,
        "bwd_maxnreg": None, "fwd_variant": "saved", "lean_bk": 64, "lean_warps": 8,
        "lean_split": False, "solve": "subst", "solve_prec": "tf32x3", "prep1_warps": None, "prep3_warps": None,
        "rbwd_warps": 4, "rbwd_bv": None, "bwd_raw_qk": True, "prep_kkt": True, "kkt_warps": 1, "kkt_bk": 32,
        "kkt_prec": "tf32", "kkt_diag_prec": None, "fwd_raw_out": True, "rawout_bv": 128, "rawout_warps": 4,
        "state_raw_k": True, "bwd_stages": 1}
# prep_split: `_prep_fwd` as three launches (Qg/Kd/P/A, the UT solve, W/U) instead of one; solve_interleave: the
#   four diagonal 16x16 inversions in one loop ([4, 16, 16] tiles) instead of one after another (H100, B4 T4096
#   H16 D128 bf16 forward, 2026-11-23: split + interleaved 1.18 ms, split + one-by-one 1.30, one launch 1.32);
#   prep_lowp: 16-bit operands for the prep's dots (Q K^T, K K^T, T K, T V; T is still solved in fp32).
#   solve_warps 1 and prep_lowp are the defaults since 2026-11-23 23:06 (H100, forward, `tunelean` step): B4 T4096
#   H16 1.060 ms (4 warps, fp32 operands) -> 0.999 (2 warps) / 0.988 (1 warp) / 0.974 (2 warps + prep_lowp); B1
#   T32768 H32 4.683 -> 4.435 / 4.303 / 4.322; o error vs fp32 3.41e-3 -> 3.77e-3 with prep_lowp (bar 5e-3)
# prep_variant: "kblock" (`_prep_fwd_blk`: K walked in blocks of prep_bk columns, Q K^T and K K^T on the raw
#   inputs with the l2 norm as row/column scales; prep_lowp then applies to T K and T V only) or "whole"
#   (`_prep_fwd`: whole [BT, K] fp32 tiles). sm_90 compile, K=V=128 bf16, 8 warps, launcher's alignment hints:
#   stage 1 143 -> 101 registers (85 at bk 32) and 96 -> 16 KB of shared memory, stage 3 76 -> 62, the one-launch
#   prep 255 regs + 112 B of stack -> 170 regs, no stack; no spills anywhere. prep_stages: num_stages of the prep's
#   launches (2 lets Triton pipeline the K-block loads; sm_90: stage 1 96 regs, stage 3 64, no spills)
# fwd_variant: the forward without a backward to feed (inference, no_grad): "saved" runs the same kernels as
#   training (prep keeps Qg, Kd, P for the backward), "lean" the inference kernels (`_prep_lean` in one launch: W
#   and U only, T kept in registers; the sequential kernel and `_out_fwd_raw` read q and k themselves); with
#   fwd_split_o=False the lean output is made inside the sequential kernel. lean_bk / lean_warps: its prep's key
#   block and warps; lean_split: its prep as two launches (A and the key norms; the solve, W and U). Bytes per
#   chunk and head (K=V=128 bf16): saved ~384 KB, lean split ~272 KB, lean inline ~176 KB
# prep1_warps / prep3_warps: warps of the split prep's stage 1 (Qg, Kd, P, A) and stage 3 (W, U) on their own
#   (None: prep_warps, else 8), so each launch can be swept alone as the solve's was
# solve: how the prep finds T = (I + A)^{-1}: "subst" (forward substitution in the 16 x 16 diagonal blocks, rows
#   read from memory, then block rows by dots) or "doubling" (log2(BT) steps T <- T - T L T on the whole tile,
#   `_solve_doubling`; in the lean prep A then never goes to memory) or "doubling16" (the 16 x 16 diagonal blocks by
#   doubling, batched, then block rows as "subst"); solve_prec: the doubling's dot precision
#   ("tf32x3": tensor cores at about fp32 accuracy, "ieee": fp32 FMA)
# rbwd_warps: warps of the state recurrence's backward `_recur_bwd` (None: 8; it followed fwd_warps before);
#   rbwd_bv: its V block (None: fwd_bv's rule, `_recur_bv`)
# bwd_raw_qk: the training forward keeps no Qg and Kd for the backward (2 x [tokens, HV, K] in the storage dtype:
#   256 MiB at B8 T2048 HV32 K128 bf16, of ~2 GiB the GDN layer keeps); `_recur_bwd` reads the raw q and k
#   instead and puts their row scales (l2 norm, scale, decays) on dO's rows and on K dS' (RAW). Default since
#   2026-11-24 16:49 (H100, bf16, `scripts/gpu_gdn_raw_qk.sh`): GDN layer peak 3.09 -> 2.84 GiB (fla 2.33) at
#   -0.9% tokens/s; kernel forward+backward +2.6% (B1 T32768 H32), +1.3% (B8 T2048 H32), +3.1% (B4 T4096 H16)
# Warps defaults since 2026-11-24 (H100, bf16, the `tunewarps` step, each launch alone against the defaults then):
#   the chunk backward (bwd_warps) at 4 warps without the register cap (bwd_maxnreg None; was 8 warps capped at
#   128): forward+backward 2.689 -> 2.501 and 12.165 -> 11.431; 4 warps with the cap kept: 3.398 / 15.010; only the
#   output launch at 4: 3.028 / 13.551. `_recur_fwd` at 4 warps (fwd_warps) ran the forward 0.968 -> 0.954 ms
#   (B4 T4096 H16) and 4.307 -> 3.974 (B1 T32768 H32), but the check of 2026-11-24 02:05 then found a non-finite
#   bf16 final state in one case (T63 B2 H2 HV4 K128; every other case passed). Understood 2026-11-25: at 4 warps
#   a chunk loop that runs once is miscompiled (`_state_warps`, which now gives such launches 8). Both state passes
#   at 4 warps by default since 2026-11-25 00:41 (H100, bf16, `scripts/gpu_four_warps_time.sh`, against 8):
#   forward 3.959 -> 3.619 ms and forward+backward 10.510 -> 9.925 (B1 T32768 H32), 0.847 / 0.840 -> 0.816 and
#   2.469 / 2.449 -> 2.215 (B4 T4096 H16), 1.689 / 1.678 -> 1.622 and 4.965 / 4.921 -> 4.446 (B8 T2048 H32); errors
#   unchanged; `_recur_fwd` 1439 -> 1049 us and `_recur_bwd` 1945 -> 1670 at B1 T32768 H32
# prep_kkt: A and its solve in one launch by [16, 16] blocks (`_kkt_solve`: K K^T from k in registers, diagonal
#   blocks by doubling, T's block rows by tensor-core dots at kkt_prec), so A never goes to memory and stage 1
#   makes Qg, Kd and P alone (split K-blocked prep only); kkt_warps / kkt_bk: its warps and key block; kkt_prec:
#   its solve's dot precision for 16-bit inputs ("tf32", "tf32x3" or "ieee"; T is stored in 16 bits for them;
#   fp32 inputs always take "ieee"); kkt_diag_prec: the diagonal blocks' doubling alone (None: kkt_prec).
#   Default since 2026-11-24 21:42 (H100, bf16 forward, `scripts/gpu_kkt.sh`):
#   B4 T4096 H16 0.974 -> 0.907 ms, B1 T32768 H32 4.31 -> 4.11, B8 T2048 H32 1.89 -> 1.78; kernels 748 -> 682 us
#   at B4 T4096 (`_kkt_solve` 96 us against stage 2's 132 plus 52 of A in stage 1); 1 warp at key block 32 (sm_90:
#   240 registers, no spills; 4 warps 1.000 ms, 8 warps 1.205, tf32x3 1.221, ieee 1.066)
# fwd_raw_out: the training forward without the prep's stage 1 (needs prep_kkt, fwd_split_o and bwd_raw_qk):
#   stage 3 also writes Kd and the key norms, and the output launch (`_out_fwd_raw`, rawout_bv / rawout_warps)
#   makes Q's scales and P from the raw q and k, storing P for the backward: fla's launch structure (A and T; W and
#   U; the state pass; the output), with no Qg written. Default since 2026-11-24 21:53 (H100, bf16 forward,
#   `scripts/gpu_rawout.sh`, V block 128 at 4 warps): B4 T4096 H16 0.906-0.910 -> 0.876 ms, B1 T32768 H32
#   4.09-4.14 -> 4.01, B8 T2048 H32 1.78-1.80 -> 1.73 (V block 64 at 8 warps: +5%; V block 32 at 4 warps: a wrong
#   o, 0.54 off, so V blocks below 64 are refused on CUDA)
# bwd_stages: num_stages of the K-blocked chunk backward's two launches (>= 1). 2 pipelines the loads of their V and
#   K loops (sm_90: 24 -> 40 KB and 40 -> 48 KB of shared memory); no gain (H100, bf16, 2026-11-25 03:21,
#   `scripts/gpu_bwd_stages.sh`: forward+backward 2.250 -> 2.250 ms at B4 T4096 H16, 9.989-10.045 -> 9.974 at B1
#   T32768 H32): the global loads they stall on (ncu, `scripts/gpu_ncu_bwd.sh`) are not in those loops
# state_raw_k: with fwd_raw_out, W/U's launch writes no Kd tile ([tokens, HV, K] 16-bit, ~58 us of its 200 at B4
#   T4096 H16, 2026-11-24), only its row scales s_k = rk e^{bL - b} ([tokens, HV] fp32); the state pass reads the raw
#   k (per key head) and multiplies Vn's rows by s_k before its state-update dot (`_recur_fwd` SK): one [BT, BV]
#   product more on the serial chain. Default since 2026-11-25 00:30 (H100, bf16 forward, `scripts/gpu_sk_out.sh`,
#   off/on twice): B4 T4096 H16 0.877 / 0.872 -> 0.856 / 0.850 ms, B8 T2048 H32 1.749 / 1.733 -> 1.708 / 1.697,
#   B1 T32768 H32 4.058 / 4.001 -> 4.061 / 4.006; kernels at B4 T4096 H16: W/U 190 -> 160 us, state pass 190 -> 202
#   (sm_90: 94 registers against 82); o error 3.73e-3 -> 3.71e-3
# tests set this: kernel outputs are filled with NaN before each launch, so an unwritten element shows
POISON = False
# (K, V, dtype, "fwd" | "bwd") -> the largest chunk size whose kernels fit this device (found on first use)
_BT_OK: dict[tuple, int] = {}


def _bt_for(K: int, V: int, dtype: torch.dtype, save: bool) -> int:
    bt = _BT_OK.get((K, V, dtype, "fwd"), 64)
    if save:
        bt = min(bt, _BT_OK.get((K, V, dtype, "bwd"), bt))
    return bt


def _max_chunks(Ttot: int, N: int, BT: int) -> int:
    return Ttot // BT + N


def _prec(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _t_dtype(sd: torch.dtype) -> torch.dtype:
    """dtype of the T = (I + A)^{-1} the training forward keeps for the backward: the 16-bit storage dtype sd when
    W/U's dots (TUNE prep_lowp) and the backward's (bwd_lowp) both round T to it (the same values, half the bytes:
    66 MiB less at B8 T2048 HV32), else fp32. T is solved in fp32 either way."""
    return sd if sd != torch.float32 and TUNE["prep_lowp"] and TUNE["bwd_lowp"] else torch.float32


def _store_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype of the intermediates W, U, chunk states and Vn (also the dot operands of the recurrence)."""
    return torch.float32 if dtype == torch.float32 or TUNE["store_fp32"] else dtype


def _out(shape, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if POISON:
        return torch.full(shape, float("nan"), device=like.device, dtype=dtype)
    return torch.empty(shape, device=like.device, dtype=dtype)


_TABLES: dict[tuple, tuple] = {}


def _chunk_table(cu: list[int], BT: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(chunk -> sequence, chunk -> first token, sequence -> first chunk, number of chunks), cached per layout
    so a training step does not rebuild and copy it to the device each call."""
    key = (tuple(cu), BT, str(device))
    hit = _TABLES.get(key)
    if hit is None:
        if len(_TABLES) > 64:
            _TABLES.clear()
        hit = _TABLES[key] = _build_chunk_table(cu, BT, device)
    return hit


def _build_chunk_table(cu: list[int], BT: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    seq, start, off = [], [], []
    for n in range(len(cu) - 1):
        off.append(len(seq))
        for s in range(cu[n], cu[n + 1], BT):
            seq.append(n)
            start.append(s)
    off.append(len(seq))
    nc = len(seq)
    if nc == 0:
        seq, start = [0], [0]
    t = lambda x: torch.tensor(x, dtype=torch.int32, device=device)
    return t(seq), t(start), t(off), nc


def _max_seq_chunks(cu: list[int], BT: int) -> int:
    return max((cu[n + 1] - cu[n] + BT - 1) // BT for n in range(len(cu) - 1))


def _cu_tensor(cu: list[int], cu_seqlens: torch.Tensor | None, dev) -> torch.Tensor:
    if cu_seqlens is not None:
        return cu_seqlens.to(torch.int32)
    key = ("cu", tuple(cu), str(dev))
    if key not in _TABLES:
        _TABLES[key] = torch.tensor(cu, dtype=torch.int32, device=dev)
    return _TABLES[key]


class Layout(NamedTuple):
    """Where the chunks of a (packed) batch are: the host facts every launch needs."""

    cu: list[int]  # sequence offsets [N+1] on the host
    N: int  # sequences
    Ttot: int  # tokens
    chunk_seq: torch.Tensor  # int32 [chunks]: the sequence of each chunk
    chunk_start: torch.Tensor  # int32 [chunks]: its first token
    chunk_off: torch.Tensor  # int32 [N+1]: the first chunk of each sequence
    nc: int  # chunks
    cu_t: torch.Tensor  # int32 [N+1] on the device
    nch: int  # chunks of the longest sequence (the sequential kernels' loop bound)


def layout(cu_seqlens: torch.Tensor | None, B: int, T: int, BT: int, dev) -> Layout:
    cu = _cu_list(cu_seqlens, B, T)
    cs, cst, coff, nc = _chunk_table(cu, BT, dev)
    return Layout(cu, len(cu) - 1, B * T, cs, cst, coff, nc, _cu_tensor(cu, cu_seqlens, dev), _max_seq_chunks(cu, BT))


def _cu_list(cu_seqlens: torch.Tensor | None, B: int, T: int) -> list[int]:
    if cu_seqlens is None:
        return [b * T for b in range(B + 1)]
    return host_offsets(cu_seqlens)


def fwd_stages() -> int:
    """TUNE["fwd_stages"], the pipeline stages of the sequential kernels: one stage gave wrong outputs and an
    illegal memory access on an H100 (2026-11-23: at K=256, and in the lean forward's sweep at K=V=128, o rel
    error 16 at B4 T4096 H16, a crash at B1 T32768 H32; the CPU interpreter computes it correctly), so it is
    refused."""
    st = TUNE["fwd_stages"]
    if st < 2:
        raise ValueError(f"gdn.TUNE['fwd_stages']: expected >= 2 (one stage miscompiles on an H100), got {st}")
    return st


def check_tune_keys(tune: dict, settings: dict, source: str, name: str = "gdn.TUNE") -> None:
    """Launch settings for the plan dict `tune` (gdn.TUNE, kda.TUNE): a key it does not have is an error naming
    `source` (a typo would otherwise be a setting no kernel reads)."""
    unknown = sorted(set(settings) - set(tune))
    if unknown:
        raise ValueError(f"{source}: unknown {name} keys {unknown}; expected among {sorted(tune)}")


def update_tune(settings: dict, source: str) -> None:
    """Merge launch settings (e.g. the 'best' of scripts/gpu_tune_gdn.py --json) into TUNE, keys checked."""
    check_tune_keys(TUNE, settings, source)
    TUNE.update(settings)


def _state_warps(key: str, K: int, dev, nch: int, tune: dict | None = None) -> int:
    """num_warps of a whole-K state pass (`_recur_fwd`: TUNE fwd_warps; `_recur_bwd`: rbwd_warps; KDA's: kda.TUNE
    state_warps, given as `tune`) whose chunk loop runs nch times. On CUDA a setting below 8 warps is taken only
    when nch >= TUNE fwd_stages, else 8: Triton 3.6 compiles these kernels at 4 warps to out-of-bounds shared-memory
    reads in the state-update dot when the software-pipelined loop runs fewer times than it has stages. H100,
    2026-11-25 00:34-00:37 (scripts/gpu_four_warps.sh, B2 H2 HV4 K128 V128 bf16, both passes at 4 warps): T = 1,
    63, 64 (one chunk) stop with an illegal memory access (also at V block 32, or 3 stages), compute-sanitizer puts
    200+ invalid 512-byte `__shared__` reads at the state update for T = 63 and 64 and none for T = 128; T = 65,
    128, 129, 200, 1000 match float64 as 8 warps do (the fault of 2026-11-24, found on the check's T63 case, was
    this one-chunk loop)."""
    w = (TUNE if tune is None else tune)[key] or _num_warps(K)
    if w < 8 and dev.type == "cuda" and nch < fwd_stages():
        return 8
    return w


def _recur_bv(K: int, V: int, programs: int, dev, key: str = "fwd_bv", per_sm: int = 2) -> int:
    """V block of the sequential kernels: TUNE[key] (fwd_bv, or rbwd_bv for `_recur_bwd`), else 32 (16 above
    K=128, for shared memory), halved to 16 when the halved grid (programs = sequences x value heads, times V/BV)
    still runs in one wave of per_sm programs per SM: few sequences x heads leave SMs idle otherwise, and the state
    passes are latency-bound (one chunk after another).
    per_sm: what fits one SM (sm_90 compile, K=V=128 bf16, 8 warps): `_recur_fwd` at BV 16 takes 74 KB of shared
    memory (2 used), `_recur_bwd` 124 KB (1). With 1, B1 T32768 H32 keeps BV 32 in the backward (128 programs, one
    wave) instead of 16 (256 programs, two waves): forward+backward 11.50 -> 10.68-10.78 ms in the tune script
    (H100, 2026-11-24 15:17), 10.52 -> 9.56 ms in the bench table (15:30)."""
    if TUNE[key]:
        return min(TUNE[key], V)
    # sm_90 compile: 32 keeps the [K, BV] fp32 state and the tiles in registers at 8 warps; at K=256 the two
    # pipeline stages need 236-240 KB of shared memory at 32 (over the 227 KB an H100 program may have), 222-224 KB at
    # 16 (bf16). One stage at 32 fits (124 KB) but made an illegal memory access on the H100 (2026-11-23).
    bv = min(32 if K <= 128 else 16, V)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 1
    while bv > 16 and programs * (V // (bv // 2)) <= sms * per_sm:
        bv //= 2
    return bv


def bwd_lowp(hb: torch.Tensor) -> bool:
    """Whether the backward's dots take 16-bit operands (TUNE["bwd_lowp"] with 16-bit saved intermediates hb).
    Refused on CUDA: bwd_lowp off with 16-bit intermediates. compute-sanitizer (H100, Triton 3.6, 2026-11-24) shows
    `_recur_bwd` with KDA's per-channel decay reading an out-of-range shared address there (its dS update, fp32
    operands converted from bf16), then an illegal memory access; fp32 operands come with store_fp32 instead."""
    lowp = TUNE["bwd_lowp"] and hb.dtype != torch.float32
    if hb.dtype != torch.float32 and not TUNE["bwd_lowp"] and hb.is_cuda:
        raise ValueError(f"gdn.TUNE['bwd_lowp']: expected True with {hb.dtype} intermediates on CUDA (False stops "
                         "with an illegal memory access on sm_90; set store_fp32=True for fp32 operands), got False")
    return lowp


def _num_warps(K: int) -> int:
    return 8  # sm_90 compile (scripts/compile_sm90.py): 4 warps spill the [64, K] tiles at K >= 128


def _fwd_impl(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None, scale: float, use_qk_l2norm: bool,
    output_final_state: bool, save: bool, BT: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (o, final_state or empty, T, W, h, Vn); the last four are empty unless save."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dev = q.device
    lay = layout(cu_seqlens, B, T, BT, dev)
    N, Ttot, nc = lay.N, lay.Ttot, lay.nc
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    if not save and TUNE["fwd_variant"] == "lean":
        return _fwd_lean(q, k, v, g, beta, initial_state, lay, scale, use_qk_l2norm, output_final_state, BT)
    if TUNE["fwd_variant"] not in ("lean", "saved"):
        raise ValueError(f"TUNE['fwd_variant']: expected 'lean' or 'saved', got {TUNE['fwd_variant']!r}")
    f32 = torch.float32
    sd = _store_dtype(q.dtype)
    NCmax = _max_chunks(Ttot, N, BT)
    # A for the solve in fp32; T solved from it in place, or into a 16-bit buffer kept for the backward when every
    # later dot rounds T to 16 bits anyway (`_t_dtype`), so A's buffer is freed when this function returns
    td = _t_dtype(sd) if save else f32
    kkt = _use_kkt()
    NCb = NCmax if save else max(nc, 1)
    if kkt:  # T straight from k: no A buffer
        Ab = Tb = torch.empty(NCb, HV, BT, BT, device=dev, dtype=td)
    else:
        Ab = torch.empty(NCmax if save and td == f32 else max(nc, 1), HV, BT, BT, device=dev, dtype=f32)
        Tb = torch.empty(NCmax, HV, BT, BT, device=dev, dtype=td) if td != f32 else Ab
    Wb = torch.empty(Ttot, HV, K, device=dev, dtype=sd)
    Ub = torch.empty(Ttot, HV, V, device=dev, dtype=sd)
    o = _out((B, T, HV, V), q, q.dtype)
    ht = _out((N, HV, K, V), q, f32) if output_final_state else q.new_empty(0, dtype=f32)
    split = TUNE["fwd_split_o"]
    keep = save or split  # the chunk states and Vn go to memory
    hb = torch.empty(NCb, HV, K, V, device=dev, dtype=sd) if keep else q.new_empty(0, dtype=sd)
    vn = torch.empty(Ttot, HV, V, device=dev, dtype=sd) if keep else q.new_empty(0, dtype=sd)
    prec = _prec(q.dtype)
    raw_out = _use_raw_out(save)
    Qg = torch.empty(0 if raw_out else Ttot, HV, K, device=dev, dtype=sd)
    if TUNE["state_raw_k"] and not raw_out:
        raise ValueError("TUNE['state_raw_k'] needs TUNE['fwd_raw_out'] (the s_k scales come from its W/U launch), "
                         f"got fwd_raw_out={TUNE['fwd_raw_out']!r}; set state_raw_k=False with it")
    sk_only = bool(TUNE["state_raw_k"])  # (so raw_out) Kd as its row scales s_k [tokens, HV] fp32; the pass reads k
    Kd = torch.empty(Ttot, HV, device=dev, dtype=f32) if sk_only else torch.empty(Ttot, HV, K, device=dev, dtype=sd)
    Pb = torch.empty(NCb if save or not raw_out else 0, HV, BT, BT, device=dev, dtype=sd)
    rk = torch.empty(Ttot if raw_out else 0, HV, device=dev, dtype=f32)  # the keys' inverse norms, for the output
    if nc > 0:
        pw = TUNE["prep_warps"] or 8
        stages = ((1, TUNE["prep1_warps"] or pw), (2, TUNE["solve_warps"]), (3, TUNE["prep3_warps"] or pw)) \
            if TUNE["prep_split"] else ((0, pw),)
        fn, extra = _prep_kernel(K, q.dtype)
        for stage, warps in stages:
            if kkt and stage == 2:
                _kkt_launch(k, g, beta, Tb, lay, H, HV, K, BT, use_qk_l2norm, prec)
                continue
            if raw_out and stage == 1:  # Kd comes from stage 3, P from the output launch
                continue
            fn[(nc, HV)](
                q, k, v, g, beta, Ab, Tb, Wb, Ub, Qg, Kd, Pb, rk, lay.cu_t, lay.chunk_seq, lay.chunk_start, scale,
                H=H, HV=HV, K=K, V=V, BT=BT, BV=min(V, 64), L2=use_qk_l2norm, PREC=prec, STAGE=stage,
                INTERLEAVE=TUNE["solve_interleave"], LOWP=TUNE["prep_lowp"] and sd != f32, num_warps=warps,
                num_stages=TUNE["prep_stages"], WITH_A=not kkt, KD=(2 if sk_only else 1) if raw_out else 0, **extra,
                **_solve_args(fn),
            )
    h0 = initial_state.contiguous() if initial_state is not None else ht
    BV = _recur_bv(K, V, N * HV, dev)
    kern._recur_fwd[(V // BV, N * HV)](
        g, Wb, Ub, Qg, *((k, Kd) if sk_only else (Kd, Pb)), o, h0, ht, hb, vn, lay.cu_t, lay.chunk_off, lay.nch,
        scale, H=H, HV=HV, K=K, V=V, BT=BT, BV=BV, PREC=prec,
        HAS_H0=initial_state is not None, STORE_HT=output_final_state, STORE=keep,
        LOWP=TUNE["fwd_lowp"] and sd != f32, num_warps=_state_warps("fwd_warps", K, dev, lay.nch),
        num_stages=fwd_stages(),
        OUT=not split, SK=sk_only,
    )
    if raw_out:
        _raw_output_pass(q, k, g, rk, hb, vn, o, Pb, lay, H, HV, K, V, BT, scale, use_qk_l2norm, prec,
                         TUNE["fwd_lowp"] and sd != f32, save)
    elif split:
        _output_pass(Qg, Pb, hb, vn, o, lay, HV, K, V, BT, prec, TUNE["fwd_lowp"] and sd != f32)
    if save and TUNE["bwd_raw_qk"]:  # the backward reads raw q and k instead (`_recur_bwd` RAW)
        Qg, Kd = q.new_empty(0, dtype=sd), q.new_empty(0, dtype=sd)
    if not save:
        hb, vn = q.new_empty(0, dtype=sd), q.new_empty(0, dtype=sd)
        Tb, Wb = q.new_empty(0, dtype=f32), q.new_empty(0, dtype=sd)
        Qg, Kd, Pb = (q.new_empty(0, dtype=sd) for _ in range(3))  # distinct: custom-op outputs may not alias
    return o, ht, Tb, Wb, hb, vn, Qg, Kd, Pb


def _fwd_lean(q, k, v, g, beta, initial_state, lay: Layout, scale: float, use_qk_l2norm: bool,
              output_final_state: bool, BT: int) -> tuple[torch.Tensor, ...]:
    """The inference forward (TUNE["fwd_variant"] = "lean"): `_prep_lean` (W, U), the state pass reading raw k,
    then `_out_fwd_raw` (or the output inside the state pass without fwd_split_o). Returns as `_fwd_impl` with
    every saved tensor empty."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dev, f32, sd = q.device, torch.float32, _store_dtype(q.dtype)
    N, Ttot, nc = lay.N, lay.Ttot, lay.nc
    prec, lowp = _prec(q.dtype), TUNE["fwd_lowp"] and sd != f32
    split = TUNE["fwd_split_o"]
    Ab = torch.empty(max(nc, 1), HV, BT, BT, device=dev, dtype=f32)  # A, staged for the solve's row reads
    Wb = torch.empty(Ttot, HV, K, device=dev, dtype=sd)
    Ub = torch.empty(Ttot, HV, V, device=dev, dtype=sd)
    o = _out((B, T, HV, V), q, q.dtype)
    ht = _out((N, HV, K, V), q, f32) if output_final_state else q.new_empty(0, dtype=f32)
    hb = torch.empty(max(nc, 1), HV, K, V, device=dev, dtype=sd) if split else q.new_empty(0, dtype=sd)
    vn = torch.empty(Ttot, HV, V, device=dev, dtype=sd) if split else q.new_empty(0, dtype=sd)
    rk = torch.empty(Ttot, HV, device=dev, dtype=f32)  # keys' inverse norms, from the prep
    if nc > 0:
        bk = key_block(TUNE, "lean_bk", K)
        for stage in ((1, 2) if TUNE["lean_split"] else (0,)):
            kern._prep_lean[(nc, HV)](
                k, v, g, beta, Ab, Wb, Ub, rk, lay.cu_t, lay.chunk_seq, lay.chunk_start,
                H=H, HV=HV, K=K, V=V, BT=BT, BK=min(bk, 32) if q.dtype == f32 else bk, BV=min(V, 64),
                L2=use_qk_l2norm, PREC=prec, INTERLEAVE=TUNE["solve_interleave"],
                LOWP=TUNE["prep_lowp"] and sd != f32, STAGE=stage, num_warps=TUNE["lean_warps"], num_stages=1,
                **_solve_args(kern._prep_lean),
            )
    h0 = initial_state.contiguous() if initial_state is not None else ht
    BV = _recur_bv(K, V, N * HV, dev)
    kern._recur_fwd[(V // BV, N * HV)](
        g, Wb, Ub, q, k, rk, o, h0, ht, hb, vn, lay.cu_t, lay.chunk_off, lay.nch, scale,
        H=H, HV=HV, K=K, V=V, BT=BT, BV=BV, PREC=prec,
        HAS_H0=initial_state is not None, STORE_HT=output_final_state, STORE=split, LOWP=lowp,
        num_warps=_state_warps("fwd_warps", K, dev, lay.nch), num_stages=fwd_stages(), OUT=not split, RAWK=True,
        L2=use_qk_l2norm,
    )
    if split and nc > 0:
        BVo = min(TUNE["out_bv"], V)
        kern._out_fwd_raw[(V // BVo, nc, HV)](
            q, k, g, rk, hb, vn, o, vn, lay.cu_t, lay.chunk_seq, lay.chunk_start, scale,
            H=H, HV=HV, K=K, V=V, BT=BT, BV=BVo, PREC=prec, LOWP=lowp, L2=use_qk_l2norm,
            num_warps=TUNE["out_warps"], num_stages=1,
        )
    e = lambda dt: q.new_empty(0, dtype=dt)  # noqa: E731 (distinct: custom-op outputs may not alias)
    return o, ht, e(f32), e(sd), e(sd), e(sd), e(sd), e(sd), e(sd)


def _use_raw_out(save: bool) -> bool:
    """Whether the training forward skips the prep's stage 1 (TUNE fwd_raw_out): stage 3 writes Kd and the key
    norms, and the output launch makes P from the raw q and k (`_out_fwd_raw`, storing P when the backward needs
    it). That needs A from `_kkt_solve`, the output in its own launch, and (with a backward) a backward that reads
    the raw q and k, since no Qg is made."""
    if not TUNE["fwd_raw_out"]:
        return False
    need = dict(prep_kkt=True, fwd_split_o=True, **({"bwd_raw_qk": True} if save else {}))
    bad = {key: TUNE[key] for key, want in need.items() if TUNE[key] is not want}
    if bad:
        raise ValueError(f"TUNE['fwd_raw_out'] needs {need}, got {bad}")
    return True


def _raw_output_pass(q, k, g, rk, hb, vn, o, Pb, lay: Layout, H: int, HV: int, K: int, V: int, BT: int,
                     scale: float, l2: bool, prec: str, lowp: bool, save: bool) -> None:
    """O of every chunk at once from the raw q and k (`_out_fwd_raw`); with save also P into Pb."""
    if lay.nc == 0:
        return
    BV = min(TUNE["rawout_bv"], V)
    if q.is_cuda and BV < min(64, V):
        raise ValueError(f"TUNE['rawout_bv']: expected >= 64 on CUDA (V block 32 at 4 warps gave a wrong output on "
                         f"an H100, 2026-11-24), got {TUNE['rawout_bv']}")
    # (a key-blocked form of this launch, its loads pipelined over blocks of 64 or 32 keys, matched float64 in the
    # CPU interpreter but gave a wrong bf16 o on an H100 at every setting, 2026-11-25 00:28: withdrawn)
    kern._out_fwd_raw[(V // BV, lay.nc, HV)](
        q, k, g, rk, hb, vn, o, Pb, lay.cu_t, lay.chunk_seq, lay.chunk_start, scale,
        H=H, HV=HV, K=K, V=V, BT=BT, BV=BV, PREC=prec, LOWP=lowp, L2=l2, STORE_P=save,
        num_warps=TUNE["rawout_warps"], num_stages=1,
    )


def _use_kkt() -> bool:
    """Whether the forward prep makes T with `_kkt_solve` (TUNE prep_kkt); it replaces the split K-blocked prep's
    stage 2 only."""
    if TUNE["prep_kkt"] and not (TUNE["prep_split"] and TUNE["prep_variant"] == "kblock"):
        raise ValueError("TUNE['prep_kkt'] needs the split K-blocked prep (prep_split=True, prep_variant 'kblock'), "
                         f"got prep_split={TUNE['prep_split']!r}, prep_variant={TUNE['prep_variant']!r}")
    return bool(TUNE["prep_kkt"])


def _kkt_launch(k, g, beta, Tb, lay: Layout, H: int, HV: int, K: int, BT: int, l2: bool, prec: str) -> None:
    """T = (I + A)^{-1} of every chunk and value head into Tb, from k, g and beta (`_kkt_solve`)."""
    bk = key_block(TUNE, "kkt_bk", K)
    dprec, sprec = block_solve_precs(k.dtype)
    kern._kkt_solve[(lay.nc, HV)](
        k, g, beta, Tb, lay.cu_t, lay.chunk_seq, lay.chunk_start,
        H=H, HV=HV, K=K, BT=BT, BK=min(bk, 32) if k.dtype == torch.float32 else bk, L2=l2, PREC=prec,
        SPREC=sprec, DPREC=dprec, num_warps=TUNE["kkt_warps"], num_stages=1,
    )


def block_solve_precs(dtype: torch.dtype) -> tuple[str, str]:
    """(diagonal blocks' precision, block rows' precision) of the [16, 16]-block UT solve (`_t_from_blocks`: GDN's
    `_kkt_solve`, KDA's `_solve_blocks`) for inputs of `dtype`: IEEE for fp32, else TUNE kkt_diag_prec (None:
    kkt_prec) and kkt_prec, each checked."""
    for key in ("kkt_prec", "kkt_diag_prec"):
        if TUNE[key] not in ("tf32", "tf32x3", "ieee") and not (key == "kkt_diag_prec" and TUNE[key] is None):
            raise ValueError(f"TUNE['{key}']: expected 'tf32', 'tf32x3' or 'ieee', got {TUNE[key]!r}")
    if dtype == torch.float32:
        return "ieee", "ieee"
    return TUNE["kkt_diag_prec"] or TUNE["kkt_prec"], TUNE["kkt_prec"]


def _solve_args(fn) -> dict:
    """The solve's launch arguments (TUNE["solve"], TUNE["solve_prec"]) for the kernels that take them."""
    modes = {"subst": 0, "doubling": 1, "doubling16": 2}
    if TUNE["solve"] not in modes:
        raise ValueError(f"TUNE['solve']: expected one of {sorted(modes)}, got {TUNE['solve']!r}")
    if fn is kern._prep_fwd:  # the whole-K prep solves by substitution only
        if TUNE["solve"] != "subst":
            raise ValueError("TUNE['solve'] = 'doubling' needs prep_variant 'kblock' (the whole-K prep substitutes)")
        return {}
    if TUNE["solve"] == "doubling16" and not TUNE["solve_interleave"]:
        raise ValueError("TUNE['solve'] = 'doubling16' needs solve_interleave=True (the diagonal blocks as one tile)")
    return dict(DOUBLING=modes[TUNE["solve"]], SPREC=TUNE["solve_prec"])


def _prep_kernel(K: int, dtype: torch.dtype):
    """The prep kernel of TUNE["prep_variant"] and its extra launch arguments (the K-blocked one's key-channel
    block: TUNE["prep_bk"], at most K, and at most 32 for fp32 inputs: their IEEE fp32 dots spill at 64, sm_90
    K=V=128 8 warps: 40 and 168 B of stack in stages 1 and 3, none at 32)."""
    if TUNE["prep_variant"] == "whole":
        return kern._prep_fwd, {}
    if TUNE["prep_variant"] != "kblock":
        raise ValueError(f"TUNE['prep_variant']: expected 'kblock' or 'whole', got {TUNE['prep_variant']!r}")
    bk = key_block(TUNE, "prep_bk", K)
    return kern._prep_fwd_blk, dict(BK=min(bk, 32) if dtype == torch.float32 else bk)


def _output_pass(Qg, Pb, hb, vn, o, lay: Layout, HV: int, K: int, V: int, BT: int, prec: str, lowp: bool) -> None:
    """O = Qg S + P Vn for every chunk at once (`_out_fwd`), after the state-only sequential pass."""
    if lay.nc == 0:
        return
    BV = min(TUNE["out_bv"], V)
    kern._out_fwd[(V // BV, lay.nc, HV)](
        Qg, Pb, hb, vn, o, lay.cu_t, lay.chunk_seq, lay.chunk_start,
        HV=HV, K=K, V=V, BT=BT, BV=BV, PREC=prec, LOWP=lowp, num_warps=TUNE["out_warps"], num_stages=1,
    )


@torch.library.custom_op("hybridlm::gdn_chunk_fwd", mutates_args=())
def gdn_chunk_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None, scale: float, use_qk_l2norm: bool,
    output_final_state: bool, save: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor]:
    """Returns (o, final_state or empty, T, W, h, Vn, Qg, Kd, P); the last seven are empty unless save."""
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
    NC = _max_chunks(B * T, N, BT)
    f32 = torch.float32
    o = q.new_empty(B, T, HV, V)
    ht = q.new_empty(N, HV, K, V, dtype=f32) if output_final_state else q.new_empty(0, dtype=f32)
    sd = _store_dtype(q.dtype)
    if save:
        tiles = (0,) if TUNE["bwd_raw_qk"] else (B * T, HV, K)  # Qg and Kd
        return (o, ht, q.new_empty(NC, HV, BT, BT, dtype=_t_dtype(sd)), q.new_empty(B * T, HV, K, dtype=sd),
                q.new_empty(NC, HV, K, V, dtype=sd), q.new_empty(B * T, HV, V, dtype=sd),
                q.new_empty(*tiles, dtype=sd), q.new_empty(*tiles, dtype=sd),
                q.new_empty(NC, HV, BT, BT, dtype=sd))
    return (o, ht, q.new_empty(0, dtype=f32), *(q.new_empty(0, dtype=sd) for _ in range(6)))


def _bwd_impl(
    do: torch.Tensor, dht: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    g: torch.Tensor, beta: torch.Tensor, saved: list[torch.Tensor | None],
    cu_seqlens: torch.Tensor | None, scale: float, use_qk_l2norm: bool, has_h0: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (dq, dk, dv, dg, dbeta, dinitial_state or empty). saved: the forward's [T, W, h, Vn, Qg, Kd, P];
    W, Qg, Kd and P serve only the state recurrence's backward, so their entries are cleared after its launch: when
    the list holds the only references (recompute), their memory is free before dq, dk, dv are allocated."""
    Tb, Wb, hb, vn, Qg, Kd, Pb = saved
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    G = HV // H
    BT = Tb.shape[-1]
    dev = q.device
    lay = layout(cu_seqlens, B, T, BT, dev)
    N, Ttot, nc = lay.N, lay.Ttot, lay.nc
    q, k, v, g, beta, do = (x.contiguous() for x in (q, k, v, g, beta, do))
    f32 = torch.float32
    prec = _prec(q.dtype)
    dhb = torch.empty_like(hb)
    dvn = torch.empty(Ttot, HV, V, device=dev, dtype=hb.dtype)
    lowp = bwd_lowp(hb)
    BV = _recur_bv(K, V, N * HV, dev, "rbwd_bv", per_sm=1)
    dh0 = _out((N, HV, K, V), q, f32) if has_h0 else q.new_empty(0, dtype=f32)
    # a forward under TUNE["bwd_raw_qk"] kept no Qg and Kd: the state backward reads the raw q and k (RAW)
    raw = Qg.numel() == 0
    kern._recur_bwd[(V // BV, N * HV)](
        g, Wb, q if raw else Qg, k if raw else Kd, Pb, do, dht if dht is not None else dvn, dh0, dhb, dvn,
        lay.cu_t, lay.chunk_off, lay.nch,
        H=H, HV=HV, K=K, V=V, BT=BT, BV=BV, PREC=prec,
        HAS_DHT=dht is not None, STORE_DH0=has_h0, LOWP=lowp, num_warps=_state_warps("rbwd_warps", K, dev, lay.nch),
        num_stages=fwd_stages(), scale=scale, L2=use_qk_l2norm, RAW=raw,
    )
    saved[1] = saved[4] = saved[5] = saved[6] = Wb = Qg = Kd = Pb = None
    # the kernels write dq, dv in the input dtype (with GVA dq per value head, as fla writes it, summed over each
    # key head's value heads in fp32 below: 128 MiB less than fp32 partials at B8 T2048 HV32 bf16). dk is written
    # once per value head but its partial sum between the two launches is parked in fp32: with GVA dk itself
    # holds it, so it is fp32; without, dk is in the input dtype beside an fp32 dkp.
    gd = f32 if G > 1 else q.dtype
    variant = TUNE["bwd_variant"]
    # the K-blocked plan writes dq in its second launch only: it allocates dq there, after freeing dS and dVn
    dq = None if variant == "kblock" and nc > 0 else _out((Ttot, HV, K), q, q.dtype)
    dk = _out((Ttot, HV, K), q, gd)
    dkp = dk if gd == f32 else torch.empty(Ttot, HV, K, device=dev, dtype=f32)
    dv = _out((B, T, HV, V), q, v.dtype)
    dg = _out((B, T, HV), q, f32)
    db = _out((B, T, HV), q, f32)
    if variant not in ("kblock", "statefirst", "twophase", "onephase"):
        raise ValueError(f"TUNE['bwd_variant']: expected 'kblock', 'statefirst', 'twophase' or 'onephase', "
                         f"got {variant!r}")
    if nc > 0 and variant == "kblock":
        state_grads = [dhb, dvn]  # the only references from here on: the function frees them after their last read
        dhb = dvn = None
        dq = _chunk_bwd_kblock(q, k, v, g, beta, Tb, hb, state_grads, vn, do, dk, dkp, dv, dg, db, lay, scale,
                               H, HV, K, V, BT, use_qk_l2norm, prec, lowp)
    elif nc > 0 and variant == "statefirst":
        _chunk_bwd_statefirst(q, k, v, g, beta, Tb, hb, dhb, vn, dvn, do, dq, dk, dkp, dv, dg, db, lay, scale,
                              H, HV, K, V, BT, use_qk_l2norm, prec, lowp)
    elif nc > 0:
        if TUNE["bwd_variant"] == "twophase":  # one launch per phase (PHASE 1, 2) or both in one (PHASE 0)
            launches = [(kern._chunk_bwd, dict(PHASE=ph)) for ph in ((1, 2) if TUNE["bwd_split"] else (0,))]
        else:
            launches = [(kern._chunk_bwd_onephase, {})]
        for fn, extra in launches:
            fn[(nc, HV)](
                q, k, v, g, beta, Tb, hb, dhb, vn, dvn, do, dq, dk, dkp, dv, dg, db, lay.cu_t, lay.chunk_seq,
                lay.chunk_start, scale,
                H=H, HV=HV, K=K, V=V, BT=BT, BV=min(TUNE["bwd_bv"] or (64 if K <= 128 else 32), V),
                L2=use_qk_l2norm, PREC=prec, LOWP=lowp, num_warps=TUNE["bwd_warps"] or 8, num_stages=1, **extra,
            )
    # the state gradients are read: free them before the GVA sums, where this layer's backward peaks otherwise (H100,
    # GDN layer B8 T2048 HV32: 264 + 128 MiB still allocated there, `scripts/gpu_layer_peak.py`, 2026-11-24)
    dhb = dvn = None
    return (gva_sum(dq, B, T, H, q.dtype), gva_sum(dk, B, T, H, k.dtype), dv.to(v.dtype), dg.to(g.dtype),
            db.to(beta.dtype), dh0)


def gva_sum(dx: torch.Tensor, B: int, T: int, H: int, dtype: torch.dtype) -> torch.Tensor:
    """dq or dk per value head [B*T, HV, K] -> per key head [B, T, H, K] in dtype: each key head's HV / H value heads
    summed in fp32 (GVA), cast as soon as the sum exists so that one fp32 sum is alive at a time."""
    G, K = dx.shape[1] // H, dx.shape[2]
    if G == 1:
        return dx.view(B, T, H, K).to(dtype)
    return dx.view(B, T, H, G, K).sum(3, dtype=torch.float32).to(dtype)


def _chunk_bwd_statefirst(q, k, v, g, beta, Tb, hb, dhb, vn, dvn, do, dq, dk, dkp, dv, dg, db, lay: Layout,
                          scale: float, H: int, HV: int, K: int, V: int, BT: int, l2: bool, prec: str,
                          lowp: bool) -> None:
    """The chunk backward as `_chunk_bwd_state` (state write, W, UT transform: dv, dbeta final, dk's and dg's
    parts parked in dkp and dg) then `_chunk_bwd_out` (output paths, then dq, dk, dg finished). With
    TUNE["bwd_ut_dots"] False the UT transform's dKK [BT, BT] waits in a scratch buffer (dot operand dtype) and
    its two dots into dk run in the second launch."""
    ut = TUNE["bwd_ut_dots"]
    dkk = dhb if ut else torch.empty(lay.nc, HV, BT, BT, device=q.device, dtype=hb.dtype if lowp else torch.float32)
    common = dict(H=H, HV=HV, K=K, V=V, BT=BT, BV=min(TUNE["bwd_bv"] or _state_first_bv(K, ut), V), L2=l2,
                  PREC=prec, LOWP=lowp, UT_DOTS=ut, num_stages=1)
    warps = TUNE["bwd_warps"] or 8
    kern._chunk_bwd_state[(lay.nc, HV)](
        k, v, g, beta, Tb, hb, dhb, vn, dvn, dkp, dv, dg, db, dkk, lay.cu_t, lay.chunk_seq, lay.chunk_start,
        num_warps=warps, **common,
    )
    kern._chunk_bwd_out[(lay.nc, HV)](
        q, k, g, beta, hb, vn, do, dq, dk, dkp, dg, dkk, lay.cu_t, lay.chunk_seq, lay.chunk_start, scale,
        num_warps=TUNE["bwd_out_warps"] or warps, **common,
    )


def _chunk_bwd_kblock(q, k, v, g, beta, Tb, hb, state_grads: list, vn, do, dk, dkp, dv, dg, db, lay: Layout,
                      scale: float, H: int, HV: int, K: int, V: int, BT: int, l2: bool, prec: str,
                      lowp: bool) -> torch.Tensor:
    """The state-first chunk backward walking K in blocks of TUNE["bwd_bk"] channels: `_chunk_bwd_state_blk` (dv,
    dbeta final; dk's part in dkp, dg's per-row part in dg, dKK + dKK^T parked [BT, BT], with l2norm the l2
    backward's row sums of its dk part in a [tokens, HV] fp32 buffer) then `_chunk_bwd_out_blk` (dq, dk, dg).
    state_grads: [dS, dVn], emptied here; the first launch is their last reader, so they are freed before dq (the
    second launch's) is allocated: the GDN layer's backward peak falls by dq's bytes (128 MiB at B8 T2048 HV32
    bf16). Returns dq [tokens, HV, K] in the input dtype."""
    dhb, dvn = state_grads
    state_grads.clear()
    dkk = torch.empty(lay.nc, HV, BT, BT, device=q.device, dtype=hb.dtype if lowp else torch.float32)
    dsk = torch.empty(lay.Ttot, HV, device=q.device, dtype=torch.float32) if l2 else dg
    BK, BV = kblock_bwd_blocks(K, V)
    stages = TUNE["bwd_stages"]
    if not isinstance(stages, int) or stages < 1:
        raise ValueError(f"gdn.TUNE['bwd_stages']: expected an int >= 1, got {stages!r}")
    common = dict(H=H, HV=HV, K=K, V=V, BT=BT, BK=BK, BV=BV, L2=l2, PREC=prec, LOWP=lowp, num_stages=stages)
    if q.dtype != torch.float32 and TUNE["bwd_maxnreg"]:  # fp32's IEEE dots spill with or without the cap
        common["maxnreg"] = TUNE["bwd_maxnreg"]
    warps = TUNE["bwd_warps"] or 8
    chunks = (lay.cu_t, lay.chunk_seq, lay.chunk_start)
    kern._chunk_bwd_state_blk[(lay.nc, HV)](
        k, v, g, beta, Tb, hb, dhb, vn, dvn, dkp, dv, dg, db, dkk, dsk, *chunks, num_warps=warps, **common)
    dhb = dvn = None
    dq = _out((lay.Ttot, HV, K), q, q.dtype)
    kern._chunk_bwd_out_blk[(lay.nc, HV)](
        q, k, g, hb, vn, do, dq, dk, dkp, dg, dkk, dsk, *chunks, scale, num_warps=TUNE["bwd_out_warps"] or warps,
        **common)
    return dq


def key_block(tune: dict, key: str, K: int) -> int:
    """The key-channel block tune[key] of a K-blocked launch (GDN's and KDA's), at most K."""
    bk = min(tune[key], K)
    if bk not in (16, 32, 64, 128, 256) or K % bk:
        raise ValueError(f"TUNE['{key}']: expected a power of two >= 16 dividing K={K}, got {tune[key]}")
    return bk


def kblock_bwd_blocks(K: int, V: int) -> tuple[int, int]:
    """(key block, V block) of the K-blocked chunk backward: TUNE["bwd_bk"] (at most K) and TUNE["bwd_bv"] or 64
    (32 at V = 64: sm_90 compile, one V block unrolls the loops and spills under the register cap, 352 B).
    Key blocks smaller than the V block are refused: on an H100 (Triton 3.6) key blocks of 32 with V blocks of 64
    gave a wrong dk (rel RMS 0.04 to inf) at B4 T4096 H16, B8 T2048 H32, B1 T32768 H32 and T200 K=V=256, with a
    barrier between the two K walks or not, while 32/32 and 64/64 were exact; the CPU interpreter gets every
    combination right, so the cause is not known."""
    bk = key_block(TUNE, "bwd_bk", K)
    bv = min(TUNE["bwd_bv"] or min(64, V // 2), V)
    if bk < bv:
        raise ValueError(f"TUNE['bwd_bk']={bk} with V block {bv} (TUNE['bwd_bv']={TUNE['bwd_bv']}, V={V}): the "
                         f"K-blocked backward needs a key block >= the V block (smaller ones gave a wrong dk on an "
                         f"H100); set TUNE['bwd_bv'] <= {bk} or TUNE['bwd_bk'] >= {bv}")
    return bk, bv


def _state_first_bv(K: int, ut_dots: bool) -> int:
    """V block of the state-first launches: sm_90 compile (K 128, bf16, 8 warps) spills 40 B/thread at 64 with the
    UT dots in the state launch, none at 32 or with them parked."""
    return 32 if ut_dots or K > 128 else 64


@torch.library.custom_op("hybridlm::gdn_chunk_bwd", mutates_args=())
def gdn_chunk_bwd(
    do: torch.Tensor, dht: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    g: torch.Tensor, beta: torch.Tensor, Tb: torch.Tensor, Wb: torch.Tensor, hb: torch.Tensor, vn: torch.Tensor,
    Qg: torch.Tensor, Kd: torch.Tensor, Pb: torch.Tensor,
    cu_seqlens: torch.Tensor | None, scale: float, use_qk_l2norm: bool, has_h0: bool, h0: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (dq, dk, dv, dg, dbeta, dinitial_state or empty)."""
    try:
        return _bwd_impl(do, dht, q, k, v, g, beta, [Tb, Wb, hb, vn, Qg, Kd, Pb], cu_seqlens, scale,
                         use_qk_l2norm, has_h0)
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


@torch.library.custom_op("hybridlm::gdn_chunk_bwd_rc", mutates_args=())
def gdn_chunk_bwd_rc(
    do: torch.Tensor, dht: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    g: torch.Tensor, beta: torch.Tensor, cu_seqlens: torch.Tensor | None, scale: float, use_qk_l2norm: bool,
    has_h0: bool, h0: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """gdn_chunk_bwd for recompute=True: reruns the forward inside, so that W, Qg, Kd and P (~0.9 KB per token and
    value head at K=V=128, 16-bit) are freed before the chunk backward's own buffers exist."""
    K, V = q.shape[-1], v.shape[-1]
    first = _bt_for(K, V, q.dtype, True)
    return _bwd_recomputed(do, dht, q, k, v, g, beta, cu_seqlens, scale, use_qk_l2norm, has_h0, h0,
                           [b for b in BT_CHOICES if b <= first], None)


@gdn_chunk_bwd_rc.register_fake
def _(do, dht, q, k, v, g, beta, cu_seqlens, scale, use_qk_l2norm, has_h0, h0):
    return _bwd_fake(q, k, v, g, beta, cu_seqlens, has_h0)


@gdn_chunk_bwd.register_fake
def _(do, dht, q, k, v, g, beta, Tb, Wb, hb, vn, Qg, Kd, Pb, cu_seqlens, scale, use_qk_l2norm, has_h0, h0):
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
    T, W, the chunk states, Vn, Qg, Kd, P are ~1.9 KB per token and value head at K=V=128 16-bit; fla keeps ~0.13 KB
    and recomputes the rest too). The rerun includes the output pass, whose result is dropped."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm, output_final_state,
                recompute):
        grad = any(ctx.needs_input_grad[:6])
        o, ht, *saved = torch.ops.hybridlm.gdn_chunk_fwd(
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
            dq, dk, dv, dg, db, dh0 = torch.ops.hybridlm.gdn_chunk_bwd_rc(
                do, dht, q, k, v, g, beta, cu, ctx.scale, ctx.l2, ctx.has_h0, h0)
        else:
            dq, dk, dv, dg, db, dh0 = torch.ops.hybridlm.gdn_chunk_bwd(
                do, dht, q, k, v, g, beta, *saved, cu, ctx.scale, ctx.l2, ctx.has_h0, h0)
        return dq, dk, dv, dg, db, (dh0 if ctx.has_h0 else None), None, None, None, None, None


def _check_device(x: torch.Tensor) -> None:
    if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(f"impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1 for the CPU interpreter), "
                           f"got q on {x.device}")


def unsupported_reason(q: torch.Tensor, v: torch.Tensor) -> str | None:
    """None when the chunk kernels take these inputs, else why not (used by impl="auto")."""
    K, V = q.shape[-1], v.shape[-1]
    if K not in SUPPORTED_DIMS or V not in SUPPORTED_DIMS:
        return f"head dims K={K}, V={V} not in {SUPPORTED_DIMS}"
    if q.dtype == torch.float64:
        return "float64 inputs"
    return None


def _check_dims(K: int, V: int) -> None:
    if K not in SUPPORTED_DIMS:
        raise ValueError(f"q/k: the Triton kernels support head dim K in {SUPPORTED_DIMS}, got K={K}")
    if V not in SUPPORTED_DIMS:
        raise ValueError(f"v: the Triton kernels support head dim V in {SUPPORTED_DIMS}, got V={V}")


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
    o, ht = _ChunkGDN.apply(q, k, v, g, beta, initial_state, cu_seqlens, scale, bool(use_qk_l2norm),
                            bool(output_final_state), bool(recompute))
    return o, (ht if output_final_state else None)


@torch.library.custom_op("hybridlm::gdn_decode", mutates_args=("state_pool",))
def gdn_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state_pool: torch.Tensor, state_indices: torch.Tensor, scale: float, use_qk_l2norm: bool,
) -> torch.Tensor:
    N, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    BV = 32 if K <= 128 else 16
    o = _out((N, HV, V), q, q.dtype)
    if N > 0:
        kern._decode_step[(V // BV, N * HV)](
            q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(), state_pool,
            state_indices, o, scale, H=H, HV=HV, K=K, V=V, BV=BV, L2=use_qk_l2norm, num_warps=4,
        )
    return o


@gdn_decode.register_fake
def _(q, k, v, g, beta, state_pool, state_indices, scale, use_qk_l2norm):
    return q.new_empty(q.shape[0], v.shape[1], v.shape[2])


def _check_decode_inputs(q, k, v, g, beta, state_pool, state_indices, *, channel: bool) -> int:
    """Shapes and dtypes of one decode step (GDN: g [N, HV]; KDA, channel: g float32 [N, HV, K]); returns K."""
    if q.dim() != 3 or k.shape != q.shape:
        raise ValueError(f"q, k: expected [N, H, K], got {tuple(q.shape)} and {tuple(k.shape)}")
    N, H, K = q.shape
    if v.dim() != 3 or v.shape[0] != N or v.shape[1] % H != 0:
        raise ValueError(f"v: expected [N, HV, V] with HV a multiple of H={H}, got {tuple(v.shape)}")
    HV, V = v.shape[1], v.shape[2]
    _check_dims(K, V)
    g_shape = (N, HV, K) if channel else (N, HV)
    if tuple(g.shape) != g_shape or (channel and g.dtype != torch.float32):
        want = "float32 [N, HV, K]" if channel else "[N, HV]"
        raise ValueError(f"g: expected {want} = {g_shape}, got {g.dtype} {tuple(g.shape)}")
    if tuple(beta.shape) != (N, HV):
        raise ValueError(f"beta: expected shape {(N, HV)} ([N, HV]), got {tuple(beta.shape)}")
    if state_pool.dtype != torch.float32 or state_pool.dim() != 4 or tuple(state_pool.shape[1:]) != (HV, K, V):
        raise ValueError(f"state_pool: expected float32 [P, {HV}, {K}, {V}], got {state_pool.dtype} "
                         f"{tuple(state_pool.shape)}")
    if not state_pool.is_contiguous():
        raise ValueError("state_pool: expected a contiguous tensor (it is updated in place)")
    if state_indices.dtype not in (torch.int32, torch.int64) or tuple(state_indices.shape) != (N,):
        raise ValueError(f"state_indices: expected int32/int64 [{N}], got {state_indices.dtype} "
                         f"{tuple(state_indices.shape)}")
    _check_device(q)
    return K


def fused_recurrent_gated_delta_rule_update(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, g: torch.Tensor, beta: torch.Tensor,
    state_pool: torch.Tensor, state_indices: torch.Tensor, scale: float | None = None, use_qk_l2norm: bool = False,
) -> torch.Tensor:
    """One decode step for N sequences (one token each).

    q, k: [N, H, K] (or [N, 1, H, K]); v: [N, HV, V] (or [N, 1, HV, V]); g, beta: [N, HV] (or [N, 1, HV]);
    state_pool: [P, HV, K, V] float32, updated in place at rows state_indices (int32/int64 [N], distinct, valid).
    Returns o [N, HV, V] (or [N, 1, HV, V] when given 4-d inputs) in q's dtype. Not differentiable."""
    four = q.dim() == 4
    if four:
        if q.shape[1] != 1:
            raise ValueError(f"q: expected one token per sequence ([N, 1, H, K]), got {tuple(q.shape)}")
        q, k, v, g, beta = q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0]
    K = _check_decode_inputs(q, k, v, g, beta, state_pool, state_indices, channel=False)
    scale = K**-0.5 if scale is None else float(scale)
    o = torch.ops.hybridlm.gdn_decode(q, k, v, g, beta, state_pool, state_indices.contiguous(), scale,
                                      bool(use_qk_l2norm))
    return o.unsqueeze(1) if four else o


def flops_chunk_fwd(B: int, T: int, HV: int, K: int, V: int, BT: int = 64) -> float:
    """Matmul flops of one chunked forward as these kernels do it (per chunk: KK^T, T solve ~ BT^3/3,
    W, U, W S, Q K^T, Q S, P Vn, K^T Vn)."""
    nc = B * HV * math.ceil(T / BT)
    per = 2 * (BT * BT * K) + (BT**3) / 3 * 2 + 2 * BT * BT * K + 2 * BT * BT * V
    per += 2 * BT * K * V + 2 * BT * BT * K + 2 * BT * K * V + 2 * BT * BT * V + 2 * BT * K * V
    return nc * per


__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule_update", "unsupported_reason",
           "gdn_chunk_fwd", "gdn_chunk_bwd",
           "gdn_decode", "flops_chunk_fwd", "triton"]
