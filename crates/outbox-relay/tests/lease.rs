//! The claim and the failure write against the real PostgreSQL
//! (`PG_URL_ORDERS`, started by `make test`):
//! - the failure write and the mark only touch rows still under that
//!   claim's lease. A worker whose write comes after its lease ran out and
//!   another worker of the same instance claimed the rows again must not
//!   release, back off, count a failure against or mark for that newer
//!   claim;
//! - a row whose leases keep running out unsettled is taken over in a batch
//!   at first, then alone, then counted as failing on its own, and
//!   quarantined once the count reaches `max_attempts`;
//! - a claim stops before the row whose payload would take the batch past
//!   `batch_max_bytes`, and always takes its first row.

use std::time::Duration;

use kit::db::PgPool as Pool;
use kit::migrations::Database;
use outbox_relay::claim::{self, Claimed, Failure};
use outbox_relay::settings::RelaySettings;
use uuid::Uuid;

const INSTANCE: &str = "lease-test-instance";

/// event_id, attempt_count, own_failure_count, quarantined, claimed_by,
/// lease_expiries, last_error.
type RowState = (Uuid, i32, i32, bool, Option<String>, i32, Option<String>);

/// A migrated pool and a tenant of the test's own.
async fn setup() -> (Pool, String) {
    let mut settings = kit::settings::DatabaseSettings::local("orders");
    if let Ok(url) = std::env::var("PG_URL_ORDERS") {
        settings.url = url;
    }
    let pool = kit::db::pool(&settings).expect("pool");
    kit::migrations::run(&pool, Database::Orders)
        .await
        .expect("migrate");
    let tenant = format!("lease-{}", &Uuid::new_v4().simple().to_string()[..12]);
    pool.get()
        .await
        .expect("connection")
        .execute("INSERT INTO tenants (tenant_id) VALUES ($1)", &[&tenant])
        .await
        .expect("tenant");
    (pool, tenant)
}

/// An order's first event with `payload`, in a transaction of its own (so
/// the rows' `available_at` follow the insertion order).
async fn insert(pool: &Pool, tenant: &str, payload: &str) -> Uuid {
    let event = Uuid::now_v7();
    pool.get()
        .await
        .expect("connection")
        .execute(
            "INSERT INTO outbox_events (event_id, tenant_id, aggregate_type, aggregate_id, \
                 aggregate_sequence, event_type, schema_version, payload) \
             VALUES ($1, $2, 'order', $3, 1, 'LeaseTest', 1, $4::text::jsonb)",
            &[&event, &tenant, &event.to_string(), &payload],
        )
        .await
        .expect("outbox row");
    event
}

/// A claim as an instance's first worker (the one that takes suspects).
async fn claim_with(pool: &Pool, settings: RelaySettings) -> Claimed {
    claim_as(pool, settings, true).await
}

async fn claim_as(pool: &Pool, settings: RelaySettings, first_worker: bool) -> Claimed {
    claim_by(pool, INSTANCE, settings, first_worker, Vec::new()).await
}

/// A claim by `instance`, while its process settles the batches of the
/// leases `settling` (`$9`).
async fn claim_by(
    pool: &Pool,
    instance: &str,
    settings: RelaySettings,
    first_worker: bool,
    settling: Vec<time::OffsetDateTime>,
) -> Claimed {
    claim::claim(
        pool,
        instance,
        &settings,
        tokio_postgres::types::Timestamp::NegInfinity,
        first_worker,
        &claim::SettlingLeases::new(settling),
    )
    .await
    .expect("claim")
}

fn settings(tenant: &str, lease_ms: u64) -> RelaySettings {
    RelaySettings {
        lease_ms,
        batch_size: 10,
        only_tenant: tenant.to_owned(),
        ..RelaySettings::default()
    }
}

/// The event ids claimed, sorted (`RETURNING` promises no order).
fn ids(claimed: &Claimed) -> Vec<Uuid> {
    let mut ids: Vec<Uuid> = claimed.rows.iter().map(|row| row.event_id).collect();
    ids.sort_unstable();
    ids
}

