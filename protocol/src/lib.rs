//! Wire protocol of the tenure lock server (work in progress: being filled in).
pub mod limits;
mod lease;
pub use lease::LeaseId;
