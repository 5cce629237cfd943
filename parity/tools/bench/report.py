"""The benchmark's report (`python -m parity bench`, parity/tools/bench/__init__.py): the stdout tables and the PNG,
both drawn from the JSON document only."""

from __future__ import annotations

import json
import math

import numpy as np

from parity.tools.bench import points as P


def _fmt(x, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def layout_of(r: dict) -> str:
    """"HT/e", "TH/2", "HT/e gather", "TH" (the mask has no base), "-" (ceilings)."""
    if not r.get("lse_layout"):
        return "-"
    s = r["lse_layout"] + (f"/{r['lse_base']}" if r.get("lse_base") else "")
    return s + (" gather" if r.get("partials_view") == "gather" else "")


def _columns(cols, num, rows):
    widths = [max([len(c)] + [len(row[i]) for row in rows]) for i, c in enumerate(cols)]

    def line(vals):
        return "  ".join(v.rjust(w) if c in num else v.ljust(w) for v, w, c in zip(vals, widths, cols)).rstrip()

    return [line(cols), line(tuple("-" * w for w in widths))] + [line(r) for r in rows]


def _serving_key(r: dict) -> tuple:
    """A record's op, impl, variant, heads, head size, dtype, partials and layout (its T left out)."""
    n = r["workload"].split("N=")[1] if "N=" in r["workload"] else ""
    return (r["op"], r["impl"], r["variant"], r["H"], r["D"], r["dtype"], n, layout_of(r))


def serving_rows(doc: dict) -> list[tuple]:
    """One row per measured point and impl: what a serving step pays per call. host (the point's op, variant and
    shape on HOST_T tokens), eager and gpu_time at the point's T, host / the framework's host floor, eager /
    gpu_time, eager / the framework's eager floor."""
    recs = doc.get("records", [])
    ceil = doc.get("ceilings", {})
    floors = {"triton": ("noop_launch_us", "noop_eager_us"), "triton-op": ("noop_launch_us", "noop_eager_us"),
              "pallas": ("jit_dispatch_us", "jit_eager_us")}
    host = {_serving_key(r): r["p50"] for r in recs if r["metric"] == "host" and r["op"] != "ceiling"}
    by_point: dict = {}
    for r in recs:
        if r["op"] == "ceiling" or r["metric"] == "host" or r["variant"].endswith("floor"):
            continue
        by_point.setdefault((r["op"], r["impl"], r["workload"], r["dtype"], r["variant"], layout_of(r)),
                            {})[r["metric"]] = r
    rows = []
    for (op, impl, workload, dtype, variant, layout), m in by_point.items():
        any_r = next(iter(m.values()))
        h = host.get(_serving_key(any_r))
        e = m.get("eager", {}).get("p50")
        g = m.get("gpu_time", {}).get("p50")
        fh, fe = (ceil.get(k) for k in floors.get(impl, (None, None)))

        def ratio(x, y):
            return x / y if x is not None and y else None

        rows.append((op, impl, workload, P.SHORT.get(dtype, dtype or "-"), variant, layout, _fmt(h, ".1f"),
                     _fmt(fh, ".1f"), _fmt(ratio(h, fh), ".2f"), _fmt(e, ".1f"), _fmt(g, ".1f"),
                     _fmt(ratio(e, g), ".2f"), _fmt(fe, ".1f"), _fmt(ratio(e, fe), ".2f")))
    return rows


def format_table(doc: dict) -> str:
    """The stdout tables: one row per record, numbers right-aligned, caption with device and formulas; then
    what a serving step pays per call (`serving_rows`) and the JAX re-trace check."""
    env = doc.get("env", {})
    cols = ("op", "impl", "workload", "dtype", "variant", "layout", "metric", "p20 us", "p50 us", "p80 us", "TB/s",
            "%ceil", "P/T", "upstr us")
    num = {"p20 us", "p50 us", "p80 us", "TB/s", "%ceil", "P/T", "upstr us"}
    rows = []
    for r in doc.get("records", []):
        rows.append((r["op"], r["impl"], r["workload"], P.SHORT.get(r["dtype"], r["dtype"] or "-"), r["variant"],
                     layout_of(r), r["metric"], _fmt(r["p20"], ".2f"), _fmt(r["p50"], ".2f"), _fmt(r["p80"], ".2f"),
                     _fmt(r["tbps"], ".3f"),
                     _fmt(None if r["frac_ceiling"] is None else 100 * r["frac_ceiling"], ".1f"),
                     _fmt(r.get("pallas_over_triton"), ".3f"), _fmt(r.get("upstream_us"), ".1f")))
    ceil = doc.get("ceilings", {})
    v = env.get("versions", {})
    up = P.UPSTREAM
    out = [f"# parity bench ({doc.get('mode')}): {env.get('gpu')} driver {env.get('driver')} CUDA {env.get('cuda')}"
           f"; torch {v.get('torch')} triton {v.get('triton')} jax {v.get('jax')}"
           f"; commit {env.get('git_commit')}; {env.get('utc_time')}",
           f"# command: {env.get('command')}",
           f"# ceilings (this run, gpu_time p50): two-read-one-write {_fmt(ceil.get('add_2r1w'), '.3f')} TB/s, "
           f"write-only {_fmt(ceil.get('fill_w'), '.3f')} TB/s (docs/spec.md 7 H200: {up['add_2r1w_tbps']} / "
           f"{up['fill_w_tbps']})",
           f"# floors (this run): empty Triton kernel {_fmt(ceil.get('noop_kernel_us'), '.2f')} us gpu_time, "
           f"{_fmt(ceil.get('noop_launch_us'), '.1f')} us host, {_fmt(ceil.get('noop_eager_us'), '.1f')} us eager; "
           f"jitted JAX identity {_fmt(ceil.get('jit_dispatch_us'), '.1f')} us host, "
           f"{_fmt(ceil.get('jit_eager_us'), '.1f')} us eager; mask 'floor' rows: fill_ of the same bytes",
           f"# upstream (docs/spec.md 7, H200): merge {up['merge_tbps']} TB/s; mask gpu_time "
           + " / ".join(f"{x}" for x in up["mask_gpu_time_us"].values()) + " us, latency "
           + " / ".join(f"{x}" for x in up["mask_latency_us"].values()) + " us (2k / 32k / 131k)",
           f"# {P.FORMULAS['merge']}; %ceil vs two-read-one-write",
           f"# {P.FORMULAS['mask']}; %ceil vs write-only",
           "# TB/s from p50; P/T = pallas p50 / triton p50 of the same point and metric; methods in the JSON",
           "# metrics: gpu_time (Triton CUDA-graph replay, includes the ~1 us gap between graph nodes; JAX profiler "
           "kernel time), latency (back-to-back calls, one sync), eager (Triton do_bench per call, launch "
           f"included; JAX a synced call), host (back-to-back calls on T={P.HOST_T})",
           "# layout: LSE layout / base (HT/e the default), gather = the N-way partials read as a view of a "
           "[T, N, H, D] all-gather buffer (Triton only)"]
    out += _columns(cols, num, rows)
    srows = serving_rows(doc)
    if srows:
        scols = ("op", "impl", "workload", "dtype", "variant", "layout", "host us", "floor", "host/fl", "eager us",
                 "gpu us", "eager/gpu", "e-floor", "eager/fl")
        out += ["", f"# what a serving step pays per call (p50): host = the op on T={P.HOST_T} (back-to-back, "
                    "one sync) beside the framework's host floor; eager and gpu at the point's T; floors: the empty "
                    "Triton launch (triton), the jitted JAX identity (pallas)"]
        out += _columns(scols, {"host us", "floor", "host/fl", "eager us", "gpu us", "eager/gpu", "e-floor",
                                "eager/fl"}, srows)
    if doc.get("retrace"):
        out.append("# JAX re-trace check (a new batch of the same shapes: other offsets and "
                   "prefill_tokens_with_context): " + "; ".join(
                       f"{r['op']} {r['new_batch']['traces']} traces / {r['new_batch']['compiles']} compiles "
                       f"({'ok' if r['ok'] else 'RETRACED'})" for r in doc["retrace"]))
    if doc.get("skipped"):
        out.append(f"# skipped {len(doc['skipped'])}: " + "; ".join(
            f"{s['point']} ({s['reason']})" for s in doc["skipped"][:6]) + (" ..." if len(doc["skipped"]) > 6 else ""))
    if doc.get("errors"):
        out.append(f"# errors {len(doc['errors'])}: " + "; ".join(
            f"{e['point']} [{e['impl']}]" for e in doc["errors"][:6]))
    return "\n".join(out)


def plot_from_json(json_path: str, png_path: str) -> None:
    """Draw the benchmark PNG from a `--json` file only: merge TB/s per point (layout in the tick label when not
    HT/e) with the ceiling, and mask time per seed workload next to upstream's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(json_path) as f:
        doc = json.load(f)
    recs = doc.get("records", [])
    env = doc.get("env", {})
    merge = [r for r in recs if r["op"] == "merge" and r["metric"] == "gpu_time"]
    mask = [r for r in recs if r["op"] == "mask" and r["variant"] == "lse" and layout_of(r) in ("HT", "-")
            and r["metric"] != "host"]
    dtypes = [d for d in ("bfloat16", "float16", "float32") if any(r["dtype"] == d for r in merge)]
    variants = [v for v in P.MERGE_VARIANTS if any(r["variant"] == v for r in merge)]
    shapes = sorted({(r["T"], r["H"], r["D"], layout_of(r)) for r in merge})
    ncols = max(1, len(variants))
    nrows = len(dtypes) + 1
    fig = plt.figure(figsize=(max(11.0, 0.42 * len(shapes) * ncols + 2.0), 3.9 * nrows))
    grid = fig.add_gridspec(nrows, ncols)
    colors = {"triton": "tab:blue", "pallas": "tab:orange", "upstream": "tab:gray"}
    ceil = doc.get("ceilings", {}).get("add_2r1w")

    def short_t(t):
        return f"{t // 1024}K" if t % 1024 == 0 else str(t)

    for i, dt in enumerate(dtypes):
        for j, var in enumerate(variants):
            ax = fig.add_subplot(grid[i, j])
            for impl, marker in (("triton", "o"), ("pallas", "s")):
                sel = [r for r in merge if r["impl"] == impl and r["dtype"] == dt and r["variant"] == var]
                xs = [shapes.index((r["T"], r["H"], r["D"], layout_of(r))) for r in sel]
                ax.plot(xs, [r["tbps"] or 0.0 for r in sel],
                        marker, color=colors[impl], label=impl, markersize=5, alpha=0.85)
            if ceil:
                ax.axhline(ceil, color="k", ls="--", lw=1, label=f"2R1W ceiling {ceil:.2f}")
            ax.axhline(P.UPSTREAM["merge_tbps"], color=colors["upstream"], ls=":", lw=1.5,
                       label=f"upstream {P.UPSTREAM['merge_tbps']}")
            ax.set_ylim(0, max(ceil or 0.0, P.UPSTREAM["merge_tbps"], *[r["tbps"] or 0.0 for r in merge]) * 1.1)
            ax.set_xticks(range(len(shapes)))
            ax.set_xticklabels([f"{short_t(t)}/{h}/{d}" + ("" if lay in ("HT/e", "-") else f" {lay}")
                                for t, h, d, lay in shapes], rotation=90, fontsize=7)
            ax.set_title(f"merge {P.SHORT.get(dt, dt)} {var}: TB/s (gpu_time p50)", fontsize=9)
            ax.grid(axis="y", alpha=0.3)
            if j == 0:
                ax.set_ylabel("effective TB/s (T/H/D layout)")
            if i == 0 and j == ncols - 1:
                ax.legend(fontsize=7, loc="lower right")

    ax2 = fig.add_subplot(grid[nrows - 1, :])
    workloads = []
    for r in mask:
        if r["workload"] not in workloads:
            workloads.append(r["workload"])
    bars = [("triton", "gpu_time"), ("pallas", "gpu_time"), ("upstream", "gpu_time"),
            ("triton", "latency"), ("pallas", "latency"), ("upstream", "latency"), ("triton", "eager"),
            ("pallas", "eager")]
    width = 0.8 / len(bars)
    for j, (impl, metric) in enumerate(bars):
        ys = []
        for w in workloads:
            if impl == "upstream":
                key = "mask_gpu_time_us" if metric == "gpu_time" else "mask_latency_us"
                ys.append(P.UPSTREAM[key].get(w, np.nan))
            else:
                v = [r["p50"] for r in mask if r["workload"] == w and r["impl"] == impl and r["metric"] == metric]
                ys.append(v[0] if v else np.nan)
        ax2.bar(np.arange(len(workloads)) + (j - (len(bars) - 1) / 2) * width, ys, width, color=colors[impl],
                hatch={"latency": "//", "eager": ".."}.get(metric),
                edgecolor=None if metric == "gpu_time" else "white",
                label=f"{impl} {metric}")
    ax2.set_xticks(range(len(workloads)))
    ax2.set_xticklabels(workloads, fontsize=8)
    ax2.set_yscale("log")
    ax2.set_ylabel("us per call (p50)")
    ax2.set_title("mask (LSE only): GPU time (solid), latency with launch (hatched), eager (dotted); upstream from "
                  "docs/spec.md 7",
                  fontsize=9)
    ax2.legend(fontsize=7, ncol=2)
    v = env.get("versions", {})
    fig.suptitle(f"{env.get('gpu')} | torch {v.get('torch')} triton {v.get('triton')} jax {v.get('jax')} | "
                 f"commit {str(env.get('git_commit'))[:12]} | {env.get('utc_time')} | mode {doc.get('mode')}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)

