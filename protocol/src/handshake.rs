//! The handshake that opens every binary connection.
//!
//! ```text
//! client -> server, 8 bytes (the hello):
//!  0      1   2   3   4          6          8
//! +------+---+---+---+----------+----------+
//! | 0x00 | T | N | R | version  | flags    |
//! |      |   |   |   | u16 BE   | u16 BE=0 |
//! +------+---+---+---+----------+----------+
//!
//! server -> client, 10 + body_len bytes (the answer):
//!  0      1   2   3   4          6          8           10
//! +------+---+---+---+----------+----------+-----------+------------------+
//! | 0x00 | T | N | R | version  | status   | body_len  | body             |
//! |      |   |   |   | u16 BE   | u16 BE   | u16 BE    | body_len bytes   |
//! +------+---+---+---+----------+----------+-----------+------------------+
//!
//! status 0 (accepted): body = the server's limits, six u32 BE, 24 bytes in version 1
//! (later servers may append more; a client skips what it does not know):
//! +---------------+---------------+------------+-------------+-------------+--------------+
//! | frame_len_max | in_flight_max | ttl_ms_max | wait_ms_max | key_len_max | meta_len_max |
//! +---------------+---------------+------------+-------------+-------------+--------------+
//!
//! status != 0 (refused): status is an error code (14 BAD_HANDSHAKE); body = UTF-8 reason,
//! at most ERROR_MESSAGE_LEN_MAX bytes. The server closes the connection after it.
//! ```
//!
//! The leading zero byte is what tells the server a binary client from a person at `nc`: no
//! console command starts with it. Every hello flag bit is reserved: a client sends zero and
//! the server refuses a hello with any bit set, so a later flag is never silently ignored.

use bytes::{Buf, BufMut, BytesMut};

use crate::error::{ErrorCode, ProtocolError};
use crate::limits::{ERROR_MESSAGE_LEN_MAX, FRAME_LEN_MAX, KEY_LEN_MAX, META_LEN_MAX};

/// The first four bytes of both handshake messages.
pub const MAGIC: [u8; 4] = [0x00, b'T', b'N', b'R'];
/// The protocol version this crate speaks.
pub const VERSION: u16 = 1;
/// Length of the client's hello, in bytes.
pub const HELLO_LEN: usize = 8;
/// Length of the server's answer before its body: magic, version, status, body length.
pub const HELLO_ACK_HEADER_LEN: usize = 10;
/// Length of the accepted answer's body in this version: six u32 limits.
pub const LIMITS_LEN: usize = 6 * 4;
/// Longest answer body a client accepts; a longer one is not a tenure server.
pub const HELLO_ACK_BODY_LEN_MAX: usize = 1024;

/// Most bytes a client reads of a console refusal sent in place of the answer
/// ([`console_refusal`]): the server's longest such line is far shorter.
pub const REFUSAL_LINE_LEN_MAX: usize = 512;
const _: () = assert!(LIMITS_LEN <= HELLO_ACK_BODY_LEN_MAX);
const _: () = assert!(ERROR_MESSAGE_LEN_MAX <= HELLO_ACK_BODY_LEN_MAX);

/// The client's hello.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hello {
    /// Protocol version the client speaks.
    pub version: u16,
}

/// The limits a server enforces, announced in its answer to the hello.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServerLimits {
    /// Largest request frame the server accepts, counted after the length prefix. It binds
    /// the client; it is never more than [`FRAME_LEN_MAX`], which bounds the server's replies.
    pub frame_len_max: u32,
    /// Requests the server lets one connection have unanswered.
    pub in_flight_max: u32,
    /// Longest lease the server grants, in milliseconds.
    pub ttl_ms_max: u32,
    /// Longest wait of a blocking acquire, in milliseconds.
    pub wait_ms_max: u32,
    /// Longest key, in bytes.
    pub key_len_max: u32,
    /// Longest holder metadata, in bytes.
    pub meta_len_max: u32,
}

