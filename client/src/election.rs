//! Leader election on top of one lock per group.
//!
//! A candidate acquires the lock `election/{group}` with `release_on_disconnect` (with one
//! server address; see [`ElectionOptions::release_on_disconnect`] for a cluster) and its value
//! (an address, a name) as holder metadata, waiting in line until it wins. The server grants
//! the lock to one holder at a time and every grant has a larger fencing token than the last,
//! so the token is the leader's *term*: at most one leader per term, and a new leader always
//! has a larger term. Pass the term to whatever the leader writes, and fence on it
//! (see [`crate::fence`]).
//!
//! A leader that crashes or loses its connection is replaced as soon as the server sees the
//! connection close; one that hangs is replaced when its lease runs out. [`Leadership`]
//! reports loss exactly like a [`LeaseGuard`]. A standby may wait in line far longer than the
//! TTL; its lease is counted from the grant (see [`crate::lease`]), not from its campaign.
//!
//! Observers ([`Election::observe`]) WATCH the lock, whose reply names the current leader, and
//! see each new leader in increasing term order.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures_util::stream::{self, Stream, StreamExt};
use tenure_protocol::limits::WAIT_MS_MAX;
use tenure_protocol::EventKind;
use tokio_util::sync::CancellationToken;

use crate::client::Client;
use crate::error::{Error, Result};
use crate::lease::{AcquireOutcome, KeepAliveOptions, LeaseGuard, LossReason};
use crate::options::AcquireOptions;
use crate::outcome::KeyState;
use crate::watch::Watch;

/// Pause before an observer subscribes again after its watch failed.
const RESUBSCRIBE_DELAY: Duration = Duration::from_millis(100);

/// How candidates of an [`Election`] hold the lock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ElectionOptions {
    /// Lease length of a leader: how long a hung leader (connection open, no renewals) keeps
    /// leading.
    pub ttl: Duration,
    /// Longest single wait in line; a campaign waits again after each one.
    pub wait_max: Duration,
    /// How the leader renews.
    pub keep_alive: KeepAliveOptions,
    /// Whether a leader's lock is tied to its connection (released when it closes), so that a
    /// crashed or cut-off leader is replaced at once rather than after `ttl`. `None` (the
    /// default) ties it when the client was given one address and not when it was given
    /// several: in a cluster a fail-over closes every connection to the old leader while the
    /// lease lives on at the new one, and a tied leadership would end with each fail-over
    /// (the lock then still held until its TTL runs out, so nobody would lead meanwhile).
    /// Untied, the leader renews with its lease id at the new leader and keeps leading.
    pub release_on_disconnect: Option<bool>,
}

impl Default for ElectionOptions {
    fn default() -> Self {
        ElectionOptions {
            ttl: Duration::from_secs(10),
            wait_max: Duration::from_millis(u64::from(WAIT_MS_MAX)),
            keep_alive: KeepAliveOptions::default(),
            release_on_disconnect: None,
        }
    }
}

/// A leader as seen by an observer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Leader {
    /// The leader's term: the fencing token of its grant.
    pub term: u64,
    /// The value the leader campaigned with.
    pub value: Bytes,
}

/// One election group on one client.
#[derive(Clone, Debug)]
pub struct Election {
    client: Client,
    group: String,
    key: Bytes,
    options: ElectionOptions,
}

/// Pause before a candidate queues again after its wait was cut short by a server restart, on
/// top of the client's own reconnect backoff.
const CAMPAIGN_RETRY_PAUSE: Duration = Duration::from_millis(50);

/// Whether a campaign should queue again after `error`: the server went away or is restarting
/// (connection lost, connection refused, SHUTTING_DOWN, RECOVERING...). Not after a time-out:
/// the first request may still be queued on the server, and a second one would queue behind it.
/// And after [`Error::AcquireEnded`]: the campaign was granted while its answer was lost and
/// that leadership is over, so the candidate stands again.
fn retry_campaign(error: &Error) -> bool {
    let ended = matches!(error, Error::AcquireEnded { .. });
    ended || (error.is_transient() && !matches!(error, Error::Timeout(_)))
}

