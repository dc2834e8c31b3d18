"""Per-layer comparison of two models (ours and a reference, e.g. transformers) with forward hooks.

Non-standard here: it knows nothing about either library. The caller passes the two lists of block modules
(`ours.layers` and `hf.model.layers`) and a function that runs each model; the hooks record every block's
output hidden state (`out.hidden_state` where a block has one, else its first output) and the report names the
first block whose output differs by more than `atol`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class LayerDiff:
    layer: int
    max_abs: float


@dataclass
class Comparison:
    diffs: list[LayerDiff]
    first_diverging: int | None  # index of the first block over atol, None if all agree
    atol: float

    def report(self) -> str:
        lines = [f"per-layer max |ours - ref| (atol {self.atol:g}):"]
        for d in self.diffs:
            mark = "  <-- first divergence" if d.layer == self.first_diverging else ""
            lines.append(f"  layer {d.layer:3d}: {d.max_abs:.3e}{mark}")
        if self.first_diverging is None:
            lines.append("  all layers agree")
        return "\n".join(lines)


def _record(modules: Sequence[nn.Module]) -> tuple[list[torch.Tensor | None], list]:
    outs: list[torch.Tensor | None] = [None] * len(modules)
    handles = []
    for i, m in enumerate(modules):
        def hook(_mod, _inp, out, i=i):
            # a block that hands its last branch on to the next one (hybridlm's BlockOutput) has its output as
            # hidden_state; a transformers block returns a tuple whose first entry is it
            t = out.hidden_state if hasattr(out, "hidden_state") else out[0] if isinstance(out, (tuple, list)) else out
            outs[i] = t.detach().float().clone()
        handles.append(m.register_forward_hook(hook))
    return outs, handles


@torch.no_grad()
def compare_layers(ours_layers: Sequence[nn.Module], ref_layers: Sequence[nn.Module], run_ours: Callable[[], object],
                   run_ref: Callable[[], object], *, atol: float = 1e-4,
                   positions: torch.Tensor | None = None) -> Comparison:
    """Run both models once with hooks on their blocks; positions: optional bool [B, T] of positions to compare."""
    if len(ours_layers) != len(ref_layers):
        raise ValueError(f"layer counts differ: ours {len(ours_layers)}, ref {len(ref_layers)}")
    a, ha = _record(ours_layers)
    b, hb = _record(ref_layers)
    try:
        run_ours()
        run_ref()
    finally:
        for h in ha + hb:
            h.remove()
    diffs, first = [], None
    for i, (x, y) in enumerate(zip(a, b)):
        if x is None or y is None or x.shape != y.shape:
            d = float("inf")
        else:
            delta = (x - y).abs()
            if positions is not None:
                delta = delta[positions]
            d = float(delta.max()) if delta.numel() else 0.0
        diffs.append(LayerDiff(i, d))
        if first is None and not d <= atol:
            first = i
    return Comparison(diffs, first, atol)
