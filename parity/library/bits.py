"""Bits of float arrays: the compared formats, same-width integer views, the ordered integer line (ULP
distances) and value classes (finite, +inf, -inf, NaN). numpy arrays are compared with numpy (torch is not needed:
`python -m parity verify` of a port runs with numpy and ml_dtypes alone); torch tensors with torch ops on their
device; JAX arrays arrive zero-copy through `parity.library.bridge` as torch tensors. Both give the same bits:
every operation here is an integer or float64 one, exact in either library."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import ml_dtypes
import numpy as np

from parity.library import bridge

# Value classes (`value_class`).
FINITE, POS_INF, NEG_INF, NAN = 0, 1, 2, 3
CLASS_NAMES = {FINITE: "finite", POS_INF: "+inf", NEG_INF: "-inf", NAN: "nan"}


@dataclasses.dataclass(frozen=True)
class _Format:
    short: str  # name in reports
    name: str  # the dtype's name (torch.float32 and np.float32 alike: "float32")
    width: int  # bits
    exp_mask: int | None  # IEEE exponent field (None: e4m3fn, which has no inf)
    np_dtype: np.dtype
    unit_roundoff: float  # half the gap between 1 and the next value

    @property
    def np_int(self):
        """The same-width signed integer numpy dtype (bit views of numpy arrays)."""
        return _NP_INT[self.width]

    @property
    def int_dtype(self):
        """The same-width signed integer torch dtype (bit views of torch tensors)."""
        import torch

        return {8: torch.int8, 16: torch.int16, 32: torch.int32}[self.width]


_NP_INT = {8: np.int8, 16: np.int16, 32: np.int32}
_FORMAT_LIST = (
    _Format("fp32", "float32", 32, 0x7F800000, np.dtype(np.float32), 2.0**-24),
    _Format("fp16", "float16", 16, 0x7C00, np.dtype(np.float16), 2.0**-11),
    _Format("bf16", "bfloat16", 16, 0x7F80, np.dtype(ml_dtypes.bfloat16), 2.0**-8),
    _Format("fp8e4m3", "float8_e4m3fn", 8, None, np.dtype(ml_dtypes.float8_e4m3fn), 2.0**-4),
    _Format("fp8e5m2", "float8_e5m2", 8, 0x7C, np.dtype(ml_dtypes.float8_e5m2), 2.0**-3),
)
_NP_FORMATS = {f.np_dtype: f for f in _FORMAT_LIST}
FORMAT_NAMES = tuple(f.name for f in _FORMAT_LIST)


@functools.cache
def _torch_formats() -> dict:
    import torch

    return {getattr(torch, f.name): f for f in _FORMAT_LIST}


def __getattr__(name):
    if name == "_FORMATS":  # torch dtype -> format (imports torch)
        return _torch_formats()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def is_numpy(x: Any) -> bool:
    return isinstance(x, np.ndarray)


def _as_array(x: Any, device=None):
    """numpy array as is (compared with numpy); torch tensor as is; JAX array zero-copy through the bridge as a torch
    tensor. A torch tensor is moved to `device`."""
    if isinstance(x, np.ndarray):
        return x
    return _as_torch(x, device)


def _as_torch(x: Any, device=None):
    """torch tensor as is; JAX array zero-copy through the bridge; numpy uploaded. Moved to `device`."""
    if isinstance(x, np.ndarray):
        t = bridge.to_torch(x, device or "cpu")
    elif bridge._is_torch_tensor(x):
        t = x
    elif bridge._is_jax_array(x):
        t = bridge.jax_to_torch(x)
    else:
        raise TypeError(f"expected a torch tensor, jax array or numpy array, got {type(x)=}")
    if device is not None and t.device != device:
        t = t.to(device)
    return t


def dtype_name(x: Any) -> str:
    """The name of an array's dtype, numpy or torch ("float32", "bfloat16", ...)."""
    dtype = x.dtype
    return dtype.name if isinstance(dtype, np.dtype) else str(dtype).replace("torch.", "")


def _format_of(dtype) -> _Format:
    fmt = _NP_FORMATS.get(dtype) if isinstance(dtype, np.dtype) else _torch_formats().get(dtype)
    if fmt is None:
        raise TypeError(f"{dtype=} is not a compared float dtype; supported: {list(FORMAT_NAMES)}")
    return fmt


