"""What the GPU tests of the two Gluon forwards (tests/ops/test_gluon_gdn.py, tests/ops/test_gluon_kda.py) share:
the bar, the case tables, and the checks against the float64 chunked reference: one call's output and final state
(`check_call`), and chunked prefill through a state pool against whole sequences (`check_prefill`).

Both forwards take (q, k, v, *, g, beta, initial_state, output_final_state, cu_seqlens, use_qk_l2norm, state_pool,
state_indices) and return (o, final state); the reference is the public op (`gated_delta_rule`, `kda`) at
impl="chunk" in float64 on the same rounded inputs. Fresh random inputs each run (`seeded`), the seed in every
failure message.
"""

from __future__ import annotations

import itertools

import torch
from float64_check import rel_f64

BAR = 5e-3  # relative RMS of o and of the final state vs float64: the Triton kernels' 16-bit bar
LENGTHS = (1, 63, 65, 128, 1000)  # one token, a chunk less one token and one more, two whole chunks, many
VARLEN = (1, 15, 100, 700)  # packed sequence lengths
HEAD_DIMS = ((64, 64), (64, 256), (128, 64), (128, 256))  # (K, V)
GVA = (1, 2, 4)  # HV / H


def seeded() -> tuple[int, torch.Generator]:
    """A fresh seed and a CUDA generator seeded with it."""
    seed = torch.seed() % 2**31
    return seed, torch.Generator(device="cuda").manual_seed(seed)


def offsets(lens) -> torch.Tensor:
    """cu_seqlens [len(lens) + 1] int32 of packed sequences of `lens` tokens."""
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device="cuda")


def _f64(x):
    return None if x is None else x.double()


def check_call(got, ref, q, k, v, *, g, beta, initial_state, cu_seqlens, use_qk_l2norm, msg: str) -> None:
    """got: (o, final state) of one forward call on these inputs (output_final_state on). o in q's dtype and the
    state fp32, each within BAR of `ref` in float64. msg: the case, with its seed."""
    o, ht = got
    o2, ht2 = ref(_f64(q), _f64(k), _f64(v), g=_f64(g), beta=_f64(beta), initial_state=_f64(initial_state),
                  output_final_state=True, cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm, impl="chunk")
    errs = {"o": rel_f64(o, o2), "final_state": rel_f64(ht, ht2)}
    assert o.dtype == q.dtype and ht.dtype == torch.float32, f"{msg}: {errs}"
    assert all(e <= BAR for e in errs.values()), f"{msg}: {errs}"


def prefill_lens(n_seq: int, length: int) -> list[int]:
    """Unequal lengths up to `length`: the sequences finish in different calls."""
    return [max(1, length - 37 * i) for i in range(n_seq)]


def check_prefill(fwd, ref, q, k, v, *, g, beta, lens, chunk: int, gen: torch.Generator, seed: int) -> None:
    """Sequences of `lens` tokens (q, k, v, g, beta packed as [1, sum(lens), ...]) prefilled chunk by chunk through
    a state pool of 2 len(lens) rows, each sequence at a random row: each call takes the next `chunk` tokens of
    every sequence not yet done, reads its row and the kernel writes the final state back there. Against one
    float64 `ref` call over the whole sequences from the same rows: o and the sequences' rows within BAR; rows no
    sequence owns keep their bits."""
    dev, n_seq = "cuda", len(lens)
    HV, K, V = v.shape[2], k.shape[3], v.shape[3]
    starts = [0, *itertools.accumulate(lens)]
    rows = torch.randperm(2 * n_seq, device=dev, generator=gen)[:n_seq]
    pool0 = torch.randn(2 * n_seq, HV, K, V, device=dev, generator=gen)
    pool = pool0.clone()
    o = torch.full_like(v, float("nan"))
    for c0 in range(0, max(lens), chunk):
        live = [i for i, n in enumerate(lens) if n > c0]
        pieces = [torch.arange(starts[i] + c0, starts[i] + min(lens[i], c0 + chunk), device=dev) for i in live]
        at = torch.cat(pieces)
        o_c, _ = fwd(q[:, at], k[:, at], v[:, at], g=g[:, at], beta=beta[:, at],
                     cu_seqlens=offsets(len(p) for p in pieces), use_qk_l2norm=True, state_pool=pool,
                     state_indices=rows[live])
        o[:, at] = o_c
    o2, ht2 = ref(_f64(q), _f64(k), _f64(v), g=_f64(g), beta=_f64(beta), initial_state=_f64(pool0[rows]),
                  output_final_state=True, cu_seqlens=offsets(lens), use_qk_l2norm=True, impl="chunk")
    errs = {"o": rel_f64(o, o2), "pool rows": rel_f64(pool[rows], ht2)}
    others = torch.ones(2 * n_seq, dtype=torch.bool, device=dev)
    others[rows] = False
    msg = f"seed {seed}: {n_seq} sequences up to {max(lens)} tokens in chunks of {chunk}: {errs}"
    assert all(e <= BAR for e in errs.values()), msg
    assert torch.equal(pool[others], pool0[others]), f"{msg}: rows no sequence owns changed"
