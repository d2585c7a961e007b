//! `run`: recover, accept, tick, shut down.
//!
//! Start-up replays the WAL into the lock table and syncs a first block of fencing tokens
//! before the first connection is accepted. Shutdown goes in the order that loses nothing:
//! stop accepting, let connections finish what they were answering (bounded by a grace
//! period), stop the expiry ticker, let a snapshot in progress finish, then sync and close the
//! WAL.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tenure_protocol::ErrorCode;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::admission::Admission;
use crate::clock::Clock;
use crate::config::{Config, Durability};
use crate::conn;
use crate::error::ServerError;
use crate::executor::{Executor, ExecutorParts};
use crate::http;
use crate::identity::Identities;
use crate::journal::{Journal, WalJournal};
use crate::obs::stats::Stats;
use crate::per_core::{Cores, Serving};
use crate::scrape::Scrape;
use crate::tls::{self, Tls};
use crate::wal::{self, SyncMode, WalOptions};

/// Runs the server on `listener` until `shutdown` completes.
///
/// # Errors
/// When the configuration is invalid, the WAL cannot be opened (including corruption, which
/// names the file and offset), or the first token reservation cannot be synced.
pub async fn run(
    config: Config,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    run_with_metrics(config, None, listener, None, shutdown).await
}

/// [`run`], also serving `/metrics`, `/healthz` and `/readyz` on `metrics_listener` (from
/// before recovery on; see [`crate::http`]), with the WAL in `storage` if given (as
/// [`run_with_storage`]) or else in files in `config.data_dir`.
///
/// # Errors
/// As [`run`].
pub async fn run_with_metrics(
    config: Config,
    storage: Option<Arc<dyn wal::Storage>>,
    listener: TcpListener,
    metrics_listener: Option<TcpListener>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    let listeners = Listeners::Shared(listener);
    run_on(config, storage, listeners, metrics_listener, shutdown).await
}

/// [`run_with_metrics`] in the per-core model ([`crate::per_core`]): each of `listeners`
/// (bound to one address with `SO_REUSEPORT` by [`crate::per_core::bind_reuseport`]) is
/// served by an OS thread of its own running a current-thread runtime, which also runs the
/// connections it accepts. The caller's runtime runs the expiry ticker, the reloads and the
/// HTTP endpoint. The WAL is in files in `config.data_dir`.
///
/// # Errors
/// As [`run`]; also when `listeners` is empty or a core thread cannot be started.
pub async fn run_per_core(
    config: Config,
    listeners: Vec<std::net::TcpListener>,
    metrics_listener: Option<TcpListener>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    let listeners = Listeners::PerCore(listeners);
    run_on(config, None, listeners, metrics_listener, shutdown).await
}

/// The client port's listeners, as the runtime model wants them.
enum Listeners {
    /// One listener, its connections on the caller's (work-stealing) runtime.
    Shared(TcpListener),
    /// One listener per core thread ([`crate::per_core`]).
    PerCore(Vec<std::net::TcpListener>),
}

impl Listeners {
    fn local_addr(&self) -> Result<std::net::SocketAddr, ServerError> {
        let addr = match self {
            Listeners::Shared(listener) => listener.local_addr(),
            Listeners::PerCore(listeners) => match listeners.first() {
                Some(listener) => listener.local_addr(),
                None => return Err(ServerError::Config("no listener for per-core".into())),
            },
        };
        addr.map_err(|e| ServerError::Config(format!("cannot read the listening address: {e}")))
    }

    /// The runtime model's name and how many listeners (and accept loops) it has, for the log.
    fn model(&self) -> (&'static str, usize) {
        match self {
            Listeners::Shared(_) => ("shared", 1),
            Listeners::PerCore(listeners) => ("per-core", listeners.len()),
        }
    }
}

/// Binds nothing: serves on `listeners`, with the WAL in `storage` or in `config.data_dir`.
async fn run_on(
    config: Config,
    storage: Option<Arc<dyn wal::Storage>>,
    listeners: Listeners,
    metrics_listener: Option<TcpListener>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    validate(&config)?;
    let (storage, dir_lock) = match storage {
        Some(storage) => (storage, None),
        None => {
            let dir_lock = lock_data_dir(&config.data_dir)?;
            let storage =
                wal::FsStorage::new(&config.data_dir).map_err(|source| ServerError::DataDir {
                    what: "cannot create",
                    path: config.data_dir.clone(),
                    source,
                })?;
            (Arc::new(storage) as Arc<dyn wal::Storage>, Some(dir_lock))
        }
    };
    let http = HttpTask::start(metrics_listener);
    let result = serve(config, storage, dir_lock, listeners, &http.scrape, shutdown).await;
    http.stop().await;
    result
}

