//! The nemesis harness for cluster mode (issue 11): three `tenured --cluster` processes
//! whose peer links cross a [`proxy::Proxy`], a seeded mixed load (plain locks, semaphore
//! permits, read and write leases, CHECKs: [`load`]) recording a client-side
//! [`history::History`], faults injected one after another (kill -9 of the leader, SIGSTOP
//! of the leader past the election timeout, a partition isolating the leader, a follower
//! restarted on a wiped data directory), and a [`checker`] over the history.
//!
//! [`run`] does it all and returns a [`Report`]; `server/tests/it/nemesis.rs` calls it.

pub mod checker;
pub mod cluster;
pub mod history;
pub mod load;
pub mod proxy;

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tenure::LeaseKind;

use checker::{Rule, Violation};
use cluster::{Cluster, NODES};
use history::History;
use load::LoadConfig;

/// Longest the cluster may take to grant again after a fault (or after its repair), on a
/// loaded machine; longer is reported as a violation.
pub const SERVE_WAIT_MAX: Duration = Duration::from_secs(10);
/// Longest the cluster may take to have a leader named by every node after a repair.
const SETTLE_WAIT_MAX: Duration = Duration::from_secs(20);
/// How long a paused or isolated leader stays so: well past the election timeout (default
/// 150 ms, an election within twice that), in ms.
const FAULT_HOLD_MS_RANGE: (u64, u64) = (600, 1500);
/// Quiet time between two faults, in ms, with the load running.
const GAP_MS_RANGE: (u64, u64) = (300, 1200);
/// Longest a wiped follower may take to catch up with the leader (its repair) before the
/// run counts it unavailable.
const CATCH_UP_WAIT_MAX: Duration = Duration::from_secs(20);
/// Load before the first fault, so leases are held when it strikes.
const WARM_UP: Duration = Duration::from_secs(1);

/// What a run does.
#[derive(Clone, Debug)]
pub struct Config {
    /// Faults injected; the first four are one of each kind.
    pub faults: usize,
    /// Seed of the fault schedule and of the load.
    pub seed: u64,
    /// Load client tasks.
    pub clients: usize,
    /// Keys the load contends for.
    pub keys: usize,
}

/// One kind of fault.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum FaultKind {
    /// `kill -9` of the leader, restarted on its data once the others serve.
    KillLeader,
    /// SIGSTOP of the leader, SIGCONT after a while past the election timeout.
    PauseLeader,
    /// Every peer link to and from the leader cut, then healed.
    IsolateLeader,
    /// A follower killed and restarted on a new, empty data directory.
    WipeFollower,
}

const KINDS: [FaultKind; 4] = [
    FaultKind::KillLeader,
    FaultKind::PauseLeader,
    FaultKind::IsolateLeader,
    FaultKind::WipeFollower,
];

/// What happened around one fault.
#[derive(Clone, Debug)]
pub struct Fault {
    /// The kind.
    pub kind: FaultKind,
    /// The node it struck (0-based).
    pub node: usize,
    /// When, from the start of the run.
    pub at: Duration,
    /// From the fault to the first acknowledged grant sent after it (`None`: not within
    /// [`SERVE_WAIT_MAX`]).
    pub serve: Option<Duration>,
    /// From the repair (restart, SIGCONT, heal, a wiped node caught up) to the first grant
    /// sent after it.
    pub serve_after_repair: Option<Duration>,
    /// A wiped follower: from its restart until it had caught up with the leader (`None`:
    /// not within [`CATCH_UP_WAIT_MAX`], or another kind of fault).
    pub catch_up: Option<Duration>,
}

