"""`launch.Launcher`: the direct launcher of plain Triton JIT kernels (the GDN and KDA training kernels' launches).

CPU: Triton's own specialisation rules that the key relies on (`native_specialize_impl`); over random calls of a
real `triton.jit` kernel, two calls with one launcher key always have one JIT cache key (Triton's binder and
`compute_cache_key`, the key can only be finer); which calls differ in key; the launch sequence with the JIT's
launch and the C launcher replaced by recorders (first call of a key through the JIT, later ones direct with their
own addresses, every fallback to the JIT); the interpreter's kernels and stand-ins launch as before.
GPU (marked gpu): direct launches equal JIT launches bitwise, for a small kernel (new tensors, refilled buffers,
reused addresses, misaligned views) and for GDN's forward and backward through impl="triton".
"""

from __future__ import annotations

import random
import types

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from triton.runtime.jit import JITFunction, compute_cache_key, create_function_from_signature  # noqa: E402

from hybridlm.ops import launch  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@triton.jit
def _axpb(x, y, out, n, s, b, flag, BLOCK: tl.constexpr, SHIFT: tl.constexpr = 0):
    """out = x * s + y + SHIFT (+ b where flag) over n elements."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    r = tl.load(x + i, mask=m, other=0.0).to(tl.float32) * s + tl.load(y + i, mask=m, other=0.0).to(tl.float32)
    r = r + SHIFT
    if flag:
        r = r + b
    tl.store(out + i, r.to(out.dtype.element_ty), mask=m)


needs_jit = pytest.mark.skipif(not isinstance(_axpb, JITFunction),
                               reason="TRITON_INTERPRET=1: triton.jit makes the interpreter's functions")


# ------------------------------------------------------------------------------------------------------------ CPU
def test_triton_specialises_as_the_key_assumes():
    """The rules of Triton's `native_specialize_impl` that `Launcher.key` mirrors (a Triton that changes them fails
    here first)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    spec = lambda v, **kw: native_specialize_impl(CUDABackend, v, False, kw.get("s", True), kw.get("a", True))  # noqa: E731
    assert spec(1) == ("constexpr", 1) and spec(1, s=False) == ("i32", None)
    for v, ty in [(0, "i32"), (16, "i32"), (-16, "i32"), (-2**31, "i32"), (2**31, "i64"), (2**32, "i64"),
                  (-2**31 - 16, "i64"), (2**63, "u64")]:
        assert spec(v) == (ty, "D"), v
    for v, ty in [(2, "i32"), (17, "i32"), (-1, "i32"), (2**31 - 1, "i32"), (2**31 + 1, "i64"), (-2**31 - 1, "i64"),
                  (2**63 - 1, "i64"), (2**63 + 1, "u64")]:
        assert spec(v) == (ty, ""), v
    assert spec(16, a=False) == ("i32", "")
    with pytest.raises(OverflowError):
        spec(2**64)
    assert spec(True) == ("u1", None) and spec(2.5) == ("fp32", None) and spec(None) == ("constexpr", None)
    t = torch.zeros(64, dtype=torch.bfloat16)
    assert t.data_ptr() % 16 == 0
    assert spec(t) == ("*bf16", "D") and spec(t[1:]) == ("*bf16", "") and spec(t[8:]) == ("*bf16", "D")
    assert spec(t, a=False) == ("*bf16", "") and spec(t.float()) == ("*fp32", "D")


def _jit_key(kernel, args, kwargs):
    """Triton's in-memory cache key of a call (as `JITFunction.run` computes it, less the per-device cache)."""
    from triton.backends.nvidia.compiler import CUDABackend

    binder = create_function_from_signature(kernel.signature, kernel.params, CUDABackend)
    _, specialization, options = binder(*args, **kwargs)
    return compute_cache_key({}, specialization, options)


def _pools():
    base = torch.zeros(256, dtype=torch.float32)
    base16 = torch.zeros(256, dtype=torch.bfloat16)
    tensors = [base, base[1:], base[4:], base[8:], torch.zeros(64), base16, base16[1:], base16[8:]]
    return dict(
        x=tensors, y=tensors, out=tensors,
        n=[0, 1, 2, 16, 17, 32, 48, -16, -17, 2**31 - 16, 2**31, 2**31 + 3, 2**63, 2**63 + 16],
        s=[1.5, 2.0, -0.0, 1, 16, 3, True], b=[1, 3, 48, 2**40, None, 0.5], flag=[True, False, 0, 1, 16],
        BLOCK=[64, 128, 64.0, True, 1, "a"], SHIFT=[0, 0.0, -0.0, False, 1, float("nan"), None],
    )


