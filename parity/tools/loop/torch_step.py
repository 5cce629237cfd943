"""The chunked-context step in PyTorch: static buffers at a capacity, the eager step, its CUDA graph.

Everything the step launches reads its sizes from the capacity and its batch from device buffers: the attention
kernel takes the device offsets (FlashAttention-2 varlen with the capacity's max sequence lengths, or, on CPU, a
dense attention masked from the same offsets), the merges take the offsets for their fused masks, and nothing
reads a device value on the host or passes a batch-dependent host integer (`prefill_tokens_with_context` stays
None: the final merge's fused mask over the whole-context offsets neutralises the requests without context). So
one capture replays for every batch that fits, after `write` puts its offsets and inputs into the same buffers.

The merges are raw `triton_impl` calls, not `parity.harness.impls` adapters: a captured step must launch into its
own static buffers (the running partial in place) with no allocation and no sync of its own, and the adapters
allocate a poisoned output per bind and sync in `results()`.
"""

from __future__ import annotations

import math

import numpy as np

from parity.tools.loop.capacity import Capacity, StepInputs

METHODS = ("chained", "fused")
KERNELS = ("flash", "dense")


def flash_attention(q, k, v, query_start_loc, cu_seq_lens, max_q: int, max_k: int, *, causal: bool, scale: float,
                    v_dim: int):
    """FlashAttention-2 varlen (`torch.ops.aten._flash_attention_forward`) on device offsets. `max_q` / `max_k` are
    host ints the kernel is launched with: the capacity's, so nothing depends on the batch. V is padded to the q/k
    head size (the kernel takes one); the output is sliced back to `v_dim` (a strided view)."""
    import torch

    out, lse, *_ = torch.ops.aten._flash_attention_forward(q, k, v, query_start_loc, cu_seq_lens, max_q, max_k, 0.0,
                                                           causal, False, scale=scale)
    if tuple(lse.shape) != (q.shape[1], q.shape[0]):  # shapes only: no device read
        raise RuntimeError(f"this torch's flash kernel returned an LSE of shape {tuple(lse.shape)}, expected "
                           f"[H, T] = {[q.shape[1], q.shape[0]]} (the varlen layout)")
    return out[..., :v_dim], lse


def _segments(offsets, size: int):
    """(i32[size] request of each row, R for rows past offsets[R]; i32[size] position in the request), on device."""
    import torch

    idx = torch.arange(size, dtype=offsets.dtype, device=offsets.device)
    seg = torch.searchsorted(offsets, idx, right=True) - 1
    num_requests = offsets.shape[0] - 1
    seg = seg.clamp(0, num_requests)
    pos = idx - offsets[seg.clamp(max=num_requests - 1)]
    return seg, pos


def dense_attention(q, k, v, query_start_loc, cu_seq_lens, *, causal: bool, scale: float):
    """Varlen attention as one dense masked product over every query and KV row, masked to each row's request from
    the device offsets (fp32). A row with no KV gets LSE -inf and a NaN output row (exp(-inf - -inf)), which only
    an offset-driven mask and a zero-weight merge keep out of the result."""
    import torch

    num_requests = query_start_loc.shape[0] - 1
    q_seg, q_pos = _segments(query_start_loc, q.shape[0])
    k_seg, k_pos = _segments(cu_seq_lens, k.shape[0])
    visible = (q_seg[:, None] == k_seg[None, :]) & (q_seg[:, None] < num_requests)
    if causal:
        visible &= k_pos[None, :] <= q_pos[:, None]
    s = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    s = s.masked_fill(~visible[None], -math.inf)
    lse = torch.logsumexp(s, dim=-1)  # [H, T]
    p = torch.exp(s - lse[..., None])
    return torch.einsum("hqk,khd->qhd", p, v.float()), lse


