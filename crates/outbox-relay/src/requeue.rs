//! `outbox-relay requeue`: release quarantined rows after a repair.
//!
//! Clears `quarantined_at`, resets `attempt_count` and `own_failure_count`
//! and makes the row due now (`last_error` is kept for the record until the
//! next attempt), then
//! notifies the relays. The order's held-back events follow in sequence.

use kit::db::PgPool;
use time::OffsetDateTime;
use uuid::Uuid;

/// Which quarantined rows to release.
#[derive(Clone, Debug)]
pub enum Target {
    Event(Uuid),
    Order(String),
    /// Every quarantined row of `tenant` (empty: of every tenant).
    All {
        tenant: String,
    },
}

/// One released row, as it was before the release.
#[derive(Clone, Debug)]
pub struct Released {
    pub event_id: Uuid,
    pub aggregate_id: String,
    pub aggregate_sequence: i64,
    pub event_type: String,
    pub attempt_count: i32,
    pub last_error: Option<String>,
    pub quarantined_at: OffsetDateTime,
}

/// Release the quarantined rows of `target`; returns them and how many
/// later events of their orders were held back behind them.
pub async fn requeue(pool: &PgPool, target: &Target) -> anyhow::Result<(Vec<Released>, i64)> {
    let (event_id, order, all) = match target {
        Target::Event(id) => (Some(*id), None, None),
        Target::Order(order) => (None, Some(order.clone()), None),
        Target::All { tenant } => (None, None, Some(tenant.clone())),
    };
    let mut client = pool.get().await?;
    let tx = client.transaction().await?;
    let rows = tx
        .query(
            "WITH target AS (
                 SELECT event_id, attempt_count, last_error, quarantined_at
                 FROM outbox_events
                 WHERE quarantined_at IS NOT NULL AND published_at IS NULL
                   AND (event_id = $1 OR aggregate_id = $2
                        OR ($3::text IS NOT NULL AND ($3 = '' OR tenant_id = $3)))
                 FOR UPDATE)
             UPDATE outbox_events o
             SET quarantined_at = NULL, attempt_count = 0, own_failure_count = 0,
                 lease_expiries = 0, available_at = now(),
                 claimed_by = NULL, claim_until = NULL
             FROM target
             WHERE o.event_id = target.event_id
             RETURNING o.event_id, o.aggregate_id, o.aggregate_sequence, o.event_type,
                       target.attempt_count, target.last_error, target.quarantined_at",
            &[&event_id, &order, &all],
        )
        .await?;
    let released: Vec<Released> = rows
        .iter()
        .map(|row| Released {
            event_id: row.get(0),
            aggregate_id: row.get(1),
            aggregate_sequence: row.get(2),
            event_type: row.get(3),
            attempt_count: row.get(4),
            last_error: row.get(5),
            quarantined_at: row.get(6),
        })
        .collect();
    let orders: Vec<String> = released.iter().map(|r| r.aggregate_id.clone()).collect();
    let held: i64 = tx
        .query_one(
            "SELECT count(*) FROM outbox_events
             WHERE aggregate_id = ANY($1) AND published_at IS NULL",
            &[&orders],
        )
        .await?
        .get(0);
    if !released.is_empty() {
        tx.execute("SELECT pg_notify('outbox_events', '')", &[])
            .await?;
    }
    // Crash window: before the commit nothing is released (run it again);
    // after it the rows are released, and only this report is lost (the
    // relays publish them; a second run finds nothing quarantined).
    kit::failpoint::crash_point("relay.requeue.before_commit");
    tx.commit().await?;
    let held = held - i64::try_from(released.len()).unwrap_or(0);
    Ok((released, held.max(0)))
}

/// Explain why nothing was released for `target`.
pub async fn describe_unreleased(pool: &PgPool, target: &Target) -> anyhow::Result<String> {
    let client = pool.get().await?;
    let rows =
        match target {
            Target::Event(id) => client
                .query(
                    "SELECT event_id, aggregate_sequence, published_at IS NOT NULL, attempt_count
                     FROM outbox_events WHERE event_id = $1",
                    &[id],
                )
                .await?,
            Target::Order(order) => client
                .query(
                    // The type too: the unique index's leading column
                    // (without it, a scan of every retained row).
                    "SELECT event_id, aggregate_sequence, published_at IS NOT NULL, attempt_count
                     FROM outbox_events WHERE aggregate_type = $2 AND aggregate_id = $1
                     ORDER BY aggregate_sequence",
                    &[order, &events::AGGREGATE_TYPE_ORDER],
                )
                .await?,
            // With relay.only_tenant set, the others' quarantined rows are
            // not looked at: said so (an alert may be about one of them).
            Target::All { tenant } if !tenant.is_empty() => {
                return Ok(format!(
                    "nothing is quarantined for tenant {tenant} (relay.only_tenant; other \
                     tenants' rows were not looked at)"
                ))
            }
            Target::All { .. } => return Ok("nothing is quarantined".to_owned()),
        };
    if rows.is_empty() {
        return Ok("no such outbox event (unknown id, or already cleaned up)".to_owned());
    }
    let published = rows.iter().filter(|r| r.get::<_, bool>(2)).count();
    Ok(format!(
        "nothing is quarantined: {} event(s) found, {} published, {} pending",
        rows.len(),
        published,
        rows.len() - published
    ))
}
