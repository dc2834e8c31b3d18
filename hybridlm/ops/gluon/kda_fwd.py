"""Kimi Delta Attention forward for Hopper (sm_90): the Triton KDA prep, then a Gluon state chain that keeps the
state in registers. What `impl="auto"` runs for KDA inference on sm_90 (bf16/fp16, K 64 or 128, V 64 to 256);
training keeps the Triton forward, whose chunk states the Triton backward reads.

The chunk-local products with the per-channel decay inside (A's solve, P, W, Qg, Kd) are the Triton prep's
(`triton.kda._prep`: its launches pick per (chunk, head) the whole-chunk, 16-row, 8-row or exact pairwise form,
every factor bounded); what this file replaces is the Triton forward's state pass and output launch, which wrote
every chunk state and Vn to memory and read them back: `kda_chain._kda_chain_kernel` holds S^T [64, K] fp32 in one
warpgroup's registers for the whole sequence and does O = Qg S + P Vn in a second warpgroup.

Bytes per chunk of 64 tokens and value head at K = V = 128 in bf16 (the Triton forward: ~490 KB, 2.0 GB at B4 T4096
H16): the prep as before (reads q, k, v, g, beta, ~82 KB; writes and rereads A / T in fp32, 48 KB; writes Qg, Kd,
W, U, P, bL, 89 KB); the chain reads Qg, Kd, W and P once per value block of 64 (2 x 56 KB, the second mostly
from L2) and U, writes o (16 + 16 KB); no chunk state (64 KB written and read) and no Vn (32 KB) goes to memory,
and the output launch's reads of Qg, P and the states (88 KB) are gone.
Other head dims and fp32 inputs are refused (`unsupported_reason`; the dispatch then keeps the Triton kernels).
"""

from __future__ import annotations

import torch

from .gdn_fwd import _check_inputs, _check_pool, unsupported_reason
from .parts import _IMPORT_ERROR

if _IMPORT_ERROR is None:  # the kernel, named here for the callers and the compile test
    from .chain import _tma_desc
    from .kda_chain import _kda_chain_kernel

__all__ = ["kda_fwd", "unsupported_reason"]

CHUNK = 64  # tokens per chunk (the Triton prep's BT for 16-bit inputs)
BV = 64  # value block of a chain program: one warpgroup's M (the transposed state's rows)
NUM_WARPS = 4  # one warpgroup (the chain's output partition adds another)
POISON = False  # tests set it: outputs start as NaN, so an element the kernel never writes fails the check


def _alloc(shape, dtype, dev) -> torch.Tensor:
    if POISON:
        return torch.full(shape, float("nan"), dtype=dtype, device=dev)
    return torch.empty(shape, dtype=dtype, device=dev)


def kda_fwd(
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
    """KDA forward: the Triton prep, then the Gluon state chain (Hopper only; no autograd).

    q, k: [B, T, H, K]; v: [B, T, HV, V] with HV a multiple of H (value head hv reads key head hv // (HV // H));
    g: [B, T, HV, K] per-channel log-decay (float32); beta: [B, T, HV]; initial_state: [N, HV, K, V] (N = B, or
    len(cu_seqlens) - 1 with B = 1); cu_seqlens: [N + 1] token offsets of packed sequences. Returns o
    [B, T, HV, V] in q's dtype and the final state [N, HV, K, V] fp32 (None unless output_final_state).
    state_pool [P, HV, K, V] fp32 and state_indices [N] (instead of initial_state): sequence n starts from pool row
    state_indices[n] and its final state is written back there in place (chunked prefill). Same contract as
    `hybridlm.ops.kda` for these arguments. checked: the caller has validated all this (`hybridlm.ops.dispatch`).
    """
    from ..triton import kda as tkda
    from ..triton.chunk_layout import layout

    if checked:
        pool = state_pool is not None
    else:
        _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, channel=True)
        pool = _check_pool(q, v, state_pool, state_indices, initial_state, cu_seqlens)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dev = q.device
    lay = layout(cu_seqlens, B, T, CHUNK, dev)
    N, Ttot, nc = lay.N, lay.Ttot, lay.nc
    q, k, v, beta = (x.contiguous() for x in (q, k, v, beta))
    g = g.to(torch.float32).contiguous()
    sd, f32 = q.dtype, torch.float32
    e = lambda *s, dt=sd: torch.empty(*s, device=dev, dtype=dt)  # noqa: E731
    NCb = max(nc, 1)
    Tb, Pb, BLb = e(NCb, HV, CHUNK, CHUNK, dt=f32), e(NCb, HV, CHUNK, CHUNK), e(NCb, HV, K, dt=f32)
    Wb, Ub, Qg, Kd = e(Ttot, HV, K), e(Ttot, HV, V), e(Ttot, HV, K), e(Ttot, HV, K)
    sc = float(K**-0.5 if scale is None else scale)
    if nc > 0:
        tkda._prep(q, k, v, g, beta, Tb, Wb, Ub, Qg, Kd, Pb, BLb, lay, sc, bool(use_qk_l2norm), "tf32")
    o = _alloc(v.shape, v.dtype, dev)
    if pool:
        h0 = ht = state_pool
        rows = state_indices.to(torch.int32).contiguous()
        store_ht = True
    else:
        h0 = initial_state.to(f32).contiguous() if initial_state is not None else None
        ht = _alloc((N, HV, K, V), f32, dev) if output_final_state else None
        rows = lay.cu_t  # never read: POOL is compiled out
        store_ht = bool(output_final_state)
    descs = _descriptors(Qg, Kd, Wb, Ub, Pb, o)
    _kda_chain_kernel[(V // BV, N * HV)](
        *descs, o, BLb, h0 if h0 is not None else BLb, ht if ht is not None else BLb, rows, lay.cu_t,
        lay.chunk_off, HV, K=K, V=V, BV=BV, C=CHUNK, HAS_H0=h0 is not None, STORE_HT=store_ht, POOL=pool,
        num_warps=NUM_WARPS,
    )
    if pool:
        return o, state_pool.index_select(0, state_indices.long()) if output_final_state else None
    return o, ht


def _descriptors(Qg, Kd, Wb, Ub, Pb, o) -> tuple:
    """TMA descriptors of the chain: Qg, Kd, W as [Ttot, HV * K] in [CHUNK, K] boxes, U and o as [Ttot, HV * V]
    in [CHUNK, BV] boxes, P as [chunks * HV * CHUNK, CHUNK] rows."""
    K = Qg.shape[-1]
    flat = lambda x: x.reshape(-1, x.shape[-2] * x.shape[-1])  # noqa: E731  [Ttot, HV, D] as [Ttot, HV * D]
    return (_tma_desc(flat(Qg), CHUNK, K), _tma_desc(flat(Kd), CHUNK, K), _tma_desc(flat(Wb), CHUNK, K),
            _tma_desc(flat(Ub), CHUNK, BV), _tma_desc(Pb.reshape(-1, CHUNK), CHUNK, CHUNK),
            _tma_desc(flat(o), CHUNK, BV))
