//! The mixed load: client tasks over a small key set, each op recorded in the [`History`],
//! and the probes the harness sends after a fault.
//!
//! Every client takes plain locks (keys `k<n>`), permits of a semaphore (`sem<n>`, of
//! [`SEMAPHORE_LIMIT`] permits, 1 to all of them at once) and read or write leases of
//! read/write keys (`rw<n>`), the family drawn per acquire: the same clients share the three,
//! so the run lasts no longer. Holders also CHECK their tokens, and old ones.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tenure::{
    AcquireOptions, AcquireOutcome, CheckOutcome, Client, ClientConfig, KeyState, LeaseId,
    LeaseKind, ReleaseOutcome, RenewOutcome,
};

use super::history::{History, Kind, Op, Outcome, PROBE_CLIENT};

/// Shortest and longest TTL the load asks for, in ms.
const TTL_MS_RANGE: (u32, u32) = (1000, 3000);
/// How much longer than its TTL a blocking acquire waits, in ms.
const WAIT_BEYOND_TTL_MS_RANGE: (u32, u32) = (200, 2000);
/// Pause between two operations of one client, in ms.
const THINK_MS_RANGE: (u64, u64) = (10, 150);
/// A client's wait for one answer (a blocking acquire adds its wait).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
/// A client's wait for a connection.
const CONNECT_TIMEOUT: Duration = Duration::from_millis(500);
/// Released (or forgotten) leases a client keeps, to check now and then that they stay gone.
const RELEASED_KEPT: usize = 8;
/// Semaphore keys of the load (`sem<n>`), and their number of permits.
const SEMAPHORE_KEYS: usize = 1;
/// Permits of each semaphore key; a lease asks for 1 to all of them.
pub const SEMAPHORE_LIMIT: u32 = 3;
/// Read/write keys of the load (`rw<n>`).
const RW_KEYS: usize = 1;
/// Share of the acquires, in %, that go to semaphore keys, and to read/write keys (the rest to
/// plain keys); and of the read/write acquires, the share that write.
const SEMAPHORE_PCT: u32 = 30;
const RW_PCT: u32 = 30;
const RW_WRITE_PCT: u32 = 50;
const _: () = assert!(SEMAPHORE_PCT + RW_PCT < 100 && RW_WRITE_PCT <= 100);
const _: () = assert!(
    SEMAPHORE_LIMIT >= 2,
    "one permit is a plain lock: nothing shared"
);
/// TTL of a probe's grant: short, it only shows that the cluster grants.
const PROBE_TTL_MS: u32 = 200;
/// A probe's wait for a connection or an answer.
const PROBE_REQUEST_TIMEOUT: Duration = Duration::from_millis(300);
/// Pause between two probes.
const PROBE_PAUSE: Duration = Duration::from_millis(50);

/// How the load runs.
#[derive(Clone, Debug)]
pub struct LoadConfig {
    /// Client tasks.
    pub clients: usize,
    /// Keys they contend for.
    pub keys: usize,
    /// Seed of the clients' choices (client `i` uses `seed + i`).
    pub seed: u64,
}

fn config() -> ClientConfig {
    ClientConfig {
        request_timeout: REQUEST_TIMEOUT,
        connect_timeout: CONNECT_TIMEOUT,
        reconnect_delay_min: Duration::from_millis(20),
        reconnect_delay_max: Duration::from_millis(200),
        ..ClientConfig::default()
    }
}

/// A client of the cluster whose addresses are `addrs` (tried in that order).
async fn connect(addrs: &str) -> Option<Client> {
    Client::connect_with(addrs.to_owned(), config()).await.ok()
}

/// A probe's client: it gives up on a silent node sooner than the load does, so the time to
/// serve it measures is not mostly its own time-outs.
async fn connect_probe(addrs: &str) -> Option<Client> {
    let config = ClientConfig {
        request_timeout: PROBE_REQUEST_TIMEOUT,
        connect_timeout: PROBE_REQUEST_TIMEOUT,
        // A probe's ACQUIRE is sent again (with its acquire id) only within its own time-out:
        // the probe loop, not the client's retries, measures how long serving takes.
        acquire_retry_for: PROBE_REQUEST_TIMEOUT,
        ..config()
    };
    Client::connect_with(addrs.to_owned(), config).await.ok()
}

