//! The real `tenured` binary as a child process, for what an in-process server cannot show:
//! `kill -9`, SIGTERM, SIGSTOP. Real time only; every wait is bounded in seconds.

use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How long a daemon may take to listen, or to exit after a signal.
const START_WAIT_MAX: Duration = Duration::from_secs(10);
/// Ports tried before giving up: another process can take a free port before the daemon binds.
const PORT_TRIES: usize = 5;
/// How often a start or an exit is looked for (real time: a child process is waited on).
const POLL_INTERVAL: Duration = Duration::from_millis(10);

/// Distinguishes the log files of the daemons one test process starts.
static DAEMONS_STARTED: AtomicU64 = AtomicU64::new(0);

/// Ports tests pick from: below Linux's default ephemeral range (32768-60999), so no
/// outgoing connection of another test takes one while a daemon restarts on it (a port from
/// `bind(:0)` is in that range, and a restart on it once found it taken).
const TEST_PORTS: std::ops::Range<u16> = 20_000..32_000;
const _: () = assert!(TEST_PORTS.end <= 32_768 && TEST_PORTS.start < TEST_PORTS.end);

/// How many ports this process has tried: its picks walk [`TEST_PORTS`] in turn from
/// [`port_seed`], so no two tests of one process (threads side by side) are handed the same
/// port before the walk comes round again.
static NEXT_PORT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// Where this process's walk starts, chosen once (so that test processes running side by
/// side rarely try the same ports). Chosen per pick, two tests' picks could meet: a daemon
/// then found its peer port taken by another test's and exited (seen in CI).
fn port_seed() -> u32 {
    static SEED: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *SEED.get_or_init(|| {
        std::process::id().wrapping_mul(7_919)
            ^ std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |t| t.subsec_nanos())
    })
}

/// A port that was free a moment ago on 127.0.0.1, from [`TEST_PORTS`] (or, with all of them
/// taken, any free one).
pub fn free_port() -> u16 {
    let len = u32::from(TEST_PORTS.end - TEST_PORTS.start);
    let seed = port_seed() % len;
    for _ in 0..len {
        let n = (seed + NEXT_PORT.fetch_add(1, Ordering::Relaxed) % len) % len;
        let port = TEST_PORTS.start + n as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind port 0")
        .local_addr()
        .expect("local addr")
        .port()
}

/// Whether process `pid` holds the IPv4 socket listening on 127.0.0.1:`port` (Linux: the
/// listener's inode in /proc/net/tcp among the process's descriptors).
fn listens_on(pid: u32, port: u16) -> bool {
    const LISTEN: &str = "0A";
    let local = format!("0100007F:{port:04X}");
    let Ok(table) = std::fs::read_to_string("/proc/net/tcp") else {
        return false;
    };
    let inodes: Vec<String> = table
        .lines()
        .skip(1)
        .map(|line| line.split_whitespace().collect::<Vec<_>>())
        .filter(|f| f.len() > 9 && f[1] == local && f[3] == LISTEN)
        .map(|f| format!("socket:[{}]", f[9]))
        .collect();
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    fds.filter_map(Result::ok)
        .filter_map(|fd| std::fs::read_link(fd.path()).ok())
        .any(|target| {
            inodes
                .iter()
                .any(|inode| target.as_os_str() == inode.as_str())
        })
}

/// What to start: the binary (`env!("CARGO_BIN_EXE_tenured")` in the server's tests), its data
/// directory, where its log goes, and flags beyond `--listen` and `--data-dir`.
#[derive(Clone, Copy, Debug)]
pub struct Tenured<'a> {
    /// The `tenured` binary.
    pub bin: &'a Path,
    /// `--data-dir`.
    pub dir: &'a Path,
    /// A directory for the daemon's log (one file per start), so a failed start can say why;
    /// `None` discards the log.
    pub logs: Option<&'a Path>,
    /// More flags, such as `--no-fsync`.
    pub args: &'a [&'a str],
}

/// A running `tenured`, killed with SIGKILL and reaped when dropped.
pub struct Daemon {
    /// The child process (this test started it; signals go to its PID only).
    pub child: Child,
    /// Where it listens.
    pub addr: SocketAddr,
}

