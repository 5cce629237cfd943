"""The input checks both kernel packages make that need no tensor library: options, shapes (as tuples) and host
values (Python ints, numpy arrays). Each raises the error the wrappers document, naming the argument and showing the
values; the packages add the checks of their own tensor types (`triton_impl/_checks.py`, `pallas_impl/_checks.py`).
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from mla_lse_common import constants
from mla_lse_common.constants import CP_METHODS, LSE_LAYOUTS


def check_lse_layout(lse_layout: str) -> None:
    if lse_layout not in LSE_LAYOUTS:
        raise ValueError(f"lse_layout must be one of {LSE_LAYOUTS}, got {lse_layout!r}")


def check_lse_base(lse_base) -> bool:
    """Returns True for base 2."""
    if lse_base == 2:
        return True
    if lse_base == math.e:
        return False
    raise ValueError(f"lse_base must be math.e or 2, got {lse_base!r}")


def check_cp_method(method: str) -> None:
    if method not in CP_METHODS:
        raise ValueError(f"method must be one of {CP_METHODS}, got {method!r}")


def check_lse_shape(name: str, shape, lse_layout: str, num_heads: int, num_tokens: int, *,
                    num_partials: int | None = None) -> None:
    """[H, T] or [T, H] by `lse_layout`; with `num_partials`, the same stacked: [N, H, T] or [N, T, H]."""
    want = (num_heads, num_tokens) if lse_layout == "HT" else (num_tokens, num_heads)
    if num_partials is not None:
        want = (num_partials,) + want
    if tuple(shape) != want:
        raise ValueError(
            f"{name} must be f32{list(want)} for lse_layout={lse_layout!r}; got {name}.shape={tuple(shape)}")


def check_fused_pair(query_start_loc, cu_seq_lens, cu_name: str) -> bool:
    """The fused mask's offsets come both or neither; returns whether they came."""
    if (query_start_loc is None) != (cu_seq_lens is None):
        raise ValueError(f"query_start_loc and {cu_name} go together (the fused mask); got only "
                         + ("query_start_loc" if query_start_loc is not None else cu_name))
    return query_start_loc is not None


def check_offset_shapes(qsl_shape, cu_shape, *, cu_name: str = "cu_seq_lens", kind: str = "tensor") -> int:
    """The two offset arrays' shapes (`kind`: what the package calls an array, for the message); returns R."""
    if qsl_shape[0] < 1:
        raise ValueError(f"query_start_loc must have R+1 >= 1 entries, got an empty {kind}")
    if tuple(cu_shape) != tuple(qsl_shape):
        raise ValueError(f"query_start_loc and {cu_name} must both be i32[R+1]; got "
                         f"query_start_loc.shape={tuple(qsl_shape)}, {cu_name}.shape={tuple(cu_shape)}")
    return qsl_shape[0] - 1


def check_prefill_tokens_range(value: int, num_tokens: int) -> None:
    """validate=True: prefill_tokens_with_context in [0, T]."""
    if not 0 <= value <= num_tokens:
        raise ValueError(f"prefill_tokens_with_context={value} must be in [0, T={num_tokens}]")


def host_prefill_tokens(prefill_tokens_with_context, num_tokens: int, validate: bool) -> int:
    """None (= T) or a host integer (a Python or numpy integer, never a device value: reading one would need a
    sync); clamped to [0, T] for the kernel (validate=True rejects values outside)."""
    x = prefill_tokens_with_context
    if x is None:
        return num_tokens
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise TypeError("prefill_tokens_with_context must be a host int (a device value would need a sync); "
                        f"got {type(x).__name__}")
    x = int(x)  # numpy integers too
    if validate:
        check_prefill_tokens_range(x, num_tokens)
    return max(0, min(x, num_tokens))


def check_offset_values(query_start_loc, cu_seq_lens, num_tokens: int, *, cu_name: str = "cu_seq_lens") -> None:
    """validate=True tier, over host copies of the offsets (numpy arrays): each starts at 0 and is non-decreasing,
    and query_start_loc[R] <= T. `cu_seq_lens` may be i32[N, R+1] (one row per partial)."""
    cu = np.asarray(cu_seq_lens)
    rows = [(cu_name, cu)] if cu.ndim == 1 else [(f"{cu_name}[{i}]", cu[i]) for i in range(cu.shape[0])]
    for name, x in [("query_start_loc", query_start_loc)] + rows:
        v = np.asarray(x).astype(np.int64)
        if v[0] != 0:
            raise ValueError(f"{name}[0] must be 0, got {v[0]}")
        bad = np.nonzero(v[1:] < v[:-1])[0]
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"{name} must be non-decreasing; {name}[{i}]={v[i]} > {name}[{i + 1}]={v[i + 1]}")
    last = int(np.asarray(query_start_loc)[-1])
    if last > num_tokens:
        raise ValueError(f"query_start_loc[R]={last} is past the token count T={num_tokens}")


