"""The training kernels give bitwise-equal gradients on every call with the same inputs (no atomics whose order
varies between runs): GDN and KDA forward and backward through `impl="triton"`, 100 calls each, with GVA, varlen
documents, an initial state and the in-kernel l2 norm. RL post-training compares log-probabilities of two passes
over the same tokens, so a gradient that moves in its last bit between calls is a bug there."""

from __future__ import annotations

import pytest
import torch

from hybridlm.ops import gated_delta_rule, kda

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CALLS = 100


def _inputs(op: str, seed: int) -> dict[str, torch.Tensor]:
    """bf16 inputs (KDA's log-decays fp32, as its kernels take them) of one packed row of three documents (1000, 63
    and 985 tokens), K = V = 128, an fp32 initial state per document; GDN with 4 key heads to 8 value heads, KDA
    with 8 of each (its kernels take no grouped value heads)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    T, H, HV, K, V = 2048, 4, 8, 128, 128
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    x = {"q": r(1, T, H, K), "k": r(1, T, H, K), "v": r(1, T, HV, V)}
    if op == "kda":
        x["q"], x["k"] = r(1, T, HV, K), r(1, T, HV, K)
        x["g"] = torch.nn.functional.logsigmoid(r(1, T, HV, K) + 2)
    else:
        x["g"] = torch.nn.functional.logsigmoid(r(1, T, HV) + 3)
    x = {n: t if n == "g" and op == "kda" else t.bfloat16() for n, t in x.items()}  # KDA's log-decays are fp32
    x["beta"] = torch.rand(1, T, HV, device="cuda", generator=gen).bfloat16()
    x["initial_state"] = r(3, HV, K, V) * 0.1
    return x


def _grads(op: str, x: dict[str, torch.Tensor], do: torch.Tensor, dht: torch.Tensor) -> list[torch.Tensor]:
    fn = kda if op == "kda" else gated_delta_rule
    leaves = {n: t.clone().requires_grad_(True) for n, t in x.items()}
    cu = torch.tensor([0, 1000, 1063, 2048], device="cuda", dtype=torch.int32)
    o, ht = fn(leaves["q"], leaves["k"], leaves["v"], g=leaves["g"], beta=leaves["beta"],
               initial_state=leaves["initial_state"], output_final_state=True, cu_seqlens=cu, use_qk_l2norm=True,
               impl="triton")
    got = torch.autograd.grad([o, ht], list(leaves.values()), [do, dht])
    return [o.detach(), ht.detach(), *got]


@pytest.mark.parametrize("op", ["gated_delta_rule", "kda"])
def test_repeated_forward_backward_is_bitwise_equal(op, seed):
    x = _inputs(op, seed)
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    do = torch.randn(x["v"].shape, device="cuda", generator=gen).bfloat16()
    dht = torch.randn(x["initial_state"].shape, device="cuda", generator=gen)
    names = ["o", "final_state", *("d" + n for n in x)]
    first = _grads(op, x, do, dht)
    assert all(torch.isfinite(t).all() for t in first), f"seed {seed}: a non-finite output or gradient"
    for call in range(1, CALLS):
        again = _grads(op, x, do, dht)
        for name, a, b in zip(names, again, first):
            assert torch.equal(a, b), (f"seed {seed}: {name} of call {call} differs from call 0 by up to "
                                       f"{(a.float() - b.float()).abs().max().item():.3g}")
