"""triton_impl.merge_attn_states_n: what only the Triton kernel has (docs/spec.md 8).

The behaviour every implementation shares (the reference on the workloads, pass-through copies, N = 2, properties,
shared errors) is tested once in tests/test_op_merge_n.py. Here: strided partials, torch-only arguments and the
compile keys. Runs in the process's Triton mode (conftest): the interpreter on CPU, compiled on a GPU.
"""

import dataclasses

import pytest
import torch
from triton_keys import Recorder, assert_one_variant, kernel_params

import triton_impl
from parity.library import bridge
from parity.harness import cases, impls
from parity.library.compare import assert_bitwise_equal
from triton_impl import _backend as triton_backend
from triton_impl import _plans as triton_plans
from triton_impl import merge_n as merge_n_mod

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn


def _inputs(case, seed=0):
    inp = cases.make_inputs_n(case, seed)
    inp["masked_lses"] = impls.masked_lses(case, inp)
    return inp, {k: bridge.to_torch(v, DEVICE) for k, v in inp.items()}


def _run(case, t, *, fused=True, output_lse=True, ptwc=None, lses=None, outputs=None, out=None):
    """The public API on a case's torch inputs into NaN-poisoned buffers; returns (out, out_lse)."""
    T, H, D = case.num_tokens, case.num_heads, case.head_dim
    outputs = t["outputs"][..., :D] if outputs is None else outputs
    lses = t["lses"] if lses is None else lses
    dtype = FP8 if case.out_dtype else outputs.dtype
    if out is None:
        out = torch.full((T, H, D), float("nan"), device=DEVICE).to(dtype)
    out_lse = torch.full(tuple(lses.shape[1:]), float("nan"), device=DEVICE) if output_lse else None
    kw = dict(query_start_loc=t["query_start_loc"], cu_seq_lens=t["cu_seq_lens"]) if fused else {}
    triton_impl.merge_attn_states_n(out, outputs, lses, out_lse, ptwc, t.get("output_scale"),
                                    lse_layout=case.lse_layout, lse_base=case.lse_base, **kw)
    return out, out_lse


def test_strided_partials_equal_contiguous():
    # A [T, N, H, D] gather viewed as [N, T, H, D], a V-padded buffer and [N, T, H] LSEs viewed as [N, H, T]:
    # the same bits as contiguous inputs.
    case = dataclasses.replace(cases.by_name("n4_bf16_d512_base2_strided"), strided=False)
    _, t = _inputs(case)
    D = case.head_dim
    contiguous = _run(case, t, outputs=t["outputs"][..., :D].contiguous())
    outputs = t["outputs"].transpose(0, 1).contiguous().transpose(0, 1)[..., :D]
    lses = t["lses"].transpose(1, 2).contiguous().transpose(1, 2)
    assert outputs.stride() != t["outputs"][..., :D].contiguous().stride() and not lses.is_contiguous()
    strided = _run(case, t, outputs=outputs, lses=lses)
    for got, want, name in zip(strided, contiguous, ("out", "lse")):
        assert_bitwise_equal(got, want, name=f"merge_n.{name} strided vs contiguous", case=case)


# --------------------------------------------------------------------------------------------------------
# No recompilation


@pytest.mark.parametrize("lse_layout", ["HT", "TH"])
def test_runtime_values_are_not_specialised(lse_layout):
    names, constexprs, dns, _ = kernel_params(merge_n_mod._merge_attn_states_n_kernel[lse_layout])
    runtime = {"prefill_tokens_with_context", "num_tokens", "num_requests", "stride_lse_n", "stride_cu_n"}
    if lse_layout == "HT":  # the head strides are T
        runtime |= {"stride_lse_h", "stride_olse_h"}
    assert runtime <= set(names) and not runtime & constexprs
    assert runtime <= dns, f"{runtime - dns} would be specialised (a recompile when they hit 1 or 16k)"
    assert "NUM_PARTIALS" in constexprs  # fixed by the deployment (the context-parallel group size)


