//! The final report, as aligned text or as JSON.

use std::fmt::Write;

use crate::stats::Stats;
use crate::wire::{OpKind, Outcome};

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

    fn json(&self) -> String {
        match self {
            Value::U64(n) => n.to_string(),
            Value::F64(x) if x.is_finite() => format!("{x:.3}"),
            Value::F64(_) => "null".to_owned(),
            Value::Str(s) => json_string(s),
        }
    }
}

fn json_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
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
pub fn kinds(stats: &Stats, window_s: f64, targets: [Option<f64>; 4]) -> Vec<KindReport> {
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
        for (title, items) in [("summary", &self.summary), ("resources", &self.resources)] {
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
        let object = |items: &[(&'static str, Value)]| {
            let fields: Vec<String> = items
                .iter()
                .map(|(k, v)| format!("{}:{}", json_string(k), v.json()))
                .collect();
            format!("{{{}}}", fields.join(","))
        };
        let kinds: Vec<String> = self
            .kinds
            .iter()
            .map(|k| {
                let mut items = vec![
                    ("count", Value::U64(k.count)),
                    ("rate_per_s", Value::F64(k.rate_per_s)),
                ];
                if let Some(t) = k.target_per_s {
                    items.push(("target_per_s", Value::F64(t)));
                }
                let names = ["p50_us", "p90_us", "p99_us", "p999_us", "max_us"];
                for (name, us) in names.iter().zip(k.latency_us) {
                    items.push((name, Value::F64(us)));
                }
                let names = [
                    "service_p50_us",
                    "service_p90_us",
                    "service_p99_us",
                    "service_p999_us",
                    "service_max_us",
                ];
                for (name, us) in names.iter().zip(k.service_us) {
                    items.push((name, Value::F64(us)));
                }
                for (name, n) in &k.outcomes {
                    items.push((name, Value::U64(*n)));
                }
                format!("{}:{}", json_string(k.name), object(&items))
            })
            .collect();
        let errors: Vec<String> = self
            .errors
            .iter()
            .map(|(k, n)| format!("{}:{n}", json_string(k)))
            .collect();
        format!(
            "{{\"settings\":{},\"window_s\":{:.3},\"ops\":{{{}}},\"summary\":{},\"resources\":{},\"errors\":{{{}}}}}",
            object(&self.settings),
            self.window_s,
            kinds.join(","),
            object(&self.summary),
            object(&self.resources),
            errors.join(",")
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_escapes() {
        assert_eq!(json_string("a\"b\\c\n"), "\"a\\\"b\\\\c\\u000a\"");
    }
}
