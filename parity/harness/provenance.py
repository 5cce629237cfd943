"""Provenance: the environment record every command writes (devices, versions, driver, commit, time, command)."""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from typing import Any

def git_commit() -> str | None:
    """$GIT_COMMIT (a copied tree, as on the device machine, may carry a stale .git), else the checkout's HEAD."""
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        r = subprocess.run(["git", "-C", root, "rev-parse", "--verify", "-q", "HEAD"], capture_output=True,
                           text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() or None


def _run_text(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def collect_env(argv: list[str] | None = None) -> dict[str, Any]:
    """Devices, versions, driver, git commit, UTC time and command line of this run.

    `argv` is the argument list of `python -m parity` (the command is recorded as that); None records
    `sys.argv`.
    """
    import importlib.metadata as md

    versions: dict[str, str | None] = {"python": platform.python_version()}
    for pkg in ("numpy", "torch", "triton", "jax", "jaxlib", "ml_dtypes"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    env: dict[str, Any] = {"versions": versions, "platform": platform.platform(), "devices": {},
                           "gpu": None, "driver": None, "cuda": None}
    try:
        import torch

        env["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            env["devices"]["torch"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            env["gpu"] = env["devices"]["torch"][0]
            env["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        else:
            env["devices"]["torch"] = ["cpu"]
    except ImportError:
        env["devices"]["torch"] = None
    smi = _run_text(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"])
    if smi:
        name, _, driver = smi.splitlines()[0].partition(",")
        env["driver"] = driver.strip() or None
        env["gpu"] = env["gpu"] or name.strip()
    try:
        import jax

        env["jax_backend"] = jax.default_backend()
        env["devices"]["jax"] = [f"{d.platform}:{getattr(d, 'device_kind', '')}" for d in jax.devices()]
    except Exception as e:  # noqa: BLE001 - informational only
        env["jax_backend"] = f"unavailable: {type(e).__name__}: {e}"
    try:
        from pallas_impl import _backend as pallas_impl_backend

        from parity.harness import impls

        env["pallas_backend"] = pallas_impl_backend.resolve_backend(impls.pallas_backend())
    except Exception as e:  # noqa: BLE001 - informational only
        env["pallas_backend"] = f"unavailable: {type(e).__name__}: {e}"
    env["git_commit"] = git_commit()
    env["utc_time"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    env["command"] = ("python -m parity " + shlex.join(argv)) if argv is not None else shlex.join(sys.argv)
    env["environment_variables"] = {k: os.environ.get(k) for k in ("TRITON_INTERPRET", "XLA_PYTHON_CLIENT_PREALLOCATE",
                                                                   "XLA_FLAGS")}
    return env
