"""The results files of `hybridlm bench mqar`: results.json (one record per cell) and the shard files of parallel
runs, merged by cell key; the time estimate that `--max-minutes` stops on.

Non-standard here: results.json was first a bare list of cells; that format still loads (as {"runs": [], "cells":
list}). A shard's file may start from a copy of the base file, so merging drops runs already present.
"""

from __future__ import annotations

import json
import os

from hybridlm.files import atomic_write


def atomic_savefig(fig, path: str) -> None:
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120))


def load_results(path: str) -> dict:
    if not os.path.exists(path):
        return {"runs": [], "cells": []}
    with open(path) as f:
        data = json.load(f)
    if isinstance(data, list):  # the first format: a bare list of cells
        data = {"runs": [], "cells": data}
    return data


def parse_shard(text: str | None) -> tuple[int, int] | None:
    """'I/N' -> (I, N): this process runs the cells whose index among those still to run is I modulo N."""
    if text is None:
        return None
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        i, n = -1, 0
    if not 0 <= i < n:
        raise ValueError(f"shard: expected I/N with 0 <= I < N (e.g. 0/4), got {text!r}")
    return i, n


def merged_results(out: str) -> dict:
    """results.json plus every shard file in out, one record per cell key (the first seen wins)."""
    data = load_results(os.path.join(out, "results.json"))
    seen = {r["key"] for r in data["cells"]}
    names = sorted(f for f in os.listdir(out) if f.startswith("results.shard") and f.endswith(".json")) \
        if os.path.isdir(out) else []
    for name in names:
        part = load_results(os.path.join(out, name))
        data["runs"] += [r for r in part["runs"] if r not in data["runs"]]  # a part may start from a copy of the base
        for r in part["cells"]:
            if r["key"] not in seen:
                seen.add(r["key"])
                data["cells"].append(r)
    return data


def estimate_seconds(cell, cfg, done: list[dict], device: str) -> float | None:
    """Seconds a cell will take, from cells already run on this device with the same mixer, width, length, steps,
    batch and CUDA-graph setting (scaled by steps); None when nothing comparable ran yet."""
    same = [r for r in done if r.get("device") == device and r["mixer"] == cell.mixer and r["width"] == cell.width
            and r["seq_len"] == cell.setting.seq_len and r.get("batch_size") == cfg.batch_size and r.get("steps")
            and r.get("cuda_graphs", False) == cfg.cuda_graphs]
    if same:
        return max(r["seconds"] / r["steps"] for r in same) * cfg.steps
    return None
