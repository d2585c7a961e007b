//! Identities: who may connect, which keys each may lock, which operations it may use, and
//! its quotas; read from a TOML file (`--identities`), reloaded on SIGHUP.
//!
//! ```toml
//! [[identity]]
//! name = "orders"
//! secret-hash = "$argon2id$v=19$m=19456,t=2,p=1$..."   # from `tenured hash-secret`
//! prefixes = ["orders/", "jobs/"]                      # "*" alone: every key
//! stats = false                                        # may use STATS
//! watch = true                                         # may use WATCH/UNWATCH
//! admin = false                                        # may change cluster membership
//! held-max = 1000                                      # optional quota
//! waiters-max = 100                                    # optional quota
//! connections-max = 50                                 # optional quota
//! sessions-max = 20                                    # optional quota
//! ```
//!
//! Secrets are stored only as argon2 PHC strings. A name the file does not hold is verified
//! against a dummy hash, so "no such identity" and "wrong secret" take the same time and get
//! the same reply. With no identities configured none of this runs: the connection layer
//! checks `Executor::identities` once per request and goes on.
//!
//! A hash's argon2 parameters are bounded ([`ARGON2_MEMORY_KIB_MAX`] and the others): the
//! file decides how much memory and time every AUTH costs, and [`VERIFIES_AT_ONCE_MAX`] of
//! them run at once, so an unbounded `m=` could ask for gigabytes.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};

mod throttle;

use argon2::password_hash::{PasswordHash, PasswordHasher, PasswordVerifier, SaltString};
use argon2::Argon2;
use serde::Deserialize;

use crate::log_limit::Sampled;

/// The prefix that stands for every key.
pub const PREFIX_ALL: &str = "*";
/// Bytes of random salt per hash.
const SALT_LEN: usize = 16;
/// Most AUTHs verified at once, server-wide. Each argon2 verification takes ~19 MiB and tens
/// of milliseconds of a core; unbounded, a flood of AUTHs would fill the blocking pool (512
/// threads) and gigabytes of memory. Beyond it AUTHs wait their turn.
pub const VERIFIES_AT_ONCE_MAX: usize = 4;
/// Most AUTHs of one peer address verified at once: half the server-wide places, so one
/// address cannot take them all. An AUTH holds one only while argon2 runs, never while its
/// spacing (see `throttle`) makes it wait, so a guesser's waiting AUTHs leave the places to
/// its neighbours at that address.
pub const PEER_VERIFIES_MAX: usize = 2;
/// An AUTH refused at once: its (peer address, name) has recent failures, and the turns
/// it spaces out are taken up to `throttle::SPACED_WAIT_MAX` ahead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Spaced;

/// Most memory, in KiB, a secret hash may ask argon2 for (`m=`): 64 MiB, over three times
/// what `tenured hash-secret` uses (19 MiB); [`VERIFIES_AT_ONCE_MAX`] verifications at once
/// then take at most 256 MiB.
pub const ARGON2_MEMORY_KIB_MAX: u32 = 64 * 1024;
/// Most passes over that memory a hash may ask for (`t=`; `tenured hash-secret` uses 2).
pub const ARGON2_TIME_COST_MAX: u32 = 16;
/// Most lanes a hash may ask for (`p=`; `tenured hash-secret` uses 1). Lanes are computed one
/// after the other here, so each adds time.
pub const ARGON2_LANES_MAX: u32 = 8;
/// Most memory times passes (KiB) a hash may ask for: what one verification costs in time,
/// bounded to four passes over the largest memory, about a quarter of a second of a core.
pub const ARGON2_WORK_KIB_MAX: u64 = 4 * ARGON2_MEMORY_KIB_MAX as u64;

const _: () = assert!(PEER_VERIFIES_MAX < VERIFIES_AT_ONCE_MAX);
const _: () =
    assert!(ARGON2_WORK_KIB_MAX <= ARGON2_MEMORY_KIB_MAX as u64 * ARGON2_TIME_COST_MAX as u64);
/// Parts of the table of identities' live leases (see `Identities::owners`).
const OWNER_SHARDS: usize = 64;

/// One identity as the file spells it.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
struct Entry {
    name: String,
    secret_hash: String,
    #[serde(default)]
    prefixes: Vec<String>,
    #[serde(default)]
    stats: bool,
    #[serde(default)]
    watch: bool,
    #[serde(default)]
    admin: bool,
    held_max: Option<usize>,
    waiters_max: Option<usize>,
    connections_max: Option<usize>,
    sessions_max: Option<usize>,
}

/// The whole file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    identity: Vec<Entry>,
}

