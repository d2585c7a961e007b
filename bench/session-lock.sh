#!/usr/bin/env bash
# What the session table's one lock costs plain locks: mixed cycles (acquire, renew, release)
# at 50 connections, unpipelined, on a fresh tenured each run, alone (A) or beside a session
# population kept alive (B: bench/session-load.py, 500 sessions x 100 leases, TTL 3 s, each
# kept alive every TTL/3, so 500 keep-alives a second renewing 50 000 leases: the estimate's
# 5 000 sessions x 100 at a 30 s TTL, scaled down by 10 in sessions, not in keep-alive rate),
# in interleaved pairs (A B, B A, ...), as bench/cpu-per-op.sh does.
#
#   bench/session-lock.sh target/release/tenured          # PAIRS=4 by default
#
# Per run: plain ops/s and the server's CPU per plain op (µs, all its threads, over the
# measured window; in B it includes the keep-alives' own work). Then one run of the session
# load alone gives that work's server CPU per second, and a probe on an idle server the
# median round trip of one keep-alive of 100 leases against a PING: the difference is about
# how long a keep-alive holds the session table's lock. Plain RENEW and RELEASE take that lock
# too, briefly, whenever session leases exist (to tell a session lease from a plain one).
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/lib.sh

BIN=${1:?usage: bench/session-lock.sh TENURED}
PAIRS=${PAIRS:-4}
LOADGEN=${LOADGEN:-target/release/tenure-loadgen}
PORT=${PORT:-17951}
read -r -a EXTRA <<<"${TENURED_ARGS:---durability tokens --no-fsync --threads 2}"
TICK_US=$((1000000 / $(getconf CLK_TCK)))

cpu() { awk '{ print $14 + $15 }' "/proc/$1/stat"; }

start_server() {
    DIR=$(mktemp -d)
    "$BIN" --listen "127.0.0.1:$PORT" --data-dir "$DIR" "${EXTRA[@]}" >/dev/null 2>&1 &
    PID=$!
    wait_port "$PORT" "$BIN"
}

stop_server() {
    kill -TERM "$PID"
    wait "$PID" || true
    rm -rf "$DIR"
}

# start_sessions ARGS...: the session load in the background, once its sessions are set up.
start_sessions() {
    SESSIONS_OUT=$(mktemp)
    python3 bench/session-load.py "$PORT" "$@" >"$SESSIONS_OUT" &
    SESSIONS_PID=$!
    for _ in $(seq 600); do grep -q ready "$SESSIONS_OUT" && return 0; sleep 0.1; done
    echo "the session load never got ready" >&2
    exit 1
}

# one WITH_SESSIONS: prints "OPS_PER_S CPU_US_PER_OP [session load report]".
one() {
    local json before after ops report=""
    start_server
    if [[ $1 == 1 ]]; then start_sessions --duration 8; fi
    json=$(mktemp)
    "$LOADGEN" --target "tenure://127.0.0.1:$PORT" --scenario max --op mixed \
        --connections 50 --pipeline 1 --duration 5s --warmup 1s --quiet --json >"$json" &
    local lg=$!
    sleep 1
    before=$(cpu "$PID")
    sleep 5
    after=$(cpu "$PID")
    wait "$lg"
    if [[ $1 == 1 ]]; then
        wait "$SESSIONS_PID"
        report=$(tail -1 "$SESSIONS_OUT")
        rm -f "$SESSIONS_OUT"
    fi
    stop_server
    ops=$(field "$json" summary ops_in_completed_cycles_per_s)
    rm -f "$json"
    awk -v o="$ops" -v c=$((after - before)) -v t="$TICK_US" \
        'BEGIN { printf "%.0f %.3f", o, c * t / (o * 5) }'
    echo " $report"
}

for pair in $(seq "$PAIRS"); do
    if ((pair % 2)); then a=$(one 0); b=$(one 1); else b=$(one 1); a=$(one 0); fi
    echo "pair $pair: A (plain) $a"
    echo "pair $pair: B (with sessions) $b"
done

# The session load alone: its server CPU per second, and the probe.
start_server
start_sessions --duration 6 --probe
sleep 1
before=$(cpu "$PID")
sleep 4
after=$(cpu "$PID")
wait "$SESSIONS_PID"
echo "sessions alone: server CPU $(awk -v c=$((after - before)) -v t="$TICK_US" \
    'BEGIN { printf "%.0f", c * t / 4 }') µs per s; $(tail -1 "$SESSIONS_OUT")"
rm -f "$SESSIONS_OUT"
stop_server
