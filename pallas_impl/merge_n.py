"""N-way attention-state merge (docs/spec.md section 8): the Pallas GPU kernel and its functional wrapper.

The same algorithm as `triton_impl/merge_n.py`, statement by statement. Grid: `(cdiv(T, block_t) * cdiv(H,
block_h),)`, head blocks fastest; a program merges a [block_t, block_h, block_d] tile of every partial
(`tiles.MERGE_N_TILES`). The loops over the N partials unroll at trace time up to N = `constants.UNROLLED_PARTIALS`
and are runtime loops beyond (`lax.fori_loop`, an `scf.for` in the Triton IR; `_math.fold_partials`), so the compile
time stays short at every N; the same operations in the same order either way. Three passes over the partials' LSE
tiles (the largest LSE, the sum of the exponentials, the weighted sum of the outputs); an LSE tile is reloaded and
its exponential recomputed in each pass, as in the Triton kernel; up to UNROLLED_PARTIALS the first output tiles may
load before the passes (`tiles.early_outputs`), and beyond the output tiles load with the L2 policy `evict_first`
(`tiles.outputs_evict`). Beyond N_SPLIT_ABOVE (`tiles.split_passes`) the merge is two `pallas_call`s, as in Triton:
the first (`_merge_n_weights_kernel`) stores m and z (and, `tiles.split_weights`, every partial's exponential e_i,
its weight's numerator) in an f32 buffer, the merge kernel reads them (given_mz, given_w): the same bits. The
fused mask finds each token's request once and reads each partial's own KV offsets.

Float math (docs/spec.md 5), identical to the Triton kernel and, at N = 2, to `pallas_impl/merge.py`: f32,
`jnp.exp` and `jnp.log`, no FMA contraction, no flush-to-zero, division with `/`,
the sums in index order from partial 0, cast only at the store.
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
from pallas_impl._device import (_copied_lse, _load_lse, _lse_where, _max_and_sum, _merged_lse, _partial_lse,
                                 _program_tile, _store_group_fp8, _store_lse, _store_nvfp4, _store_output,
                                 _token_requests, _weighted)


def _store_max_and_sum(wlse_ref, t0, h0, block_t, block_h, th_mask, w_layout, m, all_empty, z):
    """m (-inf where every partial is empty) and z of `_max_and_sum` to planes 0 and 1 of the split merge's buffer
    (its first kernel; `w_layout`: the buffer's layout, `tiles.split_layout`), for `_given_max_and_sum`."""
    _store_lse(wlse_ref, t0, h0, block_t, block_h, jnp.where(all_empty, -jnp.inf, m), th_mask, w_layout,
               lead=(jnp.int32(0),))
    _store_lse(wlse_ref, t0, h0, block_t, block_h, z, th_mask, w_layout, lead=(jnp.int32(1),))


def _given_max_and_sum(wlse_ref, t0, h0, block_t, block_h, th_mask, w_layout):
    """(m, all_empty, z) of `_max_and_sum`, read back from the buffer `_store_max_and_sum` wrote: the same values."""
    m = _load_lse(wlse_ref, t0, h0, block_t, block_h, th_mask, w_layout, lead=(jnp.int32(0),))
    z = _load_lse(wlse_ref, t0, h0, block_t, block_h, th_mask, w_layout, lead=(jnp.int32(1),), other=1.0)
    all_empty = m == -jnp.inf
    return jnp.where(all_empty, 0.0, m), all_empty, z


def _merge_n_weights_kernel(
    lses_ref,  # f32[N, H, T] or f32[N, T, H]
    qsl_ref,  # i32[R+1] query_start_loc; unused unless fused_mask
    cu_ref,  # i32[N * (R+1)] each partial's KV offsets, flattened; unused unless fused_mask
    wlse_ref,  # output: f32[2 (+ N), H, T] or f32[2 (+ N), T, H] (w_layout): m, z (, e_i)
    *, num_partials: int, num_tokens: int, num_heads: int, num_requests: int, block_t: int, block_h: int,
    lse_layout: str, w_layout: str, lse_base2: bool, output_lse: bool, fused_mask: bool, store_weights: bool,
):
    """The first kernel of a split merge (`tiles.split_passes`): m and z of a [block_t, block_h] tile of LSE
    positions (`tiles.max_sum_tiles`) and, with store_weights, every partial's exponential e_i (the numerator of
    its weight w_i = e_i / z), stored as the sum takes it, for the merge kernel's weighted sum."""
    t0, h0, t, t_mask, th_mask, _ = _program_tile(num_tokens, num_heads, 1, block_t, block_h, 1)
    req, in_req = _token_requests(qsl_ref, t, t_mask, num_requests, fused_mask)

    def store_exp(i, e_i):  # plane 2 + i of the buffer
        _store_lse(wlse_ref, t0, h0, block_t, block_h, e_i, th_mask, w_layout, lead=(jnp.asarray(2 + i, jnp.int32),))

    _, m, all_empty, z = _max_and_sum(
        lses_ref, num_partials, lse_base2, output_lse, t0=t0, h0=h0, block_t=block_t, block_h=block_h,
        th_mask=th_mask, cu_ref=cu_ref, num_requests=num_requests, req=req, in_req=in_req, lse_layout=lse_layout,
        fused_mask=fused_mask, store_exp=store_exp if store_weights else None)
    _store_max_and_sum(wlse_ref, t0, h0, block_t, block_h, th_mask, w_layout, m, all_empty, z)


def _merge_attn_states_n_kernel(
    # inputs
    outs_ref,  # dtype[N, T, H, D]
    lses_ref,  # f32[N, H, T] or f32[N, T, H]
    scale_ref,  # f32[1] output scale; unused unless fp8_out
    qsl_ref,  # i32[R+1] query_start_loc; unused unless fused_mask
    cu_ref,  # i32[N * (R+1)] each partial's KV offsets, flattened; unused unless fused_mask
    wlse_ref,  # f32[2 (+ N), H, T] or f32[2 (+ N), T, H] (w_layout): the first kernel's m, z (, e_i); unused unless
    # given_mz
    ptwc_ref,  # i32[1] prefill_tokens_with_context: tokens at or past it copy the last partial (8.4)
    # outputs
    out_ref,  # out_dtype[T, H, D]
    *more_out_refs,  # f32 LSE of the merge, when output_lse; f32[T, H * D / G] per-group scales, when group
    num_partials: int, num_tokens: int, num_heads: int, head_dim: int, num_requests: int,
    block_t: int, block_h: int, block_d: int,
    lse_layout: str, w_layout: str, lse_base2: bool, output_lse: bool, fused_mask: bool, fp8_out: bool,
    given_mz: bool, given_w: bool, group=None,
):
    t0, h0, t, t_mask, th_mask, thd_mask = _program_tile(num_tokens, num_heads, head_dim, block_t, block_h, block_d)
    last = num_partials - 1

    evict = tiles.outputs_evict("pallas", num_partials) or None

    def tile(i):  # partial i's output tile
        return pltriton.load(outs_ref.at[jnp.asarray(i, jnp.int32), pl.ds(t0, block_t), pl.ds(h0, block_h),
                                         pl.ds(0, block_d)], mask=thd_mask, other=0.0, eviction_policy=evict)

    # The last partial: also the pass-through row and LSE (8.4). Its loads are issued first.
    b = tile(last)
    last_raw = _load_lse(lses_ref, t0, h0, block_t, block_h, th_mask, lse_layout, lead=(jnp.int32(last),))
    variant = tiles.merge_variant(output_lse, fused_mask)
    # Partials 0 .. k - 1: their output tiles load now, in flight through the LSE passes (`tiles.early_outputs`).
    early = [tile(i) for i in range(tiles.early_outputs("pallas", variant, num_partials))]

    req, in_req = _token_requests(qsl_ref, t, t_mask, num_requests, fused_mask)  # once for every partial
    tile_where = dict(t0=t0, h0=h0, block_t=block_t, block_h=block_h, th_mask=th_mask, cu_ref=cu_ref,
                      num_requests=num_requests, req=req, in_req=in_req, lse_layout=lse_layout, fused_mask=fused_mask)
    if given_mz:  # 8.2, 8.3: the first kernel's m and z
        lse_i = functools.partial(_partial_lse, lses_ref, **_lse_where(**tile_where))
        m, all_empty, z = _given_max_and_sum(wlse_ref, t0, h0, block_t, block_h, th_mask, w_layout)
    else:
        lse_i, m, all_empty, z = _max_and_sum(lses_ref, num_partials, lse_base2, output_lse, **tile_where)
    out_step = tiles.n_loops("pallas", variant)[2]

    def weight(i):  # w_i = e_i / z, e_i given by the first kernel (plane 2 + i of its buffer) or computed: same bits
        if given_w:
            e_i = _load_lse(wlse_ref, t0, h0, block_t, block_h, th_mask, w_layout,
                            lead=(jnp.asarray(2 + i, jnp.int32),), other=0.0)
        else:
            e_i = _math.exp_base(lse_i(i) - m, lse_base2)
        return e_i / z

    # out = sum_i w_i * o_i in index order.
    w_last = weight(last)
    if num_partials == 1:
        out = _weighted(b, w_last)
    else:
        def output_tile(i):  # an early tile, or its load now (i is traced only where no tile is early)
            return early[i] if early and i < len(early) else tile(i)

        out = _weighted(output_tile(0), weight(0))
        out = _math.fold_prefetched(  # unrolled or a runtime loop, as in n_way_max_and_sum
            1, num_partials - 1, output_tile,
            lambda i, o_i, out: out + _weighted(o_i, weight(i)), out,
            num_partials, out_step, tiles.out_stages("pallas", variant, num_partials))
        out = out + _weighted(b, w_last)
    out = jnp.where(all_empty[:, :, None], 0.0, out)
    copy_t = t >= ptwc_ref[0]  # 8.4
    out_block = out_ref.at[pl.ds(t0, block_t), pl.ds(h0, block_h), pl.ds(0, block_d)]
    if _math.is_nvfp4(group):  # docs/spec.md 4.8: scale_ref holds the global scale
        _store_nvfp4(out_ref, more_out_refs[-1], t0, h0, out, b, copy_t, th_mask, scale_ref[0])
    elif group is not None:  # docs/spec.md 4.7
        _store_group_fp8(out_block, more_out_refs[-1], t0, h0, out, b, copy_t, th_mask, thd_mask, *group)
    else:
        _store_output(out_block, out, b, copy_t, scale_ref, thd_mask, fp8_out)

    if output_lse:
        lse = _merged_lse(z, m, all_empty, copy_t,
                          _copied_lse(last_raw, cu_ref, last, num_requests + 1, req, in_req, fused_mask), lse_base2)
        _store_lse(more_out_refs[0], t0, h0, block_t, block_h, lse, th_mask, lse_layout)


_STATIC_ARGNAMES = ("return_lse", "out_dtype", "lse_layout", "lse_base2", "interpret", "group")


@functools.partial(jax.jit, static_argnames=_STATIC_ARGNAMES)
def _merge_n_jit(outputs, lses, output_scale, query_start_loc, cu_seq_lens, prefill_tokens_with_context, *,
                 return_lse, out_dtype, lse_layout, lse_base2, interpret, group=None):
    num_partials, num_tokens, num_heads, head_dim = outputs.shape
    lse_shape = lses.shape[1:]
    prefill_tokens = checks.prefill_tokens_array(prefill_tokens_with_context, num_tokens)
    out_struct, scale_struct = ((outputs.shape[1:], out_dtype), None) if group is None else \
        _math.quantized_shapes(num_tokens, num_heads, head_dim, group)
    if num_tokens == 0 or num_heads == 0:
        empty_out = jnp.zeros(*out_struct)
        scales = None if group is None else _math.scale_layout(jnp.zeros(*scale_struct), group[2])
        return jnp_fallback._results(empty_out, jnp.zeros(lse_shape, jnp.float32) if return_lse else None, scales)
    fused = query_start_loc is not None and query_start_loc.shape[0] > 1  # R = 0: nothing to mask
    fp8 = output_scale is not None
    dummy_i32 = jnp.zeros((1,), jnp.int32)
    variant = tiles.merge_variant(return_lse, fused)
    itemsize = jnp.dtype(outputs.dtype).itemsize
    block_t, block_h, block_d = tiles.merge_tiles("pallas", num_heads, head_dim, variant, itemsize, num_partials,
                                                  lse_layout)
    num_requests = query_start_loc.shape[0] - 1 if fused else 0
    qsl = query_start_loc if fused else dummy_i32
    cu = cu_seq_lens.reshape(-1) if fused else dummy_i32
    split = tiles.split_passes(num_partials)
    weights = split and tiles.split_weights("pallas", variant, lse_layout)
    w_layout = tiles.split_layout("pallas", variant, lse_layout)
    w_shape = lse_shape if w_layout == lse_layout else lse_shape[::-1]
    wlse = jnp.zeros((1,), jnp.float32)  # unused unless split
    if split:  # the first kernel: every LSE position's m and z (and the exponentials)
        ms_block_t, ms_block_h = tiles.max_sum_tiles("pallas", num_heads, lse_layout, fused)
        wlse = pl.pallas_call(
            functools.partial(_merge_n_weights_kernel, num_partials=num_partials, num_tokens=num_tokens,
                              num_heads=num_heads, num_requests=num_requests, block_t=ms_block_t, block_h=ms_block_h,
                              lse_layout=lse_layout, w_layout=w_layout, lse_base2=lse_base2, output_lse=return_lse,
                              fused_mask=fused, store_weights=weights),
            out_shape=sharding.out_struct((2 + num_partials * weights, *w_shape), jnp.float32, lses),
            grid=tiles.max_sum_grid("pallas", num_tokens, num_heads, lse_layout, fused),
            interpret=interpret,
            compiler_params=_backend.compiler_params(
                num_warps=tiles.max_sum_warps("pallas", lse_layout, fused)),
            name="merge_attn_states_n_weights",
        )(lses, qsl, cu)
    kernel = functools.partial(
        _merge_attn_states_n_kernel, num_partials=num_partials, num_tokens=num_tokens, num_heads=num_heads,
        head_dim=head_dim, num_requests=num_requests, block_t=block_t, block_h=block_h, block_d=block_d,
        lse_layout=lse_layout, w_layout=w_layout, lse_base2=lse_base2, output_lse=return_lse, fused_mask=fused,
        fp8_out=fp8, given_mz=split, given_w=weights, group=None if group is None else group[:2])
    out_shape = [sharding.out_struct(*out_struct, outputs, lses)]
    if return_lse:
        out_shape.append(sharding.out_struct(lse_shape, jnp.float32, outputs, lses))
    if group is not None:
        out_shape.append(sharding.out_struct(*scale_struct, outputs, lses))
    results = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=tiles.merge_grid("pallas", num_tokens, num_heads, head_dim, variant, itemsize, num_partials, lse_layout),
        interpret=interpret,
        compiler_params=_backend.compiler_params(num_warps=tiles.merge_num_warps("pallas", variant, num_partials,
                                                                                 lse_layout)),
        name="merge_attn_states_n",
    )(outputs, lses, output_scale.reshape(1) if fp8 else jnp.ones((1,), jnp.float32), qsl, cu, wlse, prefill_tokens)
    if group is not None:
        results = [*results[:-1], _math.scale_layout(results[-1], group[2])]
    return tuple(results) if len(results) > 1 else results[0]


