"""The Triton wrappers' per-call path (docs/design.md, "Per-call cost"): launch plans cached per signature, the
checks that still run per call, the compiled kernel's own launcher, and torch.compile / CUDA graphs around the
plain functions. Runs in the process's Triton mode (conftest)."""

import math

import pytest
import torch

import triton_impl
from triton_impl import _backend, _launch, _plans
from triton_impl import cp_merge as cp_merge_mod
from triton_impl import mask as mask_mod
from triton_impl import merge as merge_mod
from triton_impl import merge_n as merge_n_mod
from triton_keys import kernel_params, lse_strides

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
T, H, D, N = 6, 2, 8, 3


def _merge_inputs(dtype=torch.bfloat16, lse_layout="HT"):
    g = torch.Generator().manual_seed(0)
    x = lambda: torch.randn(T, H, D, generator=g).to(dtype).to(DEVICE)  # noqa: E731
    lse = lambda: torch.randn(*((H, T) if lse_layout == "HT" else (T, H)), generator=g).to(DEVICE)  # noqa: E731
    return dict(prefix_output=x(), prefix_lse=lse(), suffix_output=x(), suffix_lse=lse())


def _offsets():
    qsl = torch.tensor([0, 2, 5], dtype=torch.int32, device=DEVICE)
    cu = torch.tensor([0, 0, 7], dtype=torch.int32, device=DEVICE)
    return qsl, cu


def _merge(out, t, olse=None, ptwc=None, **kw):
    triton_impl.merge_attn_states(out, t["prefix_output"], t["prefix_lse"], t["suffix_output"], t["suffix_lse"], olse,
                                  ptwc, **kw)


@pytest.fixture
def plans(monkeypatch):
    """A fresh plan cache for the test."""
    fresh = {}
    monkeypatch.setattr(_plans, "PLANS", fresh)
    return fresh


def test_a_cached_signature_runs_the_per_call_checks(plans):
    # Overlap and prefill_tokens_with_context depend on the call, not the signature: a call whose tensors have
    # a cached signature's metadata still gets the checked path's errors.
    t = _merge_inputs()
    _merge(torch.empty(T, H, D, dtype=torch.bfloat16, device=DEVICE), t)
    assert len(plans) == 1
    buf = torch.zeros(T + 1, H, D, dtype=torch.bfloat16, device=DEVICE)
    t2 = dict(t, prefix_output=buf[:T])  # same shape, strides, dtype and device as before
    with pytest.raises(ValueError, match="output partially overlaps prefix_output in memory"):
        _merge(buf[1:], t2)
    _merge(buf[:T], t2)  # the same view: fine (every element read before it is written)
    with pytest.raises(TypeError, match="prefill_tokens_with_context must be a host int"):
        _merge(torch.empty(T, H, D, dtype=torch.bfloat16, device=DEVICE), t, ptwc=torch.tensor(3))
    olse = torch.empty(H, T, device=DEVICE)
    _merge(torch.empty(T, H, D, dtype=torch.bfloat16, device=DEVICE), t, olse)
    with pytest.raises(ValueError, match="output_lse partially overlaps prefix_lse in memory"):
        lse_buf = torch.zeros(H * T + 1, device=DEVICE)
        _merge(torch.empty(T, H, D, dtype=torch.bfloat16, device=DEVICE),
               dict(t, prefix_lse=lse_buf[:H * T].view(H, T)), lse_buf[1:].view(H, T))
    assert len(plans) == 2


def test_a_cached_signature_gives_the_checked_paths_bits(plans):
    t = _merge_inputs()
    qsl, cu = _offsets()
    outs = []
    for _ in range(2):  # a miss (every check, then the plan), then a hit
        out, olse = torch.empty(T, H, D, dtype=torch.bfloat16, device=DEVICE), torch.empty(H, T, device=DEVICE)
        _merge(out, t, olse, 4, query_start_loc=qsl, prefix_cu_seq_lens=cu)
        outs.append((out, olse))
    assert len(plans) == 1
    for a, b in zip(*outs):
        assert torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a.view(torch.int32),
                           b.view(torch.int16) if b.dtype == torch.bfloat16 else b.view(torch.int32))


