//! Human-friendly durations for the command line: `30s`, `500ms`, `2m`, `1h`, `1m30s`.

use std::time::Duration;

/// Parses a duration written as one or more `<number><unit>` parts, units `ms`, `s`, `m`, `h`
/// (for example `30s`, `500ms`, `1m30s`). A bare number is read as milliseconds.
///
/// # Errors
/// A message naming what is wrong: empty text, a missing number, an unknown unit, overflow.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    if text.is_empty() {
        return Err("empty duration".into());
    }
    if text.bytes().all(|b| b.is_ascii_digit()) {
        let ms: u64 = text.parse().map_err(|e| format!("{text:?}: {e}"))?;
        return Ok(Duration::from_millis(ms));
    }
    let mut total_ms: u64 = 0;
    let mut rest = text;
    while !rest.is_empty() {
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            return Err(format!("{text:?}: expected a number at {rest:?}"));
        }
        let number: u64 = rest[..digits]
            .parse()
            .map_err(|e| format!("{text:?}: {e}"))?;
        rest = &rest[digits..];
        let unit_len = rest.bytes().take_while(u8::is_ascii_alphabetic).count();
        let unit_ms = match &rest[..unit_len] {
            "ms" => 1,
            "s" => 1_000,
            "m" => 60_000,
            "h" => 3_600_000,
            other => return Err(format!("{text:?}: unknown unit {other:?} (ms, s, m, h)")),
        };
        rest = &rest[unit_len..];
        total_ms = number
            .checked_mul(unit_ms)
            .and_then(|ms| total_ms.checked_add(ms))
            .ok_or_else(|| format!("{text:?}: too long"))?;
    }
    Ok(Duration::from_millis(total_ms))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units_and_sums() {
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_duration("1m30s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("250"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration(" 5s "), Ok(Duration::from_secs(5)));
    }

    #[test]
    fn rejects_malformed() {
        for bad in [
            "",
            "s",
            "10x",
            "10 s",
            "-5s",
            "1.5s",
            "99999999999999999999h",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad:?} was accepted");
        }
    }
}
