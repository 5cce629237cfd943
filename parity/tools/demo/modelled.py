"""The chunked-prefill demo on modelled attention backends (`python -m parity demo`): every backend behaviour on
empty rows (`EMPTY_BEHAVIORS`), every path, both frameworks; the batch sizes of the demo."""

from __future__ import annotations

import numpy as np

from parity.tools.chunked_prefill import (EMPTY_BEHAVIORS, ChunkPlan, PrefillBatch, attention_jax, attention_torch,
                                          bucket_size, chunk_gather_index, make_batch, reference_prefill)
from parity.tools.demo.chain import FIXED_PATHS, PATHS, combine, default_torch_device
from parity.tools.demo.rows import CORRUPTING_BEHAVIOR, FRAMEWORKS, TOLERANCE, judge_row, verdict

SIZES = ("default", "large", "real")


def demo_config(size: str = "default", seed: int = 0) -> dict:
    """The demo batch's shape, as `make_batch` keyword arguments (no data is drawn).

    default (interpreter-sized): context lens [90, 5, 40, 17, 0, 0], new tokens [7, 1, 20, 12, 3, 9],
    H=4, Dqk=96, Dv=64, workspace 128 rows, pages of 16 -> budget 32, 3 chunks: chunk 0 is empty only
    for the two requests without context, chunk 1 also for requests 1 and 3, chunk 2 for all but 0.
    large (GPU-sized): 64 requests, context up to 3000 (about a fifth without), 1-128 new tokens each,
    H=16, Dqk=192, Dv=128, workspace 32768 rows, pages of 64; the lengths are drawn from `seed`.
    Requests with context come first, as upstream orders them.
    real (for the real attention kernels): 40 requests, context 1-48 tokens (one request, the 21st, without),
    1-160 new tokens each, H=16, D=128, workspace 1024 rows, pages of 16 -> budget 16, 3 chunks; the request without
    context sits among the others, so `prefill_tokens_with_context` is None and its rows are merged in every chunk.
    """
    if size == "default":
        return dict(context_lens=[90, 5, 40, 17, 0, 0], query_lens=[7, 1, 20, 12, 3, 9], num_heads=4, qk_dim=96,
                    v_dim=64, workspace_rows=128, block_size=16)
    if size == "large":
        rng = np.random.default_rng(seed + 7919)
        ctx = rng.integers(1, 3001, size=64)
        ctx[rng.random(64) < 0.2] = 0
        ctx[0] = 3000  # the longest context sets the number of chunks
        ctx[-1] = 0  # at least one request without context
        ctx = np.concatenate([ctx[ctx > 0], ctx[ctx == 0]])  # requests with context first
        qlen = rng.integers(1, 129, size=64)
        return dict(context_lens=ctx.tolist(), query_lens=qlen.tolist(), num_heads=16, qk_dim=192, v_dim=128,
                    workspace_rows=32768, block_size=64)
    if size == "real":
        rng = np.random.default_rng(seed + 104729)
        ctx = rng.integers(1, 49, size=40)
        ctx[0] = 48  # 3 chunks
        ctx[20] = 0  # a request without context among the others: no pass-through count covers it
        qlen = rng.integers(1, 161, size=40)
        return dict(context_lens=ctx.tolist(), query_lens=qlen.tolist(), num_heads=16, qk_dim=128, v_dim=128,
                    workspace_rows=1024, block_size=16)
    raise ValueError(f"size must be one of {SIZES}, got {size!r}")


def demo_batch(size: str = "default", seed: int = 0) -> PrefillBatch:
    """The demo's batch (`demo_config`) with data drawn from `seed`."""
    return make_batch(**demo_config(size, seed), seed=seed)



# --------------------------------------------------------------------------------------------------
# The chunked prefill. The attention partials are framework code (`_partials_torch`, `_partials_jax`); the
# mask and merges run through `parity.harness.impls`, the same loop for every implementation (`_combine`).
# --------------------------------------------------------------------------------------------------

def _partials_torch(batch: PrefillBatch, plan: ChunkPlan, behavior: str, device: str) -> dict:
    """The chunk partials, the new-token partial and the offsets as torch tensors on `device`."""
    import torch

    def up(x):
        return torch.from_numpy(np.ascontiguousarray(x)).to(device)

    q, ctx_k, ctx_v = up(batch.q), up(batch.ctx_k), up(batch.ctx_v)
    qsl_host = batch.query_start_loc
    chunks = []  # (out f32[T, H, Dv], lse f32[H, T], cu i32[R+1] on device) per chunk
    for i in range(plan.num_chunks):
        idx = up(chunk_gather_index(plan, i, batch.context_start_loc))
        out, lse = attention_torch(q, ctx_k[idx], ctx_v[idx], qsl_host, plan.cu_seq_lens[i], causal=False,
                                   empty_behavior=behavior, scale=batch.scale)
        chunks.append((out, lse, up(plan.cu_seq_lens[i])))
    new_out, new_lse = attention_torch(q, up(batch.new_k), up(batch.new_v), qsl_host, qsl_host, causal=True,
                                       scale=batch.scale)
    return dict(chunks=chunks, new=(new_out, new_lse), qsl=up(qsl_host), context_cu=up(batch.context_start_loc))


