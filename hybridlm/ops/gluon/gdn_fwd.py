"""Gated DeltaNet forward for Hopper (sm_90) in Gluon: a parallel T solve, then one state chain per head and value
block. What `impl="auto"` runs for inference on sm_90 (bf16/fp16, K 64 or 128, V 64 to 256); `training_forward` is
the same pair of launches also writing what the Triton backward reads.

Two launches: `solve._gdn_solve_kernel` (every chunk of every head at once: T diag(beta) in the inputs' 16-bit dtype,
and the per-token gate rows) and `chain._gdn_chain_kernel` (one program per value block of 64 and sequence x value head,
the state in registers for the whole sequence, the output products in a second warpgroup). The math of each is in
its file's docstring; measured times and what was tried are in docs/kernels.md ("Fused forward in Gluon").
Non-standard: where the chain's programs would leave half the multiprocessors idle (a few long sequences), the solve
runs beside the chain instead of before it: the chain on a high-priority stream, waiting chunk by chunk for flags
the solve sets (`_overlaps`, `_beside`).
The host path is cut to what a call must do: what a call signature fixes (grids, constexprs, and after the first
launch each kernel's C launcher and the chain's tensor-map layout) is worked out once (`_Plan`); later calls launch
directly with cached TMA tensor maps (`launch.py`), and launch the solve before allocating o.
Other head dims and fp32 inputs are refused here (`unsupported_reason`; the dispatch then keeps the Triton
kernels).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple

import torch
import triton

from ..launch import TmaSpec, aligned, current_stream, direct_launch, direct_ok, tensor_map
from ..offsets import host_offsets
from ..validate import Dims, check_state_pool
from .chain import _descriptors, _tma_desc
from .parts import _IMPORT_ERROR, gluon_available
from .solve import GATE_ROWS

if _IMPORT_ERROR is None:  # the kernels, named here for the callers and the compile test
    from .chain import _gdn_chain_kernel, _gdn_chain_train_kernel  # noqa: F401
    from .solve import _gdn_solve_kernel, _gdn_solve_train_kernel  # noqa: F401

CHUNK = 64  # tokens per chunk (four 16-row blocks of the solve)
BV = 64  # value block of a chain program: one warpgroup's M (the transposed state's rows)
NUM_WARPS = 4  # one warpgroup (the chain's output partition adds another)
SOLVE_REGS = 128  # registers a solve thread (fp16 products): four programs a multiprocessor, no spills
POISON = False  # tests set it: outputs start as NaN, so an element the kernel never writes fails the check
# the state S^T [64, K] fp32 lives in registers (K = 256 would need twice what a thread has); V only sets the number
# of value blocks
SUPPORTED_K = (64, 128)
SUPPORTED_V = (64, 128, 256)


def unsupported_reason(q: torch.Tensor, v: torch.Tensor) -> str | None:
    """None when `gated_delta_rule_fwd` takes inputs like q [B, T, H, K] and v [B, T, HV, V] on this machine, else
    why not, in one line naming what was expected (the dispatch logs it once and falls back to the Triton kernels;
    `gated_delta_rule_fwd` raises it)."""
    if not gluon_available():
        return f"triton: expected the Gluon API of Triton 3.6, got Triton {triton.__version__}"
    if not q.is_cuda:
        return f"q: expected a CUDA tensor, got device {q.device}"
    cap = _capability(q.device.index)
    if cap != (9, 0):
        return f"q: expected a device of compute capability (9, 0) (Hopper), got {cap}"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"q: expected dtype bfloat16 or float16, got {q.dtype}"
    K, V = q.shape[-1], v.shape[-1]
    if K not in SUPPORTED_K or V not in SUPPORTED_V:
        return f"q, v: expected head dims K in {SUPPORTED_K} and V in {SUPPORTED_V}, got K={K} V={V}"
    return None


@functools.lru_cache(maxsize=16)
def _capability(index: int | None) -> tuple[int, int]:
    """torch.cuda.get_device_capability, once per device (a few microseconds a call otherwise)."""
    return torch.cuda.get_device_capability(index)


def _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, *, channel: bool = False) -> None:
    """One-line ValueErrors for what the Gluon forward does not take. channel: g is KDA's [B, T, HV, K] (one
    log-decay a key channel), else GDN's [B, T, HV]."""
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k: expected equal shapes [B, T, H, K], got {tuple(q.shape)} and {tuple(k.shape)}")
    B, T, H, K = q.shape
    if v.dim() != 4 or v.shape[:2] != (B, T):
        raise ValueError(f"v: expected [B, T, HV, V] = [{B}, {T}, HV, V], got {tuple(v.shape)}")
    HV, V = v.shape[2:]
    if HV % H:
        raise ValueError(f"v: expected its heads HV a multiple of q's H = {H}, got HV = {HV}")
    why = unsupported_reason(q, v)
    if why is not None:
        raise ValueError(why)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v: expected one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    g_dims = ("[B, T, HV, K]", (B, T, HV, K)) if channel else ("[B, T, HV]", (B, T, HV))
    for name, x, (names, want) in (("g", g, g_dims), ("beta", beta, ("[B, T, HV]", (B, T, HV)))):
        if x is None or tuple(x.shape) != want:
            raise ValueError(f"{name}: expected {names} = [{', '.join(map(str, want))}], got "
                             f"{None if x is None else tuple(x.shape)}")
    if cu_seqlens is not None and B != 1:
        raise ValueError(f"cu_seqlens: expected B = 1 (sequences packed along T), got B = {B}")
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    if initial_state is not None and tuple(initial_state.shape) != (N, HV, K, V):
        raise ValueError(f"initial_state: expected [N, HV, K, V] = [{N}, {HV}, {K}, {V}], "
                         f"got {tuple(initial_state.shape)}")


