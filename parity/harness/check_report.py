"""The records of `python -m parity check` (`parity.harness.check`): which comparisons each operation requires in
each mode (`RULES`), one `OpRecord` per operation of a case, the table and the JSON report."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from parity.harness import cases as cases_mod
from parity.harness import impls, provenance

SCHEMA = "parity-check/2"
KINDS = ("triton_vs_pallas", "pallas_vs_jnp", "triton_vs_torch", "triton_vs_reference", "pallas_vs_reference",
         "jnp_vs_reference", "torch_vs_reference")
N2_KINDS = ("triton_n2_vs_2way", "pallas_n2_vs_2way")  # N = 2 records only
# NVFP4 merges only: each implementation's run with swizzled block scales against its row-major run, bit for bit
# (codes and scales: the layout moves the scales, never a code)
NVFP4_KINDS = ("swizzled_vs_row",)
PAIRS = (("triton", "pallas"), ("pallas", "jnp"), ("triton", "torch"))

RULES = {
    "gpu-bitwise": (
        "GPU, compiled: Triton, Pallas and jnp (XLA) must agree bit for bit (0 differing bits) on every output "
        "of every operation, and at N = 2 the N-way kernels must give the 2-way kernels' bits (docs/spec.md 5, 8); "
        "triton_impl's torch path must give the Triton kernels' bits on every operation too (its division is "
        "the kernels' div.full.f32; measured equal on every record, H100, 2026-12-07); each must also match the "
        "float64 reference, bit for bit where the result is a copy and within the stated tolerance elsewhere."),
    "cpu-interpreters": (
        "CPU, Triton interpreter, Pallas interpret mode, jnp on XLA:CPU and the torch path: the mask must agree bit "
        "for bit between all four; for the merges the differing bits between implementations are reported but not "
        "required, because the interpreters' float math differs (XLA:CPU contracts FMAs and has its own "
        "exp/log, docs/spec.md 5); each implementation must match the float64 reference, bit for bit where "
        "the result is a copy and within the stated tolerance elsewhere."),
}


def _kinds(case: cases_mod.Case, op: str = "") -> tuple[str, ...]:
    return (KINDS + (N2_KINDS if case.partials == 2 else ())
            + (NVFP4_KINDS if case.nvfp4 and op.startswith("merge") else ()))


def _required(mode: str, op: str, case: cases_mod.Case) -> tuple[str, ...]:
    if op == "mask" or mode == "gpu-bitwise":
        return _kinds(case, op)
    return ("triton_vs_reference", "pallas_vs_reference", "jnp_vs_reference", "torch_vs_reference") + (
        NVFP4_KINDS if case.nvfp4 else ())


def dtype_label(case: cases_mod.Case) -> str:
    short = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float8_e4m3fn": "fp8", "float4_e2m1fn": "nvfp4"}
    label = short[case.dtype]
    return label if case.out_dtype is None else f"{label}->{short[case.out_dtype]}"


# ---------------------------------------------------------------------------------------------------------
# Records


@dataclasses.dataclass
class OpRecord:
    """The comparisons of one operation of one case."""

    case: cases_mod.Case
    op: str  # one of impls.OPS
    mode: str
    comparisons: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)  # kind -> array -> Report
    error: str | None = None
    # The explicitly chosen Pallas backend refused the case (NotImplementedError: spec-valid input it documents
    # it cannot run, e.g. Mosaic GPU beyond 64 partials). Not ok and not a parity failure: listed and counted apart.
    unsupported: str | None = None
    elapsed_s: float = 0.0

    @property
    def required(self) -> tuple[str, ...]:
        return _required(self.mode, self.op, self.case)

    @property
    def ok(self) -> bool:
        if self.error is not None or self.unsupported is not None:
            return False
        for kind in self.required:
            if not self.comparisons.get(kind):
                return False
            if not all(r.ok for r in self.comparisons[kind].values()):
                return False
        return True

    @property
    def status(self) -> str:
        if self.unsupported is not None:
            return "UNSUPPORTED"
        return "ERROR" if self.error is not None else ("ok" if self.ok else "FAIL")

    @property
    def failed(self) -> bool:
        """A parity failure or an error; an unsupported record is neither."""
        return not self.ok and self.unsupported is None

    def add(self, kind: str, report) -> None:
        self.comparisons.setdefault(kind, {})[str(report.name)] = report

    def to_dict(self) -> dict[str, Any]:
        c = self.case
        return {
            "case": c.name, "op": self.op, "partials": c.partials or None, "dtype": c.dtype,
            "out_dtype": c.out_dtype or c.dtype, "num_tokens": c.num_tokens, "num_heads": c.num_heads,
            "head_dim": c.head_dim, "num_requests": c.num_requests, "lse_layout": c.lse_layout,
            "lse_base": "2" if c.lse_base == 2 else "e", "head_pad": c.head_pad,
            "prefill_tokens_with_context": c.prefill_tokens_with_context,
            "status": self.status.lower(), "ok": self.ok, "error": self.error, "unsupported": self.unsupported,
            "required": list(self.required),
            "comparisons": {k: {n: r.to_dict() for n, r in v.items()} for k, v in self.comparisons.items()},
            "elapsed_s": round(self.elapsed_s, 3),
        }


def _sum_diff(reports) -> int:
    return int(sum(int(r.n_diff) for r in reports))


def _max_ulp(reports):
    vals = [r.max_ulp for r in reports if r.max_ulp is not None]
    if not vals:
        return None
    return max(float(v) for v in vals)


def _fmt_ulp(v) -> str:
    if v is None:
        return "-"
    if math.isinf(v):
        return "inf"
    return f"{v:.0f}" if float(v).is_integer() else f"{v:.3g}"


def _fmt_vs_ref(rec: OpRecord, kind: str) -> str:
    """`ok (exact)` for bit comparisons; `ok (err/tol 0.41)`: the largest error as a fraction of the tolerance."""
    reports = list(rec.comparisons.get(kind, {}).values())
    if not reports:
        return "-"
    if not all(r.ok for r in reports):
        return f"FAIL ({_sum_diff(r for r in reports if not r.ok)} bad)"
    ratios = [r.max_err_ratio for r in reports if getattr(r, "max_err_ratio", None) is not None]
    return f"ok (err/tol {max(ratios):.2f})" if ratios else "ok (exact)"


def _fmt_bits(rec: OpRecord, kinds) -> tuple[str, bool]:
    """Differing bits summed over `kinds` ("-" when none ran), and whether a '*' (not required) applies."""
    reps = [r for k in kinds for r in rec.comparisons.get(k, {}).values()]
    if not reps:
        return "-", False
    star = not all(k in rec.required for k in kinds if k in rec.comparisons)
    return str(_sum_diff(reps)) + ("*" if star else ""), star


def format_table(records: list[OpRecord]) -> str:
    head = ("case", "op", "N", "dtype", "D", "tri-vs-pal bits", "pal-vs-jnp bits", "tri-vs-torch bits", "N=2 vs 2-way",
            "swizzled vs row", "max ulp", "triton-vs-ref", "pallas-vs-ref", "jnp-vs-ref", "torch-vs-ref", "status")
    rows = [head]
    footnote = False
    for rec in records:
        cells = []
        for kinds in (("triton_vs_pallas",), ("pallas_vs_jnp",), ("triton_vs_torch",), N2_KINDS, NVFP4_KINDS):
            text, star = _fmt_bits(rec, kinds)
            cells.append(text)
            footnote |= star
        tp = list(rec.comparisons.get("triton_vs_pallas", {}).values())
        rows.append((rec.case.name, rec.op, str(rec.case.partials or 2), dtype_label(rec.case),
                     str(rec.case.head_dim), *cells, _fmt_ulp(_max_ulp(tp)) if tp else "-",
                     _fmt_vs_ref(rec, "triton_vs_reference"), _fmt_vs_ref(rec, "pallas_vs_reference"),
                     _fmt_vs_ref(rec, "jnp_vs_reference"), _fmt_vs_ref(rec, "torch_vs_reference"), rec.status))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    right = {2, 4, 5, 6, 7, 8, 9, 10}
    lines = []
    for n, row in enumerate(rows):
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    if footnote:
        lines.append("* reported, not required: the CPU interpreters' float math differs (docs/spec.md 5)")
    for rec in records:
        if rec.error is not None:
            lines.append(f"{rec.case.name} {rec.op}: error: {rec.error}")
        elif not rec.ok:
            for kind in rec.required:
                for r in rec.comparisons.get(kind, {}).values():
                    if not r.ok:
                        lines.append(f"{rec.case.name} {rec.op} {kind}:")
                        lines.append("  " + r.format().replace("\n", "\n  "))
    return "\n".join(lines)



def build_report(rt: impls.Runtime, records: list[OpRecord], *, suite: str, name_filter, seed: int,
                 argv: list[str] | None, shard: tuple[int, int] | None = None) -> dict[str, Any]:
    from parity.library import compare

    n_fail = sum(r.failed for r in records)
    return {
        "schema": SCHEMA,
        "env": provenance.collect_env(argv),
        "mode": rt.mode,
        "rule": RULES[rt.mode],
        "tolerances": {k: v.describe() for k, v in compare.TOLERANCES.items()},
        "suite": suite,
        "filter": name_filter,
        "shard": None if shard is None else f"{shard[0]}/{shard[1]}",
        "seed": seed,
        "summary": {"records": len(records), "failed": n_fail, "ok": n_fail == 0,
                    "unsupported": sum(r.unsupported is not None for r in records),
                    "cases": len({r.case.name for r in records})},
        "records": [r.to_dict() for r in records],
    }
