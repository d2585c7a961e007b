//! The final report, as aligned text or as JSON.

use std::fmt::Write;

use serde_json::json;

use crate::op::{OpKind, Outcome};
use crate::stats::Stats;

/// A scalar in the report.
#[derive(Clone, Debug)]
pub enum Value {
    /// A count.
    U64(u64),
    /// A rate, ratio or latency.
    F64(f64),
    /// A name.
    Str(String),
}

impl Value {
    fn text(&self) -> String {
        match self {
            Value::U64(n) => n.to_string(),
            Value::F64(x) if x.abs() >= 100.0 => format!("{x:.0}"),
            Value::F64(x) => format!("{x:.3}"),
            Value::Str(s) => s.clone(),
        }
    }

    /// The value in JSON. A rate that is not finite (an empty window) becomes `null`, and
    /// floats keep three decimals, as the text report does, so scripts do not see noise digits.
    fn json(&self) -> serde_json::Value {
        match self {
            Value::U64(n) => json!(n),
            Value::F64(x) if x.is_finite() => json!((x * 1e3).round() / 1e3),
            Value::F64(_) => serde_json::Value::Null,
            Value::Str(s) => json!(s),
        }
    }
}

/// One JSON object from named values, in the order given.
fn object<'a>(items: impl IntoIterator<Item = (&'a str, &'a Value)>) -> serde_json::Value {
    let map: serde_json::Map<String, serde_json::Value> = items
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.json()))
        .collect();
    serde_json::Value::Object(map)
}

