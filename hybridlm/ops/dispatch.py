"""The one dispatch path of the delta-rule family's public ops (`hybridlm.ops.recurrence`): the inputs validated
once into `Inputs`, a table of backends (`BACKENDS`), one function that picks one (`choose`, also behind
`resolve_impl` for the other ops and for the multi-token decode), one log line per new choice (`log_choice`, which
the layer glue's choice logs through too).

Non-standard here:
- A backend states up front what it covers: the ops it has a kernel for, the device types impl="auto" takes it on,
  whether it has a backward (`autograd`) and whether it traces under torch.compile. Then `supports(inputs)` judges
  the inputs themselves: None, or why not in one line. impl="auto" walks the table in order and takes the first
  backend that covers the call and supports its inputs. A backend passed over for a reason is named in the log
  line; one that does not cover the call (another device, gradients needed from a forward-only kernel) is not: that
  is the expected case, not a fallback. An explicit impl asks its backend alone and raises why not in one line.
- The casts the ops document happen here, after the checks and before any backend: q and k to v's dtype, a
  narrower initial_state up to the state dtype (float32; float64 for float64 v), cu_seqlens to an int32 tensor
  with a version counter and its host copy recorded (`hybridlm.ops.offsets`), so that int64 or inference-mode
  offsets are read back once a call, not once per kernel.
- KDA's gate from raw inputs (`A_log`, `dt_bias`, `lower_bound`; `hybridlm.ops.kda_gate`) is checked in
  `prepare`. The Triton backend takes it inside its kernels (`hybridlm.ops.triton.kda`: no launch of its own
  either way); for the others `execute` computes the log-decay in PyTorch (compute dtype, under autograd) first.
- A state pool is checked here once. A backend that reads and writes the pool's rows itself (`pool_in_place`)
  gets it as it is; any other gets the rows gathered as initial states, and its final states are scattered back.
- The checks and the choice are remembered per call signature (`_signature`: per tensor argument its shape, dtype,
  device and requires_grad; the op, impl, chunk_size, lower_bound, the flags and whether grad mode is on), so a
  repeat call (every layer of every step of inference) skips them: the checks read nothing else of a call, and a
  backend's `supports` judges what the signature holds. The offsets' values are not in the signature (a server's
  batches differ): they are checked on every call, from the host copy `hybridlm.ops.offsets` keeps. A remembered
  "auto" choice is used while its log line is in `_LOGGED`, so forgetting the logged choices (tests, the training
  bench) makes the next call choose and log again. Nothing is remembered while torch.compile traces.
- The multi-token decode on a state pool (`DECODE_OPS`, `hybridlm.ops.decode`) has backends of its own in the
  table (`decode=True`: "triton", the kernel, and "torch", its PyTorch path), apart from the recurrences' (its
  impls are "auto", "triton", "torch"; theirs "auto", "gluon", "triton", "chunk", "naive"). Its callers check the
  inputs and run the backend themselves (`resolve_impl`); "auto" takes the kernel on CUDA, or on any device under
  TRITON_INTERPRET=1 (`auto_interpret`: the interpreter was asked for), else the PyTorch path.
- Every impl="auto" choice of `hybridlm.ops` is logged by `log_choice`, once per (op, device type, choice, reasons
  others were passed over), into the one `_LOGGED` (`forget_logged` empties it); nothing is logged while
  torch.compile traces (a log call breaks a compiled graph).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch
import torch.utils.checkpoint

from . import context_parallel
from .chunk import recurrence_chunk
from .kda_gate import check_kda_gate, kda_gate
from .naive import recurrence_naive
from .norm import l2norm
from .offsets import host_offsets, remember_offsets
from .validate import (
    Dims,
    check_cu_seqlens,
    check_recurrence_inputs,
    check_state_dtype,
    check_state_pool,
    state_dtype,
)

log = logging.getLogger("hybridlm.ops")

# op name -> callable with the public signature; filled by hybridlm.ops.triton when its kernels import.
TRITON_KERNELS: dict[str, Callable] = {}
# op name -> (q, v) -> None when the kernel takes these inputs, else the reason it does not
TRITON_SUPPORTS: dict[str, Callable] = {}
# ops with a forward-only Gluon kernel
GLUON_OPS = ("gated_delta_rule", "kda")
# the multi-token decode on a state pool (the custom ops of hybridlm.ops.triton), run by the decode backends alone
DECODE_OPS = ("gdn_decode", "kda_decode")
# (op, device type, choice, reasons others were passed over): the choices impl="auto" has logged (`log_choice`)
_LOGGED: set[tuple] = set()


@dataclass(slots=True)
class Inputs:
    """One call of a public op, validated and cast (module docstring). `resolve_impl` fills only op, q, v, device
    and needs_grad, for the choice alone. Not frozen: one is built on every call, and a frozen dataclass sets each
    field through object.__setattr__ (microseconds a call); nothing changes one (`dataclasses.replace` makes
    another)."""

    op: str
    q: torch.Tensor | None  # [B, T, H, K] in v's dtype
    v: torch.Tensor | None  # [B, T, HV, V]
    device: torch.device  # where the call runs ("auto" looks at its type only)
    needs_grad: bool  # gradients will flow through this call
    k: torch.Tensor | None = None  # [B, T, H, K] in v's dtype
    g: torch.Tensor | None = None  # [B, T, HV] or [B, T, HV, K] log-decay, as given
    beta: torch.Tensor | None = None  # [B, T, HV], as given
    A_log: torch.Tensor | None = None  # [HV]: with it (or lower_bound) g is the raw gate input (`kda_gate`)
    dt_bias: torch.Tensor | None = None  # [HV * K] added to the raw gate input
    lower_bound: float | None = None  # the sigmoid form of the gate, bounded below by it
    delta: bool = True  # delta-rule write (else Hebbian)
    dims: Dims | None = None
    scale: float | None = None
    initial_state: torch.Tensor | None = None  # [N, HV, K, V] in the state dtype
    output_final_state: bool = False
    cu_seqlens: torch.Tensor | None = None  # int32 [N+1], not an inference tensor, host copy recorded
    offsets: list[int] | None = None  # cu_seqlens on the host
    use_qk_l2norm: bool = False
    chunk_size: int = 64
    recompute: bool = False
    state_pool: torch.Tensor | None = None  # [P, HV, K, V] in the state dtype
    state_indices: torch.Tensor | None = None  # int32/int64 [N]


@dataclass(frozen=True)
class Backend:
    """One way to run the ops (module docstring). An explicit impl names a backend; impl="auto" walks `BACKENDS`."""

    name: str  # the impl that asks for it
    label: str  # how a log line or an error names it
    run: Callable[[Inputs], tuple] | None  # (o, final state or None) of prepared inputs with T > 0; None: the
    # callers run it themselves (`resolve_impl`)
    ops: Callable[[], Collection[str]] | None = None  # ops it has a kernel for (read at each call); None: all
    unknown_op: Callable[[str], Exception] | None = None  # the error of an explicit impl for another op
    supports: Callable[[Inputs], str | None] = lambda x: None  # None, or why it does not take these inputs
    auto: bool = True  # impl="auto" considers it
    auto_devices: tuple[str, ...] | None = None  # device types "auto" takes it on (None: any)
    auto_interpret: bool = False  # "auto" takes it on any device under TRITON_INTERPRET=1 too
    autograd: bool = True  # has a backward (a forward-only backend is asked only where no gradient is needed)
    traceable: bool = True  # runs under torch.compile ("auto" skips it while compiling otherwise)
    pool_in_place: bool = False  # reads and writes state_pool's rows itself
    decode: bool = False  # runs the decode ops (DECODE_OPS) and no other; the other backends never run them


def _needs_grad(*xs: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in xs)


def _versioned(cu_seqlens):
    """An inference tensor (no version counter, so never recorded by `host_offsets`) as a normal copy, so that the
    offsets are read once per call and the copy may be saved for a backward; anything else as it is."""
    if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.is_inference():
        with torch.inference_mode(False):
            return cu_seqlens.clone()
    return cu_seqlens


def _int32_offsets(cu_seqlens: torch.Tensor | None) -> torch.Tensor | None:
    """Validated offsets as the int32 tensor the kernels read, the host copy recorded with it: int64 offsets would
    otherwise be converted, and read back, in every kernel call."""
    if cu_seqlens is None or cu_seqlens.dtype == torch.int32:
        return cu_seqlens
    with torch.inference_mode(False):  # a normal tensor, so that the record holds under inference_mode too
        cu32 = cu_seqlens.to(torch.int32)
    return remember_offsets(cu32, host_offsets(cu_seqlens))


def prepare(op: str, g_kind: str, delta: bool, q, k, v, *, g, beta, A_log=None, dt_bias=None, lower_bound=None,
            scale, initial_state, output_final_state,
            cu_seqlens, use_qk_l2norm, chunk_size, impl, recompute, state_pool, state_indices,
            seen: _Seen | None = None) -> Inputs:
    """Check a public op's arguments (one-line errors naming the argument) and cast them as documented. seen: what
    the checks found for this call's signature before (`_signature`); then only the offsets' values are checked."""
    cu_seqlens = _versioned(cu_seqlens)
    if seen is None:
        dims = check_recurrence_inputs(q, k, v, g=g, g_kind=g_kind, beta=beta, initial_state=initial_state,
                                       cu_seqlens=cu_seqlens, chunk_size=chunk_size, impl=impl, mixed_qk=True,
                                       impls=_impls(op))
        if A_log is not None or dt_bias is not None or lower_bound is not None:
            check_kda_gate(g, A_log, dt_bias, lower_bound)
        if state_pool is not None or state_indices is not None:
            check_state_pool(state_pool, state_indices, initial_state=initial_state, dims=dims,
                             dtype=state_dtype(v.dtype), device=q.device)
        if initial_state is not None:
            check_state_dtype("initial_state", initial_state, v.dtype)
        needs_grad = _needs_grad(q, k, v, g, beta, initial_state, A_log, dt_bias)
    else:
        dims, needs_grad = seen.dims, seen.needs_grad
        if cu_seqlens is not None:
            check_cu_seqlens(cu_seqlens, B=dims.B, T=dims.T)
    if initial_state is not None:
        initial_state = initial_state.to(state_dtype(v.dtype))
    cu_seqlens = _int32_offsets(cu_seqlens)
    if q.dtype != v.dtype:
        q = q.to(v.dtype)
    if k.dtype != v.dtype:
        k = k.to(v.dtype)
    return Inputs(op=op, q=q, k=k, v=v, device=q.device, needs_grad=needs_grad, g=g,
                  beta=beta, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, delta=delta, dims=dims,
                  scale=scale, initial_state=initial_state,
                  output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                  offsets=None if cu_seqlens is None else host_offsets(cu_seqlens), use_qk_l2norm=use_qk_l2norm,
                  chunk_size=chunk_size, recompute=recompute, state_pool=state_pool, state_indices=state_indices)


# ------------------------------------------------------------------------------------------------- the signature
# The tensor arguments after q, k, v that the checks read, in a fixed order.
_TENSOR_ARGS = ("g", "beta", "initial_state", "cu_seqlens", "A_log", "dt_bias", "state_pool", "state_indices")
MAX_SEEN = 256  # signatures remembered (a model's layers share a few; a server's batch shapes vary)


@dataclass(slots=True)
class _Seen:
    """What a call signature's first call found: its sizes, whether it needs gradients, its backend and the log
    line of an "auto" choice (None for an explicit impl)."""

    dims: Dims
    needs_grad: bool
    backend: Backend
    logged: tuple | None


_SEEN: OrderedDict[tuple, _Seen] = OrderedDict()


def _signature(op: str, impl: str, q, k, v, kw: dict) -> tuple | None:
    """Everything of a call that `prepare`'s checks and `choose` read, but the offsets' values (module docstring);
    None for a call not to remember: under torch.compile, or an argument of a type the checks refuse."""
    if torch.compiler.is_compiling():
        return None
    lb = kw.get("lower_bound")
    if not (lb is None or type(lb) is float):
        return None
    sig = [op, impl, kw["chunk_size"], lb, torch.is_grad_enabled(), bool(kw["output_final_state"]),
           bool(kw["use_qk_l2norm"]), bool(kw["recompute"])]
    for x in (q, k, v, *(kw.get(name) for name in _TENSOR_ARGS)):
        if x is None:  # q, k or v None: the first call's checks refuse it, so nothing is remembered
            sig.append(None)
        elif isinstance(x, torch.Tensor):
            sig += (x.shape, x.dtype, x.device, x.requires_grad)
        else:
            return None
    return tuple(sig)


def _remember(key: tuple, seen: _Seen) -> None:
    _SEEN[key] = seen
    if len(_SEEN) > MAX_SEEN:
        _SEEN.popitem(last=False)


def forget() -> None:
    """Drop every remembered signature (tests that change a backend's verdict for the same inputs)."""
    _SEEN.clear()


# ------------------------------------------------------------------------------------------------- the backends


def _run_torch(x: Inputs, core: Callable, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The PyTorch paths: everything in the state dtype, q/k normalised (eps inside the rsqrt, as transformers and
    fla) and q scaled, varlen as one call per sequence; under recompute, autograd's checkpoint keeps the inputs."""
    d = x.dims
    cd = state_dtype(x.v.dtype)
    scale = d.K**-0.5 if x.scale is None else float(x.scale)

    def body(q, k, v, g, beta, h0):
        q, k, v = q.to(cd), k.to(cd), v.to(cd)
        if x.use_qk_l2norm:
            q, k = l2norm(q), l2norm(k)
        q = q * scale
        if d.HV != d.H:  # grouped value attention: value head h reads key head h // (HV / H)
            q, k = q.repeat_interleave(d.HV // d.H, dim=2), k.repeat_interleave(d.HV // d.H, dim=2)
        if g is not None:
            g = g.to(cd)
            if g.dim() == 3:
                g = g.unsqueeze(-1)  # scalar per head: [B, T, HV, 1]
        if beta is not None:
            beta = beta.to(cd)
        state = h0 if h0 is not None else q.new_zeros(d.N, d.HV, d.K, d.V)
        if x.offsets is None:
            o, final = core(q, k, v, g=g, beta=beta, delta=x.delta, state_BHKV=state, **kwargs)
        else:  # varlen: each packed sequence starts from its own state
            outs, finals = [], []
            for n, (s, e) in enumerate(zip(x.offsets, x.offsets[1:])):
                o_n, f_n = core(q[:, s:e], k[:, s:e], v[:, s:e], g=None if g is None else g[:, s:e],
                                beta=None if beta is None else beta[:, s:e], delta=x.delta,
                                state_BHKV=state[n : n + 1], **kwargs)
                outs.append(o_n)
                finals.append(f_n)
            o, final = torch.cat(outs, dim=1), torch.cat(finals, dim=0)
        return o.to(x.v.dtype), (final if x.output_final_state else None)

    args = (x.q, x.k, x.v, x.g, x.beta, x.initial_state)
    if x.recompute and torch.is_grad_enabled():
        return torch.utils.checkpoint.checkpoint(body, *args, use_reentrant=False)
    return body(*args)


def _run_triton(x: Inputs):
    gate = {} if x.A_log is None and x.lower_bound is None else dict(A_log=x.A_log, dt_bias=x.dt_bias,
                                                                     lower_bound=x.lower_bound)
    return TRITON_KERNELS[x.op](x.q, x.k, x.v, g=x.g, beta=x.beta, scale=x.scale, initial_state=x.initial_state,
                                output_final_state=x.output_final_state, cu_seqlens=x.cu_seqlens,
                                use_qk_l2norm=x.use_qk_l2norm, recompute=x.recompute, **gate)


def _triton_supports(x: Inputs) -> str | None:
    check = TRITON_SUPPORTS.get(x.op)
    return None if check is None else check(x.q, x.v)


@functools.cache
def _gdn_fwd():
    """hybridlm.ops.gluon.gdn_fwd, or None when it does not import (no triton). Imported on first use, not with
    this module: it pulls in Triton, which CPU-only installs may lack; remembered, as each call asks twice."""
    try:
        from .gluon import gdn_fwd
    except ImportError:
        return None
    return gdn_fwd


def gluon_unsupported_reason(q: torch.Tensor, v: torch.Tensor) -> str | None:
    """None when the Gluon GDN forward takes inputs like q and v on this machine, else why not in a few words."""
    mod = _gdn_fwd()
    return "triton does not import" if mod is None else mod.unsupported_reason(q, v)


def _run_gluon(x: Inputs):
    """The Hopper forward of the op (GDN's, or KDA's: the Triton prep, then the Gluon chain), its checks skipped
    (done here); with a pool it reads and writes the rows itself."""
    if x.op == "kda":
        from .gluon.kda_fwd import kda_fwd as fwd
    else:
        fwd = _gdn_fwd().gated_delta_rule_fwd
    return fwd(
        x.q, x.k, x.v, g=x.g, beta=x.beta, scale=x.scale, initial_state=x.initial_state,
        output_final_state=x.output_final_state, cu_seqlens=x.cu_seqlens, use_qk_l2norm=x.use_qk_l2norm,
        state_pool=x.state_pool, state_indices=x.state_indices, checked=True,
    )


def _gluon_other_op(op: str) -> Exception:
    others = tuple(i for i in _impls(op) if i != "gluon")
    return ValueError(f"impl: expected one of {others} for {op} ('gluon' runs {', '.join(GLUON_OPS)} only), "
                      "got 'gluon'")


def _no_triton_kernel(op: str) -> Exception:
    return RuntimeError(f"impl: 'triton' was asked for {op}, but no Triton kernel is registered for it "
                        "(import hybridlm.ops.triton on a machine with triton installed)")


# impl="auto" tries them in this order. Under torch.compile the Triton kernels trace as custom ops with fake
# kernels; the Gluon launch is plain Python, so compiled code keeps the Triton path. Training keeps the Triton
# forward and backward: the Gluon forward does not write what the Triton backward reads. The decode's two come
# last: its callers run them (`hybridlm.ops.triton.decode_entry`), and both take every input its checks pass
# (`hybridlm.ops.decode`: the head dims are the kernel's on every impl), so neither judges the inputs.
BACKENDS: tuple[Backend, ...] = (
    Backend("gluon", "Gluon forward", _run_gluon, ops=lambda: GLUON_OPS, unknown_op=_gluon_other_op,
            supports=lambda x: gluon_unsupported_reason(x.q, x.v), auto_devices=("cuda",), autograd=False,
            traceable=False, pool_in_place=True),
    Backend("triton", "Triton kernel", _run_triton, ops=lambda: TRITON_KERNELS, unknown_op=_no_triton_kernel,
            supports=_triton_supports, auto_devices=("cuda",)),
    Backend("chunk", "chunkwise PyTorch form", lambda x: _run_torch(x, recurrence_chunk, chunk_size=x.chunk_size)),
    Backend("naive", "token loop", lambda x: _run_torch(x, recurrence_naive), auto=False),
    Backend("triton", "Triton decode kernel", None, auto_devices=("cuda",), auto_interpret=True, decode=True),
    Backend("torch", "PyTorch decode", None, decode=True),
)
_BY_NAME = {b.name: b for b in BACKENDS if not b.decode}  # the recurrences' impls, and the other ops'
_DECODE_BY_NAME = {b.name: b for b in BACKENDS if b.decode}


# ------------------------------------------------------------------------------------------------- the choice


def _named(op: str) -> dict[str, Backend]:
    """The backends an explicit impl may name for op, by name."""
    return _DECODE_BY_NAME if op in DECODE_OPS else _BY_NAME


def _impls(op: str) -> tuple[str, ...]:
    return ("auto", *_named(op))


def _covers(b: Backend, op: str) -> bool:
    return b.decode == (op in DECODE_OPS) and (b.ops is None or op in b.ops())


def _takes_device(b: Backend, device: torch.device) -> bool:
    """Whether "auto" takes b on this device (its type; any under TRITON_INTERPRET=1 where b says so)."""
    return (b.auto_devices is None or device.type in b.auto_devices
            or b.auto_interpret and os.environ.get("TRITON_INTERPRET") == "1")


def _ask(b: Backend, x: Inputs) -> Backend:
    """An explicit impl: its backend, or a one-line error saying why it does not run this call."""
    if not _covers(b, x.op):
        raise b.unknown_op(x.op)
    if x.needs_grad and not b.autograd:
        raise RuntimeError(f"impl: {b.name!r} was asked for {x.op}, but it is forward only and these inputs need "
                           "gradients (use impl='triton' or 'auto' for training, or run under torch.no_grad)")
    why = None if x.q is None else b.supports(x)
    if why is not None:
        raise RuntimeError(f"impl: {b.name!r} was asked for {x.op}, but the {b.label} does not take these inputs "
                           f"here: {why}")
    return b


def choose(x: Inputs, impl: str) -> Backend:
    """The backend of this call: the one `impl` names, or for "auto" the first in `BACKENDS` that covers the call
    and supports its inputs, logged once per (op, device type, choice, reasons others were passed over)."""
    return _choice(x, impl)[0]


def _choice(x: Inputs, impl: str) -> tuple[Backend, tuple | None]:
    """`choose`, with the key of the log line of an "auto" choice (None for an explicit impl)."""
    if impl != "auto":
        named = _named(x.op)
        if impl not in named:
            raise ValueError(f"impl: expected one of {_impls(x.op)}, got {impl!r}")
        return _ask(named[impl], x), None
    compiling = torch.compiler.is_compiling()
    whys = []
    for b in BACKENDS:
        if not (b.auto and _covers(b, x.op) and _takes_device(b, x.device)):
            continue
        if (x.needs_grad and not b.autograd) or (compiling and not b.traceable):
            continue
        why = None if x.q is None else b.supports(x)
        if why is None:
            break
        whys.append(f"{b.label} not used: {why}")
    return b, log_choice(x.op, x.device.type, b.name, "; ".join(whys) or None)


def log_choice(op: str, device_type: str, choice: str, why: str | None) -> tuple:
    """Log an impl="auto" choice on the `hybridlm.ops` logger, once per (op, device type, choice, why), and not
    while torch.compile traces (logged by the first eager call: a log call breaks a compiled graph). Returns that
    key. why: the reasons other impls were passed over, or None."""
    key = (op, device_type, choice, why)
    if key not in _LOGGED and not torch.compiler.is_compiling():
        _LOGGED.add(key)
        log.info("hybridlm.ops.%s: impl='auto' picked %r on %s%s", op, choice, device_type, f" ({why})" if why else "")
    return key


def forget_logged() -> None:
    """Forget the logged choices: the next impl="auto" call of each op chooses and logs again (the training bench,
    to log a run's own choices; tests)."""
    _LOGGED.clear()


def resolve_impl(op: str, impl: str, device: torch.device, q: torch.Tensor | None = None,
                 v: torch.Tensor | None = None, *, needs_grad: bool = True) -> str:
    """`choose` for callers that run the op themselves (the other ops, the layers' decode step, the decode ops of
    `DECODE_OPS`): the impl's name. With q and v given, backends judge inputs like them; without, only the op, the
    device type and needs_grad decide. needs_grad's default keeps callers that do not say off forward-only
    backends."""
    return choose(Inputs(op=op, q=q, v=v, device=device, needs_grad=needs_grad), impl).name


# ------------------------------------------------------------------------------------------------- the run


def _run(b: Backend, x: Inputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    d = x.dims
    if d.T == 0:  # nothing to run: empty output, state passed through
        final = x.initial_state
        if final is None:
            final = x.v.new_zeros(d.N, d.HV, d.K, d.V, dtype=state_dtype(x.v.dtype))
        return x.v.new_zeros(d.B, 0, d.HV, d.V), (final if x.output_final_state else None)
    return b.run(x)


def execute(b: Backend, x: Inputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run prepared inputs on backend b, a state pool included."""
    if (x.A_log is not None or x.lower_bound is not None) and b.name != "triton":
        g = kda_gate(x.g, x.A_log, x.dt_bias, x.lower_bound, dtype=state_dtype(x.v.dtype))
        x = dataclasses.replace(x, g=g, A_log=None, dt_bias=None, lower_bound=None)
    if x.state_pool is None:
        return _run(b, x)
    if b.pool_in_place and x.dims.T > 0 and x.state_pool.is_contiguous():
        return b.run(x)
    # a pool of states (chunked prefill in a server): sequence n starts from row state_indices[n] and its final
    # state is written back there; one gather before, one scatter after
    rows = x.state_indices.long()  # index_copy_ takes int64 rows only
    h0 = x.state_pool.index_select(0, rows)
    o, final = _run(b, dataclasses.replace(x, initial_state=h0, output_final_state=True, state_pool=None,
                                           state_indices=None))
    x.state_pool.index_copy_(0, rows, final.detach())
    return o, (final if x.output_final_state else None)


def _takes_width(op: str, impl: str, q: torch.Tensor, v: torch.Tensor, width: int) -> bool:
    """Whether the backend that runs this call without gradients runs it with values of width `width` too (the
    context-parallel pre-pass at width V + K); shapes and dtypes only, nothing is allocated."""
    like = v.new_empty(())
    qv, wide = like.expand(*q.shape), like.expand(*v.shape[:-1], width)
    try:
        return (resolve_impl(op, impl, v.device, qv, wide, needs_grad=False)
                == resolve_impl(op, impl, v.device, qv, v, needs_grad=False))
    except (RuntimeError, ValueError):  # an explicit impl that does not take the width
        return False


def dispatch(op: str, g_kind: str, delta: bool, q, k, v, *, impl: str, cp_group=None, **kw) -> tuple[
        torch.Tensor, torch.Tensor | None]:
    """A public op end to end: prepare, choose, execute. With cp_group, this rank's slice of a sequence split over
    the group (`hybridlm.ops.context_parallel`), each local piece dispatched as a call of its own."""
    if cp_group is not None:
        local = functools.partial(dispatch, op, g_kind, delta, impl=impl, state_pool=None, state_indices=None)
        return context_parallel.run(local, q, k, v, group=cp_group,
                                    takes_width=functools.partial(_takes_width, op, impl, q, v), **kw)
    key = _signature(op, impl, q, k, v, kw)
    seen = None if key is None else _SEEN.get(key)
    if seen is not None and (seen.logged is None or seen.logged in _LOGGED):
        return execute(seen.backend, prepare(op, g_kind, delta, q, k, v, impl=impl, seen=seen, **kw))
    x = prepare(op, g_kind, delta, q, k, v, impl=impl, **kw)
    b, logged = _choice(x, impl)
    if key is not None:
        _remember(key, _Seen(x.dims, x.needs_grad, b, logged))
    return execute(b, x)
