//! The journal seam, driven through the executor with an in-memory journal.

use std::sync::Arc;

use bytes::Bytes;
use tenure_protocol::{ErrorCode, Request, Response};

use super::mem::MemJournal;
use super::{settle, Journal, Settled};
use crate::clock::Clock;
use crate::config::Config;
use crate::executor::answer_lost;
use crate::executor::Session;
use crate::executor::WaitResult;
use crate::executor::{Executor, ExecutorParts, Outcome};

async fn executor(journal: &Arc<MemJournal>) -> Arc<Executor> {
    let config = Config::for_tests(std::path::Path::new("/nonexistent"));
    let journal: Arc<dyn Journal> = Arc::clone(journal) as Arc<dyn Journal>;
    let executor = Arc::new(Executor::new(ExecutorParts::new(
        config,
        Clock::start(),
        journal,
        1,
    )));
    executor.tokens().reserve().await.unwrap();
    executor
}

fn acquire(key: &str) -> Request {
    Request::Acquire {
        key: Bytes::copy_from_slice(key.as_bytes()),
        ttl_ms: 60_000,
        wait_ms: 0,
        release_on_disconnect: false,
        meta: Bytes::from_static(b"meta"),
        acquire_id: None,
        kind: Default::default(),
        session_id: None,
    }
}

fn inspect(executor: &Arc<Executor>, ctx: &mut Session, key: &str) -> Response {
    let request = Request::Inspect {
        key: Bytes::copy_from_slice(key.as_bytes()),
        kinds: Default::default(),
    };
    match executor.execute(ctx, 99, request) {
        Outcome::Reply(response, _) => response,
        _ => panic!("INSPECT answers at once"),
    }
}

#[tokio::test]
async fn a_snapshot_writes_the_same_grant_record_as_the_live_grant() {
    let journal = MemJournal::new(true);
    let executor = executor(&journal).await;
    let mut ctx = Session::new(1);
    let Outcome::Changed { ticket, .. } = executor.execute(&mut ctx, 1, acquire("k")) else {
        panic!("a grant in full durability waits for its ticket");
    };
    journal.snapshot(&*executor);
    let kept = journal.kept();
    let live = kept.iter().find(|k| k.ticket == ticket).unwrap();
    assert_eq!(kept.last().unwrap().record, live.record, "one builder");
}

#[tokio::test]
async fn a_failed_journal_refuses_a_grant_before_the_table_changes() {
    let journal = MemJournal::new(true);
    let executor = executor(&journal).await;
    let mut ctx = Session::new(1);
    journal.fail("injected");
    let Outcome::Reply(Response::Error { code, message }, _) =
        executor.execute(&mut ctx, 1, acquire("k"))
    else {
        panic!("refused at once");
    };
    assert_eq!(code, ErrorCode::Unavailable);
    assert!(message.contains("nothing changed"), "{message}");
    assert!(matches!(inspect(&executor, &mut ctx, "k"), Response::Free));
}

#[tokio::test]
async fn a_grant_lost_to_a_journal_failure_is_undone() {
    let journal = MemJournal::new(true);
    let executor = executor(&journal).await;
    let mut ctx = Session::new(1);
    let Outcome::Changed { ticket, undo, .. } = executor.execute(&mut ctx, 1, acquire("k")) else {
        panic!("a grant in full durability waits for its ticket");
    };
    assert!(matches!(
        inspect(&executor, &mut ctx, "k"),
        Response::Held { .. }
    ));
    assert!(matches!(
        settle(ticket, &journal.progress().borrow()),
        Settled::Waiting
    ));
    journal.fail("injected");
    let Settled::Lost(why) = settle(ticket, &journal.progress().borrow()) else {
        panic!("lost");
    };
    let answer = answer_lost(&executor, &mut ctx, Some(undo), &why);
    let Response::Error { message, .. } = answer else {
        panic!("an error");
    };
    assert!(message.contains("nothing changed"), "{message}");
    assert!(matches!(inspect(&executor, &mut ctx, "k"), Response::Free));
}

#[tokio::test]
async fn a_durable_grant_settles_and_token_mode_logs_no_lease() {
    let full = MemJournal::new(true);
    let executor_full = executor(&full).await;
    let mut ctx = Session::new(1);
    let Outcome::Changed { ticket, .. } = executor_full.execute(&mut ctx, 1, acquire("k")) else {
        panic!("waits for its ticket");
    };
    full.make_durable();
    assert!(matches!(
        settle(ticket, &full.progress().borrow()),
        Settled::Durable
    ));

    let tokens_only = MemJournal::new(false);
    let executor = executor(&tokens_only).await;
    let logged_before = tokens_only.kept().len();
    let outcome = executor.execute(&mut ctx, 2, acquire("k"));
    assert!(matches!(
        outcome,
        Outcome::Reply(Response::Granted { .. }, 0)
    ));
    assert_eq!(tokens_only.kept().len(), logged_before, "only reservations");
}

