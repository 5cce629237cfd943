"""The default error model of `cross_check`: a per-element bound derived from the caller's own reference, and the
audit of that reference's precision (docs/parity-library.md, "The default error model").

The reference is evaluated on the inputs as given (`want`), on float64 copies of them, and again, `TRIALS`
times, on float64 copies whose values each carry one rounding at the compute precision u_c = 2^-24 (f32 math):
relative to the value (`x * (1 + s*u_c)`) and relative to the typical magnitude of its array
(`x + s*u_c*median|x|`, what a rounding of an intermediate of the array's scale does), each with s = +1 everywhere
and with random signs. `eps` is, per element, the largest move of the reference over the trials: the error a
correct f32 evaluation makes, scaled by what feeds the element (the terms of a sum before they cancel, the
maximum and the inputs' scale for a log-sum-exp whose result is near 0). The bound of each side is

    |got - want| <= K * eps + R * u_c * |want| + ulp_out(|want| + K * eps + R * u_c * |want|) + atol_out

with K = `K_PROPAGATED`, R = `R_RESULT`, ulp_out the spacing of the output dtype at that magnitude (one full
spacing: a rounding in either direction, or a truncating cast) and atol_out the output dtype's fixed floor
(`TOLERANCES`). numpy only; nothing here runs a kernel.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np

from parity.library.tolerances import TOLERANCES, Tolerance

U_COMPUTE = 2.0**-24  # unit roundoff of the compute precision (f32)
K_PROPAGATED = 16  # roundings along a computation, each moving the result by up to eps
R_RESULT = 8  # roundings of the result itself that no input carries (constants, the last log or divide)
TRIALS = 4  # relative and array-scaled roundings, each all up and of random signs
SEED = 0x5EED

_LOW = {  # numpy dtype -> (unit roundoff, mantissa bits incl. the implicit one, smallest subnormal)
    np.dtype(np.float32): (2.0**-24, 24, 2.0**-149),
    np.dtype(np.float16): (2.0**-11, 11, 2.0**-24),
    np.dtype(ml_dtypes.bfloat16): (2.0**-8, 8, 2.0**-133),
    np.dtype(ml_dtypes.float8_e4m3fn): (2.0**-4, 4, 2.0**-9),
    np.dtype(ml_dtypes.float8_e5m2): (2.0**-3, 3, 2.0**-16),
}
_TOL_KEY = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16",
            np.dtype(ml_dtypes.bfloat16): "bfloat16", np.dtype(ml_dtypes.float8_e4m3fn): "float8_e4m3fn",
            np.dtype(ml_dtypes.float8_e5m2): "float8_e5m2"}
# A correct float64 evaluation moves by ~2^-50 of what feeds it when its inputs' dtype changes; f32 by 2^-24.
_IMPRECISE = 2.0**-36


def unit_roundoff(dtype) -> float:
    """Half the gap between 1 and the next value of a compared float dtype (numpy, ml_dtypes or torch name)."""
    return _LOW[np.dtype(_np_dtype(dtype))][0]


def _np_dtype(dtype):
    name = str(dtype).replace("torch.", "")
    return {"bfloat16": ml_dtypes.bfloat16, "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
            "float8_e5m2": ml_dtypes.float8_e5m2}.get(name, name)


def spacing(mag: np.ndarray, dtype) -> np.ndarray:
    """The gap between consecutive values of `dtype` at magnitude `mag` (float64, elementwise; the smallest
    subnormal below the normal range)."""
    _, bits, tiny = _LOW[np.dtype(_np_dtype(dtype))]
    mag = np.maximum(np.abs(mag), np.finfo(np.float64).tiny)
    exp = np.floor(np.log2(mag))
    return np.maximum(np.exp2(exp - (bits - 1)), tiny)


def is_float_array(x: Any) -> bool:
    return isinstance(x, np.ndarray) and (x.dtype.kind == "f" or x.dtype in _LOW)


def as_float64(args: Mapping[Any, Any]) -> dict[Any, Any]:
    """float64 copies of the float arrays of `args` (the rest as it is)."""
    return {k: (np.asarray(v, np.float64) if is_float_array(v) else v) for k, v in args.items()}


def typical_magnitude(v: np.ndarray) -> float:
    """The median of the nonzero finite |v| (0 if none): the scale of an array's intermediates, robust to a few
    outliers (a maximum would let one huge element loosen every bound)."""
    a = np.abs(v[np.isfinite(v) & (v != 0)])
    return float(np.median(a)) if a.size else 0.0


def perturbed(args64: Mapping[Any, Any], trial: int, u: float = U_COMPUTE) -> dict[Any, Any]:
    """`args64` with every float value carrying one rounding of size u: relative to the value itself
    (`x * (1 + s*u)`: trials 0, 1) or to the largest magnitude of its array (`x + s*u*max|x|`: trials 2, 3);
    s = +1 everywhere in trials 0 and 2, random signs (seeded) in 1 and 3. Python floats move relatively
    (an `eps`); integers and bools do not."""
    rng = np.random.default_rng(SEED + trial)
    out = {}
    for k, v in args64.items():
        if isinstance(v, np.ndarray) and v.dtype == np.float64:
            s = np.ones(v.shape) if trial in (0, 2) else rng.choice((-1.0, 1.0), size=v.shape)
            if trial < 2:
                out[k] = v * (1.0 + s * u)
            else:
                out[k] = v + s * u * typical_magnitude(v)
        elif isinstance(v, float):
            out[k] = v * (1.0 + u)
        else:
            out[k] = v
    return out


@dataclasses.dataclass
class Audit:
    """How precise the reference is, for one output (reported in every `cross_check` report with a reference).

    `eps_ulp`: the largest move of the reference under one compute-precision rounding of its inputs, in
    spacings of the output dtype at the element (a well-conditioned output moves by about 1 or less; a
    cancelling sum or a log-domain value near 0 by many). `native_vs_f64`: the largest difference between the
    reference on the inputs as given and on float64 copies, over the bound (0 for a reference computing in
    float64). `imprecise`: the reference computes in low precision itself (`why` says how it was found); its
    own error (its difference from its evaluation on float64 copies, or one rounding at its precision) is then
    added to the bound, so the kernels do not fail for it.
    """

    dtype: str  # what the reference returned
    eps_ulp: float
    native_vs_f64: float
    imprecise: bool = False
    why: str = ""
    sides_agree_better: bool = False  # set by cross_check: both sides fail the reference but agree together

    def describe(self) -> str:
        text = (f"reference {self.dtype}: one f32 rounding of its inputs moves it "
                f"by up to {self.eps_ulp:.3g} output ulps; inputs as given vs float64: {self.native_vs_f64:.3g} "
                "of the bound")
        if self.imprecise:
            text += f"; IMPRECISE REFERENCE ({self.why})"
        if self.sides_agree_better:
            text += ("; both sides agree with each other but not with the reference: suspect the reference")
        return text


def _finite(a: np.ndarray) -> np.ndarray:
    return np.where(np.isfinite(a), a, 0.0)


def bound(want: np.ndarray, eps: np.ndarray, out_dtype, ref_unit: float | None = None) -> np.ndarray:
    """The per-element bound of the module docstring; with `ref_unit` (an imprecise reference's unit
    roundoff) the reference's own error at that precision is added."""
    key = _TOL_KEY[np.dtype(_np_dtype(out_dtype))]
    w = np.abs(_finite(want))
    compute = K_PROPAGATED * eps + R_RESULT * U_COMPUTE * w
    b = compute + spacing(w + compute, out_dtype) + TOLERANCES[key].atol
    if ref_unit is not None:
        scale = ref_unit / U_COMPUTE
        b = b + scale * compute + 2 * ref_unit * w
    return b


