//! Inbox cleanup: `processed_events` rows older than the replay horizon are
//! deleted in bounded batches (the per-order progress rows stay, so a stale
//! copy of a cleaned-up event is still rejected by its sequence). The same
//! task refreshes the parked-orders gauge, on a timer of its own (the
//! dead-letter gauge is `worker::watch_dead_letters`').

use std::time::Duration;

use kit::{db::PgPool, CancellationToken};

use crate::metrics::Metrics;

/// Delete inbox rows of `consumer` older than `retention_hours`, `batch` rows
/// per transaction, until none is left; `deleted` is told each committed
/// batch's count (also when a later batch fails). Returns how many were
/// deleted.
pub async fn clean_inbox(
    pool: &PgPool,
    consumer: &str,
    retention_hours: u32,
    batch: i64,
    mut deleted_batch: impl FnMut(u64),
) -> Result<u64, anyhow::Error> {
    let hours = i32::try_from(retention_hours).unwrap_or(i32::MAX);
    let mut client = pool.get().await?;
    let mut total = 0;
    // Each batch starts its index walk where the last one stopped (its
    // newest `processed_at`): from the start, it walked past every row the
    // run had deleted, which stay in the index while a snapshot older than
    // their deletion is open in the database, so that a batch cost grew
    // with the run. Rows a batch skipped (`SKIP LOCKED`) below it are left
    // to the next run.
    let mut from: Option<time::OffsetDateTime> = None;
    loop {
        let tx = client.transaction().await?;
        let row = tx
            .query_one(
                "WITH gone AS ( \
                     DELETE FROM processed_events p USING ( \
                         SELECT consumer_name, event_id FROM processed_events \
                         WHERE consumer_name = $1 \
                           AND processed_at >= COALESCE($4::timestamptz, '-infinity') \
                           AND processed_at < now() - make_interval(hours => $2) \
                         ORDER BY processed_at LIMIT $3 FOR UPDATE SKIP LOCKED) old \
                     WHERE p.consumer_name = old.consumer_name AND p.event_id = old.event_id \
                     RETURNING p.processed_at) \
                 SELECT count(*), max(processed_at) FROM gone",
                &[&consumer, &hours, &batch, &from],
            )
            .await?;
        let deleted = u64::try_from(row.get::<_, i64>(0)).unwrap_or_default();
        if let Some(newest) = row.get::<_, Option<time::OffsetDateTime>>(1) {
            from = Some(newest);
        }
        // Crash window: the batch is deleted, not committed. A crash rolls
        // it back (the earlier batches stay deleted); the next run deletes
        // it. Only rows past the horizon are ever deleted, and the progress
        // rows stay, so a stale copy is still refused by its sequence.
        kit::failpoint::crash_point("consumer.cleanup");
        tx.commit().await?;
        deleted_batch(deleted);
        total += deleted;
        if deleted < u64::try_from(batch).unwrap_or(u64::MAX) {
            return Ok(total);
        }
        // Leave room for the consumer's own transactions between batches.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Orders of `consumer` currently parked.
pub async fn parked_orders(pool: &PgPool, consumer: &str) -> Result<i64, anyhow::Error> {
    let client = pool.get().await?;
    let row = client
        .query_one(
            "SELECT count(*) FROM order_progress WHERE consumer_name = $1 AND parked_at IS NOT NULL",
            &[&consumer],
        )
        .await?;
    Ok(row.get(0))
}

pub(crate) async fn run(
    pool: PgPool,
    consumer: String,
    retention_hours: u32,
    batch: i64,
    interval: Duration,
    metrics: Metrics,
    shutdown: CancellationToken,
) {
    let cleanup = async {
        loop {
            let counted = |deleted| metrics.inbox_cleaned.inc_by(deleted);
            match clean_inbox(&pool, &consumer, retention_hours, batch, counted).await {
                Ok(deleted) => {
                    metrics
                        .inbox_cleanup_last_success
                        .set(kit::metrics::unix_now());
                    if deleted > 0 {
                        tracing::info!(deleted, retention_hours, "inbox cleaned");
                    }
                }
                Err(error) => {
                    metrics.inbox_cleanup_failures.inc();
                    tracing::warn!(error = format!("{error:#}"), "inbox cleanup failed");
                }
            }
            tokio::time::sleep(interval).await;
        }
    };
    // The gauge is refreshed on its own, more often than the cleanup runs
    // (a redrive un-parks orders from another process), also while a long
    // cleanup run (a backlog of batches) is under way.
    let tick = interval.min(Duration::from_secs(15));
    let gauge = async {
        loop {
            match parked_orders(&pool, &consumer).await {
                Ok(parked) => metrics.parked_orders.set(parked),
                Err(error) => {
                    tracing::warn!(error = format!("{error:#}"), "counting parked orders")
                }
            }
            tokio::time::sleep(tick).await;
        }
    };
    tokio::select! {
        _ = shutdown.cancelled() => {}
        () = cleanup => {}
        () = gauge => {}
    }
}
