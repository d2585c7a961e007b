//! `tenure`: the command line of the tenure lock server.
//!
//! Thin by design: it parses arguments, makes one [`tenure::Client`] request (or holds a lock
//! while a command runs) and maps the answer to one output line and an exit code. The exit
//! codes are listed in `--help` and in the crate docs.

use std::fmt::Write as _;
use std::process::{ExitCode, ExitStatus};
use std::time::Duration;

use anyhow::{bail, Context as _};
use clap::{Args, Parser, Subcommand};
use tenure::duration::parse_duration;
use tenure::{
    AcquireOptions, AcquireOutcome, Bytes, CheckOutcome, Client, ClientConfig, Election,
    ElectionOptions, KeyState, LeaseGuard, LeaseId, LossReason, ReleaseOutcome, RenewOutcome,
};
use tokio::signal::unix::{signal, SignalKind};

/// Exit code for success.
const EXIT_OK: u8 = 0;
/// Exit code for errors: I/O, server errors, bad arguments.
const EXIT_ERROR: u8 = 1;
/// Exit code when someone else holds the lock.
const EXIT_LOCKED: u8 = 3;
/// Exit code when the lease is gone.
const EXIT_LOST: u8 = 4;
/// Exit code when a release names a lease that does not hold the lock.
const EXIT_NOT_OWNER: u8 = 5;
/// Exit code when a token does not belong to the live holder.
const EXIT_STALE: u8 = 6;

const EXIT_CODES_HELP: &str = "\
Exit codes:
  0  success (run/elect: the command's own status; 128+N if signal N killed it)
  1  error: I/O, server error, bad arguments
  3  LOCKED: someone else holds the lock
  4  LOST: the lease is gone (run/elect: lost while the command ran)
  5  NOT_OWNER: the lease id does not hold the lock
  6  STALE: the token does not belong to the live holder";

/// Talk to a tenure lock server.
#[derive(Parser, Debug)]
#[command(name = "tenure", version, after_help = EXIT_CODES_HELP)]
struct Cli {
    /// Server address.
    #[arg(
        long,
        global = true,
        env = "TENURE_ADDR",
        default_value = "127.0.0.1:7878"
    )]
    addr: String,
    /// Print JSON objects instead of key=value lines.
    #[arg(long, global = true)]
    json: bool,
    /// Longest wait for one answer (a blocking acquire adds its wait).
    #[arg(long, global = true, value_parser = parse_duration, default_value = "5s")]
    timeout: Duration,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Take a lock; prints the fencing token and the lease id.
    Acquire {
        /// The lock's name.
        key: String,
        /// Lease length, e.g. 30s, 500ms, 2m.
        #[arg(long, value_parser = parse_duration)]
        ttl: Duration,
        /// How long to wait in line if the lock is held.
        #[arg(long, value_parser = parse_duration, default_value = "0ms")]
        wait: Duration,
        /// Holder metadata shown by inspect and watchers.
        #[arg(long)]
        meta: Option<String>,
    },
    /// Extend a lease.
    Renew {
        /// The lock's name.
        key: String,
        /// The lease id printed by acquire (32 hex digits).
        #[arg(value_parser = parse_lease_id)]
        lease: LeaseId,
        /// New lease length from now.
        #[arg(long, value_parser = parse_duration)]
        ttl: Duration,
    },
    /// Give a lock back.
    Release {
        /// The lock's name.
        key: String,
        /// The lease id printed by acquire.
        #[arg(value_parser = parse_lease_id)]
        lease: LeaseId,
    },
    /// Show who holds a lock.
    Inspect {
        /// The lock's name.
        key: String,
    },
    /// Ask whether a fencing token belongs to the live holder.
    Check {
        /// The lock's name.
        key: String,
        /// The fencing token.
        token: u64,
    },
    /// Print the server's counters.
    Stats,
    /// Measure a round trip.
    Ping,
    /// Hold a lock while a command runs; kill the command if the lock is lost.
    Run(RunArgs),
    /// Run a command only while leading an election group.
    Elect(ElectArgs),
    /// Print every new leader of an election group.
    Observe {
        /// The election group.
        group: String,
    },
    /// Read commands (acquire, renew, release, inspect, check, stats, ping) from stdin, one
    /// per line, over one connection; prints one line per answer.
    Console,
}

