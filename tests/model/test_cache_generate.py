"""Issue 4: the hybrid cache (prefill + steps + continuation == one forward), generate's contract and errors,
and the memory formulas against the real cache tensors."""

from __future__ import annotations

import pytest
import torch
from test_model import small_variants

from hybridlm import HybridConfig, HybridLM
from hybridlm.model.info import cache_bytes


def variants_with_rope():
    out = dict(small_variants())
    base = out["gdn_split_headwise"].to_dict()
    base.update(rope_theta=10000.0, partial_rotary_factor=0.5, attn_gate="elementwise")
    out["gdn_split_partial_rope"] = HybridConfig.from_dict(base)
    return out


@pytest.mark.parametrize("name", list(variants_with_rope()))
def test_prefill_steps_and_continuation_equal_one_forward(name):
    model = HybridLM(variants_with_rope()[name]).eval()
    x = torch.randint(0, 64, (2, 40))
    with torch.no_grad():
        full = model(x).logits
        cache = model.new_cache()
        outs = [model(x[:, :29], cache=cache).logits]
        outs += [model(x[:, i:i + 1], cache=cache).logits for i in range(29, 35)]
        outs.append(model(x[:, 35:], cache=cache).logits)
    assert (torch.cat(outs, dim=1) - full).abs().max() <= 1e-4
    assert cache.seen_tokens == 40


@pytest.mark.parametrize("name", ["gdn_fused_qwen_moe", "kda_mla_kimi_moe"])
def test_cache_bytes_match_formula_and_linear_state_is_constant(name):
    cfg = variants_with_rope()[name]
    model = HybridLM(cfg).eval().to(torch.bfloat16)
    cb = cache_bytes(cfg, dtype_bytes=2)
    sizes = {}
    for T in (16, 48):
        cache = model.new_cache()
        with torch.no_grad():
            model(torch.randint(0, 64, (3, T)), cache=cache)
        assert cache.nbytes() == cb.total(T, batch=3)
        sizes[T] = sum(t.numel() * t.element_size() for st, lt in zip(cache.layers, cfg.layer_types)
                       if lt == "linear_attention" for t in vars(st).values())
        rec = [st.recurrent for st, lt in zip(cache.layers, cfg.layer_types) if lt == "linear_attention"]
        assert all(r.dtype == torch.float32 for r in rec)
    assert sizes[16] == sizes[48]


def test_generate_returns_prompt_then_tokens_and_stops():
    model = HybridLM(small_variants()["gdn_split_headwise"]).eval()
    x = torch.randint(1, 64, (2, 6))
    seen = []
    out = model.generate(x, max_new_tokens=5, streamer=seen.append)
    assert out.shape == (2, 11) and torch.equal(out[:, :6], x) and len(seen) == 5
    eos = int(out[0, 7])  # row 0 stops at its 2nd new token, or its 1st if that is the same token
    stop = 6 if int(out[0, 6]) == eos else 7
    stopped = model.generate(x, max_new_tokens=5, eos_token_id=eos, pad_token_id=63)
    assert torch.equal(stopped[0, :stop + 1], out[0, :stop + 1]) and (stopped[0, stop + 1:] == 63).all(), stopped
    a = model.generate(x, max_new_tokens=6, do_sample=True, temperature=0.8, top_k=10, top_p=0.9, seed=3)
    b = model.generate(x, max_new_tokens=6, do_sample=True, temperature=0.8, top_k=10, top_p=0.9, seed=3)
    assert torch.equal(a, b)
    assert model.generate(x, max_new_tokens=0).shape == (2, 6)


def test_generate_bad_input():
    model = HybridLM(small_variants()["gdn_split_headwise"]).eval()
    x = torch.randint(1, 64, (1, 4))
    with pytest.raises(ValueError, match="non-empty prompt"):
        model.generate(torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(x, max_new_tokens=-1)
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings"):
        model.generate(torch.zeros(1, model.config.max_position_embeddings + 1, dtype=torch.long), max_new_tokens=1)
    with pytest.raises(ValueError, match="temperature"):
        model.generate(x, do_sample=True, temperature=0.0)
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="top_p"):
            model.generate(x, do_sample=True, top_p=bad)


def test_native_format_round_trip_for_configs_transformers_cannot_express(tmp_path):
    cfg = small_variants()["gdn_split_headwise"]  # headwise gate: no transformers model has it
    assert cfg.hf_model_type is None
    model = HybridLM(cfg).eval()
    model.save_pretrained(str(tmp_path))
    again = HybridLM.from_pretrained(str(tmp_path))
    x = torch.randint(0, 64, (1, 9))
    with torch.no_grad():
        assert torch.equal(model(x).logits, again(x).logits)


