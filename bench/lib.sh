# Shared by the comparison scripts in bench/ (sourced, not run): ports and loadgen reports.

# port_open PORT: whether something listens on 127.0.0.1:PORT.
port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# wait_port PORT [WHAT]: waits up to 10 s for a listener on PORT, else exits naming WHAT.
wait_port() {
    for _ in $(seq 100); do port_open "$1" && return 0; sleep 0.1; done
    echo "nothing listens on port $1 after 10 s${2:+ ($2)}" >&2
    exit 1
}

# field FILE OBJECT KEY: a number from one flat object of a loadgen JSON report.
field() {
    local object
    object=$(grep -o "\"$2\":{[^}]*}" "$1" | head -1)
    grep -o "\"$3\":[-0-9.e]*" <<<"$object" | head -1 | cut -d: -f2
}
