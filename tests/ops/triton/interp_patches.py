"""Fixes to Triton's CPU interpreter (TRITON_INTERPRET=1) that the kernel tests need, applied by each interpreter
child script (and by tests/conftest.py when pytest itself runs under the interpreter) before any kernel runs.
Test support only: the library never patches Triton.

- `_patch_index`: the interpreter (3.6) turns a scalar into an int with int(ndarray of shape (1,)), which
  numpy >= 2.4 refuses; loop bounds that are launch arguments then fail.
- `_patch_bf16`: the interpreter (3.4.0 to 3.9.0) holds bf16 tensors as their uint16 bit patterns; its tl.dot
  multiplies those integers (triton-lang/triton#11584) and its fp32 -> bf16 cast truncates, where the GPU rounds to
  nearest even. This widens bf16 dot operands to fp32 first (what the GPU computes: bf16 products are exact in fp32,
  fp32 accumulation) and casts fp32 <-> bf16 by the bit patterns with round-to-nearest-even. interp_bf16.py matches
  torch exactly with it under 3.4.0, 3.5.1, 3.6.0, 3.7.1 and 3.9.0, and is off by 2e10 without it under each.
Each is a no-op where the interpreter lacks the entry points it replaces, and applying twice changes nothing.
"""

from __future__ import annotations

import triton.language as tl


def patch_interpreter() -> None:
    """Apply both fixes (call before the first kernel launch under TRITON_INTERPRET=1)."""
    _patch_index()
    _patch_bf16()


def _patch_index() -> None:
    """Scalars as loop bounds under numpy >= 2.4 (see the module docstring)."""
    try:
        from triton.runtime import interpreter as itp
    except ImportError:  # pragma: no cover
        return
    orig = getattr(itp, "_patch_lang_tensor", None)
    if orig is None or getattr(orig, "_hybridlm", False):
        return

    def patched(tensor, *scope):  # Triton 3.6+: (tensor, scope); 3.4/3.5: (tensor,)
        orig(tensor, *scope)
        index = lambda self: int(self.handle.data.reshape(-1)[0])
        if scope:
            scope[0].set_attr(tensor, "__index__", index)
        else:
            tensor.__index__ = index

    patched._hybridlm = True
    itp._patch_lang_tensor = patched


def _patch_bf16() -> None:
    """bf16 dots and casts as the GPU computes them (see the module docstring)."""
    try:
        from triton.runtime import interpreter as itp
    except ImportError:  # pragma: no cover
        return
    builder = getattr(itp, "InterpreterBuilder", None)
    orig_dot = getattr(builder, "create_dot", None)
    orig_cast = getattr(builder, "cast_impl", None)
    if orig_dot is None or orig_cast is None or getattr(orig_dot, "_hybridlm", False):
        return
    import numpy as np

    def to_f32(bits):  # bf16 bit patterns (uint16) -> float32, exact
        return (bits.astype(np.uint32) << 16).view(np.float32)

    def to_bf16(x):  # float32 -> bf16 bit patterns, round to nearest even (NaN stays a quiet NaN)
        u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
        r = ((u + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint16)
        return np.where(np.isnan(x), np.uint16(0x7FC0), r)

    def widen(x):
        return itp.TensorHandle(to_f32(x.data), tl.float32) if x.dtype.scalar == tl.bfloat16 else x

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return orig_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    def cast_impl(self, src, dst_type):
        s, t = src.dtype.scalar, dst_type.scalar
        if s == tl.bfloat16 and t == tl.float32:
            return itp.TensorHandle(to_f32(src.data), tl.float32)
        if s == tl.float32 and t == tl.bfloat16:
            return itp.TensorHandle(to_bf16(src.data), tl.bfloat16)
        return orig_cast(self, src, dst_type)

    create_dot._hybridlm = True
    builder.create_dot = create_dot
    builder.cast_impl = cast_impl
    # the create_fp_* lambdas look cast_impl up on the instance, so they take the patched one
