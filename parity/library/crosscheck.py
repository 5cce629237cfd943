"""Parity testing for any PyTorch <-> JAX kernel pair (docs/parity-library.md).

`cross_check(torch_fn, jax_fn, inputs)` shares the inputs with both frameworks (`parity.library.bridge`: one buffer,
zero-copy through DLPack), runs both, and compares every output pair bit for bit and, given a float64
`reference`, each side within tolerance (`parity.library.compare`). Mismatches are named by the caller's axes and,
through ragged offsets (query_start_loc-style), by request. The result is a `Report`.

`compare_results` is the comparison engine: implementations pairwise bit for bit, and each one against a
reference, bit for bit or within tolerance. `cross_check` and `python -m parity check` (`parity.harness.check`) both
call it; there is no second copy of the comparisons.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

SCHEMA = "parity-cross/1"
KIND_PAIR = "torch_vs_jax"


def jsonable(x):
    """A copy of `x` that strict JSON accepts: numpy scalars as numbers, non-finite floats as strings."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return jsonable(x.tolist())
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return x


# ---------------------------------------------------------------------------------------------------------
# The comparison engine


@dataclasses.dataclass(frozen=True)
class Locating:
    """How mismatches are named: ragged offsets (i32[R+1], query_start_loc-style), the axis they index, and a
    context string (e.g. "case=x seed=0 mode=compiled")."""

    offsets: Any = None
    ragged_axis: str = "token"
    context: str = ""


def compare_results(results: Mapping[str, Mapping[str, Any]], keys: Sequence[str], *,
                    pairs: Sequence[tuple[str, str]], reference: Mapping[str, Any] | None = None,
                    reference_bitwise: bool = False, against: Sequence[str] = (), locating: Locating = Locating(),
                    axes: Mapping[str, Any] | None = None, tolerance: Mapping[str, Any] | None = None,
                    exact: Mapping[str, Any] | None = None, mag: Mapping[str, Any] | None = None,
                    prefix: str = "") -> list[tuple[str, Any]]:
    """Compares the outputs `keys` of several implementations.

    Args:
        results: implementation -> output key -> array (torch, JAX or numpy).
        pairs: (a, b) implementations compared bit for bit, kind "a_vs_b" (`parity.library.compare.compare_bits`).
        reference: output key -> the expected array: float64 (compared within tolerance,
            `compare_to_reference`) or, with `reference_bitwise`, in the native dtype (compared bit for bit).
        against: the implementations compared with `reference`, kind "impl_vs_reference".
        axes: output key -> a layout of `parity.library.compare` ("THD", "HT", ...) or a tuple of axis names.
        tolerance, exact, mag: output key -> `compare_to_reference`'s tol, exact and mag (defaults: the
            output dtype's `TOLERANCES` entry, nothing exact, |reference|).
        prefix: put before each key in the report names (e.g. "merge.").

    Returns:
        (kind, `parity.library.compare.Report`) per comparison, pairs first, for each key in order.
    """
    from parity.library import compare

    axes, tolerance, exact, mag = axes or {}, tolerance or {}, exact or {}, mag or {}
    loc = dict(query_start_loc=locating.offsets, ragged_axis=locating.ragged_axis, context=locating.context)
    out: list[tuple[str, Any]] = []
    for key in keys:
        name, layout = prefix + key, axes.get(key)
        for a, b in pairs:
            out.append((f"{a}_vs_{b}", compare.compare_bits(results[a][key], results[b][key], name=name,
                                                             layout=layout, **loc)))
        if reference is None:
            continue
        for impl in against:
            got = results[impl][key]
            if reference_bitwise:
                rep = compare.compare_bits(got, reference[key], name=name, layout=layout, **loc)
            else:
                tol = tolerance.get(key)
                if tol is None:
                    tol = compare.tolerance_for(compare._as_torch(got).dtype)
                rep = compare.compare_to_reference(got, reference[key], name=name, layout=layout, tol=tol,
                                                   exact=exact.get(key, False), mag=mag.get(key), **loc)
            out.append((f"{impl}_vs_reference", rep))
    return out


