"""The context-parallel rescale kernel (docs/spec.md 9, method "reduce_scatter") on Mosaic GPU:
`backend="mosaic_gpu"`.

Experimental (docs/design.md, "Mosaic GPU backend"): tested against the reference in jax's Mosaic GPU interpreter
(tests/test_pallas_mosaic.py).

Each device scales its own partial by its N-way weight, as `pallas_impl/cp_merge.py`'s Triton-backend kernel does,
in its order: the N-way maximum and sum of every device's LSE (`_math.n_way_max_and_sum`), `w = exp(lse_rank - m) /
z` (base 2: `exp((lse_rank - m) * ln2)`), the weighted tile behind a select, 0 where every partial is empty, and on
pass-through tokens the last device's own row (the others -0.0). Grid and pipeline: those of the 2-way merge
(`merge.py`), one input. What runs in XLA around the kernel: `_common` (the fused mask's token flags, the layout;
the pass-through LSE).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_impl import _checks, _sharding
from pallas_impl import _math
from pallas_impl.mosaic import _common as mc

F32 = jnp.float32


def _kernel(num_partials: int, num_tokens: int, num_heads: int, head_dim: int, dc: int, out_type, *,
            output_lse: bool, empty_rows: bool, copy_rows: bool, lse_base2: bool, interpret: bool):
    """This device's weighted partial `[T', H * D]` (T' >= 128) from the raw `[N * H * T']` LSE rows."""
    plgpu = mc.plgpu()
    tune = mc.TUNING["cp_rescale"]
    bt, steps = mc.BLOCK_T, tune["steps"]
    nc = head_dim // dc
    nsplit = pl.cdiv(pl.cdiv(num_tokens, bt), steps)
    last = num_partials - 1
    L = plgpu.Layout.WGMMA

    def body(x_g, l_g, r_g, *rest):
        # e_g: f32[N * T'], 1 on the fused mask's tokens; c_g: f32[T'], 1 where t copies the last partial
        e_g, c_g, o_g, lo_g, *rest = mc.optional_refs(rest, empty_rows, copy_rows, True, output_lse)
        w_smem, o_scr = rest  # rows of w_smem: this device's weight, the all-empty flag, the copy flag
        hc = lax.axis_index("hc")
        sp = lax.axis_index("s")
        h = hc // nc
        rank = r_g[0]

        def step(idx, x_s):
            (i,) = idx
            t0 = mc.tile_start(sp, i, num_tokens, steps)
            def row_of(k):  # partial k's LSE row of the tile, one element per thread
                row = mc.strided_row(l_g, (k * num_heads + h) * num_tokens + t0)
                if empty_rows:
                    row = jnp.where(mc.strided_row(e_g, k * num_tokens + t0) > 0, -jnp.inf, row)
                return _math.clean_lse(row)

            if num_partials <= mc.WEIGHT_ROWS:  # unrolled, each row loaded once
                rows = [row_of(k) for k in range(num_partials)]
                m, all_empty, _, z = _math.n_way_max_and_sum(rows.__getitem__, num_partials, lse_base2, unroll=True)
            else:  # runtime loops over the devices (`_math.fold_partials`), each row loaded per loop
                m, all_empty, _, z = _math.n_way_max_and_sum(row_of, num_partials, lse_base2)
            w_smem[0] = _math.exp_base(row_of(rank) - m, lse_base2) / z  # 8.2, 8.3: partial `rank`'s weight
            w_smem[1] = jnp.where(all_empty, 1.0, 0.0)
            if copy_rows:
                w_smem[2] = mc.strided_row(c_g, t0)
            if output_lse:  # the merged LSE of every head (the caller keeps its own)
                @pl.when(hc % nc == 0)
                def _():
                    lo_g[pl.ds(h * num_tokens + t0, bt)] = _math.merged_lse(z, m, all_empty, lse_base2)

            x = mc.load(x_s, L).astype(F32)
            row = lambda k: jnp.broadcast_to(mc.load(w_smem.at[k], L.reduce(1))[:, None], (bt, dc))  # noqa: E731
            wb = row(0)
            scaled = jnp.where(wb > 0, x * wb, 0.0)  # 4.3: a zero weight gives exactly 0
            scaled = jnp.where(row(1) > 0, 0.0, scaled)
            if copy_rows:  # 8.4: the last partial's row, exactly; the other devices add -0.0 (x + -0.0 == x)
                mine = jnp.where(jnp.broadcast_to(rank == last, (bt, dc)), x, -0.0)
                scaled = jnp.where(row(2) > 0, mine, scaled)
            mc.store_tile(scaled, o_scr, o_g.at[pl.ds(t0, bt), pl.ds(hc * dc, dc)], i)

        tile = plgpu.BlockSpec((pl.Element(bt), dc), lambda i: (mc.tile_start(sp, i, num_tokens, steps), hc))
        plgpu.emit_pipeline(step, grid=(steps,), in_specs=[tile], max_concurrent_steps=tune["concurrent"])(x_g)
        plgpu.wait_smem_to_gmem(0)

    scratch = [plgpu.SMEM((3, bt), F32), plgpu.SMEM((tune["stores"], bt, dc), out_type[0].dtype)]
    return mc.kernel(body, out_type=tuple(out_type), grid=(num_heads * nc, nsplit), grid_names=("hc", "s"),
                     scratch_types=scratch, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("reduce_dtype", "return_lse", "lse_layout", "lse_base2", "interpret"))
def rescale_mosaic(part, lses, query_start_loc, cu_seq_lens, prefill_tokens_with_context, rank, *, reduce_dtype,
                   return_lse, lse_layout, lse_base2, interpret):
    """`pallas_impl.cp_merge`'s rescale (`_rescale_jit`'s arguments and results) with backend="mosaic_gpu"."""
    num_partials = lses.shape[0]
    num_tokens, num_heads, head_dim = part.shape
    tune = mc.TUNING["cp_rescale"]
    cols, dc = mc.head_plan(head_dim, part.dtype, tune["tile_bytes"], out_dtype=reduce_dtype,  # cols >= D: TMA rows
                            input_tiles=tune["concurrent"], out_slots=tune["stores"], other_bytes=3 * mc.BLOCK_T * 4)
    prefill = _checks.prefill_tokens_array(prefill_tokens_with_context, num_tokens)
    copy_t = jnp.arange(num_tokens, dtype=jnp.int32) >= prefill[0]
    empties = mc.fused_empties(query_start_loc, cu_seq_lens, num_tokens)
    lf = mc.stacked_lse_rows(lses, lse_layout)
    copy_rows = prefill_tokens_with_context is not None
    args = [mc.padded_rows(mc.padded_heads(part, cols).reshape(num_tokens, num_heads * cols), num_tokens, 0), lf,
            jnp.asarray(rank, jnp.int32).reshape(1)]
    if empties is not None:
        args.append(mc.flag_rows(empties))
    if copy_rows:
        args.append(mc.flag_rows(copy_t))
    tp = max(num_tokens, mc.BLOCK_T)
    out_type = [_sharding.out_struct((tp, num_heads * cols), reduce_dtype, *args)]
    if return_lse:
        out_type.append(_sharding.out_struct((num_heads * tp,), F32, *args))
    results = _kernel(num_partials, tp, num_heads, cols, dc, out_type, output_lse=return_lse,
                      empty_rows=empties is not None, copy_rows=copy_rows, lse_base2=lse_base2,
                      interpret=interpret)(*args)
    res = mc.finish(results, part.shape, copy_t, None, mc.last_lse_ht(lses, lse_layout, empties), None,
                    out_dtype=reduce_dtype, return_lse=return_lse, lse_layout=lse_layout, pass_through=copy_rows)
    return res if return_lse else (res, None)
