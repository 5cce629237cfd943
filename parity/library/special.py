"""Special values on request (`cross_check(..., special_values=True)`): copies of the float inputs with NaN, +inf,
-inf, -0.0 and a subnormal planted at reported positions, and the comparison of the value classes (finite,
+inf, -inf, NaN) of two outputs, located like every other comparison."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from parity.library.bits import CLASS_NAMES, _as_torch, _format_of, _native, value_class
from parity.library.compare import Report
from parity.library.errormodel import is_float_array
from parity.library.scan import ULP_BUCKETS, MAX_SHOWN, _Accumulator, _Locator, _row_chunks, _shape_of, _show

KINDS = ("nan", "+inf", "-inf", "-0.0", "subnormal")
SEED = 0x5BEC


def _value(kind: str, dtype: np.dtype) -> float:
    if kind == "subnormal":
        import ml_dtypes  # its finfo also knows bfloat16 and the fp8 dtypes (numpy's refuses them from numpy 2.5)

        return float(ml_dtypes.finfo(dtype).smallest_normal) / 2
    return {"nan": float("nan"), "+inf": float("inf"), "-inf": float("-inf"), "-0.0": -0.0}[kind]


def plant(n_args: Mapping[Any, Any], per_kind: int = 1, seed: int = SEED) -> tuple[dict[Any, Any], list[str]]:
    """(copies of `n_args` with `per_kind` elements of each of `KINDS` planted in every float array, the
    positions as "name[i, j] = kind"). Positions are distinct within an array and drawn from a seeded generator;
    a dtype without infinities (float8_e4m3fn) gets NaN where an infinity would go."""
    rng = np.random.default_rng(seed)
    out, where = dict(n_args), []
    for k, v in n_args.items():
        if not is_float_array(v) or v.size == 0:
            continue
        a = np.array(v)
        n = min(a.size, per_kind * len(KINDS))
        flat = rng.choice(a.size, size=n, replace=False)
        for i, f in enumerate(flat):
            kind = KINDS[i % len(KINDS)]
            if kind in ("+inf", "-inf") and not np.isinf(np.array(_value(kind, a.dtype), a.dtype)):
                kind = "nan"
            idx = np.unravel_index(int(f), a.shape)
            a[idx] = _value(kind, a.dtype)
            where.append(f"{k}[{', '.join(str(int(j)) for j in idx)}] = {kind}")
        out[k] = a
    return out, where


def compare_classes(got: Any, want: Any, *, name: str = "", layout: Any = None, query_start_loc: Any = None,
                    ragged_axis: str = "token", context: str = "", max_shown: int = MAX_SHOWN) -> Report:
    """The value classes of two arrays of one shape (any compared float dtypes), element by element."""
    got = _as_torch(got)
    want = _as_torch(want, got.device)
    shape = _shape_of(got)
    if _shape_of(want) != shape:
        raise ValueError(f"{name}: shapes differ: {shape} vs {_shape_of(want)}")
    fg, fw = _format_of(got.dtype), _format_of(want.dtype)
    locate = _Locator(shape, layout, query_start_loc, ragged_axis)
    g_all, w_all = (got.reshape(1), want.reshape(1)) if got.dim() == 0 else (got, want)
    acc = _Accumulator(max_shown)
    row_numel = int(np.prod(shape[1:])) if len(shape) > 1 else 1
    for i, j in _row_chunks(g_all.shape[0], row_numel):
        g, w = g_all[i:j].reshape(-1), w_all[i:j].reshape(-1)
        gc, wc = value_class(g), value_class(w)
        mis = gc != wc
        acc.count("class", mis)
        fields = dict(got=g.view(fg.int_dtype), want=w.view(fw.int_dtype), gc=gc, wc=wc)
        acc.examples_from(i * row_numel, mis, fields)

    def line(f):
        (gh, gv), (wh, wv) = _native(f["got"], fg), _native(f["want"], fw)
        return f"got {gh} ({gv}) want {wh} ({wv}): classes {CLASS_NAMES[f['gc']]} vs {CLASS_NAMES[f['wc']]}"

    n_cls = acc.counts.get("class", 0)
    return Report(name=name, dtype=fg.short, shape=shape, n=int(np.prod(shape)) if shape else 1, n_diff=n_cls,
                  max_ulp=None, ulp_hist=dict.fromkeys(ULP_BUCKETS, 0), classes_agree=n_cls == 0,
                  n_class_mismatch=n_cls, first_mismatches=_show(acc, locate, line) if n_cls else [],
                  tolerance="same value class", ok=n_cls == 0, context=context, kind="classes")


def as_narrower(a: Any, b: Any) -> tuple[torch.Tensor, torch.Tensor, str | None]:
    """(a, b) as torch tensors of one dtype: the one with more mantissa bits rounded (to nearest) to the other's
    dtype, and which was cast ("a fp32 -> bf16"; None when the dtypes agree)."""
    ta, tb = _as_torch(a), _as_torch(b)
    if ta.dtype == tb.dtype:
        return ta, tb, None
    fa, fb = _format_of(ta.dtype), _format_of(tb.dtype)
    if fa.unit_roundoff >= fb.unit_roundoff:
        return ta, tb.to(ta.device).to(ta.dtype), f"b {fb.short} -> {fa.short}"
    return ta.to(tb.dtype), tb.to(ta.device), f"a {fa.short} -> {fb.short}"


__all__ = ["KINDS", "as_narrower", "compare_classes", "plant"]
