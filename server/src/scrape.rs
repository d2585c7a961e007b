//! The `/metrics` scrape and `/readyz`'s readiness: every series, read from the executor
//! serving now (or a cluster node's), at scrape time. Here, above the executor, so that the
//! instruments in [`crate::obs`] need not know what reads them.

use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;

use crate::executor::Executor;
use crate::identity::Identities;
use crate::obs::metrics::{
    counter, gauge, FmtResult, Histogram, Metrics, NS_PER_SECOND, OUTCOMES, SURFACES,
};
use crate::obs::stats::{Stats, OP_KINDS};

/// Why the server should not get traffic yet, in one line; `None` when it should.
pub fn not_ready(shared: Option<&Arc<Executor>>) -> Option<String> {
    let Some(shared) = shared else {
        return Some("not ready: recovering from the WAL".into());
    };
    if let Some(why) = shared.journal().progress().borrow().failed.clone() {
        return Some(format!("not ready: the WAL failed: {why}"));
    }
    let left_ms = shared
        .stats()
        .metrics
        .recovering_ms_left(shared.clock().now_ms());
    if left_ms > 0 {
        return Some(format!(
            "not ready: restarted in token-only durability, no grants for {left_ms} ms more"
        ));
    }
    None
}

/// A cluster node, as the scrape sees it: the executor serving its clients now (it changes
/// with leadership), whether it should get traffic, and its cluster series.
pub trait ClusterSource: Send + Sync {
    /// The executor new client connections are given now.
    fn executor(&self) -> Arc<Executor>;
    /// `Ok` with `/readyz`'s body when the node should get traffic, else why not.
    ///
    /// # Errors
    /// The one-line reason `/readyz` answers with 503.
    fn readiness(&self) -> Result<String, String>;
    /// Writes the cluster series (`tenure_cluster_*`).
    ///
    /// # Errors
    /// When the encoder fails.
    fn encode(&self, encoder: &mut DescriptorEncoder) -> FmtResult;
}

/// The scrape: every metric, read from the server it was given once recovery finished.
#[derive(Clone, Default)]
pub struct Scrape {
    /// The server, set once it has recovered; until then nothing is exported.
    pub executor: Arc<OnceLock<Arc<Executor>>>,
    /// In cluster mode, the node: it names the executor and the readiness instead.
    pub cluster: Arc<OnceLock<Arc<dyn ClusterSource>>>,
}

impl std::fmt::Debug for Scrape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let recovered = self.executor().is_some();
        f.debug_struct("Scrape")
            .field("recovered", &recovered)
            .field("cluster", &self.cluster.get().is_some())
            .finish()
    }
}

impl Scrape {
    /// The scrape of a cluster node.
    pub fn of_cluster(node: Arc<dyn ClusterSource>) -> Scrape {
        let scrape = Scrape::default();
        let _ = scrape.cluster.set(node);
        scrape
    }

    /// The executor whose series are exported: the cluster node's current one, or the
    /// single node's once it has recovered.
    pub fn executor(&self) -> Option<Arc<Executor>> {
        match self.cluster.get() {
            Some(cluster) => Some(cluster.executor()),
            None => self.executor.get().cloned(),
        }
    }

    /// `Ok` with `/readyz`'s body (`ready`, and in cluster mode the role) when the server
    /// should get traffic, else why not.
    ///
    /// # Errors
    /// The one-line reason `/readyz` answers with 503.
    pub fn readiness(&self) -> Result<String, String> {
        if let Some(cluster) = self.cluster.get() {
            return cluster.readiness();
        }
        match not_ready(self.executor.get()) {
            None => Ok("ready".to_string()),
            Some(why) => Err(why),
        }
    }
}

fn histogram(encoder: &mut DescriptorEncoder, name: &str, help: &str, h: &Histogram) -> FmtResult {
    h.encode(encoder.encode_descriptor(name, help, None, MetricType::Histogram)?)
}

