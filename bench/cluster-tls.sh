#!/usr/bin/env bash
# What peer TLS plus client TLS and identities cost a 3-node cluster: two clusters on
# loopback, one plain and one secure, the same mixed-cycle loads against each, in
# interleaved pairs.
#
# Usage: bench/cluster-tls.sh
# Environment:
#   PAIRS=3          interleaved pairs per pipeline depth (the order flips every pair)
#   DURATION=5s      measured window of each run (after 1 s of warm-up)
#   CONNECTIONS=50   connections of each run
#   NO_BUILD=1       use the binaries in target/release as they are
#   OUT=DIR          keep every run's JSON report in DIR
#
# Clusters, each three `tenured --cluster` nodes at their defaults (heartbeat 50 ms,
# election 150 ms), formed by `--initial-cluster`: `plain` (client ports 17921-17923, peer
# ports 17931-17933, plain TCP both) and `secure` (client ports 17941-17943, peer ports
# 17951-17953) with peer mutual TLS (`--peer-tls-*`, a node certificate naming
# node-N.tenure from a throwaway CA), client TLS (an ECDSA P-256 certificate for 127.0.0.1
# from the same CA) and `--identities` (the load generator's connections each send AUTH
# as `bench`, a random secret). Certificates are made with openssl. Both clusters run for
# the whole script; each run targets its cluster's leader, found at the start. Runs: for each depth (1, then 16), PAIRS pairs of
# mixed acquire/renew/release cycles, plain then secure in odd pairs, secure then plain in
# even ones. Every process started is stopped by PID on exit. About 2 min at the defaults.
set -euo pipefail

case "${1:-}" in
    "") ;;
    -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (try --help)" >&2; exit 2 ;;
esac

PAIRS=${PAIRS:-3}
DURATION=${DURATION:-5s}
CONNECTIONS=${CONNECTIONS:-50}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
LOADGEN=$ROOT/target/release/tenure-loadgen
TENURED=$ROOT/target/release/tenured
declare -A CLIENT_BASE=([plain]=17920 [secure]=17940)
declare -A PEER_BASE=([plain]=17930 [secure]=17950)
PIDS=()

command -v openssl >/dev/null || { echo "needs the openssl command line" >&2; exit 1; }
if [[ -z ${NO_BUILD:-} ]]; then
    (cd "$ROOT" && cargo build --release --locked -q -p tenure-server -p tenure-loadgen)
fi
for bin in "$LOADGEN" "$TENURED"; do
    [[ -x $bin ]] || { echo "missing $bin (cargo build --release)" >&2; exit 1; }
done

