//! `tenured`: read the settings (flags, environment, config file), bind, run until SIGTERM
//! or SIGINT.

mod settings;

use std::time::Duration;

use anyhow::Context;
use settings::RuntimeModel;
use tenure_server::cluster::peer_tls::PeerTlsFiles;

// mimalloc: requests allocate small, short-lived buffers on every worker thread, and mimalloc's
// thread-local heaps served the mixed workload 2-8 % faster than the system allocator in A/B
// runs. It costs memory: RSS per held lock was ~200 bytes against ~125-150 with the system
// allocator (eager arena commit; MIMALLOC_ARENA_EAGER_COMMIT=0 closes most of the gap). The
// figures are in BENCHMARKS.md.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    let failed = |err: &anyhow::Error, origins: Option<&settings::Origins>| {
        let notes = |report: &str| origins.map(|o| o.notes(report)).unwrap_or_default();
        eprint!("{}", error_report(err, notes));
        std::process::ExitCode::FAILURE
    };
    let loaded = match settings::load() {
        Ok(loaded) => loaded,
        Err(err) => return failed(&err, None),
    };
    match run(&loaded) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => failed(&err, Some(&loaded.origins)),
    }
}

/// What a failed `tenured` prints: the error, then under "Caused by:" each cause whose words
/// it has not printed yet, then the `notes` on those words (where a setting they name came
/// from), then the backtrace if `RUST_BACKTRACE` asked for one (after the notes, which it
/// buried: outside test a65, 7). The server's
/// error types put their cause in their own message, so that a log line, which shows the
/// message alone, names it, and give it as their `source()` too; anyhow's own report printed
/// such a cause twice.
fn error_report(err: &anyhow::Error, notes: impl Fn(&str) -> String) -> String {
    use std::fmt::Write;
    let mut printed = err.to_string();
    let mut report = format!("Error: {printed}\n");
    let mut heading = true;
    for cause in err.chain().skip(1).map(|cause| cause.to_string()) {
        if printed.contains(&cause) {
            continue;
        }
        if std::mem::take(&mut heading) {
            report.push_str("\nCaused by:\n");
        }
        let _ = writeln!(report, "    {cause}");
        printed.push_str(&cause);
    }
    report.push_str(&notes(&report));
    if err.backtrace().status() == std::backtrace::BacktraceStatus::Captured {
        let _ = write!(report, "\nStack backtrace:\n{}", err.backtrace());
    }
    report
}

fn run(loaded: &settings::Loaded) -> anyhow::Result<()> {
    let settings = &loaded.settings;
    anyhow::ensure!(
        settings.threads != Some(0),
        "invalid configuration: --threads must be at least 1 (leave it unset for one per core)"
    );
    anyhow::ensure!(
        !(settings.cluster && settings.runtime == Some(RuntimeModel::PerCore)),
        "invalid configuration: --runtime per-core is not served in cluster mode (a cluster \
         node's client port runs on the shared runtime; leave --runtime unset or `shared`)"
    );
    match &loaded.command {
        Some(settings::Subcommand::HashSecret) => return hash_secret(),
        Some(settings::Subcommand::ClusterInit {
            peer,
            nodes,
            peer_tls_cert,
            peer_tls_key,
            peer_tls_ca,
        }) => {
            let tls = match (peer_tls_cert, peer_tls_key, peer_tls_ca) {
                (Some(cert), Some(key), Some(ca)) => Some(PeerTlsFiles {
                    cert: cert.clone(),
                    key: key.clone(),
                    ca: ca.clone(),
                }),
                _ => None,
            };
            return cluster_init(peer, nodes, tls);
        }
        None => {}
    }
    // Everything a start checks before it touches the data directory or a port, so
    // `--print-config` refuses what a start would refuse (outside test a47, M12).
    refuse_cluster_flags_without_cluster(settings)?;
    let config = settings.to_config();
    config
        .validate()
        .map_err(|e| anyhow::anyhow!("invalid configuration: {e}"))?;
    tenure_server::startup::refuse_exposed(&config, config.listen)?;
    let node = if settings.cluster {
        let node = node_plan(settings, &config)?;
        node.options.check(&config)?;
        Some(node)
    } else {
        None
    };
    if loaded.print_config {
        print!("{}", settings.to_toml()?);
        return Ok(());
    }
    settings::init_logging(settings.log_format);
    if let Some(node) = &node {
        node.warn_of_own_entry();
    }
    raise_open_file_limit(config.connections_max);
    disable_transparent_huge_pages();
    let runtime = build_runtime(settings)?;
    runtime.block_on(serve(settings, config, node))?;
    // Connections that outlived the grace period are dropped with the runtime.
    runtime.shutdown_timeout(Duration::from_millis(100));
    Ok(())
}