impl Election {
    /// The election `group` with default [`ElectionOptions`].
    pub fn new(client: Client, group: &str) -> Election {
        Election::with_options(client, group, ElectionOptions::default())
    }

    /// The election `group` with `options`.
    pub fn with_options(client: Client, group: &str, options: ElectionOptions) -> Election {
        Election {
            client,
            group: group.to_owned(),
            key: Bytes::from(format!("election/{group}")),
            options,
        }
    }

    /// The client campaigns and observations go through.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// The group's name.
    pub fn group(&self) -> &str {
        &self.group
    }

    /// The lock key the group uses: `election/{group}`.
    pub fn key(&self) -> &[u8] {
        &self.key
    }

    /// Waits until this candidate leads, then returns its [`Leadership`].
    ///
    /// # Errors
    /// [`crate::Error::Invalid`] for an over-long value or group name; otherwise any error a
    /// request can meet (a lost connection ends the campaign; call it again).
    ///
    /// # Panics
    /// When the options' `keep_alive` does not fit in `ttl` (see [`crate::Lease::keep_alive_with`]).
    pub async fn campaign(&self, value: impl AsRef<[u8]>) -> Result<Leadership> {
        let value = Bytes::copy_from_slice(value.as_ref());
        let tied = self.options.release_on_disconnect;
        let options = AcquireOptions {
            wait: self.options.wait_max,
            meta: value.clone(),
            release_on_disconnect: tied.unwrap_or(self.client.endpoints().len() == 1),
        };
        loop {
            let outcome = match self
                .client
                .acquire(&self.key, self.options.ttl, options.clone())
                .await
            {
                Ok(outcome) => outcome,
                Err(e) if retry_campaign(&e) => {
                    // The server restarted (or is restarting) under the standby: queue again
                    // once it is back. The client's reconnect backoff spaces the attempts.
                    tracing::debug!(error = %e, "campaign interrupted; queueing again");
                    tokio::time::sleep(CAMPAIGN_RETRY_PAUSE).await;
                    continue;
                }
                Err(e) => return Err(e),
            };
            match outcome {
                AcquireOutcome::Granted(lease) => {
                    return Ok(Leadership {
                        guard: lease.keep_alive_with(self.options.keep_alive),
                        group: self.group.clone(),
                        value,
                    });
                }
                AcquireOutcome::Locked(by) => {
                    tracing::debug!(term = by.token, "still not leading; waiting again");
                }
            }
        }
    }

    /// The current leader, if any.
    ///
    /// # Errors
    /// Any error a request can meet.
    pub async fn leader(&self) -> Result<Option<Leader>> {
        Ok(match self.client.inspect(&self.key).await? {
            KeyState::Free => None,
            KeyState::Held { token, meta, .. } => Some(Leader {
                term: token,
                value: meta,
            }),
        })
    }

    /// Every new leader from now on, in increasing term order, starting with the current one.
    ///
    /// The stream WATCHes the group's lock; the server's reply carries the leader at that moment
    /// and events every grant after it, so no leader falls between the two. It never yields a
    /// term not larger than the last one yielded. When the watch fails
    /// (the connection closed) it yields the error, then subscribes again and goes on; a leader
    /// that came and went while it was not subscribed is skipped.
    pub fn observe(&self) -> Observer {
        let state = ObserveState {
            election: self.clone(),
            watch: None,
            last_term: 0,
            failed: false,
        };
        let stream = stream::unfold(state, |mut state| async move {
            let item = state.next_leader().await;
            Some((item, state))
        });
        Observer {
            inner: Box::pin(stream),
        }
    }
}

struct ObserveState {
    election: Election,
    watch: Option<Watch>,
    last_term: u64,
    failed: bool,
}

