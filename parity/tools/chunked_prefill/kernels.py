"""Real attention kernels that return their LSE (not modelled): what they leave in a row with no KV is measured.

Called as a serving stack calls them, with host offsets (`parity.tools.loop` calls the same kernels on device
offsets for a captured step). torch and jax are imported inside the functions that need them.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from parity.tools.chunked_prefill.attention import _check_offsets


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
