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