/// Starts the load; it runs until `stop` is set. `addrs[i]` lists the cluster's addresses
/// starting from a different node for each `i`.
pub fn spawn(
    addrs: Vec<String>,
    history: History,
    load: &LoadConfig,
    stop: Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<usize>> {
    (0..load.clients)
        .map(|i| {
            let worker = Worker {
                id: i,
                addrs: addrs.clone(),
                history: history.clone(),
                rng: StdRng::seed_from_u64(load.seed.wrapping_add(i as u64)),
                keys: load.keys,
                held: None,
                past: Vec::new(),
            };
            tokio::spawn(worker.run(stop.clone()))
        })
        .collect()
}

/// A lease a worker holds: key, id, token, and its local deadline.
struct Held {
    key: String,
    lease: LeaseId,
    token: u64,
    deadline: Instant,
}

/// A lease a worker held: released (`released`) or forgotten past its deadline.
struct Past {
    key: String,
    lease: LeaseId,
    token: u64,
    released: bool,
}

/// Every key of the load: the plain keys, then the semaphore and read/write keys.
pub fn all_keys(keys: usize) -> Vec<String> {
    let plain = (0..keys).map(|k| format!("k{k}"));
    let semaphores = (0..SEMAPHORE_KEYS).map(|k| format!("sem{k}"));
    plain
        .chain(semaphores)
        .chain((0..RW_KEYS).map(|k| format!("rw{k}")))
        .collect()
}

struct Worker {
    id: usize,
    addrs: Vec<String>,
    history: History,
    rng: StdRng,
    keys: usize,
    held: Option<Held>,
    past: Vec<Past>,
}

impl Worker {
    /// Runs until `stop`; returns the number of operations sent.
    async fn run(mut self, stop: Arc<AtomicBool>) -> usize {
        let mut sent = 0;
        let mut client: Option<Client> = None;
        let mut endpoint = self.id;
        while !stop.load(Ordering::Relaxed) {
            let Some(c) = client.clone() else {
                client = connect(&self.addrs[endpoint % self.addrs.len()]).await;
                endpoint += 1;
                if client.is_none() {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                continue;
            };
            let outcome = self.step(&c).await;
            sent += 1;
            if matches!(outcome, Outcome::Unknown(_)) {
                // A stopped or cut-off node keeps its connections open: start afresh, from
                // the next node.
                client = None;
            }
            let think = self.rng.random_range(THINK_MS_RANGE.0..=THINK_MS_RANGE.1);
            tokio::time::sleep(Duration::from_millis(think)).await;
        }
        sent
    }

    /// A key of one of the three families, and the lease to ask for on it.
    fn pick(&mut self) -> (String, LeaseKind) {
        let roll = self.rng.random_range(0..100);
        if roll < SEMAPHORE_PCT {
            let count = self.rng.random_range(1..=SEMAPHORE_LIMIT);
            let key = format!("sem{}", self.rng.random_range(0..SEMAPHORE_KEYS));
            let limit = SEMAPHORE_LIMIT;
            (key, LeaseKind::Permits { count, limit })
        } else if roll < SEMAPHORE_PCT + RW_PCT {
            let key = format!("rw{}", self.rng.random_range(0..RW_KEYS));
            if self.rng.random_range(0..100) < RW_WRITE_PCT {
                (key, LeaseKind::Exclusive)
            } else {
                (key, LeaseKind::Shared)
            }
        } else {
            let key = format!("k{}", self.rng.random_range(0..self.keys));
            (key, LeaseKind::Exclusive)
        }
    }

    /// Remembers a lease this worker no longer holds, for later RENEWs and CHECKs.
    fn remember(&mut self, held: &Held, released: bool) {
        self.past.push(Past {
            key: held.key.clone(),
            lease: held.lease,
            token: held.token,
            released,
        });
        if self.past.len() > RELEASED_KEPT {
            self.past.remove(0);
        }
    }

    fn ttl_ms(&mut self) -> u32 {
        self.rng.random_range(TTL_MS_RANGE.0..=TTL_MS_RANGE.1)
    }

    /// One operation, chosen by what the worker holds; returns its outcome.
    async fn step(&mut self, client: &Client) -> Outcome {
        if let Some(held) = self.held.take_if(|h| h.deadline <= Instant::now()) {
            // Ran out: forget it, as a holder that stopped working would.
            self.remember(&held, false);
        }
        let roll = self.rng.random_range(0..100);
        match self.held.take() {
            Some(held) if roll < 45 => self.renew(client, held).await,
            Some(held) if roll < 80 => self.release(client, held).await,
            Some(held) => {
                let (key, token) = (held.key.clone(), held.token);
                self.held = Some(held);
                if roll < 90 {
                    self.check(client, key, token).await
                } else {
                    self.inspect(client).await
                }
            }
            None if roll < 40 => self.acquire(client, 0).await,
            None if roll < 70 => {
                let extra = self
                    .rng
                    .random_range(WAIT_BEYOND_TTL_MS_RANGE.0..=WAIT_BEYOND_TTL_MS_RANGE.1);
                self.acquire(client, TTL_MS_RANGE.1 + extra).await
            }
            None if roll < 85 || self.past.is_empty() => self.inspect(client).await,
            None => self.revisit(client, roll % 2 == 0).await,
        }
    }

    fn record(&self, key: String, kind: Kind, sent: Instant, outcome: Outcome) -> Outcome {
        self.history.record(Op {
            client: self.id,
            key,
            kind,
            sent,
            answered: Instant::now(),
            outcome: outcome.clone(),
        });
        outcome
    }

    async fn acquire(&mut self, client: &Client, wait_ms: u32) -> Outcome {
        let ((key, lease_kind), ttl_ms) = (self.pick(), self.ttl_ms());
        let options = AcquireOptions::wait(Duration::from_millis(u64::from(wait_ms)));
        let ttl = Duration::from_millis(u64::from(ttl_ms));
        let sent = Instant::now();
        let outcome = match client.acquire_kind(&key, ttl, lease_kind, options).await {
            Ok(AcquireOutcome::Granted(lease)) => {
                let (waited, ttl) = (lease.waited(), lease.ttl());
                self.held = Some(Held {
                    key: key.clone(),
                    lease: lease.lease_id(),
                    token: lease.fencing_token(),
                    deadline: sent + waited + ttl,
                });
                Outcome::Granted {
                    token: lease.fencing_token(),
                    lease: lease.lease_id(),
                    ttl_ms: u32::try_from(ttl.as_millis()).unwrap_or(u32::MAX),
                    waited_ms: u32::try_from(waited.as_millis()).unwrap_or(u32::MAX),
                }
            }
            Ok(AcquireOutcome::Locked(by)) => Outcome::Locked { token: by.token },
            Err(e) => Outcome::from_error(&e),
        };
        let kind = Kind::Acquire {
            ttl_ms,
            wait_ms,
            lease_kind,
        };
        self.record(key, kind, sent, outcome)
    }

    async fn renew(&mut self, client: &Client, held: Held) -> Outcome {
        let ttl_ms = self.ttl_ms();
        let ttl = Duration::from_millis(u64::from(ttl_ms));
        let (key, lease) = (held.key.clone(), held.lease);
        let sent = Instant::now();
        let outcome = match client.renew(&key, lease, ttl).await {
            Ok(RenewOutcome::Renewed { ttl }) => {
                self.held = Some(Held {
                    deadline: sent + ttl, // a RENEW sets the TTL: it may shorten it
                    ..held
                });
                Outcome::Renewed {
                    ttl_ms: u32::try_from(ttl.as_millis()).unwrap_or(u32::MAX),
                }
            }
            Ok(RenewOutcome::Lost) => Outcome::Lost,
            Err(e) => {
                self.held = Some(held); // maybe still held: its deadline decides
                Outcome::from_error(&e)
            }
        };
        self.record(key, Kind::Renew { lease, ttl_ms }, sent, outcome)
    }

    async fn release(&mut self, client: &Client, held: Held) -> Outcome {
        let sent = Instant::now();
        let outcome = match client.release(&held.key, held.lease).await {
            Ok(ReleaseOutcome::Released) => Outcome::Released,
            Ok(ReleaseOutcome::NotOwner) => Outcome::NotOwner,
            Err(e) => Outcome::from_error(&e),
        };
        self.remember(&held, true);
        let kind = Kind::Release { lease: held.lease };
        self.record(held.key, kind, sent, outcome)
    }

    /// A CHECK of `token` on `key`: CURRENT while its lease holds the key.
    async fn check(&mut self, client: &Client, key: String, token: u64) -> Outcome {
        let sent = Instant::now();
        let outcome = match client.check(&key, token).await {
            Ok(CheckOutcome::Current) => Outcome::Current,
            Ok(CheckOutcome::Stale) => Outcome::Stale,
            Err(e) => Outcome::from_error(&e),
        };
        self.record(key, Kind::Check { token }, sent, outcome)
    }

    /// A lease this worker no longer holds, asked about again: a CHECK of its token (`check`,
    /// or a lease forgotten, not released) or a RENEW of a released one, which must stay gone.
    async fn revisit(&mut self, client: &Client, check: bool) -> Outcome {
        let at = self.rng.random_range(0..self.past.len());
        let past = &self.past[at];
        let (key, lease, token) = (past.key.clone(), past.lease, past.token);
        if check || !past.released {
            return self.check(client, key, token).await;
        }
        let ttl_ms = self.ttl_ms();
        let sent = Instant::now();
        let ttl = Duration::from_millis(u64::from(ttl_ms));
        let outcome = match client.renew(&key, lease, ttl).await {
            Ok(RenewOutcome::Renewed { ttl }) => Outcome::Renewed {
                ttl_ms: u32::try_from(ttl.as_millis()).unwrap_or(u32::MAX),
            },
            Ok(RenewOutcome::Lost) => Outcome::Lost,
            Err(e) => Outcome::from_error(&e),
        };
        self.record(key, Kind::Renew { lease, ttl_ms }, sent, outcome)
    }

    async fn inspect(&mut self, client: &Client) -> Outcome {
        let (key, _) = self.pick();
        let sent = Instant::now();
        let outcome = inspect_outcome(client.inspect(&key).await);
        self.record(key, Kind::Inspect, sent, outcome)
    }
}

fn inspect_outcome(answer: tenure::Result<KeyState>) -> Outcome {
    match answer {
        Ok(KeyState::Free) => Outcome::Free,
        Ok(KeyState::Held { token, .. }) => Outcome::Held { token },
        Err(e) => Outcome::from_error(&e),
    }
}

/// Acquires fresh keys (`probe/<n>`), one node after another, until one is granted or
/// `wait` has passed; every attempt goes into `history`. Returns the grant's answer instant.
pub async fn probe_grant(addrs: &[String], history: &History, wait: Duration) -> Option<Instant> {
    let deadline = Instant::now() + wait;
    let mut attempt = 0usize;
    while Instant::now() < deadline {
        attempt += 1;
        let Some(client) = connect_probe(&addrs[attempt % addrs.len()]).await else {
            tokio::time::sleep(PROBE_PAUSE).await;
            continue;
        };
        let key = format!("probe/{}", PROBE_SEQ.fetch_add(1, Ordering::Relaxed));
        let ttl = Duration::from_millis(u64::from(PROBE_TTL_MS));
        let sent = Instant::now();
        let answer = client.acquire(&key, ttl, AcquireOptions::default()).await;
        let outcome = match answer {
            Ok(AcquireOutcome::Granted(lease)) => Outcome::Granted {
                token: lease.fencing_token(),
                lease: lease.lease_id(),
                ttl_ms: PROBE_TTL_MS,
                waited_ms: u32::try_from(lease.waited().as_millis()).unwrap_or(u32::MAX),
            },
            Ok(AcquireOutcome::Locked(by)) => Outcome::Locked { token: by.token },
            Err(e) => Outcome::from_error(&e),
        };
        let granted = matches!(outcome, Outcome::Granted { .. });
        let kind = Kind::Acquire {
            ttl_ms: PROBE_TTL_MS,
            wait_ms: 0,
            lease_kind: LeaseKind::Exclusive,
        };
        let answered = Instant::now();
        history.record(Op {
            client: PROBE_CLIENT,
            key,
            kind,
            sent,
            answered,
            outcome,
        });
        if granted {
            return Some(answered);
        }
        tokio::time::sleep(PROBE_PAUSE).await;
    }
    None
}

/// Distinct probe keys across a run (and runs in one process).
static PROBE_SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// INSPECTs every key of the load ([`all_keys`]) once, through a fresh client, into `history`.
pub async fn inspect_all(addrs: &str, history: &History, keys: usize) {
    let Some(client) = connect(addrs).await else {
        return;
    };
    for key in all_keys(keys) {
        let sent = Instant::now();
        let outcome = inspect_outcome(client.inspect(&key).await);
        history.record(Op {
            client: PROBE_CLIENT,
            key,
            kind: Kind::Inspect,
            sent,
            answered: Instant::now(),
            outcome,
        });
    }
}

/// TTL of the steady load's grants: long enough to outlive a fail-over's re-sends.
const STEADY_TTL_MS: u32 = 5000;
/// The first client id of the steady load in the history (the mixed load's are below).
pub const STEADY_CLIENT_FIRST: usize = 1000;

/// Starts the steady load: `tasks` closed loops, each acquiring a key of its own (never
/// asked for before, so it is free) and releasing it at once, as fast as the cluster
/// answers, until `stop`; every operation goes into `history`. It keeps the leader's log,
/// replication and fsyncs busy while the faults strike, and its grants show how long the
/// cluster did not serve.
pub fn spawn_steady(
    addrs: Vec<String>,
    history: History,
    tasks: usize,
    stop: Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<usize>> {
    (0..tasks)
        .map(|i| {
            let (addrs, history, stop) = (addrs.clone(), history.clone(), stop.clone());
            tokio::spawn(steady(STEADY_CLIENT_FIRST + i, addrs, history, stop))
        })
        .collect()
}

async fn steady(id: usize, addrs: Vec<String>, history: History, stop: Arc<AtomicBool>) -> usize {
    let mut client: Option<Client> = None;
    let (mut endpoint, mut cycles) = (id, 0usize);
    let ttl = Duration::from_millis(u64::from(STEADY_TTL_MS));
    while !stop.load(Ordering::Relaxed) {
        let Some(c) = client.clone() else {
            client = connect(&addrs[endpoint % addrs.len()]).await;
            endpoint += 1;
            if client.is_none() {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            continue;
        };
        let key = format!("s{id}/{cycles}");
        cycles += 1;
        let kind = Kind::Acquire {
            ttl_ms: STEADY_TTL_MS,
            wait_ms: 0,
            lease_kind: LeaseKind::Exclusive,
        };
        let sent = Instant::now();
        let outcome = match c.acquire(&key, ttl, AcquireOptions::default()).await {
            Ok(AcquireOutcome::Granted(lease)) => Outcome::Granted {
                token: lease.fencing_token(),
                lease: lease.lease_id(),
                ttl_ms: STEADY_TTL_MS,
                waited_ms: u32::try_from(lease.waited().as_millis()).unwrap_or(u32::MAX),
            },
            Ok(AcquireOutcome::Locked(by)) => Outcome::Locked { token: by.token },
            Err(e) => Outcome::from_error(&e),
        };
        let answered = Instant::now();
        let lease = match &outcome {
            Outcome::Granted { lease, .. } => Some(*lease),
            _ => None,
        };
        let unknown = matches!(outcome, Outcome::Unknown(_));
        history.record(Op {
            client: id,
            key: key.clone(),
            kind,
            sent,
            answered,
            outcome,
        });
        if let Some(lease) = lease {
            steady_release(&c, id, key, lease, &history).await;
        } else if unknown {
            client = None;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    cycles
}

/// The steady load's release of the `lease` it was just granted on `key`, recorded.
async fn steady_release(
    client: &Client,
    id: usize,
    key: String,
    lease: LeaseId,
    history: &History,
) {
    let sent = Instant::now();
    let outcome = match client.release(&key, lease).await {
        Ok(ReleaseOutcome::Released) => Outcome::Released,
        Ok(ReleaseOutcome::NotOwner) => Outcome::NotOwner,
        Err(e) => Outcome::from_error(&e),
    };
    history.record(Op {
        client: id,
        key,
        kind: Kind::Release { lease },
        sent,
        answered: Instant::now(),
        outcome,
    });
}
