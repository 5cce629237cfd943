"""Softmax-weighted sum of mixed-sign values in Triton (PyTorch): the torch half of the third worked pair of
docs/parity-library.md.

`softmax_wsum(scores, values)`: scores f32[T, N], values[T, N, D] (fp32, fp16 or bf16). For each row t, in f32,
over the keys n = 0, 1, ..., N - 1 in that order:

    m = max_n scores[t, n]               (0 if that is +inf or -inf)
    p_n = exp(scores[t, n] - m)
    den = sum_n p_n
    acc[d] = sum_n p_n * (0 if p_n == 0 else values[t, n, d])   (a zero weight never reads its value)
    out[t, d] = acc[d] / den if den > 0 else 0                   (rounded once to values.dtype)

Returns out[T, D] in values.dtype.

Written for bit parity with `wsum_pallas.py` by the recipe of `parity.library.recipe`. Planted bugs for the
tests: `fma=True` launches with enable_fp_fusion=True (acc + p * v becomes one FMA: one rounding less per key,
seen only on a GPU), `reverse=True` sums the keys last to first (a reordered sum), `nan_leak=True` multiplies
the values behind zero weights too (0 * NaN = NaN leaks into the row). torch and triton only.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
if not INTERPRET:
    from triton.language.extra.cuda import libdevice

BLOCK_T = 4  # rows per program
PARITY_LAUNCH = dict(enable_fp_fusion=False, enable_reflect_ftz=False)  # parity.library.recipe.TRITON_LAUNCH


@triton.jit
def _exp(x, INTERPRET: tl.constexpr):
    if INTERPRET:  # libdevice does not run in the interpreter
        return tl.exp(x)
    else:
        return libdevice.exp(x)


@triton.jit
def _wsum_kernel(s_ptr, v_ptr, out_ptr, T, N: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr,
                 BLOCK_D: tl.constexpr, REVERSE: tl.constexpr, NAN_LEAK: tl.constexpr, INTERPRET: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = t < T
    dims = tl.arange(0, BLOCK_D)
    td_mask = t_mask[:, None] & (dims < D)[None, :]
    m = tl.full([BLOCK_T], float("-inf"), tl.float32)
    for n in range(0, N):
        sn = tl.load(s_ptr + t * N + n, mask=t_mask, other=float("-inf"))
        m = tl.maximum(m, sn, propagate_nan=tl.PropagateNan.ALL)
    m = tl.where(tl.abs(m) == float("inf"), 0.0, m)
    den = tl.zeros([BLOCK_T], tl.float32)
    acc = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
    for i in range(0, N):
        if REVERSE:
            n = N - 1 - i
        else:
            n = i
        p = _exp(tl.load(s_ptr + t * N + n, mask=t_mask, other=float("-inf")) - m, INTERPRET)
        den = den + p
        vn = tl.load(v_ptr + (t[:, None] * N + n) * D + dims[None, :], mask=td_mask, other=0.0).to(tl.float32)
        if not NAN_LEAK:
            vn = tl.where(p[:, None] == 0.0, 0.0, vn)
        acc = acc + p[:, None] * vn
    out = tl.where(den[:, None] > 0.0, acc / den[:, None], 0.0)
    tl.store(out_ptr + t[:, None] * D + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=td_mask)


def softmax_wsum(scores: torch.Tensor, values: torch.Tensor, *, fma: bool = False, reverse: bool = False,
                 nan_leak: bool = False) -> torch.Tensor:
    if scores.dim() != 2 or scores.dtype != torch.float32 or not scores.is_contiguous():
        raise ValueError(f"scores must be a contiguous f32[T, N] tensor, got {scores.dtype} {tuple(scores.shape)}")
    if values.dim() != 3 or tuple(values.shape[:2]) != tuple(scores.shape) or not values.is_contiguous():
        raise ValueError(f"values must be a contiguous [T, N, D] = [{scores.shape[0]}, {scores.shape[1]}, D] tensor, "
                         f"got {tuple(values.shape)}")
    T, N, D = values.shape
    out = torch.empty((T, D), dtype=values.dtype, device=values.device)
    if T == 0 or D == 0:
        return out
    launch = dict(PARITY_LAUNCH, enable_fp_fusion=True) if fma else PARITY_LAUNCH
    _wsum_kernel[(triton.cdiv(T, BLOCK_T),)](scores, values, out, T, N=N, D=D, BLOCK_T=BLOCK_T,
                                             BLOCK_D=triton.next_power_of_2(D), REVERSE=reverse, NAN_LEAK=nan_leak,
                                             INTERPRET=INTERPRET, **launch)
    return out
