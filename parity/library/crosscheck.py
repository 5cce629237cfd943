"""Parity testing for any PyTorch <-> JAX kernel pair (docs/parity-library.md).

`cross_check(torch_fn, jax_fn, inputs)` shares the inputs with both frameworks (`parity.library.bridge`: one buffer,
zero-copy through DLPack), runs both, and compares every output pair bit for bit and, given a float64
`reference`, each side with it (`parity.library.compare`) within a bound derived from the reference itself
(`parity.library.errormodel`) unless a `tolerance` is given. Mismatches are named by the caller's axes and,
through ragged offsets (query_start_loc-style), by request. On request, the pair runs again on inputs with
special values planted (`parity.library.special`). The result is a `Report` (`parity.library.crossreport`).

The comparison engine `compare_results` (`parity.library.engine`) is shared with `python -m parity check`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from parity.library import arguments as args_
from parity.library import bridge
from parity.library.arguments import share
from parity.library.crossreport import KIND_PAIR, KIND_SPECIAL, SCHEMA, Report, jsonable
from parity.library.engine import Locating, compare_results


def _run_pair(torch_fn, jax_fn, keys, t_args, j_args, names):
    jax_out = args_.named(args_.call(jax_fn, keys, j_args), names, "jax_fn")
    args_.block(jax_out)
    torch_out = args_.named(args_.call(torch_fn, keys, t_args), names, "torch_fn")
    if set(torch_out) != set(jax_out):
        raise ValueError(f"torch_fn returned outputs {sorted(torch_out)}, jax_fn {sorted(jax_out)}")
    dev = next((t.device for t in t_args.values() if hasattr(t, "device")), None)
    if dev is not None and dev.type == "cuda":
        import torch

        torch.cuda.synchronize(dev)
    return torch_out, jax_out, dev


def _one_dtype(torch_out: dict, jax_out: dict, cast: bool, notes: list[str] | None) -> None:
    """Outputs of both sides in one compared float dtype: the wider cast to the narrower with `cast`."""
    from parity.library import bits, special

    for k in torch_out:
        for side, out in (("torch_fn", torch_out), ("jax_fn", jax_out)):
            try:
                dt = bits._as_torch(out[k]).dtype
            except TypeError:
                raise TypeError(f"output {k!r} of {side} is a {type(out[k]).__name__}; expected a torch tensor, a "
                                "JAX array or a numpy array") from None
            if dt not in bits._FORMATS:
                raise TypeError(f"output {k!r} of {side} is {dt}; compared outputs are float: "
                                f"{[str(d).replace('torch.', '') for d in bits._FORMATS]}")
        a, b, how = special.as_narrower(torch_out[k], jax_out[k])
        if how is None:
            continue
        if not cast:
            raise TypeError(f"output {k!r}: torch_fn returned {bits._as_torch(torch_out[k]).dtype}, jax_fn "
                            f"{bits._as_torch(jax_out[k]).dtype}; pass cast_to_narrower=True to compare after "
                            "rounding the wider to the narrower")
        torch_out[k], jax_out[k] = a, b
        if notes is not None:
            side, cast_ = how.split(" ", 1)
            notes.append(f"output {k!r}: {'torch_fn' if side == 'a' else 'jax_fn'} {cast_} before comparing "
                         "(cast_to_narrower)")


def cross_check(torch_fn: Callable, jax_fn: Callable, inputs: Mapping[str, Any] | Sequence[Any], *,
                reference: Callable | None = None, reference_lowp: Callable | None = None,
                outputs: Mapping[str, Any] | Sequence[str] | None = None, ragged: Any = None,
                bitwise: bool = True, tolerance: Any = None, name: str = "", device=None,
                cast_to_narrower: bool = False, special_values: bool | int = False) -> Report:
    """Runs a PyTorch and a JAX implementation on the same inputs and compares their outputs.

    Args:
        torch_fn, jax_fn: called with the shared inputs (keywords for a dict, positions for a sequence);
            each returns one array, a sequence or a dict of arrays (float dtypes: fp32, fp16, bf16, fp8).
            jax_fn runs first (and is waited for), then torch_fn: a torch kernel writing its inputs in place
            cannot change what JAX read.
        inputs: dict or sequence of numpy arrays, torch tensors, JAX arrays (any float dtype incl. bf16 and
            fp8, or int32/int16/int8/uint8/bool) and plain values (`share`).
        reference: optional; called like the others with numpy copies of the inputs (and, for the error
            model, with float64 copies, plain and with one f32 rounding planted), returns the outputs in float64.
            Its bound is combined with a low-precision baseline (`parity.library.errormodel`): a side fails only
            where it is also more than twice as far from the reference as the computation done in its inputs'
            precision: the reference itself when it follows its inputs' dtype, else `reference_lowp`, else a
            documented bound derived from the output's magnitude (the audit says which, and which bound decided
            each failing element).
        reference_lowp: optional; called like `reference` with numpy copies of the inputs in their own dtype, it
            does the computation in that precision (e.g. the same numpy code without the float64 casts, or the
            framework's own plain functions) and returns the outputs; used for the low-precision baseline.
        outputs: output name -> axis names (e.g. {"out": ("token", "head", "dim")} or "token,head,dim";
            None: mismatches named by index), or a sequence of names. Names the outputs of sequence results,
            and picks and orders dict results.
        ragged: offsets that name the request of a mismatch: an input name, an array of offsets (numpy, torch,
            JAX, list), or (either of those, axis name); the axis defaults to "token".
        bitwise: require torch and JAX to agree bit for bit (else the differing bits are reported only).
        tolerance: for the reference comparisons: None (the bound computed from the reference,
            `parity.library.errormodel`), a `parity.Tolerance`, (rtol, atol), a `TOLERANCES` key, or a dict
            output -> one of those.
        name: shown in the report.
        device: torch device for numpy inputs (default: the first tensor's, else cuda when available).
        cast_to_narrower: outputs whose dtype differs between the sides are compared after rounding the wider
            to the narrower (named in `Report.notes`); without it such outputs raise TypeError.
        special_values: True (or a count per value): run the pair again on copies of the float inputs with
            NaN, +inf, -inf, -0.0 and a subnormal planted (positions in `Report.special`) and require the two
            sides to agree on the value class of every output (kind "special_torch_vs_jax").

    Returns:
        A `Report`.
    """
    from parity.library import errormodel, special

    args_.check_callable(torch_fn, "torch_fn")
    args_.check_callable(jax_fn, "jax_fn")
    args_.check_callable(reference, "reference", optional=True)
    args_.check_callable(reference_lowp, "reference_lowp", optional=True)
    if reference_lowp is not None and reference is None:
        raise ValueError("reference_lowp needs a reference: it only sets the low-precision baseline of the "
                         "comparison with the reference")
    args_.check_inputs(inputs)
    bitwise = args_.check_flag(bitwise, "bitwise")
    cast_to_narrower = args_.check_flag(cast_to_narrower, "cast_to_narrower")
    n_special = args_.special_count(special_values)
    if not isinstance(name, str):
        raise TypeError(f"name must be a string, got {name!r}")
    names, axes = args_.output_spec(outputs)
    keys, t_args, j_args, n_args, how = share(inputs, device, host=reference is not None or n_special > 0)
    offsets, ragged_axis = args_.ragged_offsets(ragged, t_args)
    native = ref64 = eps = lowp = None
    if reference is not None:
        ref_call = lambda a: args_.call(reference, keys, a)  # noqa: E731
        named_ref = lambda r: args_.named(r, names, "reference")  # noqa: E731
        native, ref64, eps, _ = errormodel.evaluate(ref_call, n_args, named_ref)
        lowp_call = None if reference_lowp is None else (lambda a: args_.call(reference_lowp, keys, a))
        lowp = errormodel.lowp_errors(ref_call, lowp_call, n_args, named_ref, native, ref64)
    torch_out, jax_out, dev = _run_pair(torch_fn, jax_fn, keys, t_args, j_args, names)
    if native is not None and set(native) != set(torch_out):
        raise ValueError(f"reference returned outputs {sorted(native)}, torch_fn {sorted(torch_out)}")
    notes: list[str] = []
    _one_dtype(torch_out, jax_out, cast_to_narrower, notes)
    order = list(torch_out)
    for k in order if native is not None else ():
        got, ref_shape = tuple(torch_out[k].shape), tuple(np.shape(native[k]))
        if got != ref_shape:
            raise ValueError(f"output {k!r}: the reference returned shape {ref_shape}, torch_fn {got}")
    layouts = {k: args_.axes_of(axes.get(k)) for k in order}
    args_.check_axes(layouts, {k: tuple(torch_out[k].shape) for k in order})
    tols = args_.tolerances(tolerance, order)
    want, mags, audit, model = {}, {}, {}, {}
    for k in order if native is not None else ():
        out_dtype = str(getattr(torch_out[k], "dtype"))
        _, model[k], _, _ = errormodel.audit_and_bound(native[k], ref64[k], eps[k], out_dtype)
        w, b, t, audit[k] = errormodel.audit_and_bound(native[k], ref64[k], eps[k], out_dtype, lowp[k])
        want[k] = w
        if tols[k] is None:
            tols[k], mags[k] = t, b
    against = ("torch", "jax") if native is not None else ()
    loc = Locating(offsets, ragged_axis)
    pairs = compare_results({"torch": torch_out, "jax": jax_out}, order, pairs=[("torch", "jax")],
                            reference=want if native is not None else None, against=against, locating=loc,
                            axes=layouts, tolerance=tols, mag=mags)
    by_output: dict[str, dict[str, Any]] = {k: {} for k in order}
    for kind, rep in pairs:
        by_output[rep.name][kind] = rep
    for k, a in audit.items():
        reps = by_output[k]
        a.sides_agree_better = (not reps["torch_vs_reference"].ok and not reps["jax_vs_reference"].ok
                                and reps[KIND_PAIR].classes_agree and (reps[KIND_PAIR].max_ulp or 0) <= 4)
        if k in mags:  # the default bound: which of its two parts each failing element exceeded last
            for side, out in (("torch_fn", torch_out), ("jax_fn", jax_out)):
                if not reps[f"{side[:-3]}_vs_reference"].ok:
                    got = bridge.to_numpy(out[k]).astype(np.float64)
                    a.decided[side] = errormodel.deciding_bound(got, want[k], model[k], mags[k])
    required = ((KIND_PAIR,) if bitwise else ()) + tuple(f"{a}_vs_reference" for a in against)
    planted_at: list[str] = []
    if n_special:
        planted, planted_at = special.plant(n_args, n_special)
        _, t2, j2, _, _ = share(planted, dev, host=False)
        torch_sp, jax_sp, _ = _run_pair(torch_fn, jax_fn, keys, t2, j2, names)
        _one_dtype(torch_sp, jax_sp, cast_to_narrower, None)
        for k in order:
            by_output[k][KIND_SPECIAL] = special.compare_classes(
                torch_sp[k], jax_sp[k], name=k, layout=layouts[k], query_start_loc=offsets,
                ragged_axis=ragged_axis, context="special values")
        required += (KIND_SPECIAL,)
    return Report(name=name, device=str(dev or "cpu"), outputs=by_output, required=required,
                  axes={k: axes.get(k) for k in order}, inputs=how, audit=audit, special=planted_at, notes=notes)


def assert_cross_check(*args, **kwargs) -> Report:
    """`cross_check` for tests: raises AssertionError whose message is the report (pytest prints it)."""
    report = cross_check(*args, **kwargs)
    if not report.ok:
        raise AssertionError("\n" + report.format())
    return report


__all__ = ["KIND_PAIR", "KIND_SPECIAL", "Locating", "Report", "SCHEMA", "assert_cross_check", "compare_results",
           "cross_check", "jsonable", "share"]