OPTIONS = [{}, {"num_warps": 4}, {"num_warps": 8}, {"num_stages": 2}, {"num_warps": 4.0}]


@needs_jit
def test_one_launcher_key_is_one_jit_key(seed):
    """Random calls of a real kernel, each also with one argument (or the options) swapped for every other value
    of its pool, given positionally or by keyword: any two calls with the same launcher key have the same JIT key."""
    rng = random.Random(seed)
    L = launch.Launcher(_axpb)
    pools = _pools()
    names = list(pools)
    jit_of: dict = {}

    def check(vals, opts):
        npos = rng.randrange(0, len(names) + 1)
        args = tuple(vals[k] for k in names[:npos])
        kwargs = {k: vals[k] for k in names[npos:] if not (k == "SHIFT" and vals[k] == 0 and rng.random() < 0.5)}
        kwargs.update(opts)
        bound = L.key(-1, args, kwargs)
        if bound is not None:
            jk = _jit_key(_axpb, args, kwargs)
            assert jit_of.setdefault(bound[0], jk) == jk, f"one launcher key, two JIT keys: {args} {kwargs} " \
                                                          f"(seed {seed})"

    for _ in range(12):
        base, opts = {k: rng.choice(pools[k]) for k in names}, rng.choice(OPTIONS)
        for k in names:
            for v in pools[k]:
                check({**base, k: v}, opts)
        for o in OPTIONS:
            check(base, o)
    assert len(jit_of) > 100, f"only {len(jit_of)} keys drawn (seed {seed})"


def _key(x, y, out, n, s, b, flag, BLOCK=64, **kw):
    return launch.Launcher(_axpb).key(-1, (x, y, out, n, s, b, flag), dict(BLOCK=BLOCK, **kw))


@needs_jit
def test_what_changes_the_key():
    base = torch.zeros(256)
    x, y, o = base[:64], base[64:128], base[128:]
    ref = _key(x, y, o, 100, 0.5, 3, True)
    assert ref is not None
    k = ref[0]
    same = [_key(torch.zeros(8), y, o, 100, 0.5, 3, True), _key(x, y, o, 99, 0.5, 3, True),  # another aligned address
            _key(x, y, o, 100, 7.0, 5, False), _key(base[4:], y, o, 100, 0.5, 3, True)]  # values; 16-byte aligned view
    for s in same:
        assert s[0] == k
    differ = {"misaligned x": _key(base[1:], y, o, 100, 0.5, 3, True),
              "misaligned out": _key(x, y, base[129:], 100, 0.5, 3, True),
              "dtype": _key(x.double(), y, o, 100, 0.5, 3, True),
              "n divisible by 16": _key(x, y, o, 96, 0.5, 3, True), "n == 1": _key(x, y, o, 1, 0.5, 3, True),
              "n past i32": _key(x, y, o, 2**31 + 1, 0.5, 3, True), "s an int": _key(x, y, o, 100, 2, 3, True),
              "b None": _key(x, y, o, 100, 0.5, None, True), "flag an int": _key(x, y, o, 100, 0.5, 3, 0),
              "constexpr": _key(x, y, o, 100, 0.5, 3, True, BLOCK=128),
              "constexpr class": _key(x, y, o, 100, 0.5, 3, True, BLOCK=64.0),
              "constexpr default": _key(x, y, o, 100, 0.5, 3, True, SHIFT=1),
              "constexpr -0.0": _key(x, y, o, 100, 0.5, 3, True, SHIFT=-0.0),
              "option": _key(x, y, o, 100, 0.5, 3, True, num_warps=8)}
    for what, got in differ.items():
        assert got is not None and got[0] != k, what
    assert _key(x, y, o, 100, 0.5, 3, True, SHIFT=0.0)[0] != differ["constexpr -0.0"][0]
    # the launcher's arguments: tensors as addresses, everything else in its place
    assert ref[1] == [x.data_ptr(), y.data_ptr(), o.data_ptr(), 100, 0.5, 3, True, 64, 0]


