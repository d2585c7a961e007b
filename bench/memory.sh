#!/usr/bin/env bash
# Memory per held lock (issue 12, goal 1): runs the sizing estimate's open-loop workload
# against a fresh tenured at two populations and reports, for each, the server's RSS growth
# per held lock (RSS at the end minus RSS before the load generator connected, over the locks
# held), the peak RSS (VmHWM) against the RSS at the end, and the lock table's own bytes per
# lock (STATS table_bytes).
#
#   500K held: 50 000 acquires/s, each held 10 s, TTL 30 s, renewed every 10 s (the estimate)
#   5M held:   100 000 acquires/s, each held 50 s, TTL 120 s, not renewed
#
#   200k held: 20 000 acquires/s, each held 10 s, TTL 30 s, renewed every 10 s
#
# Keys are the load generator's (`job:` and 18-19 digits, 22-23 bytes). Each population is
# measured for every kind of KINDS (issue 26): `plain` locks, semaphore permit leases
# (`permits:[COUNT/]LIMIT`, the load generator's `--permits`) or read leases (`shared`), the
# last two optionally on a small key space (`permits:4096@64`: 64 keys, each held by up to
# 4 096 leases; without `@KEYS` nearly every lease has a key of its own). "B/lock" is then
# bytes per held lease.
#
# Usage: bench/memory.sh
# Environment:
#   POPULATIONS="500k 5m"  which runs (500k, 5m, 200k)
#   KINDS=plain            which kinds, e.g. "plain permits:4096@64 shared@64 permits:4"
#   TENURED_ARGS=          more tenured flags (e.g. "--runtime shared --threads 1")
#   NO_BUILD=1             use target/release as it is
#   TENURED=PATH           another build of tenured (e.g. a base to compare; with NO_BUILD=1)
#
# tenured (--durability tokens) listens on 127.0.0.1:17881 only and is stopped by PID after
# each run. About 30 s for 500K, 25 s for 200K and 70 s for 5M, per kind.
set -euo pipefail

case "${1:-}" in
    "") ;;
    -h|--help) sed -n '2,29p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (try --help)" >&2; exit 2 ;;
esac

ROOT=$(cd "$(dirname "$0")/.." && pwd)
TENURED=${TENURED:-$ROOT/target/release/tenured}
LOADGEN=${LOADGEN:-$ROOT/target/release/tenure-loadgen}
PORT=17881
read -r -a TENURED_EXTRA <<<"${TENURED_ARGS:-}"

if [[ -z ${NO_BUILD:-} ]]; then
    (cd "$ROOT" && cargo build --release -q -p tenure-server -p tenure-loadgen)
fi
for bin in "$TENURED" "$LOADGEN"; do
    [[ -x $bin ]] || { echo "missing $bin (cargo build --release)" >&2; exit 1; }
done

# shellcheck source=bench/lib.sh
source "$ROOT/bench/lib.sh"
if port_open "$PORT"; then echo "port $PORT is already in use" >&2; exit 1; fi

WORK=$(mktemp -d)
PID=
cleanup() {
    if [[ -n $PID ]]; then kill "$PID" 2>/dev/null && wait "$PID" 2>/dev/null || true; fi
    rm -rf "$WORK"
}
trap cleanup EXIT INT TERM

# status_kib FIELD: a VmRSS/VmHWM figure of the server, KiB.
status_kib() {
    awk -v f="$1:" '$1 == f { print $2 }' "/proc/$PID/status"
}

# stat NAME: one figure of the server's STATS, over the debug console.
stat() {
    local reply
    exec 3<>"/dev/tcp/127.0.0.1/$PORT"
    echo STATS >&3
    read -r -t 5 reply <&3 || true
    exec 3>&-
    tr ' ' '\n' <<<"$reply" | awk -F= -v n="$1" '$1 == n { print $2 }'
}

# kind_flags KIND: the load generator's flags for KIND (plain, permits:..[@KEYS], shared[@KEYS]).
kind_flags() {
    local kind=${1%@*} keys=
    [[ $1 == *@* ]] && keys="--keys ${1#*@}"
    case $kind in
        plain) [[ -z $keys ]] || { echo "plain locks take no @KEYS" >&2; exit 2; } ;;
        shared) echo --shared $keys ;;
        permits:*) echo --permits "${kind#permits:}" $keys ;;
        *) echo "unknown kind $1 (plain, permits:[COUNT/]LIMIT[@KEYS], shared[@KEYS])" >&2
            exit 2 ;;
    esac
}

# measure NAME LOADGEN-ARGS...: one row.
measure() {
    local name=$1
    shift
    rm -rf "$WORK/data"
    RUST_LOG=warn "$TENURED" --listen "127.0.0.1:$PORT" --data-dir "$WORK/data" \
        --durability tokens --held-max 10000000 "${TENURED_EXTRA[@]}" \
        >"$WORK/tenured.log" 2>&1 &
    PID=$!
    wait_port "$PORT"
    "$LOADGEN" --target "tenure://127.0.0.1:$PORT" --server-pid "$PID" --json --quiet \
        --scenario estimate "$@" >"$WORK/run.json"
    local start end peak held table
    start=$(field "$WORK/run.json" resources server_rss_start_bytes)
    end=$(( $(status_kib VmRSS) * 1024 ))
    peak=$(( $(status_kib VmHWM) * 1024 ))
    held=$(stat held)
    table=$(stat table_bytes)
    kill "$PID" && wait "$PID" 2>/dev/null || true
    PID=
    awk -v n="$name" -v s="$start" -v e="$end" -v p="$peak" -v h="$held" -v t="$table" 'BEGIN {
        printf "%-22s %9d %10.1f %10.1f %8.0f %8.0f %6.2f\n", n, h, (e - s) / h, t / h,
            e / 1048576, p / 1048576, p / e }'
}

echo "tenured --durability tokens ${TENURED_ARGS:-}; $(nproc) cores"
printf "%-22s %9s %10s %10s %8s %8s %6s\n" run held "B/lock" "table B" "end MiB" "peak MiB" peak/end
for population in ${POPULATIONS:-500k 5m}; do
    for kind in ${KINDS:-plain}; do
        read -r -a flags <<<"$(kind_flags "$kind")"
        name=$population
        [[ $kind == plain ]] || name+=" $kind"
        case $population in
            500k) measure "$name" --duration 10s --warmup 2s "${flags[@]}" ;;
            200k) measure "$name" --rate 20000 --duration 10s --warmup 2s "${flags[@]}" ;;
            5m) measure "$name" --rate 100000 --hold 50s --ttl 120s --renew-every 60s \
                --duration 5s --warmup 2s "${flags[@]}" ;;
            *) echo "unknown population $population (500k, 200k or 5m)" >&2; exit 2 ;;
        esac
    done
done
echo "B/lock: RSS growth per held lock or lease (end minus before connecting); table B: STATS table_bytes per lock"
echo "load average $(cut -d' ' -f1-3 /proc/loadavg)"