def _check_pool(q, v, state_pool, state_indices, initial_state, cu_seqlens) -> bool:
    """True when a state pool is given (and well formed); see `hybridlm.ops.validate.check_state_pool`."""
    if state_pool is None and state_indices is None:
        return False
    B, T, H, K = q.shape
    HV, V = v.shape[2:]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    check_state_pool(state_pool, state_indices, initial_state=initial_state,
                     dims=Dims(B=B, T=T, H=H, HV=HV, K=K, V=V, N=N), dtype=torch.float32, device=q.device)
    if not state_pool.is_contiguous():
        raise ValueError("state_pool: expected a contiguous tensor (the kernel updates its rows in place)")
    return True


@functools.lru_cache(maxsize=64)
def _equal_offsets(B: int, T: int, most: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token and chunk offsets [B + 1] (int32) of B sequences of T tokens, `most` chunks each; cached, so a call at a
    shape seen before launches no kernel for them (the kernels only read them)."""
    cu = torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=dev)
    return cu, torch.arange(0, (B + 1) * most, most, dtype=torch.int32, device=dev)


def gated_delta_rule_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm: bool = False,
    state_pool: torch.Tensor | None = None,
    state_indices: torch.Tensor | None = None,
    checked: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule forward in two launches, T solve then state chain (Hopper only; no autograd).

    q, k: [B, T, H, K]; v: [B, T, HV, V] with HV a multiple of H (value head hv reads key head hv // (HV // H));
    g (log-decay), beta: [B, T, HV]; initial_state: [N, HV, K, V] (N = B, or len(cu_seqlens) - 1 with B = 1);
    cu_seqlens: [N + 1] token offsets of packed sequences. Returns o [B, T, HV, V] in q's dtype and the final
    state [N, HV, K, V] in fp32 (None unless output_final_state). state_pool [P, HV, K, V] fp32 and state_indices
    [N] (instead of initial_state): sequence n starts from pool row state_indices[n], and the kernel writes its
    final state back to that row in place (chunked prefill; rows distinct and in range, not checked). Same
    contract as `hybridlm.ops.gated_delta_rule` for these arguments. checked: the caller has validated all this
    (`hybridlm.ops.dispatch`: the shapes, `unsupported_reason`, the pool, which must then be contiguous).
    """
    call = _Call(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm, state_pool,
                 state_indices, checked)
    call.forward()
    if state_pool is not None and output_final_state:
        return call.o, state_pool.index_select(0, state_indices.long())
    return call.o, None if call.pool else call.ht


def training_forward(q, k, v, g, beta, scale: float, initial_state, output_final_state: bool, cu_seqlens,
                     use_qk_l2norm: bool, saved: tuple) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The forward that keeps what the Triton backward reads (`triton.gdn._fwd_impl` with save, on sm_90 where
    `train_reason` finds nothing): the solve also writes the plain T, W / m and the backward chain's gate rows, the
    chain each chunk's initial state, V' and P. saved = (Tb [NC, HV, C, C], Wb [Ttot, HV, K], hb [NC, HV, K, V],
    vn [Ttot, HV, V], Pb [NC, HV, C, C]) in q's dtype and Gb [NC, HV, 4, C] fp32, allocated by the caller in the
    Triton forward's layouts (chunk slot = global chunk x HV + value head); written here. Inputs as
    `gated_delta_rule_fwd`'s, already checked. Returns (o, ht or None). Both launches go through the JIT; where the
    chain's programs leave half the multiprocessors idle, the solve runs beside the chain as in the inference
    forward (`_overlaps`, `_beside`)."""
    call = _Call(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm, None, None,
                 True)
    call.outputs()
    p = call.plan
    Tbuf, Gbuf = call.buffers()
    Tb, Wb, hb, vn, Pb, Gb = saved
    K, V = q.shape[-1], v.shape[-1]
    l2 = bool(use_qk_l2norm)
    solve_args = (call.q, call.k, call.g, call.beta, Tbuf, Gbuf, Tb, Wb, Gb, call.cu, call.chunk_off, call.flags,
                  call.scale, call.H, call.HV, K, CHUNK, GATE_ROWS, l2, p.overlap)
    o = call.o
    descs = _descriptors(call.q, call.k, call.v, o, Tbuf, Gbuf, BV)
    h0 = call.h0 if call.h0 is not None else o  # never read without HAS_H0
    ht = call.ht if call.ht is not None else o  # never written without STORE_HT
    save_descs = (_tma_desc(hb.reshape(-1, V), K, BV), _tma_desc(vn.reshape(-1, vn.shape[-2] * V), CHUNK, BV))

    def solve() -> None:
        if p.solve_grid[1] > 0:
            _gdn_solve_train_kernel[p.solve_grid](*solve_args, num_warps=NUM_WARPS)

    def chain(side: _Side | None = None) -> None:
        with contextlib.nullcontext() if side is None else torch.cuda.stream(side.stream):
            _gdn_chain_train_kernel[p.chain_grid](*descs, *save_descs, o, h0, ht, vn, Pb, call.cu, call.chunk_off,
                                                  call.flags, call.H, call.HV, K, V, BV, CHUNK, GATE_ROWS,
                                                  call.h0 is not None, call.store_ht, p.overlap, num_warps=NUM_WARPS)

    if p.overlap:  # the solve's kernel loaded before the chain waits on it (`_Call._load_solve`); every call, since
        # another specialization of the same plan (an alignment) would be another kernel, loaded at its launch
        _gdn_solve_train_kernel.warmup(*solve_args, grid=p.solve_grid, num_warps=NUM_WARPS)._init_handles()
        _beside(solve, chain, call.dev)
    else:
        solve()
        chain()
    return o, call.ht


def train_reason(q: torch.Tensor, v: torch.Tensor, N: int, BT: int) -> str | None:
    """None when `training_forward` takes a training forward of q [B, T, H, K], v [B, T, HV, V] over N sequences
    with chunks of BT, else why not (one line): the inference forward's rule, chunks of 64, and chain programs
    (value blocks x sequences x value heads) on at least a quarter of the multiprocessors: with fewer, the serial
    chain leaves the GPU idle and the Triton forward's parallel launches are faster (16 programs, one sequence of
    the 357M model, lost; 64 of 132, B1 T32768 H32, the inference chain runs at 2.5x the Triton forward:
    docs/kernels.md)."""
    why = unsupported_reason(q, v)
    if why is not None:
        return why
    if BT != CHUNK:
        return f"BT: expected chunks of {CHUNK} tokens, got {BT}"
    programs = (v.shape[-1] // BV) * N * v.shape[2]
    least = -(-_multiprocessors(q.device) // 4)
    if programs < least:
        return (f"v: expected at least {least} chain programs (value blocks x sequences x value heads: a quarter of "
                f"the multiprocessors), got {programs}")
    return None


class Launches(NamedTuple):
    """The forward's launches, bound to their buffers: `run()` is the forward; `solve()` writes T and the gate rows
    of every chunk and `chain()` reads them and writes o (and ht), each alone (timing; the chain needs the solve's
    output; the chain of an overlapped forward needs the solve to have run once). `overlapped`: the solve runs
    beside the chain (`_overlaps`)."""

    run: Callable[[], None]
    solve: Callable[[], None]
    chain: Callable[[], None]
    o: torch.Tensor
    ht: torch.Tensor | None
    buffers: tuple[torch.Tensor, torch.Tensor]  # (T, gate rows): what the solve writes and the chain reads
    programs: tuple[int, int]  # (solve, chain)
    overlapped: bool  # run() launches the solve beside the chain, which waits on it chunk by chunk


def forward_launches(q, k, v, *, g, beta, scale=None, initial_state=None, output_final_state=False,
                     cu_seqlens=None, use_qk_l2norm=False, state_pool=None, state_indices=None,
                     checked=False) -> Launches:
    """Check the inputs of `gated_delta_rule_fwd` (same arguments; not when `checked`), allocate o, ht and the
    solve's buffers and bind the launches without running them."""
    call = _Call(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm, state_pool,
                 state_indices, checked)
    call.outputs()
    p = call.plan
    # with a pool the final states are its rows (gated_delta_rule_fwd copies them out when asked)
    return Launches(call.forward, call.solve, call.chain, call.o, None if call.pool else call.ht,
                    call.buffers(), (p.solve_grid[0] * p.solve_grid[1], p.chain_grid[0] * p.chain_grid[1]),
                    p.overlap)


