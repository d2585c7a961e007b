//! The load generator's integration tests, one test binary: `end_to_end` runs the real
//! `tenure-loadgen` against a fake tenure server and a real Redis; `secure` against the real
//! server in process, with TLS and identities.

mod end_to_end;
mod secure;
