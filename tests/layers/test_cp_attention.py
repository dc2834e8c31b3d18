"""Context-parallel attention (`cp_attention`: one rank's queries against the gathered keys of the whole sequence)
against a dense softmax over the whole sequence, written here from the definition and cut to the rank's rows.

No process group is needed: the gathered keys are the whole sequence's. The CPU path (SDPA per block) is checked in
float64 with every gradient; the CUDA path (one varlen_attn call) in bfloat16 on a GPU.
"""

from __future__ import annotations

import random

import pytest
import torch

from hybridlm.layers.attention import ContextSlice, cp_attention

# name -> (ranks, positions a rank, rows, document offsets or None, query heads, kv heads, qk dim, v dim)
CASES = {
    "rows": (3, 7, 2, None, 4, 2, 8, 8),
    "docs_cross": (2, 9, 1, [0, 4, 13, 14, 18], 4, 4, 8, 8),  # 4..13 crosses the boundary at 9
    "docs_on_edge": (3, 6, 1, [0, 6, 7, 18], 2, 1, 8, 8),  # a document ends where rank 1 starts
    "one_doc": (4, 5, 1, [0, 20], 4, 2, 8, 8),
    "mla_dims": (2, 8, 1, [0, 3, 11, 16], 4, 4, 12, 8),
}


def reference(q, k, v, offsets, scale):
    """Dense masked softmax attention over the whole sequence in float64: q [B, h, N, dk], k/v [B, hkv, N, d]."""
    g = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(g, dim=1), v.double().repeat_interleave(g, dim=1)
    n = q.shape[2]
    i = torch.arange(n, device=q.device)
    doc = torch.zeros(n, dtype=torch.long, device=q.device)
    for s in (offsets or [0, n])[1:-1]:
        doc[s:] += 1
    allowed = (doc[:, None] == doc[None, :]) & (i[None, :] <= i[:, None])
    scores = (q.double() @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    return scores.softmax(-1) @ v


def _inputs(case, seed, dtype, device):
    R, T, B, offsets, h, hkv, dk, dv = CASES[case]
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(device, dtype).requires_grad_()  # noqa
    return mk(B, h, R * T, dk), mk(B, hkv, R * T, dk), mk(B, hkv, R * T, dv)


def _check(case, seed, dtype, device, tol):
    R, T, B, offsets, h, hkv, dk, dv = CASES[case]
    q, k, v = _inputs(case, seed, dtype, device)
    scale = dk**-0.5
    want = reference(q, k, v, offsets, scale)
    cot = torch.randn(want.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64).to(device)
    (want * cot).sum().backward()
    ref_grads = [t.grad.double().clone() for t in (q, k, v)]
    q.grad = k.grad = v.grad = None
    cu = None if offsets is None else torch.tensor(offsets, dtype=torch.int32, device=device)
    for r in random.Random(seed).sample(range(R), R):  # every rank, in an order drawn from the seed
        got = cp_attention(q[:, :, r * T : (r + 1) * T], k, v, ContextSlice(r, R, T, cu), scale)
        rows = slice(r * T, (r + 1) * T)
        err = (got.double() - want[:, :, rows]).abs().max().item()
        assert err <= tol, f"{case} rank {r}/{R}: output max error {err:.3g} > {tol} (seed {seed})"
        (got.double() * cot[:, :, rows]).sum().backward()
    for name, t, ref in zip("qkv", (q, k, v), ref_grads):
        err = (t.grad.double() - ref.to(device)).abs().max().item()
        assert err <= tol * max(1.0, ref.abs().max().item()), \
            f"{case}: d{name} (summed over ranks) max error {err:.3g} (seed {seed})"


@pytest.mark.parametrize("case", list(CASES))
def test_cp_attention_matches_whole_sequence_float64(case, seed):
    _check(case, seed, torch.float64, "cpu", 1e-12)


def test_cp_attention_refuses_wrong_lengths():
    q, k, v = torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 12, 8), torch.zeros(1, 2, 12, 8)
    with pytest.raises(ValueError, match="expected 4 queries and 8 keys"):
        cp_attention(q, k, v, ContextSlice(0, 2, 4), 1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_cp_attention_varlen_bf16(case, seed):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _check(case, seed, torch.bfloat16, "cuda", 3e-2)
