"""Host side of the Triton Kimi Delta Attention kernels: forward (prefill / inference) and the decode step.

- `chunk_kda(q, k, v, g=, beta=, ...)`: same contract as `hybridlm.ops.kda` (g [B, T, HV, K] per-channel
  log-decay, float32); differentiable in q, k, v, g, beta and initial_state.
- `fused_recurrent_kda_update(q, k, v, g=, beta=, state_pool=, state_indices=, ...)`: one decode token for N
  sequences on a state pool, in place (g [N, HV, K]).

Custom ops (torch.library, with fake kernels): `hybridlm::kda_chunk_fwd`, `hybridlm::kda_chunk_bwd`,
`hybridlm::kda_decode`.
"""

from __future__ import annotations

import torch

from . import gdn
from . import gdn_kernels as kern
from . import kda_kernels as kk

# Launch plan (the GPU sweep, scripts/gpu_tune_kda.py, A/Bs these):
# variant: "kblock" walks the key channels in blocks of bk columns (prep as three launches: A/P and the tiles,
#   the UT solve, W/U; backward as two launches), "whole" holds [BT, K] tiles (one-launch prep; spills at K=128)
# bk: key-channel block of the "kblock" kernels (16, 32 or 64; at most K)
# split_o: the sequential kernel carries only the state and `_out_fwd` writes the output of every chunk at once
#   (Qg and P already carry the per-channel decay, so GDN's output kernel serves KDA unchanged)
# prep_warps / solve_warps / bwd_warps: num_warps of those launches; prep_lowp: 16-bit operands for T K and T V
# maxnreg: ptxas' register cap for the K-blocked A/P prep and both backward launches (None: free). Free, they take
#   244-255 registers at 8 warps (one program per SM, no spills); capped at 128, two programs share an SM at the
#   price of spills (sm_90, K=V=128 bf16: 280 / 536 / 584 B of stack at bk 32, 120 / 160 / 392 B at bk 16)
# diag_dot: the K-blocked kernels whose diagonal 16x16 blocks go by one masked dot where the decay allows
#   (`kda_kernels._diag_pass`: a dot launch, then an exact launch for the rest) instead of the exact per-column
#   loop of 16 gathered rows per key block: any of "prep", "bwd_out", "bwd_state". H100, B4 T4096 H16 D128 bf16,
#   per forward+backward (exact loop: 2026-11-24 01:27 profile; dot: 02:07): `_kda_bwd_out_blk` 3.74 -> 2.09 ms,
#   `_kda_bwd_state_blk` 6.60 -> 3.07, `_kda_prep_ap` 2.11 -> 2.04 (two launches; not worth it). With 16-bit
#   operands in the diagonal dot the state backward gave wrong bf16 gradients (02:05, 8-5240 relative); with fp32
#   operands (tf32 dots) its bf16 gradients equal the exact launch's to 3 digits (03:52, scripts/gpu_kda_state_dot.py)
# (the off-diagonal blocks' exponentials come from `kda_kernels._off_parts` once per key block in the prep and once
#   per decay product in the backward: 2 block-wise scans and 2 exponentials instead of 6 masked whole-tile scans
#   and 6 exponentials at BT 64. H100, B4 T4096 H16 D128 bf16: forward 3.213 -> 3.060 ms (06:11), forward+backward
#   on a fresh layer's gates 12.85 -> 12.06-12.18 ms (11:46-11:55, scripts/gpu_kda_bwd_factored.sh at commit
#   1b16668); the per-column-block form and its flags prep_factored / bwd_factored are gone since commit 0cbb129)
# whole_dot: the K-blocked kernels that take each chunk (and head) whose log-decays stay within e^60 of its middle
#   row in every channel (|b_i - b_m| <= 60: per-step decays averaging up to ~1.9 over half a chunk) as one masked
#   dot per [BT, BT] decay product and key block, as GDN's kernels do (a first launch, DIAG 3); the other chunks go
#   through the 16-row blocks (diag_dot's launch, then the exact one). Any of "prep", "bwd_out", "bwd_state".
#   H100, B4 T4096 H16 D128 bf16 (scripts/gpu_tune_kda.py --no-fla, 2026-11-24): in the prep only (06:59) forward
#   2.832 -> 1.772 ms, forward+backward 8.608 -> 7.625; in all three (07:11) forward+backward 7.553 -> 5.820, worst
#   bf16 error 4.81e-3 (dg) -> 3.56e-3 (o). Kernel bench at 07:16: forward 1.469 ms (fla 1.195), forward+backward
#   5.954 (fla 5.580)
# sub_dot: the K-blocked kernels whose chunks outside the diagonal-block dot's bound take their diagonal 16-row
#   blocks as two masked dots over 8-row halves where those allow (DIAG 4: log-decays up to ~15 a step; a launch
#   between diag_dot's and the exact one, which it brings with it) instead of the exact loop. Nsight Compute (H100,
#   2026-11-24 13:20, B4 T4096 H16 D128 bf16, a fresh layer's gates): the exact launches took 2.86 + 3.81 ms of the
#   backward's 9.0 ms, the diagonal-dot launches 0.81 + 0.95 for as many chunks. With sub_dot (13:53, same run,
#   scripts/gpu_tune_kda.py --no-fla --gates init): forward 2.785 -> 2.484-2.549 ms, forward+backward 10.120 ->
#   8.836-8.935 (-12%); on the bench's mild gates (no chunk gets there; the prep's two extra launches only read
#   marks) 6.067 -> 6.144 (13:45). The half-block launches still cost ~2x the diagonal-dot ones (ncu 13:40: 1.81 and
#   2.26 ms; sm_90 stack 360 / 120 B at 8 warps against 112 / 72)
# sub_bk: the key-channel block of the half-block launches alone (None: bk). sm_90 (scripts/compile_sm90.py, 8
#   warps, 2026-11-24): at 32 they spill 360 B (output backward) and 120 B (state backward) of stack, at 16 nothing;
#   keeping M's masked copies inside the key-block loop instead made it worse (552 / 216 B). Timed at 16 (H100,
#   2026-11-24 15:01, scripts/gpu_kda_sub_bk.sh, a fresh layer's gates): forward+backward 8.90-8.95 -> 9.54-9.62 ms
#   (+7%), so it stays None
TUNE = {"variant": "kblock", "bk": 32, "split_o": True, "prep_warps": 4, "solve_warps": 4, "bwd_warps": 8,
        "prep_lowp": False, "maxnreg": None, "diag_dot": ("bwd_out", "bwd_state"),
        "whole_dot": ("prep", "bwd_out", "bwd_state"), "sub_dot": ("prep", "bwd_out", "bwd_state"),
        "sub_bk": None, "solve_blocks": True, "state_warps": 4, "state_fp32": False, "prep_block_warps": None,
        "prep_centre": False}
