"""The mask points of a benchmark run (`python -m parity bench`): the seed workloads (`parity.harness.cases`), LSE
only and with the output rows, through `parity.harness.impls`; their per-call host cost on tiny inputs."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from parity.harness import cases
from parity.tools.bench import points as P
from parity.tools.bench import timers
from parity.tools.bench.records import record

if TYPE_CHECKING:
    from parity.tools.bench.runner import Runner


def _mask_inputs(runner: Runner, case: cases.Case, with_out: bool, lse_layout: str):
    import torch

    T, H, D = case.num_tokens, case.num_heads, case.head_dim
    qsl_np, cu_np = cases.offsets(case)
    gen = torch.Generator(device=runner.device).manual_seed(0)
    shape = (H, T) if lse_layout == "HT" else (T, H)
    lse = torch.randn(*shape, generator=gen, device=runner.device, dtype=torch.float32).mul_(3.0).add_(4.0)
    out = torch.randn(T, H, D, generator=gen, device=runner.device, dtype=getattr(torch, case.dtype)) \
        if with_out else None
    return lse, out, qsl_np, cu_np

def _bind_mask(runner: Runner, impl: str, lse, out, qsl_np, cu_np, lse_layout: str):
    """The prepared mask call of `impl`: Triton in place; JAX the documented in-place form (jit, the buffers
    donated, results fed back)."""
    import torch

    from parity.library import bridge

    if impl == "triton":
        qsl, cu = (torch.from_numpy(v).to(runner.device) for v in (qsl_np, cu_np))
        return runner.adapter("triton").bind_mask(lse, qsl, cu, out, has_empty=True, in_place=True,
                                                lse_layout=lse_layout)
    import jax

    jdev = bridge.jax_device_for(lse.device)
    return runner.adapter("pallas").bind_mask(
        bridge.torch_to_jax(lse), jax.device_put(qsl_np, jdev), jax.device_put(cu_np, jdev),
        None if out is None else bridge.torch_to_jax(out), has_empty=True, donate=True, lse_layout=lse_layout)

def mask(runner: Runner, case: cases.Case, variant: str, lse_layout: str, idx: str) -> None:
    import torch

    label = f"mask {case.name} {variant} {lse_layout}"
    T, H, D = case.num_tokens, case.num_heads, case.head_dim
    nbytes = P.mask_bytes(case, variant)
    ceiling = runner.doc["ceilings"].get("fill_w")
    with_out = variant == "lse+out"
    dtype = case.dtype if with_out else "float32"
    work = T * H * 4 + (T * H * D * P.ITEMSIZE[case.dtype] if with_out else 0)
    note = f"L2-resident working set ({work / 1e6:.1f} MB <= 3x L2)" if work < 3 * P.L2_BYTES else None
    layout = {"lse_layout": lse_layout, "lse_base": None, "partials_view": None}
    lse, out, qsl_np, cu_np = _mask_inputs(runner, case, with_out, lse_layout)
    runner.sync()
    results = {}
    est = 10.0
    first = len(runner.doc["records"])

    def add(impl, metric, t, upstream=True):
        rec = record("mask", impl, case.name, T, H, D if with_out else None, dtype, variant, metric, t, nbytes,
                     ceiling, note, layout)
        if upstream:
            _upstream(rec)
        runner.add(rec)

    for impl in runner.impls:
        try:
            bound = _bind_mask(runner, impl, lse, out, qsl_np, cu_np, lse_layout)
            sync = runner.sync if impl == "triton" else bound.results
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # donation is a no-op on some CPU builds
                if impl == "triton":
                    g = runner.triton_gpu_time(bound.call)
                    est = g[0][1]
                else:
                    g = runner.jax_gpu_time(bound.call, sync, est)
                lat = runner.latency(bound.call, sync, est)
                eag = runner.eager(impl, bound.call, sync)
            if impl == "pallas":
                lat = (lat[0], lat[1].replace("public API", "jax.jit(mask_empty_context_lse, donate) chained"),
                       lat[2])
            for metric, t in (("gpu_time", g), ("latency", lat), ("eager", eag)):
                add(impl, metric, t)
            results[impl] = (g, lat, eag)
            if impl == "triton" and runner.on_gpu:  # its torch.library op, like for like
                qsl, cu = (torch.from_numpy(v).to(runner.device) for v in (qsl_np, cu_np))
                op = runner.adapter("triton").bind_mask(lse, qsl, cu, out, has_empty=True, in_place=True,
                                                        library_op=True, lse_layout=lse_layout).call
                add("triton-op", "eager", timers.time_do_bench(op))
                add("triton-op", "latency", runner.latency(op, runner.sync, est), upstream=False)
            del bound
            mask_host(runner, impl, case, variant, lse_layout)
        except Exception as e:  # noqa: BLE001
            runner.error(label, impl, e)
    runner.ratio_and_progress(idx, label, results, nbytes, first)
    # The same bytes written by a plain fill, timed the same way: the practical floor of this workload.
    buf = torch.empty(max(1, nbytes // 4), device=runner.device)
    rec = record("mask", "torch", case.name, T, H, D if with_out else None, "float32", variant + " floor",
                 "gpu_time", runner.triton_gpu_time(lambda: buf.fill_(1.0)), nbytes, ceiling,
                 "c.fill_(1) of exactly the mask's bytes (one contiguous buffer)", layout)
    runner.add(rec)
    runner.progress(f"  same bytes by fill_: {rec['p50']:.2f} us")
    rec = buf = None
    runner.cleanup()
    runner.save()

def _tiny_mask_case(case: cases.Case) -> cases.Case:
    """HOST_T tokens in two requests, the first with an empty context chunk."""
    return cases.Case(f"host_T{P.HOST_T}", (P.HOST_T // 2,) * 2, (0,), num_heads=case.num_heads,
                      head_dim=case.head_dim, dtype=case.dtype)

def mask_host(runner: Runner, impl: str, case: cases.Case, variant: str, lse_layout: str) -> None:
    """The `host` record of the mask of `case`'s heads and dtype, once per (impl, shape, variant, layout)."""
    tiny = _tiny_mask_case(case)
    key = (impl, "mask", tiny.num_heads, tiny.head_dim, tiny.dtype, variant, lse_layout)
    if key in runner.host_done:
        return
    runner.host_done.add(key)
    with_out = variant == "lse+out"
    lse, out, qsl_np, cu_np = _mask_inputs(runner, tiny, with_out, lse_layout)
    bound = _bind_mask(runner, impl, lse, out, qsl_np, cu_np, lse_layout)
    sync = runner.sync if impl == "triton" else bound.results
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = runner.host(bound.call, sync, f"public API on T={P.HOST_T}")
    nbytes = P.mask_bytes(tiny, variant)
    runner.add(record("mask", impl, tiny.name, P.HOST_T, tiny.num_heads, tiny.head_dim if with_out else None,
                    tiny.dtype if with_out else "float32", variant, "host", t, nbytes, None, None,
                    {"lse_layout": lse_layout, "lse_base": None, "partials_view": None}))

def _upstream(rec: dict) -> None:
    if rec["op"] == "mask" and rec["variant"] == "lse" and rec["lse_layout"] == "HT":
        key = "mask_gpu_time_us" if rec["metric"] == "gpu_time" else "mask_latency_us"  # latency, eager: launch
        rec["upstream_us"] = P.UPSTREAM[key].get(rec["workload"])
