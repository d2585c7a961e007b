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
//! closes this connection and nothing else.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use futures_util::future::BoxFuture;
use futures_util::stream::{FuturesUnordered, StreamExt};
use tenure_protocol::frame::{decode_request, encode_response, split_frame};
use tenure_protocol::handshake::{Hello, HelloAck, HELLO_LEN, VERSION};
use tenure_protocol::limits::FRAME_LEN_MAX;
use tenure_protocol::{ErrorCode, FrameError, Request, Response};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

use crate::config::{LINE_LEN_MAX, READ_BUFFER_MAX};
use crate::console::{self, Command};
use crate::state::{ConnCtx, Outcome, Shared, Undo, WaitResult};
use crate::wal::Lsn;

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
        result: Result<WaitResult, ()>,
        key: Bytes,
        release_on_disconnect: bool,
    },
    Retry {
        id: u64,
        request: Request,
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
    let surface = tokio::select! {
        first = read_first(&mut stream, &mut rbuf) => match first {
            Some(true) => match handshake(&shared, &mut stream, &mut rbuf).await {
                Some(()) => Surface::Binary,
                None => return,
            },
            Some(false) => Surface::Console { line_no: 0, text: String::new() },
            None => return,
        },
        _ = shutdown.cancelled() => return,
    };
    let mut conn = Conn {
        shared,
        stream,
        surface,
        rbuf,
        wbuf: BytesMut::with_capacity(16 * 1024),
        queue: VecDeque::new(),
        later: FuturesUnordered::new(),
        waits: HashMap::new(),
        watched_keys: HashSet::new(),
        ctx: ConnCtx {
            conn_id,
            owned: Vec::new(),
            sink: None,
            events: None,
            watched: 0,
        },
        closing: false,
        fatal: false,
    };
    if let Err(e) = conn.run(&shutdown).await {
        tracing::debug!(conn_id, error = %e, "connection ended with an I/O error");
    }
    conn.finish();
}

/// Reads until at least one byte is in; `Some(true)` for a binary client.
async fn read_first(stream: &mut TcpStream, rbuf: &mut BytesMut) -> Option<bool> {
    while rbuf.is_empty() {
        if stream.read_buf(rbuf).await.ok()? == 0 {
            return None;
        }
    }
    Some(rbuf[0] == 0x00)
}

/// Completes the binary handshake; `None` if the connection must close.
async fn handshake(shared: &Shared, stream: &mut TcpStream, rbuf: &mut BytesMut) -> Option<()> {
    while rbuf.len() < HELLO_LEN {
        if stream.read_buf(rbuf).await.ok()? == 0 {
            return None;
        }
    }
    let hello = Hello::decode(rbuf).ok()??;
    let ack = HelloAck {
        version: VERSION,
        frame_len_max: FRAME_LEN_MAX as u32,
        in_flight_max: shared.config.in_flight_max,
    };
    let mut out = BytesMut::new();
    ack.encode(&mut out);
    stream.write_all(&out).await.ok()?;
    if hello.version != VERSION {
        tracing::debug!(
            version = hello.version,
            "client speaks another protocol version"
        );
        return None;
    }
    Some(())
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
    /// Keys this connection watches, to end its watches when it closes.
    watched_keys: HashSet<Bytes>,
    ctx: ConnCtx,
    closing: bool,
    /// Closing because the peer broke the framing; its unread input is still arriving.
    fatal: bool,
}

