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


def group_quant(x, group_size: int, ue8m0: bool):
    """Per-group FP8 quantization of f32 `x` [..., K] in groups of `group_size` consecutive elements of its last
    axis (docs/spec.md 4.7): (q f32 [..., K], the clamped quotients before the fp8 cast; scale f32 [..., K // G]).
    amax over the non-NaN |x|, floored at GROUP_EPS; scale = amax / 448 (UE8M0: rounded up to a power of two on its
    bits); q = clamp(x / scale, -448, 448) with comparisons (NaN stays NaN)."""
    groups = x.reshape(*x.shape[:-1], x.shape[-1] // group_size, group_size)
    amax = jnp.max(jnp.where(groups == groups, jnp.abs(groups), 0.0), axis=-1)  # NaN left out of the maximum
    amax = jnp.where(amax > constants.GROUP_EPS, amax, jnp.float32(constants.GROUP_EPS))
    # amax / 448 with a divisor XLA cannot fold: it rewrites a division by a literal into a multiplication by the
    # reciprocal, which moves bits (amax is never NaN here, so the select always takes 448).
    scale = amax / jnp.where(amax == amax, jnp.float32(FP8_E4M3_MAX), jnp.float32(0))
    if ue8m0:  # rounded up to a power of two on the bits: exactly 2^ceil(log2(scale))
        bits = jax.lax.bitcast_convert_type(scale, jnp.int32)
        scale = jax.lax.bitcast_convert_type((bits + constants.UE8M0_ROUND_UP) & constants.UE8M0_EXPONENT,
                                             jnp.float32)
    q = groups / scale[..., None]
    q = jnp.where(q < -FP8_E4M3_MAX, -FP8_E4M3_MAX, q)  # comparisons, not min/max: NaN stays NaN
    q = jnp.where(q > FP8_E4M3_MAX, FP8_E4M3_MAX, q)
    return q.reshape(x.shape), scale


def scale_layout(scales, layout: str):
    """Per-group scales f32[T, G#] in `layout` (constants.SCALE_LAYOUTS): row-major as they are, column-major
    [G#, T], or column-major with T padded with zeros to a multiple of TMA_ALIGN_T (DeepGEMM's TMA alignment)."""
    if layout == "row":
        return scales
    if layout == "col_tma":
        pad = -scales.shape[0] % constants.TMA_ALIGN_T
        scales = jnp.pad(scales, ((0, pad), (0, 0)))
    return scales.T