/// Refuses a node's flags on a server started without `--cluster`: they were ignored, and a
/// unit file that forgot `--cluster` on one node made a single node with a lock table of
/// its own at an address the clients take for a cluster member (outside test a46, L2). The
/// timing flags have defaults, so they count as given when they differ from them (a47, M11).
fn refuse_cluster_flags_without_cluster(settings: &settings::Settings) -> anyhow::Result<()> {
    if settings.cluster {
        return Ok(());
    }
    let defaults = settings::Settings::default();
    let given = [
        ("--node-id", settings.node_id.is_some()),
        ("--peer-listen", settings.peer_listen.is_some()),
        // An empty `TENURE_INITIAL_CLUSTER=` (a unit file's blank template) gives nothing.
        (
            "--initial-cluster",
            settings
                .initial_cluster
                .as_ref()
                .is_some_and(|s| !s.is_empty()),
        ),
        ("--peer-tls-cert", settings.peer_tls_cert.is_some()),
        ("--peer-tls-key", settings.peer_tls_key.is_some()),
        ("--peer-tls-ca", settings.peer_tls_ca.is_some()),
        (
            "--heartbeat-ms",
            settings.heartbeat_ms != defaults.heartbeat_ms,
        ),
        (
            "--election-timeout-ms",
            settings.election_timeout_ms != defaults.election_timeout_ms,
        ),
    ];
    let given: Vec<&str> = given
        .iter()
        .filter(|(_, set)| *set)
        .map(|(f, _)| *f)
        .collect();
    let (verb, them) = if given.len() == 1 {
        ("applies", "it")
    } else {
        ("apply", "them")
    };
    anyhow::ensure!(
        given.is_empty(),
        "invalid configuration: {} only {verb} with --cluster (a cluster node); add --cluster, \
         or leave {them} out for a single node{}",
        given.join(", "),
        from_the_environment(&given)
    );
    Ok(())
}

/// Names the environment variables that set some of `flags` (a refusal that names only the
/// flag sent its reader looking for a flag that was never typed: outside test a48, N2).
fn from_the_environment(flags: &[&str]) -> String {
    let set: Vec<String> = flags
        .iter()
        .map(|flag| format!("TENURE_{}", flag[2..].replace('-', "_").to_uppercase()))
        .filter(|var| std::env::var_os(var).is_some_and(|value| !value.is_empty()))
        .collect();
    match set.len() {
        0 => String::new(),
        1 => format!(" ({} is set in the environment)", set[0]),
        _ => format!(" ({} are set in the environment)", set.join(", ")),
    }
}

/// A cluster node's settings, checked: what `run_cluster` starts it with.
struct NodePlan {
    /// Where it listens for its peers.
    peer_listen: std::net::SocketAddr,
    /// Its Raft options.
    options: tenure_server::cluster::ClusterOptions,
}

