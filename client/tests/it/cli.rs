//! The `tenure` command line against a real server. Real time throughout: `tenure` is a
//! process of its own, on the real clock; bounds are in seconds.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use tenure::{
    AcquireOptions, Client, Election, ElectionOptions, KeyState, LeaseId, ReleaseOutcome,
};
use tenure_testkit::{field, ms, ThreadServer as TestServer, PATIENCE};
use tokio::time::{timeout, Instant};

use crate::{granted, wait_for_waiters, PATIENT_TTL};

/// The `tenure` binary with `--addr addr`, killed when dropped. Its stdin is empty unless a
/// test pipes it: `tenure run` hands a terminal on stdin to its command, and tests run from
/// an interactive shell must not take that shell's terminal.
pub(crate) fn tenure_cli(addr: &str) -> tokio::process::Command {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_tenure"));
    command
        .arg("--addr")
        .arg(addr)
        .stdin(Stdio::null())
        .kill_on_drop(true);
    command
}

/// Runs the CLI with `args`; returns exit code, stdout and stderr.
pub(crate) async fn cli(addr: &str, args: &[&str]) -> (i32, String, String) {
    let output = timeout(PATIENCE, tenure_cli(addr).args(args).output())
        .await
        .expect("tenure finishes")
        .expect("tenure runs");
    (
        output.status.code().expect("exited normally"),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[tokio::test]
async fn cli_commands_print_key_values_and_exit_with_the_documented_codes() {
    let server = TestServer::start();
    let addr = server.addr.as_str();
    let (code, out, _) = cli(addr, &["acquire", "c", "--ttl", "5s", "--meta", "me"]).await;
    assert_eq!(code, 0, "{out}");
    assert_eq!(field(&out, "result"), "GRANTED");
    let token = field(&out, "token").to_owned();
    let lease = field(&out, "lease").to_owned();
    let (code, out, _) = cli(addr, &["acquire", "c", "--ttl", "5s"]).await;
    assert_eq!((code, field(&out, "result")), (3, "LOCKED"));
    assert_eq!(field(&out, "token"), token);
    assert_eq!(cli(addr, &["check", "c", &token]).await.0, 0);
    assert_eq!(cli(addr, &["check", "c", "999999"]).await.0, 6);
    assert_eq!(cli(addr, &["renew", "c", &lease, "--ttl", "5s"]).await.0, 0);
    let other = LeaseId::from_u128(7).to_string();
    assert_eq!(cli(addr, &["release", "c", &other]).await.0, 5);
    let (code, out, _) = cli(addr, &["inspect", "c"]).await;
    assert_eq!((code, field(&out, "meta")), (0, "me"));
    assert_eq!(cli(addr, &["release", "c", &lease]).await.0, 0);
    assert_eq!(cli(addr, &["renew", "c", &lease, "--ttl", "1s"]).await.0, 4);
    let (code, out, _) = cli(addr, &["--json", "inspect", "c"]).await;
    assert_eq!((code, out.trim()), (0, r#"{"result":"FREE","key":"c"}"#));
    assert_eq!(cli(addr, &["ping"]).await.0, 0);
    assert_eq!(cli(addr, &["stats"]).await.0, 0);
    assert_eq!(cli(addr, &["acquire", "c"]).await.0, 1, "missing --ttl");
    assert_eq!(
        cli(addr, &["acquire", "c", "--ttl", "1x"]).await.0,
        1,
        "bad duration"
    );
    assert_eq!(cli("127.0.0.1:1", &["ping"]).await.0, 1, "nothing listens");
    assert_eq!(cli(addr, &["--help"]).await.0, 0);
}

/// A one-shot command prints a refusal as `tenure console` does: `code=`, and the refusal's
/// own words in `error=` (outside test a37, F1: `error="server error BAD_TTL: ..."` with no
/// `code=`, and `"invalid argument BAD_TTL: ..."` for the client's own check).
#[tokio::test]
async fn cli_commands_print_a_refusal_with_its_code_and_its_own_words() {
    let server = TestServer::start();
    let addr = server.addr.as_str();
    // The server's refusal: over its TTL limit (an hour by default).
    let (code, out, _) = cli(addr, &["acquire", "r", "--ttl", "2h"]).await;
    assert_eq!(code, 1, "{out}");
    assert_eq!(field(&out, "result"), "ERROR", "{out}");
    assert_eq!(field(&out, "code"), "BAD_TTL", "{out}");
    assert!(out.contains("error=\"ttl_ms 7200000 over"), "{out}");
    // The client's own check, before anything is sent.
    let (code, out, _) = cli(addr, &["acquire", "r", "--ttl", "5ms"]).await;
    assert_eq!(code, 1, "{out}");
    assert_eq!(field(&out, "code"), "BAD_TTL", "{out}");
    assert!(out.contains("error=\"ttl_ms 5 under"), "{out}");
    // JSON has the same fields.
    let (_, out, _) = cli(addr, &["--json", "acquire", "r", "--ttl", "2h"]).await;
    let object: serde_json::Value = serde_json::from_str(out.trim()).expect("JSON");
    assert_eq!(object["code"], "BAD_TTL", "{out}");
    let message = object["error"].as_str().expect("an error text");
    assert!(message.starts_with("ttl_ms 7200000 over"), "{out}");
    // An error that is no refusal has no code.
    let (code, out, _) = cli("127.0.0.1:1", &["ping"]).await;
    assert_eq!(code, 1, "{out}");
    assert!(!out.contains("code="), "{out}");
}

/// With nobody listening, every command prints the address and the connect failure's cause
/// once, with no `code=` (outside test a39, F7: the cause was printed twice, `i/o error:
/// Connection refused (os error 111): Connection refused (os error 111)`).
#[tokio::test]
async fn cli_prints_a_connect_failures_cause_once() {
    // A port nobody listens on: bound, then given back.
    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free port")
        .to_string();
    let wanted = format!("cannot connect to {addr}: i/o error: Connection refused");
    for args in [
        &["ping"][..],
        &["acquire", "k", "--ttl", "5s"],
        &["console"],
    ] {
        let (code, out, err) = cli(&addr, args).await;
        assert_eq!(code, 1, "{args:?}: {out}{err}");
        assert_eq!(field(&out, "result"), "ERROR", "{args:?}: {out}");
        assert!(!out.contains("code="), "{args:?}: {out}");
        let (_, quoted) = out
            .trim_end()
            .split_once(" error=")
            .expect("an error= field");
        let message: String = serde_json::from_str(quoted).expect("a quoted error text");
        assert!(message.starts_with(&wanted), "{args:?}: {out}");
        assert_eq!(message.matches("Connection refused").count(), 1, "{out}");
    }
    let (_, out, _) = cli(&addr, &["--json", "ping"]).await;
    let object: serde_json::Value = serde_json::from_str(out.trim()).expect("JSON");
    let message = object["error"].as_str().expect("an error text");
    assert!(message.starts_with(&wanted), "{out}");
    assert_eq!(message.matches("Connection refused").count(), 1, "{out}");
}

/// `tenure stats | head -0`: a reader gone before the answer ends `tenure` quietly, with
/// exit code 0, as it ends `cat`; `println!` used to panic on the broken pipe.
#[tokio::test]
async fn cli_ends_quietly_when_its_reader_is_gone() {
    let server = TestServer::start();
    let mut child = tenure_cli(&server.addr)
        .arg("stats")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("tenure runs");
    // Closed before tenure has even connected: its one line meets a broken pipe.
    drop(child.stdout.take());
    let output = timeout(PATIENCE, child.wait_with_output())
        .await
        .expect("tenure finishes")
        .expect("tenure runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(0), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[tokio::test]
async fn cli_run_passes_the_token_and_returns_the_commands_status() {
    let server = TestServer::start();
    let addr = server.addr.as_str();
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("token");
    let script = format!(
        "echo $TENURE_FENCING_TOKEN $TENURE_KEY $TENURE_LEASE_ID > {}",
        file.display()
    );
    let args = [
        "run", "--key", "cli/run", "--ttl", "1s", "--", "sh", "-c", &script,
    ];
    let (code, _, err) = cli(addr, &args).await;
    assert_eq!(code, 0, "{err}");
    let written = std::fs::read_to_string(&file).expect("the command wrote its env");
    let words: Vec<&str> = written.split_whitespace().collect();
    assert_eq!(words.len(), 3, "{written:?}");
    assert_eq!(words[0], field(&err, "token"));
    assert_eq!(words[1], "cli/run");
    assert_eq!(words[2], field(&err, "lease"));
    let client = server.client().await;
    assert_eq!(
        client.inspect("cli/run").await.expect("inspect"),
        KeyState::Free,
        "released"
    );

    let exit_7 = [
        "run", "--key", "cli/run", "--ttl", "1s", "--", "sh", "-c", "exit 7",
    ];
    assert_eq!(cli(addr, &exit_7).await.0, 7);
    let killed = [
        "run",
        "--key",
        "cli/run",
        "--ttl",
        "1s",
        "--",
        "sh",
        "-c",
        "kill -TERM $$",
    ];
    assert_eq!(cli(addr, &killed).await.0, 128 + 15);

    let _held = granted(&client, "cli/busy", Duration::from_secs(5)).await;
    let busy = ["run", "--key", "cli/busy", "--ttl", "1s", "--", "true"];
    assert_eq!(cli(addr, &busy).await.0, 3, "LOCKED");
}

/// Starts `tenure run` on `key` with `flags` and `script`, which must write $TENURE_LEASE_ID
/// to the file named by its first argument; releases the lease behind its back and returns
/// its exit code and what it wrote to stderr.
async fn run_and_revoke(
    server: &TestServer,
    key: &str,
    flags: &[&str],
    script: &str,
) -> (i32, String) {
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("lease");
    let child = tenure_cli(&server.addr)
        .args(["run", "--key", key])
        .args(flags)
        .arg("--")
        .args(["sh", "-c", script, "sh"])
        .arg(&file)
        .stderr(Stdio::piped())
        .spawn()
        .expect("tenure runs");
    let lease_id = wait_for_lease_id(&file).await;
    let client = server.client().await;
    let released = client.release(key, lease_id).await.expect("release");
    assert_eq!(released, ReleaseOutcome::Released);
    let output = timeout(PATIENCE, child.wait_with_output())
        .await
        .expect("tenure exits after the loss")
        .expect("tenure runs");
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    (output.status.code().expect("exited normally"), stderr)
}

// Found by outside testing (issue 26, F6): a `tenure run` whose session was closed by someone
// with its id reported `renewal answered LOST`, though nothing was renewed and the session,
// not the lease, had ended.
#[tokio::test]
async fn cli_run_whose_session_is_closed_behind_its_back_says_the_session_ended() {
    let server = TestServer::start();
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("session");
    let script = "echo $TENURE_SESSION_ID > \"$1\"; exec sleep 30";
    let child = tenure_cli(&server.addr)
        .args(["run", "--key", "cli/closed", "--ttl", "5s", "--"])
        .args(["sh", "-c", script, "sh"])
        .arg(&file)
        .stderr(Stdio::piped())
        .spawn()
        .expect("tenure runs");
    let session = wait_for_line(&file).await;
    let session = tenure::SessionId::from_hex(&session).expect("a session id");
    let client = server.client().await;
    let released = client.close_session(session).await.expect("close");
    assert_eq!(released, 1);
    let output = timeout(PATIENCE, child.wait_with_output())
        .await
        .expect("tenure exits after the loss")
        .expect("tenure runs");
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert_eq!(output.status.code(), Some(4), "{stderr}");
    let lost = stderr.lines().find(|l| l.contains("result=LOST"));
    let lost = lost.unwrap_or_else(|| panic!("no LOST line: {stderr}"));
    assert!(lost.contains("session ended"), "{lost}");
}

// Found by outside testing (a29, finding 1): with `--no-session`, a RELEASE by the lease id
// behind `tenure`'s back went unnoticed until the next renewal, a third of the TTL later,
// while the command ran on beside the key's next holder. The key is watched there too now.
#[tokio::test]
async fn cli_run_no_session_notices_a_release_behind_its_back_at_once() {
    let server = TestServer::start();
    let script = "echo $TENURE_LEASE_ID > \"$1\"; exec sleep 120";
    // A long TTL: its first renewal is 20 s away, and only the watch says "seen by WATCH".
    let flags = ["--no-session", "--ttl", "60s"];
    let (code, stderr) = run_and_revoke(&server, "cli/nosess", &flags, script).await;
    assert_eq!(code, 4, "{stderr}");
    let lost = stderr.lines().find(|l| l.contains("result=LOST"));
    let lost = lost.unwrap_or_else(|| panic!("no LOST line: {stderr}"));
    assert!(lost.contains("seen by WATCH"), "{lost}");
}

/// The first line the child wrote to `file`, once it has.
async fn wait_for_line(file: &Path) -> String {
    let deadline = Instant::now() + PATIENCE;
    loop {
        if let Ok(text) = std::fs::read_to_string(file) {
            if text.ends_with('\n') {
                return text.trim().to_string();
            }
        }
        assert!(
            Instant::now() < deadline,
            "the command never wrote its line"
        );
        tokio::time::sleep(ms(10)).await; // real time: a child process writes the file
    }
}

async fn wait_for_lease_id(file: &Path) -> LeaseId {
    let line = wait_for_line(file).await;
    LeaseId::from_hex(&line).unwrap_or_else(|| panic!("not a lease id: {line:?}"))
}

#[tokio::test]
async fn cli_run_kills_its_command_when_the_lease_is_lost() {
    let server = TestServer::start();
    // SIGTERM is enough for a command that does not catch it.
    let script = "echo $TENURE_LEASE_ID > \"$1\"; exec sleep 30";
    let started = Instant::now();
    let (code, stderr) = run_and_revoke(
        &server,
        "cli/loss",
        &["--ttl", "300ms", "--grace", "5s"],
        script,
    )
    .await;
    assert_eq!(code, 4, "{stderr}");
    assert!(stderr.contains("result=LOST"), "{stderr}");
    // Held in a session, nothing renews it: the watch saw the release, no renewal did.
    assert!(
        stderr.contains("released or expired at the server"),
        "{stderr}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(10), // far less than the command's 30 s
        "{:?}",
        started.elapsed()
    );

    // A command that ignores SIGTERM is killed after the grace period.
    let stubborn = "trap '' TERM; echo $TENURE_LEASE_ID > \"$1\"; while :; do sleep 0.05; done";
    let (code, stderr) = run_and_revoke(
        &server,
        "cli/stubborn",
        &["--ttl", "300ms", "--grace", "200ms"],
        stubborn,
    )
    .await;
    assert_eq!(code, 4, "{stderr}");
}

/// The next line `tenure` printed, within [`PATIENCE`].
async fn next_line(
    lines: &mut tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
) -> Option<String> {
    timeout(PATIENCE, lines.next_line())
        .await
        .expect("a line")
        .expect("read")
}

#[tokio::test]
async fn cli_observe_prints_each_new_leader() {
    let server = TestServer::start();
    let election = Election::new(server.client().await, "cli");
    let leader = election.campaign("alpha").await.expect("campaign");
    let mut observe = tenure_cli(&server.addr)
        .args(["observe", "cli"])
        .stdout(Stdio::piped())
        .spawn()
        .expect("tenure runs");
    let stdout = observe.stdout.take().expect("piped");
    let mut lines = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(stdout));
    let line = next_line(&mut lines).await;
    assert_eq!(
        line.as_deref(),
        Some(&*format!("term={} value=alpha", leader.term()))
    );
    leader.resign().await.expect("resign");
    let next = election.campaign("beta").await.expect("campaign");
    let line = next_line(&mut lines).await;
    assert_eq!(
        line.as_deref(),
        Some(&*format!("term={} value=beta", next.term()))
    );
    observe.kill().await.expect("kill observe");
}

#[tokio::test]
async fn cli_elect_runs_the_command_while_leading_and_resigns() {
    let server = TestServer::start();
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("term");
    let script = "echo $TENURE_FENCING_TOKEN > \"$1\"; exit 9";
    let file_arg = file.to_str().expect("utf-8 path");
    let args = [
        "elect", "cli-g", "--value", "me", "--ttl", "1s", "--", "sh", "-c", script, "sh", file_arg,
    ];
    let (code, _, err) = cli(&server.addr, &args).await;
    assert_eq!(code, 9, "the command's status: {err}");
    assert_eq!(field(&err, "result"), "LEADING");
    assert_eq!(field(&err, "key"), "election/cli-g");
    assert_eq!(field(&err, "lease").len(), 32, "the lease id: {err}");
    let term = std::fs::read_to_string(&file).expect("the command ran");
    assert_eq!(term.trim(), field(&err, "term"));
    let client = server.client().await;
    let state = client.inspect("election/cli-g").await.expect("inspect");
    assert_eq!(state, KeyState::Free, "resigned after the command");
}

/// `tenure elect` leads in a session of its own by default (and with `--session`, still
/// accepted), and with a lease renewed alone with `--no-session`.
#[tokio::test]
async fn cli_elect_leads_in_a_session_unless_told_no_session() {
    let server = TestServer::start();
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("session");
    let file_arg = file.to_str().expect("utf-8 path");
    let script = "echo \"[$TENURE_SESSION_ID]\" > \"$1\"";
    let runs = [
        (&[][..], true),
        (&["--session"][..], true),
        (&["--no-session"][..], false),
    ];
    for (flags, in_session) in runs {
        let mut args = vec!["elect", "cli-s", "--value", "me", "--ttl", "1s"];
        args.extend_from_slice(flags);
        args.extend_from_slice(&["--", "sh", "-c", script, "sh", file_arg]);
        let (code, _, err) = cli(&server.addr, &args).await;
        assert_eq!(code, 0, "{flags:?}: {err}");
        let written = std::fs::read_to_string(&file).expect("the command ran");
        assert_eq!(
            written.trim().len() == 34,
            in_session,
            "{flags:?}: {written}"
        );
        // The LEADING line names the session the command's environment has, or none.
        let printed = err.contains(" session=");
        assert_eq!(printed, in_session, "{flags:?}: {err}");
        if in_session {
            let named = format!("[{}]", field(&err, "session"));
            assert_eq!(written.trim(), named, "{flags:?}: {err}");
        } else {
            assert_eq!(written.trim(), "[]", "{flags:?}");
        }
    }
}

/// A grant that `tenure run` or `tenure elect` found by a repeat (its first GRANTED was lost)
/// is marked `repeat=1`, last, as `tenure acquire` marks one (outside test a49, P5).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_run_and_elect_mark_a_grant_found_by_a_repeat() {
    use tenure_testkit::lossy::{next_drop, proxy, Trap};
    let server = TestServer::start();
    let (trap, mut dropped) = Trap::new();
    let upstream = server.addr.parse().expect("a socket address");
    let (addr, _accepting) = proxy(upstream, std::sync::Arc::clone(&trap)).await;
    // Not `elect --no-session` here: given one address it takes its lock with release on
    // disconnect, so the cut that lost its GRANTED ended that lease, and it campaigns anew.
    let runs: [&[&str]; 3] = [
        &["run", "--ttl", "5s", "cli/rep-run", "--", "true"],
        &[
            "run",
            "--no-session",
            "--ttl",
            "5s",
            "cli/rep-alone",
            "--",
            "true",
        ],
        &[
            "elect", "--value", "me", "--ttl", "5s", "cli-rep", "--", "true",
        ],
    ];
    for args in runs {
        trap.arm();
        let lose = async {
            let lost = next_drop(&mut dropped, PATIENCE).await;
            trap.cut();
            lost
        };
        let ((code, _, err), (token, lease_id)) = tokio::join!(cli(&addr, args), lose);
        assert_eq!(code, 0, "{args:?}: {err}");
        let line = err.lines().next().expect("a first line");
        assert!(line.ends_with(" repeat=1"), "{args:?}: {line}");
        let term = if args[0] == "run" { "token" } else { "term" };
        assert_eq!(field(line, term), token.to_string(), "{args:?}: {line}");
        assert_eq!(
            field(line, "lease"),
            lease_id.to_string(),
            "{args:?}: {line}"
        );
    }
    // A grant answered the first time is not marked.
    let (code, _, err) = cli(&addr, &["run", "--ttl", "5s", "cli/rep-run", "--", "true"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(!err.contains("repeat"), "{err}");
}

#[tokio::test]
async fn cli_run_passes_sigterm_on_and_still_releases() {
    let server = TestServer::start();
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("lease");
    let script = "echo $TENURE_LEASE_ID > \"$1\"; exec sleep 30";
    let child = tenure_cli(&server.addr)
        .args([
            "run", "--key", "cli/term", "--ttl", "5s", "--", "sh", "-c", script, "sh",
        ])
        .arg(&file)
        .spawn()
        .expect("tenure runs");
    wait_for_lease_id(&file).await;
    let pid = child.id().expect("running").to_string();
    let kill = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status();
    assert!(kill.expect("kill runs").success());
    let output = timeout(PATIENCE, child.wait_with_output())
        .await
        .expect("tenure exits")
        .expect("tenure runs");
    assert_eq!(output.status.code(), Some(128 + 15), "the command's status");
    let client = server.client().await;
    let state = client.inspect("cli/term").await.expect("inspect");
    assert_eq!(state, KeyState::Free, "released, not left to expire");
}

#[tokio::test]
async fn cli_console_answers_one_line_per_command() {
    use tokio::io::AsyncWriteExt;
    let server = TestServer::start();
    let mut console = tenure_cli(&server.addr)
        .arg("console")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("tenure runs");
    let mut stdin = console.stdin.take().expect("piped");
    let input =
        "acquire con --ttl 5s --meta x\ninspect con\nbogus\n\nrun --key k --ttl 1s -- true\nping\n";
    stdin.write_all(input.as_bytes()).await.expect("write");
    drop(stdin);
    let output = timeout(PATIENCE, console.wait_with_output())
        .await
        .expect("console exits at end of input")
        .expect("tenure runs");
    assert_eq!(output.status.code(), Some(0));
    let stdout = String::from_utf8_lossy(&output.stdout);
    let results: Vec<&str> = stdout.lines().map(|line| field(line, "result")).collect();
    assert_eq!(
        results,
        ["GRANTED", "HELD", "ERROR", "ERROR", "PONG"],
        "{stdout}"
    );
}

/// Holds `key` through a renewing guard until `tenure` queues behind it, five TTLs more, then
/// releases it; `child` must then get the lock and run its three-TTL command to the end.
async fn cli_waits_then_holds(
    server: &TestServer,
    key: &str,
    guard: tenure::LeaseGuard,
    child: tokio::process::Child,
) -> String {
    let client = server.client().await;
    wait_for_waiters(&client, key, 1).await;
    // Real time: the waiter is a `tenure` process, on the real clock.
    tokio::time::sleep(5 * PATIENT_TTL).await;
    assert!(guard.is_valid(), "the holder kept renewing");
    guard.release().await.expect("release");
    let output = timeout(PATIENCE, child.wait_with_output())
        .await
        .expect("tenure exits after its command")
        .expect("tenure runs");
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert_eq!(
        output.status.code(),
        Some(0),
        "the command's status: {stderr}"
    );
    assert!(!stderr.contains("LOST"), "{stderr}");
    stderr
}

/// Starts `tenure` with `args` and a command that holds for three TTLs; stderr is piped.
fn holding_three_ttls(server: &TestServer, args: &[&str]) -> tokio::process::Child {
    let hold_for = format!("sleep {}", (3 * PATIENT_TTL).as_secs_f64());
    tenure_cli(&server.addr)
        .args(args)
        .args(["--", "sh", "-c", &hold_for])
        .stderr(Stdio::piped())
        .spawn()
        .expect("tenure runs")
}

#[tokio::test]
async fn cli_run_keeps_a_lock_won_after_a_long_wait() {
    let server = TestServer::start();
    let holder = server.client().await;
    let guard = holder
        .lock("cli/patient", PATIENT_TTL, AcquireOptions::default())
        .await
        .expect("lock")
        .granted()
        .expect("free");
    let args = [
        "run",
        "--key",
        "cli/patient",
        "--ttl",
        "400ms",
        "--wait",
        "5s",
    ];
    let child = holding_three_ttls(&server, &args);
    let stderr = cli_waits_then_holds(&server, "cli/patient", guard, child).await;
    assert_eq!(field(&stderr, "result"), "GRANTED");
}

#[tokio::test]
async fn cli_elect_keeps_leading_after_a_long_wait() {
    let server = TestServer::start();
    let options = ElectionOptions {
        ttl: PATIENT_TTL,
        ..ElectionOptions::default()
    };
    let election = Election::with_options(server.client().await, "cli-patient", options);
    let leader = election.campaign("first").await.expect("campaign");
    let args = [
        "elect",
        "cli-patient",
        "--value",
        "second",
        "--ttl",
        "400ms",
    ];
    let child = holding_three_ttls(&server, &args);
    let key = "election/cli-patient";
    let stderr = cli_waits_then_holds(&server, key, leader.into_guard(), child).await;
    assert_eq!(field(&stderr, "result"), "LEADING");
}

#[tokio::test]
async fn cli_acquire_prints_how_long_it_waited() {
    let server = TestServer::start();
    let addr = server.addr.as_str();
    let (code, out, _) = cli(addr, &["acquire", "cli/w", "--ttl", "5s"]).await;
    assert_eq!((code, field(&out, "waited_ms")), (0, "0"), "{out}");
    let client = server.client().await;
    let guard = client
        .lock("cli/held", PATIENT_TTL, AcquireOptions::default())
        .await
        .expect("lock")
        .granted()
        .expect("free");
    let args = ["acquire", "cli/held", "--ttl", "5s", "--wait", "5s"];
    let spawned_at = Instant::now();
    let child = tenure_cli(addr)
        .args(args)
        .stdout(Stdio::piped())
        .spawn()
        .expect("tenure runs");
    wait_for_waiters(&client, "cli/held", 1).await;
    tokio::time::sleep(PATIENT_TTL).await; // real time: the waiter is a `tenure` process
    guard.release().await.expect("release");
    let output = timeout(PATIENCE, child.wait_with_output())
        .await
        .expect("tenure exits")
        .expect("tenure runs");
    let elapsed_ms = spawned_at.elapsed().as_millis();
    let out = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(0), "{out}");
    let waited_ms: u128 = field(&out, "waited_ms").parse().expect("a number");
    // In line from before it was seen queued until the release one TTL later (less 1 ms of
    // clock rounding), and not longer than the process ran.
    assert!(waited_ms + 1 >= PATIENT_TTL.as_millis(), "{out}");
    assert!(waited_ms <= elapsed_ms, "{out}: ran {elapsed_ms} ms");
}

// ---------------------------------------------------------------------------------------------
// One grammar and one name per thing: `tenure console` reads the server console's lines, and
// the command line prints the console's field names.

/// Every output line of the command line names things as the console does.
fn assert_console_names(text: &str) {
    for old in ["lease_id=", "ttl_left_ms", "\"lease_id\""] {
        assert!(!text.contains(old), "{old} in {text:?}");
    }
}

#[tokio::test]
async fn cli_prints_the_consoles_field_names() {
    let server = TestServer::start();
    let addr = server.addr.as_str();
    let (code, out, _) = cli(addr, &["acquire", "names", "--ttl", "5s"]).await;
    assert_eq!(code, 0, "{out}");
    assert!(LeaseId::from_hex(field(&out, "lease")).is_some(), "{out}");
    assert_eq!(field(&out, "ttl_ms"), "5000", "{out}");
    assert!(out.trim_end().ends_with("waited_ms=0"), "{out}");
    let mut printed = out;
    let (code, out, _) = cli(addr, &["acquire", "names", "--ttl", "5s"]).await;
    assert_eq!((code, field(&out, "result")), (3, "LOCKED"), "{out}");
    let left_ms: u64 = field(&out, "ttl_ms").parse().expect("a number");
    assert!((1..=5000).contains(&left_ms), "{out}");
    printed += &out;
    let (code, out, _) = cli(addr, &["inspect", "names"]).await;
    assert_eq!((code, field(&out, "result")), (0, "HELD"), "{out}");
    let left_ms: u64 = field(&out, "ttl_ms").parse().expect("a number");
    assert!((1..=5000).contains(&left_ms), "{out}");
    printed += &out;
    let (_, json, _) = cli(addr, &["--json", "inspect", "names"]).await;
    assert!(json.contains(r#""ttl_ms":"#), "{json}");
    printed += &json;
    let (_, json, _) = cli(addr, &["--json", "acquire", "names/2", "--ttl", "5s"]).await;
    assert!(json.contains(r#""lease":""#), "{json}");
    printed += &json;
    assert_console_names(&printed);
}

#[tokio::test]
async fn cli_reads_a_bare_duration_as_milliseconds_with_a_deprecation_note() {
    let server = TestServer::start();
    let addr = server.addr.as_str();
    let (code, out, err) = cli(addr, &["acquire", "bare", "--ttl", "1500"]).await;
    assert_eq!((code, field(&out, "ttl_ms")), (0, "1500"), "{out}");
    assert!(err.contains("deprecated"), "{err:?}");
    assert_eq!(err.lines().count(), 1, "one line: {err:?}");
    let (code, out, err) = cli(addr, &["acquire", "unit", "--ttl", "1500ms"]).await;
    assert_eq!((code, field(&out, "ttl_ms")), (0, "1500"), "{out}");
    assert_eq!(err, "", "no note when the unit is written");
}

/// A `tenure console` child with its stdin and stdout at hand, answering line by line.
pub(crate) struct Console {
    child: tokio::process::Child,
    stdin: tokio::process::ChildStdin,
    stdout: tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
}

impl Console {
    pub(crate) fn start(addr: &str) -> Console {
        let mut child = tenure_cli(addr)
            .arg("console")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("tenure runs");
        let stdin = child.stdin.take().expect("piped");
        let stdout = child.stdout.take().expect("piped");
        let stdout = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(stdout));
        Console {
            child,
            stdin,
            stdout,
        }
    }

    /// The next line the console prints.
    async fn next(&mut self) -> String {
        timeout(PATIENCE, self.stdout.next_line())
            .await
            .expect("an answer in time")
            .expect("read")
            .expect("a line before the end")
    }

    /// Sends `line` and returns the answer.
    pub(crate) async fn ask(&mut self, line: &str) -> String {
        use tokio::io::AsyncWriteExt;
        let sent = format!("{line}\n");
        self.stdin.write_all(sent.as_bytes()).await.expect("write");
        self.next().await
    }
}

/// `ID=` is sent as typed: the same line again is a repeat, answered with the first grant
/// (not LOCKED by the user's own lease), in a session too.
#[tokio::test]
async fn cli_console_sends_the_acquire_id_it_is_given() {
    let server = TestServer::start();
    let mut console = Console::start(&server.addr);
    let line = "ACQUIRE con/id 30000 ID=5e11c3a709d2446b8f310c7de295b81f";
    let first = console.ask(line).await;
    assert_eq!(field(&first, "result"), "GRANTED", "{first}");
    let again = console.ask(line).await;
    assert_eq!(field(&again, "result"), "GRANTED", "{again}");
    assert_eq!(field(&again, "token"), field(&first, "token"));
    assert_eq!(field(&again, "lease"), field(&first, "lease"));
    // The repeat is marked, last; the first grant is not.
    assert!(!first.contains("repeat"), "{first}");
    assert!(again.trim_end().ends_with(" repeat=1"), "{again}");

    let opened = console.ask("SESSION_OPEN 30000").await;
    let session = field(&opened, "session").to_string();
    let line = format!("ACQUIRE con/sid 0 SESSION={session} ID=0123456789abcdef0123456789abcdef");
    let first = console.ask(&line).await;
    assert_eq!(field(&first, "result"), "GRANTED", "{first}");
    let again = console.ask(&line).await;
    assert_eq!(field(&again, "lease"), field(&first, "lease"), "{again}");
    assert!(again.trim_end().ends_with(" repeat=1"), "{again}");
    // A server's refusal names its code, as the console's own parse errors do.
    let refused = console
        .ask("SESSION_CLOSE 00000000000000000000000000000001")
        .await;
    assert_eq!(field(&refused, "result"), "ERROR", "{refused}");
    assert_eq!(field(&refused, "code"), "NO_SESSION", "{refused}");
    // The server's message, not the code a second time.
    assert!(refused.contains("error=\"no live session"), "{refused}");
    // A session lease's repeat has the session's time left, as its first grant said.
    let left: u64 = field(&again, "ttl_ms").parse().expect("a number");
    assert!(left > 0 && left <= 30_000, "{again}");
    quit(console).await;
}

/// A typed refusal (a kind mismatch) names its code, and a repeat of an ACQUIRE whose lease
/// has ended is printed as that outcome (ENDED, with how and the token), not as an error.
#[tokio::test]
async fn cli_console_prints_kind_mismatch_with_its_code_and_an_ended_repeat_as_ended() {
    let server = TestServer::start();
    let mut console = Console::start(&server.addr);
    let held = console.ask("ACQUIRE con/kind 30000").await;
    assert_eq!(field(&held, "result"), "GRANTED", "{held}");
    let refused = console.ask("ACQUIRE con/kind 30000 PERMITS=1/3").await;
    assert_eq!(field(&refused, "result"), "ERROR", "{refused}");
    assert_eq!(field(&refused, "code"), "KIND_MISMATCH", "{refused}");
    // The client's own check words a TTL as the server does.
    let short = console.ask("ACQUIRE con/short 5").await;
    assert_eq!(field(&short, "code"), "BAD_TTL", "{short}");
    assert!(
        short.contains("ttl_ms 5 under the shortest lease, 10"),
        "{short}"
    );

    let line = "ACQUIRE con/ended 30000 ID=6a0c5f0e3b1d4e27a9c8b7d6e5f40312";
    let first = console.ask(line).await;
    assert_eq!(field(&first, "result"), "GRANTED", "{first}");
    let released = console
        .ask(&format!("RELEASE con/ended {}", field(&first, "lease")))
        .await;
    assert_eq!(field(&released, "result"), "RELEASED", "{released}");
    let again = console.ask(line).await;
    assert_eq!(field(&again, "result"), "ENDED", "{again}");
    assert_eq!(field(&again, "key"), "con/ended", "{again}");
    assert_eq!(field(&again, "how"), "released", "{again}");
    assert_eq!(field(&again, "token"), field(&first, "token"), "{again}");
    quit(console).await;
}

#[tokio::test]
async fn cli_console_reads_the_server_consoles_grammar() {
    let server = TestServer::start();
    let mut console = Console::start(&server.addr);
    let granted = console.ask("ACQUIRE con/g 30000 5000 META=me").await;
    assert_eq!(field(&granted, "result"), "GRANTED", "{granted}");
    assert_eq!(field(&granted, "ttl_ms"), "30000", "{granted}");
    let (token, lease) = (field(&granted, "token"), field(&granted, "lease"));
    let held = console.ask("inspect con/g").await;
    assert_eq!(
        (field(&held, "result"), field(&held, "meta")),
        ("HELD", "me")
    );
    let locked = console.ask("ACQUIRE con/g 1000").await;
    assert_eq!(field(&locked, "result"), "LOCKED", "{locked}");
    let renewed = console.ask(&format!("RENEW con/g {lease} 20000")).await;
    assert_eq!(field(&renewed, "ttl_ms"), "20000", "{renewed}");
    let current = console.ask(&format!("CHECK con/g {token}")).await;
    assert_eq!(field(&current, "result"), "CURRENT", "{current}");
    let released = console.ask(&format!("RELEASE con/g {lease}")).await;
    assert_eq!(field(&released, "result"), "RELEASED", "{released}");
    let refused = console.ask("ACQUIRE con/g 30s").await;
    assert_eq!(
        (field(&refused, "result"), field(&refused, "code")),
        ("ERROR", "BAD_ARGS"),
        "{refused}"
    );
    let help = console.ask("HELP").await;
    assert!(
        help.contains("ACQUIRE <key> <ttl_ms> [<wait_ms>]"),
        "{help}"
    );
    let watching = console.ask("WATCH con/w").await;
    assert_eq!(field(&watching, "result"), "WATCHING", "{watching}");
    let _lease = granted_meta(&server.client().await, "con/w").await;
    let event = console.next().await;
    assert_eq!(
        (field(&event, "result"), field(&event, "kind")),
        ("EVENT", "GRANTED"),
        "{event}"
    );
    let unwatched = console.ask("UNWATCH con/w").await;
    assert_eq!(field(&unwatched, "result"), "UNWATCHED", "{unwatched}");
    assert_console_names(&[granted, held, locked].join("\n"));
    let old = console.ask("acquire con/old --ttl 5s").await;
    assert_eq!(
        field(&old, "result"),
        "GRANTED",
        "the old spelling still works: {old}"
    );
    let output = quit(console).await;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(stderr.lines().count(), 1, "one note: {stderr:?}");
    assert!(stderr.contains("deprecated"), "{stderr:?}");
}

/// Takes `key` with metadata, as a watcher's GRANTED event shows it.
async fn granted_meta(client: &Client, key: &str) -> tenure::Lease {
    let options = AcquireOptions {
        meta: "w".into(),
        ..AcquireOptions::default()
    };
    client
        .acquire(key, Duration::from_secs(5), options)
        .await
        .expect("acquire")
        .granted()
        .expect("free")
}

/// Sends QUIT; the console must print nothing more and exit 0.
async fn quit(mut console: Console) -> std::process::Output {
    use tokio::io::AsyncWriteExt;
    console.stdin.write_all(b"QUIT\n").await.expect("write");
    let rest = timeout(PATIENCE, console.stdout.next_line())
        .await
        .expect("the console ends")
        .expect("read");
    assert_eq!(rest, None, "nothing after QUIT");
    let output = timeout(PATIENCE, console.child.wait_with_output())
        .await
        .expect("the console exits after QUIT")
        .expect("tenure runs");
    assert_eq!(output.status.code(), Some(0));
    output
}

// ---------------------------------------------------------------------------------------------
// Found by outside testing: what `run` prints, what `console` prints for WATCH, a `run` killed
// with SIGKILL, and a wait cut short by a server restart.

#[tokio::test]
async fn cli_run_prints_the_ttl_and_the_wait_of_its_grant() {
    let server = TestServer::start();
    let (code, _, err) = cli(
        &server.addr,
        &["run", "--key", "r/f", "--ttl", "5s", "--", "true"],
    )
    .await;
    assert_eq!(code, 0, "{err}");
    let granted = err
        .lines()
        .find(|l| l.contains("result=GRANTED"))
        .expect(&err);
    assert_eq!(field(granted, "ttl_ms"), "5000", "{granted}");
    assert_eq!(field(granted, "waited_ms"), "0", "{granted}");
}

#[tokio::test]
async fn cli_console_watch_prints_the_keys_state() {
    let server = TestServer::start();
    let _held = granted_meta(&server.client().await, "con/held").await;
    let mut console = Console::start(&server.addr);
    let held = console.ask("WATCH con/held").await;
    assert_eq!(
        (
            field(&held, "result"),
            field(&held, "state"),
            field(&held, "meta")
        ),
        ("WATCHING", "HELD", "w"),
        "{held}"
    );
    assert!(field(&held, "token").parse::<u64>().is_ok(), "{held}");
    let free = console.ask("WATCH con/free").await;
    assert_eq!(field(&free, "state"), "FREE", "{free}");
    quit(console).await;
}

/// The state letter of process `pid` in /proc (`Z` for a zombie), or None once it is gone.
pub(crate) fn process_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The state follows the command name, which is in parentheses and may hold spaces.
    stat.rsplit_once(") ")?.1.chars().next()
}

#[tokio::test]
async fn a_command_dies_with_a_killed_tenure_run() {
    let server = TestServer::start();
    let dir = tempfile::tempdir().unwrap();
    let pid_file = dir.path().join("pid");
    let script = format!("echo $$ > {}; exec sleep 60", pid_file.display());
    let mut run = tenure_cli(&server.addr)
        .args([
            "run", "--key", "r/k", "--ttl", "5s", "--", "sh", "-c", &script,
        ])
        .stderr(Stdio::null())
        .spawn()
        .expect("tenure runs");
    let deadline = Instant::now() + PATIENCE;
    let command_pid: u32 = loop {
        if let Some(pid) = std::fs::read_to_string(&pid_file)
            .ok()
            .and_then(|text| text.trim().parse().ok())
        {
            break pid;
        }
        assert!(Instant::now() < deadline, "the command never started");
        tokio::time::sleep(ms(10)).await;
    };
    run.start_kill().expect("SIGKILL to tenure run"); // our own child, by its handle
    run.wait().await.expect("reaped");
    // Real time: the kernel delivers the parent-death signal; poll until it has.
    let deadline = Instant::now() + PATIENCE;
    while matches!(process_state(command_pid), Some(state) if state != 'Z') {
        assert!(
            Instant::now() < deadline,
            "the command {command_pid} outlived tenure run"
        );
        tokio::time::sleep(ms(10)).await;
    }
}

#[tokio::test]
async fn cli_run_queues_again_after_a_server_restart() {
    use tenure_testkit::Server;
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path()).await;
    let addr = server.addr;
    let holder = server.client().await;
    let _held = holder
        .acquire("r/restart", ms(1500), AcquireOptions::default())
        .await
        .expect("acquire")
        .granted()
        .expect("free");
    let child = tenure_cli(&addr.to_string())
        .args([
            "run",
            "--key",
            "r/restart",
            "--ttl",
            "5s",
            "--wait",
            "30s",
            "--",
            "true",
        ])
        .stderr(Stdio::piped())
        .spawn()
        .expect("tenure runs");
    wait_for_waiters(&holder, "r/restart", 1).await;
    holder.disconnect();
    server.stop().await; // as SIGTERM: the waiter is answered SHUTTING_DOWN
    let server = Server::start_at(tenure_server::Config::for_tests(dir.path()), addr).await;
    // The holder's lease came back with the restart and runs out on its own; then `run` gets
    // the lock, runs `true` and exits 0.
    let output = timeout(PATIENCE, child.wait_with_output())
        .await
        .expect("tenure run finishes")
        .expect("tenure runs");
    let err = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(0), "{err}");
    // The crate sent the ACQUIRE again itself (its outcome was unknown), with its acquire id
    // and what was left of the wait: `run` saw one grant.
    assert!(err.contains("result=GRANTED"), "{err}");
    server.stop().await;
}

/// Starts `tenure` with `args` (a one-second session, waiting behind a lease held on `key`),
/// stops the server once it queues, keeps it down three session TTLs, so that the waiter's
/// session runs out at the client while the server is away, restarts it on the same data
/// dir, waits three TTLs more (the session the restart restored has run out at the server
/// by then), and frees the key. Returns `tenure`'s stderr; it must have exited 0.
async fn waits_through_a_restart_longer_than_its_session(key: &str, args: &[&str]) -> String {
    use tenure_testkit::Server;
    const SESSION_TTL: Duration = Duration::from_secs(1);
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path()).await;
    let addr = server.addr;
    let holder = server.client().await;
    let held = holder
        .acquire(key, Duration::from_secs(60), AcquireOptions::default())
        .await
        .expect("acquire")
        .granted()
        .expect("free");
    let lease_id = held.lease_id();
    drop(held);
    let child = tenure_cli(&addr.to_string())
        .args(args)
        .args(["--", "true"])
        .stderr(Stdio::piped())
        .spawn()
        .expect("tenure runs");
    wait_for_waiters(&holder, key, 1).await;
    holder.disconnect();
    server.stop().await;
    // Real time: `tenure` is a process of its own.
    tokio::time::sleep(3 * SESSION_TTL).await;
    let server = Server::start_at(tenure_server::Config::for_tests(dir.path()), addr).await;
    tokio::time::sleep(3 * SESSION_TTL).await;
    let freer = server.client().await;
    let released = freer.release(key, lease_id).await.expect("release");
    assert_eq!(released, ReleaseOutcome::Released, "the lease came back");
    let output = timeout(PATIENCE, child.wait_with_output())
        .await
        .expect("tenure finishes once the key is free")
        .expect("tenure runs");
    let err = String::from_utf8_lossy(&output.stderr).into_owned();
    assert_eq!(output.status.code(), Some(0), "{err}");
    server.stop().await;
    err
}

// Found by outside testing (F3): a waiter whose session ran out while the server was down
// queued again after the restart in that same session, which nobody kept alive any more; it
// exited 1 with NO_SESSION when the server's copy ran out, with most of its --wait left.
#[tokio::test]
async fn cli_run_queues_in_a_new_session_when_its_own_ran_out_while_waiting() {
    let args = [
        "run",
        "--key",
        "r/new-session",
        "--ttl",
        "1s",
        "--wait",
        "60s",
    ];
    let err = waits_through_a_restart_longer_than_its_session("r/new-session", &args).await;
    assert!(err.contains("NO_SESSION"), "{err}");
    assert!(err.contains("the session ended before the grant"), "{err}");
    assert!(!err.contains("invalid argument"), "{err}");
    assert!(err.contains("queueing again"), "{err}");
    let granted = err.lines().find(|l| l.contains("result=GRANTED"));
    let granted = granted.unwrap_or_else(|| panic!("no grant: {err}"));
    assert!(!field(granted, "session").is_empty(), "{granted}");
    assert!(!err.contains("LOST"), "{err}");
}

#[tokio::test]
async fn cli_elect_campaigns_in_a_new_session_when_its_own_ran_out_while_waiting() {
    let args = ["elect", "restarted", "--value", "standby", "--ttl", "1s"];
    let err = waits_through_a_restart_longer_than_its_session("election/restarted", &args).await;
    assert!(err.contains("campaigning again in a new session"), "{err}");
    assert!(err.contains("the session ended before the grant"), "{err}");
    assert!(err.contains("result=LEADING"), "{err}");
    assert!(!err.contains("LOST"), "{err}");
}

#[tokio::test]
async fn cli_speaks_tls_with_a_ca_and_mutual_tls_with_a_client_certificate() {
    use tenure_testkit::TestCa;
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new(dir.path(), "server");
    let clients = TestCa::new(dir.path(), "clients");
    let server_cert = ca.server(dir.path(), "server");
    let files = ca.server_files(&server_cert, Some(&clients));
    let server = TestServer::start_with(|config| config.tls = Some(files));
    let me = clients.client(dir.path(), "me");
    let (ca_path, cert, key) = (
        ca.path.to_str().unwrap(),
        me.cert.to_str().unwrap(),
        me.key.to_str().unwrap(),
    );
    let tls = [
        "--tls-ca",
        ca_path,
        "--tls-client-cert",
        cert,
        "--tls-client-key",
        key,
    ];
    let args: Vec<&str> = tls
        .iter()
        .copied()
        .chain(["acquire", "t", "--ttl", "5s"])
        .collect();
    let (code, out, err) = cli(&server.addr, &args).await;
    assert_eq!((code, field(&out, "result")), (0, "GRANTED"), "{out} {err}");

    // The console rides on the same connection options.
    let mut console = tenure_cli(&server.addr)
        .args(tls)
        .arg("console")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("tenure runs");
    let mut stdin = console.stdin.take().expect("piped");
    tokio::io::AsyncWriteExt::write_all(&mut stdin, b"inspect t\nping\n")
        .await
        .unwrap();
    drop(stdin);
    let output = timeout(PATIENCE, console.wait_with_output())
        .await
        .expect("console exits at end of input")
        .expect("tenure runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let results: Vec<&str> = stdout.lines().map(|line| field(line, "result")).collect();
    assert_eq!(results, ["HELD", "PONG"], "{stdout}");

    // Without the client certificate, or without TLS, it fails with exit code 1 and a reason.
    let (code, _, err) = cli(&server.addr, &["--tls-ca", ca_path, "ping"]).await;
    assert_eq!(code, 1, "{err}");
    let (code, out, err) = cli(&server.addr, &["ping"]).await;
    assert_eq!(code, 1, "{out}");
    assert!(
        format!("{out}{err}").contains("requires TLS"),
        "{out} {err}"
    );
    // A client certificate without a CA to check the server is refused before connecting.
    let args = ["--tls-client-cert", cert, "--tls-client-key", key, "ping"];
    let (code, out, err) = cli(&server.addr, &args).await;
    assert_eq!(code, 1);
    assert!(
        format!("{out}{err}").contains("need --tls-ca"),
        "{out} {err}"
    );
}

/// Finding 2 of the outside attack: with a hung node first among the addresses (one that
/// accepts the TCP connection and never opens it, as a stopped process does), `tenure`
/// moves on after `--connect-timeout` (1 s) instead of spending its whole `--timeout`.
#[tokio::test]
async fn cli_moves_past_an_address_that_accepts_and_never_opens() {
    let server = TestServer::start();
    // Never accepted: the kernel completes the TCP handshake, nothing answers after it.
    let hung = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addrs = format!("{},{}", hung.local_addr().unwrap(), server.addr);
    let started = Instant::now();
    let args = ["--timeout", "8s", "acquire", "k", "--ttl", "5s"];
    let (code, out, err) = cli(&addrs, &args).await;
    let took = started.elapsed();
    assert_eq!((code, field(&out, "result")), (0, "GRANTED"), "{out} {err}");
    assert!(
        took < Duration::from_secs(6),
        "took {took:?} of the 8 s --timeout"
    );
    drop(hung);
}

/// The number of RENEW requests `client`'s server has handled.
async fn renewals(client: &tenure::Client) -> u64 {
    let stats = client.stats().await.expect("stats");
    stats
        .iter()
        .find(|(n, _)| n == "ops_renew")
        .expect("ops_renew")
        .1
}

/// `tenure run` holds its lock in a session of its own by default (and with `--session`, still
/// accepted); `--no-session` holds a lease renewed alone, the behaviour before.
#[tokio::test]
async fn cli_run_holds_a_session_unless_told_no_session() {
    let server = TestServer::start();
    let addr = server.addr.as_str();
    let client = server.client().await;
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("session");
    // The command outlives three session TTLs: only the session's keep-alives hold the lock.
    let script = format!(
        "echo \"[$TENURE_SESSION_ID]\" > {}; sleep 1.5",
        file.display()
    );
    for (key, flags) in [
        ("cli/default", &[][..]),
        ("cli/session", &["--session"][..]),
    ] {
        let mut args = vec!["run", "--key", key, "--ttl", "400ms"];
        args.extend_from_slice(flags);
        args.extend_from_slice(&["--", "sh", "-c", &script]);
        let (code, _, err) = cli(addr, &args).await;
        assert_eq!(code, 0, "{flags:?}: {err}");
        let written = std::fs::read_to_string(&file).expect("the command wrote its env");
        assert_eq!(
            written.trim(),
            format!("[{}]", field(&err, "session")),
            "{err}"
        );
        assert_eq!(written.trim().len(), 34, "{written:?}");
        assert_eq!(
            client.inspect(key).await.expect("inspect"),
            KeyState::Free,
            "the session's close freed it"
        );
    }
    assert_eq!(
        renewals(&client).await,
        0,
        "kept by keep-alives, not renewals"
    );

    // --no-session: no session, and the lease outlives three TTLs by renewals.
    let plain = [
        "run",
        "--key",
        "cli/plain",
        "--ttl",
        "400ms",
        "--no-session",
        "--",
        "sh",
        "-c",
        &script,
    ];
    let (code, _, err) = cli(addr, &plain).await;
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("result=GRANTED") && !err.contains("session="),
        "{err}"
    );
    let written = std::fs::read_to_string(&file).expect("the command wrote its env");
    assert_eq!(written.trim(), "[]", "no session with --no-session");
    let renewed = renewals(&client).await;
    assert!(renewed > 0, "a lease renewed alone: {renewed} renewals");
    assert_eq!(
        client.inspect("cli/plain").await.expect("inspect"),
        KeyState::Free
    );
    let both = [
        "run",
        "cli/both",
        "--ttl",
        "1s",
        "--session",
        "--no-session",
        "--",
        "true",
    ];
    let (code, _, err) = cli(addr, &both).await;
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("cannot be used with"), "a conflict: {err}");
}

/// `--shared` and `--permits` are held in a session too (the server keeps read leases and
/// permits in sessions): two `run`s share the key, each in a session of its own, and nothing
/// is renewed.
#[tokio::test]
async fn cli_run_holds_a_shared_or_permits_lease_in_a_session() {
    let server = TestServer::start();
    let client = server.client().await;
    for (key, kind) in [
        ("cli/shared", &["--shared"][..]),
        ("cli/permits", &["--permits", "3"][..]),
    ] {
        // The first holder outlives three TTLs while the second takes the key beside it.
        let mut long = vec!["run", key, "--ttl", "400ms"];
        long.extend_from_slice(kind);
        long.extend_from_slice(&["--", "sleep", "1.5"]);
        let mut short = vec!["run", key, "--ttl", "400ms"];
        short.extend_from_slice(kind);
        short.extend_from_slice(&["--", "true"]);
        let first = cli(&server.addr, &long);
        let second = async {
            tokio::time::sleep(ms(600)).await;
            cli(&server.addr, &short).await
        };
        let ((code, _, err), (code2, _, err2)) = tokio::join!(first, second);
        assert_eq!(code, 0, "{kind:?}: {err}");
        assert_eq!(code2, 0, "{kind:?}, beside the first: {err2}");
        for err in [&err, &err2] {
            assert_eq!(field(err, "session").len(), 32, "{kind:?}: {err}");
        }
        assert_ne!(field(&err, "session"), field(&err2, "session"));
        assert_eq!(
            client.inspect(key).await.expect("inspect"),
            KeyState::Free,
            "{kind:?}"
        );
    }
    assert_eq!(
        renewals(&client).await,
        0,
        "kept by keep-alives, not renewals"
    );
}

#[tokio::test]
async fn cli_console_speaks_the_session_requests() {
    let server = TestServer::start();
    let mut console = Console::start(&server.addr);
    let opened = console.ask("SESSION_OPEN 30000").await;
    assert_eq!(field(&opened, "result"), "SESSION", "{opened}");
    assert_eq!(field(&opened, "ttl_ms"), "30000", "{opened}");
    let id = field(&opened, "session").to_owned();
    let kept = console.ask(&format!("SESSION_KEEPALIVE {id}")).await;
    assert_eq!(field(&kept, "session"), id, "{kept}");
    let granted = console.ask(&format!("ACQUIRE con/s 0 SESSION={id}")).await;
    assert_eq!(field(&granted, "result"), "GRANTED", "{granted}");
    let renewed = console
        .ask(&format!("RENEW con/s {} 1000", field(&granted, "lease")))
        .await;
    assert!(renewed.contains("SESSION_LEASE"), "{renewed}");
    let closed = console.ask(&format!("SESSION_CLOSE {id}")).await;
    assert_eq!(field(&closed, "result"), "SESSION_CLOSED", "{closed}");
    assert_eq!(field(&closed, "released"), "1", "{closed}");
    let ended = console.ask(&format!("SESSION_KEEPALIVE {id}")).await;
    assert!(ended.contains("NO_SESSION"), "{ended}");
    let free = console.ask("INSPECT con/s").await;
    assert_eq!(field(&free, "result"), "FREE", "{free}");
    // A read lease and permits live in a session too, and its close frees both.
    let opened = console.ask("SESSION_OPEN 30000").await;
    let id = field(&opened, "session").to_owned();
    for line in [
        format!("ACQUIRE con/r 0 SESSION={id} SHARED"),
        format!("ACQUIRE con/r 0 SESSION={id} SHARED"),
        format!("ACQUIRE con/p 0 SESSION={id} PERMITS=2/3"),
    ] {
        let granted = console.ask(&line).await;
        assert_eq!(field(&granted, "result"), "GRANTED", "{line}: {granted}");
    }
    let closed = console.ask(&format!("SESSION_CLOSE {id}")).await;
    assert_eq!(field(&closed, "released"), "3", "{closed}");
    for key in ["con/r", "con/p"] {
        let free = console.ask(&format!("INSPECT {key}")).await;
        assert_eq!(field(&free, "result"), "FREE", "{key}: {free}");
    }
    quit(console).await;
}

/// A server older than sessions, as far as `tenure run` can tell: SESSION_OPEN is answered
/// `UNKNOWN_OPCODE`, an ACQUIRE granted, a RENEW renewed, anything else RELEASED.
async fn server_without_sessions() -> (String, tokio::task::JoinHandle<()>) {
    use futures_util::StreamExt;
    use tenure_protocol::handshake::{HelloAck, ServerLimits, HELLO_LEN, VERSION};
    use tenure_protocol::{ErrorCode, LeaseId, Request, Response, ServerCodec};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let task = tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut hello = [0u8; HELLO_LEN];
                if stream.read_exact(&mut hello).await.is_err() {
                    return;
                }
                let mut out = bytes::BytesMut::new();
                let limits = ServerLimits::with(16, tenure_protocol::limits::TTL_MS_MAX);
                HelloAck {
                    version: VERSION,
                    limits,
                }
                .encode(&mut out);
                let (read, mut write) = stream.into_split();
                if write.write_all(&out).await.is_err() {
                    return;
                }
                let mut frames = tokio_util::codec::FramedRead::new(read, ServerCodec);
                while let Some(Ok((id, Ok(request)))) = frames.next().await {
                    let response = match request {
                        Request::SessionOpen { .. } => Response::Error {
                            code: ErrorCode::UnknownOpcode,
                            message: "unknown opcode".into(),
                        },
                        Request::Acquire { ttl_ms, .. } => Response::Granted {
                            token: 3,
                            lease_id: LeaseId::from_u128(0xabc),
                            ttl_ms,
                            waited_ms: 0,
                        },
                        Request::Renew { ttl_ms, .. } => Response::Renewed { ttl_ms },
                        _ => Response::Released,
                    };
                    out.clear();
                    tenure_protocol::frame::encode_response(id, &response, &mut out);
                    if write.write_all(&out).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (addr, task)
}

/// Against a server that does not know sessions, `tenure run` (a session by default) holds a
/// lease renewed alone instead, with a one-line warning, and the command runs.
#[tokio::test]
async fn cli_run_falls_back_to_a_renewed_lease_without_sessions() {
    let (addr, server) = server_without_sessions().await;
    let args = ["run", "cli/old", "--ttl", "300ms", "--", "sleep", "0.5"];
    let (code, _, err) = cli(&addr, &args).await;
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("does not know sessions"), "{err}");
    assert!(
        err.contains("result=GRANTED") && !err.contains("session="),
        "{err}"
    );
    server.abort();
}

/// A server at `--connections-max` answers the hello with its console refusal; the CLI
/// prints that refusal's code and words (outside test a46, L13: it printed "server did not
/// answer with the tenure magic").
#[tokio::test]
async fn cli_prints_a_connection_limit_refusal_as_the_servers_own_words() {
    use std::io::{BufRead, BufReader, Write};
    let server = TestServer::start_with(|config| config.connections_max = 1);
    let mut held = std::net::TcpStream::connect(&server.addr).expect("connect");
    held.write_all(b"PING\n").expect("write");
    let mut pong = String::new();
    BufReader::new(&held).read_line(&mut pong).expect("read");
    assert!(pong.starts_with("PONG"), "{pong}");
    let (code, out, err) = cli(&server.addr, &["ping"]).await;
    assert_eq!(code, 1, "{out}{err}");
    assert_eq!(
        out.trim_end(),
        r#"result=ERROR code=CONNECTIONS_LIMIT error="server has 1 connections already""#,
        "{err}"
    );
}
