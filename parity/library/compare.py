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

import ml_dtypes
import numpy as np
import torch

from parity.library import bridge

# Value classes (`value_class`).
FINITE, POS_INF, NEG_INF, NAN = 0, 1, 2, 3
CLASS_NAMES = {FINITE: "finite", POS_INF: "+inf", NEG_INF: "-inf", NAN: "nan"}

LAYOUTS = ("THD", "HT", "TH", "flat")
_AXES = {"THD": ("token", "head", "dim"), "HT": ("head", "token"), "TH": ("token", "head")}

ULP_BUCKETS = ("0", "1", "2", "3-4", "5-8", "9-16", ">16")
_BUCKET_EDGES = (0, 1, 2, 4, 8, 16)  # bucketize(right=False): x <= edge[i] lands in bucket i

_CHUNK = 1 << 24  # elements per device chunk: bounds the temporaries (~10 int64/f64 arrays of a chunk)
MAX_SHOWN = 8


@dataclasses.dataclass(frozen=True)
class _Format:
    short: str  # name in reports
    int_dtype: torch.dtype  # same-width signed integer for bit views
    width: int  # bits
    exp_mask: int | None  # IEEE exponent field (None: e4m3fn, which has no inf)
    np_dtype: np.dtype
    unit_roundoff: float  # half the gap between 1 and the next value


_FORMATS = {
    torch.float32: _Format("fp32", torch.int32, 32, 0x7F800000, np.dtype(np.float32), 2.0**-24),
    torch.float16: _Format("fp16", torch.int16, 16, 0x7C00, np.dtype(np.float16), 2.0**-11),
    torch.bfloat16: _Format("bf16", torch.int16, 16, 0x7F80, np.dtype(ml_dtypes.bfloat16), 2.0**-8),
    torch.float8_e4m3fn: _Format("fp8e4m3", torch.int8, 8, None, np.dtype(ml_dtypes.float8_e4m3fn), 2.0**-4),
    torch.float8_e5m2: _Format("fp8e5m2", torch.int8, 8, 0x7C, np.dtype(ml_dtypes.float8_e5m2), 2.0**-3),
}
_NP_INT = {8: np.int8, 16: np.int16, 32: np.int32}


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """`|got - want| <= atol + rtol * mag`, elementwise, in float64."""

    rtol: float
    atol: float

    def describe(self) -> str:
        return f"|got-want| <= {self.atol:.3g} + {self.rtol:.4g}*mag"


_F32_COMPUTE = 16 * 2.0**-24  # f32 math of the merge: exp, divide, multiply-add, log (a few ulp each)

TOLERANCES: dict[str, Tolerance] = {
    "float32": Tolerance(rtol=2.0**-24 + _F32_COMPUTE + 2.0**-24, atol=2.0**-120),
    "float16": Tolerance(rtol=2.0**-11 + _F32_COMPUTE + 2.0**-24, atol=2.0**-24),
    "bfloat16": Tolerance(rtol=2.0**-8 + _F32_COMPUTE + 2.0**-24, atol=2.0**-120),
    "float8_e4m3fn": Tolerance(rtol=2.0**-4 + _F32_COMPUTE + 2.0**-24, atol=2.0**-9),
    "float8_e5m2": Tolerance(rtol=2.0**-3 + _F32_COMPUTE + 2.0**-24, atol=2.0**-16),
    "lse": Tolerance(rtol=2.0**-24 + _F32_COMPUTE, atol=2.0**-20),
}
"""Tolerances of float outputs against the float64 reference (docs/spec.md 5: on CPU the interpreters do not
agree bitwise, so the merge is checked against float64 within these bounds; the mask is exact).

Derivation. The kernels compute in f32 and round once, at the store, to the output dtype with unit
roundoff u (half an ULP at 1): u = 2^-24 (fp32), 2^-11 (fp16), 2^-8 (bf16), 2^-4 (fp8 e4m3). Let
`mag = |a|*wp + |b|*ws` (float64; `parity.harness.expected.merge_out_magnitude`), the size of the terms before any cancellation.
The f32 evaluation of `a*wp + b*ws` (exp and divide within a few f32 ULPs, FMA or not, FTZ or not) errs
by at most e*mag with e = 16 * 2^-24 = 2^-20. Rounding that f32 value y to the output dtype adds at most
u*|y| <= u*(1 + e)*mag. Hence `rtol = u + e + 2^-24` (the last term bounds u*e). `|want| <= mag`, so the
default `mag = |want|` is valid for a plain rounding and stricter otherwise.

atol covers what scales with nothing: fp16 and fp8 round tiny values to multiples of their smallest
subnormal (2^-24, 2^-9, e5m2 2^-16: a full quantum, half for the rounding, half for a flushed f32 intermediate); for
fp32 and bf16 (8-bit exponent) a flushed f32 intermediate (< 2^-126) times a partial value (< 64) stays
below 2^-120. fp8 outputs are `out / scale`: pass `mag / scale`.

LSE (`lse = log(z) + m`, f32 out): log and the final add err by a few f32 ULPs of |m| + log(z) with
0 <= log(z) <= ln 2, and |lse| >= |m| - ln 2, so `rtol = 2^-24 + 2^-20` relative to |lse| plus
`atol = 2^-20` absolute (16 ULP at 1, for |lse| near 0). Base-2 LSEs add one f32 multiply each way.
"""

