"""`hybridlm SUB --help` and `hybridlm bench KIND --help` print that subcommand's own help, and flags have help text."""

from __future__ import annotations

import argparse
import importlib

import pytest

from hybridlm.bench.main import BENCHES
from hybridlm.cli import SUBCOMMANDS, main


def _help_of(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0, argv
    return capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_subcommand_help_is_its_own(name, capsys):
    out = _help_of([name, "--help"], capsys)
    assert out.startswith(f"usage: hybridlm {name} "), out
    module = importlib.import_module(SUBCOMMANDS[name][0])
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    for action in parser._actions:  # every flag the module defines is listed
        for opt in action.option_strings:
            assert opt in out, (name, opt)


@pytest.mark.parametrize("kind", ["kernels", "mqar", "train"])
def test_bench_kind_help_is_its_own(kind, capsys):
    out = _help_of(["bench", kind, "--help"], capsys)
    assert out.startswith(f"usage: hybridlm bench {kind} "), out
    assert "--out" in out
    out = _help_of(["bench", kind, "-h"], capsys)
    assert out.startswith(f"usage: hybridlm bench {kind} "), out


def test_bench_help_lists_kinds(capsys):
    out = _help_of(["bench", "--help"], capsys)
    assert out.startswith("usage: hybridlm bench "), out
    for kind in BENCHES:
        assert kind in out


def test_top_level_help_still_works(capsys):
    out = _help_of(["--help"], capsys)
    assert out.startswith("usage: hybridlm "), out
    for name in SUBCOMMANDS:
        assert name in out


def _modules() -> list[tuple[str, str]]:
    mods = [(k, v[0]) for k, v in SUBCOMMANDS.items()]
    mods += [(f"bench {k}", v[0]) for k, v in BENCHES.items() if k != "layers"]  # layers: not in this version
    return sorted(mods)


@pytest.mark.parametrize("name,module_name", _modules())
def test_every_flag_has_help_text(name, module_name):
    parser = argparse.ArgumentParser()
    importlib.import_module(module_name).add_arguments(parser)
    missing = [a.option_strings or a.dest for a in parser._actions
               if not isinstance(a, argparse._HelpAction) and not (a.help or "").strip()]
    assert not missing, f"{name}: flags without help text: {missing}"
