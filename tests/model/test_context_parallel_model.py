"""Context parallelism of the whole model on the CPU (gloo, 2 processes): a tiny 3:1 hybrid in float64 whose sequence
is split over the ranks against the same model on the whole sequence -- each rank's logits, the loss (summed over
the ranks) and the gradient of every parameter (summed over the ranks) -- for a plain batch and for packed documents
that cross the rank boundary (one starting inside the conv's reach before it, one ending on it, one empty). Two
models: test-micro (Gated DeltaNet + gated attention with RoPE, GQA) and KDA + MLA (Kimi's layers).

The processes are started with torch.multiprocessing (spawn) and meet through a file store in tmp_path: no ports.
One spawn runs every case, since the start-up of the processes costs more than the cases.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybridlm import HybridConfig, HybridLM
from hybridlm.model.presets import get_preset

TOL = 1e-10  # float64: rounding only; a missing exchange or gradient share is O(1)
R, T = 2, 12  # ranks, positions a rank
# GDN computes g in float32 (hybridlm.ops.glue.gdn_gates), so A_log's and dt_bias' gradients are sums of float32
# terms, which the split sums in another order: float32 rounding, where a missing term would be O(1)
GATE_TOL, GDN_GATES = 1e-6, ("mixer.A_log", "mixer.dt_bias")
# global document offsets: a document starting 2 positions before the boundary (the conv's tail partly its own);
# a document ending on the boundary and one starting on it
OFFSETS = ([0, 3, 10, 20, 24], [0, 7, 12, 24])


def _configs() -> dict[str, HybridConfig]:
    micro = get_preset("test-micro")
    kimi = HybridConfig.from_dict({**micro.to_dict(), "linear_kind": "kda", "linear_num_key_heads": 2,
                                   "attention_kind": "mla", "kv_lora_rank": 8, "qk_nope_head_dim": 8,
                                   "qk_rope_head_dim": 4, "v_head_dim": 8})
    return {"test-micro": micro, "kda+mla": kimi}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm().clamp_min(1e-300)).item()


def _case(name: str, cfg: HybridConfig, offsets: list[int] | None, rank: int, group, seed: int) -> None:
    torch.manual_seed(seed)  # the same parameters on every rank
    model = HybridLM(cfg).double()
    params = dict(model.named_parameters())
    gen = torch.Generator().manual_seed(seed + 1)
    B = 1 if offsets else 2
    ids = torch.randint(0, cfg.vocab_size, (B, R * T), generator=gen)
    targets = torch.cat([ids[:, 1:], torch.full((B, 1), -100)], dim=1)
    cu = None if offsets is None else torch.tensor(offsets, dtype=torch.int32)
    if cu is not None:
        targets[:, [e - 1 for e in offsets[1:] if e > 0]] = -100  # no target across a document's end

    with torch.no_grad():
        logits_ref = model(ids, cu_seqlens=cu).logits
    loss_ref = model(ids, cu_seqlens=cu, targets=targets).loss
    grads_ref = torch.autograd.grad(loss_ref, list(params.values()))

    sl = slice(rank * T, (rank + 1) * T)
    # global positions: explicit for the plain batch, the default (restarting per document) for packed documents
    pos = None if cu is not None else torch.arange(rank * T, (rank + 1) * T)[None].expand(B, T)
    with torch.no_grad():
        logits = model(ids[:, sl], cu_seqlens=cu, position_ids=pos, cp_group=group).logits
    loss = model(ids[:, sl], cu_seqlens=cu, position_ids=pos, targets=targets[:, sl], cp_group=group).loss
    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True, materialize_grads=True)

    case = f"{name} offsets={offsets} rank {rank}/{R}"
    err = _rel(logits, logits_ref[:, sl])
    assert err <= TOL, f"{case} logits: rel error {err:.3g} > {TOL} (seed {seed})"
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)  # the loss of the whole sequence: the sum over the ranks
    err = _rel(total, loss_ref.detach())
    assert err <= TOL, f"{case} loss: rel error {err:.3g} > {TOL} (seed {seed})"
    for n, got, want in zip(params, grads, grads_ref):
        got = got.clone()
        dist.all_reduce(got, group=group)
        err = _rel(got, want)
        tol = GATE_TOL if n.endswith(GDN_GATES) and cfg.linear_kind == "gdn" else 10 * TOL
        assert err <= tol, f"{case} d{n}: rel error {err:.3g} > {tol} (seed {seed})"


def _refusals(rank: int, group) -> None:
    """One-line errors naming the argument, raised on every rank alike before any exchange."""
    model = HybridLM(get_preset("test-micro")).double()
    ids = torch.zeros(1, T, dtype=torch.long)
    with pytest.raises(ValueError, match=f"cu_seqlens: expected global offsets from 0 to {R * T}"):
        model(ids, cu_seqlens=torch.tensor([0, T], dtype=torch.int32), cp_group=group)
    with pytest.raises(ValueError, match="attention_mask: expected None with cp_group"):
        model(ids, attention_mask=torch.ones(1, T, dtype=torch.long), cp_group=group)
    with pytest.raises(ValueError, match="cache: expected None with cp_group"):
        model(ids, cache=model.new_cache(), cp_group=group)
    mesa = HybridConfig.from_dict({**get_preset("test-micro").to_dict(), "linear_kind": "mesa",
                                   "linear_num_key_heads": 2})
    with pytest.raises(ValueError, match="cp_group: context parallelism covers .* got MesaNet"):
        HybridLM(mesa)(ids, cp_group=group)


def _worker(rank: int, store: str, seed: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=R)
    try:
        group = dist.new_group(list(range(R)))  # a group of its own, as a context-parallel mesh dimension gives
        for name, cfg in _configs().items():
            for offsets in (None, *OFFSETS):
                _case(name, cfg, offsets, rank, group, seed)
        _refusals(rank, group)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built")
def test_context_parallel_model_matches_whole_sequence(tmp_path, seed):
    env = dict(os.environ)
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        mp.start_processes(_worker, args=(str(tmp_path / "store"), seed), nprocs=R, join=True,
                           start_method="spawn")
    finally:
        os.environ.clear()
        os.environ.update(env)
