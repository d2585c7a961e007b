//! PROTOCOL.md's examples, read out of the document and sent byte for byte to a real server
//! (in process, port 0), whose answers must be the ones the document shows. The marker
//! convention is written at the top of PROTOCOL.md; this module is its reader:
//!
//! - every fenced block holding a hex dump or a `$ nc` session must follow a marker, so a
//!   new example cannot go untested;
//! - every marked example must be one this module knows how to set up (the names in
//!   [`SCENARIOS`]), and every scenario must find its examples;
//! - annotations are checked against their bytes (`len = 32` against `00 00 00 20`), opcode
//!   names against the tables of 3.1 and 3.2, error names against 3.5.
//!
//! Also here: the STATS names PROTOCOL.md 3.3 lists are exactly the names the server sends.

use std::collections::{BTreeSet, HashMap};
use std::path::Path;

use tenure_server::identity::hash_secret;
use tenure_testkit::raw::acquire_meta;
use tenure_testkit::{Raw, Server, PATIENCE};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// Every example name PROTOCOL.md may use, each with its setup in [`run_scenario`].
const SCENARIOS: [&str; 14] = [
    "hello-version-9",
    "acquire",
    "acquire-id",
    "acquire-id-console",
    "acquire-permits",
    "semaphore",
    "granted",
    "watching",
    "auth",
    "cluster-remove",
    "cluster-status-extended",
    "session",
    "session-open-console",
    "escapes-and-refusals",
];

fn protocol_md() -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../protocol/PROTOCOL.md");
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// What a marked block is.
#[derive(Debug, Clone, PartialEq)]
enum Role {
    /// Bytes a client sends.
    Send,
    /// Bytes a client sends, answered by this response (and error code, for ERROR).
    SendAnswer(String, Option<String>),
    /// Bytes the server answers; the labels whose bytes may differ.
    Receive(Vec<String>),
    /// A console session.
    Console,
}

/// One marked block of PROTOCOL.md.
#[derive(Debug, Clone)]
struct Example {
    name: String,
    role: Role,
    /// The block's lines, without the fences.
    lines: Vec<String>,
    /// Line number of the marker, for messages.
    line_no: usize,
}

/// Parses `<!-- example NAME: ROLE -->`; `None` if the line is not a marker.
fn parse_marker(line: &str) -> Option<(String, Role)> {
    let inner = line
        .trim()
        .strip_prefix("<!-- example ")?
        .strip_suffix("-->")?
        .trim();
    let (name, role) = inner.split_once(':').expect("marker without `:`");
    let role = role.trim();
    let role = if role == "console" {
        Role::Console
    } else if let Some(rest) = role.strip_prefix("receive") {
        let any = rest.trim().strip_prefix("any=").unwrap_or("");
        Role::Receive(
            any.split(',')
                .filter(|s| !s.is_empty())
                .map(String::from)
                .collect(),
        )
    } else if let Some(rest) = role.strip_prefix("send") {
        match rest.trim().strip_prefix(',') {
            None => Role::Send,
            Some(answer) => {
                let mut words = answer.split_whitespace();
                assert_eq!(words.next(), Some("answer"), "{line}");
                let opcode = words.next().expect("answer without an opcode").to_string();
                Role::SendAnswer(opcode, words.next().map(String::from))
            }
        }
    } else {
        panic!("unknown example role in {line:?}");
    };
    Some((name.trim().to_string(), role))
}

/// Every marked example, in document order; panics on an example block without a marker.
fn examples(doc: &str) -> Vec<Example> {
    let lines: Vec<&str> = doc.lines().collect();
    let mut found = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let marker = parse_marker(lines[i]);
        let fence = if marker.is_some() { i + 1 } else { i };
        if !lines.get(fence).is_some_and(|l| l.starts_with("```")) {
            assert!(
                marker.is_none(),
                "line {}: marker not followed by a block",
                i + 1
            );
            i += 1;
            continue;
        }
        let end = fence
            + 1
            + lines[fence + 1..]
                .iter()
                .position(|l| l.starts_with("```"))
                .unwrap();
        let block: Vec<String> = lines[fence + 1..end]
            .iter()
            .map(|l| l.to_string())
            .collect();
        match marker {
            Some((name, role)) => found.push(Example {
                name,
                role,
                lines: block,
                line_no: i + 1,
            }),
            None => {
                let example = block
                    .iter()
                    .any(|l| hex_line(l).is_some() || l.starts_with("$ nc"));
                assert!(
                    !example,
                    "line {}: an example block without a marker",
                    fence + 1
                );
            }
        }
        i = end + 1;
    }
    found
}

