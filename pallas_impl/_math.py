"""The element math both Pallas GPU backends share (the Triton-backend kernels in `pallas_impl/*.py` and the
Mosaic GPU kernels in `pallas_impl/mosaic/*.py`): constants and jnp expressions, nothing backend-specific.

It imports jax and the framework-free constants only, nothing of `pallas_impl`: both backends' files import it, it
imports neither.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mla_lse_common import constants, tiles
from mla_lse_common.constants import FP8_E4M3_MAX, LN2, LOG2E  # noqa: F401 (re-exported)


def fold_partials(lo: int, hi: int, body, init, num_partials: int, step: int, *, unroll: bool = False):
    """`body(i, x)` for i = lo .. hi - 1 in order from `init`, for the merge of N = `num_partials` partials: all
    unrolled at trace time up to N = UNROLLED_PARTIALS (or with unroll=True), else `lax.fori_loop` steps of `step`
    partials (an exp_step or out_step of `tiles.N_LOOPS`; an `scf.for` in a Pallas kernel) and the rest unrolled:
    the partition of the Triton kernels' loops (`mla_lse_common.tiles.loop_steps`), read at trace time."""
    steps = 0 if unroll else tiles.loop_steps(hi - lo, num_partials, step)
    per_step = step

    def step(k, x):
        for j in range(per_step):
            x = body(lo + k * per_step + j, x)
        return x

    x = jax.lax.fori_loop(0, steps, step, init) if steps else init
    for i in range(lo + steps * per_step, hi):
        x = body(i, x)
    return x


def fold_prefetched(lo: int, hi: int, load, body, init, num_partials: int, step: int, stages: int):
    """`fold_partials` of `body(i, load(i), x)`; with stages >= 2 (`tiles.out_stages`) its runtime loop issues the
    loads of step k + 1 before the bodies of step k and carries them to the next iteration (the first step's loads
    before the loop, the last step's bodies after it): the same operations in the same order, with one step's loads
    always in flight. Pallas' Triton lowering has no per-loop stages; the Triton kernels pipeline the same loop
    (`tl.range(num_stages=...)`)."""
    steps = tiles.loop_steps(hi - lo, num_partials, step)
    if stages < 2 or steps < 2:
        return fold_partials(lo, hi, lambda i, x: body(i, load(i), x), init, num_partials, step)

    def loads(k):
        return tuple(load(lo + k * step + j) for j in range(step))

    def bodies(k, got, x):
        for j in range(step):
            x = body(lo + k * step + j, got[j], x)
        return x

    def one_step(k, carry):
        x, got = carry
        ahead = loads(k + 1)
        return bodies(k, got, x), ahead

    x, got = jax.lax.fori_loop(0, steps - 1, one_step, (init, loads(0)))
    x = bodies(steps - 1, got, x)
    for i in range(lo + steps * step, hi):
        x = body(i, load(i), x)
    return x


def clean_lse(x):
    """An LSE tile as the merges read it (docs/spec.md 4.1): +inf and NaN as -inf. No base conversion: a base-2
    LSE stays base 2 and the merge works in base 2 (`exp_base`, `merged_lse`), so an identity stays exact."""
    return jnp.where((x == jnp.inf) | (x != x), -jnp.inf, x)


def exp_base(x, lse_base2: bool):
    """exp(x), or for a difference x of base-2 LSEs 2^x = exp(x * ln2) (docs/spec.md 4.3; x = 0 gives exactly 1).
    Not `jnp.exp2`: XLA lowers it to exp(ln2 * x) while Pallas' Triton lowering calls `__nv_exp2f`, so the jnp path
    and the kernels would differ in bits."""
    return jnp.exp(x * LN2) if lse_base2 else jnp.exp(x)


def merged_lse(z, m, empty, lse_base2: bool):
    """The merge's LSE tile in the LSEs' base (docs/spec.md 4.3): log(z) + m, for base 2 log(z) * log2(e) + m;
    -inf where every partial is empty (m is 0 there). The product sits behind the select, so no backend contracts
    it with the add into an FMA."""
    lz = jnp.log(z)
    if lse_base2:
        lz = lz * LOG2E
    return jnp.where(empty, -jnp.inf, lz) + m


def two_way_weights(p, s, lse_base2: bool):
    """(m, both_empty, z, wp, ws) of two LSE tiles (in their base) whose empty rows are -inf (docs/spec.md 4.2,
    4.3): m is 0 where both are empty, z = e_p + e_s."""
    m = jnp.maximum(p, s)
    both_empty = m == -jnp.inf
    m = jnp.where(both_empty, 0.0, m)
    pe = exp_base(p - m, lse_base2)
    se = exp_base(s - m, lse_base2)
    z = pe + se
    return m, both_empty, z, pe / z, se / z