@needs_jit
def test_calls_the_key_does_not_cover_return_none():
    base = torch.zeros(64)
    L = launch.Launcher(_axpb)
    args = (base, base, base, 10, 0.5, 3, True)
    assert L.key(-1, args, {"BLOCK": 64}) is not None
    assert L.key(0, args, {"BLOCK": 64}) is None  # tensors off the current device
    assert L.key(-1, args, {}) is None  # BLOCK missing: the JIT raises
    assert L.key(-1, args, {"BLOCK": 64, "n": 3}) is None  # n given twice
    assert L.key(-1, (base, base, base, 2**64, 0.5, 3, True), {"BLOCK": 64}) is None  # the JIT raises
    assert L.key(-1, (base, base, base, (1, 2), 0.5, 3, True), {"BLOCK": 64}) is None  # a tuple
    assert L.key(-1, args, {"BLOCK": tl.constexpr(64)}) is None  # a constexpr of another class
    assert L.key(-1, args + (64, 0, 1), {}) is None  # too many arguments


class _Compiled:
    """A CompiledKernel stand-in."""


@pytest.fixture
def recorded(monkeypatch):
    """_axpb with its JIT launch recorded (returning a fresh stand-in each call), `direct_launch` giving a recorder
    of the C launcher's calls, the current device -1 (CPU tensors are on it) and stream 77."""
    log = []

    def jit_run(*args, grid, warmup, **kwargs):
        log.append(("jit", grid, args, kwargs))
        return _Compiled()

    def direct(compiled):
        return lambda grid, stream, args: log.append(("direct", grid, stream, tuple(args), compiled))

    kernel = JITFunction(_axpb.fn)
    monkeypatch.setattr(kernel, "run", jit_run)
    monkeypatch.setattr(launch, "direct_launch", direct)
    monkeypatch.setattr(launch, "_DEVICE_STREAM", [lambda: -1, lambda dev: 77])
    return types.SimpleNamespace(kernel=kernel, L=launch.launcher(kernel), log=log)


@needs_jit
def test_first_launch_through_the_jit_then_direct(recorded):
    L, log = recorded.L, recorded.log
    a = [torch.zeros(64) for _ in range(3)]
    first = L[(4,)](*a, 64, 0.5, 3, True, BLOCK=16, num_warps=2)
    assert log[-1][0] == "jit" and log[-1][3] == dict(BLOCK=16, num_warps=2) and log[-1][1] == (4,)
    b = [torch.zeros(64) for _ in range(3)]
    got = L[(4, 2)](*b, n=64, s=0.25, b=5, flag=False, BLOCK=16, num_warps=2)
    assert got is first
    assert log[-1] == ("direct", (4, 2, 1), 77, (*[t.data_ptr() for t in b], 64, 0.25, 5, False, 16, 0), first)
    L[(4,)](*b, 64, 0.5, 3, True, BLOCK=32, num_warps=2)  # another constexpr: a key of its own, first through the JIT
    assert log[-1][0] == "jit"
    L[(4,)](b[0][1:], *b[1:], 64, 0.5, 3, True, BLOCK=16, num_warps=2)  # misaligned: another key
    assert log[-1][0] == "jit"
    L[(4,)](b[0][1:], *b[1:], 64, 0.5, 3, True, BLOCK=16, num_warps=2)
    assert log[-1][0] == "direct" and log[-1][4] is not first  # the kernel the JIT picked for the misaligned call
    assert len(log) == 5


@needs_jit
def test_fallbacks_to_the_jit(recorded, monkeypatch):
    L, log, kernel = recorded.L, recorded.log, recorded.kernel
    a = [torch.zeros(64) for _ in range(3)]
    call = lambda grid=(4,): L[grid](*a, 64, 0.5, 3, True, BLOCK=16)  # noqa: E731
    call(), call()
    assert [e[0] for e in log] == ["jit", "direct"]
    with monkeypatch.context() as m:
        m.setattr(launch, "jit_is_plain", lambda: False)  # a hook, debug mode or instrumentation
        call()
    monkeypatch.setattr(launch, "_DEVICE_STREAM", [lambda: 0, lambda dev: 77])  # tensors off the current device
    call()
    monkeypatch.setattr(launch, "_DEVICE_STREAM", [lambda: -1, lambda dev: 77])
    call(lambda meta: (4,))  # a callable grid
    kernel.pre_run_hooks.append(lambda *a, **k: None)
    call()
    kernel.pre_run_hooks.clear()
    scope = {"C": 1}
    kernel.used_global_vals[("C", id(scope))] = (1, scope)
    call()
    assert log[-1][0] == "direct"
    scope["C"] = 2  # a global the kernel read changed: the JIT raises for it
    call()
    assert [e[0] for e in log] == ["jit", "direct", "jit", "jit", "jit", "jit", "direct", "jit"]


