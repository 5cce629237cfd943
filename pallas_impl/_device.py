"""The device helpers that several Pallas (Triton-backend) kernels share.

The request search (`_count_keys_le`, the two-level 32-wide compare-and-sum of the mask and the fused merges), LSE
tiles of either layout, a merge program's tile (`_program_tile`), the fused mask's token requests, the store of a
merged tile and of its LSE (2-way, N-way and the context-parallel rescale), and the N-way merge's LSE tiles and
weights (`_max_and_sum`). `triton_impl/_device.py` holds the same helpers under the same names, statement by
statement; the element math of the N-way maximum and sum is `_math.n_way_max_and_sum` here, which both Pallas
backends share. A helper used by one kernel only stays in that kernel's file.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from mla_lse_common import tiles
from mla_lse_common.tiles import SCAN
from pallas_impl import _math
from pallas_impl._backend import pltriton


def _count_keys_le(qsl_ref, x, num_keys: int, *, key_div: int, key_step: int):
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


def _lse_index(t0, h0, block_t, block_h, lse_layout, lead=()):
    """The indexer of an LSE tile, in [block_t, block_h] order whatever the layout (whole-array refs: layout =
    index order); `lead` indexes leading axes first (the partial of stacked LSEs). An [H, T] tile is addressed
    through index arrays rather than loaded as [block_h, block_t] and transposed: the transpose cost shared-memory
    round trips in the fused merges (docs/design.md, "LSE tiles in either layout")."""
    if lse_layout == "HT":
        t = (t0 + jnp.arange(block_t, dtype=jnp.int32))[:, None]
        h = (h0 + jnp.arange(block_h, dtype=jnp.int32))[None, :]
        return (*lead, h, t)
    return (*lead, pl.ds(t0, block_t), pl.ds(h0, block_h))


def _load_lse(ref, t0, h0, block_t, block_h, th_mask, lse_layout, lead=(), other=-jnp.inf):
    """f32[block_t, block_h] tile of an LSE of either layout (`other` where th_mask is false)."""
    return pltriton.load(ref.at[_lse_index(t0, h0, block_t, block_h, lse_layout, lead)], mask=th_mask,
                           other=other)


def _store_lse(ref, t0, h0, block_t, block_h, value, th_mask, lse_layout, lead=()):
    pltriton.store(ref.at[_lse_index(t0, h0, block_t, block_h, lse_layout, lead)], value, mask=th_mask)


def _program_tile(num_tokens, num_heads, head_dim, block_t, block_h, block_d):
    """This program's [block_t, block_h, block_d] tile, head blocks fastest (consecutive programs sweep the
    [T, H, D] buffers front to back): its first token t0 and head h0, its tokens t, and the masks."""
    num_h_blocks = pl.cdiv(num_heads, block_h)
    pid = pl.program_id(0)
    t0 = (pid // num_h_blocks) * block_t
    h0 = (pid % num_h_blocks) * block_h
    t = t0 + jnp.arange(block_t, dtype=jnp.int32)
    h = h0 + jnp.arange(block_h, dtype=jnp.int32)
    d = jnp.arange(block_d, dtype=jnp.int32)
    t_mask = t < num_tokens
    th_mask = t_mask[:, None] & (h < num_heads)[None, :]
    thd_mask = th_mask[:, :, None] & (d < head_dim)[None, None, :]
    return t0, h0, t, t_mask, th_mask, thd_mask


def _token_requests(qsl_ref, t, t_mask, num_requests, fused_mask):
    """(req, in_req) of the fused mask: each token's request (clamped to R - 1) and whether it is in one."""
    req = t  # placeholders unless fused_mask
    in_req = t_mask
    if fused_mask:
        req = _count_keys_le(qsl_ref, t, num_requests + 1, key_div=1, key_step=0) - 1  # R: padding
        in_req = t_mask & (req < num_requests)
        req = jnp.minimum(req, num_requests - 1)
    return req, in_req


