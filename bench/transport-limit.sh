#!/usr/bin/env bash
# The transport limit (issue 12, goal 2): what the load generator's own client and the
# kernel's loopback carry, measured against tenure-ping-server (tenure's handshake, PING
# answered, nothing else), beside tenured's PING and mixed acquire/renew/release cycles in
# the same run, each reported as a ratio to that limit at the same depth.
#
# Usage: bench/transport-limit.sh
# Environment:
#   DURATION=5s     measured window of each run (after 1 s of warm-up)
#   CONNECTIONS=50  connections of every run
#   THREADS=1       worker threads of both servers
#   NO_BUILD=1      use the binaries in target/release as they are
#   OUT=DIR         keep every run's JSON report in DIR
#
# Both servers on loopback (ports 17891, 17892); tenured with `--durability tokens --no-fsync`
# as in the other comparisons. Every process started is stopped by PID on exit. About 1 min.
set -euo pipefail

case "${1:-}" in
    "") ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (try --help)" >&2; exit 2 ;;
esac

DURATION=${DURATION:-5s}
CONNECTIONS=${CONNECTIONS:-50}
THREADS=${THREADS:-1}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
LOADGEN=$ROOT/target/release/tenure-loadgen
TENURED=$ROOT/target/release/tenured
PINGSERVER=$ROOT/target/release/tenure-ping-server
declare -A PORT=([limit]=17891 [tenured]=17892)
declare -A PID=()

if [[ -z ${NO_BUILD:-} ]]; then
    (cd "$ROOT" && cargo build --release -q -p tenure-server -p tenure-loadgen -p tenure-bench \
        --bin tenured --bin tenure-loadgen --bin tenure-ping-server)
fi
for bin in "$LOADGEN" "$TENURED" "$PINGSERVER"; do
    [[ -x $bin ]] || { echo "missing $bin (cargo build --release)" >&2; exit 1; }
done

WORK=$(mktemp -d)
cleanup() {
    local pid
    for pid in "${PID[@]}"; do
        kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null || true
    done
    if [[ -n ${OUT:-} ]]; then mkdir -p "$OUT" && cp "$WORK"/*.json "$OUT"/ 2>/dev/null || true; fi
    rm -rf "$WORK"
}
trap cleanup EXIT INT TERM

# shellcheck source=bench/lib.sh
source "$ROOT/bench/lib.sh"
for s in limit tenured; do
    if port_open "${PORT[$s]}"; then echo "port ${PORT[$s]} is already in use" >&2; exit 1; fi
done

"$PINGSERVER" --listen "127.0.0.1:${PORT[limit]}" --threads "$THREADS" 2>"$WORK/limit.log" &
PID[limit]=$!
RUST_LOG=warn "$TENURED" --listen "127.0.0.1:${PORT[tenured]}" --data-dir "$WORK/data" \
    --durability tokens --no-fsync --threads "$THREADS" 2>"$WORK/tenured.log" &
PID[tenured]=$!
wait_port "${PORT[limit]}"
wait_port "${PORT[tenured]}"

# run NAME SERVER OP PIPELINE: writes $WORK/NAME.json
run() {
    echo "== $1: --op $3 --pipeline $4 against $2" >&2
    "$LOADGEN" --target "tenure://127.0.0.1:${PORT[$2]}" --server-pid "${PID[$2]}" --json --quiet \
        --scenario max --op "$3" --connections "$CONNECTIONS" --pipeline "$4" \
        --duration "$DURATION" --warmup 1s >"$WORK/$1.json"
}

LOAD_START=$(cut -d' ' -f1-3 /proc/loadavg)
for pipe in 1 16; do
    run "limit-p$pipe" limit ping "$pipe"
    run "ping-p$pipe" tenured ping "$pipe"
    run "mixed-p$pipe" tenured mixed "$pipe"
done
LOAD_END=$(cut -d' ' -f1-3 /proc/loadavg)

# ops FILE: operations per second, every kind together.
ops() {
    local total=0 kind rate
    for kind in ping acquire renew release; do
        rate=$(field "$1" "$kind" rate_per_s)
        total=$(awk -v a="$total" -v b="${rate:-0}" 'BEGIN { print a + b }')
    done
    printf "%.0f" "$total"
}

echo
echo "$CONNECTIONS connections, --threads $THREADS; tenured --durability tokens --no-fsync"
echo "load average before / after: $LOAD_START / $LOAD_END"
echo "vs limit: ops/s over tenure-ping-server's PING at the same depth; srv/op: server CPU us per op"
printf "%-10s %-16s %10s %8s %7s %7s\n" run server "ops/s" "vs limit" srvcpu "srv/op"
for pipe in 1 16; do
    limit=$(ops "$WORK/limit-p$pipe.json")
    for name in "limit-p$pipe" "ping-p$pipe" "mixed-p$pipe"; do
        file=$WORK/$name.json
        rate=$(ops "$file")
        server=tenured
        [[ $name == limit-* ]] && server=tenure-ping-server
        cpu=$(field "$file" resources server_cpu_pct_of_core)
        printf "%-10s %-16s %10s %8s %7s %7s\n" "$name" "$server" "$rate" \
            "$(awk -v a="$rate" -v b="$limit" 'BEGIN { if (b > 0) printf "%.3f", a / b }')" \
            "$(awk -v c="${cpu:-0}" 'BEGIN { printf "%.1f", c }')" \
            "$(awk -v c="${cpu:-0}" -v o="$rate" 'BEGIN { if (o > 0) printf "%.2f", c * 1e4 / o }')"
    done
done
echo "(mixed: ops/s counts acquire, renew and release, three per cycle)"
