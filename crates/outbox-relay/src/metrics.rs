//! The relay's Prometheus metrics, registered in the service's own registry.

use std::time::Duration;

use kit::{db::PgPool, CancellationToken};
use prometheus::{
    Gauge, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry,
};

#[derive(Clone)]
pub struct Metrics {
    /// Unpublished, not quarantined rows, but those held behind a
    /// quarantined event of their order (waiting for a predecessor
    /// otherwise included).
    pub pending: IntGauge,
    /// Unpublished rows held behind a quarantined earlier event of their
    /// order (released with it by `requeue`).
    pub held: IntGauge,
    /// Age of the oldest pending row (seconds since `occurred_at`).
    pub oldest_pending_age: Gauge,
    /// How long the oldest quarantined row has been held (0: none).
    pub oldest_quarantined_age: Gauge,
    /// Quarantined rows (each also holds back its order's later events).
    pub quarantined: IntGauge,
    /// `pg_total_relation_size('outbox_events')`.
    pub table_bytes: IntGauge,
    /// Pending, not quarantined rows that failed at least once (in backoff
    /// or being retried).
    pub retrying: IntGauge,
    /// The highest `attempt_count` among them (seed 000: watch the attempt
    /// counts; infrastructure failures count here but not towards quarantine).
    pub max_attempts: IntGauge,
    pub published: IntCounter,
    /// By reason: returned, nacked, timeout, channel, encode, and
    /// [`crate::relay::LEASE_EXPIRED`].
    pub failures: IntCounterVec,
    pub returned: IntCounter,
    pub attempts: IntCounter,
    pub expired_claims: IntCounter,
    /// Rows put into quarantine by this instance.
    pub quarantined_total: IntCounter,
    pub claimed: IntCounter,
    /// Claims committed, with rows or without (an idle relay's moves on a
    /// wake-up or its poll only).
    pub claims: IntCounter,
    pub mark_lost: IntCounter,
    pub confirm_latency: Histogram,
    /// How far the claim's floor trails the database's clock, in seconds
    /// (`-1` while it is `-infinity`: claims walk from the start).
    pub claim_floor_lag: Gauge,
    /// Published rows the cleanup deleted (per committed batch).
    pub cleanup_deleted: IntCounter,
    /// Cleanup runs that failed (the next run, an interval later, retries).
    pub cleanup_failures: IntCounter,
    /// Cleanup runs that found another instance cleaning (its advisory
    /// lock taken): neither a success nor a failure of this instance.
    pub cleanup_locked_out: IntCounter,
    /// When this instance last completed a cleanup run (Unix seconds; 0:
    /// never). Set by a run that found nothing to delete too.
    pub cleanup_last_success: Gauge,
}

fn opts(name: &str, help: &str) -> Opts {
    Opts::new(name, help)
}

/// The gauges' query: pending rows, the oldest one's age in seconds,
/// quarantined rows, the table's size, pending rows that failed before and
/// their highest attempt count, how long the oldest quarantine has held
/// its order, held rows. `$1` only this tenant
/// (empty: all). Run with sequential scans off (see [`Metrics::refresh`]).
///
/// A row behind an unpublished quarantined event of its order is "held",
/// not pending (the claim takes none while an earlier event is
/// unpublished): counted apart, out of the pending count and age, which
/// would otherwise grow for as long as the quarantine lasts and keep the
/// pending-age alerts firing over it (OutboxEventsQuarantined pages for
/// it), hiding a real outage behind them. One pass over the pending rows,
/// in the order of `outbox_pending_sequence_idx` (a window over each
/// order's earlier rows). `isfinite`: an 'infinity' `occurred_at` (a row
/// the relay cannot read, soon quarantined) would make the subtraction
/// fail. Comments stay out of the text: `pg_stat_activity` shows a
/// statement's first 1,024 bytes, and the stop test finds it there.
pub const GAUGES_SQL: &str = include_str!("gauges.sql");

/// The settings of the gauges' transaction (see [`Metrics::refresh`]):
/// sequential scans off, a longer statement bound.
pub const GAUGES_SETTINGS: &str = include_str!("gauges_settings.sql");

/// The gauges' query may take at most 1/50 (2 %) of the time between two
/// refreshes ([`Metrics::refresh_periodically`]).
pub const GAUGE_PAUSE_FACTOR: u32 = 50;

/// The pause after a refresh that took `took`: `interval`, or
/// [`GAUGE_PAUSE_FACTOR`] times `took` when that is longer.
pub fn gauge_pause(interval: Duration, took: Duration) -> Duration {
    interval.max(took.saturating_mul(GAUGE_PAUSE_FACTOR))
}

