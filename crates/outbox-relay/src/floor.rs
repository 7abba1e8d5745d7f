//! The claim's floor: where its walk of `outbox_dispatch_idx` starts.
//!
//! A published row's entry stays in the dispatch index (partial on
//! `published_at IS NULL`) until vacuum removes it, and the claim walks the
//! index from the oldest `available_at`, so without a lower bound every claim
//! steps over every entry published since the last vacuum pass: 0.5 ms with
//! none, 5.3 ms with 60,000, 17.6 ms with 290,000 for a one-row claim
//! (BENCHMARKS.md, session 8), and the outbox vacuums after 1 % of a table
//! that retains a week of events.
//!
//! The floor is a lower bound of every claimable row's `available_at`,
//! recomputed every `claim_floor_refresh_ms` by one walk (instead of one per
//! claim): the earliest `available_at` of the pending, non-quarantined rows,
//! but never later than `claim_floor_margin_ms` before the database's clock.
//! Claims add `available_at >= floor` and start their index walk there; when
//! the floor moves down the idle workers are woken.
//!
//! Nothing is ever skipped for good: every pending row is in the next
//! computation's minimum. A row can only be below the current floor if it
//! was not visible when the floor was computed, i.e. its transaction (whose
//! start is its `available_at`) had been running for longer than the margin;
//! it waits for the next refresh. Backoff sets `available_at` in the future
//! and `requeue` to `now()`, both above any floor. A quarantined row's held
//! successors are pending and not quarantined: while an order is held they
//! keep the floor at their `available_at` (the walk is then as long as it was
//! before the floor).

use std::time::Duration;

use kit::{db::PgPool, CancellationToken};
use time::OffsetDateTime;
use tokio::sync::watch;
use tokio_postgres::types::{Timestamp, Type};

/// A claim's lower bound on `available_at` (`NegInfinity`: from the start).
pub type Floor = Timestamp<OffsetDateTime>;

/// `$1` only this tenant (empty: all), `$2` the margin in ms. The inner
/// query walks the dispatch index from its start to the first pending,
/// non-quarantined row (ORDER BY ... LIMIT 1 on the index's leading column).
pub const FLOOR_SQL: &str = "
SELECT least(
    (SELECT available_at FROM outbox_events
      WHERE published_at IS NULL AND quarantined_at IS NULL
        AND ($1 = '' OR tenant_id = $1)
      ORDER BY available_at
      LIMIT 1),
    now() - $2::bigint * interval '1 millisecond')";

/// Compute the floor now.
pub async fn compute(pool: &PgPool, only_tenant: &str, margin: Duration) -> anyhow::Result<Floor> {
    let margin = i64::try_from(margin.as_millis()).unwrap_or(i64::MAX);
    let client = pool.get().await?;
    let row = client
        .query_typed_one(
            FLOOR_SQL,
            &[(&only_tenant, Type::TEXT), (&margin, Type::INT8)],
        )
        .await?;
    Ok(row.get(0))
}

/// Whether claims with floor `new` can see rows that claims with `old` could
/// not (then idle workers are woken to claim them now).
fn lowered(old: Floor, new: Floor) -> bool {
    match (old, new) {
        (_, Timestamp::NegInfinity) => !matches!(old, Timestamp::NegInfinity),
        (Timestamp::Value(old), Timestamp::Value(new)) => new < old,
        (Timestamp::PosInfinity, Timestamp::Value(_)) => true,
        _ => false,
    }
}

/// Recompute the floor every `interval` until `shutdown`, publishing it on
/// `sender`, and wake the idle workers (`wake`) when it moved down: a row
/// that committed below the old floor is claimed at once, not at the next
/// poll. On an error the floor falls back to `NegInfinity` (claims walk
/// from the start, as without a floor) until the next success.
pub async fn refresh_periodically(
    pool: PgPool,
    only_tenant: String,
    margin: Duration,
    interval: Duration,
    sender: watch::Sender<Floor>,
    wake: std::sync::Arc<watch::Sender<u64>>,
    shutdown: CancellationToken,
) {
    loop {
        let floor = match compute(&pool, &only_tenant, margin).await {
            Ok(floor) => floor,
            Err(error) => {
                tracing::debug!(error = format!("{error:#}"), "computing the claim floor");
                Timestamp::NegInfinity
            }
        };
        let old = sender.send_replace(floor);
        if lowered(old, floor) {
            crate::listen::wake(&wake);
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(interval) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_lower_floor_wakes_the_workers() {
        let at = |s: i64| Timestamp::Value(OffsetDateTime::from_unix_timestamp(s).unwrap());
        assert!(lowered(at(100), at(99)));
        assert!(lowered(at(100), Timestamp::NegInfinity));
        assert!(!lowered(at(100), at(100)));
        assert!(!lowered(at(100), at(101)));
        assert!(!lowered(Timestamp::NegInfinity, at(5)));
        assert!(!lowered(Timestamp::NegInfinity, Timestamp::NegInfinity));
    }
}
