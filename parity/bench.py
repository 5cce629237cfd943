"""Benchmarks: `python -m parity bench` (STYLE 5). One GPU, one run, both frameworks.

What is measured, in this order:

1. **Ceilings** of the same run: two-read-one-write `torch.add(a, b, out=c)` and write-only `c.fill_(1)` on
   2 GiB bf16 tensors (bytes = reads + writes), timed by CUDA-graph replay.
2. **Mask** on the docs/spec.md 7 seed workloads (`parity.cases`, tag "seed"), public API with `has_empty=True`,
   variants `lse` (LSE only, as upstream) and `lse+out` (the output rows are zeroed too).
   Bytes = masked tokens * H * 4 (+ masked tokens * H * D * out bytes for `lse+out`); compared with the
   write-only ceiling and with upstream's published H200 numbers (docs/spec.md 7, `UPSTREAM`).
3. **Merge** over T x H x D x dtype x variant (`merge_points`): `plain` (no output LSE), `lse` (output LSE),
   `fused` (fused mask, docs/spec.md 4.5, plus output LSE; 128-token requests, every even one empty in the
   prefix). Bytes = 2*T*H*D*in + T*H*D*out + 2*T*H*4 (+ T*H*4 with an output LSE); offsets are not counted.
   Compared with the two-read-one-write ceiling and upstream's 1.18 TB/s.
4. **N-way merge** (docs/spec.md 8) over N x T x variant at H = 64, D = 128, bf16 (`merge_points`): the same
   variants (`fused`: each partial's KV offsets, with partials empty for some requests), and `chain`: the same
   N-way merge done as N - 1 chained 2-way merges with output LSE (the alternative the N-way kernel replaces).
   Bytes = N*(T*H*D*in + T*H*4) + T*H*D*out (+ T*H*4 with an output LSE), for `chain` too (its useful bytes).

Two labelled numbers per point (each record carries its `method`):

- `gpu_time`: Triton via `triton.testing.do_bench_cudagraph` (graph replay on a side stream; quantiles over its
  replays, each the mean of the calls in the graph). JAX via `jax.profiler` kernel time (CUPTI; the sum of
  the kernels of one call, quantiles over calls); if the trace holds no GPU kernels, back-to-back dispatches
  of the jitted call with one sync at the end, divided by N (labelled; an upper bound when the kernel is
  shorter than a dispatch). Never a jitted `fori_loop` chain (docs/spec.md 6: XLA copies the loop-carried buffers).
- `latency`: wall clock over N back-to-back calls of the public API with one sync at the end, divided by N;
  quantiles over trials. The JAX mask is the documented in-place form, `jax.jit(..., donate_argnums=0)`,
  chained (output fed back as input; the mask is idempotent).
- `launch` (the Triton mask, GPU only): `triton.testing.do_bench` over back-to-back calls, the method behind
  upstream's launch-inclusive figures, for the plain function (impl "triton") and for its `torch.library` op
  (impl "triton-op", `torch.ops.mla_lse_merge.mask_empty_context_lse`; also its `latency`): like for like.

Inputs are rotated over enough copies that one pass exceeds 3x the L2 (`L2_BYTES`) for the merge; the mask's
working set is L2-resident on every seed workload (as in upstream's graph-replay numbers) and its records
say so in `note`. `--smoke` checks the plumbing with tiny shapes (interpreters on CPU): no claims.

Output: a table on stdout, progress on stderr, `--json FILE` (schema below, rewritten after every point so a
killed run keeps what it measured), `--plot FILE` (PNG drawn from the JSON only, `plot_from_json`).

JSON: {"schema": 1, "mode", "env": {...}, "reference": UPSTREAM, "ceilings": {...}, "records": [{op, impl,
workload, T, H, D, dtype, variant, metric, unit, method, p20, p50, p80, bytes, tbps, frac_ceiling, n, note,
...}], "skipped": [...], "errors": [...]}.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import glob
import json
import math
import os
import shutil
import sys
import tempfile
import time
import warnings

import numpy as np

from parity import cases

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and JAX share the GPU (docs/spec.md 6)

SCHEMA = 1
QUANTILES = (0.2, 0.5, 0.8)
L2_BYTES = 60e6  # H200 L2 rounded up: a working set below ~3x this is partly served from cache
MEMORY_CAP_BYTES = 60e9  # merge points needing more (inputs + output + LSEs) are skipped
CEILING_ELEMS = 1 << 30  # 2 GiB of bf16 per tensor
MAX_ROTATION = 16

# docs/spec.md 7: upstream's kernels measured on an H200 (and the B300 mask numbers), for comparison only.
UPSTREAM = {
    "source": "docs/spec.md section 7 (upstream vLLM kernels, H200)",
    "mask_gpu_time_us": {"2k_balanced": 2.0, "32k_balanced": 4.2, "131k_skewed": 9.8},
    "mask_latency_us": {"2k_balanced": 5.6, "32k_balanced": 8.2, "131k_skewed": 14.9},
    "mask_latency_b300_us": {"2k_balanced": 12.51, "32k_balanced": 12.57, "131k_skewed": 13.18},
    "merge_tbps": 1.18,
    "merge_note": "T=32K..131K, H=64/128, D=128, bf16; one (token, head) per program",
    "add_2r1w_tbps": 4.41,
    "fill_w_tbps": 3.40,
}

FORMULAS = {
    "merge": "bytes = 2*T*H*D*in_bytes + T*H*D*out_bytes + 2*T*H*4 (+ T*H*4 with an output LSE)",
    "merge_n": "bytes = N*(T*H*D*in_bytes + T*H*4) + T*H*D*out_bytes (+ T*H*4 with an output LSE); variant chain "
               "(N - 1 chained 2-way merges) is charged the same bytes",
    "mask": "bytes = masked_tokens*H*4 (+ masked_tokens*H*D*out_bytes with variant lse+out)",
    "ceiling": "add: 3 * 2 GiB (two reads, one write); fill: 2 GiB (one write); noop: an empty Triton kernel "
               "(gpu_time) and its launch, and a jitted JAX identity (latency): the host floors of `latency`",
    "tbps": "bytes / p50 time / 1e12; frac_ceiling = tbps / ceiling tbps of this run (gpu_time)",
}

_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
_SHORT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
MERGE_VARIANTS = ("plain", "lse", "fused")
N_WAY_VARIANTS = ("plain", "lse", "fused", "chain")
MASK_VARIANTS = ("lse", "lse+out")
FUSED_REQUEST_LEN = 128

# Grids per mode: (T values, H values, D values, dtypes, merge variants, mask variants).
_GRIDS = {
    "full": ((2048, 32768, 131072), (16, 64, 128), (128, 512), ("bfloat16", "float32"), MERGE_VARIANTS,
             MASK_VARIANTS),
    "quick": ((2048, 32768, 131072), (64,), (128,), ("bfloat16",), MERGE_VARIANTS, MASK_VARIANTS),
    "smoke": ((256,), (2,), (64,), ("bfloat16",), MERGE_VARIANTS, ("lse",)),
}
SMOKE_MASK_CASES = ("upstream_vector",)  # tiny "ci" workload: the seed ones are too big for interpreters


# --------------------------------------------------------------------------------------------------------
# Workloads and byte formulas


@dataclasses.dataclass(frozen=True)
class MergePoint:
    """One merge benchmark point: outputs dtype[T, H, D], LSEs f32[H, T]; `partials` N > 0 for the N-way merge
    of dtype[N, T, H, D] (docs/spec.md 8), 0 for the 2-way merge (4)."""

    T: int
    H: int
    D: int
    dtype: str
    variant: str  # "plain" | "lse" | "fused" | "chain" (N-way only: N - 1 chained 2-way merges)
    partials: int = 0

    @property
    def op(self) -> str:
        return "merge_n" if self.partials else "merge"

    @property
    def n_inputs(self) -> int:
        return self.partials or 2

    @property
    def elems(self) -> int:
        return self.T * self.H * self.D

    @property
    def output_lse(self) -> bool:
        return self.variant != "plain"

    @property
    def bytes(self) -> int:
        """Effective bytes of one call (`FORMULAS`); the output dtype is the input dtype."""
        in_b = _ITEMSIZE[self.dtype]
        th = self.T * self.H
        return self.n_inputs * (self.elems * in_b + th * 4) + self.elems * in_b + (th * 4 if self.output_lse else 0)

    @property
    def memory(self) -> int:
        """Device bytes of one input/output set (both frameworks' outputs are not alive together)."""
        return (self.n_inputs + 1) * (self.elems * _ITEMSIZE[self.dtype] + self.T * self.H * 4)

    @property
    def workload(self) -> str:
        return f"T={self.T} H={self.H} D={self.D}" + (f" N={self.partials}" if self.partials else "")

    @property
    def label(self) -> str:
        return f"{self.op} {self.workload} {self.dtype} {self.variant}"

    def fused_case(self) -> cases.Case:
        """The fused variant's batch: 128-token requests. 2-way: every even-indexed one empty in the prefix.
        N-way: contexts of 0 to 3 * N tokens spread one token per partial, so partials are empty for some."""
        n = self.T // FUSED_REQUEST_LEN
        if self.partials:
            ctx = tuple(int(x) for x in np.random.default_rng(n).integers(0, 3 * self.partials + 1, size=n))
            return cases.Case(f"fused_n{self.partials}_T{self.T}", (FUSED_REQUEST_LEN,) * n, (), num_heads=self.H,
                              head_dim=self.D, dtype=self.dtype, partials=self.partials, context_lens=ctx)
        return cases.Case(f"fused_T{self.T}", (FUSED_REQUEST_LEN,) * n, tuple(range(0, n, 2)),
                          num_heads=self.H, head_dim=self.D, dtype=self.dtype)


# N-way points per mode: (N values, T values, variants); H = 64, D = 128, bf16.
_N_GRIDS = {
    "full": ((2, 4, 8), (2048, 32768, 131072), N_WAY_VARIANTS),
    "quick": ((2, 4, 8), (32768, 131072), N_WAY_VARIANTS),
    "smoke": ((3,), (256,), N_WAY_VARIANTS),
}


def merge_points(mode: str) -> list[MergePoint]:
    """The merge grid of `mode` ("full", "quick", "smoke"), smallest working sets first, then the N-way points
    (the chained alternative only at N = 4, the issue's comparison point)."""
    t_vals, h_vals, d_vals, dtypes, variants, _ = _GRIDS[mode]
    pts = [MergePoint(t, h, d, dt, v) for dt in dtypes for d in d_vals for h in h_vals for t in t_vals
           for v in variants]
    pts = sorted(pts, key=lambda p: (p.dtype != "bfloat16", p.elems, p.D, MERGE_VARIANTS.index(p.variant)))
    n_vals, t_vals, variants = _N_GRIDS[mode]
    h, d = (2, 64) if mode == "smoke" else (64, 128)
    pts += [MergePoint(t, h, d, "bfloat16", v, n) for t in t_vals for n in n_vals for v in variants
            if v != "chain" or n == (3 if mode == "smoke" else 4)]
    return pts


def mask_cases(mode: str) -> list[cases.Case]:
    if mode == "smoke":
        return [cases.by_name(n) for n in SMOKE_MASK_CASES]
    return cases.select("seed")


def masked_tokens(case: cases.Case) -> int:
    """Query tokens of the requests whose context chunk is empty (decided from the offsets, docs/spec.md 3)."""
    qsl, cu = cases.offsets(case)
    lens, empty = np.diff(qsl), np.diff(cu) == 0
    return int(lens[empty].sum())


def mask_bytes(case: cases.Case, variant: str) -> int:
    """Bytes written by one mask call (`FORMULAS["mask"]`)."""
    n = masked_tokens(case)
    b = n * case.num_heads * 4
    if variant == "lse+out":
        b += n * case.num_heads * case.head_dim * _ITEMSIZE[case.dtype]
    return b


def _rotation(bytes_per_call: int, memory_per_set: int, on_gpu: bool) -> int:
    """Input/output sets to cycle through so one pass over them exceeds 3x L2 (1 when already large)."""
    if not on_gpu or bytes_per_call >= 3 * L2_BYTES:
        return 1
    k = math.ceil(3 * L2_BYTES / max(bytes_per_call, 1))
    return max(1, min(k, MAX_ROTATION, int(MEMORY_CAP_BYTES // max(memory_per_set, 1))))


# --------------------------------------------------------------------------------------------------------
# Timers. Each returns (p20, p50, p80) in microseconds, the method string, and the call count.


@functools.cache
def noop_kernel():
    """An empty Triton kernel (built on first use: triton is imported only when benchmarking)."""
    import triton

    @triton.jit
    def _noop(x_ptr):
        pass

    return _noop


def _quantiles(samples) -> tuple[float, float, float]:
    a = np.asarray(samples, dtype=np.float64)
    return tuple(float(np.percentile(a, q * 100.0)) for q in QUANTILES)


def time_cudagraph(fn, rep_ms: float):
    """GPU time of `fn` (torch/Triton launches only) by CUDA-graph replay."""
    import triton.testing

    ms = triton.testing.do_bench_cudagraph(fn, rep=rep_ms, quantiles=list(QUANTILES))
    q = tuple(float(x) * 1e3 for x in ms)
    return q, "triton.testing.do_bench_cudagraph: graph replay, quantiles over 10 replays (each the mean " \
              "of the calls captured in the graph)", None


def time_do_bench(fn):
    """Launch-inclusive time of one call: `triton.testing.do_bench` (CUDA events around each of many
    back-to-back calls, L2 flushed in between), the method behind upstream's launch-inclusive figures."""
    import triton.testing

    ms = triton.testing.do_bench(fn, warmup=25, rep=100, quantiles=list(QUANTILES))
    return tuple(float(x) * 1e3 for x in ms), "triton.testing.do_bench: CUDA events around each call, calls back " \
                                            "to back with an L2 flush between them; quantiles over calls", None


def time_wall(call, sync, n: int, trials: int, what: str = "public API"):
    """Per-call wall clock: `n` back-to-back calls, one sync at the end, divided by `n`; quantiles over trials."""
    call()
    sync()
    samples = []
    for _ in range(trials):
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            call()
        sync()
        samples.append((time.perf_counter() - t0) / n * 1e6)
    return _quantiles(samples), f"wall clock over {n} back-to-back calls of the {what}, one sync at the " \
                                f"end, /{n}; quantiles over {trials} trials", n


_DERIVED_LINES = ("XLA Modules", "XLA Ops", "Steps", "Launch Stats", "Source code", "Framework",
                  "XLA TraceMe", "TensorFlow")


def gpu_kernel_events(profile) -> list[tuple[float, float, str]]:
    """(start_ns, duration_ns, name) of the device activity in a `jax.profiler.ProfileData`.

    Uses the first "/device:GPU" plane that has events, and its per-stream lines ("Stream #..."); if a plane
    has no such lines, every line except derived summaries (`_DERIVED_LINES`), which would double count.
    """
    for plane in profile.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        lines = list(plane.lines)
        chosen = [ln for ln in lines if ln.name.startswith("Stream")]
        if not chosen:
            chosen = [ln for ln in lines if not ln.name.startswith(_DERIVED_LINES)]
        events = [(float(e.start_ns), float(e.duration_ns), e.name) for ln in chosen for e in ln.events]
        if events:
            return sorted(events)
    return []


def per_call_us(events, n: int):
    """Split sorted device events of `n` identical calls into per-call kernel-time sums (microseconds).

    Returns (quantiles, note) or None without events. When the event count is a multiple of `n`, each call
    is the sum of k = count / n consecutive events; otherwise every quantile is the mean per call.
    """
    if not events or n <= 0:
        return None
    if len(events) % n == 0:
        k = len(events) // n
        per = [sum(d for _, d, _ in events[i * k:(i + 1) * k]) / 1e3 for i in range(n)]
        return _quantiles(per), f"{k} kernel(s) per call"
    mean = sum(d for _, d, _ in events) / 1e3 / n
    return (mean, mean, mean), f"{len(events)} events for {n} calls: mean only"


def time_jax_profiler(call, sync, n: int):
    """JAX GPU time from the profiler's kernel durations over `n` back-to-back calls; None without GPU events."""
    import jax

    call()
    sync()
    log_dir = tempfile.mkdtemp(prefix="parity_bench_trace_")
    try:
        try:
            opts = jax.profiler.ProfileOptions()
            opts.python_tracer_level = 0
            jax.profiler.start_trace(log_dir, profiler_options=opts)
        except TypeError:  # an older jax without profiler_options
            jax.profiler.start_trace(log_dir)
        try:
            for _ in range(n):
                call()
            sync()
        finally:
            jax.profiler.stop_trace()
        files = sorted(glob.glob(os.path.join(log_dir, "**", "*.xplane.pb"), recursive=True))
        if not files:
            return None
        got = per_call_us(gpu_kernel_events(jax.profiler.ProfileData.from_file(files[-1])), n)
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)
    if got is None:
        return None
    q, note = got
    return q, f"jax.profiler kernel time (CUPTI) over {n} back-to-back calls, {note}; quantiles over calls", n


def time_jax_gpu(call, sync, n: int, trials: int, use_profiler: bool):
    """JAX GPU time: profiler kernel time, else a labelled dispatch loop."""
    call()  # compile and warm up outside the profiler: a kernel error is the kernel's, not the profiler's
    sync()
    if use_profiler:
        try:
            got = time_jax_profiler(call, sync, n)
        except Exception as e:  # noqa: BLE001 - the profiler is optional; fall back, labelled
            _log(f"  jax profiler unavailable ({type(e).__name__}: {e}); using the dispatch loop")
            got = None
        if got is not None:
            return got
    q, _, n = time_wall(call, sync, n, trials, what="jitted call")
    return q, f"jax dispatch loop: wall clock over {n} back-to-back jitted calls, one sync, /{n} (upper " \
              f"bound when the kernel is shorter than a dispatch); quantiles over {trials} trials", n


# --------------------------------------------------------------------------------------------------------
# Environment, records, JSON


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _record(op, impl, workload, T, H, D, dtype, variant, metric, timing, nbytes, ceiling_tbps, note=None):
    q, method, n = timing
    p50 = q[1]
    tbps = nbytes / (p50 * 1e-6) / 1e12 if p50 > 0 else None
    frac = tbps / ceiling_tbps if (tbps is not None and ceiling_tbps) else None
    return {"op": op, "impl": impl, "workload": workload, "T": T, "H": H, "D": D, "dtype": dtype,
            "variant": variant, "metric": metric, "unit": "us", "method": method,
            "p20": q[0], "p50": q[1], "p80": q[2], "bytes": int(nbytes), "tbps": tbps, "frac_ceiling": frac,
            "n": n, "note": note}


def _write_json(doc: dict, path: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------------------
# The runner


class _Budget(Exception):
    pass


class _Runner:
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
        self.doc = {"schema": SCHEMA, "mode": mode, "env": {}, "reference": UPSTREAM, "formulas": FORMULAS,
                    "ceilings": {}, "records": [], "skipped": [], "errors": []}
        from parity import impls

        self.rt = impls.make_runtime()
        # Reps: do_bench_cudagraph's `rep` (ms), the target wall time of one latency trial, trial count.
        self.rep_ms, self.target_s, self.trials = {"full": (20, 0.02, 5), "quick": (20, 0.02, 5),
                                                   "smoke": (2, 0.0, 1)}[mode]

    # -- helpers
    def progress(self, msg: str) -> None:
        if not self.quiet:
            _log(msg)

    def check_budget(self) -> None:
        if self.budget_s is not None and time.monotonic() - self.t_start > self.budget_s:
            raise _Budget()

    def adapter(self, impl: str):
        """The `parity.impls` adapter of "triton" or "pallas" (how the harness runs each implementation)."""
        from parity import impls

        return impls.adapter(self.rt, impl)

    def sync(self) -> None:
        if self.on_gpu:
            import torch

            torch.cuda.synchronize()

    def n_calls(self, est_us: float, lo: int = 3, hi: int = 200) -> int:
        if self.mode == "smoke":
            return 1
        return int(min(hi, max(lo, math.ceil(self.target_s * 1e6 / max(est_us, 1.0)))))

    def save(self) -> None:
        path = getattr(self.args, "json", None)
        if path:
            _write_json(self.doc, path)

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

    def triton_gpu_time(self, fn):
        if self.on_gpu:
            return time_cudagraph(fn, self.rep_ms)
        q, method, n = time_wall(fn, self.sync, 1, self.trials)
        return q, "smoke (CPU interpreter): " + method + " - no claim", n

    def jax_gpu_time(self, call, sync, est_us: float):
        if self.on_gpu:
            return time_jax_gpu(call, sync, self.n_calls(est_us, lo=5, hi=100), self.trials, self.use_profiler)
        q, method, n = time_wall(call, sync, 1, self.trials, what="jitted call")
        return q, "smoke (CPU interpret mode): " + method + " - no claim", n

    def latency(self, call, sync, est_us: float):
        q, method, n = time_wall(call, sync, self.n_calls(est_us), self.trials)
        return q, ("smoke: " + method + " - no claim") if not self.on_gpu else method, n

    # -- 1. ceilings
    def ceilings(self) -> None:
        import torch

        n = CEILING_ELEMS if self.on_gpu and self.mode != "smoke" else 1 << 16
        self.progress(f"ceilings: torch.add(a, b, out=c) and c.fill_(1) on {n * 2 / 2**30:.3g} GiB bf16 tensors")
        a = torch.ones(n, dtype=torch.bfloat16, device=self.device)
        b = torch.ones(n, dtype=torch.bfloat16, device=self.device)
        c = torch.empty(n, dtype=torch.bfloat16, device=self.device)
        self.sync()
        specs = (("add_2r1w", "torch.add(a, b, out=c)", lambda: torch.add(a, b, out=c), 3 * 2 * n),
                 ("fill_w", "c.fill_(1)", lambda: c.fill_(1.0), 2 * n))
        for key, variant, fn, nbytes in specs:
            t = self.triton_gpu_time(fn)
            rec = _record("ceiling", "torch", key, None, None, None, "bfloat16", variant, "gpu_time", t,
                          nbytes, None)
            self.doc["ceilings"][key] = rec["tbps"]
            self.add(rec)
            self.progress(f"  {key}: {rec['p50']:.1f} us, {rec['tbps']:.3f} TB/s")
        a = b = c = fn = specs = None  # free the 6 GiB of inputs before the next step
        # The fixed cost of one kernel in the same timing method: a no-op Triton kernel.
        x = torch.zeros(16, device=self.device)
        kernel = noop_kernel()
        rec = _record("ceiling", "triton", "noop_kernel", None, None, None, "float32", "empty @triton.jit kernel",
                      "gpu_time", self.triton_gpu_time(lambda: kernel[(1,)](x)), 0, None)
        self.doc["ceilings"]["noop_kernel_us"] = rec["p50"]
        self.add(rec)
        self.progress(f"  noop_kernel: {rec['p50']:.2f} us")
        # Host floors of the latency metric, same method: launching an empty Triton kernel from Python, and
        # dispatching a jitted JAX identity. No public call of either framework can be faster on this host.
        lat = self.latency(lambda: kernel[(1,)](x), self.sync, 1.0)
        rec = _record("ceiling", "triton", "noop_launch", None, None, None, "float32", "empty kernel launch",
                      "latency", lat, 0, None)
        self.doc["ceilings"]["noop_launch_us"] = rec["p50"]
        self.add(rec)
        try:
            import jax
            import jax.numpy as jnp

            ident = jax.jit(lambda v: v + 1)
            state = [jnp.zeros(16)]

            def jcall():
                state[0] = ident(state[0])

            lat = self.latency(jcall, lambda: jax.block_until_ready(state), 1.0)
            rec = _record("ceiling", "jax", "jit_dispatch", None, None, None, "float32", "jax.jit(lambda v: v + 1)",
                          "latency", lat, 0, None)
            self.doc["ceilings"]["jit_dispatch_us"] = rec["p50"]
            self.add(rec)
        except Exception as e:  # noqa: BLE001 - informational floor
            self.error("jit_dispatch floor", "jax", e)
        self.progress(f"  host floors: empty Triton launch {self.doc['ceilings']['noop_launch_us']:.1f} us, "
                      f"jitted JAX dispatch {self.doc['ceilings'].get('jit_dispatch_us', float('nan')):.1f} us")
        self.cleanup()
        self.save()

    # -- 2. mask
    def mask(self, case: cases.Case, variant: str, idx: str) -> None:
        import torch

        from parity import bridge

        label = f"mask {case.name} {variant}"
        T, H, D = case.num_tokens, case.num_heads, case.head_dim
        nbytes = mask_bytes(case, variant)
        ceiling = self.doc["ceilings"].get("fill_w")
        with_out = variant == "lse+out"
        dtype = case.dtype if with_out else "float32"
        work = T * H * 4 + (T * H * D * _ITEMSIZE[case.dtype] if with_out else 0)
        note = f"L2-resident working set ({work / 1e6:.1f} MB <= 3x L2)" if work < 3 * L2_BYTES else None
        qsl_np, cu_np = cases.offsets(case)
        gen = torch.Generator(device=self.device).manual_seed(0)
        lse = torch.randn(H, T, generator=gen, device=self.device, dtype=torch.float32).mul_(3.0).add_(4.0)
        out = torch.randn(T, H, D, generator=gen, device=self.device, dtype=getattr(torch, case.dtype)) \
            if with_out else None
        qsl = torch.from_numpy(qsl_np).to(self.device)
        cu = torch.from_numpy(cu_np).to(self.device)
        self.sync()
        results = {}
        est = 10.0
        if "triton" in self.impls:
            try:
                bound = self.adapter("triton").bind_mask(lse, qsl, cu, out, has_empty=True, in_place=True)
                g = self.triton_gpu_time(bound.call)
                est = g[0][1]
                lat = self.latency(bound.call, self.sync, est)
                for metric, t in (("gpu_time", g), ("latency", lat)):
                    rec = _record("mask", "triton", case.name, T, H, D if with_out else None, dtype, variant,
                                  metric, t, nbytes, ceiling, note)
                    self._upstream(rec)
                    self.add(rec)
                results["triton"] = (g, lat)
                if self.on_gpu:  # launch-inclusive, upstream's method: the function and its torch.library op
                    op = functools.partial(torch.ops.mla_lse_merge.mask_empty_context_lse, lse, qsl, cu, out,
                                           has_empty=True)
                    for impl, fn in (("triton", bound.call), ("triton-op", op)):
                        rec = _record("mask", impl, case.name, T, H, D if with_out else None, dtype, variant,
                                      "launch", time_do_bench(fn), nbytes, ceiling, note)
                        self._upstream(rec)
                        self.add(rec)
                    rec = _record("mask", "triton-op", case.name, T, H, D if with_out else None, dtype, variant,
                                  "latency", self.latency(op, self.sync, est), nbytes, ceiling, note)
                    self.add(rec)
            except Exception as e:  # noqa: BLE001
                self.error(label, "triton", e)
        if "pallas" in self.impls:
            try:
                import jax

                jdev = bridge.jax_device_for(lse.device)
                # The documented in-place form (impls: jit, the buffers donated, results fed back).
                bound = self.adapter("pallas").bind_mask(
                    bridge.torch_to_jax(lse), jax.device_put(qsl_np, jdev), jax.device_put(cu_np, jdev),
                    None if out is None else bridge.torch_to_jax(out), has_empty=True, donate=True)
                sync = bound.results
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # donation is a no-op on some CPU builds
                    g = self.jax_gpu_time(bound.call, sync, est)
                    lat = self.latency(bound.call, sync, est)
                lat = (lat[0], lat[1].replace("public API", "jax.jit(mask_empty_context_lse, donate) chained"), lat[2])
                for metric, t in (("gpu_time", g), ("latency", lat)):
                    rec = _record("mask", "pallas", case.name, T, H, D if with_out else None, dtype, variant,
                                  metric, t, nbytes, ceiling, note)
                    self._upstream(rec)
                    self.add(rec)
                results["pallas"] = (g, lat)
                del bound
            except Exception as e:  # noqa: BLE001
                self.error(label, "pallas", e)
        self._ratio_and_progress(idx, label, results, nbytes)
        # The same bytes written by a plain fill, timed the same way: the practical floor of this workload.
        buf = torch.empty(max(1, nbytes // 4), device=self.device)
        rec = _record("mask", "torch", case.name, T, H, D if with_out else None, "float32", variant + " floor",
                      "gpu_time", self.triton_gpu_time(lambda: buf.fill_(1.0)), nbytes, ceiling,
                      "c.fill_(1) of exactly the mask's bytes (one contiguous buffer)")
        self.add(rec)
        self.progress(f"  same bytes by fill_: {rec['p50']:.2f} us")
        rec = buf = None
        self.cleanup()
        self.save()

    @staticmethod
    def _upstream(rec: dict) -> None:
        if rec["op"] == "mask" and rec["variant"] == "lse":
            key = "mask_gpu_time_us" if rec["metric"] == "gpu_time" else "mask_latency_us"  # latency, launch: with launch
            rec["upstream_us"] = UPSTREAM[key].get(rec["workload"])

    def _ratio_and_progress(self, idx: str, label: str, results: dict, nbytes: int) -> None:
        recs = [r for r in self.doc["records"][-4:] if r["impl"] == "pallas"]
        if "triton" in results and "pallas" in results:
            for r, metric in zip(recs, ("gpu_time", "latency")):
                tri = results["triton"][0 if metric == "gpu_time" else 1][0][1]
                r["pallas_over_triton"] = r["p50"] / tri if tri > 0 else None
        parts = []
        for impl in ("triton", "pallas"):
            if impl in results:
                g, lat = results[impl]
                tb = nbytes / (g[0][1] * 1e-6) / 1e12 if g[0][1] > 0 else float("nan")
                parts.append(f"{impl} {g[0][1]:.1f} us ({tb:.2f} TB/s), latency {lat[0][1]:.1f} us")
        self.progress(f"[{idx}] {label}: " + ("; ".join(parts) if parts else "no result"))

    # -- 3. merges
    def _merge_sets(self, pt: MergePoint, k: int):
        """k random input sets of the point on the device (torch tensors), and the fused offsets (numpy)."""
        import torch

        tdt = getattr(torch, pt.dtype)
        gen = torch.Generator(device=self.device).manual_seed(0)
        lead = (pt.partials,) if pt.partials else (2,)
        sets = []
        for _ in range(k):
            o = torch.randn(*lead, pt.T, pt.H, pt.D, generator=gen, device=self.device, dtype=tdt)
            lse = torch.randn(*lead, pt.H, pt.T, generator=gen, device=self.device).mul_(3.0).add_(4.0)
            sets.append({"o": o, "l": lse})
        offs = None
        if pt.variant == "fused":
            c = pt.fused_case()
            offs = cases.offsets_n(c) if pt.partials else cases.offsets(c)
        return sets, offs

    def merge(self, pt: MergePoint, idx: str) -> None:
        ceiling = self.doc["ceilings"].get("add_2r1w")
        k = _rotation(pt.bytes, pt.memory, self.on_gpu)
        note = None if pt.bytes * k >= 3 * L2_BYTES else \
            f"L2 caveat: {k} set(s) x {pt.bytes / 1e6:.1f} MB < 3x L2"
        if k > 1:
            note = (note + "; " if note else "") + f"inputs rotated over {k} sets"
        if pt.variant == "chain":
            note = (note + "; " if note else "") + f"{pt.n_inputs - 1} chained 2-way merges with output LSE"
        sets, offs = self._merge_sets(pt, k)
        self.sync()
        results = {}
        est = pt.bytes / 3e12 * 1e6
        for impl in self.impls:
            try:
                results[impl] = self._merge_impl(impl, pt, sets, offs, ceiling=ceiling, note=note, est=est)
                est = results[impl][0][0][1]
            except Exception as e:  # noqa: BLE001
                self.error(pt.label, impl, e)
            self.cleanup()
        self._ratio_and_progress(idx, pt.label, results, pt.bytes)
        del sets, offs
        self.cleanup()
        self.save()

    def _bind_merge(self, a, impl: str, pt: MergePoint, s: dict, offs, jdev) -> list:
        """The prepared calls (`impls.Bound`) of one input set `s` (torch tensors; JAX shares them over DLPack):
        one call, or the chain of N - 1 two-way merges with output LSE."""
        import torch

        from parity import bridge, impls

        def arr(x):
            return x if impl == "triton" else bridge.torch_to_jax(x)

        def host(x):
            if impl == "triton":
                return torch.from_numpy(x).to(self.device)
            import jax

            return jax.device_put(x, jdev)

        o, lse = s["o"], s["l"]
        if pt.variant == "chain":  # the running state is the prefix, partial i the suffix
            if impl == "triton":
                calls, state = [], (o[0], lse[0])
                for i in range(1, pt.partials):
                    mid = (torch.empty_like(o[0]), torch.empty_like(lse[0]))
                    calls.append(a.bind_merge(state[0], state[1], o[i], lse[i], out=mid[0], out_lse=mid[1]))
                    state = mid
                return calls
            parts = [(arr(o[i]), arr(lse[i])) for i in range(pt.partials)]
            last = {}

            def chain():  # functional: each merge reads the previous result
                state = parts[0]
                for p in parts[1:]:
                    r = a.merge(state[0], state[1], p[0], p[1])
                    state = (r["out"], r["lse"])
                last["r"] = state

            return [impls.Bound(chain, lambda: self._block(last["r"]))]
        kw = dict(return_lse=pt.output_lse)
        if impl == "triton":
            kw.update(out=torch.empty(pt.T, pt.H, pt.D, dtype=o.dtype, device=self.device),
                      out_lse=torch.empty(pt.H, pt.T, device=self.device) if pt.output_lse else None)
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

    def _merge_impl(self, impl: str, pt: MergePoint, sets, offs, *, ceiling, note, est):
        from parity import bridge

        a = self.adapter(impl)
        jdev = bridge.jax_device_for(sets[0]["o"].device) if impl != "triton" else None
        bound = [self._bind_merge(a, impl, pt, s, offs, jdev) for s in sets]
        counter = [0]

        def call():
            for b in bound[counter[0] % len(bound)]:
                b.call()
            counter[0] += 1

        def sync():  # JAX: block on the results of the set called last
            for b in bound[(counter[0] - 1) % len(bound)]:
                b.results()

        if impl == "triton":
            g = self.triton_gpu_time(call)
            lat = self.latency(call, self.sync, g[0][1])
        else:
            g = self.jax_gpu_time(call, sync, est)
            lat = self.latency(call, sync, est)
        for metric, t in (("gpu_time", g), ("latency", lat)):
            self.add(_record(pt.op, impl, pt.workload, pt.T, pt.H, pt.D, pt.dtype, pt.variant, metric, t, pt.bytes,
                             ceiling, note))
        return g, lat

    # -- driver
    def run(self) -> None:
        only = getattr(self.args, "only", None)
        t_vals = getattr(self.args, "tokens", None)
        work = []
        if only in (None, "mask"):
            mask_variants = _GRIDS[self.mode][5]
            work += [("mask", (c, v), f"mask {c.name} {v}") for c in mask_cases(self.mode) for v in mask_variants]
        if only in (None, "merge"):
            for p in merge_points(self.mode):
                if t_vals and p.T not in t_vals:
                    continue
                work.append(("merge", p, p.label))
        if self.name_filter:
            work = [w for w in work if self.name_filter in w[2]]
        self.progress(f"bench mode={self.mode} device={self.device} impls={','.join(self.impls)}: "
                      f"{len(work)} points" + (f", budget {self.budget_s:.0f} s" if self.budget_s else ""))
        try:
            self.ceilings()
        except Exception as e:  # noqa: BLE001 - fractions become null; the points still run
            self.error("ceilings", "torch", e)
            self.cleanup()
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
            if kind == "merge" and item.memory > MEMORY_CAP_BYTES:
                self.doc["skipped"].append({"point": label, "reason": f"needs {item.memory / 1e9:.1f} GB > "
                                                                       f"{MEMORY_CAP_BYTES / 1e9:.0f} GB"})
                self.progress(f"[{idx}] {label}: skipped (needs {item.memory / 1e9:.1f} GB)")
                continue
            try:
                if kind == "mask":
                    self.mask(item[0], item[1], idx)
                else:
                    self.merge(item, idx)
            except Exception as e:  # noqa: BLE001 - setup failure (e.g. out of memory): next point
                self.error(label, "setup", e)
                self.cleanup()
        self.doc["elapsed_s"] = round(time.monotonic() - self.t_start, 1)
        self.save()


# --------------------------------------------------------------------------------------------------------
# Table and plot (both from the JSON document)


def _fmt(x, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def format_table(doc: dict) -> str:
    """The stdout table: one row per record, numbers right-aligned, caption with device and formulas."""
    env = doc.get("env", {})
    cols = ("op", "impl", "workload", "dtype", "variant", "metric", "p20 us", "p50 us", "p80 us", "TB/s",
            "%ceil", "P/T", "upstr us")
    num = {"p20 us", "p50 us", "p80 us", "TB/s", "%ceil", "P/T", "upstr us"}
    rows = []
    for r in doc.get("records", []):
        rows.append((r["op"], r["impl"], r["workload"], _SHORT.get(r["dtype"], r["dtype"] or "-"), r["variant"],
                     r["metric"], _fmt(r["p20"], ".2f"), _fmt(r["p50"], ".2f"), _fmt(r["p80"], ".2f"),
                     _fmt(r["tbps"], ".3f"), _fmt(None if r["frac_ceiling"] is None else 100 * r["frac_ceiling"],
                                                  ".1f"),
                     _fmt(r.get("pallas_over_triton"), ".3f"), _fmt(r.get("upstream_us"), ".1f")))
    widths = [max([len(c)] + [len(row[i]) for row in rows]) for i, c in enumerate(cols)]

    def line(vals):
        return "  ".join(v.rjust(w) if c in num else v.ljust(w) for v, w, c in zip(vals, widths, cols)).rstrip()

    ceil = doc.get("ceilings", {})
    v = env.get("versions", {})
    out = [f"# parity bench ({doc.get('mode')}): {env.get('gpu')} driver {env.get('driver')} CUDA {env.get('cuda')}"
           f"; torch {v.get('torch')} triton {v.get('triton')} jax {v.get('jax')}"
           f"; commit {env.get('git_commit')}; {env.get('utc_time')}",
           f"# command: {env.get('command')}",
           f"# ceilings (this run, gpu_time p50): two-read-one-write {_fmt(ceil.get('add_2r1w'), '.3f')} TB/s, "
           f"write-only {_fmt(ceil.get('fill_w'), '.3f')} TB/s (docs/spec.md 7 H200: {UPSTREAM['add_2r1w_tbps']} / "
           f"{UPSTREAM['fill_w_tbps']})",
           f"# floors (this run): empty kernel {_fmt(ceil.get('noop_kernel_us'), '.2f')} us gpu_time; host latency "
           f"of an empty Triton launch {_fmt(ceil.get('noop_launch_us'), '.1f')} us, a jitted JAX dispatch "
           f"{_fmt(ceil.get('jit_dispatch_us'), '.1f')} us; mask 'floor' rows: fill_ of the same bytes",
           f"# upstream (docs/spec.md 7, H200): merge {UPSTREAM['merge_tbps']} TB/s; mask gpu_time "
           + " / ".join(f"{v}" for v in UPSTREAM["mask_gpu_time_us"].values()) + " us, latency "
           + " / ".join(f"{v}" for v in UPSTREAM["mask_latency_us"].values()) + " us (2k / 32k / 131k)",
           f"# {FORMULAS['merge']}; %ceil vs two-read-one-write",
           f"# {FORMULAS['mask']}; %ceil vs write-only",
           "# TB/s from p50; P/T = pallas p50 / triton p50 of the same point and metric; methods in the JSON",
           "# gpu_time methods differ: Triton = CUDA-graph replay (includes the gap between graph nodes, ~1 us, "
           "visible on us-scale kernels); JAX = profiler kernel duration",
           line(cols), line(tuple("-" * w for w in widths))]
    out += [line(r) for r in rows]
    if doc.get("skipped"):
        out.append(f"# skipped {len(doc['skipped'])}: " + "; ".join(
            f"{s['point']} ({s['reason']})" for s in doc["skipped"][:6]) + (" ..." if len(doc["skipped"]) > 6 else ""))
    if doc.get("errors"):
        out.append(f"# errors {len(doc['errors'])}: " + "; ".join(
            f"{e['point']} [{e['impl']}]" for e in doc["errors"][:6]))
    return "\n".join(out)


def plot_from_json(json_path: str, png_path: str) -> None:
    """Draw the benchmark PNG from a `--json` file only: merge TB/s per point with the ceiling, and mask time
    per seed workload next to upstream's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(json_path) as f:
        doc = json.load(f)
    recs = doc.get("records", [])
    env = doc.get("env", {})
    merge = [r for r in recs if r["op"] == "merge" and r["metric"] == "gpu_time"]
    mask = [r for r in recs if r["op"] == "mask" and r["variant"] == "lse"]
    dtypes = [d for d in ("bfloat16", "float16", "float32") if any(r["dtype"] == d for r in merge)]
    variants = [v for v in MERGE_VARIANTS if any(r["variant"] == v for r in merge)]
    shapes = sorted({(r["T"], r["H"], r["D"]) for r in merge})
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
                ax.plot([shapes.index((r["T"], r["H"], r["D"])) for r in sel], [r["tbps"] or 0.0 for r in sel],
                        marker, color=colors[impl], label=impl, markersize=5, alpha=0.85)
            if ceil:
                ax.axhline(ceil, color="k", ls="--", lw=1, label=f"2R1W ceiling {ceil:.2f}")
            ax.axhline(UPSTREAM["merge_tbps"], color=colors["upstream"], ls=":", lw=1.5,
                       label=f"upstream {UPSTREAM['merge_tbps']}")
            ax.set_ylim(0, max(ceil or 0.0, UPSTREAM["merge_tbps"], *[r["tbps"] or 0.0 for r in merge]) * 1.1)
            ax.set_xticks(range(len(shapes)))
            ax.set_xticklabels([f"{short_t(t)}/{h}/{d}" for t, h, d in shapes], rotation=90, fontsize=7)
            ax.set_title(f"merge {_SHORT.get(dt, dt)} {var}: TB/s (gpu_time p50)", fontsize=9)
            ax.grid(axis="y", alpha=0.3)
            if j == 0:
                ax.set_ylabel("effective TB/s (T/H/D)")
            if i == 0 and j == ncols - 1:
                ax.legend(fontsize=7, loc="lower right")

    ax2 = fig.add_subplot(grid[nrows - 1, :])
    workloads = []
    for r in mask:
        if r["workload"] not in workloads:
            workloads.append(r["workload"])
    bars = [("triton", "gpu_time"), ("pallas", "gpu_time"), ("upstream", "gpu_time"),
            ("triton", "latency"), ("pallas", "latency"), ("upstream", "latency")]
    width = 0.8 / len(bars)
    for j, (impl, metric) in enumerate(bars):
        ys = []
        for w in workloads:
            if impl == "upstream":
                key = "mask_gpu_time_us" if metric == "gpu_time" else "mask_latency_us"
                ys.append(UPSTREAM[key].get(w, np.nan))
            else:
                v = [r["p50"] for r in mask if r["workload"] == w and r["impl"] == impl and r["metric"] == metric]
                ys.append(v[0] if v else np.nan)
        ax2.bar(np.arange(len(workloads)) + (j - (len(bars) - 1) / 2) * width, ys, width, color=colors[impl],
                hatch="//" if metric == "latency" else None, edgecolor="white" if metric == "latency" else None,
                label=f"{impl} {metric}")
    ax2.set_xticks(range(len(workloads)))
    ax2.set_xticklabels(workloads, fontsize=8)
    ax2.set_yscale("log")
    ax2.set_ylabel("us per call (p50)")
    ax2.set_title("mask (LSE only): GPU time (solid) and latency with launch (hatched); upstream from docs/spec.md 7",
                  fontsize=9)
    ax2.legend(fontsize=7, ncol=2)
    v = env.get("versions", {})
    fig.suptitle(f"{env.get('gpu')} | torch {v.get('torch')} triton {v.get('triton')} jax {v.get('jax')} | "
                 f"commit {str(env.get('git_commit'))[:12]} | {env.get('utc_time')} | mode {doc.get('mode')}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------------------------
# CLI


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `python -m parity bench` (added to the `bench` subparser by parity/cli.py)."""
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true",
                      help="subset: merge T in {2K, 32K, 131K}, H=64, D=128, bf16 (all variants); mask as full")
    size.add_argument("--smoke", action="store_true",
                      help="tiny shapes, 1-2 reps, runs on CPU (interpreters): checks the plumbing, no claims")
    parser.add_argument("--json", metavar="FILE", default=None,
                        help="write the records to FILE (rewritten after every point)")
    parser.add_argument("--plot", metavar="FILE", default=None, help="draw a PNG from the JSON to FILE")
    parser.add_argument("--replot", metavar="JSON", default=None,
                        help="measure nothing: print the table of an existing JSON (and --plot it)")
    parser.add_argument("--impl", choices=("both", "triton", "pallas"), default="both")
    parser.add_argument("--only", choices=("mask", "merge"), default=None, help="one op only (ceilings always run)")
    parser.add_argument("--tokens", type=int, nargs="+", default=None, metavar="T",
                        help="merge points with these T only")
    parser.add_argument("-k", dest="name_filter", metavar="SUBSTR", default=None,
                        help="only points whose label contains SUBSTR (e.g. 'merge T=32768', 'bfloat16 fused')")
    parser.add_argument("--budget-s", type=float, default=None, metavar="S",
                        help="stop starting new points after S seconds (the JSON and plot are still written)")
    parser.add_argument("--jax-timer", choices=("profiler", "dispatch"), default="profiler",
                        help="JAX gpu_time: profiler kernel time (default) or the labelled dispatch loop")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def run_bench(args) -> int:
    """Run the benchmark described by parsed `args`; returns the exit status (0 ok, 1 errors, 2 usage)."""
    argv = getattr(args, "argv", None)
    replot = getattr(args, "replot", None)
    if replot:
        with open(replot) as f:
            doc = json.load(f)
        print(format_table(doc))
        if getattr(args, "plot", None):
            plot_from_json(replot, args.plot)
        return 0
    mode = "smoke" if getattr(args, "smoke", False) else "quick" if getattr(args, "quick", False) else "full"
    try:
        import torch
    except ImportError as e:
        _log(f"error: bench needs torch: {e}")
        return 2
    has_cuda = torch.cuda.is_available()
    if mode != "smoke" and not has_cuda:
        _log("error: `bench` measures on a CUDA GPU and none is visible; use --smoke to check the plumbing")
        return 2
    from parity import impls

    impls.configure()
    device = "cuda" if has_cuda else "cpu"
    runner = _Runner(args, mode, device)
    runner.doc["env"] = dict(impls.collect_env(argv), l2_bytes_assumed=L2_BYTES)
    runner.save()
    try:
        runner.run()
    finally:
        runner.save()
    doc = runner.doc
    print(format_table(doc), flush=True)
    if getattr(args, "plot", None):
        path = getattr(args, "json", None)
        tmp = None
        if not path:
            fd, tmp = tempfile.mkstemp(suffix=".json")
            os.close(fd)
            _write_json(doc, tmp)
            path = tmp
        try:
            plot_from_json(path, args.plot)
            runner.progress(f"plot written to {args.plot}")
        finally:
            if tmp:
                os.unlink(tmp)
    return 1 if doc["errors"] else 0


def main(argv: list[str] | None = None) -> int:
    """`python -m parity.bench ...` (same options as `python -m parity bench`)."""
    parser = argparse.ArgumentParser(prog="python -m parity.bench", description=__doc__.splitlines()[0])
    add_bench_arguments(parser)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = ["bench", *argv]  # recorded as the equivalent `python -m parity bench ...`
    return run_bench(args)


if __name__ == "__main__":
    sys.exit(main())
