//! The one place where the server reads time.
//!
//! Expiry is judged by the monotonic clock only, so a wall-clock jump (NTP step, an operator
//! setting the date) changes nothing. The lock table, timer wheel and WAL never read a clock:
//! they are handed `now_ms`, milliseconds since this clock's origin, which is also the timer
//! wheel's tick. Tests and the simulation pass their own numbers instead.
//!
//! The clock is tokio's (`tokio::time::Instant`), which in a release build is the monotonic
//! clock itself; under a test's paused clock (`#[tokio::test(start_paused = true)]`,
//! `tokio::time::advance`) it is the runtime's virtual time, so expiry, hand-off waits and
//! `waited_ms` can be tested without waiting for real. The expiry ticker runs on tokio time
//! too (`tokio::time::interval`), so both move together.

use tokio::time::Instant;

/// Milliseconds on the server's monotonic clock, counted from server start.
#[derive(Clone, Copy, Debug)]
pub struct Clock {
    origin: Instant,
}

impl Clock {
    /// A clock whose zero is now. Read inside a runtime whose clock is paused, "now" is that
    /// runtime's virtual time.
    pub fn start() -> Clock {
        Clock {
            origin: Instant::now(),
        }
    }

    /// Milliseconds since the origin, rounded down. A lease granted for `ttl_ms` at `now_ms`
    /// expires at `now_ms + ttl_ms`, which can be up to 1 ms before the exact instant of the
    /// grant plus `ttl_ms`; a `waited_ms` taken as a difference of two readings can be up to
    /// 1 ms long. Clients take both into account (PROTOCOL.md §3.3: they count 2 ms short).
    pub fn now_ms(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_millis()).expect("server up for 584 million years")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn never_goes_backwards() {
        let clock = Clock::start();
        let mut last = clock.now_ms();
        for _ in 0..1000 {
            let now = clock.now_ms();
            assert!(now >= last);
            last = now;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn follows_the_runtimes_paused_clock() {
        let clock = Clock::start();
        assert_eq!(clock.now_ms(), 0);
        tokio::time::advance(std::time::Duration::from_millis(5_000)).await;
        assert_eq!(clock.now_ms(), 5_000, "virtual time, exactly");
    }
}
