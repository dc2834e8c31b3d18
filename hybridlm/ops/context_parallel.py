"""Context parallelism for the delta-rule recurrences: the sequence split over the ranks of a process group, each
rank running the op on its contiguous slice from its true initial state.

Non-standard here:
- The state a slice leaves is affine in the state it gets: S_out = M S_in + C, with M = A_T ... A_1 [K, K] and
  A_t = (I - beta_t k_t k_t^T) diag(e^{g_t}) (docs/math.md, "Context parallelism"). Each rank computes its M and C
  with the op itself (C from a zero state; M by running it with v = 0 from the identity, where the update is linear
  in S), all-gathers them in the state dtype (float32; float64 for float64 values) and chains them, so every rank
  knows every rank's initial state; then it runs the op on its slice from its own. Two more local calls (M,
  C) than without: correctness first, the exchange is one [K, K + V] pair per head and rank.
- Gradients are exact: M and C come from the differentiable op, the gather's backward sums the gradients of the
  gathered pieces over the ranks (an all-reduce, which gloo has; its reduce-scatter it has not) and hands each
  rank its own. That backward is a collective: every rank must backpropagate through its output, as training does.
  The output is tied to the gathered tensor (`_tie`) so that every rank's backward reaches it exactly once, even a
  rank whose initial state does not depend on the others (rank 0, a slice that starts a document).
- initial_state applies at the start of the whole sequence (of each document under varlen); every rank passes the
  same one, and its gradient on each rank is that rank's share: the full gradient is their sum.
- The final state is the same on every rank (each computes it from the gathered pieces, no further exchange); a
  loss should count it on one rank, as with any replicated tensor.
- Varlen: cu_seqlens are the global offsets of the whole row and every rank's slice has the same length T, so
  rank r holds positions [r T, (r + 1) T). A rank's slice splits into its first segment (the document running in
  at its start, whose state is chained), the documents after it (from their own initial states, known locally)
  and, if the last of those runs past the slice, the state it leaves ("tail"), which the next rank takes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from .offsets import host_offsets
from .validate import check_cu_seqlens, check_shape, check_state_dtype, state_dtype


class _Gather(torch.autograd.Function):
    """all_gather stacked [R, *x.shape]; backward: the gradients summed over ranks, this rank's row."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x, group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


def gather(x: torch.Tensor, group) -> torch.Tensor:
    """Differentiable all_gather: x from every rank of group, stacked in rank order."""
    return _Gather.apply(x, group)


class _Tie(torch.autograd.Function):
    """x unchanged, with `other` in its graph: other gets a zero gradient whenever x gets one."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        ctx.other_shape, ctx.other_dtype = other.shape, other.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, grad.new_zeros(ctx.other_shape, dtype=ctx.other_dtype)


def tie(x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """x, made to depend on other, so that a collective in other's backward runs on every rank (module docstring)."""
    return _Tie.apply(x, other) if torch.is_grad_enabled() and other.requires_grad else x


def check_group(group) -> tuple[int, int]:
    """(rank, world size) of a cp_group, or a one-line error."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("cp_group: torch.distributed is not initialised (call init_process_group first)")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"cp_group: expected a torch.distributed ProcessGroup, got {type(group).__name__}")
    return dist.get_rank(group), dist.get_world_size(group)


def _slice(x: torch.Tensor | None, s: int, e: int) -> torch.Tensor | None:
    return None if x is None else x[:, s:e]


def _pack(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.reshape(-1) for p in parts])


def _unpack(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    sizes = [p.numel() for p in like]
    return [piece.view(p.shape) for piece, p in zip(flat.split(sizes), like)]


def _first_end(starts: list[int], ends: list[int], r: int, T: int) -> int:
    """The global end of rank r's first segment (varlen)."""
    a = r * T
    return min(next(e for s, e in zip(starts, ends) if s <= a < e), a + T)


