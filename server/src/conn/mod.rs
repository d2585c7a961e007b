//! One client connection, binary or console, from its first byte to its close.
//!
//! The first byte decides the surface: the binary handshake starts with `0x00`, which no text
//! command does. After that both surfaces share one loop:
//!
//! ```text
//!   read ──► decode every whole frame/line ──► Executor::execute ─► reply queue ──► write
//!                                                   │                    ▲
//!                              queued acquire ──────┴──► waits ──────────┘
//!                                                              (grant, time-out)
//! ```
//!
//! Replies wait in the queue until the journal is durable past the change they report, then are
//! encoded into one write buffer, which is written when everything read so far is handled
//! (one write per batch of pipelined requests, not per reply). The loop owns the socket, so a
//! slow reader only ever stalls itself: the table, the ticker and other connections never
//! wait on it. Anything malformed is answered with an error; anything that breaks the framing
//! closes this connection and nothing else, after answering what came before it.
//!
//! A connection that does not finish its handshake (or first console line) within the
//! configured limit is closed. On shutdown it stops reading, answers what it has read, cancels
//! its waiters with `SHUTTING_DOWN`, and closes.
//!
//! # Layout
//! - this file: accepting the opening (handshake or first line) and the connection's loop.
//! - `surface`: binary frames and console lines, in and out.
//! - `requests`: running requests, and the answers that come later (waiters, token retries).
//! - `reply`: the reply queue, held until the journal is durable, and watch events.
//! - `ctx`: [`Session`], what the connection must take back when it closes.
//! - `auth`: AUTH, and each request checked against the connection's identity.
//! - `transport`: plain TCP or TLS underneath.

mod auth;
mod reply;
mod requests;
mod surface;
mod transport;

pub use crate::executor::{Auth, Credential, Session};
pub use transport::Transport;

use std::collections::VecDeque;
use std::sync::Arc;

use bytes::BytesMut;
use futures_util::future::BoxFuture;
use futures_util::stream::{FuturesUnordered, StreamExt};
use futures_util::FutureExt;
use tenure_protocol::frame::REQUEST_ID_NONE;
use tenure_protocol::handshake::{Hello, HelloAck, ServerLimits, HELLO_LEN, VERSION};
use tenure_protocol::{ErrorCode, Response};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

use crate::admission::{ClosingPlace, Evicted, PendingPlace};
use crate::config::READ_BUFFER_MAX;
use crate::executor::Executor;
use crate::executor::WaitResult;
use crate::executor::WatchEvent;
use crate::identity::ConnectionPlace;
use crate::journal::TICKET_NOW;
use crate::linger::linger;
use crate::obs::metrics::{self, Timing};
use reply::PendingReply;
use requests::Later;
use surface::{Fatal, Surface};

/// Longest a closing connection's last write (its reason, a TLS close) may wait for a peer
/// that does not read before the connection is dropped without it.
const CLOSING_WRITE_MAX: std::time::Duration = std::time::Duration::from_secs(1);
/// Longest a stopping connection waits for what its peer had sent before the stop
/// ([`Conn::stop`]): long enough for a loaded runtime's reactor to see it, short against a
/// shutdown's grace period.
const STOP_READ_WAIT: std::time::Duration = std::time::Duration::from_millis(100);

/// How an accepted connection starts: the time limit on its opening and AUTH, and its place
/// among the connections that have not authenticated yet.
pub struct Opening {
    /// The accept plus the handshake limit: the TLS handshake, the opening and (with
    /// identities) a successful AUTH must all be done by then, or the connection closes.
    pub deadline: tokio::time::Instant,
    /// Its place among the unauthenticated connections, when the server authenticates;
    /// given back once the connection proves who it is.
    pub pending: Option<PendingPlace>,
    /// Its place under `--connections-max`, given back when the connection ends (or, once
    /// evicted, when it starts closing: [`PendingPlace::into_closing`]).
    pub place: Option<tokio::sync::OwnedSemaphorePermit>,
}

