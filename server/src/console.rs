//! The text console: the same operations as the binary protocol, one line at a time.
//!
//! A connection whose first byte is not the binary handshake's zero byte is served here, so
//! `nc 127.0.0.1 7878` works. One command per line (`\n` or `\r\n`), commands case-insensitive,
//! arguments separated by spaces; exactly one reply line per command, in order. WATCH answers
//! with the key's state (`OK watching FREE` or `OK watching HELD ...`) and adds `EVENT ...`
//! lines that arrive whenever the watched key changes after that.
//!
//! This module only translates: a line becomes a [`Command`] holding the same
//! [`Request`] the binary protocol carries, and a [`Response`] becomes a line. The connection
//! code runs both surfaces through one executor, so they cannot drift apart.

use tenure_protocol::{EventKind, Holder, Response};

pub use tenure_protocol::console::{escape, parse, Command, HELP};

/// [`escape`] of at most the first [`QUOTED_CHARS_MAX`](tenure_protocol::console::QUOTED_CHARS_MAX)
/// bytes, then `...` if there were more: how a reason quotes a key (PROTOCOL.md 4), so a
/// refusal of a long key stays short (outside test a38, F7: FORBIDDEN quoted a whole 1 000-byte
/// key, and the binary protocol's 512-byte message cap then cut off its reason).
pub fn quote(bytes: &[u8], out: &mut String) {
    let max = tenure_protocol::console::QUOTED_CHARS_MAX;
    escape(&bytes[..bytes.len().min(max)], out);
    if bytes.len() > max {
        out.push_str("...");
    }
}

/// Appends `HELD token=.. ttl_ms=.. waiters=.. [meta=..]`: INSPECT's answer, and the state
/// a WATCH starts from.
fn format_held(token: u64, ttl_left_ms: u32, waiters: u32, meta: &[u8], out: &mut String) {
    use std::fmt::Write;
    let _ = write!(
        out,
        "HELD token={token} ttl_ms={ttl_left_ms} waiters={waiters}"
    );
    if !meta.is_empty() {
        out.push_str(" meta=");
        escape(meta, out);
    }
}

/// Appends `OK node_id=.. role=.. ...`: a CLUSTER reply. The members are written as INIT
/// takes them (`1=<peer>/<client>,...`), voters and learners apart; `-` for none. CLUSTER
/// STATUS's extension follows as more fields at the end.
fn format_cluster(status: &tenure_protocol::cluster::Status, out: &mut String) {
    use std::fmt::Write;
    use tenure_protocol::cluster::format_members;
    let leader_addr = if status.leader_addr.is_empty() {
        "-"
    } else {
        &status.leader_addr
    };
    let list = |voters: bool| {
        let members = status.members.iter().filter(|(_, v)| *v == voters);
        let text = format_members(members.map(|(m, _)| m));
        if text.is_empty() {
            "-".to_string()
        } else {
            text
        }
    };
    let _ = write!(
        out,
        "OK node_id={} role={} term={} leader_id={} leader_addr={leader_addr} \
         last_log_index={} last_applied_index={} voters={} learners={}",
        status.node_id,
        status.role.name(),
        status.term,
        status.leader_id,
        status.last_log_index,
        status.last_applied_index,
        list(true),
        list(false),
    );
    if let Some(ext) = &status.extension {
        let contact = ext
            .last_contact_ms
            .map_or("-".to_string(), |ms| ms.to_string());
        let _ = write!(
            out,
            " identities_digest={} trust_digest={} last_contact_ms={contact}",
            ext.identities_digest.to_hex(),
            ext.trust_digest.to_hex(),
        );
    }
}

/// Appends the reply line for `response` to `out`, with its `\n`.
pub fn format(response: &Response, out: &mut String) {
    format_reply(response, out);
    out.push('\n');
}

