//! `tenure`: the command line of the tenure lock server. This file is the dispatch from a
//! parsed command line to the module that runs it.
//!
//! It parses arguments ([`cli`]), makes one [`tenure::Client`] request ([`requests`]), holds a
//! lock while a command runs ([`run`], [`elect`]) or reads console lines ([`console`],
//! [`legacy`]), and maps each answer to one output line ([`output`]) and an exit code. The
//! exit codes are listed in `--help` and in the crate docs.
//!
//! # Layout
//! Each module's job and the modules it may import, lowest first; `main.rs` dispatches to
//! them and none imports it. Kept by a test (`client/tests/it/layout.rs`) that fails on an
//! import not listed here, on a listed one nobody uses, and on a cycle.
//!
//! | module | its job | may import |
//! |--------|---------|------------|
//! | `exit` | the exit codes | — |
//! | `output` | one `key=value` (or JSON) line per answer, on stdout or stderr | `exit` |
//! | `cluster` | `tenure cluster status/init/add/remove`, and the console's cluster requests | `exit`, `output` |
//! | `certs` | `tenure certs`: a development CA and node certificates (rcgen) | `exit`, `output` |
//! | `cli` | the flags and commands (clap) | `certs`, `cluster` |
//! | `legacy` | the older clap-style console lines, kept as deprecated aliases | `cli` |
//! | `requests` | one request per command, its answer printed | `exit`, `output` |
//! | `terminal` | the terminal's foreground group, handed to the command's group and back | — |
//! | `guard` | the guardian process between `run`/`elect` and the command: stops its whole process group | `exit`, `output`, `terminal` |
//! | `hold` | what `run` and `elect` hold: a lock in a session of its own, or (`--no-session`) a lease renewed alone | — |
//! | `run` | `tenure run`: hold a lock while a command runs, stop it on loss | `cli`, `exit`, `guard`, `hold`, `output`, `requests` |
//! | `elect` | `tenure elect` and `observe`: run a command while leading, print leaders | `cli`, `exit`, `hold`, `output`, `run` |
//! | `console` | `tenure console`: the text-console grammar from stdin | `cluster`, `exit`, `legacy`, `output`, `requests` |

mod certs;
mod cli;
mod cluster;
mod console;
mod elect;
mod exit;
mod guard;
mod hold;
mod legacy;
mod output;
mod requests;
mod run;
mod terminal;

use std::process::ExitCode;

use anyhow::Context as _;
use clap::Parser;
use tenure::{AcquireOptions, Bytes, Client, ClientConfig, TlsOptions};

use crate::cli::{Cli, Command};
use crate::exit::{EXIT_ERROR, EXIT_OK};
use crate::output::Out;

/// The environment variable holding the secret of `--identity`.
const SECRET_VAR: &str = "TENURE_SECRET";

fn main() -> ExitCode {
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if args.get(1).is_some_and(|arg| arg == guard::GUARD_ARG) {
        return ExitCode::from(guard::guardian(&args[2..]));
    }
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
            out.failure(&e);
            ExitCode::from(EXIT_ERROR)
        }
    }
}

async fn dispatch(cli: Cli, out: &Out) -> anyhow::Result<u8> {
    // Makes files, talks to no server.
    if let Command::Certs(args) = cli.command {
        return certs::certs(out, args);
    }
    let mut config = ClientConfig {
        request_timeout: cli.timeout,
        // Per address: a node that accepts and never opens (stopped, hung) must not take
        // the whole --timeout when another address would answer.
        connect_timeout: cli.connect_timeout.min(cli.timeout),
        ..ClientConfig::default()
    };
    if let Some(name) = &cli.identity {
        let secret = std::env::var(SECRET_VAR)
            .with_context(|| format!("--identity {name} needs the secret in {SECRET_VAR}"))?;
        config = config.with_credentials(name.clone(), secret);
    }
    if let Some(tls) = tls_options(&cli)? {
        config = config.with_tls(tls);
    }
    let client = Client::connect_with(cli.addr.clone(), config)
        .await
        .with_context(|| format!("cannot connect to {}", cli.addr))?;
    execute(client, out, cli.command).await
}

/// TLS as the flags ask for it; `None` without --tls-ca.
fn tls_options(cli: &Cli) -> anyhow::Result<Option<TlsOptions>> {
    let Some(ca) = &cli.tls_ca else {
        anyhow::ensure!(
            cli.tls_client_cert.is_none() && cli.tls_server_name.is_none(),
            "--tls-client-cert and --tls-server-name need --tls-ca (the CA that signed the \
             server's certificate)"
        );
        return Ok(None);
    };
    let client = cli
        .tls_client_cert
        .as_deref()
        .zip(cli.tls_client_key.as_deref());
    let mut tls = TlsOptions::from_files(ca, client)?;
    if let Some(name) = &cli.tls_server_name {
        tls = tls.with_server_name(name.clone());
    }
    Ok(Some(tls))
}

async fn execute(client: Client, out: &Out, command: Command) -> anyhow::Result<u8> {
    match command {
        Command::Acquire {
            key,
            ttl,
            wait,
            meta,
            kind,
        } => {
            let options = AcquireOptions {
                wait,
                meta: Bytes::from(meta.unwrap_or_default()),
                release_on_disconnect: false,
            };
            requests::acquire(&client, out, key, ttl, kind.kind(), options).await
        }
        Command::Renew { key, lease, ttl } => requests::renew(&client, out, key, lease, ttl).await,
        Command::Release { key, lease } => requests::release(&client, out, key, lease).await,
        Command::Inspect { key, kinds } => requests::inspect(&client, out, key, kinds).await,
        Command::Check { key, token } => requests::check(&client, out, key, token).await,
        Command::Stats => requests::stats(&client, out).await,
        Command::Ping => requests::ping(&client, out).await,
        Command::Run(args) => run::run(&client, out, args).await,
        Command::Elect(args) => elect::elect(client, out, args).await,
        Command::Observe { group } => elect::observe(client, out, group).await,
        Command::Console => console::console(client, out).await,
        Command::Cluster(command) => cluster::cluster(&client, out, command).await,
        Command::Certs(args) => certs::certs(out, args),
    }
}
