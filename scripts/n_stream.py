"""What limits the N-way merge at large N on the GPU: the merge beside a stream of the same bytes without the LSEs.

    python scripts/n_stream.py [--points 16:8192,128:1024,128:8192] [--json OUT.json]

For each (N, T) point (H = 64, D = 128 bf16) one process times, by CUDA-graph replay, as % of the copy ceiling of
`python -m parity bench` (torch.add of 2 GiB bf16 tensors: two reads, one write):
  - `merge_attn_states_n` of triton_impl, plain and with an output LSE (the committed launch tables);
  - `stream`: a diagnostic kernel that sums the N partials' tiles, out = o_0 + ... + o_{N-1} (no LSE, no weights),
    with the merge's grid order (head blocks fastest) and a tile, warps and loop of its own (`CONFIGS`): the bytes
    of the merge's outputs read the same way, without the three passes over the LSEs;
  - at N a multiple of 32, the merge's three passes simplified (`PASSES`): one tile per program as the merge; a
    program of 2 or 4 tiles that computes the next tile's maximum and sum inside this tile's weighted sum (the same
    operations in the same order per tile: the same bits, checked on a CPU); two kernels, one computing every
    tile's maximum and sum (the LSEs only: 1/64 of the outputs' bytes at D = 128 bf16), then the weighted sum
    reading them (the same bits, checked on a CPU); the weighted sum alone, its maximum and sum given. How much of
    the gap to the stream an overlap or a split of the passes would close.
Reading the table: if the stream at a tile is no faster than the merge, the passes over the LSEs are not what limits
it; if the stream at (N, T) falls with the bytes' span (N x T) at a fixed N, the access pattern is (address
translation, DRAM pages), not the loops. The diagnostics' sums are not the merge's bits (no special values, no
pass-through); nothing here is a result of the project's kernels but their times.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import triton_impl  # noqa: E402
from parity.tools.bench import points, timers  # noqa: E402

H, D = 64, 128
# name -> (BLOCK_T, BLOCK_H, warps, step, unroll, evict): step partials per runtime step (each unrolled), or every
# partial unrolled; evict the L2 policy of the partials' loads ("" normal, "evict_first").
CONFIGS = {
    "8x1 w4 s8": (8, 1, 4, 8, False, ""),  # the merge's tile and weighted-sum step at N > 16
    "8x1 w4 s8 ef": (8, 1, 4, 8, False, "evict_first"),
    "8x1 w4 unrolled": (8, 1, 4, 8, True, ""),
    "8x1 w4 s16": (8, 1, 4, 16, False, ""),
    "1x8 w4 s8": (1, 8, 4, 8, False, ""),
    "16x1 w4 s4": (16, 1, 4, 4, False, ""),
    "8x8 w8 s2": (8, 8, 8, 2, False, ""),
    "1x64 w8 s2": (1, 64, 8, 2, False, ""),
}


@triton.jit
def _stream_kernel(out_ptr, outs_ptr, stride_n, N: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, STEP: tl.constexpr, UNROLL: tl.constexpr,
                   EVICT: tl.constexpr):
    pid = tl.program_id(0)
    num_h_blocks: tl.constexpr = NUM_HEADS // BLOCK_H
    t = (pid // num_h_blocks) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = (pid % num_h_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, HEAD_DIM)
    offs = (t.to(tl.int64)[:, None, None] * (NUM_HEADS * HEAD_DIM) + h[None, :, None] * HEAD_DIM
            + d[None, None, :])
    stride_n = tl.cast(stride_n, tl.int64)
    acc = tl.zeros([BLOCK_T, BLOCK_H, HEAD_DIM], tl.float32)
    if UNROLL:
        for i in tl.static_range(N):
            acc += tl.load(outs_ptr + i * stride_n + offs, eviction_policy=EVICT).to(tl.float32)
    else:
        for k in range(0, N // STEP):
            for j in tl.static_range(STEP):
                acc += tl.load(outs_ptr + (k * STEP + j) * stride_n + offs, eviction_policy=EVICT).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty))


def stream(out, outs, config):
    bt, bh, warps, step, unroll, evict = config
    n, T = outs.shape[:2]
    _stream_kernel[(T // bt * (H // bh),)](out, outs, outs.stride(0), N=n, NUM_HEADS=H, HEAD_DIM=D, BLOCK_T=bt,
                                           BLOCK_H=bh, STEP=step, UNROLL=unroll, EVICT=evict, num_warps=warps)


# The merge's three passes, simplified (no NaN/inf cleaning, no fused mask, no pass-through, plain LSE-free store),
# with the merge's tile (8 tokens x 1 head, [H, T] LSEs, 4 warps): name -> (tiles per program, max chunk, sum step,
# weighted-sum step, mode). A program of `tiles` > 1 merges that many consecutive tiles and computes the next
# tile's maximum and sum inside the current tile's weighted-sum loop (one chunk or one sum step per weighted-sum
# step): the same operations in the same order per tile, their round trips overlapped with the stream. Mode
# "split": a first kernel (`_mz_kernel`) computes every position's maximum and sum with the same loops and stores
# them, the second reads them and runs the weighted sum; "given": the second kernel alone (its floor).
PASS_BLOCK_T = 8  # tokens of a tile (one head)
MZ_BLOCK = 256  # LSE positions of a `_mz_kernel` program
PASSES = {
    "3 passes": (1, 32, 16, 8, ""),
    "3 passes, next tile's overlapped, 2 tiles": (2, 32, 16, 8, ""),
    "3 passes, next tile's overlapped, 4 tiles": (4, 32, 16, 8, ""),
    "3 passes, short steps": (1, 32, 8, 4, ""),
    "3 passes, short steps, overlapped, 2 tiles": (2, 32, 8, 4, ""),
    "3 passes, short steps, overlapped, 4 tiles": (4, 32, 8, 4, ""),
    "3 passes, short steps, chunks of 16, overlapped, 2 tiles": (2, 16, 8, 4, ""),
    "2 kernels: m, z; weighted sum": (1, 32, 16, 8, "split"),
    "2 kernels: m, z; weighted sum, chunks of 8": (1, 8, 16, 8, "split"),
    "2 kernels: m, z; weighted sum, steps of 4": (1, 32, 16, 4, "split"),
    "weighted sum only (m, z given)": (1, 32, 16, 8, "given"),
}


@triton.jit
def _tile(tile, stride_lse_h, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr):
    t = (tile // NUM_HEADS) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tile % NUM_HEADS
    o_offs = (t.to(tl.int64)[:, None] * (NUM_HEADS * HEAD_DIM) + h * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :])
    return o_offs, h * stride_lse_h + t


@triton.jit
def _chunk(m, k, lses_ptr, stride_ln, lse_offs, CHUNK: tl.constexpr):
    i = (k * CHUNK + tl.arange(0, CHUNK)).to(tl.int64)
    return tl.maximum(m, tl.max(tl.load(lses_ptr + i[:, None] * stride_ln + lse_offs[None, :]), axis=0))


@triton.jit
def _sum_step(z, k, m, lses_ptr, stride_ln, lse_offs, EXP_STEP: tl.constexpr):
    for j in tl.static_range(EXP_STEP):
        z = z + tl.exp(tl.load(lses_ptr + (k * EXP_STEP + j) * stride_ln + lse_offs) - m)
    return z


@triton.jit
def _max_and_sum(lses_ptr, stride_ln, offs, N: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
                 EXP_STEP: tl.constexpr):
    """(m, z) of BLOCK positions: the maximum in chunks, then the sum of exponentials in steps."""
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    for k in range(0, N // CHUNK):
        m = _chunk(m, k, lses_ptr, stride_ln, offs, CHUNK)
    z = tl.zeros([BLOCK], tl.float32)
    for k in range(0, N // EXP_STEP):
        z = _sum_step(z, k, m, lses_ptr, stride_ln, offs, EXP_STEP)
    return m, z


@triton.jit
def _mz_kernel(mz_ptr, lses_ptr, stride_ln, num_positions, N: tl.constexpr, BLOCK: tl.constexpr,
               CHUNK: tl.constexpr, EXP_STEP: tl.constexpr):
    """Every position's maximum, then its sum of exponentials, with `passes`' loops: mz[0] = m, mz[1] = z."""
    stride_ln = tl.cast(stride_ln, tl.int64)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m, z = _max_and_sum(lses_ptr, stride_ln, offs, N, BLOCK, CHUNK, EXP_STEP)
    tl.store(mz_ptr + offs, m)
    tl.store(mz_ptr + num_positions + offs, z)


@triton.jit
def _passes_kernel(out_ptr, outs_ptr, lses_ptr, mz_ptr, stride_n, stride_ln, stride_lse_h, num_tiles,
                   N: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr,
                   TILES: tl.constexpr, CHUNK: tl.constexpr, EXP_STEP: tl.constexpr, OUT_STEP: tl.constexpr,
                   GIVEN: tl.constexpr, EVICT: tl.constexpr):  # GIVEN: m, z read from mz
    stride_n = tl.cast(stride_n, tl.int64)
    stride_ln = tl.cast(stride_ln, tl.int64)
    first = tl.program_id(0) * TILES
    o_offs, lse_offs = _tile(first, stride_lse_h, NUM_HEADS, HEAD_DIM, BLOCK_T)
    if GIVEN:
        m = tl.load(mz_ptr + lse_offs)
        z = tl.load(mz_ptr + num_tiles * BLOCK_T + lse_offs)
    else:
        m, z = _max_and_sum(lses_ptr, stride_ln, lse_offs, N, BLOCK_T, CHUNK, EXP_STEP)
    for i in range(0, TILES):
        next_o, next_lse = _tile(tl.minimum(first + i + 1, num_tiles - 1), stride_lse_h, NUM_HEADS, HEAD_DIM,
                                 BLOCK_T)
        m_next = tl.full([BLOCK_T], float("-inf"), tl.float32)
        z_next = tl.zeros([BLOCK_T], tl.float32)
        out = tl.zeros([BLOCK_T, HEAD_DIM], tl.float32)
        for k in range(0, N // OUT_STEP):
            for j in tl.static_range(OUT_STEP):
                p = k * OUT_STEP + j
                w = tl.exp(tl.load(lses_ptr + p * stride_ln + lse_offs) - m) / z
                out = out + tl.load(outs_ptr + p * stride_n + o_offs, eviction_policy=EVICT).to(tl.float32) * w[:, None]
            if TILES > 1:  # the next tile's maximum, then its sum, one step per weighted-sum step
                if k < N // CHUNK:
                    m_next = _chunk(m_next, k, lses_ptr, stride_ln, next_lse, CHUNK)
                elif k < N // CHUNK + N // EXP_STEP:
                    z_next = _sum_step(z_next, k - N // CHUNK, m_next, lses_ptr, stride_ln, next_lse, EXP_STEP)
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty))
        o_offs, lse_offs, m, z = next_o, next_lse, m_next, z_next


def passes(out, outs, lses, mz, config, evict="evict_first"):
    """One `PASSES` config over contiguous [N, T, H, D] outputs and [N, H, T] LSEs; mz: f32[2, H, T] (mode
    "given": read; "split": written by the first kernel)."""
    tiles_per_program, chunk, exp_step, out_step, mode = config
    n, T = outs.shape[:2]
    num_tiles = T // PASS_BLOCK_T * H
    assert n % chunk == 0 and n % exp_step == 0 and n % out_step == 0 and num_tiles % tiles_per_program == 0
    assert tiles_per_program == 1 or n // out_step >= n // chunk + n // exp_step
    if mode == "split":
        block = min(MZ_BLOCK, T * H)
        assert (T * H) % block == 0
        _mz_kernel[(T * H // block,)](mz, lses, lses.stride(0), T * H, N=n, BLOCK=block, CHUNK=chunk,
                                      EXP_STEP=exp_step, num_warps=4)
    _passes_kernel[(num_tiles // tiles_per_program,)](
        out, outs, lses, mz, outs.stride(0), lses.stride(0), lses.stride(1), num_tiles, N=n, NUM_HEADS=H,
        HEAD_DIM=D, BLOCK_T=PASS_BLOCK_T, TILES=tiles_per_program, CHUNK=chunk, EXP_STEP=exp_step, OUT_STEP=out_step,
        GIVEN=mode != "", EVICT=evict, num_warps=4)


def gpu_us(fn) -> float:
    return timers.time_cudagraph(fn, 20)[0][1]  # p50; it compiles and warms up outside the capture


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", default="16:8192,16:65536,128:1024,128:8192,256:512,256:8192",
                    help="N:T pairs, comma-separated")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="stream configs (CONFIGS), comma-separated")
    ap.add_argument("--no-passes", action="store_true", help="skip the simplified three-pass merges (PASSES)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("scripts/n_stream.py needs a CUDA GPU", file=sys.stderr)
        return 2
    ceiling = timers.torch_copy_ceiling_tbps()
    rows = [{"ceiling_tbps": ceiling}]
    print(f"copy ceiling {ceiling:.3f} TB/s; % of it (GPU time us)")
    for point in args.points.split(","):
        n, T = (int(v) for v in point.split(":"))
        g = torch.Generator(device="cuda").manual_seed(0)
        outs = torch.randn(n, T, H, D, generator=g, device="cuda", dtype=torch.bfloat16)
        lses = torch.randn(n, H, T, generator=g, device="cuda") * 3 + 4
        out = torch.empty(T, H, D, device="cuda", dtype=torch.bfloat16)
        out_lse = torch.empty(H, T, device="cuda")
        span_gb = outs.numel() * 2 / 1e9
        timed = {}
        for variant in ("plain", "lse"):
            fn = functools.partial(triton_impl.merge_attn_states_n, out, outs, lses,
                                   out_lse if variant == "lse" else None)
            timed[f"merge {variant}"] = (gpu_us(fn), points.MergePoint(T, H, D, "bfloat16", variant, n).bytes)
        for name in args.configs.split(","):
            config = CONFIGS[name]
            if config[4] and n > 128:  # unrolled beyond 128 partials: long compiles, nothing new
                continue
            timed[f"stream {name}"] = (gpu_us(functools.partial(stream, out, outs, config)),
                                       (n + 1) * T * H * D * 2)
        if not args.no_passes and n % 32 == 0:
            mz = torch.ones(2, H, T, device="cuda")  # `given`'s maximum and sum: any values time the same
            mz[0] = lses.max(0).values
            for name, config in PASSES.items():
                timed[name] = (gpu_us(functools.partial(passes, out, outs, lses, mz, config)),
                               points.MergePoint(T, H, D, "bfloat16", "plain", n).bytes)
        for what, (us, nbytes) in timed.items():
            pct = 100 * nbytes / us / 1e6 / ceiling
            row = dict(N=n, T=T, H=H, D=D, span_gb=round(span_gb, 2), what=what, us=round(us, 2), pct=round(pct, 1))
            rows.append(row)
            print(f"N={n:4d} T={T:6d} span {span_gb:6.1f} GB  {what:44s} {pct:6.1f}%  ({us:9.1f} us)", flush=True)
        outs = lses = out = out_lse = None
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": sys.argv[1:], "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
