"""The per-signature plans of the public `pallas_impl` wrappers (`_plans.cached_plan`, docs/design.md "Per-call
cost (JAX)"): a cached plan never freezes a value, never hides an error of another signature, and follows the
backend environment variable. Results are compared with `parity.harness.reference` bit for bit (the mask's rows and the
merges' pass-through rows are exact by docs/spec.md)."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import pallas_impl
from pallas_impl import _backend, _plans
from pallas_impl import mask as pallas_mask
from pallas_impl import merge as pallas_merge
from pallas_impl import merge_n as pallas_merge_n
from parity.library import compare
from parity.harness import reference

T, H, D = 16, 3, 8
IMPLS = [dict(implementation="jnp"), dict(implementation="pallas", interpret=True)]


def _lse(seed=0, shape=(H, T)):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _mask(lse, qsl, cu, **kw):
    return pallas_impl.mask_empty_context_lse(jnp.asarray(lse), jnp.asarray(qsl, jnp.int32),
                                              jnp.asarray(cu, jnp.int32), **kw)


@pytest.mark.parametrize("kw", IMPLS, ids=["jnp", "pallas"])
def test_a_cached_plan_reads_new_values(kw):
    # Same shapes, new offsets and LSE values: the second call uses the first call's plan, and its result is the
    # reference's for its own values.
    for seed, (qsl, cu) in enumerate([([0, 5, 16], [0, 0, 4]), ([0, 11, 16], [0, 3, 3])]):
        lse = _lse(seed)
        got = _mask(lse, qsl, cu, **kw)
        if seed == 0:
            plans = dict(pallas_mask._PLANS)
        want, _ = reference.mask_empty_context_lse(lse, np.array(qsl), np.array(cu))
        compare.assert_bitwise_equal(got, want, name="mask.lse")
    assert pallas_mask._PLANS == plans  # the second call built nothing


def test_merges_reuse_the_plan_with_new_values():
    rng = np.random.default_rng(1)
    o = rng.standard_normal((2, T, H, D)).astype(np.float32)
    for i, ptwc in enumerate((4, 9)):  # a Python int: keyed by its type, the value stays a runtime value
        lses = _lse(ptwc, (2, H, T))
        out, lse = pallas_impl.merge_attn_states(jnp.asarray(o[0]), jnp.asarray(lses[0]), jnp.asarray(o[1]),
                                                 jnp.asarray(lses[1]), prefill_tokens_with_context=ptwc,
                                                 implementation="jnp")
        out_n, lse_n = pallas_impl.merge_attn_states_n(jnp.asarray(o), jnp.asarray(lses),
                                                       prefill_tokens_with_context=ptwc, implementation="jnp")
        # docs/spec.md 4.4, 8.4: tokens at or past ptwc copy the suffix (last partial) bits.
        for got_o, got_l in ((out, lse), (out_n, lse_n)):
            compare.assert_bitwise_equal(np.array(got_o)[ptwc:], o[1][ptwc:], name="merge.out")
            compare.assert_bitwise_equal(np.array(got_l)[:, ptwc:], lses[1][:, ptwc:], name="merge.lse")
        if i == 0:
            plans = dict(pallas_merge._PLANS), dict(pallas_merge_n._PLANS)
    assert (pallas_merge._PLANS, pallas_merge_n._PLANS) == plans  # the second calls built nothing


@pytest.mark.parametrize("kw", IMPLS, ids=["jnp", "pallas"])
def test_errors_of_another_signature_after_a_cached_one(kw):
    lse = _lse()
    _mask(lse, [0, 5, 16], [0, 0, 4], **kw)  # cached
    with pytest.raises(ValueError, match="must both be"):
        _mask(lse, [0, 5, 16], [0, 4], **kw)
    with pytest.raises(TypeError, match="lse must be float32"):
        _mask(lse.astype(np.float16), [0, 5, 16], [0, 0, 4], **kw)
    with pytest.raises(ValueError, match=r"output must be \[T=16, H=3, D\]"):
        _mask(lse, [0, 5, 16], [0, 0, 4], output=jnp.zeros((T, H + 1, D), jnp.float32), **kw)
    with pytest.raises(ValueError, match="lse_layout must be one of"):  # unhashable option: checked, not cached
        _mask(lse, [0, 5, 16], [0, 0, 4], lse_layout=["HT"], **kw)
    with pytest.raises(TypeError, match="lse must be float32"):  # a refused signature is refused every time
        _mask(lse.astype(np.float16), [0, 5, 16], [0, 0, 4], **kw)
    o = jnp.zeros((T, H, D), jnp.bfloat16)
    l = jnp.asarray(lse)
    pallas_impl.merge_attn_states(o, l, o, l, **kw)
    with pytest.raises(TypeError, match="suffix_output must be bfloat16"):
        pallas_impl.merge_attn_states(o, l, o.astype(jnp.float16), l, **kw)
    with pytest.raises(TypeError, match="integer scalar"):
        pallas_impl.merge_attn_states(o, l, o, l, prefill_tokens_with_context=True, **kw)
    pallas_impl.merge_attn_states_n(o[None], l[None], **kw)
    with pytest.raises(ValueError, match="outputs and lses disagree on N"):
        pallas_impl.merge_attn_states_n(o[None], jnp.stack([l, l]), **kw)


def test_numpy_inputs_are_checked_every_call():
    lse = _lse()
    for _ in range(2):
        with pytest.raises(TypeError, match="lse must be float32"):
            pallas_impl.mask_empty_context_lse(lse.astype(np.float64), np.array([0, 16], np.int32),
                                               np.array([0, 0], np.int32), implementation="jnp")


def test_validate_checks_values_on_a_cached_plan():
    lse = _lse()
    _mask(lse, [0, 5, 16], [0, 0, 4], validate=True, implementation="jnp")
    with pytest.raises(ValueError, match="past the token count"):
        _mask(lse, [0, 5, 17], [0, 0, 4], validate=True, implementation="jnp")
    o = jnp.zeros((T, H, D), jnp.bfloat16)
    l = jnp.asarray(lse)
    pallas_impl.merge_attn_states_n(o[None], l[None], prefill_tokens_with_context=3, validate=True,
                                    implementation="jnp")
    with pytest.raises(ValueError, match=r"must be in \[0, T=16\]"):
        pallas_impl.merge_attn_states_n(o[None], l[None], prefill_tokens_with_context=17, validate=True,
                                        implementation="jnp")


def test_checks_run_at_trace_time_under_jit():
    lse = jnp.asarray(_lse())
    qsl, cu = jnp.array([0, 5, 16], jnp.int32), jnp.array([0, 0, 4], jnp.int32)
    step = jax.jit(lambda *a: pallas_impl.mask_empty_context_lse(*a, implementation="jnp"))
    want, _ = reference.mask_empty_context_lse(np.asarray(lse), np.asarray(qsl), np.asarray(cu))
    compare.assert_bitwise_equal(step(lse, qsl, cu), want, name="mask.lse")
    with pytest.raises(ValueError, match="must both be"):
        step(lse, qsl, cu[:2])


def test_the_plan_follows_the_backend_environment(monkeypatch):
    lse = _lse()
    monkeypatch.delenv(_backend.BACKEND_ENV, raising=False)
    _mask(lse, [0, 5, 16], [0, 0, 4], implementation="jnp")
    monkeypatch.setenv(_backend.BACKEND_ENV, "cuda")
    with pytest.raises(ValueError, match=f"{_backend.BACKEND_ENV} must be one of"):
        _mask(lse, [0, 5, 16], [0, 0, 4], implementation="jnp")


def test_the_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(_plans, "PLAN_CACHE_SIZE", 2)
    monkeypatch.setattr(pallas_merge_n, "_PLANS", {})
    for n in (1, 2, 3):
        o = jnp.zeros((n, T, H, D), jnp.float32)
        pallas_impl.merge_attn_states_n(o, jnp.zeros((n, H, T), jnp.float32), implementation="jnp")
        assert 1 <= len(pallas_merge_n._PLANS) <= 2
