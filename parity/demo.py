"""End-to-end demo: the MLA chunked-context prefill corruption (docs/spec.md 1) and its fix, in both frameworks.

A prefill batch with cached context is attended chunk by chunk (`parity.chunked_prefill`), the chunks
are merged, then merged with the causal attention over the new tokens, and the result is compared
with monolithic float64 attention. Each framework runs three paths over the same attention partials:

- `no_mask`: upstream before the fix, merge only. Rows of a request whose context ran out in a chunk
  are merged as if they were data.
- `mask_then_merge`: `mask_empty_context_lse(..., output=...)` on every chunk that has an empty row
  (the host guard `has_empty`), then `merge_attn_states`.
- `fused`: `merge_attn_states(..., query_start_loc=, prefix_cu_seq_lens=)`, one launch per merge. The
  fused mask reads the *prefix* operand's offsets, and the operand that can be empty is the new chunk,
  so this path passes the new chunk as the prefix and the running state as the suffix (the merge is
  symmetric in its two partials, docs/spec.md 4.3). A request empty in chunk 0 has no context at all; its
  running state stays unmasked and the final merge neutralises it (fused mask over the whole-context
  offsets, plus `prefill_tokens_with_context`).

Each is run for every backend behaviour on empty rows (`EMPTY_BEHAVIORS`). Only a *finite* LSE
breaks the unfixed path: the merge reads -inf (FA3) as empty and normalises +inf (FA2) to -inf
(docs/spec.md 4.1), so those rows stay clean even without the mask. The table says so rather than hiding it.

`run_demo` is the entry point of `python -m parity demo`; `format_demo_table` renders its rows.
"""

from __future__ import annotations

import math

import numpy as np

from parity.chunked_prefill import (EMPTY_BEHAVIORS, ChunkPlan, PrefillBatch, attention_jax, attention_torch,
                                    bucket_size, chunk_gather_index, make_batch, reference_prefill)

FRAMEWORKS = ("torch", "jax")
PATHS = ("no_mask", "mask_then_merge", "fused")
FIXED_PATHS = ("mask_then_merge", "fused")
SIZES = ("default", "large")
# fp32 end to end; the attention partials and the merges are off the float64 reference by ~1e-6.
TOLERANCE = 1e-3
# The behaviour whose unfixed path must show the corruption (the others are handled by the merge).
CORRUPTING_BEHAVIOR = "finite_nan"


def demo_config(size: str = "default", seed: int = 0) -> dict:
    """The demo batch's shape, as `make_batch` keyword arguments (no data is drawn).

    default (interpreter-sized): context lens [90, 5, 40, 17, 0, 0], new tokens [7, 1, 20, 12, 3, 9],
    H=4, Dqk=96, Dv=64, workspace 128 rows, pages of 16 -> budget 32, 3 chunks: chunk 0 is empty only
    for the two requests without context, chunk 1 also for requests 1 and 3, chunk 2 for all but 0.
    large (GPU-sized): 64 requests, context up to 3000 (about a fifth without), 1-128 new tokens each,
    H=16, Dqk=192, Dv=128, workspace 32768 rows, pages of 64; the lengths are drawn from `seed`.
    Requests with context come first, as upstream orders them.
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
    raise ValueError(f"size must be one of {SIZES}, got {size!r}")


def demo_batch(size: str = "default", seed: int = 0) -> PrefillBatch:
    """The demo's batch (`demo_config`) with data drawn from `seed`."""
    return make_batch(**demo_config(size, seed), seed=seed)


def _default_torch_device(device):
    if device is not None:
        return str(device)
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


# --------------------------------------------------------------------------------------------------
# The chunked prefill. The attention partials are framework code (`_partials_torch`, `_partials_jax`); the
# mask and merges run through `parity.impls`, the same loop for every implementation (`_combine`).
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


