"""The element math both Pallas GPU backends share (the Triton-backend kernels in `pallas_impl/*.py` and the
Mosaic GPU kernels in `pallas_impl/mosaic/*.py`): constants and jnp expressions, nothing backend-specific.

It imports jax and the framework-free constants only, nothing of `pallas_impl`: both backends' files import it, it
imports neither.
"""

from __future__ import annotations

import jax.numpy as jnp

from mla_lse_common.constants import FP8_E4M3_MAX, LN2, LOG2E  # noqa: F401 (re-exported: _math.FP8_E4M3_MAX, ...)


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


def n_way_max_and_sum(lse_i, num_partials: int):
    """(m, all_empty, e, z) of N natural-log LSE tiles whose empty rows are -inf (docs/spec.md 8.2, 8.3): the maximum
    in index order, 0 where all are empty; e_i = exp(lse_i - m); z their sum in index order.

    `lse_i(i)`: partial i's tile. It is called twice per partial, for the maximum and for the exponential, so a
    kernel may reload a tile rather than keep N of them live; a caller holding the tiles passes `tiles.__getitem__`.
    """
    m = lse_i(0)
    for i in range(1, num_partials):
        m = jnp.maximum(m, lse_i(i))
    all_empty = m == -jnp.inf
    m = jnp.where(all_empty, 0.0, m)
    e = [jnp.exp(lse_i(0) - m)]
    z = e[0]
    for i in range(1, num_partials):
        e.append(jnp.exp(lse_i(i) - m))
        z = z + e[i]
    return m, all_empty, e, z
