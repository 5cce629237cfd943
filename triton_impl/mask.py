"""Empty-context LSE mask (docs/spec.md 3), in place: the Triton kernel and its host wrapper.

Grid: (128-token query blocks, programs per block). Worst case `T // 128 + R` blocks; request r owns the
blocks from `qsl[r] // 128 + r` on. A program finds its request by counting, 32 request boundaries per
step, the requests whose first block is at or before its block (a compare-and-sum, no token->request map),
then, if that request's chunk is empty, writes -inf over its share of the heads of its tokens (and zeros
over its share of their output rows): the second grid axis deals a block's head (x dim) tiles round-robin
over `mla_lse_common.tiles.mask_split` programs, so the zeroing of a few empty requests still spreads over the GPU.
The count is two-level (`_device._count_keys_le`): chunk starts, then one chunk of 32.
`pallas_impl/mask.py` is the same algorithm, statement by statement.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_lse_common import tiles
from triton_impl import _backend
from triton_impl import _checks as checks
from triton_impl import _launch as launcher
from triton_impl import _plans as plans
from triton_impl import torch_fallback
from triton_impl._device import _count_keys_le


@triton.jit
def _own_tiles(NUM_TILES: tl.constexpr, split, num_splits, N_INTERPRET: tl.constexpr):
    """How many of the tiles split, split + num_splits, ... lie below NUM_TILES: the trip count of a program's
    round-robin loop. Under the interpreter only (N_INTERPRET > 0), NUM_TILES itself: triton 3.6's interpreter
    cannot loop to a bound computed from the program id with numpy >= 2.4 (docs/spec.md 6); the extra trips
    address tiles past NUM_TILES, which every store masks off."""
    if N_INTERPRET > 0:
        return NUM_TILES
    else:
        return (NUM_TILES - split + num_splits - 1) // num_splits


@triton.jit
def _fill_lse(lse_ptr, split, num_splits, t64, t_mask, stride_lse_h, stride_lse_t, NUM_HEADS: tl.constexpr,
              BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, N_INTERPRET: tl.constexpr):
    # This program's head tiles: split, split + num_splits, ...
    N_H: tl.constexpr = (NUM_HEADS + BLOCK_H - 1) // BLOCK_H
    for j in range(0, _own_tiles(N_H, split, num_splits, N_INTERPRET)):
        h = (split + j * num_splits) * BLOCK_H + tl.arange(0, BLOCK_H)
        h_mask = h < NUM_HEADS
        lse_ptrs = lse_ptr + h[:, None].to(tl.int64) * stride_lse_h + t64[None, :] * stride_lse_t
        tl.store(lse_ptrs, tl.full((BLOCK_H, BLOCK_T), float("-inf"), tl.float32),
                 mask=h_mask[:, None] & t_mask[None, :])


# Runtime values, never specialised: R and, in [H, T] layout, the LSE head stride (= T). The other LSE stride
# stays specialised (the unit stride of either layout, and H in [T, H]), which vectorises the -inf stores.
@_backend.jit_per_lse_layout(runtime=["num_requests"], lse_head_strides=["stride_lse_h"])
def _mask_empty_context_lse_kernel(
    lse_ptr,  # f32[H, T] via (stride_lse_h, stride_lse_t); written in place
    out_ptr,  # dtype[T, H, D] via (stride_out_t, stride_out_h, stride_out_d); zeroed rows if ZERO_OUTPUT
    qsl_ptr,  # i32[R+1] query_start_loc
    cu_ptr,  # i32[R+1] cu_seq_lens of this context chunk
    stride_lse_h, stride_lse_t,
    stride_out_t, stride_out_h, stride_out_d,
    num_requests,  # R: a runtime value, never specialised
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr, SCAN: tl.constexpr, N_INTERPRET: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HO: tl.constexpr, BLOCK_D: tl.constexpr,
    ZERO_OUTPUT: tl.constexpr, SPLIT_BLOCKS: tl.constexpr,
):
    pid = tl.program_id(0)
    # This program's share of its block's head (x dim) tiles (tiles.mask_split). The split is a runtime value
    # (it follows T and R without a recompile); a variant whose cap is 1 never splits, and its loops unroll.
    split = tl.program_id(1) if SPLIT_BLOCKS else 0
    num_splits = tl.num_programs(1) if SPLIT_BLOCKS else 1
    # Owning request = (number of requests whose first block is <= pid) - 1; request 0 starts at 0.
    first_programs_le = _count_keys_le(qsl_ptr, pid + tl.zeros((1,), tl.int32), num_requests,
                                       BLOCK_T, 1, SCAN, N_INTERPRET)
    req = tl.sum(first_programs_le, axis=0) - 1

    q_start = tl.load(qsl_ptr + req)
    q_end = tl.load(qsl_ptr + req + 1)
    is_empty = tl.load(cu_ptr + req + 1) == tl.load(cu_ptr + req)
    t0 = (pid - req) * BLOCK_T  # = (q_start // BLOCK_T + block index within the request) * BLOCK_T
    t = t0 + tl.arange(0, BLOCK_T)
    t_mask = (t >= q_start) & (t < q_end)  # also empty for the spare blocks of a request
    t64 = t.to(tl.int64)
    # A block wholly inside its request needs no token mask, and when the LSE rows start 16-byte aligned
    # (head stride a multiple of 4; t0 is a multiple of BLOCK_T) its -inf stores are 16 bytes wide.
    full = (t0 >= q_start) & (t0 + BLOCK_T <= q_end)
    if is_empty & full & (stride_lse_h % 4 == 0):
        _fill_lse(lse_ptr, split, num_splits, t64, tl.full((BLOCK_T,), 1, tl.int1), (stride_lse_h // 4) * 4,
                  stride_lse_t, NUM_HEADS, BLOCK_H, BLOCK_T, N_INTERPRET)
    elif is_empty:
        _fill_lse(lse_ptr, split, num_splits, t64, t_mask, stride_lse_h, stride_lse_t, NUM_HEADS, BLOCK_H,
                  BLOCK_T, N_INTERPRET)
    if ZERO_OUTPUT:
        if is_empty:
            # Output tiles (head tile, dim tile), dim fastest; this program's: split, split + num_splits, ...
            N_D: tl.constexpr = (HEAD_DIM + BLOCK_D - 1) // BLOCK_D
            N_TILES: tl.constexpr = (NUM_HEADS + BLOCK_HO - 1) // BLOCK_HO * N_D
            for j in range(0, _own_tiles(N_TILES, split, num_splits, N_INTERPRET)):
                i = split + j * num_splits
                ho = (i // N_D) * BLOCK_HO + tl.arange(0, BLOCK_HO)
                d = (i % N_D) * BLOCK_D + tl.arange(0, BLOCK_D)
                m = t_mask[:, None, None] & (ho < NUM_HEADS)[None, :, None] & (d < HEAD_DIM)[None, None, :]
                out_ptrs = (out_ptr + t64[:, None, None] * stride_out_t
                            + ho[None, :, None].to(tl.int64) * stride_out_h
                            + d[None, None, :].to(tl.int64) * stride_out_d)
                tl.store(out_ptrs, tl.zeros((BLOCK_T, BLOCK_HO, BLOCK_D), out_ptr.dtype.element_ty), mask=m)


def mask_empty_context_lse(lse, query_start_loc, cu_seq_lens, output=None, *, has_empty=None,
                           lse_layout="HT", implementation=None, validate=False) -> None:
    """Set the LSE of every query row of a request with an empty context chunk to -inf (docs/spec.md 3).

    Args:
      lse: f32[H, T] ([T, H] with lse_layout="TH"), any strides, natural log or base 2 (the mask writes
        -inf, which is both). Written in place.
      query_start_loc: i32[R+1], 0-based, non-decreasing; tokens at or past qsl[R] are padding and untouched.
      cu_seq_lens: i32[R+1], this chunk's KV offsets; request r is empty iff cu[r+1] == cu[r].
      output: optional fp32/fp16/bf16[T, H, D], any strides; the empty rows are zeroed in place.
      has_empty: host guard. False launches nothing; None or True launch. Never derived from device data
        (see `has_empty_context`).
      lse_layout: "HT" (vLLM, FA2) or "TH" (FlashInfer, SGLang).
      implementation: None (the Triton kernel where Triton has a driver for the tensors' device, else the torch
        path), "triton" or "torch" (`triton_impl/torch_fallback.py`: any device torch runs on). Never falls back.
      validate: also check the offsets' values (reads them on the host: a device sync).

    Raises:
      TypeError: a tensor of the wrong dtype.
      ValueError: wrong rank or shape, tensors on different devices, offsets of different lengths, an
        unknown layout or implementation; with validate=True, offsets not starting at 0, decreasing, or past T.
      NotImplementedError: implementation="triton" on a device Triton does not compile for.
    """
    key, plan = (None, None) if validate else plans.find_plan("mask", (lse, query_start_loc, cu_seq_lens, output),
                                                              (lse_layout, implementation))
    if plan is not None:  # every metadata check passed for this signature: the per-call one only
        overlaps, _, launch = plan
        if not (overlaps and checks.partial_overlap(overlaps, dict(output=output, lse=lse))):
            if launch is not None and has_empty is not False:
                _launch(launch, lse, query_start_loc, cu_seq_lens, output, lse_layout)
            return
        # an overlap: the checked path below raises its error

    checks.check_lse_layout(lse_layout)
    checks.check_tensor("lse", lse, ndim=2, dtypes=(torch.float32,))
    device = lse.device
    num_requests = checks.check_offsets(query_start_loc, cu_seq_lens, device)
    num_heads, num_tokens = lse.shape if lse_layout == "HT" else lse.shape[::-1]
    stride_lse_h, stride_lse_t = checks.lse_ht_strides("lse", lse, lse_layout, num_heads, num_tokens)
    checks.check_no_internal_overlap("lse", lse)
    overlaps = ()
    if output is not None:
        checks.check_tensor("output", output, ndim=3, dtypes=checks.OUTPUT_DTYPES, device=device)
        if tuple(output.shape[:2]) != (num_tokens, num_heads):
            raise ValueError(f"output must be [T={num_tokens}, H={num_heads}, D]; got output.shape={tuple(output.shape)}")
        checks.check_no_internal_overlap("output", output)
        overlaps = checks.check_no_partial_overlap("output", output, lse=lse)
    if validate:
        checks.check_offset_values(query_start_loc, cu_seq_lens, num_tokens)
    impl = _backend.resolve_implementation(implementation, device)
    launch = None
    if num_requests and num_tokens and impl == "torch":
        launch = plans.torch_launch()
    elif num_requests and num_tokens:
        head_dim = output.shape[2] if output is not None else 1
        block_h, block_ho, block_d = tiles.mask_tiles(num_heads, head_dim)
        launch = plans.kernel_launch(
            grid=tiles.mask_grid(num_tokens, num_requests, num_heads, head_dim, output is not None),
            ints=(stride_lse_h, stride_lse_t, *(output.stride() if output is not None else (0, 0, 0)), num_requests),
            constexprs=dict(NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_T=tiles.MASK_BLOCK_T, SCAN=tiles.SCAN,
                            N_INTERPRET=_backend.n_interpret(num_requests), BLOCK_H=block_h, BLOCK_HO=block_ho,
                            BLOCK_D=block_d, ZERO_OUTPUT=output is not None,
                            SPLIT_BLOCKS=tiles.mask_split_cap(output is not None) > 1, num_warps=tiles.MASK_NUM_WARPS["triton"]),
            state=launcher.launch_state(key))
    plans.remember(key, plans.plan(overlaps=overlaps, num_tokens=num_tokens, launch=launch))
    if launch is not None and has_empty is not False:
        _launch(launch, lse, query_start_loc, cu_seq_lens, output, lse_layout)


def _launch(launch, lse, query_start_loc, cu_seq_lens, output, lse_layout) -> None:
    """The kernel launch of a plan's `kernel_launch`, or the torch path's (`plans.torch_launch`)."""
    if launch[0] is plans.TORCH:
        torch_fallback.mask_empty_context_lse(lse, query_start_loc, cu_seq_lens, output, lse_layout)
        return
    grid, ints, constexprs, state = launch
    launcher.launch(_mask_empty_context_lse_kernel[lse_layout], grid,
                    (lse, lse if output is None else output, query_start_loc, cu_seq_lens, *ints),  # lse: a placeholder
                    constexprs, state)
