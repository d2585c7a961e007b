//! [`TokenAllocator`]: fencing tokens below a durable limit, shared by all shards.
//!
//! Allocation is one compare-and-swap on a shared counter, so shards (each behind its own
//! mutex) do not contend on a lock to get tokens; tokens are strictly increasing in the order
//! the allocations take effect. Token 0 is never issued, so it can mean "no token". Raising
//! the limit is the executor's business (`executor::tokens`, after a durable reservation).

use std::sync::atomic::{AtomicU64, Ordering};

/// Hands out fencing tokens below a durable limit; see the module docs.
#[derive(Debug)]
pub struct TokenAllocator {
    /// The next token to hand out.
    next: AtomicU64,
    /// Tokens at or above this are not yet covered by a synced WAL reservation.
    limit: AtomicU64,
}

impl TokenAllocator {
    /// An allocator that will hand out `next..limit` and then wait for `extend_limit`.
    ///
    /// # Panics
    /// If `next` is 0 or `limit < next`.
    pub fn new(next: u64, limit: u64) -> Self {
        assert!(next >= 1, "token 0 is reserved for 'no token'");
        assert!(limit >= next, "token limit {limit} below next token {next}");
        TokenAllocator {
            next: AtomicU64::new(next),
            limit: AtomicU64::new(limit),
        }
    }

    /// The next token, or `None` when the durable reservation is used up: the caller must
    /// reserve a new block in the WAL, wait for the sync, call `extend_limit` and retry.
    pub fn try_next(&self) -> Option<u64> {
        let mut next = self.next.load(Ordering::Acquire);
        loop {
            // Reading the limit after `next` can only see an older, lower limit: that refuses
            // a token which was in fact allowed, never the other way round.
            if next >= self.limit.load(Ordering::Acquire) {
                return None;
            }
            match self.next.compare_exchange_weak(
                next,
                next + 1,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Some(next),
                Err(current) => next = current,
            }
        }
    }

    /// Raises the limit to `limit` (after the WAL reservation for it is synced). A lower value
    /// than the current limit is ignored, so racing extenders cannot shrink it.
    ///
    /// # Panics
    /// If `limit` is `u64::MAX` (the counter could then overflow).
    pub fn extend_limit(&self, limit: u64) {
        assert!(limit < u64::MAX, "token limit out of range");
        self.limit.fetch_max(limit, Ordering::AcqRel);
    }

    /// The token the next successful `try_next` would return (at least; others may race).
    pub fn next_token(&self) -> u64 {
        self.next.load(Ordering::Acquire)
    }

    /// The current durable limit: tokens below it may be handed out.
    pub fn limit(&self) -> u64 {
        self.limit.load(Ordering::Acquire)
    }

    /// How many tokens can still be handed out before the limit must be raised. The server
    /// reserves the next block when this falls below a low-water mark, so `try_next` rarely
    /// returns `None`.
    pub fn remaining(&self) -> u64 {
        // Load `next` first: `limit` then is at least as new, so this never underflows.
        let next = self.next_token();
        self.limit().saturating_sub(next)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn hands_out_up_to_limit_then_waits_for_extension() {
        let tokens = TokenAllocator::new(1, 3);
        assert_eq!(tokens.remaining(), 2);
        assert_eq!(tokens.try_next(), Some(1));
        assert_eq!(tokens.try_next(), Some(2));
        assert_eq!(tokens.try_next(), None);
        assert_eq!(tokens.remaining(), 0);
        tokens.extend_limit(2); // lower: ignored
        assert_eq!(tokens.limit(), 3);
        tokens.extend_limit(5);
        assert_eq!(tokens.try_next(), Some(3));
        assert_eq!(tokens.next_token(), 4);
        assert_eq!(tokens.remaining(), 1);
    }

    #[test]
    #[should_panic(expected = "token 0")]
    fn token_zero_is_never_issued() {
        let _ = TokenAllocator::new(0, 10);
    }

    #[test]
    fn concurrent_callers_get_unique_increasing_tokens() {
        let tokens = Arc::new(TokenAllocator::new(1, 1));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let tokens = Arc::clone(&tokens);
                std::thread::spawn(move || {
                    let mut mine = Vec::new();
                    while mine.len() < 5000 {
                        match tokens.try_next() {
                            Some(token) => mine.push(token),
                            None => tokens.extend_limit(tokens.limit() + 100),
                        }
                    }
                    mine
                })
            })
            .collect();
        let mut all = Vec::new();
        for thread in threads {
            let mine = thread.join().unwrap();
            assert!(
                mine.windows(2).all(|pair| pair[0] < pair[1]),
                "per-thread order"
            );
            all.extend(mine);
        }
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), 20_000);
        assert!(all.iter().all(|&token| token < tokens.limit()));
    }
}
