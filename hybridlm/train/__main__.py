"""`python -m hybridlm.train ...` (what torchrun runs): the same flags as `hybridlm train`."""

import argparse
import logging

from .main import add_arguments, run

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m hybridlm.train", description="train a hybrid model")
    add_arguments(parser)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    raise SystemExit(run(parser.parse_args()))
