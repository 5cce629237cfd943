"""pallas_impl.merge_attn_states (docs/spec.md 4) against parity.harness.reference.

Float outputs are compared within `compare.TOLERANCES` (docs/spec.md 5: interpreters are not bitwise on CPU);
the rows docs/spec.md defines exactly (pass-through copies, both-empty rows, +inf/NaN read as empty) are checked bit
for bit. Every test takes the `mode` fixture: "interpret" everywhere, "compiled" (marked gpu) on the GPU,
identical bodies. Interpret-mode compiles dominate the runtime: the hand-written tests reuse the shapes
of a few "ci" cases, and new values (offsets, prefill_tokens_with_context) never recompile.
"""

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jax
import jax.numpy as jnp

import pallas_impl
from pallas_impl import merge as pallas_merge
from parity.harness import expected
from parity.library import compare
from parity.harness import cases, reference

CI_CASES = cases.select("ci")
SPECIALS_CASES = [c for c in CI_CASES if c.specials]
# R = 33 (the fused mask's scan crosses 32), zero-length requests, a NaN padding tail, fp16, D = 80.
R33 = cases.by_name("r33_ragged_pad")
# prefill_tokens_with_context, a V-padded buffer, padding, bf16.
PTWC = cases.by_name("padded_v_ptwc")

FIXTURE_OK = settings(suppress_health_check=list(settings().suppress_health_check)
                      + [HealthCheck.function_scoped_fixture])


def _merge(*args, mode, **kwargs):
    return pallas_impl.merge_attn_states(*args, implementation="pallas", interpret=mode == "interpret", **kwargs)


def _as_th(lse: np.ndarray, lse_layout: str) -> np.ndarray:
    return lse.T if lse_layout == "HT" else lse


def _full_options(case, inp, *, fused=True):
    """Every option the case exercises: fused mask, prefill_tokens_with_context, fp8, base, layout."""
    opts = dict(prefill_tokens_with_context=case.prefill_tokens_with_context, lse_layout=case.lse_layout,
                lse_base=case.lse_base)
    if fused:
        opts.update(query_start_loc=inp["query_start_loc"], prefix_cu_seq_lens=inp["cu_seq_lens"])
    if case.out_dtype is not None:
        opts.update(output_scale=inp["output_scale"])
    return opts


def _run(case, inp, mode, **opts):
    """The Pallas merge on a case's inputs; a V-padded buffer is sliced in JAX (arrays have no strides)."""
    D = case.head_dim
    j = {k: (None if v is None else jnp.asarray(v)) for k, v in opts.items()
         if k in ("query_start_loc", "prefix_cu_seq_lens", "output_scale")}
    rest = {k: v for k, v in opts.items() if k not in j}
    if case.out_dtype is not None and "output_scale" in opts:
        rest["out_dtype"] = cases.DTYPES[case.out_dtype]
    return _merge(jnp.asarray(inp["prefix_output"])[..., :D], jnp.asarray(inp["prefix_lse"]),
                  jnp.asarray(inp["suffix_output"])[..., :D], jnp.asarray(inp["suffix_lse"]), mode=mode, **j, **rest)


def _check(got_out, got_lse, inp, opts, *, head_dim, case, mode, fp8=False):
    """Reference comparison: classes, exact rows bit for bit, the rest within tolerance."""
    a, b = inp["prefix_output"][..., :head_dim], inp["suffix_output"][..., :head_dim]
    args = (a, inp["prefix_lse"], b, inp["suffix_lse"])
    want_out, want_lse = reference.merge_attn_states(*args, **opts)
    mag = expected.merge_out_magnitude(*args, **opts)
    T, lse_layout = a.shape[0], opts.get("lse_layout", "HT")
    ptwc = opts.get("prefill_tokens_with_context")
    passthrough = np.arange(T) >= (T if ptwc is None else int(ptwc))
    # docs/spec.md 4.2: both-empty rows are exactly 0; docs/spec.md 4.4: pass-through rows are bit copies (not across fp8).
    both_empty = np.isneginf(_as_th(want_lse, lse_layout)) & ~passthrough[:, None]
    exact = np.broadcast_to((both_empty | (passthrough[:, None] & (not fp8)))[..., None], want_out.shape)
    qsl = opts.get("query_start_loc", inp["query_start_loc"])
    compare.assert_matches_reference(got_out, want_out, exact=exact, mag=mag, name="merge.out", case=case,
                                     mode=mode, query_start_loc=qsl)
    if got_lse is not None:
        compare.assert_matches_reference(got_lse, want_lse, exact=passthrough, name="merge.lse", case=case,
                                         mode=mode, query_start_loc=qsl, layout=lse_layout)
    return want_out, want_lse


