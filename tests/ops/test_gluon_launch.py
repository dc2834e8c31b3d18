"""The host path of the Gluon GDN forward and of the Gluon backward's state-gradient chain on the CPU: which launches
a call takes and with what arguments.

No kernel runs here: the JIT launches are replaced by recorders that return stand-ins of a CompiledKernel whose C
launcher records its arguments, and the TMA encoder by one that returns the key it was given. Checked: the first
call of a signature launches through the JIT, later ones directly with the addresses of *their* tensors and
tensor maps encoded for those addresses and the signature's geometry; another shape, a misaligned pointer, a
Triton hook or another current device go back to the JIT; the tensor-map cache returns a map only for the same
address and spec and stays bounded; `direct_launch` refuses launchers it does not know. The backward's
(`gdn_bwd.state_grad_chain`: the Gluon chain, reading the forward's gate rows) likewise, and a new final-state
cotangent, initial state, length or saved-chunk count is a new plan. The
numerics of the direct launches are checked on an H100 (tests/ops/test_gluon_gdn.py and test_gluon_gdn_bwd.py:
test_direct_launches_see_new_tensors; test_gluon_gdn_bwd.py::test_direct_equals_jit_bitwise).
"""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("triton")
from hybridlm.ops import launch  # noqa: E402
from hybridlm.ops.gluon import gdn_bwd, gdn_fwd  # noqa: E402
from hybridlm.ops.triton.chunk_layout import layout  # noqa: E402

if gdn_fwd._IMPORT_ERROR is not None:  # pragma: no cover - the compile test fails on such a Triton instead
    pytest.skip("needs Triton's Gluon API", allow_module_level=True)

META16 = {"swizzle": 3, "elem_size": 2, "elem_type": 10, "block_size": [64, 64], "fp4_padded": False}
META32 = {"swizzle": 0, "elem_size": 4, "elem_type": 7, "block_size": [8, 64], "fp4_padded": False}


class RawLauncher:
    """Stands in for the C launcher (a callable that is not a Python function)."""

    def __init__(self, log):
        self.log = log

    def __call__(self, *args):
        self.log.append(args)


def fake_compiled(n_desc: int, log: list, *, scratch: int = 0, metas=None, wrap: bool = True):
    """A CompiledKernel as `direct_launch` reads it: run (the launcher object) with a `launch` that, for a kernel
    with descriptors, is a Python wrapper holding the C launcher in its closure variable `launcher`."""
    raw = RawLauncher(log)
    if n_desc and wrap:
        def make(launcher):
            def inner(*args):
                return launcher(*args)
            return inner
        launch_fn = make(raw)
    else:
        launch_fn = raw
    if metas is None:  # the chain's order: q, k, v, T (16-bit), the gate rows (fp32), o
        metas = [META16, META16, META16, META16, META32, META16][:n_desc]
    sig = {f"d{i}": "tensordesc<bf16[64, 64],x>" for i in range(n_desc)} | {"p": "*bf16", "K": "constexpr"}
    md = types.SimpleNamespace(global_scratch_size=scratch, profile_scratch_size=0, tensordesc_meta=metas)
    run = types.SimpleNamespace(launch=launch_fn, launch_cooperative_grid=False, launch_pdl=False)
    return types.SimpleNamespace(run=run, metadata=md, src=types.SimpleNamespace(signature=sig), function=1234,
                                 packed_metadata=(4, 1, 0))


class FakeKernel:
    """Stands in for a JIT function: `kernel[grid](*args, **opts)` records the call and returns a fake
    CompiledKernel; `warmup` likewise."""

    def __init__(self, n_desc, raw_log, metas=None):
        self.jit_calls, self.raw_log, self.n_desc, self.metas = [], raw_log, n_desc, metas

    def __getitem__(self, grid):
        def call(*args, **opts):
            self.jit_calls.append((grid, args, opts))
            return fake_compiled(self.n_desc, self.raw_log, metas=self.metas)
        return call

    def warmup(self, *args, grid, **opts):
        c = fake_compiled(self.n_desc, self.raw_log)
        c._init_handles = lambda: None
        return c


