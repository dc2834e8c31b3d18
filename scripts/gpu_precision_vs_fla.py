"""Accuracy of our GDN kernels and fla-core's against the float64 reference, on gates that stress the decay
exponents: the precision table of BENCHMARKS.md. Run it after a change to how the kernels form decay exponents or
sum dg, or to compare a new fla-core release.

    python scripts/gpu_precision_vs_fla.py [--T 1000] [--json PATH]

Gates (log-decays g per step and value head): "usual" logsigmoid(N(3, 1)); "decay30" uniform in [-30, 0); "cliff":
in every chunk of 64 steps, 32 of [-30, 0) then 32 of [-0.05, 0), so the later rows' decay exponents are small
differences of a cumulative sum near -500 (a kernel that forms e^{b_i - b_j} from two fp32 running sums loses
|b| * 6e-8 of each exponent there). Inputs: B2, T (1000), H4, K=V=128, beta in (0, 1) (fla's default domain),
in-kernel q/k l2 norm, an initial state; fp32 and bf16. Errors are relative RMS against our float64 chunk path on
the same rounded inputs, for o, the final state and the gradients of q, k, v, g, beta. fla-core 0.6.0 refuses its
gated backward on Hopper with Triton < 3.7.1 (fla-org/flash-linear-attention#640); the guard is lifted here, as in
`hybridlm bench kernels`. TF32 is off for PyTorch matmuls; each kernel's own dot precision is its own (ours: IEEE
fp32 dots for fp32 inputs). Outputs of our kernels start as NaN, so an unwritten element shows.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from hybridlm.ops import gated_delta_rule
from hybridlm.ops.triton import gdn as _gdn

_gdn.POISON = True  # outputs start as NaN: an unwritten element shows as an error
F64 = torch.float64
NAMES = ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative RMS error of a against the reference b (inf when a holds a non-finite value)."""
    a, b = a.to(F64), b.to(F64)
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def cliff_bounds(T: int, device: str) -> torch.Tensor:
    """[T, 1] bounds of the "cliff" gates: 30 for the first 32 steps of every chunk of 64, then 0.05."""
    return torch.where(torch.arange(T, device=device) % 64 < 32, 30.0, 0.05)[:, None]


def make_gates(kind: str, B: int, T: int, HV: int, gen: torch.Generator) -> torch.Tensor:
    """g [B, T, HV] fp32 log-decays of the named kind (module docstring)."""
    dev = "cuda"
    if kind == "usual":
        return torch.nn.functional.logsigmoid(torch.randn(B, T, HV, device=dev, generator=gen) + 3.0)
    if kind == "decay30":
        bound = torch.full((T, 1), 30.0, device=dev)
    elif kind == "cliff":
        bound = cliff_bounds(T, dev)
    else:
        raise ValueError(f"gates: expected usual, decay30 or cliff, got {kind!r}")
    return -bound * torch.rand(B, T, HV, device=dev, generator=gen)


def run(fn, xs: list[torch.Tensor], do: torch.Tensor, dht: torch.Tensor) -> dict[str, torch.Tensor]:
    """o, final state and the gradients of q, k, v, g, beta of fn(q, k, v, g, beta, h0)."""
    leaf = [x.detach().clone().requires_grad_(i < 5) for i, x in enumerate(xs)]
    o, ht = fn(*leaf)
    loss = (o.to(F64) * do.to(F64)).sum() + (ht.to(F64) * dht.to(F64)).sum()
    grads = torch.autograd.grad(loss, leaf[:5])
    return dict(zip(NAMES, [o.detach(), ht.detach(), *grads]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", type=int, default=1000, help="sequence length (default 1000)")
    ap.add_argument("--json", default=None, help="also write every error to this JSON file")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    import fla.ops.common.chunk_o as fla_chunk_o
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

    fla_chunk_o.TRITON_ABOVE_3_7_1 = True  # lift fla 0.6.0's Hopper guard on its gated backward
    seed = torch.seed() % 2**31
    gen = torch.Generator(device="cuda").manual_seed(seed)
    B, T, H, D = 2, args.T, 4, 128
    print(f"seed {seed}; {torch.cuda.get_device_name()}; torch {torch.__version__}; B{B} T{T} H{H} D{D}")

    def ours(q, k, v, g, beta, h0):
        return gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True,
                                use_qk_l2norm=True, impl="triton")

    def fla(q, k, v, g, beta, h0):
        return fla_chunk(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True,
                         use_qk_l2norm_in_kernel=True)

    def reference(q, k, v, g, beta, h0):
        return gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True,
                                use_qk_l2norm=True, impl="chunk")

    rows = []
    header = "| gates | dtype | kernel | " + " | ".join(NAMES) + " |"
    print(header + "\n" + "|---" * (3 + len(NAMES)) + "|", flush=True)
    # dtype outermost: fla autotunes its kernels once per dtype (minutes each), so every fp32 row comes first
    for dtype in (torch.float32, torch.bfloat16):
        for kind in ("usual", "decay30", "cliff"):
            r = lambda *s: torch.randn(*s, device="cuda", generator=gen)
            q, k, v = (r(B, T, H, D).to(dtype) for _ in range(3))
            beta = torch.rand(B, T, H, device="cuda", generator=gen).to(dtype)
            xs = [q, k, v, make_gates(kind, B, T, H, gen), beta, r(B, H, D, D)]
            do, dht = r(B, T, H, D), r(B, H, D, D)
            ref = run(reference, [x.to(F64) for x in xs], do, dht)
            for name, fn in (("ours", ours), ("fla", fla)):
                try:
                    got = run(fn, xs, do, dht)
                    errs = {n: rel(got[n], ref[n]) for n in NAMES}
                except Exception as e:  # noqa: BLE001 - a failing kernel is a row of the table, not the end of it
                    errs = {n: float("nan") for n in NAMES}
                    print(f"{name} {kind} {dtype}: {e!r}", file=sys.stderr)
                row = {"gates": kind, "dtype": str(dtype).replace("torch.", ""), "kernel": name, **errs}
                rows.append(row)
                # each row as it ends: fla autotunes every kernel per dtype first, which can outlast a time limit
                print(f"| {kind} | {row['dtype']} | {name} | " + " | ".join(f"{errs[n]:.2e}" for n in NAMES) + " |",
                      flush=True)
                if args.json:
                    from hybridlm.files import atomic_write_text

                    atomic_write_text(args.json, json.dumps({"seed": seed, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