/// The node `--cluster` asks for, or why it cannot be one. Reads no file and binds nothing.
fn node_plan(
    settings: &settings::Settings,
    config: &tenure_server::Config,
) -> anyhow::Result<NodePlan> {
    use tenure_server::cluster::{self, ClusterOptions};
    let node_id = settings.node_id.context("--cluster needs --node-id")?;
    // 0 is "no node" on the wire (CLUSTER STATUS's leader_id without a leader).
    anyhow::ensure!(node_id >= 1, "--node-id starts at 1 (0 means no node)");
    let peer_listen = settings
        .peer_listen
        .context("--cluster needs --peer-listen")?;
    let peer_tls = settings.peer_tls_files().map_err(anyhow::Error::msg)?;
    // Without peer TLS the peer port has no authentication at all (CLUSTER.md), and one
    // forged frame there can depose a leader or inject entries, so beyond loopback it needs
    // peer TLS; no flag turns that off (`--insecure-no-auth` is the client port's).
    anyhow::ensure!(
        peer_listen.ip().is_loopback() || peer_tls.is_some(),
        "--peer-listen {peer_listen} is not a loopback address and the peer port has no \
         authentication: give --peer-tls-cert, --peer-tls-key and --peer-tls-ca for mutual TLS"
    );
    let mut options = ClusterOptions::new(node_id, config.data_dir.clone());
    options.heartbeat_ms = settings.heartbeat_ms;
    options.peer_tls = peer_tls;
    if let Some(spec) = &settings.initial_cluster {
        let members =
            cluster::parse_members(spec).map_err(|e| anyhow::anyhow!("--initial-cluster: {e}"))?;
        options.initial_cluster = Some(members);
    }
    options.election_timeout_ms = (
        settings.election_timeout_ms,
        settings.election_timeout_ms.saturating_mul(2),
    );
    Ok(NodePlan {
        peer_listen,
        options,
    })
}

impl NodePlan {
    /// Logs a warning when `--initial-cluster` gives this node a peer address other than
    /// the one it listens on (outside test a46, L3; a48, N7): the others would dial an
    /// address nobody answers, and the cluster would never form. Only a warning: a
    /// forwarded or translated address is legitimate, and a host name may name this
    /// machine. Hosts are compared only when both are IP addresses and `--peer-listen`'s
    /// is not the unspecified one (0.0.0.0 answers on every address).
    fn warn_of_own_entry(&self) {
        let Some(own) = self
            .options
            .initial_cluster
            .as_ref()
            .and_then(|members| members.get(&self.options.node_id))
        else {
            return; // ClusterOptions::check refused a membership without this node
        };
        let (host, port) = own
            .peer_addr
            .rsplit_once(':')
            .map_or((own.peer_addr.as_str(), None), |(h, p)| {
                (h, p.parse::<u16>().ok())
            });
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let listen = self.peer_listen;
        let other_host = host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| !listen.ip().is_unspecified() && ip != listen.ip());
        if port != Some(listen.port()) || other_host {
            tracing::warn!(
                node_id = self.options.node_id,
                listed = %own.peer_addr,
                peer_listen = %listen,
                "--initial-cluster gives this node another peer address than --peer-listen: \
                 the other nodes dial the listed one"
            );
        }
    }
}

/// The runtime `main` runs on. Shared: the work-stealing runtime that runs everything.
/// Per-core: the core threads bring their own runtimes, and this one, on the main thread,
/// runs only the expiry ticker, signals, reloads and the HTTP endpoint.
fn build_runtime(settings: &settings::Settings) -> anyhow::Result<tokio::runtime::Runtime> {
    let mut runtime = match settings.runtime_model() {
        RuntimeModel::Shared => {
            let mut runtime = tokio::runtime::Builder::new_multi_thread();
            if let Some(threads) = settings.threads {
                runtime.worker_threads(threads);
            }
            runtime
        }
        RuntimeModel::PerCore => tokio::runtime::Builder::new_current_thread(),
    };
    runtime
        .enable_all()
        .build()
        .context("cannot start the runtime")
}

