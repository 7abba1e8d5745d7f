//! Full flow across the five real binaries: order-api -> outbox -> relay ->
//! RabbitMQ -> inventory, ledger, loyalty. The seed 003 story row by row, and
//! a load of orders with payments and deliveries in which every request is
//! retried with its key and every consumer gets a full relay replay: effects
//! exactly once, zero drift.
//!
//! Each test has its own system (`system_tests::system`): its own tenant,
//! relay (scoped to that tenant, publishing to a private exchange) and
//! privately named consumers bound to that exchange; the replay is scoped
//! to the tenant too (`--tenant`). The tests run one at a time (two cores).

use std::sync::Arc;
use std::time::Duration;
use system_tests::OutputWithin;

use futures_util::{stream, StreamExt};
use reqwest::StatusCode;
use serde_json::{json, Value};
use system_tests::{
    consumers::{eventually, inbox_count, Kind},
    pg,
    system::{bind_consumer, skus, unbind_consumer, Member, OrderPlan, System, SystemOptions},
    Database,
};
use tokio::sync::Mutex;

static SERIAL: Mutex<()> = Mutex::const_new(());

/// The system of these tests: one relay, one instance of each consumer.
async fn start(prefix: &str) -> System {
    System::start(prefix, SystemOptions::default()).await
}

