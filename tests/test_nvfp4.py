"""NVFP4 output of the merges (docs/spec.md 4.8) in every implementation: the fused quantization gives the bits of
the same implementation's f32-output merge followed by the reference quantizer (`parity.harness.reference.
quant_nvfp4`, `pack_fp4`, `swizzle_nvfp4_scales`), for the 2-way merge and the N-way merge (unrolled, split, N = 0),
both block-scale layouts (Pallas on both backends: Mosaic GPU with jax >= 0.11); the JAX quantizer equals the
reference on special values; the Pallas kernels lower for the GPU; bad arguments raise before anything is
written."""

from __future__ import annotations

import jax
import ml_dtypes
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import pallas_impl
import triton_impl
from pallas_impl import _math
from parity.harness import reference as R

T, H, D = 21, 2, 64
K = H * D // 16  # block scales per token
SWIZZLED_SIZE = 128 * 8  # T padded to 128, K = 8 (a multiple of 4)
GPU = torch.cuda.is_available()
JAX_0_11 = tuple(int(x) for x in jax.__version__.split(".")[:2]) >= (0, 11)
DEV = "cuda" if GPU else "cpu"
PTWC = 18  # tokens 18.. are pass-through rows (4.4): quantized like any other row
G = np.float32(448 * 6 / 12)  # a global scale as vLLM computes it: 448 * 6 / amax
MARK = 0x38  # e4m3 1.0: the caller's padding of a swizzled buffer, which triton_impl leaves as it is


def _inputs(num_partials, seed=0):
    rng = np.random.default_rng(seed)
    outs = rng.standard_normal((num_partials, T, H, D)).astype(np.float32) * 3
    outs[:, 7, 0, :16] *= 1e-3  # a block of small values: its own scale
    lses = rng.standard_normal((num_partials, H, T)).astype(np.float32)
    if num_partials:
        lses[:, :, 4] = -np.inf  # token 4: every partial empty (4.2): codes 0, scales 0
    return outs.astype(np.float16), lses


