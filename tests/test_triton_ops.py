"""triton_impl.ops: the torch.library ops `torch.ops.mla_lse_merge.*` (opcheck, torch.compile, CUDA graphs).

Each op must behave as the plain function of the same name: the same bits, the same writes (declared in the
schema, which torch.library.opcheck verifies), traceable by torch.compile(fullgraph=True), capturable in a
CUDA graph. Runs in the process's Triton mode (conftest).
"""

import numpy as np
import pytest
import torch

import triton_impl
from parity.library import bridge
from parity.harness import cases
from parity.library.compare import assert_bitwise_equal

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
OPS = torch.ops.mla_lse_merge
CASE = cases.by_name("upstream_vector")  # T = 134, H = 4, D = 64, fp32, one empty request
CASE_N = cases.by_name("n3_fp16_th_specials")


def _inputs(case=CASE):
    inp = (cases.make_inputs_n if case.n_way else cases.make_inputs)(case)
    return {k: bridge.to_torch(v, DEVICE) for k, v in inp.items()}


def _merge_args(t, output_lse=True):
    T, H, D = CASE.num_tokens, CASE.num_heads, CASE.head_dim
    out = torch.empty(T, H, D, device=DEVICE)
    olse = torch.empty_like(t["suffix_lse"]) if output_lse else None
    return (out, t["prefix_output"], t["prefix_lse"], t["suffix_output"], t["suffix_lse"], olse, 100, None)


def test_the_ops_are_registered_with_the_functions_arguments():
    import inspect

    for name in ("mask_empty_context_lse", "merge_attn_states", "merge_attn_states_n"):
        schema = getattr(OPS, name).default._schema
        args = [a.name for a in schema.arguments]
        params = list(inspect.signature(getattr(triton_impl, name)).parameters)
        assert args == params, (name, args, params)
        mutable = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
        assert mutable == {"mask_empty_context_lse": {"lse", "output"},
                           "merge_attn_states": {"output", "output_lse", "output_group_scale", "output_block_scale"},
                           "merge_attn_states_n": {"output", "output_lse", "output_group_scale",
                                                   "output_block_scale"}}[name]


@pytest.mark.parametrize("fused,output_lse", [(True, True), (False, True), (True, False)])
def test_opcheck_merge(fused, output_lse):
    t = _inputs()
    kw = dict(query_start_loc=t["query_start_loc"], prefix_cu_seq_lens=t["cu_seq_lens"]) if fused else {}
    torch.library.opcheck(OPS.merge_attn_states.default, _merge_args(t, output_lse), kw)


@pytest.mark.parametrize("with_output", [True, False])
def test_opcheck_mask(with_output):
    t = _inputs()
    out = t["prefix_output"].clone() if with_output else None
    torch.library.opcheck(OPS.mask_empty_context_lse.default,
                          (t["prefix_lse"].clone(), t["query_start_loc"], t["cu_seq_lens"], out), {"has_empty": True})


def test_opcheck_merge_n():
    t = _inputs(CASE_N)
    T, H, D = CASE_N.num_tokens, CASE_N.num_heads, CASE_N.head_dim
    out = torch.empty(T, H, D, dtype=torch.float16, device=DEVICE)
    olse = torch.empty(T, H, device=DEVICE)
    torch.library.opcheck(OPS.merge_attn_states_n.default, (out, t["outputs"][..., :D], t["lses"], olse, None, None),
                          dict(query_start_loc=t["query_start_loc"], cu_seq_lens=t["cu_seq_lens"], lse_layout="TH"))


def _pipeline(call_mask, call_merge, t):
    """Mask the prefix, then merge it: the chunk loop's two steps, through `call_*`."""
    lse, out = t["prefix_lse"].clone(), t["prefix_output"].clone()
    call_mask(lse, t["query_start_loc"], t["cu_seq_lens"], out)
    merged = _merge_args(t)
    call_merge(merged[0], out, lse, *merged[3:])
    return merged[0], merged[5]


