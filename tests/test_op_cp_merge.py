"""cp_merge_attn_states (docs/spec.md 9) in every implementation: the combine over a context-parallel group.

Device (rank) i holds partial i of an N-way case (its KV shard: partials empty for some requests, NaN garbage
under finite LSEs) and its own KV offsets. `gather` must give the single-process N-way merge's bits on every rank;
`reduce_scatter` the same values within the merge tolerance, and the N-way LSE's bits (the LSE is computed, not
reduced). Triton runs on 4 spawned gloo ranks (`cp_ranks`, one spawn per test process); the JAX implementations
under `jax.vmap` with an axis name, through `parity.harness.impls`. The torch-only and mesh-only checks are in
tests/test_triton_cp_merge.py and tests/test_pallas_sharding.py.
"""


import numpy as np
import pytest
from cp_ranks import CASE, CASE_BF16, WORLD
from op_support import IMPLS, RT, bits, numpy

import jax
import jax.numpy as jnp

from parity.harness import cases, expected, impls
from parity.library import compare

def _triton(name, method, reduce_dtype, prefix=""):
    """(per-rank (out, lse) list, single-process N-way (out, lse)) from the gloo ranks (`prefix` "torch_": the torch
    path's)."""
    import cp_ranks

    res = cp_ranks.results()
    key = f"{prefix}{name}_{method}" + ("_bf16_reduce" if reduce_dtype else "")
    _, out, lse = res[0][f"{prefix}{name}_single"]
    return [res[r][key] for r in range(WORLD)], (out, lse)


def _jax(impl, case, method, reduce_dtype):
    """The same combine with `jax.vmap(axis_name="cp")` over the N partials, and this implementation's
    single-device N-way merge of them."""
    if impl == "mosaic" and not RT.on_gpu:
        pytest.skip("JAX's Mosaic GPU interpreter runs no kernel under a vmap axis name (jax 0.11.2: 'unbound axis "
                    "name'); tests/test_pallas_mosaic.py runs the Mosaic combine under shard_map on one CPU device")
    inp = cases.make_inputs_n(case)
    D = case.head_dim
    adapter = impls.adapter(RT, impl)
    scale = None if case.out_dtype is None else jnp.asarray(inp["output_scale"])
    qsl = jnp.asarray(inp["query_start_loc"])

    def combine(o, lse, cu):
        r = adapter.cp_merge(o, lse, axis_name="cp", method=method, query_start_loc=qsl, cu_seq_lens=cu,
                             prefill_tokens_with_context=case.prefill_tokens_with_context, out_dtype=case.out_dtype,
                             output_scale=scale, lse_layout=case.lse_layout, lse_base=case.lse_base,
                             reduce_dtype=None if reduce_dtype is None else jnp.dtype(reduce_dtype))
        return r["out"], r["lse"]

    out, lse = jax.vmap(combine, axis_name="cp")(jnp.asarray(inp["outputs"])[..., :D], jnp.asarray(inp["lses"]),
                                                 jnp.asarray(inp["cu_seq_lens"]))
    single = impls.run(RT, impl, "merge_n_fused", case, {k: jnp.asarray(v) for k, v in inp.items()})
    return [(numpy(out[r]), numpy(lse[r])) for r in range(case.partials)], (numpy(single["out"]),
                                                                             numpy(single["lse"]))


def _results(impl, case, name, method, reduce_dtype):
    if impl in ("triton", "torch"):
        return _triton(name, method, reduce_dtype, "torch_" if impl == "torch" else "")
    return _jax(impl, case, method, reduce_dtype)


def _bitwise(impl) -> bool:
    """The N-way merge inside the combine and alone are two programs: bit equal in the Triton interpreter and
    compiled on a GPU; XLA:CPU contracts FMAs differently per program (docs/spec.md 5)."""
    return impl in ("triton", "pallas", "torch") or RT.on_gpu


