"""MQAR benchmark: the data follow Zoology's recipe, bad settings fail clearly, cells resume, and the ordering holds
(softmax attention and the delta rule recall what plain linear attention cannot hold)."""

from __future__ import annotations

import argparse
import json
import os

import pytest
import torch

from hybridlm.bench import mqar
from hybridlm.bench.mqar import IGNORE, MIXERS, Cell, MQARModel, Setting, TrainConfig, mqar_batch, train_cell


def _batch(n=64, T=64, P=8, V=128, seed=0, noise=True):
    return mqar_batch(n, seq_len=T, num_pairs=P, vocab_size=V, random_non_queries=noise,
                      generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("noise", [False, True])
@pytest.mark.parametrize("T,P,V", [(64, 8, 128), (64, 16, 256), (33, 8, 40), (256, 64, 8192)])
def test_every_query_target_is_the_value_paired_with_that_key(T, P, V, noise):
    x, y = _batch(n=32, T=T, P=P, V=V, noise=noise)
    assert x.shape == y.shape == (32, T) and x.dtype == y.dtype == torch.int64
    half = V // 2
    for xi, yi in zip(x.tolist(), y.tolist()):
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
        rest = [xi[j] for j in range(2 * P, T) if j not in set(scored)]
        if noise:  # the rest of the query region is random tokens of the whole vocabulary
            assert all(0 <= t < V for t in rest)
        else:  # or 0; the value is never shown after a query: it must be recalled
            assert all(t == 0 for t in rest)
        assert all(t == IGNORE for j, t in enumerate(yi) if j < 2 * P)


def test_non_query_noise_is_random_and_leaves_the_labels_alone():
    (xa, ya), (xb, yb) = _batch(seed=5, noise=True), _batch(seed=5, noise=False)
    assert torch.equal(ya, yb) and torch.equal(xa[:, :16], xb[:, :16])  # same pairs, same queries
    rest = (ya == IGNORE) & (xb == 0)
    assert rest[:, 16:].any() and (xa[rest] != 0).float().mean() > 0.9  # noise where there were zeros
    assert len(set(xa[rest].tolist())) > 100  # spread over the whole vocabulary (128)


def test_query_gaps_follow_a_power_law():
    x, y = _batch(n=512, T=256, P=8, V=1024)
    gaps = ((y != IGNORE).nonzero()[:, 1] - 16) // 2  # slot index in the query region
    space = (257 - 16) // 2
    assert gaps.min() >= 0 and gaps.max() < space
    # most queries come soon after the context, but some come late
    assert (gaps < space // 4).float().mean() > 0.5
    assert (gaps >= space // 2).any()


def test_same_seed_same_data_other_seed_other_data():
    a, b, c = _batch(seed=3), _batch(seed=3), _batch(seed=4)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


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
        model = MQARModel(m, width=32, num_heads=2, vocab_size=32, key_dim=8)
        logits = model(x)
        assert logits.shape == (2, 16, 32)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE).backward()
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad), m


def test_scored_positions_give_the_full_logits_rows():
    x, y = _batch(n=3, T=32, P=4, V=64)
    model = MQARModel("gdn", width=32, num_heads=2, vocab_size=64)
    scored = y != IGNORE
    torch.testing.assert_close(model(x, scored), model(x)[scored], rtol=1e-5, atol=1e-5)


def test_qk_norm_recipe_gives_each_mixer_its_published_form():
    def mixer(kind, qk):
        return MQARModel(kind, width=16, num_heads=1, vocab_size=32, qk_norm=qk).blocks[0].mixer

    for kind in ("linear_attention", "gla", "deltanet", "gdn", "kda"):
        assert mixer(kind, "l2").l2 and not mixer(kind, "l2").elu_features
    assert not mixer("linear_attention", "recipe").l2 and mixer("linear_attention", "recipe").elu_features
    assert not mixer("gla", "recipe").l2 and not mixer("gla", "recipe").elu_features
    assert mixer("gla", "recipe").dt_write and not mixer("gla", "l2").dt_write  # Mamba2's write scaled by dt
    assert all(mixer(k, "recipe").l2 for k in ("deltanet", "gdn", "kda"))
    # only the mixers the recipe changes get another cell key; the others share their results with "l2" runs
    st = Setting(seq_len=64, num_pairs=8, vocab_size=512)
    for kind in MIXERS:
        cell = Cell(kind, 64, st, 1e-3)
        same = cell.key(TrainConfig(qk_norm="recipe")) == cell.key(TrainConfig())
        assert same == (kind not in ("linear_attention", "gla")), kind
    with pytest.raises(ValueError, match=r"qk_norm: expected one of l2, recipe, got 'none'"):
        mixer("gla", "none")
    x, y = _batch(n=2, T=16, P=4, V=32)  # the recipe forms train: finite loss, gradients everywhere
    for kind in ("linear_attention", "gla"):
        model = MQARModel(kind, width=16, num_heads=1, vocab_size=32, qk_norm="recipe")
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=IGNORE)
        loss.backward()
        assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters())


