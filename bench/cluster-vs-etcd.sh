#!/usr/bin/env bash
# A 3-node tenure cluster and a 3-node etcd cluster on loopback, side by side in one run:
# lock cycles, the sizing estimate, and fail-over after kill -9 of the leader.
#
# Usage: bench/cluster-vs-etcd.sh
# Environment:
#   KILLS=20           leader kills per system (1..1000); each killed node is restarted and
#                      the cluster waited on until healthy before the next kill
#   DURATION=5s        measured window of each closed-loop run (estimate: ESTIMATE_DURATION)
#   ESTIMATE_DURATION=10s, ESTIMATE_RATE=50000, ESTIMATE_HOLD=10s
#   CONNECTIONS=50     connections of the closed-loop runs
#   SETTLE=1           seconds to wait after a cluster is healthy before each kill: a restarted
#                      tenure node answers (and names the leader) before it has caught up, for
#                      up to openraft's 500 ms replication back-off, and a leader killed then
#                      leaves a lagging node that campaigns in vain; 0 measures those too
#   NO_BUILD=1         use the binaries in target/release as they are
#   TENURED=PATH       the tenured binary (default target/release/tenured), for before/after runs
#   TENURE_ARGS="..."  more flags for every tenured (e.g. --election-timeout-ms 200), unquoted
#   TENURE_LOG=warn    RUST_LOG of the tenure nodes (their logs are kept with OUT)
#   OUT=DIR            keep every run's JSON report, the fail-over lines and the nodes' logs in DIR
#
# Both clusters run with their default timeouts (tenure: heartbeat 50 ms, election 150-300 ms;
# etcd 3.4: heartbeat 100 ms, election 1000 ms) and default durability (both fsync). Ports:
# tenure clients 17881-17883, peers 17101-17103; etcd clients 23791-23793, peers 23801-23803.
# Every process is ended by PID on exit; every wait is bounded.
#
# etcd is loaded through its v3 JSON gateway on the client port (HTTP/1.1 keep-alive), with the
# cycle of its own lock: lease grant + create-if-absent txn (sent back to back), keep-alive,
# revoke. HTTP/1.1 has no multiplexing (Go answers pipelined requests one at a time), so etcd's
# "16 deep" row opens CONNECTIONS x 16 connections of one cycle each: the same cycles in flight.
# Fail-over: `tenure-loadgen --scenario failover` finds the leader, kills it with kill -9 and
# times until a lock is granted by the rest (attempts of 250 ms on fresh connections). Order:
# mixed cycles, fail-overs (few locks held), then the estimate.
# The defaults take about 6 minutes.
set -euo pipefail

case "${1:-}" in
    '') ;;
    -h|--help) sed -n '2,/^set -euo/{/^#/p}' "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (try --help)" >&2; exit 2 ;;
esac

KILLS=${KILLS:-20}
DURATION=${DURATION:-5s}
ESTIMATE_DURATION=${ESTIMATE_DURATION:-10s}
ESTIMATE_RATE=${ESTIMATE_RATE:-50000}
ESTIMATE_HOLD=${ESTIMATE_HOLD:-10s}
CONNECTIONS=${CONNECTIONS:-50}
SETTLE=${SETTLE:-1}
case "$KILLS" in ''|*[!0-9]*) echo "KILLS must be a number, got: $KILLS" >&2; exit 2 ;; esac
case "$SETTLE" in ''|*[!0-9]*) echo "SETTLE must be whole seconds, got: $SETTLE" >&2; exit 2 ;; esac
(( SETTLE <= 60 )) || { echo "SETTLE=$SETTLE is over 60 s" >&2; exit 2; }
(( KILLS >= 1 && KILLS <= 1000 )) || { echo "KILLS=$KILLS is outside 1..1000" >&2; exit 2; }
ROOT=$(cd "$(dirname "$0")/.." && pwd)
LOADGEN=$ROOT/target/release/tenure-loadgen
TENURED=${TENURED:-$ROOT/target/release/tenured}
# shellcheck source=bench/lib.sh
source "$ROOT/bench/lib.sh"

if ! command -v etcd >/dev/null; then
    echo "etcd is not installed, and this script compares against it; install it with:" >&2
    echo "  apt-get install -y etcd-server etcd-client" >&2
    exit 1
fi
if [[ -z ${NO_BUILD:-} ]]; then
    (cd "$ROOT" && cargo build --release -q -p tenure-server -p tenure-loadgen)