@pytest.mark.parametrize("name,case", [("bf16", CASE_BF16), ("fp8", CASE)])
@pytest.mark.parametrize("impl", IMPLS)
def test_gather_gives_the_single_process_bits_on_every_rank(impl, name, case):
    per_rank, (want_out, want_lse) = _results(impl, case, name, "gather", None)
    for rank, (out, lse) in enumerate(per_rank):
        if _bitwise(impl):
            assert np.array_equal(bits(out), bits(want_out)), f"rank {rank}: out differs from the N-way merge"
            assert np.array_equal(bits(lse), bits(want_lse)), f"rank {rank}: lse differs from the N-way merge"
        else:
            compare.assert_matches_reference(out, want_out.astype(np.float64), name=f"cp gather.out rank {rank}",
                                             case=case, mode=impl)
            compare.assert_matches_reference(lse, want_lse.astype(np.float64), name=f"cp gather.lse rank {rank}",
                                             case=case, mode=impl, tol="lse")


# The JAX combine's own matrix (meshes, both methods, dtypes) runs in tests/test_pallas_sharding.py's subprocesses:
# here the bf16 reduction is Triton's only.
REDUCE_SCATTER = [pytest.param(impl.values[0], *v[1:], marks=impl.marks, id=f"{impl.id}-{v[0]}") for impl in IMPLS
                  for v in (("bf16", "bf16", CASE_BF16, None), ("fp8", "fp8", CASE, None),
                            ("bf16_reduce", "bf16", CASE_BF16, "bfloat16"))
                  if impl.id in ("triton", "torch") or v[0] != "bf16_reduce"]


@pytest.mark.parametrize("impl,name,case,reduce_dtype", REDUCE_SCATTER)
def test_reduce_scatter_within_tolerance(impl, name, case, reduce_dtype):
    per_rank, (_, want_lse) = _results(impl, case, name, "reduce_scatter", reduce_dtype)
    out = np.concatenate([o for o, _ in per_rank], axis=1)  # rank r: its heads
    lse = np.concatenate([lse for _, lse in per_rank], axis=0)
    # The LSE is computed from the gathered LSEs, not reduced: the N-way merge's bits.
    if _bitwise(impl):
        assert np.array_equal(bits(lse), bits(want_lse))
    inp = cases.make_inputs_n(case)
    ref = impls.run(impls.HOST, "reference", "merge_n_fused", case, inp)
    w = expected.merge_weights(case, "merge_n_fused", inp)
    mag = expected.magnitude(case, "merge_n_fused", inp, w)
    out_exact, lse_exact = expected.exact_masks(case, w)
    compare.assert_matches_reference(lse, ref["lse"], exact=lse_exact, name="cp reduce_scatter.lse", case=case,
                                     mode=impl)
    # One rounding at the end (f32 sum), or one per rank with a bf16 reduction: N + 1 roundings of the output dtype.
    tol = compare.TOLERANCES[case.out_dtype or case.dtype]
    if reduce_dtype:
        tol = compare.Tolerance(rtol=(WORLD + 1) * tol.rtol, atol=(WORLD + 1) * tol.atol)
    compare.assert_matches_reference(out, ref["out"], exact=np.broadcast_to(out_exact[..., None], mag.shape), mag=mag,
                                     tol=tol, name="cp reduce_scatter.out", case=case, mode=impl)
    if case.prefill_tokens_with_context is not None and case.out_dtype is None:
        # 8.4: the last rank's rows exactly (the reduction canonicalises NaN payloads: NaN stays NaN).
        ptwc, D = case.prefill_tokens_with_context, case.head_dim
        got, want = out[ptwc:], inp["outputs"][-1, ptwc:, :, :D]
        nan = np.isnan(want.astype(np.float32))
        assert np.array_equal(np.isnan(got.astype(np.float32)), nan)
        assert np.array_equal(bits(got)[~nan], bits(want)[~nan])