#[test]
fn a_failed_mem_journal_never_becomes_durable() {
    let journal = MemJournal::new(true);
    let ticket = journal
        .append(&super::Change::Reserve { token_limit: 10 })
        .unwrap();
    journal.fail("injected");
    journal.make_durable();
    let progress = journal.progress().borrow().clone();
    assert!(progress.lsn < ticket, "lsn moved after the failure");
    assert!(matches!(settle(ticket, &progress), Settled::Lost(_)));
}

/// A release caught by a journal failure while its hand-off waits for fencing tokens: the
/// key has no holder but is kept for the waiter, so the lease cannot simply be put back.
/// Found by the executor simulation: the undo used to panic in `restore` (a poisoned shard
/// on a live server).
#[tokio::test]
async fn undo_of_a_release_whose_handoff_waits_for_tokens_does_not_panic() {
    let journal = MemJournal::new(true);
    let mut config = Config::for_tests(std::path::Path::new("/nonexistent"));
    config.token_block = 2;
    let as_journal: Arc<dyn Journal> = Arc::clone(&journal) as Arc<dyn Journal>;
    let executor = Arc::new(Executor::new(ExecutorParts::new(
        config,
        Clock::start(),
        as_journal,
        1,
    )));
    executor.tokens().reserve().await.unwrap();
    let mut holder = Session::new(1);
    let Outcome::Changed { response, .. } = executor.execute(&mut holder, 1, acquire("k")) else {
        panic!("granted");
    };
    let Response::Granted { lease_id, .. } = response else {
        panic!("granted");
    };
    let mut waiter = Session::new(2);
    let mut blocking = acquire("k");
    if let Request::Acquire { wait_ms, .. } = &mut blocking {
        *wait_ms = 60_000;
    }
    let Outcome::Wait { rx: _rx, .. } = executor.execute(&mut waiter, 1, blocking) else {
        panic!("queued");
    };
    // The last token goes to another key; no reservation runs before the release.
    let Outcome::Changed { .. } = executor.execute(&mut holder, 2, acquire("x")) else {
        panic!("granted");
    };
    journal.make_durable();
    let release = Request::Release {
        key: Bytes::from_static(b"k"),
        lease_id,
    };
    let Outcome::Changed { ticket, undo, .. } = executor.execute(&mut holder, 3, release) else {
        panic!("a release in full durability waits for its ticket");
    };
    journal.fail("injected");
    let Settled::Lost(why) = settle(ticket, &journal.progress().borrow()) else {
        panic!("lost");
    };
    let Response::Error { code, message } = answer_lost(&executor, &mut holder, Some(undo), &why)
    else {
        panic!("an error");
    };
    assert_eq!(code, ErrorCode::Unavailable);
    assert!(message.contains("may be lost"), "{message}");
    for shard in executor.shards() {
        shard.lock().expect("not poisoned").check_invariants();
    }
}

/// Acquires `key` (TTL 60 s) and returns the lease id, with its grant made durable.
async fn held(
    executor: &Arc<Executor>,
    journal: &MemJournal,
    key: &str,
) -> tenure_protocol::LeaseId {
    let mut ctx = Session::new(7);
    let response = match executor.execute(&mut ctx, 1, acquire(key)) {
        Outcome::Changed { response, .. } | Outcome::Reply(response, _) => response,
        _ => panic!("granted at once"),
    };
    let Response::Granted { lease_id, .. } = response else {
        panic!("granted, not {response:?}");
    };
    journal.make_durable();
    lease_id
}

/// RENEW of `key`'s lease to `ttl_ms`: the reply and the ticket it waits for.
fn renew(
    executor: &Arc<Executor>,
    key: &str,
    lease_id: tenure_protocol::LeaseId,
    ttl_ms: u32,
) -> (Response, super::Ticket) {
    let request = Request::Renew {
        key: Bytes::copy_from_slice(key.as_bytes()),
        lease_id,
        ttl_ms,
    };
    match executor.execute(&mut Session::new(8), 1, request) {
        Outcome::Reply(response, ticket) => (response, ticket),
        _ => panic!("RENEW answers with a reply"),
    }
}

fn last_record(journal: &MemJournal) -> Vec<u8> {
    journal.kept().last().expect("a record").record.clone()
}