# ---------------------------------------------------------------------------------------------------------
# The report


@dataclasses.dataclass
class Report:
    """The result of `cross_check`: per output, per comparison kind, a `parity.library.compare.Report`.

    Kinds: "torch_vs_jax" (bit for bit), "torch_vs_reference" and "jax_vs_reference" (with a reference).
    `ok` iff every required comparison passes; "torch_vs_jax" is required with `bitwise=True`, and reported
    either way.
    """

    name: str
    device: str
    outputs: dict[str, dict[str, Any]]  # output -> kind -> parity.library.compare.Report
    required: tuple[str, ...]
    axes: dict[str, Any] = dataclasses.field(default_factory=dict)
    inputs: dict[str, str] = dataclasses.field(default_factory=dict)  # input -> "shared" / "copied" / "value"

    @property
    def ok(self) -> bool:
        return all(r.ok for kinds in self.outputs.values() for k, r in kinds.items() if k in self.required)

    def __getitem__(self, output: str) -> dict[str, Any]:
        return self.outputs[output]

    def n_diff(self, output: str, kind: str = KIND_PAIR) -> int:
        """Elements that differ (bit comparisons) or fail (reference comparisons)."""
        return int(self.outputs[output][kind].n_diff)

    def max_ulp(self, output: str, kind: str = KIND_PAIR) -> int | None:
        return self.outputs[output][kind].max_ulp

    def ulp_hist(self, output: str, kind: str = KIND_PAIR) -> dict[str, int]:
        return dict(self.outputs[output][kind].ulp_hist)

    def mismatches(self, output: str, kind: str = KIND_PAIR) -> list[str]:
        """Located examples ("req 3 token 17 dim 5: got 0x... want 0x... ulp=1"), at most `MAX_SHOWN` + worst."""
        return list(self.outputs[output][kind].first_mismatches)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA, "name": self.name, "device": self.device, "ok": self.ok,
            "required": list(self.required), "inputs": dict(self.inputs),
            "outputs": {out: {"axes": None if self.axes.get(out) is None else list(self.axes[out]),
                              "comparisons": {k: r.to_dict() for k, r in kinds.items()}}
                        for out, kinds in self.outputs.items()},
        }

    def to_json(self, path: str | None = None, **kw) -> str:
        """The JSON text (strict: non-finite numbers as strings); also written to `path` when given."""
        text = json.dumps(jsonable(self.to_dict()), indent=kw.pop("indent", 1), **kw)
        if path is not None:
            with open(path, "w") as f:
                f.write(text + "\n")
        return text

    def table(self) -> str:
        kinds = [k for k in (KIND_PAIR, "torch_vs_reference", "jax_vs_reference")
                 if any(k in v for v in self.outputs.values())]
        head = ("output", "dtype", "shape", *(k.replace("_vs_", "-vs-") for k in kinds))
        rows = [head]
        for out, reps in self.outputs.items():
            any_rep = next(iter(reps.values()))
            cells = []
            for k in kinds:
                r = reps.get(k)
                if r is None:
                    cells.append("-")
                    continue
                ulp = "-" if r.max_ulp is None else str(r.max_ulp)
                status = "ok" if r.ok else ("FAIL" if k in self.required else "differs*")
                if r.kind == "bitwise":
                    cells.append(f"{status} ({r.n_diff:,} differ, max {ulp} ulp)")
                else:
                    ratio = "-" if r.max_err_ratio is None else f"{r.max_err_ratio:.2f}"
                    cells.append(f"{status} ({r.n_diff:,} fail, err/tol {ratio})")
            rows.append((out, any_rep.dtype, "x".join(map(str, any_rep.shape)) or "()", *cells))
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def format(self) -> str:
        """The table, then each failing required comparison in full (located mismatches, ULP histogram), then
        one line per comparison that differs without being required."""
        req = "bit parity required" if KIND_PAIR in self.required else "bit parity reported, not required"
        lines = [f"cross_check {self.name or '(unnamed)'} on {self.device} ({req}): "
                 f"{'ok' if self.ok else 'FAIL'}", self.table()]
        extra = []
        for out, reps in self.outputs.items():
            for k, r in reps.items():
                if r.ok:
                    continue
                if k in self.required:
                    lines.append(f"{out} {k}:")
                    lines.append("  " + r.format().replace("\n", "\n  "))
                else:
                    hist = ", ".join(f"{b}: {v:,}" for b, v in r.ulp_hist.items() if v)
                    worst = [m for m in r.first_mismatches if m.startswith("worst: ")] or r.first_mismatches[:1]
                    extra.append(f"* {out} {k}, not required: ulp histogram {hist}"
                                 + (f"; {worst[0] if worst[0].startswith('worst') else 'first: ' + worst[0]}"
                                    if worst else ""))
        return "\n".join(lines + extra)

    def __str__(self) -> str:
        return self.format()


