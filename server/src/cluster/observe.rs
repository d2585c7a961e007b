//! Watching a cluster node: the digests of its security configuration (CLUSTER STATUS's
//! extension and the `tenure_cluster_config_digest_info` series), its Raft series for
//! `/metrics`, and what `/readyz` answers (README, "Metrics and health").
//!
//! # Digests
//! Each node reads its own identities file and TLS files, and the nodes must agree: a client
//! that follows `NOT_LEADER` to a node that refuses its identity sees a fail-over become an
//! outage. A digest is the first 8 bytes of BLAKE2s-256 over what is *in force* (a reload
//! that failed changes nothing), computed when asked, so it follows every SIGHUP reload:
//! - identities: a domain line, then [`Identity::canonical`] of each identity, sorted, one
//!   per line: the parsed meaning, so comments, order and spacing in the file do not count;
//! - trust set: a domain line, then each `--tls-client-ca` certificate (DER) with its length,
//!   sorted: the set, not the file's order.
//!
//! Either is all zeros (`-` when printed) when not configured.
//!
//! [`Identity::canonical`]: crate::identity::Identity::canonical

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use blake2::{Blake2s256, Digest as _};
use openraft::{RaftMetrics, ServerState};
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use tenure_protocol::cluster::{Digest, Role, StatusExtension};

use super::catch_up::CatchUp;
use super::node::Serving;
use super::prevote::PreVote;
use super::state::SnapshotMetrics;
use super::{NodeId, NodeInfo, Raft};
use crate::executor::Executor;
use crate::identity::Identities;
use crate::obs::metrics::{counter, gauge, FmtResult, Histogram};
use crate::scrape::ClusterSource;
use crate::tls::Tls;

/// A node's security configuration, as the digests are taken over.
#[derive(Clone, Default)]
pub struct Security {
    identities: Option<Arc<Identities>>,
    tls: Option<Arc<Tls>>,
}

impl Security {
    /// The configuration in force in `identities` and `tls` (either may be absent).
    pub fn new(identities: Option<Arc<Identities>>, tls: Option<Arc<Tls>>) -> Security {
        Security { identities, tls }
    }

    /// The digest of the identities in force (module docs); none without a file.
    pub fn identities_digest(&self) -> Digest {
        let Some(identities) = &self.identities else {
            return Digest::default();
        };
        let lines = identities.canonical_lines();
        digest(
            b"tenure identities v1\n",
            lines.iter().map(|l| l.as_bytes()),
        )
    }

    /// The digest of the client CA certificates in force (module docs); none without them.
    pub fn trust_digest(&self) -> Digest {
        let trusted = self.tls.as_ref().map(|tls| tls.trusted());
        let Some(trusted) = trusted.filter(|t| !t.is_empty()) else {
            return Digest::default();
        };
        let mut certs: Vec<&[u8]> = trusted.iter().map(|c| c.as_ref()).collect();
        certs.sort_unstable();
        digest(b"tenure trust v1\n", certs.into_iter())
    }
}

/// BLAKE2s-256 over `domain`, then each part with its length, cut to 8 bytes; never all
/// zeros (that is "not configured").
fn digest<'a>(domain: &[u8], parts: impl Iterator<Item = &'a [u8]>) -> Digest {
    let mut hasher = Blake2s256::new();
    hasher.update(domain);
    for part in parts {
        hasher.update((part.len() as u64).to_be_bytes());
        hasher.update(part);
    }
    let hash = hasher.finalize();
    let mut out = [0u8; 8];
    out.copy_from_slice(&hash[..8]);
    if out == [0; 8] {
        out[7] = 1; // one chance in 2^64: still not "not configured"
    }
    Digest(out)
}

/// How long this node's Raft core took over its leader's AppendEntries, and how far apart
/// they came: what a follower's leader lease (and so pre-vote) sees. A heartbeat sent while
/// an append is on its way waits on the leader for that append's answer (one replication
/// stream per follower), so the gaps show the wait; the durations show what it waits for.
#[derive(Debug)]
pub struct AppendTimes {
    /// Seconds from the arrival of an AppendEntries carrying entries to its answer: the
    /// entries written and fsynced.
    pub with_entries: Histogram,
    /// Seconds from the arrival of an empty AppendEntries (a heartbeat) to its answer.
    pub heartbeats: Histogram,
    /// Seconds between two AppendEntries arriving here, of either kind.
    pub gaps: Histogram,
    /// When the last one arrived.
    last: std::sync::Mutex<Option<std::time::Instant>>,
}