/// Completes when `pending`'s connection is evicted; never without a place.
pub async fn evicted(pending: &Option<PendingPlace>) -> Evicted {
    match pending {
        Some(place) => place.evicted().await,
        None => std::future::pending().await,
    }
}

/// Serves one accepted connection until the peer leaves, a fatal error, or shutdown.
/// `peer_name` is the verified client certificate's name (mutual TLS): when an identity has
/// that name, the connection starts authenticated as it.
pub async fn serve(
    executor: Arc<Executor>,
    stream: impl Into<Transport>,
    peer: std::net::SocketAddr,
    peer_name: Option<String>,
    conn_id: u64,
    shutdown: CancellationToken,
    opening: Opening,
) {
    let mut stream = stream.into();
    let mut rbuf = BytesMut::with_capacity(16 * 1024);
    let opened = open_in_time(&executor, &mut stream, &mut rbuf, &opening, &shutdown);
    let surface = match opened.await {
        Ok(Some(surface)) => surface,
        Ok(None) => return,
        Err(why) => {
            let limit = executor.config().handshake_timeout;
            tracing::debug!(conn_id, %peer, ?limit, "{why}");
            return;
        }
    };
    let mut ctx = Session::with_peer(conn_id, peer);
    let (auth, refusal) = start_auth(&executor, peer_name, conn_id);
    let auth_deadline = matches!(auth, Auth::Pending { .. }).then_some(opening.deadline);
    ctx.auth = auth;
    let kind = match surface {
        Surface::Binary => metrics::Surface::Binary,
        Surface::Console { .. } => metrics::Surface::Console,
    };
    executor.stats().metrics.connection(kind, true);
    let opened = Opened {
        stream,
        surface,
        rbuf,
        ctx,
        auth_deadline,
    };
    let mut conn = Conn::opened(executor, opened, opening);
    match refusal {
        Ok(place) => conn.identity_place = place,
        Err(message) => conn.close_with(ErrorCode::ConnectionsLimit, message),
    }
    if let Err(e) = conn.run(&shutdown).await {
        tracing::debug!(conn_id, error = %e, "connection ended with an I/O error");
    }
    conn.finish();
    conn.executor.stats().metrics.connection(kind, false);
}

/// What a connection has once it opened: its stream, surface and read buffer, its session,
/// and its AUTH deadline if it must authenticate.
struct Opened {
    stream: Transport,
    surface: Surface,
    rbuf: BytesMut,
    ctx: Session,
    auth_deadline: Option<tokio::time::Instant>,
}

impl Conn {
    /// The connection `opened` in its `opening`'s places, nothing read or queued yet.
    fn opened(executor: Arc<Executor>, opened: Opened, opening: Opening) -> Conn {
        let Opened {
            stream,
            surface,
            rbuf,
            ctx,
            auth_deadline,
        } = opened;
        // Proved by its certificate, or nothing to prove: no longer pending.
        let pending = opening.pending.filter(|_| auth_deadline.is_some());
        let identity_changes = executor.identities().as_ref().map(|i| i.subscribe());
        Conn {
            executor,
            stream,
            surface,
            rbuf,
            wbuf: BytesMut::with_capacity(16 * 1024),
            queue: VecDeque::new(),
            later: FuturesUnordered::new(),
            answers_due: 0,
            events_queued: 0,
            identity_changes,
            ctx,
            closing: false,
            fatal: false,
            stopping: false,
            fatal_error: None,
            timing: None,
            authenticating: false,
            auth_deadline,
            cancel_reasons: std::collections::HashMap::new(),
            pending,
            identity_place: None,
            place: opening.place,
            closing_place: None,
            linger: true,
        }
    }
}

