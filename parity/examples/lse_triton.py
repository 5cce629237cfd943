"""Log-sum-exp over a ragged batch in Triton (PyTorch): the torch half of the second worked pair of
docs/parity-library.md.

`ragged_lse(x, query_start_loc)`: x[T, H] holds the tokens of R requests back to back (`query_start_loc`
i32[R+1]; tokens past query_start_loc[R] are padding and ignored). For request r and head h, over its tokens
t = start, start + 1, ..., end - 1 (in that order, f32):

    m = max_t x[t, h]                 (NaN propagates; -inf for an empty request)
    m = 0 if m is +inf or -inf else m
    lse[r, h] = m + log(sum_t exp(x[t, h] - m))

so an empty request (or one of -inf only) gives -inf and a +inf token gives +inf. Returns lse f32[R, H].

Written for bit parity with `lse_pallas.py` by the recipe of `parity.library.recipe` (enable_fp_fusion=False,
enable_reflect_ftz=False, libdevice exp/log, the same order). Planted bugs for the tests: `reverse=True` sums
the tokens last to first (a reordered sum: a few roundings), `off_by_one=True` drops each request's last token,
`base2=True` takes exp2/log2 for exp/log (the wrong base). torch and triton only.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
if not INTERPRET:
    from triton.language.extra.cuda import libdevice

PARITY_LAUNCH = dict(enable_fp_fusion=False, enable_reflect_ftz=False)  # parity.library.recipe.TRITON_LAUNCH


@triton.jit
def _exp(x, BASE2: tl.constexpr, INTERPRET: tl.constexpr):
    if BASE2:
        return tl.exp2(x)
    elif INTERPRET:  # libdevice does not run in the interpreter
        return tl.exp(x)
    else:
        return libdevice.exp(x)


@triton.jit
def _log(x, BASE2: tl.constexpr, INTERPRET: tl.constexpr):
    if BASE2:
        return tl.log2(x)
    elif INTERPRET:
        return tl.log(x)
    else:
        return libdevice.log(x)


@triton.jit
def _bound(n, MAX_LEN: tl.constexpr):
    # Triton 3.6's interpreter cannot loop to a bound loaded in the kernel under numpy >= 2.4: there it loops to
    # the longest request (a host value; the extra steps load nothing), compiled kernels to the request's length.
    if MAX_LEN > 0:
        return MAX_LEN
    else:
        return n


@triton.jit
def _lse_kernel(x_ptr, qsl_ptr, lse_ptr, H: tl.constexpr, BLOCK_H: tl.constexpr, REVERSE: tl.constexpr,
                OFF_BY_ONE: tl.constexpr, BASE2: tl.constexpr, INTERPRET: tl.constexpr, MAX_LEN: tl.constexpr):
    r = tl.program_id(0)
    h = tl.arange(0, BLOCK_H)
    h_mask = h < H
    start = tl.load(qsl_ptr + r)
    end = tl.load(qsl_ptr + r + 1) - OFF_BY_ONE
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for i in range(0, _bound(end - start, MAX_LEN)):
        in_req = start + i + h * 0 < end  # a [BLOCK_H] mask: the interpreter takes no scalar mask here
        xt = tl.load(x_ptr + (start + i) * H + h, mask=h_mask & in_req, other=float("-inf"))
        m = tl.maximum(m, xt.to(tl.float32), propagate_nan=tl.PropagateNan.ALL)
    m = tl.where(tl.abs(m) == float("inf"), 0.0, m)
    s = tl.zeros([BLOCK_H], tl.float32)
    for i in range(0, _bound(end - start, MAX_LEN)):
        if REVERSE:
            t = end - 1 - i
        else:
            t = start + i
        if start + i < end:
            xt = tl.load(x_ptr + t * H + h, mask=h_mask, other=0.0).to(tl.float32)
            s = s + _exp(xt - m, BASE2, INTERPRET)
    lse = m + _log(s, BASE2, INTERPRET)
    tl.store(lse_ptr + r * H + h, lse, mask=h_mask)


def ragged_lse(x: torch.Tensor, query_start_loc: torch.Tensor, *, reverse: bool = False, off_by_one: bool = False,
               base2: bool = False) -> torch.Tensor:
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous [T, H] tensor, got {tuple(x.shape)=} {x.stride()=}")
    if query_start_loc.dtype != torch.int32 or query_start_loc.dim() != 1 or query_start_loc.numel() < 1:
        raise TypeError(f"query_start_loc must be int32[R+1], got {query_start_loc.dtype} "
                        f"{tuple(query_start_loc.shape)}")
    R, H = query_start_loc.numel() - 1, x.shape[1]
    lse = torch.empty((R, H), dtype=torch.float32, device=x.device)
    if R == 0 or H == 0:
        return lse
    # Under the interpreter (tensors on the CPU) the loops run to the longest request; compiled, to each one's length.
    max_len = int((query_start_loc[1:] - query_start_loc[:-1]).max()) if INTERPRET else 0
    _lse_kernel[(R,)](x, query_start_loc, lse, H=H, BLOCK_H=triton.next_power_of_2(H), REVERSE=reverse,
                      OFF_BY_ONE=int(off_by_one), BASE2=base2, INTERPRET=INTERPRET, MAX_LEN=max_len,
                      **PARITY_LAUNCH)
    return lse
