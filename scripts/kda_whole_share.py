"""Share of KDA (chunk, head) pairs that each launch of the K-blocked kernels takes (`kda_kernels._diag_pass`): the
whole-chunk dot (DIAG 3), the diagonal-block dot (DIAG 1), the half-block dots (DIAG 4) and the exact loop (DIAG 2),
for the gates of a `KimiDeltaAttention` layer or the kernel bench's (CPU, float64).

    python scripts/kda_whole_share.py [--hidden 2304] [--heads 32] [--head-dim 128] [--tokens 8192] [--seed 0]
                                      [--bench-init] [--middle-row]

The same bounds as the kernels: a block of rows (the chunk of 64, its 16-row blocks, their 8-row halves) takes the
dot when |b_i - r| <= 60 for every row i and channel, b the cumulative log-decay: for the whole chunk r = b at its
middle row (row 31), for the 16- and 8-row blocks r the midpoint of the block's range of b (`kda_kernels._centred`),
i.e. half the block's log-decay span is at most 60: the backward kernels' routing. --middle-row: r = b at the
middle row everywhere (the forward prep's routing, and the backward's before 2026-11-25 06:30). Gates of a freshly
initialised layer (our init: A_log = log U(1, 16), dt_bias 0) on x ~ N(0, 1), or with --bench-init the kernel
bench's "init" gates at B4 T4096 H16 D128 (`hybridlm.bench.kernels.kda_bench_gates`); a released checkpoint's
gates can be passed to `shares`.
"""

from __future__ import annotations

import argparse

import torch

BOUND = 60.0


def shares(g: torch.Tensor, BT: int = 64, centred: bool = True) -> dict:
    """g: [T, H, K] log-decays (T a multiple of BT) -> fractions of (chunk, head) pairs per launch."""
    T, H, K = g.shape
    b = g.double().view(T // BT, BT, H, K).cumsum(1)

    def fits(block: int) -> torch.Tensor:
        bb = b.view(T // BT, BT // block, block, H, K)
        if centred and block < BT:  # the whole chunk is bounded through its middle row (`_whole_sums`)
            worst = (bb[:, :, 0] - bb[:, :, -1]) / 2  # half the span: b falls down a block
        else:
            mid = block // 2 - 1
            worst = (bb - bb[:, :, mid:mid + 1]).abs().amax(dim=2)
        return worst.amax(dim=(1, 3)) <= BOUND  # [chunks, H]

    whole = fits(BT)
    diag = fits(16) & ~whole
    half = fits(8) & ~whole & ~diag
    n = whole.numel()
    out = {name: m.sum().item() / n for name, m in (("whole", whole), ("diag_dot", diag), ("half_dot", half))}
    out["exact"] = 1 - sum(out.values())
    return dict(out, pairs=n, mean_g=g.double().mean().item(), median_g=g.double().flatten().median().item())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2304, help="hidden size (Kimi Linear 48B: 2304)")
    ap.add_argument("--heads", type=int, default=32, help="KDA heads")
    ap.add_argument("--head-dim", type=int, default=128, help="head dim")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens (a multiple of 64)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the init and the input")
    ap.add_argument("--bench-init", action="store_true",
                    help="the kernel bench's init gates at B4 T4096 H16 D128 instead of a layer's")
    ap.add_argument("--middle-row", action="store_true",
                    help="bound every block through its middle row (the forward prep's routing)")
    args = ap.parse_args(argv)
    if args.bench_init:
        from hybridlm.bench.kernels import kda_bench_gates

        gen = torch.Generator().manual_seed(args.seed)
        g = kda_bench_gates("init", 4, 4096, 16, 128, "cpu", gen).reshape(4 * 4096, 16, 128)
        print({k: round(v, 4) if isinstance(v, float) else v
               for k, v in shares(g, centred=not args.middle_row).items()})
        return 0
    from hybridlm.layers.kda import KimiDeltaAttention

    torch.manual_seed(args.seed)
    layer = KimiDeltaAttention(args.hidden, args.heads, args.head_dim, impl="naive")
    with torch.no_grad():
        g = layer.forget_gate(torch.randn(1, args.tokens, args.hidden))[0]
    print({k: round(v, 4) if isinstance(v, float) else v
           for k, v in shares(g, centred=not args.middle_row).items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