/// A test's own rows, unpublished ones too (orders V13's guard lifted).
async fn clean_up(pool: &Pool, tenant: &str) {
    let db = pool.get().await.expect("connection");
    db.batch_execute("SET outbox.allow_unpublished_delete = on")
        .await
        .expect("lift the guard");
    db.execute("DELETE FROM outbox_events WHERE tenant_id = $1", &[&tenant])
        .await
        .expect("clean up");
    db.execute("DELETE FROM tenants WHERE tenant_id = $1", &[&tenant])
        .await
        .expect("clean up the tenant");
}

#[tokio::test]
async fn a_late_failure_write_leaves_a_newer_claim_of_the_same_instance_alone() {
    let (pool, tenant) = setup().await;
    let event = insert(&pool, &tenant, "{}").await;
    let db = pool.get().await.expect("connection");
    let instance = INSTANCE;
    let claim = |lease_ms: u64| claim_with(&pool, settings(&tenant, lease_ms));
    let failure = Failure {
        event_id: event,
        error: "late".to_owned(),
        delay_ms: 60_000,
        quarantinable: true,
    };

    // Worker A's claim runs out; worker B (same instance) claims the row again.
    let first = claim(1).await;
    assert_eq!(first.rows.len(), 1);
    tokio::time::sleep(Duration::from_millis(20)).await;
    let second = claim(60_000).await;
    assert_eq!(second.rows.len(), 1, "the expired lease is claimed again");
    assert_ne!(first.lease_until, second.lease_until);

    // The failure write of a claim (max_attempts 1: it quarantines).
    let fail_under = |claimed: &claim::Claimed| {
        let lease = claimed.lease_until.expect("lease");
        claim::mark_failed(
            &pool,
            instance,
            lease,
            std::slice::from_ref(&failure),
            1,
            false,
        )
    };
    let state = || async {
        let row = db
            .query_one(
                "SELECT claimed_by, attempt_count, quarantined_at IS NOT NULL \
                 FROM outbox_events WHERE event_id = $1",
                &[&event],
            )
            .await
            .expect("state");
        (
            row.get::<_, Option<String>>(0),
            row.get::<_, i32>(1),
            row.get::<_, bool>(2),
        )
    };

    // A's late failure write finds nothing of its own.
    let quarantined = fail_under(&first).await.expect("late write");
    assert!(quarantined.is_empty());
    assert_eq!(
        state().await,
        (Some(instance.to_owned()), 0, false),
        "B's lease stands, nothing counted (a first expiry is no failure of the row's)"
    );

    // B's own failure write is recorded (and quarantines).
    let quarantined = fail_under(&second).await.expect("own write");
    assert_eq!(quarantined, vec![event]);
    assert_eq!(state().await, (None, 1, true));

    drop(db);
    clean_up(&pool, &tenant).await;
}

/// The mark has the failure write's guard: a late mark (past its lease,
/// retried while the database was unreachable) leaves a row another worker
/// of the same instance claimed again to that claim, which marks it under
/// its own lease; the published row keeps that lease, so a retried mark
/// counts exactly the rows its own lease marked.
#[tokio::test]
async fn a_late_mark_leaves_a_newer_claim_of_the_same_instance_alone() {
    let (pool, tenant) = setup().await;
    let event = insert(&pool, &tenant, "{}").await;
    let claim = |lease_ms: u64| claim_with(&pool, settings(&tenant, lease_ms));
    let first = claim(1).await;
    assert_eq!(first.rows.len(), 1);
    tokio::time::sleep(Duration::from_millis(20)).await;
    let second = claim(60_000).await;
    assert_eq!(second.rows.len(), 1, "the expired lease is claimed again");
    let (late, newer) = (
        first.lease_until.expect("lease"),
        second.lease_until.expect("lease"),
    );
    let events = [event];
    let mark = |lease, retry| claim::mark_published(&pool, INSTANCE, lease, &events, retry);
    let state = || async {
        let row = pool
            .get()
            .await
            .expect("connection")
            .query_one(
                "SELECT published_at IS NOT NULL, claim_until FROM outbox_events \
                 WHERE event_id = $1",
                &[&event],
            )
            .await
            .expect("state");
        (row.get::<_, bool>(0), row.get::<_, time::OffsetDateTime>(1))
    };

    assert_eq!(mark(late, false).await.expect("late mark"), 0);
    assert_eq!(mark(late, true).await.expect("late mark, retried"), 0);
    assert_eq!(state().await, (false, newer), "left to the newer claim");
    assert_eq!(mark(newer, false).await.expect("own mark"), 1);
    assert_eq!(state().await, (true, newer), "published under its lease");
    // A retry after a lost reply counts the row its own lease marked...
    assert_eq!(mark(newer, true).await.expect("own mark, retried"), 1);
    // ... and the late one's retry does not.
    assert_eq!(mark(late, true).await.expect("late mark, retried"), 0);

    clean_up(&pool, &tenant).await;
}

