//! Clusters: the real `tenure-loadgen` against fake tenure members (a follower answers every
//! request `NOT_LEADER leader=<addr>` until, for the fail-over test, it takes over), and
//! against a real 3-member etcd. Real time: the load generator is a process of its own.

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use tenure_protocol::frame::{decode_request, encode_response, split_frame};
use tenure_protocol::handshake::{Hello, HelloAck, ServerLimits, VERSION};
use tenure_protocol::{ErrorCode, Response};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::end_to_end::{answer, loadgen, max_scenario, number, Locks};

/// A fake member: it follows (naming `leader`) until `leads_from`, then serves.
#[derive(Clone)]
struct Member {
    locks: Locks,
    leader: SocketAddr,
    leads_from: Arc<Mutex<Option<Instant>>>,
}

impl Member {
    fn reply(&self, request: tenure_protocol::Request) -> Response {
        let leads = self
            .leads_from
            .lock()
            .unwrap()
            .is_some_and(|t| Instant::now() >= t);
        if leads {
            return answer(&self.locks, request);
        }
        Response::Error {
            code: ErrorCode::NotLeader,
            message: format!("leader={}", self.leader),
        }
    }
}

async fn serve(mut stream: TcpStream, member: Member) {
    let mut input = BytesMut::new();
    while Hello::decode(&mut input).unwrap().is_none() {
        if stream.read_buf(&mut input).await.unwrap_or(0) == 0 {
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
            let response = member.reply(decode_request(opcode, body).unwrap());
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

/// Starts a fake member on a thread of its own (it lives until the test process ends);
/// `leads_from` says when it starts serving (`None`: never).
fn fake_member(leader: SocketAddr, leads_from: Option<Instant>) -> SocketAddr {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async move {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            tx.send(listener.local_addr().unwrap()).unwrap();
            let member = Member {
                locks: Locks::default(),
                leader,
                leads_from: Arc::new(Mutex::new(leads_from)),
            };
            loop {
                let (stream, _) = listener.accept().await.unwrap();
                stream.set_nodelay(true).unwrap();
                tokio::spawn(serve(stream, member.clone()));
            }
        });
    });
    rx.recv().unwrap()
}

#[test]
fn a_cluster_target_loads_the_member_that_serves() {
    let leader = fake_member("127.0.0.1:1".parse().unwrap(), Some(Instant::now()));
    let follower = fake_member(leader, None);
    let target = format!("tenure://{follower},{leader}");
    let (ok, json, err) = loadgen(&[&max_scenario(&target)[..], &["--op", "mixed"]].concat());
    assert!(ok, "{err}");
    assert!(
        number(&json, "summary", "cycles_completed") > 100.0,
        "{json}"
    );
    assert!(json.contains("\"errors\":{}"), "{json}");
}

