"""End-to-end demo: the MLA chunked-context prefill corruption (docs/spec.md 1) and its fix, in both frameworks.

A prefill batch with cached context is attended chunk by chunk (`parity.tools.chunked_prefill`), the chunks
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

import dataclasses
import math

import numpy as np

from parity.tools.chunked_prefill.attention import EMPTY_BEHAVIORS, attention_jax, attention_torch, bucket_size
from parity.tools.chunked_prefill.kernels import REAL_BACKENDS, attention_real, empty_row_classes, real_backend
from parity.tools.chunked_prefill.planner import ChunkPlan, chunk_gather_index
from parity.tools.chunked_prefill.reference import PrefillBatch, make_batch, reference_prefill

FRAMEWORKS = ("torch", "jax")
PATHS = ("no_mask", "mask_then_merge", "fused")
FIXED_PATHS = ("mask_then_merge", "fused")
# With a real attention kernel: upstream's merge formula before its both-empty guard (`naive_merge`), without and
# with the mask in front of it.
NAIVE_PATHS = ("naive", "naive_mask")
SIZES = ("default", "large", "real")
BACKENDS = ("modelled", *REAL_BACKENDS)
# fp32 end to end; the attention partials and the merges are off the float64 reference by ~1e-6.
TOLERANCE = 1e-3
# bf16 partials (the real GPU kernels): each of the chain's roundings (the partials, then every merge's output) is
# off by up to 2^-9 of a value, and attention outputs of standard-normal V stay within a few units.
TOLERANCE_BF16 = 5e-2
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


def _default_torch_device(device):
    if device is not None:
        return str(device)
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


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


def _partials_real(batch: PrefillBatch, plan: ChunkPlan, backend: str, device: str) -> tuple[dict, dict]:
    """The partials computed by a real attention kernel (`REAL_BACKENDS`) in its own framework, and what it left in
    the rows of requests with no KV in a chunk (`empty_row_classes`, summed over the chunks)."""
    b = real_backend(backend)
    if b.framework == "torch":
        import torch

        dtype = getattr(torch, b.dtype)

        def up(x):
            return torch.from_numpy(np.ascontiguousarray(x)).to(device=device, dtype=dtype)

        def up_i32(x):
            return torch.from_numpy(np.ascontiguousarray(x, dtype=np.int32)).to(device)
    else:
        import jax.numpy as jnp

        def up(x):
            return jnp.asarray(x, dtype=b.dtype)

        def up_i32(x):
            return jnp.asarray(x, dtype=jnp.int32)
    q, ctx_k, ctx_v = up(batch.q), up(batch.ctx_k), up(batch.ctx_v)
    qsl_host = batch.query_start_loc
    chunks, observed = [], None
    for i in range(plan.num_chunks):
        idx = chunk_gather_index(plan, i, batch.context_start_loc)
        idx = up_i32(idx) if b.framework == "torch" else idx
        out, lse = attention_real(backend, q, ctx_k[idx], ctx_v[idx], qsl_host, plan.cu_seq_lens[i], causal=False,
                                  scale=batch.scale)
        seen = empty_row_classes(_host(out), _host(lse), qsl_host, plan.cu_seq_lens[i])
        observed = seen if observed is None else {k: {c: observed[k][c] + n for c, n in v.items()}
                                                  for k, v in seen.items()}
        chunks.append((out, lse, up_i32(plan.cu_seq_lens[i])))
    new_out, new_lse = attention_real(backend, q, up(batch.new_k), up(batch.new_v), qsl_host, qsl_host, causal=True,
                                      scale=batch.scale)
    parts = dict(chunks=chunks, new=(new_out, new_lse), qsl=up_i32(qsl_host), context_cu=up_i32(batch.context_start_loc))
    return parts, observed


def _host(x) -> np.ndarray:
    from parity.library import bridge

    return bridge.to_numpy(x).astype(np.float32)


def _to_framework(parts: dict, framework: str) -> dict:
    """The partials handed to the other framework over DLPack (zero-copy; a strided view is made contiguous first,
    a visible copy, since DLPack into JAX takes compact strides only)."""
    from parity.library import bridge

    def conv(x):
        if framework == "jax":
            return x if not hasattr(x, "contiguous") else bridge.torch_to_jax(x.contiguous())
        return x if hasattr(x, "contiguous") else bridge.jax_to_torch(x)

    return dict(chunks=[tuple(conv(x) for x in c) for c in parts["chunks"]], new=tuple(conv(x) for x in parts["new"]),
                qsl=conv(parts["qsl"]), context_cu=conv(parts["context_cu"]))


def naive_merge(prefix_output, prefix_lse, suffix_output, suffix_lse, *, prefill_tokens_with_context=None,
                **_) -> dict:
    """Upstream vLLM's Triton merge formula as of the revision that added the mask, before its both-empty guard, in
    f32 numpy: +inf is read as -inf, then `m = max(p, s)` and `exp(p - m)`, which is NaN when both are -inf
    (docs/spec.md 4.2 is the guard it lacks). Tokens at or past `prefill_tokens_with_context` copy the suffix."""
    a, b = _host(prefix_output), _host(suffix_output)
    p, s = _host(prefix_lse), _host(suffix_lse)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        p = np.where(p == np.inf, -np.inf, p)
        s = np.where(s == np.inf, -np.inf, s)
        m = np.maximum(p, s)
        pe, se = np.exp(p - m), np.exp(s - m)
        z = pe + se
        out = a * (pe / z).T[..., None] + b * (se / z).T[..., None]
        lse = np.log(z) + m
    t = a.shape[0] if prefill_tokens_with_context is None else int(prefill_tokens_with_context)
    out[t:], lse[:, t:] = b[t:], _host(suffix_lse)[:, t:]
    return dict(out=out, lse=lse)


def _combine(a, parts: dict, plan: ChunkPlan, ptwc, paths=PATHS) -> dict:
    """{path: f32[T, H, Dv] numpy}: each path's mask and merges over the partials, through adapter `a` (the naive
    paths merge with `naive_merge`)."""
    from parity.library import bridge

    qsl, context_cu = parts["qsl"], parts["context_cu"]
    new_out, new_lse = parts["new"]
    results = {}
    for path in paths:
        merge = naive_merge if path in NAIVE_PATHS else a.merge
        state = None  # (out, lse) of the context so far
        for i, (out, lse, cu) in enumerate(parts["chunks"]):
            if path in ("mask_then_merge", "naive_mask"):
                r = a.mask(lse, qsl, cu, out, has_empty=plan.has_empty[i])
                out, lse = r["output"], r["lse"]
            if state is None:
                state = (out, lse)
                continue
            if path == "fused":  # the new chunk is the prefix: its offsets drive the fused mask
                r = a.merge(out, lse, state[0], state[1], query_start_loc=qsl, prefix_cu_seq_lens=cu)
            else:
                r = merge(state[0], state[1], out, lse)
            state = (r["out"], r["lse"])
        if state is None:  # no request has context
            results[path] = bridge.to_numpy(new_out)
            continue
        fused = dict(query_start_loc=qsl, prefix_cu_seq_lens=context_cu) if path == "fused" else {}
        r = merge(state[0], state[1], new_out, new_lse, prefill_tokens_with_context=ptwc, return_lse=False, **fused)
        results[path] = bridge.to_numpy(r["out"]).astype(np.float32)
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
    from parity.library import bridge
    from parity.harness import impls

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


def _rounded(batch: PrefillBatch, dtype: str) -> PrefillBatch:
    """The batch with q, k and v rounded to `dtype` (kept as f32): the kernel and the float64 reference then read
    the same values."""
    if dtype == "float32":
        return batch
    import ml_dtypes

    def r(x):
        return x.astype(getattr(ml_dtypes, dtype)).astype(np.float32)

    return dataclasses.replace(batch, q=r(batch.q), new_k=r(batch.new_k), new_v=r(batch.new_v), ctx_k=r(batch.ctx_k),
                               ctx_v=r(batch.ctx_v))


def _both_empty_tokens(batch: PrefillBatch, ptwc: int | None) -> int:
    """Tokens of requests without any context that are merged (not copied past `prefill_tokens_with_context`): both
    partials of every merge are empty there."""
    qsl = batch.query_start_loc
    end = batch.num_tokens if ptwc is None else ptwc
    return sum(max(0, min(int(qsl[r + 1]), end) - int(qsl[r])) for r, n in enumerate(batch.context_lens) if n == 0)


def _expected_real(path: str, observed: dict, both_empty: int) -> str | None:
    """With a real kernel: our fixed paths must be clean; the unfixed one too when the kernel reports empty rows as
    +-inf/NaN (the merge reads them as empty, docs/spec.md 4.1); the naive merge yields NaN on rows empty on both
    sides (docs/spec.md 4.2), with the mask always, without it when the kernel's empty LSE is not finite."""
    finite = observed["lse"]["finite"] > 0
    if path in FIXED_PATHS:
        return "clean"
    if path == "no_mask":
        return None if finite else "clean"
    if path == "naive_mask" or not finite:
        return "corrupted" if both_empty else None
    return None


