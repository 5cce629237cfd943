"""Float64 reference: the executable definition of the mask and the merges (docs/spec.md sections 3, 4, 8).

numpy only. Inputs are numpy arrays (any float dtype for outputs, f32 LSE, i32 offsets); results are
new arrays, the inputs are never modified. Float results are float64 except where the operation is a bit
copy (mask, pass-through rows), which keeps the input's dtype and bits.

The 2-way merge (section 4) is the N-way merge (section 8) of `(prefix, suffix)` whose fused mask covers
the prefix only: both run through `_merge_stacked`, so the two definitions cannot drift apart.
"""

from __future__ import annotations

import math

import numpy as np

FP8_E4M3_MAX = 448.0
LSE_LAYOUTS = ("HT", "TH")


def _check_layout(lse_layout: str) -> None:
    if lse_layout not in LSE_LAYOUTS:
        raise ValueError(f"lse_layout must be one of {LSE_LAYOUTS}, got {lse_layout!r}")


def _lse_as_ht(lse: np.ndarray, lse_layout: str) -> np.ndarray:
    _check_layout(lse_layout)
    return lse if lse_layout == "HT" else lse.T


def _base2(lse_base) -> bool:
    """Whether LSEs are base 2 (else base e). A merge works in its LSEs' own base (docs/spec.md 4.3): base-2 LSEs are
    never converted, so a merge with empty partials returns the remaining LSE exactly in either base."""
    if lse_base == 2:
        return True
    if lse_base == math.e:
        return False
    raise ValueError(f"lse_base must be math.e or 2, got {lse_base!r}")


def empty_token_mask(query_start_loc: np.ndarray, cu_seq_lens: np.ndarray, num_tokens: int) -> np.ndarray:
    """bool[T]: True for the tokens of requests whose context chunk is empty (section 3). Padding is False."""
    qsl = np.asarray(query_start_loc, dtype=np.int64)
    cu = np.asarray(cu_seq_lens, dtype=np.int64)
    empty = np.zeros(num_tokens, dtype=bool)
    for r in range(len(qsl) - 1):
        if cu[r + 1] == cu[r]:
            empty[qsl[r]:qsl[r + 1]] = True
    return empty


def mask_empty_context_lse(lse, query_start_loc, cu_seq_lens, output=None, *, lse_layout="HT"):
    """Section 3. Returns (lse, output) copies with the empty requests' rows set to -inf / 0."""
    lse = np.array(lse, copy=True)
    ht = _lse_as_ht(lse, lse_layout)  # a view: writes land in `lse`
    empty = empty_token_mask(query_start_loc, cu_seq_lens, ht.shape[1])
    ht[:, empty] = -np.inf
    if output is not None:
        output = np.array(output, copy=True)
        output[empty] = 0
    return lse, output


def _weights(l_raw: np.ndarray, empty: np.ndarray | None, base2: bool):
    """(w f64[N, T, H], m f64[T, H], z f64[T, H], both_empty bool[T, H]) of raw LSEs f32[N, T, H] (8.1-8.3), in the
    LSEs' base: e_i = exp(l_i - m), or 2^(l_i - m) for base 2 (m and the LSEs base 2).

    `empty` is bool[N, T] (a token of a request empty in partial i) or None. `m` is 0 where every partial
    is empty, so `log(z) + m` is finite everywhere it is used. N = 0: every row empty.
    """
    l = l_raw.astype(np.float64)
    l = np.where(np.isposinf(l) | np.isnan(l), -np.inf, l)  # 8.1 (4.1): +inf and NaN mean empty
    if empty is not None:
        l[np.asarray(empty, dtype=bool)] = -np.inf  # 8.1 (4.5): the fused mask, from the offsets only
    m = l.max(axis=0, initial=-np.inf)
    both_empty = m == -np.inf  # 8.2 (4.2)
    m = np.where(both_empty, 0.0, m)
    e = np.exp2(l - m) if base2 else np.exp(l - m)
    z = e.sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        w = e / z
    return w, m, z, both_empty


