//! Printing progress, and writing the results: JSON, the markdown table
//! (also spliced into BENCHMARKS.md between its result markers) and the
//! SVG chart.

use std::fmt::Write;

use serde::Serialize;

use crate::{
    api::Load,
    chart::{self, Panel, Series},
    consumers::Apply,
    relay::{BacklogSample, Drain},
    stats::ratio,
    Results,
};

/// The machine the numbers come from.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Machine {
    pub cores: usize,
    /// `MemTotal` of `/proc/meminfo`.
    pub memory_mib: u64,
    /// The cgroup's memory limit (`/sys/fs/cgroup/memory.max`), when one is
    /// set: what the run may really use.
    pub memory_limit_mib: Option<u64>,
    pub cpu: String,
}

impl Machine {
    pub fn read() -> Machine {
        let memory_kib = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|m| {
                m.lines()
                    .find_map(|l| l.strip_prefix("MemTotal:"))
                    .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            })
            .unwrap_or_default();
        let cpu = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|c| {
                c.lines()
                    .find_map(|l| l.strip_prefix("model name"))
                    .map(|v| v.trim_start_matches([' ', '\t', ':']).to_owned())
            })
            .unwrap_or_default();
        let memory_limit_mib = std::fs::read_to_string("/sys/fs/cgroup/memory.max")
            .ok()
            .and_then(|limit| limit.trim().parse::<u64>().ok())
            .map(|bytes| bytes / (1024 * 1024));
        Machine {
            cores: std::thread::available_parallelism().map_or(1, usize::from),
            memory_mib: memory_kib / 1024,
            memory_limit_mib,
            cpu,
        }
    }
}

pub fn now_utc() -> String {
    let now = time::OffsetDateTime::now_utc();
    format!(
        "{:04}-{:02}-{:02} {:02}:{:02}:{:02} UTC",
        now.year(),
        u8::from(now.month()),
        now.day(),
        now.hour(),
        now.minute(),
        now.second()
    )
}

pub fn print_load(label: &str, load: &Load) {
    println!(
        "  {label}: {} in {:.1} s = {:.0}/s, p50 {:.1} ms, p99 {:.1} ms, {} errors",
        load.requests,
        load.seconds,
        load.per_second,
        load.latency.p50_ms,
        load.latency.p99_ms,
        load.errors
    );
}

pub fn print_drain(label: &str, drain: &Drain) {
    println!(
        "  {label}: {} events, {:.0}/s (first to last {:.1} s, wall {:.1} s)",
        drain.events, drain.per_second, drain.span_seconds, drain.wall_seconds
    );
}

pub fn print_apply(label: &str, apply: &Apply) {
    println!(
        "  {label}: {} events, {:.0}/s (applying for {:.1} s, wall {:.1} s)",
        apply.events, apply.per_second, apply.span_seconds, apply.wall_seconds
    );
}

fn verdict(ok: bool) -> &'static str {
    if ok {
        "yes"
    } else {
        "**no**"
    }
}

/// The issue's targets.
const API_TARGET_PCT: f64 = 85.0;
const RELAY_TARGET_PCT: f64 = 80.0;
const CONSUMER_TARGET_PCT: f64 = 80.0;
const E2E_P50_MS: f64 = 20.0;
const E2E_P99_MS: f64 = 100.0;

/// The services whose peak RSS the issue bounds: each has a verdict, and
/// one the run did not sample fails it.
const SERVICES: [&str; 5] = [
    "inventory-consumer",
    "ledger-consumer",
    "loyalty-consumer",
    "order-api",
    "outbox-relay",
];

/// Each service's peak RSS in MiB (`None`: not sampled), the issue's
/// services first.
fn peaks_mib(r: &Results) -> Vec<(String, Option<f64>)> {
    let mut peaks: Vec<(String, Option<f64>)> = SERVICES
        .iter()
        .map(|s| {
            (
                (*s).to_owned(),
                r.peak_rss_kib.get(*s).map(|kib| *kib as f64 / 1024.0),
            )
        })
        .collect();
    for (service, kib) in &r.peak_rss_kib {
        if !SERVICES.contains(&service.as_str()) {
            peaks.push((service.clone(), Some(*kib as f64 / 1024.0)));
        }
    }
    peaks
}

/// The end-to-end targets' common condition: latencies measured, and no
/// order failed in the run or in the sustained run that set its pace (a
/// sustained maximum shed by errors would pace it lower).
fn e2e_clean(r: &Results) -> bool {
    r.e2e.count > 0 && r.e2e_orders.errors == 0 && r.sustain_orders.errors == 0
}

/// The peak RSS limit of `service` in MiB.
fn rss_limit_mib(service: &str) -> u32 {
    if service == "order-api" {
        128
    } else {
        64
    }
}

/// One target and whether the run met it (`verdicts` in latest.json: the
/// table's last column, readable without the markdown).
#[derive(Debug, Serialize)]
pub struct Verdict {
    pub stage: String,
    pub value: f64,
    pub unit: &'static str,
    pub target: String,
    pub met: bool,
}

