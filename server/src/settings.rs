//! `tenured`'s settings: command-line flags, `TENURE_*` environment variables and a TOML
//! config file, merged with the precedence flag > environment > file > default.
//!
//! Every setting is one field of [`Settings`], and so has one name in each place: the flag
//! `--ttl-max-ms`, the environment variable `TENURE_TTL_MAX_MS` and the config-file key
//! `ttl-max-ms` (kebab-case, as the flag is spelled). clap resolves flag > environment >
//! default and records which of them a value came from; a value that came from the flag or
//! the environment then replaces the file's key, and a file key replaces only a default.

use std::ffi::OsString;
use std::io::IsTerminal;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use clap::parser::ValueSource;
use clap::{ArgMatches, CommandFactory, FromArgMatches, Parser};
use serde::{Deserialize, Serialize};
use tenure_server::cluster::peer_tls::PeerTlsFiles;
use tenure_server::config::{Config, Durability};
use tenure_server::tls::TlsFiles;

/// tenured: a lock server with fencing tokens that survive crashes, on one node or as a Raft
/// cluster (--cluster).
#[derive(Parser, Debug)]
#[command(name = "tenured", version, about, long_about = None, after_help = PRECEDENCE_HELP)]
struct Cli {
    /// TOML file with any of the settings below, keys named as the flags (`held-max = 1000`).
    #[arg(long, env = "TENURE_CONFIG")]
    config: Option<PathBuf>,
    /// Print the settings in effect, as a config file, and exit.
    #[arg(long)]
    print_config: bool,
    #[command(flatten)]
    settings: Settings,
    #[command(subcommand)]
    command: Option<Subcommand>,
}

/// What `tenured` does instead of serving.
#[derive(clap::Subcommand, Debug, Clone, PartialEq, Eq)]
pub enum Subcommand {
    /// Read a secret from stdin (one line; the newline is not part of it) and print its
    /// argon2 hash, for the `secret-hash` key of an identities file. Never pass a secret as
    /// an argument: argv is readable by every user of the machine.
    HashSecret,
    /// Cluster mode: make `--nodes` the cluster's first membership, once, by asking the
    /// node at `--peer` (a peer address) to propose it.
    ClusterInit {
        /// The peer address of one of the nodes.
        #[arg(long)]
        peer: String,
        /// Every member: `1=<peer addr>/<client addr>,2=...`.
        #[arg(long)]
        nodes: String,
        /// With peer TLS: a certificate of the cluster's CA naming a node (any node's).
        #[arg(long, requires_all = ["peer_tls_key", "peer_tls_ca"])]
        peer_tls_cert: Option<PathBuf>,
        /// With peer TLS: the key of --peer-tls-cert.
        #[arg(long, requires = "peer_tls_cert")]
        peer_tls_key: Option<PathBuf>,
        /// With peer TLS: the cluster's CA certificate (PEM).
        #[arg(long, requires = "peer_tls_cert")]
        peer_tls_ca: Option<PathBuf>,
    },
}

const PRECEDENCE_HELP: &str = "Every flag can also be set by the environment variable \
    TENURE_<FLAG> (--ttl-max-ms is TENURE_TTL_MAX_MS) or by the key of the same name in the \
    --config file (ttl-max-ms = 30000). A flag beats the environment, which beats the file, \
    which beats the default.";

/// How log lines are written to stderr.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LogFormat {
    /// One human-readable line per event; coloured only when stderr is a terminal.
    Text,
    /// One JSON object per line, for log collectors.
    Json,
}

/// How connections are spread over threads (README "Running the server" says which fits).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RuntimeModel {
    /// One work-stealing runtime: its --threads workers run every connection.
    Shared,
    /// --threads threads, each a current-thread runtime with its own listener on the port
    /// (SO_REUSEPORT): the kernel spreads connections, and each stays on one thread.
    PerCore,
}