def _merge_stacked(outputs, l_raw: np.ndarray, *, empty, prefill_tokens_with_context, output_scale, base2,
                   shape=None):
    """The N-way merge of partials `outputs` (a sequence of N [T, H, D] arrays) with raw LSEs f32[N, T, H].

    Returns (out f64[T, H, D], lse f64[T, H] in the input base). `shape` ([T, H, D]) is needed for N = 0 only:
    every row empty, out 0 and LSE -inf, pass-through rows too (there is no last partial to copy, 8.4).
    """
    w, m, z, both_empty = _weights(l_raw, empty, base2)
    out = np.zeros(np.shape(outputs[0]) if len(outputs) else shape, dtype=np.float64)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        for i, o in enumerate(outputs):  # 8.3 (4.3): index order; a zero weight contributes exactly 0
            wi = w[i][..., None]
            out += np.where(wi > 0, np.asarray(o, dtype=np.float64) * wi, 0.0)
        out = np.where(both_empty[..., None], 0.0, out)
        lse = np.where(both_empty, -np.inf, (np.log2(z) if base2 else np.log(z)) + m)  # 4.3: one live partial: m

    if prefill_tokens_with_context is not None and len(outputs):  # 8.4 (4.4): bit copies of the last partial
        n = int(prefill_tokens_with_context)
        out[n:] = np.asarray(outputs[-1], dtype=np.float64)[n:]
        lse[n:] = l_raw[-1, n:]
        if empty is not None:  # 8.4: the fused mask reaches the copied LSE (the mask, then the merge)
            lse[n:][np.asarray(empty, dtype=bool)[-1, n:]] = -np.inf

    if output_scale is not None:  # 4.6
        scale = float(np.asarray(output_scale, dtype=np.float32).reshape(-1)[0])
        out = np.clip(out / scale, -FP8_E4M3_MAX, FP8_E4M3_MAX)
    return out, lse


GROUP_EPS = np.float32(1e-10)  # docs/spec.md 4.7 (mla_lse_common.constants.GROUP_EPS as f32)


def per_token_group_quant_fp8(x, group_size: int, *, scale_ue8m0: bool = False):
    """Section 4.7: per-token-group FP8 quantization of f32 rows, in f32 arithmetic (each step one IEEE f32
    operation; on a GPU both kernels' divisions are the platform's f32 `/`, as vLLM's Triton quantizer's).

    `x`: [T, ..., K] values, taken as f32 and flattened to [T, K] in their order; K a multiple of `group_size`.
    Returns (q f32[T, K], the clamped quotients before the fp8 cast (round-to-nearest-even, `to_fp8`), and
    scales f32[T, K // group_size]). Per group of `group_size` consecutive elements: amax = max |x| over the
    non-NaN elements, floored at GROUP_EPS; scale = amax / 448; with `scale_ue8m0` rounded up to a power of two on
    its bits (a nonzero mantissa goes to the next power of two: exactly 2^ceil(log2(scale)), with no log2 rounding);
    q = clamp(x / scale, -448, 448) with comparisons (NaN stays NaN).
    """
    x = np.asarray(x, np.float32)
    rows = x.reshape(x.shape[0], -1)
    groups = rows.reshape(rows.shape[0], -1, group_size)
    with np.errstate(invalid="ignore"):
        mag = np.where(np.isnan(groups), np.float32(0), np.abs(groups))
    amax = np.maximum(mag.max(axis=-1, initial=np.float32(0)), GROUP_EPS)
    scale = (amax / np.float32(FP8_E4M3_MAX)).astype(np.float32)
    if scale_ue8m0:
        bits = scale.view(np.int32)
        scale = ((bits + np.int32(0x007FFFFF)) & np.int32(0x7F800000)).astype(np.int32).view(np.float32)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        q = groups / scale[..., None]
    q = np.where(q < -FP8_E4M3_MAX, np.float32(-FP8_E4M3_MAX), q)
    q = np.where(q > FP8_E4M3_MAX, np.float32(FP8_E4M3_MAX), q).astype(np.float32)
    return q.reshape(rows.shape), scale


