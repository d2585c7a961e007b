//! The command line's grammar: clap definitions of every flag and subcommand, and the
//! parsers of their values (durations, lease ids).

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use tenure::duration::parse_duration_or_bare;
use tenure::LeaseId;

/// The `Exit codes:` section of `--help`; the codes are the `EXIT_*` constants in `exit.rs`.
const EXIT_CODES_HELP: &str = "\
Exit codes:
  0  success (run/elect: the command's own status; 128+N if signal N killed it)
  1  error: I/O, server error, bad arguments
  3  LOCKED: someone else holds the lock
  4  LOST: the lease is gone (run/elect: lost while the command ran)
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
    /// Longest wait for one answer (a blocking acquire adds its wait), and for connecting
    /// (TLS handshake and AUTH included).
    #[arg(long, global = true, value_parser = duration_flag, default_value = "5s")]
    pub timeout: Duration,
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
    /// Hold a lock (in a session of its own) while a command runs; kill the command if the
    /// lock is lost.
    Run(RunArgs),
    /// Run a command only while leading an election group (in a session of its own, so
    /// leadership rides through a cluster's fail-over).
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
}

/// Flags of `tenure run`.
#[derive(Args, Debug)]
pub struct RunArgs {
    /// The lock's name.
    #[arg(long)]
    pub key: String,
    /// TTL of the session the lock is held in (one keep-alive every third of it while the
    /// command runs); with --no-session, the lease length, renewed every third of it.
    #[arg(long, value_parser = duration_flag)]
    pub ttl: Duration,
    /// How long to wait in line if the lock is held.
    #[arg(long, value_parser = duration_flag, default_value = "0ms")]
    pub wait: Duration,
    /// Holder metadata shown by inspect and watchers.
    #[arg(long)]
    pub meta: Option<String>,
    /// Time between SIGTERM and SIGKILL when the lock is lost.
    #[arg(long, value_parser = duration_flag, default_value = "5s")]
    pub grace: Duration,
    /// Hold a lease renewed alone instead of a lock in a session of its own (as before
    /// sessions; also what happens, with a warning, against a server without sessions).
    #[arg(long)]
    pub no_session: bool,
    /// The command and its arguments (after `--`). It gets TENURE_FENCING_TOKEN,
    /// TENURE_LEASE_ID and TENURE_KEY in its environment, and TENURE_SESSION_ID when the
    /// lock is held in a session.
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
}

/// Flags of `tenure elect`.
#[derive(Args, Debug)]
pub struct ElectArgs {
    /// The election group.
    pub group: String,
    /// This candidate's value (for example its address), shown to observers.
    #[arg(long)]
    pub value: String,
    /// TTL of the leader's session (a hung or cut-off leader leads at most this long
    /// unconfirmed); with --no-session, the leader's lease length.
    #[arg(long, value_parser = duration_flag, default_value = "10s")]
    pub ttl: Duration,
    /// Lead with a lease renewed alone instead of a lock in a session (as before sessions:
    /// tied to its connection with one --addr, so it does not survive a fail-over).
    #[arg(long)]
    pub no_session: bool,
    /// Time between SIGTERM and SIGKILL when leadership is lost.
    #[arg(long, value_parser = duration_flag, default_value = "5s")]
    pub grace: Duration,
    /// The command and its arguments (after `--`). It gets TENURE_FENCING_TOKEN (the term),
    /// TENURE_LEASE_ID and TENURE_KEY in its environment, and TENURE_SESSION_ID when
    /// leading in a session.
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
    fn parses_run_and_rejects_bad_durations() {
        let cli = Cli::try_parse_from([
            "tenure", "--addr", "h:1", "run", "--key", "k", "--ttl", "300ms", "--", "sh", "-c",
            "exit 7",
        ])
        .expect("valid command line");
        match cli.command {
            Command::Run(args) => {
                assert_eq!(args.ttl, Duration::from_millis(300));
                assert_eq!(args.command, ["sh", "-c", "exit 7"]);
            }
            other => panic!("parsed as {other:?}"),
        }
        assert!(Cli::try_parse_from(["tenure", "acquire", "k", "--ttl", "10q"]).is_err());
        assert!(Cli::try_parse_from(["tenure", "release", "k", "not-hex"]).is_err());
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
