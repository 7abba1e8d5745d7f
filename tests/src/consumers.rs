//! Helpers of the consumer tests: start a consumer binary under a private
//! consumer name (so its exchange and queues are its own), publish events
//! exactly as the relay does, read metrics and the dead-letter queue, and
//! remove the topology afterwards.

use std::time::{Duration, Instant};

use futures_util::Future;
use kit::amqp::{check_confirmation, int_header, lapin, str_header, PublishRejected};
use lapin::{
    options::{
        BasicAckOptions, BasicGetOptions, BasicNackOptions, BasicPublishOptions,
        ConfirmSelectOptions, ExchangeDeleteOptions, QueueDeclareOptions, QueueDeleteOptions,
    },
    types::{AMQPValue, FieldTable, LongString, ShortString},
    BasicProperties, Channel, Connection,
};
use serde_json::{json, Value};
use uuid::Uuid;

use crate::{amqp_url, free_port, pg_url, Database, Service};

/// The service token the tests give the consumers.
pub const TEST_TOKEN: &str = "consumer-test-token";

/// Retry tiers of the tests (milliseconds).
pub const TEST_TIERS_MS: &str = "100,200,300,400,500";

/// Wait until every transaction that had written in `db` when called is
/// over: the rows written before the call are then on the read endpoints'
/// pages, which end at the oldest transaction still running
/// (`consumer_runtime::auth::SETTLED_HORIZON`; another test may hold one
/// open for seconds).
pub async fn settled(db: Database) {
    let client = crate::pg(db).await;
    // One past the highest transaction id completed so far: every
    // transaction that had committed its rows by now is below it.
    let next: i64 = client
        .query_one(
            "SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint",
            &[],
        )
        .await
        .expect("xmax")
        .get(0);
    eventually(
        &format!("the transactions running in {} to end", db.name()),
        Duration::from_secs(60),
        || async {
            let oldest: i64 = client
                .query_one(
                    "SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint",
                    &[],
                )
                .await
                .expect("xmin")
                .get(0);
            (oldest >= next).then_some(())
        },
    )
    .await;
}

/// A short random id for names and tenants.
pub fn unique(prefix: &str) -> String {
    let id = Uuid::new_v4().simple().to_string();
    format!("{prefix}-{}", &id[..12])
}

/// Which consumer binary.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Inventory,
    Ledger,
    Loyalty,
}

impl Kind {
    pub fn binary(self) -> &'static str {
        match self {
            Kind::Inventory => "inventory-consumer",
            Kind::Ledger => "ledger-consumer",
            Kind::Loyalty => "loyalty-consumer",
        }
    }

    pub fn prefix(self) -> &'static str {
        match self {
            Kind::Inventory => "INVENTORY_CONSUMER",
            Kind::Ledger => "LEDGER_CONSUMER",
            Kind::Loyalty => "LOYALTY_CONSUMER",
        }
    }

    pub fn database(self) -> Database {
        match self {
            Kind::Inventory => Database::Inventory,
            Kind::Ledger => Database::Ledger,
            Kind::Loyalty => Database::Loyalty,
        }
    }
}

/// How to start a consumer.
#[derive(Clone, Debug)]
pub struct Options {
    pub partitions: u16,
    pub tiers_ms: String,
    pub max_deferrals: u32,
    pub failpoints: Option<String>,
    pub extra: Vec<(String, String)>,
    /// Where the process's output goes, as JSON lines (read it with
    /// [`crate::error_lines`], say); the test's own output when `None`.
    pub log: Option<std::path::PathBuf>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            partitions: 2,
            tiers_ms: TEST_TIERS_MS.to_owned(),
            max_deferrals: 200,
            failpoints: None,
            extra: Vec::new(),
            log: None,
        }
    }
}

impl Options {
    /// The defaults with one partition: every event of the test shares it.
    pub fn one_partition() -> Self {
        Self {
            partitions: 1,
            ..Self::default()
        }
    }

    pub fn tier_count(&self) -> usize {
        self.tiers_ms.split(',').count()
    }
}

