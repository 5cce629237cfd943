"""How the Triton kernels compile and run: interpreter or GPU, torch.compile tracing, the parity launch options
(docs/spec.md 5) and the per-layout jit of each kernel (docs/design.md, "Runtime values")."""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import torch
import triton

# Launch options that make the float math reproducible by the Pallas port (docs/spec.md 5).
PARITY_LAUNCH = dict(enable_fp_fusion=False, enable_reflect_ftz=False)


def tracing() -> bool:
    """True while torch.compile traces (data pointers are unknown; the launch-plan cache is bypassed)."""
    return torch.compiler.is_compiling()


IMPLEMENTATIONS = ("triton", "torch")


def resolve_implementation(implementation: str | None, device: torch.device) -> str:
    """None: the Triton kernels where Triton has a driver for `device` (CUDA and ROCm, or any device under
    Triton's interpreter, `TRITON_INTERPRET=1`), the torch path elsewhere (CPU, MPS, XPU, a build without Triton).
    An explicit choice never falls back."""
    if implementation is None:
        return "triton" if triton_runs_on(device) else "torch"
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} or None, got {implementation!r}")
    if implementation == "triton" and not triton_runs_on(device):
        raise NotImplementedError(f"implementation='triton' compiles for CUDA or ROCm GPUs; the tensors are on "
                                  f"{device} (use implementation='torch' or None, or set TRITON_INTERPRET=1 before "
                                  "importing triton_impl for Triton's interpreter)")
    return implementation


def triton_runs_on(device: torch.device) -> bool:
    """Whether the Triton kernels run on `device`: any device under the interpreter, else a CUDA (or ROCm) device
    with Triton's GPU driver active."""
    return interpreting() or (device.type == "cuda" and _has_gpu_driver())


@functools.cache
def _has_gpu_driver() -> bool:
    """Whether Triton has an active GPU driver (CUDA or ROCm)."""
    try:
        from triton.runtime import driver

        driver.active.get_current_device()
        return True
    except Exception:  # noqa: BLE001 - any failure means no usable driver
        return False


def interpreting() -> bool:
    """True when Triton runs kernels in its interpreter (read at kernel import, as Triton does)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def n_interpret(num_keys: int) -> int:
    """The scan length as a compile-time value under the interpreter only, 0 when compiling.

    Triton's interpreter cannot loop to a runtime bound with numpy >= 2.4 (docs/spec.md 6); it compiles nothing,
    so a constant there costs no recompilation. Compiled kernels always loop to the runtime value.
    """
    return num_keys if interpreting() else 0


def jit_per_lse_layout(*, runtime: Sequence[str], lse_head_strides: Sequence[str]):
    """Decorator: `triton.jit` the kernel once per LSE layout, as {lse_layout: kernel}; the two differ only in
    `do_not_specialize` (docs/design.md, "Runtime values"). Both list the `runtime` parameters; the [H, T] one
    also the LSE head strides (= T there). In [T, H] layout every LSE stride is specialised: the head stride is
    1 and the token stride H, fixed per model."""
    def jit(fn):
        return {"HT": triton.jit(fn, do_not_specialize=[*runtime, *lse_head_strides]),
                "TH": triton.jit(fn, do_not_specialize=list(runtime))}
    return jit
