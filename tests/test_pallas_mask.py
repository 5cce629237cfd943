"""pallas_impl.mask_empty_context_lse: what only the JAX wrappers have (docs/spec.md 3).

The behaviour every implementation shares (the reference's bits on the workloads, idempotence, has_empty=False,
shared errors, validate=True) is tested once in tests/test_op_mask.py. Here: the split of a block over programs,
validation and checks under jax.jit, donation, traced offsets that never recompile, has_empty=False returning the
very inputs. Every test takes the `mode` fixture: "interpret" runs everywhere, "compiled" (marked gpu) on the GPU,
with identical bodies. Interpret-mode compiles dominate the runtime, so the tests reuse one static shape
(`BUCKET_HT`): new offset values never recompile, new shapes do.
"""

import dataclasses
import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import pallas_impl
from mla_lse_common import tiles
from pallas_impl import mask as pallas_mask
from parity.library import compare
from parity.harness import cases, reference

NAN_BITS = np.uint32(0x7FC0BEEF)  # a NaN with a payload: poisoned elements must keep these exact bits


@dataclasses.dataclass(frozen=True)
class Bucket:
    """A static shape of the mask: tests drawing new offset values within one bucket share a compile."""

    num_tokens: int
    num_requests: int
    num_heads: int
    lse_layout: str
    out_dtype: str | None = None  # output zeroing when set
    head_dim: int = 0


# R = 40: the ownership scan crosses a 32-request boundary; H = 3 is not a power of two.
BUCKET_HT = Bucket(num_tokens=320, num_requests=40, num_heads=3, lse_layout="HT")


def _mask(lse, query_start_loc, cu_seq_lens, output=None, *, mode, **kwargs):
    return pallas_impl.mask_empty_context_lse(lse, query_start_loc, cu_seq_lens, output,
                                              implementation="pallas", interpret=mode == "interpret", **kwargs)


def _poison_nan(x: np.ndarray, where) -> np.ndarray:
    """Writes NaN with the NAN_BITS payload (narrowed for 16-bit dtypes) into x[where], in place."""
    if x.dtype == np.float32:
        x.view(np.uint32)[where] = NAN_BITS
    else:
        x[where] = np.nan
    return x


def _bucket_inputs(bucket: Bucket, qsl: np.ndarray, seed: int):
    """Random f32 LSE in the bucket's layout (and output), NaN-poisoned at the padding tokens."""
    rng = np.random.default_rng(seed)
    T, H = bucket.num_tokens, bucket.num_heads
    pad = np.arange(T) >= qsl[-1]
    lse = _poison_nan(rng.normal(4.0, 3.0, size=(H, T)).astype(np.float32), (slice(None), pad))
    if bucket.lse_layout == "TH":
        lse = np.ascontiguousarray(lse.T)
    output = None
    if bucket.out_dtype is not None:
        output = rng.standard_normal((T, H, bucket.head_dim), dtype=np.float32).astype(cases.DTYPES[bucket.out_dtype])
        _poison_nan(output, pad)
    return lse, output


def _offsets(query_lens, empty, num_requests, num_tokens, seed=0):
    """(qsl, cu) i32[R+1]: the given requests, then zero-length requests up to R (a static maximum)."""
    rng = np.random.default_rng(seed)
    lens = np.zeros(num_requests, dtype=np.int64)
    lens[:len(query_lens)] = query_lens
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    if qsl[-1] > num_tokens:
        raise ValueError(f"{qsl[-1]=} > {num_tokens=}")
    kv = rng.integers(1, 9, size=num_requests)
    kv[list(empty)] = 0
    kv[len(query_lens):] = 0  # padded requests: no context either
    cu = np.concatenate([[0], np.cumsum(kv)]).astype(np.int32)
    return qsl, cu


def _check_against_reference(got, lse, qsl, cu, output, *, lse_layout, name, mode):
    want_lse, want_out = reference.mask_empty_context_lse(lse, qsl, cu, output, lse_layout=lse_layout)
    got_lse, got_out = got if output is not None else (got, None)
    compare.assert_bitwise_equal(got_lse, want_lse, name="mask.lse", layout=lse_layout, query_start_loc=qsl, case=name, mode=mode)
    if output is not None:
        compare.assert_bitwise_equal(got_out, want_out, name="mask.output", layout="THD", query_start_loc=qsl, case=name,
                     mode=mode)