def _combine(a, parts: dict, plan: ChunkPlan, ptwc) -> dict:
    """{path: f32[T, H, Dv] numpy}: each path's mask and merges over the partials, through adapter `a`."""
    from parity import bridge

    qsl, context_cu = parts["qsl"], parts["context_cu"]
    new_out, new_lse = parts["new"]
    results = {}
    for path in PATHS:
        state = None  # (out, lse) of the context so far
        for i, (out, lse, cu) in enumerate(parts["chunks"]):
            if path == "mask_then_merge":
                r = a.mask(lse, qsl, cu, out, has_empty=plan.has_empty[i])
                out, lse = r["output"], r["lse"]
            if state is None:
                state = (out, lse)
                continue
            if path == "fused":  # the new chunk is the prefix: its offsets drive the fused mask
                r = a.merge(out, lse, state[0], state[1], query_start_loc=qsl, prefix_cu_seq_lens=cu)
            else:
                r = a.merge(state[0], state[1], out, lse)
            state = (r["out"], r["lse"])
        if state is None:  # no request has context
            results[path] = bridge.to_numpy(new_out)
            continue
        fused = dict(query_start_loc=qsl, prefix_cu_seq_lens=context_cu) if path == "fused" else {}
        r = a.merge(state[0], state[1], new_out, new_lse, prefill_tokens_with_context=ptwc, return_lse=False,
                    **fused)
        results[path] = bridge.to_numpy(r["out"])
    return results


# --------------------------------------------------------------------------------------------------
# Comparison, entry point, table
# --------------------------------------------------------------------------------------------------

def _expected(behavior: str, path: str) -> str | None:
    if path in FIXED_PATHS:
        return "clean"
    if behavior == CORRUPTING_BEHAVIOR:
        return "corrupted"
    return None  # informational: the merge itself copes with +-inf


def compare_rows(got: np.ndarray, want: np.ndarray, query_start_loc: np.ndarray, *,
                 tolerance: float = TOLERANCE) -> dict:
    """Row-level comparison of a prefill output with the float64 reference.

    A token row is corrupted when any element is NaN or off by more than `tolerance` (absolute).
    Returns rows_corrupted, rows_total, requests_corrupted (indices), max_abs_err (over the non-NaN
    elements; inf if any element is inf), any_nan.
    """
    got = np.asarray(got, dtype=np.float64)
    if got.shape != want.shape:
        raise ValueError(f"{got.shape=} != {want.shape=}")
    err = np.abs(got - want)
    nan = np.isnan(got)
    bad_row = (nan | (err > tolerance)).reshape(got.shape[0], -1).any(axis=1)
    qsl = np.asarray(query_start_loc)
    req_of_token = np.searchsorted(qsl, np.arange(got.shape[0]), side="right") - 1
    finite_err = err[~np.isnan(err)]
    return dict(
        rows_corrupted=int(bad_row.sum()), rows_total=int(got.shape[0]),
        requests_corrupted=sorted({int(r) for r in req_of_token[bad_row]}),
        max_abs_err=float(finite_err.max()) if finite_err.size else math.nan,
        any_nan=bool(nan.any()))


def judge_row(row: dict, got: np.ndarray, want: np.ndarray, new_out: np.ndarray, query_start_loc: np.ndarray,
              ptwc: int | None, expected: str | None, *, tolerance: float = TOLERANCE) -> dict:
    """Fill one table row: the comparison with the reference, the pass-through check, and whether the path did
    what it must (`expected`: "clean", "corrupted", or None for informational rows)."""
    row.update(compare_rows(got, want, query_start_loc, tolerance=tolerance))
    row["passthrough_exact"] = _passthrough_exact(got, new_out, ptwc)
    clean = row["rows_corrupted"] == 0 and not row["any_nan"] and row["passthrough_exact"] is not False
    row["expected"] = expected
    row["ok"] = (expected is None or (expected == "clean" and clean)
                 or (expected == "corrupted" and row["rows_corrupted"] > 0))
    return row


def verdict(rows: list[dict]) -> bool:
    """Every row did what it must, and the demo showed the bug: some row was expected to be corrupted."""
    return all(r["ok"] for r in rows) and any(r["expected"] == "corrupted" for r in rows)


def _passthrough_exact(got: np.ndarray, new_out: np.ndarray, ptwc: int | None) -> bool | None:
    """Rows past `prefill_tokens_with_context` (requests without context) equal the new-token partial's bits."""
    if ptwc is None or ptwc >= got.shape[0]:
        return None
    a = np.ascontiguousarray(got[ptwc:], dtype=np.float32).view(np.uint32)
    b = np.ascontiguousarray(new_out[ptwc:], dtype=np.float32).view(np.uint32)
    return bool(np.array_equal(a, b))


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
    from parity import bridge, impls

    plan = batch.plan()
    ptwc = batch.prefill_tokens_with_context()
    want = reference_prefill(batch)
    rt = impls.make_runtime()
    torch_device = _default_torch_device(device) if "torch" in frameworks else None
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
                results = _combine(a, parts, plan, ptwc)
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


