//! Closing a connection after a fatal error without destroying the error reply: used by the
//! connection and by the TLS handshake's refusal, below both.

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Most bytes discarded from a peer after a fatal error, while its error reply drains.
const LINGER_BYTES_MAX: usize = 4 << 20;
/// Longest wait for that peer to close after a fatal error.
const LINGER_TIME_MAX: std::time::Duration = std::time::Duration::from_millis(500);

/// Closing a socket with unread input makes the kernel send a reset, which can destroy
/// the error reply just written. So: send FIN, then read and discard for a short, bounded
/// while, giving the peer time to read the reason before the connection goes.
pub async fn linger(stream: &mut (impl AsyncRead + AsyncWrite + Unpin)) {
    // The shutdown inside the bound too: over TLS it writes a record, which waits for a peer
    // that does not read (outside test a40, G0).
    let drain = async {
        let _ = stream.shutdown().await;
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
