"""One MQAR cell at the paper setting (512 tokens, 64 pairs, batch 128, width 64), eager and with CUDA graphs:
ms per step, setup seconds and the loss curve of each, so a short GPU call shows whether capture works and pays.

    python scripts/mqar_graph_probe.py [--mixer gdn] [--steps 100]
"""

from __future__ import annotations

import argparse

import torch

from hybridlm.bench.mqar import Cell, Setting, TrainConfig, train_cell


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mixer", default="gdn", help="token mixer of the cell")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps per run")
    args = p.parse_args()
    cell = Cell(args.mixer, 64, Setting(512, 64, 4096), 3e-3)
    for graphs in (False, True):
        cfg = TrainConfig(steps=args.steps, batch_size=128, test_examples=128, mixed_pairs=True, qk_norm="recipe",
                          cuda_graphs=graphs)
        r = train_cell(cell, cfg, seed=0, device=torch.device("cuda"))
        print(f"{args.mixer} cuda_graphs={graphs}: {r['ms_per_step']} ms/step, setup {r['setup_seconds']} s, "
              f"losses {r['loss_every_50']}", flush=True)


if __name__ == "__main__":
    main()
