"""torch <-> JAX without copies, over the DLPack protocol built into both frameworks (docs/spec.md 6).

The parity harness uploads each input once (numpy -> torch) and hands the same device buffer to JAX, so
both implementations read identical bits and nothing is copied behind the caller's back. DLPack here is
the protocol (`__dlpack__`, `torch.from_dlpack`, `jax.dlpack.from_dlpack`), not the unrelated PyPI
package named `dlpack`.

Supported dtypes: int32, float32, float16, bfloat16, float8_e4m3fn (all zero-copy both ways); also
float8_e5m2, int16, int8, uint8 and bool, for pairs outside this project (`parity.library.crosscheck`).

What `torch_to_jax` refuses, and why (each one is something DLPack gets wrong *silently*):

- **int64** (`TypeError`). JAX without x64 imports it as a *copy* converted to int32: the JAX array
  no longer aliases the torch tensor. Keep offsets int32 (docs/spec.md 2) on both sides.
- **Other dtypes** (`TypeError`): float64 is copied to float32 the same way; the rest is not needed.
- **Non-contiguous strides** (`ValueError`). JAX rejects broadcast or gapped strides (a V-padded
  `[T, H, 192]` buffer sliced to `[..., :128]`) and imports a transposed view as a relaid-out array.
  Call `.contiguous()` explicitly (a visible copy), or pass the full padded buffer and slice in JAX.
- **A data pointer not 16-byte aligned** (`ValueError`), e.g. a view with an odd storage offset: on CPU
  JAX silently copies it, on GPU it imports and fails at first use. `.clone()` it.
- **A device JAX does not have** (`ValueError`). The JAX array lands on the device matching the tensor:
  a CPU tensor on JAX's CPU device, `cuda:i` on the JAX GPU whose local hardware id is `i`. A CUDA tensor
  when JAX has no GPU backend, or no GPU with that index, is refused rather than copied to the host.
- After the import the JAX buffer pointer is checked against the tensor's: any copy DLPack made anyway
  raises `RuntimeError`, so "zero-copy" is a guarantee, not a hope.

Ordering across frameworks: `torch_to_jax` synchronises the tensor's current CUDA stream before export
(a host sync: JAX then sees finished data whatever stream it uses); `jax_to_torch` calls
`block_until_ready()` first. Both directions alias memory: a torch write after the export shows through
the "immutable" JAX array, so order in-place kernels with these calls (or an explicit sync), and do not
write to a tensor that a live JAX array still reads.
"""

from __future__ import annotations

from typing import Any, Mapping

import ml_dtypes
import numpy as np

import functools
import importlib
import sys


