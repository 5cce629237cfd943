"""`verify`: run one implementation (this project's through `parity.harness.impls`, a port's callable, or a port's
results files) on the golden inputs and compare with the expected results through `parity.library`'s comparison
engine: the mask bit for bit; the merges bit for bit where the result is a copy (`*_exact`) and elsewhere within
the tolerance written in the manifest (`|got - want| <= atol + rtol * mag`)."""

from __future__ import annotations

import os
import zipfile
from typing import Any

import numpy as np

from parity.harness import expected, impls, provenance, reference
from parity.harness.golden.store import (OPS, GoldenError, _np_dtype, case_from_params, case_params, load_case,
                                         load_manifest, to_stored)
from parity.library.loading import load_callable


# ---------------------------------------------------------------------------------------------------------
# Verify


def _operands(case, a: dict[str, np.ndarray], op: str) -> dict[str, np.ndarray]:
    """The numpy arrays `op` runs on (`impls.op_call`): "merge" reads the masked prefix (in a buffer with the
    case's head pad), "merge_n" the masked LSEs."""
    inputs = {k: v for k, v in a.items() if "." not in k}
    if op == "merge":
        masked = np.array(a["prefix_output"], copy=True)
        masked[..., :case.head_dim] = a["mask.output"]
        inputs.update(prefix_output=masked, prefix_lse=a["mask.lse"])
    elif op == "merge_n":
        inputs["lses"] = a["masked_lses"]
    return inputs


PORT_INPUTS = {
    "mask": ("lse", "query_start_loc", "cu_seq_lens", "output"),
    "merge": ("prefix_output", "prefix_lse", "suffix_output", "suffix_lse", "query_start_loc", "output_scale"),
    "merge_fused": ("prefix_output", "prefix_lse", "suffix_output", "suffix_lse", "query_start_loc",
                    "prefix_cu_seq_lens", "output_scale"),
    "merge_n": ("outputs", "lses", "query_start_loc", "output_scale"),
    "merge_n_fused": ("outputs", "lses", "query_start_loc", "cu_seq_lens", "output_scale"),
}
"""The arrays a port's callable receives per op (docs/porting.md): output buffers may be wider than head_dim
(columns past D are padding), the 2-way "merge" gets the masked prefix, "merge_n" the masked LSEs."""


def port_inputs(case, a: dict[str, np.ndarray], op: str) -> dict[str, np.ndarray]:
    """The numpy inputs of `op` under the names of `PORT_INPUTS` (a copy: a port may write them)."""
    ops = _operands(case, a, op)
    named = dict(ops, lse=ops.get("prefix_lse"), output=ops.get("prefix_output"),
                 prefix_cu_seq_lens=ops.get("cu_seq_lens"))
    return {k: np.array(named[k], copy=True) for k in PORT_INPUTS[op] if named.get(k) is not None}