@needs_jit
def test_a_kernel_direct_launch_refuses_stays_on_the_jit(recorded, monkeypatch):
    monkeypatch.setattr(launch, "direct_launch", lambda compiled: None)
    a = [torch.zeros(64) for _ in range(3)]
    for _ in range(3):
        recorded.L[(4,)](*a, 64, 0.5, 3, True, BLOCK=16)
    assert [e[0] for e in recorded.log] == ["jit"] * 3


@needs_jit
def test_plans_are_bounded(recorded):
    a = [torch.zeros(64) for _ in range(3)]
    for block in range(launch.MAX_KEYS + 10):
        recorded.L[(1,)](*a, 64, 0.5, 3, True, BLOCK=block)
    assert len(recorded.L._plans) == launch.MAX_KEYS


def test_interpreter_and_stand_ins_launch_as_before(monkeypatch):
    """The interpreter's function (TRITON_INTERPRET=1) and any object that is not a plain JIT kernel get
    kernel[grid] itself; the interpreter still computes on the CPU."""
    from triton.runtime.interpreter import InterpretedFunction

    f = InterpretedFunction(_axpb.fn)
    L = launch.launcher(f)
    assert L._names is None and id(f) not in launch._LAUNCHERS
    monkeypatch.setattr(launch, "_device_stream", lambda: pytest.fail("the interpreter path looked up a device"))
    x, y = torch.randn(100), torch.randn(100)
    out = torch.full((100,), float("nan"))
    L[(2,)](x, y, out, 100, 0.5, 3, 1, BLOCK=64, SHIFT=1)  # flag an int: the interpreter takes no bool argument
    torch.testing.assert_close(out, x * 0.5 + y + 4, rtol=1e-6, atol=1e-6)
    calls = []

    class StandIn:
        def __getitem__(self, grid):
            return lambda *a, **kw: calls.append((grid, a, kw))

    stand_in = StandIn()
    launch.launcher(stand_in)[(3,)](1, k=2)
    assert calls == [((3,), (1,), {"k": 2})]


@needs_jit
def test_launcher_is_looked_up_per_kernel():
    assert launch.launcher(_axpb) is launch.launcher(_axpb)
    other = JITFunction(_axpb.fn)
    assert launch.launcher(other) is not launch.launcher(_axpb) and launch.launcher(other).kernel is other


# ------------------------------------------------------------------------------------------------------------ GPU
def _counting(monkeypatch, kernel) -> list:
    """Record kernel's launches through the JIT (its `run` still the JIT's)."""
    n = []

    def run(*args, **kwargs):
        n.append(1)
        return JITFunction.run(kernel, *args, **kwargs)

    monkeypatch.setattr(kernel, "run", run)
    return n


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_direct_launches_equal_jit_launches(monkeypatch, dtype, seed):
    kernel = JITFunction(_axpb.fn)
    jit_launches = _counting(monkeypatch, kernel)
    L = launch.launcher(kernel)
    n = 1000
    grid = (triton.cdiv(n, 128),)

    def both(x, y, out, s, b, flag):
        ref = torch.full_like(out, float("nan"))
        kernel[grid](x, y, ref, n, s, b, flag, BLOCK=128)
        out.fill_(float("nan"))
        L[grid](x, y, out, n, s, b, flag, BLOCK=128)
        bits = torch.int32 if dtype == torch.float32 else torch.int16  # NaN tails compared as bits, not values
        assert torch.equal(out.view(bits), ref.view(bits)), f"direct != JIT ({dtype}, seed {seed})"

    r = lambda: torch.randn(n + 8, device="cuda", dtype=dtype)  # noqa: E731
    x, y, out = r(), r(), r()
    both(x, y, out, 0.5, 3, True)  # the key's first launch: through the JIT
    both(x, y, out, 0.25, 7, False)  # same buffers, other values
    x.normal_(), y.normal_()
    both(x, y, out, 0.5, 3, True)  # refilled buffers
    del x, y, out
    x, y, out = r(), r(), r()  # new tensors (the caching allocator hands the freed blocks back)
    both(x, y, out, 1.5, -2, True)
    assert len(jit_launches) == 4 + 1, "a direct launch went through the JIT"
    both(x[1:], y, out[3:], 0.5, 3, True)  # misaligned views: a key of their own (first through the JIT)
    both(x[1:], y, out[3:], 0.75, 3, False)  # then direct, with the kernel compiled for them
    assert len(jit_launches) == 6 + 2
    plans = list(L._plans.values())
    assert len(plans) == 2 and all(plans), "a key without a direct launch"


