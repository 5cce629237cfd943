"""The run mode and the device both frameworks share (layer 1 of `parity.harness.impls`)."""

from __future__ import annotations

import dataclasses
import os
import sys

def configure() -> bool:
    """Set the environment the kernels read at import; returns whether torch sees a CUDA GPU.

    Without CUDA, Triton kernels run in its interpreter and Pallas kernels in interpret mode;
    `XLA_PYTHON_CLIENT_PREALLOCATE=false` lets torch and JAX share a GPU.
    """
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if not has_cuda:
        if "triton_impl" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            raise RuntimeError("triton_impl was imported before TRITON_INTERPRET=1 was set: its kernels cannot "
                               "run on the CPU in this process")
        os.environ["TRITON_INTERPRET"] = "1"
    return has_cuda


@dataclasses.dataclass
class Runtime:
    """The device both frameworks use and the mode of the comparison."""

    device: str  # torch device: "cuda" or "cpu"
    mode: str  # "gpu-bitwise" or "cpu-interpreters"

    @property
    def on_gpu(self) -> bool:
        return self.device == "cuda"

    def sync(self) -> None:
        if self.on_gpu:
            import torch

            torch.cuda.synchronize()


# The reference needs no device: its adapter runs on the host whatever the machine.
HOST = Runtime("cpu", "reference")


def make_runtime() -> Runtime:
    has_cuda = configure()
    import jax

    device = "cuda" if has_cuda else "cpu"
    jax_backend = jax.default_backend()
    if has_cuda != (jax_backend == "gpu"):
        raise RuntimeError(f"torch uses {device!r} but JAX's default backend is {jax_backend!r}: "
                           "both frameworks must run on the same kind of device")
    return Runtime(device, "gpu-bitwise" if has_cuda else "cpu-interpreters")
