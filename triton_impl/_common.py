"""Constants, tile choices and input checks shared by the Triton kernels' host wrappers."""

from __future__ import annotations

import functools
import math
import numbers
import os
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

# Shared with pallas_impl/_common.py (a test asserts they agree).
MASK_BLOCK_T = 128  # query tokens per mask program (docs/spec.md 3)
SCAN = 32  # request boundaries compared per scan step (one warp)
ZERO_TILE_ELEMS = 16384  # elements of one output-zeroing store in the mask
MASK_NUM_WARPS = 8
MASK_TILE_H = 16  # heads per -inf store of the mask
# The mask's second grid axis (docs/design.md, "Mask grid"): each 128-token block's head tiles (LSE) and head x dim
# tiles (output zeroing) are dealt round-robin over `mask_split` programs, a power of two grown until the grid
# holds MASK_TARGET_PROGRAMS programs, capped by the tile count and by the split of the variant.
MASK_TARGET_PROGRAMS = 32768
MASK_ZERO_SPLIT = 64  # most programs per 128-token block when zeroing output rows
MASK_LSE_SPLIT = 4  # most programs per 128-token block for the LSE-only mask (H200 sweep, docs/results.md)
LSE_LAYOUTS = ("HT", "TH")
FP8_E4M3_MAX = 448.0
LN2 = 0.6931471805599453
LOG2E = 1.4426950408889634

# Merge launch per variant: (bytes of one input tile per program, fewest tokens per program, warps). "plain": no output
# LSE; "lse": with it; "fused": the fused mask too. Not shared: chosen per framework from the H200 tile sweep in
# docs/results.md (the tile changes which elements a program owns, never an element's arithmetic).
MERGE_TILES = {"plain": (2048, 4, 4), "lse": (4096, 1, 4), "fused": (8192, 8, 4)}
# The N-way merge's launch per variant: (bytes of a program's N input tiles together, fewest tokens, warps).
# Each partial's tile gets total // N bytes (a power of two), within N_TILE_BYTES: a program's loads stay about
# the same as N grows, and never below one 16-byte vector per thread of 4 warps. From the H200 sweep at N = 2, 4, 8
# (docs/results.md, "N-way merge"; `scripts/tune.py merge_n`).
MERGE_N_TILES = {"plain": (16384, 1, 4), "lse": (16384, 1, 4), "fused": (32768, 4, 4)}
N_TILE_BYTES = (2048, 4096)  # (fewest, most) bytes of one partial's tile in the N-way merge

# Launch options that make the float math reproducible by the Pallas port (docs/spec.md 5).
PARITY_LAUNCH = dict(enable_fp_fusion=False, enable_reflect_ftz=False)
OUTPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def tracing() -> bool:
    """True while torch.compile traces (data pointers are unknown; the launch-plan cache is bypassed)."""
    return torch.compiler.is_compiling()


# ---------------------------------------------------------------------------------------------------------
# Launch plans (docs/design.md, "Per-call cost"). A wrapper keys its plan on the `meta` of every tensor argument
# and its options (a cheap tuple); a plan is stored only after every metadata check passed for that key, so a
# hit skips them and runs the per-call checks only (data-pointer overlap, prefill_tokens_with_context).
# Bounded: full, it starts over. MLA_LSE_MERGE_PLAN_CACHE=0 turns it off (every call runs every check).
PLANS: dict = {}
PLANS_MAX = 4096
PLAN_CACHE = os.environ.get("MLA_LSE_MERGE_PLAN_CACHE", "1") != "0"


def meta(x):
    """What a tensor argument's metadata checks and launch arguments depend on (None for None; raises
    AttributeError for most non-tensors, which then take the checked path and its error)."""
    return None if x is None else (x.__class__, x.dtype, x.shape, x.stride(), x.device)


def find_plan(name: str, tensors: tuple, options: tuple):
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


