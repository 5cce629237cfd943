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
(`TOLERANCES`).

That bound sees the roundings of the inputs, not those inside the computation: an output that cancels against a
rounded intermediate (x - logsumexp(x) at a dominant logit, where the f32 log-sum-exp rounds to the logit itself)
is off by far more than its eps in any faithful f32 evaluation. So every bound is combined with a low-precision
baseline, FlashAttention's rule: the error the same computation makes done honestly in its inputs' precision,

    |got - want| <= max(the bound above, C * e_low + ulp_out(|want|)),   C = `C_LOWP`

where e_low is, per element, the largest |lowp - ref64| over the inputs as given and `LOWP_TRIALS` copies of them
with one ulp of their own dtype moved at random positions (so that one evaluation that happens to be exact does
not make the baseline 0), lowp being (in this order) the caller's `reference_lowp`, or the reference itself when
it follows its inputs' dtype (its result on the inputs as given differs from its result on float64 copies). When
neither gives a low-precision run (the reference upcasts, and no `reference_lowp`, or a `reference_lowp` that
upcasts too: the audit says so), e_low is derived: 2^-24 times the largest finite magnitude of the output and of
the float inputs, the scale of the intermediates an output cancels against (a log-sum-exp near the largest input,
a mean of the inputs; intermediates larger than any input or output, such as the partial sums of a long
accumulation, move with the inputs' roundings: eps covers them). numpy only; nothing here runs a kernel.
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
C_LOWP = 2  # a side may be this many times as far from the reference as the low-precision baseline
LOWP_TRIALS = 2  # copies of the inputs with one ulp moved, besides the inputs as given

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
    lowp: str = ""  # where the low-precision baseline came from (LOWP_MEASURED, LOWP_REFERENCE or LOWP_DERIVED)
    lowp_ulp: float = 0.0  # the largest low-precision error e_low, in output ulps at the element
    upcasts: str = ""  # which of the reference / reference_lowp upcasts (no low-precision run), if one does
    decided: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)  # side -> bound -> failing count

    def describe(self) -> str:
        text = (f"reference {self.dtype}: one f32 rounding of its inputs moves it "
                f"by up to {self.eps_ulp:.3g} output ulps; inputs as given vs float64: {self.native_vs_f64:.3g} "
                "of the bound")
        if self.lowp:
            text += f"; low-precision baseline: {self.lowp}, up to {self.lowp_ulp:.3g} output ulps"
        if self.upcasts:
            text += f" ({self.upcasts} upcasts: its run on the inputs as given is not one in their precision)"
        for side, counts in self.decided.items():
            text += f"; {side} fails {sum(counts.values())}: " + ", ".join(
                f"{n} past the {which} bound" for which, n in counts.items() if n)
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


def describe_rule(out_dtype, lowp: bool = False) -> str:
    text = (f"computed: |got-want| <= {K_PROPAGATED}*eps + {R_RESULT}*2^-24*|want| + 1 "
            f"{_TOL_KEY[np.dtype(_np_dtype(out_dtype))]} ulp + atol (eps: the reference's move under one f32 rounding "
            "of its inputs)")
    if lowp:
        text += f", or {C_LOWP}*e_low + 1 ulp (e_low: the computation's own error in its inputs' precision)"
    return text


def deciding_bound(got: np.ndarray, want: np.ndarray, model: np.ndarray, combined: np.ndarray) -> dict[str, int]:
    """How many finite elements of `got` fail the `combined` bound, by the bound that was the larger there (the
    error model's or the low-precision baseline's): the one that decided."""
    g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
    both = np.isfinite(g) & np.isfinite(w)
    err = np.where(both, np.abs(np.where(both, g, 0.0) - np.where(both, w, 0.0)), 0.0)
    fail = both & (err > combined)
    by_low = fail & (combined > model)
    return {BOUND_MODEL: int(np.sum(fail & ~by_low)), BOUND_LOWP: int(np.sum(by_low))}


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


LOWP_MEASURED = "reference_lowp"
LOWP_REFERENCE = "the reference in its inputs' precision"
LOWP_DERIVED = "derived, 2^-24 x the largest magnitude of the output and the inputs"
BOUND_MODEL, BOUND_LOWP = "error-model", "low-precision"


