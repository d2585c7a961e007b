//! The driver: connect, run the scenario on one thread, place the measured window, report.
//!
//! ```text
//!  connect   setup (pre-acquired locks)   ramp + warmup    measured window     drain
//!  |---------|----------------------------|----------------|-------------------|------|
//!            t0                           ready            window start        end
//! ```
//!
//! The whole run is one current-thread runtime: the server under test gets the other core, and
//! one thread needs no locks around the histograms and the scenario's state.

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use tenure_protocol::LeaseKind;
use tokio::sync::Notify;

use crate::args::{millis_u32, Args, Scenario as Which};
use crate::cluster;
use crate::conn::Conn;
use crate::procfs;
use crate::progress::Progress;
use crate::report::{self, Report, Value};
use crate::scenario::{closed, contention, estimate, Rng, Scenario};
use crate::socket;
use crate::stats::Stats;
use crate::target::{Kind, Security, SetupTimes, Stream, Target};
use crate::world::World;

/// Longest time setup (connecting aside) may take before the run gives up.
const SETUP_MAX: Duration = Duration::from_secs(120);
/// Longest time one connection and its setup (TLS, handshake, AUTH) may take.
const CONNECT_MAX: Duration = Duration::from_secs(10);
/// Longest wait for a tenure cluster's leader before a run starts (an election may be on).
const LEADER_WAIT_MAX: Duration = Duration::from_secs(10);
/// A thread that wakes the driver every `period`: tokio's timers have millisecond resolution,
/// which would send an open loop's ops in 1 ms bursts and add up to a millisecond of lag to
/// each; a plain thread sleeping 100 us spreads them ten times finer for a few percent of a core.
struct Ticker {
    notify: Arc<Notify>,
    stop: Arc<AtomicBool>,
}

impl Ticker {
    fn start(period: Duration) -> Ticker {
        let notify = Arc::new(Notify::new());
        let stop = Arc::new(AtomicBool::new(false));
        let (n, s) = (notify.clone(), stop.clone());
        std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                std::thread::sleep(period);
                n.notify_one();
            }
        });
        Ticker { notify, stop }
    }
}

impl Drop for Ticker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn build_scenario(
    args: &Args,
    conns: usize,
    pipeline: usize,
    redis: bool,
) -> anyhow::Result<Box<dyn Scenario>> {
    let seed = args.seed.unwrap_or_else(rand::random);
    let rng = Rng::new(seed);
    let ttl_ms = millis_u32(args.ttl, "--ttl")?;
    Ok(match args.scenario {
        Which::Estimate => Box::new(estimate::Estimate::new(
            estimate::Settings {
                rate: args.rate,
                hold_ns: args.hold().as_nanos() as u64,
                renew_every_ns: args.renew_every.as_nanos() as u64,
                ttl_ms,
                keys: args.keys(),
                connections: conns,
                sessions: args.sessions(),
            },
            rng,
        )),
        Which::Max => Box::new(closed::Closed::new(
            closed::Settings {
                op: args.op,
                keys: args.keys(),
                ttl_ms,
                connections: conns,
                pipeline,
            },
            rng,
        )),
        Which::Contention | Which::Semaphore | Which::ReadMostly => {
            Box::new(contention(args, ttl_ms, conns, redis, rng)?)
        }
        Which::Failover | Which::Healthy => bail!("{:?} is not a load scenario", args.scenario),
    })
}

/// The contention workload of `--scenario contention`, `semaphore` or `read-mostly`.
fn contention(
    args: &Args,
    ttl_ms: u32,
    conns: usize,
    redis: bool,
    rng: Rng,
) -> anyhow::Result<contention::Contention> {
    let read_mostly = args.scenario == Which::ReadMostly;
    Ok(contention::Contention::new(
        contention::Settings {
            clients: args.clients,
            keys: args.keys(),
            ttl_ms,
            wait_ms: if redis {
                0
            } else {
                millis_u32(args.wait, "--wait")?
            },
            hold_ns: args.hold().as_nanos() as u64,
            retry_ns: args.retry.as_nanos() as u64,
            connections: conns,
            kind: args.lease_kind(),
            write_ratio: read_mostly.then_some(args.write_ratio),
        },
        rng,
    ))
}

