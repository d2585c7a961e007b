//! The reader behind each crate's import-rules test (`client/tests/it/layout.rs`,
//! `loadgen/tests/it/layout.rs`): the `crate::` paths every module's non-test code names,
//! checked against a table of allowed imports (as etcd keeps `server/.import-restrictions`),
//! for cycles, and against the crate root's `# Layout` table. One copy for every crate.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Module name → the modules its non-test code names through `crate::`, for every `.rs`
/// file under `src` (a file's module is its first path component; `lib.rs` and
/// `main.rs` are the crate root, recorded as `""`). Folders in `skip` are left out.
pub fn read_crate(src: &Path, skip: &[&str]) -> BTreeMap<String, BTreeSet<String>> {
    let mut found: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in rust_files(src) {
        let relative = file.strip_prefix(src).expect("under src");
        let first = relative
            .components()
            .next()
            .expect("a file")
            .as_os_str()
            .to_string_lossy()
            .into_owned();
        if skip.contains(&first.as_str()) {
            continue;
        }
        let module = match first.trim_end_matches(".rs") {
            "lib" | "main" => String::new(),
            name => name.to_owned(),
        };
        let text = std::fs::read_to_string(&file).expect("read a source file");
        let mut names = crate_paths(&without_tests(&blank_out(&text)));
        names.remove(&module);
        found.entry(module).or_default().extend(names);
    }
    found
}

fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .expect("read a source folder")
        .map(|e| e.expect("a folder entry").path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            files.extend(rust_files(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
    files
}

/// `text` with comments, string literals and character literals replaced by spaces
/// (newlines kept), so that only code is searched.
pub fn blank_out(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = bytes.to_vec();
    let mut i = 0;
    while i < bytes.len() {
        let end = literal_or_comment_end(bytes, i);
        if end > i {
            for byte in &mut out[i..end] {
                if *byte != b'\n' {
                    *byte = b' ';
                }
            }
            i = end;
        } else {
            i += 1;
        }
    }
    String::from_utf8(out).expect("only ASCII bytes were replaced")
}

/// Where the comment or literal starting at `i` ends, or `i` if none starts there.
fn literal_or_comment_end(b: &[u8], i: usize) -> usize {
    let rest = &b[i..];
    let after_word = i > 0 && (b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_');
    if rest.starts_with(b"//") {
        return rest
            .iter()
            .position(|&c| c == b'\n')
            .map_or(b.len(), |n| i + n);
    }
    if rest.starts_with(b"/*") {
        return find(b, i + 2, b"*/").map_or(b.len(), |n| n + 2);
    }
    // Raw strings: r"..", r#".."#, br"..".
    let raw_at = if rest.starts_with(b"br") { 2 } else { 1 };
    if !after_word && (rest.starts_with(b"r") || rest.starts_with(b"br")) {
        let hashes = rest[raw_at..].iter().take_while(|&&c| c == b'#').count();
        if rest.get(raw_at + hashes) == Some(&b'"') {
            let mut close = vec![b'"'];
            close.extend(std::iter::repeat_n(b'#', hashes));
            let from = i + raw_at + hashes + 1;
            return find(b, from, &close).map_or(b.len(), |n| n + close.len());
        }
    }
    if rest[0] == b'"' {
        let mut j = i + 1;
        while j < b.len() && b[j] != b'"' {
            j += if b[j] == b'\\' { 2 } else { 1 };
        }
        return (j + 1).min(b.len());
    }
    if rest[0] == b'\'' {
        // 'x' or '\n' or '\u{..}'; anything else is a lifetime.
        if rest.get(1) == Some(&b'\\') {
            return find(b, i + 2, b"'").map_or(b.len(), |n| n + 1);
        }
        let width = std::str::from_utf8(&rest[1..])
            .ok()
            .and_then(|s| s.chars().next())
            .map_or(1, char::len_utf8);
        if rest.get(1 + width) == Some(&b'\'') {
            return i + width + 2;
        }
    }
    i
}

fn find(b: &[u8], from: usize, needle: &[u8]) -> Option<usize> {
    b.get(from..)?
        .windows(needle.len())
        .position(|w| w == needle)
        .map(|n| from + n)
}

/// `code` without `#[cfg(test)]` modules: `mod name { ... }` blocks are cut out (inline
/// test modules), and `mod name;` lines too (the file is then a test-only module, which
/// [`read_crate`] reads but the rules let import anything).
pub fn without_tests(code: &str) -> String {
    let mut out = code.to_owned();
    while let Some(at) = out.find("#[cfg(test)]") {
        let after = at + "#[cfg(test)]".len();
        let rest = out[after..].trim_start();
        let start = out.len() - rest.len();
        let end = if rest.starts_with("mod ") {
            match (rest.find('{'), rest.find(';')) {
                (Some(open), semi) if semi.is_none_or(|s| open < s) => {
                    closing_brace(&out, start + open).map_or(out.len(), |c| c + 1)
                }
                (_, Some(semi)) => start + semi + 1,
                _ => out.len(),
            }
        } else {
            after // a test-only item that is not a module: its imports still count
        };
        out.replace_range(at..end, "");
    }
    out
}

fn closing_brace(text: &str, open: usize) -> Option<usize> {
    let mut depth = 0usize;
    for (i, c) in text[open..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(open + i);
                }
            }
            _ => {}
        }
    }
    None
}

/// The first segment of every `crate::` path in `code`: `crate::a::X` and
/// `crate::{a::X, b::{self, Y}}` name `a` and `b`.
pub fn crate_paths(code: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut from = 0;
    while let Some(found) = code[from..].find("crate::") {
        let at = from + found;
        from = at + "crate::".len();
        let before = code[..at].chars().next_back();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '$') {
            continue; // `tenure_crate::`, or a macro's `$crate::`
        }
        let rest = &code[from..];
        if rest.starts_with('{') {
            let close = closing_brace(code, from).unwrap_or(code.len());
            names.extend(group_heads(&code[from + 1..close]));
        } else {
            names.extend(ident(rest));
        }
    }
    names
}