/// Every setting of `tenured`, as flags and as config-file keys.
// `default` lets a file set only some keys; `deny_unknown_fields` turns a misspelt key into an
// error rather than a setting silently left at its default.
#[derive(clap::Args, Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct Settings {
    /// Address to listen on, for both the binary protocol and the text console.
    #[arg(long, env = "TENURE_LISTEN", default_value_t = Settings::default().listen)]
    pub listen: SocketAddr,
    /// Address for HTTP `/metrics` (Prometheus), `/healthz` and `/readyz` (default: off).
    #[arg(long, env = "TENURE_METRICS_LISTEN")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metrics_listen: Option<SocketAddr>,
    /// Directory for the write-ahead log (created if missing).
    #[arg(long, env = "TENURE_DATA_DIR", default_value_os_t = Settings::default().data_dir)]
    pub data_dir: PathBuf,
    /// What survives a crash: `full` keeps every held lock; `tokens` keeps only the fencing
    /// token high-water mark and refuses grants for --ttl-max-ms after a restart.
    #[arg(long, env = "TENURE_DURABILITY", value_enum, default_value_t = Durability::Full)]
    pub durability: Durability,
    /// Skip fsync. Unsafe: a machine crash may then reuse fencing tokens. For benchmarks only.
    #[arg(long, env = "TENURE_NO_FSYNC")]
    pub no_fsync: bool,
    /// Most client connections at once.
    #[arg(
        long,
        env = "TENURE_CONNECTIONS_MAX",
        default_value_t = Settings::default().connections_max
    )]
    pub connections_max: usize,
    /// Most connections from one address that have not authenticated yet (with --identities
    /// or --tls-client-ca); one more closes the oldest of them. Together they may take at
    /// most half of --connections-max.
    #[arg(
        long,
        env = "TENURE_UNAUTHENTICATED_PER_ADDRESS_MAX",
        default_value_t = Settings::default().unauthenticated_per_address_max
    )]
    pub unauthenticated_per_address_max: usize,
    /// Most locks held at once.
    #[arg(long, env = "TENURE_HELD_MAX", default_value_t = Settings::default().held_max)]
    pub held_max: usize,
    /// Most blocking acquires waiting at once (0: no acquire waits; one that would is
    /// refused WAITERS_LIMIT, one that does not wait gets LOCKED).
    #[arg(long, env = "TENURE_WAITERS_MAX", default_value_t = Settings::default().waiters_max)]
    pub waiters_max: usize,
    /// Most blocking acquires waiting on one key (0: none waits).
    #[arg(
        long,
        env = "TENURE_WAITERS_PER_KEY_MAX",
        default_value_t = Settings::default().waiters_per_key_max
    )]
    pub waiters_per_key_max: usize,
    /// Most live sessions (PROTOCOL.md 3.11; 0: sessions are off, and `tenure run` and
    /// `tenure elect` need `--no-session`).
    #[arg(long, env = "TENURE_SESSIONS_MAX", default_value_t = Settings::default().sessions_max)]
    pub sessions_max: usize,
    /// Most leases one session holds and waits for (its waiting ACQUIREs count too; 0: a
    /// session can be opened and kept alive, but holds nothing).
    #[arg(
        long,
        env = "TENURE_SESSION_LEASES_MAX",
        default_value_t = Settings::default().session_leases_max
    )]
    pub session_leases_max: usize,
    /// Most unanswered requests per connection (announced in the handshake).
    #[arg(long, env = "TENURE_IN_FLIGHT_MAX", default_value_t = Settings::default().in_flight_max)]
    pub in_flight_max: u32,
    /// Longest lease granted, in milliseconds.
    #[arg(long, env = "TENURE_TTL_MAX_MS", default_value_t = Settings::default().ttl_max_ms)]
    pub ttl_max_ms: u32,
    /// Lock-table shards.
    #[arg(long, env = "TENURE_SHARDS", default_value_t = Settings::default().shards)]
    pub shards: usize,
    /// Worker threads for connections (default: one per core).
    #[arg(long, env = "TENURE_THREADS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub threads: Option<usize>,
    /// How connections are spread over the --threads threads: `per-core` (a runtime and a
    /// listener per thread; the default on a single node) or `shared` (one work-stealing
    /// runtime; the default, and the only model, in cluster mode).
    #[arg(long, env = "TENURE_RUNTIME", value_enum)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub runtime: Option<RuntimeModel>,
    /// WAL segment size in bytes; older segments are deleted after a snapshot of the live
    /// locks, so disk use follows the live state rather than history.
    #[arg(
        long,
        env = "TENURE_WAL_SEGMENT_BYTES",
        default_value_t = Settings::default().wal_segment_bytes
    )]
    pub wal_segment_bytes: u64,
    /// Milliseconds a new connection has to finish the binary handshake or send its first
    /// whole console line; a connection silent for longer is closed.
    #[arg(
        long,
        env = "TENURE_HANDSHAKE_TIMEOUT_MS",
        default_value_t = Settings::default().handshake_timeout_ms
    )]
    pub handshake_timeout_ms: u64,
    /// Milliseconds a connection may be idle before TCP keepalive probes start (rounded up to
    /// whole seconds, the kernel's unit).
    #[arg(
        long,
        env = "TENURE_KEEPALIVE_IDLE_MS",
        default_value_t = Settings::default().keepalive_idle_ms
    )]
    pub keepalive_idle_ms: u64,
    /// Milliseconds between unanswered keepalive probes (rounded up to whole seconds).
    #[arg(
        long,
        env = "TENURE_KEEPALIVE_INTERVAL_MS",
        default_value_t = Settings::default().keepalive_interval_ms
    )]
    pub keepalive_interval_ms: u64,
    /// Unanswered keepalive probes before the connection is dropped: a peer that vanished is
    /// noticed within idle + interval * count.
    #[arg(
        long,
        env = "TENURE_KEEPALIVE_COUNT",
        default_value_t = Settings::default().keepalive_count
    )]
    pub keepalive_count: u32,
    /// Log lines on stderr as `text` (coloured only on a terminal) or `json` (one object per
    /// line). The level comes from RUST_LOG (default `info`).
    #[arg(long, env = "TENURE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// TOML file of identities (name, secret hash, key prefixes, STATS/WATCH permission,
    /// quotas); every connection must then AUTH. Reloaded on SIGHUP. Without it only a
    /// loopback address is served.
    #[arg(long, env = "TENURE_IDENTITIES")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub identities: Option<PathBuf>,
    /// Serve a non-loopback address without identities: anyone who can connect may take and
    /// release every lock.
    #[arg(long, env = "TENURE_INSECURE_NO_AUTH")]
    pub insecure_no_auth: bool,
    /// TLS on the client port: the server's certificate chain (PEM, leaf first). Needs
    /// --tls-key. Reloaded on SIGHUP.
    #[arg(long, env = "TENURE_TLS_CERT")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM: PKCS#8, PKCS#1 or SEC1).
    #[arg(long, env = "TENURE_TLS_KEY")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_key: Option<PathBuf>,
    /// Mutual TLS: require a client certificate signed by a CA in this PEM file. A
    /// certificate whose subject common name is an identity's name authenticates as it.
    #[arg(long, env = "TENURE_TLS_CLIENT_CA")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_client_ca: Option<PathBuf>,
    /// Cluster mode (server/CLUSTER.md): replicate every grant, release and token reservation
    /// through Raft with the other nodes (3 or 5); needs --node-id and --peer-listen. The
    /// Raft log, vote and snapshot live in --data-dir.
    #[arg(long, env = "TENURE_CLUSTER")]
    pub cluster: bool,
    /// Cluster mode: this node's id in the membership.
    #[arg(long, env = "TENURE_NODE_ID")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node_id: Option<u64>,
    /// Cluster mode: the address this node listens on for its peers (its own port, never the
    /// client port). The other nodes connect to the peer address the membership gives this
    /// node (--initial-cluster, CLUSTER INIT or ADD), which must reach this listener.
    #[arg(long, env = "TENURE_PEER_LISTEN")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peer_listen: Option<SocketAddr>,
    /// Cluster mode: mutual TLS on the peer port: this node's certificate (PEM, leaf
    /// first), from the cluster's CA, naming its id as the DNS name `node-<id>.tenure`.
    /// Needs --peer-tls-key and --peer-tls-ca; allows a --peer-listen that is not loopback.
    #[arg(long, env = "TENURE_PEER_TLS_CERT")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peer_tls_cert: Option<PathBuf>,
    /// Cluster mode: the private key of --peer-tls-cert (PEM: PKCS#8, PKCS#1 or SEC1).
    #[arg(long, env = "TENURE_PEER_TLS_KEY")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peer_tls_key: Option<PathBuf>,
    /// Cluster mode: the cluster's CA certificate (PEM): every peer must present a
    /// certificate it signed, naming the node it speaks for.
    #[arg(long, env = "TENURE_PEER_TLS_CA")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peer_tls_ca: Option<PathBuf>,
    /// Cluster mode: the first membership, `1=<peer addr>/<client addr>,2=...`, the same on
    /// every node: the node with the lowest id initialises the cluster, once, when its data
    /// directory is fresh and every other node listed answers that it is fresh too. Ignored
    /// on a node that is initialised already.
    #[arg(long, env = "TENURE_INITIAL_CLUSTER")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub initial_cluster: Option<String>,
    /// Cluster mode: the leader's heartbeat interval H, in milliseconds. openraft checks its
    /// timers on a tick every 1.5 H, so heartbeats go out every 1.5 H.
    #[arg(long, env = "TENURE_HEARTBEAT_MS", default_value_t = Settings::default().heartbeat_ms)]
    pub heartbeat_ms: u64,
    /// Cluster mode: the election timeout E, in milliseconds. A follower that stops hearing
    /// its leader starts an election after the leader lease (2 E) plus a random time from E
    /// to 2 E, so 3 to 4 E after the last heartbeat (server/CLUSTER.md has the formula);
    /// nodes sharing a small, loaded machine want 300, or a starved follower starts
    /// needless elections.
    #[arg(
        long,
        env = "TENURE_ELECTION_TIMEOUT_MS",
        default_value_t = Settings::default().election_timeout_ms
    )]
    pub election_timeout_ms: u64,
}

