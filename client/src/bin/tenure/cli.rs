//! The command line's grammar: clap definitions of every flag and subcommand, and the
//! parsers of their values (durations, lease ids).

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use tenure::duration::parse_duration_or_bare;
use tenure::{LeaseId, LeaseKind};

/// The `Exit codes:` section of `--help`; the codes are the `EXIT_*` constants in `exit.rs`.
const EXIT_CODES_HELP: &str = "\
Exit codes:
  0  success (run/elect: the command's own status; 128+N if signal N killed it)
  1  error: I/O, server error, bad arguments
  3  LOCKED: someone else holds the lock
  4  LOST: the lease is gone (run/elect: lost while the command ran; acquire: ENDED, a
     retried ACQUIRE whose lease had ended already)
  5  NOT_OWNER: the lease id does not hold the lock
  6  STALE: the token does not belong to the live holder";

/// Talk to a tenure lock server.
#[derive(Parser, Debug)]
#[command(name = "tenure", version, after_help = EXIT_CODES_HELP)]
pub struct Cli {
    /// Server address; several separated by commas for a cluster (the leader is found).
    #[arg(
        long,
        global = true,
        env = "TENURE_ADDR",
        default_value = "127.0.0.1:7878"
    )]
    pub addr: String,
    /// Print JSON objects instead of key=value lines.
    #[arg(long, global = true)]
    pub json: bool,
    /// Longest wait for one answer (a blocking acquire adds its wait; `cluster add` and
    /// `cluster remove` wait at least 60 s), connecting included. An acquire whose outcome
    /// is unknown (no answer, a lost connection, no leader found) is sent again, with its
    /// acquire id, for up to 15 s after the first send or this, whichever is longer.
    #[arg(long, global = true, value_parser = duration_flag, default_value = "5s")]
    pub timeout: Duration,
    /// Longest wait for one address to connect and open (TCP, TLS handshake, the protocol's
    /// opening and AUTH), at most --timeout: past it the next address is tried. Nothing has
    /// been sent then, so a stopped or hung node costs this, not the whole --timeout.
    #[arg(long, global = true, value_parser = duration_flag, default_value = "1s")]
    pub connect_timeout: Duration,
    /// Authenticate as this identity; the secret is read from the TENURE_SECRET environment
    /// variable (never from the command line, which other users can read).
    #[arg(long, global = true, env = "TENURE_IDENTITY")]
    pub identity: Option<String>,
    /// Speak TLS, trusting only the CA certificates in this PEM file.
    #[arg(long, global = true, env = "TENURE_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
    /// Client certificate (PEM, leaf first) for a server that requires mutual TLS; needs
    /// --tls-ca and --tls-client-key.
    #[arg(
        long,
        global = true,
        env = "TENURE_TLS_CLIENT_CERT",
        requires = "tls_client_key"
    )]
    pub tls_client_cert: Option<PathBuf>,
    /// The private key of --tls-client-cert (PEM).
    #[arg(
        long,
        global = true,
        env = "TENURE_TLS_CLIENT_KEY",
        requires = "tls_client_cert"
    )]
    pub tls_client_key: Option<PathBuf>,
    /// The name the server's certificate must carry (default: the host of --addr).
    #[arg(long, global = true, env = "TENURE_TLS_SERVER_NAME")]
    pub tls_server_name: Option<String>,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// One subcommand.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Take a lock; prints the fencing token and the lease id.
    Acquire {
        /// The lock's name.
        key: String,
        /// Lease length, e.g. 30s, 500ms, 2m.
        #[arg(long, value_parser = duration_flag)]
        ttl: Duration,
        /// How long to wait in line if the lock is held.
        #[arg(long, value_parser = duration_flag, default_value = "0ms")]
        wait: Duration,
        /// Holder metadata shown by inspect and watchers.
        #[arg(long)]
        meta: Option<String>,
        /// A read lease or semaphore permits instead of the key alone.
        #[command(flatten)]
        kind: KindArgs,
    },
    /// Extend a lease.
    Renew {
        /// The lock's name.
        key: String,
        /// The lease id printed by acquire (32 hex digits).
        #[arg(value_parser = parse_lease_id)]
        lease: LeaseId,
        /// New lease length from now.
        #[arg(long, value_parser = duration_flag)]
        ttl: Duration,
    },
    /// Give a lock back.
    Release {
        /// The lock's name.
        key: String,
        /// The lease id printed by acquire.
        #[arg(value_parser = parse_lease_id)]
        lease: LeaseId,
    },
    /// Show who holds a lock.
    Inspect {
        /// The lock's name.
        key: String,
        /// For a read/write or semaphore key, add its limit, holders, permits in use, writer
        /// and waiters by kind.
        #[arg(long)]
        kinds: bool,
    },
    /// Ask whether a fencing token belongs to the live holder.
    Check {
        /// The lock's name.
        key: String,
        /// The fencing token.
        token: u64,
    },
    /// Print the server's counters.
    Stats,
    /// Measure a round trip.
    Ping,
    /// Hold a lock (in a session of its own, or with --no-session a lease renewed alone)
    /// while a command runs; kill the command if the lock is lost.
    Run(RunArgs),
    /// Run a command only while leading an election group (in a session of its own, or with
    /// --no-session as a lease renewed alone).
    Elect(ElectArgs),
    /// Print every new leader of an election group.
    Observe {
        /// The election group.
        group: String,
    },
    /// Read text-console commands from stdin, one per line, over one connection, in the
    /// server's console grammar (`ACQUIRE <key> <ttl_ms> [<wait_ms>]`, `RELEASE <key> <lease>`,
    /// ..., see PROTOCOL.md section 4 or type HELP); prints one line per answer.
    Console,
    /// Cluster mode: a node's status, and the membership (init, add, remove).
    #[command(subcommand)]
    Cluster(crate::cluster::ClusterCommand),
    /// Make a development CA and certificates for a secure cluster: one per node for peer
    /// TLS (node-<id>.tenure), and with --server one for the client ports. Connects to
    /// nothing.
    Certs(crate::certs::CertsArgs),
}

