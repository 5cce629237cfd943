"""Context-parallel combine (docs/spec.md section 9) on `torch.distributed`: the rescale kernel and the wrapper.

Each rank of a context-parallel group holds one partial `(out [T, H, D], lse)` over its local KV shard and its
local KV offsets; the combine merges the N partials of the group. Two methods:

- `gather`: all-gather the partials, LSEs and offsets (`all_gather_into_tensor`), then the N-way merge
  (`merge_n.py`) on every rank. Deterministic: the single-process N-way merge's bits; every rank gets all heads.
- `reduce_scatter`: all-gather the LSEs and offsets only; each rank scales its own partial by its N-way weight
  (the rescale kernel below: the N-way merge's weights, statement by statement, for one partial) into a
  buffer grouped by destination rank, then `reduce_scatter_tensor` sums the groups over heads: rank r gets heads
  [r * H / N, (r + 1) * H / N). The sum order belongs to the collective: within tolerance, not bit-fixed.

Rescale grid and tile: the N-way merge's. Float math: the N-way merge's (libdevice exp/log, no FMA
contraction, no flush-to-zero), `pallas_impl/cp_merge.py` statement by statement.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from mla_lse_common import constants, tiles
from mla_lse_common.tiles import RESCALE_TILE_PARTIALS
from triton_impl import _backend
from triton_impl import _checks as checks
from triton_impl import _launch as launcher
from triton_impl import _plans as plans
from triton_impl import torch_fallback
from triton_impl._device import (_cast_rne, _copied_lse, _max_and_sum, _merged_lse, _partial_exp, _program_tile,
                                 _store_nvfp4, _token_requests, _weighted)
from triton_impl.merge_n import merge_attn_states_n


# Runtime values: the N-way merge's (triton_impl/merge_n.py), and the rank.
@_backend.jit_per_lse_layout(runtime=["num_tokens", "prefill_tokens_with_context", "num_requests", "rank",
                                     "stride_lse_n", "stride_cu_n"], lse_head_strides=["stride_olse_h", "stride_lse_h"])
def _cp_rescale_kernel(
    scaled_ptr,  # reduce dtype: head h of token t at (h // HEADS_PER_GROUP) * stride_s_g + (h % HEADS_PER_GROUP) * ...
    out_lse_ptr,  # f32[H, T] merged LSE of every head via (stride_olse_h, stride_olse_t); unused unless OUTPUT_LSE
    part_ptr,  # dtype[T, H, D] this rank's partial via (stride_p_t, stride_p_h, stride_p_d)
    lses_ptr,  # f32[N, H, T] every rank's LSE via (stride_lse_n, stride_lse_h, stride_lse_t)
    qsl_ptr,  # i32[R+1] query_start_loc; unused unless FUSED_MASK
    cu_ptr,  # i32[N, R+1] every rank's KV offsets via (stride_cu_n, 1); unused unless FUSED_MASK
    stride_s_g, stride_s_t, stride_s_h, stride_s_d,
    stride_p_t, stride_p_h, stride_p_d,
    stride_olse_h, stride_olse_t,
    stride_lse_n, stride_lse_h, stride_lse_t,
    stride_cu_n,
    num_tokens, prefill_tokens_with_context, num_requests,
    rank,  # this rank's partial index; runtime value
    NUM_PARTIALS: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PER_GROUP: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    SCAN: tl.constexpr, N_INTERPRET: tl.constexpr,
    LSE_BASE2: tl.constexpr, OUTPUT_LSE: tl.constexpr, FUSED_MASK: tl.constexpr, INTERPRET: tl.constexpr,
    LSE_STEPS: tl.constexpr, EXP_STEP: tl.constexpr, MAX_CHUNKS: tl.constexpr, MAX_CHUNK: tl.constexpr,
):
    t, t_mask, th_mask, thd_mask, t64, h64, d64 = _program_tile(num_tokens, NUM_HEADS, HEAD_DIM, BLOCK_T, BLOCK_H,
                                                                  BLOCK_D)
    lse_offs = h64 * stride_lse_h + t64 * stride_lse_t
    last = NUM_PARTIALS - 1
    # A partial's offset (index x stride) may pass 2^31 elements: 64-bit, like the others.
    stride_lse_n = tl.cast(stride_lse_n, tl.int64)
    stride_cu_n = tl.cast(stride_cu_n, tl.int64)

    # This rank's partial; the last partial's raw LSE is the pass-through LSE (8.4).
    o = tl.load(part_ptr + t64[:, :, None] * stride_p_t + h64[:, :, None] * stride_p_h + d64 * stride_p_d,
                mask=thd_mask, other=0.0)
    last_raw = tl.load(lses_ptr + last * stride_lse_n + lse_offs, mask=th_mask, other=float("-inf"))

    # The N-way merge's weights (8.2, 8.3), for partial `rank` only.
    req, in_req = _token_requests(qsl_ptr, t, t_mask, num_requests, SCAN, N_INTERPRET, FUSED_MASK)
    m, all_empty, z = _max_and_sum(lses_ptr, stride_lse_n, lse_offs, th_mask, cu_ptr, stride_cu_n, req, in_req,
                                   lses_ptr, 0, lse_offs, NUM_PARTIALS, LSE_BASE2, FUSED_MASK, INTERPRET, LSE_STEPS,
                                   EXP_STEP, MAX_CHUNKS, MAX_CHUNK, False)
    w = _partial_exp(lses_ptr, stride_lse_n, rank, lse_offs, th_mask, cu_ptr, stride_cu_n, req, in_req, m,
                     LSE_BASE2, FUSED_MASK, INTERPRET) / z
    scaled = _weighted(o, w)
    scaled = tl.where(all_empty[:, :, None], 0.0, scaled)
    # 8.4: the last partial's row, exactly. The other ranks add -0.0, the identity of the sum (x + -0.0 == x).
    copy_t = t >= prefill_tokens_with_context
    if rank == last:
        scaled = tl.where(copy_t[:, None, None], o.to(tl.float32), scaled)
    else:
        scaled = tl.where(copy_t[:, None, None], -0.0, scaled)
    s_ptrs = (scaled_ptr + t64[:, :, None] * stride_s_t + (h64 // HEADS_PER_GROUP)[:, :, None] * stride_s_g
              + (h64 % HEADS_PER_GROUP)[:, :, None] * stride_s_h + d64 * stride_s_d)
    tl.store(s_ptrs, _cast_rne(scaled, scaled_ptr.dtype.element_ty, INTERPRET), mask=thd_mask)

    if OUTPUT_LSE:  # the merged LSE (of every head: the caller keeps its own)
        lse = _merged_lse(z, m, all_empty, copy_t,
                          _copied_lse(last_raw, cu_ptr + last * stride_cu_n, req, in_req, FUSED_MASK),
                          LSE_BASE2, INTERPRET)
        tl.store(out_lse_ptr + h64 * stride_olse_h + t64 * stride_olse_t, lse, mask=th_mask)


@triton.jit
def _nvfp4_rows_kernel(x_ptr, q_ptr, scale_ptr, bs_ptr, num_tokens, stride_q_t, stride_q_h, stride_q_d,
                       stride_bs_t, stride_bs_k, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                       BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, SWIZZLED: tl.constexpr):
    """NVFP4 (docs/spec.md 4.8) of contiguous rows `x` [T, H, D] (the reduce-scatter combine's f32 sum; any float
    dtype, taken as f32), through the merges' own store (`_store_nvfp4`): BLOCK_T tokens x BLOCK_H heads per
    program. Also the separate quantizer `python -m tools group-fp8-speed --format nvfp4` times."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, HEAD_DIM)
    t64, h64 = t[:, None].to(tl.int64), h[None, :].to(tl.int64)
    th_mask = (t < num_tokens)[:, None] & (h < NUM_HEADS)[None, :]
    x = tl.load(x_ptr + (t64[:, :, None] * NUM_HEADS + h64[:, :, None]) * HEAD_DIM + d, mask=th_mask[:, :, None],
                other=0.0).to(tl.float32)
    _store_nvfp4(q_ptr, x, x, t < 0, scale_ptr, bs_ptr, t64, h64, stride_q_t, stride_q_h, stride_q_d, stride_bs_t,
                 stride_bs_k, th_mask, NUM_HEADS, HEAD_DIM, BLOCK_T, BLOCK_H, HEAD_DIM, SWIZZLED)


