"""`hybridlm bench train`: the tiny CPU run writes its JSON and table, the two shapes agree with each other and with
fla's config arguments, the flash_attn stand-in is causal attention, and a failing model is a row, not a crash."""

from __future__ import annotations

import functools
import json
import math

import pytest
import torch

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
    ours, fla = rec["rows"]
    expected = HybridLM(bench.ours_config(bench.SHAPE_TINY, 64)).num_parameters()
    assert ours["model"] == "ours" and ours["params"] == expected
    assert ours["tokens_per_s"] > 0 and len(ours["step_ms_all"]) == 2 and math.isfinite(ours["loss_last"])
    assert abs(ours["loss_first"] - math.log(256)) < 0.5  # random init: about log(vocab)
    assert fla["model"] == "fla" and "CUDA" in fla["skipped"]
    assert any("impl" in m for m in rec["ours_impl_log"]), rec["ours_impl_log"]
    # the note says which SwiGLU ran, from the glue's own log line: on a CPU always the PyTorch one
    assert any("hybridlm.ops.silu_mul: impl='auto' picked 'torch' on cpu" in m
               for m in rec["ours_impl_log"]), rec["ours_impl_log"]
    assert any("SwiGLU in PyTorch" in n for n in info["notes"]), info["notes"]
    table = (tmp_path / "train.md").read_text()
    assert "| model | params | tokens/s | ours/fla | step ms | peak GiB |" in table
    assert f"| ours (hybridlm, impl=auto) | {expected:,} |" in table
    assert "fla skipped: fla's kernels need CUDA" in table


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
    rows = [{"model": "ours", "profile": {"steps": 2, "total_ms": 10.0, "groups_ms": {"matmul": 6.0, "Triton": 4.0},
                                         "top_kernels_ms": {"gemm_a": 6.0, "_recur_fwd": 4.0}}},
            {"model": "fla", "profile": {"steps": 2, "total_ms": 9.0, "groups_ms": {"matmul": 7.0, "loss": 2.0},
                                        "top_kernels_ms": {"gemm_b": 7.0}}},
            {"model": "other", "error": "out of memory"}]
    table = bench.profile_table(rows)
    assert "| kernel group | ours ms/step | fla ms/step |" in table
    assert "| matmul | 6.0 | 7.0 |" in table and "| loss | 0.0 | 2.0 |" in table
    assert "| all kernels | 10.0 | 9.0 |" in table
    assert "| `_recur_fwd` | Triton | 4.00 |" in table
    assert bench.profile_table([{"model": "ours"}]) == ""