def n_way_max_and_sum(lse_i, num_partials: int, lse_base2: bool, *, unroll: bool = False, lse_chunk=None,
                      chunk: int = 0, exp_step: int = 4, store_e=None):
    """(m, all_empty, e, z) of N LSE tiles (in their base) whose empty rows are -inf (docs/spec.md 8.2, 8.3): the
    maximum, 0 where all are empty; e_i = exp(lse_i - m) (base 2: exp((lse_i - m) * ln2)); z their sum in index
    order.

    `lse_i(i)`: partial i's tile. It is called twice per partial, for the maximum and for the exponential, so a
    kernel may reload a tile rather than keep N of them live; a caller holding the tiles passes `tiles.__getitem__`
    and unroll=True (a Python list takes no traced index). The loops unroll up to N = UNROLLED_PARTIALS and are
    runtime loops beyond (`fold_partials`); `e` is the list of the e_i where every loop unrolls, else None.
    `lse_chunk(first)`: the [chunk, ...] tiles of partials first, first + 1, ... (-inf past N), given by a kernel
    whose maximum beyond UNROLLED_PARTIALS reads them in one load each (`tiles.max_chunks`; a maximum is exact in
    any order), as the Triton kernels' `_chunk_max`; without it, or with chunk = 0, the maximum runs in index order.
    The runtime loops take steps of `exp_step` partials (`tiles.N_LOOPS`). `store_e(i, e_i)`, if given, is called
    with every e_i as the sum takes it (the split merge's first kernel stores them for the weighted sum).
    """
    chunks = 0 if unroll or lse_chunk is None else tiles.max_chunks(num_partials, chunk)
    if chunks:
        m = jax.lax.fori_loop(0, chunks, lambda k, m: jnp.maximum(m, jnp.max(lse_chunk(1 + k * chunk), axis=0)),
                              lse_i(0))
    else:
        m = fold_partials(1, num_partials, lambda i, m: jnp.maximum(m, lse_i(i)), lse_i(0), num_partials,
                          exp_step, unroll=unroll)
    all_empty = m == -jnp.inf
    m = jnp.where(all_empty, 0.0, m)

    def exp_i(i):
        e_i = exp_base(lse_i(i) - m, lse_base2)
        if store_e is not None:
            store_e(i, e_i)
        return e_i

    e = [exp_i(0)]
    if unroll or not tiles.loop_steps(num_partials - 1, num_partials, exp_step):
        z = e[0]
        for i in range(1, num_partials):
            e.append(exp_i(i))
            z = z + e[i]
        return m, all_empty, e, z
    z = fold_partials(1, num_partials, lambda i, z: z + exp_i(i), e[0], num_partials, exp_step)
    return m, all_empty, None, z


def static_fp8(x, scale):
    """The static-scale fp8 quotient of f32 `x` (docs/spec.md 4.6): clamp(x / scale, -448, 448) with comparisons
    (NaN stays NaN), f32, before the fp8 cast."""
    q = x / scale
    q = jnp.where(q < -FP8_E4M3_MAX, -FP8_E4M3_MAX, q)  # comparisons, not min/max: NaN stays NaN
    return jnp.where(q > FP8_E4M3_MAX, FP8_E4M3_MAX, q)


