//! Sessions end to end (PROTOCOL.md 3.11), over the console on a server in this process with
//! a paused clock: one keep-alive keeps every lease of a session, a session's end frees
//! them all (each watcher sees it), a keep-alive after the deadline revives nothing, and
//! RENEW of a session lease is refused.

use std::time::Duration;

use tenure_testkit::server::Heartbeat;
use tenure_testkit::{field, token, Console, Server};

/// A server reading an identities file with `identities`: (name, secret, the rest of its
/// TOML table: prefixes, quotas).
async fn with_identities(dir: &std::path::Path, identities: &[(&str, &str, &str)]) -> Server {
    let path = dir.join("identities.toml");
    let mut text = String::new();
    for (name, secret, rest) in identities {
        let hash = tenure_server::identity::hash_secret(secret.as_bytes()).unwrap();
        text += &format!("[[identity]]\nname = \"{name}\"\nsecret-hash = \"{hash}\"\n{rest}\n\n");
    }
    std::fs::write(&path, text).unwrap();
    Server::start_in(dir, |config| config.identities = Some(path)).await
}

/// A console on `server` authenticated as `name`.
async fn authed(server: &Server, name: &str, secret: &str) -> Console {
    let mut c = Console::connect(server.addr).await;
    let ok = c.cmd(&format!("AUTH {name} {secret}")).await;
    assert_eq!(ok, format!("OK authenticated {name}"));
    c
}

/// Waits (a bounded while) until the server has `n` waiters in line.
async fn waiters(probe: &mut Console, n: u32) {
    for _ in 0..500 {
        if field(&probe.cmd("STATS").await, "waiters") == n.to_string() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("never {n} waiters");
}

async fn open(c: &mut Console, ttl_ms: u32) -> String {
    let reply = c.cmd(&format!("SESSION_OPEN {ttl_ms}")).await;
    assert!(reply.starts_with("OK session="), "{reply}");
    assert!(reply.ends_with(&format!(" ttl_ms={ttl_ms}")), "{reply}");
    field(&reply, "session").to_string()
}

#[tokio::test(start_paused = true)]
async fn one_keep_alive_keeps_every_lease_and_the_deadline_frees_them_all() {
    let _heartbeat = Heartbeat::start();
    let server = Server::start_virtual().await;
    let mut c = Console::connect(server.addr).await;
    let session = open(&mut c, 1000).await;
    let mut leases = Vec::new();
    for key in ["a", "b", "c"] {
        let grant = c.cmd(&format!("ACQUIRE {key} 0 SESSION={session}")).await;
        assert!(grant.starts_with("OK token="), "{grant}");
        leases.push(field(&grant, "lease").to_string());
    }
    let mut watcher = Console::connect(server.addr).await;
    assert!(watcher.cmd("WATCH b").await.starts_with("OK watching HELD"));
    // Kept alive three times across more than the TTL: every lease still holds.
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(600)).await;
        let kept = c.cmd(&format!("SESSION_KEEPALIVE {session}")).await;
        assert_eq!(kept, format!("OK session={session} ttl_ms=1000"));
    }
    for key in ["a", "b", "c"] {
        let held = c.cmd(&format!("INSPECT {key}")).await;
        assert!(held.starts_with("HELD"), "{key}: {held}");
    }
    // A session lease is not renewed alone.
    let renew = c.cmd(&format!("RENEW a {} 1000", leases[0])).await;
    assert!(renew.starts_with("ERR SESSION_LEASE"), "{renew}");
    // Missed: at the deadline every lease is free, the watcher told, and nothing revives it.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    for key in ["a", "b", "c"] {
        assert_eq!(c.cmd(&format!("INSPECT {key}")).await, "FREE", "{key}");
    }
    let event = watcher.line().await;
    assert!(event.starts_with("EVENT EXPIRED key=b"), "{event}");
    let late = c.cmd(&format!("SESSION_KEEPALIVE {session}")).await;
    assert!(late.starts_with("ERR NO_SESSION"), "{late}");
    let late = c.cmd(&format!("ACQUIRE a 0 SESSION={session}")).await;
    assert!(late.starts_with("ERR NO_SESSION"), "{late}");
    let stats = c.cmd("STATS").await;
    assert_eq!(field(&stats, "sessions"), "0", "{stats}");
    assert_eq!(field(&stats, "sessions_expired"), "1", "{stats}");
    server.stop().await;
}

