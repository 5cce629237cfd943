"""The probe's loop over backends and situations, its recommendation, table and JSON."""

from __future__ import annotations

import json
import math
import sys
import traceback

from parity.tools.probe import core

RECOMMENDATIONS = ("safe", "needs the mask", "unknown")
# A finite LSE at or below this gets weight exp(lse - m) == 0 in f32 beside any real partial's m: a sentinel.
SENTINEL_FLOOR = -1e30


def all_backends() -> tuple:
    """Every backend the probe knows, torch's then JAX's (each module imported only here)."""
    from parity.tools.probe import jax_backends, torch_backends

    return torch_backends.BACKENDS + jax_backends.BACKENDS


def _error(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}"


def probe_situation(backend, situation: core.Situation, seed: int) -> dict:
    spec = situation.spec
    row = dict(situation=situation.name)
    try:
        inputs = core.make_inputs(spec, backend.dtype, seed)
        raw = backend.run(spec, inputs)
    except core.Unsupported as e:
        return dict(row, status="cannot_express", reason=str(e))
    except Exception as e:  # noqa: BLE001 - a kernel refusing the shape is a finding, reported with its reason
        return dict(row, status="refused", reason=_error(e))
    try:
        row.update(core.judge(spec, inputs, raw, backend.dtype))
    except Exception as e:  # noqa: BLE001 - a result the probe cannot read is reported, not dropped
        return dict(row, status="refused", reason=f"unreadable result: {_error(e)}")
    return row


def recommend(situations: list[dict], end_to_end: dict | None) -> tuple[str, str]:
    """One word for a backend, and why.

    "needs the mask" when this project's merge alone corrupts rows end to end, or the rows of a request without KV
    carry a finite LSE above `SENTINEL_FLOOR` (weight that looks like data); "safe" when those rows' LSE is
    +-inf/NaN, or a sentinel at or below the floor (weight exactly 0 beside any real partial: only a row empty in
    every partial would then come out as the kernel's output instead of 0), and the merge alone is clean; else
    "unknown". Fully masked and causal rows inform, but the mask (which reads only the offsets) cannot see them;
    padding rows are never a request's (docs/spec.md 2)."""
    zero = next((s for s in situations if s["situation"] == "zero_kv"), None)
    merged = None if not end_to_end or "paths" not in end_to_end else end_to_end["paths"]["merge"]["rows_corrupted"]
    if zero is None or zero.get("status") != "ok" or "empty_lse" not in zero:
        why = "the rows of a request without KV could not be probed"
        if merged:
            return "needs the mask", f"this project's merge alone corrupts {merged} rows end to end"
        return "unknown", why + (f" ({zero.get('reason')})" if zero and zero.get("reason") else "")
    if merged:
        return "needs the mask", f"this project's merge alone corrupts {merged} rows end to end"
    if zero["empty_lse"].get("unwritten"):
        return "needs the mask", "the LSE of a request without KV is left unwritten"
    values = zero.get("empty_lse_finite") or []
    top = zero.get("empty_lse_finite_range", [None, None])[1]
    if top is not None and top > SENTINEL_FLOOR:
        return "needs the mask", f"finite LSE (up to {top:.3g}) in the rows of a request without KV"
    tail = "the merge alone is clean end to end" if merged is not None else "end to end not run"
    if values:
        return "safe", (f"finite sentinel LSE {values[0]:.3g} weighs 0 beside any real partial (a row empty in "
                        f"every partial would come out as the kernel's output, not 0); {tail}")
    return "safe", f"empty rows' LSE is +-inf/NaN (the merge reads those as empty); {tail}"


