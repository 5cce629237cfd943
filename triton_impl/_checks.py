"""Input checks of the Triton wrappers. The always-on tier reads metadata only; `check_offset_values` reads
offsets (a host sync). The checks that need no tensor library are `mla_lse_common.checks`, re-exported here so a
wrapper reads every check from one module."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mla_lse_common import checks as _shared
from mla_lse_common import constants
from mla_lse_common.checks import (check_cp_method, check_fused_pair, check_lse_base,  # noqa: F401 (re-exported)
                                   check_lse_layout)
from triton_impl._backend import tracing

OUTPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# None (= T) or a host int, clamped to [0, T] for the kernel (validate=True rejects values outside).
check_prefill_tokens = _shared.host_prefill_tokens


def has_empty_context(chunk_seq_lens) -> bool:
    """Host guard for the mask: does any request have 0 KV tokens in this chunk?

    Args:
      chunk_seq_lens: the chunk's per-request KV lengths as host data (a sequence, a numpy array or a CPU
        tensor), as vLLM keeps them before the copy to the GPU.

    Raises:
      ValueError: for a device tensor, since reading it would synchronise the stream; a negative length.
      TypeError: not a one-dimensional sequence of integers.
    """
    if isinstance(chunk_seq_lens, torch.Tensor):
        if chunk_seq_lens.device.type != "cpu":
            raise ValueError(
                f"has_empty_context needs host data; got a tensor on {chunk_seq_lens.device} "
                "(reading it would synchronise the device): pass the CPU copy")
        return _shared.has_zero_length(chunk_seq_lens.numpy())
    return _shared.has_zero_length(chunk_seq_lens)


def check_tensor(name: str, x, *, ndim: int, dtypes: Sequence[torch.dtype], device=None) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got {name}.shape={tuple(x.shape)}")
    if x.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must be {names}; got {name}.dtype={x.dtype}")
    if device is not None and x.device != device:
        raise ValueError(f"{name} is on {x.device}, expected {device} (all tensors on one device)")


def check_no_internal_overlap(name: str, x: torch.Tensor) -> None:
    """A tensor written in place must not have elements sharing memory (an `expand`ed view): its programs would
    race on them. Sufficient test, as torch's in-place ops make: with the size > 1 dims sorted by stride, every
    stride exceeds the span of the smaller ones."""
    if x.numel() == 0:
        return
    span = 0
    for stride, size in sorted((abs(st), sz) for st, sz in zip(x.stride(), x.shape) if sz > 1):
        if stride <= span:
            raise ValueError(f"{name} has elements that share memory ({name}.shape={tuple(x.shape)}, "
                             f"{name}.stride()={x.stride()}, an expanded or overlapping view): the kernel writes it "
                             "in place and would race; pass a tensor whose elements are distinct (e.g. .contiguous())")
        span += stride * (size - 1)


def _dense(x: torch.Tensor) -> bool:
    """Non-overlapping and dense: the elements fill one contiguous range (any order of the dims)."""
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(x.stride(), x.shape) if sz > 1):
        if stride != expected:
            return False
        expected *= size
    return True


def overlap_checks(out_name, out, inputs) -> tuple:
    """The per-signature part of `check_no_partial_overlap`: for each input (name, tensor or None) worth comparing
    with `out` at run time, (out_name, name, bytes of out, bytes of the input, whether it is the same view)."""
    if out.numel() == 0 or not _dense(out):
        return ()
    return tuple((out_name, name, out.numel() * out.element_size(), x.numel() * x.element_size(),
                  tuple(x.shape) == tuple(out.shape) and x.stride() == out.stride() and x.dtype == out.dtype)
                 for name, x in inputs if x is not None and x.numel() and _dense(x) and x.device == out.device)


def partial_overlap(checks, tensors) -> str | None:
    """The per-call part: the name of the first input of `checks` (`overlap_checks`) that partially overlaps its
    output in memory, or None. `tensors` maps the names to the tensors."""
    for out_name, name, out_bytes, x_bytes, same in checks:
        lo, xlo = tensors[out_name].data_ptr(), tensors[name].data_ptr()
        if xlo < lo + out_bytes and lo < xlo + x_bytes and not (same and xlo == lo):
            return name
    return None


def check_no_partial_overlap(out_name: str, out: torch.Tensor, **inputs) -> tuple:
    """A tensor written in place must not partially overlap one it reads, as torch's in-place ops require: the
    same tensor (same start, shape and strides) is fine, every element being read before it is written by the
    same program; a shifted or reshaped alias would race. Decided, as torch decides, for dense tensors only.
    Returns the per-signature `overlap_checks`, for the wrapper's launch plan.

    While torch.compile traces, addresses are unknown (fake tensors) and this check is skipped: a traced plain
    function's kernel then runs without it. The `torch.ops` entry points run it at run time (their traced
    form is a call of the eager op)."""
    checks = overlap_checks(out_name, out, inputs.items())
    if not tracing():
        name = partial_overlap(checks, dict(inputs, **{out_name: out}))
        if name is not None:
            raise ValueError(f"{out_name} partially overlaps {name} in memory: the kernel writes {out_name} in place "
                             f"while it reads {name}; pass separate buffers (or {name} itself)")
    return checks


def check_output(output, like: torch.Tensor, output_scale, *, name: str = "output", shape=None,
                 grouped: bool = False) -> bool:
    """The merge output and its optional fp8 scale, against the partials' tensor `like` [..., T, H, D] (or
    `shape`, when the output holds only some heads); returns whether the output is fp8. Any output dtype of
    OUTPUT_DTYPES or fp8, whatever the partials' (docs/spec.md 4.3: one rounding at the store). `grouped`: per-group
    FP8 (4.7): the output must be fp8 and output_scale None (the group scales are checked by `check_group_scale`)."""
    device = like.device
    shape = tuple(like.shape[-3:]) if shape is None else tuple(shape)
    check_tensor(name, output, ndim=3, dtypes=OUTPUT_DTYPES + (torch.float8_e4m3fn,), device=device)
    if tuple(output.shape) != shape:
        raise ValueError(f"{name} must be [T, H, D] = {list(shape)}; got {name}.shape={tuple(output.shape)}")
    fp8 = output.dtype == torch.float8_e4m3fn
    if grouped:
        if not fp8:
            raise TypeError(f"group_size (per-group FP8) needs a float8_e4m3fn {name}; got {name}.dtype={output.dtype}")
        if output_scale is not None:
            raise ValueError("output_scale (one static scale) and group_size (per-group scales) exclude each other; "
                             "got both")
        check_no_internal_overlap(name, output)
        return False
    if fp8 != (output_scale is not None):
        raise ValueError("output_scale is required for a float8_e4m3fn output and only for it; got "
                         f"{name}.dtype={output.dtype}, output_scale={'given' if output_scale is not None else None}")
    if fp8:
        check_tensor("output_scale", output_scale, ndim=1, dtypes=(torch.float32,), device=device)
        if output_scale.numel() != 1:
            raise ValueError(f"output_scale must be f32[1]; got output_scale.shape={tuple(output_scale.shape)}")
    check_no_internal_overlap(name, output)
    return fp8


def lse_ht_strides(name: str, lse: torch.Tensor, lse_layout: str, num_heads: int, num_tokens: int):
    """(stride_h, stride_t) of an LSE given in `lse_layout`, after checking its shape."""
    _shared.check_lse_shape(name, lse.shape, lse_layout, num_heads, num_tokens)
    s0, s1 = lse.stride()
    stride_h, stride_t = (s0, s1) if lse_layout == "HT" else (s1, s0)
    if num_tokens == 1:  # any stride indexes a size-1 dim: use the contiguous one, so T = 1 compiles nothing new
        stride_t = 1 if lse_layout == "HT" else num_heads
    return stride_h, stride_t


def lses_strides(lses: torch.Tensor, lse_layout: str, num_partials: int, num_heads: int, num_tokens: int):
    """(stride_n, stride_h, stride_t) of stacked LSEs given in `lse_layout`, after checking their shape."""
    if lses.shape[0] != num_partials:
        raise ValueError(f"outputs and lses disagree on N: outputs has {num_partials} partials, "
                         f"lses.shape={tuple(lses.shape)}")
    _shared.check_lse_shape("lses", lses.shape, lse_layout, num_heads, num_tokens, num_partials=num_partials)
    s0, s1, s2 = lses.stride()
    stride_h, stride_t = (s1, s2) if lse_layout == "HT" else (s2, s1)
    if num_tokens == 1:  # any stride indexes a size-1 dim: the contiguous one, so T = 1 compiles nothing new
        stride_t = 1 if lse_layout == "HT" else num_heads
    return s0, stride_h, stride_t


def check_offsets(query_start_loc, cu_seq_lens, device, *, cu_name="cu_seq_lens") -> int:
    """Metadata checks of the two offset arrays; returns R."""
    check_tensor("query_start_loc", query_start_loc, ndim=1, dtypes=(torch.int32,), device=device)
    check_tensor(cu_name, cu_seq_lens, ndim=1, dtypes=(torch.int32,), device=device)
    return _shared.check_offset_shapes(query_start_loc.shape, cu_seq_lens.shape, cu_name=cu_name)


def check_offset_values(query_start_loc, cu_seq_lens, num_tokens: int, *, cu_name="cu_seq_lens") -> None:
    """validate=True tier: reads the offsets on the host (a device sync). `cu_seq_lens` may be i32[N, R+1]
    (one row per partial)."""
    _shared.check_offset_values(query_start_loc.detach().cpu().numpy(), cu_seq_lens.detach().cpu().numpy(),
                                num_tokens, cu_name=cu_name)


def check_group_scale(output_group_scale, group_size, scale_ue8m0, output: torch.Tensor, **reads) -> tuple:
    """The per-group FP8 options and the scale tensor (docs/spec.md 4.7): f32[T, H * D / group_size] on the
    output's device, any strides, no element written twice, overlapping none of the tensors of `reads` (nor the
    output); returns ((stride_t, stride_g), the per-signature overlap checks)."""
    num_tokens, num_heads, head_dim = output.shape
    _shared.check_group_quant(group_size, scale_ue8m0, head_dim)
    if output_group_scale is None:
        raise ValueError("group_size needs output_group_scale, the f32[T, H * D / group_size] tensor its scales are "
                         "written to")
    check_tensor("output_group_scale", output_group_scale, ndim=2, dtypes=(torch.float32,), device=output.device)
    want = (num_tokens, num_heads * head_dim // group_size)
    if tuple(output_group_scale.shape) != want:
        raise ValueError(f"output_group_scale must be [T, H * D / group_size] = {list(want)}; got "
                         f"output_group_scale.shape={tuple(output_group_scale.shape)} (a column-major buffer: pass "
                         "buf[:, :T].t())")
    check_no_internal_overlap("output_group_scale", output_group_scale)
    overlaps = check_no_partial_overlap("output_group_scale", output_group_scale, output=output,
                                        **{k: v for k, v in reads.items() if v is not None})
    return tuple(output_group_scale.stride()), overlaps

group_floor_scale = _shared.group_floor_scale


def check_nvfp4(output, like: torch.Tensor, output_scale, output_block_scale, scale_layout, group_size, scale_ue8m0,
                *, shape=None, reads: dict) -> tuple[tuple, tuple]:
    """NVFP4 output (docs/spec.md 4.8): `output` u8[T, H, D / 2] (two e2m1 codes a byte; D a power of two from 16),
    `output_scale` the f32[1] global scale, `output_block_scale` float8_e4m3fn [T, H * D / 16] with any strides
    (scale_layout "row"), or a contiguous buffer of the 128x4-swizzled layout's T_pad * K_pad scales (scale_layout
    "swizzled": T padded to a multiple of 128, K = H * D / 16 to a multiple of 4; the padding is the caller's, left
    untouched); returns ((stride_t, stride_k), the per-signature overlap checks)."""
    device = like.device
    num_tokens, num_heads, head_dim = tuple(like.shape[-3:]) if shape is None else tuple(shape)
    _shared.check_nvfp4_options(group_size, scale_ue8m0, scale_layout, head_dim)
    check_tensor("output", output, ndim=3, dtypes=(torch.uint8,), device=device)
    want = (num_tokens, num_heads, head_dim // 2)
    if tuple(output.shape) != want:
        raise ValueError(f"output of NVFP4 (two e2m1 codes a byte) must be u8[T, H, D / 2] = {list(want)}; got "
                         f"output.shape={tuple(output.shape)}")
    check_no_internal_overlap("output", output)
    if output_scale is None:
        raise ValueError("NVFP4 output needs output_scale, the f32[1] global scale")
    check_tensor("output_scale", output_scale, ndim=1, dtypes=(torch.float32,), device=device)
    if output_scale.numel() != 1:
        raise ValueError(f"output_scale (the NVFP4 global scale) must be f32[1]; got shape={tuple(output_scale.shape)}")
    blocks = num_heads * head_dim // constants.NVFP4_BLOCK
    check_tensor("output_block_scale", output_block_scale, dtypes=(torch.float8_e4m3fn,), device=device,
                 ndim=2 if scale_layout == "row" else getattr(output_block_scale, "ndim", 1))
    if scale_layout == "row":
        if tuple(output_block_scale.shape) != (num_tokens, blocks):
            raise ValueError(f"output_block_scale must be e4m3 [T, H * D / 16] = {[num_tokens, blocks]}; got "
                             f"output_block_scale.shape={tuple(output_block_scale.shape)}")
        check_no_internal_overlap("output_block_scale", output_block_scale)
        strides = tuple(output_block_scale.stride())
    else:
        size = _shared.nvfp4_swizzled_size(num_tokens, blocks)
        if output_block_scale.numel() != size or not output_block_scale.is_contiguous():
            raise ValueError(f"output_block_scale of the swizzled layout must be a contiguous buffer of {size} scales "
                             f"(T padded to 128, H * D / 16 to 4); got shape="
                             f"{tuple(output_block_scale.shape)}, contiguous={output_block_scale.is_contiguous()}")
        strides = (0, 0)
    overlaps = check_no_partial_overlap("output_block_scale", output_block_scale, output=output,
                                        **{k: v for k, v in reads.items() if v is not None})
    return strides, overlaps


def check_outputs(output, like: torch.Tensor, output_scale, group_size, output_group_scale, scale_ue8m0, *,
                  shape=None, reads: dict, output_block_scale=None, scale_layout="row") -> tuple[bool, tuple, tuple]:
    """The merge output with its static fp8 scale (`check_output`), its per-group FP8 scales (`check_group_scale`,
    docs/spec.md 4.7) or, with `output_block_scale`, NVFP4's block scales (`check_nvfp4`, 4.8), for every merge
    wrapper: (per-tensor fp8, the scales' (stride_t, stride_g), their overlap checks); `reads` are the tensors the
    merge reads (and the output LSE), which the scales must not overlap."""
    if output_block_scale is not None:
        if output_group_scale is not None:
            raise ValueError("output_group_scale (per-group FP8) and output_block_scale (NVFP4) exclude each other")
        return (False, *check_nvfp4(output, like, output_scale, output_block_scale, scale_layout, group_size,
                                    scale_ue8m0, shape=shape, reads=reads))
    if scale_layout != "row":
        raise ValueError(f"scale_layout goes with output_block_scale (NVFP4); got scale_layout={scale_layout!r}")
    group = group_size is not None
    if not group and (output_group_scale is not None or scale_ue8m0):
        raise ValueError("output_group_scale and scale_ue8m0 go with group_size (per-group FP8); got group_size=None")
    fp8 = check_output(output, like, output_scale, shape=shape, grouped=group)
    if not group:
        return fp8, (0, 0), ()
    strides, overlaps = check_group_scale(output_group_scale, group_size, scale_ue8m0, output, **reads)
    return fp8, strides, overlaps