def _direct_launch_version() -> bool:
    """Triton versions whose JITFunction.run ends in the launcher call that `launch` repeats (read in 3.4 to 3.9)."""
    major, minor = (int(x) for x in triton.__version__.split(".")[:2])
    return (3, 4) <= (major, minor) <= (3, 9)


# MLA_LSE_MERGE_DIRECT_LAUNCH=0 keeps every launch on `kernel[grid](...)`.
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
    compiled = kernel[grid](*args, **constexprs)
    if not state and not tracing():  # the first launch of this plan: record its kernel, or that there is none
        state[:] = (DIRECT_LAUNCH and not interpreting() and _direct_state(kernel, compiled, grid, args, constexprs)
                    or (None,))


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


def interpreting() -> bool:
    """True when Triton runs kernels in its interpreter (read at kernel import, as Triton does)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@functools.lru_cache(maxsize=None)
def mask_tiles(num_heads: int, head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_H, BLOCK_HO, BLOCK_D): head tile of the LSE stores, head and dim tiles of output zeroing."""
    block_h = min(next_pow2(num_heads), MASK_TILE_H)
    block_d = min(next_pow2(head_dim), 128)
    block_ho = max(1, min(next_pow2(num_heads), ZERO_TILE_ELEMS // (MASK_BLOCK_T * block_d)))
    return block_h, block_ho, block_d


@functools.lru_cache(maxsize=None)
def merge_tiles(num_heads: int, head_dim: int, variant: str = "plain",
                itemsize: int = 2, num_partials: int = 0) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_H, BLOCK_D) of a merge program: the whole (padded) head, the variant's fewest tokens, then
    heads, then more tokens, up to the byte budget of one `itemsize`-byte input tile: `MERGE_TILES` for the 2-way
    merge (num_partials=0), else `partial_tile_bytes` of `MERGE_N_TILES`."""
    if num_partials:
        total, min_block_t, _ = MERGE_N_TILES[variant]
        tile_bytes = partial_tile_bytes(total, num_partials)
    else:
        tile_bytes, min_block_t, _ = MERGE_TILES[variant]
    elems = max(1, tile_bytes // itemsize)
    block_d = next_pow2(head_dim)
    rest = max(1, elems // block_d)
    block_h = min(next_pow2(num_heads), max(1, rest // min_block_t))
    block_t = max(1, rest // block_h)
    return block_t, block_h, block_d


def partial_tile_bytes(total: int, num_partials: int) -> int:
    """Bytes of one partial's tile in an N-way program whose N tiles share `total` bytes: a power of two, within
    `N_TILE_BYTES`."""
    share = 1 << ((total // num_partials).bit_length() - 1)
    return min(max(share, N_TILE_BYTES[0]), N_TILE_BYTES[1])


def merge_num_warps(variant: str, num_partials: int = 0) -> int:
    return (MERGE_N_TILES if num_partials else MERGE_TILES)[variant][2]


def merge_variant(output_lse: bool, fused: bool) -> str:
    return "fused" if fused else "lse" if output_lse else "plain"


def mask_blocks(num_tokens: int, num_requests: int) -> int:
    # Worst case: each request may open a partial block -> T // BLOCK_T + R token blocks.
    return num_tokens // MASK_BLOCK_T + num_requests


@functools.lru_cache(maxsize=None)
def mask_split(num_tokens: int, num_requests: int, num_heads: int, head_dim: int, zero_output: bool) -> int:
    """Programs per 128-token block (the mask grid's second axis); static shapes only, never offsets' values."""
    block_h, block_ho, block_d = mask_tiles(num_heads, head_dim)
    tiles = -(-num_heads // block_ho) * -(-head_dim // block_d) if zero_output else -(-num_heads // block_h)
    want = next_pow2(-(-MASK_TARGET_PROGRAMS // max(1, mask_blocks(num_tokens, num_requests))))
    return max(1, min(tiles, mask_split_cap(zero_output), want))


def mask_split_cap(zero_output: bool) -> int:
    """The most programs per block of the variant; 1: its kernel never reads the second grid axis."""
    return MASK_ZERO_SPLIT if zero_output else MASK_LSE_SPLIT


def mask_grid(num_tokens: int, num_requests: int, num_heads: int, head_dim: int,
              zero_output: bool) -> tuple[int, int]:
    """(token blocks, programs per block): the second axis splits a block's stores (`mask_split`)."""
    return (mask_blocks(num_tokens, num_requests),
            mask_split(num_tokens, num_requests, num_heads, head_dim, zero_output))


def merge_grid(num_tokens: int, num_heads: int, head_dim: int, variant: str = "plain",
               itemsize: int = 2, num_partials: int = 0) -> tuple[int]:
    # One axis (no 65535 limit), head blocks fastest: program = token block * head blocks + head block.
    block_t, block_h, _ = merge_tiles(num_heads, head_dim, variant, itemsize, num_partials)
    return (math.ceil(num_tokens / block_t) * math.ceil(num_heads / block_h),)


def has_empty_context(chunk_seq_lens) -> bool:
    """Host guard for the mask: does any request have 0 KV tokens in this chunk?

    Args:
      chunk_seq_lens: the chunk's per-request KV lengths as host data (a sequence, a numpy array or a CPU
        tensor), as vLLM keeps them before the copy to the GPU.

    Raises:
      ValueError: for a device tensor, since reading it would synchronise the stream.
    """
    if isinstance(chunk_seq_lens, torch.Tensor):
        if chunk_seq_lens.device.type != "cpu":
            raise ValueError(
                f"has_empty_context needs host data; got a tensor on {chunk_seq_lens.device} "
                "(reading it would synchronise the device): pass the CPU copy")
        return bool((chunk_seq_lens == 0).any())
    return any(int(x) == 0 for x in chunk_seq_lens)


# ---------------------------------------------------------------------------------------------------------
# Input checks. The always-on tier reads metadata only; `check_offset_values` reads offsets (a host sync).


def check_lse_layout(lse_layout: str) -> None:
    if lse_layout not in LSE_LAYOUTS:
        raise ValueError(f"lse_layout must be one of {LSE_LAYOUTS}, got {lse_layout!r}")


def check_lse_base(lse_base) -> bool:
    """Returns True for base 2."""
    if lse_base == 2:
        return True
    if lse_base == math.e:
        return False
    raise ValueError(f"lse_base must be math.e or 2, got {lse_base!r}")


def check_tensor(name: str, x, *, ndim: int, dtypes: Sequence[torch.dtype], device=None) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got {name}.shape={tuple(x.shape)}")
    if x.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must be {names}; got {name}.dtype={x.dtype}")
    if device is not None and x.device != device:
        raise ValueError(f"{name} is on {x.device}, expected {device} (all tensors on one device)")


def check_no_internal_overlap(name: str, x: torch.Tensor) -> None:
    """A tensor written in place must not have elements sharing memory (an `expand`ed view): its programs would
    race on them. Sufficient test, as torch's in-place ops make: with the size > 1 dims sorted by stride, every
    stride exceeds the span of the smaller ones."""
    if x.numel() == 0:
        return
    span = 0
    for stride, size in sorted((abs(st), sz) for st, sz in zip(x.stride(), x.shape) if sz > 1):
        if stride <= span:
            raise ValueError(f"{name} has elements that share memory ({name}.shape={tuple(x.shape)}, "
                             f"{name}.stride()={x.stride()}, an expanded or overlapping view): the kernel writes it "
                             "in place and would race; pass a tensor whose elements are distinct (e.g. .contiguous())")
        span += stride * (size - 1)


def _dense(x: torch.Tensor) -> bool:
    """Non-overlapping and dense: the elements fill one contiguous range (any order of the dims)."""
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(x.stride(), x.shape) if sz > 1):
        if stride != expected:
            return False
        expected *= size
    return True


def overlap_checks(out_name, out, inputs) -> tuple:
    """The per-signature part of `check_no_partial_overlap`: for each input (name, tensor or None) worth comparing
    with `out` at run time, (out_name, name, bytes of out, bytes of the input, whether it is the same view)."""
    if out.numel() == 0 or not _dense(out):
        return ()
    return tuple((out_name, name, out.numel() * out.element_size(), x.numel() * x.element_size(),
                  tuple(x.shape) == tuple(out.shape) and x.stride() == out.stride() and x.dtype == out.dtype)
                 for name, x in inputs if x is not None and x.numel() and _dense(x) and x.device == out.device)


def partial_overlap(checks, tensors) -> str | None:
    """The per-call part: the name of the first input of `checks` (`overlap_checks`) that partially overlaps its
    output in memory, or None. `tensors` maps the names to the tensors."""
    for out_name, name, out_bytes, x_bytes, same in checks:
        lo, xlo = tensors[out_name].data_ptr(), tensors[name].data_ptr()
        if xlo < lo + out_bytes and lo < xlo + x_bytes and not (same and xlo == lo):
            return name
    return None


def check_no_partial_overlap(out_name: str, out: torch.Tensor, **inputs) -> tuple:
    """A tensor written in place must not partially overlap one it reads, as torch's in-place ops require: the
    same tensor (same start, shape and strides) is fine, every element being read before it is written by the
    same program; a shifted or reshaped alias would race. Decided, as torch decides, for dense tensors only.
    Returns the per-signature `overlap_checks`, for the wrapper's launch plan.

    While torch.compile traces, addresses are unknown (fake tensors) and this check is skipped: a traced plain
    function's kernel then runs without it. The `torch.ops` entry points run it at run time (their traced
    form is a call of the eager op)."""
    checks = overlap_checks(out_name, out, inputs.items())
    if not tracing():
        name = partial_overlap(checks, dict(inputs, **{out_name: out}))
        if name is not None:
            raise ValueError(f"{out_name} partially overlaps {name} in memory: the kernel writes {out_name} in place "
                             f"while it reads {name}; pass separate buffers (or {name} itself)")
    return checks


def check_output(output, like: torch.Tensor, output_scale, *, name: str = "output", shape=None) -> bool:
    """The merge output and its optional fp8 scale, against the partials' tensor `like` [..., T, H, D] (or
    `shape`, when the output holds only some heads); returns whether the output is fp8. Any output dtype of
    OUTPUT_DTYPES or fp8, whatever the partials' (docs/spec.md 4.3: one rounding at the store)."""
    device = like.device
    shape = tuple(like.shape[-3:]) if shape is None else tuple(shape)
    check_tensor(name, output, ndim=3, dtypes=OUTPUT_DTYPES + (torch.float8_e4m3fn,), device=device)
    if tuple(output.shape) != shape:
        raise ValueError(f"{name} must be [T, H, D] = {list(shape)}; got {name}.shape={tuple(output.shape)}")
    fp8 = output.dtype == torch.float8_e4m3fn
    if fp8 != (output_scale is not None):
        raise ValueError("output_scale is required for a float8_e4m3fn output and only for it; got "
                         f"{name}.dtype={output.dtype}, output_scale={'given' if output_scale is not None else None}")
    if fp8:
        check_tensor("output_scale", output_scale, ndim=1, dtypes=(torch.float32,), device=device)
        if output_scale.numel() != 1:
            raise ValueError(f"output_scale must be f32[1]; got output_scale.shape={tuple(output_scale.shape)}")
    check_no_internal_overlap(name, output)
    return fp8


def check_prefill_tokens(prefill_tokens_with_context, num_tokens: int, validate: bool) -> int:
    """None (= T) or a host integer; clamped to [0, T] for the kernel (validate=True rejects values outside)."""
    x = prefill_tokens_with_context
    if x is None:
        return num_tokens
    if isinstance(x, (torch.Tensor, bool)) or not isinstance(x, numbers.Integral):
        raise TypeError("prefill_tokens_with_context must be a host int (a device value would need a sync); "
                        f"got {type(x).__name__}")
    x = int(x)  # numpy integers too
    if validate and not 0 <= x <= num_tokens:
        raise ValueError(f"prefill_tokens_with_context={x} must be in [0, T={num_tokens}]")
    return max(0, min(x, num_tokens))


def jit_per_lse_layout(*, runtime: Sequence[str], lse_head_strides: Sequence[str]):
    """Decorator: `triton.jit` the kernel once per LSE layout, as {lse_layout: kernel}; the two differ only in
    `do_not_specialize` (docs/design.md, "Runtime values"). Both list the `runtime` parameters; the [H, T] one
    also the LSE head strides (= T there). In [T, H] layout every LSE stride is specialised: the head stride is
    1 and the token stride H, fixed per model."""
    def jit(fn):
        return {"HT": triton.jit(fn, do_not_specialize=[*runtime, *lse_head_strides]),
                "TH": triton.jit(fn, do_not_specialize=list(runtime))}
    return jit


def lse_ht_strides(name: str, lse: torch.Tensor, lse_layout: str, num_heads: int, num_tokens: int):
    """(stride_h, stride_t) of an LSE given in `lse_layout`, after checking its shape."""
    want = (num_heads, num_tokens) if lse_layout == "HT" else (num_tokens, num_heads)
    if tuple(lse.shape) != want:
        raise ValueError(
            f"{name} must be f32{list(want)} for lse_layout={lse_layout!r}; got {name}.shape={tuple(lse.shape)}")
    s0, s1 = lse.stride()
    stride_h, stride_t = (s0, s1) if lse_layout == "HT" else (s1, s0)
    if num_tokens == 1:  # any stride indexes a size-1 dim: use the contiguous one, so T = 1 compiles nothing new
        stride_t = 1 if lse_layout == "HT" else num_heads
    return stride_h, stride_t


def check_offsets(query_start_loc, cu_seq_lens, device, *, cu_name="cu_seq_lens") -> int:
    """Metadata checks of the two offset arrays; returns R."""
    check_tensor("query_start_loc", query_start_loc, ndim=1, dtypes=(torch.int32,), device=device)
    check_tensor(cu_name, cu_seq_lens, ndim=1, dtypes=(torch.int32,), device=device)
    if query_start_loc.shape[0] < 1:
        raise ValueError("query_start_loc must have R+1 >= 1 entries, got an empty tensor")
    if cu_seq_lens.shape != query_start_loc.shape:
        raise ValueError(
            f"query_start_loc and {cu_name} must both be i32[R+1]; got "
            f"query_start_loc.shape={tuple(query_start_loc.shape)}, {cu_name}.shape={tuple(cu_seq_lens.shape)}")
    return query_start_loc.shape[0] - 1


def check_offset_values(query_start_loc, cu_seq_lens, num_tokens: int, *, cu_name="cu_seq_lens") -> None:
    """validate=True tier: reads the offsets on the host (a device sync). `cu_seq_lens` may be i32[N, R+1]
    (one row per partial)."""
    rows = [(cu_name, cu_seq_lens)] if cu_seq_lens.dim() == 1 else \
        [(f"{cu_name}[{i}]", cu_seq_lens[i]) for i in range(cu_seq_lens.shape[0])]
    for name, x in [("query_start_loc", query_start_loc)] + rows:
        v = x.detach().cpu()
        if int(v[0]) != 0:
            raise ValueError(f"{name}[0] must be 0, got {int(v[0])}")
        if bool((v[1:] < v[:-1]).any()):
            i = int(torch.nonzero(v[1:] < v[:-1])[0, 0])
            raise ValueError(f"{name} must be non-decreasing; {name}[{i}]={int(v[i])} > {name}[{i + 1}]={int(v[i + 1])}")
    last = int(query_start_loc[-1])
    if last > num_tokens:
        raise ValueError(f"query_start_loc[R]={last} is past the token count T={num_tokens}")


def n_interpret(num_keys: int) -> int:
    """The scan length as a compile-time value under the interpreter only, 0 when compiling.

    Triton's interpreter cannot loop to a runtime bound with numpy >= 2.4 (docs/spec.md 6); it compiles nothing,
    so a constant there costs no recompilation. Compiled kernels always loop to the runtime value.
    """
    return num_keys if interpreting() else 0


@triton.jit
def _scan_bound(num_keys, N_INTERPRET: tl.constexpr):
    if N_INTERPRET > 0:
        return N_INTERPRET
    else:
        return num_keys


@triton.jit
def _count_keys_le(qsl_ptr, x, num_keys, KEY_DIV: tl.constexpr, KEY_STEP: tl.constexpr,
                   SCAN: tl.constexpr, N_INTERPRET: tl.constexpr):
    """i32[N]: for each x, how many of key(r) = qsl[r] // KEY_DIV + r * KEY_STEP, r < num_keys, are <= x.

    Keys are non-decreasing in r. Two levels of 32-wide compare-and-sum: the first key of every 32-key chunk
    (one step covers 1024 keys), then the 32 keys of the chunk holding the last key <= x.
    """
    coarse = tl.zeros_like(x)
    for r0 in range(0, _scan_bound(num_keys, N_INTERPRET), SCAN * SCAN):
        r = r0 + tl.arange(0, SCAN) * SCAN
        key = tl.load(qsl_ptr + tl.minimum(r, num_keys - 1)) // KEY_DIV + r * KEY_STEP
        coarse += tl.sum(((r < num_keys)[None, :] & (key[None, :] <= x[:, None])).to(tl.int32), axis=1)
    base = (coarse - 1) * SCAN  # key(0) <= x always: coarse >= 1
    r = base[:, None] + tl.arange(0, SCAN)[None, :]
    key = tl.load(qsl_ptr + tl.minimum(r, num_keys - 1)) // KEY_DIV + r * KEY_STEP
    return base + tl.sum(((r < num_keys) & (key <= x[:, None])).to(tl.int32), axis=1)


@triton.jit
def _cast_rne(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """f32 -> dtype with round-to-nearest-even, as the GPU's cvt does.

    Triton's interpreter truncates f32 -> bf16 and loses the carry when rounding to fp8; under it the value
    is first rounded to dtype's precision with exact f32 arithmetic (power-of-two scaling and the 1.5 * 2^23
    trick), so the final cast is exact. Magnitudes below 2^-100 are left to the interpreter.
    """
    if INTERPRET:
        if (dtype == tl.bfloat16) or (dtype == tl.float8e4nv):
            MANT: tl.constexpr = 7 if dtype == tl.bfloat16 else 3
            EMIN: tl.constexpr = -126 if dtype == tl.bfloat16 else -6
            e = ((x.to(tl.uint32, bitcast=True) >> 23) & 0xFF).to(tl.int32) - 127
            q = ((tl.maximum(e, EMIN) - MANT + 127) << 23).to(tl.float32, bitcast=True)
            r = ((x / q + 12582912.0) - 12582912.0) * q
            x = tl.where((tl.abs(x) >= 7.888609052210118e-31) & (tl.abs(x) < float("inf")), r, x)
        if dtype == tl.float8e4nv:  # the interpreter also turns NaN into 0x7c
            y = x.to(dtype).to(tl.uint8, bitcast=True)
            return tl.where(x != x, (y & 0x80) | 0x7F, y).to(dtype, bitcast=True)
    return x.to(dtype)
