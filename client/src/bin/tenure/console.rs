//! `tenure console`: a read-eval-print loop over one connection. It reads the server's
//! text-console grammar ([`crate::grammar`]) from stdin and prints each answer as one
//! command-line output line (`result=GRANTED key=k token=1 lease=... ttl_ms=... waited_ms=...`).

use std::collections::HashMap;
use std::time::Duration;

use anyhow::Context as _;
use tenure::{AcquireOptions, Bytes, Client, EventKind};
use tenure_protocol::Request;
use tokio::io::AsyncBufReadExt;
use tokio::task::JoinHandle;

use tenure_protocol::console::{self as grammar, Command as ConsoleCommand, COMMANDS};

use crate::exit::EXIT_OK;
use crate::legacy::parse_legacy;
use crate::output::{Line, Out};
use crate::requests::{self, watching_line};

/// Runs console lines read from stdin until end of input or QUIT.
pub async fn console(client: Client, out: &Out) -> anyhow::Result<u8> {
    let mut stdin = tokio::io::BufReader::new(tokio::io::stdin());
    let mut watches = Watches::default();
    let mut line = Vec::new();
    loop {
        line.clear();
        let read = stdin
            .read_until(b'\n', &mut line)
            .await
            .context("reading stdin")?;
        if read == 0 {
            break;
        }
        let text = line.strip_suffix(b"\n").unwrap_or(&line);
        let text = text.strip_suffix(b"\r").unwrap_or(text);
        let Some(command) = read_command(out, text) else {
            continue;
        };
        match command {
            ConsoleCommand::Empty => {}
            ConsoleCommand::Quit => break,
            ConsoleCommand::Help => out.print(Line::new("HELP").text("commands", COMMANDS)),
            ConsoleCommand::Request(request) => {
                if let Err(e) = execute(&client, out, &mut watches, request).await {
                    out.failure(&e);
                }
            }
        }
    }
    watches.stop_all();
    Ok(EXIT_OK)
}

/// The command on `line`, or None after printing why there is none. A line in the old
/// grammar is still read, with a deprecation note on stderr.
fn read_command(out: &Out, line: &[u8]) -> Option<ConsoleCommand> {
    let error = match grammar::parse(line) {
        Ok(command) => return Some(command),
        Err(error) => error,
    };
    let legacy = std::str::from_utf8(line)
        .ok()
        .and_then(|text| parse_legacy(text).map(|command| (text, command)));
    if let Some((text, command)) = legacy {
        eprintln!(
            "warning: {:?} is the old console grammar, deprecated; write it as the server's \
             console reads it (type HELP)",
            text.trim()
        );
        return Some(command);
    }
    out.print(
        Line::new("ERROR")
            .text("code", error.code.name())
            .text("error", error.message),
    );
    None
}

/// Sends one request and prints its answer.
async fn execute(
    client: &Client,
    out: &Out,
    watches: &mut Watches,
    request: Request,
) -> anyhow::Result<()> {
    let name = |key: &Bytes| String::from_utf8_lossy(key).into_owned();
    let ms = |n: u32| Duration::from_millis(u64::from(n));
    match request {
        Request::Acquire {
            key,
            ttl_ms,
            wait_ms,
            release_on_disconnect,
            meta,
            acquire_id,
            kind,
            session_id,
        } => {
            let options = AcquireOptions {
                wait: ms(wait_ms),
                meta,
                release_on_disconnect,
            };
            // Without ID= the client crate picks an acquire id (and resends it); with one,
            // a line typed again is a repeat, as on the server's own console.
            let target = requests::Target {
                session: session_id,
                id: acquire_id,
            };
            requests::acquire_to(client, out, name(&key), ms(ttl_ms), kind, options, target)
                .await?;
        }
        // Without ID= the client crate picks a session id (and resends it); with one, a line
        // typed again is a repeat, as for ACQUIRE.
        Request::SessionOpen { ttl_ms, session_id } => {
            requests::session_open(client, out, ms(ttl_ms), session_id).await?;
        }
        Request::SessionKeepalive { session_id } => {
            requests::session_keepalive(client, out, session_id).await?;
        }
        Request::SessionClose { session_id } => {
            requests::session_close(client, out, session_id).await?;
        }
        Request::Renew {
            key,
            lease_id,
            ttl_ms,
        } => {
            requests::renew(client, out, name(&key), lease_id, ms(ttl_ms)).await?;
        }
        Request::Release { key, lease_id } => {
            requests::release(client, out, name(&key), lease_id).await?;
        }
        Request::Inspect { key, kinds } => {
            requests::inspect(client, out, name(&key), kinds).await?;
        }
        Request::Check { key, token } => {
            requests::check(client, out, name(&key), token).await?;
        }
        Request::Stats => {
            requests::stats(client, out).await?;
        }
        Request::Ping => {
            requests::ping(client, out).await?;
        }
        Request::Watch { key } => watches.start(client, *out, key).await?,
        Request::Unwatch { key } => watches.stop(out, &key),
        // The client authenticates on connect (--identity and TENURE_SECRET), so that a
        // reconnect authenticates again; a typed AUTH would hold for one connection only.
        Request::Auth { .. } => anyhow::bail!("use --identity NAME and TENURE_SECRET, not AUTH"),
        request @ (Request::ClusterStatus { .. }
        | Request::ClusterInit { .. }
        | Request::ClusterAdd { .. }
        | Request::ClusterRemove { .. }) => crate::cluster::console(client, out, request).await?,
    }
    Ok(())
}

/// The console's watches: one task per watched key, printing its events as they come.
#[derive(Default)]
struct Watches {
    tasks: HashMap<Bytes, JoinHandle<()>>,
}

impl Watches {
    /// Watches `key` (again, if it was watched) and prints WATCHING, then EVENT lines.
    async fn start(&mut self, client: &Client, out: Out, key: Bytes) -> anyhow::Result<()> {
        let mut watch = client.watch(&key).await?;
        let name = String::from_utf8_lossy(&key);
        out.print(watching_line(&name, watch.initial_state()));
        let task = tokio::spawn(async move {
            while let Some(event) = watch.next().await {
                match event {
                    Ok(event) => {
                        out.print(event_line(event.kind, &event.key, event.token, &event.meta))
                    }
                    Err(e) => {
                        out.error(format!("watch ended: {e}"));
                        return;
                    }
                }
            }
        });
        if let Some(old) = self.tasks.insert(key, task) {
            old.abort();
        }
        Ok(())
    }

    /// Stops watching `key` and prints UNWATCHED (also when it was not watched, as the
    /// server answers OK then too).
    fn stop(&mut self, out: &Out, key: &Bytes) {
        if let Some(task) = self.tasks.remove(key) {
            task.abort();
        }
        out.print(Line::new("UNWATCHED").text("key", String::from_utf8_lossy(key)));
    }

    fn stop_all(&mut self) {
        for (_, task) in self.tasks.drain() {
            task.abort();
        }
    }
}

/// `result=EVENT kind=GRANTED key=k token=7 [meta=m]`, the console's `EVENT` line.
fn event_line(kind: EventKind, key: &[u8], token: u64, meta: &[u8]) -> Line {
    let kind = match kind {
        EventKind::Granted => "GRANTED",
        EventKind::Released => "RELEASED",
        EventKind::Expired => "EXPIRED",
    };
    let line = Line::new("EVENT")
        .text("kind", kind)
        .text("key", String::from_utf8_lossy(key))
        .number("token", token);
    if meta.is_empty() {
        line
    } else {
        line.text("meta", String::from_utf8_lossy(meta))
    }
}
