//! `tenure run` at a terminal: the command runs in a process group of its own (so that the
//! guardian can stop all of it), and the guardian makes that group the terminal's foreground
//! group while it runs, so the command reads the terminal and gets Ctrl-C and Ctrl-Z as a
//! command run by the shell does, and the shell gets the terminal back afterwards. Each test
//! runs `sh` as the session leader of a pseudo-terminal of its own, types at it and reads
//! what it prints. Real time; bounds are [`PATIENCE`].

use std::fs::File;
use std::io::{Read as _, Write as _};
use std::os::fd::{AsRawFd as _, FromRawFd as _};
use std::os::unix::process::CommandExt as _;
use std::process::Stdio;
use std::sync::mpsc;
use std::time::Instant;

use tenure_testkit::{ThreadServer as TestServer, PATIENCE};

/// A pseudo-terminal whose slave side is the controlling terminal of `sh -c SCRIPT` (a
/// session of its own), with `$T` the `tenure` binary and `$A` the server's address.
struct Terminal {
    master: File,
    output: mpsc::Receiver<Vec<u8>>,
    /// Everything printed so far.
    seen: String,
    /// Where the next [`Terminal::expect`] looks from.
    pos: usize,
    shell: std::process::Child,
}

impl Terminal {
    #[allow(unsafe_code)]
    fn run(addr: &str, script: &str) -> Terminal {
        let (master, slave) = open_pty();
        let mut shell = std::process::Command::new("sh");
        shell
            .args(["-c", script])
            .env("T", env!("CARGO_BIN_EXE_tenure"))
            .env("A", addr)
            .stdin(Stdio::from(slave.try_clone().expect("dup")))
            .stdout(Stdio::from(slave.try_clone().expect("dup")))
            .stderr(Stdio::from(slave));
        // SAFETY: between fork and exec, setsid(2) and ioctl(2) with integer arguments only.
        unsafe {
            shell.pre_exec(|| {
                if libc::setsid() < 0 || libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let shell = shell.spawn().expect("sh runs");
        let (send, output) = mpsc::channel();
        let mut reader = master.try_clone().expect("dup");
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            // Ends with EIO once no process has the slave side open.
            while let Ok(n @ 1..) = reader.read(&mut buf) {
                if send.send(buf[..n].to_vec()).is_err() {
                    return;
                }
            }
        });
        Terminal {
            master,
            output,
            seen: String::new(),
            pos: 0,
            shell,
        }
    }

    /// Waits until `text` has been printed after what earlier waits found.
    fn expect(&mut self, text: &str) {
        let deadline = Instant::now() + PATIENCE;
        while !self.seen[self.pos..].contains(text) {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.output.recv_timeout(left) {
                Ok(bytes) => self.seen.push_str(&String::from_utf8_lossy(&bytes)),
                Err(_) => panic!("never printed {text:?}; the terminal shows:\n{}", self.seen),
            }
        }
        self.pos += self.seen[self.pos..].find(text).expect("seen") + text.len();
    }

    /// Types `bytes` at the terminal.
    fn type_in(&mut self, bytes: &[u8]) {
        self.master.write_all(bytes).expect("type at the terminal");
    }

    /// The shell's exit status, within [`PATIENCE`].
    fn exit_code(mut self) -> i32 {
        let deadline = Instant::now() + PATIENCE;
        loop {
            if let Some(status) = self.shell.try_wait().expect("wait") {
                return status.code().expect("sh exited");
            }
            assert!(Instant::now() < deadline, "sh did not exit:\n{}", self.seen);
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }
}

impl Drop for Terminal {
    /// A failed test leaves nothing behind: SIGKILL to every process of the shell's session
    /// (`tenure`, the guardian and the command are in groups of their own, and a stopped
    /// one would stay).
    #[allow(unsafe_code)]
    fn drop(&mut self) {
        let session = libc::pid_t::try_from(self.shell.id()).expect("a pid fits in pid_t");
        for pid in session_members(session) {
            // SAFETY: kill(2) with integers; `pid` is in our child's own session, read just
            // now from /proc (at worst it has exited since, and the kill finds nothing).
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        let _ = self.shell.wait();
    }
}

/// The processes whose session is `session`, read from /proc.
fn session_members(session: libc::pid_t) -> Vec<libc::pid_t> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse().ok())
        .filter(|pid: &libc::pid_t| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            // After the command name (in parentheses): state, ppid, pgrp, session.
            let fields = stat
                .rsplit_once(") ")
                .map(|(_, rest)| rest)
                .unwrap_or_default();
            fields.split(' ').nth(3).and_then(|s| s.parse().ok()) == Some(session)
        })
        .collect()
}

