"""Callers' inputs for the Triton kernels through the public ops (impl="triton"), in a child process under
TRITON_INTERPRET=1 (CPU): inference tensors with int32 / int64 cu_seqlens, int64 cu_seqlens with gradients, q and k
in float32 beside float16 v, and a 16-bit initial_state beside float32 inputs.

Run by tests/ops/test_caller_inputs.py. Small shapes (T 31, K = V = 16: the kernels run zero-padded to 64), a few
seconds of kernels, ~30 s of interpreter on two cores. Prints one line "RESULT {json}": {case: {"tol": "fp32" or
"fp16", "dtypes_ok": 1.0 or 0.0, tensor: relative error against the float64 token loop on the same rounded
values}}; a gradient left in a 16-bit dtype is named "<name>@<dtype>" (its bar is that dtype's rounding).
Seed: HYBRIDLM_INTERP_SEED, printed.
"""

from __future__ import annotations

import itertools
import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from interp_patches import patch_interpreter  # noqa: E402

patch_interpreter()

import torch  # noqa: E402

from hybridlm.ops import gated_delta_rule, kda  # noqa: E402
from hybridlm.ops.triton import gdn as _gdn  # noqa: E402

_gdn.POISON = True  # kernel outputs start as NaN: an element a kernel forgets to write fails the comparison
F64 = torch.float64
OPS = {"gdn": gated_delta_rule, "kda": kda}
LENS = [5, 17, 9]


def rel(a, b):
    a, b = a.to(F64), b.to(F64)
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def draw(op, gen, H=1, HV=2, K=16, V=16):
    T, N = sum(LENS), len(LENS)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=F64)  # noqa: E731
    g = -1.5 * torch.rand(1, T, HV, *((K,) if op == "kda" else ()), generator=gen, dtype=F64)
    return dict(q=r(1, T, H, K), k=r(1, T, H, K), v=r(1, T, HV, V), g=g,
                beta=torch.rand(1, T, HV, generator=gen, dtype=F64), h0=r(N, HV, K, V))


def call(op, x, **kw):
    return OPS[op](x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], initial_state=x["h0"], use_qk_l2norm=True,
                   output_final_state=True, **kw)


def reference(op, x, cot):
    """The float64 token loop per sequence on x's values: {"o", "final_state", "d<name>"}."""
    leaves = {n: t.detach().double().requires_grad_() for n, t in x.items()}
    outs, states = [], []
    for n, (s, e) in enumerate(itertools.pairwise([0, *itertools.accumulate(LENS)])):
        part = {name: (t[n : n + 1] if name == "h0" else t[:, s:e]) for name, t in leaves.items()}
        o, h = call(op, part, impl="naive")
        outs.append(o)
        states.append(h)
    o, h = torch.cat(outs, dim=1), torch.cat(states, dim=0)
    grads = torch.autograd.grad((o * cot[0]).sum() + (h * cot[1]).sum(), list(leaves.values()))
    return {"o": o, "final_state": h, **{"d" + n: d for n, d in zip(leaves, grads)}}


def cu_of(dtype):
    return torch.tensor([0, *itertools.accumulate(LENS)], dtype=dtype)


def inference_case(op, gen, idx_dtype):
    """Every tensor made under inference_mode and the op run there; no gradients."""
    x = draw(op, gen)
    with torch.inference_mode():
        xi = {n: t.float() for n, t in x.items()}
        o, h = call(op, xi, cu_seqlens=cu_of(idx_dtype), impl="triton")
    ref = reference(op, {n: t.float() for n, t in x.items()}, (torch.zeros(o.shape, dtype=F64),
                                                                  torch.zeros(h.shape, dtype=F64)))
    ok = o.is_inference() and o.dtype == torch.float32 and h.dtype == torch.float32
    return {"tol": "fp32", "dtypes_ok": float(ok), "o": rel(o, ref["o"]), "final_state": rel(h, ref["final_state"])}


def grad_case(op, gen, dtypes: dict, tol: str, idx_dtype=torch.int64):
    """Inputs in `dtypes` (name -> dtype, float32 when absent), gradients of random cotangents on o and the final
    state against the float64 loop on q, k rounded to v's dtype (the ops' rule) and everything else as given."""
    x = draw(op, gen)
    leaves = {n: t.to(dtypes.get(n, torch.float32)).requires_grad_() for n, t in x.items()}
    o, h = call(op, leaves, cu_seqlens=cu_of(idx_dtype), impl="triton")
    cot = (torch.randn(o.shape, generator=gen, dtype=F64), torch.randn(h.shape, generator=gen, dtype=F64))
    grads = torch.autograd.grad((o.double() * cot[0]).sum() + (h.double() * cot[1]).sum(), list(leaves.values()))
    vd = leaves["v"].dtype
    rounded = {n: (t.to(vd) if n in ("q", "k") else t) for n, t in leaves.items()}
    ref = reference(op, rounded, cot)
    ok = o.dtype == vd and h.dtype == torch.float32 and all(d.dtype == t.dtype for d, t in
                                                             zip(grads, leaves.values()))
    out = {"tol": tol, "dtypes_ok": float(ok), "o": rel(o, ref["o"]), "final_state": rel(h, ref["final_state"])}
    for (n, t), d in zip(leaves.items(), grads):
        narrow = t.dtype in (torch.float16, torch.bfloat16) and tol == "fp32"
        out[f"d{n}@{str(t.dtype)[6:]}" if narrow else "d" + n] = rel(d, ref["d" + n])
    return out


def main() -> int:
    seed = int(os.environ.get("HYBRIDLM_INTERP_SEED") or torch.seed() % 2**31)
    print(f"seed {seed}", flush=True)
    gen = torch.Generator().manual_seed(seed)
    half = dict(v=torch.float16, beta=torch.float16)  # q, k (and g) float32, as fla's tests pass them
    res = {
        "seed": seed,
        "gdn_inference_int64": inference_case("gdn", gen, torch.int64),
        "kda_inference_int32": inference_case("kda", gen, torch.int32),
        "gdn_int64_grads": grad_case("gdn", gen, {}, "fp32"),
        "gdn_qk_fp32_v_fp16": grad_case("gdn", gen, half, "fp16", torch.int32),
        "kda_qk_fp32_v_fp16_int64": grad_case("kda", gen, half, "fp16", torch.int64),
        "gdn_h0_bf16": grad_case("gdn", gen, dict(h0=torch.bfloat16), "fp32"),
        "kda_h0_fp16": grad_case("kda", gen, dict(h0=torch.float16), "fp32"),
    }
    print("RESULT " + json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