def group_quant(x, group_size: int, ue8m0: bool):
    """Per-group FP8 quantization of f32 `x` [..., K] in groups of `group_size` consecutive elements of its last
    axis (docs/spec.md 4.7): (q f32 [..., K], the clamped quotients before the fp8 cast; scale f32 [..., K // G]);
    `quant_groups` of the groups."""
    q, scale = quant_groups(x.reshape(*x.shape[:-1], x.shape[-1] // group_size, group_size), ue8m0)
    return q.reshape(x.shape), scale


def quant_groups(groups, ue8m0: bool):
    """Per-group FP8 quantization of f32 `groups` [..., G], one group per row of the last axis (docs/spec.md 4.7):
    (q f32 [..., G], scale f32 [...]). amax over the non-NaN |x|, floored at GROUP_EPS; scale = amax / 448 (UE8M0:
    rounded up to a power of two on its bits); q = clamp(x / scale, -448, 448) with comparisons (NaN stays NaN).
    The Mosaic GPU kernels call it on a `[128, G]` slice of a tile."""
    amax = jnp.max(jnp.where(groups == groups, jnp.abs(groups), 0.0), axis=-1)  # NaN left out of the maximum
    amax = jnp.where(amax > constants.GROUP_EPS, amax, jnp.float32(constants.GROUP_EPS))
    # amax / 448 with a divisor XLA cannot fold: it rewrites a division by a literal into a multiplication by the
    # reciprocal, which moves bits (amax is never NaN here, so the select always takes 448).
    scale = amax / jnp.where(amax == amax, jnp.float32(FP8_E4M3_MAX), jnp.float32(0))
    if ue8m0:  # rounded up to a power of two on the bits: exactly 2^ceil(log2(scale))
        bits = jax.lax.bitcast_convert_type(scale, jnp.int32)
        scale = jax.lax.bitcast_convert_type((bits + constants.UE8M0_ROUND_UP) & constants.UE8M0_EXPONENT,
                                             jnp.float32)
    return static_fp8(groups, scale[..., None]), scale


NVFP4 = "nvfp4"  # the middle item of a `group` option for NVFP4 output: (NVFP4_BLOCK, NVFP4, scale layout)


def is_nvfp4(group) -> bool:
    """Whether the merges' quantized-output option `group` is NVFP4 (docs/spec.md 4.8), not per-group FP8 (4.7)."""
    return group is not None and group[1] == NVFP4


def quantized_shapes(num_tokens: int, num_heads: int, head_dim: int, group):
    """((out shape, out dtype), (scales shape, scales dtype)) of a merge quantized per `group` (4.7 or 4.8), the
    scales row-major: NVFP4 packs two e2m1 codes a byte and keeps e4m3 block scales, per-group FP8 f32 scales."""
    blocks = (num_tokens, num_heads * head_dim // group[0])
    if is_nvfp4(group):
        return ((num_tokens, num_heads, head_dim // 2), jnp.uint8), (blocks, jnp.float8_e4m3fn)
    return ((num_tokens, num_heads, head_dim), jnp.float8_e4m3fn), (blocks, jnp.float32)


def nvfp4_quant(x, global_scale):
    """NVFP4 quantization of f32 `x` [..., K] (K a multiple of 16) in blocks of 16 consecutive elements of its last
    axis (docs/spec.md 4.8), each step one f32 operation: (codes i32 [..., K], the e2m1 code of each element, bit 3
    its sign; block scales float8_e4m3fn [..., K // 16]). amax over the block's non-NaN |x|; s = e4m3((amax *
    f32(1/6)) * g) saturated at 448 with a comparison; inv = 1 / (f32(s) * (1 / g)), 0 where s is 0; y = clamp(x *
    inv, -6, 6) with comparisons; the magnitude code counts the thresholds |y| passes (a NaN passes none)."""
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // constants.NVFP4_BLOCK, constants.NVFP4_BLOCK)
    codes, scales = nvfp4_blocks(blocks, global_scale.astype(jnp.float32))
    return codes.reshape(x.shape), scales


def nvfp4_blocks(blocks, g):
    """`nvfp4_quant` of f32 `blocks` [..., 16], one block per row of the last axis, with the f32 global scale `g`
    (a scalar, or one per block): (codes i32 [..., 16], block scales float8_e4m3fn [...]). The Mosaic GPU kernels
    call it on a `[128, 16]` column slice of a tile, `g` a row."""
    amax = jnp.max(jnp.where(blocks == blocks, jnp.abs(blocks), 0.0), axis=-1)  # NaN left out of the maximum
    # (amax * f32(1/6)) * g with a factor XLA cannot fold: it reassociates a product of two broadcast scalars into
    # amax * (g * f32(1/6)), which moves bits (amax is never NaN, so the select always takes 1/6).
    s = (amax * jnp.where(amax == amax, jnp.float32(1 / constants.FP4_E2M1_MAX), jnp.float32(0))) * g
    scales = jnp.where(s > FP8_E4M3_MAX, jnp.float32(FP8_E4M3_MAX), s).astype(jnp.float8_e4m3fn)
    sf = e4m3_value(scales)
    inv = jnp.where(sf == 0.0, 0.0, 1.0 / jnp.where(sf == 0.0, 1.0, sf * (1.0 / g)))
    y = blocks * inv[..., None]
    y = jnp.where(y < -constants.FP4_E2M1_MAX, -constants.FP4_E2M1_MAX, y)  # comparisons: NaN stays NaN
    y = jnp.where(y > constants.FP4_E2M1_MAX, constants.FP4_E2M1_MAX, y)
    a = jnp.abs(y)
    code = jnp.zeros(y.shape, jnp.int32)
    for value, inclusive in constants.FP4_E2M1_THRESHOLDS:
        code = code + ((a >= value) if inclusive else (a > value)).astype(jnp.int32)
    sign = jax.lax.shift_right_logical(jax.lax.bitcast_convert_type(y, jnp.int32), 31)
    return code | (sign << 3), scales


def e4m3_value(v):
    """f32 of float8_e4m3fn `v` decoded from its bits with integer operations: the value of `v.astype(float32)`. XLA
    on the GPU may drop an f32 -> e4m3 -> f32 round trip as "excess precision" (the f32 before the cast comes out);
    it cannot see through the bits. e4m3fn: sign bit 7, exponent bits 6-3 (bias 7), mantissa bits 2-0; exponent 0
    is subnormal (m * 2^-9), S.1111.111 is NaN, there is no infinity."""
    bits = jax.lax.bitcast_convert_type(v, jnp.uint8).astype(jnp.int32)
    e, m = (bits >> 3) & 0xF, bits & 7
    normal = jax.lax.bitcast_convert_type(((e + 120) << 23) | (m << 20), jnp.float32)
    mag = jnp.where(e == 0, m.astype(jnp.float32) * jnp.float32(2.0 ** -9), normal)
    mag = jnp.where((bits & 0x7F) == 0x7F, jnp.float32(jnp.nan), mag)
    return jnp.where(bits >= 0x80, -mag, mag)


def pack_fp4(codes):
    """e2m1 codes i32 [..., K] -> u8 [..., K // 2]: byte j holds element 2j in its low nibble, 2j + 1 in its high one
    (a reduction of pairs, shifted by a 1-D iota: what Pallas' Triton lowering takes)."""
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    shift = jax.lax.broadcast_in_dim(4 * jax.lax.iota(jnp.int32, 2), pairs.shape, (pairs.ndim - 1,))
    return jnp.sum(pairs << shift, axis=-1).astype(jnp.uint8)


def with_swizzled_scales(results):
    """A merge's results with their last, NVFP4's row-major block scales, in the swizzled layout (the public
    functions' step after the call for scale_layout="swizzled")."""
    return (*results[:-1], swizzle_nvfp4_scales(results[-1]))


def swizzle_nvfp4_scales(scales):
    """Block scales [T, K] (1 byte each) in the 128x4-swizzled layout of the FP4 GEMMs (docs/spec.md 4.8), flat:
    T padded to a multiple of 128 and K to a multiple of 4 with zeros, scale (t, k) at ((t // 128) * (K_pad / 4) +
    k // 4) * 512 + (t % 32) * 16 + ((t % 128) // 32) * 4 + k % 4: a reshape and a transpose."""
    rows, cols = constants.NVFP4_SWIZZLE
    t, k = scales.shape
    if any(axis is not None for axis in getattr(jax.typeof(scales).sharding, "spec", ())):
        # scales sharded over an Explicit mesh (heads): the swizzle interleaves every head's columns, so the
        # swizzled array is replicated (an all-gather of T * H * D / 16 bytes)
        scales = jax.sharding.reshard(scales, jax.sharding.PartitionSpec())
    padded = jnp.pad(scales, ((0, -t % rows), (0, -k % cols)))
    tiles_t, tiles_k = padded.shape[0] // rows, padded.shape[1] // cols
    # [t // 128, (t % 128) // 32, t % 32, k // 4, k % 4] -> [t // 128, k // 4, t % 32, (t % 128) // 32, k % 4]
    x = padded.reshape(tiles_t, 4, 32, tiles_k, cols).transpose(0, 3, 2, 1, 4)
    return x.reshape(-1)


def scale_layout(scales, layout: str):
    """Per-group scales f32[T, G#] in `layout` (constants.SCALE_LAYOUTS): row-major as they are, column-major
    [G#, T], or column-major with T padded with zeros to a multiple of TMA_ALIGN_T (DeepGEMM's TMA alignment)."""
    if layout == "row":
        return scales
    if layout == "swizzled":  # NVFP4's block scales (docs/spec.md 4.8)
        return swizzle_nvfp4_scales(scales)
    if layout == "col_tma":
        pad = -scales.shape[0] % constants.TMA_ALIGN_T
        scales = jnp.pad(scales, ((0, pad), (0, 0)))
    return scales.T