#[tokio::test]
async fn close_frees_every_lease_at_once_and_counts_them() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path()).await;
    let mut c = Console::connect(server.addr).await;
    let session = open(&mut c, 60_000).await;
    let mut tokens = Vec::new();
    for key in ["x", "y"] {
        let grant = c.cmd(&format!("ACQUIRE {key} 0 SESSION={session}")).await;
        assert!(grant.starts_with("OK token="), "{grant}");
        tokens.push(token(&grant));
    }
    let mut other = Console::connect(server.addr).await;
    let locked = other.cmd("ACQUIRE x 1000").await;
    assert!(locked.starts_with("LOCKED"), "{locked}");
    let stats = c.cmd("STATS").await;
    assert_eq!(field(&stats, "session_leases"), "2", "{stats}");
    assert_eq!(
        c.cmd(&format!("SESSION_CLOSE {session}")).await,
        "OK released=2"
    );
    let grant = other.cmd("ACQUIRE x 1000").await;
    assert!(grant.starts_with("OK token="), "{grant}");
    assert!(token(&grant) > tokens[1], "tokens still rise: {grant}");
    assert_eq!(c.cmd("INSPECT y").await, "FREE");
    let again = c.cmd(&format!("SESSION_CLOSE {session}")).await;
    assert!(again.starts_with("ERR NO_SESSION"), "{again}");
    // Bad input: a TTL out of range, a session lease with a TTL, an id that is not hex.
    assert!(c.cmd("SESSION_OPEN 5").await.starts_with("ERR BAD_TTL"));
    let with_ttl = c.cmd(&format!("ACQUIRE z 1000 SESSION={session}")).await;
    assert!(with_ttl.starts_with("ERR BAD_TTL"), "{with_ttl}");
    let bad = c.cmd("SESSION_KEEPALIVE 123").await;
    assert!(bad.starts_with("ERR BAD_ARGS"), "{bad}");
    server.stop().await;
}

#[tokio::test]
async fn waiters_in_sessions_are_handed_the_keys_in_order_when_a_session_closes() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path()).await;
    let mut holder = Console::connect(server.addr).await;
    let held = open(&mut holder, 60_000).await;
    for key in ["p", "q"] {
        let grant = holder.cmd(&format!("ACQUIRE {key} 0 SESSION={held}")).await;
        assert!(grant.starts_with("OK token="), "{grant}");
    }
    // Two waiters for p, each in its own session, in this order (each queued before the
    // next is sent); one for q whose session is closed while it waits.
    let mut probe = Console::connect(server.addr).await;
    let mut first = Console::connect(server.addr).await;
    let s1 = open(&mut first, 60_000).await;
    first
        .send(&format!("ACQUIRE p 0 30000 SESSION={s1}\n"))
        .await;
    waiters(&mut probe, 1).await;
    let mut second = Console::connect(server.addr).await;
    let s2 = open(&mut second, 60_000).await;
    second
        .send(&format!("ACQUIRE p 0 30000 SESSION={s2}\n"))
        .await;
    waiters(&mut probe, 2).await;
    let mut gone = Console::connect(server.addr).await;
    let s3 = open(&mut gone, 60_000).await;
    gone.send(&format!("ACQUIRE q 0 30000 SESSION={s3}\n"))
        .await;
    waiters(&mut probe, 3).await;
    assert_eq!(
        probe.cmd(&format!("SESSION_CLOSE {s3}")).await,
        "OK released=0"
    );
    assert_eq!(
        holder.cmd(&format!("SESSION_CLOSE {held}")).await,
        "OK released=2"
    );
    let grant = first.line().await;
    assert!(grant.starts_with("OK token="), "first in line: {grant}");
    let refused = gone.line().await;
    assert!(refused.starts_with("ERR NO_SESSION"), "{refused}");
    // It says the session may not have ended: one within 10 ms of its end is skipped too,
    // and goes on (outside test a34, finding F3).
    assert!(refused.contains("or had under 10 ms left"), "{refused}");
    // q is free again: the grant its waiter's ended session was handed did not stay.
    assert_eq!(probe.cmd("INSPECT q").await, "FREE");
    // p is first's, in its session; closing that hands it to second.
    let stats = probe.cmd("STATS").await;
    assert_eq!(field(&stats, "session_leases"), "1", "{stats}");
    assert_eq!(
        first.cmd(&format!("SESSION_CLOSE {s1}")).await,
        "OK released=1"
    );
    let grant2 = second.line().await;
    assert!(grant2.starts_with("OK token="), "{grant2}");
    assert!(token(&grant2) > token(&grant));
    server.stop().await;
}

