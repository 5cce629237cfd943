"""Empty-context LSE mask (docs/spec.md 3): the Pallas GPU kernel and its functional, jit-friendly wrapper.

The same algorithm as `triton_impl/mask.py`, statement by statement. Grid: (128-token query blocks, programs
per block). Worst case `T // 128 + R` blocks; request r owns the blocks from `qsl[r] // 128 + r` on. A program
finds its request by counting, 32 request boundaries per step, the requests whose first block is at or before
its block (a compare-and-sum, no token->request map), then, if that request's chunk is empty, writes -inf over
its share of the heads of its tokens (and zeros over its share of their output rows): the second grid axis
deals a block's head (x dim) tiles round-robin over `mla_lse_common.tiles.mask_split` programs. The count is two-level
(`_device._count_keys_le`): chunk starts, then one chunk of 32. The LSE (and output) buffers are aliased to
the results, so under `jax.jit(..., donate_argnames=("lse", "output"))` the update is in place.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from mla_lse_common import tiles
from pallas_impl import _backend
from pallas_impl import _checks as checks
from pallas_impl import _plans as plans
from pallas_impl import _sharding as sharding
from pallas_impl import jnp_fallback
from pallas_impl._backend import pltriton
from pallas_impl._device import _count_keys_le


def _fill_lse(lse_ref, split, num_splits, t0, t_mask, *, num_heads: int, block_h: int, block_t: int,
              lse_layout: str):
    # This program's head tiles: split, split + num_splits, ... Tile starts come from loop indices: Pallas
    # rejects a constant start whose tile overruns the array.
    n_h = pl.cdiv(num_heads, block_h)

    def fill_heads(j, carry):
        h0 = (split + j * num_splits) * block_h
        h = h0 + jnp.arange(block_h, dtype=jnp.int32)
        h_mask = h < num_heads
        if lse_layout == "HT":  # whole-array refs: the layout is the index order
            pltriton.store(lse_ref.at[pl.ds(h0, block_h), pl.ds(t0, block_t)],
                           jnp.full((block_h, block_t), -jnp.inf, jnp.float32),
                           mask=h_mask[:, None] & t_mask[None, :])
        else:
            pltriton.store(lse_ref.at[pl.ds(t0, block_t), pl.ds(h0, block_h)],
                           jnp.full((block_t, block_h), -jnp.inf, jnp.float32),
                           mask=t_mask[:, None] & h_mask[None, :])
        return carry

    lax.fori_loop(0, (n_h - split + num_splits - 1) // num_splits, fill_heads, 0)


def _mask_empty_context_lse_kernel(
    # inputs
    qsl_ref,  # i32[R+1] query_start_loc
    cu_ref,  # i32[R+1] cu_seq_lens of this context chunk
    *refs,  # lse (and output) inputs, aliased to the outputs below; then lse (and output) outputs
    num_requests: int, num_tokens: int, num_heads: int, head_dim: int, block_t: int,
    block_h: int, block_ho: int, block_d: int, lse_layout: str, zero_output: bool, split_blocks: bool,
):
    lse_ref = refs[len(refs) // 2]  # f32[H, T] or f32[T, H]
    out_ref = refs[-1] if zero_output else None  # dtype[T, H, D]
    pid = pl.program_id(0)
    # This program's share of its block's head (x dim) tiles (tiles.mask_split); a variant whose cap is 1
    # never splits.
    split = pl.program_id(1) if split_blocks else 0
    num_splits = pl.num_programs(1) if split_blocks else 1

    # Owning request = (number of requests whose first block is <= pid) - 1; request 0 starts at 0.
    first_programs_le = _count_keys_le(qsl_ref, pid + jnp.zeros((1,), jnp.int32), num_requests,
                                       key_div=block_t, key_step=1)
    req = jnp.sum(first_programs_le, axis=0) - 1

    q_start = qsl_ref[req]
    q_end = qsl_ref[req + 1]
    is_empty = cu_ref[req + 1] == cu_ref[req]
    t0 = (pid - req) * block_t  # = (q_start // block_t + block index within the request) * block_t
    t = t0 + jnp.arange(block_t, dtype=jnp.int32)
    t_mask = (t >= q_start) & (t < q_end)  # also empty for the spare blocks of a request

    # A block wholly inside its request needs no token mask, and when the LSE rows start 16-byte aligned
    # (head stride a multiple of 4; t0 is a multiple of block_t) its -inf stores are 16 bytes wide.
    full = (t0 >= q_start) & (t0 + block_t <= q_end)
    fill = functools.partial(_fill_lse, lse_ref, split, num_splits, t0, num_heads=num_heads, block_h=block_h,
                             block_t=block_t, lse_layout=lse_layout)
    if lse_layout == "HT" and num_tokens % 4 == 0:  # the head stride is T, a static value here
        pl.when(is_empty & full)(lambda: fill(jnp.ones((block_t,), jnp.bool_)))
        pl.when(is_empty & ~full)(lambda: fill(t_mask))
    else:
        pl.when(is_empty)(lambda: fill(t_mask))

    if zero_output:
        @pl.when(is_empty)
        def _():
            # Output tiles (head tile, dim tile), dim fastest; this program's: split, split + num_splits, ...
            n_d = pl.cdiv(head_dim, block_d)
            n_tiles = pl.cdiv(num_heads, block_ho) * n_d

            def zero_tile(j, carry):
                i = split + j * num_splits
                h0 = (i // n_d) * block_ho
                d0 = (i % n_d) * block_d
                ho = h0 + jnp.arange(block_ho, dtype=jnp.int32)
                d = d0 + jnp.arange(block_d, dtype=jnp.int32)
                m = t_mask[:, None, None] & (ho < num_heads)[None, :, None] & (d < head_dim)[None, None, :]
                pltriton.store(out_ref.at[pl.ds(t0, block_t), pl.ds(h0, block_ho), pl.ds(d0, block_d)],
                                 jnp.zeros((block_t, block_ho, block_d), out_ref.dtype), mask=m)
                return carry

            lax.fori_loop(0, (n_tiles - split + num_splits - 1) // num_splits, zero_tile, 0)


@functools.partial(jax.jit, static_argnames=("lse_layout", "interpret"))
def _mask_jit(lse, query_start_loc, cu_seq_lens, output, *, lse_layout, interpret):
    num_requests = query_start_loc.shape[0] - 1
    num_heads, num_tokens = lse.shape if lse_layout == "HT" else lse.shape[::-1]
    zero_output = output is not None
    head_dim = output.shape[2] if zero_output else 1
    block_h, block_ho, block_d = tiles.mask_tiles(num_heads, head_dim)
    kernel = functools.partial(
        _mask_empty_context_lse_kernel, num_requests=num_requests, num_tokens=num_tokens, num_heads=num_heads,
        head_dim=head_dim, block_t=tiles.MASK_BLOCK_T, block_h=block_h,
        block_ho=block_ho, block_d=block_d, lse_layout=lse_layout, zero_output=zero_output,
        split_blocks=tiles.mask_split_cap(zero_output) > 1)
    buffers = (lse, output) if zero_output else (lse,)
    results = pl.pallas_call(
        kernel,
        out_shape=[sharding.out_struct(x.shape, x.dtype, x) for x in buffers],
        grid=tiles.mask_grid(num_tokens, num_requests, num_heads, head_dim, zero_output),
        input_output_aliases={2 + i: i for i in range(len(buffers))},
        interpret=interpret,
        compiler_params=_backend.compiler_params(num_warps=tiles.MASK_NUM_WARPS["pallas"]),
        name="mask_empty_context_lse",
    )(query_start_loc, cu_seq_lens, *buffers)
    return tuple(results)


def mask_empty_context_lse(lse, query_start_loc, cu_seq_lens, output=None, *, has_empty=None,
                           lse_layout="HT", interpret=None, implementation=None, backend=None, validate=False):
    """Set the LSE of every query row of a request with an empty context chunk to -inf (docs/spec.md 3).

    Functional: returns new arrays. Donate the inputs for an in-place update:
    ```
    step = jax.jit(pallas_impl.mask_empty_context_lse, donate_argnames="lse")
    lse = step(lse, query_start_loc, cu_seq_lens)  # the result reuses the donated buffer
    ```

    Args:
      lse: f32[H, T] ([T, H] with lse_layout="TH"), natural log or base 2 (-inf is both).
      query_start_loc: i32[R+1], 0-based, non-decreasing; tokens at or past qsl[R] are padding and untouched
        (padded requests of zero length are normal input). Traced: new values never recompile.
      cu_seq_lens: i32[R+1], this chunk's KV offsets; request r is empty iff cu[r+1] == cu[r].
      output: optional fp32/fp16/bf16[T, H, D]; the empty rows are zeroed.
      has_empty: host guard (a Python bool, never derived from device data). False returns the inputs
        unchanged and launches nothing.
      lse_layout: "HT" (vLLM, FA2) or "TH" (FlashInfer, SGLang, tpu-inference).
      interpret: None interprets on CPU and compiles on GPU.
      implementation: None (Pallas on GPU, jnp elsewhere), "pallas" or "jnp". An explicit choice never
        falls back.
      backend: the Pallas GPU backend of implementation="pallas": None or "triton" (the default), or
        "mosaic_gpu" (experimental, jax >= 0.11; docs/design.md, "Mosaic GPU backend").
      validate: also check the offsets' values on the host (not under jit).

    Returns:
      lse, or (lse, output) when output is given.

    Raises:
      TypeError: an array of the wrong dtype.
      ValueError: wrong rank or shape, offsets of different lengths, an unknown layout; with validate=True,
        offsets not starting at 0, decreasing, or past T.
      NotImplementedError: implementation="pallas" on a platform without Pallas GPU; backend="mosaic_gpu"
        with jax < 0.11, or for a shape its kernel does not take.
    """
    args = (lse, query_start_loc, cu_seq_lens, output)
    plan = plans.cached_plan(_PLANS, _mask_plan, args,
                             (has_empty is False, lse_layout, interpret, implementation, backend), backend)
    if validate:
        checks.check_offset_values(query_start_loc, cu_seq_lens, lse.shape[1 if lse_layout == "HT" else 0])
    _backend.check_compile_target(interpret, implementation, backend, lse)
    return plan(*args)


_PLANS: dict = {}  # plans.cached_plan


def _mask_plan(lse, query_start_loc, cu_seq_lens, output, no_empty, lse_layout, interpret, implementation, backend):
    """The static checks of `mask_empty_context_lse` and its call for arguments of these types (`plans.cached_plan`)."""
    checks.check_lse_layout(lse_layout)
    checks.check_array("lse", lse, ndim=2, dtypes=(jnp.float32,))
    num_requests = checks.check_offsets(query_start_loc, cu_seq_lens)
    num_heads, num_tokens = lse.shape if lse_layout == "HT" else lse.shape[::-1]
    if output is not None:
        checks.check_array("output", output, ndim=3, dtypes=checks.OUTPUT_DTYPES)
        if tuple(output.shape[:2]) != (num_tokens, num_heads):
            raise ValueError(f"output must be [T={num_tokens}, H={num_heads}, D]; got output.shape={tuple(output.shape)}")
    impl = _backend.resolve_implementation(implementation, backend)
    backend = _backend.resolve_backend(backend)
    if no_empty or num_requests == 0 or num_tokens == 0:
        return _unchanged
    if impl == "jnp":
        return functools.partial(jnp_fallback.mask_empty_context_lse, lse_layout=lse_layout)
    interpret = _backend.resolve_interpret(interpret, backend)
    lse_axis = 0 if lse_layout == "HT" else 1
    if backend == "mosaic_gpu":
        from pallas_impl.mosaic.mask import mask_mosaic

        fn = functools.partial(mask_mosaic, lse_layout=lse_layout, interpret=interpret)
    else:
        fn = functools.partial(_mask_jit, lse_layout=lse_layout, interpret=interpret)
    plan = sharding.call_plan(
        fn,
        ("lse", "query_start_loc", "cu_seq_lens", "output"), (lse, query_start_loc, cu_seq_lens, output),
        (lse_axis, None, None, 1), (lse_axis,) if output is None else (lse_axis, 1), interpret=interpret)
    return (lambda *xs: plan(*xs)[0]) if output is None else plan


def _unchanged(lse, query_start_loc, cu_seq_lens, output):
    return lse if output is None else (lse, output)
