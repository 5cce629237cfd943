"""The Pallas kernels under sharding: result types inside `jax.shard_map`, head-sharded operands of an Explicit
mesh (run per shard), and interpret mode over operands that vary over manual mesh axes."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def out_struct(shape, dtype, *operands) -> jax.ShapeDtypeStruct:
    """The `out_shape` entry of a kernel result. Under `jax.shard_map` with check_vma=True a result must say
    which mesh axes it varies over: those any of `operands` varies over (each element comes from its own
    shard's data). Outside shard_map that set is empty. (jax >= 0.10 names it `manual_axis_type`; older
    releases `vma`.)"""
    avals = [jax.typeof(x) for x in operands if x is not None]
    mats = [getattr(a, "manual_axis_type", None) for a in avals]
    if hasattr(jax.sharding, "ManualAxisType") and all(m is not None for m in mats):
        varying = frozenset().union(*(m.varying for m in mats))
        return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.sharding.ManualAxisType(varying=varying))
    return jax.ShapeDtypeStruct(shape, dtype, vma=frozenset().union(*(getattr(a, "vma", frozenset()) for a in avals)))


def varying(x) -> frozenset:
    """The manual mesh axes `x` varies over (inside `jax.shard_map` with check_vma=True; empty elsewhere)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    return mat.varying if mat is not None else frozenset(getattr(aval, "vma", frozenset()))


def _explicit_head_sharding(names, args, head_axes):
    """(mesh, head axis entry of the PartitionSpec) when the operands carry an Explicit-mode sharding over
    their head axis (`jax.jit` over NamedSharding inputs of an Explicit mesh), else (None, None)."""
    mesh, head = None, None
    for name, x, axis in zip(names, args, head_axes):
        if x is None or not hasattr(x, "shape"):
            continue
        sharding = getattr(jax.typeof(x), "sharding", None)
        spec = tuple(getattr(sharding, "spec", ()) or ())
        if not any(e is not None for e in spec):
            continue
        for d, entry in enumerate(spec):
            if entry is not None and d != axis:
                what = "is replicated by contract" if axis is None else f"may be sharded along its head axis {axis} only"
                raise ValueError(
                    f"{name} is sharded along axis {d} ({name} spec {jax.sharding.PartitionSpec(*spec)}); {name} "
                    f"{what}: the offsets index global tokens, so the kernels shard heads. Reshard it "
                    "(jax.reshard) or call the kernel inside jax.shard_map on local shards")
        entry = spec[axis]
        if head is not None and entry != head:
            raise ValueError(f"the operands shard their heads differently ({name}: {entry!r}, others: {head!r})")
        mesh, head = sharding.mesh, entry
    return mesh, head


def sharded_call(fn, names, args, head_axes, out_head_axes, *, interpret: bool):
    """Run `fn(*args)` (a kernel call; `args` may hold None and Python scalars) as a JAX user shards it.

    - Under `jax.jit` with operands sharded over their head axis on an Explicit mesh (`NamedSharding`), the
      call runs per shard inside `jax.shard_map` over that mesh axis: each shard merges its own heads, which
      gives the unsharded call's bits. Tokens and offsets must be replicated (the offsets index global tokens).
    - Inside `jax.shard_map` (heads sharded by the caller) the kernel runs on the local shard. With
      check_vma=True, the results vary over the axes the operands vary over (`out_struct`); in interpret mode
      see `_local_call`. Compiled kernels run on the local shard as traced.
    `head_axes` gives each operand's head axis (None: replicated); `out_head_axes` the results' (the structure of
    `fn`'s result: an int, or a tuple of ints).
    """
    mesh, head = _explicit_head_sharding(names, args, head_axes)
    if mesh is not None:
        P = jax.sharding.PartitionSpec
        keep = [i for i, x in enumerate(args) if x is not None and hasattr(x, "shape")]

        def spec(ndim, axis):
            return P(*[head if d == axis else None for d in range(ndim)]) if axis is not None else P()

        def local(*xs):
            full = list(args)
            for i, x in zip(keep, xs):
                full[i] = x
            return _local_call(fn, full, interpret)

        in_specs = tuple(spec(jnp.ndim(args[i]), head_axes[i]) for i in keep)
        # The result shapes, traced on unsharded stand-ins (a kernel cannot be traced on sharded refs).
        plain = [jax.ShapeDtypeStruct(x.shape, x.dtype) if i in keep else x for i, x in enumerate(args)]
        out_avals = jax.eval_shape(lambda *xs: fn(*xs), *plain)
        out_specs = jax.tree.map(lambda a, ax: spec(len(a.shape), ax), out_avals, out_head_axes)
        # Interpret mode: this shard_map is ours and each shard's call is local by construction, so it skips the
        # varying-axes types (check_vma=False) and the interpreter runs on the local shard (no gather, see
        # `_local_call`).
        return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=not interpret)(*[args[i] for i in keep])
    return _local_call(fn, list(args), interpret)


