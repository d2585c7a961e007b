//! Where the load goes: parsing the target, refusing remote hosts, connecting, and the
//! per-connection setup (TLS, the binary handshake, AUTH) whose cost the report shows.

use std::time::Instant;

use anyhow::{bail, ensure, Context};
use bytes::{Bytes, BytesMut};
use tenure_protocol::frame::{decode_response, encode_request, split_frame, Secret};
use tenure_protocol::handshake::{Hello, HelloAck, VERSION};
use tenure_protocol::{Request, Response};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{lookup_host, TcpStream};

use std::net::SocketAddr;

use crate::etcd::EtcdState;

use crate::args::Args;
use crate::proto::Proto;
use crate::resp;
use crate::tls::{Tls, TlsFlags};

/// Request id of the AUTH sent during setup (ids of the run's requests start afresh at 1 on
/// the connection afterwards; the server only echoes ids).
const AUTH_REQUEST_ID: u64 = 1;
/// Most addresses one target may name (a cluster's members).
pub const MEMBERS_MAX: usize = 16;

/// The server kind named by the target's scheme.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// `tenure://`: tenure's binary protocol.
    Tenure,
    /// `redis://`: RESP2.
    Redis,
    /// `etcd://`: etcd's v3 JSON gateway on its client port (see [`crate::etcd`]).
    Etcd,
}

/// A parsed target.
#[derive(Clone, Debug)]
pub struct Target {
    /// Which protocol.
    pub kind: Kind,
    /// Resolved address the connections go to (a cluster's leader, once found).
    pub addr: std::net::SocketAddr,
    /// Every address given (`scheme://a,b,c`: a cluster's members), in the order written.
    pub addrs: Vec<std::net::SocketAddr>,
    /// The host as written (brackets of an IPv6 address removed): TLS's default server name.
    pub host: String,
}

/// An identity and its secret, for AUTH on every connection.
pub struct Credentials {
    /// The identity's name.
    pub name: String,
    /// Its secret (from `TENURE_SECRET`, never a flag).
    pub secret: Bytes,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Credentials({:?}, <secret>)", self.name)
    }
}

/// Environment variable holding the secret for `--identity` (as for the `tenure` command line).
const SECRET_VAR: &str = "TENURE_SECRET";

/// What every tenure connection does after the TCP connect: TLS, AUTH, both or neither.
#[derive(Default)]
pub struct Security {
    /// TLS over the socket.
    pub tls: Option<Tls>,
    /// AUTH right after the binary handshake.
    pub credentials: Option<Credentials>,
}

impl Security {
    /// TLS and credentials from the flags and `TENURE_SECRET`.
    ///
    /// # Errors
    /// For TLS or credentials given to a Redis target, unreadable TLS files, or `--identity`
    /// without its secret.
    pub fn from_flags(args: &Args, target: &Target) -> anyhow::Result<Security> {
        if target.kind == Kind::Redis && (args.tls_ca.is_some() || args.identity.is_some()) {
            bail!("--tls-ca and --identity are for tenure:// targets only");
        }
        let tls = match &args.tls_ca {
            None => None,
            Some(ca) => Some(Tls::load(&TlsFlags {
                ca,
                client: args
                    .tls_client_cert
                    .as_ref()
                    .zip(args.tls_client_key.as_ref()),
                server_name: args.tls_server_name.as_deref().unwrap_or(&target.host),
            })?),
        };
        let credentials = match &args.identity {
            None => None,
            Some(name) => {
                let secret = std::env::var_os(SECRET_VAR)
                    .filter(|s| !s.is_empty())
                    .with_context(|| {
                        format!("--identity {name:?} needs its secret in {SECRET_VAR}")
                    })?;
                Some(Credentials {
                    name: name.clone(),
                    secret: secret.into_encoded_bytes().into(),
                })
            }
        };
        Ok(Security { tls, credentials })
    }
}

/// The transport a connection ended up with.
pub enum Stream {
    /// Plain TCP: split into owned halves, no lock between reader and writer.
    Plain(TcpStream),
    /// TLS over TCP (boxed: the session state is large).
    Tls(Box<tokio_rustls::client::TlsStream<TcpStream>>),
}

/// How long one connection's setup took, nanoseconds.
#[derive(Clone, Copy, Debug, Default)]
pub struct SetupTimes {
    /// From before the TCP connect until the connection was ready for load.
    pub total_ns: u64,
    /// The TLS handshake, when TLS is on.
    pub tls_ns: Option<u64>,
    /// AUTH, from sending it to its AUTHENTICATED reply, when an identity is given.
    pub auth_ns: Option<u64>,
}

