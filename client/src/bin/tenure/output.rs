//! What the command line prints: one line per answer, as `name=value` pairs or as a JSON
//! object (through serde_json), to stdout or, for `run`/`elect`, to stderr.
//!
//! Field names are the text console's (PROTOCOL.md section 4): `token`, `lease`, `ttl_ms`,
//! `waited_ms`, `waiters`, `meta`, so that a person sees one name per thing on both surfaces.

use std::time::Duration;

/// One value of an output line.
enum Value {
    Text(String),
    Number(u64),
}

/// One output line: ordered name/value pairs, printed as `name=value ...` or as JSON.
#[derive(Default)]
pub struct Line {
    pairs: Vec<(String, Value)>,
}

impl Line {
    /// A line starting with `result=<result>`.
    pub fn new(result: &str) -> Line {
        Line::default().text("result", result)
    }

    /// Appends a text field.
    pub fn text(mut self, name: &str, value: impl Into<String>) -> Line {
        self.pairs
            .push((name.to_owned(), Value::Text(value.into())));
        self
    }

    /// Appends a number field.
    pub fn number(mut self, name: &str, value: u64) -> Line {
        self.pairs.push((name.to_owned(), Value::Number(value)));
        self
    }

    /// The line as `name=value` pairs, or as one JSON object with the fields in order.
    pub fn render(&self, json: bool) -> String {
        let fields = self.pairs.iter().map(|(name, value)| {
            let value = match value {
                Value::Number(n) => n.to_string(),
                Value::Text(t) if json => json_string(t),
                Value::Text(t) => kv_value(t),
            };
            if json {
                format!("{}:{value}", json_string(name))
            } else {
                format!("{name}={value}")
            }
        });
        if json {
            format!("{{{}}}", fields.collect::<Vec<_>>().join(","))
        } else {
            fields.collect::<Vec<_>>().join(" ")
        }
    }
}

/// A value as it appears after `name=`: bare if it is a simple word, a JSON string otherwise.
pub fn kv_value(text: &str) -> String {
    let simple = !text.is_empty()
        && text
            .chars()
            .all(|c| c.is_ascii_graphic() && c != '"' && c != '=' && c != '\\');
    if simple {
        text.to_owned()
    } else {
        json_string(text)
    }
}

/// `text` as a quoted, escaped JSON string. serde_json's map would sort the fields, so the
/// object is assembled by [`Line::render`] and only the strings go through serde_json.
fn json_string(text: &str) -> String {
    serde_json::to_string(text).expect("a string always serializes")
}

/// Whole milliseconds, saturating.
pub fn ms(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// Where output lines go: stdout, except for `run`/`elect`, whose stdout is the command's.
#[derive(Clone, Copy)]
pub struct Out {
    /// JSON objects instead of `name=value` lines.
    pub json: bool,
    /// Print on stderr instead of stdout.
    pub to_stderr: bool,
}

impl Out {
    /// Prints one line.
    pub fn print(&self, line: Line) {
        let text = line.render(self.json);
        if self.to_stderr {
            eprintln!("{text}");
        } else {
            stdout_line(&text);
        }
    }

    /// Prints `result=ERROR error=<message>`.
    pub fn error(&self, message: impl Into<String>) {
        self.print(Line::new("ERROR").text("error", message));
    }

    /// Prints a request's failure as `result=ERROR [code=<CODE>] error=<message>`: a refusal
    /// with a code (the server's, or the client's own check of an argument) carries it as
    /// `code=`, and its message is the refusal's own words alone, without the `server error
    /// <CODE>: ` (or `invalid argument <CODE>: `) that `code=` already says and without the
    /// context added around it (`cannot connect to <addr>: ` for a refusal met while
    /// connecting, such as a wrong secret's). Any other failure is its whole chain, context
    /// first.
    pub fn failure(&self, error: &anyhow::Error) {
        let Some(typed) = error.downcast_ref::<tenure::Error>() else {
            return self.error(format!("{error:#}"));
        };
        let line = match typed.code() {
            Some(code) => Line::new("ERROR").text("code", code.name()),
            None => Line::new("ERROR"),
        };
        let message = match typed {
            tenure::Error::Server { message, .. } | tenure::Error::Invalid { message, .. } => {
                message.clone()
            }
            _ => format!("{error:#}"),
        };
        self.print(line.text("error", message));
    }
}

/// Writes one line on stdout. A reader that has gone away (`tenure cluster status | head
/// -1`) ends the program quietly, as it ends `cat`, instead of the panic `println!` gives.
pub fn stdout_line(text: &str) {
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    if let Err(e) = writeln!(stdout, "{text}").and_then(|()| stdout.flush()) {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(i32::from(crate::exit::EXIT_OK));
        }
        eprintln!(
            "error={}",
            kv_value(&format!("cannot write to stdout: {e}"))
        );
        std::process::exit(i32::from(crate::exit::EXIT_ERROR));
    }
}

/// A warning line on stderr, never mixed into the answers on stdout.
pub fn warn(message: &str) {
    eprintln!("warning={}", kv_value(message));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_render_as_key_value_and_json() {
        let line = Line::new("HELD")
            .text("key", "a b")
            .number("token", 7)
            .text("meta", "");
        assert_eq!(
            line.render(false),
            r#"result=HELD key="a b" token=7 meta="""#
        );
        assert_eq!(
            line.render(true),
            r#"{"result":"HELD","key":"a b","token":7,"meta":""}"#
        );
        assert_eq!(json_string("q\"\\\n\u{1}"), r#""q\"\\\n\u0001""#);
    }

    #[test]
    fn json_lines_are_valid_json_whatever_the_text() {
        let nasty = "quote\" back\\slash\nnew\ttab\u{1}\u{7f} é 🔒 </script>";
        let line = Line::new("HELD")
            .text("meta", nasty)
            .text(nasty, "as a name too");
        let parsed: serde_json::Value =
            serde_json::from_str(&line.render(true)).expect("valid JSON");
        assert_eq!(parsed["meta"], nasty);
        assert_eq!(parsed[nasty], "as a name too");
        assert_eq!(kv_value("plain"), "plain");
        assert_eq!(kv_value("a=b"), r#""a=b""#);
    }
}
