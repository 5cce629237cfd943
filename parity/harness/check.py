"""`python -m parity check`: run every implementation on a suite of `parity.harness.cases` and compare them.

For every case the numpy inputs (`cases.make_inputs` / `make_inputs_n`) are uploaded once to torch and
shared with JAX over DLPack (`parity.library.bridge.share_inputs`, zero-copy). Every implementation runs through
`parity.harness.impls` (reference, triton, pallas, jnp). The operations (`impls.OPS`):

- 2-way cases: `mask` (the prefix LSE, zeroing the prefix output; docs/spec.md 3); `merge` (each
  implementation merges its own masked prefix with the suffix: mask then merge, 4); `merge_fused` (the raw
  prefix with the fused mask, 4.5), for cases with an empty request;
- N-way cases (8): `merge_n` (the partials with the reference-masked LSEs: their NaN garbage stays, under
  -inf) and `merge_n_fused` (the raw partials with each partial's KV offsets). At N = 2 both must also give
  the bits of the 2-way kernels on the same partials.

Each result is compared bit for bit between implementations (`parity.library.compare.compare_bits`: Triton vs Pallas,
Pallas vs jnp) and with the float64 reference (`parity.library.compare.compare_to_reference`): exactly where the
result is a bit copy (`parity.harness.expected.exact_masks`), within tolerance elsewhere, measured against
`parity.harness.expected.magnitude`. Which comparisons are required depends on the mode (docs/spec.md 5): `RULES`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from typing import Any

import numpy as np

from parity.harness import cases as cases_mod
from parity.harness import expected, impls, provenance
from parity.library.crosscheck import jsonable

SCHEMA = "parity-check/2"
KINDS = ("triton_vs_pallas", "pallas_vs_jnp", "triton_vs_reference", "pallas_vs_reference", "jnp_vs_reference")
N2_KINDS = ("triton_n2_vs_2way", "pallas_n2_vs_2way")  # N = 2 records only
PAIRS = (("triton", "pallas"), ("pallas", "jnp"))

RULES = {
    "gpu-bitwise": (
        "GPU, compiled: Triton, Pallas and jnp (XLA) must agree bit for bit (0 differing bits) on every output "
        "of every operation, and at N = 2 the N-way kernels must give the 2-way kernels' bits (docs/spec.md 5, 8); "
        "each must also match the float64 reference, bit for bit where the result is a copy and within the "
        "stated tolerance elsewhere."),
    "cpu-interpreters": (
        "CPU, Triton interpreter, Pallas interpret mode and jnp on XLA:CPU: the mask must agree bit for bit "
        "between all three; for the merges the differing bits between implementations are reported but not "
        "required, because the interpreters' float math differs (XLA:CPU contracts FMAs and has its own "
        "exp/log, docs/spec.md 5); each implementation must match the float64 reference, bit for bit where "
        "the result is a copy and within the stated tolerance elsewhere."),
}


def _kinds(case: cases_mod.Case) -> tuple[str, ...]:
    return KINDS + (N2_KINDS if case.partials == 2 else ())


def _required(mode: str, op: str, case: cases_mod.Case) -> tuple[str, ...]:
    if mode == "gpu-bitwise" or op == "mask":
        return _kinds(case)
    return ("triton_vs_reference", "pallas_vs_reference", "jnp_vs_reference")


def dtype_label(case: cases_mod.Case) -> str:
    short = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float8_e4m3fn": "fp8"}
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
    elapsed_s: float = 0.0

    @property
    def required(self) -> tuple[str, ...]:
        return _required(self.mode, self.op, self.case)

    @property
    def ok(self) -> bool:
        if self.error is not None:
            return False
        for kind in self.required:
            if not self.comparisons.get(kind):
                return False
            if not all(r.ok for r in self.comparisons[kind].values()):
                return False
        return True

    @property
    def status(self) -> str:
        return "ERROR" if self.error is not None else ("ok" if self.ok else "FAIL")

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
            "status": self.status.lower(), "ok": self.ok, "error": self.error,
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
    head = ("case", "op", "N", "dtype", "D", "tri-vs-pal bits", "pal-vs-jnp bits", "N=2 vs 2-way", "max ulp",
            "triton-vs-ref", "pallas-vs-ref", "jnp-vs-ref", "status")
    rows = [head]
    footnote = False
    for rec in records:
        cells = []
        for kinds in (("triton_vs_pallas",), ("pallas_vs_jnp",), N2_KINDS):
            text, star = _fmt_bits(rec, kinds)
            cells.append(text)
            footnote |= star
        tp = list(rec.comparisons.get("triton_vs_pallas", {}).values())
        rows.append((rec.case.name, rec.op, str(rec.case.partials or 2), dtype_label(rec.case),
                     str(rec.case.head_dim), *cells, _fmt_ulp(_max_ulp(tp)) if tp else "-",
                     _fmt_vs_ref(rec, "triton_vs_reference"), _fmt_vs_ref(rec, "pallas_vs_reference"),
                     _fmt_vs_ref(rec, "jnp_vs_reference"), rec.status))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    right = {2, 4, 5, 6, 7, 8}
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


# ---------------------------------------------------------------------------------------------------------
# One case


def _error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


class _Judge:
    """Adds the comparisons of one record: implementations pairwise bit for bit, each one against the reference.

    Every comparison goes through `parity.library.crosscheck.compare_results`, the engine of `parity.cross_check`.
    """

    def __init__(self, rt: impls.Runtime, case: cases_mod.Case, seed: int, query_start_loc):
        from parity.library import compare, crosscheck

        self.engine = crosscheck.compare_results
        self.locating = crosscheck.Locating(query_start_loc, context=compare._context(case.name, seed, rt.mode))
        self.lse_layout = case.lse_layout

    def _axes(self, x) -> str | None:
        """[T, H, D] outputs "THD", [H, T] / [T, H] LSEs the case's layout."""
        return self.lse_layout if len(x.shape) == 2 else None

    def _run(self, rec: OpRecord, results, key: str, op: str, **kw) -> None:
        axes = {key: self._axes(next(iter(results.values()))[key])}
        for kind, report in self.engine(results, [key], locating=self.locating, axes=axes, prefix=f"{op}.", **kw):
            rec.add(kind, report)

    def bits(self, rec: OpRecord, kind: str, got, want, name: str) -> None:
        op, _, key = name.partition(".")
        axes = {key: self._axes(got)}
        for _, report in self.engine({"got": {key: got}, "want": {key: want}}, [key], pairs=[("got", "want")],
                                     locating=self.locating, axes=axes, prefix=f"{op}."):
            rec.add(kind, report)

    def all_bits(self, rec: OpRecord, results: dict[str, dict], key: str, op: str, want=None) -> None:
        self._run(rec, results, key, op, pairs=PAIRS, reference=None if want is None else {key: want},
                  reference_bitwise=True, against=impls.KERNEL_IMPLS)

    def to_reference(self, rec: OpRecord, results: dict[str, dict], key: str, op: str, want, exact, *, tol=None,
                     mag=None) -> None:
        self._run(rec, results, key, op, pairs=(), reference={key: want}, against=impls.KERNEL_IMPLS,
                  tolerance={key: tol}, exact={key: exact}, mag={key: mag})


