//! Durations as people type them on a command line: `30s`, `500ms`, `1.5ms`, `250us`, `1m30s`.
//!
//! One parser for every tenure program (the `tenure` command line and `tenure-loadgen`), so a
//! flag means the same thing everywhere. A unit is required: `30` alone is ambiguous (the
//! command line once read it as milliseconds, the load generator as seconds).
//! [`parse_duration_or_bare`] still accepts a bare number with the old meaning of each program,
//! for scripts written before units were required; the caller prints the deprecation note.

use std::time::Duration;

use thiserror::Error;

/// Longest duration accepted: far beyond any TTL, wait or run length, and small enough that
/// every sum and product below stays exact in 128-bit nanoseconds.
pub const DURATION_MAX: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// The units a duration part may carry, with their length in nanoseconds.
const UNITS_NS: [(&str, u128); 6] = [
    ("ns", 1),
    ("us", 1_000),
    ("ms", 1_000_000),
    ("s", 1_000_000_000),
    ("m", 60_000_000_000),
    ("h", 3_600_000_000_000),
];

/// Most digits after a decimal point: nanoseconds are the finest unit, so more digits than
/// that could only be rounding noise (and could overflow the fraction arithmetic).
const FRACTION_DIGITS_MAX: usize = 9;

/// Why a duration did not parse.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum DurationError {
    /// Nothing but whitespace.
    #[error("empty duration")]
    Empty,
    /// A number without a unit (`30`); [`parse_duration_or_bare`] accepts it, with a note.
    #[error("{0:?} has no unit: write it as e.g. 30s, 500ms, 250us, 2m or 1h")]
    MissingUnit(String),
    /// Not `<number><unit>` parts.
    #[error("{text:?}: expected a number at {at:?}")]
    ExpectedNumber {
        /// The whole text.
        text: String,
        /// Where a number should start.
        at: String,
    },
    /// A part with a unit that is not one of `ns`, `us`, `ms`, `s`, `m`, `h`.
    #[error("{text:?}: unknown unit {unit:?} (use ns, us, ms, s, m or h)")]
    UnknownUnit {
        /// The whole text.
        text: String,
        /// The unit as written.
        unit: String,
    },
    /// Longer than [`DURATION_MAX`], or a number with too many digits.
    #[error("{0:?} is too long (at most 100 years, 9 decimal places)")]
    TooLong(String),
}

/// A duration parsed by [`parse_duration_or_bare`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Parsed {
    /// The duration.
    pub duration: Duration,
    /// True when the text was a bare number, read in the caller's legacy unit: the caller
    /// should print a deprecation note.
    pub bare: bool,
}

/// Parses one or more `<number><unit>` parts with no space between them (`30s`, `1m30s`,
/// `1.5ms`); units `ns`, `us`, `ms`, `s`, `m`, `h`. Surrounding whitespace is ignored.
///
/// # Errors
/// A [`DurationError`] naming what is wrong; a bare number is [`DurationError::MissingUnit`].
pub fn parse_duration(text: &str) -> Result<Duration, DurationError> {
    let text = text.trim();
    if text.is_empty() {
        return Err(DurationError::Empty);
    }
    if is_bare_number(text) {
        return Err(DurationError::MissingUnit(text.to_owned()));
    }
    let mut total_ns: u128 = 0;
    let mut rest = text;
    while !rest.is_empty() {
        let (number, after_number) = split_number(text, rest)?;
        let unit_len = after_number
            .bytes()
            .take_while(u8::is_ascii_alphabetic)
            .count();
        let unit = &after_number[..unit_len];
        let unit_ns = unit_ns(text, unit)?;
        total_ns += number_ns(text, number, unit_ns)?;
        if total_ns > DURATION_MAX.as_nanos() {
            return Err(DurationError::TooLong(text.to_owned()));
        }
        rest = &after_number[unit_len..];
    }
    Ok(from_ns(total_ns))
}

/// Parses like [`parse_duration`], but also accepts a bare number (`30`, `0.5`) as a count of
/// `bare_unit`, the meaning a program gave it before units were required, and says so in
/// [`Parsed::bare`].
///
/// # Errors
/// As [`parse_duration`], except that a bare number is accepted.
pub fn parse_duration_or_bare(text: &str, bare_unit: Duration) -> Result<Parsed, DurationError> {
    match parse_duration(text) {
        Ok(duration) => Ok(Parsed {
            duration,
            bare: false,
        }),
        Err(DurationError::MissingUnit(number)) => {
            let total_ns = number_ns(&number, &number, bare_unit.as_nanos())?;
            if total_ns > DURATION_MAX.as_nanos() {
                return Err(DurationError::TooLong(number));
            }
            Ok(Parsed {
                duration: from_ns(total_ns),
                bare: true,
            })
        }
        Err(e) => Err(e),
    }
}

fn is_bare_number(text: &str) -> bool {
    text.bytes().any(|b| b.is_ascii_digit())
        && text.bytes().all(|b| b.is_ascii_digit() || b == b'.')
}

/// Splits the leading `digits[.digits]` off `rest`.
fn split_number<'a>(text: &str, rest: &'a str) -> Result<(&'a str, &'a str), DurationError> {
    let len = rest
        .bytes()
        .take_while(|b| b.is_ascii_digit() || *b == b'.')
        .count();
    if len == 0 || !rest.as_bytes()[0].is_ascii_digit() {
        return Err(DurationError::ExpectedNumber {
            text: text.to_owned(),
            at: rest.to_owned(),
        });
    }
    Ok(rest.split_at(len))
}

