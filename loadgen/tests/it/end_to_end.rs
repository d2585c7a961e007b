//! End to end: the real `tenure-loadgen` binary against a small in-test tenure server that
//! speaks the binary protocol over TCP on port 0 (grants free keys, refuses held ones, checks
//! lease ids on renew and release; no expiry, no waiting in line). Real time: the load
//! generator is a process of its own.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::process::Command;

use bytes::{Bytes, BytesMut};
use tenure_protocol::frame::{decode_request, encode_response, split_frame};
use tenure_protocol::handshake::{Hello, HelloAck, ServerLimits, VERSION};
use tenure_protocol::{LeaseId, Request, Response};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Locks of the fake server, shared by its connections.
pub(crate) type Locks = std::sync::Arc<std::sync::Mutex<(HashMap<Bytes, LeaseId>, u64)>>;

pub(crate) fn answer(locks: &Locks, request: Request) -> Response {
    let mut guard = locks.lock().unwrap();
    let (held, token) = &mut *guard;
    match request {
        Request::Ping => Response::Pong,
        Request::Acquire { key, ttl_ms, .. } => {
            if held.contains_key(&key) {
                return Response::Locked {
                    token: *token,
                    ttl_left_ms: ttl_ms,
                };
            }
            *token += 1;
            let lease_id = LeaseId::from_u128(u128::from(*token) * 7919);
            held.insert(key, lease_id);
            Response::Granted {
                token: *token,
                lease_id,
                ttl_ms,
                waited_ms: 0,
            }
        }
        Request::Renew {
            key,
            lease_id,
            ttl_ms,
        } => match held.get(&key) {
            Some(l) if *l == lease_id => Response::Renewed { ttl_ms },
            _ => Response::Lost,
        },
        Request::Release { key, lease_id } => match held.get(&key) {
            Some(l) if *l == lease_id => {
                held.remove(&key);
                Response::Released
            }
            _ => Response::NotOwner,
        },
        other => panic!("the fake server does not do {other:?}"),
    }
}

async fn serve(mut stream: TcpStream, locks: Locks) {
    let mut input = BytesMut::new();
    while Hello::decode(&mut input).unwrap().is_none() {
        if stream.read_buf(&mut input).await.unwrap() == 0 {
            return;
        }
    }
    let mut out = BytesMut::new();
    HelloAck {
        version: VERSION,
        limits: ServerLimits::with(128, 60_000),
    }
    .encode(&mut out);
    loop {
        while let Some((opcode, id, body)) = split_frame(&mut input).unwrap() {
            let response = answer(&locks, decode_request(opcode, body).unwrap());
            encode_response(id, &response, &mut out);
        }
        if stream.write_all(&out).await.is_err() {
            return;
        }
        out.clear();
        match stream.read_buf(&mut input).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
    }
}

/// Starts the fake server on a thread of its own; it lives until the test process ends.
fn fake_server() -> SocketAddr {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async move {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            tx.send(listener.local_addr().unwrap()).unwrap();
            let locks = Locks::default();
            loop {
                let (stream, _) = listener.accept().await.unwrap();
                stream.set_nodelay(true).unwrap();
                tokio::spawn(serve(stream, locks.clone()));
            }
        });
    });
    rx.recv().unwrap()
}

