"""N-way attention-state merge (docs/spec.md section 8), in place: the Triton kernel and its host wrapper.

The context-parallel building block: N partials stacked on a leading axis, as an all-gather produces them.
Grid: `(cdiv(T, BLOCK_T) * cdiv(H, BLOCK_H),)`, head blocks fastest, as the 2-way merge; a program merges a
[BLOCK_T, BLOCK_H, BLOCK_D] tile of every partial (`tiles.MERGE_N_TILES`). The loops over the N partials unroll
(`tl.static_range`) up to N = UNROLLED_PARTIALS and beyond run in runtime steps of a few partials
(`range`, which Triton does not unroll; `mla_lse_common.tiles`: `loop_steps`, `max_chunks`), so the compile time stays
short at every N; each pass does the spec's operations in index order either way (docs/spec.md 8). Three passes over
the partials' LSE tiles: the largest LSE, the sum of the exponentials, then the weighted sum of the outputs; an LSE
tile is reloaded (from cache) and its exponential recomputed in each pass, which gives the same bits; up to
UNROLLED_PARTIALS the first output tiles may load before the passes (`tiles.early_outputs`), in flight while they
run; beyond UNROLLED_PARTIALS the partials' output tiles load with the L2 policy `evict_first`
(`tiles.outputs_evict`), so the LSE tiles stay cached between passes, and the weighted sum's loop is pipelined
(`tl.range(num_stages=OUT_STAGES)`, `tiles.out_stages`: the next steps' loads in flight while this step sums).
Beyond N_SPLIT_ABOVE (`tiles.split_passes`) the merge is two launches: the first (`_merge_n_weights_kernel`) runs
the first two passes over a tile of LSE positions per program (`tiles.max_sum_tiles`) and stores m and z (and,
`tiles.split_weights`, every partial's exponential e_i, its weight's numerator, as the sum takes it) in an f32
buffer; the merge kernel reads them (GIVEN_MZ, GIVEN_W) and streams the outputs without the passes' round trips:
the same bits (docs/design.md, "Two kernels beyond 16 partials").
The fused mask finds each token's request once, with the two-level 32-wide compare-and-sum of the mask
kernel, and reads each partial's own KV offsets.

Float math (docs/spec.md 5), identical to `pallas_impl/merge_n.py` and, at N = 2, to `triton_impl/merge.py`
operation by operation: f32, libdevice exp and log, no FMA contraction, no flush-to-zero,
division with `/`, the sums in index order starting from partial 0, cast only at the store.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from mla_lse_common import tiles
from triton_impl import _backend
from triton_impl import _checks as checks
from triton_impl import _launch as launcher
from triton_impl import _plans as plans
from triton_impl import torch_fallback
from triton_impl._device import (_copied_lse, _max_and_sum, _merged_lse, _partial_exp, _program_tile,
                                 _store_group_fp8, _store_nvfp4, _store_output, _token_requests, _weighted)


@triton.jit
def _store_max_and_sum(wlse_ptr, stride_wlse_n, wlse_offs, th_mask, m, all_empty, z):
    """m (-inf where every partial is empty) and z of `_max_and_sum` to planes 0 and 1 of the split merge's buffer
    (its first kernel), for `_given_max_and_sum`."""
    tl.store(wlse_ptr + wlse_offs, tl.where(all_empty, float("-inf"), m), mask=th_mask)
    tl.store(wlse_ptr + stride_wlse_n + wlse_offs, z, mask=th_mask)


@triton.jit
def _given_max_and_sum(wlse_ptr, stride_wlse_n, wlse_offs, th_mask):
    """(m, all_empty, z) of `_max_and_sum`, read back from the buffer `_store_max_and_sum` wrote: the same values."""
    m = tl.load(wlse_ptr + wlse_offs, mask=th_mask, other=float("-inf"))
    z = tl.load(wlse_ptr + stride_wlse_n + wlse_offs, mask=th_mask, other=1.0)
    all_empty = m == float("-inf")
    return tl.where(all_empty, 0.0, m), all_empty, z


@triton.jit
def _weight(i, lses_ptr, stride_lse_n, lse_offs, th_mask, cu_ptr, stride_cu_n, req, in_req, m, z, wlse_ptr,
            stride_wlse_n, wlse_offs, LSE_BASE2: tl.constexpr, FUSED_MASK: tl.constexpr, INTERPRET: tl.constexpr,
            GIVEN_W: tl.constexpr):
    """w_i = e_i / z of partial i (8.3), e_i computed or, with GIVEN_W, the split merge's first kernel's (plane
    2 + i of its buffer): the same bits."""
    if GIVEN_W:
        e = tl.load(wlse_ptr + (2 + i) * stride_wlse_n + wlse_offs, mask=th_mask, other=0.0)
    else:
        e = _partial_exp(lses_ptr, stride_lse_n, i, lse_offs, th_mask, cu_ptr, stride_cu_n, req, in_req, m, LSE_BASE2,
                         FUSED_MASK, INTERPRET)
    return e / z


@triton.jit
def _out_step(out, i, outs_ptr, stride_o_n, o_offs, thd_mask, lses_ptr, stride_lse_n, lse_offs, th_mask, cu_ptr,
              stride_cu_n, req, in_req, m, z, wlse_ptr, stride_wlse_n, wlse_offs, LSE_BASE2: tl.constexpr,
              FUSED_MASK: tl.constexpr, INTERPRET: tl.constexpr, OUT_EVICT: tl.constexpr, GIVEN_W: tl.constexpr):
    """out + w_i * o_i, w_i = e_i / z: one step of the weighted sum (8.3)."""
    w = _weight(i, lses_ptr, stride_lse_n, lse_offs, th_mask, cu_ptr, stride_cu_n, req, in_req, m, z, wlse_ptr,
                stride_wlse_n, wlse_offs, LSE_BASE2, FUSED_MASK, INTERPRET, GIVEN_W)
    return out + _weighted(tl.load(outs_ptr + i * stride_o_n + o_offs, mask=thd_mask, other=0.0,
                                   eviction_policy=OUT_EVICT), w)


# Runtime values, never specialised: token counts, offsets, and the strides that follow T or R (the LSE
# partial stride, the offsets' partial stride and, in [H, T] layout, the LSE head strides). The other LSE strides
# and the output strides (multiples of H * D) stay specialised: their divisibility lets the loads of every
# partial's tile be 16 bytes wide.
@_backend.jit_per_lse_layout(runtime=["num_tokens", "num_requests", "stride_wlse_n", "stride_lse_n", "stride_cu_n"],
                             lse_head_strides=["stride_wlse_h", "stride_lse_h"])
def _merge_n_weights_kernel(
    wlse_ptr,  # f32[2 (+ N), H, T] ([.., T, H]) via (stride_wlse_n, stride_wlse_h, stride_wlse_t): m, z (, e_i)
    lses_ptr,  # f32[N, H, T] via (stride_lse_n, stride_lse_h, stride_lse_t)
    qsl_ptr,  # i32[R+1] query_start_loc; unused unless FUSED_MASK
    cu_ptr,  # i32[N, R+1] each partial's KV offsets via (stride_cu_n, 1); unused unless FUSED_MASK
    stride_wlse_n, stride_wlse_h, stride_wlse_t,
    stride_lse_n, stride_lse_h, stride_lse_t,
    stride_cu_n,
    num_tokens,  # T
    num_requests,  # R; runtime value
    NUM_PARTIALS: tl.constexpr, NUM_HEADS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
    SCAN: tl.constexpr, N_INTERPRET: tl.constexpr, LSE_BASE2: tl.constexpr, FUSED_MASK: tl.constexpr,
    INTERPRET: tl.constexpr, LSE_STEPS: tl.constexpr, EXP_STEP: tl.constexpr, MAX_CHUNKS: tl.constexpr,
    MAX_CHUNK: tl.constexpr, STORE_WEIGHTS: tl.constexpr,
):
    """The first kernel of a split merge (`tiles.split_passes`): m and z of a [BLOCK_T, BLOCK_H] tile of LSE
    positions (`tiles.max_sum_tiles`) and, with STORE_WEIGHTS, every partial's exponential e_i (the numerator of
    its weight w_i = e_i / z), stored as the sum takes it, for the merge kernel's weighted sum."""
    t, t_mask, th_mask, _, t64, h64, _ = _program_tile(num_tokens, NUM_HEADS, 1, BLOCK_T, BLOCK_H, 1)
    lse_offs = h64 * stride_lse_h + t64 * stride_lse_t
    wlse_offs = h64 * stride_wlse_h + t64 * stride_wlse_t
    stride_lse_n = tl.cast(stride_lse_n, tl.int64)
    stride_cu_n = tl.cast(stride_cu_n, tl.int64)
    stride_wlse_n = tl.cast(stride_wlse_n, tl.int64)
    req, in_req = _token_requests(qsl_ptr, t, t_mask, num_requests, SCAN, N_INTERPRET, FUSED_MASK)
    m, all_empty, z = _max_and_sum(lses_ptr, stride_lse_n, lse_offs, th_mask, cu_ptr, stride_cu_n, req, in_req,
                                   wlse_ptr + 2 * stride_wlse_n, stride_wlse_n, wlse_offs, NUM_PARTIALS, LSE_BASE2,
                                   FUSED_MASK, INTERPRET, LSE_STEPS, EXP_STEP, MAX_CHUNKS, MAX_CHUNK, STORE_WEIGHTS)
    _store_max_and_sum(wlse_ptr, stride_wlse_n, wlse_offs, th_mask, m, all_empty, z)


