"""hybridlm bench kernels on the CPU: the KDA rows' log-decays and the checks of the rows asked for (the timings
themselves need CUDA)."""

import argparse
import sys

import pytest
import torch
import torch.nn.functional as F

from hybridlm.bench import kernels


def _args(**kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    kernels.add_arguments(p)
    ns = p.parse_args([])
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns


def test_kda_init_gates_are_a_fresh_layers(seed):
    """"init": one decay rate A in [1, 16] per head times softplus(0.33 N(0, 1)); fast, about -5.5 a step."""
    gen = torch.Generator().manual_seed(seed)
    B, T, H, D = 2, 512, 16, 64
    g = kernels.kda_bench_gates("init", B, T, H, D, "cpu", gen)
    assert g.shape == (B, T, H, D) and g.dtype == torch.float32
    assert bool((g < 0).all())
    sp_mean = F.softplus(0.33 * torch.randn(10**6, dtype=torch.float64)).mean()
    A = -g.mean(dim=(0, 1, 3)) / sp_mean  # [H]
    assert bool(((A > 0.97) & (A < 16.3)).all()), A
    assert A.max() - A.min() > 5.0  # heads differ
    assert -12.0 < g.mean().item() < -3.0  # E[A] 8.5 (sd of 16 heads' mean ~1.1) x E[softplus] 0.72: ~ -6


def test_kda_bench_gates_are_mild(seed):
    gen = torch.Generator().manual_seed(seed)
    g = kernels.kda_bench_gates("bench", 2, 256, 4, 64, "cpu", gen)
    assert -0.1 < g.mean().item() < -0.02 and bool((g < 0).all())


def test_bad_gates_and_rows_are_refused_before_anything_runs():
    with pytest.raises(ValueError, match="kda gates: expected one of bench, init, got 'trained'"):
        kernels.kda_bench_gates("trained", 1, 8, 1, 8, "cpu", torch.Generator())
    with pytest.raises(SystemExit, match="--kda-gates: expected a subset of bench,init, got 'bench,fast'"):
        kernels.run(_args(kda_gates="bench,fast"))
    with pytest.raises(SystemExit, match=r"--parts: unknown \['kdaa'\]"):
        kernels.run(_args(parts="gdn,kdaa"))
    assert kernels._rows_asked(_args()) == (["decode", "gdn", "kda"], ["bench", "init"])


def test_fla_autotuners_are_cleared_between_shapes(monkeypatch):
    """fla's tuned configs (keyed without B and T) are cleared before each shape: every Triton autotuner found in a
    loaded fla module loses its cache, other modules' are untouched."""
    import types

    from triton.runtime.autotuner import Autotuner

    def tuner(cache):
        t = Autotuner.__new__(Autotuner)
        t.cache = dict(cache)
        return t

    ours, theirs, empty = tuner({("H32",): "cfg"}), tuner({("H32",): "cfg"}), tuner({})
    fake = types.ModuleType("fla.fake_ops")
    wrapped = tuner({("K128",): "cfg"})
    fake.kern, fake.alias, fake.empty = theirs, theirs, empty
    fake.heuristic = types.SimpleNamespace(fn=wrapped)  # as @triton.heuristics wraps an autotuner
    other = types.ModuleType("not_fla_mod")
    other.kern = ours
    monkeypatch.setitem(sys.modules, "fla.fake_ops", fake)
    monkeypatch.setitem(sys.modules, "not_fla_mod", other)
    assert kernels._fla_retune() >= 1
    assert theirs.cache == {} and wrapped.cache == {} and ours.cache == {("H32",): "cfg"}


def test_table_has_gpu_time_rows_when_measured():
    info = {"device": "H100", "torch": "2.11", "triton": "3.6", "fla_core": "0.6.0", "date_utc": "now",
            "copy_GBps": 3000.0, "bf16_matmul_TFLOPs": 740.0, "fla_guard_lifted": True}
    row = {"shape": "B8 T2048 H32 D128", "flops_fwd": 1e11, "bytes_fwd": 5e8, "ours_fwd_ms": 1.5,
           "ours_fwdbwd_ms": 4.6, "fla_fwd_ms": 1.2, "fla_fwdbwd_ms": 4.5, "ours_fwd_gpu_ms": 1.4,
           "ours_fwdbwd_gpu_ms": 4.6, "fla_fwd_gpu_ms": 1.0, "fla_fwdbwd_gpu_ms": 3.9}
    table = kernels._table(info, [row])
    assert "| B8 T2048 H32 D128 | fwd+bwd | 4.600 | 3.900 | 0.85 |" in table
    assert "ours GPU ms" not in kernels._table(info, [{k: v for k, v in row.items() if "gpu" not in k}])


def test_gpu_time_counts_side_by_side_kernels_once():
    """The GPU time of a call is the union of its kernels' intervals: one after another they add up, side by side
    (two streams) they count once, and a gap between them is left out."""
    from hybridlm.bench.cuda_profile import union_length

    assert union_length([(0.0, 2.0), (2.0, 5.0)]) == 5.0
    assert union_length([(0.0, 10.0), (1.0, 4.0), (3.0, 12.0)]) == 12.0
    assert union_length([(5.0, 6.0), (0.0, 1.0)]) == 2.0
    assert union_length([]) == 0.0


def test_multi_token_decode_rows_run_and_count_their_bytes(monkeypatch):
    """The draft-token rows on the CPU (the PyTorch path, a small shape, each call once): four rows, their bytes
    as counted by hand, and the table shows them against the copy bandwidth. At the bench's shape N 64, T 4,
    H 16, HV 32, K = V = 128 keeping every state: 64 states read, 256 written (2 MiB each), 24768 bytes of inputs
    and outputs a token, 512 of rows and counts."""
    assert kernels.bytes_decode(64, 4, 16, 32, 128, 128, written=256) == 320 * 2**21 + 256 * 24768 + 512
    calls = []
    monkeypatch.setattr(kernels, "_bench", lambda fn, rep: calls.append(fn()) or 2.0)
    monkeypatch.setattr(kernels, "DRAFT", (3, 2, 1, 2, 16, 8))
    rows = kernels._bench_decode_multi("cpu", torch.Generator().manual_seed(0), None, _args())
    assert len(rows) == 4 == len(calls) and all(o.shape == (3, 2, 2, 8) for o in calls)
    assert [r["bytes"] for r in rows[:3]] == [kernels.bytes_decode(3, 2, 1, 2, 16, 8, written=w, channel=c)
                                              for w, c in ((6, False), (6, True), (3, False))]
    info = {"device": "H100", "torch": "2.11", "triton": "3.6", "fla_core": None, "date_utc": "now",
            "copy_GBps": 1.0, "bf16_matmul_TFLOPs": 740.0, "fla_guard_lifted": False}
    assert f"| {rows[0]['shape']} | decode | 2.000 | - | - | - | - |" in kernels._table(info, rows)


def test_chunked_shapes_take_grouped_value_heads():
    """B,T,H,D[,HV]: HV defaults to H and must be a multiple of it; the default run adds Qwen3.5's 16 key heads to
    32 value heads to the three benchmark shapes."""
    assert kernels._shapes(_args(shapes=["4,4096,16,128,32", "1,64,2,16"])) == [(4, 4096, 16, 128, 32),
                                                                               (1, 64, 2, 16, 2)]
    assert kernels._shapes(_args())[-1] == (4, 4096, 16, 128, 32) and len(kernels._shapes(_args())) == 4
    assert kernels._shapes(_args(quick=True)) == [(4, 4096, 16, 128, 16)]
    with pytest.raises(SystemExit, match="--shapes: expected HV a multiple of H, got H=3 HV=4 in '1,8,3,16,4'"):
        kernels._shapes(_args(shapes=["1,8,3,16,4"]))
    with pytest.raises(SystemExit, match="--shapes: expected B,T,H,D or B,T,H,D,HV with positive integers"):
        kernels._shapes(_args(shapes=["1,8,3"]))
    assert kernels._kda_shapes(_args()) == [(4, 4096, 16, 128)]
    assert kernels._kda_shapes(_args(shapes=["4,4096,16,128,32", "8,2048,32,128"])) == [(8, 2048, 32, 128)]
    assert kernels.bytes_gdn_fwd(1, 1, 2, 4, 8, HV=4) == 2 * 2 * 4 * 2 + 4 * (8 * 2 + 2 + 4 + 8 * 2)


def test_one_token_decode_rows_run_gdn_and_kda_at_both_pool_sizes(monkeypatch):
    """The one-token rows on the CPU (the PyTorch path, small heads, each call once): GDN and KDA at N 64 and 256,
    each updating its pool in place, their bytes the fewest a call moves (KDA reads a log-decay per key channel)."""
    calls = []
    monkeypatch.setattr(kernels, "_bench", lambda fn, rep: calls.append(fn()) or 2.0)
    monkeypatch.setattr(kernels, "DECODE", (2, 16, 8))
    rows = kernels._bench_decode("cpu", torch.Generator().manual_seed(0), None, _args())
    assert [r["shape"].split(" pool")[0] for r in rows] == ["GDN decode N256", "GDN decode N64", "KDA decode N64",
                                                            "KDA decode N256"]
    assert [o.shape for o in calls] == [(256, 2, 8), (64, 2, 8), (64, 2, 8), (256, 2, 8)]
    assert [r["bytes"] for r in rows] == [kernels.bytes_decode(n, 1, 2, 2, 16, 8, written=n, channel=c)
                                          for n, c in ((256, False), (64, False), (64, True), (256, True))]


def test_prefill_rows_are_asked_by_name_and_tabled_as_speedups_of_ours():
    """A prefill row's cells: ours, fla/ours on median, graph replay and GPU ms, our wall / GPU; a missing number
    (fla's graph failed, no GPU time) is "-", not an error."""
    assert kernels._rows_asked(_args(parts="prefill,gdn"))[0] == ["prefill", "gdn"]
    info = {"device": "H100", "torch": "2.11", "triton": "3.6", "fla_core": "0.6.0", "date_utc": "now",
            "copy_GBps": 3000.0, "bf16_matmul_TFLOPs": 740.0, "fla_guard_lifted": True}
    row = {"prefill": True, "shape": "B4 T4096 H16 D128", "impl": "gluon", "ours_ms": 0.5, "fla_ms": 1.5,
           "ours_graph_ms": 0.25, "fla_graph_ms": 0.5, "ours_gpu_ms": 0.4, "fla_gpu_ms": 1.0,
           "fla_vs_ours_rel": 2e-3}
    partial = {"prefill": True, "shape": "B1 T4096 H16 D128", "impl": "triton", "ours_ms": 0.3, "fla_ms": 0.6,
               "ours_graph_ms": 0.2, "fla_graph_error": "x"}
    table = kernels._table(info, [row, partial])
    assert "| B4 T4096 H16 D128 | gluon | 0.500 | 3.00 | 0.250 | 2.00 | 0.400 | 2.50 | 1.25 | 2.0e-03 |" in table, table
    assert "| B1 T4096 H16 D128 | triton | 0.300 | 2.00 | 0.200 | - | - | - | - | - |" in table, table
    assert table.count("B4 T4096 H16 D128") == 1  # prefill rows stay out of the chunked rows' table
    assert [s[:3] for s in kernels.PREFILL_SHAPES] == [(1, 32768, 8), (2, 16384, 8), (1, 8192, 16), (1, 4096, 16),
                                                       (4, 4096, 16)]