def has_zero_length(chunk_seq_lens) -> bool:
    """Whether host data (a sequence or a numpy array of per-request KV lengths) holds a 0.

    Raises:
      TypeError: not a one-dimensional sequence of integers (a string, floats, nested lists...).
      ValueError: a negative length.
    """
    if isinstance(chunk_seq_lens, (str, bytes)):
        raise TypeError(f"chunk_seq_lens must be a sequence of integer lengths; got {chunk_seq_lens!r}")
    lens = np.asarray(chunk_seq_lens)
    if lens.ndim != 1 or not (np.issubdtype(lens.dtype, np.integer) or (lens.size == 0 and lens.dtype == float)):
        raise TypeError(f"chunk_seq_lens must be a one-dimensional sequence of integer lengths; got dtype="
                        f"{lens.dtype}, shape={lens.shape}")
    if lens.size and lens.min() < 0:
        raise ValueError(f"chunk_seq_lens must be >= 0; got {int(lens.min())} at index {int(lens.argmin())}")
    return bool((lens == 0).any())


def check_group_quant(group_size, scale_ue8m0, head_dim: int) -> int:
    """The per-group FP8 options (docs/spec.md 4.7): a group size, a power of two from MIN_GROUP_SIZE that divides
    the head dim D (a group never straddles two heads), D a power of two; returns the groups per head."""
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise TypeError(f"group_size must be an int; got {group_size!r}")
    if not isinstance(scale_ue8m0, bool):
        raise TypeError(f"scale_ue8m0 must be a bool; got {scale_ue8m0!r}")
    if group_size < constants.MIN_GROUP_SIZE or group_size & (group_size - 1):
        raise ValueError(f"group_size must be a power of two >= {constants.MIN_GROUP_SIZE}; got {group_size}")
    if head_dim % group_size or head_dim & (head_dim - 1):
        raise NotImplementedError(f"group_size={group_size} needs a head dim D that is a power of two and a multiple "
                                  f"of it (a group never straddles two heads); got D={head_dim}")
    return head_dim // group_size


def check_nvfp4_options(group_size, scale_ue8m0, scale_layout, head_dim: int) -> None:
    """The NVFP4 options both packages check alike (docs/spec.md 4.8): none of per-group FP8's, a block-scale layout
    of NVFP4_SCALE_LAYOUTS, D a power of two from 16 (a block never straddles two heads)."""
    if group_size is not None or scale_ue8m0:
        raise ValueError(f"group_size and scale_ue8m0 are per-group FP8's; NVFP4 output has blocks of "
                         f"{constants.NVFP4_BLOCK} and e4m3 scales; got group_size={group_size!r}, "
                         f"scale_ue8m0={scale_ue8m0!r}")
    if scale_layout not in constants.NVFP4_SCALE_LAYOUTS:
        raise ValueError(f"scale_layout of NVFP4 block scales must be 'row' or 'swizzled'; got {scale_layout!r}")
    if head_dim % constants.NVFP4_BLOCK or head_dim & (head_dim - 1):
        raise NotImplementedError(f"NVFP4 output needs a head dim D that is a power of two from "
                                  f"{constants.NVFP4_BLOCK} (a block never straddles two heads); got D={head_dim}")


def nvfp4_swizzled_size(num_tokens: int, num_blocks: int) -> int:
    """Scales in the 128x4-swizzled layout of [T, K] block scales: T padded to 128, K to 4 (docs/spec.md 4.8)."""
    rows, cols = constants.NVFP4_SWIZZLE
    return -(-num_tokens // rows) * rows * (-(-num_blocks // cols) * cols)


def check_scale_layout(scale_layout) -> None:
    """The per-group scales' layout (constants.SCALE_LAYOUTS: row-major, column-major, TMA-aligned column-major)."""
    if scale_layout not in constants.SCALE_LAYOUTS:
        raise ValueError(f"scale_layout must be one of {constants.SCALE_LAYOUTS}; got {scale_layout!r}")


def group_floor_scale(scale_ue8m0: bool) -> float:
    """The per-group scale of an all-zero group (docs/spec.md 4.7: an empty row): f32(GROUP_EPS) / 448 in f32,
    rounded up to a power of two with UE8M0; for the merges that fill rather than compute (N = 0)."""
    scale = np.float32(constants.GROUP_EPS) / np.float32(constants.FP8_E4M3_MAX)
    if scale_ue8m0:
        bits = np.array([scale], np.float32).view(np.int32)
        scale = ((bits + constants.UE8M0_ROUND_UP) & constants.UE8M0_EXPONENT).view(np.float32)[0]
    return float(scale)

