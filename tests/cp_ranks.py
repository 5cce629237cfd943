"""Test helper: the context-parallel combine of `triton_impl` on 4 gloo ranks (spawned processes), run once per
test process (`results()`) for tests/test_op_cp_merge.py and tests/test_triton_cp_merge.py.

Each rank holds one partial of an N-way case (its KV shard: partials empty for some requests, NaN garbage under
finite LSEs) and its own KV offsets; one spawn runs every scenario (`worker`): both methods on a bf16 and an fp8
case, per-group FP8 and NVFP4 (both block-scale layouts), a bf16 reduction, errors every rank finds alone, and
validate=True across disagreeing ranks.
"""

import dataclasses
import functools

import torch

import triton_impl
from parity.harness import cases, impls
from parity.library import bridge
from parity.tools import ranks

WORLD = 4
CASE = cases.by_name("n4_bf16_fp8_out")  # N = 4, H = 4, R = 3, bf16, specials, partials without KV
CASE_BF16 = dataclasses.replace(CASE, out_dtype=None, prefill_tokens_with_context=30)
CASE_GROUP = cases.by_name("n4_bf16_group_fp8_g128_ue8m0")  # per-group FP8 (docs/spec.md 4.7), H = 4, D = 128
# NVFP4 (4.8) on the same partials; make_inputs_n gives its global scale as output_scale
CASE_NVFP4 = dataclasses.replace(CASE_GROUP, out_dtype="float4_e2m1fn", group_size=None, scale_ue8m0=False)
H, D, T = CASE.num_heads, CASE.head_dim, CASE.num_tokens


def _local(case, rank):
    inp = cases.make_inputs_n(case)
    t = {k: bridge.to_torch(v) for k, v in inp.items()}
    return t["outputs"][rank, ..., :D], t["lses"][rank], t["query_start_loc"], t["cu_seq_lens"][rank], t


def _combine(case, rank, world, group, method, **kw):
    part, lse, qsl, cu, t = _local(case, rank)
    heads = H if method == "gather" else H // world
    dtype = torch.float8_e4m3fn if case.out_dtype else part.dtype
    out = torch.full((T, heads, D), float("nan")).to(dtype)
    out_lse = torch.full((heads, T), float("nan"))
    triton_impl.cp_merge_attn_states(out, part, lse, group, out_lse, case.prefill_tokens_with_context,
                                     t.get("output_scale"), method=method, query_start_loc=qsl, cu_seq_lens=cu, **kw)
    return bridge.to_numpy(out), bridge.to_numpy(out_lse)