/// The connection's opening (a binary handshake or a first console line) within its
/// deadline: `Ok(None)` on shutdown or a refused handshake, `Err` with why it was closed.
async fn open_in_time(
    executor: &Arc<Executor>,
    stream: &mut Transport,
    rbuf: &mut BytesMut,
    opening: &Opening,
    shutdown: &CancellationToken,
) -> Result<Option<Surface>, &'static str> {
    tokio::select! {
        opened = tokio::time::timeout_at(opening.deadline, open(executor, stream, rbuf)) => {
            opened.map_err(|_| "no handshake or first line in time; closed")
        }
        _ = shutdown.cancelled() => Ok(None),
        _ = evicted(&opening.pending) => {
            executor.stats().metrics.evicted();
            Err("evicted before its opening; closed")
        }
    }
}

/// A new connection's standing: authenticated as the identity its client certificate names
/// (with that identity's connection place, or the refusal if it has none left), pending an
/// AUTH, or open when there are no identities.
fn start_auth(
    executor: &Executor,
    peer_name: Option<String>,
    conn_id: u64,
) -> (Auth, Result<Option<ConnectionPlace>, String>) {
    let Some(identities) = &executor.identities() else {
        return (Auth::Open, Ok(None));
    };
    let identity = peer_name.and_then(|name| identities.get(&name));
    let Some(identity) = identity else {
        return (Auth::Pending { failures: 0 }, Ok(None));
    };
    let name = identity.name.clone();
    tracing::debug!(conn_id, identity = %name, "authenticated by client certificate");
    let usage = identities.usage(&name);
    let place = auth::take_connection_place(&identity, &usage).map(Some);
    let credential = Credential::Certificate;
    let auth = Auth::As {
        name,
        usage,
        credential,
    };
    (auth, place)
}

/// Reads a connection's opening, which must arrive within the handshake limit: the binary
/// handshake (answered here), or a first whole, non-blank console line (left in `rbuf` for the loop; so
/// is an over-long first line, which the loop then refuses). `None` if it must close.
async fn open(executor: &Executor, stream: &mut Transport, rbuf: &mut BytesMut) -> Option<Surface> {
    loop {
        // Blank lines get no reply, so they do not count as an opening: a peer sending only
        // newlines is as silent as one sending nothing. A binary hello never starts with
        // white space, so dropping it cannot eat one.
        let blank = rbuf.iter().take_while(|b| b.is_ascii_whitespace()).count();
        let _ = rbuf.split_to(blank);
        if !rbuf.is_empty() {
            break;
        }
        if stream.read_buf(rbuf).await.ok()? == 0 {
            return None;
        }
    }
    if rbuf[0] == 0x00 {
        handshake(executor, stream, rbuf).await?;
        return Some(Surface::Binary);
    }
    while !rbuf.contains(&b'\n') && !surface::unterminated_too_long(rbuf) {
        if stream.read_buf(rbuf).await.ok()? == 0 {
            return None; // a line without its end is never run
        }
    }
    Some(Surface::Console {
        line_no: 0,
        text: String::new(),
    })
}

/// Completes the binary handshake; `None` if the connection must close. A hello the server
/// cannot accept (wrong magic, a reserved flag set, another version) is answered with a
/// refusal carrying `BAD_HANDSHAKE` and the reason before the close.
async fn handshake(executor: &Executor, stream: &mut Transport, rbuf: &mut BytesMut) -> Option<()> {
    while rbuf.len() < HELLO_LEN {
        if stream.read_buf(rbuf).await.ok()? == 0 {
            return None;
        }
    }
    let refusal = match Hello::decode(rbuf) {
        Ok(Some(hello)) if hello.version == VERSION => None,
        Ok(Some(hello)) => Some(format!(
            "protocol version {} is not supported; this server speaks version {VERSION}",
            hello.version
        )),
        Ok(None) => Some("short hello".to_string()),
        Err(e) => Some(e.to_string()),
    };
    let mut out = BytesMut::new();
    let Some(message) = refusal else {
        let config = executor.config();
        let limits = ServerLimits::with(config.in_flight_max, config.ttl_ms_max);
        HelloAck {
            version: VERSION,
            limits,
        }
        .encode(&mut out);
        stream.write_all(&out).await.ok()?;
        return Some(());
    };
    tracing::debug!(%message, "refused a handshake");
    HelloAck::encode_refusal(VERSION, ErrorCode::BadHandshake, &message, &mut out);
    if stream.write_all(&out).await.is_ok() {
        linger(stream).await;
    }
    None
}

