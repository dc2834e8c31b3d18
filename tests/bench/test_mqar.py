"""MQAR benchmark: the data follow Zoology's recipe, the mixers are the library layers and match float64
references, training uses `hybridlm train`'s optimizer and schedule, every mixer learns to recall a small task
(and a model without a mixer does not), bad settings fail clearly, cells resume, old results files still load."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import pytest
import torch

from hybridlm.bench import mqar
from hybridlm.bench.mqar import (
    IGNORE,
    MIXERS,
    Cell,
    ConvAttention,
    MQARModel,
    RecurrentMixer,
    Setting,
    TrainConfig,
    mqar_batch,
    train_cell,
)
from hybridlm.layers import GatedAttention, GatedDeltaNet, KimiDeltaAttention, ShortConv

PAPER_RESULTS = Path(__file__).resolve().parents[2] / "results" / "mqar-paper"


@pytest.fixture(autouse=True)
def _one_thread():
    """Every test here runs models this small that a second thread only costs (4x on a busy 2-core machine);
    torch's thread count is restored after each test."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _batch(n=64, T=64, P=8, V=128, seed=0, noise=True):
    return mqar_batch(n, seq_len=T, num_pairs=P, vocab_size=V, random_non_queries=noise,
                      generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("noise", [False, True])
@pytest.mark.parametrize("T,P,V", [(64, 8, 128), (64, 16, 256), (33, 8, 40), (256, 64, 8192)])
def test_every_query_target_is_the_value_paired_with_that_key(T, P, V, noise):
    seed = _fresh_seed()
    x, y = _batch(n=32, T=T, P=P, V=V, noise=noise, seed=seed)
    assert x.shape == y.shape == (32, T) and x.dtype == y.dtype == torch.int64
    half = V // 2
    for xi, yi in zip(x.tolist(), y.tolist()):
        _check_example(xi, yi, P, V, half, noise, seed)


def _check_example(xi, yi, P, V, half, noise, seed):
    """One example against the layout, independently of how the generator builds it (seed: for the message)."""
    __tracebackhide__ = True
    try:
        keys, values = xi[0 : 2 * P : 2], xi[1 : 2 * P : 2]
        assert len(set(keys)) == P and len(set(values)) == P  # distinct within the example
        assert all(1 <= k < half for k in keys) and all(half <= v < V for v in values)
        pairs = dict(zip(keys, values))
        scored = [j for j, t in enumerate(yi) if t != IGNORE]
        assert len(scored) == P  # one query per key
        assert all(j >= 2 * P for j in scored)  # queries come after the context
        assert sorted(xi[j] for j in scored) == sorted(keys)  # every key is queried once
        for j in scored:
            assert yi[j] == pairs[xi[j]]  # the target is the value that followed this key
        assert all(j % 2 == 0 for j in scored)  # query keys sit at even offsets of the query region
        rest = [xi[j] for j in range(2 * P, len(xi)) if j not in set(scored)]
        if noise:  # the rest of the query region is random tokens of the whole vocabulary
            assert all(0 <= t < V for t in rest)
        else:  # or 0; the value is never shown after a query: it must be recalled
            assert all(t == 0 for t in rest)
        assert all(t == IGNORE for j, t in enumerate(yi) if j < 2 * P)
    except AssertionError as e:
        raise AssertionError(f"seed {seed}: {e}\ninputs {xi}\nlabels {yi}") from None


def test_non_query_noise_is_random_and_leaves_the_labels_alone():
    seed = _fresh_seed()
    (xa, ya), (xb, yb) = _batch(seed=seed, noise=True), _batch(seed=seed, noise=False)
    assert torch.equal(ya, yb) and torch.equal(xa[:, :16], xb[:, :16]), f"seed {seed}"  # same pairs and queries
    rest = (ya == IGNORE) & (xb == 0)
    # noise where there were zeros (token 0 is one of 128), spread over the whole vocabulary
    assert rest[:, 16:].any() and (xa[rest] != 0).float().mean() > 0.9, f"seed {seed}"
    assert len(set(xa[rest].tolist())) > 100, f"seed {seed}"


def test_query_gaps_follow_a_power_law():
    seed = _fresh_seed()
    x, y = _batch(n=512, T=256, P=8, V=1024, seed=seed)
    gaps = ((y != IGNORE).nonzero()[:, 1] - 16) // 2  # slot index in the query region
    space = (257 - 16) // 2
    assert gaps.min() >= 0 and gaps.max() < space, f"seed {seed}"
    # most queries come soon after the context (p ~ x^-0.99 puts over half the mass on the first quarter of the 120
    # slots even after the first picks are taken), but some come late
    assert (gaps < space // 4).float().mean() > 0.5, f"seed {seed}"
    assert (gaps >= space // 2).any(), f"seed {seed}"


def test_same_seed_same_data_other_seed_other_data():
    seed = _fresh_seed()
    a, b, c = _batch(seed=seed), _batch(seed=seed), _batch(seed=seed + 1)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), f"seed {seed}"
    assert not torch.equal(a[0], c[0]), f"seed {seed}"


def test_too_many_pairs_for_the_sequence_is_an_error():
    with pytest.raises(ValueError, match=r"num_pairs: expected 4 \* num_pairs <= seq_len \+ 1.*got num_pairs=17 "
                                         r"with seq_len=64.*at most 16 pairs"):
        _batch(T=64, P=17, V=1024)
    with pytest.raises(ValueError, match=r"num_pairs: expected >= 1, got 0"):
        _batch(P=0)


def test_vocab_too_small_for_the_pairs_is_an_error():
    with pytest.raises(ValueError, match=r"vocab_size: expected at least 18 .*got 16"):
        _batch(T=64, P=8, V=16)


def test_width_not_divisible_by_heads_is_an_error():
    with pytest.raises(ValueError, match=r"width: expected a multiple of num_heads=3 .*got width=64"):
        MQARModel("gdn", width=64, num_heads=3, vocab_size=128)
    with pytest.raises(ValueError, match=r"width: expected a multiple of num_heads=2 with an even head size, "
                                         r"got width=66"):
        MQARModel("attention", width=66, num_heads=2, vocab_size=128)


def test_unknown_mixer_is_an_error():
    with pytest.raises(ValueError, match=r"mixer: expected one of attention, .*got 'mamba'"):
        MQARModel("mamba", width=64, num_heads=1, vocab_size=128)


def _args(tmp_path, **kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    mqar.add_arguments(p)
    argv = ["--out", str(tmp_path), "--no-plot"]
    for k, v in kw.items():
        flag = "--" + k.replace("_", "-")
        argv += [flag, *map(str, v)] if isinstance(v, list) else [flag, str(v)]
    return p.parse_args(argv)


def test_cli_rejects_bad_grids_naming_the_flag(tmp_path):
    with pytest.raises(ValueError, match=r"widths: expected multiples of num_heads=3 .*got 64"):
        mqar.run(_args(tmp_path, widths=[64], num_heads=3))
    with pytest.raises(ValueError, match=r"num_pairs: expected 4 \* num_pairs <= seq_len \+ 1"):
        mqar.run(_args(tmp_path, seq_lens=[16], pairs=[8]))
    with pytest.raises(ValueError, match=r"steps: expected >= 1, got 0"):
        mqar.run(_args(tmp_path, steps=0))


def test_every_mixer_builds_and_runs_forward_backward():
    x, y = _batch(n=2, T=16, P=4, V=32)
    for m in MIXERS:
        model = MQARModel(m, width=32, num_heads=2, vocab_size=32, key_dim=None if m == "kda" else 8)
        logits = model(x)
        assert logits.shape == (2, 16, 32)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE).backward()
        # every parameter is read (a CUDA graph's backward needs a gradient for each)
        assert [n for n, p in model.named_parameters() if p.grad is None] == [], m


def test_kda_with_another_value_dim_is_an_error():
    with pytest.raises(ValueError, match=r"value_dim: expected the key dim 8 for kda \(one head size\), got 16"):
        MQARModel("kda", width=32, num_heads=2, vocab_size=32, key_dim=8, value_dim=16)


def test_scored_positions_give_the_full_logits_rows():
    x, y = _batch(n=3, T=32, P=4, V=64)
    model = MQARModel("gdn", width=32, num_heads=2, vocab_size=64)
    scored = y != IGNORE
    torch.testing.assert_close(model(x, scored), model(x)[scored], rtol=1e-5, atol=1e-5)


def test_mixers_are_the_library_layers_with_the_benchs_init():
    """Slow initial decay with A fixed at 1, a biased beta projection for the delta rule mixers, short convs from
    N(0, 1/4): the bench's model (its results moved with the library's init, see conv_init)."""
    model = MQARModel("gdn_attention", width=32, num_heads=2, vocab_size=32)
    assert isinstance(model.blocks[0].mixer, GatedDeltaNet) and isinstance(model.blocks[1].mixer, ConvAttention)
    assert isinstance(model.blocks[1].mixer.attn, GatedAttention)
    kda_mixer = MQARModel("kda", width=64, num_heads=1, vocab_size=32).blocks[0].mixer
    assert isinstance(kda_mixer, KimiDeltaAttention)
    gla_mixer = MQARModel("gla", width=64, num_heads=1, vocab_size=32).blocks[0].mixer
    for mixer in (model.blocks[0].mixer, kda_mixer, gla_mixer):
        assert torch.all(mixer.A_log == 0) and "A_log" not in dict(mixer.named_parameters())
        rate = torch.nn.functional.softplus(mixer.dt_bias.detach())
        assert rate.min() >= 1e-3 * (1 - 1e-5) and rate.max() <= 1e-1 * (1 + 1e-5), rate
    rate = torch.nn.functional.softplus(kda_mixer.dt_bias.detach())  # 64 channels: log-uniform, not one value
    assert rate.min() < 1e-2 < rate.max(), rate
    for kind in ("gdn", "deltanet"):
        assert MQARModel(kind, width=32, num_heads=2, vocab_size=32).blocks[0].mixer.in_proj_b.bias is not None
    mesa = MQARModel("mesanet", width=32, num_heads=2, vocab_size=32).blocks[0].mixer
    rate = torch.nn.functional.softplus(-mesa.a_proj.bias.detach())  # the forget gate's decay rate -g at x = 0
    assert rate.min() >= 1e-3 * (1 - 1e-5) and rate.max() <= 1e-1 * (1 + 1e-5), rate
    convs = [m.weight for m in MQARModel("attention", width=64, num_heads=1, vocab_size=32).modules()
             if isinstance(m, ShortConv)] + [kda_mixer.conv1d.weight]
    assert len(convs) == 7
    for w in convs:  # 192 or 768 draws of N(0, 0.25): the std within 15% of 0.5 (uniform(-0.5, 0.5) has 0.29)
        assert 0.42 < w.std().item() < 0.58, w.std().item()


def _fresh_seed() -> int:
    return random.SystemRandom().randrange(2**31)


def _conv_silu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x: [B, T, C]; weight [C, 1, W]: causal depthwise conv (zero history) + SiLU, by torch's conv1d."""
    W = weight.shape[-1]
    y = torch.nn.functional.conv1d(x.transpose(1, 2), weight, padding=W - 1, groups=x.shape[-1])
    return torch.nn.functional.silu(y[..., : x.shape[1]].transpose(1, 2))


def _l2(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _recurrent_reference(mix: RecurrentMixer, x: torch.Tensor) -> torch.Tensor:
    """The mixer token by token in float64: projections, conv + SiLU, q/k features, the state update of its rule,
    o_t = S_t^T q_t / sqrt(dk), RMSNorm(o) * w * silu(z) per head, output projection."""
    B, T, _ = x.shape
    H, dk, dv = mix.H, mix.dk, mix.dv
    q, k, v = _conv_silu(x @ mix.in_proj_qkv.weight.T, mix.conv1d.weight).split([H * dk, H * dk, H * dv], -1)
    q, k, v = q.reshape(B, T, H, dk), k.reshape(B, T, H, dk), v.reshape(B, T, H, dv)
    if mix.l2:
        q, k = _l2(q), _l2(k)
    elif mix.rule == "linear_attention":
        q, k = torch.nn.functional.elu(q) + 1, torch.nn.functional.elu(k) + 1
    S = torch.zeros(B, H, dk, dv, dtype=x.dtype)
    o = torch.empty(B, T, H, dv, dtype=x.dtype)
    for t in range(T):
        kt, vt = k[:, t], v[:, t]
        if mix.rule == "gla":
            dt = torch.nn.functional.softplus(x[:, t] @ mix.in_proj_a.weight.T + mix.dt_bias)  # [B, H]
            write = dt if mix.dt_write else torch.ones_like(dt)
            S = torch.exp(-mix.A_log.exp() * dt)[..., None, None] * S + write[..., None, None] * kt[..., None] * vt[
                :, :, None]
        elif mix.rule == "deltanet":
            b = mix.in_proj_b
            beta = torch.sigmoid(x[:, t] @ b.weight.T + (0 if b.bias is None else b.bias))  # [B, H]
            err = vt - torch.einsum("bhk,bhkv->bhv", kt, S)
            S = S + beta[..., None, None] * kt[..., None] * err[:, :, None]
        else:
            S = S + kt[..., None] * vt[:, :, None]
        o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t], S) / dk**0.5
    z = (x @ mix.in_proj_z.weight.T).reshape(B, T, H, dv)
    normed = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + mix.norm.eps) * mix.norm.weight
    return (normed * torch.nn.functional.silu(z)).reshape(B, T, H * dv) @ mix.out_proj.weight.T


