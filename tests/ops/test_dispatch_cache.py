"""The dispatch's per-signature memory of its checks and choice (`hybridlm.ops.dispatch._signature`): a repeat call
skips them; any change the checks could see brings them back; the offsets' values are checked on every call; bad
input raises its one-line error whatever was called before. Outputs are held to the token loop in float64."""

from __future__ import annotations

import pytest
import torch
from float64_check import F64, draw_seed, rel

from hybridlm.ops import dispatch, gated_delta_rule

TOL = 1e-10


def _inputs(B=1, T=12, H=1, HV=2, K=4, V=4, dtype=F64):
    gen = torch.Generator().manual_seed(draw_seed())
    r = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)  # noqa: E731
    q, k, v = r(B, T, H, K), r(B, T, H, K), r(B, T, HV, V)
    g = -torch.rand(B, T, HV, generator=gen, dtype=dtype)
    beta = torch.rand(B, T, HV, generator=gen, dtype=dtype)
    return q, k, v, g, beta


@pytest.fixture
def counted(monkeypatch):
    """Counts of the full checks and of the choice, from a dispatch that remembers nothing yet."""
    dispatch.forget()
    counts = {"checks": 0, "choice": 0}
    check, choice = dispatch.check_recurrence_inputs, dispatch._choice

    def counting_check(*a, **kw):
        counts["checks"] += 1
        return check(*a, **kw)

    def counting_choice(*a, **kw):
        counts["choice"] += 1
        return choice(*a, **kw)

    monkeypatch.setattr(dispatch, "check_recurrence_inputs", counting_check)
    monkeypatch.setattr(dispatch, "_choice", counting_choice)
    yield counts
    dispatch.forget()


def _check_against_naive(seed, q, k, v, **kw):
    o_ref, s_ref = gated_delta_rule(q, k, v, impl="naive", output_final_state=True, **kw)
    o, s = gated_delta_rule(q, k, v, impl="chunk", output_final_state=True, **kw)
    assert rel(o, o_ref) <= TOL and rel(s, s_ref) <= TOL, f"seed {seed}"


def test_a_repeat_call_skips_the_checks_and_the_choice(counted, seed):
    q, k, v, g, beta = _inputs()
    o_ref, _ = gated_delta_rule(q, k, v, g=g, beta=beta, impl="naive")
    counted.update(checks=0, choice=0)
    outs = [gated_delta_rule(q, k, v, g=g, beta=beta)[0] for _ in range(3)]
    assert counted == {"checks": 1, "choice": 1}
    for o in outs:
        assert rel(o, o_ref) <= TOL, f"seed {seed}"
    # new tensors of the same signature: still remembered
    q2, k2, v2, g2, beta2 = _inputs()
    o2, _ = gated_delta_rule(q2, k2, v2, g=g2, beta=beta2)
    o2_ref, _ = gated_delta_rule(q2, k2, v2, g=g2, beta=beta2, impl="naive")
    assert rel(o2, o2_ref) <= TOL, f"seed {seed}"
    assert counted == {"checks": 1, "choice": 1}  # the naive reference's signature was remembered at its first call


@pytest.mark.parametrize("change", ["shape", "dtype", "flag", "grad", "impl", "chunk_size", "state", "device"])
def test_a_changed_signature_is_checked_again(counted, change):
    q, k, v, g, beta = _inputs()
    kw = dict(g=g, beta=beta)
    gated_delta_rule(q, k, v, **kw)
    gated_delta_rule(q, k, v, **kw)
    assert counted == {"checks": 1, "choice": 1}
    if change == "shape":
        q, k, v, g, beta = _inputs(T=13)
        kw = dict(g=g, beta=beta)
    elif change == "dtype":
        kw["beta"] = beta.float()
    elif change == "flag":
        kw["use_qk_l2norm"] = True
    elif change == "grad":
        q = q.clone().requires_grad_()
    elif change == "impl":
        kw["impl"] = "naive"
    elif change == "chunk_size":
        kw["chunk_size"] = 32
    elif change == "state":
        kw["initial_state"] = torch.zeros(1, 2, 4, 4, dtype=F64)
    else:  # a tensor on another device: refused in one line, not taken for the remembered call
        kw["g"] = g.to("meta")
        with pytest.raises(ValueError, match="one device") as e:
            gated_delta_rule(q, k, v, **kw)
        assert "\n" not in str(e.value)
        return
    gated_delta_rule(q, k, v, **kw)
    assert counted["checks"] == 2


def test_grad_mode_is_part_of_the_signature(counted):
    q, k, v, g, beta = _inputs()
    q.requires_grad_()
    with torch.no_grad():
        assert dispatch.prepare("gated_delta_rule", "scalar", True, q, k, v, g=g, beta=beta, scale=None,
                                initial_state=None, output_final_state=False, cu_seqlens=None,
                                use_qk_l2norm=False, chunk_size=64, impl="auto", recompute=False, state_pool=None,
                                state_indices=None).needs_grad is False
        gated_delta_rule(q, k, v, g=g, beta=beta)
    o, _ = gated_delta_rule(q, k, v, g=g, beta=beta)
    assert o.requires_grad and counted["checks"] == 3


