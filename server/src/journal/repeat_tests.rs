//! Repeats of an ACQUIRE (same key, same acquire id) through the executor with an in-memory
//! journal: answered with the first grant while it lives, across a restart (the journal's
//! records replayed into a new executor) and a snapshot, not after an undo, and with how the
//! lease ended once it has.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tenure_protocol::{AcquireId, EndedHow, ErrorCode, LeaseId, Request, Response};

use super::mem::MemJournal;
use super::{settle, Journal, Settled};
use crate::clock::Clock;
use crate::config::Config;
use crate::executor::{answer_lost, Executor, ExecutorParts, Outcome, Session};
use crate::record::{self, LeaseReplay};

async fn executor(journal: &Arc<MemJournal>, token_floor: u64) -> Arc<Executor> {
    let config = Config::for_tests(std::path::Path::new("/nonexistent"));
    let journal: Arc<dyn Journal> = Arc::clone(journal) as Arc<dyn Journal>;
    let parts = ExecutorParts::new(config, Clock::start(), journal, token_floor);
    let executor = Arc::new(Executor::new(parts));
    executor.tokens().reserve().await.unwrap();
    executor
}

fn acquire(key: &str, ttl_ms: u32, id: Option<u128>) -> Request {
    Request::Acquire {
        key: Bytes::copy_from_slice(key.as_bytes()),
        ttl_ms,
        wait_ms: 0,
        release_on_disconnect: false,
        meta: Bytes::from_static(b"m"),
        acquire_id: id.map(AcquireId::from_u128),
        kind: Default::default(),
        session_id: None,
    }
}

/// The reply and the ticket it waits for.
fn run(executor: &Arc<Executor>, request: Request) -> (Response, u64) {
    match executor.execute(&mut Session::new(1), 1, request) {
        Outcome::Reply(response, ticket) => (response, ticket),
        Outcome::Changed {
            response, ticket, ..
        } => (response, ticket),
        _ => panic!("answered at once"),
    }
}

fn granted(response: &Response) -> (u64, LeaseId) {
    match response {
        Response::Granted {
            token, lease_id, ..
        } => (*token, *lease_id),
        other => panic!("granted, not {other:?}"),
    }
}

/// A new executor from everything the journal kept, as WAL recovery or a new cluster
/// leader would build it.
async fn restarted(journal: &MemJournal) -> (Arc<Executor>, Arc<MemJournal>) {
    let mut replay = LeaseReplay::default();
    for kept in journal.kept() {
        let (record, _) = record::decode(&kept.record).unwrap();
        replay.apply(&record);
    }
    let fresh = MemJournal::new(true);
    let executor = executor(&fresh, replay.token_floor).await;
    executor.restore(executor.clock().now_ms(), replay.to_recovered());
    (executor, fresh)
}

#[tokio::test]
async fn a_repeat_of_a_live_grant_gets_it_again_and_changes_nothing() {
    let journal = MemJournal::new(true);
    let executor = executor(&journal, 1).await;
    let (first, ticket) = run(&executor, acquire("k", 60_000, Some(7)));
    let (token, lease_id) = granted(&first);
    let records = journal.kept().len();
    // Before the grant is durable, the repeat's reply waits for the same record.
    let (again, again_ticket) = run(&executor, acquire("k", 60_000, Some(7)));
    assert_eq!(again_ticket, ticket);
    let Response::Regranted {
        token: t,
        lease_id: l,
        ttl_left_ms,
    } = again
    else {
        panic!("a repeat, not {again:?}");
    };
    assert_eq!((t, l), (token, lease_id));
    assert!(ttl_left_ms <= 60_000 && ttl_left_ms > 0);
    assert_eq!(journal.kept().len(), records, "a repeat logs nothing");
    // Another id on the held key is an ACQUIRE like any: LOCKED.
    let (other, _) = run(&executor, acquire("k", 60_000, Some(8)));
    assert!(matches!(other, Response::Locked { token: t, .. } if t == token));
    // So is a plain one.
    let (plain, _) = run(&executor, acquire("k", 60_000, None));
    assert!(matches!(plain, Response::Locked { .. }));
    for shard in executor.shards() {
        shard.lock().unwrap().check_invariants();
    }
}

#[tokio::test]
async fn a_repeat_after_release_hears_released_and_another_key_is_new() {
    let journal = MemJournal::new(true);
    let executor = executor(&journal, 1).await;
    let (first, _) = run(&executor, acquire("k", 60_000, Some(7)));
    let (token, lease_id) = granted(&first);
    journal.make_durable();
    let key = Bytes::from_static(b"k");
    let (released, _) = run(&executor, Request::Release { key, lease_id });
    assert_eq!(released, Response::Released);
    let (again, _) = run(&executor, acquire("k", 60_000, Some(7)));
    assert_eq!(
        again,
        Response::AcquireEnded {
            how: EndedHow::Released,
            token
        }
    );
    assert!(matches!(
        run(&executor, acquire("k2", 60_000, Some(7))).0,
        Response::Granted { .. }
    ));
}

