//! A small RESP2 client side for the Redis comparison: command encoder, reply decoder and the
//! standard lock recipes.
//!
//! Commands are arrays of bulk strings (`*N\r\n` then `$len\r\nbytes\r\n` per argument). Replies
//! are decoded in place and taken off the buffer only once complete, so any amount can be
//! pipelined; Redis answers in request order, which is how a reply finds its op.
//!
//! The recipes are the usual single-instance ones:
//! - acquire: `SET job:{n} <lease> NX PX <ttl>`, or with `--redis-fenced` the [`ACQUIRE_FENCED`]
//!   script, which also increments `fence:job:{n}` and returns it as the fencing token;
//! - renew: [`RENEW`], compare the value then `PEXPIRE`;
//! - release: [`RELEASE`], compare the value then `DEL`.
//!
//! Scripts are loaded once per connection with `SCRIPT LOAD` and called with `EVALSHA`.

use anyhow::{bail, ensure, Context};
use bytes::{Buf, BufMut, Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::op::{decimal, Op, OpKind, Outcome, FENCE_PREFIX, KEY_PREFIX};

/// Release only if the caller's lease still holds the key.
pub const RELEASE: &str = "if redis.call('get', KEYS[1]) == ARGV[1] then \
     return redis.call('del', KEYS[1]) else return 0 end";
/// Extend the lease only if the caller still holds the key.
pub const RENEW: &str = "if redis.call('get', KEYS[1]) == ARGV[1] then \
     return redis.call('pexpire', KEYS[1], ARGV[2]) else return 0 end";
/// Take the key if free and return the next value of its fencing counter (nil if held).
pub const ACQUIRE_FENCED: &str = "if redis.call('set', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) \
     then return redis.call('incr', KEYS[2]) else return false end";

/// Longest bulk string or line accepted in a reply: far above anything the recipes return, so
/// a broken stream fails fast instead of buffering without bound.
const REPLY_LEN_MAX: usize = 64 * 1024;
/// Deepest nesting of arrays accepted in a reply.
const ARRAY_DEPTH_MAX: usize = 4;

/// SHA1s of the three scripts, as Redis returned them from `SCRIPT LOAD`.
#[derive(Clone, Debug)]
pub struct Scripts {
    release: Bytes,
    renew: Bytes,
    acquire_fenced: Bytes,
}

/// One decoded reply, reduced to what the recipes need.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reply {
    /// `+OK`, `+PONG` or another status line (`true` when it is OK or PONG).
    Status(bool),
    /// `-ERR ...`: the first word of the message.
    Error(String),
    /// `:n`.
    Int(i64),
    /// `$n` with its bytes.
    Bulk(Bytes),
    /// `$-1` or `*-1`.
    Nil,
    /// An array (its elements are read and dropped: no recipe returns one).
    Array,
}

fn put_bulk(dst: &mut BytesMut, parts: &[&[u8]]) {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    let mut digits = [0u8; 20];
    dst.put_u8(b'$');
    dst.put_slice(decimal(len as u64, &mut digits));
    dst.put_slice(b"\r\n");
    for part in parts {
        dst.put_slice(part);
    }
    dst.put_slice(b"\r\n");
}

fn put_array_header(dst: &mut BytesMut, count: u64) {
    let mut digits = [0u8; 20];
    dst.put_u8(b'*');
    dst.put_slice(decimal(count, &mut digits));
    dst.put_slice(b"\r\n");
}

fn hex_lease(lease: u128) -> [u8; 32] {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut out = [0u8; 32];
    for (i, byte) in lease.to_be_bytes().iter().enumerate() {
        out[2 * i] = HEX[usize::from(byte >> 4)];
        out[2 * i + 1] = HEX[usize::from(byte & 15)];
    }
    out
}