/// POST to order-api once; returns status, replay flag and body.
async fn post(system: &System, path: &str, key: &str, body: &Value) -> (StatusCode, bool, Vec<u8>) {
    // A 503 (the database did not answer in time: nothing stored) is retried
    // under the same key, as the API contract tells a client to.
    let mut attempts = 0;
    let response = loop {
        let response = system
            .http
            .post(system.api.url(path))
            .bearer_auth(&system.key)
            .header("Idempotency-Key", key)
            .json(body)
            .timeout(Duration::from_secs(120))
            .send()
            .await
            .expect("request");
        attempts += 1;
        if response.status() != StatusCode::SERVICE_UNAVAILABLE || attempts == 10 {
            break response;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    };
    let replayed = response
        .headers()
        .get("Idempotent-Replayed")
        .is_some_and(|v| v == "true");
    (
        response.status(),
        replayed,
        response.bytes().await.expect("body").to_vec(),
    )
}

/// A request and its retry with the same key: one execution, one replay,
/// the same bytes.
async fn post_twice(system: &System, path: &str, key: &str, body: &Value) -> Value {
    let (status, replayed, first) = post(system, path, key, body).await;
    assert_eq!(
        status,
        StatusCode::CREATED,
        "{path}: {}",
        String::from_utf8_lossy(&first)
    );
    assert!(!replayed);
    let (status, replayed, second) = post(system, path, key, body).await;
    assert_eq!(status, StatusCode::CREATED);
    assert!(replayed, "{path}: the retry must be a replay");
    assert_eq!(first, second, "{path}: the replay differs");
    serde_json::from_slice(&first).expect("json")
}

/// Wait until each consumer's inbox holds `events` of this tenant's events.
async fn wait_applied(system: &System, events: i64) {
    wait_applied_by(system.consumers.iter(), events).await;
}

/// Wait until the inbox of each of `consumers` holds `events` events.
async fn wait_applied_by(consumers: impl Iterator<Item = &Member>, events: i64) {
    for consumer in consumers {
        let db = consumer.kind.expect("consumer").database();
        let name = consumer.name.clone();
        eventually(
            &format!("{name} applies {events} events"),
            Duration::from_secs(300),
            || {
                let name = name.clone();
                async move {
                    let applied = inbox_count(db, &name).await;
                    assert!(applied <= events, "{name} applied {applied} > {events}");
                    (applied == events).then_some(())
                }
            },
        )
        .await;
    }
}

async fn drift(system: &System) {
    let report = ops::drift::check(
        &ops::drift::Databases::from_env(),
        Some(&system.tenant),
        Duration::ZERO,
    )
    .await
    .expect("drift check");
    assert!(report.is_clean(), "drift: {:#?}", report.drift);
}

/// `outbox-relay replay` of this system's tenant to `consumer` (plus `args`).
fn replay(system: &System, consumer: &Member, args: &[&str]) {
    let output = std::process::Command::new(system_tests::bin("outbox-relay"))
        .args([
            "replay",
            "--consumer",
            &consumer.name,
            "--tenant",
            &system.tenant,
        ])
        .args(args)
        .env("RUST_LOG", "warn")
        .output_within()
        .expect("replay");
    assert!(
        output.status.success(),
        "replay: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

async fn count(db: Database, sql: &str, tenant: &str) -> i64 {
    pg(db)
        .await
        .query_one(sql, &[&tenant])
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
        .get(0)
}

#[tokio::test]
async fn the_seed_003_story_produces_exactly_the_seeds_rows() {
    let _serial = SERIAL.lock().await;
    let system = start("story").await;
    system.receive("JKT-M", 48).await;
    let order = post_twice(
            &system,
            "/orders",
            "order-1042",
            &json!({"customer_id": "77", "checkout_id": "checkout-1042",
                    "lines": [{"sku": "JKT-M", "qty": 2, "unit_price": "40.00", "unit_cost": "22.00"}],
                    "shipping": "5.00", "tax": "8.00", "total": "93.00", "currency": "USD", "location": "WH-1"}),
        )
        .await;
    let id = order["order_id"].as_str().expect("id").to_owned();
    post_twice(
        &system,
        &format!("/orders/{id}/payments"),
        "payment-9001",
        &json!({"payment_id": "9001", "amount": "93.00", "method": "card"}),
    )
    .await;
    post_twice(
        &system,
        &format!("/orders/{id}/deliveries"),
        "delivery-311",
        &json!({"delivery_id": "311", "lines": [{"sku": "JKT-M", "qty": 2}]}),
    )
    .await;
    // A second order of merchandise under one whole unit (0.50 + 5.00
    // shipping): delivered, it earns 0 points, so no loyalty entry, and the
    // drift and invariant checks expect none.
    system.receive("PIN-S", 10).await;
    let small = post_twice(
            &system,
            "/orders",
            "order-1043",
            &json!({"customer_id": "78",
                    "lines": [{"sku": "PIN-S", "qty": 1, "unit_price": "0.50", "unit_cost": "0.20"}],
                    "shipping": "5.00", "tax": "0.00", "total": "5.50", "currency": "USD", "location": "WH-1"}),
        )
        .await;
    let small = small["order_id"].as_str().expect("id").to_owned();
    post_twice(
        &system,
        &format!("/orders/{small}/payments"),
        "payment-9002",
        &json!({"payment_id": "9002", "amount": "5.50", "method": "card"}),
    )
    .await;
    post_twice(
        &system,
        &format!("/orders/{small}/deliveries"),
        "delivery-312",
        &json!({"delivery_id": "312", "lines": [{"sku": "PIN-S", "qty": 1}]}),
    )
    .await;
    wait_applied(&system, 6).await;
    let order_id: uuid::Uuid = id.parse().expect("uuid");
    let t = &system.tenant;

    // Inventory: receipt, reserve 2 (on_hand stays 48, available 46), sale -2.
    let inventory = pg(Database::Inventory).await;
    let movements: Vec<(String, i64, i64, i64, Option<uuid::Uuid>)> = inventory
        .query(
            "SELECT movement_type, qty, on_hand_delta, reserved_delta, order_id FROM stock_movements \
             WHERE tenant_id = $1 AND sku = 'JKT-M' AND location = 'WH-1' ORDER BY movement_id",
            &[t],
        )
        .await
        .expect("movements")
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4)))
        .collect();
    assert_eq!(
        movements,
        vec![
            ("receipt".to_owned(), 48, 48, 0, None),
            ("reserve".to_owned(), 2, 0, 2, Some(order_id)),
            ("sale".to_owned(), -2, -2, -2, Some(order_id)),
        ]
    );
    let level = inventory
        .query_one(
            "SELECT on_hand, reserved, available FROM stock_levels WHERE tenant_id = $1 AND sku = 'JKT-M' AND location = 'WH-1'",
            &[t],
        )
        .await
        .expect("level");
    assert_eq!(
        (
            level.get::<_, i64>(0),
            level.get::<_, i64>(1),
            level.get::<_, i64>(2)
        ),
        (46, 0, 46)
    );

    // Ledger: the two journal entries of the seed, line by line.
    let lines: Vec<(String, String, i64, i64)> = pg(Database::Ledger)
        .await
        .query(
            "SELECT e.event_type, a.name, l.debit, l.credit FROM journal_entries e \
             JOIN journal_lines l USING (entry_id) \
             JOIN ledger_accounts a ON a.tenant_id = l.tenant_id AND a.code = l.account_code \
             WHERE e.tenant_id = $1 AND e.order_id = $2 ORDER BY e.posted_at, l.line_no",
            &[t, &order_id],
        )
        .await
        .expect("journal")
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect();
    let expected: Vec<(String, String, i64, i64)> = [
        ("PaymentReceived", "Card clearing", 9300, 0),
        ("PaymentReceived", "Customer deposits", 0, 9300),
        ("ParcelDelivered", "Customer deposits", 9300, 0),
        ("ParcelDelivered", "Sales", 0, 8000),
        ("ParcelDelivered", "Shipping income", 0, 500),
        ("ParcelDelivered", "Tax payable", 0, 800),
        ("ParcelDelivered", "Cost of goods sold", 4400, 0),
        ("ParcelDelivered", "Inventory", 0, 4400),
    ]
    .iter()
    .map(|(e, a, d, c)| ((*e).to_owned(), (*a).to_owned(), *d, *c))
    .collect();
    assert_eq!(lines, expected);
    let delivery_debits: i64 = lines
        .iter()
        .filter(|l| l.0 == "ParcelDelivered")
        .map(|l| l.2)
        .sum();
    let delivery_credits: i64 = lines
        .iter()
        .filter(|l| l.0 == "ParcelDelivered")
        .map(|l| l.3)
        .sum();
    assert_eq!(
        (delivery_debits, delivery_credits),
        (13700, 13700),
        "137.00 = 137.00"
    );

    // Loyalty: +80 for customer 77, pointing at the ParcelDelivered event.
    let delivered_event: uuid::Uuid = pg(Database::Orders)
        .await
        .query_one(
            "SELECT event_id FROM outbox_events WHERE aggregate_id = $1 AND event_type = 'ParcelDelivered'",
            &[&id],
        )
        .await
        .expect("event")
        .get(0);
    let entries: Vec<(String, i64, uuid::Uuid, uuid::Uuid)> = pg(Database::Loyalty)
        .await
        .query(
            "SELECT customer_id, points, order_id, event_id FROM loyalty_entries WHERE tenant_id = $1",
            &[t],
        )
        .await
        .expect("loyalty")
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect();
    assert_eq!(
        entries,
        vec![("77".to_owned(), 80, order_id, delivered_event)],
        "customer 77's 80 points, and no entry of 0 points for customer 78"
    );

    drift(&system).await;
    let report = system.assert_invariants(Duration::from_secs(120)).await;
    assert_eq!((report.orders, report.events), (2, 6));
}

