"""What the CPU tests of the Gluon backward's switches (tests/ops/test_gluon_gdn_bwd.py, test_gluon_chunk_bwd.py)
share besides the `hopper` fixture (tests/ops/conftest.py): a stand-in that records the launches it takes.

Imported by the test modules beside it (tests/ops is on sys.path under pytest's default import mode).
"""

from __future__ import annotations


class Recorder:
    """Stands in for a Triton kernel (`kernel[grid](...)`) or a host function, recording its calls."""

    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def __getitem__(self, grid):
        return lambda *a, **kw: self.calls.append((self.name, a, kw))

    def __call__(self, *a, **kw):
        self.calls.append((self.name, a, kw))
