"""The launch tables of both kernel packages, and the tile and grid arithmetic over them.

Every tile and grid of `triton_impl` and `pallas_impl` is computed here, once. A tile decides which elements a
program owns, never an element's arithmetic (docs/design.md, "Merge grid and tiles"), so the merge tables may differ
per framework (`FRAMEWORKS`): each is keyed by the framework that launches it. The mask's constants are shared.

The tables are the knobs the sweeps vary (`python -m tools tune`, `python -m tools mask-floor`). They are read at plan
time through this module's attributes; `set_knobs` sets them and clears the cached tiles and grids. What holds a
tile beyond this module is the caller's to clear: the Triton wrappers' launch plans (`triton_impl._plans.PLANS`) and
jax's compilation caches (`jax.clear_caches()`).
"""

from __future__ import annotations

import functools

from mla_lse_common import constants

FRAMEWORKS = ("triton", "pallas")

# The mask (docs/spec.md 3; docs/design.md, "Mask tiles" and "Mask grid"): the same in both frameworks but for the
# warps per program (the mask candidates of `python -m tools mask-floor`; docs/results.md).
MASK_BLOCK_T = 128  # query tokens per mask program
SCAN = 32  # request boundaries compared per scan step (one warp)
ZERO_TILE_ELEMS = 16384  # elements of one output-zeroing store in the mask
MASK_NUM_WARPS = {"triton": 4, "pallas": 8}
MASK_TILE_H = 16  # heads per -inf store of the mask
# The mask's second grid axis: each 128-token block's head tiles (LSE) and head x dim tiles (output zeroing) are
# dealt round-robin over `mask_split` programs, a power of two grown until the grid holds MASK_TARGET_PROGRAMS
# programs, capped by the tile count and by the split of the variant.
MASK_TARGET_PROGRAMS = 32768
MASK_ZERO_SPLIT = 64  # most programs per 128-token block when zeroing output rows
MASK_LSE_SPLIT = 4  # most programs per 128-token block for the LSE-only mask

