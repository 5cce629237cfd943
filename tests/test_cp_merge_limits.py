"""The context-parallel combine (docs/spec.md 9) at its limits: an output dtype other than the partials', the exact
identities of base-2 LSEs, and (JAX) N past 64. Triton on 2 gloo ranks (spawned processes, its interpreter);
JAX with the ranks simulated by `jax.vmap` over a named axis (one device), Pallas kernels and the jnp path."""

import numpy as np
import pytest
import torch

import triton_impl
from parity.harness import expected, reference
from parity.library import compare
from parity.tools import ranks

jax = pytest.importorskip("jax")
jnp = jax.numpy
import pallas_impl  # noqa: E402

T, H, D = 5, 2, 8
WORLD = 2
U = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def _partials(n, dtype, seed, empty_rank=None):
    """(outputs [N, T, H, D] of `dtype`, base-2 lses f32[N, H, T]): one row empty everywhere, or partial
    `empty_rank` empty by its LSE (and no other row empty)."""
    import ml_dtypes

    rng = np.random.default_rng(seed)
    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    outputs = rng.standard_normal((n, T, H, D)).astype(np_dtype)
    lses = rng.uniform(-20.0, 40.0, (n, H, T)).astype(np.float32)
    if empty_rank is None:
        lses[:, 1, 0] = -np.inf  # a row empty everywhere
    else:
        lses[empty_rank] = -np.inf
    return outputs, lses


def _bits(x):
    x = np.asarray(x)
    return x.view(U[x.dtype.itemsize])


def _torch(x):
    x = np.ascontiguousarray(x)
    if x.dtype.name == "bfloat16":
        return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(x)


def _numpy(x: torch.Tensor):
    import ml_dtypes

    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return x.numpy()


SCENARIOS = {  # name -> (partials' dtype, output dtype, empty rank)
    "f32_to_bf16": ("float32", torch.bfloat16, None),
    "bf16_to_f32": ("bfloat16", torch.float32, None),
    "identity_bf16": ("bfloat16", torch.bfloat16, 0),
}


def _rank_worker(rank, world, group):
    got = {}
    for name, (dtype, out_dtype, empty) in SCENARIOS.items():
        outputs, lses = _partials(world, dtype, seed=len(name), empty_rank=empty)
        for method in ("gather", "reduce_scatter"):
            heads = H if method == "gather" else H // world
            out = torch.full((T, heads, D), float("nan")).to(out_dtype)
            out_lse = torch.full((heads, T), float("nan"))
            triton_impl.cp_merge_attn_states(out, _torch(outputs[rank]), _torch(lses[rank]), group, out_lse,
                                             method=method, lse_base=2)
            got[f"{name}/{method}"] = (_numpy(out), out_lse.numpy())
    return got


@pytest.fixture(scope="module")
def rank_results():
    out = ranks.run_ranks(_rank_worker, WORLD)
    for r, res in enumerate(out):
        assert res[0] == "ok", f"rank {r}: {res[1]}\n{res[2]}"
    return [res[1] for res in out]


def _single_triton(outputs, lses, out_dtype):
    out = torch.full((T, H, D), float("nan")).to(out_dtype)
    out_lse = torch.full((H, T), float("nan"))
    triton_impl.merge_attn_states_n(out, _torch(outputs), _torch(lses), out_lse, lse_base=2)
    return _numpy(out), out_lse.numpy()


def _assert_reference(out, lse, outputs, lses, heads=slice(None)):
    """Within tolerance of the float64 reference (the rows of one partial alone: exact), for heads `heads`."""
    ref_out, ref_lse = reference.merge_attn_states_n(outputs, lses, lse_base=2)
    w = reference.merge_weights_n(lses, lse_base=2)
    mag = expected.merge_magnitude(outputs, w)
    live = (w > 0).sum(axis=0)
    exact = (live <= 1)[:, heads]
    qsl = np.array([0, T], np.int32)
    compare.assert_matches_reference(out, ref_out[:, heads], exact=np.broadcast_to(exact[..., None], out.shape),
                                     mag=mag[:, heads], name="cp.out", query_start_loc=qsl)
    compare.assert_matches_reference(lse, ref_lse[heads], exact=exact.T, name="cp.lse", query_start_loc=qsl,
                                     layout="HT")