pub fn verdicts(r: &Results) -> Vec<Verdict> {
    let mut out = Vec::new();
    let api = ratio(r.api.per_second, r.api_raw.per_second);
    out.push(Verdict {
        stage: "API".into(),
        value: api,
        unit: "% of raw",
        target: format!(">= {API_TARGET_PCT} %, no errors"),
        met: api >= API_TARGET_PCT && r.api.errors == 0 && r.api_raw.errors == 0,
    });
    for (label, drain, raw) in [
        ("relay, 1 relay", &r.relay_one, &r.relay_raw),
        ("relay, 2 relays", &r.relay_two, &r.relay_raw_two),
    ] {
        let q = ratio(drain.per_second, raw.per_second);
        out.push(Verdict {
            stage: label.into(),
            value: q,
            unit: "% of raw",
            target: format!(">= {RELAY_TARGET_PCT} %"),
            met: q >= RELAY_TARGET_PCT,
        });
    }
    for (name, (applied, raw, _)) in &r.consumers {
        let q = ratio(applied.per_second, raw.per_second);
        out.push(Verdict {
            stage: format!("consumer {name}"),
            value: q,
            unit: "% of raw",
            target: format!(">= {CONSUMER_TARGET_PCT} %"),
            met: q >= CONSUMER_TARGET_PCT,
        });
    }
    let e2e_ok = e2e_clean(r);
    for (stage, value, limit) in [
        ("end to end p50", r.e2e.p50_ms, E2E_P50_MS),
        ("end to end p99", r.e2e.p99_ms, E2E_P99_MS),
    ] {
        out.push(Verdict {
            stage: stage.into(),
            value,
            unit: "ms",
            target: format!("< {limit} ms, no failed order"),
            met: e2e_ok && value < limit,
        });
    }
    for (service, mib) in peaks_mib(r) {
        let limit = rss_limit_mib(&service);
        out.push(Verdict {
            stage: format!("peak RSS {service}"),
            value: mib.unwrap_or_default(),
            unit: "MiB",
            target: format!("< {limit} MiB (sampled)"),
            met: mib.is_some_and(|mib| mib < f64::from(limit)),
        });
    }
    out
}

/// List the targets `r` missed, or say that it met them all; how many it
/// missed.
pub fn print_missed(r: &Results) -> usize {
    let missed: Vec<Verdict> = verdicts(r).into_iter().filter(|v| !v.met).collect();
    if missed.is_empty() {
        println!("every target met");
    }
    for v in &missed {
        println!(
            "target missed: {}: {:.1} {} (target {})",
            v.stage, v.value, v.unit, v.target
        );
    }
    missed.len()
}

/// "  <label>: 1234/s against 1500/s raw: 82 %" (the single-phase modes).
pub fn print_ratio(label: &str, measured: f64, raw: f64) {
    println!(
        "  {label}: {measured:.0}/s against {raw:.0}/s raw: {:.1} %",
        ratio(measured, raw)
    );
}

