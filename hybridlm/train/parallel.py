"""Several GPUs from outside the model: torch.distributed set-up, FSDP2, activation checkpointing, DCP checkpoints.

Non-standard here: the model code knows nothing of sharding. `apply_fsdp` finds the model's block list (the
`nn.ModuleList` with `num_hidden_layers` entries), calls `fully_shard` on units of consecutive blocks (one block
each for a large model; several for a small one, whose per-unit host cost the GPU would not hide) and then on the
root with a `MixedPrecisionPolicy` (fp32 params gathered, bf16 compute by autocast, fp32 gradient reduction).
Context parallelism (--context-parallel N): the ranks form a 2-D DeviceMesh ("dp", "cp") of world / N x N; the N
ranks of a "cp" group run the same rows, each its contiguous slice of the sequence (HybridLM's cp_group), FSDP2
shards over "dp" only (with dp = 1 the parameters are replicated, no FSDP), and `all_reduce_cp_grads` sums the
gradients of a cp group, whose ranks each hold the gradient of their own tokens only.
Sharded checkpoints use torch.distributed.checkpoint (each rank writes its shards into the same temp folder, rank 0
renames it);
`export_full` gathers a full state dict onto rank 0 for a single-safetensors folder that `from_pretrained` loads.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, replace

import torch
from torch import nn


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    cp: int = 1  # context-parallel ranks per group (--context-parallel); ranks r*cp .. r*cp+cp-1 share rows
    cp_group: object = None  # the ProcessGroup of this rank's cp group (None without context parallelism)
    dp_group: object = None  # the ProcessGroup over the data dimension (None: the whole world, or cp == 1)
    dp_mesh: object = None  # the "dp" DeviceMesh FSDP2 shards over (None: the default, the whole world)

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def dp_world(self) -> int:
        """Data-parallel ranks: how many different row sets a step reads."""
        return self.world // self.cp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.cp

    @property
    def cp_rank(self) -> int:
        """This rank's slice of each sequence (0 .. cp-1)."""
        return self.rank % self.cp

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device_arg: str) -> Dist:
    """Read torchrun's environment; with WORLD_SIZE > 1 start the process group (nccl on GPU, gloo on CPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_arg == "auto":
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    else:
        device_type = torch.device(device_arg).type
    if device_type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda: no CUDA device is visible; use --device cpu")
        idx = local_rank if world > 1 or device_arg in ("auto", "cuda") else torch.device(device_arg).index or 0
        device = torch.device("cuda", idx)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1 and not torch.distributed.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        torch.distributed.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=10),
                                             **({"device_id": device} if device.type == "cuda" else {}))
    return Dist(rank, world, local_rank, device)


def init_context_parallel(dist: Dist, n: int) -> Dist:
    """`dist` with a ("dp", "cp") DeviceMesh of world / n x n ranks (row-major: rank = dp_rank * n + cp_rank)."""
    from .errors import TrainError

    if n < 1 or dist.world % n:
        raise TrainError(f"--context-parallel: expected a divisor of the number of ranks ({dist.world}), got {n}")
    if n == 1:
        return dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(dist.device.type, (dist.world // n, n), mesh_dim_names=("dp", "cp"))
    return replace(dist, cp=n, cp_group=mesh.get_group("cp"), dp_group=mesh.get_group("dp"), dp_mesh=mesh["dp"])


def all_reduce_cp_grads(params: list[nn.Parameter], dist: Dist) -> None:
    """Sum the gradients over this rank's cp group (the local shards under FSDP2, which has reduced over "dp"),
    all of them in one flat buffer: one collective a step."""
    if dist.cp == 1:
        return
    grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.SUM, group=dist.cp_group)
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


def barrier(dist: Dist) -> None:
    if dist.enabled:
        torch.distributed.barrier()


def all_reduce_sum(t: torch.Tensor, dist: Dist) -> torch.Tensor:
    if dist.enabled:
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM)
    return t


def find_blocks(model: nn.Module) -> nn.ModuleList:
    """The block list of a HybridLM: the ModuleList with config.num_hidden_layers entries (first found)."""
    n = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    for _, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and (n is None or len(mod) == n):
            return mod
    raise RuntimeError("could not find the model's block list (an nn.ModuleList with num_hidden_layers entries)")


def apply_activation_checkpointing(model: nn.Module) -> int:
    """Recompute each block's activations in the backward (torch.utils.checkpoint, non-reentrant)."""
    from torch.utils.checkpoint import checkpoint

    blocks = find_blocks(model)
    for block in blocks:
        inner = block.forward

        def fwd(*args, _inner=inner, **kwargs):
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        block.forward = fwd
    return len(blocks)


