"""Launch settings of the Triton kernels: one typed table per op (`gdn.TUNE`, `kda.TUNE`, `conv.TUNE`, ...).

Each table is a dataclass whose fields are the settings a measured shape actually selects, with a comment per
field; the values are the defaults the benchmarks were taken with. A tuner or a test changes them for a scope
with `tuned(table, **settings)`; an unknown name is an error, not a setting that no kernel reads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager


class LaunchTable:
    """Base of the per-op tables: `update(**settings)` with every name checked."""

    def update(self, **settings) -> None:
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(settings) - names)
        if unknown:
            raise ValueError(f"{type(self).__name__}: unknown settings {unknown}; expected among {sorted(names)}")
        for name, value in settings.items():
            setattr(self, name, value)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@contextmanager
def tuned(table: LaunchTable, **settings) -> Iterator[LaunchTable]:
    """Run a block with some settings of `table` changed; the old values come back afterwards."""
    old = table.as_dict()
    table.update(**settings)
    try:
        yield table
    finally:
        table.update(**old)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for launch grids on the host (`triton.cdiv` is a constexpr function: ~2-5 us a host call)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1), for block sizes on the host (as `triton.next_power_of_2`)."""
    return 1 << (n - 1).bit_length()