# ---------------------------------------------------------------------------------------------------------
# Host side

_DTYPE_CODES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn)


def _code(x) -> int:
    return _DTYPE_CODES.index(x.dtype) if isinstance(x, torch.Tensor) and x.dtype in _DTYPE_CODES else -1


def _local_checks(output, partial_output, partial_lse, output_lse, prefill_tokens_with_context, output_scale,
                  query_start_loc, cu_seq_lens, output_group_scale=None, output_block_scale=None, *, method,
                  num_partials, lse_layout, lse_base, reduce_dtype, group_size, scale_ue8m0, scale_layout, validate):
    """Every check this rank can make alone (metadata; with validate=True also offset values). Returns the
    plan of the call's signature, the checked prefill_tokens_with_context and the descriptor the ranks must agree
    on."""
    checks.check_cp_method(method)
    checks.check_lse_layout(lse_layout)
    base2 = checks.check_lse_base(lse_base)
    checks.check_tensor("partial_output", partial_output, ndim=3, dtypes=checks.OUTPUT_DTYPES)
    device = partial_output.device
    num_tokens, num_heads, head_dim = partial_output.shape
    checks.check_tensor("partial_lse", partial_lse, ndim=2, dtypes=(torch.float32,), device=device)
    checks.lse_ht_strides("partial_lse", partial_lse, lse_layout, num_heads, num_tokens)
    heads_out = num_heads
    if method == "reduce_scatter":
        if num_heads % num_partials:
            raise ValueError(f"method='reduce_scatter' splits the H={num_heads} heads over the group's N={num_partials} "
                             "ranks: H must be a multiple of N (use method='gather')")
        heads_out = num_heads // num_partials
    want = (num_tokens, heads_out, head_dim)
    if output_block_scale is None:  # NVFP4's u8[T, H or H / N, D / 2] output: check_outputs checks it
        checks.check_tensor("output", output, ndim=3, dtypes=checks.OUTPUT_DTYPES + (torch.float8_e4m3fn,),
                            device=device)
        if tuple(output.shape) != want:
            raise ValueError(f"output must be [T, H{'/N' if heads_out != num_heads else ''}, D] = {list(want)} for "
                             f"method={method!r} with N={num_partials} ranks; got output.shape={tuple(output.shape)}")
    # docs/spec.md 4.7, 4.8: the scales of this rank's rows (every head for "gather", its heads for "reduce_scatter")
    fp8, _, _ = checks.check_outputs(output, partial_output, output_scale, group_size, output_group_scale,
                                     scale_ue8m0, shape=want, reads=dict(partial_output=partial_output,
                                                                         partial_lse=partial_lse,
                                                                         output_lse=output_lse),
                                     output_block_scale=output_block_scale, scale_layout=scale_layout)
    if output_lse is not None:
        checks.check_tensor("output_lse", output_lse, ndim=2, dtypes=(torch.float32,), device=device)
        checks.lse_ht_strides("output_lse", output_lse, lse_layout, heads_out, num_tokens)
        checks.check_no_internal_overlap("output_lse", output_lse)
    num_requests = -1
    if checks.check_fused_pair(query_start_loc, cu_seq_lens, "cu_seq_lens"):
        if isinstance(cu_seq_lens, torch.Tensor) and cu_seq_lens.dim() == 2:
            raise ValueError(f"cu_seq_lens must be this rank's local KV offsets i32[R+1] (the combine gathers every "
                             f"rank's); got cu_seq_lens.shape={tuple(cu_seq_lens.shape)}")
        num_requests = checks.check_offsets(query_start_loc, cu_seq_lens, device)
        if validate:
            checks.check_offset_values(query_start_loc, cu_seq_lens, num_tokens)
    if reduce_dtype not in (None, torch.float32, partial_output.dtype):
        raise TypeError(f"reduce_dtype must be None (float32), torch.float32 or the partials' dtype "
                        f"{partial_output.dtype}; got {reduce_dtype}")
    ptwc = checks.check_prefill_tokens(prefill_tokens_with_context, num_tokens, validate)
    descriptor = [constants.CP_METHODS.index(method), _code(partial_output), _code(output), num_tokens, num_heads,
                  head_dim, num_requests, constants.LSE_LAYOUTS.index(lse_layout), int(base2),
                  int(output_lse is not None), ptwc, _code(torch.empty(0, dtype=reduce_dtype or torch.float32))]
    descriptor += [group_size or 0, int(scale_ue8m0),
                   -1 if output_block_scale is None else constants.NVFP4_SCALE_LAYOUTS.index(scale_layout)]
    return plans.CpPlan(fp8=fp8, base2=base2, num_requests=num_requests), ptwc, descriptor


