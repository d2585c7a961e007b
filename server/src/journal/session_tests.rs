//! Sessions through the journal (PROTOCOL.md 3.11): an open session and its leases come
//! back after a restart (the journal's records replayed into a new executor, as WAL recovery
//! or a new cluster leader builds it) and after a snapshot, with the same ids and tokens and
//! a full TTL from the restart; an ended one stays ended; an open that never became durable
//! is taken back.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tenure_protocol::{ErrorCode, LeaseId, Request, Response, SessionId};

use super::mem::MemJournal;
use super::{settle, Journal, Settled};
use crate::clock::Clock;
use crate::config::Config;
use crate::executor::{answer_lost, Executor, ExecutorParts, Outcome, Session};
use crate::record::{self, LeaseReplay, Record};

async fn executor(journal: &Arc<MemJournal>, token_floor: u64) -> Arc<Executor> {
    executor_with(journal, token_floor, 3_600_000).await
}

/// [`executor`] with this `--ttl-max-ms`.
async fn executor_with(
    journal: &Arc<MemJournal>,
    token_floor: u64,
    ttl_ms_max: u32,
) -> Arc<Executor> {
    let mut config = Config::for_tests(std::path::Path::new("/nonexistent"));
    config.ttl_ms_max = ttl_ms_max;
    let journal: Arc<dyn Journal> = Arc::clone(journal) as Arc<dyn Journal>;
    let parts = ExecutorParts::new(config, Clock::start(), journal, token_floor);
    let executor = Arc::new(Executor::new(parts));
    executor.tokens().reserve().await.unwrap();
    executor
}

fn run(executor: &Arc<Executor>, request: Request) -> Response {
    match executor.execute(&mut Session::new(1), 1, request) {
        Outcome::Reply(response, _) | Outcome::Changed { response, .. } => response,
        _ => panic!("answered at once"),
    }
}

fn open(executor: &Arc<Executor>, ttl_ms: u32) -> SessionId {
    match run(
        executor,
        Request::SessionOpen {
            ttl_ms,
            session_id: None,
        },
    ) {
        Response::Session { session_id, .. } => session_id,
        other => panic!("a session, not {other:?}"),
    }
}

fn acquire_in(executor: &Arc<Executor>, key: &str, id: SessionId) -> (u64, LeaseId) {
    let request = Request::Acquire {
        key: Bytes::copy_from_slice(key.as_bytes()),
        ttl_ms: 1_000,
        wait_ms: 0,
        release_on_disconnect: false,
        meta: Bytes::from_static(b"m"),
        acquire_id: None,
        kind: Default::default(),
        session_id: Some(id),
    };
    match run(executor, request) {
        Response::Granted {
            token, lease_id, ..
        } => (token, lease_id),
        other => panic!("granted, not {other:?}"),
    }
}

fn token_held(executor: &Arc<Executor>, key: &str) -> Option<(u64, u32)> {
    let key = Bytes::copy_from_slice(key.as_bytes());
    match run(executor, Request::Inspect { key, kinds: false }) {
        Response::Held {
            token, ttl_left_ms, ..
        } => Some((token, ttl_left_ms)),
        Response::Free => None,
        other => panic!("held or free, not {other:?}"),
    }
}

/// A new executor from everything `journal` kept.
async fn restarted(journal: &MemJournal) -> (Arc<Executor>, Arc<MemJournal>) {
    let records: Vec<Vec<u8>> = journal.kept().into_iter().map(|k| k.record).collect();
    restarted_from(&records).await
}

/// A new executor from these records, as WAL recovery or a new cluster leader builds it.
async fn restarted_from(records: &[Vec<u8>]) -> (Arc<Executor>, Arc<MemJournal>) {
    restarted_with(records, 3_600_000).await
}