/// One identity, parsed and checked.
#[derive(Debug)]
pub struct Identity {
    /// Its name, as AUTH gives it.
    pub name: String,
    /// The argon2 PHC string of its secret.
    secret_hash: String,
    /// Key prefixes it may use; `None`: every key.
    prefixes: Option<Vec<Vec<u8>>>,
    /// May use STATS.
    pub stats: bool,
    /// May use WATCH and UNWATCH.
    pub watch: bool,
    /// May change a cluster's membership (CLUSTER INIT, ADD, REMOVE).
    pub admin: bool,
    /// Most blocking acquires it may have waiting at once, over all its connections.
    pub waiters_max: Option<usize>,
    /// Most locks it may hold at once, over all its connections (a queued acquire holds a
    /// place too, so that a hand-off never takes it over).
    pub held_max: Option<usize>,
    /// Most connections authenticated as it at once: one identity cannot take every
    /// connection slot of the server.
    pub connections_max: Option<usize>,
    /// Most live sessions it may have opened at once, over all its connections (counted by
    /// the session table, which knows each session's owner).
    pub sessions_max: Option<usize>,
}

impl Identity {
    /// The argon2 PHC string of its secret: a connection authenticated with a secret stays
    /// so only while this is unchanged.
    pub fn secret_hash(&self) -> &str {
        &self.secret_hash
    }

    /// Every field as parsed, in one line that two nodes agree on exactly when their entries
    /// mean the same: what a cluster's configuration digest is taken over (CLUSTER STATUS).
    pub fn canonical(&self) -> String {
        // Destructured without `..`: a field added later must be added here too.
        let Identity {
            name,
            secret_hash,
            prefixes,
            stats,
            watch,
            admin,
            waiters_max,
            held_max,
            connections_max,
            sessions_max,
        } = self;
        // Written only when set, so a file without it has the digest of earlier builds (a
        // rolling upgrade compares digests across the two).
        let sessions_max = sessions_max.map_or(String::new(), |n| format!(" sessions_max={n}"));
        format!(
            "name={name:?} secret={secret_hash:?} prefixes={prefixes:?} stats={stats} \
             watch={watch} admin={admin} waiters_max={waiters_max:?} held_max={held_max:?} \
             connections_max={connections_max:?}{sessions_max}"
        )
    }

    /// Whether this identity may use `key`.
    pub fn allows_key(&self, key: &[u8]) -> bool {
        match &self.prefixes {
            None => true,
            Some(prefixes) => prefixes.iter().any(|p| key.starts_with(p)),
        }
    }
}

/// What one identity uses now, over all its connections; kept across reloads by name.
#[derive(Debug, Default)]
pub struct Usage {
    /// Blocking acquires waiting.
    pub waiters: AtomicUsize,
    /// Locks held, and acquires that will hold one if granted (see [`HeldPlace`]).
    pub held: AtomicUsize,
    /// Connections authenticated as the identity (see [`ConnectionPlace`]).
    pub connections: AtomicUsize,
}

/// One place of an identity's connections quota, held by an authenticated connection and
/// given back when dropped (the connection closes, or a reload ends its session).
#[derive(Debug)]
pub struct ConnectionPlace(Arc<Usage>);

impl Drop for ConnectionPlace {
    fn drop(&mut self) {
        self.0.connections.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Takes one place of `usage`'s connections quota if fewer than `max` are taken.
pub fn try_take_connection(usage: &Arc<Usage>, max: Option<usize>) -> Option<ConnectionPlace> {
    let max = max.unwrap_or(usize::MAX);
    usage
        .connections
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
            (n < max).then_some(n + 1)
        })
        .ok()
        .map(|_| ConnectionPlace(Arc::clone(usage)))
}

/// One place of an identity's held-locks quota, given back when dropped: it lives in the
/// acquire being run, then in its waiter's slot while it waits in line, then in
/// [`Identities`]' table of owners for as long as the lease it became lives.
#[derive(Debug)]
pub struct HeldPlace(Arc<Usage>);

impl Drop for HeldPlace {
    fn drop(&mut self) {
        self.0.held.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Where an acquire's [`HeldPlace`] waits to be kept by a grant: shared by the acquire's
/// connection (for an immediate grant) and its waiter slot (for a hand-off), so that it is
/// given back only when both are done with it and neither made it a lease's.
pub type PlaceCell = Arc<Mutex<Option<HeldPlace>>>;

/// Takes the place out of `cell`, for a lease that keeps it.
pub fn take_place(cell: &PlaceCell) -> Option<HeldPlace> {
    cell.lock().expect("place cell poisoned").take()
}

/// Takes one place of `usage`'s held-locks quota if fewer than `max` are taken.
pub fn try_take_held(usage: &Arc<Usage>, max: Option<usize>) -> Option<HeldPlace> {
    let max = max.unwrap_or(usize::MAX);
    usage
        .held
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
            (n < max).then_some(n + 1)
        })
        .ok()
        .map(|_| HeldPlace(Arc::clone(usage)))
}

impl Usage {
    /// Takes one waiter place if fewer than `max` are taken.
    pub fn try_take_waiter(&self, max: Option<usize>) -> bool {
        let Some(max) = max else {
            self.waiters.fetch_add(1, Ordering::Relaxed);
            return true;
        };
        self.waiters
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < max).then_some(n + 1)
            })
            .is_ok()
    }

    /// Gives one waiter place back.
    pub fn give_back_waiter(&self) {
        self.waiters.fetch_sub(1, Ordering::Relaxed);
    }
}