def test_gla_recipe_writes_scaled_by_dt_as_mamba2():
    """The recipe form of the scalar-decay mixer, token by token in float64: h_t = e^{-dt_t} h_{t-1} + dt_t k_t v_t^T,
    o_t = h_t^T q_t / sqrt(dk), dt_t = softplus(a_t); then the gated norm and the output projection. The mixer
    computes its gates in float32 (for bf16 autocast), so the reference rounds dt the same way."""
    torch.manual_seed(3)
    mix = mqar.LinearMixer("gla", 16, 2, qk_norm="recipe").double()
    with torch.no_grad():
        mix.gates.weight.normal_(0, 0.5)  # token-dependent steps, so a missing or misplaced dt shows
    x = torch.randn(2, 11, 16, dtype=torch.float64)
    qkv, _ = mqar.causal_conv1d(mix.qkv(x), mix.conv_w, activation="silu")
    q, k, v = (t.reshape(2, 11, 2, 8) for t in qkv.split(mix.split, dim=-1))
    dt = torch.nn.functional.softplus(mix.gates(x).float()).double()  # [B, T, H]; the mixer takes its gates in fp32
    h = torch.zeros(2, 2, 8, 8, dtype=torch.float64)
    o = torch.empty(2, 11, 2, 8, dtype=torch.float64)
    for t in range(11):
        h = torch.exp(-dt[:, t])[..., None, None] * h + dt[:, t, :, None, None] * k[:, t, :, :, None] * v[:, t, :, None]
        o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t], h) / 8**0.5
    z = mix.z(x).reshape(2, 11, 2, 8)
    want = mix.out(mqar.gated_rms_norm(o, z, mix.norm_w, 1e-6).reshape(2, 11, 16))
    got = mix.double()(x)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    # and the "l2" form does not scale the write: the outputs differ
    plain = mqar.LinearMixer("gla", 16, 2, qk_norm="l2").double()
    plain.load_state_dict(mix.state_dict())
    assert (plain(x) - got).abs().max() > 1e-3


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


def test_mixed_pairs_split_the_batch_and_keep_the_test_at_the_cells_pairs():
    assert mqar.train_groups(128, 64, False) == [(128, 64)]
    assert mqar.train_groups(128, 64, True) == [(43, 16), (43, 32), (42, 64)]
    assert mqar.train_groups(5, 2, True) == [(3, 1), (2, 2)]  # 2 // 4 = 0 -> 1 pair; duplicates merged
    with pytest.raises(ValueError, match=r"batch_size: expected >= 3 with mixed pairs \[16, 32, 64\], got 2"):
        mqar.train_groups(2, 64, True)
    cfg = TrainConfig(steps=2, batch_size=6, test_examples=8, mixed_pairs=True)
    assert cfg.tag().endswith("|mix") and not TrainConfig().tag().endswith("|mix")
    r = train_cell(Cell("gdn", 16, Setting(32, 8, 64), 1e-2), cfg, seed=0, device=torch.device("cpu"))
    assert r["num_pairs"] == 8 and r["mixed_pairs"] is True and 0 <= r["accuracy"] <= 1


