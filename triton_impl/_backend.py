"""How the Triton kernels compile and run: interpreter or GPU, torch.compile tracing, the parity launch options
(docs/spec.md 5) and the per-layout jit of each kernel (docs/design.md, "Runtime values")."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import triton

# Launch options that make the float math reproducible by the Pallas port (docs/spec.md 5).
PARITY_LAUNCH = dict(enable_fp_fusion=False, enable_reflect_ftz=False)


def tracing() -> bool:
    """True while torch.compile traces (data pointers are unknown; the launch-plan cache is bypassed)."""
    return torch.compiler.is_compiling()


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
