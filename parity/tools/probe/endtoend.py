"""End to end on one backend: a chunked-context prefill whose attention partials the backend computes, merged three
ways and compared with monolithic float64 attention.

Paths: `naive` (upstream's merge formula trusting every LSE: `parity.tools.demo.naive_merge`), `merge` (this
project's merge, no mask) and `mask_then_merge` (`mask_empty_context_lse` on each chunk, then the merge), both
through `parity.harness.impls`. The backend's LSE is brought to this project's convention first: `[H, T]`, natural
log (x ln 2 for a base-2 LSE, which keeps +-inf, NaN and every finite value's class).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from parity.tools.probe.core import NUM_HEADS, HEAD_DIM, Inputs, Spec, round_to

# A request without context (1) among requests with context: `prefill_tokens_with_context` is None, so its rows are
# merged in every chunk (empty on both sides); budget 24 // 3 = 8 rows per request per chunk, 3 chunks: request 2
# runs out after chunk 0, request 3 after chunk 1.
BATCH = dict(context_lens=[20, 0, 3, 9], query_lens=[3, 2, 2, 4], workspace_rows=24, block_size=4)
PATHS = ("naive", "merge", "mask_then_merge")


def _batch(dtype: str, seed: int):
    from parity.tools.chunked_prefill import make_batch

    b = make_batch(BATCH["context_lens"], BATCH["query_lens"], num_heads=NUM_HEADS, qk_dim=HEAD_DIM, v_dim=HEAD_DIM,
                   workspace_rows=BATCH["workspace_rows"], block_size=BATCH["block_size"], seed=seed)
    return dataclasses.replace(b, **{f: round_to(getattr(b, f), dtype) for f in ("q", "new_k", "new_v", "ctx_k",
                                                                                "ctx_v")})


def _partial(backend, q, k, v, q_lens, kv_lens, causal: bool, base: str | None):
    """(out f32[T, H, D], lse f32[H, T] natural log) of one backend call over packed numpy rows."""
    spec = Spec(tuple(q_lens), tuple(int(n) for n in kv_lens), causal=causal)
    if k.shape[0] == 0:  # a chunk without any KV row: hand the kernel one row nobody attends to
        k, v = np.zeros((1,) + k.shape[1:], np.float32), np.zeros((1,) + v.shape[1:], np.float32)
    raw = backend.run(spec, Inputs(q=q, k=k, v=v, scale=HEAD_DIM ** -0.5))
    if raw.lse is None:
        raise RuntimeError("the backend gives no LSE: nothing to merge")
    lse = raw.lse[:, :spec.num_tokens]
    if base == "2":
        lse = lse * np.float32(math.log(2))
    return np.ascontiguousarray(raw.out[:spec.num_tokens], np.float32), np.ascontiguousarray(lse, np.float32)


def _to_impl(x, impl: str, rt):
    if impl == "reference":
        return x
    if impl == "triton":
        import torch

        return torch.from_numpy(np.ascontiguousarray(x)).to(rt.device)
    import jax.numpy as jnp

    return jnp.asarray(x)


def run_end_to_end(backend, *, base: str | None, merge_impl: str, seed: int = 0) -> dict:
    """The chunked prefill on `backend`; {path: corrupted rows, ...} plus the batch's description."""
    from parity.harness import impls
    from parity.library import bridge
    from parity.tools.chunked_prefill import chunk_gather_index, reference_prefill
    from parity.tools.demo import TOLERANCE_BF16, compare_rows, naive_merge

    batch = _batch(backend.dtype, seed)
    plan = batch.plan()
    ptwc = batch.prefill_tokens_with_context()
    want = reference_prefill(batch)
    q_lens = batch.query_lens
    chunks = []
    with np.errstate(all="ignore"):
        for i in range(plan.num_chunks):
            idx = chunk_gather_index(plan, i, batch.context_start_loc)
            chunks.append(_partial(backend, batch.q, batch.ctx_k[idx], batch.ctx_v[idx], q_lens,
                                   plan.chunk_seq_lens[i], False, base))
        new = _partial(backend, batch.q, batch.new_k, batch.new_v, q_lens, q_lens, True, base)
    rt = impls.make_runtime()
    a = impls.adapter(rt, merge_impl)
    qsl = batch.query_start_loc

    def up(x):
        return _to_impl(x, merge_impl, rt)

    # One tolerance for every dtype: f32 kernels may run TF32 on a GPU; an empty row's garbage is off by O(1).
    tolerance = TOLERANCE_BF16
    result = dict(merge_impl=merge_impl, tolerance=tolerance, context_lens=BATCH["context_lens"],
                  query_lens=BATCH["query_lens"], num_chunks=plan.num_chunks, budget=plan.budget,
                  prefill_tokens_with_context=ptwc, lse_converted="x ln 2" if base == "2" else None, paths={})
    for path in PATHS:
        with np.errstate(all="ignore"):
            state = None
            for i, (out, lse) in enumerate(chunks):
                if path == "naive":
                    part = (out, lse)
                else:
                    part = (up(out), up(lse))
                    if path == "mask_then_merge":
                        r = a.mask(part[1], up(qsl), up(plan.cu_seq_lens[i]), part[0], has_empty=plan.has_empty[i])
                        part = (r["output"], r["lse"])
                if state is None:
                    state = part
                    continue
                r = naive_merge(*state, *part) if path == "naive" else a.merge(*state, *part)
                state = (r["out"], r["lse"])
            final = (new if path == "naive" else (up(new[0]), up(new[1])))
            merge = naive_merge if path == "naive" else a.merge
            r = merge(*state, *final, prefill_tokens_with_context=ptwc)
            got = np.asarray(bridge.to_numpy(r["out"]), np.float32)
        cmp = compare_rows(got, want, qsl, tolerance=tolerance)
        result["paths"][path] = {k: cmp[k] for k in ("rows_corrupted", "rows_total", "requests_corrupted", "any_nan",
                                                     "max_abs_err")}
    return result
