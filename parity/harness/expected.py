"""What a merge's results must be, read off the float64 reference: weights, tolerance magnitudes, exact elements.

`check` and `golden` judge every implementation with these. numpy only. `arrays` is the numpy dict an op of
`parity.harness.impls.OPS` runs on (`impls.op_call`), so the weights follow exactly the operands the reference saw.
"""

from __future__ import annotations

import math

import numpy as np

from parity.harness import cases as cases_mod
from parity.harness import reference


def _partials(case: cases_mod.Case, op: str, arrays: dict[str, np.ndarray]):
    """(outputs: N arrays [T, H, D], lses f32[N, ...] in the case's layout, empty bool[N, T] or None)."""
    D, T = case.head_dim, case.num_tokens
    if op in ("merge", "merge_fused"):
        outputs = (arrays["prefix_output"][..., :D], arrays["suffix_output"][..., :D])
        lses = np.stack([arrays["prefix_lse"], arrays["suffix_lse"]])
        empty = None
        if op == "merge_fused":  # the fused mask covers the prefix only (docs/spec.md 4.5)
            empty = np.zeros((2, T), dtype=bool)
            empty[0] = reference.empty_token_mask(arrays["query_start_loc"], arrays["cu_seq_lens"], T)
        return outputs, lses, empty
    if op in ("merge_n", "merge_n_fused"):
        empty = None
        if op == "merge_n_fused":
            empty = reference.empty_token_masks(arrays["query_start_loc"], arrays["cu_seq_lens"], T)
        return arrays["outputs"][..., :D], arrays["lses"], empty
    raise ValueError(f"not a merge: {op!r}")


def merge_weights(case: cases_mod.Case, op: str, arrays: dict[str, np.ndarray]) -> np.ndarray:
    """f64[N, T, H]: the reference weight of every partial (N = 2 for the 2-way merges)."""
    _, lses, empty = _partials(case, op, arrays)
    return reference.merge_weights_n(lses, empty=empty, prefill_tokens_with_context=case.prefill_tokens_with_context,
                                     lse_layout=case.lse_layout, lse_base=case.lse_base)


def magnitude(case: cases_mod.Case, op: str, arrays: dict[str, np.ndarray], weights: np.ndarray) -> np.ndarray:
    """f64[T, H, D]: the tolerance magnitude sum_i |o_i| * w_i (divided by the static fp8 scale; NVFP4's global
    scale is the check's to apply, with the block scales)."""
    outputs, _, _ = _partials(case, op, arrays)
    return merge_magnitude(outputs, weights, None if case.nvfp4 else arrays.get("output_scale"))


def nvfp4_units(mag: np.ndarray, scales, global_scale) -> np.ndarray:
    """NVFP4 (docs/spec.md 4.8): the magnitude `mag` f64[T, H, D] in each block's units (x * g / s, s the e4m3 block
    scales [T, H * D / 16]; 0 in an all-zero block), the scale of the codes' values; NaN (a NaN element, whose code
    is +-0) as 0."""
    T, H, D = mag.shape
    sf = np.asarray(scales, np.float32).astype(np.float64)
    g = float(np.asarray(global_scale, np.float32).reshape(-1)[0])
    unit = np.where(sf > 0, g / np.where(sf > 0, sf, 1.0), 0.0)
    mag = (mag.reshape(T, -1, reference.NVFP4_BLOCK) * unit[..., None]).reshape(T, H, D)
    return np.where(np.isnan(mag), 0.0, mag)


def nvfp4_in_reference_units(values, scales, ref_scales) -> np.ndarray:
    """NVFP4 (docs/spec.md 4.8): an implementation's code values [T, H, D] in the reference's block units, times
    its block scale over the reference's (1 where the reference's is 0): a block whose scale is one e4m3 step off
    the reference's (an ulp of its f32 rows moved the amax across a rounding boundary) still compares within half
    a code step, since its quotients were taken in its own units. Any array type in, numpy f32 out (one
    rounding)."""
    from parity.library import bridge

    values = np.asarray(bridge.to_numpy(values), np.float64)
    T, H, D = values.shape
    got = np.asarray(bridge.to_numpy(scales), np.float32).astype(np.float64)
    ref = np.asarray(ref_scales, np.float32).astype(np.float64)
    ratio = np.where(ref > 0, got / np.where(ref > 0, ref, 1.0), 1.0)
    return (values.reshape(T, -1, reference.NVFP4_BLOCK) * ratio[..., None]).reshape(T, H, D).astype(np.float32)


