"""Parity harness: the float64 reference, the DLPack bridge, bitwise comparison, and `cross_check` for any
PyTorch <-> JAX kernel pair (docs/parity-library.md).

The public names are imported on first use, so `import parity` (and `python -m parity`, which sets the run
mode before torch, triton or jax start) imports nothing heavy.
"""

_EXPORTS = {"cross_check": "crosscheck", "assert_cross_check": "crosscheck", "Report": "crosscheck",
            "Tolerance": "compare", "TOLERANCES": "compare"}  # parity.library.<module>
__all__ = sorted(_EXPORTS) + ["recipe"]


def __getattr__(name):
    import importlib

    if name == "recipe":
        return importlib.import_module("parity.library.recipe")
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"parity.library.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'parity' has no attribute {name!r}")
