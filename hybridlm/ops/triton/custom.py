"""The kernels' entry points as torch.library custom ops, called without the dispatcher in eager mode.

Non-standard here: every entry point is registered as a custom op with a fake kernel, so torch.compile traces
each as one opaque node, but `call(name, *args)` runs the Python implementation directly unless a compiler is
tracing. The custom op's eager wrapper costs tens of microseconds of host time per call (on an H100 host the
norm's forward took 58 us through `torch.ops` against 27 us direct; more with several outputs), and a 325M hybrid's
training step makes about 300 such calls while its host time, not its GPU time, bounds the step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_IMPLS: dict[str, Callable] = {}


def custom_op(name: str, *, mutates_args: tuple[str, ...] = ()):
    """Decorator: register `fn` as the custom op hybridlm::name and remember it for eager calls."""

    def wrap(fn: Callable):
        _IMPLS[name] = fn
        return torch.library.custom_op(f"hybridlm::{name}", fn, mutates_args=mutates_args)

    return wrap


def call(name: str, *args):
    """hybridlm::name(*args): the op itself under torch.compile, its Python implementation otherwise."""
    if torch.compiler.is_compiling():
        return getattr(torch.ops.hybridlm, name)(*args)
    return _IMPLS[name](*args)
