"""Host copies of `cu_seqlens` (packed-document offsets) without one device sync per use.

Every varlen op needs the offsets on the host (to validate them, to lay out chunks, to loop over documents), and
`cu_seqlens.tolist()` on a CUDA tensor makes the host wait for the device. A packed training step passes the same
tensor through every layer, forward and backward, so without this it would wait about five times per GDN layer
per step.

Non-standard here: the host values are remembered per tensor object (weakly: a tensor's entry goes with it) and
checked against its version counter, so an in-place change is seen. The first use pays one sync; a caller that
built the tensor from host values (the training loop) can register them with `remember_offsets` and pay none.
Inference tensors (made under `torch.inference_mode`) have no version counter, so an in-place change to one could
not be seen: they are read on every use and never recorded (serving stacks refill such buffers in place). The
public recurrences copy one into a normal tensor once per call, so a call reads it once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary

_HOST: WeakIdKeyDictionary = WeakIdKeyDictionary()


def host_offsets(cu_seqlens: torch.Tensor) -> list[int]:
    """cu_seqlens [N+1] as a list of Python ints: from the record of this tensor when there is a current one,
    else by one `.tolist()` (a host sync on an accelerator), which is then recorded (not for an inference tensor:
    it has no version counter to tell a record from a stale one)."""
    if cu_seqlens.is_inference():
        return [int(x) for x in cu_seqlens.tolist()]
    hit = _HOST.get(cu_seqlens)
    if hit is not None and hit[0] == cu_seqlens._version:
        return hit[1]
    values = [int(x) for x in cu_seqlens.tolist()]
    _HOST[cu_seqlens] = (cu_seqlens._version, values)
    return values


def remember_offsets(cu_seqlens: torch.Tensor, host: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Record that `cu_seqlens` holds `host` (e.g. a device copy made from a CPU tensor), so that no op needs to
    read it back. Returns cu_seqlens. An inference tensor is not recorded (see the module docstring): it is read
    on each use."""
    if isinstance(host, torch.Tensor):
        if host.device.type != "cpu":
            raise ValueError(f"host: expected a CPU tensor or a sequence of ints, got a tensor on {host.device}")
        host = host.tolist()
    values = [int(x) for x in host]
    if len(values) != cu_seqlens.numel():
        raise ValueError(f"host: expected {cu_seqlens.numel()} offsets (cu_seqlens has shape "
                         f"{tuple(cu_seqlens.shape)}), got {len(values)}")
    if not cu_seqlens.is_inference():
        _HOST[cu_seqlens] = (cu_seqlens._version, values)
    return cu_seqlens


__all__ = ["host_offsets", "remember_offsets"]