/// Resource figures taken at one instant.
#[derive(Clone, Copy, Default)]
struct Snapshot {
    at_ns: u64,
    own_ticks: Option<u64>,
    server_ticks: Option<u64>,
    server_rss: Option<u64>,
    held: u64,
}

fn snapshot(world: &World, server_pid: Option<u32>) -> Snapshot {
    Snapshot {
        at_ns: world.now_ns(),
        own_ticks: procfs::cpu_ticks(None),
        server_ticks: server_pid.and_then(|p| procfs::cpu_ticks(Some(p))),
        server_rss: server_pid.and_then(procfs::rss_bytes),
        held: world.scenario.held(),
    }
}

/// Runs the configured scenario to the end and returns its report.
///
/// # Errors
/// When the target cannot be reached, a connection breaks, or the target falls so far behind
/// that the run cannot be measured.
pub async fn run(args: Args) -> anyhow::Result<Report> {
    let mut target = Target::parse(&args.target, args.allow_remote).await?;
    if target.kind == Kind::Tenure && target.addrs.len() > 1 {
        // A tenure cluster: only its leader serves, so every connection goes there.
        let security = Security::from_flags(&args, &target)?;
        target.addr = cluster::tenure_leader(&target.addrs, security, LEADER_WAIT_MAX).await?;
    }
    let redis = target.kind != Kind::Tenure;
    let server_rss_start = args.server_pid.and_then(procfs::rss_bytes);
    if args.server_pid.is_some() && server_rss_start.is_none() {
        bail!("cannot read /proc/{}/status", args.server_pid.unwrap_or(0));
    }
    let security = Security::from_flags(&args, &target)?;
    let mut conns = Vec::with_capacity(args.connections);
    let mut streams = Vec::with_capacity(args.connections);
    let mut setups = Vec::with_capacity(args.connections);
    let mut pipeline = args.pipeline;
    if args.contends() {
        // Every client has at most one op in flight; all of a connection's must fit, or a
        // release could queue behind acquires that wait for it.
        pipeline = pipeline.max(args.clients.div_ceil(args.connections));
    }
    // One at a time, so each connection's setup cost is measured without queueing behind
    // the others (the server verifies only a few AUTHs at once).
    for i in 0..args.connections {
        // etcd: every member serves (followers forward), and its own client spreads its
        // connections over the members, so these do too.
        let addr = match target.kind {
            Kind::Etcd => target.addrs[i % target.addrs.len()],
            _ => target.addr,
        };
        let connect = target.connect_to(addr, args.redis_fenced, &security);
        let connected = tokio::time::timeout(CONNECT_MAX, connect)
            .await
            .with_context(|| format!("no setup with {addr} within {CONNECT_MAX:?}"))??;
        pipeline = pipeline.min(connected.in_flight_max);
        streams.push(connected.stream);
        let proto =
            (connected.proto.with_acquire_ids(args.acquire_ids)).with_sessions(args.sessions() > 0);
        conns.push(proto.with_kind(args.lease_kind()));
        setups.push(connected.setup);
    }
    let scenario = build_scenario(&args, args.connections, pipeline, redis)?;
    let conns = conns.into_iter().map(|p| Conn::new(p, pipeline)).collect();
    let world = Rc::new(RefCell::new(World::new(conns, Stats::default(), scenario)));
    for (index, stream) in streams.into_iter().enumerate() {
        spawn_tasks(&world, index, stream);
    }
    let (begin, end) = drive(&world, &args).await?;
    let w = world.borrow();
    let window_s = (end.at_ns - begin.at_ns) as f64 / 1e9;
    Ok(Report {
        settings: settings(&args, pipeline, target.kind == Kind::Redis),
        window_s,
        kinds: report::kinds(&w.stats, window_s, w.scenario.target_rates()),
        summary: w.scenario.summary(window_s),
        resources: resources(&begin, &end, server_rss_start, w.outstanding()),
        setup: setup_report(&setups),
        errors: w
            .stats
            .errors
            .iter()
            .map(|(k, v)| (k.clone(), *v))
            .collect(),
    })
}