def probe_backend(backend, *, merge_impl: str, seed: int = 0, end_to_end: bool = True, progress=None) -> dict:
    entry = dict(backend=backend.name, framework=backend.framework, kernel=backend.kernel)
    try:
        reason = backend.unavailable()
    except Exception as e:  # noqa: BLE001
        reason = f"import failed: {_error(e)}"
    if reason is not None:
        return dict(entry, status="absent", reason=reason, recommendation="unknown", why=reason)
    entry.update(status="probed", dtype=backend.dtype)
    try:
        entry["versions"] = backend.version()
    except Exception as e:  # noqa: BLE001 - informational only
        entry["versions"] = {"error": _error(e)}
    entry["situations"] = []
    for situation in core.SITUATIONS.values():
        if progress:
            progress(f"probe: {backend.name} / {situation.name}")
        entry["situations"].append(probe_situation(backend, situation, seed))
    if end_to_end:
        from parity.tools.probe.endtoend import run_end_to_end

        base = next((s.get("lse_base") for s in entry["situations"] if s.get("lse_base")), None)
        if progress:
            progress(f"probe: {backend.name} / end to end (merge: {merge_impl})")
        try:
            entry["end_to_end"] = run_end_to_end(backend, base=base, merge_impl=merge_impl, seed=seed)
        except core.Unsupported as e:
            entry["end_to_end"] = dict(status="cannot_express", reason=str(e))
        except Exception as e:  # noqa: BLE001
            entry["end_to_end"] = dict(status="refused", reason=_error(e))
            if progress:
                progress(traceback.format_exc(limit=3))
    entry["recommendation"], entry["why"] = recommend(entry["situations"], entry.get("end_to_end"))
    return entry


def default_merge_impl() -> str:
    from parity.harness import impls

    return "triton" if impls.configure() else "jnp"


def run_probe(*, backends=None, merge_impl: str | None = None, seed: int = 0, end_to_end: bool = True,
              progress=None, argv=None) -> dict:
    """Probes every backend of `all_backends()` (or those named in `backends`); returns the JSON-ready report.

    Every known backend is listed: probed, or absent with the reason. `merge_impl` is the implementation of this
    project's mask and merge end to end ("triton", "pallas", "jnp", "reference"; default triton on a GPU, jnp
    otherwise, the interpreters being slow).
    """
    from parity.harness import provenance

    known = all_backends()
    if backends:
        unknown = sorted(set(backends) - {b.name for b in known})
        if unknown:
            raise ValueError(f"unknown backend(s) {unknown}; known: {[b.name for b in known]}")
        known = tuple(b for b in known if b.name in backends)
    merge_impl = merge_impl or default_merge_impl()
    report = dict(env=provenance.collect_env(argv), merge_impl=merge_impl, seed=seed,
                  situations={s.name: s.what for s in core.SITUATIONS.values()},
                  backends=[probe_backend(b, merge_impl=merge_impl, seed=seed, end_to_end=end_to_end,
                                          progress=progress) for b in known])
    return report


def run_isolated(*, backends=None, merge_impl: str | None = None, seed: int = 0, end_to_end: bool = True,
                 progress=None, argv=None, timeout_s: int = 600) -> dict:
    """`run_probe` with each backend in its own `python -m parity probe --backend NAME` process: a kernel that
    crashes the process or leaves the CUDA context broken costs its own entry only ("crashed", with the reason)."""
    import os
    import subprocess
    import tempfile

    from parity.harness import provenance

    names = list(backends) if backends else [b.name for b in all_backends()]
    merge_impl = merge_impl or default_merge_impl()
    report = dict(env=provenance.collect_env(argv), merge_impl=merge_impl, seed=seed, isolated=True,
                  situations={s.name: s.what for s in core.SITUATIONS.values()}, backends=[])
    for name in names:
        if progress:
            progress(f"probe: {name} (own process)")
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "probe.json")
            cmd = [sys.executable, "-m", "parity", "probe", "--backend", name, "--json", path, "--quiet",
                   "--merge-impl", merge_impl, "--seed", str(seed)] + ([] if end_to_end else ["--no-end-to-end"])
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
                rc, tail = r.returncode, (r.stderr.strip().splitlines() or [""])[-1][:300]
            except subprocess.TimeoutExpired:
                rc, tail = None, f"timed out after {timeout_s} s"
            if rc == 0 and os.path.exists(path):
                with open(path) as f:
                    report["backends"] += json.load(f)["backends"]
                continue
        why = f"the probe process ended with status {rc}: {tail}" if rc is not None else tail
        report["backends"].append(dict(backend=name, status="crashed", reason=why, recommendation="unknown", why=why))
    return report


