"""Context parallelism of the ops on the CPU (gloo, 2 and 4 processes): each rank's slice against the whole sequence
in float64 -- the output, the final state (the same on every rank), every gradient (those of the inputs every rank
shares, initial_state, KDA's A_log and dt_bias, the conv's weight and bias, summed over the ranks) -- for
gated_delta_rule and kda (also with Kimi's gate inside the op) with GVA and the l2 norm on, equal-length rows and
packed documents that cross rank boundaries, and the short conv. The pre-pass runs without autograd and a rank's
slice is differentiated through one tracked local call (local calls and backward passes counted); the Triton
kernels' D (the state-gradient chain alone) runs under the CPU interpreter on 2 ranks.

The reference is the token loop (impl="naive") on the whole sequence; the ranks run impl="chunk". The processes are
started with torch.multiprocessing (spawn) and meet through a file store in tmp_path: no ports. One spawn per world
size runs every case, since the start-up of the processes costs more than the cases.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from float64_check import rel

from hybridlm.ops.conv import causal_conv1d
from hybridlm.ops.recurrence import gated_delta_rule, kda

TOL = 1e-10  # float64: rounding only; a missing chain term or gradient share is O(1)
F64 = torch.float64
H, HV, K, V = 2, 4, 8, 6  # GVA: two value heads per key head; V != K so a transposed state fails
# packed documents of each world size (T positions a rank): one crossing a boundary, one starting on a boundary,
# one spanning ranks, one empty, one inside a rank ending on a boundary
OFFSETS = {2: (16, [0, 3, 11, 16, 21, 26, 26, 32]), 4: (12, [0, 5, 12, 15, 41, 41, 48])}


def _inputs(op: str, B: int, T: int, N: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    def r(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64)

    gshape = (B, T, HV) if op == "gated_delta_rule" else (B, T, HV, K)
    x = {"q": r(B, T, H, K), "k": r(B, T, H, K), "v": r(B, T, HV, V),
         "g": torch.nn.functional.logsigmoid(r(*gshape)) * 0.5, "beta": torch.sigmoid(r(B, T, HV)) * 1.5,
         "initial_state": r(N, HV, K, V)}
    if op == "kda_gate":  # Kimi's gate inside the op: g is the raw gate input, A_log and dt_bias shared by the ranks
        x.update(g=r(*gshape), A_log=r(HV) * 0.5, dt_bias=r(HV * K))
    return x


SHARED = ("initial_state", "A_log", "dt_bias")  # every rank passes the same one: its gradient is the ranks' sum


def _check(what: str, got: torch.Tensor, want: torch.Tensor, seed: int, tol: float = TOL) -> None:
    err = rel(got.double(), want)
    assert err <= tol, f"{what}: rel error {err:.3g} > {tol} (seed {seed})"


def _recurrence_case(op: str, varlen: bool, rank: int, R: int, group, seed: int, impl: str = "chunk",
                     dtype: torch.dtype = F64, device: str = "cpu", tol: float = TOL, offsets=None) -> None:
    fn = gated_delta_rule if op == "gated_delta_rule" else kda
    gate = lambda t: {n: t[n] for n in ("A_log", "dt_bias") if n in t}  # noqa: E731
    gen = torch.Generator().manual_seed(seed)
    if varlen:
        T, offs = offsets or OFFSETS[R]
        B, N, cu = 1, len(offs) - 1, torch.tensor(offs, dtype=torch.int32)
    else:
        T, B, cu = 10, 2, None
        N = B
    x = _inputs(op, B, R * T, N, gen)
    do, dfinal = torch.randn(B, R * T, HV, V, generator=gen, dtype=F64), torch.randn(N, HV, K, V, generator=gen,
                                                                                     dtype=F64)
    x, do, dfinal = {n: t.to(device) for n, t in x.items()}, do.to(device), dfinal.to(device)
    cu = None if cu is None else cu.to(device)
    names = list(x)
    kw = {"use_qk_l2norm": True, "output_final_state": True, "cu_seqlens": cu}

    leaves = {n: t.clone().requires_grad_(True) for n, t in x.items()}
    o_ref, f_ref = fn(leaves["q"], leaves["k"], leaves["v"], g=leaves["g"], beta=leaves["beta"],
                      initial_state=leaves["initial_state"], impl="naive", **gate(leaves), **kw)
    grads_ref = torch.autograd.grad((o_ref * do).sum() + (f_ref * dfinal).sum(), [leaves[n] for n in names])

    sl = slice(rank * T, (rank + 1) * T)
    mine = {n: (t if n in SHARED else t[:, sl]).to(dtype).requires_grad_(True) for n, t in x.items()}
    o, final = fn(mine["q"], mine["k"], mine["v"], g=mine["g"], beta=mine["beta"],
                  initial_state=mine["initial_state"], impl=impl, chunk_size=16, cp_group=group, **gate(mine), **kw)
    # the final state is replicated: its gradient is counted on one rank
    loss = (o * do[:, sl].to(dtype)).sum() + ((final * dfinal.to(final.dtype)).sum() if rank == R - 1 else 0)
    grads = torch.autograd.grad(loss, [mine[n] for n in names], allow_unused=True, materialize_grads=True)
    case = f"{op} varlen={varlen} rank {rank}/{R}"
    _check(f"{case} o", o, o_ref[:, sl], seed, tol)
    _check(f"{case} final state", final, f_ref, seed, tol)
    for n, got, want in zip(names, grads, grads_ref):
        if n in SHARED:
            got = got.clone()
            dist.all_reduce(got, group=group)
        else:
            want = want[:, sl]
        _check(f"{case} d{n}", got, want, seed, 5 * tol)


def _conv_case(rank: int, R: int, group, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    B, T, C, W = 2, 5, 3, 4
    x = {"x": torch.randn(B, R * T, C, generator=gen, dtype=F64), "weight": torch.randn(C, W, generator=gen,
                                                                                         dtype=F64),
         "bias": torch.randn(C, generator=gen, dtype=F64), "initial_state": torch.randn(B, C, W, generator=gen,
                                                                                         dtype=F64)}
    dy, dfinal = torch.randn(B, R * T, C, generator=gen, dtype=F64), torch.randn(B, C, W, generator=gen, dtype=F64)
    names = list(x)
    leaves = {n: t.clone().requires_grad_(True) for n, t in x.items()}
    y_ref, f_ref = causal_conv1d(leaves["x"], leaves["weight"], leaves["bias"], activation="silu",
                                 initial_state=leaves["initial_state"], output_final_state=True)
    grads_ref = torch.autograd.grad((y_ref * dy).sum() + (f_ref * dfinal).sum(), [leaves[n] for n in names])

    sl = slice(rank * T, (rank + 1) * T)
    mine = {n: (t[:, sl] if n == "x" else t).clone().requires_grad_(True) for n, t in x.items()}
    y, final = causal_conv1d(mine["x"], mine["weight"], mine["bias"], activation="silu",
                             initial_state=mine["initial_state"], output_final_state=True, cp_group=group)
    loss = (y * dy[:, sl]).sum() + ((final * dfinal).sum() if rank == R - 1 else 0)
    grads = torch.autograd.grad(loss, [mine[n] for n in names], allow_unused=True, materialize_grads=True)
    case = f"conv rank {rank}/{R}"
    _check(f"{case} y", y, y_ref[:, sl], seed)
    _check(f"{case} final state", final, f_ref, seed)
    for n, got, want in zip(names, grads, grads_ref):
        if n == "x":
            want = want[:, sl]
        else:  # shared by the ranks: each holds its share
            got = got.clone()
            dist.all_reduce(got, group=group)
        _check(f"{case} d{n}", got, want, seed)


class _CountBackward(torch.autograd.Function):
    """x unchanged; each backward through it is counted in `counts`."""

    @staticmethod
    def forward(ctx, x, counts):
        ctx.counts = counts
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.counts.append(1)
        return grad, None


def _graph_case(rank: int, R: int, group, seed: int) -> None:
    """The pre-pass runs without autograd and the slice is differentiated through one tracked local call: every
    local call but one runs with gradients off, and the local backward runs once on a rank whose first segment
    starts from a known state (rank 0), twice (D, then the backward) on the others (the generic path)."""
    from hybridlm.ops import context_parallel
    from hybridlm.ops.dispatch import dispatch

    tracked, backwards = [], []

    def local(*a, **kw):
        o, f = dispatch("gated_delta_rule", "scalar", True, *a, impl="chunk", state_pool=None, state_indices=None,
                        **kw)
        tracked.append(o.requires_grad)
        return (_CountBackward.apply(o, backwards) if o.requires_grad else o), f

    x = {n: t.requires_grad_(True) for n, t in _inputs("gated_delta_rule", 2, 6, 2, torch.Generator().manual_seed(
        seed)).items()}

    def call():
        return context_parallel.run(local, x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"],
                                    initial_state=x["initial_state"], output_final_state=True, cu_seqlens=None,
                                    group=group, use_qk_l2norm=True, scale=None, chunk_size=16, recompute=False)

    with torch.no_grad():  # inference: no tracked call
        o_ng, final_ng = call()
    assert tracked == [False, False], f"rank {rank}: local calls with autograd under no_grad {tracked} (seed {seed})"
    tracked.clear()
    o, final = call()
    assert sorted(tracked) == [False, True], f"rank {rank}: local calls with autograd {tracked} (seed {seed})"
    _check(f"rank {rank} o under no_grad", o_ng, o.detach(), seed)
    _check(f"rank {rank} final state under no_grad", final_ng, final.detach(), seed)
    (o.sum() + (final.sum() if rank == R - 1 else 0)).backward()
    want = 1 if rank == 0 else 2
    assert len(backwards) == want, f"rank {rank}: {len(backwards)} local backward passes, expected {want} " \
                                   f"(seed {seed})"


def _bad_input_case(rank: int, R: int, group) -> None:
    """One-line errors naming the argument; raised on every rank alike, before any exchange."""
    x = _inputs("gated_delta_rule", 1, 8, 1, torch.Generator().manual_seed(0))
    q, k, v, g, beta = x["q"], x["k"], x["v"], x["g"], x["beta"]
    cases = [
        ({"cu_seqlens": torch.tensor([0, 8], dtype=torch.int32)}, ValueError,
         f"cu_seqlens: expected to end at T={R * 8}"),
        ({"state_pool": x["initial_state"], "state_indices": torch.zeros(1, dtype=torch.long)}, ValueError,
         "cp_group: expected no state_pool"),
        ({"initial_state": x["initial_state"][:, :1]}, ValueError, "initial_state: expected shape"),
    ]
    for kw, err, msg in cases:
        with pytest.raises(err, match=msg):
            gated_delta_rule(q, k, v, g=g, beta=beta, impl="chunk", cp_group=group, **kw)
    with pytest.raises(ValueError, match="x: expected at least W=4 positions a rank with cp_group, got T=3"):
        causal_conv1d(torch.zeros(1, 3, 2, dtype=F64), torch.zeros(2, 4, dtype=F64), cp_group=group)


def _worker(rank: int, R: int, store: str, seed: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=R)
    try:
        group = dist.new_group(list(range(R)))  # a group of its own, as a context-parallel mesh dimension gives
        for op in ("gated_delta_rule", "kda", "kda_gate"):
            for varlen in (False, True):
                _recurrence_case(op, varlen, rank, R, group, seed)
        _conv_case(rank, R, group, seed)
        _graph_case(rank, R, group, seed)
        _bad_input_case(rank, R, group)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built")
@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_matches_whole_sequence(world, tmp_path, seed):
    env = dict(os.environ)
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        mp.start_processes(_worker, args=(world, str(tmp_path / "store"), seed), nprocs=world, join=True,
                           start_method="spawn")
    finally:
        os.environ.clear()
        os.environ.update(env)


@pytest.mark.skipif(dist.is_available() and dist.is_initialized(), reason="a process group is initialised here")
def test_cp_group_without_a_process_group_is_refused():
    x = _inputs("kda", 1, 4, 1, torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="cp_group: torch.distributed is not initialised"):
        kda(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], cp_group=object())


# rank 1's first segment continues rank 0's last document, and another runs past rank 0's end: D and the tail
INTERP_OFFSETS = (16, [0, 5, 20, 26, 32])


def _interp_worker(rank: int, R: int, store: str, seed: int) -> None:
    """The Triton kernels under the CPU interpreter: the D of a chained rank from the state-gradient chain alone
    (`dh0_without_dht`), and one local backward a rank."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "triton"))
    from interp_patches import patch_interpreter

    patch_interpreter()
    from hybridlm.ops.triton import gdn as tgdn
    from hybridlm.ops.triton import kda as tkda

    global K, V  # this process's own copy: small head dims (the kernels run them zero-padded to 64)
    K, V = 32, 16
    torch.set_num_threads(1)
    counts = {"D": 0, "bwd": 0}

    def counted(fn, what):
        def wrapped(*a, **kw):
            counts[what] += 1
            return fn(*a, **kw)
        return wrapped

    for mod in (tgdn, tkda):
        mod.dh0_without_dht = counted(mod.dh0_without_dht, "D")
        mod._bwd_impl = counted(mod._bwd_impl, "bwd")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=R)
    try:
        for op, varlen in (("gated_delta_rule", False), ("kda", True)):  # two of the four: the interpreter is slow
            counts.update(D=0, bwd=0)
            _recurrence_case(op, varlen, rank, R, dist.group.WORLD, seed, impl="triton", dtype=torch.float32,
                             tol=1e-5, offsets=INTERP_OFFSETS)
            want = {"D": int(rank > 0), "bwd": 1}
            assert counts == want, f"{op} varlen={varlen} rank {rank}: {counts}, expected {want} (seed {seed})"
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built")
def test_context_parallel_triton_fast_path_interpreter(tmp_path, seed):
    """impl="triton" under TRITON_INTERPRET=1 on 2 gloo ranks against the whole-sequence float64 loop (fp32 bars):
    D from the kernels' state-gradient chain, one local backward a rank; GDN on two rows, KDA on packed documents
    (a chained first segment and a tail)."""
    pytest.importorskip("triton")
    env = dict(os.environ)
    os.environ.update(OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
    try:
        mp.start_processes(_interp_worker, args=(2, str(tmp_path / "store"), seed), nprocs=2, join=True,
                           start_method="spawn")
    finally:
        os.environ.clear()
        os.environ.update(env)


def _gpu_worker(rank: int, R: int, store: str, seed: int) -> None:
    import hybridlm.ops.triton  # noqa: F401  (registers the kernels)

    global K, V  # this process's own copy: head sizes the Triton kernels' tiles take (the CPU cases keep 8, 6)
    K, V = 32, 64
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=R)
    try:
        for op in ("gated_delta_rule", "kda"):
            for varlen in (False, True):
                _recurrence_case(op, varlen, rank, R, dist.group.WORLD, seed, impl="triton", dtype=torch.float32,
                                 device=f"cuda:{rank}", tol=1e-5)
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.device_count() >= 2 and dist.is_nccl_available()),
                    reason="needs 2 CUDA devices and NCCL")
def test_context_parallel_triton_two_gpus(tmp_path, seed):
    """The Triton kernels run the local pieces: fp32 on 2 GPUs (NCCL) against the whole-sequence float64 loop."""
    mp.start_processes(_gpu_worker, args=(2, str(tmp_path / "store"), seed), nprocs=2, join=True,
                       start_method="spawn")
