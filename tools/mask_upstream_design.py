"""A timing comparator for `tools/mask_floor.py`: the LSE-only mask of upstream's design, re-implemented here
from the design description of docs/spec.md 3 (not this project's kernel, not upstream's code).

The design: one program per 128-token query block over a worst-case grid of `T // 128 + R` programs; request r
owns the programs from `qsl[r] // 128 + r` on; a program finds its request with a single-level scan that
compares 32 request boundaries per step and sums, finds it once and uses it for every head, and, when that
request's context chunk is empty, writes -inf over all H heads of its tokens in one store. No second grid axis,
no output zeroing, `[H, T]` LSE only.

Checked against `triton_impl.mask_empty_context_lse` (the same bits) by `mask_floor.py` before it is timed, and
under the interpreter by `python -m tools mask-upstream-design` (a CPU check on small random batches).
"""

from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl

BLOCK_T = 128
SCAN = 32


@triton.jit
def _upstream_design_mask_kernel(lse_ptr, qsl_ptr, cu_ptr, stride_lse_h, stride_lse_t, num_requests,
                                 NUM_HEADS: tl.constexpr, BLOCK_HP: tl.constexpr, BLOCK_T: tl.constexpr,
                                 SCAN: tl.constexpr):
    pid = tl.program_id(0)
    # The owning request: (requests whose first program is at or before pid) - 1, 32 boundaries per step.
    count = tl.zeros((SCAN,), tl.int32)
    for r0 in range(0, num_requests, SCAN):
        r = r0 + tl.arange(0, SCAN)
        valid = r < num_requests
        first = tl.load(qsl_ptr + r, mask=valid, other=0) // BLOCK_T + r
        count += (valid & (first <= pid)).to(tl.int32)
    req = tl.sum(count, axis=0) - 1
    if tl.load(cu_ptr + req + 1) == tl.load(cu_ptr + req):
        q_start = tl.load(qsl_ptr + req)
        q_end = tl.load(qsl_ptr + req + 1)
        t = (pid - req) * BLOCK_T + tl.arange(0, BLOCK_T)
        h = tl.arange(0, BLOCK_HP)
        m = (h < NUM_HEADS)[:, None] & ((t >= q_start) & (t < q_end))[None, :]
        ptrs = lse_ptr + h[:, None].to(tl.int64) * stride_lse_h + t[None, :].to(tl.int64) * stride_lse_t
        tl.store(ptrs, tl.full((BLOCK_HP, BLOCK_T), float("-inf"), tl.float32), mask=m)


def mask_upstream_design(lse: torch.Tensor, query_start_loc: torch.Tensor, cu_seq_lens: torch.Tensor,
                         num_warps: int = 4) -> None:
    """`lse` (f32 [H, T]) in place: -inf over every head of the tokens of each request with an empty chunk."""
    num_heads, num_tokens = lse.shape
    num_requests = query_start_loc.numel() - 1
    if num_requests <= 0 or num_tokens == 0:
        return
    grid = (num_tokens // BLOCK_T + num_requests,)
    _upstream_design_mask_kernel[grid](lse, query_start_loc, cu_seq_lens, lse.stride(0), lse.stride(1),
                                       num_requests, NUM_HEADS=num_heads,
                                       BLOCK_HP=triton.next_power_of_2(num_heads), BLOCK_T=BLOCK_T, SCAN=SCAN,
                                       num_warps=num_warps)


def _cpu_check(trials: int = 6) -> int:
    """Small random batches under the interpreter: the same bits as the float64 reference's mask."""
    import numpy as np

    from parity.harness import reference

    rng = np.random.default_rng(0)
    for i in range(trials):
        num_requests = int(rng.integers(1, 40))
        lens = rng.integers(0, 300, num_requests)
        qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        cu = np.concatenate([[0], np.cumsum(rng.integers(0, 2, num_requests) * 7)]).astype(np.int32)
        num_heads, num_tokens = int(rng.integers(1, 20)), int(qsl[-1] + rng.integers(0, 200))
        lse = rng.standard_normal((num_heads, num_tokens)).astype(np.float32)
        want = reference.mask_empty_context_lse(lse, qsl, cu)[0]
        got = torch.from_numpy(lse.copy())
        mask_upstream_design(got, torch.from_numpy(qsl), torch.from_numpy(cu))
        if not np.array_equal(got.numpy().view(np.uint32), np.asarray(want, np.float32).view(np.uint32)):
            print(f"trial {i}: differs (R={num_requests}, H={num_heads}, T={num_tokens})")
            return 1
    print(f"{trials} random batches: the same bits as the reference")
    return 0


if __name__ == "__main__":
    if not os.environ.get("TRITON_INTERPRET"):
        print("run with TRITON_INTERPRET=1 (the CPU check of this comparator)", file=sys.stderr)
        sys.exit(2)
    sys.exit(_cpu_check())