# ---------------------------------------------------------------------------------------------------------
# Workloads


def test_ci_cases_cover_the_merge_matrix():
    """The "ci" cases hold every head size, dtype and option the parametrised tests rely on."""
    assert {c.head_dim for c in CI_CASES} >= {64, 80, 96, 128, 192, 256, 512}
    assert {c.dtype for c in CI_CASES} >= {"float32", "float16", "bfloat16"}
    assert {c.lse_layout for c in CI_CASES} == {"HT", "TH"}
    assert any(c.lse_base == 2 for c in CI_CASES)
    assert any(c.out_dtype == "float8_e4m3fn" for c in CI_CASES)
    assert any(c.head_pad and c.prefill_tokens_with_context is not None for c in CI_CASES)
    assert any(c.specials and c.lse_layout == "TH" for c in CI_CASES)
    assert any(c.num_heads & (c.num_heads - 1) for c in CI_CASES)


@pytest.mark.parametrize("case", CI_CASES, ids=lambda c: c.name)
def test_merge_matches_reference(case, mode):
    inp = cases.make_inputs(case)
    opts = _full_options(case, inp)
    out, lse = _run(case, inp, mode, **opts)
    assert out.dtype == cases.DTYPES[case.out_dtype or case.dtype] and lse.dtype == jnp.float32
    _check(out, lse, inp, opts, head_dim=case.head_dim, case=case, mode=mode, fp8=case.out_dtype is not None)


@pytest.mark.parametrize("case", SPECIALS_CASES, ids=lambda c: c.name)
def test_specials_are_exact(case, mode):
    """docs/spec.md 4.1-4.3 from the inputs: +inf/NaN/-inf (and a masked request) are empty; both empty -> out +0 and
    lse -inf; one side empty -> the other side's row bit for bit; NaN garbage never reaches a merged row."""
    inp = cases.make_inputs(case)
    opts = _full_options(case, inp)
    out, lse = (np.asarray(x) for x in _run(case, inp, mode, **opts))
    T, D = case.num_tokens, case.head_dim
    p, s = _as_th(inp["prefix_lse"], case.lse_layout), _as_th(inp["suffix_lse"], case.lse_layout)
    masked = reference.empty_token_mask(inp["query_start_loc"], inp["cu_seq_lens"], T)
    p_empty = np.isinf(p) | np.isnan(p) | masked[:, None]
    s_empty = np.isinf(s) | np.isnan(s)
    ptwc = T if case.prefill_tokens_with_context is None else case.prefill_tokens_with_context
    merged = (np.arange(T) < ptwc)[:, None]  # not a pass-through row
    out_lse = _as_th(lse, case.lse_layout)
    both = p_empty & s_empty & merged
    assert both.any() and (p_empty & ~s_empty & merged).any()  # the case exercises both rules
    assert np.all(out.view(f"u{out.dtype.itemsize}")[both] == 0)
    assert np.all(np.isneginf(out_lse[both]))
    assert not np.isnan(out[np.broadcast_to(merged[..., None], out.shape)].astype(np.float32)).any()
    assert not np.isnan(out_lse[np.broadcast_to(merged, out_lse.shape)]).any()
    if case.out_dtype is None:
        a, b = inp["prefix_output"][..., :D], inp["suffix_output"][..., :D]
        only_s, only_p = p_empty & ~s_empty & merged, ~p_empty & s_empty & merged
        bits = lambda x: x.view(f"u{x.dtype.itemsize}")  # noqa: E731
        np.testing.assert_array_equal(bits(out)[only_s], bits(np.ascontiguousarray(b))[only_s])
        np.testing.assert_array_equal(bits(out)[only_p], bits(np.ascontiguousarray(a))[only_p])
        if case.lse_base == math.e:  # log(1) + m == m exactly; base 2 rounds through ln2 and log2(e)
            np.testing.assert_array_equal(out_lse[only_s], s[only_s])


