"""RMSNorm over a ragged batch as a Pallas kernel (JAX): the jax half of the worked example of
docs/parity-library.md. The semantics are in `rmsnorm_triton.py`'s docstring; this file follows that kernel
statement by statement (f32, the sum in order d = 0..D-1, `jnp.sqrt` (libdevice `__nv_sqrtf` on GPU, as
Triton's `libdevice.sqrt`), division with `/`, no FMA contraction and no flush-to-zero in XLA's Triton
pipeline, one cast at the store). jax and numpy only.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

BLOCK_T = 16  # tokens per program, as the Triton kernel


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _rmsnorm_kernel(x_ref, w_ref, qsl_ref, eps_ref, out_ref, rstd_ref, *, num_tokens, num_requests, D, block_d):
    t0 = pl.program_id(0) * BLOCK_T
    t = t0 + jnp.arange(BLOCK_T, dtype=jnp.int32)
    t_mask = t < num_tokens
    real = t < qsl_ref[num_requests]

    def add_square(d, acc):
        xd = pltriton.load(x_ref.at[pl.ds(t0, BLOCK_T), pl.ds(d, 1)], mask=t_mask[:, None], other=0.0)
        xd = xd.astype(jnp.float32).reshape(BLOCK_T)
        return acc + xd * xd

    acc = jax.lax.fori_loop(0, D, add_square, jnp.zeros((BLOCK_T,), jnp.float32))
    rstd = 1.0 / jnp.sqrt(acc / jnp.float32(D) + eps_ref[0])
    rstd = jnp.where(real, rstd, 0.0)
    pltriton.store(rstd_ref.at[pl.ds(t0, BLOCK_T)], rstd, mask=t_mask)
    dims = jnp.arange(block_d, dtype=jnp.int32)
    td_mask = t_mask[:, None] & (dims < D)[None, :]
    x = pltriton.load(x_ref.at[pl.ds(t0, BLOCK_T), pl.ds(0, block_d)], mask=td_mask, other=0.0).astype(jnp.float32)
    w = pltriton.load(w_ref.at[pl.ds(0, block_d)], mask=dims < D, other=0.0).astype(jnp.float32)
    out = (x * rstd[:, None]) * w[None, :]
    pltriton.store(out_ref.at[pl.ds(t0, BLOCK_T), pl.ds(0, block_d)], out.astype(out_ref.dtype), mask=td_mask)


@functools.partial(jax.jit, static_argnames=("interpret",))
def _rmsnorm(x, weight, query_start_loc, eps, *, interpret):
    T, D = x.shape
    kernel = functools.partial(_rmsnorm_kernel, num_tokens=T, num_requests=query_start_loc.shape[0] - 1, D=D,
                               block_d=_next_pow2(D))
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((T, D), x.dtype), jax.ShapeDtypeStruct((T,), jnp.float32)),
        grid=(pl.cdiv(T, BLOCK_T),),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        name="rmsnorm_ragged",
    )(x, weight, query_start_loc, jnp.asarray(eps, jnp.float32).reshape(1))


def rmsnorm(x, weight, query_start_loc, eps=1e-6, *, interpret=None):
    """(out[T, D] in x.dtype, rstd f32[T]); `interpret` None: interpret on CPU, compile on GPU."""
    if x.ndim != 2:
        raise ValueError(f"x must be [T, D], got {x.shape=}")
    if weight.shape != (x.shape[1],):
        raise ValueError(f"weight must be [D] = [{x.shape[1]}], got {weight.shape}")
    if query_start_loc.dtype != jnp.int32 or query_start_loc.ndim != 1 or query_start_loc.shape[0] < 1:
        raise TypeError(f"query_start_loc must be int32[R+1], got {query_start_loc.dtype} {query_start_loc.shape}")
    if x.shape[0] == 0:
        return jnp.zeros(x.shape, x.dtype), jnp.zeros((0,), jnp.float32)
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    return _rmsnorm(x, weight, query_start_loc, eps, interpret=interpret)
