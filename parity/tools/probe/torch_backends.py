"""PyTorch attention kernels that return (or let the caller derive) an LSE, each behind `run(spec, inputs) -> Raw`.

Three forms: varlen (packed rows with `cu_seqlens`: FlashAttention-2, memory-efficient, the flash-attn and
FlashInfer packages), dense (one batch row holding the packed tokens, a block-diagonal additive mask: -inf where
a row must not look, as `scaled_dot_product_attention` turns a boolean mask into), and dense without a mask
(SDPA's flash kernel: causal only). Inputs arrive as packed numpy arrays already rounded to the kernel's dtype.
"""

from __future__ import annotations

import importlib
import inspect
import math

import numpy as np

from parity.tools.probe.core import NUM_HEADS, Inputs, Raw, Spec, Unsupported, visibility

# A 16-bit pattern that fills freed CUDA memory before a kernel runs: rows the kernel never writes read back as it
# (bf16 -4096; f32 -4120.09...). Best effort: the caching allocator decides which block an output lands in.
POISON_BITS = -14976  # 0xC580 as int16


class TorchBackend:
    """A torch kernel. Subclasses set the class attributes and `_call`."""

    name = kernel = ""
    framework = "torch"
    dtype = "bfloat16"
    needs = "cuda"  # "cuda", "cpu" or "any"
    package = "torch"

    def unavailable(self) -> str | None:
        try:
            importlib.import_module(self.package)
        except ImportError as e:
            return f"not installed ({e})"
        import torch

        if self.needs == "cuda" and not torch.cuda.is_available():
            return "needs a CUDA GPU (none visible)"
        return self._missing()

    def _missing(self) -> str | None:
        return None

    def version(self) -> dict:
        import torch

        v = {"torch": torch.__version__}
        if self.needs != "cpu" and torch.cuda.is_available():
            v["cuda"] = torch.version.cuda
            v["cudnn"] = torch.backends.cudnn.version()
        if self.package != "torch":
            v[self.package] = getattr(importlib.import_module(self.package), "__version__", None)
        return v

    @property
    def device(self) -> str:
        import torch

        return "cuda" if self.needs == "cuda" or (self.needs == "any" and torch.cuda.is_available()) else "cpu"

    def tensor(self, x):
        import torch

        return torch.from_numpy(np.ascontiguousarray(x)).to(device=self.device, dtype=getattr(torch, self.dtype))

    def ints(self, x):
        import torch

        return torch.from_numpy(np.asarray(x, np.int32)).to(self.device)

    def poison(self) -> dict | None:
        """Fill freed allocator blocks with POISON_BITS (CUDA only); returns what unwritten memory reads as."""
        import torch

        if self.device != "cuda":
            return None
        for nbytes in (1 << 20, 1 << 19, 1 << 16, 1 << 12):  # the small pool's sizes, then a few larger blocks
            blocks = [torch.full((nbytes // 2,), POISON_BITS, dtype=torch.int16, device="cuda") for _ in range(8)]
            del blocks
        torch.cuda.synchronize()
        pattern = torch.full((2,), POISON_BITS, dtype=torch.int16)
        return {"out": pattern.view(getattr(torch, self.dtype))[0].item(), "lse": pattern.view(torch.float32)[0].item()}

    def run(self, spec: Spec, inputs: Inputs) -> Raw:
        raise NotImplementedError


def _host(x) -> np.ndarray:
    return x.detach().float().cpu().numpy()


def _mean_v_dense(spec: Spec, inputs: Inputs, rows: int) -> np.ndarray:
    """Dense form: every row's scores span all keys of the one batch row."""
    return np.broadcast_to(inputs.v.mean(axis=0, dtype=np.float64), (rows,) + inputs.v.shape[1:]).astype(np.float32)


def _mean_v_varlen(spec: Spec, inputs: Inputs, rows: int) -> np.ndarray:
    """Varlen form: a row's scores span its own request's keys (none: NaN); padding rows none."""
    out = np.full((rows,) + inputs.v.shape[1:], np.nan, np.float32)
    qsl, cu = spec.qsl, spec.cu
    for r in range(len(spec.q_lens)):
        if cu[r + 1] > cu[r]:
            out[qsl[r]:qsl[r + 1]] = inputs.v[cu[r]:cu[r + 1]].mean(axis=0)
    return out


def varlen_lse(lse, spec: Spec) -> tuple[np.ndarray, str]:
    """A varlen kernel's LSE as [H, rows] and its own layout: [H, T] (packed) or [R, H, max_q] (per request)."""
    shape = tuple(lse.shape)
    lse = _host(lse)
    if len(shape) == 2 and shape[0] == NUM_HEADS:
        return lse, f"[H, T] ({shape[1]} rows)"
    if len(shape) == 3 and shape[0] == 1 and shape[1] == NUM_HEADS and len(spec.q_lens) > 1:
        return lse[0], f"[1, H, T] ({shape[2]} rows)"
    if len(shape) == 3 and shape[0] == len(spec.q_lens) and shape[1] == NUM_HEADS:
        packed = np.full((NUM_HEADS, spec.num_tokens), np.nan, np.float32)
        qsl = spec.qsl
        for r, n in enumerate(spec.q_lens):
            packed[:, qsl[r]:qsl[r] + n] = lse[r, :, :n]
        return packed, f"[R, H, max_q] per request (shape {list(shape)})"
    raise RuntimeError(f"unexpected LSE shape {list(shape)} for a varlen batch of {len(spec.q_lens)} requests")


def dense_bias(spec: Spec, rows: int, dtype, device, *, heads: int = 1, align: int = 1):
    """Additive mask [1, heads, rows, S]: 0 where a row sees a key, -inf elsewhere (top-left causal inside a
    request). `align` pads the key axis of the storage (a strided view is returned), as some kernels want."""
    import torch

    vis = visibility(spec, "top-left", rows)
    s = vis.shape[1]
    s_pad = -(-s // align) * align
    bias = torch.zeros((1, heads, rows, s_pad), dtype=dtype, device=device)
    bias[..., :s] = torch.from_numpy(np.where(vis, 0.0, -math.inf)).to(device=device, dtype=dtype)
    return bias[..., :s]


class _Dense(TorchBackend):
    """One batch row holding the packed tokens, [1, H, rows, D]; the situation as an additive mask, or the
    kernel's own causal flag when the situation is one request with nothing else to mask."""

    takes_mask = True

    def run(self, spec: Spec, inputs: Inputs) -> Raw:
        rows = spec.num_rows
        native_causal = spec.causal and spec.single_request and not spec.masked_rows
        if not native_causal and not self.takes_mask and not (spec.single_request and not spec.masked_rows):
            raise Unsupported("no mask argument (is_causal only): a row cannot be made to attend to nothing except "
                              "through causality; the varlen kernel covers the rest")
        q = self.tensor(inputs.q[:rows]).permute(1, 0, 2)[None]
        k, v = (self.tensor(x).permute(1, 0, 2)[None] for x in (inputs.k, inputs.v))
        bias = None if native_causal or not self.takes_mask else self._bias(spec, rows, q)
        poison = self.poison()
        out, lse, layout, source = self._call(q, k, v, bias, native_causal, inputs.scale)
        return Raw(out=_host(out[0].permute(1, 0, 2)), lse=None if lse is None else lse,
                   lse_layout=layout, lse_dtype=str(self._lse_dtype).replace("torch.", ""),
                   out_dtype=self.dtype, lse_source=source, mean_v=_mean_v_dense(spec, inputs, rows), poison=poison)

    def _bias(self, spec, rows, q):
        return dense_bias(spec, rows, q.dtype, q.device)

    def _lse(self, lse, rows: int) -> tuple[np.ndarray, str]:
        self._lse_dtype = lse.dtype
        shape = list(lse.shape)
        lse = lse.reshape(lse.shape[0], lse.shape[1], -1)[0, :, :rows]
        return _host(lse), f"[B, H, T] (shape {shape})"


class TorchMath(_Dense):
    name = "torch-sdpa-math"
    kernel = "torch.ops.aten._scaled_dot_product_attention_math (SDPA's math path)"
    dtype = "float32"
    needs = "any"

    def _call(self, q, k, v, bias, causal, scale):
        import torch

        out, _ = torch.ops.aten._scaled_dot_product_attention_math(q, k, v, attn_mask=bias, is_causal=causal,
                                                                   scale=scale)
        s = (q.float() @ k.float().transpose(-1, -2)) * scale
        if causal:
            s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril().logical_not(),
                              -math.inf)
        if bias is not None:
            s = s + bias
        lse = torch.logsumexp(s, dim=-1)
        self._lse_dtype = lse.dtype
        return out, _host(lse[0]), "[B, H, T] (derived)", ("derived: torch.logsumexp(scale * q @ k^T + mask, -1) (the "
                                                           "math path returns no LSE)")


class TorchFlashCPU(_Dense):
    name = "torch-sdpa-flash-cpu"
    kernel = "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu (SDPA's CPU flash path)"
    dtype = "float32"
    needs = "cpu"

    def _call(self, q, k, v, bias, causal, scale):
        import torch

        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias,
                                                                             scale=scale)
        host, layout = self._lse(lse, q.shape[2])
        return out, host, layout, "returned by the kernel"


class TorchFlash(_Dense):
    name = "torch-sdpa-flash"
    kernel = "torch.ops.aten._scaled_dot_product_flash_attention (SDPA's FlashAttention-2 path, dense)"
    takes_mask = False

    def _call(self, q, k, v, bias, causal, scale):
        import torch

        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        host, layout = self._lse(lse, q.shape[2])
        return out, host, layout, "returned by the kernel"


class TorchEfficient(_Dense):
    name = "torch-sdpa-efficient"
    kernel = "torch.ops.aten._scaled_dot_product_efficient_attention (SDPA's memory-efficient path, dense)"
    dtype = "float32"

    def _bias(self, spec, rows, q):  # the kernel wants the bias per head, its key stride a multiple of 16
        return dense_bias(spec, rows, q.dtype, q.device, heads=q.shape[1], align=16)

    def _call(self, q, k, v, bias, causal, scale):
        import torch

        out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, causal,
                                                                              scale=scale)
        host, layout = self._lse(lse, q.shape[2])
        return out, host, layout, "returned by the kernel (compute_log_sumexp=True)"


class TorchCudnn(TorchEfficient):
    name = "torch-sdpa-cudnn"
    kernel = "torch.ops.aten._scaled_dot_product_cudnn_attention (SDPA's cuDNN path, dense)"
    dtype = "bfloat16"

    def _call(self, q, k, v, bias, causal, scale):
        import torch

        out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, bias, True, 0.0, causal, False,
                                                                          scale=scale)
        host, layout = self._lse(lse, q.shape[2])
        return out, host, layout, "returned by the kernel (compute_log_sumexp=True)"