impl Default for AppendTimes {
    fn default() -> Self {
        AppendTimes {
            with_entries: Histogram::latency_seconds(),
            heartbeats: Histogram::latency_seconds(),
            gaps: Histogram::latency_seconds(),
            last: std::sync::Mutex::new(None),
        }
    }
}

impl AppendTimes {
    /// Notes an AppendEntries' arrival; returns the instant its duration counts from.
    pub fn arrived(&self) -> std::time::Instant {
        let now = std::time::Instant::now();
        if let Some(last) = self.last.lock().expect("poisoned").replace(now) {
            let gap = now.saturating_duration_since(last);
            self.gaps.observe_duration(gap);
            if gap > std::time::Duration::from_millis(100) {
                tracing::info!(gap_ms = gap.as_millis() as u64, "AppendEntries gap");
            }
        }
        now
    }

    /// Notes the answer to an AppendEntries that arrived at `arrived`.
    pub fn answered(&self, arrived: std::time::Instant, heartbeat: bool) {
        let histogram = if heartbeat {
            &self.heartbeats
        } else {
            &self.with_entries
        };
        histogram.observe_duration(arrived.elapsed());
    }

    fn encode(&self, encoder: &mut DescriptorEncoder) -> FmtResult {
        let help = "Seconds this node took to answer an AppendEntries carrying entries \
                    (written and fsynced), as follower";
        let name = "tenure_cluster_append_duration_seconds";
        histogram(encoder, name, help, &self.with_entries)?;
        let help = "Seconds this node took to answer an empty AppendEntries (a heartbeat)";
        let name = "tenure_cluster_heartbeat_duration_seconds";
        histogram(encoder, name, help, &self.heartbeats)?;
        let help = "Seconds between two AppendEntries arriving at this node (its leader \
                    lease runs out when one gap exceeds it)";
        let name = "tenure_cluster_append_gap_seconds";
        histogram(encoder, name, help, &self.gaps)
    }
}

/// What a node counts about its cluster beyond openraft's metrics.
#[derive(Debug)]
pub struct Counters {
    /// Leaders this node has seen take office: a (term, leader) pair it had not seen last.
    pub leader_changes: AtomicU64,
    /// Terms in which this node stood for election.
    pub elections_started: AtomicU64,
    /// Terms in which this node won its election (became leader).
    pub elections_won: AtomicU64,
    /// Seconds from proposing a batch of records to its commit, on this node as leader.
    pub commit: Arc<Histogram>,
}

impl Default for Counters {
    fn default() -> Self {
        Counters {
            leader_changes: AtomicU64::new(0),
            elections_started: AtomicU64::new(0),
            elections_won: AtomicU64::new(0),
            commit: Arc::new(Histogram::latency_seconds()),
        }
    }
}

/// Counts leader changes from `raft`'s metrics into `counters` until the core stops.
/// Counts leader changes and this node's elections from `raft`'s metrics into `counters`
/// until the core stops. The metrics watch keeps only the latest value, so a candidacy too
/// short to be seen is counted when its win is (a win implies it stood).
pub async fn count_leader_changes(raft: Raft, counters: Arc<Counters>) {
    let mut metrics = raft.metrics();
    let mut last: Option<(u64, NodeId)> = None;
    let mut stood_in: Option<u64> = None;
    let mut won_in: Option<u64> = None;
    loop {
        let (seen, state, term, me) = {
            let m = metrics.borrow_and_update();
            let seen = m.current_leader.map(|leader| (m.current_term, leader));
            (seen, m.state, m.current_term, m.id)
        };
        if seen.is_some() && seen != last {
            counters.leader_changes.fetch_add(1, Ordering::Relaxed);
            last = seen;
        }
        let won = state == ServerState::Leader && seen == Some((term, me));
        if (state == ServerState::Candidate || won) && stood_in != Some(term) {
            counters.elections_started.fetch_add(1, Ordering::Relaxed);
            stood_in = Some(term);
        }
        if won && won_in != Some(term) {
            counters.elections_won.fetch_add(1, Ordering::Relaxed);
            won_in = Some(term);
        }
        if metrics.changed().await.is_err() {
            return;
        }
    }
}