/// The replies to ACQUIRE, RENEW and RELEASE; every other reply goes on to
/// [`format_query_reply`].
fn format_reply(response: &Response, out: &mut String) {
    use std::fmt::Write;
    let _ = match response {
        Response::Granted {
            token,
            lease_id,
            ttl_ms,
            waited_ms,
        } => {
            // `waited_ms` last, so that scripts reading the first fields by position still work.
            write!(
                out,
                "OK token={token} lease={lease_id} ttl_ms={ttl_ms} waited_ms={waited_ms}"
            )
        }
        // A grant's fields in a grant's order (a script reading them by position reads a
        // repeat as the grant it is), then the word that marks it.
        Response::Regranted {
            token,
            lease_id,
            ttl_left_ms,
        } => write!(
            out,
            "OK token={token} lease={lease_id} ttl_ms={ttl_left_ms} waited_ms=0 repeat"
        ),
        Response::AcquireEnded { how, token } => {
            write!(out, "ENDED {} token={token}", how.as_str())
        }
        Response::Locked { token, ttl_left_ms } => {
            write!(out, "LOCKED token={token} ttl_ms={ttl_left_ms}")
        }
        Response::Renewed { ttl_ms } => write!(out, "OK ttl_ms={ttl_ms}"),
        Response::Lost => out.write_str("LOST"),
        Response::Released => out.write_str("OK"),
        Response::NotOwner => out.write_str("NOT_OWNER"),
        other => {
            format_query_reply(other, out);
            Ok(())
        }
    };
}

/// The replies to INSPECT, CHECK, STATS, WATCH, AUTH, CLUSTER and PING, and errors.
fn format_query_reply(response: &Response, out: &mut String) {
    use std::fmt::Write;
    let _ = match response {
        Response::Granted { .. }
        | Response::Regranted { .. }
        | Response::AcquireEnded { .. }
        | Response::Locked { .. }
        | Response::Renewed { .. }
        | Response::Lost
        | Response::Released
        | Response::NotOwner => unreachable!("lease replies are formatted by format_reply"),
        Response::Pong => out.write_str("PONG"),
        Response::Session { session_id, ttl_ms } => {
            write!(out, "OK session={session_id} ttl_ms={ttl_ms}")
        }
        Response::SessionClosed { released } => write!(out, "OK released={released}"),
        Response::Free => out.write_str("FREE"),
        Response::Held { .. } | Response::HeldKinds { .. } => {
            format_inspect_reply(response, out);
            Ok(())
        }
        Response::Current => out.write_str("CURRENT"),
        Response::Stale => out.write_str("STALE"),
        Response::Stats(pairs) => {
            format_stats(pairs, out);
            Ok(())
        }
        Response::Watching { holder } => {
            format_watching(holder.as_ref(), out);
            Ok(())
        }
        Response::Unwatched => out.write_str("OK"),
        Response::Cluster(status) => {
            format_cluster(status, out);
            Ok(())
        }
        Response::Authenticated { name } => {
            out.push_str("OK authenticated ");
            escape(name, out);
            Ok(())
        }
        Response::Event {
            kind,
            key,
            token,
            meta,
        } => {
            format_event(*kind, key, *token, meta, out);
            Ok(())
        }
        Response::Error { code, message } => {
            format_error(code.name(), message, out);
            Ok(())
        }
    };
}

/// INSPECT's HELD and HELD_KINDS replies (the caller takes no other).
fn format_inspect_reply(response: &Response, out: &mut String) {
    match response {
        Response::Held {
            token,
            ttl_left_ms,
            waiters,
            meta,
        } => format_held(*token, *ttl_left_ms, *waiters, meta, out),
        Response::HeldKinds {
            token,
            ttl_left_ms,
            waiters,
            meta,
            kinds,
        } => {
            format_held(*token, *ttl_left_ms, *waiters, meta, out);
            format_holder_kinds(kinds, out);
        }
        _ => unreachable!("format_inspect_reply takes INSPECT's replies only"),
    }
}

