//! The shared vocabulary of durability: what a change is ([`Change`], [`Lease`],
//! [`FreeReason`]), its byte format ([`Record`] and the segment header, in `codec`), how far
//! a log is durable ([`Lsn`], [`DurableState`]) and the replay rules (`LeaseReplay`) that
//! turn records back into held leases ([`RecoveredLease`]).
//!
//! The executor describes changes in these words, the journal hands them on, the WAL and
//! the cluster's replicated state store and replay them; none of them owns the words, so
//! none imports another for them. Pure: no I/O, and nothing of this crate.

mod change;
pub mod codec;
mod progress;
mod replay;

pub use change::{Change, Lease};
pub use codec::*;
pub use progress::{DurableState, Lsn};
pub(crate) use replay::{Held, LeaseReplay};
pub use replay::{RecoveredLease, RecoveredSession};
