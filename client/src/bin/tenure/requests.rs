//! The one-request commands (acquire, renew, release, inspect, check, stats, ping, and the
//! session requests of the console), shared by
//! the command line and `tenure console`: one request, one output line, one exit code.

use std::time::Duration;

use tenure::{
    AcquireId, AcquireOptions, AcquireOutcome, CheckOutcome, Client, EndedHow, KeyState, LeaseId,
    LeaseKind, LockedBy, ReleaseOutcome, RenewOutcome, SessionId,
};

use crate::exit::{EXIT_LOCKED, EXIT_LOST, EXIT_NOT_OWNER, EXIT_OK, EXIT_STALE};
use crate::output::{ms, Line, Out};

/// Takes `key` (alone, shared or as permits: `kind`); prints GRANTED with the token and
/// lease, or LOCKED with the holder's token.
pub async fn acquire(
    client: &Client,
    out: &Out,
    key: String,
    ttl: Duration,
    kind: LeaseKind,
    options: AcquireOptions,
) -> anyhow::Result<u8> {
    acquire_to(client, out, key, ttl, kind, options, Target::default()).await
}

/// Where an ACQUIRE goes beyond its key: the session it is to live in (`SESSION=`), and the
/// user's own acquire id (`ID=`; without one the client picks it).
#[derive(Default)]
pub struct Target {
    /// The session the lease is to live in (its `ttl_ms` is then the session's time left).
    pub session: Option<SessionId>,
    /// The acquire id: a line typed again with the same one is a repeat.
    pub id: Option<AcquireId>,
}

/// Takes `key` as [`acquire`] does, in `target`'s session and with its acquire id if it
/// names them; prints as [`acquire`], a repeat as the grant it repeats.
pub async fn acquire_to(
    client: &Client,
    out: &Out,
    key: String,
    ttl: Duration,
    kind: LeaseKind,
    options: AcquireOptions,
    target: Target,
) -> anyhow::Result<u8> {
    let outcome = match acquire_outcome(client, &key, ttl, kind, options, target).await {
        Err(tenure::Error::AcquireEnded { how, token }) => {
            print_ended(out, &key, how, token);
            return Ok(EXIT_LOST);
        }
        outcome => outcome?,
    };
    print_acquired(out, key, outcome)
}

/// The ACQUIRE `target` asks for: with the user's acquire id, in a session, or plain.
async fn acquire_outcome(
    client: &Client,
    key: &str,
    ttl: Duration,
    kind: LeaseKind,
    options: AcquireOptions,
    target: Target,
) -> tenure::Result<AcquireOutcome> {
    match target {
        Target {
            session,
            id: Some(id),
        } => {
            client
                .acquire_with_id(key, ttl, kind, options, session, id)
                .await
        }
        Target {
            session: Some(session),
            id: None,
        } => client.acquire_in_session(key, session, kind, options).await,
        Target {
            session: None,
            id: None,
        } => client.acquire_kind(key, ttl, kind, options).await,
    }
}

/// Prints ENDED: the ACQUIRE (a repeat of its acquire id) had been granted, and that lease
/// has ended since; the server's console answers `ENDED <how> token=<n>` to the same.
fn print_ended(out: &Out, key: &str, how: EndedHow, token: u64) {
    out.print(
        Line::new("ENDED")
            .text("key", key)
            .text("how", how.as_str())
            .number("token", token),
    );
}

/// Opens a session nobody keeps alive but the console's user; prints its id and TTL.
pub async fn session_open(
    client: &Client,
    out: &Out,
    ttl: Duration,
    chosen: Option<SessionId>,
) -> anyhow::Result<u8> {
    let (id, ttl) = client.open_session_as(ttl, chosen).await?;
    print_session(out, id, ttl);
    Ok(EXIT_OK)
}

/// Keeps session `id` alive once; prints its id and TTL.
pub async fn session_keepalive(client: &Client, out: &Out, id: SessionId) -> anyhow::Result<u8> {
    let ttl = client.keep_session_alive(id).await?;
    print_session(out, id, ttl);
    Ok(EXIT_OK)
}

/// Closes session `id`; prints how many leases that freed.
pub async fn session_close(client: &Client, out: &Out, id: SessionId) -> anyhow::Result<u8> {
    let released = client.close_session(id).await?;
    out.print(Line::new("SESSION_CLOSED").number("released", u64::from(released)));
    Ok(EXIT_OK)
}

fn print_session(out: &Out, id: SessionId, ttl: Duration) {
    out.print(
        Line::new("SESSION")
            .text("session", id.to_string())
            .number("ttl_ms", ms(ttl)),
    );
}

/// Prints an acquire's outcome: GRANTED or LOCKED, and the exit code that goes with it.
fn print_acquired(out: &Out, key: String, outcome: AcquireOutcome) -> anyhow::Result<u8> {
    match outcome {
        AcquireOutcome::Granted(lease) => {
            let line = Line::new("GRANTED")
                .text("key", key)
                .number("token", lease.fencing_token())
                .text("lease", lease.lease_id().to_string())
                .number("ttl_ms", ms(lease.ttl()))
                // A script counting the lease must add this to the TTL (PROTOCOL.md 3.3).
                .number("waited_ms", ms(lease.waited()));
            // Last, so that a script reading the fields by position reads a repeat as the
            // grant it is (as the server's console marks one).
            out.print(if lease.is_repeat() {
                line.number("repeat", 1)
            } else {
                line
            });
            Ok(EXIT_OK)
        }
        AcquireOutcome::Locked(by) => {
            print_locked(out, &key, &by);
            Ok(EXIT_LOCKED)
        }
    }
}