/// Environment of a consumer process named `name`.
pub fn consumer_env(kind: Kind, name: &str, port: u16, options: &Options) -> Vec<(String, String)> {
    let p = kind.prefix();
    let mut env = vec![
        (format!("{p}__HTTP__PORT"), port.to_string()),
        (format!("{p}__CONSUMER__NAME"), name.to_owned()),
        (
            format!("{p}__CONSUMER__PARTITIONS"),
            options.partitions.to_string(),
        ),
        (
            format!("{p}__CONSUMER__RETRY_TIERS_MS"),
            options.tiers_ms.clone(),
        ),
        (
            format!("{p}__CONSUMER__MAX_DEFERRALS"),
            options.max_deferrals.to_string(),
        ),
        // Fed only through its own hash exchange: isolated from every other
        // test (and engineer) publishing on order-events.
        (
            format!("{p}__CONSUMER__BIND_ORDER_EVENTS"),
            "false".to_owned(),
        ),
        (format!("{p}__DATABASE__URL"), pg_url(kind.database())),
        (format!("{p}__DATABASE__POOL_SIZE"), "6".to_owned()),
        (format!("{p}__AMQP__URL"), amqp_url()),
        ("SERVICE_TOKEN".to_owned(), TEST_TOKEN.to_owned()),
        (
            "RUST_LOG".to_owned(),
            std::env::var("CONSUMER_TEST_LOG").unwrap_or_else(|_| "warn".to_owned()),
        ),
        ("LOG_FORMAT".to_owned(), "text".to_owned()),
        (
            "FAILPOINTS".to_owned(),
            options.failpoints.clone().unwrap_or_default(),
        ),
    ];
    env.extend(options.extra.iter().cloned());
    env
}

/// A consumer process with a private name. Dropping it kills the process,
/// then deletes the name's exchange and queues (also when the test panics).
pub struct Consumer {
    pub kind: Kind,
    pub name: String,
    pub port: u16,
    pub options: Options,
    pub service: Service,
    _topology: TopologyGuard,
}

/// Deletes a test consumer's exchange and queues when dropped.
pub struct TopologyGuard {
    name: String,
    partitions: u16,
    tiers: usize,
}

impl TopologyGuard {
    pub fn new(name: &str, options: &Options) -> Self {
        Self {
            name: name.to_owned(),
            partitions: options.partitions,
            tiers: options.tier_count(),
        }
    }
}

impl Drop for TopologyGuard {
    fn drop(&mut self) {
        let (name, partitions, tiers) = (self.name.clone(), self.partitions, self.tiers);
        // Drop cannot await: a short-lived runtime on its own thread.
        let _ = std::thread::spawn(move || {
            if let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                runtime.block_on(teardown(&name, partitions, tiers));
            }
        })
        .join();
    }
}

impl Consumer {
    /// Start it and wait until it serves HTTP and its topology exists.
    /// The consumer's process under `name` on `port`, started and not
    /// waited for (one that may die before it is ready, at a fail point).
    pub fn spawn(kind: Kind, name: &str, port: u16, options: &Options) -> Service {
        let mut env = consumer_env(kind, name, port, options);
        if options.log.is_some() {
            env.push(("LOG_FORMAT".to_owned(), "json".to_owned()));
        }
        let env_refs: Vec<(&str, String)> =
            env.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
        Service::start_with_output(kind.binary(), &[], &env_refs, options.log.as_deref())
    }

    pub async fn start(kind: Kind, name: &str, options: Options) -> Consumer {
        let port = free_port();
        let service = Self::spawn(kind, name, port, &options);
        let mut consumer = Consumer {
            kind,
            name: name.to_owned(),
            port,
            _topology: TopologyGuard::new(name, &options),
            options,
            service,
        };
        let url = format!("{}/readyz", consumer.base_url());
        consumer
            .service
            .wait_ready(&url, Duration::from_secs(90))
            .await
            .unwrap_or_else(|e| panic!("{} {name}: {e}", kind.binary()));
        wait_for_topology(name, consumer.options.tier_count()).await;
        consumer
    }

    pub fn base_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The sum of every series of metric `name` whose labels contain `labels`.
    pub async fn metric(&self, name: &str, labels: &str) -> f64 {
        scrape_metric(&self.base_url(), name, labels).await
    }

