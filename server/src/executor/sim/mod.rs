//! Seeded simulation of the executor and the journal, in the spirit of TigerBeetle's VOPR.
//!
//! One seed drives a few simulated connections (each a [`Session`]) against a real
//! [`Executor`] over a [`MemJournal`], in virtual time: the sim runs on a current-thread
//! tokio runtime whose clock is paused and only moves by `tokio::time::advance`. The
//! connections acquire (at once and blocking, with and without release-on-disconnect),
//! renew (to shorter and longer TTLs than the grant), release (right and wrong lease ids,
//! from their own or another connection), inspect, check and disconnect; the ticker's
//! expiry pass runs between steps. The journal makes writes durable only now and then,
//! fails outright (every change then refused, and those caught in the failed write undone),
//! and the server restarts from what was durable, through the WAL's real recovery code
//! ([`disk`]).
//!
//! After every step ([`model`]): no two clients are inside their local lease deadlines for
//! one key (a deadline is `sent + waited_ms + ttl_ms - 2 ms`, from the replies the clients
//! got); tokens per key grow across every acknowledged grant, restarts included; a release
//! acknowledged never comes back; a change answered UNAVAILABLE "nothing changed" is not
//! visible; a hand-off goes to the first live waiter in line; a client that believes it
//! holds a token is told CURRENT; `check_invariants` holds on every shard. After a restart,
//! every lease a client still believes it holds is back, with its token.
//!
//! Some ACQUIREs carry an acquire id, and some are sent again with an id sent before (a
//! retry), against the naive rule of PROTOCOL.md 3.9: while the lease a client was told of
//! for an id holds the key, every send of that id is answered REGRANTED with that lease
//! (after restarts too); a REGRANTED names the key's holder and never a grant answered
//! "nothing changed"; an ACQUIRE_ENDED never names the holder. A repeat's REGRANTED becomes
//! a belief like a grant's (counted from the repeat's send), so exclusion covers it.
//!
//! Sessions (open, keep-alive, close, ACQUIREs in them, expiry racing keep-alives) have a
//! simulation of their own, against its own naive model ([`sessions`]). This one opens
//! sessions too and takes leases in them on keys of their own, and restarts as the server
//! does (`restore_sessions`, then `Executor::restore`): after a restart every session that
//! had to be live is back with each acknowledged lease in it (same lease id and token, time
//! left the session's TTL from the restart), and an acknowledged close stays closed.
//!
//! `TENURE_SIM_SEEDS=n` runs n seeds (default [`SEEDS_DEFAULT`]); `TENURE_SIM_SEED=s` runs
//! only seed s. A failure names the seed and the step.

mod disk;
mod model;
mod sessions;
mod world;

use crate::table::sim::seeds_from_env;
use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};

use self::world::{Coverage, World};

/// Seeds run by default: a few seconds in a debug build.
const SEEDS_DEFAULT: u64 = 24;
/// Steps per seed.
const STEPS_PER_SEED: u64 = 1_500;

/// A current-thread runtime whose clock moves only when told: the simulations' time.
fn paused_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("a current-thread runtime")
}

fn run_seed(seed: u64, step: &Cell<u64>) -> Coverage {
    paused_runtime().block_on(async {
        let mut world = World::new(seed).await;
        for i in 0..STEPS_PER_SEED {
            step.set(i);
            world.step().await;
        }
        world.finish()
    })
}

#[test]
fn executor_and_journal_keep_their_promises() {
    let seeds = seeds_from_env(SEEDS_DEFAULT);
    let many = seeds.len() > 1;
    let mut coverage = Coverage::default();
    for seed in seeds {
        let step = Cell::new(0);
        match catch_unwind(AssertUnwindSafe(|| run_seed(seed, &step))) {
            Ok(seen) => coverage.add(seen),
            Err(panic) => {
                eprintln!(
                    "executor simulation failed at seed {seed}, step {}; \
                     rerun with TENURE_SIM_SEED={seed}",
                    step.get()
                );
                std::panic::resume_unwind(panic);
            }
        }
    }
    eprintln!("executor simulation exercised {coverage:?}");
    if many {
        coverage.check_all_seen();
    }
}