#[tokio::test]
async fn a_repeat_must_name_the_session_its_first_send_named() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path()).await;
    let mut c = Console::connect(server.addr).await;
    let session = open(&mut c, 60_000).await;
    let other = open(&mut c, 60_000).await;
    let id = "5e11c3a709d2446b8f310c7de295b81f";
    let first = c
        .cmd(&format!("ACQUIRE k 0 SESSION={session} ID={id}"))
        .await;
    assert!(first.starts_with("OK token="), "{first}");
    let again = c
        .cmd(&format!("ACQUIRE k 0 SESSION={session} ID={id}"))
        .await;
    assert!(again.ends_with(" repeat"), "{again}");
    assert_eq!(field(&again, "lease"), field(&first, "lease"));
    let elsewhere = c.cmd(&format!("ACQUIRE k 0 SESSION={other} ID={id}")).await;
    assert!(elsewhere.starts_with("ERR SESSION_MISMATCH"), "{elsewhere}");
    let without = c.cmd(&format!("ACQUIRE k 1000 ID={id}")).await;
    assert!(without.starts_with("ERR SESSION_MISMATCH"), "{without}");
    // Neither names the lease's session: its id would let the sender close it.
    for refusal in [&elsewhere, &without] {
        assert!(!refusal.contains(&session), "{refusal}");
    }
    // Nothing changed: the lease is still the session's.
    assert_eq!(
        c.cmd(&format!("SESSION_CLOSE {session}")).await,
        "OK released=1"
    );
    server.stop().await;
}

/// A repeat of acquire id `id` on `key` that queued behind its first send, the first naming
/// `first` (a session, or none: "") and the repeat `repeat`: what the repeat hears once its
/// wait runs out, the first send having been granted meanwhile.
async fn queued_repeat(server: &Server, key: &str, first: &str, repeat: &str) -> String {
    let id = "7a1e5b2c9d0f4e3a8b6c1d2e3f405162";
    // A session lease has no TTL of its own (0); a lease outside one has.
    let send = |session: &str, wait_ms: u32| match session {
        "" => format!("ACQUIRE {key} 30000 {wait_ms} ID={id}\n"),
        s => format!("ACQUIRE {key} 0 {wait_ms} ID={id} SESSION={s}\n"),
    };
    let mut holder = Console::connect(server.addr).await;
    let held = holder.cmd(&format!("ACQUIRE {key} 1500")).await;
    assert!(held.starts_with("OK token="), "{held}");
    let mut probe = Console::connect(server.addr).await;
    let before: u32 = field(&probe.cmd("STATS").await, "waiters").parse().unwrap();
    let mut c1 = Console::connect(server.addr).await;
    c1.send(&send(first, 5000)).await;
    waiters(&mut probe, before + 1).await;
    let mut c2 = Console::connect(server.addr).await;
    c2.send(&send(repeat, 3000)).await;
    waiters(&mut probe, before + 2).await;
    let granted = c1.line().await;
    assert!(
        granted.starts_with("OK token="),
        "the first send: {granted}"
    );
    c2.line().await
}

/// Outside test a34, finding F1: a repeat that waited in line behind its first send heard
/// REGRANTED with the first send's lease whatever session it named; it must name the
/// session that lease is in (or none), as a repeat that does not wait must (3.11).
#[tokio::test(start_paused = true)]
async fn a_repeat_that_waited_must_name_the_session_its_first_send_named() {
    let _heartbeat = Heartbeat::start();
    let server = Server::start_virtual().await;
    let mut c = Console::connect(server.addr).await;
    let s1 = open(&mut c, 60_000).await;
    let s2 = open(&mut c, 60_000).await;
    let cases = [
        ("in-s-none", s1.as_str(), "", false),
        ("in-s-other", s1.as_str(), s2.as_str(), false),
        ("none-in-s", "", s2.as_str(), false),
        ("in-s-same", s1.as_str(), s1.as_str(), true),
        ("none-none", "", "", true),
    ];
    for (key, first, repeat, same) in cases {
        let answer = queued_repeat(&server, key, first, repeat).await;
        if same {
            assert!(answer.ends_with(" repeat"), "{key}: {answer}");
        } else {
            assert!(
                answer.starts_with("ERR SESSION_MISMATCH"),
                "{key}: {answer}"
            );
            assert!(!answer.contains(&s1) && !answer.contains(&s2), "{answer}");
        }
    }
    // Nothing changed: each session holds the leases its first sends took.
    let released = c.cmd(&format!("SESSION_CLOSE {s1}")).await;
    assert_eq!(released, "OK released=3");
    server.stop().await;
}

