"""Launching compiled Triton and Gluon kernels without the JIT's per-call Python, and a cache of TMA tensor maps.

A launch through the JIT (`kernel[grid](*args)`, Triton 3.6) binds and specialises every argument in Python,
computes the cache key, builds the launch metadata for the profiler hooks, and encodes a CUtensorMap for every TMA
descriptor argument (`cuTensorMapEncodeTiled` behind `fill_tma_descriptor`, through a Python wrapper around the C
launcher), on every launch: tens of microseconds of host time a launch.

Non-standard here:
- `direct_launch` takes the CompiledKernel that the first JIT launch of a call signature returned and keeps its C
  launcher (the one under the tensor-descriptor wrapper), its function handle and packed metadata. The caller then
  passes the argument list the C launcher parses: pointers as ints, each TMA descriptor expanded to (tensor map,
  *shape, *strides) as the wrapper would, constexprs in their places (parsed, not passed). It is equivalent to the
  JIT launch only while the JIT would pick the same compiled kernel and would call no hook: `jit_is_plain` says
  whether Triton's launch hooks, debug mode or instrumentation are on (then the caller keeps the JIT launch), and
  the caller keys its cache on everything the JIT specialises on (dtypes, constexprs, options, the integer
  arguments, 16-byte alignment of every pointer).
- `tensor_map` encodes a TMA tensor map once per (address, geometry) and keeps it in a bounded LRU: a map is a pure
  function of the global address, shape, strides, box, element type and swizzle, so one encoded for storage that
  was freed and reallocated at the same address with the same geometry is the same map. A map holds no reference
  to the tensor, so the cache pins no memory.
If this Triton's launcher is not the one this is written against (no C launcher under the wrapper, global or
profile scratch, no tensor-descriptor metadata), `direct_launch` returns None and the caller keeps the JIT launch.
- `Launcher` / `launcher(kernel)` does the same for any plain Triton JIT kernel (no descriptor arguments), with the
  JIT's call syntax (`launcher(kernel)[grid](*args, **kwargs)`): a plan per key of everything the JIT specialises
  on, its first launch through the JIT. The key is finer than the JIT's, never coarser (see `Launcher`).
"""

from __future__ import annotations

import types
from collections import OrderedDict

import torch

try:  # Triton's runtime settings (3.4 on); an older Triton has no Gluon API, so nothing here runs with it
    from triton import knobs
except ImportError:  # pragma: no cover - depends on the installed Triton
    knobs = None
try:
    from triton.runtime.jit import JITFunction
except ImportError:  # pragma: no cover - depends on the installed Triton
    JITFunction = None

MAX_MAPS = 256  # tensor maps kept (a prefill engine's layers each reuse a few addresses; 128 B a map)

# Triton's TMA element-type enum differs between the compiler's metadata and the host encoder (as in
# triton.backends.nvidia.driver.TMA_DTYPE_DEVICE_TO_HOST)
_DEVICE_TO_HOST_ELEM = {8: 10, 9: 8, 10: 9}


class TmaSpec:
    """Everything a tensor map encodes except the address: the box, swizzle and element type the compiled kernel
    expects (its `tensordesc_meta` entry) and the 2-D tensor's shape and strides. Compared and hashed by identity, so
    a cache key holding it keeps it alive and unique; equal specs of two call signatures get maps of their own.
    `tail`: the shape and strides the launcher takes after the map."""

    __slots__ = ("swizzle", "elem_size", "elem_type", "block", "shape", "strides", "tail")

    def __init__(self, meta: dict, shape: tuple[int, ...], strides: tuple[int, ...]):
        self.swizzle = int(meta["swizzle"])
        self.elem_size = int(meta["elem_size"])
        self.elem_type = _DEVICE_TO_HOST_ELEM.get(int(meta["elem_type"]), int(meta["elem_type"]))
        self.block = [int(b) for b in meta["block_size"]]
        self.shape = [int(s) for s in shape]
        self.strides = [int(s) for s in strides]
        self.tail = (*self.shape, *self.strides)


_MAPS: OrderedDict = OrderedDict()


