"""Plain-XLA (jnp) implementation of the mask and the merges, for backends without Pallas GPU (TPU, CPU).

An implementation, tested against `parity.harness.reference` like the kernels; not a second spec. Offsets and
`prefill_tokens_with_context` stay traced. The token->request lookup is a `searchsorted` with its levels unrolled
(the default `scan` lowers to an XLA while loop); the kernels avoid per-token metadata instead. The float
operations are the kernels' in the same order (sums over partials in index order, never a tree reduction), so on
a GPU the results can be compared bit for bit with the kernels'.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from mla_lse_common import tiles
from pallas_impl import _checks, _math
from pallas_impl._math import clean_lse, exp_base, fold_partials, merged_lse, two_way_weights


def _empty_tokens(query_start_loc, cu_seq_lens, num_tokens):
    """bool[T]: tokens of requests whose chunk is empty; padding (t >= qsl[R]) is False."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    req = jnp.searchsorted(query_start_loc, t, side="right", method="scan_unrolled") - 1  # in [-1, R]
    num_requests = query_start_loc.shape[0] - 1
    safe = jnp.clip(req, 0, max(num_requests - 1, 0))
    empty = cu_seq_lens[safe + 1] == cu_seq_lens[safe]
    return (req >= 0) & (req < num_requests) & (t < query_start_loc[-1]) & empty


@functools.partial(jax.jit, static_argnames=("lse_layout",))
def mask_empty_context_lse(lse, query_start_loc, cu_seq_lens, output=None, *, lse_layout="HT"):
    num_tokens = lse.shape[1] if lse_layout == "HT" else lse.shape[0]
    empty = _empty_tokens(query_start_loc, cu_seq_lens, num_tokens)
    lse = jnp.where(empty[None, :] if lse_layout == "HT" else empty[:, None], -jnp.inf, lse)
    if output is None:
        return lse
    return lse, jnp.where(empty[:, None, None], jnp.zeros((), output.dtype), output)


def _merged_lse(z, m, empty, copy_t, passthrough, lse_base2):
    """The merge's LSE (docs/spec.md 4.2, 4.3, 4.4, 8.4), `[T, H]`, in the LSEs' base."""
    return jnp.where(copy_t[:, None], passthrough, merged_lse(z, m, empty, lse_base2))


def _stored(out, last, copy_t, output_scale, out_dtype):
    """The f32 merge `out` [T, H, D] as `out_dtype` (docs/spec.md 4.4, 4.6): pass-through tokens take `last` (the
    suffix, or the last partial) bit for bit where the output has its dtype, else rounded once (fp8: scaled and
    clamped as a merged row)."""
    copy = copy_t[:, None, None]
    if output_scale is not None:
        out = jnp.where(copy, last.astype(jnp.float32), out)
        return _math.static_fp8(out, output_scale.reshape(-1)[0]).astype(out_dtype)
    if last.dtype == out_dtype:
        return jnp.where(copy, last, out.astype(out_dtype))
    return jnp.where(copy, last.astype(jnp.float32), out).astype(out_dtype)


def _stored_grouped(out, group, last=None, copy_t=None, global_scale=None):
    """The f32 rows `out` [T, H, D] quantized per group (docs/spec.md 4.7; `group` = (group_size, ue8m0,
    scale_layout)): (fp8 of out's shape, scales in scale_layout), or NVFP4 (4.8; `group` = (16, "nvfp4",
    scale_layout), `global_scale` f32[1]): (u8[T, H, D / 2] two e2m1 codes a byte, e4m3 block scales in
    scale_layout); pass-through tokens (`copy_t`) take `last` as f32 (4.4)."""
    group_size, ue8m0, layout = group
    num_tokens = out.shape[0]
    if copy_t is not None:
        out = jnp.where(copy_t[:, None, None], last.astype(jnp.float32), out)
    if _math.is_nvfp4(group):
        codes, scale = _math.nvfp4_quant(out, global_scale.reshape(-1)[0])
        return _math.pack_fp4(codes), _math.scale_layout(scale.reshape(num_tokens, -1), layout)
    q, scale = _math.group_quant(out, group_size, ue8m0)
    return q.astype(_checks.FP8), _math.scale_layout(scale.reshape(num_tokens, -1), layout)


