//! Leader election from the shell: `tenure elect` runs a command only while leading a group
//! (supervised like `tenure run`), `tenure observe` prints each new leader.

use std::time::Duration;

use tenure::{AcquireOptions, AcquireOutcome, Bytes, Client, Election, ElectionOptions, LeaseKind};

use crate::cli::ElectArgs;
use crate::exit::EXIT_OK;
use crate::hold::{
    lock_in_session, requeue_reason, session_ended_while_waiting, sessions_unknown, Hold,
};
use crate::output::{kv_value, warn, Line, Out};
use crate::run::supervise;

/// Pause before a candidate queues again after its wait was cut short by a server restart.
const CAMPAIGN_RETRY_PAUSE: Duration = Duration::from_millis(50);

/// `tenure elect`: campaigns until leading (in a session of its own, or with `--no-session`
/// as a lease renewed alone), then runs the command while leadership lasts.
pub async fn elect(client: Client, out: &Out, args: ElectArgs) -> anyhow::Result<u8> {
    let options = ElectionOptions {
        ttl: args.ttl,
        ..ElectionOptions::default()
    };
    let election = Election::with_options(client.clone(), &args.group, options);
    let key = String::from_utf8_lossy(election.key()).into_owned();
    let hold = if args.no_session {
        campaign_alone(&election, &client, &args.value).await?
    } else {
        match campaign_in_session(&client, &key, args.ttl, &args.value).await {
            Err(e) if sessions_unknown(&e) => {
                warn("the server does not know sessions; leading with a lease renewed alone");
                campaign_alone(&election, &client, &args.value).await?
            }
            hold => hold?,
        }
    };
    let mut line = Line::new("LEADING")
        .text("group", args.group.as_str())
        .number("term", hold.fencing_token())
        .text("value", args.value.as_str())
        // Appended (compatible): the lock it leads by, as `tenure run`'s GRANTED line gives
        // them, so a script can INSPECT or fence with it; then its session, if any.
        .text("key", key.as_str())
        .text("lease", hold.lease_id().to_string());
    if let Some(id) = hold.session_id() {
        line = line.text("session", id.to_string());
    }
    // Last, as `tenure acquire` marks one (outside test a49, P5: it was not marked here).
    if hold.is_repeat() {
        line = line.number("repeat", 1);
    }
    out.print(line);
    supervise(hold, out, &key, &args.command, args.grace).await
}

/// The campaign of [`Election::campaign`]: a lease renewed alone.
async fn campaign_alone(election: &Election, client: &Client, value: &str) -> anyhow::Result<Hold> {
    let guard = election.campaign(value).await?.into_guard();
    Ok(Hold::lease(guard, client, LeaseKind::Exclusive))
}

/// Waits in line for `key` in a session of `ttl` until it is granted: the leader's term is
/// its fencing token, and its leadership lasts while its session does: until its holder stops
/// keeping the session alive (a restart of the server or a fail-over does not end it).
async fn campaign_in_session(
    client: &Client,
    key: &str,
    ttl: Duration,
    value: &str,
) -> tenure::Result<Hold> {
    let options = AcquireOptions {
        wait: ElectionOptions::default().wait_max,
        meta: Bytes::copy_from_slice(value.as_bytes()),
        release_on_disconnect: false,
    };
    loop {
        let exclusive = tenure::LeaseKind::Exclusive;
        match lock_in_session(client, key, ttl, exclusive, options.clone()).await {
            Ok(AcquireOutcome::Granted((hold, _))) => return Ok(hold),
            Ok(AcquireOutcome::Locked(_)) => {}
            // The server restarted (or is restarting) under the standby: queue again once it
            // is back. Not after a time-out: the first request may still be queued.
            Err(e) if e.is_transient() && !matches!(e, tenure::Error::Timeout(_)) => {
                tokio::time::sleep(CAMPAIGN_RETRY_PAUSE).await;
            }
            // The standby's session ended (or was lost here) before it led, say while the
            // server was down past its TTL: campaign again in a new session.
            Err(e) if session_ended_while_waiting(&e) => {
                warn(&format!(
                    "{}; campaigning again in a new session",
                    requeue_reason(&e)
                ));
                tokio::time::sleep(CAMPAIGN_RETRY_PAUSE).await;
            }
            Err(e) => return Err(e),
        }
    }
}

/// `tenure observe`: one `term= value=` line per new leader, until the stream ends.
pub async fn observe(client: Client, out: &Out, group: String) -> anyhow::Result<u8> {
    let mut leaders = Election::new(client, &group).observe();
    while let Some(leader) = leaders.next().await {
        match leader {
            Ok(leader) => out.print(
                Line::default()
                    .number("term", leader.term)
                    .text("value", String::from_utf8_lossy(&leader.value)),
            ),
            Err(e) => eprintln!("error={}", kv_value(&e.to_string())),
        }
    }
    Ok(EXIT_OK)
}