/// The server's accepting answer to a hello.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HelloAck {
    /// Protocol version the server speaks; a client must close if it differs from its own.
    pub version: u16,
    /// What the server allows on this connection.
    pub limits: ServerLimits,
}

impl Hello {
    /// Appends the hello's 8 bytes.
    pub fn encode(&self, dst: &mut BytesMut) {
        dst.put_slice(&MAGIC);
        dst.put_u16(self.version);
        dst.put_u16(0);
    }

    /// Takes a hello off the front of `src` once 8 bytes are there.
    ///
    /// # Errors
    /// [`ProtocolError::BadHandshake`] when the magic is wrong or a reserved flag bit is set.
    pub fn decode(src: &mut BytesMut) -> Result<Option<Hello>, ProtocolError> {
        if src.len() < HELLO_LEN {
            return Ok(None);
        }
        if src[..4] != MAGIC {
            return Err(ProtocolError::BadHandshake(
                "magic bytes are not 00 54 4e 52".into(),
            ));
        }
        src.advance(4);
        let version = src.get_u16();
        let flags = src.get_u16();
        if flags != 0 {
            return Err(ProtocolError::BadHandshake(format!(
                "hello flags {flags:#06x}: every flag bit is reserved and must be zero"
            )));
        }
        Ok(Some(Hello { version }))
    }
}

/// A server at its connection limit answers a hello with a console line, `ERR <CODE>
/// <words>` (PROTOCOL.md 2), not a handshake answer. Given what came instead of the magic,
/// up to its newline (or all there is), the code and the words, if the line is one; `None`
/// for anything else (not a tenure server, or an unknown code).
pub fn console_refusal(answer: &[u8]) -> Option<(ErrorCode, String)> {
    let line = answer.split(|&b| b == b'\n').next()?;
    let line = std::str::from_utf8(line).ok()?.trim_end_matches('\r');
    let rest = line.strip_prefix("ERR ")?;
    let (name, words) = rest.split_once(' ').unwrap_or((rest, ""));
    let code = ErrorCode::ALL
        .into_iter()
        .find(|code| code.name() == name)?;
    Some((code, words.to_owned()))
}

impl HelloAck {
    /// Appends the accepting answer: header with status 0, then the limits.
    pub fn encode(&self, dst: &mut BytesMut) {
        dst.put_slice(&MAGIC);
        dst.put_u16(self.version);
        dst.put_u16(0);
        dst.put_u16(LIMITS_LEN as u16);
        let l = &self.limits;
        for value in [
            l.frame_len_max,
            l.in_flight_max,
            l.ttl_ms_max,
            l.wait_ms_max,
            l.key_len_max,
            l.meta_len_max,
        ] {
            dst.put_u32(value);
        }
    }

    /// Appends a refusing answer: header with `code` as the status, then `message` (cut to
    /// [`ERROR_MESSAGE_LEN_MAX`] bytes at a character boundary).
    pub fn encode_refusal(version: u16, code: ErrorCode, message: &str, dst: &mut BytesMut) {
        let mut end = message.len().min(ERROR_MESSAGE_LEN_MAX);
        while !message.is_char_boundary(end) {
            end -= 1;
        }
        dst.put_slice(&MAGIC);
        dst.put_u16(version);
        dst.put_u16(code as u16);
        dst.put_u16(end as u16);
        dst.put_slice(&message.as_bytes()[..end]);
    }

