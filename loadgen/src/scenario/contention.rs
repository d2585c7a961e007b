//! Contention: many clients take turns on a few hot keys.
//!
//! Each client loops: acquire a random hot key (waiting in line up to `--wait` on tenure; on
//! Redis, which has no line, retrying every `--retry` after a refusal), hold it for `--hold`,
//! release it, start again. Two things are measured besides per-op latency:
//!
//! - hand-off latency: from the moment a holder's release is sent to the moment the next
//!   holder's grant arrives, counted only when that next holder was already waiting;
//! - fairness: each client's wait (first attempt to grant), with the spread of per-client mean
//!   waits and Jain's index over per-client grant counts (1 is perfectly even).
//!
//! The same loop drives the `semaphore` scenario (every ACQUIRE asks for `--permits`) and
//! `read-mostly` (each ACQUIRE a read lease, or a write at `--write-ratio`; reader and writer
//! waits apart). The clients also count, per key, the permits or leases they hold, from a
//! grant's arrival to its release's send: inside the server's hold, so while `--hold` is
//! shorter than `--ttl` the count never passes what the server allows (the limit; a writer
//! alone). The most seen at once and the breaks (which must be 0) are reported.

use std::collections::VecDeque;

use hdrhistogram::Histogram;
use tenure_protocol::LeaseKind;

use crate::op::{Op, OpKind, Outcome};
use crate::report::Value;
use crate::scenario::{key_base, op, Ctx, Rng, Scenario};
use crate::stats::{histogram, jain_index};

/// Settings of the contention workload.
pub struct Settings {
    /// Competing clients.
    pub clients: usize,
    /// Hot keys.
    pub keys: u64,
    /// Lease length, milliseconds.
    pub ttl_ms: u32,
    /// Time to wait in line, milliseconds; 0 means the target cannot wait and clients poll.
    pub wait_ms: u32,
    /// Time a client holds a lock, nanoseconds.
    pub hold_ns: u64,
    /// Poll period after a refusal when the target cannot wait, nanoseconds.
    pub retry_ns: u64,
    /// Connections; client `i` uses connection `i % connections`.
    pub connections: usize,
    /// What the run's ACQUIREs ask for (`--permits`, `--shared`, or the key alone), for the
    /// clients' count of holders.
    pub kind: LeaseKind,
    /// read-mostly: the share of acquires that ask for a write lease, the others a read lease
    /// (each ACQUIRE names its own kind). `None`: every ACQUIRE asks for `kind`.
    pub write_ratio: Option<f64>,
}

/// Scale of the write-ratio draw: a ratio is kept to a millionth.
const RATIO_SCALE: u64 = 1_000_000;

#[derive(Clone, Copy, Default)]
struct Client {
    key: u64,
    lease: u128,
    attempt_start_ns: u64,
    grants: u64,
    wait_sum_ns: u64,
    /// read-mostly: this attempt asks for a write lease.
    writing: bool,
}

/// The contention workload.
pub struct Contention {
    s: Settings,
    rng: Rng,
    key_base: u64,
    clients: Vec<Client>,
    /// When each hot key's last release was sent, nanoseconds.
    release_sent_ns: Vec<u64>,
    /// Clients holding a lock, by release time (equal holds keep it sorted).
    holding: VecDeque<(u64, usize)>,
    /// Clients refused, by retry time (equal delays keep it sorted).
    retrying: VecDeque<(u64, usize)>,
    window_ns: Option<(u64, u64)>,
    handoff_ns: Histogram<u64>,
    wait_ns: Histogram<u64>,
    held: u64,
    wait_timeouts: u64,
    /// Per hot key: permits (or leases) the clients hold now, and of them write leases.
    in_use: Vec<u32>,
    writers: Vec<u32>,
    /// The most permits or leases held at once on one key, and the grants that broke the
    /// key's rule (over the limit, a writer not alone).
    in_use_max: u32,
    exclusion_breaks: u64,
    /// read-mostly: waits and grants of readers and of writers, apart.
    read_wait_ns: Histogram<u64>,
    write_wait_ns: Histogram<u64>,
}

impl Contention {
    /// A contention workload with settings `s`.
    pub fn new(s: Settings, mut rng: Rng) -> Contention {
        Contention {
            key_base: key_base(&mut rng, s.keys),
            rng,
            clients: vec![Client::default(); s.clients],
            release_sent_ns: vec![0; s.keys as usize],
            holding: VecDeque::new(),
            retrying: VecDeque::new(),
            window_ns: None,
            handoff_ns: histogram(),
            wait_ns: histogram(),
            held: 0,
            wait_timeouts: 0,
            in_use: vec![0; s.keys as usize],
            writers: vec![0; s.keys as usize],
            in_use_max: 0,
            exclusion_breaks: 0,
            read_wait_ns: histogram(),
            write_wait_ns: histogram(),
            s,
        }
    }