def to_fp8(q):
    """The round-to-nearest-even cast of clamped f32 quotients to float8_e4m3fn (ml_dtypes)."""
    import ml_dtypes

    return np.asarray(q, np.float32).astype(ml_dtypes.float8_e4m3fn)


FP4_E2M1_MAX = 6.0
NVFP4_BLOCK = 16
# docs/spec.md 4.8: the e2m1 magnitude code of |y| counts these thresholds it passes ((value, inclusive)).
FP4_E2M1_THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True),
                       (5.0, False))
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude code -> value


def quant_nvfp4(x, global_scale, *, quotients: bool = False):
    """Section 4.8: NVFP4 quantization of f32 rows, in f32 arithmetic (each step one IEEE f32 operation).

    `x`: [T, ..., K] values, taken as f32 and flattened to [T, K]; K a multiple of 16. `global_scale`: the f32
    global scale g (finite, > 0). Returns (codes u8[T, K], one e2m1 code per element: bit 3 the sign, bits 0-2 the
    magnitude code; scales float8_e4m3fn[T, K // 16]). Per block of 16: amax = max |x| over the non-NaN elements
    (0 if none); s = e4m3((amax * f32(1/6)) * g) saturated at 448; inv = 1 / (f32(s) * f32(1/g)), 0 where s is 0;
    y = clamp(x * inv, -6, 6) with comparisons; the code of y by its thresholds, its sign bit from y's bits.
    `pack_fp4` packs two codes per byte, `swizzle_nvfp4_scales` lays the scales out for the FP4 GEMMs. With
    `quotients=True` the first result is y f32[T, K] instead, the clamped quotients the codes round (the parity
    check's reference values).
    """
    import ml_dtypes

    x = np.asarray(x, np.float32)
    rows = x.reshape(x.shape[0], -1)
    blocks = rows.reshape(rows.shape[0], -1, NVFP4_BLOCK)
    g = np.float32(global_scale)
    with np.errstate(invalid="ignore", over="ignore"):
        mag = np.where(np.isnan(blocks), np.float32(0), np.abs(blocks))
        amax = mag.max(axis=-1, initial=np.float32(0))
        s = (amax * np.float32(1 / FP4_E2M1_MAX)).astype(np.float32) * g
        s = np.where(s > np.float32(FP8_E4M3_MAX), np.float32(FP8_E4M3_MAX), s).astype(np.float32)
        scales = s.astype(ml_dtypes.float8_e4m3fn)
        sf = scales.astype(np.float32)
        denom = (sf * np.float32(np.float32(1) / g)).astype(np.float32)
        inv = np.where(sf == 0, np.float32(0), np.float32(1) / np.where(sf == 0, np.float32(1), denom))
        y = (blocks * inv.astype(np.float32)[..., None]).astype(np.float32)
        y = np.where(y < -FP4_E2M1_MAX, np.float32(-FP4_E2M1_MAX), y)
        y = np.where(y > FP4_E2M1_MAX, np.float32(FP4_E2M1_MAX), y).astype(np.float32)
    if quotients:
        return y.reshape(rows.shape), scales
    return e2m1_codes(y).reshape(rows.shape), scales


def e2m1_codes(y):
    """Section 4.8: the e2m1 codes (bit 3 the sign bit of y, bits 0-2 the thresholds |y| passes; a NaN passes
    none) of the clamped f32 quotients `y`."""
    y = np.asarray(y, np.float32)
    a = np.abs(y)
    code = np.zeros(y.shape, np.uint8)
    with np.errstate(invalid="ignore"):
        for value, inclusive in FP4_E2M1_THRESHOLDS:
            code += (a >= np.float32(value)) if inclusive else (a > np.float32(value))
    sign = (y.view(np.uint32) >> 31).astype(np.uint8)
    return code | (sign << 3)


