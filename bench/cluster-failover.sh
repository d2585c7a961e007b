#!/usr/bin/env bash
# Fail-over of a 3-node tenure cluster on loopback at default timings: kill -9 of the leader,
# then the time until a lock is granted by one of the other two, KILLS times.
#
# Usage: bench/cluster-failover.sh
# Environment:
#   KILLS=20           leader kills (1..200); the killed node is restarted on its data and
#                      the cluster waited on until healthy before the next kill
#   SETTLE=1           seconds after the cluster is healthy before each kill (a restarted node
#                      answers before it has caught up: see bench/cluster-vs-etcd.sh)
#   TENURED=PATH       the tenured binary (default target/release/tenured), for A/B runs
#   TENURE_ARGS="..."  more flags for every tenured, unquoted
#   OUT=DIR            keep the fail-over lines and the nodes' logs in DIR
# `tenure-loadgen --scenario failover` kills the leader and tries the others (attempts of
# 250 ms on fresh connections) until one grants. Prints each kill, then p50 and max and the
# load average. Exits 1 if a kill saw no grant in 30 s. Binaries: target/release.
set -euo pipefail
case "${1:-}" in
    '') ;;
    -h|--help) sed -n '2,/^set -euo/{/^#/p}' "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (try --help)" >&2; exit 2 ;;
esac
KILLS=${KILLS:-20}
SETTLE=${SETTLE:-1}
case "$KILLS$SETTLE" in *[!0-9]*) echo "KILLS and SETTLE must be whole numbers" >&2; exit 2 ;; esac
(( KILLS >= 1 && KILLS <= 200 && SETTLE <= 60 )) || { echo "KILLS 1..200, SETTLE <= 60" >&2; exit 2; }
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(mktemp -d)
# shellcheck source=bench/cluster-lib.sh
source "$ROOT/bench/cluster-lib.sh"
cleanup() {
    cluster_stop
    if [[ -n ${OUT:-} ]]; then mkdir -p "$OUT" && cp "$WORK"/*.lines "$WORK"/*.log "$OUT"/ 2>/dev/null || true; fi
    rm -rf "$WORK"
}
trap cleanup EXIT INT TERM

echo "tenured $("$TENURED" --version | head -1); flags: ${TENURE_ARGS:-none}; $(nproc) cores"
LOAD_START=$(cut -d' ' -f1-3 /proc/loadavg)
cluster_start
for k in $(seq "$KILLS"); do
    cluster_healthy >/dev/null
    sleep "$SETTLE"
    pids=$(IFS=,; echo "${C_PID[*]}")
    line=$("$LOADGEN" --target "$(cluster_target)" --scenario failover --pids "$pids" \
        --duration 30s) || { echo "kill $k: no grant after the leader's kill" >&2; exit 1; }
    echo "$line" >>"$WORK/failover.lines"
    echo "kill $k/$KILLS: $line"
    pid=$(grep -o '"killed_pid":[0-9]*' <<<"$line" | cut -d: -f2)
    for i in 0 1 2; do
        if [[ ${C_PID[i]} == "$pid" ]]; then
            for _ in $(seq 100); do port_open "${C_CLIENT[i]}" || break; sleep 0.1; done
            cluster_start_node "$i"
            wait_port "${C_CLIENT[i]}" "tenured $i"
        fi
    done
done
# quantile Q: the Q-quantile (nearest rank) of the fail-over times, in ms.
quantile() {
    grep -o '"failover_ms":[0-9.]*' "$WORK/failover.lines" | cut -d: -f2 | sort -g |
        awk -v q="$1" '{ v[NR] = $1 } END { r = int(q * NR + 0.999999); if (r < 1) r = 1; print v[r] }'
}
echo "kill -9 of the leader to a grant by another node, $KILLS kills: p50 $(quantile 0.5) ms," \
    "p90 $(quantile 0.9) ms, max $(quantile 1) ms"
echo "load average before / after: $LOAD_START / $(cut -d' ' -f1-3 /proc/loadavg)"