fi
for bin in "$LOADGEN" "$TENURED"; do
    [[ -x $bin ]] || { echo "missing $bin (cargo build --release)" >&2; exit 1; }
done

T_CLIENT=(17881 17882 17883)
T_PEER=(17101 17102 17103)
E_CLIENT=(23791 23792 23793)
E_PEER=(23801 23802 23803)
for port in "${T_CLIENT[@]}" "${T_PEER[@]}" "${E_CLIENT[@]}" "${E_PEER[@]}"; do
    if port_open "$port"; then echo "port $port is already in use" >&2; exit 1; fi
done

# 800 connections for etcd's 16-deep row, each with a socket at both ends.
ulimit -n 65536 2>/dev/null || ulimit -n 4096 2>/dev/null || true
WORK=$(mktemp -d)
T_PID=("" "" "")
E_PID=("" "" "")
# The members are disowned (so bash does not print "Killed" for each one the probe kills):
# ending one is kill by PID, then polling until it is gone, 10 s at most.
stop_pid() {
    kill "$1" 2>/dev/null || return 0
    for _ in $(seq 100); do kill -0 "$1" 2>/dev/null || return 0; sleep 0.1; done
    kill -9 "$1" 2>/dev/null || true
}
cleanup() {
    for pid in "${T_PID[@]}" "${E_PID[@]}"; do
        [[ -n $pid ]] && stop_pid "$pid"
    done
    if [[ -n ${OUT:-} ]]; then
        mkdir -p "$OUT" && cp "$WORK"/*.json "$WORK"/*.lines "$WORK"/*.log "$OUT"/ 2>/dev/null || true
    fi
    rm -rf "$WORK"
}
trap cleanup EXIT INT TERM

# wait_closed PORT: waits up to 10 s until nothing listens on PORT (a killed node's port).
wait_closed() {
    for _ in $(seq 100); do port_open "$1" || return 0; sleep 0.1; done
    echo "port $1 still open 10 s after its process was killed" >&2
    exit 1
}

start_tenure() {
    local i=$1
    RUST_LOG=${TENURE_LOG:-warn} "$TENURED" --cluster --node-id $((i + 1)) \
        --peer-listen "127.0.0.1:${T_PEER[i]}" --listen "127.0.0.1:${T_CLIENT[i]}" \
        --data-dir "$WORK/tenure$i" ${TENURE_ARGS:-} >>"$WORK/tenure$i.log" 2>&1 &
    T_PID[i]=$!
    disown "${T_PID[i]}"
}

E_CLUSTER=""
for i in 0 1 2; do E_CLUSTER+="${E_CLUSTER:+,}e$i=http://127.0.0.1:${E_PEER[i]}"; done
start_etcd() {
    local i=$1
    etcd --name "e$i" --data-dir "$WORK/etcd$i" \
        --listen-client-urls "http://127.0.0.1:${E_CLIENT[i]}" \
        --advertise-client-urls "http://127.0.0.1:${E_CLIENT[i]}" \
        --listen-peer-urls "http://127.0.0.1:${E_PEER[i]}" \
        --initial-advertise-peer-urls "http://127.0.0.1:${E_PEER[i]}" \
        --initial-cluster "$E_CLUSTER" --initial-cluster-token tenure-bench \
        --initial-cluster-state new >>"$WORK/etcd$i.log" 2>&1 &
    E_PID[i]=$!
    disown "${E_PID[i]}"
}

T_TARGET="tenure://127.0.0.1:${T_CLIENT[0]},127.0.0.1:${T_CLIENT[1]},127.0.0.1:${T_CLIENT[2]}"
E_TARGET="etcd://127.0.0.1:${E_CLIENT[0]},127.0.0.1:${E_CLIENT[1]},127.0.0.1:${E_CLIENT[2]}"
target_of() { if [[ $1 == tenure ]]; then echo "$T_TARGET"; else echo "$E_TARGET"; fi; }

# healthy SYSTEM: waits (60 s at most) until every member answers and one serves; prints the
# leader's client address.
healthy() {
    local line
    line=$("$LOADGEN" --target "$(target_of "$1")" --scenario healthy --duration 60s) || {
        echo "the $1 cluster did not become healthy; logs in $WORK" >&2
        tail -5 "$WORK"/"$1"*.log >&2
        exit 1
    }
    grep -o '"leader":"[^"]*"' <<<"$line" | cut -d'"' -f4
}

for i in 0 1 2; do start_tenure "$i"; start_etcd "$i"; done
for i in 0 1 2; do wait_port "${T_PEER[i]}" "tenured $i"; done
"$TENURED" cluster-init --peer "127.0.0.1:${T_PEER[0]}" --nodes \
    "1=127.0.0.1:${T_PEER[0]}/127.0.0.1:${T_CLIENT[0]},2=127.0.0.1:${T_PEER[1]}/127.0.0.1:${T_CLIENT[1]},3=127.0.0.1:${T_PEER[2]}/127.0.0.1:${T_CLIENT[2]}" \
    >"$WORK/cluster-init.log" 2>&1 || { cat "$WORK/cluster-init.log" >&2; exit 1; }
for i in 0 1 2; do wait_port "${E_CLIENT[i]}" "etcd $i"; done
healthy tenure >/dev/null
healthy etcd >/dev/null

# leader_pid SYSTEM: the process id of the member serving now.
leader_pid() {
    local addr port i
    addr=$(healthy "$1")
    port=${addr##*:}
    for i in 0 1 2; do
        if [[ $1 == tenure && ${T_CLIENT[i]} == "$port" ]]; then echo "${T_PID[i]}"; fi
        if [[ $1 == etcd && ${E_CLIENT[i]} == "$port" ]]; then echo "${E_PID[i]}"; fi
    done
}

# run NAME SYSTEM LOADGEN-ARGS... : writes $WORK/NAME.SYSTEM.json
run() {
    local name=$1 system=$2
    shift 2
    echo "== $name on $system: $*" >&2
    "$LOADGEN" --target "$(target_of "$system")" --json --quiet "$@" >"$WORK/$name.$system.json"
}

LOAD_START=$(cut -d' ' -f1-3 /proc/loadavg)
for pipe in 1 16; do
    mixed=(--scenario max --op mixed --duration "$DURATION" --warmup 1s)
    run "mixed-p$pipe" tenure "${mixed[@]}" --connections "$CONNECTIONS" --pipeline "$pipe"
    run "mixed-p$pipe" etcd "${mixed[@]}" --connections $((CONNECTIONS * pipe)) --pipeline 1
done

# failover SYSTEM: KILLS leader kills, each node restarted and the cluster healthy again
# before the next; appends each kill's JSON line to $WORK/failover.SYSTEM.lines.
failover() {
    local system=$1 k line pid pids i
    for k in $(seq "$KILLS"); do
        healthy "$system" >/dev/null
        sleep "$SETTLE"
        if [[ $system == tenure ]]; then pids=$(IFS=,; echo "${T_PID[*]}"); else pids=$(IFS=,; echo "${E_PID[*]}"); fi
        line=$("$LOADGEN" --target "$(target_of "$system")" --scenario failover \
            --pids "$pids" --duration 30s) || { echo "fail-over $k of $system failed" >&2; exit 1; }
        echo "$line" >>"$WORK/failover.$system.lines"
        echo "== fail-over $k/$KILLS of $system: $line" >&2
        pid=$(grep -o '"killed_pid":[0-9]*' <<<"$line" | cut -d: -f2)
        for i in 0 1 2; do
            if [[ $system == tenure && ${T_PID[i]} == "$pid" ]]; then
                wait_closed "${T_PEER[i]}"
                start_tenure "$i"
            elif [[ $system == etcd && ${E_PID[i]} == "$pid" ]]; then
                wait_closed "${E_PEER[i]}"
                start_etcd "$i"
            fi
        done
    done
}
failover tenure
failover etcd

est=(--scenario estimate --rate "$ESTIMATE_RATE" --hold "$ESTIMATE_HOLD"
     --renew-every "$ESTIMATE_HOLD" --ttl 30s --duration "$ESTIMATE_DURATION" --warmup 1s
     --connections 16 --pipeline 256)
FAILED=()
# A run that fails is said loudly, its row stays empty, and the script exits 1 after the
# table: the fail-over figures gathered before it are not thrown away.
run estimate tenure "${est[@]}" --server-pid "$(leader_pid tenure)" || {
    echo "THE ESTIMATE AGAINST TENURE FAILED (see above); its row stays empty" >&2
    FAILED+=("estimate on tenure")
    rm -f "$WORK/estimate.tenure.json"
}
# etcd cannot keep up: its backlog grows in the load generator, and the run reports what it
# got through (the same 16 connections; Go answers each one's requests one at a time). Open
# loop: an op counts only if answered, and ops meant for the window wait behind the backlog.
# Last, after the fail-overs, so neither cluster holds the estimate's locks while timed.
run estimate etcd "${est[@]}" --server-pid "$(leader_pid etcd)" --drain 1s || {
    echo "the estimate against etcd failed (see above); its row stays empty" >&2
    FAILED+=("estimate on etcd")
    rm -f "$WORK/estimate.etcd.json"
}

f() { echo "$WORK/$1.$2.json"; }
ROWS=()
row() { ROWS+=("$1|$2|$3|$4"); }
ops_per_s() {
    local total=0 kind rate
    [[ -f $1 ]] || return 0
    for kind in acquire renew release; do
        rate=$(field "$1" "$kind" rate_per_s)
        total=$(awk -v a="$total" -v b="${rate:-0}" 'BEGIN { print a + b }')
    done
    printf "%.0f" "$total"
}
for pipe in 1 16; do
    row "mixed c$CONNECTIONS p$pipe" "cycles/s (3 ops)" \
        "$(field "$(f "mixed-p$pipe" tenure)" summary cycles_per_s)" \
        "$(field "$(f "mixed-p$pipe" etcd)" summary cycles_per_s)"
    row "mixed c$CONNECTIONS p$pipe" "acquire p99 us" \
        "$(field "$(f "mixed-p$pipe" tenure)" acquire p99_us)" \
        "$(field "$(f "mixed-p$pipe" etcd)" acquire p99_us)"
done
# est_field SYSTEM OBJECT KEY: a figure of the estimate's report, empty if that run failed.
est_field() { [[ -f $(f estimate "$1") ]] && field "$(f estimate "$1")" "$2" "$3"; }
row "estimate ${ESTIMATE_RATE}/s" "ops/s achieved" \
    "$(ops_per_s "$(f estimate tenure)")" "$(ops_per_s "$(f estimate etcd)")"
for figure in "acquire p99_us acquire p99 us" "resources locks_held_at_end locks held at end" \
    "resources unanswered_after_drain unanswered after drain" \
    "resources server_cpu_pct_of_core leader cpu % of a core"; do
    read -r object key label <<<"$figure"
    row "estimate" "$label" "$(est_field tenure "$object" "$key")" "$(est_field etcd "$object" "$key")"
done

# quantile FILE Q: the Q-quantile (nearest rank) of the fail-over times in FILE, in ms.
quantile() {
    grep -o '"failover_ms":[0-9.]*' "$1" | cut -d: -f2 | sort -g |
        awk -v q="$2" '{ v[NR] = $1 } END { r = int(q * NR + 0.999999); if (r < 1) r = 1; print v[r] }'
}
for q in 0.5 1; do
    name=$([[ $q == 1 ]] && echo max || echo p50)
    row "fail-over x$KILLS settle ${SETTLE}s" "kill -9 to grant $name ms" \
        "$(quantile "$WORK/failover.tenure.lines" "$q")" "$(quantile "$WORK/failover.etcd.lines" "$q")"
done

num() {
    [[ -n $1 ]] || { echo "-"; return; }
    awk -v x="$1" 'BEGIN { a = x < 0 ? -x : x
        if (a < 10) printf "%.3f", x; else if (a < 100) printf "%.1f", x; else printf "%.0f", x }'
}
echo
echo "tenure $("$TENURED" --version 2>/dev/null | head -1), $(etcd --version | head -1)," \
    "3 nodes each on loopback, default timeouts, fsync on"
echo "load average before / after the runs: $LOAD_START / $(cut -d' ' -f1-3 /proc/loadavg)" \
    "(anything else running skews the figures, tails most)"
printf "%-24s %-28s %12s %12s %8s\n" scenario figure tenure etcd ratio
for r in "${ROWS[@]}"; do
    IFS='|' read -r scenario figure t e <<<"$r"
    ratio=$(awk -v a="${t:-0}" -v b="${e:-0}" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "-" }')
    printf "%-24s %-28s %12s %12s %8s\n" "$scenario" "$figure" "$(num "$t")" "$(num "$e")" "$ratio"
done
echo "(ratio = tenure / etcd; higher is better for rates, lower for latency, cpu and fail-over)"
if ((${#FAILED[@]})); then
    echo "FAILED: ${FAILED[*]} (their rows are empty)" >&2
    exit 1
fi
