"""The ceilings and floors of a benchmark run (`python -m parity bench`): two-read-one-write `torch.add` and
write-only `fill_` on 2 GiB tensors, an empty `@triton.jit` kernel and a jitted JAX identity, timed the way the
points are."""

from __future__ import annotations

from typing import TYPE_CHECKING

from parity.tools.bench import points as P
from parity.tools.bench import timers
from parity.tools.bench.records import record

if TYPE_CHECKING:
    from parity.tools.bench.runner import Runner


def ceilings(runner: Runner) -> None:
    import torch

    n = P.CEILING_ELEMS if runner.on_gpu and runner.mode != "smoke" else 1 << 16
    runner.progress(f"ceilings: torch.add(a, b, out=c) and c.fill_(1) on {n * 2 / 2**30:.3g} GiB bf16 tensors")
    a = torch.ones(n, dtype=torch.bfloat16, device=runner.device)
    b = torch.ones(n, dtype=torch.bfloat16, device=runner.device)
    c = torch.empty(n, dtype=torch.bfloat16, device=runner.device)
    runner.sync()
    specs = (("add_2r1w", "torch.add(a, b, out=c)", lambda: torch.add(a, b, out=c), 3 * 2 * n),
             ("fill_w", "c.fill_(1)", lambda: c.fill_(1.0), 2 * n))
    for key, variant, fn, nbytes in specs:
        t = runner.triton_gpu_time(fn)
        rec = record("ceiling", "torch", key, None, None, None, "bfloat16", variant, "gpu_time", t, nbytes, None)
        runner.doc["ceilings"][key] = rec["tbps"]
        runner.add(rec)
        runner.progress(f"  {key}: {rec['p50']:.1f} us, {rec['tbps']:.3f} TB/s")
    a = b = c = fn = specs = None  # free the 6 GiB of inputs before the next step
    # The floors of every metric: an empty Triton kernel (its GPU time by graph replay, its host cost over
    # back-to-back launches, its eager time by do_bench) and a jitted JAX identity (host, eager). No public
    # call of either framework can be cheaper on this host.
    x = torch.zeros(16, device=runner.device)
    kernel = timers.noop_kernel()

    def noop():
        kernel[(1,)](x)

    floors = (("noop_kernel_us", "noop_kernel", "gpu_time", lambda: runner.triton_gpu_time(noop)),
              ("noop_launch_us", "noop_launch", "host", lambda: runner.host(noop, runner.sync, "empty kernel launch")),
              ("noop_eager_us", "noop_eager", "eager", lambda: runner.eager("triton", noop, runner.sync)))
    for key, workload, metric, timing in floors:
        rec = record("ceiling", "triton", workload, None, None, None, "float32", "empty @triton.jit kernel",
                     metric, timing(), 0, None)
        runner.doc["ceilings"][key] = rec["p50"]
        runner.add(rec)
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
                ("jit_dispatch_us", "jit_dispatch", "host", lambda: runner.host(jcall, jsync, "jitted identity")),
                ("jit_eager_us", "jit_eager", "eager", lambda: runner.eager("pallas", jcall, jsync))):
            rec = record("ceiling", "jax", workload, None, None, None, "float32", "jax.jit(lambda v: v + 1)",
                         metric, timing(), 0, None)
            runner.doc["ceilings"][key] = rec["p50"]
            runner.add(rec)
    except Exception as e:  # noqa: BLE001 - informational floor
        runner.error("jit_dispatch floor", "jax", e)
    c = runner.doc["ceilings"]
    nan = float("nan")
    runner.progress(f"  floors: empty kernel {c['noop_kernel_us']:.2f} us gpu, launch {c['noop_launch_us']:.1f} us "
                  f"host / {c['noop_eager_us']:.1f} us eager; jitted JAX identity "
                  f"{c.get('jit_dispatch_us', nan):.1f} us host / {c.get('jit_eager_us', nan):.1f} us eager")
    runner.cleanup()
    runner.save()
