#!/usr/bin/env bash
# Two builds of tenured, A and B, in interleaved pairs (A B, B A, A B, ...): mixed cycles at 50
# connections, unpipelined and 16 deep, each run on a fresh server. Prints every pair and the
# median of the per-pair ratios B/A, which holds when the machine's speed drifts.
#
#   bench/ab-builds.sh OLD/tenured NEW/tenured            # PAIRS=5, DURATION=5s by default
#   PAIRS=7 TENURED_ARGS="--durability tokens --no-fsync --threads 1" bench/ab-builds.sh A B
#
# The load generator is LOADGEN (default target/release/tenure-loadgen), the same for both;
# B_LOADGEN_ARGS are more load generator flags for B's runs only, so one build against itself
# measures a client-side choice:
#   B_LOADGEN_ARGS=--acquire-ids bench/ab-builds.sh target/release/tenured target/release/tenured
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/lib.sh

A=${1:?usage: bench/ab-builds.sh A_TENURED B_TENURED}
B=${2:?usage: bench/ab-builds.sh A_TENURED B_TENURED}
PAIRS=${PAIRS:-5}
DURATION=${DURATION:-5s}
LOADGEN=${LOADGEN:-target/release/tenure-loadgen}
PORT=${PORT:-17931}
read -r -a EXTRA <<<"${TENURED_ARGS:---durability tokens --no-fsync --threads 1}"
read -r -a B_EXTRA <<<"${B_LOADGEN_ARGS:-}"

# one BIN PIPELINE [LOADGEN_ARGS...]: mixed cycles' ops/s of one run on a fresh server of BIN.
one() {
    local bin=$1 pipeline=$2 dir pid json
    shift 2
    dir=$(mktemp -d)
    "$bin" --listen "127.0.0.1:$PORT" --data-dir "$dir" "${EXTRA[@]}" >/dev/null 2>&1 &
    pid=$!
    wait_port "$PORT" "$bin"
    json=$("$LOADGEN" --target "tenure://127.0.0.1:$PORT" --scenario max --op mixed \
        --connections 50 --pipeline "$pipeline" --duration "$DURATION" --warmup 1s --quiet --json \
        "$@")
    kill -TERM "$pid"
    wait "$pid" || true
    rm -rf "$dir"
    grep -o '"ops_in_completed_cycles_per_s":[0-9.]*' <<<"$json" | cut -d: -f2
}

median() {
    printf "%s\n" "$@" | sort -g | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'
}

for pipeline in 1 16; do
    a_all=() b_all=() ratios=()
    for pair in $(seq "$PAIRS"); do
        # Alternate which build goes first, so neither always runs on a warmer machine.
        if ((pair % 2)); then a=$(one "$A" "$pipeline"); b=$(one "$B" "$pipeline" "${B_EXTRA[@]}")
        else b=$(one "$B" "$pipeline" "${B_EXTRA[@]}"); a=$(one "$A" "$pipeline"); fi
        ratio=$(awk -v a="$a" -v b="$b" 'BEGIN { printf "%.3f", b / a }')
        echo "pipeline $pipeline pair $pair: A $a  B $b  B/A $ratio"
        a_all+=("$a") b_all+=("$b") ratios+=("$ratio")
    done
    echo "pipeline $pipeline: median A $(median "${a_all[@]}")  median B $(median "${b_all[@]}")" \
        " median B/A $(median "${ratios[@]}") (pairs $(printf "%s\n" "${ratios[@]}" | sort -g |
        head -1)-$(printf "%s\n" "${ratios[@]}" | sort -g | tail -1))"
done