    /// Wait until this consumer is at rest after `published` messages were
    /// sent to it: every message it received acknowledged (the published
    /// ones and each copy it sent itself through a retry tier, its
    /// deferrals and retries) and none ready in its partitions or tiers.
    /// Proven by counts, not by a pause: a copy it did not count (a bug)
    /// is acknowledged on top, and the wait never ends.
    pub async fn settled(&self, published: u32) {
        let mut queues: Vec<String> = (0..self.options.partitions)
            .map(|p| format!("{}.p{p}", self.name))
            .collect();
        queues.extend((0..self.options.tier_count()).map(|t| format!("{}.retry.{t}", self.name)));
        eventually(
            &format!("{} at rest", self.name),
            Duration::from_secs(60),
            || async {
                // Counters: whole numbers, exact as f64.
                let count = |value: f64| value as u64;
                let acknowledged = count(
                    self.metric("consumer_messages_acknowledged_total", "")
                        .await,
                );
                let copies = count(self.metric("consumer_deferred_total", "").await)
                    + count(self.metric("consumer_retried_total", "").await);
                if acknowledged != u64::from(published) + copies {
                    return None;
                }
                for queue in &queues {
                    if queue_depth(queue).await != 0 {
                        return None;
                    }
                }
                Some(())
            },
        )
        .await;
    }

    /// Wait until metric `name{labels}` reaches at least `value`.
    pub async fn wait_metric(&self, name: &str, labels: &str, value: f64) {
        wait_for_metric(
            &self.base_url(),
            &self.name,
            name,
            labels,
            value,
            Duration::from_secs(60),
        )
        .await;
    }

    /// Wait until metric `name{labels}` is exactly `value`.
    pub async fn wait_metric_eq(&self, name: &str, labels: &str, value: f64) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let current = self.metric(name, labels).await;
            if current.to_bits() == value.to_bits() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{}: {name}{{{labels}}} = {current}, expected {value}",
                self.name
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// GET a read endpoint with the service token.
    pub async fn get(&self, path_and_query: &str) -> (u16, Value) {
        let response = reqwest::Client::new()
            .get(format!("{}{path_and_query}", self.base_url()))
            .bearer_auth(TEST_TOKEN)
            .send()
            .await
            .expect("GET");
        let status = response.status().as_u16();
        (status, response.json().await.unwrap_or(Value::Null))
    }
}

/// Scrape `<base_url>/metrics`: the sum of every series of metric `name`
/// whose labels contain `labels` (0 when it has none yet). A failed scrape
/// panics: read as no series, a 404 or a 500 passed every "... is 0" check.
pub async fn scrape_metric(base_url: &str, name: &str, labels: &str) -> f64 {
    let body = reqwest::get(format!("{base_url}/metrics"))
        .await
        .expect("metrics")
        .error_for_status()
        .unwrap_or_else(|error| panic!("{base_url}/metrics: {error}"))
        .text()
        .await
        .expect("metrics body");
    parse_metric(&body, name, labels)
}

