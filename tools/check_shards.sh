#!/usr/bin/env bash
# The full parity check in CHECK_SHARDS (default 3) parallel processes, one `--shard K/N` each:
#
#   python -m tools check-shards OUT.json [more `python -m parity check` options]
#
# The shards' tables and summary lines are printed in shard order; OUT.json holds {"shards": [report, ...]}.
# Exit status: 0 when every shard exited 0, else the first non-zero one.
set -u
out=$1
shift
n=${CHECK_SHARDS:-3}
PY=${PYTHON:-python3}
pids=()
for k in $(seq 0 $((n - 1))); do
    "$PY" -m parity check --suite full --shard "$k/$n" --quiet --json "$out.$k" "$@" > "$out.$k.log" 2>&1 &
    pids+=($!)
done
rc=0
for k in $(seq 0 $((n - 1))); do
    wait "${pids[$k]}"
    r=$?
    echo "== shard $k/$n: exit $r"
    cat "$out.$k.log"
    rm -f "$out.$k.log"
    [ "$rc" -eq 0 ] && rc=$r
done
"$PY" - "$out" "$n" <<'PY'
import json, os, sys
out, n = sys.argv[1], int(sys.argv[2])
shards = []
for k in range(n):
    part = f"{out}.{k}"
    if os.path.exists(part):
        with open(part) as f:
            shards.append(json.load(f))
        os.remove(part)
with open(out, "w") as f:
    json.dump({"shards": shards}, f, indent=1)
print(f"== {sum(s['summary']['records'] for s in shards)} records in {len(shards)} of {n} shards, "
      f"{sum(s['summary']['failed'] for s in shards)} failed, "
      f"{sum(s['summary'].get('unsupported', 0) for s in shards)} unsupported by the chosen Pallas backend")
PY
exit "$rc"