_DTYPE_KEY = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
              torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2"}


def tolerance_for(dtype: torch.dtype | str, *, lse: bool = False) -> Tolerance:
    """The `TOLERANCES` entry of an output dtype (or the LSE entry)."""
    if lse:
        return TOLERANCES["lse"]
    key = _DTYPE_KEY.get(dtype, dtype) if isinstance(dtype, torch.dtype) else str(dtype)
    if key not in TOLERANCES:
        raise TypeError(f"no tolerance for {dtype=}; known: {sorted(TOLERANCES)}")
    return TOLERANCES[key]


# --------------------------------------------------------------------------------------------------------
# Bits, ordered integers, value classes


def _as_torch(x: Any, device: torch.device | None = None) -> torch.Tensor:
    """torch tensor as is; JAX array zero-copy through the bridge; numpy uploaded. Moved to `device`."""
    if isinstance(x, torch.Tensor):
        t = x
    elif isinstance(x, np.ndarray):
        t = bridge.to_torch(x, device or "cpu")
    elif bridge._is_jax_array(x):
        t = bridge.jax_to_torch(x)
    else:
        raise TypeError(f"expected a torch tensor, jax array or numpy array, got {type(x)=}")
    if device is not None and t.device != device:
        t = t.to(device)
    return t


def _format_of(dtype: torch.dtype) -> _Format:
    try:
        return _FORMATS[dtype]
    except KeyError:
        raise TypeError(f"{dtype=} is not a compared float dtype; supported: {list(_FORMATS)}") from None


def raw_bits(x: Any) -> torch.Tensor:
    """The bits of a float tensor as a same-width signed integer tensor (a view when `x` allows)."""
    t = _as_torch(x)
    return t.view(_format_of(t.dtype).int_dtype)


def ordered_bits(x: Any) -> torch.Tensor:
    """int64 positions of the values on an ordered integer line: ULP distance = |ordered(a) - ordered(b)|.

    IEEE-like formats are sign-magnitude; mapping a negative value to -(magnitude bits) makes the line
    monotonic in the value, with +0 and -0 both at 0. Infinities sit one step past the largest finite
    value. NaN positions are meaningless (callers exclude NaN by `value_class`).
    """
    t = _as_torch(x)
    fmt = _format_of(t.dtype)
    b = t.view(fmt.int_dtype).to(torch.int64)
    magnitude = b & ((1 << (fmt.width - 1)) - 1)
    return torch.where(b < 0, -magnitude, magnitude)


def ulp_distance(a: Any, b: Any) -> torch.Tensor:
    """int64 |ordered(a) - ordered(b)| elementwise, in the (shared) native dtype of a and b."""
    a, b = _as_torch(a), _as_torch(b)
    if a.dtype != b.dtype:
        raise TypeError(f"ULP distance needs one dtype: {a.dtype=} {b.dtype=}")
    return (ordered_bits(a) - ordered_bits(b.to(a.device))).abs()


