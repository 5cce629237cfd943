"""The bit-parity recipe of docs/spec.md 5 as code: what makes a Triton kernel (PyTorch) and a Pallas kernel (JAX)
with the same source math give the same bits on a GPU. Imports nothing heavy; see docs/parity-library.md.

- `TRITON_LAUNCH`: pass to every launch, `kernel[grid](..., **TRITON_LAUNCH)` (or `triton_launch(**yours)`).
- `MATH`: which function to call on each side for each transcendental (the same libdevice function).
- `XLA_FLAGS`: the XLA settings that keep flush-to-zero, fast min/max and excess precision out of XLA-compiled
  code (`xla_flags()`, `apply_xla_flags()`); every flag here exists in the XLA of jax 0.10.2 and 0.11.2 (an
  unknown flag in XLA_FLAGS aborts the process, and a test checks these start).
- `MOSAIC_GPU`: the Pallas Mosaic GPU compiler parameter to keep at its default.
"""

from __future__ import annotations

import os
import sys

TRITON_LAUNCH = {"enable_fp_fusion": False, "enable_reflect_ftz": False}
"""Triton launch options. `enable_fp_fusion=False`: no contraction of `a * b + c` into an FMA (Triton contracts by
default; XLA's Triton pipeline for Pallas does not). `enable_reflect_ftz=False`: libdevice keeps subnormals (Triton
flushes them by default; XLA does not). Cost: a separate multiply and add where an FMA was (one instruction more,
and one rounding more, which is the point); invisible in memory-bound kernels, measurable in compute-bound ones
(not measured here)."""

MATH = {
    # op: (Triton on GPU, Triton interpreter, Pallas / jnp)
    "exp": ("libdevice.exp (__nv_expf)", "tl.exp", "jnp.exp (__nv_expf)"),
    "log": ("libdevice.log (__nv_logf)", "tl.log", "jnp.log (__nv_logf)"),
    "sqrt": ("libdevice.sqrt (__nv_sqrtf)", "tl.sqrt_rn", "jnp.sqrt (__nv_sqrtf)"),
    "rsqrt": ("libdevice.rsqrt (__nv_rsqrtf)", "tl.rsqrt", "jax.lax.rsqrt (__nv_rsqrtf)"),
    "divide": ("a / b (div.full.f32)", "a / b", "a / b (div.full.f32)"),
}
"""Which call gives the same bits on both sides (`libdevice` is `triton.language.extra.cuda.libdevice`). Triton's
own `tl.exp` is `ex2.approx` of `x * log2(e)` and `tl.sqrt` is `sqrt.approx`: fast, and not what Pallas computes.
libdevice does not exist in Triton's interpreter: pick with a constexpr (parity/examples/rmsnorm_triton.py). Cost:
libdevice exp/log are a few instructions longer than the approximate ones."""

XLA_FLAGS = {
    "--xla_gpu_ftz=false": "XLA:GPU keeps subnormals (the default; pinned)",
    "--xla_gpu_enable_fast_min_max=false": "min/max propagate NaN as jnp.minimum/maximum specify (the default; pinned)",
    "--xla_cpu_enable_fast_math=false": "XLA:CPU: no fast-math reassociation or approximations (the default; pinned)",
    "--xla_allow_excess_precision=false": "bf16/f16 intermediates of fused jnp code round at every op, as the "
                                          "op-by-op program says, instead of staying in f32 (default true)",
}
"""XLA settings for the jnp code around (or instead of) a Pallas kernel. They do not reach inside a Pallas kernel:
its float math is the Pallas lowering's (exp/log/sqrt/rsqrt from libdevice, no FMA contraction, no FTZ on the
Triton backend; `MOSAIC_GPU` on Mosaic GPU). XLA has no flag for FMA contraction of fused elementwise code (none
found in jax 0.10.2 / 0.11.2; on XLA:CPU jitted `a * b + c` is measured to contract even with
`--xla_cpu_enable_fast_math=false` and with `lax.reduce_precision` or `lax.optimization_barrier` on the product):
write the arithmetic that must match in a Pallas kernel. Cost of
`--xla_allow_excess_precision=false`: extra converts in fused bf16/f16 code; the others are defaults."""

MOSAIC_GPU = {"approx_math": False}
"""`plgpu.CompilerParams(approx_math=False)` (the default): exact libdevice math in Mosaic GPU kernels."""


def triton_launch(**launch) -> dict:
    """`launch` (num_warps=..., ...) plus `TRITON_LAUNCH`; a contrary enable_fp_fusion / enable_reflect_ftz raises."""
    for key, value in TRITON_LAUNCH.items():
        if key in launch and launch[key] != value:
            raise ValueError(f"{key}={launch[key]!r} breaks bit parity (docs/spec.md 5); the recipe needs {value!r}")
    return {**launch, **TRITON_LAUNCH}


def merge_xla_flags(existing: str, flags) -> str:
    """The XLA_FLAGS string `existing` with each of `flags` added unless a flag of its name is set there already."""
    have = {f.split("=", 1)[0] for f in existing.split()}
    return " ".join([*existing.split(), *(f for f in flags if f.split("=", 1)[0] not in have)])


def jax_backend_started() -> bool:
    """Whether JAX has started a backend in this process (it has read XLA_FLAGS then, once)."""
    if "jax" not in sys.modules:
        return False
    from jax._src import xla_bridge

    return bool(getattr(xla_bridge, "_backends", None))


def xla_flags(existing: str | None = None) -> str:
    """`existing` (default: $XLA_FLAGS) with the recipe's `XLA_FLAGS` added; a flag already set there is kept
    as it is (check with `xla_flag_conflicts`)."""
    return merge_xla_flags(os.environ.get("XLA_FLAGS", "") if existing is None else existing, XLA_FLAGS)


def xla_flag_conflicts(existing: str | None = None) -> list[str]:
    """The flags of `existing` (default: $XLA_FLAGS) that set a recipe flag to another value."""
    existing = os.environ.get("XLA_FLAGS", "") if existing is None else existing
    want = dict(f.split("=", 1) for f in XLA_FLAGS)
    conflicts = []
    for flag in existing.split():
        key, _, value = flag.partition("=")
        if key in want and value != want[key]:
            conflicts.append(flag)
    return conflicts


def apply_xla_flags() -> str:
    """Adds the recipe to $XLA_FLAGS. XLA reads it when JAX starts its first backend: call this before."""
    if jax_backend_started():
        raise RuntimeError("JAX has started a backend already; XLA_FLAGS is read once: call apply_xla_flags() "
                           "before the first JAX computation (or set XLA_FLAGS in the environment)")
    os.environ["XLA_FLAGS"] = xla_flags()
    return os.environ["XLA_FLAGS"]


__all__ = ["MATH", "MOSAIC_GPU", "TRITON_LAUNCH", "XLA_FLAGS", "apply_xla_flags", "jax_backend_started",
           "merge_xla_flags", "triton_launch", "xla_flags", "xla_flag_conflicts"]