/// How a repeat hears that its session lease ended, as PROTOCOL.md 3.11 says (outside test
/// a34, finding F4, found the page promising `how` 4 whatever the repeat named): after an
/// expiry, `session` when it names a session that is not live, `expired` when it names none
/// or a live one; after a close, `session` whatever it names. Never a new grant.
#[tokio::test(start_paused = true)]
async fn a_repeat_of_an_ended_session_lease_hears_how_it_ended() {
    let _heartbeat = Heartbeat::start();
    let server = Server::start_virtual().await;
    let mut c = Console::connect(server.addr).await;
    let live = open(&mut c, 60_000).await;
    let id = "0badcafe0badcafe0badcafe0badcafe";
    let repeats = |key: &str, session: &str| {
        [
            format!("ACQUIRE {key} 0 ID={id} SESSION={session}"),
            format!("ACQUIRE {key} 0 ID={id} SESSION={live}"),
            format!("ACQUIRE {key} 1000 ID={id}"),
        ]
    };
    let expiring = open(&mut c, 300).await;
    let first = c
        .cmd(&format!("ACQUIRE e 0 ID={id} SESSION={expiring}"))
        .await;
    let expired_token = token(&first);
    tokio::time::sleep(Duration::from_millis(600)).await;
    let mut heard = Vec::new();
    for repeat in repeats("e", &expiring) {
        heard.push(c.cmd(&repeat).await);
    }
    let ended = |how: &str| format!("ENDED {how} token={expired_token}");
    assert_eq!(
        heard,
        [ended("session"), ended("expired"), ended("expired")]
    );
    let closing = open(&mut c, 60_000).await;
    let first = c
        .cmd(&format!("ACQUIRE c 0 ID={id} SESSION={closing}"))
        .await;
    let closed_token = token(&first);
    assert_eq!(
        c.cmd(&format!("SESSION_CLOSE {closing}")).await,
        "OK released=1"
    );
    for repeat in repeats("c", &closing) {
        assert_eq!(
            c.cmd(&repeat).await,
            format!("ENDED session token={closed_token}")
        );
    }
    assert_eq!(c.cmd("INSPECT e").await, "FREE");
    assert_eq!(c.cmd("INSPECT c").await, "FREE");
    server.stop().await;
}

#[tokio::test(start_paused = true)]
async fn an_expired_session_hands_each_key_to_its_next_waiter_in_order() {
    let _heartbeat = Heartbeat::start();
    let server = Server::start_virtual().await;
    let mut holder = Console::connect(server.addr).await;
    let session = open(&mut holder, 500).await;
    let grant = holder.cmd(&format!("ACQUIRE k 0 SESSION={session}")).await;
    assert!(grant.starts_with("OK token="), "{grant}");
    let mut probe = Console::connect(server.addr).await;
    let mut plain = Console::connect(server.addr).await;
    plain.send("ACQUIRE k 10000 5000\n").await;
    waiters(&mut probe, 1).await;
    let mut later = Console::connect(server.addr).await;
    let theirs = open(&mut later, 60_000).await;
    later
        .send(&format!("ACQUIRE k 0 5000 SESSION={theirs}\n"))
        .await;
    waiters(&mut probe, 2).await;
    // A keep-alive just before the deadline keeps it; none after: it runs out.
    tokio::time::sleep(Duration::from_millis(450)).await;
    let kept = holder.cmd(&format!("SESSION_KEEPALIVE {session}")).await;
    assert!(kept.starts_with("OK session="), "{kept}");
    assert!(probe.cmd("INSPECT k").await.starts_with("HELD"));
    let first = plain.line().await;
    assert!(first.starts_with("OK token="), "the first waiter: {first}");
    assert!(token(&first) > token(&grant));
    let late = holder.cmd(&format!("SESSION_KEEPALIVE {session}")).await;
    assert!(late.starts_with("ERR NO_SESSION"), "{late}");
    let release = format!("RELEASE k {}", field(&first, "lease"));
    assert_eq!(plain.cmd(&release).await, "OK");
    let second = later.line().await;
    assert!(
        second.starts_with("OK token="),
        "the session's waiter: {second}"
    );
    assert!(token(&second) > token(&first));
    let stats = probe.cmd("STATS").await;
    assert_eq!(field(&stats, "session_leases"), "1", "{stats}");
    server.stop().await;
}

