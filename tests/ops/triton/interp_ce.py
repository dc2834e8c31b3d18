"""Cases for the LM head's cross-entropy kernel (hybridlm/ops/triton/ce.py) and `linear_cross_entropy` on it, run in
a child process under TRITON_INTERPRET=1 (CPU).

    python tests/ops/triton/interp_ce.py SEED

Run by tests/ops/test_linear_ce.py (the variable must be set before triton decorates the kernel). Prints one JSON
line "RESULT {case: {check: value}}"; the parent asserts. Inputs are drawn from SEED (the suite's seed for the
test); the kernel's outputs start as NaN so an unwritten element fails, and it runs with a block of 32 logits so
that a row takes several blocks and a partial last one.
- rows_*: the kernel on given logits against float64 F.cross_entropy on the same stored values: per-token loss
  (absolute error over max(1, |loss|)) and dlogits (elementwise error over |dlogits| + the dtype's smallest
  normal; at the target less 2^-22, the fp32 error of a softmax value near 1 that subtracting 1 leaves), with
  ignored tokens, targets at the row's max, first and last logits, a row shifted by 3e4 (overflows exp without
  the max) and a steep row (softmax almost one-hot); plus exact checks: ignored rows give 0 loss and zero
  gradient, the custom op in place equals the kernel into another buffer bit for bit, the loss-only launch
  gives the same losses and leaves the logits as they were, a target outside [0, V) gives a NaN loss.
- op_*: `linear_cross_entropy(impl="triton")` with chunks that do not divide the tokens against float64 (loss,
  grad_hidden, grad_weight relative L2), and under CPU bf16 autocast also against the PyTorch path under the same
  autocast (the same rounding points); no_grad, all-ignored, no tokens; the model's head with impl="triton";
  the op under torch.compile(fullgraph=True, aot_eager) against eager.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from interp_patches import patch_interpreter  # noqa: E402  (the interpreter's fixes, before any kernel runs)

patch_interpreter()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from hybridlm import HybridConfig, HybridLM  # noqa: E402
from hybridlm.ops.linear_ce import linear_cross_entropy  # noqa: E402
from hybridlm.ops.triton import ce  # noqa: E402
from hybridlm.ops.triton.tune import tuned  # noqa: E402

ce.POISON = True
F32, BF16, F16, F64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
IGNORE = -100
BLOCK = 32


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().to(F64), b.detach().to(F64)
    if a.shape != b.shape or not torch.isfinite(a).all():
        return float("inf")
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _logits(gen, V: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """12 rows: ordinary ones, two ignored, targets at the max / first / last logit, a row shifted by 3e4 and a
    steep row (scale 200) with its target off the max."""
    c = 12
    z = 3 * torch.randn(c, V, generator=gen)
    z[5] += 3e4
    z[6] *= 200
    t = torch.randint(0, V, (c,), generator=gen)
    t[[1, 8]] = IGNORE
    z = z.to(dtype)
    t[2], t[3], t[4] = z[2].float().argmax(), 0, V - 1
    t[5] = z[5].float().argmax()
    t[6] = z[6].float().argmin()
    return z, t


def rows_case(gen, V: int, dtype) -> dict:
    z, t = _logits(gen, V, dtype)
    valid = t != IGNORE
    out, loss = torch.full_like(z, float("nan")), torch.full((z.shape[0],), float("nan"))
    with tuned(ce.TUNE, block=BLOCK):
        ce.launch(z, t, out, loss, IGNORE)
        z_in, loss_in = z.clone(), torch.full_like(loss, float("nan"))
        ce.ce_rows(z_in, t, loss_in, IGNORE, True)
        z_ro, loss_ro = z.clone(), torch.full_like(loss, float("nan"))
        ce.ce_rows(z_ro, t, loss_ro, IGNORE, False)
        bad_t, loss_bad = t.clone(), torch.full_like(loss, float("nan"))
        bad_t[0], bad_t[3] = V, -1
        ce.launch(z, bad_t, None, loss_bad, IGNORE)
    zd = z.to(F64)
    ref = F.cross_entropy(zd, t, ignore_index=IGNORE, reduction="none")
    p = torch.softmax(zd, -1)
    p[torch.arange(len(t))[valid], t[valid]] -= 1
    p *= valid[:, None]
    tiny = torch.finfo(dtype).tiny  # below it the dtype's rounding is absolute (subnormals)
    at_t = torch.zeros_like(p)  # softmax - 1 at the target keeps the fp32 error of a softmax value near 1
    at_t[torch.arange(len(t))[valid], t[valid]] = 2.0**-22
    finite = bool(torch.isfinite(out).all() and torch.isfinite(loss).all())
    return {"loss": float(((loss.to(F64) - ref).abs() / ref.abs().clamp_min(1.0)).max()) if finite else float("inf"),
            "dlogits": float((((out.to(F64) - p).abs() - at_t).clamp_min(0) / (p.abs() + tiny)).max())
            if finite else float("inf"),
            "ignored_zero": float(bool((loss[~valid] == 0).all() and (out[~valid] == 0).all())),
            "in_place_equal": float(torch.equal(z_in, out) and torch.equal(loss_in, loss)),
            "loss_only_equal": float(torch.equal(z_ro, z) and torch.equal(loss_ro, loss)),
            "out_of_range_nan": float(bool(loss_bad[[0, 3]].isnan().all() and torch.equal(loss_bad[1:3], loss[1:3])))}


def _inputs(gen, n: int, d: int, v: int, ignored: float = 0.3):
    h = torch.randn(n, d, generator=gen)
    w = 0.5 * torch.randn(v, d, generator=gen)
    t = torch.randint(0, v, (n,), generator=gen)
    t[torch.rand(n, generator=gen) < ignored] = IGNORE
    return h, w, t


def _run(h, w, t, impl: str, autocast: bool, reduction: str = "sum", chunk: int | None = 10):
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    with tuned(ce.TUNE, block=BLOCK), torch.autocast("cpu", dtype=BF16, enabled=autocast):
        loss = linear_cross_entropy(hh, ww, t, ignore_index=IGNORE, reduction=reduction, chunk_size=chunk, impl=impl)
    gh, gw = torch.autograd.grad(loss * 0.7, (hh, ww))
    return loss, gh, gw


def op_case(gen, autocast: bool, reduction: str) -> dict:
    """37 tokens in chunks of 10, vocab 100 (blocks of 32): against float64, and under autocast against the
    PyTorch path under the same autocast."""
    h, w, t = _inputs(gen, 37, 16, 100)
    loss, gh, gw = _run(h, w, t, "triton", autocast, reduction)
    hd, wd = h.to(F64).requires_grad_(), w.to(F64).requires_grad_()
    ref = F.cross_entropy(F.linear(hd, wd), t, ignore_index=IGNORE, reduction=reduction)
    rh, rw = torch.autograd.grad(ref * 0.7, (hd, wd))
    res = {"loss": abs(loss.item() - ref.item()) / abs(ref.item()), "grad_hidden": rel(gh, rh),
           "grad_weight": rel(gw, rw),
           "dtypes_ok": float(loss.dtype == gh.dtype == gw.dtype == F32)}
    if autocast:
        loss2, gh2, gw2 = _run(h, w, t, "torch", autocast, reduction)
        res.update({"loss_vs_torch": abs(loss.item() - loss2.item()) / abs(loss2.item()),
                    "grad_hidden_vs_torch": rel(gh, gh2), "grad_weight_vs_torch": rel(gw, gw2)})
    return res


def op_edges(gen) -> dict:
    """no_grad gives the loss of the grad-mode call; all tokens ignored: 0 and zero gradients (mean: NaN); no
    tokens: 0; a target out of range: NaN."""
    h, w, t = _inputs(gen, 21, 8, 45)
    loss = _run(h, w, t, "triton", False, chunk=8)[0]
    with torch.no_grad(), tuned(ce.TUNE, block=BLOCK):
        loss_ng = linear_cross_entropy(h, w, t, ignore_index=IGNORE, chunk_size=8, impl="triton")
    t_ign = torch.full_like(t, IGNORE)
    l0, gh0, gw0 = _run(h, w, t_ign, "triton", False, chunk=8)
    lm = _run(h, w, t_ign, "triton", False, "mean", chunk=8)[0]
    le, ghe, gwe = _run(h[:0], w, t[:0], "triton", False)
    t_bad = t.clone()
    t_bad[3] = 45
    with torch.no_grad(), tuned(ce.TUNE, block=BLOCK):
        lb = linear_cross_entropy(h, w, t_bad, ignore_index=IGNORE, impl="triton")
    return {"no_grad_equal": float(torch.equal(loss, loss_ng) and not loss_ng.requires_grad),
            "all_ignored": float(l0.item() == 0 and not gh0.any() and not gw0.any() and bool(lm.isnan())),
            "no_tokens": float(le.item() == 0 and ghe.shape == (0, 8) and not gwe.any()),
            "out_of_range_nan": float(bool(lb.isnan()))}


def model_case(gen) -> dict:
    """HybridLM's head with impl="triton" (the layers on PyTorch) against impl="naive": loss and every gradient."""
    cfg = HybridConfig(vocab_size=70, hidden_size=32, num_hidden_layers=2,
                       layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                       linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48)
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    model = HybridLM(cfg, impl="naive")
    x = torch.randint(0, 70, (2, 13), generator=gen)
    tg = torch.randint(0, 70, (2, 13), generator=gen)
    tg[0, [2, 9]] = IGNORE
    out = {}
    for head in ("triton", "naive"):
        model.impl = head
        model.zero_grad()
        with tuned(ce.TUNE, block=BLOCK):
            loss = model(x, targets=tg).loss
        loss.backward()
        out[head] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    (lt, gt), (ln, gn) = out["triton"], out["naive"]
    return {"loss": abs(lt.item() - ln.item()) / abs(ln.item()), "grads": max(rel(gt[n], gn[n]) for n in gn)}


