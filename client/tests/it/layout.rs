//! The `tenure` crate's import rules: which module may use which, written down in
//! [`ALLOWED`] (as etcd keeps `server/.import-restrictions`) and kept by reading the
//! `crate::` paths of every module under `client/src`; the `tenure` command line in
//! `src/bin/tenure/` is a crate of its own, with its own table ([`CLI_ALLOWED`]). The test fails on an import the table
//! does not allow, on an allowed import nobody uses (so the table stays the truth), on a
//! module missing from the table, on a cycle, and when `lib.rs`'s `# Layout` table says
//! otherwise.
//!
//! Test code (`#[cfg(test)] mod ... { }` blocks and `#[cfg(test)] mod x;` modules) may import
//! anything: the rules are about the library's layers.

use std::collections::BTreeSet;
use std::path::Path;

use tenure_testkit::imports;

/// Each module and the modules it may import, lowest layer first. A module not listed here
/// is an error, so a new module has to be placed in the layers.
const ALLOWED: &[(&str, &[&str])] = &[
    ("error", &[]),
    ("fence", &[]),
    ("cluster", &[]),
    ("tls", &["error"]),
    ("options", &["tls"]),
    ("outcome", &["error"]),
    ("conn", &["error", "outcome", "tls"]),
    ("router", &["conn", "error", "options", "outcome"]),
    ("lease", &["conn", "error", "outcome", "router"]),
    ("watch", &["conn", "error", "outcome", "router"]),
    (
        "client",
        &[
            "cluster", "error", "lease", "options", "outcome", "router", "watch",
        ],
    ),
    (
        "semaphore",
        &["client", "error", "lease", "options", "outcome"],
    ),
    ("rwlock", &["client", "error", "lease", "options"]),
    (
        "election",
        &["client", "error", "lease", "options", "outcome", "watch"],
    ),
    (
        "session",
        &["client", "error", "lease", "options", "outcome", "router"],
    ),
];

/// Modules compiled only for tests: they may import anything and nothing may import them.
const TEST_ONLY: &[&str] = &["fake"];

/// The same for the `tenure` command line (`src/bin/tenure/`, a crate of its own whose
/// `main.rs` dispatches to the others and is imported by none).
const CLI_ALLOWED: &[(&str, &[&str])] = &[
    ("exit", &[]),
    ("output", &["exit"]),
    ("cluster", &["exit", "output"]),
    ("certs", &["exit", "output"]),
    ("cli", &["certs", "cluster"]),
    ("legacy", &["cli"]),
    ("requests", &["exit", "output"]),
    ("terminal", &[]),
    ("guard", &["exit", "output", "terminal"]),
    ("hold", &[]),
    (
        "run",
        &["cli", "exit", "guard", "hold", "output", "requests"],
    ),
    ("elect", &["cli", "exit", "hold", "output", "run"]),
    (
        "console",
        &["cluster", "exit", "legacy", "output", "requests"],
    ),
];

#[test]
fn every_module_imports_only_what_the_layout_allows() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let found = imports::read_crate(&src, &["bin"]);
    let lib = std::fs::read_to_string(src.join("lib.rs")).expect("read lib.rs");
    let problems = imports::check(ALLOWED, TEST_ONLY, &found, &lib);
    assert!(
        problems.is_empty(),
        "the import rules of client/src are broken:\n  {}",
        problems.join("\n  ")
    );
}

#[test]
fn every_module_of_the_command_line_imports_only_what_its_layout_allows() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/bin/tenure");
    let found = imports::read_crate(&src, &[]);
    let main = std::fs::read_to_string(src.join("main.rs")).expect("read main.rs");
    let problems = imports::check(CLI_ALLOWED, &[], &found, &main);
    assert!(
        problems.is_empty(),
        "the import rules of client/src/bin/tenure are broken:\n  {}",
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
