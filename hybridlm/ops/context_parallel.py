"""Context parallelism for the delta-rule recurrences: the sequence split over the ranks of a process group, each
rank running the op on its contiguous slice from its true initial state.

Non-standard here:
- The state a slice leaves is affine in the state it gets: S_out = M S_in + C, with M = A_T ... A_1 [K, K] and
  A_t = (I - beta_t k_t k_t^T) diag(e^{g_t}) (docs/math.md, "Context parallelism"). The forward first runs a
  pre-pass WITHOUT autograd: the op itself at width V + K, v' = [v | 0_K] from the state [0 | I_K], whose final
  state is [C | M] (each value column is its own recurrence; with v = 0 the update is linear in S, so the identity
  columns end as M). Where the backend would not take width V + K it is two calls (M from I with v = 0, C from 0).
  Under no_grad the dispatch may pick any inference backend for it (the Gluon forward on sm_90). The pieces are
  all-gathered in the state dtype (float32; float64 for float64 values) and chained, so every rank knows every
  rank's initial state; then ONE tracked local forward runs the slice from its own. The pre-pass only replaces
  waiting for the ranks before: nothing is differentiated through it.
- Gradients are exact, through `_ContextParallel`, an autograd Function with the collectives inside its forward and
  backward (every rank must backpropagate through its output, as training does). The local slice's backward is
  linear in (dO, its final-state cotangent), so the gradient of its initial state is dh0 = M^T dht + D, with D
  that gradient for dht = 0. Each rank computes D, all-gathers it with the final-state cotangents, chains in
  reverse (docs/math.md) for its true dht, and runs one local backward with (dO, dht). D comes from the Triton
  kernels' state-gradient chain alone where the tracked forward ran on them without recompute (they offer it,
  `offer_dh0`): one backward pass plus that chain; any other backend gets D from a first backward of the local
  graph with dht = 0 (two backward passes; the CPU and float64 path). A rank whose first segment starts from a
  known state (rank 0, a document starting on its boundary) needs no D.
- initial_state applies at the start of the whole sequence (of each document under varlen); every rank passes the
  same one, and its gradient on each rank is that rank's share: the full gradient is their sum.
- The final state is the same on every rank (each computes it from the gathered pieces, no further exchange); its
  gradient is the sum of every rank's cotangent (they are all-gathered in the backward), so a loss should count it
  on one rank, as with any replicated tensor.
- Varlen: cu_seqlens are the global offsets of the whole row and every rank's slice has the same length T, so
  rank r holds positions [r T, (r + 1) T). A rank's slice splits into its first segment (the document running in
  at its start, whose state is chained), the documents after it (from their own initial states, known locally)
  and, if the last of those runs past the slice, the state it leaves ("tail"), which the next rank takes. The
  pre-pass and the tracked forward are each one varlen call over the rank's segments; the reverse chain follows
  the same documents backwards (a segment's dht is its document's final-state cotangent where the document ends
  on this rank, else the next rank's first-segment dh0).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .offsets import host_offsets
from .validate import check_cu_seqlens, check_shape, check_state_dtype, state_dtype


class _Gather(torch.autograd.Function):
    """all_gather stacked [R, *x.shape]; backward: the gradients summed over ranks, this rank's row."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _all_gather(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


