"""Our DeltaFormer attention (impl="chunk", float32 compute on CUDA) against fla's, both measured against our
float64 token-by-token reference on the same inputs: B 2 x T 300 and packed varlen, 4 heads, K = V = 64, float32
and bfloat16. Prints one line per tensor,
`PARITY deltaformer <dtype> <case> <tensor> ours=<max abs err vs fp64> fla=<max abs err vs fp64>`, and asserts ours
is within a tight tolerance of float64 (fla's numbers are reported, not asserted).

Definitions: the same as fla's (its naive and its kernels): the write softmax over j < i and the read softmax over
j <= i of the same scores scale * q_i.k_j, scale K ** -0.5, beta as given. fla's op runs its own kernel for u
(`ParallelDeltaformerFunction`, the DeltaFormer-specific part) and then FlashAttention over u, which takes only
fp16 / bf16; here fla's u goes through causal SDPA in the input dtype instead (per sequence for varlen), so that
float32 is compared too and flash-attn is not needed. fla takes beta in the dtype of k.
GPU only: skipped without CUDA or without fla.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from float64_check import outputs_and_grads

from hybridlm.ops import deltaformer_attention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

B, T, H, K, V = 2, 300, 4, 64, 64
CU = [0, 77, 300, 301, 600]
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # max abs error / max |reference|


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("varlen", [False, True], ids=["plain", "varlen"])
def test_deltaformer_vs_fla(dtype, varlen):
    from fla.ops.deltaformer.parallel import ParallelDeltaformerFunction

    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31 - 1, ())))
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
        u = ParallelDeltaformerFunction.apply(q, k, v, beta, 512, None if cu is None else cu.long())
        qt, kt, ut = (z.transpose(1, 2) for z in (q, k, u))
        o = torch.cat([F.scaled_dot_product_attention(qt[:, :, s:e], kt[:, :, s:e], ut[:, :, s:e], is_causal=True)
                       for s, e in zip(bounds[:-1], bounds[1:])], dim=2)
        return o.transpose(1, 2)

    ref = outputs_and_grads(lambda **a: ours(**a, impl="naive"), {n: z.double() for n, z in x.items()},
                            do.double())
    mine = outputs_and_grads(ours, x, do)
    try:
        theirs = outputs_and_grads(fla, x, do)
    except Exception as e:  # noqa: BLE001 (fla's limits are reported, ours is still checked)
        theirs, why = {}, f"{type(e).__name__}: {e}".splitlines()[0][:80]
    for name, want in ref.items():
        e_ours = (mine[name].double() - want).abs().max().item()
        e_fla = f"{(theirs[name].double() - want).abs().max().item():.3e}" if theirs else f"error({why})"
        print(f"PARITY deltaformer {str(dtype)[6:]} {'varlen' if varlen else 'plain'} {name} ours={e_ours:.3e} "
              f"fla={e_fla}")
        assert e_ours <= TOL[dtype] * want.abs().max().item(), (name, e_ours)