    fn in_window(&self, ns: u64) -> bool {
        self.window_ns
            .is_some_and(|(start, end)| (start..end).contains(&ns))
    }

    fn acquire(&mut self, ctx: &mut Ctx<'_>, client: usize, intended_ns: u64) {
        let c = &self.clients[client];
        let mut op = op(
            OpKind::Acquire,
            c.key,
            self.rng.lease(),
            self.s.ttl_ms,
            0,
            intended_ns,
        );
        op.tag = client as u64;
        op.wait_ms = self.s.wait_ms;
        if self.s.write_ratio.is_some() {
            op.lease_kind = Some(self.lease_of(client));
        }
        ctx.submit(client % self.s.connections, op);
    }

    /// The lease client `client`'s current attempt asks for.
    fn lease_of(&self, client: usize) -> LeaseKind {
        match (self.s.write_ratio, self.clients[client].writing) {
            (None, _) => self.s.kind,
            (Some(_), true) => LeaseKind::Exclusive,
            (Some(_), false) => LeaseKind::Shared,
        }
    }

    /// Counts client `client`'s lease in (`enter`) or out of its key's holders; on entry,
    /// counts a break of the key's rule.
    fn count_holder(&mut self, client: usize, enter: bool) {
        let hot = (self.clients[client].key - self.key_base) as usize;
        let (count, alone, limit) = match self.lease_of(client) {
            LeaseKind::Exclusive => (1, true, 1),
            LeaseKind::Shared => (1, false, u32::MAX),
            LeaseKind::Permits { count, limit } => (count, false, limit),
        };
        if !enter {
            self.in_use[hot] -= count;
            self.writers[hot] -= u32::from(alone);
            return;
        }
        self.in_use[hot] += count;
        self.writers[hot] += u32::from(alone);
        self.in_use_max = self.in_use_max.max(self.in_use[hot]);
        let beside_writer = self.writers[hot] > u32::from(alone);
        if self.in_use[hot] > limit || beside_writer {
            self.exclusion_breaks += 1;
        }
    }

    fn begin(&mut self, ctx: &mut Ctx<'_>, client: usize) {
        let hot = self.rng.below(self.s.keys);
        let writing = self
            .s
            .write_ratio
            .is_some_and(|r| self.rng.below(RATIO_SCALE) < (r * RATIO_SCALE as f64) as u64);
        let c = &mut self.clients[client];
        c.key = self.key_base + hot;
        c.attempt_start_ns = ctx.now_ns;
        c.writing = writing;
        self.acquire(ctx, client, ctx.now_ns);
    }

    fn granted(&mut self, now_ns: u64, client: usize, lease: u128) {
        self.held += 1;
        self.count_holder(client, true);
        let c = self.clients[client];
        let hot = (c.key - self.key_base) as usize;
        let release_ns = self.release_sent_ns[hot];
        if release_ns > c.attempt_start_ns && self.in_window(release_ns) {
            self.handoff_ns
                .saturating_record((now_ns - release_ns).max(1));
        }
        if self.in_window(c.attempt_start_ns) {
            let wait_ns = now_ns - c.attempt_start_ns;
            self.wait_ns.saturating_record(wait_ns.max(1));
            if self.s.write_ratio.is_some() {
                let by_kind = match c.writing {
                    true => &mut self.write_wait_ns,
                    false => &mut self.read_wait_ns,
                };
                by_kind.saturating_record(wait_ns.max(1));
            }
            let c = &mut self.clients[client];
            c.grants += 1;
            c.wait_sum_ns += wait_ns;
        }
        self.clients[client].lease = lease;
        self.holding.push_back((now_ns + self.s.hold_ns, client));
    }
}

impl Scenario for Contention {
    fn start(&mut self, ctx: &mut Ctx<'_>) {
        for client in 0..self.clients.len() {
            self.begin(ctx, client);
        }
    }

    fn tick(&mut self, ctx: &mut Ctx<'_>) {
        while let Some(&(due_ns, client)) = self.holding.front() {
            if due_ns > ctx.now_ns {
                break;
            }
            self.holding.pop_front();
            self.count_holder(client, false);
            let Client { key, lease, .. } = self.clients[client];
            self.release_sent_ns[(key - self.key_base) as usize] = ctx.now_ns;
            let op = op(OpKind::Release, key, lease, 0, client as u64, due_ns);
            ctx.submit(client % self.s.connections, op);
        }
        while let Some(&(due_ns, client)) = self.retrying.front() {
            if due_ns > ctx.now_ns {
                break;
            }
            self.retrying.pop_front();
            if !ctx.stopping {
                self.acquire(ctx, client, due_ns);
            }
        }
    }