/// One line of a hex dump: its bytes and what the document says they are.
#[derive(Debug)]
struct HexLine {
    bytes: Vec<u8>,
    note: String,
}

/// Splits `00 0a 6f  key: ...` into bytes and note; `None` if the line is no hex line.
fn hex_line(line: &str) -> Option<HexLine> {
    let (hex, note) = line.split_once("  ").unwrap_or((line, ""));
    let note = note.trim().to_string();
    if hex == "..." {
        let text = note.split('"').nth(1).expect("`...` without a quoted text");
        return Some(HexLine {
            bytes: text.as_bytes().to_vec(),
            note,
        });
    }
    let mut bytes = Vec::new();
    for word in hex.split(' ') {
        if word.len() != 2 {
            return None;
        }
        bytes.push(u8::from_str_radix(word, 16).ok()?);
    }
    Some(HexLine { bytes, note })
}

/// The first word of a note: the field's name (`len`, `request_id`, `key`, `opcode`).
fn label(note: &str) -> &str {
    note.split([' ', ':', '=']).next().unwrap_or("")
}

fn big_endian(bytes: &[u8]) -> u64 {
    assert!(bytes.len() <= 8, "{bytes:02x?} is no integer");
    bytes.iter().fold(0, |n, &b| n << 8 | u64::from(b))
}

/// Opcodes by name from the table under `heading` (3.1 requests, 3.2 responses), and error
/// codes by name from 3.5: the document's own tables, so a wrong one fails too.
fn table(doc: &str, heading: &str) -> HashMap<String, u64> {
    let section = doc
        .split(heading)
        .nth(1)
        .expect("section")
        .split("\n### ")
        .next()
        .unwrap();
    let mut names = HashMap::new();
    for row in section.lines().filter(|l| l.starts_with("| ")) {
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        let value = cells[1].trim_matches('`');
        let value = match value.strip_prefix("0x") {
            Some(hex) => u64::from_str_radix(hex, 16),
            None => value.parse(),
        };
        if let Ok(value) = value {
            names.insert(cells[2].to_string(), value);
        }
    }
    names
}

/// The tables a hex dump is checked against.
struct Tables {
    requests: HashMap<String, u64>,
    responses: HashMap<String, u64>,
    errors: HashMap<String, u64>,
}

impl Tables {
    fn of(doc: &str) -> Tables {
        Tables {
            requests: table(doc, "### 3.1 "),
            responses: table(doc, "### 3.2 "),
            errors: table(doc, "### 3.5 "),
        }
    }
}

/// Checks one note against its bytes: `label = N`, `label: N ...`, `label: length N, "text"`
/// and `opcode NAME`.
fn check_note(line: &HexLine, opcodes: &HashMap<String, u64>, at: &str) {
    let note = line.note.as_str();
    if let Some(rest) = note.split_once(": length ").map(|(_, r)| r) {
        let (len, text) = rest.split_once(", ").unwrap_or((rest, ""));
        let len: usize = len.parse().unwrap_or_else(|_| panic!("{at}: {note}"));
        assert_eq!(big_endian(&line.bytes[..2]) as usize, len, "{at}: {note}");
        assert_eq!(line.bytes.len(), 2 + len, "{at}: {note}");
        if !text.is_empty() {
            assert_eq!(
                format!("\"{}\"", String::from_utf8_lossy(&line.bytes[2..])),
                text,
                "{at}"
            );
        }
    } else if let Some(name) = note.strip_prefix("opcode ") {
        let opcode = opcodes
            .get(name)
            .unwrap_or_else(|| panic!("{at}: no opcode {name}"));
        assert_eq!(line.bytes, [*opcode as u8], "{at}: {note}");
    } else if let Some((_, value)) = note.split_once(" = ").or(note.split_once(": ")) {
        let number = value.split(' ').next().unwrap();
        if let Ok(number) = number.parse::<u64>() {
            assert_eq!(big_endian(&line.bytes), number, "{at}: {note}");
        }
    }
}