/// Appends the command for `op`.
pub fn encode_op(scripts: &Scripts, fenced: bool, op: &Op, dst: &mut BytesMut) {
    let mut key_digits = [0u8; 20];
    let key = decimal(op.key, &mut key_digits);
    let mut ttl_digits = [0u8; 20];
    let ttl = decimal(u64::from(op.ttl_ms), &mut ttl_digits);
    let lease = hex_lease(op.lease);
    match op.kind {
        OpKind::Acquire if fenced => {
            put_array_header(dst, 7);
            put_bulk(dst, &[b"EVALSHA"]);
            put_bulk(dst, &[&scripts.acquire_fenced]);
            put_bulk(dst, &[b"2"]);
            put_bulk(dst, &[KEY_PREFIX, key]);
            put_bulk(dst, &[FENCE_PREFIX, key]);
            put_bulk(dst, &[&lease]);
            put_bulk(dst, &[ttl]);
        }
        OpKind::Acquire => {
            put_array_header(dst, 6);
            put_bulk(dst, &[b"SET"]);
            put_bulk(dst, &[KEY_PREFIX, key]);
            put_bulk(dst, &[&lease]);
            put_bulk(dst, &[b"NX"]);
            put_bulk(dst, &[b"PX"]);
            put_bulk(dst, &[ttl]);
        }
        OpKind::Renew => {
            put_array_header(dst, 6);
            put_bulk(dst, &[b"EVALSHA"]);
            put_bulk(dst, &[&scripts.renew]);
            put_bulk(dst, &[b"1"]);
            put_bulk(dst, &[KEY_PREFIX, key]);
            put_bulk(dst, &[&lease]);
            put_bulk(dst, &[ttl]);
        }
        OpKind::Release => {
            put_array_header(dst, 5);
            put_bulk(dst, &[b"EVALSHA"]);
            put_bulk(dst, &[&scripts.release]);
            put_bulk(dst, &[b"1"]);
            put_bulk(dst, &[KEY_PREFIX, key]);
            put_bulk(dst, &[&lease]);
        }
        OpKind::Ping => {
            put_array_header(dst, 1);
            put_bulk(dst, &[b"PING"]);
        }
        OpKind::KeepAlive => unreachable!("--sessions is for tenure:// targets only"),
    }
}

/// What Redis said to `op`, in the load generator's terms.
pub fn outcome(op: &Op, fenced: bool, reply: Reply) -> Outcome {
    match (op.kind, reply) {
        (_, Reply::Error(word)) => Outcome::Error(word),
        (OpKind::Acquire, Reply::Status(true)) if !fenced => Outcome::Granted {
            lease: op.lease,
            token: 0,
        },
        (OpKind::Acquire, Reply::Int(token)) if fenced && token > 0 => Outcome::Granted {
            lease: op.lease,
            token: token as u64,
        },
        (OpKind::Acquire, Reply::Nil) => Outcome::Locked,
        (OpKind::Renew, Reply::Int(1)) => Outcome::Renewed,
        (OpKind::Renew, Reply::Int(0)) => Outcome::Lost,
        (OpKind::Release, Reply::Int(1)) => Outcome::Released,
        // Redis cannot tell "expired" from "someone else's": both are a failed compare.
        (OpKind::Release, Reply::Int(0)) => Outcome::NotOwner,
        (OpKind::Ping, Reply::Status(true)) => Outcome::Pong,
        (kind, reply) => Outcome::Error(format!("unexpected reply to {kind:?}: {reply:?}")),
    }
}

/// Position just past the `\r\n` ending the line that starts at `at`, if it is all there.
fn line_end(src: &[u8], at: usize) -> anyhow::Result<Option<(usize, usize)>> {
    let window = &src[at..src.len().min(at + REPLY_LEN_MAX)];
    match window.windows(2).position(|w| w == b"\r\n") {
        Some(i) => Ok(Some((at + i, at + i + 2))),
        None if window.len() >= REPLY_LEN_MAX => bail!("RESP line longer than {REPLY_LEN_MAX}"),
        None => Ok(None),
    }
}

fn parse_int(text: &[u8]) -> anyhow::Result<i64> {
    std::str::from_utf8(text)
        .ok()
        .and_then(|t| t.parse().ok())
        .with_context(|| format!("bad RESP integer {:?}", String::from_utf8_lossy(text)))
}

/// A reply's shape and where it ends; byte ranges index the buffer it was parsed from.
enum Shape {
    Status(bool),
    Error(usize, usize),
    Int(i64),
    Bulk(usize, usize),
    Nil,
    Array,
}

/// Parses the reply starting at `at` without consuming: `Ok(None)` until it is complete.
fn parse(src: &[u8], at: usize, depth: usize) -> anyhow::Result<Option<(Shape, usize)>> {
    if at >= src.len() {
        return Ok(None);
    }
    let Some((text_end, next)) = line_end(src, at + 1)? else {
        return Ok(None);
    };
    let text = &src[at + 1..text_end];
    let shape = match src[at] {
        b'+' => Shape::Status(text == b"OK" || text == b"PONG"),
        b'-' => Shape::Error(at + 1, text_end),
        b':' => Shape::Int(parse_int(text)?),
        b'$' => {
            let len = parse_int(text)?;
            if len < 0 {
                return Ok(Some((Shape::Nil, next)));
            }
            let len = usize::try_from(len)?;
            ensure!(len <= REPLY_LEN_MAX, "RESP bulk of {len} bytes");
            if src.len() < next + len + 2 {
                return Ok(None);
            }
            return Ok(Some((Shape::Bulk(next, next + len), next + len + 2)));
        }
        b'*' => {
            let count = parse_int(text)?;
            if count < 0 {
                return Ok(Some((Shape::Nil, next)));
            }
            ensure!(depth < ARRAY_DEPTH_MAX, "RESP arrays nested too deep");
            let mut end = next;
            for _ in 0..count {
                match parse(src, end, depth + 1)? {
                    Some((_, after)) => end = after,
                    None => return Ok(None),
                }
            }
            return Ok(Some((Shape::Array, end)));
        }
        other => bail!("unknown RESP type byte {other:#04x}"),
    };
    Ok(Some((shape, next)))
}

