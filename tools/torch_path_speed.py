"""CPU time of triton_impl's torch path (`implementation="torch"`) beside Triton's interpreter and `torch.add` over the
same bytes: the 2-way merge of bf16 partials, f32 [H, T] LSEs, D = 128, no output LSE (docs/results.md, "The torch
path on a CPU").

    python -m tools torch-path-speed [--tokens 32768] [--heads 16] [--interpreter-tokens 256] [--partials 2]
                                     [--reps 5]

Each figure is the median of `--reps` calls after one warm-up, in this process's threads. The interpreter runs at
`--interpreter-tokens` (its time grows linearly with T; it is scaled to T in the table, and said so). `torch.add`
reads two bf16 [T, H, D] tensors and writes one: the bytes of the 2-way merge's two partial reads and its output
write. `--partials N` > 2 times the N-way merge instead (its ceiling: N reads and a write, N / 2 adds' worth).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch


def _inputs(tokens: int, heads: int, partials: int = 2, dim: int = 128):
    """(outputs bf16[N, T, H, D], lses f32[N, H, T])."""
    g = torch.Generator().manual_seed(0)
    return (torch.randn(partials, tokens, heads, dim, generator=g).to(torch.bfloat16),
            torch.randn(partials, heads, tokens, generator=g))


def _merge(o, lse, **kw):
    """The call timed: the 2-way merge for N = 2, else the N-way merge."""
    import triton_impl

    out = torch.empty_like(o[0])
    if o.shape[0] == 2:
        return lambda: triton_impl.merge_attn_states(out, o[0], lse[0], o[1], lse[1], **kw)
    return lambda: triton_impl.merge_attn_states_n(out, o, lse, **kw)


def _median_s(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _torch_path(tokens: int, heads: int, partials: int, reps: int) -> tuple[float, float]:
    o, lse = _inputs(tokens, heads, partials)
    merge = _median_s(_merge(o, lse, implementation="torch"), reps)
    out = torch.empty_like(o[0])
    add = _median_s(lambda: torch.add(o[0], o[1], out=out), reps) * partials / 2
    return merge, add


def _interpreter(tokens: int, heads: int, partials: int, reps: int) -> float:
    code = (f"import tools.torch_path_speed as m, triton_impl._backend as b; assert b.interpreting(); "
            f"o, lse = m._inputs({tokens}, {heads}, {partials}); print(m._median_s(m._merge(o, lse), {reps}))")
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return float(res.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools torch-path-speed", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--interpreter-tokens", type=int, default=256)
    p.add_argument("--partials", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    if "triton_impl" in sys.modules:
        raise SystemExit("run as `python -m tools torch-path-speed` (triton_impl must not be imported yet)")
    os.environ.pop("TRITON_INTERPRET", None)  # this process: the torch path (the interpreter runs in a child)
    merge, add = _torch_path(args.tokens, args.heads, args.partials, args.reps)
    interp = _interpreter(args.interpreter_tokens, args.heads, args.partials, args.reps)
    interp_scaled = interp * args.tokens / args.interpreter_tokens
    kind = "2-way merge" if args.partials == 2 else f"N-way merge, N={args.partials}"
    print(f"{kind}, bf16, T={args.tokens}, H={args.heads}, D=128, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(f"  torch path          {merge * 1e3:9.2f} ms")
    print(f"  torch.add (2R1W)    {add * 1e3:9.2f} ms   torch path / add = {merge / add:.2f}x"
          + ("" if args.partials == 2 else "   (N / 2 adds: the N reads and a write)"))
    print(f"  Triton interpreter  {interp_scaled * 1e3:9.2f} ms   (measured at T={args.interpreter_tokens}: "
          f"{interp * 1e3:.2f} ms, scaled by T)   interpreter / torch path = {interp_scaled / merge:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