struct Conn {
    executor: Arc<Executor>,
    stream: Transport,
    surface: Surface,
    rbuf: BytesMut,
    wbuf: BytesMut,
    queue: VecDeque<PendingReply>,
    later: FuturesUnordered<BoxFuture<'static, Later>>,
    /// Entries of `later` that are not waiters (AUTH, CLUSTER, a token retry): bounded in
    /// time, so a peer that half-closed after its request (`echo CLUSTER STATUS | nc -N`)
    /// still gets their answers. A waiter's answer is not waited for (its wait can be long).
    answers_due: usize,
    /// Entries of `queue` that answer no request (events, and the errors ending watches):
    /// they do not count against the in-flight maximum.
    events_queued: usize,
    ctx: Session,
    closing: bool,
    /// Closing because the peer broke the framing; its unread input is still arriving.
    fatal: bool,
    /// The server is shutting down: answer everything already read, then close.
    stopping: bool,
    /// The error that broke the stream, sent (request id 0) once every earlier request is
    /// answered, as the last frame before the close.
    fatal_error: Option<(ErrorCode, String)>,
    /// The request being run: its reply takes it along, for the latency metric.
    timing: Option<Timing>,
    /// An AUTH is being verified: nothing after it is read until it is answered, so replies
    /// keep their order and what follows runs as the identity it establishes.
    authenticating: bool,
    /// When an unauthenticated connection is closed (identities only): it must AUTH within
    /// the handshake limit, or it could hold a connection slot forever.
    auth_deadline: Option<tokio::time::Instant>,
    /// Reloads of the identities, after which the connection rechecks its own.
    identity_changes: Option<tokio::sync::watch::Receiver<u64>>,
    /// Why a wait was cancelled, by request id, when not because the connection ends.
    cancel_reasons: std::collections::HashMap<u64, (ErrorCode, String)>,
    /// Its place among the connections that have not authenticated yet, until it does.
    pending: Option<PendingPlace>,
    /// Its place in its identity's `connections-max`, while authenticated.
    identity_place: Option<ConnectionPlace>,
    /// Its place under `--connections-max` (see [`Opening::place`]).
    place: Option<tokio::sync::OwnedSemaphorePermit>,
    /// Evicted and closing, its place among the closing connections instead.
    closing_place: Option<ClosingPlace>,
    /// Whether a fatal close lingers for the peer to read the reason (not for an evicted
    /// connection past the bound on closing ones: it closes at once, so it never holds a
    /// place while it lingers).
    linger: bool,
}

