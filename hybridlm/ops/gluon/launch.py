"""Launching compiled Gluon kernels without the JIT's per-call Python, and a cache of TMA tensor maps.

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
"""

from __future__ import annotations

import types
from collections import OrderedDict

try:  # Triton's runtime settings (3.4 on); an older Triton has no Gluon API, so nothing here runs with it
    from triton import knobs
except ImportError:  # pragma: no cover - depends on the installed Triton
    knobs = None

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
