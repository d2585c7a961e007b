//! Command-line flags and the run configuration they resolve to.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{ensure, Context};
use clap::{Parser, ValueEnum};
use tenure_protocol::duration::parse_duration_or_bare;
use tenure_protocol::LeaseKind;

/// Longest measured window a run accepts: every run stops by itself.
pub const DURATION_MAX: Duration = Duration::from_secs(3600);
/// Most connections one run opens.
pub const CONNECTIONS_MAX: usize = 4096;
/// Most requests in flight on one connection.
pub const PIPELINE_MAX: usize = 4096;
/// Most clients in the contention scenario.
pub const CLIENTS_MAX: usize = 100_000;
/// Most sessions one connection may open (the server's `SESSIONS_PER_CONNECTION_MAX`,
/// PROTOCOL.md 3.11): `--sessions` needs at least `N / 64` connections.
pub const SESSIONS_PER_CONNECTION_MAX: usize = 64;

/// Long help text: the crate docs' overview in brief.
pub const ABOUT: &str = "Load generator for the tenure lock server (and Redis, for comparison).

Scenarios:
  estimate    open loop at --rate acquires/s; each lock held --hold, renewed every
              --renew-every with --ttl, then released; ramp of --hold, --warmup, then
              --duration measured. Defaults: 50000/s, 10s hold, 30s TTL, renew 10s
              (500K locks held, 150K ops/s). Latency counts from intended send times.
              --sessions N --session-leases M: the same churn in N sessions (tenure)
              of --ttl, M locks each (N x M = --rate x --hold), no renewals: one
              SESSION_KEEPALIVE per session every --ttl / 3 instead.
  max         closed loop at --connections x --pipeline for --op acquire|mixed|renew|release|ping
  contention  --clients on --keys hot keys, blocking acquires (--wait), short --hold:
              hand-off latency and fairness (Jain's index)
  semaphore   contention for --keys semaphore keys of --permits [COUNT/]LIMIT permits
              (default 4), each held --hold: grants/s, hand-off latency, waits, and the
              most permits seen in use at once (never over LIMIT)
  read-mostly contention for --keys read/write keys: each acquire a read lease, or a
              write with probability --write-ratio (default 0.05), held --hold: grants/s,
              hand-off latency, reader and writer wait percentiles
  healthy     a cluster: wait until every member answers and one serves
  failover    a cluster: kill -9 the leader (--pids, in address order), time until a
              grant is served by the rest (attempts bounded by --attempt-timeout)

Targets: tenure://HOST:PORT or redis://HOST:PORT (SET NX PX + Lua compare-and-delete /
compare-and-pexpire; --redis-fenced adds a per-key INCR fencing token) or etcd://HOST:PORT
(v3 JSON gateway: lease grant + create-if-absent txn, keep-alive, revoke). A,B,C names a
cluster's members (tenure: the serving one is found when the run starts, and a
leader change ends the run, its connections closed: --scenario failover measures fail-overs;
etcd: spread over). Loopback only
unless --allow-remote. --server-pid PID reports the server's RSS growth and CPU.
tenure over TLS: --tls-ca FILE [--tls-server-name NAME] [--tls-client-cert FILE
--tls-client-key FILE]; AUTH on every connection: --identity NAME with the secret in
TENURE_SECRET. The report gives each connection's setup cost (connect to ready).";

/// Which workload to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Scenario {
    /// Open loop at a constant acquire rate; each lock is held, renewed, then released.
    Estimate,
    /// Closed loop as fast as `--connections` x `--pipeline` allows, for one `--op`.
    Max,
    /// Many clients, few hot keys, blocking acquires: hand-off latency and fairness.
    Contention,
    /// Contention for semaphore permits (`--permits`, default 4): at most LIMIT holders.
    Semaphore,
    /// Contention for read/write keys: read leases, and writes at `--write-ratio`.
    ReadMostly,
    /// Cluster: wait until healthy, kill the leader (`--pids`), time until a grant is served.
    Failover,
    /// Cluster: wait (up to `--duration`) until every member answers and one serves.
    Healthy,
}

/// The operation the `max` scenario drives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum MaxOp {
    /// Acquires on random keys of the key space; grants and refusals counted apart.
    Acquire,
    /// Acquire, renew, release cycles on fresh keys; only completed cycles count.
    Mixed,
    /// Renews of one held lock per in-flight slot.
    Renew,
    /// Releases of `--keys` locks taken beforehand (untimed).
    Release,
    /// Round trips that touch no lock.
    Ping,
}