pub(crate) fn loadgen(args: &[&str]) -> (bool, String, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_tenure-loadgen"))
        .args(args)
        .output()
        .expect("run tenure-loadgen");
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// The number `name` inside the object named `object` of a JSON report: a top-level section
/// (`summary`, `resources`) or an op kind under `ops`.
pub(crate) fn number(json: &str, object: &str, name: &str) -> f64 {
    let report: serde_json::Value = serde_json::from_str(json).expect("the report is JSON");
    let section = report
        .get(object)
        .or_else(|| report["ops"].get(object))
        .unwrap_or_else(|| panic!("no {object} in {json}"));
    section[name]
        .as_f64()
        .unwrap_or_else(|| panic!("no number {name} in {section}"))
}

#[test]
fn estimate_holds_renews_and_releases_on_schedule() {
    let target = format!("tenure://{}", fake_server());
    let (ok, json, err) = loadgen(&[
        "--target",
        &target,
        "--rate",
        "2000",
        "--hold",
        "300ms",
        "--renew-every",
        "100ms",
        "--ttl",
        "1s",
        "--duration",
        "1s",
        "--warmup",
        "100ms",
        "--connections",
        "4",
        "--json",
        "--quiet",
    ]);
    assert!(ok, "{err}");
    let acquires = number(&json, "acquire", "granted");
    assert!((1800.0..=2200.0).contains(&acquires), "{json}");
    // Three renews per lock (at 100, 200 and 300 ms) and one release, at the same rate.
    let renews = number(&json, "renew", "renewed");
    assert!((5400.0..=6600.0).contains(&renews), "{json}");
    let releases = number(&json, "release", "released");
    assert!((1800.0..=2200.0).contains(&releases), "{json}");
    let held = number(&json, "resources", "locks_held_at_end");
    assert!((500.0..=700.0).contains(&held), "{json}");
    assert!(json.contains("\"errors\":{}"), "{json}");
}

/// Flags of a short `max` scenario against `target`, JSON out.
pub(crate) fn max_scenario(target: &str) -> [&str; 14] {
    [
        "--target",
        target,
        "--scenario",
        "max",
        "--duration",
        "500ms",
        "--warmup",
        "100ms",
        "--connections",
        "2",
        "--pipeline",
        "8",
        "--json",
        "--quiet",
    ]
}

#[test]
fn max_mixed_counts_whole_cycles_and_max_acquire_counts_refusals() {
    let target = format!("tenure://{}", fake_server());
    let common = max_scenario(&target);
    let (ok, json, err) = loadgen(&[&common[..], &["--op", "mixed"]].concat());
    assert!(ok, "{err}");
    assert!(
        number(&json, "summary", "cycles_completed") > 100.0,
        "{json}"
    );
    assert_eq!(number(&json, "summary", "cycles_failed"), 0.0, "{json}");
    // Ten keys, never released: after ten grants every acquire is refused.
    let (ok, json, err) = loadgen(&[&common[..], &["--op", "acquire", "--keys", "10"]].concat());
    assert!(ok, "{err}");
    assert!(number(&json, "acquire", "locked") > 100.0, "{json}");
}

#[test]
fn refuses_remote_targets_and_bad_flags() {
    let (ok, _, err) = loadgen(&["--target", "tenure://192.0.2.1:7878", "--duration", "1s"]);
    assert!(!ok && err.contains("--allow-remote"), "{err}");
    let (ok, _, err) = loadgen(&["--target", "http://127.0.0.1:1"]);
    assert!(!ok && err.contains("tenure://"), "{err}");
    let (ok, _, _) = loadgen(&["--pipeline", "0"]);
    assert!(!ok);
}

/// Kills the Redis server it names when the test ends, pass or fail.
struct RedisChild(std::process::Child);

impl Drop for RedisChild {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Needs the external program `redis-server` (`.ci/run` installs it with apt-get). Without
/// it this test fails, naming what to install: a comparison test that passes without the
/// thing it compares against would prove nothing.
#[test]
fn redis_recipes_against_a_real_redis_server() {
    let version = Command::new("redis-server").arg("--version").output();
    assert!(
        version.is_ok(),
        "this test needs redis-server on PATH (Debian: apt-get install -y redis-server)"
    );
    let port = tenure_testkit::free_port();
    let _redis = RedisChild(
        Command::new("redis-server")
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
            ])
            .args(["--appendonly", "no"])
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let addr = format!("127.0.0.1:{port}");
    for _ in 0..100 {
        if std::net::TcpStream::connect(&addr).is_ok() {
            break;
        }
        // Real time: redis-server is a process of its own, starting up.
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let target = format!("redis://{addr}");
    let common = [&max_scenario(&target)[..], &["--op", "mixed"]].concat();
    for fenced in [false, true] {
        let flags: &[&str] = if fenced { &["--redis-fenced"] } else { &[] };
        let (ok, json, err) = loadgen(&[&common[..], flags].concat());
        assert!(ok, "{err}");
        assert!(
            number(&json, "summary", "cycles_completed") > 100.0,
            "{json}"
        );
        assert_eq!(number(&json, "summary", "cycles_failed"), 0.0, "{json}");
        assert!(json.contains("\"errors\":{}"), "{json}");
    }
}
