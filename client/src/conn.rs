//! One TCP connection: the handshake, a writer task that batches frames into few writes, and a
//! reader task that hands every reply to the request waiting for it.
//!
//! ```text
//!  request ──(id, Request)──> mpsc ──> writer task ──write_all(batch)──> socket
//!     ^                                                                   │
//!     └── oneshot <── pending[id] <── reader task <──FramedRead(ClientCodec)┘
//! ```
//!
//! A request takes an in-flight permit, registers a oneshot under a fresh request id, then
//! queues the frame. The permit lives in the pending entry until the reply arrives, even if the
//! caller gave up (timed out), because the server counts the request until it answers. When the
//! connection dies every pending entry is answered with [`Error::ConnectionLost`] and the
//! `closed` token fires, which is how lease guards hear about it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;
use tenure_protocol::frame::encode_request;
use tenure_protocol::handshake::{Hello, HelloAck, ServerLimits, VERSION};
use tenure_protocol::ProtocolError;
use tenure_protocol::{ClientCodec, FrameError, Request, Response};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot, OwnedSemaphorePermit, Semaphore};
use tokio_util::codec::FramedRead;
use tokio_util::sync::CancellationToken;

use crate::error::{Error, Result};
use crate::outcome::WatchEvent;
use crate::tls::TlsOptions;

/// Most frames the writer encodes into one buffer before writing it.
const WRITE_BATCH_MAX: usize = 256;

type ReplySender = oneshot::Sender<Result<Response>>;

/// What the reader does with a frame carrying a given request id.
enum Entry {
    /// An ordinary request: one reply, then the entry is gone.
    Reply {
        tx: ReplySender,
        _permit: OwnedSemaphorePermit,
    },
    /// A watch: the WATCHING reply (while `started` is `Some`), then any number of events.
    Watch {
        key: Bytes,
        started: Option<(ReplySender, OwnedSemaphorePermit)>,
        events: mpsc::Sender<Result<WatchEvent>>,
        overflow: Arc<AtomicBool>,
    },
}

struct Pending {
    /// Set once, when the connection dies; no entry is added after that.
    closed_reason: Option<Arc<str>>,
    entries: HashMap<u64, Entry>,
    /// The ids of the watch entries of each key.
    watchers: HashMap<Bytes, Vec<u64>>,
    /// Ids of dropped watches whose key other local watches still share. The server may still
    /// name its one watch of the key by such an id (the latest WATCH sent for it), so an error
    /// ending it must reach the others.
    retired: HashMap<u64, Bytes>,
}

/// The part of a connection its tasks share with requests, watches and lease guards.
pub(crate) struct Shared {
    pending: Mutex<Pending>,
    /// Fires when the connection is closed, for whatever reason.
    pub(crate) closed: CancellationToken,
}

/// A live connection. Dropping the last handle closes it.
pub(crate) struct Conn {
    /// Unbounded because the in-flight permits bound it: every queued frame belongs to a
    /// pending entry holding a permit. Sending is then synchronous, so a caller that gives up
    /// cannot leave an entry registered whose frame was never queued.
    tx: mpsc::UnboundedSender<(u64, Request)>,
    pub(crate) shared: Arc<Shared>,
    in_flight: Arc<Semaphore>,
    next_id: AtomicU64,
    /// What the server announced in the handshake.
    pub(crate) limits: ServerLimits,
}

/// The receiving side of a watch registered on a connection.
pub(crate) struct WatchRegistration {
    pub(crate) id: u64,
    pub(crate) events: mpsc::Receiver<Result<WatchEvent>>,
    pub(crate) overflow: Arc<AtomicBool>,
}

impl Shared {
    /// A connection's shared state before anything was sent: nothing pending, not closed.
    fn new() -> Shared {
        Shared {
            pending: Mutex::new(Pending {
                closed_reason: None,
                entries: HashMap::new(),
                watchers: HashMap::new(),
                retired: HashMap::new(),
            }),
            closed: CancellationToken::new(),
        }
    }

