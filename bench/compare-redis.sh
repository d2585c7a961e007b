#!/usr/bin/env bash
# Runs the same tenure-loadgen scenarios against tenured and against Redis, side by side.
#
# Usage: bench/compare-redis.sh [--durable]
#   --durable   Redis with --appendonly yes --appendfsync always, tenured with fsync on.
#               Without it: Redis with no persistence, tenured --durability tokens (locks in
#               memory only, like Redis; fencing tokens still never reused, unlike Redis).
# Environment:
#   DURATION=5s        measured window of each closed-loop run (estimate: ESTIMATE_DURATION)
#   ESTIMATE_DURATION=10s, ESTIMATE_RATE=50000, ESTIMATE_HOLD=10s
#   CONNECTIONS=50     connections of the closed-loop runs
#   NO_BUILD=1         use the binaries in target/release as they are
#   OUT=DIR            keep every run's JSON report in DIR
#
# Both servers listen on loopback only (Redis 16379, tenured 17878) and are stopped by PID on
# exit. Runs: the estimate (open loop, ramp of ESTIMATE_HOLD), then max acquire, max mixed and
# fenced acquire, each unpipelined and 16 deep, then contention (64 clients, 4 hot keys, 1 ms
# holds; tenure waits in line, Redis clients poll every 1 ms). The defaults take about 2.5 min.
set -euo pipefail

DURABLE=0
for arg in "$@"; do
    case "$arg" in
        --durable) DURABLE=1 ;;
        -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
        *) echo "unknown argument: $arg (try --help)" >&2; exit 2 ;;
    esac
done

DURATION=${DURATION:-5s}
ESTIMATE_DURATION=${ESTIMATE_DURATION:-10s}
ESTIMATE_RATE=${ESTIMATE_RATE:-50000}
ESTIMATE_HOLD=${ESTIMATE_HOLD:-10s}
CONNECTIONS=${CONNECTIONS:-50}
REDIS_PORT=16379
TENURE_PORT=17878
ROOT=$(cd "$(dirname "$0")/.." && pwd)
LOADGEN=$ROOT/target/release/tenure-loadgen
TENURED=$ROOT/target/release/tenured

if ! command -v redis-server >/dev/null; then
    echo "redis-server is not installed; install it with:" >&2
    echo "  apt-get install -y redis-server" >&2
    exit 1
fi
if [[ -z ${NO_BUILD:-} ]]; then
    (cd "$ROOT" && cargo build --release -q -p tenure-server -p tenure-loadgen)
fi
for bin in "$LOADGEN" "$TENURED"; do
    [[ -x $bin ]] || { echo "missing $bin (cargo build --release)" >&2; exit 1; }
done

