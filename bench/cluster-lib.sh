# A 3-node tenure cluster on loopback for the cluster scripts in bench/ (sourced, not run).
# The sourcing script sets ROOT and WORK (a fresh directory) and calls cluster_start; every
# process started here is ended by PID in cluster_stop (the script's EXIT trap must call it).
#
# Node i (0-based, id i+1) listens for clients on 127.0.0.1:${C_CLIENT[i]}, for its peers on
# 127.0.0.$((i+2)):${C_PEER[i]} (its peer connections leave from that address), and serves
# /metrics on 127.0.0.1:${C_METRICS[i]}. With PROXY=1 the membership names a proxy
# (bench/peer-proxy.py, on 127.0.0.1:${C_PROXY[i]}) in front of every peer listener, so
# cluster_cut N / cluster_heal can partition node N. TENURE_ARGS (unquoted) goes to every node;
# TENURED names the binary (default target/release/tenured).

# shellcheck source=bench/lib.sh
source "$ROOT/bench/lib.sh"
TENURED=${TENURED:-$ROOT/target/release/tenured}
LOADGEN=$ROOT/target/release/tenure-loadgen
C_CLIENT=(17981 17982 17983)
C_PEER=(17991 17992 17993)
C_METRICS=(17961 17962 17963)
C_PROXY=(17971 17972 17973)
C_PID=("" "" "")
PROXY_PID=""

cluster_check_ports() {
    local port i
    for port in "${C_CLIENT[@]}" "${C_METRICS[@]}" "${C_PROXY[@]}"; do
        if port_open "$port"; then echo "port $port is already in use" >&2; exit 1; fi
    done
    for i in 0 1 2; do
        if (exec 3<>"/dev/tcp/127.0.0.$((i + 2))/${C_PEER[i]}") 2>/dev/null; then
            echo "port 127.0.0.$((i + 2)):${C_PEER[i]} is already in use" >&2; exit 1
        fi
    done
    for bin in "$TENURED" "$LOADGEN"; do
        [[ -x $bin ]] || { echo "missing $bin (cargo build --release)" >&2; exit 1; }
    done
}

# The membership: every node's peer address is its own listener, or the proxy's with PROXY=1.
cluster_members() {
    local i members="" peer
    for i in 0 1 2; do
        if [[ -n ${PROXY:-} ]]; then peer=127.0.0.1:${C_PROXY[i]}; else peer=127.0.0.$((i + 2)):${C_PEER[i]}; fi
        members+="${members:+,}$((i + 1))=$peer/127.0.0.1:${C_CLIENT[i]}"
    done
    echo "$members"
}

cluster_start_node() {
    local i=$1
    RUST_LOG=${TENURE_LOG:-warn} "$TENURED" --cluster --node-id $((i + 1)) \
        --peer-listen "127.0.0.$((i + 2)):${C_PEER[i]}" --listen "127.0.0.1:${C_CLIENT[i]}" \
        --metrics-listen "127.0.0.1:${C_METRICS[i]}" --data-dir "$WORK/node$i" \
        --initial-cluster "$(cluster_members)" ${TENURE_ARGS:-} >>"$WORK/node$i.log" 2>&1 &
    C_PID[i]=$!
    disown "${C_PID[i]}"
}

cluster_start() {
    local i
    cluster_check_ports
    if [[ -n ${PROXY:-} ]]; then
        : >"$WORK/cut"
        local pairs=()
        for i in 0 1 2; do pairs+=("127.0.0.1:${C_PROXY[i]}=127.0.0.$((i + 2)):${C_PEER[i]}"); done
        python3 "$ROOT/bench/peer-proxy.py" "$WORK/cut" "${pairs[@]}" >"$WORK/proxy.log" 2>&1 &
        PROXY_PID=$!
        disown "$PROXY_PID"
        for i in 0 1 2; do wait_port "${C_PROXY[i]}" "proxy $i"; done
    fi
    for i in 0 1 2; do rm -rf "$WORK/node$i"; cluster_start_node "$i"; done
    for i in 0 1 2; do wait_port "${C_CLIENT[i]}" "tenured $i"; done
    cluster_healthy >/dev/null
}