def test_bad_calls_leave_no_plan_and_keep_their_errors(plans):
    t = _merge_inputs()
    for _ in range(2):
        with pytest.raises(TypeError, match=r"output must be float32, float16, bfloat16, float8_e4m3fn"):
            _merge(torch.empty(T, H, D, dtype=torch.float64, device=DEVICE), t)
        with pytest.raises(ValueError, match="lse_layout must be one of"):
            _merge(torch.empty(T, H, D, dtype=torch.bfloat16, device=DEVICE), t, lse_layout=["HT"])
    assert not plans


def test_validate_takes_the_checked_path(plans):
    t = _merge_inputs()
    qsl, cu = _offsets()
    _merge(torch.empty(T, H, D, dtype=torch.bfloat16, device=DEVICE), t, query_start_loc=qsl, prefix_cu_seq_lens=cu)
    bad = torch.tensor([0, 7, 0], dtype=torch.int32, device=DEVICE)  # the same signature as cu
    with pytest.raises(ValueError, match=r"prefix_cu_seq_lens must be non-decreasing; prefix_cu_seq_lens\[1\]=7"):
        _merge(torch.empty(T, H, D, dtype=torch.bfloat16, device=DEVICE), t, query_start_loc=qsl,
               prefix_cu_seq_lens=bad, validate=True)


def test_the_plan_cache_is_bounded(plans, monkeypatch):
    monkeypatch.setattr(_plans, "PLANS_MAX", 3)
    t = _merge_inputs()
    for ptwc_tokens in range(1, T + 1):  # new signatures: T varies
        s = {k: (v[:ptwc_tokens] if v.dim() == 3 else v[:, :ptwc_tokens]) for k, v in t.items()}
        _merge(torch.empty(ptwc_tokens, H, D, dtype=torch.bfloat16, device=DEVICE), s)
        assert len(plans) <= 3


class _FakeCompiled:
    def __init__(self):
        self.calls, self.function, self.packed_metadata = [], "handle", "metadata"

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, *args):
        self.calls.append(args)


class _FakeKernel:
    """A JITFunction's launch interface: kernel[grid](*args, **kwargs) returns the compiled kernel."""

    def __init__(self, arg_names):
        self.arg_names, self.pre_run_hooks, self.compiled, self.launches = arg_names, [], _FakeCompiled(), []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.launches.append((grid, args, kwargs))
            return self.compiled
        return run


def _arg_names(kernel):
    return kernel_params(kernel)[0]  # a compiled kernel's `arg_names`, also under the interpreter


class _Hooks:
    launch_enter_hook = launch_exit_hook = None


KERNELS = {"mask": mask_mod._mask_empty_context_lse_kernel, "merge": merge_mod._merge_attn_states_kernel,
           "merge_n": merge_n_mod._merge_attn_states_n_kernel, "cp_rescale": cp_merge_mod._cp_rescale_kernel}


@pytest.mark.parametrize("entry", list(KERNELS))
def test_only_the_lse_strides_that_follow_t_are_runtime(entry):
    # docs/design.md, "Runtime values": one kernel function, one @triton.jit per LSE layout. [H, T]: the LSE
    # head strides (= T) are runtime, the token strides (1) specialised. [T, H]: every LSE head and token stride
    # is specialised (1 and H). Both layouts list the same other runtime values.
    names, _, dns_ht, _ = kernel_params(KERNELS[entry]["HT"])
    names_th, _, dns_th, _ = kernel_params(KERNELS[entry]["TH"])
    assert names_th == names and KERNELS[entry]["HT"].fn is KERNELS[entry]["TH"].fn
    head, token = lse_strides(names, "h"), lse_strides(names, "t")
    assert head and len(token) == len(head)
    assert head <= dns_ht and not token & dns_ht
    assert not (head | token) & dns_th
    assert dns_ht - head == dns_th