impl Default for Settings {
    fn default() -> Self {
        let config = Config::default();
        Settings {
            listen: config.listen,
            metrics_listen: config.metrics_listen,
            data_dir: config.data_dir,
            durability: config.durability,
            no_fsync: !config.fsync,
            connections_max: config.connections_max,
            unauthenticated_per_address_max: config.unauthenticated_per_address_max,
            held_max: config.held_max,
            waiters_max: config.waiters_max,
            waiters_per_key_max: config.waiters_per_key_max,
            sessions_max: config.sessions_max,
            session_leases_max: config.session_leases_max,
            in_flight_max: config.in_flight_max,
            ttl_max_ms: config.ttl_ms_max,
            shards: config.shards,
            threads: None,
            runtime: None,
            wal_segment_bytes: config.wal_segment_bytes_max,
            handshake_timeout_ms: millis(config.handshake_timeout),
            keepalive_idle_ms: millis(config.keepalive_idle),
            keepalive_interval_ms: millis(config.keepalive_interval),
            keepalive_count: config.keepalive_count,
            log_format: LogFormat::Text,
            identities: config.identities,
            insecure_no_auth: config.insecure_no_auth,
            tls_cert: None,
            tls_key: None,
            tls_client_ca: None,
            cluster: false,
            node_id: None,
            peer_listen: None,
            peer_tls_cert: None,
            peer_tls_key: None,
            peer_tls_ca: None,
            initial_cluster: None,
            heartbeat_ms: tenure_server::cluster::HEARTBEAT_MS_DEFAULT,
            election_timeout_ms: tenure_server::cluster::ELECTION_TIMEOUT_MS_DEFAULT,
        }
    }
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

impl Settings {
    /// The runtime model to run: as set, else `per-core` on a single node (the faster one
    /// in every A/B run, BENCHMARKS.md) and `shared` in cluster mode (the only one it serves).
    pub fn runtime_model(&self) -> RuntimeModel {
        match self.runtime {
            Some(model) => model,
            None if self.cluster => RuntimeModel::Shared,
            None => RuntimeModel::PerCore,
        }
    }

