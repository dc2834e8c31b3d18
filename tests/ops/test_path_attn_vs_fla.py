"""Our PaTH attention (impl="chunk", float32 compute on CUDA) and fla's `parallel_path_attn`, both against our
float64 token-by-token reference on the same inputs: B 2 x T 300 and packed varlen, 4 heads, K = V = 64, float32
and bfloat16 q / k / v, the forget gate on. Prints one line per tensor and implementation,
`PARITY path_attention <dtype> <case> <ours|fla> <tensor> err=<max abs err / max |fp64|> bar=...`.

Asserted: ours (output and every gradient) within TOL; fla's output within FLA_TOL, which checks the mapping of
g and scale onto fla's definition (a wrong mapping is off by O(1): the forget gate sums to ~-15 over 300 tokens).
fla's gradients are printed, not judged. An fla exception fails the test, except the known limitations in LIMITS.

Where the definitions differ and how the inputs are mapped:
- forget gate: fla scales it with the dot product, softmax((q^T P k + G_i - G_j) * scale); ours adds it after the
  scale (FoX's convention), softmax(scale * q^T P k + G_i - G_j). fla gets g / scale, and its dg is scaled back.
- fla wants w, beta and g in float32 and a head dim in {16, 32, 64}; both ops use w as given (unit norm here).
GPU only: skipped without CUDA or without fla.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fla_check import Limit, check, run_fla
from float64_check import outputs_and_grads

from hybridlm.ops import path_attention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
fla_path = pytest.importorskip("fla.ops.path_attn")

B, T, H, K, V = 2, 300, 4, 64, 64
CU = [0, 77, 300, 301, 600]  # varlen: one row of 600 tokens, lengths 77, 223, 1, 299
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # ours: max abs error / max |reference|
# fla's output: its float32 path runs its matmuls in tf32 (~1e-3 relative), its bfloat16 path rounds the
# intermediate q / k transforms to bfloat16 (~4e-3 each); bars ~5x above that until measured errors are in
FLA_TOL = {torch.float32: 1e-2, torch.bfloat16: 5e-2}
LIMITS = {torch.float32: [Limit("OutOfResources", "shared memory",
                                "fla's PaTH kernels in float32 need more shared memory than one SM has")],
          torch.bfloat16: []}


def inputs(b: int, t: int, dtype: torch.dtype, gen: torch.Generator) -> dict[str, torch.Tensor]:
    r = lambda *s: torch.randn(*s, generator=gen, device="cuda")  # noqa: E731
    return dict(q=r(b, t, H, K).to(dtype), k=r(b, t, H, K).to(dtype), v=r(b, t, H, V).to(dtype),
                w=F.normalize(r(b, t, H, K), dim=-1), beta=2 * torch.rand(b, t, H, generator=gen, device="cuda"),
                g=F.logsigmoid(3 + r(b, t, H)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("varlen", [False, True], ids=["plain", "varlen"])
def test_path_attention_vs_fla(dtype, varlen, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = inputs(1, CU[-1], dtype, gen) if varlen else inputs(B, T, dtype, gen)
    cu = torch.tensor(CU, device="cuda", dtype=torch.int32) if varlen else None
    do = torch.randn(x["v"].shape, generator=gen, device="cuda")
    scale = K**-0.5

    def ours(q, k, v, w, beta, g, impl="chunk"):
        return path_attention(q, k, v, w, g=g, beta=beta, cu_seqlens=cu, impl=impl)

    def fla(q, k, v, w, beta, g):
        return fla_path.parallel_path_attn(q, k, v, w, beta, g / scale, scale=scale,
                                           cu_seqlens=None if cu is None else cu.long())[0]

    ref = outputs_and_grads(lambda **a: ours(**a, impl="naive"), {n: t.double() for n, t in x.items()},
                            do.double())
    mine = outputs_and_grads(ours, x, do)
    tag = f"path_attention {str(dtype)[6:]} {'varlen' if varlen else 'plain'}"
    bad = []
    for name, want in ref.items():
        check(f"{tag} ours", name, mine[name], want, TOL[dtype], bad)
    assert not bad, f"seed {seed}: ours over {TOL[dtype]} x max |fp64|: {bad}"
    theirs = run_fla(lambda: outputs_and_grads(fla, x, do), LIMITS[dtype])
    for name, want in ref.items():
        check(f"{tag} fla", name, theirs[name], want, FLA_TOL[dtype] if name == "o" else float("inf"), bad)
    assert not bad, f"seed {seed}: fla's output over {FLA_TOL[dtype]} x max |fp64|: {bad}"
