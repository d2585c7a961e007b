//! Prometheus instruments: what the request path bumps, for the scrape (`crate::scrape`) to turn
//! (with the counters STATS already keeps) into the text `/metrics` serves.
//!
//! The hot path only does relaxed atomic adds on fixed arrays: requests are counted in an
//! `[op][outcome]` table and timed in one fixed-bucket [`Histogram`] per op; the replies a
//! connection flushes together are tallied locally and added once per (op, outcome, bucket)
//! ([`ReplyTally`]), so a request costs a share of two clock reads, a short bucket scan and
//! a share of three atomic adds, and allocates nothing.
//! Everything that is a level rather than an event (held locks, waiters, tokens, WAL state)
//! is read from the shared state when scraped, so it costs nothing between scrapes.
//!
//! # Definitions
//! - `tenure_renewals_lost_total{reason="expired"}`: RENEWs answered LOST for a lease id this
//!   process granted and then expired (the last [`EXPIRED_REMEMBERED_MAX`] expired lease ids
//!   are remembered; a lease past its deadline that the ticker has not reaped yet is ended by
//!   the RENEW itself, so it counts too). Its holder was still renewing after the server had ended its lease: the
//!   holder may have gone on using the resource, so this is the number that should page.
//!   `reason="unknown"` is every other LOST (released, never granted, or forgotten).
//! - `tenure_request_duration_seconds{op}`: from the moment the server took up the read that
//!   brought the request to the moment its reply was queued for writing, so it includes the
//!   wait behind earlier requests of the same read, the wait for the WAL, and for a blocking
//!   ACQUIRE its time in line. A token reservation retry restarts the clock. (One clock read
//!   per read and one per batch of replies, not two per request: at 16 requests in flight
//!   per connection those reads were 4 % of the server's time.)

use std::collections::{HashSet, VecDeque};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, NoLabelSet};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use tenure_protocol::{LeaseId, Request, Response};

use super::stats::OP_KINDS;

/// Request outcomes, as the `outcome` label spells them.
pub const OUTCOMES: [&str; 6] = ["ok", "granted", "locked", "lost", "not_owner", "error"];
/// Expired lease ids remembered to tell an expired lease's RENEW from any other LOST.
pub const EXPIRED_REMEMBERED_MAX: usize = 65_536;
/// Upper bounds of the request latency buckets, in nanoseconds (50 µs to 10 s).
const REQUEST_BOUNDS_NS: [u64; 17] = [
    50_000,
    100_000,
    250_000,
    500_000,
    1_000_000,
    2_500_000,
    5_000_000,
    10_000_000,
    25_000_000,
    50_000_000,
    100_000_000,
    250_000_000,
    500_000_000,
    1_000_000_000,
    2_500_000_000,
    5_000_000_000,
    10_000_000_000,
];
/// Upper bounds of the fsync and snapshot buckets, in nanoseconds (50 µs to 10 s).
const SYNC_BOUNDS_NS: [u64; 12] = [
    50_000,
    100_000,
    250_000,
    500_000,
    1_000_000,
    2_500_000,
    10_000_000,
    50_000_000,
    250_000_000,
    1_000_000_000,
    2_500_000_000,
    10_000_000_000,
];
/// Upper bounds of the records-per-fsync buckets (the group-commit factor).
const BATCH_BOUNDS: [u64; 12] = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096];
pub(crate) const NS_PER_SECOND: f64 = 1e9;

/// A histogram with fixed integer bucket bounds, filled with relaxed atomics (lock-free;
/// prometheus-client's own histogram takes a lock per observation).
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [u64],
    /// One count per bound, then the overflow (+Inf) bucket; not cumulative.
    counts: Box<[AtomicU64]>,
    sum: AtomicU64,
    /// Multiplies a value into the exported unit (1e-9 for nanoseconds to seconds).
    scale: f64,
}