impl Collector for Scrape {
    fn encode(&self, mut encoder: DescriptorEncoder) -> FmtResult {
        let Some(shared) = self.executor() else {
            return Ok(());
        };
        let ready = self.readiness().is_ok();
        let help = "1 when /readyz answers 200: recovered, WAL healthy, grants not refused \
                    (cluster mode: a leader is known, and this node serves if it is the leader)";
        gauge(
            &mut encoder,
            "tenure_ready",
            help,
            f64::from(u8::from(ready)),
        )?;
        encode_requests(&mut encoder, &shared.stats().metrics)?;
        encode_table(&mut encoder, &shared)?;
        encode_connections(&mut encoder, shared.stats())?;
        encode_wal(&mut encoder, &shared)?;
        match self.cluster.get() {
            Some(cluster) => cluster.encode(&mut encoder),
            None => Ok(()),
        }
    }
}

/// Requests by op and outcome, their latency, lost renewals.
fn encode_requests(encoder: &mut DescriptorEncoder, m: &Metrics) -> FmtResult {
    let help = "Requests answered, by op and outcome";
    let mut family =
        encoder.encode_descriptor("tenure_requests", help, None, MetricType::Counter)?;
    for (op, row) in OP_KINDS.iter().zip(&m.requests) {
        let op = op.to_ascii_lowercase();
        for (outcome, n) in OUTCOMES.iter().zip(row) {
            let labels = [("op", op.as_str()), ("outcome", *outcome)];
            ConstCounter::new(n.load(Ordering::Relaxed)).encode(family.encode_family(&labels)?)?;
        }
    }
    let help = "Seconds from reading a request to queuing its reply, WAL wait included";
    let name = "tenure_request_duration_seconds";
    let mut family = encoder.encode_descriptor(name, help, None, MetricType::Histogram)?;
    for (op, h) in OP_KINDS.iter().zip(&m.durations) {
        let op = op.to_ascii_lowercase();
        h.encode(family.encode_family(&[("op", op.as_str())])?)?;
    }
    let help = "RENEWs answered LOST: reason=expired if the lease had expired (it was still \
                being renewed), unknown otherwise";
    let mut family =
        encoder.encode_descriptor("tenure_renewals_lost", help, None, MetricType::Counter)?;
    for (reason, n) in [
        ("expired", &m.renewals_lost_expired),
        ("unknown", &m.renewals_lost_other),
    ] {
        let value = ConstCounter::new(n.load(Ordering::Relaxed));
        value.encode(family.encode_family(&[("reason", reason)])?)?;
    }
    Ok(())
}

/// Held locks, waiters, grants, hand-offs, expirations, tokens, recovery.
fn encode_table(encoder: &mut DescriptorEncoder, shared: &Executor) -> FmtResult {
    let s = shared.stats();
    let pairs = crate::executor::stats_pairs(shared);
    let pair = |name: &str| pairs.iter().find(|(n, _)| n == name).map_or(0, |(_, v)| *v);
    gauge(
        encoder,
        "tenure_held_locks",
        "Locks held now",
        pair("held") as f64,
    )?;
    gauge(
        encoder,
        "tenure_waiters",
        "Blocking acquires waiting now",
        pair("waiters") as f64,
    )?;
    gauge(
        encoder,
        "tenure_watches",
        "Keys watched now",
        pair("watches") as f64,
    )?;
    gauge(
        encoder,
        "tenure_shared_held_leases",
        "Read and permit leases held now, on read/write and semaphore keys",
        pair("shared_held") as f64,
    )?;
    encode_sessions(encoder, &pair)?;
    if let Some(identities) = &shared.identities() {
        encode_identities(encoder, identities)?;
    }
    encode_counters(encoder, s)?;
    encode_tokens_and_time(encoder, shared, &pair)
}

/// Sessions (PROTOCOL.md 3.11): live ones and their leases, and how many ended each way.
fn encode_sessions(encoder: &mut DescriptorEncoder, pair: &dyn Fn(&str) -> u64) -> FmtResult {
    let help = "Sessions live now";
    gauge(encoder, "tenure_sessions", help, pair("sessions") as f64)?;
    let help = "Leases held in sessions now";
    let leases = pair("session_leases") as f64;
    gauge(encoder, "tenure_session_leases", help, leases)?;
    let help = "Sessions that ran out (no keep-alive within their TTL)";
    let expired = pair("sessions_expired");
    counter(encoder, "tenure_sessions_expired", help, expired)?;
    let help = "Sessions ended by SESSION_CLOSE";
    counter(
        encoder,
        "tenure_sessions_closed",
        help,
        pair("sessions_closed"),
    )
}