    /// The server's configuration: these settings over [`Config::default`] for the rest.
    pub fn to_config(&self) -> Config {
        Config {
            listen: self.listen,
            metrics_listen: self.metrics_listen,
            data_dir: self.data_dir.clone(),
            durability: self.durability,
            fsync: !self.no_fsync,
            connections_max: self.connections_max,
            unauthenticated_per_address_max: self.unauthenticated_per_address_max,
            held_max: self.held_max,
            waiters_max: self.waiters_max,
            waiters_per_key_max: self.waiters_per_key_max,
            sessions_max: self.sessions_max,
            session_leases_max: self.session_leases_max,
            in_flight_max: self.in_flight_max,
            ttl_ms_max: self.ttl_max_ms,
            shards: self.shards,
            wal_segment_bytes_max: self.wal_segment_bytes,
            handshake_timeout: Duration::from_millis(self.handshake_timeout_ms),
            keepalive_idle: Duration::from_millis(self.keepalive_idle_ms),
            keepalive_interval: Duration::from_millis(self.keepalive_interval_ms),
            keepalive_count: self.keepalive_count,
            identities: self.identities.clone(),
            insecure_no_auth: self.insecure_no_auth,
            tls: self.tls_files(),
            ..Config::default()
        }
    }

    /// The peer TLS files, if any peer TLS setting is given.
    ///
    /// # Errors
    /// When one of the three is given without the others.
    pub fn peer_tls_files(&self) -> Result<Option<PeerTlsFiles>, String> {
        match (&self.peer_tls_cert, &self.peer_tls_key, &self.peer_tls_ca) {
            (None, None, None) => Ok(None),
            (Some(cert), Some(key), Some(ca)) => Ok(Some(PeerTlsFiles {
                cert: cert.clone(),
                key: key.clone(),
                ca: ca.clone(),
            })),
            _ => Err("--peer-tls-cert, --peer-tls-key and --peer-tls-ca go together".into()),
        }
    }

