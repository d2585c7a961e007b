#!/usr/bin/env bash
# Many clean restarts of tenured with a few locks each time: does the WAL (segment files,
# records replayed, recovery time) follow the live state or the history?
#
# Usage: bench/restarts.sh [N]        N restarts, default 1000, at most 100000
# Environment:
#   PORT=17880       loopback port for the server
#   TENURED=path     the binary to run (default target/release/tenured, built unless NO_BUILD=1)
#   NO_BUILD=1       do not build
#   EVERY=100        print a line every EVERY restarts
#   NO_FSYNC=1       run tenured with --no-fsync (replay cost without the disk's fsync time)
#
# Each run starts tenured (fsync on), waits for PONG, releases the previous run's 3 locks,
# acquires 3 new ones, and stops it with SIGTERM; so 3 locks are held at every restart. The
# line printed per EVERY runs gives the segment files found at that start, the server's own
# "recovered from the WAL" records replayed, and the median and maximum of its elapsed_ms
# over those EVERY starts. Everything lives in a temporary directory, removed on exit; the
# server is stopped by PID.
set -euo pipefail

N=${1:-1000}
N_MAX=100000
PORT=${PORT:-17880}
EVERY=${EVERY:-100}
case "$N" in
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    ''|*[!0-9]*) echo "N must be a number of restarts, got: $N" >&2; exit 2 ;;
esac
if (( N < 1 || N > N_MAX )); then
    echo "N=$N is outside 1..$N_MAX" >&2
    exit 2
fi

ROOT=$(cd "$(dirname "$0")/.." && pwd)
TENURED=${TENURED:-$ROOT/target/release/tenured}
if [[ "${NO_BUILD:-0}" != 1 ]]; then
    cargo build --release --manifest-path "$ROOT/Cargo.toml" -p tenure-server --bin tenured
fi
[[ -x "$TENURED" ]] || { echo "no $TENURED" >&2; exit 2; }

WORK=$(mktemp -d "${TMPDIR:-/tmp}/tenure-restarts.XXXXXX")
PID=""
cleanup() {
    if [[ -n "$PID" ]] && kill -0 "$PID" 2>/dev/null; then
        kill -9 "$PID" 2>/dev/null || true
        wait "$PID" 2>/dev/null || true
    fi
    rm -rf "$WORK"
}
trap cleanup EXIT

# Sends the lines on stdin to the server, one connection; prints the replies.
talk() {
    local deadline=$(( $(date +%s) + 30 )) line
    until exec 3<>"/dev/tcp/127.0.0.1/$PORT"; do
        (( $(date +%s) < deadline )) || { echo "no server on port $PORT" >&2; return 1; }
        sleep 0.005
    done 2>/dev/null
    while read -r line; do
        echo "$line" >&3
        read -r -t 30 line <&3 || { echo "no reply" >&2; return 1; }
        echo "$line"
    done
    exec 3>&-
}

FLAGS=(--listen "127.0.0.1:$PORT" --data-dir "$WORK/data")
[[ "${NO_FSYNC:-0}" == 1 ]] && FLAGS+=(--no-fsync)
# SIGTERM, repeated every 5 s (at most 6 times) if the server is still running: one start
# in about two thousand was seen to miss the first signal.
stop_server() {
    local tries
    for (( tries = 1; tries <= 6; tries++ )); do
        kill -TERM "$PID" 2>/dev/null || return 0
        for (( i = 0; i < 50; i++ )); do
            kill -0 "$PID" 2>/dev/null || return 0
            sleep 0.1
        done
        echo "run $1: tenured still running 5 s after SIGTERM $tries, sending another" >&2
    done
}

shopt -s nullglob
declare -a leases=() window=()
echo "tenured: $TENURED ${FLAGS[*]}, $N restarts"
printf '%8s %9s %9s %18s %15s\n' restart segments records recovery_ms_median recovery_ms_max
for (( run = 1; run <= N; run++ )); do
    segment_files=("$WORK"/data/wal-*.log)
    segments=${#segment_files[@]}
    NO_COLOR=1 RUST_LOG=info "$TENURED" "${FLAGS[@]}" >"$WORK/run.log" 2>&1 &
    PID=$!
    requests=$(printf 'PING\n'
        for lease in "${leases[@]}"; do printf 'RELEASE %s\n' "$lease"; done
        for j in 1 2 3; do printf 'ACQUIRE run%d-%d 3600000\n' "$run" "$j"; done)
    mapfile -t replies < <(talk <<<"$requests")
    leases=()
    for (( j = 1; j <= 3; j++ )); do
        reply=${replies[${#replies[@]} - 4 + j]}
        [[ "$reply" == "OK token="* ]] || { echo "run $run: ACQUIRE answered $reply" >&2; exit 1; }
        lease=${reply#*lease=}
        leases+=("run$run-$j ${lease%% *}")
    done
    stop_server "$run"
    wait "$PID" || { echo "run $run: tenured failed" >&2; cat "$WORK/run.log" >&2; exit 1; }
    PID=""
    line=$(sed 's/\x1b\[[0-9;]*m//g' "$WORK/run.log" | grep 'recovered from the WAL')
    records=$(grep -o 'records=[0-9]*' <<<"$line" | cut -d= -f2)
    window+=("$(grep -o 'elapsed_ms=[0-9]*' <<<"$line" | cut -d= -f2)")
    if (( run % EVERY == 0 || run == 1 )); then
        mapfile -t sorted < <(printf '%s\n' "${window[@]}" | sort -n)
        printf '%8d %9d %9s %18s %15s\n' "$run" "$segments" "$records" \
            "${sorted[$(( ${#sorted[@]} / 2 ))]}" "${sorted[-1]}"
        window=()
    fi
done
segment_files=("$WORK"/data/wal-*.log)
echo "segment files at the end: ${#segment_files[@]}," \
    "$(du -sb "$WORK/data" | cut -f1) bytes in the data directory"