def _encode(ptr: int, spec: TmaSpec):
    from triton.runtime import driver

    return driver.active.utils.fill_tma_descriptor(ptr, spec.swizzle, spec.elem_size, spec.elem_type, spec.block,
                                                   spec.shape, spec.strides, 0)  # 0: zero padding


def tensor_map(ptr: int, spec: TmaSpec):
    """The CUtensorMap of the tensor at device address ptr laid out as `spec`, encoded at its first use."""
    key = (ptr, spec)
    m = _MAPS.get(key)
    if m is None:
        m = _MAPS[key] = _encode(ptr, spec)
        if len(_MAPS) > MAX_MAPS:
            _MAPS.popitem(last=False)
    else:
        _MAPS.move_to_end(key)
    return m


def jit_is_plain() -> bool:
    """True when a JIT launch would call no launch hook and compile nothing else than what it compiled before:
    no launch hooks registered (a profiler's), Triton's debug mode and instrumentation off."""
    rt = knobs.runtime
    return (_no_hook(rt.launch_enter_hook) and _no_hook(rt.launch_exit_hook) and not rt.debug
            and not knobs.compilation.instrumentation_mode)


def _no_hook(h) -> bool:
    """None or an empty HookChain; anything else (a hook set as a plain function) counts as a hook."""
    if h is None:
        return True
    calls = getattr(h, "calls", None)
    return isinstance(calls, list) and not calls


class DirectLaunch:
    """A compiled kernel's C launcher with its function handle and packed metadata bound. `metas`: the kernel's
    tensor-descriptor metadata (`tensordesc_meta`), one dict per descriptor argument in order."""

    __slots__ = ("_launch", "_function", "_packed", "_coop", "_pdl", "metas")

    def __init__(self, launch, function, packed, coop, pdl, metas):
        self._launch, self._function, self._packed = launch, function, packed
        self._coop, self._pdl, self.metas = coop, pdl, metas

    def __call__(self, grid: tuple[int, int, int], stream: int, args) -> None:
        """Launch on `stream` (a raw CUDA stream handle) with the launcher's argument list (module docstring); no
        scratch buffers, no launch metadata, no hooks."""
        self._launch(grid[0], grid[1], grid[2], stream, self._function, self._coop, self._pdl, None, None,
                     self._packed, None, None, None, *args)


def _unwrapped(launch):
    """The C launcher under Triton's tensor-descriptor wrapper (the closure variable `launcher` of
    `wrap_handle_tensordesc`'s inner function), or None."""
    code = getattr(launch, "__code__", None)
    if code is None or not launch.__closure__:
        return None
    cells = dict(zip(code.co_freevars, launch.__closure__))
    cell = cells.get("launcher")
    return None if cell is None else cell.cell_contents


def _is_c_launcher(f) -> bool:
    """Callable and not a Python function: the wrapper (a Python function) takes descriptor objects, the C launcher
    takes what they expand to."""
    return callable(f) and not isinstance(f, (types.FunctionType, types.MethodType))


def direct_launch(compiled) -> DirectLaunch | None:
    """The direct launch of a CompiledKernel (loaded on the current device: its `run` loads it), or None when
    this Triton's launcher is not the one this is written against."""
    try:
        run = compiled.run
        md = compiled.metadata
        if md.global_scratch_size or md.profile_scratch_size:
            return None
        sig = list(compiled.src.signature.values())
        n_desc = sum(isinstance(s, str) and s.startswith("tensordesc") for s in sig)
        launch = run.launch
        metas = ()
        if n_desc:
            metas = tuple(getattr(md, "tensordesc_meta", None) or ())
            if len(metas) != n_desc or any(m is None or m.get("fp4_padded") for m in metas):
                return None
            launch = _unwrapped(launch)
        if not _is_c_launcher(launch) or compiled.function is None:  # None, or a Python wrapper we do not know
            return None
        return DirectLaunch(launch, compiled.function, compiled.packed_metadata, bool(run.launch_cooperative_grid),
                            bool(run.launch_pdl), metas)
    except (AttributeError, TypeError, KeyError):
        return None


def clear() -> None:
    """Drop every cached tensor map (tests)."""
    _MAPS.clear()


