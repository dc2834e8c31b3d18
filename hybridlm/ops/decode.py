"""Multi-token decode of the gated delta rule (GDN) and KDA on a state pool: the input checks shared with the
public entries (`hybridlm.ops.triton.decode_entry`), and the PyTorch path that runs where the kernel does not (the
CPU). The impl is chosen in `hybridlm.ops.dispatch`'s table, as the recurrences' are (its decode backends: "triton"
and "torch").

Per sequence n, from S = state_pool[state_indices[n]], for each of its T tokens t (^: l2-normalised when asked):
    S <- e^{g_t} S,   S <- S + k^_t (beta_t (v_t - S^T k^_t))^T,   o_t = scale S^T q^_t
(GDN: one log-decay per value head; KDA: one per key channel, a diagonal on S's rows). T = 1 is a decode step;
T in 2..MAX_DRAFT are the draft tokens of speculative decoding or multi-token prediction.
Non-standard: which of the T states is kept is the caller's choice, as a speculating server needs:
- intermediate_states [N, T, HV, K, V] fp32: the state after every token (then the pool is only read);
- num_accepted [N] int (0..T): the pool row gets the state after token num_accepted[n] - 1, 0 leaves it as it was;
- neither: the pool row gets the state after the last token (T one-token steps).
Both may be given. The PyTorch path takes exactly what the kernel takes (head dims, an fp32 contiguous pool), so a
call that runs on the CPU runs on the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .norm import l2norm
from .validate import Dims, check_float, check_state_pool

MAX_DRAFT = 8  # tokens per sequence in one call; a longer continuation is prefill (the chunked ops take the pool)


@dataclass(frozen=True)
class DecodeDims:
    """Sizes of checked decode inputs; one: the inputs came without the token axis (q [N, H, K])."""

    N: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    one: bool


def check_decode_inputs(q, k, v, g, beta, state_pool, state_indices, *, channel: bool, max_dim: int,
                        intermediate_states: torch.Tensor | None = None,
                        num_accepted: torch.Tensor | None = None) -> DecodeDims:
    """Shapes, dtypes and devices of a decode call: q, k [N, T, H, K] or, one token each, [N, H, K] (then every
    input drops its T axis); v [N, T, HV, V]; g [N, T, HV] (KDA, channel: float32 [N, T, HV, K]); beta [N, T, HV];
    state_pool float32 [P, HV, K, V] contiguous; state_indices int [N]; head dims in 1..max_dim."""
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        check_float(name, x)
    if q.dim() not in (3, 4) or k.shape != q.shape:
        raise ValueError(f"q, k: expected [N, T, H, K] (or [N, H, K], one token each), got {tuple(q.shape)} and "
                         f"{tuple(k.shape)}")
    one = q.dim() == 3
    N, T, H, K = (q.shape[0], 1, *q.shape[1:]) if one else q.shape
    lead, ax = ((N,), "N, ") if one else ((N, T), "N, T, ")
    if not 1 <= T <= MAX_DRAFT:
        raise ValueError(f"q: expected 1..{MAX_DRAFT} tokens per sequence (T of [N, T, H, K]; run a longer "
                         f"continuation as prefill, gated_delta_rule / kda with state_pool=), got T={T}")
    if v.dim() != q.dim() or tuple(v.shape[: len(lead)]) != lead or v.shape[-2] % H != 0:
        raise ValueError(f"v: expected [{ax}HV, V] with HV a multiple of H={H}, got {tuple(v.shape)}")
    HV, V = v.shape[-2], v.shape[-1]
    if not 1 <= K <= max_dim:
        raise ValueError(f"q/k: the decode takes head dim K in 1..{max_dim} (the Triton kernel's range, on every "
                         f"impl), got K={K}")
    if not 1 <= V <= max_dim:
        raise ValueError(f"v: the decode takes head dim V in 1..{max_dim} (the Triton kernel's range, on every "
                         f"impl), got V={V}")
    g_shape = (*lead, HV, K) if channel else (*lead, HV)
    if tuple(g.shape) != g_shape or (channel and g.dtype != torch.float32):
        want = f"float32 [{ax}HV, K]" if channel else f"[{ax}HV]"
        raise ValueError(f"g: expected {want} = {g_shape}, got {g.dtype} {tuple(g.shape)}")
    if tuple(beta.shape) != (*lead, HV):
        raise ValueError(f"beta: expected shape {(*lead, HV)} ([{ax}HV]), got {tuple(beta.shape)}")
    check_state_pool(state_pool, state_indices, initial_state=None, dims=Dims(B=N, T=T, H=H, HV=HV, K=K, V=V, N=N),
                     dtype=torch.float32, device=q.device)
    if not state_pool.is_contiguous():
        raise ValueError("state_pool: expected a contiguous tensor (it is updated in place)")
    if intermediate_states is not None:
        _check_intermediate(intermediate_states, (N, T, HV, K, V), q.device)
    if num_accepted is not None:
        _check_accepted(num_accepted, N, T, q.device)
    return DecodeDims(N=N, T=T, H=H, HV=HV, K=K, V=V, one=one)


def _check_intermediate(buf: torch.Tensor, shape: tuple[int, ...], device: torch.device) -> None:
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"intermediate_states: expected a torch.Tensor or None, got {type(buf).__name__}")
    if tuple(buf.shape) != shape:
        raise ValueError(f"intermediate_states: expected shape {shape} ([N, T, HV, K, V]), got {tuple(buf.shape)}")
    if buf.dtype != torch.float32:
        raise TypeError(f"intermediate_states: expected dtype torch.float32 (the state's), got {buf.dtype}")
    if buf.device != device:
        raise ValueError(f"intermediate_states: expected a tensor on the inputs' device {device}, got {buf.device}")
    if not buf.is_contiguous():
        raise ValueError("intermediate_states: expected a contiguous tensor (it is written in place), got strides "
                         f"{buf.stride()}")
    if buf.requires_grad:
        raise ValueError("intermediate_states: expected a tensor without requires_grad (it is written in place), "
                         "got one that requires grad")


def _check_accepted(acc: torch.Tensor, N: int, T: int, device: torch.device) -> None:
    """dtype, shape and device; the values (0..T) only when on the CPU, where looking costs no device sync (on the
    GPU a value outside 0..T writes no row)."""
    if not isinstance(acc, torch.Tensor) or acc.dtype not in (torch.int32, torch.int64):
        got = acc.dtype if isinstance(acc, torch.Tensor) else type(acc).__name__
        raise TypeError(f"num_accepted: expected an int32/int64 tensor, got {got}")
    if tuple(acc.shape) != (N,):
        raise ValueError(f"num_accepted: expected shape {(N,)} ([N], one count per sequence), got {tuple(acc.shape)}")
    if acc.device != device:
        raise ValueError(f"num_accepted: expected a tensor on the inputs' device {device}, got {acc.device}")
    if acc.device.type == "cpu" and N > 0:
        lo, hi = int(acc.min()), int(acc.max())
        if lo < 0 or hi > T:
            raise ValueError(f"num_accepted: expected counts in 0..{T} (T tokens a sequence), got {lo}..{hi}")


def decode_torch(q, k, v, g, beta, state_pool, state_indices, *, scale: float, use_qk_l2norm: bool,
                 intermediate_states: torch.Tensor | None = None,
                 num_accepted: torch.Tensor | None = None) -> torch.Tensor:
    """The decode in PyTorch, on checked 4-d inputs (q, k [N, T, H, K], ...; g GDN [N, T, HV], KDA [N, T, HV, K]):
    T one-token steps in float32 (the kernel's precision), the pool written as the module docstring says.
    Returns o [N, T, HV, V] in q's dtype."""
    N, T, H, K = q.shape
    HV = v.shape[2]
    f, out_dtype = torch.float32, q.dtype
    q, k = q.to(f), k.to(f)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    # value head hv reads key head hv // (HV / H)
    q, k = q.repeat_interleave(HV // H, dim=2) * scale, k.repeat_interleave(HV // H, dim=2)
    v, beta, dec = v.to(f), beta.to(f), g.to(f).exp()
    dec = dec[..., None] if g.dim() == 4 else dec[..., None, None]  # GDN: one per head; KDA: one per key row
    rows = state_indices.long()
    S = state_pool.index_select(0, rows)  # [N, HV, K, V], a copy
    kept = S.clone() if num_accepted is not None else None
    o = q.new_empty(N, T, HV, v.shape[-1])
    for t in range(T):
        S = S * dec[:, t]
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("nhkv,nhk->nhv", S, k[:, t]))
        S = S + k[:, t, :, :, None] * u[:, :, None, :]
        o[:, t] = torch.einsum("nhkv,nhk->nhv", S, q[:, t])
        if intermediate_states is not None:
            intermediate_states[:, t] = S
        if kept is not None:
            kept = torch.where((num_accepted == t + 1).view(N, 1, 1, 1), S, kept)
    if num_accepted is not None:
        done = num_accepted > 0
        state_pool.index_copy_(0, rows[done], kept[done])
    elif intermediate_states is None:
        state_pool.index_copy_(0, rows, S)
    return o.to(out_dtype)