def test_ops_give_the_functions_bits():
    t = _inputs()
    want = _pipeline(triton_impl.mask_empty_context_lse, triton_impl.merge_attn_states, t)
    got = _pipeline(OPS.mask_empty_context_lse, OPS.merge_attn_states, t)
    for g, w, name in zip(got, want, ("out", "lse")):
        assert_bitwise_equal(g, w, name=f"torch.ops merge.{name}", case=CASE)


def test_torch_compile_fullgraph_through_the_ops():
    t = _inputs()
    want = _pipeline(triton_impl.mask_empty_context_lse, triton_impl.merge_attn_states, t)

    def step(lse, out, a, p, b, s, qsl, cu, merged, merged_lse):
        OPS.mask_empty_context_lse(lse, qsl, cu, out)
        OPS.merge_attn_states(merged, out, lse, b, s, merged_lse, 100, None)
        return merged * 1.0, merged_lse + 0.0  # reads after the in-place writes: compile must order them

    # On the CPU aot_eager: the functionalisation that orders the in-place ops is AOTAutograd's; inductor's codegen
    # of the CPU graph around the interpreted kernels costs 15 s and is tested on the GPU (test_triton_host.py).
    compiled = torch.compile(step, fullgraph=True, backend="inductor" if torch.cuda.is_available() else "aot_eager")
    merged = _merge_args(t)
    got = compiled(t["prefix_lse"].clone(), t["prefix_output"].clone(), t["prefix_output"], t["prefix_lse"],
                   t["suffix_output"], t["suffix_lse"], t["query_start_loc"], t["cu_seq_lens"], merged[0], merged[5])
    for g, w, name in zip(got, want, ("out", "lse")):
        assert_bitwise_equal(g, w, name=f"compiled merge.{name}", case=CASE)
    assert_bitwise_equal(merged[0], want[0], name="compiled merge.out, the written buffer", case=CASE)


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay():
    # Capture the mask and the merge (plain functions and ops), replay on new inputs copied into the captured
    # buffers: the replay gives the eager bits of the new inputs.
    t = _inputs()
    static = {k: v.clone() for k, v in t.items()}
    lse, out = static["prefix_lse"].clone(), static["prefix_output"].clone()
    merged = _merge_args(static)
    for _ in range(2):  # warm up (compile) outside the capture
        OPS.mask_empty_context_lse(lse, static["query_start_loc"], static["cu_seq_lens"], out)
        OPS.merge_attn_states(merged[0], out, lse, *merged[3:])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lse.copy_(static["prefix_lse"])
        out.copy_(static["prefix_output"])
        OPS.mask_empty_context_lse(lse, static["query_start_loc"], static["cu_seq_lens"], out)
        OPS.merge_attn_states(merged[0], out, lse, *merged[3:])
    rng = np.random.default_rng(7)
    new = {k: v for k, v in t.items()}
    new["suffix_output"] = torch.from_numpy(rng.standard_normal(tuple(t["suffix_output"].shape), dtype=np.float32)).to(DEVICE)
    for k in ("prefix_lse", "prefix_output", "suffix_output", "suffix_lse"):
        static[k].copy_(new[k])
    graph.replay()
    torch.cuda.synchronize()
    want = _pipeline(triton_impl.mask_empty_context_lse, triton_impl.merge_attn_states, new)
    assert_bitwise_equal(merged[0], want[0], name="graph replay merge.out", case=CASE)
    assert_bitwise_equal(merged[5], want[1], name="graph replay merge.lse", case=CASE)


def test_ops_reject_bad_input_like_the_functions():
    t = _inputs()
    args = list(_merge_args(t))
    args[0] = torch.zeros(1, CASE.num_heads, CASE.head_dim, device=DEVICE).expand(CASE.num_tokens, -1, -1)
    with pytest.raises(ValueError, match="output has elements that share memory"):
        OPS.merge_attn_states(*args)