impl Conn {
    async fn run(&mut self, shutdown: &CancellationToken) -> std::io::Result<()> {
        let mut progress = self.executor.journal().progress();
        // Made once, not per pass: each `cancelled()` registers with the token's notifier.
        let cancelled = shutdown.cancelled();
        tokio::pin!(cancelled);
        loop {
            self.take_input();
            // A copy, not the borrow: a reply the journal lost is answered through the
            // journal (`not_leader`, `failed` read its progress again), and a read lock taken
            // twice on one thread deadlocks once the journal's writer waits between the two
            // (a cluster leader's journal failing while replies wait wedged its runtime).
            let now = progress.borrow().clone();
            self.flush_ready(&now);
            // Everything encoded is written before anything more is read, so the replies a
            // connection has not sent are bounded by what `READ_BUFFER_MAX` of requests (and
            // the watch queue) produce: a peer that does not read stops being read itself.
            // That is the back-pressure; no separate write-buffer limit is needed.
            if !self.wbuf.is_empty() {
                if !self.write_out().await? {
                    return Ok(()); // given up on a peer that does not read: dropped
                }
                self.wbuf.clear();
            }
            if self.done() {
                if self.fatal && self.linger {
                    linger(&mut self.stream).await;
                } else {
                    // TLS: a close_notify, so the peer can tell the end from a cut.
                    let _ = tokio::time::timeout(CLOSING_WRITE_MAX, self.stream.shutdown()).await;
                }
                return Ok(());
            }
            let blocked = !self.queue.is_empty();
            let can_read = !self.closing && !self.stopping && self.rbuf.len() < READ_BUFFER_MAX;
            tokio::select! {
                read = self.stream.read_buf(&mut self.rbuf), if can_read => {
                    if read? == 0 {
                        self.closing = true;
                    }
                }
                Some(done) = self.later.next(), if !self.later.is_empty() => self.on_later(done),
                changed = progress.changed(), if blocked => {
                    if changed.is_err() {
                        self.closing = true; // the journal is gone: the server is stopping
                    }
                }
                Some(event) = recv_event(&mut self.ctx.events) => self.on_event(event),
                _ = &mut cancelled, if !self.closing && !self.stopping => self.stop().await,
                _ = expiry(self.auth_deadline), if !self.closing => self.on_auth_deadline(),
                // Only unauthenticated connections poll it; the hot path never does.
                why = evicted(&self.pending), if self.pending.is_some() && !self.closing => {
                    self.on_evicted(why)
                }
                Some(()) = recv_change(&mut self.identity_changes) => self.recheck_identity(),
            }
        }
    }

    /// Writes `wbuf` whole; false if it gave up. An authenticated connection's write waits
    /// as long as its peer does not read: that is its back-pressure, and it holds only its
    /// own place. One that has not authenticated waits no longer than its AUTH deadline or
    /// its eviction, and a fatal close's no longer than [`CLOSING_WRITE_MAX`]: otherwise a
    /// stranger's connections that send and never read would wait in their writes for ever,
    /// deaf to their deadline and to eviction, and keep their places (outside test a40, G0:
    /// 40 such sockets kept every newcomer out for as long as they stayed open).
    async fn write_out(&mut self) -> std::io::Result<bool> {
        let closing_until = self
            .fatal
            .then(|| tokio::time::Instant::now() + CLOSING_WRITE_MAX);
        let until = match (closing_until, self.auth_deadline) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let Some(until) = until else {
            self.stream.write_all(&self.wbuf).await?;
            return Ok(true);
        };
        tokio::select! {
            wrote = self.stream.write_all(&self.wbuf) => wrote.map(|()| true),
            () = tokio::time::sleep_until(until) => Ok(false),
            _ = evicted(&self.pending), if self.pending.is_some() => {
                self.executor.stats().metrics.evicted();
                Ok(false)
            }
        }
    }

    /// Handles what was read; after a fatal input error or on a stop, cancels this
    /// connection's waits and, once nothing else is pending, queues the fatal error's reply.
    fn take_input(&mut self) {
        if let Err(Fatal(last)) = self.handle_input() {
            if last.is_some() {
                // A broken frame or over-long line is malformed input, as in STATS `errors`.
                crate::obs::stats::Stats::bump(&self.executor.stats().errors);
            }
            self.fatal_error = last;
            self.closing = true;
            self.fatal = true;
        }
        if self.fatal || self.stopping {
            // Their answers (an error each) arrive through `later` like any other.
            self.ctx.cancel_waits(&self.executor);
        }
        if self.later.is_empty() {
            if let Some((code, message)) = self.fatal_error.take() {
                self.push(
                    REQUEST_ID_NONE,
                    Response::Error { code, message },
                    TICKET_NOW,
                );
            }
        }
    }

