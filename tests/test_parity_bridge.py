"""parity.library.bridge: zero-copy torch <-> JAX over DLPack, and the refusals of what DLPack gets wrong (docs/spec.md 6)."""

import ml_dtypes
import numpy as np
import pytest

import jax
import jax.numpy as jnp
import torch

from parity.library import bridge
from parity.harness import cases

DTYPES = [np.int32, np.float32, np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _sample(dtype, shape=(5, 3, 8)) -> np.ndarray:
    """Values with distinct bit patterns, NaN included for the float types (payload must survive)."""
    rng = np.random.default_rng(0)
    if np.dtype(dtype) == np.int32:
        return rng.integers(-(2**31), 2**31 - 1, size=shape, dtype=np.int32)
    x = rng.standard_normal(shape).astype(np.float32).astype(dtype)
    x.reshape(-1)[3] = np.nan
    return x


def _bits(x: np.ndarray) -> np.ndarray:
    return x.view(np.dtype(f"u{x.dtype.itemsize}"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_share_is_zero_copy_and_bit_exact(dtype, device):
    x = _sample(dtype)
    t_in, j_in = bridge.share_inputs({"x": x}, device)
    t, j = t_in["x"], j_in["x"]
    assert bridge.data_ptr(t) == bridge.data_ptr(j)
    assert j.dtype == x.dtype and j.shape == x.shape
    assert j.devices() == {bridge.jax_device_for(t.device)}
    np.testing.assert_array_equal(_bits(bridge.to_numpy(t)), _bits(x))
    np.testing.assert_array_equal(_bits(bridge.to_numpy(j)), _bits(x))
    back = bridge.jax_to_torch(j)
    assert back.data_ptr() == t.data_ptr() and back.dtype == t.dtype


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_jax_result_to_torch_is_zero_copy(dtype, device):
    jdev = bridge.jax_device_for(device)
    a = jax.device_put(jnp.asarray(_sample(dtype)), jdev) * 1  # a computed result, not an import
    t = bridge.jax_to_torch(a)
    assert t.data_ptr() == a.unsafe_buffer_pointer()
    np.testing.assert_array_equal(_bits(bridge.to_numpy(t)), _bits(np.asarray(a)))


def test_shared_buffer_aliases_memory():
    # Pointer equality is the claim; a write through torch showing in JAX proves the memory is shared.
    t = bridge.to_torch(np.zeros(64, dtype=np.float32))
    j = bridge.torch_to_jax(t)
    t[7] = 5.0
    assert float(np.asarray(j)[7]) == 5.0


def test_to_torch_copies_and_keeps_bits():
    x = _sample(ml_dtypes.bfloat16)
    t = bridge.to_torch(x)
    assert t.dtype == torch.bfloat16 and t.data_ptr() != x.ctypes.data
    t.view(torch.int16)[0, 0, 0] += 1  # in-place kernels must not reach the caller's numpy inputs
    assert _bits(x)[0, 0, 0] != _bits(bridge.to_numpy(t))[0, 0, 0]
    assert t.data_ptr() % bridge.ALIGNMENT == 0


def test_padded_v_buffer_is_shared_whole():
    case = cases.by_name("padded_v_ptwc")
    inputs = cases.make_inputs(case, seed=0)
    t, j = bridge.share_inputs(inputs)
    D = case.head_dim
    for key in inputs:
        assert bridge.data_ptr(t[key]) == bridge.data_ptr(j[key]), key
    full = t["prefix_output"]
    assert full.shape[-1] == D + case.head_pad
    sliced_t, sliced_j = full[..., :D], j["prefix_output"][..., :D]  # the caller's job, both sides
    assert not sliced_t.is_contiguous()
    np.testing.assert_array_equal(_bits(bridge.to_numpy(sliced_t)), _bits(np.asarray(sliced_j)))
    with pytest.raises(ValueError, match="contiguous"):
        bridge.torch_to_jax(sliced_t)


def test_refuses_int64_offsets():
    t = torch.arange(5, dtype=torch.int64)
    with pytest.raises(TypeError, match="int32"):
        bridge.torch_to_jax(t)


def test_refuses_other_dtypes():
    with pytest.raises(TypeError, match="float64"):
        bridge.torch_to_jax(torch.zeros(4, dtype=torch.float64))
    with pytest.raises(TypeError, match="torch.Tensor"):
        bridge.torch_to_jax(np.zeros(4, dtype=np.float32))


@pytest.mark.parametrize("make", [
    lambda: torch.zeros(8, 12)[:, :8],  # gapped rows (a padded-V slice)
    lambda: torch.zeros(8, 12).t(),  # a transpose: JAX would relay it out
    lambda: torch.zeros(4).expand(3, 4),  # broadcast
], ids=["gapped", "transposed", "broadcast"])
def test_refuses_non_contiguous(make):
    with pytest.raises(ValueError, match=r"\.contiguous\(\)"):
        bridge.torch_to_jax(make())


def test_refuses_misaligned_pointer():
    t = torch.empty(17, dtype=torch.float32)[1:]  # storage offset 1: 4 bytes past an aligned base
    assert t.is_contiguous() and t.data_ptr() % 16
    with pytest.raises(ValueError, match="16-byte aligned"):
        bridge.torch_to_jax(t)
    j = bridge.torch_to_jax(t.clone())  # the advertised fix
    assert j.shape == (16,)


def test_empty_tensor_is_accepted():
    j = bridge.torch_to_jax(torch.zeros(0, 4, dtype=torch.float32))
    assert j.shape == (0, 4)


def test_cuda_tensor_needs_a_jax_gpu():
    if any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX has a GPU here")
    with pytest.raises(ValueError, match="no GPU"):
        bridge.jax_device_for("cuda:0")


def test_data_ptr_rejects_unknown():
    with pytest.raises(TypeError):
        bridge.data_ptr([1, 2, 3])
    with pytest.raises(TypeError):
        bridge.jax_to_torch(torch.zeros(2))


@pytest.mark.gpu
def test_gpu_ordering_sees_finished_torch_writes():
    # A long torch kernel writes the buffer on a side stream; the export must wait for it.
    t = torch.zeros(1 << 24, device="cuda", dtype=torch.float32)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(10_000_000)
        t.fill_(3.0)
        j = bridge.torch_to_jax(t)
    assert float(jnp.min(j)) == 3.0 and float(jnp.max(j)) == 3.0