impl ObserveState {
    async fn next_leader(&mut self) -> Result<Leader> {
        loop {
            let Some(watch) = self.watch.as_mut() else {
                if self.failed {
                    tokio::time::sleep(RESUBSCRIBE_DELAY).await;
                }
                self.failed = true;
                let watch = self.election.client.watch(&self.election.key).await?;
                self.failed = false;
                let current = match watch.initial_state() {
                    KeyState::Free => None,
                    KeyState::Held { token, meta, .. } => Some(Leader {
                        term: *token,
                        value: meta.clone(),
                    }),
                };
                self.watch = Some(watch);
                if let Some(leader) = current.and_then(|leader| self.newer(leader)) {
                    return Ok(leader);
                }
                continue;
            };
            match watch.next().await {
                Some(Ok(event)) if event.kind == EventKind::Granted => {
                    let leader = Leader {
                        term: event.token,
                        value: event.meta,
                    };
                    if let Some(leader) = self.newer(leader) {
                        return Ok(leader);
                    }
                }
                Some(Ok(_)) => {}
                Some(Err(e)) => {
                    self.watch = None;
                    self.failed = true;
                    return Err(e);
                }
                None => {
                    self.watch = None;
                    self.failed = true;
                }
            }
        }
    }

    fn newer(&mut self, leader: Leader) -> Option<Leader> {
        if leader.term <= self.last_term {
            return None;
        }
        self.last_term = leader.term;
        Some(leader)
    }
}

/// The stream of leaders from [`Election::observe`]; never ends by itself.
pub struct Observer {
    inner: Pin<Box<dyn Stream<Item = Result<Leader>> + Send>>,
}

impl fmt::Debug for Observer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Observer")
    }
}

impl Observer {
    /// The next leader (or the error of a failed watch, after which observing goes on).
    pub async fn next(&mut self) -> Option<Result<Leader>> {
        self.inner.next().await
    }
}

impl Stream for Observer {
    type Item = Result<Leader>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.inner.as_mut().poll_next(cx)
    }
}

/// This candidate leads the group until it resigns or its lease is lost.
#[derive(Debug)]
pub struct Leadership {
    guard: LeaseGuard,
    group: String,
    value: Bytes,
}

impl Leadership {
    /// The term: the fencing token of the leader's grant. Fence the leader's writes on it.
    pub fn term(&self) -> u64 {
        self.guard.fencing_token()
    }

    /// The group led.
    pub fn group(&self) -> &str {
        &self.group
    }

    /// The value this candidate campaigned with.
    pub fn value(&self) -> &[u8] {
        &self.value
    }

    /// The guard renewing the leader's lease.
    pub fn guard(&self) -> &LeaseGuard {
        &self.guard
    }

    /// True while this candidate still leads as far as it can tell (see
    /// [`LeaseGuard::is_valid`]).
    pub fn is_valid(&self) -> bool {
        self.guard.is_valid()
    }

    /// Resolves when leadership is lost (see [`LeaseGuard::lost`]).
    pub fn lost(&self) -> impl Future<Output = LossReason> + Send + 'static {
        self.guard.lost()
    }

    /// A token cancelled when leadership is lost.
    pub fn cancellation_token(&self) -> CancellationToken {
        self.guard.cancellation_token()
    }

    /// The guard itself, for code that handles leases and leaderships alike.
    pub fn into_guard(self) -> LeaseGuard {
        self.guard
    }

    /// Steps down: releases the lock so the next candidate in line leads.
    ///
    /// # Errors
    /// As [`Client::release`]; the lock is then freed when the lease runs out or the
    /// connection closes.
    pub async fn resign(self) -> Result<()> {
        self.guard.release().await.map(|_| ())
    }
}

impl Client {
    /// Campaigns in `group` with default [`ElectionOptions`]: waits until this candidate
    /// leads. Shorthand for `Election::new(client, group).campaign(value)`.
    ///
    /// # Errors
    /// As [`Election::campaign`].
    pub async fn campaign(&self, group: &str, value: impl AsRef<[u8]>) -> Result<Leadership> {
        Election::new(self.clone(), group).campaign(value).await
    }

    /// Every new leader of `group`, in increasing term order. Shorthand for
    /// `Election::new(client, group).observe()`.
    pub fn observe(&self, group: &str) -> Observer {
        Election::new(self.clone(), group).observe()
    }
}
