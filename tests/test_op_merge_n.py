"""merge_attn_states_n (docs/spec.md 8) in every implementation, against parity.harness.reference, and its properties.

Exact bits where the result is a copy or one partial alone has weight (`parity.harness.expected.exact_masks`);
elsewhere within `parity.library.compare.TOLERANCES` of the float64 reference. One test per behaviour, parametrised
over `op_support.IMPLS`; strided partials and compile keys (Triton) and jit re-tracing (JAX) are in
tests/test_triton_merge_n.py and tests/test_pallas_merge_n.py.
"""

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from op_support import IMPLS, RT, bits, check_merge, gpu_only, numpy, public_merge_n, run, to_impl

from parity.harness import cases, expected, impls, reference
from parity.library import compare
from parity.library.compare import assert_bitwise_equal

CI_N = cases.select("ci", kind="n_way")


def _inputs(case, seed=0):
    inp = cases.make_inputs_n(case, seed)
    inp["masked_lses"] = impls.masked_lses(case, inp)
    return inp


def _merge_and_check(impl, case, op="merge_n_fused", *, arrays=None, **options):
    arrays = _inputs(case) if arrays is None else arrays
    res = run(impl, op, case, arrays, **options)
    check_merge(impl, case, op, arrays, res)
    return arrays, res


# ---------------------------------------------------------------------------------------------------------
# Workloads


def test_ci_cases_cover_the_n_way_matrix():
    """The "ci" N-way cases hold what the matrix needs on CPU: N from 1 to 16, every dtype and fp8, both layouts,
    base 2, R > 32, strided partials, a padded V, pass-through rows, a wholly empty partial."""
    assert {c.partials for c in CI_N} >= {1, 2, 3, 4, 8, 16}
    assert {c.dtype for c in CI_N} == {"float32", "float16", "bfloat16"}
    assert any(c.out_dtype for c in CI_N) and any(c.lse_base == 2 for c in CI_N)
    assert {c.lse_layout for c in CI_N} == {"HT", "TH"}
    assert any(c.num_requests > 32 for c in CI_N) and any(c.strided and c.head_pad for c in CI_N)
    assert any(c.prefill_tokens_with_context is not None for c in CI_N)
    assert any((cases.partial_kv_lens(c) == 0).all(axis=1).any() for c in CI_N)
    assert any(_pass_through_without_last_kv(c) for c in CI_N)  # docs/spec.md 8.4: the copied LSE is -inf


def _pass_through_without_last_kv(case) -> bool:
    """Does a pass-through token belong to a request with no KV in the last partial?"""
    if case.prefill_tokens_with_context is None:
        return False
    qsl, _ = cases.offsets_n(case)
    no_last_kv = cases.partial_kv_lens(case)[-1] == 0
    return any(no_last_kv[r] and qsl[r + 1] > max(qsl[r], case.prefill_tokens_with_context)
               for r in range(case.num_requests))


@pytest.mark.parametrize("op", ["merge_n_fused", "merge_n"], ids=["fused", "masked_lses"])
@pytest.mark.parametrize("case", CI_N, ids=lambda c: c.name)
@pytest.mark.parametrize("impl", IMPLS)
def test_matches_reference(impl, case, op):
    """Every "ci" N-way case: raw partials with their offsets (the fused mask), and reference-masked LSEs."""
    arrays = _inputs(case)
    if op == "merge_n":
        arrays = dict(arrays, lses=arrays["masked_lses"])
    _merge_and_check(impl, case, op, arrays=arrays)


@pytest.mark.parametrize("ptwc", [0, 17, 57])
@pytest.mark.parametrize("impl", IMPLS)
def test_pass_through_rows_copy_the_last_partial(impl, ptwc):
    case = dataclasses.replace(cases.by_name("n1_bf16"), partials=3, context_lens=(5, 0, 9),
                               prefill_tokens_with_context=ptwc)
    arrays, res = _merge_and_check(impl, case)
    D = case.head_dim
    np.testing.assert_array_equal(bits(res["out"])[ptwc:], bits(arrays["outputs"][-1, ptwc:, :, :D]))
    np.testing.assert_array_equal(bits(res["lse"])[:, ptwc:], bits(arrays["lses"][-1][:, ptwc:]))