def _combine_group(rank, world, group, method):
    """The per-group FP8 combine of CASE_GROUP: this rank's (fp8 bits, scales f32[T, heads * D / G])."""
    case = CASE_GROUP
    inp = cases.make_inputs_n(case)
    t = {k: bridge.to_torch(v) for k, v in inp.items()}
    heads, d = case.num_heads if method == "gather" else case.num_heads // world, case.head_dim
    out = torch.full((case.num_tokens, heads, d), float("nan")).to(torch.float8_e4m3fn)
    scales = torch.full((case.num_tokens, heads * d // case.group_size), float("nan"))
    triton_impl.cp_merge_attn_states(out, t["outputs"][rank], t["lses"][rank], group, None,
                                     case.prefill_tokens_with_context, method=method,
                                     query_start_loc=t["query_start_loc"], cu_seq_lens=t["cu_seq_lens"][rank],
                                     group_size=case.group_size, output_group_scale=scales,
                                     scale_ue8m0=case.scale_ue8m0)
    return bridge.to_numpy(out.view(torch.uint8)), bridge.to_numpy(scales)


def _combine_nvfp4(rank, world, group, method, scale_layout="row"):
    """The NVFP4 combine of CASE_NVFP4: this rank's (packed codes u8[T, heads, D / 2], block scales' bytes)."""
    case = CASE_NVFP4
    t = {k: bridge.to_torch(v) for k, v in cases.make_inputs_n(case).items()}
    heads, d = case.num_heads if method == "gather" else case.num_heads // world, case.head_dim
    out = torch.full((case.num_tokens, heads, d // 2), 0xAB, dtype=torch.uint8)
    blocks = heads * d // 16
    shape = (case.num_tokens, blocks) if scale_layout == "row" else (-(-case.num_tokens // 128) * 128 * blocks,)
    scales = torch.full(shape, 0x38, dtype=torch.uint8).view(torch.float8_e4m3fn)
    triton_impl.cp_merge_attn_states(out, t["outputs"][rank], t["lses"][rank], group, None,
                                     case.prefill_tokens_with_context, t["output_scale"], method=method,
                                     query_start_loc=t["query_start_loc"], cu_seq_lens=t["cu_seq_lens"][rank],
                                     output_block_scale=scales, scale_layout=scale_layout)
    return bridge.to_numpy(out), bridge.to_numpy(scales.view(torch.uint8))


def _error(fn):
    try:
        fn()
    except (TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def worker(rank, world, group):
    got = {}
    for name, case in (("bf16", CASE_BF16), ("fp8", CASE)):
        for method in ("gather", "reduce_scatter"):
            got[f"{name}_{method}"] = _combine(case, rank, world, group, method)
        # The single-process N-way merge, run like the ranks' kernels (Triton's interpreter on CPU tensors).
        got[f"{name}_single"] = _single_process(case) if rank == 0 else None
    got["bf16_reduce_scatter_bf16_reduce"] = _combine(CASE_BF16, rank, world, group, "reduce_scatter",
                                                      reduce_dtype=torch.bfloat16)
    # The torch path (implementation="torch"): the same scenarios, keys prefixed "torch_".
    for name, case in (("bf16", CASE_BF16), ("fp8", CASE)):
        for method in ("gather", "reduce_scatter"):
            got[f"torch_{name}_{method}"] = _combine(case, rank, world, group, method, implementation="torch")
        got[f"torch_{name}_single"] = _single_process(case, "torch") if rank == 0 else None
    got["torch_bf16_reduce_scatter_bf16_reduce"] = _combine(CASE_BF16, rank, world, group, "reduce_scatter",
                                                            reduce_dtype=torch.bfloat16, implementation="torch")
    for method in ("gather", "reduce_scatter"):
        got[f"group_{method}"] = _combine_group(rank, world, group, method)
        for layout in ("row", "swizzled"):
            got[f"nvfp4_{method}_{layout}"] = _combine_nvfp4(rank, world, group, method, layout)
    part, lse, qsl, cu, _ = _local(CASE_BF16, rank)
    out = torch.empty(T, H, D, dtype=part.dtype)
    # Errors every rank finds alone, before any collective (all ranks raise: nobody waits in a collective).
    got["err_method"] = _error(lambda: triton_impl.cp_merge_attn_states(out, part, lse, group, method="allreduce"))
    got["err_heads"] = _error(lambda: triton_impl.cp_merge_attn_states(
        torch.empty(T, 1, D, dtype=part.dtype), part[:, :3], lse[:3], group, method="reduce_scatter"))
    got["err_cu_2d"] = _error(lambda: triton_impl.cp_merge_attn_states(
        out, part, lse, group, query_start_loc=qsl, cu_seq_lens=cu[None].expand(world, -1)))
    got["err_out_shape"] = _error(lambda: triton_impl.cp_merge_attn_states(out, part, lse, group, method="reduce_scatter"))
    got["err_group"] = _error(lambda: triton_impl.cp_merge_attn_states(out, part, lse, None))
    got["err_group_size"] = _error(lambda: triton_impl.cp_merge_attn_states(
        torch.empty(T, H, D, dtype=torch.float8_e4m3fn), part, lse, group, group_size=48,
        output_group_scale=torch.empty(T, 1)))
    got["err_nvfp4_shape"] = _error(lambda: triton_impl.cp_merge_attn_states(
        torch.empty(T, H // world, D // 2, dtype=torch.uint8), part, lse, group, None, None, torch.ones(1),
        output_block_scale=torch.empty(T, H * D // 16, dtype=torch.float8_e4m3fn)))  # "gather" writes every head
    # validate=True: inputs that differ between ranks, or a bad input on one rank only: every rank raises.
    bad_part = part.half() if rank == 2 else part
    got["validate_dtype_differs"] = _error(lambda: triton_impl.cp_merge_attn_states(
        torch.empty(T, H, D, dtype=bad_part.dtype), bad_part, lse, group, validate=True))
    bad_cu = cu[:-1] if rank == 1 else cu
    got["validate_one_rank_bad"] = _error(lambda: triton_impl.cp_merge_attn_states(
        out, part, lse, group, query_start_loc=qsl, cu_seq_lens=bad_cu, validate=True))
    got["validate_ok"] = _error(lambda: triton_impl.cp_merge_attn_states(
        out, part, lse, group, query_start_loc=qsl, cu_seq_lens=cu, validate=True))
    return got


def _single_process(case, impl="triton"):
    """The single-process N-way merge of the same partials (Triton, or its torch path): the bits `gather` must
    give."""
    inp = cases.make_inputs_n(case)
    t = {k: bridge.to_torch(v) for k, v in inp.items()}
    r = impls.run(impls.make_runtime(), impl, "merge_n_fused", case, t)
    return inp, bridge.to_numpy(r["out"]), bridge.to_numpy(r["lse"])


@functools.cache
def results() -> list:
    """Every rank's results of `worker` (one spawn per test process)."""
    out = ranks.run_ranks(worker, WORLD)
    for r, res in enumerate(out):
        assert res[0] == "ok", f"rank {r}: {res[1]}\n{res[2]}"
    return [res[1] for res in out]
