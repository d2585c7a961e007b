//! One client connection, binary or console, from its first byte to its close.
//!
//! The first byte decides the surface: the binary handshake starts with `0x00`, which no text
//! command does. After that both surfaces share one loop:
//!
//! ```text
//!   read ──► decode every whole frame/line ──► Shared::execute ──► reply queue ──► write
//!                                                   │                    ▲
//!                              queued acquire ──────┴──► waits ──────────┘
//!                                                              (grant, time-out)
//! ```
//!
//! Replies wait in the queue until the WAL is durable past the record they depend on, then are
//! encoded into one write buffer, which is written when everything read so far is handled
//! (one write per batch of pipelined requests, not per reply). The loop owns the socket, so a
//! slow reader only ever stalls itself: the table, the ticker and other connections never
//! wait on it. Anything malformed is answered with an error; anything that breaks the framing
//! closes this connection and nothing else, after answering what came before it.
//!
//! A connection that does not finish its handshake (or first console line) within the
//! configured limit is closed. On shutdown it stops reading, answers what it has read, cancels
//! its waiters with `SHUTTING_DOWN`, and closes.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use futures_util::future::BoxFuture;
use futures_util::stream::{FuturesUnordered, StreamExt};
use tenure_protocol::frame::{decode_request, encode_response, split_frame, REQUEST_ID_NONE};
use tenure_protocol::handshake::{Hello, HelloAck, ServerLimits, HELLO_LEN, VERSION};
use tenure_protocol::{ErrorCode, FrameError, Request, Response};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

use crate::config::{LINE_LEN_MAX, READ_BUFFER_MAX};
use crate::console::{self, Command};
use crate::metrics::{self, Timing};
use crate::state::{ConnCtx, Outcome, Shared, Undo, WaitResult};
use crate::wal::Lsn;
use crate::watch::WatchEvent;

/// Most bytes discarded from a peer after a fatal error, while its error reply drains.
const LINGER_BYTES_MAX: usize = 4 << 20;
/// Longest wait for that peer to close after a fatal error.
const LINGER_TIME_MAX: std::time::Duration = std::time::Duration::from_millis(500);

/// One decoded unit of input, whichever surface it came from.
enum Input {
    Request(u64, Request),
    Bad(u64, FrameError),
    Help,
    Quit,
}

/// A reason to close the connection, with an error to send first when there is one.
struct Fatal(Option<(ErrorCode, String)>);

/// What differs between the binary protocol and the console.
enum Surface {
    Binary,
    Console { line_no: u64, text: String },
}

impl Surface {
    fn decode(&mut self, buf: &mut BytesMut) -> Result<Option<Input>, Fatal> {
        match self {
            Surface::Binary => match split_frame(buf) {
                Ok(None) => Ok(None),
                Ok(Some((_, REQUEST_ID_NONE, _))) => Ok(Some(Input::Bad(
                    REQUEST_ID_NONE,
                    FrameError::new(
                        ErrorCode::BadFrame,
                        "request id 0 is reserved for replies that answer no request".into(),
                    ),
                ))),
                Ok(Some((opcode, id, body))) => Ok(Some(match decode_request(opcode, body) {
                    Ok(request) => Input::Request(id, request),
                    Err(e) => Input::Bad(id, e),
                })),
                Err(e) => Err(Fatal(e.code().map(|code| (code, e.to_string())))),
            },
            Surface::Console { line_no, .. } => loop {
                let Some(end) = buf.iter().position(|&b| b == b'\n') else {
                    if buf.len() > LINE_LEN_MAX {
                        let message = format!("line longer than {LINE_LEN_MAX} bytes");
                        return Err(Fatal(Some((ErrorCode::LineTooLong, message))));
                    }
                    return Ok(None);
                };
                if end > LINE_LEN_MAX {
                    let message = format!("line longer than {LINE_LEN_MAX} bytes");
                    return Err(Fatal(Some((ErrorCode::LineTooLong, message))));
                }
                let line = buf.split_to(end + 1);
                let line = line.strip_suffix(b"\n").unwrap_or(&line);
                let line = line.strip_suffix(b"\r").unwrap_or(line);
                *line_no += 1;
                let id = *line_no;
                return Ok(Some(match console::parse(line) {
                    Ok(Command::Request(request)) => Input::Request(id, request),
                    Ok(Command::Help) => Input::Help,
                    Ok(Command::Quit) => Input::Quit,
                    Ok(Command::Empty) => continue,
                    Err(e) => Input::Bad(id, e),
                }));
            },
        }
    }

