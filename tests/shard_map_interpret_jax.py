"""The interpreted Pallas kernels under `jax.shard_map` on more CPU devices than a CI machine has cores: run by
tests/test_pallas_sharding.py with a timeout.

4 CPU devices (`XLA_FLAGS=--xla_force_host_platform_device_count=4`, set before jax starts), each entry point run
three times under `jax.jit(jax.shard_map(...))` with check_vma=True, heads sharded; each result compared bit for bit
with the unsharded call on each shard's own slices (`per_shard`). A kernel that starts a JAX computation from a
host callback of the sharded one and waits for it can starve the CPU client's threads (its pool has
max(cores, devices) threads, each shard holds one): the run then hangs and the test times out. Sized for that: with such a callback, on 2 cores, this hung in every run
tried. Prints one line per call (the last shows where it stopped); exits non-zero on a mismatch.
"""

import dataclasses
import itertools
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import pallas_impl  # noqa: E402
from parity.harness import cases  # noqa: E402

DEVICES = 4
REPEAT = 3  # executions of each compiled shard_map call
CALLS = 0


def bits(x):
    x = np.asarray(x)
    return x.view({4: np.uint32, 2: np.uint16, 1: np.uint8}[x.dtype.itemsize])


def run(name, make, args, in_specs, out_specs, want, mesh):
    """`make(*args)` under jit(shard_map) on `mesh`, REPEAT times; every result's bits equal `want`'s."""
    global CALLS
    f = jax.jit(jax.shard_map(make, mesh=mesh, in_specs=in_specs, out_specs=out_specs))  # check_vma=True
    placed = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(args, in_specs)]
    for i in range(REPEAT):
        got = jax.block_until_ready(f(*placed))
        CALLS += 1
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            differ = int((bits(g) != bits(w)).sum())
            if g.shape != w.shape or differ:
                sys.exit(f"{name}: {differ} elements differ from the unsharded call (shapes {g.shape}, {w.shape})")
        print(f"{name} #{i}: same bits", flush=True)


def per_shard(make, args, in_specs, out_specs, mesh):
    """The unsharded `make` on each shard's own slices of `args`, assembled as `out_specs` place them: what each
    shard must compute. (An interpreted kernel's bits follow XLA:CPU's fusion of the shapes it sees, whose FMA
    contraction no flag turns off: the reference call sees the shapes a shard sees.)"""
    names = mesh.axis_names

    def index(spec, ndim, coord, sizes):
        spec = tuple(spec) + (None,) * (ndim - len(tuple(spec)))
        return tuple(slice(None) if ax is None else slice(coord[names.index(ax)] * n, (coord[names.index(ax)] + 1) * n)
                     for ax, n in zip(spec, sizes))

    coords = list(itertools.product(*(range(mesh.shape[n]) for n in names)))
    full = None
    for coord in coords:
        local = [x[index(s, x.ndim, coord, [d // (mesh.shape[a] if a else 1) for d, a in
                                            zip(x.shape, tuple(s) + (None,) * (x.ndim - len(tuple(s))))])]
                 for x, s in zip(args, in_specs)]
        got = jax.tree.leaves(make(*local))
        if full is None:
            full = [np.empty([d * (mesh.shape[a] if a else 1) for d, a in
                              zip(g.shape, tuple(s) + (None,) * (g.ndim - len(tuple(s))))], np.asarray(g).dtype)
                    for g, s in zip(got, jax.tree.leaves(out_specs, is_leaf=lambda x: isinstance(x, P)))]
        for f, g, s in zip(full, got, jax.tree.leaves(out_specs, is_leaf=lambda x: isinstance(x, P))):
            f[index(s, g.ndim, coord, g.shape)] = np.asarray(g)
    return full


assert len(jax.devices()) == DEVICES, jax.devices()
MESH = jax.make_mesh((DEVICES,), ("tp",))
OUT3, LSE, REP = P(None, "tp", None), P("tp", None), P()