    /// Closes the connection: answers every pending request with `ConnectionLost(reason)`, ends
    /// every watch and fires `closed`. Only the first call's reason is kept.
    pub(crate) fn fail(&self, reason: &str) {
        let entries = {
            let mut pending = self.pending.lock().expect("pending mutex poisoned");
            if pending.closed_reason.is_some() {
                return;
            }
            pending.closed_reason = Some(Arc::from(reason));
            pending.watchers.clear();
            pending.retired.clear();
            std::mem::take(&mut pending.entries)
        };
        let reason: Arc<str> = Arc::from(reason);
        for (_, entry) in entries {
            let tx = match entry {
                Entry::Reply { tx, .. } => Some(tx),
                Entry::Watch { started, .. } => started.map(|(tx, _)| tx),
            };
            if let Some(tx) = tx {
                let _ = tx.send(Err(Error::ConnectionLost(reason.clone())));
            }
        }
        self.closed.cancel();
    }

    /// The error to report for a connection that is closed.
    pub(crate) fn lost_error(&self) -> Error {
        let pending = self.pending.lock().expect("pending mutex poisoned");
        let reason = pending
            .closed_reason
            .clone()
            .unwrap_or_else(|| Arc::from("connection closed"));
        Error::ConnectionLost(reason)
    }

    fn register(&self, id: u64, entry: Entry) -> Result<()> {
        let mut pending = self.pending.lock().expect("pending mutex poisoned");
        if let Some(reason) = &pending.closed_reason {
            return Err(Error::ConnectionLost(reason.clone()));
        }
        if let Entry::Watch { key, .. } = &entry {
            pending.watchers.entry(key.clone()).or_default().push(id);
        }
        let previous = pending.entries.insert(id, entry);
        assert!(previous.is_none(), "request id {id} reused");
        Ok(())
    }

    /// Forgets a watch; returns whether another watch on the same key remains.
    pub(crate) fn remove_watch(&self, id: u64, key: &[u8]) -> bool {
        let mut pending = self.pending.lock().expect("pending mutex poisoned");
        pending.entries.remove(&id);
        pending.unindex_watch(id, key);
        let others = pending.watchers.contains_key(key);
        if others {
            pending.retired.insert(id, Bytes::copy_from_slice(key));
        }
        others
    }

    /// Hands one decoded frame to whoever waits for it. Returns the message of an ERROR frame
    /// nobody waits for (the server's reason for closing the connection).
    fn dispatch(&self, id: u64, frame: Result<Response, FrameError>) -> Option<String> {
        let mut pending = self.pending.lock().expect("pending mutex poisoned");
        let response = match frame {
            Ok(Response::Event {
                kind,
                key,
                token,
                meta,
            }) => {
                pending.deliver_event(WatchEvent {
                    kind,
                    key,
                    token,
                    meta,
                });
                return None;
            }
            Ok(response) => Ok(response),
            Err(e) => Err(Error::Protocol(format!("undecodable reply: {e}"))),
        };
        match pending.entries.remove(&id) {
            Some(Entry::Reply { tx, .. }) => {
                let _ = tx.send(response);
                None
            }
            Some(Entry::Watch {
                key,
                started: Some((tx, _permit)),
                events,
                overflow,
            }) => {
                pending.watch_answered(id, key, events, overflow, &response);
                let _ = tx.send(response);
                None
            }
            Some(entry @ Entry::Watch { .. }) => {
                pending.watch_ended_by_server(id, entry, response);
                None
            }
            None => pending.unclaimed(id, response),
        }
    }
}

impl Pending {
    /// The reply to a WATCH: WATCHING starts it (its entry goes back, now for events); any
    /// other answer refuses it, and its id leaves the key's index.
    fn watch_answered(
        &mut self,
        id: u64,
        key: Bytes,
        events: mpsc::Sender<Result<WatchEvent>>,
        overflow: Arc<AtomicBool>,
        response: &Result<Response>,
    ) {
        if matches!(response, Ok(Response::Watching { .. })) {
            let entry = Entry::Watch {
                key,
                started: None,
                events,
                overflow,
            };
            self.entries.insert(id, entry);
        } else {
            self.unindex_watch(id, &key);
        }
    }

