//! The once-a-second progress line on stderr.

use std::fmt::Write;

use crate::op::OpKind;
use crate::world::World;

/// Writes progress lines unless quiet.
pub struct Progress {
    quiet: bool,
}

impl Progress {
    /// A progress writer; `quiet` silences it.
    pub fn new(quiet: bool) -> Progress {
        Progress { quiet }
    }

    /// Prints one line: replies per second by kind over the last second, locks held, latency.
    pub fn line(&mut self, world: &mut World, now_ns: u64, window_ns: Option<(u64, u64)>) {
        let (per_kind, second) = world.stats.take_second();
        if self.quiet {
            return;
        }
        let phase = match window_ns {
            None => "setup",
            Some((start, _)) if now_ns < start => "warmup",
            Some((_, end)) if now_ns < end => "measure",
            Some(_) => "drain",
        };
        let mut line = format!("[{:>4}s {phase:<7}]", now_ns / 1_000_000_000);
        for kind in OpKind::ALL {
            if world.stats.replies[kind as usize] > 0 {
                let _ = write!(line, " {} {}/s", kind.name(), per_kind[kind as usize]);
            }
        }
        let queued: usize = world.conns.iter().map(|c| c.backlog()).sum();
        let errors: u64 = world.stats.errors.values().sum();
        let _ = write!(
            line,
            " | held {} | p99 1s {:.0}us run {:.0}us | queued {queued} | errors {errors}",
            world.scenario.held(),
            second.value_at_quantile(0.99) as f64 / 1e3,
            world.stats.run_ns.value_at_quantile(0.99) as f64 / 1e3,
        );
        eprintln!("{line}");
    }
}
