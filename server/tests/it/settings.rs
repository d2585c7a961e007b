//! The `tenured` binary's settings and logs, run as a process: flag > environment > config
//! file > default, `--print-config` read back by `--config`, unknown keys, and log lines on
//! stderr without colour codes when stderr is a pipe.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// `tenured` with no `TENURE_*` variable from the test's own environment.
fn tenured() -> Command {
    let mut command = Command::new(crate::tenured_bin());
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("TENURE_") {
            command.env_remove(name);
        }
    }
    command.env_remove("RUST_LOG").env("RUST_BACKTRACE", "0");
    command
}

fn print_config(command: &mut Command) -> toml::Table {
    let out = command.arg("--print-config").output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().parse().unwrap()
}

fn int(table: &toml::Table, key: &str) -> i64 {
    table[key].as_integer().unwrap_or_else(|| panic!("{key}"))
}

fn write_config(dir: &Path, text: &str) -> std::path::PathBuf {
    let path = dir.join("tenured.toml");
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn flag_beats_environment_beats_file_beats_default() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_config(
        dir.path(),
        "shards = 8\nheld-max = 500\nwaiters-max = 700\nlisten = \"127.0.0.1:7001\"\n\
         keepalive-count = 3\nlog-format = \"json\"\n",
    );
    let table = print_config(
        tenured()
            .arg("--config")
            .arg(&path)
            .args(["--shards", "32", "--keepalive-count", "5"])
            .env("TENURE_SHARDS", "16")
            .env("TENURE_HELD_MAX", "600")
            .env("TENURE_LISTEN", "127.0.0.1:7002")
            .env("TENURE_TTL_MAX_MS", "9000"),
    );
    assert_eq!(int(&table, "shards"), 32, "flag beats environment and file");
    assert_eq!(int(&table, "keepalive-count"), 5, "flag beats file");
    assert_eq!(int(&table, "held-max"), 600, "environment beats file");
    assert_eq!(
        table["listen"].as_str(),
        Some("127.0.0.1:7002"),
        "env beats file"
    );
    assert_eq!(int(&table, "ttl-max-ms"), 9000, "environment beats default");
    assert_eq!(int(&table, "waiters-max"), 700, "file beats default");
    assert_eq!(
        table["log-format"].as_str(),
        Some("json"),
        "file beats default"
    );
    assert_eq!(int(&table, "connections-max"), 10_000, "default");
    assert_eq!(table["data-dir"].as_str(), Some("./tenure-data"), "default");
}

#[test]
fn config_file_can_come_from_the_environment() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_config(dir.path(), "no-fsync = true\nthreads = 3\n");
    let table = print_config(tenured().env("TENURE_CONFIG", &path));
    assert_eq!(table["no-fsync"].as_bool(), Some(true));
    assert_eq!(int(&table, "threads"), 3);
    // A boolean flag's variable can turn it back off over the file.
    let table = print_config(
        tenured()
            .env("TENURE_CONFIG", &path)
            .env("TENURE_NO_FSYNC", "false"),
    );
    assert_eq!(table["no-fsync"].as_bool(), Some(false));
}

#[test]
fn printed_config_is_a_config_file_for_the_same_settings() {
    let dir = tempfile::tempdir().unwrap();
    let first = tenured()
        .args(["--listen", "127.0.0.1:7003", "--durability", "tokens"])
        .args(["--threads", "2", "--wal-segment-bytes", "1048576"])
        .args(["--handshake-timeout-ms", "1500", "--log-format", "json"])
        .arg("--print-config")
        .output()
        .unwrap();
    assert!(first.status.success());
    let path = write_config(dir.path(), std::str::from_utf8(&first.stdout).unwrap());
    let second = tenured()
        .arg("--config")
        .arg(&path)
        .arg("--print-config")
        .output()
        .unwrap();
    assert!(second.status.success());
    assert_eq!(
        String::from_utf8_lossy(&first.stdout),
        String::from_utf8_lossy(&second.stdout)
    );
    assert!(String::from_utf8_lossy(&first.stdout).contains("durability = \"tokens\""));
}

fn failed(out: &Output) -> String {
    assert!(!out.status.success());
    String::from_utf8(out.stderr.clone()).unwrap()
}