    /// An answer to a running watch can only be the server ending it (WATCH_LIMIT: its event
    /// queue for this connection overflowed). It comes after every event of that watch, and
    /// ends the server's one watch of the key, which every local watch of the key shares,
    /// this one included.
    fn watch_ended_by_server(&mut self, id: u64, entry: Entry, response: Result<Response>) {
        let Entry::Watch { key, .. } = &entry else {
            unreachable!("called for a watch")
        };
        let key = key.clone();
        self.entries.insert(id, entry);
        let error = match response {
            Ok(Response::Error { code, message }) => Error::Server { code, message },
            Ok(other) => Error::Protocol(format!("unexpected reply {other:?} to WATCH")),
            Err(e) => e,
        };
        self.end_watches(&key, &error);
    }

    /// A frame for an id nobody waits for: the end of a watch named by a dropped watch's id
    /// (it reaches the others of its key), an ERROR closing the connection (its message is
    /// returned), or a late reply to a request that gave up (ignored).
    fn unclaimed(&mut self, id: u64, response: Result<Response>) -> Option<String> {
        match response {
            Ok(Response::Error { code, message }) if self.retired.contains_key(&id) => {
                let key = self.retired.remove(&id).expect("checked");
                self.end_watches(&key, &Error::Server { code, message });
                None
            }
            Ok(Response::Error { code, message }) => Some(format!("{code}: {message}")),
            _ => None,
        }
    }

    fn unindex_watch(&mut self, id: u64, key: &[u8]) {
        if let Some(ids) = self.watchers.get_mut(key) {
            ids.retain(|&other| other != id);
            if ids.is_empty() {
                self.watchers.remove(key);
                self.retired.retain(|_, retired_key| retired_key != key);
            }
        }
    }

    /// Gives an event to every watch of its key. The server keeps one watch per key per
    /// connection (a repeated WATCH replaces it, sending every event of the old one before
    /// the new one's reply), so events are routed by key.
    fn deliver_event(&mut self, event: WatchEvent) {
        let Some(ids) = self.watchers.get(&event.key) else {
            return; // an event for a watch dropped a moment ago
        };
        let mut overflowed = Vec::new();
        for id in ids {
            if let Some(Entry::Watch {
                started: None,
                events,
                overflow,
                ..
            }) = self.entries.get(id)
            {
                if events.try_send(Ok(event.clone())).is_err() {
                    // The consumer is not keeping up (or is gone); dropping its watch keeps
                    // the reader, and so every other request, moving.
                    overflow.store(true, Ordering::Release);
                    overflowed.push(*id);
                }
            }
        }
        for id in overflowed {
            self.entries.remove(&id);
            self.unindex_watch(id, &event.key);
        }
    }

    /// Ends every running watch of `key` with `error`. A WATCH of the key still waiting for
    /// its reply stays: the server answers it after this end, so it starts a new watch.
    fn end_watches(&mut self, key: &[u8], error: &Error) {
        let ids = self.watchers.remove(key).unwrap_or_default();
        let mut starting = Vec::new();
        for id in ids {
            match self.entries.remove(&id) {
                Some(Entry::Watch {
                    events,
                    overflow,
                    started: None,
                    ..
                }) => {
                    let copy = match error {
                        Error::Server { code, message } => Error::Server {
                            code: *code,
                            message: message.clone(),
                        },
                        other => Error::Protocol(other.to_string()),
                    };
                    if events.try_send(Err(copy)).is_err() {
                        overflow.store(true, Ordering::Release);
                    }
                }
                Some(entry) => {
                    self.entries.insert(id, entry);
                    starting.push(id);
                }
                None => {}
            }
        }
        if starting.is_empty() {
            self.retired.retain(|_, retired_key| retired_key != key);
        } else {
            self.watchers.insert(Bytes::copy_from_slice(key), starting);
        }
    }
}