    /// Whether the connection may close now. A peer that left (or said QUIT) gets what is
    /// queued and the answers due soon (`answers_due`); on shutdown or a broken stream every request read so far is answered first,
    /// waiters included (they were cancelled, and hear why).
    fn done(&self) -> bool {
        if !self.queue.is_empty() {
            return false;
        }
        if self.stopping || self.fatal {
            return self.later.is_empty() && self.fatal_error.is_none();
        }
        self.closing && self.answers_due == 0
    }

    /// Shutdown or a lost leadership: take in what the peer has already sent, so that it too
    /// is answered (SHUTTING_DOWN, NOT_LEADER), then stop reading.
    ///
    /// What it sent may be in the kernel's buffer before tokio knows the socket is readable:
    /// a process resumed after a stop (`kill -STOP`, a VM paused), or a busy runtime whose
    /// reactor has not polled yet. One poll per read then found nothing, and the connection
    /// closed with those requests unanswered (outside test a49, P2: 3 deposed leaders in 8
    /// closed without one NOT_LEADER). So when one poll finds nothing, the first read waits,
    /// but no longer than [`STOP_READ_WAIT`]: a peer that sent nothing costs the stop that
    /// much, and one whose bytes were seen at once costs nothing.
    async fn stop(&mut self) {
        self.stopping = true;
        if self.read_what_is_there() {
            return;
        }
        let read = self.stream.read_buf(&mut self.rbuf);
        if let Ok(Ok(n)) = tokio::time::timeout(STOP_READ_WAIT, read).await {
            if n > 0 {
                self.read_what_is_there();
            }
        }
    }

    /// Reads what tokio has seen arrive, one poll per read (nothing is waited for); whether
    /// anything was read.
    fn read_what_is_there(&mut self) -> bool {
        let before = self.rbuf.len();
        while self.rbuf.len() < READ_BUFFER_MAX {
            match self.stream.read_buf(&mut self.rbuf).now_or_never() {
                Some(Ok(n)) if n > 0 => {}
                _ => break,
            }
        }
        self.rbuf.len() > before
    }

    /// Closes the connection once everything read so far is answered, with `code` and
    /// `message` (request id 0) as its last frame; nothing more is read.
    fn close_with(&mut self, code: ErrorCode, message: String) {
        self.fatal_error = Some((code, message));
        self.closing = true;
        self.fatal = true;
    }

    /// Leaves no trace in the shared state: after its waits are cancelled (so no hand-off
    /// can reach it any more), the hand-offs already made to them and not taken up yet are
    /// settled ([`Executor::undelivered_hand_off`]).
    fn finish(&mut self) {
        self.ctx.disconnect(&self.executor);
        for later in std::mem::take(&mut self.later) {
            if let Some(Later::Wait {
                result: Ok(WaitResult::Granted { grant, ticket, .. }),
                key,
                release_on_disconnect,
                session,
                ..
            }) = later.now_or_never()
            {
                let granted = (grant, ticket);
                (self.executor).undelivered_hand_off(
                    &self.ctx,
                    &key,
                    granted,
                    session,
                    release_on_disconnect,
                );
            }
        }
    }
}

/// Completes at `deadline`; never without one. Cheap to make when there is none, as it is
/// made on every pass of the loop.
async fn expiry(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

/// The next reload of the identities; never without identities, or once they are gone.
async fn recv_change(changes: &mut Option<tokio::sync::watch::Receiver<u64>>) -> Option<()> {
    match changes {
        Some(rx) => match rx.changed().await {
            Ok(()) => Some(()),
            Err(_) => {
                *changes = None;
                None
            }
        },
        None => std::future::pending().await,
    }
}

async fn recv_event(
    events: &mut Option<tokio::sync::mpsc::Receiver<WatchEvent>>,
) -> Option<WatchEvent> {
    match events {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}
