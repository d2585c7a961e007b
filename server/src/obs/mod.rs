//! Instruments only: counters ([`stats::Stats`], STATS' numbers) and Prometheus
//! histograms and tallies ([`metrics`]) that the layers below the composition root take as
//! arguments and bump. What reads them for a scrape (`crate::scrape`) or a STATS reply
//! (`crate::executor`) lives above; nothing here imports another module of this crate.

pub mod metrics;
pub mod stats;
