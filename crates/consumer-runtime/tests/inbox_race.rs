//! Seed 003: the duplicate check must be atomic, "so two copies of one
//! event arriving together cannot both pass". In a running system the copies
//! of one order's event land in one single-active-consumer partition and are
//! settled one after the other; during a failover, though, the old instance
//! can still hold its transaction open while the new one receives the
//! redelivered copy. These tests race two transactions of the runtime's own
//! opening statements (`open_message`) against the real PostgreSQL
//! (`PG_URL_LOYALTY`, any consumer database has the runtime's tables): the
//! second waits for the first and, once it commits, finds the event applied.

use std::time::Duration;

use consumer_runtime::process::{open_message, Opened};
use events::RawEnvelope;
use kit::{db::PgPool, migrations::Database};
use uuid::Uuid;

async fn pool() -> PgPool {
    let mut settings = kit::settings::DatabaseSettings::local("loyalty");
    if let Ok(url) = std::env::var("PG_URL_LOYALTY") {
        settings.url = url;
    }
    settings.pool_size = 4;
    let pool = kit::db::pool(&settings).expect("pool");
    kit::migrations::run(&pool, Database::Loyalty)
        .await
        .expect("migrate");
    pool
}

fn envelope(event_id: Uuid, order: &str, sequence: i64) -> RawEnvelope {
    RawEnvelope::parse_raw(
        serde_json::json!({
            "event_id": event_id,
            "event_type": "InboxRaceTest",
            "schema_version": 1,
            "tenant_id": "inbox-race",
            "aggregate_type": "order",
            "aggregate_id": order,
            "aggregate_sequence": sequence,
            "occurred_at": "2024-05-12T10:00:00Z",
            "payload": {},
        })
        .to_string()
        .as_bytes(),
    )
    .expect("a valid envelope")
}

/// Open `first` and commit it only once `second`'s opening, started on
/// another connection, waits for it; what `second` then found.
async fn race(
    pool: &PgPool,
    first: &RawEnvelope,
    second: &RawEnvelope,
    name: &str,
) -> (Opened, Opened) {
    let mut one = pool.get().await.expect("connection");
    let mut two = pool.get().await.expect("connection");
    let two_pid: i32 = two
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .expect("pid")
        .get(0);
    let tx = one.transaction().await.expect("begin");
    let opened_first = open_message(&tx, name, first).await.expect("first opens");

    let second_copy = second.clone();
    let second_name = name.to_owned();
    let racer = tokio::spawn(async move {
        let tx = two.transaction().await.expect("begin");
        let opened = open_message(&tx, &second_name, &second_copy)
            .await
            .expect("second opens");
        tx.rollback().await.expect("rollback");
        opened
    });
    // The second opening is blocked by the first transaction (a lock wait
    // of its backend), not merely slower.
    let watcher = pool.get().await.expect("connection");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let waiting: bool = watcher
            .query_one(
                "SELECT coalesce(wait_event_type = 'Lock', false) FROM pg_stat_activity WHERE pid = $1",
                &[&two_pid],
            )
            .await
            .expect("activity")
            .get(0);
        if waiting {
            break;
        }
        assert!(
            !racer.is_finished(),
            "the second opening did not wait for the first"
        );
        assert!(std::time::Instant::now() < deadline, "never blocked");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tx.commit().await.expect("commit");
    let opened_second = tokio::time::timeout(Duration::from_secs(30), racer)
        .await
        .expect("the second opening ends once the first commits")
        .expect("racer");
    for table in ["processed_events", "order_progress"] {
        watcher
            .execute(
                &format!("DELETE FROM {table} WHERE consumer_name = $1"),
                &[&name],
            )
            .await
            .expect("clean up");
    }
    (opened_first, opened_second)
}

fn unique(prefix: &str) -> String {
    format!("{prefix}-{}", &Uuid::new_v4().simple().to_string()[..12])
}

#[tokio::test]
async fn two_copies_of_one_event_opened_together_apply_once() {
    let name = unique("inbox-race");
    let order = Uuid::now_v7().to_string();
    let event = envelope(Uuid::now_v7(), &order, 1);
    let (first, second) = race(&pool().await, &event, &event, &name).await;
    assert!(first.new && first.advanced, "first: {first:?}");
    // The inbox row is the guard: the copy is a duplicate.
    assert!(!second.new, "second: {second:?}");
    assert!(!second.advanced, "second: {second:?}");
    assert_eq!(second.last, 1, "second: {second:?}");
}

#[tokio::test]
async fn two_events_of_one_sequence_opened_together_advance_it_once() {
    // Two different event ids claiming the same place in the order (a
    // producer bug), whose progress row exists (sequence 1 applied): both
    // inbox rows are new, so only the order's progress row keeps the second
    // from applying: its opening waits for the first transaction on that
    // row, then reads it committed (sequence 2 applied) and the conditional
    // advance does nothing.
    let pool = pool().await;
    let name = unique("progress-race");
    let order = Uuid::now_v7().to_string();
    let mut client = pool.get().await.expect("connection");
    let tx = client.transaction().await.expect("begin");
    let placed = open_message(&tx, &name, &envelope(Uuid::now_v7(), &order, 1))
        .await
        .expect("sequence 1");
    assert!(placed.advanced);
    tx.commit().await.expect("commit");
    let (first, second) = race(
        &pool,
        &envelope(Uuid::now_v7(), &order, 2),
        &envelope(Uuid::now_v7(), &order, 2),
        &name,
    )
    .await;
    assert!(first.new && first.advanced, "first: {first:?}");
    assert!(second.new, "second: {second:?}");
    assert!(!second.advanced, "second: {second:?}");
    assert_eq!(second.last, 2, "second sees the first applied: {second:?}");
}
