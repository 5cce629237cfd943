"""The empty-context LSE mask (docs/spec.md 3) as a Mosaic GPU kernel: `backend="mosaic_gpu"`.

Experimental (docs/design.md, "Mosaic GPU backend"): tested against the reference in jax's Mosaic GPU interpreter
(tests/test_pallas_mosaic.py).

In place: the LSE (and output) enter the kernel as JAX refs, which the kernel call aliases to its results
(input_output_aliases), so under `jax.jit(..., donate_argnames=...)` nothing is copied. Mosaic GPU has no masked
store, so the ragged writes are done differently from the Triton kernel (the semantics are the same, and bit-exact
by construction: the mask does no arithmetic):
- grid (128-token blocks, head groups of `TUNING["mask"]["heads"]` LSE rows, `TUNING["mask_lse"]["heads"]` without
  output zeroing); the last block is shifted to end at T. The requests that intersect the block come from the
  offsets: with fewer than 128 requests by two binary searches over copies in shared memory, up to
  `WINDOW_MAX_REQUESTS` by counting over 128-entry windows of per-thread loads (`_window_bounds`), beyond by two
  scalar binary searches over `query_start_loc` in global memory; a block with no empty request among them writes
  nothing;
- otherwise each of the group's 128-element LSE chunks (a head's row of the block, or with the `[T, H]` layout
  128 consecutive elements of the block's tokens) is rewritten as `where(mask, -inf, lse)` (the token mask built by
  a loop over those requests; per-thread accesses, any alignment; overlapping blocks write the same values);
- the output rows of the block's own empty tokens are zeroed by TMA stores from a zero tile in shared memory, each
  head group its share of the `[H * D]` row (viewed as a `[rows, cols]` TMA box), `TUNING["mask"]["tokens"]`
  tokens per store while a request's run allows, then one by one. A row no such tile holds (H * D * itemsize not a
  multiple of 16 bytes, or over 96 KiB) is zeroed by XLA after the kernel masks the LSE (a pass over the output).
`T < 128` runs on a padded copy. Under `jax.shard_map` with `check_vma`, where refs of varying values cannot enter
a Mosaic GPU kernel, the mask runs in XLA (the jnp path: the same bits).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_impl import _sharding
from pallas_impl import jnp_fallback
from pallas_impl.mosaic import _common as mc

SMEM_ZERO_TILE_BYTES = 96 * 1024  # the zero [H, D] tile must fit in shared memory
WINDOW_MAX_REQUESTS = 1024  # from 128 requests up to this many, the request bounds come from `_window_bounds`


def _searchsorted_right(refs, n, xs, nsteps):
    """For each (ref, x): how many of ref[0:n] (non-decreasing) are <= x. Scalar binary searches of `nsteps` steps,
    run in one loop so that their loads overlap."""
    def body(_, bounds):
        out = []
        for ref, x, (lo, hi) in zip(refs, xs, bounds):
            mid = (lo + hi) // 2
            le = (ref[jnp.minimum(mid, n - 1)] <= x) & (lo < hi)
            out.append((jnp.where(le, mid + 1, lo), jnp.where(le | (lo >= hi), hi, mid)))
        return tuple(out)

    bounds = lax.fori_loop(0, nsteps, body, tuple((jnp.int32(0), jnp.int32(n)) for _ in refs))
    return [lo for lo, _ in bounds]


def _window_bounds(qsl_g, cu_g, n: int, t0, t1):
    """(r_lo, r_hi, any_empty) for n >= BLOCK_T requests: requests r in [r_lo, r_hi) intersect [t0, t1), and any_empty
    says whether one of them is empty. Every offset is read by per-thread loads of 128-entry windows (the last one
    shifted back to end at n; its entries read before are not counted), all issued before the first is used (one
    memory latency against a binary search's chain of dependent scalar loads), then counted by warpgroup sums."""
    bt = mc.BLOCK_T
    iota = lax.broadcasted_iota(jnp.int32, (bt,), 0)
    lo = hi = hit = jnp.zeros((bt,), jnp.int32)
    for w in range(pl.cdiv(n, bt)):
        s = min(w * bt, n - bt)
        q0, q1 = mc.strided_row(qsl_g, s), mc.strided_row(qsl_g, s + 1)  # r = s + lane
        c0, c1 = mc.strided_row(cu_g, s), mc.strided_row(cu_g, s + 1)
        new = s + iota >= w * bt
        lo = lo + jnp.where(new & (q1 <= t0), 1, 0)
        hi = hi + jnp.where(new & (q0 < t1), 1, 0)
        hit = hit + jnp.where(new & (q1 > t0) & (q0 < t1) & (c1 == c0) & (q0 < q1), 1, 0)
    return jnp.sum(lo), jnp.sum(hi), jnp.sum(hit) > 0


def _offsets_to_smem(qsl_g, cu_g, q_s, c_s, bar) -> None:
    """Both offset arrays (`n + 1 < 128` entries) into shared memory: the largest prefix of 16-byte multiples by TMA
    (one memory latency; TMA needs 16-byte sizes), the last entries by scalar loads; then the request search reads
    shared memory (a few cycles per step against a global load's latency)."""
    plgpu = mc.plgpu()
    size = q_s.shape[0]
    bulk = size // 4 * 4
    if bulk:
        plgpu.copy_gmem_to_smem(qsl_g.at[pl.ds(0, bulk)], q_s.at[pl.ds(0, bulk)], bar)
        plgpu.copy_gmem_to_smem(cu_g.at[pl.ds(0, bulk)], c_s.at[pl.ds(0, bulk)], bar)
    for i in range(bulk, size):  # every thread stores the same values, then reads its own stores
        q_s[i] = qsl_g[i]
        c_s[i] = cu_g[i]
    if bulk:
        plgpu.barrier_wait(bar)


def _zero_tile(row_elems: int, itemsize: int) -> tuple[int, int] | None:
    """(rows, cols) of one token's output row `[H * D]` for a single TMA store: cols the largest divisor within a
    TMA box (`MAX_COLS`) of 16-byte multiples; the tile must fit shared memory. None where no such tile exists (a
    row of H * D * itemsize not a multiple of 16 bytes, or over the zero tile's budget): the kernel then masks the
    LSE only and XLA zeroes the output rows (`mask_mosaic`)."""
    if row_elems * itemsize % 16:
        return None
    cols = next(d for d in range(min(row_elems, mc.MAX_COLS), 0, -1) if row_elems % d == 0 and d * itemsize % 16 == 0)
    rows = row_elems // cols
    if rows > mc.MAX_COLS or row_elems * itemsize > SMEM_ZERO_TILE_BYTES:
        return None
    return rows, cols


def _kernel(num_heads: int, num_tokens: int, zero_tile: tuple[int, int, int], num_requests: int, lse_layout: str,
            out_dtype, *, zero_output: bool, interpret: bool):
    """The mask of a flat `[H * T']` LSE (T' >= 128) in place; the output, if any, zeroed in place as
    `[T', rows, cols]` (`zero_tile` = (tokens of one store, rows of one group, cols, rows))."""
    plgpu = mc.plgpu()
    bt = mc.BLOCK_T
    nsteps = max(1, math.ceil(math.log2(num_requests + 2)) + 1)
    tune = mc.TUNING["mask" if zero_output else "mask_lse"]
    per_group = min(tune["heads"], num_heads)
    groups = pl.cdiv(num_heads, per_group)
    k, rpg, cols, rows_total = zero_tile
    in_smem = num_requests < bt and tune["offsets_in_smem"]

    def body(qsl_g, cu_g, *refs):
        if zero_output:
            z_g, lse_g, out_g, z_s, bar, *refs = refs
        else:
            lse_g, *refs = refs
        if in_smem:  # the offsets' copies in shared memory, read in their place from here on
            _offsets_to_smem(qsl_g, cu_g, *refs)
            qsl_g, cu_g = refs[:2]
        b = lax.axis_index("b")
        g = lax.axis_index("g")
        t0 = jnp.minimum(b * bt, num_tokens - bt)
        t1 = t0 + bt
        # Requests r in [r_lo, r_hi) intersect [t0, t1): qsl[r + 1] > t0 and qsl[r] < t1.
        if bt <= num_requests <= WINDOW_MAX_REQUESTS:
            r_lo, r_hi, any_empty = _window_bounds(qsl_g, cu_g, num_requests, t0, t1)
        else:
            r_lo, r_hi = _searchsorted_right([qsl_g.at[pl.ds(1, num_requests)], qsl_g.at[pl.ds(0, num_requests)]],
                                             num_requests, [t0, t1 - 1], nsteps)

            def empty_request(r):
                return (cu_g[r + 1] == cu_g[r]) & (qsl_g[r] < qsl_g[r + 1])

            any_empty = lax.fori_loop(r_lo, r_hi, lambda r, acc: acc | empty_request(r), jnp.bool_(False))
        iota = lax.broadcasted_iota(jnp.int32, (bt,), 0)

        def token_mask(tok):
            def request(r, mask):
                return mask | ((tok >= qsl_g[r]) & (tok < qsl_g[r + 1]) & (cu_g[r + 1] == cu_g[r]))

            return lax.fori_loop(r_lo, r_hi, request, jnp.zeros((bt,), jnp.bool_))

        @pl.when(any_empty)
        def _():
            if zero_output:
                plgpu.copy_gmem_to_smem(z_g, z_s, bar)
            # The group's chunks j (the last group shifted back to end at H: chunks two groups share get the same
            # values from both), every load issued before the first store.
            j0 = jnp.minimum(g * per_group, num_heads - per_group)
            if lse_layout == "HT":  # head j's row of the block
                block_mask = token_mask(t0 + iota)
                chunks = [((j0 + q) * num_tokens + t0, block_mask) for q in range(per_group)]
            else:  # elements [j * 128, (j + 1) * 128) of the block's [128, H] rows
                chunks = [(t0 * num_heads + (j0 + q) * bt, token_mask(t0 + ((j0 + q) * bt + iota) // num_heads))
                          for q in range(per_group)]
            lses = [mc.strided_row(lse_g, start) for start, _ in chunks]
            for (start, mask), lse in zip(chunks, lses):
                lse_g[pl.ds(start, bt)] = jnp.where(mask, -jnp.inf, lse)
            if zero_output:
                plgpu.barrier_wait(bar)
                # This group's rows of the `[rows, cols]` output row (the last group's shifted back to fit).
                row0 = jnp.minimum(g * rpg, rows_total - rpg)
                own0 = b * bt  # tokens of an overlapping block are zeroed by their own block only

                def request(r, carry):
                    @pl.when(cu_g[r + 1] == cu_g[r])
                    def _():
                        lo = jnp.maximum(qsl_g[r], own0)
                        n = jnp.maximum(jnp.minimum(qsl_g[r + 1], t1) - lo, 0)

                        def zero_tokens(i, carry):  # k tokens per store
                            plgpu.copy_smem_to_gmem(z_s, out_g.at[pl.ds(lo + i * k, k), pl.ds(row0, rpg)])
                            return carry

                        def zero_token(t, carry):  # the rest one by one
                            plgpu.copy_smem_to_gmem(z_s.at[0], out_g.at[t, pl.ds(row0, rpg)])
                            return carry

                        lax.fori_loop(0, n // k, zero_tokens, 0)
                        lax.fori_loop(lo + n // k * k, lo + n, zero_token, 0)

                    return carry

                lax.fori_loop(r_lo, r_hi, request, 0)
                plgpu.wait_smem_to_gmem(0)

    scratch = [plgpu.SMEM(zero_tile[:3], out_dtype), plgpu.Barrier()] if zero_output else []
    if in_smem:
        scratch += [plgpu.SMEM((num_requests + 1,), jnp.int32)] * 2 + [plgpu.Barrier(num_arrivals=2)]
    return mc.kernel(body, out_type=(), grid=(pl.cdiv(num_tokens, bt), groups), grid_names=("b", "g"),
                     scratch_types=scratch, interpret=interpret)


def _group_tile(zero_tile: tuple[int, int], num_heads: int, itemsize: int) -> tuple[int, int, int, int]:
    """(tokens of one store, rows of one head group, cols, rows of the whole output row): the `[rows, cols]` output
    row split as many ways as the LSE heads (`TUNING["mask"]["heads"]` per group), at least one row per group;
    up to `TUNING["mask"]["tokens"]` tokens per TMA store within `SMEM_ZERO_TILE_BYTES` of zeros."""
    rows, cols = zero_tile
    groups = pl.cdiv(num_heads, min(mc.TUNING["mask"]["heads"], num_heads))
    rpg = pl.cdiv(rows, min(groups, rows))
    tokens = max(1, min(mc.TUNING["mask"]["tokens"], SMEM_ZERO_TILE_BYTES // (rpg * cols * itemsize)))
    return tokens, rpg, cols, rows


@functools.partial(jax.jit, static_argnames=("lse_layout", "interpret"))
def mask_mosaic(lse, query_start_loc, cu_seq_lens, output, *, lse_layout, interpret):
    """`pallas_impl.mask_empty_context_lse` with backend="mosaic_gpu" (its arguments, checked there)."""
    num_heads, num_tokens = lse.shape if lse_layout == "HT" else lse.shape[::-1]
    num_requests = query_start_loc.shape[0] - 1
    zero_output = output is not None
    if _sharding.varying(lse) or (zero_output and _sharding.varying(output)):  # inside shard_map with check_vma: XLA
        return jnp_fallback.mask_empty_context_lse(lse, query_start_loc, cu_seq_lens, output, lse_layout=lse_layout)
    zero_tile = (1, 1, 1, 1)
    if zero_output:
        itemsize = jnp.dtype(output.dtype).itemsize
        row_tile = _zero_tile(num_heads * output.shape[2], itemsize)
        if row_tile is None:  # rows TMA cannot zero: the LSE in the kernel, the output rows in XLA (one more pass)
            (new,) = mask_mosaic(lse, query_start_loc, cu_seq_lens, None, lse_layout=lse_layout, interpret=interpret)
            empty = jnp_fallback._empty_tokens(query_start_loc, cu_seq_lens, num_tokens)
            return new, jnp.where(empty[:, None, None], jnp.zeros((), output.dtype), output)
        zero_tile = _group_tile(row_tile, num_heads, itemsize)
    tp = max(num_tokens, mc.BLOCK_T)
    pad = tp - num_tokens  # T < 128: a padded copy (rows past T belong to no request: untouched, then cut)
    if pad:
        lse = jnp.pad(lse, ((0, 0), (0, pad)) if lse_layout == "HT" else ((0, pad), (0, 0)))
    lse_ref = jax.new_ref(lse.reshape(-1))
    args = [query_start_loc, cu_seq_lens]
    if zero_output:
        rows = output.reshape(num_tokens, zero_tile[3], zero_tile[2])
        out_ref = jax.new_ref(jnp.pad(rows, ((0, pad), (0, 0), (0, 0))) if pad else rows)
        args += [jnp.zeros(zero_tile[:3], output.dtype), lse_ref, out_ref]
    else:
        args.append(lse_ref)
    _kernel(num_heads, tp, zero_tile, num_requests, lse_layout, output.dtype if zero_output else jnp.float32,
            zero_output=zero_output, interpret=interpret)(*args)
    new = lse_ref[...].reshape((num_heads, tp) if lse_layout == "HT" else (tp, num_heads))
    if pad:
        new = new[:, :num_tokens] if lse_layout == "HT" else new[:num_tokens]
    if not zero_output:
        return (new,)
    return new, out_ref[...][:num_tokens].reshape(output.shape)
