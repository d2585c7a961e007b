#!/usr/bin/env bash
# Server CPU per operation of two builds of tenured, A and B, in interleaved pairs (A B, B A,
# ...): mixed cycles at 50 connections, unpipelined, each run on a fresh server. CPU per op is
# far less sensitive to other load on the machine than ops/s (a busy machine lowers the rate,
# not what each request costs), so this tells a slower build from a busier machine.
#
#   bench/cpu-per-op.sh OLD/tenured NEW/tenured           # PAIRS=6, PIPELINE=1 by default
#   B_ARGS="--permits 4" bench/cpu-per-op.sh T/tenured T/tenured  # one build, two workloads
#
# A_ARGS and B_ARGS (empty by default) are extra load generator flags for A's and for B's
# runs: with the same tenured twice they compare kinds of lease on one build (`--permits`,
# `--shared`, PROTOCOL.md 3.10) against plain locks.
#   LOADGEN_ARGS=--acquire-ids bench/cpu-per-op.sh ...    # extra load generator flags, both
#
# Per run: ops/s, the server's CPU (all its threads) over the measured window in µs per op,
# split into user and system time. The CPU is sampled from /proc after the warm-up and again
# at the window's end, so warm-up operations are not counted. Run it as root to give both the
# server and the load generator `nice -n -20`; otherwise they run at normal priority.
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/lib.sh

A=${1:?usage: bench/cpu-per-op.sh A_TENURED B_TENURED}
B=${2:?usage: bench/cpu-per-op.sh A_TENURED B_TENURED}
PAIRS=${PAIRS:-6}
PIPELINE=${PIPELINE:-1}
LOADGEN=${LOADGEN:-target/release/tenure-loadgen}
PORT=${PORT:-17941}
read -r -a EXTRA <<<"${TENURED_ARGS:---durability tokens --no-fsync --threads 1}"
read -r -a A_FLAGS <<<"${A_ARGS:-}"
read -r -a B_FLAGS <<<"${B_ARGS:-}"
read -r -a LG_EXTRA <<<"${LOADGEN_ARGS:-}"
NICE=()
if [[ $(id -u) == 0 ]]; then NICE=(nice -n -20); fi
TICK_US=$((1000000 / $(getconf CLK_TCK)))

# cpu PID: the process's user and system clock ticks so far, all threads.
cpu() { awk '{ print $14, $15 }' "/proc/$1/stat"; }

# one BIN [LOADGEN FLAGS...]: prints "OPS_PER_S USER_US_PER_OP SYS_US_PER_OP" of one run on
# a fresh server.
one() {
    local bin=$1 dir pid lg json before after ops
    shift
    dir=$(mktemp -d)
    json=$(mktemp)
    "${NICE[@]}" "$bin" --listen "127.0.0.1:$PORT" --data-dir "$dir" "${EXTRA[@]}" \
        >/dev/null 2>&1 &
    pid=$!
    wait_port "$PORT" "$bin"
    "${NICE[@]}" "$LOADGEN" --target "tenure://127.0.0.1:$PORT" --scenario max --op mixed \
        --connections 50 --pipeline "$PIPELINE" --duration 5s --warmup 1s --quiet --json \
        "${LG_EXTRA[@]}" "$@" >"$json" &
    lg=$!
    sleep 1 # the warm-up
    before=$(cpu "$pid")
    sleep 5 # the measured window
    after=$(cpu "$pid")
    wait "$lg"
    kill -TERM "$pid"
    wait "$pid" || true
    ops=$(field "$json" summary ops_in_completed_cycles_per_s)
    rm -rf "$dir" "$json"
    # shellcheck disable=SC2086 # two numbers each
    set -- $before $after
    awk -v o="$ops" -v u=$(($3 - $1)) -v s=$(($4 - $2)) -v t="$TICK_US" \
        'BEGIN { printf "%.0f %.3f %.3f", o, u * t / (o * 5), s * t / (o * 5) }'
}

median() {
    printf "%s\n" "$@" | sort -g | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'
}

ratios=() cpu_ratios=()
for pair in $(seq "$PAIRS"); do
    if ((pair % 2)); then
        a=$(one "$A" "${A_FLAGS[@]}") b=$(one "$B" "${B_FLAGS[@]}")
    else
        b=$(one "$B" "${B_FLAGS[@]}") a=$(one "$A" "${A_FLAGS[@]}")
    fi
    read -r a_ops a_user a_sys <<<"$a"
    read -r b_ops b_user b_sys <<<"$b"
    a_cpu=$(awk -v u="$a_user" -v s="$a_sys" 'BEGIN { printf "%.3f", u + s }')
    b_cpu=$(awk -v u="$b_user" -v s="$b_sys" 'BEGIN { printf "%.3f", u + s }')
    ratio=$(awk -v a="$a_ops" -v b="$b_ops" 'BEGIN { printf "%.3f", b / a }')
    cpu_ratio=$(awk -v a="$a_cpu" -v b="$b_cpu" 'BEGIN { printf "%.3f", b / a }')
    echo "pair $pair: A $a_ops ops/s $a_cpu µs/op (user $a_user)  B $b_ops ops/s $b_cpu µs/op" \
        "(user $b_user)  B/A ops/s $ratio  CPU/op $cpu_ratio"
    ratios+=("$ratio") cpu_ratios+=("$cpu_ratio")
done
echo "median B/A: ops/s $(median "${ratios[@]}")  CPU per op $(median "${cpu_ratios[@]}")" \
    "(pairs $(printf "%s\n" "${cpu_ratios[@]}" | sort -g | head -1)-$(printf "%s\n" \
        "${cpu_ratios[@]}" | sort -g | tail -1))"