@pytest.mark.parametrize("impl", IMPLS)
def test_return_lse_false_gives_the_same_out(impl):
    case = cases.by_name("n2_fp32_d80_ptwc")
    arrays, with_lse = _merge_and_check(impl, case)
    without = run(impl, "merge_n_fused", case, arrays, return_lse=False)
    assert without["lse"] is None
    assert_bitwise_equal(without["out"], with_lse["out"], name="merge_n.out (return_lse=False)", case=case, mode=impl)


# XLA:CPU contracts FMAs differently per program: the jnp path and jax's Mosaic GPU interpreter (which runs on it)
@pytest.mark.parametrize("impl", gpu_only("jnp", "mosaic"))
def test_n2_gives_the_two_way_bits(impl):
    """docs/spec.md 8: at N = 2 every operation is the 2-way merge's. The 2-way fused mask covers the prefix only,
    so partial 1 goes in with its LSE masked (exactly) by the reference."""
    case = cases.by_name("n2_fp32_d80_ptwc")
    arrays = _inputs(case)
    n_way = run(impl, "merge_n_fused", case, arrays)
    D = case.head_dim
    two = dict(prefix_output=arrays["outputs"][0], prefix_lse=arrays["lses"][0], suffix_output=arrays["outputs"][1],
               suffix_lse=arrays["masked_lses"][1], query_start_loc=arrays["query_start_loc"],
               cu_seq_lens=arrays["cu_seq_lens"][0])
    two_way = run(impl, "merge_fused", dataclasses.replace(case, partials=0, head_dim=D), two)
    assert_bitwise_equal(n_way["out"], two_way["out"], name="merge_n.out (N=2) vs merge.out", case=case, mode=impl)
    assert_bitwise_equal(n_way["lse"], two_way["lse"], name="merge_n.lse (N=2) vs merge.lse", case=case, mode=impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_zero_tokens(impl):
    """T = 0: results of the right (empty) shapes and dtypes, and nothing raises."""
    t = to_impl(impl, dict(outputs=np.zeros((3, 0, 2, 8), np.float32), lses=np.zeros((3, 2, 0), np.float32)))
    out, lse = (numpy(x) for x in public_merge_n(impl, t["outputs"], t["lses"]))
    assert out.shape == (0, 2, 8) and out.dtype == np.float32
    assert lse.shape == (2, 0) and lse.dtype == np.float32


# ---------------------------------------------------------------------------------------------------------
# Properties (Hypothesis, deterministic profile from conftest)


def _partials(seed, n, T=23, H=3, D=32):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, T, H, D)).astype(np.float32),
            (rng.standard_normal((n, H, T)) * 3.0 + 2.0).astype(np.float32))


def _merge(impl, o, lse):
    t = to_impl(impl, dict(o=o, lse=lse))
    return tuple(numpy(x) for x in public_merge_n(impl, t["o"], t["lse"]))


def _bitwise(impl) -> bool:
    """Bit equality between two programs: the Triton interpreter, and anything compiled on the GPU. The JAX CPU
    paths contract FMAs differently in two programs (docs/spec.md 5): values to f32 rounding there."""
    return impl in ("triton", "torch") or RT.on_gpu


def _assert_close(got, want, mag, rounds, what):
    tol = compare.TOLERANCES["float32"]
    err = np.abs(got.astype(np.float64) - want.astype(np.float64))
    assert (err <= rounds * (tol.atol + tol.rtol * mag)).all(), f"{what}: max error {err.max()}"


FIXTURE_OK = settings(suppress_health_check=list(settings().suppress_health_check)
                      + [HealthCheck.function_scoped_fixture], max_examples=8)


