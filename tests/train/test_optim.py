"""The autocast context of a training step (`hybridlm.train.optim.autocast`) and the weight-decay groups, shared by
`hybridlm train` and the MQAR benchmark."""

from __future__ import annotations

import torch

from hybridlm.train.optim import autocast, build_optimizer


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


def test_no_decay_names_pick_which_matrices_skip_weight_decay():
    model = torch.nn.ModuleDict({"embed": torch.nn.Embedding(8, 4), "proj": torch.nn.Linear(4, 4),
                                 "norm": torch.nn.LayerNorm(4)})

    def decayed(opt):
        return {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}

    # default: the embedding is not decayed; vectors (biases, norm weights) never are
    assert decayed(build_optimizer(model, 1e-3, 0.1)) == {id(model["proj"].weight)}
    # no names: every matrix decays (the MQAR benchmark's rule), vectors still do not
    assert decayed(build_optimizer(model, 1e-3, 0.1, no_decay=())) == {id(model["proj"].weight),
                                                                        id(model["embed"].weight)}
