"""Gated DeltaNet forward for Hopper (sm_90) in Gluon: a parallel T solve, then one state chain per head and value
block. What `impl="auto"` runs for inference on sm_90 (bf16/fp16, K 64 or 128, V 64 to 256); training keeps the
Triton forward, whose chunk states the Triton backward reads.

Two launches: `solve._gdn_solve_kernel` (every chunk of every head at once: T diag(beta) in the inputs' 16-bit dtype,
and the per-token gate rows) and `chain._gdn_chain_kernel` (one program per value block of 64 and sequence x value head,
the state in registers for the whole sequence, the output products in a second warpgroup). The math of each is in
its file's docstring; measured times and what was tried are in docs/kernels.md ("Fused forward in Gluon").
Non-standard: where the chain's programs would leave half the multiprocessors idle (a few long sequences), the solve
runs beside the chain instead of before it: the chain on a high-priority stream, waiting chunk by chunk for flags
the solve sets (`_overlaps`, `_beside`).
Other head dims and fp32 inputs are refused here (`unsupported_reason`; the dispatch then keeps the Triton
kernels).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
import triton

from ..validate import Dims, check_state_pool
from .chain import _descriptors
from .parts import _IMPORT_ERROR, gluon_available
from .solve import GATE_ROWS

if _IMPORT_ERROR is None:  # the kernels, named here for the callers and the compile test
    from .chain import _gdn_chain_kernel  # noqa: F401
    from .solve import _gdn_solve_kernel  # noqa: F401

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
    cap = torch.cuda.get_device_capability(q.device)
    if cap != (9, 0):
        return f"q: expected a device of compute capability (9, 0) (Hopper), got {cap}"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"q: expected dtype bfloat16 or float16, got {q.dtype}"
    K, V = q.shape[-1], v.shape[-1]
    if K not in SUPPORTED_K or V not in SUPPORTED_V:
        return f"q, v: expected head dims K in {SUPPORTED_K} and V in {SUPPORTED_V}, got K={K} V={V}"
    return None


def _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens) -> None:
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
    for name, x in (("g", g), ("beta", beta)):
        if x is None or tuple(x.shape) != (B, T, HV):
            raise ValueError(f"{name}: expected [B, T, HV] = [{B}, {T}, {HV}], got "
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
    launch = forward_launches(q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                              output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                              use_qk_l2norm=use_qk_l2norm, state_pool=state_pool, state_indices=state_indices,
                              checked=checked)
    launch.run()
    if state_pool is not None and output_final_state:
        return launch.o, state_pool.index_select(0, state_indices.long())
    return launch.o, launch.ht


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
    if checked:
        pool = state_pool is not None
    else:
        _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
        pool = _check_pool(q, v, state_pool, state_indices, initial_state, cu_seqlens)
    B, T, H, K = q.shape
    HV, V = v.shape[2:]
    scale = K**-0.5 if scale is None else scale
    dev = q.device
    if cu_seqlens is None:  # equal lengths: the chunk offsets follow without reading anything back
        most = -(-T // CHUNK)
        cu, chunk_off = _equal_offsets(B, T, most, dev)
        total = B * most
    else:
        cu = cu_seqlens.to(device=dev, dtype=torch.int32)
        nch = (cu[1:] - cu[:-1] + CHUNK - 1) // CHUNK
        chunk_off = torch.cat([nch.new_zeros(1), nch.cumsum(0)]).to(torch.int32)
        host = nch.tolist()  # the grid needs the longest sequence: one host sync
        most, total = max(host, default=0), sum(host)
    N = cu.numel() - 1
    qc, kc, vc = (x.contiguous() for x in (q, k, v))
    gc, bc = g.contiguous(), beta.contiguous()
    alloc = torch.full if POISON else lambda shape, _, **kw: torch.empty(shape, **kw)
    o = alloc(vc.shape, float("nan"), dtype=vc.dtype, device=dev)
    if pool:  # the kernel reads and writes the pool's rows; ht (if asked) is a copy of them afterwards
        h0 = ht = state_pool
        rows = state_indices.to(torch.int32).contiguous()
    else:
        ht = alloc((N, HV, K, V), float("nan"), dtype=torch.float32, device=dev) if output_final_state else None
        h0 = initial_state.to(torch.float32).contiguous() if initial_state is not None else None
        rows = cu  # never read: POOL is compiled out
    slots = max(total, 1) * HV
    Tbuf = torch.empty(slots, CHUNK, CHUNK, dtype=q.dtype, device=dev)
    Gbuf = torch.empty(slots, GATE_ROWS, CHUNK, dtype=torch.float32, device=dev)
    descs = _descriptors(qc, kc, vc, o, Tbuf, Gbuf, BV)
    programs = (most * N * HV, (V // BV) * N * HV)
    overlap = _overlaps(programs[1], most, dev)
    flags = torch.zeros(slots, dtype=torch.int32, device=dev) if overlap else cu  # cu: never read
    states = (h0 if h0 is not None else o, ht if ht is not None else o)  # o: never read (compiled out)

    solve_args = (qc, kc, gc, bc, Tbuf, Gbuf, cu, chunk_off, flags, float(scale), H, HV)
    solve_opts = dict(K=K, C=CHUNK, R=GATE_ROWS, L2=bool(use_qk_l2norm), FLAG=overlap, num_warps=NUM_WARPS,
                      maxnreg=SOLVE_REGS if use_qk_l2norm else None)

    def solve():
        if most > 0:
            _gdn_solve_kernel[(N * HV, most)](*solve_args, **solve_opts)

    def load_solve():
        """Load the solve's compiled kernel into the context now: with CUDA's lazy loading, a kernel loaded at its
        first launch waits for the kernels running, which here would be the chain waiting for it."""
        _gdn_solve_kernel.warmup(*solve_args, grid=(N * HV, max(most, 1)), **solve_opts)._init_handles()

    def chain():
        _gdn_chain_kernel[(V // BV, N * HV)](*descs, o, *states, rows, cu, chunk_off, flags, H, HV, K=K, V=V, BV=BV,
                                             C=CHUNK, R=GATE_ROWS, HAS_H0=h0 is not None, STORE_HT=ht is not None,
                                             POOL=pool, WAIT=overlap, num_warps=NUM_WARPS)

    def run():
        if overlap:
            load_solve()
            _beside(solve, chain, dev)
        else:
            solve()
            chain()

    # with a pool the final states are its rows (gated_delta_rule_fwd copies them out when asked)
    return Launches(run, solve, chain, o, None if pool else ht, (Tbuf, Gbuf), programs, overlap)


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


def _beside(solve: Callable[[], None], chain: Callable[[], None], dev: torch.device) -> None:
    """The chain on its own stream, launched first so that it holds its multiprocessors, then the solve on the
    current stream (its kernel already loaded); the chain waits chunk by chunk for the solve's flags (zeroed on the
    current stream before).
    The current stream then waits for the chain: every buffer was allocated on it, so nothing is freed or reused
    before the chain is done with it."""
    cur = torch.cuda.current_stream(dev)
    side = _chain_stream(dev)
    side.wait_stream(cur)
    with torch.cuda.stream(side):
        chain()
    solve()
    cur.wait_stream(side)
