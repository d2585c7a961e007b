//! The guardian between `tenure run`/`tenure elect` and its command: `tenure` re-executed
//! with a hidden first argument ([`GUARD_ARG`]). It starts the command as the leader of a
//! process group of its own and stops that whole group (SIGTERM, SIGKILL after the grace)
//! when asked to (SIGTERM, SIGINT or SIGHUP), when its parent `tenure` dies (its parent-death
//! signal is SIGTERM, set by `run`), and when the command exits leaving processes behind in
//! its group. It exits only once the group is empty, with the command's status (its code, or
//! 128 + the signal that killed it).
//!
//! Why a process between them: the kernel's parent-death signal reaches only a direct child,
//! so a `tenure` killed with SIGKILL (or by the OOM killer) could not stop its command's own
//! children, which would go on working unprotected beside the next holder. The guardian is
//! small and does nothing but wait, so it outlives `tenure` by at most the grace.
//!
//! It also keeps the lock's local deadline, as `tenure` last told it (its command line
//! gives the first; each later one comes as a queued signal, [`deadline_signal`]): should
//! `tenure` be stopped or stuck (SIGSTOP, a debugger, a process that no longer runs) past
//! it, the guardian stops the group by itself, as `tenure` would have (outside test a34,
//! finding F2: a stopped `tenure` left its command running beside the next holder). A stop
//! of the guardian as well (a SIGSTOP to `tenure`'s whole process group) leaves nobody to
//! act; README says so.
//!
//! It is also the group's child subreaper: a member orphaned by its parent's exit becomes
//! its child and is reaped here, so a group that has ended is seen empty at once.
//!
//! A group of its own is not the terminal's foreground group, so with a terminal on stdin
//! the guardian hands the terminal's foreground to the command's group and back, and passes
//! a stop of the command (Ctrl-Z) on to `tenure`'s job ([`crate::terminal`]): the command
//! reads the terminal and gets Ctrl-C and Ctrl-Z as a command run by the shell does.

use std::ffi::OsString;
use std::os::unix::process::CommandExt as _;
use std::time::{Duration, Instant};

use crate::exit::EXIT_ERROR;
use crate::output::{kv_value, Out};
use crate::terminal::Terminal;

/// `tenure GUARD_ARG GRACE_MS FORMAT GIVE_UP_MS -- PROGRAM ARGS...` runs the guardian. Not a subcommand of the
/// command line (it is not for people to type), so it is looked for before parsing.
pub const GUARD_ARG: &str = "__tenure_guard__";

/// Longest the guardian sleeps while the command runs: it wakes sooner for a signal (a
/// stop request, SIGCHLD, a later deadline) or at the lock's local deadline.
const WAKE_EVERY: Duration = Duration::from_millis(200);

/// How often the guardian looks at its group while it waits for it to end.
const POLL: Duration = Duration::from_millis(10);

/// How long the guardian waits for its group to empty after SIGKILL before it gives up
/// (a process stuck in the kernel, or a zombie nobody reaps) and exits anyway, warning.
const KILLED_WAIT: Duration = Duration::from_secs(5);

/// The longest the guardian takes to end after it is asked to, beyond the grace: `run`
/// waits this long for it before killing it.
pub const GUARD_MARGIN: Duration = Duration::from_secs(10);
const _: () = assert!(GUARD_MARGIN.as_millis() > KILLED_WAIT.as_millis());

/// The guardian's command line for `command`, stopping it with `grace` between SIGTERM and
/// SIGKILL, printing its errors as JSON if `json` (`--json`), and stopping it by itself
/// `give_up_in` from its start unless told a later deadline ([`tell_deadline`]).
/// `/proc/self/exe` is this very binary even if its file was replaced since; without /proc,
/// the path it was started from.
pub fn guarded(
    command: &[String],
    grace: Duration,
    json: bool,
    give_up_in: Duration,
) -> tokio::process::Command {
    let proc_exe = std::path::PathBuf::from("/proc/self/exe");
    let exe = if proc_exe.exists() {
        proc_exe
    } else {
        std::env::current_exe().unwrap_or(proc_exe)
    };
    let mut line = tokio::process::Command::new(exe);
    line.arg0("tenure")
        .arg(GUARD_ARG)
        .arg(grace.as_millis().to_string())
        .arg(if json { FORMAT_JSON } else { FORMAT_KV })
        .arg(millis(give_up_in).to_string())
        .arg("--")
        .args(command);
    line
}

