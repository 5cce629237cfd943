#!/usr/bin/env bash
# One GPU run: versions, the GPU tests, the full parity check, the demos, the benchmark and the sweeps.
#
#   OUT=/some/dir [PLAN=all|tests|bench|mosaic|mosaic_speed] bash scripts/gpu_check.sh     # from the repository root
#
# PLAN picks the steps; each plan but "all" fits one 10-minute call (DEADLINE_S, default 560 s; "all": 1500 s):
#   tests         the GPU-marked tests (`pytest -m gpu`; the CPU tests are CI's), the full parity check, the demos
#                 (modelled backends, context parallelism, real attention kernels): pytest.log check.log
#                 check_full.json demo.log
#   bench         `python -m parity bench` (BENCH_ARGS, default "--quick": GPU time, eager and host cost per call
#                 beside their floors, the layout axis), the host cost of every Triton entry point
#                 (scripts/host_cost.py) and the mask's split sweep beside `fill_` (scripts/mask_floor.py):
#                 bench.log bench.json bench.png host_cost.log mask_floor.log mask_floor.json
#   mosaic        the Mosaic GPU backend of pallas_impl: its tests, the full check on it, compute-sanitizer
#   mosaic_speed  the Mosaic GPU kernels timed beside the Triton backend's, with a sweep of their launch choices
#   all           tests, then bench (the default)
# Always env.txt. A failing step does not stop the next one; each runs under `timeout`, sized from what is left of
# DEADLINE_S. Exit status: 0 when every step exited 0, else 1 (124 in the summary means that step timed out).

set -u -o pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-out}
PY=${PYTHON:-python3}
BENCH_ARGS=${BENCH_ARGS---quick}
PLAN=${PLAN:-all}
DEADLINE_S=${DEADLINE_S:-$([ "$PLAN" = all ] && echo 1500 || echo 560)}
mkdir -p "$OUT"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export PYTHONUNBUFFERED=1
if [ -z "${GIT_COMMIT:-}" ] && command -v git >/dev/null 2>&1; then
    GIT_COMMIT=$(git rev-parse --verify -q HEAD 2>/dev/null || true)
    export GIT_COMMIT
fi

START=$(date +%s)
SUMMARY=""
FAILED=0

remaining() { echo $(( DEADLINE_S - ($(date +%s) - START) )); }

# step NAME CAP_S RESERVE_S LOG CMD...: run CMD under timeout min(CAP_S, time left - RESERVE_S), tee'd to LOG.
# RESERVE_S is the time kept for the steps after this one.
step() {
    local name=$1 cap=$2 reserve=$3 log=$4
    shift 4
    local t=$(( $(remaining) - reserve ))
    [ "$t" -gt "$cap" ] && t=$cap
    if [ "$t" -lt 10 ]; then
        echo "== $name: skipped (no time left)" | tee "$log"
        SUMMARY+="$(printf '%-8s skipped (no time left)' "$name")"$'\n'
        FAILED=1
        return
    fi
    echo "== $name (timeout ${t}s): $*" | tee "$log"
    local t0
    t0=$(date +%s)
    timeout -k 10 "$t" "$@" 2>&1 | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    SUMMARY+="$(printf '%-8s rc=%-3s %4ss' "$name" "$rc" "$(( $(date +%s) - t0 ))")"$'\n'
    [ "$rc" -ne 0 ] && FAILED=1
    return 0
}