def call_plan(fn, names, args, head_axes, out_head_axes, *, interpret: bool):
    """`sharded_call`'s choice for operands of `args`' types, as a callable of the operands: `fn` itself when
    no operand is sharded over its head axis on an Explicit mesh and no interpreted operand varies over manual
    axes (the usual call), else `sharded_call`. Reads only shapes, dtypes and shardings (so the result can be
    cached per signature, `cached_plan`) and raises `sharded_call`'s errors for a bad sharding."""
    mesh, _ = _explicit_head_sharding(names, args, head_axes)
    arrays = [x for x in args if x is not None and hasattr(x, "shape")]
    if mesh is None and not (interpret and any(varying(x) for x in arrays)):
        return (lambda *xs: _interpreted_call(fn, xs)) if interpret else fn
    return lambda *xs: sharded_call(fn, names, xs, head_axes, out_head_axes, interpret=interpret)


def _interpreted_call(fn, args):
    """`fn(*args)` in interpret mode on unsharded operands. Under `jax.sharding.set_mesh` of an Explicit mesh the
    Pallas interpreter's discharged stores fail (jax 0.10-0.11: its padded buffers and the stored values get
    different sharding types), so there the call runs inside a `jax.shard_map` with every operand and result
    replicated: each device computes the unsharded call, its bits. Decided per call (the operands' types are the
    same inside and outside the context, so a plan cannot tell); compiled kernels never take this path."""
    context = jax.sharding.get_abstract_mesh()
    types = context.axis_types
    if context.empty or jax.sharding.AxisType.Explicit not in types or jax.sharding.AxisType.Manual in types:
        return fn(*args)  # no Explicit mesh set, or inside a shard_map already
    keep = [i for i, x in enumerate(args) if x is not None and hasattr(x, "shape")]

    def local(*xs):
        full = list(args)
        for i, x in zip(keep, xs):
            full[i] = x
        return fn(*full)

    P = jax.sharding.PartitionSpec
    return jax.shard_map(local, mesh=context, in_specs=P(), out_specs=P(), check_vma=False)(
        *[args[i] for i in keep])


def _local_call(fn, args, interpret: bool):
    """`fn(*args)` on this shard's operands.

    jax's Pallas interpreter cannot take operands that vary over manual mesh axes under check_vma=True: its
    discharged loads and stores pad every ref with an invariant fill value (`lax.pad`, jax 0.10 and 0.11), and pad
    requires its operands' varying axes to match. No sound cast makes a varying value invariant without a
    collective, so in interpret mode the varying operands are gathered (typed invariant: every device holds every
    shard), the kernel runs on each shard's operands in turn (`lax.map`: the per-shard call, so the unsharded
    call's bits) and each device keeps its own shard's results. Interpret mode (CPU) thus does the work of every
    shard on each device; the compiled kernels (GPU) never take this path. Everything stays one XLA computation
    whose only cross-device step is the gather: no host round trip, nothing waits on another computation. (A host
    callback running the kernel as a second JAX computation deadlocked: each shard held one of the CPU client's
    threads while it waited for a computation that needed one.)
    """
    keep = [i for i, x in enumerate(args) if x is not None and hasattr(x, "shape")]
    axes = frozenset().union(*(varying(args[i]) for i in keep))
    if not (interpret and axes):
        return fn(*args)
    mesh = jax.sharding.get_abstract_mesh()
    axes = tuple(a for a in mesh.axis_names if a in axes)  # mesh order: all_gather's and axis_index's order
    vary = [i for i in keep if varying(args[i])]

    def gather(x):
        missing = tuple(a for a in axes if a not in varying(x))
        x = jax.lax.pcast(x, missing, to="varying") if missing else x
        return jax.lax.all_gather(x, axes, to="invarying")  # [shards, *x.shape]

    def one(xs):
        full = list(args)
        for i, x in zip(vary, xs):
            full[i] = x
        return fn(*full)

    every = jax.lax.map(one, [gather(args[i]) for i in vary])
    me = jax.lax.axis_index(axes)
    return jax.tree.map(
        lambda r: jax.lax.dynamic_index_in_dim(jax.lax.pcast(r, axes, to="varying"), me, keepdims=False), every)


def all_gather_replicated(x, axis_name):
    """`lax.all_gather` typed as invariant over `axis_name` (every device holds the same gathered array), so a
    result computed from it can be declared replicated (`out_specs=P()`) under check_vma=True."""
    try:
        return jax.lax.all_gather(x, axis_name, to="invarying")
    except (TypeError, ValueError, NotImplementedError):  # a jax without typed gathers; vmap's axis names
        return jax.lax.all_gather(x, axis_name)


def out_head_axes(return_lse: bool, lse_axis: int, group) -> tuple | int:
    """The merges' results' head axes (`call_plan`): out, the LSE when returned, the per-group scales (their group
    axis, heads first: 1 row-major, 0 column-major) when quantized per group (docs/spec.md 4.7)."""
    axes = (1,) + ((lse_axis,) if return_lse else ()) + (() if group is None else (1 if group[2] == "row" else 0,))
    return axes if len(axes) > 1 else axes[0]

