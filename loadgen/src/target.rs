//! Where the load goes: parsing the target, refusing remote hosts, connecting.

use anyhow::{bail, ensure, Context};
use bytes::BytesMut;
use tenure_protocol::handshake::{Hello, HelloAck, VERSION};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{lookup_host, TcpStream};

use crate::resp;
use crate::wire::Proto;

/// The server kind named by the target's scheme.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// `tenure://`: tenure's binary protocol.
    Tenure,
    /// `redis://`: RESP2.
    Redis,
}

/// A parsed target.
#[derive(Clone, Debug)]
pub struct Target {
    /// Which protocol.
    pub kind: Kind,
    /// Resolved address.
    pub addr: std::net::SocketAddr,
}

/// A connected stream and the protocol state agreed during setup.
pub struct Connected {
    /// The stream, handshake done.
    pub stream: TcpStream,
    /// Encoder and decoder for it.
    pub proto: Proto,
    /// Requests the server lets this connection have in flight (tenure's handshake says).
    pub in_flight_max: usize,
}

impl Target {
    /// Parses `scheme://host:port` and resolves it; refuses hosts off loopback unless allowed.
    ///
    /// # Errors
    /// For an unknown scheme, an unresolvable host or a remote one without `allow_remote`.
    pub async fn parse(text: &str, allow_remote: bool) -> anyhow::Result<Target> {
        let (kind, rest) = if let Some(rest) = text.strip_prefix("tenure://") {
            (Kind::Tenure, rest)
        } else if let Some(rest) = text.strip_prefix("redis://") {
            (Kind::Redis, rest)
        } else {
            bail!("target {text:?} must start with tenure:// or redis://");
        };
        let rest = rest.trim_end_matches('/');
        let addrs: Vec<_> = lookup_host(rest)
            .await
            .with_context(|| format!("resolving {rest:?}"))?
            .collect();
        let Some(addr) = addrs.first().copied() else {
            bail!("{rest:?} resolves to no address");
        };
        if !allow_remote && !addrs.iter().all(|a| a.ip().is_loopback()) {
            bail!("{rest:?} is not a loopback address; pass --allow-remote to load it anyway");
        }
        Ok(Target { kind, addr })
    }

    /// Opens one connection and does the protocol's setup.
    ///
    /// # Errors
    /// When the connection or handshake fails.
    pub async fn connect(&self, fenced: bool) -> anyhow::Result<Connected> {
        let mut stream = TcpStream::connect(self.addr)
            .await
            .with_context(|| format!("connecting to {}", self.addr))?;
        stream.set_nodelay(true)?;
        match self.kind {
            Kind::Tenure => {
                let ack = tenure_hello(&mut stream).await?;
                Ok(Connected {
                    stream,
                    proto: Proto::Tenure,
                    in_flight_max: usize::try_from(ack.limits.in_flight_max)?,
                })
            }
            Kind::Redis => {
                let scripts = resp::setup(&mut stream).await?;
                Ok(Connected {
                    stream,
                    proto: Proto::Redis { scripts, fenced },
                    in_flight_max: usize::MAX,
                })
            }
        }
    }
}

async fn tenure_hello(stream: &mut TcpStream) -> anyhow::Result<HelloAck> {
    let mut out = BytesMut::new();
    Hello { version: VERSION }.encode(&mut out);
    stream.write_all(&out).await?;
    let mut input = BytesMut::with_capacity(64);
    loop {
        if let Some(ack) = HelloAck::decode(&mut input)? {
            ensure!(
                ack.version == VERSION,
                "server speaks protocol version {}, we speak {VERSION}",
                ack.version
            );
            ensure!(
                ack.limits.in_flight_max > 0,
                "server allows no request in flight"
            );
            return Ok(ack);
        }
        if stream.read_buf(&mut input).await? == 0 {
            bail!("server closed the connection during the handshake");
        }
    }
}