/// A new pseudo-terminal: (master, slave), neither our controlling terminal.
#[allow(unsafe_code)]
fn open_pty() -> (File, File) {
    // SAFETY: posix_openpt, grantpt, unlockpt and ptsname_r take the descriptor we opened and
    // write only into the buffer we pass, whose length we give; the descriptors returned are
    // ours alone, so `File` may own them.
    unsafe {
        let master = libc::posix_openpt(libc::O_RDWR | libc::O_NOCTTY);
        assert!(
            master >= 0,
            "posix_openpt: {}",
            std::io::Error::last_os_error()
        );
        let master = File::from_raw_fd(master);
        assert_eq!(libc::grantpt(master.as_raw_fd()), 0, "grantpt");
        assert_eq!(libc::unlockpt(master.as_raw_fd()), 0, "unlockpt");
        let mut name = [0 as libc::c_char; 128];
        let rc = libc::ptsname_r(master.as_raw_fd(), name.as_mut_ptr(), name.len());
        assert_eq!(rc, 0, "ptsname_r");
        let slave = libc::open(name.as_ptr(), libc::O_RDWR | libc::O_NOCTTY);
        assert!(
            slave >= 0,
            "open the slave: {}",
            std::io::Error::last_os_error()
        );
        (master, File::from_raw_fd(slave))
    }
}

/// The command reads a line typed at the terminal (it used to be stopped by SIGTTIN, its
/// group not being the foreground group), and the shell reads the next line after `tenure`
/// ends (the terminal was given back).
#[test]
fn a_run_command_reads_the_terminal_and_the_shell_gets_it_back() {
    let server = TestServer::start();
    let script = r#""$T" --addr "$A" run --ttl 5s --grace 1s tty/read -- \
            sh -c 'echo ready; read line; echo "got=$line"'
        echo "status=$?"; read line; echo "after=$line""#;
    let mut terminal = Terminal::run(&server.addr, script);
    terminal.expect("ready");
    terminal.type_in(b"hello\n");
    terminal.expect("got=hello");
    terminal.expect("status=0");
    terminal.type_in(b"world\n");
    terminal.expect("after=world");
    assert_eq!(terminal.exit_code(), 0);
}

/// Ctrl-C reaches the command, the foreground job, which dies of it; `tenure` releases the
/// lock and exits with 128 + SIGINT, and the shell goes on.
#[test]
fn ctrl_c_reaches_the_command_and_the_lock_is_released() {
    let server = TestServer::start();
    let script = r#""$T" --addr "$A" run --ttl 5s --grace 1s tty/int -- \
            sh -c 'echo ready; read line; echo "not reached"'
        echo "status=$?"; "$T" --addr "$A" inspect tty/int"#;
    let mut terminal = Terminal::run(&server.addr, script);
    terminal.expect("ready");
    terminal.type_in(&[0x03]); // Ctrl-C
    terminal.expect("status=130");
    terminal.expect("result=FREE key=tty/int");
    assert!(!terminal.seen.contains("not reached"), "{}", terminal.seen);
    assert_eq!(terminal.exit_code(), 0);
}

/// Ctrl-Z stops the command, and the guardian stops `tenure`'s job with it: a job-control
/// shell sees the job stopped (status 128 + SIGTSTP) and gets the terminal; `fg` continues
/// it, and the command reads the terminal again.
#[test]
fn ctrl_z_stops_the_job_and_fg_continues_it() {
    let server = TestServer::start();
    let script = r#"set -m
        "$T" --addr "$A" run --ttl 30s --grace 1s tty/stop -- \
            sh -c 'echo ready; read line; echo "got=$line"'
        echo "stopped=$?"; read line; echo "shell=$line"; fg; echo "status=$?""#;
    let mut terminal = Terminal::run(&server.addr, script);
    terminal.expect("ready");
    terminal.type_in(&[0x1a]); // Ctrl-Z
    terminal.expect(&format!("stopped={}", 128 + libc::SIGTSTP));
    terminal.type_in(b"to the shell\n");
    terminal.expect("shell=to the shell");
    terminal.type_in(b"to the command\n");
    terminal.expect("got=to the command");
    terminal.expect("status=0");
    assert_eq!(terminal.exit_code(), 0);
}

/// A command that cannot start (its exec fails after the child took the terminal): the
/// shell gets the terminal back all the same.
#[test]
fn the_shell_gets_the_terminal_back_from_a_command_that_cannot_start() {
    let server = TestServer::start();
    let script = r#""$T" --addr "$A" run --ttl 5s tty/missing -- /nonexistent/tenure-test-command
        echo "status=$?"; read line; echo "after=$line""#;
    let mut terminal = Terminal::run(&server.addr, script);
    terminal.expect("cannot start");
    terminal.expect("status=1");
    terminal.type_in(b"back\n");
    terminal.expect("after=back");
    assert_eq!(terminal.exit_code(), 0);
}
