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
//! And it tells `tenure` its command's pid, which names the command's group ([`PidPipe`]):
//! should the guardian itself be killed, `tenure` stops that group before it gives the lock
//! up ([`stop_orphaned_group`]). Deadlines pass as instants on CLOCK_MONOTONIC, one clock
//! for both processes, so one that waited in a stopped guardian's queue is not made later.
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

/// `tenure GUARD_ARG GRACE_MS FORMAT GIVE_UP_AT_MS PID_FD -- PROGRAM ARGS...` runs the
/// guardian. Not a subcommand of the
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
    pid_fd: libc::c_int,
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
        .arg(deadline_after(give_up_in).to_string())
        .arg(pid_fd.to_string())
        .arg("--")
        .args(command);
    line
}

/// The guardian's output format argument: `key=value` lines, or JSON (`--json`).
const FORMAT_KV: &str = "kv";
const FORMAT_JSON: &str = "json";

/// CLOCK_MONOTONIC in whole milliseconds, rounded down. It is one clock for every process
/// of the machine, so `tenure` and its guardian pass deadlines on it as instants, not as
/// spans: a deadline that waits in the guardian's signal queue (the guardian stopped, say)
/// is not made later by the wait (outside test a35, G2).
#[allow(unsafe_code)]
fn monotonic_ms() -> u64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime(2) writes only the timespec we own.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
    assert_eq!(rc, 0, "CLOCK_MONOTONIC is always there on Linux");
    let secs = u64::try_from(now.tv_sec).expect("monotonic time is not negative");
    let nanos = u64::try_from(now.tv_nsec).expect("monotonic time is not negative");
    secs * 1000 + nanos / 1_000_000
}

/// The instant `left` from now on [`monotonic_ms`], rounded down (never later).
fn deadline_after(left: Duration) -> u64 {
    monotonic_ms().saturating_add(u64::try_from(left.as_millis()).unwrap_or(u64::MAX))
}

/// A deadline travels in a signal's value as its low 31 bits (a value fits in 32 bits on
/// every platform); the guardian puts the high bits back from its own clock, which is
/// within [`DEADLINE_WIRE_HALF`] ms of it (a lock's TTL is at most a day).
const DEADLINE_WIRE_MASK: u64 = (1 << 31) - 1;
const DEADLINE_WIRE_HALF: u64 = 1 << 30;
const _: () = assert!(DEADLINE_WIRE_HALF > tenure_protocol::limits::TTL_MS_MAX as u64);

/// The deadline `wire` (its low bits) stands for, read at `now_ms`.
fn deadline_from_wire(wire: u64, now_ms: u64) -> u64 {
    let ahead = wire.wrapping_sub(now_ms & DEADLINE_WIRE_MASK) & DEADLINE_WIRE_MASK;
    if ahead < DEADLINE_WIRE_HALF {
        now_ms + ahead
    } else {
        now_ms.saturating_sub(DEADLINE_WIRE_MASK + 1 - ahead)
    }
}

/// What the guardian runs: see [`parse`].
struct Guarded<'a> {
    grace: Duration,
    out: Out,
    /// The lock's local deadline, on [`monotonic_ms`].
    give_up_at_ms: u64,
    /// Where to write the command's pid ([`PidPipe`]).
    pid_fd: libc::c_int,
    program: &'a OsString,
    args: &'a [OsString],
}

/// The guardian's arguments, `GRACE_MS FORMAT GIVE_UP_AT_MS -- PROGRAM ARGS...`: the grace,
/// where its errors go, the lock's local deadline on [`monotonic_ms`], the program and its
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
    let give_up_at_ms = args.get(2)?.to_str()?.parse().ok()?;
    let pid_fd = args.get(3)?.to_str()?.parse().ok()?;
    (args.get(4)? == "--").then_some(())?;
    Some(Guarded {
        grace,
        out,
        give_up_at_ms,
        pid_fd,
        program: args.get(5)?,
        args: &args[6..],
    })
}