/// Load generator for tenure and, for comparison, Redis.
#[derive(Debug, Parser)]
#[command(version, about, long_about = ABOUT)]
pub struct Args {
    /// Server to load: tenure://HOST:PORT or redis://HOST:PORT.
    #[arg(long, default_value = "tenure://127.0.0.1:7878")]
    pub target: String,
    /// Workload.
    #[arg(long, value_enum, default_value_t = Scenario::Estimate)]
    pub scenario: Scenario,
    /// Operation for `--scenario max`.
    #[arg(long, value_enum, default_value_t = MaxOp::Acquire)]
    pub op: MaxOp,
    /// estimate: acquires per second.
    #[arg(long, default_value_t = 50_000.0)]
    pub rate: f64,
    /// How long a lock is held before release [estimate: 10s, contention, semaphore,
    /// read-mostly: 1ms].
    #[arg(long, value_parser = parse_duration)]
    pub hold: Option<Duration>,
    /// Lease length asked for on acquire and renew.
    #[arg(long, value_parser = parse_duration, default_value = "30s")]
    pub ttl: Duration,
    /// estimate: renew period; a lock is renewed at every multiple of it up to `--hold`.
    #[arg(long, value_parser = parse_duration, default_value = "10s")]
    pub renew_every: Duration,
    /// Size of the key space [estimate: 2^40, max: 1000000, contention, semaphore,
    /// read-mostly: 4].
    #[arg(long)]
    pub keys: Option<u64>,
    /// TCP connections to the target.
    #[arg(long, default_value_t = 16)]
    pub connections: usize,
    /// Most requests in flight per connection (1 = unpipelined).
    #[arg(long, default_value_t = 64)]
    pub pipeline: usize,
    /// contention: clients competing for the hot keys (spread over the connections).
    #[arg(long, default_value_t = 64)]
    pub clients: usize,
    /// contention: how long a blocking acquire waits in line (tenure).
    #[arg(long, value_parser = parse_duration, default_value = "10s")]
    pub wait: Duration,
    /// contention against Redis, which cannot wait in line: delay before retrying a refusal.
    #[arg(long, value_parser = parse_duration, default_value = "1ms")]
    pub retry: Duration,
    /// Measured window [estimate: 30s, otherwise 10s].
    #[arg(long, value_parser = parse_duration)]
    pub duration: Option<Duration>,
    /// Unmeasured time before the window (after the estimate's ramp of `--hold`).
    #[arg(long, value_parser = parse_duration, default_value = "2s")]
    pub warmup: Duration,
    /// Scheduling tick: timed sends (open loop, holds, retries) happen on it.
    #[arg(long, value_parser = parse_duration, default_value = "100us")]
    pub tick: Duration,
    /// Longest wait for outstanding replies after the window closes.
    #[arg(long, value_parser = parse_duration, default_value = "5s")]
    pub drain: Duration,
    /// Redis: acquire with the fenced script (SET NX PX + INCR of a per-key counter).
    #[arg(long)]
    pub redis_fenced: bool,
    /// tenure: every ACQUIRE carries an acquire id (PROTOCOL.md 3.9), to measure its cost.
    #[arg(long)]
    pub acquire_ids: bool,
    /// Process id of the server when it runs on this machine: RSS and CPU are reported.
    #[arg(long)]
    pub server_pid: Option<u32>,
    /// Print the final report as JSON on stdout (progress still goes to stderr).
    #[arg(long)]
    pub json: bool,
    /// No progress line.
    #[arg(long)]
    pub quiet: bool,
    /// Allow a target that is not on loopback.
    #[arg(long)]
    pub allow_remote: bool,
    /// failover: the members' process ids, in the order of the target's addresses.
    #[arg(long, value_delimiter = ',')]
    pub pids: Vec<u32>,
    /// failover, healthy: how long one probe attempt (connect and acquire) may take.
    #[arg(long, value_parser = parse_duration, default_value = "250ms")]
    pub attempt_timeout: Duration,
    /// Seed for key choice and Redis lease values [random].
    #[arg(long)]
    pub seed: Option<u64>,
    /// Speak TLS to the target, trusting only the CA certificates in this PEM file.
    #[arg(long, value_name = "FILE")]
    pub tls_ca: Option<PathBuf>,
    /// Name the server's certificate must carry [the target's host].
    #[arg(long, value_name = "NAME", requires = "tls_ca")]
    pub tls_server_name: Option<String>,
    /// Mutual TLS: the client certificate chain to present (PEM, leaf first).
    #[arg(long, value_name = "FILE", requires_all = ["tls_ca", "tls_client_key"])]
    pub tls_client_cert: Option<PathBuf>,
    /// Mutual TLS: the private key of --tls-client-cert (PEM).
    #[arg(long, value_name = "FILE", requires_all = ["tls_ca", "tls_client_cert"])]
    pub tls_client_key: Option<PathBuf>,
    /// Authenticate every connection as this identity (AUTH right after the handshake); the
    /// secret is read from the environment variable TENURE_SECRET, never from a flag.
    #[arg(long, value_name = "NAME")]
    pub identity: Option<String>,
    /// tenure: every ACQUIRE asks for permits of a counting semaphore of LIMIT permits, one
    /// (`--permits 4`) or COUNT (`--permits 2/4`), instead of the key alone (PROTOCOL.md 3.10).
    #[arg(long, value_name = "[COUNT/]LIMIT", value_parser = parse_permits)]
    pub permits: Option<LeaseKind>,
    /// tenure: every ACQUIRE asks for a read lease, beside other readers.
    #[arg(long, conflicts_with = "permits")]
    pub shared: bool,
    /// read-mostly: the share of acquires that ask for a write lease (the rest read), 0..=1.
    #[arg(long, default_value_t = 0.05)]
    pub write_ratio: f64,
    /// estimate, tenure: acquire every lock in one of N sessions of --ttl (PROTOCOL.md 3.11),
    /// opened before the run, each kept alive every --ttl / 3; no lock is renewed.
    #[arg(long, value_name = "N")]
    pub sessions: Option<usize>,
    /// estimate with --sessions: the locks each session holds at once; N x M must equal
    /// --rate x --hold (the estimate's held locks) [--rate x --hold / N].
    #[arg(long, value_name = "M", requires = "sessions")]
    pub session_leases: Option<u64>,
}

