"""The arguments of `cross_check`: the inputs shared with both frameworks (`share`), the outputs named, and every
option checked and normalised. A bad argument raises `TypeError` or `ValueError` naming the argument and what
it takes."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np


def _default_device(inputs: Sequence[Any]):
    import torch

    from parity.library import bridge

    for x in inputs:
        if isinstance(x, torch.Tensor):
            return x.device
        if bridge._is_jax_array(x):
            return bridge.jax_to_torch(x).device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def share(inputs: Mapping[str, Any] | Sequence[Any], device=None, *, host: bool = True):
    """(keys, torch args, jax args, numpy args, how) of `inputs`, a dict or a sequence of arrays and values.

    Arrays: numpy arrays are uploaded once to torch on `device` (a copy); torch tensors are used as they are
    when contiguous, 16-byte aligned and on `device` (else copied there); JAX arrays are handed to torch.
    JAX then gets the torch buffer (`parity.library.bridge.torch_to_jax`, zero-copy, checked by pointer), and the
    reference a host copy taken before anything runs (with `host`; else the numpy args are empty). Anything
    else (eps, a flag) is passed to all three as it is. int64 and float64 arrays are refused (JAX without
    x64 would copy them, `parity.library.bridge`).
    """
    import torch

    from parity.library import bridge

    keys = list(inputs) if isinstance(inputs, Mapping) else list(range(len(inputs)))
    values = [inputs[k] for k in keys]
    try:
        device = torch.device(device) if device is not None else _default_device(values)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device={device!r}: expected a torch device ('cpu', 'cuda', 'cuda:1' or a torch.device): "
                         f"{e}") from None
    t_args, j_args, n_args, how = {}, {}, {}, {}
    for k, x in zip(keys, values):
        try:
            if isinstance(x, np.ndarray):
                t, how[str(k)] = bridge.to_torch(x, device), "copied"
            elif isinstance(x, torch.Tensor) or bridge._is_jax_array(x):
                t = x if isinstance(x, torch.Tensor) else bridge.jax_to_torch(x)
                aligned = t.numel() == 0 or t.data_ptr() % bridge.ALIGNMENT == 0
                if t.is_contiguous() and aligned and t.device == device:
                    how[str(k)] = "shared"
                else:
                    t, how[str(k)] = t.to(device).contiguous().clone(), "copied"
            else:
                t_args[k] = j_args[k] = n_args[k] = x
                how[str(k)] = "value"
                continue
            if t.dtype in (torch.int64, torch.float64):
                raise TypeError(f"{t.dtype} is not shared (JAX without x64 copies it to 32 bits); pass "
                                f"{'int32' if t.dtype == torch.int64 else 'float32'}")
            t_args[k], j_args[k] = t, bridge.torch_to_jax(t)
            if host:
                n_args[k] = np.array(bridge.to_numpy(t))
        except (TypeError, ValueError) as e:
            raise type(e)(f"input {k!r}: {e}") from e
    return keys, t_args, j_args, n_args, how


def call(fn: Callable, keys: list, args: dict):
    if keys and isinstance(keys[0], str):
        return fn(**args)
    return fn(*(args[k] for k in keys))


def named(result: Any, names: list[str] | None, side: str) -> dict[str, Any]:
    """A function's result (one array, a sequence or a dict) as output name -> array."""
    if isinstance(result, Mapping):
        got = dict(result)
        if names is not None:
            missing = [n for n in names if n not in got]
            if missing:
                raise ValueError(f"{side} returned outputs {sorted(got)}, missing {missing}")
            got = {n: got[n] for n in names}
        return got
    if isinstance(result, (tuple, list)):
        names = names or [f"out{i}" for i in range(len(result))]
        if len(names) != len(result):
            raise ValueError(f"{side} returned {len(result)} outputs, `outputs` names {len(names)}: {names}")
        return dict(zip(names, result))
    return {(names or ["out"])[0]: result}


def block(outputs: dict[str, Any]) -> None:
    for v in outputs.values():
        if hasattr(v, "block_until_ready"):
            v.block_until_ready()


def check_callable(fn: Any, what: str, optional: bool = False) -> None:
    if fn is None and optional:
        return
    if not callable(fn):
        raise TypeError(f"{what} must be callable{' or None' if optional else ''}, got {type(fn).__name__}: {fn!r}")


def check_inputs(inputs: Any) -> None:
    if isinstance(inputs, (str, bytes)) or not isinstance(inputs, (Mapping, Sequence)):
        raise TypeError("inputs must be a dict name -> array or value (passed as keywords) or a sequence of them "
                        f"(passed by position), got {type(inputs).__name__}")