/// Sends the hello and reads the answer; the requests in flight allowed are the lower of the
/// server's cap and `in_flight_max`. Also returns what was read past the answer: frames the
/// server sent right behind it (an ERROR with request id 0 that closes the connection, say).
async fn handshake(
    stream: &mut (impl AsyncRead + AsyncWrite + Unpin),
    in_flight_max: u32,
) -> Result<(HelloAck, usize, BytesMut)> {
    let mut hello = BytesMut::new();
    Hello { version: VERSION }.encode(&mut hello);
    stream.write_all(&hello).await?;
    let (ack, rest) = read_ack(stream).await?;
    if ack.version != VERSION {
        return Err(Error::VersionMismatch {
            server: ack.version,
            client: VERSION,
        });
    }
    let in_flight = ack.limits.in_flight_max.min(in_flight_max);
    if in_flight == 0 {
        return Err(Error::Protocol(
            "server allows no requests in flight".into(),
        ));
    }
    let in_flight = usize::try_from(in_flight).expect("u32 fits in usize");
    Ok((ack, in_flight, rest))
}

/// Reads the server's answer to the hello (its length is in its header) and returns it with
/// the bytes read past it. A refusal becomes [`Error::VersionMismatch`] when the server
/// speaks another version, else [`Error::Server`].
async fn read_ack(stream: &mut (impl AsyncRead + Unpin)) -> Result<(HelloAck, BytesMut)> {
    let mut input = BytesMut::with_capacity(64);
    loop {
        match HelloAck::decode(&mut input) {
            Ok(Some(ack)) => return Ok((ack, input)),
            Ok(None) => {}
            Err(ProtocolError::HandshakeRefused { version, .. }) if version != VERSION => {
                return Err(Error::VersionMismatch {
                    server: version,
                    client: VERSION,
                })
            }
            Err(ProtocolError::HandshakeRefused { code, message, .. }) => {
                return Err(Error::Server { code, message })
            }
            Err(ProtocolError::BadHandshake(_)) if input.starts_with(b"ERR ") => {
                return Err(read_refusal(stream, input).await)
            }
            Err(e) => return Err(Error::Protocol(e.to_string())),
        }
        if stream.read_buf(&mut input).await? == 0 {
            // A lost connection, not a broken protocol: a proxy or load balancer whose
            // backend is down (a restart, a fail-over) accepts and closes, and a request's
            // retries must go on through that (outside test a60, F1: an open or ACQUIRE
            // whose answer was lost gave up at once, leaving its session or lease behind).
            return Err(Error::ConnectionLost(
                "the server closed the connection during the handshake".into(),
            ));
        }
    }
}

/// The rest of a console line a server sent in place of its answer to the hello (at its
/// connection limit, PROTOCOL.md 2), read up to its newline, the connection's end or
/// `REFUSAL_LINE_LEN_MAX` bytes, as the refusal it says: `Error::Server` with its code and
/// words (outside test a46, L13: it was reported as a server without the tenure magic).
async fn read_refusal(stream: &mut (impl AsyncRead + Unpin), mut input: BytesMut) -> Error {
    use tenure_protocol::handshake::{console_refusal, REFUSAL_LINE_LEN_MAX};
    while !input.contains(&b'\n') && input.len() < REFUSAL_LINE_LEN_MAX {
        match stream.read_buf(&mut input).await {
            Ok(0) | Err(_) => break, // the server closes after the line
            Ok(_) => {}
        }
    }
    input.truncate(REFUSAL_LINE_LEN_MAX);
    match console_refusal(&input) {
        Some((code, message)) => Error::Server { code, message },
        None => Error::Protocol(format!(
            "connection refused by server: {:?}",
            String::from_utf8_lossy(&input)
        )),
    }
}

