"""pallas_impl.merge_attn_states: what only the JAX wrappers have (docs/spec.md 4).

The behaviour every implementation shares (the reference on the workloads, bit copies, empty sides, properties,
shared errors, validate=True) is tested once in tests/test_op_merge.py. Here: traced values that never recompile,
validation under jax.jit, the implementation choice (`implementation=None`, the jnp path under jit). Kernel tests
take the `mode` fixture: "interpret" everywhere, "compiled" (marked gpu) on the GPU, identical bodies.
"""

import dataclasses

import numpy as np
import pytest
from merge_checks import assert_merge_matches_reference

import jax
import jax.numpy as jnp

import pallas_impl
from pallas_impl import _backend as pallas_backend
from pallas_impl import mask as pallas_mask
from pallas_impl import merge as pallas_merge
from parity.harness import cases, reference
from parity.library import compare

R33 = cases.by_name("r33_ragged_pad")  # R = 33, zero-length requests, a padding tail
PTWC = cases.by_name("padded_v_ptwc")  # prefill_tokens_with_context, a V-padded buffer, padding, bf16


def _merge(*args, mode, **kwargs):
    return pallas_impl.merge_attn_states(*args, implementation="pallas", interpret=mode == "interpret", **kwargs)


def _jax_args(case, inp):
    """The four partial arrays; a V-padded buffer is sliced in JAX (arrays have no strides)."""
    D = case.head_dim
    return (jnp.asarray(inp["prefix_output"])[..., :D], jnp.asarray(inp["prefix_lse"]),
            jnp.asarray(inp["suffix_output"])[..., :D], jnp.asarray(inp["suffix_lse"]))


def _check(case, inp, out, lse, *, ptwc, qsl, cu, mode):
    """The fused merge with these traced values against the reference of the same operands."""
    case = dataclasses.replace(case, prefill_tokens_with_context=ptwc)
    assert_merge_matches_reference(case, "merge_fused", dict(inp, query_start_loc=qsl, cu_seq_lens=cu), out, lse,
                                   mode=mode, name="merge")


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
    traces = []

    def step(a, p, b, s, ptwc, qsl, cu):
        traces.append(1)  # runs once per trace
        return _merge(a, p, b, s, prefill_tokens_with_context=ptwc, query_start_loc=qsl, prefix_cu_seq_lens=cu,
                      mode=mode)

    jitted = jax.jit(step)
    arrays = _jax_args(case, inp)
    variants = _variants(case, inp)
    for ptwc, qsl, cu in variants:
        out, lse = jitted(*arrays, jnp.int32(ptwc), jnp.asarray(qsl), jnp.asarray(cu))
        _check(case, inp, out, lse, ptwc=ptwc, qsl=qsl, cu=cu, mode=mode)
    assert len(traces) == 1
    assert jitted._cache_size() == 1

    # Called directly (Python ints too), the wrapper's jit cache gains at most this shape's one entry.
    sizes = []
    for ptwc, qsl, cu in variants:
        _merge(*arrays, prefill_tokens_with_context=ptwc, query_start_loc=jnp.asarray(qsl),
               prefix_cu_seq_lens=jnp.asarray(cu), mode=mode)
        sizes.append(pallas_merge._merge_jit._cache_size())
    assert sizes[0] == sizes[-1], sizes


def _ok_args():
    return dict(prefix_output=jnp.zeros((8, 2, 16), jnp.bfloat16), prefix_lse=jnp.zeros((2, 8), jnp.float32),
                suffix_output=jnp.zeros((8, 2, 16), jnp.bfloat16), suffix_lse=jnp.zeros((2, 8), jnp.float32))


def test_validate_under_jit_explains(mode):
    step = jax.jit(lambda a, p, b, s, n: _merge(a, p, b, s, prefill_tokens_with_context=n, validate=True,
                                                   mode=mode))
    with pytest.raises(ValueError, match="cannot run under jax.jit"):
        step(*_ok_args().values(), jnp.int32(3))


def test_out_dtype_must_be_a_float_output_dtype(mode):
    with pytest.raises(TypeError, match="out_dtype must be"):
        _merge(**_ok_args(), out_dtype=jnp.int32, mode=mode)


# ---------------------------------------------------------------------------------------------------------
# The implementation choice and the jnp path (plain XLA: every backend, no `mode`)