/// The markdown table of a run.
pub fn table(r: &Results) -> String {
    let mut md = String::new();
    let limit = r
        .machine
        .memory_limit_mib
        .map(|mib| format!(", cgroup memory limit {mib} MiB"))
        .unwrap_or_default();
    let _ = writeln!(
        md,
        "Run {} on {} cores, {} MiB{limit} ({}).\n",
        r.date, r.machine.cores, r.machine.memory_mib, r.machine.cpu
    );
    let _ = writeln!(
        md,
        "| Stage | Measured | Raw limit (same run) | Ratio | Target | Met |"
    );
    let _ = writeln!(md, "|---|---|---|---|---|---|");
    // The "Met" column reads the verdicts (latest.json's), so the two
    // cannot disagree.
    let verdicts = verdicts(r);
    let met = |stage: &str| verdict(verdicts.iter().any(|v| v.stage == stage && v.met));
    let api_ratio = ratio(r.api.per_second, r.api_raw.per_second);
    // A failed request is not in a rate or a latency: the verdict asks
    // for none at all.
    let _ = writeln!(
        md,
        "| API `POST /orders` ({} clients) | {:.0} orders/s, p50 {:.1} ms, p99 {:.1} ms, {} errors | {:.0} tx/s, p50 {:.1} ms, p99 {:.1} ms, {} errors | {:.1} % | ≥ 85 %, no errors | {} |",
        r.settings.as_ref().map_or(0, |s| s.concurrency),
        r.api.per_second, r.api.latency.p50_ms, r.api.latency.p99_ms, r.api.errors,
        r.api_raw.per_second, r.api_raw.latency.p50_ms, r.api_raw.latency.p99_ms, r.api_raw.errors,
        api_ratio, met("API")
    );
    for (label, drain, raw, relays) in [
        ("1 relay", &r.relay_one, &r.relay_raw, 1),
        ("2 relays", &r.relay_two, &r.relay_raw_two, 2),
    ] {
        let q = ratio(drain.per_second, raw.per_second);
        let _ = writeln!(
            md,
            "| Relay drain, {label} ({} events of {} orders, {} per synthetic order) | {:.0} events/s (wall {:.1} s) | {:.0} msg/s confirm-publish ({} channels × {} in flight, {relays} connection{}) | {:.1} % | ≥ 80 % | {} |",
            drain.events, r.relay_backlog_orders, r.relay_events_per_order, drain.per_second, drain.wall_seconds, raw.per_second,
            relays * r.relay_workers, r.relay_window, if relays == 1 { "" } else { "s" },
            q, met(&format!("relay, {label}"))
        );
    }
    for (name, (applied, raw, unprepared)) in &r.consumers {
        let q = ratio(applied.per_second, raw.per_second);
        let _ = writeln!(
            md,
            "| {name} apply ({} events of {} orders placed, paid, delivered; {} partitions) | {:.0} events/s | {:.0} tx/s raw inbox + effect ({:.0} tx/s with them one at a time as text, as before) | {:.1} % | ≥ 80 % | {} |",
            applied.events, r.consumer_orders, r.consumer_partitions, applied.per_second, raw.per_second, unprepared.per_second, q, met(&format!("consumer {name}"))
        );
    }
    let _ = writeln!(
        md,
        "| Whole pipeline sustained ({} clients, {} orders, everything running) | {:.0} orders/s applied by all three consumers, {} errors | | | (sets the end-to-end pace) | |",
        r.settings.as_ref().map(|s| s.concurrency).unwrap_or_default(),
        r.sustain_orders.requests,
        r.sustained,
        r.sustain_orders.errors
    );
    let _ = writeln!(
        md,
        "| End to end at {:.0} orders/s ({} orders) | p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms, {} failed orders (sustained run: {}) | | | p50 < 20 ms, p99 < 100 ms, no failed order | {} |",
        r.e2e_rate, r.e2e.count, r.e2e.p50_ms, r.e2e.p99_ms, r.e2e.max_ms, r.e2e_orders.errors, r.sustain_orders.errors,
        // One row for both end-to-end verdicts: met when both are.
        verdict(
            verdicts
                .iter()
                .filter(|v| v.stage.starts_with("end to end"))
                .all(|v| v.met)
        )
    );
    for (service, mib) in peaks_mib(r) {
        let limit = rss_limit_mib(&service);
        let measured = mib.map_or_else(|| "not sampled".to_owned(), |mib| format!("{mib:.1} MiB"));
        let _ = writeln!(
            md,
            "| Peak RSS {service} | {measured} | | | < {limit} MiB | {} |",
            met(&format!("peak RSS {service}"))
        );
    }
    if !r.cpu.is_empty() {
        let groups: std::collections::BTreeSet<&String> =
            r.cpu.values().flat_map(|(_, u)| u.seconds.keys()).collect();
        let _ = writeln!(
            md,
            "\nCPU per event in µs (user + system, every process on the machine, same intervals as above):\n"
        );
        let header: Vec<&str> = groups.iter().map(|g| g.as_str()).collect();
        let _ = writeln!(md, "| Interval | events | {} | total |", header.join(" | "));
        let _ = writeln!(md, "|---|---|{}---|", "---|".repeat(groups.len()));
        for (label, (events, usage)) in &r.cpu {
            let per = |seconds: f64| seconds * 1e6 / (*events).max(1) as f64;
            let cells: Vec<String> = groups
                .iter()
                .map(|g| {
                    usage
                        .seconds
                        .get(*g)
                        .map(|s| format!("{:.0}", per(*s)))
                        .unwrap_or_default()
                })
                .collect();
            let total: f64 = usage.seconds.values().sum();
            let _ = writeln!(
                md,
                "| {label} | {events} | {} | {:.0} |",
                cells.join(" | "),
                per(total)
            );
        }
    }
    if !r.relay_wal.is_empty() {
        let _ = writeln!(
            md,
            "\nPostgreSQL's WAL per event in the relay phase (a CHECKPOINT before each drain's backlog is written: backlog and drain share a checkpoint cycle; the raw loop writes nothing to PostgreSQL, its rows are the background's):\n"
        );
        let _ = writeln!(
            md,
            "| Interval | events | WAL records | WAL bytes | full-page images | checkpoints started (drains: since the backlog's CHECKPOINT) |"
        );
        let _ = writeln!(md, "|---|---|---|---|---|---|");
        for (label, (events, wal)) in &r.relay_wal {
            let (records, bytes, full_pages) = wal.per_event_values(*events);
            let _ = writeln!(
                md,
                "| {label} | {events} | {records:.1} | {bytes:.0} | {full_pages:.2} | {} |",
                wal.checkpoints
            );
        }
    }
    md
}

