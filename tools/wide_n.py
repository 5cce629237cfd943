"""The N-way merge at large N on the GPU: first-call compile time and bandwidth, Triton and Pallas (Triton backend).

    python -m tools wide-n [--part compile|speed|all] [--frameworks triton,pallas] [--ns 4,16,64,128,256]
                             [--json OUT.json]

(a) `compile`: the first call (compile included) of `merge_attn_states_n` at N = 4, 16, 64, 128, 256 for every
    variant (plain, output LSE, fused mask, [T, H] LSEs, base 2, fp8 output, pass-through rows, f32 partials into
    a bf16 output) at T = 256, H = 32, D = 128 bf16, and the second call. Each framework runs in a fresh process
    with an empty Triton cache directory (TRITON_CACHE_DIR) and no persistent JAX compilation cache; a
    signature's first call is its first compile in that process (each N and variant is a new signature). One
    unrelated warm-up call (N = 2, plain) comes first, so the figures exclude one-time initialisation. The
    target (docs/spec.md 8, "Any N"): well under 5 s at every N.
(b) `speed`: GPU time of the N-way merge at N = 128 and 256, T = 8192, H = 64, D = 128 bf16 (plain, output LSE,
    fused mask, [T, H] LSEs; `--variants`), as a fraction of the copy ceiling of `python -m parity bench`
    (`parity.tools.bench.points`: torch.add of 2 GiB bf16 tensors, two reads and one write, by CUDA-graph replay)
    with the bench's byte formula for merge_n. Triton by CUDA-graph replay (`timers.time_cudagraph`), Pallas by
    jax.profiler kernel time (`timers.time_jax_gpu`). Needs about 40 GB of GPU memory per framework at N = 256.
    The target: 90% or more.

Prints one table per part and writes every record to --json. About 2-4 minutes per part on an H200.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

COMPILE_SHAPE = dict(T=256, H=32, D=128)
SPEED_SHAPE = dict(T=8192, H=64, D=128)
COMPILE_NS = (4, 16, 64, 128, 256)
SPEED_NS = (128, 256)
# variant -> options: lse (an output LSE), fused (the fused mask), layout, base, fp8, ptwc, in_dtype
VARIANTS = {
    "plain": dict(lse=False),
    "lse": dict(lse=True),
    "fused": dict(lse=True, fused=True),
    "th": dict(lse=True, layout="TH"),
    "fused_th": dict(lse=True, fused=True, layout="TH"),
    "base2": dict(lse=True, base=2),
    "fp8": dict(lse=False, fp8=True),
    "pass_through": dict(lse=True, ptwc=True),
    "fp32_to_bf16": dict(lse=True, in_dtype="float32", out_dtype="bfloat16"),
}
SPEED_VARIANTS = ("plain", "lse", "fused", "th", "fused_th")
REQUEST_LEN = 128  # tokens per request of the fused mask's offsets


def _offsets(n: int, num_tokens: int):
    """(query_start_loc i32[R+1], cu_seq_lens i32[N, R+1]) as numpy: requests of REQUEST_LEN tokens, each partial
    with no KV for every third request (shifted per partial)."""
    import numpy as np

    num_requests = max(1, num_tokens // REQUEST_LEN)
    qsl = np.minimum(np.arange(num_requests + 1) * REQUEST_LEN, num_tokens).astype(np.int32)
    kv = (np.arange(num_requests)[None, :] + np.arange(n)[:, None]) % 3
    cu = np.concatenate([np.zeros((n, 1), np.int64), np.cumsum(kv, axis=1)], axis=1).astype(np.int32)
    return qsl, cu


def merge_bytes(n, T, H, D, in_bytes, out_bytes, lse: bool) -> int:
    """`parity.tools.bench.points.FORMULAS["merge_n"]`."""
    return n * (T * H * D * in_bytes + T * H * 4) + T * H * D * out_bytes + (T * H * 4 if lse else 0)


# ---------------------------------------------------------------------------------------------------------
# Workers (one framework per process)


class _Triton:
    name = "triton"

    def __init__(self):
        import torch

        import triton_impl

        self.torch, self.ti = torch, triton_impl
        self.dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run under TRITON_INTERPRET=1

    def sync(self):
        if self.dev == "cuda":
            self.torch.cuda.synchronize()

    def build(self, n, T, H, D, opts):
        torch = self.torch
        dt = getattr(torch, opts.get("in_dtype", "bfloat16"))
        out_dt = torch.float8_e4m3fn if opts.get("fp8") else getattr(torch, opts.get("out_dtype", str(dt)[6:]))
        g = torch.Generator(device=self.dev).manual_seed(n)
        outs = torch.randn((n, T, H, D), dtype=dt, device=self.dev, generator=g)
        lse_shape = (n, H, T) if opts.get("layout", "HT") == "HT" else (n, T, H)
        lses = torch.randn(lse_shape, device=self.dev, generator=g) * 3.0
        out = torch.empty((T, H, D), dtype=out_dt, device=self.dev)
        olse = torch.empty(lse_shape[1:], device=self.dev) if opts["lse"] else None
        scale = torch.full((1,), 0.05, device=self.dev) if opts.get("fp8") else None
        kw = dict(lse_layout=opts.get("layout", "HT"), lse_base=opts.get("base", 2.718281828459045))
        if opts.get("fused"):
            qsl, cu = _offsets(n, T)
            kw.update(query_start_loc=torch.from_numpy(qsl).to(self.dev), cu_seq_lens=torch.from_numpy(cu).to(self.dev))
        ptwc = T // 2 if opts.get("ptwc") else None
        return lambda: self.ti.merge_attn_states_n(out, outs, lses, olse, ptwc, scale, **kw)

    def gpu_us(self, call):
        from parity.tools.bench import timers

        q, _, _ = timers.time_cudagraph(call, 300)
        return q[1]

    def ceiling_tbps(self):
        """The bench's add_2r1w ceiling: torch.add of 2 GiB bf16 tensors by CUDA-graph replay."""
        from parity.tools.bench import timers

        return timers.torch_copy_ceiling_tbps(300)

    def free(self):
        self.torch.cuda.empty_cache()