/// Figures for one op kind.
pub struct KindReport {
    /// Op kind name.
    pub name: &'static str,
    /// Replies in the window.
    pub count: u64,
    /// Replies per second in the window.
    pub rate_per_s: f64,
    /// Rate the workload aimed at.
    pub target_per_s: Option<f64>,
    /// Non-zero outcome counts.
    pub outcomes: Vec<(&'static str, u64)>,
    /// p50, p90, p99, p99.9 and max latency from intended send, microseconds.
    pub latency_us: [f64; 5],
    /// The same quantiles from actual send: the target's share without the generator's lag.
    pub service_us: [f64; 5],
}

/// Everything a run reports.
pub struct Report {
    /// Settings echoed back.
    pub settings: Vec<(&'static str, Value)>,
    /// Length of the measured window, seconds.
    pub window_s: f64,
    /// Per op kind, only kinds that were sent in the window.
    pub kinds: Vec<KindReport>,
    /// Scenario-specific figures.
    pub summary: Vec<(&'static str, Value)>,
    /// Memory and CPU figures.
    pub resources: Vec<(&'static str, Value)>,
    /// Per-connection setup cost (TCP connect, TLS, handshake, AUTH), before the run.
    pub setup: Vec<(&'static str, Value)>,
    /// Error replies by name, whole run.
    pub errors: Vec<(String, u64)>,
}

/// Quantiles reported: p50, p90, p99, p99.9, max.
const QUANTILES: [(&str, f64); 5] = [
    ("p50", 0.5),
    ("p90", 0.9),
    ("p99", 0.99),
    ("p99.9", 0.999),
    ("max", 1.0),
];

/// Per-kind figures from the window's stats.
pub fn kinds(
    stats: &Stats,
    window_s: f64,
    targets: [Option<f64>; OpKind::COUNT],
) -> Vec<KindReport> {
    let mut out = Vec::new();
    for kind in OpKind::ALL {
        let k = &stats.measured[kind as usize];
        if k.count() == 0 {
            continue;
        }
        let outcomes = Outcome::NAMES
            .iter()
            .zip(k.outcomes)
            .filter(|(_, n)| *n > 0)
            .map(|(name, n)| (*name, n))
            .collect();
        let latency_us = QUANTILES.map(|(_, q)| k.latency_ns.value_at_quantile(q) as f64 / 1e3);
        let service_us = QUANTILES.map(|(_, q)| k.service_ns.value_at_quantile(q) as f64 / 1e3);
        out.push(KindReport {
            name: kind.name(),
            count: k.count(),
            rate_per_s: k.count() as f64 / window_s,
            target_per_s: targets[kind as usize],
            outcomes,
            latency_us,
            service_us,
        });
    }
    out
}

impl Report {
    /// Aligned text for people.
    pub fn text(&self) -> String {
        let mut out = String::new();
        let settings: Vec<String> = self
            .settings
            .iter()
            .map(|(k, v)| format!("{k}={}", v.text()))
            .collect();
        let _ = writeln!(out, "settings: {}", settings.join(" "));
        let _ = writeln!(out, "window: {:.2} s", self.window_s);
        let _ = writeln!(
            out,
            "{:<8} {:>10} {:>10} {:>10} {:>8} {:>8} {:>8} {:>8} {:>9}  outcomes (per s)",
            "op", "count", "rate/s", "target/s", "p50 us", "p90 us", "p99 us", "p99.9 us", "max us"
        );
        for k in &self.kinds {
            let target = k.target_per_s.map_or("-".into(), |t| format!("{t:.0}"));
            let [p50, p90, p99, p999, max] = k.latency_us;
            let outcomes: Vec<String> = k
                .outcomes
                .iter()
                .map(|(n, c)| format!("{n} {c} ({:.0})", *c as f64 / self.window_s))
                .collect();
            let _ = writeln!(
                out,
                "{:<8} {:>10} {:>10.0} {:>10} {p50:>8.1} {p90:>8.1} {p99:>8.1} {p999:>8.1} {max:>9.1}  {}",
                k.name, k.count, k.rate_per_s, target, outcomes.join(", ")
            );
        }
        let _ = writeln!(
            out,
            "service time, from actual send (the generator's own lag excluded):"
        );
        for k in &self.kinds {
            let [p50, p90, p99, p999, max] = k.service_us;
            let _ = writeln!(
                out,
                "{:<8} {:>10} {:>10} {:>10} {p50:>8.1} {p90:>8.1} {p99:>8.1} {p999:>8.1} {max:>9.1}",
                k.name, "", "", ""
            );
        }
        let sections = [
            ("summary", &self.summary),
            ("resources", &self.resources),
            ("setup per connection", &self.setup),
        ];
        for (title, items) in sections {
            if !items.is_empty() {
                let _ = writeln!(out, "{title}:");
                for (k, v) in items.iter() {
                    let _ = writeln!(out, "  {k:<32} {}", v.text());
                }
            }
        }
        for (name, n) in &self.errors {
            let _ = writeln!(out, "error replies {name}: {n}");
        }
        out
    }

    /// One JSON object for scripts.
    pub fn json(&self) -> String {
        let pairs = |items: &'_ [(&'static str, Value)]| object(items.iter().map(|(k, v)| (*k, v)));
        let ops: serde_json::Map<String, serde_json::Value> = self
            .kinds
            .iter()
            .map(|k| (k.name.to_owned(), k.json()))
            .collect();
        let errors: serde_json::Map<String, serde_json::Value> = self
            .errors
            .iter()
            .map(|(name, n)| (name.clone(), json!(n)))
            .collect();
        json!({
            "settings": pairs(&self.settings),
            "window_s": Value::F64(self.window_s).json(),
            "ops": ops,
            "summary": pairs(&self.summary),
            "resources": pairs(&self.resources),
            "setup": pairs(&self.setup),
            "errors": errors,
        })
        .to_string()
    }
}

impl KindReport {
    /// This op kind's figures as one JSON object.
    fn json(&self) -> serde_json::Value {
        let mut items = vec![
            ("count", Value::U64(self.count)),
            ("rate_per_s", Value::F64(self.rate_per_s)),
        ];
        if let Some(t) = self.target_per_s {
            items.push(("target_per_s", Value::F64(t)));
        }
        let names = ["p50_us", "p90_us", "p99_us", "p999_us", "max_us"];
        items.extend(names.into_iter().zip(self.latency_us.map(Value::F64)));
        let names = [
            "service_p50_us",
            "service_p90_us",
            "service_p99_us",
            "service_p999_us",
            "service_max_us",
        ];
        items.extend(names.into_iter().zip(self.service_us.map(Value::F64)));
        items.extend(
            self.outcomes
                .iter()
                .map(|(name, n)| (*name, Value::U64(*n))),
        );
        object(items.iter().map(|(k, v)| (*k, v)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_is_valid_and_escaped() {
        let report = Report {
            settings: vec![("target", Value::Str("a\"b\\c\n".into()))],
            window_s: 1.0,
            kinds: Vec::new(),
            summary: vec![("rate", Value::F64(f64::NAN))],
            resources: Vec::new(),
            setup: Vec::new(),
            errors: vec![("BAD \"KEY\"".into(), 2)],
        };
        let parsed: serde_json::Value = serde_json::from_str(&report.json()).unwrap();
        assert_eq!(parsed["settings"]["target"], "a\"b\\c\n");
        assert!(parsed["summary"]["rate"].is_null());
        assert_eq!(parsed["errors"]["BAD \"KEY\""], 2);
    }
}
