//! The older clap-style lines `tenure console` accepted before it read the server console's
//! grammar ([`tenure_protocol::console`], the one parser both share), kept as deprecated
//! aliases.

use std::time::Duration;

use clap::Parser;
use tenure::Bytes;
use tenure_protocol::console::Command as ConsoleCommand;
use tenure_protocol::Request;

use crate::cli::Command;

/// A line of the grammar `tenure console` read before it took the server's: the command
/// line's own subcommands (`acquire k --ttl 5s --wait 1s --meta m`, `renew k <lease> --ttl
/// 5s`), parsed by the command line's parser. Only the forms the new grammar cannot read are
/// taken; the others read the same in both.
#[derive(Parser, Debug)]
#[command(no_binary_name = true, disable_help_flag = true)]
struct LegacyLine {
    #[command(subcommand)]
    command: Command,
}

/// Reads `line` in the old console grammar (deprecated), or None if it is not one. `exit`
/// was the old spelling of QUIT.
pub fn parse_legacy(line: &str) -> Option<ConsoleCommand> {
    let words: Vec<&str> = line.split_whitespace().collect();
    if words == ["exit"] {
        return Some(ConsoleCommand::Quit);
    }
    let request = match LegacyLine::try_parse_from(&words).ok()?.command {
        Command::Acquire {
            key,
            ttl,
            wait,
            meta,
            kind,
        } => Request::Acquire {
            key: Bytes::from(key),
            ttl_ms: ms_u32(ttl)?,
            wait_ms: ms_u32(wait)?,
            release_on_disconnect: false,
            meta: Bytes::from(meta.unwrap_or_default()),
            acquire_id: None,
            kind: kind.kind(),
            session_id: None,
        },
        Command::Renew { key, lease, ttl } => Request::Renew {
            key: Bytes::from(key),
            lease_id: lease,
            ttl_ms: ms_u32(ttl)?,
        },
        _ => return None,
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
    use tenure_protocol::console::parse;

    const LEASE: &str = "000102030405060708090a0b0c0d0e0f";

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