fn chart_of(r: &Results) -> String {
    let per_second = |load: &Load| -> Vec<(f64, f64)> {
        load.timeline
            .iter()
            .enumerate()
            .filter(|(s, _)| (*s as f64) < load.seconds.floor())
            .map(|(s, n)| (s as f64, *n as f64))
            .collect()
    };
    let by_second = |timeline: &[u64]| -> Vec<(f64, f64)> {
        timeline
            .iter()
            .enumerate()
            .map(|(s, n)| (s as f64, *n as f64))
            .collect()
    };
    // A second without an order has no latency (NaN): no point.
    let e2e_latency = |pick: fn(&(f64, f64, f64, f64)) -> f64| -> Vec<(f64, f64)> {
        r.e2e_timeline
            .iter()
            .map(|t| (t.0, pick(t)))
            .filter(|(_, ms)| ms.is_finite())
            .collect()
    };
    // A panel per consumer: six lines in one panel, at rates a few hundred
    // events/s apart, would cross each other.
    let consumers = r.consumers.iter().map(|(name, (applied, raw, _))| Panel {
        title: format!(
            "Phase 3: {name} vs the raw transaction, applied per second (each side's halves in turn)"
        ),
        unit: "/s".into(),
        series: vec![
            Series {
                name: format!("{name} events/s"),
                color: "#1f77b4",
                points: by_second(&applied.timeline),
            },
            Series {
                name: "raw inbox + effect tx/s".into(),
                color: "#ff7f0e",
                points: by_second(&raw.timeline),
            },
        ],
    });
    let mut panels = vec![
        Panel {
            title: "Phase 1: POST /orders vs the raw transaction (per second)".into(),
            unit: "/s".into(),
            series: vec![
                Series {
                    name: "order-api orders/s".into(),
                    color: "#1f77b4",
                    points: per_second(&r.api),
                },
                Series {
                    name: "raw tokio-postgres tx/s".into(),
                    color: "#ff7f0e",
                    points: per_second(&r.api_raw),
                },
            ],
        },
        Panel {
            title: "Phase 2: messages reaching the sink per second (each side from its start)"
                .into(),
            unit: "/s".into(),
            series: [
                ("raw confirm-publish", "#ff7f0e", &r.relay_raw),
                ("raw, 2 connections", "#d62728", &r.relay_raw_two),
                ("1 relay", "#1f77b4", &r.relay_one),
                ("2 relays", "#2ca02c", &r.relay_two),
            ]
            .into_iter()
            .map(|(name, color, drain)| Series {
                name: name.into(),
                color,
                points: by_second(&drain.timeline),
            })
            .collect(),
        },
    ];
    panels.extend(consumers);
    panels.extend([
        Panel {
            title: format!(
                "Phase 4: sustained maximum, {} clients back to back: committed, and applied by \
                 all three, per second",
                r.settings.as_ref().map_or(0, |s| s.concurrency)
            ),
            unit: "/s".into(),
            series: vec![
                Series {
                    name: "orders committed/s".into(),
                    color: "#2ca02c",
                    points: r.sustain_timeline.iter().map(|t| (t.0, t.1)).collect(),
                },
                Series {
                    name: "applied by all three/s".into(),
                    color: "#9467bd",
                    points: r.sustain_applied.clone(),
                },
            ],
        },
        Panel {
            title: format!(
                "Phase 4: end-to-end run at {:.0} orders/s: committed, and applied by all three, per second",
                r.e2e_rate
            ),
            unit: "/s".into(),
            series: vec![
                Series {
                    name: "orders committed/s (the pace)".into(),
                    color: "#2ca02c",
                    points: r.e2e_timeline.iter().map(|t| (t.0, t.1)).collect(),
                },
                Series {
                    name: "applied by all three/s".into(),
                    color: "#9467bd",
                    points: r.e2e_applied.clone(),
                },
            ],
        },
        Panel {
            title: "Phase 4: order commit -> committed by all three consumers".into(),
            unit: "ms".into(),
            series: vec![
                Series {
                    name: "p50 of the second".into(),
                    color: "#1f77b4",
                    points: e2e_latency(|t| t.2),
                },
                Series {
                    name: "max of the second".into(),
                    color: "#d62728",
                    points: e2e_latency(|t| t.3),
                },
            ],
        },
    ]);
    chart::render(&format!("make bench, {}", r.date), &panels)
}

const BEGIN: &str = "<!-- bench:results:begin -->";
const END: &str = "<!-- bench:results:end -->";

/// Write `latest.json`, `latest.md`, `latest.svg` under `out` (and a copy
/// under `out/runs/<date>/`), and splice the table into BENCHMARKS.md.
pub fn write(out: &str, r: &Results) -> anyhow::Result<()> {
    let mut value = serde_json::to_value(r)?;
    if let Some(fields) = value.as_object_mut() {
        fields.insert("verdicts".into(), serde_json::to_value(verdicts(r))?);
    }
    let json = serde_json::to_string_pretty(&value)?;
    let md = table(r);
    let svg = chart_of(r);
    let stamp = r.date.replace([' ', ':'], "-");
    let run_dir = format!("{out}/runs/{stamp}");
    std::fs::create_dir_all(&run_dir)?;
    for dir in [out, run_dir.as_str()] {
        std::fs::write(format!("{dir}/latest.json"), &json)?;
        std::fs::write(format!("{dir}/latest.md"), &md)?;
        std::fs::write(format!("{dir}/latest.svg"), &svg)?;
    }
    println!("\n{md}");
    println!("wrote {out}/latest.json, {out}/latest.md, {out}/latest.svg");
    if let Ok(doc) = std::fs::read_to_string("BENCHMARKS.md") {
        if let (Some(b), Some(e)) = (doc.find(BEGIN), doc.find(END)) {
            let spliced = format!(
                "{}{BEGIN}\n{md}\n![throughput and latency over the run]({out}/latest.svg)\n{}",
                &doc[..b],
                &doc[e..]
            );
            std::fs::write("BENCHMARKS.md", spliced)?;
            println!("updated BENCHMARKS.md");
        }
    }
    Ok(())
}