/// The pipe on which the guardian tells `tenure` its command's pid (which is also the
/// command's process group): should the guardian be killed (SIGKILL, the OOM killer, a
/// signal it does not take), `tenure` stops the group itself before it gives up the lock
/// (outside test a35, G1: the command ran on beside the next holder). `tenure` keeps the
/// read end; the write end is the guardian's only (close-on-exec everywhere else).
pub struct PidPipe {
    read: std::fs::File,
    write: Option<std::os::fd::OwnedFd>,
}

impl PidPipe {
    /// A new pipe, both ends close-on-exec.
    #[allow(unsafe_code)]
    pub fn new() -> std::io::Result<PidPipe> {
        use std::os::fd::FromRawFd as _;
        let mut fds = [0; 2];
        // SAFETY: pipe2(2) writes two descriptors into the array we own.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: both descriptors are new and ours alone.
        let (read, write) = unsafe {
            (
                std::fs::File::from_raw_fd(fds[0]),
                std::os::fd::OwnedFd::from_raw_fd(fds[1]),
            )
        };
        Ok(PidPipe {
            read,
            write: Some(write),
        })
    }

    /// The write end's number, for the guardian's command line.
    pub fn write_fd(&self) -> libc::c_int {
        use std::os::fd::AsRawFd as _;
        self.write.as_ref().map_or(-1, |fd| fd.as_raw_fd())
    }