def exact_masks(case: cases_mod.Case, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(out_exact bool[T, H], lse_exact bool in the case's LSE layout): where the result is a bit copy.

    - pass-through rows (`t >= prefill_tokens_with_context`): the last partial's row and raw LSE bits;
    - rows where no partial has weight (every partial empty): out 0, LSE -inf;
    - rows where one partial alone has weight (the others' weights are exactly 0, even in float64): its
      weight is 1, so the row is that partial's (rounded once to another output dtype), and its LSE is that
      partial's LSE, in base 2 as in base e (the merge works in the LSEs' base: log(1) + m == m,
      docs/spec.md 4.3).
    With an fp8 or NVFP4 output only the rows without weight are exact in the output (the others are scaled and
    cast).
    """
    passthrough = np.zeros(weights.shape[1:], dtype=bool)
    if case.prefill_tokens_with_context is not None:
        passthrough[case.prefill_tokens_with_context:] = True
    live = (weights > 0).sum(axis=0)
    none, alone = (live == 0) & ~passthrough, (live == 1) & ~passthrough
    out_exact = none if case.fp8_out or case.nvfp4 else none | alone | passthrough
    lse_exact = none | passthrough | alone
    return out_exact, (lse_exact.T if case.lse_layout == "HT" else lse_exact)


def merge_magnitude(outputs, weights, output_scale=None) -> np.ndarray:
    """f64[T, H, D]: sum_i |o_i| * w_i, the scale of the merge's rounding error (the `mag` of `TOLERANCES`).

    `outputs` are the N partials (a sequence of [T, H, D] arrays, or one [N, T, H, D] array), `weights` their
    merge weights f64[N, T, H] (`parity.harness.reference.merge_weights_n`). A zero weight contributes exactly 0
    (docs/spec.md 4.3), so NaN in an empty partial does not reach the magnitude. With an fp8 output (4.6) it
    is divided by the scale.
    """
    mag = None
    for o, w in zip(outputs, np.asarray(weights, dtype=np.float64)):
        with np.errstate(invalid="ignore"):
            term = np.where(w[..., None] > 0, np.abs(np.asarray(o, dtype=np.float64)) * w[..., None], 0.0)
        mag = term if mag is None else mag + term
    if output_scale is not None:
        mag /= float(np.asarray(output_scale, dtype=np.float32).reshape(-1)[0])
    return mag


def merge_out_magnitude(prefix_output: np.ndarray, prefix_lse: np.ndarray, suffix_output: np.ndarray,
                        suffix_lse: np.ndarray, *, output_scale=None, query_start_loc=None, prefix_cu_seq_lens=None,
                        prefill_tokens_with_context=None, lse_layout="HT", lse_base=math.e) -> np.ndarray:
    """`merge_magnitude` of the 2-way merge with these options, its weights from `parity.harness.reference`."""
    T = np.asarray(prefix_output).shape[0]
    empty = None
    if query_start_loc is not None:  # the fused mask covers the prefix only
        empty = np.zeros((2, T), dtype=bool)
        empty[0] = reference.empty_token_mask(query_start_loc, prefix_cu_seq_lens, T)
    w = reference.merge_weights_n(np.stack([prefix_lse, suffix_lse]), empty=empty, lse_layout=lse_layout,
                                  lse_base=lse_base, prefill_tokens_with_context=prefill_tokens_with_context)
    return merge_magnitude((prefix_output, suffix_output), w, output_scale)


def merge_out_magnitude_n(outputs: np.ndarray, lses: np.ndarray, *, output_scale=None, query_start_loc=None,
                          cu_seq_lens=None, prefill_tokens_with_context=None, lse_layout="HT",
                          lse_base=math.e) -> np.ndarray:
    """`merge_magnitude` of the N-way merge with these options, its weights from `parity.harness.reference`."""
    T = np.asarray(outputs).shape[1]
    empty = None if query_start_loc is None else reference.empty_token_masks(query_start_loc, cu_seq_lens, T)
    w = reference.merge_weights_n(lses, empty=empty, lse_layout=lse_layout, lse_base=lse_base,
                                  prefill_tokens_with_context=prefill_tokens_with_context)
    return merge_magnitude(outputs, w, output_scale)