/// Flags of `tenure run`.
#[derive(Args, Debug)]
pub struct RunArgs {
    /// The lock's name (or give it as KEY, before `--`).
    #[arg(long = "key", value_name = "KEY")]
    pub key_flag: Option<String>,
    /// The lock's name, as --key gives it.
    #[arg(
        value_name = "KEY",
        conflicts_with = "key_flag",
        required_unless_present = "key_flag"
    )]
    pub key_arg: Option<String>,
    /// The TTL of the session the lock is held in (one keep-alive every third of it); with
    /// --no-session, the lease length, renewed every third of it while the command runs.
    #[arg(long, value_parser = duration_flag)]
    pub ttl: Duration,
    /// How long to wait in line if the lock is held.
    #[arg(long, value_parser = duration_flag, default_value = "0ms")]
    pub wait: Duration,
    /// Holder metadata shown by inspect and watchers.
    #[arg(long)]
    pub meta: Option<String>,
    /// A read lease or semaphore permits instead of the key alone.
    #[command(flatten)]
    pub kind: KindArgs,
    /// Time between SIGTERM and SIGKILL to the command's process group when it is stopped (lock
    /// lost, a signal to tenure, tenure's death, leftovers after the command exits).
    #[arg(long, value_parser = grace_flag, default_value = "5s")]
    pub grace: Duration,
    /// Hold the lock in a session of its own (the default; the flag is accepted as before).
    /// The session survives a server restart and a cluster's fail-over. Against a server
    /// without sessions, a lease renewed alone, with a warning.
    #[arg(long)]
    pub session: bool,
    /// Hold a lease renewed alone instead of a lock in a session (the behaviour before
    /// sessions were the default).
    #[arg(long, conflicts_with = "session")]
    pub no_session: bool,
    /// The command and its arguments (after `--`). It gets TENURE_FENCING_TOKEN,
    /// TENURE_LEASE_ID and TENURE_KEY in its environment, and TENURE_SESSION_ID when the
    /// lock is held in a session. At a terminal it is the foreground job: it reads the
    /// terminal, and Ctrl-C and Ctrl-Z reach it.
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
}

impl RunArgs {
    /// The lock's name, from --key or KEY (clap makes sure there is exactly one).
    pub fn key(&self) -> &str {
        self.key_flag
            .as_deref()
            .or(self.key_arg.as_deref())
            .expect("clap requires --key or KEY")
    }
}

