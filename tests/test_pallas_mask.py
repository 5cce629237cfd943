"""pallas_impl.mask_empty_context_lse (docs/spec.md 3) against parity.harness.reference, bit for bit.

Every test takes the `mode` fixture: "interpret" runs everywhere, "compiled" (marked gpu) on the GPU, with
identical bodies. Interpret-mode compiles dominate the runtime, so the hand-written tests reuse a few
static shapes (`BUCKET_*`): new offset values never recompile, new shapes do.
"""

import dataclasses

import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jax
import jax.numpy as jnp

import pallas_impl
from mla_lse_common import tiles
from pallas_impl import mask as pallas_mask
from parity.library import compare
from parity.harness import cases, reference

CI_CASES = cases.select("ci")
NAN_BITS = np.uint32(0x7FC0BEEF)  # a NaN with a payload: poisoned elements must keep these exact bits


@dataclasses.dataclass(frozen=True)
class Bucket:
    """A static shape of the mask: tests drawing new offset values within one bucket share a compile."""

    num_tokens: int
    num_requests: int
    num_heads: int
    lse_layout: str
    out_dtype: str | None = None  # output zeroing when set
    head_dim: int = 0


# R = 40: the ownership scan crosses a 32-request boundary; H = 3 is not a power of two.
BUCKET_HT = Bucket(num_tokens=320, num_requests=40, num_heads=3, lse_layout="HT")
# R = 135: requests in five 32-wide chunks of the fine scan; [T, H] LSE with fp16 output zeroing at D = 80.
BUCKET_TH = Bucket(num_tokens=400, num_requests=135, num_heads=5, lse_layout="TH", out_dtype="float16",
                   head_dim=80)
BUCKETS = [pytest.param(BUCKET_HT, id="HT"), pytest.param(BUCKET_TH, id="TH_out_fp16")]

# Hypothesis runs the `mode` fixture (a plain string) once per test; the profile comes from conftest.
FIXTURE_OK = settings(suppress_health_check=list(settings().suppress_health_check)
                      + [HealthCheck.function_scoped_fixture])


def _mask(lse, query_start_loc, cu_seq_lens, output=None, *, mode, **kwargs):
    return pallas_impl.mask_empty_context_lse(lse, query_start_loc, cu_seq_lens, output,
                                              implementation="pallas", interpret=mode == "interpret", **kwargs)


def _poison_nan(x: np.ndarray, where) -> np.ndarray:
    """Writes NaN with the NAN_BITS payload (narrowed for 16-bit dtypes) into x[where], in place."""
    if x.dtype == np.float32:
        x.view(np.uint32)[where] = NAN_BITS
    else:
        x[where] = np.nan
    return x


def _bucket_inputs(bucket: Bucket, qsl: np.ndarray, seed: int):
    """Random f32 LSE in the bucket's layout (and output), NaN-poisoned at the padding tokens."""
    rng = np.random.default_rng(seed)
    T, H = bucket.num_tokens, bucket.num_heads
    pad = np.arange(T) >= qsl[-1]
    lse = _poison_nan(rng.normal(4.0, 3.0, size=(H, T)).astype(np.float32), (slice(None), pad))
    if bucket.lse_layout == "TH":
        lse = np.ascontiguousarray(lse.T)
    output = None
    if bucket.out_dtype is not None:
        output = rng.standard_normal((T, H, bucket.head_dim), dtype=np.float32).astype(cases.DTYPES[bucket.out_dtype])
        _poison_nan(output, pad)
    return lse, output


def _offsets(query_lens, empty, num_requests, num_tokens, seed=0):
    """(qsl, cu) i32[R+1]: the given requests, then zero-length requests up to R (a static maximum)."""
    rng = np.random.default_rng(seed)
    lens = np.zeros(num_requests, dtype=np.int64)
    lens[:len(query_lens)] = query_lens
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    if qsl[-1] > num_tokens:
        raise ValueError(f"{qsl[-1]=} > {num_tokens=}")
    kv = rng.integers(1, 9, size=num_requests)
    kv[list(empty)] = 0
    kv[len(query_lens):] = 0  # padded requests: no context either
    cu = np.concatenate([[0], np.cumsum(kv)]).astype(np.int32)
    return qsl, cu