#[tokio::test(start_paused = true)]
async fn a_repeat_after_expiry_hears_expired_even_before_the_ticker_reaps_it() {
    let journal = MemJournal::new(true);
    let executor = executor(&journal, 1).await;
    let (first, _) = run(&executor, acquire("k", 100, Some(7)));
    let (token, _) = granted(&first);
    journal.make_durable();
    tokio::time::advance(Duration::from_millis(150)).await;
    let (again, _) = run(&executor, acquire("k", 100, Some(7)));
    assert_eq!(
        again,
        Response::AcquireEnded {
            how: EndedHow::Expired,
            token
        }
    );
    // The key is free: a new id is granted.
    assert!(matches!(
        run(&executor, acquire("k", 100, Some(8))).0,
        Response::Granted { .. }
    ));
}

/// A repeat that arrives once the holder's lease is past its deadline, before the ticker
/// hands the key to the first send waiting in line, hears of that hand-off: REGRANTED with
/// the first send's grant (outside test a30, finding F2: it was LOCKED, with that grant's
/// own token, and a client that took LOCKED at its word left the grant orphaned).
#[tokio::test(start_paused = true)]
async fn a_repeat_racing_the_hand_off_to_its_first_send_hears_of_that_grant() {
    let journal = MemJournal::new(true);
    let executor = executor(&journal, 1).await;
    let (holder, _) = run(&executor, acquire("k", 100, None));
    granted(&holder);
    repeat_races_the_hand_off(&executor, &journal, acquire("k", 60_000, Some(7))).await;
}

/// The same on a semaphore key (one permit): its holders and waiters are kept apart from
/// plain locks' (module `table::shared`).
#[tokio::test(start_paused = true)]
async fn a_permit_repeat_racing_the_hand_off_to_its_first_send_hears_of_that_grant() {
    let journal = MemJournal::new(true);
    let executor = executor(&journal, 1).await;
    let kind = tenure_protocol::LeaseKind::Permits { count: 1, limit: 1 };
    let mut holder = acquire_kind("s", None, kind);
    if let Request::Acquire { ttl_ms, .. } = &mut holder {
        *ttl_ms = 100;
    }
    granted(&run(&executor, holder).0);
    repeat_races_the_hand_off(&executor, &journal, acquire_kind("s", Some(7), kind)).await;
}

/// Queues `request` (its key held by a lease of 100 ms), lets that lease run out without a
/// ticker, sends `request` again: the repeat is REGRANTED with the first send's grant.
async fn repeat_races_the_hand_off(
    executor: &Arc<Executor>,
    journal: &Arc<MemJournal>,
    request: Request,
) {
    let mut waiting = request.clone();
    if let Request::Acquire { wait_ms, .. } = &mut waiting {
        *wait_ms = 30_000;
    }
    let first = match executor.execute(&mut Session::new(2), 2, waiting) {
        Outcome::Wait { rx, .. } => rx,
        _ => panic!("queued, not answered at once"),
    };
    journal.make_durable();
    tokio::time::advance(Duration::from_millis(150)).await;
    // The holder's lease is past its deadline; no ticker has run.
    let (again, ticket) = run(executor, request);
    let Response::Regranted {
        token, lease_id, ..
    } = again
    else {
        panic!("REGRANTED, not {again:?}")
    };
    journal.make_durable_to(ticket);
    let Ok(crate::executor::WaitResult::Granted { grant, .. }) = first.await else {
        panic!("the first send was not granted")
    };
    assert_eq!((grant.token, grant.lease_id), (token, lease_id));
}

#[tokio::test]
async fn a_repeat_after_a_restart_or_a_snapshot_gets_the_same_grant() {
    let journal = MemJournal::new(true);
    let executor = executor(&journal, 1).await;
    let (first, _) = run(&executor, acquire("k", 60_000, Some(7)));
    let (token, lease_id) = granted(&first);
    journal.make_durable();
    // Replayed from the grant's own record ...
    let (after_restart, fresh) = restarted(&journal).await;
    let (again, _) = run(&after_restart, acquire("k", 60_000, Some(7)));
    assert!(
        matches!(again, Response::Regranted { token: t, lease_id: l, .. } if t == token && l == lease_id),
        "{again:?}"
    );
    // ... and from a snapshot of the restarted one.
    fresh.snapshot(&*after_restart);
    let (twice, _) = restarted(&fresh).await;
    let (again, _) = run(&twice, acquire("k", 60_000, Some(7)));
    assert!(
        matches!(again, Response::Regranted { token: t, lease_id: l, .. } if t == token && l == lease_id),
        "{again:?}"
    );
    // Without the id the restarted server knows nothing more than before.
    assert!(matches!(
        run(&twice, acquire("k", 60_000, None)).0,
        Response::Locked { .. }
    ));
}

