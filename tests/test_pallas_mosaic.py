"""pallas_impl with backend="mosaic_gpu" (experimental; docs/design.md, "Mosaic GPU").

What runs where:
- the backend's argument checks and shape limits: everywhere;
- the kernels on the ci cases against the float64 reference (every operation of `parity.harness.impls.ops_of`): with
  jax >= 0.11, in jax's Mosaic GPU interpreter on CPU and compiled on the GPU;
- lowering every ci case for the GPU (`jax.export`, platforms=["cuda"]): with jax >= 0.11, on any machine (it
  catches what the interpreter cannot: layout inference, shared-memory budgets, TMA shapes);
- bit agreement with the Triton backend: on the GPU.
On a jax without `plgpu.kernel(out_type=...)` (0.10 and older) the kernel tests skip and the backend refuses
with NotImplementedError, which a test asserts.
"""

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from merge_checks import assert_merge_matches_reference

import jax
import jax.numpy as jnp

import pallas_impl
from pallas_impl import _backend as pallas_backend
from parity.library import compare
from parity.harness import cases, impls


def _has_mosaic() -> bool:
    """jax >= 0.11: 0.10 has plgpu.kernel, but its layout inference rejects these kernels."""
    return tuple(int(x) for x in re.findall(r"\d+", jax.__version__)[:2]) >= (0, 11)


HAS_MOSAIC = _has_mosaic()
needs_mosaic = pytest.mark.skipif(not HAS_MOSAIC, reason=f"backend='mosaic_gpu' needs jax >= 0.11; this is jax "
                                                         f"{jax.__version__}")
CI_OPS = [pytest.param(case, op, id=f"{case.name}-{op}") for case in cases.select("ci", kind="all")
          for op in impls.ops_of(case)]
RT = impls.Runtime("cuda" if jax.default_backend() == "gpu" else "cpu",
                   "gpu-bitwise" if jax.default_backend() == "gpu" else "cpu-interpreters")


def _operands(case, op):
    """numpy operands of `op` as `parity.harness.check` builds them: the reference-masked prefix for "merge", the
    reference-masked LSEs for "merge_n" (the mask is exact)."""
    if case.n_way:
        inputs = cases.make_inputs_n(case)
        if op == "merge_n":
            inputs["lses"] = impls.masked_lses(case, inputs)
        return inputs
    inputs = cases.make_inputs(case)
    if op == "merge":
        masked = impls.run(impls.HOST, "reference", "mask", case, inputs)
        inputs.update(prefix_output=masked["output"], prefix_lse=masked["lse"])
    return inputs


def _device(inputs):
    return {k: jnp.asarray(v) for k, v in inputs.items()}


def _check_against_reference(case, op, inputs, got):
    ref = impls.run(impls.HOST, "reference", op, case, inputs)
    loc = dict(case=case, mode="mosaic", query_start_loc=inputs["query_start_loc"])
    if op == "mask":
        compare.assert_bitwise_equal(got["lse"], ref["lse"], name="mask.lse", layout=case.lse_layout, **loc)
        compare.assert_bitwise_equal(got["output"], ref["output"], name="mask.output", **loc)
        return
    assert_merge_matches_reference(case, op, inputs, got["out"], got["lse"], mode="mosaic", scales=got.get("scales"))


@pytest.mark.gpu
@needs_mosaic
@pytest.mark.parametrize("case, op", CI_OPS)
def test_ci_cases_bits_match_the_triton_backend(case, op):
    arrays = _device(_operands(case, op))
    got = impls.run(RT, "mosaic", op, case, arrays)
    impls.set_pallas_backend("triton")  # whatever PALLAS_IMPL_BACKEND says
    try:
        want = impls.run(RT, "pallas", op, case, arrays)
    finally:
        impls.set_pallas_backend(None)
    assert set(got) == set(want)
    for key, w in want.items():
        if w is not None:
            compare.assert_bitwise_equal(got[key], w, name=f"{op}.{key}", case=case, mode="mosaic vs triton")


def _past_the_old_limits(case) -> bool:
    """The options Mosaic GPU refused until 2026-12-05 (N > 64, an output dtype other than the partials' or fp8,
    per-group FP8): the full suite's cases of them."""
    mixed = case.out_dtype is not None and np.dtype(case.out_dtype) not in (np.dtype(case.dtype),
                                                                             np.dtype(jnp.float8_e4m3fn))
    return (case.n_way and case.partials > 64) or mixed or bool(case.group_size)


WIDER_OPS = [pytest.param(case, op, id=f"{case.name}-{op}") for case in cases.select("full", kind="all")
             if _past_the_old_limits(case) for op in impls.ops_of(case) if op != "mask"]


def _odd_heads(name: str, head_dim: int):
    case = cases.by_name(name)
    return dataclasses.replace(case, name=f"{name}_d{head_dim}", head_dim=head_dim)


# Heads whose rows are not whole 16-byte TMA rows of 8-column multiples (padded for the merge kernels) and output
# rows no TMA tile zeroes (H * D * itemsize not a multiple of 16 bytes: zeroed by XLA after the LSE kernel).
ODD_HEAD_OPS = [pytest.param(case, op, id=f"{case.name}-{op}") for case in (
    _odd_heads("padded_v_ptwc", 20), _odd_heads("specials_th", 3), _odd_heads("fp8_out", 12),
    _odd_heads("n3_fp16_th_specials", 33), _odd_heads("n2_fp32_d80_ptwc", 5)) for op in impls.ops_of(case)]


# Every case group above: the ci cases; N > 64 (the weights in blocks of 64, runtime loops over the partials), f32 /
# f16 / bf16 outputs from other partial dtypes (one rounding at the store) and per-group FP8 (quantized in the
# kernel since 2026-12-07); heads of any width.
MOSAIC_OPS = CI_OPS + WIDER_OPS + ODD_HEAD_OPS


@needs_mosaic
@pytest.mark.parametrize("case, op", MOSAIC_OPS)
def test_cases_match_reference(case, op):
    inputs = _operands(case, op)
    got = impls.run(RT, "mosaic", op, case, _device(inputs))
    _check_against_reference(case, op, inputs, got)


@needs_mosaic
@pytest.mark.parametrize("case, op", MOSAIC_OPS)
def test_cases_lower_for_the_gpu(case, op):
    """`op` on `case` lowers to a Mosaic GPU kernel for the GPU (`jax.export`, platforms=["cuda"]), on any machine."""
    inputs = _operands(case, op)
    keys = sorted(inputs)

    def run(*xs):
        got = impls.run(RT, "mosaic-lowered", op, case, dict(zip(keys, xs)))
        return {k: v for k, v in got.items() if v is not None}

    exported = jax.export.export(jax.jit(run), platforms=["cuda"])(
        *[jax.ShapeDtypeStruct(inputs[k].shape, inputs[k].dtype) for k in keys])
    assert "mosaic_gpu" in exported.mlir_module()


@needs_mosaic
@pytest.mark.parametrize("partials", [0, 4])
def test_the_common_merge_is_the_kernel_alone(partials):
    """`[H, T]` LSEs, T >= 128, no fused mask, no pass-through, with the merged LSE: the exported module runs the
    Mosaic GPU kernel and no other XLA work on the data (`_common`: reshapes only; `[T, H]` LSEs are transposed
    around the kernel, docs/design.md says why)."""
    T, H, D = 256, 4, 128
    if partials:
        def merge(o, l):
            return pallas_impl.merge_attn_states_n(o, l, return_lse=True, backend="mosaic_gpu", interpret=False)
        args = [jax.ShapeDtypeStruct((partials, T, H, D), jnp.bfloat16),
                jax.ShapeDtypeStruct((partials, H, T), jnp.float32)]
    else:
        def merge(a, la, b, lb):
            return pallas_impl.merge_attn_states(a, la, b, lb, return_lse=True, backend="mosaic_gpu", interpret=False)
        args = [jax.ShapeDtypeStruct((T, H, D), jnp.bfloat16), jax.ShapeDtypeStruct((H, T), jnp.float32)] * 2
    text = jax.export.export(jax.jit(merge), platforms=["cuda"])(*args).mlir_module()
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1
    ops = set(re.findall(r"stablehlo\.([a-z_]+)", text[text.index("func.func public @main"):]))
    assert ops <= {"custom_call", "reshape", "slice", "return"}, ops


