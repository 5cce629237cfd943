"""Context-parallel combine (docs/spec.md section 9) on JAX collectives: the rescale kernel and the wrapper.

Called inside `jax.shard_map` over the context-parallel mesh axis: each device holds its partial
`(out [T, H, D], lse)` over its KV shard and its local KV offsets. The same two methods as
`triton_impl/cp_merge.py`:

- `gather`: `lax.all_gather` of the partials, LSEs and offsets, then the N-way merge (`merge_n.py`) on every
  device: the single-device N-way merge's bits; every device gets all heads (the result is invariant over the
  axis).
- `reduce_scatter`: `lax.all_gather` of the LSEs and offsets only; each device scales its own partial by its
  N-way weight (the rescale kernel, statement by statement the Triton one; with backend="mosaic_gpu"
  `mosaic/cp_merge.py`, the same bits), then `lax.psum_scatter` over heads:
  device r gets heads [r * H / N, (r + 1) * H / N). Within tolerance (the collective owns the sum order).

Device i of the axis is partial i of the N-way merge.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from mla_lse_common import tiles
from mla_lse_common.tiles import RESCALE_TILE_PARTIALS
from pallas_impl import _backend
from pallas_impl import _checks as checks
from pallas_impl import _math, jnp_fallback
from pallas_impl import _sharding as sharding
from pallas_impl._backend import pltriton
from pallas_impl._device import (_copied_lse, _load_lse, _max_and_sum, _merged_lse, _program_tile, _store_lse,
                                 _token_requests, _weighted)
from pallas_impl.merge_n import merge_attn_states_n


def _cp_rescale_kernel(
    # inputs
    part_ref,  # dtype[T, H, D] this device's partial
    lses_ref,  # f32[N, H, T] or f32[N, T, H] every device's LSE
    qsl_ref,  # i32[R+1] query_start_loc; unused unless fused_mask
    cu_ref,  # i32[N * (R+1)] every device's KV offsets, flattened; unused unless fused_mask
    ptwc_ref,  # i32[1] prefill_tokens_with_context
    rank_ref,  # i32[1] this device's partial index (lax.axis_index)
    # outputs
    scaled_ref,  # reduce dtype[T, H, D]: this device's weighted partial
    *out_lse_ref,  # f32 merged LSE of every head, when output_lse
    num_partials: int, num_tokens: int, num_heads: int, head_dim: int, num_requests: int,
    block_t: int, block_h: int, block_d: int, lse_layout: str, lse_base2: bool, output_lse: bool,
    fused_mask: bool,
):
    t0, h0, t, t_mask, th_mask, thd_mask = _program_tile(num_tokens, num_heads, head_dim, block_t, block_h, block_d)
    last = num_partials - 1
    rank = rank_ref[0]

    # This device's partial; the last partial's raw LSE is the pass-through LSE (8.4).
    o = pltriton.load(part_ref.at[pl.ds(t0, block_t), pl.ds(h0, block_h), pl.ds(0, block_d)], mask=thd_mask,
                      other=0.0)
    last_raw = _load_lse(lses_ref, t0, h0, block_t, block_h, th_mask, lse_layout, lead=(jnp.int32(last),))

    req, in_req = _token_requests(qsl_ref, t, t_mask, num_requests, fused_mask)
    # The N-way merge's weights (8.2, 8.3), for partial `rank` only.
    lse_i, m, all_empty, z = _max_and_sum(
        lses_ref, num_partials, lse_base2, output_lse, t0=t0, h0=h0, block_t=block_t, block_h=block_h,
        th_mask=th_mask, cu_ref=cu_ref, num_requests=num_requests, req=req, in_req=in_req, lse_layout=lse_layout,
        fused_mask=fused_mask)
    w = _math.exp_base(lse_i(rank) - m, lse_base2) / z
    scaled = _weighted(o, w)
    scaled = jnp.where(all_empty[:, :, None], 0.0, scaled)
    # 8.4: the last partial's row, exactly. The other devices add -0.0, the identity of the sum (x + -0.0 == x).
    copy_t = t >= ptwc_ref[0]
    scaled = jnp.where(copy_t[:, None, None], jnp.where(rank == last, o.astype(jnp.float32), -0.0), scaled)
    pltriton.store(scaled_ref.at[pl.ds(t0, block_t), pl.ds(h0, block_h), pl.ds(0, block_d)],
                   scaled.astype(scaled_ref.dtype), mask=thd_mask)

    if output_lse:  # the merged LSE (of every head: the caller keeps its own)
        lse = _merged_lse(z, m, all_empty, copy_t,
                          _copied_lse(last_raw, cu_ref, last, num_requests + 1, req, in_req, fused_mask), lse_base2)
        _store_lse(out_lse_ref[0], t0, h0, block_t, block_h, lse, th_mask, lse_layout)


@functools.partial(jax.jit, static_argnames=("reduce_dtype", "return_lse", "lse_layout", "lse_base2", "interpret"))
def _rescale_jit(part, lses, query_start_loc, cu_seq_lens, prefill_tokens_with_context, rank, *, reduce_dtype,
                 return_lse, lse_layout, lse_base2, interpret):
    num_partials = lses.shape[0]
    num_tokens, num_heads, head_dim = part.shape
    fused = query_start_loc is not None and query_start_loc.shape[0] > 1
    variant = tiles.merge_variant(return_lse, fused)
    itemsize = jnp.dtype(part.dtype).itemsize
    block_t, block_h, block_d = tiles.merge_tiles("pallas", num_heads, head_dim, variant, itemsize,
                                                  RESCALE_TILE_PARTIALS, lse_layout)
    kernel = functools.partial(
        _cp_rescale_kernel, num_partials=num_partials, num_tokens=num_tokens, num_heads=num_heads, head_dim=head_dim,
        num_requests=query_start_loc.shape[0] - 1 if fused else 0, block_t=block_t, block_h=block_h,
        block_d=block_d, lse_layout=lse_layout, lse_base2=lse_base2, output_lse=return_lse, fused_mask=fused)
    operands = (part, lses, rank)
    out_shape = [sharding.out_struct(part.shape, reduce_dtype, *operands)]
    if return_lse:
        out_shape.append(sharding.out_struct(lses.shape[1:], jnp.float32, *operands))
    dummy = jnp.zeros((1,), jnp.int32)
    results = pl.pallas_call(
        kernel, out_shape=out_shape,
        grid=tiles.merge_grid("pallas", num_tokens, num_heads, head_dim, variant, itemsize, RESCALE_TILE_PARTIALS,
                              lse_layout),
        interpret=interpret,
        compiler_params=_backend.compiler_params(
            num_warps=tiles.merge_num_warps("pallas", variant, RESCALE_TILE_PARTIALS, lse_layout)),
        name="cp_rescale",
    )(part, lses, query_start_loc if fused else dummy, cu_seq_lens.reshape(-1) if fused else dummy,
      checks.prefill_tokens_array(prefill_tokens_with_context, num_tokens), rank.reshape(1))
    return tuple(results) if return_lse else (results[0], None)


def _axis_size(axis_name) -> int:
    try:
        return lax.axis_size(axis_name)
    except NameError as e:
        raise ValueError(f"axis_name={axis_name!r} is not a mesh axis of the enclosing jax.shard_map (or vmap): call "
                         "cp_merge_attn_states inside jax.shard_map over the context-parallel axis") from e


def cp_merge_attn_states(out, lse, *, axis_name, query_start_loc=None, cu_seq_lens=None, method="gather",
                         prefill_tokens_with_context=None, return_lse=True, out_dtype=None, output_scale=None,
                         lse_layout="HT", lse_base=math.e, reduce_dtype=None, group_size=None, scale_ue8m0=False,
                         scale_layout="row", interpret=None, implementation=None, backend=None, validate=False):
    """Combine the attention partials of a context-parallel mesh axis (docs/spec.md section 9).

    Call inside `jax.shard_map` (or `jax.vmap` with an axis name) over `axis_name`; device i of the axis holds
    partial i of the N-way merge (docs/spec.md 8).

    Args:
      out: dtype[T, H, D], fp32/fp16/bf16: attention of all T queries over this device's KV shard.
      lse: f32[H, T] ([T, H] with lse_layout="TH"), its LSE; +inf and NaN mean empty.
      axis_name: the context-parallel mesh axis (N devices).
      query_start_loc: i32[R+1], replicated; cu_seq_lens: i32[R+1], THIS device's local KV offsets. Both or
        neither: a token of a request with no KV on device i gets partial i LSE -inf, whatever the backend left.
      method: "gather" (result [T, H, D], every head, on every device) or "reduce_scatter" (result [T, H / N, D]:
        device r's heads [r * H / N, (r + 1) * H / N); H must be a multiple of N).
      prefill_tokens_with_context: tokens at or past it copy the last device's row and LSE bits (8.4).
      return_lse: also return the merged LSE ([H, T], or [H / N, T] for "reduce_scatter"; layout and base kept).
      out_dtype, output_scale: None (the partials' dtype), float32/float16/bfloat16 (one rounding), or
        float8_e4m3fn with its scale (4.6).
      reduce_dtype: "reduce_scatter" only: None (float32: one rounding, at the end) or the partials' dtype.
      out_dtype float4_e2m1fn with output_scale (the global scale) and scale_layout "row" or "swizzled": NVFP4
        output (docs/spec.md 4.8), as for `merge_attn_states`: "gather" fused into the N-way merge,
        "reduce_scatter" on this device's reduced rows, after the sum.
      group_size, scale_ue8m0, scale_layout: per-group FP8 output (docs/spec.md 4.7), as for `merge_attn_states`;
        the scales (of this device's rows: every head, or its H / N heads) are returned last. "gather": fused
        into the N-way merge (its bits); "reduce_scatter": on the reduced rows, after the sum.
      interpret, implementation, backend, validate: as `merge_attn_states_n` (backend="mosaic_gpu": the N-way
        merge's and the rescale kernel's Mosaic GPU versions).

    Returns:
      (out, lse) if return_lse else out; with group_size or NVFP4 the scales follow.

    Raises:
      ValueError: axis_name not bound by an enclosing shard_map, H not a multiple of N for "reduce_scatter",
        offsets of the wrong shape (cu_seq_lens must be this device's i32[R+1]), bad options. All at trace time,
        before any collective runs.
      TypeError: an array of the wrong dtype.
    """
    checks.check_cp_method(method)
    num_partials = _axis_size(axis_name)
    checks.check_lse_layout(lse_layout)
    lse_base2 = checks.check_lse_base(lse_base)
    checks.check_array("out", out, ndim=3, dtypes=checks.OUTPUT_DTYPES)
    num_tokens, num_heads, head_dim = out.shape
    checks.check_array("lse", lse, ndim=2, dtypes=(jnp.float32,))
    checks.check_lse_shape("lse", lse.shape, lse_layout, num_heads, num_tokens)
    requested = out_dtype  # the N-way merge of "gather" takes the caller's (NVFP4's float4_e2m1fn, not its bytes)
    out_dtype, group = checks.check_output_options(out_dtype, out.dtype, output_scale, group_size, scale_ue8m0,
                                                   scale_layout, head_dim)
    if method == "reduce_scatter" and num_heads % num_partials:
        raise ValueError(f"method='reduce_scatter' splits the H={num_heads} heads over the N={num_partials} devices of "
                         f"axis {axis_name!r}: H must be a multiple of N (use method='gather')")
    if reduce_dtype is not None and jnp.dtype(reduce_dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(out.dtype)):
        raise TypeError(f"reduce_dtype must be None (float32), float32 or the partials' dtype {jnp.dtype(out.dtype).name}; "
                        f"got {jnp.dtype(reduce_dtype).name}")
    if checks.check_fused_pair(query_start_loc, cu_seq_lens, "cu_seq_lens"):
        if getattr(cu_seq_lens, "ndim", 1) == 2:
            raise ValueError(f"cu_seq_lens must be this device's local KV offsets i32[R+1] (the combine gathers every "
                             f"device's); got cu_seq_lens.shape={tuple(cu_seq_lens.shape)}")
        checks.check_offsets(query_start_loc, cu_seq_lens)
        if validate:
            checks.check_offset_values(query_start_loc, cu_seq_lens, num_tokens)
    checks.check_prefill_tokens(prefill_tokens_with_context, num_tokens, validate)
    impl = _backend.resolve_implementation(implementation, backend)
    backend = _backend.resolve_backend(backend)
    if backend == "mosaic_gpu":  # every refusal before the first collective is traced
        _backend.resolve_interpret(interpret, backend)  # jax >= 0.11

    gather = sharding.all_gather_replicated if method == "gather" else lax.all_gather
    lses = gather(lse, axis_name)
    cus = None if query_start_loc is None else gather(cu_seq_lens, axis_name)
    if method == "gather":
        return merge_attn_states_n(
            gather(out, axis_name), lses, prefill_tokens_with_context=prefill_tokens_with_context,
            query_start_loc=query_start_loc, cu_seq_lens=cus, return_lse=return_lse, out_dtype=requested,
            output_scale=output_scale, lse_layout=lse_layout, lse_base=lse_base, group_size=group_size,
            scale_ue8m0=scale_ue8m0, scale_layout=scale_layout, interpret=interpret, implementation=impl,
            backend=None if impl == "jnp" else backend)  # the jnp path takes no backend (Mosaic GPU refuses it)

    rank = lax.axis_index(axis_name).astype(jnp.int32)
    rdt = jnp.dtype(reduce_dtype or jnp.float32)
    if impl == "jnp":
        scaled, merged = jnp_fallback.cp_rescale(out, lses, query_start_loc, cus, prefill_tokens_with_context, rank,
                                                 reduce_dtype=rdt, return_lse=return_lse, lse_layout=lse_layout,
                                                 lse_base2=lse_base2)
    else:
        interp = _backend.resolve_interpret(interpret, backend)
        if backend == "mosaic_gpu":
            from pallas_impl.mosaic.cp_merge import rescale_mosaic as rescale
        else:
            rescale = _rescale_jit
        scaled, merged = sharding.sharded_call(
            functools.partial(rescale, reduce_dtype=rdt, return_lse=return_lse, lse_layout=lse_layout,
                              lse_base2=lse_base2, interpret=interp),
            ("out", "lses", "query_start_loc", "cu_seq_lens", "prefill_tokens_with_context", "rank"),
            (out, lses, query_start_loc, cus, prefill_tokens_with_context, rank),
            (None,) * 6, (None, None), interpret=interp)
    heads = num_heads // num_partials
    reduced = lax.psum_scatter(scaled, axis_name, scatter_dimension=1, tiled=True)  # [T, H / N, D]
    scales = None
    if group is not None:  # 4.7 / 4.8, after the sum: this device's rows quantized, its scales in their layout
        result, scales = jnp_fallback._stored_grouped(reduced.astype(jnp.float32), group, global_scale=output_scale)
    elif out_dtype == checks.FP8:  # 4.6, after the sum
        result = reduced.astype(jnp.float32) / jnp.asarray(output_scale, jnp.float32).reshape(-1)[0]
        result = jnp.where(result < -_math.FP8_E4M3_MAX, -_math.FP8_E4M3_MAX, result)
        result = jnp.where(result > _math.FP8_E4M3_MAX, _math.FP8_E4M3_MAX, result).astype(out_dtype)
    else:
        result = reduced.astype(out_dtype)
    axis = 0 if lse_layout == "HT" else 1
    lse_out = lax.dynamic_slice_in_dim(merged, rank * heads, heads, axis=axis) if return_lse else None
    return jnp_fallback._results(result, lse_out, scales)
