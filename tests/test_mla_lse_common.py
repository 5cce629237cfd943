"""mla_lse_common: the framework-free layer both kernel packages import (docs/design.md, "Kernel packages").

It imports no tensor library, and each package imports only its own; the tuning knobs are set in one place; the
host-side checks raise the errors the wrappers document."""

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mla_lse_common import checks, tiles

ROOT = Path(__file__).resolve().parents[1]
IMPORTS = """
import sys
import {module}
print(sorted(m for m in ("torch", "jax", "triton") if m in sys.modules))
"""


@pytest.mark.parametrize("module, allowed", [("mla_lse_common.tiles, mla_lse_common.checks", []),
                                             ("pallas_impl", ["jax"]), ("triton_impl", ["torch", "triton"])])
def test_each_package_imports_only_its_framework(module, allowed):
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", IMPORTS.format(module=module)], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split("\n")[-2] == str(allowed)


def test_set_knobs_sets_both_frameworks_and_restores():
    before = tiles.mask_grid(4096, 4, 64, 1, False), tiles.merge_tiles("triton", 64, 128, "lse")
    pallas = tiles.merge_tiles("pallas", 64, 128, "lse")
    previous = tiles.set_knobs(MASK_LSE_SPLIT=1, MERGE_TILES={fw: {v: (512, 1, 4) for v in t}
                                                              for fw, t in tiles.MERGE_TILES.items()})
    try:
        assert tiles.mask_grid(4096, 4, 64, 1, False)[1] == 1  # the cached grid was dropped
        assert tiles.merge_tiles("triton", 64, 128, "lse") == tiles.merge_tiles("pallas", 64, 128, "lse") == (1, 2, 128)
    finally:
        tiles.set_knobs(**previous)
    assert (tiles.mask_grid(4096, 4, 64, 1, False), tiles.merge_tiles("triton", 64, 128, "lse")) == before
    assert tiles.merge_tiles("pallas", 64, 128, "lse") == pallas
    with pytest.raises(ValueError, match="unknown knobs \\['SCAN'\\]"):
        tiles.set_knobs(SCAN=16)  # a kernel constant, not a knob


def test_host_checks_name_the_argument_and_values():
    assert checks.host_prefill_tokens(None, 7, False) == 7
    assert checks.host_prefill_tokens(np.int64(9), 7, False) == 7  # clamped to T without validate
    with pytest.raises(ValueError, match=r"prefill_tokens_with_context=9 must be in \[0, T=7\]"):
        checks.host_prefill_tokens(9, 7, True)
    for bad in (True, 3.0, "3"):
        with pytest.raises(TypeError, match="must be a host int"):
            checks.host_prefill_tokens(bad, 7, False)
    assert checks.check_lse_base(2) is True and checks.check_lse_base(math.e) is False
    with pytest.raises(ValueError, match="lse_base must be math.e or 2, got 10"):
        checks.check_lse_base(10)
    with pytest.raises(ValueError, match=r"query_start_loc and cu_seq_lens must both be i32\[R\+1\]"):
        checks.check_offset_shapes((3,), (4,))
    with pytest.raises(ValueError, match="got an empty array"):
        checks.check_offset_shapes((0,), (0,), kind="array")
    with pytest.raises(ValueError, match="go together"):
        checks.check_fused_pair(np.zeros(2), None, "cu_seq_lens")


@pytest.mark.parametrize("qsl, cu, message", [
    ([0, 2, 5], [[0, 1, 1], [0, 3, 2]], r"cu_seq_lens\[1\] must be non-decreasing; cu_seq_lens\[1\]\[1\]=3 > "),
    ([1, 2, 5], [0, 1, 1], r"query_start_loc\[0\] must be 0, got 1"),
    ([0, 2, 9], [0, 1, 1], r"query_start_loc\[R\]=9 is past the token count T=8"),
])
def test_offset_values_over_host_arrays(qsl, cu, message):
    with pytest.raises(ValueError, match=message):
        checks.check_offset_values(np.array(qsl, np.int32), np.array(cu, np.int32), 8)
    assert checks.has_zero_length([3, 0, 2]) and not checks.has_zero_length(np.array([3, 1]))