def _store_output(out_block, out, last, copy_t, scale_ref, thd_mask, fp8_out):
    """The merged f32 tile `out` to `out_block` (docs/spec.md 4.4, 4.6): pass-through tokens take `last` (the
    suffix, or the last partial) bit for bit where the output has its dtype, else rounded once to the output dtype
    (through the scale and clamp of a merged row for fp8)."""
    if fp8_out:
        out = jnp.where(copy_t[:, None, None], last.astype(jnp.float32), out)
        pltriton.store(out_block, _math.static_fp8(out, scale_ref[0]).astype(out_block.dtype), mask=thd_mask)
    elif last.dtype == out_block.dtype:
        pltriton.store(out_block, jnp.where(copy_t[:, None, None], last, out.astype(out_block.dtype)), mask=thd_mask)
    else:  # 4.4: another output dtype: the copied row, as f32, takes the one rounding of a merged row
        out = jnp.where(copy_t[:, None, None], last.astype(jnp.float32), out)
        pltriton.store(out_block, out.astype(out_block.dtype), mask=thd_mask)


def _store_group_fp8(out_block, scale_ref, t0, h0, out, last, copy_t, th_mask, thd_mask, group_size, ue8m0):
    """The merged f32 tile `out` [block_t, block_h, D] (D a power of two: the whole head) quantized per group of
    `group_size` elements of a head row (docs/spec.md 4.7) to `out_block` (fp8), its scales to this tile's block of
    `scale_ref` f32[T, H * D / G]: pass-through tokens take `last` as f32 (4.4), quantized like any other row."""
    out = jnp.where(copy_t[:, None, None], last.astype(jnp.float32), out)
    q, scale = _math.group_quant(out, group_size, ue8m0)
    pltriton.store(out_block, q.astype(out_block.dtype), mask=thd_mask)
    block_t, block_h, groups = scale.shape
    g_mask = jnp.broadcast_to(th_mask[:, :, None], scale.shape).reshape(block_t, block_h * groups)
    pltriton.store(scale_ref.at[pl.ds(t0, block_t), pl.ds(h0 * groups, block_h * groups)],
                   scale.reshape(block_t, block_h * groups), mask=g_mask)


def _store_nvfp4(out_ref, scale_ref, t0, h0, out, last, copy_t, th_mask, global_scale):
    """The merged f32 tile `out` [block_t, block_h, D] (D a power of two from 16: the whole head) quantized to NVFP4
    (docs/spec.md 4.8) with the f32 `global_scale`: two e2m1 codes a byte to this tile's block of `out_ref` u8[T, H,
    D / 2], its e4m3 block scales to `scale_ref` [T, H * D / 16]; pass-through tokens take `last` as f32 (4.4),
    quantized like any other row."""
    out = jnp.where(copy_t[:, None, None], last.astype(jnp.float32), out)
    codes, scales = _math.nvfp4_quant(out, global_scale)
    packed = _math.pack_fp4(codes)
    block_t, block_h, half = packed.shape
    pltriton.store(out_ref.at[pl.ds(t0, block_t), pl.ds(h0, block_h), pl.ds(0, half)], packed,
                   mask=jnp.broadcast_to(th_mask[:, :, None], packed.shape))
    blocks = scales.shape[-1]
    s_mask = jnp.broadcast_to(th_mask[:, :, None], scales.shape).reshape(block_t, block_h * blocks)
    pltriton.store(scale_ref.at[pl.ds(t0, block_t), pl.ds(h0 * blocks, block_h * blocks)],
                   scales.reshape(block_t, block_h * blocks), mask=s_mask)


def _merged_lse(z, m, empty, copy_t, passthrough, lse_base2):
    """The merge's LSE tile (docs/spec.md 4.2, 4.3, 4.4, 8.4), in the LSEs' base (`_math.merged_lse`)."""
    return jnp.where(copy_t[:, None], passthrough, _math.merged_lse(z, m, empty, lse_base2))


def _empty_tokens(cu_ref, i, cu_row, req, in_req):
    """bool[block_t]: the tokens of requests with no KV in partial i (8.1)."""
    base = i * cu_row  # cu_seq_lens is flattened: partial i's offsets start at i * (R + 1)
    return in_req & (cu_ref[base + req + 1] == cu_ref[base + req])


def _partial_lse(lses_ref, i, t0, h0, block_t, block_h, th_mask, cu_ref, cu_row, req, in_req, *, lse_layout,
                 fused_mask):
    """f32[block_t, block_h]: partial i's LSE tile (i a Python int or a traced loop index) in the LSEs' base, empty
    rows -inf (8.1)."""
    lse = _math.clean_lse(_load_lse(lses_ref, t0, h0, block_t, block_h, th_mask, lse_layout,
                                    lead=(jnp.asarray(i, jnp.int32),)))  # 4.1
    if fused_mask:  # 8.1: a token of a request with no KV in this partial has LSE -inf
        lse = jnp.where(_empty_tokens(cu_ref, i, cu_row, req, in_req)[:, None], -jnp.inf, lse)
    return lse


