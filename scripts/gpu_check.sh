#!/usr/bin/env bash
# One GPU run: versions, the GPU tests, the full parity check, the demos, the benchmark and the sweeps.
#
#   OUT=/some/dir [PLAN=all|tests|bench|more|mosaic|mosaic_speed|tune_n|limits|split|fused_first|warps|stages|loops|buffer|early|verify|verify_tests] bash scripts/gpu_check.sh
#
# PLAN picks the steps; each plan but "all" fits one 10-minute call (DEADLINE_S, default 560 s; "all": 1500 s):
#   tests         the GPU-marked tests (`pytest -m gpu`; the CPU tests are CI's) and the full parity check on
#                 both Pallas backends (Triton, Mosaic GPU): pytest.log check.log check_full.json check_mosaic.*
#   bench         `python -m parity bench` (BENCH_ARGS, default "--quick": GPU time, eager and host cost per call
#                 beside their floors, the layout axis), the host cost of every Triton entry point
#                 (scripts/host_cost.py), the mask's candidates beside `fill_` and upstream's design
#                 (scripts/mask_floor.py), the attention-kernel probe (`python -m parity probe`) and the
#                 cross_check error-model pairs (docs/examples/error_model_pairs.py): bench.* host_cost.log
#                 mask_floor.* probe.* pairs.*
#   more          the host cost again, the N-way merge at large N (scripts/wide_n.py: first-call compile time,
#                 bandwidth at N = 128, 256), the chunked-context loop as one captured step (`python -m parity
#                 loop`, torch and JAX), the probe in one process, then GPU tests (GPU_TESTS, default all) in
#                 the time left: host_cost.log wide_n_* loop_* probe.* pytest.log
#   mosaic        the Mosaic GPU backend of pallas_impl: its tests, the full check on it, compute-sanitizer
#   mosaic_speed  the Mosaic GPU kernels timed beside the Triton backend's, with a sweep of their launch choices
#   tune_n        the N-way merge's launch sweeps (scripts/tune.py): N = 128 and 256 at T = 8192 (tiles,
#                 N_LOOPS, N_OUTPUTS_EVICT), then the full parity check (Pallas on its Triton backend):
#                 tune_*.json tune_*.log check*
#   fused_first   the fused N-way merge's first kernel in [H, T] layout: heads per program (scripts/tune.py
#                 +fhH --kernels), both frameworks: fused_*.json
#   warps         the N-way merge's tiles with 2 warps at large N and in the all-gather view: warps_*.json
#                 gather_*.json
#   stages        the N-way weighted sum's loads in flight at large N (tiles.N_OUT_STAGES; scripts/tune.py +osS),
#                 both frameworks, both LSE layouts, then the bits of the loops' tests, compiled st_*.json pytest.log
#   loops         the fused N-way merge's loops beyond 16 partials (its first kernel's maximum chunk and sum
#                 steps, tiles.N_LOOPS) with and without the weights stored, each kernel's time (--kernels), both
#                 frameworks, both LSE layouts: lp_*.json
#   buffer        the fused N-way merge with [H, T] LSEs given its weights in a [T, H] buffer (both frameworks,
#                 N = 128 / 256), then the split merge's bits tests: bp_*.json pytest.log
#   early         the N-way merge's first output tiles loaded before its LSE passes (tiles.N_EARLY_OUTPUTS,
#                 +eoK) in the all-gather view and contiguous at N = 8 / 16 (Pallas: contiguous); Pallas's fused
#                 first kernel's program in [H, T] layout (+psP, +fhH, +mwW) at N = 128 / 256; then the early
#                 tiles' bits tests: eo_*.json fk_*.json pytest.log (EARLY_TILES, FK_TILES, EARLY_NS "N:T ..."
#                 override the sweeps)
#   verify        after a kernel or launch change: the full parity check (Pallas on its Triton backend; with
#                 VERIFY_MOSAIC=1 on Mosaic GPU too), the N-way merge at large N (scripts/wide_n.py speed; with
#                 VERIFY_KERNELS=1 each kernel of the split fused merge), the GPU tests of the N-way merge and the
#                 loop (GPU_TESTS): check*.json check*.log wide_n_speed.* kernels_* pytest.log
#   limits        what limits the N-way merge at large N (scripts/n_stream.py: the merge beside a stream of its
#                 bytes and beside simplified three-pass merges, overlapped or split in two kernels), then the
#                 all-gather view at N = 8 and 16 with larger tiles: n_stream.* gather_*.json
#   split         the N-way merge in two kernels beyond 16 partials (scripts/tune.py --kernels: each kernel's
#                 time): the first kernel's positions per program, the fused merge's stored weights and tile, both
#                 frameworks; the full check; the N-way GPU tests: tune_*.json check* pytest.log
#   verify_tests  the GPU tests (`pytest -m gpu -v -rf`: a timeout still names what ran and failed), then the
#                 first-call compile times (wide_n.py compile): pytest.log wide_n_compile.*
#   all           tests, bench, then more
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
# The full check in 8 processes (`scripts/check_shards.sh`): 72-83 s per Pallas backend on the H200 (session 6).
export CHECK_SHARDS=${CHECK_SHARDS:-8}
XDIST=$("$PY" -c "import xdist" 2>/dev/null && echo "-n 4")
GPU_TESTS=${GPU_TESTS:-}  # PLAN=more, verify: test files for their GPU tests step (default: every GPU test; verify: its own)

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
if [ "$PLAN" = tune_n ]; then
    # Tiles "bytes,fewest_tokens,warps/lo,hi/chunk,exp_step,out_step[+hint]" or "committed[+hint]" (scripts/tune.py
    # --tiles; +normal: the default L2 policy for the output loads, +ef: evict_first). N = 128 and 256 at T = 8192:
    # more tokens per partial's tile (with more warps), larger chunks of the maximum, shorter weighted-sum steps;
    # then the fused variant and [T, H] LSEs with and without evict_first; then the full check.
    TUNE=("$PY" scripts/tune.py merge_n --heads 64 --dims 128 --tokens 8192)
    step tune_128 150 390 "$OUT/tune_128.log" "${TUNE[@]}" --variants plain lse --partials 128 --budget-s 130 \
        --tiles committed committed+normal 16384,8,4/2048,4096/32,16,8 16384,8,4/2048,4096/32,16,6 \
        16384,16,8/4096,4096/16,16,8 16384,16,8/4096,4096/32,16,6 16384,32,16/8192,8192/32,16,8 \
        16384,8,4/2048,4096/32,16,4 --json "$OUT/tune_128.json"
    step tune_256 100 280 "$OUT/tune_256.log" "${TUNE[@]}" --variants plain lse --partials 256 --budget-s 80 \
        --tiles committed committed+normal 16384,8,4/2048,4096/32,16,6 16384,16,8/4096,4096/32,16,6 \
        16384,32,16/8192,8192/32,16,8 --json "$OUT/tune_256.json"
    step tune_fused 60 210 "$OUT/tune_fused.log" "${TUNE[@]}" --variants fused --partials 128 256 --budget-s 50 \
        --tiles committed committed+normal --json "$OUT/tune_fused.json"
    step tune_th 40 165 "$OUT/tune_th.log" "${TUNE[@]}" --variants plain lse --partials 128 --lse-layout TH \
        --budget-s 30 --tiles committed committed+normal --json "$OUT/tune_th.json"
    step check 100 5 "$OUT/check.log" bash scripts/check_shards.sh "$OUT/check_full.json"