# The 2-way merge's launch per framework and variant: (bytes of one input tile per program, fewest tokens per
# program, warps). "plain": no output LSE; "lse": with it; "fused": the fused mask too. Chosen per framework from
# the tile sweeps (`python -m tools tune merge`; docs/results.md).
MERGE_TILES = {
    "triton": {"plain": (2048, 4, 4), "lse": (4096, 1, 4), "fused": (8192, 8, 4)},
    "pallas": {"plain": (2048, 4, 4), "lse": (4096, 4, 4), "fused": (8192, 8, 4)},
}
# The N-way merge's launch per framework, variant and LSE layout: (bytes of a program's N input tiles together,
# fewest tokens, fewest tokens of a tile at the floor, warps). Each partial's tile gets total // N bytes (a power
# of two) within N_TILE_BYTES: a program's loads stay about the same as N grows, and never below one 16-byte vector
# per thread of 4 warps. A tile at the floor (N >= 8 at these totals) with [H, T] LSEs takes 8 tokens of one head:
# its LSE tile is one 32-byte run of tokens, not 8 heads' scattered words; a larger tile keeps heads first, which
# the sweeps preferred (`python -m tools tune merge_n`; docs/design.md, "N-way tiles"). Beyond N_SPLIT_ABOVE with the
# weights stored, the fused merge's weighted sum (its LSEs and offsets no longer read per partial) takes the
# "weighted" entry (`tile_variant`), keyed by the split buffer's layout (`split_layout`): the output-LSE merge's
# tile with 2 warps (Triton) or, in [T, H] order, 4 (Pallas), the best of the H200 sweeps there (Pallas's [H, T]
# entry is unused: its buffer is [T, H], N_SPLIT_WEIGHTS_LAYOUT).
MERGE_N_TILES = {
    "triton": {"plain": {"HT": (16384, 1, 8, 4), "TH": (16384, 1, 1, 4)},
               "lse": {"HT": (16384, 1, 8, 4), "TH": (16384, 1, 1, 4)},
               "fused": {"HT": (32768, 4, 4, 4), "TH": (32768, 4, 4, 4)},
               "weighted": {"HT": (16384, 1, 8, 2), "TH": (16384, 1, 1, 2)}},
    "pallas": {"plain": {"HT": (16384, 4, 8, 4), "TH": (16384, 4, 4, 4)},
               "lse": {"HT": (16384, 4, 8, 4), "TH": (16384, 4, 4, 4)},
               "fused": {"HT": (16384, 4, 4, 4), "TH": (16384, 4, 4, 4)},
               "weighted": {"HT": (16384, 1, 8, 2), "TH": (16384, 1, 1, 4)}},
}
N_TILE_BYTES = (2048, 4096)  # (fewest, most) bytes of one partial's tile in the N-way merge
# The N-way loops beyond N = constants.UNROLLED_PARTIALS (docs/spec.md 8, "Any N"; docs/design.md, "Loops over
# many partials") per framework and variant: (max_chunk, exp_step, out_step). The maximum reads max_chunk partials'
# LSE tiles in one load (a maximum is exact in any order; 0: one partial at a time, in steps of exp_step); the sum
# of the exponentials runs in runtime steps of exp_step partials and the weighted sum of the outputs in steps of
# out_step (each step unrolled: its loads are in flight together), the last count % step unrolled. None of them
# changes a bit. Chosen from the sweeps at N = 128 and 256 (`python -m tools tune merge_n`; docs/design.md, "Loops over
# many partials"): larger chunks and steps cost registers, and so occupancy; the fused variant (its offsets read
# per partial) ran best one partial at a time.
N_LOOPS = {
    "triton": {"plain": (32, 16, 6), "lse": (16, 16, 6), "fused": (0, 4, 4)},
    "pallas": {"plain": (16, 16, 6), "lse": (16, 16, 6), "fused": (0, 4, 4)},
}
# The L2 eviction policy of the N-way merge's loads of the partials' output tiles where its loops run at runtime
# (N > constants.UNROLLED_PARTIALS), per framework: "evict_first" (read once, first out of L2, ahead of the LSE
# tiles that each pass reloads) or "" (the default policy, always taken up to UNROLLED_PARTIALS). No bit depends on
# it. Measured on the H200: a gain at N = 128 and 256, a loss at N = 8 and 16 (docs/design.md, "evict_first beyond
# 16 partials").
N_OUTPUTS_EVICT = {"triton": "evict_first", "pallas": "evict_first"}
# The weighted sum's loads in flight where its loop runs at runtime (N > constants.UNROLLED_PARTIALS), per
# framework and variant: the loop's steps whose loads are issued ahead of the step being summed, plus one (1: each
# step's loads wait for the previous step's sum). Triton pipelines the loop (`tl.range(num_stages=...)`: the loads
# of the next stages go to shared memory asynchronously); Pallas, whose lowering has no per-loop stages, carries
# the next step's output tiles in registers through the loop (any value above 1: one step ahead). The same
# operations in the same order: no bit depends on it.
N_OUT_STAGES = {"triton": {"plain": 3, "lse": 3, "fused": 2}, "pallas": {"plain": 2, "lse": 2, "fused": 2}}
# Where the N-way loops unroll (N <= constants.UNROLLED_PARTIALS), per framework and variant: how many of the
# partials' output tiles, from partial 0, load before the maximum and the sum of the exponentials instead of in the
# weighted sum, so that their reads are in flight while the LSE passes run: {N: count}, the entry of the largest N
# at or below the merge's (none: 0), capped at N - 1 (the last partial's tile always loads first). Only the loads
# move: no bit depends on it. From the H200 sweeps (docs/results.md, "Early output tiles"): Triton's output-LSE
# merge, whose loads Triton otherwise issues after every exponential, gains 1-3 points with 2 early tiles at N = 8,
# 4 at N = 12 and all at N = 16; the count's best is not monotonic in N (all 7 at N = 8 lose 6 points, 2 or 4 at
# N = 16 up to 9 in one layout), so the table names the measured N. Elsewhere none measured better (Triton at
# N = 4; Pallas at N = 8 and 16: within 0.3 points or worse).
N_EARLY_OUTPUTS = {"triton": {"plain": {}, "lse": {8: 2, 12: 4, 16: 16}, "fused": {}},
                   "pallas": {"plain": {}, "lse": {}, "fused": {}}}
