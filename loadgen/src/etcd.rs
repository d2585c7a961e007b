//! The etcd side: the lock cycle of etcd's own lock (`clientv3/concurrency`), spoken to the
//! v3 API's JSON gateway on the client port over HTTP/1.1 keep-alive.
//!
//! | op | etcd requests |
//! |---|---|
//! | acquire | `POST /v3/lease/grant {ID, TTL}`, then `POST /v3/kv/txn`: put `job:{n}` with the lease if its `create_revision` is 0 |
//! | renew | `POST /v3/lease/keepalive {ID}` (a one-message stream; the reply comes chunked) |
//! | release | `POST /v3/lease/revoke {ID}` (deletes the key with the lease) |
//! | ping | `POST /v3/maintenance/status {}` |
//!
//! The client picks the lease id (etcd takes a requested `ID` on grant), so the grant and the
//! txn of one acquire go out back to back in one write instead of two round trips: this saves
//! etcd a round trip per cycle that its own client spends, so the comparison leans its way.
//! The gateway is a grpc-gateway: no gRPC client is compiled, and the requests are written by
//! hand like tenure's frames. Replies come in request order (HTTP/1.1), so an [`EtcdState`]
//! remembers how many responses each op in flight waits for.

use std::collections::VecDeque;
use std::fmt::Write as _;

use anyhow::{bail, ensure, Context};
use bytes::{Buf, BufMut, BytesMut};
use serde_json::Value;

use crate::op::{decimal, Op, OpKind, Outcome, KEY_PREFIX};

/// Longest response head (status line and headers) accepted, in bytes.
const HEAD_BYTES_MAX: usize = 16 * 1024;
/// Longest response body accepted, in bytes (the gateway's replies are a few hundred).
const BODY_BYTES_MAX: usize = 1024 * 1024;
/// Largest lease id etcd accepts (ids are positive int64).
const LEASE_ID_MAX: u64 = i64::MAX as u64;

/// What one connection to etcd remembers between encoding and decoding.
#[derive(Clone, Debug, Default)]
pub struct EtcdState {
    /// `Host:` header value.
    host: String,
    /// HTTP responses each op in flight waits for, in send order.
    expect: VecDeque<u8>,
    /// Responses already read for the op at the front.
    parts: Vec<HttpReply>,
}

/// One HTTP response, body de-chunked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HttpReply {
    /// Status code.
    pub status: u16,
    /// Body bytes.
    pub body: Vec<u8>,
}

impl EtcdState {
    /// State for a connection to `host` (`host:port`, for the `Host:` header).
    pub fn new(host: &str) -> EtcdState {
        EtcdState {
            host: host.to_owned(),
            ..EtcdState::default()
        }
    }

    /// Appends the requests for `op`.
    pub fn encode(&mut self, op: &Op, dst: &mut BytesMut) {
        let id = lease_id(op.lease);
        let ttl_s = op.ttl_ms.div_ceil(1000).max(1);
        match op.kind {
            OpKind::Acquire => {
                let grant = format!("{{\"ID\":\"{id}\",\"TTL\":\"{ttl_s}\"}}");
                self.post("/v3/lease/grant", &grant, dst);
                self.post("/v3/kv/txn", &txn_body(op.key, id), dst);
                self.expect.push_back(2);
            }
            OpKind::Renew => {
                self.post("/v3/lease/keepalive", &format!("{{\"ID\":\"{id}\"}}"), dst);
                self.expect.push_back(1);
            }
            OpKind::Release => {
                self.post("/v3/lease/revoke", &format!("{{\"ID\":\"{id}\"}}"), dst);
                self.expect.push_back(1);
            }
            OpKind::Ping => {
                self.post("/v3/maintenance/status", "{}", dst);
                self.expect.push_back(1);
            }
            OpKind::KeepAlive => unreachable!("--sessions is for tenure:// targets only"),
        }
    }

    /// Appends one `POST path` with a JSON `body`, answered by one response.
    pub fn request(&mut self, path: &str, body: &str, dst: &mut BytesMut) {
        self.post(path, body, dst);
        self.expect.push_back(1);
    }

    fn post(&self, path: &str, body: &str, dst: &mut BytesMut) {
        let mut head = String::with_capacity(128);
        // Writing to a String cannot fail.
        let _ = write!(
            head,
            "POST {path} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n",
            self.host,
            body.len()
        );
        dst.put_slice(head.as_bytes());
        dst.put_slice(body.as_bytes());
    }