/// [`restarted_from`] with this `--ttl-max-ms`.
async fn restarted_with(records: &[Vec<u8>], ttl_ms_max: u32) -> (Arc<Executor>, Arc<MemJournal>) {
    let mut replay = LeaseReplay::default();
    for bytes in records {
        let (record, _) = record::decode(bytes).unwrap();
        replay.apply(&record);
    }
    let fresh = MemJournal::new(true);
    let executor = executor_with(&fresh, replay.token_floor, ttl_ms_max).await;
    let now_ms = executor.clock().now_ms();
    executor.restore_sessions(now_ms, replay.to_sessions());
    executor.restore(now_ms, replay.to_recovered());
    (executor, fresh)
}

fn keep(executor: &Arc<Executor>, session_id: SessionId) -> Response {
    run(executor, Request::SessionKeepalive { session_id })
}

#[tokio::test(start_paused = true)]
async fn a_session_and_its_leases_survive_a_restart_and_a_snapshot() {
    let journal = MemJournal::new(true);
    let first = executor(&journal, 1).await;
    let id = open(&first, 10_000);
    let leases: Vec<_> = ["a", "b", "c"]
        .iter()
        .map(|key| acquire_in(&first, key, id))
        .collect();
    journal.make_durable();
    // Most of the session's TTL runs out before the crash: the restart counts it again.
    tokio::time::advance(Duration::from_millis(9_000)).await;
    let (second, fresh) = restarted(&journal).await;
    for (key, (token, _)) in ["a", "b", "c"].iter().zip(&leases) {
        let (held, ttl_left_ms) = token_held(&second, key).expect("held");
        assert_eq!(held, *token);
        assert!(ttl_left_ms > 9_000, "a full TTL from the restart");
    }
    assert!(matches!(keep(&second, id), Response::Session { .. }));
    // A plain RENEW of one is still refused: it is the session's.
    let (key, lease_id) = (Bytes::from_static(b"a"), leases[0].1);
    let renew = Request::Renew {
        key,
        lease_id,
        ttl_ms: 1_000,
    };
    assert!(matches!(
        run(&second, renew),
        Response::Error {
            code: ErrorCode::SessionLease,
            ..
        }
    ));
    // A snapshot of the restarted server (sessions copied before their grants) alone
    // brings them back again.
    fresh.snapshot(&*second);
    let kinds: Vec<u8> = fresh.kept().iter().map(|k| k.record[8]).collect();
    let first_open = kinds
        .iter()
        .position(|&t| t == 7)
        .expect("the session copied");
    let first_grant = kinds
        .iter()
        .position(|&t| t == 2)
        .expect("the grants copied");
    assert!(first_open < first_grant, "{kinds:?}");
    let (third, _) = restarted(&fresh).await;
    let closed = run(&third, Request::SessionClose { session_id: id });
    assert_eq!(closed, Response::SessionClosed { released: 3 });
    for key in ["a", "b", "c"] {
        assert_eq!(token_held(&third, key), None);
    }
}

#[tokio::test(start_paused = true)]
async fn a_restored_session_not_kept_alive_expires_a_ttl_after_the_restart() {
    let journal = MemJournal::new(true);
    let first = executor(&journal, 1).await;
    let id = open(&first, 1_000);
    acquire_in(&first, "a", id);
    journal.make_durable();
    // The crash comes just before the session's deadline; the restart counts it again.
    tokio::time::advance(Duration::from_millis(990)).await;
    let (second, _) = restarted(&journal).await;
    tokio::time::advance(Duration::from_millis(990)).await;
    assert!(token_held(&second, "a").is_some(), "not before its TTL");
    tokio::time::advance(Duration::from_millis(20)).await;
    assert!(matches!(
        keep(&second, id),
        Response::Error {
            code: ErrorCode::NoSession,
            ..
        }
    ));
    assert_eq!(token_held(&second, "a"), None);
}