impl Histogram {
    /// A latency histogram kept in nanoseconds and exported in seconds, with the request
    /// buckets (50 µs to 10 s).
    pub fn latency_seconds() -> Histogram {
        Histogram::new(&REQUEST_BOUNDS_NS, 1.0 / NS_PER_SECOND)
    }

    fn new(bounds: &'static [u64], scale: f64) -> Histogram {
        assert!(bounds.windows(2).all(|w| w[0] < w[1]), "bounds ascend");
        let counts = (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect();
        Histogram {
            bounds,
            counts,
            sum: AtomicU64::new(0),
            scale,
        }
    }

    /// Counts one observation of `value` (in the histogram's integer unit).
    pub fn observe(&self, value: u64) {
        self.add(self.bucket_of(value), 1, value);
    }

    /// The bucket `value` falls in.
    fn bucket_of(&self, value: u64) -> usize {
        self.bounds.partition_point(|&bound| bound < value)
    }

    /// Counts `count` observations in `bucket` that sum to `sum`.
    fn add(&self, bucket: usize, count: u64, sum: u64) {
        self.counts[bucket].fetch_add(count, Ordering::Relaxed);
        self.sum.fetch_add(sum, Ordering::Relaxed);
    }

    /// Counts one duration, for histograms kept in nanoseconds.
    pub fn observe_duration(&self, elapsed: Duration) {
        self.observe(u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX));
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.counts.iter().map(|c| c.load(Ordering::Relaxed)).sum()
    }

    /// Writes the histogram's buckets, sum and count.
    pub fn encode(&self, mut encoder: prometheus_client::encoding::MetricEncoder) -> FmtResult {
        let mut buckets = Vec::with_capacity(self.counts.len());
        for (i, count) in self.counts.iter().enumerate() {
            let bound = self
                .bounds
                .get(i)
                .map_or(f64::MAX, |&b| b as f64 * self.scale);
            buckets.push((bound, count.load(Ordering::Relaxed)));
        }
        let count = buckets.iter().map(|(_, n)| n).sum();
        let sum = self.sum.load(Ordering::Relaxed) as f64 * self.scale;
        encoder.encode_histogram::<NoLabelSet>(sum, count, &buckets, None)
    }
}

/// The WAL's instruments, filled by its syncer's fsync thread.
#[derive(Debug)]
pub struct WalMetrics {
    /// Time each `fdatasync` of a batch took, in nanoseconds.
    pub fsync: Histogram,
    /// Records each fsync covered: every batch written while the fsync before it ran.
    pub records_per_batch: Histogram,
    /// Time each snapshot of the live locks took, in nanoseconds.
    pub snapshot: Histogram,
    /// Snapshots abandoned.
    pub snapshot_failures: AtomicU64,
}

impl Default for WalMetrics {
    fn default() -> Self {
        WalMetrics {
            fsync: Histogram::new(&SYNC_BOUNDS_NS, 1.0 / NS_PER_SECOND),
            records_per_batch: Histogram::new(&BATCH_BOUNDS, 1.0),
            snapshot: Histogram::new(&SYNC_BOUNDS_NS, 1.0 / NS_PER_SECOND),
            snapshot_failures: AtomicU64::new(0),
        }
    }
}