@pytest.fixture
def host(monkeypatch):
    """gdn_fwd on the CPU with recorders for the kernels, the stream, the device and the tensor-map encoder."""
    solve_raw, chain_raw, encoded = [], [], []
    solve, chain = FakeKernel(0, solve_raw), FakeKernel(6, chain_raw)
    monkeypatch.setattr(gdn_fwd, "_gdn_solve_kernel", solve)
    monkeypatch.setattr(gdn_fwd, "_gdn_chain_kernel", chain)
    monkeypatch.setattr(gdn_fwd, "_multiprocessors", lambda dev: 132)
    monkeypatch.setattr(gdn_fwd, "_PLANS", type(gdn_fwd._PLANS)())
    current = {"device": None}
    monkeypatch.setattr(launch, "_DEVICE_STREAM", [lambda: current["device"], lambda index: 77])
    monkeypatch.setattr(launch, "_MAPS", type(launch._MAPS)())

    def encode(ptr, spec):
        encoded.append((ptr, spec))
        return ("map", ptr, spec.swizzle, tuple(spec.block), tuple(spec.shape), tuple(spec.strides))

    monkeypatch.setattr(launch, "_encode", encode)
    return types.SimpleNamespace(solve=solve, chain=chain, solve_raw=solve_raw, chain_raw=chain_raw,
                                 encoded=encoded, current=current)


