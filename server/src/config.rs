//! Runtime configuration: every limit the server enforces, with defaults sized for one node.
//!
//! Wire limits (key length, frame size, TTL range) are in `tenure_protocol::limits`; the ones
//! here are about this server's resources and may differ between deployments.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// How much of the lock state survives a crash.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize,
)]
// The config file spells it as the flag does: `durability = "tokens"`.
#[serde(rename_all = "kebab-case")]
pub enum Durability {
    /// Every grant and release is in the WAL and synced before its reply: held locks come back
    /// after a restart with the same lease ids and tokens.
    Full,
    /// Only the fencing-token high-water mark is synced. After a restart the server refuses new
    /// grants for `ttl_max` so that locks granted before the crash have run out.
    Tokens,
}

/// Everything `run` needs to know. Built by the binary from flags, or by tests.
#[derive(Clone, Debug)]
pub struct Config {
    /// Address the binary binds (tests bind their own listener and ignore it).
    pub listen: SocketAddr,
    /// Address the binary binds for `/metrics`, `/healthz` and `/readyz`; `None`: no HTTP.
    /// Tests pass their own listener to `run_with_metrics` and ignore it.
    pub metrics_listen: Option<SocketAddr>,
    /// Directory of the write-ahead log; created if missing.
    pub data_dir: PathBuf,
    /// What survives a crash.
    pub durability: Durability,
    /// Whether the WAL calls fsync. Off only in tests and benchmarks: without it a crash of the
    /// machine (not just the process) can reuse fencing tokens.
    pub fsync: bool,
    /// Most client connections at once; one more is told `CONNECTIONS_LIMIT` and closed.
    pub connections_max: usize,
    /// Most connections from one peer address that have not authenticated yet (when the
    /// server authenticates: identities or a client CA); one more closes the oldest of them
    /// (see [`crate::admission`]).
    pub unauthenticated_per_address_max: usize,
    /// Most locks held at once across the server.
    pub held_max: usize,
    /// Most blocking acquires waiting at once across the server.
    pub waiters_max: usize,
    /// Most blocking acquires waiting on one key.
    pub waiters_per_key_max: usize,
    /// Most live sessions across the server (PROTOCOL.md 3.11).
    pub sessions_max: usize,
    /// Most leases one session holds and waits for (its waiting ACQUIREs count too).
    pub session_leases_max: usize,
    /// Most requests one connection may have unanswered.
    pub in_flight_max: u32,
    /// Most keys one connection may watch.
    pub watches_per_connection_max: usize,
    /// Most events queued for one watching connection before its watches are dropped.
    pub watch_queue_max: usize,
    /// Longest lease the server grants, in milliseconds (at most the wire limit).
    pub ttl_ms_max: u32,
    /// Number of lock-table shards (each a mutex over part of the keys).
    pub shards: usize,
    /// How often the expiry ticker runs. Expired locks are freed within this of their deadline.
    pub tick_interval: Duration,
    /// Most expirations (and waiter time-outs) handled per shard per tick, so an expiry storm
    /// cannot starve requests; the rest wait for the next tick.
    pub expirations_per_tick_max: usize,
    /// Fencing tokens reserved in the WAL per sync; a block is reserved ahead of need.
    pub token_block: u64,
    /// How long shutdown waits for connections to finish before closing them.
    pub shutdown_grace: Duration,
    /// WAL segment size in bytes: segments rotate at this size, and a snapshot of the live
    /// locks lets older segments be deleted, so disk use follows the live state.
    pub wal_segment_bytes_max: u64,
    /// Longest a new connection may take to finish the binary handshake or send its first
    /// whole console line; a silent one is closed, so it cannot hold a connection slot.
    pub handshake_timeout: Duration,
    /// Idle time before the first TCP keepalive probe on an accepted socket (`TCP_KEEPIDLE`).
    pub keepalive_idle: Duration,
    /// Time between unanswered keepalive probes (`TCP_KEEPINTVL`).
    pub keepalive_interval: Duration,
    /// Unanswered probes after which the kernel drops the connection (`TCP_KEEPCNT`). A peer
    /// that vanished is noticed within `keepalive_idle + keepalive_interval * keepalive_count`,
    /// and then its waiters and release-on-disconnect locks go as on any close.
    pub keepalive_count: u32,
    /// The identities file (see [`crate::identity`]); `None`: no identities, and then only a
    /// loopback address may be served unless `insecure_no_auth` is set.
    pub identities: Option<PathBuf>,
    /// Serve a non-loopback address without identities: anyone who can connect may take,
    /// release and inspect every lock.
    pub insecure_no_auth: bool,
    /// TLS on the client port (see [`crate::tls`]); `None`: plain TCP.
    pub tls: Option<crate::tls::TlsFiles>,
}