def value_class(x: Any) -> torch.Tensor:
    """int8 class per element: FINITE (0), POS_INF (1), NEG_INF (2), NAN (3).

    Float formats are decoded from their bits (works for fp8, where torch lacks isinf/isnan kernels on
    some devices); float64 through isnan/isinf. fp8 e4m3fn has no infinity: its classes are finite/NaN.
    """
    t = _as_torch(x)
    if t.dtype == torch.float64:
        cls = torch.zeros(t.shape, dtype=torch.int8, device=t.device)
        cls[torch.isposinf(t)] = POS_INF
        cls[torch.isneginf(t)] = NEG_INF
        cls[torch.isnan(t)] = NAN
        return cls
    fmt = _format_of(t.dtype)
    b = t.view(fmt.int_dtype).to(torch.int64)
    magnitude = b & ((1 << (fmt.width - 1)) - 1)
    cls = torch.zeros(t.shape, dtype=torch.int8, device=t.device)
    if fmt.exp_mask is None:  # e4m3fn: S.1111.111 is NaN, nothing is inf
        cls[magnitude == 0x7F] = NAN
        return cls
    is_inf = magnitude == fmt.exp_mask
    cls[is_inf & (b >= 0)] = POS_INF
    cls[is_inf & (b < 0)] = NEG_INF
    cls[magnitude > fmt.exp_mask] = NAN
    return cls


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
    kind: str = "bitwise"  # or "reference"
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
        ratio = "n/a" if self.max_err_ratio is None else f"{self.max_err_ratio:.3g}"
        return (f"{where}: {self.n_diff:,} / {self.n:,} fail (class {self.n_class_mismatch:,}, "
                f"exact {self.n_exact_mismatch:,} of {self.n_exact:,}, tolerance {self.n_tol_fail:,}), "
                f"max {ulp} ulp, max err/tol {ratio}, {classes}")

    def format(self) -> str:
        lines = [self.header()]
        lines += [f"  {m}" for m in self.first_mismatches]
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


# --------------------------------------------------------------------------------------------------------
# Chunked scans


def _number(v: float) -> str:
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    s = f"{v:.5g}"
    return s + ".0" if s.lstrip("-").isdigit() else s


def _native(bits: int, fmt: _Format) -> tuple[str, str]:
    """(hex bits, value) of one element given its signed bits."""
    unsigned = bits & ((1 << fmt.width) - 1)
    value = float(np.array(bits, dtype=_NP_INT[fmt.width]).view(fmt.np_dtype)[()])
    return f"0x{unsigned:0{fmt.width // 4}x}", _number(value)


class _Locator:
    """Names an element by layout axes and, through query_start_loc, its request.

    `layout` is one of `LAYOUTS` or a tuple of axis names, one per dimension (any names: `parity.library.crosscheck`);
    then `query_start_loc` indexes the axis named `ragged_axis` and the axes are named in array order.
    """

    def __init__(self, shape: tuple[int, ...], layout: str | tuple[str, ...] | None, query_start_loc: Any,
                 ragged_axis: str = "token"):
        if layout is None:
            layout = {3: "THD", 2: "HT"}.get(len(shape), "flat")
        if isinstance(layout, (tuple, list)):
            self.axes, self.order = tuple(str(a) for a in layout), tuple(str(a) for a in layout)
            self.ragged_axis = ragged_axis
            if len(self.axes) != len(shape):
                raise ValueError(f"axes {self.axes} name {len(self.axes)} dims, got {shape=}")
        elif layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS} or a tuple of axis names, got {layout!r}")
        elif layout != "flat" and len(_AXES[layout]) != len(shape):
            raise ValueError(f"layout {layout!r} needs {len(_AXES[layout])} dims, got {shape=}")
        else:
            self.axes = _AXES.get(layout, ())
            self.order, self.ragged_axis = ("head", "token", "dim"), "token"
        self.shape, self.layout = shape, layout
        self.qsl = None
        if query_start_loc is not None:
            self.qsl = np.asarray(bridge.to_numpy(query_start_loc), dtype=np.int64).reshape(-1)
            if self.qsl.size < 1:
                raise ValueError(f"query_start_loc needs at least one entry, got {self.qsl.shape=}")

    def __call__(self, flat: int) -> str:
        idx = tuple(int(i) for i in np.unravel_index(flat, self.shape)) if self.shape else ()
        if self.layout == "flat":
            return f"index {idx}"
        named = dict(zip(self.axes, idx))
        parts = []
        if self.qsl is not None and self.ragged_axis in named:
            t = named[self.ragged_axis]
            if t >= self.qsl[-1]:
                parts.append("padding")
            else:
                parts.append(f"req {int(np.searchsorted(self.qsl, t, side='right')) - 1}")
        parts += [f"{axis} {named[axis]}" for axis in self.order if axis in named]
        return " ".join(parts)

    def token_axis(self) -> int | None:
        return self.axes.index(self.ragged_axis) if self.ragged_axis in self.axes else None