/// INSPECT KINDS' fields after HELD's: the holder and waiter counts by kind.
fn format_holder_kinds(kinds: &tenure_protocol::kind::HolderKinds, out: &mut String) {
    use std::fmt::Write;
    let _ = write!(
        out,
        " limit={} holders={} in_use={} writer={} waiting_shared={} waiting_exclusive={}",
        kinds.limit,
        kinds.holders,
        kinds.in_use,
        u8::from(kinds.writer),
        kinds.waiting_shared,
        kinds.waiting_exclusive
    );
}

/// An error line: `ERR <code> <reason>`, the free-text reason kept on one line.
fn format_error(code: &str, message: &str, out: &mut String) {
    use std::fmt::Write;
    let message: String = message
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    let _ = write!(out, "ERR {code} {message}");
}

/// WATCH's reply: `OK watching` and the key's holder, or `FREE`.
fn format_watching(holder: Option<&Holder>, out: &mut String) {
    out.push_str("OK watching ");
    match holder {
        None => out.push_str("FREE"),
        Some(h) => format_held(h.token, h.ttl_left_ms, h.waiters, &h.meta, out),
    }
}

/// STATS' reply: `OK` and its `name=value` pairs.
fn format_stats(pairs: &[(String, u64)], out: &mut String) {
    use std::fmt::Write;
    out.push_str("OK");
    for (name, value) in pairs {
        let _ = write!(out, " {name}={value}");
    }
}

/// An event line: `EVENT <kind> key=<key> token=<token>`, and `meta=` if it has any.
fn format_event(kind: EventKind, key: &[u8], token: u64, meta: &[u8], out: &mut String) {
    use std::fmt::Write;
    let kind = match kind {
        EventKind::Granted => "GRANTED",
        EventKind::Released => "RELEASED",
        EventKind::Expired => "EXPIRED",
    };
    let _ = write!(out, "EVENT {kind} key=");
    escape(key, out);
    let _ = write!(out, " token={token}");
    if !meta.is_empty() {
        out.push_str(" meta=");
        escape(meta, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use tenure_protocol::{ErrorCode, LeaseId};

    #[test]
    fn formats_replies_as_in_the_contract() {
        let line = |r: Response| {
            let mut s = String::new();
            format(&r, &mut s);
            s
        };
        let lease_id = LeaseId::from_u128(0xab);
        assert_eq!(
            line(Response::Granted {
                token: 7,
                lease_id,
                ttl_ms: 30000,
                waited_ms: 0,
            }),
            "OK token=7 lease=000000000000000000000000000000ab ttl_ms=30000 waited_ms=0\n"
        );
        assert_eq!(
            line(Response::Granted {
                token: 8,
                lease_id,
                ttl_ms: 300,
                waited_ms: 1250,
            }),
            "OK token=8 lease=000000000000000000000000000000ab ttl_ms=300 waited_ms=1250\n"
        );
        assert_eq!(
            line(Response::Locked {
                token: 7,
                ttl_left_ms: 12
            }),
            "LOCKED token=7 ttl_ms=12\n"
        );
        assert_eq!(line(Response::Renewed { ttl_ms: 5 }), "OK ttl_ms=5\n");
        assert_eq!(line(Response::Released), "OK\n");
        assert_eq!(line(Response::NotOwner), "NOT_OWNER\n");
        assert_eq!(
            line(Response::Held {
                token: 3,
                ttl_left_ms: 9,
                waiters: 2,
                meta: Bytes::new()
            }),
            "HELD token=3 ttl_ms=9 waiters=2\n"
        );
        assert_eq!(
            line(Response::Held {
                token: 3,
                ttl_left_ms: 9,
                waiters: 0,
                meta: Bytes::from_static(b"a b")
            }),
            "HELD token=3 ttl_ms=9 waiters=0 meta=a\\x20b\n"
        );
        assert_eq!(
            line(Response::Stats(vec![("held".into(), 1)])),
            "OK held=1\n"
        );
        assert_eq!(
            line(Response::Error {
                code: ErrorCode::BadTtl,
                message: "no\nnewlines".into()
            }),
            "ERR BAD_TTL no newlines\n"
        );
    }
}
