//! The crash matrix (issue 7): for each named boundary, the real binaries
//! run as child processes, one of them with its fail point armed
//! (`FAILPOINTS`, fired once after some traffic), traffic flows (every
//! request retried with its key like a real client), the process aborts
//! exactly there (SIGABRT, not a caught panic), it is restarted without the
//! fail point, and the invariant checker (`ops::invariants`) must find all
//! six invariants holding once the system has drained.
//!
//! | boundary | fail point | test |
//! |---|---|---|
//! | order-api, before commit | `order_api.before_commit` | `order_api_crash_before_commit` |
//! | order-api, after commit, before the response | `order_api.after_commit` | `order_api_crash_after_commit_before_response` |
//! | relay, during the claim | `relay.claim` | `relay_crash_during_claim` |
//! | relay, after the claim, before publish | `relay.before_publish` | `relay_crash_after_claim_before_publish` |
//! | relay, after the broker's ack, before `published_at` | `relay.after_ack_before_mark` | `relay_crash_after_ack_before_mark` |
//! | relay, during cleanup | `relay.cleanup` | `relay_crash_during_cleanup` |
//! | consumer, inside the handler | `consumer.in_handler` | `consumer_crash_inside_the_handler` |
//! | consumer, after the handler's writes, before commit | `consumer.before_commit` | `consumer_crash_after_the_handler_before_commit` |
//! | consumer, after commit, before ack | `consumer.after_commit_before_ack` | `consumer_crash_after_commit_before_ack` |
//!
//! The tests run one at a time (their consumers share `order-events`).

use std::sync::Arc;
use std::time::Duration;
use system_tests::OutputWithin;

use system_tests::{
    pg,
    system::{aborted, System, SystemOptions},
    Database,
};
use tokio::sync::Mutex;
use uuid::Uuid;

static SERIAL: Mutex<()> = Mutex::const_new(());