def _long_tiles_differ(case) -> bool:
    from pallas_impl.mosaic import _common as mc

    tune, itemsize = mc.TUNING["merge"], np.dtype(case.dtype).itemsize
    return mc.column_chunk(case.head_dim, itemsize, tune["tile_bytes"]) != mc.column_chunk(
        case.head_dim, itemsize, tune["long_tile_bytes"])


LONG_TILE_OPS = [pytest.param(case, op, id=f"{case.name}-{op}") for case in cases.select("ci", kind="two_way")
                 if _long_tiles_differ(case) for op in impls.ops_of(case) if op.startswith("merge")]


@needs_mosaic
@pytest.mark.parametrize("case, op", LONG_TILE_OPS)
def test_the_long_token_tiles_of_the_two_way_merge_match_reference(case, op, monkeypatch):
    """The 2-way merge's tiles from `long_tokens` on (T = 32K on the GPU: the full check's seed cases), here
    from 128 padded tokens so that the ci cases take them."""
    from pallas_impl.mosaic import _common as mc

    monkeypatch.setitem(mc.TUNING, "merge", dict(mc.TUNING["merge"], long_tokens=mc.BLOCK_T))
    jax.clear_caches()  # the tiles are chosen at trace time
    try:
        inputs = _operands(case, op)
        got = impls.run(RT, "mosaic", op, case, _device(inputs))
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    _check_against_reference(case, op, inputs, got)


def test_the_two_way_merge_takes_the_long_tiles_from_long_tokens():
    from pallas_impl.mosaic import _common as mc

    short, long = mc.TUNING["merge"]["tile_bytes"], mc.TUNING["merge"]["long_tile_bytes"]
    assert short != long
    assert mc.merge_tuning(mc.TUNING["merge"]["long_tokens"] - 1)["tile_bytes"] == short
    assert mc.merge_tuning(mc.TUNING["merge"]["long_tokens"])["tile_bytes"] == long
    assert set(mc.merge_tuning(mc.BLOCK_T)) == {"steps", "concurrent", "tile_bytes", "stores", "ctas_per_sm",
                                                 "compute_wgs", "lse_tma", "row_weights"}


def test_the_grouped_and_nvfp4_launch_choices_apply_to_their_outputs_only(monkeypatch):
    """The 2-way merge's `grouped` choices (per-group FP8 and NVFP4) and the N-way merge's `nvfp4` ones (empty by
    default: set here) replace the plain merges' for those outputs and no other; NVFP4's two compute warpgroups in
    the N-way merge split by rows, whatever `split` says (by columns the GPU wrote wrong codes)."""
    from pallas_impl.mosaic import _common as mc

    nvfp4 = dict(compute_wgs=2)
    monkeypatch.setitem(mc.TUNING, "merge_n", dict(mc.TUNING["merge_n"], nvfp4=nvfp4))
    grouped = mc.TUNING["merge"]["grouped"]
    assert grouped
    assert mc.merge_tuning(mc.BLOCK_T, True) == dict(mc.merge_tuning(mc.BLOCK_T), **grouped)
    plain = {k: v for k, v in mc.TUNING["merge_n"].items() if k != "nvfp4"}
    assert mc.merge_n_tuning(None) == plain
    assert mc.merge_n_tuning((mc.STATIC,)) == plain
    assert mc.merge_n_tuning((128, False)) == plain
    assert mc.merge_n_tuning((mc.NVFP4,)) == dict(plain, **nvfp4, split="rows")
    plain_split = dict(mc.TUNING["merge_n"], compute_wgs=2, split="cols", nvfp4={})
    monkeypatch.setitem(mc.TUNING, "merge_n", plain_split)
    assert mc.merge_n_tuning((128, False))["split"] == "cols"  # per-group FP8 keeps its split
    assert mc.merge_n_tuning((mc.NVFP4,))["split"] == "rows"


def _with_choices(choices: dict, monkeypatch, run):
    """`run()` with the launch `choices` set on both merges (`mc.TUNING`, read at trace time: jax's caches cleared
    before and after)."""
    from pallas_impl.mosaic import _common as mc

    for kernel in ("merge", "merge_n"):
        monkeypatch.setitem(mc.TUNING, kernel, dict(mc.TUNING[kernel], **choices))
    jax.clear_caches()
    try:
        return run()
    finally:
        monkeypatch.undo()
        jax.clear_caches()


PERSISTENT_OPS = [pytest.param(case, op, id=f"{case.name}-{op}") for case in cases.select("ci", kind="all")
                  for op in impls.ops_of(case) if op in ("merge", "merge_n")]


@needs_mosaic
@pytest.mark.parametrize("launch", [dict(ctas_per_sm=1), dict(ctas_per_sm=3), dict(compute_wgs=2),
                                    dict(compute_wgs=2, ctas_per_sm=1), dict(compute_wgs=2, split="rows"),
                                    dict(lse_tma=False), dict(row_weights=False)],
                         ids=lambda d: json.dumps(d))
@pytest.mark.parametrize("case, op", PERSISTENT_OPS)
def test_launch_schedules_match_reference(case, op, launch, monkeypatch):
    """The merges' other schedules: persistent CTAs (`ctas_per_sm`, `mc.Tiles`; in the interpreter
    `INTERPRET_SMS` SMs, so a CTA's pipeline wraps over the column chunks and token tiles and the last CTAs repeat
    the last tile), the warp-specialised pipeline (`compute_wgs`, `mc.compute_warpgroups`; the 2-way merge's tiles
    split by columns or by rows, `mc.warpgroup_tile`), the LSE rows by
    per-thread loads where they would come by TMA (`lse_tma`, `mc.rows_by_tma`: T' a multiple of 4; the cases of
    other T take that path by default) and the 2-way merge's weights relaid out where they would be computed in
    the row layout (`row_weights`)."""
    inputs = _operands(case, op)
    got = _with_choices(launch, monkeypatch, lambda: impls.run(RT, "mosaic", op, case, _device(inputs)))
    _check_against_reference(case, op, inputs, got)


# `[T, H]` LSEs of whole boxes of heads (H a multiple of `mc.TH_HEADS`): T = 260 (a shifted last tile, specials),
# T = 257 (not a multiple of 4), T = 68 (padded to one tile; bf16 D = 256, pass-through rows), an fp8 output with
# base-2 LSEs, and V-padded heads with pass-through rows; N-way: N = 2-4, specials, padded heads (D = 80), D = 512
# into fp8, NVFP4 with pass-through rows.
TH_BOX_OPS = [pytest.param(case, op, id=f"{case.name}-{op}") for case in (
    dataclasses.replace(cases.by_name("specials_th"), name="specials_th_h16", num_heads=16,
                        query_lens=(50, 0, 77, 133)),
    dataclasses.replace(cases.by_name("specials_th"), name="specials_th_h8", num_heads=8),
    dataclasses.replace(cases.by_name("d256_bf16_th"), name="d256_bf16_th_h8", num_heads=8,
                        prefill_tokens_with_context=40),
    dataclasses.replace(cases.by_name("fp8_out"), name="fp8_out_th_h8_base2", num_heads=8, lse_layout="TH",
                        lse_base=2),
    dataclasses.replace(cases.by_name("padded_v_ptwc"), name="padded_v_ptwc_th_h8", num_heads=8, lse_layout="TH"),
    *(dataclasses.replace(cases.by_name(name), name=f"{name}_h8", num_heads=8) for name in (
        "n3_fp16_th_specials", "n4_fp16_d80_th", "n2_bf16_fp8_d512_th_base2", "n4_fp16_nvfp4_th_base2")))
    for op in impls.ops_of(case) if op.startswith("merge")]