def _partials_jax(batch: PrefillBatch, plan: ChunkPlan, behavior: str) -> dict:
    """`_partials_torch` on the JAX side (JAX's default device)."""
    import jax.numpy as jnp

    q, ctx_k, ctx_v = jnp.asarray(batch.q), jnp.asarray(batch.ctx_k), jnp.asarray(batch.ctx_v)
    qsl_host = batch.query_start_loc
    chunks = []
    for i in range(plan.num_chunks):
        idx = chunk_gather_index(plan, i, batch.context_start_loc).astype(np.int32)
        # Pad the gather to a power of two (rows past cu[R] are never read) so chunks share programs.
        idx = jnp.asarray(np.pad(idx, (0, bucket_size(idx.size) - idx.size)))
        out, lse = attention_jax(q, ctx_k[idx], ctx_v[idx], qsl_host, plan.cu_seq_lens[i], causal=False,
                                 empty_behavior=behavior, scale=batch.scale)
        chunks.append((out, lse, jnp.asarray(plan.cu_seq_lens[i])))
    new_out, new_lse = attention_jax(q, jnp.asarray(batch.new_k), jnp.asarray(batch.new_v), qsl_host, qsl_host,
                                     causal=True, scale=batch.scale)
    return dict(chunks=chunks, new=(new_out, new_lse), qsl=jnp.asarray(qsl_host),
                context_cu=jnp.asarray(batch.context_start_loc))



def _expected(behavior: str, path: str) -> str | None:
    if path in FIXED_PATHS:
        return "clean"
    if behavior == CORRUPTING_BEHAVIOR:
        return "corrupted"
    return None  # informational: the merge itself copes with +-inf



def run_batch(batch: PrefillBatch, *, framework: str = "both", device=None, tolerance: float = TOLERANCE,
              behaviors=None, jax_implementation: str = "pallas") -> tuple[list[dict], bool]:
    """Runs every (framework, empty behaviour, path) on `batch`; see `run_demo` for the results.

    `jax_implementation` picks `pallas_impl`'s implementation: "pallas" (the kernels; interpreted on
    CPU) or "jnp" (its fallback).
    """
    if framework not in ("both", *FRAMEWORKS):
        raise ValueError(f"framework must be 'both', 'torch' or 'jax', got {framework!r}")
    frameworks = FRAMEWORKS if framework == "both" else (framework,)
    behaviors = tuple(EMPTY_BEHAVIORS) if behaviors is None else tuple(behaviors)
    for b in behaviors:
        if b not in EMPTY_BEHAVIORS:
            raise ValueError(f"unknown empty behaviour {b!r}; known: {list(EMPTY_BEHAVIORS)}")
    from parity.library import bridge
    from parity.harness import impls

    plan = batch.plan()
    ptwc = batch.prefill_tokens_with_context()
    want = reference_prefill(batch)
    rt = impls.make_runtime()
    torch_device = default_torch_device(device) if "torch" in frameworks else None
    meta = dict(num_requests=batch.num_requests, num_tokens=batch.num_tokens, num_heads=batch.num_heads,
                num_chunks=plan.num_chunks, budget=plan.budget, has_empty=list(plan.has_empty),
                prefill_tokens_with_context=ptwc, tolerance=tolerance)
    rows = []
    for fw in frameworks:
        if fw == "jax":
            import jax

            fw_device = f"{jax.devices()[0]}/{jax_implementation}"
        else:
            fw_device = torch_device
        for behavior in behaviors:
            # The interpreters compute with numpy: exp(-inf - -inf) and friends in masked lanes would warn.
            with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
                if fw == "torch":
                    parts, a = _partials_torch(batch, plan, behavior, torch_device), impls.adapter(rt, "triton")
                else:
                    parts, a = _partials_jax(batch, plan, behavior), impls.adapter(rt, jax_implementation)
                results = combine(a, parts, plan, ptwc)
                new_out = bridge.to_numpy(parts["new"][0])
            for path in PATHS:
                row = dict(framework=fw, device=fw_device, empty_behavior=behavior, path=path,
                           fixed=path in FIXED_PATHS)
                judge_row(row, results[path], want, new_out, batch.query_start_loc, ptwc, _expected(behavior, path),
                          tolerance=tolerance)
                row.update(meta)
                rows.append(row)
    # The demo must show the bug: the finite-garbage behaviour has to be among those run.
    return rows, verdict(rows)