@pytest.mark.parametrize("entry", ["mask", "merge", "merge_n"])
def test_direct_launch_passes_every_parameter_in_order(plans, monkeypatch, entry):
    # The second call of a signature goes to the compiled kernel's launcher with what JITFunction.run would pass:
    # grid, stream, handle, metadata, launch metadata, hooks, then the kernel's parameters in order.
    module, name = {"mask": (mask_mod, "_mask_empty_context_lse_kernel"),
                    "merge": (merge_mod, "_merge_attn_states_kernel"),
                    "merge_n": (merge_n_mod, "_merge_attn_states_n_kernel")}[entry]
    fake = _FakeKernel(_arg_names(getattr(module, name)["HT"]))
    monkeypatch.setitem(getattr(module, name), "HT", fake)
    monkeypatch.setattr(_launch, "DIRECT_LAUNCH", True)
    monkeypatch.setattr(_backend, "interpreting", lambda: False)
    monkeypatch.setattr(_backend, "triton_runs_on", lambda device: True)
    monkeypatch.setattr(_launch, "_driver", lambda: (lambda: 0, lambda device: 1234, _Hooks))
    t = _merge_inputs()
    qsl, cu = _offsets()
    out = torch.empty(T, H, D, dtype=torch.bfloat16, device=DEVICE)
    olse = torch.empty(H, T, device=DEVICE)
    outs = torch.stack([t["prefix_output"]] * N)
    lses = torch.stack([t["prefix_lse"]] * N)
    cus = cu.expand(N, -1).contiguous()
    for ptwc in (3, 5):
        if entry == "mask":
            triton_impl.mask_empty_context_lse(olse, qsl, cu, out)
        elif entry == "merge":
            _merge(out, t, olse, ptwc, query_start_loc=qsl, prefix_cu_seq_lens=cu)
        else:
            triton_impl.merge_attn_states_n(out, outs, lses, olse, ptwc, query_start_loc=qsl,
                                            cu_seq_lens=cus)
    (grid, args, kwargs), = fake.launches  # the first call only
    (direct,) = fake.compiled.calls
    assert direct[:9] == (grid[0], 1, 1, 1234, "handle", "metadata", None, None, None)
    params = direct[9:]
    assert len(params) == len(fake.arg_names)
    want = dict(zip(fake.arg_names, args), **{k: v for k, v in kwargs.items() if k in fake.arg_names})
    if entry != "mask":
        want["prefill_tokens_with_context"] = 5
    for got, param in zip(params, fake.arg_names):
        w = want[param]
        assert got is w or (not isinstance(w, torch.Tensor) and got == w), param


def test_direct_launch_falls_back_for_unaligned_pointers(plans, monkeypatch):
    fake = _FakeKernel(_arg_names(merge_mod._merge_attn_states_kernel["HT"]))
    monkeypatch.setitem(merge_mod._merge_attn_states_kernel, "HT", fake)
    monkeypatch.setattr(_launch, "DIRECT_LAUNCH", True)
    monkeypatch.setattr(_backend, "interpreting", lambda: False)
    monkeypatch.setattr(_backend, "triton_runs_on", lambda device: True)
    monkeypatch.setattr(_launch, "_driver", lambda: (lambda: 0, lambda device: 1234, _Hooks))
    t = _merge_inputs()
    buf = torch.empty(T * H * D + 1, dtype=torch.bfloat16, device=DEVICE)
    _merge(buf[:-1].view(T, H, D), t)
    _merge(buf[1:].view(T, H, D), t)  # 2 bytes off: another compiled variant, Triton's to choose
    _merge(buf[:-1].view(T, H, D), t)
    assert len(fake.launches) == 2 and len(fake.compiled.calls) == 1


# --------------------------------------------------------------------------------------------------------
# torch.compile and CUDA graphs around the plain functions


def _pipeline(t, qsl, cu, outs, lses, lse_layout="HT"):
    """Mask, 2-way merge and N-way merge through the plain functions; returns what they wrote (read after)."""
    lse, out = t["prefix_lse"].clone(), t["prefix_output"].clone()
    triton_impl.mask_empty_context_lse(lse, qsl, cu, out, lse_layout=lse_layout)
    merged, merged_lse = torch.empty_like(out), torch.empty_like(lse)
    triton_impl.merge_attn_states(merged, out, lse, t["suffix_output"], t["suffix_lse"], merged_lse, 4,
                                  lse_layout=lse_layout)
    merged_n = torch.empty_like(out)
    triton_impl.merge_attn_states_n(merged_n, outs, lses, None, 5, lse_base=math.e, lse_layout=lse_layout)
    return lse * 1.0, merged * 1.0, merged_lse * 1.0, merged_n * 1.0


