"""The launch of a cached plan through the compiled kernel's own launcher (docs/design.md, "Per-call cost").

MLA_LSE_MERGE_DIRECT_LAUNCH=0 keeps every launch on `kernel[grid](...)`.
"""

from __future__ import annotations

import os
import warnings

import torch
import triton

from triton_impl import _backend
from triton_impl._plans import PLAN_CACHE


def _direct_launch_version() -> bool:
    """Triton versions whose JITFunction.run ends in the launcher call that `launch` repeats (read in 3.4 to 3.9)."""
    major, minor = (int(x) for x in triton.__version__.split(".")[:2])
    return (3, 4) <= (major, minor) <= (3, 9)


# numpy's warnings of Triton's interpreter on the kernels' sentinels (log(0) = -inf, -inf - -inf = NaN, exp of it),
# which the kernels select away: silenced inside an interpreted launch only.
INTERPRETER_WARNINGS = r"(divide by zero|invalid value|overflow) encountered"

DIRECT_LAUNCH = PLAN_CACHE and os.environ.get("MLA_LSE_MERGE_DIRECT_LAUNCH", "1") != "0" and _direct_launch_version()


def launch_state(key) -> list:
    """A new plan's launch state for `launch`: empty (the first launch records the compiled kernel) when the plan is
    cached under `key`, else already marked "no direct launch" (`[None]`): an uncached plan (validate=True, tracing,
    the cache off) is used once, so recording its kernel would be wasted host work."""
    return [] if key is not None else [None]


def launch(kernel, grid, args, constexprs, state: list) -> None:
    """`kernel[grid](*args, **constexprs)`, through the compiled kernel's own launcher once it is known.

    `state` is a list kept with the launch plan (`launch_state`), empty until its first launch. The plan's key
    fixes Triton's compile-cache key except for the pointers' 16-byte alignment and the type of the per-call integers
    (`prefill_tokens_with_context` in [0, T] and the CP rank: i32, `do_not_specialize`). The first launch records
    the compiled kernel Triton chose, when every pointer is aligned; a later launch with aligned pointers on the
    same device, without pre-run hooks, passes the launcher what `JITFunction.run` would: the grid, the stream,
    the kernel handle and metadata, the launch metadata and hooks, then every parameter in order (constexprs
    included). Anything else takes `kernel[grid]`."""
    if len(state) > 1:
        jit_fn, compiled, num_ptrs, tail, device, get_device, get_stream, runtime = state
        if kernel is jit_fn and not kernel.pre_run_hooks and get_device() == device:
            for x in args[:num_ptrs]:
                if x.data_ptr() & 15:
                    break
            else:
                stream = get_stream(device)
                full = (*args, *tail)
                compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, 1, stream, compiled.function,
                             compiled.packed_metadata,
                             compiled.launch_metadata(grid, stream, *full), runtime.launch_enter_hook,
                             runtime.launch_exit_hook, *full)
                return
    if _backend.interpreting():
        with warnings.catch_warnings():  # the interpreter's numpy evaluates log(0) and exp(-inf - -inf) as asked
            warnings.filterwarnings("ignore", INTERPRETER_WARNINGS, RuntimeWarning)
            compiled = kernel[grid](*args, **constexprs)
    else:
        compiled = kernel[grid](*args, **constexprs)
    if not state and not _backend.tracing():  # the first launch of this plan: record its kernel, or that there is none
        state[:] = (DIRECT_LAUNCH and not _backend.interpreting()
                    and _direct_state(kernel, compiled, grid, args, constexprs) or (None,))


def _direct_state(kernel, compiled, grid, args, constexprs) -> tuple:
    """What `launch` needs to call `compiled`'s launcher directly, or () where it should not. The tensors must
    lead the positional arguments (as in every kernel here) and be 16-byte aligned."""
    names = getattr(kernel, "arg_names", None)
    num_ptrs = next((i for i, x in enumerate(args) if not isinstance(x, torch.Tensor)), len(args))
    if (names is None or getattr(kernel, "pre_run_hooks", True) or len(grid) > 2
            or not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata", "launch_metadata"))
            or any(isinstance(x, torch.Tensor) for x in args[num_ptrs:])
            or any(x.data_ptr() & 15 for x in args[:num_ptrs])
            or not all(n in constexprs for n in names[len(args):])):
        return ()
    try:
        get_device, get_stream, runtime = _driver()
        return (kernel, compiled, num_ptrs, tuple(constexprs[n] for n in names[len(args):]), get_device(), get_device,
                get_stream, runtime)
    except (ImportError, AttributeError, RuntimeError):
        return ()


def _driver():
    """(current device, current stream of a device, the launch hooks' holder), as JITFunction.run reads them."""
    from triton import knobs
    from triton.runtime import driver
    return driver.active.get_current_device, driver.active.get_current_stream, knobs.runtime
