//! Soak, backlog and poison (issue 7), through the real binaries and the
//! invariant checker.
//!
//! - `soak_with_kill_9_broker_and_database_restarts`: orders with payments
//!   and deliveries under load, 2 relays and 2 instances of each consumer,
//!   while a chaos driver SIGKILLs a random service every few seconds and
//!   restarts it, plus one PostgreSQL immediate-mode restart (crash
//!   recovery) and one RabbitMQ restart. Then drain and check: 0 lost,
//!   0 double effects, order kept, 0 drift. Short by default (`make test`);
//!   `make soak` runs it long (`SOAK_LONG=1`, see [`Soak::from_env`]).
//! - `backlog_drains_in_order_and_the_oldest_pending_age_falls_back`.
//! - `poison_is_held_with_its_order_and_released_in_order`: an unroutable
//!   event (quarantined, its order held) and a message that always fails in
//!   one consumer (dead-lettered, order parked), then `outbox-relay
//!   requeue` and `<consumer> redrive`.
//!
//! The tests of this file run one at a time.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use system_tests::{
    consumers::eventually,
    pg,
    system::{bind_consumer, mix, unbind_consumer, System, SystemOptions},
    Database,
};
use tokio::sync::Mutex;

static SERIAL: Mutex<()> = Mutex::const_new(());

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The soak's knobs. `SOAK_LONG=1` switches the defaults to the long run.
#[derive(Debug, Clone)]
struct Soak {
    orders: u64,
    /// Keep the chaos going at least this long (also after the traffic).
    min_seconds: u64,
    kill_interval_ms: u64,
    concurrency: usize,
    infra_restarts: bool,
}

impl Soak {
    fn from_env() -> Soak {
        let long = std::env::var("SOAK_LONG").is_ok_and(|v| v == "1");
        Soak {
            orders: env_u64("SOAK_ORDERS", if long { 5_000 } else { 2_000 }),
            min_seconds: env_u64("SOAK_SECONDS", if long { 0 } else { 40 }),
            kill_interval_ms: env_u64("SOAK_KILL_INTERVAL_MS", if long { 2_000 } else { 1_500 }),
            concurrency: usize::try_from(env_u64("SOAK_CONCURRENCY", 16)).unwrap_or(16),
            infra_restarts: env_u64("SOAK_INFRA_RESTARTS", 1) == 1,
        }
    }
}

/// `scripts/infra-restart.sh <args>`.
async fn infra_restart(args: &[&str]) -> String {
    system_tests::wait_for_quiet_machine("soak").await;
    system_tests::infra_script(args).await
}

/// Kill -9 a member every `interval` (each round of kills goes through
/// every member once, in a random order) and restart it a moment later,
/// until the traffic is done and `min_seconds` have passed. Kills per member.
async fn chaos(
    system: Arc<System>,
    soak: Soak,
    traffic_done: Arc<AtomicBool>,
) -> BTreeMap<String, u64> {
    let started = Instant::now();
    let seed = u64::from(std::process::id());
    let mut kills: BTreeMap<String, u64> = BTreeMap::new();
    let mut order: Vec<usize> = Vec::new();
    let mut round = 0u64;
    while !(traffic_done.load(Ordering::Relaxed)
        && started.elapsed() >= Duration::from_secs(soak.min_seconds))
    {
        tokio::time::sleep(Duration::from_millis(soak.kill_interval_ms)).await;
        round += 1;
        let members = system.members();
        if order.is_empty() {
            order = (0..members.len()).collect();
            order.sort_by_key(|i| mix(seed ^ (round << 8) ^ *i as u64));
        }
        let victim = members[order.pop().expect("a member")];
        victim
            .sample(if victim.label.starts_with("relay") {
                system_tests::system::RELAY_COUNTERS
            } else {
                system_tests::system::CONSUMER_COUNTERS
            })
            .await;
        victim.kill();
        *kills.entry(victim.label.clone()).or_default() += 1;
        tokio::time::sleep(Duration::from_millis(300 + mix(seed ^ round) % 1_200)).await;
        victim.start("");
        system.sample_all().await;
    }
    kills
}

