//! The broker's memory alarm: RabbitMQ blocks every connection that
//! publishes until the alarm clears (it stops reading from their sockets, so
//! nothing the relay sends, not even a channel open, is answered). Orders
//! keep being taken (they only need PostgreSQL); the relay publishes
//! nothing, marks nothing published, quarantines nothing, and still stops
//! promptly on SIGTERM; once the alarm clears, everything flows and the six
//! invariants hold.
//!
//! The alarm is the whole broker's: the test waits until no other test
//! binary or benchmark runs on the machine (`cargo test` runs this binary
//! alone anyway), and `scripts/infra-up.sh` clears an alarm a killed run
//! left raised.

use std::time::{Duration, Instant};

use system_tests::{
    pg,
    system::{System, SystemOptions},
    Database,
};

/// The alarm is the broker's: one test of this binary at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Raised by [`MemoryAlarm::raise`], cleared when dropped (also when the
/// test fails, so the broker is never left blocking everyone).
struct MemoryAlarm;

impl MemoryAlarm {
    async fn raise() -> Self {
        system_tests::infra_script(&["rabbitmq-alarm", "on"]).await;
        MemoryAlarm
    }
}

impl Drop for MemoryAlarm {
    fn drop(&mut self) {
        let script =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/infra-restart.sh");
        let cleared = std::process::Command::new("bash")
            .arg(script)
            .args(["rabbitmq-alarm", "off"])
            .status()
            .is_ok_and(|status| status.success());
        if !cleared {
            eprintln!("could not clear RabbitMQ's memory alarm: run `scripts/infra-restart.sh rabbitmq-alarm off`");
        }
    }
}