@pytest.fixture
def small_splits(monkeypatch):
    """Caps the mask's programs per block at 3 (LSE-only; at most 3 head tiles) and 5 (zeroing), whatever the grid
    size: the round-robin deal of a block's tiles, with programs left without a tile of one kind."""
    monkeypatch.setattr(tiles, "MASK_TARGET_PROGRAMS", 1 << 30)
    monkeypatch.setattr(tiles, "MASK_LSE_SPLIT", 3)
    monkeypatch.setattr(tiles, "MASK_ZERO_SPLIT", 5)
    tiles.mask_split.cache_clear()
    pallas_mask._mask_jit.clear_cache()  # traces hold the grid
    yield
    tiles.mask_split.cache_clear()
    pallas_mask._mask_jit.clear_cache()


@pytest.mark.parametrize("zero_output", [False, True])
@pytest.mark.parametrize("lse_layout", ["HT", "TH"])
def test_block_split_over_programs(small_splits, lse_layout, zero_output, mode):
    # H = 40: three LSE head tiles of 16; D = 48 zeroed in 20 (2 heads x 64 dims) tiles.
    bucket = Bucket(num_tokens=404, num_requests=6, num_heads=40, lse_layout=lse_layout,
                    out_dtype="bfloat16" if zero_output else None, head_dim=48 if zero_output else 0)
    grid = tiles.mask_grid(bucket.num_tokens, bucket.num_requests, bucket.num_heads,
                                   bucket.head_dim if zero_output else 1, zero_output)
    assert grid[1] == (5 if zero_output else 3)
    qsl, cu = _offsets((130, 7, 200, 0, 60), (0, 2, 3), bucket.num_requests, bucket.num_tokens)
    lse, output = _bucket_inputs(bucket, qsl, seed=3)
    got = _mask(jnp.asarray(lse), jnp.asarray(qsl), jnp.asarray(cu),
                None if output is None else jnp.asarray(output), lse_layout=lse_layout, mode=mode)
    _check_against_reference(got, lse, qsl, cu, output, lse_layout=lse_layout, name="h40_split", mode=mode)


# ---------------------------------------------------------------------------------------------------------
# Guard, helper and validation


def test_has_empty_false_returns_the_inputs(mode):
    qsl, cu = _offsets([4, 4], empty=(0,), num_requests=2, num_tokens=8)
    lse = jnp.zeros((2, 8), jnp.float32)
    output = jnp.ones((8, 2, 16), jnp.bfloat16)
    assert _mask(lse, jnp.asarray(qsl), jnp.asarray(cu), has_empty=False, mode=mode) is lse
    got_lse, got_out = _mask(lse, jnp.asarray(qsl), jnp.asarray(cu), output, has_empty=False, mode=mode)
    assert got_lse is lse and got_out is output


def test_has_empty_context_refuses_device_arrays():
    with pytest.raises(ValueError, match="jax.Array"):
        pallas_impl.has_empty_context(jnp.array([1, 0], jnp.int32))


def test_validate_under_jit_explains(mode):
    step = jax.jit(lambda lse, qsl, cu: _mask(lse, qsl, cu, validate=True, mode=mode))
    with pytest.raises(ValueError, match="cannot run under jax.jit"):
        step(jnp.zeros((2, 8), jnp.float32), jnp.array([0, 4, 8], jnp.int32), jnp.array([0, 0, 1], jnp.int32))


def test_always_on_errors_at_trace_time(mode):
    """Shapes and dtypes are checked while tracing: no device data is read."""
    step = jax.jit(lambda lse, qsl, cu: _mask(lse, qsl.astype(jnp.float32), cu, mode=mode))
    with pytest.raises(TypeError, match="query_start_loc must be int32"):
        step(jnp.zeros((2, 8), jnp.float32), jnp.array([0, 4, 8], jnp.int32), jnp.array([0, 0, 1], jnp.int32))
    step = jax.jit(lambda lse, qsl, cu: _mask(lse, qsl, cu[:2], mode=mode))
    with pytest.raises(ValueError, match="must both be"):
        step(jnp.zeros((2, 8), jnp.float32), jnp.array([0, 4, 8], jnp.int32), jnp.array([0, 0, 1], jnp.int32))


# ---------------------------------------------------------------------------------------------------------
# jit conventions: donation / in place, traced offsets, no recompilation


