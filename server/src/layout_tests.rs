//! The import rules of the crate's layout (`lib.rs`'s "# Layout"), kept by reading the code:
//! every `crate::` path outside test code is an edge from its file's top-level module to the
//! module it names, and every edge must be in [`ALLOWED`]; the graph must have no cycle.
//!
//! Test code (`#[cfg(test)]` items, files whose path holds `test`, the `sim` simulations) may
//! import anything, as `module_cycles.py` also counts it. The binary's own files (`main.rs`
//! and the modules it declares) are not part of the library's graph.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Each top-level module and the modules it may import. A new module, or a new edge, is a
/// decision about the layout: add it here and to `lib.rs`'s "# Layout" together.
const ALLOWED: &[(&str, &[&str])] = &[
    // Leaves: nothing of the crate.
    ("clock", &[]),
    ("wheel", &[]),
    ("memory", &[]),
    ("log_limit", &[]),
    ("linger", &[]),
    ("console", &[]),
    ("record", &[]),
    ("obs", &[]),
    ("identity", &["log_limit"]),
    ("admission", &[]),
    // Pure and durable layers.
    ("table", &["wheel"]),
    ("tls", &["linger"]),
    ("wal", &["record", "obs"]),
    ("config", &["tls", "wal"]),
    ("journal", &["config", "record", "wal"]),
    ("error", &["journal", "wal"]),
    // The request path.
    (
        "executor",
        &[
            "clock", "config", "identity", "journal", "obs", "record", "table",
        ],
    ),
    (
        "conn",
        &[
            "admission",
            "config",
            "console",
            "executor",
            "identity",
            "journal",
            "linger",
            "obs",
        ],
    ),
    // What both modes build a server from.
    ("scrape", &["executor", "identity", "obs"]),
    ("http", &["scrape"]),
    ("startup", &["config", "error", "identity", "tls"]),
    (
        "accept",
        &["admission", "config", "conn", "executor", "obs", "tls"],
    ),
    // The two composition roots, siblings: neither imports the other.
    (
        "serve",
        &[
            "accept", "clock", "config", "error", "executor", "http", "identity", "journal",
            "memory", "scrape", "startup", "tls", "wal",
        ],
    ),
    (
        "cluster",
        &[
            "accept",
            "clock",
            "config",
            "error",
            "executor",
            "http",
            "identity",
            "journal",
            "log_limit",
            "obs",
            "record",
            "scrape",
            "startup",
            "tls",
            "wal",
        ],
    ),
];

/// Most bytes of source the reader accepts per file, so a runaway file fails loudly.
const FILE_BYTES_MAX: u64 = 1 << 20;

fn src_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// Every `.rs` file under `dir`, recursively, in a stable order.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("read src dir")
        .map(|entry| entry.expect("dir entry").path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|ext| ext == "rs") {
            out.push(path);
        }
    }
}

/// `text` without `//` comments (doc comments included: a link in prose is no import).
fn strip_comments(text: &str) -> String {
    text.lines()
        .map(|line| line.find("//").map_or(line, |at| &line[..at]))
        .collect::<Vec<_>>()
        .join("\n")
}