    /// The TLS files, if any TLS setting is given; a missing certificate or key is left
    /// empty for [`Config::validate`] to name.
    fn tls_files(&self) -> Option<TlsFiles> {
        if self.tls_cert.is_none() && self.tls_key.is_none() && self.tls_client_ca.is_none() {
            return None;
        }
        Some(TlsFiles {
            cert: self.tls_cert.clone().unwrap_or_default(),
            key: self.tls_key.clone().unwrap_or_default(),
            client_ca: self.tls_client_ca.clone(),
        })
    }

    /// These settings as a config file that `--config` reads back to the same settings.
    ///
    /// # Errors
    /// A value TOML cannot hold (an integer over `i64::MAX`, a path that is not UTF-8).
    pub fn to_toml(&self) -> anyhow::Result<String> {
        let body = toml::to_string(self).context("cannot write the settings as TOML")?;
        let threads = if self.threads.is_none() {
            "# threads: unset, one worker per core\n"
        } else {
            ""
        };
        let metrics = if self.metrics_listen.is_none() {
            "# metrics-listen: unset, no HTTP endpoint\n"
        } else {
            ""
        };
        let header = "# tenured settings in effect (flag > TENURE_* environment > file > default)";
        Ok(format!("{header}\n{body}{threads}{metrics}"))
    }
}

/// What the command line asked for.
pub struct Loaded {
    /// The merged settings.
    pub settings: Settings,
    /// Where the settings not typed on the command line came from.
    pub origins: Origins,
    /// `--print-config`: print the settings and exit.
    pub print_config: bool,
    /// A subcommand to run instead of serving.
    pub command: Option<Subcommand>,
}

/// Reads the flags, the environment and the `--config` file. On `--help`, `--version` or a
/// malformed flag, prints clap's message and exits, as clap does.
///
/// # Errors
/// The config file cannot be read, or has an unknown key or a bad value (the message names
/// the file and the key).
pub fn load() -> anyhow::Result<Loaded> {
    load_from(std::env::args_os())
}

fn load_from(args: impl IntoIterator<Item = OsString>) -> anyhow::Result<Loaded> {
    let args: Vec<OsString> = args.into_iter().collect();
    let matches = Cli::command()
        .try_get_matches_from(&args)
        .unwrap_or_else(|e| {
            let from_env = env_source(&e, &args);
            let code = e.exit_code();
            // `--help` and `--version` print to stdout, errors to stderr, as clap does.
            let _ = e.print();
            if let Some(note) = from_env {
                eprintln!("{note}");
            }
            std::process::exit(code)
        });
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    let file = match &cli.config {
        Some(path) => read_file(path)?,
        None => Settings::default(),
    };
    let settings = overlay(file, &cli.settings, &matches)?;
    let file_keys = match &cli.config {
        Some(path) => file_keys(path),
        None => Vec::new(),
    };
    Ok(Loaded {
        settings,
        origins: Origins::of(&matches, cli.config.as_deref(), &file_keys),
        print_config: cli.print_config,
        command: cli.command,
    })
}

/// For clap's error about a bad value that the environment gave, not the command line, a
/// note naming the variable: clap names only the flag, which sent its reader looking for a
/// flag never typed (outside test a63, F7: `TENURE_HELD_MAX=lots` read as `--held-max`).
fn env_source(e: &clap::Error, args: &[OsString]) -> Option<String> {
    use clap::error::{ContextKind, ContextValue};
    let Some(ContextValue::String(invalid)) = e.get(ContextKind::InvalidArg) else {
        return None;
    };
    let long = invalid.split_whitespace().next()?.strip_prefix("--")?;
    let command = Cli::command();
    let arg = command
        .get_arguments()
        .find(|a| a.get_long() == Some(long))?;
    let var = arg.get_env()?;
    let flag = format!("--{long}");
    let typed = args.iter().skip(1).any(|a| {
        let a = a.to_string_lossy();
        a == flag || a.starts_with(&format!("{flag}="))
    });
    let set = std::env::var_os(var).is_some();
    (set && !typed).then(|| {
        format!(
            "note: that value of {flag} came from the environment variable {}",
            var.to_string_lossy()
        )
    })
}

/// Where a setting's value came from, when not from the command line.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Origin {
    /// This `TENURE_*` variable.
    Environment(String),
    /// This config file's key of the flag's name.
    File(PathBuf),
}