/// A hex example's bytes, each line's note checked; with the labels of each byte.
fn hex_bytes(example: &Example, opcodes: &HashMap<String, u64>) -> (Vec<u8>, Vec<String>) {
    let (mut bytes, mut labels) = (Vec::new(), Vec::new());
    for (i, line) in example.lines.iter().enumerate() {
        let Some(hex) = hex_line(line) else { continue };
        let at = format!("PROTOCOL.md line {}", example.line_no + 2 + i);
        check_note(&hex, opcodes, &at);
        labels.extend(std::iter::repeat_n(
            label(&hex.note).to_string(),
            hex.bytes.len(),
        ));
        bytes.extend(hex.bytes);
    }
    assert!(!bytes.is_empty(), "example {} has no bytes", example.name);
    if labels[0] == "len" {
        let len = big_endian(&bytes[..4]) as usize;
        assert_eq!(
            len,
            bytes.len() - 4,
            "example {}: `len` is not its length",
            example.name
        );
    }
    (bytes, labels)
}

/// The next whole frame from `stream`, its length prefix included.
async fn read_frame(stream: &mut TcpStream) -> Vec<u8> {
    let mut frame = vec![0u8; 4];
    let read = async {
        stream.read_exact(&mut frame).await.unwrap();
        let len = big_endian(&frame) as usize;
        frame.resize(4 + len, 0);
        stream.read_exact(&mut frame[4..]).await.unwrap();
    };
    tokio::time::timeout(PATIENCE, read)
        .await
        .expect("no frame in time");
    frame
}

/// `got` must be the receive example's bytes, except where its `any=` labels allow.
fn assert_received(example: &Example, tables: &Tables, got: &[u8]) {
    let Role::Receive(any) = &example.role else {
        panic!("{} is not a receive example", example.name);
    };
    let (want, labels) = hex_bytes(example, &tables.responses);
    let masked = |bytes: &[u8]| -> Vec<Option<u8>> {
        let keep =
            |(i, b): (usize, &u8)| (!labels.get(i).is_some_and(|l| any.contains(l))).then_some(*b);
        bytes.iter().enumerate().map(keep).collect()
    };
    assert_eq!(
        masked(got),
        masked(&want),
        "example {} (PROTOCOL.md line {}): the server answered {got:02x?}",
        example.name,
        example.line_no
    );
}

/// A send example's answer must be the response (and error code) its marker names, with
/// its request id.
fn assert_answer(example: &Example, tables: &Tables, sent: &[u8], got: &[u8]) {
    let Role::SendAnswer(opcode, code) = &example.role else {
        panic!("{} has no answer", example.name);
    };
    let at = format!("example {}: the server answered {got:02x?}", example.name);
    assert_eq!(u64::from(got[4]), tables.responses[opcode], "{at}");
    assert_eq!(got[5..13], sent[5..13], "{at}: another request id");
    if let Some(code) = code {
        assert_eq!(big_endian(&got[13..15]), tables.errors[code], "{at}");
    }
}

/// The examples of one scenario, by role: panics if the document has none.
fn of<'a>(all: &'a [Example], name: &str) -> Vec<&'a Example> {
    let found: Vec<&Example> = all.iter().filter(|e| e.name == name).collect();
    assert!(!found.is_empty(), "PROTOCOL.md has no example {name}");
    found
}

