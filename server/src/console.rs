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

use bytes::Bytes;
use tenure_protocol::frame::validate_key;
use tenure_protocol::{ErrorCode, EventKind, FrameError, LeaseId, Request, Response};

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

/// The reply to HELP: every command on one line.
pub const HELP: &str = "OK commands: PING | ACQUIRE <key> <ttl_ms> [<wait_ms>] [META=<text>] \
[RELEASE_ON_DISCONNECT] | RENEW <key> <lease> <ttl_ms> | RELEASE <key> <lease> | INSPECT <key> | \
CHECK <key> <token> | STATS | WATCH <key> | UNWATCH <key> | HELP | QUIT";

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
    let Some(name) = words.next() else {
        return Ok(Command::Empty);
    };
    let args: Vec<&str> = words.collect();
    let name = name.to_ascii_uppercase();
    let usage = |form: &str| bad_args(format!("usage: {form}"));
    let request = match (name.as_str(), args.as_slice()) {
        ("PING", []) => Request::Ping,
        ("STATS", []) => Request::Stats,
        ("HELP", []) => return Ok(Command::Help),
        ("QUIT", []) => return Ok(Command::Quit),
        ("ACQUIRE", [key, ttl, rest @ ..]) => parse_acquire(key, ttl, rest)?,
        ("ACQUIRE", _) => {
            return Err(usage(
                "ACQUIRE <key> <ttl_ms> [<wait_ms>] [META=<text>] [RELEASE_ON_DISCONNECT]",
            ))
        }
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
        },
        ("INSPECT", _) => return Err(usage("INSPECT <key>")),
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
        ("PING" | "STATS" | "HELP" | "QUIT", _) => {
            return Err(bad_args(format!("{name} takes no arguments")))
        }
        _ => {
            return Err(FrameError::new(
                ErrorCode::UnknownOpcode,
                format!("unknown command {:?}; try HELP", truncate(&name, 32)),
            ))
        }
    };
    request.validate()?;
    Ok(Command::Request(request))
}

fn parse_acquire(key: &str, ttl: &str, rest: &[&str]) -> Result<Request, FrameError> {
    let mut wait_ms = 0;
    let mut meta = Bytes::new();
    let mut release_on_disconnect = false;
    for (i, word) in rest.iter().enumerate() {
        let upper = word.to_ascii_uppercase();
        if let Some(value) = word.get(5..).filter(|_| upper.starts_with("META=")) {
            meta = Bytes::copy_from_slice(value.as_bytes());
        } else if upper == "RELEASE_ON_DISCONNECT" {
            release_on_disconnect = true;
        } else if i == 0 {
            wait_ms = parse_u32("wait_ms", word)?;
        } else {
            return Err(bad_args(format!(
                "unexpected argument {:?}",
                truncate(word, 32)
            )));
        }
    }
    Ok(Request::Acquire {
        key: parse_key(key)?,
        ttl_ms: parse_u32("ttl_ms", ttl)?,
        wait_ms,
        release_on_disconnect,
        meta,
    })
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

fn truncate(text: &str, chars_max: usize) -> String {
    text.chars().take(chars_max).collect()
}

/// Writes bytes that may not be text so that the reply stays one line of printable words:
/// printable ASCII other than space and backslash as is, everything else as `\xNN`.
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

/// Appends the reply line for `response` to `out`, with its `\n`.
pub fn format(response: &Response, out: &mut String) {
    use std::fmt::Write;
    let _ = match response {
        Response::Pong => out.write_str("PONG"),
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
        Response::Locked { token, ttl_left_ms } => {
            write!(out, "LOCKED token={token} ttl_ms={ttl_left_ms}")
        }
        Response::Renewed { ttl_ms } => write!(out, "OK ttl_ms={ttl_ms}"),
        Response::Lost => out.write_str("LOST"),
        Response::Released => out.write_str("OK"),
        Response::NotOwner => out.write_str("NOT_OWNER"),
        Response::Free => out.write_str("FREE"),
        Response::Held {
            token,
            ttl_left_ms,
            waiters,
            meta,
        } => {
            format_held(*token, *ttl_left_ms, *waiters, meta, out);
            Ok(())
        }
        Response::Current => out.write_str("CURRENT"),
        Response::Stale => out.write_str("STALE"),
        Response::Stats(pairs) => {
            out.push_str("OK");
            for (name, value) in pairs {
                let _ = write!(out, " {name}={value}");
            }
            Ok(())
        }
        Response::Watching { holder } => {
            out.push_str("OK watching ");
            match holder {
                None => out.push_str("FREE"),
                Some(h) => format_held(h.token, h.ttl_left_ms, h.waiters, &h.meta, out),
            }
            Ok(())
        }
        Response::Unwatched => out.write_str("OK"),
        Response::Event {
            kind,
            key,
            token,
            meta,
        } => {
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
            Ok(())
        }
        Response::Error { code, message } => {
            // The reason is free text but must stay on one line.
            let message: String = message
                .chars()
                .map(|c| if c.is_control() { ' ' } else { c })
                .collect();
            write!(out, "ERR {} {message}", code.name())
        }
    };
    out.push('\n');
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
                meta: Bytes::new()
            }
        );
        assert_eq!(
            request("ACQUIRE k 1000 500 meta=10.0.0.1:80 release_on_disconnect"),
            Request::Acquire {
                key: Bytes::from_static(b"k"),
                ttl_ms: 1000,
                wait_ms: 500,
                release_on_disconnect: true,
                meta: Bytes::from_static(b"10.0.0.1:80")
            }
        );
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

    #[test]
    fn rejects_malformed_lines_with_codes() {
        assert_eq!(err("FROB"), ErrorCode::UnknownOpcode);
        assert_eq!(err("ACQUIRE"), ErrorCode::BadArgs);
        assert_eq!(err("ACQUIRE k"), ErrorCode::BadArgs);
        assert_eq!(err("ACQUIRE k ten"), ErrorCode::BadArgs);
        assert_eq!(err("ACQUIRE k 1000 5 6"), ErrorCode::BadArgs);
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
