//! `key=value` fields of console replies and of the `tenure` command line's output.

/// The value of `name=` in `line`.
///
/// # Panics
/// When `line` has no such field.
pub fn field<'a>(line: &'a str, name: &str) -> &'a str {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(name).and_then(|r| r.strip_prefix('=')))
        .unwrap_or_else(|| panic!("no {name}= in {line:?}"))
}

/// The fencing token (`token=`) in `line`.
///
/// # Panics
/// When `line` has no token, or it is not a number.
pub fn token(line: &str) -> u64 {
    field(line, "token").parse().expect("token= is a number")
}
