"""Our DeltaFormer attention (impl="chunk", float32 compute on CUDA) and fla's, both against our float64
token-by-token reference on the same inputs: B 2 x T 300 and packed varlen, 4 heads, K = V = 64, float32 and
bfloat16. Prints one line per tensor and implementation,
`PARITY deltaformer <dtype> <case> <ours|fla> <tensor> err=<max abs err / max |fp64|> bar=...`.

Asserted: ours (output and every gradient) within TOL; fla's output within FLA_TOL (a different definition, a
wrong scale or a beta read from the wrong token is off by O(1)). fla's gradients are printed, not judged. An fla
exception fails the test (no known limitation is named for this op).

Definitions: the same as fla's (its naive and its kernels): the write softmax over j < i and the read softmax over
j <= i of the same scores scale * q_i.k_j, scale K ** -0.5, beta as given. fla's op runs its own kernel for u
(`ParallelDeltaformerFunction`, the DeltaFormer-specific part, called here with q as the write's query) and then
FlashAttention over u, which takes only fp16 / bf16; here fla's u goes through causal SDPA in the input dtype
instead (per sequence for varlen), so that float32 is compared too and flash-attn is not needed. fla takes beta in
the dtype of k.
GPU only: skipped without CUDA or without fla.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fla_check import check, run_fla
from float64_check import outputs_and_grads

from hybridlm.ops import deltaformer_attention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
fla_deltaformer = pytest.importorskip("fla.ops.deltaformer.parallel")

B, T, H, K, V = 2, 300, 4, 64, 64
CU = [0, 77, 300, 301, 600]
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # ours: max abs error / max |reference|
# fla's output: its kernels run float32 matmuls in tf32 (~1e-3 relative) and keep u in the input dtype (bfloat16:
# ~4e-3 a step, through the recursion); bars ~5x above that until measured errors are in
FLA_TOL = {torch.float32: 1e-2, torch.bfloat16: 5e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("varlen", [False, True], ids=["plain", "varlen"])
def test_deltaformer_vs_fla(dtype, varlen, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    b, t = (1, CU[-1]) if varlen else (B, T)
    r = lambda *s: torch.randn(*s, generator=gen, device="cuda").to(dtype)  # noqa: E731
    x = dict(q=r(b, t, H, K), k=r(b, t, H, K), v=r(b, t, H, V),
             beta=torch.rand(b, t, H, generator=gen, device="cuda").to(dtype))
    cu = torch.tensor(CU, device="cuda", dtype=torch.int32) if varlen else None
    bounds = CU if varlen else [0, t]
    do = torch.randn(x["v"].shape, generator=gen, device="cuda")

    def ours(q, k, v, beta, impl="chunk"):
        return deltaformer_attention(q, k, v, beta=beta, cu_seqlens=cu, impl=impl)

    def fla(q, k, v, beta):
        u = fla_deltaformer.ParallelDeltaformerFunction.apply(q, k, v, beta, 512, None if cu is None else cu.long())
        qt, kt, ut = (z.transpose(1, 2) for z in (q, k, u))
        o = torch.cat([F.scaled_dot_product_attention(qt[:, :, s:e], kt[:, :, s:e], ut[:, :, s:e], is_causal=True)
                       for s, e in zip(bounds[:-1], bounds[1:])], dim=2)
        return o.transpose(1, 2)

    ref = outputs_and_grads(lambda **a: ours(**a, impl="naive"), {n: z.double() for n, z in x.items()},
                            do.double())
    mine = outputs_and_grads(ours, x, do)
    tag = f"deltaformer {str(dtype)[6:]} {'varlen' if varlen else 'plain'}"
    bad = []
    for name, want in ref.items():
        check(f"{tag} ours", name, mine[name], want, TOL[dtype], bad)
    assert not bad, f"seed {seed}: ours over {TOL[dtype]} x max |fp64|: {bad}"
    theirs = run_fla(lambda: outputs_and_grads(fla, x, do))
    for name, want in ref.items():
        check(f"{tag} fla", name, theirs[name], want, FLA_TOL[dtype] if name == "o" else float("inf"), bad)
    assert not bad, f"seed {seed}: fla's output over {FLA_TOL[dtype]} x max |fp64|: {bad}"
