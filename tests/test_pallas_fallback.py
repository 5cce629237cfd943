"""pallas_impl.jnp_fallback (implementation="jnp") against parity.harness.reference, and the implementation choice.

The fallback is plain XLA: it runs on every backend, so these tests have no `mode`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_impl
from pallas_impl import _backend as pallas_backend
from pallas_impl import mask as pallas_mask
from pallas_impl import merge as pallas_merge
from parity.harness import expected
from parity.library import compare
from parity.harness import cases, reference

CI_CASES = cases.select("ci")
R33 = cases.by_name("r33_ragged_pad")  # R = 33, zero-length requests, padding tail
PTWC = cases.by_name("padded_v_ptwc")  # prefill_tokens_with_context, V-padded buffer


def _merge_options(case, inp, to=np.asarray):
    opts = dict(prefill_tokens_with_context=case.prefill_tokens_with_context, lse_layout=case.lse_layout,
                lse_base=case.lse_base, query_start_loc=to(inp["query_start_loc"]),
                prefix_cu_seq_lens=to(inp["cu_seq_lens"]))
    if case.out_dtype is not None:
        opts["output_scale"] = to(inp["output_scale"])
    return opts


def _jax_merge_args(case, inp):
    D = case.head_dim  # a V-padded buffer is sliced in JAX
    return (jnp.asarray(inp["prefix_output"])[..., :D], jnp.asarray(inp["prefix_lse"]),
            jnp.asarray(inp["suffix_output"])[..., :D], jnp.asarray(inp["suffix_lse"]))


def _check_merge(out, lse, case, inp, opts, *, label=""):
    """Reference comparison; pass-through rows (and both-empty rows) bit for bit, the rest within tolerance."""
    D, T = case.head_dim, case.num_tokens
    args = (inp["prefix_output"][..., :D], inp["prefix_lse"], inp["suffix_output"][..., :D], inp["suffix_lse"])
    want_out, want_lse = reference.merge_attn_states(*args, **opts)
    mag = expected.merge_out_magnitude(*args, **opts)
    ptwc = opts.get("prefill_tokens_with_context")
    passthrough = np.arange(T) >= (T if ptwc is None else int(ptwc))
    want_th = want_lse.T if case.lse_layout == "HT" else want_lse
    both_empty = np.isneginf(want_th) & ~passthrough[:, None]
    fp8 = case.out_dtype is not None
    exact = np.broadcast_to((both_empty | (passthrough[:, None] & (not fp8)))[..., None], want_out.shape)
    qsl = opts["query_start_loc"]
    compare.assert_matches_reference(out, want_out, exact=exact, mag=mag, case=case, name=f"merge.out{label}",
                                     query_start_loc=qsl, mode="jnp")
    compare.assert_matches_reference(lse, want_lse, exact=passthrough, case=case, name=f"merge.lse{label}",
                                     query_start_loc=qsl, mode="jnp")


@pytest.mark.parametrize("case", CI_CASES, ids=lambda c: c.name)
def test_mask_matches_reference(case):
    inp = cases.make_inputs(case)
    D = case.head_dim
    qsl, cu = inp["query_start_loc"], inp["cu_seq_lens"]
    got_lse, got_out = pallas_impl.mask_empty_context_lse(
        jnp.asarray(inp["prefix_lse"]), jnp.asarray(qsl), jnp.asarray(cu), jnp.asarray(inp["prefix_output"])[..., :D],
        lse_layout=case.lse_layout, implementation="jnp")
    want_lse, want_out = reference.mask_empty_context_lse(inp["prefix_lse"], qsl, cu, inp["prefix_output"][..., :D],
                                                          lse_layout=case.lse_layout)
    compare.assert_bitwise_equal(got_lse, want_lse, name="mask.lse", case=case, mode="jnp")
    compare.assert_bitwise_equal(got_out, want_out, name="mask.output", case=case, mode="jnp")


@pytest.mark.parametrize("case", CI_CASES, ids=lambda c: c.name)
def test_merge_matches_reference(case):
    inp = cases.make_inputs(case)
    kwargs = _merge_options(case, inp, to=jnp.asarray)
    if case.out_dtype is not None:
        kwargs["out_dtype"] = cases.DTYPES[case.out_dtype]
    out, lse = pallas_impl.merge_attn_states(*_jax_merge_args(case, inp), implementation="jnp", **kwargs)
    _check_merge(out, lse, case, inp, _merge_options(case, inp))


def test_implementation_none_picks_by_backend():
    """None: the Pallas kernel on GPU, the jnp fallback elsewhere (CPU here: no Pallas compile happens)."""
    expected = "pallas" if jax.default_backend() == "gpu" else "jnp"
    assert pallas_backend.resolve_implementation(None) == expected
    inp = cases.make_inputs(PTWC)
    args = _jax_merge_args(PTWC, inp)
    kwargs = _merge_options(PTWC, inp, to=jnp.asarray)
    sizes = (pallas_merge._merge_jit._cache_size(), pallas_mask._mask_jit._cache_size())
    out, lse = pallas_impl.merge_attn_states(*args, **kwargs)
    mask_lse = pallas_impl.mask_empty_context_lse(args[1], kwargs["query_start_loc"], kwargs["prefix_cu_seq_lens"])
    if expected == "jnp":
        assert (pallas_merge._merge_jit._cache_size(), pallas_mask._mask_jit._cache_size()) == sizes
    want_out, want_lse = pallas_impl.merge_attn_states(*args, implementation=expected, **kwargs)
    compare.assert_bitwise_equal(out, want_out, name="merge.out", case=PTWC)
    compare.assert_bitwise_equal(lse, want_lse, name="merge.lse", case=PTWC)
    want_mask = pallas_impl.mask_empty_context_lse(args[1], kwargs["query_start_loc"], kwargs["prefix_cu_seq_lens"],
                                                   implementation=expected)
    compare.assert_bitwise_equal(mask_lse, want_mask, name="mask.lse", case=PTWC)


def test_unknown_implementation_raises():
    lse = jnp.zeros((2, 8), jnp.float32)
    qsl, cu = jnp.array([0, 4, 8], jnp.int32), jnp.array([0, 0, 1], jnp.int32)
    with pytest.raises(ValueError, match="implementation must be one of"):
        pallas_impl.mask_empty_context_lse(lse, qsl, cu, implementation="bogus")
    out = jnp.zeros((8, 2, 16), jnp.float32)
    with pytest.raises(ValueError, match="implementation must be one of"):
        pallas_impl.merge_attn_states(out, lse, out, lse, implementation="bogus")


def test_fallback_under_jit_with_traced_values():
    """Offsets and prefill_tokens_with_context traced: new values, one trace, results match the reference."""
    case = R33
    inp = cases.make_inputs(case)
    T, R = case.num_tokens, case.num_requests
    traces = []

    def step(a, p, b, s, ptwc, qsl, cu):
        traces.append(1)  # runs once per trace
        lse, a = pallas_impl.mask_empty_context_lse(p, qsl, cu, a, implementation="jnp")
        merged = pallas_impl.merge_attn_states(a, p, b, s, prefill_tokens_with_context=ptwc, query_start_loc=qsl,
                                               prefix_cu_seq_lens=cu, implementation="jnp")
        return lse, merged

    jitted = jax.jit(step)
    rng = np.random.default_rng(3)
    lens = rng.integers(0, T // R, size=R)
    lens[-3:] = 0  # padded requests
    qsl2 = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    cu2 = np.concatenate([[0], np.cumsum(np.where(rng.random(R) < 0.5, 0, 2))]).astype(np.int32)
    for ptwc, qsl, cu in [(T, inp["query_start_loc"], inp["cu_seq_lens"]), (17, qsl2, cu2), (0, qsl2, cu2)]:
        lse, (out, merged_lse) = jitted(*_jax_merge_args(case, inp), jnp.int32(ptwc), jnp.asarray(qsl),
                                        jnp.asarray(cu))
        want_lse, _ = reference.mask_empty_context_lse(inp["prefix_lse"], qsl, cu)
        compare.assert_bitwise_equal(lse, want_lse, name="mask.lse", case=case, mode="jnp")
        opts = dict(prefill_tokens_with_context=ptwc, query_start_loc=qsl, prefix_cu_seq_lens=cu)
        _check_merge(out, merged_lse, case, inp, opts, label=f" ptwc={ptwc}")
    assert len(traces) == 1
    assert jitted._cache_size() == 1


def test_documented_donation_pattern():
    """The docstring's `jax.jit(mask_empty_context_lse, donate_argnames="lse")` runs (default implementation)."""
    step = jax.jit(pallas_impl.mask_empty_context_lse, donate_argnames="lse")
    inp = cases.make_inputs(R33)
    lse = jnp.asarray(inp["prefix_lse"])
    got = step(lse, jnp.asarray(inp["query_start_loc"]), jnp.asarray(inp["cu_seq_lens"]))
    assert lse.is_deleted()
    want, _ = reference.mask_empty_context_lse(inp["prefix_lse"], inp["query_start_loc"], inp["cu_seq_lens"])
    compare.assert_bitwise_equal(got, want, name="mask.lse", case=R33)