impl Metrics {
    /// Build the collectors and register them in `registry`.
    pub fn new(registry: &Registry) -> Self {
        let counter = |name: &str, help: &str| {
            let c = IntCounter::with_opts(opts(name, help)).expect("valid counter");
            kit::metrics::register(registry, &c);
            c
        };
        let int_gauge = |name: &str, help: &str| {
            let g = IntGauge::with_opts(opts(name, help)).expect("valid gauge");
            kit::metrics::register(registry, &g);
            g
        };
        let oldest_pending_age = Gauge::with_opts(opts(
            "outbox_oldest_pending_age_seconds",
            "Age of the oldest unpublished, not quarantined outbox row",
        ))
        .expect("valid gauge");
        kit::metrics::register(registry, &oldest_pending_age);
        let oldest_quarantined_age = Gauge::with_opts(opts(
            "outbox_oldest_quarantined_age_seconds",
            "How long the oldest quarantined outbox row has held its order (0: none)",
        ))
        .expect("valid gauge");
        kit::metrics::register(registry, &oldest_quarantined_age);
        let failures = IntCounterVec::new(
            opts(
                "outbox_publish_failures_total",
                "Publish attempts that failed, by reason (returned, nacked, timeout, channel, encode; lease_expired: a relay died or stalled holding the event alone)",
            ),
            &["reason"],
        )
        .expect("valid counter vec");
        // Every reason's series starts at zero (present for rate() and alerts).
        for reason in crate::publish::PublishFailure::REASONS
            .into_iter()
            .chain([crate::relay::LEASE_EXPIRED])
        {
            failures.with_label_values(&[reason]);
        }
        kit::metrics::register(registry, &failures);
        let confirm_latency = Histogram::with_opts(
            HistogramOpts::new(
                "outbox_confirm_latency_seconds",
                "From a message's publish to the broker's confirm",
            )
            .buckets(vec![
                0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
            ]),
        )
        .expect("valid histogram");
        kit::metrics::register(registry, &confirm_latency);
        let claim_floor_lag = Gauge::with_opts(opts(
            "outbox_claim_floor_lag_seconds",
            "How far the claim's floor trailed the database's clock at its last refresh (-1: no floor, claims walk from the start)",
        ))
        .expect("valid gauge");
        kit::metrics::register(registry, &claim_floor_lag);
        let cleanup_last_success = Gauge::with_opts(opts(
            "outbox_cleanup_last_success_timestamp_seconds",
            "When this instance last completed a cleanup run (0: never; a run locked out by another instance does not count)",
        ))
        .expect("valid gauge");
        kit::metrics::register(registry, &cleanup_last_success);
        Self {
            pending: int_gauge(
                "outbox_pending_events",
                "Unpublished outbox rows, not quarantined nor held behind a quarantined event of their order",
            ),
            held: int_gauge(
                "outbox_held_events",
                "Unpublished rows held behind a quarantined earlier event of their order (released with it by requeue)",
            ),
            oldest_pending_age,
            oldest_quarantined_age,
            quarantined: int_gauge(
                "outbox_quarantined_events",
                "Quarantined outbox rows (their orders' later events are held back)",
            ),
            table_bytes: int_gauge(
                "outbox_table_bytes",
                "Total size of the outbox table with its indexes and TOAST",
            ),
            retrying: int_gauge(
                "outbox_retrying_events",
                "Unpublished, not quarantined rows that failed at least once",
            ),
            max_attempts: int_gauge(
                "outbox_retrying_max_attempts",
                "The highest attempt_count of an unpublished, not quarantined row",
            ),
            published: counter(
                "outbox_published_total",
                "Rows published and confirmed by the broker, then marked",
            ),
            failures,
            returned: counter(
                "outbox_returned_total",
                "Messages returned by the broker as unroutable (mandatory)",
            ),
            attempts: counter(
                "outbox_attempts_total",
                "Publish attempts (successful or not), and leases that ran out on a row held alone (a relay died or stalled on it; counted by the instance that takes it over)",
            ),
            expired_claims: counter(
                "outbox_expired_claims_total",
                "Rows whose expired lease (another instance crashed or stalled) this instance took over",
            ),
            quarantined_total: counter(
                "outbox_quarantined_total",
                "Rows this instance put into quarantine after the maximum attempts",
            ),
            claimed: counter("outbox_claimed_total", "Rows claimed"),
            claims: counter(
                "outbox_claims_total",
                "Claims committed, with rows or without (an idle relay's count moves on a wake-up or its poll only)",
            ),
            mark_lost: counter(
                "outbox_mark_lost_total",
                "Confirmed rows this instance could not mark (its lease was taken over): republished later",
            ),
            confirm_latency,
            claim_floor_lag,
            cleanup_deleted: counter(
                "outbox_cleanup_deleted_total",
                "Published rows past the retention horizon deleted by the cleanup",
            ),
            cleanup_failures: counter(
                "outbox_cleanup_failures_total",
                "Cleanup runs that failed (retried at the next interval)",
            ),
            cleanup_locked_out: counter(
                "outbox_cleanup_locked_out_total",
                "Cleanup runs skipped because another instance held the cleanup lock (it was cleaning)",
            ),
            cleanup_last_success,
        }
    }