    /// Lets the guardian `command` inherit the write end (only it: the flag is cleared in
    /// the child, between fork and exec).
    #[allow(unsafe_code)]
    pub fn pass_to(&self, command: &mut tokio::process::Command) {
        let fd = self.write_fd();
        // SAFETY: the closure runs in the child between fork and exec and calls only
        // fcntl(2), which is async-signal-safe, on a descriptor number; it allocates nothing.
        unsafe {
            command.pre_exec(move || {
                if libc::fcntl(fd, libc::F_SETFD, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }

    /// Closes our copy of the write end, once the guardian has its own.
    pub fn close_write(&mut self) {
        self.write = None;
    }

    /// The command's pid, once the guardian has ended (its end of the pipe is then closed,
    /// so this does not wait); `None` if it never wrote one (killed before, or the command
    /// never started).
    pub fn command_pid(&mut self) -> Option<libc::pid_t> {
        use std::io::Read as _;
        self.close_write();
        let mut text = String::new();
        self.read.read_to_string(&mut text).ok()?;
        text.trim()
            .parse()
            .ok()
            .filter(|&pid: &libc::pid_t| pid > 0)
    }
}

/// Writes `pid` on `fd` (the guardian's end of [`PidPipe`]) and closes it. Best effort: a
/// `tenure` that is gone cannot read it anyway.
#[allow(unsafe_code)]
fn report_pid(fd: libc::c_int, pid: libc::pid_t) {
    use std::io::Write as _;
    use std::os::fd::FromRawFd as _;
    if fd < 0 {
        return;
    }
    // SAFETY: `fd` was handed to us by `tenure` for this alone; nothing else here uses it.
    let mut file = unsafe { std::fs::File::from_raw_fd(fd) };
    let _ = writeln!(file, "{pid}");
}

/// Marks `fd` close-on-exec (a bad descriptor number is left alone).
#[allow(unsafe_code)]
fn set_cloexec(fd: libc::c_int) {
    if fd >= 0 {
        // SAFETY: fcntl(2) with integers; it touches no memory of this process.
        let _ = unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
    }
}

/// Stops the process group `pgid` whose guardian is gone (SIGTERM, SIGKILL after `grace`),
/// as the guardian would have: `tenure`'s own last resort. True once no live process is
/// left in the group, false if some are after [`KILLED_WAIT`] more. Its members are not our
/// children, and their new parent may be slow to reap them, so zombies do not count.
pub async fn stop_orphaned_group(pgid: libc::pid_t, grace: Duration) -> bool {
    for (signal, wait) in [(libc::SIGTERM, grace), (libc::SIGKILL, KILLED_WAIT)] {
        if !group_has_live_members(pgid) {
            return true;
        }
        kill_group(pgid, signal);
        kill_group(pgid, libc::SIGCONT);
        let deadline = Instant::now() + wait;
        while Instant::now() < deadline {
            if !group_has_live_members(pgid) {
                return true;
            }
            tokio::time::sleep(POLL).await;
        }
    }
    !group_has_live_members(pgid)
}

/// Whether a process that is not a zombie is in the group `pgid`, read from /proc (which
/// every Linux has; without it, whether the group exists at all).
fn group_has_live_members(pgid: libc::pid_t) -> bool {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return !group_is_empty(pgid);
    };
    entries.flatten().any(|entry| {
        let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
        // After the command name (in parentheses, which may hold anything): state, ppid, pgrp.
        let Some((_, rest)) = stat.rsplit_once(") ") else {
            return false;
        };
        let mut fields = rest.split(' ');
        let state = fields.next();
        let pgrp = fields.nth(1).and_then(|f| f.parse::<libc::pid_t>().ok());
        pgrp == Some(pgid) && state != Some("Z")
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
    let wire = deadline_after(give_up_in) & DEADLINE_WIRE_MASK;
    let value = libc::sigval {
        sival_ptr: usize::try_from(wire).expect("31 bits fit") as *mut libc::c_void,
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
        give_up_at_ms: mut give_up_at,
        pid_fd,
        program,
        args: program_args,
    }) = parse(args)
    else {
        eprintln!("error=\"{GUARD_ARG} is internal to tenure run and tenure elect\"");
        return EXIT_ERROR;
    };
    // Not for the command: it is `tenure`'s way to its group should we be killed.
    set_cloexec(pid_fd);
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
    report_pid(pid_fd, pid);
    let mut status = None;
    while status.is_none() {
        let now = monotonic_ms();
        if now >= give_up_at {
            // Deadlines told while we could not take them (this process stopped, say) are
            // still queued: the latest is the one that counts (outside test a35, G2).
            match drain_deadlines(&signals, &mut give_up_at) {
                Woken::Stop => break,
                _ if monotonic_ms() < give_up_at => continue,
                _ => {}
            }
            let message = "tenure did not confirm the lock by its local deadline; \
                           stopping the command";
            eprintln!("warning={}", kv_value(message));
            break;
        }
        let until = Duration::from_millis(give_up_at - now);
        match next_signal(&signals, WAKE_EVERY.min(until)) {
            Woken::Stop => break,
            Woken::Deadline(told) => give_up_at = give_up_at.max(told),
            Woken::Other | Woken::Nothing => {}
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
    /// `tenure` (our parent, no other process) told the lock's local deadline, on
    /// [`monotonic_ms`].
    Deadline(u64),
    /// SIGCHLD, or a deadline signal from anyone but our parent.
    Other,
    /// Nothing came before the time-out.
    Nothing,
}

/// Takes every signal already pending without waiting, moving `give_up_at` to the latest
/// deadline among them; `Woken::Stop` if one asked to stop.
fn drain_deadlines(signals: &libc::sigset_t, give_up_at: &mut u64) -> Woken {
    loop {
        match next_signal(signals, Duration::ZERO) {
            Woken::Stop => return Woken::Stop,
            Woken::Deadline(told) => *give_up_at = (*give_up_at).max(told),
            Woken::Other => {}
            Woken::Nothing => return Woken::Nothing,
        }
    }
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
            let wire = value.sival_ptr as usize as u64;
            if sender == parent {
                Woken::Deadline(deadline_from_wire(wire, monotonic_ms()))
            } else {
                Woken::Other
            }
        }
        // Interrupted (by SIGCONT after a stop, say): something may be pending still.
        -1 if std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) => Woken::Other,
        -1 => Woken::Nothing,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_deadline_comes_back_from_its_low_bits_near_now() {
        let now = 5 * (DEADLINE_WIRE_MASK + 1) + 12_345; // high bits the wire drops
        for deadline in [now, now + 1, now + 86_400_000, now - 1, now - 60_000] {
            let wire = deadline & DEADLINE_WIRE_MASK;
            assert_eq!(deadline_from_wire(wire, now), deadline, "{deadline}");
        }
        // Across the wire's wrap: just before and after a multiple of 2^31.
        let now = 3 * (DEADLINE_WIRE_MASK + 1) - 10;
        for deadline in [now + 20, now - 20, now + 1_000_000] {
            assert_eq!(
                deadline_from_wire(deadline & DEADLINE_WIRE_MASK, now),
                deadline
            );
        }
    }
}
