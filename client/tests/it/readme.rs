//! README.md's console and command-line examples, read out of README.md and run in the order
//! they appear against one fresh server, so that an example cannot rot and one example's
//! leftovers cannot break the next.
//!
//! A block is an example if the line before its opening fence is `<!-- example NAME: console
//! -->` (after the `$ nc` line, each command line is followed by its one reply line) or
//! `<!-- example NAME: cli -->` (`$ tenure ARGS` lines, each followed by the lines it prints;
//! `$ tenure console` is followed by pairs of an input line and the line printed for it). A
//! `# comment` after a command is dropped. What may differ from run to run is masked: a
//! lease id (32 hex digits) stands for the lease the server granted (the same digits later
//! stand for the same lease), a value `...` for anything, and the time left (`ttl_ms=` of a
//! `HELD` line, which counts down) for any number. Tokens are compared exactly: the
//! examples run on one fresh server, whose first token is 1.
//!
//! `<!-- example NAME: shell -->` marks commands a user types in a shell (a trailing `\`
//! continues a line): README's secure cluster, run on its own
//! ([`readme_secure_cluster_runs_as_written`]).

use std::collections::HashMap;
use std::process::Stdio;

use tenure_testkit::{ThreadServer, PATIENCE};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::time::timeout;

/// README.md, beside the workspace's manifest.
fn readme() -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md");
    std::fs::read_to_string(path).expect("README.md")
}

#[derive(Debug, PartialEq)]
enum Kind {
    Console,
    Cli,
    Shell,
}

/// One marked example: its name, kind and the lines inside its fence.
#[derive(Debug)]
struct Example {
    name: String,
    kind: Kind,
    lines: Vec<String>,
}

/// Every marked example block of `doc`, in order.
fn examples(doc: &str) -> Vec<Example> {
    let lines: Vec<&str> = doc.lines().collect();
    let mut found = Vec::new();
    for (at, line) in lines.iter().enumerate() {
        let Some(marker) = line
            .trim()
            .strip_prefix("<!-- example ")
            .and_then(|rest| rest.strip_suffix(" -->"))
        else {
            continue;
        };
        let (name, kind) = marker.split_once(": ").expect("NAME: KIND");
        let kind = match kind {
            "console" => Kind::Console,
            "cli" => Kind::Cli,
            "shell" => Kind::Shell,
            other => panic!("example {name}: unknown kind {other:?}"),
        };
        assert!(
            lines.get(at + 1).is_some_and(|l| l.starts_with("```")),
            "example {name}: a fenced block must follow its marker"
        );
        let body = lines[at + 2..]
            .iter()
            .take_while(|l| !l.starts_with("```"))
            .map(|l| l.to_string())
            .collect();
        found.push(Example {
            name: name.to_string(),
            kind,
            lines: body,
        });
    }
    found
}

fn is_lease(word: &str) -> bool {
    word.len() == 32 && word.bytes().all(|b| b.is_ascii_hexdigit())
}

/// Lease ids of the document mapped to the server's, learned from the replies.
#[derive(Default)]
struct Leases(HashMap<String, String>);