#[tokio::test]
async fn a_renewal_longer_than_the_logged_ttl_is_logged_and_answered_once_durable() {
    let journal = MemJournal::new(true);
    let executor = executor(&journal).await;
    let lease_id = held(&executor, &journal, "k").await;
    let records = journal.kept().len();
    let renewed = |ttl_ms| Response::Renewed { ttl_ms };
    // The grant's TTL or less: not logged, answered at once.
    assert_eq!(
        renew(&executor, "k", lease_id, 60_000),
        (renewed(60_000), 0)
    );
    assert_eq!(
        renew(&executor, "k", lease_id, 30_000),
        (renewed(30_000), 0)
    );
    assert_eq!(journal.kept().len(), records);
    // Longer: a Renew record, and the reply waits for it.
    let (response, ticket) = renew(&executor, "k", lease_id, 120_000);
    assert_eq!(response, renewed(120_000));
    assert_eq!(ticket, journal.last_ticket());
    let record = last_record(&journal);
    let (decoded, _) = crate::wal::record::decode(&record).unwrap();
    let crate::wal::Record::Renew { key, ttl_ms, .. } = decoded else {
        panic!("a Renew record, not {decoded:?}");
    };
    assert_eq!((key, ttl_ms), (&b"k"[..], 120_000));
    assert!(matches!(
        settle(ticket, &journal.progress().borrow()),
        Settled::Waiting
    ));
    // Another renewal to that TTL, from anywhere, waits for the same record ...
    assert_eq!(
        renew(&executor, "k", lease_id, 90_000),
        (renewed(90_000), ticket)
    );
    journal.make_durable();
    // ... and once it is durable, no longer.
    assert_eq!(
        renew(&executor, "k", lease_id, 120_000),
        (renewed(120_000), 0)
    );
    assert_eq!(journal.kept().len(), records + 1);
    // A snapshot copies the lease with its logged TTL.
    journal.snapshot(&*executor);
    let snapshot = last_record(&journal);
    let (copy, _) = crate::wal::record::decode(&snapshot).unwrap();
    assert!(
        matches!(
            copy,
            crate::wal::Record::Grant {
                ttl_ms: 120_000,
                ..
            }
        ),
        "{copy:?}"
    );
}

#[tokio::test]
async fn a_longer_renewal_that_cannot_be_logged_changes_nothing() {
    let journal = MemJournal::new(true);
    let executor = executor(&journal).await;
    let lease_id = held(&executor, &journal, "k").await;
    journal.fail("injected");
    let (response, ticket) = renew(&executor, "k", lease_id, 120_000);
    let Response::Error { code, message } = response else {
        panic!("refused, not {response:?}");
    };
    assert_eq!((code, ticket), (ErrorCode::Unavailable, 0));
    assert!(message.contains("nothing changed"), "{message}");
    let Response::Held { ttl_left_ms, .. } = inspect(&executor, &mut Session::new(1), "k") else {
        panic!("still held");
    };
    assert!(
        ttl_left_ms <= 60_000,
        "the lease was extended: {ttl_left_ms} ms left"
    );
    // A renewal the log already covers still works.
    let renewed = Response::Renewed { ttl_ms: 60_000 };
    assert_eq!(renew(&executor, "k", lease_id, 60_000), (renewed, 0));
}

#[tokio::test]
async fn token_mode_logs_no_renewal() {
    let journal = MemJournal::new(false);
    let executor = executor(&journal).await;
    let lease_id = held(&executor, &journal, "k").await;
    let records = journal.kept().len();
    let renewed = Response::Renewed { ttl_ms: 120_000 };
    assert_eq!(
        renew(&executor, "k", lease_id, 120_000),
        (renewed.clone(), 0)
    );
    assert_eq!(renew(&executor, "k", lease_id, 120_000), (renewed, 0));
    assert_eq!(journal.kept().len(), records, "only reservations");
}

#[tokio::test(start_paused = true)]
async fn a_release_put_back_keeps_the_logged_ttl_of_its_lease() {
    let journal = MemJournal::new(true);
    let executor = executor(&journal).await;
    let lease_id = held(&executor, &journal, "k").await;
    let (_, ticket) = renew(&executor, "k", lease_id, 120_000);
    assert_ne!(ticket, 0, "logged");
    journal.make_durable();
    // Time passes: the lease has less left than either TTL when it is put back.
    tokio::time::advance(std::time::Duration::from_millis(10)).await;
    let mut ctx = Session::new(1);
    let release = Request::Release {
        key: Bytes::from_static(b"k"),
        lease_id,
    };
    let Outcome::Changed { ticket, undo, .. } = executor.execute(&mut ctx, 1, release) else {
        panic!("a release in full durability waits for its ticket");
    };
    journal.fail("injected");
    let Settled::Lost(why) = settle(ticket, &journal.progress().borrow()) else {
        panic!("lost");
    };
    let answer = answer_lost(&executor, &mut ctx, Some(undo), &why);
    assert!(
        matches!(answer, Response::Error { ref message, .. } if message.contains("nothing changed"))
    );
    // Both TTLs are durable: renewing to either needs no record the failed log cannot take.
    for ttl_ms in [60_000, 120_000] {
        let renewed = Response::Renewed { ttl_ms };
        assert_eq!(renew(&executor, "k", lease_id, ttl_ms), (renewed, 0));
    }
}

