"""Our PaTH attention (impl="chunk", float32 compute on CUDA) against fla's `parallel_path_attn`, both measured
against our float64 token-by-token reference on the same inputs: B 2 x T 300 and packed varlen, 4 heads, K = V = 64,
float32 and bfloat16 q / k / v, the forget gate on. Prints one line per tensor,
`PARITY path_attention <dtype> <case> <tensor> ours=<max abs err vs fp64> fla=<max abs err vs fp64>`, and asserts
ours is within a tight tolerance of float64 (fla's numbers are reported: its kernels round w to fp16).

Where the definitions differ and how the inputs are mapped:
- forget gate: fla scales it with the dot product, softmax((q^T P k + G_i - G_j) * scale); ours adds it after the
  scale (FoX's convention), softmax(scale * q^T P k + G_i - G_j). fla gets g / scale, and its dg is scaled back.
- fla wants w, beta and g in float32 and a head dim in {16, 32, 64, 128}; both ops use w as given (unit norm here).
GPU only: skipped without CUDA or without fla.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from float64_check import outputs_and_grads

from hybridlm.ops import path_attention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

B, T, H, K, V = 2, 300, 4, 64, 64
CU = [0, 77, 300, 301, 600]  # varlen: one row of 600 tokens, lengths 77, 223, 1, 299
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # max abs error / max |reference|


def inputs(b: int, t: int, dtype: torch.dtype, gen: torch.Generator) -> dict[str, torch.Tensor]:
    r = lambda *s: torch.randn(*s, generator=gen, device="cuda")  # noqa: E731
    return dict(q=r(b, t, H, K).to(dtype), k=r(b, t, H, K).to(dtype), v=r(b, t, H, V).to(dtype),
                w=F.normalize(r(b, t, H, K), dim=-1), beta=2 * torch.rand(b, t, H, generator=gen, device="cuda"),
                g=F.logsigmoid(3 + r(b, t, H)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("varlen", [False, True], ids=["plain", "varlen"])
def test_path_attention_vs_fla(dtype, varlen):
    from fla.ops.path_attn import parallel_path_attn

    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    x = inputs(1, CU[-1], dtype, gen) if varlen else inputs(B, T, dtype, gen)
    cu = torch.tensor(CU, device="cuda", dtype=torch.int32) if varlen else None
    do = torch.randn(x["v"].shape, generator=gen, device="cuda")
    scale = K**-0.5

    def ours(q, k, v, w, beta, g, impl="chunk"):
        return path_attention(q, k, v, w, g=g, beta=beta, cu_seqlens=cu, impl=impl)

    def fla(q, k, v, w, beta, g):
        return parallel_path_attn(q, k, v, w, beta, g / scale, scale=scale,
                                  cu_seqlens=None if cu is None else cu.long())[0]

    ref = outputs_and_grads(lambda **a: ours(**a, impl="naive"), {n: t.double() for n, t in x.items()},
                            do.double())
    mine = outputs_and_grads(ours, x, do)
    try:
        theirs = outputs_and_grads(fla, x, do)
    except Exception as e:  # noqa: BLE001 (fla's limits are reported, ours is still checked)
        theirs, why = {}, f"{type(e).__name__}: {e}".splitlines()[0][:80]
    for name, want in ref.items():
        e_ours = (mine[name].double() - want).abs().max().item()
        e_fla = f"{(theirs[name].double() - want).abs().max().item():.3e}" if theirs else f"error({why})"
        print(f"PARITY path_attention {str(dtype)[6:]} {'varlen' if varlen else 'plain'} {name} ours={e_ours:.3e} "
              f"fla={e_fla}")
        assert e_ours <= TOL[dtype] * want.abs().max().item(), (name, e_ours)
