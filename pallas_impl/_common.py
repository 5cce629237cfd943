"""Constants, tile choices, backend choice and input checks shared by the Pallas kernels' wrappers.

jax and numpy only: a JAX user installs and runs `pallas_impl` without torch.
"""

from __future__ import annotations

import functools
import math
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_impl._math import FP8_E4M3_MAX, LN2, LOG2E, has_mosaic_gpu  # noqa: F401 (re-exported: c.LN2, ...)

try:
    from jax.experimental.pallas import triton as pltriton
except ImportError:  # a jax without the Pallas Triton backend: backend="mosaic_gpu" only (resolve_backend)
    pltriton = None

# Shared with triton_impl/_common.py (a test asserts they agree).
MASK_BLOCK_T = 128  # query tokens per mask program (docs/spec.md 3)
SCAN = 32  # request boundaries compared per scan step (one warp)
ZERO_TILE_ELEMS = 16384  # elements of one output-zeroing store in the mask
MASK_NUM_WARPS = 8
MASK_TILE_H = 16  # heads per -inf store of the mask
# The mask's second grid axis (docs/design.md, "Mask grid"): each 128-token block's head tiles (LSE) and head x dim
# tiles (output zeroing) are dealt round-robin over `mask_split` programs, a power of two grown until the grid
# holds MASK_TARGET_PROGRAMS programs, capped by the tile count and by the split of the variant.
MASK_TARGET_PROGRAMS = 32768
MASK_ZERO_SPLIT = 64  # most programs per 128-token block when zeroing output rows
MASK_LSE_SPLIT = 4  # most programs per 128-token block for the LSE-only mask (H200 sweep, docs/results.md)
LSE_LAYOUTS = ("HT", "TH")

# Merge launch per variant: (bytes of one input tile per program, fewest tokens per program, warps). "plain": no output
# LSE; "lse": with it; "fused": the fused mask too. Not shared: chosen per framework from the H200 tile sweep in
# docs/results.md (the tile changes which elements a program owns, never an element's arithmetic).
MERGE_TILES = {"plain": (2048, 4, 4), "lse": (4096, 4, 4), "fused": (8192, 8, 4)}
# The N-way merge's launch per variant: (bytes of a program's N input tiles together, fewest tokens, warps).
# Each partial's tile gets total // N bytes (a power of two), within N_TILE_BYTES: a program's loads stay about
# the same as N grows, and never below one 16-byte vector per thread of 4 warps. From the H200 sweep at N = 2, 4, 8
# (docs/results.md, "N-way merge"; `scripts/tune.py merge_n`).
MERGE_N_TILES = {"plain": (16384, 4, 4), "lse": (16384, 4, 4), "fused": (16384, 4, 4)}
N_TILE_BYTES = (2048, 4096)  # (fewest, most) bytes of one partial's tile in the N-way merge
IMPLEMENTATIONS = ("pallas", "jnp")
BACKENDS = ("triton", "mosaic_gpu")  # the Pallas GPU backend of implementation="pallas" (resolve_backend)
BACKEND_ENV = "PALLAS_IMPL_BACKEND"  # the process-wide default of backend=None

