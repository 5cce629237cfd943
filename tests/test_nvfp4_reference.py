"""The NVFP4 reference quantizer (docs/spec.md 4.8; `parity.harness.reference.quant_nvfp4`, `pack_fp4`,
`swizzle_nvfp4_scales`), checked against what does not share its code: hand-computed codes at every rounding
threshold, ml_dtypes' round-to-nearest-even e2m1 and e4m3 casts, vLLM's reference quantizer re-expressed in torch
from its documented algorithm, and the swizzled layout built by reshapes. The merges do not take NVFP4 yet."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from mla_lse_common import constants
from parity.harness import reference as R


def test_constants_are_the_references():
    assert constants.FP4_E2M1_MAX == R.FP4_E2M1_MAX == float(ml_dtypes.finfo(ml_dtypes.float4_e2m1fn).max)
    assert constants.NVFP4_BLOCK == R.NVFP4_BLOCK == 16
    assert constants.FP4_E2M1_THRESHOLDS == R.FP4_E2M1_THRESHOLDS
    assert constants.NVFP4_SWIZZLE == (128, 4)
    # Each threshold is the midpoint of two neighbouring e2m1 values; a tie goes to the even code.
    for code, (value, inclusive) in enumerate(R.FP4_E2M1_THRESHOLDS):
        assert value == (R.FP4_E2M1_VALUES[code] + R.FP4_E2M1_VALUES[code + 1]) / 2
        assert inclusive == (code % 2 == 1)


def test_codes_at_every_threshold():
    # g = 1 and a block maximum of 6: s = e4m3(6 * f32(1/6)) = 1, inv = 1, so y is x itself.
    x = np.array([[6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 5.0001, -0.0, np.nan, -0.1, 0.2500001, -6, 3, 0.5]],
                 np.float32)
    codes, scales = R.quant_nvfp4(x, 1.0)
    assert scales.astype(np.float32).tolist() == [[1.0]]
    assert codes.tolist() == [[7, 0, 2, 2, 4, 4, 6, 6, 7, 8, 0, 8, 1, 15, 5, 1]]


def test_empty_and_saturated_blocks():
    x = np.zeros((2, 32), np.float32)
    x[1, 16:] = np.linspace(-1e30, 1e30, 16)
    codes, scales = R.quant_nvfp4(x, 448.0 * 6)
    assert (codes[0] == 0).all() and (scales[0].astype(np.float32) == 0).all()  # an empty row: codes 0, scale 0
    assert scales[1, 1].astype(np.float32) == 448  # the block scale saturates at 448
    assert codes[1, 16] == 15 and codes[1, 31] == 7


def _vllm_reference(x, global_scale):
    """vLLM's reference NVFP4 quantizer (tests' `ref_nvfp4_quant`) as its algorithm reads, re-expressed in torch:
    the block maximum, scale = g * (amax * 1/6) clamped to 448 and cast to e4m3, output_scale = 1 / (scale * 1/g)
    (0 for a 0 scale), x * output_scale clamped to [-6, 6], rounded to the nearest e2m1 value by its table.
    Returns (f32 values, f32 scales)."""
    t = torch.from_numpy(x).reshape(x.shape[0], -1, 16)
    g = torch.tensor(global_scale, dtype=torch.float32)
    vec_max = t.abs().amax(dim=-1, keepdim=True)
    scale = g * (vec_max * torch.tensor(1 / 6.0, dtype=torch.float32))
    scale = scale.clamp(max=448.0).to(torch.float8_e4m3fn).to(torch.float32)
    inv_g = torch.where(g == 0, torch.zeros_like(g), 1.0 / g)
    denom = scale * inv_g
    output_scale = torch.where(denom == 0, torch.zeros_like(denom), 1.0 / denom)
    y = (t * output_scale).clamp(-6.0, 6.0)
    a = y.abs()
    steps = [(a > 0.25) & (a < 0.75), (a >= 0.75) & (a <= 1.25), (a > 1.25) & (a < 1.75), (a >= 1.75) & (a <= 2.5),
             (a > 2.5) & (a < 3.5), (a >= 3.5) & (a <= 5.0), a > 5.0]
    q = torch.zeros_like(a)
    for cond, value in zip(steps, (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)):
        q = torch.where(cond, torch.tensor(value), q)
    return (torch.sign(y) * q).reshape(x.shape[0], -1).numpy(), scale.squeeze(-1).numpy(), y.reshape(x.shape[0], -1)


@pytest.mark.parametrize("spread", [1.0, 1e-3, 1e4])
def test_the_reference_quantizer_is_vllms(spread):
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((40, 256)) * spread).astype(np.float32)
    x[3] = 0  # an all-zero row
    x[5, :16] *= 1e-6  # a block far below the tensor's maximum: a small e4m3 scale, subnormal or zero
    g = np.float32(448 * 6) / np.abs(x).max()
    codes, scales = R.quant_nvfp4(x, g)
    values, vllm_scales, y = _vllm_reference(x, g)
    np.testing.assert_array_equal(scales.astype(np.float32), vllm_scales)
    np.testing.assert_array_equal(np.abs(R.fp4_values(codes)), np.abs(values))  # vLLM's sign() drops -0's sign
    # The codes are ml_dtypes' round-to-nearest-even e2m1 cast of the same clamped quotients, sign bits included.
    cast = y.numpy().astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    np.testing.assert_array_equal(codes, cast)


def test_pack_puts_the_even_element_in_the_low_nibble():
    codes = np.array([[1, 2, 15, 8, 0, 7]], np.uint8)
    assert R.pack_fp4(codes).tolist() == [[0x21, 0x8F, 0x70]]


@pytest.mark.parametrize("t,k", [(1, 1), (130, 6), (256, 8), (37, 32)])
def test_swizzled_scales_are_128x4_tiles(t, k):
    rng = np.random.default_rng(t + k)
    scales = rng.integers(1, 255, (t, k), dtype=np.uint8)
    got = R.swizzle_nvfp4_scales(scales)
    tp, kp = -(-t // 128) * 128, -(-k // 4) * 4
    padded = np.zeros((tp, kp), np.uint8)
    padded[:t, :k] = scales
    # Tile (row block, column block) of 128 x 4, inside it row r = 32 * i + j and column c at [j, i, c].
    tiles = padded.reshape(tp // 128, 4, 32, kp // 4, 4).transpose(0, 3, 2, 1, 4)
    np.testing.assert_array_equal(got, tiles.ravel())
    assert got.size == tp * kp and (np.sort(got)[: tp * kp - t * k] == 0).all()