@functools.partial(jax.jit, static_argnames=("return_lse", "out_dtype", "lse_layout", "lse_base2", "group"))
def merge_attn_states(prefix_output, prefix_lse, suffix_output, suffix_lse, output_scale, query_start_loc,
                      prefix_cu_seq_lens, prefill_tokens_with_context, *, return_lse, out_dtype, lse_layout,
                      lse_base2, group=None):
    num_tokens = prefix_output.shape[0]
    prefill_tokens = _checks.prefill_tokens_array(prefill_tokens_with_context, num_tokens)
    p_raw = prefix_lse.T if lse_layout == "HT" else prefix_lse  # [T, H]
    s_raw = suffix_lse.T if lse_layout == "HT" else suffix_lse
    p, s = clean_lse(p_raw), clean_lse(s_raw)  # 4.1; a base-2 LSE stays base 2
    if query_start_loc is not None:
        p = jnp.where(_empty_tokens(query_start_loc, prefix_cu_seq_lens, num_tokens)[:, None], -jnp.inf, p)
    m, both_empty, z, wp, ws = two_way_weights(p, s, lse_base2)
    wp, ws = wp[..., None], ws[..., None]
    a = prefix_output.astype(jnp.float32)
    b = suffix_output.astype(jnp.float32)
    out = jnp.where(wp > 0, a * wp, 0.0) + jnp.where(ws > 0, b * ws, 0.0)
    out = jnp.where(both_empty[..., None], 0.0, out)
    copy_t = jnp.arange(num_tokens, dtype=jnp.int32) >= prefill_tokens[0]
    if group is not None:  # 4.7 / 4.8: (fp8 or packed fp4, scales)
        out, scales = _stored_grouped(out, group, suffix_output, copy_t, output_scale)
    else:
        out = _stored(out, suffix_output, copy_t, output_scale, out_dtype)
    lse = _merged_lse(z, m, both_empty, copy_t, s_raw, lse_base2) if return_lse else None
    return _results(out, None if lse is None else (lse.T if lse_layout == "HT" else lse),
                    scales if group is not None else None)


def _results(out, lse, scales):
    """The merges' results: out, then the LSE when returned, then the per-group scales when quantized per group;
    one array alone, else a tuple."""
    results = tuple(x for x in (out, lse, scales) if x is not None)
    return results if len(results) > 1 else results[0]


def _copied_lse(last_raw, empty):
    """The pass-through LSE (8.4), `[T, H]`: the last partial's raw bits; the fused mask (`empty` bool[N, T], or
    None) reaches them too: -inf for a token of a request with no KV in the last partial."""
    return last_raw if empty is None else jnp.where(empty[-1][:, None], -jnp.inf, last_raw)


def _n_way_weights(lses, query_start_loc, cu_seq_lens, num_tokens, lse_layout, lse_base2):
    """(raw [N, T, H] LSEs, e(i) = exp(lse_i - m) (base 2: of (lse_i - m) * ln2), m, all_empty, z, empty bool[N, T] or None) of the
    N-way merge (8.1-8.3), in index order: the loops over the partials unroll up to N = UNROLLED_PARTIALS and are
    `lax.fori_loop`s beyond (`_math.fold_partials`), so the trace and compile time do not grow with N."""
    num_partials = lses.shape[0]
    l_raw = jnp.swapaxes(lses, 1, 2) if lse_layout == "HT" else lses  # [N, T, H]
    lse = clean_lse(l_raw)  # 4.1; a base-2 LSE stays base 2
    empty = None
    if query_start_loc is not None:
        empty = jax.vmap(lambda cu: _empty_tokens(query_start_loc, cu, num_tokens))(cu_seq_lens)  # [N, T]
        lse = jnp.where(empty[:, :, None], -jnp.inf, lse)
    exp_step = tiles.n_loops("pallas", "lse")[1]  # the partition changes no bit: the kernels' lse loops
    m = fold_partials(1, num_partials, lambda i, m: jnp.maximum(m, lse[i]), lse[0], num_partials, exp_step)
    all_empty = m == -jnp.inf
    m = jnp.where(all_empty, 0.0, m)

    def e(i):
        return exp_base(lse[i] - m, lse_base2)

    z = fold_partials(1, num_partials, lambda i, z: z + e(i), e(0), num_partials, exp_step)  # index order
    return l_raw, e, m, all_empty, z, empty


