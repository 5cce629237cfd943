"""Modelled varlen attention backends: what a backend returns for a query row with no KV tokens is set, not measured.

`attention_torch` and `attention_jax` stand in for a real varlen attention backend, including what such a backend
returns for a row with no KV tokens (`EMPTY_BEHAVIORS`, docs/spec.md 1), which is the whole point: the merge cannot
tell garbage from data unless the rows are masked from the offsets. torch and jax are imported inside the functions
that need them; the offsets are host arrays.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class EmptyBehavior:
    """The LSE and output a backend leaves in a row whose KV set is empty."""

    name: str
    lse: float
    output: float
    backend: str


EMPTY_BEHAVIORS: dict[str, EmptyBehavior] = {
    b.name: b for b in (
        EmptyBehavior("fa2", math.inf, 0.0, "FlashAttention-2 varlen: LSE +inf"),
        EmptyBehavior("fa3", -math.inf, 0.0, "FlashAttention-3: LSE -inf"),
        # A finite LSE that looks like data and uninitialised (NaN) output: the merge weighs the
        # garbage in, and NaN * w is NaN for any weight.
        EmptyBehavior("finite_nan", 0.0, math.nan, "FlashInfer / TRT-LLM ragged: finite LSE, NaN output"),
    )
}


def _behavior(empty_behavior: str) -> EmptyBehavior:
    if empty_behavior not in EMPTY_BEHAVIORS:
        raise ValueError(f"empty_behavior must be one of {list(EMPTY_BEHAVIORS)}, got {empty_behavior!r}")
    return EMPTY_BEHAVIORS[empty_behavior]


def _check_offsets(q_shape, k_shape, v_shape, query_start_loc, cu_seq_lens, causal):
    if len(q_shape) != 3 or len(k_shape) != 3 or len(v_shape) != 3:
        raise ValueError(f"q, k, v must be [tokens, H, dim], got {q_shape=}, {k_shape=}, {v_shape=}")
    if q_shape[1] != k_shape[1] or k_shape[1] != v_shape[1] or q_shape[2] != k_shape[2] or k_shape[0] != v_shape[0]:
        raise ValueError(f"mismatched q/k/v: {q_shape=}, {k_shape=}, {v_shape=}")
    qsl = np.asarray(query_start_loc, dtype=np.int64)
    cu = np.asarray(cu_seq_lens, dtype=np.int64)
    if qsl.ndim != 1 or qsl.shape != cu.shape:
        raise ValueError(f"query_start_loc and cu_seq_lens must both be [R+1], got {qsl.shape=}, {cu.shape=}")
    if qsl[-1] > q_shape[0] or cu[-1] > k_shape[0]:
        raise ValueError(f"offsets past the buffers: {qsl[-1]=} > {q_shape[0]=} or {cu[-1]=} > {k_shape[0]=}")
    if causal and not np.array_equal(np.diff(qsl), np.diff(cu)):
        raise ValueError("causal attention here is over the new tokens: query and KV lengths must match, "
                         f"got {np.diff(qsl).tolist()} and {np.diff(cu).tolist()}")
    return qsl, cu


def attention_torch(q, k, v, query_start_loc, cu_seq_lens, *, causal: bool, empty_behavior: str = "fa3",
                    scale: float | None = None):
    """Varlen attention in torch, standing in for a real prefill backend (fp32 math).

    Args:
        q: f32[T, H, Dqk], queries grouped by `query_start_loc`.
        k: f32[N, H, Dqk], v: f32[N, H, Dv], KV grouped by `cu_seq_lens`.
        query_start_loc, cu_seq_lens: i32[R+1] host arrays (numpy / list): no device sync.
        causal: query j of request r attends KV 0..j of r (the new tokens); else all of r's KV.
        empty_behavior: a key of `EMPTY_BEHAVIORS`: what rows of a request with no KV hold.
        scale: softmax scale, default `Dqk ** -0.5`.

    Returns:
        (out f32[T, H, Dv], lse f32[H, T] natural log, vLLM layout). Tokens past `query_start_loc[R]`
        hold NaN.
    """
    import torch

    beh = _behavior(empty_behavior)
    qsl, cu = _check_offsets(tuple(q.shape), tuple(k.shape), tuple(v.shape), query_start_loc, cu_seq_lens, causal)
    num_tokens, num_heads, qk_dim = q.shape
    scale = qk_dim ** -0.5 if scale is None else scale
    out = torch.full((num_tokens, num_heads, v.shape[2]), math.nan, dtype=torch.float32, device=q.device)
    lse = torch.full((num_heads, num_tokens), math.nan, dtype=torch.float32, device=q.device)
    for r in range(qsl.size - 1):
        q0, q1, k0, k1 = int(qsl[r]), int(qsl[r + 1]), int(cu[r]), int(cu[r + 1])
        if q1 == q0:
            continue
        if k1 == k0:  # no KV tokens: whatever the backend leaves there
            out[q0:q1] = beh.output
            lse[:, q0:q1] = beh.lse
            continue
        s = torch.einsum("qhd,khd->hqk", q[q0:q1].float(), k[k0:k1].float()) * scale
        if causal:
            s = s.masked_fill(torch.ones(q1 - q0, k1 - k0, dtype=torch.bool, device=q.device).triu(1), -math.inf)
        row_lse = torch.logsumexp(s, dim=-1)  # [H, n]
        p = torch.exp(s - row_lse[..., None])
        out[q0:q1] = torch.einsum("hqk,khd->qhd", p, v[k0:k1].float())
        lse[:, q0:q1] = row_lse
    return out, lse


def _segments(offsets: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(i32[size] request id, -1 past the last offset; i32[size] position within the request)."""
    idx = np.arange(size)
    seg = (np.searchsorted(offsets, idx, side="right") - 1).astype(np.int32)
    seg[idx >= offsets[-1]] = -1
    pos = (idx - offsets[np.clip(seg, 0, None)]).astype(np.int32)
    return seg, pos


