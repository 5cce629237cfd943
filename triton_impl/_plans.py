"""Launch plans (docs/design.md, "Per-call cost"): what a Triton wrapper computes once per signature.

A wrapper keys its plan on the `meta` of every tensor argument and its options (a cheap tuple); a plan is stored
only after every metadata check passed for that key, so a hit skips them and runs the per-call checks only
(data-pointer overlap, prefill_tokens_with_context). Bounded: full, it starts over. MLA_LSE_MERGE_PLAN_CACHE=0
turns it off (every call runs every check). Plans and their launches are named records (tuples, so the hot path
unpacks them as fast as before).
"""

from __future__ import annotations

import os
from typing import NamedTuple

from triton_impl._backend import tracing

PLANS: dict = {}
PLANS_MAX = 4096
PLAN_CACHE = os.environ.get("MLA_LSE_MERGE_PLAN_CACHE", "1") != "0"


class Launch(NamedTuple):
    """One kernel launch of a plan, but for the per-call arguments (`prefill_tokens_with_context`, the CP rank)."""
    grid: tuple
    ints: tuple  # the integer arguments that follow the pointers: strides, then sizes
    constexprs: dict  # compile-time arguments and launch options
    state: list  # `_launch.launch`'s record of the compiled kernel (`_launch.launch_state`)


class MergeLaunch(NamedTuple):
    """A merge's launch: `Launch`'s fields and what picks the pointers (the fused mask's offsets or placeholders)."""
    grid: tuple
    fused: bool  # the kernel reads query_start_loc and the KV offsets
    ints: tuple  # strides, then T
    num_requests: int  # R, the kernel's last argument
    constexprs: dict
    state: list


class Plan(NamedTuple):
    """A wrapper's plan for one signature."""
    overlaps: tuple  # `_checks.overlap_checks` of each written tensor: the per-call overlap test
    num_tokens: int  # T (prefill_tokens_with_context's default and clamp)
    launch: Launch | MergeLaunch | None  # None: nothing to launch (no tokens, heads or requests)


class CpPlan(NamedTuple):
    """The context-parallel combine's per-signature facts (`cp_merge._local_checks`)."""
    fp8: bool  # a float8_e4m3fn output
    base2: bool  # lse_base=2
    num_requests: int  # R of the fused mask, -1 without it


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