class _Varlen(TorchBackend):
    """Packed rows [rows, H, D] with cu_seqlens; rows past the last request are padding the kernel is handed."""

    def run(self, spec: Spec, inputs: Inputs) -> Raw:
        if spec.masked_rows:
            raise Unsupported("no mask argument: a varlen kernel sees a request's keys, all or (causal) a prefix")
        rows = spec.num_rows
        q, k, v = self.tensor(inputs.q[:rows]), self.tensor(inputs.k), self.tensor(inputs.v)
        max_q, max_k = max(spec.q_lens), max(max(spec.kv_lens), 1)
        poison = self.poison()
        out, lse, source = self._call(q, k, v, self.ints(spec.qsl), self.ints(spec.cu), max_q, max_k, spec.causal,
                                      inputs.scale)
        host, layout = varlen_lse(lse, spec)
        layout = getattr(self, "native_layout", None) or layout
        return Raw(out=_host(out.reshape(rows, NUM_HEADS, -1)), lse=host, lse_layout=layout,
                   lse_dtype=str(lse.dtype).replace("torch.", ""), out_dtype=self.dtype, lse_source=source,
                   mean_v=_mean_v_varlen(spec, inputs, rows), poison=poison)


class TorchFlashVarlen(_Varlen):
    name = "torch-flash-varlen"
    kernel = "torch.ops.aten._flash_attention_forward (FlashAttention-2 varlen, as vLLM's MLA prefill calls it)"

    def _call(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        import torch

        out, lse, *_ = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False,
                                                               scale=scale)
        return out, lse, "returned by the kernel"