def _local_params(output, partial_output, partial_lse, output_lse, prefill_tokens_with_context, output_scale,
                  query_start_loc, cu_seq_lens, output_group_scale, output_block_scale, **options):
    """`_local_checks` through the plan cache: (plan, prefill_tokens_with_context, descriptor); the descriptor is
    None where the plan was found (validate=False only)."""
    key, plan = (None, None) if options["validate"] else plans.find_plan(
        "cp_merge", (output, partial_output, partial_lse, output_lse, output_scale, query_start_loc, cu_seq_lens,
                     output_group_scale, output_block_scale), tuple(options.values()))
    if plan is not None:  # every metadata check passed for this signature: prefill_tokens_with_context only
        return plan, checks.check_prefill_tokens(prefill_tokens_with_context, partial_output.shape[0], False), None
    plan, ptwc, descriptor = _local_checks(output, partial_output, partial_lse, output_lse,
                                           prefill_tokens_with_context, output_scale, query_start_loc, cu_seq_lens,
                                           output_group_scale, output_block_scale, **options)
    plans.remember(key, plan)
    return plan, ptwc, descriptor


DESCRIPTOR_FIELDS = ("method", "partial_output.dtype", "output.dtype", "T", "H", "D", "R", "lse_layout",
                     "lse_base", "output_lse given", "prefill_tokens_with_context", "reduce_dtype", "group_size",
                     "scale_ue8m0", "NVFP4 scale_layout")


