"""What the float64 equality tests of the ops share: the relative error they bound and the seed they draw.

Imported by the test modules beside it (tests/ops is on sys.path under pytest's default import mode).
"""

from __future__ import annotations

import torch

F64 = torch.float64


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (b == 0 gives ||a|| / 1e-300: any difference fails)."""
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def draw_seed() -> int:
    """A seed from torch's global RNG (which the suite seeds afresh for every test and reports)."""
    return int(torch.randint(0, 2**31 - 1, ()))
