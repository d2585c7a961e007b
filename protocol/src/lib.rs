//! The wire protocol of tenure, a lock server: what a client and `tenured` say to each other.
//!
//! A binary connection opens with an 8-byte hello and an answer carrying the server's limits
//! (see [`handshake`]), then carries length-prefixed frames in both directions. Every request has a request id
//! chosen by the client and its reply carries the same id, so a client may keep many requests
//! in flight on one connection and the server may answer a blocking acquire out of order.
//! Every integer is fixed width and big-endian. `PROTOCOL.md` beside this crate draws every
//! frame byte by byte; the code here is the reference implementation of that file.
//!
//! The crate does no I/O of its own: it turns bytes into [`Request`]s and [`Response`]s and back,
//! and checks every field against the named limits in [`limits`] before anything is allocated.
//!
//! # Layout
//! - [`limits`]: every wire limit, with `const` asserts on how they relate.
//! - [`handshake`]: the hello that opens a binary connection and the server's answer.
//! - [`frame`]: requests, responses, opcodes, and their encoders and decoders.
//! - [`codec`]: `tokio_util` codec adapters for the server and client sides.
//! - [`cluster`]: the cluster administration requests' bodies and the CLUSTER reply.
//! - [`console`]: the text console's grammar, read by the server and by `tenure console`.
//! - [`error`]: wire error codes, per-frame errors and stream errors.
//! - [`duration`]: `30s`/`500ms`/`1m30s` parsing, shared by every command line of the project.
//! - [`LeaseId`]: the 128-bit name of one grant.
//! - [`kind`]: [`LeaseKind`], exclusive, shared (read) or semaphore permits.

pub mod cluster;
pub mod codec;
pub mod console;
pub mod duration;
pub mod error;
pub mod frame;
pub mod handshake;
pub mod kind;
mod lease;
pub mod limits;

pub use codec::{ClientCodec, ServerCodec};
pub use error::{ErrorCode, FrameError, ProtocolError};
pub use frame::{EndedHow, EventKind, Holder, Request, Response, Secret};
pub use kind::LeaseKind;
pub use lease::{AcquireId, LeaseId, SessionId};
