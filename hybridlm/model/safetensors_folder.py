"""Reading and writing safetensors checkpoint folders (single file or sharded with an index), atomically.

Non-standard here: every file is written through `hybridlm.files.atomic_write` (a temporary name in the same
folder, fsync, os.replace), so an interrupted save never leaves a half-written file under the final name. Reading
is lazy: a `TensorSource` maps every key to the file that holds it and opens the tensor only when asked; a missing
or truncated file is reported with its path.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hybridlm.files import atomic_write, atomic_write_text
from hybridlm.model.locate import UsageError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class CheckpointError(UsageError, RuntimeError):
    """A checkpoint folder that cannot be loaded as asked; the message names the file / key / shapes. A UsageError
    (the command line prints it as one line) and, as it always was, a RuntimeError."""


def atomic_save_tensors(tensors: dict[str, torch.Tensor], path: str) -> None:
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))


def parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    s = size.strip().upper()
    for unit, mult in (("GIB", 2**30), ("MIB", 2**20), ("KIB", 2**10), ("GB", 10**9), ("MB", 10**6),
                       ("KB", 10**3), ("B", 1)):
        if s.endswith(unit):
            return int(float(s[: -len(unit)]) * mult)
    return int(s)


def save_sharded(tensors: dict[str, torch.Tensor], folder: str, max_shard_size: int | str) -> list[str]:
    """Write one file, or shards + index when the total exceeds max_shard_size. Returns the file names."""
    limit = parse_size(max_shard_size)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, v in tensors.items():
        n = v.numel() * v.element_size()
        if shards[-1] and size + n > limit:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += n
    if len(shards) == 1:
        atomic_save_tensors(shards[0], os.path.join(folder, SINGLE_NAME))
        _remove_if_present(os.path.join(folder, INDEX_NAME))  # a stale index would shadow the new file
        return [SINGLE_NAME]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards):
        atomic_save_tensors(shard, os.path.join(folder, name))
        weight_map.update({k: name for k in shard})
    total = sum(v.numel() * v.element_size() for v in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    atomic_write_text(os.path.join(folder, INDEX_NAME), json.dumps(index, indent=2) + "\n")
    _remove_if_present(os.path.join(folder, SINGLE_NAME))
    return names


def _remove_if_present(path: str) -> None:
    if os.path.exists(path):
        os.remove(path)


class TensorSource:
    """Lazy view of every tensor in a checkpoint folder: key -> file, opened on demand."""

    def __init__(self, folder: str):
        self.folder = folder
        index_path = os.path.join(folder, INDEX_NAME)
        single = os.path.join(folder, SINGLE_NAME)
        self.where: dict[str, str] = {}
        if os.path.exists(index_path):
            with open(index_path, encoding="utf-8") as f:
                weight_map = json.load(f).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index_path}: no 'weight_map' in the index")
            files = sorted(set(weight_map.values()))
        elif os.path.exists(single):
            files = [SINGLE_NAME]
        else:
            raise CheckpointError(f"{folder}: no {SINGLE_NAME} and no {INDEX_NAME}")
        self._handles = {}
        for name in files:
            path = os.path.join(folder, name)
            if not os.path.exists(path):
                raise CheckpointError(f"{path}: listed in {INDEX_NAME} but missing")
            self._check_size(path)
            try:
                h = safe_open(path, framework="pt")
                keys = list(h.keys())
            except Exception as e:  # safetensors raises its own error types for bad headers / data
                raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from e
            self._handles[name] = h
            for k in keys:
                self.where[k] = name

    @staticmethod
    def _check_size(path: str) -> None:
        """safe_open only reads the header: compare the data the header promises with the file's length."""
        actual = os.path.getsize(path)
        try:
            with open(path, "rb") as f:
                header_len = int.from_bytes(f.read(8), "little")
                if actual < 8 + header_len:
                    raise CheckpointError(f"{path}: truncated (header of {header_len} bytes, file has {actual})")
                header = json.loads(f.read(header_len))
        except (ValueError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: not a readable safetensors file (bad header: {e})") from e
        data_end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        if actual < 8 + header_len + data_end:
            raise CheckpointError(
                f"{path}: truncated (header promises {8 + header_len + data_end} bytes, file has {actual})"
            )

    def keys(self) -> list[str]:
        return list(self.where)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._handles[self.where[key]].get_slice(key).get_shape())

    def get(self, key: str) -> torch.Tensor:
        name = self.where[key]
        try:
            return self._handles[name].get_tensor(key)
        except Exception as e:
            raise CheckpointError(f"{os.path.join(self.folder, name)}: cannot read {key!r} ({e})") from e