/// One series of the backlog run against "must stay flat": the medians of
/// its middle and last thirds of samples against the median of its first
/// third (the middle one too, so that a bulge that recedes by the end
/// still fails); for a sawtooth (the dead tuples, an autovacuum pass every
/// few seconds) also the thirds' peaks, since a median falls wherever the
/// third cuts the cycle.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Trend {
    pub first_third_median: f64,
    pub middle_third_median: f64,
    pub last_third_median: f64,
    /// The middle and last thirds' medians may be at most this:
    /// [`Flatness::FACTOR`] times the first third's, plus the series' slack.
    pub limit: f64,
    pub first_third_peak: f64,
    pub middle_third_peak: f64,
    pub last_third_peak: f64,
    /// The middle and last thirds' peaks may be at most this (when peaks
    /// are judged): [`Flatness::FACTOR`] times the first third's, plus the
    /// peak slack.
    pub peak_limit: Option<f64>,
    pub flat: bool,
}

impl Trend {
    /// `None` with fewer than 3 values (no thirds to compare). Peaks are
    /// judged when `peak_slack` is given.
    fn of(values: &[f64], slack: f64, peak_slack: Option<f64>) -> Option<Trend> {
        let third = values.len() / 3;
        if third == 0 {
            return None;
        }
        let median = |part: &[f64]| {
            let mut part = part.to_vec();
            part.sort_by(f64::total_cmp);
            crate::stats::percentile(&part, 0.5)
        };
        let peak = |part: &[f64]| part.iter().copied().fold(f64::MIN, f64::max);
        let parts = [
            &values[..third],
            &values[third..values.len() - third],
            &values[values.len() - third..],
        ];
        let [first, middle, last] = parts.map(median);
        let [first_peak, middle_peak, last_peak] = parts.map(peak);
        let limit = first * Flatness::FACTOR + slack;
        let peak_limit = peak_slack.map(|slack| first_peak * Flatness::FACTOR + slack);
        let peaks_flat = peak_limit.is_none_or(|limit| middle_peak <= limit && last_peak <= limit);
        Some(Trend {
            first_third_median: first,
            middle_third_median: middle,
            last_third_median: last,
            limit,
            first_third_peak: first_peak,
            middle_third_peak: middle_peak,
            last_third_peak: last_peak,
            peak_limit,
            flat: middle <= limit && last <= limit && peaks_flat,
        })
    }
}

/// A least-squares line through a series (by sample): its values at the
/// first and the last sample, and whether the end stays within `limit`
/// ([`Flatness::RISE_FACTOR`] times the start, plus the slack). A steady
/// climb that the thirds' medians let through (70 to 136 ms: the first
/// third's median is already 81) fails here.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Line {
    pub start: f64,
    pub end: f64,
    pub limit: f64,
    pub flat: bool,
}

impl Line {
    /// `None` with fewer than 3 values.
    fn of(values: &[f64], slack: f64) -> Option<Line> {
        if values.len() < 3 {
            return None;
        }
        let n = values.len() as f64;
        let mean_x = (n - 1.0) / 2.0;
        let mean_y = values.iter().sum::<f64>() / n;
        let (mut sxy, mut sxx) = (0.0, 0.0);
        for (i, y) in values.iter().enumerate() {
            let dx = i as f64 - mean_x;
            sxy += dx * (y - mean_y);
            sxx += dx * dx;
        }
        let slope = sxy / sxx;
        let (start, end) = (mean_y - slope * mean_x, mean_y + slope * mean_x);
        let limit = start.max(0.0) * Flatness::RISE_FACTOR + slack;
        Some(Line {
            start,
            end,
            limit,
            flat: end <= limit,
        })
    }
}

/// The backlog run's verdict: the claim latency and the outbox's dead tuples
/// must stay flat while the backlog drains (a growth from the first third of
/// the samples to the last beyond noise fails the run).
#[derive(Clone, Debug, Default, Serialize)]
pub struct Flatness {
    pub rule: String,
    pub claim_ms: Option<Trend>,
    /// The claim latency's line over the run (its trend, which the thirds
    /// judge only coarsely). Not the dead tuples': they climb from none to
    /// autovacuum's sawtooth in the first samples, which a line reads as a
    /// rise (1.7 times in session 19's flat run); their peaks are judged.
    pub claim_line: Option<Line>,
    pub dead_tuples: Option<Trend>,
    /// Both flat; `None`: too few samples for a verdict.
    pub flat: Option<bool>,
}

impl Flatness {
    /// How much the middle and last thirds' medians may exceed the first
    /// third's, times (2.0 until session 19; the runs so far stayed within
    /// 1.14).
    pub const FACTOR: f64 = 1.5;
    /// The claim's slack, ms.
    pub const CLAIM_SLACK_MS: f64 = 5.0;
    /// The dead tuples' slack, as a fraction of the backlog (an autovacuum
    /// pass every few seconds makes them a sawtooth).
    pub const DEAD_SLACK: f64 = 0.05;
    /// The dead tuples' peaks' slack, as a fraction of the backlog: a
    /// sawtooth whose peaks double fails (with the medians' 5 % alone, a
    /// steady doubling of a 1,000,000-event run's could pass).
    pub const DEAD_PEAK_SLACK: f64 = 0.01;
    /// How far the claim latency's line may rise over the run: its end at
    /// most this times its start, plus [`Self::CLAIM_SLACK_MS`] (session
    /// 19's run: 49 to 42 ms).
    pub const RISE_FACTOR: f64 = 1.25;

