//! One trace per business operation, across the broker: the five real
//! binaries export their spans over OTLP/HTTP to an in-test receiver, and for
//! each of an order's three operations (placed, paid, delivered) the spans of
//! order-api, outbox-relay and the three consumers share one trace id with
//! the right parents:
//!
//! client (traceparent header) -> order-api `order_operation` (its context
//! stored in `outbox_events.traceparent`) -> outbox-relay `outbox.publish`
//! (`traceparent` AMQP header) -> each consumer's `consume` span.
//!
//! The services run with `RUST_LOG=warn`: the trace must not depend on the
//! log level.

use std::collections::BTreeSet;
use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::{json, Value};
use system_tests::{
    consumers::eventually,
    otlp::{Receiver, Span},
    pg,
    system::{System, SystemOptions},
    Database,
};

/// The tests of this file run one at a time (the first sets the OTLP
/// environment its services inherit).
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const CONSUMERS: [&str; 3] = ["inventory-consumer", "ledger-consumer", "loyalty-consumer"];

/// The trace of one operation, once every consumer has exported its span.
struct Trace<'a> {
    operation: &'a Span,
    publishes: Vec<&'a Span>,
    consumes: Vec<&'a Span>,
}

fn trace<'a>(spans: &'a [Span], trace_id: &str) -> Option<Trace<'a>> {
    let in_trace: Vec<&Span> = spans.iter().filter(|s| s.trace_id == trace_id).collect();
    let operation = *in_trace
        .iter()
        .find(|s| s.service == "order-api" && s.name == "order_operation")?;
    let publishes: Vec<&Span> = in_trace
        .iter()
        .copied()
        .filter(|s| s.service == "outbox-relay" && s.name == "outbox.publish")
        .collect();
    let consumes: Vec<&Span> = in_trace
        .iter()
        .copied()
        .filter(|s| CONSUMERS.contains(&s.service.as_str()) && s.name == "consume")
        .collect();
    let services: BTreeSet<&str> = consumes.iter().map(|s| s.service.as_str()).collect();
    (!publishes.is_empty() && services.len() == CONSUMERS.len()).then_some(Trace {
        operation,
        publishes,
        consumes,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_trace_per_operation_across_the_broker() {
    let _serial = SERIAL.lock().await;
    let receiver = Receiver::start().await;
    // Inherited by every process the system starts (the test process starts no
    // other thread that reads the environment at this point).
    let _env = OtelEnv::set(&receiver);
    // No lease may run out and no confirm time out on a stalled machine: a
    // republished copy would bring a second publish span, whose consume
    // span can reach the receiver before the publish span does.
    let system = System::start(
        "trace",
        SystemOptions {
            relay_env: system_tests::PATIENT_RELAY
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            ..SystemOptions::default()
        },
    )
    .await;
    system.receive("SKU-00", 100).await;

    // The first two operations continue a trace the client started (trace
    // id, parent span id); the third starts its own (order-api's span is the root).
    let client_trace = |i: u8| {
        (i < 3).then(|| {
            (
                format!("4bf92f3577b34da6a3ce929d0e0e47{i:02x}"),
                format!("00f067aa0ba902{i:02x}"),
            )
        })
    };
    let post = |path: String, key: &'static str, body: Value, i: u8| {
        let mut request = system
            .http
            .post(system.api.url(&path))
            .bearer_auth(&system.key)
            .header("Idempotency-Key", key)
            .json(&body)
            .timeout(Duration::from_secs(30));
        if let Some((trace_id, parent)) = client_trace(i) {
            request = request
                .header("traceparent", format!("00-{trace_id}-{parent}-01"))
                .header("tracestate", "vendor=test");
        }
        async move {
            let response = request.send().await.expect("request");
            assert_eq!(response.status(), 201, "{path}");
            response.json::<Value>().await.expect("json")
        }
    };
    let order = post(
        "/orders".into(),
        "trace-order",
        json!({"customer_id": "c-trace", "checkout_id": "chk-trace",
               "lines": [{"sku": "SKU-00", "qty": 2, "unit_price": "10.00", "unit_cost": "5.00"}],
               "shipping": "1.00", "tax": "2.00", "currency": "USD", "location": "WH-1"}),
        1,
    )
    .await;
    let order_id = order["order_id"].as_str().expect("order id").to_owned();
    post(
        format!("/orders/{order_id}/payments"),
        "trace-pay",
        json!({"payment_id": "p-trace", "amount": "23.00", "method": "card"}),
        2,
    )
    .await;
    post(
        format!("/orders/{order_id}/deliveries"),
        "trace-deliver",
        json!({"delivery_id": "d-trace", "lines": [{"sku": "SKU-00", "qty": 2}]}),
        3,
    )
    .await;

    // The stored trace context of each event (in sequence order).
    let orders = pg(Database::Orders).await;
    let stored: Vec<(String, String, Option<String>, Option<String>)> = orders
        .query(
            "SELECT event_id::text, event_type, traceparent, tracestate FROM outbox_events
             WHERE tenant_id = $1 AND aggregate_id = $2 ORDER BY aggregate_sequence",
            &[&system.tenant, &order_id],
        )
        .await
        .expect("outbox rows")
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect();
    let types: Vec<&str> = stored.iter().map(|s| s.1.as_str()).collect();
    assert_eq!(
        types,
        ["OrderPlaced", "PaymentReceived", "ParcelDelivered"],
        "events of the order"
    );

    for (i, (event_id, event_type, traceparent, tracestate)) in stored.iter().enumerate() {
        let traceparent = traceparent.as_deref().expect("stored traceparent");
        let trace_id = traceparent.split('-').nth(1).expect("trace id").to_owned();
        let client = client_trace(i as u8 + 1);
        let client_span = match &client {
            Some((client_trace_id, client_span)) => {
                assert_eq!(
                    &trace_id, client_trace_id,
                    "{event_type}: the client's trace is continued"
                );
                client_span.clone()
            }
            None => String::new(),
        };
        let spans = eventually(
            &format!("the spans of {event_type} from all five services"),
            Duration::from_secs(60),
            || {
                let spans = receiver.spans();
                let found = trace(&spans, &trace_id).is_some();
                async move { found.then_some(spans) }
            },
        )
        .await;
        let t = trace(&spans, &trace_id).expect("trace");

        // order-api continues the client's trace (or starts one) and stores
        // its own span's context.
        assert_eq!(
            t.operation.parent_span_id, client_span,
            "{event_type}: order-api parent"
        );
        assert_eq!(
            traceparent,
            format!("00-{trace_id}-{}-01", t.operation.span_id),
            "{event_type}: the outbox row stores the order-api span's context"
        );
        assert_eq!(
            tracestate.as_deref(),
            client.is_some().then_some("vendor=test"),
            "{event_type}: tracestate"
        );

        // The relay's publish span is a child of the stored context.
        for publish in &t.publishes {
            assert_eq!(
                publish.parent_span_id, t.operation.span_id,
                "{event_type}: relay publish parent"
            );
            assert_eq!(publish.attribute("event_id"), Some(event_id.as_str()));
            assert_eq!(publish.attribute("aggregate_id"), Some(order_id.as_str()));
        }
        // Each consumer's span is a child of a publish span (the message's headers).
        let publish_ids: BTreeSet<&str> = t.publishes.iter().map(|s| s.span_id.as_str()).collect();
        for consume in &t.consumes {
            assert!(
                publish_ids.contains(consume.parent_span_id.as_str()),
                "{event_type}: {} consume span's parent {} is not a publish span {publish_ids:?}",
                consume.service,
                consume.parent_span_id
            );
        }
        // No other span of this trace is a root or dangles outside it.
        let ids: BTreeSet<&str> = spans
            .iter()
            .filter(|s| s.trace_id == trace_id)
            .map(|s| s.span_id.as_str())
            .collect();
        for span in spans.iter().filter(|s| s.trace_id == trace_id) {
            assert!(
                span.parent_span_id == client_span || ids.contains(span.parent_span_id.as_str()),
                "{event_type}: {} {} has an unknown parent {}",
                span.service,
                span.name,
                span.parent_span_id
            );
        }
    }
    assert!(
        receiver
            .requests()
            .iter()
            .all(|r| r.starts_with("POST /v1/traces")),
        "only trace exports: {:?}",
        receiver.requests()
    );
}

/// The OTLP environment of the processes this test process starts; removed
/// again on drop (also when the test fails).
struct OtelEnv;

const OTEL_VARS: [&str; 3] = [
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_BSP_SCHEDULE_DELAY",
    "OTEL_EXPORTER_OTLP_TIMEOUT",
];

impl OtelEnv {
    fn set(receiver: &Receiver) -> OtelEnv {
        for (name, value) in OTEL_VARS.iter().zip([
            receiver.endpoint(),
            // Export every 100 ms instead of every 5 s.
            "100".to_owned(),
            // A batch whose export times out is dropped for good: generous,
            // so a stalled machine does not lose spans the test waits for.
            "30000".to_owned(),
        ]) {
            std::env::set_var(name, value);
        }
        OtelEnv
    }
}

impl Drop for OtelEnv {
    fn drop(&mut self) {
        for name in OTEL_VARS {
            std::env::remove_var(name);
        }
    }
}

/// Spans still waiting in the batch exporter are flushed when a service
/// stops on SIGTERM (the export interval here is a minute: only the
/// shutdown flush can deliver them in time).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_spans_are_flushed_on_sigterm() {
    let _serial = SERIAL.lock().await;
    let receiver = Receiver::start().await;
    let tenant = system_tests::unique_tenant("flush");
    let key = system_tests::api_key(&tenant);
    let mut api = system_tests::OrderApi::start(&[
        ("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint()),
        ("OTEL_BSP_SCHEDULE_DELAY", "60000".to_owned()),
    ])
    .await;
    let response = reqwest::Client::new()
        .post(api.url("/orders"))
        .bearer_auth(&key)
        .header("Idempotency-Key", "flush-1")
        .json(
            &json!({"customer_id": "c-flush", "checkout_id": "chk-flush",
               "lines": [{"sku": "SKU-00", "qty": 1, "unit_price": "1.00", "unit_cost": "0.50"}],
               "shipping": "0.00", "tax": "0.00", "currency": "USD", "location": "WH-1"}),
        )
        .send()
        .await
        .expect("request");
    assert_eq!(response.status(), 201);
    // No relay runs here: the order's event would stay pending for good in
    // the shared database, where every later relay (other tests, `make
    // bench`) walks it and publishes it to an exchange with no queue.
    system_tests::delete_outbox_rows(
        &system_tests::pg(system_tests::Database::Orders).await,
        "DELETE FROM outbox_events WHERE tenant_id = $1 AND published_at IS NULL",
        &[&tenant],
    )
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        receiver.spans().is_empty(),
        "nothing exported before the interval"
    );
    api.service.signal("TERM");
    let status = api
        .service
        .wait_exit(Duration::from_secs(30))
        .expect("order-api stops on SIGTERM");
    assert!(status.success(), "order-api exit: {status:?}");
    let spans = receiver.spans();
    assert!(
        spans
            .iter()
            .any(|s| s.service == "order-api" && s.name == "order_operation"),
        "the order's span was flushed at shutdown: {spans:?}"
    );
}