# ------------------------------------------------------------------------------------------------- the host path
# What a call signature fixes is worked out once (`_Plan`, cached in `_PLANS`); a call then allocates its buffers
# and launches. Each kernel's first launch of a plan goes through the JIT, which compiles it and returns the
# CompiledKernel; later launches go through its C launcher directly (`launch.direct_launch`), with the chain's TMA
# tensor maps from `launch.tensor_map`. A call takes the direct launches only where the JIT's launch would be the
# same: no Triton hooks or debug mode (`launch.jit_is_plain`), the inputs on the current device, every pointer
# 16-byte aligned (the JIT specialises on it; the plan's kernels were compiled for aligned pointers); any other call
# launches through the JIT as before.

MAX_PLANS = 64  # call signatures kept (a model's layers share a few; a server's batch shapes vary)


class _Plan:
    """What one call signature (`_Call.key`) fixes: grids, constexprs and options of both kernels, whether the
    solve runs beside the chain; once each kernel was launched through the JIT from an aligned call, its direct
    launch (False: this Triton's launcher is not the one `launch.direct_launch` knows) and the chain's tensor-map
    specs."""

    __slots__ = ("solve_grid", "chain_grid", "solve_consts", "solve_opts", "chain_consts", "overlap", "solve",
                 "chain", "specs")

    def __init__(self, *, N, HV, K, V, most, l2, overlap, has_h0, store_ht, pool):
        self.solve_grid = (N * HV, most, 1)
        self.chain_grid = (V // BV, N * HV, 1)
        self.solve_consts = (K, CHUNK, GATE_ROWS, l2, overlap)  # K, C, R, L2, FLAG
        self.solve_opts = dict(num_warps=NUM_WARPS, maxnreg=SOLVE_REGS if l2 else None)
        self.chain_consts = (K, V, BV, CHUNK, GATE_ROWS, has_h0, store_ht, pool, overlap)  # ... POOL, WAIT
        self.overlap = overlap
        self.solve = self.chain = self.specs = None


_PLANS: OrderedDict = OrderedDict()


def cached_plan(plans: OrderedDict, key: tuple, make: Callable[[], object]):
    """plans[key], made by make() at its first use; plans keeps the MAX_PLANS most recently used (the Gluon
    backward's host path keeps its plans the same way)."""
    plan = plans.get(key)
    if plan is None:
        plan = plans[key] = make()
        if len(plans) > MAX_PLANS:
            plans.popitem(last=False)
    else:
        plans.move_to_end(key)
    return plan


class _Call:
    """One forward: the inputs made contiguous, the solve's buffers, then o and ht (`outputs`), and the launches.
    `forward` launches the solve before it allocates o (so the GPU starts on the solve while the host prepares the
    chain), or with the overlapped form the chain first on its own stream."""

    __slots__ = ("plan", "dev", "direct", "pool", "q", "k", "v", "g", "beta", "scale", "H", "HV", "cu", "chunk_off",
                 "flags", "h0", "rows", "work", "slots", "Tbuf", "Gbuf", "o", "ht", "store_ht", "descs_shape", "ptrs")

    def __init__(self, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm,
                 state_pool, state_indices, checked):
        if checked:
            pool = state_pool is not None
        else:
            _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
            pool = _check_pool(q, v, state_pool, state_indices, initial_state, cu_seqlens)
        B, T, H, K = q.shape
        HV, V = v.shape[2], v.shape[3]
        dev = q.device
        if cu_seqlens is None:  # equal lengths: the chunk offsets follow without reading anything back
            most = -(-T // CHUNK)
            cu, chunk_off = _equal_offsets(B, T, most, dev)
            N, total = B, B * most
        else:
            cu = cu_seqlens.to(device=dev, dtype=torch.int32)
            # the grid needs the longest sequence: the host copy the dispatch recorded (else one sync, recorded)
            host = host_offsets(cu)
            nch = [-(-(b - a) // CHUNK) for a, b in zip(host, host[1:])]
            most, total = max(nch, default=0), sum(nch)
            # the chunk offsets from the host: one copy (no device sync: pageable memory is staged at once)
            chunk_off = torch.tensor([0, *itertools.accumulate(nch)], dtype=torch.int32).to(dev, non_blocking=True)
            N = len(host) - 1
        self.q, self.k, self.v = q.contiguous(), k.contiguous(), v.contiguous()
        self.g, self.beta = g.contiguous(), beta.contiguous()
        if pool:  # the kernel reads and writes the pool's rows; ht (if asked) is a copy of them afterwards
            self.h0 = self.ht = state_pool
            self.rows = state_indices.to(torch.int32).contiguous()
            self.store_ht = True
        else:
            self.h0 = initial_state.to(torch.float32).contiguous() if initial_state is not None else None
            self.ht = None
            self.rows = cu  # never read: POOL is compiled out
            self.store_ht = bool(output_final_state)
        self.pool, self.dev, self.H, self.HV, self.cu, self.chunk_off = pool, dev, H, HV, cu, chunk_off
        self.scale = float(K**-0.5 if scale is None else scale)
        slots = max(total, 1) * HV
        overlap = _overlaps((V // BV) * N * HV, most, dev)
        l2 = bool(use_qk_l2norm)
        key = (dev.index, q.dtype, g.dtype, beta.dtype, B * T, H, HV, K, V, N, most, total, l2,
               self.h0 is not None, self.store_ht, pool, overlap)
        self.plan = cached_plan(_PLANS, key, lambda: _Plan(N=N, HV=HV, K=K, V=V, most=most, l2=l2, overlap=overlap,
                                                           has_h0=self.h0 is not None, store_ht=self.store_ht,
                                                           pool=pool))
        # T and the gate rows in one allocation (one call of the allocator on the way to the solve's launch);
        # tb is a multiple of 16 bytes, so the gate rows start aligned
        tb = slots * CHUNK * CHUNK * q.element_size()
        self.work = torch.empty(tb + slots * GATE_ROWS * CHUNK * 4, dtype=torch.uint8, device=dev)
        self.slots, self.Tbuf, self.Gbuf = slots, None, None
        self.flags = torch.zeros(slots, dtype=torch.int32, device=dev) if overlap else cu  # cu: never read
        self.o = None
        self.descs_shape = (B * T, H * K, HV * V, slots)
        self.ptrs = None
        self.direct = direct_ok(dev)
        if self.direct:
            wp = self.work.data_ptr()
            ptrs = (self.q.data_ptr(), self.k.data_ptr(), self.v.data_ptr(), self.g.data_ptr(),
                    self.beta.data_ptr(), wp, wp + tb, cu.data_ptr(), chunk_off.data_ptr(), self.flags.data_ptr(),
                    self.rows.data_ptr(), 0 if self.h0 is None else self.h0.data_ptr())
            self.direct = aligned(*ptrs)
            self.ptrs = ptrs

    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(T [slots, C, C] in q's dtype, gate rows [slots, R, C] fp32): views of `work`, made when asked (the JIT
        launches, `forward_launches`)."""
        if self.Tbuf is None:
            tb = self.slots * CHUNK * CHUNK * self.q.element_size()
            self.Tbuf = self.work[:tb].view(self.q.dtype).view(self.slots, CHUNK, CHUNK)
            self.Gbuf = self.work[tb:].view(torch.float32).view(self.slots, GATE_ROWS, CHUNK)
        return self.Tbuf, self.Gbuf

    def outputs(self) -> None:
        """Allocate o (and ht, unless the pool is ht); NaN-filled under POISON."""
        alloc = torch.full if POISON else lambda shape, _, **kw: torch.empty(shape, **kw)
        v = self.v
        self.o = alloc(v.shape, float("nan"), dtype=v.dtype, device=self.dev)
        if not self.pool and self.store_ht:
            N, K, V = self.plan.chain_grid[1] // self.HV, self.q.shape[-1], v.shape[-1]
            self.ht = alloc((N, self.HV, K, V), float("nan"), dtype=torch.float32, device=self.dev)

    def forward(self) -> None:
        if self.plan.overlap:
            if self.o is None:
                self.outputs()
            self._load_solve()
            _beside(self.solve, self.chain, self.dev)
            return
        self.solve()
        if self.o is None:
            self.outputs()
        self.chain()

    def _solve_args(self, ptrs):
        """The solve's arguments in the kernel's order: tensors for the JIT, their addresses for a direct launch."""
        q, k, _, g, beta, Tb, Gb, cu, off, flags = ptrs[:10]
        return (q, k, g, beta, Tb, Gb, cu, off, flags, self.scale, self.H, self.HV, *self.plan.solve_consts)

    def _tensors(self):
        return (self.q, self.k, self.v, self.g, self.beta, *self.buffers(), self.cu, self.chunk_off, self.flags)

    def solve(self) -> None:
        p = self.plan
        if p.solve_grid[1] == 0:
            return
        if self.direct and p.solve:
            p.solve(p.solve_grid, current_stream(self.dev.index), self._solve_args(self.ptrs))
            return
        compiled = _gdn_solve_kernel[p.solve_grid](*self._solve_args(self._tensors()), **p.solve_opts)
        if self.direct and p.solve is None:
            p.solve = direct_launch(compiled) or False

    def _load_solve(self) -> None:
        """Load the solve's compiled kernel into the context before the chain starts: with CUDA's lazy loading, a
        kernel loaded at its first launch waits for the kernels running, which here would be the chain waiting for
        it. Once a plan has the solve's direct launch, that kernel is loaded."""
        p = self.plan
        if self.direct and p.solve:
            return
        grid = (p.solve_grid[0], max(p.solve_grid[1], 1))
        compiled = _gdn_solve_kernel.warmup(*self._solve_args(self._tensors()), grid=grid, **p.solve_opts)
        compiled._init_handles()
        if self.direct and p.solve is None:
            p.solve = direct_launch(compiled) or False

    def chain(self, side: _Side | None = None) -> None:
        """The chain's launch on the current stream, or on `side` (the overlapped form): a direct launch takes its
        raw handle, a JIT launch makes it the current stream for the launch."""
        p = self.plan
        o, ht = self.o, self.ht
        if self.direct and p.chain and aligned(o.data_ptr(), 0 if ht is None else ht.data_ptr()):
            stream = current_stream(self.dev.index) if side is None else side.raw
            p.chain(p.chain_grid, stream, self._chain_direct_args(p))
            return
        states = (self.h0 if self.h0 is not None else o, ht if ht is not None else o)  # o: never read
        descs = _descriptors(self.q, self.k, self.v, o, *self.buffers(), BV)
        with contextlib.nullcontext() if side is None else torch.cuda.stream(side.stream):
            compiled = _gdn_chain_kernel[p.chain_grid](*descs, o, *states, self.rows, self.cu, self.chunk_off,
                                                       self.flags, self.H, self.HV, *p.chain_consts,
                                                       num_warps=NUM_WARPS)
        if self.direct and p.chain is None and aligned(o.data_ptr(), 0 if ht is None else ht.data_ptr()):
            d = direct_launch(compiled)
            if d is not None:
                p.specs = _specs(d.metas, *self.descs_shape)
            p.chain = d or False

    def _chain_direct_args(self, p: _Plan) -> tuple:
        """The chain's arguments as its C launcher parses them: each descriptor as (tensor map, *shape, *strides),
        pointers as addresses."""
        qp, kp, vp, _, _, Tp, Gp, cu, off, flags, rows, h0 = self.ptrs
        op = self.o.data_ptr()
        htp = op if self.ht is None else self.ht.data_ptr()
        sq, sk, sv, st, sg, so = p.specs
        return (tensor_map(qp, sq), *sq.tail, tensor_map(kp, sk), *sk.tail, tensor_map(vp, sv), *sv.tail,
                tensor_map(Tp, st), *st.tail, tensor_map(Gp, sg), *sg.tail, tensor_map(op, so), *so.tail,
                op, h0 if self.h0 is not None else op, htp, rows, cu, off, flags, self.H, self.HV, *p.chain_consts)


def _specs(metas, Ttot: int, HK: int, HVV: int, slots: int) -> tuple[TmaSpec, ...]:
    """The chain's tensor-map specs, in its descriptor order (`chain._descriptors`: q, k, v, T, gate rows, o), from
    the compiled kernel's tensor-descriptor metadata."""
    shapes = ((Ttot, HK), (Ttot, HK), (Ttot, HVV), (slots * CHUNK, CHUNK), (slots * GATE_ROWS, CHUNK), (Ttot, HVV))
    return tuple(TmaSpec(m, shape, (shape[1], 1)) for m, shape in zip(metas, shapes, strict=True))


OVERLAP_TOKENS = 4096  # the shortest longest sequence that runs its solve beside the chain (a second stream's cost)


def _overlaps(chain_programs: int, most: int, dev: torch.device) -> bool:
    """Whether the solve runs beside the chain rather than before it: when the chain's programs (one a
    multiprocessor) leave at least half the multiprocessors idle for the solve, which never waits, so the chain's
    waits always end; and the sequences are long enough to pay for the second stream."""
    return 2 * chain_programs <= _multiprocessors(dev) and most * CHUNK >= OVERLAP_TOKENS


@functools.lru_cache(maxsize=8)
def _multiprocessors(dev: torch.device) -> int:
    return torch.cuda.get_device_properties(dev).multi_processor_count


@functools.lru_cache(maxsize=8)
def _chain_stream(dev: torch.device) -> torch.cuda.Stream:
    """The stream of an overlapped chain: the highest priority, so that its programs are placed before the
    solve's."""
    return torch.cuda.Stream(device=dev, priority=torch.cuda.Stream.priority_range()[1])


class _Side(NamedTuple):
    """What the overlapped form forks with, made once per device and thread: the chain's stream, its raw handle
    (what a direct launch takes, so the current stream is never switched), and the two events of the fork and
    the join. Reused: a stream waits on an event's latest record at the time it is told to wait, so a later
    record does not move an earlier wait; per thread, so that two threads never record one event between the
    other's record and wait. (`Stream.wait_stream` makes, and then frees, a new event each time, and switching
    the current stream costs more than a launch.)"""

    stream: torch.cuda.Stream
    raw: int
    fork: torch.cuda.Event
    join: torch.cuda.Event


_SIDES = threading.local()


def _side(dev: torch.device) -> _Side:
    sides = _SIDES.__dict__
    side = sides.get(dev)
    if side is None:
        stream = _chain_stream(dev)
        side = sides[dev] = _Side(stream, stream.cuda_stream, torch.cuda.Event(), torch.cuda.Event())
    return side


def _beside(solve: Callable[[], None], chain: Callable[[_Side], None], dev: torch.device) -> None:
    """The chain on its own stream, launched first so that it holds its multiprocessors, then the solve on the
    current stream (its kernel already loaded); the chain waits chunk by chunk for the solve's flags (zeroed on the
    current stream before).
    The current stream then waits for the chain: every buffer was allocated on it, so nothing is freed or reused
    before the chain is done with it."""
    cur = torch.cuda.current_stream(dev)
    side = _side(dev)
    side.fork.record(cur)
    side.stream.wait_event(side.fork)
    chain(side)
    solve()
    side.join.record(side.stream)
    cur.wait_event(side.join)
