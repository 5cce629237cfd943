"""The report of `cross_check`: per output, per comparison kind, a `parity.library.compare.Report`; the reference
audit per output; the special-value runs; a table, JSON and a readable text."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import numpy as np

SCHEMA = "parity-cross/2"
KIND_PAIR = "torch_vs_jax"
KIND_SPECIAL = "special_torch_vs_jax"
KINDS = (KIND_PAIR, "torch_vs_reference", "jax_vs_reference", KIND_SPECIAL)


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



@dataclasses.dataclass
class Report:
    """The result of `cross_check`: per output, per comparison kind, a `parity.library.compare.Report`.

    Kinds: "torch_vs_jax" (bit for bit), "torch_vs_reference" and "jax_vs_reference" (with a reference),
    "special_torch_vs_jax" (value classes on the inputs with special values planted, with `special_values`).
    `ok` iff every required comparison passes; "torch_vs_jax" is required with `bitwise=True`, and reported
    either way. `audit`: output -> `parity.library.errormodel.Audit` (with a reference). `special`: the planted
    positions. `notes`: what was done to the outputs (e.g. a cast to the narrower dtype).
    """

    name: str
    device: str
    outputs: dict[str, dict[str, Any]]  # output -> kind -> parity.library.compare.Report
    required: tuple[str, ...]
    axes: dict[str, Any] = dataclasses.field(default_factory=dict)
    inputs: dict[str, str] = dataclasses.field(default_factory=dict)  # input -> "shared" / "copied" / "value"
    audit: dict[str, Any] = dataclasses.field(default_factory=dict)  # output -> errormodel.Audit
    special: list[str] = dataclasses.field(default_factory=list)  # "x[3, 7] = nan", ...
    notes: list[str] = dataclasses.field(default_factory=list)

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
            "required": list(self.required), "inputs": dict(self.inputs), "special": list(self.special),
            "notes": list(self.notes),
            "outputs": {out: {"axes": None if self.axes.get(out) is None else list(self.axes[out]),
                              "audit": (dataclasses.asdict(self.audit[out]) if out in self.audit else None),
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
        kinds = [k for k in KINDS
                 if any(k in v for v in self.outputs.values())]
        head = ("output", "dtype", "shape",
                *("special values" if k == KIND_SPECIAL else k.replace("_vs_", "-vs-") for k in kinds))
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
                elif r.kind == "classes":
                    cells.append(f"{status} ({r.n_diff:,} class mismatches)")
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
        lines += [f"note: {n}" for n in self.notes]
        lines += [f"audit {out}: {a.describe()}" for out, a in self.audit.items()]
        if self.special:
            lines.append("special values planted at: " + ", ".join(self.special))
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


__all__ = ["KIND_PAIR", "KIND_SPECIAL", "Report", "SCHEMA", "jsonable"]