#[tokio::test]
async fn many_orders_with_retries_and_a_full_replay_apply_exactly_once_with_zero_drift() {
    let _serial = SERIAL.lock().await;
    let orders: u64 = std::env::var("FULL_FLOW_ORDERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    let system = Arc::new(start("load").await);
    // This tenant's events since this system is up (`--tenant`: other
    // tests' events must not reach these consumers).
    let started = time::OffsetDateTime::now_utc() - time::Duration::seconds(1);
    for sku in &skus() {
        system.receive(sku, 1_000_000).await;
    }

    let results: Vec<(u64, u64)> = stream::iter(0..orders)
        .map(|i| {
            let system = system.clone();
            async move {
                let plan = OrderPlan::new(i);
                let order = post_twice(&system, "/orders", &plan.keys[0], &plan.order).await;
                let id = order["order_id"].as_str().expect("id").to_owned();
                post_twice(
                    &system,
                    &format!("/orders/{id}/payments"),
                    &plan.keys[1],
                    &plan.payment,
                )
                .await;
                post_twice(
                    &system,
                    &format!("/orders/{id}/deliveries"),
                    &plan.keys[2],
                    &plan.delivery,
                )
                .await;
                (plan.line_count, plan.points)
            }
        })
        .buffer_unordered(16)
        .collect()
        .await;
    let line_total: u64 = results.iter().map(|r| r.0).sum();
    let points_total: u64 = results.iter().map(|r| r.1).sum();
    let events = i64::try_from(orders * 3).expect("fits");
    wait_applied(&system, events).await;
    drift(&system).await;

    // A full replay of the range to every consumer: all duplicates.
    for consumer in &system.consumers {
        let before = consumer.metric("consumer_duplicates_total", "").await;
        let since = started
            .format(&time::format_description::well_known::Rfc3339)
            .expect("format");
        replay(&system, consumer, &["--since", &since]);
        consumer
            .wait_metric("consumer_duplicates_total", "", before + events as f64)
            .await;
    }
    wait_applied(&system, events).await;

    let t = &system.tenant;
    let n = i64::try_from(orders).expect("fits");
    let lines = i64::try_from(line_total).expect("fits");
    assert_eq!(
        count(
            Database::Orders,
            "SELECT count(*) FROM orders WHERE tenant_id = $1",
            t
        )
        .await,
        n
    );
    assert_eq!(
        count(
            Database::Orders,
            "SELECT count(*) FROM outbox_events WHERE tenant_id = $1 AND published_at IS NOT NULL",
            t
        )
        .await,
        events
    );
    assert_eq!(
        count(Database::Inventory, "SELECT count(*) FROM stock_movements WHERE tenant_id = $1 AND movement_type = 'reserve'", t).await,
        lines
    );
    assert_eq!(
        count(
            Database::Inventory,
            "SELECT count(*) FROM stock_movements WHERE tenant_id = $1 AND movement_type = 'sale'",
            t
        )
        .await,
        lines
    );
    assert_eq!(
        count(
            Database::Ledger,
            "SELECT count(*) FROM journal_entries WHERE tenant_id = $1",
            t
        )
        .await,
        2 * n
    );
    assert_eq!(
        count(
            Database::Loyalty,
            "SELECT count(*) FROM loyalty_entries WHERE tenant_id = $1",
            t
        )
        .await,
        n
    );
    assert_eq!(
        count(
            Database::Loyalty,
            "SELECT coalesce(sum(points), 0)::bigint FROM loyalty_entries WHERE tenant_id = $1",
            t
        )
        .await,
        i64::try_from(points_total).expect("fits")
    );
    drift(&system).await;
}

/// Seed 003: "adding loyalty points means writing a new listener for
/// ParcelDelivered; checkout is not touched". A listener deployed while
/// orders are under way has seen none of their earlier events: the runbook
/// (deploy/README.md, "Adding a consumer") replays the retained history to
/// it right after it joins. Here the loyalty consumer is not bound while
/// one order is placed, paid and delivered and another placed and paid;
/// then it joins, the replay runs, the second order is delivered live.
/// Both orders earn their points once, nothing is dead-lettered or parked,
/// and the books agree. (Without the replay the first order would earn
/// nothing and the second's delivery would wait at the gap, then park.)
/// The replay is scoped to the test's tenant (`--tenant`: the shared
/// database holds other tests' events), which makes it a filtered replay
/// that queues behind the live messages instead of purging first; the
/// runbook's unfiltered one also purges, which changes nothing here (no
/// live message of this order waits in the queue when it runs).
#[tokio::test]
async fn a_listener_added_later_catches_up_through_a_replay_without_dead_letters() {
    let _serial = SERIAL.lock().await;
    let system = start("late").await;
    let loyalty = system.consumer(Kind::Loyalty);
    unbind_consumer(&loyalty.name, &system.exchange).await;
    let others = || {
        system
            .consumers
            .iter()
            .filter(|c| c.kind != Some(Kind::Loyalty))
    };
    system.receive("JKT-M", 48).await;
    let place = |key: &'static str, customer: &'static str| {
        let system = &system;
        async move {
            let order = post_twice(
                system,
                "/orders",
                key,
                &json!({"customer_id": customer,
                        "lines": [{"sku": "JKT-M", "qty": 2, "unit_price": "40.00", "unit_cost": "22.00"}],
                        "shipping": "5.00", "tax": "8.00", "total": "93.00", "currency": "USD", "location": "WH-1"}),
            )
            .await;
            let id = order["order_id"].as_str().expect("id").to_owned();
            post_twice(
                system,
                &format!("/orders/{id}/payments"),
                &format!("{key}-pay"),
                &json!({"payment_id": format!("{key}-pay"), "amount": "93.00", "method": "card"}),
            )
            .await;
            id
        }
    };
    let deliver = |id: String| {
        let system = &system;
        async move {
            post_twice(
                system,
                &format!("/orders/{id}/deliveries"),
                &format!("{id}-delivery"),
                &json!({"delivery_id": format!("{id}-d"), "lines": [{"sku": "JKT-M", "qty": 2}]}),
            )
            .await;
        }
    };
    let early = place("late-1", "77").await;
    deliver(early.clone()).await;
    let pending = place("late-2", "78").await;
    wait_applied_by(others(), 5).await;
    assert_eq!(
        inbox_count(Database::Loyalty, &loyalty.name).await,
        0,
        "loyalty has not joined yet"
    );

    // The listener joins (it receives every event from now on), then the
    // runbook's replay hands it the history.
    bind_consumer(&loyalty.name, &system.exchange).await;
    replay(&system, loyalty, &[]);
    deliver(pending.clone()).await;
    wait_applied(&system, 6).await;

    let points: Vec<(String, i64, String)> = pg(Database::Loyalty)
        .await
        .query(
            "SELECT customer_id, points, order_id::text FROM loyalty_entries WHERE tenant_id = $1 \
             ORDER BY customer_id",
            &[&system.tenant],
        )
        .await
        .expect("loyalty")
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    assert_eq!(
        points,
        vec![("77".to_owned(), 80, early), ("78".to_owned(), 80, pending)]
    );
    assert_eq!(
        loyalty.metric("consumer_dead_lettered_total", "").await,
        0.0
    );
    // Only the live delivery measures the lag: the five replayed events are
    // late by design, and would hold ConsumerLagHigh up through a backfill.
    assert_eq!(
        loyalty.metric("consumer_lag_seconds_count", "").await,
        1.0,
        "lag observed for live events only"
    );
    let parked: i64 = pg(Database::Loyalty)
        .await
        .query_one(
            "SELECT count(*) FROM order_progress WHERE consumer_name = $1 AND parked_at IS NOT NULL",
            &[&loyalty.name],
        )
        .await
        .expect("parked")
        .get(0);
    assert_eq!(parked, 0);
    drift(&system).await;
}

/// `make demo` (crates/ops/src/bin/demo.rs) tells the seed 003 story through
/// the real HTTP APIs and checks the seed's numbers (stock 46, journal 93.00
/// and 137.00, 80 points): run here on a system of its own (its tenant and
/// API key), it must finish with exit 0 and print the seed's rows.
#[tokio::test]
async fn the_demo_tells_the_seed_story_and_checks_its_numbers() {
    let _serial = SERIAL.lock().await;
    let system = start("demo").await;
    let url = |kind| system.consumer(kind).base_url();
    let output = system_tests::output_within(
        tokio::process::Command::new(system_tests::bin("demo"))
            .env("ORDER_API_URL", system.api.base_url())
            .env("INVENTORY_URL", url(Kind::Inventory))
            .env("LEDGER_URL", url(Kind::Ledger))
            .env("LOYALTY_URL", url(Kind::Loyalty))
            .env("SERVICE_TOKEN", system_tests::consumers::TEST_TOKEN)
            .env("DEMO_TENANT", &system.tenant)
            .env("DEMO_API_KEY", &system.key),
    )
    .await
    .expect("run the demo");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "demo: {}\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    for line in [
        "level: on_hand 46, reserved 0, available 46",
        "    debits 93.00 = credits 93.00",
        "    debits 137.00 = credits 137.00",
        "-- loyalty: customer 77, balance 80",
        "== story complete",
    ] {
        assert!(stdout.contains(line), "no {line:?} in:\n{stdout}");
    }
    drift(&system).await;
}
