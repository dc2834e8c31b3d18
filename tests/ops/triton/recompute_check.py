"""The recompute contract of a differentiable Triton op, shared by the interpreter scripts: with recompute=True the
op keeps only its inputs for the backward, and outputs and gradients are bitwise those of recompute=False (the
backward reruns the same deterministic forward kernels)."""

from __future__ import annotations

import torch


def recompute_case(fn, xs: list[torch.Tensor], gen: torch.Generator, **kw) -> dict:
    """fn(q, k, v, *, g, beta, initial_state, output_final_state, recompute, **kw) on leaves cloned from xs
    (q, k, v, g, beta, h0) in both modes. Returns 1.0/0.0 for bitwise equality of o, the final state and every
    gradient, and the bytes autograd kept (saved tensors) in each mode beside the inputs' bytes."""
    do = dht = None
    runs = {}
    for rc in (False, True):
        leaf = [x.clone().requires_grad_() for x in xs]
        kept = []

        def pack(t, kept=kept):
            kept.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            o, ht = fn(*leaf[:3], g=leaf[3], beta=leaf[4], initial_state=leaf[5], output_final_state=True,
                       recompute=rc, **kw)
        if do is None:
            do, dht = torch.randn(o.shape, generator=gen), torch.randn(ht.shape, generator=gen)
        grads = torch.autograd.grad((o.float() * do).sum() + (ht * dht).sum(), leaf)
        runs[rc] = ([o, ht, *grads], sum(kept))
    same = all(torch.equal(a, b) for a, b in zip(runs[False][0], runs[True][0]))
    return {"bitwise_equal": float(same), "saved_bytes": runs[True][1], "saved_bytes_without": runs[False][1],
            "input_bytes": sum(x.numel() * x.element_size() for x in xs)}


def check_recompute_result(res: dict) -> None:
    """The test side of recompute_case: bitwise-equal results; with recompute autograd keeps the inputs and the
    12 bytes of cu_seqlens [3] int32 and nothing else; without it, more than twice that (the intermediates)."""
    assert res["bitwise_equal"] == 1.0, res
    assert res["saved_bytes"] == res["input_bytes"] + 12, res
    assert res["saved_bytes_without"] > 2 * res["input_bytes"], res
