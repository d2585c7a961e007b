#!/usr/bin/env bash
# The cost of identities (AUTH, once per connection) and TLS, side by side with plain TCP in
# one run: four tenured variants, the same loadgen scenarios against each.
#
# Usage: bench/tls-auth.sh
# Environment:
#   DURATION=5s            measured window of each mixed-cycle run (after 1 s of warm-up)
#   ESTIMATE_DURATION=20s  measured window of the estimate (after its 10 s ramp and 1 s warm-up)
#   CONNECTIONS=50         connections of the mixed-cycle runs
#   NO_BUILD=1             use the binaries in target/release as they are
#   OUT=DIR                keep every run's JSON report in DIR
#
# Variants, each its own tenured on loopback (ports 17881-17884), all with
# `--durability tokens --no-fsync --threads 1` (the setting of the other A/B comparisons in
# BENCHMARKS.md): plain; identities only (every connection sends AUTH); TLS only; TLS and
# identities. Certificates: a throwaway CA and an ECDSA P-256 server certificate for
# 127.0.0.1 made with openssl; the identity's secret is random, hashed with
# `tenured hash-secret` and handed to the load generator in TENURE_SECRET. Runs, one variant
# after the other within each step so the machine's drift hits all alike: mixed
# acquire/renew/release cycles at CONNECTIONS connections unpipelined, the same 16 deep,
# then the estimate (50 000 acquires/s, 10 s holds, 16 connections 256 deep, as in
# compare-redis.sh), each variant's server stopped after its estimate so that the 500K locks
# it leaves do not expire during the next one. Every process started is stopped by PID on
# exit. About 3 min.
set -euo pipefail

case "${1:-}" in
    "") ;;
    -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (try --help)" >&2; exit 2 ;;
esac

DURATION=${DURATION:-5s}
ESTIMATE_DURATION=${ESTIMATE_DURATION:-20s}
CONNECTIONS=${CONNECTIONS:-50}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
LOADGEN=$ROOT/target/release/tenure-loadgen
TENURED=$ROOT/target/release/tenured
VARIANTS=(plain auth tls tls+auth)
declare -A PORT=([plain]=17881 [auth]=17882 [tls]=17883 [tls+auth]=17884)
declare -A PID=()

command -v openssl >/dev/null || { echo "needs the openssl command line" >&2; exit 1; }
if [[ -z ${NO_BUILD:-} ]]; then
    (cd "$ROOT" && cargo build --release -q -p tenure-server -p tenure-loadgen)
fi
for bin in "$LOADGEN" "$TENURED"; do
    [[ -x $bin ]] || { echo "missing $bin (cargo build --release)" >&2; exit 1; }
done