/// One line typed into `tenure console`.
#[derive(Parser, Debug)]
#[command(no_binary_name = true, disable_help_flag = true)]
struct ConsoleLine {
    #[command(subcommand)]
    command: Command,
}

#[derive(Args, Debug)]
struct RunArgs {
    /// The lock's name.
    #[arg(long)]
    key: String,
    /// Lease length; renewed every third of it while the command runs.
    #[arg(long, value_parser = parse_duration)]
    ttl: Duration,
    /// How long to wait in line if the lock is held.
    #[arg(long, value_parser = parse_duration, default_value = "0ms")]
    wait: Duration,
    /// Holder metadata shown by inspect and watchers.
    #[arg(long)]
    meta: Option<String>,
    /// Time between SIGTERM and SIGKILL when the lock is lost.
    #[arg(long, value_parser = parse_duration, default_value = "5s")]
    grace: Duration,
    /// The command and its arguments (after `--`). It gets TENURE_FENCING_TOKEN,
    /// TENURE_LEASE_ID and TENURE_KEY in its environment.
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

#[derive(Args, Debug)]
struct ElectArgs {
    /// The election group.
    group: String,
    /// This candidate's value (for example its address), shown to observers.
    #[arg(long)]
    value: String,
    /// Leader lease length.
    #[arg(long, value_parser = parse_duration, default_value = "10s")]
    ttl: Duration,
    /// Time between SIGTERM and SIGKILL when leadership is lost.
    #[arg(long, value_parser = parse_duration, default_value = "5s")]
    grace: Duration,
    /// The command and its arguments (after `--`). It gets TENURE_FENCING_TOKEN (the term),
    /// TENURE_LEASE_ID and TENURE_KEY in its environment.
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

fn parse_lease_id(text: &str) -> Result<LeaseId, String> {
    LeaseId::from_hex(text).ok_or_else(|| format!("{text:?} is not a 32-digit hex lease id"))
}

/// One value of an output line.
enum Value {
    Text(String),
    Number(u64),
}

/// One output line: ordered name/value pairs, printed as `name=value ...` or as JSON.
#[derive(Default)]
struct Line {
    pairs: Vec<(String, Value)>,
}

impl Line {
    fn new(result: &str) -> Line {
        Line::default().text("result", result)
    }

    fn text(mut self, name: &str, value: impl Into<String>) -> Line {
        self.pairs
            .push((name.to_owned(), Value::Text(value.into())));
        self
    }

    fn number(mut self, name: &str, value: u64) -> Line {
        self.pairs.push((name.to_owned(), Value::Number(value)));
        self
    }

    fn render(&self, json: bool) -> String {
        let mut out = String::new();
        if json {
            out.push('{');
        }
        for (i, (name, value)) in self.pairs.iter().enumerate() {
            match (json, i) {
                (true, 0) => {}
                (true, _) => out.push(','),
                (false, 0) => {}
                (false, _) => out.push(' '),
            }
            let value = match value {
                Value::Number(n) => n.to_string(),
                Value::Text(t) if json => json_string(t),
                Value::Text(t) => kv_value(t),
            };
            if json {
                let _ = write!(out, "{}:{value}", json_string(name));
            } else {
                let _ = write!(out, "{name}={value}");
            }
        }
        if json {
            out.push('}');
        }
        out
    }
}

/// A value as it appears after `name=`: bare if it is a simple word, quoted otherwise.
fn kv_value(text: &str) -> String {
    let simple = !text.is_empty()
        && text
            .chars()
            .all(|c| c.is_ascii_graphic() && c != '"' && c != '=' && c != '\\');
    if simple {
        text.to_owned()
    } else {
        json_string(text)
    }
}

fn json_string(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if u32::from(c) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn ms(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// Where output lines go: stdout, except for `run`/`elect`, whose stdout is the command's.
struct Out {
    json: bool,
    to_stderr: bool,
}

impl Out {
    fn print(&self, line: Line) {
        let text = line.render(self.json);
        if self.to_stderr {
            eprintln!("{text}");
        } else {
            println!("{text}");
        }
    }
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            // --help and --version are not errors; everything else is exit code 1.
            return ExitCode::from(if e.use_stderr() { EXIT_ERROR } else { EXIT_OK });
        }
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("error=\"cannot start the runtime: {e}\"");
            return ExitCode::from(EXIT_ERROR);
        }
    };
    let out = Out {
        json: cli.json,
        to_stderr: matches!(cli.command, Command::Run(_) | Command::Elect(_)),
    };
    match runtime.block_on(dispatch(cli, &out)) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            out.print(Line::new("ERROR").text("error", format!("{e:#}")));
            ExitCode::from(EXIT_ERROR)
        }
    }
}

