#!/usr/bin/env bash
# Semaphore permits and read leases against plain locks (issue 26, "Performance"): mixed
# cycles (acquire, renew, release on fresh keys) at 50 connections, unpipelined and 16 deep,
# with ONE build of tenured and a fresh server per run. Each round runs every kind once, the
# order rotating from round to round; prints every run and, per kind, the median of the
# per-round ratios kind/plain, which holds when the machine's speed drifts.
#
#   bench/kinds.sh                         # ROUNDS=5, DURATION=5s, KINDS below
#   ROUNDS=7 KINDS="plain permits:4 shared" nice -n -20 bench/kinds.sh
#
# Kinds: plain (the key alone), permits:LIMIT or permits:COUNT/LIMIT (`--permits`), shared
# (`--shared`). TENURED (default target/release/tenured) and LOADGEN (default
# target/release/tenure-loadgen); tenured listens on 127.0.0.1:PORT only and is stopped by
# PID after each run.
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/lib.sh

case "${1:-}" in
    "") ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (try --help)" >&2; exit 2 ;;
esac

ROUNDS=${ROUNDS:-5}
DURATION=${DURATION:-5s}
TENURED=${TENURED:-target/release/tenured}
LOADGEN=${LOADGEN:-target/release/tenure-loadgen}
PORT=${PORT:-17933}
read -r -a KIND_LIST <<<"${KINDS:-plain permits:4 permits:64 shared}"
read -r -a EXTRA <<<"${TENURED_ARGS:---durability tokens --no-fsync --threads 1}"
[[ ${KIND_LIST[0]} == plain ]] || { echo "KINDS must start with plain" >&2; exit 2; }
for bin in "$TENURED" "$LOADGEN"; do
    [[ -x $bin ]] || { echo "missing $bin (cargo build --release)" >&2; exit 1; }
done
if port_open "$PORT"; then echo "port $PORT is already in use" >&2; exit 1; fi

PID=
DIR=
cleanup() {
    if [[ -n $PID ]]; then kill "$PID" 2>/dev/null && wait "$PID" 2>/dev/null || true; fi
    if [[ -n $DIR ]]; then rm -rf "$DIR"; fi
}
trap cleanup EXIT INT TERM

# kind_flags KIND: the load generator's flags for KIND.
kind_flags() {
    case $1 in
        plain) ;;
        shared) echo --shared ;;
        permits:*) echo --permits "${1#permits:}" ;;
        *) echo "unknown kind $1 (plain, permits:[COUNT/]LIMIT, shared)" >&2; exit 2 ;;
    esac
}

# one KIND PIPELINE: mixed cycles' ops/s of one run on a fresh server, in RESULT (not in a
# subshell, so that the trap sees PID).
one() {
    local kind=$1 pipeline=$2 json flags
    read -r -a flags <<<"$(kind_flags "$kind")"
    DIR=$(mktemp -d)
    "$TENURED" --listen "127.0.0.1:$PORT" --data-dir "$DIR" "${EXTRA[@]}" >/dev/null 2>&1 &
    PID=$!
    wait_port "$PORT" "$TENURED"
    json=$("$LOADGEN" --target "tenure://127.0.0.1:$PORT" --scenario max --op mixed \
        --connections 50 --pipeline "$pipeline" --duration "$DURATION" --warmup 1s --quiet \
        --json "${flags[@]}")
    kill -TERM "$PID"
    wait "$PID" || true
    PID=
    rm -rf "$DIR"
    DIR=
    RESULT=$(grep -o '"ops_in_completed_cycles_per_s":[0-9.]*' <<<"$json" | cut -d: -f2)
}

median() {
    printf "%s\n" "$@" | sort -g | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'
}

n=${#KIND_LIST[@]}
echo "tenured ${EXTRA[*]}; $(nproc) cores; load average $(cut -d' ' -f1-3 /proc/loadavg)"
for pipeline in 1 16; do
    declare -A ops=() ratios=()
    for round in $(seq "$ROUNDS"); do
        declare -A got=()
        # Rotate the order, so that no kind always runs first or on a warmer machine.
        for i in $(seq 0 $((n - 1))); do
            kind=${KIND_LIST[$(((i + round - 1) % n))]}
            one "$kind" "$pipeline"
            got[$kind]=$RESULT
        done
        line="pipeline $pipeline round $round:"
        for kind in "${KIND_LIST[@]}"; do
            ratio=$(awk -v a="${got[plain]}" -v b="${got[$kind]}" 'BEGIN { printf "%.3f", b / a }')
            ops[$kind]+="${got[$kind]} " ratios[$kind]+="$ratio "
            line+="  $kind ${got[$kind]}"
            [[ $kind == plain ]] || line+=" ($ratio)"
        done
        echo "$line"
        unset got
    done
    for kind in "${KIND_LIST[@]}"; do
        read -r -a o <<<"${ops[$kind]}"
        read -r -a r <<<"${ratios[$kind]}"
        echo "pipeline $pipeline $kind: median ops/s $(median "${o[@]}")  median ratio to plain" \
            "$(median "${r[@]}") (rounds $(printf "%s\n" "${r[@]}" | sort -g | head -1)-$(
                printf "%s\n" "${r[@]}" | sort -g | tail -1))"
    done
    unset ops ratios
done
echo "load average $(cut -d' ' -f1-3 /proc/loadavg)"
