//! Closed loop: `connections x pipeline` lanes, each sending its next op the moment the last one
//! is answered. The figure is the target's peak throughput at that concurrency.
//!
//! - `acquire`: random keys of the key space, so grants and refusals (LOCKED) mix as the space
//!   fills; the two are counted apart and the grant rate is the headline.
//! - `mixed`: each lane runs acquire, renew, release on a fresh key; only cycles that complete
//!   are counted.
//! - `renew`: each lane takes one lock (untimed) and renews it over and over.
//! - `release`: `--keys` locks are taken first (untimed), then released as fast as possible; the
//!   run ends early when none is left.
//! - `ping`: round trips that touch no lock.

use crate::args::MaxOp;
use crate::op::{Op, OpKind, Outcome};
use crate::report::Value;
use crate::scenario::{key_base, op, Ctx, Rng, Scenario};

/// Settings of a closed-loop run.
pub struct Settings {
    /// Which op.
    pub op: MaxOp,
    /// Size of the key space (and the number of locks taken beforehand for `release`).
    pub keys: u64,
    /// Lease length asked for, milliseconds.
    pub ttl_ms: u32,
    /// Connections.
    pub connections: usize,
    /// Requests in flight per connection.
    pub pipeline: usize,
}

#[derive(Clone, Copy, Default)]
struct Lane {
    key: u64,
    lease: u128,
    cycle_start_ns: u64,
    /// `renew`: the lane holds its first lock.
    ready: bool,
}

/// The closed-loop workload.
pub struct Closed {
    s: Settings,
    rng: Rng,
    key_base: u64,
    lanes: Vec<Lane>,
    /// Next fresh key number (mixed, renew, release setup).
    next_key: u64,
    window_ns: Option<(u64, u64)>,
    ready_lanes: usize,
    /// Locks taken for `release`, waiting to be released.
    pool: Vec<(u64, u128)>,
    pool_requested: u64,
    releasing: bool,
    held: u64,
    cycles_done: u64,
    cycles_failed: u64,
    /// Grants in the current whole second of the window, and the best second so far.
    second_grants: u64,
    second_end_ns: u64,
    peak_grants: u64,
}

impl Closed {
    /// A closed-loop workload with settings `s`.
    pub fn new(s: Settings, mut rng: Rng) -> Closed {
        let lanes = s.connections * s.pipeline;
        Closed {
            key_base: key_base(&mut rng, s.keys),
            rng,
            lanes: vec![Lane::default(); lanes],
            next_key: 0,
            window_ns: None,
            ready_lanes: 0,
            pool: Vec::new(),
            pool_requested: 0,
            releasing: false,
            held: 0,
            cycles_done: 0,
            cycles_failed: 0,
            second_grants: 0,
            second_end_ns: u64::MAX,
            peak_grants: 0,
            s,
        }
    }

    fn conn(&self, lane: u64) -> usize {
        (lane % self.s.connections as u64) as usize
    }

    fn fresh_key(&mut self) -> u64 {
        let key = self.key_base + self.next_key % self.s.keys;
        self.next_key += 1;
        key
    }

    fn send(&mut self, ctx: &mut Ctx<'_>, kind: OpKind, lane: u64, key: u64, lease: u128) {
        let op = op(kind, key, lease, self.s.ttl_ms, lane, ctx.now_ns);
        ctx.submit(self.conn(lane), op);
    }

    /// The first op of a lane, or its next one once the previous is answered.
    fn next(&mut self, ctx: &mut Ctx<'_>, lane: u64) {
        match self.s.op {
            MaxOp::Acquire => {
                let key = self.key_base + self.rng.below(self.s.keys);
                let lease = self.rng.lease();
                self.send(ctx, OpKind::Acquire, lane, key, lease);
            }
            MaxOp::Ping => self.send(ctx, OpKind::Ping, lane, 0, 0),
            MaxOp::Mixed | MaxOp::Renew => {
                let key = self.fresh_key();
                let lease = self.rng.lease();
                self.lanes[lane as usize].key = key;
                self.lanes[lane as usize].cycle_start_ns = ctx.now_ns;
                self.send(ctx, OpKind::Acquire, lane, key, lease);
            }
            MaxOp::Release if !self.releasing => {
                if self.pool_requested < self.s.keys {
                    self.pool_requested += 1;
                    let key = self.fresh_key();
                    let lease = self.rng.lease();
                    self.send(ctx, OpKind::Acquire, lane, key, lease);
                }
            }
            MaxOp::Release => {
                if let Some((key, lease)) = self.pool.pop() {
                    self.send(ctx, OpKind::Release, lane, key, lease);
                }
            }
        }
    }

    fn on_mixed(&mut self, ctx: &mut Ctx<'_>, op: &Op, outcome: &Outcome) {
        let lane = self.lanes[op.tag as usize];
        match (op.kind, outcome) {
            (OpKind::Acquire, Outcome::Granted { lease, .. }) => {
                self.held += 1;
                self.lanes[op.tag as usize].lease = *lease;
                self.send(ctx, OpKind::Renew, op.tag, lane.key, *lease);
                return;
            }
            (OpKind::Renew, Outcome::Renewed) => {
                self.send(ctx, OpKind::Release, op.tag, lane.key, lane.lease);
                return;
            }
            (OpKind::Release, Outcome::Released) => {
                self.held -= 1;
                if self.in_window(lane.cycle_start_ns) {
                    self.cycles_done += 1;
                }
            }
            (OpKind::Acquire, _) => self.cycles_failed += 1,
            _ => {
                // A renew or release that failed leaves the lock to its TTL.
                self.held -= 1;
                self.cycles_failed += 1;
            }
        }
        if !ctx.stopping {
            self.next(ctx, op.tag);
        }
    }