impl Leases {
    /// `line` with every lease id the document used replaced by the server's.
    fn to_server(&self, line: &str) -> String {
        line.split(' ')
            .map(|w| self.0.get(w).map_or(w, String::as_str))
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// Whether `got` is the line `shown`, masked as the module docs say; learns lease ids.
    fn matches(&mut self, shown: &str, got: &str) -> bool {
        let (shown_words, got_words): (Vec<&str>, Vec<&str>) = (
            shown.split_whitespace().collect(),
            got.split_whitespace().collect(),
        );
        if shown_words.len() != got_words.len() {
            return false;
        }
        let held = shown_words.first() == Some(&"HELD") || shown.contains("result=HELD");
        shown_words.iter().zip(&got_words).all(|(&s, &g)| {
            let (s_key, s_value) = s.split_once('=').unwrap_or(("", s));
            let (g_key, g_value) = g.split_once('=').unwrap_or(("", g));
            s_key == g_key && self.value_matches(s_key, s_value, g_value, held)
        })
    }

    fn value_matches(&mut self, key: &str, shown: &str, got: &str, held: bool) -> bool {
        if shown == "..." || (held && key == "ttl_ms" && got.parse::<u32>().is_ok()) {
            return true;
        }
        if is_lease(shown) && is_lease(got) {
            return self.0.entry(shown.to_string()).or_insert(got.to_string()) == got;
        }
        shown == got
    }
}

/// A command line of a cli example: its words, the comment dropped.
fn command_words(line: &str) -> Vec<String> {
    let command = line.split(" #").next().unwrap_or(line);
    command.split_whitespace().map(str::to_string).collect()
}

async fn console_example(addr: &str, example: &Example, leases: &mut Leases) {
    let (first, rest) = example.lines.split_first().expect("a `$ nc` line");
    assert!(first.starts_with("$ nc "), "{}: {first}", example.name);
    let stream = TcpStream::connect(addr).await.unwrap();
    let (read, mut write) = stream.into_split();
    let mut read = BufReader::new(read);
    for pair in rest.chunks(2) {
        let [command, shown] = pair else {
            panic!("{}: a command without its reply", example.name)
        };
        let sent = format!("{}\n", leases.to_server(command));
        write.write_all(sent.as_bytes()).await.unwrap();
        let mut got = String::new();
        timeout(PATIENCE, read.read_line(&mut got))
            .await
            .expect("a reply in time")
            .unwrap();
        let got = got.trim_end();
        let what = &example.name;
        assert!(
            leases.matches(shown, got),
            "{what}: {command}\nshown: {shown}\n  got: {got}"
        );
    }
}

/// Runs `tenure --addr ADDR ARGS` with `input` on stdin; returns what it printed.
async fn run_cli(addr: &str, args: &[String], input: &str) -> String {
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_tenure"))
        .arg("--addr")
        .arg(addr)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("tenure runs");
    let mut stdin = child.stdin.take().expect("stdin");
    stdin.write_all(input.as_bytes()).await.unwrap();
    drop(stdin);
    let output = timeout(PATIENCE, child.wait_with_output())
        .await
        .expect("tenure finishes")
        .unwrap();
    String::from_utf8_lossy(&output.stdout).into_owned()
}

async fn cli_example(addr: &str, example: &Example, leases: &mut Leases) {
    let mut at = 0;
    while at < example.lines.len() {
        let line = &example.lines[at];
        let command = line.strip_prefix("$ ").expect("a `$ tenure` line");
        let words = command_words(command);
        assert_eq!(words[0], "tenure", "{}: {line}", example.name);
        let following: Vec<&String> = example.lines[at + 1..]
            .iter()
            .take_while(|l| !l.starts_with("$ "))
            .collect();
        at += 1 + following.len();
        let args: Vec<String> = words[1..].iter().map(|w| leases.to_server(w)).collect();
        let (input, shown): (String, Vec<&String>) = if args == ["console"] {
            let inputs = following.iter().step_by(2);
            let input = inputs
                .map(|l| format!("{}\n", leases.to_server(l)))
                .collect();
            (
                input,
                following.iter().skip(1).step_by(2).copied().collect(),
            )
        } else {
            (String::new(), following)
        };
        let printed = run_cli(addr, &args, &input).await;
        let got: Vec<&str> = printed.lines().collect();
        assert_eq!(
            got.len(),
            shown.len(),
            "{}: {line}\n{printed}",
            example.name
        );
        for (shown, got) in shown.iter().zip(got) {
            let what = &example.name;
            assert!(
                leases.matches(shown, got),
                "{what}: {line}\nshown: {shown}\n  got: {got}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readme_console_and_cli_examples_run_in_order_as_written() {
    let all = examples(&readme());
    assert!(
        all.iter().any(|e| e.kind == Kind::Console) && all.iter().any(|e| e.kind == Kind::Cli),
        "README's examples are marked: {all:?}"
    );
    let server = ThreadServer::start();
    let mut leases = Leases::default();
    for example in &all {
        match example.kind {
            Kind::Console => console_example(&server.addr, example, &mut leases).await,
            Kind::Cli => cli_example(&server.addr, example, &mut leases).await,
            Kind::Shell => {}
        }
    }
}

/// A shell example's commands, continuation lines joined.
fn shell_commands(example: &Example) -> Vec<String> {
    let mut commands = Vec::new();
    let mut current = String::new();
    for line in &example.lines {
        match line.trim_end().strip_suffix('\\') {
            Some(part) => current.push_str(part),
            None => {
                current.push_str(line);
                commands.push(std::mem::take(&mut current));
            }
        }
    }
    commands
}

/// `text` with each `127.0.0.1:PORT` moved to a free port, the same one for the same port
/// throughout (`ports` remembers).
fn on_free_ports(text: &str, ports: &mut HashMap<String, String>) -> String {
    const HOST: &str = "127.0.0.1:";
    let mut out = String::new();
    let mut rest = text;
    while let Some(at) = rest.find(HOST) {
        out.push_str(&rest[..at + HOST.len()]);
        rest = &rest[at + HOST.len()..];
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        let free = ports.entry(rest[..digits].to_string()).or_insert_with(|| {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            listener.local_addr().unwrap().port().to_string()
        });
        out.push_str(free);
        rest = &rest[digits..];
    }
    out + rest
}

/// Waits (60 s at most) until the cluster that the client command `words` reaches has a
/// leader that serves: the same command's addresses and TLS, acquiring a key of the test's
/// own with a longer time limit (a debug build on a loaded machine can take longer than the
/// command's 5 s for its first commit).
async fn wait_until_served(
    tenure: &std::path::Path,
    words: &[&str],
    dir: &std::path::Path,
    n: usize,
) {
    let subcommand = words
        .iter()
        .position(|w| *w == "acquire")
        .expect("an acquire");
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let output = tokio::process::Command::new(tenure)
            .args(&words[1..subcommand])
            .args(["--timeout", "20s", "acquire", "readme-probe", "--ttl", "1s"])
            .current_dir(dir)
            .kill_on_drop(true)
            .output();
        let output = timeout(PATIENCE * 2, output)
            .await
            .expect("tenure finishes");
        let output = output.expect("tenure runs");
        if output.status.success() {
            return;
        }
        let logs: Vec<String> = (0..n)
            .map(|i| std::fs::read_to_string(dir.join(format!("n{i}.log"))).unwrap())
            .collect();
        assert!(
            tokio::time::Instant::now() < deadline,
            "no leader served in 60 s: {}\n{logs:#?}",
            String::from_utf8_lossy(&output.stdout)
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}

/// README's secure cluster, typed as written in a fresh directory (on free ports, so that
/// it cannot meet another run's): `tenure certs`, three `tenured` nodes with peer TLS and
/// client TLS (left running, as with `&`), then, once the cluster serves, the client. `tenured` is the one built beside `tenure` (`cargo test
/// --workspace` builds it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readme_secure_cluster_runs_as_written() {
    let example = examples(&readme())
        .into_iter()
        .find(|e| e.kind == Kind::Shell && e.name == "secure-cluster")
        .expect("README marks its secure cluster `secure-cluster: shell`");
    let tenure = std::path::PathBuf::from(env!("CARGO_BIN_EXE_tenure"));
    let tenured = tenure.with_file_name("tenured");
    assert!(
        tenured.exists(),
        "{} is not built: cargo build -p tenure-server --bin tenured",
        tenured.display()
    );
    let dir = tempfile::tempdir().unwrap();
    let mut ports = HashMap::new();
    let mut daemons = Vec::new();
    for command in shell_commands(&example) {
        let command = on_free_ports(&command, &mut ports);
        let words: Vec<&str> = command.split_whitespace().collect();
        let program = match words[0] {
            "tenure" => &tenure,
            "tenured" => &tenured,
            other => panic!("secure-cluster: {other} is neither tenure nor tenured"),
        };
        let mut process = tokio::process::Command::new(program);
        process.args(&words[1..]).current_dir(dir.path());
        if words[0] == "tenured" {
            let log = std::fs::File::create(dir.path().join(format!("n{}.log", daemons.len())));
            let log = log.unwrap();
            process.stdout(Stdio::null()).stderr(log).kill_on_drop(true);
            daemons.push(process.spawn().expect("tenured runs"));
            continue;
        }
        if !daemons.is_empty() {
            wait_until_served(&tenure, &words, dir.path(), daemons.len()).await;
        }
        let output = timeout(PATIENCE, process.output())
            .await
            .expect("tenure finishes")
            .expect("tenure runs");
        let printed = String::from_utf8_lossy(&output.stdout).into_owned()
            + &String::from_utf8_lossy(&output.stderr);
        // `tenure certs` prints OK, the acquire GRANTED.
        let done = ["result=OK ", "result=GRANTED "]
            .iter()
            .any(|r| printed.starts_with(r));
        assert!(output.status.success() && done, "{command}\n{printed}");
    }
    assert_eq!(daemons.len(), 3, "three nodes");
    for daemon in &mut daemons {
        assert!(daemon.try_wait().unwrap().is_none(), "a node exited");
    }
}

#[test]
fn masks_match_only_what_may_differ() {
    let mut leases = Leases::default();
    let lease = "6f1c0e4b3f0a4d8e9b2c7a115d3e9f20";
    let real = "00000000000000000000000000000abc";
    let shown = format!("OK token=1 lease={lease} ttl_ms=30000 waited_ms=0");
    assert!(leases.matches(
        &shown,
        &format!("OK token=1 lease={real} ttl_ms=30000 waited_ms=0")
    ));
    assert_eq!(
        leases.to_server(&format!("RELEASE k {lease}")),
        format!("RELEASE k {real}")
    );
    let other = "00000000000000000000000000000def";
    assert!(!leases.matches(
        &shown,
        &format!("OK token=1 lease={other} ttl_ms=30000 waited_ms=0")
    ));
    assert!(!leases.matches(
        &shown,
        &format!("OK token=2 lease={real} ttl_ms=30000 waited_ms=0")
    ));
    assert!(!leases.matches(
        &shown,
        &format!("OK token=1 lease={real} ttl_ms=29000 waited_ms=0")
    ));
    assert!(leases.matches(
        "HELD token=1 ttl_ms=29990 waiters=0",
        "HELD token=1 ttl_ms=1 waiters=0"
    ));
    assert!(leases.matches("x lease=...", "x lease=anything"));
}