#[test]
fn unknown_key_or_bad_value_is_an_error_naming_key_and_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_config(dir.path(), "shards = 8\nhold-max = 5\n");
    let stderr = failed(&tenured().arg("--config").arg(&path).output().unwrap());
    assert!(stderr.contains("hold-max"), "{stderr}");
    assert!(stderr.contains(&path.display().to_string()), "{stderr}");
    let path = write_config(dir.path(), "keepalive-idle-ms = -1\n");
    let stderr = failed(&tenured().arg("--config").arg(&path).output().unwrap());
    assert!(stderr.contains("key `keepalive-idle-ms`"), "{stderr}");
    assert!(stderr.contains(&path.display().to_string()), "{stderr}");
    let missing = dir.path().join("missing.toml");
    let stderr = failed(&tenured().arg("--config").arg(&missing).output().unwrap());
    assert!(stderr.contains("missing.toml"), "{stderr}");
}

/// A start that fails names its cause once: the server's errors carry their cause in their
/// message and as their source, and the report printed it under both.
#[test]
fn a_failed_start_names_its_cause_once() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("a-file");
    std::fs::write(&file, "not a directory").unwrap();
    let out = tenured()
        .args(["--listen", "127.0.0.1:0", "--data-dir"])
        .arg(&file)
        .output()
        .unwrap();
    let stderr = failed(&out);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.starts_with("Error: "), "{stderr}");
    assert!(stderr.contains(&file.display().to_string()), "{stderr}");
    assert_eq!(stderr.matches("(os error").count(), 1, "{stderr}");
}

/// A cluster node refuses a single node's data directory: it would not read that WAL, so it
/// would grant its held keys again under fencing tokens from 1 (outside test a46, L1: token
/// 2097153 held, then 2 granted beside it).
#[test]
fn a_cluster_node_refuses_a_single_nodes_data_dir() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let mut single = tenured()
        .args(["--listen", "127.0.0.1:0", "--data-dir"])
        .arg(&data)
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let has_wal = || {
        std::fs::read_dir(&data).is_ok_and(|entries| {
            entries
                .flatten()
                .any(|e| e.file_name().to_string_lossy().starts_with("wal-"))
        })
    };
    let started = std::time::Instant::now();
    while !has_wal() && started.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(20));
    }
    single.kill().unwrap();
    single.wait().unwrap();
    assert!(has_wal(), "the single node wrote no WAL segment");
    let out = tenured()
        .args(["--cluster", "--node-id", "1", "--listen", "127.0.0.1:0"])
        .args(["--peer-listen", "127.0.0.1:0", "--data-dir"])
        .arg(&data)
        .args(["--initial-cluster", "1=127.0.0.1:1/127.0.0.1:2"])
        .output()
        .unwrap();
    let stderr = failed(&out);
    assert!(
        stderr.contains("holds a single-node server's state (wal-"),
        "{stderr}"
    );
}

/// A node's flags without `--cluster` are refused, not ignored: a node that forgot
/// `--cluster` was a single node with a lock table of its own (outside test a46, L2).
#[test]
fn cluster_flags_without_cluster_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let out = tenured()
        .args(["--listen", "127.0.0.1:0", "--node-id", "2", "--data-dir"])
        .arg(dir.path())
        .output()
        .unwrap();
    let stderr = failed(&out);
    assert!(
        stderr.contains("--node-id only applies with --cluster"),
        "{stderr}"
    );
    assert!(
        std::fs::read_dir(dir.path()).unwrap().next().is_none(),
        "nothing started"
    );
}