/// Starts connection `index`'s reader and writer. Plain TCP splits into owned halves, which
/// share no lock; TLS needs `tokio::io::split`, whose halves take turns on one lock.
fn spawn_tasks(world: &Rc<RefCell<World>>, index: usize, stream: Stream) {
    match stream {
        Stream::Plain(stream) => {
            let (read, write) = stream.into_split();
            tokio::task::spawn_local(socket::reader(world.clone(), index, read));
            tokio::task::spawn_local(socket::writer(world.clone(), index, write));
        }
        Stream::Tls(stream) => {
            let (read, write) = tokio::io::split(*stream);
            tokio::task::spawn_local(socket::reader(world.clone(), index, read));
            tokio::task::spawn_local(socket::writer(world.clone(), index, write));
        }
    }
}

/// Per-connection setup cost: connect to ready, and the TLS and AUTH parts of it.
fn setup_report(setups: &[SetupTimes]) -> Vec<(&'static str, Value)> {
    /// Median and maximum of some nanosecond figures, in milliseconds.
    fn p50_max_ms(mut ns: Vec<u64>) -> Option<(Value, Value)> {
        ns.sort_unstable();
        let max = *ns.last()?;
        let p50 = ns[(ns.len() - 1) / 2];
        Some((Value::F64(p50 as f64 / 1e6), Value::F64(max as f64 / 1e6)))
    }
    let parts = [
        (
            "connect_to_ready_p50_ms",
            "connect_to_ready_max_ms",
            setups.iter().map(|s| Some(s.total_ns)).collect::<Vec<_>>(),
        ),
        (
            "tls_handshake_p50_ms",
            "tls_handshake_max_ms",
            setups.iter().map(|s| s.tls_ns).collect(),
        ),
        (
            "auth_p50_ms",
            "auth_max_ms",
            setups.iter().map(|s| s.auth_ns).collect(),
        ),
    ];
    let mut out = vec![("connections", Value::U64(setups.len() as u64))];
    for (p50_name, max_name, part) in parts {
        if let Some((p50, max)) = p50_max_ms(part.into_iter().flatten().collect()) {
            out.push((p50_name, p50));
            out.push((max_name, max));
        }
    }
    out
}

/// The settings echoed in the report.
fn settings(args: &Args, pipeline: usize, redis: bool) -> Vec<(&'static str, Value)> {
    let mut settings = vec![
        ("target", Value::Str(args.target.clone())),
        (
            "scenario",
            Value::Str(format!("{:?}", args.scenario).to_lowercase()),
        ),
        ("connections", Value::U64(args.connections as u64)),
        ("pipeline", Value::U64(pipeline as u64)),
    ];
    match args.scenario {
        Which::Estimate => settings.extend([
            ("rate", Value::F64(args.rate)),
            ("hold_s", Value::F64(args.hold().as_secs_f64())),
            ("ttl_s", Value::F64(args.ttl.as_secs_f64())),
            ("renew_every_s", Value::F64(args.renew_every.as_secs_f64())),
            ("sessions", Value::U64(args.sessions() as u64)),
            (
                "session_leases",
                Value::U64(args.session_leases.unwrap_or(0)),
            ),
        ]),
        Which::Max => settings.push(("op", Value::Str(format!("{:?}", args.op).to_lowercase()))),
        Which::Contention | Which::Semaphore | Which::ReadMostly => settings.extend([
            ("clients", Value::U64(args.clients as u64)),
            ("hold_ms", Value::F64(args.hold().as_secs_f64() * 1e3)),
        ]),
        Which::Failover | Which::Healthy => {}
    }
    if redis {
        settings.push(("redis_fenced", Value::Str(args.redis_fenced.to_string())));
    }
    if args.acquire_ids {
        settings.push(("acquire_ids", Value::Str("true".to_owned())));
    }
    if args.scenario == Which::ReadMostly {
        settings.push(("write_ratio", Value::F64(args.write_ratio)));
    }
    match args.lease_kind() {
        LeaseKind::Exclusive => {}
        LeaseKind::Shared => settings.push(("lease_kind", Value::Str("shared".to_owned()))),
        LeaseKind::Permits { count, limit } => {
            let permits = format!("permits={count}/{limit}");
            settings.push(("lease_kind", Value::Str(permits)));
        }
    }
    let transport = match (&args.tls_ca, &args.tls_client_cert) {
        (None, _) => "tcp",
        (Some(_), None) => "tls",
        (Some(_), Some(_)) => "mutual-tls",
    };
    settings.push(("transport", Value::Str(transport.to_owned())));
    if let Some(name) = &args.identity {
        settings.push(("identity", Value::Str(name.clone())));
    }
    settings
}

