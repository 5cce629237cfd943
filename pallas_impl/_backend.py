"""Which implementation and Pallas GPU backend a call runs, and how: implementation (Pallas kernel or jnp),
backend ("triton" or "mosaic_gpu"), interpret mode, the Pallas Triton lowering's parameters and its deprecation
warning (docs/design.md, "Mosaic GPU backend")."""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import warnings

import jax

try:
    from jax.experimental.pallas import triton as pltriton
except ImportError:  # a jax without the Pallas Triton backend: backend="mosaic_gpu" only (resolve_backend)
    pltriton = None

IMPLEMENTATIONS = ("pallas", "jnp")
BACKENDS = ("triton", "mosaic_gpu")  # the Pallas GPU backend of implementation="pallas" (resolve_backend)
BACKEND_ENV = "PALLAS_IMPL_BACKEND"  # the process-wide default of backend=None
MOSAIC_MIN_JAX = (0, 11)  # Mosaic GPU: Warpgroup lowering by default, plgpu.kernel(out_type=...), its interpreter
FP8_LOWERING_MIN_JAX = (0, 10, 2)  # the Pallas Triton lowering of jax 0.10.0 cannot cast to float8_e4m3fn


@functools.cache
def has_mosaic_gpu() -> bool:
    """Whether this jax's Mosaic GPU Pallas API is one the `pallas_impl/mosaic` kernels take (jax >= 0.11)."""
    return tuple(int(x) for x in re.findall(r"\d+", jax.__version__)[:2]) >= MOSAIC_MIN_JAX


def check_fp8_lowering(quantized: bool, interpret: bool, backend: str) -> None:
    """An fp8 or NVFP4 output (`quantized`: an fp8 store in the kernel) compiled on the Pallas Triton backend needs a
    jax whose Triton lowering casts to float8_e4m3fn (0.10.2 does, 0.10.0 does not): a clear error here instead of
    the lowering's. Interpret mode, the jnp path and Mosaic GPU take it on any jax."""
    if quantized and not interpret and backend == "triton":
        version = tuple(int(x) for x in re.findall(r"\d+", jax.__version__)[:3])
        if version < FP8_LOWERING_MIN_JAX:
            raise NotImplementedError(f"fp8 and NVFP4 outputs of the Pallas Triton backend need jax >= 0.10.2 (the "
                                      f"Triton lowering of jax {jax.__version__} cannot cast to float8_e4m3fn); use "
                                      "implementation='jnp' or a newer jax")


def resolve_interpret(interpret: bool | None, backend: str = "triton") -> bool:
    """None: interpret on CPU, compile on GPU. backend="mosaic_gpu" needs jax >= 0.11 either way (its interpret
    mode is jax's Mosaic GPU interpreter)."""
    if backend == "mosaic_gpu" and not has_mosaic_gpu():
        raise NotImplementedError(f"backend='mosaic_gpu' needs jax >= 0.11 (its layout inference and plgpu.kernel "
                                  f"API); this is jax {jax.__version__}: use backend='triton'")
    if interpret is None:
        return jax.default_backend() == "cpu"
    return bool(interpret)


def check_compile_target(interpret, implementation, backend, x) -> None:
    """interpret=False compiles the Pallas kernels for a GPU. Called eagerly where JAX's platform is the CPU, that
    cannot run (JAX would fail inside its lowering): refused here. Under a trace (`jax.jit`, `jax.export` for a GPU
    from a CPU host) it is the caller's lowering target, left alone; the jnp path ignores `interpret`."""
    kernel = implementation == "pallas" or backend == "mosaic_gpu"
    if interpret is False and kernel and jax.default_backend() == "cpu" and not isinstance(x, _TRACER):
        raise NotImplementedError("interpret=False compiles the Pallas kernels for a GPU, and JAX's platform is the "
                                  "CPU: use interpret=None or True (the Pallas interpreter), or implementation='jnp'")


_TRACER = getattr(jax.core, "Tracer", None) or __import__("jax._src.core", fromlist=["Tracer"]).Tracer


def resolve_backend(backend: str | None) -> str:
    """The Pallas GPU backend. None: the environment's `PALLAS_IMPL_BACKEND` if set, else "triton" while jax has
    the Pallas Triton backend and "mosaic_gpu" once it is gone (experimental; docs/design.md, "Mosaic GPU
    backend")."""
    if backend is None:
        backend = os.environ.get(BACKEND_ENV) or ("triton" if pltriton is not None else "mosaic_gpu")
        if backend not in BACKENDS:
            raise ValueError(f"{BACKEND_ENV} must be one of {BACKENDS} or unset, got {backend!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    if backend == "triton" and pltriton is None:
        raise NotImplementedError(f"backend='triton': this jax ({jax.__version__}) has no Pallas Triton backend "
                                  "(jax.experimental.pallas.triton): use backend='mosaic_gpu' or None")
    return backend


def resolve_implementation(implementation: str | None, backend: str | None = None) -> str:
    """None: the Pallas kernel on GPU, the jnp path elsewhere; with an explicit backend="mosaic_gpu" (the
    caller's argument, not the environment's default), the Pallas kernel. An explicit choice never falls back."""
    platform = jax.default_backend()
    if backend is not None:
        resolve_backend(backend)  # an unknown name is refused first
    if backend == "mosaic_gpu":
        if implementation == "jnp":
            raise ValueError("backend='mosaic_gpu' selects a Pallas kernel; it does not go with implementation='jnp'")
        implementation = "pallas"
    if implementation is None:
        return "pallas" if platform == "gpu" else "jnp"
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} or None, got {implementation!r}")
    if implementation == "pallas" and platform not in ("gpu", "cpu"):
        raise NotImplementedError(
            f"the Pallas kernels target GPUs (and the CPU interpreter); the platform is {platform!r}: "
            "use implementation='jnp'")
    return implementation


# jax 0.11 warns at every lowering of a Triton-backend pallas_call (docs/design.md, "Mosaic GPU backend").
TRITON_DEPRECATION = r"The Pallas Triton backend is deprecated and will be removed in a future JAX version\."


@functools.cache
def _compiler_params_type():
    """Our kernels' Triton compiler parameters: a subclass of `pltriton.CompilerParams` whose lowering rule is
    jax's own with the deprecation warning ignored while it lowers one of our kernels (jax picks a pallas_call's
    GPU lowering rule by its compiler parameters' type). The filter lives inside that lowering only
    (`warnings.catch_warnings`): the caller's own Triton-backend kernels still warn, and the process's warning
    filters are left as they were. A jax without that registry takes `pltriton.CompilerParams` (and may warn)."""
    try:
        from jax._src.pallas import core as pallas_core
        from jax._src.pallas.triton import pallas_call_registration as triton_lowering
    except ImportError:
        return pltriton.CompilerParams
    if not hasattr(pallas_core, "register_lowering_rule"):
        return pltriton.CompilerParams

    @dataclasses.dataclass(frozen=True)
    class CompilerParams(pltriton.CompilerParams):
        pass

    def lowering(ctx, *in_nodes, **params):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=TRITON_DEPRECATION, category=DeprecationWarning)
            return triton_lowering.pallas_call_lowering(ctx, *in_nodes, **params)

    pallas_core.register_lowering_rule(CompilerParams, lowering, "gpu")
    return CompilerParams


def compiler_params(num_warps: int):
    """Pins the Pallas Triton lowering (docs/spec.md 6), lowered without jax's deprecation warning
    (`_compiler_params_type`); see docs/design.md for the move to Mosaic GPU."""
    return _compiler_params_type()(num_warps=num_warps, num_stages=1)