def run(local: Callable, q, k, v, *, g, beta, initial_state, output_final_state, cu_seqlens, group,
        state_pool=None, state_indices=None, **kw) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A recurrence on this rank's slice of a sequence split over `group` (module docstring).

    local(q, k, v, g=, beta=, initial_state=, output_final_state=, cu_seqlens=) runs the op on local data (the
    public op's dispatch without a group; kw, e.g. scale and impl's settings, is passed on to it).
    Returns (o for this slice, the final state of the whole sequence on every rank or None)."""
    rank, R = check_group(group)
    if state_pool is not None or state_indices is not None:
        raise ValueError("cp_group: expected no state_pool/state_indices with context parallelism (they are for "
                         "serving), got a state pool")
    if not (isinstance(v, torch.Tensor) and v.dim() == 4 and isinstance(k, torch.Tensor) and k.dim() == 4):
        raise ValueError("cp_group: expected k [B, T, H, K] and v [B, T, HV, V], got "
                         f"{getattr(k, 'shape', type(k).__name__)} and {getattr(v, 'shape', type(v).__name__)}")
    B, T, HV, V = v.shape
    K = k.shape[-1]
    sd = state_dtype(v.dtype)
    if cu_seqlens is None:
        starts = ends = list(range(B))  # one row per sequence, each running through every rank
        n_docs = B
    else:
        if T == 0:
            raise ValueError("v: expected a slice of at least one position a rank with cp_group and cu_seqlens, "
                             "got T=0")
        n_docs = check_cu_seqlens(cu_seqlens, B=B, T=R * T)
        offsets = host_offsets(cu_seqlens)
        starts, ends = offsets[:-1], offsets[1:]
    if initial_state is not None:
        check_shape("initial_state", initial_state, (n_docs, HV, K, V), f"[N={n_docs}, HV={HV}, K={K}, V={V}]")
        check_state_dtype("initial_state", initial_state, v.dtype)
        initial_state = initial_state.to(sd)

    def fresh(n: int) -> torch.Tensor:  # the state a document starts from, [1, HV, K, V]
        if initial_state is not None:
            return initial_state[n : n + 1]
        return v.new_zeros(1, HV, K, V, dtype=sd)

    def call(s, e, **extra):
        return local(_slice(q, s, e), _slice(k, s, e), _slice(v, s, e), g=_slice(g, s, e), beta=_slice(beta, s, e),
                     **kw, **extra)

    if cu_seqlens is None:
        f_end, rest = T, []
    else:  # this rank's segments: (document, local start, local end), in order
        a = rank * T
        segs = [(n, max(s, a) - a, min(e, a + T) - a) for n, (s, e) in enumerate(zip(starts, ends))
                if s < e and s < a + T and e > a]
        f_end, rest = segs[0][2], segs[1:]
    Nf = B if cu_seqlens is None else 1

    # the first segment's transition and its state from zero
    eye = torch.eye(K, dtype=sd, device=v.device).expand(Nf, HV, K, K).contiguous()
    M = local(_slice(q, 0, f_end), _slice(k, 0, f_end), v.new_zeros(B, f_end, HV, K), g=_slice(g, 0, f_end),
              beta=_slice(beta, 0, f_end), initial_state=eye, output_final_state=True, cu_seqlens=None, **kw)[1]
    C = call(0, f_end, initial_state=None, output_final_state=True, cu_seqlens=None)[1]
    pieces = [M, C]
    o_rest = None
    if cu_seqlens is not None:
        # the documents after the first segment start here, from states known locally
        tail = v.new_zeros(1, HV, K, V, dtype=sd)
        finals = v.new_zeros(n_docs, HV, K, V, dtype=sd)
        if rest:
            cu = torch.tensor([0] + [e - f_end for _, _, e in rest], dtype=torch.int32, device=v.device)
            h0 = torch.cat([fresh(n) for n, _, _ in rest])
            o_rest, f_rest = call(f_end, T, initial_state=h0, output_final_state=True, cu_seqlens=cu)
            idx = [n for n, _, _ in rest if ends[n] <= (rank + 1) * T]  # the documents that end on this rank
            if idx:
                finals = finals.index_copy(0, torch.tensor(idx, device=v.device), f_rest[: len(idx)])
            if len(idx) < len(rest):
                tail = f_rest[-1:]
        pieces += [tail, finals]
    flat = gather(_pack(pieces), group)
    got = [_unpack(flat[r], pieces) for r in range(R)]

    # every rank's initial state and the state it leaves, in rank order
    s_in, s_out = [], []
    for r in range(R):
        if cu_seqlens is None:
            s = (initial_state if initial_state is not None else v.new_zeros(B, HV, K, V, dtype=sd)) if r == 0 \
                else s_out[-1]
        else:
            n0 = next(n for n, (a0, e0) in enumerate(zip(starts, ends)) if a0 <= r * T < e0)
            s = fresh(n0) if starts[n0] == r * T else s_out[-1]
        s_in.append(s)
        through = torch.einsum("nhij,nhjv->nhiv", got[r][0], s) + got[r][1]  # the first segment's end state
        if cu_seqlens is None or _first_end(starts, ends, r, T) == (r + 1) * T:
            s_out.append(through)
        else:
            s_out.append(got[r][2])

    h = tie(s_in[rank], flat)
    o_first = call(0, f_end, initial_state=h, output_final_state=False, cu_seqlens=None)[0]
    o = o_first if o_rest is None else torch.cat([o_first, o_rest], dim=1)
    if not output_final_state:
        return o, None
    if cu_seqlens is None:
        return o, s_out[-1]
    out = []
    for n, (s, e) in enumerate(zip(starts, ends)):
        if s == e:
            out.append(fresh(n))
            continue
        r = (e - 1) // T
        if s <= r * T:  # the document is the first segment of the rank it ends on
            out.append(torch.einsum("nhij,nhjv->nhiv", got[r][0], s_in[r]) + got[r][1])
        else:
            out.append(got[r][3][n : n + 1])
    return o, torch.cat(out)