/// The role as the wire and the console name it.
pub fn role_of(state: ServerState) -> Role {
    match state {
        ServerState::Learner => Role::Learner,
        ServerState::Follower => Role::Follower,
        ServerState::Candidate => Role::Candidate,
        ServerState::Leader => Role::Leader,
        ServerState::Shutdown => Role::Shutdown,
    }
}

/// CLUSTER STATUS's extension for this node now.
pub fn extension(
    m: &RaftMetrics<NodeId, NodeInfo>,
    security: &Security,
    catch_up: &CatchUp,
) -> StatusExtension {
    StatusExtension {
        identities_digest: security.identities_digest(),
        trust_digest: security.trust_digest(),
        last_contact_ms: last_contact_ms(m, catch_up),
    }
}

/// Milliseconds since this node last heard its cluster: a quorum's acknowledgement on the
/// leader, an AppendEntries on any other node.
fn last_contact_ms(m: &RaftMetrics<NodeId, NodeInfo>, catch_up: &CatchUp) -> Option<u64> {
    if m.state == ServerState::Leader {
        return m.millis_since_quorum_ack;
    }
    catch_up.since_append_ms()
}

/// A cluster node for the scrape: see [`ClusterSource`].
pub struct NodeScrape {
    /// The node's Raft, whose metrics watch the series are read from.
    pub(super) raft: Raft,
    /// The executor serving new connections, which changes with leadership.
    pub(super) current: Arc<RwLock<Serving>>,
    /// What the digests are taken over.
    pub(super) security: Security,
    /// Leader changes and commit latency.
    pub(super) counters: Arc<Counters>,
    /// Where the last AppendEntries was noted (a follower's last contact).
    pub(super) catch_up: Arc<CatchUp>,
    /// Snapshot build and install timings.
    pub(super) snapshots: Arc<SnapshotMetrics>,
    /// Pre-vote rounds run and pre-votes refused.
    pub(super) prevote: Arc<PreVote>,
    /// Peer connections refused for another cluster's id.
    pub(super) cluster_id: Arc<super::cluster_id::ClusterId>,
    /// AppendEntries durations and gaps, as follower.
    pub(super) appends: Arc<AppendTimes>,
}

impl NodeScrape {
    /// openraft's metrics, with the leader this node knows
    /// ([`known_leader`](super::catch_up::known_leader)).
    fn metrics(&self) -> RaftMetrics<NodeId, NodeInfo> {
        let mut m = self.raft.metrics().borrow().clone();
        m.current_leader = super::catch_up::known_leader(&m, &self.catch_up, self.prevote.lease());
        m
    }
}

impl ClusterSource for NodeScrape {
    fn executor(&self) -> Arc<Executor> {
        Arc::clone(&self.current.read().expect("poisoned").executor)
    }

    fn readiness(&self) -> Result<String, String> {
        let m = self.metrics();
        let executor = self.executor();
        let serving = executor.journal().not_leader().is_none();
        readiness(&m, serving)?;
        // A follower's journal refuses everything by design; the leader's may have failed.
        if let Some(why) = serving
            .then(|| crate::scrape::not_ready(Some(&executor)))
            .flatten()
        {
            return Err(why);
        }
        let role = role_of(m.state).name();
        Ok(match m.current_leader {
            Some(leader) if leader != m.id => format!("ready: {role}, leader {leader}"),
            _ => format!("ready: {role}"),
        })
    }

