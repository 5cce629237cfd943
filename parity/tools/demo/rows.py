"""The demos' rows (`python -m parity demo`, also `--cp` and `--backend`): a prefill output compared row by row with
the float64 reference, what each path must show, the verdict and the table."""

from __future__ import annotations

import math

import numpy as np

from parity.tools.chunked_prefill import EMPTY_BEHAVIORS

FRAMEWORKS = ("torch", "jax")
# fp32 end to end; the attention partials and the merges are off the float64 reference by ~1e-6.
TOLERANCE = 1e-3
# bf16 partials (the real GPU kernels): each of the chain's roundings (the partials, then every merge's output) is
# off by up to 2^-9 of a value, and attention outputs of standard-normal V stay within a few units.
TOLERANCE_BF16 = 5e-2
# The behaviour whose unfixed path must show the corruption (the others are handled by the merge).
CORRUPTING_BEHAVIOR = "finite_nan"


def compare_rows(got: np.ndarray, want: np.ndarray, query_start_loc: np.ndarray, *,
                 tolerance: float = TOLERANCE) -> dict:
    """Row-level comparison of a prefill output with the float64 reference.

    A token row is corrupted when any element is NaN or off by more than `tolerance` (absolute).
    Returns rows_corrupted, rows_total, requests_corrupted (indices), max_abs_err (over the non-NaN
    elements; inf if any element is inf), any_nan.
    """
    got = np.asarray(got, dtype=np.float64)
    if got.shape != want.shape:
        raise ValueError(f"{got.shape=} != {want.shape=}")
    err = np.abs(got - want)
    nan = np.isnan(got)
    bad_row = (nan | (err > tolerance)).reshape(got.shape[0], -1).any(axis=1)
    qsl = np.asarray(query_start_loc)
    req_of_token = np.searchsorted(qsl, np.arange(got.shape[0]), side="right") - 1
    finite_err = err[~np.isnan(err)]
    return dict(
        rows_corrupted=int(bad_row.sum()), rows_total=int(got.shape[0]),
        requests_corrupted=sorted({int(r) for r in req_of_token[bad_row]}),
        max_abs_err=float(finite_err.max()) if finite_err.size else math.nan,
        any_nan=bool(nan.any()))


def judge_row(row: dict, got: np.ndarray, want: np.ndarray, new_out: np.ndarray, query_start_loc: np.ndarray,
              ptwc: int | None, expected: str | None, *, tolerance: float = TOLERANCE) -> dict:
    """Fill one table row: the comparison with the reference, the pass-through check, and whether the path did
    what it must (`expected`: "clean", "corrupted", or None for informational rows)."""
    row.update(compare_rows(got, want, query_start_loc, tolerance=tolerance))
    row["passthrough_exact"] = _passthrough_exact(got, new_out, ptwc)
    clean = row["rows_corrupted"] == 0 and not row["any_nan"] and row["passthrough_exact"] is not False
    row["expected"] = expected
    row["ok"] = (expected is None or (expected == "clean" and clean)
                 or (expected == "corrupted" and row["rows_corrupted"] > 0))
    return row


def verdict(rows: list[dict]) -> bool:
    """Every row did what it must, and the demo showed the bug: some row was expected to be corrupted."""
    return all(r["ok"] for r in rows) and any(r["expected"] == "corrupted" for r in rows)


def _passthrough_exact(got: np.ndarray, new_out: np.ndarray, ptwc: int | None) -> bool | None:
    """Rows past `prefill_tokens_with_context` (requests without context) equal the new-token partial's bits."""
    if ptwc is None or ptwc >= got.shape[0]:
        return None
    a = np.ascontiguousarray(got[ptwc:], dtype=np.float32).view(np.uint32)
    b = np.ascontiguousarray(new_out[ptwc:], dtype=np.float32).view(np.uint32)
    return bool(np.array_equal(a, b))



def format_demo_table(rows: list[dict]) -> str:
    """A plain-text table of `run_demo` rows, with a caption line describing the batch."""
    if not rows:
        return "(no rows)"
    r0 = rows[0]
    lines = []
    if "cp" in r0:
        lines.append(f"context-parallel prefill: KV over N={r0['cp']} ranks "
                     f"(token j on rank (j // {r0['interleave']}) % "
                     f"{r0['cp']}), R={r0['num_requests']} T={r0['num_tokens']} H={r0['num_heads']}, "
                     f"{r0['empty_rank_requests']} (rank, request) pairs with context but no local KV, "
                     f"prefill_tokens_with_context={r0['prefill_tokens_with_context']} "
                     f"tolerance={r0['tolerance']:g} (abs, vs float64 monolithic attention)")
    elif "backend" in r0:
        lines.append(f"chunked-context prefill on a real attention kernel: {r0['kernel']}, {r0['dtype']}; "
                     f"R={r0['num_requests']} T={r0['num_tokens']} H={r0['num_heads']} chunks={r0['num_chunks']} "
                     f"budget={r0['budget']} prefill_tokens_with_context={r0['prefill_tokens_with_context']}, "
                     f"{r0['both_empty_tokens']} tokens empty in every chunk; empty rows left by the kernel: "
                     f"LSE {r0['observed']['lse']}, output rows {r0['observed']['out_rows']}; "
                     f"tolerance={r0['tolerance']:g} (abs, vs float64 monolithic attention)")
    elif "num_chunks" in r0:
        lines.append(f"chunked-context prefill: R={r0['num_requests']} T={r0['num_tokens']} H={r0['num_heads']} "
                     f"chunks={r0['num_chunks']} budget={r0['budget']} has_empty={r0['has_empty']} "
                     f"prefill_tokens_with_context={r0['prefill_tokens_with_context']} "
                     f"tolerance={r0['tolerance']:g} (abs, vs float64 monolithic attention)")
    header = ("framework", "device", "empty rows", "path", "corrupted rows", "requests", "max abs err*", "NaN",
              "pass-through", "expected", "result")

    def cell(r):
        beh = EMPTY_BEHAVIORS.get(r["empty_behavior"])
        lse = "" if beh is None else f" (lse {beh.lse:g})"
        if "observed" in r:  # a real kernel: what it left in empty rows
            lse = " (lse " + "/".join(k for k, n in r["observed"]["lse"].items() if n) + ", out " + \
                  "/".join(k for k, n in r["observed"]["out_rows"].items() if n) + ")"
        pt = {None: "-", True: "exact", False: "DIFFERS"}[r["passthrough_exact"]]
        reqs = r["requests_corrupted"]
        reqs_s = "-" if not reqs else ",".join(map(str, reqs[:8])) + (",..." if len(reqs) > 8 else "")
        result = "info" if r["expected"] is None else ("ok" if r["ok"] else "FAIL")
        return (r["framework"], r.get("device", ""), r["empty_behavior"] + lse, r["path"],
                f"{r['rows_corrupted']}/{r['rows_total']}", reqs_s, f"{r['max_abs_err']:.2e}",
                "yes" if r["any_nan"] else "no", pt, r["expected"] or "-", result)

    body = [cell(r) for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(header)]
    right = {4, 6}  # numeric columns

    def fmt(cells):
        padded = (c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
        return "  ".join(padded).rstrip()

    lines += [fmt(header), fmt(["-" * w for w in widths])] + [fmt(b) for b in body]
    lines.append("* over the elements that are not NaN; a NaN element corrupts its row (column NaN).")
    return "\n".join(lines)
