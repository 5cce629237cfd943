"""triton_impl's torch path (`implementation="torch"`, triton_impl/torch_fallback.py) beyond the per-op suites (which
run it on every case as the implementation "torch"): what `implementation=None` picks where; the bits the spec fixes
equal to the Triton interpreter's (the mask, pass-through copies, NaN and the sign of zero of an fp8 store); the
in-place contract (a merge into its own prefix); torch.compile(fullgraph=True); errors."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import triton_impl
from parity.harness import cases, impls
from parity.library import bridge

ROOT = Path(__file__).resolve().parents[1]
GPU = torch.cuda.is_available()


def test_without_a_triton_driver_none_runs_the_torch_path_and_triton_is_refused():
    """A CPU process without TRITON_INTERPRET (a laptop, a CPU server): every entry point runs with
    implementation=None (the torch path); implementation="triton" says what it needs."""
    if GPU:
        pytest.skip("a CPU machine's behaviour")
    code = textwrap.dedent("""
        import math, torch, triton_impl
        T, H, D = 40, 2, 32
        o = torch.randn(3, T, H, D); l = torch.randn(3, H, T)
        qsl = torch.tensor([0, 10, 30], dtype=torch.int32); cu = torch.tensor([0, 0, 4], dtype=torch.int32)
        lse = l[0].clone(); triton_impl.mask_empty_context_lse(lse, qsl, cu)
        assert (lse[:, :10] == -math.inf).all() and torch.equal(lse[:, 10:], l[0][:, 10:])
        out = torch.empty(T, H, D); ol = torch.empty(H, T)
        triton_impl.merge_attn_states(out, o[0], l[0], o[1], l[1], ol, 35, query_start_loc=qsl, prefix_cu_seq_lens=cu)
        assert torch.equal(out[35:], o[1][35:]) and torch.equal(ol[:, 35:], l[1][:, 35:])
        triton_impl.merge_attn_states_n(out, o, l, ol)
        q = torch.empty(T, H, D, dtype=torch.float8_e4m3fn); s = torch.empty(T, H * D // 16)
        triton_impl.merge_attn_states_n(q, o, l, group_size=16, output_group_scale=s)
        try:
            triton_impl.merge_attn_states(out, o[0], l[0], o[1], l[1], implementation="triton")
        except NotImplementedError as e:
            print("refused:", e)
        print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "refused: implementation='triton' compiles for CUDA or ROCm GPUs" in res.stdout and "TRITON_INTERPRET=1" \
        in res.stdout and res.stdout.strip().endswith("ok")


def bits(x):
    x = np.ascontiguousarray(bridge.to_numpy(x))
    return x.view({4: np.uint32, 2: np.uint16, 1: np.uint8}[x.dtype.itemsize])


def _pair(op, case, impl):
    runtime = impls.make_runtime()
    inputs = cases.make_inputs_n(case) if case.n_way else cases.make_inputs(case)
    arrays = {k: bridge.to_torch(v, runtime.device) if isinstance(v, np.ndarray) else v for k, v in inputs.items()}
    return impls.run(runtime, impl, op, case, arrays)


@pytest.mark.parametrize("name", ["upstream_vector", "specials_th", "padded_v_ptwc", "base2_specials"])
def test_the_mask_is_the_interpreters_bits(name):
    case = cases.by_name(name)
    got, want = _pair("mask", case, "torch"), _pair("mask", case, "triton")
    for key in ("lse", "output_buffer"):
        assert np.array_equal(bits(got[key]), bits(want[key])), key


MERGES = [pytest.param(case, op, id=f"{case.name}-{op}") for case in cases.select("ci", kind="all")
          for op in impls.ops_of(case) if op.startswith("merge")]


@pytest.mark.gpu
@pytest.mark.parametrize("case, op", MERGES)
def test_on_cuda_the_merges_are_the_compiled_kernels_bits(case, op):
    """On a CUDA GPU the torch path divides as the kernels do (`torch_fallback.div`: div.full.f32) and takes
    CUDA's exp and log where the kernels take libdevice's: every output bit of the ci cases' merges the
    compiled Triton kernels'."""
    got, want = _pair(op, case, "torch"), _pair(op, case, "triton")
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert np.array_equal(bits(got[key]), bits(value)), key


def test_an_fp8_quotient_rounding_to_minus_zero_stores_0x80_in_both():
    """docs/spec.md 4.6: a round-to-nearest-even cast keeps the sign of a value rounded to zero (0x80), as the GPU's
    cvt does; the Triton interpreter's exact cast lost it before 2026-12-07."""
    T, H, D = 8, 1, 16
    o = torch.zeros(2, T, H, D)
    o[:, :, :, 0] = -1e-6  # / scale 1: far below e4m3's smallest subnormal (2^-9)
    o[:, :, :, 1] = float("nan")
    o[:, :, :, 2] = 1e-6
    lse = torch.zeros(2, H, T)
    for impl in ("triton", "torch"):
        out = torch.empty(T, H, D, dtype=torch.float8_e4m3fn)
        triton_impl.merge_attn_states_n(out, o, lse, None, None, torch.ones(1), implementation=impl)
        b = out.view(torch.uint8)[:, 0, :3]
        assert (b[:, 0] == 0x80).all() and (b[:, 2] == 0x00).all(), (impl, b[0])
        assert ((b[:, 1] & 0x7F) == 0x7F).all(), (impl, b[0])  # NaN stays NaN


def test_a_merge_into_its_own_prefix_in_place():
    """vLLM's in-place chunk loop: output=prefix_output and output_lse=prefix_lse (the torch path reads everything
    before it writes)."""
    T, H, D = 30, 2, 16
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(T, H, D, generator=g), torch.randn(T, H, D, generator=g)
    pa, pb = torch.randn(H, T, generator=g), torch.randn(H, T, generator=g)
    want, want_lse = torch.empty(T, H, D), torch.empty(H, T)
    triton_impl.merge_attn_states(want, a, pa, b, pb, want_lse, 25, implementation="torch")
    triton_impl.merge_attn_states(a, a, pa, b, pb, pa, 25, implementation="torch")
    assert torch.equal(a, want) and torch.equal(pa, want_lse)


def test_torch_compile_fullgraph_traces_the_torch_path():
    T, H, D = 24, 2, 16
    o, lse = torch.randn(3, T, H, D), torch.randn(3, H, T)
    qsl, cu = torch.tensor([0, 8, 24], dtype=torch.int32), torch.tensor([[0, 0, 5]] * 3, dtype=torch.int32)

    def step(out, out_lse, o, lse):
        triton_impl.merge_attn_states_n(out, o, lse, out_lse, query_start_loc=qsl, cu_seq_lens=cu,
                                        implementation="torch")
        return out, out_lse

    want = step(torch.empty(T, H, D), torch.empty(H, T), o, lse)
    got = torch.compile(step, fullgraph=True)(torch.empty(T, H, D), torch.empty(H, T), o, lse)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("call, error, match", [
    (lambda o, l: triton_impl.merge_attn_states(o[0], o[0], l[0], o[1], l[1], implementation="cuda"), ValueError,
     "implementation must be one of"),
    (lambda o, l: triton_impl.merge_attn_states_n(o[0], o, l[:, :1], implementation="torch"), ValueError, "lses"),
    (lambda o, l: triton_impl.mask_empty_context_lse(l[0].double(), torch.zeros(2, dtype=torch.int32),
                                                     torch.zeros(2, dtype=torch.int32), implementation="torch"),
     TypeError, "lse must be float32"),
])
def test_the_torch_path_takes_the_same_checks(call, error, match):
    o, l = torch.zeros(2, 8, 2, 16), torch.zeros(2, 2, 8)
    with pytest.raises(error, match=match):
        call(o, l)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_partials_are_never_written(dtype):
    """The torch path computes in f32 copies: an f32 partial's own buffer (whose .to(float32) is itself) stays as
    it was, NaN garbage and all."""
    T, H, D = 20, 2, 16
    o = torch.randn(3, T, H, D).to(dtype)
    o[1, 3] = float("nan")
    lse = torch.randn(3, H, T)
    before, lse_before = o.clone(), lse.clone()
    out = torch.empty(T, H, D)
    triton_impl.merge_attn_states(out, o[0], lse[0], o[1], lse[1], implementation="torch")
    triton_impl.merge_attn_states_n(out, o, lse, implementation="torch")
    assert torch.equal(o.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       before.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
    assert torch.equal(lse, lse_before)
