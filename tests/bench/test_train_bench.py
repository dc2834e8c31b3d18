"""`hybridlm bench train`: the tiny CPU run writes its JSON and table (a row per model and data kind), the two shapes
agree with each other and with fla's config arguments, the flash_attn stand-ins are causal attention, packed
short documents reach our model with their cu_seqlens and its loss is the per-document cross-entropy, and a failing
model is a row, not a crash."""

from __future__ import annotations

import functools
import json
import math

import pytest
import torch
import torch.nn.functional as F

from hybridlm.bench import train as bench
from hybridlm.model.hybrid import HybridLM


@pytest.fixture
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def test_tiny_cpu_run_writes_json_and_table(tmp_path, one_thread):
    assert bench.main(["--tiny", "--device", "cpu", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "train.json") as f:
        rec = json.load(f)
    info = rec["info"]
    for key in ("device", "torch", "triton", "fla", "date_utc", "command", "precision", "notes"):
        assert key in info, key
    assert info["command"].startswith("python -m hybridlm.bench.train --tiny")
    assert (info["seq_len"], info["batch_size"], info["steps"], info["warmup"]) == (64, 2, 2, 1)
    assert rec["configs"]["ours"]["hidden_size"] == 64 and rec["configs"]["fla"] is None
    assert list(info["data"]) == ["bundled"] and "41 documents" in info["data"]["bundled"]
    ours, fla = rec["rows"]
    expected = HybridLM(bench.ours_config(bench.SHAPE_TINY, 64)).num_parameters()
    assert ours["model"] == "ours" and ours["params"] == expected and ours["data"] == fla["data"] == "bundled"
    assert ours["tokens_per_s"] > 0 and len(ours["step_ms_all"]) == 2 and math.isfinite(ours["loss_last"])
    assert abs(ours["loss_first"] - math.log(256)) < 0.5  # random init: about log(vocab)
    assert fla["model"] == "fla" and "CUDA" in fla["skipped"]
    assert any("impl" in m for m in rec["ours_impl_log"]), rec["ours_impl_log"]
    # the note says which SwiGLU ran, from the glue's own log line: on a CPU always the PyTorch one
    assert any("hybridlm.ops.silu_mul: impl='auto' picked 'torch' on cpu" in m
               for m in rec["ours_impl_log"]), rec["ours_impl_log"]
    assert any("SwiGLU in PyTorch" in n for n in info["notes"]), info["notes"]
    table = (tmp_path / "train.md").read_text()
    assert ("| model | data | loss | params | tokens/s | ours/fla | x bundled | model TFLOP/s | MFU | step ms "
            "| peak GiB |") in table
    assert ours["model_tflops"] > 0 and "mfu" not in ours  # no peak known for a CPU
    assert (f"| ours (hybridlm, impl=auto) | bundled | fused linear + CE (chunked, no logits) | {expected:,} |"
            in table)
    assert "fla on bundled skipped: fla's kernels need CUDA" in table


def test_tiny_cpu_run_has_a_row_per_model_and_data(tmp_path, one_thread):
    assert bench.main(["--tiny", "--device", "cpu", "--out", str(tmp_path), "--data", "short-docs,random",
                       "--steps", "1", "--warmup", "0"]) == 0
    rec = json.loads((tmp_path / "train.json").read_text())
    assert [(r["model"], r["data"]) for r in rec["rows"]] == [("ours", "short-docs"), ("fla", "short-docs"),
                                                              ("ours", "random"), ("fla", "random")]
    assert "8,674 short documents" in rec["info"]["data"]["short-docs"]
    for r in rec["rows"][::2]:
        assert r["tokens_per_s"] > 0 and math.isfinite(r["loss_first"]), r
        assert "ratio_over_bundled" not in r  # no bundled row in this run


def test_350m_shape_counts_and_fla_arguments():
    """Our 350M model has the parameters of transformers' Qwen3.5 of the same shape (the layout it follows; fla's
    build of it has 6 x (1024^2 + 256) fewer: no attention output gate, no q/k norm)."""
    transformers = pytest.importorskip("transformers")
    shape = bench.SHAPE_350M
    cfg = bench.ours_config(shape, 4096)
    hf_cfg = transformers.Qwen3_5TextConfig(
        vocab_size=32000, hidden_size=1024, num_hidden_layers=24, intermediate_size=2816,
        layer_types=["full_attention" if i % 4 == 3 else "linear_attention" for i in range(24)],
        linear_num_key_heads=8, linear_num_value_heads=8, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, num_attention_heads=8, num_key_value_heads=2, head_dim=128, tie_word_embeddings=True)
    with torch.device("meta"):
        n = HybridLM(cfg).num_parameters()
        n_hf = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(hf_cfg).parameters())
    assert n == n_hf, (n, n_hf)
    kw = bench.fla_config_kwargs(shape, 4096)
    assert kw["attn"]["layers"] == [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"]
    assert kw["attn"]["layers"] == [3, 7, 11, 15, 19, 23]
    assert kw["hidden_size"] // kw["attn"]["num_heads"] == cfg.head_dim == 128  # fla's attention head width
    assert kw["attn"]["num_kv_heads"] == cfg.num_key_value_heads
    assert (kw["num_heads"], kw["num_v_heads"], kw["head_dim"], kw["expand_v"]) == (8, 8, 128, 1.0)
    assert (kw["intermediate_size"], kw["conv_size"], kw["vocab_size"]) == (2816, 4, 32000)
    assert kw["tie_word_embeddings"] is cfg.tie_word_embeddings is True


def test_fla_shape_must_tie_attention_width_to_hidden():
    bad = bench.Shape(vocab_size=256, hidden_size=64, num_layers=4, intermediate_size=128, linear_heads=2,
                      linear_value_heads=2, linear_head_dim=32, attn_heads=2, attn_kv_heads=1, attn_head_dim=16)
    with pytest.raises(ValueError, match="head_dim = hidden_size // num_heads"):
        bench.fla_config_kwargs(bad, 64)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_flash_attn_stand_in_is_causal_attention(kv_heads):
    B, T, H, d = 2, 17, 4, 8
    q = torch.randn(B, T, H, d, dtype=torch.float64)
    k = torch.randn(B, T, kv_heads, d, dtype=torch.float64)
    v = torch.randn(B, T, kv_heads, d, dtype=torch.float64)
    o = bench.sdpa_flash_attn_func(q, k, v, causal=True)
    # reference: head h reads kv head h // (H / kv_heads), scores masked above the diagonal
    kr, vr = (x.repeat_interleave(H // kv_heads, dim=2) for x in (k, v))
    s = torch.einsum("bthd,bshd->bhts", q, kr) / math.sqrt(d)
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.einsum("bhts,bshd->bthd", s.softmax(-1), vr)
    torch.testing.assert_close(o, ref)
    with pytest.raises(NotImplementedError, match="window"):
        bench.sdpa_flash_attn_func(q, k, v, causal=True, window_size=(8, 0))


def test_varlen_stand_in_passes_documents_causal_and_gqa(monkeypatch):
    """The flash_attn_varlen_func stand-in hands fla's arguments to varlen_attn in either keyword generation of it:
    causal as the window (-1, 0) and GQA by enable_gqa where varlen_attn has them, else is_causal and repeated kv
    heads; varlen_attn itself needs CUDA (its numbers: the GPU test below)."""
    import torch.nn.attention.varlen as tv

    seen = {}

    def windowed(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
        seen.update(shapes=(q.shape, k.shape), cu=(cu_q, cu_k), max=(max_q, max_k), scale=scale,
                    window_size=window_size, enable_gqa=enable_gqa)
        return torch.zeros_like(q)

    def older(q, k, v, cu_q, cu_k, max_q, max_k, *, is_causal=False, scale=None):
        seen.update(shapes=(q.shape, k.shape), is_causal=is_causal, scale=scale)
        return torch.zeros_like(q)

    q, k, v = torch.zeros(10, 4, 8), torch.zeros(10, 2, 8), torch.zeros(10, 2, 8)
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    monkeypatch.setattr(tv, "varlen_attn", windowed)
    o = bench.varlen_flash_attn_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=10, max_seqlen_k=10,
                                     causal=True, window_size=(-1, -1))
    assert o.shape == q.shape and seen["cu"] == (cu, cu) and seen["max"] == (10, 10)
    assert seen["window_size"] == (-1, 0) and seen["enable_gqa"] is True and seen["scale"] is None
    assert seen["shapes"] == (q.shape, k.shape)
    seen.clear()
    monkeypatch.setattr(tv, "varlen_attn", older)
    o = bench.varlen_flash_attn_func(q, k, v, cu, cu, 10, 10, softmax_scale=0.5, causal=True)
    assert o.shape == q.shape and seen["is_causal"] is True and seen["scale"] == 0.5
    assert seen["shapes"] == (q.shape, q.shape)  # kv heads repeated for the query heads
    with pytest.raises(NotImplementedError, match="window"):
        bench.varlen_flash_attn_func(q, k, v, cu, cu, 10, 10, causal=True, window_size=(8, 0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not bench.varlen_available(), reason="needs CUDA varlen_attn")
def test_varlen_stand_in_is_causal_attention_per_document_gpu():
    seed = 0
    g = torch.Generator(device="cuda").manual_seed(seed)
    N, H, Hkv, d = 50, 4, 2, 64
    cu = torch.tensor([0, 7, 30, 50], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(N, h, d, generator=g, device="cuda", dtype=torch.bfloat16) for h in (H, Hkv, Hkv))
    o = bench.varlen_flash_attn_func(q, k, v, cu, cu, N, N, causal=True)
    ref = torch.cat([bench.sdpa_flash_attn_func(*(t[None, s:e].double() for t in (q, k, v)), causal=True)[0]
                     for s, e in ((0, 7), (7, 30), (30, 50))])
    torch.testing.assert_close(o.double(), ref, atol=2e-2, rtol=2e-2, msg=lambda m: f"seed {seed}: {m}")


def test_fla_labels_undo_its_shift():
    """fla's CausalLM turns labels into cat(labels[:, 1:], ignore) (its documented shift); given fla_labels(targets)
    that is the targets themselves, whose last position the bench always leaves without a target."""
    tg = torch.tensor([[5, 6, -100, 7, -100], [1, 2, 3, 4, -100]])
    labels = bench.fla_labels(tg)
    shifted = torch.cat((labels[:, 1:], torch.full_like(labels[:, :1], -100)), 1)
    assert torch.equal(shifted, tg)


def test_short_docs_batches_reach_our_model_and_loss_is_per_document(one_thread):
    """Packed short documents: the [1, B*T] call carries the batch's cu_seqlens (with document starts inside rows,
    host values registered), and our fused training loss equals F.cross_entropy over each document's logits from
    its own forward (no packing), in float64."""
    from hybridlm.ops.offsets import _HOST

    seed = 0
    torch.manual_seed(seed)
    T = 512  # documents of ~580 bytes: rows this long hold document starts
    spec = _spec(seq_len=T, batch_size=2, seed=seed)
    (batch,), desc = bench.make_batches("short-docs", bench.SHAPE_TINY, spec, 1)
    assert "8,674 short documents" in desc and f"[1, {2 * T}]" in desc
    cu = batch.cu_seqlens.tolist()
    assert batch.input_ids.shape == batch.targets.shape == (1, 2 * T) and cu[0] == 0 and cu[-1] == 2 * T and T in cu
    assert any(c % T for c in cu), cu  # a short document starts inside a row
    assert batch.targets[0, -1] == bench.IGNORE and batch.n_targets == int((batch.targets != bench.IGNORE).sum())
    model = HybridLM(bench.ours_config(bench.SHAPE_TINY, T)).double()
    seen = []
    model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw.get("cu_seqlens")), with_kwargs=True)
    ids, tg, cu_t = batch.to(torch.device("cpu"))
    with torch.no_grad():
        loss = bench.ours_loss(model, ids, tg, cu_t, batch.n_targets)
        assert seen[0] is cu_t and seen[0].tolist() == cu and _HOST[cu_t][1] == cu
        ref = sum(F.cross_entropy(model(ids[:, s:e]).logits[0], tg[0, s:e], ignore_index=-100, reduction="sum")
                  for s, e in zip(cu[:-1], cu[1:])) / batch.n_targets
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-10, msg=lambda m: f"seed {seed}: {m}")


@pytest.mark.parametrize("arg", ["", "bundled,bundled", "documents"])
def test_bad_data_names_the_argument(tmp_path, capsys, arg):
    assert bench.main(["--tiny", "--device", "cpu", "--out", str(tmp_path), "--data", arg]) == 2
    assert "--data" in capsys.readouterr().err


def _spec(**kw):
    base = dict(seq_len=16, batch_size=2, steps=1, warmup=0, lr=1e-3, seed=0, grad_ckpt=False, compile=False,
                device=torch.device("cpu"), bf16=False)
    return bench.RunSpec(**{**base, **kw})


def test_a_failing_model_is_a_row_not_a_crash(one_thread):
    def broken(shape, seq_len, device):
        raise RuntimeError("no kernel for this")

    row, config = bench.measure("broken", broken, bench.SHAPE_TINY, _spec())
    assert row["model"] == "broken" and "RuntimeError: no kernel for this" in row["error"]
    assert "tokens_per_s" not in row and config is None


def test_grad_ckpt_runs_our_model(one_thread):
    row, config = bench.measure("ours", bench.build_ours, bench.SHAPE_TINY, _spec(grad_ckpt=True, steps=2))
    assert "error" not in row, row
    assert row["tokens_per_s"] > 0 and config["num_hidden_layers"] == 4


def test_recompute_linear_reaches_our_model(one_thread):
    build = functools.partial(bench.build_ours, recompute_linear=True)
    row, config = bench.measure("ours", build, bench.SHAPE_TINY, _spec(steps=2))
    assert "error" not in row, row
    assert config["linear_recompute"] is True and row["tokens_per_s"] > 0


@pytest.mark.parametrize("flags,name", [(["--batch-size", "0"], "--batch-size"), (["--seq-len", "1"], "--seq-len"),
                                        (["--steps", "0"], "--steps"), (["--lr", "0"], "--lr"),
                                        (["--device", "gpu7"], "--device"), (["--profile", "2"], "--profile")])
def test_bad_flags_name_the_argument(tmp_path, capsys, flags, name):
    assert bench.main(["--tiny", "--device", "cpu", "--out", str(tmp_path), *flags]) == 2
    assert name in capsys.readouterr().err
    assert not (tmp_path / "train.json").exists()


@pytest.mark.parametrize("name,group", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", "matmul"), ("nvjet_tst_192x192_64x4", "matmul"),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<>", "attention (SDPA)"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x128_1x4x1_cga1x1",
     "attention (SDPA)"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4>", "loss"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", "torch other"),
    ("Memcpy DtoD (Device -> Device)", "torch other"), ("_recur_bwd", "Triton"),
    ("chunk_gated_delta_rule_fwd_kernel_h_blockdim64", "Triton"),
    ("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "optimizer")])
def test_profile_groups_kernels_by_name(name, group):
    assert bench.kernel_group(name) == group


def test_profile_table_puts_models_side_by_side():
    rows = [{"model": "ours", "profile": {"steps": 2, "total_ms": 10.0, "launches": 3400.0,
                                         "groups_ms": {"matmul": 6.0, "Triton": 4.0},
                                         "top_kernels_ms": {"gemm_a": 6.0, "_recur_fwd": 4.0}}},
            {"model": "fla", "profile": {"steps": 2, "total_ms": 9.0, "launches": 2500.0,
                                        "groups_ms": {"matmul": 7.0, "loss": 2.0},
                                        "top_kernels_ms": {"gemm_b": 7.0}}},
            {"model": "other", "error": "out of memory"}]
    table = bench.profile_table(rows)
    assert "| kernel group | ours ms/step | fla ms/step |" in table
    assert "| matmul | 6.0 | 7.0 |" in table and "| loss | 0.0 | 2.0 |" in table
    assert "| all kernels | 10.0 | 9.0 |" in table
    assert "| kernels launched per step | 3400 | 2500 |" in table
    assert "| `_recur_fwd` | Triton | 4.00 |" in table
    assert bench.profile_table([{"model": "ours"}]) == ""


@pytest.mark.parametrize("shape", [bench.SHAPE_TINY, bench.SHAPE_350M], ids=["tiny", "350m"])
def test_mfu_counts_every_matmul_weight_of_our_model(shape):
    """The MFU numerator's weights are exactly the nn.Linear weights of the model `ours_config` builds (the tied LM
    head counted once, as a product; no embedding lookup), so the FLOP count follows the shape it claims to count."""
    with torch.device("meta"):
        model = HybridLM(bench.ours_config(shape, 64))
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert bench.matmul_params(shape) == linear


def test_mean_context_and_mfu_of_a_row():
    """Causal attention over documents of 3 and 1 tokens: a token sees (1+2+3 + 1) / 4 keys on average; a plain
    [2, 4] batch sees (1+2+3+4) / 4; the row's MFU is its model FLOP rate over the peak."""
    docs = bench.StepBatch(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long),
                           torch.tensor([0, 3, 4], dtype=torch.int32), 4)
    plain = bench.StepBatch(torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long), None, 8)
    assert bench.mean_context([docs], 4) == 7 / 4
    assert bench.mean_context([plain], 4) == 10 / 4
    assert bench.mean_context([docs, plain], 4) == (7 + 20) / 12
    row = {"tokens_per_s": 2e6}
    fpt = bench.train_flops_per_token(bench.SHAPE_350M, 2048.5)
    bench._add_mfu(row, fpt, 989.4)
    assert row["model_tflops"] == fpt * 2e6 / 1e12
    assert row["mfu"] == row["model_tflops"] / 989.4
    # causal attention, forward and backward: 3 x (QK^T and PV: 2 products x 2 FLOPs) x heads x head dim per key,
    # in each of the 6 attention blocks of 8 heads x 128
    assert fpt - bench.train_flops_per_token(bench.SHAPE_350M, 1048.5) == 6 * 12 * 8 * 128 * 1000
    assert fpt > 6 * bench.matmul_params(bench.SHAPE_350M) + 6 * 12 * 8 * 128 * 2048.5