/// `promtool` (Debian's `prometheus` package; `scripts/check-deploy.sh`,
/// which `make test` runs first, installs it where missing).
fn promtool() -> String {
    let path = std::env::var("PROMTOOL").unwrap_or_else(|_| "promtool".to_owned());
    let found = Command::new(&path)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        found,
        "{path} not found: run scripts/check-deploy.sh (installs it) or apt-get install prometheus"
    );
    path
}

/// Every service's `/metrics`, after an order went through the whole system
/// (so histograms and labelled counters have samples), passes `promtool
/// check metrics` (Prometheus naming: `_total`, `_seconds`, base units) and
/// has the metrics of DESIGN.md section 10 that the alerts read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_service_exposes_lint_clean_prometheus_metrics() {
    let _serial = SERIAL.lock().await;
    let promtool = promtool();
    let system = System::start("metrics", SystemOptions::default()).await;
    system.stock_up().await;
    system.order_flow(0).await;
    // Placed, paid, delivered: three events applied by every consumer.
    for consumer in &system.consumers {
        consumer
            .wait_metric("consumer_events_applied_total", "", 3.0)
            .await;
    }

    let expected: [(&str, &[&str]); 3] = [
        (
            "order-api",
            &[
                "idempotency_claims_total",
                "idempotency_replays_total",
                "idempotency_key_conflicts_total",
                "idempotency_in_progress_total",
                "idempotency_rollbacks_total",
                "idempotency_commit_outcome_unknown_total",
                "idempotency_expired_keys_deleted_total",
                "idempotency_cleanup_failures_total",
                "idempotency_oldest_incomplete_key_seconds",
            ],
        ),
        (
            "relay",
            &[
                "outbox_pending_events",
                "outbox_oldest_pending_age_seconds",
                "outbox_published_total",
                "outbox_publish_failures_total",
                "outbox_attempts_total",
                "outbox_expired_claims_total",
                "outbox_confirm_latency_seconds_bucket",
                "outbox_quarantined_events",
                "outbox_table_bytes",
            ],
        ),
        (
            "consumer",
            &[
                "consumer_events_applied_total",
                "consumer_duplicates_total",
                "consumer_deferred_total",
                "consumer_retried_total",
                "consumer_dead_lettered_total",
                "consumer_dlq_messages",
                "consumer_handler_duration_seconds_bucket",
                "consumer_lag_seconds_bucket",
            ],
        ),
    ];
    let mut exported = String::new();
    for member in system.members() {
        let body = system_tests::wait_for_ok(&member.url("/metrics"), Duration::from_secs(10))
            .await
            .expect("metrics");
        exported.push_str(&body);
        let names: &[&str] = expected
            .iter()
            .find(|(prefix, _)| {
                member.label.starts_with(prefix) || member.kind.is_some() && *prefix == "consumer"
            })
            .map(|(_, names)| *names)
            .unwrap_or(&[]);
        for name in names {
            assert!(
                body.lines().any(|l| l.starts_with(name)),
                "{}: no {name} in /metrics:\n{body}",
                member.label
            );
        }
        let mut child = Command::new(&promtool)
            .args(["check", "metrics"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("promtool");
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(body.as_bytes())
            .expect("write metrics");
        let output = child.wait_with_output().expect("promtool output");
        assert!(
            output.status.success(),
            "promtool check metrics on {}'s /metrics:\n{}{}",
            member.label,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    // And the broker's, as deploy/prometheus/prometheus.yml scrapes them
    // (jobs rabbitmq and rabbitmq-queues; the plugin infra-up.sh enables).
    // A queue is in the per-queue metrics from the broker's first
    // statistics emission after its declaration (every 5 s by default): on
    // a fresh cluster this run's queues may not be there yet.
    for (path, sample) in [
        ("/metrics", "rabbitmq_"),
        (
            "/metrics/detailed?family=queue_coarse_metrics",
            "rabbitmq_detailed_queue_",
        ),
    ] {
        let url = format!("http://127.0.0.1:15692{path}");
        let body = eventually(
            &format!("RabbitMQ's {url} (rabbitmq_prometheus) with samples"),
            Duration::from_secs(60),
            || async {
                let body = system_tests::wait_for_ok(&url, Duration::from_secs(10))
                    .await
                    .ok()?;
                body.lines()
                    .any(|line| line.starts_with(sample))
                    .then_some(body)
            },
        )
        .await;
        exported.push_str(&body);
    }
    // Every metric an alert rule reads is exported by some service or the
    // broker: a renamed metric would leave its alert unable to fire, and
    // promtool's rule tests (scripts/check-deploy.sh) feed the rules their
    // own series.
    let read = alert_metric_names();
    assert!(read.len() >= 20, "alerts.yml read: {read:?}");
    let missing: Vec<&String> = read
        .iter()
        .filter(|name| {
            !exported.lines().any(|line| {
                line.strip_prefix(name.as_str())
                    .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
            })
        })
        .collect();
    assert!(
        missing.is_empty(),
        "metrics the alerts read that no service exports: {missing:?}"
    );
}

/// The metric names the alert rules read: the identifiers with an
/// underscore in every `expr` of deploy/prometheus/alerts.yml (PromQL's
/// functions aside; `up` is Prometheus's own).
fn alert_metric_names() -> BTreeSet<String> {
    let rules = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../deploy/prometheus/alerts.yml"
    ))
    .expect("deploy/prometheus/alerts.yml");
    let mut exprs = Vec::new();
    let mut lines = rules.lines().peekable();
    while let Some(line) = lines.next() {
        let Some(at) = line.find("expr:") else {
            continue;
        };
        let rest = line[at + "expr:".len()..].trim();
        // A block scalar (`|`, `|-`, `>`, `>-`, ...): the lines indented
        // past `expr:`.
        if rest.starts_with('|') || rest.starts_with('>') {
            while let Some(next) = lines.peek() {
                let indent = next.len() - next.trim_start().len();
                if !next.trim().is_empty() && indent <= at {
                    break;
                }
                exprs.push(next.to_string());
                lines.next();
            }
        } else {
            exprs.push(rest.to_string());
        }
    }
    exprs
        .iter()
        .flat_map(|expr| {
            // Outside quoted strings (label values and regular expressions).
            let code: String = expr.split('"').step_by(2).collect::<Vec<_>>().join(" ");
            let mut names = Vec::new();
            let mut rest = code.as_str();
            while let Some(start) = rest.find(|c: char| c.is_ascii_lowercase()) {
                let token = &rest[start..];
                let end = token
                    .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .unwrap_or(token.len());
                let (name, after) = token.split_at(end);
                // Not a function (`label_replace(`, `histogram_quantile(`).
                if name.contains('_') && !after.trim_start().starts_with('(') {
                    names.push(name.to_owned());
                }
                rest = after;
            }
            names
        })
        .collect()
}
