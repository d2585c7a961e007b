//! A proxy that loses a reply on purpose: it forwards every connection to its upstream and,
//! while its trap is armed, throws away the first GRANTED (the grant is durable: the server
//! replies only then), reports it, and closes that connection when the test says so. An
//! ACQUIRE whose answer it lost has an unknown outcome for its client, which must find its
//! one grant by a repeat of the acquire id (PROTOCOL.md 3.9).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tenure::LeaseId;
use tenure_protocol::Response;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, Notify};

/// Opcode of GRANTED (PROTOCOL.md 3.2).
const GRANTED: u8 = 0x82;

/// The grant a proxy threw away: its token and lease id.
pub type Dropped = (u64, LeaseId);

/// What the proxies share: whether the next GRANTED is to be dropped, where to report it,
/// and the signal to cut the client's connection once the test has done its harm.
pub struct Trap {
    armed: AtomicBool,
    dropped: mpsc::UnboundedSender<Dropped>,
    cut: Notify,
}

impl Trap {
    /// A trap, disarmed, and the receiver of the grants it will drop.
    pub fn new() -> (Arc<Trap>, mpsc::UnboundedReceiver<Dropped>) {
        let (dropped, rx) = mpsc::unbounded_channel();
        let trap = Trap {
            armed: AtomicBool::new(false),
            dropped,
            cut: Notify::new(),
        };
        (Arc::new(trap), rx)
    }

    /// Drops the next GRANTED any proxy of this trap forwards.
    pub fn arm(&self) {
        self.armed.store(true, Ordering::SeqCst);
    }

    /// Closes the connection whose GRANTED was dropped.
    pub fn cut(&self) {
        self.cut.notify_one();
    }
}

/// The next grant the trap dropped, within `within`.
///
/// # Panics
/// If none was dropped in time.
pub async fn next_drop(rx: &mut mpsc::UnboundedReceiver<Dropped>, within: Duration) -> Dropped {
    tokio::time::timeout(within, rx.recv())
        .await
        .expect("a grant within the step's time")
        .expect("the trap lives")
}

/// A proxy on a port of its own that forwards every connection to `upstream` (connecting
/// anew each time, so it reaches a restarted server) through `trap`. Returns its address.
///
/// Aborting the returned task closes its port, so that new connections are refused as a
/// killed node's are.
pub async fn proxy(upstream: SocketAddr, trap: Arc<Trap>) -> (String, tokio::task::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let accepting = tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let trap = Arc::clone(&trap);
            tokio::spawn(async move {
                let Ok(server) = TcpStream::connect(upstream).await else {
                    return; // the server is down: the client sees a closed connection
                };
                let (mut client_read, client_write) = client.into_split();
                let (server_read, mut server_write) = server.into_split();
                let upward = tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut client_read, &mut server_write).await;
                });
                let _ = forward_replies(server_read, client_write, &trap).await;
                upward.abort();
            });
        }
    });
    (addr, accepting)
}

/// Copies the server's handshake answer, then its frames one by one, dropping a GRANTED
/// when the trap is armed (and then waiting for the cut before returning, which closes the
/// client's connection).
async fn forward_replies(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    trap: &Trap,
) -> std::io::Result<()> {
    let mut header = [0u8; tenure_protocol::handshake::HELLO_ACK_HEADER_LEN];
    from.read_exact(&mut header).await?;
    let mut body = vec![0u8; usize::from(u16::from_be_bytes([header[8], header[9]]))];
    from.read_exact(&mut body).await?;
    to.write_all(&header).await?;
    to.write_all(&body).await?;
    loop {
        let mut len = [0u8; 4];
        from.read_exact(&mut len).await?;
        let mut frame = vec![0u8; u32::from_be_bytes(len) as usize];
        from.read_exact(&mut frame).await?;
        if frame[0] == GRANTED && trap.armed.swap(false, Ordering::SeqCst) {
            let body = bytes::Bytes::copy_from_slice(&frame[9..]);
            let Ok(Response::Granted {
                token, lease_id, ..
            }) = tenure_protocol::frame::decode_response(GRANTED, body)
            else {
                panic!("an undecodable GRANTED");
            };
            trap.dropped.send((token, lease_id)).unwrap();
            trap.cut.notified().await;
            return Ok(());
        }
        to.write_all(&len).await?;
        to.write_all(&frame).await?;
    }
}
