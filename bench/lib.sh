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

# median NUMBERS...: the middle value (the lower middle of an even count).
median() {
    printf "%s\n" "$@" | sort -g | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'
}

# median_ci NUMBERS...: "LOW-HIGH", a 95 % confidence interval for the median that assumes
# nothing of the distribution (the order statistics a sign test gives: the k-th smallest
# and the k-th largest, k the largest with P(Binomial(n, 1/2) < k) <= 2.5 %). Pair ratios
# on this machine swing 0.7-1.4 from run to run, so a median means little without it.
# Fewer than 6 numbers have no such interval: "n/a".
median_ci() {
    printf "%s\n" "$@" | sort -g | awk '{ v[NR] = $1 } END {
        n = NR; p = 0.5 ^ n; cdf = 0; k = 0
        # cdf = P(X <= i); k grows while P(X <= k) stays within 2.5 %.
        for (i = 0; i < n; i++) { cdf += p; if (cdf > 0.025) break; k = i + 1; p = p * (n - i) / (i + 1) }
        if (k < 1) { print "n/a"; exit }
        print v[k] "-" v[n - k + 1] }'
}
