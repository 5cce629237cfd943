#!/usr/bin/env bash
# The Mosaic GPU backend's tests on a CPU machine whose Python is older than jax 0.11 needs (3.12+): a Debian
# trixie root (Python 3.13) by debootstrap, jax 0.11 and the test dependencies in a venv inside it, then pytest in
# it over this checkout (`python -m tools mosaic-cpu [PYTEST ARGS]`; as root, with debootstrap and the network):
#
#   python -m tools mosaic-cpu                       # tests/test_pallas_mosaic.py and the op tests' mosaic runs
#   python -m tools mosaic-cpu tests/test_pallas_mosaic.py -k wide
#
# What runs: jax's Mosaic GPU interpreter (the kernels' semantics against the float64 reference) and the lowering of
# every kernel for the GPU (`jax.export`, platforms=["cuda"]: layout inference, shared-memory budgets, TMA shapes).
# Not the GPU's float bits (XLA:CPU arithmetic): those are the GPU check's. The root (MOSAIC_ROOT, default
# /tmp/mosaic-root) is built once (about 4 minutes, 5.5 GB with torch: PyPI's CUDA build, which imports on a CPU;
# 2026-12-05); later runs reuse it.
# docs/design.md, "Mosaic GPU backend", says what CI covers and why this is not in it.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=${MOSAIC_ROOT:-/tmp/mosaic-root}
JAX_VERSION=${JAX_VERSION:-0.11.2}
TORCH_VERSION=${TORCH_VERSION:-2.11.0}
REPO=$(pwd)
CA=${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}

if [ ! -f "$ROOT/opt/venv/pyvenv.cfg" ]; then  # built already: reuse it
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates trixie "$ROOT" \
        http://deb.debian.org/debian
    cp /etc/resolv.conf "$ROOT/etc/"
    [ -f "$CA" ] && cp "$CA" "$ROOT/etc/ssl/certs/ca-certificates.crt"  # a proxy's CA, where the host has one
    chroot "$ROOT" python3 -m venv /opt/venv
    chroot "$ROOT" env PIP_CERT=/etc/ssl/certs/ca-certificates.crt /opt/venv/bin/pip install -q \
        "jax[cpu]==$JAX_VERSION" "torch==$TORCH_VERSION" numpy ml_dtypes pytest hypothesis absl-py
fi
mkdir -p "$ROOT/repo"
mountpoint -q "$ROOT/repo" || mount --bind "$REPO" "$ROOT/repo"
mountpoint -q "$ROOT/proc" || mount -t proc proc "$ROOT/proc"
trap 'umount "$ROOT/repo" "$ROOT/proc" 2>/dev/null || true' EXIT
[ $# -gt 0 ] || set -- tests/test_pallas_mosaic.py tests/test_op_mask.py tests/test_op_merge.py \
    tests/test_op_merge_n.py -k "mosaic or lower or width"
chroot "$ROOT" env -C /repo PYTHONPATH=/repo:/repo/tests /opt/venv/bin/python -m pytest -q -p no:cacheprovider "$@"