/// While a worker of this process settles a batch whose lease ran out (its
/// mark retried while the database was unreachable), the other workers'
/// claims leave that batch alone, and take everything else: rows never
/// leased, expired leases of other instances, and this instance's other
/// expired leases.
#[tokio::test]
async fn a_claim_spares_the_batches_its_process_is_settling() {
    let (pool, tenant) = setup().await;
    let claim = |instance: &'static str, lease_ms: u64, settling| {
        claim_by(&pool, instance, settings(&tenant, lease_ms), true, settling)
    };
    // A batch of another instance and two of this one, then all three
    // leases run out (set back an hour: no race with the clock); a row
    // never leased.
    let others = insert(&pool, &tenant, "{}").await;
    assert_eq!(
        ids(&claim("another-instance", 60_000, vec![]).await),
        vec![others]
    );
    let settled = insert(&pool, &tenant, "{}").await;
    assert_eq!(ids(&claim(INSTANCE, 60_000, vec![]).await), vec![settled]);
    let dropped = insert(&pool, &tenant, "{}").await;
    assert_eq!(ids(&claim(INSTANCE, 60_000, vec![]).await), vec![dropped]);
    let fresh = insert(&pool, &tenant, "{}").await;
    let leases: std::collections::HashMap<Uuid, time::OffsetDateTime> = pool
        .get()
        .await
        .expect("connection")
        .query(
            "UPDATE outbox_events SET claim_until = claim_until - interval '1 hour' \
             WHERE tenant_id = $1 AND claim_until IS NOT NULL \
             RETURNING event_id, claim_until",
            &[&tenant],
        )
        .await
        .expect("leases run out")
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect();
    assert_eq!(leases.len(), 3);

    // Settling `settled`'s lease; the other instance's lease in the list is
    // not this instance's, so not spared.
    let spared = claim(INSTANCE, 60_000, vec![leases[&settled], leases[&others]]).await;
    let mut want = vec![dropped, others, fresh];
    want.sort_unstable();
    assert_eq!(ids(&spared), want, "all but the batch being settled");
    assert_eq!(spared.taken_over, 2, "the two other expired leases");
    // Once nobody of this process settles it, it is taken over as usual.
    let taken = claim(INSTANCE, 60_000, vec![]).await;
    assert_eq!((ids(&taken), taken.taken_over), (vec![settled], 1));

    clean_up(&pool, &tenant).await;
}

