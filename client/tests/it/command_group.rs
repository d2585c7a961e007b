//! `tenure run` and `tenure elect` stop the command's whole process group, not only the
//! process they started: on a loss, on SIGINT, when the command exits leaving a background
//! process behind, when `tenure` itself is killed with SIGKILL (finding F1: a grandchild
//! went on running unprotected beside the next holder), and, by the guardian alone, when
//! `tenure` is stopped past the lock's local deadline. Real time throughout; bounds are in
//! seconds.

use std::path::Path;
use std::process::Stdio;

use tenure::{KeyState, LeaseId, ReleaseOutcome};
use tenure_testkit::{ms, ThreadServer as TestServer, PATIENCE};
use tokio::process::Child;
use tokio::time::{timeout, Instant};

use crate::cli::{process_state, tenure_cli};

/// For `sh -c SCRIPT sh DIR`: starts a background loop (a grandchild of `tenure`) writing
/// DIR/mark every 50 ms for at most 30 s, its pid in DIR/pid, then DIR/lease, then waits in
/// the foreground. The loop's bound keeps a failing test from leaving it behind for long.
const WITH_GRANDCHILD: &str =
    "(for i in $(seq 600); do echo $i > \"$1/mark\"; sleep 0.05; done) & \
     echo $! > \"$1/pid\"; echo $TENURE_LEASE_ID > \"$1/lease\"; sleep 30";

/// Starts `tenure ARGS -- sh -c SCRIPT sh DIR`; returns it, the grandchild's pid and the
/// lease id once the command has written them.
async fn start(
    server: &TestServer,
    args: &[&str],
    script: &str,
    dir: &Path,
) -> (Child, u32, LeaseId) {
    let child = tenure_cli(&server.addr)
        .args(args)
        .args(["--", "sh", "-c", script, "sh"])
        .arg(dir)
        .stderr(Stdio::piped())
        .spawn()
        .expect("tenure runs");
    let deadline = Instant::now() + PATIENCE;
    loop {
        let lease = std::fs::read_to_string(dir.join("lease")).ok();
        let lease = lease.and_then(|text| LeaseId::from_hex(text.trim()));
        let pid = std::fs::read_to_string(dir.join("pid")).ok();
        if let (Some(lease), Some(pid)) = (lease, pid.and_then(|p| p.trim().parse().ok())) {
            return (child, pid, lease);
        }
        assert!(Instant::now() < deadline, "the command never started");
        tokio::time::sleep(ms(10)).await; // real time: a child process writes the files
    }
}

/// The grandchild `pid` is gone (or a zombie) within [`PATIENCE`], and its marker file no
/// longer changes.
async fn assert_stopped(pid: u32, dir: &Path) {
    let deadline = Instant::now() + PATIENCE;
    while matches!(process_state(pid), Some(state) if state != 'Z') {
        assert!(Instant::now() < deadline, "the grandchild {pid} still runs");
        tokio::time::sleep(ms(10)).await;
    }
    let before = std::fs::read_to_string(dir.join("mark")).unwrap_or_default();
    tokio::time::sleep(ms(300)).await; // six of its 50 ms periods
    let after = std::fs::read_to_string(dir.join("mark")).unwrap_or_default();
    assert_eq!(before, after, "the marker still changes");
}