    fn on_renew(&mut self, ctx: &mut Ctx<'_>, op: &Op, outcome: &Outcome) {
        let lane = op.tag as usize;
        match (op.kind, outcome) {
            (OpKind::Acquire, Outcome::Granted { lease, .. }) => {
                self.held += 1;
                self.lanes[lane].lease = *lease;
                if !self.lanes[lane].ready {
                    self.lanes[lane].ready = true;
                    self.ready_lanes += 1;
                }
            }
            (OpKind::Renew, Outcome::Renewed) => {}
            (OpKind::Renew, _) => {
                // The lease is gone: take a fresh lock and carry on.
                self.held -= 1;
                self.next(ctx, op.tag);
                return;
            }
            (OpKind::Acquire, _) => {
                self.next(ctx, op.tag);
                return;
            }
            _ => {}
        }
        if !ctx.stopping {
            let Lane { key, lease, .. } = self.lanes[lane];
            self.send(ctx, OpKind::Renew, op.tag, key, lease);
        }
    }

    fn in_window(&self, intended_ns: u64) -> bool {
        self.window_ns
            .is_some_and(|(start, end)| (start..end).contains(&intended_ns))
    }
}

impl Scenario for Closed {
    fn start(&mut self, ctx: &mut Ctx<'_>) {
        for lane in 0..self.lanes.len() as u64 {
            self.next(ctx, lane);
        }
    }

    fn tick(&mut self, ctx: &mut Ctx<'_>) {
        if ctx.now_ns >= self.second_end_ns {
            // Only whole seconds inside the window count toward the peak.
            if self.in_window(self.second_end_ns - 1) {
                self.peak_grants = self.peak_grants.max(self.second_grants);
            }
            self.second_grants = 0;
            self.second_end_ns += 1_000_000_000;
        }
        let window_open = self.window_ns.is_some_and(|(start, _)| ctx.now_ns >= start);
        if self.s.op == MaxOp::Release && !self.releasing && window_open {
            self.releasing = true;
            for lane in 0..self.lanes.len() as u64 {
                self.next(ctx, lane);
            }
        }
    }

    fn on_reply(&mut self, ctx: &mut Ctx<'_>, op: &Op, outcome: &Outcome) {
        match self.s.op {
            MaxOp::Mixed => return self.on_mixed(ctx, op, outcome),
            MaxOp::Renew => return self.on_renew(ctx, op, outcome),
            MaxOp::Acquire | MaxOp::Ping | MaxOp::Release => {}
        }
        match (op.kind, outcome) {
            (OpKind::Acquire, Outcome::Granted { lease, .. }) => {
                self.held += 1;
                if self.in_window(op.intended_ns) {
                    self.second_grants += 1;
                }
                if self.s.op == MaxOp::Release {
                    self.pool.push((op.key, *lease));
                }
            }
            (OpKind::Acquire, _) if self.s.op == MaxOp::Release => {
                self.pool_requested -= 1; // taken by an earlier run: try another key
            }
            (OpKind::Release, _) => self.held -= 1,
            _ => {}
        }
        if !ctx.stopping {
            self.next(ctx, op.tag);
        }
    }

    fn set_window(&mut self, start_ns: u64, end_ns: u64) {
        self.window_ns = Some((start_ns, end_ns));
        self.second_end_ns = start_ns + 1_000_000_000;
    }

    fn ready(&self) -> bool {
        match self.s.op {
            MaxOp::Renew => self.ready_lanes == self.lanes.len(),
            MaxOp::Release => self.pool.len() as u64 == self.s.keys,
            _ => true,
        }
    }

    fn skips_warmup(&self) -> bool {
        self.s.op == MaxOp::Release
    }

    fn finished(&self) -> bool {
        self.s.op == MaxOp::Release && self.releasing && self.pool.is_empty()
    }

    fn held(&self) -> u64 {
        self.held
    }

    fn summary(&self, window_s: f64) -> Vec<(&'static str, Value)> {
        let mut out = vec![
            ("lanes", Value::U64(self.lanes.len() as u64)),
            ("keys", Value::U64(self.s.keys)),
        ];
        if self.s.op == MaxOp::Acquire {
            out.push((
                "peak_grants_per_s_best_second",
                Value::U64(self.peak_grants),
            ));
        }
        if self.s.op == MaxOp::Mixed {
            out.push(("cycles_completed", Value::U64(self.cycles_done)));
            out.push(("cycles_failed", Value::U64(self.cycles_failed)));
            let cycles_per_s = self.cycles_done as f64 / window_s;
            out.push(("cycles_per_s", Value::F64(cycles_per_s)));
            out.push((
                "ops_in_completed_cycles_per_s",
                Value::F64(3.0 * cycles_per_s),
            ));
        }
        out
    }
}