def test_fused_mask_more_than_1024_requests(mode):
    """R = 1100: the fused mask's two-level request search crosses a 1024-request coarse step."""
    rng = np.random.default_rng(4)
    R, H, D = 1100, 2, 16
    lens = rng.integers(0, 3, size=R)
    lens[[3, 1030]] = (130, 129)
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    cu = np.concatenate([[0], np.cumsum(np.where(rng.random(R) < 0.5, 0, 4))]).astype(np.int32)
    T = int(qsl[-1]) + 9  # a padding tail

    def partial():
        x = rng.standard_normal((T, H, D), dtype=np.float32)
        lse = rng.normal(4.0, 3.0, size=(H, T)).astype(np.float32)
        x[qsl[-1]:], lse[:, qsl[-1]:] = np.nan, np.nan
        return x, lse

    (a, p), (b, s) = partial(), partial()
    empty = reference.empty_token_mask(qsl, cu, T)
    a[empty], p[:, empty] = np.nan, 3.0  # garbage a backend can leave in an empty chunk
    out, lse = _merge(jnp.asarray(a), jnp.asarray(p), jnp.asarray(b), jnp.asarray(s),
                      query_start_loc=jnp.asarray(qsl), prefix_cu_seq_lens=jnp.asarray(cu), mode=mode)
    inp = dict(prefix_output=a, prefix_lse=p, suffix_output=b, suffix_lse=s, query_start_loc=qsl)
    _check(out, lse, inp, dict(query_start_loc=qsl, prefix_cu_seq_lens=cu), head_dim=D, case="r1100", mode=mode)


def test_passthrough_rows_are_bit_copies(mode):
    """docs/spec.md 4.4: tokens at or past prefill_tokens_with_context copy the suffix row and raw LSE bits."""
    inp = cases.make_inputs(PTWC)
    out, lse = _run(PTWC, inp, mode, **_full_options(PTWC, inp))
    n, D = PTWC.prefill_tokens_with_context, PTWC.head_dim
    compare.assert_bitwise_equal(np.asarray(out)[n:], np.ascontiguousarray(inp["suffix_output"][n:, :, :D]), name="out copy")
    compare.assert_bitwise_equal(np.asarray(lse)[:, n:], inp["suffix_lse"][:, n:], name="lse copy")


def test_return_lse_false(mode):
    inp = cases.make_inputs(PTWC)
    opts = _full_options(PTWC, inp)
    out_only = _run(PTWC, inp, mode, return_lse=False, **opts)
    assert isinstance(out_only, jax.Array)
    out, _ = _run(PTWC, inp, mode, **opts)
    compare.assert_bitwise_equal(out_only, out, name="return_lse=False", case=PTWC, mode=mode)


def test_mask_then_merge_equals_fused(mode):
    """Masking the prefix first and merging gives the fused result bit for bit (docs/spec.md 4.5)."""
    inp = cases.make_inputs(R33)
    D = R33.head_dim
    fused_out, fused_lse = _run(R33, inp, mode, **_full_options(R33, inp))
    lse, prefix_out = pallas_impl.mask_empty_context_lse(
        jnp.asarray(inp["prefix_lse"]), jnp.asarray(inp["query_start_loc"]), jnp.asarray(inp["cu_seq_lens"]),
        jnp.asarray(inp["prefix_output"])[..., :D], implementation="pallas", interpret=mode == "interpret")
    out, lse = _merge(prefix_out, lse, jnp.asarray(inp["suffix_output"])[..., :D], jnp.asarray(inp["suffix_lse"]),
                      mode=mode)
    compare.assert_bitwise_equal(out, fused_out, name="merge.out", case=R33, mode=mode)
    compare.assert_bitwise_equal(lse, fused_lse, name="merge.lse", case=R33, mode=mode)


