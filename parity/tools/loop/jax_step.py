"""The chunked-context step in JAX: one jitted function per (capacity, method), compiled once, traced once.

Every size is the capacity's; the batch is data (offsets, inputs), so a new batch neither re-traces nor
recompiles (counted with `parity.tools.bench.timers.TraceCounter`). Attention is `jax.nn.dot_product_attention`
with its LSE (`return_residual=True`; cuDNN on a GPU, XLA anywhere): the packed tokens are gathered into one row
per request from the device offsets (`max_query_len` query rows, `chunk_kv` KV rows: rounded up to 128 for cuDNN)
with `query_seq_lengths` / `key_value_seq_lengths`, and gathered back. The merges are `pallas_impl`'s public
functions called inside the jit (the harness adapters wait on their results, which a traced step cannot).

In place in JAX is a property of the compiled program: the chained merges are functional, and inside one jitted
step each running partial is a temporary whose buffer XLA's assignment reuses once it is dead; donation only
matters at a jit boundary, which this step has none of between its merges.
"""

from __future__ import annotations

import functools

import numpy as np

from parity.tools.loop.capacity import Capacity, StepInputs

METHODS = ("chained", "fused")
ATTENTIONS = ("cudnn", "xla")


def _rows(n: int, attention: str) -> int:
    return -(-n // 128) * 128 if attention == "cudnn" else n


def _attention_fn(cap: Capacity, attention: str):
    """`partials(x) -> ([(out, lse)] * C, (out, lse) of the new tokens)`, traced inside a jitted step: every chunk
    gathered into the workspace and attended (non-causal), then the new tokens (causal)."""
    import jax
    import jax.numpy as jnp

    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
    scale = cap.qk_dim ** -0.5
    q_rows, kv_rows = _rows(cap.max_query_len, attention), _rows(cap.chunk_kv, attention)
    num_requests = cap.num_requests

    def to_rows(x, offsets, rows):  # packed [n, H, D] -> [R, rows, H, D]; rows past a request's length are 0
        lens = offsets[1:] - offsets[:-1]
        j = jnp.arange(rows, dtype=jnp.int32)[None, :]
        idx = jnp.clip(offsets[:-1, None] + j, 0, x.shape[0] - 1)
        return jnp.where((j < lens[:, None])[..., None, None], jnp.take(x, idx, axis=0), 0).astype(x.dtype), lens

    def attend(q, k, v, qsl, cu, *, causal, rows):
        qr, q_lens = to_rows(q, qsl, q_rows)
        kr, kv_lens = to_rows(k, cu, rows)
        vr, _ = to_rows(v, cu, rows)
        if attention == "cudnn":  # a request past the batch's has no query rows to read back: give it one
            q_lens = jnp.maximum(q_lens, 1)
        out, lse = jax.nn.dot_product_attention(qr, kr, vr, scale=scale, is_causal=causal, query_seq_lengths=q_lens,
                                                key_value_seq_lengths=kv_lens, implementation=attention,
                                                return_residual=True)
        t = jnp.arange(cap.num_tokens, dtype=jnp.int32)
        req = jnp.clip(jnp.searchsorted(qsl, t, side="right") - 1, 0, num_requests - 1)
        pos = jnp.clip(t - qsl[req], 0, q_rows - 1)  # padding tokens read some row: they are padding
        return out[req, pos][..., :cap.v_dim], lse.astype(jnp.float32)[req, pos].T  # [T, H, Dv], [H, T]

    def partials(x):
        qsl, cu = x["query_start_loc"], x["cu_seq_lens"]
        parts = []
        for i in range(cap.num_chunks):
            ws_k = jnp.take(x["ctx_k"], x["gather"][i], axis=0)  # the chunk's workspace
            ws_v = jnp.take(x["ctx_v"], x["gather"][i], axis=0)
            parts.append(attend(x["q"], ws_k, ws_v, qsl, cu[i], causal=False, rows=kv_rows))
        return parts, attend(x["q"], x["new_k"], x["new_v"], qsl, qsl, causal=True, rows=q_rows)

    return partials


def _stacked(parts, new):
    import jax.numpy as jnp

    return jnp.stack([o for o, _ in parts] + [new[0]]), jnp.stack([lse for _, lse in parts] + [new[1]])


def make_step(cap: Capacity, *, method: str, attention: str, merge_impl: str, backend: str | None = None):
    """The jitted step `f(inputs: dict) -> out [T, H, Dv]` (see `inputs_jax`). `merge_impl` is pallas_impl's
    `implementation` ("pallas", interpreted on a CPU, or "jnp"). V arrives zero-padded to the q/k head size
    (`jax.nn.dot_product_attention` takes one head size); the output is sliced back to Dv."""
    import jax

    import pallas_impl

    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    kernel = dict(implementation=merge_impl, backend=backend)
    partials = _attention_fn(cap, attention)

    def step(x):
        qsl, cu = x["query_start_loc"], x["cu_seq_lens"]
        parts, new = partials(x)
        if method == "fused":
            outs, lses = _stacked(parts, new)
            return pallas_impl.merge_attn_states_n(outs, lses, query_start_loc=qsl, cu_seq_lens=cu,
                                                   return_lse=False, **kernel)
        return chained_merges(parts, new, qsl, cu, x["context_cu"], kernel)

    return jax.jit(step)


def make_partials(cap: Capacity, *, attention: str):
    """The jitted attention alone: `f(inputs) -> (outs [C+1, T, H, Dv], lses [C+1, H, T])`, the fused step's
    stacked partials (what the merges-only timings read)."""
    import jax

    partials = _attention_fn(cap, attention)
    return jax.jit(lambda x: _stacked(*partials(x)))


def chained_merges(parts, new, qsl, cu, context_cu, kernel):
    """The chained combine: chunk i (the prefix: its offsets drive the fused mask) into the running partial, then
    the new tokens, the requests without context masked over `context_cu` (docs/design.md, "Chunked-context loop")."""
    import pallas_impl

    state = parts[0]
    for i in range(1, len(parts)):
        state = pallas_impl.merge_attn_states(parts[i][0], parts[i][1], state[0], state[1], query_start_loc=qsl,
                                              prefix_cu_seq_lens=cu[i], **kernel)
    return pallas_impl.merge_attn_states(state[0], state[1], new[0], new[1], query_start_loc=qsl,
                                         prefix_cu_seq_lens=context_cu, return_lse=False, **kernel)


@functools.cache
def merges_only(method: str, merge_impl: str, backend: str | None):
    """The jitted merges of `method` alone, on stacked partials `(outs [C+1, T, H, Dv], lses [C+1, H, T], qsl, cu,
    context_cu)`: what the step's combine costs without the attention."""
    import jax

    import pallas_impl

    kernel = dict(implementation=merge_impl, backend=backend)

    def fused(outs, lses, qsl, cu, context_cu):
        return pallas_impl.merge_attn_states_n(outs, lses, query_start_loc=qsl, cu_seq_lens=cu, return_lse=False,
                                               **kernel)

    def chained(outs, lses, qsl, cu, context_cu):
        n = outs.shape[0]
        parts = [(outs[i], lses[i]) for i in range(n - 1)]
        return chained_merges(parts, (outs[n - 1], lses[n - 1]), qsl, cu, context_cu, kernel)

    return jax.jit(fused if method == "fused" else chained)


def inputs_jax(inputs: StepInputs, *, dtype: str, v_cols: int) -> dict:
    """A batch's step inputs as JAX arrays on the default device (V zero-padded to `v_cols` columns)."""
    import jax.numpy as jnp

    def pad_v(v):
        return np.pad(v, ((0, 0), (0, 0), (0, v_cols - v.shape[2])))

    floats = dict(q=inputs.q, new_k=inputs.new_k, new_v=pad_v(inputs.new_v), ctx_k=inputs.ctx_k,
                  ctx_v=pad_v(inputs.ctx_v))
    ints = dict(query_start_loc=inputs.query_start_loc, cu_seq_lens=inputs.cu_seq_lens, context_cu=inputs.context_cu,
                gather=inputs.gather)
    return {**{k: jnp.asarray(v, dtype=dtype) for k, v in floats.items()},
            **{k: jnp.asarray(v, dtype=jnp.int32) for k, v in ints.items()}}
