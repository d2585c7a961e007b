//! [`Watch`]: the stream of changes to one key, registered on one connection.
//!
//! The connection's reader routes each event to the watch's bounded queue (see `conn`); this
//! module turns that queue into a stream that ends with the error that ended it, and
//! unsubscribes when dropped.

use std::fmt;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures_util::Stream;
use tenure_protocol::{ErrorCode, Request, Response};

use crate::conn::{Conn, WatchRegistration};
use crate::error::{unexpected, Error, Result};
use crate::outcome::{KeyState, WatchEvent};
use crate::router::Router;

/// Most events a watch queues for a consumer that is not reading; past it the watch is
/// dropped with [`Error::WatchOverflow`] rather than stall the connection.
pub const WATCH_EVENTS_MAX: usize = 1024;

/// A stream of [`WatchEvent`]s for one key, from [`Client::watch`](crate::Client::watch).
///
/// Ends after yielding one error: [`Error::ConnectionLost`] when the connection closes,
/// [`Error::WatchOverflow`] when the consumer fell [`WATCH_EVENTS_MAX`] events behind, or
/// [`Error::Server`] when the server ended the watch (its own queue for this connection
/// overflowed).
/// Dropping it unsubscribes.
pub struct Watch {
    conn: Arc<Conn>,
    key: Bytes,
    registration: WatchRegistration,
    initial_state: KeyState,
    ended: bool,
}

impl fmt::Debug for Watch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Watch").field("key", &self.key).finish()
    }
}

impl Watch {
    /// Registers a watch of `key` on the router's current connection (opening one if
    /// needed), as [`Client::watch`](crate::Client::watch) describes.
    pub(crate) async fn start(router: &Router, key: &[u8]) -> Result<Watch> {
        let key = Bytes::copy_from_slice(key);
        Request::Watch { key: key.clone() }
            .validate()
            .map_err(Error::invalid)?;
        let timeout = router.config().request_timeout;
        // A follower refuses WATCH with NOT_LEADER, as every request: followed as the
        // others are, so a watch set up again after a fail-over reaches the new leader
        // rather than asking the same follower until something else moves the connection.
        let started = async {
            let mut redirects = 0;
            loop {
                let conn = router.connection().await?;
                let (reply, registration) = conn.watch(key.clone(), WATCH_EVENTS_MAX).await?;
                if let Response::Error {
                    code: ErrorCode::NotLeader,
                    message,
                } = &reply
                {
                    if redirects < router.redirects_max() {
                        conn.shared.remove_watch(registration.id, &key);
                        redirects += 1;
                        router.follow(&conn, message).await;
                        continue;
                    }
                }
                return Ok::<_, Error>((reply, registration, conn));
            }
        };
        let (reply, registration, conn) = tokio::time::timeout(timeout, started)
            .await
            .unwrap_or(Err(Error::Timeout(timeout)))?;
        let initial_state = match reply {
            Response::Watching { holder: None } => KeyState::Free,
            Response::Watching { holder: Some(h) } => KeyState::Held {
                token: h.token,
                ttl_left: Duration::from_millis(u64::from(h.ttl_left_ms)),
                waiters: h.waiters,
                meta: h.meta,
            },
            other => {
                conn.shared.remove_watch(registration.id, &key);
                return Err(unexpected("WATCH", other));
            }
        };
        Ok(Watch {
            conn,
            key,
            registration,
            initial_state,
            ended: false,
        })
    }

    /// The key being watched.
    pub fn key(&self) -> &[u8] {
        &self.key
    }

    /// The key's state when the watch started (`ttl_left` as of then): the stream's events
    /// are exactly the changes after it.
    pub fn initial_state(&self) -> &KeyState {
        &self.initial_state
    }

    /// The next event, or the error that ended the watch; `None` after that error.
    pub async fn next(&mut self) -> Option<Result<WatchEvent>> {
        std::future::poll_fn(|cx| self.poll_event(cx)).await
    }

    fn poll_event(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<WatchEvent>>> {
        if self.ended {
            return Poll::Ready(None);
        }
        match self.registration.events.poll_recv(cx) {
            Poll::Ready(Some(Ok(event))) => Poll::Ready(Some(Ok(event))),
            Poll::Ready(Some(Err(e))) => {
                self.ended = true;
                Poll::Ready(Some(Err(e)))
            }
            Poll::Pending => Poll::Pending,
            Poll::Ready(None) => {
                self.ended = true;
                let error = if self.registration.overflow.load(Ordering::Acquire) {
                    Error::WatchOverflow
                } else if self.conn.is_closed() {
                    self.conn.shared.lost_error()
                } else {
                    Error::Protocol("the server ended the watch".into())
                };
                Poll::Ready(Some(Err(error)))
            }
        }
    }
}

impl Stream for Watch {
    type Item = Result<WatchEvent>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.get_mut().poll_event(cx)
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        let others = self
            .conn
            .shared
            .remove_watch(self.registration.id, &self.key);
        if others || self.conn.is_closed() {
            return;
        }
        // Unsubscribing is a courtesy (the server drops watches with the connection), so it
        // is skipped when no runtime is around to send it.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let conn = Arc::clone(&self.conn);
            let key = self.key.clone();
            let _unwatch = runtime.spawn(async move {
                let _ = conn.call(Request::Unwatch { key }).await;
            });
        }
    }
}
