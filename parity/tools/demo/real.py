"""The demo on real attention kernels (`python -m parity demo --backend B`, docs/design.md): the chunk partials of a
real kernel (`REAL_BACKENDS`), computed once in its framework and handed to the other over DLPack, merged by both
frameworks' kernels and by upstream's unguarded formula."""

from __future__ import annotations

import numpy as np

from parity.tools.chunked_prefill import (ChunkPlan, PrefillBatch, attention_real, chunk_gather_index,
                                          empty_row_classes, real_backend, reference_prefill)
from parity.tools.chunked_prefill.reference import rounded
from parity.tools.demo.chain import FIXED_PATHS, NAIVE_PATHS, PATHS, combine, default_torch_device, host_f32
from parity.tools.demo.rows import FRAMEWORKS, TOLERANCE, TOLERANCE_BF16, judge_row


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
        seen = empty_row_classes(host_f32(out), host_f32(lse), qsl_host, plan.cu_seq_lens[i])
        observed = seen if observed is None else {k: {c: observed[k][c] + n for c, n in v.items()}
                                                  for k, v in seen.items()}
        chunks.append((out, lse, up_i32(plan.cu_seq_lens[i])))
    new_out, new_lse = attention_real(backend, q, up(batch.new_k), up(batch.new_v), qsl_host, qsl_host, causal=True,
                                      scale=batch.scale)
    parts = dict(chunks=chunks, new=(new_out, new_lse), qsl=up_i32(qsl_host),
                 context_cu=up_i32(batch.context_start_loc))
    return parts, observed



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
    batch = rounded(batch, b.dtype)
    plan = batch.plan()
    ptwc = batch.prefill_tokens_with_context()
    want = reference_prefill(batch)
    torch_device = default_torch_device(device)
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
            results = combine(impls.adapter(rt, impl), parts, plan, ptwc, PATHS + NAIVE_PATHS)
        new_out = bridge.to_numpy(parts["new"][0])
        for path in PATHS + NAIVE_PATHS:
            row = dict(framework=fw, device=fw_device, empty_behavior=backend, path=path, fixed=path in FIXED_PATHS)
            judge_row(row, results[path], want, new_out, batch.query_start_loc, ptwc,
                      _expected_real(path, observed, both_empty), tolerance=tolerance)
            row.update(meta)
            rows.append(row)
    return rows, all(r["ok"] for r in rows)