def run_demo(*, framework: str = "both", device=None, size: str = "default", seed: int = 0) -> tuple[list[dict], bool]:
    """Reproduces the chunked-context prefill corruption and its fix.

    Args:
        framework: "both", "torch" (Triton kernels) or "jax" (Pallas kernels).
        device: torch device string; None picks "cuda" when available, else "cpu" (Triton then runs in
            its interpreter). The JAX side uses JAX's default device.
        size: "default" (small, for CPU interpreters) or "large" (64 requests, thousands of tokens).
        seed: data seed (and, for "large", the length draw).

    Returns:
        (rows, ok). One row per (framework, empty_behavior, path): rows_corrupted / rows_total,
        requests_corrupted, max_abs_err, any_nan, passthrough_exact (rows of requests without context
        are bit copies of the new-token partial; None if there are none), expected ("clean",
        "corrupted" or None for information only), ok, and the batch's shape. `ok` holds when every
        fixed path is clean for every behaviour and the unfixed path is corrupted for the finite-LSE
        behaviour.

    Raises:
        ValueError: unknown framework or size.
        ImportError: the chosen framework's kernels cannot be imported.
    """
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")
    return run_batch(demo_batch(size, seed), framework=framework, device=device)


def format_demo_table(rows: list[dict]) -> str:
    """A plain-text table of `run_demo` rows, with a caption line describing the batch."""
    if not rows:
        return "(no rows)"
    r0 = rows[0]
    lines = []
    if "cp" in r0:
        lines.append(f"context-parallel prefill: KV over N={r0['cp']} ranks (token j on rank (j // {r0['interleave']}) % "
                     f"{r0['cp']}), R={r0['num_requests']} T={r0['num_tokens']} H={r0['num_heads']}, "
                     f"{r0['empty_rank_requests']} (rank, request) pairs with context but no local KV, "
                     f"prefill_tokens_with_context={r0['prefill_tokens_with_context']} "
                     f"tolerance={r0['tolerance']:g} (abs, vs float64 monolithic attention)")
    elif "num_chunks" in r0:
        lines.append(f"chunked-context prefill: R={r0['num_requests']} T={r0['num_tokens']} H={r0['num_heads']} "
                     f"chunks={r0['num_chunks']} budget={r0['budget']} has_empty={r0['has_empty']} "
                     f"prefill_tokens_with_context={r0['prefill_tokens_with_context']} "
                     f"tolerance={r0['tolerance']:g} (abs, vs float64 monolithic attention)")
    header = ("framework", "device", "empty rows", "path", "corrupted rows", "requests", "max abs err*", "NaN",
              "pass-through", "expected", "result")

    def cell(r):
        beh = EMPTY_BEHAVIORS.get(r["empty_behavior"])
        lse = "" if beh is None else f" (lse {beh.lse:g})"
        pt = {None: "-", True: "exact", False: "DIFFERS"}[r["passthrough_exact"]]
        reqs = r["requests_corrupted"]
        reqs_s = "-" if not reqs else ",".join(map(str, reqs[:8])) + (",..." if len(reqs) > 8 else "")
        result = "info" if r["expected"] is None else ("ok" if r["ok"] else "FAIL")
        return (r["framework"], r.get("device", ""), r["empty_behavior"] + lse, r["path"],
                f"{r['rows_corrupted']}/{r['rows_total']}", reqs_s, f"{r['max_abs_err']:.2e}",
                "yes" if r["any_nan"] else "no", pt, r["expected"] or "-", result)

    body = [cell(r) for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(header)]
    right = {4, 6}  # numeric columns

    def fmt(cells):
        padded = (c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
        return "  ".join(padded).rstrip()

    lines += [fmt(header), fmt(["-" * w for w in widths])] + [fmt(b) for b in body]
    lines.append("* over the elements that are not NaN; a NaN element corrupts its row (column NaN).")
    return "\n".join(lines)