#[tokio::test]
async fn an_ended_session_stays_ended_and_its_leases_with_it() {
    let journal = MemJournal::new(true);
    let first = executor(&journal, 1).await;
    let closed = open(&first, 60_000);
    acquire_in(&first, "a", closed);
    let live = open(&first, 60_000);
    let (token, _) = acquire_in(&first, "b", live);
    run(&first, Request::SessionClose { session_id: closed });
    journal.make_durable();
    let (second, _) = restarted(&journal).await;
    assert!(matches!(
        keep(&second, closed),
        Response::Error {
            code: ErrorCode::NoSession,
            ..
        }
    ));
    assert_eq!(token_held(&second, "a"), None);
    assert_eq!(token_held(&second, "b").map(|h| h.0), Some(token));
    // A crash between a session's end and its leases' frees: the grants stay in the log,
    // yet recovery drops them with their session.
    let kept: Vec<_> = journal.kept();
    let end_at = kept
        .iter()
        .position(|k| k.record[8] == 9)
        .expect("a SessionEnd record");
    let cut: Vec<Vec<u8>> = kept[..=end_at].iter().map(|k| k.record.clone()).collect();
    let (third, _) = restarted_from(&cut).await;
    assert_eq!(token_held(&third, "a"), None);
    assert!(matches!(keep(&third, live), Response::Session { .. }));
}

/// SESSION_OPEN with a session id, run and answered.
fn open_as(executor: &Arc<Executor>, ttl_ms: u32, id: SessionId) -> Response {
    let session_id = Some(id);
    run(executor, Request::SessionOpen { ttl_ms, session_id })
}

/// An open sent again with its session id (its answer lost) finds the session the first send
/// opened, with its leases, also after a restart (WAL recovery, or a new cluster leader), and
/// opens no second one; once the session has ended, a repeat hears so.
#[tokio::test(start_paused = true)]
async fn an_open_sent_again_with_its_session_id_finds_its_session_after_a_restart() {
    let journal = MemJournal::new(true);
    let first = executor(&journal, 1).await;
    let id = SessionId::from_u128(0x5e55_1011);
    let opened = Response::Session {
        session_id: id,
        ttl_ms: 5_000,
    };
    assert_eq!(open_as(&first, 5_000, id), opened);
    let (token, _) = acquire_in(&first, "a", id);
    assert_eq!(open_as(&first, 5_000, id), opened);
    assert_eq!(first.sessions().counts(), (1, 1));
    journal.make_durable();
    let (second, _) = restarted(&journal).await;
    assert_eq!(open_as(&second, 5_000, id), opened);
    assert_eq!(second.sessions().counts(), (1, 1));
    assert_eq!(token_held(&second, "a").map(|h| h.0), Some(token));
    // A restart that lowered `--ttl-max-ms` under the session's TTL refuses new opens of
    // that TTL, not the session's repeat (outside test a60, F3).
    let records: Vec<Vec<u8>> = journal.kept().into_iter().map(|k| k.record).collect();
    let (lowered, _) = restarted_with(&records, 4_000).await;
    assert_eq!(open_as(&lowered, 5_000, id), opened);
    let other = SessionId::from_u128(0x0de1);
    assert!(matches!(
        open_as(&lowered, 5_000, other),
        Response::Error {
            code: ErrorCode::BadTtl,
            ..
        }
    ));
    // Another TTL is not this session's open.
    assert!(matches!(
        open_as(&second, 6_000, id),
        Response::Error {
            code: ErrorCode::SessionMismatch,
            ..
        }
    ));
    // Ended (by the clock, before the ticker's pass): a repeat is told, nothing opens.
    tokio::time::advance(Duration::from_millis(5_001)).await;
    let ended = open_as(&second, 5_000, id);
    assert!(
        matches!(&ended, Response::Error { code: ErrorCode::NoSession, message }
            if message.contains("has ended")),
        "{ended:?}"
    );
    assert_eq!(token_held(&second, "a"), None);
}

