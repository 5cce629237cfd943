"""MLA chunked-context prefill, modelled end to end: chunk planner, backend-like attention, reference.

This is the setting where the empty-context mask and the merge are used (docs/spec.md 1; NOTES "vLLM's MLA
chunked-context prefill"). A batch of prefill requests, each with `context_lens[r]` cached KV tokens
and `query_lens[r]` new tokens, is attended in two parts:

1. the cached context, in workspace-sized chunks (`plan_chunks`): every request with context gets the
   same per-chunk budget, so a short context runs out early and its rows are *empty* in later chunks;
2. the new tokens, causally.

The partial results are merged with `merge_attn_states`. `attention_torch` and `attention_jax` stand
in for a real varlen attention backend, including what such a backend returns for a row with no KV
tokens (`EMPTY_BEHAVIORS`), which is the whole point: the merge cannot tell garbage from data unless
the rows are masked from the offsets. `reference_prefill` is monolithic float64 attention over
context + new tokens, the ground truth the chunked result must reproduce.

Planner, batch builder and reference are numpy only; torch and jax are imported inside the functions
that need them. Offsets are int32 and live on the host, as upstream keeps them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np


# --------------------------------------------------------------------------------------------------
# Chunk planner
# --------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, eq=False)
class ChunkPlan:
    """How the cached context is cut into workspace-sized chunks (upstream's scheme).

    Attributes:
        budget: context rows per request per chunk (0 when no request has context).
        num_chunks: `cdiv(max(context_lens), budget)` (0 when no request has context).
        chunk_seq_lens: i32[num_chunks, R], KV tokens of request r in chunk i.
        cu_seq_lens: i32[num_chunks, R+1], `[0, cumsum(chunk_seq_lens[i])]`: the chunk's KV offsets.
        has_empty: host bools, `any(chunk_seq_lens[i] == 0)`: the mask's launch guard.
    """

    budget: int
    num_chunks: int
    chunk_seq_lens: np.ndarray
    cu_seq_lens: np.ndarray
    has_empty: list[bool]

    def chunk_start(self, i: int) -> int:
        """First context position (per request) covered by chunk i: the same for every request."""
        return i * self.budget


def _check_lens(name: str, lens: Sequence[int]) -> np.ndarray:
    arr = np.asarray(lens)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    if (arr < 0).any():
        raise ValueError(f"{name} must be non-negative, got {arr.tolist()}")
    return arr


def plan_chunks(context_lens: Sequence[int], workspace_rows: int, block_size: int) -> ChunkPlan:
    """Plans the context chunks of one prefill batch.

    Per chunk budget: `workspace_rows // num_prefills_with_context`, rounded down to `block_size`.
    `num_chunks = cdiv(max(context_lens), budget)`. Chunk i covers context positions
    `[i*budget, (i+1)*budget)` of every request: `chunk_seq_lens[i, r] = max(min(ctx[r],
    (i+1)*budget) - i*budget, 0)`. Requests without context are empty in every chunk.

    Args:
        context_lens: cached-context length of each of the R prefill requests.
        workspace_rows: KV rows of the gather workspace (shared by all requests of a chunk).
        block_size: KV-cache page size; the budget is a whole number of pages.

    Returns:
        A `ChunkPlan`.

    Raises:
        ValueError: negative lengths, non-positive sizes, or a workspace holding less than one page
            per request with context (upstream asserts the same).
    """
    ctx = _check_lens("context_lens", context_lens)
    if int(workspace_rows) <= 0 or int(block_size) <= 0:
        raise ValueError(f"workspace_rows and block_size must be positive, got {workspace_rows=}, {block_size=}")
    num_requests = ctx.size
    num_with_context = int((ctx > 0).sum())
    if num_with_context == 0:
        return ChunkPlan(0, 0, np.zeros((0, num_requests), np.int32), np.zeros((0, num_requests + 1), np.int32), [])
    budget = (int(workspace_rows) // num_with_context) // int(block_size) * int(block_size)
    if budget <= 0:
        raise ValueError(f"workspace too small: {workspace_rows=} rows cannot give one page of {block_size=} "
                         f"to each of the {num_with_context} requests with context")
    max_ctx = int(ctx.max())
    num_chunks = -(-max_ctx // budget)
    starts = np.arange(num_chunks, dtype=np.int64)[:, None] * budget  # [num_chunks, 1]
    ends = np.minimum(ctx[None, :], starts + budget)
    chunk_seq_lens = np.maximum(ends - starts, 0).astype(np.int32)
    cu_seq_lens = np.zeros((num_chunks, num_requests + 1), dtype=np.int32)
    cu_seq_lens[:, 1:] = np.cumsum(chunk_seq_lens, axis=1, dtype=np.int64).astype(np.int32)
    has_empty = [bool((row == 0).any()) for row in chunk_seq_lens]
    return ChunkPlan(budget, num_chunks, chunk_seq_lens, cu_seq_lens, has_empty)


def prefill_tokens_with_context(context_lens: Sequence[int], query_start_loc: Sequence[int]) -> int | None:
    """Query tokens of the requests with context when those requests come first, else None.

    The final merge (context partial = prefix, new-token partial = suffix) copies every token at or past
    this count straight from the suffix (docs/spec.md 4.4). That is only right when the requests without context
    are exactly the trailing ones; otherwise there is no such count and upstream passes None.

    Args:
        context_lens: int[R], cached-context length per request.
        query_start_loc: i32[R+1], the prefill query offsets.
    """
    ctx = _check_lens("context_lens", context_lens)
    qsl = np.asarray(query_start_loc)
    if qsl.shape != (ctx.size + 1,):
        raise ValueError(f"query_start_loc must have R+1 = {ctx.size + 1} entries, got shape {qsl.shape}")
    k = int((ctx > 0).sum())
    if not (ctx[:k] > 0).all():  # then some request without context precedes one with context
        return None
    return int(qsl[k])


def chunk_gather_index(plan: ChunkPlan, i: int, context_start_loc: np.ndarray) -> np.ndarray:
    """i64[cu_seq_lens[i][R]]: rows of the per-request-contiguous context KV that form chunk i.

    Request r's cached KV occupies rows `[context_start_loc[r], context_start_loc[r+1])`; chunk i takes
    its positions `[i*budget, i*budget + chunk_seq_lens[i, r])`, requests in order (the workspace).
    """
    start = plan.chunk_start(i)
    parts = [np.arange(context_start_loc[r] + start, context_start_loc[r] + start + n, dtype=np.int64)
             for r, n in enumerate(plan.chunk_seq_lens[i].tolist())]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def cp_shard(context_lens: Sequence[int], context_start_loc: np.ndarray, num_ranks: int,
             interleave: int = 1) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each rank's share of the cached context under vLLM's decode-context-parallel placement.

    KV token j of a request lives on rank `(j // interleave) % num_ranks`. A request whose context is shorter
    than `num_ranks * interleave` leaves some ranks without any of its KV (docs/spec.md 9).

    Returns:
        Per rank: (i64[n_local] rows of `ctx_k` / `ctx_v` it holds, request by request in order;
        i32[R+1] its local KV offsets `cu_seq_lens`).
    """
    ctx = _check_lens("context_lens", context_lens)
    if int(num_ranks) < 1 or int(interleave) < 1:
        raise ValueError(f"num_ranks and interleave must be positive, got {num_ranks=}, {interleave=}")
    out = []
    for rank in range(int(num_ranks)):
        parts, lens = [], []
        for r, n in enumerate(ctx.tolist()):
            j = np.arange(n, dtype=np.int64)
            mine = j[(j // interleave) % num_ranks == rank]
            parts.append(context_start_loc[r] + mine)
            lens.append(mine.size)
        cu = np.zeros(ctx.size + 1, dtype=np.int32)
        cu[1:] = np.cumsum(lens)
        out.append((np.concatenate(parts) if parts else np.zeros(0, np.int64), cu))
    return out


# --------------------------------------------------------------------------------------------------
# What attention backends return for a query row with no KV tokens (docs/spec.md 1)
# --------------------------------------------------------------------------------------------------

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


# --------------------------------------------------------------------------------------------------
# Real attention kernels (not modelled): what they return for a row with no KV tokens is measured, not set
# --------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RealBackend:
    """An attention kernel that returns its LSE, called as a serving stack calls it."""

    name: str
    framework: str  # "torch" or "jax": where the partials are computed
    dtype: str  # the partials' dtype (q, k, v and out)
    gpu_only: bool
    kernel: str  # what runs, for the table and the docs


REAL_BACKENDS: dict[str, RealBackend] = {
    b.name: b for b in (
        RealBackend("torch-flash", "torch", "bfloat16", True,
                    "PyTorch's FlashAttention-2 varlen kernel (torch.ops.aten._flash_attention_forward), LSE [H, T]"),
        RealBackend("jax-cudnn", "jax", "bfloat16", True,
                    "cuDNN flash attention through jax.nn.dot_product_attention(implementation='cudnn', "
                    "return_residual=True), one padded batch row per request"),
        RealBackend("jax-xla", "jax", "float32", False,
                    "jax.nn.dot_product_attention(implementation='xla', return_residual=True), one padded batch "
                    "row per request (any device)"),
    )
}


def real_backend(name: str) -> RealBackend:
    if name not in REAL_BACKENDS:
        raise ValueError(f"backend must be one of {list(REAL_BACKENDS)}, got {name!r}")
    return REAL_BACKENDS[name]


def _pad_head_dim(v, qk_dim: int, pad):
    """V zero-padded to the q/k head size (FlashAttention and cuDNN take one head size): vLLM's MLA prefill pads V
    from 128 to 192 the same way and slices the output back (a strided view)."""
    return v if v.shape[2] == qk_dim else pad(v, qk_dim - v.shape[2])


def attention_torch_flash(q, k, v, query_start_loc, cu_seq_lens, *, causal: bool, scale: float | None = None):
    """Varlen attention by PyTorch's FlashAttention-2 kernel (CUDA, fp16/bf16).

    Args as `attention_torch`; `q`, `k`, `v` fp16/bf16 CUDA tensors. Returns (out dtype[T, H, Dv], a view of the
    kernel's [T, H, Dqk] output when Dv < Dqk; lse f32[H, T] natural log), exactly as the kernel returns them: rows
    of a request with no KV tokens hold whatever it leaves there.
    """
    import torch

    qsl, cu = _check_offsets(tuple(q.shape), tuple(k.shape), tuple(v.shape), query_start_loc, cu_seq_lens, causal)
    num_tokens, num_heads, qk_dim = q.shape
    v_dim = v.shape[2]
    if int(qsl[-1]) != num_tokens:
        raise ValueError(f"the flash kernel writes only the rows of the requests: query_start_loc[R]={int(qsl[-1])} "
                         f"must equal T={num_tokens}")
    vp = _pad_head_dim(v, qk_dim, lambda x, n: torch.nn.functional.pad(x, (0, n)))

    def dev(x):
        return torch.as_tensor(np.asarray(x, dtype=np.int32), device=q.device)

    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q, k, vp, dev(qsl), dev(cu), int(np.diff(qsl).max()), int(np.diff(cu).max()), 0.0, causal, False,
        scale=qk_dim ** -0.5 if scale is None else scale)
    if tuple(lse.shape) != (num_heads, num_tokens):
        raise RuntimeError(f"this torch's flash kernel returned an LSE of shape {tuple(lse.shape)}, expected "
                           f"[H, T] = {[num_heads, num_tokens]} (the varlen layout)")
    return out[..., :v_dim], lse


def attention_jax_dpa(q, k, v, query_start_loc, cu_seq_lens, *, causal: bool, implementation: str,
                      scale: float | None = None):
    """Varlen attention by `jax.nn.dot_product_attention` with its LSE (`return_residual=True`).

    The packed tokens go to one batch row per request, padded to a multiple of 128 (cuDNN's flash path wants it),
    with `query_seq_lengths` / `key_value_seq_lengths`; results are packed back. Args as `attention_torch` (JAX
    arrays); `implementation` "cudnn" or "xla". Returns (out dtype[T, H, Dv], lse f32[H, T] natural log) as the
    function returns them, rows of a request with no KV tokens included.
    """
    import jax
    import jax.numpy as jnp

    qsl, cu = _check_offsets(tuple(q.shape), tuple(k.shape), tuple(v.shape), query_start_loc, cu_seq_lens, causal)
    num_tokens, num_heads, qk_dim = q.shape
    v_dim = v.shape[2]
    q_lens, kv_lens = np.diff(qsl), np.diff(cu)
    rows_q, rows_kv = (max(128, -(-int(x.max()) // 128) * 128) for x in (q_lens, kv_lens))
    vp = _pad_head_dim(v, qk_dim, lambda x, n: jnp.pad(x, ((0, 0), (0, 0), (0, n))))

    def to_rows(x, offsets, rows):  # packed [n, H, D] -> [R, rows, H, D]; padding reads row 0 (masked out)
        idx = offsets[:-1, None] + np.arange(rows)[None, :]
        valid = np.arange(rows)[None, :] < np.diff(offsets)[:, None]
        return jnp.where(valid[..., None, None], x[np.where(valid, idx, 0)], 0)

    out, lse = jax.nn.dot_product_attention(
        to_rows(q, qsl, rows_q), to_rows(k, cu, rows_kv), to_rows(vp, cu, rows_kv),
        scale=qk_dim ** -0.5 if scale is None else scale, is_causal=causal,
        query_seq_lengths=jnp.asarray(q_lens, jnp.int32), key_value_seq_lengths=jnp.asarray(kv_lens, jnp.int32),
        implementation=implementation, return_residual=True)
    req = np.repeat(np.arange(q_lens.size), q_lens)
    pos = np.arange(int(qsl[-1])) - qsl[:-1][req]
    out = out[req, pos][..., :v_dim]  # [T', H, Dv]
    lse = lse.astype(jnp.float32)[req, pos].T  # [H, T']
    if int(qsl[-1]) < num_tokens:  # padding tokens: never part of a request
        out = jnp.pad(out, ((0, num_tokens - int(qsl[-1])), (0, 0), (0, 0)), constant_values=jnp.nan)
        lse = jnp.pad(lse, ((0, 0), (0, num_tokens - int(qsl[-1]))), constant_values=jnp.nan)
    return out, lse


def attention_real(backend: str, q, k, v, query_start_loc, cu_seq_lens, *, causal: bool, scale: float | None = None):
    """One of `REAL_BACKENDS` on arrays of its framework (torch tensors or JAX arrays)."""
    b = real_backend(backend)
    if b.name == "torch-flash":
        return attention_torch_flash(q, k, v, query_start_loc, cu_seq_lens, causal=causal, scale=scale)
    return attention_jax_dpa(q, k, v, query_start_loc, cu_seq_lens, causal=causal, scale=scale,
                             implementation=b.name.split("-", 1)[1])


def empty_row_classes(out, lse, query_start_loc, cu_seq_lens) -> dict:
    """What a kernel left in the rows of requests with no KV tokens: counts of the LSE classes (+inf, -inf, nan,
    finite) and of the output rows' classes (zero, nan, finite non-zero), over host copies."""
    qsl, cu = np.asarray(query_start_loc), np.asarray(cu_seq_lens)
    empty = np.zeros(np.asarray(lse).shape[1], bool)
    for r in np.flatnonzero(np.diff(cu) == 0):
        empty[qsl[r]:qsl[r + 1]] = True
    lse = np.asarray(lse, np.float32)[:, empty]
    out = np.asarray(out, np.float32)[empty].reshape(int(empty.sum()), -1)
    return dict(
        lse={"+inf": int(np.isposinf(lse).sum()), "-inf": int(np.isneginf(lse).sum()),
             "nan": int(np.isnan(lse).sum()), "finite": int(np.isfinite(lse).sum())},
        out_rows={"zero": int((out == 0).all(axis=1).sum()), "nan": int(np.isnan(out).any(axis=1).sum()),
                  "finite": int((np.isfinite(out).all(axis=1) & (out != 0).any(axis=1)).sum())})


# --------------------------------------------------------------------------------------------------
# Batches and the float64 ground truth
# --------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, eq=False)
class PrefillBatch:
    """One prefill batch with cached context, as numpy arrays (framework-neutral).

    Attributes:
        context_lens, query_lens: per request (R of each).
        workspace_rows, block_size: chunking parameters (`plan_chunks`).
        query_start_loc: i32[R+1], offsets of the new tokens (queries and new KV alike).
        context_start_loc: i32[R+1], offsets of each request's cached KV in `ctx_k` / `ctx_v`.
        q, new_k: f32[T, H, Dqk]; new_v: f32[T, H, Dv].
        ctx_k: f32[Nctx, H, Dqk]; ctx_v: f32[Nctx, H, Dv] (MLA's up-projected cached latents).
    """

    context_lens: tuple[int, ...]
    query_lens: tuple[int, ...]
    workspace_rows: int
    block_size: int
    query_start_loc: np.ndarray
    context_start_loc: np.ndarray
    q: np.ndarray
    new_k: np.ndarray
    new_v: np.ndarray
    ctx_k: np.ndarray
    ctx_v: np.ndarray

    @property
    def num_requests(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])

    @property
    def num_heads(self) -> int:
        return self.q.shape[1]

    @property
    def scale(self) -> float:
        return self.q.shape[2] ** -0.5

    def plan(self) -> ChunkPlan:
        return plan_chunks(self.context_lens, self.workspace_rows, self.block_size)

    def prefill_tokens_with_context(self) -> int | None:
        return prefill_tokens_with_context(self.context_lens, self.query_start_loc)


def _offsets(lens: Sequence[int]) -> np.ndarray:
    out = np.zeros(len(lens) + 1, dtype=np.int32)
    out[1:] = np.cumsum(np.asarray(lens, dtype=np.int64))
    return out


def make_batch(context_lens: Sequence[int], query_lens: Sequence[int], *, num_heads: int = 4, qk_dim: int = 96,
               v_dim: int = 64, workspace_rows: int = 128, block_size: int = 16, seed: int = 0) -> PrefillBatch:
    """A seeded batch: standard-normal queries, keys and values in fp32."""
    ctx = _check_lens("context_lens", context_lens)
    qlen = _check_lens("query_lens", query_lens)
    if ctx.size != qlen.size:
        raise ValueError(f"context_lens and query_lens must have one entry per request, got {ctx.size} and {qlen.size}")
    rng = np.random.default_rng(seed)
    qsl, csl = _offsets(qlen), _offsets(ctx)
    num_tokens, num_ctx = int(qsl[-1]), int(csl[-1])

    def normal(n, d):
        return rng.standard_normal((n, num_heads, d), dtype=np.float32)

    return PrefillBatch(
        context_lens=tuple(int(x) for x in ctx), query_lens=tuple(int(x) for x in qlen),
        workspace_rows=int(workspace_rows), block_size=int(block_size),
        query_start_loc=qsl, context_start_loc=csl,
        q=normal(num_tokens, qk_dim), new_k=normal(num_tokens, qk_dim), new_v=normal(num_tokens, v_dim),
        ctx_k=normal(num_ctx, qk_dim), ctx_v=normal(num_ctx, v_dim))


def reference_prefill(batch: PrefillBatch) -> np.ndarray:
    """f64[T, H, Dv]: monolithic float64 attention over each request's context + new tokens (causal).

    Query j of request r attends all `context_lens[r]` cached tokens and new tokens 0..j of r.
    """
    qsl, csl = batch.query_start_loc, batch.context_start_loc
    out = np.zeros((batch.num_tokens, batch.num_heads, batch.new_v.shape[2]), dtype=np.float64)
    for r in range(batch.num_requests):
        q0, q1, c0, c1 = int(qsl[r]), int(qsl[r + 1]), int(csl[r]), int(csl[r + 1])
        n, ctx = q1 - q0, c1 - c0
        if n == 0:
            continue
        q = batch.q[q0:q1].astype(np.float64)
        k = np.concatenate([batch.ctx_k[c0:c1], batch.new_k[q0:q1]]).astype(np.float64)
        v = np.concatenate([batch.ctx_v[c0:c1], batch.new_v[q0:q1]]).astype(np.float64)
        s = (q.transpose(1, 0, 2) @ k.transpose(1, 2, 0)) * batch.scale  # [H, n, ctx+n]; matmul uses BLAS
        visible = np.arange(ctx + n)[None, :] <= ctx + np.arange(n)[:, None]  # [n, ctx+n]
        s = np.where(visible[None], s, -np.inf)
        s -= s.max(axis=-1, keepdims=True)
        p = np.exp(s)
        p /= p.sum(axis=-1, keepdims=True)
        out[q0:q1] = (p @ v.transpose(1, 0, 2)).transpose(1, 0, 2)
    return out
