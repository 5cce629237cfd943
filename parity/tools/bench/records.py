"""The benchmark's JSON records (`python -m parity bench`): one record per point, implementation and metric, and
the document written after every point."""

from __future__ import annotations

import json
import os

SCHEMA = 2  # the JSON schema's version (docs/design.md says what each version changed)


def record(op, impl, workload, T, H, D, dtype, variant, metric, timing, nbytes, ceiling_tbps, note=None,
           layout=None):
    """One JSON record; `layout`: {lse_layout, lse_base, partials_view} (None where it does not apply)."""
    q, method, n = timing
    p50 = q[1]
    tbps = nbytes / (p50 * 1e-6) / 1e12 if p50 > 0 else None
    frac = tbps / ceiling_tbps if (tbps is not None and ceiling_tbps) else None
    rec = {"op": op, "impl": impl, "workload": workload, "T": T, "H": H, "D": D, "dtype": dtype,
           "variant": variant, "metric": metric, "unit": "us", "method": method,
           "p20": q[0], "p50": q[1], "p80": q[2], "bytes": int(nbytes), "tbps": tbps, "frac_ceiling": frac,
           "n": n, "note": note}
    rec.update(layout or {"lse_layout": None, "lse_base": None, "partials_view": None})
    return rec


def write_json(doc: dict, path: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)