# The 2-way inputs: T = 1200, H = 8 (two heads per device), D = 64, fp32, three requests, the first without context.
rng = np.random.default_rng(0)
T, H, D = 1200, 8, 64
PO, SO = (jnp.asarray(rng.standard_normal((T, H, D), dtype=np.float32)) for _ in range(2))
PL, SL = (jnp.asarray(rng.normal(4.0, 3.0, (H, T)).astype(np.float32)) for _ in range(2))
QSL, CSL = jnp.asarray([0, T // 3, T * 5 // 6, T], jnp.int32), jnp.asarray([0, 0, 5, 5], jnp.int32)
KW = dict(implementation="pallas", interpret=True)


def mask(lse, q, c, o):
    return pallas_impl.mask_empty_context_lse(lse, q, c, o, **KW)


def merge(a, p, b, s, q, c):
    return pallas_impl.merge_attn_states(a, p, b, s, query_start_loc=q, prefix_cu_seq_lens=c, **KW)


def merge_fused(a, p, b, s, q, c):
    return pallas_impl.merge_attn_states(a, p, b, s, query_start_loc=q, prefix_cu_seq_lens=c,
                                         prefill_tokens_with_context=T * 5 // 6, **KW)


run("mask", mask, (PL, QSL, CSL, PO), (LSE, REP, REP, OUT3), (LSE, OUT3), mask(PL, QSL, CSL, PO), MESH)
for fn in (merge, merge_fused):
    args, specs = (PO, PL, SO, SL, QSL, CSL), (OUT3, LSE, OUT3, LSE, REP, REP)
    run(fn.__name__, fn, args, specs, (OUT3, LSE), per_shard(fn, args, specs, (OUT3, LSE), MESH), MESH)

# The N-way inputs: 4 partials, H = 8, bf16, specials (+inf, NaN, -inf LSEs), partials without KV.
CN = dataclasses.replace(cases.by_name("n4_bf16_fp8_out"), num_heads=H, out_dtype=None,
                         prefill_tokens_with_context=30)
IN = {k: jnp.asarray(v) for k, v in cases.make_inputs_n(CN).items()}
ON, LN, QN, CUN = IN["outputs"], IN["lses"], IN["query_start_loc"], IN["cu_seq_lens"]


def merge_n(o, l, q, c):
    return pallas_impl.merge_attn_states_n(o, l, query_start_loc=q, cu_seq_lens=c, prefill_tokens_with_context=30,
                                           **KW)


SPECS_N = (P(None, None, "tp", None), P(None, "tp", None), REP, REP)
run("merge_n_fused", merge_n, (ON, LN, QN, CUN), SPECS_N, (OUT3, LSE),
    per_shard(merge_n, (ON, LN, QN, CUN), SPECS_N, (OUT3, LSE), MESH), MESH)

# Two mesh axes: a data-parallel pair of batches, each with its heads over 2 devices. The offsets vary over "dp"
# only (each batch its own), the outputs and LSEs over both axes.
MESH2 = jax.make_mesh((2, DEVICES // 2), ("dp", "tp"))
CSL2 = jnp.stack([CSL, jnp.asarray([0, 7, 7, 9], jnp.int32)])
PO2, PL2, SO2, SL2 = (jnp.stack([x, x[::-1]]) for x in (PO, PL, SO, SL))
ARGS2 = (PO2, PL2, SO2, SL2, QSL, CSL2)
OUT4, LSE3 = P("dp", None, "tp", None), P("dp", "tp", None)


def merge_fused_dp(a, p, b, s, q, c):
    return jax.tree.map(lambda r: r[None], merge_fused(a[0], p[0], b[0], s[0], q, c[0]))


SPECS2 = (OUT4, LSE3, OUT4, LSE3, REP, P("dp"))
run("merge_fused_dp_tp", merge_fused_dp, ARGS2, SPECS2, (OUT4, LSE3),
    per_shard(merge_fused_dp, ARGS2, SPECS2, (OUT4, LSE3), MESH2), MESH2)

# The context-parallel combine: partial i on device i.
MESH_CP = jax.make_mesh((DEVICES,), ("cp",))


def cp(method):
    def f(o, l, q, c):
        return pallas_impl.cp_merge_attn_states(o[0], l[0], axis_name="cp", query_start_loc=q, cu_seq_lens=c[0],
                                                method=method, prefill_tokens_with_context=30, **KW)

    return f


def single_device_cp(method):
    """The same program on one device: jax.vmap over the ranks (the collectives' single-device form)."""
    def f(o, l, c):
        return pallas_impl.cp_merge_attn_states(o, l, axis_name="cp", query_start_loc=QN, cu_seq_lens=c,
                                                method=method, prefill_tokens_with_context=30, **KW)

    out, lse = jax.vmap(f, axis_name="cp")(ON, LN, CUN)
    if method == "gather":  # every rank holds the whole merge
        return out[0], lse[0]
    return jnp.concatenate(list(out), axis=1), jnp.concatenate(list(lse), axis=0)  # rank r: heads [2r, 2r + 2)


for method, out_specs in (("gather", (REP, REP)), ("reduce_scatter", (P(None, "cp", None), P("cp", None)))):
    run(f"cp_{method}", cp(method), (ON, LN, QN, CUN), (P("cp"), P("cp"), REP, P("cp")), out_specs,
        single_device_cp(method), MESH_CP)

print(f"{CALLS} shard_map calls on {DEVICES} devices ({os.cpu_count()} CPU cores): same bits as the unsharded calls")
