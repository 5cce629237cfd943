"""Attention-state merge (docs/spec.md 4): the Pallas GPU kernel and its functional, jit-friendly wrapper.

The same algorithm as `triton_impl/merge.py`, statement by statement. Grid: `(cdiv(T, block_t) *
cdiv(H, block_h),)`, head blocks fastest; a program merges a [block_t, block_h, block_d] tile (the whole
padded head, then as many heads and tokens as fit in the variant's budget, `tiles.MERGE_TILES`). The fused
mask (docs/spec.md 4.5) finds each token's request with the same two-level 32-wide compare-and-sum as the mask kernel.

Float math (docs/spec.md 5), identical to the Triton kernel in operation order: f32 throughout, `jnp.exp`/`jnp.log`
(libdevice `__nv_expf`/`__nv_logf` on GPU), no FMA contraction and no flush-to-zero (XLA's Triton pipeline
does neither), division with `/`, cast only at the store.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from mla_lse_common import tiles
from pallas_impl import _backend
from pallas_impl import _checks as checks
from pallas_impl import _math, jnp_fallback
from pallas_impl import _plans as plans
from pallas_impl import _sharding as sharding
from pallas_impl._backend import pltriton
from pallas_impl._device import (_load_lse, _merged_lse, _program_tile, _store_group_fp8, _store_lse, _store_nvfp4,
                                 _store_output, _token_requests)
from pallas_impl._math import two_way_weights


def _merge_attn_states_kernel(
    # inputs
    prefix_out_ref,  # dtype[T, H, D]
    prefix_lse_ref,  # f32[H, T] or f32[T, H]
    suffix_out_ref,  # dtype[T, H, D]
    suffix_lse_ref,  # f32[H, T] or f32[T, H]
    scale_ref,  # f32[1] output scale; unused unless fp8_out
    qsl_ref,  # i32[R+1] query_start_loc; unused unless fused_mask
    cu_ref,  # i32[R+1] the prefix chunk's cu_seq_lens; unused unless fused_mask
    ptwc_ref,  # i32[1] prefill_tokens_with_context: tokens at or past it are suffix copies (docs/spec.md 4.4)
    # outputs
    out_ref,  # out_dtype[T, H, D]
    *more_out_refs,  # f32 LSE of the merge, when output_lse; the scales [T, H * D / G], when group (4.7, 4.8)
    num_tokens: int, num_heads: int, head_dim: int, num_requests: int,
    block_t: int, block_h: int, block_d: int,
    lse_layout: str, lse_base2: bool, output_lse: bool, fused_mask: bool, fp8_out: bool, group=None,
):
    t0, h0, t, t_mask, th_mask, thd_mask = _program_tile(num_tokens, num_heads, head_dim, block_t, block_h, block_d)

    # Issue every load first: the fused-mask scan below overlaps their latency.
    p_raw = _load_lse(prefix_lse_ref, t0, h0, block_t, block_h, th_mask, lse_layout)
    s_raw = _load_lse(suffix_lse_ref, t0, h0, block_t, block_h, th_mask, lse_layout)
    a = pltriton.load(prefix_out_ref.at[pl.ds(t0, block_t), pl.ds(h0, block_h), pl.ds(0, block_d)],
                      mask=thd_mask, other=0.0)
    b = pltriton.load(suffix_out_ref.at[pl.ds(t0, block_t), pl.ds(h0, block_h), pl.ds(0, block_d)],
                      mask=thd_mask, other=0.0)

    # docs/spec.md 4.1: +inf (FA2's empty row) and NaN read as -inf; a base-2 LSE stays base 2.
    p = _math.clean_lse(p_raw)
    s = _math.clean_lse(s_raw)
    if fused_mask:  # docs/spec.md 4.5: a token of a request whose prefix chunk is empty has p = -inf
        req, in_req = _token_requests(qsl_ref, t, t_mask, num_requests, fused_mask)
        empty_t = in_req & (cu_ref[req + 1] == cu_ref[req])
        p = jnp.where(empty_t[:, None], -jnp.inf, p)

    m, both_empty, z, wp, ws = two_way_weights(p, s, lse_base2)
    # docs/spec.md 4.3: a zero weight gives exactly 0, so NaN in an empty partial cannot leak.
    out = (jnp.where(wp[:, :, None] > 0.0, a.astype(jnp.float32) * wp[:, :, None], 0.0)
           + jnp.where(ws[:, :, None] > 0.0, b.astype(jnp.float32) * ws[:, :, None], 0.0))
    out = jnp.where(both_empty[:, :, None], 0.0, out)
    copy_t = t >= ptwc_ref[0]  # docs/spec.md 4.4
    out_block = out_ref.at[pl.ds(t0, block_t), pl.ds(h0, block_h), pl.ds(0, block_d)]
    if _math.is_nvfp4(group):  # docs/spec.md 4.8: scale_ref holds the global scale
        _store_nvfp4(out_ref, more_out_refs[-1], t0, h0, out, b, copy_t, th_mask, scale_ref[0])
    elif group is not None:  # docs/spec.md 4.7
        _store_group_fp8(out_block, more_out_refs[-1], t0, h0, out, b, copy_t, th_mask, thd_mask, *group)
    else:
        _store_output(out_block, out, b, copy_t, scale_ref, thd_mask, fp8_out)

    if output_lse:
        lse = _merged_lse(z, m, both_empty, copy_t, s_raw, lse_base2)
        _store_lse(more_out_refs[0], t0, h0, block_t, block_h, lse, th_mask, lse_layout)


_STATIC_ARGNAMES = ("return_lse", "out_dtype", "lse_layout", "lse_base2", "interpret", "group")


@functools.partial(jax.jit, static_argnames=_STATIC_ARGNAMES)
def _merge_jit(prefix_output, prefix_lse, suffix_output, suffix_lse, output_scale, query_start_loc,
               prefix_cu_seq_lens, prefill_tokens_with_context, *, return_lse, out_dtype, lse_layout, lse_base2,
               interpret, group=None):
    num_tokens, num_heads, head_dim = prefix_output.shape
    prefill_tokens = checks.prefill_tokens_array(prefill_tokens_with_context, num_tokens)
    out_struct, scale_struct = ((prefix_output.shape, out_dtype), None) if group is None else \
        _math.quantized_shapes(num_tokens, num_heads, head_dim, group)
    if num_tokens == 0 or num_heads == 0:
        empty_out = jnp.zeros(*out_struct)
        scales = None if group is None else _math.scale_layout(jnp.zeros(*scale_struct), group[2])
        return jnp_fallback._results(empty_out, jnp.zeros(prefix_lse.shape, jnp.float32) if return_lse else None,
                                     scales)
    fused = query_start_loc is not None and query_start_loc.shape[0] > 1  # R = 0: nothing to mask
    fp8 = output_scale is not None
    dummy_i32 = jnp.zeros((1,), jnp.int32)
    variant = tiles.merge_variant(return_lse, fused)
    itemsize = jnp.dtype(prefix_output.dtype).itemsize
    block_t, block_h, block_d = tiles.merge_tiles("pallas", num_heads, head_dim, variant, itemsize)
    kernel = functools.partial(
        _merge_attn_states_kernel, num_tokens=num_tokens, num_heads=num_heads, head_dim=head_dim,
        num_requests=query_start_loc.shape[0] - 1 if fused else 0,
        block_t=block_t, block_h=block_h, block_d=block_d,
        lse_layout=lse_layout, lse_base2=lse_base2, output_lse=return_lse, fused_mask=fused, fp8_out=fp8,
        group=None if group is None else group[:2])
    operands = (prefix_output, prefix_lse, suffix_output, suffix_lse)
    out_shape = [sharding.out_struct(*out_struct, *operands)]
    if return_lse:
        out_shape.append(sharding.out_struct(prefix_lse.shape, jnp.float32, *operands))
    if group is not None:
        out_shape.append(sharding.out_struct(*scale_struct, *operands))
    results = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=tiles.merge_grid("pallas", num_tokens, num_heads, head_dim, variant, itemsize),
        interpret=interpret,
        compiler_params=_backend.compiler_params(num_warps=tiles.merge_num_warps("pallas", variant)),
        name="merge_attn_states",
    )(prefix_output, prefix_lse, suffix_output, suffix_lse,
      output_scale.reshape(1) if fp8 else jnp.ones((1,), jnp.float32),
      query_start_loc if fused else dummy_i32, prefix_cu_seq_lens if fused else dummy_i32, prefill_tokens)
    if group is not None:
        results = [*results[:-1], _math.scale_layout(results[-1], group[2])]
    return tuple(results) if len(results) > 1 else results[0]


def merge_attn_states(prefix_output, prefix_lse, suffix_output, suffix_lse, *,
                      prefill_tokens_with_context=None, query_start_loc=None, prefix_cu_seq_lens=None,
                      return_lse=True, out_dtype=None, output_scale=None, lse_layout="HT", lse_base=math.e,
                      group_size=None, scale_ue8m0=False, scale_layout="row", interpret=None, implementation=None,
                      backend=None, validate=False):
    """Merge two attention partials by their LSEs (docs/spec.md 4). Functional and jit-friendly.

    Args:
      prefix_output, suffix_output: dtype[T, H, D], fp32/fp16/bf16, one dtype. (JAX arrays have no strides:
        slice a V-padded buffer before the call.)
      prefix_lse, suffix_lse: f32[H, T] ([T, H] with lse_layout="TH"), natural log unless lse_base=2.
        +inf and NaN mean an empty partial.
      prefill_tokens_with_context: None (= T) or an integer scalar, traced or not. Tokens at or past it copy
        the suffix row and LSE bits. Changing it never recompiles.
      query_start_loc, prefix_cu_seq_lens: i32[R+1] both or neither: the fused mask (docs/spec.md 4.5). Traced.
      return_lse: also return the merged LSE (same layout and base).
      out_dtype: None (the inputs' dtype), float32/float16/bfloat16 whatever the inputs' dtype (one rounding at the
        store), float8_e4m3fn, which needs output_scale, or float4_e2m1fn: NVFP4 (docs/spec.md 4.8; D a power of
        two from 16), returned as u8[T, H, D / 2] (two e2m1 codes a byte, element 2j in the low nibble) with its
        float8_e4m3fn block scales last, one per 16 elements, in scale_layout "row" [T, H * D / 16] or
        "swizzled" (the FP4 GEMMs' 128x4-swizzled flat buffer, its padding 0).
      output_scale: f32 scalar or f32[1], for an fp8 output (docs/spec.md 4.6), or NVFP4's global scale (4.8).
      lse_layout: "HT" or "TH", for all LSEs.
      lse_base: math.e or 2, for all LSEs.
      group_size: per-group FP8 (docs/spec.md 4.7): the output is float8_e4m3fn (out_dtype None or fp8, no
        output_scale), quantized per group of group_size elements of each head row (a power of two from 16
        dividing D, D a power of two), and its f32 scales are returned last.
      scale_ue8m0: the per-group scales rounded up to powers of two (DeepGEMM's UE8M0).
      scale_layout: the scales' layout: "row" f32[T, H * D / G], "col" f32[H * D / G, T], or "col_tma" f32[H * D /
        G, T padded to a multiple of 4] (DeepGEMM's TMA-aligned column-major; the padding is 0).
      interpret: None interprets on CPU and compiles on GPU.
      implementation: None (Pallas on GPU, jnp elsewhere), "pallas" or "jnp"; an explicit choice never
        falls back.
      backend: the Pallas GPU backend of implementation="pallas": None or "triton" (the default), or
        "mosaic_gpu" (experimental, jax >= 0.11; docs/design.md, "Mosaic GPU backend").
      validate: also check offset values and prefill_tokens_with_context on the host (not under jit).

    Returns:
      (out dtype[T, H, D], lse f32) if return_lse else out; with group_size or NVFP4 the scales follow: (out, lse,
      scales) or (out, scales).

    Raises:
      TypeError: an array of the wrong dtype.
      ValueError: wrong ranks or shapes, mismatched offsets, bad options.
      NotImplementedError: implementation="pallas" on a platform without Pallas GPU; backend="mosaic_gpu"
        with jax < 0.11, or for a shape its kernel does not take.
    """
    args = (prefix_output, prefix_lse, suffix_output, suffix_lse, output_scale, query_start_loc, prefix_cu_seq_lens,
            prefill_tokens_with_context)
    plan = plans.cached_plan(_PLANS, _merge_plan, args,
                             (return_lse, out_dtype, lse_layout, lse_base, interpret, implementation, backend,
                              group_size, scale_ue8m0, scale_layout), backend)
    if validate:
        num_tokens = prefix_output.shape[0]
        if query_start_loc is not None:
            checks.check_offset_values(query_start_loc, prefix_cu_seq_lens, num_tokens, cu_name="prefix_cu_seq_lens")
        checks.check_prefill_tokens(prefill_tokens_with_context, num_tokens, validate)
    _backend.check_compile_target(interpret, implementation, backend, prefix_output)
    results = plan(*args)
    return _math.with_swizzled_scales(results) if scale_layout == "swizzled" else results


_PLANS: dict = {}  # plans.cached_plan


def _merge_plan(prefix_output, prefix_lse, suffix_output, suffix_lse, output_scale, query_start_loc,
                prefix_cu_seq_lens, prefill_tokens_with_context, return_lse, out_dtype, lse_layout, lse_base, interpret,
                implementation, backend, group_size=None, scale_ue8m0=False, scale_layout="row"):
    """The static checks of `merge_attn_states` and its call for arguments of these types (`plans.cached_plan`)."""
    checks.check_lse_layout(lse_layout)
    lse_base2 = checks.check_lse_base(lse_base)
    checks.check_array("prefix_output", prefix_output, ndim=3, dtypes=checks.OUTPUT_DTYPES)
    checks.check_array("suffix_output", suffix_output, ndim=3, dtypes=(prefix_output.dtype,))
    if suffix_output.shape != prefix_output.shape:
        raise ValueError(f"suffix_output must match prefix_output [T, H, D]; got suffix_output.shape="
                         f"{tuple(suffix_output.shape)}, prefix_output.shape={tuple(prefix_output.shape)}")
    num_tokens, num_heads, _ = prefix_output.shape
    for name, x in (("prefix_lse", prefix_lse), ("suffix_lse", suffix_lse)):
        checks.check_array(name, x, ndim=2, dtypes=(jnp.float32,))
        checks.check_lse_shape(name, x.shape, lse_layout, num_heads, num_tokens)
    out_dtype, group = checks.check_output_options(out_dtype, prefix_output.dtype, output_scale, group_size,
                                                   scale_ue8m0, scale_layout, prefix_output.shape[2])
    if checks.check_fused_pair(query_start_loc, prefix_cu_seq_lens, "prefix_cu_seq_lens"):
        checks.check_offsets(query_start_loc, prefix_cu_seq_lens, cu_name="prefix_cu_seq_lens")
    checks.check_prefill_tokens(prefill_tokens_with_context, num_tokens, False)
    impl = _backend.resolve_implementation(implementation, backend)
    backend = _backend.resolve_backend(backend)
    options = dict(return_lse=return_lse, out_dtype=out_dtype, lse_layout=lse_layout, lse_base2=lse_base2)
    if group is not None:  # NVFP4's swizzled block scales: the call's row-major ones, rearranged after it
        options["group"] = group[:2] + ("row",) if group[2] == "swizzled" else group
    if impl == "jnp":
        return functools.partial(jnp_fallback.merge_attn_states, **options)
    interpret = _backend.resolve_interpret(interpret, backend)
    _backend.check_fp8_lowering(output_scale is not None or group is not None, interpret, backend)
    lse_axis = 0 if lse_layout == "HT" else 1
    if backend == "mosaic_gpu":
        from pallas_impl.mosaic.merge import merge_mosaic

        fn = functools.partial(merge_mosaic, **options, interpret=interpret)
    else:
        fn = functools.partial(_merge_jit, **options, interpret=interpret)
    return sharding.call_plan(
        fn,
        ("prefix_output", "prefix_lse", "suffix_output", "suffix_lse", "output_scale", "query_start_loc",
         "prefix_cu_seq_lens", "prefill_tokens_with_context"),
        (prefix_output, prefix_lse, suffix_output, suffix_lse, output_scale, query_start_loc, prefix_cu_seq_lens,
         prefill_tokens_with_context),
        (1, lse_axis, 1, lse_axis, None, None, None, None),
        sharding.out_head_axes(return_lse, lse_axis, options.get("group")), interpret=interpret)