impl WalMetrics {
    /// A snapshot finished (`ok`) or was abandoned after `elapsed`.
    pub fn snapshot_done(&self, elapsed: Duration, ok: bool) {
        self.snapshot.observe_duration(elapsed);
        if !ok {
            self.snapshot_failures.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A batch of `records` was written, and synced in `synced` unless sync is off.
    pub fn batch_written(&self, records: u64, synced: Option<Duration>) {
        self.records_per_batch.observe(records);
        if let Some(elapsed) = synced {
            self.fsync.observe_duration(elapsed);
        }
    }
}

/// When a request was taken up, and which kind it is; carried to its reply.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    op: u8,
    started: Instant,
}

impl Timing {
    /// Starts timing `request`, taken up at `at`.
    pub fn start(request: &Request, at: Instant) -> Timing {
        Timing {
            op: op_of(request),
            started: at,
        }
    }
}

/// Distinct (op, outcome, latency bucket) triples a [`ReplyTally`] holds before it adds
/// them to the instruments; a batch of replies rarely has more (a mixed pipeline: three).
const TALLY_ENTRIES: usize = 8;

/// Replies counted locally while a batch of them is flushed, then added to the shared
/// instruments once per (op, outcome, bucket) rather than with three atomic adds per reply:
/// at 16 requests in flight per connection those adds were 2-3 % of the server's time, and
/// with a thread per core each one pulls a cache line shared by every thread.
#[derive(Default)]
pub struct ReplyTally {
    entries: [TallyEntry; TALLY_ENTRIES],
    len: usize,
}

#[derive(Default, Clone, Copy)]
struct TallyEntry {
    /// (op, outcome, bucket): indexes into `Metrics::requests` and `durations`.
    key: (u8, u8, u8),
    count: u64,
    sum_ns: u64,
}

/// The client surface a connection speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Surface {
    /// The binary protocol.
    Binary = 0,
    /// The text console.
    Console = 1,
}

pub(crate) const SURFACES: [&str; 2] = ["binary", "console"];

/// The instruments bumped while serving; one per server, inside [`Stats`](super::stats::Stats).
#[derive(Debug)]
pub struct Metrics {
    /// Requests by `[op][outcome]`.
    pub(crate) requests: [[AtomicU64; OUTCOMES.len()]; OP_KINDS.len()],
    pub(crate) durations: [Histogram; OP_KINDS.len()],
    pub(crate) renewals_lost_expired: AtomicU64,
    pub(crate) renewals_lost_other: AtomicU64,
    /// Expired lease ids, oldest first, at most [`EXPIRED_REMEMBERED_MAX`]; touched only on
    /// expiry and on a LOST renewal, never on the common path.
    pub(crate) expired: Mutex<(VecDeque<LeaseId>, HashSet<LeaseId>)>,
    pub(crate) open_by_surface: [AtomicI64; SURFACES.len()],
    /// Connections closed because their TLS handshake failed, timed out, or was plain text.
    pub(crate) tls_refused: AtomicU64,
    /// Unauthenticated connections closed to make room for newer ones (see `admission`).
    pub(crate) evicted: AtomicU64,
    /// Nanoseconds recovery took (set once).
    pub(crate) recovery_ns: AtomicU64,
    /// `Clock::now_ms` until which grants are refused after a token-only restart.
    pub(crate) recovering_until_ms: AtomicU64,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            requests: Default::default(),
            durations: std::array::from_fn(|_| {
                Histogram::new(&REQUEST_BOUNDS_NS, 1.0 / NS_PER_SECOND)
            }),
            renewals_lost_expired: AtomicU64::new(0),
            renewals_lost_other: AtomicU64::new(0),
            expired: Mutex::default(),
            open_by_surface: Default::default(),
            tls_refused: AtomicU64::new(0),
            evicted: AtomicU64::new(0),
            recovery_ns: AtomicU64::new(0),
            recovering_until_ms: AtomicU64::new(0),
        }
    }
}

fn op_of(request: &Request) -> u8 {
    u8::try_from(super::stats::op_index(request)).expect("fewer than 256 kinds of request")
}

fn outcome_of(response: &Response) -> usize {
    match response {
        Response::Granted { .. } => 1,
        Response::Locked { .. } => 2,
        Response::Lost => 3,
        Response::NotOwner => 4,
        Response::Error { .. } => 5,
        _ => 0,
    }
}

impl Metrics {
    /// Counts a reply being queued for the request `timing` started on.
    pub fn replied(&self, timing: Timing, response: &Response, at: Instant) {
        let mut tally = ReplyTally::default();
        self.tally(&mut tally, timing, response, at);
        self.add_tally(&mut tally);
    }

