"""CPU time of triton_impl's torch path (`implementation="torch"`) beside Triton's interpreter and `torch.add` over the
same bytes: the 2-way merge of bf16 partials, f32 [H, T] LSEs, D = 128, no output LSE (docs/results.md, "The torch
path on a CPU").

    python -m tools torch-path-speed [--tokens 32768] [--heads 16] [--interpreter-tokens 2048] [--reps 5]

Each figure is the median of `--reps` calls after one warm-up, in this process's threads. The interpreter runs at
`--interpreter-tokens` (its time grows linearly with T; it is scaled to T in the table, and said so). `torch.add`
reads two bf16 [T, H, D] tensors and writes one: the bytes of the merge's two partial reads and its output write.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)  # this process: the torch path (the interpreter runs in a child)

import torch  # noqa: E402


def _inputs(tokens: int, heads: int, dim: int = 128):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(tokens, heads, dim, generator=g).to(torch.bfloat16)
    b = torch.randn(tokens, heads, dim, generator=g).to(torch.bfloat16)
    return a, b, torch.randn(heads, tokens, generator=g), torch.randn(heads, tokens, generator=g)


def _median_s(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _torch_path(tokens: int, heads: int, reps: int) -> tuple[float, float]:
    import triton_impl

    a, b, pl, sl = _inputs(tokens, heads)
    out = torch.empty_like(a)
    merge = _median_s(lambda: triton_impl.merge_attn_states(out, a, pl, b, sl, implementation="torch"), reps)
    add = _median_s(lambda: torch.add(a, b, out=out), reps)
    return merge, add


def _interpreter(tokens: int, heads: int, reps: int) -> float:
    code = (f"import tools.torch_path_speed as m, triton_impl, torch; a, b, pl, sl = m._inputs({tokens}, {heads}); "
            f"out = torch.empty_like(a); print(m._median_s(lambda: triton_impl.merge_attn_states(out, a, pl, b, sl), "
            f"{reps}))")
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return float(res.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools torch-path-speed", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--interpreter-tokens", type=int, default=2048)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    merge, add = _torch_path(args.tokens, args.heads, args.reps)
    interp = _interpreter(args.interpreter_tokens, args.heads, max(1, args.reps // 2))
    interp_scaled = interp * args.tokens / args.interpreter_tokens
    print(f"2-way merge, bf16, T={args.tokens}, H={args.heads}, D=128, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(f"  torch path          {merge * 1e3:9.2f} ms")
    print(f"  torch.add (2R1W)    {add * 1e3:9.2f} ms   torch path / add = {merge / add:.2f}x")
    print(f"  Triton interpreter  {interp_scaled * 1e3:9.2f} ms   (measured at T={args.interpreter_tokens}: "
          f"{interp * 1e3:.2f} ms, scaled by T)   interpreter / torch path = {interp_scaled / merge:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
