#!/usr/bin/env bash
# What an acquire id costs (issue 25): mixed cycles (acquire, renew, release) at 50
# connections, 16 deep, against one tenured build, with and without --acquire-ids, in
# interleaved pairs (order alternating), each run on a fresh server (or, SERVER=one, all on
# one server). Prints each run's ops/s and the server's CPU per op (from /proc, so other
# load on the machine moves it less than it moves throughput), and the medians of the
# per-pair ratios ids/plain with a 95 % confidence interval of each.
#
#   bench/acquire-id-cost.sh                       # PAIRS=5, DURATION=5s, PIPELINE=16
#   TENURED=target/release/tenured LOADGEN=target/release/tenure-loadgen bench/acquire-id-cost.sh
#   PIN=1 bench/acquire-id-cost.sh   # server on CPU 0, load generator on CPU 1 (taskset)
#
# PIN=1 keeps the scheduler from moving the two processes onto one core mid-run, which on
# a 2-core machine swings one run's throughput by 10-20 %: pinned, runs of one build agree
# within a few per cent, so a cost of a few per cent shows (BENCHMARKS.md, 2026-12-02).
#
#   SERVER=one DURATION=1s WARMUP=200ms PAIRS=150 PIN=1 bench/acquire-id-cost.sh
#
# This machine's speed also swings by a third from one second to the next (STATS polled
# each second through one run: 0.50-0.87M ops/s), so short runs, interleaved, cancel more of
# that drift than long ones: one server for all of them (a run of mixed cycles leaves the
# table empty; an ids run leaves the table of ended acquire ids filled, as on any server that
# has been up a while), 1 s each, and many pairs (BENCHMARKS.md, 2026-12-03 night).
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/lib.sh

PAIRS=${PAIRS:-5}
DURATION=${DURATION:-5s}
PIPELINE=${PIPELINE:-16}
WARMUP=${WARMUP:-1s}
SERVER=${SERVER:-fresh}
[[ $SERVER == fresh || $SERVER == one ]] || { echo "SERVER is fresh or one, not $SERVER" >&2; exit 2; }
TENURED=${TENURED:-target/release/tenured}
LOADGEN=${LOADGEN:-target/release/tenure-loadgen}
PORT=${PORT:-17941}
read -r -a EXTRA <<<"${TENURED_ARGS:---durability tokens --no-fsync --threads 1}"
PIN=${PIN:-0}
SERVER_CPU=() LOADGEN_CPU=()
if [[ $PIN == 1 ]]; then
    command -v taskset >/dev/null || { echo "PIN=1 needs taskset (util-linux)" >&2; exit 1; }
    SERVER_CPU=(taskset -c 0) LOADGEN_CPU=(taskset -c 1)
fi

# start_server: starts tenured on PORT with a fresh data directory; sets pid and dir.
start_server() {
    dir=$(mktemp -d)
    "${SERVER_CPU[@]}" "$TENURED" --listen "127.0.0.1:$PORT" --data-dir "$dir" "${EXTRA[@]}" >/dev/null 2>&1 &
    pid=$!
    wait_port "$PORT" "$TENURED"
}

stop_server() {
    kill -TERM "$pid"
    wait "$pid" || true
    rm -rf "$dir"
}

# one [LOADGEN_ARGS...]: "ops/s cpu_us_per_op" of one run (on a fresh server unless
# SERVER=one).
one() {
    local json ops cpu
    [[ $SERVER == one ]] || start_server
    json=$("${LOADGEN_CPU[@]}" "$LOADGEN" --target "tenure://127.0.0.1:$PORT" --scenario max --op mixed \
        --connections 50 --pipeline "$PIPELINE" --duration "$DURATION" --warmup "$WARMUP" --quiet \
        --json --server-pid "$pid" "$@")
    [[ $SERVER == one ]] || stop_server
    ops=$(grep -o '"ops_in_completed_cycles_per_s":[0-9.]*' <<<"$json" | cut -d: -f2)
    cpu=$(grep -o '"server_cpu_pct_of_core":[0-9.]*' <<<"$json" | cut -d: -f2)
    awk -v o="$ops" -v c="$cpu" 'BEGIN { printf "%.0f %.3f\n", o, c / 100 / o * 1e6 }'
}

pid='' dir=''
if [[ $SERVER == one ]]; then
    start_server
    trap stop_server EXIT
fi

ops_ratios=() cpu_ratios=()
for pair in $(seq "$PAIRS"); do
    if ((pair % 2)); then a=$(one); b=$(one --acquire-ids)
    else b=$(one --acquire-ids); a=$(one); fi
    read -r a_ops a_cpu <<<"$a"
    read -r b_ops b_cpu <<<"$b"
    ops_ratio=$(awk -v a="$a_ops" -v b="$b_ops" 'BEGIN { printf "%.3f", b / a }')
    cpu_ratio=$(awk -v a="$a_cpu" -v b="$b_cpu" 'BEGIN { printf "%.3f", b / a }')
    echo "pair $pair: plain $a_ops ops/s ${a_cpu} us/op  ids $b_ops ops/s ${b_cpu} us/op" \
        " ops ids/plain $ops_ratio  cpu/op ids/plain $cpu_ratio"
    ops_ratios+=("$ops_ratio") cpu_ratios+=("$cpu_ratio")
done
echo "pipeline $PIPELINE, $PAIRS pairs of $DURATION, server $SERVER: median ops ids/plain $(median "${ops_ratios[@]}")" \
    "(95 % CI $(median_ci "${ops_ratios[@]}")), median server CPU per op ids/plain" \
    "$(median "${cpu_ratios[@]}") (95 % CI $(median_ci "${cpu_ratios[@]}"))"