def _partial_lse_chunk(lses_ref, first, chunk, num_partials, t0, h0, block_t, block_h, th_mask, cu_ref, cu_row, req,
                       in_req, *, lse_layout, fused_mask):
    """f32[chunk, block_t, block_h]: the LSE tiles of partials first, first + 1, ... in one load, as `_partial_lse`
    each; partials past N read as -inf (the Triton kernels' `_chunk_max`)."""
    i = first + jnp.arange(chunk, dtype=jnp.int32)
    live = i < num_partials
    i = jnp.minimum(i, num_partials - 1)
    t = (t0 + jnp.arange(block_t, dtype=jnp.int32))[None, :, None]
    h = (h0 + jnp.arange(block_h, dtype=jnp.int32))[None, None, :]
    index = (i[:, None, None], h, t) if lse_layout == "HT" else (i[:, None, None], t, h)
    lse = _math.clean_lse(pltriton.load(lses_ref.at[index], mask=live[:, None, None] & th_mask[None, :, :],
                                        other=-jnp.inf))  # 4.1
    if fused_mask:  # 8.1, for each partial of the chunk
        lse = jnp.where(_empty_tokens(cu_ref, i[:, None], cu_row, req[None, :], in_req[None, :])[:, :, None], -jnp.inf,
                        lse)
    return lse


def _lse_where(*, t0, h0, block_t, block_h, th_mask, cu_ref, num_requests, req, in_req, lse_layout, fused_mask):
    """Where a program's partial LSE tiles are (`_partial_lse`'s and `_partial_lse_chunk`'s keywords)."""
    return dict(t0=t0, h0=h0, block_t=block_t, block_h=block_h, th_mask=th_mask, cu_ref=cu_ref,
                cu_row=num_requests + 1, req=req, in_req=in_req, lse_layout=lse_layout, fused_mask=fused_mask)


def _max_and_sum(lses_ref, num_partials, lse_base2, output_lse, *, t0, h0, block_t, block_h, th_mask, cu_ref,
                 num_requests, req, in_req, lse_layout, fused_mask, store_exp=None):
    """(lse_i, m, all_empty, z) of the N-way weights (8.2, 8.3), as the Triton kernels' `_max_and_sum`:
    `_math.n_way_max_and_sum` over the program's LSE tiles (`_partial_lse`; for the maximum beyond
    UNROLLED_PARTIALS `_partial_lse_chunk`) with the variant's loops (`tiles.N_LOOPS`). `lse_i(i)`: partial i's
    tile, for the weights. `store_exp(i, e_i)`: called with every exponential of the sum (the split merge's first
    kernel)."""
    where = _lse_where(t0=t0, h0=h0, block_t=block_t, block_h=block_h, th_mask=th_mask, cu_ref=cu_ref,
                       num_requests=num_requests, req=req, in_req=in_req, lse_layout=lse_layout, fused_mask=fused_mask)
    lse_i = functools.partial(_partial_lse, lses_ref, **where)
    chunk, exp_step, _ = tiles.n_loops("pallas", tiles.merge_variant(output_lse, fused_mask))
    lse_chunk = functools.partial(_partial_lse_chunk, lses_ref, chunk=max(chunk, 1), num_partials=num_partials,
                                  **where)
    m, all_empty, _, z = _math.n_way_max_and_sum(lse_i, num_partials, lse_base2, lse_chunk=lse_chunk, chunk=chunk,
                                                 exp_step=exp_step, store_e=store_exp)
    return lse_i, m, all_empty, z


def _weighted(x, w):
    # 4.3: a zero weight gives exactly 0, so NaN in an empty partial cannot leak.
    return jnp.where(w[:, :, None] > 0.0, x.astype(jnp.float32) * w[:, :, None], 0.0)


def _copied_lse(last_raw, cu_ref, last, cu_row, req, in_req, fused_mask):
    """The pass-through LSE tile (8.4): the last partial's raw bits; the fused mask reaches them too (the mask,
    then the merge): -inf for a token of a request with no KV in the last partial."""
    if fused_mask:
        last_raw = jnp.where(_empty_tokens(cu_ref, last, cu_row, req, in_req)[:, None], -jnp.inf, last_raw)
    return last_raw
