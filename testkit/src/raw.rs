//! A bare binary-protocol client, for frames the client crate would not send, and request
//! builders.

use std::net::SocketAddr;

use bytes::{Bytes, BytesMut};
use tenure_protocol::frame::{decode_response, encode_request, split_frame};
use tenure_protocol::handshake::{Hello, HelloAck, VERSION};
use tenure_protocol::{LeaseId, Request, Response};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

use crate::PATIENCE;

/// Receive buffer of [`Raw::connect_small_window`]: the server soon has to wait for it.
const SMALL_WINDOW_BYTES: u32 = 4096;

/// A binary-protocol connection, handshake done.
pub struct Raw {
    stream: TcpStream,
    buf: BytesMut,
}

impl Raw {
    /// Connects and shakes hands; returns the server's handshake reply too.
    pub async fn connect(addr: SocketAddr) -> (Raw, HelloAck) {
        let stream = TcpStream::connect(addr).await.expect("connect");
        Raw::handshake(stream).await
    }

    /// A client whose socket takes in little before the server must wait for it to read.
    pub async fn connect_small_window(addr: SocketAddr) -> Raw {
        let socket = TcpSocket::new_v4().expect("socket");
        socket
            .set_recv_buffer_size(SMALL_WINDOW_BYTES)
            .expect("SO_RCVBUF");
        Raw::handshake(socket.connect(addr).await.expect("connect"))
            .await
            .0
    }

    async fn handshake(mut stream: TcpStream) -> (Raw, HelloAck) {
        let mut out = BytesMut::new();
        Hello { version: VERSION }.encode(&mut out);
        stream.write_all(&out).await.expect("send hello");
        let mut buf = BytesMut::new();
        loop {
            if let Some(ack) = HelloAck::decode(&mut buf).expect("a well-formed hello reply") {
                return (Raw { stream, buf }, ack);
            }
            let read = tokio::time::timeout(PATIENCE, stream.read_buf(&mut buf)).await;
            assert!(
                read.expect("no hello reply in time").expect("read") > 0,
                "closed during handshake"
            );
        }
    }

    /// Sends one request frame.
    pub async fn send(&mut self, id: u64, request: &Request) {
        let mut out = BytesMut::new();
        encode_request(id, request, &mut out);
        self.stream.write_all(&out).await.expect("send a frame");
    }

    /// Sends bytes as they are (a broken frame, say).
    pub async fn send_bytes(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).await.expect("send bytes");
    }

    /// The next frame, or `None` once the server closed; panics if none comes in time.
    pub async fn recv(&mut self) -> Option<(u64, Response)> {
        loop {
            if let Some((opcode, id, body)) = split_frame(&mut self.buf).expect("a frame") {
                return Some((id, decode_response(opcode, body).expect("a response")));
            }
            let read = tokio::time::timeout(PATIENCE, self.stream.read_buf(&mut self.buf));
            if read.await.expect("no frame in time").unwrap_or(0) == 0 {
                return None;
            }
        }
    }

    /// The next frame; panics if the server closed.
    pub async fn frame(&mut self) -> (u64, Response) {
        self.recv().await.expect("connection closed")
    }

    /// Sends `request` as `id` and returns the next frame, which must answer it.
    pub async fn call(&mut self, id: u64, request: Request) -> Response {
        self.send(id, &request).await;
        let (got, response) = self.frame().await;
        assert_eq!(got, id, "reply to another request: {response:?}");
        response
    }

    /// The socket, for tests that look at it or shut it.
    pub fn stream(&mut self) -> &mut TcpStream {
        &mut self.stream
    }
}

/// `text` as key or metadata bytes.
pub fn bytes(text: &str) -> Bytes {
    Bytes::copy_from_slice(text.as_bytes())
}

/// An ACQUIRE of `key` (waiting `wait_ms`, 0 for no wait), not tied to the connection.
pub fn acquire(key: &str, ttl_ms: u32, wait_ms: u32) -> Request {
    acquire_meta(key, ttl_ms, wait_ms, "")
}

/// [`acquire`] with metadata.
pub fn acquire_meta(key: &str, ttl_ms: u32, wait_ms: u32, meta: &str) -> Request {
    Request::Acquire {
        key: bytes(key),
        ttl_ms,
        wait_ms,
        release_on_disconnect: false,
        meta: bytes(meta),
        acquire_id: None,
        kind: Default::default(),
        session_id: None,
    }
}

/// A RELEASE of `key` by `lease_id`.
pub fn release(key: &str, lease_id: LeaseId) -> Request {
    Request::Release {
        key: bytes(key),
        lease_id,
    }
}

/// The token and lease id of a GRANTED reply; panics on anything else.
pub fn granted(response: Response) -> (u64, LeaseId) {
    match response {
        Response::Granted {
            token, lease_id, ..
        } => (token, lease_id),
        other => panic!("expected a grant, got {other:?}"),
    }
}
