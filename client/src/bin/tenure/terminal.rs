//! The terminal's foreground process group, for the guardian ([`crate::guard`]).
//!
//! The command runs in a process group of its own, so that the guardian can stop all of it.
//! A terminal lets only its foreground group read it (any other group is stopped by SIGTTIN)
//! and sends Ctrl-C and Ctrl-Z to that group only. So when the terminal on stdin has
//! `tenure`'s group (the shell's job) in its foreground, the guardian hands the foreground to
//! the command's group while it runs and takes it back once the group has ended, as a shell
//! does for a job. When the command is stopped (Ctrl-Z, or SIGTTIN in a job put in the
//! background), the guardian stops its own group the same way, so that the shell sees its
//! job stopped and takes the terminal; `fg` or `bg` continues the job, and the guardian
//! hands the terminal to the command again (if its job is in the foreground) and continues
//! the command. Without a terminal on stdin nothing here is done.

/// The terminal on stdin, which is this process's controlling terminal.
pub struct Terminal {
    /// The guardian's own process group: `tenure`'s, the shell's job.
    home: libc::pid_t,
}

impl Terminal {
    /// The terminal on stdin if it is this process's controlling terminal; `None` without
    /// one (a pipe, a file, a terminal of another session).
    #[allow(unsafe_code)]
    pub fn on_stdin() -> Option<Terminal> {
        // SAFETY: isatty(3), tcgetpgrp(3) and getpgrp(2) take integers and touch no memory
        // of this process.
        let (is_tty, foreground, home) =
            unsafe { (libc::isatty(0), libc::tcgetpgrp(0), libc::getpgrp()) };
        // tcgetpgrp fails (ENOTTY) on a terminal that is not our controlling terminal.
        (is_tty == 1 && foreground > 0).then_some(Terminal { home })
    }

    /// Whether our group is the terminal's foreground group: only then is the terminal ours
    /// to hand over (a job in the background leaves it to whoever has it).
    pub fn home_in_foreground(&self) -> bool {
        foreground() == Some(self.home)
    }

    /// Has the child of `command`, in its new process group (std sets it before running
    /// the `pre_exec` closures), make that group the terminal's foreground group before it
    /// execs. Done in the child so that the command never runs a moment in the terminal's
    /// background: a read in that moment would stop it. Call only if
    /// [`Terminal::home_in_foreground`]; a failure is ignored (the command then runs in the
    /// background, as it would without a terminal).
    #[allow(unsafe_code)]
    pub fn hand_over_in_child(&self, command: &mut std::process::Command) {
        use std::os::unix::process::CommandExt as _;
        // SAFETY: the closure runs between fork and exec and calls only getpid(2) and what
        // `set_foreground` calls (pthread_sigmask, tcsetpgrp), which are async-signal-safe;
        // it allocates nothing.
        unsafe {
            command.pre_exec(|| {
                set_foreground(libc::getpid());
                Ok(())
            });
        }
    }

    /// Gives the terminal back to our group if the command's group `pgid` has it; with
    /// `None`, after a hand-over in the child of a command that never started (its exec
    /// failed), if anyone but our group has it.
    pub fn take_back(&self, pgid: Option<libc::pid_t>) {
        let current = foreground();
        if current != Some(self.home) && (pgid.is_none() || current == pgid) {
            set_foreground(self.home);
        }
    }

    /// The command's group `pgid` was stopped by `signal`: stops our own group (the shell's
    /// job) likewise and returns once it is continued, then hands the terminal to `pgid`
    /// again if our group is in the foreground and continues `pgid`.
    ///
    /// In a group with no job-control shell above it (an orphaned group) the kernel discards
    /// SIGTSTP, SIGTTIN and SIGTTOU, so we go on at once: the command is continued rather
    /// than left stopped with nobody to continue it. For that reason SIGSTOP, which is never
    /// discarded, is passed on as SIGTSTP.
    #[allow(unsafe_code)]
    pub fn command_stopped(&self, pgid: libc::pid_t, signal: libc::c_int) {
        self.take_back(Some(pgid));
        let signal = match signal {
            libc::SIGTTIN | libc::SIGTTOU => signal,
            _ => libc::SIGTSTP,
        };
        // SAFETY: kill(2) takes integers and touches no memory of this process. A signal to
        // our own group stops this (single-threaded) process before kill returns, until the
        // shell continues the job.
        unsafe {
            libc::kill(-self.home, signal);
        }
        if self.home_in_foreground() {
            set_foreground(pgid);
        }
        // SAFETY: as above; `pgid` is the command's group, which lives while it is unreaped.
        unsafe {
            libc::kill(-pgid, libc::SIGCONT);
        }
    }
}

/// The terminal's foreground group, if it has one.
#[allow(unsafe_code)]
fn foreground() -> Option<libc::pid_t> {
    // SAFETY: tcgetpgrp(3) takes an integer and touches no memory of this process.
    let pgid = unsafe { libc::tcgetpgrp(0) };
    (pgid > 0).then_some(pgid)
}

/// Makes `pgid` the terminal's foreground group, with SIGTTOU blocked meanwhile: a process
/// in the background that changes the foreground group is otherwise stopped by SIGTTOU.
/// Best effort: a failure leaves the foreground as it was. Async-signal-safe.
#[allow(unsafe_code)]
fn set_foreground(pgid: libc::pid_t) {
    // SAFETY: the sets are ours and valid (a zeroed sigset_t is a valid value to start
    // from); sigemptyset, sigaddset, pthread_sigmask and tcsetpgrp write only into them.
    unsafe {
        let mut ttou: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut ttou);
        libc::sigaddset(&mut ttou, libc::SIGTTOU);
        libc::pthread_sigmask(libc::SIG_BLOCK, &ttou, &mut old);
        libc::tcsetpgrp(0, pgid);
        libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
    }
}
