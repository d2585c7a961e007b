//! The classic fencing story, step by step, against a live server.
//!
//! A takes the lock and stalls past its TTL; B takes the lock with a larger fencing token and
//! writes; A wakes up and writes with its old token; the resource rejects it.
//!
//! ```text
//! cargo run -p tenure --example fencing                      # in-process server on port 0
//! cargo run -p tenure --example fencing -- --addr 127.0.0.1:7878
//! ```

use std::time::Duration;

use anyhow::{bail, Context};
use tenure::{AcquireOptions, AcquireOutcome, CheckOutcome, Client, Fence, Lease};
use tokio::time::Instant;

/// Lease length: short, so the story takes about a second.
const TTL: Duration = Duration::from_millis(300);
/// How long A stalls: past its TTL.
const STALL: Duration = Duration::from_millis(450);

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (addr, _server) = match args.as_slice() {
        [] => {
            let (addr, server) = start_server().await?;
            println!("started an in-process server on {addr}");
            (addr, Some(server))
        }
        [flag, addr] if flag == "--addr" => (addr.clone(), None),
        _ => bail!("usage: fencing [--addr HOST:PORT]"),
    };
    let started = Instant::now();
    let step = |text: String| println!("[{:>4} ms] {text}", started.elapsed().as_millis());
    let key = format!("example/fencing/{}", std::process::id());
    let storage = Fence::new();

    let a = Client::connect(addr.clone()).await.context("client A")?;
    let b = Client::connect(addr).await.context("client B")?;
    let lease_a = acquire(&a, &key, Duration::ZERO).await?;
    let token_a = lease_a.fencing_token();
    step(format!("A acquires {key}: token {token_a}, ttl {TTL:?}"));
    storage.try_accept(&key, token_a)?;
    step(format!("A writes with token {token_a}: accepted"));

    step(format!(
        "A stalls for {STALL:?} (a GC pause) and does not renew"
    ));
    let lease_b = acquire(&b, &key, Duration::from_secs(5)).await?;
    let token_b = lease_b.fencing_token();
    step(format!("B waited in line and acquires: token {token_b}"));
    storage.try_accept(&key, token_b)?;
    step(format!("B writes with token {token_b}: accepted"));

    tokio::time::sleep_until(started + STALL).await;
    step(format!(
        "A wakes up; its local deadline passed {} ms ago, but A writes anyway",
        Instant::now()
            .saturating_duration_since(lease_a.deadline())
            .as_millis()
    ));
    match storage.try_accept(&key, token_a) {
        Ok(()) => bail!("the stale write was accepted: fencing is broken"),
        Err(rejected) => step(format!(
            "the resource rejects token {token_a}: it has accepted {}",
            rejected.highest
        )),
    }
    let check = a.check(&key, token_a).await?;
    assert_eq!(check, CheckOutcome::Stale);
    step(format!("the server agrees: CHECK {token_a} is STALE"));
    lease_b.release().await?;
    Ok(())
}

async fn acquire(client: &Client, key: &str, wait: Duration) -> anyhow::Result<Lease> {
    match client.acquire(key, TTL, AcquireOptions::wait(wait)).await? {
        AcquireOutcome::Granted(lease) => Ok(lease),
        AcquireOutcome::Locked(by) => bail!("{key} is held by token {}", by.token),
    }
}

/// A server on 127.0.0.1:0 in this process; it stops when the returned sender is dropped.
async fn start_server() -> anyhow::Result<(
    String,
    (tempfile::TempDir, tokio::sync::oneshot::Sender<()>),
)> {
    let data = tempfile::tempdir()?;
    let config = tenure_server::Config::for_tests(data.path());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?.to_string();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let shutdown = async move {
        let _ = stopped.await;
    };
    tokio::spawn(async move {
        if let Err(e) = tenure_server::run(config, listener, shutdown).await {
            eprintln!("server failed: {e:#}");
        }
    });
    Ok((addr, (data, stop)))
}