class _Pallas:
    name = "pallas"

    def __init__(self):
        import jax
        import jax.numpy as jnp

        import pallas_impl

        try:  # no persistent compilation cache: every signature compiles
            jax.config.update("jax_enable_compilation_cache", False)
        except (AttributeError, KeyError, ValueError):
            pass
        self.jax, self.jnp, self.pi = jax, jnp, pallas_impl

    def sync(self):
        self.jnp.zeros(()).block_until_ready()

    def build(self, n, T, H, D, opts):
        jax, jnp = self.jax, self.jnp
        dt = jnp.dtype(opts.get("in_dtype", "bfloat16"))
        out_dtype = jnp.float8_e4m3fn if opts.get("fp8") else jnp.dtype(opts.get("out_dtype", dt.name))
        k1, k2 = jax.random.split(jax.random.key(n))
        row = jax.random.normal(k1, (T, H, D), jnp.float32)
        outs = jax.jit(lambda r: (r[None] + jnp.arange(n, dtype=jnp.float32)[:, None, None, None] * 0.01)
                       .astype(dt))(row)
        lse_shape = (n, H, T) if opts.get("layout", "HT") == "HT" else (n, T, H)
        lses = jax.random.normal(k2, lse_shape, jnp.float32) * 3.0
        kw = dict(lse_layout=opts.get("layout", "HT"), lse_base=opts.get("base", 2.718281828459045),
                  return_lse=opts["lse"], out_dtype=out_dtype, implementation="pallas", backend="triton")
        if opts.get("fp8"):
            kw["output_scale"] = jnp.full((1,), 0.05, jnp.float32)
        if opts.get("fused"):
            qsl, cu = _offsets(n, T)
            kw.update(query_start_loc=jnp.asarray(qsl), cu_seq_lens=jnp.asarray(cu))
        if opts.get("ptwc"):
            kw["prefill_tokens_with_context"] = T // 2
        fn = self.jax.jit(lambda o, l: self.pi.merge_attn_states_n(o, l, **kw))
        outs.block_until_ready()

        def call():
            return fn(outs, lses)

        return call

    def gpu_us(self, call):
        from parity.tools.bench import timers

        res = []

        def run():
            res[:] = [call()]

        def sync():
            self.jax.block_until_ready(res)

        q, _, _ = timers.time_jax_gpu(run, sync, 10, 3, use_profiler=True)
        return q[1]

    def ceiling_tbps(self):
        """XLA's a + b of 2 GiB bf16 tensors (two reads, one write), by jax.profiler kernel time."""
        from parity.tools.bench import points

        jnp = self.jnp
        n = points.CEILING_ELEMS
        a, b = jnp.ones(n, jnp.bfloat16), jnp.ones(n, jnp.bfloat16)
        add = self.jax.jit(lambda x, y: x + y)
        us = self.gpu_us(lambda: add(a, b))
        return 3 * 2 * n / (us * 1e-6) / 1e12

    def free(self):
        import gc

        gc.collect()