def nudged(n_args: Mapping[Any, Any], trial: int) -> dict[Any, Any]:
    """`n_args` with about half of each float array's finite nonzero values moved by one ulp of their own dtype
    (up or down in magnitude, at seeded random positions); the rest as it is."""
    rng = np.random.default_rng(SEED + 100 + trial)
    out = {}
    for k, v in n_args.items():
        if is_float_array(v) and v.dtype.itemsize in (1, 2, 4, 8) and v.size:
            bits = v.view(f"u{v.dtype.itemsize}").copy()
            step = rng.choice(np.array([0, 1, -1], np.int64), size=v.shape)
            ok = np.isfinite(v.astype(np.float64)) & (v.astype(np.float64) != 0)
            moved = (bits.astype(np.int64) + np.where(ok, step, 0)).astype(bits.dtype).view(v.dtype)
            out[k] = np.where(np.isfinite(moved.astype(np.float64)), moved, v)
        else:
            out[k] = v
    return out


def lowp_errors(reference, reference_lowp, n_args: Mapping[Any, Any], named, native: Mapping[str, np.ndarray],
                ref64: Mapping[str, np.ndarray]) -> dict[str, tuple[np.ndarray, str, str]]:
    """Per output: (e_low, source, which upcasts) of the module docstring.

    `reference(args)` and `reference_lowp(args)` (None: the reference itself) run on argument dicts; `named`
    names their outputs. `native` / `ref64`: the reference on the inputs as given and on float64 copies."""
    fresh = lambda a: {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in a.items()}  # noqa: E731
    lowp = reference if reference_lowp is None else reference_lowp
    first = native if reference_lowp is None else {k: np.asarray(v) for k, v in named(lowp(fresh(n_args))).items()}
    if set(first) != set(ref64):
        raise ValueError(f"reference_lowp returned outputs {sorted(first)}, the reference {sorted(ref64)}")
    runs = [(first, ref64)]
    for trial in range(LOWP_TRIALS):
        moved = nudged(n_args, trial)
        runs.append((named(lowp(fresh(moved))), named(reference(as_float64(moved)))))
    inputs = [typical for v in n_args.values() if is_float_array(v)
              for typical in [np.max(np.abs(_finite(np.asarray(v, np.float64))), initial=0.0)]]
    out = {}
    for k in ref64:
        e, upcast = np.zeros(np.shape(ref64[k])), True
        for low, r64 in runs:
            lo, hi = np.asarray(low[k], np.float64), np.asarray(r64[k], np.float64)
            if lo.shape != hi.shape:
                raise ValueError(f"output {k!r}: reference_lowp returned shape {lo.shape}, the reference {hi.shape}")
            both = np.isfinite(lo) & np.isfinite(hi)
            upcast &= bool(np.array_equal(lo[both], hi[both]))
            e = np.maximum(e, np.where(both, np.abs(np.where(both, lo, 0.0) - np.where(both, hi, 0.0)), 0.0))
        if upcast:
            scale = max([float(np.max(np.abs(_finite(np.asarray(ref64[k], np.float64))), initial=0.0))] + inputs)
            out[k] = (np.full(np.shape(ref64[k]), U_COMPUTE * scale), LOWP_DERIVED,
                      "reference_lowp" if reference_lowp is not None else "the reference")
        else:
            out[k] = (e, LOWP_MEASURED if reference_lowp is not None else LOWP_REFERENCE, "")
    return out


def lowp_bound(want: np.ndarray, e_low: np.ndarray, out_dtype) -> np.ndarray:
    """C_LOWP * e_low + one output ulp at |want|."""
    w = np.abs(_finite(np.asarray(want, np.float64)))
    return C_LOWP * e_low + spacing(w, out_dtype)


def audit_and_bound(native: np.ndarray, ref64: np.ndarray, eps: np.ndarray, out_dtype,
                    lowp: tuple[np.ndarray, str, str] | None = None) -> tuple[
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
    low_ulp, source, upcasts = 0.0, "", ""
    if lowp is not None:
        e_low, source, upcasts = lowp
        low = lowp_bound(w, e_low, out_dtype)
        low_ulp = float(np.max((low - spacing(np.abs(_finite(w)), out_dtype)) / C_LOWP
                               / spacing(np.abs(_finite(w)), out_dtype))) if low.size else 0.0
        b = np.maximum(b, low)
    tol = Tolerance(rtol=1.0, atol=0.0, text=describe_rule(out_dtype, lowp is not None))
    audit = Audit(dtype=str(np.dtype(native.dtype)), eps_ulp=eps_ulp, native_vs_f64=native_vs,
                  imprecise=bool(reasons), why="; ".join(reasons), lowp=source, lowp_ulp=low_ulp, upcasts=upcasts)
    return np.asarray(w), np.asarray(b, np.float64), tol, audit


__all__ = ["Audit", "C_LOWP", "K_PROPAGATED", "LOWP_TRIALS", "R_RESULT", "TRIALS", "U_COMPUTE", "audit_and_bound",
           "bound", "deciding_bound", "evaluate", "lowp_bound", "lowp_errors", "nudged", "perturbed", "spacing",
           "unit_roundoff"]