def _empty_lse(rng, shape):
    """An LSE that is empty everywhere, in all three spellings (-inf, FA2's +inf, NaN)."""
    return rng.choice(np.array([-np.inf, np.inf, np.nan], dtype=np.float32), size=shape)


def test_all_empty_prefix_returns_the_suffix(mode):
    rng = np.random.default_rng(5)
    inp = cases.make_inputs(R33)
    D, n_real = R33.head_dim, int(inp["query_start_loc"][-1])
    b = np.ascontiguousarray(inp["suffix_output"][..., :D])
    prefix_out = np.full_like(b, np.nan)  # garbage: must never leak
    # Pass-through from qsl[R] on: the padding rows are suffix copies too, so every row is the suffix's.
    out, lse = _merge(jnp.asarray(prefix_out), jnp.asarray(_empty_lse(rng, inp["prefix_lse"].shape)),
                      jnp.asarray(b), jnp.asarray(inp["suffix_lse"]), prefill_tokens_with_context=jnp.int32(n_real),
                      mode=mode)
    compare.assert_bitwise_equal(out, b, name="merge.out", case=R33, mode=mode)
    compare.assert_bitwise_equal(lse, inp["suffix_lse"], name="merge.lse", case=R33, mode=mode)


def test_all_empty_suffix_returns_the_prefix(mode):
    rng = np.random.default_rng(6)
    inp = cases.make_inputs(R33)
    D, n_real = R33.head_dim, int(inp["query_start_loc"][-1])
    a = np.ascontiguousarray(inp["prefix_output"][..., :D])
    a[:n_real][np.isnan(a[:n_real])] = 1.5  # clean (not fused: the garbage rows would be merged as data)
    suffix_out = np.full_like(a, np.nan)
    out, lse = _merge(jnp.asarray(a), jnp.asarray(inp["prefix_lse"]), jnp.asarray(suffix_out),
                      jnp.asarray(_empty_lse(rng, inp["suffix_lse"].shape)), mode=mode)
    compare.assert_bitwise_equal(np.asarray(out)[:n_real], a[:n_real], name="merge.out", case=R33, mode=mode)
    compare.assert_bitwise_equal(np.asarray(lse)[:, :n_real], inp["prefix_lse"][:, :n_real], name="merge.lse", case=R33,
                 mode=mode)
    # Padding rows are empty on both sides (NaN LSE): exactly 0 and -inf.
    assert np.all(np.asarray(out)[n_real:].view(np.uint16) == 0)
    assert np.all(np.isneginf(np.asarray(lse)[:, n_real:]))


# ---------------------------------------------------------------------------------------------------------
# jit conventions: prefill_tokens_with_context and offsets are traced; new values never recompile