def _check_against_reference(got, lse, qsl, cu, output, *, lse_layout, name, mode):
    want_lse, want_out = reference.mask_empty_context_lse(lse, qsl, cu, output, lse_layout=lse_layout)
    got_lse, got_out = got if output is not None else (got, None)
    compare.assert_bitwise_equal(got_lse, want_lse, name="mask.lse", layout=lse_layout, query_start_loc=qsl, case=name, mode=mode)
    if output is not None:
        compare.assert_bitwise_equal(got_out, want_out, name="mask.output", layout="THD", query_start_loc=qsl, case=name,
                     mode=mode)


# ---------------------------------------------------------------------------------------------------------
# Workloads: every "ci" case, with output zeroing, in the case's layout.


def test_ci_cases_cover_the_mask_edges():
    """The named workloads hold the edges the parametrised test below relies on (guards cases.py edits)."""
    lens = {n for c in CI_CASES for n in c.query_lens}
    assert {0, 127, 128, 129, 256} <= lens  # zero-length requests, 128-token block edges
    assert any(32 < c.num_requests < 1000 for c in CI_CASES)  # R = 33
    assert any(c.num_requests >= 1000 and max(c.query_lens) <= 8 for c in CI_CASES)  # R = 1000, tiny lengths
    assert any(c.padding > 0 for c in CI_CASES)  # NaN-poisoned padding tail
    assert {c.lse_layout for c in CI_CASES} == {"HT", "TH"}
    assert {c.dtype for c in CI_CASES} >= {"float32", "float16", "bfloat16"}
    assert {c.head_dim for c in CI_CASES} >= {80, 512}
    assert any(c.num_heads & (c.num_heads - 1) for c in CI_CASES)  # H not a power of two
    # Both store paths of a whole empty block: 16-byte stores (aligned [H, T] rows) and masked stores.
    whole = [c for c in CI_CASES if c.lse_layout == "HT" and _has_whole_empty_block(c)]
    assert {c.num_tokens % 4 == 0 for c in whole} == {True, False}