/// A connected stream and the protocol state agreed during setup.
pub struct Connected {
    /// The stream, handshake done.
    pub stream: Stream,
    /// Encoder and decoder for it.
    pub proto: Proto,
    /// Requests the server lets this connection have in flight (tenure's handshake says).
    pub in_flight_max: usize,
    /// What the setup cost.
    pub setup: SetupTimes,
}

fn elapsed_ns(since: Instant) -> u64 {
    u64::try_from(since.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

impl Target {
    /// Parses `scheme://host:port[,host:port...]` and resolves each address; refuses hosts off
    /// loopback unless allowed. Several addresses name a cluster's members.
    ///
    /// # Errors
    /// For an unknown scheme, an unresolvable host or a remote one without `allow_remote`.
    pub async fn parse(text: &str, allow_remote: bool) -> anyhow::Result<Target> {
        let (kind, rest) = if let Some(rest) = text.strip_prefix("tenure://") {
            (Kind::Tenure, rest)
        } else if let Some(rest) = text.strip_prefix("redis://") {
            (Kind::Redis, rest)
        } else if let Some(rest) = text.strip_prefix("etcd://") {
            (Kind::Etcd, rest)
        } else {
            bail!("target {text:?} must start with tenure://, redis:// or etcd://");
        };
        let rest = rest.trim_end_matches('/');
        let mut addrs = Vec::new();
        for one in rest.split(',') {
            addrs.push(resolve(one, allow_remote).await?);
        }
        ensure!(
            addrs.len() <= MEMBERS_MAX,
            "{} addresses; a cluster has at most {MEMBERS_MAX}",
            addrs.len()
        );
        ensure!(
            kind != Kind::Redis || addrs.len() == 1,
            "a redis:// target takes one address"
        );
        let host = host_of(rest.split(',').next().unwrap_or(rest)).to_owned();
        Ok(Target {
            kind,
            addr: addrs[0],
            addrs,
            host,
        })
    }

    /// Opens one connection to `addr` (the target's, or one of a cluster's members) and does
    /// the protocol's setup: TLS and AUTH as `security` says.
    ///
    /// # Errors
    /// When the connection, TLS, the handshake or AUTH fails.
    pub async fn connect_to(
        &self,
        addr: SocketAddr,
        fenced: bool,
        security: &Security,
    ) -> anyhow::Result<Connected> {
        let start = Instant::now();
        let mut stream = TcpStream::connect(addr)
            .await
            .with_context(|| format!("connecting to {addr}"))?;
        stream.set_nodelay(true)?;
        if self.kind == Kind::Etcd {
            ensure!(
                security.tls.is_none() && security.credentials.is_none(),
                "TLS and --identity are for tenure:// targets only"
            );
            return Ok(Connected {
                stream: Stream::Plain(stream),
                proto: Proto::Etcd(EtcdState::new(&addr.to_string())),
                in_flight_max: usize::MAX,
                setup: SetupTimes {
                    total_ns: elapsed_ns(start),
                    ..SetupTimes::default()
                },
            });
        }
        if self.kind == Kind::Redis {
            ensure!(
                security.tls.is_none() && security.credentials.is_none(),
                "TLS and --identity are for tenure:// targets only"
            );
            let scripts = resp::setup(&mut stream).await?;
            return Ok(Connected {
                stream: Stream::Plain(stream),
                proto: Proto::Redis { scripts, fenced },
                in_flight_max: usize::MAX,
                setup: SetupTimes {
                    total_ns: elapsed_ns(start),
                    ..SetupTimes::default()
                },
            });
        }
        let mut setup = SetupTimes::default();
        let (stream, in_flight_max) = match &security.tls {
            None => {
                let in_flight_max = tenure_setup(&mut stream, security, &mut setup).await?;
                (Stream::Plain(stream), in_flight_max)
            }
            Some(tls) => {
                let tls_start = Instant::now();
                let mut stream = tls.handshake(stream).await?;
                setup.tls_ns = Some(elapsed_ns(tls_start));
                let in_flight_max = tenure_setup(&mut stream, security, &mut setup).await?;
                (Stream::Tls(Box::new(stream)), in_flight_max)
            }
        };
        setup.total_ns = elapsed_ns(start);
        Ok(Connected {
            stream,
            proto: Proto::tenure(),
            in_flight_max,
            setup,
        })
    }
}

/// Connects to a tenure node at `addr` as every connection of the run does (TLS and AUTH
/// when `security` has them: a cluster's client port may need either), does the handshake
/// and asks `request`; returns the reply.
///
/// # Errors
/// When the connection, TLS, the handshake or AUTH fails, or the reply does not decode.
pub async fn tenure_ask(
    addr: SocketAddr,
    security: &Security,
    request: &Request,
) -> anyhow::Result<Response> {
    let stream = TcpStream::connect(addr)
        .await
        .with_context(|| format!("connecting to {addr}"))?;
    stream.set_nodelay(true)?;
    match &security.tls {
        None => ask_on(stream, addr, security, request).await,
        Some(tls) => ask_on(tls.handshake(stream).await?, addr, security, request).await,
    }
}

/// [`tenure_ask`] on a connected stream.
async fn ask_on<S: AsyncRead + AsyncWrite + Unpin>(
    mut stream: S,
    addr: SocketAddr,
    security: &Security,
    request: &Request,
) -> anyhow::Result<Response> {
    tenure_setup(&mut stream, security, &mut SetupTimes::default()).await?;
    let mut out = BytesMut::new();
    encode_request(AUTH_REQUEST_ID, request, &mut out);
    stream.write_all(&out).await?;
    stream.flush().await?;
    let mut input = BytesMut::with_capacity(256);
    loop {
        if let Some((opcode, _id, body)) = split_frame(&mut input).context("reply")? {
            return decode_response(opcode, body).context("reply");
        }
        if stream.read_buf(&mut input).await? == 0 {
            bail!("{addr} closed the connection before answering");
        }
    }
}

/// Resolves one `host:port`; refuses a host off loopback unless allowed.
async fn resolve(one: &str, allow_remote: bool) -> anyhow::Result<SocketAddr> {
    let addrs: Vec<_> = lookup_host(one)
        .await
        .with_context(|| format!("resolving {one:?}"))?
        .collect();
    let Some(addr) = addrs.first().copied() else {
        bail!("{one:?} resolves to no address");
    };
    if !allow_remote && !addrs.iter().all(|a| a.ip().is_loopback()) {
        bail!("{one:?} is not a loopback address; pass --allow-remote to load it anyway");
    }
    Ok(addr)
}

/// The binary handshake, then AUTH if credentials are given; returns the in-flight limit.
async fn tenure_setup<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    security: &Security,
    setup: &mut SetupTimes,
) -> anyhow::Result<usize> {
    let mut input = BytesMut::with_capacity(64);
    let ack = tenure_hello(stream, &mut input).await?;
    if let Some(credentials) = &security.credentials {
        let auth_start = Instant::now();
        tenure_auth(stream, &mut input, credentials).await?;
        setup.auth_ns = Some(elapsed_ns(auth_start));
    }
    ensure!(
        input.is_empty(),
        "server sent {} bytes nobody asked for during setup",
        input.len()
    );
    Ok(usize::try_from(ack.limits.in_flight_max)?)
}

async fn tenure_hello<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    input: &mut BytesMut,
) -> anyhow::Result<HelloAck> {
    let mut out = BytesMut::new();
    Hello { version: VERSION }.encode(&mut out);
    stream.write_all(&out).await?;
    // A TLS stream may hold written bytes back until flushed; a TCP stream's flush is a no-op.
    stream.flush().await?;
    loop {
        if let Some(ack) = HelloAck::decode(input)? {
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
        if stream.read_buf(input).await? == 0 {
            bail!("server closed the connection during the handshake");
        }
    }
}

/// Sends AUTH and waits for its reply (PROTOCOL.md 3.7: nothing may be pipelined behind it).
async fn tenure_auth<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    input: &mut BytesMut,
    credentials: &Credentials,
) -> anyhow::Result<()> {
    let name = &credentials.name;
    let mut out = BytesMut::new();
    let request = Request::Auth {
        name: Bytes::copy_from_slice(name.as_bytes()),
        secret: Secret(credentials.secret.clone()),
    };
    encode_request(AUTH_REQUEST_ID, &request, &mut out);
    stream.write_all(&out).await?;
    stream.flush().await?;
    loop {
        if let Some((opcode, id, body)) = split_frame(input).context("AUTH reply")? {
            let reply = decode_response(opcode, body).context("AUTH reply")?;
            match reply {
                Response::Authenticated { .. } if id == AUTH_REQUEST_ID => return Ok(()),
                Response::Error { code, message } => bail!(
                    "AUTH as {name:?} refused: {code} {message} (check --identity and the \
                     secret in TENURE_SECRET)"
                ),
                other => bail!("AUTH as {name:?}: unexpected reply {other:?} (id {id})"),
            }
        }
        if stream.read_buf(input).await? == 0 {
            bail!("server closed the connection during AUTH as {name:?}");
        }
    }
}

/// `host` of `host:port` or `[v6]:port`.
fn host_of(addr: &str) -> &str {
    if let Some(rest) = addr.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    addr.rsplit_once(':').map_or(addr, |(host, _)| host)
}

#[cfg(test)]
mod tests {
    use super::host_of;

    #[test]
    fn host_is_the_address_without_its_port() {
        assert_eq!(host_of("localhost:7878"), "localhost");
        assert_eq!(host_of("127.0.0.1:7878"), "127.0.0.1");
        assert_eq!(host_of("[::1]:7878"), "::1");
    }
}