def _variants(case, inp):
    """(prefill_tokens_with_context, qsl, cu) triples: new values, the case's shapes."""
    T, R = case.num_tokens, case.num_requests
    rng = np.random.default_rng(11)
    qsl, cu = inp["query_start_loc"], inp["cu_seq_lens"]
    lens = rng.integers(0, T // R + 1, size=R)
    lens[-1] = 0  # a padded request
    qsl2 = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    cu2 = np.concatenate([[0], np.cumsum(np.where(rng.random(R) < 0.5, 0, 3))]).astype(np.int32)
    return [(0, qsl, cu), (T // 2, qsl2, cu2), (T, qsl2, cu), (int(qsl2[-1]), qsl, cu2)]


def test_traced_values_never_recompile(mode):
    case = PTWC
    inp = cases.make_inputs(case)
    D = case.head_dim
    traces = []

    def step(a, p, b, s, ptwc, qsl, cu):
        traces.append(1)  # runs once per trace
        return _merge(a, p, b, s, prefill_tokens_with_context=ptwc, query_start_loc=qsl, prefix_cu_seq_lens=cu,
                      mode=mode)

    jitted = jax.jit(step)
    arrays = [jnp.asarray(inp[k]) for k in ("prefix_output", "prefix_lse", "suffix_output", "suffix_lse")]
    arrays[0], arrays[2] = arrays[0][..., :D], arrays[2][..., :D]
    variants = _variants(case, inp)
    for ptwc, qsl, cu in variants:
        out, lse = jitted(*arrays, jnp.int32(ptwc), jnp.asarray(qsl), jnp.asarray(cu))
        opts = dict(prefill_tokens_with_context=ptwc, query_start_loc=qsl, prefix_cu_seq_lens=cu)
        _check(out, lse, inp, opts, head_dim=D, case=case, mode=mode)
    assert len(traces) == 1
    assert jitted._cache_size() == 1

    # Called directly (Python ints too), the wrapper's jit cache gains at most this shape's one entry.
    sizes = []
    for ptwc, qsl, cu in variants:
        _merge(*arrays, prefill_tokens_with_context=ptwc, query_start_loc=jnp.asarray(qsl),
               prefix_cu_seq_lens=jnp.asarray(cu), mode=mode)
        sizes.append(pallas_merge._merge_jit._cache_size())
    assert sizes[0] == sizes[-1], sizes


# ---------------------------------------------------------------------------------------------------------
# Errors (always on; no device data read)


def _ok_args():
    return dict(prefix_output=jnp.zeros((8, 2, 16), jnp.bfloat16), prefix_lse=jnp.zeros((2, 8), jnp.float32),
                suffix_output=jnp.zeros((8, 2, 16), jnp.bfloat16), suffix_lse=jnp.zeros((2, 8), jnp.float32))


@pytest.mark.parametrize("change,error,match", [
    pytest.param(dict(suffix_output=jnp.zeros((8, 2, 16), jnp.float16)), TypeError, "suffix_output must be bfloat16",
                 id="dtypes_differ"),
    pytest.param(dict(prefix_output=jnp.zeros((8, 2, 16), jnp.int32),
                      suffix_output=jnp.zeros((8, 2, 16), jnp.int32)), TypeError, "prefix_output must be",
                 id="int_output"),
    pytest.param(dict(suffix_output=jnp.zeros((8, 2, 8), jnp.bfloat16)), ValueError, "suffix_output must match",
                 id="shapes_differ"),
    pytest.param(dict(prefix_lse=jnp.zeros((8, 2), jnp.float32)), ValueError, r"prefix_lse must be f32\[2, 8\]",
                 id="lse_layout_shape"),
    pytest.param(dict(suffix_lse=jnp.zeros((2, 8), jnp.bfloat16)), TypeError, "suffix_lse must be float32",
                 id="lse_dtype"),
    pytest.param(dict(out_dtype=jnp.int32), TypeError, "out_dtype must be", id="out_dtype"),
    pytest.param(dict(out_dtype=jnp.float8_e4m3fn), ValueError, "output_scale is required", id="fp8_no_scale"),
    pytest.param(dict(output_scale=jnp.ones((1,), jnp.float32)), ValueError, "output_scale is required",
                 id="scale_without_fp8"),
    pytest.param(dict(out_dtype=jnp.float8_e4m3fn, output_scale=jnp.ones((2,), jnp.float32)), TypeError,
                 "output_scale must be an f32 scalar", id="scale_shape"),
    pytest.param(dict(query_start_loc=jnp.array([0, 8], jnp.int32)), ValueError, "go together", id="qsl_alone"),
    pytest.param(dict(query_start_loc=jnp.array([0, 8], jnp.int32), prefix_cu_seq_lens=jnp.array([0, 1, 1], jnp.int32)),
                 ValueError, "must both be", id="offset_lengths"),
    pytest.param(dict(query_start_loc=jnp.array([0.0, 8.0]), prefix_cu_seq_lens=jnp.array([0, 1], jnp.int32)),
                 TypeError, "query_start_loc must be int32", id="qsl_float"),
    pytest.param(dict(prefill_tokens_with_context=2.5), TypeError, "integer scalar", id="ptwc_float"),
    pytest.param(dict(lse_layout="HD"), ValueError, "lse_layout must be one of", id="layout"),
    pytest.param(dict(lse_base=10), ValueError, "lse_base must be", id="base"),
    pytest.param(dict(prefill_tokens_with_context=9, validate=True), ValueError, r"must be in \[0, T=8\]",
                 id="validate_ptwc"),
    pytest.param(dict(query_start_loc=jnp.array([0, 9], jnp.int32), prefix_cu_seq_lens=jnp.array([0, 1], jnp.int32),
                      validate=True), ValueError, "past the token count", id="validate_qsl"),
])
def test_errors(change, error, match, mode):
    with pytest.raises(error, match=match):
        _merge(**{**_ok_args(), **change}, mode=mode)


def test_validate_under_jit_explains(mode):
    step = jax.jit(lambda a, p, b, s, n: _merge(a, p, b, s, prefill_tokens_with_context=n, validate=True,
                                                   mode=mode))
    with pytest.raises(ValueError, match="cannot run under jax.jit"):
        step(*_ok_args().values(), jnp.int32(3))


# ---------------------------------------------------------------------------------------------------------
# Property (Hypothesis): ragged batches with zeros, a padding tail, H = 3, R = 40 across the 32-wide scan,
# specials, traced prefill_tokens_with_context. One static shape: no recompilation between examples.

PROP_T, PROP_R, PROP_H, PROP_D = 256, 40, 3, 64


@st.composite
def merge_batches(draw):
    lens = draw(st.lists(st.one_of(st.just(0), st.integers(1, 6), st.integers(120, 140)),
                         min_size=PROP_R, max_size=PROP_R))
    pad = draw(st.integers(0, 40))
    qsl = np.minimum(np.concatenate([[0], np.cumsum(lens)]), PROP_T - pad).astype(np.int32)
    empty = draw(st.lists(st.booleans(), min_size=PROP_R, max_size=PROP_R))
    cu = np.concatenate([[0], np.cumsum(np.where(empty, 0, 5))]).astype(np.int32)
    ptwc = draw(st.integers(0, PROP_T))
    return qsl, cu, ptwc, draw(st.integers(0, 2**16))


@FIXTURE_OK
@given(batch=merge_batches())
def test_property_merge_within_tolerance(mode, batch):
    qsl, cu, ptwc, seed = batch
    rng = np.random.default_rng(seed)
    n_real = int(qsl[-1])
    bf16 = cases.DTYPES["bfloat16"]

    def partial():
        x = np.full((PROP_T, PROP_H, PROP_D), np.nan, np.float32)
        x[:n_real] = rng.standard_normal((n_real, PROP_H, PROP_D), dtype=np.float32)
        lse = rng.normal(4.0, 3.0, size=(PROP_H, PROP_T)).astype(np.float32)
        special = rng.random(lse.shape) < 0.15
        lse[special] = rng.choice(np.array([-np.inf, np.inf, np.nan], np.float32), size=int(special.sum()))
        lse[:, n_real:] = np.nan
        x[(special | np.isnan(lse)).T] = np.nan  # an empty partial's output is garbage
        return x.astype(bf16), lse

    (a, p), (b, s) = partial(), partial()
    inp = dict(prefix_output=a, prefix_lse=p, suffix_output=b, suffix_lse=s, query_start_loc=qsl)
    out, lse = _merge(jnp.asarray(a), jnp.asarray(p), jnp.asarray(b), jnp.asarray(s),
                      prefill_tokens_with_context=jnp.int32(ptwc), query_start_loc=jnp.asarray(qsl),
                      prefix_cu_seq_lens=jnp.asarray(cu), mode=mode)
    opts = dict(prefill_tokens_with_context=ptwc, query_start_loc=qsl, prefix_cu_seq_lens=cu)
    _check(out, lse, inp, opts, head_dim=PROP_D, case=f"property(seed={seed})", mode=mode)
