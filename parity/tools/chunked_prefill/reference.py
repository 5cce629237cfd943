"""Prefill batches (framework-neutral numpy) and their float64 ground truth: monolithic attention over each
request's cached context + new tokens, which the chunked result must reproduce."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from parity.tools.chunked_prefill.planner import ChunkPlan, _check_lens, plan_chunks, prefill_tokens_with_context


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


def rounded(batch: PrefillBatch, dtype: str) -> PrefillBatch:
    """The batch with q, k and v rounded to `dtype` (kept as f32): a kernel fed `dtype` and the float64 reference then
    read the same values."""
    if dtype == "float32":
        return batch
    import ml_dtypes

    def r(x):
        return x.astype(getattr(ml_dtypes, dtype)).astype(np.float32)

    return dataclasses.replace(batch, q=r(batch.q), new_k=r(batch.new_k), new_v=r(batch.new_v), ctx_k=r(batch.ctx_k),
                               ctx_v=r(batch.ctx_v))
