"""The chunk planner of MLA chunked-context prefill (upstream's workspace scheme; docs/spec.md 1).

A batch of prefill requests, each with `context_lens[r]` cached KV tokens, attends its cached context in
workspace-sized chunks: every request with context gets the same per-chunk budget, so a short context runs out
early and its rows are *empty* in later chunks. Offsets are int32 numpy arrays on the host, as upstream makes them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np


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
