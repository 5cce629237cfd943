#!/usr/bin/env bash
# One GPU run of the maintainers' checks and measurements (`python -m tools gpu-run`, docs/results.md "Recording a
# GPU run"):
#
#   OUT=/some/dir [PLAN=all|tests|bench|more|mosaic|mosaic_speed|mosaic_candidates|verify|fp8|verify_tests] \
#       python -m tools gpu-run
#
# PLAN picks the steps; each plan but "all" fits one 10-minute call (DEADLINE_S, default 560 s; "all": 1500 s):
#   tests         the GPU-marked tests (`pytest -m gpu`; the CPU tests are CI's) and the full parity check on
#                 both Pallas backends (Triton, Mosaic GPU): pytest.log check.log check_full.json check_mosaic.*
#   bench         `python -m parity bench` (BENCH_ARGS, default "--quick": GPU time, eager and host cost per call
#                 beside their floors, the layout axis), the host cost of every Triton entry point (host-cost),
#                 the mask beside `fill_` and upstream's design (mask-sweep), the attention-kernel probe
#                 (`python -m parity probe`) and the cross_check error-model pairs
#                 (parity/examples/error_model_pairs.py): bench.* host_cost.log mask_floor.* probe.* pairs.*
#   more          the host cost again, the N-way merge at large N (wide-n: first-call compile time, bandwidth at
#                 N = 128, 256), the chunked-context loop as one captured step (`python -m parity loop`, torch and
#                 JAX), the probe in one process, then GPU tests (GPU_TESTS, default all) in the time left
#   mosaic        the Mosaic GPU backend of pallas_impl: its tests, the full check on it, compute-sanitizer
#   mosaic_speed  the Mosaic GPU kernels timed beside the Triton backend's, with a sweep of their launch choices
#                 (MOSAIC_SPEED_ARGS="--grid --budget-s 480": the merges' whole table instead), then the 2-way
#                 merge under Nsight Compute on both backends (mosaic-profile): mosaic_speed.* ncu_*.txt
#   mosaic_candidates  the Mosaic GPU launch choices no default takes yet (`CANDIDATES` of
#                 tests/test_pallas_mosaic.py): the [T, H] LSE boxes' bits against the Triton backend's, their
#                 time beside the defaults on the merges' [T, H] cells (T = 2K, 32K; N = 2, 4, 8), the NVFP4
#                 candidates' time: pytest.log mosaic_speed_th.* mosaic_speed_nvfp4.*
#   verify        after a kernel or launch change: the full parity check (Pallas on its Triton backend; with
#                 VERIFY_MOSAIC=1 on Mosaic GPU too), the N-way merge at large N (wide-n speed; with
#                 VERIFY_KERNELS=1 each kernel of the split fused merge), the GPU tests of the N-way merge and the
#                 loop (GPU_TESTS): check*.json check*.log wide_n_speed.* kernels_* pytest.log
#   fp8           per-group FP8 and NVFP4: their GPU tests (and the torch path's and Mosaic GPU's long-T ones), the
#                 full check's quantized cases on both Pallas backends, the fused merges' speed (group-fp8-speed;
#                 Mosaic GPU's too): pytest.log check_*.json group_fp8_speed.* nvfp4_speed.* *_mosaic.json
#   verify_tests  the GPU tests (`pytest -m gpu -v -rf`: a timeout still names what ran and failed), then the
#                 first-call compile times (wide-n compile): pytest.log wide_n_compile.*
#   all           tests, bench, then more
# The launch sweeps run on their own: `python -m tools tune merge|merge_n|mask ...`.
# Every file but env.txt and summary.txt is packed into $OUT/run.tgz at the end (the device tool brings back
# few files).
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
# The device tool's copy of the tree may carry stale git metadata: pass GIT_COMMIT=<the tree's commit> there.
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
# The full check in 8 processes (tools/check_shards.sh): 72-83 s per Pallas backend on the H200 (2026-12-01).
export CHECK_SHARDS=${CHECK_SHARDS:-8}
XDIST=$("$PY" -c "import xdist" 2>/dev/null && echo "-n 4")
GPU_TESTS=${GPU_TESTS:-}  # PLAN=more, verify: test files for their GPU tests step (default: every GPU test; verify: its own)

