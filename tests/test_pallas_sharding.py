"""pallas_impl under jax.shard_map and sharded jax.jit, and the JAX context-parallel combine, on 4 CPU devices.

JAX fixes its device count at start-up, so the checks run once in their own process (`multidevice_jax.py`,
with XLA_FLAGS=--xla_force_host_platform_device_count=4); each test asserts the checks of one group. Every check
compares bits with the unsharded (or single-device N-way) call, or with the float64 reference within tolerance.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import jax

HERE = Path(__file__).resolve().parent
# 4 CPU devices, with the session's other XLA flags (the CPU run mode's, conftest.py)
FOUR_DEVICES = " ".join([os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=4"]).strip()


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    out = tmp_path_factory.mktemp("multidevice") / "checks.json"
    env = dict(os.environ, XLA_FLAGS=FOUR_DEVICES, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, str(HERE / "multidevice_jax.py"), str(out)], env=env, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0 and out.exists(), r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(out.read_text())


def _assert_group(checks, prefix, at_least):
    group = {k: v for k, v in checks.items() if k.startswith(prefix)}
    assert len(group) >= at_least, f"expected {at_least} checks under {prefix!r}, got {sorted(group)}"
    failed = {k: v["detail"] for k, v in group.items() if not v["ok"]}
    assert not failed, "\n\n".join(f"{k}:\n{d}" for k, d in failed.items())


def test_every_entry_point_under_shard_map_with_check_vma(checks):
    # mask, fused 2-way merge, fused N-way merge x (pallas kernel, jnp) x (Explicit, Auto mesh): heads sharded.
    _assert_group(checks, "shard_map/", 3 * 2 * 2)


def test_every_entry_point_under_jit_with_named_sharding(checks):
    _assert_group(checks, "jit_named_sharding/", 3 * 2 * 2 + 1)


def test_compiled_kernels_trace_under_shard_map(checks):
    _assert_group(checks, "compiled_trace_under_shard_map/", 3)


@pytest.mark.skipif(tuple(int(x) for x in re.findall(r"\d+", jax.__version__)[:2]) < (0, 11),
                    reason=f"backend='mosaic_gpu' needs jax >= 0.11; this is jax {jax.__version__}")
def test_mosaic_gpu_kernels_trace_under_shard_map(checks):
    # The mask, the fused merges and the CP gather and reduce_scatter with backend="mosaic_gpu", compiled, under
    # check_vma=True.
    _assert_group(checks, "compiled_trace_under_shard_map/", 3 + 5)
    assert sum("/mosaic" in k for k in checks) == 5, sorted(checks)


def test_cp_gather_gives_the_single_device_bits(checks):
    _assert_group(checks, "cp/gather/", 2)


def test_cp_reduce_scatter_within_tolerance(checks):
    _assert_group(checks, "cp/reduce_scatter/", 4)


def test_cp_on_vmap_simulated_ranks(checks):
    _assert_group(checks, "cp/vmap_simulated_ranks/", 2)


def test_cp_errors_before_any_collective(checks):
    _assert_group(checks, "cp/errors/", 4)


HANG_TIMEOUT_S = 240  # about 30 s of CPU time when it passes


def test_interpreted_kernels_under_shard_map_on_more_devices_than_cores_do_not_hang():
    """The mask, the 2-way merge (plain, fused, over two mesh axes), the fused N-way merge and the CP combine (both
    methods), interpreted under jit(shard_map) with check_vma=True on 4 CPU devices, 21 runs in all, each with the
    unsharded call's bits (`shard_map_interpret_jax.py`). A kernel that waits inside the sharded computation for
    another JAX computation (a host callback) hangs there: the run times out."""
    env = dict(os.environ, XLA_FLAGS=FOUR_DEVICES, JAX_PLATFORMS="cpu")
    try:
        r = subprocess.run([sys.executable, str(HERE / "shard_map_interpret_jax.py")], env=env, capture_output=True,
                           text=True, timeout=HANG_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        pytest.fail(f"no result after {HANG_TIMEOUT_S} s (a deadlock); the last calls that finished:\n{out[-1000:]}")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    calls = re.search(r"(\d+) shard_map calls on 4 devices", r.stdout)
    assert calls and int(calls.group(1)) >= 20, r.stdout[-3000:]