#[tokio::test]
async fn the_session_limits_refuse_one_more_and_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), |config| {
        config.sessions_max = 1;
        config.session_leases_max = 1;
    })
    .await;
    let mut c = Console::connect(server.addr).await;
    let session = open(&mut c, 60_000).await;
    let full = c.cmd("SESSION_OPEN 60000").await;
    assert!(full.starts_with("ERR SESSIONS_LIMIT"), "{full}");
    assert!(full.contains("--sessions-max"), "{full}");
    let grant = c.cmd(&format!("ACQUIRE a 0 SESSION={session}")).await;
    assert!(grant.starts_with("OK token="), "{grant}");
    let full = c.cmd(&format!("ACQUIRE b 0 SESSION={session}")).await;
    assert!(full.starts_with("ERR SESSION_LEASES_LIMIT"), "{full}");
    assert_eq!(c.cmd("INSPECT b").await, "FREE");
    assert_eq!(
        c.cmd(&format!("SESSION_CLOSE {session}")).await,
        "OK released=1"
    );
    // Its place is free again.
    open(&mut c, 60_000).await;
    server.stop().await;
}

/// Read leases and semaphore permits live in a session as plain session leases do (PROTOCOL.md
/// 3.11): kept past their TTL by keep-alives, each a lease of its own (a writer waits for
/// them all), the kind rules unchanged, and the session's expiry frees every one and hands
/// the key to the writer in line.
#[tokio::test(start_paused = true)]
async fn read_leases_and_permits_live_in_a_session_and_its_end_frees_them() {
    let _heartbeat = Heartbeat::start();
    let server = Server::start_virtual().await;
    let mut c = Console::connect(server.addr).await;
    let session = open(&mut c, 1000).await;
    for line in [
        format!("ACQUIRE rw 0 SESSION={session} SHARED"),
        format!("ACQUIRE rw 0 SESSION={session} SHARED"),
        format!("ACQUIRE sem 0 SESSION={session} PERMITS=2/3"),
    ] {
        let grant = c.cmd(&line).await;
        assert!(grant.starts_with("OK token="), "{line}: {grant}");
    }
    let mismatch = c.cmd(&format!("ACQUIRE sem 0 SESSION={session}")).await;
    assert!(mismatch.starts_with("ERR KIND_MISMATCH"), "{mismatch}");
    let full = c
        .cmd(&format!("ACQUIRE sem 0 SESSION={session} PERMITS=2/3"))
        .await;
    assert!(full.starts_with("LOCKED"), "{full}");
    // A writer waits for both readers; a third permit fits beside the session's two.
    let mut writer = Console::connect(server.addr).await;
    writer.send("ACQUIRE rw 60000 5000\n").await;
    let mut probe = Console::connect(server.addr).await;
    waiters(&mut probe, 1).await;
    let third = probe.cmd("ACQUIRE sem 5000 PERMITS=3").await;
    assert!(third.starts_with("OK token="), "{third}");
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(600)).await;
        let kept = c.cmd(&format!("SESSION_KEEPALIVE {session}")).await;
        assert_eq!(kept, format!("OK session={session} ttl_ms=1000"));
    }
    let kinds = probe.cmd("INSPECT rw KINDS").await;
    assert_eq!(field(&kinds, "holders"), "2", "{kinds}");
    let kinds = probe.cmd("INSPECT sem KINDS").await;
    assert_eq!(field(&kinds, "in_use"), "3", "{kinds}");
    // The session runs out: both read leases and the two permits end with it.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let granted = writer.line().await;
    assert!(granted.starts_with("OK token="), "{granted}");
    let kinds = probe.cmd("INSPECT sem KINDS").await;
    assert_eq!(field(&kinds, "in_use"), "1", "{kinds}");
    let ended = c.cmd(&format!("SESSION_KEEPALIVE {session}")).await;
    assert!(ended.starts_with("ERR NO_SESSION"), "{ended}");
}

