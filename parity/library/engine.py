"""The comparison engine: implementations pairwise bit for bit, and each one against a reference, bit for bit or
within tolerance. `cross_check` and `python -m parity check` (`parity.harness.check`) both call it; there is no
second copy of the comparisons."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any


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
                    tol = compare.tolerance_for(compare._as_array(got).dtype)
                rep = compare.compare_to_reference(got, reference[key], name=name, layout=layout, tol=tol,
                                                   exact=exact.get(key, False), mag=mag.get(key), **loc)
            out.append((f"{impl}_vs_reference", rep))
    return out


__all__ = ["Locating", "compare_results"]
