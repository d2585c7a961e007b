#!/usr/bin/env bash
# Does the cost of an operation depend on how many locks are held? Runs the same closed-loop
# loadgen scenarios against three tenured servers holding 1K, 100K and 1M other locks, in
# rounds (each round runs every scenario against every server in turn, so a drift of the
# machine's speed hits all three alike), and prints the median throughput of each and the
# median of its per-round ratio to the 1K server.
#
# Usage: bench/population.sh
# Environment:
#   DURATION=5s          measured window of each run
#   ROUNDS=3             rounds; each figure is the median over them
#   DURABILITY=tokens    tenured --durability (tokens: the CPU cost of the table, not the disk)
#   NO_BUILD=1           use target/release as it is
#   TENURED_ARGS=        more tenured flags (e.g. "--runtime shared")
#
# The servers listen on 127.0.0.1:17879-17881 only (one at a time under load; the others
# idle) and are stopped by PID on exit. About 1 min to fill, then 1 min per round.
set -euo pipefail
cd "$(dirname "$0")/.."

DURATION=${DURATION:-5s}
ROUNDS=${ROUNDS:-3}
DURABILITY=${DURABILITY:-tokens}
HELD=(1000 100000 1000000)
declare -A PORT=([1000]=17879 [100000]=17880 [1000000]=17881)
TENURED=target/release/tenured
LOADGEN=target/release/tenure-loadgen

command -v python3 >/dev/null || { echo "needs python3" >&2; exit 2; }
if [[ -z ${NO_BUILD:-} ]]; then
    cargo build --release -q -p tenure-server -p tenure-loadgen
fi

WORK=$(mktemp -d)
declare -A PID=()
cleanup() {
    local pid
    for pid in "${PID[@]}"; do
        kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null
    done
    rm -rf "$WORK"
}
trap cleanup EXIT INT TERM

read -r -a TENURED_EXTRA <<<"${TENURED_ARGS:-}"
for held in "${HELD[@]}"; do
    port=${PORT[$held]}
    if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
        echo "port $port is already in use" >&2
        exit 1
    fi
    RUST_LOG=warn "$TENURED" --listen "127.0.0.1:$port" --data-dir "$WORK/$held" \
        --durability "$DURABILITY" "${TENURED_EXTRA[@]}" >"$WORK/tenured.$held.log" 2>&1 &
    PID[$held]=$!
    for _ in $(seq 100); do (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break; sleep 0.1; done
done

# fill PORT COUNT: holds locks pop:0..COUNT for an hour, pipelining 1000 acquires at a time.
fill() {
    python3 - "$1" "$2" <<'PY'
import socket, sys
port, end = (int(a) for a in sys.argv[1:])
sock = socket.create_connection(("127.0.0.1", port), timeout=120)
replies = sock.makefile("rb")
for base in range(0, end, 1000):
    count = min(1000, end - base)
    sock.sendall("".join(f"ACQUIRE pop:{i} 3600000\n" for i in range(base, base + count)).encode())
    for _ in range(count):
        reply = replies.readline()
        if not reply.startswith(b"OK token="):
            sys.exit(f"fill: ACQUIRE answered {reply!r}")
PY
}

# measure PORT ARGS...: prints one figure per run.
measure() {
    local port=$1 json
    shift
    json=$("$LOADGEN" --target "tenure://127.0.0.1:$port" --scenario max --duration "$DURATION" \
        --warmup 1s --quiet --json "$@")
    if [[ " $* " == *" --op mixed "* ]]; then
        grep -o '"ops_in_completed_cycles_per_s":[0-9.]*' <<<"$json" | cut -d: -f2
    else
        grep -o '"rate_per_s":[0-9.]*' <<<"$json" | head -1 | cut -d: -f2
    fi
}

# median NUMBERS...: the middle value (the lower middle of an even count).
median() {
    printf "%s\n" "$@" | sort -g | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'
}

runs=("mixed c50 p1|--op mixed --connections 50 --pipeline 1"
      "mixed c50 p16|--op mixed --connections 50 --pipeline 16"
      "renew c50 p16|--op renew --connections 50 --pipeline 16")
for held in "${HELD[@]}"; do
    fill "${PORT[$held]}" "$held"
done
declare -A figures ratios
for round in $(seq "$ROUNDS"); do
    for r in "${runs[@]}"; do
        name=${r%%|*}
        declare -A this=()
        for held in "${HELD[@]}"; do
            # shellcheck disable=SC2086
            this[$held]=$(measure "${PORT[$held]}" ${r#*|})
            figures[$held/$name]+="${this[$held]} "
            ratios[$held/$name]+="$(awk -v a="${this[$held]}" -v b="${this[1000]}" \
                'BEGIN { printf "%.3f", a / b }') "
        done
        echo "round $round, $name: ${this[1000]} / ${this[100000]} / ${this[1000000]} ops/s" >&2
    done
done
printf "%-16s %-14s %14s %10s\n" held run "ops/s" "vs 1K"
for held in "${HELD[@]}"; do
    for r in "${runs[@]}"; do
        name=${r%%|*}
        # shellcheck disable=SC2086
        printf "%-16s %-14s %14.0f %10s\n" "$held" "$name" \
            "$(median ${figures[$held/$name]})" "$(median ${ratios[$held/$name]})"
    done
done
echo "medians of $ROUNDS rounds; vs 1K: the median of each round's ratio to the 1K server"
echo "tenured RSS at the end (1K / 100K / 1M): $(for held in "${HELD[@]}"; do
    awk '/^VmRSS:/ { printf "%s ", $2 }' "/proc/${PID[$held]}/status"; done)KiB;" \
    "durability $DURABILITY; $(nproc) cores; load average $(cut -d' ' -f1-3 /proc/loadavg)"
