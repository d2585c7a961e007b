//! `--permits` and `--shared` (PROTOCOL.md 3.10): the real `tenure-loadgen` against the real
//! server, whose counters show that the ACQUIREs asked for permits or read leases; and the
//! flags refused where they mean nothing.

use tenure_testkit::ThreadServer;

use crate::end_to_end::number;

/// Runs `max mixed` on one key with `flags`; returns success, stdout and stderr.
fn loadgen(server: &ThreadServer, flags: &[&str]) -> (bool, String, String) {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_tenure-loadgen"))
        .args(["--target", &format!("tenure://{}", server.addr)])
        .args(["--scenario", "max", "--op", "mixed", "--keys", "1"])
        .args(["--duration", "500ms", "--warmup", "100ms"])
        .args(["--connections", "2", "--pipeline", "4", "--json", "--quiet"])
        .args(flags)
        .output()
        .expect("run tenure-loadgen");
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// The server's STATS counter `name`.
async fn stat(server: &ThreadServer, name: &str) -> u64 {
    let stats = server.client().await.stats().await.expect("stats");
    stats
        .into_iter()
        .find(|(n, _)| n == name)
        .unwrap_or_else(|| panic!("no {name} in STATS"))
        .1
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permits_and_shared_acquires_reach_the_server() {
    let server = ThreadServer::start();
    // Eight lanes on one key of four permits: some cycles complete, the others are refused.
    let (ok, json, err) = loadgen(&server, &["--permits", "4"]);
    assert!(ok, "{err}");
    assert!(number(&json, "summary", "cycles_completed") > 0.0, "{json}");
    assert!(
        json.contains("permits=1/4"),
        "the report names the kind: {json}"
    );
    assert!(stat(&server, "permit_grants").await > 0);
    assert_eq!(stat(&server, "shared_grants").await, 0);
    // Every lane's read lease beside the others: none is refused.
    let (ok, json, err) = loadgen(&server, &["--shared"]);
    assert!(ok, "{err}");
    assert_eq!(number(&json, "summary", "cycles_failed"), 0.0, "{json}");
    assert!(stat(&server, "shared_grants").await > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kinds_combine_with_acquire_ids() {
    // `--acquire-ids` with `--permits` or `--shared`: every ACQUIRE carries both (the id
    // before the kind, PROTOCOL.md 3.1); a frame the server could not read would fail cycles.
    let server = ThreadServer::start();
    let (ok, json, err) = loadgen(&server, &["--shared", "--acquire-ids"]);
    assert!(ok, "{err}");
    assert_eq!(number(&json, "summary", "cycles_failed"), 0.0, "{json}");
    assert!(number(&json, "summary", "cycles_completed") > 0.0, "{json}");
    assert!(
        json.contains("shared") && json.contains("acquire_ids"),
        "{json}"
    );
    assert!(stat(&server, "shared_grants").await > 0);
    let (ok, json, err) = loadgen(&server, &["--permits", "4", "--acquire-ids"]);
    assert!(ok, "{err}");
    assert!(number(&json, "summary", "cycles_completed") > 0.0, "{json}");
    assert!(json.contains("permits=1/4"), "{json}");
    assert!(stat(&server, "permit_grants").await > 0);
    // The server saw the ids: the released leases' ids are remembered as ended.
    let ids = stat(&server, "acquire_ids").await + stat(&server, "acquire_ids_ended").await;
    assert!(ids > 0, "no acquire id reached the server");
}

#[test]
fn kinds_are_refused_for_other_targets_and_out_of_range() {
    let run = |flags: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_tenure-loadgen"))
            .args(flags)
            .output()
            .expect("run tenure-loadgen")
    };
    let redis = run(&["--target", "redis://127.0.0.1:1", "--shared"]);
    let err = String::from_utf8_lossy(&redis.stderr);
    assert!(
        !redis.status.success() && err.contains("tenure:// targets only"),
        "{err}"
    );
    for bad in ["0", "5/4", "x"] {
        assert!(
            !run(&["--permits", bad]).status.success(),
            "--permits {bad}"
        );
    }
    assert!(!run(&["--permits", "4", "--shared"]).status.success());
}