/// The semaphore scenario's permits when `--permits` is not given: one of 4.
pub const SEMAPHORE_DEFAULT: LeaseKind = LeaseKind::Permits { count: 1, limit: 4 };

/// Parses `--permits`: `LIMIT` (one permit of LIMIT) or `COUNT/LIMIT`, in the protocol's range.
///
/// # Errors
/// For anything else.
pub fn parse_permits(text: &str) -> anyhow::Result<LeaseKind> {
    let number = |part: &str| {
        part.trim()
            .parse::<u32>()
            .with_context(|| format!("{text:?} is not LIMIT or COUNT/LIMIT"))
    };
    let (count, limit) = match text.split_once('/') {
        Some((count, limit)) => (number(count)?, number(limit)?),
        None => (1, number(text)?),
    };
    let kind = LeaseKind::Permits { count, limit };
    kind.validate().map_err(|e| anyhow::anyhow!(e.message))?;
    Ok(kind)
}

/// Parses a duration flag: `250us`, `1.5ms`, `10s`, `2m` ([`tenure_protocol::duration`]).
/// A bare number is still read as seconds, its meaning before units were required, with a
/// deprecation note on stderr.
///
/// # Errors
/// For anything else.
pub fn parse_duration(text: &str) -> anyhow::Result<Duration> {
    let parsed = parse_duration_or_bare(text, Duration::from_secs(1))?;
    if parsed.bare {
        eprintln!(
            "warning: duration {:?} has no unit; read as seconds ({}s), deprecated: write the unit",
            text.trim(),
            text.trim()
        );
    }
    Ok(parsed.duration)
}

/// Whole milliseconds of `d`, for wire fields.
///
/// # Errors
/// When it does not fit 32 bits.
pub fn millis_u32(d: Duration, flag: &str) -> anyhow::Result<u32> {
    u32::try_from(d.as_millis()).with_context(|| format!("{flag} is too long"))
}

impl Args {
    /// The kind every tenure ACQUIRE of the run asks for: `--permits`, `--shared`, or the key
    /// alone.
    pub fn lease_kind(&self) -> LeaseKind {
        match (self.permits, self.shared) {
            (Some(permits), _) => permits,
            (None, true) => LeaseKind::Shared,
            (None, false) => LeaseKind::Exclusive,
        }
    }

    /// Checks ranges and fills per-scenario defaults.
    ///
    /// # Errors
    /// For a flag out of range.
    pub fn resolve(mut self) -> anyhow::Result<Args> {
        self.fill_defaults();
        self.check_counts()?;
        self.check_times()?;
        self.check_kinds()?;
        ensure!(
            self.lease_kind().is_exclusive() || self.target.starts_with("tenure://"),
            "--permits and --shared are for tenure:// targets only"
        );
        if self.scenario == Scenario::Failover {
            ensure!(!self.pids.is_empty(), "--scenario failover needs --pids");
        }
        ensure!(
            self.tick >= Duration::from_micros(10) && self.tick <= Duration::from_millis(100),
            "--tick must be 10us..=100ms"
        );
        self.check_estimate()?;
        self.check_sessions()?;
        crate::wire::validate_limits(
            millis_u32(self.ttl, "--ttl")?,
            millis_u32(self.wait, "--wait")?,
        )?;
        Ok(self)
    }