WORK=$(mktemp -d)
cleanup() {
    local pid
    for pid in "${PID[@]}"; do
        kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null || true
    done
    if [[ -n ${OUT:-} ]]; then mkdir -p "$OUT" && cp "$WORK"/*.json "$OUT"/ 2>/dev/null || true; fi
    rm -rf "$WORK"
}
trap cleanup EXIT INT TERM

# shellcheck source=bench/lib.sh
source "$ROOT/bench/lib.sh"
for v in "${VARIANTS[@]}"; do
    if port_open "${PORT[$v]}"; then echo "port ${PORT[$v]} is already in use" >&2; exit 1; fi
done

# A CA and a server certificate for 127.0.0.1 and localhost, valid for a day.
make_certificates() {
    local ext=$WORK/server.ext
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 1 \
        -subj "/CN=tenure bench CA" -keyout "$WORK/ca.key" -out "$WORK/ca.pem" 2>/dev/null
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=tenured" \
        -keyout "$WORK/server.key" -out "$WORK/server.csr" 2>/dev/null
    printf '%s\n' "basicConstraints = CA:FALSE" "keyUsage = digitalSignature" \
        "extendedKeyUsage = serverAuth" "subjectAltName = IP:127.0.0.1, DNS:localhost" >"$ext"
    openssl x509 -req -in "$WORK/server.csr" -CA "$WORK/ca.pem" -CAkey "$WORK/ca.key" \
        -CAcreateserial -days 1 -extfile "$ext" -out "$WORK/server.pem" 2>/dev/null
}

# The identity `bench` with a random secret, allowed the load generator's keys (job:N).
make_identities() {
    SECRET=$(openssl rand -hex 16)
    local hash
    hash=$(printf '%s\n' "$SECRET" | "$TENURED" hash-secret)
    printf '[[identity]]\nname = "bench"\nsecret-hash = "%s"\nprefixes = ["job:"]\n' \
        "$hash" >"$WORK/identities.toml"
}

make_certificates
make_identities
for v in "${VARIANTS[@]}"; do
    flags=(--listen "127.0.0.1:${PORT[$v]}" --data-dir "$WORK/data.$v"
           --durability tokens --no-fsync --threads 1)
    [[ $v == *tls* ]] && flags+=(--tls-cert "$WORK/server.pem" --tls-key "$WORK/server.key")
    [[ $v == *auth* ]] && flags+=(--identities "$WORK/identities.toml")
    RUST_LOG=warn "$TENURED" "${flags[@]}" >"$WORK/tenured.$v.log" 2>&1 &
    PID[$v]=$!
done
for v in "${VARIANTS[@]}"; do wait_port "${PORT[$v]}" "log: $WORK/tenured.$v.log"; done

# run NAME VARIANT LOADGEN-ARGS... : writes $WORK/NAME.VARIANT.json
run() {
    local name=$1 v=$2
    shift 2
    local flags=(--target "tenure://127.0.0.1:${PORT[$v]}" --server-pid "${PID[$v]}")
    [[ $v == *tls* ]] && flags+=(--tls-ca "$WORK/ca.pem")
    echo "== $name on $v: $*" >&2
    if [[ $v == *auth* ]]; then
        # The secret goes through the environment, never the command line.
        TENURE_SECRET=$SECRET "$LOADGEN" "${flags[@]}" --identity bench --json --quiet "$@" \
            >"$WORK/$name.$v.json"
    else
        "$LOADGEN" "${flags[@]}" --json --quiet "$@" >"$WORK/$name.$v.json"
    fi
}

LOAD_START=$(cut -d' ' -f1-3 /proc/loadavg)
for pipe in 1 16; do
    for v in "${VARIANTS[@]}"; do
        run "mixed-p$pipe" "$v" --scenario max --op mixed --connections "$CONNECTIONS" \
            --pipeline "$pipe" --duration "$DURATION" --warmup 1s
    done
done
for v in "${VARIANTS[@]}"; do
    run estimate "$v" --scenario estimate --rate 50000 --hold 10s --renew-every 10s --ttl 30s \
        --duration "$ESTIMATE_DURATION" --warmup 1s --connections 16 --pipeline 256
    # The estimate leaves 500K locks held; stopped now, this server cannot spend the next
    # variant's run expiring them.
    kill "${PID[$v]}" && wait "${PID[$v]}" 2>/dev/null || true
    unset "PID[$v]"
done
LOAD_END=$(cut -d' ' -f1-3 /proc/loadavg)

ops_per_s() {
    local total=0 kind rate
    for kind in acquire renew release; do
        rate=$(field "$1" "$kind" rate_per_s)
        total=$(awk -v a="$total" -v b="${rate:-0}" 'BEGIN { print a + b }')
    done
    printf "%.0f" "$total"
}
# num X: X rounded for the table (more decimals for small values), or "-" when missing.
num() {
    [[ -n $1 ]] || { echo "-"; return; }
    awk -v x="$1" 'BEGIN { a = x < 0 ? -x : x
        if (a < 10) printf "%.2f", x; else if (a < 100) printf "%.1f", x; else printf "%.0f", x }'
}

echo
echo "tenured --durability tokens --no-fsync --threads 1; ECDSA P-256 certificate; TLS 1.3"
echo "load average before / after the runs: $LOAD_START / $LOAD_END" \
    "(anything else running skews the figures, tails most)"
echo "vs pl: ops/s over plain's; p50/p99/p99.9: acquire latency from intended send, us;"
echo "set50/setmax: connect to ready per connection, ms (tls50, auth50: its TLS and AUTH parts);"
echo "srvcpu/lgcpu: % of a core, server and load generator; srv/op: server CPU us per op"
printf "%-10s %-9s %8s %6s %6s %6s %6s %6s %6s %6s %6s %6s %7s %6s\n" scenario variant ops/s \
    "vs pl" p50 p99 p99.9 "set50" "setmax" "tls50" "auth50" "srvcpu" "srv/op" "lgcpu"
for name in mixed-p1 mixed-p16 estimate; do
    base=""
    for v in "${VARIANTS[@]}"; do
        file=$WORK/$name.$v.json
        ops=$(ops_per_s "$file")
        base=${base:-$ops}
        ratio=$(awk -v a="$ops" -v b="$base" 'BEGIN { if (b > 0) printf "%.3f", a / b; else print "-" }')
        cpu=$(field "$file" resources server_cpu_pct_of_core)
        per_op=$(awk -v c="${cpu:-0}" -v o="$ops" 'BEGIN { if (o > 0) printf "%.2f", c * 1e4 / o }')
        printf "%-10s %-9s %8s %6s %6s %6s %6s %6s %6s %6s %6s %6s %7s %6s\n" "$name" "$v" "$ops" "$ratio" \
            "$(num "$(field "$file" acquire p50_us)")" \
            "$(num "$(field "$file" acquire p99_us)")" \
            "$(num "$(field "$file" acquire p999_us)")" \
            "$(num "$(field "$file" setup connect_to_ready_p50_ms)")" \
            "$(num "$(field "$file" setup connect_to_ready_max_ms)")" \
            "$(num "$(field "$file" setup tls_handshake_p50_ms)")" \
            "$(num "$(field "$file" setup auth_p50_ms)")" \
            "$(num "$cpu")" "$per_op" \
            "$(num "$(field "$file" resources loadgen_cpu_pct_of_core)")"
    done
done
echo "(mixed: ops/s counts acquire, renew and release, three per cycle)"