@pytest.mark.parametrize("lse_layout", ["HT", "TH"])
def test_plain_functions_trace_fullgraph_on_cpu(monkeypatch, lse_layout):
    # The interpreter's kernels do not trace (Dynamo cannot follow the interpreter's launch), so on CPU the launch is
    # recorded: every check, the layout's kernel and the launch arguments must trace in one graph (no data_ptr
    # arithmetic).
    if DEVICE != "cpu":
        pytest.skip("the CPU variant of test_torch_compile_fullgraph_around_the_plain_functions")
    t = _merge_inputs(torch.float32, lse_layout)
    qsl, cu = _offsets()
    outs, lses = torch.stack([t["prefix_output"], t["suffix_output"]] * 2), torch.stack([t["prefix_lse"]] * 4)
    launches = []
    monkeypatch.setattr(_launch, "launch", lambda kernel, grid, args, constexprs, state: launches.append(
        (kernel, grid, [a for a in args if not isinstance(a, torch.Tensor)], constexprs)))
    _pipeline(t, qsl, cu, outs, lses, lse_layout)
    eager = list(launches)
    launches.clear()
    # dynamic=False: the other layout's run recompiles `_pipeline`, by default with symbolic shapes and strides,
    # which the wrappers' stride checks cannot trace (sorting them).
    torch.compile(_pipeline, backend="eager", fullgraph=True, dynamic=False)(t, qsl, cu, outs, lses, lse_layout)
    assert len(eager) == 3 and launches == eager
    assert [k for k, *_ in eager] == [KERNELS[e][lse_layout] for e in ("mask", "merge", "merge_n")]


@pytest.mark.gpu
@pytest.mark.parametrize("lse_layout", ["HT", "TH"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph_around_the_plain_functions(backend, lse_layout):
    # aot_eager runs the traced kernel launches as given; inductor launches user kernels itself (with the
    # launch options, enable_fp_fusion=False included, or the bits would differ). Each layout has its own kernels.
    t = _merge_inputs(torch.float32, lse_layout)
    qsl, cu = _offsets()
    outs, lses = torch.stack([t["prefix_output"], t["suffix_output"]] * 2), torch.stack([t["prefix_lse"]] * 4)
    want = _pipeline(t, qsl, cu, outs, lses, lse_layout)
    got = torch.compile(_pipeline, backend=backend, fullgraph=True, dynamic=False)(t, qsl, cu, outs, lses, lse_layout)
    for g, w in zip(got, want):
        assert torch.equal(g.view(torch.int32), w.view(torch.int32))


@pytest.mark.gpu
def test_cuda_graph_capture_of_the_plain_functions():
    # After a warm-up (plans made, compiled kernels recorded) the captured launches are the direct ones.
    t = _merge_inputs(torch.float32)
    qsl, cu = _offsets()
    outs, lses = torch.stack([t["prefix_output"], t["suffix_output"]] * 2), torch.stack([t["prefix_lse"]] * 4)
    static = {k: v.clone() for k, v in t.items()}
    for _ in range(2):
        _pipeline(static, qsl, cu, outs, lses)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = _pipeline(static, qsl, cu, outs, lses)
    new = _merge_inputs(torch.float32)
    new = {k: v * 0.5 + 1.0 for k, v in new.items()}
    for k in static:
        static[k].copy_(new[k])
    graph.replay()
    torch.cuda.synchronize()
    want = _pipeline(new, qsl, cu, outs, lses)
    for g, w in zip(got, want):
        assert torch.equal(g.view(torch.int32), w.view(torch.int32))


@pytest.mark.gpu
def test_direct_launch_is_used_and_gives_the_same_bits(plans):
    # On the GPU's Triton version the second call of a signature must take the compiled kernel's launcher (or
    # this test names the version where it does not), with the first call's bits.
    t = _merge_inputs()
    qsl, cu = _offsets()
    results = []
    for _ in range(2):
        out, olse = torch.empty(T, H, D, dtype=torch.bfloat16, device=DEVICE), torch.empty(H, T, device=DEVICE)
        _merge(out, t, olse, 4, query_start_loc=qsl, prefix_cu_seq_lens=cu)
        results.append((out.view(torch.int16), olse.view(torch.int32)))
    (plan,) = plans.values()
    state = plan[2][-1]
    import triton
    assert len(state) > 1, f"no direct launch with triton {triton.__version__} (DIRECT_LAUNCH={_launch.DIRECT_LAUNCH})"
    for a, b in zip(*results):
        assert torch.equal(a, b)
