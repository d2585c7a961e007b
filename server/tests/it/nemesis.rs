//! The nemesis run of cluster mode (issue 11): three `tenured --cluster` daemons, peer links
//! through a proxy, a seeded mixed load, and the four faults (kill -9, SIGSTOP and SIGCONT
//! of the leader, a partition isolating it, a follower restarted wiped); the checker of
//! `tenure_testkit::nemesis` must find the client-side history consistent.
//!
//! Short by default (each fault kind once, and two more; what CI runs). A soak:
//! `TENURE_NEMESIS_FAULTS=500 TENURE_NEMESIS_SEED=7 cargo test -p tenure-server --test it
//! nemesis -- --nocapture` prints the report.

use tenure_testkit::nemesis::{self, Config, SERVE_WAIT_MAX};

use super::tenured_bin;

/// Faults of the short run: one of each kind, then two chosen by the seed.
const FAULTS_DEFAULT: usize = 6;
/// Seed of the short run, fixed so that CI runs one schedule.
const SEED_DEFAULT: u64 = 11;
/// Load clients and the keys they contend for.
const CLIENTS: usize = 6;
const KEYS: usize = 4;

fn env_number(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(text) => text
            .parse()
            .unwrap_or_else(|_| panic!("{name}={text:?} is not a number")),
        Err(_) => default,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cluster_under_faults_keeps_every_lease_and_token_promise() {
    let faults = env_number("TENURE_NEMESIS_FAULTS", FAULTS_DEFAULT as u64);
    let config = Config {
        faults: usize::try_from(faults).expect("a fault count"),
        seed: env_number("TENURE_NEMESIS_SEED", SEED_DEFAULT),
        clients: CLIENTS,
        keys: KEYS,
    };
    let report = nemesis::run(tenured_bin(), config).await;
    println!("{report}");
    assert!(report.violations.is_empty(), "{report}");
    // The load's clients send acquire ids and retry with them (the `tenure` crate): every
    // grant reaches the client that asked, none holds a key unknown to all.
    assert!(report.orphans.is_empty(), "{report}");
    assert_eq!(report.acquires_unknown, 0, "{report}");
    assert!(
        report.kinds().len() == 4 || report.faults.len() < 4,
        "{report}"
    );
    for fault in &report.faults {
        let served = fault.serve.zip(fault.serve_after_repair);
        assert!(
            served.is_some_and(|(a, b)| a <= SERVE_WAIT_MAX && b <= SERVE_WAIT_MAX),
            "{fault:?}\n{report}"
        );
    }
    let granted = report.ops.get("acquire Granted").copied().unwrap_or(0);
    assert!(granted > 0, "the load was granted nothing\n{report}");
}

/// Time a wiped follower is given to catch up from the leader before the test leans on it.
const CATCH_UP: std::time::Duration = std::time::Duration::from_secs(2);

/// A follower restarted on an empty data directory comes back as a follower that counts:
/// with the other follower killed, the leader and the wiped node still grant. (openraft's
/// leader used to stop on the follower's log going backwards: a debug assertion in its
/// replication progress, without the `loosen-follower-log-revert` feature.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_follower_restarted_wiped_catches_up_and_counts_in_the_quorum() {
    use tenure_testkit::nemesis::{cluster::Cluster, cluster::NODES, history::History, load};

    let mut cluster = Cluster::start(tenured_bin()).await;
    let addrs: Vec<String> = (0..NODES).map(|i| cluster.addr_list(i)).collect();
    let history = History::default();
    let first = load::probe_grant(&addrs, &history, SERVE_WAIT_MAX).await;
    assert!(first.is_some(), "the cluster never granted");
    let leader = cluster.wait_leader(SERVE_WAIT_MAX).await.expect("a leader");
    let (wiped, other) = ((leader + 1) % NODES, (leader + 2) % NODES);
    cluster.wipe_and_restart(wiped);
    assert!(load::probe_grant(&addrs, &history, SERVE_WAIT_MAX)
        .await
        .is_some());
    tokio::time::sleep(CATCH_UP).await;

    cluster.kill9(other);
    let served = load::probe_grant(&addrs, &history, SERVE_WAIT_MAX).await;
    assert!(
        served.is_some(),
        "the leader and the wiped follower did not grant (logs: {})",
        cluster.logs().display()
    );
    let violations = tenure_testkit::nemesis::checker::check(&history.snapshot());
    assert!(violations.is_empty(), "{violations:?}");
}

/// How long the partition-heal case cuts a follower off: over 15 election timeouts at the
/// shipped timing (150-300 ms, after openraft's 300 ms lease).
const PARTITION: std::time::Duration = std::time::Duration::from_secs(5);
/// Times it cuts one off, each follower in turn.
const PARTITIONS: usize = 3;

/// Issue 24: a follower whose peer links are all cut for [`PARTITION`], then healed, used to
/// depose the leader on its return (7 of 7), having raised its term while cut off. With
/// pre-vote nobody answers it, so it never stands: the cluster grants throughout, and after
/// each heal the same node leads, at the same term on every node (zero leader changes).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_follower_partitioned_and_healed_changes_no_leader() {
    use tenure_testkit::nemesis::{cluster::Cluster, cluster::NODES, history::History, load};

    let cluster = Cluster::start(tenured_bin()).await;
    let addrs: Vec<String> = (0..NODES).map(|i| cluster.addr_list(i)).collect();
    let history = History::default();
    let first = load::probe_grant(&addrs, &history, SERVE_WAIT_MAX).await;
    assert!(first.is_some(), "the cluster never granted");
    assert!(
        cluster.wait_settled(SERVE_WAIT_MAX).await,
        "no settled leader"
    );
    let leader = cluster.wait_leader(SERVE_WAIT_MAX).await.expect("a leader");
    let term = cluster.term(leader).await.expect("the leader's term");
    for round in 0..PARTITIONS {
        let follower = (leader + 1 + round % (NODES - 1)) % NODES;
        cluster.proxy.isolate(follower);
        tokio::time::sleep(PARTITION).await;
        let served = load::probe_grant(&addrs, &history, SERVE_WAIT_MAX).await;
        assert!(
            served.is_some(),
            "round {round}: no grant while node {follower} was cut off"
        );
        cluster.proxy.heal();
        // Links are made again within the peers' retry pause (at most 100 ms).
        tokio::time::sleep(std::time::Duration::from_secs(2)).await;
        assert!(
            cluster.wait_settled(SERVE_WAIT_MAX).await,
            "round {round}: not settled"
        );
        assert_eq!(
            cluster.leader().await,
            Some(leader),
            "round {round}: the leader changed"
        );
        for i in 0..NODES {
            let now = cluster.term(i).await;
            assert_eq!(
                now,
                Some(term),
                "round {round}: node {i}'s term moved (logs: {})",
                cluster.logs().display()
            );
        }
    }
    let violations = tenure_testkit::nemesis::checker::check(&history.snapshot());
    assert!(violations.is_empty(), "{violations:?}");
}
