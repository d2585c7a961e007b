//! A compile-time guard, not a run-time test: every public path of the `tenure` crate that
//! a program could write before its modules were reshaped (options, outcomes and watches out
//! of `client.rs`) still resolves, and the paths through `tenure::client` name the very types
//! at the crate root. Removing a re-export breaks the build of this test binary.
// The imports are the check; nothing uses them.
#![allow(unused_imports)]

use tenure::client::AcquireOptions as _;
use tenure::client::AcquireOutcome as _;
use tenure::client::CheckOutcome as _;
use tenure::client::Client as _;
use tenure::client::ClientConfig as _;
use tenure::client::ClientOptions as _;
use tenure::client::Credentials as _;
use tenure::client::KeyState as _;
use tenure::client::LockedBy as _;
use tenure::client::ReleaseOutcome as _;
use tenure::client::RenewOutcome as _;
use tenure::client::Watch as _;
use tenure::client::WatchEvent as _;
use tenure::client::WATCH_EVENTS_MAX as _;
use tenure::cluster::format_members as _;
use tenure::cluster::parse_addrs as _;
use tenure::cluster::parse_members as _;
use tenure::cluster::Member as _;
use tenure::cluster::Role as _;
use tenure::cluster::Status as _;
use tenure::cluster::CHANGE_TIMEOUT_MIN as _;
use tenure::duration as _;
use tenure::election::Election as _;
use tenure::election::ElectionOptions as _;
use tenure::election::Leader as _;
use tenure::election::Leadership as _;
use tenure::election::Observer as _;
use tenure::error::Error as _;
use tenure::error::Result as _;
use tenure::fence::Fence as _;
use tenure::fence::Rejected as _;
use tenure::fence::SequenceRejected as _;
use tenure::fence::SequencedFence as _;
use tenure::lease::deadline_margin as _;
use tenure::lease::KeepAliveOptions as _;
use tenure::lease::Lease as _;
use tenure::lease::LeaseGuard as _;
use tenure::lease::LossReason as _;
use tenure::lease::CLOCK_RATE_SLACK_DIVISOR as _;
use tenure::lease::SERVER_ROUNDING as _;
use tenure::semaphore::KindsState as _;
use tenure::tls::TlsOptions as _;
use tenure::AcquireOptions as _;
use tenure::AcquireOutcome as _;
use tenure::Bytes as _;
use tenure::CheckOutcome as _;
use tenure::Client as _;
use tenure::ClientConfig as _;
use tenure::ClientOptions as _;
use tenure::Credentials as _;
use tenure::Election as _;
use tenure::ElectionOptions as _;
use tenure::Error as _;
use tenure::ErrorCode as _;
use tenure::EventKind as _;
use tenure::Fence as _;
use tenure::HolderKinds as _;
use tenure::KeepAliveOptions as _;
use tenure::KeyState as _;
use tenure::KindsState as _;
use tenure::Leader as _;
use tenure::Leadership as _;
use tenure::Lease as _;
use tenure::LeaseGuard as _;
use tenure::LeaseId as _;
use tenure::LeaseKind as _;
use tenure::LockedBy as _;
use tenure::LossReason as _;
use tenure::Observer as _;
use tenure::Rejected as _;
use tenure::ReleaseOutcome as _;
use tenure::RenewOutcome as _;
use tenure::Result as _;
use tenure::SequenceRejected as _;
use tenure::SequencedFence as _;
use tenure::ServerLimits as _;
use tenure::TlsOptions as _;
use tenure::Watch as _;
use tenure::WatchEvent as _;

/// Each type under its old `tenure::client` path is the type at the crate root: these
/// compile only while that holds.
#[allow(dead_code)]
mod same_types {
    fn acquire_outcome(x: tenure::client::AcquireOutcome) -> tenure::AcquireOutcome {
        x
    }
    fn options(x: tenure::client::AcquireOptions) -> tenure::AcquireOptions {
        x
    }
    fn config(x: tenure::client::ClientOptions) -> tenure::ClientConfig {
        x
    }
    fn key_state(x: tenure::client::KeyState) -> tenure::KeyState {
        x
    }
    fn watch(x: tenure::client::Watch) -> tenure::Watch {
        x
    }
    fn event(x: tenure::client::WatchEvent) -> tenure::WatchEvent {
        x
    }
    fn events_max() -> usize {
        tenure::client::WATCH_EVENTS_MAX
    }
}