# ------------------------------------------------------------------------------------- plain Triton JIT kernels
# What Triton 3.6's JIT specialises a call on (`JITFunction.run`: the binder from `create_function_from_signature`,
# then `compute_cache_key`; per argument `native_specialize_impl`, with the NVIDIA backend's rules):
# - the current device (a cache per device) and the options (every keyword that is not a parameter, as given);
# - a constexpr parameter: its value (the key holds str() of it, so True, 1 and 1.0 differ, as do 0.0 and -0.0);
# - a tensor: its dtype and whether data_ptr() % 16 == 0 (unless do_not_specialize(_on_alignment));
# - an int: 1 becomes a constexpr (unless do_not_specialize); else its type by range (i32 for [-2^31, 2^31),
#   i64 below 2^63, u64 below 2^64, larger ones raise) and whether it is divisible by 16;
# - a bool (u1) and a float (fp32): the type only, the value is passed; None: a constexpr.
# The key below holds all of these, some more finely than the JIT (an int's ==1 and divisibility even where the
# kernel does not specialise on them): a finer key only costs a JIT launch per extra key, each of which returns the
# kernel the JIT picked for that very call. Anything else (tuples, descriptors, other classes, a callable grid)
# launches through the JIT every time.

MAX_KEYS = 64  # specialisations kept per kernel (a model's layers share a few; ints are keyed by class, not value)

_MISSING = object()
_Tensor, _Parameter = torch.Tensor, torch.nn.Parameter
_I32, _I64, _U64 = 1 << 31, 1 << 63, 1 << 64
_DEVICE_STREAM: list = []  # Triton's active driver's (current device, current stream), looked up once


def _device_stream():
    if not _DEVICE_STREAM:
        from triton.runtime import driver

        _DEVICE_STREAM.extend((driver.active.get_current_device, driver.active.get_current_stream))
    return _DEVICE_STREAM


def current_stream(index: int) -> int:
    """The current stream of device `index` as a raw handle, as the JIT looks it up."""
    return _device_stream()[1](index)


def direct_ok(dev: torch.device) -> bool:
    """Whether a call on dev may take a direct launch: the JIT would launch on dev (the current device) and call no
    hook (`jit_is_plain`)."""
    return jit_is_plain() and _device_stream()[0]() == dev.index


def aligned(*ptrs: int) -> bool:
    """Every address 16-byte aligned (the JIT specialises pointers on it)."""
    acc = 0
    for p in ptrs:
        acc |= p
    return acc & 15 == 0


def _int_class(v: int):
    """An int argument's share of the key: 1 (a constexpr to the JIT), else its width class with its divisibility
    by 16 in the lowest bit; None past u64 (the JIT raises)."""
    if v == 1:
        return 1
    d = v & 15 == 0  # two's complement: equals the JIT's v % 16 == 0 for negative v too
    if -_I32 <= v < _I32:
        return 2 + d
    if -_I64 <= v < _I64:
        return 4 + d
    if 0 <= v < _U64:
        return 6 + d
    return None


def _launchable(kernel) -> bool:
    """A plain `triton.jit` kernel whose launch is the `JITFunction.run` this is written against; not the
    interpreter's function (TRITON_INTERPRET=1), an autotuner or heuristics wrapper, or a test's stand-in."""
    return JITFunction is not None and isinstance(kernel, JITFunction) and type(kernel).run is JITFunction.run


