"""RMSNorm over a ragged batch in float64 numpy: the reference of the worked example of docs/parity-library.md
(semantics: `rmsnorm_triton.py`'s docstring). numpy only."""

from __future__ import annotations

import numpy as np


def rmsnorm(x, weight, query_start_loc, eps=1e-6):
    """(out f64[T, D], rstd f64[T]) of the inputs' values."""
    x = np.asarray(x, dtype=np.float64)
    w = np.asarray(weight, dtype=np.float64)
    real = np.arange(x.shape[0]) < int(np.asarray(query_start_loc)[-1])
    rstd = np.where(real, 1.0 / np.sqrt(np.mean(x * x, axis=1) + np.float64(np.float32(eps))), 0.0)
    return x * rstd[:, None] * w[None, :], rstd


def make_inputs(seed: int = 0, query_lens=(5, 0, 17, 1, 9), padding: int = 3, D: int = 96, dtype="bfloat16"):
    """A ragged batch: requests of `query_lens` tokens (one empty), `padding` tokens after them, x and weight
    in `dtype` (numpy / ml_dtypes), query_start_loc int32, eps a float."""
    import ml_dtypes

    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(seed)
    T = int(sum(query_lens)) + padding
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    x = (rng.standard_normal((T, D)) * rng.uniform(0.1, 4.0, (T, 1))).astype(dt)
    w = rng.uniform(0.5, 1.5, D).astype(dt)
    return {"x": x, "weight": w, "query_start_loc": qsl, "eps": 1e-6}