impl Conn {
    /// Connects, does the handshake and starts the reader and writer tasks.
    ///
    /// `in_flight_max` is the client's own cap; the server's cap from the handshake wins if
    /// it is lower.
    pub(crate) async fn open(
        addr: &str,
        in_flight_max: u32,
        tls: Option<&TlsOptions>,
    ) -> Result<Arc<Conn>> {
        let mut stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        // Plain TCP splits into owned halves; TLS needs tokio's split, which shares the
        // stream behind a lock, so it is used only where it is needed.
        match tls {
            None => {
                let (ack, in_flight, rest) = handshake(&mut stream, in_flight_max).await?;
                let (read, write) = stream.into_split();
                Ok(Self::spawn(read, write, ack, in_flight, rest))
            }
            Some(tls) => {
                let mut stream = tls.connect(addr, stream).await?;
                let (ack, in_flight, rest) = handshake(&mut stream, in_flight_max).await?;
                let (read, write) = tokio::io::split(stream);
                Ok(Self::spawn(read, write, ack, in_flight, rest))
            }
        }
    }

    /// Starts the reader and writer tasks of a connection past its handshake.
    fn spawn(
        read: impl AsyncRead + Unpin + Send + 'static,
        write: impl AsyncWrite + Unpin + Send + 'static,
        ack: HelloAck,
        in_flight: usize,
        rest: BytesMut,
    ) -> Arc<Conn> {
        let shared = Arc::new(Shared::new());
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(read_loop(read, rest, Arc::clone(&shared)));
        tokio::spawn(write_loop(write, rx, Arc::clone(&shared)));
        Arc::new(Conn {
            tx,
            shared,
            in_flight: Arc::new(Semaphore::new(in_flight)),
            next_id: AtomicU64::new(1), // 0 is left for frames that answer no request
            limits: ack.limits,
        })
    }

    /// True once the connection has died or was closed.
    pub(crate) fn is_closed(&self) -> bool {
        self.shared.closed.is_cancelled()
    }

    async fn permit(&self) -> Result<OwnedSemaphorePermit> {
        tokio::select! {
            permit = Arc::clone(&self.in_flight).acquire_owned() => {
                Ok(permit.expect("the in-flight semaphore is never closed"))
            }
            _ = self.shared.closed.cancelled() => Err(self.shared.lost_error()),
        }
    }

    fn send(&self, id: u64, request: Request) -> Result<()> {
        self.tx
            .send((id, request))
            .map_err(|_| self.shared.lost_error())
    }

    /// Sends one request and waits for its reply (an ERROR reply included).
    pub(crate) async fn call(&self, request: Request) -> Result<Response> {
        let permit = self.permit().await?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        self.shared.register(
            id,
            Entry::Reply {
                tx,
                _permit: permit,
            },
        )?;
        self.send(id, request)?;
        rx.await.unwrap_or_else(|_| Err(self.shared.lost_error()))
    }

    /// Sends WATCH for `key`; returns its reply and the event queue (meaningful if the reply
    /// is WATCHING).
    pub(crate) async fn watch(
        &self,
        key: Bytes,
        events_max: usize,
    ) -> Result<(Response, WatchRegistration)> {
        let permit = self.permit().await?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        let (events_tx, events) = mpsc::channel(events_max);
        let overflow = Arc::new(AtomicBool::new(false));
        let entry = Entry::Watch {
            key: key.clone(),
            started: Some((tx, permit)),
            events: events_tx,
            overflow: Arc::clone(&overflow),
        };
        self.shared.register(id, entry)?;
        self.send(id, Request::Watch { key })?;
        let reply = rx.await.unwrap_or_else(|_| Err(self.shared.lost_error()))?;
        Ok((
            reply,
            WatchRegistration {
                id,
                events,
                overflow,
            },
        ))
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.shared.fail("client dropped the connection");
    }
}

/// Reads frames until the connection ends; `rest` is what the handshake read past its answer.
async fn read_loop(read: impl AsyncRead + Unpin + Send, rest: BytesMut, shared: Arc<Shared>) {
    let mut frames = FramedRead::new(read, ClientCodec);
    frames.read_buffer_mut().extend_from_slice(&rest);
    let mut notice = None;
    let reason = loop {
        let item = tokio::select! {
            _ = shared.closed.cancelled() => return,
            item = frames.next() => item,
        };
        match item {
            Some(Ok((id, frame))) => match shared.dispatch(id, frame) {
                // Id 0 answers no request of ours (we never send it): the server closes the
                // connection after it (PROTOCOL.md 3, "Request id 0"), so the requests in flight fail now
                // rather than when the close arrives (outside test a48, N14: a peer that
                // kept the connection open held them to their time-outs).
                Some(message) if id == 0 => {
                    break format!("server closes the connection ({message})");
                }
                Some(message) => notice = Some(message),
                None => {}
            },
            Some(Err(e)) => break format!("stream error: {e}"),
            None => {
                break match notice {
                    Some(message) => format!("server closed the connection ({message})"),
                    None => "server closed the connection".to_owned(),
                }
            }
        }
    };
    tracing::debug!(%reason, "connection closed");
    shared.fail(&reason);
}

