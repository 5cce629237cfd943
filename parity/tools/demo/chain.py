"""The merge chain of the chunked-prefill demos: each path's mask and merges over the chunk partials, through a
`parity.harness.impls` adapter (the same loop for every implementation), and upstream's merge formula before its
both-empty guard (`naive_merge`)."""

from __future__ import annotations

import numpy as np

from parity.tools.chunked_prefill import ChunkPlan

PATHS = ("no_mask", "mask_then_merge", "fused")
FIXED_PATHS = ("mask_then_merge", "fused")
# With a real attention kernel: upstream's merge formula before its both-empty guard (`naive_merge`), without and
# with the mask in front of it.
NAIVE_PATHS = ("naive", "naive_mask")


def default_torch_device(device):
    if device is not None:
        return str(device)
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"



def host_f32(x) -> np.ndarray:
    from parity.library import bridge

    return bridge.to_numpy(x).astype(np.float32)



def naive_merge(prefix_output, prefix_lse, suffix_output, suffix_lse, *, prefill_tokens_with_context=None,
                **_) -> dict:
    """Upstream vLLM's Triton merge formula as of the revision that added the mask, before its both-empty guard, in
    f32 numpy: +inf is read as -inf, then `m = max(p, s)` and `exp(p - m)`, which is NaN when both are -inf
    (docs/spec.md 4.2 is the guard it lacks). Tokens at or past `prefill_tokens_with_context` copy the suffix."""
    a, b = host_f32(prefix_output), host_f32(suffix_output)
    p, s = host_f32(prefix_lse), host_f32(suffix_lse)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        p = np.where(p == np.inf, -np.inf, p)
        s = np.where(s == np.inf, -np.inf, s)
        m = np.maximum(p, s)
        pe, se = np.exp(p - m), np.exp(s - m)
        z = pe + se
        out = a * (pe / z).T[..., None] + b * (se / z).T[..., None]
        lse = np.log(z) + m
    t = a.shape[0] if prefill_tokens_with_context is None else int(prefill_tokens_with_context)
    out[t:], lse[:, t:] = b[t:], host_f32(suffix_lse)[:, t:]
    return dict(out=out, lse=lse)


def combine(a, parts: dict, plan: ChunkPlan, ptwc, paths=PATHS) -> dict:
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
