//! The lease id: the unguessable name of one grant.
use std::fmt;

/// A lease id: 128 random bits chosen by the server for one grant, unique per grant.
///
/// Renew and release must present it; the server compares it atomically with the change it
/// makes, so a holder whose lease expired and was granted to someone else can change nothing.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct LeaseId(pub [u8; 16]);

impl LeaseId {
    /// Width of a lease id on the wire, in bytes.
    pub const LEN: usize = 16;

    /// Builds a lease id from a 128-bit number (big-endian byte order).
    pub fn from_u128(value: u128) -> Self {
        LeaseId(value.to_be_bytes())
    }

    /// The lease id as a 128-bit number (big-endian byte order).
    pub fn as_u128(&self) -> u128 {
        u128::from_be_bytes(self.0)
    }

    /// Parses the 32-digit lowercase or uppercase hex form used by the console.
    pub fn from_hex(text: &str) -> Option<Self> {
        // `from_str_radix` would also take a leading '+', so check every digit first.
        if text.len() != 2 * Self::LEN || !text.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        u128::from_str_radix(text, 16).ok().map(Self::from_u128)
    }
}

impl fmt::Display for LeaseId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.as_u128())
    }
}

impl fmt::Debug for LeaseId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LeaseId({self})")
    }
}

/// An acquire id: 128 bits a client chooses at random for one ACQUIRE and sends again, unchanged,
/// with every retry of it, so the server can tell a retry from a new request (PROTOCOL.md
/// "Acquire ids"). It names one ACQUIRE of one key.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct AcquireId(pub [u8; 16]);

impl AcquireId {
    /// Width of an acquire id on the wire, in bytes.
    pub const LEN: usize = 16;

    /// Builds an acquire id from a 128-bit number (big-endian byte order).
    pub fn from_u128(value: u128) -> Self {
        AcquireId(value.to_be_bytes())
    }

    /// Parses the 32-digit hex form used by the console (as [`LeaseId::from_hex`]).
    pub fn from_hex(text: &str) -> Option<Self> {
        LeaseId::from_hex(text).map(|id| AcquireId(id.0))
    }
}

impl fmt::Display for AcquireId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", LeaseId(self.0))
    }
}

impl fmt::Debug for AcquireId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "AcquireId({self})")
    }
}

/// A session id: 128 random bits the server picks for one session (PROTOCOL.md 3.11). Like a
/// lease id it is a bearer name: whoever presents it may keep the session alive, acquire in
/// it or close it (within its identity).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct SessionId(pub [u8; 16]);

impl SessionId {
    /// Width of a session id on the wire, in bytes.
    pub const LEN: usize = 16;

    /// Builds a session id from a 128-bit number (big-endian byte order).
    pub fn from_u128(value: u128) -> Self {
        SessionId(value.to_be_bytes())
    }

    /// Parses the 32-digit hex form used by the console (as [`LeaseId::from_hex`]).
    pub fn from_hex(text: &str) -> Option<Self> {
        LeaseId::from_hex(text).map(|id| SessionId(id.0))
    }
}

impl fmt::Display for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", LeaseId(self.0))
    }
}

impl fmt::Debug for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SessionId({self})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trip() {
        let id = LeaseId::from_u128(0x0123_4567_89ab_cdef_0011_2233_4455_6677);
        let text = id.to_string();
        assert_eq!(text, "0123456789abcdef0011223344556677");
        assert_eq!(LeaseId::from_hex(&text), Some(id));
        assert_eq!(LeaseId::from_hex(&text.to_uppercase()), Some(id));
        assert_eq!(LeaseId::from_hex("abc"), None);
        assert_eq!(LeaseId::from_hex(&"g".repeat(32)), None);
        assert_eq!(LeaseId::from_hex(&format!("+{}", "1".repeat(31))), None);
    }
}
