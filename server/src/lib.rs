//! tenured: a single-node, in-memory lock server (work in progress).
pub mod clock;
pub mod table;
pub mod tokens;
pub mod wal;
pub mod wheel;
