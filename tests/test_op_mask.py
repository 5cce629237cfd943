"""mask_empty_context_lse (docs/spec.md 3) in every implementation, bit for bit against parity.harness.reference.

One test per behaviour, parametrised over `op_support.IMPLS` (Triton, Pallas, jnp, Mosaic GPU where jax has it);
what only one framework has (strides, overlaps and compile keys in Triton; jit, donation and re-tracing in JAX) is
in tests/test_triton_mask.py and tests/test_pallas_mask.py. Shapes are tiny: the Triton interpreter runs a grid's
programs one by one, and each new shape is a new Pallas interpret-mode compile.
"""

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from op_support import IMPLS, check_mask, gpu_only, numpy, public_mask, run, to_impl

import pallas_impl
import triton_impl
from parity.harness import cases, reference
from parity.library.compare import assert_bitwise_equal

CI_CASES = cases.select("ci")
MASK_BLOCK_T = 128  # the mask's token block (an empty request owning whole blocks takes the unmasked-store path)


def _tiny_lens(seed: int, num_requests: int, max_len: int = 3) -> tuple[int, ...]:
    """Request lengths in [0, max_len]: many zero-length requests, a short T for a large R."""
    rng = np.random.default_rng(seed)
    return tuple(int(x) for x in rng.integers(0, max_len + 1, size=num_requests))


def _every_other(num_requests: int, start: int = 0) -> tuple[int, ...]:
    return tuple(range(start, num_requests, 2))


# Hand-written edges, each named after what it exercises.
EDGE_CASES = [
    # R = 33: the ownership count crosses a 32-request chunk.
    cases.Case("r33_tiny", _tiny_lens(10, 33), _every_other(33, 1), num_heads=3, head_dim=32,
               dtype="float32", padding=4),
    # R = 65: three 32-request chunks, the last one partial.
    cases.Case("r65_tiny", _tiny_lens(11, 65), _every_other(65), num_heads=2, head_dim=16, padding=3),
    # Zero-length requests, empty and not, at the start, middle and end; a padding tail after the last
    # (zero-length) request, as serving stacks pad offsets to a static maximum.
    cases.Case("zero_len", (0, 0, 5, 0, 3, 0), (0, 2, 3, 5), num_heads=4, head_dim=32, padding=2),
    # Block edges shifted by one token: requests start at 1, 128, 256, 385 and end past them.
    cases.Case("block_edges_shifted", (1, 127, 128, 129, 256), (1, 2, 3, 4), num_heads=2, head_dim=16,
               dtype="float32"),
    # H not a power of two: 5 (one masked head tile) and 20 (two LSE head tiles of 16).
    cases.Case("h5", (40, 0, 130), (0, 1), num_heads=5, head_dim=64, dtype="float16", padding=9),
    cases.Case("h20_th", (17, 140, 5), (1, 2), num_heads=20, head_dim=24, lse_layout="TH", padding=6),
]
# R = 1100 requests of 0-3 tokens (and two of ~130): the two-level request search takes a second 1024-request
# coarse step. The Triton interpreter runs its ~1100 programs too slowly for CPU CI.
def _r1100_lens() -> tuple[int, ...]:
    lens = list(_tiny_lens(13, 1100))
    lens[3], lens[1030] = 130, 129
    return tuple(lens)


R1100 = cases.Case("r1100", _r1100_lens(), _every_other(1100, 1), num_heads=2, head_dim=16, padding=9)


def _mask_and_check(impl, case, *, with_output=True, seed=0, **options):
    arrays = cases.make_inputs(case, seed)
    if not with_output:
        arrays["prefix_output"] = None
    res = run(impl, "mask", case, arrays, **options)
    check_mask(impl, case, arrays, res, with_output=with_output)
    return arrays, res


# ---------------------------------------------------------------------------------------------------------
# Workloads


def test_ci_cases_cover_the_mask_edges():
    """The named workloads hold the edges the parametrised tests rely on (guards cases.py edits)."""
    lens = {n for c in CI_CASES for n in c.query_lens}
    assert {0, 127, 128, 129, 256} <= lens  # zero-length requests, 128-token block edges
    assert any(32 < c.num_requests < 1000 for c in CI_CASES)  # R = 33
    assert any(c.num_requests >= 1000 and max(c.query_lens) <= 8 for c in CI_CASES)  # R = 1000, tiny lengths
    assert any(c.padding > 0 for c in CI_CASES)  # NaN-poisoned padding tail
    assert any(c.head_pad > 0 for c in CI_CASES)  # a V-padded output buffer
    assert {c.lse_layout for c in CI_CASES} == {"HT", "TH"}
    assert {c.dtype for c in CI_CASES} >= {"float32", "float16", "bfloat16"}
    assert {c.head_dim for c in CI_CASES} >= {80, 512}
    assert any(c.num_heads & (c.num_heads - 1) for c in CI_CASES)  # H not a power of two
    # Both store paths of a whole empty block: 16-byte stores (aligned [H, T] rows) and masked stores.
    whole = [c for c in CI_CASES if c.lse_layout == "HT" and _has_whole_empty_block(c)]
    assert {c.num_tokens % 4 == 0 for c in whole} == {True, False}


