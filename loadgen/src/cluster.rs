//! Clusters: finding a tenure cluster's leader, waiting until a cluster (tenure or etcd) is
//! healthy (`--scenario healthy`), and the fail-over probe (`--scenario failover`).
//!
//! The probe kills the leader itself, so the clock starts at the `kill -9`, not at some
//! instant another process wrote down: it finds the leader, sends SIGKILL to its process
//! (`--pids`, in the order of the target's addresses), then tries a lock acquire on the other
//! members, each attempt on a fresh connection bounded by `--attempt-timeout`, until one is
//! granted. tenure's followers answer `NOT_LEADER leader=<addr>` and the next attempt goes
//! there; etcd's followers forward to their leader, so attempts just go round the members.
//! The time printed runs from just before the kill to the grant's reply.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use bytes::{Bytes, BytesMut};
use tenure_protocol::{ErrorCode, Request, Response};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::args::{millis_u32, Args, Scenario};
use crate::etcd::{self, EtcdState, HttpReply};
use crate::op::{Op, OpKind, Outcome, KEY_PREFIX};
use crate::target::{tenure_ask, Kind, Security, Target};

/// Pause after an attempt that failed at once (refused connection, `leader=unknown`), so a
/// cluster without a leader is not spun on; it bounds how late a success is seen.
const RETRY_PAUSE: Duration = Duration::from_millis(10);
/// Most attempts one probe makes, whatever the time bound.
const ATTEMPTS_MAX: u64 = 100_000;
/// Lease length of the probe's grants: they are never released, so short.
const PROBE_TTL_MS: u32 = 2000;

/// How one attempt went.
#[derive(Debug, PartialEq, Eq)]
pub enum Answer {
    /// The lock was granted: the cluster serves.
    Granted,
    /// A tenure follower named the leader (or `None`: it knows none).
    Redirect(Option<SocketAddr>),
    /// Anything else: refused, an error, no answer in time.
    Failed(String),
}

/// Runs `--scenario healthy` or `--scenario failover` and prints its one-line JSON report.
///
/// # Errors
/// When the cluster does not become healthy, or serve again, within `--duration`.
pub fn run_blocking(args: Args) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let target = Target::parse(&args.target, args.allow_remote).await?;
        ensure!(
            target.kind != Kind::Redis,
            "--scenario {:?} is for tenure:// and etcd:// clusters",
            args.scenario
        );
        let deadline = Instant::now() + args.duration();
        let probe = Probe::new(&target, &args)?;
        let leader = probe.healthy(deadline).await?;
        let line = if args.scenario == Scenario::Failover {
            probe.failover(leader, &args.pids, deadline).await?
        } else {
            format!(
                "{{\"healthy\":true,\"leader\":\"{}\"}}",
                target.addrs[leader]
            )
        };
        println!("{line}");
        Ok(())
    })
}

/// What the probe needs of the flags.
struct Probe {
    kind: Kind,
    addrs: Vec<SocketAddr>,
    /// TLS and AUTH, as the run's own connections have them.
    security: Security,
    attempt_timeout: Duration,
    /// Key numbers of the probe's locks: random start, then counting up, so never reused.
    next_key: std::cell::Cell<u64>,
}

impl Probe {
    fn new(target: &Target, args: &Args) -> anyhow::Result<Probe> {
        millis_u32(args.attempt_timeout, "--attempt-timeout")?;
        Ok(Probe {
            kind: target.kind,
            addrs: target.addrs.clone(),
            security: Security::from_flags(args, target)?,
            attempt_timeout: args.attempt_timeout,
            next_key: std::cell::Cell::new(rand::random::<u64>() >> 8),
        })
    }

    fn key(&self) -> u64 {
        let key = self.next_key.get();
        self.next_key.set(key + 1);
        key
    }

