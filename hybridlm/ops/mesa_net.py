"""Public MesaNet op: the least-squares memory with a forget gate and a per-channel ridge (Mesa layer).

Non-standard here (against the delta-rule ops of `hybridlm.ops.recurrence`):
- The state is a pair (H [N, HV, K, K], G [N, HV, K, V]): key covariance and key-value covariance, both decayed by
  e^{g_t} and written with weight beta_t; `initial_state` and the returned final state are such tuples.
- The output is o_t = G_t^T (H_t + diag(lambda))^{-1} q_t with `lamb` [HV, K] > 0 (fla's layer: softplus(param) +
  0.25). The solve is exact by default; `cg_iters=n` runs n conjugate-gradient steps instead (fla's kernels always
  do, 30 by default), which is what the layer costs on a GPU, and uses no per-token K x K matrix on impl="chunk".
- `scale` (default K ** -0.5, as every op here) only rescales o, since o is linear in q; fla's MesaNet has no
  scale, so its layer here passes scale=1.
- No Triton kernel: impl="auto" is "chunk" everywhere, and "triton" fails with resolve_impl's error.
- Autocast is switched off inside: the solve and the covariances are float32 whatever region the call is in (a
  bfloat16 key covariance would make the solve meaningless); the output still comes back in the input dtype.
"""

from __future__ import annotations

import contextlib

import torch

from .dispatch import resolve_impl
from .mesa_chunk import mesa_chunk
from .mesa_naive import mesa_naive
from .norm import l2norm
from .offsets import host_offsets
from .validate import Dims, check_float, check_recurrence_inputs, check_same_device, check_shape

OP = "mesa_net"


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _check_inputs(q, k, v, g, beta, lamb, initial_state, cu_seqlens, chunk_size, cg_iters, impl) -> Dims:
    dims = check_recurrence_inputs(q, k, v, g=g, g_kind="scalar", beta=beta, initial_state=None,
                                   cu_seqlens=cu_seqlens, chunk_size=chunk_size, impl=impl)
    if beta is None:
        raise ValueError("beta: expected a write-strength tensor [B, T, HV], got None")
    check_float("lamb", lamb)
    check_shape("lamb", lamb, (dims.HV, dims.K), "[HV, K]")
    h0 = s0 = None
    if initial_state is not None:
        if not isinstance(initial_state, (tuple, list)) or len(initial_state) != 2:
            raise TypeError(f"initial_state: expected a pair (H [N, HV, K, K], G [N, HV, K, V]), got "
                            f"{type(initial_state).__name__}")
        h0, s0 = initial_state
        check_float("initial_state[0]", h0)
        check_float("initial_state[1]", s0)
        check_shape("initial_state[0]", h0, (dims.N, dims.HV, dims.K, dims.K), "[N, HV, K, K]")
        check_shape("initial_state[1]", s0, (dims.N, dims.HV, dims.K, dims.V), "[N, HV, K, V]")
        cd = _compute_dtype(q)
        for i, x in enumerate((h0, s0)):
            if x.dtype != cd:
                raise TypeError(f"initial_state[{i}]: expected dtype {cd} for {q.dtype} inputs, got {x.dtype}")
    if cg_iters is not None and (isinstance(cg_iters, bool) or not isinstance(cg_iters, int) or cg_iters < 1):
        raise ValueError(f"cg_iters: expected None (exact solve) or an int >= 1, got {cg_iters!r}")
    check_same_device(q=q, g=g, beta=beta, lamb=lamb, h0=h0, s0=s0)
    return dims


