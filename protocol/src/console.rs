//! The text console's grammar: one line in, one [`Command`] out (PROTOCOL.md section 4).
//!
//! The server's console and the `tenure console` command line both read lines with
//! [`parse`], so a person at a terminal meets one grammar wherever they type. A line becomes
//! the same [`Request`] the binary protocol carries; how replies are written is the server's
//! business (its `console` module).

use bytes::Bytes;

use crate::frame::validate_key;
use crate::limits::PERMITS_MAX;
use crate::{AcquireId, ErrorCode, FrameError, LeaseId, LeaseKind, Request, SessionId};

/// Longest piece of an argument a reason quotes back (PROTOCOL.md 4), then `...`: a reply
/// line stays short whatever was typed, and a quote cut short is not read as the whole.
pub const QUOTED_CHARS_MAX: usize = 32;

/// Writes bytes that may not be text so that a reply or a log line stays one line of
/// printable words: printable ASCII other than space and backslash as is, everything else
/// as `\xNN`.
pub fn escape(bytes: &[u8], out: &mut String) {
    use std::fmt::Write;
    for &b in bytes {
        if b.is_ascii_graphic() && b != b'\\' {
            out.push(b as char);
        } else {
            let _ = write!(out, "\\x{b:02x}");
        }
    }
}

/// The command list, once, for both [`COMMANDS`] and [`HELP`] (`concat!` takes literals only).
macro_rules! command_list {
    () => {
        "PING | ACQUIRE <key> <ttl_ms> [<wait_ms>] [META=<text>] [RELEASE_ON_DISCONNECT] \
         [ID=<32 hex>] [SESSION=<32 hex>] [SHARED | PERMITS=[<count>/]<limit>] | \
         RENEW <key> <lease> <ttl_ms> | RELEASE <key> <lease> | INSPECT <key> [KINDS] | \
         CHECK <key> <token> | STATS | WATCH <key> | UNWATCH <key> | AUTH <name> <secret> | \
         CLUSTER STATUS | CLUSTER INIT <id>=<peer>/<client>,... | \
         CLUSTER ADD <id> <peer>/<client> | CLUSTER REMOVE <id> | SESSION_OPEN <ttl_ms> [ID=<32 hex>] | \
         SESSION_KEEPALIVE <session> | SESSION_CLOSE <session> | HELP | QUIT"
    };
}

/// Every command with its arguments, on one line.
pub const COMMANDS: &str = command_list!();

/// The console's reply to HELP.
pub const HELP: &str = concat!("OK commands: ", command_list!());

/// What one console line asks for.
#[derive(Debug, PartialEq, Eq)]
pub enum Command {
    /// An operation shared with the binary protocol.
    Request(Request),
    /// List the commands.
    Help,
    /// Say BYE and close.
    Quit,
    /// A blank line: no reply, so a stray newline does not desynchronise a script.
    Empty,
}

fn bad_args(message: String) -> FrameError {
    FrameError::new(ErrorCode::BadArgs, message)
}