fn unit_ns(text: &str, unit: &str) -> Result<u128, DurationError> {
    UNITS_NS
        .iter()
        .find(|(name, _)| *name == unit)
        .map(|(_, ns)| *ns)
        .ok_or_else(|| DurationError::UnknownUnit {
            text: text.to_owned(),
            unit: unit.to_owned(),
        })
}

/// `number` (`12` or `1.25`) times `unit_ns`, in whole nanoseconds (a finer remainder is cut).
fn number_ns(text: &str, number: &str, unit_ns: u128) -> Result<u128, DurationError> {
    let too_long = || DurationError::TooLong(text.to_owned());
    let bad = || DurationError::ExpectedNumber {
        text: text.to_owned(),
        at: number.to_owned(),
    };
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    if whole.is_empty() || fraction.contains('.') || (number.ends_with('.')) {
        return Err(bad());
    }
    if fraction.len() > FRACTION_DIGITS_MAX {
        return Err(too_long());
    }
    // u64 digits at most: anything longer is over DURATION_MAX in any unit.
    let whole: u64 = whole.parse().map_err(|_| too_long())?;
    let fraction_scale = 10u128.pow(u32::try_from(fraction.len()).expect("at most 9"));
    let fraction: u128 = if fraction.is_empty() {
        0
    } else {
        fraction.parse().map_err(|_| bad())?
    };
    let whole_ns = u128::from(whole) * unit_ns;
    Ok(whole_ns + fraction * unit_ns / fraction_scale)
}

fn from_ns(total_ns: u128) -> Duration {
    let secs = u64::try_from(total_ns / 1_000_000_000).expect("under DURATION_MAX");
    let nanos = u32::try_from(total_ns % 1_000_000_000).expect("under a second");
    Duration::new(secs, nanos)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(text: &str) -> Duration {
        parse_duration(text).unwrap_or_else(|e| panic!("{text:?}: {e}"))
    }

    #[test]
    fn parses_every_unit_sums_and_fractions() {
        assert_eq!(ok("30s"), Duration::from_secs(30));
        assert_eq!(ok("500ms"), Duration::from_millis(500));
        assert_eq!(ok("250us"), Duration::from_micros(250));
        assert_eq!(ok("7ns"), Duration::from_nanos(7));
        assert_eq!(ok("2m"), Duration::from_secs(120));
        assert_eq!(ok("1h"), Duration::from_secs(3600));
        assert_eq!(ok("1m30s"), Duration::from_secs(90));
        assert_eq!(ok("1h2m3s4ms"), Duration::from_millis(3_723_004));
        assert_eq!(ok("1.5ms"), Duration::from_micros(1500));
        assert_eq!(ok("0.25s"), Duration::from_millis(250));
        assert_eq!(ok(" 5s "), Duration::from_secs(5));
        assert_eq!(ok("0ms"), Duration::ZERO);
    }

    #[test]
    fn a_bare_number_needs_a_unit() {
        assert_eq!(
            parse_duration("250"),
            Err(DurationError::MissingUnit("250".into()))
        );
        assert!(matches!(
            parse_duration("1.5"),
            Err(DurationError::MissingUnit(_))
        ));
    }

    #[test]
    fn bare_numbers_keep_each_programs_old_meaning() {
        let ms = Duration::from_millis(1);
        let s = Duration::from_secs(1);
        let bare = |text, unit| parse_duration_or_bare(text, unit).unwrap();
        assert_eq!(
            bare("250", ms),
            Parsed {
                duration: Duration::from_millis(250),
                bare: true
            }
        );
        assert_eq!(bare("10", s).duration, Duration::from_secs(10));
        assert_eq!(bare("0.5", s).duration, Duration::from_millis(500));
        assert_eq!(
            bare("10s", ms),
            Parsed {
                duration: Duration::from_secs(10),
                bare: false
            },
            "a unit wins over the legacy one"
        );
        assert!(parse_duration_or_bare("10x", s).is_err());
        assert!(parse_duration_or_bare("", s).is_err());
    }

    #[test]
    fn rejects_malformed_and_overlong() {
        for bad in [
            "",
            "  ",
            "s",
            "10x",
            "10 s",
            "-5s",
            "1.s",
            ".5s",
            "1..5s",
            "1.2.3s",
            "5sms",
            "s5",
            "1m30",
            "1.0000000001s",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad:?} was accepted");
        }
        assert!(matches!(
            parse_duration("99999999999999999999h"),
            Err(DurationError::TooLong(_))
        ));
        assert!(matches!(
            parse_duration("1000000h"),
            Err(DurationError::TooLong(_))
        ));
        assert!(matches!(
            parse_duration("10q"),
            Err(DurationError::UnknownUnit { .. })
        ));
        assert_eq!(parse_duration(""), Err(DurationError::Empty));
        assert!(parse_duration_or_bare("99999999999999999999", Duration::from_secs(1)).is_err());
    }

    #[test]
    fn errors_name_the_problem() {
        let message = parse_duration("10q").unwrap_err().to_string();
        assert!(message.contains("unknown unit \"q\""), "{message}");
        let message = parse_duration("30").unwrap_err().to_string();
        assert!(message.contains("no unit"), "{message}");
    }
}
