"""RMSNorm over a ragged batch in Triton (PyTorch): the torch half of the worked example of docs/parity-library.md.

`rmsnorm(x, weight, query_start_loc, eps)`: x[T, D] holds the tokens of R requests back to back
(`query_start_loc` i32[R+1]); tokens at or past query_start_loc[R] are padding. For a real token t

    rstd[t] = 1 / sqrt(sum_d x[t, d]^2 / D + eps)   (the sum in order d = 0, 1, ..., D - 1, in f32)
    out[t, d] = (x[t, d] * rstd[t]) * weight[d]    (f32, rounded once to x.dtype at the store)

and padding tokens get out = 0, rstd = 0. Returns (out[T, D] in x.dtype, rstd f32[T]).

Written for bit parity with `rmsnorm_pallas.py` (same statements in the same order) by the recipe of
`parity.library.recipe`: launched with enable_fp_fusion=False and enable_reflect_ftz=False, sqrt from libdevice,
division with `/`.
Two planted bugs for the tests: `fma=True` launches with enable_fp_fusion=True (the sum of squares becomes an
FMA chain: a few ulps that only the GPU shows), and `off_by_one=True` takes the last real token for padding
(a ragged-bound bug any device shows).
torch and triton only.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
if not INTERPRET:
    from triton.language.extra.cuda import libdevice

BLOCK_T = 16  # tokens per program
PARITY_LAUNCH = dict(enable_fp_fusion=False, enable_reflect_ftz=False)  # parity.library.recipe.TRITON_LAUNCH


@triton.jit
def _sqrt(x, INTERPRET: tl.constexpr):
    if INTERPRET:  # libdevice does not run in the interpreter
        return tl.sqrt_rn(x)
    else:
        return libdevice.sqrt(x)


@triton.jit
def _rmsnorm_kernel(x_ptr, w_ptr, qsl_ptr, out_ptr, rstd_ptr, num_tokens, eps, num_requests: tl.constexpr,
                    D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, OFF_BY_ONE: tl.constexpr,
                    INTERPRET: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = t < num_tokens
    real = t < tl.load(qsl_ptr + num_requests) - OFF_BY_ONE
    acc = tl.zeros([BLOCK_T], dtype=tl.float32)
    for d in range(0, D):
        xd = tl.load(x_ptr + t * D + d, mask=t_mask, other=0.0).to(tl.float32)
        acc = acc + xd * xd
    rstd = 1.0 / _sqrt(acc / D + eps, INTERPRET)
    rstd = tl.where(real, rstd, 0.0)
    tl.store(rstd_ptr + t, rstd, mask=t_mask)
    dims = tl.arange(0, BLOCK_D)
    td_mask = t_mask[:, None] & (dims < D)[None, :]
    x = tl.load(x_ptr + t[:, None] * D + dims[None, :], mask=td_mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + dims, mask=dims < D, other=0.0).to(tl.float32)
    out = (x * rstd[:, None]) * w[None, :]
    tl.store(out_ptr + t[:, None] * D + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=td_mask)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, query_start_loc: torch.Tensor, eps: float = 1e-6, *,
            fma: bool = False, off_by_one: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous [T, D] tensor, got {tuple(x.shape)=} {x.stride()=}")
    if weight.shape != (x.shape[1],):
        raise ValueError(f"weight must be [D] = [{x.shape[1]}], got {tuple(weight.shape)}")
    if query_start_loc.dtype != torch.int32 or query_start_loc.dim() != 1 or query_start_loc.numel() < 1:
        raise TypeError(f"query_start_loc must be int32[R+1], got {query_start_loc.dtype} "
                        f"{tuple(query_start_loc.shape)}")
    T, D = x.shape
    out = torch.empty_like(x)
    rstd = torch.empty(T, dtype=torch.float32, device=x.device)
    if T == 0:
        return out, rstd
    launch = dict(PARITY_LAUNCH, enable_fp_fusion=True) if fma else PARITY_LAUNCH
    _rmsnorm_kernel[(triton.cdiv(T, BLOCK_T),)](
        x, weight, query_start_loc, out, rstd, T, eps, num_requests=query_start_loc.numel() - 1, D=D,
        BLOCK_T=BLOCK_T, BLOCK_D=triton.next_power_of_2(D), OFF_BY_ONE=int(off_by_one), INTERPRET=INTERPRET,
        **launch)
    return out, rstd