/// [`run`] with the WAL kept in `storage` instead of files in `config.data_dir`, such as a
/// [`wal::FaultyStorage`] that fails writes or fsyncs on cue. The data directory's `LOCK`
/// file is not taken: whoever built `storage` answers for it having one user.
///
/// # Errors
/// As [`run`].
pub async fn run_with_storage(
    config: Config,
    storage: Arc<dyn wal::Storage>,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    run_with_metrics(config, Some(storage), listener, None, shutdown).await
}

/// The HTTP endpoint's task, if `--metrics-listen` is set.
struct HttpTask {
    scrape: Scrape,
    stop: CancellationToken,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl HttpTask {
    fn start(listener: Option<TcpListener>) -> HttpTask {
        let scrape = Scrape::default();
        let stop = CancellationToken::new();
        let task = listener.map(|l| tokio::spawn(http::serve(l, scrape.clone(), stop.clone())));
        HttpTask { scrape, stop, task }
    }

    /// Stops it and waits, so nothing holds the server's state (and its data-directory
    /// lock) once `run` returns.
    async fn stop(self) {
        self.stop.cancel();
        if let Some(task) = self.task {
            let _ = task.await;
        }
    }
}

fn validate(config: &Config) -> Result<(), ServerError> {
    config.validate().map_err(ServerError::Config)
}

/// Recovers from `storage`, then serves until `shutdown`; `dir_lock` is held meanwhile.
async fn serve(
    config: Config,
    storage: Arc<dyn wal::Storage>,
    dir_lock: Option<std::fs::File>,
    listeners: Listeners,
    scrape: &Scrape,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    let addr = listeners.local_addr()?;
    let identities = load_identities(&config, addr)?;
    let tls = load_tls(&config)?;
    let executor = recover(config, storage, dir_lock, identities).await?;
    let shared = Arc::new(executor);
    shared
        .tokens()
        .reserve()
        .await
        .map_err(ServerError::FirstReservation)?;
    let _ = scrape.executor.set(Arc::clone(&shared));

    let stop = CancellationToken::new();
    let tracker = TaskTracker::new();
    let serving = Serving {
        shared: Arc::clone(&shared),
        tls,
        tracker: tracker.clone(),
        stop: stop.clone(),
    };
    let (runtime, listeners_count) = listeners.model();
    let accepting = Accepting::start(listeners, &serving).await?;
    // `addr` as before (`Some(..)`): log readers may match it.
    let (addr, durability) = (Some(addr), shared.config().durability);
    tracing::info!(
        ?addr,
        ?durability,
        runtime,
        listeners_count,
        "tenured ready"
    );
    let snapshots = TaskTracker::new();
    let ticker = tokio::spawn(tick(Arc::clone(&shared), stop.clone(), snapshots.clone()));
    spawn_reloader(
        shared.identities().clone(),
        serving.tls.clone(),
        stop.clone(),
    )?;
    let cores = accepting.until(&serving, shutdown).await;
    stop.cancel();
    tracker.close();
    if tokio::time::timeout(shared.config().shutdown_grace, tracker.wait())
        .await
        .is_err()
    {
        tracing::warn!("connections still open after the grace period; closing them");
    }
    if let Some(cores) = cores {
        cores.halt().await;
    }
    ticker.abort();
    let _ = ticker.await;
    // A snapshot still copying on its blocking thread would append after the final sync and
    // keep the data directory locked after `run` returned: let it finish first.
    snapshots.close();
    snapshots.wait().await;
    shared
        .journal()
        .sync_and_stop()
        .map_err(ServerError::FinalSync)?;
    tracing::info!("stopped");
    Ok(())
}

/// Reads the TLS files, if TLS is configured.
pub(crate) fn load_tls(config: &Config) -> Result<Option<Arc<Tls>>, ServerError> {
    let Some(files) = &config.tls else {
        return Ok(None);
    };
    let tls = Tls::load(files.clone()).map_err(ServerError::Tls)?;
    tracing::info!(cert = %files.cert.display(), mutual = files.client_ca.is_some(), "TLS on");
    Ok(Some(Arc::new(tls)))
}

/// The client port being served, in either runtime model.
enum Accepting {
    /// The accept loop runs in [`serve`] itself, on the caller's runtime.
    Shared(TcpListener),
    /// The accept loops run on the core threads.
    PerCore(Cores),
}

impl Accepting {
    async fn start(listeners: Listeners, serving: &Serving) -> Result<Accepting, ServerError> {
        match listeners {
            Listeners::Shared(listener) => Ok(Accepting::Shared(listener)),
            Listeners::PerCore(listeners) => Cores::start(listeners, serving)
                .await
                .map(Accepting::PerCore)
                .map_err(ServerError::PerCore),
        }
    }