def test_lowering_declares_the_donated_aliases(mode):
    """Donating lse and output: the lowered module aliases each to its result (so the update is in place)."""
    qsl, cu = _offsets([5, 3], empty=(1,), num_requests=2, num_tokens=8)
    step = jax.jit(lambda lse, q, c, out: _mask(lse, q, c, out, mode=mode), donate_argnums=(0, 3))
    text = step.lower(jnp.zeros((2, 8), jnp.float32), jnp.asarray(qsl), jnp.asarray(cu),
                      jnp.zeros((8, 2, 16), jnp.bfloat16)).as_text()
    # The donated arguments carry an alias to a result (its index shifts when the module also returns a token:
    # the Mosaic GPU interpreter's callback is an ordered effect).
    aliased = re.findall(r"tensor<([0-9a-z]+)> \{[^}]*tf\.aliasing_output = \d+", text)
    assert "2x8xf32" in aliased and "8x2x16xbf16" in aliased, text[:2000]


def test_donated_lse_is_updated_in_place(mode):
    """The result reuses the donated buffer (XLA:CPU honours the donation in interpret mode too)."""
    b = BUCKET_HT
    qsl, cu = _offsets([40, 0, 130, 2], empty=(0, 2), num_requests=b.num_requests, num_tokens=b.num_tokens)
    lse_np, _ = _bucket_inputs(b, qsl, seed=3)
    step = jax.jit(lambda lse, q, c: _mask(lse, q, c, mode=mode), donate_argnums=0)
    # A buffer XLA owns: jax 0.10.0 imports a 64-byte-aligned numpy array without a copy, and XLA:CPU cannot reuse a
    # donated import (the test failed whenever numpy's allocation happened to be aligned).
    lse = jnp.copy(jnp.asarray(lse_np))
    pointer = lse.unsafe_buffer_pointer()
    got = step(lse, jnp.asarray(qsl), jnp.asarray(cu))
    assert got.unsafe_buffer_pointer() == pointer
    assert lse.is_deleted()
    _check_against_reference(got, lse_np, qsl, cu, None, lse_layout="HT", name="donated", mode=mode)


def _batches(bucket: Bucket, n: int):
    """n offset pairs of one static shape with different values (lengths, empty sets, padded requests)."""
    rng = np.random.default_rng(7)
    for i in range(n):
        real = bucket.num_requests - 3 * i
        lens = rng.integers(0, 5, size=real)
        lens[rng.integers(real)] = 130  # one request spans two 128-token blocks
        empty = tuple(int(r) for r in np.nonzero(rng.random(real) < 0.5)[0])
        yield _offsets(lens, empty, bucket.num_requests, bucket.num_tokens, seed=i)


def test_offsets_are_traced_and_never_recompile(mode):
    b = BUCKET_HT
    traces = []

    def step(lse, qsl, cu):
        traces.append(1)  # runs once per trace
        return _mask(lse, qsl, cu, mode=mode)

    jitted = jax.jit(step)
    for qsl, cu in _batches(b, 3):
        lse, _ = _bucket_inputs(b, qsl, seed=int(qsl[-1]))
        got = jitted(jnp.asarray(lse), jnp.asarray(qsl), jnp.asarray(cu))
        _check_against_reference(got, lse, qsl, cu, None, lse_layout="HT", name="jit", mode=mode)
    assert len(traces) == 1
    assert jitted._cache_size() == 1

    # Called directly, the wrapper's own jit cache gains at most the one entry of this shape.
    sizes = []
    for qsl, cu in _batches(b, 3):
        lse, _ = _bucket_inputs(b, qsl, seed=1)
        _check_against_reference(_mask(jnp.asarray(lse), jnp.asarray(qsl), jnp.asarray(cu), mode=mode),
                                 lse, qsl, cu, None, lse_layout="HT", name="direct", mode=mode)
        sizes.append(pallas_mask._mask_jit._cache_size())
    assert sizes[0] == sizes[-1], sizes


def test_documented_donation_pattern():
    """The docstring's `jax.jit(mask_empty_context_lse, donate_argnames="lse")` runs (default implementation)."""
    step = jax.jit(pallas_impl.mask_empty_context_lse, donate_argnames="lse")
    case = cases.by_name("r33_ragged_pad")
    inp = cases.make_inputs(case)
    lse = jnp.asarray(inp["prefix_lse"])
    got = step(lse, jnp.asarray(inp["query_start_loc"]), jnp.asarray(inp["cu_seq_lens"]))
    assert lse.is_deleted()
    want, _ = reference.mask_empty_context_lse(inp["prefix_lse"], inp["query_start_loc"], inp["cu_seq_lens"])
    compare.assert_bitwise_equal(got, want, name="mask.lse", case=case)
