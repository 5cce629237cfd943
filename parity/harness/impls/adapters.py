"""The calling convention of every implementation (layer 2 of `parity.harness.impls`) and the float64 reference
behind it."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from parity.harness import reference

REF_CHUNK_ELEMS = 1 << 23  # T*H*D elements per token chunk of the float64 reference: bounds its temporaries


@dataclasses.dataclass
class Bound:
    """One prepared call: `call()` runs the public API once; `results()` returns its outputs."""

    call: Callable[[], Any]
    results: Callable[[], dict[str, Any]]

    def __call__(self) -> dict[str, Any]:
        self.call()
        return self.results()



class Adapter:
    """The calling convention (the same keyword options in every implementation):

    - `bind_mask(lse, query_start_loc, cu_seq_lens, output=None, *, head_dim=None, lse_layout, has_empty,
      donate)` -> results {"lse", "output"} (+ "output_buffer" for Triton: the whole, possibly padded buffer);
    - `bind_merge(prefix_output, prefix_lse, suffix_output, suffix_lse, *, head_dim=None,
      prefill_tokens_with_context, query_start_loc, prefix_cu_seq_lens, out_dtype, output_scale, return_lse,
      lse_layout, lse_base, head_pad, out, out_lse)` -> {"out", "lse"} (+ "out_buffer" for Triton);
    - `bind_merge_n(outputs, lses, *, head_dim=None, prefill_tokens_with_context, query_start_loc, cu_seq_lens,
      out_dtype, output_scale, return_lse, lse_layout, lse_base, head_pad, strided, out, out_lse)`.

    Output buffers may be wider than `head_dim` (a V-padded layout): Triton reads and writes views of them,
    JAX slices them (its arrays have no strides), the reference slices. `head_pad` widens the output buffer
    Triton writes (its columns past D must keep their poison); `out`/`out_lse` hand Triton buffers to write
    (the benchmarks). `strided` makes Triton read the partials through views of a `[T, N, H, D]` gather and
    of the other LSE layout. Options an implementation has no use for are ignored.
    """

    name: str

    def mask(self, *args, **kwargs) -> dict[str, Any]:
        return self.bind_mask(*args, **kwargs)()

    def merge(self, *args, **kwargs) -> dict[str, Any]:
        return self.bind_merge(*args, **kwargs)()

    def merge_n(self, *args, **kwargs) -> dict[str, Any]:
        return self.bind_merge_n(*args, **kwargs)()


class ReferenceAdapter(Adapter):
    """`parity.harness.reference` on numpy arrays. Merge results are float64 (fp8: the clamped, scaled value)."""

    name = "reference"

    def bind_mask(self, lse, query_start_loc, cu_seq_lens, output=None, *, head_dim=None, lse_layout="HT",
                  has_empty=None, donate=False):
        out = None if output is None else np.asarray(output)[..., :head_dim]

        def results():
            got_lse, got_out = reference.mask_empty_context_lse(lse, query_start_loc, cu_seq_lens, out,
                                                                 lse_layout=lse_layout)
            return {"lse": got_lse, "output": got_out}

        return Bound(lambda: None, results)

    def bind_merge(self, prefix_output, prefix_lse, suffix_output, suffix_lse, *, head_dim=None,
                   prefill_tokens_with_context=None, query_start_loc=None, prefix_cu_seq_lens=None, out_dtype=None,
                   output_scale=None, return_lse=True, lse_layout="HT", lse_base=math.e, group_size=None,
                   scale_ue8m0=False, **_):
        a = np.asarray(prefix_output)[..., :head_dim]
        b = np.asarray(suffix_output)[..., :head_dim]

        def one(t0, t1, ptwc, qsl):
            kw = {} if qsl is None else dict(query_start_loc=qsl, prefix_cu_seq_lens=prefix_cu_seq_lens)
            return reference.merge_attn_states(a[t0:t1], token_slice(prefix_lse, lse_layout, t0, t1), b[t0:t1],
                                               token_slice(suffix_lse, lse_layout, t0, t1),
                                               prefill_tokens_with_context=ptwc, output_scale=static,
                                               lse_layout=lse_layout, lse_base=lse_base, **kw)

        static, global_scale = _scales(out_dtype, output_scale)
        return Bound(lambda: None, lambda: _quantized(_chunked(one, a.shape, lse_layout, prefill_tokens_with_context,
                                                               query_start_loc), group_size, scale_ue8m0,
                                                      global_scale))

    def bind_merge_n(self, outputs, lses, *, head_dim=None, prefill_tokens_with_context=None, query_start_loc=None,
                     cu_seq_lens=None, out_dtype=None, output_scale=None, return_lse=True, lse_layout="HT",
                     lse_base=math.e, group_size=None, scale_ue8m0=False, **_):
        o = np.asarray(outputs)[..., :head_dim]
        lses = np.asarray(lses)

        def one(t0, t1, ptwc, qsl):
            kw = {} if qsl is None else dict(query_start_loc=qsl, cu_seq_lens=cu_seq_lens)
            sl = lses[:, :, t0:t1] if lse_layout == "HT" else lses[:, t0:t1]
            return reference.merge_attn_states_n(o[:, t0:t1], sl, prefill_tokens_with_context=ptwc,
                                                 output_scale=static, lse_layout=lse_layout,
                                                 lse_base=lse_base, **kw)

        static, global_scale = _scales(out_dtype, output_scale)
        return Bound(lambda: None, lambda: _quantized(_chunked(one, o.shape[1:], lse_layout,
                                                               prefill_tokens_with_context, query_start_loc),
                                                      group_size, scale_ue8m0, global_scale))


def _scales(out_dtype, output_scale):
    """(the merge's static fp8 scale, NVFP4's global scale): `output_scale` is the latter with an NVFP4 output."""
    return (None, output_scale) if out_dtype == "float4_e2m1fn" else (output_scale, None)


def _quantized(results: dict[str, np.ndarray], group_size, scale_ue8m0: bool,
               global_scale=None) -> dict[str, np.ndarray]:
    """Per-group FP8 (docs/spec.md 4.7) of the reference merge's float64 rows rounded to f32: "out" the clamped
    quotients before the fp8 cast, "scales" f32[T, H * D / G]; NVFP4 (4.8, with `global_scale`): "out" the
    clamped quotients y before the e2m1 rounding (a NaN as the +-0 it encodes to), "scales" e4m3[T, H * D / 16];
    the results unchanged otherwise."""
    if global_scale is not None:
        out = results["out"]
        g = np.asarray(global_scale, np.float32).reshape(-1)[0]
        y, scales = reference.quant_nvfp4(out.astype(np.float32), g, quotients=True)
        y = np.where(np.isnan(y), np.copysign(np.float32(0), y), y)  # a NaN's code is +-0 by its sign bit (4.8)
        return dict(results, out=y.reshape(out.shape).astype(np.float64), scales=scales)
    if not group_size:
        return results
    out = results["out"]
    q, scales = reference.per_token_group_quant_fp8(out.astype(np.float32), group_size, scale_ue8m0=scale_ue8m0)
    return dict(results, out=q.reshape(out.shape).astype(np.float64), scales=scales)


def token_slice(lse, lse_layout: str, t0: int, t1: int):
    return lse[:, t0:t1] if lse_layout == "HT" else lse[t0:t1]


def _chunked(one, out_shape, lse_layout: str, ptwc, query_start_loc) -> dict[str, np.ndarray]:
    """Run `one(t0, t1, ptwc, qsl)` over token chunks: offsets are rebased and clipped to the chunk
    (`clip(qsl - t0, 0, t1 - t0)` selects exactly the same tokens), as is `prefill_tokens_with_context`."""
    T, H, D = out_shape
    step = max(1, REF_CHUNK_ELEMS // max(1, H * D))
    out = np.empty((T, H, D), dtype=np.float64)
    lse = np.empty((H, T) if lse_layout == "HT" else (T, H), dtype=np.float64)
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        p = None if ptwc is None else int(np.clip(ptwc - t0, 0, t1 - t0))
        q = None if query_start_loc is None else np.clip(np.asarray(query_start_loc, np.int64) - t0, 0, t1 - t0)
        o, l = one(t0, t1, p, q)
        out[t0:t1] = o
        token_slice(lse, lse_layout, t0, t1)[...] = l
    return {"out": out, "lse": lse}