def _shared(rt: impls.Runtime, inputs: dict[str, np.ndarray]) -> dict[str, dict[str, Any]]:
    """The inputs of every implementation: numpy for the reference, one device buffer for the others."""
    from parity.library import bridge

    t, j = bridge.share_inputs(inputs, rt.device)
    return {"reference": inputs, "triton": t, "pallas": j, "jnp": j}


def _judge_merge(rec: OpRecord, judge: _Judge, case: cases_mod.Case, op: str, results: dict,
                 ref_arrays: dict[str, np.ndarray]) -> None:
    """The comparisons of a merge record: pairwise bits, and each implementation against the reference."""
    D = case.head_dim
    w = expected.merge_weights(case, op, ref_arrays)
    mag = expected.magnitude(case, op, ref_arrays, w)
    out_exact, lse_exact = expected.exact_masks(case, w)
    ref = results["reference"]
    judge.all_bits(rec, results, "out", op)
    judge.all_bits(rec, results, "lse", op)
    judge.to_reference(rec, results, "out", op, ref["out"], np.broadcast_to(out_exact[..., None], mag.shape), mag=mag)
    judge.to_reference(rec, results, "lse", op, ref["lse"], lse_exact, tol="lse")
    if case.head_pad:  # the columns past D of Triton's output buffer keep their NaN poison
        pad = results["triton"]["out_buffer"][..., D:]
        judge.bits(rec, "triton_vs_reference", pad, impls.poisoned(pad.shape, case.out_dtype or case.dtype, pad.device),
                   f"{op}.out[pad]")