    /// Counts a reply queued at `at` in `tally`, to be added to the instruments with the
    /// other replies of its batch by [`Metrics::add_tally`].
    pub fn tally(&self, tally: &mut ReplyTally, timing: Timing, response: &Response, at: Instant) {
        let elapsed = at.saturating_duration_since(timing.started);
        let ns = u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX);
        let op = timing.op;
        let bucket = self.durations[usize::from(op)].bucket_of(ns);
        let key = (op, outcome_of(response) as u8, bucket as u8);
        let filled = &mut tally.entries[..tally.len];
        if let Some(entry) = filled.iter_mut().find(|e| e.key == key) {
            entry.count += 1;
            entry.sum_ns = entry.sum_ns.saturating_add(ns);
            return;
        }
        if tally.len == TALLY_ENTRIES {
            self.add_tally(tally);
        }
        tally.entries[tally.len] = TallyEntry {
            key,
            count: 1,
            sum_ns: ns,
        };
        tally.len += 1;
    }

    /// Adds the replies counted in `tally` to the instruments and empties it.
    pub fn add_tally(&self, tally: &mut ReplyTally) {
        for entry in &tally.entries[..tally.len] {
            let (op, outcome, bucket) = entry.key;
            let op = usize::from(op);
            self.requests[op][usize::from(outcome)].fetch_add(entry.count, Ordering::Relaxed);
            self.durations[op].add(usize::from(bucket), entry.count, entry.sum_ns);
        }
        tally.len = 0;
    }

    /// Remembers that `lease_id` expired, forgetting the oldest beyond the limit.
    pub fn expired(&self, lease_id: LeaseId) {
        let mut guard = self.expired.lock().expect("metrics lock poisoned");
        let (order, set) = &mut *guard;
        if set.insert(lease_id) {
            order.push_back(lease_id);
        }
        if order.len() > EXPIRED_REMEMBERED_MAX {
            let oldest = order.pop_front().expect("over the limit, so not empty");
            set.remove(&oldest);
        }
    }

    /// Counts a RENEW answered LOST, by whether its lease expired (see the module docs).
    pub fn renew_lost(&self, lease_id: LeaseId) {
        let expired = self
            .expired
            .lock()
            .expect("metrics lock poisoned")
            .1
            .contains(&lease_id);
        let counter = if expired {
            &self.renewals_lost_expired
        } else {
            &self.renewals_lost_other
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// A connection chose its surface (`opened`) or closed (`!opened`).
    pub fn connection(&self, surface: Surface, opened: bool) {
        let delta = if opened { 1 } else { -1 };
        self.open_by_surface[surface as usize].fetch_add(delta, Ordering::Relaxed);
    }

    /// A connection to the TLS port closed without completing the TLS handshake.
    pub fn tls_refused(&self) {
        self.tls_refused.fetch_add(1, Ordering::Relaxed);
    }

    /// An unauthenticated connection was closed to make room for a newer one.
    pub fn evicted(&self) {
        self.evicted.fetch_add(1, Ordering::Relaxed);
    }

    /// Records how long recovery took and until when (`Clock::now_ms`) grants are refused.
    pub fn recovered(&self, elapsed: Duration, recovering_until_ms: u64) {
        let ns = u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX);
        self.recovery_ns.store(ns, Ordering::Relaxed);
        self.recovering_until_ms
            .store(recovering_until_ms, Ordering::Relaxed);
    }

    /// Milliseconds left of the token-only RECOVERING window at `now_ms` (0 once over).
    pub fn recovering_ms_left(&self, now_ms: u64) -> u64 {
        self.recovering_until_ms
            .load(Ordering::Relaxed)
            .saturating_sub(now_ms)
    }
}

/// What encoding a metric can fail with.
pub type FmtResult = Result<(), std::fmt::Error>;

