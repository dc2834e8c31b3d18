"""The `hybridlm` command line: one subcommand per job.

Non-standard here: subcommands live in the modules that do the work; each module exposes
`add_arguments(parser)` and `run(args) -> int`, and is imported only when its subcommand runs, so `hybridlm --help`
stays fast and a missing optional dependency only breaks the subcommand that needs it.
Errors are one line on stderr: a bad flag (argparse) or a UsageError (a bad argument, a damaged checkpoint) exits
with 2, anything else with 1 and the exception's type; `-v` (before or after the subcommand) shows the traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
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


class _OneLineParser(argparse.ArgumentParser):
    """argparse's errors as one line (not the usage block too), pointing at --help."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


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
    verbose = args.verbose or any(a in ("-v", "--verbose") for a in rest)
    rest = [a for a in rest if a not in ("-v", "--verbose")]
    module = importlib.import_module(args._module)
    prog = f"hybridlm {args.command}"
    sub = _OneLineParser(prog=prog, description=SUBCOMMANDS[args.command][1])
    module.add_arguments(sub)
    sub_args = sub.parse_args(rest)
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(name)s: %(message)s")
    from hybridlm.model.locate import UsageError

    try:
        return int(module.run(sub_args) or 0)
    except BrokenPipeError:  # the reader left (`| head`): nothing to say; stdout to devnull so exit's flush is quiet
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except UsageError as e:
        if verbose:
            raise
        print(f"{prog}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - one line; the traceback is one -v away
        if verbose:
            raise
        print(f"{prog}: error: {type(e).__name__}: {_one_line(e)} (hybridlm -v {args.command} ... shows where)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
