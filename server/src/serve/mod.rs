//! The composition root: `run` builds the server from its parts (recovery, the executor, the
//! accept loops, the ticker, the HTTP endpoint and its scrape) and shuts it down.
//!
//! Start-up replays the WAL into the lock table and syncs a first block of fencing tokens
//! before the first connection is accepted. Shutdown goes in the order that loses nothing:
//! stop accepting, let connections finish what they were answering (bounded by a grace
//! period), stop the expiry ticker, let a snapshot in progress finish, then sync and close the
//! WAL.

pub mod per_core;
mod recovery;

use std::future::Future;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::accept::accept_loop;
use crate::config::Config;
use crate::error::ServerError;
use crate::executor::{tick, Executor};
use crate::http;
use crate::scrape::Scrape;
use crate::startup::{load_identities, load_tls, lock_data_dir, spawn_reloader, DirMode};
use crate::wal;
use per_core::{Cores, Serving};
use recovery::recover;

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

/// [`run_with_metrics`] in the per-core model ([`per_core`]): each of `listeners`
/// (bound to one address with `SO_REUSEPORT` by [`per_core::bind_reuseport`]) is
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
    /// One listener per core thread ([`per_core`]).
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
            let dir_lock = lock_data_dir(&config.data_dir, DirMode::Single)?;
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
    // Before "ready": a SIGHUP sent once the server says it is ready must find its handler
    // (the signal's default action would end the process).
    spawn_reloader(
        shared.identities().clone(),
        serving.tls.clone(),
        stop.clone(),
    )?;
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
    let cores = accepting.until(&serving, shutdown).await;
    let stopping = Stopping {
        shared,
        stop,
        tracker,
        cores,
        ticker,
        snapshots,
    };
    stopping.shut_down().await
}

/// What `serve` stops, in order, once `shutdown` came.
struct Stopping {
    shared: Arc<Executor>,
    stop: CancellationToken,
    tracker: TaskTracker,
    cores: Option<Cores>,
    ticker: tokio::task::JoinHandle<()>,
    snapshots: TaskTracker,
}

impl Stopping {
    /// Stops accepting, lets connections finish within the grace period, stops the ticker
    /// and any snapshot, then syncs and closes the journal.
    async fn shut_down(self) -> Result<(), ServerError> {
        let Stopping {
            shared,
            stop,
            tracker,
            cores,
            ticker,
            snapshots,
        } = self;
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