#[tokio::test]
async fn a_grant_lost_to_a_leadership_loss_is_undone_and_answered_not_leader() {
    let journal = MemJournal::new(true);
    let executor = executor(&journal).await;
    let mut ctx = Session::new(1);
    let Outcome::Changed { ticket, undo, .. } = executor.execute(&mut ctx, 1, acquire("k")) else {
        panic!("a grant in full durability waits for its ticket");
    };
    journal.fail(super::NOT_LEADER);
    let Settled::Lost(why) = settle(ticket, &journal.progress().borrow()) else {
        panic!("lost");
    };
    let Response::Error { code, message } = answer_lost(&executor, &mut ctx, Some(undo), &why)
    else {
        panic!("an error");
    };
    // The outcome is unknown (the entry may still commit), and a journal that does not
    // know the leader (MemJournal names none) says so.
    assert_eq!(code, ErrorCode::NotLeader);
    assert!(
        message.starts_with("the outcome is unknown: ") && message.ends_with("; leader=unknown"),
        "{message}"
    );
    assert!(matches!(inspect(&executor, &mut ctx, "k"), Response::Free));
}

#[tokio::test]
async fn a_read_never_shows_a_change_its_ticket_does_not_cover() {
    let journal = MemJournal::new(true);
    let executor = executor(&journal).await;
    let mut ctx = Session::new(1);
    // Another connection's grant lands between a read's ticket and its reply.
    let other = Arc::clone(&executor);
    journal.confirm_then(move || {
        let _ = other.execute(&mut Session::new(2), 1, acquire("k"));
    });
    let request = Request::Inspect {
        key: Bytes::from_static(b"k"),
        kinds: Default::default(),
    };
    let Outcome::Reply(response, ticket) = executor.execute(&mut ctx, 1, request) else {
        panic!("INSPECT answers with a reply");
    };
    let grant = journal.last_ticket();
    assert!(
        matches!(response, Response::Free) || ticket >= grant,
        "{response:?} answered at ticket {ticket}, the grant it shows is at {grant}"
    );
}

/// A waiter handed a lock by an expiry just after its node lost the leadership: the grant
/// cannot be committed, so it is undone and the waiter told `NOT_LEADER`, as every refusal
/// of a deposed leader is (PROTOCOL.md 3.8), not UNAVAILABLE "not durable".
#[tokio::test(start_paused = true)]
async fn a_handoff_refused_by_a_deposed_leader_is_answered_not_leader() {
    let journal = MemJournal::new(true);
    let executor = executor(&journal).await;
    let mut holder = Session::new(1);
    let mut short = acquire("k");
    if let Request::Acquire { ttl_ms, .. } = &mut short {
        *ttl_ms = 100;
    }
    let Outcome::Changed { .. } = executor.execute(&mut holder, 1, short) else {
        panic!("granted");
    };
    journal.make_durable();
    let mut blocking = acquire("k");
    if let Request::Acquire { wait_ms, .. } = &mut blocking {
        *wait_ms = 60_000;
    }
    let mut waiter = Session::new(2);
    let Outcome::Wait { mut rx, .. } = executor.execute(&mut waiter, 1, blocking) else {
        panic!("queued");
    };
    journal.fail(super::NOT_LEADER);
    tokio::time::advance(std::time::Duration::from_millis(200)).await;
    let now_ms = executor.clock().now_ms();
    let mut events = Vec::new();
    for shard in executor.shards() {
        let mut shard = shard.lock().expect("shard poisoned");
        shard.advance(now_ms, 1_000, &executor.tokens().allocator, &mut events);
        executor.apply_events(&mut shard, now_ms, &mut events);
    }
    match rx.try_recv() {
        Ok(WaitResult::Failed(code, message)) => {
            assert_eq!(
                (code, message.as_str()),
                (ErrorCode::NotLeader, "leader=unknown")
            );
        }
        other => panic!("{other:?}"),
    }
}
