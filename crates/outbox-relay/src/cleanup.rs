//! Deleting published rows past the replay horizon, in bounded batches.
//!
//! One instance at a time: the run holds a session-level advisory lock on a
//! dedicated connection (closing the connection, or a crash, releases it).
//! Each batch is its own short transaction deleting at most `batch_size`
//! rows (`FOR UPDATE SKIP LOCKED`, oldest `published_at` first, through
//! `outbox_published_at_idx`), so there is no long transaction and no lock
//! storm; a pause between batches leaves room for the hot path. Unpublished
//! rows (pending, in backoff, quarantined) are never deleted.

use std::time::Duration;

use kit::CancellationToken;

use crate::settings::CleanupSettings;

/// The advisory lock key of the cleanup ("outbox_c").
pub const CLEANUP_LOCK_KEY: i64 = 0x6f75_7462_6f78_5f63;

pub const DELETE_SQL: &str = "
DELETE FROM outbox_events
WHERE event_id IN (
    SELECT event_id FROM outbox_events
    WHERE published_at < now() - $1::bigint * interval '1 second'
    ORDER BY published_at
    LIMIT $2
    FOR UPDATE SKIP LOCKED)";

/// What one cleanup run did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct CleanupReport {
    /// Another instance held the lock: nothing was done.
    pub locked_out: bool,
    pub deleted: u64,
    /// Batches that deleted at least one row.
    pub batches: u64,
}

/// One cleanup run: delete every published row past the horizon, batch by
/// batch, unless another instance is cleaning up (or `shutdown`).
pub async fn run_once(
    database_url: &str,
    settings: &CleanupSettings,
    shutdown: &CancellationToken,
) -> anyhow::Result<CleanupReport> {
    let (mut client, connection) = kit::db::connect(database_url).await?;
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
        let retention = i64::try_from(settings.retention_secs).unwrap_or(i64::MAX);
        let mut report = CleanupReport::default();
        loop {
            let tx = client.transaction().await?;
            let deleted = tx
                .execute(DELETE_SQL, &[&retention, &settings.batch_size])
                .await?;
            kit::failpoint::crash_point("relay.cleanup");
            tx.commit().await?;
            if deleted > 0 {
                report.deleted += deleted;
                report.batches += 1;
                tracing::debug!(deleted, total = report.deleted, "cleanup batch");
            }
            if deleted < u64::try_from(settings.batch_size).unwrap_or(u64::MAX)
                || shutdown.is_cancelled()
            {
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

/// Run the cleanup every `interval` until `shutdown`.
pub async fn run_periodically(
    database_url: String,
    settings: CleanupSettings,
    shutdown: CancellationToken,
) {
    loop {
        match run_once(&database_url, &settings, &shutdown).await {
            Ok(report) if report.deleted > 0 => tracing::info!(
                deleted = report.deleted,
                batches = report.batches,
                retention_secs = settings.retention_secs,
                "outbox cleanup"
            ),
            Ok(_) => {}
            Err(error) => tracing::warn!(error = format!("{error:#}"), "outbox cleanup failed"),
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_millis(settings.interval_ms)) => {}
        }
    }
}