def _result_shapes(case, op: str) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    T, H, D = case.num_tokens, case.num_heads, case.head_dim
    lse_shape = (H, T) if case.lse_layout == "HT" else (T, H)
    if op == "mask":
        return {"lse": (lse_shape, np.dtype(np.float32)), "output": ((T, H, D), _np_dtype(case.dtype))}
    shapes = {"out": ((T, H, D), _np_dtype(case.out_dtype or case.dtype)), "lse": (lse_shape, np.dtype(np.float32))}
    if case.group_size:  # per-group FP8 (docs/spec.md 4.7)
        shapes["scales"] = ((T, H * D // case.group_size), np.dtype(np.float32))
    if case.nvfp4:  # NVFP4 (4.8): the packed codes, two a byte, and the row-major e4m3 block scales
        shapes["out"] = ((T, H, D // 2), np.dtype(np.uint8))
        shapes["scales"] = ((T, H * D // 16), _np_dtype("float8_e4m3fn"))
    return shapes


def _values(case, results: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A port's NVFP4 results with their packed codes as values f32[T, H, D] (docs/spec.md 4.8: the codes' e2m1
    values, the block's units); other results as they are."""
    if not case.nvfp4 or "out" not in results:
        return results
    return dict(results, out=reference.fp4_values(reference.unpack_fp4(results["out"])))


def _as_result(case, op: str, key: str, x) -> np.ndarray:
    """A port's result as the typed array it must be: the right dtype, or the unsigned integers of its bits."""
    shape, dtype = _result_shapes(case, op)[key]
    x = np.asarray(x)
    if x.dtype.kind == "u" and x.dtype.itemsize == dtype.itemsize:
        x = x.view(dtype)
    if x.dtype != dtype or tuple(x.shape) != shape:
        raise GoldenError(f"{op}.{key} must be {dtype.name}{list(shape)} (or its bits as uint{8 * dtype.itemsize}); "
                          f"got {x.dtype.name}{list(x.shape)}")
    return x


class Runner:
    """Runs one implementation: this project's through `parity.harness.impls` (as `python -m parity check`), a port's
    callable `fn(op, inputs, params) -> dict` (`impl="module:function"` or `"path/to/file.py:function"`), or a
    port's results read from files (`outputs_dir`)."""

    def __init__(self, impl: str | None = None, *, fn=None, outputs_dir: str | None = None):
        self.impl = impl or ("outputs" if outputs_dir else getattr(fn, "__name__", "port"))
        self.fn, self.outputs_dir, self._files = fn, outputs_dir, {}
        if fn is None and outputs_dir is None and impl is not None and ":" in impl:
            self.fn = load_callable(impl)
        self.rt = impls.HOST if impl == "reference" or self.fn or outputs_dir else impls.make_runtime()

    def run(self, case, a: dict, op: str, params: dict | None = None) -> dict[str, Any]:
        if self.fn is not None:
            got = self.fn(op, port_inputs(case, a, op), dict(params or case_params(case, 0)))
            return _values(case, {k: _as_result(case, op, k, got[k]) for k in _result_shapes(case, op)})
        if self.outputs_dir is not None:
            return _values(case, self._read(case, op))
        inputs = _operands(case, a, op)
        if self.impl == "reference":
            got = impls.run(self.rt, "reference", op, case, inputs)
            if case.nvfp4 and op != "mask":  # 4.8: the values of the e2m1 codes of the quotients
                got = dict(got, out=reference.e2m1_values(got["out"]),
                           lse=got["lse"].astype(np.float32))
            elif op != "mask":  # the reference leaves the final rounding to the caller (docs/spec.md 4.6 for fp8)
                got = dict(got, out=got["out"].astype(_np_dtype(case.out_dtype or case.dtype)),
                           lse=got["lse"].astype(np.float32))
            return got
        from parity.library import bridge

        t, j = bridge.share_inputs(inputs, self.rt.device)
        return impls.run(self.rt, self.impl, op, case, t if self.impl == "triton" else j)

    def _read(self, case, op: str) -> dict[str, np.ndarray]:
        path = os.path.join(self.outputs_dir, f"{case.name}.npz")
        if case.name not in self._files:
            if not os.path.exists(path):
                raise GoldenError(f"no results file {path} for case {case.name}")
            try:
                with np.load(path, allow_pickle=False) as z:
                    self._files[case.name] = {k: z[k] for k in z.files}
            except (zipfile.BadZipFile, EOFError, ValueError, OSError) as e:
                raise GoldenError(f"{path} is not a readable .npz (truncated or corrupt): {type(e).__name__}: "
                                  f"{e}") from None
        f = self._files[case.name]
        missing = [f"{op}.{k}" for k in _result_shapes(case, op) if f"{op}.{k}" not in f]
        if missing:
            raise GoldenError(f"{path} lacks {missing}")
        return {k: _as_result(case, op, k, f[f"{op}.{k}"]) for k in _result_shapes(case, op)}


def save_outputs(out_dir: str, case_name: str, results: dict[str, dict[str, np.ndarray]]) -> str:
    """Write a port's results of one case as `verify --outputs` reads them: `<out_dir>/<case>.npz`, one array
    `<op>.<result>` each, stored as the unsigned integers of its bits (docs/porting.md, "Results files")."""
    os.makedirs(out_dir, exist_ok=True)
    arrays = {f"{op}.{key}": to_stored(np.asarray(x))[0] for op, r in results.items() for key, x in r.items()}
    path = os.path.join(out_dir, f"{case_name}.npz")
    np.savez(path, **arrays)
    return path


def verify_case(entry: dict[str, Any], a: dict[str, np.ndarray], runner: Runner, tolerances: dict[str, dict]):
    """Runs the ops of one case; returns [(op, {array: Report}, error or None)].

    Every comparison goes through `parity.library.crosscheck.compare_results`, the engine of `check` and
    `parity.cross_check`: the mask's results bit for bit with `mask.*`, the merges' with `merge.*` (exact where
    `*_exact`, elsewhere within the manifest's tolerances, measured against `parity.harness.expected.magnitude`).
    """
    from parity.library import compare, crosscheck

    case = case_from_params(entry["name"], entry["params"])
    out_dtype = case.out_dtype or case.dtype
    locating = crosscheck.Locating(a["query_start_loc"], context=compare._context(
        case.name, entry["params"]["seed"], f"golden-{runner.impl}"))

    def axes(results):  # [T, H, D] outputs "THD", [H, T] / [T, H] LSEs the case's layout
        return {k: case.lse_layout if len(x.shape) == 2 else None for k, x in results.items()}

    results = []
    for op in entry.get("ops", OPS):
        reports: dict[str, Any] = {}
        try:
            got = runner.run(case, a, op, entry["params"])
            if op == "mask":
                want = {k: a[f"mask.{k}"] for k in ("lse", "output")}
                compared = crosscheck.compare_results({"got": got, "want": want}, ["lse", "output"],
                                                      pairs=[("got", "want")], locating=locating, axes=axes(want),
                                                      prefix="mask.")
            else:
                arrays = _operands(case, a, "merge_n" if case.n_way else "merge")
                mag = expected.magnitude(case, "merge_n" if case.n_way else "merge", arrays, a["merge.weights"])
                want = {"out": a["merge.out"], "lse": a["merge.lse"]}
                tolerance = {"out": compare.Tolerance(**tolerances[out_dtype]),
                             "lse": compare.Tolerance(**tolerances["lse"])}
                keys = ["out", "lse"]
                if case.group_size:  # docs/spec.md 4.7: the magnitude in each group's units, and the scales
                    T, H, D = mag.shape
                    mag = (mag.reshape(T, -1, case.group_size) / a["merge.scales"][..., None]).reshape(T, H, D)
                    want["scales"] = a["merge.scales"]
                    tolerance["scales"] = compare.Tolerance(**tolerances["float32"])
                    keys.append("scales")
                if case.nvfp4:  # 4.8: the magnitude and the codes' values in the reference's block units
                    mag = expected.nvfp4_units(mag, a["merge.scales"], a["output_scale"])
                    got = dict(got, out=expected.nvfp4_in_reference_units(got["out"], got["scales"],
                                                                          a["merge.scales"]))
                    want["scales"] = a["merge.scales"]
                    tolerance["scales"] = compare.Tolerance(**tolerances["nvfp4_block_scale"])
                    keys.append("scales")
                compared = crosscheck.compare_results(
                    {"got": got}, keys, pairs=(), reference=want, against=("got",), locating=locating,
                    axes=dict(axes(want), **({"scales": ("token", "group")} if "scales" in want else {})),
                    prefix=f"{op}.", tolerance=tolerance,
                    exact={"out": np.broadcast_to(a["merge.out_exact"][:, :, None], mag.shape),
                           "lse": a["merge.lse_exact"]},
                    mag={"out": mag})
            reports.update((str(report.name), report) for _, report in compared)
            results.append((op, reports, None))
        except Exception as e:  # noqa: BLE001 - report and go on
            results.append((op, reports, f"{type(e).__name__}: {e}"))
    return results


def verify(golden_dir: str, impl=None, *, outputs_dir: str | None = None, name_filter: str | None = None,
           progress=None):
    """Returns (rows, ok): one row per (case, op) with the reports, or the error that stopped it.

    `impl`: "triton", "pallas", "jnp", "reference", "module:function" / "path.py:function", or a callable
    `fn(op, inputs, params) -> dict` (docs/porting.md); or `outputs_dir`: a port's results files.
    """
    manifest = load_manifest(golden_dir)
    entries = [e for e in manifest["cases"] if name_filter is None or name_filter in e["name"]]
    if not entries:
        raise GoldenError(f"no case in {golden_dir!r} matches -k {name_filter!r}")
    runner = Runner(None, fn=impl, outputs_dir=outputs_dir) if callable(impl) or outputs_dir else Runner(impl)
    impl = runner.impl
    rows = []
    total = sum(len(e.get("ops", OPS)) for e in entries)
    for entry in entries:
        try:
            a = load_case(golden_dir, entry)
        except GoldenError as e:
            for op in entry.get("ops", OPS):
                rows.append(dict(case=entry["name"], op=op, reports={}, error=str(e), load_error=True,
                                 params=entry["params"]))
            continue
        for op, reports, error in verify_case(entry, a, runner, manifest["tolerances"]):
            ok = error is None and bool(reports) and all(r.ok for r in reports.values())
            rows.append(dict(case=entry["name"], op=op, reports=reports, error=error, ok=ok, params=entry["params"]))
            if progress is not None:
                print(f"[{len(rows)}/{total}] {entry['name']} {op} {impl} {'ok' if ok else 'FAIL'}",
                      file=progress, flush=True)
    for r in rows:
        r.setdefault("ok", False)
    return rows, all(r["ok"] for r in rows)


def format_rows(rows, impl: str) -> str:
    head = ("case", "op", "dtype", "D", "exact mismatches", "tolerance failures", "max err/tol", "status")
    table = [head]
    details = []
    seen = set()
    for r in rows:
        reps = list(r["reports"].values())
        p = r["params"]
        dt = p["dtype"] if p["out_dtype"] == p["dtype"] else f"{p['dtype']}->{p['out_dtype']}"
        exact = sum(x.n_exact_mismatch if x.kind == "reference" else x.n_diff for x in reps)
        tol = sum(x.n_tol_fail + x.n_class_mismatch for x in reps if x.kind == "reference")
        ratios = [x.max_err_ratio for x in reps if x.kind == "reference" and x.max_err_ratio is not None]
        status = "ok" if r["ok"] else ("ERROR" if r["error"] else "FAIL")
        table.append((r["case"], r["op"], dt, str(p["head_dim"]), str(exact) if reps else "-",
                       str(tol) if any(x.kind == "reference" for x in reps) else "-",
                       f"{max(ratios):.3g}" if ratios else "-", status))
        if r.get("load_error"):  # the case's file: one line for all its ops
            if (r["case"], r["error"]) not in seen:
                seen.add((r["case"], r["error"]))
                details.append(f"error: {r['error']}")
        elif r["error"]:
            details.append(f"{r['case']} {r['op']}: error: {r['error']}")
        for x in reps:
            if not x.ok:
                details.append(x.format())
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    lines = []
    for n, row in enumerate(table):
        lines.append("  ".join(c.rjust(w) if 3 <= i <= 6 else c.ljust(w)
                               for i, (c, w) in enumerate(zip(row, widths))).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    ok = all(r["ok"] for r in rows)
    lines.append(f"golden verify --impl {impl}: {sum(r['ok'] for r in rows)}/{len(rows)} ok"
                 + ("" if ok else " -- FAILURE"))
    return "\n".join(lines + details)


def build_report(rows, ok: bool, *, golden_dir: str, impl: str, outputs_dir: str | None,
                 argv: list[str] | None) -> dict[str, Any]:
    """The JSON report of a verify run (`--json`)."""
    return {"schema": "parity-golden-verify/1", "env": provenance.collect_env(argv, frameworks=False),
            "golden_dir": os.path.abspath(golden_dir), "impl": impl, "outputs": outputs_dir, "ok": ok,
            "records": [{"case": r["case"], "op": r["op"], "ok": r["ok"], "error": r["error"],
                         "reports": {k: v.to_dict() for k, v in r["reports"].items()}} for r in rows]}