/// The guardian's output format argument: `key=value` lines, or JSON (`--json`).
const FORMAT_KV: &str = "kv";
const FORMAT_JSON: &str = "json";

/// A time in whole milliseconds, rounded down (so a deadline passed on is never later),
/// as a queued signal's value carries it.
fn millis(span: Duration) -> i32 {
    i32::try_from(span.as_millis()).unwrap_or(i32::MAX)
}

/// What the guardian runs: see [`parse`].
struct Guarded<'a> {
    grace: Duration,
    out: Out,
    give_up_in: Duration,
    program: &'a OsString,
    args: &'a [OsString],
}

/// The guardian's arguments, `GRACE_MS FORMAT GIVE_UP_MS -- PROGRAM ARGS...`: the grace,
/// where its errors go, the time to the lock's local deadline, the program and its
/// arguments; `None` if they are not that.
fn parse(args: &[OsString]) -> Option<Guarded<'_>> {
    let grace = Duration::from_millis(args.first()?.to_str()?.parse().ok()?);
    let json = match args.get(1)?.to_str()? {
        FORMAT_KV => false,
        FORMAT_JSON => true,
        _ => return None,
    };
    let out = Out {
        json,
        to_stderr: true,
    };
    let give_up_in = Duration::from_millis(args.get(2)?.to_str()?.parse().ok()?);
    (args.get(3)? == "--").then_some(())?;
    Some(Guarded {
        grace,
        out,
        give_up_in,
        program: args.get(4)?,
        args: &args[5..],
    })
}

/// The queued (real-time) signal by which `tenure` tells its guardian a later local
/// deadline: its value is the time to it in milliseconds.
pub fn deadline_signal() -> libc::c_int {
    libc::SIGRTMIN() + 1
}