@_backend.jit_per_lse_layout(runtime=["num_tokens", "prefill_tokens_with_context", "num_requests", "stride_lse_n",
                                      "stride_cu_n", "stride_wlse_n", "stride_gs_t", "stride_gs_g"],
                             lse_head_strides=["stride_olse_h", "stride_lse_h", "stride_wlse_h"])
def _merge_attn_states_n_kernel(
    out_ptr,  # dtype[T, H, D] (or fp8) via (stride_out_t, stride_out_h, stride_out_d)
    out_lse_ptr,  # f32[H, T] via (stride_olse_h, stride_olse_t); unused unless OUTPUT_LSE
    outs_ptr,  # dtype[N, T, H, D] via (stride_o_n, stride_o_t, stride_o_h, stride_o_d)
    lses_ptr,  # f32[N, H, T] via (stride_lse_n, stride_lse_h, stride_lse_t)
    scale_ptr,  # f32[1] output scale (NVFP4: the global scale); unused unless FP8_OUT or NVFP4
    qsl_ptr,  # i32[R+1] query_start_loc; unused unless FUSED_MASK
    cu_ptr,  # i32[N, R+1] each partial's KV offsets via (stride_cu_n, 1); unused unless FUSED_MASK
    wlse_ptr,  # f32[2 (+ N), H, T] ([.., T, H]): the first kernel's m, z (, e_i); unused unless GIVEN_MZ
    gs_ptr,  # per-group f32 scales or NVFP4's e4m3 block scales [T, H * D / G] via (stride_gs_t, stride_gs_g)
    stride_out_t, stride_out_h, stride_out_d,
    stride_o_n, stride_o_t, stride_o_h, stride_o_d,
    stride_olse_h, stride_olse_t,
    stride_lse_n, stride_lse_h, stride_lse_t,
    stride_cu_n,
    stride_wlse_n, stride_wlse_h, stride_wlse_t,
    stride_gs_t, stride_gs_g,
    num_tokens,  # T
    prefill_tokens_with_context,  # tokens at or past it copy the last partial (8.4); runtime value
    num_requests,  # R; runtime value
    NUM_PARTIALS: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    SCAN: tl.constexpr, N_INTERPRET: tl.constexpr,
    LSE_BASE2: tl.constexpr, OUTPUT_LSE: tl.constexpr, FUSED_MASK: tl.constexpr, FP8_OUT: tl.constexpr,
    INTERPRET: tl.constexpr, LSE_STEPS: tl.constexpr, OUT_STEPS: tl.constexpr, EXP_STEP: tl.constexpr,
    OUT_STEP: tl.constexpr, MAX_CHUNKS: tl.constexpr, MAX_CHUNK: tl.constexpr, OUT_EVICT: tl.constexpr,
    GIVEN_MZ: tl.constexpr, GIVEN_W: tl.constexpr, OUT_STAGES: tl.constexpr, EARLY_OUTPUTS: tl.constexpr,
    GROUP_SIZE: tl.constexpr, UE8M0: tl.constexpr, NVFP4: tl.constexpr, SWIZZLED: tl.constexpr,
):
    t, t_mask, th_mask, thd_mask, t64, h64, d64 = _program_tile(num_tokens, NUM_HEADS, HEAD_DIM, BLOCK_T, BLOCK_H,
                                                                  BLOCK_D)
    lse_offs = h64 * stride_lse_h + t64 * stride_lse_t
    o_offs = t64[:, :, None] * stride_o_t + h64[:, :, None] * stride_o_h + d64 * stride_o_d
    last = NUM_PARTIALS - 1
    # A partial's offset (index x stride) passes 2^31 elements in the stacked buffers: 64-bit, like the others.
    stride_o_n = tl.cast(stride_o_n, tl.int64)
    stride_lse_n = tl.cast(stride_lse_n, tl.int64)
    stride_cu_n = tl.cast(stride_cu_n, tl.int64)
    wlse_offs = h64 * stride_wlse_h + t64 * stride_wlse_t
    stride_wlse_n = tl.cast(stride_wlse_n, tl.int64)

    # The last partial: also the pass-through row and LSE (8.4). Its loads are issued first.
    b = tl.load(outs_ptr + last * stride_o_n + o_offs, mask=thd_mask, other=0.0, eviction_policy=OUT_EVICT)
    last_raw = tl.load(lses_ptr + last * stride_lse_n + lse_offs, mask=th_mask, other=float("-inf"))
    # Partials 0 .. EARLY_OUTPUTS - 1: their output tiles load now, in flight through the LSE passes
    # (`tiles.early_outputs`: never the last; 0 where the loops run at runtime).
    early = ()
    for i in tl.static_range(EARLY_OUTPUTS):
        early = early + (tl.load(outs_ptr + i * stride_o_n + o_offs, mask=thd_mask, other=0.0,
                                 eviction_policy=OUT_EVICT),)

    # The request of each token, once for every partial; m and z (8.2, 8.3), or the first kernel's.
    req, in_req = _token_requests(qsl_ptr, t, t_mask, num_requests, SCAN, N_INTERPRET, FUSED_MASK)
    if GIVEN_MZ:
        m, all_empty, z = _given_max_and_sum(wlse_ptr, stride_wlse_n, wlse_offs, th_mask)
    else:
        m, all_empty, z = _max_and_sum(lses_ptr, stride_lse_n, lse_offs, th_mask, cu_ptr, stride_cu_n, req, in_req,
                                       wlse_ptr, 0, wlse_offs, NUM_PARTIALS, LSE_BASE2, FUSED_MASK, INTERPRET,
                                       LSE_STEPS, EXP_STEP, MAX_CHUNKS, MAX_CHUNK, False)
    # out = sum_i w_i * o_i in index order, w_i = e_i / z.
    w_last = _weight(last, lses_ptr, stride_lse_n, lse_offs, th_mask, cu_ptr, stride_cu_n, req, in_req, m, z, wlse_ptr,
                     stride_wlse_n, wlse_offs, LSE_BASE2, FUSED_MASK, INTERPRET, GIVEN_W)
    if NUM_PARTIALS == 1:
        out = _weighted(b, w_last)
    else:
        w = _weight(0, lses_ptr, stride_lse_n, lse_offs, th_mask, cu_ptr, stride_cu_n, req, in_req, m, z, wlse_ptr,
                    stride_wlse_n, wlse_offs, LSE_BASE2, FUSED_MASK, INTERPRET, GIVEN_W)
        if EARLY_OUTPUTS >= 1:
            out = _weighted(early[0], w)
        else:
            out = _weighted(tl.load(outs_ptr + o_offs, mask=thd_mask, other=0.0, eviction_policy=OUT_EVICT), w)
        for k in tl.range(0, OUT_STEPS, num_stages=OUT_STAGES):  # partials 1 .. N-2, in steps of OUT_STEP
            for j in tl.static_range(OUT_STEP):
                out = _out_step(out, 1 + k * OUT_STEP + j, outs_ptr, stride_o_n, o_offs, thd_mask, lses_ptr,
                                stride_lse_n, lse_offs, th_mask, cu_ptr, stride_cu_n, req, in_req, m, z, wlse_ptr,
                                stride_wlse_n, wlse_offs, LSE_BASE2, FUSED_MASK, INTERPRET, OUT_EVICT, GIVEN_W)
        for i in tl.static_range(1 + OUT_STEPS * OUT_STEP, NUM_PARTIALS - 1):
            if i < EARLY_OUTPUTS:
                out = out + _weighted(early[i], _weight(i, lses_ptr, stride_lse_n, lse_offs, th_mask, cu_ptr,
                                                       stride_cu_n, req, in_req, m, z, wlse_ptr, stride_wlse_n,
                                                       wlse_offs, LSE_BASE2, FUSED_MASK, INTERPRET, GIVEN_W))
            else:
                out = _out_step(out, i, outs_ptr, stride_o_n, o_offs, thd_mask, lses_ptr, stride_lse_n, lse_offs,
                                th_mask, cu_ptr, stride_cu_n, req, in_req, m, z, wlse_ptr, stride_wlse_n, wlse_offs,
                                LSE_BASE2, FUSED_MASK, INTERPRET, OUT_EVICT, GIVEN_W)
        out = out + _weighted(b, w_last)
    out = tl.where(all_empty[:, :, None], 0.0, out)
    copy_t = t >= prefill_tokens_with_context  # 8.4
    out_ptrs = out_ptr + t64[:, :, None] * stride_out_t + h64[:, :, None] * stride_out_h + d64 * stride_out_d
    if NVFP4:  # docs/spec.md 4.8
        _store_nvfp4(out_ptr, out, b, copy_t, scale_ptr, gs_ptr, t64, h64, stride_out_t, stride_out_h, stride_out_d,
                     stride_gs_t, stride_gs_g, th_mask, NUM_HEADS, HEAD_DIM, BLOCK_T, BLOCK_H, BLOCK_D, SWIZZLED)
    elif GROUP_SIZE:  # docs/spec.md 4.7
        _store_group_fp8(out_ptr, out_ptrs, out, b, copy_t, gs_ptr, t64, h64, stride_gs_t, stride_gs_g, th_mask,
                         thd_mask, HEAD_DIM, BLOCK_T, BLOCK_H, BLOCK_D, GROUP_SIZE, UE8M0, INTERPRET)
    else:
        _store_output(out_ptr, out_ptrs, out, b, copy_t, scale_ptr, thd_mask, FP8_OUT, INTERPRET)

    if OUTPUT_LSE:
        lse = _merged_lse(z, m, all_empty, copy_t,
                          _copied_lse(last_raw, cu_ptr + last * stride_cu_n, req, in_req, FUSED_MASK),
                          LSE_BASE2, INTERPRET)
        tl.store(out_lse_ptr + h64 * stride_olse_h + t64 * stride_olse_t, lse, mask=th_mask)


