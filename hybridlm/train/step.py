"""The device side of a training step: a micro-batch's forward calls, the summed loss, evaluation and sampling.

Non-standard here: nothing in a step waits for the device. Host tensors go to the GPU through pinned memory, the
offsets of packed rows carry their host values (hybridlm.ops.offsets) so that the varlen ops need not read them
back, and every rank makes the same number of forward calls (FSDP's collectives), padding with a call that has no
target.
With context parallelism each call is cut into the cp group's slices (`cp_slice`): every rank of the group has the
same rows and runs its contiguous share of each one, cu_seqlens staying global.
"""

from __future__ import annotations

import torch

from ..ops.offsets import remember_offsets
from .data import IGNORE, RowLayout, make_batch
from .optim import autocast
from .parallel import Dist, all_reduce_sum, clip_grad_norm


def forward_calls(batch, packing: str, n_calls: int):
    """The (input_ids, targets, cu_seqlens) calls of a micro-batch, padded to `n_calls`. Under FSDP every rank must
    make the same number of forward/backward calls (each one all-gathers and reduce-scatters every block), and with
    "auto" packing a batch takes one or two: `n_calls` is the largest count of any rank's batch, which every rank
    works out from the data layout (`RowLayout.n_calls` of each rank's rows: no communication). A rank with fewer
    adds a dummy call (one row, every target ignored: zero loss and zero gradient, but the same collectives), so most
    steps stay at one call per rank."""
    calls = batch.pieces(packing)
    if len(calls) > n_calls:
        raise RuntimeError(f"internal: this batch takes {len(calls)} forward calls but the data layout said at most "
                           f"{n_calls} (RowLayout.n_calls disagrees with Batch.pieces)")
    while len(calls) < n_calls:
        ids = batch.input_ids.view(-1)[: batch.seq_len].view(1, -1)
        calls.append((ids, torch.full_like(ids, IGNORE), None))
    return calls


def cp_slice(ids: torch.Tensor, tg: torch.Tensor, dist: Dist) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's contiguous slice of a call's ids and targets [b, L] -> [b, L / cp] (L is a multiple of --seq-len,
    which the flags' check makes a multiple of cp). A flattened call's documents cross the slices: the model
    chains them (HybridLM's cp_group), so the slices compute what the whole row computes."""
    if dist.cp == 1:
        return ids, tg
    n = ids.shape[1] // dist.cp
    sl = slice(dist.cp_rank * n, (dist.cp_rank + 1) * n)
    return ids[:, sl], tg[:, sl]


def to_device(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """A host tensor onto `device` without blocking the host: pinned first on CUDA (an asynchronous copy from
    pageable memory may wait for the device)."""
    if t is None or t.device == device:
        return t
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def offsets_to_device(cu: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """cu_seqlens onto `device`, with its host values recorded (hybridlm.ops.offsets), so that the varlen ops of
    every layer read them from the host copy instead of waiting for the device."""
    if cu is None:
        return None
    return remember_offsets(to_device(cu, device), cu)


def loss_sum(model, ids, tg, cu, device, bf16, cp_group=None) -> torch.Tensor:
    """The sum of token losses of one forward call: the model's head and loss fused (hybridlm.ops.linear_ce), so
    the [tokens, vocab] logits are never held; inside the forward, so FSDP has the head's weight gathered.
    cp_group: ids and tg are this rank's slice (`cp_slice`) and the sum is over its own targets."""
    cp = {} if cp_group is None else {"cp_group": cp_group}
    with autocast(device, bf16):
        return model(ids, cu_seqlens=cu, targets=tg, **cp).loss


@torch.no_grad()
def evaluate(model, stream, args, dist: Dist, device, bf16, layout: RowLayout | None = None) -> tuple[float, int]:
    """Sum of val token losses / count over the first --eval-tokens of the val split (rows split over the data
    ranks, each call over a cp group's ranks).
    The sums stay on the device until the end (one all-reduce and one host copy per evaluation)."""
    was_training = model.training
    model.eval()
    T = args.seq_len
    layout = layout or RowLayout.of(stream, T)
    n_rows = min(stream.n_rows(T), max(1, args.eval_tokens // T))
    dp = dist.dp_world
    n_rows = max(dp, n_rows - n_rows % dp)  # the same number of batches on every rank
    all_rows = [r % stream.n_rows(T) for r in range(n_rows)]
    per_rank = [all_rows[k :: dp] for k in range(dp)]
    tot = torch.zeros(2, dtype=torch.float64, device=device)
    eb = args.batch_size * 4  # no activations kept: bigger batches
    for i in range(0, len(per_rank[dist.dp_rank]), eb):
        b = make_batch(stream, per_rank[dist.dp_rank][i : i + eb], T)
        n_calls = max(layout.n_calls(rows[i : i + eb], args.packing) for rows in per_rank)
        for ids, tg, cu in forward_calls(b, args.packing, n_calls):
            ids, tg = cp_slice(ids, tg, dist)
            ids, tg, cu = to_device(ids, device), to_device(tg, device), offsets_to_device(cu, device)
            tot[0] += loss_sum(model, ids, tg, cu, device, bf16, dist.cp_group).double()
            tot[1] += (tg != IGNORE).sum()
    all_reduce_sum(tot, dist)
    model.train(was_training)
    return float(tot[0] / tot[1].clamp(min=1)), int(tot[1])


@torch.no_grad()
def sample(model, tokenizer, prompt_ids: list[int], n: int, temperature: float, seed: int, max_len: int,
           device) -> list[int]:
    """Re-run the model on the growing sequence (no cache), temperature sampling with a fixed generator."""
    was_training = model.training
    model.eval()
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = list(prompt_ids)
    for _ in range(n):
        x = torch.tensor([ids[-max_len:]], dtype=torch.long, device=device)
        logits = model(x).logits[0, -1].float().cpu()
        if temperature <= 0:
            nxt = int(logits.argmax())
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            nxt = int(torch.multinomial(probs, 1, generator=g))
        ids.append(nxt)
    model.train(was_training)
    return ids


def clip_gradients(model, max_norm: float, dist: Dist) -> torch.Tensor:
    """Clip the gradients to `max_norm` and return their total norm as a tensor on the device: under FSDP2 the
    norm of the sharded gradients is reduced over ranks once here (clipping needs it), and logging it later needs no
    second reduction and no wait for the device now."""
    return clip_grad_norm([p for p in model.parameters() if p.grad is not None], max_norm, dist)


def oom_message(args, err) -> str:
    return (f"a micro-batch of {args.batch_size} x {args.seq_len} tokens does not fit in memory ({err}); "
            "lower --batch-size (raise --grad-accum to keep the same global batch), use --activation-checkpointing, "
            "or shorten --seq-len")