WORK=$(mktemp -d)
cleanup() {
    local pid
    for pid in "${PIDS[@]}"; do
        kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null || true
    done
    if [[ -n ${OUT:-} ]]; then mkdir -p "$OUT" && cp "$WORK"/*.json "$OUT"/ 2>/dev/null || true; fi
    rm -rf "$WORK"
}
trap cleanup EXIT INT TERM

# shellcheck source=bench/lib.sh
source "$ROOT/bench/lib.sh"
for c in plain secure; do
    for n in 1 2 3; do
        for port in $((CLIENT_BASE[$c] + n)) $((PEER_BASE[$c] + n)); do
            if port_open "$port"; then echo "port $port is already in use" >&2; exit 1; fi
        done
    done
done

# sign NAME EXTENSIONS...: NAME.key and NAME.pem, signed by the CA, valid for a day.
sign() {
    local name=$1
    shift
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=$name" \
        -keyout "$WORK/$name.key" -out "$WORK/$name.csr" 2>/dev/null
    printf '%s\n' "$@" >"$WORK/$name.ext"
    openssl x509 -req -in "$WORK/$name.csr" -CA "$WORK/ca.pem" -CAkey "$WORK/ca.key" \
        -CAcreateserial -days 1 -extfile "$WORK/$name.ext" -out "$WORK/$name.pem" 2>/dev/null
}
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 1 \
    -subj "/CN=tenure bench CA" -keyout "$WORK/ca.key" -out "$WORK/ca.pem" 2>/dev/null
for n in 1 2 3; do
    sign "node-$n" "subjectAltName = DNS:node-$n.tenure" "extendedKeyUsage = serverAuth, clientAuth"
done
sign server "basicConstraints = CA:FALSE" "extendedKeyUsage = serverAuth" \
    "subjectAltName = IP:127.0.0.1, DNS:localhost"
SECRET=$(openssl rand -hex 16)
printf '[[identity]]\nname = "bench"\nsecret-hash = "%s"\nprefixes = ["job:"]\n' \
    "$(printf '%s\n' "$SECRET" | "$TENURED" hash-secret)" >"$WORK/identities.toml"

# members CLUSTER: its --initial-cluster value.
members() {
    local n list=""
    for n in 1 2 3; do
        list+="${list:+,}$n=127.0.0.1:$((PEER_BASE[$1] + n))/127.0.0.1:$((CLIENT_BASE[$1] + n))"
    done
    echo "$list"
}
for c in plain secure; do
    for n in 1 2 3; do
        flags=(--cluster --node-id "$n" --data-dir "$WORK/$c$n"
               --peer-listen "127.0.0.1:$((PEER_BASE[$c] + n))"
               --listen "127.0.0.1:$((CLIENT_BASE[$c] + n))" --initial-cluster "$(members "$c")")
        if [[ $c == secure ]]; then
            flags+=(--peer-tls-cert "$WORK/node-$n.pem" --peer-tls-key "$WORK/node-$n.key"
                    --peer-tls-ca "$WORK/ca.pem" --tls-cert "$WORK/server.pem"
                    --tls-key "$WORK/server.key" --identities "$WORK/identities.toml")
        fi
        RUST_LOG=warn "$TENURED" "${flags[@]}" >"$WORK/$c$n.log" 2>&1 &
        PIDS+=($!)
    done
done
for c in plain secure; do
    for n in 1 2 3; do wait_port $((CLIENT_BASE[$c] + n)) "log: $WORK/$c$n.log"; done
done

# loadgen CLUSTER PORT ARGS...: the load generator against CLUSTER's node at PORT, with the
# cluster's TLS and identity.
loadgen() {
    local c=$1 port=$2
    shift 2
    if [[ $c == secure ]]; then
        TENURE_SECRET=$SECRET "$LOADGEN" --target "tenure://127.0.0.1:$port" \
            --tls-ca "$WORK/ca.pem" --identity bench "$@"
    else
        "$LOADGEN" --target "tenure://127.0.0.1:$port" "$@"
    fi
}
# leader CLUSTER: waits (60 s at most) until one of its nodes serves a short run on its
# own, and prints that node's client port. (The load generator's leader finding speaks
# neither TLS nor AUTH, so each run targets the leader's address alone, both clusters
# alike; a fail-over during the runs would show as failed cycles.)
leader() {
    local _ n port
    for _ in $(seq 20); do
        for n in 1 2 3; do
            port=$((CLIENT_BASE[$1] + n))
            if loadgen "$1" "$port" --scenario max --op mixed --connections 1 --pipeline 1 \
                --duration 200ms --warmup 0s --json --quiet >"$WORK/probe.json" 2>/dev/null \
                && [[ $(field "$WORK/probe.json" summary cycles_failed) == 0 ]]; then
                echo "$port"
                return 0
            fi
        done
        sleep 1
    done
    echo "the $1 cluster did not serve in 60 s; logs in $WORK" >&2
    tail -5 "$WORK/$1"*.log >&2
    exit 1
}
declare -A LEADER=([plain]=$(leader plain) [secure]=$(leader secure))
echo "leaders: plain 127.0.0.1:${LEADER[plain]}, secure 127.0.0.1:${LEADER[secure]}" >&2

LOAD_START=$(cut -d' ' -f1-3 /proc/loadavg)
for pipe in 1 16; do
    for pair in $(seq "$PAIRS"); do
        order=(plain secure)
        ((pair % 2 == 0)) && order=(secure plain)
        for c in "${order[@]}"; do
            echo "== mixed p$pipe pair $pair on $c" >&2
            loadgen "$c" "${LEADER[$c]}" --scenario max --op mixed --connections "$CONNECTIONS" \
                --pipeline "$pipe" --duration "$DURATION" --warmup 1s --json --quiet \
                >"$WORK/p$pipe.$pair.$c.json"
        done
    done
done
LOAD_END=$(cut -d' ' -f1-3 /proc/loadavg)

echo
echo "3-node clusters on loopback, defaults; secure = peer mTLS + client TLS + AUTH (ECDSA P-256)"
echo "load average before / after the runs: $LOAD_START / $LOAD_END" \
    "(anything else running skews the figures, tails most)"
echo "cycles/s: mixed acquire/renew/release cycles (3 ops each); p99: acquire latency, us"
printf "%-6s %-5s %10s %10s %7s %9s %9s\n" depth pair plain secure "sec/pl" "p99 pl" "p99 sec"
for pipe in 1 16; do
    ratios=()
    for pair in $(seq "$PAIRS"); do
        a=$(field "$WORK/p$pipe.$pair.plain.json" summary cycles_per_s)
        b=$(field "$WORK/p$pipe.$pair.secure.json" summary cycles_per_s)
        r=$(awk -v a="$a" -v b="$b" 'BEGIN { if (a > 0) printf "%.3f", b / a; else print "-" }')
        ratios+=("$r")
        printf "%-6s %-5s %10.0f %10.0f %7s %9.0f %9.0f\n" "p$pipe" "$pair" "$a" "$b" "$r" \
            "$(field "$WORK/p$pipe.$pair.plain.json" acquire p99_us)" \
            "$(field "$WORK/p$pipe.$pair.secure.json" acquire p99_us)"
    done
    median=$(printf '%s\n' "${ratios[@]}" | sort -g | awk '{ v[NR] = $1 } END {
        if (NR % 2) print v[(NR + 1) / 2]; else printf "%.3f", (v[NR / 2] + v[NR / 2 + 1]) / 2 }')
    echo "p$pipe median secure/plain: $median"
done