/// `--permits` and `--shared` of `acquire` and `run` (PROTOCOL.md 3.10).
#[derive(Args, Debug, Default, Clone, Copy)]
pub struct KindArgs {
    /// Take permits of a counting semaphore of LIMIT permits: one (`--permits 4`) or COUNT of
    /// them as one lease (`--permits 2/4`). At most LIMIT permits are held at once.
    #[arg(long, value_name = "[COUNT/]LIMIT", value_parser = parse_permits)]
    pub permits: Option<LeaseKind>,
    /// Take a read lease: readers hold the key together; a plain acquire of it is the
    /// writer, alone.
    #[arg(long, conflicts_with = "permits")]
    pub shared: bool,
}

impl KindArgs {
    /// The lease kind the flags ask for: permits, shared, or the key alone.
    pub fn kind(self) -> LeaseKind {
        match (self.permits, self.shared) {
            (Some(permits), _) => permits,
            (None, true) => LeaseKind::Shared,
            (None, false) => LeaseKind::Exclusive,
        }
    }
}

/// Parses `--permits`: `LIMIT` (one permit of LIMIT) or `COUNT/LIMIT`, checked against the
/// protocol's range.
pub fn parse_permits(text: &str) -> Result<LeaseKind, String> {
    let number = |part: &str| {
        part.trim()
            .parse::<u32>()
            .map_err(|_| format!("{text:?} is not LIMIT or COUNT/LIMIT (whole numbers)"))
    };
    let (count, limit) = match text.split_once('/') {
        Some((count, limit)) => (number(count)?, number(limit)?),
        None => (1, number(text)?),
    };
    let kind = LeaseKind::Permits { count, limit };
    kind.validate().map_err(|e| e.message)?;
    Ok(kind)
}

/// Flags of `tenure elect`.
#[derive(Args, Debug)]
pub struct ElectArgs {
    /// The election group.
    pub group: String,
    /// This candidate's value (for example its address), shown to observers.
    #[arg(long)]
    pub value: String,
    /// The leader's lease length (a hung or cut-off leader leads at most this long
    /// unconfirmed): the TTL of the leader's session, or with --no-session of its lease.
    #[arg(long, value_parser = duration_flag, default_value = "10s")]
    pub ttl: Duration,
    /// Lead with a lock in a session of its own (the default; the flag is accepted as
    /// before): leadership lasts while the session does, through a server restart and a
    /// cluster's fail-over. Against a server without sessions, a lease renewed alone, with a
    /// warning.
    #[arg(long)]
    pub session: bool,
    /// Lead with a lease renewed alone instead (the behaviour before sessions were the
    /// default: release on disconnect given one address).
    #[arg(long, conflicts_with = "session")]
    pub no_session: bool,
    /// Time between SIGTERM and SIGKILL to the command's process group when it is stopped
    /// (leadership lost, a signal to tenure, tenure's death).
    #[arg(long, value_parser = grace_flag, default_value = "5s")]
    pub grace: Duration,
    /// The command and its arguments (after `--`). It gets TENURE_FENCING_TOKEN (the term),
    /// TENURE_LEASE_ID and TENURE_KEY in its environment, and TENURE_SESSION_ID when
    /// leading in a session. At a terminal it is the foreground job, as with `run`.
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
}

/// Parses a lease id as printed by acquire: 32 hex digits.
pub fn parse_lease_id(text: &str) -> Result<LeaseId, String> {
    LeaseId::from_hex(text).ok_or_else(|| format!("{text:?} is not a 32-digit hex lease id"))
}

/// Parses a duration flag (`30s`, `500ms`, `1m30s`; see `tenure::duration`). A bare number is
/// still read as milliseconds, its meaning before units were required, with a deprecation
/// note on stderr so that scripts keep working while their authors are told.
/// Longest `--grace`: a command that ignores SIGTERM may run this long after its lock was
/// lost, and `tenure` itself waits it out. An hour is past any honest clean-up, and far from
/// the guardian's own limits (its argument is in whole milliseconds, a `u64`).
pub const GRACE_MAX: Duration = Duration::from_secs(3600);

/// `--grace`: a duration of at most [`GRACE_MAX`].
pub fn grace_flag(text: &str) -> Result<Duration, String> {
    let grace = duration_flag(text)?;
    if grace > GRACE_MAX {
        return Err(format!(
            "at most {}s (the command may run this long after its lock is lost)",
            GRACE_MAX.as_secs()
        ));
    }
    Ok(grace)
}

