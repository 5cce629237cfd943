"""Loading what a command line names: a callable (`MODULE:FUNCTION` or `PATH.py:FUNCTION`), the inputs of
`python -m parity cross` (a .npz) and its `--outputs` spec."""

from __future__ import annotations

import os
from typing import Any

import numpy as np


class LoadError(ValueError):
    """A callable, file or spec named on the command line that cannot be used."""


def load_callable(spec: str, flag: str = "--impl"):
    """`module:function` (importable) or `path/to/file.py:function`: a port's entry point. Errors name `flag`,
    the command-line option that gave `spec`."""
    import importlib
    import importlib.util

    target, _, name = spec.rpartition(":")
    if not target or not name:
        raise LoadError(f"{flag} {spec!r}: expected MODULE:FUNCTION or PATH.py:FUNCTION")
    if target.endswith(".py"):
        if not os.path.exists(target):
            raise LoadError(f"{flag} {spec!r}: no file {target}")
        mod_spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(target))[0], target)
        module = importlib.util.module_from_spec(mod_spec)
        try:
            mod_spec.loader.exec_module(module)
        except Exception as e:  # the file's own error, named by the flag that loaded it
            raise LoadError(f"{flag} {spec!r}: importing {target} raised {type(e).__name__}: {e}") from e
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise LoadError(f"{flag} {spec!r}: cannot import {target}: {e}") from e
    fn = getattr(module, name, None)
    if not callable(fn):
        raise LoadError(f"{flag} {spec!r}: {target} has no callable {name!r}")
    return fn


def load_inputs(path: str, flag: str = "--inputs") -> dict[str, Any]:
    """The inputs of `python -m parity cross` from a .npz: a 0-d array becomes a Python number, and an array
    stored as NAME:DTYPE (bfloat16, float8_e4m3fn, float8_e5m2) holds that dtype's bits as unsigned integers.
    A missing, truncated or foreign file raises `LoadError` naming `flag` and the file."""
    import zipfile

    import ml_dtypes

    out: dict[str, Any] = {}
    try:
        with np.load(path, allow_pickle=False) as f:
            if not hasattr(f, "files"):
                raise LoadError(f"{flag} {path}: a single .npy array, expected a .npz of named inputs")
            for key in f.files:
                a = f[key]
                name, _, dtype = key.partition(":")
                if dtype:
                    if dtype not in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
                        raise LoadError(f"{flag} {path}: {key!r}: unknown dtype {dtype!r} (bfloat16, float8_e4m3fn, "
                                        "float8_e5m2)")
                    want = np.dtype(getattr(ml_dtypes, dtype))
                    if a.dtype.itemsize != want.itemsize or a.dtype.kind not in "ui":
                        raise LoadError(f"{flag} {path}: {key!r} must hold {dtype} bits as {want.itemsize}-byte "
                                        f"unsigned integers, got {a.dtype}")
                    a = a.view(want)
                out[name] = a.item() if a.ndim == 0 else a
    except LoadError:
        raise
    except FileNotFoundError:
        raise LoadError(f"{flag} {path}: no such file") from None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise LoadError(f"{flag} {path}: not a readable .npz ({type(e).__name__}: {e})") from None
    return out


def parse_outputs(spec: str | None) -> dict[str, tuple[str, ...] | None] | None:
    """'out=token,dim;rstd=token' -> {"out": ("token", "dim"), "rstd": ("token",)}; a bare name has no axes."""
    if not spec:
        return None
    outputs: dict[str, tuple[str, ...] | None] = {}
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        name, _, axes = part.partition("=")
        if not name.strip():
            raise LoadError(f"--outputs {spec!r}: an entry without a name ({part!r}); expected 'out=token,dim;rstd'")
        outputs[name.strip()] = tuple(a.strip() for a in axes.split(",")) if axes else None
    return outputs


__all__ = ["LoadError", "load_callable", "load_inputs", "parse_outputs"]