/// A node setting from the environment is named as such in the refusal, and an empty one
/// (a unit file's blank `TENURE_INITIAL_CLUSTER=`) gives nothing (outside test a48, N2).
#[test]
fn a_node_setting_from_the_environment_is_named_as_such() {
    let out = tenured()
        .args(["--listen", "127.0.0.1:0", "--print-config"])
        .env("TENURE_NODE_ID", "2")
        .output()
        .unwrap();
    let stderr = failed(&out);
    assert!(
        stderr.contains("--node-id only applies with --cluster")
            && stderr.contains("(TENURE_NODE_ID is set in the environment)"),
        "{stderr}"
    );
    let out = tenured()
        .args(["--listen", "127.0.0.1:0", "--print-config"])
        .env("TENURE_INITIAL_CLUSTER", "")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A bad value from the environment is named as such, not only as its flag (outside test
/// a63, F7); the same value typed on the command line gets no such note.
#[test]
fn a_bad_value_from_the_environment_names_its_variable() {
    let out = tenured()
        .arg("--print-config")
        .env("TENURE_HELD_MAX", "lots")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("invalid value 'lots' for '--held-max"),
        "{stderr}"
    );
    assert!(
        stderr.contains(
            "that value of --held-max came from the environment variable TENURE_HELD_MAX"
        ),
        "{stderr}"
    );
    let out = tenured()
        .args(["--print-config", "--held-max", "lots"])
        .env("TENURE_HELD_MAX", "7")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("environment"), "{stderr}");
}

/// A value in range for its type but refused by the checks that follow (a limit, the
/// cluster's timing) names where it came from too (outside test a64, F1), and a value typed
/// on the command line gets no note.
#[test]
fn a_refused_value_names_the_variable_or_file_that_gave_it() {
    let node = [
        "--cluster",
        "--node-id",
        "1",
        "--peer-listen",
        "127.0.0.1:7001",
        "--initial-cluster",
        "1=127.0.0.1:7001/127.0.0.1:7000",
        "--print-config",
    ];
    let out = tenured()
        .args(node)
        .env("TENURE_HEARTBEAT_MS", "9")
        .output()
        .unwrap();
    let stderr = failed(&out);
    assert!(
        stderr.contains("--heartbeat-ms 9 is under the least, 10"),
        "{stderr}"
    );
    assert!(
        stderr.contains(
            "note: the value of --heartbeat-ms came from the environment variable \
             TENURE_HEARTBEAT_MS"
        ),
        "{stderr}"
    );
    let out = tenured()
        .arg("--print-config")
        .env("TENURE_HELD_MAX", "0")
        .output()
        .unwrap();
    let stderr = failed(&out);
    assert!(stderr.contains("--held-max must be at least 1"), "{stderr}");
    assert!(
        stderr.contains("environment variable TENURE_HELD_MAX"),
        "{stderr}"
    );

    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tenured.toml");
    std::fs::write(&file, "held-max = 0\n").unwrap();
    let out = tenured()
        .arg("--config")
        .arg(&file)
        .arg("--print-config")
        .output()
        .unwrap();
    let stderr = failed(&out);
    assert!(
        stderr.contains(&format!(
            "note: the value of --held-max came from the config file {} (key held-max)",
            file.display()
        )),
        "{stderr}"
    );
    let out = tenured()
        .args(["--print-config", "--held-max", "0"])
        .output()
        .unwrap();
    let stderr = failed(&out);
    assert!(!stderr.contains("note:"), "{stderr}");

    // The exposed-address refusal names its flag, so its note follows; a backtrace asked
    // for comes after the note, not over it (outside test a65, 3 and 7).
    let out = tenured()
        .arg("--print-config")
        .env("TENURE_LISTEN", "0.0.0.0:1")
        .env("RUST_BACKTRACE", "1")
        .output()
        .unwrap();
    let stderr = failed(&out);
    let note = "note: the value of --listen came from the environment variable TENURE_LISTEN";
    let at = stderr.find(note).expect(&stderr);
    assert!(
        stderr
            .find("Stack backtrace")
            .is_none_or(|trace| trace > at),
        "{stderr}"
    );
}