    /// Accepts until `shutdown`. The shared listener is closed on return; the core threads
    /// close theirs once `serving.stop` is cancelled, and are returned to be halted after
    /// the grace period (they run their connections until then).
    async fn until(
        self,
        serving: &Serving,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Option<Cores> {
        match self {
            Accepting::Shared(listener) => {
                let tls = serving.tls.clone();
                let serve = || (Arc::clone(&serving.shared), serving.stop.clone());
                tokio::select! {
                    _ = accept_loop(&listener, tls, &serving.tracker, serve) => {}
                    _ = shutdown => tracing::info!("shutting down"),
                }
                None
            }
            Accepting::PerCore(cores) => {
                shutdown.await;
                tracing::info!("shutting down");
                Some(cores)
            }
        }
    }
}

/// Reads the identities file if one is configured. Without one, only a loopback address is
/// served unless mutual TLS (a client CA) stands in for identities or `insecure_no_auth` says
/// otherwise: the secure choice is the default.
pub(crate) fn load_identities(
    config: &Config,
    addr: std::net::SocketAddr,
) -> Result<Option<Arc<Identities>>, ServerError> {
    let Some(path) = &config.identities else {
        let mutual_tls = config
            .tls
            .as_ref()
            .is_some_and(|tls| tls.client_ca.is_some());
        if !addr.ip().is_loopback() && !mutual_tls {
            if !config.insecure_no_auth {
                return Err(ServerError::NoIdentities(addr));
            }
            warn_insecure_no_auth(addr);
        }
        return Ok(None);
    };
    let identities = Identities::load(path).map_err(ServerError::Identities)?;
    tracing::info!(path = %path.display(), "identities loaded");
    Ok(Some(Arc::new(identities)))
}

/// The warning every mode logs when `--insecure-no-auth` lets it serve `addr`, a
/// non-loopback address, to anyone who can reach it.
pub(crate) fn warn_insecure_no_auth(addr: std::net::SocketAddr) {
    tracing::warn!(%addr, "serving a non-loopback address WITHOUT identities (--insecure-no-auth)");
}

/// Reloads the identities and the TLS files on every SIGHUP until `stop`. A reload that fails
/// keeps what is in force and says why in the log; connections stay open either way. With
/// neither, a SIGHUP is only logged: its default action would end the server.
pub(crate) fn spawn_reloader(
    identities: Option<Arc<Identities>>,
    tls: Option<Arc<Tls>>,
    stop: CancellationToken,
) -> Result<(), ServerError> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut hangup = signal(SignalKind::hangup())
        .map_err(|e| ServerError::Config(format!("cannot install the SIGHUP handler: {e}")))?;
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                got = hangup.recv() => if got.is_none() { return },
            }
            if let Some(tls) = &tls {
                let tls = Arc::clone(tls);
                match tokio::task::spawn_blocking(move || tls.reload()).await {
                    Ok(Ok(())) => tracing::info!("TLS certificate and key reloaded"),
                    Ok(Err(error)) => {
                        tracing::error!(%error, "TLS reload failed; the old files stay in force")
                    }
                    Err(error) => tracing::error!(%error, "TLS reload panicked"),
                }
            }
            let Some(identities) = &identities else {
                tracing::info!("SIGHUP: no identities file to reload (identities need a restart)");
                continue;
            };
            let reloaded = {
                let identities = Arc::clone(identities);
                tokio::task::spawn_blocking(move || identities.reload()).await
            };
            match reloaded {
                Ok(Ok(count)) => tracing::info!(count, "identities reloaded"),
                Ok(Err(error)) => {
                    tracing::error!(%error, "identities reload failed; the old ones stay in force")
                }
                Err(error) => tracing::error!(%error, "identities reload panicked"),
            }
        }
    });
    Ok(())
}