type Table = HashMap<String, Arc<Identity>>;

/// The identities in force, swapped whole on reload.
pub struct Identities {
    path: PathBuf,
    table: RwLock<Arc<Table>>,
    usage: Mutex<HashMap<String, Arc<Usage>>>,
    /// The held-locks place of every live lease granted to an identity, by fencing token
    /// (unique per grant, and what expiry reports).
    /// Split in [`OWNER_SHARDS`] by token: one map of half a million leases growing in place
    /// would stall every grant and free behind its lock for milliseconds.
    owners: Box<[Mutex<HashMap<u64, HeldPlace>>]>,
    /// Verified against when the name is unknown, so the miss costs what a hit costs.
    dummy_hash: String,
    /// Places for verifications running at once (see [`VERIFIES_AT_ONCE_MAX`]).
    verifying: Arc<tokio::sync::Semaphore>,
    /// Bumped by every reload that took effect, so connections recheck their identity.
    generation: tokio::sync::watch::Sender<u64>,
    /// Recent failed AUTHs by peer address and name, which space out that bucket's next
    /// verifications.
    failures: Mutex<throttle::Throttle>,
    /// Verification places by peer address, for addresses with an AUTH in progress.
    peers_verifying: Mutex<HashMap<std::net::IpAddr, Arc<tokio::sync::Semaphore>>>,
    /// The log lines about failed AUTHs, and about connections closed for them: one a
    /// [`AUTH_FAILURE_LOG_PERIOD_MS`] each, so a stranger guessing cannot fill the disk.
    failures_logged: [Sampled; 2],
    /// The origin of `failures_logged`'s clock.
    started: std::time::Instant,
}

/// Shortest time between two log lines about failed AUTHs (and between two about
/// connections closed after too many), as for refused peer frames: a stranger sending
/// AUTHs of made-up names wrote a line each, 130 a second from one address (outside test
/// a38, F4). Each line says how many were left out since.
pub const AUTH_FAILURE_LOG_PERIOD_MS: u64 = 10_000;

/// Which of [`Identities::failure_logged`]'s lines.
#[derive(Clone, Copy, Debug)]
pub enum FailureLine {
    /// A failed AUTH.
    Failed = 0,
    /// A connection closed after too many failed AUTHs.
    Closed = 1,
}

/// What an AUTH from an address hands its verification: the throttle's bucket its failure
/// counts against, and its claim on the address's verification places.
struct Origin {
    bucket: throttle::Bucket,
    claim: PeerClaim,
}

/// An AUTH's claim on its peer address's verification places ([`PEER_VERIFIES_MAX`]), and
/// the place it holds while it has one. The address's entry in `peers_verifying` lives as
/// long as a claim on it does: the last claim to go removes it.
struct PeerClaim {
    identities: Arc<Identities>,
    peer: std::net::IpAddr,
    places: Arc<tokio::sync::Semaphore>,
    place: Option<tokio::sync::OwnedSemaphorePermit>,
}

impl PeerClaim {
    fn new(identities: &Arc<Identities>, peer: std::net::IpAddr) -> PeerClaim {
        let mut peers = identities
            .peers_verifying
            .lock()
            .expect("peers lock poisoned");
        let places = peers
            .entry(peer)
            .or_insert_with(|| Arc::new(tokio::sync::Semaphore::new(PEER_VERIFIES_MAX)));
        PeerClaim {
            identities: Arc::clone(identities),
            peer,
            places: Arc::clone(places),
            place: None,
        }
    }

    /// Waits for one of the address's places and holds it.
    async fn take_place(&mut self) {
        self.place = Arc::clone(&self.places).acquire_owned().await.ok();
    }

    /// Gives the place held back.
    fn leave_place(&mut self) {
        self.place = None;
    }
}

impl Drop for PeerClaim {
    fn drop(&mut self) {
        self.place = None;
        let mut peers = (self.identities.peers_verifying)
            .lock()
            .expect("peers lock poisoned");
        // Held by the map and by this claim only (a place held holds it too): no other
        // AUTH of the address is in progress.
        let last = peers
            .get(&self.peer)
            .is_some_and(|places| Arc::ptr_eq(places, &self.places))
            && Arc::strong_count(&self.places) == 2;
        if last {
            peers.remove(&self.peer);
        }
    }
}

impl std::fmt::Debug for Identities {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Identities")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl Identities {
    /// Reads the identities file at `path`.
    ///
    /// # Errors
    /// The file cannot be read, is not valid TOML, has an unknown key (named), or an entry
    /// is invalid (a bad hash, an empty prefix, a name given twice).
    pub fn load(path: &Path) -> Result<Identities, String> {
        let table = read(path)?;
        let dummy_hash = hash_secret(b"tenure-dummy-secret-for-unknown-names")?;
        Ok(Identities {
            path: path.to_path_buf(),
            table: RwLock::new(Arc::new(table)),
            usage: Mutex::new(HashMap::new()),
            owners: (0..OWNER_SHARDS).map(|_| Mutex::default()).collect(),
            dummy_hash,
            verifying: Arc::new(tokio::sync::Semaphore::new(VERIFIES_AT_ONCE_MAX)),
            generation: tokio::sync::watch::Sender::new(0),
            failures: Mutex::new(throttle::Throttle::default()),
            peers_verifying: Mutex::new(HashMap::new()),
            failures_logged: Default::default(),
            started: std::time::Instant::now(),
        })
    }

