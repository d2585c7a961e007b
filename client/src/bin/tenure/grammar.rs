//! The text console's grammar (PROTOCOL.md section 4, the server's `console.rs`), read by
//! `tenure console`, and the older clap-style lines it accepted before, kept as deprecated
//! aliases.
//!
//! The server's parser lives in the server crate, which a client must not depend on, so this
//! is a second implementation of the same grammar; a test feeds both the same lines (valid,
//! malformed and randomly mutated) and requires the same request or the same error code.

use std::time::Duration;

use clap::{Parser, Subcommand};
use tenure::{Bytes, ErrorCode, LeaseId};
use tenure_protocol::frame::validate_key;
use tenure_protocol::{FrameError, Request};

use crate::cli::{duration_flag, parse_lease_id};

/// The commands, as the server's HELP lists them.
pub const COMMANDS: &str = "PING | ACQUIRE <key> <ttl_ms> [<wait_ms>] [META=<text>] \
[RELEASE_ON_DISCONNECT] | RENEW <key> <lease> <ttl_ms> | RELEASE <key> <lease> | INSPECT <key> | \
CHECK <key> <token> | STATS | WATCH <key> | UNWATCH <key> | HELP | QUIT";

/// Longest piece of a bad word quoted back in an error.
const QUOTED_CHARS_MAX: usize = 32;

/// What one console line asks for.
#[derive(Debug, PartialEq, Eq)]
pub enum ConsoleCommand {
    /// An operation of the protocol.
    Request(Request),
    /// List the commands.
    Help,
    /// End the session.
    Quit,
    /// A blank line: no answer.
    Empty,
}

fn bad_args(message: String) -> FrameError {
    FrameError::new(ErrorCode::BadArgs, message)
}

/// Parses one line in the text console's grammar: commands case-insensitive, arguments
/// separated by whitespace, durations in whole milliseconds.
///
/// # Errors
/// The [`FrameError`] the server's console would answer `ERR <CODE> <reason>` with.
pub fn parse(line: &[u8]) -> Result<ConsoleCommand, FrameError> {
    let text = std::str::from_utf8(line).map_err(|_| bad_args("line is not UTF-8 text".into()))?;
    let mut words = text.split_ascii_whitespace();
    let Some(name) = words.next() else {
        return Ok(ConsoleCommand::Empty);
    };
    let args: Vec<&str> = words.collect();
    let name = name.to_ascii_uppercase();
    let request = match (name.as_str(), args.as_slice()) {
        ("HELP", []) => return Ok(ConsoleCommand::Help),
        ("QUIT", []) => return Ok(ConsoleCommand::Quit),
        (_, args) => parse_request(&name, args)?,
    };
    request.validate()?;
    Ok(ConsoleCommand::Request(request))
}

/// The request named `name` (upper case) with `args`, before the limits are checked.
fn parse_request(name: &str, args: &[&str]) -> Result<Request, FrameError> {
    let usage = |form: &str| bad_args(format!("usage: {form}"));
    Ok(match (name, args) {
        ("PING", []) => Request::Ping,
        ("STATS", []) => Request::Stats,
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
                format!("unknown command {:?}; try HELP", truncate(name)),
            ))
        }
    })
}

/// `ACQUIRE <key> <ttl_ms> [<wait_ms>] [META=<text>] [RELEASE_ON_DISCONNECT]`: the wait must
/// come first; the two options may follow in any order.
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
                truncate(word)
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

fn truncate(text: &str) -> String {
    text.chars().take(QUOTED_CHARS_MAX).collect()
}

/// A line of the grammar `tenure console` read before it took the server's: the command
/// line's subcommands (`acquire k --ttl 5s --wait 1s --meta m`, `renew k <lease> --ttl 5s`).
/// Only the forms the new grammar cannot read are kept; the others read the same in both.
#[derive(Parser, Debug)]
#[command(no_binary_name = true, disable_help_flag = true)]
struct LegacyLine {
    #[command(subcommand)]
    command: LegacyCommand,
}

#[derive(Subcommand, Debug)]
enum LegacyCommand {
    Acquire {
        key: String,
        #[arg(long, value_parser = duration_flag)]
        ttl: Duration,
        #[arg(long, value_parser = duration_flag, default_value = "0ms")]
        wait: Duration,
        #[arg(long)]
        meta: Option<String>,
    },
    Renew {
        key: String,
        #[arg(value_parser = parse_lease_id)]
        lease: LeaseId,
        #[arg(long, value_parser = duration_flag)]
        ttl: Duration,
    },
}

/// Reads `line` in the old console grammar (deprecated), or None if it is not one. `exit`
/// was the old spelling of QUIT.
pub fn parse_legacy(line: &str) -> Option<ConsoleCommand> {
    let words: Vec<&str> = line.split_whitespace().collect();
    if words == ["exit"] {
        return Some(ConsoleCommand::Quit);
    }
    let request = match LegacyLine::try_parse_from(&words).ok()?.command {
        LegacyCommand::Acquire {
            key,
            ttl,
            wait,
            meta,
        } => Request::Acquire {
            key: Bytes::from(key),
            ttl_ms: ms_u32(ttl)?,
            wait_ms: ms_u32(wait)?,
            release_on_disconnect: false,
            meta: Bytes::from(meta.unwrap_or_default()),
        },
        LegacyCommand::Renew { key, lease, ttl } => Request::Renew {
            key: Bytes::from(key),
            lease_id: lease,
            ttl_ms: ms_u32(ttl)?,
        },
    };
    request.validate().ok()?;
    Some(ConsoleCommand::Request(request))
}

