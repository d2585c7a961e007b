//! The one accept loop both modes use: the connection limit, connection ids, keepalive, the
//! TLS handshake and the hand-off to [`crate::conn`]. The single-node server (`serve`) and
//! a cluster node (`cluster`) each run it with the executor serving now.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tenure_protocol::ErrorCode;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::admission::Admission;
use crate::config::Config;
use crate::conn;
use crate::executor::Executor;
use crate::obs::stats::Stats;
use crate::tls::{self, Tls};

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
    let accept = AcceptShared::new(serving().0.config());
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
        let arrival = Arrival {
            stream,
            peer,
            conn_id,
            executor: shared,
            stop,
            tls: tls.clone(),
        };
        match Arc::clone(&accept.permits).try_acquire_owned() {
            Ok(permit) => arrival.start(permit, accept.admission.as_ref(), tracker),
            // Full, with a connection that has not authenticated: it makes room, and the
            // newcomer waits for its place to come back (its close is prompt).
            Err(_) if accept.admission.as_ref().is_some_and(|a| a.evict_oldest()) => {
                let permits = Arc::clone(&accept.permits);
                let admission = accept.admission.clone();
                let spawner = tracker.clone();
                tracker.spawn(async move {
                    let wait = tokio::time::timeout(EVICTED_CLOSE_MAX, permits.acquire_owned());
                    match wait.await {
                        Ok(Ok(permit)) => arrival.start(permit, admission.as_ref(), &spawner),
                        _ => arrival.refuse().await,
                    }
                });
            }
            Err(_) => {
                tracker.spawn(arrival.refuse());
            }
        }
    }
}

/// Longest a newcomer at the connection limit waits for the place of the unauthenticated
/// connection evicted for it ([`Admission::evict_oldest`]); that one closes at once, so
/// this is only a bound (past it the newcomer is refused as without one).
const EVICTED_CLOSE_MAX: Duration = Duration::from_secs(1);

/// A connection just accepted, before it has a place.
struct Arrival {
    stream: TcpStream,
    peer: std::net::SocketAddr,
    conn_id: u64,
    executor: Arc<Executor>,
    stop: CancellationToken,
    tls: Option<Arc<Tls>>,
}

impl Arrival {
    /// Serves the connection in the place `permit` holds, on a task of `tracker`.
    fn start(
        self,
        permit: tokio::sync::OwnedSemaphorePermit,
        admission: Option<&Arc<Admission>>,
        tracker: &TaskTracker,
    ) {
        let Arrival {
            stream,
            peer,
            conn_id,
            executor: shared,
            stop,
            tls,
        } = self;
        Stats::bump(&shared.stats().connections_total);
        // From here on a silent socket has the handshake limit in all, TLS, opening and AUTH
        // together, and an unauthenticated one holds a bounded place (see `admission`).
        let opening = conn::Opening {
            deadline: tokio::time::Instant::now() + shared.config().handshake_timeout,
            pending: admission.map(|a| a.admit(conn_id, peer.ip())),
            place: Some(permit),
        };
        if let Err(e) = set_keepalive(&stream, shared.config()) {
            tracing::warn!(error = %e, "cannot enable TCP keepalive on an accepted socket");
        }
        // Small replies must not wait for Nagle's algorithm.
        let _ = stream.set_nodelay(true);
        tracker.spawn(async move {
            Stats::bump(&shared.stats().connections);
            let accepted = Accepted {
                stream,
                peer,
                conn_id,
                opening,
            };
            // The connection's place goes with `opening`, given back when it ends.
            serve_accepted(Arc::clone(&shared), tls, accepted, stop).await;
            shared
                .stats()
                .connections
                .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        });
    }

    /// Refuses the connection: the server has `--connections-max` connections, all
    /// authenticated (or it does not authenticate).
    async fn refuse(self) {
        Stats::bump(&self.executor.stats().connections_refused);
        // A plain-text refusal would read as a broken handshake to a TLS client, and a
        // TLS handshake is work the server is out of room for: a TLS port just closes.
        if self.tls.is_some() {
            return;
        }
        // Said in the console's words; a binary client reads a failed handshake and reports
        // the connection closed.
        let line = format!(
            "ERR {} server has {} connections already\n",
            ErrorCode::ConnectionsLimit.name(),
            self.executor.config().connections_max
        );
        let mut stream = self.stream;
        let _ =
            tokio::time::timeout(Duration::from_secs(1), stream.write_all(line.as_bytes())).await;
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
