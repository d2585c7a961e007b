#!/usr/bin/env bash
# Does the cost of an operation depend on how many locks are held? Runs the same closed-loop
# loadgen scenarios against one tenured with 1K, then 100K, then 1M other locks held, and
# prints the throughput of each next to the 1K figure.
#
# Usage: bench/population.sh
# Environment:
#   DURATION=5s          measured window of each run
#   DURABILITY=tokens    tenured --durability (tokens: the CPU cost of the table, not the disk)
#   NO_BUILD=1           use target/release as it is
#   TENURED_ARGS=        more tenured flags (e.g. "--runtime shared")
#
# tenured listens on 127.0.0.1:17879 only and is stopped by PID on exit. About 1.5 min.
set -euo pipefail
cd "$(dirname "$0")/.."

DURATION=${DURATION:-5s}
DURABILITY=${DURABILITY:-tokens}
PORT=17879
TENURED=target/release/tenured
LOADGEN=target/release/tenure-loadgen

command -v python3 >/dev/null || { echo "needs python3" >&2; exit 2; }
if [[ -z ${NO_BUILD:-} ]]; then
    cargo build --release -q -p tenure-server -p tenure-loadgen
fi

WORK=$(mktemp -d)
PID=
cleanup() {
    [[ -n $PID ]] && kill "$PID" 2>/dev/null && wait "$PID" 2>/dev/null
    rm -rf "$WORK"
}
trap cleanup EXIT INT TERM

read -r -a TENURED_EXTRA <<<"${TENURED_ARGS:-}"
RUST_LOG=warn "$TENURED" --listen 127.0.0.1:$PORT --data-dir "$WORK" \
    --durability "$DURABILITY" "${TENURED_EXTRA[@]}" >"$WORK/tenured.log" 2>&1 &
PID=$!
for _ in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/$PORT) 2>/dev/null && break; sleep 0.1; done

# fill FROM TO: holds locks pop:FROM..TO for an hour, pipelining 1000 acquires at a time.
fill() {
    python3 - "$PORT" "$1" "$2" <<'PY'
import socket, sys
port, start, end = (int(a) for a in sys.argv[1:])
sock = socket.create_connection(("127.0.0.1", port), timeout=120)
replies = sock.makefile("rb")
for base in range(start, end, 1000):
    count = min(1000, end - base)
    sock.sendall("".join(f"ACQUIRE pop:{i} 3600000\n" for i in range(base, base + count)).encode())
    for _ in range(count):
        reply = replies.readline()
        if not reply.startswith(b"OK token="):
            sys.exit(f"fill: ACQUIRE answered {reply!r}")
PY
}

# measure NAME ARGS...: prints one figure per run.
measure() {
    local json
    json=$("$LOADGEN" --target tenure://127.0.0.1:$PORT --scenario max --duration "$DURATION" \
        --warmup 1s --quiet --json "$@")
    if [[ " $* " == *" --op mixed "* ]]; then
        grep -o '"ops_in_completed_cycles_per_s":[0-9.]*' <<<"$json" | cut -d: -f2
    else
        grep -o '"rate_per_s":[0-9.]*' <<<"$json" | head -1 | cut -d: -f2
    fi
}

runs=("mixed c50 p1|--op mixed --connections 50 --pipeline 1"
      "mixed c50 p16|--op mixed --connections 50 --pipeline 16"
      "renew c50 p16|--op renew --connections 50 --pipeline 16")
declare -A base
filled=0
printf "%-16s %-14s %14s %10s\n" held run "ops/s" "vs 1K"
for held in 1000 100000 1000000; do
    fill $filled $held
    filled=$held
    for r in "${runs[@]}"; do
        name=${r%%|*}
        # shellcheck disable=SC2086
        figure=$(measure ${r#*|})
        [[ $held == 1000 ]] && base[$name]=$figure
        ratio=$(awk -v a="$figure" -v b="${base[$name]}" 'BEGIN { printf "%.2f", a / b }')
        printf "%-16s %-14s %14.0f %10s\n" "$held" "$name" "$figure" "$ratio"
    done
done
echo "tenured RSS at the end: $(awk '/^VmRSS:/ { print $2 }' /proc/$PID/status) KiB;" \
    "durability $DURABILITY; $(nproc) cores; load average $(cut -d' ' -f1-3 /proc/loadavg)"
