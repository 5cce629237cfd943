"""GPU measurements of the chunked-context step as a serving step pays for it (`python -m parity loop`).

Per capacity (C chunks) and method: the merges' GPU time alone (the C in-place 2-way merges vs the one N-way merge,
over the same stacked partials), the whole step's GPU time, and the host time one step costs: the eager step's
launches vs one graph replay (torch), one jitted dispatch (JAX). GPU times come from
`parity.tools.bench.timers` (CUDA-graph replay for torch, the profiler's kernel times for JAX); host times are the
wall clock of issuing one step with the GPU idle (a sync before each sample), quantiles over samples.
"""

from __future__ import annotations

import time

from parity.tools.bench import timers

HOST_SAMPLES = 50


def byte_ratio(num_chunks: int) -> float:
    """What the chained merges move over what the fused merge moves (outputs only): C merges that read two partials
    and write one, against one that reads C + 1 and writes one."""
    return 3 * num_chunks / (num_chunks + 2)


def host_us(call, sync, samples: int = HOST_SAMPLES):
    """(p20, p50, p80) microseconds of issuing `call` once, the device idle before each sample."""
    call()
    sync()
    got = []
    for _ in range(samples):
        sync()
        t0 = time.perf_counter()
        call()
        got.append((time.perf_counter() - t0) * 1e6)
    sync()
    return timers._quantiles(got)


def measure_torch(loop, method: str, rep_ms: float = 100.0) -> dict:
    """Timings of a `TorchLoop` whose buffers hold a batch and whose `method` graph is captured."""
    torch = loop.torch
    loop.step("fused")  # fills the stacked partials the merges-only timings read
    loop.sync()
    if method == "fused":
        merges = loop.merge_fused
    else:
        state_out, state_lse = loop.outs[0].clone(), loop.lses[0].clone()

        def merges():
            loop.merge_chained(state_out, state_lse)

    merge_q, merge_how, _ = timers.time_cudagraph(merges, rep_ms)
    step_q, step_how, _ = timers.time_cudagraph(lambda: loop.step(method), rep_ms)
    return dict(merges_gpu_us=merge_q[1], merges_gpu_us_q=merge_q, step_gpu_us=step_q[1], step_gpu_us_q=step_q,
                gpu_method=step_how,
                host_eager_us=host_us(lambda: loop.step(method), torch.cuda.synchronize)[1],
                host_replay_us=host_us(lambda: loop.replay(method), torch.cuda.synchronize)[1],
                host_method=f"wall clock of issuing one step, a sync before each of {HOST_SAMPLES} samples; median")


def _held(fn, *args):
    """(call, sync) of `fn(*args)` for the JAX timers: the call keeps its result, the sync waits for it."""
    import jax

    holder = {}

    def call():
        holder["r"] = fn(*args)

    def sync():
        jax.block_until_ready(holder.get("r"))

    return call, sync


def measure_jax(step, inputs: dict, merges, merge_args: tuple, n: int = 20) -> dict:
    """Timings of a jitted step on `inputs` and of its jitted merges alone on `merge_args`."""
    step_q, step_how, _ = timers.time_jax_gpu(*_held(step, inputs), n, 3, use_profiler=True)
    merge_q, _, _ = timers.time_jax_gpu(*_held(merges, *merge_args), n, 3, use_profiler=True)
    return dict(merges_gpu_us=merge_q[1], merges_gpu_us_q=merge_q, step_gpu_us=step_q[1], step_gpu_us_q=step_q,
                gpu_method=step_how, host_dispatch_us=host_us(*_held(step, inputs))[1],
                host_method=f"wall clock of one jitted dispatch, the device idle before each of {HOST_SAMPLES} "
                            "samples; median")