EMPTY = "empty"  # the launch plan of N = 0: no kernel, output 0 and LSE -inf (docs/spec.md 8.2)


def merge_attn_states_n(output, outputs, lses, output_lse=None, prefill_tokens_with_context=None,
                        output_scale=None, *, query_start_loc=None, cu_seq_lens=None, lse_layout="HT",
                        lse_base=math.e, group_size=None, output_group_scale=None, scale_ue8m0=False,
                        output_block_scale=None, scale_layout="row", implementation=None, validate=False) -> None:
    """Merge N attention partials by their LSEs (docs/spec.md section 8), in place.

    Args:
      output: f32/f16/bf16[T, H, D], any of them whatever the partials' dtype (one rounding at the store), or
        float8_e4m3fn with output_scale; any strides. Written in place.
      outputs: dtype[N, T, H, D], fp32/fp16/bf16, any strides (a view of an all-gather buffer, a V-padded
        buffer sliced to [..., :D]); any N >= 0 (N = 0: output 0, LSE -inf).
      lses: f32[N, H, T] ([N, T, H] with lse_layout="TH"), any strides; natural log unless lse_base=2. +inf
        and NaN mean an empty partial.
      output_lse: optional f32[H, T] ([T, H]) LSE of the merge, same base. Written in place.
      prefill_tokens_with_context: int or None (= T). Tokens at or past it copy the last partial's row and
        LSE bits (with the fused mask, LSE -inf for a request with no KV in the last partial: 8.4). A runtime
        value: changing it never recompiles.
      output_scale: f32[1] tensor, required for (and only for) an fp8 output.
      query_start_loc, cu_seq_lens: i32[R+1] and i32[N, R+1], both or neither: the fused mask (8.1); a token
        of a request with no KV in partial i (cu_seq_lens[i, r+1] == cu_seq_lens[i, r]) gives partial i LSE
        -inf, whatever the partial holds.
      lse_layout: "HT" or "TH", for all LSEs.
      lse_base: math.e or 2, for all LSEs.
      group_size, output_group_scale, scale_ue8m0: per-group FP8 output, as for `merge_attn_states`
        (docs/spec.md 4.7); output_group_scale f32[T, H * D / group_size], any strides, written in place.
      output_block_scale, scale_layout: NVFP4 output, as for `merge_attn_states` (docs/spec.md 4.8): output
        u8[T, H, D / 2], output_scale the f32[1] global scale (N = 0 zeroes the whole swizzled buffer).
      implementation: None (the Triton kernels where Triton has a driver for the tensors' device, else the torch
        path), "triton" or "torch" (`triton_impl/torch_fallback.py`: any device torch runs on). Never falls back.
      validate: also check offset values and prefill_tokens_with_context (reads offsets: a device sync).

    Raises:
      TypeError: a tensor of the wrong dtype.
      ValueError: wrong ranks or shapes (outputs and lses disagreeing on N, cu_seq_lens not [N, R+1]),
        different devices, an overlapping output, bad options.
      NotImplementedError: a group size (or NVFP4) the kernels do not take for this head dim;
        implementation="triton" on a device Triton does not compile for.
    """
    scales = output_group_scale if output_block_scale is None else output_block_scale  # the kernel's one slot
    key, plan = (None, None) if validate else plans.find_plan(
        "merge_n", (output, outputs, lses, output_lse, output_scale, query_start_loc, cu_seq_lens, output_group_scale,
                    output_block_scale),
        (lse_layout, lse_base, group_size, scale_ue8m0, scale_layout, implementation))
    if plan is not None:  # every metadata check passed for this signature: the per-call ones only
        overlaps, num_tokens, launch = plan
        if not checks.partial_overlap(overlaps, dict(output=output, output_lse=output_lse, outputs=outputs, lses=lses,
                                                     output_group_scale=output_group_scale,
                                                     output_block_scale=output_block_scale)):
            prefill_tokens = num_tokens if prefill_tokens_with_context is None else checks.check_prefill_tokens(
                prefill_tokens_with_context, num_tokens, False)
            if launch is not None:
                _launch(launch, output, output_lse, outputs, lses, output_scale, query_start_loc, cu_seq_lens,
                        prefill_tokens, lse_layout, scales)
            return
        # an overlap: the checked path below raises its error

    checks.check_lse_layout(lse_layout)
    base2 = checks.check_lse_base(lse_base)
    checks.check_tensor("outputs", outputs, ndim=4, dtypes=checks.OUTPUT_DTYPES)
    device = outputs.device
    num_partials, num_tokens, num_heads, head_dim = outputs.shape
    group = group_size is not None or output_block_scale is not None
    fp8, gs_strides, gs_overlaps = checks.check_outputs(
        output, outputs, output_scale, group_size, output_group_scale, scale_ue8m0,
        reads=dict(outputs=outputs, lses=lses, output_lse=output_lse), output_block_scale=output_block_scale,
        scale_layout=scale_layout)
    checks.check_tensor("lses", lses, ndim=3, dtypes=(torch.float32,), device=device)
    stride_lse_n, stride_lse_h, stride_lse_t = checks.lses_strides(lses, lse_layout, num_partials, num_heads,
                                                                   num_tokens)
    olse_strides, lse_overlaps = (0, 0), ()
    if output_lse is not None:
        checks.check_tensor("output_lse", output_lse, ndim=2, dtypes=(torch.float32,), device=device)
        olse_strides = checks.lse_ht_strides("output_lse", output_lse, lse_layout, num_heads, num_tokens)
        checks.check_no_internal_overlap("output_lse", output_lse)
        lse_overlaps = checks.check_no_partial_overlap("output_lse", output_lse, lses=lses, output=output)
    out_overlaps = checks.check_no_partial_overlap("output", output, outputs=outputs)
    fused = checks.check_fused_pair(query_start_loc, cu_seq_lens, "cu_seq_lens")
    num_requests = 0
    cu_given = cu_seq_lens
    if fused:
        checks.check_tensor("query_start_loc", query_start_loc, ndim=1, dtypes=(torch.int32,), device=device)
        checks.check_tensor("cu_seq_lens", cu_seq_lens, ndim=2, dtypes=(torch.int32,), device=device)
        if query_start_loc.shape[0] < 1:
            raise ValueError("query_start_loc must have R+1 >= 1 entries, got an empty tensor")
        num_requests = query_start_loc.shape[0] - 1
        if tuple(cu_seq_lens.shape) != (num_partials, num_requests + 1):
            raise ValueError(f"cu_seq_lens must be i32[N, R+1] = [{num_partials}, {num_requests + 1}] (each partial's KV "
                             f"offsets); got cu_seq_lens.shape={tuple(cu_seq_lens.shape)}")
        if cu_seq_lens.stride(1) != 1:
            cu_seq_lens = cu_seq_lens.contiguous()  # a read-only copy of R+1 offsets per partial
        fused = num_requests > 0  # no request, nothing to mask
    prefill_tokens = checks.check_prefill_tokens(prefill_tokens_with_context, num_tokens, validate)
    if validate and fused:
        checks.check_offset_values(query_start_loc, cu_seq_lens, num_tokens)
    impl = _backend.resolve_implementation(implementation, device)
    launch = None
    if num_partials == 0:  # 8.2: no partial, every row empty (pass-through rows too: there is no last partial)
        launch = EMPTY
        if group:  # 4.7: q = 0 and the floor's scale; 4.8: codes 0 and scales 0
            launch = (EMPTY, 0.0 if output_block_scale is not None else checks.group_floor_scale(scale_ue8m0))
    elif num_tokens and num_heads and impl == "torch":
        launch = plans.torch_launch(lse_base2=base2, fused=fused, group_size=group_size, scale_ue8m0=scale_ue8m0,
                                    nvfp4=output_block_scale is not None, scale_layout=scale_layout)
    elif num_tokens and num_heads:
        variant = tiles.merge_variant(output_lse is not None, fused)
        itemsize = outputs.element_size()
        block_t, block_h, block_d = tiles.merge_tiles("triton", num_heads, head_dim, variant, itemsize, num_partials,
                                                      lse_layout)
        split = tiles.split_passes(num_partials)
        weights = split and tiles.split_weights("triton", variant, lse_layout)
        # The split merge's f32[2 (+ N), H, T] ([.., T, H]: `tiles.split_layout`) buffer: m, z (and the
        # exponentials), allocated per call.
        w_ht = tiles.split_layout("triton", variant, lse_layout) == "HT"
        wlse_strides = (num_heads * num_tokens, *((num_tokens, 1) if w_ht else (1, num_heads)))
        cu_stride = cu_seq_lens.stride(0) if fused else 0
        shared = dict(NUM_PARTIALS=num_partials, NUM_HEADS=num_heads, SCAN=tiles.SCAN,
                      N_INTERPRET=_backend.n_interpret(num_requests + 1), LSE_BASE2=base2, FUSED_MASK=fused,
                      INTERPRET=_backend.interpreting(), **plans.n_way_loops(variant, num_partials, weighted_sum=False))
        first = None
        if split:
            ms_block_t, ms_block_h = tiles.max_sum_tiles("triton", num_heads, lse_layout, fused)
            wlse_shape = (2 + num_partials * weights, *((num_heads, num_tokens) if w_ht else (num_tokens, num_heads)))
            first = (wlse_shape, plans.kernel_launch(
                grid=tiles.max_sum_grid("triton", num_tokens, num_heads, lse_layout, fused),
                ints=(*wlse_strides, stride_lse_n, stride_lse_h, stride_lse_t, cu_stride, num_tokens, num_requests),
                constexprs=dict(**shared, BLOCK_T=ms_block_t, BLOCK_H=ms_block_h, STORE_WEIGHTS=weights,
                                num_warps=tiles.max_sum_warps("triton", lse_layout, fused),
                                **_backend.PARITY_LAUNCH),
                state=launcher.launch_state(key)))
        launch = (first, plans.merge_launch(
            grid=tiles.merge_grid("triton", num_tokens, num_heads, head_dim, variant, itemsize, num_partials,
                                  lse_layout),
            fused=fused,
            ints=(*output.stride(), *outputs.stride(), *olse_strides, stride_lse_n, stride_lse_h, stride_lse_t,
                  cu_stride, *wlse_strides, *gs_strides, num_tokens),
            num_requests=num_requests,
            constexprs=dict(**shared, HEAD_DIM=head_dim, BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_D=block_d,
                            OUTPUT_LSE=output_lse is not None, FP8_OUT=fp8,
                            **plans.n_way_loops(variant, num_partials, max_and_sum=False),
                            OUT_EVICT=tiles.outputs_evict("triton", num_partials), GIVEN_MZ=split, GIVEN_W=weights,
                            EARLY_OUTPUTS=tiles.early_outputs("triton", variant, num_partials),
                            GROUP_SIZE=group_size or 0, UE8M0=bool(scale_ue8m0),
                            NVFP4=output_block_scale is not None, SWIZZLED=scale_layout == "swizzled",
                            num_warps=tiles.merge_num_warps("triton", variant, num_partials, lse_layout),
                            **_backend.PARITY_LAUNCH),
            state=launcher.launch_state(key)))
    # A non-contiguous cu_seq_lens row is copied per call: no plan for it (its copy would be the launch's pointer).
    if not (fused and cu_seq_lens is not cu_given):
        plans.remember(key, plans.plan(overlaps=lse_overlaps + out_overlaps + gs_overlaps, num_tokens=num_tokens,
                                       launch=launch))
    if launch is not None:
        _launch(launch, output, output_lse, outputs, lses, output_scale, query_start_loc, cu_seq_lens, prefill_tokens,
                lse_layout, scales)