def _triton(outs, lses, layout, implementation="triton"):
    two_way = outs.shape[0] == 2
    q = torch.full((T, H, D // 2), 0xAB, dtype=torch.uint8, device=DEV)
    shape = (T, K) if layout == "row" else (SWIZZLED_SIZE,)
    scales = torch.full(shape, MARK, dtype=torch.uint8, device=DEV).view(torch.float8_e4m3fn)
    f32 = torch.empty((T, H, D), dtype=torch.float32, device=DEV)
    o, l = torch.from_numpy(outs).to(DEV), torch.from_numpy(lses).to(DEV)
    g = torch.tensor([G], device=DEV)
    kw = dict(output_block_scale=scales, scale_layout=layout, implementation=implementation)
    if two_way:
        triton_impl.merge_attn_states(q, o[0], l[0], o[1], l[1], None, PTWC, g, **kw)
        triton_impl.merge_attn_states(f32, o[0], l[0], o[1], l[1], None, PTWC, implementation=implementation)
    else:
        triton_impl.merge_attn_states_n(q, o, l, None, PTWC, g, **kw)
        triton_impl.merge_attn_states_n(f32, o, l, None, PTWC, implementation=implementation)
    return q.cpu().numpy(), scales.view(torch.uint8).cpu().numpy(), f32.cpu().numpy()


def _jax(outs, lses, layout, implementation):
    """`implementation` "pallas" (its Triton backend), "mosaic" (Pallas on Mosaic GPU, jax >= 0.11) or "jnp"."""
    kw = dict(implementation=implementation, prefill_tokens_with_context=PTWC, return_lse=False)
    if implementation == "mosaic":
        kw.update(implementation="pallas", backend="mosaic_gpu")
    o, l = jnp.asarray(outs), jnp.asarray(lses)
    if outs.shape[0] == 2:
        fn = lambda **k: pallas_impl.merge_attn_states(o[0], l[0], o[1], l[1], **kw, **k)  # noqa: E731
    else:
        fn = lambda **k: pallas_impl.merge_attn_states_n(o, l, **kw, **k)  # noqa: E731
    q, scales = fn(out_dtype=jnp.float4_e2m1fn, output_scale=jnp.float32(G), scale_layout=layout)
    assert q.dtype == jnp.uint8 and q.shape == (T, H, D // 2) and scales.dtype == jnp.float8_e4m3fn
    assert scales.shape == ((T, K) if layout == "row" else (SWIZZLED_SIZE,))
    return np.asarray(q), np.asarray(scales).view(np.uint8), np.asarray(fn(out_dtype=jnp.float32))


def _want(f32, layout, padding):
    codes, scales = R.quant_nvfp4(f32, G)
    scales = scales.view(np.uint8)
    if layout == "swizzled":
        flat = R.swizzle_nvfp4_scales(scales)
        mask = R.swizzle_nvfp4_scales(np.ones_like(scales)).astype(bool)  # where a real scale lands
        scales = np.where(mask, flat, np.uint8(padding))
    return R.pack_fp4(codes), codes, scales


def _codes(packed):
    return R.unpack_fp4(packed.reshape(T, -1))


# Every implementation through every N kind (2-way, unrolled N-way, split N-way beyond 16, N = 0) and both layouts.
CASES = [(impl, n, layout) for impl in ("triton", "torch", "pallas", "jnp") + (("mosaic",) if JAX_0_11 else ()) for n, layout
         in ((2, "row"), (2, "swizzled"), (3, "swizzled"), (20, "row"), (0, "swizzled"))]


@pytest.mark.parametrize("impl, num_partials, layout", CASES)
def test_fused_nvfp4_is_merge_then_the_reference_quantizer(impl, num_partials, layout):
    outs, lses = _inputs(num_partials)
    if impl in ("triton", "torch"):
        got, scales, f32 = _triton(outs, lses, layout, impl)
    else:
        got, scales, f32 = _jax(outs, lses, layout, impl)
    # the padding of a swizzled buffer: the caller's in PyTorch (untouched; N = 0 zeroes the buffer), 0 in JAX
    padding = MARK if impl in ("triton", "torch") and num_partials else 0
    want, want_codes, want_scales = _want(f32, layout, padding)
    if impl in ("triton", "torch") and not GPU:  # Triton's interpreter, torch on a CPU: IEEE f32, the reference's
        np.testing.assert_array_equal(got.reshape(T, -1), want)
        np.testing.assert_array_equal(scales.ravel(), want_scales.ravel())
    else:
        # XLA:CPU contracts FMAs per compile (the f32 rows of the two calls may differ in the last bit); on a GPU
        # the kernels divide with div.full.f32, the reference with a correctly rounded division (docs/spec.md 5):
        # a scale within one e4m3 step, a code within one e2m1 step of the reference's, in a few elements.
        got_codes = _codes(got)
        step = np.abs((got_codes & 7).astype(int) - (want_codes & 7).astype(int))
        assert step.max() <= 1 and (step > 0).mean() < 0.01
        assert np.abs(scales.ravel().astype(int) - want_scales.ravel().astype(int)).max() <= 1
    codes = _codes(got)
    assert (codes[4] == 0).all()  # both partials empty (4.2): codes 0 and scale 0
    assert not R.quant_nvfp4(f32, G)[1].view(np.uint8)[4].any()
    if num_partials == 0:
        assert not got.any() and not scales.any()


def test_jax_quantizer_is_the_reference_on_special_values():
    """`pallas_impl._math.nvfp4_quant` and `pack_fp4` (the kernels' and the jnp path's) against the reference:
    NaN (left out of the maximum; its code +-0), +-inf, all-zero blocks, subnormals, values at every e2m1 threshold
    (ties to the even code) and a global scale that saturates the block scale at 448."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((9, 64)) * rng.choice([1e-38, 1e-3, 1, 7e3], (9, 64))).astype(np.float32)
    x[1, :16] = 0
    x[2, 3], x[2, 20], x[2, 40] = np.nan, np.inf, -np.inf
    x[3, :16] = [0, .25, .5, .75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, -1.25]
    x[3, 16:32] = -x[3, :16]
    for g in (np.float32(1.0), np.float32(448 * 6 / 7e3), np.float32(1e6)):
        codes, scales = jax.jit(_math.nvfp4_quant)(jnp.asarray(x), jnp.float32(g))
        want_codes, want_scales = R.quant_nvfp4(x, g)
        np.testing.assert_array_equal(np.asarray(codes), want_codes)
        np.testing.assert_array_equal(np.asarray(scales).view(np.uint8), want_scales.view(np.uint8))
        np.testing.assert_array_equal(np.asarray(jax.jit(_math.pack_fp4)(codes)), R.pack_fp4(want_codes))
    # at g = 1 block 3's scale is 6 / 6 = 1: each value is its own quotient, every tie rounds to the even code
    assert list(R.quant_nvfp4(x, np.float32(1.0))[0][3, :16]) == [0, 0, 1, 2, 2, 2, 3, 4, 4, 4, 5, 6, 6, 6, 7, 10]


@pytest.mark.skipif(JAX_0_11 and not GPU, reason="jax >= 0.11's Pallas Triton lowering asks a GPU for its compute "
                                                 "capability")
@pytest.mark.parametrize("op", ["merge", "merge_n"])
def test_pallas_nvfp4_kernels_lower_for_the_gpu(op):
    """The NVFP4 store (reshape to blocks, e4m3 cast, pair packing) lowers to Triton IR for a GPU, on a CPU with
    jax < 0.11 (the Pallas Triton backend's lowering runs in Python; only the PTX compile needs the GPU)."""
    S = jax.ShapeDtypeStruct
    kw = dict(implementation="pallas", interpret=False, out_dtype=jnp.float4_e2m1fn, scale_layout="swizzled")
    if op == "merge":
        args = [S((64, 4, 128), jnp.bfloat16), S((4, 64), jnp.float32)] * 2 + [S((), jnp.float32)]
        fn = lambda a, la, b, lb, g: pallas_impl.merge_attn_states(a, la, b, lb, output_scale=g, **kw)  # noqa: E731
    else:
        args = [S((20, 64, 4, 128), jnp.bfloat16), S((20, 4, 64), jnp.float32), S((), jnp.float32)]
        fn = lambda o, l, g: pallas_impl.merge_attn_states_n(o, l, output_scale=g, **kw)  # noqa: E731
    checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    if tuple(int(x) for x in jax.__version__.split(".")[:3]) < (0, 10, 2):  # every fp8 store: a clear refusal
        with pytest.raises(NotImplementedError, match="need jax >= 0.10.2"):
            jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(*args)
        return
    exported = jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(*args)
    assert "xla.gpu.triton" in exported.mlir_module()
    assert [a.shape for a in exported.out_avals] == [(64, 4, 64), (4, 64), (128 * 32,)]  # K = 4 * 128 / 16


def _triton_args(out_dtype=torch.uint8, out_shape=(T, H, D // 2), scales_shape=(T, K),
                 scales_dtype=torch.float8_e4m3fn, head_dim=D):
    outs, lses = _inputs(2)
    o = torch.from_numpy(outs[..., :head_dim].copy()).to(DEV)
    out = torch.full(out_shape, 7, dtype=torch.uint8, device=DEV).view(out_dtype)
    scales = torch.full(scales_shape, MARK, dtype=torch.uint8, device=DEV).view(scales_dtype)
    return out, scales, (out, o[0], torch.from_numpy(lses[0]).to(DEV), o[1], torch.from_numpy(lses[1]).to(DEV))


@pytest.mark.parametrize("change, kw, error, match", [
    (dict(out_dtype=torch.float8_e4m3fn), {}, TypeError, "output must be uint8"),
    (dict(out_shape=(T, H, D)), {}, ValueError, r"must be u8\[T, H, D / 2\]"),
    (dict(scales_dtype=torch.uint8), {}, TypeError, "output_block_scale must be float8_e4m3fn"),
    (dict(scales_shape=(T, K + 1)), {}, ValueError, r"output_block_scale must be e4m3 \[T, H \* D / 16\]"),
    (dict(scales_shape=(SWIZZLED_SIZE - 4,)), dict(scale_layout="swizzled"), ValueError, "contiguous buffer of 1024"),
    ({}, dict(scale_layout="col"), ValueError, "must be 'row' or 'swizzled'"),
    ({}, dict(group_size=16), ValueError, "per-group FP8's"),
    ({}, dict(output_scale=None), ValueError, "needs output_scale"),
    (dict(out_shape=(T, H, 24), scales_shape=(T, 6), head_dim=48), {}, NotImplementedError, "power of two from 16"),
])
def test_triton_bad_arguments_raise_and_write_nothing(change, kw, error, match):
    out, scales, args = _triton_args(**change)
    kw = dict(dict(output_scale=torch.tensor([G], device=DEV)), **kw)
    before = (out.view(torch.uint8).clone(), scales.view(torch.uint8).clone())
    with pytest.raises(error, match=match):
        triton_impl.merge_attn_states(*args, None, None, kw.pop("output_scale"), output_block_scale=scales, **kw)
    assert torch.equal(out.view(torch.uint8), before[0]) and torch.equal(scales.view(torch.uint8), before[1])


def test_triton_scale_layout_without_block_scales_is_refused():
    out, _, args = _triton_args(out_dtype=torch.uint8)
    f32 = torch.empty((T, H, D), device=DEV)
    with pytest.raises(ValueError, match="scale_layout goes with output_block_scale"):
        triton_impl.merge_attn_states(f32, *args[1:], scale_layout="swizzled")


@pytest.mark.parametrize("kw, error, match", [
    (dict(), ValueError, "needs output_scale, the f32 global scale"),
    (dict(output_scale=jnp.ones((2,), jnp.float32)), TypeError, "global scale"),
    (dict(output_scale=jnp.float32(1), group_size=64), ValueError, "per-group FP8's"),
    (dict(output_scale=jnp.float32(1), scale_layout="col"), ValueError, "must be 'row' or 'swizzled'"),
])
@pytest.mark.parametrize("implementation", ["pallas", "jnp"])
def test_jax_bad_arguments_raise(kw, error, match, implementation):
    outs, lses = _inputs(2)
    o, l = jnp.asarray(outs), jnp.asarray(lses)
    kw = dict(kw, out_dtype=jnp.float4_e2m1fn, implementation=implementation)
    with pytest.raises(error, match=match):
        pallas_impl.merge_attn_states(o[0], l[0], o[1], l[1], **kw)
    with pytest.raises(error, match=match):
        pallas_impl.merge_attn_states_n(o, l, **kw)
    with pytest.raises(ValueError, match="scale_layout"):  # swizzled is NVFP4's
        pallas_impl.merge_attn_states(o[0], l[0], o[1], l[1], implementation=implementation, scale_layout="swizzled")


@pytest.mark.gpu
@pytest.mark.parametrize("num_partials, layout", [(2, "row"), (3, "swizzled"), (20, "swizzled")])
def test_triton_pallas_and_jnp_agree_bit_for_bit_on_gpu(num_partials, layout):
    outs, lses = _inputs(num_partials, seed=11)
    t_out, t_scales, _ = _triton(outs, lses, layout)
    for impl in ("pallas", "jnp") + (("mosaic",) if JAX_0_11 else ()):
        got, scales, _ = _jax(outs, lses, layout, impl)
        np.testing.assert_array_equal(got, t_out, err_msg=impl)
        if layout == "row":
            np.testing.assert_array_equal(scales, t_scales, err_msg=impl)
        else:  # the padding differs by design (the caller's in PyTorch, 0 in JAX)
            real = R.swizzle_nvfp4_scales(np.ones((T, K), np.uint8)).astype(bool)
            np.testing.assert_array_equal(scales[real], t_scales[real])


@pytest.mark.parametrize("method", ["gather", "reduce_scatter"])
@pytest.mark.parametrize("implementation", ["pallas", "jnp"])
def test_jax_cp_combine_writes_nvfp4(method, implementation):
    """The JAX context-parallel combine on 4 vmap-simulated devices (docs/spec.md 9) with NVFP4 output (4.8):
    each device's rows (every head for "gather", its head for "reduce_scatter") quantized, row-major scales
    within one e4m3 step and codes within one e2m1 step of the N-way merge's (the interpreters' FMA contraction
    and the sum's order differ; "gather" is the N-way merge itself), and the swizzled layout of the same
    combine's row-major scales."""
    rng = np.random.default_rng(2)
    heads = 4  # reduce_scatter: one head per device
    o = jnp.asarray((rng.standard_normal((4, T, heads, D)) * 3).astype(np.float16))
    l = jnp.asarray(rng.standard_normal((4, heads, T)).astype(np.float32))

    def combine(layout):
        return jax.vmap(lambda out, lse: pallas_impl.cp_merge_attn_states(
            out, lse, axis_name="cp", method=method, return_lse=False, out_dtype=jnp.float4_e2m1fn,
            output_scale=jnp.float32(G), scale_layout=layout, implementation=implementation), axis_name="cp")(o, l)

    q, scales = combine("row")
    want_q, want_s = pallas_impl.merge_attn_states_n(o, l, return_lse=False, out_dtype=jnp.float4_e2m1fn,
                                                     output_scale=jnp.float32(G), implementation=implementation)
    _, swizzled = combine("swizzled")
    for r in range(4):
        np.testing.assert_array_equal(np.asarray(swizzled[r]).view(np.uint8),
                                      R.swizzle_nvfp4_scales(np.asarray(scales[r]).view(np.uint8)))
    if method == "gather":  # every device holds every head
        q, scales = q[0], scales[0]
    else:  # device r: head r, its D / 16 blocks
        q, scales = jnp.concatenate(list(q), axis=1), jnp.concatenate(list(scales), axis=1)
    got_s, want_s = np.asarray(scales).view(np.uint8).astype(int), np.asarray(want_s).view(np.uint8).astype(int)
    assert np.abs(got_s - want_s).max() <= 1
    got, want = _codes(np.asarray(q).reshape(T, -1)), _codes(np.asarray(want_q).reshape(T, -1))
    step = np.abs((got & 7).astype(int) - (want & 7).astype(int))
    assert step.max() <= 1 and (step > 0).mean() < 0.02


@pytest.mark.parametrize("layout", ["row", "swizzled"])
def test_fused_equals_merge_then_the_separate_quantizer_kernel(layout):
    """The fused Triton N-way merge against the Triton merge into f32 followed by the separate NVFP4 quantizer
    (`triton_impl.cp_merge._nvfp4_rows_kernel`, the merges' own store on given rows: the reduce-scatter CP
    combine's and `python -m tools group-fp8-speed --format nvfp4`'s), two heads a program: bit for bit, under
    the interpreter as compiled, both scale layouts."""
    from triton_impl._backend import PARITY_LAUNCH
    from triton_impl.cp_merge import _nvfp4_rows_kernel

    outs, lses = _inputs(3, seed=9)
    got, scales, f32 = _triton(outs, lses, layout)
    x = torch.from_numpy(f32).to(DEV)
    q = torch.empty((T, H, D // 2), dtype=torch.uint8, device=DEV)
    s = torch.full((T, K) if layout == "row" else (SWIZZLED_SIZE,), MARK, dtype=torch.uint8,
                   device=DEV).view(torch.float8_e4m3fn)
    with np.errstate(all="ignore"):
        _nvfp4_rows_kernel[(T // 4 + 1, 1)](x, q, torch.tensor([G], device=DEV), s, T, *q.stride(),
                                            *((0, 0) if layout == "swizzled" else s.stride()), NUM_HEADS=H,
                                            HEAD_DIM=D, BLOCK_T=4, BLOCK_H=H, SWIZZLED=layout == "swizzled",
                                            **PARITY_LAUNCH)
    np.testing.assert_array_equal(got, q.cpu().numpy())
    np.testing.assert_array_equal(scales, s.view(torch.uint8).cpu().numpy())


@pytest.mark.skipif(GPU, reason="the CPU variant: on a GPU tests/test_triton_host.py compiles the kernels")
@pytest.mark.parametrize("layout", ["row", "swizzled"])
def test_triton_nvfp4_traces_fullgraph(monkeypatch, layout):
    """Under torch.compile(fullgraph=True) the NVFP4 merges' checks and launch arguments trace in one graph (the
    interpreter's launch is recorded: Dynamo cannot follow it), with the eager launches' arguments."""
    from triton_impl import _launch

    outs, lses = _inputs(3)
    o, l = torch.from_numpy(outs), torch.from_numpy(lses)
    q = torch.zeros((T, H, D // 2), dtype=torch.uint8)
    scales = torch.zeros((T, K) if layout == "row" else (SWIZZLED_SIZE,), dtype=torch.float8_e4m3fn)
    g = torch.tensor([G])

    def step(o, l, q, scales, g):
        triton_impl.merge_attn_states(q, o[0], l[0], o[1], l[1], None, PTWC, g, output_block_scale=scales,
                                      scale_layout=layout)
        triton_impl.merge_attn_states_n(q, o, l, None, PTWC, g, output_block_scale=scales, scale_layout=layout)
        return q * 1

    launches = []
    monkeypatch.setattr(_launch, "launch", lambda kernel, grid, args, constexprs, state: launches.append(
        (kernel, grid, [a for a in args if not isinstance(a, torch.Tensor)], constexprs)))
    step(o, l, q, scales, g)
    eager = list(launches)
    launches.clear()
    torch.compile(step, backend="eager", fullgraph=True, dynamic=False)(o, l, q, scales, g)
    assert len(eager) == 2 and launches == eager and all(c["NVFP4"] for *_, c in eager)
    assert all(c["SWIZZLED"] == (layout == "swizzled") for *_, c in eager)


@pytest.mark.parametrize("layout", ["row", "swizzled"])
@pytest.mark.parametrize("implementation", ["pallas", "jnp"])
def test_jax_nvfp4_with_heads_sharded_on_an_explicit_mesh(implementation, layout):
    """Operands head-sharded on an Explicit mesh (one device here; tests/test_pallas_sharding.py runs four for the
    other options): the sharded call's results are the unsharded call's bits; the swizzled scales, which
    interleave every head's columns, come back replicated."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    outs, lses = _inputs(3)
    o, l = jnp.asarray(outs), jnp.asarray(lses)
    kw = dict(return_lse=False, implementation=implementation, out_dtype=jnp.float4_e2m1fn,
              output_scale=jnp.float32(G), scale_layout=layout)
    want_q, want_s = pallas_impl.merge_attn_states_n(o, l, **kw)
    mesh = jax.make_mesh((1,), ("heads",), axis_types=(AxisType.Explicit,))
    with jax.sharding.set_mesh(mesh):
        o = jax.device_put(o, NamedSharding(mesh, P(None, None, "heads", None)))
        l = jax.device_put(l, NamedSharding(mesh, P(None, "heads", None)))
        q, s = pallas_impl.merge_attn_states_n(o, l, **kw)
    np.testing.assert_array_equal(np.asarray(q), np.asarray(want_q))
    np.testing.assert_array_equal(np.asarray(s).view(np.uint8), np.asarray(want_s).view(np.uint8))
    if layout == "swizzled":
        assert all(axis is None for axis in jax.typeof(s).sharding.spec)


def test_e4m3_value_decodes_every_code_as_the_cast():
    """`_math.e4m3_value` (the jnp quantizer's f32 of its e4m3 scales, from their bits) gives the f32 bits of
    ml_dtypes' cast for all 256 codes: zeros, subnormals, normals, both signs, NaN."""
    codes = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    got = np.asarray(jax.jit(_math.e4m3_value)(jnp.asarray(codes)))
    np.testing.assert_array_equal(got.view(np.uint32), codes.astype(np.float32).view(np.uint32))


def test_parity_check_runs_the_nvfp4_cases_and_fails_a_wrong_code(tmp_path, monkeypatch):
    """`python -m parity check --suite full -k nvfp4`: the NVFP4 cases (2-way with pass-through rows and special
    LSEs, N-way [T, H] base 2) pass against the reference's quotients within half an e2m1 step, their block scales
    compared too; one code moved by a whole step in the Triton results fails the check."""
    import json

    from parity import cli
    from parity.harness.impls import kernels

    assert cli.main(["check", "--suite", "full", "-k", "nvfp4", "--quiet", "--json", str(tmp_path / "r.json")]) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["summary"]["records"] == 5 and report["summary"]["failed"] == 0
    assert "scales" in (tmp_path / "r.json").read_text()
    real = kernels.nvfp4_values

    def off_by_a_step(packed):
        v = real(packed)
        return v if type(v).__module__.startswith("jax") else torch.where(v == 1.0, 2.0, v)  # 1.0 -> 2.0: code 2 -> 4

    monkeypatch.setattr(kernels, "nvfp4_values", off_by_a_step)
    assert cli.main(["check", "--suite", "full", "-k", "nvfp4_ptwc", "--quiet"]) == 1


def test_golden_vectors_carry_nvfp4(tmp_path, capsys):
    """`export` writes the NVFP4 cases (merge.out the reference's quotients, merge.out_bits its codes' values,
    merge.scales the e4m3 block scales); `verify` passes the implementations and a port returning packed codes
    with row-major scales (pallas_impl's jnp path), and fails that port with one block scale two e4m3 steps
    off."""
    from parity import cli
    from parity.harness import golden

    gold = tmp_path / "gold"
    assert cli.main(["export", str(gold), "--suite", "full", "-k", "nvfp4", "--quiet"]) == 0
    entries = golden.load_manifest(str(gold))["cases"]
    assert [e["name"] for e in entries] == ["nvfp4_ptwc_specials", "n4_fp16_nvfp4_th_base2"]
    a = golden.load_case(str(gold), entries[0])
    T = entries[0]["params"]["num_tokens"] if "num_tokens" in entries[0]["params"] else a["prefix_output"].shape[0]
    assert a["merge.scales"].dtype == ml_dtypes.float8_e4m3fn and a["merge.scales"].shape == (T, 4 * 64 // 16)
    assert set(np.unique(np.abs(a["merge.out_bits"]))) <= set(R.FP4_E2M1_VALUES)
    for impl in ("reference", "triton", "jnp"):
        assert cli.main(["verify", str(gold), "--impl", impl, "--quiet"]) == 0, impl
    port = tmp_path / "port.py"
    port.write_text(PORT.format(bump=0))
    assert cli.main(["verify", str(gold), "--impl", f"{port}:run", "--quiet"]) == 0
    port.write_text(PORT.format(bump=2))
    capsys.readouterr()
    assert cli.main(["verify", str(gold), "--impl", f"{port}:run", "--quiet"]) == 1
    assert "scales" in capsys.readouterr().out


PORT = """
import math

import jax.numpy as jnp
import numpy as np
import pallas_impl


def run(op, x, params):
    D = params["head_dim"]
    if op == "mask":
        lse, out = pallas_impl.mask_empty_context_lse(x["lse"], x["query_start_loc"], x["cu_seq_lens"],
                                                      x["output"][..., :D], lse_layout=params["lse_layout"],
                                                      implementation="jnp")
        return dict(lse=np.asarray(lse), output=np.asarray(out))
    kw = dict(out_dtype=jnp.float4_e2m1fn, output_scale=jnp.asarray(x["output_scale"]), implementation="jnp",
              prefill_tokens_with_context=params.get("prefill_tokens_with_context"), lse_layout=params["lse_layout"],
              lse_base=math.e if params["lse_base"] == "e" else 2)
    if op.startswith("merge_n"):
        fused = dict(query_start_loc=x["query_start_loc"], cu_seq_lens=x["cu_seq_lens"]) if op.endswith("fused") else {{}}
        q, lse, s = pallas_impl.merge_attn_states_n(x["outputs"][..., :D], x["lses"], **fused, **kw)
    else:
        fused = dict(query_start_loc=x["query_start_loc"], prefix_cu_seq_lens=x["prefix_cu_seq_lens"]) \
            if op.endswith("fused") else {{}}
        q, lse, s = pallas_impl.merge_attn_states(x["prefix_output"][..., :D], x["prefix_lse"],
                                                  x["suffix_output"][..., :D], x["suffix_lse"], **fused, **kw)
    s = np.asarray(s).view(np.uint8).copy()
    s[0, 0] += {bump}  # a block scale two e4m3 steps off (one is within the tolerance)
    return dict(out=np.asarray(q), lse=np.asarray(lse), scales=s)
"""


# The layout of the block scales moves the scales, never a code (docs/spec.md 4.8): row and swizzled runs on the same
# inputs over a grid of shapes (T not a multiple of 128 nor of any tile, odd H, D up to the MLA latent, N = 1 to 20,
# the fused mask, pass-through rows). Until 2026-12-07 the compiled Triton 2-way merge with the fused mask wrote
# sign-only codes for half of each tile's heads with swizzled scales (H100): the interpreter cannot show it.
LAYOUT_GRID = [(t, h, d, n, fused) for t, h, d, n, fused in (
    (1001, 8, 128, 2, True), (1001, 8, 128, 2, False), (130, 3, 512, 1, False), (130, 3, 512, 2, True),
    (300, 16, 64, 2, True), (257, 5, 128, 3, True), (1001, 8, 128, 20, True), (77, 2, 16, 2, True))]


def _layout_inputs(T, H, D, N, fused):
    rng = np.random.default_rng(T * 7 + H * 3 + D + N)
    outs = (rng.standard_normal((max(N, 2), T, H, D)) * 3).astype(np.float32)
    lses = rng.standard_normal((max(N, 2), H, T)).astype(np.float32)
    qsl = np.array([0, T // 10, T // 2, T // 2 + 1, T - T // 20, T], np.int32)
    cu = np.array([0, 10, 10, 20, 20, 30], np.int32)
    return outs[:N], lses[:N], (qsl, cu) if fused else None


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU (the compiled kernels; the interpreters write the same codes)")
@pytest.mark.parametrize("T, H, D, N, fused", LAYOUT_GRID)
@pytest.mark.parametrize("impl", ["triton", "torch", "pallas"] + (["mosaic"] if JAX_0_11 else []))
def test_swizzled_scales_leave_every_code_as_the_row_layout_writes_it(impl, T, H, D, N, fused):
    outs, lses, offsets = _layout_inputs(T, H, D, N, fused)
    ptwc = T - T // 20
    K = H * D // 16
    g = np.float32(448 * 6 / 12)
    results = {}
    for layout in ("row", "swizzled"):
        if impl in ("triton", "torch"):
            o, l = torch.from_numpy(outs).to(torch.bfloat16).cuda(), torch.from_numpy(lses).cuda()
            q = torch.full((T, H, D // 2), 0xAB, dtype=torch.uint8, device="cuda")
            shape = (T, K) if layout == "row" else (-(-T // 128) * 128 * (-(-K // 4) * 4),)
            s = torch.full(shape, 0x38, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
            kw = dict(output_block_scale=s, scale_layout=layout, implementation=impl)
            gs = torch.tensor([g], device="cuda")
            if N == 2:
                if fused:
                    kw.update(query_start_loc=torch.from_numpy(offsets[0]).cuda(),
                              prefix_cu_seq_lens=torch.from_numpy(offsets[1]).cuda())
                triton_impl.merge_attn_states(q, o[0], l[0], o[1], l[1], None, ptwc, gs, **kw)
            else:
                if fused:
                    kw.update(query_start_loc=torch.from_numpy(offsets[0]).cuda(),
                              cu_seq_lens=torch.from_numpy(np.stack([offsets[1]] * N)).cuda())
                triton_impl.merge_attn_states_n(q, o, l, None, ptwc, gs, **kw)
            results[layout] = (q.cpu().numpy(), s.view(torch.uint8).cpu().numpy())
        else:
            kw = dict(implementation="pallas", prefill_tokens_with_context=ptwc, return_lse=False,
                      out_dtype=jnp.float4_e2m1fn, output_scale=jnp.float32(g), scale_layout=layout)
            if impl == "mosaic":
                kw["backend"] = "mosaic_gpu"
            o, l = jnp.asarray(outs, jnp.bfloat16), jnp.asarray(lses)
            if fused:
                kw["query_start_loc"] = jnp.asarray(offsets[0])
            if N == 2:
                if fused:
                    kw["prefix_cu_seq_lens"] = jnp.asarray(offsets[1])
                q, s = pallas_impl.merge_attn_states(o[0], l[0], o[1], l[1], **kw)
            else:
                if fused:
                    kw["cu_seq_lens"] = jnp.asarray(np.stack([offsets[1]] * N))
                q, s = pallas_impl.merge_attn_states_n(o, l, **kw)
            results[layout] = (np.asarray(q), np.asarray(s).view(np.uint8))
    (q_row, s_row), (q_sw, s_sw) = results["row"], results["swizzled"]
    np.testing.assert_array_equal(q_sw, q_row)
    np.testing.assert_array_equal(s_sw[R.swizzled_offsets(T, K)], s_row.reshape(T, K))


def test_parity_check_fails_a_swizzled_run_that_differs_from_the_row_run(monkeypatch, capsys):
    """`check`'s swizzled_vs_row comparison is required: scales read back from the wrong swizzled offsets (as a
    layout bug would write them) fail the NVFP4 merge records, located, while the row runs still pass."""
    from parity import cli
    from parity.harness.impls import kernels

    real = kernels.swizzled_offsets
    monkeypatch.setattr(kernels, "swizzled_offsets", lambda t, k: np.roll(real(t, k), 1, axis=0))
    assert cli.main(["check", "--suite", "full", "-k", "nvfp4_ptwc", "--quiet"]) == 1
    out = capsys.readouterr().out
    assert "swizzled_vs_row" in out and "merge.scales[triton]" in out
