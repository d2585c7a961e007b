//! Credentials: the client authenticates on every (re)connect, and the `tenure` command line
//! takes `--identity NAME` with the secret from `TENURE_SECRET`.

use std::time::Duration;

use tenure::{Client, ClientConfig, Error, ErrorCode, KeyState};
use tokio::sync::oneshot;

/// Generous bound on anything that takes a few round trips (AUTH hashes on purpose).
const PATIENCE: Duration = Duration::from_secs(10);

/// A server with one identity, `app` (secret `app-secret`, keys under `app/`), in a runtime of
/// its own; stopped when dropped.
struct TestServer {
    addr: String,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
    _data: tempfile::TempDir,
}

impl TestServer {
    fn start() -> TestServer {
        let data = tempfile::tempdir().unwrap();
        let ids = data.path().join("identities.toml");
        let hash = tenure_server::identity::hash_secret(b"app-secret").unwrap();
        let text = format!(
            "[[identity]]\nname = \"app\"\nsecret-hash = \"{hash}\"\nprefixes = [\"app/\"]\n"
        );
        std::fs::write(&ids, text).unwrap();
        let mut config = tenure_server::Config::for_tests(data.path());
        config.identities = Some(ids);
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (stop, stopped) = oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).unwrap();
                let shutdown = async move {
                    let _ = stopped.await;
                };
                tenure_server::run(config, listener, shutdown)
                    .await
                    .unwrap();
            });
        });
        TestServer {
            addr,
            stop: Some(stop),
            thread: Some(thread),
            _data: data,
        }
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        let _ = self.stop.take().unwrap().send(());
        let _ = self.thread.take().unwrap().join();
    }
}

fn server_code(e: &Error) -> ErrorCode {
    match e {
        Error::Server { code, .. } => *code,
        other => panic!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credentials_are_sent_on_every_connect() {
    let server = TestServer::start();
    let config = ClientConfig::default().with_credentials("app", "app-secret");
    let client = Client::connect_with(server.addr.clone(), config)
        .await
        .unwrap();
    assert_eq!(client.inspect("app/1").await.unwrap(), KeyState::Free);
    let forbidden = client.inspect("other/1").await.unwrap_err();
    assert_eq!(server_code(&forbidden), ErrorCode::Forbidden);
    // A reconnect authenticates again.
    client.disconnect();
    assert_eq!(client.inspect("app/1").await.unwrap(), KeyState::Free);
    assert!(format!("{:?}", client.config()).contains("<secret>"));
    assert!(!format!("{:?}", client.config()).contains("app-secret"));

    let wrong = ClientConfig::default().with_credentials("app", "nope");
    let err = Client::connect_with(server.addr.clone(), wrong)
        .await
        .unwrap_err();
    assert_eq!(server_code(&err), ErrorCode::Unauthenticated);
    let anonymous = Client::connect(server.addr.clone()).await.unwrap();
    let err = anonymous.inspect("app/1").await.unwrap_err();
    assert_eq!(server_code(&err), ErrorCode::Unauthenticated);
}

/// `tenure --identity app ARGS` against `addr`, with `secret` in `TENURE_SECRET` (none if
/// `None`); returns the exit code, stdout and stderr.
async fn tenure_as_app(
    addr: &str,
    secret: Option<&str>,
    args: &[&str],
) -> (Option<i32>, String, String) {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_tenure"));
    command
        .args(["--addr", addr, "--identity", "app"])
        .args(args)
        .env_remove("TENURE_SECRET")
        .env_remove("TENURE_IDENTITY")
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true);
    if let Some(secret) = secret {
        command.env("TENURE_SECRET", secret);
    }
    let out = tokio::time::timeout(PATIENCE, command.output())
        .await
        .unwrap()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_takes_identity_and_secret_from_the_environment() {
    let server = TestServer::start();
    let run = |secret: Option<&'static str>| {
        let addr = server.addr.clone();
        async move {
            let (code, out, err) = tenure_as_app(&addr, secret, &["inspect", "app/1"]).await;
            (code, out + &err)
        }
    };
    let (code, text) = run(Some("app-secret")).await;
    assert_eq!(code, Some(0), "{text}");
    assert!(text.contains("result=FREE"), "{text}");
    let (code, text) = run(Some("wrong")).await;
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("UNAUTHENTICATED"), "{text}");
    let (code, text) = run(None).await;
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("TENURE_SECRET"), "{text}");
}

/// A wrong secret is refused while connecting, and printed as every refusal is: its code and
/// the server's own words, in the one-shot commands, `--json` and `tenure console` alike
/// (outside test a39, F7: the words were `cannot connect to <addr>: authentication failed`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_prints_a_wrong_secret_as_the_servers_own_refusal() {
    let server = TestServer::start();
    let refused = r#"result=ERROR code=UNAUTHENTICATED error="authentication failed""#;
    for args in [
        &["inspect", "app/1"][..],
        &["acquire", "app/1", "--ttl", "5s"],
    ] {
        let (code, out, err) = tenure_as_app(&server.addr, Some("wrong"), args).await;
        assert_eq!(code, Some(1), "{args:?}: {out}{err}");
        assert_eq!(out.trim_end(), refused, "{args:?}: {err}");
    }
    let (code, out, err) = tenure_as_app(&server.addr, Some("wrong"), &["--json", "ping"]).await;
    assert_eq!(code, Some(1), "{out}{err}");
    let object: serde_json::Value = serde_json::from_str(out.trim()).expect("JSON");
    assert_eq!(object["code"], "UNAUTHENTICATED", "{out}");
    assert_eq!(object["error"], "authentication failed", "{out}");
    let (code, out, err) = tenure_as_app(&server.addr, Some("wrong"), &["console"]).await;
    assert_eq!(code, Some(1), "{out}{err}");
    assert_eq!(out.trim_end(), refused, "{err}");
}
