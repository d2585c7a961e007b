//! A scripted stand-in for the server, for unit tests of behaviour the real server cannot be
//! made to show on demand (renewals that hang, odd handshakes, durability errors).
//!
//! Tests run it under a paused clock (`#[tokio::test(start_paused = true)]`). tokio then
//! jumps to the next timer whenever every task is idle, also while a loopback reply is
//! already on its way; so the fake server keeps a timer due every [`NETWORK_DELAY_MAX`], and
//! a round trip costs at most that much virtual time instead of a jump to the client's
//! request timeout.

use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use futures_util::StreamExt;
use tenure_protocol::frame::encode_response;
use tenure_protocol::handshake::{HelloAck, ServerLimits, HELLO_LEN};
use tenure_protocol::{Request, Response, ServerCodec};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::codec::FramedRead;

/// The most virtual time one hop over the fake network takes (see the module comment).
pub(crate) const NETWORK_DELAY_MAX: Duration = Duration::from_millis(1);

/// Answers each request with what the script returns; `None` never answers.
pub(crate) type Script = Arc<dyn Fn(&Request) -> Option<Response> + Send + Sync>;

/// A fake server listening on 127.0.0.1:0.
pub(crate) struct FakeServer {
    pub(crate) addr: String,
    task: JoinHandle<()>,
    heartbeat: JoinHandle<()>,
}

impl Drop for FakeServer {
    fn drop(&mut self) {
        self.task.abort();
        self.heartbeat.abort();
    }
}

/// Starts a fake server that announces `version` and `in_flight_max` and answers by `script`.
pub(crate) async fn start(version: u16, in_flight_max: u32, script: Script) -> FakeServer {
    start_delayed(version, in_flight_max, script, Duration::ZERO).await
}

/// Like [`start`], but every answer is written `delay` after its request was read (answers
/// stay in order, like a slow network).
pub(crate) async fn start_delayed(
    version: u16,
    in_flight_max: u32,
    script: Script,
    delay: Duration,
) -> FakeServer {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    serve_on(listener, version, in_flight_max, script, delay)
}

/// Like [`start`], on `addr` (a fake server dropped there before: a restart on the same
/// address, as after a `kill -9`).
pub(crate) async fn start_at(
    addr: &str,
    version: u16,
    in_flight_max: u32,
    script: Script,
) -> FakeServer {
    // The dropped server's listener closes when its aborted task is dropped: soon.
    for _ in 0..REBIND_TRIES {
        if let Ok(listener) = TcpListener::bind(addr).await {
            return serve_on(listener, version, in_flight_max, script, Duration::ZERO);
        }
        tokio::task::yield_now().await;
    }
    panic!("cannot bind {addr} again");
}

/// Attempts to bind an address again in [`start_at`].
const REBIND_TRIES: usize = 1_000;

/// Serves `listener`. Dropping the [`FakeServer`] closes every connection it accepted, as a
/// crash would.
fn serve_on(
    listener: TcpListener,
    version: u16,
    in_flight_max: u32,
    script: Script,
    delay: Duration,
) -> FakeServer {
    let addr = listener.local_addr().expect("addr").to_string();
    let task = tokio::spawn(async move {
        // Owned by this task, so that aborting it aborts every connection too.
        let mut connections = tokio::task::JoinSet::new();
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            while connections.try_join_next().is_some() {}
            let script = Arc::clone(&script);
            connections.spawn(serve(stream, version, in_flight_max, script, delay));
        }
    });
    let heartbeat = tokio::spawn(async {
        loop {
            tokio::time::sleep(NETWORK_DELAY_MAX).await;
        }
    });
    FakeServer {
        addr,
        task,
        heartbeat,
    }
}

async fn serve(
    mut stream: tokio::net::TcpStream,
    version: u16,
    in_flight_max: u32,
    script: Script,
    delay: Duration,
) {
    let mut hello = [0u8; HELLO_LEN];
    if stream.read_exact(&mut hello).await.is_err() {
        return;
    }
    let mut out = BytesMut::new();
    let ack = HelloAck {
        version,
        limits: ServerLimits::with(in_flight_max, tenure_protocol::limits::TTL_MS_MAX),
    };
    ack.encode(&mut out);
    let (read, mut write) = stream.into_split();
    if write.write_all(&out).await.is_err() {
        return;
    }
    let mut frames = FramedRead::new(read, ServerCodec);
    while let Some(Ok((id, request))) = frames.next().await {
        let Ok(request) = request else { return };
        if let Some(response) = script(&request) {
            tokio::time::sleep(delay).await;
            out.clear();
            encode_response(id, &response, &mut out);
            if write.write_all(&out).await.is_err() {
                return;
            }
        }
    }
}
