//! The per-core runtime model: `n` OS threads, each running a tokio current-thread runtime
//! with a listener of its own on the one client address (`SO_REUSEPORT`).
//!
//! The kernel spreads new connections over the listeners, and a connection's reads, writes
//! and wake-ups then stay on the thread that accepted it: no work stealing and no
//! cross-core wake-up for a request that only touches its own connection. What is shared
//! stays shared: the lock table's shards (each behind its own mutex), the journal, the
//! token allocator and the counters, so a waiter on one thread is handed a lock released on
//! another exactly as before. The accept loops share one connection limit and one sequence
//! of connection ids (`accept::AcceptShared`).
//!
//! The runtime that calls [`crate::run_per_core`] keeps the rest: the one expiry
//! ticker, signals, reloads and the HTTP endpoint.
//!
//! ```text
//!                    kernel (SO_REUSEPORT group on one port)
//!              ┌───────────────┬───────────────┬──────────────┐
//!   tenure-core-0:         tenure-core-1:       ...     tenure-core-(n-1):
//!   listener, accept loop, its connections (current-thread runtime each)
//!              └───────── shards, journal, tokens, stats ─────┘
//!   caller's runtime: ticker, signals, SIGHUP reloads, /metrics
//! ```

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::accept::{accept_loop_shared, AcceptShared};
use crate::executor::Executor;
use crate::tls::Tls;

/// The listen backlog of each per-core listener, as tokio's `TcpListener::bind` uses.
const BACKLOG_MAX: i32 = 1024;

/// How long a core thread's runtime waits, once halted, for tasks still running (those
/// that outlived the shutdown grace period) before dropping them.
const HALT_WAIT_MAX: Duration = Duration::from_millis(100);

/// Most per-core listeners one server binds: far above any core count, low enough that a
/// typo in `--threads` is refused before it starts a thread per listener.
pub const CORES_MAX: usize = 1024;

/// Binds `count` listeners to `addr`, all with `SO_REUSEPORT`, so the kernel spreads
/// connections over them. With port 0 the first picks the port and the others join it.
///
/// A listener with `SO_REUSEPORT` lets another socket of the same user bind the same port,
/// and a second `tenured --runtime per-core` started by mistake on the same address would
/// then take half the connections with a lock table of its own. So a fixed port is first
/// bound once without `SO_REUSEPORT`: that fails if anything listens there already.
///
/// # Errors
/// When the address is in use or a socket option or bind is refused.
///
/// # Panics
/// When `count` is 0 or over [`CORES_MAX`].
pub fn bind_reuseport(addr: SocketAddr, count: usize) -> io::Result<Vec<std::net::TcpListener>> {
    assert!(
        (1..=CORES_MAX).contains(&count),
        "listener count {count} out of range"
    );
    if addr.port() != 0 {
        drop(bind_one(addr, false)?);
    }
    let first = bind_one(addr, true)?;
    let addr = first.local_addr()?;
    let mut listeners = vec![first];
    for _ in 1..count {
        listeners.push(bind_one(addr, true)?);
    }
    Ok(listeners)
}

/// One non-blocking listener on `addr`, with `SO_REUSEADDR` (as tokio sets it, so a port
/// in TIME_WAIT can be bound again) and, if `reuse_port`, `SO_REUSEPORT`.
fn bind_one(addr: SocketAddr, reuse_port: bool) -> io::Result<std::net::TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    socket.set_reuse_address(true)?;
    if reuse_port {
        socket.set_reuse_port(true)?;
    }
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    socket.listen(BACKLOG_MAX)?;
    Ok(socket.into())
}

/// The running core threads. Dropping it tells them to stop accepting and to end, without
/// waiting; [`Cores::halt`] also waits for them.
pub(crate) struct Cores {
    threads: Vec<JoinHandle<()>>,
    /// Ends the accept loops (it is also the connections' stop).
    stop: CancellationToken,
    /// Ends each thread's runtime, and with it the tasks still on it.
    halt: CancellationToken,
}

/// What every core thread serves with.
pub(crate) struct Serving {
    /// The one executor.
    pub shared: Arc<Executor>,
    /// TLS on the client port, if on.
    pub tls: Option<Arc<Tls>>,
    /// Tracks every connection task, on whichever thread, for the shutdown grace period.
    pub tracker: TaskTracker,
    /// Stops accepting and tells connections to finish.
    pub stop: CancellationToken,
}