    /// Whether a `line` about a failed AUTH may be logged now: `Some` with how many such
    /// lines were left out since the last, or `None` (see [`AUTH_FAILURE_LOG_PERIOD_MS`]).
    pub fn failure_logged(&self, line: FailureLine) -> Option<u64> {
        let now_ms = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.failures_logged[line as usize].admit(now_ms, AUTH_FAILURE_LOG_PERIOD_MS)
    }

    /// Reads the file again and puts it in force; on error the identities in force stay.
    /// Returns how many identities are now in force.
    ///
    /// # Errors
    /// As [`Identities::load`].
    pub fn reload(&self) -> Result<usize, String> {
        let table = read(&self.path)?;
        let count = table.len();
        *self.table.write().expect("identities lock poisoned") = Arc::new(table);
        self.generation.send_modify(|g| *g += 1);
        Ok(count)
    }

    /// Changes whenever a reload takes effect: every connection then checks that its identity
    /// still exists with the same secret, and still allows its waits and watches.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.generation.subscribe()
    }

    /// Verifies an AUTH from `peer`, as [`Identities::verify_bounded`], after waiting its
    /// turn. A (peer address, name) with recent failures has its verifications spaced out
    /// (see `throttle`): each AUTH is given a turn as it arrives, and one whose turn would be
    /// more than `throttle::SPACED_WAIT_MAX` away is refused at once (`Err(Spaced)`), so no
    /// AUTH queues behind every guess of its bucket. The wait holds nothing, so it slows
    /// only the AUTHs of that address for that name. Then at most [`PEER_VERIFIES_MAX`]
    /// AUTHs of one address are verified at once, so a burst from one address cannot take
    /// every verification place. A failure is remembered against the (address, name); a
    /// success changes nothing.
    ///
    /// Once its verification has started, the AUTH's places and its failure belong to the
    /// verification, not to this future: dropped (its connection evicted or past its
    /// deadline), argon2 still runs to the end (a blocking task cannot be cancelled), keeps
    /// both places until then, and a failure still counts (outside test a43, K4: a flood
    /// evicted mid-verification was never counted, so its spacing never engaged). Dropped
    /// before that, it cost nothing and counts nothing.
    ///
    /// # Errors
    /// [`Spaced`] when the bucket's turns are taken up to the wait bound.
    pub async fn verify_from(
        self: Arc<Self>,
        peer: std::net::IpAddr,
        name: bytes::Bytes,
        secret: bytes::Bytes,
    ) -> Result<Option<Arc<Identity>>, Spaced> {
        let bucket = self.bucket(peer, &name);
        let mut claim = PeerClaim::new(&self, peer);
        // A turn is asked for with a place in hand, so that AUTHs of one bucket arriving
        // together are spaced as soon as the first of them failed; but a wait is sat out
        // without the place, which the neighbours need.
        claim.take_place().await;
        match self.verify_delay(&bucket) {
            throttle::Start::Now => {}
            throttle::Start::Full => return Err(Spaced),
            throttle::Start::After(wait) => {
                claim.leave_place();
                tokio::time::sleep(wait).await;
                claim.take_place().await;
            }
        }
        let origin = Origin { bucket, claim };
        Ok(self.verify_holding(name, secret, Some(origin)).await)
    }

    /// The throttle's bucket of an AUTH from `peer` giving `name`: the name if the identities
    /// in force hold it, else the empty name, shared by every unknown one.
    fn bucket(&self, peer: std::net::IpAddr, name: &[u8]) -> throttle::Bucket {
        let known = std::str::from_utf8(name)
            .ok()
            .filter(|n| self.get(n).is_some());
        (peer, known.unwrap_or_default().to_string())
    }

    /// When an AUTH of `bucket` may be verified: now for a bucket with no recent failures;
    /// otherwise at its turn, its verifications spaced out one after another.
    fn verify_delay(&self, bucket: &throttle::Bucket) -> throttle::Start {
        let now = std::time::Instant::now();
        self.failures
            .lock()
            .expect("failures lock poisoned")
            .try_start(bucket, now)
    }

    /// Records a failed AUTH of `bucket`.
    fn failed_from(&self, bucket: throttle::Bucket) {
        let now = std::time::Instant::now();
        self.failures
            .lock()
            .expect("failures lock poisoned")
            .failed(bucket, now);
    }

    /// The file the identities come from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The identity named `name` in the table in force now.
    pub fn get(&self, name: &str) -> Option<Arc<Identity>> {
        let table = self.table.read().expect("identities lock poisoned");
        table.get(name).cloned()
    }

    /// [`Identity::canonical`] of every identity in force, sorted.
    pub fn canonical_lines(&self) -> Vec<String> {
        let table = self.table.read().expect("identities lock poisoned");
        let mut lines: Vec<String> = table.values().map(|i| i.canonical()).collect();
        lines.sort_unstable();
        lines
    }

    /// The usage counters of `name`, made on first use.
    pub fn usage(&self, name: &str) -> Arc<Usage> {
        let mut usage = self.usage.lock().expect("usage lock poisoned");
        Arc::clone(usage.entry(name.to_string()).or_default())
    }

    /// Every identity in force, by name, with its locks held (places taken) and waiters now;
    /// for the metrics, whose labels are therefore bounded by the identities file.
    pub fn usage_by_identity(&self) -> Vec<(String, usize, usize)> {
        let names: Vec<String> = {
            let table = self.table.read().expect("identities lock poisoned");
            table.keys().cloned().collect()
        };
        let usage = self.usage.lock().expect("usage lock poisoned");
        let mut rows: Vec<_> = names
            .into_iter()
            .map(|name| {
                let (held, waiters) = usage.get(&name).map_or((0, 0), |u| {
                    (
                        u.held.load(Ordering::Relaxed),
                        u.waiters.load(Ordering::Relaxed),
                    )
                });
                (name, held, waiters)
            })
            .collect();
        rows.sort_unstable();
        rows
    }

    fn owners_of(&self, token: u64) -> &Mutex<HashMap<u64, HeldPlace>> {
        // Tokens are handed out in sequence, so consecutive ones spread over every shard.
        &self.owners[(token % OWNER_SHARDS as u64) as usize]
    }

    /// Records that the lease with fencing token `token` holds `place` until it ends.
    pub fn hold(&self, token: u64, place: HeldPlace) {
        let mut owners = self.owners_of(token).lock().expect("owners lock poisoned");
        owners.insert(token, place);
    }

    /// Every lease's place comes back: a new cluster leader's executor starts from the
    /// replicated leases, which count against no identity (as after a restart), and the
    /// places its predecessor's leases held here would otherwise never be given back.
    pub fn forget_held(&self) {
        for shard in self.owners.iter() {
            let places = std::mem::take(&mut *shard.lock().expect("owners lock poisoned"));
            drop(places); // after the lock, as in `ended`
        }
    }

    /// The lease with fencing token `token` ended: its place, if it had one, comes back.
    pub fn ended(&self, token: u64) {
        let place = self
            .owners_of(token)
            .lock()
            .expect("owners lock poisoned")
            .remove(&token);
        drop(place); // after the lock: giving back needs no lock
    }

    /// [`Identities::verify`] on a blocking thread, at most [`VERIFIES_AT_ONCE_MAX`] at once.
    pub async fn verify_bounded(
        self: Arc<Self>,
        name: bytes::Bytes,
        secret: bytes::Bytes,
    ) -> Option<Arc<Identity>> {
        self.verify_holding(name, secret, None).await
    }

    /// [`Identities::verify_bounded`], for an AUTH from `origin`'s address: the blocking task,
    /// which runs to the end even if this future is dropped, keeps the server-wide place and
    /// the address's until argon2 is done, so both bound the work actually running; and it
    /// records a failure against the (address, name) itself, before giving the address's
    /// place back (so the next AUTH of the bucket is spaced by it), whether or not anyone
    /// is still waiting for the answer. A failure nobody heard is logged here, sampled as the
    /// connections' failure lines are.
    async fn verify_holding(
        self: Arc<Self>,
        name: bytes::Bytes,
        secret: bytes::Bytes,
        origin: Option<Origin>,
    ) -> Option<Arc<Identity>> {
        let place = Arc::clone(&self.verifying).acquire_owned().await.ok()?;
        let (answer, answered) = tokio::sync::oneshot::channel();
        tokio::task::spawn_blocking(move || {
            let verified = self.verify(&name, &secret);
            drop(place);
            let Some(Origin { bucket, claim }) = origin else {
                let _ = answer.send(verified);
                return;
            };
            let failed = verified.is_none();
            let peer = bucket.0;
            if failed {
                self.failed_from(bucket);
            }
            drop(claim);
            if answer.send(verified).is_err() && failed {
                self.failure_unheard(peer, &name);
            }
        });
        answered.await.ok().flatten()
    }

    /// Logs (sampled) a failed AUTH from `peer` giving `name` whose connection was gone
    /// before its answer (evicted, or past its deadline): it counted all the same.
    fn failure_unheard(&self, peer: std::net::IpAddr, name: &[u8]) {
        if let Some(unlogged) = self.failure_logged(FailureLine::Failed) {
            let mut shown = String::new();
            tenure_protocol::console::escape(name, &mut shown); // the name only, never the secret
            let why = "authentication failed; its connection was gone before the answer";
            tracing::warn!(%peer, name = %shown, unlogged, "{why}");
        }
    }

    /// Checks `secret` against identity `name`; the identity if it matches. Slow on purpose
    /// (argon2): call it off the async workers. An unknown name is verified against a dummy
    /// hash so it takes as long as a wrong secret.
    pub fn verify(&self, name: &[u8], secret: &[u8]) -> Option<Arc<Identity>> {
        let name = std::str::from_utf8(name).ok();
        let identity = name.and_then(|n| self.get(n));
        let hash = identity
            .as_ref()
            .map_or(self.dummy_hash.as_str(), |i| i.secret_hash.as_str());
        let matches = verify_hash(hash, secret);
        identity.filter(|_| matches)
    }
}

