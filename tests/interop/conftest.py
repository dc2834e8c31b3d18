"""The interop tests import hf_models by name; the transformers models they share are built once per session."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def hf_and_folder(tmp_path_factory, derive_seed):
    """(transformers model, folder it saved itself to) of a family, built once for the session on a seed of its own
    derived from the run's (so that any test replays alone). Tests must not change the model."""
    from hf_models import make_hf

    cache: dict[str, tuple] = {}

    def get(family: str):
        if family not in cache:
            with torch.random.fork_rng(devices=[]):  # the calling test's draws do not depend on who built it
                hf = make_hf(family, derive_seed(f"hf_models:{family}"))
                folder = tmp_path_factory.mktemp(family)
                hf.save_pretrained(folder)
            cache[family] = (hf, folder)
        return cache[family]

    return get