def describe_rule(out_dtype) -> str:
    return (f"computed: |got-want| <= {K_PROPAGATED}*eps + {R_RESULT}*2^-24*|want| + 1 {_TOL_KEY[np.dtype(_np_dtype(out_dtype))]}"
            " ulp + atol (eps: the reference's move under one f32 rounding of its inputs)")


def evaluate(call, n_args: Mapping[Any, Any], named) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray],
                                                              dict[str, np.ndarray], dict[str, str]]:
    """(want on the inputs as given, want on float64 copies, eps, returned dtype) per output.

    `call(args)` runs the reference on an argument dict; `named(result)` names its outputs."""
    fresh = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in n_args.items()}  # it may write them
    native = {k: np.asarray(v) for k, v in named(call(fresh)).items()}
    args64 = as_float64(n_args)
    ref64 = {k: np.asarray(v) for k, v in named(call(args64)).items()}
    if set(ref64) != set(native):
        raise ValueError(f"reference returned outputs {sorted(native)} on the inputs and {sorted(ref64)} on "
                         "float64 copies of them")
    eps = {k: np.zeros(np.shape(v)) for k, v in ref64.items()}
    base = {k: np.asarray(v, np.float64) for k, v in ref64.items()}
    # A reference that rounds to a low precision even on float64 inputs would round a 2^-24 move away: move it
    # by 4 of its own units instead and scale the moves back to 2^-24 (they are linear in a small move).
    low = [_LOW[np.dtype(v.dtype)][0] for v in ref64.values() if np.dtype(v.dtype) in _LOW]
    u = 4 * max(low) if low else U_COMPUTE
    for trial in range(TRIALS):
        moved = named(call(perturbed(args64, trial, u)))
        for k in eps:
            with np.errstate(invalid="ignore", over="ignore"):
                d = np.abs(np.asarray(moved[k], np.float64) - base[k]) * (U_COMPUTE / u)
            eps[k] = np.maximum(eps[k], np.where(np.isfinite(d), d, 0.0))
    dtypes = {k: str(v.dtype) for k, v in native.items()}
    return native, ref64, eps, dtypes