# Beyond N_SPLIT_ABOVE partials the N-way merge runs in two kernels (docs/design.md, "Two kernels beyond 16
# partials"): the first computes every LSE position's maximum and sum over the partials' LSEs (their N_LOOPS
# max_chunk and exp_step) and, with N_SPLIT_WEIGHTS, every partial's exponential e_i as the sum takes it (its
# weight's numerator), and stores them in the LSEs' layout; the second reads them and runs the weighted sum of the
# outputs (out_step), without the first two passes' round trips (and, given the exponentials, dividing each by z
# instead of reading an LSE tile and the fused mask's offsets per partial). The same operations in the same order
# per position: no bit depends on it. A first-kernel program owns MAX_SUM_POSITIONS LSE positions with
# MAX_SUM_WARPS warps: a run of tokens of one head in [H, T] layout, whole heads' rows in [T, H]. With the fused
# mask (its offsets read per token) and [H, T] LSEs, per framework, MAX_SUM_FUSED_POSITIONS positions of
# MAX_SUM_FUSED_HEADS heads with MAX_SUM_FUSED_WARPS warps: the H200 sweeps' best (docs/results.md; Pallas's
# tile, 32 heads x 32 tokens, reads and stores its [T, H] buffer of exponentials in 128-byte runs; Triton's, 8 heads
# x 32 tokens, with 8 warps since its first kernel makes two passes, not three).
N_SPLIT_ABOVE = constants.UNROLLED_PARTIALS
# N_SPLIT_WEIGHTS per framework, variant and LSE layout, from the H200 sweeps (docs/results.md): the stored
# exponentials (the weights' numerators: "weights" in the knobs' names) pay where the weighted sum would otherwise
# read the fused mask's offsets per partial (both frameworks in both layouts; Pallas's with [H, T] LSEs only in a
# [T, H] buffer, N_SPLIT_WEIGHTS_LAYOUT), m and z alone elsewhere.
N_SPLIT_WEIGHTS = {"triton": {"plain": {"HT": False, "TH": False}, "lse": {"HT": False, "TH": False},
                              "fused": {"HT": True, "TH": True}},
                   "pallas": {"plain": {"HT": False, "TH": False}, "lse": {"HT": False, "TH": False},
                              "fused": {"HT": True, "TH": True}}}
# The layout of the split buffer where the weights are stored with [H, T] LSEs, per framework: "HT" (the LSEs') or
# "TH" (token-major, the output tiles' order: the weighted sum then takes the [T, H] "weighted" tile, reading each
# partial's weights of a token's heads as one run, and the LSEs only for the pass-through row). With [T, H] LSEs,
# or with m and z alone, the buffer is in the LSEs' layout. The same values either way: no bit depends on it. From
# the H200 sweeps (docs/results.md): Pallas's merge kernel with [H, T] LSEs runs as fast as with [T, H] ones given
# a [T, H] buffer; Triton's first kernel stores a [T, H] buffer from its [H, T] tile at 3.5-4x the cost.
N_SPLIT_WEIGHTS_LAYOUT = {"triton": "HT", "pallas": "TH"}
MAX_SUM_POSITIONS = 256
MAX_SUM_WARPS = 4
MAX_SUM_FUSED_HEADS = {"triton": 8, "pallas": 32}
MAX_SUM_FUSED_POSITIONS = {"triton": 256, "pallas": 1024}
MAX_SUM_FUSED_WARPS = {"triton": 8, "pallas": 8}
# The context-parallel rescale reads one partial's tile and writes one: it takes the N-way tile of two partials
# (the 2-way merge's bytes per tile).
RESCALE_TILE_PARTIALS = 2

