"""Sibling projections: several nn.Linear on one input x as one autograd node (`fused_linear`).

Non-standard here (the parameters stay the layers' own nn.Linear modules: names, shapes, init and checkpoints are
untouched; only the computation is shared):
- The backward accumulates dX of all siblings in the GEMM epilogue (addmm with beta 1) into one [N, D] buffer.
  Separate Linears would each write their own dX and autograd would add them with one elementwise kernel per
  extra sibling.
- Output gradients are never concatenated. `F.linear(x, cat(W)).split(...)` would run one dX GEMM, but split's
  backward is a cat of the output gradients: a copy of [N, sum of widths] that for SwiGLU's gate and up (2I wide)
  moves more bytes than the add it saves. Wide outputs therefore keep a GEMM each, forward and backward.
- Skinny outputs (at most D / 8 wide: GDN's b and a, KDA's beta and low-rank gate inputs) ride along in one GEMM.
  Their weights are concatenated and their outputs are views of one tensor. They read x once instead of once each,
  and their gradients, cheap to concatenate, share one dX and one dW GEMM.
- A tuple of Linears is one output, its weights concatenated along the output dim: q, k and v go into the short
  conv as one tensor without a cat of [N, 2 dk + dv] activations.
- Without a graph and with fewer tokens than output rows (decode) each Linear runs alone: the weight copy of a
  concatenation would move more bytes than the GEMMs it merges.
- Under autocast x, weights and biases are cast first (as F.linear would cast them), so the saved tensors and the
  backward GEMMs are in the autocast dtype. Outside it, the dtypes must match as for nn.Linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from .norm import autocast_dtype

Member = nn.Linear | tuple[nn.Linear, ...]


def fused_linear(x: torch.Tensor, *members: Member) -> tuple[torch.Tensor, ...]:
    """x: [..., D]; members: nn.Linear, or tuples of them, on D inputs -> one tensor [..., out] per member (a tuple's
    outputs concatenated in its order), equal to the Linears' own outputs up to matmul rounding. A member that is
    another module (a projection a model replaced, e.g. by Linear + conv), or a Linear with hooks, runs as itself."""
    groups = [m if isinstance(m, tuple) else (m,) for m in members]
    plain = [i for i, g in enumerate(groups) if all(_plain(lin) for lin in g)]
    outs = [torch.cat([mod(x) for mod in g], dim=-1) if len(g) > 1 else g[0](x)
            for i, g in enumerate(groups) if i not in plain]
    fused = iter(_linears_on(x, [groups[i] for i in plain]) if plain else ())
    others = iter(outs)
    return tuple(next(fused) if i in plain else next(others) for i in range(len(groups)))


def _plain(m: nn.Module) -> bool:
    """An nn.Linear whose call is F.linear(x, weight, bias): its own forward, no hooks."""
    return type(m).forward is nn.Linear.forward and not (m._forward_hooks or m._forward_pre_hooks)


def _linears_on(x: torch.Tensor, groups: list[tuple[nn.Linear, ...]]) -> tuple[torch.Tensor, ...]:
    layout = tuple(tuple(lin.out_features for lin in g) for g in groups)
    params = [p for g in groups for lin in g for p in (lin.weight, lin.bias)]
    half = autocast_dtype(x)
    if half is not None:
        x, params = x.to(half), [None if p is None else p.to(half) for p in params]
    units = _units(layout, x.shape[-1])
    if torch.is_grad_enabled() and (x.requires_grad or any(p is not None and p.requires_grad for p in params)):
        return _Siblings.apply(x, layout, units, *params)
    if x.numel() // x.shape[-1] < sum(map(sum, layout)):  # decode: copying the weights costs more than it merges
        it = iter(zip(params[0::2], params[1::2]))
        return tuple(torch.cat([F.linear(x, *next(it)) for _ in g], dim=-1) if len(g) > 1 else F.linear(x, *next(it))
                     for g in layout)
    return tuple(_forward(x, layout, units, params[0::2], params[1::2])[0])


def _units(layout: tuple[tuple[int, ...], ...], D: int) -> tuple[tuple[int, ...], ...]:
    """The GEMMs: each wide member alone, the skinny ones (<= D / 8 wide) together, in member order."""
    skinny = tuple(m for m, widths in enumerate(layout) if 8 * sum(widths) <= D)
    wide = [(m,) for m in range(len(layout)) if m not in skinny]
    return tuple(sorted(wide + ([skinny] if skinny else []), key=lambda u: u[0]))


def _linears(layout, unit) -> list[int]:
    """The flat indices of the Linears of a unit's members."""
    starts = [sum(len(g) for g in layout[:m]) for m in range(len(layout))]
    return [starts[m] + j for m in unit for j in range(len(layout[m]))]


