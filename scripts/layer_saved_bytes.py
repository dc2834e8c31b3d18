"""What one GDN or KDA layer keeps for its backward, tensor by tensor, without a GPU.

Non-standard here: the layer runs on PyTorch's meta device (shapes only, nothing computed) with the Triton path
selected, so the custom ops' fake kernels stand in for the kernels and report exactly the buffers the kernels save.
TRITON_INTERPRET=1 only lets the host code accept non-CUDA tensors; no kernel is interpreted. The layer's glue
(short conv, norms) takes its PyTorch path on meta, so what the fused glue saves on a GPU may differ. Tensors that
share a storage (q, k, v as views of the conv output) are counted once, at the storage's size. What the backward
allocates on top (state gradients, partial sums) is not listed: the fake kernels allocate only the outputs.

    python scripts/layer_saved_bytes.py --layer gdn --batch 8 --seq-len 2048 [--recompute] [--saved-qk]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402


def saved_storages(layer: torch.nn.Module, x: torch.Tensor) -> list[tuple[int, torch.dtype, tuple, str]]:
    """(bytes, dtype, shape, autograd node) per distinct storage saved for the backward of layer(x)."""
    seen: dict[int, tuple[int, torch.dtype, tuple, str]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        seen.setdefault(id(st), (st.nbytes(), t.dtype, tuple(t.shape), ""))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    return sorted(seen.values(), key=lambda r: -r[0])


def build(kind: str, hidden: int, recompute: bool) -> torch.nn.Module:
    from hybridlm.layers.gdn import GatedDeltaNet
    from hybridlm.layers.kda import KimiDeltaAttention

    if kind == "gdn":  # Qwen3-Next widths: 16 key heads, 32 value heads, head dim 128
        return GatedDeltaNet(hidden, 16, 32, 128, 128, layout="split", impl="triton", recompute=recompute)
    return KimiDeltaAttention(hidden, 32, 128, impl="triton", recompute=recompute)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layer", choices=("gdn", "kda"), default="gdn", help="which layer (Qwen3-Next / Kimi widths)")
    p.add_argument("--hidden", type=int, default=2048, help="model width")
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence")
    p.add_argument("--recompute", action="store_true", help="the recurrence keeps only its inputs (recompute=True)")
    p.add_argument("--saved-qk", action="store_true",
                   help="GDN: the forward keeps Qg and Kd for the backward (gdn.TUNE bwd_raw_qk off)")
    args = p.parse_args()
    import hybridlm.ops.triton  # noqa: F401  (registers the custom ops and their fake kernels)
    from hybridlm.ops.triton import gdn

    gdn.TUNE["bwd_raw_qk"] = not args.saved_qk

    with torch.device("meta"):
        layer = build(args.layer, args.hidden, args.recompute).to(torch.bfloat16)
        x = torch.randn(args.batch, args.seq_len, args.hidden, dtype=torch.bfloat16, requires_grad=True)
        rows = saved_storages(layer, x)
    total = 0
    for nbytes, dtype, shape, _ in rows:
        total += nbytes
        print(f"{nbytes / 2**20:9.1f} MiB  {str(dtype).replace('torch.', ''):9} {list(shape)}")
    print(f"{total / 2**20:9.1f} MiB  in all ({args.layer}, B {args.batch} x T {args.seq_len}, hidden {args.hidden}"
          f"{', recompute' if args.recompute else ''}{', scaled q/k kept' if args.saved_qk else ''})")


if __name__ == "__main__":
    main()