def _has_whole_empty_block(case) -> bool:
    qsl, cu = cases.offsets(case)
    block = tiles.MASK_BLOCK_T
    return any(cu[r + 1] == cu[r] and -(-qsl[r] // block) * block + block <= qsl[r + 1]
               for r in range(case.num_requests))


@pytest.mark.parametrize("case", CI_CASES, ids=lambda c: c.name)
def test_mask_matches_reference(case, mode):
    inp = cases.make_inputs(case)
    D = case.head_dim
    qsl, cu = inp["query_start_loc"], inp["cu_seq_lens"]
    output = np.ascontiguousarray(inp["prefix_output"][..., :D])
    # A V-padded buffer is sliced in JAX (arrays have no strides), as a caller would.
    got = _mask(jnp.asarray(inp["prefix_lse"]), jnp.asarray(qsl), jnp.asarray(cu),
                jnp.asarray(inp["prefix_output"])[..., :D], lse_layout=case.lse_layout, mode=mode)
    want_lse, want_out = reference.mask_empty_context_lse(inp["prefix_lse"], qsl, cu, output,
                                                          lse_layout=case.lse_layout)
    compare.assert_bitwise_equal(got[0], want_lse, name="mask.lse", case=case, mode=mode)
    compare.assert_bitwise_equal(got[1], want_out, name="mask.output", case=case, mode=mode)


@pytest.fixture
def small_splits(monkeypatch):
    """Caps the mask's programs per block at 3 (LSE-only; at most 3 head tiles) and 5 (zeroing), whatever the grid
    size: the round-robin deal of a block's tiles, with programs left without a tile of one kind."""
    monkeypatch.setattr(tiles, "MASK_TARGET_PROGRAMS", 1 << 30)
    monkeypatch.setattr(tiles, "MASK_LSE_SPLIT", 3)
    monkeypatch.setattr(tiles, "MASK_ZERO_SPLIT", 5)
    tiles.mask_split.cache_clear()
    pallas_mask._mask_jit.clear_cache()  # traces hold the grid
    yield
    tiles.mask_split.cache_clear()
    pallas_mask._mask_jit.clear_cache()


@pytest.mark.parametrize("zero_output", [False, True])
@pytest.mark.parametrize("lse_layout", ["HT", "TH"])
def test_block_split_over_programs(small_splits, lse_layout, zero_output, mode):
    # H = 40: three LSE head tiles of 16; D = 48 zeroed in 20 (2 heads x 64 dims) tiles.
    bucket = Bucket(num_tokens=404, num_requests=6, num_heads=40, lse_layout=lse_layout,
                    out_dtype="bfloat16" if zero_output else None, head_dim=48 if zero_output else 0)
    grid = tiles.mask_grid(bucket.num_tokens, bucket.num_requests, bucket.num_heads,
                           bucket.head_dim if zero_output else 1, zero_output)
    assert grid[1] == (5 if zero_output else 3)
    qsl, cu = _offsets((130, 7, 200, 0, 60), (0, 2, 3), bucket.num_requests, bucket.num_tokens)
    lse, output = _bucket_inputs(bucket, qsl, seed=3)
    got = _mask(jnp.asarray(lse), jnp.asarray(qsl), jnp.asarray(cu),
                None if output is None else jnp.asarray(output), lse_layout=lse_layout, mode=mode)
    _check_against_reference(got, lse, qsl, cu, output, lse_layout=lse_layout, name="h40_split", mode=mode)


def test_upstream_vector(mode):
    """vLLM's test: qsl=[0, 2, 133, 134], cu=[0, 4, 4, 7], H=4, T=134 -> lse[:, 2:133] = -inf, rest kept."""
    rng = np.random.default_rng(0)
    qsl = np.array([0, 2, 133, 134], dtype=np.int32)
    cu = np.array([0, 4, 4, 7], dtype=np.int32)
    lse = rng.normal(4.0, 3.0, size=(4, 134)).astype(np.float32)
    output = rng.standard_normal((134, 4, 64), dtype=np.float32)
    got = _mask(jnp.asarray(lse), jnp.asarray(qsl), jnp.asarray(cu), jnp.asarray(output), mode=mode)
    _check_against_reference(got, lse, qsl, cu, output, lse_layout="HT", name="upstream", mode=mode)
    got_lse, got_out = (np.asarray(x) for x in got)
    assert np.all(got_lse[:, 2:133] == -np.inf)
    keep = np.r_[0:2, 133:134]
    np.testing.assert_array_equal(got_lse[:, keep].view(np.uint32), lse[:, keep].view(np.uint32))
    assert np.all(got_out[2:133].view(np.uint32) == 0)  # +0.0
    np.testing.assert_array_equal(got_out[keep].view(np.uint32), output[keep].view(np.uint32))


def test_padded_requests_at_the_end(mode):
    """JAX serving stacks pad offsets to a static maximum: trailing zero-length requests, qsl[R] < T."""
    b = BUCKET_HT
    lens = [3, 0, 128, 0, 129, 1, 0, 5]  # zero-length requests in the middle too; 8..39 are padding
    qsl, cu = _offsets(lens, empty=(1, 2, 3, 6, 7), num_requests=b.num_requests, num_tokens=b.num_tokens)
    lse, _ = _bucket_inputs(b, qsl, seed=1)
    got = _mask(jnp.asarray(lse), jnp.asarray(qsl), jnp.asarray(cu), mode=mode)
    _check_against_reference(got, lse, qsl, cu, None, lse_layout="HT", name="padded_requests", mode=mode)
    got = np.asarray(got)
    assert qsl[-1] == 266 and np.all(qsl[8:] == 266)
    assert np.all(got[:, 3:131] == -np.inf)  # request 2 (128 tokens)
    np.testing.assert_array_equal(got[:, 266:].view(np.uint32), np.full((3, 320 - 266), NAN_BITS))


def test_more_than_1024_requests(mode):
    """R = 1100: the two-level request search crosses a 1024-request coarse step (r1000 stays below it)."""
    rng = np.random.default_rng(4)
    R = 1100
    lens = rng.integers(0, 3, size=R)
    lens[[3, 1030, 1099]] = (130, 129, 0)
    qsl, cu = _offsets(lens, empty=np.nonzero(rng.random(R) < 0.5)[0], num_requests=R, num_tokens=int(lens.sum()))
    T = int(qsl[-1]) + 9  # a padding tail
    lse = _poison_nan(rng.normal(4.0, 3.0, size=(2, T)).astype(np.float32), (slice(None), np.arange(T) >= qsl[-1]))
    output = rng.standard_normal((T, 2, 16), dtype=np.float32).astype(cases.DTYPES["bfloat16"])
    got = _mask(jnp.asarray(lse), jnp.asarray(qsl), jnp.asarray(cu), jnp.asarray(output), mode=mode)
    _check_against_reference(got, lse, qsl, cu, output, lse_layout="HT", name="r1100", mode=mode)


# ---------------------------------------------------------------------------------------------------------
# Guard, helper and validation


def test_has_empty_false_returns_the_inputs(mode):
    qsl, cu = _offsets([4, 4], empty=(0,), num_requests=2, num_tokens=8)
    lse = jnp.zeros((2, 8), jnp.float32)
    output = jnp.ones((8, 2, 16), jnp.bfloat16)
    assert _mask(lse, jnp.asarray(qsl), jnp.asarray(cu), has_empty=False, mode=mode) is lse
    got_lse, got_out = _mask(lse, jnp.asarray(qsl), jnp.asarray(cu), output, has_empty=False, mode=mode)
    assert got_lse is lse and got_out is output


def test_has_empty_context():
    assert pallas_impl.has_empty_context([3, 0, 5]) is True
    assert pallas_impl.has_empty_context([3, 1, 5]) is False
    assert pallas_impl.has_empty_context(np.array([2, 0], dtype=np.int32)) is True
    assert pallas_impl.has_empty_context(np.array([2, 7], dtype=np.int64)) is False
    assert pallas_impl.has_empty_context([]) is False
    with pytest.raises(ValueError, match="jax.Array"):
        pallas_impl.has_empty_context(jnp.array([1, 0], jnp.int32))


@pytest.mark.parametrize("qsl,cu,match", [
    pytest.param([1, 4, 8], [0, 1, 1], r"query_start_loc\[0\] must be 0", id="qsl_start"),
    pytest.param([0, 5, 4], [0, 1, 1], "query_start_loc must be non-decreasing", id="qsl_decreasing"),
    pytest.param([0, 4, 8], [0, 3, 2], "cu_seq_lens must be non-decreasing", id="cu_decreasing"),
    pytest.param([0, 4, 8], [2, 3, 4], r"cu_seq_lens\[0\] must be 0", id="cu_start"),
    pytest.param([0, 4, 9], [0, 1, 1], r"query_start_loc\[R\]=9 is past the token count T=8", id="qsl_past_T"),
])
def test_validate_rejects_bad_offsets(qsl, cu, match, mode):
    lse = jnp.zeros((2, 8), jnp.float32)
    with pytest.raises(ValueError, match=match):
        _mask(lse, jnp.array(qsl, jnp.int32), jnp.array(cu, jnp.int32), validate=True, mode=mode)


def test_validate_accepts_good_offsets(mode):
    b = BUCKET_HT
    qsl, cu = _offsets([7, 0, 200, 13], empty=(0, 1), num_requests=b.num_requests, num_tokens=b.num_tokens)
    lse, _ = _bucket_inputs(b, qsl, seed=2)
    got = _mask(jnp.asarray(lse), jnp.asarray(qsl), jnp.asarray(cu), validate=True, mode=mode)
    _check_against_reference(got, lse, qsl, cu, None, lse_layout="HT", name="validate", mode=mode)


def test_validate_under_jit_explains(mode):
    step = jax.jit(lambda lse, qsl, cu: _mask(lse, qsl, cu, validate=True, mode=mode))
    with pytest.raises(ValueError, match="cannot run under jax.jit"):
        step(jnp.zeros((2, 8), jnp.float32), jnp.array([0, 4, 8], jnp.int32), jnp.array([0, 0, 1], jnp.int32))


def _ok_args():
    return dict(lse=jnp.zeros((2, 8), jnp.float32), query_start_loc=jnp.array([0, 4, 8], jnp.int32),
                cu_seq_lens=jnp.array([0, 0, 3], jnp.int32), output=jnp.zeros((8, 2, 16), jnp.float16))


@pytest.mark.parametrize("change,error,match", [
    pytest.param(dict(lse=jnp.zeros((16,), jnp.float32)), ValueError, "lse must have 2 dims", id="lse_rank"),
    pytest.param(dict(lse=jnp.zeros((2, 8), jnp.float16)), TypeError, "lse must be float32", id="lse_f16"),
    pytest.param(dict(query_start_loc=jnp.array([0.0, 4.0, 8.0], jnp.float32)), TypeError,
                 "query_start_loc must be int32", id="qsl_float"),
    # jnp.asarray would narrow int64 to int32 (x64 off); a numpy int64 array reaches the check as is.
    pytest.param(dict(cu_seq_lens=np.array([0, 0, 3], np.int64)), TypeError, "cu_seq_lens must be int32",
                 id="cu_int64"),
    pytest.param(dict(cu_seq_lens=jnp.array([0, 3], jnp.int32)), ValueError, "must both be i32\\[R\\+1\\]",
                 id="offset_lengths"),
    pytest.param(dict(query_start_loc=jnp.zeros((3, 1), jnp.int32)), ValueError,
                 "query_start_loc must have 1 dims", id="qsl_rank"),
    pytest.param(dict(output=jnp.zeros((8, 3, 16), jnp.float16)), ValueError, r"output must be \[T=8, H=2, D\]",
                 id="output_shape"),
    pytest.param(dict(output=jnp.zeros((8, 2), jnp.float16)), ValueError, "output must have 3 dims",
                 id="output_rank"),
    pytest.param(dict(output=jnp.zeros((8, 2, 16), jnp.int32)), TypeError, "output must be", id="output_int"),
    pytest.param(dict(lse_layout="HD"), ValueError, "lse_layout must be one of", id="layout"),
])
def test_always_on_errors(change, error, match, mode):
    args = {**_ok_args(), **change}
    with pytest.raises(error, match=match):
        _mask(**args, mode=mode)


def test_always_on_errors_at_trace_time(mode):
    """Shapes and dtypes are checked while tracing: no device data is read."""
    step = jax.jit(lambda lse, qsl, cu: _mask(lse, qsl.astype(jnp.float32), cu, mode=mode))
    with pytest.raises(TypeError, match="query_start_loc must be int32"):
        step(jnp.zeros((2, 8), jnp.float32), jnp.array([0, 4, 8], jnp.int32), jnp.array([0, 0, 1], jnp.int32))
    step = jax.jit(lambda lse, qsl, cu: _mask(lse, qsl, cu[:2], mode=mode))
    with pytest.raises(ValueError, match="must both be"):
        step(jnp.zeros((2, 8), jnp.float32), jnp.array([0, 4, 8], jnp.int32), jnp.array([0, 0, 1], jnp.int32))


# ---------------------------------------------------------------------------------------------------------
# jit conventions: donation / in place, traced offsets, no recompilation


def test_lowering_declares_the_donated_aliases(mode):
    """Donating lse and output: the lowered module aliases each to its result (so the update is in place)."""
    qsl, cu = _offsets([5, 3], empty=(1,), num_requests=2, num_tokens=8)
    step = jax.jit(lambda lse, q, c, out: _mask(lse, q, c, out, mode=mode), donate_argnums=(0, 3))
    text = step.lower(jnp.zeros((2, 8), jnp.float32), jnp.asarray(qsl), jnp.asarray(cu),
                      jnp.zeros((8, 2, 16), jnp.bfloat16)).as_text()
    # The donated arguments carry an alias to a result (its index shifts when the module also returns a token:
    # the Mosaic GPU interpreter's callback is an ordered effect).
    aliased = re.findall(r"tensor<([0-9a-z]+)> \{[^}]*tf\.aliasing_output = \d+", text)
    assert "2x8xf32" in aliased and "8x2x16xbf16" in aliased, text[:2000]


def test_donated_lse_is_updated_in_place(mode):
    """The result reuses the donated buffer (XLA:CPU honours the donation in interpret mode too)."""
    b = BUCKET_HT
    qsl, cu = _offsets([40, 0, 130, 2], empty=(0, 2), num_requests=b.num_requests, num_tokens=b.num_tokens)
    lse_np, _ = _bucket_inputs(b, qsl, seed=3)
    step = jax.jit(lambda lse, q, c: _mask(lse, q, c, mode=mode), donate_argnums=0)
    lse = jnp.asarray(lse_np)
    pointer = lse.unsafe_buffer_pointer()
    got = step(lse, jnp.asarray(qsl), jnp.asarray(cu))
    assert got.unsafe_buffer_pointer() == pointer
    assert lse.is_deleted()
    _check_against_reference(got, lse_np, qsl, cu, None, lse_layout="HT", name="donated", mode=mode)


def _batches(bucket: Bucket, n: int):
    """n offset pairs of one static shape with different values (lengths, empty sets, padded requests)."""
    rng = np.random.default_rng(7)
    for i in range(n):
        real = bucket.num_requests - 3 * i
        lens = rng.integers(0, 5, size=real)
        lens[rng.integers(real)] = 130  # one request spans two 128-token blocks
        empty = tuple(int(r) for r in np.nonzero(rng.random(real) < 0.5)[0])
        yield _offsets(lens, empty, bucket.num_requests, bucket.num_tokens, seed=i)


def test_offsets_are_traced_and_never_recompile(mode):
    b = BUCKET_HT
    traces = []

    def step(lse, qsl, cu):
        traces.append(1)  # runs once per trace
        return _mask(lse, qsl, cu, mode=mode)

    jitted = jax.jit(step)
    for qsl, cu in _batches(b, 3):
        lse, _ = _bucket_inputs(b, qsl, seed=int(qsl[-1]))
        got = jitted(jnp.asarray(lse), jnp.asarray(qsl), jnp.asarray(cu))
        _check_against_reference(got, lse, qsl, cu, None, lse_layout="HT", name="jit", mode=mode)
    assert len(traces) == 1
    assert jitted._cache_size() == 1

    # Called directly, the wrapper's own jit cache gains at most the one entry of this shape.
    sizes = []
    for qsl, cu in _batches(b, 3):
        lse, _ = _bucket_inputs(b, qsl, seed=1)
        _check_against_reference(_mask(jnp.asarray(lse), jnp.asarray(qsl), jnp.asarray(cu), mode=mode),
                                 lse, qsl, cu, None, lse_layout="HT", name="direct", mode=mode)
        sizes.append(pallas_mask._mask_jit._cache_size())
    assert sizes[0] == sizes[-1], sizes


# ---------------------------------------------------------------------------------------------------------
# Properties (Hypothesis): ragged lengths with zeros, a padding tail, padded requests, H not a power of two,
# R across 32-request boundaries. Values vary freely; shapes stay in the buckets.


@st.composite
def ragged_offsets(draw, num_requests: int, num_tokens: int):
    lens = draw(st.lists(st.one_of(st.just(0), st.integers(1, 6), st.integers(120, 140), st.integers(250, 260)),
                         min_size=num_requests, max_size=num_requests))
    pad = draw(st.integers(0, 48))  # tokens past qsl[R]; requests pushed past T - pad become padded (0-length)
    qsl = np.minimum(np.concatenate([[0], np.cumsum(lens)]), num_tokens - pad).astype(np.int32)
    empty = draw(st.lists(st.booleans(), min_size=num_requests, max_size=num_requests))
    kv = draw(st.lists(st.integers(1, 70), min_size=num_requests, max_size=num_requests))
    cu = np.concatenate([[0], np.cumsum(np.where(empty, 0, kv))]).astype(np.int32)
    return qsl, cu, draw(st.integers(0, 2**16))


@pytest.mark.parametrize("bucket", BUCKETS)
@FIXTURE_OK
@given(data=st.data())
def test_property_matches_reference_and_is_idempotent(bucket, mode, data):
    qsl, cu, seed = data.draw(ragged_offsets(bucket.num_requests, bucket.num_tokens))
    lse, output = _bucket_inputs(bucket, qsl, seed)
    args = (jnp.asarray(qsl), jnp.asarray(cu))
    kwargs = dict(lse_layout=bucket.lse_layout, mode=mode)
    if output is None:
        once = _mask(jnp.asarray(lse), *args, **kwargs)
        twice = _mask(once, *args, **kwargs)
    else:
        once = _mask(jnp.asarray(lse), *args, jnp.asarray(output), **kwargs)
        twice = _mask(once[0], *args, once[1], **kwargs)
    _check_against_reference(once, lse, qsl, cu, output, lse_layout=bucket.lse_layout, name="property",
                             mode=mode)
    for a, b in zip(jax.tree.leaves(twice), jax.tree.leaves(once)):
        compare.assert_bitwise_equal(a, b, name="mask idempotent", query_start_loc=qsl, mode=mode,
                     layout=bucket.lse_layout if a.ndim == 2 else "THD")
    same = _mask(jnp.asarray(lse), *args, has_empty=False, **kwargs)
    compare.assert_bitwise_equal(same, lse, name="has_empty=False", layout=bucket.lse_layout, mode=mode)
