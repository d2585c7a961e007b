//! Process supervision: `tenure run` holds a lock while a command runs, and (for `run` and
//! `elect`) the command is stopped when the lock is lost, with SIGTERM, then SIGKILL.

use std::os::unix::process::ExitStatusExt as _;
use std::process::ExitStatus;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use tenure::{AcquireOptions, AcquireOutcome, Bytes, Client, LeaseKind, LossReason};
use tokio::signal::unix::{signal, SignalKind};

use crate::cli::RunArgs;
use crate::exit::{EXIT_ERROR, EXIT_LOCKED, EXIT_LOST};
use crate::guard::{
    deadline_signal, guarded, stop_orphaned_group, tell_deadline, PidPipe, GUARD_MARGIN,
};
use crate::hold::{
    lock_in_session, loss_text, requeue_reason, session_ended_while_waiting, sessions_unknown,
    Hold, Loss,
};
use crate::output::{ms, warn, Line, Out};
use crate::requests::print_locked;

/// `tenure run`: takes the lock (waiting if asked) in a session of its own (or, with
/// `--no-session`, as a lease renewed alone), runs the command under it, releases.
///
/// The session is the default because it is durable like a lease (PROTOCOL.md 3.11): it rides
/// through a restart and a fail-over, and unlike a renewed lease its end frees the lock at
/// once when `tenure` closes it.
pub async fn run(client: &Client, out: &Out, args: RunArgs) -> anyhow::Result<u8> {
    let key = args.key().to_owned();
    let kind = args.kind.kind();
    let options = AcquireOptions {
        wait: args.wait,
        meta: Bytes::from(args.meta.unwrap_or_default()),
        release_on_disconnect: false,
    };
    let outcome = if !args.no_session {
        let in_session =
            acquire_through_restarts(client, &key, args.ttl, kind, options.clone(), true).await;
        match in_session {
            Err(e) if e.downcast_ref().is_some_and(sessions_unknown) => {
                warn("the server does not know sessions; holding a lease renewed alone");
                acquire_lease(client, &key, args.ttl, kind, options).await?
            }
            outcome => outcome?,
        }
    } else {
        acquire_lease(client, &key, args.ttl, kind, options).await?
    };
    let (hold, waited) = match outcome {
        AcquireOutcome::Granted(granted) => granted,
        AcquireOutcome::Locked(by) => {
            print_locked(out, &key, &by);
            return Ok(EXIT_LOCKED);
        }
    };
    let mut line = Line::new("GRANTED")
        .text("key", key.as_str())
        .number("token", hold.fencing_token())
        .text("lease", hold.lease_id().to_string())
        .number("ttl_ms", ms(args.ttl))
        // A script counting the lease adds this to the TTL (PROTOCOL.md 3.3).
        .number("waited_ms", ms(waited));
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

/// A lease renewed alone, with the time it waited in line.
async fn acquire_lease(
    client: &Client,
    key: &str,
    ttl: Duration,
    kind: LeaseKind,
    options: AcquireOptions,
) -> anyhow::Result<AcquireOutcome<(Hold, Duration)>> {
    acquire_through_restarts(client, key, ttl, kind, options, false).await
}

/// Pause before queueing again after a wait was cut short by a server restart, on top of the
/// client's own reconnect backoff.
const REQUEUE_PAUSE: Duration = Duration::from_millis(50);
/// Longest `tenure run` and `tenure elect` try to give a lost lock back before they exit
/// (the server may be down: its TTL frees the lock then).
const GIVE_BACK_AFTER_LOSS_MAX: Duration = Duration::from_secs(2);

/// Acquires `key` as `kind`, in a new session of `ttl` when `in_session`; a wait cut short by a server
/// restart (connection lost or refused, SHUTTING_DOWN, RECOVERING), or whose session ended or
/// was lost before the grant (NO_SESSION: say its TTL ran out while the server was down),
/// queues again (in a new session), for what is left of `options.wait`. A time-out is not
/// retried: the first request may still be queued on the server.
async fn acquire_through_restarts(
    client: &Client,
    key: &str,
    ttl: Duration,
    kind: LeaseKind,
    mut options: AcquireOptions,
    in_session: bool,
) -> anyhow::Result<AcquireOutcome<(Hold, Duration)>> {
    let wait_until = Instant::now() + options.wait;
    loop {
        let attempt = if in_session {
            lock_in_session(client, key, ttl, kind, options.clone()).await
        } else {
            client
                .acquire_kind(key, ttl, kind, options.clone())
                .await
                .map(|outcome| match outcome {
                    AcquireOutcome::Granted(lease) => {
                        let waited = lease.waited();
                        let hold = Hold::lease(lease.keep_alive(), client, kind);
                        AcquireOutcome::Granted((hold, waited))
                    }
                    AcquireOutcome::Locked(by) => AcquireOutcome::Locked(by),
                })
        };
        match attempt {
            Ok(outcome) => return Ok(outcome),
            // A grant whose answer was lost and that has ended since (AcquireEnded) is queued
            // for again too: the command has not run under it.
            Err(e)
                if matches!(e, tenure::Error::AcquireEnded { .. })
                    || (in_session && session_ended_while_waiting(&e))
                    || (e.is_transient() && !matches!(e, tenure::Error::Timeout(_))) =>
            {
                let left = wait_until.saturating_duration_since(Instant::now());
                if left <= REQUEUE_PAUSE {
                    return Err(e.into());
                }
                warn(&format!(
                    "{}; queueing again for the {left:?} of --wait left",
                    requeue_reason(&e)
                ));
                tokio::time::sleep(REQUEUE_PAUSE).await;
                options.wait = wait_until.saturating_duration_since(Instant::now());
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// Runs `command` while `guard` holds the lock, under a guardian that stops its whole process
/// group (`crate::guard`). On loss: SIGTERM to the group, SIGKILL after `grace`, exit code 4.
/// On SIGINT or SIGTERM to us: the same, then release and exit with the command's status.
/// Otherwise (the command exited; any leftovers in its group stopped): release and exit with
/// its status.
pub async fn supervise(
    guard: Hold,
    out: &Out,
    key: &str,
    command: &[String],
    grace: Duration,
) -> anyhow::Result<u8> {
    let Some(program) = command.first() else {
        bail!("no command given after --");
    };
    let mut interrupt = signal(SignalKind::interrupt()).context("installing a SIGINT handler")?;
    let mut terminated = signal(SignalKind::terminate()).context("installing a SIGTERM handler")?;
    // The command runs under a guardian (crate::guard) that stops its whole process group,
    // even after this process is killed with SIGKILL. Not killed on drop: a guardian killed
    // with SIGKILL would leave the group running; our exit sends it SIGTERM instead.
    let mut pids = PidPipe::new().context("making a pipe for the command's guardian")?;
    let mut command_line = guarded(
        command,
        grace,
        out.json,
        guard.guardian_time_left(),
        pids.write_fd(),
    );
    command_line
        .env("TENURE_FENCING_TOKEN", guard.fencing_token().to_string())
        .env("TENURE_LEASE_ID", guard.lease_id().to_string())
        .env("TENURE_KEY", key);
    if let Some(id) = guard.session_id() {
        command_line.env("TENURE_SESSION_ID", id.to_string());
    }
    die_with_us(&mut command_line);
    pids.pass_to(&mut command_line);
    let spawned = command_line.spawn();
    pids.close_write();
    let mut child = match spawned {
        Ok(child) => child,
        Err(e) => {
            let _ = guard.release().await;
            return Err(e).with_context(|| format!("cannot start {program:?}"));
        }
    };
    let mut lost = guard.lost();
    let mut told = Told::new(&guard);
    // Often enough for a short lease's renewals to keep the guardian's deadline ahead.
    let every = (guard.time_left() / 10).clamp(TELL_GUARDIAN_EVERY_MIN, TELL_GUARDIAN_EVERY);
    let mut tell = tokio::time::interval(every);
    let status = loop {
        tokio::select! {
            status = child.wait() => break status.context("waiting for the command")?,
            reason = &mut lost => {
                match terminate(&mut child, grace).await {
                    Err(e) => warn(&format!("{e:#}")),
                    Ok(status) if status.signal().is_some() => {
                        if !group_stopped(&mut pids, grace).await {
                            return Ok(keep_for_orphans(guard, out, status));
                        }
                    }
                    Ok(_) => {}
                }
                return Ok(lost_exit(guard, out, key, &reason).await);
            }
            _ = interrupt.recv() => break terminate(&mut child, grace).await?,
            _ = terminated.recv() => break terminate(&mut child, grace).await?,
            _ = tell.tick() => told.update(&child, &guard),
        }
    };
    // The guardian exits with a code of its own, never by a signal: killed, it stopped
    // nothing, and the command's group may run on.
    if status.signal().is_some() {
        if !group_stopped(&mut pids, grace).await {
            return Ok(keep_for_orphans(guard, out, status));
        }
        let message = format!(
            "the command's guardian was killed ({status}); tenure stopped the command's \
             process group and released the lock"
        );
        if let Err(e) = guard.release().await {
            warn(&format!("release failed: {e}"));
        }
        out.error(message);
        return Ok(EXIT_ERROR);
    }
    // Past the local deadline, the command may have run on after the lock was gone (this
    // process stopped, its guardian stopping the command at that deadline): a loss.
    if guard.time_left().is_zero() {
        let reason = tokio::time::timeout(LOSS_SEEN_WITHIN, &mut lost).await;
        let reason = reason.unwrap_or(Loss {
            reason: LossReason::Expired { last_error: None },
            seen_by_watch: false,
        });
        return Ok(lost_exit(guard, out, key, &reason).await);
    }
    if let Err(e) = guard.release().await {
        warn(&format!("release failed: {e}"));
    }
    Ok(exit_code(status))
}

/// Stops the command's process group ourselves, its guardian having been killed: true once
/// no process of it is left (or none was started), false if we cannot tell which group it
/// is or it outlives SIGKILL.
async fn group_stopped(pids: &mut PidPipe, grace: Duration) -> bool {
    match pids.command_pid() {
        Some(pgid) => stop_orphaned_group(pgid, grace).await,
        None => false,
    }
}

/// The guardian was killed and its command's group may still run: the lock is not given
/// back (its session is not closed, its lease not released: it runs out after its TTL, as
/// if `tenure` had died with the command), and the exit code says an error.
fn keep_for_orphans(guard: Hold, out: &Out, status: ExitStatus) -> u8 {
    out.error(format!(
        "the command's guardian was killed ({status}) and its process group could not be \
         stopped; the lock is not released and runs out after its TTL"
    ));
    // Dropped, the guard would close its session or release its lease.
    std::mem::forget(guard);
    EXIT_ERROR
}

/// After the lock was lost and the command stopped: says so, gives the lock back if the
/// server still has it, and returns the exit code.
async fn lost_exit(guard: Hold, out: &Out, key: &str, reason: &Loss) -> u8 {
    out.print(
        Line::new("LOST")
            .text("key", key)
            .text("reason", loss_text(reason)),
    );
    guard.give_back_after_loss(GIVE_BACK_AFTER_LOSS_MAX).await;
    EXIT_LOST
}

/// How often `tenure` tells the command's guardian a later local deadline, if it moved: at
/// most this seldom, and at least every tenth of the lock's time left at the grant (a renewal
/// moves it every third of the TTL), but not more often than `TELL_GUARDIAN_EVERY_MIN`.
const TELL_GUARDIAN_EVERY: Duration = Duration::from_millis(100);
const TELL_GUARDIAN_EVERY_MIN: Duration = Duration::from_millis(1);
/// Least move of the local deadline worth telling the guardian.
const TOLD_STEP_MIN: Duration = Duration::from_millis(1);
/// How long a loss is waited for once the local deadline is seen passed: the guard's own
/// signal fires at that deadline, so it is at most a scheduling delay away.
const LOSS_SEEN_WITHIN: Duration = Duration::from_secs(1);

/// The local deadline the guardian was last told, as an instant of ours.
struct Told(Instant);

impl Told {
    /// The deadline the guardian started with (its command line).
    fn new(guard: &Hold) -> Told {
        Told(Instant::now() + guard.guardian_time_left())
    }

    /// Tells the guardian of `child` its deadline if it moved later.
    fn update(&mut self, child: &tokio::process::Child, guard: &Hold) {
        let left = guard.guardian_time_left();
        let deadline = Instant::now() + left;
        // Told in whole milliseconds: a later deadline by less tells nothing new.
        if left.is_zero() || deadline < self.0 + TOLD_STEP_MIN {
            return;
        }
        let Some(pid) = child.id() else { return };
        match tell_deadline(pid, left) {
            Ok(()) => self.0 = deadline,
            Err(e) => warn(&format!(
                "telling the command's guardian its deadline failed: {e}"
            )),
        }
    }
}

/// SIGTERM to the guardian, which stops the command's process group (SIGTERM, SIGKILL after
/// `grace`) and then exits with the command's status; killed itself if it has not ended
/// [`GUARD_MARGIN`] after the grace.
async fn terminate(
    child: &mut tokio::process::Child,
    grace: Duration,
) -> anyhow::Result<ExitStatus> {
    if let Some(pid) = child.id() {
        if let Err(e) = send_sigterm(pid) {
            warn(&format!("SIGTERM to {pid} failed: {e}"));
        }
    }
    let bound = grace.saturating_add(GUARD_MARGIN);
    if let Ok(status) = tokio::time::timeout(bound, child.wait()).await {
        return status.context("waiting for the command");
    }
    warn("the command's guardian did not end; killing it");
    child
        .kill()
        .await
        .context("killing the command's guardian")?;
    child.wait().await.context("waiting for the command")
}

/// Has the kernel send the guardian SIGTERM if this process dies without stopping it
/// (`kill -9`, the OOM killer): nobody would renew the lease any more, and an orphaned command
/// would go on working after it ran out, beside the next holder. The guardian then stops the
/// command's group as it would on a loss. Also starts the guardian with the signal that
/// tells it deadlines ([`deadline_signal`]) blocked.
#[allow(unsafe_code)]
fn die_with_us(command: &mut tokio::process::Command) {
    let parent = libc::pid_t::try_from(std::process::id()).expect("a pid fits in pid_t");
    let told = deadline_signal();
    // SAFETY: the closure runs in the child between fork and exec, where only
    // async-signal-safe calls are allowed: it calls prctl(2), getppid(2), sigemptyset,
    // sigaddset and pthread_sigmask on a set on its stack, and allocates nothing
    // (`from_raw_os_error` builds the error without allocating). A zeroed sigset_t is a
    // valid value to start from.
    unsafe {
        command.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // We may have died between fork and prctl: then the signal will never come.
            if libc::getppid() != parent {
                return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
            }
            // A deadline we tell before the guardian has blocked it would kill it (a
            // queued signal's default action): blocked here, the mask survives the exec.
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, told);
            if libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

// `kill(2)` is the only way to send SIGTERM (tokio's `Child::kill` sends SIGKILL, which gives
// the command no chance to clean up), and it is an FFI call.
#[allow(unsafe_code)]
fn send_sigterm(pid: u32) -> std::io::Result<()> {
    let pid = libc::pid_t::try_from(pid).map_err(std::io::Error::other)?;
    // SAFETY: kill(2) takes two integers and touches no memory of this process. `pid` is our
    // own child, not yet reaped (we hold its `Child`), so it names no other process.
    let rc = unsafe { libc::kill(pid, libc::SIGTERM) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// The command's exit status as ours: its code, or 128 + the signal that killed it.
fn exit_code(status: ExitStatus) -> u8 {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => u8::try_from(code & 0xff).expect("masked to a byte"),
        (None, Some(signal)) => u8::try_from((128 + signal) & 0xff).expect("masked to a byte"),
        (None, None) => EXIT_ERROR,
    }
}
