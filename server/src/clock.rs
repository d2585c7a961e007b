//! The one place where the server reads time.
//!
//! Expiry is judged by the monotonic clock only, so a wall-clock jump (NTP step, an operator
//! setting the date) changes nothing. The lock table, timer wheel and WAL never read a clock:
//! they are handed `now_ms`, milliseconds since this clock's origin, which is also the timer
//! wheel's tick. Tests and the simulation pass their own numbers instead.

use std::time::Instant;

/// Milliseconds on the server's monotonic clock, counted from server start.
#[derive(Clone, Copy, Debug)]
pub struct Clock {
    origin: Instant,
}

impl Clock {
    /// A clock whose zero is now.
    pub fn start() -> Clock {
        Clock {
            origin: Instant::now(),
        }
    }

    /// Milliseconds since the origin, rounded down: a lease granted for `ttl_ms` at `now_ms`
    /// expires at `now_ms + ttl_ms`, so rounding down can only make it last a little longer on
    /// the server, never shorter than the client (which counts from before it sent) believes.
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
}