/// Opens the WAL in `storage` and rebuilds the lock table from it.
/// `dir_lock`, the data directory's lock, is held by the journal for as long as it lives.
async fn recover(
    config: Config,
    storage: Arc<dyn wal::Storage>,
    dir_lock: Option<std::fs::File>,
    identities: Option<Arc<Identities>>,
) -> Result<Executor, ServerError> {
    let options = WalOptions {
        sync_mode: if config.fsync {
            SyncMode::Data
        } else {
            SyncMode::Off
        },
        segment_size_max: config.wal_segment_bytes_max,
        token_floor_margin: config.token_block,
        ..WalOptions::default()
    };
    let dir = storage.path("");
    // Real time on purpose: this only measures how long recovery took, for the log.
    let started = std::time::Instant::now();
    // Replay, restore and the collection after them run on one thread: the replayed copy of
    // the leases was allocated by this thread's allocator heap, and a forced collection only
    // returns the freed pages of the calling thread's heap to the OS. Meanwhile freed memory
    // goes back at once (see `PurgeAtOnce`), so none waits for a purge that would come late.
    let (shared, torn_tail_truncated) = tokio::task::spawn_blocking(move || {
        let purge_at_once = crate::memory::PurgeAtOnce::start();
        let (wal, recovered) = wal::open_with_storage(storage, options)
            .map_err(|source| ServerError::Recovery { dir, source })?;
        let clock = Clock::start();
        let now_ms = clock.now_ms();
        // In token-only mode held locks were not logged, so any of them may still be in use:
        // wait out the longest lease this server grants before granting again. Any segment or
        // floor file means a server ran here, even if a disk lost every record it wrote.
        let log_existed = recovered.segments > 0 || recovered.token_floor > 0;
        let refused_until_ms = match config.durability {
            Durability::Tokens if log_existed => now_ms + u64::from(config.ttl_ms_max),
            _ => 0,
        };
        let leases = recovered.leases.len();
        let journal: Arc<dyn Journal> = Arc::new(WalJournal::new(wal, config.durability, dir_lock));
        let shared = Executor::new(ExecutorParts {
            grants_refused_until_ms: refused_until_ms,
            identities,
            ..ExecutorParts::new(config, clock, journal, recovered.token_floor)
        });
        shared
            .stats()
            .metrics
            .recovered(started.elapsed(), refused_until_ms);
        shared.restore(now_ms, recovered.leases);
        // The replayed copy of the leases is gone; its memory goes back now, not whenever
        // the allocator next gets to it.
        crate::memory::release_freed();
        drop(purge_at_once);
        tracing::info!(
            leases,
            token_floor = recovered.token_floor,
            records = recovered.records,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "recovered from the WAL"
        );
        Ok::<_, ServerError>((shared, recovered.torn_tail_truncated))
    })
    .await
    .map_err(ServerError::RecoveryPanicked)??;
    if let Some((path, offset)) = &torn_tail_truncated {
        tracing::warn!(path = %path.display(), offset, "truncated a torn record at the end of the WAL");
    }
    Ok(shared)
}

/// Takes an exclusive lock on `data_dir/LOCK` for the life of the server: two servers
/// appending to one log would each hand out the same fencing tokens.
pub(crate) fn lock_data_dir(dir: &std::path::Path) -> Result<std::fs::File, ServerError> {
    let io_error = |what, path: &std::path::Path| {
        let path = path.to_path_buf();
        move |source| ServerError::DataDir { what, path, source }
    };
    std::fs::create_dir_all(dir).map_err(io_error("cannot create", dir))?;
    let path = dir.join("LOCK");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(io_error("cannot open", &path))?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => Err(ServerError::DataDirInUse(dir.to_path_buf())),
        Err(std::fs::TryLockError::Error(e)) => Err(io_error("cannot lock", &path)(e)),
    }
}