class _Framework:
    """A framework module imported on first use: `import parity.library.bridge` (and the numpy comparisons that
    import it) needs neither torch nor jax installed."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        return getattr(importlib.import_module(self._name), attr)


torch = _Framework("torch")
jax = _Framework("jax")

ALIGNMENT = 16  # bytes; XLA requires it of imported buffers
_SUPPORTED = ("int32", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "int16", "int8", "uint8",
              "bool")


@functools.cache
def _tables() -> tuple:
    """(the torch dtypes shared zero-copy, numpy dtypes uploaded through a same-width unsigned view because
    `torch.from_numpy` cannot take them, torch dtypes read back through one)."""
    supported = tuple(getattr(torch, name) for name in _SUPPORTED)
    np_via_view = {
        np.dtype(ml_dtypes.bfloat16): (np.uint16, torch.bfloat16),
        np.dtype(ml_dtypes.float8_e4m3fn): (np.uint8, torch.float8_e4m3fn),
        np.dtype(ml_dtypes.float8_e5m2): (np.uint8, torch.float8_e5m2),
    }
    torch_via_view = {
        torch.bfloat16: (torch.int16, np.dtype(ml_dtypes.bfloat16)),
        torch.float8_e4m3fn: (torch.uint8, np.dtype(ml_dtypes.float8_e4m3fn)),
        torch.float8_e5m2: (torch.uint8, np.dtype(ml_dtypes.float8_e5m2)),
    }
    return supported, np_via_view, torch_via_view


def __getattr__(name):
    if name == "SUPPORTED_TORCH_DTYPES":
        return _tables()[0]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _is_jax_array(x: Any) -> bool:
    """A jax.Array (jax is not imported for the question: without it, nothing is one)."""
    return "jax" in sys.modules and isinstance(x, sys.modules["jax"].Array)


def _is_torch_tensor(x: Any) -> bool:
    return "torch" in sys.modules and isinstance(x, sys.modules["torch"].Tensor)


def jax_device_for(device: torch.device | str) -> jax.Device:
    """The JAX device that aliases memory of torch `device` (cpu -> JAX cpu, cuda:i -> JAX gpu i).

    Raises:
        ValueError: JAX has no such device (e.g. a CUDA tensor with a CPU-only jax).
    """
    device = torch.device(device)
    if device.type == "cpu":
        return jax.devices("cpu")[0]
    if device.type != "cuda":
        raise ValueError(f"unsupported torch device {device=}: only cpu and cuda can be shared with JAX")
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        gpus = jax.local_devices(backend="gpu")
    except RuntimeError as e:
        raise ValueError(
            f"tensor is on {device} but JAX has no GPU backend (jax.default_backend()="
            f"{jax.default_backend()!r}); install a CUDA jax or move the tensor to the CPU") from e
    for d in gpus:
        if getattr(d, "local_hardware_id", d.id) == index:
            return d
    raise ValueError(f"tensor is on {device} but JAX sees no GPU with that index: {gpus=}")


def data_ptr(x: Any) -> int:
    """Address of the first element of a torch tensor, JAX array (single device) or numpy array."""
    if _is_torch_tensor(x):
        return x.data_ptr()
    if _is_jax_array(x):
        return x.unsafe_buffer_pointer()
    if isinstance(x, np.ndarray):
        return x.ctypes.data
    raise TypeError(f"data_ptr needs a torch tensor, jax array or numpy array, got {type(x)=}")


def torch_to_jax(t: torch.Tensor) -> jax.Array:
    """Hands a torch tensor to JAX without a copy (the JAX array aliases `t`).

    Args:
        t: int32, float32, float16, bfloat16 or float8_e4m3fn tensor, contiguous, 16-byte aligned,
            on the CPU or a CUDA device that JAX also sees.

    Returns:
        A JAX array on the matching device sharing `t`'s memory.

    Raises:
        TypeError: `t` is not a tensor or has an unsupported dtype (int64 in particular).
        ValueError: non-contiguous strides, a misaligned data pointer, or a device JAX lacks.
        RuntimeError: DLPack copied the buffer anyway (pointer check after import).
    """
    if not _is_torch_tensor(t):
        raise TypeError(f"torch_to_jax needs a torch.Tensor, got {type(t)=}")
    if t.dtype == torch.int64:
        raise TypeError(
            f"{t.dtype=}: JAX (x64 disabled) would silently copy an int64 tensor to int32, breaking the "
            "alias; keep offsets int32 (docs/spec.md 2) and convert on the torch side if you must")
    if t.dtype not in _tables()[0]:
        raise TypeError(f"{t.dtype=} is not shared zero-copy; supported: {_tables()[0]}")
    if not t.is_contiguous():
        raise ValueError(
            f"non-contiguous tensor ({t.shape=}, {t.stride()=}): DLPack rejects or relays out such strides. "
            "Call .contiguous() explicitly (a copy), or share the full padded buffer and slice it in JAX")
    if t.numel() > 0 and t.data_ptr() % ALIGNMENT:
        raise ValueError(
            f"data pointer 0x{t.data_ptr():x} is not {ALIGNMENT}-byte aligned ({t.storage_offset()=}, "
            f"{t.dtype=}): JAX would copy it on CPU and fail at first use on GPU; .clone() it first")
    target = jax_device_for(t.device)
    if t.device.type == "cuda":
        # Ordering: JAX must see the data the torch stream is still writing.
        torch.cuda.current_stream(t.device).synchronize()
    a = jax.dlpack.from_dlpack(t)
    if a.devices() != {target}:
        raise RuntimeError(f"DLPack import landed on {a.devices()}, expected {target} for {t.device}")
    if t.numel() > 0 and a.unsafe_buffer_pointer() != t.data_ptr():
        raise RuntimeError(
            f"DLPack import copied the buffer ({t.dtype=}, {t.shape=}): jax 0x{a.unsafe_buffer_pointer():x} "
            f"vs torch 0x{t.data_ptr():x}")
    return a


def jax_to_torch(a: jax.Array) -> torch.Tensor:
    """Hands a (single-device, materialised) JAX array to torch without a copy.

    Blocks until `a` is computed first, so torch kernels on any stream read finished data.

    Raises:
        TypeError: `a` is not a JAX array or has an unsupported dtype.
        ValueError: `a` spans several devices.
        RuntimeError: torch got a copy rather than an alias.
    """
    if not _is_jax_array(a):
        raise TypeError(f"jax_to_torch needs a jax.Array, got {type(a)=}")
    if len(a.devices()) != 1:
        raise ValueError(f"only single-device arrays can be shared, got {a.devices()=}")
    a.block_until_ready()
    t = torch.from_dlpack(a)
    if t.dtype not in _tables()[0]:
        raise TypeError(f"{a.dtype=} is not shared zero-copy; supported: {_tables()[0]}")
    if t.numel() > 0 and t.data_ptr() != a.unsafe_buffer_pointer():
        raise RuntimeError(f"DLPack export copied the buffer ({a.dtype=}, {a.shape=})")
    return t


def to_torch(x: np.ndarray, device: torch.device | str = "cpu") -> torch.Tensor:
    """Uploads a numpy array to a new, contiguous torch tensor on `device` (always a copy).

    Handles ml_dtypes bfloat16 / float8_e4m3fn, which `torch.from_numpy` cannot take, by viewing them as
    same-width unsigned integers and reinterpreting on the torch side: bits are preserved exactly (NaN
    payloads included). The copy never aliases `x`, so kernels writing in place cannot change the
    caller's reference inputs, and the fresh allocation is aligned for `torch_to_jax`.
    """
    x = np.ascontiguousarray(np.asarray(x))
    via = _tables()[1].get(x.dtype)
    if via is not None:
        t = torch.from_numpy(x.view(via[0])).view(via[1])
    else:
        t = torch.from_numpy(x)
    device = torch.device(device)
    return t.clone() if device.type == "cpu" else t.to(device)


def to_numpy(x: Any) -> np.ndarray:
    """torch tensor or JAX array -> numpy (ml_dtypes for bf16/fp8), bits preserved. Copies to host:
    meant for small tensors and host reports."""
    if isinstance(x, np.ndarray):
        return x
    if _is_jax_array(x):
        return np.asarray(jax.device_get(x))
    if _is_torch_tensor(x):
        t = x.detach().cpu()
        via = _tables()[2].get(t.dtype)
        if via is not None:
            return t.contiguous().view(via[0]).numpy().view(via[1])
        return t.numpy()
    raise TypeError(f"to_numpy needs a torch tensor, jax array or numpy array, got {type(x)=}")


def share_inputs(inputs: Mapping[str, np.ndarray], device: torch.device | str = "cpu"
                 ) -> tuple[dict[str, torch.Tensor], dict[str, jax.Array]]:
    """Uploads each numpy input once to torch and hands the same buffer to JAX.

    Padded-V buffers (cases with `head_pad`) are shared whole: slicing to `head_dim` is the caller's job
    (torch: `x[..., :D]`, a strided view; JAX: `x[..., :D]`, a slice). `None` values are passed through.

    Returns:
        (torch_inputs, jax_inputs) with the same keys; each pair aliases one buffer on `device`.
    """
    torch_inputs: dict[str, torch.Tensor] = {}
    jax_inputs: dict[str, jax.Array] = {}
    for key, value in inputs.items():
        if value is None:
            torch_inputs[key] = jax_inputs[key] = None
            continue
        t = to_torch(value, device)
        torch_inputs[key] = t
        jax_inputs[key] = torch_to_jax(t)
    return torch_inputs, jax_inputs


__all__ = ["ALIGNMENT", "SUPPORTED_TORCH_DTYPES", "data_ptr", "jax_device_for", "jax_to_torch",
           "share_inputs", "to_numpy", "to_torch", "torch_to_jax"]