def run_real_batch(batch: PrefillBatch, backend: str, *, framework: str = "both", device=None,
                   jax_implementation: str = "pallas") -> tuple[list[dict], bool]:
    """`run_batch` with the partials of a real attention kernel (`REAL_BACKENDS`), computed once in the kernel's
    framework and handed to the other over DLPack; the paths are `PATHS` and `NAIVE_PATHS`."""
    if framework not in ("both", *FRAMEWORKS):
        raise ValueError(f"framework must be 'both', 'torch' or 'jax', got {framework!r}")
    frameworks = FRAMEWORKS if framework == "both" else (framework,)
    b = real_backend(backend)
    from parity.library import bridge
    from parity.harness import impls

    rt = impls.make_runtime()
    if b.gpu_only and not rt.on_gpu:
        raise RuntimeError(f"backend {backend!r} ({b.kernel}) needs a CUDA GPU; on CPU use 'jax-xla' or 'modelled'")
    batch = _rounded(batch, b.dtype)
    plan = batch.plan()
    ptwc = batch.prefill_tokens_with_context()
    want = reference_prefill(batch)
    torch_device = _default_torch_device(device)
    tolerance = TOLERANCE_BF16 if b.dtype == "bfloat16" else TOLERANCE
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        computed, observed = _partials_real(batch, plan, backend, torch_device)
    both_empty = _both_empty_tokens(batch, ptwc)
    meta = dict(num_requests=batch.num_requests, num_tokens=batch.num_tokens, num_heads=batch.num_heads,
                num_chunks=plan.num_chunks, budget=plan.budget, has_empty=list(plan.has_empty),
                prefill_tokens_with_context=ptwc, tolerance=tolerance, backend=backend, kernel=b.kernel,
                dtype=b.dtype, observed=observed, both_empty_tokens=both_empty)
    rows = []
    for fw in frameworks:
        if fw == "jax":
            import jax

            fw_device, impl = f"{jax.devices()[0]}/{jax_implementation}", jax_implementation
        else:
            fw_device, impl = torch_device, "triton"
        parts = computed if fw == b.framework else _to_framework(computed, fw)
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            results = _combine(impls.adapter(rt, impl), parts, plan, ptwc, PATHS + NAIVE_PATHS)
        new_out = bridge.to_numpy(parts["new"][0])
        for path in PATHS + NAIVE_PATHS:
            row = dict(framework=fw, device=fw_device, empty_behavior=backend, path=path, fixed=path in FIXED_PATHS)
            judge_row(row, results[path], want, new_out, batch.query_start_loc, ptwc,
                      _expected_real(path, observed, both_empty), tolerance=tolerance)
            row.update(meta)
            rows.append(row)
    return rows, all(r["ok"] for r in rows)