/// A repeat of an open whose record is not durable yet waits for that record, and is lost
/// with it.
#[tokio::test]
async fn a_repeat_of_an_open_not_durable_yet_waits_for_its_record() {
    let journal = MemJournal::new(true);
    let executor = executor(&journal, 1).await;
    let open = Request::SessionOpen {
        ttl_ms: 5_000,
        session_id: Some(SessionId::from_u128(0x5e55)),
    };
    let Outcome::Changed { ticket, .. } = executor.execute(&mut Session::new(1), 1, open.clone())
    else {
        panic!("an open waits for its record");
    };
    let Outcome::Reply(Response::Session { .. }, repeat) =
        executor.execute(&mut Session::new(2), 1, open)
    else {
        panic!("a repeat is answered with the session");
    };
    assert_eq!(repeat, ticket);
    assert!(matches!(
        settle(repeat, &journal.progress().borrow()),
        Settled::Waiting
    ));
    journal.fail("injected");
    assert!(matches!(
        settle(repeat, &journal.progress().borrow()),
        Settled::Lost(_)
    ));
}

#[tokio::test]
async fn an_open_that_never_became_durable_is_taken_back() {
    let journal = MemJournal::new(true);
    let executor = executor(&journal, 1).await;
    let Outcome::Changed { ticket, undo, .. } = executor.execute(
        &mut Session::new(1),
        1,
        Request::SessionOpen {
            ttl_ms: 5_000,
            session_id: None,
        },
    ) else {
        panic!("an open waits for its record");
    };
    let Some(Record::SessionOpen { session_id, .. }) = journal
        .kept()
        .last()
        .map(|k| record::decode(&k.record).unwrap().0)
    else {
        panic!("the open was logged");
    };
    let id = SessionId(session_id);
    assert!(matches!(keep(&executor, id), Response::Session { .. }));
    journal.fail("injected");
    let Settled::Lost(why) = settle(ticket, &journal.progress().borrow()) else {
        panic!("lost");
    };
    let answer = answer_lost(&executor, &mut Session::new(1), Some(undo), &why);
    assert!(matches!(
        answer,
        Response::Error {
            code: ErrorCode::Unavailable,
            ..
        }
    ));
    assert_eq!(executor.sessions().counts(), (0, 0));
}

#[tokio::test]
async fn a_repeat_of_a_lease_whose_session_was_closed_hears_its_session_ended() {
    let journal = MemJournal::new(true);
    let executor = executor(&journal, 1).await;
    let id = open(&executor, 60_000);
    let acquire = lock_k(1_000, 0, Some(7), Some(id));
    let token = match run(&executor, acquire.clone()) {
        Response::Granted { token, .. } => token,
        other => panic!("granted, not {other:?}"),
    };
    journal.make_durable();
    run(&executor, Request::SessionClose { session_id: id });
    // Not "released": the client did not release it, its session's end freed it.
    assert_eq!(
        run(&executor, acquire),
        Response::AcquireEnded {
            how: tenure_protocol::EndedHow::Session,
            token
        }
    );
    // Logged with its own reason, and the log still replays.
    let frees: Vec<_> = journal
        .kept()
        .into_iter()
        .filter_map(|k| match record::decode(&k.record).unwrap().0 {
            Record::Free {
                token: t, reason, ..
            } => Some((t, reason)),
            _ => None,
        })
        .collect();
    assert_eq!(frees, vec![(token, record::FreeReason::Session)]);
    let (again, _) = restarted(&journal).await;
    assert_eq!(token_held(&again, "k"), None);
}

#[tokio::test(start_paused = true)]
async fn a_repeat_of_a_lease_whose_session_expired_hears_its_session_ended() {
    let journal = MemJournal::new(true);
    let executor = executor(&journal, 1).await;
    let id = open(&executor, 100);
    let acquire = lock_k(1_000, 0, Some(8), Some(id));
    let token = match run(&executor, acquire.clone()) {
        Response::Granted { token, .. } => token,
        other => panic!("granted, not {other:?}"),
    };
    journal.make_durable();
    // Past the session's deadline, before any ticker: not "no session", not "expired".
    tokio::time::advance(Duration::from_millis(150)).await;
    assert_eq!(
        run(&executor, acquire),
        Response::AcquireEnded {
            how: tenure_protocol::EndedHow::Session,
            token
        }
    );
}