def _int_view(x, fmt: _Format):
    """The bits of `x` (numpy or torch) as a same-width signed integer view."""
    return x.view(fmt.np_int) if is_numpy(x) else x.view(fmt.int_dtype)


def _int64(x):
    return x.astype(np.int64) if is_numpy(x) else x.to(_torch().int64)


def _float64(x):
    return x.astype(np.float64) if is_numpy(x) else x.to(_torch().float64)


def _where(cond, a, b):
    return np.where(cond, a, b) if is_numpy(cond) else _torch().where(cond, a, b)


def _zeros_int8(x):
    return np.zeros(x.shape, dtype=np.int8) if is_numpy(x) else _torch().zeros(x.shape, dtype=_torch().int8,
                                                                                device=x.device)


def _torch():
    import torch

    return torch


def raw_bits(x: Any):
    """The bits of a float array as a same-width signed integer array (a view when `x` allows)."""
    t = _as_array(x)
    return _int_view(t, _format_of(t.dtype))


def ordered_bits(x: Any):
    """int64 positions of the values on an ordered integer line: ULP distance = |ordered(a) - ordered(b)|.

    IEEE-like formats are sign-magnitude; mapping a negative value to -(magnitude bits) makes the line
    monotonic in the value, with +0 and -0 both at 0. Infinities sit one step past the largest finite
    value. NaN positions are meaningless (callers exclude NaN by `value_class`).
    """
    t = _as_array(x)
    fmt = _format_of(t.dtype)
    b = _int64(_int_view(t, fmt))
    magnitude = b & ((1 << (fmt.width - 1)) - 1)
    return _where(b < 0, -magnitude, magnitude)


def ulp_distance(a: Any, b: Any):
    """int64 |ordered(a) - ordered(b)| elementwise, in the (shared) native dtype of a and b."""
    a, b = _as_array(a), _as_array(b)
    if is_numpy(a) != is_numpy(b):
        a, b = _as_torch(a), _as_torch(b)
    if a.dtype != b.dtype:
        raise TypeError(f"ULP distance needs one dtype: {a.dtype=} {b.dtype=}")
    if not is_numpy(a):
        b = b.to(a.device)
    return abs(ordered_bits(a) - ordered_bits(b))


def value_class(x: Any):
    """int8 class per element: FINITE (0), POS_INF (1), NEG_INF (2), NAN (3).

    Float formats are decoded from their bits (works for fp8, where torch lacks isinf/isnan kernels on
    some devices); float64 through isnan/isinf. fp8 e4m3fn has no infinity: its classes are finite/NaN.
    """
    t = _as_array(x)
    cls = _zeros_int8(t)
    if dtype_name(t) == "float64":
        lib = np if is_numpy(t) else _torch()
        cls[lib.isposinf(t)] = POS_INF
        cls[lib.isneginf(t)] = NEG_INF
        cls[lib.isnan(t)] = NAN
        return cls
    fmt = _format_of(t.dtype)
    b = _int64(_int_view(t, fmt))
    magnitude = b & ((1 << (fmt.width - 1)) - 1)
    if fmt.exp_mask is None:  # e4m3fn: S.1111.111 is NaN, nothing is inf
        cls[magnitude == 0x7F] = NAN
        return cls
    is_inf = magnitude == fmt.exp_mask
    cls[is_inf & (b >= 0)] = POS_INF
    cls[is_inf & (b < 0)] = NEG_INF
    cls[magnitude > fmt.exp_mask] = NAN
    return cls



def _number(v: float) -> str:
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    s = f"{v:.5g}"
    return s + ".0" if s.lstrip("-").isdigit() else s


def _native(bits: int, fmt: _Format) -> tuple[str, str]:
    """(hex bits, value) of one element given its signed bits."""
    unsigned = bits & ((1 << fmt.width) - 1)
    value = float(np.array(bits, dtype=_NP_INT[fmt.width]).view(fmt.np_dtype)[()])
    return f"0x{unsigned:0{fmt.width // 4}x}", _number(value)



__all__ = ["CLASS_NAMES", "FINITE", "NAN", "NEG_INF", "POS_INF", "ordered_bits", "raw_bits", "ulp_distance",
           "value_class"]