# ---------------------------------------------------------------------------------------------------------
# Inputs and outputs


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
    device = torch.device(device) if device is not None else _default_device(values)
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


def _call(fn: Callable, keys: list, args: dict):
    if keys and isinstance(keys[0], str):
        return fn(**args)
    return fn(*(args[k] for k in keys))


def _named(result: Any, names: list[str] | None, side: str) -> dict[str, Any]:
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


def _ragged(ragged, t_args: dict) -> tuple[Any, str]:
    """(offsets, axis) of `ragged`: an input name, (input name or array, axis), or None. A host copy."""
    from parity.library import bridge

    if ragged is None:
        return None, "token"
    name, axis = (ragged, "token") if isinstance(ragged, (str, int)) else tuple(ragged)
    if isinstance(name, (str, int)) and not isinstance(name, bool):
        if name not in t_args:
            raise ValueError(f"ragged={ragged!r}: no input named {name!r} (inputs: {list(t_args)})")
        name = t_args[name]
    offsets = np.array(bridge.to_numpy(name) if not isinstance(name, (list, tuple)) else name)
    if offsets.ndim != 1 or offsets.dtype.kind not in "iu":
        raise TypeError(f"ragged offsets must be a 1-D integer array, got {offsets.dtype} {offsets.shape}")
    return offsets, str(axis)


def _tolerances(tolerance, names: list[str]) -> dict[str, Any]:
    from parity.library import compare

    def one(t):
        if t is None or isinstance(t, compare.Tolerance):
            return t
        if isinstance(t, str):
            return compare.TOLERANCES[t]
        rtol, atol = t
        return compare.Tolerance(rtol=float(rtol), atol=float(atol))

    if isinstance(tolerance, Mapping):
        return {n: one(tolerance.get(n)) for n in names}
    return {n: one(tolerance) for n in names}


def _axes(v) -> tuple[str, ...] | str:
    """An output's axis names ("token,dim" or a tuple), or "flat" (mismatches named by index) for None."""
    if v is None:
        return "flat"
    return tuple(a.strip() for a in v.split(",")) if isinstance(v, str) else tuple(v)


def _block(outputs: dict[str, Any]) -> None:
    for v in outputs.values():
        if hasattr(v, "block_until_ready"):
            v.block_until_ready()


# ---------------------------------------------------------------------------------------------------------
# The API