def run_case(rt: impls.Runtime, case: cases_mod.Case, seed: int, on_record=None) -> list[OpRecord]:
    """Run the operations of one case; `on_record(rec)` is called as each finishes.

    Results stay on the device (torch tensors, JAX arrays): `parity.library.compare` scans them there in chunks.
    """
    records: list[OpRecord] = []

    def finish(rec: OpRecord, t0: float) -> None:
        rec.elapsed_s = time.perf_counter() - t0
        records.append(rec)
        if on_record is not None:
            on_record(rec)

    if case.n_way:
        _run_n_way(rt, case, seed, finish)
    else:
        _run_two_way(rt, case, seed, finish)
    return records


def _run_two_way(rt, case, seed, finish) -> None:
    D = case.head_dim
    inputs = cases_mod.make_inputs(case, seed)
    arrays = _shared(rt, inputs)
    judge = _Judge(rt, case, seed, inputs["query_start_loc"])

    # ---- mask (docs/spec.md 3): bit-exact everywhere
    t0 = time.perf_counter()
    rec = OpRecord(case, "mask", rt.mode)
    masked: dict[str, dict] = {}
    try:
        masked = {impl: impls.run(rt, impl, "mask", case, arrays[impl]) for impl in impls.IMPLS}
        judge.all_bits(rec, masked, "lse", "mask", masked["reference"]["lse"])
        judge.all_bits(rec, masked, "output", "mask", masked["reference"]["output"])
        if case.head_pad:  # the columns past D of the V-padded buffer are not the mask's to touch
            judge.bits(rec, "triton_vs_reference", masked["triton"]["output_buffer"][..., D:],
                       inputs["prefix_output"][..., D:], "mask.output[pad]")
    except Exception as e:  # noqa: BLE001 - one broken case must not hide the others
        rec.error = _error_text(e)
    finish(rec, t0)

    # ---- merge: mask then merge (each implementation merges its own masked prefix), then the fused mask
    for op in impls.ops_of(case)[1:]:
        t0 = time.perf_counter()
        rec = OpRecord(case, op, rt.mode)
        try:
            if op == "merge":
                if len(masked) < len(impls.IMPLS):
                    raise RuntimeError("the mask failed, so mask-then-merge has no input")
                ops = {impl: dict(arrays[impl], prefix_output=masked[impl]["output"], prefix_lse=masked[impl]["lse"])
                       for impl in impls.IMPLS}
            else:
                ops = arrays
            results = {impl: impls.run(rt, impl, op, case, ops[impl]) for impl in impls.IMPLS}
            _judge_merge(rec, judge, case, op, results, ops["reference"])
        except Exception as e:  # noqa: BLE001
            rec.error = _error_text(e)
        finish(rec, t0)


def _run_n_way(rt, case, seed, finish) -> None:
    inputs = cases_mod.make_inputs_n(case, seed)
    inputs["masked_lses"] = impls.masked_lses(case, inputs)
    arrays = _shared(rt, inputs)
    judge = _Judge(rt, case, seed, inputs["query_start_loc"])
    for op in impls.ops_of(case):
        t0 = time.perf_counter()
        rec = OpRecord(case, op, rt.mode)
        try:
            ops = arrays if op == "merge_n_fused" else {
                impl: dict(arrays[impl], lses=arrays[impl]["masked_lses"]) for impl in impls.IMPLS}
            results = {impl: impls.run(rt, impl, op, case, ops[impl]) for impl in impls.IMPLS}
            _judge_merge(rec, judge, case, op, results, ops["reference"])
            if case.partials == 2:
                _n2_vs_two_way(rt, rec, judge, case, op, arrays, results)
        except Exception as e:  # noqa: BLE001
            rec.error = _error_text(e)
        finish(rec, t0)


