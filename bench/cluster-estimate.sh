#!/usr/bin/env bash
# The sizing estimate against a 3-node tenure cluster on loopback, RUNS times, each on a fresh
# cluster at default timings: does the leader hold through the load (zero leader changes)?
#
# Usage: bench/cluster-estimate.sh
# Environment:
#   RUNS=5             fresh clusters, one estimate each (1..20)
#   DURATION=60s       measured window (after the ramp of HOLD and a 5 s warm-up)
#   RATE=50000 HOLD=10s  acquires/s and hold (renewed every HOLD, TTL 30 s): 500K held, 150K ops/s
#   TENURED=PATH       the tenured binary (default target/release/tenured), for A/B runs
#   TENURE_ARGS="..."  more flags for every tenured (e.g. --election-timeout-ms 300), unquoted
#   OUT=DIR            keep each run's JSON report and the nodes' logs in DIR
# Prints one line per run: ops/s, acquire p99/max, leader changes (the highest term before and
# after: a leader change needs a new term), and the load average. Exits 1 if any run saw a
# leader change or failed. Binaries: target/release (build them first). About 90 s per run.
set -euo pipefail
case "${1:-}" in
    '') ;;
    -h|--help) sed -n '2,/^set -euo/{/^#/p}' "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (try --help)" >&2; exit 2 ;;
esac
RUNS=${RUNS:-5}
DURATION=${DURATION:-60s}
RATE=${RATE:-50000}
HOLD=${HOLD:-10s}
case "$RUNS" in ''|*[!0-9]*) echo "RUNS must be a number" >&2; exit 2 ;; esac
(( RUNS >= 1 && RUNS <= 20 )) || { echo "RUNS=$RUNS is outside 1..20" >&2; exit 2; }
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(mktemp -d)
# shellcheck source=bench/cluster-lib.sh
source "$ROOT/bench/cluster-lib.sh"
cleanup() {
    cluster_stop
    if [[ -n ${OUT:-} ]]; then mkdir -p "$OUT" && cp "$WORK"/*.json "$WORK"/*.log "$OUT"/ 2>/dev/null || true; fi
    rm -rf "$WORK"
}
trap cleanup EXIT INT TERM
ulimit -n 65536 2>/dev/null || true

echo "tenured $("$TENURED" --version | head -1); ${RATE}/s, hold $HOLD, ${DURATION} measured;" \
    "flags: ${TENURE_ARGS:-none}; $(nproc) cores"
BAD=0
for run in $(seq "$RUNS"); do
    cluster_start
    leader=$(cluster_leader)
    before=$(cluster_term)
    load0=$(cut -d' ' -f1-3 /proc/loadavg)
    ok=1
    "$LOADGEN" --target "$(cluster_target)" --scenario estimate --rate "$RATE" --hold "$HOLD" \
        --renew-every "$HOLD" --ttl 30s --duration "$DURATION" --warmup 5s \
        --connections 16 --pipeline 256 --server-pid "${C_PID[leader]}" --json --quiet \
        >"$WORK/estimate-$run.json" || ok=0
    after=$(cluster_term)
    view=$(cluster_view)
    load1=$(cut -d' ' -f1-3 /proc/loadavg)
    j=$WORK/estimate-$run.json
    ops=0
    for kind in acquire renew release; do
        r=$(field "$j" "$kind" rate_per_s 2>/dev/null || true)
        ops=$(awk -v a="$ops" -v b="${r:-0}" 'BEGIN { printf "%.0f", a + b }')
    done
    errors=$(grep -o '"errors":{[^}]*}' "$j" 2>/dev/null | cut -c10- || echo "?")
    changes=$((after - before))
    printf "run %d: %s ops/s, acquire p99 %s us max %s us, errors %s, leader changes %d (term %s -> %s), leader cpu %s%%, load %s / %s%s\n" \
        "$run" "$ops" "$(field "$j" acquire p99_us 2>/dev/null)" "$(field "$j" acquire max_us 2>/dev/null)" \
        "${errors:-?}" "$changes" "$before" "$after" \
        "$(field "$j" resources server_cpu_pct_of_core 2>/dev/null)" "$load0" "$load1" \
        "$([[ $ok == 1 ]] || echo ' FAILED')"
    echo "    $view"
    cluster_append_tails "$leader"
    if [[ $ok != 1 || $changes != 0 ]]; then BAD=$((BAD + 1)); fi
    cluster_stop
    for i in 0 1 2; do cp "$WORK/node$i.log" "$WORK/run$run-node$i.log" 2>/dev/null || true; : >"$WORK/node$i.log"; done
done
echo "$((RUNS - BAD)) of $RUNS runs held with zero leader changes"
(( BAD == 0 ))
