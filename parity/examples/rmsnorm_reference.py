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


_UNIT = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8, "float8_e4m3fn": 2.0**-4}
_ATOL = {"float32": 2.0**-120, "float16": 2.0**-24, "bfloat16": 2.0**-120, "float8_e4m3fn": 2.0**-9}


def tolerance(D: int, dtype="bfloat16", *, truncating_cast: bool = False) -> dict[str, tuple[float, float]]:
    """(rtol, atol) per output for `parity.cross_check`, from the kernels' error analysis.

    The f32 sum of D squares (all terms >= 0) errs by at most D units of roundoff u = 2^-24 relative; rstd
    halves that (a square root) and adds four roundings (/D, +eps, sqrt, 1/x): rtol (D/2 + 4) u. out adds two
    multiplies and the rounding to its dtype (unit u_out; twice that where the cast truncates, as Triton's
    interpreter does to bf16). atol: the output dtype's smallest subnormal scale (fp16, fp8), else negligible.
    """
    name = np.dtype(dtype).name
    u, u_out = 2.0**-24, _UNIT[name] * (2 if truncating_cast else 1)
    rstd = (D / 2 + 4) * u
    return {"out": (rstd + 2 * u + u_out + u, _ATOL[name]), "rstd": (rstd, 2.0**-120)}


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