/// An ACQUIRE of the plain lock "k" without metadata.
fn lock_k(
    ttl_ms: u32,
    wait_ms: u32,
    acquire_id: Option<u128>,
    session_id: Option<SessionId>,
) -> Request {
    Request::Acquire {
        key: Bytes::from_static(b"k"),
        ttl_ms,
        wait_ms,
        release_on_disconnect: false,
        meta: Bytes::new(),
        acquire_id: acquire_id.map(tenure_protocol::AcquireId::from_u128),
        kind: Default::default(),
        session_id,
    }
}

#[tokio::test(start_paused = true)]
async fn a_waiter_whose_session_ended_before_its_turn_answers_no_repeat() {
    let journal = MemJournal::new(true);
    let executor = executor(&journal, 1).await;
    let id = open(&executor, 100);
    let key = Bytes::from_static(b"k");
    let holder = lock_k(10_000, 0, None, None);
    let Response::Granted { lease_id, .. } = run(&executor, holder) else {
        panic!("granted")
    };
    let waiter = lock_k(0, 10_000, Some(9), Some(id));
    let Outcome::Wait { mut rx, .. } = executor.execute(&mut Session::new(1), 2, waiter.clone())
    else {
        panic!("queued")
    };
    journal.make_durable();
    // The session ends while it waits; then the holder lets go and the key is handed on.
    tokio::time::advance(Duration::from_millis(150)).await;
    run(
        &executor,
        Request::Release {
            key: key.clone(),
            lease_id,
        },
    );
    // The table skips it (its session has ended by the clock) and drops its slot, which its
    // connection answers NO_SESSION: no grant was made for it, and the key is free.
    assert!(matches!(
        rx.try_recv(),
        Err(tokio::sync::oneshot::error::TryRecvError::Closed)
    ));
    assert_eq!(token_held(&executor, "k"), None);
    // Its client heard NO_SESSION, never of the grant: a retry hears the same, not how a
    // grant it never had ended.
    assert!(matches!(
        run(&executor, waiter),
        Response::Error {
            code: ErrorCode::NoSession,
            ..
        }
    ));
}

/// Holds "k", queues `waiting` on `conn` (its wait noted, as its connection notes it) and
/// releases the holder: the grant the waiter was handed, not taken up yet, its ticket (made
/// durable) and the waiter's id.
fn handed_k(
    executor: &Arc<Executor>,
    journal: &MemJournal,
    conn: &mut Session,
    waiting: Request,
) -> (crate::table::Grant, super::Ticket, u64) {
    let key = Bytes::from_static(b"k");
    let Response::Granted { lease_id, .. } = run(executor, lock_k(10_000, 0, None, None)) else {
        panic!("granted")
    };
    let Request::Acquire { session_id, .. } = &waiting else {
        unreachable!("an ACQUIRE")
    };
    let session_id = *session_id;
    let Outcome::Wait {
        mut rx, waiter_id, ..
    } = executor.execute(conn, 2, waiting)
    else {
        panic!("queued")
    };
    conn.add_wait(2, key.clone(), waiter_id, session_id);
    journal.make_durable();
    run(executor, Request::Release { key, lease_id });
    let Ok(crate::executor::WaitResult::Granted { grant, ticket, .. }) = rx.try_recv() else {
        panic!("handed the key")
    };
    journal.make_durable();
    (grant, ticket, waiter_id)
}

