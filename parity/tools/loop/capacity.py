"""The fixed capacity of a captured chunked-context step, and batches written at that capacity.

A captured step (one CUDA graph, one jitted function) has static shapes: at most `num_tokens` new tokens of at most
`num_requests` requests, `num_chunks` context chunks of `workspace_rows` KV rows each, a request at most
`max_query_len` new tokens and at most `chunk_kv` KV rows in a chunk. A batch is planned as upstream plans it
(`plan_chunks`) and written into arrays of exactly those shapes (`StepInputs`): requests past the batch's have no
tokens, chunks past its plan have no KV (every request is empty there), tokens past its last are padding. What
changes between batches is data only: the offsets and the inputs, never a shape, a host flag or a host integer.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from parity.tools.chunked_prefill.planner import ChunkPlan, chunk_gather_index
from parity.tools.chunked_prefill.reference import PrefillBatch, make_batch


@dataclasses.dataclass(frozen=True)
class Capacity:
    """Static sizes of one captured step. `min_context_requests` bounds the chunk budget: a batch with fewer
    requests with context would get `workspace_rows // n` rows per request per chunk, more than `chunk_kv`."""

    num_tokens: int
    num_requests: int
    num_chunks: int
    workspace_rows: int
    block_size: int
    max_query_len: int
    min_context_requests: int
    num_heads: int
    qk_dim: int
    v_dim: int

    @property
    def chunk_kv(self) -> int:
        """The largest KV rows of one request in one chunk: the budget of `min_context_requests` requests."""
        return self.workspace_rows // self.min_context_requests // self.block_size * self.block_size

    @property
    def context_rows(self) -> int:
        """Rows of the cached-context buffer: every chunk full."""
        return self.num_chunks * self.workspace_rows

    def with_chunks(self, num_chunks: int) -> "Capacity":
        return dataclasses.replace(self, num_chunks=int(num_chunks))

    def check(self, batch: PrefillBatch, plan: ChunkPlan) -> None:
        """Raises ValueError naming the first size of `batch` past this capacity."""
        qlen = np.asarray(batch.query_lens)
        checks = (("tokens", batch.num_tokens, self.num_tokens), ("requests", batch.num_requests, self.num_requests),
                  ("chunks", plan.num_chunks, self.num_chunks), ("query tokens of a request",
                                                                  int(qlen.max(initial=0)), self.max_query_len),
                  ("chunk budget", plan.budget, self.chunk_kv),
                  ("context rows", int(batch.context_start_loc[-1]), self.context_rows))
        for what, got, cap in checks:
            if got > cap:
                raise ValueError(f"the batch's {what} ({got}) exceed the step's capacity ({cap}): {self}")
        if batch.num_heads != self.num_heads or batch.q.shape[2] != self.qk_dim or batch.new_v.shape[2] != self.v_dim:
            raise ValueError(f"the batch's heads and head sizes {batch.q.shape[1:]}, {batch.new_v.shape[2]} are not "
                             f"the capacity's ({self.num_heads}, {self.qk_dim}, {self.v_dim})")


# CPU CI (interpreters): tiny. GPU: an MLA prefill head (qk 192 = 128 + 64 rope, v 128), 16 local heads.
CAPACITIES = {
    "ci": Capacity(num_tokens=16, num_requests=4, num_chunks=2, workspace_rows=16, block_size=4, max_query_len=4,
                   min_context_requests=2, num_heads=2, qk_dim=16, v_dim=8),
    "gpu": Capacity(num_tokens=8192, num_requests=64, num_chunks=8, workspace_rows=8192, block_size=64,
                    max_query_len=128, min_context_requests=32, num_heads=16, qk_dim=192, v_dim=128),
}


def loop_batches(cap: Capacity, count: int, seed: int = 0) -> list[PrefillBatch]:
    """`count` seeded batches that fit `cap`, of different lengths: the first uses all `cap.num_chunks` chunks, the
    others 1 to `num_chunks`; each has requests without context among the others (so no
    `prefill_tokens_with_context` covers them) and fewer requests and tokens than the capacity."""
    rng = np.random.default_rng(seed + 7207)
    batches = []
    for b in range(count):
        num_requests = int(rng.integers(max(cap.min_context_requests + 1, cap.num_requests // 2), cap.num_requests + 1))
        with_context = int(rng.integers(cap.min_context_requests, num_requests))  # at least one request without
        budget = cap.workspace_rows // with_context // cap.block_size * cap.block_size
        chunks = cap.num_chunks if b == 0 else int(rng.integers(1, cap.num_chunks + 1))
        longest = (chunks - 1) * budget + int(rng.integers(1, budget + 1))  # needs exactly `chunks` chunks
        ctx = rng.integers(1, longest + 1, size=with_context)
        ctx[0] = longest
        ctx = np.concatenate([ctx, np.zeros(num_requests - with_context, np.int64)])
        rng.shuffle(ctx)
        qlen = rng.integers(1, cap.max_query_len + 1, size=num_requests)
        while qlen.sum() > cap.num_tokens:
            qlen = np.maximum(qlen // 2, 1)
        batches.append(make_batch(ctx.tolist(), qlen.tolist(), num_heads=cap.num_heads, qk_dim=cap.qk_dim,
                                  v_dim=cap.v_dim, workspace_rows=cap.workspace_rows, block_size=cap.block_size,
                                  seed=seed + 31 * b))
    return batches


@dataclasses.dataclass(frozen=True, eq=False)
class StepInputs:
    """One batch at a capacity, as host arrays of the capacity's shapes (what is copied into the step's buffers).

    Attributes:
        query_start_loc: i32[R+1]; requests past the batch's are empty (their offsets repeat the batch's T).
        cu_seq_lens: i32[C + 1, R+1]: rows 0..C-1 the chunks' KV offsets (a chunk past the plan: all 0), row C the
            new tokens' (= query_start_loc): the N-way merge's per-partial offsets.
        context_cu: i32[R+1], each request's whole cached context (empty iff it has none): the final merge's mask.
        gather: i32[C, W], chunk i's workspace rows as rows of `ctx_k` / `ctx_v` (padding reads row 0).
        q, new_k: f32[T, H, Dqk]; new_v: f32[T, H, Dv]; ctx_k: f32[Nctx, H, Dqk]; ctx_v: f32[Nctx, H, Dv], zero
            past the batch's rows.
        num_tokens: the batch's T (the rows compared; rows past it are padding).
    """

    query_start_loc: np.ndarray
    cu_seq_lens: np.ndarray
    context_cu: np.ndarray
    gather: np.ndarray
    q: np.ndarray
    new_k: np.ndarray
    new_v: np.ndarray
    ctx_k: np.ndarray
    ctx_v: np.ndarray
    num_tokens: int


def _padded(x: np.ndarray, rows: int) -> np.ndarray:
    out = np.zeros((rows, *x.shape[1:]), np.float32)
    out[:x.shape[0]] = x
    return out


def step_inputs(cap: Capacity, batch: PrefillBatch) -> StepInputs:
    """`batch` written at capacity `cap` (raises ValueError when it does not fit)."""
    plan = batch.plan()
    cap.check(batch, plan)
    r_cap = cap.num_requests

    def offsets(x: np.ndarray) -> np.ndarray:
        out = np.full(r_cap + 1, x[-1], np.int32)
        out[:x.size] = x
        return out

    qsl = offsets(batch.query_start_loc)
    cu = np.zeros((cap.num_chunks + 1, r_cap + 1), np.int32)
    gather = np.zeros((cap.num_chunks, cap.workspace_rows), np.int32)
    for i in range(plan.num_chunks):
        cu[i] = offsets(plan.cu_seq_lens[i])
        idx = chunk_gather_index(plan, i, batch.context_start_loc)
        gather[i, :idx.size] = idx
    cu[cap.num_chunks] = qsl
    return StepInputs(query_start_loc=qsl, cu_seq_lens=cu, context_cu=offsets(batch.context_start_loc),
                      gather=gather, q=_padded(batch.q, cap.num_tokens), new_k=_padded(batch.new_k, cap.num_tokens),
                      new_v=_padded(batch.new_v, cap.num_tokens), ctx_k=_padded(batch.ctx_k, cap.context_rows),
                      ctx_v=_padded(batch.ctx_v, cap.context_rows), num_tokens=batch.num_tokens)
