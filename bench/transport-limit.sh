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
#   ROUNDS=3        rounds of all six runs; each figure is the median over the rounds
#   TENURED_ARGS=   more tenured flags (e.g. "--runtime per-core")
#   NO_BUILD=1      use the binaries in target/release as they are
#   OUT=DIR         keep every run's JSON report in DIR
#
# Both servers on loopback (ports 17891, 17892); tenured with `--durability tokens --no-fsync`
# as in the other comparisons. Every process started is stopped by PID on exit. About 40 s
# per round.
set -euo pipefail

case "${1:-}" in
    "") ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (try --help)" >&2; exit 2 ;;
esac

DURATION=${DURATION:-5s}
CONNECTIONS=${CONNECTIONS:-50}
THREADS=${THREADS:-1}
ROUNDS=${ROUNDS:-3}
read -r -a TENURED_EXTRA <<<"${TENURED_ARGS:-}"
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
    --durability tokens --no-fsync --threads "$THREADS" "${TENURED_EXTRA[@]}" \
    2>"$WORK/tenured.log" &
PID[tenured]=$!
wait_port "${PORT[limit]}"
wait_port "${PORT[tenured]}"

# run NAME ROUND SERVER OP PIPELINE: writes $WORK/NAME.ROUND.json
run() {
    echo "== $1 (round $2): --op $4 --pipeline $5 against $3" >&2
    "$LOADGEN" --target "tenure://127.0.0.1:${PORT[$3]}" --server-pid "${PID[$3]}" --json --quiet \
        --scenario max --op "$4" --connections "$CONNECTIONS" --pipeline "$5" \
        --duration "$DURATION" --warmup 1s >"$WORK/$1.$2.json"
}

LOAD_START=$(cut -d' ' -f1-3 /proc/loadavg)
for round in $(seq "$ROUNDS"); do
    for pipe in 1 16; do
        run "limit-p$pipe" "$round" limit ping "$pipe"
        run "ping-p$pipe" "$round" tenured ping "$pipe"
        run "mixed-p$pipe" "$round" tenured mixed "$pipe"
    done
done
LOAD_END=$(cut -d' ' -f1-3 /proc/loadavg)

# median NUMBERS...: the middle value (the lower middle of an even count).
median() {
    printf "%s\n" "$@" | sort -g | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'
}

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
echo "$CONNECTIONS connections, --threads $THREADS; tenured --durability tokens --no-fsync ${TENURED_ARGS:-}"
echo "medians of $ROUNDS rounds; vs limit: the median of each round's ratio"
echo "load average before / after: $LOAD_START / $LOAD_END"
echo "vs limit: ops/s over tenure-ping-server's PING at the same depth; srv/op: server CPU us per op"
printf "%-10s %-16s %10s %8s %7s %7s\n" run server "ops/s" "vs limit" srvcpu "srv/op"
for pipe in 1 16; do
    for name in "limit-p$pipe" "ping-p$pipe" "mixed-p$pipe"; do
        rates=() ratios=() cpus=() per_op=()
        for round in $(seq "$ROUNDS"); do
            file=$WORK/$name.$round.json
            rate=$(ops "$file")
            limit=$(ops "$WORK/limit-p$pipe.$round.json")
            cpu=$(field "$file" resources server_cpu_pct_of_core)
            rates+=("$rate")
            ratios+=("$(awk -v a="$rate" -v b="$limit" 'BEGIN { if (b > 0) printf "%.3f", a / b }')")
            cpus+=("${cpu:-0}")
            per_op+=("$(awk -v c="${cpu:-0}" -v o="$rate" 'BEGIN { if (o > 0) printf "%.2f", c * 1e4 / o }')")
        done
        server=tenured
        [[ $name == limit-* ]] && server=tenure-ping-server
        printf "%-10s %-16s %10s %8s %7s %7s\n" "$name" "$server" "$(median "${rates[@]}")" \
            "$(median "${ratios[@]}")" "$(printf "%.1f" "$(median "${cpus[@]}")")" \
            "$(median "${per_op[@]}")"
    done
done
echo "(mixed: ops/s counts acquire, renew and release, three per cycle)"
