//! The failure write of a claim against the real PostgreSQL (`PG_URL_ORDERS`,
//! started by `make test`): it only touches rows still under that claim's
//! lease. A worker whose write comes after its lease ran out and another
//! worker of the same instance claimed the rows again must not release,
//! back off or count a failure against that newer claim.

use std::time::Duration;

use kit::migrations::Database;
use outbox_relay::claim::{self, Failure};
use uuid::Uuid;

#[tokio::test]
async fn a_late_failure_write_leaves_a_newer_claim_of_the_same_instance_alone() {
    let mut settings = kit::settings::DatabaseSettings::local("orders");
    if let Ok(url) = std::env::var("PG_URL_ORDERS") {
        settings.url = url;
    }
    let pool = kit::db::pool(&settings).expect("pool");
    kit::migrations::run(&pool, Database::Orders)
        .await
        .expect("migrate");
    let tenant = format!("lease-{}", &Uuid::new_v4().simple().to_string()[..12]);
    let event = Uuid::now_v7();
    let db = pool.get().await.expect("connection");
    db.execute("INSERT INTO tenants (tenant_id) VALUES ($1)", &[&tenant])
        .await
        .expect("tenant");
    db.execute(
        "INSERT INTO outbox_events (event_id, tenant_id, aggregate_type, aggregate_id, \
             aggregate_sequence, event_type, schema_version, payload) \
         VALUES ($1, $2, 'order', $3, 1, 'LeaseTest', 1, '{}')",
        &[&event, &tenant, &event.to_string()],
    )
    .await
    .expect("outbox row");
    let instance = "lease-test-instance";
    let claim = |lease_ms: u64| {
        let pool = pool.clone();
        let tenant = tenant.clone();
        async move {
            claim::claim(
                &pool,
                instance,
                Duration::from_millis(lease_ms),
                10,
                &tenant,
                tokio_postgres::types::Timestamp::NegInfinity,
            )
            .await
            .expect("claim")
        }
    };
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
        "B's lease stands, nothing counted"
    );

    // B's own failure write is recorded (and quarantines).
    let quarantined = fail_under(&second).await.expect("own write");
    assert_eq!(quarantined, vec![event]);
    assert_eq!(state().await, (None, 1, true));

    // A test's own rows, unpublished ones too (orders V13's guard lifted).
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
