//! What a [`Client`](crate::Client) is made with ([`ClientConfig`], [`Credentials`]) and
//! what one acquire asks for ([`AcquireOptions`]): plain data, so that every layer (the
//! connection manager, the client, elections) can take them without importing the client.

use std::fmt;
use std::time::Duration;

use bytes::Bytes;
use tenure_protocol::limits::IN_FLIGHT_MAX_DEFAULT;

use crate::tls::TlsOptions;

/// The default [`ClientConfig::acquire_retry_for`]: a restart of a loaded single node or a
/// cluster's election with a slow takeover fits in it.
pub const ACQUIRE_RETRY_FOR_DEFAULT: Duration = Duration::from_secs(15);

/// How a [`Client`](crate::Client) talks to the server.
#[derive(Clone, Debug)]
pub struct ClientConfig {
    /// Longest wait for the answer to one request; a blocking acquire adds its `wait`.
    pub request_timeout: Duration,
    /// Longest wait for one address to connect and open (TCP, TLS handshake, the protocol's
    /// handshake and AUTH); past it the next address is tried (no request has been sent on
    /// that connection yet). A request's own `request_timeout` bounds it too.
    pub connect_timeout: Duration,
    /// Delay before the attempt that follows a first failed reconnect.
    pub reconnect_delay_min: Duration,
    /// Cap on the delay between reconnect attempts. A renewal, a session's keep-alive or
    /// close, and a release wait at most 250 ms of it, so a server back within a lease's
    /// time left is reached in time, and a lease given back is freed soon after.
    pub reconnect_delay_max: Duration,
    /// Most requests kept in flight on the connection; the server's cap (announced in the
    /// handshake) wins when it is lower.
    pub in_flight_max: u32,
    /// The identity to authenticate as, right after the handshake of every connection
    /// (reconnects included); `None` for a server without identities.
    pub credentials: Option<Credentials>,
    /// TLS to the server; `None`: plain TCP.
    pub tls: Option<TlsOptions>,
    /// How long, past its wait, an ACQUIRE whose outcome is unknown (connection lost, no
    /// answer in time, `NOT_LEADER` or `SHUTTING_DOWN` mid-write, a restart) keeps being sent
    /// again with its acquire id, counted from its first send; never less than
    /// `request_timeout`. Long enough for a fail-over or a restart, and far inside the
    /// server's memory of ended acquire ids (70 minutes, PROTOCOL.md 3.9).
    pub acquire_retry_for: Duration,
}

/// [`ClientConfig`] by another name: the options a [`Client`](crate::Client) is made with.
pub type ClientOptions = ClientConfig;

impl ClientConfig {
    /// These options, speaking TLS as `tls` says.
    pub fn with_tls(mut self, tls: TlsOptions) -> Self {
        self.tls = Some(tls);
        self
    }

    /// These options, authenticating as `name` with `secret` on every connection.
    pub fn with_credentials(mut self, name: impl Into<String>, secret: impl Into<Bytes>) -> Self {
        self.credentials = Some(Credentials {
            name: name.into(),
            secret: secret.into(),
        });
        self
    }
}

/// An identity's name and secret. `Debug` does not show the secret.
#[derive(Clone)]
pub struct Credentials {
    /// The identity's name.
    pub name: String,
    /// Its secret.
    pub secret: Bytes,
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credentials")
            .field("name", &self.name)
            .field("secret", &"<secret>")
            .finish()
    }
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            request_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(2),
            reconnect_delay_min: Duration::from_millis(50),
            reconnect_delay_max: Duration::from_secs(5),
            in_flight_max: IN_FLIGHT_MAX_DEFAULT,
            credentials: None,
            tls: None,
            acquire_retry_for: ACQUIRE_RETRY_FOR_DEFAULT,
        }
    }
}

/// Options of one acquire.
#[derive(Clone, Debug, Default)]
pub struct AcquireOptions {
    /// How long to wait in line if the lock is held; zero answers LOCKED at once. Waiters are
    /// served first come, first served.
    pub wait: Duration,
    /// Holder metadata, readable by INSPECT and watchers (for example a leader's address).
    pub meta: Bytes,
    /// Free the lock the moment this client's connection closes, instead of at the lease's
    /// end. The lease is then tied to this connection: after a reconnect it is gone.
    pub release_on_disconnect: bool,
}

impl AcquireOptions {
    /// Options that wait in line up to `wait`.
    pub fn wait(wait: Duration) -> AcquireOptions {
        AcquireOptions {
            wait,
            ..AcquireOptions::default()
        }
    }
}
