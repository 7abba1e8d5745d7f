//! The claim's floor: where its walk of `outbox_dispatch_idx` starts.
//!
//! A published row's entry stays in the dispatch index (partial on
//! `published_at IS NULL`) until vacuum removes it, and the claim walks the
//! index from the oldest `available_at`, so without a lower bound every claim
//! steps over every entry published since the last vacuum pass: 0.5 ms with
//! none, 5.3 ms with 60,000, 17.6 ms with 290,000 for a one-row claim
//! (bench/findings.md, session 8), and the outbox vacuums after 1 % of a table
//! that retains a week of events.
//!
//! The floor is a lower bound of every claimable row's `available_at`,
//! recomputed every `claim_floor_refresh_ms` by one walk (instead of one per
//! claim): the earliest `available_at` of the pending, non-quarantined rows
//! that are the lowest unpublished sequence of their order (the claim's own
//! per-order condition), but never later than `claim_floor_margin_ms` before
//! the database's clock. Claims add
//! `available_at >= floor` and start their index walk there; when the floor
//! moves down the idle workers are woken.
//!
//! Nothing is ever skipped for good: every pending row that could be claimed
//! is in the next computation's minimum. A row is below the current floor
//! only if it was not among them when the floor was computed: its
//! transaction (whose start is its `available_at`) had been running for
//! longer than the margin, or it was set back to pending with an old
//! `available_at` (by hand, or the bench resetting its backlog), or the
//! database's clock stepped back; or an earlier event of its order held it
//! back (in flight, in backoff or quarantined) until it was published. It
//! waits for the next refresh, which counts it and wakes the workers.
//! Backoff sets `available_at` in the future and `requeue` to `now()`.
//! Leaving held events out keeps an order stuck in backoff (up to the
//! backoff cap) or in quarantine (until an operator requeues it) from
//! pinning the floor at its held events' `available_at`.

use std::time::Duration;

use kit::{db::PgPool, CancellationToken};
use time::OffsetDateTime;
use tokio::sync::watch;
use tokio_postgres::types::{Timestamp, Type};

use crate::metrics::Metrics;

/// A claim's lower bound on `available_at` (`NegInfinity`: from the start).
pub type Floor = Timestamp<OffsetDateTime>;

/// `$1` only this tenant (empty: all), `$2` the margin in ms. The inner
/// query walks the dispatch index from its start to the first pending,
/// non-quarantined row that no earlier unpublished event of its order holds
/// back (ORDER BY ... LIMIT 1 on the index's leading column; the hold-back
/// probe is the claim's own `NOT EXISTS`, word for word: a unit test keeps
/// the two the same).
pub const FLOOR_SQL: &str = "
SELECT claim_floor,
       CASE WHEN isfinite(claim_floor) THEN EXTRACT(EPOCH FROM now() - claim_floor)::float8 END
FROM (SELECT least(
    (SELECT o.available_at FROM outbox_events o
      WHERE o.published_at IS NULL AND o.quarantined_at IS NULL
        AND ($1 = '' OR o.tenant_id = $1)
        AND (o.aggregate_sequence = 1 OR NOT EXISTS (
            SELECT 1 FROM outbox_events earlier
            WHERE earlier.aggregate_id = o.aggregate_id
              AND earlier.aggregate_type = o.aggregate_type
              AND earlier.aggregate_sequence < o.aggregate_sequence
              AND earlier.published_at IS NULL))
      ORDER BY o.available_at
      LIMIT 1),
    now() - $2::bigint * interval '1 millisecond') AS claim_floor) AS computed";

/// Compute the floor now, with how far it trails the database's clock in
/// seconds (`None` for an infinite floor): both on the database's clock, so
/// a relay host whose clock is off does not show as lag.
pub async fn compute(
    pool: &PgPool,
    only_tenant: &str,
    margin: Duration,
) -> anyhow::Result<(Floor, Option<f64>)> {
    let margin = i64::try_from(margin.as_millis()).unwrap_or(i64::MAX);
    let client = pool.get().await?;
    let row = client
        .query_typed_one(
            FLOOR_SQL,
            &[(&only_tenant, Type::TEXT), (&margin, Type::INT8)],
        )
        .await?;
    Ok((row.get(0), row.get(1)))
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

/// Recompute the floor every `interval` (or 50 times as long as the last
/// computation took, when that is longer) until `shutdown`, publishing it on
/// `sender` (and as the `outbox_claim_floor_lag_seconds` gauge), and wake
/// the idle workers (`wake`) when it moved down: a row that committed below
/// the old floor is claimed at once, not at the next poll. On an error the
/// floor falls back to `NegInfinity` (claims walk from the start, as without
/// a floor) until the next success.
#[allow(clippy::too_many_arguments)]
pub async fn refresh_periodically(
    pool: PgPool,
    only_tenant: String,
    margin: Duration,
    interval: Duration,
    sender: watch::Sender<Floor>,
    wake: std::sync::Arc<watch::Sender<u64>>,
    metrics: Metrics,
    shutdown: CancellationToken,
) {
    loop {
        let started = std::time::Instant::now();
        let computed = tokio::select! {
            _ = shutdown.cancelled() => return,
            computed = compute(&pool, &only_tenant, margin) => computed,
        };
        // Like the gauges: at most 2 % of the time on the walk itself.
        let pause = crate::metrics::gauge_pause(interval, started.elapsed());
        let (floor, lag) = match computed {
            Ok(computed) => computed,
            Err(error) => {
                tracing::warn!(
                    error = format!("{error:#}"),
                    "computing the claim floor failed: claims walk the whole dispatch index until it works"
                );
                (Timestamp::NegInfinity, None)
            }
        };
        metrics.claim_floor_lag.set(lag.unwrap_or(-1.0));
        let old = sender.send_replace(floor);
        if lowered(old, floor) {
            crate::listen::wake(&wake);
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(pause) => {}
        }
    }
}

/// The floor a claim starts from now: the last one refreshed, or
/// `-infinity` (the walk from the start: slower, never a row left behind)
/// once the refresh task has ended (at shutdown, or after a bug). A floor
/// frozen by a dead task would keep every row that falls below it waiting.
pub fn current(floor: &watch::Receiver<Floor>) -> Floor {
    if floor.has_changed().is_err() {
        return Timestamp::NegInfinity;
    }
    *floor.borrow()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_floor_whose_refresh_task_has_ended_is_minus_infinity() {
        let at = Timestamp::Value(OffsetDateTime::from_unix_timestamp(100).unwrap());
        let (tx, rx) = watch::channel(Timestamp::NegInfinity);
        tx.send(at).expect("a receiver");
        assert_eq!(current(&rx), at);
        drop(tx);
        assert_eq!(current(&rx), Timestamp::NegInfinity);
    }

    /// The floor counts exactly the rows the claim treats as next in their
    /// order: its hold-back condition is the claim's, word for word.
    #[test]
    fn the_floor_holds_back_what_the_claim_holds_back() {
        let words = |sql: &str| sql.split_whitespace().collect::<Vec<_>>().join(" ");
        let claim = words(crate::claim::CLAIM_SQL);
        let start = claim
            .find("(o.aggregate_sequence = 1 OR NOT EXISTS (")
            .expect("the claim's hold-back condition");
        let end = claim[start..]
            .find("earlier.published_at IS NULL))")
            .expect("its end")
            + start
            + "earlier.published_at IS NULL))".len();
        assert!(
            words(FLOOR_SQL).contains(&claim[start..end]),
            "{}",
            &claim[start..end]
        );
    }

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