WORK=$(mktemp -d)
REDIS_PID=""
TENURE_PID=""
cleanup() {
    for pid in $REDIS_PID $TENURE_PID; do
        kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null || true
    done
    if [[ -n ${OUT:-} ]]; then mkdir -p "$OUT" && cp "$WORK"/*.json "$OUT"/ 2>/dev/null || true; fi
    rm -rf "$WORK"
}
trap cleanup EXIT INT TERM

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
wait_port() {
    for _ in $(seq 100); do port_open "$1" && return 0; sleep 0.1; done
    echo "nothing listens on port $1 after 10 s" >&2
    exit 1
}
for port in $REDIS_PORT $TENURE_PORT; do
    if port_open "$port"; then echo "port $port is already in use" >&2; exit 1; fi
done

mkdir -p "$WORK/redis" "$WORK/tenure"
if (( DURABLE )); then
    redis_persist=(--appendonly yes --appendfsync always)
    tenure_persist=()
    MODE="durable: Redis AOF appendfsync always; tenured fsync on"
else
    redis_persist=(--appendonly no)
    tenure_persist=(--durability tokens)
    MODE="in memory: Redis without persistence; tenured --durability tokens"
fi
redis-server --port $REDIS_PORT --bind 127.0.0.1 --save '' --dir "$WORK/redis" \
    "${redis_persist[@]}" >"$WORK/redis.log" 2>&1 &
REDIS_PID=$!
RUST_LOG=warn "$TENURED" --listen 127.0.0.1:$TENURE_PORT --data-dir "$WORK/tenure" \
    "${tenure_persist[@]}" >"$WORK/tenured.log" 2>&1 &
TENURE_PID=$!
wait_port $REDIS_PORT
wait_port $TENURE_PORT

# run NAME SERVER(tenure|redis) LOADGEN-ARGS... : writes $WORK/NAME.SERVER.json
run() {
    local name=$1 server=$2 pid target
    shift 2
    if [[ $server == tenure ]]; then
        target=tenure://127.0.0.1:$TENURE_PORT pid=$TENURE_PID
    else
        target=redis://127.0.0.1:$REDIS_PORT pid=$REDIS_PID
    fi
    echo "== $name on $server: $*" >&2
    "$LOADGEN" --target "$target" --server-pid "$pid" --json --quiet "$@" \
        >"$WORK/$name.$server.json"
}

# field FILE OBJECT KEY: a number from one flat object of a loadgen JSON report.
field() {
    local object
    object=$(grep -o "\"$2\":{[^}]*}" "$1" | head -1)
    grep -o "\"$3\":[-0-9.e]*" <<<"$object" | head -1 | cut -d: -f2
}
window() { grep -o '"window_s":[0-9.]*' "$1" | cut -d: -f2; }
# per_s FILE OBJECT KEY: that count divided by the window.
per_s() {
    local n w
    n=$(field "$1" "$2" "$3")
    w=$(window "$1")
    awk -v n="${n:-0}" -v w="$w" 'BEGIN { printf "%.0f", n / w }'
}
ops_per_s() {
    local total=0 kind rate
    for kind in acquire renew release; do
        rate=$(field "$1" "$kind" rate_per_s)
        total=$(awk -v a="$total" -v b="${rate:-0}" 'BEGIN { print a + b }')
    done
    printf "%.0f" "$total"
}

LOAD_START=$(cut -d' ' -f1-3 /proc/loadavg)
ROWS=()
row() { ROWS+=("$1|$2|$3|$4"); }

est=(--scenario estimate --rate "$ESTIMATE_RATE" --hold "$ESTIMATE_HOLD"
     --renew-every "$ESTIMATE_HOLD" --ttl 30s --duration "$ESTIMATE_DURATION" --warmup 1s
     --connections 16 --pipeline 256)
for server in tenure redis; do run estimate $server "${est[@]}"; done
for pipe in 1 16; do
    max=(--scenario max --connections "$CONNECTIONS" --pipeline $pipe --duration "$DURATION"
         --warmup 1s)
    for server in tenure redis; do
        run "acquire-p$pipe" $server "${max[@]}" --op acquire
        run "mixed-p$pipe" $server "${max[@]}" --op mixed
    done
    # tenure's grants always carry a fencing token; Redis needs the fenced script for one.
    run "fenced-p$pipe" tenure "${max[@]}" --op acquire
    run "fenced-p$pipe" redis "${max[@]}" --op acquire --redis-fenced
    run "mixed-fenced-p$pipe" redis "${max[@]}" --op mixed --redis-fenced
done

cont=(--scenario contention --clients 64 --keys 4 --hold 1ms --connections 16
      --duration "$DURATION" --warmup 1s)
for server in tenure redis; do run contention $server "${cont[@]}"; done

f() { echo "$WORK/$1.$2.json"; }
for s in tenure redis; do
    declare "est_ops_$s=$(ops_per_s "$(f estimate $s)")"
    declare "est_p99_$s=$(field "$(f estimate $s)" acquire p99_us)"
    declare "est_mem_$s=$(field "$(f estimate $s)" resources server_bytes_per_held_lock)"
    declare "est_cpu_$s=$(field "$(f estimate $s)" resources server_cpu_pct_of_core)"
done
row "estimate ${ESTIMATE_RATE}/s" "ops/s achieved" "$est_ops_tenure" "$est_ops_redis"
row "estimate" "acquire p99 us" "$est_p99_tenure" "$est_p99_redis"
row "estimate" "server bytes/held lock" "$est_mem_tenure" "$est_mem_redis"
row "estimate" "server cpu % of a core" "$est_cpu_tenure" "$est_cpu_redis"
for pipe in 1 16; do
    for s in tenure redis; do
        declare "acq_$s=$(per_s "$(f "acquire-p$pipe" $s)" acquire granted)"
        declare "acqp99_$s=$(field "$(f "acquire-p$pipe" $s)" acquire p99_us)"
        declare "mix_$s=$(field "$(f "mixed-p$pipe" $s)" summary cycles_per_s)"
        declare "fen_$s=$(per_s "$(f "fenced-p$pipe" $s)" acquire granted)"
    done
    mixfen_redis=$(field "$(f "mixed-fenced-p$pipe" redis)" summary cycles_per_s)
    row "max acquire c$CONNECTIONS p$pipe" "grants/s" "$acq_tenure" "$acq_redis"
    row "max acquire c$CONNECTIONS p$pipe" "acquire p99 us" "$acqp99_tenure" "$acqp99_redis"
    row "max mixed c$CONNECTIONS p$pipe" "cycles/s (3 ops)" "$mix_tenure" "$mix_redis"
    row "fenced acquire c$CONNECTIONS p$pipe" "grants/s" "$fen_tenure" "$fen_redis"
    row "mixed vs fenced c$CONNECTIONS p$pipe" "cycles/s (Redis fenced)" "$mix_tenure" "$mixfen_redis"
done

# num X: X rounded for the table (more decimals for small values), or "-" when missing.
num() {
    [[ -n $1 ]] || { echo "-"; return; }
    awk -v x="$1" 'BEGIN { a = x < 0 ? -x : x
        if (a < 10) printf "%.3f", x; else if (a < 100) printf "%.1f", x; else printf "%.0f", x }'
}
for s in tenure redis; do
    declare "cg_$s=$(field "$(f contention $s)" summary grants_per_s)"
    declare "ch50_$s=$(field "$(f contention $s)" summary handoff_p50_us)"
    declare "ch99_$s=$(field "$(f contention $s)" summary handoff_p99_us)"
    declare "cj_$s=$(field "$(f contention $s)" summary jain_fairness)"
done
row "contention 64 on 4 keys" "grants/s" "$cg_tenure" "$cg_redis"
row "contention 64 on 4 keys" "hand-off p50 us" "$ch50_tenure" "$ch50_redis"
row "contention 64 on 4 keys" "hand-off p99 us" "$ch99_tenure" "$ch99_redis"
row "contention 64 on 4 keys" "Jain fairness (1 = even)" "$cj_tenure" "$cj_redis"

echo
echo "mode: $MODE"
echo "load average before / after the runs: $LOAD_START / $(cut -d' ' -f1-3 /proc/loadavg)" \
    "(anything else running skews the figures, tails most)"
printf "%-28s %-24s %12s %12s %8s\n" scenario figure tenure redis ratio
for r in "${ROWS[@]}"; do
    IFS='|' read -r scenario figure t r2 <<<"$r"
    ratio=$(awk -v a="${t:-0}" -v b="${r2:-0}" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "-" }')
    printf "%-28s %-24s %12s %12s %8s\n" "$scenario" "$figure" "$(num "$t")" "$(num "$r2")" "$ratio"
done
echo "(ratio = tenure / redis; higher is better for rates, lower for latency, memory and cpu)"