# prep_block_warps: num_warps of the prep's block launches (DIAG 1, 4, 2; None: prep_warps). At 4 warps they take
#   255 registers and spill (sm_90: 96-128 B of stack), at 8 none (246-255 registers, 0 B), one program per SM
#   either way. H100, a fresh layer's gates, B4 T4096 H16 bf16 (2026-11-25 18:20): forward 2.357 / 2.314 ms at 4,
#   2.910 at 8 (`scripts/gpu_tune_kda.py --gates init`): the spills are not what the prep waits on
# prep_centre: the prep's block bounds about the midpoint of each block's log-decay range, as the backward's
#   (`kda_kernels._centred`), instead of its middle row. Same run: forward 2.404 ms against 2.357 / 2.314 (lost, as
#   centring the prep did at 2026-11-25 06:12)
# solve_blocks: the UT solve by [16, 16] blocks in registers (`gdn_kernels._solve_blocks`, one warp: the diagonal
#   blocks by doubling, the rest by block dots at gdn.TUNE kkt_prec / kkt_diag_prec for 16-bit inputs, IEEE for
#   fp32), GDN's `_kkt_solve` without its K K^T part, instead of `_kda_solve` (`_solve_ut`: row substitution, [16, BT]
#   ieee block rows, 194 us of a 5.74 ms forward+backward at B4 T4096 H16, 2026-11-24 10:48). Default since
#   2026-11-25 00:13 (H100, bf16, B4 T4096 H16, a fresh layer's gates, `kdasolve` step of scripts/gpu_call.sh,
#   off/on twice): forward 2.544 / 2.480 -> 2.387 / 2.357 ms, forward+backward 9.000 / 8.878 -> 8.791 / 8.747,
#   worst error dg 3.49e-3 -> 3.48e-3 (predicted ~-0.1 ms of the forward). The bench gates' rows of that step did
#   not run (its time went to compiling); the solve does not depend on the gates
# state_warps: num_warps of both state passes (GDN's `_recur_fwd` / `_recur_bwd` with CHANNEL); below 8 only where
#   the chunk loop runs at least gdn.TUNE fwd_stages times (`gdn._state_warps`: one-chunk loops are miscompiled at 4
#   warps). 4 by default since 2026-11-25 01:08 (H100, B4 T4096 H16 D128 bf16, `scripts/gpu_kda_four_warps.sh`,
#   8/4 twice): bench gates forward 1.658 / 1.640 -> 1.617 / 1.601 ms, forward+backward 5.992 / 6.047 -> 5.897 /
#   5.966; a fresh layer's gates 2.408 / 2.373 -> 2.327 / 2.338 and 8.924 / 8.828 -> 8.743 / 8.743; errors unchanged;
#   the KDA cases of the float64 check all pass at 4 warps
# state_fp32: with 16-bit inputs keep the chunk states and Kd in fp32 (and so the state gradients and dVn; every
#   backward dot then takes tf32 operands). Off by default: it costs ~20% (H100, B4 T4096 H16 D128 bf16, a fresh
#   layer's gates, 2026-11-25 03:05, scripts/gpu_kda_state_fp32.sh: forward 2.367 / 2.315 -> 2.843 / 2.763 ms,
#   forward+backward 8.851 / 8.628 -> 10.512 / 10.513). What it buys, on the check's strong-decay case (log-decays
#   uniform in [-30, 0) a step and channel, K64 V128 T300 bf16, 20 seeds, scripts/gpu_kda_tail.sh, 02:59 and
#   03:12): worst dbeta 8.65e-3 -> 3.56e-3, dg 6.85e-3 -> 5.41e-3 (bar 1e-2; that case has missed it at 1.15-1.19e-2
#   in two of the full checks); the chunk states alone in fp32: dbeta 7.42e-3, dg 5.39e-3. On the CPU in bf16
#   (scripts/interp_kda_tail.py, seed 117): dbeta 2.47e-2 -> 2.88e-3 (gdn.TUNE store_fp32, every intermediate in
#   fp32: 2.54e-3); in that script's earlier draw order (commit de5cc4e, seed 6) dg / dbeta 1.50e-2 / 1.15e-2 ->
#   8.81e-3 / 1.53e-3, dg's tail needing store_fp32 (7.96e-4 / 1.35e-3)
KERNELS = ("prep", "bwd_out", "bwd_state")  # the names diag_dot, whole_dot and sub_dot take


