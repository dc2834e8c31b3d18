"""Document attention (packed rows with cu_seqlens, no dense mask) against a dense-mask softmax in float64.

The reference is written here from the definition (scores, a same-document causal mask, softmax), independent of
`build_attention_mask` and of SDPA. The CPU path ("loop") is checked in float64; the CUDA paths (varlen_attn,
flex_attention) in bfloat16 on a GPU.
"""

from __future__ import annotations

import logging

import pytest
import torch

from hybridlm import HybridConfig, HybridLM
from hybridlm.layers import attention as attn
from hybridlm.layers.attention import Documents, document_attention

CASES = {  # name -> (cu_seqlens, query heads, kv heads, qk dim, v dim)
    "mixed": ([0, 5, 6, 19, 20, 33], 4, 4, 8, 8),
    "gqa": ([0, 7, 8, 9, 30], 6, 2, 8, 8),
    "ones": ([0, 1, 2, 3, 4, 5], 2, 1, 4, 4),
    "one_doc": ([0, 24], 4, 2, 8, 8),
    "mla_dims": ([0, 3, 17, 18], 4, 4, 12, 8),
    "wide": ([0, 5, 6, 19, 20, 33], 4, 2, 16, 16),  # flex_attention takes head dims >= 16 only
}


def reference(q, k, v, cu, scale):
    """Dense masked softmax attention in float64: q [1, h, N, dk], k [1, hkv, N, dk], v [1, hkv, N, dv]."""
    g = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(g, dim=1), v.double().repeat_interleave(g, dim=1)
    n = q.shape[2]
    doc = torch.zeros(n, dtype=torch.long)
    for s in cu[1:-1]:
        doc[s:] += 1
    i = torch.arange(n)
    allowed = (doc[:, None] == doc[None, :]) & (i[None, :] <= i[:, None])
    scores = (q.double() @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    return scores.softmax(-1) @ v


def inputs(case, seed, dtype=torch.float64, device="cpu"):
    cu, h, hkv, dk, dv = CASES[case]
    g = torch.Generator().manual_seed(seed)
    n = cu[-1]
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(device, dtype).requires_grad_()  # noqa
    return cu, mk(1, h, n, dk), mk(1, hkv, n, dk), mk(1, hkv, n, dv)


@pytest.mark.parametrize("case", list(CASES))
def test_loop_matches_dense_reference_values_and_grads(case):
    seed = 1000 + list(CASES).index(case)
    cu, q, k, v = inputs(case, seed)
    scale = q.shape[-1] ** -0.5
    docs = Documents(torch.tensor(cu, dtype=torch.int32))
    out = document_attention(q, k, v, docs, scale, impl="loop")
    ref = reference(q, k, v, cu, scale)
    assert out.shape == ref.shape
    err = (out - ref).abs().max().item()
    assert err <= 1e-12, f"seed {seed}: output error {err}"
    w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    got = torch.autograd.grad((out * w).sum(), (q, k, v))
    want = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for name, a, b in zip("qkv", got, want):
        e = (a - b).abs().max().item()
        assert e <= 1e-12, f"seed {seed}: d{name} error {e}"


def test_auto_takes_the_loop_on_cpu_and_logs_once(caplog):
    cu, q, k, v = inputs("gqa", 7)
    attn._DOC_LOGGED.discard(("cpu", torch.float64, "loop"))
    with caplog.at_level(logging.INFO, logger="hybridlm.layers"):
        assert attn.resolve_document_impl(q, v) == "loop"
        assert attn.resolve_document_impl(q, v) == "loop"
    lines = [r.getMessage() for r in caplog.records if "packed documents" in r.getMessage()]
    assert len(lines) == 1 and "causal SDPA per document" in lines[0]


def test_bad_offsets_and_impl_are_refused():
    cu, q, k, v = inputs("mixed", 3)
    with pytest.raises(ValueError, match="cu_seqlens: expected offsets from 0 to 33"):
        document_attention(q, k, v, Documents(torch.tensor([0, 5, 30], dtype=torch.int32)), 1.0)
    with pytest.raises(ValueError, match="impl: expected one of"):
        document_attention(q, k, v, Documents(torch.tensor(cu, dtype=torch.int32)), 1.0, impl="dense")


def test_packed_model_forward_builds_no_dense_mask(monkeypatch):
    """A packed forward (cu_seqlens, nothing padded, no cache) never calls build_attention_mask, and gives the
    logits of each document run on its own (positions restarting per document)."""
    cfg = HybridConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, layer_types=["linear_attention",
                       "full_attention"], linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
                       linear_value_head_dim=8, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                       intermediate_size=48)
    torch.manual_seed(0)
    model = HybridLM(cfg).eval()
    x = torch.randint(0, 64, (1, 40))
    cu = torch.tensor([0, 1, 15, 16, 40], dtype=torch.int32)
    with torch.no_grad():
        parts = torch.cat([model(x[:, s:e]).logits for s, e in zip(cu.tolist(), cu.tolist()[1:])], dim=1)

    def refuse(*a, **kw):
        raise AssertionError("build_attention_mask called for a packed forward")

    monkeypatch.setattr("hybridlm.model.hybrid.build_attention_mask", refuse)
    with torch.no_grad():
        packed = model(x, cu_seqlens=cu).logits
    assert (packed - parts).abs().max() <= 1e-5