fi
if [ "$PLAN" = limits ]; then
    # What limits the N-way merge at large N (scripts/n_stream.py): the merge beside a stream of the same bytes and
    # beside simplified three-pass merges (the passes overlapped, or split into a maximum-and-sum kernel and a
    # weighted-sum kernel); then the all-gather view at N = 8 and 16: the committed tiles (first and last: the
    # spread) beside larger ones, plain and output LSE, both LSE layouts.
    TUNE=("$PY" scripts/tune.py merge_n --heads 64 --dims 128)
    step n_stream 230 190 "$OUT/n_stream.log" "$PY" scripts/n_stream.py --points 128:1024,128:8192,256:8192 \
        --configs "8x1 w4 s8,8x1 w4 s8 ef" --json "$OUT/n_stream.json"
    GATHER_TILES=(committed 32768,8,4/2048,4096 65536,8,4/2048,8192 65536,8,8/2048,8192 32768,16,8/2048,8192
                  committed)
    for nt in 8:32768 16:8192; do
        step "gather_${nt%%:*}" 100 $(( ${nt%%:*} == 8 ? 90 : 0 )) "$OUT/gather_${nt%%:*}.log" "${TUNE[@]}" \
            --frameworks triton --partials "${nt%%:*}" --tokens "${nt##*:}" --variants plain lse \
            --lse-layout HT TH --partials-view gather --budget-s 80 --tiles "${GATHER_TILES[@]}" \
            --json "$OUT/gather_${nt%%:*}.json"
    done