/// Prints LOCKED: the holder's token and how long its lease has left.
pub fn print_locked(out: &Out, key: &str, by: &LockedBy) {
    out.print(
        Line::new("LOCKED")
            .text("key", key)
            .number("token", by.token)
            .number("ttl_ms", ms(by.ttl_left)),
    );
}

/// Extends `lease`; prints RENEWED or LOST.
pub async fn renew(
    client: &Client,
    out: &Out,
    key: String,
    lease: LeaseId,
    ttl: Duration,
) -> anyhow::Result<u8> {
    let (line, code) = match client.renew(&key, lease, ttl).await? {
        RenewOutcome::Renewed { ttl } => (
            Line::new("RENEWED")
                .text("key", key)
                .number("ttl_ms", ms(ttl)),
            EXIT_OK,
        ),
        RenewOutcome::Lost => (Line::new("LOST").text("key", key), EXIT_LOST),
    };
    out.print(line);
    Ok(code)
}

/// Gives `key` back; prints RELEASED or NOT_OWNER.
pub async fn release(
    client: &Client,
    out: &Out,
    key: String,
    lease: LeaseId,
) -> anyhow::Result<u8> {
    let (result, code) = match client.release(&key, lease).await? {
        ReleaseOutcome::Released => ("RELEASED", EXIT_OK),
        ReleaseOutcome::NotOwner => ("NOT_OWNER", EXIT_NOT_OWNER),
    };
    out.print(Line::new(result).text("key", key));
    Ok(code)
}

/// Prints FREE, or HELD with the holder's token, time left, waiters and metadata; with
/// `kinds`, a read/write or semaphore key's holders and waiters by kind after them.
pub async fn inspect(client: &Client, out: &Out, key: String, kinds: bool) -> anyhow::Result<u8> {
    let (state, by_kind) = if kinds {
        let answer = client.inspect_kinds(&key).await?;
        (answer.state, answer.kinds)
    } else {
        (client.inspect(&key).await?, None)
    };
    let line = holder_fields(Line::new(state_name(&state)).text("key", key), &state);
    out.print(match by_kind {
        None => line,
        Some(k) => line
            .number("limit", u64::from(k.limit))
            .number("holders", u64::from(k.holders))
            .number("in_use", u64::from(k.in_use))
            .number("writer", u64::from(k.writer))
            .number("waiting_shared", u64::from(k.waiting_shared))
            .number("waiting_exclusive", u64::from(k.waiting_exclusive)),
    });
    Ok(EXIT_OK)
}

/// WATCH's answer: `result=WATCHING key=k state=FREE`, or `state=HELD` with the holder's
/// fields, as the console answers `OK watching FREE` / `OK watching HELD ...`.
pub fn watching_line(key: &str, state: &KeyState) -> Line {
    let line = Line::new("WATCHING")
        .text("key", key)
        .text("state", state_name(state));
    holder_fields(line, state)
}

fn state_name(state: &KeyState) -> &'static str {
    match state {
        KeyState::Free => "FREE",
        KeyState::Held { .. } => "HELD",
    }
}

/// Appends the holder's token, time left, waiters and metadata, if the key is held.
fn holder_fields(line: Line, state: &KeyState) -> Line {
    match state {
        KeyState::Free => line,
        KeyState::Held {
            token,
            ttl_left,
            waiters,
            meta,
        } => line
            .number("token", *token)
            .number("ttl_ms", ms(*ttl_left))
            .number("waiters", u64::from(*waiters))
            .text("meta", String::from_utf8_lossy(meta)),
    }
}

/// Prints CURRENT or STALE for `token`.
pub async fn check(client: &Client, out: &Out, key: String, token: u64) -> anyhow::Result<u8> {
    let (result, code) = match client.check(&key, token).await? {
        CheckOutcome::Current => ("CURRENT", EXIT_OK),
        CheckOutcome::Stale => ("STALE", EXIT_STALE),
    };
    out.print(Line::new(result).text("key", key).number("token", token));
    Ok(code)
}

/// Prints the server's counters on one line.
pub async fn stats(client: &Client, out: &Out) -> anyhow::Result<u8> {
    let line = client
        .stats()
        .await?
        .into_iter()
        .fold(Line::new("STATS"), |line, (name, value)| {
            line.number(&name, value)
        });
    out.print(line);
    Ok(EXIT_OK)
}

/// Prints PONG with the round trip in microseconds.
pub async fn ping(client: &Client, out: &Out) -> anyhow::Result<u8> {
    let rtt = client.ping().await?;
    let rtt_us = u64::try_from(rtt.as_micros()).unwrap_or(u64::MAX);
    out.print(Line::new("PONG").number("rtt_us", rtt_us));
    Ok(EXIT_OK)
}