/// An identity's `sessions-max` (README "Identities and permissions", PROTOCOL.md 3.11)
/// counts its live sessions over all its connections: one more is `SESSIONS_LIMIT` naming the
/// quota and the identity, another identity is not counted with it, and a closed or expired
/// session gives its place back.
#[tokio::test]
async fn an_identitys_sessions_max_counts_over_its_connections() {
    let dir = tempfile::tempdir().unwrap();
    let identities = [
        (
            "orders",
            "orders-secret",
            "prefixes = [\"orders/\"]\nsessions-max = 2",
        ),
        (
            "billing",
            "billing-secret",
            "prefixes = [\"billing/\"]\nsessions-max = 1",
        ),
    ];
    let server = with_identities(dir.path(), &identities).await;
    let a = &mut authed(&server, "orders", "orders-secret").await;
    let b = &mut authed(&server, "orders", "orders-secret").await;
    let billing = &mut authed(&server, "billing", "billing-secret").await;
    let first = open(a, 60_000).await;
    open(b, 100).await;
    let full = a.cmd("SESSION_OPEN 60000").await;
    assert!(
        full.starts_with("ERR SESSIONS_LIMIT sessions-max"),
        "{full}"
    );
    assert!(full.contains("`orders`"), "{full}");
    let full = b.cmd("SESSION_OPEN 60000").await;
    assert!(
        full.starts_with("ERR SESSIONS_LIMIT sessions-max"),
        "{full}"
    );
    // Billing's quota is its own.
    open(billing, 60_000).await;
    // The 100 ms session expires and gives its place back (the ticker reaps it).
    let mut reopened = false;
    for _ in 0..500 {
        tokio::time::sleep(Duration::from_millis(10)).await;
        let reply = b.cmd("SESSION_OPEN 60000").await;
        if reply.starts_with("OK session=") {
            reopened = true;
            break;
        }
        assert!(reply.starts_with("ERR SESSIONS_LIMIT"), "{reply}");
    }
    assert!(reopened, "an expired session never gave its place back");
    assert!(a
        .cmd("SESSION_OPEN 60000")
        .await
        .starts_with("ERR SESSIONS_LIMIT"));
    // A close gives one back at once.
    let closed = billing.cmd(&format!("SESSION_CLOSE {first}")).await;
    assert!(
        closed.starts_with("ERR NO_SESSION"),
        "another identity's: {closed}"
    );
    // Closed from the identity's other connection.
    assert_eq!(
        b.cmd(&format!("SESSION_CLOSE {first}")).await,
        "OK released=0"
    );
    open(a, 60_000).await;
    server.stop().await;
}

/// A session within the shortest lease TTL (10 ms) of its end takes no new lease: its ACQUIRE
/// is `NO_SESSION` (before, the table was asked for a lease of under 10 ms, whose assertion
/// panicked the connection's task while it held a shard's lock, poisoning it for everyone),
/// and nothing changed: the key is free, the server answers, and a keep-alive that arrives
/// in time still continues the session.
#[tokio::test(start_paused = true)]
async fn a_session_about_to_end_takes_no_new_lease_and_the_server_goes_on() {
    let _heartbeat = Heartbeat::start();
    let server = Server::start_virtual().await;
    let mut c = Console::connect(server.addr).await;
    let session = open(&mut c, 100).await;
    tokio::time::sleep(Duration::from_millis(95)).await;
    let late = c.cmd(&format!("ACQUIRE a 0 SESSION={session}")).await;
    assert!(late.starts_with("ERR NO_SESSION"), "{late}");
    assert!(late.contains("takes no new lease"), "{late}");
    assert_eq!(c.cmd("INSPECT a").await, "FREE");
    let kept = c.cmd(&format!("SESSION_KEEPALIVE {session}")).await;
    assert_eq!(kept, format!("OK session={session} ttl_ms=100"));
    let grant = c.cmd(&format!("ACQUIRE a 0 SESSION={session}")).await;
    assert!(grant.starts_with("OK token="), "{grant}");
    let mut other = Console::connect(server.addr).await;
    assert!(other.cmd("ACQUIRE b 1000").await.starts_with("OK token="));
    server.stop().await;
}