def _chunk_size(K: int, dtype: torch.dtype) -> int:
    """Chunk length: 64, but 32 for float32 inputs above K=128. sm_90 compile (compile_sm90.py, K=V=256 fp32, V block
    16): at 64 the sequential kernels need 228 KB of shared memory (the H100 allows 227 KB), at 32 118 KB. Fixed per
    (K, dtype), not found by trial, so the fake kernel's saved shapes match."""
    return 32 if K > 128 and dtype == torch.float32 else 64


def _state_dtype(sd: torch.dtype) -> torch.dtype:
    """Storage dtype of the chunk states and Kd: fp32 under TUNE state_fp32, else the other tiles' `sd`."""
    return torch.float32 if TUNE["state_fp32"] else sd


@torch.library.custom_op("hybridlm::kda_chunk_fwd", mutates_args=())
def kda_chunk_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None, scale: float, use_qk_l2norm: bool,
    output_final_state: bool, save: bool,
) -> list[torch.Tensor]:
    """Returns [o [B, T, HV, V], final_state [N, HV, K, V] fp32 or empty] and, when save, the intermediates of
    the backward: T, W, chunk states, Vn, Qg, Kd, P, b (per token), bL (per chunk)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    BT = _chunk_size(K, q.dtype)
    dev = q.device
    lay = gdn.layout(cu_seqlens, B, T, BT, dev)
    N, Ttot, nc = lay.N, lay.Ttot, lay.nc
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    f32 = torch.float32
    sd = gdn._store_dtype(q.dtype)
    NCb = gdn._max_chunks(Ttot, N, BT) if save else max(nc, 1)
    e = lambda *s, dt=sd: torch.empty(*s, device=dev, dtype=dt)  # noqa: E731
    Tb, Pb, BLb = e(NCb, HV, BT, BT, dt=f32), e(NCb, HV, BT, BT), e(NCb, HV, K, dt=f32)
    sdh = _state_dtype(sd)
    Wb, Ub, Qg, Kd = e(Ttot, HV, K), e(Ttot, HV, V), e(Ttot, HV, K), e(Ttot, HV, K, dt=sdh)
    # b per token: only the whole-K kernels keep it (the K-blocked ones recompute it from g)
    Bc = e(*_bc_shape(Ttot, HV, K), dt=f32)
    split = TUNE["split_o"]
    keep = save or split  # the chunk states and Vn go to memory
    hb = e(NCb, HV, K, V, dt=sdh) if keep else q.new_empty(0, dtype=sdh)
    vn = e(Ttot, HV, V) if keep else q.new_empty(0, dtype=sd)
    o = gdn._out((B, T, HV, V), q, q.dtype)
    ht = gdn._out((N, HV, K, V), q, f32) if output_final_state else q.new_empty(0, dtype=f32)
    prec = gdn._prec(q.dtype)
    if nc > 0:
        _prep(q, k, v, g, beta, Tb, Wb, Ub, Qg, Kd, Pb, Bc, BLb, lay, scale, use_qk_l2norm, prec, sd)
    h0 = initial_state.contiguous() if initial_state is not None else ht
    BV = gdn._recur_bv(K, V, N * HV, dev)
    kern._recur_fwd[(V // BV, N * HV)](
        BLb, Wb, Ub, Qg, Kd, Pb, o, h0, ht, hb, vn, lay.cu_t, lay.chunk_off, lay.nch, 1.0,
        H=H, HV=HV, K=K, V=V, BT=BT, BV=BV, PREC=prec,
        HAS_H0=initial_state is not None, STORE_HT=output_final_state, STORE=keep,
        LOWP=gdn.TUNE["fwd_lowp"] and sd != f32, CHANNEL=True,
        num_warps=gdn._state_warps("state_warps", K, dev, lay.nch, TUNE), num_stages=gdn.fwd_stages(),
        OUT=not split,
    )
    if split:
        gdn._output_pass(Qg, Pb, hb, vn, o, lay, HV, K, V, BT, prec, gdn.TUNE["fwd_lowp"] and sd != f32)
    if not save:
        return [o, ht]
    return [o, ht, Tb, Wb, hb, vn, Qg, Kd, Pb, Bc, BLb]


def _cap() -> dict:
    """The register-cap launch option (TUNE["maxnreg"]), when one is set."""
    return {"maxnreg": TUNE["maxnreg"]} if TUNE["maxnreg"] else {}


def _bc_shape(Ttot: int, HV: int, K: int) -> tuple[int, ...]:
    return (Ttot, HV, K) if TUNE["variant"] == "whole" else (0,)


def _diag_modes(kernel: str) -> tuple[int, ...]:
    """The DIAG launches of one K-blocked kernel (`kda_kernels._diag_pass`): 3 the whole chunk by dot, 1 its
    diagonal blocks by dot, 4 those by their 8-row halves' dots, 2 the rest exactly; (0,) all exactly in one
    launch."""
    for key in ("diag_dot", "whole_dot", "sub_dot"):
        unknown = set(TUNE[key]) - set(KERNELS)
        if unknown:
            raise ValueError(f"kda.TUNE[{key!r}]: expected names among {', '.join(KERNELS)}, got {sorted(unknown)}")
    sub = kernel in TUNE["sub_dot"]  # DIAG 4 reads the marks of a DIAG 1 launch, so it brings one
    modes = ((3,) if kernel in TUNE["whole_dot"] else ()) + ((1,) if kernel in TUNE["diag_dot"] or sub else ()) \
        + ((4,) if sub else ())
    return modes + (2,) if modes else (0,)


def _bwd_warps(dev: torch.device) -> int:
    """TUNE["bwd_warps"] of the K-blocked backward launches. Refused on CUDA below 8: at 4 warps compute-sanitizer
    (H100, Triton 3.6, 2026-11-24) shows `_kda_bwd_out_blk` reading shared memory out of bounds (1 KB at 116 KB, in
    a reduction), then infinite gradients or an illegal memory access."""
    w = TUNE["bwd_warps"]
    if dev.type == "cuda" and w < 8:
        raise ValueError(f"kda.TUNE['bwd_warps']: expected 8 or more on CUDA (4 reads shared memory out of bounds in "
                         f"_kda_bwd_out_blk on sm_90), got {w}")
    return w


def _redo(nc: int, HV: int, dev: torch.device) -> torch.Tensor:
    """The int32 [chunks, HV] marks that pass chunks from a K-blocked kernel's dot launch to its exact launch
    (`kda_kernels._diag_pass`); the dot launch writes every entry."""
    return torch.empty(max(nc, 1), HV, device=dev, dtype=torch.int32)


def _bk(K: int, mode: int | None = None) -> int:
    """The key-channel block of a K-blocked launch: TUNE["sub_bk"] for the half-block launches (DIAG 4) when set,
    else TUNE["bk"]. The marks do not depend on it (the bounds are per chunk, over every key block)."""
    if mode == 4 and TUNE["sub_bk"] is not None:
        return gdn.key_block(TUNE, "sub_bk", K)
    return gdn.key_block(TUNE, "bk", K)


def _prep(q, k, v, g, beta, Tb, Wb, Ub, Qg, Kd, Pb, Bc, BLb, lay, scale: float, l2: bool, prec: str,
          sd: torch.dtype) -> None:
    """Everything of each chunk that does not depend on the state (T, W, U, Qg, Kd, P, b, bL)."""
    H, K, HV, V = q.shape[2], q.shape[3], v.shape[2], v.shape[3]
    BT = Tb.shape[-1]
    grid = (lay.nc, HV)
    chunks = (lay.cu_t, lay.chunk_seq, lay.chunk_start)
    if TUNE["variant"] == "whole":
        kk._kda_prep_fwd[grid](
            q, k, v, g, beta, Tb, Wb, Ub, Qg, Kd, Pb, Bc, BLb, *chunks, scale,
            H=H, HV=HV, K=K, V=V, BT=BT, BV=min(V, 64), L2=l2, PREC=prec, num_warps=8, num_stages=1,
        )
        return
    BK = _bk(K)
    redo = _redo(lay.nc, HV, q.device)
    modes = _diag_modes("prep")  # the whole chunk by dot where the decay allows, ...; the rest exactly
    for mode in modes:
        warps = TUNE["prep_warps"] if mode == 3 or TUNE["prep_block_warps"] is None else TUNE["prep_block_warps"]
        kk._kda_prep_ap[grid](q, k, g, beta, Tb, Qg, Kd, Pb, BLb, redo, *chunks, scale, H=H, HV=HV, K=K, BT=BT,
                              BK=_bk(K, mode), L2=l2, PREC=prec, DIAG=mode, WHOLE=3 in modes,
                              CENTRE=TUNE["prep_centre"], num_warps=warps, num_stages=1, **_cap())
    if TUNE["solve_blocks"]:
        dp, sp = gdn.block_solve_precs(q.dtype)
        kern._solve_blocks[grid](Tb, HV, BT=BT, DPREC=dp, SPREC=sp, num_warps=1, num_stages=1)
    else:
        kk._kda_solve[grid](Tb, HV, BT=BT, INTERLEAVE=gdn.TUNE["solve_interleave"], num_warps=TUNE["solve_warps"],
                            num_stages=1)
    kk._kda_prep_wu[grid](k, v, g, beta, Tb, Wb, Ub, *chunks, H=H, HV=HV, K=K, V=V, BT=BT, BK=BK, BV=min(V, 64),
                          L2=l2, PREC=prec, LOWP=TUNE["prep_lowp"] and sd != torch.float32,
                          num_warps=TUNE["prep_warps"], num_stages=1)


@kda_chunk_fwd.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm, output_final_state, save):
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    f32 = torch.float32
    ht = q.new_empty(N, HV, K, V, dtype=f32) if output_final_state else q.new_empty(0, dtype=f32)
    out = [q.new_empty(B, T, HV, V), ht]
    if save:
        BT, sd, Tt = _chunk_size(K, q.dtype), gdn._store_dtype(q.dtype), B * T
        NC = gdn._max_chunks(Tt, N, BT)
        out += [q.new_empty(NC, HV, BT, BT, dtype=f32), q.new_empty(Tt, HV, K, dtype=sd),
                q.new_empty(NC, HV, K, V, dtype=_state_dtype(sd)), q.new_empty(Tt, HV, V, dtype=sd),
                q.new_empty(Tt, HV, K, dtype=sd), q.new_empty(Tt, HV, K, dtype=_state_dtype(sd)),
                q.new_empty(NC, HV, BT, BT, dtype=sd), q.new_empty(*_bc_shape(Tt, HV, K), dtype=f32),
                q.new_empty(NC, HV, K, dtype=f32)]
    return out


@torch.library.custom_op("hybridlm::kda_chunk_bwd", mutates_args=())
def kda_chunk_bwd(
    do: torch.Tensor, dht: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    g: torch.Tensor, beta: torch.Tensor, saved: list[torch.Tensor], cu_seqlens: torch.Tensor | None, scale: float,
    use_qk_l2norm: bool, has_h0: bool,
) -> list[torch.Tensor]:
    """Returns [dq, dk, dv, dg, dbeta, dinitial_state or empty]."""
    return _bwd_impl(do, dht, q, k, v, g, beta, list(saved), cu_seqlens, scale, use_qk_l2norm, has_h0)


@torch.library.custom_op("hybridlm::kda_chunk_bwd_rc", mutates_args=())
def kda_chunk_bwd_rc(
    do: torch.Tensor, dht: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    g: torch.Tensor, beta: torch.Tensor, cu_seqlens: torch.Tensor | None, scale: float, use_qk_l2norm: bool,
    has_h0: bool, h0: torch.Tensor | None,
) -> list[torch.Tensor]:
    """kda_chunk_bwd for recompute=True: reruns the forward inside, so that W, Qg, Kd and P are freed before the
    chunk backward's own buffers exist."""
    saved = kda_chunk_fwd(q, k, v, g, beta, h0, cu_seqlens, scale, use_qk_l2norm, False, True)[2:]
    return _bwd_impl(do, dht, q, k, v, g, beta, saved, cu_seqlens, scale, use_qk_l2norm, has_h0)