if [ "$PLAN" = mosaic ] || [ "$PLAN" = mosaic_speed ] || [ "$PLAN" = mosaic_candidates ]; then
    # The experimental Mosaic GPU backend of pallas_impl (docs/design.md, "Mosaic GPU backend"). PLAN=mosaic: the
    # Pallas test suite with that backend as the default (PALLAS_IMPL_BACKEND) and its own tests (bits against the
    # Triton backend), then the full parity check with Pallas on Mosaic GPU (its compiles take most of it: 3 shards
    # did not finish in 150 s on the H200; 8 shards took 78-83 s, 2026-12-01), then its kernels under
    # compute-sanitizer (tools/sanitize_mosaic.py). PLAN=mosaic_speed: its
    # kernels timed beside the Triton backend's with a sweep of their launch choices (tools/mosaic_speed.py).
    if [ "$PLAN" = mosaic_candidates ]; then
        # (each test compiles both backends at T = 1001 and 32K: about 95 s a test on the H100, 2026-12-07; the
        # N-way NVFP4 rows split has its bits from 2026-12-08 and waits for PLAN=mosaic with it as the default)
        step pytest 300 245 "$OUT/pytest.log" "$PY" -m pytest -m gpu -v -rf tests/test_pallas_mosaic.py \
            -k "launch_candidates and th_boxes"
        # the merges' [T, H] cells at T = 2K and 32K with the LSEs in boxes of heads (th_boxes) beside the defaults
        step mosaic_speed_th 170 75 "$OUT/mosaic_speed_th.log" "$PY" -m tools.mosaic_speed --grid --first 2 \
            --kernels merge merge_n --match "^(merge|merge_n N=(2|4|8)) T=(2048|32768) (plain|lse|fused) TH$" \
            --budget-s 155 --json "$OUT/mosaic_speed_th.json"
        # the N-way NVFP4 merge split by rows over two compute warpgroups on the NVFP4 points
        step mosaic_speed_nvfp4 70 5 "$OUT/mosaic_speed_nvfp4.log" "$PY" -m tools.mosaic_speed --kernels merge \
            merge_n --first 3 --match nvfp4 --budget-s 55 --json "$OUT/mosaic_speed_nvfp4.json"
    elif [ "$PLAN" = mosaic ]; then
        # shellcheck disable=SC2086
        step pytest 240 150 "$OUT/pytest.log" env PALLAS_IMPL_BACKEND=mosaic_gpu "$PY" -m pytest -q -rs $XDIST \
            tests/test_pallas_mask.py tests/test_pallas_merge.py tests/test_pallas_merge_n.py tests/test_pallas_mosaic.py \
            tests/test_op_mask.py tests/test_op_merge.py tests/test_op_merge_n.py -k "pallas or mosaic"
        step check 300 30 "$OUT/check.log" bash tools/check_shards.sh "$OUT/check_full.json" \
            --pallas-backend mosaic_gpu
        step sanitize 150 5 "$OUT/sanitize.log" env XLA_PYTHON_CLIENT_ALLOCATOR=platform compute-sanitizer \
            --tool memcheck --error-exitcode 1 "$PY" -m tools.sanitize_mosaic
    else
        # MOSAIC_SPEED_ARGS: e.g. "--grid --budget-s 480" for the merges' whole table (with DEADLINE_S=560)
        # shellcheck disable=SC2086
        step mosaic_speed $([ -n "${MOSAIC_SPEED_ARGS:-}" ] && echo 540 || echo 200) 65 "$OUT/mosaic_speed.log" "$PY" \
            -m tools.mosaic_speed ${MOSAIC_SPEED_ARGS:-} --json "$OUT/mosaic_speed.json"
        # the 2-way plain merge under Nsight Compute on both backends (MOSAIC_PROFILE_ARGS: another op or variant)
        # shellcheck disable=SC2086
        step mosaic_profile 60 5 "$OUT/mosaic_profile.log" "$PY" -m tools.mosaic_profile ${MOSAIC_PROFILE_ARGS:-} \
            --out "$OUT"
    fi
    echo "== summary ($(( $(date +%s) - START ))s of ${DEADLINE_S}s)"
    printf '%s' "$SUMMARY"
    exit "$FAILED"