async fn dispatch(cli: Cli, out: &Out) -> anyhow::Result<u8> {
    let config = ClientConfig {
        request_timeout: cli.timeout,
        ..ClientConfig::default()
    };
    let client = Client::connect_with(cli.addr.clone(), config)
        .await
        .with_context(|| format!("cannot connect to {}", cli.addr))?;
    execute(client, out, cli.command).await
}

async fn execute(client: Client, out: &Out, command: Command) -> anyhow::Result<u8> {
    match command {
        Command::Acquire {
            key,
            ttl,
            wait,
            meta,
        } => acquire(&client, out, key, ttl, wait, meta).await,
        Command::Renew { key, lease, ttl } => {
            let line = match client.renew(&key, lease, ttl).await? {
                RenewOutcome::Renewed { ttl } => (
                    Line::new("RENEWED")
                        .text("key", key)
                        .number("ttl_ms", ms(ttl)),
                    EXIT_OK,
                ),
                RenewOutcome::Lost => (Line::new("LOST").text("key", key), EXIT_LOST),
            };
            out.print(line.0);
            Ok(line.1)
        }
        Command::Release { key, lease } => {
            let (result, code) = match client.release(&key, lease).await? {
                ReleaseOutcome::Released => ("RELEASED", EXIT_OK),
                ReleaseOutcome::NotOwner => ("NOT_OWNER", EXIT_NOT_OWNER),
            };
            out.print(Line::new(result).text("key", key));
            Ok(code)
        }
        Command::Inspect { key } => inspect(&client, out, key).await,
        Command::Check { key, token } => {
            let (result, code) = match client.check(&key, token).await? {
                CheckOutcome::Current => ("CURRENT", EXIT_OK),
                CheckOutcome::Stale => ("STALE", EXIT_STALE),
            };
            out.print(Line::new(result).text("key", key).number("token", token));
            Ok(code)
        }
        Command::Stats => {
            let line = client
                .stats()
                .await?
                .into_iter()
                .fold(Line::new("STATS"), |line, (name, value)| {
                    line.number(&name, value)
                });
            out.print(line);
            Ok(EXIT_OK)
        }
        Command::Ping => {
            let rtt = client.ping().await?;
            out.print(
                Line::new("PONG")
                    .number("rtt_us", u64::try_from(rtt.as_micros()).unwrap_or(u64::MAX)),
            );
            Ok(EXIT_OK)
        }
        Command::Run(args) => run(&client, out, args).await,
        Command::Elect(args) => elect(client, out, args).await,
        Command::Observe { group } => observe(client, out, group).await,
        Command::Console => console(client, out).await,
    }
}

/// Runs request commands read from stdin until end of input. Commands that hold a lock or
/// never end (run, elect, observe) are refused: a console has no command to supervise.
async fn console(client: Client, out: &Out) -> anyhow::Result<u8> {
    use tokio::io::AsyncBufReadExt;
    let mut lines = tokio::io::BufReader::new(tokio::io::stdin()).lines();
    while let Some(line) = lines.next_line().await.context("reading stdin")? {
        let words: Vec<&str> = line.split_whitespace().collect();
        if words.is_empty() {
            continue;
        }
        if matches!(words[0], "quit" | "exit") {
            break;
        }
        let command = match ConsoleLine::try_parse_from(&words) {
            Ok(parsed) => parsed.command,
            Err(e) => {
                let message = e.to_string();
                let first = message.lines().next().unwrap_or("bad command");
                out.print(Line::new("ERROR").text("error", first));
                continue;
            }
        };
        if matches!(
            command,
            Command::Run(_) | Command::Elect(_) | Command::Observe { .. } | Command::Console
        ) {
            out.print(Line::new("ERROR").text("error", "not available in the console"));
            continue;
        }
        if let Err(e) = Box::pin(execute(client.clone(), out, command)).await {
            out.print(Line::new("ERROR").text("error", format!("{e:#}")));
        }
    }
    Ok(EXIT_OK)
}

