//! `tenured`: parse flags, bind, run until SIGTERM or SIGINT.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use tenure_server::config::{Config, Durability};

// mimalloc: requests allocate small, short-lived buffers on every worker thread, and mimalloc's
// thread-local heaps served the mixed workload 2-8 % faster than the system allocator in A/B
// runs. It costs memory: RSS per held lock was ~200 bytes against ~125-150 with the system
// allocator (eager arena commit; MIMALLOC_ARENA_EAGER_COMMIT=0 closes most of the gap). The
// figures are in BENCHMARKS.md.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// tenured: a single-node lock server with fencing tokens that survive crashes.
#[derive(Parser, Debug)]
#[command(version, about, long_about = None)]
struct Args {
    /// Address to listen on, for both the binary protocol and the text console.
    #[arg(long, default_value = "127.0.0.1:7878", env = "TENURE_LISTEN")]
    listen: SocketAddr,
    /// Directory for the write-ahead log (created if missing).
    #[arg(long, default_value = "./tenure-data", env = "TENURE_DATA_DIR")]
    data_dir: PathBuf,
    /// What survives a crash: `full` keeps every held lock; `tokens` keeps only the fencing
    /// token high-water mark and refuses grants for --ttl-max-ms after a restart.
    #[arg(long, value_enum, default_value = "full")]
    durability: Durability,
    /// Skip fsync. Unsafe: a machine crash may then reuse fencing tokens. For benchmarks only.
    #[arg(long)]
    no_fsync: bool,
    /// Most client connections at once.
    #[arg(long, default_value_t = Config::default().connections_max)]
    connections_max: usize,
    /// Most locks held at once.
    #[arg(long, default_value_t = Config::default().held_max)]
    held_max: usize,
    /// Most blocking acquires waiting at once.
    #[arg(long, default_value_t = Config::default().waiters_max)]
    waiters_max: usize,
    /// Most blocking acquires waiting on one key.
    #[arg(long, default_value_t = Config::default().waiters_per_key_max)]
    waiters_per_key_max: usize,
    /// Most unanswered requests per connection (announced in the handshake).
    #[arg(long, default_value_t = Config::default().in_flight_max)]
    in_flight_max: u32,
    /// Longest lease granted, in milliseconds.
    #[arg(long, default_value_t = Config::default().ttl_ms_max)]
    ttl_max_ms: u32,
    /// Lock-table shards.
    #[arg(long, default_value_t = Config::default().shards)]
    shards: usize,
    /// Worker threads for connections (default: one per core).
    #[arg(long)]
    threads: Option<usize>,
    /// WAL segment size in bytes; older segments are deleted after a snapshot of the live
    /// locks, so disk use follows the live state rather than history.
    #[arg(long, default_value_t = Config::default().wal_segment_size_max)]
    wal_segment_bytes: u64,
    /// Milliseconds a new connection has to finish the binary handshake or send its first
    /// whole console line; a connection silent for longer is closed.
    #[arg(long, default_value_t = millis(Config::default().handshake_timeout))]
    handshake_timeout_ms: u64,
    /// Milliseconds a connection may be idle before TCP keepalive probes start (rounded up to
    /// whole seconds, the kernel's unit).
    #[arg(long, default_value_t = millis(Config::default().keepalive_idle))]
    keepalive_idle_ms: u64,
    /// Milliseconds between unanswered keepalive probes (rounded up to whole seconds).
    #[arg(long, default_value_t = millis(Config::default().keepalive_interval))]
    keepalive_interval_ms: u64,
    /// Unanswered keepalive probes before the connection is dropped: a peer that vanished is
    /// noticed within idle + interval * count.
    #[arg(long, default_value_t = Config::default().keepalive_count)]
    keepalive_count: u32,
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let args = Args::parse();
    let config = Config {
        listen: args.listen,
        data_dir: args.data_dir,
        durability: args.durability,
        fsync: !args.no_fsync,
        connections_max: args.connections_max,
        held_max: args.held_max,
        waiters_max: args.waiters_max,
        waiters_per_key_max: args.waiters_per_key_max,
        in_flight_max: args.in_flight_max,
        ttl_ms_max: args.ttl_max_ms,
        shards: args.shards,
        wal_segment_size_max: args.wal_segment_bytes,
        handshake_timeout: Duration::from_millis(args.handshake_timeout_ms),
        keepalive_idle: Duration::from_millis(args.keepalive_idle_ms),
        keepalive_interval: Duration::from_millis(args.keepalive_interval_ms),
        keepalive_count: args.keepalive_count,
        ..Config::default()
    };
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    if let Some(threads) = args.threads {
        runtime.worker_threads(threads);
    }
    let runtime = runtime
        .enable_all()
        .build()
        .context("cannot start the runtime")?;
    runtime.block_on(async move {
        // Installed before the port is bound: a handler installed lazily, when `run` first
        // polls the future, lets a SIGTERM that arrives in between go unnoticed.
        let shutdown = shutdown_signal().context("cannot install the signal handlers")?;
        let listener = tokio::net::TcpListener::bind(config.listen)
            .await
            .with_context(|| format!("cannot listen on {}", config.listen))?;
        tenure_server::run(config, listener, shutdown).await
    })?;
    // Connections that outlived the grace period are dropped with the runtime.
    runtime.shutdown_timeout(Duration::from_millis(100));
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