    /// The kinds scenarios: tenure only, the semaphore with permits, read-mostly with neither
    /// flag (it picks the kind per acquire) and a ratio in range.
    fn check_kinds(&mut self) -> anyhow::Result<()> {
        let kinds = matches!(self.scenario, Scenario::Semaphore | Scenario::ReadMostly);
        ensure!(
            !kinds || self.target.starts_with("tenure://"),
            "--scenario semaphore and read-mostly are for tenure:// targets only"
        );
        match self.scenario {
            Scenario::Semaphore => {
                ensure!(
                    !self.shared,
                    "--scenario semaphore takes --permits, not --shared"
                );
                self.permits.get_or_insert(SEMAPHORE_DEFAULT);
            }
            Scenario::ReadMostly => ensure!(
                self.permits.is_none() && !self.shared,
                "--scenario read-mostly picks read or write per acquire: no --permits or --shared"
            ),
            _ => {}
        }
        ensure!(
            (0.0..=1.0).contains(&self.write_ratio),
            "--write-ratio must be 0..=1"
        );
        Ok(())
    }

    /// Whether the scenario is one of the contention family (blocking acquires by clients).
    pub fn contends(&self) -> bool {
        matches!(
            self.scenario,
            Scenario::Contention | Scenario::Semaphore | Scenario::ReadMostly
        )
    }

    /// The defaults that depend on the scenario: hold, key space and measured window.
    fn fill_defaults(&mut self) {
        let (hold, keys, duration) = match self.scenario {
            Scenario::Estimate => (10_000, 1 << 40, 30),
            Scenario::Max => (0, 1_000_000, 10),
            Scenario::Contention | Scenario::Semaphore | Scenario::ReadMostly => (1, 4, 10),
            Scenario::Failover | Scenario::Healthy => (0, 1, 30),
        };
        self.hold.get_or_insert(Duration::from_millis(hold));
        self.keys.get_or_insert(keys);
        self.duration.get_or_insert(Duration::from_secs(duration));
    }

    /// Connections, pipeline depth, clients and keys within their named maximums.
    fn check_counts(&self) -> anyhow::Result<()> {
        ensure!(
            (1..=CONNECTIONS_MAX).contains(&self.connections),
            "--connections must be 1..={CONNECTIONS_MAX}"
        );
        ensure!(
            (1..=PIPELINE_MAX).contains(&self.pipeline),
            "--pipeline must be 1..={PIPELINE_MAX}"
        );
        ensure!(
            (1..=CLIENTS_MAX).contains(&self.clients),
            "--clients must be 1..={CLIENTS_MAX}"
        );
        ensure!(
            self.keys() >= 1 && self.keys() <= 1 << 62,
            "--keys must be 1..=2^62"
        );
        Ok(())
    }

    /// Every duration bounded, so that every run stops by itself.
    fn check_times(&self) -> anyhow::Result<()> {
        ensure!(
            self.duration() <= DURATION_MAX,
            "--duration is over {DURATION_MAX:?}"
        );
        ensure!(
            self.warmup <= DURATION_MAX,
            "--warmup is over {DURATION_MAX:?}"
        );
        ensure!(
            self.drain <= DURATION_MAX,
            "--drain is over {DURATION_MAX:?}"
        );
        ensure!(
            self.hold() <= DURATION_MAX,
            "--hold is over {DURATION_MAX:?}"
        );
        ensure!(!self.duration().is_zero(), "--duration must be positive");
        ensure!(
            self.attempt_timeout >= Duration::from_millis(1)
                && self.attempt_timeout <= Duration::from_secs(60),
            "--attempt-timeout must be 1ms..=60s"
        );
        Ok(())
    }

    /// The open loop's rate and renewals within what one run can send.
    fn check_estimate(&self) -> anyhow::Result<()> {
        if self.scenario == Scenario::Estimate {
            ensure!(
                self.rate > 0.0 && self.rate <= 10_000_000.0,
                "--rate must be in (0, 1e7]"
            );
            ensure!(
                !self.renew_every.is_zero(),
                "--renew-every must be positive"
            );
            ensure!(
                self.hold().as_nanos() / self.renew_every.as_nanos() <= 64,
                "--hold / --renew-every is over 64 renews per lock"
            );
        }
        Ok(())
    }