def test_implementation_none_picks_by_backend():
    """None: the Pallas kernel on GPU, the jnp fallback elsewhere (CPU here: no Pallas compile happens)."""
    chosen = "pallas" if jax.default_backend() == "gpu" else "jnp"
    assert pallas_backend.resolve_implementation(None) == chosen
    inp = cases.make_inputs(PTWC)
    args = _jax_args(PTWC, inp)
    kwargs = dict(prefill_tokens_with_context=PTWC.prefill_tokens_with_context,
                  query_start_loc=jnp.asarray(inp["query_start_loc"]), prefix_cu_seq_lens=jnp.asarray(inp["cu_seq_lens"]))
    sizes = (pallas_merge._merge_jit._cache_size(), pallas_mask._mask_jit._cache_size())
    out, lse = pallas_impl.merge_attn_states(*args, **kwargs)
    mask_lse = pallas_impl.mask_empty_context_lse(args[1], kwargs["query_start_loc"], kwargs["prefix_cu_seq_lens"])
    if chosen == "jnp":
        assert (pallas_merge._merge_jit._cache_size(), pallas_mask._mask_jit._cache_size()) == sizes
    want_out, want_lse = pallas_impl.merge_attn_states(*args, implementation=chosen, **kwargs)
    compare.assert_bitwise_equal(out, want_out, name="merge.out", case=PTWC)
    compare.assert_bitwise_equal(lse, want_lse, name="merge.lse", case=PTWC)
    want_mask = pallas_impl.mask_empty_context_lse(args[1], kwargs["query_start_loc"], kwargs["prefix_cu_seq_lens"],
                                                   implementation=chosen)
    compare.assert_bitwise_equal(mask_lse, want_mask, name="mask.lse", case=PTWC)


def test_unknown_implementation_raises():
    lse = jnp.zeros((2, 8), jnp.float32)
    qsl, cu = jnp.array([0, 4, 8], jnp.int32), jnp.array([0, 0, 1], jnp.int32)
    with pytest.raises(ValueError, match="implementation must be one of"):
        pallas_impl.mask_empty_context_lse(lse, qsl, cu, implementation="bogus")
    out = jnp.zeros((8, 2, 16), jnp.float32)
    with pytest.raises(ValueError, match="implementation must be one of"):
        pallas_impl.merge_attn_states(out, lse, out, lse, implementation="bogus")


def test_jnp_mask_then_merge_under_jit_with_traced_values():
    """The jnp path under jit: offsets and prefill_tokens_with_context traced, new values, one trace, results match
    the reference."""
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
        lse, (out, merged_lse) = jitted(*_jax_args(case, inp), jnp.int32(ptwc), jnp.asarray(qsl), jnp.asarray(cu))
        want_lse, _ = reference.mask_empty_context_lse(inp["prefix_lse"], qsl, cu)
        compare.assert_bitwise_equal(lse, want_lse, name="mask.lse", case=case, mode="jnp")
        _check(case, inp, out, merged_lse, ptwc=ptwc, qsl=qsl, cu=cu, mode="jnp")
    assert len(traces) == 1
    assert jitted._cache_size() == 1


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the refusal is a CPU platform's")
def test_compiling_for_a_gpu_on_a_cpu_is_refused_eagerly_not_under_a_trace():
    """interpret=False eagerly on a CPU: NotImplementedError naming the way out (the docstrings' promise), for each
    entry point; under a trace (a lowering for a GPU from a CPU host) it is the caller's target, not refused here."""
    o = jnp.zeros((8, 2, 16), jnp.float32)
    lse = jnp.zeros((2, 8), jnp.float32)
    offs = jnp.asarray([0, 8], jnp.int32)
    calls = [lambda **k: pallas_impl.merge_attn_states(o, lse, o, lse, **k),
             lambda **k: pallas_impl.merge_attn_states_n(o[None], lse[None], **k),
             lambda **k: pallas_impl.mask_empty_context_lse(lse, offs, jnp.asarray([0, 0], jnp.int32), **k)]
    for call in calls:
        with pytest.raises(NotImplementedError, match="interpret=None or True"):
            call(implementation="pallas", interpret=False)
        call(implementation="jnp", interpret=False)  # the jnp path ignores interpret
    traced = jax.make_jaxpr(lambda a: pallas_impl.merge_attn_states(a, lse, a, lse, implementation="pallas",
                                                                    interpret=False))(o)
    assert traced is not None
