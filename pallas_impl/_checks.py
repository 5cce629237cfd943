"""Input checks of the Pallas wrappers. The always-on tier reads shapes and dtypes only, so under jax.jit it runs at
trace time; the validate=True tier reads values on the host (not under jit). The checks that need no tensor library
are `mla_lse_common.checks`, re-exported here so a wrapper reads every check from one module.

jax and numpy only: a JAX user installs and runs `pallas_impl` without torch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mla_lse_common import checks as _shared
from mla_lse_common import constants
from pallas_impl import _math
from mla_lse_common.checks import (check_cp_method, check_fused_pair, check_lse_base,  # noqa: F401 (re-exported)
                                   check_lse_layout, check_lse_shape)

OUTPUT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
FP8 = jnp.dtype(jnp.float8_e4m3fn)
FP4 = jnp.dtype(jnp.float4_e2m1fn)  # out_dtype of NVFP4 output (docs/spec.md 4.8), returned packed: u8[T, H, D / 2]


def has_empty_context(chunk_seq_lens) -> bool:
    """Host guard for the mask: does any request have 0 KV tokens in this chunk?

    Args:
      chunk_seq_lens: host data (a sequence or a numpy array), as serving stacks keep it before the upload.

    Raises:
      ValueError: for a jax.Array, since reading it would synchronise the device (or fail under jit); a negative
        length.
      TypeError: not a one-dimensional sequence of integers.
    """
    if isinstance(chunk_seq_lens, jax.Array):
        raise ValueError("has_empty_context needs host data; got a jax.Array (reading it would synchronise "
                         "the device, and fails under jit): pass the host copy")
    return _shared.has_zero_length(chunk_seq_lens)


def check_array(name: str, x, *, ndim: int, dtypes) -> None:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if x.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got {name}.shape={tuple(x.shape)}")
    if jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in dtypes]:
        names = ", ".join(jnp.dtype(d).name for d in dtypes)
        raise TypeError(f"{name} must be {names}; got {name}.dtype={jnp.dtype(x.dtype).name}")


def check_offsets(query_start_loc, cu_seq_lens, *, cu_name="cu_seq_lens") -> int:
    """Shape and dtype checks of the two offset arrays; returns R."""
    check_array("query_start_loc", query_start_loc, ndim=1, dtypes=(jnp.int32,))
    check_array(cu_name, cu_seq_lens, ndim=1, dtypes=(jnp.int32,))
    return _shared.check_offset_shapes(query_start_loc.shape, cu_seq_lens.shape, cu_name=cu_name, kind="array")


def _concrete(name: str, x):
    if isinstance(x, jax.core.Tracer):
        raise ValueError(f"validate=True reads {name}'s values on the host and cannot run under jax.jit; "
                         "validate outside jit, or pass validate=False")
    return np.asarray(x)


def check_offset_values(query_start_loc, cu_seq_lens, num_tokens: int, *, cu_name="cu_seq_lens") -> None:
    """validate=True tier: reads the offsets on the host (a device sync; not under jit). `cu_seq_lens` may be
    i32[N, R+1] (one row per partial)."""
    cu = _concrete(cu_name, cu_seq_lens)
    _shared.check_offset_values(_concrete("query_start_loc", query_start_loc), cu, num_tokens, cu_name=cu_name)


def check_group(group_size, scale_ue8m0, scale_layout, head_dim: int, output_scale):
    """The per-group FP8 options (docs/spec.md 4.7): None without group_size, else (group_size, scale_ue8m0,
    scale_layout), checked."""
    if group_size is None:
        if scale_ue8m0 or scale_layout != "row":
            raise ValueError("scale_ue8m0 and scale_layout go with group_size (per-group FP8); got group_size=None")
        return None
    _shared.check_group_quant(group_size, scale_ue8m0, head_dim)
    _shared.check_scale_layout(scale_layout)
    if output_scale is not None:
        raise ValueError("output_scale (one static scale) and group_size (per-group scales) exclude each other; "
                         "got both")
    return (group_size, scale_ue8m0, scale_layout)


def check_out_dtype(out_dtype, in_dtype, output_scale, *, grouped: bool = False):
    """The merge's output dtype (None: the inputs'; any of OUTPUT_DTYPES or fp8 whatever the inputs' dtype, docs/spec.md
    4.3), checked against the fp8 scale (`grouped`: per-group FP8, fp8 without one); returns it as a dtype."""
    out_dtype = jnp.dtype(in_dtype if out_dtype is None else out_dtype)
    if out_dtype not in OUTPUT_DTYPES + (FP8,):
        raise TypeError(f"out_dtype must be None (the inputs' dtype {jnp.dtype(in_dtype).name}), float32, float16, "
                        f"bfloat16 or float8_e4m3fn; got {out_dtype.name}")
    fp8 = out_dtype == FP8
    if grouped:
        if not fp8:
            raise TypeError(f"group_size (per-group FP8) needs out_dtype float8_e4m3fn (or None); got {out_dtype.name}")
        return out_dtype
    if fp8 != (output_scale is not None):
        raise ValueError("output_scale is required for a float8_e4m3fn output and only for it; got "
                         f"out_dtype={out_dtype.name}, output_scale={'given' if output_scale is not None else None}")
    if fp8 and (getattr(output_scale, "dtype", None) != jnp.float32 or getattr(output_scale, "size", 0) != 1):
        raise TypeError(f"output_scale must be an f32 scalar or f32[1] array; got {output_scale!r}")
    return out_dtype


def check_prefill_tokens(prefill_tokens_with_context, num_tokens: int, validate: bool) -> None:
    """None, a Python int or an integer scalar array (traced or not); no device work here."""
    x = prefill_tokens_with_context
    if x is None:
        return
    if isinstance(x, bool) or not (isinstance(x, int) or (hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.integer)
                                                          and getattr(x, "ndim", None) == 0)):
        raise TypeError(f"prefill_tokens_with_context must be an integer scalar; got {x!r}")
    if validate:
        _shared.check_prefill_tokens_range(int(_concrete("prefill_tokens_with_context", x)), num_tokens)


def prefill_tokens_array(prefill_tokens_with_context, num_tokens: int):
    """i32[1] for the kernels (inside jit): None means T; values are clamped to [0, T]."""
    if prefill_tokens_with_context is None:
        return jnp.full((1,), num_tokens, jnp.int32)
    x = jnp.asarray(prefill_tokens_with_context).astype(jnp.int32)
    return jnp.clip(x, 0, num_tokens).reshape(1)


def check_nvfp4(output_scale, group_size, scale_ue8m0, scale_layout, head_dim: int):
    """NVFP4 output (docs/spec.md 4.8: out_dtype float4_e2m1fn): output_scale is the f32 global scale, the block
    scales' layout "row" or "swizzled", D a power of two from 16; returns the `group` option (16, "nvfp4", layout)."""
    _shared.check_nvfp4_options(group_size, scale_ue8m0, scale_layout, head_dim)
    if output_scale is None:
        raise ValueError("NVFP4 output (out_dtype float4_e2m1fn) needs output_scale, the f32 global scale")
    if getattr(output_scale, "dtype", None) != jnp.float32 or getattr(output_scale, "size", 0) != 1:
        raise TypeError(f"output_scale (the NVFP4 global scale) must be an f32 scalar or f32[1] array; got "
                        f"{output_scale!r}")
    return (constants.NVFP4_BLOCK, _math.NVFP4, scale_layout)


def check_output_options(out_dtype, in_dtype, output_scale, group_size, scale_ue8m0, scale_layout, head_dim: int):
    """The merges' output options: (out_dtype as a dtype, the quantized-output option or None); with group_size the
    output is fp8 (out_dtype None or float8_e4m3fn; docs/spec.md 4.7); with out_dtype float4_e2m1fn it is NVFP4
    (4.8: packed u8, returned as such)."""
    if out_dtype is not None and jnp.dtype(out_dtype) == FP4:
        return jnp.dtype(jnp.uint8), check_nvfp4(output_scale, group_size, scale_ue8m0, scale_layout, head_dim)
    group = check_group(group_size, scale_ue8m0, scale_layout, head_dim, output_scale)
    out_dtype = check_out_dtype(FP8 if group and out_dtype is None else out_dtype, in_dtype, output_scale,
                                grouped=group is not None)
    return out_dtype, group