/// `text` without `#[cfg(test)]` items: each attribute and the item after it, up to its `;`
/// or the end of its outermost `{ }` block.
fn strip_test_items(text: &str) -> String {
    const ATTRIBUTE: &str = "#[cfg(test)]";
    let mut out = String::new();
    let mut rest = text;
    while let Some(at) = rest.find(ATTRIBUTE) {
        out.push_str(&rest[..at]);
        let item = &rest[at + ATTRIBUTE.len()..];
        let mut depth = 0usize;
        let mut end = item.len();
        for (i, c) in item.char_indices() {
            match c {
                ';' if depth == 0 => {
                    end = i + 1;
                    break;
                }
                '{' => depth += 1,
                '}' => {
                    depth = depth.saturating_sub(1);
                    if depth == 0 {
                        end = i + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        rest = &item[end..];
    }
    out.push_str(rest);
    out
}

/// The first path segment of every `crate::` path in `code`, groups (`crate::{a::X, b}`)
/// included.
fn crate_roots(code: &str) -> Vec<String> {
    let mut roots = Vec::new();
    for (at, _) in code.match_indices("crate::") {
        let preceded_by_ident = code[..at]
            .chars()
            .next_back()
            .is_some_and(|c| c.is_alphanumeric() || c == '_');
        if preceded_by_ident {
            continue; // `$crate::` or `mycrate::`
        }
        let after = &code[at + "crate::".len()..];
        if let Some(group) = after.strip_prefix('{') {
            roots.extend(group_roots(group));
        } else {
            roots.push(ident(after));
        }
    }
    roots.retain(|root| !root.is_empty() && root != "self");
    roots
}

/// The first segment of each top-level item of a `{ ... }` group starting at `group`.
fn group_roots(group: &str) -> Vec<String> {
    let mut roots = vec![ident(group.trim_start())];
    let mut depth = 0usize;
    for (i, c) in group.char_indices() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => break,
            '}' => depth -= 1,
            ',' if depth == 0 => roots.push(ident(group[i + 1..].trim_start())),
            _ => {}
        }
    }
    roots
}

fn ident(text: &str) -> String {
    text.chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect()
}

/// The modules `main.rs` declares: the binary's, not the library's.
fn binary_modules(src: &Path) -> BTreeSet<String> {
    let main = std::fs::read_to_string(src.join("main.rs")).expect("read main.rs");
    main.lines()
        .filter_map(|line| line.trim().strip_prefix("mod "))
        .map(ident)
        .collect()
}

/// Names `lib.rs` re-exports at the crate root (`pub use config::{Config, ..}`), each with
/// the module it comes from, so `crate::Config` counts as an import of `config`.
fn root_reexports(src: &Path) -> BTreeMap<String, String> {
    let lib = std::fs::read_to_string(src.join("lib.rs")).expect("read lib.rs");
    let mut names = BTreeMap::new();
    for line in lib.lines() {
        let Some(path) = line.trim().strip_prefix("pub use ") else {
            continue;
        };
        let module = ident(path);
        let tail = path[module.len()..].trim_start_matches("::");
        let items = tail.trim_start_matches('{').trim_end_matches(';');
        for item in items.trim_end_matches('}').split(',') {
            let name = item.rsplit("::").next().unwrap_or("").trim();
            if !name.is_empty() {
                names.insert(name.to_string(), module.clone());
            }
        }
    }
    names
}

/// The library's import graph: top-level module -> modules it imports, each edge with the
/// file that makes it.
fn import_graph() -> BTreeMap<String, BTreeMap<String, String>> {
    let src = src_dir();
    let skipped = binary_modules(&src);
    let reexports = root_reexports(&src);
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let rel = |path: &Path| path.strip_prefix(&src).expect("under src").to_path_buf();
    let top = |rel: &Path| {
        let first = rel.components().next().expect("a path");
        let name = first.as_os_str().to_str().expect("utf-8 path");
        name.strip_suffix(".rs").unwrap_or(name).to_string()
    };
    let modules: BTreeSet<String> = files.iter().map(|path| top(&rel(path))).collect();
    let mut graph: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    for path in &files {
        let rel = rel(path);
        let from = top(&rel);
        let shown = rel.display().to_string();
        let test_code = shown.contains("test") || rel.components().any(|c| c.as_os_str() == "sim");
        if from == "lib" || from == "main" || skipped.contains(&from) || test_code {
            continue;
        }
        assert!(
            path.metadata().expect("stat").len() <= FILE_BYTES_MAX,
            "{shown}"
        );
        let text = std::fs::read_to_string(path).expect("read source");
        let code = strip_test_items(&strip_comments(&text));
        let edges = graph.entry(from.clone()).or_default();
        for root in crate_roots(&code) {
            let to = match reexports.get(&root) {
                Some(module) => module.clone(),
                None if modules.contains(&root) => root,
                None => panic!("{shown}: `crate::{root}` names no module of the crate"),
            };
            if to != from {
                edges.entry(to).or_insert_with(|| shown.clone());
            }
        }
    }
    graph
}

/// A cycle in `graph`, as the modules along it, if there is one.
fn find_cycle(graph: &BTreeMap<String, BTreeMap<String, String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeMap<String, String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|n| n == node) {
            let mut cycle = path[at..].to_vec();
            cycle.push(node.to_string());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_string());
        for next in graph.get(node).into_iter().flat_map(|edges| edges.keys()) {
            if let Some(cycle) = visit(next, graph, path, done) {
                return Some(cycle);
            }
        }
        path.pop();
        done.insert(node.to_string());
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|node| visit(node, graph, &mut Vec::new(), &mut done))
}

