"""CUDA smoke tests of the model paths the trainer and generate use (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch
from test_model import small_variants

from hybridlm import HybridLM

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def gpu_variants():
    """The CPU variants with head dims the Triton kernels support (64)."""
    out = {}
    for name, cfg in small_variants().items():
        d = cfg.to_dict()
        d.update(hidden_size=128, linear_key_head_dim=64, linear_value_head_dim=64, head_dim=32)
        out[name] = type(cfg).from_dict(d)
    return out


@pytest.mark.parametrize("name", list(small_variants()))
def test_cuda_bf16_forward_backward_packed_and_generate(name):
    import hybridlm.ops.triton  # noqa: F401  (registers the kernels impl="auto" picks on CUDA; must import on a GPU)

    cpu = HybridLM(gpu_variants()[name]).eval()
    gpu = HybridLM(gpu_variants()[name]).cuda().eval()
    gpu.load_state_dict(cpu.state_dict())
    x = torch.randint(0, 64, (1, 64))
    cu = torch.tensor([0, 20, 64], dtype=torch.int32)
    with torch.no_grad():
        ref = cpu(x, cu_seqlens=cu).logits
        out = gpu(x.cuda(), cu_seqlens=cu.cuda()).logits.cpu()
    assert (out - ref).abs().max() <= 2e-3
    model = gpu.to(torch.bfloat16).train()
    loss = model(x.cuda(), cu_seqlens=cu.cuda()).logits.float().logsumexp(-1).mean()
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    out = model.eval().generate(x[:, :10].cuda(), max_new_tokens=5)
    assert out.shape == (1, 15)