def _bwd_impl(do, dht, q, k, v, g, beta, saved: list[torch.Tensor | None], cu_seqlens, scale: float,
              use_qk_l2norm: bool, has_h0: bool) -> list[torch.Tensor]:
    """saved: the forward's [T, W, h, Vn, Qg, Kd, P, b, bL]; W, Qg, Kd and P serve only the state recurrence's
    backward, so their entries are cleared after its launch (freed when the list holds the only references)."""
    Tb, Wb, hb, vn, Qg, Kd, Pb, Bc, BLb = saved
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    BT = Tb.shape[-1]
    dev = q.device
    lay = gdn.layout(cu_seqlens, B, T, BT, dev)
    N, Ttot, nc = lay.N, lay.Ttot, lay.nc
    q, k, v, g, beta, do = (x.contiguous() for x in (q, k, v, g, beta, do))
    f32 = torch.float32
    prec = gdn._prec(q.dtype)
    dhb = torch.empty_like(hb)
    dvn = torch.empty(Ttot, HV, V, device=dev, dtype=hb.dtype)
    lowp = gdn.bwd_lowp(hb)
    BV = gdn._recur_bv(K, V, N * HV, dev, "rbwd_bv", per_sm=1)
    dh0 = gdn._out((N, HV, K, V), q, f32) if has_h0 else q.new_empty(0, dtype=f32)
    kern._recur_bwd[(V // BV, N * HV)](
        BLb, Wb, Qg, Kd, Pb, do, dht if dht is not None else dvn, dh0, dhb, dvn, lay.cu_t, lay.chunk_off,
        lay.nch, H=H, HV=HV, K=K, V=V, BT=BT, BV=BV, PREC=prec,
        HAS_DHT=dht is not None, STORE_DH0=has_h0, LOWP=lowp, CHANNEL=True,
        num_warps=gdn._state_warps("state_warps", K, dev, lay.nch, TUNE), num_stages=gdn.fwd_stages(),
    )
    saved[1] = saved[4] = saved[5] = saved[6] = Wb = Qg = Kd = Pb = None
    dq, dk, dg = (gdn._out((Ttot, HV, K), q, f32) for _ in range(3))
    # dv is written once per chunk (one launch of the diagonal modes takes each chunk), so in the input dtype: no
    # fp32 copy and no cast kernel after (GDN's backward does the same)
    dv = gdn._out((B, T, HV, V), q, v.dtype)
    db = gdn._out((B, T, HV), q, f32)
    chunks = (lay.cu_t, lay.chunk_seq, lay.chunk_start)
    if nc > 0 and TUNE["variant"] == "whole":
        for phase in (1, 2):  # two launches: each kernel holds half the live tiles
            kk._kda_chunk_bwd[(nc, HV)](
                q, k, v, g, beta, Tb, Bc, BLb, hb, dhb, vn, dvn, do, dq, dk, dv, dg, db, *chunks, scale,
                H=H, HV=HV, K=K, V=V, BT=BT, BV=min(V, 64), L2=use_qk_l2norm, PREC=prec, LOWP=lowp, PHASE=phase,
                num_warps=8, num_stages=1,
            )
    elif nc > 0:
        bw = _bwd_warps(dev)
        redo = _redo(nc, HV, dev)
        out_modes, state_modes = _diag_modes("bwd_out"), _diag_modes("bwd_state")  # as in the prep
        for mode in out_modes:
            kk._kda_bwd_out_blk[(nc, HV)](
                q, k, g, hb, vn, do, dq, dk, dg, redo, *chunks, scale, H=H, HV=HV, K=K, V=V, BT=BT, BK=_bk(K, mode),
                BV=min(V, 64), L2=use_qk_l2norm, PREC=prec, LOWP=lowp, DIAG=mode, WHOLE=3 in out_modes,
                num_warps=bw, num_stages=1, **_cap(),
            )
        # the same launches as the output backward's have written redo's marks (same g, same key blocks): the state
        # backward reads them instead of recomputing them
        marked = state_modes == out_modes and state_modes != (0,)
        for mode in state_modes:
            kk._kda_bwd_state_blk[(nc, HV)](
                k, v, g, beta, Tb, BLb, hb, dhb, vn, dvn, dk, dv, dg, db, redo, *chunks, H=H, HV=HV, K=K, V=V,
                BT=BT, BK=_bk(K, mode), BV=min(V, 64), L2=use_qk_l2norm, PREC=prec, LOWP=lowp, DIAG=mode, MARKED=marked,
                WHOLE=3 in state_modes, num_warps=bw, num_stages=1, **_cap(),
            )
    del dhb, dvn  # read: freed before the GVA sums and casts, as in the GDN backward
    return [gdn.gva_sum(dq, B, T, H, q.dtype), gdn.gva_sum(dk, B, T, H, k.dtype), dv,
            dg.view(B, T, HV, K), db.to(beta.dtype), dh0]


@kda_chunk_bwd.register_fake
def _(do, dht, q, k, v, g, beta, saved, cu_seqlens, scale, use_qk_l2norm, has_h0):
    return _bwd_fake(q, k, v, beta, cu_seqlens, has_h0)


@kda_chunk_bwd_rc.register_fake
def _(do, dht, q, k, v, g, beta, cu_seqlens, scale, use_qk_l2norm, has_h0, h0):
    return _bwd_fake(q, k, v, beta, cu_seqlens, has_h0)


def _bwd_fake(q, k, v, beta, cu_seqlens, has_h0):
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    dh0 = q.new_empty(N, HV, K, V, dtype=torch.float32) if has_h0 else q.new_empty(0, dtype=torch.float32)
    return [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), q.new_empty(B, T, HV, K,
            dtype=torch.float32), torch.empty_like(beta), dh0]


