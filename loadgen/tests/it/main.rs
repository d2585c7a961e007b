//! The load generator's integration tests, one test binary: `end_to_end` runs the real
//! `tenure-loadgen` against a fake tenure server and a real Redis; `secure` against the real
//! server in process, with TLS and identities; `kinds` its `--permits` and `--shared` against
//! the real server; `sessions` its `--sessions` estimate against the real server; `cluster` against fake cluster members (the
//! leader found, a fail-over timed) and a real 3-member etcd; `layout` keeps the import rules
//! of `loadgen/src` (which module may use which).

mod cluster;
mod end_to_end;
mod kinds;
mod layout;
mod secure;
mod sessions;