@needs_mosaic
@pytest.mark.parametrize("return_lse", [True, False])
@pytest.mark.parametrize("case, op", TH_BOX_OPS)
def test_th_lses_read_in_boxes_of_heads_match_reference(case, op, return_lse, monkeypatch):
    """The merges reading `[T, H]` LSEs as they are and writing their merged LSE so (`th_boxes`, `mc.lse_boxes`):
    each CTA one token tile of `TH_HEADS` heads, their boxes copied once, each head's column picked in registers;
    the same bits as with XLA's transposes (the same arithmetic), and the reference's values."""
    from pallas_impl.mosaic import _common as mc

    taken = []
    boxes = mc.lse_boxes
    monkeypatch.setattr(mc, "lse_boxes", lambda *a: taken.append(boxes(*a)) or taken[-1])
    inputs = _operands(case, op)
    method, args, opts = impls.op_call(op, case, _device(inputs))

    def merged():
        return getattr(impls.adapter(RT, "mosaic"), method)(*args, **opts, return_lse=return_lse)

    want = merged()
    got = _with_choices(dict(th_boxes=True), monkeypatch, merged)
    assert taken == [False, True]
    assert set(got) == set(want)
    for key, w in want.items():
        if w is not None:
            compare.assert_bitwise_equal(got[key], w, name=f"{op}.{key}", case=case, mode="boxes vs transposes")
    assert_merge_matches_reference(case, op, inputs, got["out"], got["lse"] if return_lse else None, mode="mosaic",
                                   scales=got.get("scales"))


@needs_mosaic
@pytest.mark.parametrize("partials", [0, 4])
@pytest.mark.parametrize("fused", [False, True])
def test_th_lses_in_boxes_of_heads_lower_for_the_gpu_with_no_transpose(partials, fused, monkeypatch):
    """The `th_boxes` merges at T = 1001, H = 16 (the flag rows of T' not a multiple of 4 padded to whole 16-byte
    rows for their TMA copy) lowered for the GPU: no XLA transpose left around them."""
    T, H, D = 1001, 16, 128
    kw = dict(lse_layout="TH", return_lse=True, backend="mosaic_gpu", interpret=False)
    o = jax.ShapeDtypeStruct((max(partials, 2), T, H, D), jnp.bfloat16)
    lse = jax.ShapeDtypeStruct((max(partials, 2), T, H), jnp.float32)
    qsl = jax.ShapeDtypeStruct((4,), jnp.int32)
    cu = jax.ShapeDtypeStruct((partials, 4) if partials else (4,), jnp.int32)

    def merge(o, lse, qsl, cu):
        fuse = dict(query_start_loc=qsl, **{"cu_seq_lens" if partials else "prefix_cu_seq_lens": cu}) if fused else {}
        if partials:
            return pallas_impl.merge_attn_states_n(o, lse, **fuse, **kw)
        return pallas_impl.merge_attn_states(o[0], lse[0], o[1], lse[1], **fuse, **kw)

    def lowered():
        return jax.export.export(jax.jit(merge), platforms=["cuda"])(o, lse, qsl, cu).mlir_module()

    text = _with_choices(dict(th_boxes=True), monkeypatch, lowered)
    assert "mosaic_gpu" in text and "stablehlo.transpose" not in text
    assert "stablehlo.transpose" in lowered()  # the default: XLA transposes


@needs_mosaic
@pytest.mark.parametrize("lse_step", [16, 5])
def test_the_n_way_runtime_loops_take_any_lse_step(lse_step, monkeypatch):
    """Beyond `WEIGHT_ROWS` partials the N-way kernel's maximum and sum run as runtime loops of `lse_step` LSE
    loads an iteration (`TUNING["merge_n"]["lse_step"]`): the reference's result at any step (N = 130, `[T, H]`
    LSEs with NaN and +-inf, f32 out), and the default step's bits (the same operations in the same order)."""
    from pallas_impl.mosaic import _common as mc

    case = cases.by_name("n130_bf16_to_fp32_th")
    assert case.partials > mc.WEIGHT_ROWS and lse_step != mc.TUNING["merge_n"]["lse_step"]
    inputs = _operands(case, "merge_n")
    jax.clear_caches()
    default = impls.run(RT, "mosaic", "merge_n", case, _device(inputs))
    monkeypatch.setitem(mc.TUNING, "merge_n", dict(mc.TUNING["merge_n"], lse_step=lse_step))
    jax.clear_caches()  # the step is read at trace time
    try:
        got = impls.run(RT, "mosaic", "merge_n", case, _device(inputs))
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    _check_against_reference(case, "merge_n", inputs, got)
    for key, value in got.items():
        if value is not None:
            np.testing.assert_array_equal(np.asarray(value).view(np.uint8), np.asarray(default[key]).view(np.uint8))


GROUPED_WS = {  # grouped outputs whose half tile (64 columns at D = 128) holds whole groups; and G = 128
    "group_fp8_g128": dict(out_dtype=jnp.float8_e4m3fn, group_size=128),
    "group_fp8_g64": dict(out_dtype=jnp.float8_e4m3fn, group_size=64),
    "group_fp8_g32_ue8m0": dict(out_dtype=jnp.float8_e4m3fn, group_size=32, scale_ue8m0=True),
    "nvfp4_row": dict(out_dtype=jnp.float4_e2m1fn, output_scale=jnp.float32(40.0)),
    "nvfp4_swizzled": dict(out_dtype=jnp.float4_e2m1fn, output_scale=jnp.float32(40.0), scale_layout="swizzled"),
}


@needs_mosaic
@pytest.mark.parametrize("output, split", [(o, "cols") for o in GROUPED_WS if o != "group_fp8_g128"]
                         + [(o, "rows") for o in GROUPED_WS])
def test_grouped_outputs_split_over_two_compute_warpgroups_keep_their_bits(output, split, monkeypatch):
    """Per-group FP8 and NVFP4 with the warp-specialised pipeline (`compute_wgs=2`): each compute warpgroup
    quantizes whole groups of its half tile (`split`: its columns, or its 64 rows, `mc.warpgroup_tile`) with its
    own scale slots, and the outputs, scales and LSE are the one-warpgroup kernels' bits (2-way, its long
    128-column tiles, and N = 3; T = 130, H = 2, D = 128). A group as wide as the tile (128) splits by rows only;
    NVFP4 by columns where each half is `NVFP4_COLUMNS` at least."""
    from pallas_impl.mosaic import _common as mc

    quant = {"group_fp8_g64": (64, False), "group_fp8_g32_ue8m0": (32, True),
             "group_fp8_g128": (128, False)}.get(output, (mc.NVFP4,))
    tune = dict(compute_wgs=2, split=split)
    assert mc.warpgroup_tile(tune, quant, 128, jnp.uint8) == ((2, 64, 128) if split == "rows" else (2, 128, 64))
    assert mc.warpgroup_tile(dict(compute_wgs=2), (128, False), 128, jnp.float8_e4m3fn) == (1, 128, 128)
    assert mc.warpgroup_tile(dict(compute_wgs=2), (mc.NVFP4,), 64, jnp.int4) == (1, 128, 64)
    assert mc.warpgroup_tile(dict(compute_wgs=2, split="rows"), (mc.NVFP4,), 64, jnp.int4) == (2, 64, 64)
    kw = GROUPED_WS[output]
    keys = jax.random.split(jax.random.PRNGKey(3), 2)
    outs = jax.random.normal(keys[0], (3, 130, 2, 128), jnp.bfloat16) * 3
    lses = jax.random.normal(keys[1], (3, 2, 130), jnp.float32)
    results = {}
    for wgs in (1, 2):
        for kernel in ("merge", "merge_n"):
            # (`grouped`, `nvfp4`: the merges' choices for these outputs, emptied so that `compute_wgs` holds)
            # `long_tokens`: the 2-way merge's 128-column tiles at T = 130, so that G = 64 and NVFP4 split
            own = dict(grouped={}, long_tokens=mc.BLOCK_T) if kernel == "merge" else dict(nvfp4={})
            monkeypatch.setitem(mc.TUNING, kernel, dict(mc.TUNING[kernel], compute_wgs=wgs, split=split, **own))
        jax.clear_caches()  # the schedule is chosen at trace time
        two = pallas_impl.merge_attn_states(outs[0], lses[0], outs[1], lses[1], backend="mosaic_gpu",
                                            return_lse=True, **kw)
        many = pallas_impl.merge_attn_states_n(outs, lses, backend="mosaic_gpu", return_lse=True, **kw)
        results[wgs] = [np.asarray(x) for x in jax.tree.leaves((two, many))]
    monkeypatch.undo()
    jax.clear_caches()
    for one, split in zip(results[1], results[2]):
        assert one.dtype == split.dtype and one.shape == split.shape
        np.testing.assert_array_equal(one.view(np.uint8), split.view(np.uint8))


