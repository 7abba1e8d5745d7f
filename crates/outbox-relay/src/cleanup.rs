//! Deleting published rows past the retention horizon (the later of the
//! replay and audit horizons: [`CleanupSettings::horizon_secs`]), in
//! bounded batches.
//!
//! One instance at a time: the run holds a session-level advisory lock on a
//! dedicated connection (closing the connection, or a crash, releases it;
//! `application_name` [`application_name`]). Each batch is its own short
//! transaction deleting at most `batch_size` rows (`FOR UPDATE SKIP
//! LOCKED`, oldest `published_at` first, through `outbox_published_at_idx`),
//! so there is no long transaction and no lock storm; a pause between
//! batches leaves room for the hot path. Unpublished rows (pending, in
//! backoff, quarantined) are never deleted.
//!
//! Monitoring ([`run_periodically`]): `outbox_cleanup_deleted_total` rises
//! with every committed batch; `outbox_cleanup_last_success_timestamp_seconds`
//! is set by every completed run, one that found nothing to delete
//! included; a run that fails counts in `outbox_cleanup_failures_total`. A
//! run locked out by another instance's lock is neither: that instance is
//! cleaning (`outbox_cleanup_locked_out_total`), and the alert
//! OutboxCleanupStalled looks at the latest success of any instance.

use std::time::Duration;

use kit::CancellationToken;

use crate::metrics::Metrics;
use crate::settings::CleanupSettings;

/// The advisory lock key of the cleanup ("outbox_c").
pub const CLEANUP_LOCK_KEY: i64 = 0x6f75_7462_6f78_5f63;

/// One batch: the oldest published rows past the horizon, from `$3` on
/// (the last batch's newest `published_at`; none: from the start), and the
/// batch's count and newest `published_at`. Each batch starts its index
/// walk where the last one stopped: from the start, it walked past every
/// row the run had deleted, which stay in the index while a snapshot older
/// than their deletion is open anywhere in the database (a long report, a
/// drift check), so that a batch cost grew with the run (quadratic; a run
/// outgrew its interval, then its statement timeout). Rows a batch skipped
/// (`SKIP LOCKED`) below the cursor are left to the next run.
pub const DELETE_SQL: &str = "
WITH gone AS (
    DELETE FROM outbox_events
    WHERE event_id IN (
        SELECT event_id FROM outbox_events
        WHERE published_at >= COALESCE($3::timestamptz, '-infinity')
          AND published_at < now() - $1::bigint * interval '1 second'
        ORDER BY published_at
        LIMIT $2
        FOR UPDATE SKIP LOCKED)
    RETURNING published_at)
SELECT count(*), max(published_at) FROM gone";

/// The `application_name` of the cleanup connection of `instance` (in
/// `pg_stat_activity`).
pub fn application_name(instance: &str) -> String {
    format!("outbox-relay cleanup {instance}")
}

/// What one cleanup run did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct CleanupReport {
    /// Another instance held the lock: nothing was done.
    pub locked_out: bool,
    /// A shutdown ended the run after a full batch: rows past the horizon
    /// may remain.
    pub stopped_early: bool,
    pub deleted: u64,
    /// Batches that deleted at least one row.
    pub batches: u64,
}

/// One cleanup run: delete every published row past the horizon, batch by
/// batch, unless another instance is cleaning up (or `shutdown`).
/// `deleted` is told each committed batch's count.
pub async fn run_once(
    database_url: &str,
    application_name: &str,
    settings: &CleanupSettings,
    shutdown: &CancellationToken,
    mut deleted: impl FnMut(u64),
) -> anyhow::Result<CleanupReport> {
    let mut config: tokio_postgres::Config = database_url.parse()?;
    config.application_name(application_name);
    // A batch waiting on a lock (a migration's DDL in a rolling deploy) is
    // ended at 30 s, not waited for: the run fails and the next interval
    // tries again. (A shutdown gives the run up at once: `run_periodically`.)
    kit::db::bound_session(&mut config);
    kit::db::bound_network_waits(&mut config);
    let (mut client, connection) = kit::db::connect_with(&config).await?;
    let driver = tokio::spawn(connection);
    let result = async {
        let locked: bool = client
            .query_one("SELECT pg_try_advisory_lock($1)", &[&CLEANUP_LOCK_KEY])
            .await?
            .get(0);
        if !locked {
            return Ok(CleanupReport {
                locked_out: true,
                ..CleanupReport::default()
            });
        }
        // Validated (at most a century): no overflow here, nor in the SQL interval.
        let horizon = i64::try_from(settings.horizon_secs()).unwrap_or(i64::MAX);
        let mut report = CleanupReport::default();
        let mut from: Option<time::OffsetDateTime> = None;
        loop {
            let tx = client.transaction().await?;
            let row = tx
                .query_one(DELETE_SQL, &[&horizon, &settings.batch_size, &from])
                .await?;
            let count = u64::try_from(row.get::<_, i64>(0)).unwrap_or_default();
            if let Some(newest) = row.get::<_, Option<time::OffsetDateTime>>(1) {
                from = Some(newest);
            }
            kit::failpoint::crash_point("relay.cleanup");
            tx.commit().await?;
            if count > 0 {
                deleted(count);
                report.deleted += count;
                report.batches += 1;
                tracing::debug!(deleted = count, total = report.deleted, "cleanup batch");
            }
            if count < u64::try_from(settings.batch_size).unwrap_or(u64::MAX) {
                break;
            }
            if shutdown.is_cancelled() {
                report.stopped_early = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(settings.batch_pause_ms)).await;
        }
        client
            .execute("SELECT pg_advisory_unlock($1)", &[&CLEANUP_LOCK_KEY])
            .await?;
        Ok(report)
    }
    .await;
    drop(client);
    let _ = driver.await;
    result
}

/// Run the cleanup every `interval` until `shutdown`, recording each run in
/// the cleanup metrics (see the module documentation).
pub async fn run_periodically(
    database_url: String,
    instance: String,
    settings: CleanupSettings,
    metrics: Metrics,
    shutdown: CancellationToken,
) {
    let name = application_name(&instance);
    loop {
        let counted = |count| metrics.cleanup_deleted.inc_by(count);
        // A run blocked at a stop (a lock, a database partitioned away) is
        // given up: its batch in flight rolls back with the dropped session.
        let run = run_once(&database_url, &name, &settings, &shutdown, counted);
        let Some(run) = kit::shutdown::unless_stopped(&shutdown, Duration::ZERO, run).await else {
            return;
        };
        match run {
            Ok(report) if report.locked_out => {
                metrics.cleanup_locked_out.inc();
                tracing::debug!("another instance is cleaning up");
            }
            Ok(report) => {
                metrics.cleanup_last_success.set(kit::metrics::unix_now());
                if report.deleted > 0 {
                    tracing::info!(
                        deleted = report.deleted,
                        batches = report.batches,
                        horizon_secs = settings.horizon_secs(),
                        "outbox cleanup"
                    );
                }
            }
            Err(error) => {
                metrics.cleanup_failures.inc();
                tracing::warn!(error = format!("{error:#}"), "outbox cleanup failed");
            }
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_millis(settings.interval_ms)) => {}
        }
    }
}
