"""Per-signature plans of the public wrappers (docs/design.md, "Per-call cost (JAX)"): the static checks, the
implementation, backend and sharding choice of a call, computed once per signature as a callable of the operands."""

from __future__ import annotations

import os

import jax

from pallas_impl._backend import BACKEND_ENV


class _Uncached(Exception):
    """An argument that `_arg_key` does not key (a NumPy array, a list, ...): that call checks everything."""


_Tracer = jax.core.Tracer
_SingleDevice = jax.sharding.SingleDeviceSharding


def _arg_key(x):
    """A hashable stand-in of everything the static checks read of one argument: a jax.Array's shape, dtype,
    weak type and sharding (a tracer's aval also holds its varying manual axes; a single-device sharding reads
    as None: no head axis to shard), None, or the Python int type."""
    if x is None:
        return None
    if isinstance(x, _Tracer):
        return jax.typeof(x)
    if isinstance(x, jax.Array):
        sharding = x.sharding
        return x.aval, None if type(sharding) is _SingleDevice else sharding
    if type(x) is int:
        return int
    raise _Uncached


PLAN_CACHE_SIZE = 4096  # plans kept per entry point; a full cache starts over


def cached_plan(cache: dict, build, args: tuple, options: tuple, backend):
    """`build(*args, *options)`, a callable of the operands that runs the call (every static check passed), computed
    once per signature: the arguments' `_arg_key`s, `options` (the wrapper's static arguments) and, for
    backend=None, the `BACKEND_ENV` it resolves through. An unkeyed argument or option builds every time (and raises
    every time for bad input). Value checks (validate=True) are not part of a plan. docs/design.md, "Per-call cost
    (JAX)"."""
    try:
        key = (options, os.environ.get(BACKEND_ENV) if backend is None else None, tuple(map(_arg_key, args)))
        plan = cache.get(key)
    except (_Uncached, TypeError):  # TypeError: an unhashable option, refused by `build`'s checks
        return build(*args, *options)
    if plan is None:
        plan = build(*args, *options)
        if len(cache) >= PLAN_CACHE_SIZE:
            cache.clear()
        cache[key] = plan
    return plan