    /// Refresh the gauges from one query over the pending rows
    /// ([`GAUGES_SQL`]).
    ///
    /// Sequential scans are off for it: the pending rows are all in the
    /// partial indexes (`published_at IS NULL`), while the table also holds
    /// every published row of the replay horizon. Right after a backlog the
    /// statistics still say "half the table is pending" and the planner
    /// scanned the whole table (70 ms on the bench's database, every
    /// `metrics_interval_ms`, per relay), growing with the retention.
    /// `only_tenant` (empty: all) scopes them like the relay's claim.
    ///
    /// The count reads every pending row, so it gets more time than the
    /// sessions' 30 s statement bound (`kit::db::SESSION_LIMITS`): under a
    /// backlog of tens of millions it would otherwise be cancelled on every
    /// refresh and the backlog gauges would freeze; the pacing of
    /// `refresh_periodically` keeps it to a small share of the database
    /// whatever it takes.
    pub async fn refresh(&self, pool: &PgPool, only_tenant: &str) -> anyhow::Result<()> {
        let mut client = pool.get().await?;
        let tx = client.transaction().await?;
        tx.batch_execute(GAUGES_SETTINGS).await?;
        let row = tx.query_one(GAUGES_SQL, &[&only_tenant]).await?;
        tx.commit().await?;
        self.pending.set(row.get(0));
        let age: f64 = row.get(1);
        self.oldest_pending_age.set(age.max(0.0));
        self.quarantined.set(row.get(2));
        self.table_bytes.set(row.get(3));
        self.retrying.set(row.get(4));
        self.max_attempts.set(i64::from(row.get::<_, i32>(5)));
        let quarantined_for: f64 = row.get(6);
        self.oldest_quarantined_age.set(quarantined_for.max(0.0));
        self.held.set(row.get(7));
        Ok(())
    }

    /// Refresh the gauges every `interval` until `shutdown`, or less often
    /// when the query is slow: the pause is at least [`GAUGE_PAUSE_FACTOR`]
    /// times the last refresh's duration. Counting the pending rows reads
    /// every one of them (73 ms for a 100,000-event backlog on the bench's
    /// machine, ten times that for a million), and a backlog is exactly
    /// when the database has no CPU to spare; the oldest-age gauge still
    /// moves with the backlog, just less often.
    pub async fn refresh_periodically(
        self,
        pool: PgPool,
        only_tenant: String,
        interval: Duration,
        shutdown: CancellationToken,
    ) {
        paced(interval, &shutdown, || async {
            if let Err(error) = self.refresh(&pool, &only_tenant).await {
                tracing::warn!(error = format!("{error:#}"), "refreshing outbox gauges");
            }
        })
        .await;
    }
}

/// Run `work` until `shutdown`, pausing after each run for
/// [`gauge_pause`]`(interval, how long the run took)`; a run in progress
/// at the shutdown is given up (a read).
async fn paced<F, Fut>(interval: Duration, shutdown: &CancellationToken, mut work: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    loop {
        let started = std::time::Instant::now();
        // A refresh blocked at a stop (a lock on the table, a database
        // partitioned away; its count runs up to 10 min) is given up: a read.
        if kit::shutdown::unless_stopped(shutdown, Duration::ZERO, work())
            .await
            .is_none()
        {
            return;
        }
        let pause = gauge_pause(interval, started.elapsed());
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(pause) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slow_gauge_query_stretches_the_pause_to_fifty_times_its_duration() {
        let interval = Duration::from_secs(5);
        // Fast queries: the configured interval.
        assert_eq!(gauge_pause(interval, Duration::from_millis(3)), interval);
        assert_eq!(gauge_pause(interval, Duration::from_millis(100)), interval);
        // A million-row count (700 ms): 35 s between refreshes.
        assert_eq!(
            gauge_pause(interval, Duration::from_millis(700)),
            Duration::from_secs(35)
        );
        assert_eq!(
            gauge_pause(Duration::ZERO, Duration::from_millis(20)),
            Duration::from_secs(1)
        );
    }

    #[tokio::test]
    async fn the_refresh_loop_waits_fifty_times_a_slow_refresh() {
        // Each run takes at least 20 ms against a 10 ms interval: the loop
        // must then wait at least 1 s. Paced by the interval instead, it
        // would run ~50 times in 1.5 s; a slow machine only makes the runs
        // longer and the pauses too.
        let runs = std::sync::atomic::AtomicUsize::new(0);
        let shutdown = CancellationToken::new();
        let work = || async {
            runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let stopped = tokio::time::timeout(
            Duration::from_millis(1500),
            paced(Duration::from_millis(10), &shutdown, work),
        )
        .await;
        assert!(stopped.is_err(), "the loop runs until shutdown");
        let runs = runs.load(std::sync::atomic::Ordering::SeqCst);
        assert!(
            (1..=2).contains(&runs),
            "{runs} runs in 1.5 s: a 20 ms run must be followed by a pause of at least 1 s"
        );
    }
}
