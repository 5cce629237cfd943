"""The benchmark's timers (`python -m parity bench`, parity/tools/bench/__init__.py). Each returns (p20, p50, p80) in
microseconds, the method string, and the call count; `TraceCounter` counts JAX traces and compiles."""

from __future__ import annotations

import functools
import glob
import os
import shutil
import sys
import tempfile
import time

import numpy as np

QUANTILES = (0.2, 0.5, 0.8)
# jax's monitoring events of one trace of a jitted function and of one backend compile (jax._src.dispatch).
JAX_TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
JAX_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


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
    """GPU time of `fn` (torch/Triton launches only) by CUDA-graph replay.

    The method of `triton.testing.do_bench_cudagraph` (a graph of as many calls as fill about `rep_ms`, replayed
    10 times, each replay's time over its call count), captured in `thread_local` mode: work that another thread
    (JAX's runtime) has in flight cannot invalidate the capture, as the process-global mode lets it.
    """
    import torch

    stream = torch.cuda.Stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def captured(calls: int):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
            for _ in range(calls):
                fn()
        return graph

    def replay_ms(graph) -> float:
        start.record(stream)
        graph.replay()
        end.record(stream)
        torch.cuda.synchronize()
        return start.elapsed_time(end)

    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        fn()  # compiles and warms up outside the capture
        torch.cuda.synchronize()
        one = captured(1)
        est = sum(replay_ms(one) for _ in range(5)) / 5
        calls = max(1, int(rep_ms / max(est, 1e-4)))
        graph = captured(calls)
        replay_ms(graph)
        ms = [replay_ms(graph) / calls for _ in range(10)]
    q = _quantiles([x * 1e3 for x in ms])
    return q, (f"CUDA-graph replay (thread-local capture) of {calls} calls, quantiles over 10 replays (each the mean "
               "of the calls captured in the graph)"), None


def torch_copy_ceiling_tbps(rep_ms: float = 20) -> float:
    """The bench's add_2r1w ceiling for a script outside a bench run (`floors.ceilings` records it in one):
    torch.add(a, b, out=c) of 2 GiB bf16 tensors on the current CUDA device, two reads and one write, by CUDA-graph
    replay (p50), in TB/s."""
    import torch

    from parity.tools.bench.points import CEILING_ELEMS

    a, b, c = (torch.ones(CEILING_ELEMS, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    us = time_cudagraph(lambda: torch.add(a, b, out=c), rep_ms)[0][1]
    return 3 * 2 * CEILING_ELEMS / us / 1e6


def time_do_bench(fn):
    """Launch-inclusive time of one call: `triton.testing.do_bench` (CUDA events around each of many
    back-to-back calls, L2 flushed in between), the method behind upstream's launch-inclusive figures."""
    import triton.testing

    ms = triton.testing.do_bench(fn, warmup=25, rep=100, quantiles=list(QUANTILES))
    return tuple(float(x) * 1e3 for x in ms), "triton.testing.do_bench: CUDA events around each call, calls back " \
                                            "to back with an L2 flush between them; quantiles over calls", None


def time_wall(call, sync, n: int, trials: int, what: str = "public API", warmup: bool = True):
    """Per-call wall clock: `n` back-to-back calls, one sync at the end, divided by `n`; quantiles over trials.
    `warmup`: one call first, untimed (the smoke mode, which claims nothing, skips it)."""
    if warmup:
        call()
        sync()
    samples = []
    for k in range(trials):
        if warmup or k:  # nothing to wait for before the first call
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


def jax_kernel_events(call, sync, n: int) -> list[tuple[float, float, str]]:
    """`gpu_kernel_events` of `n` back-to-back calls under the JAX profiler (one warm-up call first, outside it)."""
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
        return gpu_kernel_events(jax.profiler.ProfileData.from_file(files[-1])) if files else []
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)


def time_jax_profiler(call, sync, n: int):
    """JAX GPU time from the profiler's kernel durations over `n` back-to-back calls; None without GPU events."""
    got = per_call_us(jax_kernel_events(call, sync, n), n)
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
            log(f"  jax profiler unavailable ({type(e).__name__}: {e}); using the dispatch loop")
            got = None
        if got is not None:
            return got
    q, _, n = time_wall(call, sync, n, trials, what="jitted call")
    return q, f"jax dispatch loop: wall clock over {n} back-to-back jitted calls, one sync, /{n} (upper " \
              f"bound when the kernel is shorter than a dispatch); quantiles over {trials} trials", n


def time_synced(call, sync, n: int, what: str = "jitted call", warmup: bool = True):
    """Per-call wall clock of `n` calls, each followed by a sync (a call a step waits for, launch and sync
    included): JAX's counterpart of `time_do_bench` (CUDA events on torch's stream cannot see JAX's). `warmup` as
    in `time_wall`."""
    if warmup:
        call()
        sync()
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        call()
        sync()
        samples.append((time.perf_counter() - t0) * 1e6)
    return _quantiles(samples), f"wall clock of each of {n} {what}s, each followed by a sync; quantiles over " \
                                f"calls", n


class TraceCounter:
    """Counts jax's traces of jitted functions and backend compiles while active (`with TraceCounter() as c:`,
    then `c.traces`, `c.compiles`), through `jax.monitoring`'s duration events."""

    def __init__(self):
        self.traces = self.compiles = 0

    def _listener(self, event: str, duration: float, **_) -> None:
        if event == JAX_TRACE_EVENT:
            self.traces += 1
        elif event == JAX_COMPILE_EVENT:
            self.compiles += 1

    def __enter__(self):
        import jax.monitoring

        jax.monitoring.register_event_duration_secs_listener(self._listener)
        return self

    def __exit__(self, *exc):
        import jax.monitoring

        jax.monitoring.unregister_event_duration_listener(self._listener)
        return False
