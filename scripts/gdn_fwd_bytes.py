"""The memory-traffic floor of our chunked Gated DeltaNet training forward, launch by launch, against issue 5's
forward target (>= 2x fla-core's GPU time). Arithmetic only (no GPU): every buffer each launch must read from or
write to HBM at least once, at its storage dtype, summed; divided by a copy bandwidth it is the least time the
launch plan can take, whatever happens inside the kernels (L2 reuse of a buffer read by several programs is
assumed perfect, so the floor is optimistic).

The plan is the one `gdn._fwd_impl` runs with the default `gdn.TUNE` (prep_kkt, fwd_raw_out, state_raw_k,
fwd_split_o; 16-bit storage for 16-bit inputs):

    1 `_kkt_solve`        k, g, beta                   -> T [chunks, HV, BT, BT]
    2 prep stage 3 (W/U)  T, k, v, g, beta             -> W, U [tokens, HV, K|V], key scales s_k, inverse norms rk
    3 `_recur_fwd` (SK)   W, U, k, g, s_k              -> chunk states h [chunks, HV, K, V], Vn [tokens, HV, V]
    4 `_out_fwd_raw`      q, k, g, rk, h, Vn           -> o, P [chunks, HV, BT, BT] (kept for the backward)

    python scripts/gdn_fwd_bytes.py [--copy-gbs 3016] [--fla-us 600,2529,1248]

Defaults: the copy bandwidth and fla-core 0.6.0's summed forward GPU times measured on the H100 in the run of
2026-11-25 00:52 UTC (BENCHMARKS.md), at B4 T4096 H16, B1 T32768 H32, B8 T2048 H32 (K = V = 128, bf16).
"""

from __future__ import annotations

import argparse
import math

SHAPES = ((4, 4096, 16), (1, 32768, 32), (8, 2048, 32))


def launch_bytes(B: int, T: int, H: int, HV: int, K: int = 128, V: int = 128, BT: int = 64, s: int = 2,
                 gf: int = 4) -> dict[str, tuple[int, int]]:
    """{launch: (bytes read, bytes written)} of the default training forward; s: the input / storage itemsize,
    gf: g's itemsize (fp32 log-decays), s_k and rk are fp32."""
    tok, nc = B * T, B * math.ceil(T / BT)
    q = k = tok * H * K * s
    v = o = vn = U = tok * HV * V * s
    W = tok * HV * K * s
    g, beta, row32 = tok * HV * gf, tok * HV * s, tok * HV * 4
    Tb = P = nc * HV * BT * BT * s
    h = nc * HV * K * V * s
    return {
        "_kkt_solve": (k + g + beta, Tb),
        "prep stage 3 (W/U)": (Tb + k + v + g + beta, W + U + 2 * row32),
        "_recur_fwd": (W + U + k + g + row32, h + vn),
        "_out_fwd_raw": (q + k + g + row32 + h + vn, o + P),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--copy-gbs", type=float, default=3016.0, help="device copy bandwidth in GB/s (1e9 bytes)")
    ap.add_argument("--fla-us", default="600,2529,1248",
                    help="fla-core's forward GPU time in us at the three shapes, comma-separated")
    args = ap.parse_args(argv)
    fla = [float(x) for x in args.fla_us.split(",")]
    if len(fla) != len(SHAPES):
        raise SystemExit(f"--fla-us: expected {len(SHAPES)} comma-separated times, got {args.fla_us!r}")
    print(f"copy bandwidth {args.copy_gbs:.0f} GB/s; K = V = 128, bf16 storage, chunk 64")
    print("| shape | launch | MB read | MB written | floor us |")
    print("|---|---|---|---|---|")
    rows = []
    for (B, T, H), t_fla in zip(SHAPES, fla):
        per = launch_bytes(B, T, H, H)
        total = 0
        for name, (r, w) in per.items():
            total += r + w
            print(f"| B{B} T{T} H{H} | {name} | {r / 1e6:.0f} | {w / 1e6:.0f} | {(r + w) / args.copy_gbs / 1e3:.0f} |")
        floor = total / args.copy_gbs / 1e3
        rows.append((B, T, H, total, floor, t_fla))
    print()
    print("| shape | plan's bytes MB | KB per chunk and head | floor us | fla us | target us (fla / 2) "
          "| best fla/ours |")
    print("|---|---|---|---|---|---|---|")
    for B, T, H, total, floor, t_fla in rows:
        pairs = B * math.ceil(T / 64) * H
        print(f"| B{B} T{T} H{H} | {total / 1e6:.0f} | {total / pairs / 1024:.1f} | {floor:.0f} | {t_fla:.0f} | "
              f"{t_fla / 2:.0f} | {t_fla / floor:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