/// The outcome of a run.
#[derive(Debug)]
pub struct Report {
    /// The configuration run.
    pub config: Config,
    /// Every fault, in order.
    pub faults: Vec<Fault>,
    /// Operations by kind of request and outcome, e.g. `acquire granted`.
    pub ops: BTreeMap<String, usize>,
    /// Every broken invariant; must be empty.
    pub violations: Vec<Violation>,
    /// Grants seen holding a key that no client was answered ([`checker::orphans`]): with
    /// acquire ids, which the `tenure` crate sends and retries with, there are none.
    pub orphans: Vec<String>,
    /// The load's ACQUIREs that ended with an unknown outcome: with acquire ids the crate
    /// sends them again until one answer settles them, so there are none while the cluster
    /// serves again within its retry window.
    pub acquires_unknown: usize,
    /// Wall time of the run.
    pub elapsed: Duration,
    /// Where the daemons' logs and the history were saved, when there were violations.
    pub saved: Option<PathBuf>,
}

/// Runs the cluster, the load and the faults; checks the history.
pub async fn run(bin: &Path, config: Config) -> Report {
    let started = Instant::now();
    let mut rng = StdRng::seed_from_u64(config.seed);
    let mut cluster = Cluster::start(bin).await;
    let addrs: Vec<String> = (0..NODES).map(|i| cluster.addr_list(i)).collect();
    let history = History::default();
    let stop = Arc::new(AtomicBool::new(false));
    let load = LoadConfig {
        clients: config.clients,
        keys: config.keys,
        seed: config.seed,
    };
    let workers = load::spawn(addrs.clone(), history.clone(), &load, stop.clone());
    let mut violations = Vec::new();
    if load::probe_grant(&addrs, &history, SETTLE_WAIT_MAX)
        .await
        .is_none()
    {
        violations.push(unavailable(
            "the cluster never granted after its start".into(),
        ));
    }
    tokio::time::sleep(WARM_UP).await;
    let mut first_kinds = KINDS;
    for i in (1..first_kinds.len()).rev() {
        first_kinds.swap(i, rng.random_range(0..=i));
    }
    let mut faults = Vec::new();
    for n in 0..config.faults {
        let kind = first_kinds
            .get(n)
            .copied()
            .unwrap_or_else(|| KINDS[rng.random_range(0..KINDS.len())]);
        let fault = inject(&mut cluster, &addrs, &history, kind, &mut rng, started).await;
        let lagging = kind == FaultKind::WipeFollower && fault.catch_up.is_none();
        if fault.serve.is_none() || fault.serve_after_repair.is_none() || lagging {
            violations.push(unavailable(format!("fault {n}: {fault:?}")));
        }
        if !cluster.wait_settled(SETTLE_WAIT_MAX).await {
            violations.push(unavailable(format!(
                "fault {n}: no settled leader after it"
            )));
        }
        load::inspect_all(&addrs[0], &history, config.keys).await;
        faults.push(fault);
        let gap = rng.random_range(GAP_MS_RANGE.0..=GAP_MS_RANGE.1);
        tokio::time::sleep(Duration::from_millis(gap)).await;
    }
    stop.store(true, Ordering::Relaxed);
    for worker in workers {
        let _ = worker.await;
    }
    let ops = history.snapshot();
    violations.extend(checker::check(&ops));
    let orphans = checker::orphans(&ops);
    let acquires_unknown = ops
        .iter()
        .filter(|op| op.client != history::PROBE_CLIENT)
        .filter(|op| matches!(op.kind, history::Kind::Acquire { .. }))
        .filter(|op| matches!(op.outcome, history::Outcome::Unknown(_)))
        .count();
    let failed = !violations.is_empty() || !orphans.is_empty() || acquires_unknown > 0;
    let saved = failed.then(|| save(&cluster, &ops, &faults, started, &config));
    Report {
        config,
        faults,
        ops: count_ops(&ops),
        violations,
        orphans,
        acquires_unknown,
        elapsed: started.elapsed(),
        saved,
    }
}