/// Where each setting not typed on the command line came from, so that a refusal naming a
/// flag can name the variable or file that gave it: otherwise its reader looks for a flag
/// that was never typed (outside test a64, F1: `TENURE_HEARTBEAT_MS=9` was refused as
/// `--heartbeat-ms` alone).
#[derive(Debug, Default)]
pub struct Origins {
    /// Flag (`--held-max`) to origin.
    of: Vec<(String, Origin)>,
}

impl Origins {
    fn of(matches: &ArgMatches, config: Option<&Path>, file_keys: &[String]) -> Origins {
        let mut of = Vec::new();
        for arg in Cli::command().get_arguments() {
            let (Some(long), Some(source)) =
                (arg.get_long(), matches.value_source(arg.get_id().as_str()))
            else {
                continue;
            };
            let origin = match (source, arg.get_env(), config) {
                (ValueSource::EnvVariable, Some(var), _) => {
                    Origin::Environment(var.to_string_lossy().into_owned())
                }
                (ValueSource::DefaultValue, _, Some(path))
                    if file_keys.iter().any(|k| k == long) =>
                {
                    Origin::File(path.to_path_buf())
                }
                _ => continue,
            };
            of.push((format!("--{long}"), origin));
        }
        Origins { of }
    }

    /// A note for each flag `report` names whose value did not come from the command line
    /// (and whose variable the report does not name already): empty if none.
    pub fn notes(&self, report: &str) -> String {
        let mut notes = String::new();
        for (flag, origin) in &self.of {
            if !names_flag(report, flag) {
                continue;
            }
            let note = match origin {
                Origin::Environment(var) if report.contains(var.as_str()) => continue,
                Origin::Environment(var) => {
                    format!("note: the value of {flag} came from the environment variable {var}")
                }
                Origin::File(path) => format!(
                    "note: the value of {flag} came from the config file {} (key {})",
                    path.display(),
                    &flag[2..]
                ),
            };
            notes.push_str(&note);
            notes.push('\n');
        }
        notes
    }
}

/// Whether `text` names `flag` itself (`--heartbeat-ms`, not only `--heartbeat-ms-x`).
fn names_flag(text: &str, flag: &str) -> bool {
    text.match_indices(flag).any(|(at, _)| {
        let next = text[at + flag.len()..].chars().next();
        !next.is_some_and(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    })
}

/// The top-level keys of the config file at `path` (none if it cannot be read: then
/// [`read_file`] has refused it already).
fn file_keys(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|text| text.parse::<toml::Table>().ok())
        .map(|table| table.keys().cloned().collect())
        .unwrap_or_default()
}

/// Parses a config file.
///
/// # Errors
/// The file cannot be read, or a key is unknown or has a bad value; the message names the
/// file, the line and the key.
pub fn read_file(path: &Path) -> anyhow::Result<Settings> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the config file {}", path.display()))?;
    parse_file(&text).map_err(|e| anyhow::anyhow!("config file {}: {e}", path.display()))
}