    /// The verdict on the samples taken while the drain ran (`left` > 0).
    /// The run's last sample is taken once the sink has every event: its
    /// claim walks an empty backlog (9.2 ms against 18-77 ms for the rest
    /// of a run), which would pull the line's end down and, low at the
    /// end, let a climb pass. It stays in the JSON and the chart.
    pub fn of(samples: &[BacklogSample], backlog: i64) -> Flatness {
        let draining: Vec<&BacklogSample> = samples.iter().filter(|s| s.left > 0).collect();
        let claim: Vec<f64> = draining.iter().map(|s| s.claim_ms).collect();
        let dead: Vec<f64> = draining.iter().map(|s| s.dead_tuples as f64).collect();
        let claim_ms = Trend::of(&claim, Self::CLAIM_SLACK_MS, None);
        let claim_line = Line::of(&claim, Self::CLAIM_SLACK_MS);
        let dead_tuples = Trend::of(
            &dead,
            backlog as f64 * Self::DEAD_SLACK,
            Some(backlog as f64 * Self::DEAD_PEAK_SLACK),
        );
        let flat = match (&claim_ms, &claim_line, &dead_tuples) {
            (Some(c), Some(l), Some(d)) => Some(c.flat && l.flat && d.flat),
            _ => None,
        };
        Flatness {
            rule: format!(
                "flat (the samples taken while events were left to receive): medians of the \
                 middle and last thirds of the samples <= {} x the first third's + slack ({} ms \
                 for the claim, {} % of the backlog for dead tuples), and for dead tuples the \
                 thirds' peaks too ({} x + {} % of the backlog); the claim's least-squares line \
                 ends <= {} x its start + {} ms",
                Self::FACTOR,
                Self::CLAIM_SLACK_MS,
                Self::DEAD_SLACK * 100.0,
                Self::FACTOR,
                Self::DEAD_PEAK_SLACK * 100.0,
                Self::RISE_FACTOR,
                Self::CLAIM_SLACK_MS
            ),
            claim_ms,
            claim_line,
            dead_tuples,
            flat,
        }
    }

    pub fn print(&self) {
        println!("  verdict ({})", self.rule);
        for (name, trend) in [
            ("claim ms", &self.claim_ms),
            ("dead tuples", &self.dead_tuples),
        ] {
            if let Some(t) = trend {
                let peaks = t.peak_limit.map_or(String::new(), |limit| {
                    format!(
                        "; peaks {:.1}, {:.1}, {:.1}, limit {limit:.1}",
                        t.first_third_peak, t.middle_third_peak, t.last_third_peak
                    )
                });
                println!(
                    "    {name}: medians: first third {:.1}, middle third {:.1}, last third {:.1}, limit {:.1}{peaks}: {}",
                    t.first_third_median,
                    t.middle_third_median,
                    t.last_third_median,
                    t.limit,
                    if t.flat { "flat" } else { "NOT FLAT" }
                );
            }
        }
        if let Some(line) = &self.claim_line {
            println!(
                "    claim ms: least-squares line from {:.1} to {:.1}, limit {:.1}: {}",
                line.start,
                line.end,
                line.limit,
                if line.flat { "flat" } else { "NOT FLAT" }
            );
        }
        match self.flat {
            Some(true) => println!("  both flat"),
            Some(false) => println!("  NOT FLAT"),
            None => println!("  no verdict: fewer than 3 samples (a backlog too small to judge)"),
        }
    }
}

