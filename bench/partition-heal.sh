#!/usr/bin/env bash
# A follower of a 3-node tenure cluster partitioned for CUT seconds, then healed, under a
# steady open-loop load, ROUNDS times: leader changes (should be 0) and the longest any
# request waited (goal: under 200 ms).
#
# Usage: bench/partition-heal.sh
# Environment:
#   ROUNDS=5           partitions (1..50), one loadgen run each, on one cluster
#   CUT=5              seconds the follower is cut off (1..60)
#   RATE=5000          acquires/s of the load (each held 1 s, renewed every 0.5 s, TTL 30 s)
#   TENURED=PATH       the tenured binary (default target/release/tenured), for A/B runs
#   TENURE_ARGS="..."  more flags for every tenured, unquoted
#   OUT=DIR            keep the JSON reports and the nodes' logs in DIR
# Peer links cross bench/peer-proxy.py (python3), which closes every link to and from the
# follower while it is cut off and refuses new ones. The load runs 2 s before the cut and
# 5 s after the heal, latency counted from each request's intended send time (open loop), so
# a request held up by the partition or by an election shows in max. Round 0 runs the same
# load without a cut: the machine's own longest wait, to read the others against. Exits 1 if
# a round saw a leader change. Binaries: target/release.
set -euo pipefail
case "${1:-}" in
    '') ;;
    -h|--help) sed -n '2,/^set -euo/{/^#/p}' "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (try --help)" >&2; exit 2 ;;
esac
ROUNDS=${ROUNDS:-5}
CUT=${CUT:-5}
RATE=${RATE:-5000}
case "$ROUNDS$CUT" in *[!0-9]*) echo "ROUNDS and CUT must be whole numbers" >&2; exit 2 ;; esac
(( ROUNDS >= 1 && ROUNDS <= 50 && CUT >= 1 && CUT <= 60 )) || { echo "ROUNDS 1..50, CUT 1..60" >&2; exit 2; }
command -v python3 >/dev/null || { echo "python3 is needed for the proxy" >&2; exit 1; }
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(mktemp -d)
PROXY=1
# shellcheck source=bench/cluster-lib.sh
source "$ROOT/bench/cluster-lib.sh"
LOAD_PID=""
cleanup() {
    [[ -n $LOAD_PID ]] && cluster_stop_pid "$LOAD_PID"
    cluster_stop
    if [[ -n ${OUT:-} ]]; then mkdir -p "$OUT" && cp "$WORK"/*.json "$WORK"/*.log "$OUT"/ 2>/dev/null || true; fi
    rm -rf "$WORK"
}
trap cleanup EXIT INT TERM

echo "tenured $("$TENURED" --version | head -1); follower cut ${CUT} s, ${RATE} acquires/s;" \
    "flags: ${TENURE_ARGS:-none}; $(nproc) cores"
cluster_start
BAD=0
for round in $(seq 0 "$ROUNDS"); do
    leader=$(cluster_leader)
    follower=$(((leader + 1 + round % 2) % 3))
    before=$(cluster_term)
    load0=$(cut -d' ' -f1-3 /proc/loadavg)
    # 1 s ramp (the hold) + 1 s warm-up, then the window: 2 s, the cut, 5 s.
    j=$WORK/round-$round.json
    "$LOADGEN" --target "$(cluster_target)" --scenario estimate --rate "$RATE" --hold 1s \
        --renew-every 500ms --ttl 30s --warmup 1s --duration "$((CUT + 7))s" \
        --connections 8 --pipeline 256 --json --quiet >"$j" &
    LOAD_PID=$!
    sleep 4
    if ((round > 0)); then cluster_cut "$follower"; fi
    sleep "$CUT"
    cluster_heal
    ok=1
    wait "$LOAD_PID" || ok=0
    LOAD_PID=""
    sleep 1
    after=$(cluster_term)
    view=$(cluster_view)
    max=0
    for kind in acquire renew release; do
        m=$(field "$j" "$kind" max_us 2>/dev/null || true)
        max=$(awk -v a="$max" -v b="${m:-0}" 'BEGIN { print (b > a ? b : a) }')
    done
    changes=$((after - before))
    printf "round %d: follower n%d cut %d s; leader changes %d (term %s -> %s); longest request %.1f ms (acquire p99 %s us); errors %s; load %s / %s%s\n" \
        "$round" "$((follower + 1))" "$((round > 0 ? CUT : 0))" "$changes" "$before" "$after" "$(awk -v m="$max" 'BEGIN { print m / 1000 }')" \
        "$(field "$j" acquire p99_us 2>/dev/null)" "$(grep -o '"errors":{[^}]*}' "$j" | cut -c10-)" \
        "$load0" "$(cut -d' ' -f1-3 /proc/loadavg)" "$([[ $ok == 1 ]] || echo ' LOADGEN FAILED')"
    echo "    $view"
    if [[ $ok != 1 || $changes != 0 ]]; then BAD=$((BAD + 1)); fi
    sleep 1
done
echo "$((ROUNDS - BAD)) of $ROUNDS rounds with zero leader changes"
(( BAD == 0 ))
