"""Shared pieces of the Mosaic GPU kernels (`jax.experimental.pallas.mosaic_gpu`, jax >= 0.11).

The Mosaic GPU kernels do in their body the arithmetic the Triton kernels do per element — the LSE sentinels (+inf
and NaN read as -inf, `_math.clean_lse`), the maximum, the exponentials (of base-2 differences for base-2 LSEs),
their sum, the weights, the weighted sum, the log (`_math.merged_lse`) — and leave the per-row bookkeeping to XLA
around the call, as the same operations in the same order (the jnp path's, which gives the Triton kernels' bits on
the GPU): the fused mask's per-token emptiness from the offsets (`jnp_fallback._empty_tokens`), the pass-through
LSE, `[T, H]` layouts (transposed), `T < 128` (padded with empty rows), heads that are not whole TMA rows (padded
with zero columns, `head_columns`) and per-group or NVFP4 scales into the caller's layout (the kernel writes a row
per group). Inside the kernel, per-token flag rows set the fused mask's raw LSEs to -inf and give pass-through rows
of the output the last partial's own bits, and quantized outputs (fp8 with a static scale or per group, NVFP4) are
quantized in registers and stored quantized with their scales (`output_plan`, `quantized`). For the common call
(`[H, T]` LSEs, T >= 128, no fused mask, no pass-through) what runs in XLA is reshapes only: no kernel but the
merge.

Why this split (docs/design.md, "Mosaic GPU backend"): Mosaic GPU has no masked loads or stores, its TMA copies need
16-byte aligned rows (an `[H, T]` LSE row at an odd T is not), its Warpgroup layout inference needs tiles of
128 rows, and it contracts a multiply feeding an add into an FMA unless a select separates them (every product
in these kernels is behind a `jnp.where`, as in the Triton kernels).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_impl import _backend, _math, _sharding, jnp_fallback

BLOCK_T = 128  # tokens per tile: a Warpgroup row vector needs a multiple of 128 elements
MAX_COLS = 256  # a TMA box dimension holds at most 256 elements: wider heads are split into column chunks
# Dynamic shared memory of one CTA on an H100 / H200 (227 KiB), less 1 KiB for the pipelines' barriers.
SMEM_BYTES = 227 * 1024 - 1024
# The N-way merge keeps a shared-memory weight row per partial up to WEIGHT_ROWS partials (its loops over them
# unrolled); beyond, its loops run at runtime and the weights of WEIGHT_ROWS partials at a time.
WEIGHT_ROWS = 64
# The N-way merge copies each tile's LSE rows into shared memory a tile ahead up to this many partials
# (`prefetches_rows`); beyond, its threads load them from GMEM when the tile starts.
PREFETCH_PARTIALS = 16
# Launch choices per kernel (they change which CTA owns a tile, never an element's arithmetic):
# steps: token tiles per CTA (one emit_pipeline); concurrent: pipelined steps in flight; tile_bytes: the most bytes
# of one [128, dc] input tile; stores: output tiles whose TMA stores may be in flight (1 or 2 shared-memory slots;
# docs/design.md, "Mosaic GPU backend", says why stores go through shared memory); ctas_per_sm: 0 for a grid of
# `steps` tiles per CTA, k > 0 for k persistent CTAs per SM (`Tiles`); compute_wgs: 1, or 2 for a
# warp-specialised merge (`compute_warpgroups`); lse_tma: each tile's LSE rows copied by TMA (`rows_by_tma`, the
# N-way merge's a tile ahead, `prefetches_rows`); row_weights: the 2-way merge's weights from those rows in the
# tile's row layout (no relayout through shared memory); lse_step: beyond WEIGHT_ROWS partials, the LSE loads of
# each iteration of the N-way merge's runtime loops over them (its maximum and sum, `_math.n_way_max_and_sum`'s
# `exp_step`; the same operations in the same order at any step); th_boxes (off unless set: a candidate): the merges
# read and write `[T, H]` LSEs in boxes of heads, one token tile of 8 heads per CTA (`lse_boxes`).
# The 2-way merge keeps 2 inputs x `concurrent` tiles in shared memory, the N-way and the rescale 1 x `concurrent`:
# smaller 2-way tiles keep two CTAs per SM (228 KiB of shared memory on an H100/H200).
# `python -m tools mosaic-speed` sweeps these on the GPU (it sets them here and clears jax's caches). The 2-way merge
# takes `long_tile_bytes` from `long_tokens` padded tokens on (`merge_tuning`): larger tiles pay at long T only; and
# for per-group FP8 and NVFP4 outputs the choices in `grouped` (two compute warpgroups, the quantizer being
# issue-bound on one: split by rows, `compute_warpgroups`). The N-way merge runs two persistent CTAs per SM; its
# NVFP4 outputs take the choices in `nvfp4` (`merge_n_tuning`). The defaults are the best of
# `python -m tools mosaic-speed`'s sweeps on the H100 whose bits the full check confirmed (docs/results.md,
# 2026-12-07).
TUNING = {
    "merge": dict(steps=8, concurrent=2, tile_bytes=16 * 1024, stores=2, ctas_per_sm=0, compute_wgs=1, lse_tma=True,
                  row_weights=True, long_tokens=16384, long_tile_bytes=32 * 1024,
                  grouped=dict(compute_wgs=2, split="rows")),
    "merge_n": dict(steps=4, concurrent=2, tile_bytes=32 * 1024, stores=1, ctas_per_sm=2, compute_wgs=1,
                    lse_tma=True, lse_step=4, nvfp4={}),
    "cp_rescale": dict(steps=8, concurrent=2, tile_bytes=32 * 1024, stores=2),
    # heads: LSE rows (of 128 tokens) per CTA; the output rows are split as many ways as the heads.
    # tokens: output rows (of one head group's share) per TMA store of zeros. "mask_lse": without output zeroing
    # (`python -m tools mosaic-speed` sweeps both).
    # offsets_in_smem: with fewer than 128 requests, search copies of the offsets in shared memory.
    "mask": dict(heads=8, tokens=8, offsets_in_smem=True),
    "mask_lse": dict(heads=16, offsets_in_smem=True),
}


@functools.cache
def plgpu():
    """The Mosaic GPU Pallas module, imported on first use (the `mosaic` extra: jax >= 0.11, and absl-py for
    jax's Mosaic GPU interpreter)."""
    if not _backend.has_mosaic_gpu():
        need = ".".join(map(str, _backend.MOSAIC_MIN_JAX))
        raise NotImplementedError(f"backend='mosaic_gpu' needs jax >= {need} (its layout "
                                  f"inference and plgpu.kernel API); this is jax {jax.__version__}: use "
                                  "backend='triton'")
    from jax.experimental.pallas import mosaic_gpu

    return mosaic_gpu


def kernel(body, *, interpret: bool, **kwargs):
    """`plgpu.kernel` with this package's compiler parameters; `interpret` runs jax's Mosaic GPU interpreter (a
    NumPy model of the kernel: its semantics, not the GPU's float bits)."""
    m = plgpu()
    params = m.CompilerParams(lowering_semantics=m.LoweringSemantics.Warpgroup, approx_math=False)
    return m.kernel(body, compiler_params=params, interpret=m.InterpretGPUParams() if interpret else None, **kwargs)


def load(ref, layout):
    """`plgpu.load` of a whole ref into a register `layout`."""
    return plgpu().load(ref, layout=layout)


def tile_start(split, i, num_tokens: int, steps: int):
    """First token of a CTA's tile `i` (`steps` tiles of BLOCK_T tokens per token split): the last tile of the
    padded `T' >= BLOCK_T` rows is shifted back to end at T', so no copy leaves the arrays."""
    return jnp.minimum((split * steps + i) * BLOCK_T, num_tokens - BLOCK_T)


# SMs the persistent schedule assumes where no GPU is attached: jax's Mosaic GPU interpreter (fewer CTAs, so a
# CTA's pipeline wraps over several tiles in the tests) and a lowering for the GPU from a CPU host (an H100's).
INTERPRET_SMS, DEFAULT_SMS = 4, 132


def sm_count(interpret: bool) -> int:
    """The GPU's SMs (trace time; `DEFAULT_SMS` when jax reports none), `INTERPRET_SMS` in the interpreter."""
    if interpret:
        return INTERPRET_SMS
    try:
        return int(getattr(jax.devices("gpu")[0], "core_count", 0)) or DEFAULT_SMS
    except RuntimeError:  # no GPU backend: a lowering for the GPU from a CPU host
        return DEFAULT_SMS


MEMORY_REGISTERS = 40  # registers per thread of the warpgroup that issues a warp-specialised pipeline's copies


def compute_warpgroups(tune: dict, quant, dc: int, out_dtype) -> int:
    """Compute warpgroups of a merge kernel: `tune["compute_wgs"]` (1: one warpgroup copies and computes; 2: a
    warp-specialised pipeline, a third warpgroup issuing the TMA copies and each compute warpgroup merging half of
    each tile's columns, or half of its rows, `split_by_rows`, `warpgroup_tile`). Split by columns, 1 where half a
    tile is not whole 16-byte rows of a multiple of 8 columns and of the output's groups (a group of per-group FP8
    never spans warpgroups; NVFP4's int4 tiles are `NVFP4_COLUMNS` at least); split by rows, any tile."""
    wgs = tune.get("compute_wgs", 1)
    if wgs > 1 and split_by_rows(tune):
        return wgs
    if wgs == 1 or dc % wgs:
        return 1
    width = dc // wgs
    if not grouped(quant):
        multiple = 8
    elif quant_is_nvfp4(quant):
        multiple = NVFP4_COLUMNS
    else:
        multiple = quant[0]
    if width % multiple or width % 8 or width * jnp.dtype(out_dtype).itemsize % 16:
        return 1
    return wgs


def split_by_rows(tune: dict) -> bool:
    """Whether two compute warpgroups split a tile by rows (`tune["split"] == "rows"`) rather than by columns."""
    return tune.get("split") == "rows"


def warpgroup_tile(tune: dict, quant, dc: int, out_dtype) -> tuple[int, int, int]:
    """(compute warpgroups, rows, columns) of the `[rows, columns]` part of each `[BLOCK_T, dc]` tile a compute
    warpgroup merges (`compute_warpgroups`): the whole tile with one; with two, half its columns or half its rows
    (`split_by_rows`: 64, a WGMMA layout's tile of rows; any group size, the LSE rows' weights loaded for its own
    rows only)."""
    wgs = compute_warpgroups(tune, quant, dc, out_dtype)
    if wgs > 1 and split_by_rows(tune):
        return wgs, BLOCK_T // wgs, dc
    return wgs, BLOCK_T, dc // wgs


def pipeline(step, inputs, *, grid, in_specs, tune: dict, wgs: int, init_carry):
    """`step` pipelined over `grid` with `tune["concurrent"]` steps in flight and the carry from `init_carry()`:
    `emit_pipeline` for one compute warpgroup; for `wgs` > 1, the warp-specialised pipeline (`compute_warpgroups`:
    warpgroup `wgs` issues the copies, warpgroups 0 .. wgs - 1, axis "wg", run `step`). One warpgroup: the final
    carry."""
    m = plgpu()
    if wgs > 1:
        return m.emit_pipeline_warp_specialized(
            step, grid=grid, in_specs=in_specs, max_concurrent_steps=tune["concurrent"],
            memory_registers=MEMORY_REGISTERS, wg_axis="wg", num_compute_wgs=wgs,
            compute_context=lambda run: run(init_carry()))(*inputs)
    return m.emit_pipeline(step, grid=grid, in_specs=in_specs, max_concurrent_steps=tune["concurrent"],
                           init_carry=init_carry())(*inputs)


def per_warpgroup(scratch: list, wgs: int) -> list:
    """Shared-memory scratch `scratch` once per compute warpgroup (a leading axis of `wgs`) where `wgs` > 1."""
    if wgs == 1:
        return scratch
    return [plgpu().SMEM((wgs, *x.shape), x.dtype) for x in scratch]


def per_warpgroup_refs(refs, wg, wgs: int) -> list:
    """Warpgroup `wg`'s part of each of `per_warpgroup(..., wgs)`'s refs."""
    return [x.at[wg] for x in refs] if wgs > 1 else list(refs)


def when_computing(wg, wgs: int, fn) -> None:
    """`fn()` in the compute warpgroups only (`wg` < `wgs`): with one warpgroup, always."""
    if wgs > 1:
        pl.when(wg < wgs)(fn)
    else:
        fn()


def warpgroups(wgs: int) -> dict:
    """`kernel` arguments for `wgs` compute warpgroups: the copy-issuing one besides, axis "wg"."""
    return dict(num_threads=wgs + 1, thread_name="wg") if wgs > 1 else {}


def token_tiles(num_tokens: int) -> int:
    """Token tiles of BLOCK_T over `num_tokens` (>= BLOCK_T) padded tokens, the last one shifted back (`tile_start`)."""
    return -(-num_tokens // BLOCK_T)


class Tiles:
    """Which `[BLOCK_T, dc]` tile of the padded `[T', H * D]` rows a merge kernel's CTA takes at pipeline step `i`
    (`at(i)`: the column chunk `hc` and the first token `t0`); the launch choice `ctas_per_sm` of its `TUNING`.

    0: a grid of (H * D / dc, token splits) CTAs, each `steps` consecutive tiles of one column chunk, the last
    tile shifted back to end at T' (`tile_start`). k > 0: persistent, `k` CTAs per SM (at most the tiles), CTA c
    taking tiles c, c + P, c + 2P, ... of the token-major order (the column chunks of one token tile, then the next
    tile), clamped to the last tile: a CTA with fewer tiles repeats that one, writing the same values. Persistent CTAs
    fill and drain their pipeline once instead of once per `steps` tiles, and no wave of CTAs is left part-full.
    `chunks_per_cta` > 0 (a `[T, H]` LSE read in boxes of heads, `lse_boxes`; whatever `ctas_per_sm` says): a grid
    of (H * D / dc / chunks_per_cta, token tiles) CTAs, each the `chunks_per_cta` consecutive column chunks of one
    token tile, so a CTA's heads share one box. Which tile a CTA takes never changes an element's arithmetic."""

    def __init__(self, num_tokens: int, num_chunks: int, tune: dict, interpret: bool, chunks_per_cta: int = 0):
        self.num_tokens, self.num_chunks = num_tokens, num_chunks
        self.token_tiles = token_tiles(num_tokens)
        self.total = num_chunks * self.token_tiles
        self.chunks_per_cta = chunks_per_cta
        per_sm = tune.get("ctas_per_sm", 0)
        if chunks_per_cta:
            assert num_chunks % chunks_per_cta == 0
            self.ctas, self.steps = 0, chunks_per_cta
            self.grid, self.names = (num_chunks // chunks_per_cta, self.token_tiles), ("g", "t")
        elif per_sm:
            self.ctas = min(self.total, sm_count(interpret) * per_sm)
            self.steps = -(-self.total // self.ctas)
            self.grid, self.names = (self.ctas,), ("c",)
        else:
            self.ctas = 0
            self.steps = tune["steps"]
            self.grid, self.names = (num_chunks, -(-self.token_tiles // self.steps)), ("hc", "s")

    def at(self, i):
        """(hc, t0) of step `i` (traced) in the kernel."""
        if self.chunks_per_cta:
            return (lax.axis_index("g") * self.chunks_per_cta + i,
                    jnp.minimum(lax.axis_index("t") * BLOCK_T, self.num_tokens - BLOCK_T))
        if not self.ctas:
            return lax.axis_index("hc"), tile_start(lax.axis_index("s"), i, self.num_tokens, self.steps)
        f = jnp.minimum(lax.axis_index("c") + i * self.ctas, self.total - 1)
        tile, hc = f // self.num_chunks, f % self.num_chunks
        return hc, jnp.minimum(tile * BLOCK_T, self.num_tokens - BLOCK_T)


def optional_refs(refs, *present):
    """The kernel refs `refs` in order, None in place of each absent one (`present` False), then the rest."""
    it = iter(refs)
    return [next(it) if p else None for p in present] + list(it)


def strided_row(ref, start):
    """`ref[start:start + BLOCK_T]` by per-thread loads (one element per thread: any alignment, which TMA lacks)."""
    m = plgpu()
    return m.layout_cast(ref[pl.ds(start, BLOCK_T)], m.Layout.WG_STRIDED((BLOCK_T,), vec_size=1))


def store_tile(result, o_scr, dst, count, scales=None, s_scr=None, s_dst=None) -> None:
    """A finished `[rows, dc]` tile (or a warpgroup's part of one, `warpgroup_tile`) to GMEM `dst` by a TMA store
    from slot `count % S` of `o_scr` (`[S, rows, dc]`), once the store that last used that slot has read it (at
    most S - 1 others in flight); with per-group `scales` (`quantized`), those rows too, from the same slot of
    `s_scr` (`[S, groups, rows]`) to `s_dst` (`[groups, rows]` of the scales' rows)."""
    m = plgpu()
    slots = o_scr.shape[0]
    m.wait_smem_to_gmem((slots - 1) * (1 if scales is None else 2), wait_read_only=True)
    slot = o_scr.at[count % slots] if slots > 1 else o_scr.at[0]
    slot[...] = result.astype(o_scr.dtype)
    if scales is not None:
        s_slot = s_scr.at[count % slots] if slots > 1 else s_scr.at[0]
        for k, sc in enumerate(scales):
            s_slot[k] = sc
    m.commit_smem()
    m.copy_smem_to_gmem(slot, dst)
    if scales is not None:
        m.copy_smem_to_gmem(s_slot, s_dst)


def head_columns(head_dim: int, itemsize: int, out_itemsize: int | None = None) -> int:
    """The columns a merge kernel gives a head: D itself when its rows are whole 16-byte TMA rows (of the inputs'
    `itemsize` and the output's `out_itemsize`) and a multiple of 8 columns (the register layout's tile, 8 wide),
    else D padded to the next such width (`padded_heads`: zero columns, cut after the kernel; an output element's
    arithmetic is its own column's, so the bits do not move)."""
    step = math.lcm(8, *(16 // math.gcd(16, size) for size in (itemsize, out_itemsize or itemsize)))
    return -(-head_dim // step) * step


def padded_heads(x, columns: int):
    """`[..., D]` with zero columns up to `columns` (`head_columns`), or `x` itself."""
    pad = columns - x.shape[-1]
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)]) if pad else x


def head_plan(head_dim: int, dtype, tile_bytes: int, *, out_dtype, input_tiles: int, out_slots: int,
              other_bytes: int, group_size: int = 1, scale_bytes: int = 0,
              nvfp4: bool = False) -> tuple[int, int]:
    """(columns of a kernel's head, columns of one TMA tile) for heads of `head_dim` elements of `dtype`:
    `head_columns`, then `column_chunk` of that width (a multiple of `group_size`: a quantization group stays in one
    tile), narrowed (halving `tile_bytes`) until the kernel's shared memory fits `SMEM_BYTES`: `input_tiles`
    `[BLOCK_T, dc]` input tiles in flight, `out_slots` output tiles of `out_dtype` (with `scale_bytes` of scales
    per group of a row each) and `other_bytes` of other scratch. (An f32 output of bf16 inputs doubles the output
    slots: at the 2-way merge's long-T tiles it needed 258 KiB.) `nvfp4`: int4 codes (half a byte a column) and
    e4m3 block scales out, tiles a multiple of `NVFP4_COLUMNS`. ValueError where no tile fits."""
    itemsize = jnp.dtype(dtype).itemsize
    out_itemsize = jnp.dtype(out_dtype).itemsize
    cols = head_columns(head_dim, itemsize, out_itemsize)
    if nvfp4:
        multiple = NVFP4_COLUMNS
    else:
        multiple = math.lcm(group_size, 16 // math.gcd(16, out_itemsize))
    dc = column_chunk(cols, itemsize, tile_bytes, multiple)

    def smem(dc):
        if nvfp4:
            out_tile = dc // 2 + dc // NVFP4_BLOCK
        else:
            out_tile = dc * out_itemsize + dc // group_size * scale_bytes
        return BLOCK_T * (dc * input_tiles * itemsize + out_slots * out_tile) + other_bytes

    while smem(dc) > SMEM_BYTES:
        tile_bytes //= 2
        narrower = column_chunk(cols, itemsize, tile_bytes, multiple)
        if narrower == dc:
            raise ValueError(f"no tile of a {head_dim}-column head fits {SMEM_BYTES} bytes of shared memory")
        dc = narrower
    return cols, dc


def column_chunk(head_dim: int, itemsize: int, tile_bytes: int = 32 * 1024, multiple: int = 1) -> int:
    """Columns of one TMA tile: the largest divisor of D of 16-byte rows and a multiple of 8 columns (the WGMMA
    register layout's tile, 8 wide) and of `multiple` within MAX_COLS and `tile_bytes` (at least the narrowest such
    column). D is a kernel's head width (`head_columns`); ValueError where no such divisor is within MAX_COLS."""
    if head_dim * itemsize % 16 or head_dim % 8:
        raise ValueError(f"a kernel's head is whole 16-byte rows of a multiple of 8 columns (head_columns); got "
                         f"D={head_dim} with {itemsize}-byte elements")
    unit = math.lcm(8, 16 // math.gcd(16, itemsize), multiple)
    chunks = [dc for dc in range(unit, min(head_dim, MAX_COLS) + 1, unit) if head_dim % dc == 0]
    if not chunks:
        raise ValueError(f"no tile of a {head_dim}-column head is a multiple of {multiple} columns within {MAX_COLS}")
    fitting = [dc for dc in chunks if BLOCK_T * dc * itemsize <= tile_bytes]
    return max(fitting) if fitting else chunks[0]


def merge_tuning(num_tokens: int, grouped_output: bool = False) -> dict:
    """The 2-way merge's launch choices for `num_tokens` padded tokens (`long_tile_bytes` tiles from `long_tokens`),
    with the `grouped` ones for a `grouped_output` (per-group FP8, NVFP4: `grouped`)."""
    tune = dict(TUNING["merge"])
    if num_tokens >= tune.pop("long_tokens", num_tokens + 1):
        tune["tile_bytes"] = tune["long_tile_bytes"]
    tune.pop("long_tile_bytes", None)
    return _overridden(tune, "grouped", grouped_output)


def merge_n_tuning(quant) -> dict:
    """The N-way merge's launch choices for the output `quant` (`output_plan`): with the `nvfp4` ones for NVFP4,
    whose two compute warpgroups always split by rows (by columns the H100 wrote the second warpgroup's half of
    every head wrong, 2026-12-08, where jax's interpreter gives the right bits: docs/results.md)."""
    tune = _overridden(dict(TUNING["merge_n"]), "nvfp4", quant_is_nvfp4(quant))
    return dict(tune, split="rows") if quant_is_nvfp4(quant) and tune.get("compute_wgs", 1) > 1 else tune


def _overridden(tune: dict, key: str, applies: bool) -> dict:
    """`tune` without its `key` of choices for some outputs, those choices applied where `applies`."""
    own = tune.pop(key, {})
    return dict(tune, **own) if applies else tune


# A `[T', H]` LSE's box of heads (`lse_boxes`): 8 heads, 32-byte rows (TMA takes 16-byte multiples).
TH_HEADS = 8


def lse_boxes(tune: dict, lse_layout: str, num_heads: int) -> bool:
    """Whether a merge reads a `[T, H]` LSE as it is (`tune["th_boxes"]`): each CTA takes the column chunks of
    `TH_HEADS` heads of one token tile (`Tiles(chunks_per_cta=...)`: a grid, whatever `ctas_per_sm` says), copies
    that tile's `[BLOCK_T, TH_HEADS]` box of each LSE into shared memory once by TMA, picks each head's column in
    registers (`lse_column`) and writes its merged LSE the same way, a `[BLOCK_T, TH_HEADS]` box by TMA, so no XLA
    transpose runs before or after the kernel and each box is read once. With the rows by TMA (`lse_tma`; a
    `[T', H]` box's rows are whole 16-byte units at any T), on one compute warpgroup, H a multiple of TH_HEADS; the
    2-way merge with its weights in the tile's row layout (`row_weights`), the N-way merge up to
    `PREFETCH_PARTIALS` partials. Elsewhere XLA transposes a `[T, H]` LSE first (`lse_rows`)."""
    return (bool(tune.get("th_boxes")) and lse_layout == "TH" and num_heads % TH_HEADS == 0
            and bool(tune.get("lse_tma")) and tune.get("compute_wgs", 1) == 1)


def lse_column(box, head, layout):
    """Head `head`'s column (`head % TH_HEADS`) of a `[rows, TH_HEADS]` LSE box in shared memory (`lse_boxes`) as a
    row in the `layout` of a tile's rows (the WGMMA layout reduced over columns): the other columns at -inf, then
    the maximum over the box's columns, which is that column's value, bits and all (a NaN stays NaN, -0.0 stays
    -0.0; `_math.clean_lse` then takes the sentinels as it does in `[H, T']` rows)."""
    m = plgpu()
    x = load(box, m.Layout.WGMMA)
    col = lax.broadcasted_iota(jnp.int32, x.shape, 1)
    return jnp.max(jnp.where(col == head % TH_HEADS, x, -jnp.inf), axis=1)


def with_lse_column(box, head, row):
    """The `[rows, TH_HEADS]` register box of merged LSEs `box` with head `head`'s column (`head % TH_HEADS`) set to
    `row` (in the row layout of a tile's rows): the inverse of `lse_column`, carried over a CTA's tiles."""
    column = lax.broadcasted_iota(jnp.int32, box.shape, 1) == head % TH_HEADS
    return jnp.where(column, row[:, None], box)


def store_lse_box(box, smem, lo_g, t0, head0) -> None:
    """A CTA's finished register box of merged LSEs to rows `t0` .. `t0 + BLOCK_T - 1` and heads `head0` ..
    `head0 + TH_HEADS - 1` of the `[T', H]` output `lo_g`, by TMA from `smem` (a free `[BLOCK_T, TH_HEADS]`
    buffer: the CTA's input box, read by then)."""
    m = plgpu()
    smem[...] = box
    m.commit_smem()
    m.copy_smem_to_gmem(smem, lo_g.at[pl.ds(t0, BLOCK_T), pl.ds(head0, TH_HEADS)])


def lse_rows(lse, lse_layout: str, flat: bool = True, boxes: bool = False):
    """A raw LSE as a kernel reads it: f32[H * T'] (`flat`: rows h, for per-thread loads), f32[H, T'] (TMA
    copies, `rows_by_tma`) or, `boxes` (`lse_boxes`), a `[T, H]` LSE as f32[T', H]; T' >= BLOCK_T padded with
    -inf. The sentinels are the kernel's (`_math.clean_lse`); an LSE of T >= BLOCK_T in the layout the kernel reads
    is only reshaped (no XLA kernel)."""
    if boxes:
        return padded_rows(lse, lse.shape[0], -jnp.inf, axis=0)
    x = lse if lse_layout == "HT" else lse.T
    x = padded_rows(x, x.shape[-1], -jnp.inf, axis=-1)
    return x.reshape(-1) if flat else x


def rows_by_tma(tune: dict, num_tokens: int) -> bool:
    """Whether a merge kernel over `num_tokens` padded tokens copies each tile's LSE and flag rows into shared memory
    by TMA with the tile (`tune["lse_tma"]`): where an `[H, T']` row's stride is a multiple of 16 bytes (T' a
    multiple of 4), as a TMA copy needs (its box may start at any token). Else each thread loads its row's element
    from GMEM, a step ahead (`strided_row`). Either way the same values reach the same arithmetic."""
    return bool(tune.get("lse_tma")) and num_tokens % 4 == 0


def prefetches_rows(tune: dict, num_tokens: int, num_partials: int) -> bool:
    """Whether the N-way merge's tiles take their N LSE rows (and flag rows) from shared memory, copied by TMA a tile
    ahead (`rows_by_tma`), up to `PREFETCH_PARTIALS` partials (two `[N, BLOCK_T]` slots of each kind of row)."""
    return rows_by_tma(tune, num_tokens) and num_partials <= PREFETCH_PARTIALS


def stacked_lse_rows(lses, lse_layout: str, flat: bool = True):
    """`lse_rows` of N stacked LSEs: f32[N * H * T'], rows (k, h), or (not `flat`) f32[N, H, T']."""
    x = lses if lse_layout == "HT" else jnp.swapaxes(lses, 1, 2)
    x = padded_rows(x, x.shape[-1], -jnp.inf, axis=-1)
    return x.reshape(-1) if flat else x


def fused_empties(query_start_loc, cu_seq_lens, num_tokens: int):
    """bool[..., T]: the fused mask's tokens (docs/spec.md 4.5, 8.1) of each `cu_seq_lens` row (`[..., R + 1]`), or
    None without a fused mask."""
    if query_start_loc is None or query_start_loc.shape[0] <= 1:
        return None
    empty = functools.partial(jnp_fallback._empty_tokens, query_start_loc, num_tokens=num_tokens)
    for _ in range(cu_seq_lens.ndim - 1):
        empty = jax.vmap(empty)
    return empty(cu_seq_lens)


def flag_rows(flags, flat: bool = True, whole_rows: bool = False):
    """bool[..., T] as the f32[... * T'] rows a kernel reads per tile (1 where set; T' >= BLOCK_T padded with 0), or
    (not `flat`) f32[..., T'], with `whole_rows` T' padded to whole 16-byte units (a TMA copy's row stride)."""
    x = padded_rows(flags.astype(jnp.float32), flags.shape[-1], 0.0, axis=-1)
    if whole_rows and x.shape[-1] % 4:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, -x.shape[-1] % 4)])
    return x.reshape(-1) if flat else x


def last_lse_ht(lses, lse_layout: str, empties, boxes: bool = False):
    """The pass-through LSE of an N-way merge as `[H, T]` (or, `boxes`: `lse_boxes`, as the caller's `[T, H]`;
    docs/spec.md 8.4): the last partial's raw bits, -inf on the fused mask's empty tokens of that partial."""
    if boxes:
        return lses[-1] if empties is None else jnp.where(empties[-1][:, None], -jnp.inf, lses[-1])
    x = lses[-1] if lse_layout == "HT" else lses[-1].T
    return x if empties is None else jnp.where(empties[-1][None, :], -jnp.inf, x)


def padded_rows(x, num_tokens: int, fill, axis: int = -2):
    """Pad the token axis (`axis`: -2 of `[..., T, C]`, -1 of `[..., T]`) to at least BLOCK_T with `fill`; a kernel
    tile covers it."""
    pad = max(0, BLOCK_T - num_tokens)
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=fill)


FP8 = jnp.float8_e4m3fn
STATIC = "static"  # `output_plan`: an fp8 output with a static scale (docs/spec.md 4.6)
NVFP4 = _math.NVFP4  # `output_plan`: NVFP4 (4.8)
NVFP4_BLOCK = 16
# NVFP4's codes are stored as an int4 tile (`quantized`), whose bytes in memory are the packed bytes (two codes a
# byte, the low nibble first: `_math.pack_fp4`'s order), and XLA views the int4 output as u8 after the kernel
# (`finish`). Its tiles, or a compute warpgroup's part of one, are `NVFP4_COLUMNS` at least: 32-byte int4 rows.
# At 32 columns (16-byte rows, the least TMA takes) the H100 wrote wrong codes (2026-12-07: heads of D = 32, the
# 2-way and N-way merges, where jax's interpreter gives the right ones), so narrower heads store f32 rows that XLA
# quantizes (`output_plan`). (Until 2026-12-07 a WGMMA of the f16 codes by a packing matrix paired the columns
# into bytes in registers, which Mosaic GPU's register arrays have no operation for: docs/design.md.)
NVFP4_COLUMNS = 64


def quant_is_nvfp4(quant) -> bool:
    """Whether `quant` (`output_plan`) is NVFP4."""
    return quant is not None and quant[0] == NVFP4


def output_plan(out_dtype, output_scale, group, plan):
    """(quant, stored dtype, (cols, dc)) of a merge kernel: what it quantizes in its registers (docs/spec.md 4.6,
    4.7, 4.8): None (it stores the output dtype), (STATIC,), (group size, UE8M0) of per-group FP8, or (NVFP4,)
    (int4 codes), with its head plan (`plan(out_dtype=..., group_size=..., scale_bytes=..., nvfp4=...)`,
    `head_plan` of the kernel's tiles). Where no tile holding whole groups fits shared memory (a group of 256 f32
    columns; NVFP4 heads not a multiple of `NVFP4_COLUMNS`), the kernel stores f32 rows that XLA quantizes after
    it (`finish`)."""
    if group is None:
        return ((STATIC,) if output_scale is not None else None), out_dtype, plan(out_dtype=out_dtype)
    try:
        if _math.is_nvfp4(group):
            return (NVFP4,), jnp.int4, plan(out_dtype=jnp.uint8, nvfp4=True)
        return tuple(group[:2]), out_dtype, plan(out_dtype=out_dtype, group_size=group[0], scale_bytes=4)
    except ValueError:
        return None, jnp.float32, plan(out_dtype=jnp.float32)


def has_scale_row(quant) -> bool:
    """Whether a kernel of `quant` (`output_plan`) reads a scale row (`scale_row`): the static fp8 scale, NVFP4's
    global scale."""
    return quant is not None and quant[0] in (STATIC, NVFP4)


def stores_f32_rows(group, quant) -> bool:
    """Whether a kernel stores f32 rows for XLA to quantize after it (`output_plan`: no tile holds whole groups);
    such a kernel does not take the pass-through rows (`finish` copies them)."""
    return group is not None and quant is None


def grouped(quant) -> bool:
    """Whether `quant` (`output_plan`) writes scales: per-group FP8 or NVFP4."""
    return quant is not None and quant[0] != STATIC


def block_of(quant) -> int:
    """Columns per scale of a `grouped` quant."""
    return NVFP4_BLOCK if quant[0] == NVFP4 else quant[0]


def scale_row(output_scale):
    """A static fp8 scale (or NVFP4's global scale) f32[1] as the f32[BLOCK_T] row a kernel reads per tile
    (`strided_row`)."""
    return jnp.broadcast_to(output_scale.reshape(-1)[:1].astype(jnp.float32), (BLOCK_T,))


def scales_struct(num_tokens: int, num_heads: int, cols: int, quant, *args):
    """The scales a kernel writes (`grouped` quant), f32 (per-group FP8) or e4m3 (NVFP4): a row of BLOCK_T per
    group or NVFP4 block of each token tile, `[tiles * H * D / G, BLOCK_T]` (`tile_scale_rows`), so each tile's
    TMA store starts on a whole row. Rows indexed by the tile's first token instead would start `t0` elements in,
    and the shifted last tile's `t0` (`tile_start`) is any number: a TMA copy's GMEM address must be 16-byte
    aligned (compiled: CUDA_ERROR_MISALIGNED_ADDRESS for f32, an illegal instruction for e4m3; the interpreter
    does not model it). `tile_scales` puts them back in token order."""
    dtype = FP8 if quant[0] == NVFP4 else jnp.float32
    return _sharding.out_struct((token_tiles(num_tokens) * num_heads * cols // block_of(quant), BLOCK_T), dtype, *args)


def tile_scale_rows(g_g, t0, hc, ng: int, num_tokens: int):
    """The `ng` rows of `scales_struct` `g_g` (a kernel over `num_tokens` padded tokens) that column chunk `hc` of
    the tile from token `t0` writes: tile ceil(t0 / BLOCK_T) (the shifted last tile's too)."""
    tile = (t0 + BLOCK_T - 1) // BLOCK_T
    return g_g.at[pl.ds(tile * (g_g.shape[0] // token_tiles(num_tokens)) + hc * ng, ng), :]


def tile_scales(raw, num_tokens: int):
    """`scales_struct`'s rows `[tiles * G#, BLOCK_T]` of a kernel over `tp = max(T, BLOCK_T)` padded tokens as
    `[G#, T]` in token order: tile k < tiles - 1 holds tokens from k * BLOCK_T, the last one from tp - BLOCK_T."""
    tp = max(num_tokens, BLOCK_T)
    tiles = token_tiles(tp)
    x = raw.reshape(tiles, -1, BLOCK_T)
    head = jnp.moveaxis(x[:-1], 0, 1).reshape(x.shape[1], -1)  # tokens [0, (tiles - 1) * BLOCK_T)
    tail = x[-1][:, (tiles - 1) * BLOCK_T - (tp - BLOCK_T):]  # the rest, from the last tile
    return jnp.concatenate([head, tail], axis=1)[:, :num_tokens]


def out_struct(num_tokens: int, num_heads: int, cols: int, stored_dtype, *args):
    """The output a merge kernel writes: `[T', H * D]` of the stored dtype (NVFP4: int4 codes)."""
    return _sharding.out_struct((num_tokens, num_heads * cols), stored_dtype, *args)


def quantized(result, quant, scale):
    """The f32 tile `result` `[BLOCK_T, dc]` quantized in registers (`output_plan`): (tile, [scale row of each group]
    or None). Static: `_math.static_fp8` by the scale row `scale`, broadcast (fp8); per group: `_math.quant_groups`
    of each `[BLOCK_T, G]` column slice (a group never spans tiles: `head_plan`), fp8, f32 scales; NVFP4:
    `_math.nvfp4_blocks` of each 16-column slice with the global scale `scale` (a row), e4m3 scales, the codes as
    an int4 tile (codes 8..15 as their two's complement: the same four bits)."""
    if quant[0] == STATIC:
        return _math.static_fp8(result, jnp.broadcast_to(scale[:, None], result.shape)).astype(FP8), None
    g = block_of(quant)
    qs, scales = [], []
    for k in range(result.shape[1] // g):
        block = result[:, k * g:(k + 1) * g]
        if quant[0] == NVFP4:
            q, sc = _math.nvfp4_blocks(block, scale)
        else:
            q, sc = _math.quant_groups(block, quant[1])
            q = q.astype(FP8)
        qs.append(q)
        scales.append(sc)
    q = jnp.concatenate(qs, axis=1) if len(qs) > 1 else qs[0]
    if quant[0] != NVFP4:
        return q, scales
    return jnp.where(q >= 8, q - 16, q).astype(jnp.int4), scales


def quant_scratch(quant, stores: int, dc: int, wgs: int = 1, rows: int = BLOCK_T) -> list:
    """The shared memory a `grouped` quant adds to a merge kernel whose compute warpgroups (`wgs`) each quantize
    `[rows, dc]` of a tile (`warpgroup_tile`): its scale slots (`store_tile`), once per warpgroup
    (`warpgroup_quant_scratch` picks them)."""
    if not grouped(quant):
        return []
    dtype = FP8 if quant[0] == NVFP4 else jnp.float32
    return per_warpgroup([plgpu().SMEM((stores, dc // block_of(quant), rows), dtype)], wgs)


def warpgroup_quant_scratch(q_scr: list, wg, wgs: int) -> list:
    """Compute warpgroup `wg`'s part of `quant_scratch(..., wgs)`: its scale slots (`wg` is 0 with one
    warpgroup)."""
    return per_warpgroup_refs(q_scr, wg, wgs)


def kernel_io(args: list, quant, output_scale, num_tokens: int, num_heads: int, cols: int, stored_dtype,
              return_lse: bool, lse_boxes: bool = False) -> list:
    """A merge kernel's quantization input appended to `args` (the static or NVFP4 global scale as a row) and its
    outputs' types: the output (`out_struct`), the scales of a `grouped` quant, the LSE (`[H * T']`, or `[T', H]`
    written in boxes of heads: `lse_boxes`)."""
    if has_scale_row(quant):
        args.append(scale_row(output_scale))
    out_type = [out_struct(num_tokens, num_heads, cols, stored_dtype, *args)]
    if grouped(quant):
        out_type.append(scales_struct(num_tokens, num_heads, cols, quant, *args))
    if return_lse:
        shape = (num_tokens, num_heads) if lse_boxes else (num_heads * num_tokens,)
        out_type.append(_sharding.out_struct(shape, jnp.float32, *args))
    return out_type


def output_slots(stores: int, dc: int, dtype, rows: int = BLOCK_T):
    """The shared-memory output slots of a merge kernel (`store_tile`): `[stores, rows, dc]` of the stored
    dtype."""
    return plgpu().SMEM((stores, rows, dc), dtype)


def store_merged(result, quant, scale, q_scr, o_scr, o_g, g_g, t0, hc, count, row0=0) -> None:
    """A merged f32 tile `result` `[rows, dc]` (column chunk `hc` of rows `row0` .. `row0 + rows - 1` of the tile
    from `t0`) stored: quantized first where `quant` says (`quantized`, `scale` the scale row or None; `q_scr` the
    kernel's `quant_scratch`), its scales to their rows of `g_g`."""
    rows, dc = result.shape
    scales = None
    if quant:
        result, scales = quantized(result, quant, scale)
    dst = o_g.at[pl.ds(t0 + row0, rows), pl.ds(hc * dc, dc)]
    if not grouped(quant):
        store_tile(result, o_scr, dst, count)
        return
    ng = dc // block_of(quant)
    s_dst = tile_scale_rows(g_g, t0, hc, ng, o_g.shape[0])
    if rows < BLOCK_T:  # its tokens' columns of the scale rows (64 f32 or e4m3 columns: whole 16-byte units)
        s_dst = s_dst.at[:, pl.ds(row0, rows)]
    store_tile(result, o_scr, dst, count, scales, q_scr[0], s_dst)


def stored(out, last, copy, dtype):
    """A merged f32 tile `out` as the kernel stores it in `dtype` (docs/spec.md 4.4): pass-through rows (`copy`, a
    bool tile, or None for none) take the tile `last` bit for bit where it has that dtype, else `last` as f32,
    rounded once at the store (`store_tile`) like a merged row."""
    if copy is None:
        return out
    if last.dtype == dtype:
        return jnp.where(copy, last, out.astype(dtype))
    return jnp.where(copy, last.astype(jnp.float32), out)


def finish(results, shape, copy_t, last_output, last_lse, output_scale, *, out_dtype, return_lse: bool,
           lse_layout: str, pass_through: bool, group=None, lse_boxes: bool = False):
    """XLA after a merge kernel (docs/spec.md 4.4, 4.7, 4.8, 8.4): the `[T, H, D]` output (quantized in the kernel:
    its scales, `scales_struct` in token order by `tile_scales`, in the caller's layout; a group wider than any
    tile, `output_plan`: the kernel's f32 rows, the last partial's rows copied, quantized, with `output_scale`
    NVFP4's global scale), and the merged LSE (the kernel writes it in the caller's base, `[H * T']` or, `lse_boxes`,
    `[T', H]`; with `pass_through`, the rows of `copy_t` take `last_lse`'s bits, `[H, T]` or, `lse_boxes`,
    `[T, H]`), in the caller's layout. `results`: the kernel's padded
    `[T', H * D]` output (NVFP4's int4 codes viewed as u8 here: `[T', H * D / 2]`;
    then its scales, then its `[H * T']` LSE), its heads of `head_columns`; for T >= BLOCK_T, an `[H, T]` LSE,
    whole heads and no pass-through these are reshapes only."""
    num_tokens, num_heads, head_dim = shape
    results = list(results)
    out = results.pop(0)[:num_tokens]
    if out.dtype == jnp.int4:  # NVFP4's int4 codes: their bytes, two codes each
        out = lax.bitcast_convert_type(out.reshape(num_tokens, -1, 2), jnp.uint8)
    width = head_dim // 2 if out.dtype == jnp.uint8 else head_dim  # NVFP4: two codes a byte
    out = out.reshape(num_tokens, num_heads, out.shape[1] // num_heads)[..., :width]  # padded heads cut
    scales = None
    if group is not None and out.dtype == jnp.float32:  # f32 rows (`output_plan`); NVFP4's global scale (4.8)
        out, scales = jnp_fallback._stored_grouped(out, group, last_output, copy_t, output_scale)
    elif group is not None:
        scales = _math.scale_layout(tile_scales(results.pop(0), num_tokens).T, group[2])
    merged = None
    if return_lse and lse_boxes:
        merged = results[0][:num_tokens]  # [T, H], the caller's layout
        return jnp_fallback._results(out, jnp.where(copy_t[:, None], last_lse, merged) if pass_through else merged,
                                     scales)
    if return_lse:
        merged = results[0].reshape(num_heads, -1)[:, :num_tokens]  # [H, T]
        if pass_through:
            merged = jnp.where(copy_t[None, :], last_lse, merged)
        merged = merged if lse_layout == "HT" else merged.T
    return jnp_fallback._results(out, merged, scales)
