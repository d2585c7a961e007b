//! The load generator's import rules: which module may use which, written down in
//! [`ALLOWED`] (as etcd keeps `server/.import-restrictions`) and kept by reading the
//! `crate::` paths of every module under `loadgen/src`. The test fails on an import the
//! table does not allow, on an allowed import nobody uses (so the table stays the truth), on
//! a module missing from the table, on a cycle, and when `main.rs`'s `# Layout` table says
//! otherwise.
//!
//! Test code (`#[cfg(test)] mod ... { }` blocks) may import anything: the rules are about
//! the program's layers.

use std::collections::BTreeSet;
use std::path::Path;

use tenure_testkit::imports;

/// Each module and the modules it may import, lowest layer first. A module not listed here
/// is an error, so a new module has to be placed in the layers.
const ALLOWED: &[(&str, &[&str])] = &[
    ("op", &[]),
    ("procfs", &[]),
    ("tls", &[]),
    ("wire", &["op"]),
    ("resp", &["op"]),
    ("etcd", &["op"]),
    ("proto", &["etcd", "op", "resp", "wire"]),
    ("stats", &["op"]),
    ("report", &["op", "stats"]),
    ("args", &["wire"]),
    ("target", &["args", "etcd", "proto", "resp", "tls"]),
    ("conn", &["op", "proto"]),
    ("scenario", &["args", "conn", "op", "report", "stats"]),
    ("world", &["conn", "scenario", "stats"]),
    ("socket", &["conn", "world"]),
    ("progress", &["op", "world"]),
    ("cluster", &["args", "etcd", "op", "target"]),
    (
        "run",
        &[
            "args", "cluster", "conn", "procfs", "progress", "report", "scenario", "socket",
            "stats", "target", "world",
        ],
    ),
];

#[test]
fn every_module_imports_only_what_the_layout_allows() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let found = imports::read_crate(&src, &[]);
    let main = std::fs::read_to_string(src.join("main.rs")).expect("read main.rs");
    let problems = imports::check(ALLOWED, &[], &found, &main);
    assert!(
        problems.is_empty(),
        "the import rules of loadgen/src are broken:\n  {}",
        problems.join("\n  ")
    );
}

#[test]
fn the_import_reader_sees_grouped_nested_and_inline_paths_and_skips_tests_and_comments() {
    let text = r#"
        use crate::a::X;
        use crate::{b::Y, c::{self, Z}};
        // use crate::commented::Out;
        /// [`crate::doc_link`]
        fn f() -> crate::d::W { let s = "crate::in_a_string"; crate::e::call() }
        #[cfg(test)]
        mod tests { use crate::in_tests::T; }
    "#;
    let seen = imports::crate_paths(&imports::without_tests(&imports::blank_out(text)));
    let expected: BTreeSet<String> = ["a", "b", "c", "d", "e"].map(String::from).into();
    assert_eq!(seen, expected);
}
