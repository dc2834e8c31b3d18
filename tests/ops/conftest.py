"""Fixtures of the ops tests: `hopper`, a mocked sm_90 device for the CPU tests of the Gluon kernels' switches."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def hopper(monkeypatch):
    """CPU tensors seen as CUDA tensors on a device of compute capability (9, 0)."""
    from hybridlm.ops.gluon import gdn_fwd

    if not gdn_fwd.gluon_available():
        pytest.fail("the installed Triton lacks the Gluon API (tests/ops/test_gluon_compile.py says which)")
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(gdn_fwd, "_capability", lambda index: (9, 0))