/// Tells the guardian `pid` that the lock's local deadline is now `give_up_in` away.
///
/// # Errors
/// The guardian has gone (ESRCH), or the signal queue is full (EAGAIN).
#[allow(unsafe_code)]
pub fn tell_deadline(pid: u32, give_up_in: Duration) -> std::io::Result<()> {
    let pid = libc::pid_t::try_from(pid).map_err(std::io::Error::other)?;
    // The value travels in the pointer-sized union: an integer, never dereferenced.
    let value = libc::sigval {
        sival_ptr: millis(give_up_in) as usize as *mut libc::c_void,
    };
    // SAFETY: sigqueue(2) takes integers and the union by value; it touches no memory of this
    // process. `pid` is our own child, not yet reaped, so it names no other process.
    let rc = unsafe { libc::sigqueue(pid, deadline_signal(), value) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// The guardian's main: `args` are those after [`GUARD_ARG`]. Returns the exit code.
pub fn guardian(args: &[OsString]) -> u8 {
    let Some(Guarded {
        grace,
        out,
        give_up_in,
        program,
        args: program_args,
    }) = parse(args)
    else {
        eprintln!("error=\"{GUARD_ARG} is internal to tenure run and tenure elect\"");
        return EXIT_ERROR;
    };
    let mut give_up_at = Instant::now() + give_up_in;
    // Blocked before the command starts, so no stop request is lost; taken by `sigtimedwait`.
    let signals = stop_signals();
    set_blocked(libc::SIG_BLOCK, &signals);
    become_subreaper();
    let terminal = Terminal::on_stdin();
    let mut command = std::process::Command::new(program);
    command.args(program_args).process_group(0);
    unblocked_in_child(&mut command, signals);
    let handed = terminal.as_ref().filter(|t| t.home_in_foreground());
    if let Some(terminal) = handed {
        terminal.hand_over_in_child(&mut command);
    }
    let spawned = command.spawn();
    let child = match spawned {
        Ok(child) => child,
        Err(e) => {
            if let Some(terminal) = handed {
                terminal.take_back(None);
            }
            out.error(format!("cannot start {program:?}: {e}"));
            return EXIT_ERROR;
        }
    };
    let pid = libc::pid_t::try_from(child.id()).expect("a pid fits in pid_t");
    // Waited for with waitpid(2) below, with the orphans this subreaper adopts.
    drop(child);
    let mut status = None;
    while status.is_none() {
        let now = Instant::now();
        if now >= give_up_at {
            let message = "tenure did not confirm the lock by its local deadline; \
                           stopping the command";
            eprintln!("warning={}", kv_value(message));
            break;
        }
        match next_signal(&signals, WAKE_EVERY.min(give_up_at - now)) {
            Woken::Stop => break,
            Woken::Deadline(later) => give_up_at = give_up_at.max(Instant::now() + later),
            Woken::Other => {}
        }
        // Stops of the command are seen only with a terminal: without one, nobody would
        // continue a job stopped on its behalf.
        let stopped = reap(pid, &mut status, terminal.is_some());
        if let (Some(signal), Some(terminal)) = (stopped, &terminal) {
            terminal.command_stopped(pid, signal);
        }
    }
    stop_group(pid, grace, &signals, &mut status);
    if let Some(terminal) = &terminal {
        terminal.take_back(Some(pid));
    }
    status.map_or(EXIT_ERROR, exit_code)
}

/// SIGTERM to the group led by `pid`, SIGKILL after `grace`, and waits until it is empty
/// (bounded by [`KILLED_WAIT`]), reaping the command into `status`.
fn stop_group(
    pid: libc::pid_t,
    grace: Duration,
    signals: &libc::sigset_t,
    status: &mut Option<libc::c_int>,
) {
    for (signal, wait) in [(libc::SIGTERM, grace), (libc::SIGKILL, KILLED_WAIT)] {
        reap(pid, status, false);
        if group_is_empty(pid) {
            return;
        }
        kill_group(pid, signal);
        // A stopped process acts on SIGTERM only once continued (SIGKILL needs no SIGCONT).
        kill_group(pid, libc::SIGCONT);
        let deadline = Instant::now() + wait;
        while Instant::now() < deadline {
            reap(pid, status, false);
            if group_is_empty(pid) {
                return;
            }
            // Requests to stop while stopping change nothing; SIGCHLD wakes us early.
            next_signal(signals, POLL);
        }
    }
    let message = format!("process group {pid} still has members after SIGKILL");
    eprintln!("warning={}", kv_value(&message));
}

/// The signals that ask the guardian to stop, SIGCHLD, which wakes it to reap, and
/// [`deadline_signal`].
#[allow(unsafe_code)]
fn stop_signals() -> libc::sigset_t {
    // SAFETY: sigemptyset/sigaddset write only into the set we own; a zeroed sigset_t is a
    // valid value to start from.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        let signals = [libc::SIGTERM, libc::SIGINT, libc::SIGHUP, libc::SIGCHLD];
        for signal in signals.into_iter().chain([deadline_signal()]) {
            libc::sigaddset(&mut set, signal);
        }
        set
    }
}

/// Blocks or unblocks (`how`) `signals` in this (single-threaded) process.
#[allow(unsafe_code)]
fn set_blocked(how: libc::c_int, signals: &libc::sigset_t) {
    // SAFETY: reads the set we pass, writes no old set.
    let rc = unsafe { libc::pthread_sigmask(how, signals, std::ptr::null_mut()) };
    assert_eq!(rc, 0, "pthread_sigmask with a valid set cannot fail");
}

/// The command starts with `signals` unblocked again: a mask is inherited through exec, and
/// std does not reset it on every path (seen: a background `sleep` of `sh -c` kept SIGTERM
/// blocked, so only the SIGKILL after the grace stopped it).
#[allow(unsafe_code)]
fn unblocked_in_child(command: &mut std::process::Command, signals: libc::sigset_t) {
    // SAFETY: the closure runs between fork and exec and calls only pthread_sigmask, which
    // is async-signal-safe, on a set copied into it; it allocates nothing.
    unsafe {
        command.pre_exec(move || {
            if libc::pthread_sigmask(libc::SIG_UNBLOCK, &signals, std::ptr::null_mut()) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Orphaned descendants become our children, so we can reap them (best effort: without it
/// they go to init, which reaps them too, a little later).
#[allow(unsafe_code)]
fn become_subreaper() {
    // SAFETY: prctl(2) with integer arguments only.
    let _ = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1) };
}

/// What woke the guardian ([`next_signal`]).
enum Woken {
    /// A request to stop: SIGTERM, SIGINT or SIGHUP.
    Stop,
    /// `tenure` (our parent, no other process) told a later local deadline, this far away.
    Deadline(Duration),
    /// SIGCHLD, a time-out, or a deadline signal from anyone but our parent.
    Other,
}

/// Waits up to `timeout` for one of `signals`.
#[allow(unsafe_code)]
fn next_signal(signals: &libc::sigset_t, timeout: Duration) -> Woken {
    let timeout = libc::timespec {
        tv_sec: libc::time_t::try_from(timeout.as_secs()).unwrap_or(libc::time_t::MAX),
        tv_nsec: libc::c_long::from(timeout.subsec_nanos()),
    };
    // SAFETY: a zeroed siginfo_t is a valid value for sigtimedwait(2) to overwrite.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: the set, the siginfo and the time-out are ours and valid.
    let signal = unsafe { libc::sigtimedwait(signals, &mut info, &timeout) };
    match signal {
        libc::SIGTERM | libc::SIGINT | libc::SIGHUP => Woken::Stop,
        signal if signal == deadline_signal() => {
            // SAFETY: filled in by sigtimedwait for a queued signal: the sender and the value.
            let (sender, value) = unsafe { (info.si_pid(), info.si_value()) };
            // SAFETY: getppid(2) cannot fail.
            let parent = unsafe { libc::getppid() };
            // The value is an integer carried in the union's pointer (`tell_deadline`).
            let ms = value.sival_ptr as usize as u64;
            if sender == parent {
                Woken::Deadline(Duration::from_millis(ms))
            } else {
                Woken::Other
            }
        }
        _ => Woken::Other,
    }
}

/// Reaps every child that has ended (the command, and orphans adopted as subreaper); the
/// command's wait status goes into `status`. With `stops`, a stop of the command is
/// reported too: the signal that stopped it.
#[allow(unsafe_code)]
fn reap(
    command: libc::pid_t,
    status: &mut Option<libc::c_int>,
    stops: bool,
) -> Option<libc::c_int> {
    let flags = libc::WNOHANG | if stops { libc::WUNTRACED } else { 0 };
    let mut stopped = None;
    loop {
        let mut raw = 0;
        // SAFETY: waitpid(2) writes only the status integer we own.
        let pid = unsafe { libc::waitpid(-1, &mut raw, flags) };
        if pid <= 0 {
            return stopped;
        }
        if pid == command && libc::WIFSTOPPED(raw) {
            stopped = Some(libc::WSTOPSIG(raw));
        } else if pid == command {
            *status = Some(raw);
        }
    }
}

/// Whether no process is left in the group `pgid`.
#[allow(unsafe_code)]
fn group_is_empty(pgid: libc::pid_t) -> bool {
    // SAFETY: kill(2) with signal 0 checks only; it touches no memory of this process.
    let rc = unsafe { libc::kill(-pgid, 0) };
    rc != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
}

/// `signal` to every process in the group `pgid`: the command's group, which exists (it
/// was not seen empty, and the command's pid is not reused while its group lives).
#[allow(unsafe_code)]
fn kill_group(pgid: libc::pid_t, signal: libc::c_int) {
    // SAFETY: kill(2) takes integers and touches no memory of this process.
    let _ = unsafe { libc::kill(-pgid, signal) };
}

/// A wait status as an exit code: the code, or 128 + the signal that killed the command.
fn exit_code(status: libc::c_int) -> u8 {
    let code = if libc::WIFEXITED(status) {
        libc::WEXITSTATUS(status)
    } else if libc::WIFSIGNALED(status) {
        128 + libc::WTERMSIG(status)
    } else {
        return EXIT_ERROR;
    };
    u8::try_from(code & 0xff).expect("masked to a byte")
}