NVFP4_OPS = [pytest.param(case, op, id=f"{case.name}-{op}") for case in map(cases.by_name, (
    "nvfp4_ptwc_specials", "n4_fp16_nvfp4_th_base2")) for op in impls.ops_of(case) if op.startswith("merge")]


@needs_mosaic
@pytest.mark.parametrize("launch", [{}, dict(grouped=dict(compute_wgs=2), nvfp4=dict(compute_wgs=2)),
                                    dict(grouped=dict(compute_wgs=2, split="rows"),
                                         nvfp4=dict(compute_wgs=2, split="rows"))], ids=lambda d: json.dumps(d))
@pytest.mark.parametrize("case, op", NVFP4_OPS)
def test_nvfp4_on_each_schedule_matches_reference(case, op, launch, monkeypatch):
    """NVFP4's codes stored as an int4 tile (its bytes are the packed bytes, viewed as u8 after the kernel)
    against the float64 reference: the full suite's NVFP4 cases (pass-through rows, specials, `[T, H]` base-2
    LSEs, N = 4), on one compute warpgroup and split over two by columns or by rows."""
    inputs = _operands(case, op)
    got = _with_choices(launch, monkeypatch,
                        lambda: impls.run(RT, "mosaic", op, case, _device(inputs)))
    _check_against_reference(case, op, inputs, got)


# ---------------------------------------------------------------------------------------------------------
# Choosing the backend


def _small():
    o = jnp.zeros((3, 130, 2, 64), jnp.bfloat16)
    lse = jnp.zeros((3, 2, 130), jnp.float32)
    qsl = jnp.asarray([0, 100, 130], jnp.int32)
    cu = jnp.asarray([0, 0, 5], jnp.int32)
    return o, lse, qsl, cu


CALLS = {
    "mask": lambda o, lse, qsl, cu, **kw: pallas_impl.mask_empty_context_lse(lse[0], qsl, cu, o[0], **kw),
    "merge": lambda o, lse, qsl, cu, **kw: pallas_impl.merge_attn_states(o[0], lse[0], o[1], lse[1], **kw),
    "merge_n": lambda o, lse, qsl, cu, **kw: pallas_impl.merge_attn_states_n(o, lse, **kw),
}


@pytest.mark.parametrize("fn", CALLS)
def test_an_unknown_backend_is_refused(fn):
    with pytest.raises(ValueError, match=r"backend must be one of \('triton', 'mosaic_gpu'\)"):
        CALLS[fn](*_small(), backend="mosaic")


@pytest.mark.parametrize("fn", CALLS)
def test_mosaic_gpu_does_not_go_with_the_jnp_path(fn):
    with pytest.raises(ValueError, match="backend='mosaic_gpu' selects a Pallas kernel"):
        CALLS[fn](*_small(), backend="mosaic_gpu", implementation="jnp")


@pytest.mark.skipif(HAS_MOSAIC, reason="this jax has the Mosaic GPU kernel API")
@pytest.mark.parametrize("fn", CALLS)
def test_mosaic_gpu_needs_jax_0_11(fn):
    with pytest.raises(NotImplementedError, match=r"needs jax >= 0.11"):
        CALLS[fn](*_small(), backend="mosaic_gpu")


CP_CASE = dataclasses.replace(cases.by_name("n4_bf16_fp8_out"), out_dtype=None, prefill_tokens_with_context=30)


def _cp_operands(lse_layout, lse_base):
    inputs = {k: jnp.asarray(v) for k, v in cases.make_inputs_n(CP_CASE).items()}
    lses = inputs["lses"] if lse_layout == "HT" else jnp.swapaxes(inputs["lses"], 1, 2)
    if lse_base == 2:
        lses = lses * np.float32(1 / math.log(2))
    return inputs["outputs"], lses, inputs["query_start_loc"], inputs["cu_seq_lens"]


@pytest.mark.gpu
@needs_mosaic
@pytest.mark.parametrize("lse_layout, lse_base, reduce_dtype, fused", [
    ("HT", math.e, jnp.float32, True), ("TH", 2, jnp.bfloat16, False)])
def test_cp_rescale_gives_the_triton_backends_bits(lse_layout, lse_base, reduce_dtype, fused):
    # The rescale kernel of method="reduce_scatter", rank by rank: each rank's weighted partial and the merged LSE,
    # against the Triton backend's, bit for bit, compiled on a GPU. Not in the two interpreters on a CPU: both run
    # XLA:CPU, which contracts FMAs per program (1-ulp differences in the base-2 LSE, jax 0.11.2, 2026-12-05). (jax's
    # Mosaic GPU interpreter does not run under a named vmap: the whole combine is lowered below.)
    from pallas_impl import cp_merge
    from pallas_impl.mosaic.cp_merge import rescale_mosaic

    outs, lses, qsl, cus = _cp_operands(lse_layout, lse_base)
    kw = dict(reduce_dtype=jnp.dtype(reduce_dtype), return_lse=True, lse_layout=lse_layout, lse_base2=lse_base == 2,
              interpret=jax.default_backend() == "cpu")  # on a GPU: the compiled kernels
    for rank in range(outs.shape[0]):
        args = (outs[rank], lses, qsl if fused else None, cus if fused else None,
                CP_CASE.prefill_tokens_with_context, jnp.int32(rank))
        got, want = rescale_mosaic(*args, **kw), cp_merge._rescale_jit(*args, **kw)
        for name, g, w in zip(("scaled", "lse"), got, want):
            compare.assert_bitwise_equal(np.asarray(g), np.asarray(w), name=f"rank {rank} {name}", case=CP_CASE,
                                         mode="mosaic vs triton")


@needs_mosaic
@pytest.mark.parametrize("fused", [False, True])
def test_cp_rescale_past_64_devices_matches_the_jnp_path(fused):
    """N = 70 devices (the rescale's loops over the partials at runtime, each LSE row loaded per loop): ranks 0, 37
    and 69 against the jnp path's rescale, within f32 rounding (the interpreter runs XLA:CPU arithmetic; the bits
    are the GPU's check)."""
    from pallas_impl import jnp_fallback
    from pallas_impl.mosaic.cp_merge import rescale_mosaic


    case = dataclasses.replace(CP_CASE, name="n70_cp", partials=70)
    inputs = {k: jnp.asarray(v) for k, v in cases.make_inputs_n(case).items()}
    outs, lses = inputs["outputs"], inputs["lses"]
    qsl, cus = (inputs["query_start_loc"], inputs["cu_seq_lens"]) if fused else (None, None)
    kw = dict(reduce_dtype=jnp.dtype(jnp.float32), return_lse=True, lse_layout="HT", lse_base2=False)
    for rank in (0, 37, 69):
        args = (outs[rank], lses, qsl, cus, case.prefill_tokens_with_context, jnp.int32(rank))
        got = rescale_mosaic(*args, **kw, interpret=jax.default_backend() == "cpu")
        want = jnp_fallback.cp_rescale(*args, **kw)
        for name, g, w in zip(("scaled", "lse"), got, want):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-6, atol=1e-6, err_msg=f"rank {rank} {name}")


@needs_mosaic
def test_cp_reduce_scatter_lowers_for_the_gpu():
    outs, lses, qsl, cus = _cp_operands("HT", math.e)

    def combine(out, lse, cu):
        return pallas_impl.cp_merge_attn_states(out, lse, axis_name="cp", method="reduce_scatter", query_start_loc=qsl,
                                                cu_seq_lens=cu, prefill_tokens_with_context=30, backend="mosaic_gpu",
                                                interpret=False)

    exported = jax.export.export(jax.jit(jax.vmap(combine, axis_name="cp")), platforms=["cuda"])(
        *[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (outs, lses, cus)])
    assert "mosaic_gpu" in exported.mlir_module()