/// Parses one line (without its line ending).
///
/// # Errors
/// A [`FrameError`] whose code and message become the `ERR <CODE> <reason>` reply.
pub fn parse(line: &[u8]) -> Result<Command, FrameError> {
    let text = std::str::from_utf8(line).map_err(|_| bad_args("line is not UTF-8 text".into()))?;
    let mut words = text.split_ascii_whitespace();
    let Some(typed) = words.next() else {
        return Ok(Command::Empty);
    };
    let args: Vec<&str> = words.collect();
    let name = typed.to_ascii_uppercase();
    let usage = |form: &str| bad_args(format!("usage: {form}"));
    let request = match (name.as_str(), args.as_slice()) {
        ("PING", []) => Request::Ping,
        ("STATS", []) => Request::Stats,
        ("HELP", []) => return Ok(Command::Help),
        ("QUIT", []) => return Ok(Command::Quit),
        ("ACQUIRE", [key, ttl, rest @ ..]) => parse_acquire(key, ttl, rest)?,
        ("ACQUIRE", _) => return Err(usage(ACQUIRE_USAGE)),
        ("RENEW", [key, lease, ttl]) => Request::Renew {
            key: parse_key(key)?,
            lease_id: parse_lease(lease)?,
            ttl_ms: parse_u32("ttl_ms", ttl)?,
        },
        ("RENEW", _) => return Err(usage("RENEW <key> <lease> <ttl_ms>")),
        ("RELEASE", [key, lease]) => Request::Release {
            key: parse_key(key)?,
            lease_id: parse_lease(lease)?,
        },
        ("RELEASE", _) => return Err(usage("RELEASE <key> <lease>")),
        ("INSPECT", [key]) => Request::Inspect {
            key: parse_key(key)?,
            kinds: false,
        },
        ("INSPECT", [key, flag]) if flag.eq_ignore_ascii_case("KINDS") => Request::Inspect {
            key: parse_key(key)?,
            kinds: true,
        },
        ("INSPECT", _) => return Err(usage("INSPECT <key> [KINDS]")),
        ("CHECK", [key, token]) => Request::Check {
            key: parse_key(key)?,
            token: parse_u64("token", token)?,
        },
        ("CHECK", _) => return Err(usage("CHECK <key> <token>")),
        ("WATCH", [key]) => Request::Watch {
            key: parse_key(key)?,
        },
        ("WATCH", _) => return Err(usage("WATCH <key>")),
        ("UNWATCH", [key]) => Request::Unwatch {
            key: parse_key(key)?,
        },
        ("UNWATCH", _) => return Err(usage("UNWATCH <key>")),
        ("AUTH", [name, secret]) => Request::Auth {
            name: Bytes::copy_from_slice(name.as_bytes()),
            secret: crate::Secret(Bytes::copy_from_slice(secret.as_bytes())),
        },
        ("AUTH", _) => return Err(usage("AUTH <name> <secret>")),
        ("CLUSTER", [sub, rest @ ..]) => parse_cluster(sub, rest)?,
        ("CLUSTER", _) => return Err(usage(CLUSTER_USAGE)),
        ("SESSION_OPEN", [ttl, rest @ ..]) => parse_session_open(ttl, rest)?,
        ("SESSION_OPEN", _) => return Err(usage(SESSION_OPEN_USAGE)),
        ("SESSION_KEEPALIVE", [id]) => Request::SessionKeepalive {
            session_id: parse_session("session", id)?,
        },
        ("SESSION_KEEPALIVE", _) => return Err(usage("SESSION_KEEPALIVE <session>")),
        ("SESSION_CLOSE", [id]) => Request::SessionClose {
            session_id: parse_session("session", id)?,
        },
        ("SESSION_CLOSE", _) => return Err(usage("SESSION_CLOSE <session>")),
        ("PING" | "STATS" | "HELP" | "QUIT", _) => {
            return Err(bad_args(format!("{name} takes no arguments")))
        }
        _ => {
            return Err(FrameError::new(
                ErrorCode::UnknownOpcode,
                format!("unknown command \"{}\"; try HELP", truncate(typed)),
            ))
        }
    };
    request.validate()?;
    Ok(Command::Request(request))
}

/// ACQUIRE's form, for its usage error.
const ACQUIRE_USAGE: &str = "ACQUIRE <key> <ttl_ms> [<wait_ms>] [META=<text>] \
     [RELEASE_ON_DISCONNECT] [ID=<32 hex>] [SESSION=<32 hex>] \
     [SHARED | PERMITS=[<count>/]<limit>]";

/// The CLUSTER forms, for its usage error.
const CLUSTER_USAGE: &str = "CLUSTER STATUS | CLUSTER INIT <id>=<peer>/<client>,... | \
     CLUSTER ADD <id> <peer>/<client> | CLUSTER REMOVE <id>";

fn parse_cluster(sub: &str, rest: &[&str]) -> Result<Request, FrameError> {
    let request = match (sub.to_ascii_uppercase().as_str(), rest) {
        ("STATUS", []) => Request::ClusterStatus { extended: true },
        ("INIT", [spec]) => Request::ClusterInit {
            members: crate::cluster::parse_members(spec)?,
        },
        ("ADD", [id, addrs]) => Request::ClusterAdd {
            member: crate::cluster::parse_addrs(parse_u64("id", id)?, addrs)?,
        },
        ("REMOVE", [id]) => Request::ClusterRemove {
            id: parse_u64("id", id)?,
        },
        _ => return Err(bad_args(format!("usage: {CLUSTER_USAGE}"))),
    };
    Ok(request)
}