def _has_whole_empty_block(case) -> bool:
    qsl, cu = cases.offsets(case)
    return any(cu[r + 1] == cu[r] and -(-qsl[r] // MASK_BLOCK_T) * MASK_BLOCK_T + MASK_BLOCK_T <= qsl[r + 1]
               for r in range(case.num_requests))


@pytest.mark.parametrize("case", CI_CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("impl", IMPLS)
def test_matches_reference(impl, case):
    """Every "ci" case with output zeroing, in the case's layout, V-padded buffers as views/slices: every bit."""
    _mask_and_check(impl, case)


@pytest.mark.parametrize("case", EDGE_CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("impl", IMPLS)
def test_edge_cases_match_reference(impl, case):
    _mask_and_check(impl, case)


@pytest.mark.parametrize("impl", gpu_only("triton"))
def test_more_than_1024_requests(impl):
    _mask_and_check(impl, R1100)


@pytest.mark.parametrize("impl", IMPLS)
def test_upstream_vector(impl):
    """vLLM's test: qsl=[0, 2, 133, 134], cu=[0, 4, 4, 7], H=4, T=134 -> lse[:, 2:133] = -inf, output rows +0.0,
    every other element kept (read off the spec, not the reference)."""
    rng = np.random.default_rng(0)
    qsl = np.array([0, 2, 133, 134], dtype=np.int32)
    cu = np.array([0, 4, 4, 7], dtype=np.int32)
    lse = rng.normal(4.0, 3.0, size=(4, 134)).astype(np.float32)
    output = rng.standard_normal((134, 4, 64), dtype=np.float32)
    t = to_impl(impl, dict(lse=lse, qsl=qsl, cu=cu, output=output))
    got_lse, got_out = (numpy(x) for x in public_mask(impl, t["lse"], t["qsl"], t["cu"], t["output"]))
    assert np.all(got_lse[:, 2:133] == -np.inf)
    keep = np.r_[0:2, 133:134]
    np.testing.assert_array_equal(got_lse[:, keep].view(np.uint32), lse[:, keep].view(np.uint32))
    assert np.all(got_out[2:133].view(np.uint32) == 0)  # +0.0
    np.testing.assert_array_equal(got_out[keep].view(np.uint32), output[keep].view(np.uint32))


@pytest.mark.parametrize("impl", IMPLS)
def test_lse_only_keeps_every_other_bit(impl):
    """Without `output` only the LSE changes; NaN padding (payload included) keeps its bits."""
    _mask_and_check(impl, cases.by_name("r33_ragged_pad"), with_output=False)


@pytest.mark.parametrize("impl", IMPLS)
def test_has_empty_true_is_the_plain_mask(impl):
    _mask_and_check(impl, cases.by_name("upstream_vector"), has_empty=True)


@pytest.mark.parametrize("num_tokens,qsl,cu", [
    (0, [0], [0]),  # R = 0, T = 0
    (5, [0], [0]),  # R = 0: every token is padding
    (0, [0, 0, 0], [0, 0, 3]),  # T = 0, two zero-length requests
], ids=["r0_t0", "r0_padding", "t0_r2"])
@pytest.mark.parametrize("impl", IMPLS)
def test_nothing_to_mask(impl, num_tokens, qsl, cu):
    """No request owns a token: every bit comes back, NaN payloads included (offsets validated too)."""
    lse = np.full((3, num_tokens), np.nan, np.float32)
    lse.view(np.uint32)[:] = 0x7FC0BEEF
    t = to_impl(impl, dict(lse=lse, qsl=np.array(qsl, np.int32), cu=np.array(cu, np.int32)))
    got = public_mask(impl, t["lse"], t["qsl"], t["cu"], validate=True)
    assert_bitwise_equal(got, lse, name="mask.lse", mode=impl)


# ---------------------------------------------------------------------------------------------------------
# Properties (Hypothesis, deterministic profile from conftest). Shapes stay in a few buckets (one Pallas
# compile each); offsets, emptiness, padding tails and values are drawn.


@dataclasses.dataclass(frozen=True)
class Bucket:
    num_tokens: int
    num_requests: int
    num_heads: int
    head_dim: int
    dtype: str
    lse_layout: str
    with_output: bool


BUCKETS = [
    # R = 40 crosses a 32-request scan boundary; H = 3 is not a power of two; LSE only.
    pytest.param(Bucket(260, 40, 3, 16, "bfloat16", "HT", False), id="HT"),
    # [T, H] LSE, H = 5, fp16 output zeroing at D = 12 (not a power of two).
    pytest.param(Bucket(160, 33, 5, 12, "float16", "TH", True), id="TH_out_fp16"),
]
FIXTURE_OK = settings(suppress_health_check=list(settings().suppress_health_check)
                      + [HealthCheck.function_scoped_fixture], max_examples=6)


@st.composite
def bucket_cases(draw, b: Bucket):
    """A Case of the bucket's static shape: zero-length requests, requests around the 128-token block, a NaN
    padding tail, random empty flags (requests pushed past T become zero-length, padded requests)."""
    lens = draw(st.lists(st.one_of(st.just(0), st.integers(1, 6), st.integers(120, 140)),
                         min_size=b.num_requests, max_size=b.num_requests))
    room = b.num_tokens - draw(st.integers(0, 48))
    capped = []
    for n in lens:
        n = min(n, room - sum(capped))
        capped.append(n)
    flags = draw(st.lists(st.booleans(), min_size=b.num_requests, max_size=b.num_requests))
    case = cases.Case("property", tuple(capped), tuple(r for r, f in enumerate(flags) if f),
                      num_heads=b.num_heads, head_dim=b.head_dim, dtype=b.dtype, lse_layout=b.lse_layout,
                      padding=b.num_tokens - sum(capped))
    return case, draw(st.integers(0, 2**16))


@pytest.mark.parametrize("bucket", BUCKETS)
@pytest.mark.parametrize("impl", IMPLS)
@FIXTURE_OK
@given(data=st.data())
def test_property_matches_reference_idempotent_and_guarded(impl, bucket, data):
    """Once: the reference's bits. Twice: the same bits (idempotent). has_empty=False: the inputs' bits."""
    case, seed = data.draw(bucket_cases(bucket))
    with_output = bucket.with_output
    arrays, once = _mask_and_check(impl, case, with_output=with_output, seed=seed)
    again = dict(arrays, prefix_lse=numpy(once["lse"]),
                 prefix_output=numpy(once["output"]) if with_output else None)
    twice = run(impl, "mask", case, again)
    assert_bitwise_equal(twice["lse"], once["lse"], name="mask.lse (twice)", case=case, mode=impl)
    if with_output:
        assert_bitwise_equal(twice["output"], once["output"], name="mask.output (twice)", case=case, mode=impl)
    same = run(impl, "mask", case, arrays, has_empty=False)
    assert_bitwise_equal(same["lse"], arrays["prefix_lse"], name="mask.lse (has_empty=False)", case=case, mode=impl)
    if with_output:
        assert_bitwise_equal(same["output"], arrays["prefix_output"], name="mask.output (has_empty=False)",
                             case=case, mode=impl)


# ---------------------------------------------------------------------------------------------------------
# has_empty_context (host data in both frameworks; each framework's own refusals are in its file)


@pytest.mark.parametrize("lens,want", [
    ([3, 0, 2], True), ([1, 2], False), ([], False),
    (np.array([4, 5, 0], np.int32), True), (np.array([4, 5], np.int64), False),
], ids=["list_empty", "list_full", "list_none", "numpy_empty", "numpy_full"])
@pytest.mark.parametrize("module", [triton_impl, pallas_impl], ids=["triton_impl", "pallas_impl"])
def test_has_empty_context(module, lens, want):
    got = module.has_empty_context(lens)
    assert type(got) is bool and got is want


@pytest.mark.parametrize("lens, error, match", [
    ("abc", TypeError, "sequence of integer lengths"), ([1.5, 2.0], TypeError, "integer lengths"),
    ([[1, 0]], TypeError, "one-dimensional"), ([-1, 2], ValueError, "must be >= 0; got -1 at index 0"),
    (np.array([3, -4]), ValueError, "got -4 at index 1"),
])
@pytest.mark.parametrize("module", [triton_impl, pallas_impl], ids=["triton_impl", "pallas_impl"])
def test_has_empty_context_refuses_what_is_not_lengths(module, lens, error, match):
    with pytest.raises(error, match=match):
        module.has_empty_context(lens)


# ---------------------------------------------------------------------------------------------------------
# Errors: the same bad arguments raise the same exception type, naming the argument, in every implementation.


def _valid():
    """Valid arguments (T=6, H=2, R=2)."""
    return dict(lse=np.zeros((2, 6), np.float32), query_start_loc=np.array([0, 2, 5], np.int32),
                cu_seq_lens=np.array([0, 0, 4], np.int32), output=np.zeros((6, 2, 8), np.float32))


I32 = np.int32
ERRORS = [
    ("lse_rank1", dict(lse=np.zeros(6, np.float32)), ValueError, "lse must have 2 dims"),
    ("lse_rank3", dict(lse=np.zeros((2, 6, 1), np.float32)), ValueError, "lse must have 2 dims"),
    ("lse_f16", dict(lse=np.zeros((2, 6), np.float16)), TypeError, "lse"),
    ("lse_f64", dict(lse=np.zeros((2, 6), np.float64)), TypeError, "lse"),
    ("qsl_int64", dict(query_start_loc=np.array([0, 2, 5], np.int64)), TypeError, "query_start_loc"),
    ("cu_int64", dict(cu_seq_lens=np.array([0, 0, 4], np.int64)), TypeError, "cu_seq_lens"),
    ("qsl_float", dict(query_start_loc=np.array([0, 2, 5], np.float32)), TypeError, "query_start_loc"),
    ("qsl_rank2", dict(query_start_loc=np.array([[0, 2, 5]], I32)), ValueError, "query_start_loc"),
    ("qsl_no_entries", dict(query_start_loc=np.zeros(0, I32), cu_seq_lens=np.zeros(0, I32)), ValueError, "R\\+1"),
    ("offset_lengths", dict(cu_seq_lens=np.array([0, 4], I32)), ValueError, "cu_seq_lens"),
    ("output_tokens", dict(output=np.zeros((7, 2, 8), np.float32)), ValueError, "output"),
    ("output_heads", dict(output=np.zeros((6, 3, 8), np.float32)), ValueError, "output"),
    ("output_rank2", dict(output=np.zeros((6, 2), np.float32)), ValueError, "output must have 3 dims"),
    ("output_int32", dict(output=np.zeros((6, 2, 8), I32)), TypeError, "output"),
    ("output_fp8", dict(output=np.zeros((6, 2, 8), cases.DTYPES["float8_e4m3fn"])), TypeError, "output"),
    ("bad_layout", dict(lse_layout="ht"), ValueError, "lse_layout"),
    # lse_layout="TH" reads lse as [T=2, H=6]: the [6, 2, 8] output no longer fits.
    ("th_with_ht_lse", dict(lse_layout="TH"), ValueError, "output"),
]


def _call(impl, **changes):
    kw = {**_valid(), **changes}
    arrays = to_impl(impl, {k: kw.pop(k) for k in ("lse", "query_start_loc", "cu_seq_lens", "output")})
    return public_mask(impl, arrays["lse"], arrays["query_start_loc"], arrays["cu_seq_lens"], arrays["output"], **kw)


@pytest.mark.parametrize("changes,error,match", [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
@pytest.mark.parametrize("impl", IMPLS)
def test_always_on_errors(impl, changes, error, match):
    with pytest.raises(error, match=match):
        _call(impl, **changes)


@pytest.mark.parametrize("impl", IMPLS)
def test_always_on_errors_precede_the_guard(impl):
    """The metadata checks run even when has_empty=False launches nothing."""
    with pytest.raises(TypeError, match="query_start_loc"):
        _call(impl, query_start_loc=np.array([0, 2, 5], np.int64), has_empty=False)


VALIDATE_ERRORS = [
    ("qsl_not_from_0", dict(query_start_loc=np.array([1, 2, 5], I32)), "query_start_loc\\[0\\] must be 0"),
    ("cu_not_from_0", dict(cu_seq_lens=np.array([2, 2, 4], I32)), "cu_seq_lens\\[0\\] must be 0"),
    ("qsl_decreasing", dict(query_start_loc=np.array([0, 3, 2], I32)), "query_start_loc must be non-decreasing"),
    ("cu_decreasing", dict(cu_seq_lens=np.array([0, 4, 1], I32)), "cu_seq_lens must be non-decreasing"),
    ("qsl_past_T", dict(query_start_loc=np.array([0, 2, 7], I32)), "past the token count"),
]


@pytest.mark.parametrize("changes,match", [e[1:] for e in VALIDATE_ERRORS], ids=[e[0] for e in VALIDATE_ERRORS])
@pytest.mark.parametrize("impl", IMPLS)
def test_validate_errors(impl, changes, match):
    _call(impl, **changes)  # the always-on tier does not read values: no error, no sync
    with pytest.raises(ValueError, match=match):
        _call(impl, validate=True, **changes)


@pytest.mark.parametrize("impl", IMPLS)
def test_validate_accepts_valid_offsets(impl):
    lse, out = (numpy(x) for x in _call(impl, validate=True))
    want_lse, want_out = reference.mask_empty_context_lse(*(_valid()[k] for k in ("lse", "query_start_loc",
                                                                                 "cu_seq_lens", "output")))
    assert_bitwise_equal(lse, want_lse, name="mask.lse", mode=impl)
    assert_bitwise_equal(out, want_out, name="mask.output", mode=impl)