#[tokio::test(start_paused = true)]
async fn a_hand_off_that_meets_its_sessions_close_is_freed_and_answered_no_session() {
    let journal = MemJournal::new(true);
    let executor = executor(&journal, 1).await;
    let id = open(&executor, 10_000);
    let key = Bytes::from_static(b"k");
    let mut conn = Session::new(1);
    let waiting = lock_k(0, 10_000, None, Some(id));
    let (grant, ticket, waiter_id) = handed_k(&executor, &journal, &mut conn, waiting);
    // Handed the key, and the session closes before its connection joins it to the session.
    assert_eq!(
        run(&executor, Request::SessionClose { session_id: id }),
        Response::SessionClosed { released: 0 }
    );
    let joined = executor.join_session(&conn, (id, waiter_id), &key, grant, ticket);
    assert_eq!(joined.err().map(|e| e.0), Some(ErrorCode::NoSession));
    assert_eq!(token_held(&executor, "k"), None);
}

/// A session's waiter with an acquire id is handed its key, and its connection ends before
/// taking the grant up (outside test a30, finding F1: the lease stayed out of its session,
/// a repeat naming the session was SESSION_MISMATCH "in no session", its close freed
/// nothing and the key stayed held for the session's TTL). A repeat in between is answered
/// with the grant; the connection's end joins the lease to its session, whose close frees it.
#[tokio::test(start_paused = true)]
async fn a_hand_off_its_connection_never_took_up_joins_its_session() {
    let journal = MemJournal::new(true);
    let executor = executor(&journal, 1).await;
    let id = open(&executor, 10_000);
    let key = Bytes::from_static(b"k");
    let mut conn = Session::new(7);
    let waiting = lock_k(0, 10_000, Some(9), Some(id));
    let (grant, ticket, waiter_id) = handed_k(&executor, &journal, &mut conn, waiting);
    // The client retries on another connection before the first one's end is seen.
    let Response::Regranted { token, .. } = run(&executor, lock_k(0, 10_000, Some(9), Some(id)))
    else {
        panic!("the repeat was not answered with the grant")
    };
    assert_eq!(token, grant.token);
    // The first connection ends, its grant never sent.
    conn.disconnect(&executor);
    let session = Some((id, waiter_id));
    executor.undelivered_hand_off(&conn, &key, (grant, ticket), session, false);
    assert_eq!(
        run(&executor, Request::SessionClose { session_id: id }),
        Response::SessionClosed { released: 1 }
    );
    assert_eq!(token_held(&executor, "k"), None);
}

/// A waiter's hand-off its connection never took up, without an acquire id (nobody can
/// ever name its lease) or with release on disconnect, is freed at once.
#[tokio::test(start_paused = true)]
async fn a_hand_off_nobody_can_name_is_freed_when_its_connection_ends() {
    let journal = MemJournal::new(true);
    let executor = executor(&journal, 1).await;
    for (acquire_id, release_on_disconnect) in [(None, false), (Some(5), true)] {
        let key = Bytes::from_static(b"k");
        let mut conn = Session::new(7);
        let mut waiting = lock_k(10_000, 10_000, acquire_id, None);
        if let Request::Acquire {
            release_on_disconnect: flag,
            ..
        } = &mut waiting
        {
            *flag = release_on_disconnect;
        }
        let (grant, ticket, _) = handed_k(&executor, &journal, &mut conn, waiting);
        assert!(token_held(&executor, "k").is_some());
        conn.disconnect(&executor);
        let granted = (grant, ticket);
        executor.undelivered_hand_off(&conn, &key, granted, None, release_on_disconnect);
        assert_eq!(token_held(&executor, "k"), None, "{acquire_id:?}");
    }
}

/// An ACQUIRE of `count` permits of 2 on "s", in session `session` or not, waiting 10 s.
fn permits(count: u32, session: Option<SessionId>, wait_ms: u32) -> Request {
    Request::Acquire {
        key: Bytes::from_static(b"s"),
        ttl_ms: if session.is_some() { 0 } else { 10_000 },
        wait_ms,
        release_on_disconnect: false,
        meta: Bytes::new(),
        acquire_id: None,
        kind: tenure_protocol::LeaseKind::Permits { count, limit: 2 },
        session_id: session,
    }
}