def compiled_case(gen) -> dict:
    """linear_cross_entropy(impl="triton") under torch.compile(fullgraph=True, aot_eager) against eager: the custom
    op's fake kernel traces and its writes into the loss buffer's slices survive functionalization."""
    h, w, t = _inputs(gen, 21, 8, 40)
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()

    def f(h, w, t):
        return linear_cross_entropy(h, w, t, ignore_index=IGNORE, chunk_size=8, impl="triton")

    with tuned(ce.TUNE, block=BLOCK):
        a = torch.compile(f, backend="aot_eager", fullgraph=True)(hh, ww, t)
        ga = torch.autograd.grad(a, (hh, ww))
        b = f(hh, ww, t)
        gb = torch.autograd.grad(b, (hh, ww))
    return {"loss": rel(a, b), "grad_hidden": rel(ga[0], gb[0]), "grad_weight": rel(ga[1], gb[1])}


def cases(gen) -> dict:
    res = {}
    for dt, name in ((F32, "f32"), (BF16, "bf16"), (F16, "f16")):
        for V in (100, 32, 7):
            res[f"rows_{name}_V{V}"] = rows_case(gen, V, dt)
    for autocast in (False, True):
        for reduction in ("sum", "mean"):
            res[f"op_{'bf16' if autocast else 'f32'}_{reduction}"] = op_case(gen, autocast, reduction)
    res["op_edges"] = op_edges(gen)
    res["model_head"] = model_case(gen)
    res["compiled"] = compiled_case(gen)
    return res


def main() -> int:
    seed = int(sys.argv[1]) if len(sys.argv) > 1 else torch.seed() % 2**31
    res = {"seed": seed}
    res.update(cases(torch.Generator().manual_seed(seed)))
    print("RESULT " + json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
