"""Bits of float arrays: the compared formats, same-width integer views, the ordered integer line (ULP
distances) and value classes (finite, +inf, -inf, NaN). torch ops on the array's device; JAX arrays arrive
zero-copy through `parity.library.bridge`."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import ml_dtypes
import numpy as np
import torch

from parity.library import bridge

# Value classes (`value_class`).
FINITE, POS_INF, NEG_INF, NAN = 0, 1, 2, 3
CLASS_NAMES = {FINITE: "finite", POS_INF: "+inf", NEG_INF: "-inf", NAN: "nan"}


@dataclasses.dataclass(frozen=True)
class _Format:
    short: str  # name in reports
    int_dtype: torch.dtype  # same-width signed integer for bit views
    width: int  # bits
    exp_mask: int | None  # IEEE exponent field (None: e4m3fn, which has no inf)
    np_dtype: np.dtype
    unit_roundoff: float  # half the gap between 1 and the next value


_FORMATS = {
    torch.float32: _Format("fp32", torch.int32, 32, 0x7F800000, np.dtype(np.float32), 2.0**-24),
    torch.float16: _Format("fp16", torch.int16, 16, 0x7C00, np.dtype(np.float16), 2.0**-11),
    torch.bfloat16: _Format("bf16", torch.int16, 16, 0x7F80, np.dtype(ml_dtypes.bfloat16), 2.0**-8),
    torch.float8_e4m3fn: _Format("fp8e4m3", torch.int8, 8, None, np.dtype(ml_dtypes.float8_e4m3fn), 2.0**-4),
    torch.float8_e5m2: _Format("fp8e5m2", torch.int8, 8, 0x7C, np.dtype(ml_dtypes.float8_e5m2), 2.0**-3),
}
_NP_INT = {8: np.int8, 16: np.int16, 32: np.int32}


def _as_torch(x: Any, device: torch.device | None = None) -> torch.Tensor:
    """torch tensor as is; JAX array zero-copy through the bridge; numpy uploaded. Moved to `device`."""
    if isinstance(x, torch.Tensor):
        t = x
    elif isinstance(x, np.ndarray):
        t = bridge.to_torch(x, device or "cpu")
    elif bridge._is_jax_array(x):
        t = bridge.jax_to_torch(x)
    else:
        raise TypeError(f"expected a torch tensor, jax array or numpy array, got {type(x)=}")
    if device is not None and t.device != device:
        t = t.to(device)
    return t


def _format_of(dtype: torch.dtype) -> _Format:
    try:
        return _FORMATS[dtype]
    except KeyError:
        raise TypeError(f"{dtype=} is not a compared float dtype; supported: {list(_FORMATS)}") from None


def raw_bits(x: Any) -> torch.Tensor:
    """The bits of a float tensor as a same-width signed integer tensor (a view when `x` allows)."""
    t = _as_torch(x)
    return t.view(_format_of(t.dtype).int_dtype)


def ordered_bits(x: Any) -> torch.Tensor:
    """int64 positions of the values on an ordered integer line: ULP distance = |ordered(a) - ordered(b)|.

    IEEE-like formats are sign-magnitude; mapping a negative value to -(magnitude bits) makes the line
    monotonic in the value, with +0 and -0 both at 0. Infinities sit one step past the largest finite
    value. NaN positions are meaningless (callers exclude NaN by `value_class`).
    """
    t = _as_torch(x)
    fmt = _format_of(t.dtype)
    b = t.view(fmt.int_dtype).to(torch.int64)
    magnitude = b & ((1 << (fmt.width - 1)) - 1)
    return torch.where(b < 0, -magnitude, magnitude)


def ulp_distance(a: Any, b: Any) -> torch.Tensor:
    """int64 |ordered(a) - ordered(b)| elementwise, in the (shared) native dtype of a and b."""
    a, b = _as_torch(a), _as_torch(b)
    if a.dtype != b.dtype:
        raise TypeError(f"ULP distance needs one dtype: {a.dtype=} {b.dtype=}")
    return (ordered_bits(a) - ordered_bits(b.to(a.device))).abs()


def value_class(x: Any) -> torch.Tensor:
    """int8 class per element: FINITE (0), POS_INF (1), NEG_INF (2), NAN (3).

    Float formats are decoded from their bits (works for fp8, where torch lacks isinf/isnan kernels on
    some devices); float64 through isnan/isinf. fp8 e4m3fn has no infinity: its classes are finite/NaN.
    """
    t = _as_torch(x)
    if t.dtype == torch.float64:
        cls = torch.zeros(t.shape, dtype=torch.int8, device=t.device)
        cls[torch.isposinf(t)] = POS_INF
        cls[torch.isneginf(t)] = NEG_INF
        cls[torch.isnan(t)] = NAN
        return cls
    fmt = _format_of(t.dtype)
    b = t.view(fmt.int_dtype).to(torch.int64)
    magnitude = b & ((1 << (fmt.width - 1)) - 1)
    cls = torch.zeros(t.shape, dtype=torch.int8, device=t.device)
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
