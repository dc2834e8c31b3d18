"""What the GPU comparisons with fla share: the error they bound (max |x - ref| / max |ref|, per tensor), the line
they print for each tensor, and the rule for fla's exceptions: an exception fails the test unless it is one of the
known limitations the test names (a type name, a piece of its message, and a one-line reason), which xfail it.

Imported by the *_vs_fla.py modules beside it (tests/ops is on sys.path under pytest's default import mode).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch


class Limit(NamedTuple):
    """A known limitation of fla: an exception of type `kind` (its class name) whose message contains `text`."""

    kind: str
    text: str
    reason: str


def run_fla(fn: Callable, limits: list[Limit] = ()):
    """fn() (fla's call); a known limitation xfails the test with its reason, any other exception fails it."""
    try:
        return fn()
    except Exception as e:
        for lim in limits:
            if type(e).__name__ == lim.kind and lim.text in str(e):
                pytest.xfail(f"known fla limitation: {lim.reason} ({type(e).__name__}: {str(e)[:120]})")
        raise


def max_err(x: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max |x - ref|, max |ref|), in float64; inf when x holds a NaN or an inf."""
    x = x.double()
    scale = ref.abs().max().item()
    return ((x - ref).abs().max().item() if torch.isfinite(x).all() else float("inf")), scale


def check(tag: str, name: str, x: torch.Tensor, ref: torch.Tensor, bar: float, bad: list) -> None:
    """Print `PARITY <tag> <name> err=<max abs err / max |ref|> bar=<bar> (max |ref| ...)` and add the tensor to
    `bad` when its error is over the bar."""
    err, scale = max_err(x, ref)
    rel = err / (scale or 1.0)
    print(f"PARITY {tag} {name} err={rel:.3e} bar={bar:.0e} (max |ref| {scale:.3e})")
    if not rel <= bar:
        bad.append((name, f"{rel:.3e}"))