/// Kills the child it holds when the test ends, pass or fail.
struct ChildGuard(Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn failover_kills_the_leader_and_times_the_next_grant() {
    // The "leader" process is a sleep whose pid the probe kills; the fake leader itself
    // keeps serving, but the probe must not ask it again. The follower takes over 1.5 s
    // after the test starts (after the probe's health check), and names the old leader
    // until then.
    let mut sleeper = ChildGuard(Command::new("sleep").arg("60").spawn().unwrap());
    let bystander = ChildGuard(Command::new("sleep").arg("60").spawn().unwrap());
    let takeover = Instant::now() + Duration::from_millis(1500);
    let leader = fake_member("127.0.0.1:1".parse().unwrap(), Some(Instant::now()));
    let follower = fake_member(leader, Some(takeover));
    let target = format!("tenure://{leader},{follower}");
    let pids = format!("{},{}", sleeper.0.id(), bystander.0.id());
    let started = Instant::now();
    let (ok, out, err) = loadgen(&[
        "--target",
        &target,
        "--scenario",
        "failover",
        "--pids",
        &pids,
        "--duration",
        "10s",
    ]);
    assert!(ok, "{err}");
    let line: serde_json::Value = serde_json::from_str(out.trim()).expect("one JSON line");
    assert_eq!(line["killed"], leader.to_string(), "{out}");
    assert_eq!(line["served_by"], follower.to_string(), "{out}");
    let failover_ms = line["failover_ms"].as_f64().unwrap();
    // Generous bounds: it cannot be served before the takeover, and must be soon after.
    let upper_ms = started.elapsed().as_secs_f64() * 1e3;
    assert!(failover_ms > 0.0 && failover_ms <= upper_ms, "{out}");
    assert!(Instant::now() >= takeover);
    let status = sleeper.0.wait().unwrap();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(
        status.signal(),
        Some(9),
        "the leader's process was sent SIGKILL"
    );
}

#[test]
fn a_cluster_target_with_no_member_serving_fails_in_bounded_time() {
    let nobody = fake_member("127.0.0.1:1".parse().unwrap(), None);
    let started = Instant::now();
    let target = format!("tenure://{nobody},{nobody}");
    let (ok, _, err) = loadgen(&[&max_scenario(&target)[..], &["--op", "mixed"]].concat());
    assert!(!ok && err.contains("served a grant"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(60));
}

/// Three etcd members on free loopback ports, killed when dropped.
struct Etcd {
    members: Vec<ChildGuard>,
    clients: Vec<u16>,
    _dir: tempfile::TempDir,
}

fn etcd_cluster() -> Etcd {
    let version = Command::new("etcd").arg("--version").output();
    assert!(
        version.is_ok(),
        "this test needs etcd on PATH (Debian: apt-get install -y etcd-server)"
    );
    let dir = tempfile::tempdir().unwrap();
    let clients: Vec<u16> = (0..3).map(|_| tenure_testkit::free_port()).collect();
    let peers: Vec<u16> = (0..3).map(|_| tenure_testkit::free_port()).collect();
    let initial: Vec<String> = (0..3)
        .map(|i| format!("e{i}=http://127.0.0.1:{}", peers[i]))
        .collect();
    let members = (0..3)
        .map(|i| {
            let client = format!("http://127.0.0.1:{}", clients[i]);
            let peer = format!("http://127.0.0.1:{}", peers[i]);
            ChildGuard(
                Command::new("etcd")
                    .args(["--name", &format!("e{i}")])
                    .arg("--data-dir")
                    .arg(dir.path().join(format!("e{i}")))
                    .args([
                        "--listen-client-urls",
                        &client,
                        "--advertise-client-urls",
                        &client,
                    ])
                    .args([
                        "--listen-peer-urls",
                        &peer,
                        "--initial-advertise-peer-urls",
                        &peer,
                    ])
                    .args(["--initial-cluster", &initial.join(",")])
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .unwrap(),
            )
        })
        .collect();
    Etcd {
        members,
        clients,
        _dir: dir,
    }
}

/// Needs the external program `etcd` (`.ci/run` installs it with apt-get); fails without it,
/// as the Redis test does.
#[test]
fn etcd_lock_cycles_and_failover_against_a_real_etcd_cluster() {
    let mut etcd = etcd_cluster();
    let addrs: Vec<String> = etcd
        .clients
        .iter()
        .map(|p| format!("127.0.0.1:{p}"))
        .collect();
    let target = format!("etcd://{}", addrs.join(","));
    let (ok, out, err) = loadgen(&[
        "--target",
        &target,
        "--scenario",
        "healthy",
        "--duration",
        "30s",
    ]);
    assert!(ok, "{err}");
    assert!(out.contains("\"healthy\":true"), "{out}");
    let (ok, json, err) = loadgen(&[&max_scenario(&target)[..], &["--op", "mixed"]].concat());
    assert!(ok, "{err}");
    assert!(number(&json, "summary", "cycles_completed") > 5.0, "{json}");
    assert_eq!(number(&json, "summary", "cycles_failed"), 0.0, "{json}");
    assert!(json.contains("\"errors\":{}"), "{json}");
    let pids: Vec<String> = etcd.members.iter().map(|m| m.0.id().to_string()).collect();
    let (ok, out, err) = loadgen(&[
        "--target",
        &target,
        "--scenario",
        "failover",
        "--pids",
        &pids.join(","),
        "--duration",
        "30s",
    ]);
    assert!(ok, "{err}");
    let line: serde_json::Value = serde_json::from_str(out.trim()).expect("one JSON line");
    let killed = line["killed"].as_str().unwrap().to_owned();
    let index = addrs
        .iter()
        .position(|a| *a == killed)
        .expect("a member was killed");
    let status = etcd.members[index].0.wait().unwrap();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(9), "{out}");
    assert!(line["failover_ms"].as_f64().unwrap() > 0.0, "{out}");
}