/// Leases that run out with their rows unsettled (the relay holding them
/// died or stalled): at a row's first expiry it is taken over in a batch,
/// uncounted; from its second on it is claimed alone (a row never leased
/// waits behind it), and only the expiry of a lease that held it alone
/// counts as its own failure, until the claim quarantines it at
/// `max_attempts`. The rows first claimed with it are never counted.
#[tokio::test]
async fn a_row_whose_leases_keep_running_out_is_claimed_alone_then_counted_then_quarantined() {
    let (pool, tenant) = setup().await;
    let first = insert(&pool, &tenant, "{}").await;
    let second = insert(&pool, &tenant, "{}").await;
    let third = insert(&pool, &tenant, "{}").await;
    let run_out = || tokio::time::sleep(Duration::from_millis(20));
    let claim = |lease_ms| {
        claim_with(
            &pool,
            RelaySettings {
                max_attempts: 2,
                ..settings(&tenant, lease_ms)
            },
        )
    };

    // A relay claims the three and dies (its 1 ms lease runs out).
    let batch = claim(1).await;
    assert_eq!(ids(&batch), vec![first, second, third]);
    assert_eq!((batch.taken_over, batch.counted), (0, 0));
    run_out().await;
    // Their first expiry: taken over together, uncounted; and again lost.
    let again = claim(1).await;
    assert_eq!(ids(&again), vec![first, second, third]);
    assert_eq!(
        (again.taken_over, again.counted, again.quarantined.len()),
        (3, 0, 0)
    );
    let fresh = insert(&pool, &tenant, "{}").await;
    run_out().await;

    // Their second expiry: suspects. The oldest alone, nothing else (not
    // the other two, not the fresh row), uncounted: its lost lease held
    // three rows. (Only a first worker takes suspects.)
    let alone = claim(1).await;
    assert_eq!(ids(&alone), vec![first], "one suspect, nothing else");
    assert_eq!((alone.taken_over, alone.counted), (1, 0));
    run_out().await;
    // Its lease held it alone: counted (1 of 2), and it is claimed alone again.
    let counted = claim(1).await;
    assert_eq!(ids(&counted), vec![first]);
    assert_eq!(counted.counted, 1);
    assert!(counted.quarantined.is_empty());
    run_out().await;
    // Counted again: 2 of 2. The claim quarantines it instead of leasing it.
    let stopped = claim(1).await;
    assert!(stopped.rows.is_empty() && stopped.lease_until.is_none());
    assert_eq!((stopped.taken_over, stopped.counted), (1, 1));
    let lease_error = format!(
        "the lease of {INSTANCE} ran out while it held this event alone: \
         that relay died or stalled on it"
    );
    assert_eq!(stopped.quarantined, vec![(first, lease_error.clone())]);

    // Another worker skips the two suspects left and takes the fresh row
    // behind them; the first worker takes the suspects, one at a time.
    let other_worker = claim_as(
        &pool,
        RelaySettings {
            max_attempts: 2,
            ..settings(&tenant, 60_000)
        },
        false,
    )
    .await;
    assert_eq!(ids(&other_worker), vec![fresh]);
    assert_eq!(ids(&claim(60_000).await), vec![second]);
    assert_eq!(ids(&claim(60_000).await), vec![third]);
    assert!(claim(60_000).await.rows.is_empty(), "nothing else is due");

    let db = pool.get().await.expect("connection");
    let state = db
        .query(
            "SELECT event_id, attempt_count, own_failure_count, quarantined_at IS NOT NULL, \
                    claimed_by, lease_expiries, last_error \
             FROM outbox_events WHERE tenant_id = $1 ORDER BY available_at, event_id",
            &[&tenant],
        )
        .await
        .expect("state");
    let state: Vec<RowState> = state
        .iter()
        .map(|r| {
            (
                r.get(0),
                r.get(1),
                r.get(2),
                r.get(3),
                r.get(4),
                r.get(5),
                r.get(6),
            )
        })
        .collect();
    let leased = Some(INSTANCE.to_owned());
    assert_eq!(
        state,
        vec![
            (first, 2, 2, true, None, 4, Some(lease_error)),
            (second, 0, 0, false, leased.clone(), 2, None),
            (third, 0, 0, false, leased.clone(), 2, None),
            (fresh, 0, 0, false, leased, 0, None),
        ]
    );
    clean_up(&pool, &tenant).await;
}

/// A claim takes rows while the payloads before them stay under
/// `batch_max_bytes` (as stored: `pg_column_size`), and always its first.
#[tokio::test]
async fn a_claim_stops_at_its_byte_bound_and_always_takes_its_first_row() {
    let (pool, tenant) = setup().await;
    let pad = "x".repeat(1_000);
    let mut events = Vec::new();
    for _ in 0..5 {
        events.push(insert(&pool, &tenant, &format!("{{\"pad\": \"{pad}\"}}")).await);
    }
    let stored: i32 = pool
        .get()
        .await
        .expect("connection")
        .query_one(
            "SELECT max(pg_column_size(payload)) FROM outbox_events WHERE tenant_id = $1",
            &[&tenant],
        )
        .await
        .expect("size")
        .get(0);
    assert!(stored > 1_000, "{stored}");
    let bounded = |batch_max_bytes: i64| {
        claim_with(
            &pool,
            RelaySettings {
                batch_max_bytes,
                ..settings(&tenant, 600_000)
            },
        )
    };

    // Two and a half payloads: the third starts below the bound, the
    // fourth would start above it.
    let claimed = bounded(i64::from(stored) * 5 / 2).await;
    assert_eq!(ids(&claimed), events[..3]); // v7 ids: sorted as inserted
                                            // A bound below one payload still takes one row.
    let claimed = bounded(1).await;
    assert_eq!(ids(&claimed), events[3..4]);
    let claimed = bounded(i64::MAX).await;
    assert_eq!(ids(&claimed), events[4..]);
    clean_up(&pool, &tenant).await;
}