def _err_cell(x) -> str:
    return x if isinstance(x, str) else f"{x:.1e}"


def _lse_cell(s: dict, key: str) -> str:
    if f"{key}_lse" not in s:
        return "(not in LSE)" if f"{key}_lse_missing" in s else "-"
    return core.class_label(s[f"{key}_lse"], s.get(f"{key}_lse_finite"))


def format_table(report: dict) -> str:
    """Two plain-text tables: per (backend, situation), then per backend (end to end and recommendation)."""
    head = ("backend", "situation", "status", "empty rows: LSE", "out", "padding: LSE", "out", "base", "LSE layout",
            "dtype", "data err")
    body = []
    for b in report["backends"]:
        if b["status"] != "probed":
            body.append((b["backend"], "-", b["status"], b["reason"], "", "", "", "", "", "", ""))
            continue
        for s in b["situations"]:
            if s["status"] not in ("ok", "no_empty_rows"):
                body.append((b["backend"], s["situation"], s["status"], s.get("reason", ""), "", "", "", "", "", "",
                             ""))
                continue
            extra = f" ({s['alignment']})" if s.get("alignment") else ""
            body.append((b["backend"], s["situation"], s["status"] + extra, _lse_cell(s, "empty"),
                         core.class_label(s.get("empty_out")), _lse_cell(s, "padding"),
                         core.class_label(s.get("padding_out")), s.get("lse_base") or "?",
                         s["lse_layout"].split(" (")[0], f"{s['lse_dtype']}/{s['out_dtype']}",
                         _err_cell(s["data_max_err"]) + ("" if s["data_ok"] else " BAD")))
    lines = [_grid(head, body, wrap_last_text=3), ""]
    head2 = ("backend", "naive merge", "merge", "mask + merge", "recommendation", "why")
    body2 = []
    for b in report["backends"]:
        e2e = b.get("end_to_end") or {}
        if "paths" in e2e:
            cells = tuple(f"{p['rows_corrupted']}/{p['rows_total']}" for p in e2e["paths"].values())
        else:
            cells = (e2e.get("status", "-"), e2e.get("reason", "")[:60], "")
        body2.append((b["backend"], *cells, b["recommendation"], b.get("why", "")))
    lines.append(_grid(head2, body2))
    lines.append(f"end to end: chunked prefill, corrupted rows vs float64 attention; merge = {report['merge_impl']}; "
                 "status/reason columns say why a row was not probed.")
    return "\n".join(lines)


def _grid(head, body, wrap_last_text=None) -> str:
    widths = [max(len(str(h)), *(len(str(r[i])) for r in body)) if body else len(h) for i, h in enumerate(head)]
    if wrap_last_text is not None:  # a long reason in a status row must not widen every other row's column
        widths[wrap_last_text] = min(widths[wrap_last_text], 40)

    def fmt(cells):
        return "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()

    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in body])


def _strict(x):
    """NaN and infinities as the strings "nan", "inf", "-inf": the file is strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: _strict(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_strict(v) for v in x]
    return x


def write_json(report: dict, path: str) -> None:
    """The report as strict JSON (`_strict`) to `path` ("-": stdout)."""
    text = json.dumps(_strict(report), indent=1, default=str, allow_nan=False)
    if path == "-":
        sys.stdout.write(text + "\n")
    else:
        with open(path, "w") as f:
            f.write(text + "\n")