/// Saves the daemons' logs, the faults and the history (times in ms from the start of the
/// run) in a directory of their own under the system's temporary directory.
fn save(
    cluster: &Cluster,
    ops: &[history::Op],
    faults: &[Fault],
    started: Instant,
    config: &Config,
) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "tenure-nemesis-{}-{}",
        config.seed,
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).expect("create the nemesis directory");
    for entry in std::fs::read_dir(cluster.logs()).expect("read the log directory") {
        let path = entry.expect("a log").path();
        if let Some(name) = path.file_name() {
            let _ = std::fs::copy(&path, dir.join(name));
        }
    }
    let at = |t: Instant| t.saturating_duration_since(started).as_secs_f64() * 1000.0;
    let mut text = String::new();
    for f in faults {
        text.push_str(&format!("{:.1} fault {f:?}\n", f.at.as_secs_f64() * 1000.0));
    }
    for op in ops {
        text.push_str(&format!(
            "{:.1} {:.1} client={} key={} {:?} -> {:?}\n",
            at(op.sent),
            at(op.answered),
            op.client,
            op.key,
            op.kind,
            op.outcome
        ));
    }
    std::fs::write(dir.join("history.txt"), text).expect("write the history");
    dir
}

fn unavailable(detail: String) -> Violation {
    Violation {
        rule: Rule::Unavailable,
        key: String::new(),
        detail,
    }
}

/// Injects one fault of `kind`, repairs it, and measures the time to serve after each.
async fn inject(
    cluster: &mut Cluster,
    addrs: &[String],
    history: &History,
    kind: FaultKind,
    rng: &mut StdRng,
    started: Instant,
) -> Fault {
    let leader = cluster.wait_leader(SETTLE_WAIT_MAX).await.unwrap_or(0);
    let node = match kind {
        FaultKind::WipeFollower => (leader + rng.random_range(1..NODES)) % NODES,
        _ => leader,
    };
    let hold =
        Duration::from_millis(rng.random_range(FAULT_HOLD_MS_RANGE.0..=FAULT_HOLD_MS_RANGE.1));
    let struck = Instant::now();
    let mut catch_up = None;
    let probe = {
        let (addrs, history) = (addrs.to_vec(), history.clone());
        tokio::spawn(async move { load::probe_grant(&addrs, &history, SERVE_WAIT_MAX).await })
    };
    match kind {
        FaultKind::KillLeader => {
            cluster.kill9(node);
            let _ = probe_wait(&probe).await;
            cluster.restart(node);
        }
        FaultKind::PauseLeader => {
            cluster.pause(node, true);
            tokio::time::sleep(hold).await;
            cluster.pause(node, false);
        }
        FaultKind::IsolateLeader => {
            cluster.proxy.isolate(node);
            tokio::time::sleep(hold).await;
            cluster.proxy.heal();
        }
        FaultKind::WipeFollower => {
            cluster.wipe_and_restart(node);
            // Until it has caught up, the committed entries it held are on one node fewer
            // and it does not vote: the next fault must not come before (Raft tolerates one
            // lost node, not this and a leader's loss at once). Its catch-up is the repair.
            let restarted = Instant::now();
            if cluster.wait_caught_up(node, CATCH_UP_WAIT_MAX).await {
                catch_up = Some(restarted.elapsed());
            }
        }
    }
    let repaired = Instant::now();
    let _ = probe.await;
    let after_repair = load::probe_grant(addrs, history, SERVE_WAIT_MAX).await;
    let serve = history
        .first_grant_since(struck)
        .map(|t| t.duration_since(struck))
        .filter(|d| *d <= SERVE_WAIT_MAX);
    let serve_after_repair = after_repair.map(|_| {
        let first = history
            .first_grant_since(repaired)
            .expect("the probe's grant");
        first.duration_since(repaired)
    });
    Fault {
        kind,
        node,
        at: struck.duration_since(started),
        serve,
        serve_after_repair,
        catch_up,
    }
}