/// Parses a config file's text; the error names the key it is about.
fn parse_file(text: &str) -> Result<Settings, String> {
    toml::from_str(text).map_err(|e: toml::de::Error| {
        // toml quotes an unknown key itself; for a bad value it only shows the line, so the
        // key is named here, taken from the start of that line.
        let key = e
            .span()
            .and_then(|span| line_at(text, span.start).split_once('='))
            .map(|(key, _)| key.trim().trim_matches('"'))
            .filter(|key| !key.is_empty());
        match key {
            Some(key) => format!("key `{key}`: {e}"),
            None => e.to_string(),
        }
    })
}

/// The whole line of `text` that holds byte `offset`.
fn line_at(text: &str, offset: usize) -> &str {
    let start = text[..offset].rfind('\n').map_or(0, |i| i + 1);
    let end = text[offset..].find('\n').map_or(text.len(), |i| offset + i);
    &text[start..end]
}

/// `file` with every setting that came from a flag or the environment replaced by `cli`'s.
fn overlay(file: Settings, cli: &Settings, matches: &ArgMatches) -> anyhow::Result<Settings> {
    let mut merged = toml::Table::try_from(&file).context("cannot merge the settings")?;
    let explicit = toml::Table::try_from(cli).context("cannot merge the settings")?;
    for (key, value) in explicit {
        // The serde key is the clap id in kebab-case (a unit test checks every key maps).
        let source = matches.value_source(&key.replace('-', "_"));
        if matches!(
            source,
            Some(ValueSource::CommandLine | ValueSource::EnvVariable)
        ) {
            merged.insert(key, value);
        }
    }
    merged.try_into().context("cannot merge the settings")
}