/// Sends a send example on a handshaken connection and checks what comes back: the
/// example's answer, or the receive example that follows it.
async fn exchange(server: &Server, examples: &[&Example], tables: &Tables) {
    let mut raw = Raw::connect(server.addr).await.0;
    let send = examples
        .iter()
        .find(|e| matches!(e.role, Role::Send | Role::SendAnswer(..)))
        .expect("a send example");
    let (bytes, _) = hex_bytes(send, &tables.requests);
    raw.send_bytes(&bytes).await;
    let got = read_frame(raw.stream()).await;
    match examples.iter().find(|e| matches!(e.role, Role::Receive(_))) {
        Some(receive) => assert_received(receive, tables, &got),
        None => assert_answer(send, tables, &bytes, &got),
    }
}

/// An ACQUIRE with an acquire id sent twice on one connection: the first answer is the send
/// example's, the second the receive example that follows it (a repeat).
async fn exchange_twice(server: &Server, examples: &[&Example], tables: &Tables) {
    let mut raw = Raw::connect(server.addr).await.0;
    let send = examples
        .iter()
        .find(|e| matches!(e.role, Role::SendAnswer(..)))
        .expect("a send example with its answer");
    let (bytes, _) = hex_bytes(send, &tables.requests);
    raw.send_bytes(&bytes).await;
    let got = read_frame(raw.stream()).await;
    assert_answer(send, tables, &bytes, &got);
    raw.send_bytes(&bytes).await;
    let again = read_frame(raw.stream()).await;
    let receive = examples
        .iter()
        .find(|e| matches!(e.role, Role::Receive(_)))
        .expect("a receive example");
    assert_received(receive, tables, &again);
    assert_eq!(
        got[21..37],
        again[21..37],
        "the repeat names the first lease id"
    );
}

/// The handshake refusal: bytes out, bytes back, then the close.
async fn hello_refused(server: &Server, examples: &[&Example], tables: &Tables) {
    let mut stream = TcpStream::connect(server.addr).await.unwrap();
    let (hello, _) = hex_bytes(examples[0], &tables.requests);
    stream.write_all(&hello).await.unwrap();
    let mut got = Vec::new();
    tokio::time::timeout(PATIENCE, stream.read_to_end(&mut got))
        .await
        .expect("not closed in time")
        .unwrap();
    let (want, _) = hex_bytes(examples[1], &tables.responses);
    assert_eq!(got, want, "{}", String::from_utf8_lossy(&got));
}

/// GRANTED and WATCHING: the document shows only the answer; the request is made here.
async fn answer_only(server: &Server, example: &Example, tables: &Tables) {
    let mut raw = Raw::connect(server.addr).await.0;
    if example.name == "granted" {
        raw.send(7, &acquire_meta("order:1842", 30_000, 0, ""))
            .await;
    } else {
        let held = raw.call(1, acquire_meta("watched", 30_000, 0, "ab")).await;
        assert!(
            matches!(held, tenure_protocol::Response::Granted { .. }),
            "{held:?}"
        );
        let key = tenure_testkit::raw::bytes("watched");
        raw.send(7, &tenure_protocol::Request::Watch { key }).await;
    }
    let got = read_frame(raw.stream()).await;
    assert_received(example, tables, &got);
}

/// Normalises a console line as the convention says: lease ids through `leases` (the
/// document's to the server's, learnt from the first line that shows each), time left as `*`.
fn console_words(line: &str, leases: &mut HashMap<String, String>, learn: Option<&str>) -> String {
    let time_left = ["HELD", "LOCKED", "OK watching HELD"]
        .iter()
        .any(|p| line.starts_with(p))
        || line.ends_with(" repeat");
    let mut words = Vec::new();
    for (i, word) in line.split(' ').enumerate() {
        if let Some(value) = word.strip_prefix("ttl_ms=").filter(|_| time_left) {
            value
                .parse::<u32>()
                .unwrap_or_else(|_| panic!("time left in {line:?}"));
            words.push("ttl_ms=*".to_string());
        } else if let Some(id) = word.strip_prefix("lease=") {
            if let Some(actual) = learn.and_then(|l| l.split(' ').nth(i)) {
                leases.insert(
                    id.to_string(),
                    actual.trim_start_matches("lease=").to_string(),
                );
            }
            words.push("lease=*".to_string());
        } else {
            words.push(
                leases
                    .get(word)
                    .cloned()
                    .unwrap_or_else(|| word.to_string()),
            );
        }
    }
    words.join(" ")
}