/// `--print-config` refuses what a start refuses (outside test a47, M12, and a48, N3 and N4:
/// it printed the settings and exited 0), and the timing flags count as node flags (M11:
/// ignored).
#[test]
fn print_config_refuses_what_a_start_refuses() {
    let refused = |args: &[&str], words: &str| {
        let out = tenured().args(args).arg("--print-config").output().unwrap();
        let stderr = failed(&out);
        assert!(stderr.contains(words), "{args:?}: {stderr}");
        assert!(out.stdout.is_empty(), "{args:?} printed settings");
    };
    refused(&["--node-id", "1"], "--node-id only applies with --cluster");
    refused(
        &["--heartbeat-ms", "100", "--election-timeout-ms", "900"],
        "--heartbeat-ms, --election-timeout-ms only apply with --cluster",
    );
    refused(&["--cluster"], "--cluster needs --node-id");
    let node = [
        "--cluster",
        "--node-id",
        "1",
        "--peer-listen",
        "127.0.0.1:1",
    ];
    refused(
        &[&node[..], &["--initial-cluster", "1=a"]].concat(),
        "--initial-cluster:",
    );
    refused(
        &[
            &node[..],
            &["--initial-cluster", "2=127.0.0.1:2/127.0.0.1:3"],
        ]
        .concat(),
        "--initial-cluster does not list this node (1)",
    );
    refused(
        &["--listen", "0.0.0.0:1"],
        "refusing to serve 0.0.0.0:1 (--listen) without identities",
    );
    refused(
        &[&node[..], &["--no-fsync"]].concat(),
        "do not apply in cluster mode",
    );
    refused(
        &[
            &node[..],
            &["--heartbeat-ms", "500", "--election-timeout-ms", "100"],
        ]
        .concat(),
        "--election-timeout-ms (100) must be more than --heartbeat-ms (500)",
    );
    refused(
        &[&node[..], &["--heartbeat-ms", "0"]].concat(),
        "--heartbeat-ms 0 is under the least, 10",
    );
    refused(
        &[&node[..], &["--election-timeout-ms", "100000000000"]].concat(),
        "--election-timeout-ms 100000000000 is over the most, 60000",
    );
    let out = tenured().args(node).arg("--print-config").output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn shipped_sample_config_is_accepted() {
    let sample = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/tenured.toml");
    let table = print_config(tenured().arg("--config").arg(sample));
    assert_eq!(table["data-dir"].as_str(), Some("/var/lib/tenure"));
}

/// Starts `tenured` with `args` and stderr on a pipe, waits for its ready line, stops it with
/// SIGTERM and returns everything it wrote to stderr.
fn stderr_of_a_run(args: &[&str]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let mut child = tenured()
        .args(["--listen", "127.0.0.1:0", "--no-fsync", "--data-dir"])
        .arg(dir.path())
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (lines_tx, lines_rx) = mpsc::channel();
    let stderr = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            let _ = lines_tx.send(line.unwrap());
        }
    });
    let mut lines = Vec::new();
    while let Ok(line) = lines_rx.recv_timeout(Duration::from_secs(20)) {
        let ready = line.contains("tenured ready");
        lines.push(line);
        if ready {
            break;
        }
    }
    // The `kill` command, as the other tests do: the workspace denies `unsafe`.
    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let status = child.wait().unwrap();
    reader.join().unwrap();
    lines.extend(lines_rx.try_iter());
    assert!(status.success(), "{status:?}: {lines:?}");
    lines.join("\n")
}

#[test]
fn text_logs_go_to_stderr_without_colour_codes_when_it_is_a_pipe() {
    let stderr = stderr_of_a_run(&[]);
    assert!(stderr.contains("tenured ready"), "{stderr}");
    assert!(stderr.contains("stopped"), "{stderr}");
    assert!(
        !stderr.contains("\x1b["),
        "colour codes in a pipe: {stderr:?}"
    );
}

#[test]
fn json_logs_are_one_object_per_line() {
    let stderr = stderr_of_a_run(&["--log-format", "json"]);
    assert!(
        !stderr.contains("\x1b["),
        "colour codes in a pipe: {stderr:?}"
    );
    let mut messages = Vec::new();
    for line in stderr.lines() {
        let value: serde_json::Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("not a JSON line ({e}): {line:?}"));
        assert!(value["level"].is_string(), "{line}");
        messages.push(value["fields"]["message"].as_str().unwrap().to_owned());
    }
    assert!(
        messages.iter().any(|m| m == "tenured ready"),
        "{messages:?}"
    );
    assert!(messages.iter().any(|m| m == "stopped"), "{messages:?}");
}

// ----- the systemd unit -----

/// Exposure score (`systemd-analyze security`, 0.0-10.0, times ten) the unit must stay under:
/// it scores 1.4 today; 2.0 leaves room for systemd's scoring to shift between versions.
const UNIT_EXPOSURE_MAX: u32 = 20;