@pytest.mark.parametrize("qk_norm", ["l2", "recipe"])
@pytest.mark.parametrize("rule", ["linear_attention", "gla", "deltanet"])
def test_recurrent_mixer_matches_a_float64_token_loop(rule, qk_norm):
    seed = _fresh_seed()
    torch.manual_seed(seed)
    mix = mqar.build_mixer(rule, 16, 2, key_dim=8, value_dim=8, qk_norm=qk_norm).double()  # the bench's mixer
    assert isinstance(mix, RecurrentMixer)
    with torch.no_grad():
        for p in mix.parameters():  # away from the init (unit norm weight), so a misplaced term shows
            p.add_(0.3 * torch.randn_like(p))
    x = torch.randn(2, 11, 16, dtype=torch.float64)
    torch.testing.assert_close(mix(x), _recurrent_reference(mix, x), rtol=1e-9, atol=1e-11,
                               msg=lambda m: f"seed {seed}: {m}")


def test_qk_norm_recipe_gives_each_mixer_its_published_form():
    def mixer(kind, qk):
        return MQARModel(kind, width=16, num_heads=1, vocab_size=32, qk_norm=qk).blocks[0].mixer

    for kind in ("linear_attention", "gla", "deltanet"):
        assert mixer(kind, "l2").l2 and not mixer(kind, "l2").elu_features and not mixer(kind, "l2").dt_write
    assert not mixer("linear_attention", "recipe").l2 and mixer("linear_attention", "recipe").elu_features
    assert not mixer("gla", "recipe").l2 and mixer("gla", "recipe").dt_write  # Mamba2's write scaled by dt
    assert mixer("deltanet", "recipe").l2  # the delta rule keeps l2 keys; GDN and KDA always l2-normalise
    # only the mixers the recipe changes get another cell key; the others share their results with "l2" runs
    st = Setting(seq_len=64, num_pairs=8, vocab_size=512)
    for kind in MIXERS:
        cell = Cell(kind, 64, st, 1e-3)
        same = cell.key(TrainConfig(qk_norm="recipe")) == cell.key(TrainConfig())
        assert same == (kind not in ("linear_attention", "gla")), kind
        assert cell.key(TrainConfig()).endswith(mqar.MODEL_TAG)
    with pytest.raises(ValueError, match=r"qk_norm: expected one of l2, recipe, got 'none'"):
        mixer("gla", "none")