def audit_and_bound(native: np.ndarray, ref64: np.ndarray, eps: np.ndarray, out_dtype) -> tuple[
        np.ndarray, np.ndarray, Tolerance, Audit]:
    """(want, bound, the `Tolerance` describing it, the audit) of one output.

    `want` is the reference on the inputs as given (the caller's semantics). Where its result on float64 copies
    differs, the reference computes in its inputs' precision: the difference is its own error, flagged and
    added to the bound. A reference that returns a low-precision dtype even on float64 inputs adds its own
    error at that precision (the bound's compute terms scaled by its unit roundoff over 2^-24, and one
    rounding)."""
    w = np.asarray(native, np.float64)
    r64 = np.asarray(ref64, np.float64)
    feed = np.abs(_finite(w)) + eps / U_COMPUTE
    b = bound(w, eps, out_dtype)
    both = np.isfinite(w) & np.isfinite(r64)
    diff = np.where(both, np.abs(np.where(both, w, 0.0) - np.where(both, r64, 0.0)), 0.0)
    native_vs = float(np.max(diff / b)) if diff.size else 0.0
    eps_ulp = float(np.max(eps / spacing(np.abs(_finite(w)), out_dtype))) if eps.size else 0.0
    reasons, ref_unit = [], None
    if np.dtype(native.dtype) in _LOW:
        reasons.append(f"it returns {np.dtype(native.dtype)}")
    if np.dtype(ref64.dtype) in _LOW:
        ref_unit = _LOW[np.dtype(ref64.dtype)][0]
        reasons.append(f"it returns {np.dtype(ref64.dtype)} on float64 inputs too")
    if diff.size and np.any(diff > _IMPRECISE * feed):
        reasons.append("its result on the inputs as given differs from its result on float64 copies")
    if ref_unit is not None:
        b = bound(w, eps, out_dtype, ref_unit)
    b = b + diff
    tol = Tolerance(rtol=1.0, atol=0.0, text=describe_rule(out_dtype))
    audit = Audit(dtype=str(np.dtype(native.dtype)), eps_ulp=eps_ulp, native_vs_f64=native_vs,
                  imprecise=bool(reasons), why="; ".join(reasons))
    return np.asarray(w), np.asarray(b, np.float64), tol, audit


__all__ = ["Audit", "K_PROPAGATED", "R_RESULT", "TRIALS", "U_COMPUTE", "audit_and_bound", "bound", "evaluate",
           "perturbed", "spacing", "unit_roundoff"]
