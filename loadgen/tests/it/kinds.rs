//! `--permits` and `--shared` (PROTOCOL.md 3.10): the real `tenure-loadgen` against the real
//! server, whose counters show that the ACQUIREs asked for permits or read leases; and the
//! flags refused where they mean nothing.

use tenure_testkit::ThreadServer;

use crate::end_to_end::number;

/// Runs `max mixed` on one key with `flags`; returns success, stdout and stderr.
fn loadgen(server: &ThreadServer, flags: &[&str]) -> (bool, String, String) {
    let target = format!("tenure://{}", server.addr);
    let mut args = vec!["--target", &target];
    args.extend(["--scenario", "max", "--op", "mixed", "--keys", "1"]);
    args.extend(["--duration", "500ms", "--warmup", "100ms"]);
    args.extend(["--connections", "2", "--pipeline", "4", "--json", "--quiet"]);
    args.extend(flags);
    crate::end_to_end::loadgen(&args)
}

/// The server's STATS counter `name`.
pub(crate) async fn stat(server: &ThreadServer, name: &str) -> u64 {
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

/// Runs `--scenario SCENARIO` briefly, 16 clients on 2 keys with `flags`; returns the report.
fn contend(server: &ThreadServer, scenario: &str, flags: &[&str]) -> String {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_tenure-loadgen"))
        .args(["--target", &format!("tenure://{}", server.addr)])
        .args(["--scenario", scenario, "--clients", "16", "--keys", "2"])
        .args(["--hold", "1ms", "--duration", "1s", "--warmup", "200ms"])
        .args(["--connections", "2", "--json", "--quiet"])
        .args(flags)
        .output()
        .expect("run tenure-loadgen");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    );
    assert!(output.status.success(), "{stderr}");
    let report: serde_json::Value = serde_json::from_str(&stdout).expect("JSON");
    let errors = report["errors"].as_object().expect("an errors object");
    assert!(errors.is_empty(), "errors: {stdout}");
    stdout
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_semaphore_scenario_contends_for_permits_within_the_limit() {
    let server = ThreadServer::start();
    let json = contend(&server, "semaphore", &["--permits", "3"]);
    let grants = number(&json, "summary", "grants");
    assert!(grants >= 1.0, "{json}");
    assert!(json.contains("permits=1/3"), "{json}");
    assert_eq!(number(&json, "summary", "permit_limit"), 3.0, "{json}");
    // The clients' own count of permits held at once on a key: some, never over the limit.
    let most = number(&json, "summary", "held_at_once_max");
    assert!((1.0..=3.0).contains(&most), "{json}");
    assert_eq!(number(&json, "summary", "exclusion_breaks"), 0.0, "{json}");
    assert!(number(&json, "summary", "grants_per_s") > 0.0, "{json}");
    // Every grant the report counts was a permit grant at the server (which also counts
    // the warm-up's and the drain's).
    let at_server = stat(&server, "permit_grants").await as f64;
    assert!(
        at_server >= grants,
        "server {at_server} < report {grants}: {json}"
    );
    assert_eq!(stat(&server, "shared_grants").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_read_mostly_scenario_mixes_read_and_write_leases() {
    let server = ThreadServer::start();
    let json = contend(&server, "read-mostly", &["--write-ratio", "0.5"]);
    let grants = number(&json, "summary", "grants");
    let (reads, writes) = (
        number(&json, "summary", "read_grants"),
        number(&json, "summary", "write_grants"),
    );
    assert!(grants >= 2.0, "{json}");
    assert_eq!(reads + writes, grants, "{json}");
    assert!(reads >= 1.0 && writes >= 1.0, "{json}");
    assert_eq!(number(&json, "summary", "exclusion_breaks"), 0.0, "{json}");
    assert!(
        number(&json, "summary", "write_wait_p99_us") > 0.0,
        "{json}"
    );
    // Both kinds reached the server: read leases, and writes (plain grants).
    let shared = stat(&server, "shared_grants").await as f64;
    let all = stat(&server, "grants").await as f64;
    assert!(shared >= reads, "server {shared} < report {reads}: {json}");
    assert!(
        all - shared >= writes,
        "server writes {} < report {writes}",
        all - shared
    );
}