/// A session's waiting ACQUIRE leaves its queue when the session is closed (PROTOCOL.md
/// 3.11): it is answered `NO_SESSION` at once, and a later waiter on the semaphore that fits
/// beside the holder, held back by it only by FIFO order, gets its permit at once (not when
/// the session's waiter's own wait would have run out).
#[tokio::test]
async fn a_closed_sessions_waiter_leaves_the_line_and_the_next_waiter_gets_the_permits() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path()).await;
    let mut holder = Console::connect(server.addr).await;
    let held = holder.cmd("ACQUIRE sem 60000 PERMITS=2").await;
    assert!(held.starts_with("OK token="), "{held}");
    let mut probe = Console::connect(server.addr).await;
    let mut in_session = Console::connect(server.addr).await;
    let session = open(&mut in_session, 60_000).await;
    in_session
        .send(&format!(
            "ACQUIRE sem 0 30000 SESSION={session} PERMITS=2/2\n"
        ))
        .await;
    waiters(&mut probe, 1).await;
    let mut later = Console::connect(server.addr).await;
    later.send("ACQUIRE sem 60000 30000 PERMITS=2\n").await;
    waiters(&mut probe, 2).await;
    assert_eq!(
        probe.cmd(&format!("SESSION_CLOSE {session}")).await,
        "OK released=0"
    );
    let refused = in_session.line().await;
    assert!(refused.starts_with("ERR NO_SESSION"), "{refused}");
    // Well inside the 30 s either wait would last: it is not the wait running out.
    let granted = tokio::time::timeout(Duration::from_secs(10), later.line())
        .await
        .expect("the later waiter was served when the session's waiter left");
    assert!(granted.starts_with("OK token="), "{granted}");
    waiters(&mut probe, 0).await;
    // The console says the two options do not combine (the wire's flag bits: BAD_FRAME).
    let both = probe
        .cmd(&format!(
            "ACQUIRE k 0 SESSION={session} RELEASE_ON_DISCONNECT"
        ))
        .await;
    assert!(both.starts_with("ERR BAD_ARGS"), "{both}");
    assert!(both.contains("do not combine"), "{both}");
    server.stop().await;
}

/// Another identity's session is refused as `NO_SESSION`, except for a repeat (PROTOCOL.md
/// 3.11 "Identities"): a repeat of a live lease's key and acquire id is answered before the
/// session is looked at, `REGRANTED` when it names the lease's session and `SESSION_MISMATCH`
/// otherwise, and that refusal does not give away the lease's session id.
#[tokio::test]
async fn a_repeat_is_answered_before_another_identitys_session_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let shared = "prefixes = [\"shared/\"]";
    let server = with_identities(
        dir.path(),
        &[("a", "a-secret", shared), ("b", "b-secret", shared)],
    )
    .await;
    let mut a = authed(&server, "a", "a-secret").await;
    let mut b = authed(&server, "b", "b-secret").await;
    let theirs = open(&mut a, 60_000).await;
    let id = "0f1e2d3c4b5a69788796a5b4c3d2e1f0";
    let first = a
        .cmd(&format!("ACQUIRE shared/k 0 SESSION={theirs} ID={id}"))
        .await;
    assert!(first.starts_with("OK token="), "{first}");

    let fresh = b.cmd(&format!("ACQUIRE shared/j 0 SESSION={theirs}")).await;
    assert!(fresh.starts_with("ERR NO_SESSION"), "{fresh}");
    let repeat = b
        .cmd(&format!("ACQUIRE shared/k 0 SESSION={theirs} ID={id}"))
        .await;
    assert!(repeat.ends_with(" repeat"), "{repeat}");
    assert_eq!(field(&repeat, "lease"), field(&first, "lease"));
    let own = open(&mut b, 60_000).await;
    let mismatch = b
        .cmd(&format!("ACQUIRE shared/k 0 SESSION={own} ID={id}"))
        .await;
    assert!(mismatch.starts_with("ERR SESSION_MISMATCH"), "{mismatch}");
    assert!(!mismatch.contains(&theirs), "{mismatch}");
    // Nothing changed: the lease is still in its session.
    assert_eq!(
        a.cmd(&format!("SESSION_CLOSE {theirs}")).await,
        "OK released=1"
    );
    server.stop().await;
}