def cross_check(torch_fn: Callable, jax_fn: Callable, inputs: Mapping[str, Any] | Sequence[Any], *,
                reference: Callable | None = None, outputs: Mapping[str, Any] | Sequence[str] | None = None,
                ragged: Any = None, bitwise: bool = True, tolerance: Any = None, name: str = "",
                device=None) -> Report:
    """Runs a PyTorch and a JAX implementation on the same inputs and compares their outputs.

    Args:
        torch_fn, jax_fn: called with the shared inputs (keywords for a dict, positions for a sequence);
            each returns one array, a sequence or a dict of arrays (float dtypes: fp32, fp16, bf16, fp8).
            jax_fn runs first (and is waited for), then torch_fn: a torch kernel writing its inputs in place
            cannot change what JAX read.
        inputs: dict or sequence of numpy arrays, torch tensors, JAX arrays (any float dtype incl. bf16 and
            fp8, or int32/int16/int8/uint8/bool) and plain values (`share`).
        reference: optional; called like the others with numpy copies of the inputs, returns the outputs in
            float64 (numpy), each compared with both sides within `tolerance`.
        outputs: output name -> axis names (e.g. {"out": ("token", "head", "dim")} or "token,head,dim";
            None: mismatches named by index), or a sequence of names. Names the outputs of sequence results,
            and picks and orders dict results.
        ragged: offsets that name the request of a mismatch: an input name (indexing axis "token"), or
            (input name or array, axis name).
        bitwise: require torch and JAX to agree bit for bit (else the differing bits are reported only).
        tolerance: for the reference comparisons: a `parity.library.compare.Tolerance`, (rtol, atol), a
            `TOLERANCES` key, or a dict output -> one of those; None: the output dtype's `TOLERANCES` entry.
        name: shown in the report.
        device: torch device for numpy inputs (default: the first tensor's, else cuda when available).

    Returns:
        A `Report`.
    """
    keys, t_args, j_args, n_args, how = share(inputs, device, host=reference is not None)
    names = None if outputs is None else list(outputs)
    axes = dict(outputs) if isinstance(outputs, Mapping) else {}
    offsets, ragged_axis = _ragged(ragged, t_args)
    ref = None
    if reference is not None:
        ref = {k: np.asarray(v) for k, v in _named(_call(reference, keys, n_args), names, "reference").items()}
    jax_out = _named(_call(jax_fn, keys, j_args), names, "jax_fn")
    _block(jax_out)
    torch_out = _named(_call(torch_fn, keys, t_args), names, "torch_fn")
    if set(torch_out) != set(jax_out):
        raise ValueError(f"torch_fn returned outputs {sorted(torch_out)}, jax_fn {sorted(jax_out)}")
    if ref is not None and set(ref) != set(torch_out):
        raise ValueError(f"reference returned outputs {sorted(ref)}, torch_fn {sorted(torch_out)}")
    dev = next((t.device for t in t_args.values() if hasattr(t, "device")), None)
    if dev is not None and dev.type == "cuda":
        import torch

        torch.cuda.synchronize(dev)
    order = list(torch_out)
    against = ("torch", "jax") if ref is not None else ()
    pairs = compare_results({"torch": torch_out, "jax": jax_out}, order, pairs=[("torch", "jax")], reference=ref,
                            against=against, locating=Locating(offsets, ragged_axis),
                            axes={k: _axes(axes.get(k)) for k in order},
                            tolerance=_tolerances(tolerance, order))
    by_output: dict[str, dict[str, Any]] = {k: {} for k in order}
    for kind, rep in pairs:
        by_output[rep.name][kind] = rep
    required = ((KIND_PAIR,) if bitwise else ()) + tuple(f"{a}_vs_reference" for a in against)
    return Report(name=name, device=str(dev or "cpu"), outputs=by_output, required=required,
                  axes={k: axes.get(k) for k in order}, inputs=how)


def assert_cross_check(*args, **kwargs) -> Report:
    """`cross_check` for tests: raises AssertionError whose message is the report (pytest prints it)."""
    report = cross_check(*args, **kwargs)
    if not report.ok:
        raise AssertionError("\n" + report.format())
    return report



__all__ = ["Locating", "Report", "assert_cross_check", "compare_results", "cross_check", "jsonable", "share"]
