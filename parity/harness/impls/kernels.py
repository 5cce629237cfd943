"""The kernel implementations behind the calling convention of `parity.harness.impls.adapters`: `triton_impl`
on torch tensors and `pallas_impl` (Pallas or its jnp path) on JAX arrays."""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from parity.harness import cases as cases_mod
from parity.harness.impls.adapters import Adapter, Bound
from parity.harness.impls.runtime import Runtime
from parity.harness.reference import swizzled_offsets

def poisoned(shape, dtype: str, device):
    """A NaN-filled torch tensor: an element a kernel fails to write shows up as a NaN mismatch (its bits are
    torch's f32 NaN cast to `dtype`)."""
    import torch

    return torch.full(tuple(shape), float("nan"), dtype=torch.float32, device=device).to(getattr(torch, dtype))


class TritonAdapter(Adapter):
    """`triton_impl` on torch tensors: its Triton kernels, or with implementation="torch" its torch path (the
    adapter "torch"). The mask runs in place on clones (the inputs are never written)."""

    def __init__(self, rt: Runtime, implementation: str = "triton"):
        import torch

        import triton_impl

        self.rt, self.torch, self.ti = rt, torch, triton_impl
        self.name = implementation
        self.kw = dict(implementation=implementation)

    def bind_mask(self, lse, query_start_loc, cu_seq_lens, output=None, *, head_dim=None, lse_layout="HT",
                  has_empty=None, donate=False, in_place=False, library_op=False):
        """`in_place`: the mask writes `lse` / `output` themselves (no clones); `library_op`: through its
        `torch.library` op, `torch.ops.mla_lse_merge.mask_empty_context_lse` (bare on a GPU: what a compiled
        graph calls)."""
        if not in_place:
            lse = lse.clone()
            output = None if output is None else output.clone()
        view = None if output is None else output[..., :head_dim]
        if library_op:
            op = functools.partial(self.torch.ops.mla_lse_merge.mask_empty_context_lse, lse, query_start_loc,
                                   cu_seq_lens, view, has_empty=has_empty, lse_layout=lse_layout, **self.kw)
            call = op if self.rt.on_gpu else _quiet(op)
        else:
            def call():
                with np.errstate(all="ignore"):  # the interpreter evaluates with numpy: inf/NaN inputs are expected
                    self.ti.mask_empty_context_lse(lse, query_start_loc, cu_seq_lens, view, has_empty=has_empty,
                                                   lse_layout=lse_layout, **self.kw)

        def results():
            self.rt.sync()
            return {"lse": lse, "output": view, "output_buffer": output}

        return Bound(call, results)

    def _group_scales(self, shape, group_size, device):
        """The per-group scales' buffer (docs/spec.md 4.7), poisoned: DeepGEMM's TMA-aligned column-major f32[G#,
        T padded to 4], and the f32[T, G#] view the kernels write through (the padding stays poisoned)."""
        if not group_size:
            return None
        T, H, D = shape
        buf = poisoned((H * D // group_size, -(-T // 4) * 4), "float32", device)
        return buf[:, :T].t()

    def _out_buffers(self, shape, dtype, lse_shape, device, head_pad, out, out_lse, return_lse):
        T, H, D = shape
        if out is None:
            out = poisoned((T, H, D + head_pad), dtype, device)
        if out_lse is None and return_lse:
            out_lse = poisoned(lse_shape, "float32", device)
        return out, out_lse

    def bind_merge(self, prefix_output, prefix_lse, suffix_output, suffix_lse, *, head_dim=None,
                   prefill_tokens_with_context=None, query_start_loc=None, prefix_cu_seq_lens=None, out_dtype=None,
                   output_scale=None, return_lse=True, lse_layout="HT", lse_base=math.e, head_pad=0, out=None,
                   out_lse=None, group_size=None, scale_ue8m0=False, scale_layout="row", **_):
        a, b = prefix_output[..., :head_dim], suffix_output[..., :head_dim]
        dtype = out_dtype or str(a.dtype).replace("torch.", "")
        kw = {}
        if query_start_loc is not None:
            kw = dict(query_start_loc=query_start_loc, prefix_cu_seq_lens=prefix_cu_seq_lens)
        if dtype == "float4_e2m1fn":
            return self._nvfp4(self.ti.merge_attn_states, a.shape, suffix_lse.shape, a.device, return_lse,
                               (a, prefix_lse, b, suffix_lse), (prefill_tokens_with_context, output_scale),
                               dict(kw, lse_layout=lse_layout, lse_base=lse_base, **self.kw), scale_layout)
        buf, olse = self._out_buffers(a.shape, dtype, suffix_lse.shape, a.device, head_pad, out, out_lse, return_lse)
        view = buf[..., :a.shape[2]]
        scales = self._group_scales(a.shape, group_size, a.device)
        if group_size:
            kw.update(group_size=group_size, output_group_scale=scales, scale_ue8m0=scale_ue8m0)
        call = functools.partial(self.ti.merge_attn_states, view, a, prefix_lse, b, suffix_lse, olse,
                                 prefill_tokens_with_context, output_scale, lse_layout=lse_layout, lse_base=lse_base,
                                 **kw, **self.kw)

        def results():
            self.rt.sync()
            return {"out": view, "lse": olse, "out_buffer": buf, **({"scales": scales} if group_size else {})}

        return Bound(_quiet(call), results)

    def _nvfp4(self, api, shape, lse_shape, device, return_lse, partials, trailing, kw, scale_layout="row"):
        """An NVFP4 merge (docs/spec.md 4.8): `api(out, *partials, out_lse, *trailing, **kw)` into a poisoned
        u8[T, H, D / 2] buffer and poisoned e4m3 block scales [T, H * D / 16] (row-major, or the flat 128x4-swizzled
        buffer with scale_layout="swizzled", read back row-major); "out" the codes' values [T, H, D]
        (`nvfp4_values`), "scales" the block scales, "out_buffer" the packed bytes."""
        import torch

        T, H, D = shape
        K = H * D // 16
        packed = torch.full((T, H, D // 2), 0xAB, dtype=torch.uint8, device=device)
        offsets = None
        if scale_layout == "swizzled":
            buf = poisoned((-(-T // 128) * 128 * (-(-K // 4) * 4),), "float8_e4m3fn", device)
            offsets = torch.from_numpy(swizzled_offsets(T, K)).to(device)
        else:
            buf = poisoned((T, K), "float8_e4m3fn", device)
        _, olse = self._out_buffers(shape, "float32", lse_shape, device, 0, None, None, return_lse)
        call = functools.partial(api, packed, *partials, olse, *trailing, output_block_scale=buf,
                                 scale_layout=scale_layout, **kw)

        def results():
            self.rt.sync()
            scales = buf if offsets is None else buf.view(torch.uint8)[offsets].view(torch.float8_e4m3fn)
            return {"out": nvfp4_values(packed), "lse": olse, "out_buffer": packed, "scales": scales}

        return Bound(_quiet(call), results)

    def bind_merge_n(self, outputs, lses, *, head_dim=None, prefill_tokens_with_context=None, query_start_loc=None,
                     cu_seq_lens=None, out_dtype=None, output_scale=None, return_lse=True, lse_layout="HT",
                     lse_base=math.e, head_pad=0, strided=False, out=None, out_lse=None, group_size=None,
                     scale_ue8m0=False, scale_layout="row", **_):
        if strided:  # the same values, read through views of a [T, N, H, D] gather and of the other LSE layout
            outputs = outputs.transpose(0, 1).contiguous().transpose(0, 1)
            lses = lses.transpose(1, 2).contiguous().transpose(1, 2)
        o = outputs[..., :head_dim]
        dtype = out_dtype or str(o.dtype).replace("torch.", "")
        if dtype == "float4_e2m1fn":
            return self._nvfp4(self.ti.merge_attn_states_n, o.shape[1:], lses.shape[1:], o.device, return_lse,
                               (o, lses), (prefill_tokens_with_context, output_scale),
                               dict(query_start_loc=query_start_loc, cu_seq_lens=cu_seq_lens, lse_layout=lse_layout,
                                    lse_base=lse_base, **self.kw), scale_layout)
        buf, olse = self._out_buffers(o.shape[1:], dtype, lses.shape[1:], o.device, head_pad, out, out_lse,
                                      return_lse)
        view = buf[..., :o.shape[3]]
        scales = self._group_scales(o.shape[1:], group_size, o.device)
        kw = dict(group_size=group_size, output_group_scale=scales, scale_ue8m0=scale_ue8m0) if group_size else {}
        call = functools.partial(self.ti.merge_attn_states_n, view, o, lses, olse, prefill_tokens_with_context,
                                 output_scale, query_start_loc=query_start_loc, cu_seq_lens=cu_seq_lens,
                                 lse_layout=lse_layout, lse_base=lse_base, **kw, **self.kw)

        def results():
            self.rt.sync()
            return {"out": view, "lse": olse, "out_buffer": buf, **({"scales": scales} if group_size else {})}

        return Bound(_quiet(call), results)

    def bind_cp_merge(self, partial_output, partial_lse, group, *, method="gather", query_start_loc=None,
                      cu_seq_lens=None, prefill_tokens_with_context=None, out_dtype=None, output_scale=None,
                      return_lse=True, lse_layout="HT", lse_base=math.e, reduce_dtype=None, validate=False, **_):
        """The context-parallel combine on `group` (call on every rank): this rank's result, all heads for
        "gather", its H / N heads for "reduce_scatter"."""
        T, H, D = partial_output.shape
        heads = H if method == "gather" else H // group.size()
        dtype = out_dtype or str(partial_output.dtype).replace("torch.", "")
        out = poisoned((T, heads, D), dtype, partial_output.device)
        lse_shape = (heads, T) if lse_layout == "HT" else (T, heads)
        out_lse = poisoned(lse_shape, "float32", partial_output.device) if return_lse else None
        call = functools.partial(self.ti.cp_merge_attn_states, out, partial_output, partial_lse, group, out_lse,
                                 prefill_tokens_with_context, output_scale, method=method,
                                 query_start_loc=query_start_loc, cu_seq_lens=cu_seq_lens, lse_layout=lse_layout,
                                 lse_base=lse_base, reduce_dtype=reduce_dtype, validate=validate, **self.kw)

        def results():
            self.rt.sync()
            return {"out": out, "lse": out_lse}

        return Bound(_quiet(call), results)


def _quiet(call):
    def run():
        with np.errstate(all="ignore"):  # the interpreter evaluates with numpy: inf/NaN inputs are expected
            call()

    return run


class JaxAdapter(Adapter):
    """`pallas_impl` with one `implementation` ("pallas" or "jnp") and Pallas `backend`, functional."""

    def __init__(self, rt: Runtime, implementation: str, backend: str | None = None, interpret: bool | None = None):
        import jax
        import jax.numpy as jnp

        import pallas_impl

        self.rt, self.jax, self.jnp, self.pi = rt, jax, jnp, pallas_impl
        self.name = "mosaic" if backend == "mosaic_gpu" else implementation
        self.kernel = dict(implementation=implementation, backend=backend)
        if interpret is not None:
            self.kernel["interpret"] = interpret

    def _dtype(self, name):
        return None if name is None else self.jnp.dtype(cases_mod.DTYPES[name])

    def _holder(self, fn):
        last: dict[str, Any] = {}

        def call():
            last["r"] = fn()

        def results():
            self.jax.block_until_ready(last["r"])
            return last["r"]

        return Bound(call, results)

    def bind_mask(self, lse, query_start_loc, cu_seq_lens, output=None, *, head_dim=None, lse_layout="HT",
                  has_empty=None, donate=False):
        out = None if output is None else output[..., :head_dim]
        api = functools.partial(self.pi.mask_empty_context_lse, has_empty=has_empty, lse_layout=lse_layout,
                                **self.kernel)
        if not donate:
            def fn():
                r = api(lse, query_start_loc, cu_seq_lens, out)
                return {"lse": r, "output": None} if out is None else {"lse": r[0], "output": r[1]}

            return self._holder(fn)
        # The documented in-place form: jit with the buffers donated, each result fed back as the next input
        # (the mask is idempotent). JAX-owned copies: a donated buffer must not be one torch still owns.
        jnp = self.jnp
        state = [jnp.copy(lse)] + ([] if out is None else [jnp.copy(out)])
        step = self.jax.jit(api, donate_argnums=(0,) if out is None else (0, 3))

        def call():
            if out is None:
                state[0] = step(state[0], query_start_loc, cu_seq_lens)
            else:
                state[0], state[1] = step(state[0], query_start_loc, cu_seq_lens, state[1])

        def results():
            self.jax.block_until_ready(state)
            return {"lse": state[0], "output": state[1] if out is not None else None}

        return Bound(call, results)

    def bind_merge(self, prefix_output, prefix_lse, suffix_output, suffix_lse, *, head_dim=None,
                   prefill_tokens_with_context=None, query_start_loc=None, prefix_cu_seq_lens=None, out_dtype=None,
                   output_scale=None, return_lse=True, lse_layout="HT", lse_base=math.e, group_size=None,
                   scale_ue8m0=False, scale_layout="row", **_):
        a, b = prefix_output[..., :head_dim], suffix_output[..., :head_dim]
        api = functools.partial(
            self.pi.merge_attn_states, prefill_tokens_with_context=prefill_tokens_with_context,
            query_start_loc=query_start_loc, prefix_cu_seq_lens=prefix_cu_seq_lens, return_lse=return_lse,
            out_dtype=self._dtype(out_dtype), output_scale=output_scale, lse_layout=lse_layout, lse_base=lse_base,
            **_group_options(group_size, scale_ue8m0, out_dtype, scale_layout), **self.kernel)
        return self._holder(lambda: _as_results(api(a, prefix_lse, b, suffix_lse), return_lse, group_size,
                                                out_dtype, (a.shape[0], a.shape[1] * a.shape[2] // 16)))

    def bind_merge_n(self, outputs, lses, *, head_dim=None, prefill_tokens_with_context=None, query_start_loc=None,
                     cu_seq_lens=None, out_dtype=None, output_scale=None, return_lse=True, lse_layout="HT",
                     lse_base=math.e, group_size=None, scale_ue8m0=False, scale_layout="row", **_):
        o = outputs[..., :head_dim]
        api = functools.partial(
            self.pi.merge_attn_states_n, prefill_tokens_with_context=prefill_tokens_with_context,
            query_start_loc=query_start_loc, cu_seq_lens=cu_seq_lens, return_lse=return_lse,
            out_dtype=self._dtype(out_dtype), output_scale=output_scale, lse_layout=lse_layout, lse_base=lse_base,
            **_group_options(group_size, scale_ue8m0, out_dtype, scale_layout), **self.kernel)
        return self._holder(lambda: _as_results(api(o, lses), return_lse, group_size, out_dtype,
                                                (o.shape[1], o.shape[2] * o.shape[3] // 16)))


    def cp_merge(self, out, lse, *, axis_name, method="gather", query_start_loc=None, cu_seq_lens=None,
                 prefill_tokens_with_context=None, out_dtype=None, output_scale=None, return_lse=True,
                 lse_layout="HT", lse_base=math.e, reduce_dtype=None, **_) -> dict[str, Any]:
        """The context-parallel combine over `axis_name` (inside `jax.shard_map` or a named `jax.vmap`)."""
        r = self.pi.cp_merge_attn_states(
            out, lse, axis_name=axis_name, method=method, query_start_loc=query_start_loc, cu_seq_lens=cu_seq_lens,
            prefill_tokens_with_context=prefill_tokens_with_context, return_lse=return_lse,
            out_dtype=self._dtype(out_dtype), output_scale=output_scale, lse_layout=lse_layout, lse_base=lse_base,
            reduce_dtype=reduce_dtype, **self.kernel)
        return _as_results(r, return_lse)


def _group_options(group_size, scale_ue8m0: bool, out_dtype=None, scale_layout="row") -> dict[str, Any]:
    """pallas_impl's per-group FP8 options (docs/spec.md 4.7): the scales in DeepGEMM's TMA-aligned column-major
    layout, so the harness runs the layout path (`_as_results` views them back as f32[T, G#]); NVFP4's block-scale
    layout (4.8)."""
    if out_dtype == "float4_e2m1fn":
        return dict(scale_layout=scale_layout)
    return dict(group_size=group_size, scale_ue8m0=scale_ue8m0, scale_layout="col_tma") if group_size else {}


def nvfp4_values(packed):
    """The values of NVFP4's packed e2m1 codes (docs/spec.md 4.8; byte j: element 2j low nibble, 2j + 1 high),
    u8[..., K / 2] -> f32[..., K], on the array's own device (torch or JAX): the block's units, before the scales."""
    import numpy as np

    from parity.harness.reference import FP4_E2M1_VALUES

    if hasattr(packed, "device") and type(packed).__module__.startswith("torch"):
        import torch

        codes = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(*packed.shape[:-1], -1).long()
        lut = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=packed.device)
        mag = lut[codes & 7]
        return torch.where((codes & 8) != 0, -mag, mag)
    import jax.numpy as jnp

    codes = jnp.stack([packed & 15, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1).astype(jnp.int32)
    mag = jnp.asarray(np.asarray(FP4_E2M1_VALUES, np.float32))[codes & 7]
    return jnp.where((codes & 8) != 0, -mag, mag)


def _as_results(r, return_lse: bool, group_size=None, out_dtype=None, blocks=None) -> dict[str, Any]:
    """The adapters' results; NVFP4's block scales row-major [T, K] (`blocks`), read back from a flat swizzled
    buffer."""
    if out_dtype == "float4_e2m1fn":  # NVFP4 (docs/spec.md 4.8): packed codes and row-major e4m3 block scales
        out, lse, scales = r if return_lse else (r[0], None, r[1])
        if scales.ndim == 1:  # the swizzled layout
            scales = scales[swizzled_offsets(*blocks)]
        return {"out": nvfp4_values(out), "lse": lse, "scales": scales}
    if group_size:
        out, lse, scales = r if return_lse else (r[0], None, r[1])
        return {"out": out, "lse": lse, "scales": scales[:, :out.shape[0]].T}
    return {"out": r[0], "lse": r[1]} if return_lse else {"out": r, "lse": None}