@pytest.mark.parametrize("name", ["f32_to_bf16", "bf16_to_f32"])
def test_triton_cp_into_another_out_dtype(rank_results, name):
    dtype, out_dtype, _ = SCENARIOS[name]
    outputs, lses = _partials(WORLD, dtype, seed=len(name))
    want = _single_triton(outputs, lses, out_dtype)
    heads = H // WORLD
    for rank, got in enumerate(rank_results):
        out, lse = got[f"{name}/gather"]  # the single-process N-way merge's bits, on every rank
        np.testing.assert_array_equal(_bits(out), _bits(want[0]))
        np.testing.assert_array_equal(_bits(lse), _bits(want[1]))
        own = slice(rank * heads, (rank + 1) * heads)
        out, lse = got[f"{name}/reduce_scatter"]  # within tolerance; the LSE computed, with the N-way bits
        assert out.dtype == want[0].dtype
        np.testing.assert_array_equal(_bits(lse), _bits(want[1][own]))
        _assert_reference(out, lse, outputs, lses, own)


def test_triton_cp_base2_identity(rank_results):
    """Rank 0 empty: every rank gets rank 1's row and base-2 LSE bits back, by either method."""
    outputs, lses = _partials(WORLD, "bfloat16", seed=len("identity_bf16"), empty_rank=0)
    heads = H // WORLD
    for rank, got in enumerate(rank_results):
        out, lse = got["identity_bf16/gather"]
        np.testing.assert_array_equal(_bits(out), _bits(outputs[1]))
        np.testing.assert_array_equal(_bits(lse), _bits(lses[1]))
        own = slice(rank * heads, (rank + 1) * heads)
        out, lse = got["identity_bf16/reduce_scatter"]
        np.testing.assert_array_equal(_bits(out), _bits(outputs[1][:, own]))
        np.testing.assert_array_equal(_bits(lse), _bits(lses[1][own]))


def _jax_cp(impl, outputs, lses, method, out_dtype):
    """Every simulated rank's (out, lse) of the combine: jax.vmap over the named axis "cp"."""
    f = lambda o, l: pallas_impl.cp_merge_attn_states(  # noqa: E731
        o, l, axis_name="cp", method=method, out_dtype=out_dtype, lse_base=2, implementation=impl)
    return [np.asarray(x) for x in jax.vmap(f, axis_name="cp")(jnp.asarray(outputs), jnp.asarray(lses))]


@pytest.mark.parametrize("impl,n", [("pallas", 2), ("jnp", 2), ("jnp", 65)])
def test_jax_cp_into_another_out_dtype(impl, n):
    outputs, lses = _partials(n, "float32", seed=n)
    want = [np.asarray(x) for x in pallas_impl.merge_attn_states_n(
        jnp.asarray(outputs), jnp.asarray(lses), out_dtype=jnp.bfloat16, lse_base=2, implementation=impl)]
    out, lse = _jax_cp(impl, outputs, lses, "gather", jnp.bfloat16)
    for r in range(n):  # the single-device N-way merge's bits on every rank
        np.testing.assert_array_equal(_bits(out[r]), _bits(want[0]))
        np.testing.assert_array_equal(_bits(lse[r]), _bits(want[1]))
    if H % n == 0:
        out, lse = _jax_cp(impl, outputs, lses, "reduce_scatter", jnp.bfloat16)
        heads = H // n
        for r in range(n):
            own = slice(r * heads, (r + 1) * heads)
            np.testing.assert_array_equal(_bits(lse[r]), _bits(want[1][own]))
            _assert_reference(out[r], lse[r], outputs, lses, own)


@pytest.mark.parametrize("impl", ["pallas", "jnp"])
def test_jax_cp_base2_identity(impl):
    outputs, lses = _partials(WORLD, "bfloat16", seed=3, empty_rank=0)
    for method in ("gather", "reduce_scatter"):
        out, lse = _jax_cp(impl, outputs, lses, method, None)
        heads = H if method == "gather" else H // WORLD
        for r in range(WORLD):
            own = slice(0, H) if method == "gather" else slice(r * heads, (r + 1) * heads)
            np.testing.assert_array_equal(_bits(out[r]), _bits(outputs[1][:, own]))
            np.testing.assert_array_equal(_bits(lse[r]), _bits(lses[1][own]))