# The ordering, at the tiny preset's setting (random tokens fill the query region, as in Zoology's data).
# Measured accuracies (attention, deltanet, linear attention), 600 steps x 64, lr 1e-2:
#   seed 0: 0.996, 0.907, 0.132        seed 7: 0.999, 0.992, 0.968
# So at this CPU scale the gap is how fast each mixer learns within the budget, and it depends on the seed: a fresh
# seed per run would make this test flaky. A search for a CPU-sized setting where the gap comes from capacity
# (linear attention's state overloaded, the delta rule overwriting) found none (2026-11-23; 600 steps x 64, lr 1e-2,
# one thread, 500 test examples, seeds in brackets; "dk" is the recurrent mixers' key size, the state dk x width):
#   width 32, 16 pairs:          attention 1.000, linear 0.669, deltanet 0.631, gdn 0.030 [0]
#   width 64, 16 pairs:          deltanet 0.912, gdn 0.745 [0]; linear 0.026, 0.186, 0.635, 0.017 [0, 1, 2, 7]
#   same, training on 4/8/16 pairs mixed (--mixed-pairs, tested on 16):  gdn 0.973, linear 0.051 [0]
#   tiny setting, --qk-norm recipe (published forms):  linear 0.094, gla 0.396 [7] (l2 forms: linear 0.968 [7])
#   width 64, dk 16, 16 pairs:   linear 0.040, deltanet 0.695 [0]
#   width 64, dk 16, 8 pairs:    linear 0.605, 0.563, 0.635; deltanet 0.928, 0.791, 0.024; gdn 0.141, 0.048,
#                                0.047 [0, 1, 2]; with 1000 steps: linear 0.983 [0], gdn 0.889 [1], deltanet 0.008 [2]
#   same with vocab 128:         linear 0.987 [0], deltanet 0.981 [2], gdn 0.120, 0.501 [0, 1]
# Every recurrent mixer sits at chance (loss ln(number of values)) for 250 to over 600 steps and then drops; which
# ones drop within the budget depends on the seed, for the delta-rule mixers as much as for linear attention, and
# linear attention reaches 0.98 even with a 16 x 64 state and 8 pairs when given 1000 steps. So this test pins
# seed 0 (the run above, reproduced exactly twice on the CPU; it passed again on 2026-11-23, though a single DeltaNet
# seed-0 cell at the preset's 500 test examples gave 0.947 then, not the preset run's 0.907: thread count or changes
# to the ops move these numbers); HYBRIDLM_MQAR_SEED=N tries another. About 2 minutes on 2 free CPU cores (6 on 2
# busy ones), hence `slow`.
ORDER_SETTING = Setting(seq_len=64, num_pairs=8, vocab_size=512)
ORDER_CONFIG = TrainConfig(num_heads=1, steps=600, batch_size=64, test_examples=256)


# 2026-11-25, another CPU (2 cores, torch 2.13.0): seed 0 gave attention 0.993, deltanet 0.902, linear attention
# 0.854, where the machines before gave 0.996, 0.907, 0.132 on the same seed and code. The recurrent mixers' race
# against the step budget depends on the CPU's arithmetic as well as on the seed, so this test asserts only what
# held on every machine and seed measured: attention recalls (> 0.9), and no recurrent mixer beats it. The
# delta rule's lead over linear attention is a GPU result at the paper's scale (`hybridlm bench mqar`,
# BENCHMARKS.md), not something a 600-step CPU run can pin.


@pytest.mark.slow
def test_attention_recalls_and_no_recurrent_mixer_beats_it():
    seed = int(os.environ.get("HYBRIDLM_MQAR_SEED", "0"))
    acc = {m: train_cell(Cell(m, 64, ORDER_SETTING, 1e-2), ORDER_CONFIG, seed=seed, device=torch.device("cpu"))
           ["accuracy"] for m in ("attention", "deltanet", "linear_attention")}
    msg = f"seed {seed}: {acc}"
    assert acc["attention"] > 0.9, msg
    assert acc["attention"] >= max(acc["deltanet"], acc["linear_attention"]) - 0.01, msg
