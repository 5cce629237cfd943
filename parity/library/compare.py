"""Comparisons for the parity harness: exact bits, float64 reference within tolerance, and readable failures.

Everything runs on the device of `got` with torch ops, in chunks along the first axis, so a 1G-element
output is never copied to the host; only counts, a ULP histogram and a few located mismatches come back.
JAX arrays are accepted and handed to torch zero-copy through `parity.library.bridge.jax_to_torch`.

Two comparisons:

- `compare_bits` / `assert_bitwise_equal`: Triton vs Pallas. Identical bits are required; a NaN agrees with
  a NaN by value class but a different NaN payload still counts as a difference (parity means the same
  bits), and +0 vs -0 is a difference of 0 ULP.
- `compare_to_reference` / `assert_matches_reference`: an implementation vs the float64 reference
  (`parity.harness.reference`). Checks, in order: (1) the value class (finite, +inf, -inf, NaN) of every element
  agrees; (2) elements marked `exact` (the mask, pass-through copies, zeroed rows) match the reference
  rounded to the native dtype bit for bit (NaN vs NaN agrees: float64 cannot carry f32 NaN payloads
  reliably, unless `want` is given in the native dtype, then its bits are compared as they are);
  (3) the other finite elements satisfy `|got - want| <= atol + rtol * mag` (see `TOLERANCES`).

ULP distances are measured in the native dtype on the ordered integer line of `ordered_bits`.
A failure reads:

    merge.out bf16 case=131k_skewed seed=7 mode=compiled: 3 / 8,388,608 differ, max 2 ulp, classes agree
      req 17 head 5 token 4211 dim 80: got 0x3f81 (1.0078) want 0x3f80 (1.0) ulp=1

No kernel imports: this module works before the kernels exist.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from parity.library import bridge
# Also the names of parity.library.compare for its callers (the bits, the scan, the tolerance table).
from parity.library.bits import (CLASS_NAMES, FINITE, NAN, NEG_INF, POS_INF, _as_array, _as_torch, _float64,
                                 _format_of, _int_view, _native, _where, dtype_name, is_numpy, ordered_bits,
                                 raw_bits, ulp_distance, value_class)
from parity.library.scan import (LAYOUTS, MAX_SHOWN, ULP_BUCKETS, _Accumulator, _Locator, _chunk_of, _device_of,
                                 _mask_chunk, _pick_layout, _row_chunks, _shape_of, _show)
from parity.library.tolerances import TOLERANCES, Tolerance, tolerance_for

# --------------------------------------------------------------------------------------------------------
# Report


@dataclasses.dataclass
class Report:
    """Summary of one comparison. `n_diff` counts failing elements; `ok` is `n_diff == 0`."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    n: int
    n_diff: int
    max_ulp: int | None  # over elements where neither side is NaN; None if there are none
    ulp_hist: dict[str, int]  # ULP_BUCKETS -> count, same elements as max_ulp
    classes_agree: bool
    n_class_mismatch: int
    first_mismatches: list[str]
    tolerance: str
    ok: bool
    context: str = ""
    kind: str = "bitwise"  # or "reference", or "classes" (value classes only: `parity.library.special`)
    n_exact: int = 0  # elements checked bit for bit (reference mode)
    n_exact_mismatch: int = 0
    n_tol_fail: int = 0
    n_bits_diff: int = 0  # reference mode: elements whose bits differ from the rounded reference
    max_err_ratio: float | None = None  # reference mode: max |got-want| / (atol + rtol*mag); <= 1 passes

    def header(self) -> str:
        where = " ".join(p for p in (self.name, self.dtype, self.context) if p)
        classes = "classes agree" if self.classes_agree else f"{self.n_class_mismatch:,} class mismatches"
        ulp = "n/a" if self.max_ulp is None else f"{self.max_ulp:,}"
        if self.kind == "bitwise":
            return f"{where}: {self.n_diff:,} / {self.n:,} differ, max {ulp} ulp, {classes}"
        if self.kind == "classes":
            return f"{where}: {self.n_diff:,} / {self.n:,} differ in value class"
        ratio = "n/a" if self.max_err_ratio is None else f"{self.max_err_ratio:.3g}"
        return (f"{where}: {self.n_diff:,} / {self.n:,} fail (class {self.n_class_mismatch:,}, "
                f"exact {self.n_exact_mismatch:,} of {self.n_exact:,}, tolerance {self.n_tol_fail:,}), "
                f"max {ulp} ulp, max err/tol {ratio}, {classes}")

    def format(self) -> str:
        lines = [self.header()]
        lines += [f"  {m}" for m in self.first_mismatches]
        if self.kind == "classes":
            return "\n".join(lines)
        hist = ", ".join(f"{k}: {v:,}" for k, v in self.ulp_hist.items() if v)
        lines.append(f"  ulp histogram: {hist or 'empty'}")
        if self.kind == "reference":
            lines.append(f"  tolerance: {self.tolerance}; {self.n_bits_diff:,} elements differ in bits from "
                         "the reference rounded to the native dtype")
        else:
            lines.append(f"  tolerance: {self.tolerance}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["shape"] = list(self.shape)
        return d

    def __str__(self) -> str:
        return self.format()



def __getattr__(name):
    if name == "_FORMATS":  # torch dtype -> format (imports torch)
        from parity.library import bits

        return bits._FORMATS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _pair(got: Any, want: Any):
    """`got` and `want` as one kind of array: numpy when both are numpy (compared with numpy), else torch tensors
    on `got`'s device."""
    got, want = _as_array(got), _as_array(want)
    if is_numpy(got) and is_numpy(want):
        return got, want
    got = _as_torch(got)
    return got, _as_torch(want, got.device)


def _numel(x) -> int:
    return int(math.prod(x.shape))


def _check_pair(got: Any, want_shape: tuple[int, ...], what: str) -> None:
    if _shape_of(got) != want_shape:
        raise ValueError(f"{what}: shapes differ: got {tuple(got.shape)} want {want_shape}")


def compare_bits(got: Any, want: Any, *, name: str = "", query_start_loc: Any = None,
                 layout: str | None = None, context: str = "", max_shown: int = MAX_SHOWN,
                 lse_layout: str | None = None, case: Any = None, seed: Any = None, mode: Any = None,
                 ragged_axis: str = "token") -> Report:
    """Exact bitwise comparison of two arrays of one float dtype (Triton vs Pallas parity).

    Args:
        got, want: torch tensors or JAX arrays (any strides), same dtype (fp32/fp16/bf16/fp8) and shape.
        name: what is compared, e.g. "merge.out".
        query_start_loc: i32[R+1]; names the request of each mismatch (`layout` must have a token axis).
        layout: "THD" (outputs [T, H, D]), "HT" or "TH" (LSE), "flat"; None infers THD / HT by rank. Or a
            tuple of axis names, one per dim: mismatches are then named by them, in array order.
        ragged_axis: with a tuple `layout`, the axis `query_start_loc` indexes (default "token").
        context: e.g. "case=2k_balanced seed=0 mode=compiled"; built from `case`, `seed`, `mode` when
            empty.
        lse_layout: the layout of a 2-D (LSE) operand, used when `layout` is None.

    Returns:
        A `Report`; `ok` iff every element has identical bits (NaN payloads included; +0 != -0).
    """
    got, want = _pair(got, want)
    layout = _pick_layout(layout, lse_layout, got.ndim)
    context = context or _context(case, seed, mode)
    if got.dtype != want.dtype:
        raise TypeError(f"{name}: dtypes differ: {got.dtype=} {want.dtype=}")
    fmt = _format_of(got.dtype)
    _check_pair(got, _shape_of(want), name)
    shape = _shape_of(got)
    locate = _Locator(shape, layout, query_start_loc, ragged_axis)
    g_all, w_all = (got.reshape(1), want.reshape(1)) if got.ndim == 0 else (got, want)
    acc = _Accumulator(max_shown)
    row_numel = math.prod(shape[1:]) if len(shape) > 1 else 1
    for i, j in _row_chunks(g_all.shape[0], row_numel):
        g = g_all[i:j].reshape(-1)
        w = w_all[i:j].reshape(-1)
        gb, wb = _int_view(g, fmt), _int_view(w, fmt)
        gc, wc = value_class(g), value_class(w)
        diff = gb != wb
        comparable = (gc != NAN) & (wc != NAN)
        ulp = _where(comparable, abs(ordered_bits(g) - ordered_bits(w)), -1)
        acc.count("diff", diff)
        acc.count("class", gc != wc)
        acc.ulps(ulp, comparable)
        fields = dict(got=gb, want=wb, ulp=ulp)
        base = i * row_numel
        acc.examples_from(base, diff, fields)
        acc.worst_from(base, _where(diff, ulp, -1), fields)

    def line(f):
        (gh, gv), (wh, wv) = _native(f["got"], fmt), _native(f["want"], fmt)
        ulp = "n/a" if f["ulp"] < 0 else f["ulp"]
        return f"got {gh} ({gv}) want {wh} ({wv}) ulp={ulp}"

    n_diff, n_class = acc.counts.get("diff", 0), acc.counts.get("class", 0)
    return Report(
        name=name, dtype=fmt.short, shape=shape, n=_numel(got), n_diff=n_diff, max_ulp=acc.max_ulp,
        ulp_hist=dict(zip(ULP_BUCKETS, acc.hist.tolist())), classes_agree=n_class == 0,
        n_class_mismatch=n_class, first_mismatches=_show(acc, locate, line) if n_diff else [],
        tolerance="identical bits", ok=n_diff == 0, context=context, kind="bitwise")


def compare_to_reference(got: Any, want: Any, *, name: str = "", tol: Tolerance | str | None = None,
                         exact: Any = False, mag: Any = None, query_start_loc: Any = None,
                         layout: str | None = None, context: str = "", max_shown: int = MAX_SHOWN,
                         exact_mask: Any = None, lse_layout: str | None = None, case: Any = None,
                         seed: Any = None, mode: Any = None, ragged_axis: str = "token") -> Report:
    """Compares an implementation's output with the float64 reference (module docstring: checks 1-3).

    Args:
        got: torch tensor or JAX array, fp32/fp16/bf16/fp8 e4m3fn, any strides.
        want: same shape; float64 (the reference), or the native dtype of `got` (e.g. the mask's f32 LSE,
            whose bits, NaN payloads included, are then compared as they are). numpy, torch or JAX.
        tol: a `Tolerance`, a `TOLERANCES` key, or None: `TOLERANCES["lse"]` for an LSE layout ("HT",
            "TH", or None with 2 dims), else `TOLERANCES[dtype of got]`.
        exact: True (everything bit for bit), False, or a bool mask: full shape or a token mask bool[T]
            (e.g. the pass-through rows `arange(T) >= prefill_tokens_with_context`).
        mag: float64 per-element magnitude for the tolerance (full shape), default |want|. For merge
            outputs use `parity.harness.expected.merge_out_magnitude`.
        query_start_loc, layout, context, lse_layout, case, seed, mode, ragged_axis: as in `compare_bits`.
        exact_mask: an alias of `exact` (used when given).

    Returns:
        A `Report`; `ok` iff no class mismatch, no exact mismatch and no element out of tolerance.
    """
    got = _as_array(got)
    if not is_numpy(got) or not (is_numpy(want) and (mag is None or is_numpy(mag))):
        got = _as_torch(got)  # a torch comparison on got's device
    if exact_mask is not None:
        exact = exact_mask
    layout = _pick_layout(layout, lse_layout, got.ndim)
    context = context or _context(case, seed, mode)
    fmt = _format_of(got.dtype)
    device = _device_of(got)
    shape = _shape_of(got)
    _check_pair(got, _shape_of(want), name)
    if mag is not None and _shape_of(mag) != shape:
        raise ValueError(f"{name}: mag shape {_shape_of(mag)} != {shape}")
    if tol is None:  # an LSE layout (given or inferred for 2-D) takes the LSE entry
        lse_like = layout in ("HT", "TH") or (layout is None and got.ndim == 2)
        tol = tolerance_for(got.dtype, lse=lse_like)
    elif isinstance(tol, str):
        tol = TOLERANCES[tol]
    locate = _Locator(shape, layout, query_start_loc, ragged_axis)
    if got.ndim == 0:
        got, shape1 = got.reshape(1), (1,)
        want = np.asarray(bridge.to_numpy(want)).reshape(1)
        mag = None if mag is None else np.asarray(bridge.to_numpy(mag), np.float64).reshape(1)
    else:
        shape1 = shape
    if isinstance(want, np.ndarray):
        want_native = want.dtype == fmt.np_dtype
    else:
        want_native = dtype_name(_as_torch(want)) == fmt.name
    acc = _Accumulator(max_shown)
    row_numel = math.prod(shape1[1:]) if len(shape1) > 1 else 1
    for i, j in _row_chunks(shape1[0], row_numel):
        g = got[i:j].reshape(-1)
        w = _chunk_of(want, i, j, device)
        if want_native:
            w_r, w64 = w, _float64(w)
        else:
            w64 = _float64(w)
            w_r = w64.astype(fmt.np_dtype) if device is None else w64.to(got.dtype)
        gb, wb = _int_view(g, fmt), _int_view(w_r, fmt)
        gc = value_class(g)
        # Rounding may overflow to inf in IEEE dtypes; fp8 casts saturate (torch) or give NaN (ml_dtypes), so fp8
        # uses f64 classes.
        wc = value_class(w_r) if fmt.exp_mask is not None else value_class(w64)
        ex = _mask_chunk(exact, locate, shape1, i, j, device)
        if isinstance(ex, bool):
            ex = (gb == gb) if ex else (gb != gb)  # an integer view: never NaN
        m = abs(w64) if mag is None else _float64(_chunk_of(mag, i, j, device))

        class_mis = gc != wc
        agree = ~class_mis
        comparable = (gc != NAN) & (wc != NAN)
        bits_diff = gb != wb
        # NaN vs NaN agrees by class unless `want` carries native bits.
        exact_mis = ex & agree & bits_diff & (comparable | want_native)
        floats = ~ex & agree & (gc == FINITE)
        g64 = _float64(g)
        limit = tol.atol + tol.rtol * m
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):  # numpy: inf - inf where not `floats`
            err = _where(floats, abs(g64 - w64), 0.0)
            ratio = _where(floats, err / limit, -1.0)
        tol_fail = floats & ~(err <= limit)  # a NaN magnitude fails too
        fail = class_mis | exact_mis | tol_fail
        ulp = _where(comparable, abs(ordered_bits(g) - ordered_bits(w_r)), -1)

        acc.count("class", class_mis)
        acc.count("exact", ex)
        acc.count("exact_mis", exact_mis)
        acc.count("tol", tol_fail)
        acc.count("fail", fail)
        acc.count("bits", bits_diff & comparable)
        acc.ulps(ulp, comparable)
        if floats.any():
            r = float(ratio.max().item())
            acc.counts["ratio"] = max(acc.counts.get("ratio", -1.0), r)
        reason = _where(class_mis, 0, _where(exact_mis, 1, 2))
        fields = dict(got=gb, want=wb, want64=w64, ulp=ulp, ratio=ratio, reason=reason, got_cls=gc, want_cls=wc)
        base = i * row_numel
        acc.examples_from(base, fail, fields)
        acc.worst_from(base, _where(fail, ratio, -1.0), fields)

    def line(f):
        (gh, gv), (wh, wv) = _native(f["got"], fmt), _native(f["want"], fmt)
        tag = ("class", "exact", "tol")[f["reason"]]
        text = f"[{tag}] got {gh} ({gv}) want {wh} ({wv}) [f64 {f['want64']:.9g}]"
        if f["reason"] == 0:
            text += f" classes {CLASS_NAMES[f['got_cls']]} vs {CLASS_NAMES[f['want_cls']]}"
        if f["ulp"] >= 0:
            text += f" ulp={f['ulp']}"
        if f["reason"] == 2:
            text += f" err/tol={f['ratio']:.3g}"
        return text

    c = acc.counts
    n_fail = c.get("fail", 0)
    ratio = c.get("ratio")
    return Report(
        name=name, dtype=fmt.short, shape=shape, n=math.prod(shape), n_diff=n_fail, max_ulp=acc.max_ulp,
        ulp_hist=dict(zip(ULP_BUCKETS, acc.hist.tolist())), classes_agree=c.get("class", 0) == 0,
        n_class_mismatch=c.get("class", 0), first_mismatches=_show(acc, locate, line) if n_fail else [],
        tolerance=tol.describe(), ok=n_fail == 0, context=context, kind="reference",
        n_exact=c.get("exact", 0), n_exact_mismatch=c.get("exact_mis", 0), n_tol_fail=c.get("tol", 0),
        n_bits_diff=c.get("bits", 0), max_err_ratio=None if ratio is None or ratio < 0 else ratio)


