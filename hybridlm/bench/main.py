"""`hybridlm bench WHAT [flags]`: dispatch to one benchmark module, each with add_arguments(parser), run(args).

Modules are imported only when their benchmark runs (a missing optional dependency breaks only that one).
"""

from __future__ import annotations

import argparse
import importlib

# name -> (module, help); a name whose module is not there yet says so when asked for
BENCHES: dict[str, tuple[str, str]] = {
    "kernels": ("hybridlm.bench.kernels", "Triton GDN kernels vs fla-core and SDPA (CUDA)"),
    "layers": ("hybridlm.bench.layers", "layer-level benchmark"),
    "mqar": ("hybridlm.bench.mqar", "multi-query associative recall"),
    "train": ("hybridlm.bench.train", "training tokens/s of a ~350M 3:1 hybrid, ours vs fla's model classes"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("what", choices=sorted(BENCHES), help="; ".join(f"{k}: {v[1]}" for k, v in BENCHES.items()))
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="flags of that benchmark (see WHAT --help)")


def run(args: argparse.Namespace) -> int:
    module_name, help_ = BENCHES[args.what]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name == module_name:
            print(f"hybridlm bench {args.what}: not available in this version ({module_name} is missing)")
            return 2
        raise
    sub = argparse.ArgumentParser(prog=f"hybridlm bench {args.what}", description=help_)
    module.add_arguments(sub)
    return int(module.run(sub.parse_args(args.rest)) or 0)
