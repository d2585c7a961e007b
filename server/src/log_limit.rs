//! A rate limit on repeated warnings and errors from chatty dependencies.
//!
//! openraft logs a WARN or an ERROR line each time a heartbeat or a leadership confirmation
//! round cannot reach a peer: with one follower down that is several lines a second, and one
//! per confirmation round under load, for as long as the follower stays down. The first line
//! of each kind says everything an operator needs; the rest would bury every other log line
//! and fill disks. So each call site of the listed crates logs its WARN and ERROR events at
//! most once per [`REPEAT_PERIOD`]; their INFO and lower lines (elections, membership) and
//! every line of ours pass untouched.
//!
//! Lines of ours that a stranger can cause at will (a refused peer frame, a failed AUTH) are
//! sampled at their call site by [`Sampled`]: one line a period, counting the ones left out,
//! so a flood cannot fill the disk with them.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tracing::callsite::Identifier;
use tracing::{Event, Level, Metadata};
use tracing_subscriber::layer::{Context, Filter};

/// Shortest time between two WARN or ERROR lines from one call site of a limited crate.
pub const REPEAT_PERIOD: Duration = Duration::from_secs(10);

/// Crates whose repeated warnings and errors are limited (module path prefixes).
pub const LIMITED_TARGETS: &[&str] = &["openraft"];

/// The filter: see the module docs.
#[derive(Debug, Default)]
pub struct RepeatLimit {
    last: Mutex<HashMap<Identifier, Instant>>,
}

impl RepeatLimit {
    fn limits(metadata: &Metadata<'_>) -> bool {
        *metadata.level() <= Level::WARN
            && LIMITED_TARGETS
                .iter()
                .any(|prefix| metadata.target().starts_with(prefix))
    }

    /// Whether a line from `site` may go out at `now`; if so, it is remembered.
    fn admit(&self, site: Identifier, now: Instant) -> bool {
        let mut last = self.last.lock().expect("log limit mutex poisoned");
        match last.get(&site) {
            Some(&at) if now.duration_since(at) < REPEAT_PERIOD => false,
            _ => {
                last.insert(site, now);
                true
            }
        }
    }
}

impl<S> Filter<S> for RepeatLimit {
    fn enabled(&self, _metadata: &Metadata<'_>, _cx: &Context<'_, S>) -> bool {
        true
    }

    fn callsite_enabled(
        &self,
        metadata: &'static Metadata<'static>,
    ) -> tracing::subscriber::Interest {
        // "Sometimes" for the limited sites, so that `event_enabled` is asked every time.
        if Self::limits(metadata) {
            tracing::subscriber::Interest::sometimes()
        } else {
            tracing::subscriber::Interest::always()
        }
    }

    fn event_enabled(&self, event: &Event<'_>, _cx: &Context<'_, S>) -> bool {
        let metadata = event.metadata();
        !Self::limits(metadata) || self.admit(metadata.callsite(), Instant::now())
    }
}

/// One log line a period from a stream of like events, saying how many were left out since:
/// see the module docs. Time arrives as milliseconds on the caller's clock, 0 being never.
#[derive(Debug, Default)]
pub struct Sampled {
    last_ms: AtomicU64,
    unlogged: AtomicU64,
}

impl Sampled {
    /// Whether the event at `now_ms` may be logged (the first, then one at least `period_ms`
    /// after the last one logged): `Some` with how many were left out since, or `None`, and
    /// it is counted as left out.
    pub fn admit(&self, now_ms: u64, period_ms: u64) -> Option<u64> {
        let last = self.last_ms.load(Ordering::Relaxed);
        let due = last == 0 || now_ms.saturating_sub(last) >= period_ms;
        if due
            && self
                .last_ms
                .compare_exchange(last, now_ms.max(1), Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        {
            return Some(self.unlogged.swap(0, Ordering::AcqRel));
        }
        self.unlogged.fetch_add(1, Ordering::Relaxed);
        None
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::Layer;

    use super::*;

    /// Collects formatted lines.
    #[derive(Clone, Default)]
    struct Lines(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Lines {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_repeated_openraft_error_is_logged_once_per_period_ours_always() {
        let lines = Lines::default();
        let sink = lines.clone();
        let layer = tracing_subscriber::fmt::layer()
            .with_writer(move || sink.clone())
            .with_ansi(false)
            .with_filter(RepeatLimit::default());
        let subscriber = tracing_subscriber::registry().with(layer);
        tracing::subscriber::with_default(subscriber, || {
            for _ in 0..5 {
                tracing::error!(target: "openraft::core", "peer unreachable");
                tracing::info!(target: "openraft::core", "vote granted");
                tracing::error!(target: "tenure_server::cluster", "ours");
            }
        });
        let text = String::from_utf8(lines.0.lock().unwrap().clone()).unwrap();
        assert_eq!(text.matches("peer unreachable").count(), 1, "{text}");
        assert_eq!(text.matches("vote granted").count(), 5, "{text}");
        assert_eq!(text.matches("ours").count(), 5, "{text}");
    }

    #[test]
    fn a_sampled_stream_logs_once_a_period_with_the_count_left_out() {
        let sampled = Sampled::default();
        assert_eq!(sampled.admit(1_000, 10_000), Some(0));
        assert_eq!(sampled.admit(1_001, 10_000), None);
        assert_eq!(sampled.admit(10_999, 10_000), None);
        assert_eq!(sampled.admit(11_000, 10_000), Some(2));
        assert_eq!(sampled.admit(11_000, 10_000), None);
        // An event at 0 on the caller's clock is logged too (and kept as at 1: 0 is never).
        let at_zero = Sampled::default();
        assert_eq!(at_zero.admit(0, 10_000), Some(0));
        assert_eq!(at_zero.admit(5, 10_000), None);
    }

    #[test]
    fn a_site_speaks_again_after_the_period() {
        let limit = RepeatLimit::default();
        // A real call site's identity, as an event carries it.
        let site = tracing::callsite! {
            name: "repeated",
            kind: tracing::metadata::Kind::EVENT,
            target: "openraft::core",
            level: Level::ERROR,
            fields: []
        };
        let site = tracing::Callsite::metadata(site).callsite();
        let start = Instant::now();
        assert!(limit.admit(site.clone(), start));
        assert!(!limit.admit(site.clone(), start + REPEAT_PERIOD / 2));
        assert!(limit.admit(site, start + REPEAT_PERIOD));
    }
}
