"""The README runs as written: every Python snippet, in a fresh interpreter and an empty folder; and it names the
command that uses what the main job trained right after the main job."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", README.read_text(encoding="utf-8"), flags=re.S | re.M)


@pytest.mark.parametrize("i", range(len(_blocks("python"))))
def test_python_snippet_runs(i, tmp_path):
    code = _blocks("python")[i]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(README.parent), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                       env=env)
    assert r.returncode == 0, f"README snippet {i}:\n{code}\n{r.stderr}"


def test_generate_on_the_run_folder_follows_the_main_job():
    lines = _blocks("bash")[0].splitlines()
    main = next(i for i, line in enumerate(lines) if line.rstrip().endswith("# main job"))
    assert "hybridlm train" in lines[main]
    assert re.match(r"hybridlm generate --model runs/train\b", lines[main + 1]), lines[main + 1]