@pytest.mark.parametrize("impl", IMPLS)
@FIXTURE_OK
@given(where=st.integers(0, 3), empty=st.sampled_from(["-inf", "+inf", "nan"]), seed=st.integers(0, 3))
def test_property_an_empty_partial_anywhere_changes_nothing(impl, where, empty, seed):
    """An all-empty partial (its output NaN garbage) added at any index of N = 3 partials leaves the merge of the
    others unchanged."""
    n = 3
    o, lse = _partials(seed, n)
    base = _merge(impl, o, lse)
    where = min(where, n)
    e_o = np.full_like(o[:1], np.nan)
    e_l = np.full_like(lse[:1], {"-inf": -np.inf, "+inf": np.inf, "nan": np.nan}[empty])
    got = _merge(impl, np.concatenate([o[:where], e_o, o[where:]]), np.concatenate([lse[:where], e_l, lse[where:]]))
    if _bitwise(impl):
        assert_bitwise_equal(got[0], base[0], name="merge_n.out with an empty partial", mode=impl)
        assert_bitwise_equal(got[1], base[1], name="merge_n.lse with an empty partial", mode=impl)
    else:
        mag = expected.merge_magnitude(o, reference.merge_weights_n(lse))
        _assert_close(got[0], base[0], mag, 2, "out")
        np.testing.assert_allclose(got[1], base[1], rtol=2**-20, atol=2**-20)


@pytest.mark.parametrize("impl", IMPLS)
@FIXTURE_OK
@given(seed=st.integers(0, 5))
def test_property_permuting_partials_stays_within_tolerance(impl, seed):
    n = 4
    o, lse = _partials(seed, n)
    base = _merge(impl, o, lse)
    perm = np.random.default_rng(seed).permutation(n)
    got = _merge(impl, o[perm], lse[perm])
    mag = expected.merge_magnitude(o, reference.merge_weights_n(lse))
    _assert_close(got[0], base[0], 2 * mag, 1, "permuted partials: out off by more than two roundings")
    lse_tol = compare.TOLERANCES["lse"]
    assert (np.abs(got[1].astype(np.float64) - base[1]) <= lse_tol.atol + lse_tol.rtol * 2 * np.abs(base[1])).all()


@pytest.mark.parametrize("impl", IMPLS)
@FIXTURE_OK
@given(seed=st.integers(0, 5))
def test_property_merge_is_associative_within_tolerance(impl, seed):
    """merge(a, b, c) vs merge(merge(a, b), c): the same value up to the intermediate's rounding."""
    o, lse = _partials(seed, 3)
    three = _merge(impl, o, lse)
    ab = _merge(impl, o[:2], lse[:2])
    chained = _merge(impl, np.stack([ab[0], o[2]]), np.stack([ab[1], lse[2]]))
    mag = expected.merge_magnitude(o, reference.merge_weights_n(lse))
    _assert_close(chained[0], three[0], 3 * mag, 1, "chained merge: out")
    lse_tol = compare.TOLERANCES["lse"]
    assert (np.abs(chained[1].astype(np.float64) - three[1])
            <= lse_tol.atol + lse_tol.rtol * 3 * np.abs(three[1])).all()


# ---------------------------------------------------------------------------------------------------------
# Errors: the same bad arguments raise the same exception type, naming the argument, in every implementation.


def _valid(N=3, T=6, H=2, D=8):
    return dict(outputs=np.zeros((N, T, H, D), cases.DTYPES["bfloat16"]), lses=np.zeros((N, H, T), np.float32))


_ARRAYS = ("outputs", "lses", "query_start_loc", "cu_seq_lens", "output_scale")
QSL = np.array([0, 2, 6], np.int32)
CU = np.array([[0, 0, 3], [0, 1, 2], [0, 0, 0]], np.int32)


def _call(impl, **changes):
    kw = {**_valid(), **changes}
    arrays = to_impl(impl, {k: kw.pop(k) for k in _ARRAYS if k in kw})
    return public_merge_n(impl, arrays.pop("outputs"), arrays.pop("lses"), **arrays, **kw)