    fn encode(&mut self, id: u64, response: &Response, out: &mut BytesMut) {
        match self {
            Surface::Binary => encode_response(id, response, out),
            Surface::Console { text, .. } => {
                text.clear();
                console::format(response, text);
                out.extend_from_slice(text.as_bytes());
            }
        }
    }
}

/// Something a connection waits for besides its socket: a queued acquire's answer, or a
/// token reservation before an acquire can run again.
enum Later {
    Wait {
        id: u64,
        timing: Option<Timing>,
        result: Result<WaitResult, ()>,
        key: Bytes,
        release_on_disconnect: bool,
    },
    Retry {
        id: u64,
        request: Request,
        /// When the request was first taken up.
        received_ms: u64,
        reserved: Result<(), String>,
    },
}

/// A reply waiting for the WAL to be durable up to `lsn`.
struct Queued {
    lsn: Lsn,
    id: u64,
    reply: Reply,
    /// For a grant or release: how to take it back if its record never becomes durable.
    undo: Option<Undo>,
    /// Pushed by the server (an event, or the end of a watch), not the answer to a request.
    pushed: bool,
    /// When the request this answers was read, for its latency metric.
    timing: Option<Timing>,
}

/// A protocol response, or a console-only line (HELP, BYE) that has no binary form.
enum Reply {
    Response(Response),
    Line(&'static str),
}

/// Serves one accepted connection until the peer leaves, a fatal error, or shutdown.
pub async fn serve(
    shared: Arc<Shared>,
    mut stream: TcpStream,
    conn_id: u64,
    shutdown: CancellationToken,
) {
    let _ = stream.set_nodelay(true);
    let mut rbuf = BytesMut::with_capacity(16 * 1024);
    let limit = shared.config.handshake_timeout;
    let surface = tokio::select! {
        opened = tokio::time::timeout(limit, open(&shared, &mut stream, &mut rbuf)) => {
            match opened {
                Ok(Some(surface)) => surface,
                Ok(None) => return,
                Err(_) => {
                    tracing::debug!(conn_id, ?limit, "no handshake or first line in time; closed");
                    return;
                }
            }
        }
        _ = shutdown.cancelled() => return,
    };
    let kind = match surface {
        Surface::Binary => metrics::Surface::Binary,
        Surface::Console { .. } => metrics::Surface::Console,
    };
    shared.stats.metrics.connection(kind, true);
    let mut conn = Conn {
        shared,
        stream,
        surface,
        rbuf,
        wbuf: BytesMut::with_capacity(16 * 1024),
        queue: VecDeque::new(),
        later: FuturesUnordered::new(),
        waits: HashMap::new(),
        events_queued: 0,
        ctx: ConnCtx::new(conn_id),
        closing: false,
        fatal: false,
        stopping: false,
        fatal_error: None,
        timing: None,
    };
    if let Err(e) = conn.run(&shutdown).await {
        tracing::debug!(conn_id, error = %e, "connection ended with an I/O error");
    }
    conn.finish();
    conn.shared.stats.metrics.connection(kind, false);
}

/// Reads a connection's opening, which must arrive within the handshake limit: the binary
/// handshake (answered here), or a first whole console line (left in `rbuf` for the loop; so
/// is an over-long first line, which the loop then refuses). `None` if it must close.
async fn open(shared: &Shared, stream: &mut TcpStream, rbuf: &mut BytesMut) -> Option<Surface> {
    while rbuf.is_empty() {
        if stream.read_buf(rbuf).await.ok()? == 0 {
            return None;
        }
    }
    if rbuf[0] == 0x00 {
        handshake(shared, stream, rbuf).await?;
        return Some(Surface::Binary);
    }
    while !rbuf.contains(&b'\n') && rbuf.len() <= LINE_LEN_MAX {
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
async fn handshake(shared: &Shared, stream: &mut TcpStream, rbuf: &mut BytesMut) -> Option<()> {
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
        let config = &shared.config;
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

/// Closing a socket with unread input makes the kernel send a reset, which can destroy
/// the error reply just written. So: send FIN, then read and discard for a short, bounded
/// while, giving the peer time to read the reason before the connection goes.
async fn linger(stream: &mut TcpStream) {
    let _ = stream.shutdown().await;
    let drain = async {
        let mut scratch = vec![0u8; 16 * 1024];
        let mut drained = 0usize;
        while drained < LINGER_BYTES_MAX {
            match stream.read(&mut scratch).await {
                Ok(0) | Err(_) => break,
                Ok(n) => drained += n,
            }
        }
    };
    let _ = tokio::time::timeout(LINGER_TIME_MAX, drain).await;
}

struct Conn {
    shared: Arc<Shared>,
    stream: TcpStream,
    surface: Surface,
    rbuf: BytesMut,
    wbuf: BytesMut,
    queue: VecDeque<Queued>,
    later: FuturesUnordered<BoxFuture<'static, Later>>,
    /// Queued acquires by request id: the key and the table's waiter id.
    waits: HashMap<u64, (Bytes, u64)>,
    /// Entries of `queue` that answer no request (events, and the errors ending watches):
    /// they do not count against the in-flight maximum.
    events_queued: usize,
    ctx: ConnCtx,
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
}

impl Conn {
    async fn run(&mut self, shutdown: &CancellationToken) -> std::io::Result<()> {
        let mut durable = self.shared.durable();
        // Made once, not per pass: each `cancelled()` registers with the token's notifier.
        let cancelled = shutdown.cancelled();
        tokio::pin!(cancelled);
        loop {
            if let Err(Fatal(last)) = self.handle_input() {
                self.fatal_error = last;
                self.closing = true;
                self.fatal = true;
            }
            if self.fatal || self.stopping {
                // Their answers (an error each) arrive through `later` like any other.
                self.cancel_waits();
            }
            if self.later.is_empty() {
                if let Some((code, message)) = self.fatal_error.take() {
                    self.push(REQUEST_ID_NONE, Response::Error { code, message }, 0);
                }
            }
            self.flush_ready(&durable.borrow());
            if !self.wbuf.is_empty() {
                self.stream.write_all(&self.wbuf).await?;
                self.wbuf.clear();
            }
            if self.done() {
                if self.fatal {
                    linger(&mut self.stream).await;
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
                changed = durable.changed(), if blocked => {
                    if changed.is_err() {
                        self.closing = true; // the WAL is gone: the server is stopping
                    }
                }
                Some(event) = recv_event(&mut self.ctx.events) => self.on_event(event),
                _ = &mut cancelled, if !self.closing && !self.stopping => self.stop(),
            }
        }
    }

    /// Whether the connection may close now. A peer that left (or said QUIT) gets what is
    /// queued; on shutdown or a broken stream every request read so far is answered first,
    /// waiters included (they were cancelled, and hear why).
    fn done(&self) -> bool {
        if !self.queue.is_empty() {
            return false;
        }
        if self.stopping || self.fatal {
            return self.later.is_empty() && self.fatal_error.is_none();
        }
        self.closing
    }

    /// Shutdown: take in what the peer has already sent (without waiting for more), so that
    /// it too is answered, then stop reading.
    fn stop(&mut self) {
        self.stopping = true;
        while self.rbuf.len() < READ_BUFFER_MAX {
            match self.stream.try_read_buf(&mut self.rbuf) {
                Ok(n) if n > 0 => {}
                _ => break,
            }
        }
    }

    /// Takes this connection's waiters out of their queues. Each one's channel then closes,
    /// and `on_later` answers it with the reason the connection is ending.
    fn cancel_waits(&mut self) {
        for (_, (key, waiter_id)) in self.waits.drain() {
            self.shared.shard(&key).cancel_waiter(&key, waiter_id);
        }
    }

    /// Decodes and runs everything whole in the read buffer.
    fn handle_input(&mut self) -> Result<(), Fatal> {
        // The console promises replies in order, so while a blocking acquire waits there, later
        // lines stay unread in the buffer; the binary protocol answers by id and goes on.
        let console = matches!(self.surface, Surface::Console { .. });
        while !self.closing && (!console || self.later.is_empty()) {
            let Some(input) = self.surface.decode(&mut self.rbuf)? else {
                break;
            };
            match input {
                Input::Request(id, request) => self.on_request(id, request, None),
                Input::Bad(id, e) => {
                    crate::stats::Stats::bump(&self.shared.stats.errors);
                    self.push(
                        id,
                        Response::Error {
                            code: e.code,
                            message: e.message,
                        },
                        0,
                    );
                }
                Input::Help => self.push_line(console::HELP),
                Input::Quit => {
                    self.push_line("BYE");
                    self.closing = true;
                }
            }
        }
        Ok(())
    }

    /// Requests read and not yet answered: replies waiting for the WAL, and acquires waiting
    /// in line or for fencing tokens. Events are not requests; a WATCH counts until its reply.
    fn in_flight(&self) -> usize {
        self.queue.len() - self.events_queued + self.later.len()
    }

    /// Runs a request; `received_ms` is when it was first taken up if this is a retry.
    fn on_request(&mut self, id: u64, request: Request, received_ms: Option<u64>) {
        self.timing = Some(Timing::start(&request));
        if self.in_flight() >= self.shared.config.in_flight_max as usize {
            let max = self.shared.config.in_flight_max;
            let message = format!("{max} requests already in flight on this connection");
            self.push(
                id,
                Response::Error {
                    code: ErrorCode::TooManyInFlight,
                    message,
                },
                0,
            );
            return;
        }
        if let Request::Watch { .. } = request {
            // A new watch starts on a queue that takes events, not on one that overflowed.
            self.end_watches_if_overflowed();
        }
        let outcome = match received_ms {
            None => self.shared.execute(&mut self.ctx, id, request),
            Some(received_ms) => self
                .shared
                .execute_again(&mut self.ctx, id, request, received_ms),
        };
        // Events a WATCH drained were checked against the watches it replaced, not the new one.
        for event in std::mem::take(&mut self.ctx.drained) {
            self.queue_event(event);
        }
        match outcome {
            Outcome::Reply(response, lsn) => self.push(id, response, lsn),
            Outcome::Changed {
                response,
                lsn,
                undo,
            } => self.push_change(id, response, lsn, undo),
            Outcome::Wait {
                rx,
                key,
                waiter_id,
                release_on_disconnect,
            } => {
                self.waits.insert(id, (key.clone(), waiter_id));
                let timing = self.timing.take();
                self.later.push(Box::pin(async move {
                    let result = rx.await.map_err(|_| ());
                    Later::Wait {
                        id,
                        timing,
                        result,
                        key,
                        release_on_disconnect,
                    }
                }));
            }
            Outcome::NeedTokens {
                request,
                received_ms,
            } => {
                self.timing = None; // the retry times itself
                let shared = Arc::clone(&self.shared);
                self.later.push(Box::pin(async move {
                    let reserved = shared.reserve_tokens().await.map_err(|e| e.to_string());
                    Later::Retry {
                        id,
                        request,
                        received_ms,
                        reserved,
                    }
                }));
            }
        }
    }

    fn on_later(&mut self, done: Later) {
        match done {
            Later::Wait {
                id,
                timing,
                result,
                key,
                release_on_disconnect,
            } => {
                self.waits.remove(&id);
                self.timing = timing;
                let (response, lsn) = match result {
                    Ok(WaitResult::Granted {
                        grant,
                        lsn,
                        waited_ms,
                    }) => {
                        if release_on_disconnect {
                            self.ctx.owned.push((key.clone(), grant.lease_id));
                        }
                        let response = Response::Granted {
                            token: grant.token,
                            lease_id: grant.lease_id,
                            ttl_ms: grant.ttl_ms,
                            waited_ms,
                        };
                        let undo = Undo::Grant {
                            key,
                            lease_id: grant.lease_id,
                        };
                        self.push_change(id, response, lsn, undo);
                        return;
                    }
                    Ok(WaitResult::TimedOut { token, ttl_left_ms }) => (
                        Response::Locked {
                            token,
                            ttl_left_ms: u32::try_from(ttl_left_ms).unwrap_or(u32::MAX),
                        },
                        0,
                    ),
                    Ok(WaitResult::Failed(code, message)) => (Response::Error { code, message }, 0),
                    Err(()) => (self.wait_cancelled(), 0),
                };
                self.push(id, response, lsn);
            }
            Later::Retry {
                id,
                request,
                received_ms,
                reserved,
            } => match reserved {
                // Runs (and counts) the acquire again; reservations are rare enough not to matter.
                Ok(()) => self.on_request(id, request, Some(received_ms)),
                Err(message) => {
                    let message = format!("could not reserve fencing tokens: {message}");
                    self.push(
                        id,
                        Response::Error {
                            code: ErrorCode::Unavailable,
                            message,
                        },
                        0,
                    );
                }
            },
        }
    }

    /// The answer to a wait cancelled because this connection is ending.
    fn wait_cancelled(&self) -> Response {
        match &self.fatal_error {
            Some((code, _)) => Response::Error {
                code: *code,
                message: "the wait was cancelled: a later frame broke the stream".to_string(),
            },
            None => Response::Error {
                code: ErrorCode::ShuttingDown,
                message: "the wait was cancelled: the server is shutting down".to_string(),
            },
        }
    }

    fn on_event(&mut self, event: WatchEvent) {
        self.push_event(event);
        self.end_watches_if_overflowed();
    }

    /// Queues an event, unless its watch has ended since it was queued.
    fn push_event(&mut self, event: WatchEvent) {
        if self.ctx.is_live(&event) {
            self.queue_event(event);
        }
    }

    fn queue_event(&mut self, event: WatchEvent) {
        let WatchEvent {
            watch_id,
            kind,
            key,
            token,
            meta,
        } = event;
        let response = Response::Event {
            kind,
            key,
            token,
            meta,
        };
        self.push_pushed(watch_id, response);
    }

    /// If the event queue overflowed: sends every event it still holds (all from before the
    /// overflow), then ends each watch with its own WATCH_LIMIT error, so no event of a watch
    /// follows its end. The queue is dropped; a later WATCH starts a new one.
    fn end_watches_if_overflowed(&mut self) {
        let overflowed = self
            .ctx
            .sink
            .as_ref()
            .is_some_and(|sink| sink.overflowed.load(Ordering::Relaxed));
        if !overflowed {
            return;
        }
        // The full queue takes nothing more, so this drains it (bounded by its size).
        while let Some(event) = self.ctx.events.as_mut().and_then(|rx| rx.try_recv().ok()) {
            self.push_event(event);
        }
        let mut ended: Vec<(Bytes, u64)> = self.ctx.watches.drain().collect();
        ended.sort_unstable_by_key(|&(_, id)| id);
        for (key, watch_id) in ended {
            self.shared.watches.remove(&key, self.ctx.conn_id);
            let message = "events were not read fast enough; every watch on this connection ended"
                .to_string();
            let code = ErrorCode::WatchLimit;
            self.push_pushed(watch_id, Response::Error { code, message });
        }
        // Dropping the receiver makes a notification racing with this one fail harmlessly.
        self.ctx.sink = None;
        self.ctx.events = None;
    }

    /// Queues a frame that answers no request: an event or the end of a watch.
    fn push_pushed(&mut self, id: u64, response: Response) {
        self.events_queued += 1;
        self.queue.push_back(Queued {
            lsn: 0,
            id,
            reply: Reply::Response(response),
            undo: None,
            pushed: true,
            timing: None,
        });
    }

    fn push(&mut self, id: u64, response: Response, lsn: Lsn) {
        self.queue.push_back(Queued {
            lsn,
            id,
            reply: Reply::Response(response),
            undo: None,
            pushed: false,
            timing: self.timing.take(),
        });
    }

    /// Queues the reply to a grant or release, with the way to undo it.
    fn push_change(&mut self, id: u64, response: Response, lsn: Lsn, undo: Undo) {
        self.queue.push_back(Queued {
            lsn,
            id,
            reply: Reply::Response(response),
            undo: Some(undo),
            pushed: false,
            timing: self.timing.take(),
        });
    }

    /// Console-only lines carry no state, so they need no durability; they still go through
    /// the queue to stay in order behind earlier replies.
    fn push_line(&mut self, line: &'static str) {
        self.queue.push_back(Queued {
            lsn: 0,
            id: 0,
            reply: Reply::Line(line),
            undo: None,
            pushed: false,
            timing: None,
        });
    }

    /// Moves every reply whose WAL record is durable into the write buffer, in order.
    fn flush_ready(&mut self, durable: &crate::wal::DurableState) {
        while let Some(front) = self.queue.front() {
            if front.lsn > durable.lsn && durable.failed.is_none() {
                break;
            }
            let Queued {
                lsn,
                id,
                reply,
                undo,
                pushed,
                timing,
            } = self.queue.pop_front().expect("front exists");
            if pushed {
                self.events_queued -= 1;
            }
            let response = match reply {
                Reply::Response(response) => response,
                Reply::Line(line) => {
                    self.wbuf.extend_from_slice(line.as_bytes());
                    self.wbuf.extend_from_slice(b"\n");
                    continue;
                }
            };
            let response = match (&durable.failed, undo) {
                (Some(why), Some(undo)) if lsn > durable.lsn => {
                    // The WAL cut the record off; take the change back here too, so that
                    // "nothing changed" holds now as well as after a restart.
                    if let Undo::Grant { lease_id, .. } = &undo {
                        self.ctx.owned.retain(|(_, l)| l != lease_id);
                    }
                    let message = if self.shared.undo(undo) {
                        format!("not durable, nothing changed: {why}")
                    } else {
                        format!("not durable, the change may be lost: it holds until the server restarts: {why}")
                    };
                    Response::Error {
                        code: ErrorCode::Unavailable,
                        message,
                    }
                }
                (Some(why), None) if lsn > durable.lsn => Response::Error {
                    code: ErrorCode::Unavailable,
                    message: format!(
                        "not durable, the change may be lost: it holds until the server restarts: {why}"
                    ),
                },
                _ => response,
            };
            if let Some(timing) = timing {
                self.shared.stats.metrics.replied(timing, &response);
            }
            self.surface.encode(id, &response, &mut self.wbuf);
        }
    }

    /// Leaves no trace in the shared state.
    fn finish(&mut self) {
        let waits = self.waits.drain().map(|(_, wait)| wait);
        self.shared.disconnect(&mut self.ctx, waits);
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
