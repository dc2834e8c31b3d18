"""The autocast context of a training step (`hybridlm.train.optim.autocast`), shared by `hybridlm train` and the
MQAR benchmark."""

from __future__ import annotations

import torch

from hybridlm.train.optim import autocast


def test_autocast_is_bf16_when_asked_and_a_no_op_otherwise():
    cpu = torch.device("cpu")
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with autocast(cpu, True):
        assert (a @ b).dtype == torch.bfloat16 and torch.is_autocast_cache_enabled()
    with autocast(cpu, True, cache=False):  # what a CUDA graph needs: no cast weights kept across replays
        assert (a @ b).dtype == torch.bfloat16 and not torch.is_autocast_cache_enabled()
    assert torch.is_autocast_cache_enabled()  # restored on exit
    with autocast(cpu, False):
        assert (a @ b).dtype == torch.float32 and not torch.is_autocast_enabled("cpu")