    /// Takes the responses of the oldest op in flight off `src`, once all have arrived.
    ///
    /// # Errors
    /// When the stream is not HTTP/1.1 as expected, or a response answers nothing.
    pub fn decode(&mut self, src: &mut BytesMut) -> anyhow::Result<Option<Vec<HttpReply>>> {
        loop {
            let Some(&want) = self.expect.front() else {
                ensure!(src.is_empty(), "HTTP response with nothing in flight");
                return Ok(None);
            };
            if self.parts.len() == usize::from(want) {
                self.expect.pop_front();
                return Ok(Some(std::mem::take(&mut self.parts)));
            }
            match parse_response(src)? {
                Some(reply) => self.parts.push(reply),
                None => return Ok(None),
            }
        }
    }
}

/// The outcome of `op` given its responses.
pub fn outcome(op: &Op, replies: &[HttpReply]) -> Outcome {
    match outcome_of(op, replies) {
        Ok(outcome) => outcome,
        Err(e) => Outcome::Error(format!("{e:#}")),
    }
}

fn outcome_of(op: &Op, replies: &[HttpReply]) -> anyhow::Result<Outcome> {
    let mut json = Vec::with_capacity(replies.len());
    for reply in replies {
        json.push(body_json(reply)?);
    }
    Ok(match op.kind {
        OpKind::Acquire => {
            // The grant's body proves nothing more than its 200; the txn decides.
            let txn = &json[1];
            if txn.get("succeeded").and_then(Value::as_bool) == Some(true) {
                Outcome::Granted {
                    lease: u128::from(lease_id(op.lease)),
                    // etcd's fencing token is the revision of the put that took the key.
                    token: int_field(&txn["header"], "revision").unwrap_or(0),
                }
            } else {
                Outcome::Locked
            }
        }
        OpKind::Renew => {
            // A keep-alive of an unknown lease answers TTL 0, which the gateway leaves out.
            match int_field(&json[0]["result"], "TTL") {
                Some(ttl) if ttl > 0 => Outcome::Renewed,
                _ => Outcome::Lost,
            }
        }
        OpKind::Release => Outcome::Released,
        OpKind::Ping => Outcome::Pong,
        OpKind::KeepAlive => Outcome::Error("etcd has no tenure sessions".to_owned()),
    })
}

/// A 200's body as JSON, or the gateway's error as an error.
///
/// # Errors
/// For another status, an `error` field, or a body that is not JSON.
pub fn body_json(reply: &HttpReply) -> anyhow::Result<Value> {
    let json: Value = serde_json::from_slice(&reply.body).with_context(|| {
        format!(
            "HTTP {} with a body that is not JSON: {:?}",
            reply.status,
            String::from_utf8_lossy(&reply.body)
        )
    })?;
    if reply.status != 200 || json.get("error").is_some() {
        let message = json
            .get("error")
            .and_then(|e| {
                e.as_str()
                    .map(str::to_owned)
                    .or_else(|| e.get("message").map(|m| m.to_string()))
            })
            .unwrap_or_else(|| json.to_string());
        bail!("HTTP {}: {message}", reply.status);
    }
    Ok(json)
}

/// An int64 field, which the gateway writes as a JSON string.
pub fn int_field(object: &Value, name: &str) -> Option<u64> {
    match object.get(name)? {
        Value::String(s) => s.parse().ok(),
        Value::Number(n) => n.as_u64(),
        _ => None,
    }
}

/// The etcd lease id for a loadgen lease value: positive int64, never 0 (0 asks etcd to pick).
pub fn lease_id(lease: u128) -> u64 {
    ((lease as u64) & LEASE_ID_MAX).max(1)
}

/// The create-if-absent txn of etcd's lock: put `job:{key}` with the lease if nobody created it.
fn txn_body(key: u64, id: u64) -> String {
    let mut digits = [0u8; 20];
    let mut name = KEY_PREFIX.to_vec();
    name.extend_from_slice(decimal(key, &mut digits));
    let key64 = base64(&name);
    format!(
        "{{\"compare\":[{{\"key\":\"{key64}\",\"result\":\"EQUAL\",\"target\":\"CREATE\",\
         \"create_revision\":\"0\"}}],\"success\":[{{\"request_put\":{{\"key\":\"{key64}\",\
         \"value\":\"\",\"lease\":\"{id}\"}}}}]}}"
    )
}