impl Daemon {
    /// Starts on a free port and waits until it accepts connections.
    pub fn start(what: Tenured<'_>) -> Daemon {
        for _ in 0..PORT_TRIES {
            let addr = SocketAddr::from(([127, 0, 0, 1], free_port()));
            if let Ok(daemon) = Daemon::try_start(what, addr) {
                return daemon;
            }
        }
        panic!("tenured did not start on any of {PORT_TRIES} ports");
    }

    /// Starts on `addr`, retrying for a while if the port is not free again yet.
    pub fn start_on(what: Tenured<'_>, addr: SocketAddr) -> Daemon {
        let deadline = Instant::now() + START_WAIT_MAX;
        loop {
            match Daemon::try_start(what, addr) {
                Ok(daemon) => return daemon,
                Err(log) if Instant::now() < deadline && log.contains("cannot listen") => {
                    std::thread::sleep(POLL_INTERVAL * 10);
                }
                Err(log) => panic!("tenured did not start on {addr}:\n{log}"),
            }
        }
    }

    /// `Err` carries the log of a daemon that exited instead of listening.
    pub fn try_start(what: Tenured<'_>, addr: SocketAddr) -> Result<Daemon, String> {
        let n = DAEMONS_STARTED.fetch_add(1, Ordering::Relaxed);
        let log_path: Option<PathBuf> = what.logs.map(|logs| logs.join(format!("tenured-{n}.log")));
        let stderr = match &log_path {
            Some(path) => {
                Stdio::from(std::fs::File::create(path).expect("create the daemon's log"))
            }
            None => Stdio::null(),
        };
        let child = Command::new(what.bin)
            .args(["--listen", &addr.to_string(), "--data-dir"])
            .arg(what.dir)
            .args(what.args)
            // Quiet unless a run being diagnosed asks for more (`TENURE_DAEMON_LOG=info`).
            .env(
                "RUST_LOG",
                std::env::var("TENURE_DAEMON_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .expect("spawn tenured");
        let mut daemon = Daemon { child, addr };
        let deadline = Instant::now() + START_WAIT_MAX;
        while Instant::now() < deadline {
            // The port answering is not enough: between `free_port` and the bind, another
            // test's daemon may have taken it, and ours is about to exit "cannot listen".
            if TcpStream::connect(addr).is_ok() && listens_on(daemon.child.id(), addr.port()) {
                return Ok(daemon);
            }
            if daemon.child.try_wait().expect("try_wait").is_some() {
                let log = log_path.map(std::fs::read_to_string);
                return Err(log.and_then(Result::ok).unwrap_or_default());
            }
            std::thread::sleep(POLL_INTERVAL);
        }
        daemon.kill9();
        Err(format!(
            "not listening after {START_WAIT_MAX:?}; log {:?}",
            log_path
        ))
    }

    /// The child's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends SIGKILL and reaps the child.
    pub fn kill9(&mut self) {
        let _ = self.child.kill(); // SIGKILL, to the PID this test started
        let _ = self.child.wait();
    }

    /// Sends SIGTERM and waits (up to 10 s, else panics) for the child to exit.
    pub fn sigterm_and_wait(&mut self) -> ExitStatus {
        signal(self.pid(), "TERM");
        self.wait_exit()
    }

    /// Waits (up to 10 s, else panics) for the child to exit, after a signal already sent.
    pub fn wait_exit(&mut self) -> ExitStatus {
        let deadline = Instant::now() + START_WAIT_MAX;
        loop {
            if let Some(exit) = self.child.try_wait().expect("try_wait") {
                return exit;
            }
            assert!(Instant::now() < deadline, "tenured did not exit");
            std::thread::sleep(POLL_INTERVAL);
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// Sends `kill -<name>` (TERM, STOP, CONT, ...) to `pid`, a process this test started.
///
/// # Panics
/// When `kill` fails.
pub fn signal(pid: u32, name: &str) {
    let status = Command::new("kill")
        .args([&format!("-{name}"), &pid.to_string()])
        .status()
        .expect("kill runs");
    assert!(status.success(), "kill -{name} {pid} failed");
}