def merge_attn_states_n(outputs, lses, *, prefill_tokens_with_context=None, query_start_loc=None,
                        cu_seq_lens=None, return_lse=True, out_dtype=None, output_scale=None, lse_layout="HT",
                        lse_base=math.e, group_size=None, scale_ue8m0=False, scale_layout="row", interpret=None,
                        implementation=None, backend=None, validate=False):
    """Merge N attention partials by their LSEs (docs/spec.md section 8). Functional and jit-friendly.

    Args:
      outputs: dtype[N, T, H, D], fp32/fp16/bf16 (an all-gather of the partials along a new leading axis);
        any N >= 0 (N = 0: output 0, LSE -inf).
      lses: f32[N, H, T] ([N, T, H] with lse_layout="TH"), natural log unless lse_base=2. +inf and NaN mean an
        empty partial.
      prefill_tokens_with_context: None (= T) or an integer scalar, traced or not. Tokens at or past it copy
        the last partial's row and LSE bits. Changing it never recompiles.
      query_start_loc, cu_seq_lens: i32[R+1] and i32[N, R+1], both or neither: the fused mask (8.1); a token of
        a request with no KV in partial i gives partial i LSE -inf. Traced.
      return_lse: also return the merged LSE (same layout and base).
      out_dtype: None (the inputs' dtype), float32/float16/bfloat16 whatever the inputs' dtype (one rounding at the
        store), float8_e4m3fn, which needs output_scale, or float4_e2m1fn (NVFP4, 4.8), as for
        `merge_attn_states`.
      output_scale: f32 scalar or f32[1], for an fp8 output (4.6), or NVFP4's global scale (4.8).
      lse_layout: "HT" or "TH", for all LSEs.
      lse_base: math.e or 2, for all LSEs.
      group_size, scale_ue8m0, scale_layout: per-group FP8 output, as for `merge_attn_states` (docs/spec.md 4.7);
        scale_layout also NVFP4's ("row" or "swizzled").
      interpret: None interprets on CPU and compiles on GPU.
      implementation: None (Pallas on GPU, jnp elsewhere), "pallas" or "jnp"; an explicit choice never falls
        back.
      backend: the Pallas GPU backend of implementation="pallas": None or "triton" (the default), or
        "mosaic_gpu" (experimental, jax >= 0.11; docs/design.md, "Mosaic GPU backend").
      validate: also check offset values and prefill_tokens_with_context on the host (not under jit).

    Returns:
      (out dtype[T, H, D], lse f32[H, T] or [T, H]) if return_lse else out; with group_size or NVFP4 the scales
      follow.

    Raises:
      TypeError: an array of the wrong dtype.
      ValueError: wrong ranks or shapes (outputs and lses disagreeing on N, cu_seq_lens not [N, R+1]), bad
        options.
      NotImplementedError: implementation="pallas" on a platform without Pallas GPU; backend="mosaic_gpu"
        with jax < 0.11, or for a shape its kernel does not take.
    """
    args = (outputs, lses, output_scale, query_start_loc, cu_seq_lens, prefill_tokens_with_context)
    plan = plans.cached_plan(_PLANS, _merge_n_plan, args,
                             (return_lse, out_dtype, lse_layout, lse_base, interpret, implementation, backend,
                              group_size, scale_ue8m0, scale_layout), backend)
    if validate:
        num_tokens = outputs.shape[1]
        if query_start_loc is not None:
            checks.check_offset_values(query_start_loc, cu_seq_lens, num_tokens)
        checks.check_prefill_tokens(prefill_tokens_with_context, num_tokens, validate)
    _backend.check_compile_target(interpret, implementation, backend, outputs)
    results = plan(*args)
    return _math.with_swizzled_scales(results) if scale_layout == "swizzled" else results