def _n2_vs_two_way(rt, rec, judge, case, op, arrays, results) -> None:
    """docs/spec.md 8: at N = 2 the N-way kernel gives the 2-way kernel's bits. The 2-way fused mask covers the
    prefix only, so partial 1 goes in with its reference-masked LSE (the mask is exact)."""
    two_way_op = "merge_fused" if op == "merge_n_fused" else "merge"
    for impl in ("triton", "pallas"):
        a = arrays[impl]
        lses = a["lses"] if op == "merge_n_fused" else a["masked_lses"]
        two = dict(prefix_output=a["outputs"][0], prefix_lse=lses[0], suffix_output=a["outputs"][1],
                   suffix_lse=a["masked_lses"][1], query_start_loc=a["query_start_loc"],
                   cu_seq_lens=a["cu_seq_lens"][0], output_scale=a.get("output_scale"))
        got = impls.run(rt, impl, two_way_op, case, two)
        for key in ("out", "lse"):
            judge.bits(rec, f"{impl}_n2_vs_2way", results[impl][key], got[key], f"{op}.{key}")


# ---------------------------------------------------------------------------------------------------------
# The command


def count_ops(selected) -> int:
    return sum(len(impls.ops_of(c)) for c in selected)


def select(suite: str, name_filter: str | None, shard: tuple[int, int] | None = None) -> list:
    """The cases of a check run: the suite's, filtered by name, then every N-th from the K-th with shard=(K, N)."""
    selected = cases_mod.select(suite, name_filter, kind="all")
    return selected if shard is None else selected[shard[0]::shard[1]]


def run_check(*, suite: str, name_filter: str | None, seed: int, quiet: bool = False, shard=None,
              progress=None) -> tuple[impls.Runtime, list[OpRecord]]:
    selected = select(suite, name_filter, shard)
    rt = impls.make_runtime()
    total = count_ops(selected)
    records: list[OpRecord] = []

    def on_record(rec: OpRecord) -> None:
        records.append(rec)
        if not quiet:
            line = (f"[{len(records)}/{total}] {rec.case.name} {rec.op} {dtype_label(rec.case)} "
                    f"D={rec.case.head_dim} {rec.status} ({rec.elapsed_s:.1f}s)")
            print(line, file=progress or sys.stderr, flush=True)

    for case in selected:
        run_case(rt, case, seed, on_record)
    return rt, records


def build_report(rt: impls.Runtime, records: list[OpRecord], *, suite: str, name_filter, seed: int,
                 argv: list[str] | None, shard: tuple[int, int] | None = None) -> dict[str, Any]:
    from parity.library import compare

    n_fail = sum(not r.ok for r in records)
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
                    "cases": len({r.case.name for r in records})},
        "records": [r.to_dict() for r in records],
    }


def main(args) -> int:
    """Handler of `python -m parity check` (args from parity.cli)."""
    shard = getattr(args, "shard", None)
    selected = select(args.suite, args.name_filter, shard)
    if not selected:
        print(f"error: no case in suite {args.suite!r} matches -k {args.name_filter!r}"
              + (f" in shard {shard[0]}/{shard[1]}" if shard else ""), file=sys.stderr)
        return 2
    rt, records = run_check(suite=args.suite, name_filter=args.name_filter, seed=args.seed, quiet=args.quiet,
                            shard=shard)
    print(format_table(records))
    ok = all(r.ok for r in records)
    print(f"{rt.mode}: {sum(r.ok for r in records)}/{len(records)} ok" + ("" if ok else " -- PARITY FAILURE"))
    if args.json:
        report = build_report(rt, records, suite=args.suite, name_filter=args.name_filter, seed=args.seed,
                              argv=getattr(args, "argv", None), shard=shard)
        with open(args.json, "w") as f:
            json.dump(jsonable(report), f, indent=1)
            f.write("\n")
    return 0 if ok else 1