/// Most keepalive probes the kernel accepts in `TCP_KEEPCNT` (Linux caps it at 127).
pub const KEEPALIVE_COUNT_MAX: u32 = 127;
/// Longest keepalive idle or interval the kernel accepts: `TCP_KEEPIDLE` and `TCP_KEEPINTVL`
/// are whole seconds, at most 32767.
pub const KEEPALIVE_SECS_MAX: u64 = 32_767;

/// Connections that have not authenticated yet may take at most 1/this of
/// `connections_max` in all (see [`Config::unauthenticated_max`]): the rest is always left to
/// authenticated connections, however many addresses a flood of silent sockets comes from.
pub const UNAUTHENTICATED_SHARE_DIVISOR: usize = 2;

/// Bytes a connection may read ahead before it stops reading until replies are written.
/// There is no write-side limit: a connection writes all it encoded before it reads again,
/// so its unsent replies are bounded by what this much input produces (see `conn`).
pub const READ_BUFFER_MAX: usize = 256 * 1024;

const _: () = assert!(READ_BUFFER_MAX > tenure_protocol::limits::FRAME_LEN_MAX + 4);
const _: () = assert!(READ_BUFFER_MAX > tenure_protocol::limits::LINE_LEN_MAX + 1);

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: SocketAddr::from(([127, 0, 0, 1], 7878)),
            metrics_listen: None,
            data_dir: PathBuf::from("./tenure-data"),
            durability: Durability::Full,
            fsync: true,
            connections_max: 10_000,
            unauthenticated_per_address_max: 64,
            held_max: 2_000_000,
            waiters_max: 1_000_000,
            waiters_per_key_max: 10_000,
            sessions_max: 65_536,
            session_leases_max: 65_536,
            in_flight_max: tenure_protocol::limits::IN_FLIGHT_MAX_DEFAULT,
            watches_per_connection_max: 1024,
            watch_queue_max: 4096,
            ttl_ms_max: 3_600_000,
            shards: 64,
            tick_interval: Duration::from_millis(2),
            expirations_per_tick_max: 4096,
            token_block: 1 << 20,
            shutdown_grace: Duration::from_secs(5),
            wal_segment_bytes_max: crate::wal::SEGMENT_SIZE_MAX_DEFAULT,
            handshake_timeout: Duration::from_secs(10),
            // 60 s + 10 s * 6: a vanished peer is dropped within two minutes.
            keepalive_idle: Duration::from_secs(60),
            keepalive_interval: Duration::from_secs(10),
            keepalive_count: 6,
            identities: None,
            insecure_no_auth: false,
            tls: None,
        }
    }
}

impl Config {
    /// Defaults for tests: data in `data_dir`, fsync off, small limits so tests can hit them.
    pub fn for_tests(data_dir: &std::path::Path) -> Config {
        Config {
            data_dir: data_dir.to_path_buf(),
            fsync: false,
            connections_max: 256,
            held_max: 100_000,
            waiters_max: 10_000,
            waiters_per_key_max: 1_000,
            token_block: 1_000,
            shutdown_grace: Duration::from_millis(500),
            ..Config::default()
        }
    }