def _agree(group, descriptor, error, device) -> None:
    """validate=True: one small all-gather in which every rank reports its local verdict and its descriptor;
    then every rank raises the same kind of error if any rank failed or the ranks disagree. Nobody is left
    inside a collective: each rank enters this one, whatever its inputs."""
    n = len(DESCRIPTOR_FIELDS)
    mine = torch.tensor([0 if error is None else 1] + (descriptor or [-2] * n), dtype=torch.int64, device=device)
    rows = torch.empty(group.size() * (n + 1), dtype=torch.int64, device=device)
    _quiet_collective(dist.all_gather_into_tensor, rows, mine, group=group)
    rows = rows.view(group.size(), n + 1).cpu().tolist()  # a host sync: validate=True only
    bad = [r for r, row in enumerate(rows) if row[0]]
    if error is not None:
        raise error
    if bad:
        raise ValueError(f"cp_merge_attn_states: rank(s) {bad} of the group failed their input checks (each raised "
                         "its own error); this rank's inputs were valid")
    diff = [f"{name}: " + ", ".join(f"rank {r}={row[i + 1]}" for r, row in enumerate(rows))
            for i, name in enumerate(DESCRIPTOR_FIELDS) if len({row[i + 1] for row in rows}) > 1]
    if diff:
        raise ValueError("cp_merge_attn_states: the ranks of the group disagree on " + "; ".join(diff))