fi
if [ "$PLAN" = split ]; then
    # The N-way merge in two kernels beyond UNROLLED_PARTIALS (docs/design.md, "Two kernels beyond 16 partials"),
    # N = 128 / 256, T = 8192, with each kernel's device time (--kernels: one framework per process): Pallas's
    # merges with 512 LSE positions per first-kernel program (+ps512) and its fused merge with the weights stored
    # (+w: then the "weighted" tile, `tiles.tile_variant`), in both LSE layouts; Triton's plain and fused merges with
    # +ps512; then the full check (Pallas on its Triton backend) and the N-way GPU tests.
    TUNE=("$PY" scripts/tune.py merge_n --heads 64 --dims 128 --tokens 8192 --partials 128 256 --kernels)
    step tune_pallas 130 390 "$OUT/tune_pallas.log" "${TUNE[@]}" --frameworks pallas --variants plain lse fused \
        --budget-s 110 --tiles committed committed+ps512 committed+w 16384,8,4+w --json "$OUT/tune_pallas.json"
    step tune_pallas_th 70 320 "$OUT/tune_pallas_th.log" "${TUNE[@]}" --frameworks pallas --variants lse fused \
        --lse-layout TH --budget-s 55 --tiles committed committed+ps512 committed+w --json "$OUT/tune_pallas_th.json"
    step tune_triton 80 240 "$OUT/tune_triton.log" "${TUNE[@]}" --frameworks triton --variants plain fused \
        --lse-layout HT TH --budget-s 65 --tiles committed committed+ps512 --json "$OUT/tune_triton.json"
    step check 110 110 "$OUT/check.log" bash scripts/check_shards.sh "$OUT/check_full.json"
    # shellcheck disable=SC2086
    step pytest 100 0 "$OUT/pytest.log" "$PY" -m pytest -q -rfs -m gpu $XDIST tests/test_merge_limits.py \
        tests/test_triton_merge_n.py tests/test_pallas_merge_n.py tests/test_op_merge_n.py tests/test_kernels_agree.py
fi
if [ "$PLAN" = fused_first ]; then
    # The fused N-way merge's first kernel in [H, T] layout (the slowest of the split merge's kernels there: its
    # per-token offset reads): MAX_SUM_FUSED_HEADS heads x 256 / H tokens per program (+fhH), each kernel's time,
    # one framework per process; N = 128 / 256, T = 8192.
    TUNE=("$PY" scripts/tune.py merge_n --heads 64 --dims 128 --tokens 8192 --partials 128 256 --kernels
          --variants fused --tiles committed committed+fh16 committed+fh32 committed+fh64)
    step fused_triton 100 110 "$OUT/fused_triton.log" "${TUNE[@]}" --frameworks triton --budget-s 80 \
        --json "$OUT/fused_triton.json"
    step fused_pallas 100 0 "$OUT/fused_pallas.log" "${TUNE[@]}" --frameworks pallas --budget-s 80 \
        --json "$OUT/fused_pallas.json"
fi
if [ "$PLAN" = warps ]; then
    # The N-way merge's tiles with 2 warps (16 B -> 32 B per thread and partial): N = 128 / 256 at T = 8192 (the
    # committed tiles first and last: the spread), both frameworks, both LSE layouts; then the all-gather view at
    # N = 8 / 16 (Triton, output LSE).
    TUNE=("$PY" scripts/tune.py merge_n --heads 64 --dims 128)
    step warps_ht 110 250 "$OUT/warps_ht.log" "${TUNE[@]}" --frameworks triton --tokens 8192 --partials 128 256 \
        --variants plain lse fused --budget-s 90 --tiles committed 16384,8,2 committed --json "$OUT/warps_ht.json"
    step warps_th 80 170 "$OUT/warps_th.log" "${TUNE[@]}" --frameworks triton --tokens 8192 --partials 128 256 \
        --variants lse fused --lse-layout TH --budget-s 60 --tiles committed 16384,1,2 committed \
        --json "$OUT/warps_th.json"
    step warps_pallas 90 80 "$OUT/warps_pallas.log" "${TUNE[@]}" --frameworks pallas --tokens 8192 \
        --partials 128 256 --variants plain lse --budget-s 70 --tiles committed 16384,8,2 committed \
        --json "$OUT/warps_pallas.json"
    for nt in 8:32768 16:8192; do
        step "gather_${nt%%:*}" 40 $(( ${nt%%:*} == 8 ? 40 : 0 )) "$OUT/gather_${nt%%:*}.log" "${TUNE[@]}" \
            --frameworks triton --partials "${nt%%:*}" --tokens "${nt##*:}" --variants lse --partials-view gather \
            --budget-s 30 --tiles committed 16384,8,2 committed --json "$OUT/gather_${nt%%:*}.json"
    done