# --------------------------------------------------------------------------------------------------------
# Test helpers


def _context(case: Any, seed: Any, mode: Any) -> str:
    parts = []
    if case is not None:
        parts.append(f"case={getattr(case, 'name', case)}")
    if seed is not None:
        parts.append(f"seed={seed}")
    if mode is not None:
        parts.append(f"mode={mode}")
    return " ".join(parts)


def _case_defaults(case: Any, ndim: int, query_start_loc: Any, layout: str | None):
    if case is not None and hasattr(case, "query_lens"):
        if query_start_loc is None:
            query_start_loc = np.concatenate([[0], np.cumsum(case.query_lens)]).astype(np.int32)
        if layout is None and ndim == 2:
            layout = case.lse_layout
    return query_start_loc, layout


def assert_matches_reference(got: Any, want: Any, *, case: Any = None, exact: Any = False, name: str = "",
                             mag: Any = None, seed: Any = None, mode: Any = None, query_start_loc: Any = None,
                             layout: str | None = None, tol: Tolerance | str | None = None) -> Report:
    """The one comparison helper of the tests: class, then exact bits, then tolerance.

    `case` (a `parity.harness.cases.Case`) supplies the failure context and, unless given, `query_start_loc`
    (from its query lengths) and the LSE layout. `tol` defaults as in `compare_to_reference` (the LSE
    entry for 2-D arrays, the output dtype's entry otherwise). Raises AssertionError with `Report.format()`; returns the
    report when it passes.
    """
    got_t = _as_array(got)
    query_start_loc, layout = _case_defaults(case, got_t.ndim, query_start_loc, layout)
    report = compare_to_reference(got_t, want, name=name, tol=tol, exact=exact, mag=mag,
                                  query_start_loc=query_start_loc, layout=layout,
                                  context=_context(case, seed, mode))
    if not report.ok:
        raise AssertionError(report.format())
    return report