#[tokio::test]
async fn a_grant_undone_is_not_repeated() {
    let journal = MemJournal::new(true);
    let executor = executor(&journal, 1).await;
    let outcome = executor.execute(&mut Session::new(1), 1, acquire("k", 60_000, Some(7)));
    let Outcome::Changed { ticket, undo, .. } = outcome else {
        panic!("waits for its ticket");
    };
    journal.fail("injected");
    let Settled::Lost(why) = settle(ticket, &journal.progress().borrow()) else {
        panic!("lost");
    };
    answer_lost(&executor, &mut Session::new(1), Some(undo), &why);
    // Neither a repeat of the live grant nor of an ended one: a new ACQUIRE, refused
    // like any while the journal is failed.
    let (again, _) = run(&executor, acquire("k", 60_000, Some(7)));
    assert!(
        matches!(
            &again,
            Response::Error {
                code: ErrorCode::Unavailable,
                ..
            }
        ),
        "{again:?}"
    );
    for shard in executor.shards() {
        let shard = shard.lock().unwrap();
        shard.check_invariants();
        assert_eq!(shard.acquire_ids_count(), (0, 0));
    }
    // Nothing of it in a restart either: the record never became durable.
    let durable = MemJournal::new(true);
    let (after_restart, _) = restarted(&durable).await;
    assert!(matches!(
        run(&after_restart, acquire("k", 60_000, Some(7))).0,
        Response::Granted { .. }
    ));
}

fn acquire_kind(key: &str, id: Option<u128>, kind: tenure_protocol::LeaseKind) -> Request {
    match acquire(key, 60_000, id) {
        Request::Acquire {
            key,
            ttl_ms,
            wait_ms,
            release_on_disconnect,
            meta,
            acquire_id,
            ..
        } => Request::Acquire {
            key,
            ttl_ms,
            wait_ms,
            release_on_disconnect,
            meta,
            acquire_id,
            kind,
            session_id: None,
        },
        other => unreachable!("{other:?}"),
    }
}

/// A read lease and a permit lease granted to ACQUIREs with acquire ids, beside other
/// holders of their keys, answer repeats with themselves after a restart and after a
/// snapshot: the Grant record carries the id and the kind together.
#[tokio::test]
async fn repeats_of_read_and_permit_leases_survive_a_restart_and_a_snapshot() {
    use tenure_protocol::LeaseKind;
    let permits = LeaseKind::Permits { count: 1, limit: 3 };
    let journal = MemJournal::new(true);
    let executor = executor(&journal, 1).await;
    let read = granted(&run(&executor, acquire_kind("doc", Some(7), LeaseKind::Shared)).0);
    granted(&run(&executor, acquire_kind("doc", None, LeaseKind::Shared)).0);
    granted(&run(&executor, acquire_kind("pool", None, permits)).0);
    let permit = granted(&run(&executor, acquire_kind("pool", Some(8), permits)).0);
    journal.make_durable();
    let regranted = |executor: &Arc<Executor>, key, id, kind| {
        let (answer, _) = run(executor, acquire_kind(key, Some(id), kind));
        match answer {
            Response::Regranted {
                token, lease_id, ..
            } => (token, lease_id),
            other => panic!("{key}: expected REGRANTED, got {other:?}"),
        }
    };
    let (after_restart, fresh) = restarted(&journal).await;
    assert_eq!(regranted(&after_restart, "doc", 7, LeaseKind::Shared), read);
    assert_eq!(regranted(&after_restart, "pool", 8, permits), permit);
    fresh.snapshot(&*after_restart);
    let (twice, _) = restarted(&fresh).await;
    assert_eq!(regranted(&twice, "doc", 7, LeaseKind::Shared), read);
    assert_eq!(regranted(&twice, "pool", 8, permits), permit);
    for shard in twice.shards() {
        shard.lock().unwrap().check_invariants();
    }
}

/// A read lease whose grant never became durable answers no repeat: the id is forgotten
/// with it (the shared key's holders are searched for it as a plain key's slot is).
#[tokio::test]
async fn an_undone_read_lease_is_not_repeated() {
    use tenure_protocol::LeaseKind;
    let journal = MemJournal::new(true);
    let executor = executor(&journal, 1).await;
    let request = acquire_kind("doc", Some(7), LeaseKind::Shared);
    let outcome = executor.execute(&mut Session::new(1), 1, request);
    let Outcome::Changed { ticket, undo, .. } = outcome else {
        panic!("waits for its ticket");
    };
    journal.fail("injected");
    let Settled::Lost(why) = settle(ticket, &journal.progress().borrow()) else {
        panic!("lost");
    };
    answer_lost(&executor, &mut Session::new(1), Some(undo), &why);
    for shard in executor.shards() {
        let shard = shard.lock().unwrap();
        shard.check_invariants();
        assert_eq!(shard.acquire_ids_count(), (0, 0));
    }
}