fi
if [ "$PLAN" = stages ]; then
    # The weighted sum's loads in flight beyond UNROLLED_PARTIALS (tiles.N_OUT_STAGES, +osS) with the tables' other
    # choices, N = 128 / 256 at T = 8192, the committed tables first and last (the spread), one framework per
    # process: Pallas's fused merge with the weights stored (+w) and its tiles carried ahead (+os2), its plain and
    # output-LSE merges' weighted-sum steps (4, 8) with them; Triton's fused merge with 4 warps and 3 stages. Then
    # the bits of the loops' tests, compiled.
    TUNE=("$PY" scripts/tune.py merge_n --heads 64 --dims 128 --tokens 8192 --partials 128 256)
    step st_pallas_fused 100 380 "$OUT/st_pallas_fused.log" "${TUNE[@]}" --frameworks pallas --variants fused \
        --budget-s 80 --tiles committed committed+os2 committed+w committed+w+os2 16384,8,4+w+os2 committed \
        --json "$OUT/st_pallas_fused.json"
    step st_pallas_fused_th 80 300 "$OUT/st_pallas_fused_th.log" "${TUNE[@]}" --frameworks pallas --variants fused \
        --lse-layout TH --budget-s 65 --tiles committed committed+os2 committed+w+os2 16384,1,4+w+os2 committed \
        --json "$OUT/st_pallas_fused_th.json"
    step st_pallas 80 220 "$OUT/st_pallas.log" "${TUNE[@]}" --frameworks pallas --variants plain lse \
        --budget-s 65 --tiles committed committed/committed/16,16,4 committed/committed/16,16,8 committed+os1 \
        committed --json "$OUT/st_pallas.json"
    step st_triton_fused 80 140 "$OUT/st_triton_fused.log" "${TUNE[@]}" --frameworks triton --variants fused \
        --budget-s 65 --tiles committed committed+os3 16384,8,4 16384,8,4+os3 committed \
        --json "$OUT/st_triton_fused.json"
    step st_triton_fused_th 60 80 "$OUT/st_triton_fused_th.log" "${TUNE[@]}" --frameworks triton --variants fused \
        --lse-layout TH --budget-s 45 --tiles committed 16384,1,4 16384,1,4+os3 committed \
        --json "$OUT/st_triton_fused_th.json"
    # Not -m gpu: the Triton cases of this test (unmarked: the interpreter on a CPU) run compiled here.
    step pytest 80 0 "$OUT/pytest.log" "$PY" -m pytest -q -rfs tests/test_merge_limits.py -k pipelined
fi
if [ "$PLAN" = loops ]; then
    # The fused merge's first kernel runs its passes over the partials one partial (maximum) or exp_step (sum,
    # weights) at a time (tiles.N_LOOPS "fused"): its loads wait on each step. Chunks and steps of 8-32 with the
    # weights stored (+w) and without, one framework per process, the committed tables first and last, each
    # kernel's time; N = 128 / 256 at T = 8192.
    TUNE=("$PY" scripts/tune.py merge_n --heads 64 --dims 128 --tokens 8192 --partials 128 256 --kernels
          --variants fused)
    step lp_pallas 170 250 "$OUT/lp_pallas.log" "${TUNE[@]}" --frameworks pallas --budget-s 150 --tiles committed \
        16384,8,4+w+os2 16384,8,4/committed/16,16,4+w+os2 16384,8,4/committed/16,8,4+w+os2 \
        16384,8,4/committed/32,16,4+w+os2 16384,8,4/committed/16,16,4+w+os2+fh8 committed/committed/16,16,4+os2 \
        committed/committed/16,16,4 committed --json "$OUT/lp_pallas.json"
    step lp_pallas_th 100 150 "$OUT/lp_pallas_th.log" "${TUNE[@]}" --frameworks pallas --lse-layout TH \
        --budget-s 80 --tiles committed 16384,1,4+w+os2 16384,1,4/committed/16,16,4+w+os2 \
        16384,1,4/committed/16,8,4+w+os2 committed/committed/16,16,4 committed --json "$OUT/lp_pallas_th.json"
    step lp_triton 130 0 "$OUT/lp_triton.log" "${TUNE[@]}" --frameworks triton --lse-layout HT TH --budget-s 110 \
        --tiles committed committed/committed/16,16,4 committed/committed/16,8,4 committed/committed/32,16,4 \
        committed --json "$OUT/lp_triton.json"
