//! The real `tenure-loadgen` against the real server (in this test's runtime) with TLS and
//! identities: AUTH on every connection and its cost in the report, mutual TLS, and clear
//! failures for a wrong secret, a missing one and a CA that did not sign the server's
//! certificate.

use std::path::Path;

use tenure_server::identity::hash_secret;
use tenure_testkit::tls::Issued;
use tenure_testkit::{Server, TestCa};

use crate::end_to_end::number;

/// The identity the load generator authenticates as; its keys are the generator's (`job:N`).
const IDENTITY: &str = "bench";
const SECRET: &str = "bench-secret";

/// A CA, a server certificate from it, and a CA for client certificates.
struct Pki {
    ca: TestCa,
    server: Issued,
    clients: TestCa,
}

fn pki(dir: &Path) -> Pki {
    let ca = TestCa::new(dir, "trusted");
    let server = ca.server(dir, "server");
    let clients = TestCa::new(dir, "clients");
    Pki {
        ca,
        server,
        clients,
    }
}

/// A TLS server with the identity `bench`; with `mutual`, it also requires client
/// certificates from `pki.clients`.
async fn server(dir: &Path, pki: &Pki, mutual: bool) -> Server {
    let ids = dir.join("identities.toml");
    let text = format!(
        "[[identity]]\nname = \"{IDENTITY}\"\nsecret-hash = \"{}\"\nprefixes = [\"job:\"]\n",
        hash_secret(SECRET.as_bytes()).unwrap()
    );
    std::fs::write(&ids, text).unwrap();
    let files = pki
        .ca
        .server_files(&pki.server, mutual.then_some(&pki.clients));
    Server::start_in(dir, |config| {
        config.tls = Some(files);
        config.identities = Some(ids);
    })
    .await
}

/// Runs a short `max mixed` run against `server` with `flags`, the secret in the environment
/// if given; returns success, stdout and stderr.
async fn loadgen(server: &Server, secret: Option<&str>, flags: &[&str]) -> (bool, String, String) {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_tenure-loadgen"));
    command
        .args(["--target", &format!("tenure://{}", server.addr)])
        .args(["--scenario", "max", "--op", "mixed"])
        .args(["--duration", "500ms", "--warmup", "100ms"])
        .args(["--connections", "2", "--pipeline", "8", "--json", "--quiet"])
        .args(flags)
        .env_remove("TENURE_SECRET");
    if let Some(secret) = secret {
        command.env("TENURE_SECRET", secret);
    }
    let output = command.output().await.expect("run tenure-loadgen");
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_tls_with_auth_every_connection_authenticates_and_setup_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    let pki = pki(dir.path());
    let server = server(dir.path(), &pki, false).await;
    let flags = ["--tls-ca", path(&pki.ca.path), "--identity", IDENTITY];
    let (ok, json, err) = loadgen(&server, Some(SECRET), &flags).await;
    assert!(ok, "{err}");
    assert!(
        number(&json, "summary", "cycles_completed") > 100.0,
        "{json}"
    );
    assert_eq!(number(&json, "summary", "cycles_failed"), 0.0, "{json}");
    assert!(json.contains("\"errors\":{}"), "{json}");
    assert!(json.contains("\"transport\":\"tls\""), "{json}");
    assert_eq!(number(&json, "setup", "connections"), 2.0, "{json}");
    for figure in [
        "connect_to_ready_p50_ms",
        "tls_handshake_p50_ms",
        "auth_p50_ms",
    ] {
        assert!(number(&json, "setup", figure) > 0.0, "{figure}: {json}");
    }
    // The whole setup includes its TLS and AUTH parts.
    assert!(
        number(&json, "setup", "connect_to_ready_max_ms") >= number(&json, "setup", "auth_max_ms"),
        "{json}"
    );
}