async fn count(sql: &str, tenant: &str) -> i64 {
    pg(Database::Orders)
        .await
        .query_one(sql, &[&tenant])
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_blocked_broker_holds_events_back_loses_nothing_and_does_not_hold_shutdown() {
    let _serial = SERIAL.lock().await;
    system_tests::wait_for_quiet_machine("broker_alarm").await;
    let system = System::start(
        "alarm",
        SystemOptions {
            relay_env: vec![(
                "OUTBOX_RELAY__RELAY__CONFIRM_TIMEOUT_MS".to_owned(),
                "1000".to_owned(),
            )],
            ..SystemOptions::default()
        },
    )
    .await;
    system.stock_up().await;
    system.drive(0..3, 3).await;

    // Again right before the alarm: nothing else may have started meanwhile.
    system_tests::wait_for_quiet_machine("broker_alarm").await;
    let alarm = MemoryAlarm::raise().await;
    // Orders are still taken: the API needs only PostgreSQL.
    system.drive(3..8, 5).await;
    let relay = system.member("relay-0");
    system_tests::consumers::eventually(
        "the relay's publishes time out on the blocked connection",
        Duration::from_secs(60),
        || async {
            (relay
                .metric("outbox_publish_failures_total", "reason=\"timeout\"")
                .await
                >= 1.0)
                .then_some(())
        },
    )
    .await;
    // Not ready while the broker blocks it, and /readyz says why (the
    // ServiceNotReady alert reads service_ready).
    let client = reqwest::Client::new();
    system_tests::consumers::eventually(
        "the relay's /readyz: not ready, the broker blocking it",
        Duration::from_secs(30),
        || async {
            let response = client.get(relay.url("/readyz")).send().await.ok()?;
            let status = response.status();
            let body = response.text().await.ok()?;
            (status == reqwest::StatusCode::SERVICE_UNAVAILABLE
                && body.contains("\"broker\":\"blocked\""))
            .then_some(())
        },
    )
    .await;
    let tenant = system.tenant.clone();
    let held = count(
        "SELECT count(*) FROM outbox_events WHERE tenant_id = $1 AND published_at IS NULL",
        &tenant,
    )
    .await;
    assert!(
        held >= 15,
        "the five orders taken during the alarm are held back ({held} unpublished)"
    );
    assert_eq!(
        count(
            "SELECT count(*) FROM outbox_events WHERE tenant_id = $1 \
               AND (quarantined_at IS NOT NULL OR own_failure_count <> 0)",
            &tenant,
        )
        .await,
        0,
        "a blocked broker is the infrastructure's failure: nothing counts towards quarantine"
    );

    // SIGTERM while the broker blocks the relay's connection: a clean exit,
    // without waiting for the broker.
    let asked = Instant::now();
    let status = relay
        .stop()
        .expect("the relay exits on SIGTERM while the broker is blocked");
    assert!(status.success(), "relay exit status {status:?}");
    assert!(
        asked.elapsed() < Duration::from_secs(20),
        "the relay took {:?} to stop",
        asked.elapsed()
    );

    drop(alarm);
    relay.start("");
    relay.ready(Duration::from_secs(60)).await;
    let report = system.assert_invariants(Duration::from_secs(180)).await;
    assert_eq!(report.orders, 8);
    assert_eq!(report.published, 24);
    for consumer in &report.consumers {
        assert_eq!(consumer.applied, 24, "{}", consumer.name);
    }
}

/// The alarm blocks a connection once it publishes, and lapin then writes
/// nothing on it, acknowledgements included. A consumer sends its copies
/// (retries, deferrals, dead letters) on a connection of its own: one
/// partition holding a copy the broker will not take does not stop the
/// other partitions' acknowledgements (on a shared connection they all
/// waited for the alarm to end, then for the broker's consumer_timeout).
/// Nor does it stop a partition set up after it: every partition's channels
/// are open before any worker starts (a publishing channel opened after the
/// held copy was never answered, and its partition never consumed). Nor
/// does a second copy wait for the end of the alarm: its publish, never
/// written, gives up and the message is held, counted, with the messages
/// settled before it acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_copy_held_by_the_alarm_does_not_stop_the_other_partitions_acknowledgements() {
    use system_tests::consumers::{
        live_counts, order_placed, payment_received, queue_depth, unique, wait_for_topology,
        Consumer, Kind, Options, Publisher, TopologyGuard,
    };
    let _serial = SERIAL.lock().await;
    system_tests::wait_for_quiet_machine("broker_alarm").await;
    let tenant = unique("alarm-copy");
    let name = unique("alarm-copy-led");
    let options = Options::default();
    assert_eq!(options.partitions, 2);
    let _topology = TopologyGuard::new(&name, &options);

    // The consumer's topology, then the consumer stopped: its queues stay.
    let port = system_tests::free_port();
    let mut first = Consumer::spawn(Kind::Ledger, &name, port, &options);
    first
        .wait_ready(
            &format!("http://127.0.0.1:{port}/readyz"),
            Duration::from_secs(90),
        )
        .await
        .expect("the consumer is ready");
    wait_for_topology(&name, options.tier_count()).await;
    first.signal("TERM");
    let stopped = tokio::task::spawn_blocking(move || first.wait_exit(Duration::from_secs(30)))
        .await
        .expect("wait");
    assert!(stopped.is_some(), "the first consumer stopped");

    // A payment whose order was never placed here: its partition defers it
    // (a copy to a retry tier), which the alarm holds. Put straight into the
    // first partition, the one set up first.
    let publisher = Publisher::connect().await;
    let held = uuid::Uuid::now_v7();
    let partitions = [format!("{name}.p0"), format!("{name}.p1")];
    publisher
        .publish_raw(
            "",
            &partitions[0],
            &payment_received(&tenant, held, 2, "53.00"),
        )
        .await
        .expect("the payment is put into the first partition");
    let depths = |queues: [String; 2]| async move {
        [queue_depth(&queues[0]).await, queue_depth(&queues[1]).await]
    };
    assert_eq!(depths(partitions.clone()).await, [1, 0]);
    let other = 1;
    // Orders placed behind it, until at least 3 are in the other partition.
    let mut placed = 0;
    while depths(partitions.clone()).await[other] < 3 {
        assert!(placed < 64, "no order hashed to the other partition");
        publisher
            .to_consumer(
                &name,
                &order_placed(&tenant, uuid::Uuid::now_v7(), 1, "77", 1),
            )
            .await;
        placed += 1;
    }
    let on_other = f64::from(depths(partitions.clone()).await[other]);
    // Behind the other partition's orders, a payment of its own: a second
    // copy, due once the first has made the broker block the publishing
    // connection. lapin writes nothing on a blocked connection: the publish
    // gives up after 5 s and the message is held, counted (the alert
    // ConsumerRetryingInPlace), and the orders settled before it are
    // acknowledged meanwhile. Before, its publish waited unseen, deaf to a
    // shutdown, for the end of the alarm, and so did their acknowledgements.
    publisher
        .publish_raw(
            "",
            &partitions[other],
            &payment_received(&tenant, uuid::Uuid::now_v7(), 2, "54.00"),
        )
        .await
        .expect("a second payment is put into the other partition");

    system_tests::wait_for_quiet_machine("broker_alarm").await;
    let alarm = MemoryAlarm::raise().await;
    // The consumer delays its second partition's set-up by 10 s: time for
    // the first partition's worker, were it started already, to send the
    // copy the alarm holds (after which the broker answers nothing on the
    // publishing connection, a channel open included), and for the test to
    // see a consumer ready before its second partition consumes.
    let log = std::env::temp_dir().join(format!("{name}.delayed.log"));
    let delayed = Options {
        failpoints: Some("consumer.partition_set_up=1*return(10000)".to_owned()),
        log: Some(log.clone()),
        // The fail point's warning is read from the log (whatever
        // CONSUMER_TEST_LOG says).
        extra: vec![("RUST_LOG".into(), "warn".into())],
        ..options.clone()
    };
    let consumer = Consumer::start(Kind::Ledger, &name, delayed).await;
    // Ready only once every partition consumes.
    for queue in &partitions {
        assert_eq!(
            live_counts(queue).await.1,
            1,
            "{queue} has its consumer when the consumer is ready"
        );
    }
    assert!(
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .contains("fail point: delaying"),
        "the second partition's set-up was not delayed: this shows nothing"
    );
    // The other partition applies and acknowledges its orders while both
    // partitions wait for the broker to take their copies.
    consumer
        .wait_metric("consumer_messages_acknowledged_total", "", on_other)
        .await;
    assert_eq!(
        consumer
            .metric("consumer_messages_acknowledged_total", "")
            .await,
        on_other,
        "only the other partition's orders are acknowledged during the alarm"
    );
    assert_eq!(consumer.metric("consumer_deferred_total", "").await, 0.0);
    assert!(
        consumer.metric("consumer_retried_in_place_total", "").await >= 1.0,
        "the second copy is held and counted"
    );

    drop(alarm);
    // The copies go out once the alarm clears; the held partition's orders
    // follow.
    consumer
        .wait_metric("consumer_deferred_total", "", 2.0)
        .await;
    consumer
        .wait_metric("consumer_events_applied_total", "", f64::from(placed))
        .await;
}