fn verify_hash(hash: &str, secret: &[u8]) -> bool {
    // Hashes were parsed when the file was read; one that fails here matches nothing.
    PasswordHash::new(hash)
        .map(|parsed| Argon2::default().verify_password(secret, &parsed).is_ok())
        .unwrap_or(false)
}

/// Hashes `secret` with argon2id and a random salt, as a PHC string.
///
/// # Errors
/// argon2 refused the input (a secret over its length limit).
pub fn hash_secret(secret: &[u8]) -> Result<String, String> {
    let secret_len_max = tenure_protocol::limits::SECRET_LEN_MAX;
    if secret.len() > secret_len_max {
        return Err(format!(
            "the secret is {} bytes; AUTH takes at most {secret_len_max}",
            secret.len()
        ));
    }
    let salt: [u8; SALT_LEN] = rand::random();
    let salt = SaltString::encode_b64(&salt).map_err(|e| e.to_string())?;
    Argon2::default()
        .hash_password(secret, &salt)
        .map(|hash| hash.to_string())
        .map_err(|e| format!("cannot hash the secret: {e}"))
}

fn read(path: &Path) -> Result<Table, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read the identities file {}: {e}", path.display()))?;
    parse(&text).map_err(|e| format!("identities file {}: {e}", path.display()))
}

