"""Per-group FP8 output of the merges (docs/spec.md 4.7) in every implementation: the fused quantization gives the
bits of the same implementation's f32-output merge followed by the reference quantizer
(`parity.harness.reference.per_token_group_quant_fp8`), in every scale layout, with and without UE8M0 scales; the
reference quantizer is vLLM's `per_token_group_quant_fp8` re-expressed from its documented algorithm; bad
arguments raise before anything is written."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import pallas_impl
import triton_impl
from parity.harness import reference as R

T, H, D = 21, 2, 64
GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
PTWC = 18  # tokens 18.. are pass-through rows (4.4): quantized like any other row


def _inputs(num_partials, seed=0):
    rng = np.random.default_rng(seed)
    outs = rng.standard_normal((num_partials, T, H, D)).astype(np.float32) * 3
    lses = rng.standard_normal((num_partials, H, T)).astype(np.float32)
    if num_partials:
        lses[:, :, 4] = -np.inf  # token 4: every partial empty (4.2): q = 0, the floor's scale
    return outs.astype(np.float16), lses


def _to_rows(scales, layout):
    s = np.asarray(scales)
    return s if layout == "row" else s[:, :T].T


def _triton(outs, lses, group_size, ue8m0, layout, two_way, implementation="triton"):
    out = torch.empty((T, H, D), dtype=torch.float8_e4m3fn, device=DEV)
    groups = H * D // group_size
    buf = torch.full((groups, 24) if layout == "col_tma" else (groups, T) if layout == "col" else (T, groups), -1.0,
                     device=DEV)
    scales = buf if layout == "row" else buf[:, :T].t()
    f32 = torch.empty((T, H, D), dtype=torch.float32, device=DEV)
    o, l = torch.from_numpy(outs).to(DEV), torch.from_numpy(lses).to(DEV)
    if two_way:
        kw = dict(prefill_tokens_with_context=PTWC, implementation=implementation)
        triton_impl.merge_attn_states(out, o[0], l[0], o[1], l[1], group_size=group_size, output_group_scale=scales,
                                      scale_ue8m0=ue8m0, **kw)
        triton_impl.merge_attn_states(f32, o[0], l[0], o[1], l[1], **kw)
    else:
        triton_impl.merge_attn_states_n(out, o, l, prefill_tokens_with_context=PTWC, group_size=group_size,
                                        output_group_scale=scales, scale_ue8m0=ue8m0, implementation=implementation)
        triton_impl.merge_attn_states_n(f32, o, l, prefill_tokens_with_context=PTWC, implementation=implementation)
    if layout == "col_tma":
        assert (buf[:, T:] == -1).all(), "the padding columns are the caller's: untouched"
    return out.view(torch.uint8).cpu().numpy(), _to_rows(buf.cpu().numpy(), layout), f32.cpu().numpy()


def _pallas(outs, lses, group_size, ue8m0, layout, two_way, implementation):
    kw = dict(implementation=implementation, prefill_tokens_with_context=PTWC, return_lse=False)
    o, l = jnp.asarray(outs), jnp.asarray(lses)
    if two_way:
        fn = lambda **k: pallas_impl.merge_attn_states(o[0], l[0], o[1], l[1], **kw, **k)  # noqa: E731
    else:
        fn = lambda **k: pallas_impl.merge_attn_states_n(o, l, **kw, **k)  # noqa: E731
    out, scales = fn(group_size=group_size, scale_ue8m0=ue8m0, scale_layout=layout)
    assert out.dtype == jnp.float8_e4m3fn
    if layout == "col_tma":
        assert scales.shape == (H * D // group_size, 24) and not np.asarray(scales)[:, T:].any()
    return np.asarray(out).view(np.uint8), _to_rows(scales, layout), np.asarray(fn(out_dtype=jnp.float32))


# Every implementation through every N kind (2-way, unrolled N-way, split N-way beyond 16), every scale layout,
# both scale kinds and three group sizes: one option set per N (the options are independent of N's code path).
CASES = [(impl, n, g, ue, layout) for impl in ("triton", "torch", "pallas", "jnp")
         for n, g, ue, layout in ((2, 64, False, "row"), (3, 16, True, "col"), (20, 32, False, "col_tma"),
                                  (2, 32, True, "col_tma"))]


@pytest.mark.parametrize("impl, num_partials, group_size, ue8m0, layout", CASES)
def test_fused_quantization_is_merge_then_quantize(impl, num_partials, group_size, ue8m0, layout):
    outs, lses = _inputs(num_partials)
    two_way = num_partials == 2
    if impl in ("triton", "torch"):
        got, scales, f32 = _triton(outs, lses, group_size, ue8m0, layout, two_way, impl)
    else:
        got, scales, f32 = _pallas(outs, lses, group_size, ue8m0, layout, two_way, impl)
    q, want_scales = R.per_token_group_quant_fp8(f32, group_size, scale_ue8m0=ue8m0)
    want = R.to_fp8(q).view(np.uint8)
    got = got.reshape(T, -1)
    # On the CPU, XLA contracts FMAs per compile (the jnp and interpreted Pallas merges' f32 rows may differ
    # between the two calls); on a GPU the kernels divide with div.full.f32, the reference with numpy's correctly
    # rounded f32 division (docs/spec.md 5): within one rounding there; bit for bit under Triton's interpreter and
    # the torch path on a CPU.
    if impl not in ("triton", "torch") or GPU:
        assert np.allclose(scales, want_scales, rtol=2**-20, atol=0)
        assert np.abs(got.astype(int) - want.astype(int)).max() <= 1
    else:
        np.testing.assert_array_equal(scales.view(np.int32), want_scales.view(np.int32))
        np.testing.assert_array_equal(got, want)
    floor = np.float32(1e-10) / np.float32(448)
    assert (got[4] == 0).all() and np.all(scales[4] == (2.0**-42 if ue8m0 else floor))  # both empty: 4.2
    if ue8m0:
        assert np.all(np.log2(scales) == np.round(np.log2(scales)))


def _vllm_quant(x, group_size, ue8m0):
    """vLLM's per_token_group_quant_fp8 as its Triton kernel documents it (re-expressed in torch, f32): absmax
    floored at eps, y_s = absmax / 448 (UE8M0: exp2(ceil(log2(y_s)))), q = clamp(y / y_s, -448, 448) -> fp8."""
    y = torch.from_numpy(np.asarray(x, np.float32)).reshape(x.shape[0], -1, group_size)
    absmax = torch.clamp(y.abs().amax(-1), min=1e-10)
    y_s = absmax / 448.0
    if ue8m0:
        y_s = torch.exp2(torch.ceil(torch.log2(y_s)))
    q = torch.clamp(y / y_s[..., None], -448.0, 448.0).to(torch.float8_e4m3fn)
    return q.view(torch.uint8).reshape(x.shape[0], -1).numpy(), y_s.numpy()


@pytest.mark.parametrize("ue8m0", [False, True])
def test_the_reference_quantizer_is_vllms(ue8m0):
    x = (np.random.default_rng(3).standard_normal((64, 512)) * np.logspace(-3, 3, 512)).astype(np.float32)
    x[5] = 0.0  # an all-zero row: the eps floor
    q, s = R.per_token_group_quant_fp8(x, 128, scale_ue8m0=ue8m0)
    vq, vs = _vllm_quant(x, 128, ue8m0)
    np.testing.assert_array_equal(s.view(np.int32), vs.view(np.int32))
    np.testing.assert_array_equal(R.to_fp8(q).view(np.uint8), vq)


def test_ue8m0_rounds_up_on_the_bits_where_log2_would_not():
    """docs/spec.md 4.7: a scale one ulp above a power of two goes to the next power of two; log2's rounding
    (vLLM's exp2(ceil(log2(s)))) leaves it at the power below, and its group's largest element clamps."""
    s = np.float32(2.0**-10) * np.float32(1 + 2**-23)
    x = np.zeros((1, 16), np.float32)
    x[0, 0] = s * np.float32(448)
    _, scale = R.per_token_group_quant_fp8(x, 16, scale_ue8m0=True)
    _, vllm_scale = _vllm_quant(x, 16, True)
    assert scale[0, 0] == 2.0**-9 and vllm_scale[0, 0] == 2.0**-10


def test_nan_stays_nan_and_is_left_out_of_the_maximum():
    x = np.ones((1, 16), np.float32)
    x[0, 3] = np.nan
    q, s = R.per_token_group_quant_fp8(x, 16)
    assert s[0, 0] == np.float32(1) / np.float32(448) and np.isnan(q[0, 3]) and q[0, 0] == np.float32(1) / s[0, 0]


# Bad arguments: a clear error naming the argument, nothing written.

def _triton_args(group_size=64, out_dtype=torch.float8_e4m3fn, scales_shape=(T, H * D // 64),
                 scales_dtype=torch.float32, **kw):
    outs, lses = _inputs(2)
    o, l = torch.from_numpy(outs).to(DEV), torch.from_numpy(lses).to(DEV)
    out = torch.zeros((T, H, D), dtype=out_dtype, device=DEV)
    scales = torch.full(scales_shape, 7.0, dtype=scales_dtype, device=DEV)
    return out, scales, (out, o[0], l[0], o[1], l[1]), dict(group_size=group_size, output_group_scale=scales, **kw)


@pytest.mark.parametrize("change, error, match", [
    (dict(group_size=48), ValueError, "group_size must be a power of two"),
    (dict(group_size=8), ValueError, "group_size must be a power of two >= 16"),
    (dict(group_size=128, scales_shape=(T, 1)), NotImplementedError, "group_size=128 needs a head dim"),
    (dict(scales_shape=(T, 3)), ValueError, r"output_group_scale must be \[T, H \* D / group_size\]"),
    (dict(scales_dtype=torch.float16), TypeError, "output_group_scale"),
    (dict(out_dtype=torch.bfloat16), TypeError, "needs a float8_e4m3fn output"),
    (dict(output_scale=torch.ones(1, device=DEV)), ValueError, "exclude each other"),
    (dict(scale_ue8m0=1), TypeError, "scale_ue8m0 must be a bool"),
])
def test_triton_bad_arguments_raise_and_write_nothing(change, error, match):
    output_scale = change.pop("output_scale", None)
    out, scales, args, kw = _triton_args(**change)
    before = (out.view(torch.uint8).clone(), scales.clone())
    with pytest.raises(error, match=match):
        triton_impl.merge_attn_states(*args, None, None, output_scale, **kw)
    assert torch.equal(out.view(torch.uint8), before[0]) and torch.equal(scales, before[1])


def test_triton_group_scale_without_group_size_is_refused():
    out, scales, args, _ = _triton_args()
    with pytest.raises(ValueError, match="go with group_size"):
        triton_impl.merge_attn_states(*args, output_group_scale=scales)


@pytest.mark.parametrize("kw, error, match", [
    (dict(group_size=64, out_dtype=jnp.bfloat16), TypeError, "needs out_dtype float8_e4m3fn"),
    (dict(group_size=64, scale_layout="diag"), ValueError, "scale_layout must be one of"),
    (dict(scale_layout="col"), ValueError, "go with group_size"),
    (dict(group_size=100), ValueError, "group_size must be a power of two"),
    (dict(group_size=64, output_scale=jnp.ones((1,), jnp.float32)), ValueError, "exclude each other"),
])
@pytest.mark.parametrize("implementation", ["pallas", "jnp"])
def test_jax_bad_arguments_raise(kw, error, match, implementation):
    outs, lses = _inputs(2)
    o, l = jnp.asarray(outs), jnp.asarray(lses)
    with pytest.raises(error, match=match):
        pallas_impl.merge_attn_states(o[0], l[0], o[1], l[1], implementation=implementation, **kw)
    with pytest.raises(error, match=match):
        pallas_impl.merge_attn_states_n(o, l, implementation=implementation, **kw)


def test_group_fp8_is_within_the_float64_reference():
    """Against the float64 merge: the scales within a few f32 ulps of the reference row's, the values within one
    e4m3 rounding."""
    outs, lses = _inputs(3, seed=5)
    out64, _ = R.merge_attn_states_n(outs, lses, prefill_tokens_with_context=PTWC)
    q, s = R.per_token_group_quant_fp8(out64.astype(np.float32), 32)
    got, scales = pallas_impl.merge_attn_states_n(jnp.asarray(outs), jnp.asarray(lses), group_size=32,
                                                  prefill_tokens_with_context=PTWC, return_lse=False,
                                                  implementation="jnp")
    assert np.allclose(np.asarray(scales), s, rtol=2**-20)
    g = np.asarray(got).astype(np.float32).reshape(T, -1, 32) * np.asarray(scales)[..., None]
    w = R.to_fp8(q).astype(np.float32).reshape(T, -1, 32) * s[..., None]
    assert np.all(np.abs(g - w) <= 2**-3 * np.abs(w) + 1e-30) and math.isfinite(float(np.abs(g).max()))


@pytest.mark.gpu
@pytest.mark.parametrize("num_partials", [2, 3, 20])
@pytest.mark.parametrize("ue8m0, layout", [(False, "row"), (True, "col_tma")])
def test_triton_pallas_and_jnp_agree_bit_for_bit_on_gpu(num_partials, ue8m0, layout):
    outs, lses = _inputs(num_partials, seed=11)
    two_way = num_partials == 2
    t_out, t_scales, _ = _triton(outs, lses, 64, ue8m0, layout, two_way)
    for impl in ("pallas", "jnp"):
        got, scales, _ = _pallas(outs, lses, 64, ue8m0, layout, two_way, impl)
        np.testing.assert_array_equal(got.reshape(T, -1), t_out.reshape(T, -1))
        np.testing.assert_array_equal(scales.view(np.int32), t_scales.view(np.int32))



def test_golden_vectors_carry_the_scales(tmp_path, capsys):
    """`export` writes merge.scales for a group case; `verify` passes the kernels' results and a port's results
    files with the right scales, and fails them with scales off by a factor of two (their fp8 values unchanged)."""
    from parity import cli
    from parity.harness import golden
    from parity.harness.golden import verifier

    gold, outs = tmp_path / "gold", tmp_path / "outs"
    pick = ["-k", "group_fp8_g16"]
    assert cli.main(["export", str(gold), "--suite", "full", *pick, "--quiet"]) == 0
    (entry,) = golden.load_manifest(str(gold))["cases"]
    a = golden.load_case(str(gold), entry)
    assert a["merge.scales"].shape == (45, 2 * 128 // 16) and entry["params"]["group_size"] == 16
    assert cli.main(["verify", str(gold), "--impl", "triton", *pick, "--quiet"]) == 0
    case = golden.case_from_params(entry["name"], entry["params"])
    runner = verifier.Runner("jnp")
    results = {op: {k: np.asarray(v) for k, v in runner.run(case, a, op).items() if k in ("out", "lse", "scales",
                                                                                         "output")}
               for op in entry["ops"]}
    verifier.save_outputs(str(outs), case.name, results)
    assert cli.main(["verify", str(gold), "--outputs", str(outs), *pick, "--quiet"]) == 0
    for r in results.values():
        if "scales" in r:
            r["scales"] = r["scales"] * 2
    verifier.save_outputs(str(outs), case.name, results)
    capsys.readouterr()
    assert cli.main(["verify", str(gold), "--outputs", str(outs), *pick, "--quiet"]) == 1
    assert "scales" in capsys.readouterr().out


@pytest.mark.parametrize("method", ["gather", "reduce_scatter"])
@pytest.mark.parametrize("implementation", ["pallas", "jnp"])
def test_jax_cp_combine_quantizes_per_group(method, implementation):
    """The JAX context-parallel combine on 4 vmap-simulated devices (docs/spec.md 9): each device's rows (every
    head for "gather", its heads for "reduce_scatter") quantized per group, within one rounding of the N-way
    merge's (the interpreters' FMA contraction and the reduction order differ; on a GPU "gather" is bit-exact)."""
    import jax

    rng = np.random.default_rng(2)
    heads = 4  # reduce_scatter: one head per device
    o = jnp.asarray((rng.standard_normal((4, T, heads, D)) * 3).astype(np.float16))
    l = jnp.asarray(rng.standard_normal((4, heads, T)).astype(np.float32))

    def combine(out, lse):
        return pallas_impl.cp_merge_attn_states(out, lse, axis_name="cp", method=method, return_lse=False,
                                                group_size=32, scale_ue8m0=True, scale_layout="col",
                                                implementation=implementation)

    q, scales = jax.vmap(combine, axis_name="cp")(o, l)
    want_q, want_s = pallas_impl.merge_attn_states_n(o, l, return_lse=False, group_size=32, scale_ue8m0=True,
                                                     implementation=implementation)
    if method == "gather":  # every device holds every head
        q, scales = q[0], scales[0].T
    else:  # device r: head r, its D / 32 groups
        q = jnp.concatenate(list(q), axis=1)
        scales = jnp.concatenate([s.T for s in scales], axis=1)
    np.testing.assert_allclose(np.asarray(scales), np.asarray(want_s), rtol=2**-18)
    got = np.asarray(q).view(np.uint8).astype(int).reshape(T, -1)
    assert np.abs(got - np.asarray(want_q).view(np.uint8).astype(int).reshape(T, -1)).max() <= 1


@pytest.mark.parametrize("ue8m0", [False, True])
def test_fused_equals_merge_then_the_separate_quantizer_kernel(ue8m0):
    """The fused Triton merge against the Triton merge into f32 followed by the separate quantizer kernel of
    `python -m tools group-fp8-speed` (vLLM's per_token_group_quant_fp8 re-expressed): bit for bit, under the
    interpreter as compiled (both divide with the same f32 `/`)."""
    import sys
    from pathlib import Path

    import triton

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tools.group_fp8_speed import _quant_kernel
    from triton_impl._backend import PARITY_LAUNCH

    outs, lses = _inputs(3, seed=9)
    got, scales, f32 = _triton(outs, lses, 32, ue8m0, "row", two_way=False)
    x = torch.from_numpy(f32).to(DEV)
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=DEV)
    s = torch.empty(T * H * D // 32, device=DEV)
    groups = T * H * D // 32
    with np.errstate(all="ignore"):
        _quant_kernel[(triton.cdiv(groups, 8),)](x, q, s, groups, GROUP=32, BLOCK=8, UE8M0=ue8m0,
                                                 INTERPRET=not GPU, **PARITY_LAUNCH)
    np.testing.assert_array_equal(got.reshape(T, -1), q.view(torch.uint8).cpu().numpy().reshape(T, -1))
    np.testing.assert_array_equal(scales.view(np.int32), s.cpu().numpy().reshape(T, -1).view(np.int32))