    /// Checks that the limits make sense together.
    ///
    /// # Errors
    /// A message naming the first setting out of range, by its `tenured` flag (the settings
    /// without a flag by their names), so that `tenured` can say where its value came from.
    pub fn validate(&self) -> Result<(), String> {
        use tenure_protocol::limits::{TTL_MS_MAX, TTL_MS_MIN};
        if !(TTL_MS_MIN..=TTL_MS_MAX).contains(&self.ttl_ms_max) {
            return Err(format!(
                "--ttl-max-ms {} outside {TTL_MS_MIN}..={TTL_MS_MAX}",
                self.ttl_ms_max
            ));
        }
        if self.shards == 0 || self.shards > 4096 {
            return Err(format!("--shards {} outside 1..=4096", self.shards));
        }
        for (name, value) in [
            ("--connections-max", self.connections_max),
            (
                "--unauthenticated-per-address-max",
                self.unauthenticated_per_address_max,
            ),
            ("--held-max", self.held_max),
            ("--in-flight-max", self.in_flight_max as usize),
            ("expirations per tick", self.expirations_per_tick_max),
            ("token block", self.token_block as usize),
        ] {
            if value == 0 {
                return Err(format!("{name} must be at least 1"));
            }
        }
        self.validate_connection_timing()?;
        if let Some(tls) = &self.tls {
            if tls.cert.as_os_str().is_empty() || tls.key.as_os_str().is_empty() {
                return Err(
                    "TLS needs both a certificate (--tls-cert) and its key (--tls-key)".into(),
                );
            }
        }
        if self.wal_segment_bytes_max < 64 * 1024 {
            return Err(format!(
                "--wal-segment-bytes {} is under 64 KiB",
                self.wal_segment_bytes_max
            ));
        }
        if self.held_max > u32::MAX as usize / 2 {
            return Err(format!(
                "--held-max {} is over {}",
                self.held_max,
                u32::MAX / 2
            ));
        }
        Ok(())
    }

    /// Most connections that have not authenticated yet, in all: a share of
    /// `connections_max` ([`UNAUTHENTICATED_SHARE_DIVISOR`]), at least one.
    pub fn unauthenticated_max(&self) -> usize {
        (self.connections_max / UNAUTHENTICATED_SHARE_DIVISOR).max(1)
    }

    /// Whether connections must prove who they are (identities, or a client CA for mutual
    /// TLS): only then are there unauthenticated connections to bound.
    pub fn authenticates(&self) -> bool {
        let client_ca = self.tls.as_ref().is_some_and(|t| t.client_ca.is_some());
        self.identities.is_some() || client_ca
    }

    /// The handshake limit and the keepalive settings, which the kernel takes in whole
    /// seconds (see [`keepalive_secs`]).
    fn validate_connection_timing(&self) -> Result<(), String> {
        if self.handshake_timeout.is_zero() {
            return Err("--handshake-timeout-ms must be over 0".into());
        }
        for (name, value) in [
            ("--keepalive-idle-ms", self.keepalive_idle),
            ("--keepalive-interval-ms", self.keepalive_interval),
        ] {
            if value.is_zero() || keepalive_secs(value) > KEEPALIVE_SECS_MAX {
                return Err(format!(
                    "{name} {} outside 1..={} (ms)",
                    value.as_millis(),
                    KEEPALIVE_SECS_MAX * 1000
                ));
            }
        }
        if !(1..=KEEPALIVE_COUNT_MAX).contains(&self.keepalive_count) {
            return Err(format!(
                "--keepalive-count {} outside 1..={KEEPALIVE_COUNT_MAX}",
                self.keepalive_count
            ));
        }
        Ok(())
    }
}

/// A keepalive time in the kernel's unit, whole seconds, rounded up so that a setting never
/// probes sooner than asked (and 1-999 ms does not become 0, which the kernel refuses).
pub fn keepalive_secs(time: Duration) -> u64 {
    time.as_secs() + u64::from(time.subsec_nanos() > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connection_timing_is_validated_and_rounded_up_to_seconds() {
        assert!(Config::default().validate().is_ok());
        let zero_count = Config {
            keepalive_count: 0,
            ..Config::default()
        };
        assert!(zero_count.validate().is_err());
        let too_long = Config {
            keepalive_idle: Duration::from_secs(KEEPALIVE_SECS_MAX + 1),
            ..Config::default()
        };
        assert!(too_long.validate().is_err());
        let no_handshake = Config {
            handshake_timeout: Duration::ZERO,
            ..Config::default()
        };
        assert!(no_handshake.validate().is_err());
        assert_eq!(keepalive_secs(Duration::from_millis(1)), 1);
        assert_eq!(keepalive_secs(Duration::from_millis(2000)), 2);
        assert_eq!(keepalive_secs(Duration::from_millis(2001)), 3);
    }
}