# Ends PID and polls until it is gone (10 s at most, then kill -9).
cluster_stop_pid() {
    kill "$1" 2>/dev/null || return 0
    for _ in $(seq 100); do kill -0 "$1" 2>/dev/null || return 0; sleep 0.1; done
    kill -9 "$1" 2>/dev/null || true
}

cluster_stop() {
    local i
    for i in 0 1 2; do [[ -n ${C_PID[i]} ]] && cluster_stop_pid "${C_PID[i]}"; C_PID[i]=""; done
    [[ -n $PROXY_PID ]] && cluster_stop_pid "$PROXY_PID"
    PROXY_PID=""
}

cluster_target() { echo "tenure://127.0.0.1:${C_CLIENT[0]},127.0.0.1:${C_CLIENT[1]},127.0.0.1:${C_CLIENT[2]}"; }

# Waits (60 s at most) until every member answers and one serves; prints the loadgen's line.
cluster_healthy() {
    "$LOADGEN" --target "$(cluster_target)" --scenario healthy --duration 60s || {
        echo "the cluster did not become healthy; logs in $WORK" >&2
        tail -5 "$WORK"/node*.log >&2
        exit 1
    }
}

# The index (0-2) of the node serving now.
cluster_leader() {
    local addr i
    addr=$(cluster_healthy | grep -o '"leader":"[^"]*"' | cut -d'"' -f4)
    for i in 0 1 2; do [[ ${addr##*:} == "${C_CLIENT[i]}" ]] && echo "$i"; done
    return 0
}

# metric I NAME: the value of series NAME (no labels) on node I, rounded to a whole number;
# empty if the node does not answer.
metric() {
    curl -s --max-time 2 "http://127.0.0.1:${C_METRICS[$1]}/metrics" |
        awk -v n="$2" '$1 == n { printf "%.0f\n", $2; exit }'
}

# What every node reports now, one line: term, leader, leader changes and elections seen.
cluster_view() {
    local i out=""
    for i in 0 1 2; do
        out+="n$((i + 1)):term=$(metric "$i" tenure_cluster_term),leader=$(metric "$i" tenure_cluster_leader_id)"
        out+=",changes=$(metric "$i" tenure_cluster_leader_changes_total)"
        out+=",elections=$(metric "$i" tenure_cluster_elections_started_total) "
    done
    echo "$out"
}

# The highest term any node reports.
cluster_term() {
    local i t max=0
    for i in 0 1 2; do t=$(metric "$i" tenure_cluster_term); [[ -n $t && $t -gt $max ]] && max=$t; done
    echo "$max"
}

cluster_cut() { echo "$1" >"$WORK/cut"; }
cluster_heal() { : >"$WORK/cut"; }

# tail_counts I SERIES: "n, >50ms a, >100ms b, >250ms c, >500ms d" of histogram SERIES (base name)
# on node I, from its cumulative buckets.
tail_counts() {
    curl -s --max-time 2 "http://127.0.0.1:${C_METRICS[$1]}/metrics" | awk -v s="$2" '
        $1 == s "_count" { n = $2 }
        $1 == s "_bucket{le=\"0.05\"}" { a = $2 }
        $1 == s "_bucket{le=\"0.1\"}" { b = $2 }
        $1 == s "_bucket{le=\"0.25\"}" { c = $2 }
        $1 == s "_bucket{le=\"0.5\"}" { d = $2 }
        END { printf "%d, >50ms %d, >100ms %d, >250ms %d, >500ms %d", n, n - a, n - b, n - c, n - d }'
}

# What the followers saw of their leader's AppendEntries: gaps between arrivals, and the
# time each one carrying entries took (write and fsync), one line per follower.
cluster_append_tails() {
    local i leader=$1
    for i in 0 1 2; do
        [[ $i == "$leader" ]] && continue
        echo "    n$((i + 1)) append gaps: $(tail_counts "$i" tenure_cluster_append_gap_seconds);" \
            "appends with entries: $(tail_counts "$i" tenure_cluster_append_duration_seconds);" \
            "heartbeats: $(tail_counts "$i" tenure_cluster_heartbeat_duration_seconds)"
    done
}