/// The probe that finds a cluster's serving member (several addresses) and the `healthy`
/// scenario's connect as the run's connections do, with TLS and AUTH (outside test a37:
/// they spoke plain TCP, so every scenario against a TLS cluster failed before the run with
/// `BAD_HANDSHAKE`). One TLS server named twice stands in for a cluster whose every member
/// serves; the probe only needs one that grants.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cluster_probes_speak_tls_and_auth_as_the_run_does() {
    let dir = tempfile::tempdir().unwrap();
    let pki = pki(dir.path());
    let server = server(dir.path(), &pki, false).await;
    let twice = format!("tenure://{0},{0}", server.addr);
    let run = |scenario: &'static str, target: String| {
        let ca = path(&pki.ca.path).to_owned();
        async move {
            let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_tenure-loadgen"));
            command
                .args(["--target", &target, "--scenario", scenario])
                .args(["--op", "mixed", "--duration", "500ms", "--warmup", "100ms"])
                .args(["--connections", "2", "--json", "--quiet"])
                .args(["--tls-ca", &ca, "--identity", IDENTITY])
                .env("TENURE_SECRET", SECRET);
            let output = command.output().await.expect("run tenure-loadgen");
            let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
            let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
            (output.status.success(), stdout, stderr)
        }
    };
    let (ok, json, err) = run("max", twice).await;
    assert!(ok, "{err}");
    assert!(number(&json, "summary", "cycles_completed") > 0.0, "{json}");
    let (ok, line, err) = run("healthy", format!("tenure://{}", server.addr)).await;
    assert!(ok, "{err}");
    assert!(line.starts_with("{\"healthy\":true"), "{line}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_a_client_certificate_named_after_the_identity_needs_no_auth() {
    let dir = tempfile::tempdir().unwrap();
    let pki = pki(dir.path());
    let server = server(dir.path(), &pki, true).await;
    let client = pki.clients.client(dir.path(), IDENTITY);
    let flags = [
        "--tls-ca",
        path(&pki.ca.path),
        "--tls-client-cert",
        path(&client.cert),
        "--tls-client-key",
        path(&client.key),
    ];
    let (ok, json, err) = loadgen(&server, None, &flags).await;
    assert!(ok, "{err}");
    assert!(
        number(&json, "summary", "cycles_completed") > 100.0,
        "{json}"
    );
    assert!(json.contains("\"transport\":\"mutual-tls\""), "{json}");
    assert!(!json.contains("auth_p50_ms"), "no AUTH was sent: {json}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_or_missing_secret_fails_naming_auth_and_the_identity() {
    let dir = tempfile::tempdir().unwrap();
    let pki = pki(dir.path());
    let server = server(dir.path(), &pki, false).await;
    let flags = ["--tls-ca", path(&pki.ca.path), "--identity", IDENTITY];
    let (ok, _, err) = loadgen(&server, Some("not-the-secret"), &flags).await;
    assert!(!ok);
    assert!(
        err.contains("AUTH as \"bench\" refused") && err.contains("UNAUTHENTICATED"),
        "{err}"
    );
    let (ok, _, err) = loadgen(&server, None, &flags).await;
    assert!(!ok && err.contains("TENURE_SECRET"), "{err}");
    // Without AUTH the server refuses every request, and the report says so.
    let (_, json, err) = loadgen(&server, None, &flags[..2]).await;
    let told = format!("{json}{err}").to_lowercase();
    assert!(told.contains("unauthenticated"), "{json}{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ca_that_did_not_sign_the_server_certificate_fails_the_handshake_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let pki = pki(dir.path());
    let server = server(dir.path(), &pki, false).await;
    let rogue = TestCa::new(dir.path(), "rogue");
    let flags = ["--tls-ca", path(&rogue.path), "--identity", IDENTITY];
    let (ok, _, err) = loadgen(&server, Some(SECRET), &flags).await;
    assert!(!ok);
    assert!(
        err.contains("TLS handshake with 127.0.0.1 failed") && err.contains("certificate"),
        "{err}"
    );
    // Plain TCP to the TLS port fails too, and does not hang.
    let (ok, _, err) = loadgen(&server, Some(SECRET), &["--identity", IDENTITY]).await;
    assert!(!ok, "{err}");
}
