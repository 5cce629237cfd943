"""How to run each implementation of each operation: the one place the harness commands go through.

`check`, `golden`, `bench` and `demo` never call `triton_impl` or `pallas_impl` themselves; they ask this
module. Implementations (`IMPLS`):

- "reference": `parity.harness.reference`, float64 numpy, in token chunks (every token is independent);
- "triton": `triton_impl` on torch tensors, in place into buffers allocated here (poisoned with NaN, so an
  element a kernel fails to write shows up);
- "pallas": `pallas_impl` with `implementation="pallas"` (interpret mode on CPU) and the Pallas backend of
  `set_pallas_backend` (the CLI's `--pallas-backend`; None: `pallas_impl`'s default);
- "jnp": `pallas_impl` with `implementation="jnp"` (its plain-XLA path);
- "torch": `triton_impl` with `implementation="torch"` (its torch path, `triton_impl/torch_fallback.py`);
- "mosaic" (not in `IMPLS`: GPU and jax >= 0.11 only, run by its own tests): `pallas_impl` with
  `backend="mosaic_gpu"`, the experimental Mosaic GPU kernels.

Three layers:

1. `configure()` / `make_runtime()`: the run mode, fixed before anything imports `triton_impl` (Triton reads
   `TRITON_INTERPRET` when its kernels are defined), and the device both frameworks share.
2. `adapter(rt, impl)`: an implementation behind one calling convention. `bind_mask`, `bind_merge` and
   `bind_merge_n` prepare one call of the public API (buffers allocated, options resolved) and return a
   `Bound`: `call()` is exactly one public call (what the benchmarks time, what a CUDA graph captures) and
   `results()` its outputs as a dict; `mask`, `merge` and `merge_n` do both. Arrays are the
   implementation's own type (numpy, torch tensors, JAX arrays); dtypes are named by string.
3. `run(rt, impl, op, case, arrays)`: one operation of `OPS` on a `parity.harness.cases` case's arrays.

Modules: `runtime` (layer 1), `adapters` (the calling convention, the reference's adapter), `kernels` (the
Triton and JAX adapters); this module holds the registry and layer 3. The environment record every command
writes is `parity.harness.provenance.collect_env`.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from parity.harness import cases as cases_mod
from parity.harness import reference
from parity.harness.impls.adapters import REF_CHUNK_ELEMS, Adapter, Bound, ReferenceAdapter, token_slice
from parity.harness.impls.kernels import JaxAdapter, TritonAdapter, poisoned
from parity.harness.impls.runtime import HOST, Runtime, configure, make_runtime

__all__ = ["EXPERIMENTAL_IMPLS", "HOST", "IMPLS", "KERNEL_IMPLS", "OPS", "REF_CHUNK_ELEMS", "Adapter", "Bound",
           "JaxAdapter", "ReferenceAdapter", "Runtime", "TritonAdapter", "adapter", "bind", "configure",
           "make_runtime", "masked_lses", "op_call", "ops_of", "pallas_backend", "poisoned", "run",
           "set_pallas_backend", "token_slice"]

IMPLS = ("reference", "triton", "pallas", "jnp", "torch")
EXPERIMENTAL_IMPLS = ("mosaic",)
KERNEL_IMPLS = ("triton", "pallas", "jnp", "torch")
# Operations on a case's arrays. "merge" takes the masked prefix (mask then merge), "merge_fused" the raw
# prefix with the fused mask; "merge_n" the reference-masked partials, "merge_n_fused" the raw partials with
# their offsets (docs/spec.md section 8).
OPS = ("mask", "merge", "merge_fused", "merge_n", "merge_n_fused")
_PALLAS_BACKEND: list[str | None] = [None]  # the "pallas" implementation's `backend=` (set_pallas_backend)


def _merge_options(case: cases_mod.Case) -> dict[str, Any]:
    options = dict(prefill_tokens_with_context=case.prefill_tokens_with_context, out_dtype=case.out_dtype,
                   lse_layout=case.lse_layout, lse_base=case.lse_base)
    if case.group_size:  # per-group FP8 (docs/spec.md 4.7): every adapter returns "scales" f32[T, H * D / G] too
        options.update(group_size=case.group_size, scale_ue8m0=case.scale_ue8m0)
    if case.nvfp4:  # NVFP4 (4.8): the block scales' layout; every adapter returns them row-major [T, H * D / 16]
        options.update(scale_layout=case.scale_layout)
    return options



def set_pallas_backend(backend: str | None) -> None:
    """The `backend=` of every later "pallas" run: None (pallas_impl's default), "triton" or "mosaic_gpu"."""
    _PALLAS_BACKEND[0] = backend


def pallas_backend() -> str | None:
    return _PALLAS_BACKEND[0]


@functools.cache
def _adapter(rt_key: tuple, impl: str, backend: str | None) -> Adapter:
    rt = Runtime(*rt_key)
    if impl == "reference":
        return ReferenceAdapter()
    if impl == "triton":
        return TritonAdapter(rt)
    if impl == "torch":
        return TritonAdapter(rt, implementation="torch")
    if impl == "pallas":
        return JaxAdapter(rt, impl, backend=backend)
    if impl == "jnp":
        return JaxAdapter(rt, impl)
    if impl == "mosaic":
        return JaxAdapter(rt, "pallas", backend="mosaic_gpu")
    if impl == "mosaic-lowered":  # compiled kernels even on a CPU: for jax.export(platforms=["cuda"]) only
        return JaxAdapter(rt, "pallas", backend="mosaic_gpu", interpret=False)
    raise ValueError(f"impl must be one of {IMPLS + EXPERIMENTAL_IMPLS}, got {impl!r}")


def adapter(rt: Runtime, impl: str) -> Adapter:
    """The adapter of `impl` ("reference", "triton", "pallas", "jnp", "torch", "mosaic"), imported once."""
    return _adapter((rt.device, rt.mode), impl, _PALLAS_BACKEND[0] if impl == "pallas" else None)


# ---------------------------------------------------------------------------------------------------------
# Operations on a case's arrays


def op_call(op: str, case: cases_mod.Case, arrays: dict[str, Any]) -> tuple[str, tuple, dict[str, Any]]:
    """(adapter method, positional arrays, options) of `op` on `arrays` (the keys of `cases.make_inputs` /
    `make_inputs_n`, in one implementation's array type), with the case's options.

    "merge" reads `prefix_output` / `prefix_lse` as given: the caller passes the masked prefix there.
    "merge_n" reads `lses` as given: the caller passes the masked LSEs there.
    """
    D = case.head_dim
    if op == "mask":
        return "mask", (arrays["prefix_lse"], arrays["query_start_loc"], arrays["cu_seq_lens"],
                        arrays["prefix_output"]), dict(head_dim=D, lse_layout=case.lse_layout)
    opts = dict(_merge_options(case), head_dim=D, head_pad=case.head_pad, output_scale=arrays.get("output_scale"))
    if op in ("merge", "merge_fused"):
        if op == "merge_fused":
            opts.update(query_start_loc=arrays["query_start_loc"], prefix_cu_seq_lens=arrays["cu_seq_lens"])
        return "merge", (arrays["prefix_output"], arrays["prefix_lse"], arrays["suffix_output"],
                         arrays["suffix_lse"]), opts
    if op in ("merge_n", "merge_n_fused"):
        if op == "merge_n_fused":
            opts.update(query_start_loc=arrays["query_start_loc"], cu_seq_lens=arrays["cu_seq_lens"])
        return "merge_n", (arrays["outputs"], arrays["lses"]), dict(opts, strided=case.strided)
    raise ValueError(f"op must be one of {OPS}, got {op!r}")


def bind(rt: Runtime, impl: str, op: str, case: cases_mod.Case, arrays: dict[str, Any]) -> Bound:
    method, args, opts = op_call(op, case, arrays)
    return getattr(adapter(rt, impl), "bind_" + method)(*args, **opts)


def run(rt: Runtime, impl: str, op: str, case: cases_mod.Case, arrays: dict[str, Any]) -> dict[str, Any]:
    """Run `op` of `impl` on a case's arrays; returns the results dict of the adapter."""
    return bind(rt, impl, op, case, arrays)()


def ops_of(case: cases_mod.Case) -> tuple[str, ...]:
    """The operations `check` and the golden vectors run on `case`."""
    if case.n_way:
        return ("merge_n", "merge_n_fused")
    return ("mask", "merge", "merge_fused") if case.empty else ("mask", "merge")


def masked_lses(case: cases_mod.Case, inputs: dict[str, np.ndarray]) -> np.ndarray:
    """The N-way case's LSEs after the reference mask of each partial: the "merge_n" operand (exact)."""
    lses = inputs["lses"]
    out = np.empty_like(lses)
    for i in range(case.partials):
        out[i] = reference.mask_empty_context_lse(lses[i], inputs["query_start_loc"], inputs["cu_seq_lens"][i],
                                                  lse_layout=case.lse_layout)[0]
    return out
