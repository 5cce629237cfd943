"""The benchmark's runner (`python -m parity bench`, parity/tools/bench/): the state of one run (options, timers by
mode, the JSON document) and the points it measures (`work`); `floors`, `mask_runs`, `merge_runs` and `retrace`
measure them and `schedule` runs them in order.
Every op goes through `parity.harness.impls` (the one place that says how to run each implementation)."""

from __future__ import annotations

import gc
import math
import time

from parity.harness import cases
from parity.tools.bench import points as P
from parity.tools.bench import timers
from parity.tools.bench.records import SCHEMA, record, write_json

__all__ = ["SCHEMA", "Runner", "record", "write_json"]


class BudgetSpent(Exception):
    pass


class Runner:
    def __init__(self, args, mode: str, device: str):
        self.args, self.mode, self.device = args, mode, device
        self.on_gpu = device == "cuda"
        self.t_start = time.monotonic()
        self.budget_s = getattr(args, "budget_s", None)
        self.impls = {"both": ("triton", "pallas"), "triton": ("triton",), "pallas": ("pallas",)}[
            getattr(args, "impl", "both") or "both"]
        self.quiet = bool(getattr(args, "quiet", False))
        self.name_filter = getattr(args, "name_filter", None)
        self.use_profiler = self.on_gpu and getattr(args, "jax_timer", "profiler") == "profiler"
        self.doc = {"schema": SCHEMA, "mode": mode, "env": {}, "reference": P.UPSTREAM, "formulas": P.FORMULAS,
                    "ceilings": {}, "records": [], "retrace": [], "skipped": [], "errors": []}
        self.host_done: set = set()  # (impl, tiny point) pairs whose `host` record exists
        from parity.harness import impls

        self.rt = impls.make_runtime()
        # Reps: do_bench_cudagraph's `rep` (ms), the target wall time of one latency trial, trial count.
        self.rep_ms, self.target_s, self.trials = {"full": (20, 0.02, 5), "quick": (20, 0.02, 5),
                                                   "smoke": (2, 0.0, 1)}[mode]

    # -- helpers
    def progress(self, msg: str) -> None:
        if not self.quiet:
            timers.log(msg)

    def check_budget(self) -> None:
        if self.budget_s is not None and time.monotonic() - self.t_start > self.budget_s:
            raise BudgetSpent()

    def adapter(self, impl: str):
        """The `parity.harness.impls` adapter of "triton" or "pallas" (how the harness runs each implementation)."""
        from parity.harness import impls

        return impls.adapter(self.rt, impl)

    def sync(self) -> None:
        self.rt.sync()

    def n_calls(self, est_us: float, lo: int = 3, hi: int = 200) -> int:
        if self.mode == "smoke":
            return 1
        return int(min(hi, max(lo, math.ceil(self.target_s * 1e6 / max(est_us, 1.0)))))

    def save(self) -> None:
        path = getattr(self.args, "json", None)
        if path:
            write_json(self.doc, path)

    def add(self, rec: dict) -> None:
        self.doc["records"].append(rec)

    def error(self, label: str, impl: str, e: BaseException) -> None:
        msg = f"{type(e).__name__}: {e}"
        self.doc["errors"].append({"point": label, "impl": impl, "error": msg[:2000]})
        lines = [ln.strip() for ln in msg.splitlines() if ln.strip()]
        short = lines[0] if len(lines) < 2 else f"{lines[0]} ... {lines[-1]}"
        self.progress(f"  {impl}: error: {short[:400]}")

    def cleanup(self) -> None:
        """Between points on a GPU: the last point's buffers freed before the next one allocates. The smoke mode on
        CPU holds tiny arrays and skips it (a full collection per point was a sixth of its run time)."""
        if not self.on_gpu:
            return
        import torch

        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    def _smoke(self, timing, what: str):
        q, method, n = timing
        return q, f"smoke ({what}): {method} - no claim", n

    def triton_gpu_time(self, fn):
        if self.on_gpu:
            return timers.time_cudagraph(fn, self.rep_ms)
        return self._smoke(timers.time_wall(fn, self.sync, 1, self.trials, warmup=False), "CPU interpreter")

    def jax_gpu_time(self, call, sync, est_us: float):
        if self.on_gpu:
            return timers.time_jax_gpu(call, sync, self.n_calls(est_us, lo=5, hi=100), self.trials,
                                       self.use_profiler)
        return self._smoke(timers.time_wall(call, sync, 1, self.trials, what="jitted call", warmup=False),
                           "CPU interpret mode")

    def latency(self, call, sync, est_us: float):
        t = timers.time_wall(call, sync, self.n_calls(est_us), self.trials, warmup=self.on_gpu)
        return t if self.on_gpu else self._smoke(t, "CPU")

    def host(self, call, sync, what: str):
        """Per-call host cost: many back-to-back calls on tiny inputs, one sync at the end."""
        n = 200 if self.mode != "smoke" else 1
        t = timers.time_wall(call, sync, n, self.trials, what=what, warmup=self.on_gpu)
        return t if self.on_gpu else self._smoke(t, "CPU")

    def eager(self, impl: str, call, sync):
        """What a step waits for per call: Triton `do_bench` (CUDA events, launch included), JAX a synced call."""
        if not self.on_gpu:
            return self._smoke(timers.time_synced(call, sync, 1, warmup=False), "CPU")
        if impl == "pallas":
            return timers.time_synced(call, sync, 50)
        return timers.time_do_bench(call)

    def ratio_and_progress(self, idx: str, label: str, results: dict, nbytes: int, first: int) -> None:
        """Sets `pallas_over_triton` on the point's Pallas records (those from index `first` on)."""
        metrics = ("gpu_time", "latency", "eager")
        recs = [r for r in self.doc["records"][first:] if r["impl"] == "pallas" and r["metric"] in metrics]
        if "triton" in results and "pallas" in results:
            for r in recs:
                tri = results["triton"][metrics.index(r["metric"])][0][1]
                r["pallas_over_triton"] = r["p50"] / tri if tri > 0 else None
        parts = []
        for impl in ("triton", "pallas"):
            if impl in results:
                g, lat, eag = results[impl]
                tb = nbytes / (g[0][1] * 1e-6) / 1e12 if g[0][1] > 0 else float("nan")
                parts.append(f"{impl} {g[0][1]:.1f} us ({tb:.2f} TB/s), latency {lat[0][1]:.1f} us, eager "
                             f"{eag[0][1]:.1f} us")
        self.progress(f"[{idx}] {label}: " + ("; ".join(parts) if parts else "no result"))

    # -- the points
    def work(self) -> list:
        """(kind, item, label) of every point this run measures, in order."""
        args = self.args
        only = getattr(args, "only", None)
        t_vals = getattr(args, "tokens", None)
        layouts, head_dims, views = (getattr(args, k, None) for k in ("layouts", "head_dims", "views"))
        work = []
        if only in (None, "mask"):
            mask_variants = P.GRIDS[self.mode][5]
            work += [("mask", (c, v, "HT"), f"mask {c.name} {v} HT") for c in P.mask_cases(self.mode)
                     for v in mask_variants]
        if only in (None, "mask", "layouts"):
            if any(parse[0] == "TH" for parse in map(P.parse_layout, layouts or P.LAYOUT_GRIDS[self.mode][0])):
                work += [("mask", (cases.by_name(n), "lse", "TH"), f"mask {n} lse TH")
                         for n in P.LAYOUT_MASK_CASES[self.mode]]
        pts = []
        if only in (None, "merge"):
            pts += P.merge_points(self.mode)
        if only in (None, "merge", "layouts"):
            pts += P.layout_points(self.mode, layouts, head_dims, views)
        work += [("merge", p, p.label) for p in pts if not t_vals or p.T in t_vals]
        if self.name_filter:
            work = [w for w in work if self.name_filter in w[2]]
        return work
