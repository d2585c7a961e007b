#!/usr/bin/env bash
# Restart time of tenured after kill -9 with N held locks: fill, kill -9, restart, and time
# from launching the new process until it answers PING (WAL replay included).
#
# Usage: bench/restart-time.sh [N]     N held locks, default 500000, at most 2000000
# Environment:
#   PORT=17879    loopback port for the server
#   NO_FSYNC=1    run tenured with --no-fsync (the fill is faster; replay is the same)
#   NO_BUILD=1    use target/release/tenured as it is
#   KEEP_LOGS=1   print the servers' logs on exit
#
# Prints the fill rate, the WAL size, the server's RSS before the kill and after the restart,
# the time to the first PONG and the server's own recovery figure. Everything lives in a
# temporary directory, removed on exit; the servers are stopped by PID.
set -euo pipefail

N=${1:-500000}
N_MAX=2000000
PORT=${PORT:-17879}
case "$N" in
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    ''|*[!0-9]*) echo "N must be a number of locks, got: $N" >&2; exit 2 ;;
esac
if (( N < 1 || N > N_MAX )); then
    echo "N=$N is outside 1..$N_MAX" >&2
    exit 2
fi
command -v python3 >/dev/null || { echo "needs python3" >&2; exit 2; }

ROOT=$(cd "$(dirname "$0")/.." && pwd)
TENURED=$ROOT/target/release/tenured
if [[ "${NO_BUILD:-0}" != 1 ]]; then
    cargo build --release --manifest-path "$ROOT/Cargo.toml" -p tenure-server --bin tenured
fi
[[ -x "$TENURED" ]] || { echo "no $TENURED (build it or unset NO_BUILD)" >&2; exit 2; }

WORK=$(mktemp -d "${TMPDIR:-/tmp}/tenure-restart.XXXXXX")
PID=""
cleanup() {
    if [[ -n "$PID" ]] && kill -0 "$PID" 2>/dev/null; then
        kill -9 "$PID" 2>/dev/null || true
        wait "$PID" 2>/dev/null || true
    fi
    if [[ -n "${KEEP_LOGS:-}" ]]; then cat "$WORK"/*.log >&2; fi
    rm -rf "$WORK"
}
trap cleanup EXIT

FLAGS=(--listen "127.0.0.1:$PORT" --data-dir "$WORK/data" --held-max "$N_MAX")
[[ "${NO_FSYNC:-0}" == 1 ]] && FLAGS+=(--no-fsync)

# Starts tenured in the background with its log in $WORK/$1.log; sets PID.
start() {
    NO_COLOR=1 RUST_LOG=info "$TENURED" "${FLAGS[@]}" >"$WORK/$1.log" 2>&1 &
    PID=$!
}

# Polls until PING answers PONG (bash's /dev/tcp, no interpreter start-up in the figure);
# prints the milliseconds since $1 (from `date +%s%N`).
ping_ms() {
    local deadline=$(( $(date +%s) + 120 )) reply
    until exec 3<>"/dev/tcp/127.0.0.1/$PORT"; do
        (( $(date +%s) < deadline )) || { echo "no server on port $PORT" >&2; return 1; }
        sleep 0.002
    done 2>/dev/null
    echo PING >&3
    read -r -t 120 reply <&3 || true
    exec 3>&-
    [[ "$reply" == PONG* ]] || { echo "PING answered: $reply" >&2; return 1; }
    echo $(( ($(date +%s%N) - $1) / 1000000 ))
}

rss_kib() {
    awk '/^VmRSS:/ { print $2 }' "/proc/$1/status"
}

# python3 helper: `fill` pipelines N acquires, 1000 lines at a time; `held` prints STATS held.
client() {
    python3 - "$@" <<'PY'
import socket, sys, time

mode, port = sys.argv[1], int(sys.argv[2])

def connect(deadline):
    while True:
        try:
            return socket.create_connection(("127.0.0.1", port), timeout=120)
        except OSError:
            if time.time() > deadline:
                sys.exit(f"no server on port {port}")
            time.sleep(0.002)

if mode == "fill":
    n, batch = int(sys.argv[3]), 1000
    sock = connect(time.time() + 10)
    replies = sock.makefile("rb")
    started, done = time.monotonic(), 0
    while done < n:
        count = min(batch, n - done)
        lines = "".join(f"ACQUIRE fill:{i} 3600000\n" for i in range(done, done + count))
        sock.sendall(lines.encode())
        for _ in range(count):
            reply = replies.readline()
            if not reply.startswith(b"OK token="):
                sys.exit(f"fill: ACQUIRE answered {reply!r}")
        done += count
    elapsed = time.monotonic() - started
    print(f"filled {n} held locks in {elapsed:.2f} s ({n / elapsed:,.0f} grants/s)")
elif mode == "held":
    sock = connect(time.time() + 10)
    sock.sendall(b"STATS\n")
    stats = sock.makefile("rb").readline().decode().split()
    print(dict(w.split("=", 1) for w in stats[1:])["held"])
PY
}

echo "tenured: $TENURED ${FLAGS[*]}"
start first
ping_ms "$(date +%s%N)" >/dev/null
client fill "$PORT" "$N"
held=$(client held "$PORT")
[[ "$held" == "$N" ]] || { echo "STATS says held=$held, expected $N" >&2; exit 1; }
rss_before=$(rss_kib "$PID")
kill -9 "$PID"
wait "$PID" 2>/dev/null || true
wal_bytes=$(du -sb "$WORK/data" | cut -f1)

launched_ns=$(date +%s%N)
start second
to_pong_ms=$(ping_ms "$launched_ns")
held=$(client held "$PORT")
rss_after=$(rss_kib "$PID")
sleep 1 # and once it has settled
rss_settled=$(rss_kib "$PID")
[[ "$held" == "$N" ]] || { echo "after restart STATS says held=$held, expected $N" >&2; exit 1; }
recovery=$(sed 's/\x1b\[[0-9;]*m//g' "$WORK/second.log" | grep 'recovered from the WAL' \
    | grep -o 'elapsed_ms=[0-9]*' | head -1 || true)

echo "held locks:            $N"
echo "WAL on disk:           $((wal_bytes / 1024 / 1024)) MiB ($wal_bytes bytes)"
echo "RSS before kill -9:    $((rss_before / 1024)) MiB"
echo "restart to first PONG: ${to_pong_ms} ms (from launching the process)"
echo "server's WAL replay:   ${recovery:-not logged}"
echo "RSS after restart:     $((rss_after / 1024)) MiB at the first PONG, $((rss_settled / 1024)) MiB a second later (held=$held)"