/// Writes one counter without labels.
pub(crate) fn counter(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    value: u64,
) -> FmtResult {
    let metric = ConstCounter::new(value);
    metric.encode(encoder.encode_descriptor(name, help, None, metric.metric_type())?)
}

/// Writes one gauge without labels.
pub(crate) fn gauge(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    value: f64,
) -> FmtResult {
    let metric = ConstGauge::new(value);
    metric.encode(encoder.encode_descriptor(name, help, None, metric.metric_type())?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_hold_their_upper_bound() {
        let h = Histogram::new(&BATCH_BOUNDS, 1.0);
        for value in [0, 1, 2, 3, 4096, 4097] {
            h.observe(value);
        }
        let counts: Vec<u64> = h.counts.iter().map(|c| c.load(Ordering::Relaxed)).collect();
        assert_eq!(counts[0], 2, "0 and 1 are <= 1");
        assert_eq!(counts[1], 1, "2");
        assert_eq!(counts[2], 1, "3 is <= 4");
        assert_eq!(counts[BATCH_BOUNDS.len() - 1], 1, "4096");
        assert_eq!(counts[BATCH_BOUNDS.len()], 1, "4097 overflows");
        assert_eq!(h.count(), 6);
    }

    /// A batch tallied together counts exactly what counting each reply alone would, also
    /// when it holds more distinct (op, outcome, bucket) triples than the tally has room for.
    #[test]
    fn a_tallied_batch_counts_what_single_replies_would() {
        let (one_by_one, tallied) = (Metrics::default(), Metrics::default());
        let at = Instant::now() + Duration::from_secs(20);
        let requests = [
            Request::Ping,
            Request::Stats,
            Request::Inspect {
                key: b"k".to_vec().into(),
                kinds: Default::default(),
            },
        ];
        let responses = [Response::Pong, Response::Free, Response::Stale];
        let mut tally = ReplyTally::default();
        let mut replies = 0;
        for (i, request) in requests.iter().cycle().take(300).enumerate() {
            // Starts spread over 20 s: every latency bucket gets some.
            let started = at - Duration::from_micros((i as u64 * 7919) % 20_000_000);
            let timing = Timing::start(request, started);
            let response = &responses[i % responses.len()];
            one_by_one.replied(timing, response, at);
            tallied.tally(&mut tally, timing, response, at);
            replies += 1;
        }
        tallied.add_tally(&mut tally);
        assert_eq!(tally.len, 0, "adding empties the tally");
        let total = |m: &Metrics| m.durations.iter().map(Histogram::count).sum::<u64>();
        assert_eq!(total(&tallied), replies);
        for op in 0..OP_KINDS.len() {
            let (a, b) = (&one_by_one.durations[op], &tallied.durations[op]);
            let counts = |h: &Histogram| -> Vec<u64> {
                h.counts.iter().map(|c| c.load(Ordering::Relaxed)).collect()
            };
            assert_eq!(counts(a), counts(b), "op {op}'s buckets");
            assert_eq!(a.sum.load(Ordering::Relaxed), b.sum.load(Ordering::Relaxed));
            for outcome in 0..OUTCOMES.len() {
                let n = |m: &Metrics| m.requests[op][outcome].load(Ordering::Relaxed);
                assert_eq!(n(&one_by_one), n(&tallied), "op {op}, outcome {outcome}");
            }
        }
    }

    #[test]
    fn expired_lease_ids_are_remembered_up_to_the_limit() {
        let m = Metrics::default();
        let id = |i: u128| LeaseId::from_u128(i);
        for i in 0..=EXPIRED_REMEMBERED_MAX as u128 {
            m.expired(id(i));
        }
        m.renew_lost(id(0)); // forgotten: the oldest went when the limit was passed
        m.renew_lost(id(1));
        assert_eq!(m.renewals_lost_other.load(Ordering::Relaxed), 1);
        assert_eq!(m.renewals_lost_expired.load(Ordering::Relaxed), 1);
    }
}