fn parse_acquire(key: &str, ttl: &str, rest: &[&str]) -> Result<Request, FrameError> {
    let mut wait_ms = 0;
    let mut meta = Bytes::new();
    let mut release_on_disconnect = false;
    let mut acquire_id = None;
    let mut kind = LeaseKind::Exclusive;
    let mut session_id = None;
    // Each option at most once: a doubled one is a mistake to point out, not guess at.
    let mut seen = [false; 4];
    let mut once = |option: usize, name: &str| {
        if std::mem::replace(&mut seen[option], true) {
            return Err(bad_args(format!("{name} given twice")));
        }
        Ok(())
    };
    for (i, word) in rest.iter().enumerate() {
        let upper = word.to_ascii_uppercase();
        if let Some(value) = word.get(8..).filter(|_| upper.starts_with("SESSION=")) {
            once(3, "SESSION=")?;
            session_id = Some(parse_session("SESSION=", value)?);
        } else if let Some(value) = word.get(5..).filter(|_| upper.starts_with("META=")) {
            once(0, "META=")?;
            meta = Bytes::copy_from_slice(value.as_bytes());
        } else if let Some(value) = word.get(3..).filter(|_| upper.starts_with("ID=")) {
            once(1, "ID=")?;
            let id = AcquireId::from_hex(value).ok_or_else(|| id_malformed(value))?;
            acquire_id = Some(id);
        } else if upper == "RELEASE_ON_DISCONNECT" {
            once(2, "RELEASE_ON_DISCONNECT")?;
            release_on_disconnect = true;
        } else if upper == "SHARED" || upper.starts_with("PERMITS=") {
            if !kind.is_exclusive() {
                return Err(bad_args("give one of SHARED and PERMITS= once".into()));
            }
            kind = parse_kind(&upper)?;
        } else if i == 0 && looks_numeric(word) {
            wait_ms = parse_u32("wait_ms", word)?;
        } else {
            return Err(bad_args(format!(
                "unexpected argument \"{}\"; usage: {ACQUIRE_USAGE}",
                truncate(word)
            )));
        }
    }
    refuse_session_with_disconnect(release_on_disconnect, session_id.is_some())?;
    Ok(Request::Acquire {
        key: parse_key(key)?,
        ttl_ms: parse_u32("ttl_ms", ttl)?,
        wait_ms,
        release_on_disconnect,
        meta,
        acquire_id,
        session_id,
        kind,
    })
}

/// Whether an ACQUIRE's first word after the TTL is meant as its `wait_ms`: it starts like a
/// number (a digit, or the `+` `str::parse` takes). Any other word is an unknown option and
/// is called one, not a bad `wait_ms` (outside test a31, finding F2).
fn looks_numeric(word: &str) -> bool {
    word.starts_with(|c: char| c.is_ascii_digit() || c == '+' || c == '-')
}

/// `SESSION=` with `RELEASE_ON_DISCONNECT`: the wire's flag bits 2 and 0 together are a
/// malformed frame (`BAD_FRAME`); on a console line they are a choice of arguments, and said
/// to be one (PROTOCOL.md 4).
fn refuse_session_with_disconnect(release: bool, session: bool) -> Result<(), FrameError> {
    if release && session {
        return Err(bad_args(
            "SESSION= and RELEASE_ON_DISCONNECT do not combine: a session lease ends with \
             its session, not with a connection"
                .into(),
        ));
    }
    Ok(())
}

/// `SHARED`, `PERMITS=<limit>` (one permit) or `PERMITS=<count>/<limit>`, upper-cased.
fn parse_kind(upper: &str) -> Result<LeaseKind, FrameError> {
    let Some(value) = upper.strip_prefix("PERMITS=") else {
        return Ok(LeaseKind::Shared);
    };
    let (count, limit) = match value.split_once('/') {
        Some((count, limit)) => (
            parse_permits("count", count)?,
            parse_permits("limit", limit)?,
        ),
        None => (1, parse_permits("limit", value)?),
    };
    Ok(LeaseKind::Permits { count, limit })
}

/// A PERMITS= number: decimal digits only (no sign; `str::parse` would take a leading '+').
/// Digits too many for a `u32` are a count out of range: `BAD_PERMITS`, quoting them as
/// typed (a saturated value in the message would be a number nobody typed).
fn parse_permits(name: &str, word: &str) -> Result<u32, FrameError> {
    if word.is_empty() || !word.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad_args(format!(
            "PERMITS= {name} must be a whole number from 1 to {PERMITS_MAX}"
        )));
    }
    word.parse().map_err(|_| {
        FrameError::new(
            ErrorCode::BadPermits,
            format!("PERMITS= {name} {} is over {PERMITS_MAX}", truncate(word)),
        )
    })
}