fi
if [ "$PLAN" = verify ]; then
    # GPU_TESTS (default: the N-way merge's and the loop's files) run after the N-way merge's speed; the Mosaic GPU
    # check, last, when its kernels changed (VERIFY_MOSAIC=1).
    # The check's reserve scales with DEADLINE_S (330 s of the default 560), so a shorter call still runs it.
    step check 110 $(( DEADLINE_S * 330 / 560 )) "$OUT/check.log" bash tools/check_shards.sh "$OUT/check_full.json"
    step wide_n_speed 190 $(( ${VERIFY_KERNELS:-0} == 1 ? 260 : 180 )) "$OUT/wide_n_speed.log" "$PY" \
        -m tools.wide_n --part speed --json "$OUT/wide_n_speed.json"
    if [ "${VERIFY_KERNELS:-0}" = 1 ]; then
        # Each kernel of the split fused merge (--kernels), N = 128 / 256, T = 8192, both LSE layouts, the committed
        # tables twice (the spread), one framework per process.
        for fw in triton pallas; do
            step "kernels_$fw" 60 $([ $fw = triton ] && echo 200 || echo 140) "$OUT/kernels_$fw.log" "$PY" \
                -m tools.tune merge_n --heads 64 --dims 128 --tokens 8192 --partials 128 256 --variants fused \
                --lse-layout HT TH --kernels --frameworks $fw --budget-s 45 --tiles committed committed \
                --json "$OUT/kernels_$fw.json"
        done
    fi
    # shellcheck disable=SC2086
    step pytest 150 $([ "${VERIFY_MOSAIC:-0}" = 1 ] && echo 100 || echo 0) "$OUT/pytest.log" "$PY" -m pytest -v -rfs \
        -m gpu $XDIST ${GPU_TESTS:-tests/test_parity_loop.py tests/test_merge_limits.py tests/test_triton_merge_n.py \
        tests/test_pallas_merge_n.py tests/test_op_merge_n.py}
    if [ "${VERIFY_MOSAIC:-0}" = 1 ]; then
        step check_mosaic 110 0 "$OUT/check_mosaic.log" bash tools/check_shards.sh "$OUT/check_mosaic.json" \
            --pallas-backend mosaic_gpu
    fi
fi
if [ "$PLAN" = fp8 ]; then
    # Per-group FP8 (docs/spec.md 4.7) and NVFP4 (4.8): their GPU tests (Triton = Pallas = jnp bit for bit, row vs
    # swizzled NVFP4 scales), the per-group and NVFP4 records of the full check on both Pallas backends (Triton,
    # Mosaic GPU; NVFP4 swizzled against row), its GPU-only T = 32K cases of every quantized output on both, then
    # the fused merges beside bf16 and merge + separate quantizer (NVFP4 at T = 32K only: the time left).
    step pytest 130 400 "$OUT/pytest.log" "$PY" -m pytest -v -rfs -m gpu tests/test_group_fp8.py tests/test_nvfp4.py \
        tests/test_pallas_mosaic.py::test_quantized_and_f32_outputs_at_long_t_give_the_triton_backends_bits \
        tests/test_triton_torch_path.py
    step check 100 350 "$OUT/check.log" "$PY" -m parity check --suite full -k group --json "$OUT/check_group.json"
    step check_mosaic 80 290 "$OUT/check_mosaic.log" "$PY" -m parity check --suite full -k group \
        --pallas-backend mosaic_gpu --json "$OUT/check_group_mosaic.json"
    for backend in triton mosaic_gpu; do
        step "check_nvfp4_$backend" 60 230 "$OUT/check_nvfp4_$backend.log" "$PY" -m parity check --suite full \
            -k nvfp4 --pallas-backend $backend --json "$OUT/check_nvfp4_$backend.json"
    done
    for backend in triton mosaic_gpu; do
        step "check_t32k_$backend" 90 200 "$OUT/check_t32k_$backend.log" "$PY" -m parity check --suite full \
            -k t32k --pallas-backend $backend --json "$OUT/check_t32k_$backend.json"
    done
    step group_fp8_speed 150 140 "$OUT/group_fp8_speed.log" "$PY" -m tools.group_fp8_speed \
        --json "$OUT/group_fp8_speed.json"
    step nvfp4_speed 70 70 "$OUT/nvfp4_speed.log" "$PY" -m tools.group_fp8_speed --format nvfp4 --tokens 32768 \
        --json "$OUT/nvfp4_speed.json"
    # Mosaic GPU's quantized merges (quantized in its kernels since 2026-12-07) at T = 32K, beside the rows above
    step mosaic_speed 70 0 "$OUT/mosaic_quant_speed.log" env PALLAS_IMPL_BACKEND=mosaic_gpu bash -c \
        "$PY -m tools.group_fp8_speed --tokens 32768 --frameworks pallas --json $OUT/group_fp8_mosaic.json && \
         $PY -m tools.group_fp8_speed --format nvfp4 --tokens 32768 --frameworks pallas --json $OUT/nvfp4_mosaic.json"
