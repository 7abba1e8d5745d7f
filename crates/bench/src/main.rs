//! `make bench`: the load generator and phase runner. It starts a private
//! system from the release binaries (order-api, two relays, the three
//! consumers, under a fresh tenant, a private exchange and private consumer
//! names, so other tests and engineers sharing PostgreSQL and RabbitMQ do
//! not interfere), runs every stage next to its raw limit in the same run,
//! and writes a markdown table, a JSON file and an SVG chart (BENCHMARKS.md).
//!
//! `bench` runs the suite; `bench backlog` the long backlog drain
//! (`make bench-backlog`). Settings are environment variables (see
//! [`Settings`]).

// The bench computes statistics (rates, ratios, percentiles), never money.
#![allow(clippy::float_arithmetic)]
// Counts and durations converted for statistics; precision loss is irrelevant.
#![allow(clippy::cast_precision_loss)]

mod api;
mod chart;
mod consumers;
mod cpu;
mod relay;
mod report;
mod stats;

use std::{
    collections::{BTreeMap, HashMap},
    sync::Arc,
    time::{Duration, Instant},
};

use system_tests::{
    consumers::Kind,
    pg, pg_url,
    system::{bind_consumer, unbind_consumer, Member, System, SystemOptions},
    Database,
};

use crate::stats::{ms, Latency, PeakMemory};

/// Environment settings, with the defaults of `make bench`.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Settings {
    /// `BENCH_CONCURRENCY`: clients of the API phase (and raw connections).
    pub concurrency: usize,
    /// `BENCH_API_SECONDS`: length of each side of the API phase.
    pub api_seconds: u64,
    /// `BENCH_EVENTS`: the relay backlog.
    pub events: i64,
    /// `BENCH_CONSUMER_EVENTS`: events queued for each consumer (rounded up
    /// to whole orders of three events).
    pub consumer_events: i64,
    /// `BENCH_E2E_SECONDS`: length of the paced end-to-end run.
    pub e2e_seconds: u64,
    /// `BENCH_SUSTAIN_SECONDS`: closed-loop load measuring the sustained maximum.
    pub sustain_seconds: u64,
    /// `BENCH_BACKLOG_EVENTS`: the backlog of `bench backlog`.
    pub backlog_events: i64,
    /// `BENCH_EVENTS_PER_ORDER`: events per synthetic order (1-3) in the
    /// relay phase's backlog.
    pub events_per_order: i64,
    /// `BENCH_BACKLOG_EVENTS_PER_ORDER`: the same for `bench backlog`.
    pub backlog_events_per_order: i64,
    /// `BENCH_OUT`: output directory.
    pub out: String,
    /// `BENCH_STRICT` (0 or 1): `bench` (the full run) ends with an error,
    /// after writing its results, when a target was missed (for a gate;
    /// by default the missed targets are listed and the run succeeds).
    pub strict: bool,
}

fn env<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

impl Settings {
    fn from_env() -> Settings {
        Settings {
            concurrency: env("BENCH_CONCURRENCY", 16),
            api_seconds: env("BENCH_API_SECONDS", 15),
            events: env("BENCH_EVENTS", 100_000),
            consumer_events: env("BENCH_CONSUMER_EVENTS", 10_000),
            e2e_seconds: env("BENCH_E2E_SECONDS", 20),
            sustain_seconds: env("BENCH_SUSTAIN_SECONDS", 10),
            backlog_events: env("BENCH_BACKLOG_EVENTS", 1_000_000),
            events_per_order: env("BENCH_EVENTS_PER_ORDER", 1),
            backlog_events_per_order: env("BENCH_BACKLOG_EVENTS_PER_ORDER", 3),
            out: env("BENCH_OUT", "bench".to_owned()),
            strict: env("BENCH_STRICT", 0_u8) != 0,
        }
    }
}

/// Everything one run measured (the JSON file).
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Results {
    pub date: String,
    pub machine: report::Machine,
    pub settings: Option<Settings>,
    pub api: api::Load,
    pub api_raw: api::Load,
    pub relay_one: relay::Drain,
    pub relay_two: relay::Drain,
    pub relay_raw: relay::Drain,
    /// The raw loop at two relays' concurrency: twice the channels, over
    /// two connections (the 2-relay drain's limit).
    pub relay_raw_two: relay::Drain,
    /// The raw loop's channels and messages in flight on each (the relay's
    /// default workers and batch size).
    pub relay_workers: usize,
    pub relay_window: usize,
    /// Events per synthetic order in the relay's backlog (1: every event
    /// the first of its order, whose claim skips the hold-back probe).
    pub relay_events_per_order: i64,
    /// The orders the relay's backlog holds (the API phase's one-event
    /// orders and the synthetic ones).
    pub relay_backlog_orders: u64,
    /// The consumers' partitions (the production default, 4) and so the
    /// raw loop's sequential workers.
    pub consumer_partitions: usize,
    /// Orders whose events phase 3 applies (each placed, paid, delivered).
    pub consumer_orders: u64,
    /// Per consumer: (applied by the service, raw prepared, raw unprepared).
    pub consumers: BTreeMap<String, (consumers::Apply, consumers::Apply, consumers::Apply)>,
    /// The closed-loop load of the sustained-maximum run.
    pub sustain_orders: api::Load,
    /// Orders per second the whole pipeline sustained (applied by all three).
    pub sustained: f64,
    /// [`Results::e2e_timeline`] of the sustained run (for the chart: a
    /// stall under the closed-loop load shows here).
    pub sustain_timeline: Vec<(f64, f64, f64, f64)>,
    /// [`Results::e2e_applied`] of the sustained run.
    pub sustain_applied: Vec<(f64, f64)>,
    pub e2e_rate: f64,
    pub e2e_orders: api::Load,
    pub e2e: Latency,
    /// CPU seconds per process group, per measured interval.
    pub cpu: BTreeMap<String, (u64, cpu::Usage)>,
    /// PostgreSQL's WAL during each side of the relay phase.
    pub relay_wal: BTreeMap<String, (u64, relay::Wal)>,
    /// Peak RSS (KiB) per service binary, over every process of the run.
    pub peak_rss_kib: BTreeMap<String, u64>,
    /// (second, orders, p50 ms, max ms) of the end-to-end run, by commit
    /// second (every second of the run, orders 0 in a second without one).
    pub e2e_timeline: Vec<(f64, f64, f64, f64)>,
    /// (second, events applied by all three consumers) of the end-to-end
    /// run, by the second the last of the three committed (every second,
    /// 0 in a second where none was): a stall of the pipeline shows here.
    pub e2e_applied: Vec<(f64, f64)>,
}

/// What the chart draws of a run of phase 4: [`Results::e2e_timeline`] and
/// [`Results::e2e_applied`] (the sustained run's likewise).
type Timelines = (Vec<(f64, f64, f64, f64)>, Vec<(f64, f64)>);

fn block<T>(f: impl FnOnce() -> T) -> T {
    tokio::task::block_in_place(f)
}

fn phase(name: &str) {
    println!("\n== {name}  [{}]", report::now_utc());
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let settings = Settings::from_env();
    // Checked before anything starts (the relay phase's top-up would refuse
    // them only after the API phase).
    for (name, per_order) in [
        ("BENCH_EVENTS_PER_ORDER", settings.events_per_order),
        (
            "BENCH_BACKLOG_EVENTS_PER_ORDER",
            settings.backlog_events_per_order,
        ),
    ] {
        anyhow::ensure!(
            (1..=3).contains(&per_order),
            "{name} must be 1, 2 or 3 (an order has at most three events), not {per_order}"
        );
    }
    std::fs::create_dir_all(&settings.out)?;
    match std::env::args().nth(1).as_deref() {
        None | Some("suite") => suite(settings).await,
        Some("backlog") => backlog(settings).await,
        Some("e2e") => e2e_only(settings).await,
        Some("relay") => relay_only(settings).await,
        Some("api") => api_only(settings).await,
        Some("consumers") => consumers_only(settings).await,
        Some(other) => {
            anyhow::bail!(
                "unknown mode {other:?}: `bench`, `bench backlog`, `bench api`, `bench relay`, `bench consumers` or `bench e2e`"
            )
        }
    }
}

/// Aborts a background task when dropped (on every path out of a phase:
/// the task's `Arc<System>` must not outlive the run).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Every service process's peak RSS over the run: read (VmHWM, the
/// process's own high-water mark) right before each stop, every 200 ms by
/// the sampler, and at the end for the processes still running.
static PEAKS: std::sync::LazyLock<PeakMemory> = std::sync::LazyLock::new(PeakMemory::default);

/// Stop `member`, its peak RSS read first (a process that stops between
/// two samples would lose up to 200 ms of them; one stopped before the
/// sampler starts, e.g. during the stock-up, all).
fn stop_member(member: &system_tests::system::Member) {
    if let Some(pid) = member.pid() {
        PEAKS.record(member.binary, pid);
    }
    block(|| member.stop());
}