def inputs(seed, B=2, T=100, H=2, HV=4, K=128, V=128, offset=0):
    """Fresh CPU tensors; offset > 0 moves g's storage off 16-byte alignment."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k, v = r(B, T, H, K).to(torch.bfloat16), r(B, T, H, K).to(torch.bfloat16), r(B, T, HV, V).to(torch.bfloat16)
    g = r(B * T * HV + offset)[offset:].view(B, T, HV)
    return q, k, v, g, r(B, T, HV).to(torch.bfloat16)


def forward(x, **kw):
    q, k, v, g, beta = x
    return gdn_fwd.gated_delta_rule_fwd(q, k, v, g=g, beta=beta, use_qk_l2norm=True, checked=True, **kw)


def test_second_call_launches_directly_with_its_own_tensors(host, seed):
    a, b = inputs(seed), inputs(seed + 1)
    forward(a)
    assert len(host.solve.jit_calls) == 1 and len(host.chain.jit_calls) == 1 and not host.solve_raw
    o_b, ht_b = forward(b, output_final_state=False)
    assert len(host.solve.jit_calls) == 1 and len(host.chain.jit_calls) == 1, seed
    (solve_args,), (chain_args,) = host.solve_raw, host.chain_raw
    q, k, v, g, beta = b
    # base: grid, stream, function, cooperative, pdl, two scratch, packed metadata, launch metadata, two hooks
    assert solve_args[:4] == (8, 2, 1, 77) and solve_args[4:13] == (1234, False, False, None, None, (4, 1, 0),
                                                                       None, None, None)
    jit_grid, jit_args, jit_opts = host.solve.jit_calls[0]
    direct = solve_args[13:]
    assert len(direct) == len(jit_args) and jit_grid == (8, 2, 1)
    assert direct[:4] == (q.data_ptr(), k.data_ptr(), g.data_ptr(), beta.data_ptr()), seed
    assert direct[9:] == jit_args[9:]  # scale, H, HV and the constexprs
    assert jit_opts == {"num_warps": gdn_fwd.NUM_WARPS, "maxnreg": gdn_fwd.SOLVE_REGS}
    # the chain: six (map, *shape, *strides) groups, then o and the rest
    Ttot, slots = 200, 2 * 2 * 4
    shapes = [(Ttot, 256), (Ttot, 256), (Ttot, 512), (slots * 64, 64), (slots * 8, 64), (Ttot, 512)]
    ptrs = [q.data_ptr(), k.data_ptr(), v.data_ptr(), None, None, o_b.data_ptr()]
    groups = [chain_args[13 + 5 * i: 18 + 5 * i] for i in range(6)]
    for i, (grp, shape, ptr) in enumerate(zip(groups, shapes, ptrs)):
        tag, addr, _, block, enc_shape, enc_strides = grp[0]
        assert tag == "map" and grp[1:] == (*shape, shape[1], 1) and enc_shape == shape, (seed, i, grp)
        assert enc_strides == (shape[1], 1) and (ptr is None or addr == ptr), (seed, i)
    assert groups[4][0][3] == (8, 64) and groups[0][0][2] == 3
    # T and the gate rows: one allocation, the gate rows right after T; the solve wrote where the chain reads
    assert groups[4][0][1] == groups[3][0][1] + slots * 64 * 64 * 2 and direct[4:6] == (groups[3][0][1],
                                                                                        groups[4][0][1])
    rest = chain_args[43:]
    assert rest[0] == o_b.data_ptr() and rest[1] == rest[2] == o_b.data_ptr()  # no h0, no ht: o, never read
    assert ht_b is None


def test_same_addresses_reuse_their_tensor_maps(host, seed):
    """q, k and v at the same addresses are encoded once (the CPU allocator moves o and the solve's buffers each
    call; CUDA's caching allocator mostly gives them back their addresses)."""
    a = inputs(seed)
    ptrs = {x.data_ptr() for x in a[:3]}
    for _ in range(3):
        forward(a)
    assert sorted(p for p, _ in host.encoded if p in ptrs) == sorted(ptrs), seed
    b = inputs(seed + 1)
    forward(b)
    assert {x.data_ptr() for x in b[:3]} <= {p for p, _ in host.encoded}, "new tensors got no maps of their own"


def test_another_shape_or_flag_is_another_plan(host, seed):
    forward(inputs(seed))
    forward(inputs(seed, T=130))
    assert len(host.chain.jit_calls) == 2, "a new length launched through an old plan"
    forward(inputs(seed), output_final_state=True)
    assert len(host.chain.jit_calls) == 3 and host.chain.jit_calls[-1][1][-3] is True  # STORE_HT
    assert len(gdn_fwd._PLANS) == 3


def test_misaligned_pointer_launches_through_the_jit(host, seed):
    forward(inputs(seed))
    forward(inputs(seed, offset=1))  # g 4 bytes off alignment: the JIT specialises on it
    assert len(host.solve.jit_calls) == 2 and not host.solve_raw, seed
    assert len(host.chain.jit_calls) == 2 and not host.chain_raw, seed


def test_hooks_or_another_device_launch_through_the_jit(host, seed, monkeypatch):
    forward(inputs(seed))
    host.current["device"] = 1  # the inputs are not on the current device
    forward(inputs(seed))
    assert len(host.solve.jit_calls) == 2 and not host.solve_raw
    host.current["device"] = None
    hook = lambda *a: None  # noqa: E731
    launch.knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert not launch.jit_is_plain()
        forward(inputs(seed))
    finally:
        launch.knobs.runtime.launch_enter_hook.remove(hook)
    assert len(host.solve.jit_calls) == 3 and not host.solve_raw
    assert launch.jit_is_plain()
    monkeypatch.setattr(launch.knobs.runtime, "debug", True)
    assert not launch.jit_is_plain()


def test_tensor_map_cache_keys_and_bound(host, monkeypatch):
    spec = launch.TmaSpec(META16, (128, 256), (256, 1))
    twin = launch.TmaSpec(META16, (128, 256), (256, 1))
    m = launch.tensor_map(4096, spec)
    assert launch.tensor_map(4096, spec) is m and len(host.encoded) == 1
    assert launch.tensor_map(8192, spec) != m and len(host.encoded) == 2  # another address
    launch.tensor_map(4096, twin)  # an equal spec of another signature: a map of its own
    assert len(host.encoded) == 3
    monkeypatch.setattr(launch, "MAX_MAPS", 4)
    for p in range(5):
        launch.tensor_map(16 * (p + 1000), spec)
    assert len(launch._MAPS) == 4
    launch.tensor_map(4096, spec)  # evicted: encoded again
    assert host.encoded[-1] == (4096, spec)
    assert spec.elem_type == 9 and launch.TmaSpec(META32, (8, 64), (64, 1)).elem_type == 7  # host enum


def test_direct_launch_refuses_unknown_launchers():
    log = []
    assert launch.direct_launch(fake_compiled(6, log)) is not None
    assert launch.direct_launch(fake_compiled(0, log)) is not None
    assert launch.direct_launch(fake_compiled(6, log, scratch=128)) is None
    assert launch.direct_launch(fake_compiled(6, log, metas=[META16] * 5)) is None  # a descriptor without metadata
    assert launch.direct_launch(fake_compiled(6, log, metas=[dict(META16, fp4_padded=True)] * 6)) is None

    def other_wrapper(*args):  # a Python wrapper that holds no `launcher`
        return args

    c = fake_compiled(6, log)
    c.run.launch = other_wrapper
    assert launch.direct_launch(c) is None
    c = fake_compiled(0, log)
    c.run.launch = other_wrapper
    assert launch.direct_launch(c) is None


def test_varlen_chunk_offsets_come_from_the_host_copy(host, seed, monkeypatch):
    """Packed sequences: the grid and the chunk offsets follow from the recorded host offsets (no read-back of the
    device tensor), lengths 1, 15, 100 and 700 giving 1, 1, 2 and 11 chunks."""
    from hybridlm.ops import offsets

    lens = [1, 15, 100, 700]
    q, k, v, g, beta = inputs(seed, B=1, T=sum(lens))
    cu = offsets.remember_offsets(torch.tensor([0, 1, 16, 116, 816], dtype=torch.int32), [0, 1, 16, 116, 816])
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "tolist", lambda self: pytest.fail("read the offsets back"))
        gdn_fwd.gated_delta_rule_fwd(q, k, v, g=g, beta=beta, cu_seqlens=cu, use_qk_l2norm=True, checked=True)
    grid, args, _ = host.solve.jit_calls[-1]
    assert grid == (4 * 4, 11, 1), seed
    assert args[7].dtype == torch.int32 and args[7].tolist() == [0, 1, 2, 4, 15] and args[6] is cu, seed
    assert host.chain.jit_calls[-1][0] == (2, 4 * 4, 1)