@functools.partial(jax.jit, static_argnames=("return_lse", "out_dtype", "lse_layout", "lse_base2", "group"))
def merge_attn_states_n(outputs, lses, output_scale, query_start_loc, cu_seq_lens, prefill_tokens_with_context, *,
                        return_lse, out_dtype, lse_layout, lse_base2, group=None):
    num_partials, num_tokens = outputs.shape[:2]
    prefill_tokens = _checks.prefill_tokens_array(prefill_tokens_with_context, num_tokens)
    l_raw, e, m, all_empty, z, empty = _n_way_weights(lses, query_start_loc, cu_seq_lens, num_tokens, lse_layout,
                                                      lse_base2)

    def term(i):  # 4.3: a zero weight gives exactly 0
        w = (e(i) / z)[..., None]
        return jnp.where(w > 0, outputs[i].astype(jnp.float32) * w, 0.0)

    out_step = tiles.n_loops("pallas", "lse")[2]
    out = fold_partials(1, num_partials, lambda i, out: out + term(i), term(0), num_partials, out_step)
    out = jnp.where(all_empty[..., None], 0.0, out)
    copy_t = jnp.arange(num_tokens, dtype=jnp.int32) >= prefill_tokens[0]
    scales = None
    if group is not None:  # 4.7 / 4.8: (fp8 or packed fp4, scales)
        out, scales = _stored_grouped(out, group, outputs[-1], copy_t, output_scale)
    else:
        out = _stored(out, outputs[-1], copy_t, output_scale, out_dtype)
    lse_out = _merged_lse(z, m, all_empty, copy_t, _copied_lse(l_raw[-1], empty), lse_base2) if return_lse else None
    return _results(out, None if lse_out is None else (lse_out.T if lse_layout == "HT" else lse_out), scales)


@functools.partial(jax.jit, static_argnames=("return_lse", "out_dtype", "lse_layout", "lse_base2", "group"))
def empty_merge_n(outputs, lses, output_scale, query_start_loc, cu_seq_lens, prefill_tokens_with_context, *,
                  return_lse, out_dtype, lse_layout, lse_base2, group=None):
    """The N-way merge of N = 0 partials (docs/spec.md 8.2), on every implementation and backend: every row is
    empty, output 0 and LSE -inf, pass-through rows too (there is no last partial to copy); per-group FP8 (4.7):
    q = 0 and the floor's scale."""
    del query_start_loc, cu_seq_lens, prefill_tokens_with_context, lse_layout, lse_base2
    out = jnp.zeros(outputs.shape[1:], out_dtype)
    scales = None
    if group is not None:
        out, scales = _stored_grouped(jnp.zeros(outputs.shape[1:], jnp.float32), group, global_scale=output_scale)
    return _results(out, jnp.full(lses.shape[1:], -jnp.inf, jnp.float32) if return_lse else None, scales)


@functools.partial(jax.jit, static_argnames=("reduce_dtype", "return_lse", "lse_layout", "lse_base2"))
def cp_rescale(part, lses, query_start_loc, cu_seq_lens, prefill_tokens_with_context, rank, *, reduce_dtype,
               return_lse, lse_layout, lse_base2):
    """The context-parallel rescale (pallas_impl/cp_merge.py) in jnp: (scaled reduce_dtype[T, H, D], merged LSE)."""
    num_partials, num_tokens = lses.shape[0], part.shape[0]
    prefill_tokens = _checks.prefill_tokens_array(prefill_tokens_with_context, num_tokens)
    l_raw, e, m, all_empty, z, empty = _n_way_weights(lses, query_start_loc, cu_seq_lens, num_tokens, lse_layout,
                                                      lse_base2)
    w = (e(rank) / z)[..., None]
    o = part.astype(jnp.float32)
    scaled = jnp.where(w > 0, o * w, 0.0)
    scaled = jnp.where(all_empty[..., None], 0.0, scaled)
    copy_t = (jnp.arange(num_tokens, dtype=jnp.int32) >= prefill_tokens[0])[:, None, None]
    scaled = jnp.where(copy_t, jnp.where(rank == num_partials - 1, o, -0.0), scaled).astype(reduce_dtype)
    if not return_lse:
        return scaled, None
    merged = _merged_lse(z, m, all_empty, copy_t[:, 0, 0], _copied_lse(l_raw[-1], empty), lse_base2)
    return scaled, (merged.T if lse_layout == "HT" else merged)