/// `bench/backlog.json` and `bench/backlog.svg` of one `bench backlog` run.
pub fn write_backlog(
    out: &str,
    events_per_order: i64,
    drain: &Drain,
    samples: &[BacklogSample],
    verdict: &Flatness,
) -> anyhow::Result<()> {
    let json = serde_json::to_string_pretty(&serde_json::json!({
        "date": now_utc(),
        "machine": Machine::read(),
        "events_per_order": events_per_order,
        "drain": drain,
        "verdict": verdict,
        "samples": samples,
    }))?;
    std::fs::write(format!("{out}/backlog.json"), json)?;
    let panels = vec![
        Panel {
            title: "Claim query (500 rows) latency during the drain".into(),
            unit: "ms".into(),
            series: vec![Series {
                name: "claim ms".into(),
                color: "#1f77b4",
                points: samples.iter().map(|s| (s.seconds, s.claim_ms)).collect(),
            }],
        },
        Panel {
            title: "outbox_events dead tuples; events not yet received by the sink".into(),
            unit: "".into(),
            series: vec![
                Series {
                    name: "dead tuples".into(),
                    color: "#d62728",
                    points: samples
                        .iter()
                        .map(|s| (s.seconds, s.dead_tuples as f64))
                        .collect(),
                },
                Series {
                    // Backlog minus the sink's count (not a count of the
                    // table's unpublished rows).
                    name: "not yet received by the sink".into(),
                    color: "#2ca02c",
                    points: samples.iter().map(|s| (s.seconds, s.left as f64)).collect(),
                },
            ],
        },
    ];
    std::fs::write(
        format!("{out}/backlog.svg"),
        chart::render(
            &format!("make bench-backlog: {} events, {}", drain.events, now_utc()),
            &panels,
        ),
    )?;
    println!("wrote {out}/backlog.json, {out}/backlog.svg");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verdicts_apply_the_issue_s_targets() {
        let mut r = Results::default();
        r.api.per_second = 85.0;
        r.api_raw.per_second = 100.0;
        r.relay_one.per_second = 79.9;
        r.relay_two.per_second = 80.0;
        r.relay_raw.per_second = 100.0;
        // The 2-relay row against its own raw limit, not the 1-relay one.
        r.relay_raw_two.per_second = 100.0;
        r.e2e.count = 10;
        r.e2e.p50_ms = 19.9;
        r.e2e.p99_ms = 100.0;
        r.peak_rss_kib.insert("order-api".into(), 100 * 1024);
        r.peak_rss_kib.insert("outbox-relay".into(), 64 * 1024);
        let met: Vec<(String, bool)> = verdicts(&r).into_iter().map(|v| (v.stage, v.met)).collect();
        let expected = [
            ("API", true),
            ("relay, 1 relay", false),
            ("relay, 2 relays", true),
            ("end to end p50", true),
            ("end to end p99", false),
            // Not sampled: no verdict of "met".
            ("peak RSS inventory-consumer", false),
            ("peak RSS ledger-consumer", false),
            ("peak RSS loyalty-consumer", false),
            ("peak RSS order-api", true),
            ("peak RSS outbox-relay", false),
        ]
        .map(|(stage, met)| (stage.to_owned(), met));
        assert_eq!(met, expected);
        let missed = expected.iter().filter(|(_, met)| !met).count();
        assert_eq!(print_missed(&r), missed);
        // The table's "Met" column says the same, row by row.
        let md = table(&r);
        let last_cell = |row_start: &str| -> String {
            let row = md
                .lines()
                .find(|l| l.starts_with(row_start))
                .unwrap_or_else(|| panic!("no row {row_start:?} in {md}"));
            row.trim_end_matches(" |")
                .rsplit("| ")
                .next()
                .unwrap_or("")
                .to_owned()
        };
        for (row, cell) in [
            ("| API ", "yes"),
            ("| Relay drain, 1 relay", "**no**"),
            ("| Relay drain, 2 relays", "yes"),
            ("| End to end", "**no**"),
            ("| Peak RSS order-api", "yes"),
            ("| Peak RSS outbox-relay", "**no**"),
        ] {
            assert_eq!(last_cell(row), cell, "{row}");
        }
        let p50 = |r: &Results| {
            verdicts(r)
                .into_iter()
                .find(|v| v.stage == "end to end p50")
                .expect("p50")
                .met
        };
        r.sustain_orders.errors = 1;
        assert!(
            !p50(&r),
            "a failed order in the sustained run fails the end to end"
        );
        r.api.errors = 1;
        assert!(!verdicts(&r)[0].met, "an error fails the API target");
    }

    fn samples(claim: &[f64], dead: &[i64]) -> Vec<BacklogSample> {
        claim
            .iter()
            .zip(dead)
            .enumerate()
            .map(|(i, (claim_ms, dead_tuples))| BacklogSample {
                seconds: i as f64 * 2.0,
                // Still draining: every sample is judged.
                left: 1,
                claim_ms: *claim_ms,
                dead_tuples: *dead_tuples,
                live_tuples: 0,
            })
            .collect()
    }

    #[test]
    fn a_sawtooth_is_flat_a_climb_is_not() {
        let claim = [3.0, 9.0, 4.0, 5.0, 8.0, 3.0, 4.0, 10.0, 3.0];
        let saw = [
            1_000, 60_000, 120_000, 2_000, 70_000, 110_000, 5_000, 50_000, 123_000,
        ];
        let verdict = Flatness::of(&samples(&claim, &saw), 1_000_000);
        assert_eq!(verdict.flat, Some(true), "{verdict:?}");
        let climb = [
            1_000, 100_000, 200_000, 300_000, 400_000, 500_000, 600_000, 700_000, 800_000,
        ];
        let verdict = Flatness::of(&samples(&claim, &climb), 1_000_000);
        assert_eq!(verdict.flat, Some(false), "{verdict:?}");
        assert!(!verdict.dead_tuples.expect("a trend").flat);
        let slower = [3.0, 4.0, 3.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0];
        let verdict = Flatness::of(&samples(&slower, &saw), 1_000_000);
        assert_eq!(verdict.flat, Some(false), "{verdict:?}");
        // A bulge that recedes by the end is not flat either.
        let bulge = [3.0, 4.0, 3.0, 30.0, 40.0, 35.0, 4.0, 3.0, 4.0];
        let verdict = Flatness::of(&samples(&bulge, &saw), 1_000_000);
        assert_eq!(verdict.flat, Some(false), "{verdict:?}");
        // A sawtooth whose medians stay put while its peaks double.
        let taller = [
            1_000, 60_000, 30_000, 2_000, 65_000, 30_000, 1_000, 130_000, 30_000,
        ];
        let verdict = Flatness::of(&samples(&claim, &taller), 1_000_000);
        let dead = verdict.dead_tuples.as_ref().expect("a trend");
        assert_eq!(
            (
                dead.first_third_median,
                dead.last_third_median,
                dead.last_third_peak
            ),
            (30_000.0, 30_000.0, 130_000.0)
        );
        assert_eq!(verdict.flat, Some(false), "{verdict:?}");
        assert_eq!(Flatness::of(&samples(&[1.0, 2.0], &[1, 2]), 10).flat, None);
        // A steady climb of the claim that the thirds' medians let through
        // (70 to 136 ms over 85 samples: 1.5 x 81 + 5 ms >= 125), its line
        // does not; nor 10 to 26 ms.
        for (from, to) in [(70.0, 136.0), (10.0, 26.0)] {
            let climb: Vec<f64> = (0..85)
                .map(|i| from + (to - from) * f64::from(i) / 84.0)
                .collect();
            let flat_dead = vec![40_000; 85];
            let verdict = Flatness::of(&samples(&climb, &flat_dead), 1_000_000);
            assert!(
                verdict.claim_ms.as_ref().expect("thirds").flat,
                "{verdict:?}"
            );
            assert!(
                !verdict.claim_line.as_ref().expect("line").flat,
                "{verdict:?}"
            );
            assert_eq!(verdict.flat, Some(false), "{from} -> {to}");
        }
        // A noisy level series (the spread of a real run's claim samples:
        // 35 to 65 ms, a spike of 106 and a dip of 1.5 ms), flat.
        let mut noisy: Vec<f64> = (0..45)
            .map(|i: i32| 50.0 + 30.0 * (f64::from(i * 7 % 11) / 10.0 - 0.5))
            .collect();
        noisy[5] = 106.0;
        noisy[40] = 1.5;
        let line = Line::of(&noisy, Flatness::CLAIM_SLACK_MS).expect("line");
        assert!(line.flat, "{line:?}");
    }

    #[test]
    fn the_sample_after_the_drain_is_not_judged() {
        // A claim climbing from 20 to 31 ms over 9 samples: its line ends
        // above 1.25 x 20 + 5 ms.
        let climb: Vec<f64> = (0..9).map(|i| 20.0 + 11.0 * f64::from(i) / 8.0).collect();
        let mut taken = samples(&climb, &[40_000; 9]);
        assert_eq!(Flatness::of(&taken, 1_000_000).flat, Some(false));
        // The last sample, once the sink has every event: a claim over an
        // empty backlog. Judged, it would pull the line down to flat.
        taken.push(BacklogSample {
            seconds: 18.0,
            left: 0,
            claim_ms: 2.0,
            dead_tuples: 40_000,
            live_tuples: 0,
        });
        let verdict = Flatness::of(&taken, 1_000_000);
        assert_eq!(verdict.flat, Some(false), "{verdict:?}");
        let line = verdict.claim_line.expect("line");
        assert!((line.end - 31.0).abs() < 1e-9, "{line:?}");
    }

    #[test]
    fn the_chart_draws_phase_3_and_the_sustained_run() {
        let mut r = Results::default();
        let apply = |timeline: &[u64]| Apply {
            events: timeline.iter().sum(),
            timeline: timeline.to_vec(),
            ..Apply::default()
        };
        for name in ["inventory-consumer", "ledger-consumer", "loyalty-consumer"] {
            r.consumers.insert(
                name.to_owned(),
                (
                    // Its halves of 4 and 5 s, the second stalled for a
                    // second.
                    apply(&[400, 2000, 2000, 600, 300, 0, 2100, 2000, 600]),
                    apply(&[1900, 2100, 1000, 2000, 2000, 1000]),
                    Apply::default(),
                ),
            );
        }
        r.sustain_timeline = (0..10).map(|s| (f64::from(s), 450.0, 12.0, 40.0)).collect();
        r.sustain_applied = (0..12).map(|s| (f64::from(s), 440.0)).collect();
        let svg = chart_of(&r);
        for name in ["inventory-consumer", "ledger-consumer", "loyalty-consumer"] {
            assert!(
                svg.contains(&format!("Phase 3: {name} vs the raw transaction")),
                "{name}"
            );
            assert!(svg.contains(&format!("{name} events/s")), "{name}");
        }
        assert!(svg.contains("Phase 4: sustained maximum"));
        // Every second of each line is a point: the consumer's 9 and the raw
        // side's 6 in each of the three panels, the sustained run's 10 and 12.
        let lengths: Vec<usize> = svg
            .lines()
            .filter_map(|line| line.split("points=\"").nth(1))
            .map(|points| points.split(' ').count())
            .collect();
        for (points, lines) in [(9, 3), (6, 3), (10, 1), (12, 1)] {
            assert_eq!(
                lengths.iter().filter(|n| **n == points).count(),
                lines,
                "lines of {points} points in {lengths:?}"
            );
        }
    }
}