_PLANS: dict = {}  # plans.cached_plan


def _merge_n_plan(outputs, lses, output_scale, query_start_loc, cu_seq_lens, prefill_tokens_with_context, return_lse,
                  out_dtype, lse_layout, lse_base, interpret, implementation, backend, group_size=None, scale_ue8m0=False,
                  scale_layout="row"):
    """The static checks of `merge_attn_states_n` and its call for arguments of these types (`plans.cached_plan`)."""
    checks.check_lse_layout(lse_layout)
    lse_base2 = checks.check_lse_base(lse_base)
    checks.check_array("outputs", outputs, ndim=4, dtypes=checks.OUTPUT_DTYPES)
    num_partials, num_tokens, num_heads, _ = outputs.shape
    checks.check_array("lses", lses, ndim=3, dtypes=(jnp.float32,))
    if lses.shape[0] != num_partials:
        raise ValueError(f"outputs and lses disagree on N: outputs has {num_partials} partials, "
                         f"lses.shape={tuple(lses.shape)}")
    checks.check_lse_shape("lses", lses.shape, lse_layout, num_heads, num_tokens, num_partials=num_partials)
    out_dtype, group = checks.check_output_options(out_dtype, outputs.dtype, output_scale, group_size, scale_ue8m0,
                                                   scale_layout, outputs.shape[3])
    if checks.check_fused_pair(query_start_loc, cu_seq_lens, "cu_seq_lens"):
        checks.check_array("query_start_loc", query_start_loc, ndim=1, dtypes=(jnp.int32,))
        checks.check_array("cu_seq_lens", cu_seq_lens, ndim=2, dtypes=(jnp.int32,))
        if query_start_loc.shape[0] < 1:
            raise ValueError("query_start_loc must have R+1 >= 1 entries, got an empty array")
        want = (num_partials, query_start_loc.shape[0])
        if tuple(cu_seq_lens.shape) != want:
            raise ValueError(f"cu_seq_lens must be i32[N, R+1] = {list(want)} (each partial's KV offsets); got "
                             f"cu_seq_lens.shape={tuple(cu_seq_lens.shape)}")
    checks.check_prefill_tokens(prefill_tokens_with_context, num_tokens, False)
    impl = _backend.resolve_implementation(implementation, backend)
    backend = _backend.resolve_backend(backend)
    options = dict(return_lse=return_lse, out_dtype=out_dtype, lse_layout=lse_layout, lse_base2=lse_base2)
    if group is not None:  # NVFP4's swizzled block scales: the call's row-major ones, rearranged after it
        options["group"] = group[:2] + ("row",) if group[2] == "swizzled" else group
    if num_partials == 0:  # 8.2: no partial, every row empty (pass-through rows too); no kernel on any backend
        return functools.partial(jnp_fallback.empty_merge_n, **options)
    if impl == "jnp":
        return functools.partial(jnp_fallback.merge_attn_states_n, **options)
    interpret = _backend.resolve_interpret(interpret, backend)
    _backend.check_fp8_lowering(output_scale is not None or group is not None, interpret, backend)
    lse_axis = 0 if lse_layout == "HT" else 1
    if backend == "mosaic_gpu":
        from pallas_impl.mosaic.merge_n import merge_n_mosaic

        fn = functools.partial(merge_n_mosaic, **options, interpret=interpret)
    else:
        fn = functools.partial(_merge_n_jit, **options, interpret=interpret)
    return sharding.call_plan(
        fn,
        ("outputs", "lses", "output_scale", "query_start_loc", "cu_seq_lens", "prefill_tokens_with_context"),
        (outputs, lses, output_scale, query_start_loc, cu_seq_lens, prefill_tokens_with_context),
        (2, lse_axis + 1, None, None, None, None),
        sharding.out_head_axes(return_lse, lse_axis, options.get("group")), interpret=interpret)