class _ChunkKDA(torch.autograd.Function):
    """recompute: keep only the inputs (and the initial state) for the backward and rerun the forward kernels
    there, as `gdn._ChunkGDN` does."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm, output_final_state,
                recompute):
        grad = any(ctx.needs_input_grad[:6])
        o, ht, *saved = torch.ops.hybridlm.kda_chunk_fwd(q, k, v, g, beta, initial_state, cu_seqlens, scale,
                                                         use_qk_l2norm, output_final_state, grad and not recompute)
        ctx.recompute = grad and recompute
        ctx.save_for_backward(q, k, v, g, beta, cu_seqlens, initial_state, *([] if ctx.recompute else saved))
        ctx.scale, ctx.l2, ctx.has_h0, ctx.g_dtype = scale, use_qk_l2norm, initial_state is not None, g.dtype
        if not output_final_state:
            ctx.mark_non_differentiable(ht)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, cu, h0, *saved = ctx.saved_tensors
        if dht is not None and dht.numel() == 0:
            dht = None
        if ctx.recompute:
            dq, dk, dv, dg, db, dh0 = torch.ops.hybridlm.kda_chunk_bwd_rc(do, dht, q, k, v, g, beta, cu, ctx.scale,
                                                                          ctx.l2, ctx.has_h0, h0)
        else:
            dq, dk, dv, dg, db, dh0 = torch.ops.hybridlm.kda_chunk_bwd(do, dht, q, k, v, g, beta, saved, cu,
                                                                       ctx.scale, ctx.l2, ctx.has_h0)
        return dq, dk, dv, dg.to(ctx.g_dtype), db, (dh0 if ctx.has_h0 else None), None, None, None, None, None


def unsupported_reason(q: torch.Tensor, v: torch.Tensor) -> str | None:
    """None when the KDA kernels take these inputs, else why not."""
    return gdn.unsupported_reason(q, v)


def chunk_kda(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, g: torch.Tensor, beta: torch.Tensor,
    scale: float | None = None, initial_state: torch.Tensor | None = None, output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None, use_qk_l2norm: bool = False, recompute: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA forward on the Triton kernels. Shapes as `hybridlm.ops.kda` (g: [B, T, HV, K]); recompute: keep
    only the inputs for the backward and rerun the forward kernels there."""
    K, V = q.shape[-1], v.shape[-1]
    gdn._check_dims(K, V)
    gdn._check_device(q)
    if q.dtype == torch.float64:
        raise TypeError("q: the Triton kernels take float16/bfloat16/float32 inputs, got float64")
    if g.dtype != torch.float32:
        raise TypeError(f"g: the KDA kernels take float32 log-decays, got {g.dtype}")
    if initial_state is not None and initial_state.dtype != torch.float32:
        raise TypeError(f"initial_state: expected dtype torch.float32 for {q.dtype} inputs, got {initial_state.dtype}")
    scale = K**-0.5 if scale is None else float(scale)
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(torch.int32)
    # contiguous copies of views made here, before autograd saves them, so the backward does not copy them again
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    o, ht = _ChunkKDA.apply(q, k, v, g, beta, initial_state, cu_seqlens, scale, bool(use_qk_l2norm),
                            bool(output_final_state), bool(recompute))
    return o, (ht if output_final_state else None)