class TorchEfficientVarlen(_Varlen):
    name = "torch-efficient-varlen"
    kernel = ("torch.ops.aten._efficient_attention_forward (memory-efficient varlen; causal: "
              "custom_mask_type=2, bottom-right)")
    dtype = "float32"

    def _call(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        import torch

        out, lse, *_ = torch.ops.aten._efficient_attention_forward(q[None], k[None], v[None], None, cu_q, cu_k, max_q,
                                                                   max_k, 0.0, 2 if causal else 0, True, scale=scale)
        return out[0], lse, "returned by the kernel (compute_log_sumexp=True)"


class FlashAttnVarlen(_Varlen):
    name = "flash-attn-varlen"
    kernel = "flash_attn.flash_attn_varlen_func(return_attn_probs=True) (the flash-attn package)"
    package = "flash_attn"

    def _call(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        import flash_attn

        r = flash_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=scale,
                                              causal=causal, return_attn_probs=True)
        return r[0], r[1], "returned by the kernel (return_attn_probs=True)"


class FlashInferRagged(_Varlen):
    name = "flashinfer-ragged"
    kernel = "flashinfer.BatchPrefillWithRaggedKVCacheWrapper(...).run(return_lse=True)"
    package = "flashinfer"
    native_layout = "[T, H]"

    def _missing(self) -> str | None:
        import flashinfer

        if not hasattr(flashinfer, "BatchPrefillWithRaggedKVCacheWrapper"):
            return "this flashinfer has no BatchPrefillWithRaggedKVCacheWrapper"
        return None

    def _call(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        import flashinfer
        import torch

        workspace = torch.empty(128 << 20, dtype=torch.uint8, device=q.device)
        w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD")
        plan = w.plan if hasattr(w, "plan") else w.begin_forward
        plan(cu_q, cu_k, NUM_HEADS, NUM_HEADS, q.shape[-1], causal=causal, sm_scale=scale)
        if "return_lse" in inspect.signature(w.run).parameters:
            out, lse = w.run(q, k, v, return_lse=True)
        else:
            out, lse = w.forward_return_lse(q, k, v, causal=causal, sm_scale=scale)
        return out, lse.transpose(0, 1), "returned by the kernel"


# The kernel the project's fix was measured on first: a later kernel breaking the CUDA context cannot cost it
# (`--isolate` removes the risk altogether).
BACKENDS = (TorchMath(), TorchFlashCPU(), TorchFlashVarlen(), TorchFlash(), TorchEfficientVarlen(), TorchEfficient(),
            TorchCudnn(), FlashAttnVarlen(), FlashInferRagged())