def _all_gather(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.stack(parts)


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


# ------------------------------------------------------------------------------------------------- D from a kernel

# while `_ContextParallel` runs its tracked local forward: the list that kernels offering D append to
_OFFERS: contextvars.ContextVar[list | None] = contextvars.ContextVar("hybridlm_cp_dh0_offers", default=None)


@contextlib.contextmanager
def _collect_offers():
    offers: list[Callable] = []
    token = _OFFERS.set(offers)
    try:
        yield offers
    finally:
        _OFFERS.reset(token)


def wants_dh0() -> bool:
    """Whether a kernel's forward should offer `offer_dh0`: only inside the tracked forward of `run`, never while
    torch.compile traces (the offer reads the call's autograd node, which Dynamo cannot trace)."""
    return not torch.compiler.is_compiling() and _OFFERS.get() is not None


def offer_dh0(fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Called by a differentiable kernel right after its forward: fn(do) is the gradient of that call's
    initial_state for the output cotangent do and no final-state cotangent ([N, HV, K, V], state dtype), from the
    forward's saved buffers, cheaper than a backward. A no-op outside the tracked forward of `run`."""
    offers = _OFFERS.get()
    if offers is not None:
        offers.append(fn)


# ------------------------------------------------------------------------------------------------- the plan


@dataclass
class _Plan:
    """One call's layout over the ranks (module docstring); everything the Function needs besides tensors."""

    local: Callable  # the op on local data (dispatch without a group)
    kw: dict  # the op's other arguments, passed on to local (no tensors)
    names: tuple[str, ...]  # the Function's tensor inputs after q, k, v, g, beta, initial_state (e.g. A_log)
    group: object
    rank: int
    R: int
    B: int
    T: int  # positions a rank
    HV: int
    K: int
    V: int
    sd: torch.dtype  # the state dtype
    varlen: bool
    starts: list[int]  # global document starts (varlen; else range(B))
    ends: list[int]
    n_docs: int
    segs: list[tuple[int, int, int]]  # this rank's (document, local start, local end), in order (varlen)
    wide: bool  # the pre-pass is one call at width V + K
    output_final_state: bool
    track: bool  # gradients are needed (grad mode on at the call and an input requires them)

    def n0(self, r: int) -> int:
        """The document rank r's slice starts in (varlen)."""
        a = r * self.T
        return next(n for n, (s, e) in enumerate(zip(self.starts, self.ends)) if s <= a < e)

    def chained(self, r: int) -> bool:
        """Rank r's first segment starts from the state the rank before leaves."""
        return r > 0 if not self.varlen else self.starts[self.n0(r)] < r * self.T

    def first_ends_here(self, r: int) -> bool:
        """Rank r's first segment is the end of its document (its final state is returned, not passed on)."""
        return r == self.R - 1 if not self.varlen else self.ends[self.n0(r)] <= (r + 1) * self.T

    def passes_on(self) -> bool:
        """This rank's last segment runs past its slice (the next rank's first segment continues it)."""
        return self.rank < self.R - 1 if not self.varlen else self.ends[self.segs[-1][0]] > (self.rank + 1) * self.T

    @property
    def nf(self) -> int:  # rows of the first segment's state
        return self.B if not self.varlen else 1

    def cu_local(self, device) -> torch.Tensor | None:
        if not self.varlen:
            return None
        return torch.tensor([0] + [e for _, _, e in self.segs], dtype=torch.int32, device=device)


def _zeros(p: _Plan, n: int, width: int | None = None, like: torch.Tensor | None = None) -> torch.Tensor:
    return torch.zeros(n, p.HV, p.K, p.V if width is None else width, dtype=p.sd, device=like.device)


def _fresh(p: _Plan, init: torch.Tensor | None, n: int, like: torch.Tensor) -> torch.Tensor:
    """The state document n starts from, [1, HV, K, V]."""
    return init[n : n + 1] if init is not None else _zeros(p, 1, like=like)


def _call(p: _Plan, x: dict, v: torch.Tensor, h0: torch.Tensor, end: int | None = None, varlen: bool = True,
          final: bool = True):
    """local on positions [0, end) of the slice (all of it when end is None) with values v, from h0."""
    sl = (lambda t: t) if end is None else (lambda t: t[:, :end])
    extra = {n: x[n] for n in p.names}
    return p.local(sl(x["q"]), sl(x["k"]), sl(v), g=sl(x["g"]), beta=sl(x["beta"]), initial_state=h0,
                   output_final_state=final, cu_seqlens=p.cu_local(v.device) if varlen else None, **p.kw, **extra)


# ------------------------------------------------------------------------------------------------- forward pieces


def _prepass(p: _Plan, x: dict, init: torch.Tensor | None) -> list[torch.Tensor]:
    """(without autograd) the first segment's M [nf, HV, K, K] and C [nf, HV, K, V] and, under varlen, the tail
    [1, HV, K, V] and the final states [n_docs, HV, K, V] of the later documents that end on this rank."""
    v = x["v"]
    B, T, HV, K, V = p.B, p.T, p.HV, p.K, p.V
    rest = [_fresh(p, init, n, v) for n, _, _ in p.segs[1:]]
    eye = torch.eye(K, dtype=p.sd, device=v.device).expand(p.nf, HV, K, K)
    if p.wide:
        vw = torch.cat([v, v.new_zeros(B, T, HV, K)], dim=-1)
        h0 = torch.cat([torch.cat([_zeros(p, p.nf, like=v), eye], dim=-1),
                        *(torch.cat([r, _zeros(p, 1, K, like=v)], dim=-1) for r in rest)])
        F = _call(p, x, vw, h0)[1]
        M, F = F[: p.nf, ..., V:], F[..., :V]
    else:
        f_end = T if not p.varlen else p.segs[0][2]
        M = _call(p, x, v.new_zeros(B, f_end, HV, K), eye.contiguous(), end=f_end, varlen=False)[1]
        F = _call(p, x, v, torch.cat([_zeros(p, p.nf, like=v), *rest]))[1]
    pieces = [M, F[: p.nf]]
    if p.varlen:
        tail = F[-1:] if p.passes_on() and len(p.segs) > 1 else _zeros(p, 1, like=v)
        finals = _zeros(p, p.n_docs, like=v)
        for i, (n, _, _) in enumerate(p.segs[1:], 1):
            if p.ends[n] <= (p.rank + 1) * T:
                finals[n] = F[i]
        pieces += [tail, finals]
    return pieces


def _pack(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in parts])


def _unpack(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    sizes = [t.numel() for t in like]
    return [piece.view(t.shape) for piece, t in zip(flat.split(sizes), like)]


def _chain(p: _Plan, got: list[list[torch.Tensor]], init: torch.Tensor | None, like: torch.Tensor):
    """Every rank's initial state (of its first segment) and the final states of the whole sequence (every
    document's under varlen), from the gathered pieces."""
    s_in, s_out = [], []
    for r in range(p.R):
        if not p.chained(r):
            s = (init if init is not None else _zeros(p, p.B, like=like)) if not p.varlen \
                else _fresh(p, init, p.n0(r), like)
        else:
            s = s_out[-1]
        s_in.append(s)
        through = torch.matmul(got[r][0], s) + got[r][1]  # the first segment's end state
        covers = not p.varlen or p.ends[p.n0(r)] >= (r + 1) * p.T  # the first segment is the whole slice
        s_out.append(through if covers else got[r][2])
    if not p.varlen:
        return s_in, s_out[-1]
    out = []
    for n, (s, e) in enumerate(zip(p.starts, p.ends)):
        if s == e:
            out.append(_fresh(p, init, n, like))
            continue
        r = (e - 1) // p.T
        if s <= r * p.T:  # the document is the first segment of the rank it ends on
            out.append(torch.matmul(got[r][0], s_in[r]) + got[r][1])
        else:
            out.append(got[r][3][n : n + 1])
    return s_in, torch.cat(out)


def _grads(outputs, inputs, grad_outputs, retain: bool) -> list[torch.Tensor | None]:
    """autograd.grad over the outputs that are in the graph; None for inputs that need no gradient, zeros for one
    that does but is not reached."""
    pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if o.requires_grad]
    want = [i for i in inputs if i is not None and i.requires_grad]
    got = iter(torch.autograd.grad([o for o, _ in pairs], want, [g for _, g in pairs], retain_graph=retain,
                                   allow_unused=True, materialize_grads=True) if pairs and want else
               [torch.zeros_like(i) for i in want])
    return [next(got) if i is not None and i.requires_grad else None for i in inputs]


# ------------------------------------------------------------------------------------------------- the Function


class _ContextParallel(torch.autograd.Function):
    """(o of this slice, final states) from the slice's inputs; the collectives inside (module docstring)."""

    @staticmethod
    def forward(ctx, p: _Plan, q, k, v, g, beta, init, *extra):
        x = {"q": q, "k": k, "v": v, "g": g, "beta": beta, **dict(zip(p.names, extra))}
        pieces = _prepass(p, x, init)
        flat = _all_gather(_pack(pieces), p.group)
        got = [_unpack(flat[r], pieces) for r in range(p.R)]
        s_in, final = _chain(p, got, init, v)
        h0 = torch.cat([s_in[p.rank], *(_fresh(p, init, n, v) for n, _, _ in p.segs[1:])])
        names = ("q", "k", "v", "g", "beta", *p.names)
        needs = dict(zip(names, ctx.needs_input_grad[1:6] + ctx.needs_input_grad[7:]))
        if not p.track:
            o = _call(p, x, v, h0, final=False)[0]
            return o, final if p.output_final_state else v.new_empty(0)
        with torch.enable_grad(), _collect_offers() as offers:
            leaves = {n: (x[n].detach().requires_grad_(needs[n]) if x[n] is not None else None) for n in names}
            h0 = h0.detach().requires_grad_(True)
            o, ht = _call(p, leaves, leaves["v"], h0)
        ctx.p, ctx.graph = p, (o, ht, [leaves[n] for n in names], h0, offers[0] if len(offers) == 1 else None)
        ctx.M = [got[r][0] for r in range(p.R)]
        ctx.init_grad = ctx.needs_input_grad[6]
        if not p.output_final_state:
            final = v.new_empty(0)
            ctx.mark_non_differentiable(final)
        return o.detach(), final

    @staticmethod
    def backward(ctx, do, dfinal):
        p = ctx.p
        o, ht, leaves, h0, offer = ctx.graph
        ctx.graph = None
        do = do.contiguous()
        # D: this rank's first-segment initial-state gradient with no final-state cotangent
        if not p.chained(p.rank):
            D = _zeros(p, p.nf, like=do)
        elif offer is not None:
            D = offer(do)[: p.nf].to(p.sd)
        else:
            D = _grads([o], [h0], [do], retain=True)[0][: p.nf]
        dfin = dfinal.to(p.sd) if p.output_final_state else _zeros(p, p.n_docs if p.varlen else p.B, like=do)
        flat = _all_gather(_pack([D, dfin]), p.group)
        got = [_unpack(flat[r], [D, dfin]) for r in range(p.R)]
        dfin_all = sum(gr[1] for gr in got)
        dht = _local_dht(p, ctx.M, [gr[0] for gr in got], dfin_all, do)
        *grads, dh0 = _grads([o, ht], [*leaves, h0], [do, dht], retain=False)
        dinit = _init_grad(p, dh0, dfin) if ctx.init_grad else None
        return (None, *grads[:5], dinit, *grads[5:])


def _local_dht(p: _Plan, M: list[torch.Tensor], D: list[torch.Tensor], dfin: torch.Tensor, like) -> torch.Tensor:
    """The final-state cotangent of each of this rank's segments [segments, HV, K, V]."""
    x_next = None  # the gradient of rank r's first-segment initial state, r from the last rank down to rank + 1
    if p.passes_on():
        for r in range(p.R - 1, p.rank, -1):
            if p.first_ends_here(r):
                d = dfin if not p.varlen else dfin[p.n0(r) : p.n0(r) + 1]
            else:
                d = x_next
            x_next = torch.matmul(M[r].transpose(-1, -2), d) + D[r]
    if not p.varlen:
        return dfin if p.rank == p.R - 1 else x_next
    return torch.cat([dfin[n : n + 1] if p.ends[n] <= (p.rank + 1) * p.T else x_next for n, _, _ in p.segs])


def _init_grad(p: _Plan, dh0: torch.Tensor, dfin: torch.Tensor) -> torch.Tensor:
    """This rank's share of initial_state's gradient: the initial-state gradients of the segments that start a
    document here, and (varlen) its own final-state cotangent of the empty documents."""
    if not p.varlen:
        return dh0 if p.rank == 0 else torch.zeros_like(dh0)
    out = _zeros(p, p.n_docs, like=dh0)
    for i, (n, _, _) in enumerate(p.segs):
        if p.starts[n] >= p.rank * p.T:
            out[n] += dh0[i]
    for n, (s, e) in enumerate(zip(p.starts, p.ends)):
        if s == e:
            out[n] += dfin[n]
    return out


# ------------------------------------------------------------------------------------------------- the entry


def run(local: Callable, q, k, v, *, g, beta, initial_state, output_final_state, cu_seqlens, group,
        state_pool=None, state_indices=None, takes_width: Callable[[int], bool] = lambda width: True,
        **kw) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A recurrence on this rank's slice of a sequence split over `group` (module docstring).

    local(q, k, v, g=, beta=, initial_state=, output_final_state=, cu_seqlens=) runs the op on local data (the
    public op's dispatch without a group; kw, e.g. scale, impl's settings and KDA's gate tensors, is passed on to
    it). takes_width(W): the backend that runs local without gradients takes values of width W as it takes v's
    (then the pre-pass is one call at width V + K).
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
        n_docs, segs = B, []
    else:
        if T == 0:
            raise ValueError("v: expected a slice of at least one position a rank with cp_group and cu_seqlens, "
                             "got T=0")
        n_docs = check_cu_seqlens(cu_seqlens, B=B, T=R * T)
        offsets = host_offsets(cu_seqlens)
        starts, ends = offsets[:-1], offsets[1:]
        a = rank * T
        segs = [(n, max(s, a) - a, min(e, a + T) - a) for n, (s, e) in enumerate(zip(starts, ends))
                if s < e and s < a + T and e > a]
    if initial_state is not None:
        check_shape("initial_state", initial_state, (n_docs, HV, K, V), f"[N={n_docs}, HV={HV}, K={K}, V={V}]")
        check_state_dtype("initial_state", initial_state, v.dtype)
        initial_state = initial_state.to(sd)
    names = tuple(n for n, t in kw.items() if isinstance(t, torch.Tensor))
    p = _Plan(local=local, kw={n: t for n, t in kw.items() if n not in names}, names=names, group=group, rank=rank,
              R=R, B=B, T=T, HV=HV, K=K, V=V, sd=sd, varlen=cu_seqlens is not None, starts=starts, ends=ends,
              n_docs=n_docs, segs=segs, wide=takes_width(V + K), output_final_state=output_final_state,
              track=torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in
                                                    (q, k, v, g, beta, initial_state, *(kw[n] for n in names))))
    o, final = _ContextParallel.apply(p, q, k, v, g, beta, initial_state, *(kw[n] for n in names))
    return o, (final if output_final_state else None)