/// Standard base64 with padding (the gateway's encoding of bytes fields).
pub fn base64(input: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(input.len().div_ceil(3) * 4);
    for chunk in input.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = u32::from(b[0]) << 16 | u32::from(b[1]) << 8 | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Takes one whole HTTP/1.1 response off the front of `src` (Content-Length or chunked body).
///
/// # Errors
/// When the bytes are not such a response, or a head or body is over its limit.
pub fn parse_response(src: &mut BytesMut) -> anyhow::Result<Option<HttpReply>> {
    let Some(head_len) = find(src, b"\r\n\r\n").map(|at| at + 4) else {
        ensure!(
            src.len() <= HEAD_BYTES_MAX,
            "HTTP head over {HEAD_BYTES_MAX} bytes"
        );
        return Ok(None);
    };
    let head = std::str::from_utf8(&src[..head_len]).context("HTTP head is not UTF-8")?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status: u16 = match status_line.split(' ').collect::<Vec<_>>()[..] {
        ["HTTP/1.1", code, ..] => code.parse().context("HTTP status code")?,
        _ => bail!("not an HTTP/1.1 status line: {status_line:?}"),
    };
    let mut length = None;
    let mut chunked = false;
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        let value = value.trim();
        if name.eq_ignore_ascii_case("content-length") {
            length = Some(value.parse::<usize>().context("Content-Length")?);
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            chunked = value.eq_ignore_ascii_case("chunked");
        }
    }
    let body = if chunked {
        match dechunk(&src[head_len..])? {
            Some((body, used)) => {
                src.advance(head_len + used);
                body
            }
            None => return Ok(None),
        }
    } else {
        let length = length.context("HTTP response with neither Content-Length nor chunks")?;
        ensure!(length <= BODY_BYTES_MAX, "HTTP body of {length} bytes");
        if src.len() < head_len + length {
            return Ok(None);
        }
        let body = src[head_len..head_len + length].to_vec();
        src.advance(head_len + length);
        body
    };
    Ok(Some(HttpReply { status, body }))
}