async fn acquire(
    client: &Client,
    out: &Out,
    key: String,
    ttl: Duration,
    wait: Duration,
    meta: Option<String>,
) -> anyhow::Result<u8> {
    let options = AcquireOptions {
        wait,
        meta: Bytes::from(meta.unwrap_or_default()),
        release_on_disconnect: false,
    };
    match client.acquire(&key, ttl, options).await? {
        AcquireOutcome::Granted(lease) => {
            out.print(
                Line::new("GRANTED")
                    .text("key", key)
                    .number("token", lease.fencing_token())
                    .text("lease_id", lease.lease_id().to_string())
                    .number("ttl_ms", ms(lease.ttl()))
                    // A script counting the lease must add this to the TTL (PROTOCOL.md 3.3).
                    .number("waited_ms", ms(lease.waited())),
            );
            Ok(EXIT_OK)
        }
        AcquireOutcome::Locked(by) => {
            out.print(
                Line::new("LOCKED")
                    .text("key", key)
                    .number("token", by.token)
                    .number("ttl_left_ms", ms(by.ttl_left)),
            );
            Ok(EXIT_LOCKED)
        }
    }
}

async fn inspect(client: &Client, out: &Out, key: String) -> anyhow::Result<u8> {
    let line = match client.inspect(&key).await? {
        KeyState::Free => Line::new("FREE").text("key", key),
        KeyState::Held {
            token,
            ttl_left,
            waiters,
            meta,
        } => Line::new("HELD")
            .text("key", key)
            .number("token", token)
            .number("ttl_left_ms", ms(ttl_left))
            .number("waiters", u64::from(waiters))
            .text("meta", String::from_utf8_lossy(&meta)),
    };
    out.print(line);
    Ok(EXIT_OK)
}

async fn run(client: &Client, out: &Out, args: RunArgs) -> anyhow::Result<u8> {
    let options = AcquireOptions {
        wait: args.wait,
        meta: Bytes::from(args.meta.unwrap_or_default()),
        release_on_disconnect: false,
    };
    let guard = match client.lock(&args.key, args.ttl, options).await? {
        AcquireOutcome::Granted(guard) => guard,
        AcquireOutcome::Locked(by) => {
            out.print(
                Line::new("LOCKED")
                    .text("key", args.key)
                    .number("token", by.token)
                    .number("ttl_left_ms", ms(by.ttl_left)),
            );
            return Ok(EXIT_LOCKED);
        }
    };
    out.print(
        Line::new("GRANTED")
            .text("key", args.key.as_str())
            .number("token", guard.fencing_token())
            .text("lease_id", guard.lease_id().to_string()),
    );
    supervise(guard, out, &args.key, &args.command, args.grace).await
}

async fn elect(client: Client, out: &Out, args: ElectArgs) -> anyhow::Result<u8> {
    let options = ElectionOptions {
        ttl: args.ttl,
        ..ElectionOptions::default()
    };
    let election = Election::with_options(client, &args.group, options);
    let leadership = election.campaign(&args.value).await?;
    out.print(
        Line::new("LEADING")
            .text("group", args.group.as_str())
            .number("term", leadership.term())
            .text("value", args.value.as_str()),
    );
    let key = String::from_utf8_lossy(election.key()).into_owned();
    supervise(
        leadership.into_guard(),
        out,
        &key,
        &args.command,
        args.grace,
    )
    .await
}