def test_the_default_backend_is_triton_unless_the_environment_says_otherwise(monkeypatch):
    monkeypatch.delenv("PALLAS_IMPL_BACKEND", raising=False)
    assert pallas_backend.resolve_backend(None) == "triton"
    monkeypatch.setenv("PALLAS_IMPL_BACKEND", "mosaic_gpu")
    assert pallas_backend.resolve_backend(None) == "mosaic_gpu"
    assert pallas_backend.resolve_backend("triton") == "triton"  # an explicit argument wins
    # The environment picks the Pallas kernels' backend only: the jnp path stays available.
    o, lse, qsl, cu = _small()
    want = pallas_impl.merge_attn_states_n(o, lse, implementation="jnp", backend=None)
    monkeypatch.setenv("PALLAS_IMPL_BACKEND", "cuda")
    with pytest.raises(ValueError, match=r"PALLAS_IMPL_BACKEND must be one of \('triton', 'mosaic_gpu'\)"):
        pallas_backend.resolve_backend(None)
    monkeypatch.delenv("PALLAS_IMPL_BACKEND")
    got = pallas_impl.merge_attn_states_n(o, lse, implementation="jnp")
    assert all(np.array_equal(np.asarray(g), np.asarray(w), equal_nan=True) for g, w in zip(got, want))


def _abstract_hopper():
    """Lowering for an H100 on any machine: the Pallas Triton lowering asks for the GPU's compute capability, which
    an abstract mesh's device kind gives where there is no GPU."""
    from jax._src.mesh import AbstractDevice

    try:
        device = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=None, platform="gpu")
        return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device))
    except TypeError:  # jax 0.10.0: no abstract GPU device
        pytest.skip(f"jax {jax.__version__} cannot lower for a GPU it does not see (no abstract GPU device)")


TRITON_CALLS = dict(CALLS, cp_merge=lambda o, lse, qsl, cu, **kw: jax.vmap(
    lambda x, y: pallas_impl.cp_merge_attn_states(x, y, axis_name="cp", method="reduce_scatter", **kw),
    axis_name="cp")(o[:2], lse[:2]))


@pytest.mark.parametrize("fn", TRITON_CALLS)
def test_triton_backend_kernels_lower_without_the_deprecation_and_leave_the_warning_filters_alone(fn):
    """Our Triton-backend kernels lower for the GPU through their own compiler parameters' rule, on any machine,
    without jax's deprecation warning (the filter lives in their own lowering only,
    `_backend._compiler_params_type`); the process's warning filters are left as they were, and the caller's own
    Triton-backend kernel still warns where jax deprecates that backend (jax >= 0.11)."""
    from jax.experimental import pallas as pl


    def own_kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1

    def theirs(x):
        return pl.pallas_call(own_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=False,
                              compiler_params=pallas_backend.pltriton.CompilerParams(num_warps=4))(x)

    def ours(*xs):
        return TRITON_CALLS[fn](*xs, implementation="pallas", backend="triton", interpret=False)

    def lower(f, *xs):
        return jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=[
            jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
                *[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in xs]).mlir_module()

    deprecation = re.compile(pallas_backend.TRITON_DEPRECATION)
    args, x, hopper = _small(), jnp.zeros((16,), jnp.float32), _abstract_hopper()
    with warnings.catch_warnings(record=True) as seen, hopper:
        warnings.simplefilter("always")
        filters = list(warnings.filters)
        assert "xla.gpu.triton" in lower(ours, *args)
        assert not [w for w in seen if deprecation.match(str(w.message))]
        assert warnings.filters == filters
        lower(theirs, x)
        deprecates = HAS_MOSAIC  # jax >= 0.11
        assert [w.category for w in seen if deprecation.match(str(w.message))] == [DeprecationWarning] * deprecates


# ---------------------------------------------------------------------------------------------------------
# Shape limits of the Mosaic GPU kernels (pure functions: no GPU, any jax)


@pytest.mark.parametrize("head_dim, itemsize, cols", [
    (64, 2, 64), (80, 2, 80), (128, 2, 128), (192, 2, 96), (256, 2, 128), (512, 2, 128),  # <= 32 KiB tiles of 128 rows
    (32, 4, 32), (64, 4, 64), (80, 4, 40), (96, 4, 48), (512, 4, 64), (16, 4, 16), (48, 2, 48)])
def test_column_chunks_divide_the_head_in_16_byte_rows_within_the_tile_budget(head_dim, itemsize, cols):
    from pallas_impl.mosaic import _common as mc

    assert mc.column_chunk(head_dim, itemsize) == cols


@pytest.mark.parametrize("head_dim, itemsize, columns", [
    (20, 2, 24), (3, 4, 8), (33, 2, 40), (80, 4, 80), (12, 4, 16), (64, 2, 64), (1, 2, 8), (33, 1, 48)])
def test_heads_of_rows_not_whole_tma_rows_are_padded(head_dim, itemsize, columns):
    from pallas_impl.mosaic import _common as mc

    assert mc.head_columns(head_dim, itemsize) == columns
    assert mc.column_chunk(columns, itemsize) > 0  # a padded head is a kernel's head
    if columns != head_dim:
        with pytest.raises(ValueError, match=f"got D={head_dim} with {itemsize}-byte elements"):
            mc.column_chunk(head_dim, itemsize)


@pytest.mark.parametrize("row_elems, itemsize, tile", [
    (4 * 64, 2, (1, 256)), (16 * 128, 2, (8, 256)), (1 * 512, 4, (2, 256)), (20 * 16, 4, (2, 160)),
    (5 * 96, 2, (2, 240)), (128 * 128, 2, (64, 256))])
def test_mask_zero_tiles_cover_one_output_row(row_elems, itemsize, tile):
    from pallas_impl.mosaic import mask

    assert mask._zero_tile(row_elems, itemsize) == tile
    assert math.prod(tile) == row_elems


@pytest.mark.parametrize("row_elems, itemsize", [(5 * 3, 2), (128 * 512, 2)])
def test_mask_output_rows_no_tma_tile_holds_are_left_to_xla(row_elems, itemsize):
    from pallas_impl.mosaic import mask

    assert mask._zero_tile(row_elems, itemsize) is None