/// Poll `<base_url>/metrics` until `name{labels}` reaches at least `value`.
pub async fn wait_for_metric(
    base_url: &str,
    who: &str,
    name: &str,
    labels: &str,
    value: f64,
    timeout: Duration,
) {
    let deadline = Instant::now() + timeout;
    loop {
        let current = scrape_metric(base_url, name, labels).await;
        if current >= value {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{who}: {name}{{{labels}}} = {current}, expected >= {value}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Sum of metric `name` series whose label set contains `labels`.
pub fn parse_metric(body: &str, name: &str, labels: &str) -> f64 {
    body.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} ")))
        .filter(|l| l.contains(labels))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Poll until `<name>.events` routes to every partition queue and the retry
/// tiers exist (the consumer declares them after connecting).
pub async fn wait_for_topology(name: &str, tiers: usize) {
    let connection = connect().await;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let channel = connection.create_channel().await.expect("channel");
        let last = format!("{name}.retry.{}", tiers - 1);
        let declared = channel
            .queue_declare(
                last.as_str().into(),
                QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .is_ok();
        if declared {
            let _ = channel.close(200, "ok".into()).await;
            break;
        }
        assert!(
            Instant::now() < deadline,
            "topology of {name} not declared in time"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = connection.close(200, "ok".into()).await;
}

pub async fn connect() -> Connection {
    let settings = kit::settings::AmqpSettings { url: amqp_url() };
    kit::amqp::connect(&settings, "consumer-tests", &kit::CancellationToken::new())
        .await
        .expect("connect to RabbitMQ")
}

/// Poll `check` until it returns `Some`, at most `timeout`.
pub async fn eventually<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

// ------------------------------------------------------------- events

/// An event message: the envelope JSON and the relay's AMQP metadata.
#[derive(Clone, Debug)]
pub struct Message {
    pub event_id: Uuid,
    pub event_type: String,
    pub aggregate_id: String,
    pub sequence: i64,
    pub schema_version: i64,
    pub tenant: String,
    pub body: Vec<u8>,
}

impl Message {
    /// The same event under schema version 99, which no consumer decodes
    /// (poison of a known type).
    pub fn as_version_99(mut self) -> Message {
        let mut raw: Value = serde_json::from_slice(&self.body).expect("json");
        raw["schema_version"] = serde_json::json!(99);
        self.body = serde_json::to_vec(&raw).expect("json");
        self.schema_version = 99;
        self
    }
}

/// RFC 3339 "now" (UTC), without a date-time dependency.
pub fn now_rfc3339() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default();
    let days = i64::try_from(secs / 86_400).unwrap_or_default();
    let rem = secs % 86_400;
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Build an event message from its parts (any type or version, for poison tests).
pub fn message(
    tenant: &str,
    order: Uuid,
    sequence: i64,
    event_type: &str,
    schema_version: i64,
    payload: Value,
) -> Message {
    let event_id = Uuid::now_v7();
    let envelope = json!({
        "event_id": event_id,
        "event_type": event_type,
        "schema_version": schema_version,
        "tenant_id": tenant,
        "aggregate_type": "order",
        "aggregate_id": order.to_string(),
        "aggregate_sequence": sequence,
        "occurred_at": now_rfc3339(),
        "payload": payload,
    });
    let body = serde_json::to_vec(&envelope).expect("json");
    if schema_version == 1 && events::supported_versions(event_type).contains(&1) {
        // Known events must be valid by the contract itself.
        events::RawEnvelope::parse_raw(&body)
            .and_then(|raw| raw.decode())
            .expect("a valid v1 event");
    }
    Message {
        event_id,
        event_type: event_type.to_owned(),
        aggregate_id: order.to_string(),
        sequence,
        schema_version,
        tenant: tenant.to_owned(),
        body,
    }
}

/// The seed 003 order: customer 77 buys 2 x JKT-M at 40.00 (cost 22.00),
/// shipping 5.00, tax 8.00, total 93.00, card payment 9001, delivery 311.
pub struct Story {
    pub tenant: String,
    pub order: Uuid,
    pub placed: Message,
    pub paid: Message,
    pub delivered: Message,
}

pub fn order_placed(tenant: &str, order: Uuid, sequence: i64, customer: &str, qty: u32) -> Message {
    let total = 40 * i64::from(qty) + 13;
    message(
        tenant,
        order,
        sequence,
        "OrderPlaced",
        1,
        json!({
            "order_id": order,
            "customer_id": customer,
            "lines": [{"sku": "JKT-M", "qty": qty, "unit_price": "40.00", "unit_cost": "22.00"}],
            "shipping": "5.00",
            "tax": "8.00",
            "total": format!("{total}.00"),
            "currency": "USD",
            "location": "WH-1",
        }),
    )
}

pub fn payment_received(tenant: &str, order: Uuid, sequence: i64, amount: &str) -> Message {
    message(
        tenant,
        order,
        sequence,
        "PaymentReceived",
        1,
        json!({
            "order_id": order,
            "payment_id": "9001",
            "amount": amount,
            "currency": "USD",
            "method": "card",
        }),
    )
}

pub fn parcel_delivered(tenant: &str, order: Uuid, sequence: i64, qty: u32) -> Message {
    message(
        tenant,
        order,
        sequence,
        "ParcelDelivered",
        1,
        json!({
            "order_id": order,
            "delivery_id": "311",
            "delivered_at": now_rfc3339(),
            "lines": [{"sku": "JKT-M", "qty": qty}],
        }),
    )
}

pub fn story(tenant: &str) -> Story {
    let order = Uuid::now_v7();
    Story {
        tenant: tenant.to_owned(),
        order,
        placed: order_placed(tenant, order, 1, "77", 2),
        paid: payment_received(tenant, order, 2, "93.00"),
        delivered: parcel_delivered(tenant, order, 3, 2),
    }
}

fn long(value: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(value.as_bytes()))
}

/// A confirm-mode channel publishing like the relay.
pub struct Publisher {
    pub connection: Connection,
    pub channel: Channel,
}

impl Publisher {
    pub async fn connect() -> Publisher {
        let connection = connect().await;
        let channel = connection.create_channel().await.expect("channel");
        kit::amqp::declare_order_events_exchange(&channel)
            .await
            .expect("declare order-events");
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .expect("confirms");
        Publisher {
            connection,
            channel,
        }
    }

    /// Publish raw bytes with the relay's properties and headers.
    pub async fn publish_raw(
        &self,
        exchange: &str,
        routing_key: &str,
        message: &Message,
    ) -> Result<(), PublishRejected> {
        self.publish_raw_with(exchange, routing_key, message, &[])
            .await
    }

    /// [`Publisher::publish_raw`] with `extra` integer headers (a copy as
    /// a consumer re-publishes it: its counts).
    pub async fn publish_raw_with(
        &self,
        exchange: &str,
        routing_key: &str,
        message: &Message,
        extra: &[(&str, i64)],
    ) -> Result<(), PublishRejected> {
        let mut headers = FieldTable::default();
        for (name, value) in extra {
            headers.insert((*name).into(), AMQPValue::LongLongInt(*value));
        }
        headers.insert("aggregate_id".into(), long(&message.aggregate_id));
        headers.insert(
            "aggregate_sequence".into(),
            AMQPValue::LongLongInt(message.sequence),
        );
        headers.insert(
            "schema_version".into(),
            AMQPValue::LongLongInt(message.schema_version),
        );
        headers.insert("tenant_id".into(), long(&message.tenant));
        headers.insert("event_type".into(), long(&message.event_type));
        headers.insert(
            "traceparent".into(),
            long("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
        );
        let properties = BasicProperties::default()
            .with_message_id(ShortString::from(message.event_id.to_string()))
            .with_type(ShortString::from(message.event_type.as_str()))
            .with_content_type(ShortString::from("application/json"))
            .with_delivery_mode(2)
            .with_headers(headers);
        let confirm = self
            .channel
            .basic_publish(
                exchange.into(),
                routing_key.into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                &message.body,
                properties,
            )
            .await
            .expect("publish")
            .await
            .expect("confirm");
        check_confirmation(confirm)
    }

    /// Publish to the consumer's own hash exchange (only that consumer sees it).
    pub async fn to_consumer(&self, consumer: &str, message: &Message) {
        self.publish_raw(&format!("{consumer}.events"), &message.event_type, message)
            .await
            .unwrap_or_else(|e| panic!("publish {} to {consumer}: {e}", message.event_type));
    }

    /// [`Publisher::to_consumer`] of each message, in order.
    pub async fn all_to_consumer(&self, consumer: &str, messages: &[&Message]) {
        for message in messages {
            self.to_consumer(consumer, message).await;
        }
    }
}

/// Whether one of `letters` is of `order` and its reason says `needle`.
pub fn has_letter(letters: &[DeadLetter], order: Uuid, needle: &str) -> bool {
    letters.iter().any(|l| {
        l.aggregate_id.as_deref() == Some(order.to_string().as_str()) && l.reason.contains(needle)
    })
}

/// A message read from a dead-letter queue.
#[derive(Debug)]
pub struct DeadLetter {
    pub body: Vec<u8>,
    pub reason: String,
    pub aggregate_id: Option<String>,
    /// `x-consumer-attempts`: the failed attempts it had.
    pub attempts: Option<i64>,
    /// `x-consumer-gap-failures`: the failed waits for an earlier event of
    /// its order, past its deferrals.
    pub gap_failures: Option<i64>,
    /// `x-delivery-count`: how often the quorum queue delivered it before.
    pub delivery_count: Option<i64>,
}

/// Messages currently in `<consumer>.dlq` (reads and acknowledges them: they
/// are removed).
pub async fn drain_dead_letters(consumer: &str) -> Vec<DeadLetter> {
    let connection = connect().await;
    let channel = connection.create_channel().await.expect("channel");
    let mut letters = Vec::new();
    while let Some(message) = channel
        .basic_get(
            format!("{consumer}.dlq").as_str().into(),
            BasicGetOptions { no_ack: false },
        )
        .await
        .expect("basic.get on the dlq")
    {
        letters.push(dead_letter(&message.delivery));
        message
            .delivery
            .acker
            .ack(BasicAckOptions::default())
            .await
            .expect("ack");
    }
    let _ = connection.close(200, "ok".into()).await;
    letters
}

/// A dead letter's body and the runtime's headers on it.
fn dead_letter(delivery: &lapin::message::Delivery) -> DeadLetter {
    let headers = delivery.properties.headers().as_ref();
    DeadLetter {
        body: delivery.data.clone(),
        reason: str_header(headers, "x-dead-letter-reason").unwrap_or_default(),
        aggregate_id: str_header(headers, "aggregate_id"),
        attempts: int_header(headers, "x-consumer-attempts"),
        gap_failures: int_header(headers, "x-consumer-gap-failures"),
        delivery_count: int_header(headers, "x-delivery-count"),
    }
}

/// Read one message of `<consumer>.dlq` (waiting for one: a letter
/// returned a moment ago is requeued by the quorum queue asynchronously)
/// and return it to the queue (a nack with requeue, which the quorum queue
/// counts in `x-delivery-count`): the letter as read, back in the queue when
/// this returns.
pub async fn peek_a_dead_letter(consumer: &str) -> DeadLetter {
    let connection = connect().await;
    let channel = connection.create_channel().await.expect("channel");
    let dlq = format!("{consumer}.dlq");
    let message = eventually("a dead letter", Duration::from_secs(30), || async {
        channel
            .basic_get(dlq.as_str().into(), BasicGetOptions { no_ack: false })
            .await
            .expect("basic.get on the dlq")
    })
    .await;
    let letter = dead_letter(&message.delivery);
    message
        .delivery
        .acker
        .nack(BasicNackOptions {
            requeue: true,
            multiple: false,
        })
        .await
        .expect("nack");
    let _ = connection.close(200, "peeked".into()).await;
    eventually(
        "the letter back in the DLQ",
        Duration::from_secs(30),
        || async { (queue_depth(&dlq).await >= 1).then_some(()) },
    )
    .await;
    letter
}

/// Rows in the inbox (`processed_events`) of consumer `name` in `db`.
pub async fn inbox_count(db: Database, name: &str) -> i64 {
    crate::pg(db)
        .await
        .query_one(
            "SELECT count(*) FROM processed_events WHERE consumer_name = $1",
            &[&name],
        )
        .await
        .expect("inbox count")
        .get(0)
}

/// Number of messages ready in `queue`.
pub async fn queue_depth(queue: &str) -> u32 {
    live_counts(queue).await.0
}

/// (ready messages, consumers) of `queue`, straight from the broker (a
/// passive declare: exact, unlike the management API's lagging stats).
pub async fn live_counts(queue: &str) -> (u32, u32) {
    let connection = connect().await;
    let channel = connection.create_channel().await.expect("channel");
    let declared = kit::amqp::passive_declare(&channel, queue)
        .await
        .unwrap_or_else(|e| panic!("queue {queue}: {e}"));
    let _ = connection.close(200, "ok".into()).await;
    (declared.message_count(), declared.consumer_count())
}

/// GET `path` of the RabbitMQ management API (`/api/...`).
pub async fn management(path: &str) -> Value {
    let url = format!(
        "http://127.0.0.1:{}{path}",
        std::env::var("RABBITMQ_MGMT_PORT").unwrap_or_else(|_| "15672".to_owned())
    );
    let user = std::env::var("AMQP_USER").unwrap_or_else(|_| "app".to_owned());
    let password = std::env::var("AMQP_PASSWORD").unwrap_or_else(|_| "app".to_owned());
    match reqwest::Client::new()
        .get(url)
        .basic_auth(user, Some(password))
        .send()
        .await
    {
        Ok(response) => response.json::<Value>().await.unwrap_or(Value::Null),
        Err(_) => Value::Null,
    }
}

/// Consumers registered on `queue` (management API).
pub async fn queue_consumers(queue: &str) -> u64 {
    management(&format!("/api/queues/%2f/{queue}"))
        .await
        .get("consumers")
        .and_then(Value::as_u64)
        .unwrap_or(0)
}

/// Delete a test consumer's exchange and queues.
pub async fn teardown(consumer: &str, partitions: u16, tiers: usize) {
    let connection = connect().await;
    let channel = connection.create_channel().await.expect("channel");
    let mut queues: Vec<String> = (0..partitions)
        .map(|p| format!("{consumer}.p{p}"))
        .collect();
    queues.extend((0..tiers).map(|t| format!("{consumer}.retry.{t}")));
    queues.push(format!("{consumer}.dlq"));
    for queue in queues {
        let _ = channel
            .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
            .await;
    }
    let _ = channel
        .exchange_delete(
            format!("{consumer}.events").as_str().into(),
            ExchangeDeleteOptions::default(),
        )
        .await;
    let _ = connection.close(200, "ok".into()).await;
}