/// Sample every member's peak RSS until the returned guard is dropped.
fn sample_memory(system: Arc<System>, peaks: PeakMemory) -> AbortOnDrop {
    AbortOnDrop(tokio::spawn(async move {
        loop {
            for member in system.members() {
                if let Some(pid) = member.pid() {
                    peaks.record(member.binary, pid);
                }
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }))
}

async fn start_system(relays: usize) -> Arc<System> {
    // The relays run as deployed: every production default of the relay
    // settings in place of the tests' short timings, except what places the
    // bench's relays (their instance ids, tenant and private exchange).
    // (With the tests' 500 ms gauge refresh, the gauges' count of the
    // 100,000-row backlog alone cost PostgreSQL 16 µs per relayed event.)
    let defaults = serde_json::to_value(outbox_relay::settings::RelaySettings::default())
        .expect("relay settings serialize");
    let relay_env = defaults
        .as_object()
        .expect("relay settings are a struct")
        .iter()
        .filter(|(name, _)| !["instance_id", "only_tenant", "exchange"].contains(&name.as_str()))
        .map(|(name, value)| {
            let value = match value {
                serde_json::Value::String(text) => text.clone(),
                other => other.to_string(),
            };
            (
                format!("OUTBOX_RELAY__RELAY__{}", name.to_uppercase()),
                value,
            )
        })
        .collect();
    let system = System::start(
        "bench",
        SystemOptions {
            relays,
            start_relays: false,
            relay_env,
            consumer_options: consumer_options(),
            ..SystemOptions::default()
        },
    )
    .await;
    Arc::new(system)
}

/// The consumers run as deployed too: the production default partitions
/// (4), retry tiers, deferrals and pool size in place of the tests' (2
/// partitions, tiers in milliseconds, 6 connections); prefetch and the rest
/// are the services' own defaults already. (Their names, databases and the
/// private exchange they are bound to are the bench's.)
fn consumer_options() -> system_tests::consumers::Options {
    let production = consumer_runtime::settings::Settings::local("bench", "bench", 0);
    let pool_size = production.database.pool_size.to_string();
    system_tests::consumers::Options {
        partitions: production.consumer.partitions,
        tiers_ms: production.consumer.retry_tiers_ms,
        max_deferrals: production.consumer.max_deferrals,
        // Each consumer reads its own prefix's.
        extra: [Kind::Inventory, Kind::Ledger, Kind::Loyalty]
            .into_iter()
            .map(|kind| {
                (
                    format!("{}__DATABASE__POOL_SIZE", kind.prefix()),
                    pool_size.clone(),
                )
            })
            .collect(),
        ..system_tests::consumers::Options::default()
    }
}

async fn start_relays(system: &System, count: usize) -> Instant {
    let started = Instant::now();
    for relay in system.relays.iter().take(count) {
        relay.start("");
    }
    for relay in system.relays.iter().take(count) {
        relay.ready(Duration::from_secs(60)).await;
    }
    started
}

fn stop_relays(system: &System) {
    for relay in &system.relays {
        stop_member(relay);
    }
}

/// A started private system with the orders database and the raw loops'
/// tenants (`<tenant>-raw` for the API and consumers' raw loops, `…-raw2`
/// for the consumers' unprepared variant), stocked like the system's tenant.
struct Bench {
    system: Arc<System>,
    orders: tokio_postgres::Client,
    raw_tenant: String,
    /// The connection holding the run's advisory lock ([`run_lock`]) for the
    /// run's whole life: while it is open, no other bench's
    /// [`clear_aborted_runs`] deletes this run's rows.
    _lock: tokio_postgres::Client,
}

/// The key of a run's session-level advisory lock, from its tenant id (the
/// raw loops' tenants `<tenant>-raw` and `<tenant>-raw2` share their run's).
const RUN_LOCK: &str = "hashtextextended('bench-run:' || $1, 0)";

/// The run's tenant of one of its tenants ("bench-<12 hex>", the prefix of
/// the raw loops' `…-raw` and `…-raw2`).
fn run_tenant(tenant: &str) -> String {
    tenant.splitn(3, '-').take(2).collect::<Vec<_>>().join("-")
}

/// Every tenant of the run whose system tenant is `run`: its own, the raw
/// sides' (`-raw`; `-raw2`, the unprepared transaction's), and `-raw3`,
/// phase 3's priming events ([`consumer_phase`]).
fn run_tenants(run: &str) -> [String; 4] {
    [
        run.to_owned(),
        format!("{run}-raw"),
        format!("{run}-raw2"),
        format!("{run}-raw3"),
    ]
}

/// Take the run's advisory lock on a connection of its own, kept open
/// until the process ends (a killed run's lock goes with its connection).
async fn run_lock(tenant: &str) -> anyhow::Result<tokio_postgres::Client> {
    let lock = pg(Database::Orders).await;
    lock.execute(&format!("SELECT pg_advisory_lock({RUN_LOCK})"), &[&tenant])
        .await?;
    Ok(lock)
}

impl Bench {
    /// Start the system (`relays` relays, stopped) and prepare the tenants;
    /// `consumers_running` false stops the consumers again.
    async fn start(title: &str, relays: usize, consumers_running: bool) -> anyhow::Result<Bench> {
        phase(title);
        let mut orders = pg(Database::Orders).await;
        check_commit_timestamps(&orders).await?;
        clear_aborted_runs(&orders).await;
        // The orders database as on a fresh cluster, whatever an earlier
        // run left (see `consumers::reset_empty`), before the services
        // start. (The consumers' databases: phase 3, `compact_empty`.)
        consumers::reset_empty(&mut orders).await;
        let system = start_system(relays).await;
        // Before the run writes any outbox row (what `clear_aborted_runs`
        // looks for).
        let lock = run_lock(&system.tenant).await?;
        system.stock_up().await;
        let raw_tenant = format!("{}-raw", system.tenant);
        orders
            .execute(
                "INSERT INTO tenants (tenant_id) VALUES ($1) ON CONFLICT DO NOTHING",
                &[&raw_tenant],
            )
            .await?;
        for tenant in &run_tenants(&system.tenant)[1..] {
            receive_raw_stock(&system, tenant).await;
        }
        if !consumers_running {
            for consumer in &system.consumers {
                stop_member(consumer);
            }
        }
        Ok(Bench {
            system,
            orders,
            raw_tenant,
            _lock: lock,
        })
    }

    /// Orders for 5 s from 8 clients: the events of a single-phase run.
    async fn template_orders(&self) -> u64 {
        let seed = api::http_load(
            &self.system.api.base_url(),
            &self.system.key,
            0,
            8,
            Duration::from_secs(5),
        )
        .await;
        println!("  {} template orders", seed.requests);
        seed.requests
    }

    /// Stop every service and delete what the run wrote: the consumers'
    /// inbox rows, the tenants' orders, outbox rows and the consumers'
    /// effects, the ledger's journal too ([`cleanup_effects`]).
    async fn teardown(self) {
        for member in self.system.members() {
            stop_member(member);
        }
        for consumer in &self.system.consumers {
            if consumer.label.ends_with("-0") {
                // (Phase 3's priming inbox rows go with their tenant's,
                // `-raw3`, in `cleanup_effects`.)
                consumers::forget(consumer.kind.expect("kind"), &consumer.name).await;
            }
        }
        for tenant in run_tenants(&self.system.tenant) {
            cleanup_orders(&self.orders, &tenant).await;
            cleanup_effects(&tenant).await;
            forget_tenant(&self.orders, &tenant).await;
        }
    }

    /// Tear down after the run's body, whatever became of it: returned,
    /// failed or panicked (a failed run does not leave its backlog behind).
    async fn finish<T>(self, outcome: std::thread::Result<anyhow::Result<T>>) -> anyhow::Result<T> {
        if !matches!(outcome, Ok(Ok(_))) {
            phase("the run failed: tearing down");
        }
        self.teardown().await;
        match outcome {
            Ok(result) => result,
            Err(panic) => std::panic::resume_unwind(panic),
        }
    }
}

/// Run a mode's body on `bench` (panics caught, for [`Bench::finish`]).
async fn guarded<T>(
    body: impl std::future::Future<Output = anyhow::Result<T>>,
) -> std::thread::Result<anyhow::Result<T>> {
    use futures_util::FutureExt;
    std::panic::AssertUnwindSafe(body).catch_unwind().await
}

async fn suite(settings: Settings) -> anyhow::Result<()> {
    let run_started = Instant::now();
    let bench = Bench::start(
        "start: order-api, 2 relays (stopped), 3 consumers (private names)",
        2,
        false,
    )
    .await?;
    let outcome = guarded(suite_phases(&bench, &settings)).await;
    let missed = bench.finish(outcome).await?;
    println!("done in {:.0?}", run_started.elapsed());
    anyhow::ensure!(
        !settings.strict || missed == 0,
        "{missed} target(s) missed (BENCH_STRICT=1)"
    );
    Ok(())
}

/// Every phase of `bench suite`, then the results written; how many
/// targets the run missed.
async fn suite_phases(bench: &Bench, settings: &Settings) -> anyhow::Result<usize> {
    let settings = settings.clone();
    let mut results = Results {
        date: report::now_utc(),
        machine: report::Machine::read(),
        settings: Some(settings.clone()),
        ..Results::default()
    };
    let (system, orders, raw_tenant) = (&bench.system, &bench.orders, &bench.raw_tenant);
    let peaks = PEAKS.clone();
    let sampler = sample_memory(system.clone(), peaks.clone());

    // 1. API vs raw transaction.
    api_phase(system, orders, &settings, raw_tenant, &mut results).await;

    // 2. Relay: backlog, one relay, two relays, raw confirm-publish.
    relay_phase(
        system,
        orders,
        &settings,
        settings.events_per_order,
        &mut results,
    )
    .await?;

    // 3. Consumers: whole orders queued for each one, then started; raw.
    consumer_phase(system, orders, &settings, raw_tenant, &mut results).await;

    // 4. End to end at half the sustained maximum order rate of the whole
    // pipeline, measured here with everything running at once (API, one
    // relay, three consumers, PostgreSQL and RabbitMQ share the machine: the
    // stages' isolated maxima above add up to more than it has).
    start_relays(system, 1).await;
    phase(&format!(
        "4. sustained maximum: {} clients back to back for {} s, 1 relay, all consumers",
        settings.concurrency, settings.sustain_seconds
    ));
    let since = consumers::now(&consumers::db(Kind::Inventory).await).await;
    results.sustain_orders = api::http_load(
        &system.api.base_url(),
        &system.key,
        5_000_000,
        settings.concurrency,
        Duration::from_secs(settings.sustain_seconds),
    )
    .await;
    report::print_load("order-api", &results.sustain_orders);
    let applied = applied_by_all(system, orders, since).await?;
    results.sustained = applied.throughput();
    let (_, (timeline, done)) = applied.by_second(since)?;
    results.sustain_timeline = timeline;
    results.sustain_applied = done;
    println!(
        "  {} orders applied by all three consumers at {:.0}/s (first order to last applied)",
        applied.events.len(),
        results.sustained
    );
    let e2e_rate = (results.sustained / 2.0).max(1.0);
    results.e2e_rate = e2e_rate;
    phase(&format!(
        "4. end to end: {e2e_rate:.0} orders/s for {} s, 1 relay, all consumers",
        settings.e2e_seconds
    ));
    let (load, latency, (timeline, applied)) =
        paced_run(system, orders, e2e_rate, settings.e2e_seconds).await?;
    results.e2e_orders = load;
    results.e2e = latency;
    results.e2e_timeline = timeline;
    results.e2e_applied = applied;

    // 5. Memory.
    drop(sampler);
    for member in system.members() {
        if let Some(pid) = member.pid() {
            peaks.record(member.binary, pid);
        }
    }
    results.peak_rss_kib = peaks.snapshot();
    phase("5. peak RSS");
    for (service, kib) in &results.peak_rss_kib {
        println!("  {service}: {:.1} MiB", *kib as f64 / 1024.0);
    }

    phase("writing results");
    report::write(&settings.out, &results)?;
    Ok(report::print_missed(&results))
}

/// Print and keep the CPU an interval of `events` events took, per process.
fn record_cpu(results: &mut Results, label: &str, events: u64, usage: cpu::Usage) {
    println!("  CPU per event: {}", usage.per_event(events));
    results.cpu.insert(label.to_owned(), (events, usage));
}

fn record_wal(results: &mut Results, label: &str, events: u64, wal: relay::Wal) {
    println!("  PostgreSQL WAL: {}", wal.per_event(events));
    results.relay_wal.insert(label.to_owned(), (events, wal));
}

/// Receipts of every SKU for the raw tenant (the same stock as the system's).
async fn receive_raw_stock(system: &System, tenant: &str) {
    for sku in system_tests::system::skus() {
        system.receive_for(tenant, &sku, 100_000_000).await;
    }
}

/// The events of a run and when all three consumers had applied each.
///
/// Both ends are commit times (`pg_xact_commit_timestamp`, which needs
/// `track_commit_timestamp = on`: `make up` sets it, [`Bench::start`] checks
/// it): the order row's transaction and each consumer's inbox row's. The
/// columns `occurred_at` and `processed_at` are their transactions' *start*
/// times (`now()`), earlier than the commits by each transaction's duration
/// (sessions 1-7 measured with them; `start_to_start` keeps that measure for
/// comparison).
struct Applied {
    /// (event id, its order's commit) of every event since the start.
    events: Vec<(uuid::Uuid, time::OffsetDateTime)>,
    /// Per event, the latest of the three consumers' commits (every event
    /// of `events` is here: [`applied_by_all`] fails otherwise).
    done: BTreeMap<uuid::Uuid, time::OffsetDateTime>,
    /// Per event, `occurred_at` to the latest of the three `processed_at`
    /// in ms (the measure before commit timestamps).
    start_to_start: Vec<f64>,
}

impl Applied {
    /// Events per second from the first event to the last one applied by all
    /// three: the pipeline's throughput, queueing included.
    fn throughput(&self) -> f64 {
        let first = self.events.iter().map(|(_, at)| *at).min();
        let last = self.done.values().max().copied();
        match (first, last) {
            (Some(first), Some(last)) if last > first => {
                self.done.len() as f64 / ms((last - first).unsigned_abs()) * 1000.0
            }
            _ => 0.0,
        }
    }

    /// The latency of every event, from its order's commit to the last of
    /// the three consumers' (see [`Applied`]), and the run's per-second
    /// timelines, by whole seconds since `since`.
    fn by_second(&self, since: time::OffsetDateTime) -> anyhow::Result<(Latency, Timelines)> {
        let mut samples = Vec::new();
        let mut per_second: BTreeMap<i64, Vec<f64>> = BTreeMap::new();
        let mut done_per_second: BTreeMap<i64, u64> = BTreeMap::new();
        for (id, committed) in &self.events {
            let done = self
                .done
                .get(id)
                .ok_or_else(|| anyhow::anyhow!("event {id} not applied by all three consumers"))?;
            let latency = ms((*done - *committed).unsigned_abs());
            samples.push(latency);
            per_second
                .entry((*committed - since).whole_seconds())
                .or_default()
                .push(latency);
            *done_per_second
                .entry((*done - since).whole_seconds())
                .or_default() += 1;
        }
        // Every second from the first to the last, a second without an order
        // (or without an event done) drawn as 0, not bridged by a line.
        let seconds = per_second
            .keys()
            .chain(done_per_second.keys())
            .copied()
            .fold(None, |span: Option<(i64, i64)>, s| {
                Some(span.map_or((s, s), |(a, b)| (a.min(s), b.max(s))))
            });
        let (mut timeline, mut done) = (Vec::new(), Vec::new());
        if let Some((first, last)) = seconds {
            for second in first..=last {
                match per_second.get_mut(&second) {
                    Some(v) => {
                        v.sort_by(f64::total_cmp);
                        timeline.push((
                            second as f64,
                            v.len() as f64,
                            stats::percentile(v, 0.5),
                            v[v.len() - 1],
                        ));
                    }
                    None => timeline.push((second as f64, 0.0, f64::NAN, f64::NAN)),
                }
                let n = done_per_second.get(&second).copied().unwrap_or_default();
                done.push((second as f64, n as f64));
            }
        }
        Ok((Latency::of(samples), (timeline, done)))
    }
}

/// How long each consumer may take to apply the run's events once the load
/// has stopped; past it the run fails.
const APPLY_DEADLINE: Duration = Duration::from_secs(300);

/// Fail unless PostgreSQL records commit timestamps (the end-to-end latency
/// is measured between commits): checked at start-up, so a misconfigured
/// server fails the run in seconds, not after the phases before phase 4.
async fn check_commit_timestamps(orders: &tokio_postgres::Client) -> anyhow::Result<()> {
    let tracked: String = orders
        .query_one("SHOW track_commit_timestamp", &[])
        .await?
        .get(0);
    anyhow::ensure!(
        tracked == "on",
        "PostgreSQL runs with track_commit_timestamp = {tracked}: the end-to-end latency is \
         measured between commits; `make up` turns it on (scripts/infra-up.sh)"
    );
    // The relay phase's spans subtract PostgreSQL's `now()` from the
    // bench's clock: one host's clock (within 50 ms of a round trip).
    let before = std::time::SystemTime::now();
    let server: f64 = orders
        .query_one("SELECT EXTRACT(EPOCH FROM clock_timestamp())::float8", &[])
        .await?
        .get(0);
    let after = std::time::SystemTime::now();
    let epoch = kit::metrics::unix_seconds;
    anyhow::ensure!(
        server >= epoch(before) - 0.05 && server <= epoch(after) + 0.05,
        "PostgreSQL's clock ({server}) is not the bench's ({} to {}): the relay phase's \
         spans need one host's clock",
        epoch(before),
        epoch(after)
    );
    // The end-to-end latency subtracts commit timestamps of different
    // databases: they must be one server's (one clock), not four.
    let mut servers = std::collections::BTreeSet::new();
    for db in Database::ALL {
        let id: i64 = pg(db)
            .await
            .query_one("SELECT system_identifier FROM pg_control_system()", &[])
            .await?
            .get(0);
        servers.insert(id);
    }
    anyhow::ensure!(
        servers.len() == 1,
        "the four databases are on {} PostgreSQL servers: the end-to-end latency subtracts \
         commit timestamps of different databases and needs one server's clock",
        servers.len()
    );
    Ok(())
}

/// Wait until every event of the tenant since `since` is applied by all
/// three consumers (each one has [`APPLY_DEADLINE`]; an event missing from
/// any of them then fails the run); prints where the time went.
async fn applied_by_all(
    system: &System,
    orders: &tokio_postgres::Client,
    since: time::OffsetDateTime,
) -> anyhow::Result<Applied> {
    // The order row of an order placed since `since` is written once, by the
    // order's transaction (only phase 3 pays and delivers, before any
    // `since` of phase 4), so its xmin is that transaction; the outbox
    // row's is not (the relay's claim and mark rewrite it).
    let rows = orders
        .query(
            "SELECT o.event_id, pg_xact_commit_timestamp(r.xmin), o.occurred_at, o.published_at
               FROM outbox_events o
               JOIN orders r ON r.order_id = o.aggregate_id::uuid
              WHERE o.tenant_id = $1 AND o.occurred_at >= $2 AND o.aggregate_type = 'order'",
            &[&system.tenant, &since],
        )
        .await?;
    let mut events = Vec::with_capacity(rows.len());
    let mut occurred = BTreeMap::new();
    let mut relay_part = Vec::with_capacity(rows.len());
    for row in &rows {
        let id: uuid::Uuid = row.get(0);
        let committed: time::OffsetDateTime = row.get(1);
        events.push((id, committed));
        occurred.insert(id, row.get::<_, time::OffsetDateTime>(2));
        // Where the time goes: order commit -> the relay's mark (its
        // transaction's start, after the confirms), then -> each
        // consumer's commit.
        if let Some(published) = row.get::<_, Option<time::OffsetDateTime>>(3) {
            relay_part.push(ms((published - committed).unsigned_abs()));
        }
    }
    let relay_part = Latency::of(relay_part);
    println!(
        "  order commit -> marked published by the relay: p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
        relay_part.p50_ms, relay_part.p99_ms, relay_part.max_ms
    );
    let committed: BTreeMap<uuid::Uuid, time::OffsetDateTime> = events.iter().copied().collect();
    // Per event, each consumer's commit and transaction start, in the
    // consumers' order: an event is done when all three are in.
    let mut commits: BTreeMap<uuid::Uuid, Vec<time::OffsetDateTime>> = BTreeMap::new();
    let mut starts: BTreeMap<uuid::Uuid, Vec<time::OffsetDateTime>> = BTreeMap::new();
    let kinds: Vec<&Member> = system
        .consumers
        .iter()
        .filter(|c| c.label.ends_with("-0"))
        .collect();
    let want = i64::try_from(events.len()).unwrap_or(i64::MAX);
    for consumer in &kinds {
        let kind = consumer.kind.expect("kind");
        let db = consumers::db(kind).await;
        let started = Instant::now();
        let mut last_print = Instant::now();
        let mut progress = stats::Progress::new(0);
        // While the consumer catches up only its count is asked (the same
        // PostgreSQL serves it); the rows once it has them all.
        loop {
            let applied: i64 = db
                .query_one(
                    "SELECT count(*) FROM processed_events
                      WHERE consumer_name = $1 AND processed_at >= $2",
                    &[&consumer.name, &since],
                )
                .await?
                .get(0);
            if applied >= want {
                break;
            }
            anyhow::ensure!(
                started.elapsed() < APPLY_DEADLINE,
                "{}: {applied} of {want} events applied after {APPLY_DEADLINE:?}: the run fails",
                kind.binary()
            );
            progress.check(
                u64::try_from(applied).unwrap_or_default(),
                format_args!("{}: applied of {want}", kind.binary()),
            )?;
            if last_print.elapsed() >= Duration::from_secs(5) {
                println!(
                    "  waiting for {}: {applied}/{want} applied after {:.0?}",
                    kind.binary(),
                    started.elapsed()
                );
                last_print = Instant::now();
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        // The inbox row is written once, by the transaction that applied
        // the event: its xmin's commit is when the effect became visible.
        let rows = db
            .query(
                "SELECT event_id, pg_xact_commit_timestamp(xmin), processed_at
                   FROM processed_events
                  WHERE consumer_name = $1 AND processed_at >= $2",
                &[&consumer.name, &since],
            )
            .await?;
        let mut part = Vec::with_capacity(rows.len());
        for row in &rows {
            let id: uuid::Uuid = row.get(0);
            let applied: time::OffsetDateTime = row.get(1);
            let started: time::OffsetDateTime = row.get(2);
            let Some(order) = committed.get(&id) else {
                continue;
            };
            part.push(ms((applied - *order).unsigned_abs()));
            // The inbox's key is (consumer, event): one row per consumer.
            commits.entry(id).or_default().push(applied);
            starts.entry(id).or_default().push(started);
        }
        let part = Latency::of(part);
        println!(
            "  order commit -> {} commit: p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms ({} events)",
            kind.binary(),
            part.p50_ms,
            part.p99_ms,
            part.max_ms,
            part.count
        );
    }
    // Done: applied by every consumer; the latest of their commits.
    let all = |times: Vec<time::OffsetDateTime>| {
        (times.len() == kinds.len())
            .then(|| times.into_iter().max())
            .flatten()
    };
    let done: BTreeMap<uuid::Uuid, time::OffsetDateTime> = commits
        .into_iter()
        .filter_map(|(id, times)| all(times).map(|at| (id, at)))
        .collect();
    anyhow::ensure!(
        kinds.len() == 3 && done.len() == events.len(),
        "{} of {} events applied by all {} consumers: the run fails",
        done.len(),
        events.len(),
        kinds.len()
    );
    let start_to_start = starts
        .into_iter()
        .filter_map(|(id, times)| all(times).map(|at| (id, at)))
        .filter_map(|(id, at)| occurred.get(&id).map(|o| ms((at - *o).unsigned_abs())))
        .collect();
    Ok(Applied {
        events,
        done,
        start_to_start,
    })
}

/// Orders started at an even `rate` for `seconds` (open loop), then the
/// latency of every event from its order to the last of the three consumers
/// (printed, with the per-stage breakdown): the load, the latency and its
/// per-second timeline.
async fn paced_run(
    system: &System,
    orders: &tokio_postgres::Client,
    rate: f64,
    seconds: u64,
) -> anyhow::Result<(api::Load, Latency, Timelines)> {
    let since = consumers::now(&consumers::db(Kind::Inventory).await).await;
    let load = api::paced_load(
        &system.api.base_url(),
        &system.key,
        10_000_000,
        rate,
        Duration::from_secs(seconds),
    )
    .await;
    report::print_load("paced order-api", &load);
    let (latency, timelines) = end_to_end(system, orders, since).await?;
    println!(
        "  order commit -> committed by all three: p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms ({} events)",
        latency.p50_ms, latency.p99_ms, latency.max_ms, latency.count
    );
    Ok((load, latency, timelines))
}

/// Every event of the paced run: from its order's commit to the last of the
/// three consumers' commits (see [`Applied`]; the older start-to-start
/// measure is printed next to it).
async fn end_to_end(
    system: &System,
    orders: &tokio_postgres::Client,
    since: time::OffsetDateTime,
) -> anyhow::Result<(Latency, Timelines)> {
    let applied = applied_by_all(system, orders, since).await?;
    let (latency, timelines) = applied.by_second(since)?;
    let before = Latency::of(applied.start_to_start);
    println!(
        "  (order transaction start -> the last consumer transaction's start, as measured \
         until session 7: p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms)",
        before.p50_ms, before.p99_ms, before.max_ms
    );
    Ok((latency, timelines))
}

/// Phase 2: the relay draining a backlog (one relay, then two) against lapin
/// confirm-publishing the same messages, `per_order` events per synthetic
/// order. Returns the backlog size.
async fn relay_phase(
    system: &System,
    orders: &tokio_postgres::Client,
    settings: &Settings,
    per_order: i64,
    results: &mut Results,
) -> anyhow::Result<i64> {
    // 2. Relay: backlog, one relay, two relays, raw confirm-publish.
    phase(&format!(
        "2. relay: backlog of {} events, {per_order} per order",
        settings.events
    ));
    for consumer in &system.consumers {
        if consumer.label.ends_with("-0") {
            unbind_consumer(&consumer.name, &system.exchange).await;
        }
    }
    let sink = relay::Sink::bind(&system.exchange).await;
    let drained = guarded(relay_drains(
        system, orders, settings, per_order, &sink, results,
    ))
    .await;
    // Deleted on every path, a panic too: nothing else removes the sink's
    // queue (durable, bound to everything: it would keep filling).
    sink.delete().await;
    let backlog = match drained {
        Ok(result) => result?,
        Err(panic) => std::panic::resume_unwind(panic),
    };
    for consumer in &system.consumers {
        if consumer.label.ends_with("-0") {
            bind_consumer(&consumer.name, &system.exchange).await;
        }
    }
    Ok(backlog)
}

/// Into `sink`: the raw loop's first half, one relay, two relays, the raw
/// loop's second half.
async fn relay_drains(
    system: &System,
    orders: &tokio_postgres::Client,
    settings: &Settings,
    per_order: i64,
    sink: &relay::Sink,
    results: &mut Results,
) -> anyhow::Result<i64> {
    let backlog = relay::top_up(orders, &system.tenant, settings.events, per_order).await?;
    // The API phase's rows are orders of one event each; only the copies
    // that top them up have `per_order` events: the table says how many
    // orders the backlog really holds.
    let backlog_orders: i64 = orders
        .query_one(
            "SELECT count(DISTINCT aggregate_id) FROM outbox_events WHERE tenant_id = $1",
            &[&system.tenant],
        )
        .await?
        .get(0);
    results.relay_backlog_orders = u64::try_from(backlog_orders).unwrap_or_default();
    println!("  backlog: {backlog} unpublished events of {backlog_orders} orders");
    // The relay's own defaults (what `start_system` runs it with): the raw
    // loop cannot drift from them.
    let defaults = outbox_relay::settings::RelaySettings::default();
    let workers = defaults.workers;
    let window = usize::try_from(defaults.batch_size).unwrap_or(500);
    results.relay_workers = workers;
    results.relay_window = window;
    results.relay_events_per_order = per_order;
    let rows = relay::rows(orders, &system.tenant, None, backlog).await;
    let half = rows.len() / 2;
    let halves: Vec<Arc<Vec<_>>> = [&rows[..half], &rows[half..]]
        .into_iter()
        .map(|rows| {
            Arc::new(
                rows.iter()
                    .map(|row| (system.exchange.clone(), relay::message(row)))
                    .collect(),
            )
        })
        .collect();
    drop(rows);
    // In halves around the drains (raw, raw as two, one relay, two relays,
    // raw as two, raw), as the other phases alternate their sides: a drift
    // of the machine's speed, or the broker's leftover work from the side
    // before, weighs on both. Each relay count has its own raw limit, at its
    // concurrency: one relay's channels on one connection, two relays' on
    // two.
    phase(&format!(
        "2. raw, first half: lapin confirm-publish of the same messages ({workers} channels \
         x {window} in flight, a connection of its own)"
    ));
    let one = raw_half(orders, sink, halves[0].clone(), 1, workers, window).await?;
    phase(&format!(
        "2. raw as two relays, first half ({} channels x {window} in flight over 2 connections)",
        2 * workers
    ));
    let two = raw_half(orders, sink, halves[0].clone(), 2, 2 * workers, window).await?;
    phase("2. one relay draining the backlog");
    results.relay_one = drain(system, orders, sink, backlog, 1, results).await?;
    phase("2. two relays draining the same backlog again");
    results.relay_two = drain(system, orders, sink, backlog, 2, results).await?;
    phase("2. raw as two relays, second half");
    let two_second = raw_half(orders, sink, halves[1].clone(), 2, 2 * workers, window).await?;
    phase("2. raw, second half");
    let one_second = raw_half(orders, sink, halves[1].clone(), 1, workers, window).await?;
    results.relay_raw = both_halves(results, "2. relay raw", one, one_second);
    results.relay_raw_two = both_halves(results, "2. relay raw, 2 connections", two, two_second);
    Ok(backlog)
}

/// One raw half: its drain, CPU and WAL ([`raw_half`]).
type RawHalf = (relay::Drain, cpu::Usage, relay::Wal);

/// A raw loop's two halves as one drain, their CPU and WAL recorded under
/// `label`.
fn both_halves(
    results: &mut Results,
    label: &str,
    (first, first_cpu, first_wal): RawHalf,
    (second, second_cpu, second_wal): RawHalf,
) -> relay::Drain {
    let raw = first.then(second);
    report::print_drain(&format!("{label}, both halves"), &raw);
    let events = raw.events;
    record_cpu(results, label, events, first_cpu.plus(second_cpu));
    record_wal(results, label, events, first_wal.plus(second_wal));
    raw
}

/// One half of the raw confirm-publish loop into the sink, on an AMQP
/// connection of its own (as the relay has; the sink consumes on another),
/// after [`settle`]: its drain, CPU and WAL.
async fn raw_half(
    orders: &tokio_postgres::Client,
    sink: &relay::Sink,
    messages: Arc<Vec<(String, outbox_relay::publish::Message)>>,
    connections: usize,
    channels: usize,
    window: usize,
) -> anyhow::Result<(relay::Drain, cpu::Usage, relay::Wal)> {
    let mut opened = Vec::with_capacity(connections);
    for _ in 0..connections.max(1) {
        opened.push(system_tests::consumers::connect().await);
    }
    settle(orders).await;
    let before = sink.delivered();
    let wal = relay::Wal::read(orders).await?;
    let meter = cpu::Meter::start();
    let recorder = sink.record();
    sink.arm();
    let mut raw = relay::raw_publish(&opened, messages.clone(), channels, window).await;
    relay::span_from_first_message(&mut raw, sink)?;
    let delivered = sink
        .wait_delivered(before + messages.len() as u64, RAW_DELIVERY_DEADLINE)
        .await;
    let cpu = meter.stop();
    let wal = relay::Wal::read(orders).await?.since(wal);
    raw.timeline = recorder.finish();
    for connection in &opened {
        let _ = connection.close(200, "done".into()).await;
    }
    delivered?;
    report::print_drain("raw confirm-publish", &raw);
    println!("  CPU per event: {}", cpu.per_event(raw.events));
    Ok((raw, cpu, wal))
}

/// How long the sink may take to receive the raw loop's confirmed messages.
const RAW_DELIVERY_DEADLINE: Duration = Duration::from_secs(600);

/// `relays` relays draining the tenant's backlog of `backlog` events into the
/// sink: the drain, its CPU per event (recorded), the relays stopped again.
async fn drain(
    system: &System,
    orders: &tokio_postgres::Client,
    sink: &relay::Sink,
    backlog: i64,
    relays: usize,
    results: &mut Results,
) -> anyhow::Result<relay::Drain> {
    let label = match relays {
        1 => "1 relay".to_owned(),
        n => format!("{n} relays"),
    };
    // Each drain's backlog written in the checkpoint cycle of its drain
    // (the API's rows among it too, which the first drain would otherwise
    // find last changed before a checkpoint), the same way for both.
    let checkpoints = relay::rewrite_in_a_fresh_checkpoint_cycle(orders, &system.tenant).await?;
    // The same state as before the raw loop: the database vacuumed, RabbitMQ
    // done with the previous side's publishes.
    settle(orders).await;
    let wal = relay::Wal::read(orders).await?;
    let relays_since = consumers::now(orders).await;
    let meter = cpu::Meter::start();
    let before = sink.delivered();
    let recorder = sink.record();
    sink.arm();
    let started = start_relays(system, relays).await;
    let total = u64::try_from(backlog).unwrap_or(0);
    let drain = relay::measure_drain(
        orders,
        &system.tenant,
        started,
        &label,
        sink,
        before,
        total,
        DRAIN_DEADLINE,
    )
    .await;
    let cpu = meter.stop();
    let timeline = recorder.finish();
    stop_relays(system);
    relay::wait_relay_backends_gone(orders, relays_since).await;
    let mut drain = drain?;
    drain.timeline = timeline;
    record_cpu(results, &format!("2. {label}"), drain.events, cpu);
    let after = relay::Wal::read(orders).await?;
    let mut wal = after.since(wal);
    // The CHECKPOINT's own is not the drain's.
    wal.checkpoints = (after.checkpoints - checkpoints - 1).max(0);
    if wal.checkpoints > 0 {
        println!(
            "  warning: {} checkpoint(s) started between the CHECKPOINT before the backlog \
             and the drain's end: the drain paid full-page images",
            wal.checkpoints
        );
    }
    record_wal(results, &format!("2. {label}"), drain.events, wal);
    report::print_drain(&label, &drain);
    Ok(drain)
}

/// How long one drain of the relay phase may take.
const DRAIN_DEADLINE: Duration = Duration::from_secs(1800);

/// `bench relay`: phase 2 alone (`BENCH_EVENTS` backlog), after 5 s of API
/// orders as its templates: a quick loop for profiling the relay.
async fn relay_only(settings: Settings) -> anyhow::Result<()> {
    let run_started = Instant::now();
    let mut results = Results::default();
    let bench = Bench::start(
        "relay: start order-api, 2 relays (stopped), 3 consumers (private names)",
        2,
        false,
    )
    .await?;
    let outcome = guarded(async {
        bench.template_orders().await;
        let per_order = settings.events_per_order;
        relay_phase(
            &bench.system,
            &bench.orders,
            &settings,
            per_order,
            &mut results,
        )
        .await?;
        report::print_ratio(
            "1 relay",
            results.relay_one.per_second,
            results.relay_raw.per_second,
        );
        report::print_ratio(
            "2 relays",
            results.relay_two.per_second,
            results.relay_raw_two.per_second,
        );
        Ok(())
    })
    .await;
    bench.finish(outcome).await?;
    println!("done in {:.0?}", run_started.elapsed());
    Ok(())
}

/// Phase 3: each consumer applying the events of whole orders (each placed,
/// paid and delivered through the API, as in production), queued for it,
/// against the same transaction run raw (under `raw_tenant` and
/// `raw_tenant`2).
///
/// Each side runs in halves ordered consumer, raw, raw, consumer (like the
/// API phase): a drift of the machine's speed, or of the tables' size,
/// during the phase then weighs on both sides alike instead of on the later
/// one. The consumer is stopped between its halves and its queues are
/// filled only while it is stopped, so it never competes with the filling.
/// The relays must be stopped: this phase publishes the orders' events
/// itself.
async fn consumer_phase(
    system: &System,
    orders: &tokio_postgres::Client,
    settings: &Settings,
    raw_tenant: &str,
    results: &mut Results,
) {
    // 3. Consumers: fill each one's queues, start it, compare with raw.
    let lifecycles = u64::try_from(settings.consumer_events)
        .unwrap_or_default()
        .div_ceil(3)
        .max(1);
    phase(&format!(
        "3. consumers: the {} events of {lifecycles} orders (placed, paid, delivered) for \
         each, in halves ordered consumer (queued while stopped), raw, raw, consumer",
        3 * lifecycles
    ));
    let rows = lifecycle_rows(system, orders, settings, lifecycles).await;
    results.consumer_orders = lifecycles;
    let half = rows.len() / 2;
    // The relay phase's drains (and the marks above) leave the outbox's
    // dead versions behind.
    consumers::vacuum(orders).await;
    // The effects are keyed by tenant: each raw variant applies the events
    // under a tenant of its own (same stock), so its effects are new too.
    let bodies_for = |tenant: &str| -> Vec<(String, Vec<u8>)> {
        rows.iter()
            .map(|row| {
                let mut row = row.clone();
                row.tenant_id = tenant.to_owned();
                let body = outbox_relay::publish::envelope(&row)
                    .expect("a bench row has a version")
                    .to_json_bytes()
                    .expect("encode");
                (row.aggregate_id, body)
            })
            .collect()
    };
    // The consumers run with the production default partitions (4): the
    // raw loop gets as many sequential workers.
    let partitions = usize::from(consumer_options().partitions);
    results.consumer_partitions = partitions;
    let raw_bodies = bodies_for(raw_tenant);
    let unprepared_bodies = bodies_for(&format!("{raw_tenant}2"));
    let priming = bodies_for(&format!("{raw_tenant}3"));
    let priming = &priming[..priming.len().min(PRIMING_EVENTS)];
    for consumer in &system.consumers {
        let kind = consumer.kind.expect("consumer kind");
        let db = consumers::db(kind).await;
        // Neither side starts on the remains of an earlier run: tables its
        // teardown emptied keep their indexes' pages (`compact_empty`), and
        // once autovacuum has vacuumed them they are planned as empty, a
        // session's generic plans then walking a tenant's rows by the wrong
        // index (see `consumers::vacuum`). The indexes rebuilt, some events
        // of a tenant of the run's own, applied raw and kept until the
        // teardown, give every table rows for the halves' vacuum to
        // analyze. (Truncating the empty tables instead, as the orders
        // database is at the start, read the ledger lower in three runs:
        // PostgreSQL 611-615 against 542-547 µs per event for the raw side,
        // where this reads 564-568 against 546-548.)
        consumers::compact_empty(&db).await;
        consumers::raw(kind, &prime_name(&consumer.name), priming, partitions, true).await;
        let (first, first_cpu) = consumer_half(consumer, &db, &rows[..half]).await;
        stop_member(consumer);
        let raw_name = format!("{}-raw", consumer.name);
        let (raw_first, raw_cpu) =
            raw_apply_half(kind, &db, &raw_name, &raw_bodies[..half], partitions).await;
        let (raw_second, second_raw_cpu) =
            raw_apply_half(kind, &db, &raw_name, &raw_bodies[half..], partitions).await;
        let raw_cpu = raw_cpu.plus(second_raw_cpu);
        // The second half; the consumer then stays up for phase 4.
        let (second, second_cpu) = consumer_half(consumer, &db, &rows[half..]).await;
        let applied = first.then(second);
        report::print_apply(kind.binary(), &applied);
        record_cpu(
            results,
            &format!("3. {}", kind.binary()),
            applied.events,
            first_cpu.plus(second_cpu),
        );
        let raw = raw_first.then(raw_second);
        report::print_apply("raw (the runtime's transaction, same statements)", &raw);
        record_cpu(
            results,
            &format!("3. {} raw", kind.binary()),
            raw.events,
            raw_cpu,
        );
        consumers::forget(kind, &raw_name).await;
        // The transaction as the runtime sent it before the benchmark
        // (statements as text, one round trip each): the gain of preparing
        // and pipelining them, same run (informative: in one piece, after).
        let unprepared =
            consumers::raw(kind, &raw_name, &unprepared_bodies, partitions, false).await;
        report::print_apply(
            "raw (statements one at a time as text, as before)",
            &unprepared,
        );
        consumers::forget(kind, &raw_name).await;
        results
            .consumers
            .insert(kind.binary().to_owned(), (applied, raw, unprepared));
    }
}

/// Phase 3's priming events per consumer (100 orders' worth).
const PRIMING_EVENTS: usize = 300;

/// The inbox name of phase 3's priming events for `consumer`.
fn prime_name(consumer: &str) -> String {
    format!("{consumer}-prime")
}

/// The first order number of phase 3's orders (idempotency keys
/// `order-<n>`, checkouts `chk-<n>`): far from every other phase's.
const LIFECYCLE_BASE: u64 = 20_000_000;

/// `count` orders placed, paid and delivered through the API, `concurrency`
/// at a time (the relays stopped): their outbox rows in the order they
/// were written (orders interleaved, as they arrive in production; each
/// order's events in sequence), then marked published, so that the relay
/// started for phase 4 does not send them again (this phase queues them
/// for the consumers itself).
async fn lifecycle_rows(
    system: &System,
    orders: &tokio_postgres::Client,
    settings: &Settings,
    count: u64,
) -> Vec<outbox_relay::claim::OutboxRow> {
    let since = consumers::now(orders).await;
    let started = Instant::now();
    let traffic = system
        .drive(LIFECYCLE_BASE..LIFECYCLE_BASE + count, settings.concurrency)
        .await;
    println!(
        "  {} orders placed, paid and delivered through the API in {:.1?} ({} requests retried)",
        traffic.orders,
        started.elapsed(),
        traffic.retries
    );
    let rows = relay::rows(orders, &system.tenant, Some(since), i64::MAX).await;
    assert_eq!(
        rows.len() as u64,
        3 * count,
        "phase 3: the outbox rows of {count} placed, paid and delivered orders"
    );
    in_sequence(
        rows.iter()
            .map(|row| (row.aggregate_id.as_str(), row.aggregate_sequence)),
    )
    .expect("phase 3's events in each order's sequence");
    let marked = relay::mark_published(orders, &system.tenant, Some(since))
        .await
        .expect("mark phase 3's rows published");
    assert_eq!(marked, 3 * count, "phase 3: its rows marked published");
    rows
}

/// `Ok` when every order's events, (order, sequence) in the order given,
/// come in its sequence (1, 2, 3, ...), as a consumer must receive them.
fn in_sequence<'a>(events: impl IntoIterator<Item = (&'a str, i64)>) -> anyhow::Result<()> {
    let mut last: HashMap<&str, i64> = HashMap::new();
    for (order, sequence) in events {
        let seen = last.entry(order).or_insert(0);
        anyhow::ensure!(
            sequence == *seen + 1,
            "order {order}: event {sequence} after event {seen}"
        );
        *seen = sequence;
    }
    Ok(())
}

/// Before each half of phase 3, the same state for either side: the
/// consumer's database vacuumed, and RabbitMQ done with earlier work (its
/// quorum WAL written out to segment files after a burst of publishes or
/// acks: over a core for a second or more, seen after the last fill of a
/// run), which belongs to what came before, not to the side measured next.
async fn settle(db: &tokio_postgres::Client) {
    consumers::vacuum(db).await;
    roll_over_quorum_wal().await;
    let waited = cpu::wait_quiet("rabbitmq", 0.25, Duration::from_secs(5)).await;
    if waited > Duration::from_millis(500) {
        println!("  (waited {waited:.1?} for RabbitMQ to finish earlier work)");
    }
}

/// Start RabbitMQ's quorum-queue WAL afresh (`rabbitmqctl eval
/// 'ra_log_wal:force_roll_over(ra_log_wal).'`; its entries are written out
/// to the queues' segments, which [`settle`] then waits for), so that every
/// side starts with an empty WAL and in-memory log tables, whatever earlier
/// phases wrote (the WAL rolls over by itself at 512 MiB, inside whichever
/// side happens to fill it). If `rabbitmqctl` cannot reach the node, the
/// side runs without it and says so.
async fn roll_over_quorum_wal() {
    let output = tokio::task::spawn_blocking(|| {
        // Bounded by coreutils' timeout: `eval` ignores rabbitmqctl's own
        // `-t` (its RPC waits forever on a hung node).
        std::process::Command::new("timeout")
            .args([
                "30",
                "rabbitmqctl",
                "-q",
                "eval",
                "ra_log_wal:force_roll_over(ra_log_wal).",
            ])
            .output()
    })
    .await;
    match output {
        Ok(Ok(output)) if output.status.success() => {}
        Ok(Ok(output)) => println!(
            "  (could not roll RabbitMQ's quorum WAL over: {})",
            String::from_utf8_lossy(&output.stderr).trim()
        ),
        Ok(Err(error)) => println!("  (could not run rabbitmqctl: {error})"),
        Err(error) => println!("  (could not run rabbitmqctl: {error})"),
    }
}

/// One raw half of phase 3 after [`settle`]: `bodies` applied raw as
/// consumer `name` of `kind` (prepared and pipelined, `partitions` workers),
/// with its timeline, and the machine's CPU meanwhile.
async fn raw_apply_half(
    kind: Kind,
    db: &tokio_postgres::Client,
    name: &str,
    bodies: &[(String, Vec<u8>)],
    partitions: usize,
) -> (consumers::Apply, cpu::Usage) {
    settle(db).await;
    let since = consumers::now(db).await;
    let meter = cpu::Meter::start();
    let mut applied = consumers::raw(kind, name, bodies, partitions, true).await;
    let cpu = meter.stop();
    applied.timeline = consumers::timeline(db, name, since).await;
    (applied, cpu)
}

/// Queue `rows` for the stopped `consumer`, vacuum its database, start it
/// and wait until it has applied them all: the run (with its timeline) and
/// the machine's CPU from its start to then.
async fn consumer_half(
    consumer: &Member,
    db: &tokio_postgres::Client,
    rows: &[outbox_relay::claim::OutboxRow],
) -> (consumers::Apply, cpu::Usage) {
    let connection = system_tests::consumers::connect().await;
    let queued: Vec<_> = rows
        .iter()
        .map(|row| (format!("{}.events", consumer.name), relay::message(row)))
        .collect();
    let fill =
        relay::raw_publish(std::slice::from_ref(&connection), Arc::new(queued), 1, 500).await;
    let _ = connection.close(200, "done".into()).await;
    println!(
        "  {}: queued {} messages in {:.1} s, starting",
        consumer.label, fill.events, fill.wall_seconds
    );
    settle(db).await;
    let since = consumers::now(db).await;
    let started = Instant::now();
    let meter = cpu::Meter::start();
    consumer.start("");
    consumer.ready(Duration::from_secs(60)).await;
    let mut applied = consumers::measure(
        db,
        &consumer.name,
        since,
        u64::try_from(rows.len()).unwrap_or_default(),
        started,
    )
    .await;
    let cpu = meter.stop();
    applied.timeline = consumers::timeline(db, &consumer.name, since).await;
    (applied, cpu)
}

/// `bench consumers`: phase 3 alone (the relays stay stopped): a quick loop
/// for the consumers.
async fn consumers_only(settings: Settings) -> anyhow::Result<()> {
    let mut results = Results::default();
    let bench = Bench::start(
        "consumers: start order-api, 1 relay (stopped), 3 consumers (private names)",
        1,
        false,
    )
    .await?;
    let outcome = guarded(async {
        consumer_phase(
            &bench.system,
            &bench.orders,
            &settings,
            &bench.raw_tenant,
            &mut results,
        )
        .await;
        for (name, (applied, raw, _)) in &results.consumers {
            report::print_ratio(name, applied.per_second, raw.per_second);
        }
        Ok(())
    })
    .await;
    bench.finish(outcome).await
}

/// Phase 1: `POST /orders` against the same transaction run raw.
async fn api_phase(
    system: &System,
    orders: &tokio_postgres::Client,
    settings: &Settings,
    raw_tenant: &str,
    results: &mut Results,
) {
    // 1. API vs raw transaction, in halves ordered API, raw, raw, API: a
    // drift of the machine's speed (or of the tables' size) during the
    // phase then weighs on both sides alike instead of on the later one.
    let half = Duration::from_secs(settings.api_seconds) / 2;
    let url = pg_url(Database::Orders);
    let (base, key, clients) = (system.api.base_url(), &system.key, settings.concurrency);
    phase(&format!(
        "1. API: POST /orders, {clients} clients, against the same transaction through \
         tokio-postgres (raw), {half:?} each in the order API, raw, raw, API"
    ));
    // Order numbers of the second halves start far above the first's.
    let second = 1_000_000;
    let meter = cpu::Meter::start();
    let api_first = api::http_run(&base, key, 0, clients, half).await;
    let api_cpu = meter.stop();
    let meter = cpu::Meter::start();
    let raw_first = api::raw_run(&url, raw_tenant, 0, clients, half).await;
    let raw_second = api::raw_run(&url, raw_tenant, second, clients, half).await;
    let raw_cpu = meter.stop();
    let meter = cpu::Meter::start();
    let api_second = api::http_run(&base, key, second, clients, half).await;
    let api_cpu = api_cpu.plus(meter.stop());
    results.api = api_first.then(api_second).load();
    results.api_raw = raw_first.then(raw_second).load();
    report::print_load("order-api", &results.api);
    let events = results.api.requests;
    record_cpu(results, "1. API", events, api_cpu);
    report::print_load("raw", &results.api_raw);
    let events = results.api_raw.requests;
    record_cpu(results, "1. API raw", events, raw_cpu);
    cleanup_orders(orders, raw_tenant).await;
}

/// `bench api`: phase 1 alone (the API against the raw transaction).
async fn api_only(settings: Settings) -> anyhow::Result<()> {
    let mut results = Results::default();
    let bench = Bench::start(
        "api: start order-api, 1 relay (stopped), 3 consumers (private names)",
        1,
        false,
    )
    .await?;
    let outcome = guarded(async {
        api_phase(
            &bench.system,
            &bench.orders,
            &settings,
            &bench.raw_tenant,
            &mut results,
        )
        .await;
        report::print_ratio("API", results.api.per_second, results.api_raw.per_second);
        Ok(())
    })
    .await;
    bench.finish(outcome).await
}

/// `bench e2e`: the end-to-end phase alone, at `BENCH_E2E_RATE` orders/s
/// (default 50) for `BENCH_E2E_SECONDS`, with the per-stage breakdown: a
/// quick loop for profiling the latency without the whole suite.
async fn e2e_only(settings: Settings) -> anyhow::Result<()> {
    let rate: f64 = std::env::var("BENCH_E2E_RATE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50.0);
    let bench = Bench::start(
        "e2e: start order-api, 1 relay, 3 consumers (private names)",
        1,
        true,
    )
    .await?;
    let outcome = guarded(async {
        let (system, orders) = (&bench.system, &bench.orders);
        start_relays(system, 1).await;
        phase(&format!(
            "e2e: {rate:.0} orders/s for {} s",
            settings.e2e_seconds
        ));
        paced_run(system, orders, rate, settings.e2e_seconds).await?;
        Ok(())
    })
    .await;
    bench.finish(outcome).await
}

/// Delete what aborted bench runs left behind (their teardown never ran), and
/// say how many other tenants' rows are pending. The bench's relays claim
/// for their own tenant only, but their claim still walks every pending row
/// of the outbox: 6,000 rows left by one interrupted `make bench-consumers`
/// (its relays never drained them) took the end-to-end p50 from 10 to 40-95
/// ms. (Production relays have no tenant filter.)
///
/// A run is aborted when its advisory lock ([`run_lock`]) is free: its
/// process, and with it the connection holding the lock, is gone. A bench
/// running at the same time in another process holds its lock and keeps
/// its rows.
async fn clear_aborted_runs(db: &tokio_postgres::Client) {
    // A run is found by what it writes only once it holds its lock: its
    // pending outbox rows, or its stock receipts (`Bench::start` stocks its
    // tenants right after taking the lock, and the teardown deletes each
    // tenant's last of its rows). Not by its `tenants` row: that is written before the
    // lock is taken, so a run starting in another process would be taken
    // for an aborted one. The receipts find a run killed after its rows
    // were published (phases 3 and 4), whose journal entries only this
    // removes.
    let mut tenants: Vec<String> = db
        .query(
            "SELECT DISTINCT tenant_id FROM outbox_events
              WHERE published_at IS NULL AND tenant_id LIKE 'bench-%'",
            &[],
        )
        .await
        .map(|rows| rows.iter().map(|r| r.get::<_, String>(0)).collect())
        .unwrap_or_else(|_| Vec::new());
    tenants.extend(
        consumers::db(Kind::Inventory)
            .await
            .query(
                "SELECT DISTINCT tenant_id FROM stock_receipts WHERE tenant_id LIKE 'bench-%'",
                &[],
            )
            .await
            .map(|rows| {
                rows.iter()
                    .map(|r| r.get::<_, String>(0))
                    .collect::<Vec<_>>()
            })
            .unwrap_or_default(),
    );
    let runs: std::collections::BTreeSet<String> =
        tenants.iter().map(|tenant| run_tenant(tenant)).collect();
    for run in &runs {
        let free = db
            .query_one(&format!("SELECT pg_try_advisory_lock({RUN_LOCK})"), &[run])
            .await
            .is_ok_and(|row| row.get::<_, bool>(0));
        if !free {
            println!("  leaving the rows of tenant {run}: a bench running in another process");
            continue;
        }
        // Every tenant of the run, as its teardown would have.
        for tenant in run_tenants(run) {
            println!("  deleting the rows of an aborted run: tenant {tenant}");
            cleanup_orders(db, &tenant).await;
            cleanup_effects(&tenant).await;
            forget_tenant(db, &tenant).await;
        }
        let _ = db
            .execute(&format!("SELECT pg_advisory_unlock({RUN_LOCK})"), &[run])
            .await;
    }
    let pending: i64 = db
        .query_one(
            "SELECT count(*) FROM outbox_events WHERE published_at IS NULL",
            &[],
        )
        .await
        .map(|row| row.get(0))
        .unwrap_or_default();
    if pending > 1_000 {
        println!(
            "  WARNING: {pending} pending outbox rows of other tenants: every claim of the \
             bench's relays walks them (slower relay phases, higher end-to-end latency)"
        );
    }
}

/// Delete a tenant's orders, idempotency records and outbox rows.
async fn cleanup_orders(db: &tokio_postgres::Client, tenant: &str) {
    // Its pending rows too (orders V13 keeps unpublished rows from a DELETE
    // unless the session lifts the guard: the bench's own rows).
    let _ = db
        .batch_execute("SET outbox.allow_unpublished_delete = on")
        .await;
    for statement in [
        "DELETE FROM outbox_events WHERE tenant_id = $1",
        "DELETE FROM idempotency_requests WHERE tenant_id = $1",
        "DELETE FROM payments WHERE tenant_id = $1",
        "DELETE FROM deliveries WHERE tenant_id = $1",
        "DELETE FROM order_lines WHERE order_id IN (SELECT order_id FROM orders WHERE tenant_id = $1)",
        "DELETE FROM orders WHERE tenant_id = $1",
    ] {
        if let Err(error) = db.execute(statement, &[&tenant]).await {
            eprintln!("cleanup: {:#}", anyhow::Error::from(error));
        }
    }
    let _ = db
        .batch_execute("RESET outbox.allow_unpublished_delete")
        .await;
}

/// Delete a tenant's API keys and its `tenants` row (after its orders).
async fn forget_tenant(db: &tokio_postgres::Client, tenant: &str) {
    for statement in [
        "DELETE FROM api_keys WHERE tenant_id = $1",
        "DELETE FROM tenants WHERE tenant_id = $1",
    ] {
        if let Err(error) = db.execute(statement, &[&tenant]).await {
            eprintln!("cleanup: {:#}", anyhow::Error::from(error));
        }
    }
}

/// Delete the consumers' effects of a tenant, children before parents
/// (migrations/{inventory,ledger,loyalty}), and its progress rows, the
/// ledger's journal too ([`cleanup_journal`]).
async fn cleanup_effects(tenant: &str) {
    cleanup_journal(tenant).await;
    // The stock receipts last of all: they are how the next run finds this
    // one if it is killed before its teardown ends ([`clear_aborted_runs`]).
    for (kind, statements) in [
        (
            Kind::Ledger,
            &[
                "DELETE FROM ledger_orders WHERE tenant_id = $1",
                "DELETE FROM order_progress WHERE tenant_id = $1",
                "DELETE FROM processed_events WHERE tenant_id = $1",
            ][..],
        ),
        (
            Kind::Loyalty,
            &[
                "DELETE FROM loyalty_entries WHERE tenant_id = $1",
                "DELETE FROM loyalty_orders WHERE tenant_id = $1",
                "DELETE FROM order_progress WHERE tenant_id = $1",
                "DELETE FROM processed_events WHERE tenant_id = $1",
            ][..],
        ),
        (
            Kind::Inventory,
            &[
                // Movements are immutable (inventory V2) but for a repair
                // that says so, set on this session for the one DELETE
                // between the SET and the RESET: the bench's own tenant's.
                "SET inventory.allow_movement_repair = on",
                "DELETE FROM stock_movements WHERE tenant_id = $1",
                "RESET inventory.allow_movement_repair",
                "DELETE FROM inventory_orders WHERE tenant_id = $1",
                "DELETE FROM stock_levels WHERE tenant_id = $1",
                "DELETE FROM order_progress WHERE tenant_id = $1",
                "DELETE FROM processed_events WHERE tenant_id = $1",
                "DELETE FROM stock_receipts WHERE tenant_id = $1",
            ][..],
        ),
    ] {
        let db = consumers::db(kind).await;
        for statement in statements {
            let done = if statement.contains("$1") {
                db.execute(*statement, &[&tenant]).await.map(|_| ())
            } else {
                db.batch_execute(statement).await
            };
            if let Err(error) = done {
                eprintln!(
                    "cleanup ({}): {:#}",
                    kind.binary(),
                    anyhow::Error::from(error)
                );
            }
        }
    }
}

/// Delete a bench tenant's journal and accounts (phase 3 pays and
/// delivers orders, and the ledger posts them). The journal is immutable:
/// its triggers reject every DELETE (ledger V1), and no application path
/// may remove an entry. The bench's tenants are its own, on the local
/// cluster, whose role is a superuser (`scripts/infra-up.sh`): it lifts the
/// triggers for this one transaction (`session_replication_role =
/// replica`), as dropping the database would. Left behind, the entries
/// name orders the orders database no longer has, and `make drift` over
/// every tenant would report them. A role that may not do this leaves them,
/// and says so.
async fn cleanup_journal(tenant: &str) {
    let mut db = consumers::db(Kind::Ledger).await;
    let deleted = async {
        let tx = db.transaction().await?;
        tx.batch_execute("SET LOCAL session_replication_role = replica")
            .await?;
        let mut rows = 0;
        for statement in [
            "DELETE FROM journal_lines WHERE tenant_id = $1",
            "DELETE FROM journal_entries WHERE tenant_id = $1",
            "DELETE FROM ledger_accounts WHERE tenant_id = $1",
        ] {
            rows += tx.execute(statement, &[&tenant]).await?;
        }
        tx.commit().await?;
        Ok::<u64, tokio_postgres::Error>(rows)
    }
    .await;
    if let Err(error) = deleted {
        eprintln!(
            "cleanup (ledger-consumer): the journal of tenant {tenant} stays ({:#}); \
             `make drift` over every tenant reports its entries as for unknown orders",
            anyhow::Error::from(error)
        );
    }
}

/// `bench backlog`: one relay draining a backlog of `BENCH_BACKLOG_EVENTS`,
/// sampling the claim query's latency and the outbox's dead tuples.
async fn backlog(settings: Settings) -> anyhow::Result<()> {
    let mut bench = Bench::start("backlog: start order-api, 1 relay (stopped)", 1, false).await?;
    let outcome = guarded(backlog_drain(&mut bench, &settings)).await;
    let verdict = bench.finish(outcome).await?;
    // The deleted backlog leaves ~2 GB of free space in outbox_events (half
    // of every page is kept free by the fillfactor). A plain VACUUM makes it
    // reusable and takes no lock that blocks other sessions' reads and
    // writes of this shared table (VACUUM FULL would, for the whole rewrite);
    // the file keeps its size (see BENCHMARKS.md, method 7).
    phase("backlog: VACUUM (ANALYZE) outbox_events (the drained backlog's space made reusable)");
    let orders = pg(Database::Orders).await;
    orders
        .batch_execute("VACUUM (ANALYZE) outbox_events")
        .await?;
    // No verdict is no proof of flatness: a run too short to judge fails
    // too (before, it ended with success).
    match verdict.flat {
        Some(true) => Ok(()),
        Some(false) => anyhow::bail!(
            "NOT FLAT: the claim latency or the dead tuples grew during the drain (see above)"
        ),
        None => anyhow::bail!(
            "no verdict: fewer than 3 samples of the drain; raise BENCH_BACKLOG_EVENTS"
        ),
    }
}

/// The whole backlog drain may take this long at most.
const BACKLOG_DEADLINE: Duration = Duration::from_secs(3600);
/// The drain fails when the sink receives nothing for this long.
const BACKLOG_STALL: Duration = Duration::from_secs(120);

/// The backlog run's body: the backlog, the drain sampled, the results.
async fn backlog_drain(bench: &mut Bench, settings: &Settings) -> anyhow::Result<report::Flatness> {
    for consumer in &bench.system.consumers {
        if consumer.label.ends_with("-0") {
            unbind_consumer(&consumer.name, &bench.system.exchange).await;
        }
    }
    phase("backlog: 5 s of API orders as templates, then the synthetic backlog");
    bench.template_orders().await;
    let system = bench.system.clone();
    let orders = &mut bench.orders;
    let per_order = settings.backlog_events_per_order;
    let backlog = relay::top_up(orders, &system.tenant, settings.backlog_events, per_order).await?;
    println!("  backlog: {backlog} events, {per_order} per synthetic order");
    let sink = relay::Sink::bind(&system.exchange).await;
    phase("backlog: one relay draining; a sample every 2 s");
    sink.arm();
    let started = start_relays(&system, 1).await;
    let measured = guarded(async {
        let samples = sample_backlog(orders, &system.tenant, started, &sink, backlog).await?;
        let total = u64::try_from(backlog).unwrap_or(0);
        let drain = relay::measure_drain(
            orders,
            &system.tenant,
            started,
            "relay",
            &sink,
            0,
            total,
            BACKLOG_DEADLINE,
        )
        .await?;
        Ok((samples, drain))
    })
    .await;
    stop_relays(&system);
    // Deleted on every path, a panic too (see `relay_phase`).
    sink.delete().await;
    let (samples, drain) = match measured {
        Ok(result) => result?,
        Err(panic) => std::panic::resume_unwind(panic),
    };
    report::print_drain("1 relay", &drain);
    let verdict = report::Flatness::of(&samples, backlog);
    verdict.print();
    report::write_backlog(
        &settings.out,
        settings.backlog_events_per_order,
        &drain,
        &samples,
        &verdict,
    )?;
    Ok(verdict)
}

/// A sample every 2 s until the sink has received the whole backlog; an
/// error past [`BACKLOG_DEADLINE`], or when the sink received nothing for
/// [`BACKLOG_STALL`].
async fn sample_backlog(
    orders: &mut tokio_postgres::Client,
    tenant: &str,
    started: Instant,
    sink: &relay::Sink,
    backlog: i64,
) -> anyhow::Result<Vec<relay::BacklogSample>> {
    let mut samples = Vec::new();
    let (mut received, mut progressed) = (sink.delivered(), Instant::now());
    loop {
        let delivered = sink.delivered();
        if delivered > received {
            (received, progressed) = (delivered, Instant::now());
        }
        let left = backlog.saturating_sub(i64::try_from(delivered).unwrap_or(i64::MAX));
        let sample = relay::backlog_sample(orders, tenant, started, left).await;
        println!(
            "  {:>6.0} s  not yet received {:>8}  claim {:>7.1} ms  dead tuples {:>8}  live {:>8}",
            sample.seconds, sample.left, sample.claim_ms, sample.dead_tuples, sample.live_tuples
        );
        samples.push(sample);
        if left == 0 {
            return Ok(samples);
        }
        anyhow::ensure!(
            progressed.elapsed() < BACKLOG_STALL,
            "backlog drain stalled: the sink received nothing for {BACKLOG_STALL:?} \
             ({delivered}/{backlog} received)"
        );
        anyhow::ensure!(
            started.elapsed() < BACKLOG_DEADLINE,
            "backlog drain not done after {BACKLOG_DEADLINE:?} ({delivered}/{backlog} received)"
        );
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::in_sequence;

    #[test]
    fn orders_interleave_but_each_keeps_its_sequence() {
        let good = [("a", 1), ("b", 1), ("a", 2), ("b", 2), ("a", 3), ("b", 3)];
        assert!(in_sequence(good).is_ok());
        let swapped = [("a", 1), ("a", 3), ("a", 2)];
        let error = in_sequence(swapped).expect_err("3 before 2");
        assert_eq!(error.to_string(), "order a: event 3 after event 1");
        assert!(
            in_sequence([("a", 2)]).is_err(),
            "an order's first event is 1"
        );
        assert!(in_sequence([("a", 1), ("a", 1)]).is_err(), "twice");
    }
}
