"""The command line: help lists every subcommand, the demo runs and shows agreement."""

from __future__ import annotations

import subprocess
import sys

from hybridlm.cli import SUBCOMMANDS, main


def test_help_lists_subcommands(capsys):
    assert main([]) == 2
    out = capsys.readouterr().out
    for name in SUBCOMMANDS:
        assert name in out


def test_demo_runs_and_algorithms_agree():
    out = subprocess.run([sys.executable, "-m", "hybridlm", "demo", "--seq-len", "40"], capture_output=True,
                         text=True, check=True).stdout
    rows = [line.split() for line in out.splitlines() if line.split() and line.split()[0] in
            ("gated_delta_rule", "kda", "delta_rule", "gated_linear_attention", "linear_attention", "comba",
             "mesa_net", "path_attention", "deltaformer_attention")]
    assert len(rows) == 9
    assert all(float(r[-1]) < 1e-12 for r in rows), out
