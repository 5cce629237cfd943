"""parity.library.compare: ULP distances, value classes, located failure messages and the reference tolerances."""

import json
import math

import ml_dtypes
import numpy as np
import pytest

import jax.numpy as jnp
import torch

from parity.harness import expected
from parity.library import bridge, compare, scan
from parity.harness import cases, reference

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
# Every bit pattern of the narrow formats: (torch dtype, numpy dtype, unsigned view).
NARROW = [
    pytest.param(torch.bfloat16, ml_dtypes.bfloat16, np.uint16, id="bf16"),
    pytest.param(torch.float16, np.float16, np.uint16, id="fp16"),
    pytest.param(torch.float8_e4m3fn, ml_dtypes.float8_e4m3fn, np.uint8, id="fp8e4m3"),
]
# An output dtype with its tolerance entry (each dtype shares a parameter with its tolerance).
OUT_DTYPES = [
    pytest.param(torch.float32, compare.TOLERANCES["float32"], id="fp32"),
    pytest.param(torch.float16, compare.TOLERANCES["float16"], id="fp16"),
    pytest.param(torch.bfloat16, compare.TOLERANCES["bfloat16"], id="bf16"),
    pytest.param(torch.float8_e4m3fn, compare.TOLERANCES["float8_e4m3fn"], id="fp8e4m3"),
]
# Merge cases probed with an f32 merge on XLA:CPU (FMA contraction, XLA's exp/log): the tolerances must
# accept a faithful f32 implementation. fp32+TH+specials, bf16 base 2, fp16 D=192, fp8 out, padded V + ptwc.
CALIBRATION_CASES = ["specials_th", "base2_specials", "d192_fp16", "fp8_out", "padded_v_ptwc"]


def _all_patterns(np_dtype, uint):
    bits = np.arange(np.iinfo(uint).max + 1, dtype=uint)
    return bits.view(np_dtype)


def _rank_line(values: np.ndarray) -> np.ndarray:
    """Position of each non-NaN value among the distinct representable values (brute force by sorting)."""
    finite_or_inf = values[~np.isnan(values)]
    distinct = np.unique(finite_or_inf)  # -0.0 == 0.0: one point
    return np.searchsorted(distinct, values)


# ---------------------------------------------------------------------------------------------------
# ordered_bits / ULP distance / value classes


@pytest.mark.parametrize("tdtype,np_dtype,uint", NARROW)
def test_ordered_bits_matches_rank_of_every_pattern(tdtype, np_dtype, uint):
    x = _all_patterns(np_dtype, uint)
    with np.errstate(invalid="ignore"):
        values = x.astype(np.float64)
    ok = ~np.isnan(values)
    rank = _rank_line(values)
    ordered = compare.ordered_bits(bridge.to_torch(x)).numpy()
    zero_rank = np.searchsorted(np.unique(values[ok]), 0.0)
    # ULP distance between any two values = difference of ranks: the lines agree up to the origin.
    np.testing.assert_array_equal(ordered[ok], rank[ok] - zero_rank)


def test_ulp_distance_fp32_by_stepping():
    rng = np.random.default_rng(1)
    starts = rng.integers(0, 2**32, size=400, dtype=np.uint64).astype(np.uint32).view(np.float32)
    starts = starts[np.isfinite(starts) & (np.abs(starts) < 1e38)]
    starts = np.concatenate([starts, np.float32([0.0, -0.0, -1e-45, -3e-45, 1.0, -1.0])]).astype(np.float32)
    steps = rng.integers(0, 40, size=starts.size)
    ends = starts.copy()
    for i, k in enumerate(steps):
        for _ in range(k):
            ends[i] = np.nextafter(ends[i], np.float32(np.inf))
    # nextafter counts -0 -> +min_subnormal as a step but -0 and +0 are one point: skip starts at -0.
    keep = ~((starts == 0) & np.signbit(starts))
    got = compare.ulp_distance(torch.from_numpy(ends[keep]), torch.from_numpy(starts[keep])).numpy()
    np.testing.assert_array_equal(got, steps[keep])