def mesa_net(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    g: torch.Tensor,
    beta: torch.Tensor,
    lamb: torch.Tensor,
    scale: float | None = None,
    initial_state: tuple[torch.Tensor, torch.Tensor] | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm: bool = False,
    chunk_size: int = 16,
    cg_iters: int | None = None,
    impl: str = "auto",
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """MesaNet: H_t = e^{g_t} H_{t-1} + beta_t k_t k_t^T,  G_t = e^{g_t} G_{t-1} + beta_t k_t v_t^T,
    o_t = G_t^T (H_t + diag(lambda))^{-1} q_t.

    q, k: [B, T, H, K]; v: [B, T, HV, V] with HV a multiple of H (value head h reads key head h // (HV / H)).
    g: [B, T, HV] log-decay (<= 0); beta: [B, T, HV] write strength (>= 0); lamb: [HV, K] ridge (> 0).
    scale: multiplies q after the optional l2 norm; default K ** -0.5 (o is linear in q: fla uses 1).
    initial_state: (H [N, HV, K, K], G [N, HV, K, V]) in float32 (float64 for float64 inputs); H must be symmetric
    positive semi-definite for the solve to be well posed (it is whenever it came out of this op).
    output_final_state: also return the final (H, G); otherwise None is returned.
    cu_seqlens: int32/int64 [N+1] offsets of sequences packed into one row (B must be 1), FlashAttention-style.
    use_qk_l2norm: normalise q and k over K as x * rsqrt(sum(x^2) + 1e-6) first.
    chunk_size: 16, 32, 64 or 128, used by impl="chunk". Default 16, not 64 as for the delta rules: the exact solve
    forms every token's K x K system from its chunk's keys, O(T * chunk_size * K^2) work, while the sequential part
    is only one K x K update per chunk.
    cg_iters: None for the exact solve, or that many conjugate-gradient steps from x = 0 (fla: 30).
    impl: "auto" | "naive" | "chunk" ("triton" has no kernel and fails).
    Returns (o [B, T, HV, V] in the input dtype, (H, G) or None)."""
    dims = _check_inputs(q, k, v, g, beta, lamb, initial_state, cu_seqlens, chunk_size, cg_iters, impl)
    impl = resolve_impl(OP, impl, q.device)
    cd = _compute_dtype(q)
    N, HV, K, V = dims.N, dims.HV, dims.K, dims.V
    if initial_state is None:
        h0, s0 = q.new_zeros(N, HV, K, K, dtype=cd), q.new_zeros(N, HV, K, V, dtype=cd)
    else:
        h0, s0 = initial_state
    if dims.T == 0:
        return v.new_zeros(dims.B, 0, HV, V), ((h0, s0) if output_final_state else None)

    out_dtype = q.dtype
    scale = K**-0.5 if scale is None else float(scale)
    q, k, v, g, beta, lamb = (x.to(cd) for x in (q, k, v, g, beta, lamb))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * scale
    if HV != dims.H:
        q, k = q.repeat_interleave(HV // dims.H, dim=2), k.repeat_interleave(HV // dims.H, dim=2)

    def core(sl: slice, h: torch.Tensor, s: torch.Tensor):
        args = (q[:, sl], k[:, sl], v[:, sl])
        kw = dict(g=g[:, sl], beta=beta[:, sl], lamb=lamb, h_BHKK=h, s_BHKV=s, cg_iters=cg_iters)
        return mesa_naive(*args, **kw) if impl == "naive" else mesa_chunk(*args, chunk_size=chunk_size, **kw)

    dev = q.device.type
    with torch.autocast(dev, enabled=False) if torch.amp.is_autocast_available(dev) else contextlib.nullcontext():
        if cu_seqlens is None:
            o, h, s = core(slice(None), h0, s0)
        else:  # varlen: each packed sequence starts from its own state
            bounds = host_offsets(cu_seqlens)
            parts = [core(slice(bounds[n], bounds[n + 1]), h0[n : n + 1], s0[n : n + 1]) for n in range(N)]
            o = torch.cat([p[0] for p in parts], dim=1)
            h, s = torch.cat([p[1] for p in parts]), torch.cat([p[2] for p in parts])
    return o.to(out_dtype), ((h, s) if output_final_state else None)