    /// Takes the answer off the front of `src` once all of it is there.
    ///
    /// # Errors
    /// [`ProtocolError::HandshakeRefused`] when the server refused the hello;
    /// [`ProtocolError::BadHandshake`] when the magic is wrong, the body is over
    /// [`HELLO_ACK_BODY_LEN_MAX`], or the limits are too short or out of range.
    pub fn decode(src: &mut BytesMut) -> Result<Option<HelloAck>, ProtocolError> {
        if src.len() >= 4 && src[..4] != MAGIC {
            return Err(ProtocolError::BadHandshake(
                "server did not answer with the tenure magic".into(),
            ));
        }
        if src.len() < HELLO_ACK_HEADER_LEN {
            return Ok(None);
        }
        let body_len = usize::from(u16::from_be_bytes([src[8], src[9]]));
        if body_len > HELLO_ACK_BODY_LEN_MAX {
            return Err(ProtocolError::BadHandshake(format!(
                "handshake answer body of {body_len} bytes is over {HELLO_ACK_BODY_LEN_MAX}"
            )));
        }
        if src.len() < HELLO_ACK_HEADER_LEN + body_len {
            return Ok(None);
        }
        src.advance(4);
        let version = src.get_u16();
        let status = src.get_u16();
        src.advance(2);
        let mut body = src.split_to(body_len);
        if status != 0 {
            return Err(ProtocolError::HandshakeRefused {
                version,
                code: ErrorCode::from_u16(status),
                message: String::from_utf8_lossy(&body).into_owned(),
            });
        }
        if body_len < LIMITS_LEN {
            return Err(ProtocolError::BadHandshake(format!(
                "handshake answer carries {body_len} bytes of limits, fewer than {LIMITS_LEN}"
            )));
        }
        let limits = ServerLimits {
            frame_len_max: body.get_u32(),
            in_flight_max: body.get_u32(),
            ttl_ms_max: body.get_u32(),
            wait_ms_max: body.get_u32(),
            key_len_max: body.get_u32(),
            meta_len_max: body.get_u32(),
        };
        // Anything after the known limits is from a later server: skipped on purpose.
        check_limits(&limits)?;
        Ok(Some(HelloAck { version, limits }))
    }
}

/// A server must accept every request this crate can encode: its frame limit must hold the
/// largest ACQUIRE and not exceed what the decoder reads.
fn check_limits(limits: &ServerLimits) -> Result<(), ProtocolError> {
    let frame = limits.frame_len_max as usize;
    if !(crate::limits::ACQUIRE_LEN_MAX..=FRAME_LEN_MAX).contains(&frame) {
        return Err(ProtocolError::BadHandshake(format!(
            "server frame limit {frame} outside {}..={FRAME_LEN_MAX}",
            crate::limits::ACQUIRE_LEN_MAX
        )));
    }
    if limits.key_len_max as usize > KEY_LEN_MAX || limits.meta_len_max as usize > META_LEN_MAX {
        return Err(ProtocolError::BadHandshake(format!(
            "server key/meta limits {}/{} over the wire limits {KEY_LEN_MAX}/{META_LEN_MAX}",
            limits.key_len_max, limits.meta_len_max
        )));
    }
    Ok(())
}

impl ServerLimits {
    /// The wire limits, with `in_flight_max` and `ttl_ms_max` as a server configures them.
    pub fn with(in_flight_max: u32, ttl_ms_max: u32) -> ServerLimits {
        ServerLimits {
            frame_len_max: FRAME_LEN_MAX as u32,
            in_flight_max,
            ttl_ms_max,
            wait_ms_max: crate::limits::WAIT_MS_MAX,
            key_len_max: KEY_LEN_MAX as u32,
            meta_len_max: META_LEN_MAX as u32,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_console_refusal_in_place_of_the_answer_gives_its_code_and_words() {
        let line = b"ERR CONNECTIONS_LIMIT server has 2 connections already\n";
        assert_eq!(
            console_refusal(line),
            Some((
                ErrorCode::ConnectionsLimit,
                "server has 2 connections already".to_owned()
            ))
        );
        assert_eq!(
            console_refusal(b"ERR CONNECTIONS_LIMIT cut sh"),
            Some((ErrorCode::ConnectionsLimit, "cut sh".to_owned()))
        );
        assert_eq!(console_refusal(b"ERR NO_SUCH_CODE words\n"), None);
        assert_eq!(console_refusal(b"HTTP/1.1 400 Bad Request\r\n"), None);
    }
}
