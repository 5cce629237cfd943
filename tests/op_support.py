"""Test helper of the per-op suites (tests/test_op_*.py): every implementation behind one calling convention.

The suites run each behaviour once, parametrised over `IMPLS`, through `parity.harness.impls` (adapters, `op_call`)
and judge it against the float64 reference (`parity.harness.reference`, `parity.harness.expected`) with the one
comparison helper, `parity.library.compare`. Options the adapters do not carry (`validate=True`, bad arguments)
go through `public`, one call of the implementation's public API.

- `IMPLS`: "triton", "pallas" (interpret mode on CPU, compiled on a GPU), "jnp", "torch" (triton_impl's torch path),
  "mosaic" (jax >= 0.11 only: the param skips with the reason elsewhere); marked `gpu` on a CUDA machine (the GPU
  run selects `-m gpu`);
- `to_impl(impl, arrays)`: numpy arrays in the implementation's own type (torch on `RT.device`, JAX arrays);
- `run(impl, op, case, arrays, **options)`: one operation of `impls.OPS` on numpy arrays, the options of
  `impls.op_call` updated by `options`; results as numpy-comparable arrays of the implementation;
- `check_mask` / `check_merge`: the result against the reference, exact bits where the spec makes them exact.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from merge_checks import assert_merge_matches_reference
from parity.harness import cases, impls
from parity.library import bridge
from parity.library.compare import assert_bitwise_equal

RT = impls.make_runtime()
HAS_MOSAIC = tuple(int(x) for x in re.findall(r"\d+", jax.__version__)[:2]) >= (0, 11)
_NEEDS_MOSAIC = pytest.mark.skipif(not HAS_MOSAIC, reason=f"backend='mosaic_gpu' needs jax >= 0.11; this is jax "
                                                          f"{jax.__version__}")
JAX_IMPLS = ("pallas", "jnp", "mosaic")
TORCH_IMPLS = ("triton", "torch")  # triton_impl's Triton kernels and its torch path


def _impls(gpu=()):
    """The params of every implementation. On a CUDA machine each carries the `gpu` mark, so that the GPU run's
    `pytest -m gpu` (`python -m tools gpu-run`) runs the per-op suites compiled; on CPU only those named in `gpu`."""
    out = []
    for name in ("triton", "pallas", "jnp", "torch", "mosaic"):
        marks = [_NEEDS_MOSAIC] if name == "mosaic" else []
        if RT.on_gpu or name in gpu:
            marks.append(pytest.mark.gpu)
        out.append(pytest.param(name, marks=marks, id=name))
    return out


IMPLS = _impls()


def gpu_only(*names):
    """IMPLS with the named implementations marked `gpu` (e.g. the Triton interpreter where a shape is too slow
    on CPU, or jnp where XLA:CPU's per-program FMA contraction rules out bit equality, docs/spec.md 5)."""
    return _impls(gpu=names)


def to_impl(impl: str, arrays: dict) -> dict:
    """numpy arrays as the implementation's arrays. For JAX, 64-bit numpy arrays stay numpy (jnp.asarray would
    narrow them to 32 bits with x64 off; the wrappers' dtype checks must see them)."""
    if impl == "reference":
        return dict(arrays)
    if impl in TORCH_IMPLS:
        return {k: None if v is None else bridge.to_torch(np.asarray(v), RT.device) for k, v in arrays.items()}
    return {k: v if v is None or (isinstance(v, np.ndarray) and v.dtype.itemsize == 8) else jnp.asarray(v)
            for k, v in arrays.items()}


def run(impl: str, op: str, case, arrays: dict, **options) -> dict:
    """`op` of `impl` on the numpy `arrays` with the case's options (`impls.op_call`) updated by `options`."""
    method, args, opts = impls.op_call(op, case, to_impl(impl, arrays))
    opts.update(options)
    return getattr(impls.adapter(RT, impl), method)(*args, **opts)


def numpy(x):
    return None if x is None else np.array(bridge.to_numpy(x))  # a writable copy


def check_mask(impl: str, case, arrays: dict, res: dict, *, with_output: bool = True) -> None:
    """The mask's results bit for bit against the reference; Triton's V-padded columns keep their bits."""
    ref = impls.run(impls.HOST, "reference", "mask", case, arrays)
    assert_bitwise_equal(res["lse"], ref["lse"], name="mask.lse", case=case, mode=impl)
    if with_output:
        assert_bitwise_equal(res["output"], ref["output"], name="mask.output", case=case, mode=impl)
        buf = res.get("output_buffer")
        if buf is not None and buf.shape[-1] > case.head_dim:
            assert_bitwise_equal(buf[..., case.head_dim:], arrays["prefix_output"][..., case.head_dim:],
                                 name="mask.output[pad]", case=case, mode=impl)


def check_merge(impl: str, case, op: str, arrays: dict, res: dict) -> None:
    """A merge's results against the reference of the same operands (`merge_checks`): result dtypes, exact rows bit
    for bit, the rest within tolerance; the columns past D of Triton's output buffer keep their NaN poison."""
    out_dtype = cases.DTYPES[case.out_dtype or case.dtype]
    assert numpy(res["out"]).dtype == out_dtype, (impl, numpy(res["out"]).dtype, out_dtype)
    if res["lse"] is not None:
        assert numpy(res["lse"]).dtype == np.float32
    assert_merge_matches_reference(case, op, arrays, res["out"], res["lse"], mode=impl, name=op)
    buf = res.get("out_buffer")
    if buf is not None and buf.shape[-1] > case.head_dim:
        pad = buf[..., case.head_dim:]
        assert_bitwise_equal(pad, impls.poisoned(pad.shape, case.out_dtype or case.dtype, pad.device),
                             name=f"{op}.out[pad]", case=case, mode=impl)


def bits(x) -> np.ndarray:
    x = np.ascontiguousarray(numpy(x))
    return x.view({8: np.uint64, 4: np.uint32, 2: np.uint16, 1: np.uint8}[x.dtype.itemsize])


# ---------------------------------------------------------------------------------------------------------
# The public APIs, called directly: for options the adapters do not carry (validate) and for bad arguments.


def _jax_kernel(impl: str) -> dict:
    if impl == "mosaic":
        return dict(implementation="pallas", backend="mosaic_gpu")
    return dict(implementation=impl)


def public_mask(impl: str, lse, query_start_loc, cu_seq_lens, output=None, **kw):
    """One call of the mask's public API on the implementation's arrays (Triton: in place, returns the arguments)."""
    if impl in TORCH_IMPLS:
        import triton_impl

        with np.errstate(all="ignore"):
            triton_impl.mask_empty_context_lse(lse, query_start_loc, cu_seq_lens, output, implementation=impl, **kw)
        return lse if output is None else (lse, output)
    import pallas_impl

    return pallas_impl.mask_empty_context_lse(lse, query_start_loc, cu_seq_lens, output, **kw, **_jax_kernel(impl))


def _triton_out(like, out_dtype, lse_shape):
    import torch

    dtype = like.dtype if out_dtype is None else getattr(torch, out_dtype)
    out = torch.zeros(like.shape[-3:], device=like.device).to(dtype)
    return out, torch.zeros(tuple(lse_shape), device=like.device)


def public_merge(impl: str, prefix_output, prefix_lse, suffix_output, suffix_lse, *, out_dtype=None,
                 prefill_tokens_with_context=None, output_scale=None, return_lse=True, **kw):
    """One call of the 2-way merge's public API (`out_dtype` by name; Triton allocates `output` of that dtype)."""
    if impl in TORCH_IMPLS:
        import triton_impl

        T, H = prefix_output.shape[:2]
        out, out_lse = _triton_out(prefix_output, out_dtype, (H, T) if kw.get("lse_layout", "HT") == "HT" else (T, H))
        out_lse = out_lse if return_lse else None
        with np.errstate(all="ignore"):
            triton_impl.merge_attn_states(out, prefix_output, prefix_lse, suffix_output, suffix_lse, out_lse,
                                          prefill_tokens_with_context, output_scale, implementation=impl, **kw)
        return (out, out_lse) if return_lse else out
    import pallas_impl

    return pallas_impl.merge_attn_states(
        prefix_output, prefix_lse, suffix_output, suffix_lse, prefill_tokens_with_context=prefill_tokens_with_context,
        output_scale=output_scale, return_lse=return_lse,
        out_dtype=None if out_dtype is None else cases.DTYPES[out_dtype], **kw, **_jax_kernel(impl))


def public_merge_n(impl: str, outputs, lses, *, out_dtype=None, prefill_tokens_with_context=None,
                   output_scale=None, return_lse=True, **kw):
    """One call of the N-way merge's public API (`out_dtype` by name)."""
    if impl in TORCH_IMPLS:
        import triton_impl

        out, out_lse = _triton_out(outputs, out_dtype, lses.shape[1:])
        out_lse = out_lse if return_lse else None
        with np.errstate(all="ignore"):
            triton_impl.merge_attn_states_n(out, outputs, lses, out_lse, prefill_tokens_with_context, output_scale,
                                            implementation=impl, **kw)
        return (out, out_lse) if return_lse else out
    import pallas_impl

    return pallas_impl.merge_attn_states_n(
        outputs, lses, prefill_tokens_with_context=prefill_tokens_with_context, output_scale=output_scale,
        return_lse=return_lse, out_dtype=None if out_dtype is None else cases.DTYPES[out_dtype], **kw,
        **_jax_kernel(impl))
