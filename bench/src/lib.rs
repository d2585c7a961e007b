//! bench (being written)