/// Binds the ports and serves until SIGTERM or SIGINT.
async fn serve(
    settings: &settings::Settings,
    config: tenure_server::Config,
    node: Option<NodePlan>,
) -> anyhow::Result<()> {
    // Installed before the port is bound: a handler installed lazily, when `run` first
    // polls the future, lets a SIGTERM that arrives in between go unnoticed.
    let shutdown = shutdown_signal().context("cannot install the signal handlers")?;
    let listen = config.listen;
    let port = match settings.runtime_model() {
        RuntimeModel::PerCore => ClientPort::PerCore(bind_per_core(settings, listen)?),
        RuntimeModel::Shared => ClientPort::Shared(
            tokio::net::TcpListener::bind(listen)
                .await
                .with_context(|| format!("cannot listen on {listen}"))?,
        ),
    };
    let metrics_listener = match config.metrics_listen {
        Some(addr) => Some(
            tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("cannot listen for metrics on {addr}"))?,
        ),
        None => None,
    };
    match port {
        ClientPort::PerCore(listeners) => {
            let run = tenure_server::run_per_core(config, listeners, metrics_listener, shutdown);
            Ok(run.await?)
        }
        ClientPort::Shared(listener) => match node {
            Some(node) => run_cluster(node, config, listener, metrics_listener, shutdown).await,
            None => {
                let run = tenure_server::run_with_metrics(
                    config,
                    None,
                    listener,
                    metrics_listener,
                    shutdown,
                );
                Ok(run.await?)
            }
        },
    }
}

/// The client port, bound as the runtime model wants it.
enum ClientPort {
    /// One listener (`--runtime shared`, and cluster mode).
    Shared(tokio::net::TcpListener),
    /// One listener per core thread (`--runtime per-core`).
    PerCore(Vec<std::net::TcpListener>),
}

/// `--runtime per-core`: one `SO_REUSEPORT` listener per thread, `--threads` of them (one
/// per core if unset).
fn bind_per_core(
    settings: &settings::Settings,
    listen: std::net::SocketAddr,
) -> anyhow::Result<Vec<std::net::TcpListener>> {
    use tenure_server::per_core::{bind_reuseport, CORES_MAX};
    let threads = match settings.threads {
        Some(threads) => threads,
        None => std::thread::available_parallelism().map_or(1, |n| n.get()),
    };
    anyhow::ensure!(
        threads <= CORES_MAX,
        "invalid configuration: --threads {threads} is over {CORES_MAX} with --runtime per-core"
    );
    bind_reuseport(listen, threads).with_context(|| format!("cannot listen on {listen}"))
}

/// `tenured --cluster`: one node of a cluster (server/CLUSTER.md), until SIGTERM or SIGINT.
async fn run_cluster(
    node: NodePlan,
    config: tenure_server::Config,
    listener: tokio::net::TcpListener,
    metrics_listener: Option<tokio::net::TcpListener>,
    shutdown: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    let peer_listen = node.peer_listen;
    let peers = tokio::net::TcpListener::bind(peer_listen)
        .await
        .with_context(|| format!("cannot listen for peers on {peer_listen}"))?;
    let run = tenure_server::cluster::run(
        config,
        node.options,
        listener,
        peers,
        metrics_listener,
        shutdown,
    );
    run.await?;
    Ok(())
}

/// `tenured cluster-init`: asks one node, over its peer port, to make `nodes` the cluster's
/// first membership.
fn cluster_init(peer: &str, nodes: &str, tls: Option<PeerTlsFiles>) -> anyhow::Result<()> {
    use tenure_server::cluster::network::Dialer;
    use tenure_server::cluster::peer_tls::PeerTls;
    let members = tenure_server::cluster::parse_members(nodes).map_err(anyhow::Error::msg)?;
    let tls = match tls {
        Some(files) => Some(std::sync::Arc::new(
            PeerTls::load(&files).map_err(anyhow::Error::msg)?,
        )),
        None => None,
    };
    let dialer = Dialer::new(std::net::Ipv4Addr::UNSPECIFIED.into(), tls);
    let count = members.len();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the runtime")?;
    runtime
        .block_on(tenure_server::cluster::initialize_remote(
            &dialer, peer, members,
        ))
        .map_err(anyhow::Error::msg)?;
    println!("initialised a cluster of {count} nodes");
    Ok(())
}