NO_TRITON = """
import importlib.abc, sys

class NoPallasTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "jax.experimental.pallas.triton":
            raise ImportError("this jax has no Pallas Triton backend")
        return None

sys.meta_path.insert(0, NoPallasTriton())
import pallas_impl
from pallas_impl import _backend as c

print(c.pltriton is None, c.resolve_backend(None))
try:
    c.resolve_backend("triton")
except NotImplementedError as e:
    print(e)
if c.has_mosaic_gpu():  # every entry point and option runs on the default, Mosaic GPU (its interpreter, on a CPU)
    import jax, jax.numpy as jnp, numpy as np
    o = jnp.linspace(-1, 1, 130 * 2 * 64, dtype=jnp.float32).reshape(130, 2, 64).astype(jnp.bfloat16)
    l = jnp.linspace(-3, 3, 260, dtype=jnp.float32).reshape(2, 130)
    outs, lses = jnp.stack([o, o[::-1], -o]), jnp.stack([l, l[:, ::-1], l * 0.5])
    wide, wide_l = jnp.tile(outs[:, :20], (24, 1, 1, 1)), jnp.tile(lses[:, :, :20], (24, 1, 1))  # N = 72 > 64
    qsl, cu = jnp.array([0, 60, 130], jnp.int32), jnp.array([0, 0, 9], jnp.int32)
    g = jnp.float32(224.0)
    calls = {
        "mask": lambda **k: pallas_impl.mask_empty_context_lse(l, qsl, cu, o, **k),
        "merge": lambda **k: pallas_impl.merge_attn_states(o, l, o[::-1], l[:, ::-1], **k),
        "merge fused, f32 out": lambda **k: pallas_impl.merge_attn_states(
            o, l, o[::-1], l[:, ::-1], query_start_loc=qsl, prefix_cu_seq_lens=cu, out_dtype=jnp.float32, **k),
        "merge fp8": lambda **k: pallas_impl.merge_attn_states(o, l, o[::-1], l[:, ::-1], out_dtype=jnp.float8_e4m3fn,
                                                               output_scale=jnp.float32(0.05), **k),
        "merge per-group fp8": lambda **k: pallas_impl.merge_attn_states(o, l, o[::-1], l[:, ::-1], group_size=32,
                                                                         **k),
        "merge nvfp4": lambda **k: pallas_impl.merge_attn_states(o, l, o[::-1], l[:, ::-1], output_scale=g,
                                                                 out_dtype=jnp.float4_e2m1fn, **k),
        "merge_n": lambda **k: pallas_impl.merge_attn_states_n(outs, lses, prefill_tokens_with_context=100, **k),
        "merge_n N = 72": lambda **k: pallas_impl.merge_attn_states_n(wide, wide_l, **k),
        "merge_n nvfp4": lambda **k: pallas_impl.merge_attn_states_n(outs, lses, out_dtype=jnp.float4_e2m1fn,
                                                                     output_scale=g, scale_layout="swizzled", **k),
        # one CPU device: JAX's Mosaic GPU interpreter runs no kernel under a vmap axis name, nor the rescale
        # kernel on several devices at once (docs/design.md, "Mosaic GPU backend")
        "cp combine": lambda **k: [jax.shard_map(
            lambda a, b: pallas_impl.cp_merge_attn_states(a[0], b[0], axis_name="cp", method=m, **k)[0][None],
            mesh=jax.make_mesh((1,), ("cp",), axis_types=(jax.sharding.AxisType.Auto,)),
            in_specs=(jax.P("cp"), jax.P("cp")), out_specs=jax.P("cp"), check_vma=False)(outs[:1], lses[:1])
            for m in ("gather", "reduce_scatter")],
    }
    bad = []
    for name, call in calls.items():
        got = jax.tree.leaves(call(implementation="pallas"))
        want = jax.tree.leaves(call(implementation="jnp"))
        for x, y in zip(got, want):  # the interpreters' float math differs: values within a rounding or a code
            x, y = np.asarray(x), np.asarray(y)
            if x.dtype == np.uint8:  # packed NVFP4 codes: 99% of the bytes equal
                ok = x.shape == y.shape and (x == y).mean() > 0.99
            else:
                x, y = x.astype(np.float32), y.astype(np.float32)
                ok = x.shape == y.shape and np.allclose(x, y, rtol=0.07, atol=1e-2, equal_nan=True)
            if not ok:
                bad.append(name)
    print("kernels ran", len(calls), "differ", sorted(set(bad)))
else:
    print("kernels ran", 0, "differ", [])
"""


def test_without_the_pallas_triton_backend_the_default_is_mosaic_gpu():
    # A future jax without jax.experimental.pallas.triton: pallas_impl still imports and defaults to Mosaic GPU;
    # asking for the Triton backend says why it cannot run; with jax >= 0.11 every entry point and output option
    # (the mask, fused and quantized merges, N > 64, NVFP4, the CP combine) runs on that default, no call breaks.
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    r = subprocess.run([sys.executable, "-c", NO_TRITON], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    first, second, third = r.stdout.strip().splitlines()
    assert first == "True mosaic_gpu"
    assert "has no Pallas Triton backend" in second and "use backend='mosaic_gpu'" in second
    assert third == ("kernels ran 10 differ []" if HAS_MOSAIC else "kernels ran 0 differ []"), third


def test_pallas_impl_modules_import_no_cycle():
    # Every import among pallas_impl's modules, module-level or inside a function (the backend dispatch), points
    # one way: _math below the layers (_backend, _checks, _device, ...) below the op files; a Triton-backend op file may reach its Mosaic GPU
    # counterpart, never the reverse.
    import ast

    root = Path(__file__).resolve().parents[1]
    files = {".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
             for p in (root / "pallas_impl").rglob("*.py")}
    graph = {}
    for mod, path in files.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                deps |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module
                         for a in node.names}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
        graph[mod] = {d for d in deps if d in files and d != mod and d != "pallas_impl"}
    assert graph["pallas_impl._math"] == set()
    state = {}

    def visit(mod, path):
        if state.get(mod) == "open":
            raise AssertionError("import cycle: " + " -> ".join(path + [mod]))
        if state.get(mod) == "done":
            return
        state[mod] = "open"
        for dep in sorted(graph[mod]):
            visit(dep, path + [mod])
        state[mod] = "done"

    for mod in sorted(graph):
        visit(mod, [])
    assert "pallas_impl.mosaic.merge" in graph["pallas_impl.merge"]  # the dispatch edge is seen


@needs_mosaic
@pytest.mark.parametrize("lse_layout", ["HT", "TH"])
def test_mask_updates_donated_buffers_in_place(lse_layout):
    # The compiled mask aliases the LSE and output arguments to its results: with donation, no copy (the exported
    # module marks both arguments as aliased to results, and the kernel's custom call aliases its operands).
    T, H, D = 300, 4, 64
    lse = jax.ShapeDtypeStruct((H, T) if lse_layout == "HT" else (T, H), jnp.float32)
    out = jax.ShapeDtypeStruct((T, H, D), jnp.bfloat16)
    offs = jax.ShapeDtypeStruct((4,), jnp.int32)

    def mask(lse, out, qsl, cu):
        return pallas_impl.mask_empty_context_lse(lse, qsl, cu, out, lse_layout=lse_layout, backend="mosaic_gpu",
                                                  interpret=False)

    text = jax.export.export(jax.jit(mask, donate_argnums=(0, 1)), platforms=["cuda"])(lse, out, offs, offs)
    text = text.mlir_module()
    main = next(line for line in text.splitlines() if "func.func public @main" in line)
    assert main.count("tf.aliasing_output") == 2, main
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1
    assert "output_operand_aliases" in text


@needs_mosaic
@pytest.mark.parametrize("lse_layout", ["HT", "TH"])
# The request bounds: binary searches in shared memory (< 128 requests), windows, binary searches in global memory
@pytest.mark.parametrize("num_requests", [100, 300, 1100])
@pytest.mark.parametrize("with_output", [True, False])
def test_mask_of_many_short_requests_matches_the_reference(lse_layout, num_requests, with_output):
    # Requests of 0-14 tokens, ~half empty: blocks intersect many requests, and the output zeroing takes both
    # its multi-token stores and its single-token tail for runs of every length.
    from pallas_impl.mosaic import mask

    assert mask.WINDOW_MAX_REQUESTS < 1100
    rng = np.random.default_rng(5)
    T, H, D, R = 2000, 4, 32, num_requests
    lens = rng.integers(0, 15, R)
    qsl = np.minimum(np.r_[0, np.cumsum(lens)], T - 7).astype(np.int32)
    cu = np.r_[0, np.cumsum(rng.integers(0, 2, R))].astype(np.int32)
    lse = rng.standard_normal((H, T) if lse_layout == "HT" else (T, H)).astype(np.float32)
    out = rng.standard_normal((T, H, D)).astype(np.float32)
    got = pallas_impl.mask_empty_context_lse(jnp.asarray(lse), jnp.asarray(qsl), jnp.asarray(cu),
                                             jnp.asarray(out) if with_output else None, lse_layout=lse_layout,
                                             backend="mosaic_gpu")
    from parity.harness import reference

    assert 0.25 * qsl[-1] < reference.empty_token_mask(qsl, cu, T).sum() < 0.75 * qsl[-1]
    want_lse, want_out = reference.mask_empty_context_lse(lse, qsl, cu, out, lse_layout=lse_layout)
    got_lse = got[0] if with_output else got
    compare.assert_bitwise_equal(np.asarray(got_lse), want_lse.astype(np.float32), name="mask.lse", layout=lse_layout)
    if with_output:
        compare.assert_bitwise_equal(np.asarray(got[1]), want_out.astype(np.float32), name="mask.output")


# ---------------------------------------------------------------------------------------------------------
# Shared memory at every tile size: long-T tiles with an f32 (or quantized, stored as f32) output