def _launch(launch, output, output_lse, outputs, lses, output_scale, query_start_loc, cu_seq_lens,
            prefill_tokens, lse_layout, output_group_scale=None) -> None:
    """The kernel launches of a plan: `EMPTY` (with per-group FP8: (`EMPTY`, the floor's scale)), the torch path's
    (`plans.torch_launch`), or (first,
    merge): the split merge's first kernel (None unless `tiles.split_passes`: (its buffer's shape, its
    `plans.kernel_launch`)), then the merge's (grid, fused, the strides and T, R, the compile-time arguments,
    `launcher.launch`'s state)."""
    if launch is EMPTY or launch[0] is EMPTY:
        output.zero_()
        if output_lse is not None:
            output_lse.fill_(float("-inf"))
        if output_group_scale is not None:  # 4.7: q = 0 and the floor's scale; 4.8: scales 0
            output_group_scale.fill_(launch[1])
        return
    if launch[0] is plans.TORCH:
        options = launch[1]
        fused = options["fused"]
        torch_fallback.merge_attn_states_n(
            output, outputs, lses, output_lse, prefill_tokens, query_start_loc if fused else None,
            cu_seq_lens if fused else None, lse_layout=lse_layout, lse_base2=options["lse_base2"],
            **torch_fallback.store_options(options, output_scale, output_group_scale))
        return
    first, (grid, fused, ints, num_requests, constexprs, state) = launch
    placeholder = lses  # for the pointers a variant does not read
    qsl, cu = (query_start_loc, cu_seq_lens) if fused else (placeholder, placeholder)
    wlse = placeholder
    if first is not None:
        wlse_shape, (w_grid, w_ints, w_constexprs, w_state) = first
        wlse = torch.empty(wlse_shape, dtype=torch.float32, device=lses.device)
        launcher.launch(_merge_n_weights_kernel[lse_layout], w_grid, (wlse, lses, qsl, cu, *w_ints), w_constexprs,
                        w_state)
    launcher.launch(_merge_attn_states_n_kernel[lse_layout], grid, (
        output, placeholder if output_lse is None else output_lse, outputs, lses,
        placeholder if output_scale is None else output_scale, qsl, cu, wlse,
        placeholder if output_group_scale is None else output_group_scale, *ints, prefill_tokens, num_requests),
        constexprs, state)
