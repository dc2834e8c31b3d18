"""Sweep launch knobs of the Triton GDN backward at B4 T4096 H16 D128 bf16 (one GPU run; prints a table).

    python scripts/gpu_tune_gdn.py
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
import triton.testing

from hybridlm.ops.triton import chunk_gated_delta_rule, gdn


def main() -> int:
    dev = "cuda"
    B, T, H, D = 4, 4096, 16, 128
    r = lambda *s: torch.randn(*s, device=dev)
    xs = [r(B, T, H, D).bfloat16() for _ in range(3)] + [F.logsigmoid(r(B, T, H) + 3.0),
                                                        torch.sigmoid(r(B, T, H)).bfloat16()]
    leaves = [x.clone().requires_grad_() for x in xs]
    do = r(B, T, H, D).bfloat16()

    def fb():
        o = chunk_gated_delta_rule(*leaves[:3], g=leaves[3], beta=leaves[4], use_qk_l2norm=True)[0]
        return torch.autograd.grad(o, leaves, do)

    rows = []
    for bt, warps, bv in itertools.product((32, 16), (4, 8), (16, 32, 64)):
        gdn._BT_OK.clear()
        gdn._BT_OK[(D, D, torch.bfloat16, "fwd")] = bt
        gdn._BT_OK[(D, D, torch.bfloat16, "bwd")] = bt
        gdn.TUNE.update(bwd_warps=warps, bwd_bv=bv)
        try:
            ms = triton.testing.do_bench(fb, warmup=5, rep=40, return_mode="median")
            with torch.no_grad():
                fw = triton.testing.do_bench(lambda: chunk_gated_delta_rule(*xs[:3], g=xs[3], beta=xs[4],
                                                                            use_qk_l2norm=True),
                                             warmup=5, rep=40, return_mode="median")
        except Exception as e:  # noqa: BLE001
            ms, fw = float("nan"), float("nan")
            print(f"BT{bt} warps{warps} bv{bv}: {e!r}"[:200], flush=True)
        used = dict(gdn._BT_OK)
        rows.append((bt, warps, bv, fw, ms, used))
        print(f"BT{bt} warps{warps} bwd_BV{bv}: fwd {fw:.3f} ms, fwd+bwd {ms:.3f} ms, BT used {used}", flush=True)
    print("\n| BT | bwd warps | bwd BV | fwd ms | fwd+bwd ms |\n|---|---|---|---|---|")
    for bt, w, bv, fw, ms, _ in rows:
        print(f"| {bt} | {w} | {bv} | {fw:.3f} | {ms:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