/// Accepts client connections for ever, each served by the executor `serving` names when
/// it arrives and ended by the token it names with it (a single node: its one executor and
/// the server's stop; a cluster node: whichever executor is current, leader or follower,
/// and that term's stop). The connection limit, keepalive, TLS and the connection counters
/// (on the executor serving) are the same in both modes.
pub(crate) async fn accept_loop(
    listener: &TcpListener,
    tls: Option<Arc<Tls>>,
    tracker: &TaskTracker,
    serving: impl Fn() -> (Arc<Executor>, CancellationToken),
) {
    // Every executor of a process shares its configuration.
    let accept = AcceptShared::new(&serving().0.config());
    accept_loop_shared(listener, tls, tracker, serving, &accept).await;
}

/// What all accept loops of one server share, however many threads accept.
pub(crate) struct AcceptShared {
    /// The connection limit: one permit per open connection, server-wide.
    permits: Arc<Semaphore>,
    /// The last connection id handed out. An id names its connection in the watch registry,
    /// so two accept loops must never hand out the same one.
    conn_id_last: AtomicU64,
    /// The bounds on connections that have not authenticated yet; `None` when the server
    /// does not authenticate (nothing to wait for).
    admission: Option<Arc<Admission>>,
}

impl AcceptShared {
    /// Room for `config.connections_max` connections, and for the unauthenticated ones
    /// `config` allows; ids start at 1.
    pub(crate) fn new(config: &Config) -> AcceptShared {
        let admission = config.authenticates().then(|| {
            let per_address_max = config.unauthenticated_per_address_max;
            Arc::new(Admission::new(
                per_address_max,
                config.unauthenticated_max(),
            ))
        });
        AcceptShared {
            permits: Arc::new(Semaphore::new(config.connections_max)),
            conn_id_last: AtomicU64::new(0),
            admission,
        }
    }
}

/// [`accept_loop`] as one of several accepting for one server (the per-core model), with
/// the connection limit and the connection ids in `accept` shared between them.
pub(crate) async fn accept_loop_shared(
    listener: &TcpListener,
    tls: Option<Arc<Tls>>,
    tracker: &TaskTracker,
    serving: impl Fn() -> (Arc<Executor>, CancellationToken),
    accept: &AcceptShared,
) {
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of file descriptors and the like: back off instead of spinning.
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let conn_id = accept.conn_id_last.fetch_add(1, Ordering::Relaxed) + 1;
        let (shared, stop) = serving();
        let Ok(permit) = Arc::clone(&accept.permits).try_acquire_owned() else {
            Stats::bump(&shared.stats().connections_refused);
            // A plain-text refusal would read as a broken handshake to a TLS client, and a
            // TLS handshake is work the server is out of room for: a TLS port just closes.
            if tls.is_none() {
                tracker.spawn(refuse(stream, shared.config().connections_max));
            }
            continue;
        };
        Stats::bump(&shared.stats().connections_total);
        // From here on a silent socket has the handshake limit in all, TLS, opening and AUTH
        // together, and an unauthenticated one holds a bounded place (see `admission`).
        let opening = conn::Opening {
            deadline: tokio::time::Instant::now() + shared.config().handshake_timeout,
            pending: accept
                .admission
                .as_ref()
                .map(|a| a.admit(conn_id, peer.ip())),
        };
        if let Err(e) = set_keepalive(&stream, &shared.config()) {
            tracing::warn!(error = %e, "cannot enable TCP keepalive on an accepted socket");
        }
        // Small replies must not wait for Nagle's algorithm.
        let _ = stream.set_nodelay(true);
        let tls = tls.clone();
        tracker.spawn(async move {
            Stats::bump(&shared.stats().connections);
            let accepted = Accepted {
                stream,
                peer,
                conn_id,
                opening,
            };
            serve_accepted(Arc::clone(&shared), tls, accepted, stop).await;
            shared
                .stats()
                .connections
                .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
            drop(permit);
        });
    }
}

/// An accepted connection, as the accept loop hands it on.
struct Accepted {
    stream: TcpStream,
    peer: std::net::SocketAddr,
    conn_id: u64,
    opening: conn::Opening,
}