fi
if [ "$PLAN" = verify_tests ]; then
    # shellcheck disable=SC2086
    step pytest 360 190 "$OUT/pytest.log" "$PY" -m pytest -v -rfs --durations=25 -m gpu $XDIST
    step wide_n_compile 190 0 "$OUT/wide_n_compile.log" "$PY" -m tools.wide_n --part compile --ns 4,16,64,256 \
        --json "$OUT/wide_n_compile.json"
fi
if [ "$PLAN" = all ] || [ "$PLAN" = tests ]; then
    # shellcheck disable=SC2086
    step pytest 240 240 "$OUT/pytest.log" "$PY" -m pytest -q -rs -m gpu $XDIST
    # The full check compiles ~150 kernels per framework: CHECK_SHARDS processes split the cases (--shard K/N).
    step check 120 130 "$OUT/check.log" bash tools/check_shards.sh "$OUT/check_full.json"
    step check_mosaic 120 5 "$OUT/check_mosaic.log" bash tools/check_shards.sh "$OUT/check_mosaic.json" \
        --pallas-backend mosaic_gpu
fi
if [ "$PLAN" = all ] || [ "$PLAN" = bench ]; then
    step host_cost 90 400 "$OUT/host_cost.log" "$PY" -m tools.host_cost
    step mask_floor 150 260 "$OUT/mask_floor.log" "$PY" -m tools.mask_floor --budget-s 80 \
        --json "$OUT/mask_floor.json"
    step probe 110 150 "$OUT/probe.log" "$PY" -m parity probe --isolate --json "$OUT/probe.json"
    step pairs 40 110 "$OUT/pairs.log" "$PY" -m parity.examples.error_model_pairs --json "$OUT/pairs.json"
    # The bench stops starting new points 60 s before its timeout, so the JSON and table still get written.
    BENCH_T=$(( $(remaining) - 5 ))
    # shellcheck disable=SC2086  # BENCH_ARGS is a list of options
    step bench 600 5 "$OUT/bench.log" "$PY" -m parity bench --budget-s $(( BENCH_T > 90 ? BENCH_T - 60 : 30 )) \
        $BENCH_ARGS --json "$OUT/bench.json"
fi
if [ "$PLAN" = all ] || [ "$PLAN" = more ]; then
    step host_cost 30 520 "$OUT/host_cost.log" "$PY" -m tools.host_cost
    step wide_n_compile 110 410 "$OUT/wide_n_compile.log" "$PY" -m tools.wide_n --part compile --ns 4,16,64,256 \
        --json "$OUT/wide_n_compile.json"
    step wide_n_speed 80 330 "$OUT/wide_n_speed.log" "$PY" -m tools.wide_n --part speed \
        --json "$OUT/wide_n_speed.json"
    step loop_torch 90 240 "$OUT/loop_torch.log" "$PY" -m parity loop --framework torch --json "$OUT/loop_torch.json"
    step loop_jax 90 150 "$OUT/loop_jax.log" "$PY" -m parity loop --framework jax --json "$OUT/loop_jax.json"
    step probe 100 50 "$OUT/probe.log" "$PY" -m parity probe --json "$OUT/probe.json"
    # Whatever time is left: the GPU tests of GPU_TESTS (default: all), one line per test (-v: a timeout still
    # shows what ran).
    # shellcheck disable=SC2086
    step pytest 200 0 "$OUT/pytest.log" "$PY" -m pytest -v -rs -m gpu $XDIST $GPU_TESTS
fi

{ echo "== summary ($(( $(date +%s) - START ))s of ${DEADLINE_S}s)"; printf '%s' "$SUMMARY"; } | tee "$OUT/summary.txt"
( cd "$OUT" && files=$(ls | grep -v -e '^env.txt$' -e '^summary.txt$' -e '^run.tgz$') && [ -n "$files" ] \
    && tar czf run.tgz $files && rm -rf $files )
ls -la "$OUT"
exit "$FAILED"