#[test]
fn every_import_follows_the_layout_table() {
    let allowed: BTreeMap<&str, &[&str]> = ALLOWED.iter().copied().collect();
    let mut broken = Vec::new();
    for (from, edges) in import_graph() {
        let Some(may) = allowed.get(from.as_str()) else {
            broken.push(format!("module `{from}` is not in the layout table"));
            continue;
        };
        for (to, file) in edges {
            if !may.contains(&to.as_str()) {
                broken.push(format!("{file}: `{from}` may not import `{to}`"));
            }
        }
    }
    assert!(
        broken.is_empty(),
        "imports against the layout:\n{}",
        broken.join("\n")
    );
}

#[test]
fn the_import_graph_has_no_cycle() {
    let graph = import_graph();
    if let Some(cycle) = find_cycle(&graph) {
        panic!("import cycle: {}", cycle.join(" -> "));
    }
    // The table itself must be a layering too, or a later edge it allows could close one.
    let table = ALLOWED
        .iter()
        .map(|(from, to)| {
            let edges = to.iter().map(|t| (t.to_string(), String::new())).collect();
            (from.to_string(), edges)
        })
        .collect();
    if let Some(cycle) = find_cycle(&table) {
        panic!("the layout table allows a cycle: {}", cycle.join(" -> "));
    }
}

#[test]
fn the_reader_sees_grouped_paths_and_skips_test_items() {
    let code = "use crate::{a::X, b::{c, d}, e};\n#[cfg(test)]\nmod t { use crate::f; }\nfn g() { crate::h::i(); }\n";
    let code = strip_test_items(&strip_comments(code));
    assert_eq!(crate_roots(&code), ["a", "b", "e", "h"]);
    assert_eq!(crate_roots("/// see [`crate::x`]\n").len(), 1);
    assert!(crate_roots(&strip_comments("/// see [`crate::x`]\n")).is_empty());
    let cyclic = BTreeMap::from([
        (
            "p".to_string(),
            BTreeMap::from([("q".to_string(), String::new())]),
        ),
        (
            "q".to_string(),
            BTreeMap::from([("p".to_string(), String::new())]),
        ),
    ]);
    assert_eq!(find_cycle(&cyclic).expect("a cycle"), ["p", "q", "p"]);
}

/// Most lines a function outside test code may span, signature to closing brace (issue 23).
const FUNCTION_LINES_MAX: usize = 70;

/// The name of the function `line` opens, if it opens one:
/// `[pub[(..)]] [async] [const] [unsafe] fn name`.
fn fn_name(line: &str) -> Option<String> {
    let word = |rest: &str, word: &str| {
        let after = rest.strip_prefix(word)?;
        after
            .starts_with(char::is_whitespace)
            .then(|| after.trim_start().to_string())
    };
    let mut rest = line.trim_start().to_string();
    if let Some(after) = rest.strip_prefix("pub") {
        let after = match after.strip_prefix('(') {
            Some(scope) => &scope[scope.find(')')? + 1..],
            None => after,
        };
        if after.starts_with(char::is_whitespace) {
            rest = after.trim_start().to_string();
        }
    }
    for qualifier in ["async", "const", "unsafe"] {
        if let Some(after) = word(&rest, qualifier) {
            rest = after;
        }
    }
    let name = ident(&word(&rest, "fn")?);
    (!name.is_empty()).then_some(name)
}