def run_demo(*, framework: str = "both", device=None, size: str = "default", seed: int = 0,
             backend: str = "modelled") -> tuple[list[dict], bool]:
    """Reproduces the chunked-context prefill corruption and its fix.

    Args:
        framework: "both", "torch" (Triton kernels) or "jax" (Pallas kernels).
        device: torch device string; None picks "cuda" when available, else "cpu" (Triton then runs in
            its interpreter). The JAX side uses JAX's default device.
        size: "default" (small, for CPU interpreters), "large" (64 requests, thousands of tokens) or "real" (40
            requests, a request without context among them; `demo_config`).
        seed: data seed (and, for "large" and "real", the length draw).
        backend: "modelled" (every behaviour of `EMPTY_BEHAVIORS`) or a real attention kernel of
            `REAL_BACKENDS` ("torch-flash", "jax-cudnn": GPU; "jax-xla": any device), whose partials both
            frameworks merge (`run_real_batch`): the table adds the naive-merge paths and what the kernel left in
            empty rows.

    Returns:
        (rows, ok). One row per (framework, empty_behavior, path): rows_corrupted / rows_total,
        requests_corrupted, max_abs_err, any_nan, passthrough_exact (rows of requests without context
        are bit copies of the new-token partial; None if there are none), expected ("clean",
        "corrupted" or None for information only), ok, and the batch's shape. `ok` holds when every
        fixed path is clean for every behaviour and the unfixed path is corrupted for the finite-LSE
        behaviour.

    Raises:
        ValueError: unknown framework, size or backend.
        RuntimeError: a GPU-only backend without a GPU.
        ImportError: the chosen framework's kernels cannot be imported.
    """
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")
    if backend != "modelled":
        real_backend(backend)  # an unknown name is refused before any work
        return run_real_batch(demo_batch(size, seed), backend, framework=framework, device=device)
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
    elif "backend" in r0:
        lines.append(f"chunked-context prefill on a real attention kernel: {r0['kernel']}, {r0['dtype']}; "
                     f"R={r0['num_requests']} T={r0['num_tokens']} H={r0['num_heads']} chunks={r0['num_chunks']} "
                     f"budget={r0['budget']} prefill_tokens_with_context={r0['prefill_tokens_with_context']}, "
                     f"{r0['both_empty_tokens']} tokens empty in every chunk; empty rows left by the kernel: "
                     f"LSE {r0['observed']['lse']}, output rows {r0['observed']['out_rows']}; "
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
        if "observed" in r:  # a real kernel: what it left in empty rows
            lse = " (lse " + "/".join(k for k, n in r["observed"]["lse"].items() if n) + ", out " + \
                  "/".join(k for k, n in r["observed"]["out_rows"].items() if n) + ")"
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