def bucket_size(n: int) -> int:
    """Next power of two (at least 16): padded KV lengths, so chunk sizes share compiled programs."""
    return max(16, 1 << max(n - 1, 0).bit_length())


_JAX_ATTENTION = {}


def _jax_attention_fn(causal: bool, block_q: int):
    """The jitted dense attention: scores against the whole (padded) KV, masked to the own request."""
    key = (causal, block_q)
    if key in _JAX_ATTENTION:
        return _JAX_ATTENTION[key]
    import jax
    import jax.numpy as jnp

    hi = jax.lax.Precision.HIGHEST  # no TF32 on GPUs

    def block(q, q_seg, q_pos, k, v, k_seg, k_pos, scale, empty_lse, empty_out):
        s = jnp.einsum("qhd,khd->hqk", q, k, precision=hi) * scale  # f32[H, block_q, N]
        visible = q_seg[:, None] == k_seg[None, :]
        if causal:
            visible &= k_pos[None, :] <= q_pos[:, None]
        s = jnp.where(visible[None], s, -jnp.inf)
        has_kv = visible.any(axis=1)  # [block_q]; False for a request with no KV tokens (and padding)
        m = jnp.where(has_kv[None], s.max(axis=-1), 0.0)
        lse = jnp.log(jnp.exp(s - m[..., None]).sum(axis=-1)) + m
        p = jnp.where(visible[None], jnp.exp(s - lse[..., None]), 0.0)
        out = jnp.einsum("hqk,khd->qhd", p, v, precision=hi)
        lse = jnp.where(has_kv[None], lse, empty_lse)  # a row with no KV: what the backend leaves
        out = jnp.where(has_kv[:, None, None], out, empty_out)
        padding = q_seg < 0
        return (jnp.where(padding[:, None, None], jnp.nan, out), jnp.where(padding[None], jnp.nan, lse))

    @jax.jit
    def run(q, q_seg, q_pos, k, v, k_seg, k_pos, scale, empty_lse, empty_out):
        num_tokens, num_heads, qk_dim = q.shape
        nb = num_tokens // block_q

        def one(args):
            return block(*args, k, v, k_seg, k_pos, scale, empty_lse, empty_out)

        out, lse = jax.lax.map(one, (q.reshape(nb, block_q, num_heads, qk_dim),
                                     q_seg.reshape(nb, block_q), q_pos.reshape(nb, block_q)))
        return out.reshape(num_tokens, num_heads, -1), lse.transpose(1, 0, 2).reshape(num_heads, num_tokens)

    _JAX_ATTENTION[key] = run
    return run


def attention_jax(q, k, v, query_start_loc, cu_seq_lens, *, causal: bool, empty_behavior: str = "fa3",
                  scale: float | None = None):
    """`attention_torch` in jax.numpy: same arguments and results (new arrays on the inputs' device).

    One jitted program per (causal, padded shape): every query block is scored against the whole KV
    buffer, masked to its own request (and causally), so the per-request lengths stay runtime data and
    the behaviour's fill values are traced scalars. KV is padded to a power of two and queries to a
    block multiple; fp32 with `Precision.HIGHEST`.
    """
    import jax.numpy as jnp

    beh = _behavior(empty_behavior)
    qsl, cu = _check_offsets(tuple(q.shape), tuple(k.shape), tuple(v.shape), query_start_loc, cu_seq_lens, causal)
    num_tokens, num_heads, qk_dim = q.shape
    scale = qk_dim ** -0.5 if scale is None else scale
    num_kv = int(cu[-1])
    kv_pad = bucket_size(num_kv)
    # Bound the f32[H, block_q, N] scores to about 256 MiB.
    block_q = max(1, min(bucket_size(num_tokens), (1 << 26) // (num_heads * kv_pad)))
    block_q = 1 << (block_q.bit_length() - 1)
    t_pad = -(-num_tokens // block_q) * block_q
    q_seg, q_pos = _segments(qsl, t_pad)
    k_seg, k_pos = _segments(cu, kv_pad)

    def pad(x, n):
        x = jnp.asarray(x, jnp.float32)[:n]
        return jnp.pad(x, ((0, n - x.shape[0]), (0, 0), (0, 0)))

    out, lse = _jax_attention_fn(causal, block_q)(
        pad(q, t_pad), jnp.asarray(q_seg), jnp.asarray(q_pos), pad(k, kv_pad), pad(v, kv_pad),
        jnp.asarray(k_seg), jnp.asarray(k_pos), jnp.float32(scale), jnp.float32(beh.lse), jnp.float32(beh.output))
    return out[:num_tokens], lse[:, :num_tokens]