/// Parses an identities file's text.
///
/// # Errors
/// Invalid TOML, an unknown key (toml names it), or an invalid entry.
pub fn parse(text: &str) -> Result<HashMap<String, Arc<Identity>>, String> {
    let file: File = toml::from_str(text).map_err(|e| e.to_string())?;
    // An empty file is far more often a file caught mid-rewrite than a wish to let no one
    // in; and identities are switched off by a restart, not by a reload.
    if file.identity.is_empty() {
        return Err("no [[identity]] in the file".into());
    }
    let mut table = HashMap::new();
    for entry in file.identity {
        let name = entry.name.clone();
        let identity = check(entry).map_err(|e| format!("identity `{name}`: {e}"))?;
        if table.insert(name.clone(), Arc::new(identity)).is_some() {
            return Err(format!("identity `{name}` is given twice"));
        }
    }
    Ok(table)
}

fn check(entry: Entry) -> Result<Identity, String> {
    let name_len_max = tenure_protocol::limits::IDENTITY_NAME_LEN_MAX;
    // Printable ASCII without white space, quotes or backslashes: a name is a metric label
    // value and a log field, and must need no escaping in either.
    let printable = |c: char| c.is_ascii_graphic() && c != '"' && c != '\\';
    if entry.name.is_empty()
        || entry.name.len() > name_len_max
        || !entry.name.chars().all(printable)
    {
        return Err(format!(
            "a name must be 1 to {name_len_max} printable ASCII characters, without spaces, \
             quotes or backslashes"
        ));
    }
    check_hash(&entry.secret_hash)?;
    let prefixes = if entry.prefixes.iter().any(|p| p == PREFIX_ALL) {
        None
    } else if entry.prefixes.iter().any(String::is_empty) {
        return Err(format!(
            "an empty prefix is ambiguous; write \"{PREFIX_ALL}\" for every key"
        ));
    } else {
        Some(entry.prefixes.into_iter().map(String::into_bytes).collect())
    };
    Ok(Identity {
        name: entry.name,
        secret_hash: entry.secret_hash,
        prefixes,
        stats: entry.stats,
        watch: entry.watch,
        admin: entry.admin,
        waiters_max: entry.waiters_max,
        held_max: entry.held_max,
        connections_max: entry.connections_max,
        sessions_max: entry.sessions_max,
    })
}