def check_flag(value: Any, what: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{what} must be True or False, got {value!r}")
    return bool(value)


_AXES_HELP = "a tuple of axis names, a string 'token,dim', or None"


def output_spec(outputs: Any) -> tuple[list[str] | None, dict[str, Any]]:
    """(names or None, name -> axes) of `outputs`: a dict name -> axes, or a sequence of names."""
    if outputs is None:
        return None, {}
    if isinstance(outputs, Mapping):
        for k, v in outputs.items():
            if not isinstance(k, str):
                raise TypeError(f"outputs: names must be strings, got {k!r}")
            if v is not None and not isinstance(v, str) and not (
                    isinstance(v, Sequence) and all(isinstance(a, str) for a in v)):
                raise TypeError(f"outputs[{k!r}]: axes must be {_AXES_HELP}, got {v!r}")
        return list(outputs), dict(outputs)
    if isinstance(outputs, str):
        raise TypeError(f"outputs must be a dict name -> axes or a sequence of names, got the string {outputs!r} "
                        "(one output: ['name'] or {'name': axes})")
    if isinstance(outputs, Sequence) and all(isinstance(n, str) for n in outputs):
        if len(set(outputs)) != len(outputs):
            raise ValueError(f"outputs: names repeat: {list(outputs)}")
        return list(outputs), {}
    raise TypeError(f"outputs must be a dict name -> axes or a sequence of names, got {outputs!r}")


def axes_of(v) -> tuple[str, ...] | str:
    """An output's axis names ("token,dim" or a tuple), or "flat" (mismatches named by index) for None."""
    if v is None:
        return "flat"
    return tuple(a.strip() for a in v.split(",")) if isinstance(v, str) else tuple(v)


def check_axes(axes: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> None:
    for k, a in axes.items():
        if a != "flat" and len(a) != len(shapes[k]):
            raise ValueError(f"outputs[{k!r}]: {len(a)} axis names {a} for an output of shape {shapes[k]}")


def _is_name(x: Any) -> bool:
    return isinstance(x, (str, int)) and not isinstance(x, (bool, np.bool_))


def ragged_offsets(ragged: Any, t_args: Mapping[Any, Any]) -> tuple[np.ndarray | None, str]:
    """(offsets, axis) of `ragged`: None; an input name (or position); an array of offsets (numpy, torch, JAX or
    a list of ints); or (one of those, axis name). The axis defaults to "token". A host copy."""
    from parity.library import bridge

    help_ = ("an input name, an array of offsets [0, end_0, ..., end_R-1], or (name or array, axis name), "
             "e.g. ragged='query_start_loc' or ragged=(cu_seqlens, 'seq')")
    if ragged is None:
        return None, "token"
    axis = "token"
    if isinstance(ragged, tuple) and len(ragged) == 2 and isinstance(ragged[1], str):
        ragged, axis = ragged
        if not axis:
            raise ValueError(f"ragged: the axis name is empty; {help_}")
    if _is_name(ragged):
        if ragged not in t_args:
            raise ValueError(f"ragged={ragged!r}: no input named {ragged!r} (inputs: {list(t_args)}); {help_}")
        ragged = t_args[ragged]
    try:
        if isinstance(ragged, (list, tuple)):
            offsets = np.array(ragged)
        else:
            offsets = np.array(bridge.to_numpy(ragged))
    except (TypeError, ValueError) as e:
        raise TypeError(f"ragged: expected {help_}; got {type(ragged).__name__} ({e})") from None
    if offsets.ndim != 1 or offsets.size < 1 or offsets.dtype.kind not in "iu":
        raise TypeError(f"ragged: offsets must be a 1-D integer array with at least one entry, got "
                        f"{offsets.dtype} {offsets.shape}; {help_}")
    if np.any(np.diff(offsets.astype(np.int64)) < 0) or offsets[0] < 0:
        raise ValueError(f"ragged: offsets must start >= 0 and not decrease, got {offsets.tolist()[:16]}")
    return offsets, str(axis)


def tolerances(tolerance: Any, names: list[str]) -> dict[str, Any]:
    """output -> `Tolerance` or None (the computed default) from `tolerance`: None, a `Tolerance`, (rtol, atol),
    a `TOLERANCES` key, or a dict output -> one of those."""
    from parity.library.tolerances import TOLERANCES, Tolerance

    def one(t, where):
        if t is None or isinstance(t, Tolerance):
            return t
        if isinstance(t, str):
            if t not in TOLERANCES:
                raise ValueError(f"{where}: unknown key {t!r}; keys of parity.TOLERANCES: {sorted(TOLERANCES)}")
            return TOLERANCES[t]
        if isinstance(t, Sequence) and len(t) == 2 and all(isinstance(x, (int, float)) for x in t):
            rtol, atol = float(t[0]), float(t[1])
            if not (rtol >= 0 and atol >= 0):
                raise ValueError(f"{where}: rtol and atol must be >= 0, got {t!r}")
            return Tolerance(rtol=rtol, atol=atol)
        raise TypeError(f"{where}: expected None, a parity.Tolerance, (rtol, atol), a parity.TOLERANCES key or a "
                        f"dict output -> one of those; got {t!r}")

    if isinstance(tolerance, Mapping):
        unknown = [k for k in tolerance if k not in names]
        if unknown:
            raise ValueError(f"tolerance: no outputs named {unknown} (outputs: {names})")
        return {n: one(tolerance.get(n), f"tolerance[{n!r}]") for n in names}
    t = one(tolerance, "tolerance")
    return dict.fromkeys(names, t)


def special_count(special_values: Any) -> int:
    """Elements of each special value planted per float input: 0 (off), 1 for True, or the number given."""
    if isinstance(special_values, (bool, np.bool_)):
        return int(special_values)
    if isinstance(special_values, int) and special_values >= 0:
        return special_values
    raise TypeError(f"special_values must be True, False or a count >= 0 per value, got {special_values!r}")


__all__ = ["axes_of", "check_axes", "check_callable", "check_flag", "check_inputs", "output_spec",
           "ragged_offsets", "share", "special_count", "tolerances"]