def test_overlapped_form_forks_and_joins_without_switching_streams(monkeypatch):
    """The solve beside the chain: the chain's stream waits for the current one, the chain is launched on it by its
    raw handle (no stream switch), the solve on the current stream, and the current stream waits for the chain;
    the fork and join events are made once per device and thread, not once a call."""
    import threading

    log, made = [], []

    class Stream:
        def __init__(self, name, raw):
            self.name, self.cuda_stream = name, raw

        def wait_event(self, ev):
            log.append(("wait", self.name, ev.n))

    class Event:
        def __init__(self):
            self.n = len(made)
            made.append(self)

        def record(self, stream):
            log.append(("record", stream.name, self.n))

    cur, side = Stream("cur", 11), Stream("side", 22)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda dev=None: cur)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: pytest.fail("switched the current stream"))
    monkeypatch.setattr(gdn_fwd, "_chain_stream", lambda dev: side)
    monkeypatch.setattr(gdn_fwd, "_SIDES", threading.local())
    dev = torch.device("cuda", 0)

    def chain(s):
        log.append(("chain", s.raw))

    for _ in range(2):
        gdn_fwd._beside(lambda: log.append(("solve",)), chain, dev)
    once = [("record", "cur", 0), ("wait", "side", 0), ("chain", 22), ("solve",), ("record", "side", 1),
            ("wait", "cur", 1)]
    assert log == once * 2 and len(made) == 2
    t = threading.Thread(target=gdn_fwd._beside, args=(lambda: None, lambda s: None, dev))
    t.start()
    t.join()
    assert len(made) == 4  # another thread: events of its own