    /// One acquire of a fresh key at `addr`, bounded by `--attempt-timeout`.
    async fn attempt(&self, addr: SocketAddr) -> Answer {
        let key = self.key();
        let asked = async {
            match self.kind {
                Kind::Etcd => etcd_acquire(addr, key).await,
                _ => tenure_acquire(addr, &self.security, key).await,
            }
        };
        match tokio::time::timeout(self.attempt_timeout, asked).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(e)) => Answer::Failed(format!("{e:#}")),
            Err(_) => Answer::Failed(format!("no answer within {:?}", self.attempt_timeout)),
        }
    }

    /// Waits until every member answers and one serves; returns the leader's index.
    async fn healthy(&self, deadline: Instant) -> anyhow::Result<usize> {
        let mut last = String::new();
        while Instant::now() < deadline {
            match self.check().await {
                Ok(leader) => return Ok(leader),
                Err(e) => last = format!("{e:#}"),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        bail!("the cluster was not healthy in time: {last}")
    }

    /// One look at every member: the leader's index if all answer and agree.
    async fn check(&self) -> anyhow::Result<usize> {
        if self.kind == Kind::Etcd {
            let leader = self.etcd_leader().await?;
            // The leader must also serve a lock, not just name itself.
            match self.attempt(self.addrs[leader]).await {
                Answer::Granted => return Ok(leader),
                other => bail!("etcd leader {}: {other:?}", self.addrs[leader]),
            }
        }
        let mut leader = None;
        let mut named = Vec::new();
        for (i, &addr) in self.addrs.iter().enumerate() {
            match self.attempt(addr).await {
                Answer::Granted => {
                    ensure!(leader.is_none(), "two members serve");
                    leader = Some(i);
                }
                Answer::Redirect(Some(to)) => named.push(to),
                other => bail!("{addr}: {other:?}"),
            }
        }
        let leader = leader.context("no member serves")?;
        let leader_addr = self.addrs[leader];
        ensure!(
            named.iter().all(|&to| to == leader_addr),
            "followers name {named:?}, not {leader_addr}"
        );
        Ok(leader)
    }

    /// The index of the member every etcd member names as leader.
    async fn etcd_leader(&self) -> anyhow::Result<usize> {
        let mut leader_id = None;
        let mut leader = None;
        for (i, &addr) in self.addrs.iter().enumerate() {
            let status = tokio::time::timeout(self.attempt_timeout, etcd_status(addr))
                .await
                .with_context(|| format!("{addr}: no status in time"))??;
            ensure!(status.leader != 0, "{addr} knows no leader");
            ensure!(
                leader_id.is_none_or(|id| id == status.leader),
                "members name different leaders"
            );
            leader_id = Some(status.leader);
            if status.member == status.leader {
                leader = Some(i);
            }
        }
        leader.context("no member is the leader its peers name")
    }

    /// Kills the leader, then tries the others until one grants; returns the report line.
    async fn failover(
        &self,
        leader: usize,
        pids: &[u32],
        deadline: Instant,
    ) -> anyhow::Result<String> {
        let pid = *pids
            .get(leader)
            .context("--pids has no process for the leader")?;
        let dead = self.addrs[leader];
        let alive: Vec<SocketAddr> = self.addrs.iter().copied().filter(|&a| a != dead).collect();
        let killed_at = Instant::now();
        kill(pid)?;
        let mut next = 0;
        let mut last = String::new();
        for attempts in 1..=ATTEMPTS_MAX {
            if Instant::now() >= deadline {
                break;
            }
            let addr = alive[next % alive.len()];
            match self.attempt(addr).await {
                Answer::Granted => {
                    let failover_ms = killed_at.elapsed().as_secs_f64() * 1e3;
                    return Ok(format!(
                        "{{\"failover_ms\":{failover_ms:.1},\"attempts\":{attempts},\
                         \"killed\":\"{dead}\",\"killed_pid\":{pid},\"served_by\":\"{addr}\"}}"
                    ));
                }
                Answer::Redirect(Some(to)) if to != dead && to != addr && alive.contains(&to) => {
                    // Straight to the member named, without a pause: it may serve already.
                    next = alive.iter().position(|&a| a == to).unwrap_or(next + 1);
                    continue;
                }
                Answer::Redirect(_) => last = format!("{addr}: no leader that serves"),
                Answer::Failed(why) => last = why,
            }
            next += 1;
            tokio::time::sleep(RETRY_PAUSE).await;
        }
        bail!("no grant after killing the leader {dead} (pid {pid}): {last}")
    }
}

/// The address of the member of a tenure cluster that serves grants, found within `within`
/// over connections with `security` (TLS, AUTH).
///
/// # Errors
/// When no member serves a grant in time.
pub async fn tenure_leader(
    addrs: &[SocketAddr],
    security: Security,
    within: Duration,
) -> anyhow::Result<SocketAddr> {
    let probe = Probe {
        kind: Kind::Tenure,
        addrs: addrs.to_vec(),
        security,
        attempt_timeout: Duration::from_secs(1),
        next_key: std::cell::Cell::new(rand::random::<u64>() >> 8),
    };
    let deadline = Instant::now() + within;
    let mut last = String::new();
    while Instant::now() < deadline {
        for &addr in addrs {
            match probe.attempt(addr).await {
                Answer::Granted => return Ok(addr),
                other => last = format!("{addr}: {other:?}"),
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bail!("no member of {addrs:?} served a grant within {within:?} (last: {last})")
}

/// Sends SIGKILL to `pid` (with kill(1): the load generator links no libc bindings).
fn kill(pid: u32) -> anyhow::Result<()> {
    let status = std::process::Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .context("running kill")?;
    ensure!(status.success(), "kill -9 {pid} failed: {status}");
    Ok(())
}

/// One tenure acquire of `job:{key}` at `addr`.
async fn tenure_acquire(addr: SocketAddr, security: &Security, key: u64) -> anyhow::Result<Answer> {
    let mut name = KEY_PREFIX.to_vec();
    name.extend_from_slice(key.to_string().as_bytes());
    let request = Request::Acquire {
        key: Bytes::from(name),
        ttl_ms: PROBE_TTL_MS,
        wait_ms: 0,
        release_on_disconnect: false,
        meta: Bytes::new(),
        acquire_id: None,
        kind: Default::default(),
        session_id: None,
    };
    Ok(match tenure_ask(addr, security, &request).await? {
        Response::Granted { .. } => Answer::Granted,
        Response::Error {
            code: ErrorCode::NotLeader,
            message,
        } => Answer::Redirect(leader_named(&message)),
        other => Answer::Failed(format!("{other:?}")),
    })
}

/// The address in a `NOT_LEADER` message (`leader=<addr>`), if it names one.
pub fn leader_named(message: &str) -> Option<SocketAddr> {
    message
        .split_whitespace()
        .find_map(|word| word.strip_prefix("leader="))
        .and_then(|addr| addr.parse().ok())
}

/// One etcd lock acquire (lease grant, then the create-if-absent txn) of `job:{key}` at `addr`.
async fn etcd_acquire(addr: SocketAddr, key: u64) -> anyhow::Result<Answer> {
    let op = Op {
        kind: OpKind::Acquire,
        key,
        lease: u128::from(key) << 1 | 1,
        ttl_ms: PROBE_TTL_MS,
        wait_ms: 0,
        tag: 0,
        intended_ns: 0,
        sent_ns: 0,
        lease_kind: None,
    };
    let replies = etcd_exchange(addr, |state, out| state.encode(&op, out)).await?;
    Ok(match etcd::outcome(&op, &replies) {
        Outcome::Granted { .. } => Answer::Granted,
        other => Answer::Failed(format!("{other:?}")),
    })
}

/// An etcd member's id and the leader it knows (0: none).
struct Status {
    member: u64,
    leader: u64,
}

async fn etcd_status(addr: SocketAddr) -> anyhow::Result<Status> {
    let replies = etcd_exchange(addr, |state, out| {
        state.request("/v3/maintenance/status", "{}", out);
    })
    .await?;
    let json = etcd::body_json(&replies[0])?;
    Ok(Status {
        member: etcd::int_field(&json["header"], "member_id")
            .context("status without member_id")?,
        leader: etcd::int_field(&json, "leader").unwrap_or(0),
    })
}

/// Connects to `addr`, writes what `encode` puts out, and reads the replies it waits for.
async fn etcd_exchange(
    addr: SocketAddr,
    encode: impl FnOnce(&mut EtcdState, &mut BytesMut),
) -> anyhow::Result<Vec<HttpReply>> {
    let mut stream = TcpStream::connect(addr)
        .await
        .with_context(|| format!("connecting to {addr}"))?;
    stream.set_nodelay(true)?;
    let mut state = EtcdState::new(&addr.to_string());
    let mut out = BytesMut::new();
    encode(&mut state, &mut out);
    stream.write_all(&out).await?;
    let mut input = BytesMut::with_capacity(4096);
    loop {
        if let Some(replies) = state.decode(&mut input)? {
            return Ok(replies);
        }
        if stream.read_buf(&mut input).await? == 0 {
            bail!("{addr} closed the connection before answering");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::leader_named;

    #[test]
    fn the_leader_is_read_from_a_not_leader_message() {
        assert_eq!(
            leader_named("leader=127.0.0.1:7879"),
            Some("127.0.0.1:7879".parse().unwrap())
        );
        assert_eq!(leader_named("leader=unknown"), None);
        assert_eq!(leader_named("not the leader"), None);
    }
}
