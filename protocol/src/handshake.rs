//! The handshake that opens every binary connection.
//!
//! ```text
//! client -> server, 8 bytes:
//!  0      1   2   3   4          6          8
//! +------+---+---+---+----------+----------+
//! | 0x00 | T | N | R | version  | flags    |
//! |      |   |   |   | u16 BE   | u16 BE=0 |
//! +------+---+---+---+----------+----------+
//!
//! server -> client, 16 bytes:
//! +------+---+---+---+----------+----------+----------------+----------------+
//! | 0x00 | T | N | R | version  | reserved | frame_len_max  | in_flight_max  |
//! |      |   |   |   | u16 BE   | u16 BE=0 | u32 BE         | u32 BE         |
//! +------+---+---+---+----------+----------+----------------+----------------+
//! ```
//!
//! The leading zero byte is what tells the server a binary client from a person at `nc`: no
//! console command starts with it. A server that does not speak the client's version answers
//! with its own version and closes the connection.

use bytes::{Buf, BufMut, BytesMut};

use crate::error::ProtocolError;

/// The first four bytes of both handshake messages.
pub const MAGIC: [u8; 4] = [0x00, b'T', b'N', b'R'];
/// The protocol version this crate speaks.
pub const VERSION: u16 = 1;
/// Length of the client's hello, in bytes.
pub const HELLO_LEN: usize = 8;
/// Length of the server's answer, in bytes.
pub const HELLO_ACK_LEN: usize = 16;

/// The client's hello.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hello {
    /// Protocol version the client speaks.
    pub version: u16,
}

/// The server's answer to a hello.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HelloAck {
    /// Protocol version the server speaks; if it differs from the client's, the server closes.
    pub version: u16,
    /// Largest frame the server accepts, after the length prefix.
    pub frame_len_max: u32,
    /// Requests the server lets one connection have in flight.
    pub in_flight_max: u32,
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
    /// [`ProtocolError::BadHandshake`] when the magic is wrong.
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
        let _flags = src.get_u16(); // reserved: sent as zero, ignored so later versions can use it
        Ok(Some(Hello { version }))
    }
}

impl HelloAck {
    /// Appends the answer's 16 bytes.
    pub fn encode(&self, dst: &mut BytesMut) {
        dst.put_slice(&MAGIC);
        dst.put_u16(self.version);
        dst.put_u16(0);
        dst.put_u32(self.frame_len_max);
        dst.put_u32(self.in_flight_max);
    }

    /// Takes the answer off the front of `src` once 16 bytes are there.
    ///
    /// # Errors
    /// [`ProtocolError::BadHandshake`] when the magic is wrong.
    pub fn decode(src: &mut BytesMut) -> Result<Option<HelloAck>, ProtocolError> {
        if src.len() < HELLO_ACK_LEN {
            return Ok(None);
        }
        if src[..4] != MAGIC {
            return Err(ProtocolError::BadHandshake(
                "server did not answer with the tenure magic".into(),
            ));
        }
        src.advance(4);
        let version = src.get_u16();
        src.advance(2);
        Ok(Some(HelloAck {
            version,
            frame_len_max: src.get_u32(),
            in_flight_max: src.get_u32(),
        }))
    }
}