# ------------------------------------------------------------------------------ the backward's state-gradient chain
BWD_METAS = [META16] * 5 + [META32] + [META16] * 2  # W, q, k, do, P, the gate rows (fp32), dS', dVn


@pytest.fixture
def bwd(host, monkeypatch):
    """gdn_bwd on the CPU: a recorder for the chain kernel, the forward's for the rest."""
    chain_raw = []
    chain = FakeKernel(8, chain_raw, BWD_METAS)
    monkeypatch.setattr(gdn_bwd, "_gdn_chain_bwd_kernel", chain)
    monkeypatch.setattr(gdn_bwd, "_PLANS", type(gdn_bwd._PLANS)())
    return types.SimpleNamespace(chain=chain, chain_raw=chain_raw, encoded=host.encoded, current=host.current)


def bwd_inputs(B=2, T=100, H=2, HV=4, K=128, V=128, *, dht=True, h0=True, extra=1, offset=0, strided=False):
    """What `_state_grad_pass` hands the chain (values unused: no kernel runs): the saved P, gate rows and the dS'
    buffer with `extra` chunks past the layout's (the forward sizes them by `max_chunks`); offset > 0 moves the
    final-state cotangent's storage off 16-byte alignment (a plain pointer of the chain's); strided: do is a
    transposed view."""
    lay = layout(None, B, T, 64, "cpu")
    e = lambda *s, dt=torch.bfloat16: torch.empty(*s, dtype=dt)  # noqa: E731
    nc = lay.nc + extra
    do = e(B, T, V, HV).transpose(2, 3) if strided else e(B, T, HV, V)
    n_ht = B * HV * K * V
    return dict(q=e(B, T, H, K), k=e(B, T, H, K), G=e(nc, HV, 4, 64, dt=torch.float32), do=do, Wb=e(B * T, HV, K),
                Pb=e(nc, HV, 64, 64), dhb=e(nc, HV, K, V), dvn=e(B * T, HV, V),
                dht=e(n_ht + offset, dt=torch.float32)[offset:].view(B, HV, K, V) if dht else None,
                dh0=e(B, HV, K, V, dt=torch.float32) if h0 else e(0, dt=torch.float32), h0=h0, lay=lay)


def backward(x):
    gdn_bwd.state_grad_chain(x["do"], x["dht"], x["q"], x["k"], x["G"], x["Wb"], x["Pb"], x["dh0"], x["dhb"],
                             x["dvn"], x["lay"], x["h0"])