    fn encode(&self, encoder: &mut DescriptorEncoder) -> FmtResult {
        let m = self.metrics();
        encode_state(encoder, &m)?;
        encode_log(encoder, &m)?;
        encode_replication(encoder, &m)?;
        let contact = last_contact_ms(&m, &self.catch_up);
        if let Some(ms) = contact {
            let help = "Seconds since this node last heard its cluster: a quorum's \
                        acknowledgement on the leader, an AppendEntries on any other node";
            let name = "tenure_cluster_last_contact_seconds";
            gauge(encoder, name, help, ms as f64 / 1000.0)?;
        }
        let changes = self.counters.leader_changes.load(Ordering::Relaxed);
        let help = "Leaders this node has seen take office (a new term or a new leader)";
        counter(encoder, "tenure_cluster_leader_changes", help, changes)?;
        let started = self.counters.elections_started.load(Ordering::Relaxed);
        let help = "Terms in which this node stood for election";
        counter(encoder, "tenure_cluster_elections_started", help, started)?;
        let won = self.counters.elections_won.load(Ordering::Relaxed);
        let help = "Terms in which this node won its election and led";
        counter(encoder, "tenure_cluster_elections_won", help, won)?;
        encode_prevote(encoder, &self.prevote)?;
        let refused = self.cluster_id.refused();
        let help = "Peer connections refused because they were of another cluster (cluster id)";
        let name = "tenure_cluster_peer_connections_refused_cluster";
        counter(encoder, name, help, refused)?;
        let help = "Seconds from proposing a batch of records to its commit, as leader";
        let name = "tenure_cluster_commit_duration_seconds";
        histogram(encoder, name, help, &self.counters.commit)?;
        let help = "Seconds each snapshot of the replicated state built here took, file synced";
        let name = "tenure_cluster_snapshot_build_duration_seconds";
        histogram(encoder, name, help, &self.snapshots.built)?;
        let help = "Seconds each snapshot installed here from a leader took, file synced";
        let name = "tenure_cluster_snapshot_install_duration_seconds";
        histogram(encoder, name, help, &self.snapshots.installed)?;
        let deferred = self.snapshots.deferred.load(Ordering::Relaxed);
        let help = "Committed entries applied once a snapshot let go of the replicated state, their apply answered at once";
        counter(
            encoder,
            "tenure_cluster_entries_applied_after_snapshot",
            help,
            deferred,
        )?;
        self.appends.encode(encoder)?;
        encode_digests(encoder, &self.security)
    }
}

fn encode_prevote(encoder: &mut DescriptorEncoder, prevote: &PreVote) -> FmtResult {
    let rounds = prevote.rounds.load(Ordering::Relaxed);
    let help = "Pre-vote rounds this node ran: its election timer fired and it asked the voters";
    counter(encoder, "tenure_cluster_prevote_rounds", help, rounds)?;
    let granted = prevote.granted_rounds.load(Ordering::Relaxed);
    let help = "Pre-vote rounds a quorum granted, after which this node stood for election";
    counter(
        encoder,
        "tenure_cluster_prevote_rounds_granted",
        help,
        granted,
    )?;
    let refused = prevote.refused.load(Ordering::Relaxed);
    let help = "Pre-votes this node refused (it heard a leader, leads, or has a longer log)";
    counter(encoder, "tenure_cluster_prevotes_refused", help, refused)
}

fn histogram(encoder: &mut DescriptorEncoder, name: &str, help: &str, h: &Histogram) -> FmtResult {
    h.encode(encoder.encode_descriptor(name, help, None, MetricType::Histogram)?)
}

/// Why a node with metrics `m` (that serves clients as leader if `serving`) should not get
/// traffic: `Ok` when it knows a leader and, if openraft says it leads, its takeover is done.
///
/// # Errors
/// The reason, for `/readyz`'s 503.
pub fn readiness(m: &RaftMetrics<NodeId, NodeInfo>, serving: bool) -> Result<(), String> {
    if m.running_state.is_err() || m.state == ServerState::Shutdown {
        return Err("not ready: the Raft core stopped".to_string());
    }
    let membership = m.membership_config.membership();
    if membership.get_node(&m.id).is_none() {
        let why = "not ready: this node is not in the cluster's membership (removed, not yet \
                   added, or not initialised)";
        return Err(why.to_string());
    }
    let role = role_of(m.state).name();
    match m.current_leader {
        None => Err(format!(
            "not ready: no leader known ({role}, term {})",
            m.current_term
        )),
        // openraft names this node leader both while its takeover commits and, for a
        // while, once it is cut off from a quorum (its journal refuses then): the line
        // cannot tell them apart, so it names both (outside tester a29's finding 4).
        Some(leader) if leader == m.id && !serving => Err(format!(
            "not ready: leading term {} but not serving: taking over, or out of touch with \
             a quorum",
            m.current_term
        )),
        Some(_) => Ok(()),
    }
}