def test_attention_mixer_matches_explicit_causal_softmax():
    """q/k/v projections, each followed by a causal depthwise conv + SiLU, rotary on pairs (i, i + hd/2) with angle
    pos * 10000^(-2i/hd), softmax(q k^T / sqrt(hd)) over the past and the present, output projection; float64."""
    seed = _fresh_seed()
    torch.manual_seed(seed)
    mix = ConvAttention(16, 2).double()
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    B, T, H, hd = 2, 9, 2, 8
    a = mix.attn
    q, k, v = (_conv_silu(x @ proj[0].weight.T, proj[1].weight).reshape(B, T, H, hd).transpose(1, 2)
               for proj in (a.q_proj, a.k_proj, a.v_proj))
    ang = torch.arange(T, dtype=torch.float64)[:, None] * 10000.0 ** (-torch.arange(hd // 2) / (hd // 2))

    def rot(t):
        t1, t2 = t[..., : hd // 2], t[..., hd // 2 :]
        return torch.cat([t1 * ang.cos() - t2 * ang.sin(), t2 * ang.cos() + t1 * ang.sin()], dim=-1)

    scores = rot(q) @ rot(k).transpose(-1, -2) / hd**0.5
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    want = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, H * hd) @ a.o_proj.weight.T
    # the library's rotary tables are float32 by design (cast to the activations' dtype), hence 1e-6, not 1e-9
    torch.testing.assert_close(mix(x), want, rtol=1e-6, atol=1e-8, msg=lambda m: f"seed {seed}: {m}")


def test_training_uses_the_train_optimizer_schedule_and_no_decay_groups():
    """`hybridlm train`'s AdamW with the bench's groups (every matrix decays, the embedding too; vectors do not) and
    its schedule: the lr of the last step is lr_at's (cosine to 0), read back from the optimizer after a short run."""
    seen = {}
    real = mqar.build_optimizer

    def spy(model, lr, wd, **kw):
        seen["opt"] = real(model, lr, wd, **kw)
        seen["model"] = model
        return seen["opt"]

    cfg = TrainConfig(steps=5, batch_size=4, test_examples=4, warmup=0.4)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mqar, "build_optimizer", spy)
        train_cell(Cell("gla", 16, Setting(16, 2, 32), 1e-2), cfg, seed=0, device=torch.device("cpu"))
    decay, no_decay = seen["opt"].param_groups
    names = {id(p): n for n, p in seen["model"].named_parameters()}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert {names[id(p)] for p in no_decay["params"]} >= {"blocks.0.mixer.dt_bias", "norm.weight"}
    assert all(p.ndim < 2 for p in no_decay["params"])
    assert {names[id(p)] for p in decay["params"]} >= {"embed.weight", "head.weight", "blocks.0.mixer.conv1d.weight"}
    assert seen["opt"].defaults["betas"] == (0.9, 0.98)
    # warmup 2 steps, then cosine over 3: the last step (4) runs at 0.5 * (1 + cos(pi * 2 / 3)) * lr = 0.25 lr
    assert decay["lr"] == pytest.approx(0.25e-2, rel=1e-12)


def test_cuda_graphs_need_a_cuda_device():
    cfg = TrainConfig(steps=1, batch_size=4, test_examples=4, cuda_graphs=True)
    with pytest.raises(ValueError, match=r"cuda_graphs: expected a CUDA device, got cpu"):
        train_cell(Cell("gdn", 16, Setting(16, 2, 32), 1e-2), cfg, seed=0, device=torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_train_like_eager():
    """The graphed trunk replays the same kernels: the loss curve of a short run matches the eager one."""
    runs = {}
    for graphs in (False, True):
        cfg = TrainConfig(steps=101, batch_size=32, test_examples=64, mixed_pairs=True, cuda_graphs=graphs)
        runs[graphs] = train_cell(Cell("gdn", 64, Setting(64, 8, 256), 3e-3), cfg, seed=0,
                                  device=torch.device("cuda"))["loss_every_50"]
    assert runs[False] == pytest.approx(runs[True], rel=2e-2), runs


def test_cells_resume_and_record_where_they_ran(tmp_path, capsys):
    kw = dict(mixers=["attention", "linear_attention"], widths=[16], seq_lens=[16], pairs=[2], vocab_size=32,
              steps=3, batch_size=4, test_examples=8)
    assert mqar.run(_args(tmp_path, max_cells=1, **kw)) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert len(data["cells"]) == 1
    cell = data["cells"][0]
    for field in ("device", "torch", "date", "accuracy", "ms_per_step", "key"):
        assert field in cell
    assert data["runs"][0]["device"] == "cpu" and "torch" in data["runs"][0] and "command" in data["runs"][0]
    assert mqar.run(_args(tmp_path, **kw)) == 0  # resumes: only the missing cell runs
    out = capsys.readouterr().out
    assert "1 of 2 cells done, 1 to run" in out
    data = json.loads((tmp_path / "results.json").read_text())
    assert [c["mixer"] for c in data["cells"]] == ["attention", "linear_attention"]
    assert len(data["runs"]) == 2
    assert mqar.run(_args(tmp_path, **kw)) == 0
    assert "2 of 2 cells done, 0 to run" in capsys.readouterr().out
    assert (tmp_path / "table.txt").read_text().count("\n") >= 4


def test_time_budget_stops_between_cells(tmp_path, capsys):
    kw = dict(mixers=["attention", "linear_attention", "gla"], widths=[16], seq_lens=[16], pairs=[2],
              vocab_size=32, steps=3, batch_size=4, test_examples=8)
    assert mqar.run(_args(tmp_path, max_minutes=1e-6, **kw)) == 0
    assert "stopping before" in capsys.readouterr().out
    assert len(json.loads((tmp_path / "results.json").read_text())["cells"]) == 1  # the first cell always runs


def test_shards_split_the_grid_and_a_plain_run_merges_them(tmp_path, capsys):
    kw = dict(mixers=["attention", "linear_attention", "gla"], widths=[16], seq_lens=[16], pairs=[2],
              vocab_size=32, steps=2, batch_size=4, test_examples=8)
    for i in range(2):
        assert mqar.run(_args(tmp_path, shard=f"{i}/2", **kw)) == 0
    a = json.loads((tmp_path / "results.shard0of2.json").read_text())["cells"]
    b = json.loads((tmp_path / "results.shard1of2.json").read_text())["cells"]
    assert [c["mixer"] for c in a] == ["attention", "gla"] and [c["mixer"] for c in b] == ["linear_attention"]
    assert not (tmp_path / "results.json").exists() and not (tmp_path / "table.txt").exists()
    capsys.readouterr()
    assert mqar.run(_args(tmp_path, max_cells=0, **kw)) == 0  # merges; nothing left to run
    assert "3 of 3 cells done, 0 to run" in capsys.readouterr().out
    merged = json.loads((tmp_path / "results.json").read_text())
    assert sorted(c["key"] for c in merged["cells"]) == sorted(c["key"] for c in a + b)
    assert "gla" in (tmp_path / "table.txt").read_text()
    assert mqar.run(_args(tmp_path, shard="1/2", **kw)) == 0  # a shard rerun sees the merged file: nothing to do
    assert "0 to run" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"shard: expected I/N with 0 <= I < N \(e.g. 0/4\), got '2/2'"):
        mqar.run(_args(tmp_path, shard="2/2", **kw))
    # a grown grid: the shards split the 3 new cells, not the whole grid (where shard 1 would get only one)
    kw["widths"] = [16, 24]
    for i in range(2):
        assert mqar.run(_args(tmp_path, shard=f"{i}/2", **kw)) == 0
    a = json.loads((tmp_path / "results.shard0of2.json").read_text())["cells"]
    b = json.loads((tmp_path / "results.shard1of2.json").read_text())["cells"]
    assert [(c["mixer"], c["width"]) for c in a[2:]] == [("attention", 24), ("gla", 24)]
    assert [(c["mixer"], c["width"]) for c in b[1:]] == [("linear_attention", 24)]


def test_mixed_pairs_split_the_batch_and_keep_the_test_at_the_cells_pairs(monkeypatch):
    assert mqar.train_groups(128, 64, False) == [(128, 64)]
    assert mqar.train_groups(128, 64, True) == [(43, 16), (43, 32), (42, 64)]
    assert mqar.train_groups(5, 2, True) == [(3, 1), (2, 2)]  # 2 // 4 = 0 -> 1 pair; duplicates merged
    with pytest.raises(ValueError, match=r"batch_size: expected >= 3 with mixed pairs \[16, 32, 64\], got 2"):
        mqar.train_groups(2, 64, True)
    cfg = TrainConfig(steps=2, batch_size=6, test_examples=8, mixed_pairs=True)
    assert cfg.tag().endswith("|mix") and not TrainConfig().tag().endswith("|mix")
    scored = {}
    evaluate = mqar.evaluate
    monkeypatch.setattr(mqar, "evaluate", lambda model, x, y, **kw: scored.update(model=model, x=x, y=y)
                        or evaluate(model, x, y, **kw))
    r = train_cell(Cell("gdn", 16, Setting(32, 8, 64), 1e-2), cfg, seed=0, device=torch.device("cpu"))
    assert r["num_pairs"] == 8 and r["mixed_pairs"] is True
    # the held-out examples all ask the cell's 8 pairs, and the reported accuracy is the trained model's share of
    # right answers on them, counted here
    keep = scored["y"] != IGNORE
    assert keep.sum(1).tolist() == [8] * 8
    with torch.no_grad():
        pred = scored["model"].eval()(scored["x"]).argmax(-1)
    assert r["accuracy"] == (pred[keep] == scored["y"][keep]).sum().item() / 64


def test_old_results_files_still_load_and_tabulate():
    """results/mqar-paper/ (the GPU paper grid of the bench's earlier mixers): its cells load, and the table of its
    recipe grid is the committed table.txt. Its keys lack MODEL_TAG, so a rerun would not count them as done."""
    data = mqar.load_results(str(PAPER_RESULTS / "results.json"))
    cfg = dict(mqar.PRESETS["paper"])
    grid = {c.key(mqar.train_config(cfg)).removesuffix(mqar.MODEL_TAG) for c in mqar.build_cells(cfg)}
    rows = mqar.best_per_cell([r for r in data["cells"] if r["key"] in grid])
    assert len(rows) == 21
    table = (PAPER_RESULTS / "table.txt").read_text().split("\n", 1)[1].strip("\n")
    assert mqar.format_table(rows) == table
    assert not {r["key"] for r in data["cells"]} & {c.key(mqar.train_config(cfg)) for c in mqar.build_cells(cfg)}


# Every mixer learns to recall on a small task at a pinned seed (training curves at this size jump from chance to
# recall at a step that depends on the seed, so a fresh seed per run would be flaky; the bars have margin at seed
# 0). Two pairs of 16 possible values: a model with no token mixing can only guess a value (1/16), one that keeps
# the values but not which key each followed gets 1/2; the bar is above both, and the control below shows the
# task cannot be passed without a mixer. The default run trains GDN and the control (a few seconds each); the other
# mixers are slow-marked. Seed 0 on one CPU thread gave attention 0.998, linear attention 1.000, gla 1.000,
# deltanet 0.998, gdn 0.994, kda 1.000, comba 1.000, gdn_attention 0.998, path 0.998, deltaformer 0.998.
LEARN_SETTING = Setting(seq_len=16, num_pairs=2, vocab_size=32)
LEARN_CONFIG = TrainConfig(num_heads=1, steps=400, batch_size=32, test_examples=256)
LEARN_BAR = 0.85


def _learn(mixer: str, seed: int = 0) -> float:
    cell = Cell(mixer, 32, LEARN_SETTING, 1e-2)
    return train_cell(cell, LEARN_CONFIG, seed=seed, device=torch.device("cpu"))["accuracy"]


def test_gdn_learns_to_recall_two_pairs():
    acc = _learn("gdn")
    assert acc > LEARN_BAR, f"gdn at seed 0: accuracy {acc:.3f}, expected > {LEARN_BAR}"


@pytest.mark.slow
@pytest.mark.parametrize("mixer", [m for m in MIXERS if m != "gdn"])
def test_each_mixer_learns_to_recall_two_pairs(mixer):
    acc = _learn(mixer)
    assert acc > LEARN_BAR, f"{mixer} at seed 0: accuracy {acc:.3f}, expected > {LEARN_BAR}"


class _NoMixing(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.proj = torch.nn.Linear(width, width, bias=False)  # each token on its own: no token mixing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def test_without_token_mixing_the_task_stays_at_chance():
    """The control of the bar above: the same training with each mixer replaced by a per-token projection (the
    model sees only the current token) stays near 1/16 however it trains; a fresh seed (printed)."""
    seed = _fresh_seed()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mqar, "build_mixer", lambda kind, width, *a, **kw: _NoMixing(width))
        acc = _learn("gdn", seed)
    assert acc < 0.2, f"seed {seed}: accuracy {acc:.3f} without token mixing, expected < 0.2 (chance 1/16)"