/// Checks that `hash` is an argon2 PHC string whose parameters are within the bounds, so
/// that verifying against it costs what the bounds allow and no more.
fn check_hash(hash: &str) -> Result<(), String> {
    let parsed = PasswordHash::new(hash)
        .map_err(|e| format!("secret-hash is not a PHC string ({e}); see `tenured hash-secret`"))?;
    if argon2::Algorithm::try_from(parsed.algorithm).is_err() {
        return Err(format!(
            "secret-hash uses `{}`, not argon2; see `tenured hash-secret`",
            parsed.algorithm
        ));
    }
    let params = argon2::Params::try_from(&parsed)
        .map_err(|e| format!("secret-hash has bad argon2 parameters ({e})"))?;
    let (memory, time, lanes) = (params.m_cost(), params.t_cost(), params.p_cost());
    let bounds = [
        ("m (memory, KiB)", memory, ARGON2_MEMORY_KIB_MAX),
        ("t (passes)", time, ARGON2_TIME_COST_MAX),
        ("p (lanes)", lanes, ARGON2_LANES_MAX),
    ];
    for (what, value, max) in bounds {
        if value > max {
            return Err(format!(
                "secret-hash asks argon2 for {what} = {value}; this server takes at most \
                 {max} (`tenured hash-secret` makes m=19456,t=2,p=1)"
            ));
        }
    }
    let work = u64::from(memory) * u64::from(time);
    if work > ARGON2_WORK_KIB_MAX {
        return Err(format!(
            "secret-hash asks argon2 for m * t = {work} KiB of work; this server takes at \
             most {ARGON2_WORK_KIB_MAX} (`tenured hash-secret` makes m=19456,t=2,p=1)"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_need_no_escaping_and_secrets_fit_auth() {
        let hash = hash_secret(b"pw").unwrap();
        for bad in ["a b", "a\tb", "a\"b", "a\\b", ""] {
            let text = format!("[[identity]]\nname = {bad:?}\nsecret-hash = \"{hash}\"\n");
            assert!(parse(&text).is_err(), "{bad:?} accepted");
        }
        let text = format!("[[identity]]\nname = \"svc-a.b@c:d/e\"\nsecret-hash = \"{hash}\"\n");
        assert!(parse(&text).is_ok());
        assert!(parse("").unwrap_err().contains("no [[identity]]"));
        let long = vec![b'x'; tenure_protocol::limits::SECRET_LEN_MAX + 1];
        assert!(hash_secret(&long).unwrap_err().contains("at most"));
    }

    fn file(hash: &str, extra: &str) -> String {
        format!("[[identity]]\nname = \"a\"\nsecret-hash = \"{hash}\"\n{extra}\n")
    }

    #[test]
    fn hash_verifies_only_its_secret() {
        let hash = hash_secret(b"s3cret").unwrap();
        assert!(hash.starts_with("$argon2id$"), "{hash}");
        assert!(verify_hash(&hash, b"s3cret"));
        assert!(!verify_hash(&hash, b"s3cres"));
        assert_ne!(hash, hash_secret(b"s3cret").unwrap(), "salted");
    }

    #[test]
    fn prefixes_star_and_none() {
        let hash = hash_secret(b"x").unwrap();
        let table = parse(&file(&hash, "prefixes = [\"orders/\", \"jobs/\"]")).unwrap();
        let a = &table["a"];
        assert!(a.allows_key(b"orders/1") && a.allows_key(b"jobs/"));
        assert!(!a.allows_key(b"order") && !a.allows_key(b"x/orders/1"));
        let table = parse(&file(&hash, "prefixes = [\"*\"]")).unwrap();
        assert!(table["a"].allows_key(b"anything"));
        let table = parse(&file(&hash, "")).unwrap();
        assert!(!table["a"].allows_key(b"anything"), "no prefixes: no keys");
        let err = parse(&file(&hash, "prefixes = [\"\"]")).unwrap_err();
        assert!(err.contains("empty prefix"), "{err}");
    }

    #[test]
    fn unknown_keys_and_bad_hashes_are_errors() {
        let hash = hash_secret(b"x").unwrap();
        let err = parse(&file(&hash, "admn = true")).unwrap_err();
        assert!(err.contains("admn"), "{err}");
        let err = parse("[[identitty]]\n").unwrap_err();
        assert!(err.contains("identitty"), "{err}");
        let err = parse(&file("plain", "")).unwrap_err();
        assert!(err.contains("secret-hash"), "{err}");
        let twice = format!("{}{}", file(&hash, ""), file(&hash, ""));
        assert!(parse(&twice).unwrap_err().contains("twice"));
    }

    #[tokio::test]
    async fn bounded_verifies_all_finish_and_give_their_places_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ids.toml");
        std::fs::write(&path, file(&hash_secret(b"pw").unwrap(), "")).unwrap();
        let ids = Arc::new(Identities::load(&path).unwrap());
        let attempts = (0..VERIFIES_AT_ONCE_MAX * 2).map(|i| {
            let secret = if i % 2 == 0 { "pw" } else { "wrong" };
            let verify = Arc::clone(&ids).verify_bounded("a".into(), secret.into());
            tokio::spawn(verify)
        });
        let results: Vec<_> = futures_util::future::join_all(attempts).await;
        let names: Vec<_> = results.into_iter().map(Result::unwrap).collect();
        assert_eq!(
            names
                .iter()
                .filter(|n| n.as_ref().is_some_and(|i| i.name == "a"))
                .count(),
            VERIFIES_AT_ONCE_MAX
        );
        assert_eq!(ids.verifying.available_permits(), VERIFIES_AT_ONCE_MAX);
        assert!(ids.verify(b"nobody", b"pw").is_none());
    }

    /// A PHC string of `hash` with its parameters replaced by `params`.
    fn with_params(hash: &str, params: &str) -> String {
        let parts: Vec<&str> = hash.split('$').collect();
        assert!(parts[3].starts_with("m="), "{hash}");
        let mut parts = parts;
        parts[3] = params;
        parts.join("$")
    }

    #[test]
    fn argon2_parameters_over_the_bounds_are_refused_naming_them() {
        let hash = hash_secret(b"x").unwrap();
        assert!(
            parse(&file(&hash, "")).is_ok(),
            "hash-secret's own parameters"
        );
        let at_bounds = format!("m={ARGON2_MEMORY_KIB_MAX},t=4,p=1");
        assert!(parse(&file(&with_params(&hash, &at_bounds), "")).is_ok());
        for (params, named) in [
            ("m=4000000,t=100,p=1", "m (memory, KiB) = 4000000"),
            ("m=19456,t=100,p=1", "t (passes) = 100"),
            ("m=19456,t=2,p=64", "p (lanes) = 64"),
            ("m=65536,t=16,p=1", "m * t = 1048576"),
        ] {
            let err = parse(&file(&with_params(&hash, params), "")).unwrap_err();
            assert!(
                err.contains(named) && err.contains("at most"),
                "{params}: {err}"
            );
            assert!(err.contains("identity `a`"), "{err}");
        }
        let scrypt = "$scrypt$ln=16,r=8,p=1$aM15713r3Xsvxbi31lqr1Q$nFNh2CVHVjNldFVKDHDlm4CbdRSCdEBsjjJxD+iCs5E";
        let err = parse(&file(scrypt, "")).unwrap_err();
        assert!(err.contains("not argon2"), "{err}");
    }

    #[test]
    fn connection_places_count_exactly_and_come_back() {
        let usage = Arc::new(Usage::default());
        let a = try_take_connection(&usage, Some(2)).unwrap();
        let _b = try_take_connection(&usage, Some(2)).unwrap();
        assert!(try_take_connection(&usage, Some(2)).is_none());
        drop(a);
        assert!(try_take_connection(&usage, Some(2)).is_some());
        assert!(
            try_take_connection(&usage, None).is_some(),
            "no quota: no limit"
        );
        let text = file(&hash_secret(b"x").unwrap(), "connections-max = 3");
        assert_eq!(parse(&text).unwrap()["a"].connections_max, Some(3));
    }

    #[test]
    fn held_places_come_back_when_dropped() {
        let usage = Arc::new(Usage::default());
        let a = try_take_held(&usage, Some(1)).unwrap();
        assert!(try_take_held(&usage, Some(1)).is_none());
        drop(a);
        assert!(try_take_held(&usage, Some(1)).is_some());
        assert_eq!(usage.held.load(Ordering::Relaxed), 0);
    }

    /// Outside test a43, K4: an AUTH dropped mid-verification (its connection evicted) used to
    /// give its address's place back at once and count no failure, though argon2 ran on.
    #[tokio::test]
    async fn a_verification_whose_auth_was_dropped_holds_its_places_and_still_counts() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ids.toml");
        std::fs::write(&path, file(&hash_secret(b"pw").unwrap(), "")).unwrap();
        let ids = Arc::new(Identities::load(&path).unwrap());
        let peer: std::net::IpAddr = [127, 0, 0, 5].into();
        let verify = Arc::clone(&ids).verify_from(peer, "a".into(), "wrong".into());
        let auth = tokio::spawn(verify);
        while ids.verifying.available_permits() == VERIFIES_AT_ONCE_MAX {
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
        auth.abort();
        assert!(auth.await.unwrap_err().is_cancelled());
        // Read under the lock, without a clone of its `Arc` (which would keep the entry).
        let peers = &ids.peers_verifying;
        let peer_free = (peers.lock().unwrap().get(&peer)).map(|p| p.available_permits());
        // The server-wide place goes back first, so while it is taken the address's was too.
        if ids.verifying.available_permits() < VERIFIES_AT_ONCE_MAX {
            assert_eq!(
                peer_free,
                Some(PEER_VERIFIES_MAX - 1),
                "the address's place"
            );
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while ids.verifying.available_permits() < VERIFIES_AT_ONCE_MAX
            || !ids.peers_verifying.lock().unwrap().is_empty()
        {
            assert!(
                std::time::Instant::now() < deadline,
                "places never came back"
            );
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
        // The failure counted: that (address, name)'s next AUTHs are spaced.
        let bucket = ids.bucket(peer, b"a");
        assert_eq!(ids.verify_delay(&bucket), throttle::Start::Now);
        assert_ne!(ids.verify_delay(&bucket), throttle::Start::Now);
        assert_eq!(ids.verify_delay(&(peer, "b".into())), throttle::Start::Now);
    }

    #[test]
    fn waiter_quota_counts_exactly() {
        let usage = Usage::default();
        assert!(usage.try_take_waiter(Some(2)));
        assert!(usage.try_take_waiter(Some(2)));
        assert!(!usage.try_take_waiter(Some(2)));
        usage.give_back_waiter();
        assert!(usage.try_take_waiter(Some(2)));
    }
}