/// Waits for the probe task to finish, without consuming its handle.
async fn probe_wait(probe: &tokio::task::JoinHandle<Option<Instant>>) {
    let deadline = Instant::now() + SERVE_WAIT_MAX + Duration::from_secs(1);
    while !probe.is_finished() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn count_ops(ops: &[history::Op]) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for op in ops {
        let kind = match op.kind {
            history::Kind::Acquire {
                wait_ms,
                lease_kind,
                ..
            } => acquire_name(&op.key, lease_kind, wait_ms > 0),
            history::Kind::Renew { .. } => "renew",
            history::Kind::Release { .. } => "release",
            history::Kind::Inspect => "inspect",
            history::Kind::Check { .. } => "check",
        };
        let outcome = match &op.outcome {
            // "server error WAITERS_LIMIT: ..." counts as "Failed server error WAITERS_LIMIT".
            history::Outcome::Failed(why) => {
                format!("Failed {}", why.split(':').next().unwrap_or(""))
            }
            other => {
                let name = format!("{other:?}");
                name.split(['(', ' ', '{']).next().unwrap_or("").to_owned()
            }
        };
        *counts.entry(format!("{kind} {outcome}")).or_default() += 1;
    }
    counts
}

/// The name an ACQUIRE is counted under: `acquire` (a plain lock), `write` and `read` (a
/// read/write key's), `permits`; `-wait` when it waited in line.
fn acquire_name(key: &str, kind: LeaseKind, waits: bool) -> &'static str {
    match (kind, key.starts_with("rw"), waits) {
        (LeaseKind::Exclusive, false, false) => "acquire",
        (LeaseKind::Exclusive, false, true) => "acquire-wait",
        (LeaseKind::Exclusive, true, false) => "write",
        (LeaseKind::Exclusive, true, true) => "write-wait",
        (LeaseKind::Shared, _, false) => "read",
        (LeaseKind::Shared, _, true) => "read-wait",
        (LeaseKind::Permits { .. }, _, false) => "permits",
        (LeaseKind::Permits { .. }, _, true) => "permits-wait",
    }
}

/// The `q`-quantile of `sorted` (nearest rank).
fn quantile(sorted: &[Duration], q: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((sorted.len() as f64) * q).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

impl Report {
    /// The kinds of fault this run injected.
    pub fn kinds(&self) -> Vec<FaultKind> {
        let mut kinds: Vec<FaultKind> = self.faults.iter().map(|f| f.kind).collect();
        kinds.sort();
        kinds.dedup();
        kinds
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.config;
        writeln!(
            f,
            "nemesis: seed {} faults {} clients {} keys {} in {:.1?}",
            c.seed, c.faults, c.clients, c.keys, self.elapsed
        )?;
        let total: usize = self.ops.values().sum();
        writeln!(f, "operations: {total}")?;
        for (what, n) in &self.ops {
            writeln!(f, "  {what}: {n}")?;
        }
        writeln!(
            f,
            "time to serve (ms), from fault | from repair (wipes: | caught up): count p50 p99 max"
        )?;
        for kind in KINDS {
            let of_kind: Vec<&Fault> = self.faults.iter().filter(|x| x.kind == kind).collect();
            if of_kind.is_empty() {
                continue;
            }
            let line = |pick: fn(&Fault) -> Option<Duration>| {
                let mut ds: Vec<Duration> = of_kind.iter().filter_map(|x| pick(x)).collect();
                ds.sort();
                let [p50, p99, max] = [0.5, 0.99, 1.0].map(|q| quantile(&ds, q).as_millis());
                format!("{} {p50} {p99} {max}", ds.len())
            };
            let catch_up = if kind == FaultKind::WipeFollower {
                format!(" | caught up {}", line(|x| x.catch_up))
            } else {
                String::new()
            };
            writeln!(
                f,
                "  {kind:?} x{}: {} | {}{catch_up}",
                of_kind.len(),
                line(|x| x.serve),
                line(|x| x.serve_after_repair)
            )?;
        }
        writeln!(f, "violations: {}", self.violations.len())?;
        if let Some(dir) = &self.saved {
            writeln!(f, "  logs and history saved in {}", dir.display())?;
        }
        for v in self.violations.iter().take(20) {
            writeln!(f, "  {v}")?;
        }
        writeln!(
            f,
            "orphaned grants: {}; the load's ACQUIREs with an unknown outcome: {}",
            self.orphans.len(),
            self.acquires_unknown
        )?;
        for orphan in self.orphans.iter().take(20) {
            writeln!(f, "  {orphan}")?;
        }
        Ok(())
    }
}