/// Releases `key`'s lease behind the holder's back; returns `tenure`'s exit code.
async fn revoke(server: &TestServer, key: &str, lease: LeaseId, child: Child) -> i32 {
    let client = server.client().await;
    let released = client.release(key, lease).await.expect("release");
    assert_eq!(released, ReleaseOutcome::Released);
    let output = timeout(PATIENCE, child.wait_with_output())
        .await
        .expect("tenure exits after the loss")
        .expect("tenure runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("result=LOST"), "{stderr}");
    output.status.code().expect("exited normally")
}

#[tokio::test]
async fn a_lost_run_stops_the_commands_grandchildren() {
    let server = TestServer::start();
    let dir = tempfile::tempdir().expect("temp dir");
    let args = ["run", "grp/run", "--ttl", "5s", "--grace", "1s"];
    let (child, grandchild, lease) = start(&server, &args, WITH_GRANDCHILD, dir.path()).await;
    assert_eq!(revoke(&server, "grp/run", lease, child).await, 4);
    assert_stopped(grandchild, dir.path()).await;
}

#[tokio::test]
async fn a_lost_election_stops_the_commands_grandchildren() {
    let server = TestServer::start();
    let dir = tempfile::tempdir().expect("temp dir");
    let args = [
        "elect", "grp-g", "--value", "me", "--ttl", "5s", "--grace", "1s",
    ];
    let (child, grandchild, lease) = start(&server, &args, WITH_GRANDCHILD, dir.path()).await;
    assert_eq!(revoke(&server, "election/grp-g", lease, child).await, 4);
    assert_stopped(grandchild, dir.path()).await;
}

/// SIGKILL to `tenure ARGS` running [`WITH_GRANDCHILD`]: the grandchild is stopped within the
/// grace (1 s) and [`PATIENCE`].
async fn killed_tenure_stops_the_grandchildren(args: &[&str]) {
    let server = TestServer::start();
    let dir = tempfile::tempdir().expect("temp dir");
    let (mut child, grandchild, _) = start(&server, args, WITH_GRANDCHILD, dir.path()).await;
    child.start_kill().expect("SIGKILL to tenure"); // our own child, by its handle
    child.wait().await.expect("reaped");
    assert_stopped(grandchild, dir.path()).await;
}

#[tokio::test]
async fn a_killed_run_takes_the_commands_grandchildren_with_it() {
    killed_tenure_stops_the_grandchildren(&["run", "grp/kill", "--ttl", "5s", "--grace", "1s"])
        .await;
}

#[tokio::test]
async fn a_killed_elect_takes_the_commands_grandchildren_with_it() {
    let args = [
        "elect", "grp-k", "--value", "me", "--ttl", "5s", "--grace", "1s",
    ];
    killed_tenure_stops_the_grandchildren(&args).await;
}

/// SIGSTOP to `tenure ARGS` alone (not its guardian) running [`WITH_GRANDCHILD`] with a 3 s
/// TTL: the guardian stops the command's group at the local deadline it was last told, while
/// `tenure` is still stopped (outside test a34, finding F2: the command ran on beside the next
/// holder); continued, `tenure` says LOST and exits 4.
async fn stopped_tenure_stops_the_grandchildren(args: &[&str]) {
    let server = TestServer::start();
    let dir = tempfile::tempdir().expect("temp dir");
    let (child, grandchild, _) = start(&server, args, WITH_GRANDCHILD, dir.path()).await;
    let tenure_pid = child.id().expect("running");
    signal_pid(tenure_pid, libc::SIGSTOP);
    // The local deadline is under 3 s away, the grace 1 s: well inside PATIENCE.
    assert_stopped(grandchild, dir.path()).await;
    assert_eq!(
        process_state(tenure_pid),
        Some('T'),
        "tenure was to stay stopped while its guardian acted"
    );
    signal_pid(tenure_pid, libc::SIGCONT);
    let output = timeout(PATIENCE, child.wait_with_output())
        .await
        .expect("tenure exits once continued")
        .expect("tenure runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("result=LOST"), "{stderr}");
    assert!(
        stderr.contains("did not confirm the lock by its local deadline"),
        "{stderr}"
    );
    assert_eq!(output.status.code(), Some(4), "{stderr}");
}

#[tokio::test]
async fn a_stopped_run_has_its_guardian_stop_the_command_at_the_deadline() {
    stopped_tenure_stops_the_grandchildren(&["run", "grp/stop", "--ttl", "3s", "--grace", "1s"])
        .await;
}

#[tokio::test]
async fn a_stopped_elect_has_its_guardian_stop_the_command_at_the_deadline() {
    let args = [
        "elect", "grp-s", "--value", "me", "--ttl", "3s", "--grace", "1s",
    ];
    stopped_tenure_stops_the_grandchildren(&args).await;
}

/// The guardian of `tenure` process `tenure_pid`: its child, read from /proc.
fn guardian_of(tenure_pid: u32) -> u32 {
    let found = std::fs::read_dir("/proc")
        .expect("/proc")
        .flatten()
        .find_map(|entry| {
            let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(entry.path().join("stat")).ok()?;
            let ppid: u32 = stat.rsplit_once(") ")?.1.split(' ').nth(1)?.parse().ok()?;
            let cmdline = std::fs::read(entry.path().join("cmdline")).ok()?;
            let guard = String::from_utf8_lossy(&cmdline).contains("__tenure_guard__");
            (ppid == tenure_pid && guard).then_some(pid)
        });
    found.expect("tenure has a guardian")
}

/// `signal` to process `pid`: our own unreaped child, or its guardian read just now.
#[allow(unsafe_code)]
fn signal_pid(pid: u32, signal: libc::c_int) {
    let pid = libc::pid_t::try_from(pid).expect("a pid fits");
    // SAFETY: kill(2) with integers; `pid` is our child (held, not reaped) or its child.
    assert_eq!(
        unsafe { libc::kill(pid, signal) },
        0,
        "signal {signal} to {pid}"
    );
}

/// SIGKILL to the guardian alone (outside test a35, G1: `tenure` released the lock and
/// exited while the command's group ran on beside the next holder): `tenure` stops the
/// group itself, then releases, and says so, exit 1.
#[tokio::test]
async fn a_killed_guardian_has_tenure_stop_the_command_before_the_release() {
    let server = TestServer::start();
    let dir = tempfile::tempdir().expect("temp dir");
    let args = ["run", "grp/guard", "--ttl", "5s", "--grace", "1s"];
    let (child, grandchild, _) = start(&server, &args, WITH_GRANDCHILD, dir.path()).await;
    signal_pid(guardian_of(child.id().expect("running")), libc::SIGKILL);
    let output = timeout(PATIENCE, child.wait_with_output())
        .await
        .expect("tenure exits")
        .expect("tenure runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("guardian was killed"), "{stderr}");
    // Stopped before tenure exited, hence before the release.
    assert!(
        !matches!(process_state(grandchild), Some(state) if state != 'Z'),
        "the grandchild {grandchild} outlived tenure"
    );
    assert_stopped(grandchild, dir.path()).await;
    let client = server.client().await;
    assert_eq!(client.inspect("grp/guard").await.unwrap(), KeyState::Free);
}

/// SIGSTOP of the guardian alone for longer than the TTL while `tenure` keeps the lock:
/// continued, the guardian takes the deadlines `tenure` told it meanwhile and leaves the
/// command alone (outside test a35, G2: it stopped the command, saying the lock was not
/// confirmed).
#[tokio::test]
async fn a_guardian_stopped_past_the_ttl_leaves_a_kept_lock_alone() {
    let server = TestServer::start();
    let dir = tempfile::tempdir().expect("temp dir");
    let script = "echo $TENURE_LEASE_ID > \"$1/lease\"; echo $$ > \"$1/pid\"; sleep 4";
    let args = ["run", "grp/gstop", "--ttl", "1s", "--grace", "1s"];
    let (child, _, _) = start(&server, &args, script, dir.path()).await;
    let guardian = guardian_of(child.id().expect("running"));
    signal_pid(guardian, libc::SIGSTOP);
    tokio::time::sleep(ms(2_000)).await; // twice the TTL: real time, tenure renews meanwhile
    signal_pid(guardian, libc::SIGCONT);
    let output = timeout(PATIENCE, child.wait_with_output())
        .await
        .expect("tenure exits")
        .expect("tenure runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(0), "{stderr}");
    assert!(!stderr.contains("warning="), "{stderr}");
}

/// A command that exits leaving a background process in its group: the process is stopped
/// before the lock is released, and the command's status is passed through.
#[tokio::test]
async fn a_commands_leftover_background_process_is_stopped_before_the_release() {
    let server = TestServer::start();
    let dir = tempfile::tempdir().expect("temp dir");
    // The command waits for the test to read its files, then exits with 3.
    let script = WITH_GRANDCHILD.replace(
        "sleep 30",
        "while [ ! -e \"$1/go\" ]; do sleep 0.02; done; exit 3",
    );
    let args = ["run", "grp/left", "--ttl", "5s", "--grace", "1s"];
    let (child, grandchild, _) = start(&server, &args, &script, dir.path()).await;
    std::fs::write(dir.path().join("go"), "").expect("write go");
    let output = timeout(PATIENCE, child.wait_with_output())
        .await
        .expect("tenure exits after its command")
        .expect("tenure runs");
    assert_eq!(output.status.code(), Some(3), "the command's status");
    assert!(
        matches!(process_state(grandchild), None | Some('Z')),
        "stopped before tenure exited"
    );
    assert_stopped(grandchild, dir.path()).await;
    let state = server
        .client()
        .await
        .inspect("grp/left")
        .await
        .expect("inspect");
    assert_eq!(state, KeyState::Free, "released");
}

/// SIGINT to `tenure` (`kill -INT`; Ctrl-C at a terminal reaches the command instead, the
/// terminal's foreground job: `terminal.rs`) stops the whole group, then releases.
#[tokio::test]
async fn sigint_to_tenure_run_stops_the_commands_group_and_releases() {
    let server = TestServer::start();
    let dir = tempfile::tempdir().expect("temp dir");
    let args = ["run", "grp/int", "--ttl", "5s", "--grace", "1s"];
    let (child, grandchild, _) = start(&server, &args, WITH_GRANDCHILD, dir.path()).await;
    let pid = child.id().expect("running").to_string();
    let kill = std::process::Command::new("kill")
        .args(["-INT", &pid])
        .status();
    assert!(kill.expect("kill runs").success());
    let output = timeout(PATIENCE, child.wait_with_output())
        .await
        .expect("tenure exits")
        .expect("tenure runs");
    assert_eq!(
        output.status.code(),
        Some(128 + 15),
        "the command got SIGTERM"
    );
    assert_stopped(grandchild, dir.path()).await;
    let state = server
        .client()
        .await
        .inspect("grp/int")
        .await
        .expect("inspect");
    assert_eq!(state, KeyState::Free, "released, not left to expire");
}

/// A command the guardian cannot start (not found): its error is one line in the CLI's
/// format, a JSON object under `--json` as every other error there, and `tenure` releases the
/// lock and exits 1.
#[tokio::test]
async fn a_command_that_cannot_start_is_an_error_line_in_the_clis_format() {
    let server = TestServer::start();
    let missing = "/nonexistent/tenure-test-command";
    for (json, key) in [(true, "grp/json"), (false, "grp/kv")] {
        let mut line = tenure_cli(&server.addr);
        if json {
            line.arg("--json");
        }
        let output = timeout(
            PATIENCE,
            line.args(["run", "--ttl", "5s", key, "--", missing])
                .output(),
        )
        .await
        .expect("tenure exits")
        .expect("tenure runs");
        assert_eq!(output.status.code(), Some(1), "{output:?}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        let error = stderr
            .lines()
            .find(|line| line.contains("cannot start"))
            .unwrap_or_else(|| panic!("no error line: {stderr}"));
        if json {
            let object: serde_json::Value =
                serde_json::from_str(error).unwrap_or_else(|e| panic!("{e}: {error}"));
            assert_eq!(object["result"], "ERROR", "{error}");
            let message = object["error"].as_str().expect("an error text");
            assert!(message.contains(missing), "{error}");
            // The grant line before it is JSON too: every line on stderr parses.
            for line in stderr.lines() {
                let parsed: Result<serde_json::Value, _> = serde_json::from_str(line);
                assert!(parsed.is_ok(), "not JSON: {line}");
            }
        } else {
            assert!(error.starts_with("result=ERROR error="), "{error}");
        }
        let state = server.client().await.inspect(key).await.expect("inspect");
        assert_eq!(state, KeyState::Free, "released");
    }
}
