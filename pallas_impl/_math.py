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
MOSAIC_MIN_JAX = (0, 11)  # Mosaic GPU: Warpgroup lowering by default, plgpu.kernel(out_type=...), its interpreter


def natural_lse(x, lse_base2: bool):
    """An LSE tile as the merges read it (docs/spec.md 4.1): natural log, +inf and NaN as -inf."""
    if lse_base2:
        x = x * LN2
    return jnp.where((x == jnp.inf) | (x != x), -jnp.inf, x)


def stored_lse(lse, lse_base2: bool):
    """A merged natural-log LSE tile in the caller's base."""
    return lse * LOG2E if lse_base2 else lse


def two_way_weights(p, s):
    """(m, both_empty, z, wp, ws) of two natural-log LSE tiles whose empty rows are -inf (docs/spec.md 4.2, 4.3):
    m is 0 where both are empty, z = e_p + e_s."""
    m = jnp.maximum(p, s)
    both_empty = m == -jnp.inf
    m = jnp.where(both_empty, 0.0, m)
    pe = jnp.exp(p - m)
    se = jnp.exp(s - m)
    z = pe + se
    return m, both_empty, z, pe / z, se / z


def n_way_max_and_sum(lses):
    """(m, all_empty, e, z) of N natural-log LSE tiles whose empty rows are -inf (docs/spec.md 8.2): the maximum in
    index order, 0 where all are empty; e_i = exp(lse_i - m); z their sum in index order."""
    m = lses[0]
    for x in lses[1:]:
        m = jnp.maximum(m, x)
    all_empty = m == -jnp.inf
    m = jnp.where(all_empty, 0.0, m)
    e = [jnp.exp(x - m) for x in lses]
    z = e[0]
    for x in e[1:]:
        z = z + x
    return m, all_empty, e, z


@functools.cache
def has_mosaic_gpu() -> bool:
    """Whether this jax's Mosaic GPU Pallas API is one the `pallas_impl/mosaic` kernels take (jax >= 0.11)."""
    return tuple(int(x) for x in re.findall(r"\d+", jax.__version__)[:2]) >= MOSAIC_MIN_JAX
