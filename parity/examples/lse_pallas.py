"""Log-sum-exp over a ragged batch as a Pallas kernel (JAX): the jax half of the second worked pair of
docs/parity-library.md. The semantics are in `lse_triton.py`'s docstring; this file follows that kernel statement
by statement (f32, the maximum then the sum in token order, `jnp.exp`/`jnp.log` (libdevice on GPU, as Triton's
`libdevice.exp/log`), no FMA contraction and no flush-to-zero in XLA's Triton pipeline). The request bounds
are runtime values (no recompile per batch). `reverse=True` is the planted reordered sum. jax and numpy only.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _lse_kernel(x_ref, qsl_ref, lse_ref, *, H, block_h, reverse):
    r = pl.program_id(0)
    h = jnp.arange(block_h, dtype=jnp.int32)
    h_mask = h < H
    start = qsl_ref[r]
    end = qsl_ref[r + 1]

    def row(t):
        xt = pltriton.load(x_ref.at[pl.ds(t, 1), pl.ds(0, block_h)], mask=h_mask[None, :], other=0.0)
        return xt.astype(jnp.float32).reshape(block_h)

    m = jax.lax.fori_loop(start, end, lambda t, m: jnp.maximum(m, row(t)), jnp.full((block_h,), -jnp.inf, jnp.float32))
    m = jnp.where(jnp.abs(m) == jnp.inf, 0.0, m)

    def add(i, s):
        t = end - 1 - i if reverse else start + i
        return s + jnp.exp(row(t) - m)

    s = jax.lax.fori_loop(0, end - start, add, jnp.zeros((block_h,), jnp.float32))
    lse = m + jnp.log(s)
    pltriton.store(lse_ref.at[pl.ds(r, 1), pl.ds(0, block_h)], lse[None, :], mask=h_mask[None, :])


@functools.partial(jax.jit, static_argnames=("interpret", "reverse"))
def _ragged_lse(x, query_start_loc, *, interpret, reverse):
    R, H = query_start_loc.shape[0] - 1, x.shape[1]
    kernel = functools.partial(_lse_kernel, H=H, block_h=_next_pow2(H), reverse=reverse)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((R, H), jnp.float32),
        grid=(R,),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=1, num_stages=1),
        name="ragged_lse",
    )(x, query_start_loc)


def ragged_lse(x, query_start_loc, *, reverse: bool = False, interpret=None):
    """lse f32[R, H]; `interpret` None: interpret on CPU, compile on GPU."""
    if x.ndim != 2:
        raise ValueError(f"x must be [T, H], got {x.shape=}")
    if query_start_loc.dtype != jnp.int32 or query_start_loc.ndim != 1 or query_start_loc.shape[0] < 1:
        raise TypeError(f"query_start_loc must be int32[R+1], got {query_start_loc.dtype} {query_start_loc.shape}")
    if query_start_loc.shape[0] == 1 or x.shape[1] == 0:
        return jnp.zeros((query_start_loc.shape[0] - 1, x.shape[1]), jnp.float32)
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    return _ragged_lse(x, query_start_loc, interpret=interpret, reverse=reverse)