impl Cores {
    /// Starts one thread per listener, named `tenure-core-<i>`, each accepting on its
    /// listener and running the connections it accepts, until `serving.stop`. Returns once
    /// every thread runs its runtime.
    ///
    /// # Errors
    /// When a runtime cannot be built, a listener cannot be registered with it or a thread
    /// cannot be spawned; threads already started are told to end.
    pub(crate) async fn start(
        listeners: Vec<std::net::TcpListener>,
        serving: &Serving,
    ) -> io::Result<Cores> {
        let accept = Arc::new(AcceptShared::new(serving.shared.config()));
        let mut cores = Cores {
            threads: Vec::with_capacity(listeners.len()),
            stop: serving.stop.clone(),
            halt: CancellationToken::new(),
        };
        for (i, listener) in listeners.into_iter().enumerate() {
            let core = Core {
                listener,
                accept: Arc::clone(&accept),
                shared: Arc::clone(&serving.shared),
                tls: serving.tls.clone(),
                tracker: serving.tracker.clone(),
                stop: serving.stop.clone(),
                halt: cores.halt.clone(),
            };
            let (ready, started) = tokio::sync::oneshot::channel();
            // The runtime is built on its thread: a runtime dropped inside an async context
            // (this one, on an error) panics.
            let thread = std::thread::Builder::new()
                .name(format!("tenure-core-{i}"))
                .spawn(move || core.run(ready))?;
            cores.threads.push(thread);
            match started.await {
                Ok(result) => result?,
                Err(_) => return Err(io::Error::other("a core thread ended while starting")),
            }
        }
        Ok(cores)
    }

    /// Ends the threads, dropping any connection still on them, and waits until they have
    /// ended. Called once the shutdown grace period is over.
    pub(crate) async fn halt(mut self) {
        self.stop.cancel();
        self.halt.cancel();
        let threads = std::mem::take(&mut self.threads);
        // Joining blocks, so off the async thread; each join is bounded by HALT_WAIT_MAX.
        let joined = tokio::task::spawn_blocking(move || {
            for thread in threads {
                if thread.join().is_err() {
                    tracing::error!("a core thread panicked");
                }
            }
        });
        let _ = joined.await;
    }
}

impl Drop for Cores {
    fn drop(&mut self) {
        self.stop.cancel();
        self.halt.cancel();
    }
}

/// One core thread's share of the work.
struct Core {
    listener: std::net::TcpListener,
    accept: Arc<AcceptShared>,
    shared: Arc<Executor>,
    tls: Option<Arc<Tls>>,
    tracker: TaskTracker,
    stop: CancellationToken,
    halt: CancellationToken,
}

impl Core {
    /// Builds this thread's runtime and says on `ready` whether it could. Then accepts until
    /// `stop`, and keeps running the connections it accepted (a current-thread runtime runs
    /// its tasks only inside `block_on`) until `halt`.
    fn run(self, ready: tokio::sync::oneshot::Sender<io::Result<()>>) {
        let (runtime, listener) = match runtime_for(self.listener) {
            Ok(started) => started,
            Err(e) => {
                let _ = ready.send(Err(e));
                return;
            }
        };
        let _ = ready.send(Ok(()));
        let Core {
            accept,
            shared,
            tls,
            tracker,
            stop,
            halt,
            ..
        } = self;
        runtime.block_on(async {
            let serving = || (Arc::clone(&shared), stop.clone());
            tokio::select! {
                _ = accept_loop_shared(&listener, tls, &tracker, serving, &accept) => {}
                _ = stop.cancelled() => {}
            }
            drop(listener);
            halt.cancelled().await;
        });
        runtime.shutdown_timeout(HALT_WAIT_MAX);
    }
}

/// A current-thread runtime, and `listener` registered with its I/O driver.
fn runtime_for(
    listener: std::net::TcpListener,
) -> io::Result<(tokio::runtime::Runtime, TcpListener)> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let listener = {
        let _entered = runtime.enter();
        TcpListener::from_std(listener)?
    };
    Ok((runtime, listener))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn port_zero_binds_every_listener_to_the_port_the_first_got() {
        let listeners = bind_reuseport("127.0.0.1:0".parse().unwrap(), 3).unwrap();
        let addrs: Vec<_> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
        assert_ne!(addrs[0].port(), 0);
        assert!(addrs.iter().all(|a| *a == addrs[0]), "{addrs:?}");
    }

    #[test]
    fn a_port_in_use_is_refused_even_by_a_reuseport_group() {
        let taken = bind_reuseport("127.0.0.1:0".parse().unwrap(), 2).unwrap();
        let addr = taken[0].local_addr().unwrap();
        let err = bind_reuseport(addr, 2).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::AddrInUse, "{err}");
    }
}