    fn on_reply(&mut self, ctx: &mut Ctx<'_>, op: &Op, outcome: &Outcome) {
        let client = op.tag as usize;
        match (op.kind, outcome) {
            (OpKind::Acquire, Outcome::Granted { lease, .. }) => {
                self.granted(ctx.now_ns, client, *lease);
            }
            (OpKind::Acquire, Outcome::Locked) if self.s.wait_ms > 0 => {
                // Waited the whole --wait in line: go back in line, the wait still counting.
                self.wait_timeouts += 1;
                if !ctx.stopping {
                    self.acquire(ctx, client, ctx.now_ns);
                }
            }
            (OpKind::Acquire, _) => {
                self.retrying
                    .push_back((ctx.now_ns + self.s.retry_ns, client));
            }
            (OpKind::Release, _) => {
                self.held -= 1;
                if !ctx.stopping {
                    self.begin(ctx, client);
                }
            }
            _ => {}
        }
    }

    fn set_window(&mut self, start_ns: u64, end_ns: u64) {
        self.window_ns = Some((start_ns, end_ns));
    }

    fn held(&self) -> u64 {
        self.held
    }

    fn summary(&self, window_s: f64) -> Vec<(&'static str, Value)> {
        let grants: Vec<u64> = self.clients.iter().map(|c| c.grants).collect();
        let means_us: Vec<f64> = self
            .clients
            .iter()
            .filter(|c| c.grants > 0)
            .map(|c| c.wait_sum_ns as f64 / c.grants as f64 / 1e3)
            .collect();
        let total: u64 = grants.iter().sum();
        let us = |h: &Histogram<u64>, q: f64| Value::F64(h.value_at_quantile(q) as f64 / 1e3);
        let mut out = vec![
            ("clients", Value::U64(self.clients.len() as u64)),
            ("hot_keys", Value::U64(self.s.keys)),
            ("grants", Value::U64(total)),
            ("grants_per_s", Value::F64(total as f64 / window_s)),
            ("handoffs", Value::U64(self.handoff_ns.len())),
            ("handoff_p50_us", us(&self.handoff_ns, 0.5)),
            ("handoff_p99_us", us(&self.handoff_ns, 0.99)),
            ("handoff_max_us", us(&self.handoff_ns, 1.0)),
            ("wait_p50_us", us(&self.wait_ns, 0.5)),
            ("wait_p99_us", us(&self.wait_ns, 0.99)),
            ("wait_max_us", us(&self.wait_ns, 1.0)),
            (
                "client_mean_wait_min_us",
                Value::F64(fold(&means_us, f64::min)),
            ),
            (
                "client_mean_wait_max_us",
                Value::F64(fold(&means_us, f64::max)),
            ),
            (
                "client_grants_min",
                Value::U64(grants.iter().copied().min().unwrap_or(0)),
            ),
            (
                "client_grants_max",
                Value::U64(grants.iter().copied().max().unwrap_or(0)),
            ),
            ("jain_fairness", Value::F64(jain_index(&grants))),
            ("wait_timeouts", Value::U64(self.wait_timeouts)),
            ("held_at_once_max", Value::U64(u64::from(self.in_use_max))),
            ("exclusion_breaks", Value::U64(self.exclusion_breaks)),
        ];
        out.extend(self.kinds_summary(window_s));
        out
    }
}

impl Contention {
    /// The semaphore's limit, or read-mostly's reads and writes apart.
    fn kinds_summary(&self, window_s: f64) -> Vec<(&'static str, Value)> {
        let us = |h: &Histogram<u64>, q: f64| Value::F64(h.value_at_quantile(q) as f64 / 1e3);
        let mut out = Vec::new();
        if let LeaseKind::Permits { count, limit } = self.s.kind {
            out.push(("permits_per_grant", Value::U64(u64::from(count))));
            out.push(("permit_limit", Value::U64(u64::from(limit))));
        }
        if let Some(ratio) = self.s.write_ratio {
            let (reads, writes) = (self.read_wait_ns.len(), self.write_wait_ns.len());
            out.extend([
                ("write_ratio", Value::F64(ratio)),
                ("read_grants", Value::U64(reads)),
                ("write_grants", Value::U64(writes)),
                ("read_grants_per_s", Value::F64(reads as f64 / window_s)),
                ("write_grants_per_s", Value::F64(writes as f64 / window_s)),
                ("read_wait_p50_us", us(&self.read_wait_ns, 0.5)),
                ("read_wait_p99_us", us(&self.read_wait_ns, 0.99)),
                ("read_wait_max_us", us(&self.read_wait_ns, 1.0)),
                ("write_wait_p50_us", us(&self.write_wait_ns, 0.5)),
                ("write_wait_p90_us", us(&self.write_wait_ns, 0.9)),
                ("write_wait_p99_us", us(&self.write_wait_ns, 0.99)),
                ("write_wait_max_us", us(&self.write_wait_ns, 1.0)),
            ]);
        }
        out
    }
}

fn fold(xs: &[f64], f: fn(f64, f64) -> f64) -> f64 {
    xs.iter().copied().reduce(f).unwrap_or(0.0)
}