def e2m1_values(y):
    """Section 4.8: the f32 values the e2m1 codes of the clamped quotients `y` stand for (`fp4_values` of
    `e2m1_codes`)."""
    return fp4_values(e2m1_codes(y))


def fp4_values(codes):
    """f32 values of e2m1 codes (bit 3 the sign): the dequantized elements before their block scale."""
    codes = np.asarray(codes, np.uint8)
    mag = np.asarray(FP4_E2M1_VALUES, np.float32)[codes & 7]
    return np.where(codes & 8, -mag, mag).astype(np.float32)


def pack_fp4(codes):
    """u8[T, K] e2m1 codes -> u8[T, K // 2]: byte j holds element 2j in its low nibble, 2j + 1 in its high one."""
    codes = np.asarray(codes, np.uint8)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)


def unpack_fp4(packed):
    """u8[..., K // 2] -> u8[..., K] e2m1 codes: `pack_fp4`'s inverse (element 2j the low nibble of byte j)."""
    packed = np.asarray(packed, np.uint8)
    return np.stack([packed & 15, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)


def swizzled_offsets(num_tokens: int, num_blocks: int) -> np.ndarray:
    """i64[T, K]: where block scale (t, k) lands in the 128x4-swizzled layout (`swizzle_nvfp4_scales`)."""
    kp = -(-num_blocks // 4) * 4
    tt, kk = np.meshgrid(np.arange(num_tokens), np.arange(num_blocks), indexing="ij")
    return ((tt // 128) * (kp // 4) + kk // 4) * 512 + (tt % 32) * 16 + ((tt % 128) // 32) * 4 + kk % 4


def swizzle_nvfp4_scales(scales):
    """[T, K] block scales (any 1-byte dtype) -> the same dtype, flat, in the 128x4-swizzled layout (section 4.8):
    T padded to a multiple of 128 and K to a multiple of 4 with zeros; scale (t, k) at
    ((t // 128) * (K_pad / 4) + k // 4) * 512 + (t % 32) * 16 + ((t % 128) // 32) * 4 + k % 4."""
    scales = np.asarray(scales)
    t, k = scales.shape
    tp, kp = -(-t // 128) * 128, -(-k // 4) * 4
    bits = np.zeros((tp, kp), np.uint8)
    bits[:t, :k] = scales.view(np.uint8)
    out = np.zeros(tp * kp, np.uint8)
    out[swizzled_offsets(tp, kp).ravel()] = bits.ravel()
    return out.view(scales.dtype)


def _from_th(lse_th: np.ndarray, lse_layout: str) -> np.ndarray:
    return lse_th.T if lse_layout == "HT" else lse_th


def merge_attn_states(prefix_output, prefix_lse, suffix_output, suffix_lse, *,
                      prefill_tokens_with_context=None, query_start_loc=None, prefix_cu_seq_lens=None,
                      output_scale=None, lse_layout="HT", lse_base=math.e):
    """Section 4. Returns (out f64[T, H, D], lse f64 in the input layout and base).

    Pass-through rows (4.4) hold the suffix values exactly (as float64, which represents every input value
    exactly). With `output_scale` (4.6) `out` is the clamped, scaled value before the fp8 cast; the caller
    rounds it to e4m3.
    """
    base2 = _base2(lse_base)
    num_tokens = np.shape(prefix_output)[0]
    l_raw = np.stack([_lse_as_ht(np.asarray(x), lse_layout).T for x in (prefix_lse, suffix_lse)])
    empty = None
    if query_start_loc is not None:  # 4.5: the fused mask covers the prefix only
        empty = np.zeros((2, num_tokens), dtype=bool)
        empty[0] = empty_token_mask(query_start_loc, prefix_cu_seq_lens, num_tokens)
    out, lse = _merge_stacked((prefix_output, suffix_output), l_raw, empty=empty,
                              prefill_tokens_with_context=prefill_tokens_with_context,
                              output_scale=output_scale, base2=base2)
    return out, _from_th(lse, lse_layout)


def _lses_as_nth(lses: np.ndarray, lse_layout: str) -> np.ndarray:
    """[N, T, H] view of stacked LSEs given as [N, H, T] ("HT") or [N, T, H] ("TH")."""
    _check_layout(lse_layout)
    lses = np.asarray(lses)
    return lses.transpose(0, 2, 1) if lse_layout == "HT" else lses


def merge_attn_states_n(outputs, lses, *, prefill_tokens_with_context=None, query_start_loc=None,
                        cu_seq_lens=None, output_scale=None, lse_layout="HT", lse_base=math.e):
    """Section 8: the N-way merge of stacked partials.

    Args:
      outputs: [N, T, H, D], any float dtype.
      lses: f32[N, H, T] ([N, T, H] with lse_layout="TH"), base e or 2. N >= 0 (N = 0: out 0, LSE -inf).
      query_start_loc, cu_seq_lens: i32[R+1] and i32[N, R+1], both or neither: a token of a request empty in
        partial i (cu_seq_lens[i, r+1] == cu_seq_lens[i, r]) gives partial i LSE -inf (8.1).
      prefill_tokens_with_context: tokens at or past it copy the last partial's row and raw LSE (8.4); with
        the offsets, -inf for a token of a request with no KV in the last partial.
      output_scale: fp8 output scale (4.6).

    Returns:
      (out f64[T, H, D], lse f64 in the input layout and base).
    """
    base2 = _base2(lse_base)
    outputs = np.asarray(outputs)
    if outputs.ndim != 4:
        raise ValueError(f"outputs must be [N, T, H, D]; got {outputs.shape=}")
    num_tokens = outputs.shape[1]
    l_raw = _lses_as_nth(lses, lse_layout)
    empty = None if query_start_loc is None else empty_token_masks(query_start_loc, cu_seq_lens, num_tokens)
    out, lse = _merge_stacked(list(outputs), l_raw, empty=empty,
                              prefill_tokens_with_context=prefill_tokens_with_context,
                              output_scale=output_scale, base2=base2, shape=outputs.shape[1:])
    return out, _from_th(lse, lse_layout)


def empty_token_masks(query_start_loc, cu_seq_lens, num_tokens: int) -> np.ndarray:
    """bool[N, T]: `empty_token_mask` of each partial's offsets `cu_seq_lens` i32[N, R+1]."""
    cu = np.asarray(cu_seq_lens)
    return np.array([empty_token_mask(query_start_loc, cu[i], num_tokens) for i in range(cu.shape[0])],
                    dtype=bool).reshape(cu.shape[0], num_tokens)


def merge_weights_n(lses, *, empty=None, prefill_tokens_with_context=None, lse_layout="HT",
                    lse_base=math.e) -> np.ndarray:
    """f64[N, T, H]: the weight w_i of each partial in the N-way merge (8.3) of LSEs f32[N, H, T] ([N, T, H]).

    `empty` is bool[N, T] (the fused mask: `empty_token_masks`, or for the 2-way merge the prefix's mask
    stacked on all-False) or None. Rows empty everywhere weigh every partial 0; pass-through rows (8.4) weigh
    the last partial 1 and the others 0. The weights give the scale of the merge's rounding error
    (`parity.harness.expected.merge_magnitude`).
    """
    l_raw = _lses_as_nth(lses, lse_layout)
    w, _, _, both_empty = _weights(l_raw, empty, _base2(lse_base))
    w = np.where(both_empty[None], 0.0, w)
    if prefill_tokens_with_context is not None and w.shape[0]:
        n = int(prefill_tokens_with_context)
        w[:, n:] = 0.0
        w[-1, n:] = 1.0
    return w