fi
if [ "$PLAN" = buffer ]; then
    # The fused N-way merge with [H, T] LSEs given the weights in a [T, H] buffer (+w+wth; Pallas, then Triton's
    # stored weights moved there, +wth), N = 128 / 256 at T = 8192, each kernel's time, the committed tables first
    # and last (the spread); then the split merge's bits tests.
    TUNE=("$PY" scripts/tune.py merge_n --heads 64 --dims 128)
    step bp_pallas 150 350 "$OUT/bp_pallas.log" "${TUNE[@]}" --frameworks pallas --tokens 8192 --partials 128 256 \
        --variants fused --kernels --budget-s 130 --tiles committed committed+w+wth committed+w+wth+fh8 \
        committed+w+wth committed --json "$OUT/bp_pallas.json"
    step bp_triton 80 270 "$OUT/bp_triton.log" "${TUNE[@]}" --frameworks triton --tokens 8192 --partials 128 256 \
        --variants fused --kernels --budget-s 60 --tiles committed committed+wth committed --json "$OUT/bp_triton.json"
    step pytest 120 0 "$OUT/pytest.log" "$PY" -m pytest -q -rfs tests/test_merge_limits.py -k two_kernels
fi
if [ "$PLAN" = early ]; then
    # The committed tables first and last in each step (the spread of one process).
    TUNE=("$PY" scripts/tune.py merge_n --heads 64 --dims 128)
    # shellcheck disable=SC2206
    EARLY_TILES=(${EARLY_TILES:-committed committed+eo16 committed+eo1 committed+eo3 committed})
    # shellcheck disable=SC2206
    FK_TILES=(${FK_TILES:-committed committed+ps512 committed+ps512+fh32 committed+ps1024+fh32 committed+ps1024+fh64 \
        committed+ps1024+fh32+mw8 committed})
    for nt in ${EARLY_NS:-8:32768 16:8192}; do
        step "eo_gather_${nt%%:*}" 100 $(( ${nt%%:*} == 8 ? 350 : 250 )) "$OUT/eo_gather_${nt%%:*}.log" "${TUNE[@]}" \
            --frameworks triton --partials "${nt%%:*}" --tokens "${nt##*:}" --variants lse \
            --lse-layout HT TH --partials-view gather contig --budget-s 85 --tiles "${EARLY_TILES[@]}" \
            --json "$OUT/eo_gather_${nt%%:*}.json"
    done
    step eo_pallas 60 250 "$OUT/eo_pallas.log" "${TUNE[@]}" --frameworks pallas --partials 8 16 --tokens 8192 \
        --variants plain lse --lse-layout HT TH --budget-s 50 --tiles committed committed+eo16 committed \
        --json "$OUT/eo_pallas.json"
    step fk_pallas 190 60 "$OUT/fk_pallas.log" "${TUNE[@]}" --frameworks pallas --tokens 8192 --partials 128 256 \
        --variants fused --kernels --budget-s 170 --tiles "${FK_TILES[@]}" --json "$OUT/fk_pallas.json"
    step pytest 60 0 "$OUT/pytest.log" "$PY" -m pytest -q -rfs tests/test_merge_limits.py -k early
