"""The JAX sharding and context-parallel checks, on 4 CPU devices: run by tests/test_pallas_sharding.py.

JAX fixes its device count when it starts, so these run in their own process with
`XLA_FLAGS=--xla_force_host_platform_device_count=4` (the rest of the test session keeps one device). Each check
records {"ok", "detail"} under its name; `python tests/multidevice_jax.py OUT.json` writes them all.
"""

import dataclasses
import json
import os
import re
import sys
import traceback

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import pallas_impl  # noqa: E402
from parity.library import compare
from parity.harness import cases, expected, impls  # noqa: E402

RESULTS = {}
IMPLS = ("pallas", "jnp")  # "pallas": the kernels, in interpret mode on CPU
# backend="mosaic_gpu" (jax >= 0.11) is traced compiled only: jax's Mosaic GPU interpreter keeps one global model
# of shared memory and fails when several CPU devices run kernels at once.
MOSAIC = tuple(int(x) for x in re.findall(r"\d+", jax.__version__)[:2]) >= (0, 11)


def check(name):
    def wrap(fn):
        try:
            detail = fn()
            RESULTS[name] = {"ok": True, "detail": detail or ""}
        except Exception as e:  # noqa: BLE001 - recorded, asserted by the test
            RESULTS[name] = {"ok": False, "detail": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"}
        return fn

    return wrap


def bits(x):
    x = np.asarray(x)
    return x.view({4: np.uint32, 2: np.uint16, 1: np.uint8}[x.dtype.itemsize])


def same_bits(got, want, what):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        if not np.array_equal(bits(g), bits(w)):
            raise AssertionError(f"{what}: {int((bits(g) != bits(w)).sum())} elements differ from the unsharded call")


def kw(impl, interpret=True):
    if impl == "mosaic":
        return dict(backend="mosaic_gpu", interpret=interpret)
    return dict(implementation=impl, interpret=interpret)


# The 2-way case: H = 8 heads (two per device), fp32, an empty request, a V-padded layout sliced in JAX.
C2 = dataclasses.replace(cases.by_name("block_edges"), num_heads=8, head_dim=32)
I2 = {k: jnp.asarray(v) for k, v in cases.make_inputs(C2).items()}
D2 = C2.head_dim
A, PL, B, SL = I2["prefix_output"][..., :D2], I2["prefix_lse"], I2["suffix_output"][..., :D2], I2["suffix_lse"]
QSL, CU = I2["query_start_loc"], I2["cu_seq_lens"]
# The N-way case: 4 partials, H = 4 (one head per device), bf16, specials, partials without KV.
CN = dataclasses.replace(cases.by_name("n4_bf16_fp8_out"), out_dtype=None, prefill_tokens_with_context=30)
IN = {k: jnp.asarray(v) for k, v in cases.make_inputs_n(CN).items()}
ON, LN, CUN = IN["outputs"], IN["lses"], IN["cu_seq_lens"]

OPS = {
    "mask": (lambda impl, i=True: lambda l, q, c, o: pallas_impl.mask_empty_context_lse(l, q, c, o, **kw(impl, i)),
             (PL, QSL, CU, A), (P("tp", None), P(), P(), P(None, "tp", None)), (P("tp", None), P(None, "tp", None))),
    "merge_fused": (lambda impl, i=True: lambda a, p, b, s, q, c: pallas_impl.merge_attn_states(
        a, p, b, s, query_start_loc=q, prefix_cu_seq_lens=c, prefill_tokens_with_context=400, **kw(impl, i)),
        (A, PL, B, SL, QSL, CU), (P(None, "tp", None), P("tp", None), P(None, "tp", None), P("tp", None), P(), P()),
        (P(None, "tp", None), P("tp", None))),
    "merge_n_fused": (lambda impl, i=True: lambda o, l, q, c: pallas_impl.merge_attn_states_n(
        o, l, query_start_loc=q, cu_seq_lens=c, prefill_tokens_with_context=30, **kw(impl, i)),
        (ON, LN, QSL_N := IN["query_start_loc"], CUN), (P(None, None, "tp", None), P(None, "tp", None), P(), P()),
        (P(None, "tp", None), P("tp", None))),
}


def mesh_of(axis_type):
    return jax.make_mesh((4,), ("tp",), axis_types=(axis_type,))


def put(args, specs, mesh):
    return tuple(jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(args, specs))


AXES = {"explicit": jax.sharding.AxisType.Explicit, "auto": jax.sharding.AxisType.Auto}

for op, (make, args, in_specs, out_specs) in OPS.items():
    for impl in IMPLS:
        want = make(impl)(*args)
        for axis_label, axis_type in AXES.items():
            mesh = mesh_of(axis_type)
            sharded = put(args, in_specs, mesh)

            @check(f"shard_map/{op}/{impl}/{axis_label}")
            def _(op=op, impl=impl, mesh=mesh, sharded=sharded, in_specs=in_specs, out_specs=out_specs, want=want):
                f = jax.shard_map(make(impl), mesh=mesh, in_specs=in_specs, out_specs=out_specs)  # check_vma=True
                same_bits(jax.jit(f)(*sharded), want, f"{op} under shard_map")

            @check(f"jit_named_sharding/{op}/{impl}/{axis_label}")
            def _(op=op, impl=impl, sharded=sharded, want=want):
                got = jax.jit(make(impl))(*sharded)
                same_bits(got, want, f"{op} under jit with NamedSharding inputs")
                return str(jax.tree.leaves(got)[0].sharding)

    for impl in ("pallas",) + (("mosaic",) if MOSAIC else ()):
        @check(f"compiled_trace_under_shard_map/{op}/{impl}")
        def _(make=make, impl=impl, args=args, in_specs=in_specs, out_specs=out_specs):
            # The compiled kernels' out_shape under check_vma=True, traced on CPU (lowering needs a GPU).
            mesh = mesh_of(jax.sharding.AxisType.Auto)
            f = jax.shard_map(make(impl, False), mesh=mesh, in_specs=in_specs, out_specs=out_specs)
            return str(jax.jit(f).trace(*args).out_info)


@check("jit_named_sharding/token_axis_sharded_is_an_error")
def _():
    mesh = mesh_of(jax.sharding.AxisType.Explicit)
    a, p, b, s = put((A[:640], PL[:, :640], B[:640], SL[:, :640]),
                     (P("tp", None, None), P(None, "tp"), P("tp", None, None), P(None, "tp")), mesh)
    try:
        jax.jit(lambda *x: pallas_impl.merge_attn_states(*x, **kw("pallas")))(a, p, b, s)
    except ValueError as e:
        assert "shard heads" in str(e), e
        return str(e)
    raise AssertionError("a token-sharded operand was accepted")


# ---- the context-parallel combine over a 4-device axis
MESH_CP = jax.make_mesh((4,), ("cp",), axis_types=(jax.sharding.AxisType.Auto,))
WANT_N = {impl: pallas_impl.merge_attn_states_n(ON, LN, query_start_loc=QSL_N, cu_seq_lens=CUN,
                                                prefill_tokens_with_context=30, **kw(impl)) for impl in IMPLS}


def cp_call(impl, method, **extra):
    def f(o, l, q, c):
        return pallas_impl.cp_merge_attn_states(o[0], l[0], axis_name="cp", query_start_loc=q, cu_seq_lens=c[0],
                                                method=method, prefill_tokens_with_context=30, **kw(impl), **extra)

    out_specs = (P(), P()) if method == "gather" else (P(None, "cp", None), P("cp", None))
    return jax.jit(jax.shard_map(f, mesh=MESH_CP, in_specs=(P("cp"), P("cp"), P(), P("cp")), out_specs=out_specs))


for impl in IMPLS:
    @check(f"cp/gather/{impl}")
    def _(impl=impl):
        # Replicated result (out_specs=P() under check_vma=True), the single-device N-way merge's bits.
        same_bits(cp_call(impl, "gather")(ON, LN, QSL_N, CUN), WANT_N[impl], "cp gather")

    for reduce_dtype in (None, jnp.bfloat16):
        @check(f"cp/reduce_scatter/{impl}/{'f32' if reduce_dtype is None else 'bf16'}_reduce")
        def _(impl=impl, reduce_dtype=reduce_dtype):
            out, lse = cp_call(impl, "reduce_scatter", reduce_dtype=reduce_dtype)(ON, LN, QSL_N, CUN)
            same_bits(lse, WANT_N[impl][1], "cp reduce_scatter LSE (computed, not reduced)")
            inp = cases.make_inputs_n(CN)
            ref = impls.run(impls.HOST, "reference", "merge_n_fused", CN, inp)
            w = expected.merge_weights(CN, "merge_n_fused", inp)
            mag = expected.magnitude(CN, "merge_n_fused", inp, w)
            exact, _ = expected.exact_masks(CN, w)
            tol = compare.TOLERANCES["bfloat16"]
            if reduce_dtype is not None:  # one rounding per device, then the sum's
                tol = compare.Tolerance(rtol=5 * tol.rtol, atol=5 * tol.atol)
            compare.assert_matches_reference(np.asarray(out), ref["out"], exact=np.broadcast_to(exact[..., None], mag.shape),
                                             mag=mag, tol=tol, name="cp reduce_scatter out", case=CN)

    @check(f"cp/vmap_simulated_ranks/{impl}")
    def _(impl=impl):
        # One device, N simulated ranks (jax.vmap with an axis name): the same bits (the single-GPU demo path).
        f = lambda o, l, c: pallas_impl.cp_merge_attn_states(o, l, axis_name="cp", query_start_loc=QSL_N,  # noqa
                                                            cu_seq_lens=c, prefill_tokens_with_context=30, **kw(impl))
        out, lse = jax.vmap(f, axis_name="cp")(ON, LN, CUN)
        for r in range(4):
            same_bits((out[r], lse[r]), WANT_N[impl], f"vmap rank {r}")


if MOSAIC:
    @check("compiled_trace_under_shard_map/cp_gather/mosaic")
    def _():
        def f(o, l, q, c):
            return pallas_impl.cp_merge_attn_states(o[0], l[0], axis_name="cp", query_start_loc=q, cu_seq_lens=c[0],
                                                    prefill_tokens_with_context=30, **kw("mosaic", False))

        g = jax.shard_map(f, mesh=MESH_CP, in_specs=(P("cp"), P("cp"), P(), P("cp")), out_specs=(P(), P()))
        return str(jax.jit(g).trace(ON, LN, QSL_N, CUN).out_info)

    @check("compiled_trace_under_shard_map/cp_reduce_scatter/mosaic")
    def _():
        def f(o, l, q, c):  # the rescale kernel, compiled, then psum_scatter: device r keeps head r
            return pallas_impl.cp_merge_attn_states(o[0], l[0], axis_name="cp", query_start_loc=q, cu_seq_lens=c[0],
                                                    method="reduce_scatter", prefill_tokens_with_context=30,
                                                    **kw("mosaic", False))

        g = jax.shard_map(f, mesh=MESH_CP, in_specs=(P("cp"), P("cp"), P(), P("cp")),
                          out_specs=(P(None, "cp"), P("cp")))
        return str(jax.jit(g).trace(ON, LN, QSL_N, CUN).out_info)


def expect_error(fn, match):
    try:
        fn()
    except ValueError as e:
        assert match in str(e), str(e)
        return str(e)
    raise AssertionError("no error")


@check("cp/errors/wrong_axis_name")
def _():
    def f(o, l):
        return pallas_impl.cp_merge_attn_states(o[0], l[0], axis_name="dcp", **kw("jnp"))

    g = jax.jit(jax.shard_map(f, mesh=MESH_CP, in_specs=(P("cp"), P("cp")), out_specs=(P(), P())))
    return expect_error(lambda: g(ON, LN), "axis_name='dcp' is not a mesh axis")


@check("cp/errors/outside_shard_map")
def _():
    return expect_error(lambda: pallas_impl.cp_merge_attn_states(ON[0], LN[0], axis_name="cp"), "is not a mesh axis")


@check("cp/errors/heads_not_a_multiple_of_n")
def _():
    def f(o, l):
        return pallas_impl.cp_merge_attn_states(o[0, :, :3], l[0, :3], axis_name="cp", method="reduce_scatter",
                                                **kw("jnp"))

    g = jax.jit(jax.shard_map(f, mesh=MESH_CP, in_specs=(P("cp"), P("cp")), out_specs=(P(), P())))
    return expect_error(lambda: g(ON, LN), "H must be a multiple of N")


@check("cp/errors/gathered_offsets")
def _():
    def f(o, l, q, c):
        return pallas_impl.cp_merge_attn_states(o[0], l[0], axis_name="cp", query_start_loc=q, cu_seq_lens=c,
                                                **kw("jnp"))

    g = jax.jit(jax.shard_map(f, mesh=MESH_CP, in_specs=(P("cp"), P("cp"), P(), P()), out_specs=(P(), P())))
    return expect_error(lambda: g(ON, LN, QSL_N, CUN), "this device's local KV offsets")


if __name__ == "__main__":
    with open(sys.argv[1], "w") as f:
        json.dump(RESULTS, f, indent=1)
    print(f"{sum(r['ok'] for r in RESULTS.values())}/{len(RESULTS)} ok; {len(jax.devices())} devices")
