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

use std::collections::VecDeque;

use hdrhistogram::Histogram;

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
}

#[derive(Clone, Copy, Default)]
struct Client {
    key: u64,
    lease: u128,
    attempt_start_ns: u64,
    grants: u64,
    wait_sum_ns: u64,
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
        ctx.submit(client % self.s.connections, op);
    }

    fn begin(&mut self, ctx: &mut Ctx<'_>, client: usize) {
        let hot = self.rng.below(self.s.keys);
        let c = &mut self.clients[client];
        c.key = self.key_base + hot;
        c.attempt_start_ns = ctx.now_ns;
        self.acquire(ctx, client, ctx.now_ns);
    }

    fn granted(&mut self, now_ns: u64, client: usize, lease: u128) {
        self.held += 1;
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
        vec![
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
        ]
    }
}

fn fold(xs: &[f64], f: fn(f64, f64) -> f64) -> f64 {
    xs.iter().copied().reduce(f).unwrap_or(0.0)
}
