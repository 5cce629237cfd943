"""Float64 reference: the executable definition of the mask and the merge (SPEC sections 3-4).

numpy only. Inputs are numpy arrays (any float dtype for outputs, f32 LSE, i32 offsets); results are
new arrays, the inputs are never modified. Float results are float64 except where the operation is a bit
copy (mask, pass-through rows), which keeps the input's dtype and bits.
"""

from __future__ import annotations

import math

import numpy as np

FP8_E4M3_MAX = 448.0
LSE_LAYOUTS = ("HT", "TH")


def _lse_as_ht(lse: np.ndarray, lse_layout: str) -> np.ndarray:
    if lse_layout not in LSE_LAYOUTS:
        raise ValueError(f"lse_layout must be one of {LSE_LAYOUTS}, got {lse_layout!r}")
    return lse if lse_layout == "HT" else lse.T


def _lse_base_factor(lse_base) -> float:
    """ln(base): multiply a base-`lse_base` LSE by it to get a natural-log LSE."""
    if lse_base == 2:
        return math.log(2.0)
    if lse_base == math.e:
        return 1.0
    raise ValueError(f"lse_base must be math.e or 2, got {lse_base!r}")


def empty_token_mask(query_start_loc: np.ndarray, cu_seq_lens: np.ndarray, num_tokens: int) -> np.ndarray:
    """bool[T]: True for the tokens of requests whose context chunk is empty (SPEC 3). Padding is False."""
    qsl = np.asarray(query_start_loc, dtype=np.int64)
    cu = np.asarray(cu_seq_lens, dtype=np.int64)
    empty = np.zeros(num_tokens, dtype=bool)
    for r in range(len(qsl) - 1):
        if cu[r + 1] == cu[r]:
            empty[qsl[r]:qsl[r + 1]] = True
    return empty


def mask_empty_context_lse(lse, query_start_loc, cu_seq_lens, output=None, *, lse_layout="HT"):
    """SPEC 3. Returns (lse, output) copies with the empty requests' rows set to -inf / 0."""
    lse = np.array(lse, copy=True)
    ht = _lse_as_ht(lse, lse_layout)  # a view: writes land in `lse`
    empty = empty_token_mask(query_start_loc, cu_seq_lens, ht.shape[1])
    ht[:, empty] = -np.inf
    if output is not None:
        output = np.array(output, copy=True)
        output[empty] = 0
    return lse, output


def merge_attn_states(prefix_output, prefix_lse, suffix_output, suffix_lse, *,
                      prefill_tokens_with_context=None, query_start_loc=None, prefix_cu_seq_lens=None,
                      output_scale=None, lse_layout="HT", lse_base=math.e):
    """SPEC 4. Returns (out f64[T, H, D], lse f64 in the input layout and base).

    Pass-through rows (SPEC 4.4) hold the suffix values exactly (as float64, which represents every
    input value exactly). With `output_scale` (SPEC 4.6) `out` is the clamped, scaled value before the
    fp8 cast; the caller rounds it to e4m3.
    """
    a = np.asarray(prefix_output, dtype=np.float64)
    b = np.asarray(suffix_output, dtype=np.float64)
    num_tokens = a.shape[0]
    ln_base = _lse_base_factor(lse_base)
    p_raw = _lse_as_ht(np.asarray(prefix_lse), lse_layout).astype(np.float64).T  # [T, H]
    s_raw = _lse_as_ht(np.asarray(suffix_lse), lse_layout).astype(np.float64).T

    # SPEC 4.1: +inf and NaN mean "empty", like -inf.
    def normalise(x):
        return np.where(np.isposinf(x) | np.isnan(x), -np.inf, x * ln_base)

    p, s = normalise(p_raw), normalise(s_raw)
    if query_start_loc is not None:  # SPEC 4.5: the fused mask
        empty = empty_token_mask(query_start_loc, prefix_cu_seq_lens, num_tokens)
        p[empty] = -np.inf

    m = np.maximum(p, s)
    both_empty = m == -np.inf  # SPEC 4.2
    m_safe = np.where(both_empty, 0.0, m)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        pe, se = np.exp(p - m_safe), np.exp(s - m_safe)
        z = pe + se
        wp, ws = pe / z, se / z
        # SPEC 4.3: a zero weight contributes exactly 0, whatever the partial holds.
        term_a = np.where((wp > 0)[..., None], a * wp[..., None], 0.0)
        term_b = np.where((ws > 0)[..., None], b * ws[..., None], 0.0)
        out = np.where(both_empty[..., None], 0.0, term_a + term_b)
        lse = np.where(both_empty, -np.inf, np.log(z) + m_safe) / ln_base

    if prefill_tokens_with_context is not None:  # SPEC 4.4: bit copies of the suffix
        n = int(prefill_tokens_with_context)
        out[n:] = b[n:]
        lse[n:] = s_raw[n:]

    if output_scale is not None:  # SPEC 4.6
        scale = float(np.asarray(output_scale, dtype=np.float32).reshape(-1)[0])
        out = np.clip(out / scale, -FP8_E4M3_MAX, FP8_E4M3_MAX)

    lse = lse.T  # back to [H, T]
    return out, (lse if lse_layout == "HT" else lse.T)
