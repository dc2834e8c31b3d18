"""The layer benchmark's CPU-side pieces: the recompute variant and the table (the timing itself needs CUDA)."""

from __future__ import annotations

from hybridlm.bench import layers


def test_recompute_variant_builds_a_recomputing_layer():
    w = dict(D=64, H=2, HV=4, d=16)
    assert layers._ours_gdn(w, recompute=True).recompute and not layers._ours_gdn(w).recompute
    assert layers._ours_kda(dict(w, HV=2), recompute=True).recompute


def test_table_has_the_recompute_columns():
    info = dict(device="X", torch="t", triton="tr", fla="f", date_utc="d", tokens=16)
    row = dict(layer="gdn", width="2048", T=8, B=2, ours_tok_s=1000.0, fla_tok_s=900.0, speedup_vs_fla=1.11,
               ours_peak_GiB=3.0, fla_peak_GiB=2.5, ours_rc_tok_s=950.0, rc_speedup_vs_fla=1.06, ours_rc_peak_GiB=2.0,
               fla_error="boom")
    text = layers._table(info, [row])
    line = [ln for ln in text.splitlines() if ln.startswith("| gdn")][0]
    assert line.split("|")[9:12] == [" 950 ", " 1.06 ", " 2.00 "], line
    assert "fla_error: boom" in text


def test_rows_are_saved_as_they_finish(tmp_path, monkeypatch):
    """layers.json and layers.md are rewritten (atomically) after every row, so a run cut short keeps the rows it
    finished; --no-recompute reaches the row runner."""
    import argparse
    import json

    import pytest
    import torch

    p = argparse.ArgumentParser()
    layers.add_arguments(p)
    args = p.parse_args(["--out", str(tmp_path), "--rows", "gdn,kda", "--widths", "1024", "--seq-lens", "2048",
                         "--no-fla", "--no-recompute"])
    seen = []

    def fake_row(kind, wname, T, a, have_fla):
        seen.append((kind, a.no_recompute))
        if kind == "kda":
            raise KeyboardInterrupt  # the run stops in its second row
        return dict(layer=kind, width=wname, T=T, B=8, ours_tok_s=1.0, ours_peak_GiB=1.0)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "test device")
    monkeypatch.setattr(layers, "_run_row", fake_row)
    with pytest.raises(KeyboardInterrupt):
        layers.run(args)
    assert seen == [("gdn", True), ("kda", True)]
    saved = json.loads((tmp_path / "layers.json").read_text())
    assert [r["layer"] for r in saved["rows"]] == ["gdn"]
    assert "| gdn | 1024 | 2048 x 8 |" in (tmp_path / "layers.md").read_text()
    assert not [f for f in tmp_path.iterdir() if f.name.startswith(".tmp-")]