@pytest.mark.parametrize("lse_layout", ["HT", "TH"])
def test_one_compiled_variant_across_token_counts(monkeypatch, lse_layout):
    # New token counts (T = 1 and multiples of 16 included) have the same specialisation key: one compiled
    # kernel. [H, T]: head strides (= T) and the partial stride (T * H) runtime; [T, H]: every LSE head and token
    # stride specialised (1 and H = 4), the partial stride runtime. The kernel is replaced by a recorder.
    recorder = Recorder(merge_n_mod._merge_attn_states_n_kernel)
    monkeypatch.setattr(merge_n_mod, "_merge_attn_states_n_kernel", recorder)
    monkeypatch.setattr(triton_backend, "interpreting", lambda: False)  # record the compiled launch arguments
    monkeypatch.setattr(triton_backend, "triton_runs_on", lambda device: True)
    monkeypatch.setattr(triton_plans, "PLANS", {})
    N, H, D = 3, 4, 64
    token_counts = (1, 5, 16, 37, 48, 100)
    for T in token_counts:
        lse_shape = (H, T) if lse_layout == "HT" else (T, H)
        out, outs = torch.zeros(T, H, D, device=DEVICE), torch.zeros(N, T, H, D, device=DEVICE)
        lses, out_lse = torch.zeros(N, *lse_shape, device=DEVICE), torch.zeros(*lse_shape, device=DEVICE)
        triton_impl.merge_attn_states_n(out, outs, lses, out_lse, lse_layout=lse_layout)
    assert len(recorder[lse_layout].launches) == len(token_counts)
    keys = recorder[lse_layout].keys()
    assert_one_variant(keys, "merge_n")
    head, token = ("i32", None), ("constexpr", 1)
    if lse_layout == "TH":
        head, token = ("constexpr", 1), ("i32", "")
    want = dict(stride_lse_h=head, stride_olse_h=head, stride_lse_t=token, stride_olse_t=token,
                stride_lse_n=("i32", None))
    assert {k: keys[0][k] for k in want} == want


@pytest.mark.gpu
@pytest.mark.parametrize("lse_layout", ["HT", "TH"])
def test_no_recompilation_across_batches(lse_layout):
    kernel = merge_n_mod._merge_attn_states_n_kernel[lse_layout]
    base = dataclasses.replace(cases.by_name("n4_bf16_fp8_out"), lse_layout=lse_layout)

    def launch(query_lens, contexts, ptwc):
        case = dataclasses.replace(base, query_lens=query_lens, context_lens=contexts)
        _, t = _inputs(case)
        _run(case, t, ptwc=ptwc)

    launch((24, 16, 3), (1, 20, 6), 30)
    cache = kernel.device_caches[torch.cuda.current_device()][0]
    n = len(cache)
    for query_lens, contexts, ptwc in [((24, 16, 3), (0, 2, 6), 0), ((13,), (40,), 1), ((1, 2, 3, 4, 5),
                                       (0, 1, 2, 3, 4), 16), ((64, 61), (9, 9), 125), ((48,), (0,), None)]:
        launch(query_lens, contexts, ptwc)
    assert len(cache) == n, f"the N-way kernel compiled {len(cache) - n} more variants for new runtime values"


# --------------------------------------------------------------------------------------------------------
# Errors


def _valid(N=3, T=6, H=2, D=8, dtype=torch.bfloat16):
    return dict(output=torch.zeros(T, H, D, dtype=dtype, device=DEVICE),
                outputs=torch.zeros(N, T, H, D, dtype=dtype, device=DEVICE),
                lses=torch.zeros(N, H, T, device=DEVICE), output_lse=torch.zeros(H, T, device=DEVICE),
                prefill_tokens_with_context=None, output_scale=None)


POSITIONAL = ("output", "outputs", "lses", "output_lse", "prefill_tokens_with_context", "output_scale")
I32 = dict(dtype=torch.int32, device=DEVICE)
QSL = torch.tensor([0, 2, 6], **I32)
CU = torch.tensor([[0, 0, 3], [0, 1, 2], [0, 0, 0]], **I32)


def _call(**changes):
    kw = _valid()
    kw.update(changes)
    args = [kw.pop(k) for k in POSITIONAL]
    triton_impl.merge_attn_states_n(*args, **kw)


# The errors every implementation shares (ranks, dtypes, N, offsets, layouts, validate=True) are in
# test_op_merge_n.py; these are torch's: the output buffers, tensors, devices and memory shared between elements.
TORCH_ERRORS = [
    ("output_shape", dict(output=torch.zeros(6, 2, 16, dtype=torch.bfloat16, device=DEVICE)), ValueError,
     "output.shape"),
    ("output_dtype", dict(output=torch.zeros(6, 2, 8, dtype=torch.float64, device=DEVICE)), TypeError, "output.dtype"),
    ("output_lse_shape", dict(output_lse=torch.zeros(2, 5, device=DEVICE)), ValueError, "output_lse.shape"),
    ("output_expanded", dict(output=torch.zeros(1, 2, 8, dtype=torch.bfloat16, device=DEVICE).expand(6, 2, 8)),
     ValueError, "output has elements that share memory"),
    ("output_lse_expanded", dict(output_lse=torch.zeros(2, 1, device=DEVICE).expand(2, 6)), ValueError,
     "output_lse has elements that share memory"),
    ("ptwc_tensor", dict(prefill_tokens_with_context=torch.tensor(3)), TypeError, "host int"),
    ("lses_other_device", dict(lses=torch.zeros(3, 2, 6, device="meta")), ValueError, "meta"),
]


@pytest.mark.parametrize("changes,error,match", [e[1:] for e in TORCH_ERRORS], ids=[e[0] for e in TORCH_ERRORS])
def test_torch_argument_errors(changes, error, match):
    with pytest.raises(error, match=match):
        _call(**changes)
