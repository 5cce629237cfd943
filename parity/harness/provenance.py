"""Provenance: the environment record every command writes (devices, versions, driver, commit, time, command)."""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from typing import Any

PROJECT = "mla-lse-merge"


def _checkout_root() -> str | None:
    """The folder above this package when it is a git checkout of this project (its pyproject.toml names it and
    its .git is there), else None: an installed package, even one inside an unrelated repository."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        with open(os.path.join(root, "pyproject.toml")) as f:
            ours = f'name = "{PROJECT}"' in f.read()
    except OSError:
        return None
    return root if ours and os.path.exists(os.path.join(root, ".git")) else None


def git_commit() -> str | None:
    """$GIT_COMMIT (a copied tree, as on the device machine, may carry a stale .git), else the HEAD of the checkout
    this package is imported from (`_checkout_root`); None for an installed package (`source` says which)."""
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    root = _checkout_root()
    if root is None:
        return None
    try:
        r = subprocess.run(["git", "-C", root, "rev-parse", "--verify", "-q", "HEAD"], capture_output=True,
                           text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() or None


def source() -> str:
    """Where this package runs from: "checkout" (then `git_commit` is its HEAD) or "installed <version>"."""
    if os.environ.get("GIT_COMMIT") or _checkout_root() is not None:
        return "checkout"
    from importlib import metadata

    try:
        return f"installed {metadata.version(PROJECT)}"
    except metadata.PackageNotFoundError:
        return "installed (version unknown)"


def _run_text(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def collect_env(argv: list[str] | None = None, *, frameworks: bool = True) -> dict[str, Any]:
    """Devices, versions, driver, git commit, where the package runs from, UTC time and command line of this run.

    `argv` is the argument list of `python -m parity` (the command is recorded as that); None records
    `sys.argv`. With frameworks=False (golden export and verify: numpy alone may be installed) torch, jax and
    pallas_impl are asked for their devices only when this process imported them already.
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
    def wanted(module: str) -> bool:
        return frameworks or module in sys.modules

    try:
        if not wanted("torch"):
            raise ImportError("not imported by this run")
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
        if not wanted("jax"):
            raise ImportError("not imported by this run")
        import jax

        env["jax_backend"] = jax.default_backend()
        env["devices"]["jax"] = [f"{d.platform}:{getattr(d, 'device_kind', '')}" for d in jax.devices()]
    except Exception as e:  # noqa: BLE001 - informational only
        env["jax_backend"] = f"unavailable: {type(e).__name__}: {e}"
    try:
        if not wanted("pallas_impl"):
            raise ImportError("not imported by this run")
        from pallas_impl import _backend as pallas_impl_backend

        from parity.harness import impls

        env["pallas_backend"] = pallas_impl_backend.resolve_backend(impls.pallas_backend())
    except Exception as e:  # noqa: BLE001 - informational only
        env["pallas_backend"] = f"unavailable: {type(e).__name__}: {e}"
    env["git_commit"] = git_commit()
    env["source"] = source()
    env["utc_time"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    env["command"] = ("python -m parity " + shlex.join(argv)) if argv is not None else shlex.join(sys.argv)
    env["environment_variables"] = {k: os.environ.get(k) for k in ("TRITON_INTERPRET", "XLA_PYTHON_CLIENT_PREALLOCATE",
                                                                   "XLA_FLAGS")}
    return env
