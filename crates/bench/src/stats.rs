//! Percentiles, rates and the peak-memory sampler.

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use serde::Serialize;

/// Latency summary in milliseconds.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Latency {
    pub count: usize,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

impl Latency {
    /// From samples in milliseconds (any order).
    pub fn of(mut samples: Vec<f64>) -> Latency {
        if samples.is_empty() {
            return Latency::default();
        }
        samples.sort_by(f64::total_cmp);
        Latency {
            count: samples.len(),
            p50_ms: percentile(&samples, 0.50),
            p99_ms: percentile(&samples, 0.99),
            max_ms: samples[samples.len() - 1],
        }
    }
}

/// Nearest-rank percentile of sorted samples.
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Events per second.
pub fn rate(count: u64, elapsed: Duration) -> f64 {
    let secs = elapsed.as_secs_f64();
    if secs <= 0.0 {
        return 0.0;
    }
    count as f64 / secs
}

/// `part / whole` in percent.
pub fn ratio(part: f64, whole: f64) -> f64 {
    if whole <= 0.0 {
        return 0.0;
    }
    part * 100.0 / whole
}

pub fn ms(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1000.0
}

/// `VmHWM` (peak resident set) of a process in KiB.
pub fn peak_rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// Peak RSS per service label over every process it ran as (each start is a
/// new process with its own high-water mark).
#[derive(Clone, Default)]
pub struct PeakMemory(Arc<Mutex<BTreeMap<String, u64>>>);

impl PeakMemory {
    pub fn record(&self, label: &str, pid: u32) {
        if let Some(kib) = peak_rss_kib(pid) {
            if let Ok(mut peaks) = self.0.lock() {
                let peak = peaks.entry(label.to_owned()).or_insert(0);
                *peak = (*peak).max(kib);
            }
        }
    }

    pub fn snapshot(&self) -> BTreeMap<String, u64> {
        self.0.lock().map(|p| p.clone()).unwrap_or_default()
    }
}

/// How long a phase's wait may see its count stand still before it fails: a
/// service that died, or a sink whose stream ended, fails the phase within
/// a minute instead of at its deadline (up to 30 minutes).
pub const STALL: Duration = Duration::from_secs(60);

/// A wait's count (messages received, events applied, rows left) and when
/// it last moved.
pub struct Progress {
    count: u64,
    moved: Instant,
}

impl Progress {
    pub fn new(count: u64) -> Progress {
        Progress {
            count,
            moved: Instant::now(),
        }
    }

    /// Records `count`; an error naming `what` when it has not moved for
    /// [`STALL`].
    pub fn check(&mut self, count: u64, what: impl std::fmt::Display) -> anyhow::Result<()> {
        if count != self.count {
            (self.count, self.moved) = (count, Instant::now());
        }
        anyhow::ensure!(
            self.moved.elapsed() < STALL,
            "{what}: stalled at {count} for {STALL:?} (a service stopped?)"
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let samples: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&samples, 0.5), 50.0);
        assert_eq!(percentile(&samples, 0.99), 99.0);
        let l = Latency::of(vec![3.0, 1.0, 2.0]);
        assert_eq!((l.p50_ms, l.max_ms, l.count), (2.0, 3.0, 3));
    }
}
