"""The 2-way merge (docs/spec.md 4) as a Mosaic GPU kernel: `backend="mosaic_gpu"`.

Experimental (docs/design.md, "Mosaic GPU backend"): tested against the reference in jax's Mosaic GPU interpreter
(tests/test_pallas_mosaic.py) and, compiled, bit for bit against the Triton backend (`python -m parity check`).

Grid: (H * D / dc, token splits) CTAs; a CTA pipelines `TUNING["merge"]["steps"]` tiles of 128 tokens of the
`[T, H * D]` views of the prefix and the suffix (`emit_pipeline`, TMA copies of `[128, dc]` tiles in). At each tile
the weights are computed one LSE row per thread, as the N-way kernel does, and relaid out through shared memory into
the tile's row layout. The tile's LSE rows (and flag rows) come with it by TMA where T' is a multiple of 4
(`mc.rows_by_tma`: an `[H, T']` row's stride is then whole 16-byte units); at other T each thread loads its row's
elements from GMEM a step ahead, in the pipeline's carry. XLA transposes a `[T, H]` LSE first, unless the
launch choice `th_boxes` (a candidate, `mc.lse_boxes`) has each CTA take 8 heads of one token tile, their
`[128, 8]` LSE boxes read once and the merged LSE written the same way. The merged tile leaves by a TMA
store from one of the output slots in shared memory, the previous store still in flight. The last tile is shifted to
end at T: no copy leaves the arrays, and overlapping tiles write identical values. Tiles of
`TUNING["merge"]["tile_bytes"]`, from `long_tokens` padded tokens `long_tile_bytes` (`mc.merge_tuning`). Launch
choices and their shared-memory budget: docs/design.md, "Mosaic GPU backend".

Float math in the order of `pallas_impl/merge.py`; what runs in XLA around the kernel: `_common`.
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


def _kernel(num_tokens: int, num_heads: int, head_dim: int, dc: int, out_type, *, output_lse: bool,
            empty_rows: bool, copy_rows: bool, lse_base2: bool, quant, lse_tma: bool, lse_boxes: bool,
            interpret: bool):
    """The merge of padded `[T', H * D]` prefix and suffix (T' >= 128) with raw LSE rows, `[H, T']` copied with each
    tile (`lse_tma`, `mc.rows_by_tma`), `[T', H]` boxes of heads copied once per CTA (`lse_boxes`, `mc.lse_boxes`)
    or `[H * T']` loaded per thread; quantized outputs quantized in registers (`quant`: `mc.output_plan`)."""
    plgpu = mc.plgpu()
    tune = mc.merge_tuning(num_tokens, mc.grouped(quant))
    nc = head_dim // dc
    tiles = mc.Tiles(num_tokens, num_heads * nc, tune, interpret, chunks_per_cta=mc.TH_HEADS * nc if lse_boxes else 0)
    bt, steps = mc.BLOCK_T, tiles.steps
    L = plgpu.Layout.WGMMA
    R = L.reduce(1)  # a tile's rows, each where the tile's row layout holds it
    # The weights in the tile's row layout from the rows in shared memory (lse_tma), else one row per thread,
    # relaid out through shared memory (`TUNING["merge"]["row_weights"]`). Not with the merged LSE, which leaves
    # by per-thread stores one row per thread: the same rows in both layouts in one kernel fail Mosaic GPU's
    # layout inference (jax 0.11.2).
    row_weights = lse_tma and tune.get("row_weights", False) and (lse_boxes or not output_lse)
    box_lse = lse_boxes and output_lse  # the merged LSE in boxes of heads, carried over the CTA's tiles
    grouped = mc.grouped(quant)
    scaled = mc.has_scale_row(quant)  # a scale row in: the static fp8 scale, NVFP4's global scale
    # Each compute warpgroup merges `[rw, width]` of a tile: all of it, or half its columns or its rows.
    wgs, rw, width = mc.warpgroup_tile(tune, quant, dc, out_type[0].dtype)
    by_rows = rw < bt

    def body(a_g, b_g, p_g, s_g, *rest):
        # e_g: f32[T'], 1 on the fused mask's tokens; c_g: f32[T'], 1 where t copies the suffix; q_g: f32[128],
        # the static fp8 scale or NVFP4's global scale; g_g: the scales, a row per group
        e_g, c_g, q_g, o_g, g_g, lo_g, *rest = mc.optional_refs(rest, empty_rows, copy_rows, scaled, True,
                                                                grouped, output_lse)
        # rows of w_smem: wp, ws, both-empty flag, copy flag, static or global scale
        w_smem, o_scr, *q_scr = rest
        if lse_boxes:  # this CTA's token tile of both LSEs' boxes of its heads, once, before its tiles
            *q_scr, boxes, box_bar = q_scr
            hc0, t00 = tiles.at(0)
            head0 = hc0 // nc
            for k, x_g in enumerate((p_g, s_g)):
                plgpu.copy_gmem_to_smem(x_g.at[pl.ds(t00, bt), pl.ds(head0, mc.TH_HEADS)], boxes.at[k], box_bar)
            plgpu.barrier_wait(box_bar)
        # With two compute warpgroups (and a third issuing the TMA copies), warpgroup wg merges columns
        # [wg * width, (wg + 1) * width) of each tile, or rows [wg * rw, (wg + 1) * rw) (`by_rows`), with its own
        # weight rows, output slots and quantization scratch.
        wg = lax.axis_index("wg") if wgs > 1 else 0
        mine = lambda r: r.at[pl.ds(wg * rw, rw)] if by_rows else r  # noqa: E731 - its part of a row
        w_smem, o_scr = mc.per_warpgroup_refs((w_smem, o_scr), wg, wgs)
        q_scr = mc.warpgroup_quant_scratch(q_scr, wg, wgs)

        def cleaned(p, s, e, c):
            """The tile's rows as the weights take them: p (the fused mask's tokens at -inf), s, the copy flags."""
            if empty_rows:
                p = jnp.where(e > 0, -jnp.inf, p)
            got = (_math.clean_lse(p), _math.clean_lse(s))
            return got + (c,) if copy_rows else got

        def rows(i):
            """The rows of tile i by per-thread loads (any alignment), a step ahead in the carry."""
            hc, t0 = tiles.at(jnp.minimum(i, steps - 1))
            h = hc // nc
            flag = lambda r: mc.strided_row(r, t0) if r is not None else None  # noqa: E731
            return cleaned(mc.strided_row(p_g, h * num_tokens + t0), mc.strided_row(s_g, h * num_tokens + t0),
                           flag(e_g), flag(c_g))

        if scaled:  # the scale row, once (the weights' rows are rewritten per tile, this one never)
            def scale_row():
                w_smem[4] = mc.strided_row(q_g, 0)

            mc.when_computing(wg, wgs, scale_row)

        def step(idx, a_s, b_s, *rest):
            (i,) = idx
            hc, t0 = tiles.at(i)
            h = hc // nc
            *row_s, carry = rest
            if lse_tma:  # the rows came with the tiles: p, s (or the boxes), then the flag rows present
                p_s, s_s, *flag_s = (boxes.at[0], boxes.at[1], *row_s) if lse_boxes else row_s
                flag_s = iter(flag_s)
                e_s, c_s = [next(flag_s) if r is not None else None for r in (e_g, c_g)]

                def tile_rows(strided: bool):
                    """The rows one per thread (`strided`) or in the tile's row layout."""
                    read = lambda r: (mc.strided_row(r, 0) if strided else mc.load(mine(r), R))  # noqa: E731
                    lse = (lambda r: mc.lse_column(mine(r), h, R)) if lse_boxes else read  # noqa: E731
                    return cleaned(lse(p_s), lse(s_s), *(read(r) if r is not None else None for r in (e_s, c_s)))

                following = ()
            else:
                # This tile's rows were loaded a step ahead (the carry); the next tile's loads are issued now, so
                # their latency overlaps this tile's work rather than stalling the next step.
                current, following = carry, rows(i + 1)

            if row_weights:
                # The weights of the rows each thread holds in the tile's row layout, from the rows in shared
                # memory: no relayout.
                p, s, *copy = tile_rows(strided=False)
                m, both_empty, z, wp, ws = _math.two_way_weights(p, s, lse_base2)
                empty, copy = jnp.where(both_empty, 1.0, 0.0), (copy[0] if copy_rows else None)
                if box_lse:  # head h's column of the merged box (every column chunk of h writes the same values)
                    following = mc.with_lse_column(carry, h, _math.merged_lse(z, m, both_empty, lse_base2))
            else:
                # The weights of the tile's 128 rows, one row per thread, as the N-way kernel computes them; relaid
                # out through shared memory into the tile's row layout.
                if lse_tma:
                    current = tile_rows(strided=True)
                p, s = current[:2]
                m, both_empty, z, wp, ws = _math.two_way_weights(p, s, lse_base2)
                w_smem[0] = wp
                w_smem[1] = ws
                w_smem[2] = jnp.where(both_empty, 1.0, 0.0)
                if copy_rows:
                    w_smem[3] = current[2]
                if output_lse:
                    @pl.when((hc % nc == 0) & (wg == 0))
                    def _():
                        lo_g[pl.ds(h * num_tokens + t0, bt)] = _math.merged_lse(z, m, both_empty, lse_base2)
                wp, ws, empty = (mc.load(mine(w_smem.at[k]), R) for k in range(3))
                copy = mc.load(mine(w_smem.at[3]), R) if copy_rows else None

            if by_rows:
                a_s, b_s = a_s.at[pl.ds(wg * rw, rw), :], b_s.at[pl.ds(wg * rw, rw), :]
            elif wgs > 1:
                a_s, b_s = a_s.at[:, pl.ds(wg * width, width)], b_s.at[:, pl.ds(wg * width, width)]
            a = mc.load(a_s, L)
            b = mc.load(b_s, L)
            row = lambda x: jnp.broadcast_to(x[:, None], (rw, width))  # noqa: E731
            wpb = row(wp)
            wsb = row(ws)
            # 4.3: a zero weight gives exactly 0, so NaN in an empty partial cannot leak.
            out = jnp.where(wpb > 0, a.astype(F32) * wpb, 0.0) + jnp.where(wsb > 0, b.astype(F32) * wsb, 0.0)
            out = jnp.where(row(empty) > 0, 0.0, out)
            # 4.4: the suffix's bits (its value rounded once, for another output dtype; quantized as a merged row)
            result = mc.stored(out, b, row(copy) > 0 if copy_rows else None, F32 if quant else o_scr.dtype)
            scale = mc.load(mine(w_smem.at[4]), R) if scaled else None
            # 4.6, 4.7, 4.8: column chunk hc * wgs + wg of `width` columns, or chunk hc of rows from wg * rw
            chunk, row0 = (hc, wg * rw) if by_rows else (hc * wgs + wg, 0)
            mc.store_merged(result, quant, scale, q_scr, o_scr, o_g, g_g, t0, chunk, i, row0=row0)
            return following

        tile = plgpu.BlockSpec((pl.Element(bt), dc), lambda i: tiles.at(i)[::-1])
        inputs, specs = [a_g, b_g], [tile, tile]
        if lse_tma:  # the LSE rows (`[H, T']`) and flag rows (`[T']`) of each tile by TMA, with it
            at = lambda i: tiles.at(i)[1]  # noqa: E731
            lse = plgpu.BlockSpec((None, pl.Element(bt)), lambda i: (tiles.at(i)[0] // nc, at(i)))
            flags = [r for r in (e_g, c_g) if r is not None]
            flag = plgpu.BlockSpec((pl.Element(bt),), lambda i: (at(i),))
            inputs += ([] if lse_boxes else [p_g, s_g]) + flags
            specs += ([] if lse_boxes else [lse, lse]) + [flag] * len(flags)
        merged = mc.pipeline(step, inputs, grid=(steps,), in_specs=specs, tune=tune, wgs=wgs,
                             init_carry=lambda: (jnp.zeros((bt, mc.TH_HEADS), F32) if box_lse
                                                 else () if lse_tma else rows(0)))
        if box_lse:
            mc.store_lse_box(merged, boxes.at[0], lo_g, t00, head0)
        plgpu.wait_smem_to_gmem(0)

    own = mc.per_warpgroup([plgpu.SMEM((5, bt), F32),
                            mc.output_slots(tune["stores"], width, out_type[0].dtype, rw)], wgs)
    boxes = [plgpu.SMEM((2, bt, mc.TH_HEADS), F32), plgpu.Barrier(num_arrivals=2)] if lse_boxes else []
    return mc.kernel(body, out_type=tuple(out_type), grid=tiles.grid, grid_names=tiles.names,
                     scratch_types=[*own, *mc.quant_scratch(quant, tune["stores"], width, wgs, rw), *boxes],
                     interpret=interpret, **mc.warpgroups(wgs))


@functools.partial(jax.jit, static_argnames=("return_lse", "out_dtype", "lse_layout", "lse_base2", "group",
                                          "interpret"))
def merge_mosaic(prefix_output, prefix_lse, suffix_output, suffix_lse, output_scale, query_start_loc,
                 prefix_cu_seq_lens, prefill_tokens_with_context, *, return_lse, out_dtype, lse_layout, lse_base2,
                 interpret, group=None):
    """`pallas_impl.merge_attn_states` with backend="mosaic_gpu" (its arguments, checked there)."""
    num_tokens, num_heads, head_dim = prefix_output.shape
    tp = max(num_tokens, mc.BLOCK_T)
    tune = mc.merge_tuning(tp, group is not None)  # for the head plan; then as the kernel takes it
    plan = functools.partial(mc.head_plan, head_dim, prefix_output.dtype, tune["tile_bytes"],  # cols >= D: TMA rows
                             input_tiles=2 * tune["concurrent"], out_slots=tune["stores"],
                             other_bytes=5 * mc.BLOCK_T * 4 * tune.get("compute_wgs", 1))
    quant, stored_dtype, (cols, dc) = mc.output_plan(out_dtype, output_scale, group, plan)
    tune = mc.merge_tuning(tp, mc.grouped(quant))
    prefill = _checks.prefill_tokens_array(prefill_tokens_with_context, num_tokens)
    copy_t = jnp.arange(num_tokens, dtype=jnp.int32) >= prefill[0]
    # XLA before the kernel: the fused mask's token flags (4.5), the layout, T < 128.
    empty = mc.fused_empties(query_start_loc, prefix_cu_seq_lens, num_tokens)
    rows = lambda x: mc.padded_rows(mc.padded_heads(x, cols).reshape(num_tokens, num_heads * cols),  # noqa: E731
                                    num_tokens, 0)
    copy_rows = prefill_tokens_with_context is not None and not mc.stores_f32_rows(group, quant)
    lse_tma = mc.rows_by_tma(tune, tp)
    boxes = mc.lse_boxes(tune, lse_layout, num_heads) and bool(tune.get("row_weights"))
    lse_tma = lse_tma or boxes  # the flag rows by TMA too: `[T']` rows need no stride
    args = [rows(prefix_output), rows(suffix_output),
            *(mc.lse_rows(x, lse_layout, flat=not lse_tma, boxes=boxes) for x in (prefix_lse, suffix_lse))]
    if empty is not None:
        args.append(mc.flag_rows(empty))
    if copy_rows:
        args.append(mc.flag_rows(copy_t))
    out_type = mc.kernel_io(args, quant, output_scale, tp, num_heads, cols, stored_dtype, return_lse, boxes)
    results = _kernel(tp, num_heads, cols, dc, out_type, output_lse=return_lse, empty_rows=empty is not None,
                      copy_rows=copy_rows, lse_base2=lse_base2, quant=quant, lse_tma=lse_tma, lse_boxes=boxes,
                      interpret=interpret)(*args)
    # XLA after the kernel: NVFP4 (4.8), per-group scales' layout, the pass-through LSE (4.4: the suffix's raw
    # bits), the layout.
    return mc.finish(results, prefix_output.shape, copy_t, suffix_output,
                     suffix_lse if lse_layout == "HT" or boxes else suffix_lse.T, output_scale, out_dtype=out_dtype,
                     return_lse=return_lse, lse_layout=lse_layout,
                     pass_through=prefill_tokens_with_context is not None, group=group, lse_boxes=boxes)