def _quiet_collective(fn, *args, **kwargs):
    """torch >= 2.13 marks all_gather_into_tensor / reduce_scatter_tensor deprecated (FutureWarning) in favour of
    `*_single` names older releases lack; the calls are the same collectives."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use `torch\.distributed\.", category=FutureWarning)
        return fn(*args, **kwargs)


def _group_device(group, partial_output):
    if isinstance(partial_output, torch.Tensor) and partial_output.device.type != "meta":
        return partial_output.device
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")


def cp_merge_attn_states(output, partial_output, partial_lse, group, output_lse=None,
                         prefill_tokens_with_context=None, output_scale=None, *, method="gather",
                         query_start_loc=None, cu_seq_lens=None, lse_layout="HT", lse_base=math.e,
                         reduce_dtype=None, group_size=None, output_group_scale=None, scale_ue8m0=False,
                         output_block_scale=None, scale_layout="row", implementation=None, validate=False) -> None:
    """Combine the attention partials of a context-parallel group (docs/spec.md section 9), in place.

    Call on every rank of `group` with that rank's partial over its local KV. Rank i is partial i of the N-way
    merge (docs/spec.md 8): its order fixes the bits of `gather`.

    Args:
      output: method "gather": dtype[T, H, D], every head. method "reduce_scatter": dtype[T, H / N, D], this
        rank's heads [rank * H / N, (rank + 1) * H / N). f32/f16/bf16 whatever the partials' dtype, or fp8
        (float8_e4m3fn) with output_scale. Written in place.
      partial_output: dtype[T, H, D], fp32/fp16/bf16: attention of all T queries over this rank's KV shard. A
        strided view is copied to a contiguous buffer for the collective.
      partial_lse: f32[H, T] ([T, H] with lse_layout="TH"), its LSE; +inf and NaN mean empty.
      group: the `torch.distributed` process group of the context-parallel ranks (NCCL on GPUs, gloo on CPU).
      output_lse: optional f32 LSE of the merge, [H, T] ("gather") or [H / N, T] ("reduce_scatter").
      prefill_tokens_with_context: tokens at or past it copy the last rank's row and LSE bits (8.4).
      output_scale: f32[1], for (and only for) an fp8 output.
      method: "gather" or "reduce_scatter" (see the module docstring and docs/design.md for the bytes moved).
      query_start_loc: i32[R+1], the same on every rank; cu_seq_lens: i32[R+1], THIS rank's local KV offsets. Both
        or neither: a token of a request with no KV on rank i gets partial i LSE -inf, whatever the backend left.
      lse_layout, lse_base: of every LSE.
      reduce_dtype: "reduce_scatter" only: the dtype of the reduced buffer, None (float32: one rounding, at the
        end) or the partials' dtype (half the bytes; one rounding per rank).
      group_size, output_group_scale, scale_ue8m0: per-group FP8 output (docs/spec.md 4.7), as for
        `merge_attn_states`; output_group_scale f32[T, (H or H / N) * D / group_size], this rank's rows. "gather":
        fused into the N-way merge (its bits); "reduce_scatter": on the reduced rows, after the sum.
      output_block_scale, scale_layout: NVFP4 output (docs/spec.md 4.8), as for `merge_attn_states`: `output`
        u8[T, H or H / N, D / 2], output_scale the f32[1] global scale, output_block_scale this rank's e4m3 block
        scales ("row" [T, (H or H / N) * D / 16], any strides, or "swizzled", the FP4 GEMMs' buffer of this rank's
        rows). "gather": fused into the N-way merge (its bits); "reduce_scatter": on the reduced rows, after the
        sum, by the merges' own NVFP4 store.
      implementation: None (the Triton kernels where Triton has a driver for the tensors' device, else the torch
        path), "triton" or "torch" (`triton_impl/torch_fallback.py`: any device torch runs on, gloo on a CPU).
      validate: also check offset values, and before anything else make every rank agree on the inputs: one
        small all-gather of each rank's verdict and metadata (a host sync), after which every rank raises if any
        rank's inputs were bad or the ranks disagree (dtype, T, H, D, R, layout, base, method, ...).

    Raises:
      TypeError, ValueError: before any collective, for this rank's own inputs (with validate=True, on every
        rank, after the agreement all-gather). Without validate, a check that fails on one rank only leaves the
        other ranks waiting in the first collective until the group's timeout: validate=True is the safe mode
        for inputs that can differ between ranks.
    """
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup, got {type(group).__name__}")
    num_partials, rank = group.size(), group.rank()
    params, ptwc, descriptor, error, impl = None, None, None, None, None
    try:
        impl = _backend.resolve_implementation(implementation, partial_output.device) if isinstance(
            partial_output, torch.Tensor) else None  # a non-tensor: _local_params names it
        params, ptwc, descriptor = _local_params(
            output, partial_output, partial_lse, output_lse, prefill_tokens_with_context, output_scale,
            query_start_loc, cu_seq_lens, output_group_scale, output_block_scale, method=method,
            num_partials=num_partials, lse_layout=lse_layout, lse_base=lse_base, reduce_dtype=reduce_dtype,
            group_size=group_size, scale_ue8m0=scale_ue8m0, scale_layout=scale_layout, validate=validate)
    except (TypeError, ValueError) as e:
        if not validate:
            raise
        error = e
    if validate:
        _agree(group, descriptor, error, _group_device(group, partial_output))

    num_tokens, num_heads, head_dim = partial_output.shape
    fused = params.num_requests > 0
    device = partial_output.device
    lse_buf_shape = (num_partials * partial_lse.shape[0], partial_lse.shape[1])
    lses = torch.empty(lse_buf_shape, dtype=torch.float32, device=device)
    works = [_quiet_collective(dist.all_gather_into_tensor, lses, partial_lse.contiguous(), group=group,
                               async_op=True)]
    cus = None
    if fused:
        cus = torch.empty(num_partials * cu_seq_lens.shape[0], dtype=torch.int32, device=device)
        works.append(_quiet_collective(dist.all_gather_into_tensor, cus, cu_seq_lens.contiguous(), group=group,
                                       async_op=True))
    if method == "gather":
        outs = torch.empty((num_partials * num_tokens, num_heads, head_dim), dtype=partial_output.dtype, device=device)
        works.append(_quiet_collective(dist.all_gather_into_tensor, outs, partial_output.contiguous(), group=group,
                                       async_op=True))
    for w in works:
        w.wait()
    lses = lses.view(num_partials, *partial_lse.shape)
    cus = cus.view(num_partials, -1) if fused else None
    qsl = query_start_loc if fused else None
    if method == "gather":
        group = dict(group_size=group_size, output_group_scale=output_group_scale,
                     scale_ue8m0=scale_ue8m0) if group_size else {}
        if output_block_scale is not None:
            group = dict(output_block_scale=output_block_scale, scale_layout=scale_layout)
        merge_attn_states_n(output, outs.view(num_partials, num_tokens, num_heads, head_dim), lses, output_lse,
                            ptwc, output_scale, query_start_loc=qsl, cu_seq_lens=cus,
                            lse_layout=lse_layout, lse_base=lse_base, implementation=impl, **group)
        return

    heads = num_heads // num_partials
    rdt = reduce_dtype or torch.float32
    scaled = torch.empty((num_partials, num_tokens, heads, head_dim), dtype=rdt, device=device)
    merged_lse = None if output_lse is None else torch.empty_like(partial_lse, memory_format=torch.contiguous_format)
    if num_tokens and num_heads and impl == "torch":
        torch_fallback.cp_rescale(scaled, merged_lse, partial_output, lses, qsl, cus, rank, ptwc, lse_layout=lse_layout,
                                  lse_base2=params.base2)
    elif num_tokens and num_heads:
        _rescale(scaled, merged_lse, partial_output, lses, qsl, cus, rank, params, ptwc, lse_layout)
    if output_lse is not None:  # this rank's heads of the merged LSE
        own = slice(rank * heads, (rank + 1) * heads)
        output_lse.copy_(merged_lse[own] if lse_layout == "HT" else merged_lse[:, own])
    direct = output.dtype == rdt and output.is_contiguous() and output_block_scale is None
    reduced = output if direct else torch.empty((num_tokens, heads, head_dim), dtype=rdt, device=device)
    _quiet_collective(dist.reduce_scatter_tensor, reduced, scaled.view(num_partials * num_tokens, heads, head_dim),
                      op=dist.ReduceOp.SUM, group=group)
    if output_block_scale is not None and impl == "torch":  # 4.8, after the sum: the torch path's NVFP4 store
        rows = reduced.float()
        torch_fallback.store(output, rows, rows, num_tokens, output_scale=output_scale,
                             output_block_scale=output_block_scale, scale_layout=scale_layout)  # no pass-through row
    elif output_block_scale is not None:  # 4.8, after the sum: this rank's rows through the merges' NVFP4 store
        _nvfp4_rows(output, reduced.float().contiguous(), output_scale, output_block_scale, scale_layout)
    elif group_size:  # 4.7, after the sum: this rank's rows quantized per group (torch's cast: nearest even)
        q, scales = torch_fallback.group_quant(reduced.float().reshape(num_tokens, -1), group_size, scale_ue8m0)
        output.copy_(q.view(output.shape))
        output_group_scale.copy_(scales)
    elif params.fp8:  # 4.6, after the sum: clamp(out / scale) then the cast (torch's: round to nearest even)
        output.copy_((reduced.float() / output_scale).clamp(-constants.FP8_E4M3_MAX, constants.FP8_E4M3_MAX))
    elif not direct:
        output.copy_(reduced)


def _nvfp4_rows(output, rows, output_scale, output_block_scale, scale_layout) -> None:
    """NVFP4 of contiguous f32 `rows` [T, H', D] into `output` u8[T, H', D / 2] and `output_block_scale` (4.8)."""
    num_tokens, heads, head_dim = rows.shape
    if not num_tokens or not heads:
        return
    block_t, block_h = 4, min(triton.next_power_of_2(heads), 16)
    swizzled = scale_layout == "swizzled"
    _nvfp4_rows_kernel[(triton.cdiv(num_tokens, block_t), triton.cdiv(heads, block_h))](
        rows, output, output_scale, output_block_scale, num_tokens, *output.stride(),
        *((0, 0) if swizzled else output_block_scale.stride()), NUM_HEADS=heads, HEAD_DIM=head_dim,
        BLOCK_T=block_t, BLOCK_H=block_h, SWIZZLED=swizzled, **_backend.PARITY_LAUNCH)  # the fused merges' float settings: the store's bits


def _rescale(scaled, merged_lse, partial_output, lses, qsl, cus, rank, params, ptwc, lse_layout) -> None:
    """`scaled` [N, T, H / N, D]: group j holds heads [j * H / N, (j + 1) * H / N) of this rank's weighted partial,
    the layout `reduce_scatter_tensor` splits along dim 0; `merged_lse` the merged LSE of every head."""
    fused = cus is not None
    key, plan = plans.find_plan("cp_rescale", (scaled, merged_lse, partial_output, lses, qsl, cus),
                                (lse_layout, params.base2, params.num_requests))
    if plan is None:
        plan = _rescale_plan(scaled, merged_lse, partial_output, lses, cus, params, lse_layout, key)
        plans.remember(key, plan)
    grid, ints, constexprs, state = plan
    placeholder = lses  # for the pointers a variant does not read
    launcher.launch(_cp_rescale_kernel[lse_layout], grid, (
        scaled, placeholder if merged_lse is None else merged_lse, partial_output, lses,
        qsl if fused else placeholder, cus if fused else placeholder, *ints, ptwc,
        max(params.num_requests, 0), rank), constexprs, state)


def _rescale_plan(scaled, output_lse, partial_output, lses, cus, params, lse_layout, key):
    """The `kernel_launch` of a rescale (cached under `key` when it is not None)."""
    num_partials, num_tokens, heads, head_dim = scaled.shape
    num_heads = partial_output.shape[1]
    fused = cus is not None
    variant = tiles.merge_variant(output_lse is not None, fused)
    itemsize = partial_output.element_size()
    block_t, block_h, block_d = tiles.merge_tiles("triton", num_heads, head_dim, variant, itemsize,
                                                  RESCALE_TILE_PARTIALS, lse_layout)
    stride_lse_n, stride_lse_h, stride_lse_t = checks.lses_strides(lses, lse_layout, num_partials, num_heads,
                                                                   num_tokens)
    olse_strides = (0, 0) if output_lse is None else checks.lse_ht_strides("merged_lse", output_lse, lse_layout,
                                                                           num_heads, num_tokens)
    return plans.kernel_launch(
        grid=tiles.merge_grid("triton", num_tokens, num_heads, head_dim, variant, itemsize, RESCALE_TILE_PARTIALS,
                              lse_layout),
        ints=(*scaled.stride(), *partial_output.stride(), *olse_strides, stride_lse_n, stride_lse_h, stride_lse_t,
              cus.stride(0) if fused else 0, num_tokens),
        constexprs=dict(NUM_PARTIALS=num_partials, NUM_HEADS=num_heads, HEAD_DIM=head_dim, HEADS_PER_GROUP=heads,
                        BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_D=block_d,
                        SCAN=tiles.SCAN, N_INTERPRET=_backend.n_interpret(max(params.num_requests, 0) + 1),
                        LSE_BASE2=params.base2, OUTPUT_LSE=output_lse is not None, FUSED_MASK=fused,
                        INTERPRET=_backend.interpreting(),
                        **plans.n_way_loops(variant, num_partials, weighted_sum=False),
                        num_warps=tiles.merge_num_warps("triton", variant, RESCALE_TILE_PARTIALS, lse_layout),
                        **_backend.PARITY_LAUNCH),
        state=launcher.launch_state(key))