{
    echo "== date: $(date -u +%Y-%m-%dT%H:%M:%SZ)  commit: ${GIT_COMMIT:-unknown}  BENCH_ARGS='$BENCH_ARGS'"
    timeout 60 "$PY" - <<'EOF' 2>&1
import platform, sys
print("python", sys.version.split()[0], platform.platform())
for name in ("numpy", "ml_dtypes", "torch", "triton", "jax", "jaxlib", "pytest", "hypothesis", "matplotlib"):
    try:
        mod = __import__(name)
        print(f"{name:11s}", getattr(mod, "__version__", "?"))
    except Exception as e:  # report and go on: the steps below show what breaks
        print(f"{name:11s} unavailable: {type(e).__name__}: {e}")
try:
    import torch
    print("torch cuda", torch.version.cuda, "available", torch.cuda.is_available(),
          torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
    import jax
    print("jax backend", jax.default_backend(), jax.devices())
except Exception as e:
    print("device query failed:", type(e).__name__, e)
EOF
    timeout 30 nvidia-smi 2>&1 || echo "nvidia-smi failed"
} | tee "$OUT/env.txt"

# pytest-xdist (in the device image) spreads the kernel compiles over 4 workers; without it, one process.
# The full check in 8 processes (`scripts/check_shards.sh`): 72-83 s per Pallas backend on the H200 (session 6).
export CHECK_SHARDS=${CHECK_SHARDS:-8}
XDIST=$("$PY" -c "import xdist" 2>/dev/null && echo "-n 4")

if [ "$PLAN" = mosaic ] || [ "$PLAN" = mosaic_speed ]; then
    # The experimental Mosaic GPU backend of pallas_impl (docs/design.md, "Mosaic GPU backend"). PLAN=mosaic: the
    # Pallas test suite with that backend as the default (PALLAS_IMPL_BACKEND) and its own tests (bits against the
    # Triton backend), then the full parity check with Pallas on Mosaic GPU (its compiles take most of it: 3 shards
    # did not finish in 150 s on the H200 in session 5; 8 shards took 78-83 s in session 6), then its kernels under
    # compute-sanitizer (scripts/sanitize_mosaic.py). PLAN=mosaic_speed: its
    # kernels timed beside the Triton backend's with a sweep of their launch choices (scripts/mosaic_speed.py).
    if [ "$PLAN" = mosaic ]; then
        # shellcheck disable=SC2086
        step pytest 240 150 "$OUT/pytest.log" env PALLAS_IMPL_BACKEND=mosaic_gpu "$PY" -m pytest -q -rs $XDIST \
            tests/test_pallas_mask.py tests/test_pallas_merge.py tests/test_pallas_merge_n.py tests/test_pallas_mosaic.py \
            tests/test_op_mask.py tests/test_op_merge.py tests/test_op_merge_n.py -k "pallas or mosaic"
        step check 300 30 "$OUT/check.log" bash scripts/check_shards.sh "$OUT/check_full.json" \
            --pallas-backend mosaic_gpu
        step sanitize 150 5 "$OUT/sanitize.log" env XLA_PYTHON_CLIENT_ALLOCATOR=platform compute-sanitizer \
            --tool memcheck --error-exitcode 1 "$PY" scripts/sanitize_mosaic.py
    else
        step mosaic_speed 200 5 "$OUT/mosaic_speed.log" "$PY" scripts/mosaic_speed.py --json "$OUT/mosaic_speed.json"
    fi
    echo "== summary ($(( $(date +%s) - START ))s of ${DEADLINE_S}s)"
    printf '%s' "$SUMMARY"
    exit "$FAILED"
fi
if [ "$PLAN" = all ] || [ "$PLAN" = tests ]; then
    # shellcheck disable=SC2086
    step pytest 200 240 "$OUT/pytest.log" "$PY" -m pytest -q -rs -m gpu $XDIST
    # The full check compiles ~120 kernels per framework: CHECK_SHARDS processes split the cases (--shard K/N).
    step check 150 100 "$OUT/check.log" bash scripts/check_shards.sh "$OUT/check_full.json"
    step demo 90 110 "$OUT/demo.log" "$PY" -m parity demo --size large
    # The context-parallel demo: JAX over 4 ranks simulated by a named vmap on the one GPU, torch on 4 gloo ranks;
    # then the partials of real attention kernels (PyTorch's FlashAttention-2, cuDNN through jax.nn).
    step demo_cp 60 70 "$OUT/demo_more.log" "$PY" -m parity demo --cp 4 --interleave 2
    cat "$OUT/demo_more.log" >> "$OUT/demo.log"
    for backend in torch-flash jax-cudnn; do
        step "demo_$backend" 60 5 "$OUT/demo_more.log" "$PY" -m parity demo --backend "$backend" --size real
        cat "$OUT/demo_more.log" >> "$OUT/demo.log"
    done
    rm -f "$OUT/demo_more.log"
fi
if [ "$PLAN" = all ] || [ "$PLAN" = bench ]; then
    step host_cost 90 300 "$OUT/host_cost.log" "$PY" scripts/host_cost.py
    step mask_floor 150 200 "$OUT/mask_floor.log" "$PY" scripts/mask_floor.py --json "$OUT/mask_floor.json"
    # The bench stops starting new points 60 s before its timeout, so the JSON, table and plot still get written.
    BENCH_T=$(( $(remaining) - 5 ))
    # shellcheck disable=SC2086  # BENCH_ARGS is a list of options
    step bench 600 5 "$OUT/bench.log" "$PY" -m parity bench --budget-s $(( BENCH_T > 90 ? BENCH_T - 60 : 30 )) \
        $BENCH_ARGS --json "$OUT/bench.json" --plot "$OUT/bench.png"
fi

echo "== summary ($(( $(date +%s) - START ))s of ${DEADLINE_S}s)"
printf '%s' "$SUMMARY"
ls -la "$OUT"
exit "$FAILED"
