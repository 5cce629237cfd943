"""Log-sum-exp over a ragged batch in float64 numpy: the reference of the second worked pair of
docs/parity-library.md (semantics: `lse_triton.py`'s docstring), and its inputs. numpy only."""

from __future__ import annotations

import numpy as np


def ragged_lse(x, query_start_loc):
    """lse f64[R, H] of the inputs' values: log sum_t exp(x[t, h]) over the tokens of each request."""
    x = np.asarray(x, dtype=np.float64)
    qsl = np.asarray(query_start_loc).astype(np.int64)
    out = np.empty((qsl.size - 1, x.shape[1]))
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for r in range(qsl.size - 1):
            rows = x[qsl[r]:qsl[r + 1]]
            m = rows.max(axis=0) if rows.shape[0] else np.full(x.shape[1], -np.inf)
            m = np.where(np.isinf(m), 0.0, m)
            out[r] = m + np.log(np.exp(rows - m).sum(axis=0))
    return out


def make_inputs(seed: int = 0, query_lens=(7, 0, 19, 1, 12, 30), padding: int = 3, H: int = 6, dtype="float32",
                near_zero: bool = True):
    """A ragged batch x[T, H] (`dtype`, numpy / ml_dtypes) of requests of `query_lens` tokens (one empty) and
    `padding` tokens after them, with query_start_loc int32. With `near_zero`, every other request is shifted so
    that its log-sum-exp is near 0 while its maximum is not (a log-domain output near 0)."""
    import ml_dtypes

    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(seed)
    T = int(sum(query_lens)) + padding
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    x = rng.standard_normal((T, H)) * rng.uniform(0.5, 3.0, (1, H)) + rng.uniform(-4.0, 4.0, (T, 1)) + 20.0
    x = x.astype(dt).astype(np.float64)
    if near_zero:
        lse = ragged_lse(x, qsl)
        for r in range(0, qsl.size - 1, 2):
            if qsl[r + 1] > qsl[r]:
                x[qsl[r]:qsl[r + 1]] -= lse[r]
    return {"x": x.astype(dt), "query_start_loc": qsl}