KNOBS = ("MASK_NUM_WARPS", "MASK_TILE_H", "ZERO_TILE_ELEMS", "MASK_TARGET_PROGRAMS", "MASK_ZERO_SPLIT",
         "MASK_LSE_SPLIT", "MERGE_TILES", "MERGE_N_TILES", "N_TILE_BYTES", "N_LOOPS", "N_OUTPUTS_EVICT",
         "N_OUT_STAGES", "N_EARLY_OUTPUTS", "N_SPLIT_ABOVE", "N_SPLIT_WEIGHTS", "N_SPLIT_WEIGHTS_LAYOUT",
         "MAX_SUM_POSITIONS", "MAX_SUM_WARPS", "MAX_SUM_FUSED_HEADS", "MAX_SUM_FUSED_POSITIONS",
         "MAX_SUM_FUSED_WARPS")


def set_knobs(**values) -> dict:
    """Set launch-table knobs (names in `KNOBS`) and clear the cached tiles and grids; returns the values they
    replaced, so a sweep can restore them (`set_knobs(**previous)`)."""
    unknown = set(values) - set(KNOBS)
    if unknown:
        raise ValueError(f"unknown knobs {sorted(unknown)}; the knobs are {KNOBS}")
    previous = {k: globals()[k] for k in values}
    globals().update(values)
    for cached in (mask_tiles, merge_tiles, mask_split):
        cached.cache_clear()
    return previous


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.lru_cache(maxsize=None)
def mask_tiles(num_heads: int, head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_H, BLOCK_HO, BLOCK_D): head tile of the LSE stores, head and dim tiles of output zeroing."""
    block_h = min(next_pow2(num_heads), MASK_TILE_H)
    block_d = min(next_pow2(head_dim), 128)
    block_ho = max(1, min(next_pow2(num_heads), ZERO_TILE_ELEMS // (MASK_BLOCK_T * block_d)))
    return block_h, block_ho, block_d


@functools.lru_cache(maxsize=None)
def merge_tiles(framework: str, num_heads: int, head_dim: int, variant: str = "plain",
                itemsize: int = 2, num_partials: int = 0, lse_layout: str = "HT") -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_H, BLOCK_D) of a merge program: the whole (padded) head, the variant's fewest tokens, then
    heads, then more tokens, up to the byte budget of one `itemsize`-byte input tile: `MERGE_TILES` for the 2-way
    merge (num_partials=0), else `partial_tile_bytes` of `MERGE_N_TILES` for `lse_layout`."""
    if num_partials:
        total, min_block_t, floor_block_t, _ = n_tile(framework, variant, num_partials, lse_layout)
        tile_bytes = partial_tile_bytes(total, num_partials)
        if tile_bytes == N_TILE_BYTES[0]:
            min_block_t = floor_block_t
    else:
        tile_bytes, min_block_t, _ = MERGE_TILES[framework][variant]
    elems = max(1, tile_bytes // itemsize)
    block_d = next_pow2(head_dim)
    rest = max(1, elems // block_d)
    block_h = min(next_pow2(num_heads), max(1, rest // min_block_t))
    block_t = max(1, rest // block_h)
    return block_t, block_h, block_d


def partial_tile_bytes(total: int, num_partials: int) -> int:
    """Bytes of one partial's tile in an N-way program whose N tiles share `total` bytes: a power of two, within
    `N_TILE_BYTES`."""
    share = 1 << ((total // num_partials).bit_length() - 1)
    return min(max(share, N_TILE_BYTES[0]), N_TILE_BYTES[1])


def merge_num_warps(framework: str, variant: str, num_partials: int = 0, lse_layout: str = "HT") -> int:
    if num_partials:
        return n_tile(framework, variant, num_partials, lse_layout)[3]
    return MERGE_TILES[framework][variant][2]


def tile_variant(framework: str, variant: str, num_partials: int, lse_layout: str) -> str:
    """The `MERGE_N_TILES` entry an N-way merge of `variant` takes: its own, but beyond N_SPLIT_ABOVE with the
    weights stored (`split_weights`) the fused merge's weighted sum reads neither LSEs nor offsets per partial and
    takes "weighted"."""
    if variant == "fused" and split_passes(num_partials) and split_weights(framework, variant, lse_layout):
        return "weighted"
    return variant


def n_tile(framework: str, variant: str, num_partials: int, lse_layout: str) -> tuple[int, int, int, int]:
    """The `MERGE_N_TILES` entry of an N-way merge: its `tile_variant`'s, for the LSEs' layout or, for "weighted"
    (the fused merge's weighted sum given the weights: it reads the split buffer, not the LSEs, per partial), for
    the buffer's (`split_layout` of the fused merge)."""
    entry = tile_variant(framework, variant, num_partials, lse_layout)
    layout = split_layout(framework, "fused", lse_layout) if entry == "weighted" else lse_layout
    return MERGE_N_TILES[framework][entry][layout]


def merge_variant(output_lse: bool, fused: bool) -> str:
    return "fused" if fused else "lse" if output_lse else "plain"


def merge_grid(framework: str, num_tokens: int, num_heads: int, head_dim: int, variant: str = "plain",
               itemsize: int = 2, num_partials: int = 0, lse_layout: str = "HT") -> tuple[int]:
    """One axis (no 65535 limit), head blocks fastest: program = token block * head blocks + head block."""
    block_t, block_h, _ = merge_tiles(framework, num_heads, head_dim, variant, itemsize, num_partials, lse_layout)
    return (cdiv(num_tokens, block_t) * cdiv(num_heads, block_h),)


def n_loops(framework: str, variant: str) -> tuple[int, int, int]:
    """(max_chunk, exp_step, out_step) of the N-way loops of `variant` ("plain", "lse", "fused"; `N_LOOPS`)."""
    return N_LOOPS[framework][variant]


def outputs_evict(framework: str, num_partials: int) -> str:
    """The eviction policy of the N-way merge's output-tile loads at N = `num_partials` (`N_OUTPUTS_EVICT`)."""
    return N_OUTPUTS_EVICT[framework] if num_partials > constants.UNROLLED_PARTIALS else ""


def out_stages(framework: str, variant: str, num_partials: int) -> int:
    """The stages of the N-way weighted sum's runtime loop at N = `num_partials` (`N_OUT_STAGES`; 1 where the loop
    unrolls)."""
    return N_OUT_STAGES[framework][variant] if num_partials > constants.UNROLLED_PARTIALS else 1


def early_outputs(framework: str, variant: str, num_partials: int) -> int:
    """How many output tiles (partials 0, 1, ..) the N-way merge of `num_partials` partials loads before its LSE
    passes (`N_EARLY_OUTPUTS`; 0 where its loops run at runtime)."""
    if num_partials > constants.UNROLLED_PARTIALS:
        return 0
    counts = N_EARLY_OUTPUTS[framework][variant]
    at = [n for n in counts if n <= num_partials]
    return max(0, min(counts[max(at)], num_partials - 1)) if at else 0


def split_passes(num_partials: int) -> bool:
    """Whether the N-way merge of `num_partials` partials runs in two kernels (`N_SPLIT_ABOVE`)."""
    return num_partials > N_SPLIT_ABOVE


def split_weights(framework: str, variant: str, lse_layout: str) -> bool:
    """Whether the split merge's first kernel also stores the weights' numerators e_i (`N_SPLIT_WEIGHTS`)."""
    return N_SPLIT_WEIGHTS[framework][variant][lse_layout]


def split_layout(framework: str, variant: str, lse_layout: str) -> str:
    """The layout of the split merge's buffer ("HT" or "TH"): `N_SPLIT_WEIGHTS_LAYOUT` where the weights are stored
    with [H, T] LSEs, else the LSEs'."""
    if lse_layout == "HT" and split_weights(framework, variant, lse_layout):
        return N_SPLIT_WEIGHTS_LAYOUT[framework]
    return lse_layout


def max_sum_tiles(framework: str, num_heads: int, lse_layout: str, fused: bool = False) -> tuple[int, int]:
    """(BLOCK_T, BLOCK_H) of a program of the split N-way merge's first kernel: MAX_SUM_POSITIONS LSE positions,
    a run of tokens of one head in [H, T] layout (fused: MAX_SUM_FUSED_POSITIONS of MAX_SUM_FUSED_HEADS heads),
    every head (up to the budget) of a few tokens in [T, H]."""
    if lse_layout == "HT" and fused:
        block_h = min(next_pow2(num_heads), MAX_SUM_FUSED_HEADS[framework])
        return max(1, MAX_SUM_FUSED_POSITIONS[framework] // block_h), block_h
    block_h = 1 if lse_layout == "HT" else min(next_pow2(num_heads), MAX_SUM_POSITIONS)
    return max(1, MAX_SUM_POSITIONS // block_h), block_h


def max_sum_warps(framework: str, lse_layout: str, fused: bool = False) -> int:
    """The warps of a program of the split N-way merge's first kernel (`max_sum_tiles`)."""
    return MAX_SUM_FUSED_WARPS[framework] if lse_layout == "HT" and fused else MAX_SUM_WARPS


def max_sum_grid(framework: str, num_tokens: int, num_heads: int, lse_layout: str,
                 fused: bool = False) -> tuple[int]:
    """The first kernel's grid, head blocks fastest as the merges'."""
    block_t, block_h = max_sum_tiles(framework, num_heads, lse_layout, fused)
    return (cdiv(num_tokens, block_t) * cdiv(num_heads, block_h),)


def loop_steps(count: int, num_partials: int, step: int) -> int:
    """The runtime steps of `step` partials (an exp_step or out_step of `N_LOOPS`) of a loop over `count` of the N =
    `num_partials` partials, the rest unrolled (0: all unrolled, N <= `constants.UNROLLED_PARTIALS`); read at plan
    time."""
    if num_partials <= constants.UNROLLED_PARTIALS:
        return 0
    return max(count, 0) // step


def max_chunks(num_partials: int, chunk: int) -> int:
    """The loads of `chunk` LSE tiles (a max_chunk of `N_LOOPS`) of the N-way maximum over partials 1 .. N-1 (0: one
    partial at a time, in `loop_steps`; always 0 up to N = `constants.UNROLLED_PARTIALS`); read at plan time."""
    if num_partials <= constants.UNROLLED_PARTIALS or not chunk:
        return 0
    return cdiv(num_partials - 1, chunk)


def mask_blocks(num_tokens: int, num_requests: int) -> int:
    """Token blocks of the mask grid. Worst case: each request may open a partial block -> T // BLOCK_T + R."""
    return num_tokens // MASK_BLOCK_T + num_requests


@functools.lru_cache(maxsize=None)
def mask_split(num_tokens: int, num_requests: int, num_heads: int, head_dim: int, zero_output: bool) -> int:
    """Programs per 128-token block (the mask grid's second axis); static shapes only, never offsets' values."""
    block_h, block_ho, block_d = mask_tiles(num_heads, head_dim)
    tiles = cdiv(num_heads, block_ho) * cdiv(head_dim, block_d) if zero_output else cdiv(num_heads, block_h)
    want = next_pow2(cdiv(MASK_TARGET_PROGRAMS, max(1, mask_blocks(num_tokens, num_requests))))
    return max(1, min(tiles, mask_split_cap(zero_output), want))


def mask_split_cap(zero_output: bool) -> int:
    """The most programs per block of the variant; 1: its kernel never reads the second grid axis."""
    return MASK_ZERO_SPLIT if zero_output else MASK_LSE_SPLIT


def mask_grid(num_tokens: int, num_requests: int, num_heads: int, head_dim: int,
              zero_output: bool) -> tuple[int, int]:
    """(token blocks, programs per block): the second axis splits a block's stores (`mask_split`)."""
    return (mask_blocks(num_tokens, num_requests),
            mask_split(num_tokens, num_requests, num_heads, head_dim, zero_output))
