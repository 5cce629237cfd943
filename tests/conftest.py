"""Test-session setup: run mode, seeds, markers.

Triton reads TRITON_INTERPRET when its kernels are imported, so the mode is fixed here, before any test
module imports `triton_impl`: interpreter without CUDA, compiled with it.
"""

import os
import random

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


HAS_CUDA = _has_cuda()
try:  # two torch threads fight XLA's for a 2-core CI machine (parity.library.compare runs torch ops)
    import torch

    torch.set_num_threads(1)
except ImportError:
    pass
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"


def _patch_triton_language_once_per_launch() -> None:
    """Triton's interpreter swaps `triton.language`'s builtins for interpreted ones when a kernel launches and puts
    them back when it returns; it also redoes the swap at every call of a device function (`_patch_lang(fn)`
    through `inspect.getmembers` of the language modules), which finds them swapped already and sets equivalent
    functions again. That repeat was 41% of the interpreter's time in tests/test_merge_limits.py (cProfile,
    2026-12-05): the kernels call device functions per tile. Here a device function's call skips it while a
    launch's swap covers the language modules it sees; the launch's own swap and its restore are untouched.
    Anything unlike the layout this expects (triton 3.6-3.9) leaves the interpreter as it is."""
    try:
        import inspect

        from triton.runtime import interpreter as ti
    except ImportError:
        return
    executor = getattr(ti, "GridExecutor", None)
    patch = getattr(ti, "_patch_lang", None)
    if executor is None or patch is None or not hasattr(ti, "tl"):
        return

    def langs_of(fn):
        return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (ti.tl, ti.tl.core))

    class _Kept:
        def restore(self):
            pass

    launches = []  # per running launch: None until its own swap, then the ids of the modules it swapped

    def patch_lang(fn):
        if launches and launches[-1] is not None and langs_of(fn) <= launches[-1]:
            return _Kept()
        scope = patch(fn)
        if launches and launches[-1] is None:
            launches[-1] = langs_of(fn)
        return scope

    run = executor.__call__

    def launch(self, *args, **kwargs):
        launches.append(None)
        try:
            return run(self, *args, **kwargs)
        finally:
            launches.pop()

    ti._patch_lang = patch_lang
    executor.__call__ = launch


if not HAS_CUDA:
    _patch_triton_language_once_per_launch()

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
