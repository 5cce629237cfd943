"""Per-call host cost of the Triton entry points (docs/design.md, "Per-call cost").

`stubbed`: the wrapper alone (checks, cached launch plan, arguments), the kernel launch replaced by a no-op.
On a GPU also `real`: wall time per call of back-to-back calls (launch included, one sync at the end), next to
an empty @triton.jit kernel launched the same way in the same run; `gpu`: the kernels' own time per call (20 calls
captured in a CUDA graph, replayed), so a `real` close to `gpu` is GPU-bound, not host-bound; `direct`: whether the
call took the compiled kernel's launcher directly (`triton_impl._launch.launch`). bf16, T = 16, H = 64, D = 128.

    python -m tools host-cost [--calls 2000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU: only the stubbed figures

import triton  # noqa: E402

import triton_impl  # noqa: E402
from mla_lse_common import constants  # noqa: E402
from triton_impl import cp_merge, mask, merge, merge_n  # noqa: E402

KERNELS = [(mask, "_mask_empty_context_lse_kernel"), (merge, "_merge_attn_states_kernel"),
           (merge_n, "_merge_attn_states_n_kernel"), (merge_n, "_merge_n_weights_kernel"),
           (cp_merge, "_cp_rescale_kernel")]


@triton.jit
def _empty_kernel(x_ptr):
    pass


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def entry_points(device, T=16, H=64, D=128, N=4, R=4, dtype=torch.bfloat16):
    def o(*shape, dt=dtype):
        return torch.randn(*shape, device=device).to(dt)

    out, p, s = o(T, H, D), o(T, H, D), o(T, H, D)
    plse, slse, olse = o(H, T, dt=torch.float32), o(H, T, dt=torch.float32), o(H, T, dt=torch.float32)
    plse_th, slse_th, olse_th = (x.t().contiguous() for x in (plse, slse, olse))
    qsl = torch.tensor([0, 4, 8, 12, 16], dtype=torch.int32, device=device)
    cu = torch.tensor([0, 10, 10, 30, 40], dtype=torch.int32, device=device)
    fp8, scale = torch.empty(T, H, D, dtype=torch.float8_e4m3fn, device=device), torch.ones(1, device=device)
    outs, lses, cus = o(N, T, H, D), o(N, H, T, dt=torch.float32), cu.repeat(N, 1)
    wide = 32  # beyond UNROLLED_PARTIALS: the merge in two kernels (tiles.split_passes)
    outs_w, lses_w = o(wide, T, H, D), o(wide, H, T, dt=torch.float32)
    ops = torch.ops.mla_lse_merge
    scaled = torch.empty(2, T, H // 2, D, dtype=torch.float32, device=device)
    cp_args = (out, p, plse, None, None, None, None, None)
    cp_kw = dict(method="reduce_scatter", num_partials=2, lse_layout="HT", lse_base=math.e, reduce_dtype=None,
                 validate=False)

    half, lses2 = out[:, : H // 2], lses[:2]

    def cp_local():
        params, ptwc, _ = cp_merge._local_params(half, *cp_args[1:], **cp_kw)
        cp_merge._rescale(scaled, None, p, lses2, None, None, 0, params, ptwc, "HT")

    fn = triton_impl
    return {
        "mask": lambda: fn.mask_empty_context_lse(plse, qsl, cu),
        "mask + output": lambda: fn.mask_empty_context_lse(plse, qsl, cu, out),
        "merge plain": lambda: fn.merge_attn_states(out, p, plse, s, slse),
        "merge output LSE": lambda: fn.merge_attn_states(out, p, plse, s, slse, olse),
        "merge fused": lambda: fn.merge_attn_states(out, p, plse, s, slse, olse, query_start_loc=qsl,
                                                    prefix_cu_seq_lens=cu),
        "merge [T,H] base 2": lambda: fn.merge_attn_states(out, p, plse_th, s, slse_th, olse_th, 12, lse_layout="TH",
                                                           lse_base=2),
        "merge fp8": lambda: fn.merge_attn_states(fp8, p, plse, s, slse, None, None, scale),
        f"merge_n N={N}": lambda: fn.merge_attn_states_n(out, outs, lses),
        f"merge_n N={N} fused": lambda: fn.merge_attn_states_n(out, outs, lses, olse, query_start_loc=qsl,
                                                               cu_seq_lens=cus),
        f"merge_n N={wide} (two kernels)": lambda: fn.merge_attn_states_n(out, outs_w, lses_w, olse),
        "cp_merge local (checks + rescale)": cp_local,
        "op mask": lambda: ops.mask_empty_context_lse(plse, qsl, cu),
        "op merge output LSE": lambda: ops.merge_attn_states(out, p, plse, s, slse, olse),
        f"op merge_n N={N}": lambda: ops.merge_attn_states_n(out, outs, lses),
    }


def per_call_us(fn, calls, sync, rounds=5):
    """The fastest of `rounds` rounds of `calls` back-to-back calls, per call (other load only slows a round)."""
    for _ in range(3):
        fn()
    sync()
    best = math.inf
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best / calls * 1e6


def gpu_us(fn, calls=20, reps=50):
    """GPU time per call: `calls` calls captured in one CUDA graph, replayed `reps` times between two events."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (calls * reps)


def direct(fn) -> bool:
    """Whether `fn`'s launches take the compiled launcher directly: its launch plan's state (a list) holds the
    compiled kernel after the first launch."""
    from triton_impl import _plans

    _plans.PLANS.clear()
    fn()
    fn()

    def states(x):
        if isinstance(x, list):
            yield x
        elif isinstance(x, tuple):
            for y in x:
                yield from states(y)

    found = [st for plan in _plans.PLANS.values() for st in states(plan)]
    return bool(found) and all(len(st) > 1 for st in found)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000, help="back-to-back calls per round")
    ap.add_argument("--rounds", type=int, default=5, help="rounds; the fastest counts (more on a busy CPU)")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    entries = entry_points(device)
    real = {}
    if cuda:
        x = torch.empty(1, device=device)
        empty = per_call_us(lambda: _empty_kernel[(1,)](x), args.calls, sync, args.rounds)
        real = {name: per_call_us(f, args.calls, sync, args.rounds) for name, f in entries.items()}
        gpu = {name: gpu_us(f) for name, f in entries.items()}
        took_direct = {name: direct(f) for name, f in entries.items()}
    saved = [getattr(m, k) for m, k in KERNELS]
    for m, k in KERNELS:  # each module's {lse_layout: kernel}
        setattr(m, k, dict.fromkeys(constants.LSE_LAYOUTS, _NoLaunch()))
    try:
        stubbed = {name: per_call_us(f, args.calls, lambda: None, args.rounds) for name, f in entries.items()}
    finally:
        for (m, k), v in zip(KERNELS, saved):
            setattr(m, k, v)
    print(f"{device}, torch {torch.__version__}, triton {triton.__version__}; us per call, "
          f"best of {args.rounds} rounds of {args.calls} calls")
    if cuda:
        print(f"{'empty @triton.jit kernel':36s} real {empty:7.1f}")
    for name in entries:
        line = f"{name:36s} stubbed {stubbed[name]:7.1f}"
        if cuda:
            line += (f"   real {real[name]:7.1f}   real / empty {real[name] / empty:4.2f}   gpu {gpu[name]:6.1f}"
                     f"   direct {'yes' if took_direct[name] else 'no'}")
        print(line)


if __name__ == "__main__":
    main()
