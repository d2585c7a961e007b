#!/usr/bin/env bash
# Server instructions per request, counted by valgrind's callgrind: mixed cycles (acquire,
# renew, release) against one tenured build, with and without --acquire-ids (or any two
# load generator argument sets). Instructions, unlike seconds, do not move with whatever
# else the machine runs, so a change of a few per cent in what the server executes per
# request shows in one run, where throughput needs many interleaved pairs (BENCHMARKS.md,
# 2026-12-03 "what an acquire id costs, counted"). It does not see cache misses or the
# kernel: a throughput claim still needs bench/acquire-id-cost.sh.
#
#   bench/instructions.sh                                   # plain against --acquire-ids
#   A_ARGS="" B_ARGS="--acquire-ids" DURATION=10s bench/instructions.sh
#   A_TENURED=old/tenured B_TENURED=new/tenured B_ARGS="" bench/instructions.sh  # two builds
#
# Prints, for each side, the requests the server ran (STATS ops_acquire + ops_renew +
# ops_release) and the instructions per request of
#   executor: Executor::run and all it calls (the request's work, under the shard's lock),
#   connection: Conn::run and all it calls (the above, plus decoding, replies, socket I/O),
# then the ratios B/A. The server's other threads (the ticker, the WAL) are left out: they
# run per unit of time, not per request.
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/lib.sh

TENURED=${TENURED:-target/release/tenured}
A_TENURED=${A_TENURED:-$TENURED}
B_TENURED=${B_TENURED:-$TENURED}
LOADGEN=${LOADGEN:-target/release/tenure-loadgen}
PORT=${PORT:-17943}
DURATION=${DURATION:-10s}
A_ARGS=${A_ARGS-}
B_ARGS=${B_ARGS---acquire-ids}
command -v valgrind >/dev/null || { echo "needs valgrind (apt-get install valgrind)" >&2; exit 1; }
command -v callgrind_annotate >/dev/null || { echo "needs callgrind_annotate (valgrind)" >&2; exit 1; }
command -v nc >/dev/null || { echo "needs nc (netcat-openbsd)" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# inclusive OUT PATTERN: the inclusive instruction count of the one function matching PATTERN.
inclusive() {
    callgrind_annotate --inclusive=yes --threshold=100 "$1" 2>/dev/null |
        grep -E "$2 \[" | head -1 | awk '{ gsub(",", "", $1); print $1 }'
}

# one NAME TENURED [LOADGEN_ARGS...]: "requests executor_ir_per_op connection_ir_per_op".
one() {
    local name=$1 tenured=$2 pid requests exec conn
    shift 2
    mkdir "$work/$name.data"
    valgrind --tool=callgrind --callgrind-out-file="$work/$name.out" "$tenured" \
        --listen "127.0.0.1:$PORT" --data-dir "$work/$name.data" \
        --durability tokens --no-fsync --threads 1 >"$work/$name.log" 2>&1 &
    pid=$!
    for _ in $(seq 300); do port_open "$PORT" && break; sleep 0.1; done
    port_open "$PORT" || { echo "tenured under valgrind did not listen" >&2; cat "$work/$name.log" >&2; exit 1; }
    "$LOADGEN" --target "tenure://127.0.0.1:$PORT" --scenario max --op mixed \
        --connections 10 --pipeline 16 --duration "$DURATION" --warmup 1s --quiet "$@" >/dev/null
    requests=$(printf 'STATS\n' | nc -q1 127.0.0.1 "$PORT" | tr ' ' '\n' |
        awk -F= '/^ops_(acquire|renew|release)=/ { s += $2 } END { print s }')
    kill -TERM "$pid"
    wait "$pid" || true
    exec=$(inclusive "$work/$name.out" 'tenure_server::executor::Executor::run')
    conn=$(inclusive "$work/$name.out" 'tenure_server::conn::Conn::run::\{\{closure\}\}')
    [[ -n $requests && -n $exec && -n $conn && $requests -gt 0 ]] ||
        { echo "no counts for $name (requests '$requests')" >&2; exit 1; }
    awk -v r="$requests" -v e="$exec" -v c="$conn" 'BEGIN { printf "%d %.1f %.1f\n", r, e / r, c / r }'
}

read -r -a a_args <<<"$A_ARGS"
read -r -a b_args <<<"$B_ARGS"
read -r a_req a_exec a_conn <<<"$(one a "$A_TENURED" "${a_args[@]}")"
read -r b_req b_exec b_conn <<<"$(one b "$B_TENURED" "${b_args[@]}")"
echo "A ($A_TENURED ${A_ARGS:-plain}): $a_req requests, executor $a_exec, connection $a_conn instructions per request"
echo "B ($B_TENURED ${B_ARGS:-plain}): $b_req requests, executor $b_exec, connection $b_conn instructions per request"
awk -v ae="$a_exec" -v be="$b_exec" -v ac="$a_conn" -v bc="$b_conn" \
    'BEGIN { printf "B/A: executor %.3f, connection %.3f\n", be / ae, bc / ac }'