/// A semaphore of 2 with one permit held; a session's ACQUIRE of 2 at the head of the line,
/// and behind it a plain ACQUIRE of 1 that fits but waits its turn (strict FIFO).
async fn semaphore_behind_a_session_waiter(
    session_ttl_ms: u32,
) -> (
    Arc<Executor>,
    SessionId,
    tokio::sync::oneshot::Receiver<crate::executor::WaitResult>,
    tokio::sync::oneshot::Receiver<crate::executor::WaitResult>,
) {
    let journal = MemJournal::new(true);
    let executor = executor(&journal, 1).await;
    let id = open(&executor, session_ttl_ms);
    assert!(matches!(
        run(&executor, permits(1, None, 0)),
        Response::Granted { .. }
    ));
    let queue = |request, n| match executor.execute(&mut Session::new(n), n, request) {
        Outcome::Wait { rx, .. } => rx,
        _ => panic!("queued"),
    };
    let in_session = queue(permits(2, Some(id), 10_000), 2);
    let later = queue(permits(1, None, 10_000), 3);
    journal.make_durable();
    (executor, id, in_session, later)
}

#[tokio::test(start_paused = true)]
async fn a_close_takes_the_sessions_waiters_out_of_line_and_serves_the_queue_again() {
    let (executor, id, mut in_session, mut later) = semaphore_behind_a_session_waiter(10_000).await;
    assert!(later.try_recv().is_err(), "FIFO: it waits behind the head");
    assert_eq!(
        run(&executor, Request::SessionClose { session_id: id }),
        Response::SessionClosed { released: 0 }
    );
    // At once, not when the later waiter's wait or the session waiter's would run out.
    assert!(matches!(
        in_session.try_recv(),
        Ok(crate::executor::WaitResult::Failed(ErrorCode::NoSession, _))
    ));
    assert!(matches!(
        later.try_recv(),
        Ok(crate::executor::WaitResult::Granted { .. })
    ));
    assert_eq!(executor.sessions().lock().waiters_len(), 0);
}

#[tokio::test(start_paused = true)]
async fn an_expiry_takes_the_sessions_waiters_out_of_line_and_serves_the_queue_again() {
    let (executor, _, mut in_session, mut later) = semaphore_behind_a_session_waiter(100).await;
    tokio::time::advance(Duration::from_millis(150)).await;
    // The ticker's pass over the sessions.
    executor.reap_sessions(executor.clock().now_ms());
    assert!(matches!(
        in_session.try_recv(),
        Ok(crate::executor::WaitResult::Failed(ErrorCode::NoSession, _))
    ));
    assert!(matches!(
        later.try_recv(),
        Ok(crate::executor::WaitResult::Granted { .. })
    ));
}

#[tokio::test(start_paused = true)]
async fn a_waiting_acquire_counts_against_the_sessions_leases_limit() {
    let journal = MemJournal::new(true);
    let mut config = Config::for_tests(std::path::Path::new("/nonexistent"));
    config.session_leases_max = 2;
    let dyn_journal: Arc<dyn Journal> = Arc::clone(&journal) as Arc<dyn Journal>;
    let executor = Arc::new(Executor::new(ExecutorParts::new(
        config,
        Clock::start(),
        dyn_journal,
        1,
    )));
    executor.tokens().reserve().await.unwrap();
    let id = open(&executor, 10_000);
    // One permit held in the session, one ACQUIRE of it waiting: the limit of 2 is full.
    assert!(matches!(
        run(&executor, permits(2, Some(id), 0)),
        Response::Granted { .. }
    ));
    let Outcome::Wait { rx, .. } =
        executor.execute(&mut Session::new(2), 2, permits(1, Some(id), 10_000))
    else {
        panic!("queued")
    };
    match run(&executor, permits(1, Some(id), 10_000)) {
        Response::Error { code, .. } => assert_eq!(code, ErrorCode::SessionLeasesLimit),
        other => panic!("refused, not {other:?}"),
    }
    drop(rx);
}