/// Takes one complete reply off the front of `src`.
///
/// # Errors
/// When the bytes are not RESP2: the connection must close.
pub fn decode(src: &mut BytesMut) -> anyhow::Result<Option<Reply>> {
    let Some((shape, end)) = parse(src, 0, 0)? else {
        return Ok(None);
    };
    let reply = match shape {
        Shape::Status(ok) => Reply::Status(ok),
        Shape::Error(from, to) => {
            let text = String::from_utf8_lossy(&src[from..to]);
            Reply::Error(text.split(' ').next().unwrap_or("").to_owned())
        }
        Shape::Int(n) => Reply::Int(n),
        Shape::Nil => Reply::Nil,
        Shape::Array => Reply::Array,
        Shape::Bulk(from, to) => {
            let frame = src.split_to(end).freeze();
            return Ok(Some(Reply::Bulk(frame.slice(from..to))));
        }
    };
    src.advance(end);
    Ok(Some(reply))
}

/// Sends one command on a fresh connection and waits for its reply (setup only).
async fn call(stream: &mut TcpStream, args: &[&[u8]]) -> anyhow::Result<Reply> {
    let mut out = BytesMut::new();
    put_array_header(&mut out, args.len() as u64);
    for arg in args {
        put_bulk(&mut out, &[arg]);
    }
    stream.write_all(&out).await?;
    let mut input = BytesMut::with_capacity(256);
    loop {
        if let Some(reply) = decode(&mut input)? {
            return Ok(reply);
        }
        if stream.read_buf(&mut input).await? == 0 {
            bail!("redis closed the connection during setup");
        }
    }
}

/// Checks the server answers PING and loads the scripts.
///
/// # Errors
/// When the server does not speak RESP or refuses a script.
pub async fn setup(stream: &mut TcpStream) -> anyhow::Result<Scripts> {
    let pong = call(stream, &[b"PING"]).await?;
    ensure!(pong == Reply::Status(true), "PING answered {pong:?}");
    Ok(Scripts {
        release: load(stream, RELEASE).await?,
        renew: load(stream, RENEW).await?,
        acquire_fenced: load(stream, ACQUIRE_FENCED).await?,
    })
}

async fn load(stream: &mut TcpStream, script: &str) -> anyhow::Result<Bytes> {
    match call(stream, &[b"SCRIPT", b"LOAD", script.as_bytes()]).await? {
        Reply::Bulk(sha) => Ok(sha),
        other => bail!("SCRIPT LOAD answered {other:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_each_type_and_waits_for_more() {
        let mut src = BytesMut::from(
            &b"+OK\r\n:42\r\n$-1\r\n$3\r\nabc\r\n-ERR no\r\n*2\r\n:1\r\n$1\r\nx\r\n"[..],
        );
        assert_eq!(decode(&mut src).unwrap(), Some(Reply::Status(true)));
        assert_eq!(decode(&mut src).unwrap(), Some(Reply::Int(42)));
        assert_eq!(decode(&mut src).unwrap(), Some(Reply::Nil));
        assert_eq!(
            decode(&mut src).unwrap(),
            Some(Reply::Bulk(Bytes::from_static(b"abc")))
        );
        assert_eq!(decode(&mut src).unwrap(), Some(Reply::Error("ERR".into())));
        assert_eq!(decode(&mut src).unwrap(), Some(Reply::Array));
        assert!(src.is_empty());
        for partial in [&b"$3\r\nab"[..], b":4", b"*2\r\n:1\r\n", b""] {
            let mut src = BytesMut::from(partial);
            assert_eq!(decode(&mut src).unwrap(), None);
            assert_eq!(src.len(), partial.len());
        }
        assert!(decode(&mut BytesMut::from(&b"?x\r\n"[..])).is_err());
    }

    #[test]
    fn encodes_set_nx_px() {
        let scripts = Scripts {
            release: Bytes::from_static(b"r"),
            renew: Bytes::from_static(b"n"),
            acquire_fenced: Bytes::from_static(b"f"),
        };
        let op = Op {
            kind: OpKind::Acquire,
            key: 7,
            lease: 1,
            ttl_ms: 30_000,
            wait_ms: 0,
            tag: 0,
            intended_ns: 0,
            sent_ns: 0,
            lease_kind: None,
        };
        let mut out = BytesMut::new();
        encode_op(&scripts, false, &op, &mut out);
        let expected = format!(
            "*6\r\n$3\r\nSET\r\n$5\r\njob:7\r\n$32\r\n{:032x}\r\n$2\r\nNX\r\n$2\r\nPX\r\n$5\r\n30000\r\n",
            1
        );
        assert_eq!(out, expected.as_bytes());
    }
}