const SESSION_OPEN_USAGE: &str = "SESSION_OPEN <ttl_ms> [ID=<32 hex>]";

/// `SESSION_OPEN <ttl_ms> [ID=<32 hex>]`; `ID=`'s mistakes are told as ACQUIRE's are.
fn parse_session_open(ttl: &str, rest: &[&str]) -> Result<Request, FrameError> {
    let mut session_id = None;
    for word in rest {
        let upper = word.to_ascii_uppercase();
        let Some(value) = word.get(3..).filter(|_| upper.starts_with("ID=")) else {
            return Err(bad_args(format!("usage: {SESSION_OPEN_USAGE}")));
        };
        if session_id.is_some() {
            return Err(bad_args("ID= given twice".into()));
        }
        session_id = Some(SessionId::from_hex(value).ok_or_else(|| id_malformed(value))?);
    }
    Ok(Request::SessionOpen {
        ttl_ms: parse_u32("ttl_ms", ttl)?,
        session_id,
    })
}

/// An `ID=` value that is not 32 hex digits.
fn id_malformed(value: &str) -> FrameError {
    let chars = value.chars().count();
    let quoted = truncate(value);
    bad_args(format!(
        "ID= must be 32 hex digits, got {chars} characters: ID={quoted}"
    ))
}

/// A SESSION= id: 32 hex digits.
fn parse_session(name: &str, word: &str) -> Result<SessionId, FrameError> {
    SessionId::from_hex(word)
        .ok_or_else(|| bad_args(format!("{name} {} is not 32 hex digits", truncate(word))))
}

fn parse_key(word: &str) -> Result<Bytes, FrameError> {
    validate_key(word.as_bytes())?;
    Ok(Bytes::copy_from_slice(word.as_bytes()))
}

fn parse_lease(word: &str) -> Result<LeaseId, FrameError> {
    LeaseId::from_hex(word).ok_or_else(|| bad_args("lease must be 32 hex digits".into()))
}

fn parse_u32(name: &str, word: &str) -> Result<u32, FrameError> {
    word.parse()
        .map_err(|_| bad_args(format!("{name} must be a whole number up to {}", u32::MAX)))
}

fn parse_u64(name: &str, word: &str) -> Result<u64, FrameError> {
    word.parse()
        .map_err(|_| bad_args(format!("{name} must be a whole number up to {}", u64::MAX)))
}