/// Runs `command` while `guard` holds the lock. On loss: SIGTERM, SIGKILL after `grace`,
/// exit code 4. On SIGINT or SIGTERM to us: the same to the command, then release and exit
/// with its status. Otherwise: release and exit with the command's status.
async fn supervise(
    guard: LeaseGuard,
    out: &Out,
    key: &str,
    command: &[String],
    grace: Duration,
) -> anyhow::Result<u8> {
    let Some((program, args)) = command.split_first() else {
        bail!("no command given after --");
    };
    let mut interrupt = signal(SignalKind::interrupt()).context("installing a SIGINT handler")?;
    let mut terminated = signal(SignalKind::terminate()).context("installing a SIGTERM handler")?;
    let spawned = tokio::process::Command::new(program)
        .args(args)
        .env("TENURE_FENCING_TOKEN", guard.fencing_token().to_string())
        .env("TENURE_LEASE_ID", guard.lease_id().to_string())
        .env("TENURE_KEY", key)
        .kill_on_drop(true)
        .spawn();
    let mut child = match spawned {
        Ok(child) => child,
        Err(e) => {
            let _ = guard.release().await;
            return Err(e).with_context(|| format!("cannot start {program:?}"));
        }
    };
    let lost = guard.lost();
    let status = tokio::select! {
        status = child.wait() => status.context("waiting for the command")?,
        reason = lost => {
            if let Err(e) = terminate(&mut child, grace).await {
                eprintln!("warning={}", kv_value(&format!("{e:#}")));
            }
            print_lost(out, key, &reason);
            return Ok(EXIT_LOST);
        }
        _ = interrupt.recv() => terminate(&mut child, grace).await?,
        _ = terminated.recv() => terminate(&mut child, grace).await?,
    };
    if let Err(e) = guard.release().await {
        eprintln!("warning={}", kv_value(&format!("release failed: {e}")));
    }
    Ok(exit_code(status))
}

fn print_lost(out: &Out, key: &str, reason: &LossReason) {
    out.print(
        Line::new("LOST")
            .text("key", key)
            .text("reason", reason.to_string()),
    );
}

/// SIGTERM, then SIGKILL if the child is still running after `grace`; returns its status.
async fn terminate(
    child: &mut tokio::process::Child,
    grace: Duration,
) -> anyhow::Result<ExitStatus> {
    if let Some(pid) = child.id() {
        if let Err(e) = send_sigterm(pid) {
            eprintln!(
                "warning={}",
                kv_value(&format!("SIGTERM to {pid} failed: {e}"))
            );
        }
    }
    if let Ok(status) = tokio::time::timeout(grace, child.wait()).await {
        return status.context("waiting for the command");
    }
    child.kill().await.context("killing the command")?;
    child.wait().await.context("waiting for the command")
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

async fn observe(client: Client, out: &Out, group: String) -> anyhow::Result<u8> {
    let mut leaders = Election::new(client, &group).observe();
    while let Some(leader) = leaders.next().await {
        match leader {
            Ok(leader) => out.print(
                Line::default()
                    .number("term", leader.term)
                    .text("value", String::from_utf8_lossy(&leader.value)),
            ),
            Err(e) => eprintln!("error={}", kv_value(&e.to_string())),
        }
    }
    Ok(EXIT_OK)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_render_as_key_value_and_json() {
        let line = Line::new("HELD")
            .text("key", "a b")
            .number("token", 7)
            .text("meta", "");
        assert_eq!(
            line.render(false),
            r#"result=HELD key="a b" token=7 meta="""#
        );
        assert_eq!(
            line.render(true),
            r#"{"result":"HELD","key":"a b","token":7,"meta":""}"#
        );
        assert_eq!(json_string("q\"\\\n\u{1}"), r#""q\"\\\n\u0001""#);
    }

    #[test]
    fn cli_parses_run_and_rejects_bad_durations() {
        let cli = Cli::try_parse_from([
            "tenure", "--addr", "h:1", "run", "--key", "k", "--ttl", "300ms", "--", "sh", "-c",
            "exit 7",
        ])
        .expect("valid command line");
        match cli.command {
            Command::Run(args) => {
                assert_eq!(args.ttl, Duration::from_millis(300));
                assert_eq!(args.command, ["sh", "-c", "exit 7"]);
            }
            other => panic!("parsed as {other:?}"),
        }
        assert!(Cli::try_parse_from(["tenure", "acquire", "k", "--ttl", "10q"]).is_err());
        assert!(Cli::try_parse_from(["tenure", "release", "k", "not-hex"]).is_err());
    }
}
