"""The benchmark's runner (`python -m parity bench`, parity/tools/bench/__init__.py): ceilings and floors, the mask and
merge points, the per-call host cost on tiny inputs and the JAX re-trace check. Every op goes through
`parity.harness.impls` (the one place that says how to run each implementation)."""

from __future__ import annotations

import dataclasses
import functools
import gc
import json
import math
import os
import time
import warnings

import numpy as np

from parity.harness import cases
from parity.tools.bench import points as P
from parity.tools.bench import timers

SCHEMA = 2  # 2: layout fields on every record; metrics host and eager (eager replaces schema 1's launch); retrace


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


class _Budget(Exception):
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
            raise _Budget()

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
        gc.collect()
        if self.on_gpu:
            import torch

            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def _smoke(self, timing, what: str):
        q, method, n = timing
        return q, f"smoke ({what}): {method} - no claim", n

    def triton_gpu_time(self, fn):
        if self.on_gpu:
            return timers.time_cudagraph(fn, self.rep_ms)
        return self._smoke(timers.time_wall(fn, self.sync, 1, self.trials), "CPU interpreter")

    def jax_gpu_time(self, call, sync, est_us: float):
        if self.on_gpu:
            return timers.time_jax_gpu(call, sync, self.n_calls(est_us, lo=5, hi=100), self.trials,
                                       self.use_profiler)
        return self._smoke(timers.time_wall(call, sync, 1, self.trials, what="jitted call"), "CPU interpret mode")

    def latency(self, call, sync, est_us: float):
        t = timers.time_wall(call, sync, self.n_calls(est_us), self.trials)
        return t if self.on_gpu else self._smoke(t, "CPU")

    def host(self, call, sync, what: str):
        """Per-call host cost: many back-to-back calls on tiny inputs, one sync at the end."""
        n = 200 if self.mode != "smoke" else 1
        t = timers.time_wall(call, sync, n, self.trials, what=what)
        return t if self.on_gpu else self._smoke(t, "CPU")

    def eager(self, impl: str, call, sync):
        """What a step waits for per call: Triton `do_bench` (CUDA events, launch included), JAX a synced call."""
        if not self.on_gpu:
            return self._smoke(timers.time_synced(call, sync, 1), "CPU")
        if impl == "pallas":
            return timers.time_synced(call, sync, 50)
        return timers.time_do_bench(call)

    # -- 1. ceilings and floors
    def ceilings(self) -> None:
        import torch

        n = P.CEILING_ELEMS if self.on_gpu and self.mode != "smoke" else 1 << 16
        self.progress(f"ceilings: torch.add(a, b, out=c) and c.fill_(1) on {n * 2 / 2**30:.3g} GiB bf16 tensors")
        a = torch.ones(n, dtype=torch.bfloat16, device=self.device)
        b = torch.ones(n, dtype=torch.bfloat16, device=self.device)
        c = torch.empty(n, dtype=torch.bfloat16, device=self.device)
        self.sync()
        specs = (("add_2r1w", "torch.add(a, b, out=c)", lambda: torch.add(a, b, out=c), 3 * 2 * n),
                 ("fill_w", "c.fill_(1)", lambda: c.fill_(1.0), 2 * n))
        for key, variant, fn, nbytes in specs:
            t = self.triton_gpu_time(fn)
            rec = record("ceiling", "torch", key, None, None, None, "bfloat16", variant, "gpu_time", t, nbytes, None)
            self.doc["ceilings"][key] = rec["tbps"]
            self.add(rec)
            self.progress(f"  {key}: {rec['p50']:.1f} us, {rec['tbps']:.3f} TB/s")
        a = b = c = fn = specs = None  # free the 6 GiB of inputs before the next step
        # The floors of every metric: an empty Triton kernel (its GPU time by graph replay, its host cost over
        # back-to-back launches, its eager time by do_bench) and a jitted JAX identity (host, eager). No public
        # call of either framework can be cheaper on this host.
        x = torch.zeros(16, device=self.device)
        kernel = timers.noop_kernel()

        def noop():
            kernel[(1,)](x)

        floors = (("noop_kernel_us", "noop_kernel", "gpu_time", lambda: self.triton_gpu_time(noop)),
                  ("noop_launch_us", "noop_launch", "host", lambda: self.host(noop, self.sync, "empty kernel launch")),
                  ("noop_eager_us", "noop_eager", "eager", lambda: self.eager("triton", noop, self.sync)))
        for key, workload, metric, timing in floors:
            rec = record("ceiling", "triton", workload, None, None, None, "float32", "empty @triton.jit kernel",
                         metric, timing(), 0, None)
            self.doc["ceilings"][key] = rec["p50"]
            self.add(rec)
        try:
            import jax
            import jax.numpy as jnp

            ident = jax.jit(lambda v: v + 1)
            state = [jnp.zeros(16)]

            def jcall():
                state[0] = ident(state[0])

            def jsync():
                jax.block_until_ready(state)

            for key, workload, metric, timing in (
                    ("jit_dispatch_us", "jit_dispatch", "host", lambda: self.host(jcall, jsync, "jitted identity")),
                    ("jit_eager_us", "jit_eager", "eager", lambda: self.eager("pallas", jcall, jsync))):
                rec = record("ceiling", "jax", workload, None, None, None, "float32", "jax.jit(lambda v: v + 1)",
                             metric, timing(), 0, None)
                self.doc["ceilings"][key] = rec["p50"]
                self.add(rec)
        except Exception as e:  # noqa: BLE001 - informational floor
            self.error("jit_dispatch floor", "jax", e)
        c = self.doc["ceilings"]
        nan = float("nan")
        self.progress(f"  floors: empty kernel {c['noop_kernel_us']:.2f} us gpu, launch {c['noop_launch_us']:.1f} us "
                      f"host / {c['noop_eager_us']:.1f} us eager; jitted JAX identity "
                      f"{c.get('jit_dispatch_us', nan):.1f} us host / {c.get('jit_eager_us', nan):.1f} us eager")
        self.cleanup()
        self.save()

    # -- 2. mask
    def _mask_inputs(self, case: cases.Case, with_out: bool, lse_layout: str):
        import torch

        T, H, D = case.num_tokens, case.num_heads, case.head_dim
        qsl_np, cu_np = cases.offsets(case)
        gen = torch.Generator(device=self.device).manual_seed(0)
        shape = (H, T) if lse_layout == "HT" else (T, H)
        lse = torch.randn(*shape, generator=gen, device=self.device, dtype=torch.float32).mul_(3.0).add_(4.0)
        out = torch.randn(T, H, D, generator=gen, device=self.device, dtype=getattr(torch, case.dtype)) \
            if with_out else None
        return lse, out, qsl_np, cu_np

    def _bind_mask(self, impl: str, lse, out, qsl_np, cu_np, lse_layout: str):
        """The prepared mask call of `impl`: Triton in place; JAX the documented in-place form (jit, the buffers
        donated, results fed back)."""
        import torch

        from parity.library import bridge

        if impl == "triton":
            qsl, cu = (torch.from_numpy(v).to(self.device) for v in (qsl_np, cu_np))
            return self.adapter("triton").bind_mask(lse, qsl, cu, out, has_empty=True, in_place=True,
                                                    lse_layout=lse_layout)
        import jax

        jdev = bridge.jax_device_for(lse.device)
        return self.adapter("pallas").bind_mask(
            bridge.torch_to_jax(lse), jax.device_put(qsl_np, jdev), jax.device_put(cu_np, jdev),
            None if out is None else bridge.torch_to_jax(out), has_empty=True, donate=True, lse_layout=lse_layout)

    def mask(self, case: cases.Case, variant: str, lse_layout: str, idx: str) -> None:
        import torch

        label = f"mask {case.name} {variant} {lse_layout}"
        T, H, D = case.num_tokens, case.num_heads, case.head_dim
        nbytes = P.mask_bytes(case, variant)
        ceiling = self.doc["ceilings"].get("fill_w")
        with_out = variant == "lse+out"
        dtype = case.dtype if with_out else "float32"
        work = T * H * 4 + (T * H * D * P.ITEMSIZE[case.dtype] if with_out else 0)
        note = f"L2-resident working set ({work / 1e6:.1f} MB <= 3x L2)" if work < 3 * P.L2_BYTES else None
        layout = {"lse_layout": lse_layout, "lse_base": None, "partials_view": None}
        lse, out, qsl_np, cu_np = self._mask_inputs(case, with_out, lse_layout)
        self.sync()
        results = {}
        est = 10.0
        first = len(self.doc["records"])

        def add(impl, metric, t, upstream=True):
            rec = record("mask", impl, case.name, T, H, D if with_out else None, dtype, variant, metric, t, nbytes,
                         ceiling, note, layout)
            if upstream:
                self._upstream(rec)
            self.add(rec)

        for impl in self.impls:
            try:
                bound = self._bind_mask(impl, lse, out, qsl_np, cu_np, lse_layout)
                sync = self.sync if impl == "triton" else bound.results
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # donation is a no-op on some CPU builds
                    if impl == "triton":
                        g = self.triton_gpu_time(bound.call)
                        est = g[0][1]
                    else:
                        g = self.jax_gpu_time(bound.call, sync, est)
                    lat = self.latency(bound.call, sync, est)
                    eag = self.eager(impl, bound.call, sync)
                if impl == "pallas":
                    lat = (lat[0], lat[1].replace("public API", "jax.jit(mask_empty_context_lse, donate) chained"),
                           lat[2])
                for metric, t in (("gpu_time", g), ("latency", lat), ("eager", eag)):
                    add(impl, metric, t)
                results[impl] = (g, lat, eag)
                if impl == "triton" and self.on_gpu:  # its torch.library op, like for like
                    qsl, cu = (torch.from_numpy(v).to(self.device) for v in (qsl_np, cu_np))
                    op = functools.partial(torch.ops.mla_lse_merge.mask_empty_context_lse, lse, qsl, cu, out,
                                           has_empty=True, lse_layout=lse_layout)
                    add("triton-op", "eager", timers.time_do_bench(op))
                    add("triton-op", "latency", self.latency(op, self.sync, est), upstream=False)
                del bound
                self.mask_host(impl, case, variant, lse_layout)
            except Exception as e:  # noqa: BLE001
                self.error(label, impl, e)
        self._ratio_and_progress(idx, label, results, nbytes, first)
        # The same bytes written by a plain fill, timed the same way: the practical floor of this workload.
        buf = torch.empty(max(1, nbytes // 4), device=self.device)
        rec = record("mask", "torch", case.name, T, H, D if with_out else None, "float32", variant + " floor",
                     "gpu_time", self.triton_gpu_time(lambda: buf.fill_(1.0)), nbytes, ceiling,
                     "c.fill_(1) of exactly the mask's bytes (one contiguous buffer)", layout)
        self.add(rec)
        self.progress(f"  same bytes by fill_: {rec['p50']:.2f} us")
        rec = buf = None
        self.cleanup()
        self.save()

    @staticmethod
    def _tiny_mask_case(case: cases.Case) -> cases.Case:
        """HOST_T tokens in two requests, the first with an empty context chunk."""
        return cases.Case(f"host_T{P.HOST_T}", (P.HOST_T // 2,) * 2, (0,), num_heads=case.num_heads,
                          head_dim=case.head_dim, dtype=case.dtype)

    def mask_host(self, impl: str, case: cases.Case, variant: str, lse_layout: str) -> None:
        """The `host` record of the mask of `case`'s heads and dtype, once per (impl, shape, variant, layout)."""
        tiny = self._tiny_mask_case(case)
        key = (impl, "mask", tiny.num_heads, tiny.head_dim, tiny.dtype, variant, lse_layout)
        if key in self.host_done:
            return
        self.host_done.add(key)
        with_out = variant == "lse+out"
        lse, out, qsl_np, cu_np = self._mask_inputs(tiny, with_out, lse_layout)
        bound = self._bind_mask(impl, lse, out, qsl_np, cu_np, lse_layout)
        sync = self.sync if impl == "triton" else bound.results
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t = self.host(bound.call, sync, f"public API on T={P.HOST_T}")
        nbytes = P.mask_bytes(tiny, variant)
        self.add(record("mask", impl, tiny.name, P.HOST_T, tiny.num_heads, tiny.head_dim if with_out else None,
                        tiny.dtype if with_out else "float32", variant, "host", t, nbytes, None, None,
                        {"lse_layout": lse_layout, "lse_base": None, "partials_view": None}))

    @staticmethod
    def _upstream(rec: dict) -> None:
        if rec["op"] == "mask" and rec["variant"] == "lse" and rec["lse_layout"] == "HT":
            key = "mask_gpu_time_us" if rec["metric"] == "gpu_time" else "mask_latency_us"  # latency, eager: launch
            rec["upstream_us"] = P.UPSTREAM[key].get(rec["workload"])

    def _ratio_and_progress(self, idx: str, label: str, results: dict, nbytes: int, first: int) -> None:
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

    # -- 3. merges
    def _merge_sets(self, pt: P.MergePoint, k: int):
        """k random input sets of the point on the device (torch tensors, the gather view a strided view of a
        [T, N, H, D] buffer), and the fused offsets (numpy)."""
        import torch

        tdt = getattr(torch, pt.dtype)
        gen = torch.Generator(device=self.device).manual_seed(0)
        n = pt.n_inputs
        lse_shape = (n, pt.H, pt.T) if pt.lse_layout == "HT" else (n, pt.T, pt.H)
        sets = []
        for _ in range(k):
            if pt.view == "gather":
                o = torch.randn(pt.T, n, pt.H, pt.D, generator=gen, device=self.device, dtype=tdt).transpose(0, 1)
            else:
                o = torch.randn(n, pt.T, pt.H, pt.D, generator=gen, device=self.device, dtype=tdt)
            lse = torch.randn(*lse_shape, generator=gen, device=self.device).mul_(3.0).add_(4.0)
            sets.append({"o": o, "l": lse})
        offs = None
        if pt.variant == "fused":
            c = pt.fused_case()
            offs = cases.offsets_n(c) if pt.partials else cases.offsets(c)
        return sets, offs

    def merge(self, pt: P.MergePoint, idx: str) -> None:
        ceiling = self.doc["ceilings"].get("add_2r1w")
        k = P.rotation(pt.bytes, pt.memory, self.on_gpu)
        note = None if pt.bytes * k >= 3 * P.L2_BYTES else \
            f"L2 caveat: {k} set(s) x {pt.bytes / 1e6:.1f} MB < 3x L2"
        if k > 1:
            note = (note + "; " if note else "") + f"inputs rotated over {k} sets"
        if pt.variant == "chain":
            note = (note + "; " if note else "") + f"{pt.n_inputs - 1} chained 2-way merges with output LSE"
        sets, offs = self._merge_sets(pt, k)
        self.sync()
        results = {}
        est = pt.bytes / 3e12 * 1e6
        first = len(self.doc["records"])
        for impl in self.impls:
            if impl != "triton" and pt.view == "gather":
                self.doc["skipped"].append({"point": pt.label, "impl": impl,
                                            "reason": "the all-gather view is Triton only: JAX arrays have no "
                                                      "strides (a [T, N, H, D] buffer is transposed by a copy)"})
                continue
            try:
                results[impl] = self._merge_impl(impl, pt, sets, offs, ceiling=ceiling, note=note, est=est)
                est = results[impl][0][0][1]
                self.merge_host(impl, pt)
            except Exception as e:  # noqa: BLE001
                self.error(pt.label, impl, e)
            self.cleanup()
        self._ratio_and_progress(idx, pt.label, results, pt.bytes, first)
        del sets, offs
        self.cleanup()
        self.save()

    def _bind_merge(self, a, impl: str, pt: P.MergePoint, s: dict, offs, jdev) -> list:
        """The prepared calls (`impls.Bound`) of one input set `s` (torch tensors; JAX shares them over DLPack):
        one call, or the chain of N - 1 two-way merges with output LSE."""
        import torch

        from parity.library import bridge
        from parity.harness import impls

        def arr(x):
            return x if impl == "triton" else bridge.torch_to_jax(x)

        def host(x):
            if impl == "triton":
                return torch.from_numpy(x).to(self.device)
            import jax

            return jax.device_put(x, jdev)

        o, lse = s["o"], s["l"]
        lay = dict(lse_layout=pt.lse_layout, lse_base=P.base_value(pt.lse_base))
        if pt.variant == "chain":  # the running state is the prefix, partial i the suffix
            if impl == "triton":
                calls, state = [], (o[0], lse[0])
                for i in range(1, pt.partials):
                    mid = (torch.empty_like(o[0]), torch.empty_like(lse[0]))
                    calls.append(a.bind_merge(state[0], state[1], o[i], lse[i], out=mid[0], out_lse=mid[1], **lay))
                    state = mid
                return calls
            parts = [(arr(o[i]), arr(lse[i])) for i in range(pt.partials)]
            last = {}

            def chain():  # functional: each merge reads the previous result
                state = parts[0]
                for p in parts[1:]:
                    r = a.merge(state[0], state[1], p[0], p[1], **lay)
                    state = (r["out"], r["lse"])
                last["r"] = state

            return [impls.Bound(chain, lambda: self._block(last["r"]))]
        kw = dict(return_lse=pt.output_lse, **lay)
        if impl == "triton":
            lse_shape = (pt.H, pt.T) if pt.lse_layout == "HT" else (pt.T, pt.H)
            kw.update(out=torch.empty(pt.T, pt.H, pt.D, dtype=o.dtype, device=self.device),
                      out_lse=torch.empty(*lse_shape, device=self.device) if pt.output_lse else None)
        if pt.op == "merge":
            if offs is not None:
                kw.update(query_start_loc=host(offs[0]), prefix_cu_seq_lens=host(offs[1]))
            return [a.bind_merge(arr(o[0]), arr(lse[0]), arr(o[1]), arr(lse[1]), **kw)]
        if offs is not None:
            kw.update(query_start_loc=host(offs[0]), cu_seq_lens=host(offs[1]))
        return [a.bind_merge_n(arr(o), arr(lse), **kw)]

    @staticmethod
    def _block(x):
        import jax

        jax.block_until_ready(x)

    def _merge_calls(self, impl: str, pt: P.MergePoint, sets, offs):
        """(call, sync) of `impl` on `sets`: each call runs the next set (rotation)."""
        from parity.library import bridge

        a = self.adapter(impl)
        jdev = bridge.jax_device_for(sets[0]["o"].device) if impl != "triton" else None
        bound = [self._bind_merge(a, impl, pt, s, offs, jdev) for s in sets]
        counter = [0]

        def call():
            for b in bound[counter[0] % len(bound)]:
                b.call()
            counter[0] += 1

        def sync():  # JAX: block on the results of the set called last
            if impl == "triton":
                self.sync()
                return
            for b in bound[(counter[0] - 1) % len(bound)]:
                b.results()

        return call, sync

    def _merge_impl(self, impl: str, pt: P.MergePoint, sets, offs, *, ceiling, note, est):
        call, sync = self._merge_calls(impl, pt, sets, offs)
        if impl == "triton":
            g = self.triton_gpu_time(call)
            lat = self.latency(call, sync, g[0][1])
        else:
            g = self.jax_gpu_time(call, sync, est)
            lat = self.latency(call, sync, est)
        eag = self.eager(impl, call, sync)
        for metric, t in (("gpu_time", g), ("latency", lat), ("eager", eag)):
            self.add(record(pt.op, impl, pt.workload, pt.T, pt.H, pt.D, pt.dtype, pt.variant, metric, t, pt.bytes,
                            ceiling, note, pt.layout_fields))
        return g, lat, eag

    def merge_host(self, impl: str, pt: P.MergePoint) -> None:
        """The `host` record of `pt`'s op, variant, heads, head size, dtype and layout on HOST_T tokens, once."""
        tiny = dataclasses.replace(pt, T=P.HOST_T)
        if (impl, tiny) in self.host_done:
            return
        self.host_done.add((impl, tiny))
        sets, offs = self._merge_sets(tiny, 1)
        call, sync = self._merge_calls(impl, tiny, sets, offs)
        t = self.host(call, sync, f"public API on T={P.HOST_T}")
        self.add(record(tiny.op, impl, tiny.workload, tiny.T, tiny.H, tiny.D, tiny.dtype, tiny.variant, "host", t,
                        tiny.bytes, None, None, tiny.layout_fields))

    # -- 4. JAX: a new batch of the same shapes traces nothing
    def retrace_check(self) -> None:
        """Each jitted public `pallas_impl` function on HOST_T tokens: a first batch, then a batch of the same
        shapes with other offsets and `prefill_tokens_with_context`; the second must trace and compile nothing
        (docs/design.md: batch-varying values are runtime values)."""
        import jax

        from parity.harness import impls

        jdev = jax.devices()[0]
        a = impls.adapter(self.rt, "pallas")
        T, H, D = P.HOST_T, 2, 64
        rng = np.random.default_rng(0)
        o = [jax.device_put(rng.standard_normal((T, H, D)).astype(np.float32), jdev) for _ in range(2)]
        on = jax.device_put(rng.standard_normal((3, T, H, D)).astype(np.float32), jdev)
        lse = [jax.device_put(rng.standard_normal((H, T)).astype(np.float32), jdev) for _ in range(2)]
        lsen = jax.device_put(rng.standard_normal((3, H, T)).astype(np.float32), jdev)
        # Two batches of 3 requests each: other lengths, other empty requests, other prefill_tokens_with_context.
        batches = [(np.array([0, 4, 10, 16], np.int32), np.array([0, 0, 5, 9], np.int32), 12),
                   (np.array([0, 7, 8, 16], np.int32), np.array([0, 3, 3, 3], np.int32), 16)]

        def put(x):
            return jax.device_put(x, jdev)

        def cu_n(cu):
            return np.stack([cu, cu * 2, np.zeros_like(cu)])

        ops = {
            "mask": lambda qsl, cu, p: a.mask(lse[0], put(qsl), put(cu), has_empty=True),
            "merge fused": lambda qsl, cu, p: a.merge(o[0], lse[0], o[1], lse[1], query_start_loc=put(qsl),
                                                      prefix_cu_seq_lens=put(cu), prefill_tokens_with_context=p),
            "merge_n fused": lambda qsl, cu, p: a.merge_n(on, lsen, query_start_loc=put(qsl),
                                                          cu_seq_lens=put(cu_n(cu)), prefill_tokens_with_context=p),
        }
        for name, fn in ops.items():
            try:
                counts = []
                for qsl, cu, p in batches:
                    with timers.TraceCounter() as c:
                        r = fn(qsl, cu, p)
                        jax.block_until_ready(r)
                    counts.append((c.traces, c.compiles))
                rec = {"op": name, "impl": "pallas", "T": T, "H": H, "D": D,
                       "first_batch": {"traces": counts[0][0], "compiles": counts[0][1]},
                       "new_batch": {"traces": counts[1][0], "compiles": counts[1][1]},
                       "ok": counts[1] == (0, 0),
                       "method": "jax.monitoring duration events (jaxpr traces, backend compiles) during one call "
                                 "and its block_until_ready; new batch: other offsets and "
                                 "prefill_tokens_with_context (a Python int), the same shapes"}
                self.doc["retrace"].append(rec)
                self.progress(f"  retrace {name}: first batch {counts[0][0]} traces / {counts[0][1]} compiles, "
                              f"new batch {counts[1][0]} / {counts[1][1]}")
                if not rec["ok"]:
                    self.error(f"retrace {name}", "pallas", RuntimeError(
                        f"a new batch of the same shapes traced {counts[1][0]} and compiled {counts[1][1]} times"))
            except Exception as e:  # noqa: BLE001
                self.error(f"retrace {name}", "pallas", e)
        self.save()

    # -- driver
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

    def run(self) -> None:
        work = self.work()
        self.progress(f"bench mode={self.mode} device={self.device} impls={','.join(self.impls)}: "
                      f"{len(work)} points" + (f", budget {self.budget_s:.0f} s" if self.budget_s else ""))
        try:
            self.ceilings()
        except Exception as e:  # noqa: BLE001 - fractions become null; the points still run
            self.error("ceilings", "torch", e)
            self.cleanup()
        if "pallas" in self.impls and not getattr(self.args, "no_retrace", False):
            self.retrace_check()
        for i, (kind, item, label) in enumerate(work, 1):
            idx = f"{i}/{len(work)}"
            try:
                self.check_budget()
            except _Budget:
                rest = [w[2] for w in work[i - 1:]]
                self.doc["skipped"] += [{"point": r, "reason": "time budget"} for r in rest]
                self.progress(f"[{idx}] time budget of {self.budget_s:.0f} s spent: skipping {len(rest)} points")
                self.save()
                break
            if kind == "merge" and item.memory > P.MEMORY_CAP_BYTES:
                self.doc["skipped"].append({"point": label, "reason": f"needs {item.memory / 1e9:.1f} GB > "
                                                                       f"{P.MEMORY_CAP_BYTES / 1e9:.0f} GB"})
                self.progress(f"[{idx}] {label}: skipped (needs {item.memory / 1e9:.1f} GB)")
                continue
            try:
                if kind == "mask":
                    self.mask(*item, idx)
                else:
                    self.merge(item, idx)
            except Exception as e:  # noqa: BLE001 - setup failure (e.g. out of memory): next point
                self.error(label, "setup", e)
                self.cleanup()
        self.doc["elapsed_s"] = round(time.monotonic() - self.t_start, 1)
        self.save()
