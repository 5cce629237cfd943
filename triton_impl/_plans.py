"""Launch plans (docs/design.md, "Per-call cost"): what a Triton wrapper computes once per signature.

A wrapper keys its plan on the `meta` of every tensor argument and its options (a cheap tuple); a plan is stored
only after every metadata check passed for that key, so a hit skips them and runs the per-call checks only
(data-pointer overlap, prefill_tokens_with_context). Bounded: full, it starts over. MLA_LSE_MERGE_PLAN_CACHE=0
turns it off (every call runs every check).

A plan and its launch are built by name (`plan`, `kernel_launch`, `merge_launch`: keyword-only, the fields and their
order defined there once) and stored as plain tuples in that order, which a cache hit unpacks: CPython unpacks an
exact tuple several times faster than a NamedTuple (docs/design.md, "Per-call cost"), and a hit does little else.
"""

from __future__ import annotations

import os
from typing import NamedTuple

from mla_lse_common import tiles
from triton_impl._backend import tracing

PLANS: dict = {}
PLANS_MAX = 4096
PLAN_CACHE = os.environ.get("MLA_LSE_MERGE_PLAN_CACHE", "1") != "0"


# A plan's launch on the torch path (`triton_impl/torch_fallback.py`), with what it needs beyond the call's
# arguments: (TORCH, options).
TORCH = "torch"


def torch_launch(**options) -> tuple:
    """The launch of a plan on the torch path: (TORCH, the keyword options of its `torch_fallback` function)."""
    return TORCH, options


def plan(*, overlaps: tuple, num_tokens: int, launch: tuple | str | None) -> tuple:
    """A wrapper's plan for one signature: (overlaps, num_tokens, launch).

    overlaps: `_checks.overlap_checks` of each written tensor, the per-call overlap test; num_tokens: T
    (prefill_tokens_with_context's default and clamp); launch: `kernel_launch` or `merge_launch`, None where there
    is nothing to launch (no tokens, heads or requests), or a wrapper's marker of a launch without a kernel
    (the N-way merge's `EMPTY`)."""
    return overlaps, num_tokens, launch


def kernel_launch(*, grid: tuple, ints: tuple, constexprs: dict, state: list) -> tuple:
    """One kernel launch but for its per-call arguments: (grid, ints, constexprs, state).

    ints: the integer arguments after the pointers (strides, then sizes); constexprs: compile-time arguments and
    launch options; state: `_launch.launch`'s record of the compiled kernel (`_launch.launch_state`)."""
    return grid, ints, constexprs, state


def merge_launch(*, grid: tuple, fused: bool, ints: tuple, num_requests: int, constexprs: dict,
                 state: list) -> tuple:
    """A merge's launch: (grid, fused, ints, num_requests, constexprs, state), `kernel_launch`'s fields and what picks
    the pointers: fused, whether the kernel reads query_start_loc and the KV offsets; num_requests, R (its last
    argument, after the per-call prefill_tokens_with_context)."""
    return grid, fused, ints, num_requests, constexprs, state


class CpPlan(NamedTuple):
    """The context-parallel combine's per-signature facts (`cp_merge._local_checks`), read by name."""
    fp8: bool  # a float8_e4m3fn output
    base2: bool  # lse_base=2
    num_requests: int  # R of the fused mask, -1 without it


def n_way_loops(variant: str, num_partials: int, *, max_and_sum: bool = True, weighted_sum: bool = True) -> dict:
    """The constexprs of `_device._max_and_sum`'s loops (unless max_and_sum=False) and of the N-way merge's weighted
    sum (unless weighted_sum=False) for N = `num_partials` partials of `variant`: `tiles.N_LOOPS` partitioned by
    `tiles.max_chunks` and `loop_steps`, and the weighted sum's `tiles.out_stages`."""
    chunk, exp_step, out_step = tiles.n_loops("triton", variant)
    loops = {}
    if max_and_sum:
        loops.update(LSE_STEPS=tiles.loop_steps(num_partials - 1, num_partials, exp_step), EXP_STEP=exp_step,
                     MAX_CHUNKS=tiles.max_chunks(num_partials, chunk), MAX_CHUNK=max(chunk, 1))
    if weighted_sum:
        loops.update(OUT_STEPS=tiles.loop_steps(num_partials - 2, num_partials, out_step), OUT_STEP=out_step,
                     OUT_STAGES=tiles.out_stages("triton", variant, num_partials))
    return loops


def meta(x):
    """What a tensor argument's metadata checks and launch arguments depend on (None for None; raises
    AttributeError for most non-tensors, which then take the checked path and its error)."""
    return None if x is None else (x.__class__, x.dtype, x.shape, x.stride(), x.device)


def find_plan(name: str, tensors: tuple, options):
    """(key, plan) of a call: the plan-cache key (None where the cache cannot be used: off, tracing, an argument
    that is no tensor or is unhashable) and the plan stored for it, if any."""
    if not PLAN_CACHE or tracing():
        return None, None
    try:
        key = (name, options, tuple(map(meta, tensors)))
        return key, PLANS.get(key)
    except (AttributeError, TypeError):
        return None, None


def remember(key, plan) -> None:
    if key is None:
        return
    if len(PLANS) >= PLANS_MAX:
        PLANS.clear()
    PLANS[key] = plan
