//! Expired idempotency keys are deleted in bounded batches (short statements,
//! no lock storms); several instances may run it at once (SKIP LOCKED).
//! After expiry a key is a new operation; `orders (tenant_id, checkout_id)`
//! still rejects a second order for the same checkout.

use std::time::Duration;

use deadpool_postgres::Pool;
use kit::CancellationToken;

use crate::{idempotency::InFlight, metrics::Metrics};

/// One batch: the expired keys from `$2` on (the last batch's latest
/// `expires_at`; none: from the start), oldest first, and the batch's count
/// and latest `expires_at`. Each batch starts its index walk where the last
/// stopped: from the start, it walked past every key the run had deleted,
/// which stay in the index while a snapshot older than their deletion is
/// open in the database, so that a batch cost grew with the run. Keys a
/// batch skipped (`SKIP LOCKED`) below it are left to the next run.
const DELETE_EXPIRED: &str = "\
WITH gone AS (
    DELETE FROM idempotency_requests
     WHERE ctid IN (SELECT ctid FROM idempotency_requests
                     WHERE expires_at >= COALESCE($2::timestamptz, '-infinity')
                       AND expires_at <= now()
                     ORDER BY expires_at
                     LIMIT $1 FOR UPDATE SKIP LOCKED)
    RETURNING expires_at)
SELECT count(*), max(expires_at) FROM gone";

/// Delete every expired key now, batch by batch, until none is left or
/// `stop` is cancelled (checked between batches: a large backlog of expired
/// keys does not hold up a shutdown); `deleted_batch` is told each batch's
/// count as it commits (a long run shows as rows deleted, not as a stall;
/// also when a later batch fails). Returns how many, and whether `stop`
/// ended the run before the end (expired keys may remain).
pub async fn delete_expired(
    pool: &Pool,
    batch: i64,
    stop: &CancellationToken,
    mut deleted_batch: impl FnMut(u64),
) -> Result<(u64, bool), crate::error::ApiError> {
    let mut total = 0;
    let mut from: Option<time::OffsetDateTime> = None;
    loop {
        if stop.is_cancelled() {
            return Ok((total, true));
        }
        let client = pool.get().await?;
        // Crash window: each batch is one autocommit DELETE of rows already
        // expired (a key past its retention is a new operation whether its
        // row is there or not); a crash before or after it leaves the rest
        // to the next run, nothing half done.
        let deleted = match async {
            let statement = client.prepare_cached(DELETE_EXPIRED).await?;
            client.query_one(&statement, &[&batch, &from]).await
        }
        .await
        {
            Ok(row) => {
                if let Some(latest) = row.get::<_, Option<time::OffsetDateTime>>(1) {
                    from = Some(latest);
                }
                u64::try_from(row.get::<_, i64>(0)).unwrap_or_default()
            }
            Err(error) => {
                if kit::db::session_fault(&error) {
                    // Closed, not pooled: the session cannot do this for
                    // its life (see `kit::db::session_fault`).
                    drop(deadpool_postgres::Object::take(client));
                }
                return Err(error.into());
            }
        };
        deleted_batch(deleted);
        total += deleted;
        if deleted < u64::try_from(batch).unwrap_or(u64::MAX) {
            return Ok((total, false));
        }
    }
}

/// The background task: cleanup every `interval`, and the in-flight gauge
/// every second. Two loops, so a long cleanup run (a backlog of expired
/// keys, batch after batch) does not freeze the gauge: a stuck owner must
/// show while the database is under that stress too.
pub async fn run(
    pool: Pool,
    metrics: Metrics,
    in_flight: InFlight,
    interval: Duration,
    batch: i64,
    shutdown: CancellationToken,
) {
    let gauge = async {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tick.tick() => {
                    let age = i64::try_from(in_flight.oldest().as_secs()).unwrap_or(i64::MAX);
                    metrics.oldest_incomplete_key_seconds.set(age);
                }
            }
        }
    };
    let cleanup = async {
        let mut tick = tokio::time::interval(interval);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tick.tick() => match delete_expired(
                    &pool,
                    batch,
                    &shutdown,
                    |deleted| metrics.expired_deleted.inc_by(deleted),
                )
                .await
                {
                    // Stopped by the shutdown: not a completed run.
                    Ok((_, true)) => {}
                    Ok((deleted, false)) => {
                        metrics.cleanup_last_success.set(kit::metrics::unix_now());
                        if deleted > 0 {
                            tracing::info!(deleted, "expired idempotency keys deleted");
                        }
                    }
                    Err(error) => {
                        metrics.cleanup_failures.inc();
                        tracing::warn!(%error, "idempotency key cleanup failed");
                    }
                },
            }
        }
    };
    tokio::join!(gauge, cleanup);
}