/// The first segment of each top-level item of a `{a::X, b::{Y, Z}}` group's inside.
fn group_heads(inside: &str) -> Vec<String> {
    let mut heads = Vec::new();
    let mut depth = 0;
    let mut item_start = true;
    for (i, c) in inside.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => item_start = true,
            c if item_start && !c.is_whitespace() => {
                heads.extend(ident(&inside[i..]));
                item_start = false;
            }
            _ => {}
        }
    }
    heads
}

fn ident(text: &str) -> Option<String> {
    let end = text
        .find(|c: char| !(c.is_alphanumeric() || c == '_'))
        .unwrap_or(text.len());
    (end > 0).then(|| text[..end].to_owned())
}

/// Every way `found` (from [`read_crate`]) and `root_docs` (the text of `lib.rs` or
/// `main.rs`) break the rules in `allowed`; empty when all hold.
pub fn check(
    allowed: &[(&str, &[&str])],
    test_only: &[&str],
    found: &BTreeMap<String, BTreeSet<String>>,
    root_docs: &str,
) -> Vec<String> {
    let table: BTreeMap<&str, BTreeSet<&str>> = allowed
        .iter()
        .map(|(module, deps)| (*module, deps.iter().copied().collect()))
        .collect();
    assert_eq!(table.len(), allowed.len(), "a module listed twice");
    let mut problems = Vec::new();
    for (module, names) in found {
        if module.is_empty() || test_only.contains(&module.as_str()) {
            continue; // the crate root wires everything; test code may import anything
        }
        let Some(deps) = table.get(module.as_str()) else {
            problems.push(format!("`{module}` is not in the table of allowed imports"));
            continue;
        };
        for name in names {
            if test_only.contains(&name.as_str()) {
                problems.push(format!("`{module}` imports the test-only `{name}`"));
            } else if !found.contains_key(name) {
                problems.push(format!(
                    "`{module}` names `crate::{name}`, which is no module: import it from \
                     the module that owns it, not through the crate root"
                ));
            } else if !deps.contains(name.as_str()) {
                problems.push(format!(
                    "`{module}` imports `{name}`, which the table does not allow"
                ));
            }
        }
        for dep in deps {
            if !names.contains(*dep) {
                problems.push(format!(
                    "`{module}` may import `{dep}` but does not: remove it from the table"
                ));
            }
        }
    }
    for module in table.keys() {
        if !found.contains_key(*module) {
            problems.push(format!("the table lists `{module}`, which has no source"));
        }
    }
    let graph: BTreeMap<&str, BTreeSet<&str>> = found
        .iter()
        .filter(|(module, _)| !module.is_empty() && !test_only.contains(&module.as_str()))
        .map(|(module, names)| (module.as_str(), names.iter().map(String::as_str).collect()))
        .collect();
    problems.extend(cycle(&graph).map(|c| format!("import cycle: {}", c.join(" -> "))));
    problems.extend(layout_docs_disagree(&table, root_docs));
    problems
}

/// One cycle of `graph`, as the modules along it (the first repeated at the end).
pub fn cycle<'a>(graph: &BTreeMap<&'a str, BTreeSet<&'a str>>) -> Option<Vec<&'a str>> {
    // Depth-first search; a node met again while on the path closes a cycle.
    fn visit<'a>(
        node: &'a str,
        graph: &BTreeMap<&'a str, BTreeSet<&'a str>>,
        path: &mut Vec<&'a str>,
        done: &mut BTreeSet<&'a str>,
    ) -> Option<Vec<&'a str>> {
        if let Some(at) = path.iter().position(|&n| n == node) {
            let mut found = path[at..].to_vec();
            found.push(node);
            return Some(found);
        }
        if !done.insert(node) {
            return None;
        }
        path.push(node);
        for next in graph.get(node).into_iter().flatten() {
            if let Some(found) = visit(next, graph, path, done) {
                return Some(found);
            }
        }
        path.pop();
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|node| visit(node, graph, &mut Vec::new(), &mut done))
}

/// Where the `# Layout` table of the crate root's docs (rows
/// ``//! | `module` | its job | `a`, `b` |``, `—` for none) differs from `table`.
fn layout_docs_disagree(table: &BTreeMap<&str, BTreeSet<&str>>, root_docs: &str) -> Vec<String> {
    let mut documented: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for line in root_docs.lines() {
        let Some(row) = line.trim().strip_prefix("//! | `") else {
            continue;
        };
        let cells: Vec<&str> = row.split(" | ").collect();
        let module = cells[0].trim_end_matches('`').to_owned();
        let deps = cells.last().expect("a cell").trim_end_matches('|');
        let deps = deps
            .split(',')
            .map(|d| d.trim().trim_matches('`').to_owned())
            .filter(|d| !d.is_empty() && d != "—")
            .collect();
        documented.insert(module, deps);
    }
    let mut problems = Vec::new();
    for (module, deps) in table {
        match documented.get(*module) {
            None => problems.push(format!("the `# Layout` table does not list `{module}`")),
            Some(said) if said.iter().map(String::as_str).ne(deps.iter().copied()) => {
                problems.push(format!(
                    "the `# Layout` table says `{module}` imports {said:?}, the rules {deps:?}"
                ));
            }
            Some(_) => {}
        }
    }
    for module in documented.keys() {
        if !table.contains_key(module.as_str()) {
            problems.push(format!(
                "the `# Layout` table lists `{module}`, the rules do not"
            ));
        }
    }
    problems
}