fn ms_u32(duration: Duration) -> Option<u32> {
    u32::try_from(duration.as_millis()).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tenure_server::console as server;

    /// What the server's console makes of `line`, in this module's terms.
    fn server_parse(line: &[u8]) -> Result<ConsoleCommand, FrameError> {
        server::parse(line).map(|command| match command {
            server::Command::Request(request) => ConsoleCommand::Request(request),
            server::Command::Help => ConsoleCommand::Help,
            server::Command::Quit => ConsoleCommand::Quit,
            server::Command::Empty => ConsoleCommand::Empty,
        })
    }

    fn assert_same(line: &[u8]) {
        let ours = parse(line);
        let theirs = server_parse(line);
        let show = String::from_utf8_lossy(line);
        match (&ours, &theirs) {
            (Ok(a), Ok(b)) => assert_eq!(a, b, "{show:?}"),
            (Err(a), Err(b)) => {
                assert_eq!((a.code, &a.message), (b.code, &b.message), "{show:?}");
            }
            _ => panic!("{show:?}: tenure console {ours:?}, server console {theirs:?}"),
        }
    }

    const LEASE: &str = "000102030405060708090a0b0c0d0e0f";

    #[test]
    fn reads_lines_as_the_server_console_does() {
        assert_eq!(
            parse(b"ACQUIRE k 30000 5000").unwrap(),
            ConsoleCommand::Request(Request::Acquire {
                key: Bytes::from_static(b"k"),
                ttl_ms: 30000,
                wait_ms: 5000,
                release_on_disconnect: false,
                meta: Bytes::new(),
            })
        );
        let lines = [
            "ACQUIRE k 30000 5000".to_owned(),
            "acquire order:1842 30000".into(),
            "ACQUIRE k 1000 500 meta=10.0.0.1:80 release_on_disconnect".into(),
            "ACQUIRE k 1000 RELEASE_ON_DISCONNECT META=x".into(),
            format!("RENEW k {LEASE} 100"),
            format!("release k {LEASE}"),
            "INSPECT k".into(),
            "CHECK k 18446744073709551615".into(),
            "  PiNg  ".into(),
            "STATS".into(),
            "watch k".into(),
            "UNWATCH k".into(),
            "help".into(),
            "QUIT".into(),
            "   ".into(),
            "".into(),
        ];
        for line in &lines {
            assert!(parse(line.as_bytes()).is_ok(), "{line:?}");
            assert_same(line.as_bytes());
        }
    }

    #[test]
    fn refuses_lines_as_the_server_console_does() {
        let lines = [
            "FROB".to_owned(),
            "ACQUIRE".into(),
            "ACQUIRE k".into(),
            "ACQUIRE k ten".into(),
            "ACQUIRE k 1000 5 6".into(),
            "ACQUIRE k 99999999999".into(),
            "ACQUIRE k 1".into(),
            "ACQUIRE k 1000 4000000000".into(),
            "ACQUIRE k 30s".into(),
            "ACQUIRE k --ttl 5s".into(),
            format!("ACQUIRE {} 1000", "k".repeat(1025)),
            format!("ACQUIRE k 1000 META={}", "m".repeat(1025)),
            "RENEW k nothex 100".into(),
            format!("RENEW k 100 {LEASE}"),
            "RELEASE k".into(),
            "CHECK k -1".into(),
            "PING extra".into(),
            "HELP me".into(),
            "exit".into(),
        ];
        for line in &lines {
            assert!(parse(line.as_bytes()).is_err(), "{line:?}");
            assert_same(line.as_bytes());
        }
        assert_same(&[0xff, 0xfe]);
    }

    /// Random mutations of valid lines: both parsers accept the same ones, as the same request,
    /// and refuse the others with the same code and reason.
    #[test]
    fn mutated_lines_read_the_same_on_both_surfaces() {
        use rand::rngs::StdRng;
        use rand::{Rng, SeedableRng};
        let mut rng = StdRng::seed_from_u64(0x7e_4c1e);
        let lines = [
            "ACQUIRE order:1842 30000 500 META=x RELEASE_ON_DISCONNECT".to_owned(),
            format!("RENEW k {LEASE} 100"),
            format!("RELEASE k {LEASE}"),
            "CHECK k 18446744073709551615".into(),
            "INSPECT k".into(),
            "WATCH k".into(),
            "HELP".into(),
        ];
        let mut accepted = 0;
        for _ in 0..5_000 {
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
            assert_same(&line);
            accepted += usize::from(parse(&line).is_ok());
        }
        assert!(accepted > 100, "only {accepted} mutated lines parsed");
    }

    #[test]
    fn help_lists_the_servers_commands() {
        assert_eq!(format!("OK commands: {COMMANDS}"), server::HELP);
    }

    #[test]
    fn old_spellings_still_read_as_before() {
        let acquire = parse_legacy("acquire con --ttl 5s --wait 1s --meta x").unwrap();
        assert_eq!(
            acquire,
            parse(b"ACQUIRE con 5000 1000 META=x").unwrap(),
            "the same request as the new spelling"
        );
        let renew = parse_legacy(&format!("renew k {LEASE} --ttl 250")).unwrap();
        assert_eq!(
            renew,
            parse(format!("RENEW k {LEASE} 250").as_bytes()).unwrap()
        );
        assert_eq!(parse_legacy("exit"), Some(ConsoleCommand::Quit));
        assert_eq!(parse_legacy("acquire k"), None, "no --ttl");
        assert_eq!(
            parse_legacy("acquire k --ttl 1ms"),
            None,
            "under the TTL minimum"
        );
        assert_eq!(parse_legacy("run --key k --ttl 1s -- true"), None);
        assert_eq!(parse_legacy("bogus"), None);
    }
}