/// The event counters: grants, hand-offs, LOCKED answers, expirations, errors.
fn encode_counters(encoder: &mut DescriptorEncoder, s: &Stats) -> FmtResult {
    counter(
        encoder,
        "tenure_grants",
        "Grants, hand-offs included",
        Stats::get(&s.grants),
    )?;
    let help = "Grants handed to a waiter on release or expiry";
    counter(encoder, "tenure_handoffs", help, Stats::get(&s.handoffs))?;
    let help = "Acquires answered LOCKED, at once or when their wait ran out";
    counter(encoder, "tenure_locked", help, Stats::get(&s.locked))?;
    counter(
        encoder,
        "tenure_expirations",
        "Leases that ran out",
        Stats::get(&s.expirations),
    )?;
    let help = "ACQUIREs answered as a repeat of an earlier one with the same acquire id";
    counter(encoder, "tenure_repeats", help, Stats::get(&s.repeats))?;
    let help = "Grants of read leases, hand-offs included";
    counter(
        encoder,
        "tenure_shared_grants",
        help,
        Stats::get(&s.shared_grants),
    )?;
    let help = "Grants of semaphore permit leases, hand-offs included";
    counter(
        encoder,
        "tenure_permit_grants",
        help,
        Stats::get(&s.permit_grants),
    )?;
    counter(
        encoder,
        "tenure_errors",
        "Requests answered ERROR",
        Stats::get(&s.errors),
    )
}

/// Tokens, recovery, table memory and uptime; `pair` reads one STATS pair.
fn encode_tokens_and_time(
    encoder: &mut DescriptorEncoder,
    shared: &Executor,
    pair: &dyn Fn(&str) -> u64,
) -> FmtResult {
    let m = &shared.stats().metrics;
    let help = "Next fencing token to be granted (the high-water mark)";
    gauge(
        encoder,
        "tenure_token_high_water",
        help,
        pair("token_next") as f64,
    )?;
    let help = "Fencing tokens durably reserved (never granted at or above)";
    gauge(
        encoder,
        "tenure_token_limit",
        help,
        pair("token_limit") as f64,
    )?;
    let recovery = m.recovery_ns.load(Ordering::Relaxed) as f64 / NS_PER_SECOND;
    let help = "Seconds the last start spent replaying the WAL";
    gauge(encoder, "tenure_recovery_duration_seconds", help, recovery)?;
    let left = m.recovering_ms_left(shared.clock().now_ms()) as f64 / 1000.0;
    let help = "Seconds left in which a token-only restart still refuses grants";
    gauge(encoder, "tenure_recovering_seconds_left", help, left)?;
    let help = "Bytes the lock table holds in memory";
    gauge(
        encoder,
        "tenure_table_bytes",
        help,
        pair("table_bytes") as f64,
    )?;
    let help = "Seconds since the server started";
    gauge(
        encoder,
        "tenure_uptime_seconds",
        help,
        shared.clock().now_ms() as f64 / 1000.0,
    )
}

/// Locks held and waiters by identity: one label value per configured identity, so the
/// cardinality is the identities file's length.
fn encode_identities(encoder: &mut DescriptorEncoder, identities: &Identities) -> FmtResult {
    let rows = identities.usage_by_identity();
    let help = "Locks held now (blocking acquires that will hold one included), by identity; \
        locks recovered after a restart count against none";
    let mut family =
        encoder.encode_descriptor("tenure_identity_held_locks", help, None, MetricType::Gauge)?;
    for (name, held, _) in &rows {
        let value = ConstGauge::new(*held as i64);
        value.encode(family.encode_family(&[("identity", name.as_str())])?)?;
    }
    let help = "Blocking acquires waiting now, by identity";
    let mut family =
        encoder.encode_descriptor("tenure_identity_waiters", help, None, MetricType::Gauge)?;
    for (name, _, waiters) in &rows {
        let value = ConstGauge::new(*waiters as i64);
        value.encode(family.encode_family(&[("identity", name.as_str())])?)?;
    }
    Ok(())
}