async fn write_loop(
    mut write: impl AsyncWrite + Unpin,
    mut rx: mpsc::UnboundedReceiver<(u64, Request)>,
    shared: Arc<Shared>,
) {
    let mut buf = BytesMut::with_capacity(tenure_protocol::limits::FRAME_LEN_MAX);
    loop {
        let first = tokio::select! {
            _ = shared.closed.cancelled() => return,
            first = rx.recv() => first,
        };
        let Some((id, request)) = first else { return };
        encode_request(id, &request, &mut buf);
        for _ in 1..WRITE_BATCH_MAX {
            match rx.try_recv() {
                Ok((id, request)) => encode_request(id, &request, &mut buf),
                Err(_) => break,
            }
        }
        let written = tokio::select! {
            _ = shared.closed.cancelled() => return,
            written = write.write_all(&buf) => written,
        };
        buf.clear();
        if let Err(e) = written {
            shared.fail(&format!("write failed: {e}"));
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tenure_protocol::ErrorCode;

    fn shared() -> Shared {
        Shared::new()
    }

    /// Registers a running watch of `key` under `id`, as if WATCHING had arrived.
    fn running_watch(shared: &Shared, id: u64, key: &'static [u8]) -> WatchRegistration {
        let permit = Arc::new(Semaphore::new(1)).try_acquire_owned().unwrap();
        let (tx, _reply) = oneshot::channel();
        let (events_tx, events) = mpsc::channel(4);
        let overflow = Arc::new(AtomicBool::new(false));
        let entry = Entry::Watch {
            key: Bytes::from_static(key),
            started: Some((tx, permit)),
            events: events_tx,
            overflow: Arc::clone(&overflow),
        };
        shared.register(id, entry).unwrap();
        assert!(shared
            .dispatch(id, Ok(Response::Watching { holder: None }))
            .is_none());
        WatchRegistration {
            id,
            events,
            overflow,
        }
    }

    #[test]
    fn the_end_of_a_watch_named_by_a_dropped_watchs_id_reaches_the_others() {
        let shared = shared();
        let mut first = running_watch(&shared, 5, b"k");
        let second = running_watch(&shared, 9, b"k");
        // The server's one watch of "k" now carries id 9; dropping that local watch leaves it.
        assert!(shared.remove_watch(second.id, b"k"));
        let end = Response::Error {
            code: ErrorCode::WatchLimit,
            message: "events were not read fast enough".into(),
        };
        assert_eq!(shared.dispatch(9, Ok(end)), None, "not a connection notice");
        match first.events.try_recv() {
            Ok(Err(Error::Server { code, .. })) => assert_eq!(code, ErrorCode::WatchLimit),
            other => panic!("the remaining watch was not ended: {other:?}"),
        }
    }

    #[test]
    fn the_end_of_one_keys_watch_leaves_the_other_keys_watches_running() {
        let shared = shared();
        let mut ended = running_watch(&shared, 5, b"k");
        let mut other = running_watch(&shared, 7, b"j");
        let end = Response::Error {
            code: ErrorCode::WatchLimit,
            message: "events were not read fast enough".into(),
        };
        assert_eq!(shared.dispatch(5, Ok(end)), None);
        assert!(matches!(
            ended.events.try_recv(),
            Ok(Err(Error::Server { .. }))
        ));
        assert!(
            matches!(
                other.events.try_recv(),
                Err(mpsc::error::TryRecvError::Empty)
            ),
            "the server ends each watch with its own frame"
        );
    }
}