def _forward(x, layout, units, ws, bs) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """-> (outputs in member order, each unit's weight [rows, D])."""
    outs, unit_ws = [None] * len(layout), []
    for unit in units:
        idx = _linears(layout, unit)
        w = ws[idx[0]] if len(idx) == 1 else torch.cat([ws[j] for j in idx])
        b = None
        if any(bs[j] is not None for j in idx):  # a Linear without a bias adds zeros
            b = torch.cat([bs[j] if bs[j] is not None else ws[j].new_zeros(ws[j].shape[0]) for j in idx])
        y = F.linear(x, w, b)
        parts = y.split([sum(layout[m]) for m in unit], dim=-1) if len(unit) > 1 else (y,)
        for m, part in zip(unit, parts):
            outs[m] = part
        unit_ws.append(w)
    return outs, unit_ws


def _rows(t: torch.Tensor, widths: list[int]) -> tuple[torch.Tensor, ...]:
    return t.split(widths) if len(widths) > 1 else (t,)


class _Siblings(torch.autograd.Function):
    """fused_linear with the backward of the module docstring; inputs (x, layout, units, w0, b0, w1, b1, ...)."""

    @staticmethod
    def forward(ctx, x, layout, units, *params):
        outs, unit_ws = _forward(x, layout, units, params[0::2], params[1::2])
        ctx.save_for_backward(x, *unit_ws)
        ctx.layout, ctx.units, ctx.has_bias = layout, units, [b is not None for b in params[1::2]]
        ctx.set_materialize_grads(False)  # an unused output costs no GEMM
        return tuple(outs)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        x, *unit_ws = ctx.saved_tensors
        layout, need = ctx.layout, ctx.needs_input_grad
        x2 = x.reshape(-1, x.shape[-1])
        dx, dparams = None, [None] * (2 * len(ctx.has_bias))
        for unit, w in zip(ctx.units, unit_ws):
            live = [m for m in unit if grads[m] is not None]
            if not live:
                continue
            g = torch.cat([grads[m].reshape(-1, sum(layout[m])) for m in live], dim=-1) if len(live) > 1 \
                else grads[live[0]].reshape(-1, sum(layout[live[0]]))
            if len(live) < len(unit):  # the rows of the live members only
                rows = dict(zip(unit, w.split([sum(layout[m]) for m in unit])))
                w = torch.cat([rows[m] for m in live])
            if need[0]:
                dx = g.mm(w) if dx is None else dx.addmm_(g, w)
            idx = _linears(layout, tuple(live))
            widths = [n for m in live for n in layout[m]]
            if any(need[3 + 2 * j] for j in idx):
                for j, dw in zip(idx, _rows(g.t().mm(x2), widths)):
                    dparams[2 * j] = dw if need[3 + 2 * j] else None
            if any(ctx.has_bias[j] and need[4 + 2 * j] for j in idx):
                for j, db in zip(idx, _rows(g.sum(0), widths)):
                    dparams[2 * j + 1] = db if ctx.has_bias[j] and need[4 + 2 * j] else None
        return (None if dx is None else dx.view(x.shape), None, None, *dparams)
