"""The segment-parallel prefill on the Gluon forward (H100/H200): B1 T8192 H4 K=V=128 bf16, 8 programs unsplit on
100+ multiprocessors, so impl="gluon" splits it. The split forced (4 segments) and as the backend chooses it (the
same 4 segments: bitwise equal) against the float64 chunkwise path on the same rounded inputs, each within 1.5x the
unsplit Gluon call's error (outputs NaN-poisoned; final states too) and under the kernels' 16-bit bar.

GPU only (`@pytest.mark.gpu`; skipped without CUDA, compute capability 9.0 or Gluon). Fresh inputs from the suite's
seed, the seed in every failure message.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridlm.ops import dispatch, gated_delta_rule
from hybridlm.ops import split_prefill as sp

pytest.importorskip("triton")
from float64_check import F64, draw_seed, gluon_gpu_marks, rel_f64  # noqa: E402

from hybridlm.ops.gluon import gdn_fwd  # noqa: E402

BAR = 5e-3  # the 16-bit bar of the Gluon kernels' own checks (tests/ops/test_gluon_gdn.py)

pytestmark = gluon_gpu_marks()


def test_gluon_split_matches_float64(monkeypatch):
    monkeypatch.setattr(gdn_fwd, "POISON", True)
    seed = draw_seed()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    B, T, H, K, V = 1, 8192, 4, 128, 128
    r = lambda *s: torch.randn(*s, generator=gen, device="cuda")  # noqa: E731
    x = dict(q=r(B, T, H, K).bfloat16(), k=r(B, T, H, K).bfloat16(), v=r(B, T, H, V).bfloat16(),
             g=F.logsigmoid(r(B, T, H) + 3.0), beta=torch.sigmoid(r(B, T, H)).bfloat16())
    h0 = r(B, H, K, V)
    kw = dict(use_qk_l2norm=True, output_final_state=True, initial_state=h0)
    with torch.no_grad():
        o64, f64 = gated_delta_rule(**{n: t.to(F64) for n, t in x.items()}, impl="chunk",
                                    **{**kw, "initial_state": h0.to(F64)})
        whole = sp.split_prefill(**x, segments=1, impl="gluon", **kw)
        forced = sp.split_prefill(**x, segments=4, impl="gluon", **kw)
        auto = gated_delta_rule(**x, impl="gluon", **kw)
    xp = dispatch.prepare("gated_delta_rule", "scalar", True, x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"],
                          scale=None, initial_state=h0, output_final_state=True, cu_seqlens=None,
                          use_qk_l2norm=True, chunk_size=64, impl="gluon", recompute=False, state_pool=None,
                          state_indices=None)
    length = sp.auto_length(xp, gdn_fwd._multiprocessors(h0.device), gdn_fwd.SUPPORTED_V)
    assert length == T // 4, f"the backend's choice: segments of {length}"
    e1, f1 = rel_f64(whole[0], o64), rel_f64(whole[1], f64)
    assert e1 <= BAR and f1 <= BAR, f"unsplit Gluon: output {e1:.2e}, final state {f1:.2e}, seed {seed}"
    for name, (o, f) in (("forced", forced), ("auto", auto)):
        eo, ef = rel_f64(o, o64), rel_f64(f, f64)
        print(f"{name} split: output {eo:.2e} (unsplit {e1:.2e}), final state {ef:.2e} (unsplit {f1:.2e})")
        assert eo <= 1.5 * e1, f"{name} split: output error {eo:.2e} vs unsplit {e1:.2e}, seed {seed}"
        assert ef <= 1.5 * f1 + 1e-6, f"{name} split: final state error {ef:.2e} vs unsplit {f1:.2e}, seed {seed}"
    assert torch.equal(auto[0], forced[0]) and torch.equal(auto[1], forced[1]), f"auto != forced, seed {seed}"