class Launcher:
    """`kernel[grid](*args, **kwargs)` with the JIT's per-call Python skipped once a call's specialisation was
    launched: `Launcher(kernel)[grid](...)` takes the same arguments and returns what the JIT launch returns (the
    CompiledKernel). Per key (module section above) the first launch goes through the JIT and keeps its
    CompiledKernel's C launcher (`direct_launch`); a later call with that key passes it the argument list (tensors
    as their addresses) on the current stream. Launches through the JIT: any kernel that is not plain
    (`_launchable`), Triton hooks, debug or instrumentation on (`jit_is_plain`), a pre-run hook or debug on the
    kernel, a tensor off the current device, an argument or grid the key does not cover, a kernel whose compiled
    form `direct_launch` does not take, or a global it read that changed since (the JIT raises for that)."""

    __slots__ = ("kernel", "_names", "_index", "_defaults", "_const", "_plans")

    def __init__(self, kernel):
        self.kernel = kernel
        self._names = None  # None: every launch goes through kernel[grid]
        self._plans: dict = {}  # key -> (DirectLaunch, CompiledKernel), or False: the JIT launches it
        if _launchable(kernel):
            params = kernel.params
            self._names = tuple(p.name for p in params)
            self._index = {p.name: i for i, p in enumerate(params)}
            self._defaults = tuple(p.default if p.has_default else _MISSING for p in params)
            self._const = tuple(p.is_constexpr for p in params)

    def __getitem__(self, grid):
        if self._names is None:
            return self.kernel[grid]
        return lambda *args, **kwargs: self.run(grid, args, kwargs)

    def run(self, grid, args: tuple, kwargs: dict):
        k = self.kernel
        if not jit_is_plain() or k.pre_run_hooks or k.debug or callable(grid):
            return k[grid](*args, **kwargs)
        dev = _device_stream()[0]()
        bound = self.key(dev, args, kwargs)
        if bound is None:
            return k[grid](*args, **kwargs)
        key, dargs = bound
        try:
            plan = self._plans.get(key)
        except TypeError:  # an unhashable option value
            return k[grid](*args, **kwargs)
        if plan is None:
            compiled = k[grid](*args, **kwargs)
            if compiled is not None:
                self._keep(key, compiled)
            return compiled
        if plan is False or not _globals_unchanged(k):
            return k[grid](*args, **kwargs)
        n = len(grid)
        plan[0]((grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1), _DEVICE_STREAM[1](dev), dargs)
        return plan[1]

    def key(self, dev: int, args: tuple, kwargs: dict):
        """(key, the C launcher's argument list) of a call on device dev, or None when the JIT must launch it."""
        names, index = self._names, self._index
        n = len(args)
        if n > len(names):
            return None
        parts = [dev]
        app = parts.append
        for name, v in kwargs.items():
            i = index.get(name)
            if i is None:  # an option
                app((name, v.__class__, v))
            elif i < n:  # given twice: the JIT raises
                return None
        vals = list(args)
        for i in range(n, len(names)):
            v = kwargs.get(names[i], _MISSING)
            if v is _MISSING:
                v = self._defaults[i]
                if v is _MISSING:
                    return None
            vals.append(v)
        i = -1
        for v, const in zip(vals, self._const):
            i += 1
            cls = v.__class__
            if const:  # the class with the value (the JIT's key holds str(): True, 1 and 1.0 differ)
                if cls is int or cls is bool or cls is str or v is None:
                    app((cls, v))
                elif cls is float:  # its exact bits: -0.0 and NaN are keys of their own, as in the JIT's str()
                    app((cls, v.hex()))
                else:
                    return None
            elif cls is _Tensor or cls is _Parameter:
                if v.get_device() != dev:
                    return None
                p = v.data_ptr()
                app((v.dtype, p & 15 == 0))
                vals[i] = p
            elif cls is int:
                c = _int_class(v)
                if c is None:
                    return None
                app(c)
            elif cls is float or cls is bool or v is None:
                app(cls)
            else:
                return None
        return tuple(parts), vals

    def _keep(self, key, compiled) -> None:
        d = direct_launch(compiled)
        self._plans[key] = (d, compiled) if d is not None else False
        if len(self._plans) > MAX_KEYS:
            del self._plans[next(iter(self._plans))]


def _globals_unchanged(kernel) -> bool:
    """The JIT's check that the globals the kernel read when compiled still hold those values."""
    for (name, _), (val, scope) in kernel.used_global_vals.items():
        if scope.get(name, _MISSING) != val:
            return False
    return True


_LAUNCHERS: dict[int, Launcher] = {}  # id(kernel) -> its Launcher (which holds the kernel, so the id stays its own)


def launcher(kernel) -> Launcher:
    """The Launcher of a plain JIT kernel, made at its first use; for anything else (the interpreter's function, a
    test's stand-in) a Launcher that passes every launch to kernel[grid]. Looked up per launch, so a launch site
    reads the kernel from its module at call time (a patched kernel is the one launched)."""
    got = _LAUNCHERS.get(id(kernel))
    if got is not None and got.kernel is kernel:
        return got
    got = Launcher(kernel)
    if got._names is not None:
        _LAUNCHERS[id(kernel)] = got
    return got
