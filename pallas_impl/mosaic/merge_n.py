"""The N-way merge (docs/spec.md 8) as a Mosaic GPU kernel: `backend="mosaic_gpu"`.

Experimental (docs/design.md, "Mosaic GPU backend"): tested against the reference in jax's Mosaic GPU interpreter
(tests/test_pallas_mosaic.py) and, compiled, bit for bit against the Triton backend (`python -m parity check`).

Grid: `mc.Tiles` (by default `TUNING["merge_n"]["ctas_per_sm"]` persistent CTAs per SM, each taking every P-th
tile; with 0, (H * D / dc, token splits) CTAs of `steps` tiles). A CTA pipelines its tiles of 128 tokens of the
`[T, H * D]` view (`emit_pipeline`: TMA copies of `[128, dc]` tiles of every partial, `concurrent` in flight) over
(token tile, partial), carrying the f32 accumulator. The last tile is shifted to end at T, so no copy leaves
the arrays and overlapping tiles write identical values. At partial 0 a tile's weights are computed from the
N LSE rows into shared memory (up to N = `WEIGHT_ROWS`; beyond, m and z at partial 0 by runtime loops, and the
weights of `WEIGHT_ROWS` partials at a time at the first of them). Up to `mc.PREFETCH_PARTIALS` partials and T' a
multiple of 4 (`mc.prefetches_rows`), the next tile's rows (and flag rows) are copied into shared memory by TMA
when a tile starts, so they are there when it ends; else each thread loads its rows' elements from GMEM. With the
launch choice `th_boxes` (a candidate, `mc.lse_boxes`) a `[T, H]` LSE is read as it is: each CTA takes 8 heads of
one token tile, their `[N, 128, 8]` LSE boxes copied once, and writes its merged LSE the same way. At
partial N - 1 the tile is stored by hand (`emit_pipeline` writes an output block at the first step of its
index, not the last).

Float math, in the order of `pallas_impl/merge_n.py`: f32, `jnp.exp`/`jnp.log` (libdevice, approx_math off),
`/` (div.full, as Triton's), every product behind a `jnp.where` (Mosaic contracts a bare multiply-add into an
FMA), sums in index order from partial 0, one cast at the store. See `_common` for what runs in XLA around it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_impl import _checks
from pallas_impl import _math
from pallas_impl.mosaic import _common as mc

F32 = jnp.float32


def _kernel(num_partials: int, num_tokens: int, num_heads: int, head_dim: int, dc: int, out_type, *,
            output_lse: bool, empty_rows: bool, copy_rows: bool, lse_base2: bool, quant, prefetch: bool,
            boxes: bool, interpret: bool):
    """The merge kernel over stacked partials `[N, T', H * D]`, T' >= 128 (padded); quantized outputs
    quantized in registers (`quant`: `mc.output_plan`). `prefetch` (`mc.prefetches_rows`): the raw LSE rows come
    as `[N, H, T']` and each tile's rows (and flag rows) by TMA a tile ahead; `boxes` (`mc.lse_boxes`): the raw
    `[N, T', H]` LSEs in boxes of heads, each CTA's box (and flag rows) by TMA once, the weights computed in the
    tile's row layout and the merged LSE written `[T', H]` in boxes; else `[N * H * T']`, loaded per thread."""
    plgpu = mc.plgpu()
    tune = mc.merge_n_tuning(quant)
    nc = head_dim // dc
    tiles = mc.Tiles(num_tokens, num_heads * nc, tune, interpret, chunks_per_cta=mc.TH_HEADS * nc if boxes else 0)
    box_lse = boxes and output_lse  # the merged LSE in boxes of heads, carried over the CTA's tiles
    bt, steps = mc.BLOCK_T, tiles.steps
    L = plgpu.Layout.WGMMA
    R = L.reduce(1)  # a tile's rows, each where the tile's row layout holds it

    # The weights live in shared memory, `rows` partials at a time: every partial's up to WEIGHT_ROWS, else
    # blocks of WEIGHT_ROWS, each computed at its first partial from m and z (rows + 1, rows + 2).
    rows = min(num_partials, mc.WEIGHT_ROWS)
    blocks = num_partials > rows
    grouped = mc.grouped(quant)
    scaled = mc.has_scale_row(quant)  # a scale row in: the static fp8 scale, NVFP4's global scale
    scale_at = rows + (3 if blocks else 1)  # the row of w_smem holding that scale
    lse_at = scale_at + 1  # with `box_lse`, the row of w_smem holding the tile's merged LSE
    # Each compute warpgroup merges `[rw, width]` of a tile: all of it, or half its columns or its rows.
    wgs, rw, width = mc.warpgroup_tile(tune, quant, dc, out_type[0].dtype)
    by_rows = rw < bt

    def body(x_g, l_g, *rest):
        # x_g: the partials; l_g: the raw LSE rows, f32[N * H * T'] ((k * H + h) * T' + t) or, with prefetch,
        # f32[N, H, T']; e_g: f32[N * T'] (prefetch: [N, T']), 1 on the fused mask's tokens; c_g: f32[T'], 1 where t
        # copies the last partial; q_g: f32[128], the static fp8 scale or NVFP4's global scale; g_g: the
        # scales, a row per group
        e_g, c_g, q_g, o_g, g_g, lo_g, *rest = mc.optional_refs(rest, empty_rows, copy_rows, scaled, True,
                                                                grouped, output_lse)
        # rows of w_smem: the weights, the all-empty flag (, m, z with blocks) (, the static or global scale)
        w_smem, row_smem, o_scr, *q_scr = rest
        if prefetch:  # the row buffers (two slots each: this tile's, the next one's) and their barriers
            bufs, row_bar, q_scr = q_scr[:prefetch_refs], q_scr[prefetch_refs], q_scr[prefetch_refs + 1:]
        if boxes:  # this CTA's token tile of every LSE's box of its heads (and flag rows), once, before its tiles
            q_scr, box_refs, box_bar = q_scr[:-box_count - 1], q_scr[-box_count - 1:-1], q_scr[-1]
            l_box, e_box, c_box = mc.optional_refs(box_refs, True, empty_rows, copy_rows)
            hc0, t00 = tiles.at(0)
            head0 = hc0 // nc
            plgpu.copy_gmem_to_smem(l_g.at[:, pl.ds(t00, bt), pl.ds(head0, mc.TH_HEADS)], l_box, box_bar)
            if empty_rows:
                plgpu.copy_gmem_to_smem(e_g.at[:, pl.ds(t00, bt)], e_box, box_bar)
            if copy_rows:
                plgpu.copy_gmem_to_smem(c_g.at[pl.ds(t00, bt)], c_box, box_bar)
            plgpu.barrier_wait(box_bar)
        # With two compute warpgroups (and a third issuing the TMA copies), warpgroup wg merges columns
        # [wg * width, (wg + 1) * width) of each tile, or rows [wg * rw, (wg + 1) * rw) (`by_rows`), with its own
        # weight rows (all 128 computed by each), output slots and quantization scratch.
        wg = lax.axis_index("wg") if wgs > 1 else 0
        mine = lambda r: r.at[pl.ds(wg * rw, rw)] if by_rows else r  # noqa: E731 - its part of a row
        w_smem, row_smem, o_scr = mc.per_warpgroup_refs((w_smem, row_smem, o_scr), wg, wgs)
        if prefetch:
            l_buf, e_buf, c_buf = mc.optional_refs(mc.per_warpgroup_refs(bufs, wg, wgs), True, empty_rows,
                                                   copy_rows)

            def fetch(i, slot):
                """Tile i's rows into `slot` of the row buffers, on that slot's barrier (one per warpgroup)."""
                hc, t0 = tiles.at(i)
                barrier = row_bar.at[wg * 2 + slot]
                plgpu.copy_gmem_to_smem(l_g.at[:, hc // nc, pl.ds(t0, bt)], l_buf.at[slot], barrier)
                if empty_rows:
                    plgpu.copy_gmem_to_smem(e_g.at[:, pl.ds(t0, bt)], e_buf.at[slot], barrier)
                if copy_rows:
                    plgpu.copy_gmem_to_smem(c_g.at[pl.ds(t0, bt)], c_buf.at[slot], barrier)

            mc.when_computing(wg, wgs, lambda: fetch(0, 0))
        q_scr = mc.warpgroup_quant_scratch(q_scr, wg, wgs)

        def step(idx, x_s, carry):
            i, n = idx
            hc, t0 = tiles.at(i)
            h = hc // nc
            acc, lse_box = carry if box_lse else (carry, None)

            def lse_of(k):  # partial k's raw LSE row of the tile (k may be traced), one element per thread
                if prefetch:
                    x = mc.strided_row(l_buf.at[i % 2, k], 0)
                    e = mc.strided_row(e_buf.at[i % 2, k], 0) if empty_rows else None
                else:
                    x = mc.strided_row(l_g, (k * num_heads + h) * num_tokens + t0)
                    e = mc.strided_row(e_g, k * num_tokens + t0) if empty_rows else None
                if empty_rows:
                    x = jnp.where(e > 0, -jnp.inf, x)
                return _math.clean_lse(x)

            @pl.when(n == 0)
            def _sums():  # docs/spec.md 8.2, 8.3
                if prefetch:  # this tile's rows have come; the next tile's into the other slot, once every thread
                    # is past the reads of that slot (the previous tile's: its flags at its last step)
                    plgpu.barrier_wait(row_bar.at[wg * 2 + i % 2])
                    plgpu.commit_smem()

                    @pl.when(i + 1 < steps)
                    def _():
                        fetch(i + 1, 1 - i % 2)
                if boxes:  # each partial's column of its box, in the tile's row layout (no relayout)
                    def box_lse_of(k):
                        x = mc.lse_column(l_box.at[k], h, R)
                        if empty_rows:
                            x = jnp.where(mc.load(e_box.at[k], R) > 0, -jnp.inf, x)
                        return _math.clean_lse(x)

                    m, all_empty, e, z = _math.n_way_max_and_sum([box_lse_of(k) for k in range(num_partials)]
                                                                 .__getitem__, num_partials, lse_base2, unroll=True)
                    for k in range(num_partials):
                        w_smem[k] = e[k] / z
                    if box_lse:
                        w_smem[lse_at] = _math.merged_lse(z, m, all_empty, lse_base2)
                elif blocks:  # the loops over the partials run at runtime (`_math.fold_partials`)
                    m, all_empty, _, z = _math.n_way_max_and_sum(lse_of, num_partials, lse_base2,
                                                                  exp_step=tune["lse_step"])
                    w_smem[rows + 1] = m
                    w_smem[rows + 2] = z
                else:
                    ls = [lse_of(k) for k in range(num_partials)]
                    m, all_empty, e, z = _math.n_way_max_and_sum(ls.__getitem__, num_partials, lse_base2,
                                                                 unroll=True)
                    for k in range(num_partials):
                        w_smem[k] = e[k] / z
                w_smem[rows] = jnp.where(all_empty, 1.0, 0.0)
                if scaled:
                    w_smem[scale_at] = mc.strided_row(q_g, 0)
                if output_lse and not boxes:
                    @pl.when((hc % nc == 0) & (wg == 0))
                    def _():
                        # per-thread stores: any alignment
                        lo_g[pl.ds(h * num_tokens + t0, bt)] = _math.merged_lse(z, m, all_empty, lse_base2)

            if blocks:
                @pl.when(n % rows == 0)
                def _weights():  # w_k = e_k / z of partials n .. n + rows - 1, e_k as the sum took it
                    m, z = mc.strided_row(w_smem.at[rows + 1], 0), mc.strided_row(w_smem.at[rows + 2], 0)
                    for j in range(rows):
                        k = jnp.minimum(n + j, num_partials - 1)  # past N: a row never read
                        w_smem[j] = _math.exp_base(lse_of(k) - m, lse_base2) / z

            row = lambda x: jnp.broadcast_to(x[:, None], (rw, width))  # noqa: E731
            wb = row(mc.load(mine(w_smem.at[n % rows if blocks else n]), R))
            if by_rows:
                x_s = x_s.at[pl.ds(wg * rw, rw), :]
            elif wgs > 1:
                x_s = x_s.at[:, pl.ds(wg * width, width)]
            x = mc.load(x_s, L)
            term = jnp.where(wb > 0, x.astype(F32) * wb, 0.0)  # 4.3: a zero weight gives exactly 0
            acc = jnp.where(jnp.broadcast_to(n == 0, term.shape), term, acc + term)

            @pl.when(n == num_partials - 1)
            def _store():
                out = jnp.where(row(mc.load(mine(w_smem.at[rows]), R)) > 0, 0.0, acc)
                copy = None
                if copy_rows:  # 8.4: the last partial's own bits (x is its tile at this step)
                    if boxes:
                        flags = mc.load(c_box, R)
                    elif prefetch:
                        flags = mc.load(mine(c_buf.at[i % 2]), R)
                    else:
                        row_smem[...] = mc.strided_row(c_g, t0)
                        flags = mc.load(mine(row_smem), R)
                    copy = row(flags) > 0
                result = mc.stored(out, x, copy, F32 if quant else o_scr.dtype)
                scale = mc.load(mine(w_smem.at[scale_at]), R) if scaled else None
                # 4.6, 4.7, 4.8: column chunk hc * wgs + wg of `width` columns, or chunk hc of rows from wg * rw
                chunk, row0 = (hc, wg * rw) if by_rows else (hc * wgs + wg, 0)
                mc.store_merged(result, quant, scale, q_scr, o_scr, o_g, g_g, t0, chunk, i, row0=row0)

            if box_lse:  # head h's column of the merged box (every column chunk of h writes the same values)
                return acc, mc.with_lse_column(lse_box, h, mc.load(w_smem.at[lse_at], R))
            return acc

        spec = plgpu.BlockSpec((None, pl.Element(bt), dc),
                               lambda i, n: (n, *tiles.at(i)[::-1]))

        def init_carry():
            acc = plgpu.layout_cast(jnp.zeros((rw, width), F32), L)
            return (acc, jnp.zeros((bt, mc.TH_HEADS), F32)) if box_lse else acc

        carry = mc.pipeline(step, (x_g,), grid=(steps, num_partials), in_specs=[spec], tune=tune, wgs=wgs,
                            init_carry=init_carry)
        if box_lse:
            mc.store_lse_box(carry[1], l_box.at[0], lo_g, t00, head0)
        plgpu.wait_smem_to_gmem(0)

    own = mc.per_warpgroup([plgpu.SMEM((lse_at + box_lse, bt), F32), plgpu.SMEM((bt,), F32),
                            mc.output_slots(tune["stores"], width, out_type[0].dtype, rw)], wgs)
    row_bufs = []
    if prefetch:
        row_bufs = mc.per_warpgroup([plgpu.SMEM(shape, F32) for shape, present in (
            ((2, num_partials, bt), True), ((2, num_partials, bt), empty_rows), ((2, bt), copy_rows)) if present],
                                    wgs)
        row_bufs.append(plgpu.Barrier(num_arrivals=len(row_bufs), num_barriers=2 * wgs))
    prefetch_refs = len(row_bufs) - 1
    box_bufs = [plgpu.SMEM(shape, F32) for shape, present in (
        ((num_partials, bt, mc.TH_HEADS), boxes), ((num_partials, bt), boxes and empty_rows),
        ((bt,), boxes and copy_rows)) if present]
    box_count = len(box_bufs)
    if boxes:
        box_bufs.append(plgpu.Barrier(num_arrivals=box_count))
    return mc.kernel(body, out_type=tuple(out_type), grid=tiles.grid, grid_names=tiles.names,
                     scratch_types=[*own, *row_bufs, *mc.quant_scratch(quant, tune["stores"], width, wgs, rw),
                                    *box_bufs],
                     interpret=interpret, **mc.warpgroups(wgs))


@functools.partial(jax.jit, static_argnames=("return_lse", "out_dtype", "lse_layout", "lse_base2", "group",
                                          "interpret"))
def merge_n_mosaic(outputs, lses, output_scale, query_start_loc, cu_seq_lens, prefill_tokens_with_context, *,
                   return_lse, out_dtype, lse_layout, lse_base2, interpret, group=None):
    """`pallas_impl.merge_attn_states_n` with backend="mosaic_gpu" (its arguments, checked there)."""
    num_partials, num_tokens, num_heads, head_dim = outputs.shape
    # NVFP4's launch choices for the head plan (the most shared memory); then as the kernel takes them
    tune = mc.merge_n_tuning((mc.NVFP4,) if group is not None and _math.is_nvfp4(group) else None)
    rows = min(num_partials, mc.WEIGHT_ROWS)
    tp = max(num_tokens, mc.BLOCK_T)
    boxes = mc.lse_boxes(tune, lse_layout, num_heads) and num_partials <= mc.PREFETCH_PARTIALS
    prefetch = mc.prefetches_rows(tune, tp, num_partials) and not boxes
    row_bytes = (rows + 5 + (2 * (2 * num_partials + 1) if prefetch else 0)
                 + ((mc.TH_HEADS + 1) * num_partials + 2 if boxes else 0)) * mc.BLOCK_T * 4
    plan = functools.partial(mc.head_plan, head_dim, outputs.dtype, tune["tile_bytes"],  # cols >= D: TMA rows
                             input_tiles=tune["concurrent"], out_slots=tune["stores"],
                             other_bytes=row_bytes * tune.get("compute_wgs", 1))
    quant, stored_dtype, (cols, dc) = mc.output_plan(out_dtype, output_scale, group, plan)
    tune = mc.merge_n_tuning(quant)
    prefill = _checks.prefill_tokens_array(prefill_tokens_with_context, num_tokens)
    copy_t = jnp.arange(num_tokens, dtype=jnp.int32) >= prefill[0]
    # XLA before the kernel: the fused mask's token flags (docs/spec.md 8.1), the layout, T < 128.
    empties = mc.fused_empties(query_start_loc, cu_seq_lens, num_tokens)
    lf = (mc.padded_rows(lses, num_tokens, -jnp.inf) if boxes  # [N, T', H]
          else mc.stacked_lse_rows(lses, lse_layout, flat=not prefetch))
    x = mc.padded_rows(mc.padded_heads(outputs, cols).reshape(num_partials, num_tokens, num_heads * cols),
                       num_tokens, 0)
    copy_rows = prefill_tokens_with_context is not None and not mc.stores_f32_rows(group, quant)
    args = [x, lf]
    if empties is not None:
        args.append(mc.flag_rows(empties, flat=not (prefetch or boxes), whole_rows=boxes))
    if copy_rows:
        args.append(mc.flag_rows(copy_t))
    out_type = mc.kernel_io(args, quant, output_scale, tp, num_heads, cols, stored_dtype, return_lse, boxes)
    results = _kernel(num_partials, tp, num_heads, cols, dc, out_type, output_lse=return_lse,
                      empty_rows=empties is not None, copy_rows=copy_rows, lse_base2=lse_base2, quant=quant,
                      prefetch=prefetch, boxes=boxes, interpret=interpret)(*args)
    # XLA after the kernel: NVFP4 (4.8), per-group scales' layout, the pass-through LSE (8.4), the layout.
    return mc.finish(results, outputs.shape[1:], copy_t, outputs[-1],
                     mc.last_lse_ht(lses, lse_layout, empties, boxes), output_scale, out_dtype=out_dtype,
                     return_lse=return_lse, lse_layout=lse_layout,
                     pass_through=prefill_tokens_with_context is not None, group=group, lse_boxes=boxes)
