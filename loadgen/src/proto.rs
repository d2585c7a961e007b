//! The dispatcher: [`Proto`] is one connection's protocol, and sends each op to the codec of
//! its target (`wire` for tenure, `resp` for Redis, `etcd`) and each reply back to the
//! [`Outcome`] it means. The codecs know only the shared types in `op`; this is the one place
//! that knows all three.

use bytes::BytesMut;
use tenure_protocol::LeaseKind;

use crate::etcd::{self, EtcdState, HttpReply};
use crate::op::{Op, Outcome};
use crate::resp::{self, Reply, Scripts};
use crate::wire;

/// The protocol of one connection.
#[derive(Clone, Debug)]
pub enum Proto {
    /// tenure's binary protocol: replies carry the request id and may come out of order.
    Tenure {
        /// What every ACQUIRE asks for (`--permits`, `--shared`; the key alone by default).
        kind: LeaseKind,
        /// Every ACQUIRE carries an acquire id (`--acquire-ids`, PROTOCOL.md 3.9).
        acquire_ids: bool,
        /// Every ACQUIRE is in a session (`--sessions`, PROTOCOL.md 3.11): its op's `lease`.
        sessions: bool,
    },
    /// Redis RESP2 with the usual lock recipes: replies come in request order.
    Redis {
        /// SHA1s of the loaded scripts.
        scripts: Scripts,
        /// Acquire through the fenced script (SET NX PX plus INCR of a per-key counter).
        fenced: bool,
    },
    /// etcd's v3 JSON gateway over HTTP/1.1: replies come in request order, an acquire's two.
    Etcd(EtcdState),
}

impl Proto {
    /// Whether replies come back in request order (and so carry no id).
    pub fn in_order(&self) -> bool {
        matches!(self, Proto::Redis { .. } | Proto::Etcd(_))
    }

    /// tenure's binary protocol for a plain lock, no acquire ids: what a connection starts as.
    pub fn tenure() -> Proto {
        Proto::Tenure {
            kind: LeaseKind::Exclusive,
            acquire_ids: false,
            sessions: false,
        }
    }

    /// This protocol with acquire ids on every ACQUIRE (or not), if it is tenure's; the
    /// other targets have none.
    pub fn with_acquire_ids(self, on: bool) -> Proto {
        match self {
            Proto::Tenure { kind, sessions, .. } => Proto::Tenure {
                kind,
                acquire_ids: on,
                sessions,
            },
            other => other,
        }
    }

    /// This protocol with every ACQUIRE in a session (or not), if it is tenure's.
    pub fn with_sessions(self, on: bool) -> Proto {
        match self {
            Proto::Tenure {
                kind, acquire_ids, ..
            } => Proto::Tenure {
                kind,
                acquire_ids,
                sessions: on,
            },
            other => other,
        }
    }

    /// This connection's protocol with every tenure ACQUIRE asking for `kind`; the other
    /// targets have no kinds (`Args::resolve` refuses `--permits` and `--shared` for them).
    pub fn with_kind(self, kind: LeaseKind) -> Proto {
        match self {
            Proto::Tenure {
                acquire_ids,
                sessions,
                ..
            } => Proto::Tenure {
                kind,
                acquire_ids,
                sessions,
            },
            other => other,
        }
    }

    /// Appends the request for `op`, tagged `id` where the protocol has ids.
    pub fn encode(&mut self, id: u64, op: &Op, dst: &mut BytesMut) {
        match self {
            Proto::Tenure {
                kind,
                acquire_ids,
                sessions,
            } => {
                let how = wire::Acquiring {
                    acquire_id: *acquire_ids,
                    session: *sessions,
                    kind: *kind,
                };
                wire::encode(id, op, how, dst);
            }
            Proto::Redis { scripts, fenced } => resp::encode_op(scripts, *fenced, op, dst),
            Proto::Etcd(state) => state.encode(op, dst),
        }
    }

    /// Takes one reply off the front of `src`: the request id (`None` for in-order protocols)
    /// and the reply, still to be matched with its op by [`Proto::outcome`].
    ///
    /// # Errors
    /// When the stream is broken (bad length, bad RESP type): the connection must close.
    pub fn decode(&mut self, src: &mut BytesMut) -> anyhow::Result<Option<(Option<u64>, Decoded)>> {
        match self {
            Proto::Tenure { .. } => {
                Ok(wire::decode(src)?.map(|(id, r)| (Some(id), Decoded::Tenure(r))))
            }
            Proto::Redis { .. } => Ok(resp::decode(src)?.map(|r| (None, Decoded::Redis(r)))),
            Proto::Etcd(state) => Ok(state.decode(src)?.map(|r| (None, Decoded::Etcd(r)))),
        }
    }

    /// The outcome of `op` given its decoded reply.
    pub fn outcome(&self, op: &Op, decoded: Decoded) -> Outcome {
        match decoded {
            Decoded::Tenure(outcome) => outcome,
            Decoded::Redis(reply) => {
                let fenced = matches!(self, Proto::Redis { fenced: true, .. });
                resp::outcome(op, fenced, reply)
            }
            Decoded::Etcd(replies) => etcd::outcome(op, &replies),
        }
    }
}

/// A reply taken off the wire, before it is matched with its op.
#[derive(Debug)]
pub enum Decoded {
    /// tenure replies stand alone.
    Tenure(Outcome),
    /// Redis replies mean something only next to the command that asked.
    Redis(Reply),
    /// The HTTP responses of one etcd op (two for an acquire).
    Etcd(Vec<HttpReply>),
}
