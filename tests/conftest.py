"""Test-session setup: run mode, seeds, markers.

Triton reads TRITON_INTERPRET when its kernels are imported, so the mode is fixed here, before any test
module imports `triton_impl`: interpreter without CUDA, compiled with it.
"""

import os
import random

from parity.harness.impls.runtime import configure

# The harness's run mode (parity.harness.impls.runtime.configure): without CUDA, TRITON_INTERPRET=1 and Pallas in
# interpret mode, Triton's interpreter without its per-device-call repeat; XLA_PYTHON_CLIENT_PREALLOCATE=false.
HAS_CUDA = configure()
try:  # two torch threads fight XLA's for a 2-core CI machine (parity.library.compare runs torch ops)
    import torch

    torch.set_num_threads(1)
except ImportError:
    pass

import numpy as np  # noqa: E402
import pytest  # noqa: E402

try:
    from hypothesis import HealthCheck, settings

    settings.register_profile(
        "ci", derandomize=True, deadline=None, max_examples=12,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
except ImportError:  # hypothesis is in the `test` extra
    pass


@pytest.fixture(autouse=True)
def _seed():
    random.seed(0)
    np.random.seed(0)
    try:
        import torch

        torch.manual_seed(0)
    except ImportError:
        pass


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none visible)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=["interpret", pytest.param("compiled", marks=pytest.mark.gpu)])
def mode(request):
    """Pallas run mode: identical test bodies in interpret mode and compiled on the GPU."""
    return request.param
