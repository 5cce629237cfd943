"""Attention-state merge (docs/spec.md 4), in place: the Triton kernel and its vLLM-compatible host wrapper.

Grid: `(cdiv(T, BLOCK_T) * cdiv(H, BLOCK_H),)`, head blocks fastest; a program merges a [BLOCK_T, BLOCK_H,
BLOCK_D] tile (the whole padded head, then as many heads and tokens as fit in the variant's budget,
`tiles.MERGE_TILES`). The fused mask (docs/spec.md 4.5) finds each token's request with the same two-level
32-wide compare-and-sum as the mask kernel.

Float math (docs/spec.md 5), identical to `pallas_impl/merge.py` in operation order: f32 throughout, exp and log from
libdevice (plain `tl.exp`/`tl.log` under the interpreter, which also gets an exact RNE cast), launched with `enable_fp_fusion=False` and
`enable_reflect_ftz=False`, division with `/`, cast only at the store.
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
from triton_impl._device import (_clean_lse, _exp_base, _merged_lse, _program_tile, _store_group_fp8, _store_nvfp4,
                                 _store_output, _token_requests)


@triton.jit
def _two_way_weights(p, s, LSE_BASE2: tl.constexpr, INTERPRET: tl.constexpr):
    """(m, both_empty, z, wp, ws) of two LSE tiles (base e, or base 2) whose empty rows are -inf (docs/spec.md 4.2,
    4.3): m is 0 where both are empty, z = e_p + e_s."""
    m = tl.maximum(p, s)
    both_empty = m == float("-inf")
    m = tl.where(both_empty, 0.0, m)
    pe = _exp_base(p - m, LSE_BASE2, INTERPRET)
    se = _exp_base(s - m, LSE_BASE2, INTERPRET)
    z = pe + se
    return m, both_empty, z, pe / z, se / z


# Runtime values, never specialised: token counts, offsets and, in [H, T] layout, the LSE head strides (= T).
# The other LSE strides stay specialised (the unit stride of either layout, and H in [T, H]): that vectorises the
# LSE accesses.
@_backend.jit_per_lse_layout(runtime=["num_tokens", "prefill_tokens_with_context", "num_requests", "stride_gs_t",
                                      "stride_gs_g"],
                      lse_head_strides=["stride_olse_h", "stride_plse_h", "stride_slse_h"])
def _merge_attn_states_kernel(
    out_ptr,  # dtype[T, H, D] (or fp8) via (stride_out_t, stride_out_h, stride_out_d)
    out_lse_ptr,  # f32[H, T] via (stride_olse_h, stride_olse_t); unused unless OUTPUT_LSE
    prefix_ptr,  # dtype[T, H, D] via (stride_p_t, stride_p_h, stride_p_d)
    prefix_lse_ptr,  # f32[H, T] via (stride_plse_h, stride_plse_t)
    suffix_ptr,  # dtype[T, H, D] via (stride_s_t, stride_s_h, stride_s_d)
    suffix_lse_ptr,  # f32[H, T] via (stride_slse_h, stride_slse_t)
    scale_ptr,  # f32[1] output scale (NVFP4: the global scale); unused unless FP8_OUT or NVFP4
    gs_ptr,  # per-group f32 scales or NVFP4's e4m3 block scales [T, H * D / G] via (stride_gs_t, stride_gs_g)
    qsl_ptr,  # i32[R+1] query_start_loc; unused unless FUSED_MASK
    cu_ptr,  # i32[R+1] the prefix chunk's cu_seq_lens; unused unless FUSED_MASK
    stride_out_t, stride_out_h, stride_out_d,
    stride_p_t, stride_p_h, stride_p_d,
    stride_s_t, stride_s_h, stride_s_d,
    stride_olse_h, stride_olse_t,
    stride_plse_h, stride_plse_t,
    stride_slse_h, stride_slse_t,
    stride_gs_t, stride_gs_g,
    num_tokens,  # T
    prefill_tokens_with_context,  # tokens at or past it are suffix copies (docs/spec.md 4.4); runtime value
    num_requests,  # R; runtime value
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    SCAN: tl.constexpr, N_INTERPRET: tl.constexpr,
    LSE_BASE2: tl.constexpr, OUTPUT_LSE: tl.constexpr, FUSED_MASK: tl.constexpr, FP8_OUT: tl.constexpr,
    GROUP_SIZE: tl.constexpr, UE8M0: tl.constexpr, NVFP4: tl.constexpr, SWIZZLED: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    t, t_mask, th_mask, thd_mask, t64, h64, d64 = _program_tile(num_tokens, NUM_HEADS, HEAD_DIM, BLOCK_T, BLOCK_H,
                                                                  BLOCK_D)

    # Issue every load first: the fused-mask scan below overlaps their latency.
    p_raw = tl.load(prefix_lse_ptr + h64 * stride_plse_h + t64 * stride_plse_t, mask=th_mask, other=float("-inf"))
    s_raw = tl.load(suffix_lse_ptr + h64 * stride_slse_h + t64 * stride_slse_t, mask=th_mask, other=float("-inf"))
    a = tl.load(prefix_ptr + t64[:, :, None] * stride_p_t + h64[:, :, None] * stride_p_h + d64 * stride_p_d,
                mask=thd_mask, other=0.0)
    b = tl.load(suffix_ptr + t64[:, :, None] * stride_s_t + h64[:, :, None] * stride_s_h + d64 * stride_s_d,
                mask=thd_mask, other=0.0)

    # docs/spec.md 4.1: +inf (FA2's empty row) and NaN read as -inf; a base-2 LSE stays base 2.
    p = _clean_lse(p_raw)
    s = _clean_lse(s_raw)
    if FUSED_MASK:  # docs/spec.md 4.5: a token of a request whose prefix chunk is empty has p = -inf
        req, in_req = _token_requests(qsl_ptr, t, t_mask, num_requests, SCAN, N_INTERPRET, FUSED_MASK)
        empty_t = in_req & (tl.load(cu_ptr + req + 1) == tl.load(cu_ptr + req))
        p = tl.where(empty_t[:, None], float("-inf"), p)

    m, both_empty, z, wp, ws = _two_way_weights(p, s, LSE_BASE2, INTERPRET)
    # docs/spec.md 4.3: a zero weight gives exactly 0, so NaN in an empty partial cannot leak.
    out = (tl.where(wp[:, :, None] > 0.0, a.to(tl.float32) * wp[:, :, None], 0.0)
           + tl.where(ws[:, :, None] > 0.0, b.to(tl.float32) * ws[:, :, None], 0.0))
    out = tl.where(both_empty[:, :, None], 0.0, out)
    copy_t = t >= prefill_tokens_with_context  # docs/spec.md 4.4
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
        lse = _merged_lse(z, m, both_empty, copy_t, s_raw, LSE_BASE2, INTERPRET)
        tl.store(out_lse_ptr + h64 * stride_olse_h + t64 * stride_olse_t, lse, mask=th_mask)


def merge_attn_states(output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse=None,
                      prefill_tokens_with_context=None, output_scale=None, *, query_start_loc=None,
                      prefix_cu_seq_lens=None, lse_layout="HT", lse_base=math.e, group_size=None,
                      output_group_scale=None, scale_ue8m0=False, output_block_scale=None, scale_layout="row",
                      implementation=None, validate=False) -> None:
    """Merge two attention partials by their LSEs (docs/spec.md 4), vLLM's positional signature, in place.

    Args:
      output: f32/f16/bf16[T, H, D], any of them whatever the partials' dtype (one rounding at the store), or
        float8_e4m3fn with output_scale; any strides. Written in place.
      prefix_output, suffix_output: dtype[T, H, D], fp32/fp16/bf16, each with its own strides (a V-padded
        [T, H, 192] buffer sliced to [..., :128] works).
      prefix_lse, suffix_lse: f32[H, T] ([T, H] with lse_layout="TH"), any strides; natural log unless
        lse_base=2. +inf and NaN mean an empty partial.
      output_lse: optional f32 LSE of the merge, same layout and base. Written in place.
      prefill_tokens_with_context: int or None (= T). Tokens at or past it copy the suffix row and LSE
        bits. A runtime value: changing it never recompiles.
      output_scale: f32[1] tensor, required for (and only for) an fp8 output.
      query_start_loc, prefix_cu_seq_lens: i32[R+1] both or neither: the fused mask (docs/spec.md 4.5), treating
        the prefix of every request whose prefix chunk is empty as empty.
      lse_layout: "HT" or "TH", for all three LSEs.
      lse_base: math.e or 2, for all three LSEs.
      group_size: per-group FP8 (docs/spec.md 4.7): a float8_e4m3fn output quantized per group of group_size
        elements of each head row (a power of two from 16 dividing D, D a power of two), its f32 scales written
        to output_group_scale; output_scale must then be None.
      output_group_scale: f32[T, H * D / group_size], any strides: row-major, or a column-major buffer
        [H * D / group_size, T or T padded] viewed as `buf[:, :T].t()` (DeepGEMM's TMA-aligned layout). Written
        in place.
      scale_ue8m0: the per-group scales rounded up to powers of two (DeepGEMM's UE8M0).
      output_block_scale: NVFP4 output (docs/spec.md 4.8): `output` is u8[T, H, D / 2] (two e2m1 codes a byte, D a
        power of two from 16), `output_scale` the f32[1] global scale, and the e4m3 block scales are written here:
        float8_e4m3fn [T, H * D / 16] with any strides, or with scale_layout="swizzled" a contiguous buffer of the
        FP4 GEMMs' 128x4-swizzled layout (T padded to 128, H * D / 16 to 4; its padding left as it is).
      scale_layout: "row" or "swizzled", NVFP4's block scales' layout.
      implementation: None (the Triton kernel where Triton has a driver for the tensors' device, else the torch
        path), "triton" or "torch" (`triton_impl/torch_fallback.py`: any device torch runs on). Never falls back.
      validate: also check offset values and prefill_tokens_with_context (reads offsets: a device sync).

    Raises:
      TypeError: a tensor of the wrong dtype.
      ValueError: wrong ranks or shapes, different devices, mismatched offsets, bad options.
      NotImplementedError: a group size (or NVFP4) the kernels do not take for this head dim;
        implementation="triton" on a device Triton does not compile for.
    """
    scales = output_group_scale if output_block_scale is None else output_block_scale  # the kernel's one slot
    key, plan = (None, None) if validate else plans.find_plan(
        "merge", (output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse, output_scale,
                  query_start_loc, prefix_cu_seq_lens, output_group_scale, output_block_scale),
        (lse_layout, lse_base, group_size, scale_ue8m0, scale_layout, implementation))
    if plan is not None:  # every metadata check passed for this signature: the per-call ones only
        overlaps, num_tokens, launch = plan
        if not checks.partial_overlap(overlaps, dict(output=output, output_lse=output_lse, prefix_output=prefix_output,
                                                     prefix_lse=prefix_lse, suffix_output=suffix_output,
                                                     suffix_lse=suffix_lse, output_group_scale=output_group_scale,
                                                     output_block_scale=output_block_scale)):
            prefill_tokens = num_tokens if prefill_tokens_with_context is None else checks.check_prefill_tokens(
                prefill_tokens_with_context, num_tokens, False)
            if launch is not None:
                _launch(launch, output, output_lse, prefix_output, prefix_lse, suffix_output, suffix_lse, output_scale,
                        query_start_loc, prefix_cu_seq_lens, prefill_tokens, lse_layout, scales)
            return
        # an overlap: the checked path below raises its error

    checks.check_lse_layout(lse_layout)
    base2 = checks.check_lse_base(lse_base)
    checks.check_tensor("prefix_output", prefix_output, ndim=3, dtypes=checks.OUTPUT_DTYPES)
    device = prefix_output.device
    num_tokens, num_heads, head_dim = prefix_output.shape
    checks.check_tensor("suffix_output", suffix_output, ndim=3, dtypes=(prefix_output.dtype,), device=device)
    if suffix_output.shape != prefix_output.shape:
        raise ValueError(f"suffix_output must match prefix_output [T, H, D]; got suffix_output.shape="
                         f"{tuple(suffix_output.shape)}, prefix_output.shape={tuple(prefix_output.shape)}")
    fp8, gs_strides, gs_overlaps = checks.check_outputs(
        output, prefix_output, output_scale, group_size, output_group_scale, scale_ue8m0,
        reads=dict(prefix_output=prefix_output, suffix_output=suffix_output, prefix_lse=prefix_lse,
                   suffix_lse=suffix_lse, output_lse=output_lse),
        output_block_scale=output_block_scale, scale_layout=scale_layout)
    lse_strides = []  # (h, t) strides in the kernel's order: output_lse, prefix_lse, suffix_lse
    for name, x in (("output_lse", output_lse), ("prefix_lse", prefix_lse), ("suffix_lse", suffix_lse)):
        if x is None:
            lse_strides += [0, 0]
            continue
        checks.check_tensor(name, x, ndim=2, dtypes=(torch.float32,), device=device)
        lse_strides += checks.lse_ht_strides(name, x, lse_layout, num_heads, num_tokens)
    lse_overlaps = ()
    if output_lse is not None:
        checks.check_no_internal_overlap("output_lse", output_lse)
        lse_overlaps = checks.check_no_partial_overlap("output_lse", output_lse, prefix_lse=prefix_lse,
                                                       suffix_lse=suffix_lse, output=output)
    out_overlaps = checks.check_no_partial_overlap("output", output, prefix_output=prefix_output,
                                                   suffix_output=suffix_output)
    fused = checks.check_fused_pair(query_start_loc, prefix_cu_seq_lens, "prefix_cu_seq_lens")
    num_requests = 0
    if fused:
        num_requests = checks.check_offsets(query_start_loc, prefix_cu_seq_lens, device, cu_name="prefix_cu_seq_lens")
        fused = num_requests > 0  # no request, nothing to mask
    prefill_tokens = checks.check_prefill_tokens(prefill_tokens_with_context, num_tokens, validate)
    if validate and fused:
        checks.check_offset_values(query_start_loc, prefix_cu_seq_lens, num_tokens, cu_name="prefix_cu_seq_lens")
    impl = _backend.resolve_implementation(implementation, device)
    launch = None
    if num_tokens and num_heads and impl == "torch":
        launch = plans.torch_launch(lse_base2=base2, fused=fused, group_size=group_size, scale_ue8m0=scale_ue8m0,
                                    nvfp4=output_block_scale is not None, scale_layout=scale_layout)
    elif num_tokens and num_heads:
        variant = tiles.merge_variant(output_lse is not None, fused)
        itemsize = prefix_output.element_size()
        block_t, block_h, block_d = tiles.merge_tiles("triton", num_heads, head_dim, variant, itemsize)
        launch = plans.merge_launch(
            grid=tiles.merge_grid("triton", num_tokens, num_heads, head_dim, variant, itemsize), fused=fused,
            ints=(*output.stride(), *prefix_output.stride(), *suffix_output.stride(), *lse_strides, *gs_strides,
                  num_tokens),
            num_requests=num_requests,
            constexprs=dict(NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_D=block_d,
                            SCAN=tiles.SCAN, N_INTERPRET=_backend.n_interpret(num_requests + 1), LSE_BASE2=base2,
                            OUTPUT_LSE=output_lse is not None, FUSED_MASK=fused, FP8_OUT=fp8,
                            GROUP_SIZE=group_size or 0, UE8M0=bool(scale_ue8m0),
                            NVFP4=output_block_scale is not None, SWIZZLED=scale_layout == "swizzled",
                            INTERPRET=_backend.interpreting(), num_warps=tiles.merge_num_warps("triton", variant),
                            **_backend.PARITY_LAUNCH),
            state=launcher.launch_state(key))
    plans.remember(key, plans.plan(overlaps=lse_overlaps + out_overlaps + gs_overlaps, num_tokens=num_tokens,
                                   launch=launch))
    if launch is not None:
        _launch(launch, output, output_lse, prefix_output, prefix_lse, suffix_output, suffix_lse, output_scale,
                query_start_loc, prefix_cu_seq_lens, prefill_tokens, lse_layout, scales)


def _launch(launch, output, output_lse, prefix_output, prefix_lse, suffix_output, suffix_lse, output_scale,
            query_start_loc, prefix_cu_seq_lens, prefill_tokens, lse_layout, output_group_scale=None) -> None:
    """The kernel launch of a plan's `merge_launch`, or the torch path's (`plans.torch_launch`)."""
    if launch[0] is plans.TORCH:
        options = launch[1]
        fused = options["fused"]
        torch_fallback.merge_attn_states(
            output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse, prefill_tokens,
            query_start_loc if fused else None, prefix_cu_seq_lens if fused else None, lse_layout=lse_layout,
            lse_base2=options["lse_base2"], **torch_fallback.store_options(options, output_scale, output_group_scale))
        return
    grid, fused, ints, num_requests, constexprs, state = launch
    placeholder = prefix_lse  # for the pointers a variant does not read
    launcher.launch(_merge_attn_states_kernel[lse_layout], grid, (
        output, placeholder if output_lse is None else output_lse, prefix_output, prefix_lse, suffix_output, suffix_lse,
        placeholder if output_scale is None else output_scale,
        placeholder if output_group_scale is None else output_group_scale,
        query_start_loc if fused else placeholder, prefix_cu_seq_lens if fused else placeholder,
        *ints, prefill_tokens, num_requests), constexprs, state)
