//! Latency histograms and outcome counters.
//!
//! Every reply is counted for the live progress line; only ops whose *intended* send time falls
//! inside the measured window go into the report's per-kind histograms, so the ramp, the warmup
//! and the drain after the window leave no trace in the figures.

use std::collections::BTreeMap;

use hdrhistogram::Histogram;

use crate::op::{Op, OpKind, Outcome};

/// Largest latency a histogram tracks, in nanoseconds (longer ones are clamped to it).
const LATENCY_NS_MAX: u64 = 3_600 * 1_000_000_000;
/// Most distinct error names kept; the rest are counted under "other".
const ERROR_NAMES_MAX: usize = 32;

/// A latency histogram in nanoseconds, 3 significant digits.
pub fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, LATENCY_NS_MAX, 3).expect("valid histogram bounds")
}

/// Figures for one op kind inside the window.
pub struct KindStats {
    /// Latency from intended send to reply, nanoseconds: the headline figure.
    pub latency_ns: Histogram<u64>,
    /// Latency from actual send to reply, nanoseconds: what the target alone costs.
    pub service_ns: Histogram<u64>,
    /// Replies by outcome class ([`Outcome::NAMES`]).
    pub outcomes: [u64; Outcome::COUNT],
}

impl KindStats {
    /// Replies of any outcome.
    pub fn count(&self) -> u64 {
        self.outcomes.iter().sum()
    }
}

/// All figures of a run.
pub struct Stats {
    /// Intended-send-time window that counts, nanoseconds since the start (end exclusive).
    pub window_ns: Option<(u64, u64)>,
    /// Per-kind figures inside the window, indexed by `OpKind as usize`.
    pub measured: [KindStats; OpKind::COUNT],
    /// Error replies by name, whole run.
    pub errors: BTreeMap<String, u64>,
    /// Replies per kind, whole run (the progress line diffs these).
    pub replies: [u64; OpKind::COUNT],
    /// Replies per kind at the last progress line.
    pub replies_last: [u64; OpKind::COUNT],
    /// Latency of every reply since the last progress line.
    pub second_ns: Histogram<u64>,
    /// Latency of every reply since the start.
    pub run_ns: Histogram<u64>,
}

impl Default for Stats {
    fn default() -> Self {
        let kind = || KindStats {
            latency_ns: histogram(),
            service_ns: histogram(),
            outcomes: [0; Outcome::COUNT],
        };
        Stats {
            window_ns: None,
            measured: std::array::from_fn(|_| kind()),
            errors: BTreeMap::new(),
            replies: [0; OpKind::COUNT],
            replies_last: [0; OpKind::COUNT],
            second_ns: histogram(),
            run_ns: histogram(),
        }
    }
}

impl Stats {
    /// Counts one reply that arrived at `now_ns`.
    pub fn record(&mut self, op: &Op, outcome: &Outcome, now_ns: u64) {
        let latency_ns = now_ns.saturating_sub(op.intended_ns).max(1);
        let kind = op.kind as usize;
        self.replies[kind] += 1;
        self.second_ns.saturating_record(latency_ns);
        self.run_ns.saturating_record(latency_ns);
        if let Outcome::Error(name) = outcome {
            if self.errors.len() < ERROR_NAMES_MAX || self.errors.contains_key(name) {
                *self.errors.entry(name.clone()).or_default() += 1;
            } else {
                *self.errors.entry("other".into()).or_default() += 1;
            }
        }
        if self.in_window(op.intended_ns) {
            let k = &mut self.measured[kind];
            k.latency_ns.saturating_record(latency_ns);
            k.service_ns
                .saturating_record(now_ns.saturating_sub(op.sent_ns).max(1));
            k.outcomes[outcome.index()] += 1;
        }
    }

    /// Whether an op meant to be sent at `intended_ns` counts.
    pub fn in_window(&self, intended_ns: u64) -> bool {
        self.window_ns
            .is_some_and(|(start, end)| (start..end).contains(&intended_ns))
    }

    /// Replies per kind since the last call, and resets the one-second histogram.
    pub fn take_second(&mut self) -> ([u64; OpKind::COUNT], Histogram<u64>) {
        let mut delta = [0; OpKind::COUNT];
        for kind in OpKind::ALL {
            let k = kind as usize;
            delta[k] = self.replies[k] - self.replies_last[k];
        }
        self.replies_last = self.replies;
        let second = std::mem::replace(&mut self.second_ns, histogram());
        (delta, second)
    }
}

/// Jain's fairness index of `xs`: 1 when all are equal, 1/n when one has everything.
pub fn jain_index(xs: &[u64]) -> f64 {
    let sum: f64 = xs.iter().map(|&x| x as f64).sum();
    let squares: f64 = xs.iter().map(|&x| (x as f64) * (x as f64)).sum();
    if squares == 0.0 {
        return 1.0;
    }
    sum * sum / (xs.len() as f64 * squares)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jain() {
        assert!((jain_index(&[5, 5, 5, 5]) - 1.0).abs() < 1e-9);
        assert!((jain_index(&[8, 0, 0, 0]) - 0.25).abs() < 1e-9);
    }

    #[test]
    fn only_the_window_counts() {
        let mut stats = Stats {
            window_ns: Some((100, 200)),
            ..Stats::default()
        };
        let mut op = Op {
            kind: OpKind::Ping,
            key: 0,
            lease: 0,
            ttl_ms: 0,
            wait_ms: 0,
            tag: 0,
            intended_ns: 50,
            sent_ns: 50,
            lease_kind: None,
        };
        stats.record(&op, &Outcome::Pong, 60);
        op.intended_ns = 150;
        stats.record(&op, &Outcome::Pong, 190);
        op.intended_ns = 200;
        stats.record(&op, &Outcome::Pong, 210);
        let ping = &stats.measured[OpKind::Ping as usize];
        assert_eq!(ping.count(), 1);
        assert_eq!(ping.latency_ns.max(), 40);
        assert_eq!(stats.replies[OpKind::Ping as usize], 3);
    }
}