def test_ulp_distance_landmarks():
    f = np.float32
    pairs = [(0.0, -0.0, 0), (f(1e-45), f(-1e-45), 2), (np.finfo(f).max, np.inf, 1), (1.0, 2.0, 2**23),
             (-np.inf, np.inf, 2 * 0x7F800000)]
    a = torch.tensor([p[0] for p in pairs], dtype=torch.float32)
    b = torch.tensor([p[1] for p in pairs], dtype=torch.float32)
    assert compare.ulp_distance(a, b).tolist() == [p[2] for p in pairs]


def test_ordered_bits_is_monotonic_on_sampled_fp32():
    rng = np.random.default_rng(2)
    x = rng.integers(0, 2**32, size=20000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = np.sort(x[~np.isnan(x)])
    ordered = compare.ordered_bits(torch.from_numpy(x)).numpy()
    step = np.diff(ordered)
    equal_values = np.diff(x.astype(np.float64)) == 0
    assert (step[~equal_values] > 0).all() and (step[equal_values] == 0).all()


@pytest.mark.parametrize("tdtype,np_dtype,uint", NARROW)
def test_value_class_of_every_pattern(tdtype, np_dtype, uint):
    x = _all_patterns(np_dtype, uint)
    with np.errstate(invalid="ignore"):
        v = x.astype(np.float64)
    want = np.where(np.isnan(v), compare.NAN,
                    np.where(np.isposinf(v), compare.POS_INF, np.where(np.isneginf(v), compare.NEG_INF,
                                                                       compare.FINITE)))
    np.testing.assert_array_equal(compare.value_class(bridge.to_torch(x)).numpy(), want)
    if tdtype == torch.float8_e4m3fn:
        assert not np.isin(want, (compare.POS_INF, compare.NEG_INF)).any()  # e4m3fn has no inf


def test_value_class_fp32_and_f64():
    vals = [1.0, -0.0, np.inf, -np.inf, np.nan, 3e-45]
    want = [compare.FINITE, compare.FINITE, compare.POS_INF, compare.NEG_INF, compare.NAN, compare.FINITE]
    for dt in (torch.float32, torch.float64):
        assert compare.value_class(torch.tensor(vals, dtype=dt)).tolist() == want
    nan_payload = torch.tensor([0x7FC00001, -0x00400000], dtype=torch.int32)  # 0x7fc00001, 0xffc00000
    assert compare.value_class(nan_payload.view(torch.float32)).tolist() == [compare.NAN, compare.NAN]


# ---------------------------------------------------------------------------------------------------
# compare_bits: counts, histogram, located messages


def _bf16_bits(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def test_failure_message_has_the_documented_shape():
    # One mismatch at request 2, head 1, token 5, dim 3: want 1.0 (0x3f80), got the next bf16 (0x3f81).
    qsl = np.array([0, 3, 3, 10, 12], dtype=np.int32)  # request 1 is empty; tokens 12..14 are padding
    want = torch.ones(15, 2, 4, dtype=torch.bfloat16)
    got = want.clone()
    got.view(torch.int16)[5, 1, 3] = 0x3F81
    with pytest.raises(AssertionError) as err:
        compare.assert_bitwise_equal(got, want, name="merge.out", query_start_loc=qsl, case="toy", seed=7,
                                     mode="compiled")
    lines = str(err.value).splitlines()
    assert lines[0] == "merge.out bf16 case=toy seed=7 mode=compiled: 1 / 120 differ, max 1 ulp, classes agree"
    assert lines[1] == "  req 2 head 1 token 5 dim 3: got 0x3f81 (1.0078) want 0x3f80 (1.0) ulp=1"


@pytest.mark.parametrize("layout", ["THD", "HT", "TH"])
def test_mismatch_located_through_offsets(layout):
    qsl = np.array([0, 4, 4, 4, 9, 20], dtype=np.int32)  # two empty requests in a row, then padding
    T, H, D = 23, 3, 5
    shape = {"THD": (T, H, D), "HT": (H, T), "TH": (T, H)}[layout]
    want = torch.randn(shape, dtype=torch.float32)
    got = want.clone()
    plants = {(11, 2, 4): "req 4 head 2 token 11", (4, 0, 0): "req 3 head 0 token 4",
              (21, 1, 2): "padding head 1 token 21", (0, 1, 1): "req 0 head 1 token 0"}
    for (t, h, d) in plants:
        idx = {"THD": (t, h, d), "HT": (h, t), "TH": (t, h)}[layout]
        got[idx] = -got[idx] - 1.0
    report = compare.compare_bits(got, want, name="x", query_start_loc=qsl, layout=layout)
    assert report.n_diff == len(plants) and not report.ok
    text = report.format()
    for (t, h, d), where in plants.items():
        expect = where + (f" dim {d}" if layout == "THD" else "") + ": got 0x"
        assert expect in text, (expect, text)


def test_layout_comes_from_the_case():
    case = cases.by_name("specials_th")  # lse_layout="TH"
    qsl, _ = cases.offsets(case)
    want = torch.zeros(case.num_tokens, case.num_heads, dtype=torch.float32)
    got = want.clone()
    got[qsl[3] + 2, 4] = 1.0
    with pytest.raises(AssertionError, match=f"req 3 head 4 token {qsl[3] + 2}:"):
        compare.assert_bitwise_equal(got, want, name="merge.lse", case=case, seed=0)


def test_histogram_counts_and_max_ulp():
    want = torch.full((64,), 1.5, dtype=torch.float32)
    got = want.clone()
    gbits = got.view(torch.int32)
    distances = [1, 2, 3, 5, 9, 17]
    for i, k in enumerate(distances):
        gbits[10 * i] += k if i % 2 else -k
    r = compare.compare_bits(got, want, name="x")
    assert r.n_diff == 6 and r.max_ulp == 17 and r.classes_agree
    assert r.ulp_hist == {"0": 58, "1": 1, "2": 1, "3-4": 1, "5-8": 1, "9-16": 1, ">16": 1}


def test_nan_payloads_and_signed_zeros_differ():
    want = torch.tensor([0x7FC00000, 0, 0x3F800000], dtype=torch.int32).view(torch.float32)
    got = torch.tensor([0x7FC00001, -(2**31), 0x3F800000], dtype=torch.int32).view(torch.float32)
    r = compare.compare_bits(got, want, name="x", layout="flat")
    assert r.n_diff == 2 and r.classes_agree and r.max_ulp == 0
    assert "ulp=n/a" in r.format() and "got 0x80000000 (-0.0) want 0x00000000 (0.0) ulp=0" in r.format()


def test_class_mismatch_is_reported():
    want = _bf16_bits([0x3F80, 0x3F80, 0xFF80])  # 1, 1, -inf
    got = _bf16_bits([0x3F80, 0x7FC0, 0xFF7F])  # 1, NaN, -max
    r = compare.compare_bits(got, want, name="x", layout="flat")
    assert r.n_class_mismatch == 2 and not r.classes_agree
    assert "2 class mismatches" in r.header()


def test_chunked_scan_keeps_global_positions(monkeypatch):
    monkeypatch.setattr(scan, "_CHUNK", 7)  # one row of H*D = 6 per chunk
    qsl = np.array([0, 5, 9, 40], dtype=np.int32)
    want = torch.randn(40, 2, 3, dtype=torch.float16)
    got = want.clone()
    plants = [(1, 0, 2), (7, 1, 1), (8, 0, 0), (33, 1, 2)]
    for i, p in enumerate(plants):
        got.view(torch.int16)[p] += 1 + i
    r = compare.compare_bits(got, want, name="x", query_start_loc=qsl)
    assert r.n_diff == 4 and r.max_ulp == 4
    expect = ["req 0 head 0 token 1 dim 2", "req 1 head 1 token 7 dim 1", "req 1 head 0 token 8 dim 0",
              "req 2 head 1 token 33 dim 2"]
    assert [m.split(":")[0] for m in r.first_mismatches] == expect


def test_worst_element_is_shown_past_the_first_ones():
    want = torch.zeros(100, dtype=torch.float32) + 1.0
    got = want.clone()
    got.view(torch.int32)[:10] += 1
    got.view(torch.int32)[90] += 1000
    r = compare.compare_bits(got, want, name="x", layout="flat", max_shown=3)
    assert len(r.first_mismatches) == 4 and r.first_mismatches[-1].startswith("worst: index (90,)")


def test_report_json_and_inputs_from_jax_and_numpy():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    r = compare.compare_bits(jnp.asarray(x), x, name="x")
    assert r.ok and r.n == 12
    assert json.loads(json.dumps(r.to_dict()))["ulp_hist"]["0"] == 12


def test_argument_errors():
    a = torch.zeros(3, 4, dtype=torch.float32)
    with pytest.raises(TypeError, match="dtypes differ"):
        compare.compare_bits(a, a.to(torch.float16), name="x")
    with pytest.raises(ValueError, match="shapes differ"):
        compare.compare_bits(a, torch.zeros(4, 3), name="x")
    with pytest.raises(ValueError, match="layout"):
        compare.compare_bits(a, a, name="x", layout="THD")
    with pytest.raises(TypeError, match="float dtype"):
        compare.compare_bits(a.to(torch.int32), a.to(torch.int32), name="x")
    with pytest.raises(ValueError, match="token mask"):
        compare.compare_to_reference(a, a.double(), exact=np.ones(5, dtype=bool))


@pytest.mark.parametrize("device", DEVICES)
def test_compare_runs_on_the_tensor_device(device):
    want = torch.randn(50, 4, 8, device=device).to(torch.bfloat16)
    got = want.clone()
    got.view(torch.int16)[3, 2, 1] += 2
    r = compare.compare_bits(got, want, name="x")
    assert r.n_diff == 1 and r.max_ulp == 2
    rr = compare.compare_to_reference(got, want.double(), name="x")
    assert rr.n_bits_diff == 1 and rr.max_ulp == 2


# ---------------------------------------------------------------------------------------------------
# compare_to_reference: classes, exact elements, tolerance


def _rounded(want64: np.ndarray, tdtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(want64).to(tdtype)


@pytest.mark.parametrize("tdtype,tol", OUT_DTYPES)
def test_rounded_reference_passes_and_k_ulps_fail(tdtype, tol):
    rng = np.random.default_rng(3)
    want = rng.standard_normal((33, 4, 16)) * (4.0 if tdtype == torch.float8_e4m3fn else 1.0)
    t, h, d = 20, 3, 7
    want[t, h, d] = 1.75
    got = _rounded(want, tdtype)
    report = compare.assert_matches_reference(got, want, name="out", tol=tol)
    assert report.max_err_ratio <= 1.0 and report.max_ulp == 0
    # k ULPs away from zero with k*u > 2*rtol: out of tolerance whatever the binade.
    fmt = compare._FORMATS[tdtype]
    k = int(2 * tol.rtol / fmt.unit_roundoff) + 2
    bad = got.clone()
    bad.view(fmt.int_dtype)[t, h, d] += k
    qsl = np.array([0, 10, 30, 33], dtype=np.int32)
    with pytest.raises(AssertionError, match=r"1 / 2,112 fail .*tolerance 1\)") as err:
        compare.assert_matches_reference(bad, want, name="out", tol=tol, query_start_loc=qsl)
    assert f"req 1 head {h} token {t} dim {d}: [tol]" in str(err.value)


def test_mag_widens_the_bound_for_cancellation():
    # a*wp + b*ws cancels to ~0: the error allowed scales with the terms, not with the tiny result.
    want = np.array([1e-6], dtype=np.float64)
    got = torch.tensor([1e-6 + 1e-7], dtype=torch.float32)
    assert not compare.compare_to_reference(got, want, layout="flat").ok
    assert compare.compare_to_reference(got, want, layout="flat", mag=np.array([1.0])).ok


def test_classes_must_agree_even_inside_tolerance():
    want = np.array([np.inf, -np.inf, np.nan, 1.0])
    assert compare.compare_to_reference(torch.tensor(want, dtype=torch.float32), want, layout="flat").ok
    got = torch.tensor([np.finfo(np.float32).max, -np.inf, 0.0, np.nan], dtype=torch.float32)
    r = compare.compare_to_reference(got, want, layout="flat")
    assert r.n_class_mismatch == 3 and r.n_diff == 3
    assert "[class]" in r.format() and "classes finite vs +inf" in r.format()


def test_exact_elements_compare_bits():
    want = np.array([[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]])
    got = torch.tensor(want, dtype=torch.float32)
    got[0, 0] = -0.0  # within any tolerance, but not a bit copy
    got.view(torch.int32)[1, 2] += 1
    assert compare.compare_to_reference(got, want, layout="flat", mag=np.full((2, 3), 1e6)).ok
    r = compare.compare_to_reference(got, want, layout="flat", exact=True)
    assert r.n_exact_mismatch == 2 and r.n_exact == 6
    # A token mask marks the pass-through rows only (layout TH: token axis 0).
    r = compare.compare_to_reference(got, want, layout="TH", exact=np.array([False, True]),
                                     mag=np.full((2, 3), 1e6))
    assert r.n_exact == 3 and r.n_exact_mismatch == 1 and "head 2 token 1: [exact]" in r.format()


def test_exact_nan_payloads_only_with_native_want():
    want32 = torch.tensor([0x7FC00000, 0x3F800000], dtype=torch.int32).view(torch.float32)
    got = torch.tensor([0x7FC00123, 0x3F800000], dtype=torch.int32).view(torch.float32)
    # float64 cannot carry the payload: NaN vs NaN agrees.
    assert compare.compare_to_reference(got, want32.double().numpy(), exact=True, layout="flat").ok
    # The native want (e.g. the mask reference's f32 LSE) keeps its bits: the payload must match.
    r = compare.compare_to_reference(got, want32.numpy(), exact=True, layout="flat")
    assert r.n_exact_mismatch == 1 and not r.ok


def test_tolerance_table():
    units = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8, "float8_e4m3fn": 2.0**-4}
    for key, u in units.items():
        tol = compare.TOLERANCES[key]
        assert u < tol.rtol < u + 2.0**-19  # one rounding + a bounded f32 compute error
        assert compare.tolerance_for(getattr(torch, key)) is tol
    assert compare.TOLERANCES["lse"].atol > 0
    with pytest.raises(TypeError):
        compare.tolerance_for(torch.int32)


# ---------------------------------------------------------------------------------------------------
# Calibration: a faithful f32 merge on XLA:CPU passes; a merge with bf16 weights fails


def _f32_merge(case, inp, weight_dtype=jnp.float32):
    """docs/spec.md 4 in f32 with jnp (XLA:CPU: FMA contraction, its own exp/log); fused mask; casts at the end."""
    D = case.head_dim
    f32 = jnp.float32
    a = jnp.asarray(inp["prefix_output"][..., :D]).astype(f32)
    b = jnp.asarray(inp["suffix_output"][..., :D]).astype(f32)
    p_raw, s_raw = (jnp.asarray(inp[k]) for k in ("prefix_lse", "suffix_lse"))
    if case.lse_layout == "HT":
        p_raw, s_raw = p_raw.T, s_raw.T  # [T, H]
    ln_base = f32(math.log(2.0)) if case.lse_base == 2 else f32(1.0)

    def normalise(x):
        return jnp.where(jnp.isposinf(x) | jnp.isnan(x), -jnp.inf, x * ln_base)

    p, s = normalise(p_raw), normalise(s_raw)
    empty = reference.empty_token_mask(inp["query_start_loc"], inp["cu_seq_lens"], case.num_tokens)
    p = jnp.where(jnp.asarray(empty)[:, None], -jnp.inf, p)
    m = jnp.maximum(p, s)
    both = m == -jnp.inf
    m0 = jnp.where(both, f32(0), m)
    pe, se = jnp.exp(p - m0), jnp.exp(s - m0)
    z = pe + se
    wp, ws = (pe / z).astype(weight_dtype).astype(f32), (se / z).astype(weight_dtype).astype(f32)
    out = jnp.where((wp > 0)[..., None], a * wp[..., None], 0.0) + jnp.where((ws > 0)[..., None],
                                                                              b * ws[..., None], 0.0)
    out = jnp.where(both[..., None], 0.0, out)
    lse = jnp.where(both, -jnp.inf, jnp.log(z) + m0) / ln_base
    n = case.prefill_tokens_with_context
    if n is not None:
        out, lse = out.at[n:].set(b[n:]), lse.at[n:].set(s_raw[n:])
    out_dtype = cases.DTYPES[case.out_dtype or case.dtype]
    if case.out_dtype is not None:
        out = jnp.clip(out / f32(inp["output_scale"][0]), -448.0, 448.0)
    lse = lse.T if case.lse_layout == "HT" else lse
    return out.astype(out_dtype), lse


def _check_merge(case, inp, out, lse):
    D = case.head_dim
    kw = dict(query_start_loc=inp["query_start_loc"], prefix_cu_seq_lens=inp["cu_seq_lens"],
              prefill_tokens_with_context=case.prefill_tokens_with_context, lse_layout=case.lse_layout,
              lse_base=case.lse_base)
    args = (inp["prefix_output"][..., :D], inp["prefix_lse"], inp["suffix_output"][..., :D], inp["suffix_lse"])
    want_out, want_lse = reference.merge_attn_states(*args, output_scale=inp.get("output_scale"), **kw)
    mag = expected.merge_out_magnitude(*args, output_scale=inp.get("output_scale"), **kw)
    exact = np.zeros(case.num_tokens, dtype=bool)
    if case.prefill_tokens_with_context is not None:
        exact[case.prefill_tokens_with_context:] = True  # docs/spec.md 4.4: bit copies
    out_exact = exact if case.out_dtype is None else False  # fp8 rows are scaled, not copied
    compare.assert_matches_reference(out, want_out, case=case, exact=out_exact, mag=mag, name="merge.out",
                                     seed=0, mode="jnp-f32")
    compare.assert_matches_reference(lse, want_lse, case=case, exact=exact, name="merge.lse", seed=0,
                                     mode="jnp-f32")


@pytest.mark.parametrize("name", CALIBRATION_CASES)
def test_faithful_f32_merge_is_within_tolerance(name):
    case = cases.by_name(name)
    inp = cases.make_inputs(case, seed=0)
    _check_merge(case, inp, *_f32_merge(case, inp))


@pytest.mark.parametrize("name", ["specials_th", "d192_fp16"])
def test_bf16_weights_are_caught(name):
    # Rounding the merge weights to bf16 is the kind of precision loss the tolerance must catch.
    case = cases.by_name(name)
    inp = cases.make_inputs(case, seed=0)
    with pytest.raises(AssertionError, match=r"(?s)merge\.out .* fail .*\[tol\]"):
        _check_merge(case, inp, *_f32_merge(case, inp, weight_dtype=jnp.bfloat16))


def test_merge_magnitude_bounds_the_reference():
    case = cases.by_name("base2_specials")
    inp = cases.make_inputs(case, seed=0)
    args = (inp["prefix_output"], inp["prefix_lse"], inp["suffix_output"], inp["suffix_lse"])
    kw = dict(lse_layout=case.lse_layout, lse_base=case.lse_base)
    want, _ = reference.merge_attn_states(*args, **kw)
    mag = expected.merge_out_magnitude(*args, **kw)
    ok = np.isfinite(want)
    assert ok.any() and (np.abs(want[ok]) <= mag[ok] * (1 + 1e-12)).all()


def test_lse_layout_picks_the_lse_tolerance():
    # lse = log(z) + m can land near 0 with an absolute f32 error of a few ULPs of |m|: the LSE entry's
    # atol accepts it, the plain fp32 output entry (relative only) would not.
    want = np.array([[1e-3, 5.0], [-2e-3, 7.0]])
    got = torch.tensor(want, dtype=torch.float32)
    got[0, 0] += 2.0**-22
    assert compare.compare_to_reference(got, want, layout="HT").ok
    assert compare.compare_to_reference(got, want).ok  # 2-D: an LSE by default
    assert not compare.compare_to_reference(got[None], want[None]).ok  # 3-D: an output
