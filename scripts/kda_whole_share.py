"""Share of KDA (chunk, head) pairs that the whole-chunk dot takes (`kda_kernels._diag_pass` DIAG 3), that the
diagonal-block dot takes (DIAG 1), and that go exactly, for the gates of a `KimiDeltaAttention` layer (CPU, float64).

    python scripts/kda_whole_share.py [--hidden 2304] [--heads 32] [--head-dim 128] [--tokens 8192] [--seed 0]

The same bounds as the kernels: a chunk of 64 rows goes whole when |b_i - b_m| <= 60 for every row i and channel
(m = row 31, b the cumulative log-decay), else by diagonal-block dot when within each 16-row block |b_i - b_m'| <= 60
(m' its row 7), else exactly. Gates of a freshly initialised layer (our init: A_log = log U(1, 16), dt_bias 0) on
x ~ N(0, 1); a released checkpoint's gates can be passed to `shares` (not done yet: no weights on this machine).
"""

from __future__ import annotations

import argparse

import torch


def shares(g: torch.Tensor, BT: int = 64) -> dict:
    """g: [T, H, K] log-decays (T a multiple of BT) -> fractions of (chunk, head) pairs per launch."""
    T, H, K = g.shape
    c = g.double().view(T // BT, BT, H, K)
    b = c.cumsum(1)

    def worst(block: int, mid: int) -> torch.Tensor:
        bb = b.view(T // BT, BT // block, block, H, K)
        return (bb - bb[:, :, mid:mid + 1]).abs().amax(dim=(1, 2, 4))  # [chunks, H]

    whole = worst(BT, BT // 2 - 1) <= 60.0
    diag = (worst(16, 7) <= 60.0) & ~whole
    n = whole.numel()
    return {"whole": whole.sum().item() / n, "diag_dot": diag.sum().item() / n,
            "exact": 1 - (whole.sum() + diag.sum()).item() / n, "pairs": n,
            "mean_g": g.double().mean().item(), "median_g": g.double().flatten().median().item()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2304, help="hidden size (Kimi Linear 48B: 2304)")
    ap.add_argument("--heads", type=int, default=32, help="KDA heads")
    ap.add_argument("--head-dim", type=int, default=128, help="head dim")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens (a multiple of 64)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the init and the input")
    args = ap.parse_args(argv)
    from hybridlm.layers.kda import KimiDeltaAttention

    torch.manual_seed(args.seed)
    layer = KimiDeltaAttention(args.hidden, args.heads, args.head_dim, impl="naive")
    with torch.no_grad():
        g = layer.forget_gate(torch.randn(1, args.tokens, args.hidden))[0]
    print({k: round(v, 4) if isinstance(v, float) else v for k, v in shares(g).items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
