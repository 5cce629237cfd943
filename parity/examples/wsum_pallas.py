"""Softmax-weighted sum of mixed-sign values as a Pallas kernel (JAX): the jax half of the third worked pair of
docs/parity-library.md. The semantics are in `wsum_triton.py`'s docstring; this file follows that kernel
statement by statement (f32, the maximum, then weights, denominator and weighted sum in key order, `jnp.exp`
(libdevice on GPU), the value behind a zero weight selected away before the multiply-add, one cast at the store). `reverse=True` is the
planted reordered sum. jax and numpy only.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

BLOCK_T = 4  # rows per program, as the Triton kernel


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _wsum_kernel(s_ref, v_ref, out_ref, *, T, N, D, block_d, reverse):
    t0 = pl.program_id(0) * BLOCK_T
    t = t0 + jnp.arange(BLOCK_T, dtype=jnp.int32)
    t_mask = t < T
    dims = jnp.arange(block_d, dtype=jnp.int32)
    td_mask = t_mask[:, None] & (dims < D)[None, :]

    def score(n):
        sn = pltriton.load(s_ref.at[pl.ds(t0, BLOCK_T), pl.ds(n, 1)], mask=t_mask[:, None], other=-jnp.inf)
        return sn.reshape(BLOCK_T)

    m = jax.lax.fori_loop(0, N, lambda n, m: jnp.maximum(m, score(n)), jnp.full((BLOCK_T,), -jnp.inf, jnp.float32))
    m = jnp.where(jnp.abs(m) == jnp.inf, 0.0, m)

    def step(i, carry):
        den, acc = carry
        n = N - 1 - i if reverse else i
        p = jnp.exp(score(n) - m)
        den = den + p
        vn = pltriton.load(v_ref.at[pl.ds(t0, BLOCK_T), pl.ds(n, 1), pl.ds(0, block_d)], mask=td_mask[:, None, :],
                           other=0.0)
        vn = jnp.where(p[:, None] == 0.0, 0.0, vn.reshape(BLOCK_T, block_d).astype(jnp.float32))
        return den, acc + p[:, None] * vn

    init = (jnp.zeros((BLOCK_T,), jnp.float32), jnp.zeros((BLOCK_T, block_d), jnp.float32))
    den, acc = jax.lax.fori_loop(0, N, step, init)
    out = jnp.where(den[:, None] > 0.0, acc / den[:, None], 0.0)
    pltriton.store(out_ref.at[pl.ds(t0, BLOCK_T), pl.ds(0, block_d)], out.astype(out_ref.dtype), mask=td_mask)


@functools.partial(jax.jit, static_argnames=("interpret", "reverse"))
def _softmax_wsum(scores, values, *, interpret, reverse):
    T, N, D = values.shape
    kernel = functools.partial(_wsum_kernel, T=T, N=N, D=D, block_d=_next_pow2(D), reverse=reverse)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((T, D), values.dtype),
        grid=(pl.cdiv(T, BLOCK_T),),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        name="softmax_wsum",
    )(scores, values)


def softmax_wsum(scores, values, *, reverse: bool = False, interpret=None):
    """out[T, D] in values.dtype; `interpret` None: interpret on CPU, compile on GPU."""
    if scores.ndim != 2 or scores.dtype != jnp.float32:
        raise ValueError(f"scores must be f32[T, N], got {scores.dtype} {scores.shape}")
    if values.ndim != 3 or values.shape[:2] != scores.shape:
        raise ValueError(f"values must be [T, N, D] = [{scores.shape[0]}, {scores.shape[1]}, D], got {values.shape}")
    if values.shape[0] == 0 or values.shape[2] == 0:
        return jnp.zeros((values.shape[0], values.shape[2]), values.dtype)
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    return _softmax_wsum(scores, values, interpret=interpret, reverse=reverse)
