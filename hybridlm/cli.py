"""The `hybridlm` command line: one subcommand per job.

Non-standard here: subcommands live in the modules that do the work; each module exposes
`add_arguments(parser)` and `run(args) -> int`, and is imported only when its subcommand runs, so `hybridlm --help`
stays fast and a missing optional dependency only breaks the subcommand that needs it.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "train": ("hybridlm.train.main", "train a hybrid model (defaults: a small 3:1 GDN hybrid on bundled Shakespeare)"),
    "demo": ("hybridlm.demo", "run the reference ops once and print what they compute (no training)"),
    "info": ("hybridlm.model.info", "parameters, layer pattern and cache bytes of a preset or checkpoint"),
    "generate": ("hybridlm.model.generate_cli", "generate text from a checkpoint folder"),
    "memory": ("hybridlm.model.memory", "KV-cache vs recurrent-state bytes against context length"),
    "bench": ("hybridlm.bench.main", "benchmarks: kernels, layers, mqar"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridlm", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level (which impl auto picked)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in SUBCOMMANDS.items():
        # add_help=False: `hybridlm NAME --help` must reach NAME's own parser (built in main), not this stub
        p = sub.add_parser(name, help=help_, description=help_, add_help=False)
        p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # Parse the command name first, then let its module add its own flags.
    args, rest = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    module = importlib.import_module(args._module)
    sub = argparse.ArgumentParser(prog=f"hybridlm {args.command}", description=SUBCOMMANDS[args.command][1])
    module.add_arguments(sub)
    sub_args = sub.parse_args(rest)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    return int(module.run(sub_args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