/// `systemd-analyze` must be installed (`.ci/run` installs the `systemd` package): the test
/// fails without it rather than pass without checking.
fn systemd_analyze(args: &[&str], unit: &Path) -> Output {
    Command::new("systemd-analyze")
        .args(args)
        .arg(unit)
        .output()
        .expect("systemd-analyze is missing: apt-get install systemd")
}

#[test]
fn systemd_unit_verifies_and_stays_hardened() {
    let deploy = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy");
    let unit = std::fs::read_to_string(deploy.join("tenured.service")).unwrap();
    let exec = "ExecStart=/usr/local/bin/tenured --config /etc/tenure/tenured.toml\n";
    assert!(
        unit.contains(exec),
        "the unit runs the installed binary on the config"
    );
    // The sample config's data-dir is the unit's state directory.
    assert!(unit.contains("\nStateDirectory=tenure\n"));
    for line in [
        "DynamicUser=yes",
        "ProtectSystem=strict",
        "NoNewPrivileges=yes",
    ] {
        assert!(unit.contains(&format!("\n{line}\n")), "{line}");
    }
    // verify checks that ExecStart's binary exists, so point it at the one just built.
    let dir = tempfile::tempdir().unwrap();
    let copy = dir.path().join("tenured.service");
    let built = exec.replace("/usr/local/bin/tenured", env!("CARGO_BIN_EXE_tenured"));
    std::fs::write(&copy, unit.replace(exec, &built)).unwrap();
    let out = systemd_analyze(&["verify"], &copy);
    // An unknown or misspelt key is only a warning with exit status 0: any output fails.
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success() && said.trim().is_empty(), "{said}");
    let threshold = format!("--threshold={UNIT_EXPOSURE_MAX}");
    let out = systemd_analyze(&["security", "--offline=yes", &threshold], &copy);
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{report}");
    assert!(report.contains("Overall exposure level"), "{report}");
}

// ----- the Dockerfile (no docker daemon here: these are the checks that need none) -----

#[test]
fn dockerfile_uses_the_workspace_toolchain_and_files_that_exist() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let dockerfile = std::fs::read_to_string(root.join("Dockerfile")).unwrap();
    let manifest: toml::Table = std::fs::read_to_string(root.join("Cargo.toml"))
        .unwrap()
        .parse()
        .unwrap();
    let msrv = manifest["workspace"]["package"]["rust-version"]
        .as_str()
        .unwrap();
    assert!(
        dockerfile.contains(&format!("FROM rust:{msrv}-slim-")),
        "the builder image is the workspace's rust-version {msrv}"
    );
    for line in dockerfile.lines().filter(|l| l.starts_with("COPY ")) {
        let words: Vec<&str> = line.split_whitespace().collect();
        if words[1].starts_with("--from=") || words[1] == "." {
            continue;
        }
        assert!(root.join(words[1]).is_file(), "{line}: no such file");
    }
    assert!(
        dockerfile.contains("\nUSER tenure\n"),
        "runs as a non-root user"
    );
    assert!(dockerfile.contains("\nVOLUME [\"/var/lib/tenure\"]\n"));
    let entry = r#"ENTRYPOINT ["/usr/local/bin/tenured", "--config", "/etc/tenure/tenured.toml"]"#;
    assert!(dockerfile.contains(entry));
}

/// `tenured --help` describes the binary as it is: cluster mode is there (not "being built"),
/// the server is not only single-node, and `--peer-listen` says the peers use the address in
/// the membership, not the listener's.
#[test]
fn help_describes_cluster_mode_as_it_is() {
    let out = tenured().arg("--help").output().unwrap();
    assert!(out.status.success());
    let help = String::from_utf8(out.stdout).unwrap();
    for stale in [
        "being built",
        "single-node",
        "in-memory",
        "reach this one on",
    ] {
        assert!(
            !help.contains(stale),
            "`--help` still says {stale:?}:\n{help}"
        );
    }
    assert!(help.contains("Raft cluster"), "{help}");
    let peer_listen = help
        .split("--peer-listen <")
        .nth(1)
        .and_then(|rest| rest.split("\n  -").next())
        .expect("--peer-listen in --help");
    assert!(peer_listen.contains("--initial-cluster"), "{peer_listen}");
}
