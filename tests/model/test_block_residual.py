"""The blocks hand their last branch on to the next norm (`BlockOutput`, `RMSNorm(x, branch)`): the model computes
what the plain composition computed, x = x + mix(norm1(x)); x = x + mlp(norm2(x)) (OLMo attention blocks:
x = x + norm1(mix(x)); x = x + norm2(mlp(x))), final norm, lm head. Written out here by hand from the model's own
modules and compared bit for bit: logits, every block's output hidden state, every parameter gradient; in float32,
float64 and float32 under CPU bf16 autocast (the training path: float32 residual, bf16 branches); with activation
checkpointing too. On the CPU the norms run PyTorch (the fused kernel is checked in tests/ops/test_add_rms_norm.py).
"""

from __future__ import annotations

import pytest
import torch
from test_model import small_variants

from hybridlm import HybridLM
from hybridlm.layers import positions_for
from hybridlm.model.hybrid import BlockOutput


def old_forward(model: HybridLM, ids: torch.Tensor, record: list) -> torch.Tensor:
    """Logits of the plain composition (no mask, no cache), each block's output appended to record."""
    x = model.embed_tokens(ids)
    pos = positions_for(ids.shape[1], None, x.device)
    for blk in model.layers:
        if blk.linear:
            mix = lambda h, blk=blk: blk.mixer(h, attention_mask=None, cu_seqlens=None, cache=None)  # noqa: E731
        else:
            mix = lambda h, blk=blk: blk.mixer(h, None, pos, cache=None)  # noqa: E731
        if blk.post_norm:
            x = x + blk.norm1(mix(x))
            x = x + blk.norm2(blk.mlp(x))
        else:
            x = x + mix(blk.norm1(x))
            x = x + blk.mlp(blk.norm2(x))
        record.append(x.detach().clone())
    return model.lm_head(model.norm(x))


def run(model: HybridLM, ids: torch.Tensor, mode: str, new: bool):
    """(logits, block outputs, parameter gradients) of one forward + backward."""
    model.zero_grad(set_to_none=True)
    record: list = []
    hook = lambda _m, _a, out: record.append(out.hidden_state.detach().clone())  # noqa: E731
    handles = [blk.register_forward_hook(hook) for blk in model.layers] if new else []
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
        logits = model(ids).logits if new else old_forward(model, ids, record)
    for h in handles:
        h.remove()
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids.roll(-1, 1).flatten())
    loss.backward()
    return logits.detach(), record, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def perturbed(name: str, mode: str) -> HybridLM:
    model = HybridLM(small_variants()[name])
    with torch.no_grad():  # norms away from their initial weights, so that a mixed-up norm shows
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.2 * torch.randn_like(p))
    return model.double() if mode == "float64" else model


@pytest.mark.parametrize("mode", ["float32", "float64", "autocast"])
@pytest.mark.parametrize("name", list(small_variants()))
def test_fused_residual_equals_plain_adds(name, mode, seed):
    model = perturbed(name, mode)
    ids = torch.randint(0, 64, (2, 13))
    old, new = run(model, ids, mode, new=False), run(model, ids, mode, new=True)
    assert torch.equal(old[0], new[0]), f"logits differ (seed {seed})"
    assert len(new[1]) == len(old[1]) == model.config.num_hidden_layers
    for i, (a, b) in enumerate(zip(old[1], new[1])):
        assert torch.equal(a, b), f"block {i} output differs (seed {seed})"
    assert old[2].keys() == new[2].keys()
    for n in old[2]:
        assert torch.equal(old[2][n], new[2][n]), f"grad {n} differs (seed {seed})"


def test_fused_residual_under_activation_checkpointing(seed):
    """Each block recomputed in the backward (hybridlm.train.parallel): the same gradients bit for bit."""
    from hybridlm.train.parallel import apply_activation_checkpointing

    model = perturbed("gdn_olmo", "float32")
    ids = torch.randint(0, 64, (2, 13))
    plain = run(model, ids, "autocast", new=True)
    apply_activation_checkpointing(model)
    ckpt = run(model, ids, "autocast", new=True)
    assert torch.equal(plain[0], ckpt[0])
    assert all(torch.equal(plain[2][n], ckpt[2][n]) for n in plain[2]), f"seed {seed}"


def test_block_output_types_under_autocast():
    """A pre-norm block returns its float32 residual and its MLP's bf16 output, not yet added; the first block
    takes no branch."""
    model = HybridLM(small_variants()["gdn_split_headwise"])
    x = torch.randn(1, 5, 32)
    pos = positions_for(5, None, x.device)
    kw = dict(attention_mask=None, cu_seqlens=None, attn_mask=None, position_ids=pos)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model.layers[0](x, **kw)
        out2 = model.layers[1](*out, **kw)
    assert isinstance(out, BlockOutput) and isinstance(out2, BlockOutput)
    assert out.residual.dtype == out2.residual.dtype == torch.float32
    assert out.branch.dtype == out2.branch.dtype == torch.bfloat16
    assert torch.equal(out.hidden_state, out.residual + out.branch)