def test_bwd_second_call_launches_directly_with_its_own_tensors(bwd):
    a, b = bwd_inputs(), bwd_inputs()
    backward(a)
    assert len(bwd.chain.jit_calls) == 1 and not bwd.chain_raw
    backward(b)
    assert len(bwd.chain.jit_calls) == 1
    (chain_args,) = bwd.chain_raw
    lay = b["lay"]
    # the chain: eight (map, *shape, *strides) groups in `_descriptors`' order, then its pointers and integers
    shapes = [(200, 512), (200, 256), (200, 256), (200, 512), (5 * 4 * 64, 64), (4 * 4 * 4, 64), (5 * 4 * 128, 128),
              (200, 512)]
    ptrs = [b[n].data_ptr() for n in ("Wb", "q", "k", "do", "Pb", "G", "dhb", "dvn")]
    groups = [chain_args[13 + 5 * i: 18 + 5 * i] for i in range(8)]
    for i, (grp, shape, ptr) in enumerate(zip(groups, shapes, ptrs)):
        tag, addr, _, block, enc_shape, enc_strides = grp[0]
        assert tag == "map" and addr == ptr and grp[1:] == (*shape, shape[1], 1), (i, grp)
        assert enc_shape == shape and enc_strides == (shape[1], 1), i
    assert groups[5][0][3] == (8, 64) and groups[0][0][2] == 3  # the gate rows' fp32 box, a 16-bit swizzle
    assert chain_args[:3] == (2, 8, 1)
    rest = chain_args[53:]
    _, cjit_args, cjit_opts = bwd.chain.jit_calls[0]
    assert rest[:5] == tuple(x.data_ptr() for x in (b["dht"], b["dh0"], b["dvn"], lay.cu_t, lay.chunk_off))
    assert rest[5:] == cjit_args[13:] == (2, 4, 128, 128, 64, 64, 4, True, True)
    assert cjit_opts == {"num_warps": gdn_bwd.NUM_WARPS}


def test_bwd_same_addresses_reuse_their_tensor_maps(bwd):
    a = bwd_inputs()
    for _ in range(3):
        backward(a)
    fixed = {a[n].data_ptr() for n in ("Wb", "q", "k", "do", "Pb", "G", "dhb", "dvn")}
    assert sorted(p for p, _ in bwd.encoded if p in fixed) == sorted(fixed)


def test_bwd_another_signature_is_another_plan(bwd):
    backward(bwd_inputs())
    backward(bwd_inputs())  # new tensors of the same signature: the same plan
    assert len(bwd.chain.jit_calls) == 1 and len(bwd.chain_raw) == 1
    for n, kw in enumerate([dict(dht=False), dict(h0=False), dict(T=130), dict(extra=2)], start=2):
        backward(bwd_inputs(**kw))
        assert len(bwd.chain.jit_calls) == n, kw
    consts = [c[1][-2:] for c in bwd.chain.jit_calls]
    assert consts[1] == (False, True) and consts[2] == (True, False)  # HAS_DHT, STORE_DH0
    no_dht, no_h0 = bwd.chain.jit_calls[1][1], bwd.chain.jit_calls[2][1]
    assert no_dht[8] is no_dht[9] and no_h0[9] is no_h0[10]  # stand-ins (dh0 for dht, dvn for dh0), never touched
    assert len(gdn_bwd._PLANS) == 5


@pytest.mark.parametrize("case", ["misaligned", "strided", "device", "hook"])
def test_bwd_launches_through_the_jit_where_direct_is_not_equivalent(bwd, case):
    backward(bwd_inputs())
    x = bwd_inputs(offset=1 if case == "misaligned" else 0, strided=case == "strided")
    hook = lambda *a: None  # noqa: E731
    if case == "device":
        bwd.current["device"] = 1
    if case == "hook":
        launch.knobs.runtime.launch_enter_hook.add(hook)
    try:
        backward(x)
    finally:
        if case == "hook":
            launch.knobs.runtime.launch_enter_hook.remove(hook)
    assert len(bwd.chain.jit_calls) == 2, case
    assert not bwd.chain_raw, case
    bwd.current["device"] = None
    backward(bwd_inputs())
    assert len(bwd.chain_raw) == 1, case


def test_bwd_unknown_launcher_stays_on_the_jit(bwd, monkeypatch):
    chain = FakeKernel(8, bwd.chain_raw, BWD_METAS[:7])  # a descriptor without metadata: not a launcher we know
    monkeypatch.setattr(gdn_bwd, "_gdn_chain_bwd_kernel", chain)
    for _ in range(3):
        backward(bwd_inputs())
    assert len(chain.jit_calls) == 3 and not bwd.chain_raw
    (plan,) = gdn_bwd._PLANS.values()
    assert plan.chain is False and plan.specs is None
