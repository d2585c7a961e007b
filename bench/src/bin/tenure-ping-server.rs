//! `tenure-ping-server`: the least a tenure server can be. It speaks tenure's handshake and
//! answers PING, and every other request with `UNKNOWN_COMMAND`; nothing else. Pointed at by
//! the load generator (`--op ping`), it measures what the load generator's own client and the
//! kernel's loopback carry, so that every figure of the real server can be read as a ratio to
//! that limit measured in the same run (BENCHMARKS.md).
//!
//! It reads whatever has arrived, answers every whole frame in it with one write, and reads
//! again: the same batching the real server does, with none of its work.
//!
//! ```sh
//! tenure-ping-server --listen 127.0.0.1:17100 [--threads N]
//! ```

use std::net::SocketAddr;

use bytes::BytesMut;
use tenure_protocol::frame::{encode_response, op, split_frame};
use tenure_protocol::handshake::{Hello, HelloAck, ServerLimits, HELLO_LEN, VERSION};
use tenure_protocol::limits::{IN_FLIGHT_MAX_DEFAULT, TTL_MS_MAX};
use tenure_protocol::{ErrorCode, Response};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Bytes read at a time, as the real server reads.
const READ_CHUNK: usize = 16 * 1024;

fn main() -> std::io::Result<()> {
    let mut listen: SocketAddr = "127.0.0.1:17100".parse().expect("a valid default");
    let mut threads = None;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let value = args.next();
        match (arg.as_str(), value) {
            ("--listen", Some(v)) => listen = v.parse().map_err(invalid)?,
            ("--threads", Some(v)) => threads = Some(v.parse().map_err(invalid)?),
            _ => {
                eprintln!("usage: tenure-ping-server [--listen ADDR] [--threads N]");
                std::process::exit(2);
            }
        }
    }
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    if let Some(threads) = threads {
        runtime.worker_threads(threads);
    }
    runtime.enable_all().build()?.block_on(async move {
        let listener = TcpListener::bind(listen).await?;
        eprintln!("tenure-ping-server listening on {}", listener.local_addr()?);
        loop {
            let (stream, _) = listener.accept().await?;
            tokio::spawn(async move {
                let _ = serve(stream).await;
            });
        }
    })
}

fn invalid(e: impl std::fmt::Display) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string())
}

async fn serve(mut stream: TcpStream) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    let mut input = BytesMut::with_capacity(READ_CHUNK);
    while input.len() < HELLO_LEN {
        if stream.read_buf(&mut input).await? == 0 {
            return Ok(());
        }
    }
    let mut output = BytesMut::with_capacity(READ_CHUNK);
    match Hello::decode(&mut input) {
        Ok(Some(hello)) if hello.version == VERSION => HelloAck {
            version: VERSION,
            limits: ServerLimits::with(IN_FLIGHT_MAX_DEFAULT, TTL_MS_MAX),
        }
        .encode(&mut output),
        _ => return Ok(()),
    }
    stream.write_all(&output).await?;
    output.clear();
    loop {
        if input.capacity() - input.len() < READ_CHUNK / 4 {
            input.reserve(READ_CHUNK);
        }
        if stream.read_buf(&mut input).await? == 0 {
            return Ok(());
        }
        loop {
            match split_frame(&mut input) {
                Ok(Some((opcode, id, _body))) => {
                    let response = if opcode == op::PING {
                        Response::Pong
                    } else {
                        Response::Error {
                            code: ErrorCode::UnknownOpcode,
                            message: "this server answers PING only".into(),
                        }
                    };
                    encode_response(id, &response, &mut output);
                }
                Ok(None) => break,
                Err(_) => return Ok(()),
            }
        }
        if !output.is_empty() {
            stream.write_all(&output).await?;
            output.clear();
        }
    }
}