def test_memory_subcommand_table_and_plot(tmp_path, capsys):
    from matplotlib.image import imread

    from hybridlm.cli import main

    png = tmp_path / "mem.png"
    assert main(["memory", "--preset", "kimi-linear-48b-a3b", "--max-context", "65536", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    for label in ("full attention (MHA)", "full attention (GQA)", "MLA", "all GDN", "all KDA", "hybrid"):
        assert label in out
    img = imread(str(png))
    assert img.shape[0] == 500 and img.shape[1] == 800


def test_memory_plot_shows_curves_that_coincide():
    """All GDN and all KDA hold the same bytes for Kimi Linear's shape: the later curve is drawn thinner, in
    another marker and line style, above the earlier one, so both show."""
    import matplotlib.pyplot as plt

    from hybridlm.model.memory import contexts_up_to, figure, table
    from hybridlm.model.presets import get_preset

    ctxs = contexts_up_to(65536)
    fig = figure(table(get_preset("kimi-linear-48b-a3b"), ctxs, 2, 1), ctxs, "t")
    try:
        lines = {ln.get_label(): ln for ln in fig.axes[0].get_lines()}
    finally:
        plt.close(fig)
    gdn, kda = lines["all GDN"], lines["all KDA"]
    assert list(gdn.get_ydata()) == list(kda.get_ydata())  # the case that hid one line under the other
    assert len({(ln.get_marker(), ln.get_linestyle()) for ln in lines.values()}) == len(lines) == 6
    assert kda.get_zorder() > gdn.get_zorder() and kda.get_linewidth() < gdn.get_linewidth()
    assert kda.get_markersize() < gdn.get_markersize()


def test_generate_subcommand_streams(capsys):
    from hybridlm.cli import main

    assert main(["generate", "--model", "tiny", "--prompt", "ab", "--max-new-tokens", "4"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("ab") and "tokens/s" in captured.err


def test_tokenizer_json_from_a_checkpoint_folder(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from hybridlm.model.tokenizer import ByteTokenizer, JsonTokenizer, load_tokenizer

    tok = Tokenizer(models.WordLevel({"hello": 0, "world": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(str(tmp_path), vocab_size=3)
    assert isinstance(loaded, JsonTokenizer) and loaded.encode("hello world") == [0, 1]
    byte = load_tokenizer(None, vocab_size=256)
    assert isinstance(byte, ByteTokenizer) and byte.decode(byte.encode("héllo")) == "héllo"
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(str(tmp_path / "nowhere"), vocab_size=1000)


def test_generate_leaves_the_global_rng_alone():
    """Sampling with and without a seed draws from a private generator: the global torch and Python RNG states
    are the same after generate as before."""
    import random

    model = HybridLM(small_variants()["gdn_split_headwise"]).eval()
    x = torch.randint(1, 64, (2, 5), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(123)
    random.seed(123)
    before, py_before = torch.get_rng_state(), random.getstate()
    for seed in (None, 5):
        model.generate(x, max_new_tokens=4, do_sample=True, top_p=0.9, seed=seed)
        assert torch.equal(torch.get_rng_state(), before), f"seed={seed}: the global torch RNG moved"
        assert random.getstate() == py_before, f"seed={seed}: the Python RNG moved"


def test_repetition_penalty_by_hand():
    """The penalty against numbers worked out by hand: a seen positive logit is divided, a seen negative one
    multiplied, unseen ones untouched, a token seen twice penalised once."""
    from hybridlm.model.generate import _penalize

    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0], [1.0, 1.0, -2.0, 0.0]])
    tokens = torch.tensor([[0, 1, 1], [2, 3, 2]])
    want = torch.tensor([[1.0, -2.0, 0.5, 3.0], [1.0, 1.0, -4.0, 0.0]])
    assert torch.equal(_penalize(logits, tokens, 2.0), want)


def test_stop_strings_end_at_the_first_occurrence():
    """Greedy generation with a stop string equals the greedy tokens without one, cut right after the token that
    completes the string's first occurrence in the new text (found by str.find on the decoded bytes), with the
    model's eos turned off so only the stop string ends the row."""
    from hybridlm.model.tokenizer import ByteTokenizer

    torch.manual_seed(0)
    cfg = small_variants()["gdn_split_headwise"]
    cfg.vocab_size = 256
    model = HybridLM(cfg).eval()
    tok = ByteTokenizer()
    x = torch.tensor([tok.encode("To be")])
    full = model.generate(x, max_new_tokens=24, eos_token_id=[])[0, x.shape[1]:].tolist()
    text = bytes(full).decode("latin-1")  # one char per byte: positions are token indices
    stop = text[6:8]
    end = text.find(stop) + len(stop)
    got = model.generate(x, max_new_tokens=24, eos_token_id=[], stop_strings=[stop],
                         tokenizer=type("Latin1", (), {"decode": lambda self, ids: bytes(ids).decode("latin-1")})())
    assert got[0, x.shape[1]:].tolist() == full[:end], (stop, text)
    with pytest.raises(ValueError, match="stop_strings: need tokenizer="):
        model.generate(x, max_new_tokens=2, stop_strings=["a"])
    with pytest.raises(ValueError, match="repetition_penalty"):
        model.generate(x, max_new_tokens=2, repetition_penalty=0.0)