/// Serves `accepted` through its TLS handshake, if the port has TLS, then as a connection.
async fn serve_accepted(
    executor: Arc<Executor>,
    tls: Option<Arc<Tls>>,
    accepted: Accepted,
    stop: CancellationToken,
) {
    let Accepted {
        stream,
        peer,
        conn_id,
        opening,
    } = accepted;
    let Some(tls) = tls else {
        return conn::serve(executor, stream, peer, None, conn_id, stop, opening).await;
    };
    let limit = executor.config().handshake_timeout;
    let handshake = tokio::select! {
        done = tls.accept(stream, limit) => Some(done),
        _ = stop.cancelled() => Some(None),
        // Evicted mid-handshake: closed, and not a failed handshake.
        _ = conn::evicted(&opening.pending) => None,
    };
    match handshake {
        Some(Some(tls::Accepted { stream, peer_name })) => {
            conn::serve(executor, stream, peer, peer_name, conn_id, stop, opening).await
        }
        Some(None) => executor.stats().metrics.tls_refused(),
        None => executor.stats().metrics.evicted(),
    }
}

/// Turns on TCP keepalive with the configured timing, so that a peer that vanished without
/// closing (power loss, a cable pulled, a NAT that forgot the flow) is dropped within
/// `keepalive_idle + keepalive_interval * keepalive_count` instead of never; its waiters and
/// release-on-disconnect locks then go as on any close.
///
/// # Errors
/// When the kernel refuses one of the options.
pub fn set_keepalive(stream: &TcpStream, config: &Config) -> std::io::Result<()> {
    use crate::config::keepalive_secs;
    let keepalive = socket2::TcpKeepalive::new()
        .with_time(Duration::from_secs(keepalive_secs(config.keepalive_idle)))
        .with_interval(Duration::from_secs(keepalive_secs(
            config.keepalive_interval,
        )))
        .with_retries(config.keepalive_count);
    socket2::SockRef::from(stream).set_tcp_keepalive(&keepalive)
}

/// Tells a connection over the limit why it is being closed, in the console's words (a binary
/// client reads a failed handshake; it reports the connection closed).
async fn refuse(mut stream: TcpStream, connections_max: usize) {
    let line = format!(
        "ERR {} server has {connections_max} connections already\n",
        ErrorCode::ConnectionsLimit.name()
    );
    let _ = tokio::time::timeout(Duration::from_secs(1), stream.write_all(line.as_bytes())).await;
}

/// Expires leases and times out waiters, every `tick_interval`, bounded per shard per pass.
/// Snapshots run on blocking threads tracked by `snapshots`.
pub(crate) async fn tick(shared: Arc<Executor>, stop: CancellationToken, snapshots: TaskTracker) {
    let mut interval = tokio::time::interval(shared.config().tick_interval);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let budget = shared.config().expirations_per_tick_max;
    let mut events = Vec::new();
    let snapshotting = Arc::new(AtomicBool::new(false));
    while !stop.is_cancelled() {
        interval.tick().await;
        let now_ms = shared.clock().now_ms();
        for shard in shared.shards() {
            let mut shard = shard.lock().expect("shard poisoned");
            // Whatever the budget leaves is picked up on the next tick.
            shard.advance(now_ms, budget, &shared.tokens().allocator, &mut events);
            shared.apply_events(&mut shard, now_ms, &mut events);
        }
        // The copy takes a while at a million locks: run it on a blocking thread, one at a
        // time, so neither the ticker nor a runtime worker waits for it.
        if shared.journal().snapshot_due() && !snapshotting.swap(true, Ordering::AcqRel) {
            let (shared, snapshotting) = (Arc::clone(&shared), Arc::clone(&snapshotting));
            snapshots.spawn_blocking(move || {
                shared.journal().snapshot(&*shared);
                snapshotting.store(false, Ordering::Release);
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn keepalive_options_are_set_as_configured() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap());
        let (client, accepted) = tokio::join!(client, listener.accept());
        let (_client, (accepted, _)) = (client.unwrap(), accepted.unwrap());
        let socket = socket2::SockRef::from(&accepted);
        assert!(!socket.keepalive().unwrap(), "off before");
        let config = Config {
            keepalive_idle: Duration::from_millis(1500), // rounded up to whole seconds
            keepalive_interval: Duration::from_secs(3),
            keepalive_count: 4,
            ..Config::default()
        };
        set_keepalive(&accepted, &config).unwrap();
        assert!(socket.keepalive().unwrap());
        assert_eq!(socket.tcp_keepalive_time().unwrap(), Duration::from_secs(2));
        assert_eq!(
            socket.tcp_keepalive_interval().unwrap(),
            Duration::from_secs(3)
        );
        assert_eq!(socket.tcp_keepalive_retries().unwrap(), 4);
    }
}
