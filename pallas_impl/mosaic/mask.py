"""The empty-context LSE mask (docs/spec.md 3) as a Mosaic GPU kernel: `backend="mosaic_gpu"`.

Experimental (docs/design.md, "Mosaic GPU backend"): with jax 0.11.2 on a CPU, lowered for the GPU and run in jax's
Mosaic GPU interpreter against the reference on every ci case (tests/test_pallas_mosaic.py); not yet run on a
GPU at this commit.

Mosaic GPU has no masked store, so the ragged writes are done differently from the Triton kernel (the semantics
are the same, and bit-exact by construction: the mask does no arithmetic):
- one CTA per 128-token block (the last shifted to end at T); two scalar binary searches over
  `query_start_loc` find the requests that intersect the block, a loop over them builds the block's token
  mask (a request empty in this chunk: `cu[r+1] == cu[r]`), and each head's LSE row of the block is rewritten
  whole into the new LSE: `where(mask, -inf, lse)` (every token is in some block; shifted blocks that overlap
  write the same values; per-thread accesses, any alignment);
- an empty request's output rows are zeroed by one TMA store per token row (the `[H * D]` row viewed as a
  `[rows, cols]` TMA box) from a zero tile in shared memory.
The output is updated in place through a JAX ref (donate it for no copy); under `jax.shard_map` with
`check_vma`, where such refs cannot enter the kernel, its rows are zeroed by XLA.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_impl import _common as c
from pallas_impl import jnp_fallback
from pallas_impl.mosaic import _common as mc

SMEM_ZERO_TILE_BYTES = 96 * 1024  # the zero [H, D] tile must fit in shared memory


def _searchsorted_right(ref, n, x, nsteps):
    """How many of ref[0:n] (non-decreasing) are <= x: a scalar binary search of `nsteps` steps."""
    def body(_, lohi):
        lo, hi = lohi
        mid = (lo + hi) // 2
        le = (ref[jnp.minimum(mid, n - 1)] <= x) & (lo < hi)
        return jnp.where(le, mid + 1, lo), jnp.where(le | (lo >= hi), hi, mid)

    lo, _ = lax.fori_loop(0, nsteps, body, (jnp.int32(0), jnp.int32(n)))
    return lo


def _zero_tile(row_elems: int, itemsize: int) -> tuple[int, int]:
    """(rows, cols) of one token's output row `[H * D]` for a single TMA store: cols the largest divisor within a
    TMA box (`MAX_COLS`) of 16-byte multiples; the tile must fit shared memory."""
    if row_elems * itemsize % 16:
        raise NotImplementedError(f"backend='mosaic_gpu' zeroes output rows with TMA stores, which need H * D * "
                                  f"itemsize to be a multiple of 16 bytes; got {row_elems} x {itemsize}: use "
                                  "backend='triton'")
    cols = next(d for d in range(min(row_elems, mc.MAX_COLS), 0, -1) if row_elems % d == 0 and d * itemsize % 16 == 0)
    rows = row_elems // cols
    if rows > mc.MAX_COLS or row_elems * itemsize > SMEM_ZERO_TILE_BYTES:
        raise NotImplementedError(f"backend='mosaic_gpu' zeroes an output row [H * D = {row_elems}] from one tile in "
                                  f"shared memory (at most {SMEM_ZERO_TILE_BYTES} bytes, {mc.MAX_COLS} x "
                                  f"{mc.MAX_COLS}): use backend='triton'")
    return rows, cols


def _kernel(num_heads: int, num_tokens: int, zero_tile: tuple[int, int], num_requests: int, out_dtype, out_type, *,
            zero_output: bool, interpret: bool):
    """The mask of a padded `[H, T']` LSE (T' >= 128) into a new one; the output, if any, zeroed in place as
    `[T', rows, cols]` (`zero_tile`)."""
    plgpu = mc.plgpu()
    bt = mc.BLOCK_T
    nsteps = max(1, math.ceil(math.log2(num_requests + 2)) + 1)

    def body(qsl_g, cu_g, lse_g, *refs):
        if zero_output:
            z_g, out_g, new_g, z_s, bar = refs
        else:
            new_g, = refs
        i = lax.axis_index("i")
        t0 = jnp.minimum(i * bt, num_tokens - bt)
        t1 = t0 + bt
        # Requests r in [r_lo, r_hi) intersect [t0, t1): qsl[r + 1] > t0 and qsl[r] < t1.
        r_lo = _searchsorted_right(qsl_g.at[pl.ds(1, num_requests)], num_requests, t0, nsteps)
        r_hi = _searchsorted_right(qsl_g.at[pl.ds(0, num_requests)], num_requests, t1 - 1, nsteps)
        if zero_output:
            plgpu.copy_gmem_to_smem(z_g, z_s, bar)
            plgpu.barrier_wait(bar)
        tok = t0 + lax.broadcasted_iota(jnp.int32, (bt,), 0)

        def request(r, mask):
            a, b = qsl_g[r], qsl_g[r + 1]
            empty = cu_g[r + 1] == cu_g[r]
            if zero_output:
                @pl.when(empty)
                def _():
                    def zero_row(t, carry):
                        plgpu.copy_smem_to_gmem(z_s, out_g.at[t])
                        return carry

                    lax.fori_loop(jnp.maximum(a, t0), jnp.minimum(b, t1), zero_row, 0)

            return mask | ((tok >= a) & (tok < b) & empty)

        mask = lax.fori_loop(r_lo, r_hi, request, jnp.zeros((bt,), jnp.bool_))

        def head(h, carry):
            new_g[h, pl.ds(t0, bt)] = jnp.where(mask, -jnp.inf, lse_g[h, pl.ds(t0, bt)])
            return carry

        lax.fori_loop(0, num_heads, head, 0)
        if zero_output:
            plgpu.wait_smem_to_gmem(0)

    scratch = [plgpu.SMEM(zero_tile, out_dtype), plgpu.Barrier()] if zero_output else []
    return mc.kernel(body, out_type=out_type, grid=(pl.cdiv(num_tokens, bt),), grid_names=("i",),
                     scratch_types=scratch, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("lse_layout", "interpret"))
def mask_mosaic(lse, query_start_loc, cu_seq_lens, output, *, lse_layout, interpret):
    """`pallas_impl.mask_empty_context_lse` with backend="mosaic_gpu" (its arguments, checked there)."""
    ht = lse if lse_layout == "HT" else lse.T
    num_heads, num_tokens = ht.shape
    num_requests = query_start_loc.shape[0] - 1
    zero_output = output is not None
    zero_tile = (1, 1)
    if zero_output:
        zero_tile = _zero_tile(num_heads * output.shape[2], jnp.dtype(output.dtype).itemsize)
    tp = max(num_tokens, mc.BLOCK_T)
    pad = tp - num_tokens  # rows past T belong to no request: untouched, then sliced away
    ht = jnp.pad(ht, ((0, 0), (0, pad))) if pad else ht
    # The output is zeroed in place through a JAX ref (donate it for no copy). Refs of values that vary over a
    # shard_map axis cannot enter a Mosaic GPU kernel: there the rows are zeroed by XLA (the same zeros).
    in_kernel = zero_output and not c.varying(output)
    args = [query_start_loc, cu_seq_lens, ht]
    if in_kernel:
        rows = output.reshape(num_tokens, *zero_tile)
        out_ref = jax.new_ref(jnp.pad(rows, ((0, pad), (0, 0), (0, 0))) if pad else rows)
        args += [jnp.zeros(zero_tile, output.dtype), out_ref]
    new = _kernel(num_heads, tp, zero_tile, num_requests, output.dtype if in_kernel else jnp.float32,
                  c.out_struct((num_heads, tp), jnp.float32, ht), zero_output=in_kernel, interpret=interpret)(*args)
    new = new[:, :num_tokens]
    new = new if lse_layout == "HT" else new.T
    if not zero_output:
        return (new,)
    if in_kernel:
        return new, out_ref[...][:num_tokens].reshape(output.shape)
    empty = jnp_fallback._empty_tokens(query_start_loc, cu_seq_lens, num_tokens)
    return new, jnp.where(empty[:, None, None], jnp.zeros((), output.dtype), output)