/// Each function in `text` over [`FUNCTION_LINES_MAX`] lines, as `file:line name: n lines`.
/// Braces are counted per line; an inline `#[cfg(test)] mod` ends the scan, as test modules
/// close the file here.
fn long_functions(shown: &str, text: &str) -> Vec<String> {
    let lines: Vec<&str> = text.lines().collect();
    let inline_mod =
        |line: &str| line.trim_start().starts_with("mod ") && !line.trim_end().ends_with(';');
    let end = lines
        .windows(2)
        .position(|pair| pair[0].trim() == "#[cfg(test)]" && inline_mod(pair[1]))
        .unwrap_or(lines.len());
    let mut long = Vec::new();
    let mut i = 0;
    while i < end {
        let opens = fn_name(lines[i]).filter(|_| !lines[i].trim_end().ends_with(';'));
        let Some(name) = opens else {
            i += 1;
            continue;
        };
        let (mut depth, mut seen, mut j) = (0i64, false, i);
        while j < end {
            let count = |c: char| lines[j].matches(c).count() as i64;
            depth += count('{') - count('}');
            seen |= lines[j].contains('{');
            if seen && depth <= 0 {
                break;
            }
            j += 1;
        }
        let span = j - i + 1;
        if span > FUNCTION_LINES_MAX {
            long.push(format!("{shown}:{} {name}: {span} lines", i + 1));
        }
        i = if seen { j + 1 } else { i + 1 };
    }
    long
}

#[test]
fn no_function_outside_tests_is_over_the_line_limit() {
    let src = src_dir();
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut long = Vec::new();
    for path in &files {
        let rel = path.strip_prefix(&src).expect("under src");
        let shown = rel.display().to_string();
        // The simulations (`sim/`, `sim.rs`) are test code, as for the import rules.
        let sim = |c: std::path::Component| c.as_os_str().to_string_lossy().starts_with("sim");
        if shown.contains("test") || rel.components().any(sim) {
            continue;
        }
        let text = std::fs::read_to_string(path).expect("read source");
        long.extend(long_functions(&shown, &text));
    }
    assert!(
        long.is_empty(),
        "functions over {FUNCTION_LINES_MAX} lines (split them into named helpers):\n{}",
        long.join("\n")
    );
}

#[test]
fn the_length_reader_counts_functions_and_skips_test_modules() {
    let function = |name: &str, body_lines: usize| {
        let body = "    let _ = 1;\n".repeat(body_lines);
        format!("pub(crate) async fn {name}(x: u8) -> u8 {{\n{body}    x\n}}\n")
    };
    // Signature, body, tail expression and closing brace.
    let at_limit = function("fits", FUNCTION_LINES_MAX - 3);
    let over = function("too_long", FUNCTION_LINES_MAX - 2);
    let text = format!("{at_limit}trait T {{\n    fn f(&self);\n}}\n{over}");
    assert_eq!(
        long_functions("f.rs", &text),
        [format!(
            "f.rs:{} too_long: {} lines",
            FUNCTION_LINES_MAX + 4,
            FUNCTION_LINES_MAX + 1
        )]
    );
    let tests = format!("#[cfg(test)]\nmod tests {{\n{over}}}\n");
    assert!(long_functions("f.rs", &format!("{at_limit}{tests}")).is_empty());
    assert_eq!(fn_name("    pub fn go() {").as_deref(), Some("go"));
    assert_eq!(fn_name("const unsafe fn go() {").as_deref(), Some("go"));
    assert_eq!(fn_name("let function = 1;"), None);
    assert_eq!(fn_name("fnord()"), None);
}