/// Sends log lines to stderr in `format`, at the level RUST_LOG gives (default `info`), with
/// colour codes only when stderr is a terminal: in a file or a pipe they are noise. openraft's
/// repeated warnings and errors are limited ([`tenure_server::log_limit`]).
pub fn init_logging(format: LogFormat) {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::Layer;

    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    let fmt = match format {
        LogFormat::Text => fmt.boxed(),
        LogFormat::Json => fmt.json().boxed(),
    };
    let limit = tenure_server::log_limit::RepeatLimit::default();
    tracing_subscriber::registry()
        .with(filter)
        .with(fmt.with_filter(limit))
        .init();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load_args(args: &[&str]) -> Settings {
        let argv = std::iter::once("tenured").chain(args.iter().copied());
        load_from(argv.map(OsString::from)).unwrap().settings
    }

    #[test]
    fn every_key_is_a_flag() {
        let command = Cli::command();
        let table = toml::Table::try_from(Settings {
            threads: Some(2),
            runtime: Some(RuntimeModel::Shared),
            identities: Some("ids.toml".into()),
            metrics_listen: Some("127.0.0.1:9100".parse().unwrap()),
            tls_cert: Some("cert.pem".into()),
            tls_key: Some("key.pem".into()),
            tls_client_ca: Some("ca.pem".into()),
            node_id: Some(1),
            peer_listen: Some("127.0.0.1:7001".parse().unwrap()),
            peer_tls_cert: Some("node.pem".into()),
            peer_tls_key: Some("node.key".into()),
            peer_tls_ca: Some("cluster-ca.pem".into()),
            initial_cluster: Some("1=127.0.0.1:7001/127.0.0.1:7878".into()),
            ..Settings::default()
        })
        .unwrap();
        for key in table.keys() {
            let id = key.replace('-', "_");
            let arg = command.get_arguments().find(|a| a.get_id() == id.as_str());
            let arg = arg.unwrap_or_else(|| panic!("key {key} has no flag"));
            assert_eq!(arg.get_long(), Some(key.as_str()));
            let env = format!("TENURE_{}", id.to_uppercase());
            assert_eq!(arg.get_env(), Some(std::ffi::OsStr::new(&env)), "{key}");
        }
        assert_eq!(
            table.len(),
            37,
            "a new setting needs a key, a flag and a variable"
        );
    }

    #[test]
    fn flag_beats_file_beats_default() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tenured.toml");
        std::fs::write(&path, "shards = 8\nheld-max = 500\nno-fsync = true\n").unwrap();
        let path = path.to_str().unwrap();
        let settings = load_args(&["--config", path, "--shards", "16"]);
        assert_eq!(settings.shards, 16, "flag beats file");
        assert_eq!(settings.held_max, 500, "file beats default");
        assert!(settings.no_fsync, "file beats default");
        assert_eq!(settings.waiters_max, Settings::default().waiters_max);
        // A flag given with its default value still beats the file.
        let default_shards = Settings::default().shards.to_string();
        let settings = load_args(&["--config", path, "--shards", &default_shards]);
        assert_eq!(settings.shards, Settings::default().shards);
    }

    #[test]
    fn unknown_key_is_an_error_naming_it() {
        let err = parse_file("shards = 8\nheld_maxx = 5\n").unwrap_err();
        assert!(err.starts_with("key `held_maxx`"), "{err}");
        assert!(err.contains("unknown field"), "{err}");
    }

    #[test]
    fn bad_value_names_the_key_and_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad.toml");
        std::fs::write(&path, "shards = 8\nheld-max = \"lots\"\n").unwrap();
        let err = format!("{:#}", read_file(&path).unwrap_err());
        assert!(err.contains("key `held-max`"), "{err}");
        assert!(err.contains(&path.display().to_string()), "{err}");
        let err = parse_file("durability = \"some\"\n").unwrap_err();
        assert!(err.contains("key `durability`"), "{err}");
    }

    #[test]
    fn printed_config_reads_back_the_same() {
        let changed = Settings {
            listen: "0.0.0.0:9000".parse().unwrap(),
            data_dir: "/var/lib/tenure".into(),
            durability: Durability::Tokens,
            no_fsync: true,
            threads: Some(3),
            runtime: Some(RuntimeModel::PerCore),
            metrics_listen: Some("127.0.0.1:9100".parse().unwrap()),
            keepalive_count: 9,
            log_format: LogFormat::Json,
            ..Settings::default()
        };
        for settings in [Settings::default(), changed] {
            let text = settings.to_toml().unwrap();
            assert_eq!(parse_file(&text).unwrap(), settings, "{text}");
        }
    }

    #[test]
    fn shipped_sample_parses_and_lists_every_key() {
        let sample = include_str!("../deploy/tenured.toml");
        let settings = parse_file(sample).unwrap();
        assert!(settings.to_config().validate().is_ok());
        assert_eq!(settings.data_dir, Path::new("/var/lib/tenure"));
        // Every key appears in the sample, set or commented out, so it documents them all.
        let all = toml::Table::try_from(Settings {
            threads: Some(1),
            identities: Some("ids.toml".into()),
            metrics_listen: Some("127.0.0.1:9100".parse().unwrap()),
            tls_cert: Some("cert.pem".into()),
            tls_key: Some("key.pem".into()),
            tls_client_ca: Some("ca.pem".into()),
            node_id: Some(1),
            peer_listen: Some("127.0.0.1:7001".parse().unwrap()),
            peer_tls_cert: Some("node.pem".into()),
            peer_tls_key: Some("node.key".into()),
            peer_tls_ca: Some("cluster-ca.pem".into()),
            initial_cluster: Some("1=127.0.0.1:7001/127.0.0.1:7878".into()),
            ..Settings::default()
        })
        .unwrap();
        for key in all.keys() {
            let mentioned = sample.lines().any(|line| {
                let line = line.trim_start_matches(['#', ' ']);
                line.starts_with(&format!("{key} ="))
            });
            assert!(mentioned, "the sample does not mention {key}");
        }
        // A commented-out key shows the default, so uncommenting it changes nothing.
        let defaults = toml::Table::try_from(Settings::default()).unwrap();
        for line in sample.lines().filter_map(|l| l.strip_prefix("# ")) {
            let line = line.split(" #").next().unwrap();
            let Ok(entry) = line.parse::<toml::Table>() else {
                continue; // prose
            };
            let unset = [
                "threads",
                "runtime",
                "metrics-listen",
                "identities",
                "tls-cert",
                "tls-key",
                "tls-client-ca",
                "node-id",
                "peer-listen",
                "peer-tls-cert",
                "peer-tls-key",
                "peer-tls-ca",
                "initial-cluster",
            ];
            for (key, value) in entry.iter().filter(|(k, _)| !unset.contains(&k.as_str())) {
                assert_eq!(defaults.get(key), Some(value), "sample's default for {key}");
            }
        }
    }
}