pub fn duration_flag(text: &str) -> Result<Duration, String> {
    let parsed =
        parse_duration_or_bare(text, Duration::from_millis(1)).map_err(|e| e.to_string())?;
    if parsed.bare {
        let number = text.trim();
        eprintln!(
            "warning: duration {number:?} has no unit; read as milliseconds ({number}ms), \
             deprecated: write the unit"
        );
    }
    Ok(parsed.duration)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grace_is_capped() {
        let run = |grace: &str| {
            Cli::try_parse_from([
                "tenure", "run", "k", "--ttl", "1s", "--grace", grace, "--", "true",
            ])
            .map(|_| ())
            .map_err(|e| e.to_string())
        };
        assert_eq!(run("1h"), Ok(()));
        let refused = run("61m").unwrap_err();
        assert!(refused.contains("at most 3600s"), "{refused}");
        assert!(run("100000000000000000h").is_err());
    }

    #[test]
    fn parses_run_and_rejects_bad_durations() {
        let cli = Cli::try_parse_from([
            "tenure", "--addr", "h:1", "run", "--key", "k", "--ttl", "300ms", "--", "sh", "-c",
            "exit 7",
        ])
        .expect("valid command line");
        match cli.command {
            Command::Run(args) => {
                assert_eq!(args.key(), "k");
                assert_eq!(args.kind.kind(), LeaseKind::Exclusive);
                assert_eq!(args.ttl, Duration::from_millis(300));
                assert_eq!(args.command, ["sh", "-c", "exit 7"]);
            }
            other => panic!("parsed as {other:?}"),
        }
        assert!(Cli::try_parse_from(["tenure", "acquire", "k", "--ttl", "10q"]).is_err());
        assert!(Cli::try_parse_from(["tenure", "release", "k", "not-hex"]).is_err());
    }

    #[test]
    fn run_takes_the_key_as_an_argument_and_a_kind() {
        let cli = Cli::try_parse_from([
            "tenure",
            "run",
            "--permits",
            "2/4",
            "--ttl",
            "1s",
            "pool",
            "--",
            "true",
        ])
        .expect("valid command line");
        match cli.command {
            Command::Run(args) => {
                assert_eq!(args.key(), "pool");
                let kind = LeaseKind::Permits { count: 2, limit: 4 };
                assert_eq!(args.kind.kind(), kind);
                assert_eq!(args.command, ["true"]);
            }
            other => panic!("parsed as {other:?}"),
        }
        let shared = [
            "tenure", "run", "--shared", "--ttl", "1s", "doc", "--", "true",
        ];
        match Cli::try_parse_from(shared).expect("valid").command {
            Command::Run(args) => assert_eq!(args.kind.kind(), LeaseKind::Shared),
            other => panic!("parsed as {other:?}"),
        }
        let refused: [&[&str]; 5] = [
            &["tenure", "run", "--ttl", "1s", "--", "true"],
            &[
                "tenure", "run", "--key", "a", "--ttl", "1s", "b", "--", "true",
            ],
            &[
                "tenure",
                "acquire",
                "k",
                "--ttl",
                "1s",
                "--shared",
                "--permits",
                "2",
            ],
            &["tenure", "acquire", "k", "--ttl", "1s", "--permits", "0"],
            &["tenure", "acquire", "k", "--ttl", "1s", "--permits", "5/4"],
        ];
        for line in refused {
            assert!(Cli::try_parse_from(line).is_err(), "{line:?}");
        }
    }

    #[test]
    fn a_bare_duration_is_still_milliseconds() {
        let cli = Cli::try_parse_from(["tenure", "acquire", "k", "--ttl", "1500", "--wait", "2s"])
            .expect("bare numbers are deprecated, not refused");
        match cli.command {
            Command::Acquire { ttl, wait, .. } => {
                assert_eq!(ttl, Duration::from_millis(1500));
                assert_eq!(wait, Duration::from_secs(2));
            }
            other => panic!("parsed as {other:?}"),
        }
        assert_eq!(duration_flag("1.5"), Ok(Duration::from_micros(1500)));
        assert_eq!(duration_flag("250us"), Ok(Duration::from_micros(250)));
    }
}
