//! tenure client (being written)