def _pick_layout(layout: str | None, lse_layout: str | None, ndim: int) -> str | None:
    if layout is None and lse_layout is not None and ndim == 2:
        if lse_layout not in ("HT", "TH"):
            raise ValueError(f"lse_layout must be 'HT' or 'TH', got {lse_layout!r}")
        return lse_layout
    return layout


def _row_chunks(n_rows: int, row_numel: int):
    rows = max(1, _CHUNK // max(1, row_numel))
    for i in range(0, n_rows, rows):
        yield i, min(n_rows, i + rows)


def _chunk_of(x: Any, i: int, j: int, device: torch.device) -> torch.Tensor:
    """Rows [i, j) of a full-shape operand (torch, numpy or jax) as a flat tensor on `device`."""
    if isinstance(x, np.ndarray):
        return bridge.to_torch(x[i:j], device).reshape(-1)
    return _as_torch(x)[i:j].to(device).reshape(-1)


def _shape_of(x: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in x.shape)


class _Accumulator:
    def __init__(self, max_shown: int):
        self.max_shown = max_shown
        self.counts: dict[str, int] = {}
        self.hist = torch.zeros(len(ULP_BUCKETS), dtype=torch.int64)
        self.max_ulp: int | None = None
        self.examples: list[tuple[int, dict]] = []  # (flat index, fields)
        self.worst: tuple[float, int, dict] | None = None  # (score, flat index, fields)

    def count(self, key: str, mask: torch.Tensor) -> None:
        self.counts[key] = self.counts.get(key, 0) + int(mask.sum().item())

    def ulps(self, ulp: torch.Tensor, valid: torch.Tensor) -> None:
        u = ulp[valid]
        if u.numel() == 0:
            return
        edges = torch.tensor(_BUCKET_EDGES, dtype=torch.int64, device=u.device)
        self.hist += torch.bincount(torch.bucketize(u, edges), minlength=len(ULP_BUCKETS)).cpu()
        m = int(u.max().item())
        self.max_ulp = m if self.max_ulp is None else max(self.max_ulp, m)

    def examples_from(self, base: int, fail: torch.Tensor, fields: dict[str, torch.Tensor]) -> None:
        need = self.max_shown - len(self.examples)
        if need <= 0:
            return
        idx = fail.nonzero().flatten()[:need]
        if idx.numel() == 0:
            return
        got = {k: v[idx].tolist() for k, v in fields.items()}
        for n, i in enumerate(idx.tolist()):
            self.examples.append((base + i, {k: v[n] for k, v in got.items()}))

    def worst_from(self, base: int, score: torch.Tensor, fields: dict[str, torch.Tensor]) -> None:
        """Keeps the element with the highest score (score < 0: not a candidate)."""
        if score.numel() == 0:
            return
        value, i = torch.max(score, dim=0)
        value = float(value.item())
        if value < 0 or (self.worst is not None and value <= self.worst[0]):
            return
        i = int(i.item())
        self.worst = (value, base + i, {k: v[i].item() for k, v in fields.items()})


def _show(acc: _Accumulator, locate: _Locator, line) -> list[str]:
    shown = [f"{locate(flat)}: {line(f)}" for flat, f in acc.examples]
    if acc.worst is not None and acc.worst[1] not in {flat for flat, _ in acc.examples}:
        shown.append(f"worst: {locate(acc.worst[1])}: {line(acc.worst[2])}")
    return shown


def _check_pair(got: torch.Tensor, want_shape: tuple[int, ...], what: str) -> None:
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
    got = _as_torch(got)
    want = _as_torch(want, got.device)
    layout = _pick_layout(layout, lse_layout, got.dim())
    context = context or _context(case, seed, mode)
    if got.dtype != want.dtype:
        raise TypeError(f"{name}: dtypes differ: {got.dtype=} {want.dtype=}")
    fmt = _format_of(got.dtype)
    _check_pair(got, _shape_of(want), name)
    shape = _shape_of(got)
    locate = _Locator(shape, layout, query_start_loc, ragged_axis)
    g_all, w_all = (got.reshape(1), want.reshape(1)) if got.dim() == 0 else (got, want)
    acc = _Accumulator(max_shown)
    row_numel = math.prod(shape[1:]) if len(shape) > 1 else 1
    for i, j in _row_chunks(g_all.shape[0], row_numel):
        g = g_all[i:j].reshape(-1)
        w = w_all[i:j].reshape(-1)
        gb, wb = g.view(fmt.int_dtype), w.view(fmt.int_dtype)
        gc, wc = value_class(g), value_class(w)
        diff = gb != wb
        comparable = (gc != NAN) & (wc != NAN)
        ulp = torch.where(comparable, (ordered_bits(g) - ordered_bits(w)).abs(), -1)
        acc.count("diff", diff)
        acc.count("class", gc != wc)
        acc.ulps(ulp, comparable)
        fields = dict(got=gb, want=wb, ulp=ulp)
        base = i * row_numel
        acc.examples_from(base, diff, fields)
        acc.worst_from(base, torch.where(diff, ulp, -1), fields)

    def line(f):
        (gh, gv), (wh, wv) = _native(f["got"], fmt), _native(f["want"], fmt)
        ulp = "n/a" if f["ulp"] < 0 else f["ulp"]
        return f"got {gh} ({gv}) want {wh} ({wv}) ulp={ulp}"

    n_diff, n_class = acc.counts.get("diff", 0), acc.counts.get("class", 0)
    return Report(
        name=name, dtype=fmt.short, shape=shape, n=got.numel(), n_diff=n_diff, max_ulp=acc.max_ulp,
        ulp_hist=dict(zip(ULP_BUCKETS, acc.hist.tolist())), classes_agree=n_class == 0,
        n_class_mismatch=n_class, first_mismatches=_show(acc, locate, line) if n_diff else [],
        tolerance="identical bits", ok=n_diff == 0, context=context, kind="bitwise")


def _mask_chunk(mask: Any, locate: _Locator, shape: tuple[int, ...], i: int, j: int,
                device: torch.device) -> torch.Tensor | bool:
    """Rows [i, j) of a bool mask given as a scalar, a full-shape array or a token mask bool[T]."""
    if isinstance(mask, (bool, np.bool_)):
        return bool(mask)
    if isinstance(mask, torch.Tensor):
        m = mask
    else:
        m = np.asarray(bridge.to_numpy(mask))
        if m.dtype != np.bool_:
            raise TypeError(f"masks must be bool, got {m.dtype=}")
        if m.shape == shape:  # copy just the rows (the mask may be a read-only broadcast view)
            return torch.from_numpy(np.array(m[i:j])).to(device).reshape(-1)
        m = torch.from_numpy(np.array(m))
    if m.dtype != torch.bool:
        raise TypeError(f"masks must be bool, got {m.dtype=}")
    if tuple(m.shape) == shape:
        return m[i:j].to(device).reshape(-1)
    axis = locate.token_axis()
    if m.dim() == 1 and axis is not None and m.shape[0] == shape[axis]:
        rows = list(shape)
        rows[0] = j - i
        view = [1] * len(shape)
        view[axis] = shape[axis]
        full = m.to(device).view(view)
        if axis == 0:
            full = full[i:j]
        return full.expand(rows).reshape(-1)
    raise ValueError(f"mask shape {tuple(m.shape)} is neither the full shape {shape} nor a token mask "
                     f"bool[T] for layout {locate.layout!r}")


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
    got = _as_torch(got)
    if exact_mask is not None:
        exact = exact_mask
    layout = _pick_layout(layout, lse_layout, got.dim())
    context = context or _context(case, seed, mode)
    fmt = _format_of(got.dtype)
    device = got.device
    shape = _shape_of(got)
    _check_pair(got, _shape_of(want), name)
    if mag is not None and _shape_of(mag) != shape:
        raise ValueError(f"{name}: mag shape {_shape_of(mag)} != {shape}")
    if tol is None:  # an LSE layout (given or inferred for 2-D) takes the LSE entry
        lse_like = layout in ("HT", "TH") or (layout is None and got.dim() == 2)
        tol = tolerance_for(got.dtype, lse=lse_like)
    elif isinstance(tol, str):
        tol = TOLERANCES[tol]
    locate = _Locator(shape, layout, query_start_loc, ragged_axis)
    if got.dim() == 0:
        got, shape1 = got.reshape(1), (1,)
        want = np.asarray(bridge.to_numpy(want)).reshape(1)
        mag = None if mag is None else np.asarray(bridge.to_numpy(mag), np.float64).reshape(1)
    else:
        shape1 = shape
    if isinstance(want, np.ndarray):
        want_native = want.dtype == fmt.np_dtype
    else:
        want_native = _as_torch(want).dtype == got.dtype
    acc = _Accumulator(max_shown)
    row_numel = math.prod(shape1[1:]) if len(shape1) > 1 else 1
    for i, j in _row_chunks(shape1[0], row_numel):
        g = got[i:j].reshape(-1)
        w = _chunk_of(want, i, j, device)
        if want_native:
            w_r, w64 = w, w.to(torch.float64)
        else:
            w64 = w.to(torch.float64)
            w_r = w64.to(got.dtype)
        gb, wb = g.view(fmt.int_dtype), w_r.view(fmt.int_dtype)
        gc = value_class(g)
        # Rounding may overflow to inf in IEEE dtypes; torch saturates fp8 casts, so fp8 uses f64 classes.
        wc = value_class(w_r) if fmt.exp_mask is not None else value_class(w64)
        ex = _mask_chunk(exact, locate, shape1, i, j, device)
        ex = torch.full_like(gb, ex, dtype=torch.bool) if isinstance(ex, bool) else ex
        m = w64.abs() if mag is None else _chunk_of(mag, i, j, device).to(torch.float64)

        class_mis = gc != wc
        agree = ~class_mis
        comparable = (gc != NAN) & (wc != NAN)
        bits_diff = gb != wb
        # NaN vs NaN agrees by class unless `want` carries native bits.
        exact_mis = ex & agree & bits_diff & (comparable | want_native)
        floats = ~ex & agree & (gc == FINITE)
        g64 = g.to(torch.float64)
        limit = tol.atol + tol.rtol * m
        err = torch.where(floats, (g64 - w64).abs(), 0.0)
        ratio = torch.where(floats, err / limit, -1.0)
        tol_fail = floats & ~(err <= limit)  # a NaN magnitude fails too
        fail = class_mis | exact_mis | tol_fail
        ulp = torch.where(comparable, (ordered_bits(g) - ordered_bits(w_r)).abs(), -1)

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
        reason = torch.where(class_mis, 0, torch.where(exact_mis, 1, 2)).to(torch.int8)
        fields = dict(got=gb, want=wb, want64=w64, ulp=ulp, ratio=ratio, reason=reason, got_cls=gc, want_cls=wc)
        base = i * row_numel
        acc.examples_from(base, fail, fields)
        acc.worst_from(base, torch.where(fail, ratio, -1.0), fields)

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
    got_t = _as_torch(got)
    query_start_loc, layout = _case_defaults(case, got_t.dim(), query_start_loc, layout)
    report = compare_to_reference(got_t, want, name=name, tol=tol, exact=exact, mag=mag,
                                  query_start_loc=query_start_loc, layout=layout,
                                  context=_context(case, seed, mode))
    if not report.ok:
        raise AssertionError(report.format())
    return report


def assert_bitwise_equal(got: Any, want: Any, *, name: str = "", case: Any = None, seed: Any = None,
                         mode: Any = None, query_start_loc: Any = None, layout: str | None = None) -> Report | None:
    """Raises AssertionError (with `Report.format()`) unless `got` and `want` have identical bits.

    Equal bits return at once (one device-side `torch.equal`); the located report is built only on a mismatch.
    """
    got_t = _as_torch(got)
    want_t = _as_torch(want, got_t.device)
    if (got_t.shape == want_t.shape and got_t.dtype == want_t.dtype
            and torch.equal(raw_bits(got_t), raw_bits(want_t))):
        return None
    query_start_loc, layout = _case_defaults(case, got_t.dim(), query_start_loc, layout)
    report = compare_bits(got_t, want_t, name=name, query_start_loc=query_start_loc, layout=layout,
                          context=_context(case, seed, mode))
    if not report.ok:
        raise AssertionError(report.format())
    return report


__all__ = ["CLASS_NAMES", "FINITE", "NAN", "NEG_INF", "POS_INF", "Report", "TOLERANCES", "Tolerance",
           "ULP_BUCKETS", "assert_bitwise_equal", "assert_matches_reference", "compare_bits",
           "compare_to_reference", "ordered_bits", "raw_bits", "tolerance_for",
           "ulp_distance", "value_class"]
