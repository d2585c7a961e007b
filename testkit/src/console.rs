//! Text-console clients: one line out, one line back.

use std::io::{self, BufRead, Write};
use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

use crate::PATIENCE;

/// A console session over tokio.
pub struct Console {
    reader: BufReader<tokio::net::tcp::OwnedReadHalf>,
    writer: tokio::net::tcp::OwnedWriteHalf,
}

impl Console {
    /// Connects to the console at `addr`.
    pub async fn connect(addr: SocketAddr) -> Console {
        let (r, w) = TcpStream::connect(addr)
            .await
            .expect("connect to the console")
            .into_split();
        Console {
            reader: BufReader::new(r),
            writer: w,
        }
    }

    /// Sends `text` as it is (add the newline yourself).
    pub async fn send(&mut self, text: &str) {
        self.writer
            .write_all(text.as_bytes())
            .await
            .expect("write to the console");
    }

    /// The next line, without its line end; panics if none comes within [`PATIENCE`] or the
    /// server closed.
    pub async fn line(&mut self) -> String {
        let mut line = String::new();
        let n = tokio::time::timeout(PATIENCE, self.reader.read_line(&mut line))
            .await
            .expect("no line in time")
            .expect("read from the console");
        assert!(n > 0, "connection closed");
        line.trim_end().to_string()
    }

    /// Sends one command line and reads one line back.
    pub async fn cmd(&mut self, text: &str) -> String {
        self.send(&format!("{text}\n")).await;
        self.line().await
    }

    /// The reading half, for tests that read otherwise than line by line.
    pub fn reader(&mut self) -> &mut BufReader<tokio::net::tcp::OwnedReadHalf> {
        &mut self.reader
    }

    /// The writing half, for tests that write what `send` would not (bytes that are no text).
    pub fn writer(&mut self) -> &mut tokio::net::tcp::OwnedWriteHalf {
        &mut self.writer
    }
}

/// A console session over blocking sockets, for tests that run clients on threads.
pub struct LineConn {
    reader: io::BufReader<std::net::TcpStream>,
    writer: std::net::TcpStream,
}

/// Longest a blocking connect may take.
const CONNECT_WAIT_MAX: Duration = Duration::from_secs(2);

impl LineConn {
    /// Connects to `addr`; a read waits at most `read_wait_max`.
    pub fn connect(addr: SocketAddr, read_wait_max: Duration) -> io::Result<LineConn> {
        let stream = std::net::TcpStream::connect_timeout(&addr, CONNECT_WAIT_MAX)?;
        stream.set_read_timeout(Some(read_wait_max))?;
        stream.set_nodelay(true)?;
        Ok(LineConn {
            reader: io::BufReader::new(stream.try_clone()?),
            writer: stream,
        })
    }

    /// Sends `text` as it is.
    pub fn send(&mut self, text: &str) -> io::Result<()> {
        self.writer.write_all(text.as_bytes())
    }

    /// The next line, without its line end; `UnexpectedEof` once the server closed.
    pub fn line(&mut self) -> io::Result<String> {
        let mut line = String::new();
        if self.reader.read_line(&mut line)? == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        Ok(line.trim_end().to_string())
    }

    /// Sends one command line and reads one line back.
    pub fn cmd(&mut self, text: &str) -> io::Result<String> {
        self.send(&format!("{text}\n"))?;
        self.line()
    }
}