OUTPUT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
FP8 = jnp.dtype(jnp.float8_e4m3fn)


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@functools.lru_cache(maxsize=None)
def mask_tiles(num_heads: int, head_dim: int) -> tuple[int, int, int]:
    """(block_h, block_ho, block_d): head tile of the LSE stores, head and dim tiles of output zeroing."""
    block_h = min(next_pow2(num_heads), MASK_TILE_H)
    block_d = min(next_pow2(head_dim), 128)
    block_ho = max(1, min(next_pow2(num_heads), ZERO_TILE_ELEMS // (MASK_BLOCK_T * block_d)))
    return block_h, block_ho, block_d


@functools.lru_cache(maxsize=None)
def merge_tiles(num_heads: int, head_dim: int, variant: str = "plain",
                itemsize: int = 2, num_partials: int = 0) -> tuple[int, int, int]:
    """(block_t, block_h, block_d) of a merge program: the whole (padded) head, the variant's fewest tokens, then
    heads, then more tokens, up to the byte budget of one `itemsize`-byte input tile: `MERGE_TILES` for the 2-way
    merge (num_partials=0), else `partial_tile_bytes` of `MERGE_N_TILES`."""
    if num_partials:
        total, min_block_t, _ = MERGE_N_TILES[variant]
        tile_bytes = partial_tile_bytes(total, num_partials)
    else:
        tile_bytes, min_block_t, _ = MERGE_TILES[variant]
    elems = max(1, tile_bytes // itemsize)
    block_d = next_pow2(head_dim)
    rest = max(1, elems // block_d)
    block_h = min(next_pow2(num_heads), max(1, rest // min_block_t))
    block_t = max(1, rest // block_h)
    return block_t, block_h, block_d


def partial_tile_bytes(total: int, num_partials: int) -> int:
    """Bytes of one partial's tile in an N-way program whose N tiles share `total` bytes: a power of two, within
    `N_TILE_BYTES`."""
    share = 1 << ((total // num_partials).bit_length() - 1)
    return min(max(share, N_TILE_BYTES[0]), N_TILE_BYTES[1])


def merge_num_warps(variant: str, num_partials: int = 0) -> int:
    return (MERGE_N_TILES if num_partials else MERGE_TILES)[variant][2]


def merge_variant(output_lse: bool, fused: bool) -> str:
    return "fused" if fused else "lse" if output_lse else "plain"


def count_keys_le(qsl_ref, x, num_keys: int, *, key_div: int, key_step: int):
    """i32[N]: for each x, how many of key(r) = qsl[r] // key_div + r * key_step, r < num_keys, are <= x.

    Keys are non-decreasing in r. Two levels of 32-wide compare-and-sum: the first key of every 32-key chunk
    (one step covers 1024 keys), then the 32 keys of the chunk holding the last key <= x.
    """
    def coarse_step(i, coarse):
        r = i * SCAN * SCAN + jnp.arange(SCAN, dtype=jnp.int32) * SCAN
        key = qsl_ref[jnp.minimum(r, num_keys - 1)] // key_div + r * key_step
        return coarse + jnp.sum(((r < num_keys)[None, :] & (key[None, :] <= x[:, None])).astype(jnp.int32), axis=1)

    coarse = jax.lax.fori_loop(0, pl.cdiv(num_keys, SCAN * SCAN), coarse_step, jnp.zeros_like(x))
    base = (coarse - 1) * SCAN  # key(0) <= x always: coarse >= 1
    r = base[:, None] + jnp.arange(SCAN, dtype=jnp.int32)[None, :]
    key = qsl_ref[jnp.minimum(r, num_keys - 1)] // key_div + r * key_step
    return base + jnp.sum(((r < num_keys) & (key <= x[:, None])).astype(jnp.int32), axis=1)


def mask_blocks(num_tokens: int, num_requests: int) -> int:
    # Worst case: each request may open a partial block -> T // BLOCK_T + R token blocks.
    return num_tokens // MASK_BLOCK_T + num_requests


@functools.lru_cache(maxsize=None)
def mask_split(num_tokens: int, num_requests: int, num_heads: int, head_dim: int, zero_output: bool) -> int:
    """Programs per 128-token block (the mask grid's second axis); static shapes only, never offsets' values."""
    block_h, block_ho, block_d = mask_tiles(num_heads, head_dim)
    tiles = -(-num_heads // block_ho) * -(-head_dim // block_d) if zero_output else -(-num_heads // block_h)
    want = next_pow2(-(-MASK_TARGET_PROGRAMS // max(1, mask_blocks(num_tokens, num_requests))))
    return max(1, min(tiles, mask_split_cap(zero_output), want))


def mask_split_cap(zero_output: bool) -> int:
    """The most programs per block of the variant; 1: its kernel never reads the second grid axis."""
    return MASK_ZERO_SPLIT if zero_output else MASK_LSE_SPLIT


def mask_grid(num_tokens: int, num_requests: int, num_heads: int, head_dim: int,
              zero_output: bool) -> tuple[int, int]:
    """(token blocks, programs per block): the second axis splits a block's stores (`mask_split`)."""
    return (mask_blocks(num_tokens, num_requests),
            mask_split(num_tokens, num_requests, num_heads, head_dim, zero_output))


def merge_grid(num_tokens: int, num_heads: int, head_dim: int, variant: str = "plain",
               itemsize: int = 2, num_partials: int = 0) -> tuple[int]:
    # One axis (no 65535 limit), head blocks fastest: program = token block * head blocks + head block.
    block_t, block_h, _ = merge_tiles(num_heads, head_dim, variant, itemsize, num_partials)
    return (pl.cdiv(num_tokens, block_t) * pl.cdiv(num_heads, block_h),)


# jax 0.11 warns at every lowering of a Triton-backend pallas_call (docs/design.md: the Mosaic GPU plan).
TRITON_DEPRECATION = r"The Pallas Triton backend is deprecated and will be removed in a future JAX version\."


@functools.cache
def filter_triton_deprecation() -> None:
    """Ignore exactly that message, as a DeprecationWarning, once our kernels are first used.

    The warning fires when the enclosing jit compiles, possibly after our call has returned, so a
    `catch_warnings` block around the call cannot hold it: the filter is process-wide and this narrow.
    """
    warnings.filterwarnings("ignore", message=TRITON_DEPRECATION, category=DeprecationWarning)


def compiler_params(num_warps: int):
    """Pins the Pallas Triton lowering (docs/spec.md 6); see docs/design.md for the move to Mosaic GPU."""
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=1)


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
        return fn
    return lambda *xs: sharded_call(fn, names, xs, head_axes, out_head_axes, interpret=interpret)


class _Uncached(Exception):
    """An argument that `_arg_key` does not key (a NumPy array, a list, ...): that call checks everything."""


_Tracer = jax.core.Tracer
_SingleDevice = jax.sharding.SingleDeviceSharding


def _arg_key(x):
    """A hashable stand-in of everything the static checks read of one argument: a jax.Array's shape, dtype,
    weak type and sharding (a tracer's aval also holds its varying manual axes; a single-device sharding reads
    as None: no head axis to shard), None, or the Python int type."""
    if x is None:
        return None
    if isinstance(x, _Tracer):
        return jax.typeof(x)
    if isinstance(x, jax.Array):
        sharding = x.sharding
        return x.aval, None if type(sharding) is _SingleDevice else sharding
    if type(x) is int:
        return int
    raise _Uncached


PLAN_CACHE_SIZE = 4096  # plans kept per entry point; a full cache starts over


def cached_plan(cache: dict, build, args: tuple, options: tuple, backend):
    """`build(*args, *options)`, a callable of the operands that runs the call (every static check passed), computed
    once per signature: the arguments' `_arg_key`s, `options` (the wrapper's static arguments) and, for
    backend=None, the `BACKEND_ENV` it resolves through. An unkeyed argument or option builds every time (and raises
    every time for bad input). Value checks (validate=True) are not part of a plan. docs/design.md, "Per-call cost
    (JAX)"."""
    try:
        key = (options, os.environ.get(BACKEND_ENV) if backend is None else None, tuple(map(_arg_key, args)))
        plan = cache.get(key)
    except (_Uncached, TypeError):  # TypeError: an unhashable option, refused by `build`'s checks
        return build(*args, *options)
    if plan is None:
        plan = build(*args, *options)
        if len(cache) >= PLAN_CACHE_SIZE:
            cache.clear()
        cache[key] = plan
    return plan


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


def resolve_interpret(interpret: bool | None, backend: str = "triton") -> bool:
    """None: interpret on CPU, compile on GPU. backend="mosaic_gpu" needs jax >= 0.11 either way (its interpret
    mode is jax's Mosaic GPU interpreter)."""
    if backend == "mosaic_gpu" and not has_mosaic_gpu():
        raise NotImplementedError(f"backend='mosaic_gpu' needs jax >= 0.11 (its layout inference and plgpu.kernel "
                                  f"API); this is jax {jax.__version__}: use backend='triton'")
    if interpret is None:
        return jax.default_backend() == "cpu"
    return bool(interpret)


def resolve_backend(backend: str | None) -> str:
    """The Pallas GPU backend. None: the environment's `PALLAS_IMPL_BACKEND` if set, else "triton" while jax has
    the Pallas Triton backend and "mosaic_gpu" once it is gone (experimental; docs/design.md, "Mosaic GPU
    backend")."""
    if backend is None:
        backend = os.environ.get(BACKEND_ENV) or ("triton" if pltriton is not None else "mosaic_gpu")
        if backend not in BACKENDS:
            raise ValueError(f"{BACKEND_ENV} must be one of {BACKENDS} or unset, got {backend!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    if backend == "triton" and pltriton is None:
        raise NotImplementedError(f"backend='triton': this jax ({jax.__version__}) has no Pallas Triton backend "
                                  "(jax.experimental.pallas.triton): use backend='mosaic_gpu' or None")
    return backend


def resolve_implementation(implementation: str | None, backend: str | None = None) -> str:
    """None: the Pallas kernel on GPU, the jnp path elsewhere; with an explicit backend="mosaic_gpu" (the
    caller's argument, not the environment's default), the Pallas kernel. An explicit choice never falls back."""
    platform = jax.default_backend()
    if backend is not None:
        resolve_backend(backend)  # an unknown name is refused first
    if backend == "mosaic_gpu":
        if implementation == "jnp":
            raise ValueError("backend='mosaic_gpu' selects a Pallas kernel; it does not go with implementation='jnp'")
        implementation = "pallas"
    if implementation is None:
        return "pallas" if platform == "gpu" else "jnp"
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} or None, got {implementation!r}")
    if implementation == "pallas" and platform not in ("gpu", "cpu"):
        raise NotImplementedError(
            f"the Pallas kernels target GPUs (and the CPU interpreter); the platform is {platform!r}: "
            "use implementation='jnp'")
    return implementation


def has_empty_context(chunk_seq_lens) -> bool:
    """Host guard for the mask: does any request have 0 KV tokens in this chunk?

    Args:
      chunk_seq_lens: host data (a sequence or a numpy array), as serving stacks keep it before the upload.

    Raises:
      ValueError: for a jax.Array, since reading it would synchronise the device (or fail under jit).
    """
    if isinstance(chunk_seq_lens, jax.Array):
        raise ValueError("has_empty_context needs host data; got a jax.Array (reading it would synchronise "
                         "the device, and fails under jit): pass the host copy")
    return bool((np.asarray(chunk_seq_lens) == 0).any())


# ---------------------------------------------------------------------------------------------------------
# Input checks. The always-on tier reads shapes and dtypes only, so under jax.jit it runs at trace time.


def check_lse_layout(lse_layout: str) -> None:
    if lse_layout not in LSE_LAYOUTS:
        raise ValueError(f"lse_layout must be one of {LSE_LAYOUTS}, got {lse_layout!r}")


def check_lse_base(lse_base) -> bool:
    """Returns True for base 2."""
    if lse_base == 2:
        return True
    if lse_base == math.e:
        return False
    raise ValueError(f"lse_base must be math.e or 2, got {lse_base!r}")


def check_array(name: str, x, *, ndim: int, dtypes) -> None:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if x.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got {name}.shape={tuple(x.shape)}")
    if jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in dtypes]:
        names = ", ".join(jnp.dtype(d).name for d in dtypes)
        raise TypeError(f"{name} must be {names}; got {name}.dtype={jnp.dtype(x.dtype).name}")


def check_lse_shape(name: str, lse, lse_layout: str, num_heads: int, num_tokens: int, *,
                    num_partials: int | None = None) -> None:
    """[H, T] or [T, H] by `lse_layout`; with `num_partials`, the same stacked: [N, H, T] or [N, T, H]."""
    want = (num_heads, num_tokens) if lse_layout == "HT" else (num_tokens, num_heads)
    if num_partials is not None:
        want = (num_partials,) + want
    if tuple(lse.shape) != want:
        raise ValueError(
            f"{name} must be f32{list(want)} for lse_layout={lse_layout!r}; got {name}.shape={tuple(lse.shape)}")


def check_offsets(query_start_loc, cu_seq_lens, *, cu_name="cu_seq_lens") -> int:
    """Shape and dtype checks of the two offset arrays; returns R."""
    check_array("query_start_loc", query_start_loc, ndim=1, dtypes=(jnp.int32,))
    check_array(cu_name, cu_seq_lens, ndim=1, dtypes=(jnp.int32,))
    if query_start_loc.shape[0] < 1:
        raise ValueError("query_start_loc must have R+1 >= 1 entries, got an empty array")
    if cu_seq_lens.shape != query_start_loc.shape:
        raise ValueError(
            f"query_start_loc and {cu_name} must both be i32[R+1]; got "
            f"query_start_loc.shape={tuple(query_start_loc.shape)}, {cu_name}.shape={tuple(cu_seq_lens.shape)}")
    return query_start_loc.shape[0] - 1


def _concrete(name: str, x):
    if isinstance(x, jax.core.Tracer):
        raise ValueError(f"validate=True reads {name}'s values on the host and cannot run under jax.jit; "
                         "validate outside jit, or pass validate=False")
    return np.asarray(x)


def check_offset_values(query_start_loc, cu_seq_lens, num_tokens: int, *, cu_name="cu_seq_lens") -> None:
    """validate=True tier: reads the offsets on the host (a device sync; not under jit). `cu_seq_lens` may be
    i32[N, R+1] (one row per partial)."""
    cu = _concrete(cu_name, cu_seq_lens)
    rows = [(cu_name, cu)] if cu.ndim == 1 else [(f"{cu_name}[{i}]", cu[i]) for i in range(cu.shape[0])]
    for name, x in [("query_start_loc", query_start_loc)] + rows:
        v = _concrete(name, x).astype(np.int64)
        if v[0] != 0:
            raise ValueError(f"{name}[0] must be 0, got {v[0]}")
        bad = np.nonzero(v[1:] < v[:-1])[0]
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"{name} must be non-decreasing; {name}[{i}]={v[i]} > {name}[{i + 1}]={v[i + 1]}")
    last = int(_concrete("query_start_loc", query_start_loc)[-1])
    if last > num_tokens:
        raise ValueError(f"query_start_loc[R]={last} is past the token count T={num_tokens}")


def check_out_dtype(out_dtype, in_dtype, output_scale):
    """The merge's output dtype (None: the inputs'; any of OUTPUT_DTYPES or fp8 whatever the inputs' dtype, docs/spec.md
    4.3), checked against the fp8 scale; returns it as a dtype."""
    out_dtype = jnp.dtype(in_dtype if out_dtype is None else out_dtype)
    if out_dtype not in tuple(map(jnp.dtype, OUTPUT_DTYPES)) + (FP8,):
        raise TypeError(f"out_dtype must be None (the inputs' dtype {jnp.dtype(in_dtype).name}), float32, float16, "
                        f"bfloat16 or float8_e4m3fn; got {out_dtype.name}")
    fp8 = out_dtype == FP8
    if fp8 != (output_scale is not None):
        raise ValueError("output_scale is required for a float8_e4m3fn output and only for it; got "
                         f"out_dtype={out_dtype.name}, output_scale={'given' if output_scale is not None else None}")
    if fp8 and (getattr(output_scale, "dtype", None) != jnp.float32 or getattr(output_scale, "size", 0) != 1):
        raise TypeError(f"output_scale must be an f32 scalar or f32[1] array; got {output_scale!r}")
    return out_dtype


def check_prefill_tokens(prefill_tokens_with_context, num_tokens: int, validate: bool) -> None:
    """None, a Python int or an integer scalar array (traced or not); no device work here."""
    x = prefill_tokens_with_context
    if x is None:
        return
    if isinstance(x, bool) or not (isinstance(x, int) or (hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.integer)
                                                          and getattr(x, "ndim", None) == 0)):
        raise TypeError(f"prefill_tokens_with_context must be an integer scalar; got {x!r}")
    if validate:
        v = int(_concrete("prefill_tokens_with_context", x))
        if not 0 <= v <= num_tokens:
            raise ValueError(f"prefill_tokens_with_context={v} must be in [0, T={num_tokens}]")


def prefill_tokens_array(prefill_tokens_with_context, num_tokens: int):
    """i32[1] for the kernels (inside jit): None means T; values are clamped to [0, T]."""
    if prefill_tokens_with_context is None:
        return jnp.full((1,), num_tokens, jnp.int32)
    x = jnp.asarray(prefill_tokens_with_context).astype(jnp.int32)
    return jnp.clip(x, 0, num_tokens).reshape(1)