def assert_bitwise_equal(got: Any, want: Any, *, name: str = "", case: Any = None, seed: Any = None,
                         mode: Any = None, query_start_loc: Any = None, layout: str | None = None) -> Report | None:
    """Raises AssertionError (with `Report.format()`) unless `got` and `want` have identical bits.

    Equal bits return at once (one comparison of the bits, on the device for torch); the located report is built
    only on a mismatch.
    """
    got_t, want_t = _pair(got, want)
    if got_t.shape == want_t.shape and got_t.dtype == want_t.dtype:
        a, b = raw_bits(got_t), raw_bits(want_t)
        if np.array_equal(a, b) if is_numpy(a) else bool((a == b).all()):
            return None
    query_start_loc, layout = _case_defaults(case, got_t.ndim, query_start_loc, layout)
    report = compare_bits(got_t, want_t, name=name, query_start_loc=query_start_loc, layout=layout,
                          context=_context(case, seed, mode))
    if not report.ok:
        raise AssertionError(report.format())
    return report


__all__ = ["CLASS_NAMES", "FINITE", "NAN", "NEG_INF", "POS_INF", "Report", "TOLERANCES", "Tolerance",
           "ULP_BUCKETS", "assert_bitwise_equal", "assert_matches_reference", "compare_bits",
           "compare_to_reference", "ordered_bits", "raw_bits", "tolerance_for",
           "ulp_distance", "value_class"]
