"""The element math both Pallas GPU backends share (the Triton-backend kernels in `pallas_impl/*.py` and the
Mosaic GPU kernels in `pallas_impl/mosaic/*.py`): constants and jnp expressions, nothing backend-specific.

It imports jax only, and nothing of `pallas_impl`: both backends' files import it, it imports neither.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp

FP8_E4M3_MAX = 448.0
LN2 = 0.6931471805599453
LOG2E = 1.4426950408889634
# The N-way loops over the partials (docs/spec.md 8, "Any N"): unrolled at trace time up to N = UNROLLED_PARTIALS
# (fast code, a short compile); beyond, runtime steps of PARTIALS_PER_STEP partials (`lax.fori_loop`, each step
# unrolled), the last count % PARTIALS_PER_STEP unrolled: a compile that does not grow with N. The same operations
# in the same order either way, so the same bits. Equal to triton_impl/merge_n.py's.
UNROLLED_PARTIALS = 16
PARTIALS_PER_STEP = 4
MOSAIC_MIN_JAX = (0, 11)  # Mosaic GPU: Warpgroup lowering by default, plgpu.kernel(out_type=...), its interpreter


def fold_partials(lo: int, hi: int, body, init, num_partials: int):
    """`body(i, x)` for i = lo .. hi - 1 in order from `init`, for the merge of N = `num_partials` partials: all
    unrolled at trace time up to N = UNROLLED_PARTIALS, else `lax.fori_loop` steps of PARTIALS_PER_STEP partials
    (an `scf.for` in a Pallas kernel) and the rest unrolled; the partition of triton_impl/merge_n.py's loops."""
    steps = 0 if num_partials <= UNROLLED_PARTIALS else max(hi - lo, 0) // PARTIALS_PER_STEP

    def step(k, x):
        for j in range(PARTIALS_PER_STEP):
            x = body(lo + k * PARTIALS_PER_STEP + j, x)
        return x

    x = jax.lax.fori_loop(0, steps, step, init) if steps else init
    for i in range(lo + steps * PARTIALS_PER_STEP, hi):
        x = body(i, x)
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


def n_way_max_and_sum(lses, lse_base2: bool):
    """(m, all_empty, e, z) of N LSE tiles (in their base) whose empty rows are -inf (docs/spec.md 8.2): the maximum
    in index order, 0 where all are empty; e_i = exp(lse_i - m) (base 2: exp((lse_i - m) * ln2)); z their sum in index order."""
    m = lses[0]
    for x in lses[1:]:
        m = jnp.maximum(m, x)
    all_empty = m == -jnp.inf
    m = jnp.where(all_empty, 0.0, m)
    e = [exp_base(x - m, lse_base2) for x in lses]
    z = e[0]
    for x in e[1:]:
        z = z + x
    return m, all_empty, e, z


@functools.cache
def has_mosaic_gpu() -> bool:
    """Whether this jax's Mosaic GPU Pallas API is one the `pallas_impl/mosaic` kernels take (jax >= 0.11)."""
    return tuple(int(x) for x in re.findall(r"\d+", jax.__version__)[:2]) >= MOSAIC_MIN_JAX