/// `text` for a message, cut to [`QUOTED_CHARS_MAX`] characters, and then ending in `...`
/// so the cut is not read as the whole argument.
/// The first [`QUOTED_CHARS_MAX`] characters of `text` for a reason to quote, then `...` if
/// there were more; every byte that is not printable ASCII (or is `\` or `"`) written as
/// `\xNN`, as replies write keys, so the reply stays one line of words whatever was typed.
fn truncate(text: &str) -> String {
    use std::fmt::Write;
    let mut quoted = String::new();
    let mut chars = text.chars();
    for c in chars.by_ref().take(QUOTED_CHARS_MAX) {
        if c.is_ascii_graphic() && c != '\\' && c != '"' {
            quoted.push(c);
        } else {
            for b in c.encode_utf8(&mut [0; 4]).bytes() {
                let _ = write!(quoted, "\\x{b:02x}");
            }
        }
    }
    if chars.next().is_some() {
        quoted.push_str("...");
    }
    quoted
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(line: &str) -> Request {
        match parse(line.as_bytes()).unwrap() {
            Command::Request(r) => r,
            other => panic!("{line}: {other:?}"),
        }
    }

    fn err(line: &str) -> ErrorCode {
        parse(line.as_bytes()).unwrap_err().code
    }

    #[test]
    fn parses_every_command_case_insensitively() {
        assert_eq!(request("ping"), Request::Ping);
        assert_eq!(request("  PiNg  "), Request::Ping);
        assert_eq!(
            request("acquire order:1842 30000"),
            Request::Acquire {
                key: Bytes::from_static(b"order:1842"),
                ttl_ms: 30000,
                wait_ms: 0,
                release_on_disconnect: false,
                meta: Bytes::new(),
                acquire_id: None,
                kind: LeaseKind::Exclusive,
                session_id: None,
            }
        );
        assert_eq!(
            request("ACQUIRE k 1000 500 meta=10.0.0.1:80 release_on_disconnect"),
            Request::Acquire {
                key: Bytes::from_static(b"k"),
                ttl_ms: 1000,
                wait_ms: 500,
                release_on_disconnect: true,
                meta: Bytes::from_static(b"10.0.0.1:80"),
                kind: LeaseKind::Exclusive,
                acquire_id: None,
                session_id: None,
            }
        );
        let id = "5E11c3a709d2446b8f310c7de295b81f";
        assert!(matches!(
            request(&format!("ACQUIRE k 1000 id={id}")),
            Request::Acquire {
                acquire_id: Some(a),
                wait_ms: 0,
                ..
            } if a == AcquireId::from_u128(0x5e11c3a709d2446b8f310c7de295b81f)
        ));
        // The wait comes first, as before.
        assert_eq!(
            err(&format!("ACQUIRE k 1000 ID={id} 5")),
            ErrorCode::BadArgs
        );
        assert!(matches!(
            request(&format!("ACQUIRE k 1000 5 ID={id}")),
            Request::Acquire {
                acquire_id: Some(_),
                wait_ms: 5,
                ..
            }
        ));
        // Both options together, in either order.
        assert!(matches!(
            request(&format!("ACQUIRE k 1000 SHARED ID={id}")),
            Request::Acquire {
                acquire_id: Some(_),
                kind: LeaseKind::Shared,
                ..
            }
        ));
        assert!(matches!(
            request(&format!("ACQUIRE k 1000 ID={id} PERMITS=2/4")),
            Request::Acquire {
                acquire_id: Some(_),
                kind: LeaseKind::Permits { count: 2, limit: 4 },
                ..
            }
        ));
        let kind = |line: &str| match request(line) {
            Request::Acquire { kind, .. } => kind,
            other => panic!("{other:?}"),
        };
        assert_eq!(kind("ACQUIRE k 1000 shared"), LeaseKind::Shared);
        assert_eq!(
            kind("ACQUIRE k 1000 5 PERMITS=4"),
            LeaseKind::Permits { count: 1, limit: 4 }
        );
        assert_eq!(
            kind("ACQUIRE k 1000 permits=2/4 META=x"),
            LeaseKind::Permits { count: 2, limit: 4 }
        );
        assert_eq!(err("ACQUIRE k 1000 SHARED PERMITS=4"), ErrorCode::BadArgs);
        assert_eq!(err("ACQUIRE k 1000 PERMITS=5/4"), ErrorCode::BadPermits);
        assert_eq!(err("ACQUIRE k 1000 PERMITS=0"), ErrorCode::BadPermits);
        assert_eq!(err("ACQUIRE k 1000 PERMITS=4097"), ErrorCode::BadPermits);
        assert_eq!(err("ACQUIRE k 1000 PERMITS=x"), ErrorCode::BadArgs);
        let lease = "000102030405060708090a0b0c0d0e0f";
        assert!(matches!(
            request(&format!("RENEW k {lease} 100")),
            Request::Renew { ttl_ms: 100, .. }
        ));
        assert!(matches!(
            request(&format!("release k {lease}")),
            Request::Release { .. }
        ));
        assert!(matches!(request("INSPECT k"), Request::Inspect { .. }));
        assert!(matches!(
            request("CHECK k 18446744073709551615"),
            Request::Check {
                token: u64::MAX,
                ..
            }
        ));
        assert_eq!(request("STATS"), Request::Stats);
        assert!(matches!(request("watch k"), Request::Watch { .. }));
        assert!(matches!(request("unwatch k"), Request::Unwatch { .. }));
        assert_eq!(parse(b"help").unwrap(), Command::Help);
        assert_eq!(parse(b"QUIT").unwrap(), Command::Quit);
        assert_eq!(parse(b"   ").unwrap(), Command::Empty);
    }

    fn refusal(line: &str) -> FrameError {
        parse(line.as_bytes()).expect_err(line)
    }

    #[test]
    fn a_doubled_acquire_option_is_bad_args() {
        let id = "5e11c3a709d2446b8f310c7de295b81f";
        for line in [
            format!("ACQUIRE k 1000 ID={id} ID={id}"),
            format!("ACQUIRE k 1000 5 id={id} META=x ID=00000000000000000000000000000001"),
            "ACQUIRE k 1000 META=a META=b".to_string(),
            "ACQUIRE k 1000 0 RELEASE_ON_DISCONNECT release_on_disconnect".to_string(),
        ] {
            let e = refusal(&line);
            assert_eq!(e.code, ErrorCode::BadArgs, "{line}");
            assert!(e.message.ends_with("given twice"), "{line}: {}", e.message);
        }
    }

    #[test]
    fn permits_counts_are_plain_digits_and_the_message_names_the_real_bounds() {
        for line in [
            "ACQUIRE k 1000 PERMITS=+1/2",
            "ACQUIRE k 1000 PERMITS=1/+2",
            "ACQUIRE k 1000 PERMITS=+2",
            "ACQUIRE k 1000 PERMITS=-1/2",
            "ACQUIRE k 1000 PERMITS=/2",
            "ACQUIRE k 1000 PERMITS=",
        ] {
            let e = refusal(line);
            assert_eq!(e.code, ErrorCode::BadArgs, "{line}");
            let bounds = format!("from 1 to {PERMITS_MAX}");
            assert!(e.message.ends_with(&bounds), "{line}: {}", e.message);
        }
        // Digits out of range are counts out of range, however many, quoted as typed.
        let e = refusal("ACQUIRE k 1000 PERMITS=99999999999");
        assert_eq!(e.code, ErrorCode::BadPermits);
        assert!(e.message.contains("99999999999"), "{}", e.message);
        assert!(!e.message.contains(&u32::MAX.to_string()), "{}", e.message);
        let e = refusal("ACQUIRE k 1000 PERMITS=1/99999999999");
        assert_eq!(e.code, ErrorCode::BadPermits);
        assert!(e.message.contains("limit 99999999999"), "{}", e.message);
        assert_eq!(
            refusal("ACQUIRE k 1000 PERMITS=5000/4096").code,
            ErrorCode::BadPermits
        );
    }

    #[test]
    fn an_unknown_acquire_option_is_named_as_one_not_as_a_bad_wait() {
        for line in [
            "ACQUIRE k 1000 SHARD",
            "ACQUIRE k 1000 PERMIT=2",
            "ACQUIRE k 1000 5 SHARD",
        ] {
            let e = refusal(line);
            assert_eq!(e.code, ErrorCode::BadArgs, "{line}");
            assert!(
                e.message.starts_with("unexpected argument \"SHARD")
                    || e.message.starts_with("unexpected argument \"PERMIT="),
                "{line}: {}",
                e.message
            );
            assert!(e.message.contains(ACQUIRE_USAGE), "{line}: {}", e.message);
        }
        // A word that starts like a number is still read as the wait, and said to be bad.
        for line in [
            "ACQUIRE k 1000 5x",
            "ACQUIRE k 1000 -5",
            "ACQUIRE k 1000 99999999999",
        ] {
            let e = refusal(line);
            assert!(
                e.message.starts_with("wait_ms must be"),
                "{line}: {}",
                e.message
            );
        }
    }

    #[test]
    fn a_quoted_argument_cut_short_says_so() {
        let e = refusal(&format!("ACQUIRE k 1000 ID={}", "a".repeat(33)));
        assert_eq!(e.code, ErrorCode::BadArgs);
        let cut = format!("got 33 characters: ID={}...", "a".repeat(32));
        assert!(e.message.ends_with(&cut), "{}", e.message);
        let e = refusal("ACQUIRE k 1000 ID=abc");
        assert!(
            e.message.ends_with("got 3 characters: ID=abc"),
            "{}",
            e.message
        );
        let e = refusal(&format!("ACQUIRE k 1000 5 {}", "x".repeat(40)));
        assert!(
            e.message.contains(&format!("{}...", "x".repeat(32))),
            "{}",
            e.message
        );
    }

    #[test]
    fn the_all_zero_acquire_id_is_refused() {
        let e = refusal(&format!("ACQUIRE k 1000 ID={}", "0".repeat(32)));
        assert_eq!(e.code, ErrorCode::BadArgs);
        assert!(e.message.contains("all zero"), "{}", e.message);
    }

    #[test]
    fn parses_the_session_commands() {
        let id = "5E11c3a709d2446b8f310c7de295b81f";
        let session = SessionId::from_u128(0x5e11c3a709d2446b8f310c7de295b81f);
        assert_eq!(
            request("session_open 10000"),
            Request::SessionOpen {
                ttl_ms: 10000,
                session_id: None
            }
        );
        assert_eq!(
            request(&format!("SESSION_OPEN 10000 id={id}")),
            Request::SessionOpen {
                ttl_ms: 10000,
                session_id: Some(session)
            }
        );
        assert_eq!(
            request(&format!("SESSION_KEEPALIVE {id}")),
            Request::SessionKeepalive {
                session_id: session
            }
        );
        assert_eq!(
            request(&format!("SESSION_CLOSE {id}")),
            Request::SessionClose {
                session_id: session
            }
        );
        assert!(matches!(
            request(&format!("ACQUIRE k 0 250 session={id} ID={id}")),
            Request::Acquire {
                ttl_ms: 0,
                wait_ms: 250,
                session_id: Some(s),
                acquire_id: Some(_),
                ..
            } if s == session
        ));
        for bad in [
            "SESSION_OPEN",
            "SESSION_OPEN ten",
            "SESSION_OPEN 10 20",
            "SESSION_OPEN 10000 ID=123",
            "SESSION_OPEN 10000 ID=",
            "SESSION_OPEN 10000 ID=5e11c3a709d2446b8f310c7de295b81f x",
            "SESSION_OPEN 10000 ID=5e11c3a709d2446b8f310c7de295b81f ID=5e11c3a709d2446b8f310c7de295b81f",
            "SESSION_KEEPALIVE",
            "SESSION_KEEPALIVE 123",
            "SESSION_CLOSE nothex",
            "ACQUIRE k 0 SESSION=123",
        ] {
            assert_eq!(err(bad), ErrorCode::BadArgs, "{bad}");
        }
        assert_eq!(err("SESSION_OPEN 5"), ErrorCode::BadTtl);
        assert_eq!(
            err(&format!("ACQUIRE k 1000 SESSION={id}")),
            ErrorCode::BadTtl
        );
        // Either order; a console line says the two do not combine (the wire: BAD_FRAME).
        for line in [
            format!("ACQUIRE k 0 SESSION={id} RELEASE_ON_DISCONNECT"),
            format!("ACQUIRE k 0 5 RELEASE_ON_DISCONNECT SESSION={id}"),
        ] {
            let Err(e) = parse(line.as_bytes()) else {
                panic!("{line} parsed")
            };
            assert_eq!(e.code, ErrorCode::BadArgs, "{line}");
            assert!(e.message.contains("do not combine"), "{}", e.message);
        }
        assert_eq!(err("ACQUIRE k 0"), ErrorCode::BadTtl);
    }

    /// A quoted argument is written as replies write keys, `\xNN` for what is not printable
    /// ASCII, and cut at `QUOTED_CHARS_MAX` characters (outside test a38, F6: an unknown
    /// command was quoted with Rust's escapes, `\0` and `\u{1}`).
    #[test]
    fn a_quoted_argument_is_escaped_as_replies_are_and_cut_short() {
        let unknown = parse(b"PING\0\x01").unwrap_err();
        assert_eq!(
            unknown.message,
            r#"unknown command "PING\x00\x01"; try HELP"#
        );
        let quoted = parse("FR\u{e9}B\"\\".as_bytes()).unwrap_err();
        assert_eq!(
            quoted.message,
            r#"unknown command "FR\xc3\xa9B\x22\x5c"; try HELP"#
        );
        // Quoted as typed, not upper-cased (outside test a39, F6).
        let typed = parse(b"frob\"q").unwrap_err();
        assert_eq!(typed.message, r#"unknown command "frob\x22q"; try HELP"#);
        let long = "X".repeat(40);
        let cut = parse(long.as_bytes()).unwrap_err();
        let shown = format!(
            "unknown command \"{}...\"; try HELP",
            &long[..QUOTED_CHARS_MAX]
        );
        assert_eq!(cut.message, shown);
        let just = "X".repeat(QUOTED_CHARS_MAX);
        let whole = parse(just.as_bytes()).unwrap_err();
        assert_eq!(
            whole.message,
            format!("unknown command \"{just}\"; try HELP")
        );
        let argument = parse(b"ACQUIRE k 1000 \x02x").unwrap_err();
        assert!(
            argument
                .message
                .starts_with(r#"unexpected argument "\x02x"; usage"#),
            "{}",
            argument.message
        );
    }

    #[test]
    fn rejects_malformed_lines_with_codes() {
        assert_eq!(err("FROB"), ErrorCode::UnknownOpcode);
        assert_eq!(err("ACQUIRE"), ErrorCode::BadArgs);
        assert_eq!(err("ACQUIRE k"), ErrorCode::BadArgs);
        assert_eq!(err("ACQUIRE k ten"), ErrorCode::BadArgs);
        assert_eq!(err("ACQUIRE k 1000 5 6"), ErrorCode::BadArgs);
        assert_eq!(err("ACQUIRE k 1000 ID=123"), ErrorCode::BadArgs);
        assert_eq!(
            err(&format!("ACQUIRE k 1000 ID={}", "g".repeat(32))),
            ErrorCode::BadArgs
        );
        assert_eq!(err("ACQUIRE k 99999999999"), ErrorCode::BadArgs);
        assert_eq!(err("ACQUIRE k 1"), ErrorCode::BadTtl);
        assert_eq!(err("ACQUIRE k 1000 4000000000"), ErrorCode::BadWait);
        assert_eq!(
            err(&format!("ACQUIRE {} 1000", "k".repeat(1025))),
            ErrorCode::BadKey
        );
        assert_eq!(
            err(&format!("ACQUIRE k 1000 META={}", "m".repeat(1025))),
            ErrorCode::MetaTooLong
        );
        assert_eq!(err("RENEW k nothex 100"), ErrorCode::BadArgs);
        assert_eq!(err("RELEASE k"), ErrorCode::BadArgs);
        assert_eq!(err("CHECK k -1"), ErrorCode::BadArgs);
        assert_eq!(err("PING extra"), ErrorCode::BadArgs);
        assert_eq!(parse(&[0xff, 0xfe]).unwrap_err().code, ErrorCode::BadArgs);
    }

    #[test]
    fn parses_the_cluster_commands_and_names_bad_ones() {
        assert_eq!(
            request("cluster status"),
            Request::ClusterStatus { extended: true }
        );
        let Request::ClusterInit { members } = request("CLUSTER INIT 1=a:1/a:2,2=b:1/b:2") else {
            panic!("not an INIT");
        };
        assert_eq!((members.len(), members[1].id), (2, 2));
        let Request::ClusterAdd { member } = request("CLUSTER ADD 4 d:1/d:2") else {
            panic!("not an ADD");
        };
        assert_eq!((member.id, member.peer_addr.as_str()), (4, "d:1"));
        assert_eq!(
            request("CLUSTER REMOVE 3"),
            Request::ClusterRemove { id: 3 }
        );
        for bad in [
            "CLUSTER",
            "CLUSTER FROB",
            "CLUSTER STATUS x",
            "CLUSTER INIT",
            "CLUSTER INIT 1=a",
            "CLUSTER ADD 4",
            "CLUSTER ADD 0 a/b",
            "CLUSTER ADD x a/b",
            "CLUSTER ADD 4 nocolon",
            "CLUSTER REMOVE 0",
            "CLUSTER REMOVE",
        ] {
            assert_eq!(err(bad), ErrorCode::BadArgs, "{bad}");
        }
    }

    /// Random and mutated lines never panic the parser, and whatever parses is in range.
    #[test]
    fn mutated_lines_never_panic() {
        use rand::rngs::StdRng;
        use rand::{Rng, SeedableRng};
        let mut rng = StdRng::seed_from_u64(0xc0_501e);
        let lines = [
            "ACQUIRE order:1842 30000 500 META=x RELEASE_ON_DISCONNECT",
            "RENEW k 000102030405060708090a0b0c0d0e0f 100",
            "RELEASE k 000102030405060708090a0b0c0d0e0f",
            "CHECK k 18446744073709551615",
            "INSPECT k",
            "WATCH k",
        ];
        let mut parsed = 0;
        for _ in 0..20_000 {
            let mut line = lines[rng.random_range(0..lines.len())].as_bytes().to_vec();
            for _ in 0..rng.random_range(1..4) {
                let at = rng.random_range(0..line.len().max(1));
                match rng.random_range(0..3) {
                    0 if !line.is_empty() => line[at] = rng.random(),
                    1 if !line.is_empty() => {
                        line.remove(at);
                    }
                    _ => line.insert(at.min(line.len()), rng.random()),
                }
            }
            if let Ok(Command::Request(request)) = parse(&line) {
                request.validate().unwrap();
                parsed += 1;
            }
        }
        assert!(parsed > 500, "only {parsed} mutated lines parsed");
    }

    #[test]
    fn help_lists_the_commands() {
        assert_eq!(HELP, format!("OK commands: {COMMANDS}"));
    }
}