fn encode_state(encoder: &mut DescriptorEncoder, m: &RaftMetrics<NodeId, NodeInfo>) -> FmtResult {
    let help = "1 for this node's role, 0 for the others";
    let mut family =
        encoder.encode_descriptor("tenure_cluster_role", help, None, MetricType::Gauge)?;
    let now = role_of(m.state);
    for role in [
        Role::Learner,
        Role::Follower,
        Role::Candidate,
        Role::Leader,
        Role::Shutdown,
    ] {
        let value = ConstGauge::new(i64::from(role == now));
        value.encode(family.encode_family(&[("role", role.name())])?)?;
    }
    let help = "This node's id";
    gauge(encoder, "tenure_cluster_node_id", help, m.id as f64)?;
    let help = "This node's current Raft term";
    gauge(encoder, "tenure_cluster_term", help, m.current_term as f64)?;
    let leader = m.current_leader.unwrap_or(0);
    let help = "The leader this node knows of, 0 for none";
    gauge(encoder, "tenure_cluster_leader_id", help, leader as f64)?;
    let help = "Members of the membership this node knows, by kind";
    let mut family =
        encoder.encode_descriptor("tenure_cluster_members", help, None, MetricType::Gauge)?;
    let membership = m.membership_config.membership();
    let voters = membership.voter_ids().count();
    let all = membership.nodes().count();
    for (kind, n) in [("voter", voters), ("learner", all - voters)] {
        let value = ConstGauge::new(n as i64);
        value.encode(family.encode_family(&[("kind", kind)])?)?;
    }
    Ok(())
}

fn encode_log(encoder: &mut DescriptorEncoder, m: &RaftMetrics<NodeId, NodeInfo>) -> FmtResult {
    let last_log = m.last_log_index.unwrap_or(0);
    let applied = m.last_applied.map_or(0, |l| l.index);
    let help = "The last index in this node's Raft log (0: empty)";
    gauge(
        encoder,
        "tenure_cluster_last_log_index",
        help,
        last_log as f64,
    )?;
    let help = "The last Raft index this node applied (0: none)";
    gauge(
        encoder,
        "tenure_cluster_last_applied_index",
        help,
        applied as f64,
    )?;
    let help = "Entries in this node's log not yet applied (last log index - last applied)";
    let lag = last_log.saturating_sub(applied) as f64;
    gauge(encoder, "tenure_cluster_apply_lag_entries", help, lag)?;
    let help = "The last Raft index this node's snapshot covers (0: no snapshot)";
    let snapshot = m.snapshot.map_or(0, |l| l.index) as f64;
    gauge(encoder, "tenure_cluster_snapshot_index", help, snapshot)?;
    let help = "The last Raft index purged from this node's log (0: none)";
    let purged = m.purged.map_or(0, |l| l.index) as f64;
    gauge(encoder, "tenure_cluster_purged_index", help, purged)
}

/// On the leader: entries each other member lacks of its log; nothing on other nodes.
/// One series per member: bounded by the membership.
fn encode_replication(
    encoder: &mut DescriptorEncoder,
    m: &RaftMetrics<NodeId, NodeInfo>,
) -> FmtResult {
    let Some(replication) = &m.replication else {
        return Ok(());
    };
    let last_log = m.last_log_index.unwrap_or(0);
    let help = "On the leader: entries of its log each other member has not acknowledged";
    let mut family = encoder.encode_descriptor(
        "tenure_cluster_replication_lag_entries",
        help,
        None,
        MetricType::Gauge,
    )?;
    for (id, matched) in replication.iter().filter(|(id, _)| **id != m.id) {
        let lag = last_log.saturating_sub(matched.map_or(0, |l| l.index));
        let member = id.to_string();
        let value = ConstGauge::new(i64::try_from(lag).unwrap_or(i64::MAX));
        value.encode(family.encode_family(&[("member", member.as_str())])?)?;
    }
    Ok(())
}