class TorchLoop:
    """One capacity's buffers and steps. `write(inputs)`, then `step(method)` (eager) or, after `capture(method)`,
    `replay(method)`; the result is `out[method]` (rows past the batch's T are padding)."""

    def __init__(self, cap: Capacity, *, device: str, kernel: str, dtype: str):
        import torch

        import triton_impl

        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        self.torch, self.ti, self.cap, self.kernel = torch, triton_impl, cap, kernel
        self.dtype = getattr(torch, dtype)
        self.scale = cap.qk_dim ** -0.5
        v_cols = cap.qk_dim if kernel == "flash" else cap.v_dim  # FlashAttention takes one head size
        T, R, C, H, W = cap.num_tokens, cap.num_requests, cap.num_chunks, cap.num_heads, cap.workspace_rows

        def zeros(*shape, dtype=self.dtype):
            return torch.zeros(shape, dtype=dtype, device=device)

        self.q, self.new_k, self.new_v = zeros(T, H, cap.qk_dim), zeros(T, H, cap.qk_dim), zeros(T, H, v_cols)
        self.ctx_k, self.ctx_v = zeros(cap.context_rows, H, cap.qk_dim), zeros(cap.context_rows, H, v_cols)
        self.ws_k, self.ws_v = zeros(W, H, cap.qk_dim), zeros(W, H, v_cols)  # the one gather workspace
        i32 = torch.int32
        self.qsl, self.context_cu = zeros(R + 1, dtype=i32), zeros(R + 1, dtype=i32)
        self.cu, self.gather = zeros(C + 1, R + 1, dtype=i32), zeros(C, W, dtype=i32)
        self.outs, self.lses = zeros(C + 1, T, H, cap.v_dim), zeros(C + 1, H, T, dtype=torch.float32)
        self.out = {m: zeros(T, H, cap.v_dim) for m in METHODS}
        self.graphs = {}

    def write(self, inputs: StepInputs) -> None:
        """A batch's offsets and inputs into the step's buffers (host -> device copies; V's padding stays 0)."""
        t = self.torch
        for buf, x in ((self.qsl, inputs.query_start_loc), (self.context_cu, inputs.context_cu),
                       (self.cu, inputs.cu_seq_lens), (self.gather, inputs.gather), (self.q, inputs.q),
                       (self.new_k, inputs.new_k), (self.ctx_k, inputs.ctx_k)):
            buf.copy_(t.from_numpy(np.ascontiguousarray(x)))
        self.new_v[..., :self.cap.v_dim].copy_(t.from_numpy(inputs.new_v))
        self.ctx_v[..., :self.cap.v_dim].copy_(t.from_numpy(inputs.ctx_v))

    def _attend(self, k, v, cu, *, causal: bool, max_k: int):
        if self.kernel == "flash":
            return flash_attention(self.q, k, v, self.qsl, cu, self.cap.max_query_len, max_k, causal=causal,
                                   scale=self.scale, v_dim=self.cap.v_dim)
        return dense_attention(self.q, k, v, self.qsl, cu, causal=causal, scale=self.scale)

    def _chunk(self, i: int):
        """Chunk i: its context rows gathered into the workspace, then attended (non-causal)."""
        t = self.torch
        t.index_select(self.ctx_k, 0, self.gather[i], out=self.ws_k)
        t.index_select(self.ctx_v, 0, self.gather[i], out=self.ws_v)
        return self._attend(self.ws_k, self.ws_v, self.cu[i], causal=False, max_k=self.cap.chunk_kv)

    def _suffix(self):
        return self._attend(self.new_k, self.new_v, self.qsl, causal=True, max_k=self.cap.max_query_len)

    def step(self, method: str):
        """The whole step, eager: C chunk partials and the new-token partial, combined by `method`:

        - "chained": chunk 0 is the running partial; each later chunk merges into it in place (output and output
          LSE are the running partial's own tensors). The chunk is the merge's prefix operand, so its offsets drive
          the fused mask; the running partial is the suffix (the merge is symmetric, docs/spec.md 4.3). Then the
          final merge with the new tokens, the context's requests without context masked by the fused mask over
          `context_cu`. C merges.
        - "fused": the C + 1 partials stacked (a copy each: this attention kernel has no `out=`), one N-way merge
          with every partial's offsets `cu_seq_lens[C + 1, R + 1]` (docs/spec.md 8.1).
        """
        ti, C = self.ti, self.cap.num_chunks
        if method == "chained":
            state_out = state_lse = None
            for i in range(C):
                o, lse = self._chunk(i)
                if i == 0:
                    state_out, state_lse = o, lse
                    continue
                ti.merge_attn_states(state_out, o, lse, state_out, state_lse, state_lse, query_start_loc=self.qsl,
                                     prefix_cu_seq_lens=self.cu[i])
            o, lse = self._suffix()
            ti.merge_attn_states(self.out[method], state_out, state_lse, o, lse, query_start_loc=self.qsl,
                                 prefix_cu_seq_lens=self.context_cu)
        elif method == "fused":
            for i in range(C + 1):
                o, lse = self._chunk(i) if i < C else self._suffix()
                self.outs[i].copy_(o)
                self.lses[i].copy_(lse)
            self.merge_fused()
        else:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        return self.out[method]

    def merge_fused(self) -> None:
        """The fused step's merge alone, over the stacked partials."""
        self.ti.merge_attn_states_n(self.out["fused"], self.outs, self.lses, query_start_loc=self.qsl,
                                    cu_seq_lens=self.cu)

    def merge_chained(self, state_out, state_lse) -> None:
        """The chained step's C merges alone, over the stacked partials: chunks 1..C-1 into the running partial
        (`state_out`, `state_lse`, written in place), then the new tokens into `out["chained"]`."""
        ti = self.ti
        for i in range(1, self.cap.num_chunks):
            ti.merge_attn_states(state_out, self.outs[i], self.lses[i], state_out, state_lse, state_lse,
                                 query_start_loc=self.qsl, prefix_cu_seq_lens=self.cu[i])
        ti.merge_attn_states(self.out["chained"], state_out, state_lse, self.outs[-1], self.lses[-1],
                             query_start_loc=self.qsl, prefix_cu_seq_lens=self.context_cu)

    def capture(self, method: str) -> None:
        """The whole step as one CUDA graph: warmed up on a side stream (Triton compiles, plans are cached,
        cuBLAS / flash workspaces exist), then captured. Tensors the step allocates come from the graph's private
        pool and are replayed at the same addresses."""
        torch = self.torch
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.step(method)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        # thread_local: only this thread's calls must be capture-safe (JAX's runtime threads are not ours)
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self.step(method)
        torch.cuda.synchronize()
        self.graphs[method] = graph

    def replay(self, method: str):
        self.graphs[method].replay()
        return self.out[method]

    def sync(self) -> None:
        if self.q.is_cuda:
            self.torch.cuda.synchronize()