# --- CUDA ---

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# bf16 inputs, fp32 accumulation in the kernels; the reference sees the same bf16-rounded inputs in float64
BF16_TOL = {"out": 2e-2, "grad": 5e-2}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("impl,case", [("varlen", c) for c in CASES] + [("flex", "wide")])
def test_cuda_paths_match_dense_reference_bf16(case, impl):
    seed = 2000 + list(CASES).index(case)
    cu, q, k, v = inputs(case, seed, torch.bfloat16, "cuda")
    scale = q.shape[-1] ** -0.5
    docs = Documents(torch.tensor(cu, dtype=torch.int32, device="cuda"))
    out = document_attention(q, k, v, docs, scale, impl=impl)
    assert out.dtype == torch.bfloat16
    qc, kc, vc = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    ref = reference(qc, kc, vc, cu, scale)
    err = (out.double().cpu() - ref).abs().max().item()
    assert err <= BF16_TOL["out"], f"seed {seed}: {impl} output error {err}"
    w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    got = torch.autograd.grad((out.float() * w.cuda().float()).sum(), (q, k, v))
    want = torch.autograd.grad((ref * w).sum(), (qc, kc, vc))
    for name, a, b in zip("qkv", got, want):
        e = (a.double().cpu() - b).abs().max().item()
        assert e <= BF16_TOL["grad"] * max(1.0, b.abs().max().item()), f"seed {seed}: {impl} d{name} error {e}"


@pytest.mark.gpu
@needs_cuda
def test_cuda_bf16_auto_takes_varlen():
    cu, q, k, v = inputs("gqa", 11, torch.bfloat16, "cuda")
    assert attn.resolve_document_impl(q, v) == "varlen"
    _, q, k, v = inputs("mla_dims", 12, torch.bfloat16, "cuda")
    assert attn.resolve_document_impl(q, v) == "varlen"
    _, q, k, v = inputs("gqa", 13, torch.float32, "cuda")
    assert attn.resolve_document_impl(q, v) == "loop"


@pytest.mark.gpu
@needs_cuda
def test_cuda_fp32_long_document_with_gqa_makes_no_score_matrix():
    """float32 packed documents take the loop path; with grouped kv heads it must still reach a fused kernel (the
    math path's [h, N, N] scores would be 4 GiB here)."""
    seed, n, h, hkv, d = 2101, 16384, 4, 2, 64
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, h, n, d, device="cuda", generator=gen)
    k, v = (torch.randn(1, hkv, n, d, device="cuda", generator=gen) for _ in range(2))
    docs = Documents(torch.tensor([0, 3, n], dtype=torch.int32, device="cuda"))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = document_attention(q, k, v, docs, d**-0.5)
    peak = torch.cuda.max_memory_allocated() - base
    assert peak < 2**30, f"seed {seed}: float32 GQA document attention peaked at {peak / 2**30:.2f} GiB"
    # the last query row of the long document against its keys, in float64
    s, i = 3, n - 1
    qi, ki, vi = q[0, :, i].double(), k[0, :, s:].double().repeat_interleave(2, 0), v[0, :, s:].double()
    p = torch.softmax((ki @ qi[:, :, None])[..., 0] * d**-0.5, dim=-1)
    want = (p[:, None, :] @ vi.repeat_interleave(2, 0))[:, 0]
    err = (out[0, :, i].double() - want).abs().max().item()
    assert err <= 1e-4, f"seed {seed}: float32 output error {err}"