/// A whole chunked body at the front of `src`: the body and the bytes it took, or `None`.
fn dechunk(src: &[u8]) -> anyhow::Result<Option<(Vec<u8>, usize)>> {
    let mut body = Vec::new();
    let mut at = 0;
    loop {
        let Some(line_len) = find(&src[at..], b"\r\n") else {
            return Ok(None);
        };
        let size_text = std::str::from_utf8(&src[at..at + line_len]).context("chunk size")?;
        let size_text = size_text.split(';').next().unwrap_or_default().trim();
        let size = usize::from_str_radix(size_text, 16).context("chunk size")?;
        ensure!(
            body.len() + size <= BODY_BYTES_MAX,
            "chunked body over {BODY_BYTES_MAX} bytes"
        );
        at += line_len + 2;
        if size == 0 {
            // Trailer lines (the gateway sends one on errors), then an empty line.
            if src.len() >= at + 2 && &src[at..at + 2] == b"\r\n" {
                return Ok(Some((body, at + 2)));
            }
            return Ok(find(&src[at..], b"\r\n\r\n").map(|end| (body, at + end + 4)));
        }
        if src.len() < at + size + 2 {
            return Ok(None);
        }
        body.extend_from_slice(&src[at..at + size]);
        at += size + 2;
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(kind: OpKind) -> Op {
        Op {
            kind,
            key: 42,
            lease: 0xffff_0000_0000_0000_8000_0000_0000_0007,
            ttl_ms: 1500,
            wait_ms: 0,
            tag: 0,
            intended_ns: 0,
            sent_ns: 0,
            lease_kind: None,
        }
    }

    fn reply(body: &str) -> String {
        format!(
            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
    }

    #[test]
    fn base64_matches_the_standard_alphabet_and_padding() {
        assert_eq!(base64(b""), "");
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foo"), "Zm9v");
        assert_eq!(base64(b"job:42"), "am9iOjQy");
    }

    #[test]
    fn an_acquire_is_a_grant_then_a_create_if_absent_txn() {
        let mut state = EtcdState::new("127.0.0.1:2379");
        let mut out = BytesMut::new();
        state.encode(&op(OpKind::Acquire), &mut out);
        let text = String::from_utf8(out.to_vec()).unwrap();
        let grant_at = text.find("POST /v3/lease/grant HTTP/1.1\r\n").unwrap();
        let txn_at = text.find("POST /v3/kv/txn HTTP/1.1\r\n").unwrap();
        assert!(grant_at < txn_at);
        // The id is the low 63 bits (never 0); the TTL rounds up to whole seconds.
        assert!(text.contains("{\"ID\":\"7\",\"TTL\":\"2\"}"), "{text}");
        assert!(
            text.contains("\"target\":\"CREATE\",\"create_revision\":\"0\""),
            "{text}"
        );
        assert!(text.contains("\"key\":\"am9iOjQy\""), "{text}");
        assert!(text.contains("\"lease\":\"7\""), "{text}");
        // Each body's Content-Length is its length.
        let txn_body = &text[text.rfind("\r\n\r\n").unwrap() + 4..];
        assert!(text.contains(&format!(
            "Content-Length: {}\r\n\r\n{txn_body}",
            txn_body.len()
        )));
    }

    #[test]
    fn an_acquire_waits_for_both_responses_and_reads_the_txn() {
        let mut state = EtcdState::new("h");
        state.encode(&op(OpKind::Acquire), &mut BytesMut::new());
        state.encode(&op(OpKind::Acquire), &mut BytesMut::new());
        let grant = reply(r#"{"header":{"revision":"5"},"ID":"7","TTL":"2"}"#);
        let won = reply(r#"{"header":{"revision":"6"},"succeeded":true,"responses":[]}"#);
        let lost = reply(r#"{"header":{"revision":"6"},"responses":[]}"#);
        let mut input = BytesMut::from(grant.as_bytes());
        assert_eq!(
            state.decode(&mut input).unwrap(),
            None,
            "one of two responses"
        );
        input.extend_from_slice(won.as_bytes());
        input.extend_from_slice(grant.as_bytes());
        input.extend_from_slice(lost.as_bytes());
        let first = state.decode(&mut input).unwrap().unwrap();
        let token = match outcome(&op(OpKind::Acquire), &first) {
            Outcome::Granted { lease: 7, token } => token,
            other => panic!("{other:?}"),
        };
        assert_eq!(token, 6);
        let second = state.decode(&mut input).unwrap().unwrap();
        assert_eq!(outcome(&op(OpKind::Acquire), &second), Outcome::Locked);
        assert!(input.is_empty());
        assert_eq!(
            state.decode(&mut input).unwrap(),
            None,
            "nothing in flight, nothing read"
        );
        input.extend_from_slice(grant.as_bytes());
        assert!(
            state.decode(&mut input).is_err(),
            "a response nothing asked for"
        );
    }

    #[test]
    fn a_chunked_keepalive_renews_or_reports_the_lease_lost() {
        let mut state = EtcdState::new("h");
        state.encode(&op(OpKind::Renew), &mut BytesMut::new());
        state.encode(&op(OpKind::Renew), &mut BytesMut::new());
        let alive = r#"{"result":{"header":{},"ID":"7","TTL":"2"}}"#;
        let chunked = format!(
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{alive}\r\n0\r\n\r\n",
            alive.len()
        );
        let mut input = BytesMut::from(&chunked.as_bytes()[..chunked.len() - 2]);
        assert_eq!(
            state.decode(&mut input).unwrap(),
            None,
            "the last chunk's line is missing"
        );
        input.extend_from_slice(b"\r\n");
        let replies = state.decode(&mut input).unwrap().unwrap();
        assert_eq!(outcome(&op(OpKind::Renew), &replies), Outcome::Renewed);
        let gone = reply(r#"{"result":{"header":{},"ID":"7"}}"#);
        input.extend_from_slice(gone.as_bytes());
        let replies = state.decode(&mut input).unwrap().unwrap();
        assert_eq!(outcome(&op(OpKind::Renew), &replies), Outcome::Lost);
    }

    #[test]
    fn gateway_errors_are_errors_and_garbage_breaks_the_stream() {
        let body = r#"{"error":"etcdserver: requested lease not found"}"#;
        let error = format!(
            "HTTP/1.1 404 Not Found\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        let mut input = BytesMut::from(error.as_bytes());
        let replies = vec![parse_response(&mut input).unwrap().unwrap()];
        match outcome(&op(OpKind::Release), &replies) {
            Outcome::Error(message) => assert!(message.contains("lease not found"), "{message}"),
            other => panic!("{other:?}"),
        }
        // A chunked error with a trailer, as the gateway sends a failed stream's.
        let error = "{\"error\":\"etcdserver: requested lease not found\",\"code\":5}";
        let chunked = format!(
            "HTTP/1.1 404 Not Found\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{error}\r\n0\r\n\
             Grpc-Trailer-Content-Type: application/grpc\r\n\r\nHTTP/1.1",
            error.len()
        );
        let mut input = BytesMut::from(chunked.as_bytes());
        let reply = parse_response(&mut input).unwrap().unwrap();
        assert_eq!((reply.status, &input[..]), (404, &b"HTTP/1.1"[..]));
        let mut garbage = BytesMut::from(&b"SSH-2.0-OpenSSH\r\n\r\n"[..]);
        assert!(parse_response(&mut garbage).is_err());
    }
}