/// One PostgreSQL immediate-mode restart (crash recovery) at a third of the
/// traffic and one RabbitMQ restart at half of it (the slower one: the
/// traffic goes on while the broker is down).
async fn infrastructure(
    soak: Soak,
    progress: Arc<std::sync::atomic::AtomicU64>,
    traffic_done: Arc<AtomicBool>,
) -> Vec<String> {
    let started = Instant::now();
    let mut events = Vec::new();
    if !soak.infra_restarts {
        return events;
    }
    for (sixths, args) in [(2, ["pg", "immediate"]), (3, ["rabbitmq", "app"])] {
        while progress.load(Ordering::Relaxed) * 6 < soak.orders * sixths
            && !traffic_done.load(Ordering::Relaxed)
        {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let done = progress.load(Ordering::Relaxed);
        let out = infra_restart(&args).await;
        events.push(format!(
            "{out} at {:?} (after {done} orders)",
            started.elapsed()
        ));
    }
    events
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn soak_with_kill_9_broker_and_database_restarts() {
    let _serial = SERIAL.lock().await;
    let soak = Soak::from_env();
    println!("soak: {soak:?}");
    let started = Instant::now();
    let system = Arc::new(
        System::start(
            "soak",
            SystemOptions {
                relays: 2,
                consumer_instances: 2,
                ..SystemOptions::default()
            },
        )
        .await,
    );
    system.stock_up().await;

    let progress = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let traffic_done = Arc::new(AtomicBool::new(false));
    let chaos = tokio::spawn(chaos(system.clone(), soak.clone(), traffic_done.clone()));
    let infrastructure = tokio::spawn(infrastructure(
        soak.clone(),
        progress.clone(),
        traffic_done.clone(),
    ));
    // Traffic in slices, so the chaos knows how far it got.
    let slice = 50;
    let mut line_total = 0;
    let mut points_total = 0;
    let mut start = 0;
    while start < soak.orders {
        let end = (start + slice).min(soak.orders);
        let traffic = system.drive(start..end, soak.concurrency).await;
        line_total += traffic.line_total;
        points_total += traffic.points_total;
        start = end;
        progress.store(end, Ordering::Relaxed);
    }
    traffic_done.store(true, Ordering::Relaxed);
    let traffic_seconds = started.elapsed().as_secs();
    let infra = infrastructure.await.expect("infrastructure restarts");
    let kills = chaos.await.expect("chaos");

    // Everything back up (the chaos restarts what it kills; make sure).
    for member in system.members() {
        if !member.running() {
            member.start("");
        }
        member.ready(Duration::from_secs(120)).await;
    }
    let report = system.check(Duration::from_secs(900)).await;
    let (retries, replays) = system.client_counts();
    let suppressed: u64 = report
        .consumers
        .iter()
        .filter_map(|c| c.duplicates_suppressed)
        .sum();
    let summary = format!(
        "soak report ({} orders, {} s of traffic, {} s in all)\n\
         kills (SIGKILL + restart): {} ({kills:?})\n\
         infrastructure: {infra:?}\n\
         client: {retries} requests retried, {replays} idempotent replays\n\
         events: {}\n\
         duplicates published (as the relays counted): {}\n\
         duplicates suppressed (all consumers, at least): {suppressed}\n\
         lost: {}\n\
         double effects: {}\n\
         ordering violations: {}\n\
         drift: {}\n\n{}",
        soak.orders,
        traffic_seconds,
        started.elapsed().as_secs(),
        kills.values().sum::<u64>(),
        report.events,
        report.duplicates_published.unwrap_or_default(),
        report.lost(),
        report.double_effects(),
        report.ordering_violations(),
        report.drift_findings(),
        report.render()
    );
    println!("{summary}");
    let target = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target");
    let _ = std::fs::write(target.join("soak-report.txt"), &summary);

    assert!(report.is_clean(), "{summary}");
    let orders = i64::try_from(soak.orders).expect("fits");
    assert_eq!(report.orders, orders);
    assert_eq!(report.events, 3 * orders);
    // Every event published (lost() == 0 is already part of is_clean()).
    assert_eq!(report.published, 3 * orders);
    assert!(
        kills.len() == system.members().len(),
        "the chaos killed every service at least once: {kills:?}"
    );
    // The effects, summed: one sale per line, the loyalty points of every order.
    let t = system.tenant.clone();
    let sales: i64 = pg(Database::Inventory)
        .await
        .query_one(
            "SELECT count(*) FROM stock_movements WHERE tenant_id = $1 AND movement_type = 'sale'",
            &[&t],
        )
        .await
        .expect("sales")
        .get(0);
    assert_eq!(sales, i64::try_from(line_total).expect("fits"));
    let points: i64 = pg(Database::Loyalty)
        .await
        .query_one(
            "SELECT coalesce(sum(points), 0)::bigint FROM loyalty_entries WHERE tenant_id = $1",
            &[&t],
        )
        .await
        .expect("points")
        .get(0);
    assert_eq!(points, i64::try_from(points_total).expect("fits"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn backlog_drains_in_order_and_the_oldest_pending_age_falls_back() {
    let _serial = SERIAL.lock().await;
    let long = std::env::var("SOAK_LONG").is_ok_and(|v| v == "1");
    let orders = env_u64("SOAK_BACKLOG_ORDERS", if long { 16_667 } else { 1_000 });
    let system = System::start(
        "backlog",
        SystemOptions {
            relays: 2,
            start_relays: false,
            ..SystemOptions::default()
        },
    )
    .await;
    system.stock_up().await;
    system.drive(0..orders, 16).await;
    let events = i64::try_from(3 * orders).expect("fits");
    let pending: i64 = pg(Database::Orders)
        .await
        .query_one(
            "SELECT count(*) FROM outbox_events WHERE tenant_id = $1 AND published_at IS NULL",
            &[&system.tenant],
        )
        .await
        .expect("pending")
        .get(0);
    assert_eq!(pending, events, "the whole backlog waits for the relay");

    // Row updates of the outbox from here on: only the relays update it
    // (claims, marks, failures). This assumes no other writer of the shared
    // database meanwhile: the soak tests run one at a time (`SERIAL`), and
    // `cargo test` runs one test binary at a time. (Updates of a transaction
    // that aborts count too; no fault is injected here.)
    let outbox_updates = || async {
        pg(Database::Orders)
            .await
            .query_one(
                "SELECT n_tup_upd FROM pg_stat_user_tables \
                 WHERE schemaname = 'public' AND relname = 'outbox_events'",
                &[],
            )
            .await
            .expect("pg_stat_user_tables")
            .get::<_, i64>(0)
    };
    let updates_before = outbox_updates().await;
    let started = Instant::now();
    for relay in &system.relays {
        relay.start("");
    }
    let relay = &system.relays[0];
    relay.ready(Duration::from_secs(90)).await;
    let report = system.assert_invariants(Duration::from_secs(1800)).await;
    println!(
        "backlog of {events} events drained and applied by every consumer in {:?}",
        started.elapsed()
    );
    assert_eq!(report.events, events);
    assert_eq!(report.published, events);

    // Per-order sequence as the relays published it (not only as the
    // consumers applied it, which they would hold in order anyway): event k+1
    // of an order was claimable only once k was marked, so it was marked
    // strictly later.
    let out_of_order: i64 = pg(Database::Orders)
        .await
        .query_one(
            "SELECT count(*) FROM outbox_events a JOIN outbox_events b \
               ON b.aggregate_type = a.aggregate_type AND b.aggregate_id = a.aggregate_id \
              AND b.aggregate_sequence = a.aggregate_sequence + 1 \
             WHERE a.tenant_id = $1 AND b.published_at <= a.published_at",
            &[&system.tenant],
        )
        .await
        .expect("publication order")
        .get(0);
    assert_eq!(
        out_of_order, 0,
        "events published ahead of their predecessor"
    );

    // The relays are scoped to the system's tenant (`only_tenant`), and so
    // are their gauges: other tenants' pending rows in the shared database do
    // not count. Both fall back once the backlog is drained. (The metric
    // reader counts an absent series as 0: the gauges must exist.)
    let exposition = reqwest::get(relay.url("/metrics"))
        .await
        .expect("metrics")
        .text()
        .await
        .expect("metrics body");
    for gauge in ["outbox_oldest_pending_age_seconds", "outbox_pending_events"] {
        assert!(
            exposition.contains(&format!("# TYPE {gauge} gauge")),
            "{gauge} exported:\n{exposition}"
        );
    }
    let fell = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            let age = relay.metric("outbox_oldest_pending_age_seconds", "").await;
            let pending = relay.metric("outbox_pending_events", "").await;
            if age < 5.0 && pending == 0.0 {
                return age;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    })
    .await;
    let age = fell.expect("the oldest pending age and the pending count fall back within 60 s");
    println!("outbox_oldest_pending_age_seconds back to {age}, outbox_pending_events 0");

    // Bounded database load: each event is written twice (DESIGN.md
    // section 6: the claim, then the mark), plus one claim more for a row
    // a relay took over (its lease ran out: a relay can stall that long on
    // a loaded machine), and two more (the failure recorded, the next
    // claim) for a failed publish. No other write: no write per poll.
    let (mut taken_over, mut failures) = (0.0, 0.0);
    for relay in &system.relays {
        taken_over += relay.metric("outbox_expired_claims_total", "").await;
        failures += relay.metric("outbox_publish_failures_total", "").await;
    }
    let (taken_over, failures) = (taken_over as i64, failures as i64);
    // An idle session may hold its statistics back for up to 10 s
    // (PostgreSQL 15); one that ends reports them. Stop the relays, wait
    // until none of their sessions is left, then until the count holds
    // still (the last sessions' reports land).
    for relay in &system.relays {
        relay.stop();
    }
    let orders_db = pg(Database::Orders).await;
    eventually("the relays' sessions gone", Duration::from_secs(30), || async {
        let left: i64 = orders_db
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE 'outbox-relay %'",
                &[],
            )
            .await
            .expect("pg_stat_activity")
            .get(0);
        (left == 0).then_some(())
    })
    .await;
    let mut updates = outbox_updates().await - updates_before;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let now = outbox_updates().await - updates_before;
        if now == updates || Instant::now() >= deadline {
            break;
        }
        updates = now;
    }
    println!(
        "outbox row updates during the drain: {updates} for {events} events \
         ({taken_over} rows taken over, {failures} failed publishes)"
    );
    // At most: a failure whose lease was taken over before it could be
    // recorded is counted by both metrics, written once.
    assert!(
        (2 * events..=2 * events + taken_over + 2 * failures).contains(&updates),
        "{updates} outbox row updates for {events} events: writes beyond the claim and the mark"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn poison_is_held_with_its_order_and_released_in_order() {
    let _serial = SERIAL.lock().await;
    let system = System::start(
        "poison",
        SystemOptions {
            relay_env: vec![
                (
                    "OUTBOX_RELAY__RELAY__MAX_ATTEMPTS".to_owned(),
                    "3".to_owned(),
                ),
                (
                    "OUTBOX_RELAY__RELAY__BACKOFF_BASE_MS".to_owned(),
                    "100".to_owned(),
                ),
                (
                    "OUTBOX_RELAY__RELAY__BACKOFF_CAP_MS".to_owned(),
                    "300".to_owned(),
                ),
            ],
            ..SystemOptions::default()
        },
    )
    .await;
    system.stock_up().await;
    let names: Vec<String> = system.consumers.iter().map(|c| c.name.clone()).collect();

    // 1. An event the broker cannot route: order 0 placed while no queue is
    //    bound. The relay backs off, then quarantines it.
    for name in &names {
        unbind_consumer(name, &system.exchange).await;
    }
    let body = order_body(0);
    let placed = system.post_created("/orders", "order-0", &body).await;
    let stuck = placed["order_id"].as_str().expect("id").to_owned();
    let orders_db = pg(Database::Orders).await;
    eventually("order 0's event quarantined", Duration::from_secs(120), || {
        let (db, stuck) = (&orders_db, stuck.clone());
        async move {
            let row = db
                .query_one(
                    "SELECT quarantined_at IS NOT NULL, coalesce(last_error, '') FROM outbox_events \
                     WHERE aggregate_id = $1 AND aggregate_sequence = 1",
                    &[&stuck],
                )
                .await
                .expect("row");
            let last_error: String = row.get(1);
            row.get::<_, bool>(0).then_some(last_error)
        }
    })
    .await;
    let last_error: String = orders_db
        .query_one(
            "SELECT last_error FROM outbox_events WHERE aggregate_id = $1 AND aggregate_sequence = 1",
            &[&stuck],
        )
        .await
        .expect("row")
        .get(0);
    assert!(
        last_error.contains("NO_ROUTE"),
        "reason recorded: {last_error}"
    );
    for name in &names {
        bind_consumer(name, &system.exchange).await;
    }
    // Its order goes on (paid, delivered): those events are held behind it.
    finish_order(&system, 0, &stuck).await;

    // 2. A message that always fails in the ledger: order 1, once placed.
    let placed = system
        .post_created("/orders", "order-1", &order_body(1))
        .await;
    let failing = placed["order_id"].as_str().expect("id").to_owned();
    let ledger = system.member("ledger-0");
    let ledger_db = pg(Database::Ledger).await;
    eventually("ledger applies order 1's OrderPlaced", Duration::from_secs(120), || {
        let (db, name, order) = (&ledger_db, ledger.name.clone(), failing.clone());
        async move {
            db.query_opt(
                "SELECT 1 FROM order_progress WHERE consumer_name = $1 AND aggregate_id = $2 AND last_sequence = 1",
                &[&name, &order],
            )
            .await
            .expect("progress")
            .map(|_| ())
        }
    })
    .await;
    ledger.kill();
    ledger.start(&format!("consumer.handler_error=return({failing})"));
    ledger.ready(Duration::from_secs(90)).await;
    finish_order(&system, 1, &failing).await;

    // 3. Other orders are unaffected.
    for i in 2..12 {
        system.order_flow(i).await;
    }
    let report = eventually("only orders 0 and 1 held", Duration::from_secs(300), || {
        let system = &system;
        let (stuck, failing) = (stuck.clone(), failing.clone());
        async move {
            let report = system.check(Duration::ZERO).await;
            let held: std::collections::BTreeSet<String> = report
                .violations
                .iter()
                .filter_map(|v| v.order.clone())
                .chain(
                    report
                        .drift
                        .drift
                        .iter()
                        .filter_map(|d| d.order_id.map(|o| o.to_string())),
                )
                .collect();
            let expected: std::collections::BTreeSet<String> = [stuck, failing].into();
            let parked = report
                .violations
                .iter()
                .any(|v| v.what.contains("parked") && v.what.contains("injected by fail point"));
            (held == expected && parked).then_some(report)
        }
    })
    .await;
    println!("held:\n{}", report.render());
    assert!(
        report
            .violations
            .iter()
            .all(|v| v.invariant == 3 || v.invariant == 6),
        "only not-yet-applied events, nothing doubled or out of order:\n{}",
        report.render()
    );
    // The quarantined order: nothing of it went out.
    let held: i64 = orders_db
        .query_one(
            "SELECT count(*) FROM outbox_events WHERE aggregate_id = $1 AND published_at IS NULL",
            &[&stuck],
        )
        .await
        .expect("held")
        .get(0);
    assert_eq!(held, 3, "the quarantined event and the two behind it");

    // 4. Release: requeue the quarantined event; fix the ledger and redrive.
    let (ok, output) = system.relays[0].run(&["requeue", "--order", &stuck]);
    assert!(ok, "{output}");
    assert!(output.contains("released 1 event(s)"), "{output}");
    ledger.kill();
    ledger.start("");
    ledger.ready(Duration::from_secs(90)).await;
    let (ok, output) = ledger.run(&["redrive", "--order", &failing]);
    assert!(ok, "{output}");
    println!("redrive: {output}");
    let report = system.assert_invariants(Duration::from_secs(300)).await;
    assert_eq!(report.orders, 12);
    assert_eq!(report.events, 36);
}

fn order_body(i: u64) -> serde_json::Value {
    serde_json::json!({"customer_id": format!("c-{i}"), "checkout_id": format!("chk-{i}"),
        "lines": [{"sku": "SKU-01", "qty": 2, "unit_price": "10.00", "unit_cost": "4.00"}],
        "shipping": "1.00", "tax": "2.00", "currency": "USD", "location": "WH-1"})
}

async fn finish_order(system: &System, i: u64, order: &str) {
    system
        .post_created(
            &format!("/orders/{order}/payments"),
            &format!("pay-{i}"),
            &serde_json::json!({"payment_id": format!("p-{i}"), "amount": "23.00", "method": "card"}),
        )
        .await;
    system
        .post_created(
            &format!("/orders/{order}/deliveries"),
            &format!("deliver-{i}"),
            &serde_json::json!({"delivery_id": format!("d-{i}"), "lines": [{"sku": "SKU-01", "qty": 2}]}),
        )
        .await;
}
