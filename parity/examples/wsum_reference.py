"""Softmax-weighted sum of mixed-sign values in float64 numpy: the reference of the third worked pair of
docs/parity-library.md (semantics: `wsum_triton.py`'s docstring), and its inputs. numpy only."""

from __future__ import annotations

import numpy as np


def softmax_wsum(scores, values):
    """out f64[T, D]: sum_n softmax(scores[t])_n * values[t, n, :]; a zero weight contributes 0 whatever its
    value, a row of zero weights gives 0."""
    s = np.asarray(scores, dtype=np.float64)
    v = np.asarray(values, dtype=np.float64)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        m = s.max(axis=1, keepdims=True)
        m = np.where(np.isinf(m), 0.0, m)
        p = np.exp(s - m)
        den = p.sum(axis=1)
        pv = p[:, :, None] * np.where(p[:, :, None] == 0, 0.0, v)
        return np.where(den[:, None] > 0, pv.sum(axis=1) / np.where(den > 0, den, 1.0)[:, None], 0.0)


def make_inputs(seed: int = 0, T: int = 21, N: int = 12, D: int = 40, dtype="float32", poison: bool = False):
    """scores f32[T, N] (about a third of them -inf: zero weights; the last row all -inf) and values[T, N, D] in
    `dtype` of both signs, the last key of each row (the largest weight) chosen so that half of the output columns cancel to near
    0. With `poison`, the values behind the zero weights are NaN (a correct kernel ignores them)."""
    import ml_dtypes

    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(seed)
    s = (rng.standard_normal((T, N)) * 2.0).astype(np.float32)
    masked = rng.random((T, N)) < 0.33
    masked[:, N - 1] = False
    masked[T - 1] = True
    s[:, N - 1] = s.max(axis=1) + 0.5  # the last key has the largest weight: its value stays of the others' size
    s[masked] = -np.inf
    v = (rng.standard_normal((T, N, D)) * rng.uniform(0.5, 8.0, (T, 1, 1))).astype(dt).astype(np.float64)
    with np.errstate(invalid="ignore"):
        p = np.exp(s - np.where(np.isinf(s.max(1, keepdims=True)), 0.0, s.max(1, keepdims=True)))
    for t in range(T - 1):  # cancel columns 0, 2, 4, ...: the last key's value undoes the others
        rest = (p[t, :N - 1, None] * np.where(masked[t, :N - 1, None], 0.0, v[t, :N - 1])).sum(0)
        v[t, N - 1, 0::2] = -rest[0::2] / p[t, N - 1]
    v = v.astype(dt)
    if poison:
        v[masked] = np.nan
    return {"scores": s, "values": v}