/// A console session: each command sent as the document writes it, each reply compared.
async fn console_session(server: &Server, example: &Example) {
    let stream = TcpStream::connect(server.addr).await.unwrap();
    let (read, mut write) = stream.into_split();
    let mut read = BufReader::new(read);
    let mut leases = HashMap::new();
    let lines = &example.lines;
    assert!(
        lines[0].starts_with("$ nc "),
        "{}: starts with `$ nc`",
        example.name
    );
    for pair in lines[1..].chunks(2) {
        let [command, want] = pair else {
            panic!("{}: a command without its reply", example.name)
        };
        let command = console_words(command, &mut leases, None);
        write
            .write_all(format!("{command}\n").as_bytes())
            .await
            .unwrap();
        let mut got = String::new();
        tokio::time::timeout(PATIENCE, read.read_line(&mut got))
            .await
            .unwrap()
            .unwrap();
        let got = got.trim_end_matches('\n');
        let want_words = console_words(want, &mut leases, Some(got));
        let got_words = console_words(got, &mut HashMap::new(), None);
        assert_eq!(
            got_words, want_words,
            "{}: `{command}` was answered {got:?}",
            example.name
        );
    }
}

/// A server with one identity, `orders`, whose secret is the AUTH example's `s3cret`.
async fn server_with_orders(dir: &Path) -> Server {
    let path = dir.join("identities.toml");
    let hash = hash_secret(b"s3cret").unwrap();
    let text =
        format!("[[identity]]\nname = \"orders\"\nsecret-hash = \"{hash}\"\nprefixes = [\"*\"]\n");
    std::fs::write(&path, text).unwrap();
    Server::start_in(dir, |config| config.identities = Some(path)).await
}

async fn run_scenario(name: &str, all: &[Example], tables: &Tables) {
    let dir = tempfile::tempdir().unwrap();
    let examples = of(all, name);
    let server = match name {
        "auth" => server_with_orders(dir.path()).await,
        _ => Server::start(dir.path()).await,
    };
    match name {
        "hello-version-9" => hello_refused(&server, &examples, tables).await,
        "acquire" | "acquire-permits" | "auth" | "cluster-remove" | "cluster-status-extended" => {
            exchange(&server, &examples, tables).await
        }
        "acquire-id" => exchange_twice(&server, &examples, tables).await,
        "granted" | "watching" => answer_only(&server, examples[0], tables).await,
        "session"
        | "semaphore"
        | "escapes-and-refusals"
        | "acquire-id-console"
        | "session-open-console" => console_session(&server, examples[0]).await,
        other => panic!("no scenario {other}"),
    }
    server.stop().await;
}

#[tokio::test]
async fn every_example_in_protocol_md_gets_the_answer_it_shows() {
    let doc = protocol_md();
    let all = examples(&doc);
    let names: BTreeSet<&str> = all.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(
        names,
        BTreeSet::from(SCENARIOS),
        "PROTOCOL.md's examples and this test's"
    );
    let tables = Tables::of(&doc);
    for name in SCENARIOS {
        run_scenario(name, &all, &tables).await;
    }
}

/// PROTOCOL.md 3.3 names every STATS pair, and the server sends exactly those.
#[tokio::test]
async fn stats_names_are_the_ones_protocol_md_lists() {
    let doc = protocol_md();
    let listed = doc
        .split("The names sent,")
        .nth(1)
        .expect("3.3 lists the STATS names")
        .split(". ")
        .next()
        .unwrap();
    let documented: Vec<&str> = listed
        .split('`')
        .skip(1)
        .step_by(2)
        .filter(|name| name.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'))
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path()).await;
    let client = server.client().await;
    let stats = client.stats().await.unwrap();
    let sent: Vec<&str> = stats.iter().map(|(name, _)| name.as_str()).collect();
    assert_eq!(
        sent, documented,
        "STATS names, in order: the server's and PROTOCOL.md's"
    );
    server.stop().await;
}