    /// `--sessions` and `--session-leases`: for the estimate against tenure, within the
    /// connections' session limit, and consistent with the churn.
    fn check_sessions(&mut self) -> anyhow::Result<()> {
        let Some(sessions) = self.sessions else {
            return Ok(());
        };
        ensure!(
            self.scenario == Scenario::Estimate && self.target.starts_with("tenure://"),
            "--sessions is for --scenario estimate against tenure:// targets"
        );
        ensure!(sessions >= 1, "--sessions must be at least 1");
        ensure!(
            sessions <= SESSIONS_PER_CONNECTION_MAX * self.connections,
            "--sessions {sessions} needs --connections {} or more (a connection opens at most \
             {SESSIONS_PER_CONNECTION_MAX} sessions)",
            sessions.div_ceil(SESSIONS_PER_CONNECTION_MAX)
        );
        let held = (self.rate * self.hold().as_secs_f64()).round() as u64;
        let each = (held as f64 / sessions as f64).round() as u64;
        let asked = *self.session_leases.get_or_insert(each);
        ensure!(
            asked == each,
            "--sessions {sessions} x --session-leases {asked} is not --rate x --hold = {held} \
             held locks: --session-leases {each} fits"
        );
        Ok(())
    }

    /// `--sessions`, 0 without.
    pub fn sessions(&self) -> usize {
        self.sessions.unwrap_or(0)
    }

    /// `--hold` after [`Args::resolve`].
    pub fn hold(&self) -> Duration {
        self.hold.expect("resolved")
    }

    /// `--keys` after [`Args::resolve`].
    pub fn keys(&self) -> u64 {
        self.keys.expect("resolved")
    }

    /// `--duration` after [`Args::resolve`].
    pub fn duration(&self) -> Duration {
        self.duration.expect("resolved")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("10s").unwrap(), Duration::from_secs(10));
        assert_eq!(parse_duration("250us").unwrap(), Duration::from_micros(250));
        assert_eq!(
            parse_duration("1.5ms").unwrap(),
            Duration::from_micros(1500)
        );
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert_eq!(parse_duration("1h").unwrap(), Duration::from_secs(3600));
        assert!(parse_duration("5d").is_err());
        assert!(parse_duration("ms").is_err());
    }

    #[test]
    fn a_bare_number_is_still_seconds() {
        assert_eq!(parse_duration("10").unwrap(), Duration::from_secs(10));
        assert_eq!(parse_duration("0.5").unwrap(), Duration::from_millis(500));
        let args = Args::parse_from(["tenure-loadgen", "--duration", "3"]);
        assert_eq!(args.duration, Some(Duration::from_secs(3)));
    }

    #[test]
    fn defaults_resolve() {
        let args = Args::parse_from(["tenure-loadgen"]).resolve().unwrap();
        assert_eq!(args.hold(), Duration::from_secs(10));
        assert_eq!(args.keys(), 1 << 40);
        let args = Args::parse_from(["tenure-loadgen", "--scenario", "contention"])
            .resolve()
            .unwrap();
        assert_eq!(args.keys(), 4);
    }

    #[test]
    fn the_kinds_scenarios_resolve_and_refuse_what_does_not_fit() {
        let parse = |flags: &[&str]| {
            let mut argv = vec!["tenure-loadgen"];
            argv.extend_from_slice(flags);
            Args::parse_from(argv).resolve()
        };
        let semaphore = parse(&["--scenario", "semaphore"]).unwrap();
        assert_eq!(semaphore.lease_kind(), SEMAPHORE_DEFAULT);
        assert_eq!(
            (semaphore.keys(), semaphore.hold()),
            (4, Duration::from_millis(1))
        );
        let two_of_eight = parse(&["--scenario", "semaphore", "--permits", "2/8"]).unwrap();
        let wanted = LeaseKind::Permits { count: 2, limit: 8 };
        assert_eq!(two_of_eight.lease_kind(), wanted);
        let read_mostly = parse(&["--scenario", "read-mostly"]).unwrap();
        assert_eq!(read_mostly.lease_kind(), LeaseKind::Exclusive);
        assert!((read_mostly.write_ratio - 0.05).abs() < 1e-9);
        for bad in [
            &["--scenario", "semaphore", "--shared"][..],
            &["--scenario", "read-mostly", "--shared"],
            &["--scenario", "read-mostly", "--permits", "4"],
            &["--scenario", "read-mostly", "--write-ratio", "1.5"],
            &[
                "--scenario",
                "semaphore",
                "--target",
                "redis://127.0.0.1:6379",
            ],
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
    }
}