BF16 = cases.DTYPES["bfloat16"]
ERRORS = [
    ("outputs_rank3", dict(outputs=np.zeros((6, 2, 8), BF16)), ValueError, "outputs must have 4 dims"),
    ("outputs_f64", dict(outputs=np.zeros((3, 6, 2, 8), np.float64)), TypeError, "outputs"),
    ("outputs_int", dict(outputs=np.zeros((3, 6, 2, 8), np.int32)), TypeError, "outputs"),
    ("lses_disagree_on_n", dict(lses=np.zeros((4, 2, 6), np.float32)), ValueError, "disagree on N"),
    ("lses_th_in_ht", dict(lses=np.zeros((3, 6, 2), np.float32)), ValueError, r"lses must be f32\[3, 2, 6\]"),
    ("lses_f16", dict(lses=np.zeros((3, 2, 6), np.float16)), TypeError, "lses"),
    ("only_qsl", dict(query_start_loc=QSL), ValueError, "go together"),
    ("only_cu", dict(cu_seq_lens=CU), ValueError, "go together"),
    ("cu_one_row", dict(query_start_loc=QSL, cu_seq_lens=CU[0]), ValueError, "cu_seq_lens must have 2 dims"),
    ("cu_wrong_n", dict(query_start_loc=QSL, cu_seq_lens=CU[:2]), ValueError, r"cu_seq_lens must be i32\[N, R\+1\]"),
    ("cu_wrong_r", dict(query_start_loc=QSL, cu_seq_lens=CU[:, :2]), ValueError,
     r"cu_seq_lens must be i32\[N, R\+1\]"),
    ("cu_int64", dict(query_start_loc=QSL, cu_seq_lens=CU.astype(np.int64)), TypeError, "cu_seq_lens"),
    ("fp8_without_scale", dict(out_dtype="float8_e4m3fn"), ValueError, "output_scale is required"),
    ("bad_layout", dict(lse_layout="ht"), ValueError, "lse_layout"),
    ("bad_base", dict(lse_base=10), ValueError, "lse_base"),
]


@pytest.mark.parametrize("changes,error,match", [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
@pytest.mark.parametrize("impl", IMPLS)
def test_input_errors(impl, changes, error, match):
    with pytest.raises(error, match=match):
        _call(impl, **changes)


VALIDATE_ERRORS = [
    ("ptwc_past_T", dict(prefill_tokens_with_context=7), "prefill_tokens_with_context"),
    ("cu_row_decreasing", dict(query_start_loc=QSL, cu_seq_lens=np.array([[0, 0, 3], [0, 2, 1], [0, 0, 0]], np.int32)),
     r"cu_seq_lens\[1\] must be non-decreasing"),
    ("cu_row_not_from_0", dict(query_start_loc=QSL, cu_seq_lens=np.array([[0, 0, 3], [1, 1, 2], [0, 0, 0]], np.int32)),
     r"cu_seq_lens\[1\]\[0\] must be 0"),
    ("qsl_past_T", dict(query_start_loc=np.array([0, 2, 9], np.int32), cu_seq_lens=CU), "past the token"),
]


@pytest.mark.parametrize("changes,match", [e[1:] for e in VALIDATE_ERRORS], ids=[e[0] for e in VALIDATE_ERRORS])
@pytest.mark.parametrize("impl", IMPLS)
def test_validate_errors(impl, changes, match):
    with pytest.raises(ValueError, match=match):
        _call(impl, validate=True, **changes)


@pytest.mark.parametrize("impl", IMPLS)
def test_validate_accepts_valid_inputs(impl):
    out, lse = _call(impl, validate=True, prefill_tokens_with_context=6, query_start_loc=QSL, cu_seq_lens=CU)
    want_out, want_lse = reference.merge_attn_states_n(*_valid().values(), prefill_tokens_with_context=6,
                                                       query_start_loc=QSL, cu_seq_lens=CU)
    np.testing.assert_array_equal(numpy(out).astype(np.float64), want_out)
    np.testing.assert_array_equal(numpy(lse), want_lse.astype(np.float32))