def _worker(part: str, framework: str, ns, variants=SPEED_VARIANTS) -> list[dict]:
    fw = _Triton() if framework == "triton" else _Pallas()
    records = []
    if part == "compile":
        s = COMPILE_SHAPE
        warm = fw.build(2, s["T"], s["H"], s["D"], VARIANTS["plain"])
        t0 = time.perf_counter()
        warm()
        fw.sync()
        records.append(dict(part=part, framework=framework, variant="warmup", N=2, first_s=time.perf_counter() - t0))
        for n in ns:
            for variant, opts in VARIANTS.items():
                call = fw.build(n, s["T"], s["H"], s["D"], opts)
                fw.sync()
                t0 = time.perf_counter()
                call()
                fw.sync()
                first = time.perf_counter() - t0
                t0 = time.perf_counter()
                call()
                fw.sync()
                records.append(dict(part=part, framework=framework, variant=variant, N=n, first_s=first,
                                    second_s=time.perf_counter() - t0, **s))
                print(json.dumps(records[-1]), file=sys.stderr, flush=True)
                call = None
                fw.free()
        return records
    s = SPEED_SHAPE
    ceiling = fw.ceiling_tbps()
    fw.free()
    records.append(dict(part=part, framework=framework, variant="ceiling add_2r1w", tbps=ceiling))
    for n in ns:
        for variant in variants:
            opts = VARIANTS[variant]
            call = fw.build(n, s["T"], s["H"], s["D"], opts)
            us = fw.gpu_us(call)
            nbytes = merge_bytes(n, s["T"], s["H"], s["D"], 2, 2, opts["lse"])
            tbps = nbytes / (us * 1e-6) / 1e12
            records.append(dict(part=part, framework=framework, variant=variant, N=n, us=us, bytes=nbytes,
                                tbps=tbps, frac_own_ceiling=tbps / ceiling, **s))
            print(json.dumps(records[-1]), file=sys.stderr, flush=True)
            call = None
            fw.free()
    return records


# ---------------------------------------------------------------------------------------------------------
# Driver


def _spawn(part: str, framework: str, ns, variants) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="wide_n_triton_cache_") as cache:
        env = dict(os.environ, TRITON_CACHE_DIR=cache, XLA_PYTHON_CLIENT_PREALLOCATE="false",
                   PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        cmd = [sys.executable, "-m", "tools.wide_n", "--worker", part, "--frameworks", framework, "--ns", ",".join(map(str, ns)),
               "--variants", ",".join(variants)]
        done = subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    if done.returncode:
        return [dict(part=part, framework=framework, error=f"worker exited with {done.returncode}")]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _table(records) -> None:
    compile_rows = [r for r in records if r.get("part") == "compile" and "N" in r and r["variant"] != "warmup"]
    if compile_rows:
        print("\n(a) first call (compile included) / second call, seconds; T=256 H=32 D=128")
        for fw in sorted({r["framework"] for r in compile_rows}):
            rows = [r for r in compile_rows if r["framework"] == fw]
            ns = sorted({r["N"] for r in rows})
            print(f"{fw:8s} {'variant':14s} " + " ".join(f"N={n:<13d}" for n in ns))
            for v in VARIANTS:
                cells = {r["N"]: f"{r['first_s']:6.2f}/{r['second_s']:.4f}" for r in rows if r["variant"] == v}
                print(f"{'':8s} {v:14s} " + " ".join(f"{cells.get(n, '-'):15s}" for n in ns))
        worst = max(r["first_s"] for r in compile_rows)
        print(f"worst first call: {worst:.2f} s ({'under' if worst < 5 else 'OVER'} the 5 s target)")
    speed = [r for r in records if r.get("part") == "speed"]
    if speed:
        torch_ceiling = next((r["tbps"] for r in speed if r["framework"] == "triton" and "ceiling" in r["variant"]),
                             None)
        print("\n(b) GPU time, T=8192 H=64 D=128 bf16; frac = TB/s / ceiling (torch.add 2r1w of this run)")
        for r in speed:
            if "ceiling" in r["variant"]:
                print(f"{r['framework']:8s} ceiling add_2r1w {r['tbps']:.3f} TB/s")
                continue
            frac = r["tbps"] / torch_ceiling if torch_ceiling else r["frac_own_ceiling"]
            print(f"{r['framework']:8s} N={r['N']:<4d} {r['variant']:6s} {r['us']:10.1f} us {r['tbps']:.3f} TB/s "
                  f"frac {frac:.3f} ({'ok' if frac >= 0.9 else 'BELOW'} 0.90)")
    for r in records:
        if "error" in r:
            print(f"{r['part']} {r['framework']}: {r['error']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("compile", "speed", "all"), default="all")
    ap.add_argument("--frameworks", default="triton,pallas")
    ap.add_argument("--ns", default=None, help="comma-separated N (default: 4,16,64,128,256 / 128,256)")
    ap.add_argument("--variants", default=",".join(SPEED_VARIANTS), help="speed: comma-separated variants")
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", choices=("compile", "speed"), default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    frameworks = [f for f in args.frameworks.split(",") if f]
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}; the variants are {list(VARIANTS)}")
    if args.worker:
        ns = tuple(int(x) for x in args.ns.split(","))
        print(json.dumps(_worker(args.worker, frameworks[0], ns, variants)))
        return 0
    records = []
    for part in (("compile", "speed") if args.part == "all" else (args.part,)):
        ns = tuple(int(x) for x in args.ns.split(",")) if args.ns else (COMPILE_NS if part == "compile" else SPEED_NS)
        for fw in frameworks:
            records += _spawn(part, fw, ns, variants)
    _table(records)
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))
    return 1 if any("error" in r for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