def test_the_offsets_values_are_checked_on_every_call(counted, seed):
    """Offsets of one shape (one signature) with other values: the new values are taken (output against the token
    loop), and bad values raise their one-line error after good ones; in place changes are seen too."""
    q, k, v, g, beta = _inputs(T=12)
    for cu in ([0, 5, 12], [0, 9, 12], [0, 0, 12]):
        _check_against_naive(seed, q, k, v, g=g, beta=beta, cu_seqlens=torch.tensor(cu, dtype=torch.int32))
    assert counted["checks"] == 2  # naive and chunk: one signature each
    bad = {(0, 7, 5): "non-decreasing", (1, 5, 12): "start at 0", (0, 5, 11): "T=12"}
    for cu, what in bad.items():
        with pytest.raises(ValueError, match=what) as e:
            gated_delta_rule(q, k, v, g=g, beta=beta, cu_seqlens=torch.tensor(cu, dtype=torch.int32), impl="chunk")
        assert "\n" not in str(e.value)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    gated_delta_rule(q, k, v, g=g, beta=beta, cu_seqlens=cu, impl="chunk")
    cu[1] = 13  # in place: the version counter moves, the record is read again
    with pytest.raises(ValueError, match="non-decreasing"):
        gated_delta_rule(q, k, v, g=g, beta=beta, cu_seqlens=cu, impl="chunk")
    with torch.inference_mode():  # an inference tensor refilled in place (no version counter): read every call
        cu_inf = torch.tensor([0, 5, 12], dtype=torch.int32)
        gated_delta_rule(q, k, v, g=g, beta=beta, cu_seqlens=cu_inf, impl="chunk")
        cu_inf[2] = 11
        with pytest.raises(ValueError, match="T=12"):
            gated_delta_rule(q, k, v, g=g, beta=beta, cu_seqlens=cu_inf, impl="chunk")


@pytest.mark.parametrize("bad,err,words", [
    (dict(g="g3"), ValueError, ["g", "shape"]),
    (dict(beta="int"), TypeError, ["beta", "int64"]),
    (dict(chunk_size=48), ValueError, ["chunk_size", "48"]),
    (dict(impl="fast"), ValueError, ["impl", "'fast'"]),
    (dict(initial_state="wide"), ValueError, ["initial_state", "shape"]),
    (dict(state_pool="grad"), ValueError, ["state_pool", "requires_grad"]),
])
def test_bad_input_after_good_calls_raises_its_one_line_error(counted, bad, err, words):
    """The remembered signatures never let a bad call through: each raises what it raises with nothing
    remembered."""
    q, k, v, g, beta = _inputs()
    pool, rows = torch.zeros(3, 2, 4, 4, dtype=F64), torch.tensor([1])
    for kw in (dict(), dict(state_pool=pool, state_indices=rows)):
        for _ in range(2):
            gated_delta_rule(q, k, v, g=g, beta=beta, **kw)
    name, what = next(iter(bad.items()))
    kw = dict(g=g, beta=beta)
    if name == "state_pool":
        kw.update(state_pool=pool.clone().requires_grad_(), state_indices=rows)
    else:
        kw[name] = {"g3": g[..., :1], "int": (beta * 0).long(), "wide": torch.zeros(2, 2, 4, 4, dtype=F64)}.get(
            what, what)
    messages = []
    for _ in range(2):
        with pytest.raises(err) as e:
            gated_delta_rule(q, k, v, **kw)
        messages.append(str(e.value))
        dispatch.forget()
    assert messages[0] == messages[1] and "\n" not in messages[0]
    assert all(w in messages[0] for w in words), messages[0]


def test_forgetting_the_logged_choices_logs_the_next_one(caplog, monkeypatch):
    """A remembered "auto" choice holds while its log line is remembered: `forget_logged` (the training bench calls
    it, to log a run's choices) makes the next call choose and log again; the layer glue's and the decode's choices
    are in the same one set, forgotten by the same call."""
    from hybridlm.ops import glue

    monkeypatch.setattr(dispatch, "_LOGGED", set())
    q, k, v, g, beta = _inputs()
    cpu = torch.device("cpu")

    def choose_all():
        gated_delta_rule(q, k, v, g=g, beta=beta)
        gated_delta_rule(q, k, v, g=g, beta=beta)
        glue.use_triton("silu_mul", "auto", q)
        glue.use_triton("silu_mul", "auto", q)
        dispatch.resolve_impl("kda_decode", "auto", cpu, q, v, needs_grad=False)

    with caplog.at_level("INFO", logger="hybridlm.ops"):
        choose_all()
        dispatch.forget_logged()
        choose_all()
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs == ["hybridlm.ops.gated_delta_rule: impl='auto' picked 'chunk' on cpu",
                    "hybridlm.ops.silu_mul: impl='auto' picked 'torch' on cpu (Triton kernel not used: on cpu)",
                    "hybridlm.ops.kda_decode: impl='auto' picked 'torch' on cpu"] * 2, msgs


def test_the_memory_is_bounded(monkeypatch):
    monkeypatch.setattr(dispatch, "MAX_SEEN", 3)
    dispatch.forget()
    for T in range(1, 7):
        q, k, v, g, beta = _inputs(T=T)
        gated_delta_rule(q, k, v, g=g, beta=beta)
    assert len(dispatch._SEEN) == 3
    dispatch.forget()