def _smem(dc, itemsize, out_itemsize, input_tiles, out_slots, other):
    from pallas_impl.mosaic import _common as mc

    return mc.BLOCK_T * dc * (input_tiles * itemsize + out_slots * out_itemsize) + other


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("head_dim", [64, 80, 128, 192, 256, 512])
def test_every_merge_tile_fits_shared_memory(dtype, out_dtype, head_dim):
    """`head_plan` narrows a kernel's tile until its shared memory fits (fp8: tiles of 16-byte rows): the 2-way
    merge at its short and long tiles, the N-way merge at N = 2 and past WEIGHT_ROWS, the CP rescale. Before 2026-12-07 the 2-way merge's
    long-T tiles with an f32 output of bf16 partials (every quantized output then: f32 rows) asked for 258 KiB and
    failed to compile at T >= 32K."""
    from pallas_impl.mosaic import _common as mc

    itemsize, out_itemsize = np.dtype(dtype).itemsize, np.dtype(jnp.dtype(out_dtype)).itemsize
    for tokens in (mc.BLOCK_T, mc.TUNING["merge"]["long_tokens"]):
        tune = mc.merge_tuning(tokens)
        shape = dict(input_tiles=2 * tune["concurrent"], out_slots=tune["stores"], other_bytes=4 * mc.BLOCK_T * 4)
        cols, dc = mc.head_plan(head_dim, dtype, tune["tile_bytes"], out_dtype=out_dtype, **shape)
        assert cols % dc == 0 and _smem(dc, itemsize, out_itemsize, *shape.values()) <= mc.SMEM_BYTES
        # the widest tile within the budget: a tile twice as wide (where one divides the head) would not fit
        wider = mc.column_chunk(cols, itemsize, tune["tile_bytes"], 16 // math.gcd(16, out_itemsize))
        if wider != dc:
            assert _smem(2 * dc, itemsize, out_itemsize, *shape.values()) > mc.SMEM_BYTES
    tune = mc.TUNING["merge_n"]
    for partials in (2, 300):
        other = (min(partials, mc.WEIGHT_ROWS) + 4) * mc.BLOCK_T * 4
        _, dc = mc.head_plan(head_dim, dtype, tune["tile_bytes"], out_dtype=out_dtype, input_tiles=tune["concurrent"],
                             out_slots=tune["stores"], other_bytes=other)
        assert _smem(dc, itemsize, out_itemsize, tune["concurrent"], tune["stores"], other) <= mc.SMEM_BYTES


def test_long_tiles_of_bf16_into_f32_are_narrowed():
    from pallas_impl.mosaic import _common as mc

    tune = mc.merge_tuning(mc.TUNING["merge"]["long_tokens"])
    shape = dict(input_tiles=2 * tune["concurrent"], out_slots=tune["stores"], other_bytes=4 * mc.BLOCK_T * 4)
    assert mc.head_plan(128, "bfloat16", tune["tile_bytes"], out_dtype="bfloat16", **shape) == (128, 128)
    assert mc.head_plan(128, "bfloat16", tune["tile_bytes"], out_dtype="float32", **shape) == (128, 64)


LONG_T_OUTPUTS = {
    "float32": dict(out_dtype=jnp.float32),
    "static_fp8": dict(out_dtype=jnp.float8_e4m3fn, output_scale=jnp.float32(0.5)),
    "group_fp8": dict(group_size=128),
    "group_fp8_ue8m0": dict(group_size=64, scale_ue8m0=True),
    "nvfp4_row": dict(out_dtype=jnp.float4_e2m1fn, output_scale=jnp.float32(40.0)),
    "nvfp4_swizzled": dict(out_dtype=jnp.float4_e2m1fn, output_scale=jnp.float32(40.0), scale_layout="swizzled"),
}


@pytest.mark.gpu
@needs_mosaic
@pytest.mark.parametrize("num_tokens", [130, 1001, 2048, 16384, 16411, 32768, 131072])
@pytest.mark.parametrize("output", list(LONG_T_OUTPUTS) + ["bf16_th", "bf16_th_lse"])
def test_quantized_and_f32_outputs_at_long_t_give_the_triton_backends_bits(num_tokens, output):
    """Every quantized output and an f32 one, 2-way (the fused mask, pass-through rows) and N = 4, bf16, H = 16,
    D = 128, at T = 130 to 131K on Mosaic GPU: the Triton backend's bits (at T >= 32K the 2-way merge's long
    tiles failed to compile before 2026-12-07; at T not a multiple of 16 the last tile's scale rows were a
    misaligned TMA store until 2026-12-07). Also `[T, H]` LSEs with NaN and -inf among them (`bf16_th`), with and
    without the merged LSE."""
    _assert_same_bits(_long_t_merges(num_tokens, output, "mosaic_gpu"), _long_t_merges(num_tokens, output, "triton"))


def _long_t_merges(num_tokens: int, output: str, backend: str) -> list:
    """The long-T test's merges on `backend`: 2-way (the fused mask, pass-through rows) and N = 4, bf16, H = 16,
    D = 128, with the options of `output` (`LONG_T_OUTPUTS`; "bf16": none); their results as numpy arrays."""
    heads, head_dim, partials = 16, 128, 4
    keys = jax.random.split(jax.random.PRNGKey(num_tokens), 2)
    outs = jax.random.normal(keys[0], (partials, num_tokens, heads, head_dim), jnp.bfloat16) * 3
    lses = jax.random.normal(keys[1], (partials, heads, num_tokens), jnp.float32)
    qsl = jnp.asarray([0, 7, num_tokens // 2, num_tokens - 5], jnp.int32)
    cu = jnp.asarray([0, 3, 3, 9], jnp.int32)  # request 1: an empty prefix chunk
    kw = dict(LONG_T_OUTPUTS.get(output, {}))
    if output.startswith("bf16_th"):
        lses = jnp.swapaxes(lses, 1, 2).at[:, ::5, 3].set(jnp.nan).at[:, ::7, 9].set(-jnp.inf)
        kw.update(lse_layout="TH", return_lse=output.endswith("lse"))
    two = pallas_impl.merge_attn_states(outs[0], lses[0], outs[1], lses[1], query_start_loc=qsl,
                                        prefix_cu_seq_lens=cu, prefill_tokens_with_context=num_tokens - 3,
                                        implementation="pallas", backend=backend, **kw)
    many = pallas_impl.merge_attn_states_n(outs, lses, implementation="pallas", backend=backend, **kw)
    return [np.asarray(x) for x in jax.tree.leaves((two, many))]


def _assert_same_bits(got: list, want: list) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(g.view(np.uint8) if g.dtype.itemsize == 1 else g,
                                      w.view(np.uint8) if w.dtype.itemsize == 1 else w)


# The launch choices `python -m tools mosaic-speed` sweeps that no default takes yet, with the outputs they change:
# before one becomes a default, the GPU gives its bits here (the interpreter tests above check it on a CPU).
CANDIDATES = {
    "nvfp4_n_way_rows": (dict(nvfp4=dict(compute_wgs=2, split="rows")), ["nvfp4_row", "nvfp4_swizzled"]),
    "th_boxes": (dict(th_boxes=True), ["bf16_th", "bf16_th_lse"]),  # `[T, H]` LSEs in boxes of heads
}


@pytest.mark.gpu
@needs_mosaic
@pytest.mark.parametrize("num_tokens", [1001, 32768])
@pytest.mark.parametrize("candidate, output", [(c, o) for c, (_, outs) in CANDIDATES.items() for o in outs])
def test_launch_candidates_give_the_triton_backends_bits(candidate, output, num_tokens, monkeypatch):
    """Each candidate of `CANDIDATES` (set on both merges) compiled on the GPU: the Triton backend's bits at a T
    that is not a multiple of 16 (the shifted last tile) and at the 2-way merge's long tiles."""
    want = _long_t_merges(num_tokens, output, "triton")
    got = _with_choices(CANDIDATES[candidate][0], monkeypatch, lambda: _long_t_merges(num_tokens, output, "mosaic_gpu"))
    _assert_same_bits(got, want)


@pytest.mark.parametrize("num_tokens", [1, 127, 128, 130, 255, 256, 1001, 4096 + 77])
def test_scale_rows_of_each_tile_come_back_in_token_order(num_tokens):
    """The grouped scales' rows as the kernels write them (a row block per token tile, the shifted last tile's
    too: `tile_scale_rows`), put back in token order by `tile_scales`: each token's own scale."""
    from pallas_impl.mosaic import _common as mc

    tp = max(num_tokens, mc.BLOCK_T)
    tiles, groups = -(-tp // mc.BLOCK_T), 3
    raw = np.full((tiles * groups, mc.BLOCK_T), -1.0, np.float32)
    for k in range(tiles):
        t0 = min(k * mc.BLOCK_T, tp - mc.BLOCK_T)  # `tile_start`
        row = -(-t0 // mc.BLOCK_T) * groups  # the tile of `tile_scale_rows`
        assert row == k * groups
        tokens = t0 + np.arange(mc.BLOCK_T)
        raw[row:row + groups] = tokens[None, :] * 10.0 + np.arange(groups)[:, None]
    want = np.arange(num_tokens)[None, :] * 10.0 + np.arange(groups)[:, None]
    np.testing.assert_array_equal(np.asarray(mc.tile_scales(jnp.asarray(raw), num_tokens)), want)


@pytest.mark.parametrize("dtype, head_dim, group_size, in_kernel", [
    ("bfloat16", 128, 128, True), ("bfloat16", 128, 16, True), ("float16", 512, 128, True),
    ("float16", 512, 256, False),  # [128, 256] f16 tiles x 2 inputs x 2 steps: 256 KiB, no tile fits
])
def test_per_group_tiles_hold_whole_groups_else_xla_quantizes(dtype, head_dim, group_size, in_kernel):
    """The 2-way merge's plan for per-group FP8 (`output_plan`): tiles a multiple of G wide, their scales counted
    in shared memory; where no such tile fits, f32 rows that XLA quantizes. NVFP4: tiles of 64 columns and more."""
    import functools

    from pallas_impl.mosaic import _common as mc

    tune = mc.merge_tuning(mc.BLOCK_T)
    shape = dict(input_tiles=2 * tune["concurrent"], out_slots=tune["stores"], other_bytes=5 * mc.BLOCK_T * 4)
    plan = functools.partial(mc.head_plan, head_dim, dtype, tune["tile_bytes"], **shape)
    quant, stored, (cols, dc) = mc.output_plan(jnp.float8_e4m3fn, None, (group_size, False, "row"), plan)
    assert (quant == (group_size, False)) == in_kernel
    if in_kernel:
        itemsize = np.dtype(dtype).itemsize
        smem = mc.BLOCK_T * (dc * 2 * tune["concurrent"] * itemsize + tune["stores"] * (dc + dc // group_size * 4))
        assert stored == jnp.float8_e4m3fn and dc % group_size == 0 and cols % dc == 0
        assert smem + shape["other_bytes"] <= mc.SMEM_BYTES
    else:
        assert stored == jnp.float32
    quant, stored, (_, dc) = mc.output_plan(jnp.float4_e2m1fn, jnp.ones(1), (16, "nvfp4", "row"), plan)
    assert quant == (mc.NVFP4,) and stored == jnp.int4 and dc % mc.NVFP4_COLUMNS == 0


def _avals(jaxpr):
    """Every output aval of every equation of `jaxpr`, its sub-jaxprs' too."""
    for eqn in jaxpr.eqns:
        yield from (v.aval for v in eqn.outvars)
        for p in eqn.params.values():
            for sub in p if isinstance(p, (tuple, list)) else (p,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _avals(inner)


QUANTIZED_IN_KERNEL = {  # output -> (dtype, D, options, quantized in the kernel)
    "static_fp8": (jnp.bfloat16, 128, LONG_T_OUTPUTS["static_fp8"], True),
    "group_fp8": (jnp.bfloat16, 128, LONG_T_OUTPUTS["group_fp8"], True),
    "nvfp4_row": (jnp.bfloat16, 128, LONG_T_OUTPUTS["nvfp4_row"], True),
    "nvfp4_swizzled": (jnp.bfloat16, 64, LONG_T_OUTPUTS["nvfp4_swizzled"], True),
    "nvfp4_d16": (jnp.bfloat16, 16, LONG_T_OUTPUTS["nvfp4_row"], False),  # no tile of 64 int4 columns divides D
    "nvfp4_d32": (jnp.bfloat16, 32, LONG_T_OUTPUTS["nvfp4_row"], False),  # 32-column int4 tiles: wrong on the GPU
    "group_fp8_g256_f32": (jnp.float32, 256, dict(group_size=256), False),  # no tile of a group fits
}


@needs_mosaic
@pytest.mark.parametrize("partials", [2, 3])
@pytest.mark.parametrize("output", list(QUANTIZED_IN_KERNEL))
def test_quantized_outputs_leave_the_kernel_quantized(partials, output):
    """Static fp8, per-group FP8 and NVFP4 are quantized in the Mosaic GPU kernels: no f32 `[T', H * D]` array
    anywhere in the traced merge, the kernel's fp8 (or NVFP4's int4 codes, viewed as u8 by XLA after it) output
    instead; where no tile holds whole groups the kernel stores f32 rows, which the test sees (it can fail)."""
    dtype, head_dim, kw, in_kernel = QUANTIZED_IN_KERNEL[output]
    num_tokens, heads = 300, 4
    keys = jax.random.split(jax.random.PRNGKey(0), 2)
    outs = jax.random.normal(keys[0], (partials, num_tokens, heads, head_dim), dtype)
    lses = jax.random.normal(keys[1], (partials, heads, num_tokens), jnp.float32)
    def fn(o, s):
        if partials == 2:
            return pallas_impl.merge_attn_states(o[0], s[0], o[1], s[1], backend="mosaic_gpu", **kw)
        return pallas_impl.merge_attn_states_n(o, s, backend="mosaic_gpu", **kw)
    avals = [a for a in _avals(jax.make_jaxpr(fn)(outs, lses).jaxpr) if hasattr(a, "shape")]
    f32_rows = [a for a in avals if tuple(a.shape) == (num_tokens, heads * head_dim) and a.dtype == jnp.float32]
    assert bool(f32_rows) != in_kernel, [a.str_short() for a in f32_rows]
    stored_dtype = jnp.int4 if kw.get("out_dtype") == jnp.float4_e2m1fn else jnp.float8_e4m3fn
    stored = [a for a in avals if tuple(a.shape) == (num_tokens, heads * head_dim) and a.dtype == stored_dtype]
    assert bool(stored) == in_kernel


def test_the_profile_tool_keeps_the_merge_kernels_of_both_backends_and_needs_ncu(monkeypatch, capsys):
    """`python -m tools mosaic-profile`: its kernel filter keeps Mosaic GPU's kernel (by its name there,
    `body_mosaic_gpu_kernel`) and the Triton backend's merge, not the XLA kernels around them (the names Nsight
    Compute listed on the H100, 2026-12-07); without `ncu` it says so and exits 2."""
    from tools import mosaic_profile

    kernels = re.compile(mosaic_profile.KERNELS.removeprefix("regex:"))
    assert kernels.search("body_mosaic_gpu_kernel") and kernels.search("_merge_attn_states_kernel")
    for xla in ("input_concatenate_fusion", "loop_dynamic_slice_fusion", "loop_multiply_fusion_1", "loop_xor_fusion"):
        assert not kernels.search(xla)
    monkeypatch.setattr(mosaic_profile.shutil, "which", lambda name: None)
    assert mosaic_profile.main([]) == 2
    assert "ncu" in capsys.readouterr().err


def test_the_profile_tool_ranks_the_sass_instructions_by_their_stall_samples():
    """`mosaic_profile.top_stalls` on a source page as Nsight Compute writes it (CSV, a header row naming the
    sampling column): the instructions with the most samples first, each with its share; a page without samples says
    so."""
    from tools import mosaic_profile

    page = ('"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)"\n'
            '"0x10","LDG.E R2, [R4.64]","30","28"\n"0x20","SYNCS.PHASECHK.TRANS64 P0, [UR4], R3","60","59"\n'
            '"0x30","FFMA R5, R2, R6, R7","10","1"\n')
    lines = mosaic_profile.top_stalls(page, count=2)
    assert "All Samples" in lines[0]
    assert lines[1].split() == ["60.0%", "SYNCS.PHASECHK.TRANS64", "P0,", "[UR4],", "R3"]
    assert lines[2].split()[:2] == ["30.0%", "LDG.E"] and len(lines) == 3
    assert "no warp stall samples" in mosaic_profile.top_stalls('"Address","Source"\n"0x10","NOP"\n')[0]
