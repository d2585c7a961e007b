//! Workloads. Each one decides what to send and when; the driver in [`crate::run`] owns the
//! clock, the measured window and the report, and [`crate::world`] holds the connections a
//! scenario sends on (through [`Ctx`]).
//!
//! # Layout
//! - [`estimate`]: open loop at a constant acquire rate with hold, renew and release.
//! - [`closed`]: closed loop at a fixed number of requests in flight, one op kind at a time.
//! - [`contention`]: many clients on a few hot keys; hand-off latency and fairness.

pub mod closed;
pub mod contention;
pub mod estimate;

use crate::conn::Conn;
use crate::op::{Op, OpKind, Outcome};
use crate::report::Value;

/// What a scenario sees of the world while it acts.
pub struct Ctx<'a> {
    /// Now, in nanoseconds since the run started.
    pub now_ns: u64,
    /// The connections; a scenario picks one per op.
    pub conns: &'a mut [Conn],
    /// The window has closed: closed loops stop starting new work.
    pub stopping: bool,
}

impl Ctx<'_> {
    /// Sends (or queues) `op` on connection `conn`.
    pub fn submit(&mut self, conn: usize, op: Op) {
        self.conns[conn].submit(op, self.now_ns);
    }
}

/// A workload driven by the run loop.
pub trait Scenario {
    /// Called once after connecting, at the run's time origin.
    fn start(&mut self, ctx: &mut Ctx<'_>);
    /// Called about every millisecond: timed sends happen here.
    fn tick(&mut self, ctx: &mut Ctx<'_>);
    /// Called for every reply, after it was counted.
    fn on_reply(&mut self, ctx: &mut Ctx<'_>, op: &Op, outcome: &Outcome);
    /// Told the measured window (intended send times, nanoseconds, end exclusive) once known.
    fn set_window(&mut self, start_ns: u64, end_ns: u64);
    /// Whether setup work (pre-acquired locks) is done, so the window may be placed.
    fn ready(&self) -> bool {
        true
    }
    /// Unmeasured time the workload needs after [`Scenario::ready`] to reach steady state.
    fn ramp_ns(&self) -> u64 {
        0
    }
    /// Whether `--warmup` is skipped (a workload that consumes its setup should not idle).
    fn skips_warmup(&self) -> bool {
        false
    }
    /// Whether the workload ran out of work before the window's end.
    fn finished(&self) -> bool {
        false
    }
    /// Locks this run believes it holds now.
    fn held(&self) -> u64;
    /// Rate per op kind the workload aims at, if it has one (indexed by `OpKind as usize`).
    fn target_rates(&self) -> [Option<f64>; OpKind::COUNT] {
        [None; OpKind::COUNT]
    }
    /// Scenario-specific figures for the report; `window_s` is the measured window's length.
    fn summary(&self, window_s: f64) -> Vec<(&'static str, Value)>;
}

/// SplitMix64: a fast, seedable generator, plenty for picking keys and lease values.
pub struct Rng(u64);

impl Rng {
    /// A generator started from `seed`.
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (`n` > 0), by multiply-shift.
    pub fn below(&mut self, n: u64) -> u64 {
        assert!(n > 0);
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// A random 128-bit lease value (the client-chosen lock value in the Redis recipes).
    pub fn lease(&mut self) -> u128 {
        (u128::from(self.next_u64()) << 64) | u128::from(self.next_u64())
    }
}

/// Where this run's keys start: random, so locks left by an earlier run (still inside their
/// TTL) do not collide with this one's.
pub fn key_base(rng: &mut Rng, keys: u64) -> u64 {
    const BASE_MAX: u64 = 1 << 62;
    assert!(keys <= BASE_MAX);
    rng.below(BASE_MAX - keys + 1)
}

/// An op with the fields every scenario fills the same way.
pub fn op(kind: OpKind, key: u64, lease: u128, ttl_ms: u32, tag: u64, intended_ns: u64) -> Op {
    Op {
        kind,
        key,
        lease,
        ttl_ms,
        wait_ms: 0,
        tag,
        intended_ns,
        sent_ns: 0,
        lease_kind: None,
    }
}