/// Ticks the scenario until the window closed and replies drained; returns the resource
/// snapshots at the window's start and end.
async fn drive(world: &Rc<RefCell<World>>, args: &Args) -> anyhow::Result<(Snapshot, Snapshot)> {
    world.borrow_mut().start_scenario();
    let ticker = Ticker::start(args.tick);
    let mut window: Option<(u64, u64)> = None;
    let mut begin: Option<Snapshot> = None;
    let mut end: Option<Snapshot> = None;
    let mut next_progress_ns = 1_000_000_000;
    let mut progress = Progress::new(args.quiet);
    loop {
        ticker.notify.notified().await;
        let mut w = world.borrow_mut();
        w.check_health()?;
        w.tick();
        let now_ns = w.now_ns();
        if window.is_none() {
            if w.scenario.ready() {
                let warmup = if w.scenario.skips_warmup() {
                    Duration::ZERO
                } else {
                    args.warmup
                };
                let start = now_ns + w.scenario.ramp_ns() + warmup.as_nanos() as u64;
                let span = (start, start + args.duration().as_nanos() as u64);
                w.stats.window_ns = Some(span);
                w.scenario.set_window(span.0, span.1);
                window = Some(span);
            } else if now_ns > SETUP_MAX.as_nanos() as u64 {
                bail!(
                    "setup did not finish within {SETUP_MAX:?} (errors so far: {:?})",
                    w.stats.errors
                );
            }
        }
        let (start_ns, end_ns) = window.unwrap_or((u64::MAX, u64::MAX));
        if begin.is_none() && now_ns >= start_ns {
            begin = Some(snapshot(&w, args.server_pid));
        }
        if end.is_none() && (now_ns >= end_ns || (begin.is_some() && w.scenario.finished())) {
            let snap = snapshot(&w, args.server_pid);
            if snap.at_ns < end_ns {
                // Ran out of work early: the window ends here.
                w.stats.window_ns = Some((start_ns, snap.at_ns));
            }
            end = Some(snap);
            w.stopping = true;
        }
        if now_ns >= next_progress_ns {
            next_progress_ns += 1_000_000_000;
            progress.line(&mut w, now_ns, window);
        }
        if let Some(e) = end {
            if w.outstanding() == 0 || now_ns >= e.at_ns + args.drain.as_nanos() as u64 {
                let begin = begin.context("window closed before it opened")?;
                return Ok((begin, e));
            }
        }
    }
}

fn resources(
    begin: &Snapshot,
    end: &Snapshot,
    server_rss_start: Option<u64>,
    unanswered: usize,
) -> Vec<(&'static str, Value)> {
    let window_s = (end.at_ns - begin.at_ns) as f64 / 1e9;
    let mut out = vec![
        ("locks_held_at_end", Value::U64(end.held)),
        ("unanswered_after_drain", Value::U64(unanswered as u64)),
    ];
    let cpu = |a: Option<u64>, b: Option<u64>| {
        let ticks = b?.checked_sub(a?)?;
        Some(Value::F64(
            100.0 * ticks as f64 / procfs::TICKS_PER_S / window_s,
        ))
    };
    if let Some(v) = cpu(begin.own_ticks, end.own_ticks) {
        out.push(("loadgen_cpu_pct_of_core", v));
    }
    if let Some(v) = cpu(begin.server_ticks, end.server_ticks) {
        out.push(("server_cpu_pct_of_core", v));
    }
    if let (Some(start), Some(rss)) = (server_rss_start, end.server_rss) {
        let growth = rss as i64 - start as i64;
        out.push(("server_rss_start_bytes", Value::U64(start)));
        out.push(("server_rss_end_bytes", Value::U64(rss)));
        out.push(("server_rss_growth_bytes", Value::F64(growth as f64)));
        // Growth per lock means something only when many locks are held at the end.
        if end.held >= 1000 {
            out.push((
                "server_bytes_per_held_lock",
                Value::F64(growth as f64 / end.held as f64),
            ));
        }
    }
    out
}

/// Starts the run on a current-thread runtime (see the module docs for why one thread).
///
/// # Errors
/// As [`run`].
pub fn run_blocking(args: Args) -> anyhow::Result<Report> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let local = tokio::task::LocalSet::new();
    local.block_on(&runtime, run(args))
}