@torch.library.custom_op("hybridlm::kda_decode", mutates_args=("state_pool",))
def kda_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state_pool: torch.Tensor, state_indices: torch.Tensor, scale: float, use_qk_l2norm: bool,
) -> torch.Tensor:
    N, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    BV = 32 if K <= 128 else 16
    o = gdn._out((N, HV, V), q, q.dtype)
    if N > 0:
        kern._decode_step[(V // BV, N * HV)](
            q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(), state_pool,
            state_indices, o, scale, H=H, HV=HV, K=K, V=V, BV=BV, L2=use_qk_l2norm, CHANNEL=True, num_warps=4,
        )
    return o


@kda_decode.register_fake
def _(q, k, v, g, beta, state_pool, state_indices, scale, use_qk_l2norm):
    return q.new_empty(q.shape[0], v.shape[1], v.shape[2])


def fused_recurrent_kda_update(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, g: torch.Tensor, beta: torch.Tensor,
    state_pool: torch.Tensor, state_indices: torch.Tensor, scale: float | None = None, use_qk_l2norm: bool = False,
) -> torch.Tensor:
    """One KDA decode step for N sequences: q, k [N, H, K]; v [N, HV, V]; g [N, HV, K] (float32); beta [N, HV];
    state_pool fp32 [P, HV, K, V] updated in place at rows state_indices. Returns o [N, HV, V]."""
    K = gdn._check_decode_inputs(q, k, v, g, beta, state_pool, state_indices, channel=True)
    scale = K**-0.5 if scale is None else float(scale)
    return torch.ops.hybridlm.kda_decode(q, k, v, g, beta, state_pool, state_indices.contiguous(), scale,
                                         bool(use_qk_l2norm))


__all__ = ["chunk_kda", "fused_recurrent_kda_update", "kda_chunk_fwd", "kda_chunk_bwd", "kda_decode",
           "unsupported_reason"]
