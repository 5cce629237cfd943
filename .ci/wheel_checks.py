"""What a user of one extra meets, from the built wheel in a fresh environment, run outside the source tree (`.ci/wheel`):

    python wheel_checks.py golden|jax|triton

- golden (numpy + ml_dtypes): `python -m parity example numpy_port > my_port.py`, `export --suite ci`, `verify` of the
  shipped port and of the copy, all with torch, triton and jax absent; `check` says which extra it needs;
- jax: pallas_impl without torch (a merge against a hand-written one, the jnp path), `python -m parity --help`
  fast and framework-free, `check` names the extra;
- triton: triton_impl without jax, on the CPU without TRITON_INTERPRET (the torch path: every entry point), the
  provenance of an installed package (no commit), `check` names the extra.
Each check prints one line; any failure raises.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time


def _parity(*argv, check=True):
    res = subprocess.run([sys.executable, "-m", "parity", *argv], capture_output=True, text=True)
    if check and res.returncode != 0:
        raise AssertionError(f"parity {' '.join(argv)}: exit {res.returncode}\n{res.stdout}\n{res.stderr}")
    return res


def _absent(*names):
    for name in names:
        assert importlib.util.find_spec(name) is None, f"{name} is installed in this environment"


def _missing_extra_line(command, extra):
    res = _parity(command, check=False)
    err = res.stderr.strip()
    assert res.returncode == 3 and len(err.splitlines()) == 1 and f'pip install "mla-lse-merge[{extra}]"' in err, \
        (command, res.returncode, err)
    print(f"ok: `parity {command}` without its extra: {err}")


def golden(tmp):
    _absent("torch", "triton", "jax")
    port = os.path.join(tmp, "my_port.py")
    with open(port, "w") as f:
        f.write(_parity("example", "numpy_port").stdout)
    gold = os.path.join(tmp, "golden")
    _parity("export", gold, "--suite", "ci", "--quiet")
    manifest = json.load(open(os.path.join(gold, "manifest.json")))
    assert manifest["generator"]["git_commit"] is None and manifest["generator"]["source"].startswith("installed")
    n = sum(len(c["ops"]) for c in manifest["cases"])
    for impl in ("parity.examples.numpy_port:port", f"{port}:port"):
        out = _parity("verify", gold, "--impl", impl, "--quiet").stdout
        assert f"{n}/{n} ok" in out, out[-500:]
    print(f"ok: numpy + ml_dtypes only: export --suite ci, verify of the shipped port and of its copy: {n}/{n}")
    _missing_extra_line("check", "parity")


def jax_only(tmp):
    _absent("torch", "triton")
    import jax.numpy as jnp
    import numpy as np

    import pallas_impl

    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((40, 2, 16)).astype(np.float32) for _ in range(2))
    pl, sl = (rng.standard_normal((2, 40)).astype(np.float32) for _ in range(2))
    out, lse = pallas_impl.merge_attn_states(jnp.asarray(a), jnp.asarray(pl), jnp.asarray(b), jnp.asarray(sl))
    m = np.maximum(pl, sl).T[..., None]
    want = (a * np.exp(pl.T[..., None] - m) + b * np.exp(sl.T[..., None] - m)) / (
        np.exp(pl.T[..., None] - m) + np.exp(sl.T[..., None] - m))
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-6)
    print("ok: pallas_impl without torch: a merge equals a hand-written one")
    t0 = time.perf_counter()
    res = _parity("--help")
    assert "COMMAND" in res.stdout and time.perf_counter() - t0 < 2.0
    print(f"ok: `parity --help` in {time.perf_counter() - t0:.2f} s")
    _missing_extra_line("check", "parity")


def triton_only(tmp):
    _absent("jax")
    assert "TRITON_INTERPRET" not in os.environ
    import torch

    import triton_impl

    T, H, D = 40, 2, 16
    o, lse = torch.randn(3, T, H, D), torch.randn(3, H, T)
    qsl, cu = torch.tensor([0, 10, 30], dtype=torch.int32), torch.tensor([0, 0, 4], dtype=torch.int32)
    masked = lse[0].clone()
    triton_impl.mask_empty_context_lse(masked, qsl, cu)
    assert (masked[:, :10] == float("-inf")).all() and torch.equal(masked[:, 10:], lse[0][:, 10:])
    out, out_lse = torch.empty(T, H, D), torch.empty(H, T)
    triton_impl.merge_attn_states(out, o[0], lse[0], o[1], lse[1], out_lse)
    w = torch.softmax(torch.stack([lse[0], lse[1]]), 0).transpose(1, 2)[..., None]
    torch.testing.assert_close(out, w[0] * o[0] + w[1] * o[1], rtol=1e-5, atol=1e-6)
    triton_impl.merge_attn_states_n(out, o, lse, out_lse, query_start_loc=qsl, cu_seq_lens=torch.stack([cu] * 3))
    print("ok: triton_impl without jax, on a CPU without TRITON_INTERPRET: the torch path (mask, 2-way, N-way)")
    from parity.harness import provenance

    assert provenance.git_commit() is None and provenance.source().startswith("installed")
    print(f"ok: provenance of an installed package: {provenance.source()}, no commit")
    _missing_extra_line("check", "parity")


if __name__ == "__main__":
    role = sys.argv[1]
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)  # outside the source tree
        {"golden": golden, "jax": jax_only, "triton": triton_only}[role](tmp)