/// Open connections by surface, accepted and refused ones.
fn encode_connections(encoder: &mut DescriptorEncoder, s: &Stats) -> FmtResult {
    let help = "Client connections open now, by surface (before the first byte: none)";
    let mut family =
        encoder.encode_descriptor("tenure_connections", help, None, MetricType::Gauge)?;
    for (surface, n) in SURFACES.iter().zip(&s.metrics.open_by_surface) {
        let value = ConstGauge::new(n.load(Ordering::Relaxed));
        value.encode(family.encode_family(&[("surface", *surface)])?)?;
    }
    let help = "Client connections accepted";
    counter(
        encoder,
        "tenure_connections_accepted",
        help,
        Stats::get(&s.connections_total),
    )?;
    let help = "Client connections refused at --connections-max (before any surface is known)";
    counter(
        encoder,
        "tenure_connections_refused",
        help,
        Stats::get(&s.connections_refused),
    )?;
    let help = "Unauthenticated client connections closed to make room for newer ones \
        (--unauthenticated-per-address-max, or half of --connections-max)";
    counter(
        encoder,
        "tenure_connections_evicted",
        help,
        s.metrics.evicted.load(Ordering::Relaxed),
    )?;
    let help = "Connections to a TLS port whose TLS handshake failed (a bad or untrusted \
        certificate, plain text, a timeout); one evicted mid-handshake counts as evicted";
    counter(
        encoder,
        "tenure_tls_handshakes_failed",
        help,
        s.metrics.tls_refused.load(Ordering::Relaxed),
    )
}

/// WAL health, fsync latency and batch size, bytes, segments, snapshots.
fn encode_wal(encoder: &mut DescriptorEncoder, executor: &Executor) -> FmtResult {
    // A cluster follower's journal refuses everything by design: "failed", but no WAL did.
    let failed = executor.journal().progress().borrow().failed.is_some()
        && executor.journal().not_leader().is_none();
    let help = "1 once a WAL write or fsync failed (changes are refused until a restart)";
    gauge(
        encoder,
        "tenure_wal_failed",
        help,
        f64::from(u8::from(failed)),
    )?;
    let journal = executor.journal().stats();
    counter(
        encoder,
        "tenure_wal_records",
        "WAL records written",
        journal.records,
    )?;
    let help = "WAL record bytes written";
    counter(encoder, "tenure_wal_written_bytes", help, journal.bytes)?;
    counter(
        encoder,
        "tenure_wal_fsyncs",
        "WAL fdatasync calls",
        journal.fsyncs,
    )?;
    let Some(wal) = executor.journal().wal() else {
        return Ok(()); // a journal that is not a local WAL has no fsyncs or segments
    };
    let (stats, m) = (wal.stats(), wal.metrics());
    let help = "Seconds each WAL fdatasync took";
    histogram(encoder, "tenure_wal_fsync_duration_seconds", help, &m.fsync)?;
    let help = "Records each WAL write batch carried (the group-commit factor)";
    histogram(
        encoder,
        "tenure_wal_records_per_batch",
        help,
        &m.records_per_batch,
    )?;
    let help = "WAL segment files on disk, as of the last batch written";
    gauge(
        encoder,
        "tenure_wal_segments",
        help,
        stats.segments_on_disk as f64,
    )?;
    let help = "Seconds each WAL snapshot of the live locks took";
    histogram(
        encoder,
        "tenure_wal_snapshot_duration_seconds",
        help,
        &m.snapshot,
    )?;
    let help = "WAL snapshots abandoned";
    let failures = m.snapshot_failures.load(Ordering::Relaxed);
    counter(encoder, "tenure_wal_snapshot_failures", help, failures)
}