/// Orders per test (3 events each).
fn orders() -> u64 {
    std::env::var("FAULTS_ORDERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(30)
}

const CRASH_TIMEOUT: Duration = Duration::from_secs(240);
const DRAIN_TIMEOUT: Duration = Duration::from_secs(300);
const READY: Duration = Duration::from_secs(90);

/// `label` crashing at `failpoint`, the relays patient
/// ([`system_tests::PATIENT_RELAY`]): no duplicate comes from a relay's
/// republish on a stalled machine, only from the crash (`label` is never a
/// relay here: a dead relay's lease of 10 minutes would hold its rows).
fn options(label: &str, failpoint: &str) -> SystemOptions {
    assert!(!label.starts_with("relay"), "see relay_crash");
    SystemOptions {
        failpoints: vec![(label.to_owned(), failpoint.to_owned())],
        relay_env: system_tests::PATIENT_RELAY
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
        ..SystemOptions::default()
    }
}

/// Relay settings of the relay crash tests: one worker (the crash covers the
/// whole claim/batch) and small batches (the fail point fires on a batch
/// with rows, while others are still pending).
fn small_batches() -> Vec<(String, String)> {
    vec![
        ("OUTBOX_RELAY__RELAY__WORKERS".to_owned(), "1".to_owned()),
        (
            "OUTBOX_RELAY__RELAY__BATCH_SIZE".to_owned(),
            "10".to_owned(),
        ),
    ]
}

/// Wait until `label` aborts by itself; assert it was the fail point's abort.
async fn wait_abort(system: &System, label: &str) {
    let status = system
        .member(label)
        .wait_exit(CRASH_TIMEOUT)
        .await
        .unwrap_or_else(|| panic!("{label}: the fail point never fired"));
    assert!(
        aborted(&status),
        "{label} must die by SIGABRT at the fail point, not {status:?}"
    );
}

/// Restart `label` without fail points and wait until it is ready.
async fn restart(system: &System, label: &str) {
    let member = system.member(label);
    member.start("");
    member.ready(READY).await;
}

/// The whole system with traffic running while `label` crashes at
/// `failpoint`: crash, restart, finish the traffic, drain, check.
async fn crash_under_traffic(prefix: &str, label: &str, failpoint: &str) -> Arc<System> {
    let system = Arc::new(System::start(prefix, options(label, failpoint)).await);
    system.stock_up().await;
    let n = orders();
    let traffic = tokio::spawn({
        let system = system.clone();
        async move { system.drive(0..n, 8).await }
    });
    wait_abort(&system, label).await;
    restart(&system, label).await;
    traffic.await.expect("traffic"); // each order flow panics on a failure
    assert_invariants(&system, n).await;
    system
}

/// All six invariants, with the expected numbers of orders and events.
async fn assert_invariants(system: &System, orders: u64) -> ops::invariants::Report {
    let report = system.assert_invariants(DRAIN_TIMEOUT).await;
    let orders = i64::try_from(orders).expect("fits");
    assert_eq!(report.orders, orders, "one order per checkout");
    assert_eq!(report.events, 3 * orders, "three events per order");
    assert_eq!(report.published, 3 * orders);
    for consumer in &report.consumers {
        assert_eq!(consumer.applied, 3 * orders, "{}", consumer.name);
    }
    report
}

async fn count(db: Database, sql: &str, tenant: &str) -> i64 {
    pg(db)
        .await
        .query_one(sql, &[&tenant])
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
        .get(0)
}

/// Rows of `tenant` claimed and not published. Asked while the only relay
/// is dead: these are its lease, whether or not the lease has run out yet
/// (`claim_until > now()` made the count depend on how fast the test got
/// here).
async fn leased(tenant: &str) -> i64 {
    count(
        Database::Orders,
        "SELECT count(*) FROM outbox_events WHERE tenant_id = $1 \
         AND published_at IS NULL AND claimed_by IS NOT NULL",
        tenant,
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn order_api_crash_before_commit() {
    let _serial = SERIAL.lock().await;
    let system = crash_under_traffic(
        "fault-api-pre",
        "order-api",
        "order_api.before_commit=20*off->1*return",
    )
    .await;
    let (retries, _) = system.client_counts();
    assert!(retries >= 1, "the crashed request was retried");
    // One key per request, each with its stored response (201): the
    // rolled-back attempt left no claimed key without a response (its
    // retry became the owner), and no other answer was stored.
    assert_eq!(
        count(
            Database::Orders,
            "SELECT count(*) FILTER (WHERE response_status = 201) FROM idempotency_requests \
             WHERE tenant_id = $1",
            &system.tenant
        )
        .await,
        i64::try_from(3 * orders()).expect("fits")
    );
    assert_eq!(
        count(
            Database::Orders,
            "SELECT count(*) FILTER (WHERE response_status IS DISTINCT FROM 201) \
             FROM idempotency_requests WHERE tenant_id = $1",
            &system.tenant
        )
        .await,
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn order_api_crash_after_commit_before_response() {
    let _serial = SERIAL.lock().await;
    let system = crash_under_traffic(
        "fault-api-post",
        "order-api",
        "order_api.after_commit=20*off->1*return",
    )
    .await;
    let (retries, replays) = system.client_counts();
    assert!(retries >= 1, "the crashed request was retried");
    assert!(
        replays >= 1,
        "the retry of the committed request is an idempotent replay"
    );
}

/// Relay crash tests: a backlog first (relay stopped), then the relay starts
/// with the fail point, crashes on its third batch, and is restarted while
/// more traffic arrives.
async fn relay_crash(prefix: &str, failpoint: &str) -> (Arc<System>, i64) {
    let system = Arc::new(
        System::start(
            prefix,
            SystemOptions {
                start_relays: false,
                relay_env: small_batches(),
                ..SystemOptions::default()
            },
        )
        .await,
    );
    system.stock_up().await;
    let n = orders();
    let first = n / 2;
    system.drive(0..first, 8).await;
    let relay = system.member("relay-0");
    relay.start(failpoint);
    let traffic = tokio::spawn({
        let system = system.clone();
        async move { system.drive(first..n, 8).await }
    });
    wait_abort(&system, "relay-0").await;
    let leased_after_crash = leased(&system.tenant).await;
    // One worker, batches of 10, a backlog of more than 30 events in at
    // least 10 orders (a claim takes one event per order): the crash came
    // on the third batch (so the third claim had rows to take).
    assert!(
        first >= 10,
        "FAULTS_ORDERS of at least 20 (two full batches of first events)"
    );
    assert_eq!(
        count(
            Database::Orders,
            "SELECT count(*) FROM outbox_events WHERE tenant_id = $1 AND published_at IS NOT NULL",
            &system.tenant,
        )
        .await,
        20,
        "two batches marked before the crash"
    );
    restart(&system, "relay-0").await;
    traffic.await.expect("traffic");
    assert_invariants(&system, n).await;
    (system, leased_after_crash)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn relay_crash_during_claim() {
    let _serial = SERIAL.lock().await;
    let (_system, leased) = relay_crash("fault-claim", "relay.claim=2*off->1*return").await;
    assert_eq!(
        leased, 0,
        "the crashed claim rolled back: no lease outlives it"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn relay_crash_after_claim_before_publish() {
    let _serial = SERIAL.lock().await;
    let (system, leased) =
        relay_crash("fault-prepub", "relay.before_publish=2*off->1*return").await;
    assert_eq!(
        leased, 10,
        "the claimed batch stays leased to the dead relay until expiry"
    );
    let relay = system.member("relay-0");
    assert!(
        relay.metric("outbox_expired_claims_total", "").await >= 10.0,
        "the restarted relay took the expired leases over"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn relay_crash_after_ack_before_mark() {
    let _serial = SERIAL.lock().await;
    let (system, leased) = relay_crash(
        "fault-ackmark",
        "relay.after_ack_before_mark=2*off->1*return",
    )
    .await;
    assert_eq!(
        leased, 10,
        "the confirmed batch is not marked published: it is published again"
    );
    // Every consumer gets both copies of those 10 events and applies one
    // (the second copy of an order's last event may still be on its way
    // when the invariants hold: wait for it).
    for consumer in &system.consumers {
        system_tests::consumers::eventually(
            &format!("{}: 10 duplicates suppressed", consumer.label),
            Duration::from_secs(60),
            || async {
                let suppressed = consumer.metric("consumer_duplicates_total", "").await
                    + consumer.metric("consumer_stale_total", "").await;
                (suppressed >= 10.0).then_some(())
            },
        )
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn relay_crash_during_cleanup() {
    let _serial = SERIAL.lock().await;
    // Published rows past the 7-day horizon, of a tenant of their own, and
    // older than any other test's (the cleanup takes the oldest published
    // rows of every tenant first: its first batch must be ten of these).
    let aged_tenant = system_tests::unique_tenant("fault-aged");
    let db = pg(Database::Orders).await;
    // Rows an aborted earlier run (of this test, or of the relay suite's
    // cleanup test, whose rows are from 2000) left would come first.
    system_tests::delete_outbox_rows(
        &db,
        "DELETE FROM outbox_events WHERE event_type = 'FaultTestAged' \
            OR published_at < timestamptz '2001-01-03 00:00Z'",
        &[],
    )
    .await;
    for i in 0..25 {
        let order = Uuid::now_v7().to_string();
        db.execute(
            "INSERT INTO outbox_events (event_id, tenant_id, aggregate_type, aggregate_id, \
               aggregate_sequence, event_type, schema_version, payload, occurred_at, published_at) \
             VALUES ($1, $2, 'order', $3, 1, 'FaultTestAged', 1, $4, \
                     timestamptz '2001-01-01 00:00Z', \
                     timestamptz '2001-01-02 00:00Z' - $5 * interval '1 second')",
            &[
                &Uuid::now_v7(),
                &aged_tenant,
                &order,
                &serde_json::json!({"order_id": order}),
                &f64::from(i),
            ],
        )
        .await
        .expect("aged row");
    }
    let aged = || {
        count(
            Database::Orders,
            "SELECT count(*) FROM outbox_events WHERE tenant_id = $1",
            &aged_tenant,
        )
    };

    let mut relay_env = small_batches();
    relay_env.extend([
        (
            "OUTBOX_RELAY__CLEANUP__ENABLED".to_owned(),
            "true".to_owned(),
        ),
        (
            "OUTBOX_RELAY__CLEANUP__BATCH_SIZE".to_owned(),
            "10".to_owned(),
        ),
        (
            "OUTBOX_RELAY__CLEANUP__INTERVAL_MS".to_owned(),
            "1000".to_owned(),
        ),
    ]);
    let system = Arc::new(
        System::start(
            "fault-cleanup",
            SystemOptions {
                start_relays: false,
                relay_env,
                ..SystemOptions::default()
            },
        )
        .await,
    );
    system.stock_up().await;
    let n = orders();
    system.drive(0..n / 2, 8).await;
    // The first cleanup batch commits, the second aborts before its commit.
    system
        .member("relay-0")
        .start("relay.cleanup=1*off->1*return");
    let traffic = tokio::spawn({
        let system = system.clone();
        async move { system.drive(n / 2..n, 8).await }
    });
    wait_abort(&system, "relay-0").await;
    assert_eq!(
        aged().await,
        15,
        "batch 1 (10 rows) committed, batch 2 rolled back by the crash"
    );
    restart(&system, "relay-0").await;
    traffic.await.expect("traffic");
    system_tests::consumers::eventually(
        "the restarted relay's cleanup finishes",
        Duration::from_secs(60),
        || async { (aged().await == 0).then_some(()) },
    )
    .await;
    // The live tenant lost nothing: every row within the horizon is there.
    assert_invariants(&system, n).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn consumer_crash_inside_the_handler() {
    let _serial = SERIAL.lock().await;
    crash_under_traffic(
        "fault-handler",
        "ledger-0",
        "consumer.in_handler=30*off->1*return",
    )
    .await;
}

/// The handler has written its effects (and the runtime its inbox row and
/// progress) in the open transaction: the crash rolls all of it back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn consumer_crash_after_the_handler_before_commit() {
    let _serial = SERIAL.lock().await;
    crash_under_traffic(
        "fault-precommit",
        "loyalty-0",
        "consumer.before_commit=30*off->1*return",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn consumer_crash_after_commit_before_ack() {
    let _serial = SERIAL.lock().await;
    let system = crash_under_traffic(
        "fault-ack",
        "inventory-0",
        "consumer.after_commit_before_ack=30*off->1*return",
    )
    .await;
    // The committed, unacknowledged messages came back and were duplicates
    // (the relays are patient: no copy of theirs). The last one may still
    // be on its way when the invariants hold: wait for it.
    let inventory = system.member("inventory-0");
    system_tests::consumers::eventually(
        "the redelivered message suppressed",
        Duration::from_secs(60),
        || async {
            let suppressed = inventory.metric("consumer_duplicates_total", "").await
                + inventory.metric("consumer_stale_total", "").await;
            (suppressed >= 1.0).then_some(())
        },
    )
    .await;
}

/// The checker itself: a clean system, then tamperings that break each
/// invariant, and each of the checker's findings within an invariant, each
/// of which it must report on its own order, by the check meant for it (a
/// checker that cannot fail proves nothing).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_checker_reports_each_broken_invariant() {
    let _serial = SERIAL.lock().await;
    let system = System::start("fault-checker", SystemOptions::default()).await;
    system.stock_up().await;
    system.drive(0..10, 4).await;
    assert_invariants(&system, 10).await;
    let t = system.tenant.clone();
    let orders = pg(Database::Orders).await;
    let ids: Vec<String> = orders
        .query(
            "SELECT order_id::text FROM orders WHERE tenant_id = $1 ORDER BY order_id",
            &[&t],
        )
        .await
        .expect("orders")
        .iter()
        .map(|r| r.get(0))
        .collect();
    let event = |order: &str, sequence: i64| {
        let orders = &orders;
        let order = order.to_owned();
        async move {
            orders
                .query_one(
                    "SELECT event_id FROM outbox_events WHERE aggregate_id = $1 AND aggregate_sequence = $2",
                    &[&order, &sequence],
                )
                .await
                .expect("event")
                .get::<_, Uuid>(0)
        }
    };
    // (1) a committed delivery whose outbox row is gone.
    system_tests::delete_outbox_rows(
        &orders,
        "DELETE FROM outbox_events WHERE aggregate_id = $1 AND aggregate_sequence = 3",
        &[&ids[0]],
    )
    .await;
    // (2) an outbox row (published) without any order.
    let orphan = Uuid::now_v7().to_string();
    orders
        .execute(
            "INSERT INTO outbox_events (event_id, tenant_id, aggregate_type, aggregate_id, \
               aggregate_sequence, event_type, schema_version, payload, published_at) \
             VALUES ($1, $2, 'order', $3, 1, 'OrderPlaced', 1, '{}', now())",
            &[&Uuid::now_v7(), &t, &orphan],
        )
        .await
        .expect("orphan");
    // (4) a second loyalty entry for order 1's delivery, under another event.
    let loyalty = pg(Database::Loyalty).await;
    loyalty
        .execute(
            "INSERT INTO loyalty_entries (tenant_id, customer_id, order_id, points, event_id, \
               event_type, reason, occurred_at) \
             SELECT tenant_id, customer_id, order_id, points, $2, event_type, reason, occurred_at \
               FROM loyalty_entries WHERE tenant_id = $1 AND order_id = $3::text::uuid",
            &[&t, &Uuid::now_v7(), &ids[1]],
        )
        .await
        .expect("double");
    // (5) order 2's delivery recorded as processed before its payment.
    let inventory = pg(Database::Inventory).await;
    let delivered = event(&ids[2], 3).await;
    inventory
        .execute(
            "UPDATE processed_events SET processed_at = processed_at - interval '1 hour' \
             WHERE consumer_name = $1 AND event_id = $2",
            &[
                &system
                    .consumer(system_tests::consumers::Kind::Inventory)
                    .name,
                &delivered,
            ],
        )
        .await
        .expect("reorder");
    // (3) order 3's delivery never applied by the loyalty consumer: its inbox
    // row and effect removed together.
    let lost = event(&ids[3], 3).await;
    loyalty
        .execute(
            "DELETE FROM loyalty_entries WHERE tenant_id = $1 AND event_id = $2",
            &[&t, &lost],
        )
        .await
        .expect("lose effect");
    loyalty
        .execute(
            "DELETE FROM processed_events WHERE consumer_name = $1 AND event_id = $2",
            &[
                &system.consumer(system_tests::consumers::Kind::Loyalty).name,
                &lost,
            ],
        )
        .await
        .expect("lose inbox");

    let inventory_name = system
        .consumer(system_tests::consumers::Kind::Inventory)
        .name
        .clone();
    // (4) order 4's placement applied by inventory without its inbox row.
    let placed4 = event(&ids[4], 1).await;
    inventory
        .execute(
            "DELETE FROM processed_events WHERE consumer_name = $1 AND event_id = $2",
            &[&inventory_name, &placed4],
        )
        .await
        .expect("drop inbox row");
    // (4) order 5's delivery in inventory's inbox without its sale.
    system_tests::repair_movements(
        &inventory,
        "DELETE FROM stock_movements WHERE tenant_id = $1 AND order_id = $2::text::uuid \
           AND movement_type = 'sale'",
        &[&t, &ids[5]],
    )
    .await;
    // (1, 2) order 6 set back to paid, its delivery and event left.
    orders
        .execute(
            "UPDATE orders SET status = 'paid' WHERE tenant_id = $1 AND order_id = $2::text::uuid",
            &[&t, &ids[6]],
        )
        .await
        .expect("status back");
    // (2) order 7's payment event replaced by a delivery at its position.
    system_tests::delete_outbox_rows(
        &orders,
        "DELETE FROM outbox_events WHERE aggregate_id = $1 AND aggregate_sequence = 2",
        &[&ids[7]],
    )
    .await;
    orders
        .execute(
            "INSERT INTO outbox_events (event_id, tenant_id, aggregate_type, aggregate_id, \
               aggregate_sequence, event_type, schema_version, payload, published_at) \
             VALUES ($1, $2, 'order', $3, 2, 'ParcelDelivered', 1, '{}', now())",
            &[&Uuid::now_v7(), &t, &ids[7]],
        )
        .await
        .expect("wrong type");
    // (5) order 8's reservation rewritten after its sale (a newer movement id).
    let renumbered = system_tests::repair_movements(
        &inventory,
        "UPDATE stock_movements SET movement_id = DEFAULT \
         WHERE tenant_id = $1 AND order_id = $2::text::uuid AND movement_type = 'reserve'",
        &[&t, &ids[8]],
    )
    .await;
    assert!(renumbered > 0);
    // (4) order 9's reservation booked twice for its event (at another
    // location: one per event, sku and location is all the schema stops).
    inventory
        .batch_execute(&format!(
            "INSERT INTO stock_levels (tenant_id, sku, location) \
               SELECT tenant_id, sku, 'elsewhere' FROM stock_movements \
                WHERE tenant_id = '{t}' AND order_id = '{o}' AND movement_type = 'reserve' \
             ON CONFLICT DO NOTHING; \
             INSERT INTO stock_movements (tenant_id, sku, location, movement_type, qty, \
                on_hand_delta, reserved_delta, shortage, order_id, event_id) \
               SELECT tenant_id, sku, 'elsewhere', movement_type, qty, on_hand_delta, \
                      reserved_delta, shortage, order_id, event_id FROM stock_movements \
                WHERE tenant_id = '{t}' AND order_id = '{o}' AND movement_type = 'reserve' \
                ORDER BY movement_id LIMIT 1;",
            o = ids[9]
        ))
        .await
        .expect("double");
    // (2) inventory's progress row for an order with no event at all.
    let stray = Uuid::now_v7().to_string();
    inventory
        .execute(
            "INSERT INTO order_progress (consumer_name, aggregate_id, tenant_id, last_sequence) \
             VALUES ($1, $2, $3, 1)",
            &[&inventory_name, &stray, &t],
        )
        .await
        .expect("stray progress");

    let report = system.check(Duration::ZERO).await;
    println!("{}", report.render());
    for n in 1..=5 {
        assert!(
            report.count(n) > 0,
            "invariant {n} not reported:\n{}",
            report.render()
        );
    }
    assert!(report.drift_findings() > 0, "drift not reported");
    // (6) order 9's doubled reservation, at a stock level of its own whose
    // row says nothing is reserved: its stock-level comparison, on its own.
    assert!(
        report.drift.drift.iter().any(|d| d.order_id.is_none()
            && d.what.starts_with("stock level ")
            && d.what
                .contains("@elsewhere: on_hand 0 reserved 0, movements say 0 / ")),
        "(6) the stock level that differs from its movements:\n{}",
        report.render()
    );
    assert!(report.lost() > 0 && report.double_effects() > 0 && report.ordering_violations() > 0);
    // Each mutation found by the check meant for it, on its order (another
    // check firing on the same order must not stand in for it).
    let reported = |invariant: u8, consumer: Option<&str>, order: &str, what: &str| {
        report.violations.iter().any(|v| {
            v.invariant == invariant
                && consumer.is_none_or(|c| v.consumer.as_deref() == Some(c))
                && v.order.as_deref() == Some(order)
                && v.what.contains(what)
        })
    };
    let loyalty_name = system
        .consumer(system_tests::consumers::Kind::Loyalty)
        .name
        .clone();
    let (inventory_name, loyalty_name) =
        (Some(inventory_name.as_str()), Some(loyalty_name.as_str()));
    for (invariant, consumer, order, what) in [
        (
            1,
            None,
            ids[0].as_str(),
            "outbox sequences [1, 2], expected [1, 2, 3]",
        ),
        (2, None, orphan.as_str(), "without a committed order"),
        (
            4,
            loyalty_name,
            ids[1].as_str(),
            "which is not in the outbox",
        ),
        (
            4,
            inventory_name,
            ids[4].as_str(),
            "(without its inbox row)",
        ),
        (
            4,
            inventory_name,
            ids[5].as_str(),
            "(missing although the inbox records the event)",
        ),
        (
            1,
            None,
            ids[6].as_str(),
            "with 1 payment(s) and 1 deliver(ies)",
        ),
        (
            1,
            None,
            ids[6].as_str(),
            "status paid but last_event_sequence 3",
        ),
        (
            2,
            None,
            ids[6].as_str(),
            "beyond the order's last sequence 3 / status paid",
        ),
        (
            2,
            None,
            ids[7].as_str(),
            "is ParcelDelivered at sequence 2, expected PaymentReceived",
        ),
        (
            5,
            inventory_name,
            ids[8].as_str(),
            "sale (sequence 3) written before reserve (sequence 1)",
        ),
        (4, inventory_name, ids[9].as_str(), "(doubled)"),
        (
            2,
            inventory_name,
            stray.as_str(),
            "progress for an order without outbox events",
        ),
    ] {
        assert!(
            reported(invariant, consumer, order, what),
            "({invariant}) {what:?} on {order}:\n{}",
            report.render()
        );
    }
    assert!(
        reported(5, inventory_name, &ids[2], "processed out of order"),
        "(5) the reordered delivery:\n{}",
        report.render()
    );
    assert!(
        report.violations.iter().any(|v| v.invariant == 3
            && v.consumer.as_deref() == loyalty_name
            && v.order.as_deref() == Some(ids[3].as_str())),
        "(3) the lost delivery:\n{}",
        report.render()
    );
    assert!(!report.is_clean());
    // The command says so too, with exit status 1.
    let scope = system.scope();
    let mut args = vec!["--tenant".to_owned(), t.clone()];
    for c in &scope.consumers {
        args.push("--consumer".to_owned());
        args.push(format!("{}={}", c.kind.default_name(), c.name));
    }
    let output = std::process::Command::new(system_tests::bin("check-invariants"))
        .args(&args)
        .output_within()
        .expect("check-invariants");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(1), "{stdout}");
    assert!(stdout.contains("INVARIANTS VIOLATED"), "{stdout}");
    // A metrics endpoint that answers 404 (a wrong path) is no measured 0.
    let output = std::process::Command::new(system_tests::bin("check-invariants"))
        .args(&args)
        .args(["--relay-metrics", &system.api.url("/metric")])
        .output_within()
        .expect("check-invariants");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let published = stdout
        .lines()
        .find(|line| line.contains("duplicates published"))
        .unwrap_or_default();
    assert!(published.ends_with(": n/a"), "{stdout}");
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("no metrics read"),
        "{output:?}"
    );
    // A consumer's metrics for a consumer not checked: refused.
    let output = std::process::Command::new(system_tests::bin("check-invariants"))
        .args(&args)
        .args(["--consumer-metrics", "nobody=http://127.0.0.1:1/metrics"])
        .output_within()
        .expect("check-invariants");
    assert_eq!(output.status.code(), Some(2), "{output:?}");
    // A tenant with nothing (a misspelt name) checks nothing: not a pass.
    args[1] = format!("{t}-misspelt");
    let output = std::process::Command::new(system_tests::bin("check-invariants"))
        .args(&args)
        .output_within()
        .expect("check-invariants");
    assert_eq!(
        output.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
}