def _gdn_inputs(dtype, seed, misaligned: bool):
    """Inputs of a varlen GDN call (two documents, GVA 2 -> 4 heads, K = V = 128, an fp32 initial state); with
    misaligned each of q, k, v, g, beta a contiguous view one element into a larger buffer (2 or 4 bytes off)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    B, T, H, HV, K, V = 1, 1000, 2, 4, 128, 128
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731

    def put(t):
        if not misaligned:
            return t.to(dtype)
        buf = torch.empty(t.numel() + 1, device="cuda", dtype=dtype)
        buf[1:].copy_(t.flatten())
        return buf[1:].view(t.shape)

    x = dict(q=put(r(B, T, H, K)), k=put(r(B, T, H, K)), v=put(r(B, T, HV, V)),
             g=put(torch.nn.functional.logsigmoid(r(B, T, HV) + 3)),
             beta=put(torch.rand(B, T, HV, device="cuda", generator=gen)))
    x["initial_state"] = r(2, HV, K, V) * 0.1
    return x, torch.tensor([0, 611, T], device="cuda", dtype=torch.int32)


def _gdn_fwd_bwd(x, cu, seed):
    """o, ht and the gradients of every input, for a fixed random do and dht."""
    from hybridlm.ops import gated_delta_rule

    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}
    o, ht = gated_delta_rule(**leaves, output_final_state=True, cu_seqlens=cu, use_qk_l2norm=True, impl="triton")
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    do = torch.randn(o.shape, device="cuda", generator=gen).to(o.dtype)
    dht = torch.randn(ht.shape, device="cuda", generator=gen)
    torch.autograd.backward((o, ht), (do, dht))
    return [o, ht] + [leaves[n].grad for n in x]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("misaligned", [False, True])
def test_gdn_forward_backward_direct_equals_jit(monkeypatch, dtype, misaligned, seed):
    """GDN's forward and backward through impl="triton" (the Triton state-gradient pass, not the Gluon chain) with
    the direct launches equal the same calls through the JIT bitwise, on three fresh input sets (each allocated
    where the previous one was freed), outputs NaN-poisoned; after the first set, none of the seven kernels
    launches through the JIT."""
    from hybridlm.ops.triton import chunk_bwd, chunk_out, gdn, state_pass, ut_solve, wy

    monkeypatch.setattr(gdn.TUNE, "gluon_chain", False)
    monkeypatch.setattr(gdn, "POISON", True)
    kernels = [wy._wu_fwd, state_pass._recur_fwd, ut_solve._kkt_solve, chunk_out._out_fwd_raw, state_pass._recur_bwd,
               chunk_bwd._chunk_bwd_state_blk, chunk_bwd._chunk_bwd_out_blk]
    jit = {k.__name__: _counting(monkeypatch, k) for k in kernels}
    for trial in range(3):
        x, cu = _gdn_inputs(dtype, seed + trial, misaligned)
        with monkeypatch.context() as m:
            m.setattr(launch, "jit_is_plain", lambda: False)  # every launch through the JIT
            ref = _gdn_fwd_bwd(x, cu, seed + trial)
        before = {name: len(n) for name, n in jit.items()}
        got = _gdn_fwd_bwd(x, cu, seed + trial)
        for name, a, b in zip(["o", "ht", *x], got, ref, strict=True):
            assert torch.equal(a, b), (f"{name}: direct != JIT (trial {trial}, {dtype}, misaligned={misaligned}, "
                                       f"seed {seed})")
        if trial:
            through_jit = [name for name, n in jit.items() if len(n) != before[name]]
            assert not through_jit, f"launched through the JIT on a repeated key: {through_jit} (seed {seed})"
        del x, ref, got