/// `tenured hash-secret`: one line from stdin (without its line ending) to its argon2 hash on
/// stdout. The secret never appears on the command line.
fn hash_secret() -> anyhow::Result<()> {
    let mut line = String::new();
    std::io::stdin()
        .read_line(&mut line)
        .context("cannot read the secret from stdin")?;
    let secret = line.strip_suffix('\n').unwrap_or(&line);
    let secret = secret.strip_suffix('\r').unwrap_or(secret);
    anyhow::ensure!(!secret.is_empty(), "no secret on stdin");
    let hash =
        tenure_server::identity::hash_secret(secret.as_bytes()).map_err(anyhow::Error::msg)?;
    println!("{hash}");
    Ok(())
}

/// Installs the SIGTERM and SIGINT handlers now, and returns a future that completes on the
/// first of them.
fn shutdown_signal() -> std::io::Result<impl std::future::Future<Output = ()>> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    })
}

/// File descriptors kept beyond `--connections-max` for everything else: the WAL or Raft log
/// and its snapshots, listeners, the peer port's connections, the metrics endpoint.
const FDS_RESERVED: u64 = 1024;

/// Opts this process out of transparent huge pages. mimalloc asks for them on its arenas, and
/// a 2 MiB page is resident whole once any byte of it is touched and returned only whole: at
/// 500K held locks RSS grew 100-110 bytes per lock with them and 88-89 without (the lock
/// table itself is 88), at no measured cost in throughput (BENCHMARKS.md, issue 12). Applies
/// to mappings made before the call too. `prctl` is an FFI call, hence the `unsafe`.
#[allow(unsafe_code)]
fn disable_transparent_huge_pages() {
    // SAFETY: PR_SET_THP_DISABLE takes plain integers and only sets a flag on this process.
    let result = unsafe { libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0) };
    if result != 0 {
        tracing::debug!(error = %std::io::Error::last_os_error(), "cannot opt out of transparent huge pages");
    }
}

/// Raises the soft limit on open files to the hard limit, as servers do (1024 is a common
/// soft default, under `--connections-max`'s 10 000): a process that runs out cannot open
/// its log (a cluster node's Raft core stops on it). Warns if the limit is still too low.
/// `getrlimit`/`setrlimit` are FFI calls, hence the `unsafe`.
#[allow(unsafe_code)]
fn raise_open_file_limit(connections_max: usize) {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit only read and write the struct passed.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 {
            return;
        }
        if limit.rlim_cur < limit.rlim_max {
            let raised = libc::rlimit {
                rlim_cur: limit.rlim_max,
                rlim_max: limit.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                limit = raised;
            }
        }
    }
    let needed = connections_max as u64 + FDS_RESERVED;
    if limit.rlim_cur < needed {
        tracing::warn!(
            open_files = limit.rlim_cur,
            needed,
            "the open-file limit is below --connections-max plus a reserve: raise it (ulimit -n)"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::error_report;

    /// An error of ours whose message has its cause in it, as the server's types do.
    #[derive(Debug, thiserror::Error)]
    #[error("cannot create /x: {0}")]
    struct Create(#[source] std::io::Error);

    fn not_found() -> std::io::Error {
        std::io::Error::new(std::io::ErrorKind::NotFound, "no such file")
    }

    #[test]
    fn a_cause_already_in_the_message_is_not_printed_again() {
        let report = error_report(&anyhow::Error::new(Create(not_found())), |_| String::new());
        assert_eq!(report.matches("no such file").count(), 1, "{report}");
        assert!(!report.contains("Caused by"), "{report}");
    }

    #[test]
    fn a_cause_the_message_does_not_name_is_printed_under_caused_by() {
        let err = anyhow::Error::new(Create(not_found())).context("cannot open the journal");
        let report = error_report(&err, |_| String::new());
        assert!(
            report.starts_with("Error: cannot open the journal\n"),
            "{report}"
        );
        assert!(
            report.contains("Caused by:\n    cannot create /x: no such file\n"),
            "{report}"
        );
        assert_eq!(report.matches("no such file").count(), 1, "{report}");
    }
}
