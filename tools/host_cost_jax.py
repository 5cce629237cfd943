"""Per-call host cost of the public `pallas_impl` entry points (docs/design.md, "Per-call cost (JAX)").

Wall time per call of back-to-back calls on tiny inputs (bf16, T = 16, H = 64, D = 128; one sync at the end),
beside JAX's own dispatch floor measured in the same run: a jitted identity on one tiny array, and the same jitted
merge called directly with the public function's arguments (what a caller's own `jax.jit` around the public call
costs per dispatch). `public / floor` is the wrapper's share; `jit(public)` wraps the public call in the caller's
jit, as serving stacks do.

    python -m tools host-cost-jax [--calls 2000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import math
import time


import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import pallas_impl  # noqa: E402


def per_call_us(fn, calls: int, rounds: int) -> float:
    out = None
    for _ in range(3):
        out = fn()
    jax.block_until_ready(out)
    best = math.inf
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = fn()
        jax.block_until_ready(out)
        best = min(best, time.perf_counter() - t0)
    return best / calls * 1e6


def entry_points(T=16, H=64, D=128, N=4):
    key = jax.random.key(0)
    o = jax.random.normal(key, (N, T, H, D), jnp.bfloat16)
    lse = jax.random.normal(key, (N, H, T), jnp.float32)
    a, b, p, s = o[0], o[1], lse[0], lse[1]
    qsl = jnp.array([0, 4, 8, 12, 16], jnp.int32)
    cu = jnp.array([0, 10, 10, 30, 40], jnp.int32)
    cus = jnp.tile(cu, (N, 1))
    pth, sth = p.T, s.T
    n12 = jnp.asarray(12, jnp.int32)
    pi = pallas_impl
    return {
        "mask": lambda: pi.mask_empty_context_lse(p, qsl, cu),
        "mask + output": lambda: pi.mask_empty_context_lse(p, qsl, cu, a),
        "merge plain": lambda: pi.merge_attn_states(a, p, b, s, return_lse=False),
        "merge output LSE": lambda: pi.merge_attn_states(a, p, b, s),
        "merge fused": lambda: pi.merge_attn_states(a, p, b, s, query_start_loc=qsl, prefix_cu_seq_lens=cu),
        "merge [T,H] base 2": lambda: pi.merge_attn_states(a, pth, b, sth, lse_layout="TH", lse_base=2),
        "merge, ptwc a Python int": lambda: pi.merge_attn_states(a, p, b, s, prefill_tokens_with_context=12),
        "merge, ptwc an i32 device scalar": lambda: pi.merge_attn_states(a, p, b, s, prefill_tokens_with_context=n12),
        f"merge_n N={N}": lambda: pi.merge_attn_states_n(o, lse, return_lse=False),
        f"merge_n N={N} output LSE": lambda: pi.merge_attn_states_n(o, lse),
        f"merge_n N={N} fused": lambda: pi.merge_attn_states_n(o, lse, query_start_loc=qsl, cu_seq_lens=cus),
    }, (o, lse, a, b, p, s, qsl, cu)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    entries, (o, lse, a, b, p, s, qsl, cu) = entry_points()
    x = jnp.ones((16,), jnp.float32)
    ident = jax.jit(lambda v: v + 1)
    floor = per_call_us(lambda: ident(x), args.calls, args.rounds)
    jitted = jax.jit(lambda a, p, b, s: pallas_impl.merge_attn_states(a, p, b, s))
    jit_merge = per_call_us(lambda: jitted(a, p, b, s), args.calls, args.rounds)
    print(f"{jax.devices()[0]}, jax {jax.__version__}; us per call, best of {args.rounds} rounds of {args.calls} calls")
    print(f"{'floor: jit(lambda v: v + 1)':36s} {floor:7.1f}")
    print(f"{'jit(merge output LSE), 4 arrays':36s} {jit_merge:7.1f}   / floor {jit_merge / floor:4.2f}")
    for name, fn in entries.items():
        us = per_call_us(fn, args.calls, args.rounds)
        print(f"{name:36s} {us:7.1f}   / floor {us / floor:4.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