fi
if [ "$PLAN" = verify ]; then
    # GPU_TESTS (default: the N-way merge's and the loop's files) run after the N-way merge's speed; the Mosaic GPU
    # check, last, when its kernels changed (VERIFY_MOSAIC=1).
    # The check's reserve scales with DEADLINE_S (330 s of the default 560), so a shorter call still runs it.
    step check 110 $(( DEADLINE_S * 330 / 560 )) "$OUT/check.log" bash scripts/check_shards.sh "$OUT/check_full.json"
    step wide_n_speed 190 $(( ${VERIFY_KERNELS:-0} == 1 ? 260 : 180 )) "$OUT/wide_n_speed.log" "$PY" \
        scripts/wide_n.py --part speed --json "$OUT/wide_n_speed.json"
    if [ "${VERIFY_KERNELS:-0}" = 1 ]; then
        # Each kernel of the split fused merge (--kernels), N = 128 / 256, T = 8192, both LSE layouts, the committed
        # tables twice (the spread), one framework per process.
        for fw in triton pallas; do
            step "kernels_$fw" 60 $([ $fw = triton ] && echo 200 || echo 140) "$OUT/kernels_$fw.log" "$PY" \
                scripts/tune.py merge_n --heads 64 --dims 128 --tokens 8192 --partials 128 256 --variants fused \
                --lse-layout HT TH --kernels --frameworks $fw --budget-s 45 --tiles committed committed \
                --json "$OUT/kernels_$fw.json"
        done
    fi
    # shellcheck disable=SC2086
    step pytest 150 $([ "${VERIFY_MOSAIC:-0}" = 1 ] && echo 100 || echo 0) "$OUT/pytest.log" "$PY" -m pytest -v -rfs \
        -m gpu $XDIST ${GPU_TESTS:-tests/test_parity_loop.py tests/test_merge_limits.py tests/test_triton_merge_n.py \
        tests/test_pallas_merge_n.py tests/test_op_merge_n.py}
    if [ "${VERIFY_MOSAIC:-0}" = 1 ]; then
        step check_mosaic 110 0 "$OUT/check_mosaic.log" bash scripts/check_shards.sh "$OUT/check_mosaic.json" \
            --pallas-backend mosaic_gpu
    fi
fi
if [ "$PLAN" = verify_tests ]; then
    # shellcheck disable=SC2086
    step pytest 360 190 "$OUT/pytest.log" "$PY" -m pytest -v -rfs --durations=25 -m gpu $XDIST
    step wide_n_compile 190 0 "$OUT/wide_n_compile.log" "$PY" scripts/wide_n.py --part compile --ns 4,16,64,256 \
        --json "$OUT/wide_n_compile.json"
fi
if [ "$PLAN" = all ] || [ "$PLAN" = tests ]; then
    # shellcheck disable=SC2086
    step pytest 240 240 "$OUT/pytest.log" "$PY" -m pytest -q -rs -m gpu $XDIST
    # The full check compiles ~150 kernels per framework: CHECK_SHARDS processes split the cases (--shard K/N).
    step check 120 130 "$OUT/check.log" bash scripts/check_shards.sh "$OUT/check_full.json"
    step check_mosaic 120 5 "$OUT/check_mosaic.log" bash scripts/check_shards.sh "$OUT/check_mosaic.json" \
        --pallas-backend mosaic_gpu
fi
if [ "$PLAN" = all ] || [ "$PLAN" = bench ]; then
    step host_cost 90 400 "$OUT/host_cost.log" "$PY" scripts/host_cost.py
    step mask_floor 150 260 "$OUT/mask_floor.log" "$PY" scripts/mask_floor.py --budget-s 80 \
        --json "$OUT/mask_floor.json"
    step probe 110 150 "$OUT/probe.log" "$PY" -m parity probe --isolate --json "$OUT/probe.json"
    step pairs 40 110 "$OUT/pairs.log" "$PY" docs/examples/error_model_pairs.py --json "$OUT/pairs.json"
    # The bench stops starting new points 60 s before its timeout, so the JSON and table still get written.
    BENCH_T=$(( $(remaining) - 5 ))
    # shellcheck disable=SC2086  # BENCH_ARGS is a list of options
    step bench 600 5 "$OUT/bench.log" "$PY" -m parity bench --budget-s $(( BENCH_T > 90 ? BENCH_T - 60 : 30 )) \
        $BENCH_ARGS --json "$OUT/bench.json"
fi
if [ "$PLAN" = all ] || [ "$PLAN" = more ]; then
    step host_cost 30 520 "$OUT/host_cost.log" "$PY" scripts/host_cost.py
    step wide_n_compile 110 410 "$OUT/wide_n_compile.log" "$PY" scripts/wide_n.py --part compile --ns 4,16,64,256 \
        --json "$OUT/wide_n_compile.json"
    step wide_n_speed 80 330 "$OUT/wide_n_speed.log" "$PY" scripts/wide_n.py --part speed \
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