def fsdp_units(blocks: nn.ModuleList, min_unit_params: int) -> list[list[nn.Module]]:
    """Consecutive blocks grouped until each group holds at least `min_unit_params` parameters (the last group
    may hold fewer); 0 gives one group per block."""
    units: list[list[nn.Module]] = []
    size = min_unit_params  # start a new group at the first block
    for block in blocks:
        if size >= min_unit_params:
            units.append([])
            size = 0
        units[-1].append(block)
        size += sum(p.numel() for p in block.parameters())
    return units


def apply_fsdp(model: nn.Module, bf16: bool, reshard_after_forward: bool = True, min_unit_params: int = 0,
               fully_shard=None, mesh=None) -> nn.Module:
    """FSDP2: fully_shard each unit of consecutive blocks, then the root, gradients reduced in fp32. Parameters are
    gathered in fp32 and the bf16 compute comes from the same autocast the one-GPU run uses, so N GPUs compute
    what one GPU computes (a bf16 param_dtype would also round the norms' and gates' weights, which autocast leaves
    in fp32: seen on two H200s as a final loss 0.066 away from one GPU's after 50 steps).
    min_unit_params: blocks are sharded together until a unit holds this many parameters (`fsdp_units`). Each unit
    costs host time in its hooks and collectives every step (on an H100 host the 325M preset's 24 single-block
    units added ~80 ms of host time to a 160 ms step that the host already bounds); a large model's blocks pass
    the bar one by one, as torchtitan wraps them.
    reshard_after_forward=False keeps each unit's gathered parameters from its forward to its backward: one
    all-gather per unit a step instead of two, for the whole model's parameters in memory on every GPU.
    fully_shard: the function to apply (tests pass a recorder; default torch's). mesh: the 1-D DeviceMesh to shard
    over (context parallelism: the "dp" dimension; default the whole world)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if fully_shard is None:
        from torch.distributed.fsdp import fully_shard
    # cast_forward_inputs off: the float inputs of a block are float32 already (residual stream, padding mask) but
    # the previous block's branch, which autocast made bf16 and the fused add + norm reads as it is (a cast to
    # float32 would add a kernel each way per block and change no value)
    mp = (MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False)
          if bf16 else None)
    kw = {"mp_policy": mp} if mp is not None else {}
    if mesh is not None:
        kw["mesh"] = mesh
    for unit in fsdp_units(find_blocks(model), min_unit_params):
        fully_shard(unit[0] if len(unit) == 1 else unit, reshard_after_forward=reshard_after_forward, **kw)
    fully_shard(model, **kw)
    return model


def clip_grad_norm(params: list[nn.Parameter], max_norm: float, dist: Dist) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ (2-norm) computed on each rank's local gradient shards with one all-reduce of
    the squared norm over the data dimension (the ranks of a cp group hold the same gradients), returning the total
    norm on the device. Under FSDP2 the gradients are DTensors and the same
    two calls on them go through DTensor dispatch per tensor: ~5 ms more host time a step for the 325M preset."""
    grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    total = torch.nn.utils.get_total_norm(grads, 2.0)
    if dist.dp_world > 1:
        sq = total.square()
        torch.distributed.all_reduce(sq, op=torch.distributed.ReduceOp.SUM, group=dist.dp_group)
        total = sq.sqrt()
    torch.nn.utils.clip_grads_with_norm_(grads, max_norm, total)
    return total.detach()


def dcp_save(folder: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Sharded model + optimizer state into `folder` (every rank calls this)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=folder)


def dcp_load(folder: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def full_model_state(model: nn.Module, dist: Dist) -> dict[str, torch.Tensor] | None:
    """The unsharded float32 state dict on rank 0's CPU (None on other ranks); every rank must call this."""
    if not dist.enabled:
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return sd if dist.is_main else None