impl Conn {
    async fn run(&mut self, shutdown: &CancellationToken) -> std::io::Result<()> {
        let mut durable = self.shared.durable();
        // Made once, not per pass: each `cancelled()` registers with the token's notifier.
        let cancelled = shutdown.cancelled();
        tokio::pin!(cancelled);
        loop {
            if let Err(Fatal(last)) = self.handle_input() {
                if let Some((code, message)) = last {
                    self.push(0, Response::Error { code, message }, 0);
                }
                self.closing = true;
                self.fatal = true;
            }
            self.flush_ready(&durable.borrow());
            if !self.wbuf.is_empty() {
                self.stream.write_all(&self.wbuf).await?;
                self.wbuf.clear();
            }
            if self.closing && self.queue.is_empty() {
                if self.fatal {
                    self.linger().await;
                }
                return Ok(());
            }
            let blocked = !self.queue.is_empty();
            let can_read = !self.closing && self.rbuf.len() < READ_BUFFER_MAX;
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
                _ = &mut cancelled, if !self.closing => self.closing = true,
            }
        }
    }

    /// Closing a socket with unread input makes the kernel send a reset, which can destroy
    /// the error reply just written. So: send FIN, then read and discard for a short, bounded
    /// while, giving the peer time to read the reason before the connection goes.
    async fn linger(&mut self) {
        let _ = self.stream.shutdown().await;
        let drain = async {
            let mut scratch = vec![0u8; 16 * 1024];
            let mut drained = 0usize;
            while drained < LINGER_BYTES_MAX {
                match self.stream.read(&mut scratch).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => drained += n,
                }
            }
        };
        let _ = tokio::time::timeout(LINGER_TIME_MAX, drain).await;
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
                Input::Request(id, request) => self.on_request(id, request),
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

    fn in_flight(&self) -> usize {
        self.queue.len() + self.later.len()
    }

    fn on_request(&mut self, id: u64, request: Request) {
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
        let watch_key = match &request {
            Request::Watch { key } | Request::Unwatch { key } => Some(key.clone()),
            _ => None,
        };
        match self.shared.execute(&mut self.ctx, id, request) {
            Outcome::Reply(response, lsn) => {
                match (watch_key, &response) {
                    (Some(key), Response::Watching) => {
                        self.watched_keys.insert(key);
                    }
                    (Some(key), Response::Unwatched) => {
                        self.watched_keys.remove(&key);
                    }
                    _ => {}
                }
                self.push(id, response, lsn)
            }
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
                self.later.push(Box::pin(async move {
                    let result = rx.await.map_err(|_| ());
                    Later::Wait {
                        id,
                        result,
                        key,
                        release_on_disconnect,
                    }
                }));
            }
            Outcome::NeedTokens(request) => {
                let shared = Arc::clone(&self.shared);
                self.later.push(Box::pin(async move {
                    let reserved = shared.reserve_tokens().await.map_err(|e| e.to_string());
                    Later::Retry {
                        id,
                        request,
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
                result,
                key,
                release_on_disconnect,
            } => {
                self.waits.remove(&id);
                let (response, lsn) = match result {
                    Ok(WaitResult::Granted { grant, lsn }) => {
                        if release_on_disconnect {
                            self.ctx.owned.push((key.clone(), grant.lease_id));
                        }
                        let response = Response::Granted {
                            token: grant.token,
                            lease_id: grant.lease_id,
                            ttl_ms: grant.ttl_ms,
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
                    Err(()) => {
                        let message =
                            "the wait was cancelled: the server is shutting down".to_string();
                        (
                            Response::Error {
                                code: ErrorCode::ShuttingDown,
                                message,
                            },
                            0,
                        )
                    }
                };
                self.push(id, response, lsn);
            }
            Later::Retry {
                id,
                request,
                reserved,
            } => match reserved {
                // Runs (and counts) the acquire again; reservations are rare enough not to matter.
                Ok(()) => self.on_request(id, request),
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

    fn on_event(&mut self, event: crate::watch::WatchEvent) {
        let sink_overflowed = self
            .ctx
            .sink
            .as_ref()
            .is_some_and(|s| s.overflowed.swap(false, Ordering::Relaxed));
        if sink_overflowed {
            for key in std::mem::take(&mut self.watched_keys) {
                self.shared.watches.remove(&key, self.ctx.conn_id);
            }
            self.ctx.watched = 0;
            let message = "events were not read fast enough; all watches on this connection ended"
                .to_string();
            self.push(
                event.watch_id,
                Response::Error {
                    code: ErrorCode::WatchLimit,
                    message,
                },
                0,
            );
            return;
        }
        let crate::watch::WatchEvent {
            watch_id,
            kind,
            key,
            token,
            meta,
        } = event;
        self.push(
            watch_id,
            Response::Event {
                kind,
                key,
                token,
                meta,
            },
            0,
        );
    }

    fn push(&mut self, id: u64, response: Response, lsn: Lsn) {
        self.queue.push_back(Queued {
            lsn,
            id,
            reply: Reply::Response(response),
            undo: None,
        });
    }

    /// Queues the reply to a grant or release, with the way to undo it.
    fn push_change(&mut self, id: u64, response: Response, lsn: Lsn, undo: Undo) {
        self.queue.push_back(Queued {
            lsn,
            id,
            reply: Reply::Response(response),
            undo: Some(undo),
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
            } = self.queue.pop_front().expect("front exists");
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
            self.surface.encode(id, &response, &mut self.wbuf);
        }
    }

    /// Leaves no trace in the shared state.
    fn finish(&mut self) {
        let waits = self.waits.drain().map(|(_, wait)| wait);
        let keys: Vec<Bytes> = self.watched_keys.drain().collect();
        self.shared.disconnect(&mut self.ctx, waits, &keys);
    }
}

async fn recv_event(
    events: &mut Option<tokio::sync::mpsc::Receiver<crate::watch::WatchEvent>>,
) -> Option<crate::watch::WatchEvent> {
    match events {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}
