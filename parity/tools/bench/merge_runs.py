"""The 2-way and N-way merge points of a benchmark run (`python -m parity bench`): input sets rotated past the L2,
the chained alternative of the N-way merge, the all-gather view, through `parity.harness.impls`; their per-call
host cost on tiny inputs."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from parity.harness import cases
from parity.tools.bench import points as P
from parity.tools.bench.records import record

if TYPE_CHECKING:
    from parity.tools.bench.runner import Runner


def _merge_sets(runner: Runner, pt: P.MergePoint, k: int):
    """k random input sets of the point on the device (torch tensors, the gather view a strided view of a
    [T, N, H, D] buffer), and the fused offsets (numpy)."""
    import torch

    tdt = getattr(torch, pt.dtype)
    gen = torch.Generator(device=runner.device).manual_seed(0)
    n = pt.n_inputs
    lse_shape = (n, pt.H, pt.T) if pt.lse_layout == "HT" else (n, pt.T, pt.H)
    sets = []
    for _ in range(k):
        if pt.view == "gather":
            o = torch.randn(pt.T, n, pt.H, pt.D, generator=gen, device=runner.device, dtype=tdt).transpose(0, 1)
        else:
            o = torch.randn(n, pt.T, pt.H, pt.D, generator=gen, device=runner.device, dtype=tdt)
        lse = torch.randn(*lse_shape, generator=gen, device=runner.device).mul_(3.0).add_(4.0)
        sets.append({"o": o, "l": lse})
    offs = None
    if pt.variant == "fused":
        c = pt.fused_case()
        offs = cases.offsets_n(c) if pt.partials else cases.offsets(c)
    return sets, offs

def merge(runner: Runner, pt: P.MergePoint, idx: str) -> None:
    ceiling = runner.doc["ceilings"].get("add_2r1w")
    k = P.rotation(pt.bytes, pt.memory, runner.on_gpu)
    note = None if pt.bytes * k >= 3 * P.L2_BYTES else \
        f"L2 caveat: {k} set(s) x {pt.bytes / 1e6:.1f} MB < 3x L2"
    if k > 1:
        note = (note + "; " if note else "") + f"inputs rotated over {k} sets"
    if pt.variant == "chain":
        note = (note + "; " if note else "") + f"{pt.n_inputs - 1} chained 2-way merges with output LSE"
    sets, offs = _merge_sets(runner, pt, k)
    runner.sync()
    results = {}
    est = pt.bytes / 3e12 * 1e6
    first = len(runner.doc["records"])
    for impl in runner.impls:
        if impl != "triton" and pt.view == "gather":
            runner.doc["skipped"].append({"point": pt.label, "impl": impl,
                                        "reason": "the all-gather view is Triton only: JAX arrays have no "
                                                  "strides (a [T, N, H, D] buffer is transposed by a copy)"})
            continue
        try:
            results[impl] = _merge_impl(runner, impl, pt, sets, offs, ceiling=ceiling, note=note, est=est)
            est = results[impl][0][0][1]
            merge_host(runner, impl, pt)
        except Exception as e:  # noqa: BLE001
            runner.error(pt.label, impl, e)
        runner.cleanup()
    runner.ratio_and_progress(idx, pt.label, results, pt.bytes, first)
    del sets, offs
    runner.cleanup()
    runner.save()

def _bind_merge(runner: Runner, a, impl: str, pt: P.MergePoint, s: dict, offs, jdev) -> list:
    """The prepared calls (`impls.Bound`) of one input set `s` (torch tensors; JAX shares them over DLPack):
    one call, or the chain of N - 1 two-way merges with output LSE."""
    import torch

    from parity.library import bridge
    from parity.harness import impls

    def arr(x):
        return x if impl == "triton" else bridge.torch_to_jax(x)

    def host(x):
        if impl == "triton":
            return torch.from_numpy(x).to(runner.device)
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

        return [impls.Bound(chain, lambda: _block(last["r"]))]
    kw = dict(return_lse=pt.output_lse, **lay)
    if impl == "triton":
        lse_shape = (pt.H, pt.T) if pt.lse_layout == "HT" else (pt.T, pt.H)
        kw.update(out=torch.empty(pt.T, pt.H, pt.D, dtype=o.dtype, device=runner.device),
                  out_lse=torch.empty(*lse_shape, device=runner.device) if pt.output_lse else None)
    if pt.op == "merge":
        if offs is not None:
            kw.update(query_start_loc=host(offs[0]), prefix_cu_seq_lens=host(offs[1]))
        return [a.bind_merge(arr(o[0]), arr(lse[0]), arr(o[1]), arr(lse[1]), **kw)]
    if offs is not None:
        kw.update(query_start_loc=host(offs[0]), cu_seq_lens=host(offs[1]))
    return [a.bind_merge_n(arr(o), arr(lse), **kw)]

def _block(x):
    import jax

    jax.block_until_ready(x)

def _merge_calls(runner: Runner, impl: str, pt: P.MergePoint, sets, offs):
    """(call, sync) of `impl` on `sets`: each call runs the next set (rotation)."""
    from parity.library import bridge

    a = runner.adapter(impl)
    jdev = bridge.jax_device_for(sets[0]["o"].device) if impl != "triton" else None
    bound = [_bind_merge(runner, a, impl, pt, s, offs, jdev) for s in sets]
    counter = [0]

    def call():
        for b in bound[counter[0] % len(bound)]:
            b.call()
        counter[0] += 1

    def sync():  # JAX: block on the results of the set called last
        if impl == "triton":
            runner.sync()
            return
        for b in bound[(counter[0] - 1) % len(bound)]:
            b.results()

    return call, sync

def _merge_impl(runner: Runner, impl: str, pt: P.MergePoint, sets, offs, *, ceiling, note, est):
    call, sync = _merge_calls(runner, impl, pt, sets, offs)
    if impl == "triton":
        g = runner.triton_gpu_time(call)
        lat = runner.latency(call, sync, g[0][1])
    else:
        g = runner.jax_gpu_time(call, sync, est)
        lat = runner.latency(call, sync, est)
    eag = runner.eager(impl, call, sync)
    for metric, t in (("gpu_time", g), ("latency", lat), ("eager", eag)):
        runner.add(record(pt.op, impl, pt.workload, pt.T, pt.H, pt.D, pt.dtype, pt.variant, metric, t, pt.bytes,
                        ceiling, note, pt.layout_fields))
    return g, lat, eag

def merge_host(runner: Runner, impl: str, pt: P.MergePoint) -> None:
    """The `host` record of `pt`'s op, variant, heads, head size, dtype and layout on HOST_T tokens, once."""
    tiny = dataclasses.replace(pt, T=P.HOST_T)
    if (impl, tiny) in runner.host_done:
        return
    runner.host_done.add((impl, tiny))
    sets, offs = _merge_sets(runner, tiny, 1)
    call, sync = _merge_calls(runner, impl, tiny, sets, offs)
    t = runner.host(call, sync, f"public API on T={P.HOST_T}")
    runner.add(record(tiny.op, impl, tiny.workload, tiny.T, tiny.H, tiny.D, tiny.dtype, tiny.variant, "host", t,
                    tiny.bytes, None, None, tiny.layout_fields))