/// One series per node with its digests as labels: Prometheus compares the nodes (the
/// shipped alert), so no node needs to ask another. The labels change only on a reload that
/// changes the files, and a node has one series at a time.
fn encode_digests(encoder: &mut DescriptorEncoder, security: &Security) -> FmtResult {
    let help = "Digests of this node's identities and client CA trust set in force (CLUSTER \
                STATUS's; - for none): every node of a cluster should show the same";
    // A gauge of 1 with the labels (as `node_uname_info`): the classic text format, which
    // promtool reads, has no info type.
    let mut family = encoder.encode_descriptor(
        "tenure_cluster_config_digest_info",
        help,
        None,
        MetricType::Gauge,
    )?;
    let identities = security.identities_digest().to_hex();
    let trust = security.trust_digest().to_hex();
    let labels = [
        ("identities", identities.as_str()),
        ("trust", trust.as_str()),
    ];
    ConstGauge::new(1).encode(family.encode_family(&labels)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::hash_secret;

    fn entry(name: &str, hash: &str, extra: &str) -> String {
        format!("[[identity]]\nname = \"{name}\"\nsecret-hash = \"{hash}\"\n{extra}\n")
    }

    fn digest_of(path: &std::path::Path) -> Digest {
        let identities = Arc::new(Identities::load(path).unwrap());
        Security::new(Some(identities), None).identities_digest()
    }

    /// The digest is of what the file means: order, comments and spacing do not count, any
    /// parsed field does, and a reload that takes effect changes it.
    #[test]
    fn identities_digest_follows_the_parsed_content_and_reloads() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("identities.toml");
        let (a, b) = (hash_secret(b"a").unwrap(), hash_secret(b"b").unwrap());
        let first = entry("a", &a, "stats = true");
        let second = entry("b", &b, "prefixes = [\"jobs/\"]");
        std::fs::write(&path, format!("{first}\n{second}")).unwrap();
        let base = digest_of(&path);
        assert!(!base.is_none());
        assert_eq!(base.to_hex().len(), 16);
        std::fs::write(&path, format!("# the same, reordered\n{second}\n\n{first}")).unwrap();
        assert_eq!(digest_of(&path), base, "order and comments do not count");
        let changed = entry("b", &b, "prefixes = [\"jobs/\"]\nheld-max = 4");
        std::fs::write(&path, format!("{first}\n{changed}")).unwrap();
        assert_ne!(digest_of(&path), base, "a quota counts");
        let rehashed = entry("a", &hash_secret(b"a").unwrap(), "stats = true");
        std::fs::write(&path, format!("{rehashed}\n{second}")).unwrap();
        assert_ne!(digest_of(&path), base, "a secret hash counts");

        std::fs::write(&path, format!("{first}\n{second}")).unwrap();
        let identities = Arc::new(Identities::load(&path).unwrap());
        let security = Security::new(Some(Arc::clone(&identities)), None);
        assert_eq!(security.identities_digest(), base);
        std::fs::write(&path, first.clone()).unwrap();
        assert_eq!(
            security.identities_digest(),
            base,
            "the file alone changes nothing"
        );
        identities.reload().unwrap();
        assert_ne!(security.identities_digest(), base, "the reload does");
        std::fs::write(&path, "not toml [").unwrap();
        let reloaded = security.identities_digest();
        assert!(identities.reload().is_err());
        assert_eq!(
            security.identities_digest(),
            reloaded,
            "a failed reload changes nothing"
        );
    }

    #[test]
    fn nothing_configured_is_the_zero_digest() {
        let security = Security::default();
        assert!(security.identities_digest().is_none());
        assert!(security.trust_digest().is_none());
        assert_eq!(security.identities_digest().to_hex(), "-");
    }
}
