//! A whole system from the real binaries, for the full-flow, fault and soak
//! tests: order-api, N relays scoped to the system's own tenant
//! (`OUTBOX_RELAY__RELAY__ONLY_TENANT`) publishing to a private topic
//! exchange `<tenant>.order-events` (`OUTBOX_RELAY__RELAY__EXCHANGE`), and M
//! instances of each consumer under private names, their hash exchanges
//! bound to that private exchange exactly as a real consumer binds
//! `order-events` (`#`). So a system sees only its own events, and tests
//! (or engineers) running at the same time cannot apply each other's
//! events. Every process is a
//! [`Member`] that can be killed (SIGKILL), crashed by a fail point and
//! restarted with the same configuration (same port, same consumer name)
//! while the test drives traffic through the same `System` (shared behind
//! an `Arc`).
//!
//! Test files still run their systems one at a time (a static mutex): the
//! machine has two cores.

use crate::OutputWithin;
use std::process::ExitStatus;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use futures_util::{stream, StreamExt};
use ops::invariants::{self, Scope};
use reqwest::{Client, StatusCode};
use serde_json::{json, Value};

use crate::consumers::{
    connect, consumer_env, scrape_metric, unique, wait_for_metric, wait_for_topology, Kind,
    Options, TopologyGuard, TEST_TOKEN,
};
use crate::{api_key, free_port, unique_tenant, wait_for_ok, Service};
use kit::amqp::lapin::{
    options::{ExchangeBindOptions, ExchangeDeleteOptions, ExchangeUnbindOptions},
    types::FieldTable,
};

/// How to build a [`System`].
#[derive(Clone, Debug)]
pub struct SystemOptions {
    pub relays: usize,
    /// Instances of each consumer (one name per kind, shared by its instances).
    pub consumer_instances: usize,
    /// Fail points per member label (`order-api`, `relay-0`, `inventory-0`,
    /// ...), applied to the first start only.
    pub failpoints: Vec<(String, String)>,
    /// Extra environment for every relay.
    pub relay_env: Vec<(String, String)>,
    /// Extra environment for order-api.
    pub api_env: Vec<(String, String)>,
    /// Start the relays now (`false`: the test starts them later).
    pub start_relays: bool,
    /// How the consumers run (the tests' defaults: 2 partitions, retry tiers
    /// in milliseconds).
    pub consumer_options: Options,
}

impl Default for SystemOptions {
    fn default() -> Self {
        Self {
            relays: 1,
            consumer_instances: 1,
            failpoints: Vec::new(),
            relay_env: Vec::new(),
            api_env: Vec::new(),
            start_relays: true,
            consumer_options: Options::default(),
        }
    }
}

/// One process of the system: restartable with the same environment.
pub struct Member {
    /// `order-api`, `relay-<i>`, `<kind>-<i>`.
    pub label: String,
    pub binary: &'static str,
    /// For consumers: the kind and the (shared) consumer name.
    pub kind: Option<Kind>,
    pub name: String,
    pub port: u16,
    env: Vec<(String, String)>,
    service: Mutex<Option<Service>>,
    /// Starts so far.
    pub starts: AtomicU64,
    /// Last scraped value of each counter, per process id (summed over the
    /// process's incarnations: a counter restarts at 0 with its process).
    samples: Mutex<Vec<(u32, String, u64)>>,
}

impl Member {
    fn new(
        label: String,
        binary: &'static str,
        kind: Option<Kind>,
        name: String,
        port: u16,
        env: Vec<(String, String)>,
    ) -> Member {
        Member {
            label,
            binary,
            kind,
            name,
            port,
            env,
            service: Mutex::new(None),
            starts: AtomicU64::new(0),
            samples: Mutex::new(Vec::new()),
        }
    }

    /// Start the process (`failpoints`: its `FAILPOINTS`, empty = none).
    /// Does not wait for readiness.
    pub fn start(&self, failpoints: &str) {
        let mut env: Vec<(&str, String)> = self
            .env
            .iter()
            .filter(|(k, _)| k != "FAILPOINTS")
            .map(|(k, v)| (k.as_str(), v.clone()))
            .collect();
        env.push(("FAILPOINTS", failpoints.to_owned()));
        let service = Service::start(self.binary, &[], &env);
        self.starts.fetch_add(1, Ordering::Relaxed);
        *self.service.lock().expect("lock") = Some(service);
    }

    pub fn base_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Run a subcommand of this member's binary with its environment
    /// (e.g. `redrive`, `requeue`); (success, stdout + stderr).
    pub fn run(&self, args: &[&str]) -> (bool, String) {
        let output = std::process::Command::new(crate::bin(self.binary))
            .args(args)
            .envs(
                self.env
                    .iter()
                    .filter(|(k, _)| k != "FAILPOINTS")
                    .map(|(k, v)| (k.as_str(), v.as_str())),
            )
            .output_within()
            .expect("run a subcommand");
        (
            output.status.success(),
            format!(
                "{}{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            ),
        )
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base_url())
    }

    pub fn pid(&self) -> Option<u32> {
        self.service
            .lock()
            .expect("lock")
            .as_ref()
            .map(Service::pid)
    }

    /// Whether the process is alive.
    pub fn running(&self) -> bool {
        let mut guard = self.service.lock().expect("lock");
        match guard.as_mut() {
            Some(service) => service.wait_exit(Duration::ZERO).is_none(),
            None => false,
        }
    }

    /// SIGKILL and reap it (no-op when not running).
    pub fn kill(&self) {
        let mut guard = self.service.lock().expect("lock");
        if let Some(mut service) = guard.take() {
            if service.wait_exit(Duration::ZERO).is_none() {
                service.signal("KILL");
                service.wait_exit(Duration::from_secs(30));
            }
        }
    }

    /// SIGTERM and wait for a clean exit.
    pub fn stop(&self) -> Option<ExitStatus> {
        let mut guard = self.service.lock().expect("lock");
        let mut service = guard.take()?;
        if service.wait_exit(Duration::ZERO).is_none() {
            service.signal("TERM");
        }
        service.wait_exit(Duration::from_secs(60))
    }

    /// Wait until the process exits by itself; its exit status.
    pub async fn wait_exit(&self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            {
                let mut guard = self.service.lock().expect("lock");
                if let Some(service) = guard.as_mut() {
                    if let Some(status) = service.wait_exit(Duration::ZERO) {
                        guard.take();
                        return Some(status);
                    }
                }
            }
            if Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Wait for `/readyz`.
    pub async fn ready(&self, timeout: Duration) {
        wait_for_ok(&format!("{}/readyz", self.base_url()), timeout)
            .await
            .unwrap_or_else(|e| panic!("{}: {e}", self.label));
        // An answer on a port whose service has exited with an error (it
        // could not bind it, say) came from some other process. (Dying by a
        // signal is a fail point's abort, which may fire this early.)
        let exited = self
            .service
            .lock()
            .expect("lock")
            .as_mut()
            .and_then(Service::exited_with_code);
        if let Some(status) = exited {
            panic!(
                "{}: /readyz on port {} answered, but the process exited: {status}",
                self.label, self.port
            );
        }
    }

    /// The sum of every series of metric `name` whose labels contain `labels`.
    pub async fn metric(&self, name: &str, labels: &str) -> f64 {
        scrape_metric(&self.base_url(), name, labels).await
    }

    /// Wait until metric `name{labels}` reaches at least `value`.
    pub async fn wait_metric(&self, name: &str, labels: &str, value: f64) {
        wait_for_metric(
            &self.base_url(),
            &self.label,
            name,
            labels,
            value,
            // Thousands of events (a replay) through a debug build on a
            // slow machine.
            Duration::from_secs(300),
        )
        .await;
    }

    /// Scrape the counters `names` of the running process and remember them
    /// under its pid.
    pub async fn sample(&self, names: &[&str]) {
        let Some(pid) = self.pid() else { return };
        let url = format!("{}/metrics", self.base_url());
        let Ok(Ok(response)) =
            tokio::time::timeout(Duration::from_secs(3), Client::new().get(&url).send()).await
        else {
            return;
        };
        let Ok(body) = response.text().await else {
            return;
        };
        let mut samples = self.samples.lock().expect("lock");
        for name in names {
            let value = invariants::metric_sum(&body, name);
            match samples.iter_mut().find(|(p, n, _)| *p == pid && n == name) {
                Some(entry) => entry.2 = entry.2.max(value),
                None => samples.push((pid, (*name).to_owned(), value)),
            }
        }
    }

    /// Counter `name` summed over every sampled incarnation (a lower bound:
    /// what a killed process counted after its last sample is not seen).
    pub fn sampled(&self, name: &str) -> u64 {
        self.samples
            .lock()
            .expect("lock")
            .iter()
            .filter(|(_, n, _)| n == name)
            .map(|s| s.2)
            .sum()
    }
}

/// Counters sampled from relays and consumers for the reports.
pub const RELAY_COUNTERS: &[&str] = &["outbox_expired_claims_total", "outbox_mark_lost_total"];
pub const CONSUMER_COUNTERS: &[&str] = &["consumer_duplicates_total", "consumer_stale_total"];

/// What a traffic run did.
#[derive(Clone, Debug, Default)]
pub struct Traffic {
    pub orders: u64,
    /// Requests sent again (connection failures, 5xx, 409 in progress).
    pub retries: u64,
    /// Responses that were idempotent replays.
    pub replays: u64,
    pub line_total: u64,
    pub points_total: u64,
}

/// The whole system.
pub struct System {
    pub tenant: String,
    pub key: String,
    pub http: Client,
    pub api: Member,
    pub relays: Vec<Member>,
    /// Every consumer instance; the first `consumer_instances` are of the
    /// first kind, and so on.
    pub consumers: Vec<Member>,
    /// The private topic exchange the relays publish to.
    pub exchange: String,
    retries: AtomicU64,
    replays: AtomicU64,
    _topology: Vec<TopologyGuard>,
    _exchange: ExchangeGuard,
}

/// Deletes the system's private exchange when dropped.
struct ExchangeGuard(String);

impl Drop for ExchangeGuard {
    fn drop(&mut self) {
        let exchange = self.0.clone();
        let _ = std::thread::spawn(move || {
            if let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                runtime.block_on(async {
                    let connection = connect().await;
                    if let Ok(channel) = connection.create_channel().await {
                        let _ = channel
                            .exchange_delete(
                                exchange.as_str().into(),
                                ExchangeDeleteOptions::default(),
                            )
                            .await;
                    }
                    let _ = connection.close(200, "ok".into()).await;
                });
            }
        })
        .join();
    }
}

/// Declare the private exchange (as the relay does).
async fn declare_exchange(exchange: &str) {
    let connection = connect().await;
    let channel = connection.create_channel().await.expect("channel");
    kit::amqp::declare_topic_exchange(&channel, exchange)
        .await
        .expect("declare the private exchange");
    let _ = connection.close(200, "ok".into()).await;
}

/// Unbind consumer `name`'s hash exchange from `exchange` (`#`): the
/// relay's publishes become unroutable (returned, mandatory).
pub async fn unbind_consumer(name: &str, exchange: &str) {
    let connection = connect().await;
    let channel = connection.create_channel().await.expect("channel");
    channel
        .exchange_unbind(
            format!("{name}.events").as_str().into(),
            exchange.into(),
            "#".into(),
            ExchangeUnbindOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("unbind the consumer");
    let _ = connection.close(200, "ok".into()).await;
}

/// Bind consumer `name`'s hash exchange to `exchange` (everything: `#`).
pub async fn bind_consumer(name: &str, exchange: &str) {
    let connection = connect().await;
    let channel = connection.create_channel().await.expect("channel");
    channel
        .exchange_bind(
            format!("{name}.events").as_str().into(),
            exchange.into(),
            "#".into(),
            ExchangeBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("bind the consumer to the private exchange");
    let _ = connection.close(200, "ok".into()).await;
}

/// A deterministic pseudo-random sequence (no shared RNG state between tasks).
pub fn mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

/// Minor units as a two-place decimal string.
pub fn cents(minor: u64) -> String {
    format!("{}.{:02}", minor / 100, minor % 100)
}

/// The SKUs of the generated orders.
pub fn skus() -> Vec<String> {
    (0..20).map(|i| format!("SKU-{i:02}")).collect()
}

fn relay_env(tenant: &str, port: u16, extra: &[(String, String)]) -> Vec<(String, String)> {
    let mut env: Vec<(String, String)> = [
        ("OUTBOX_RELAY__HTTP__PORT", port.to_string()),
        ("OUTBOX_RELAY__RELAY__ONLY_TENANT", tenant.to_owned()),
        ("OUTBOX_RELAY__RELAY__POLL_INTERVAL_MS", "200".to_owned()),
        // A killed relay's leases are taken over quickly.
        ("OUTBOX_RELAY__RELAY__LEASE_MS", "6000".to_owned()),
        ("OUTBOX_RELAY__RELAY__CONFIRM_TIMEOUT_MS", "4000".to_owned()),
        ("OUTBOX_RELAY__RELAY__BACKOFF_BASE_MS", "100".to_owned()),
        ("OUTBOX_RELAY__RELAY__BACKOFF_CAP_MS", "2000".to_owned()),
        ("OUTBOX_RELAY__RELAY__MAX_ATTEMPTS", "1000".to_owned()),
        ("OUTBOX_RELAY__RELAY__METRICS_INTERVAL_MS", "500".to_owned()),
        ("OUTBOX_RELAY__CLEANUP__ENABLED", "false".to_owned()),
        ("RUST_LOG", "warn,lapin=error".to_owned()),
        ("LOG_FORMAT", "text".to_owned()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    for (k, v) in extra {
        env.retain(|(key, _)| key != k);
        env.push((k.clone(), v.clone()));
    }
    env
}

impl System {
    /// Start everything and wait until it is ready.
    pub async fn start(prefix: &str, options: SystemOptions) -> System {
        let tenant = unique_tenant(prefix);
        let key = api_key(&tenant);
        let exchange = format!("{tenant}.order-events");
        declare_exchange(&exchange).await;
        let exchange_guard = ExchangeGuard(exchange.clone());
        let mut relay_extra = vec![("OUTBOX_RELAY__RELAY__EXCHANGE".to_owned(), exchange.clone())];
        relay_extra.extend(options.relay_env.iter().cloned());
        let failpoint = |label: &str| -> String {
            options
                .failpoints
                .iter()
                .find(|(l, _)| l == label)
                .map(|(_, f)| f.clone())
                .unwrap_or_default()
        };

        let api_port = free_port();
        let mut api_env = vec![
            ("ORDER_API__HTTP__PORT".to_owned(), api_port.to_string()),
            ("RUST_LOG".to_owned(), "warn".to_owned()),
            ("LOG_FORMAT".to_owned(), "text".to_owned()),
        ];
        api_env.extend(options.api_env.iter().cloned());
        let api = Member::new(
            "order-api".into(),
            "order-api",
            None,
            "order-api".into(),
            api_port,
            api_env,
        );
        api.start(&failpoint("order-api"));

        let relays: Vec<Member> = (0..options.relays)
            .map(|i| {
                let port = free_port();
                Member::new(
                    format!("relay-{i}"),
                    "outbox-relay",
                    None,
                    format!("relay-{i}"),
                    port,
                    relay_env(&tenant, port, &relay_extra),
                )
            })
            .collect();
        if options.start_relays {
            for relay in &relays {
                relay.start(&failpoint(&relay.label));
            }
        }

        let mut consumers = Vec::new();
        let mut topology = Vec::new();
        for kind in [Kind::Inventory, Kind::Ledger, Kind::Loyalty] {
            let name = unique(&format!("ft-{}", &kind.binary()[..3]));
            // Not bound to order-events: to the private exchange below.
            let consumer_options = options.consumer_options.clone();
            topology.push(TopologyGuard::new(&name, &consumer_options));
            for i in 0..options.consumer_instances.max(1) {
                let port = free_port();
                let label = format!("{}-{i}", &kind.binary()[..kind.binary().len() - 9]);
                let member = Member::new(
                    label,
                    kind.binary(),
                    Some(kind),
                    name.clone(),
                    port,
                    consumer_env(kind, &name, port, &consumer_options),
                );
                member.start(&failpoint(&member.label));
                consumers.push(member);
            }
        }

        let system = System {
            tenant,
            key,
            http: Client::new(),
            api,
            relays,
            consumers,
            exchange,
            retries: AtomicU64::new(0),
            replays: AtomicU64::new(0),
            _topology: topology,
            _exchange: exchange_guard,
        };
        system.api.ready(Duration::from_secs(90)).await;
        for relay in system.relays.iter().filter(|r| r.running()) {
            relay.ready(Duration::from_secs(90)).await;
        }
        for consumer in &system.consumers {
            consumer.ready(Duration::from_secs(90)).await;
        }
        for consumer in system.consumers.iter().filter(|c| c.label.ends_with("-0")) {
            wait_for_topology(&consumer.name, options.consumer_options.tier_count()).await;
            bind_consumer(&consumer.name, &system.exchange).await;
        }
        system
    }

    /// Every member: order-api, relays, consumers.
    pub fn members(&self) -> Vec<&Member> {
        std::iter::once(&self.api)
            .chain(self.relays.iter())
            .chain(self.consumers.iter())
            .collect()
    }

    pub fn member(&self, label: &str) -> &Member {
        self.members()
            .into_iter()
            .find(|m| m.label == label)
            .unwrap_or_else(|| panic!("no member {label}"))
    }

    /// The first instance of consumer `kind`.
    pub fn consumer(&self, kind: Kind) -> &Member {
        self.consumers
            .iter()
            .find(|c| c.kind == Some(kind))
            .expect("consumer")
    }

    /// The invariant checker's scope: this tenant, these consumer names.
    pub fn scope(&self) -> Scope {
        let mut scope = Scope::tenant(&self.tenant);
        for kind in [Kind::Inventory, Kind::Ledger, Kind::Loyalty] {
            let checker_kind = match kind {
                Kind::Inventory => invariants::Kind::Inventory,
                Kind::Ledger => invariants::Kind::Ledger,
                Kind::Loyalty => invariants::Kind::Loyalty,
            };
            scope = scope.with_consumer(checker_kind, &self.consumer(kind).name);
        }
        scope
    }

    /// Run the checker until every invariant holds or `timeout`; the report,
    /// with the sampled duplicate figures filled in.
    pub async fn check(&self, timeout: Duration) -> invariants::Report {
        let mut report =
            invariants::check_until(&ops::drift::Databases::from_env(), &self.scope(), timeout)
                .await
                .expect("invariant checker");
        self.sample_all().await;
        report.duplicates_published = Some(
            self.relays
                .iter()
                .map(|r| RELAY_COUNTERS.iter().map(|c| r.sampled(c)).sum::<u64>())
                .sum(),
        );
        for summary in &mut report.consumers {
            summary.duplicates_suppressed = Some(
                self.consumers
                    .iter()
                    .filter(|c| c.name == summary.name)
                    .map(|c| CONSUMER_COUNTERS.iter().map(|n| c.sampled(n)).sum::<u64>())
                    .sum(),
            );
        }
        report
    }

    /// Sample the counters of every running relay and consumer.
    pub async fn sample_all(&self) {
        for relay in &self.relays {
            relay.sample(RELAY_COUNTERS).await;
        }
        for consumer in &self.consumers {
            consumer.sample(CONSUMER_COUNTERS).await;
        }
    }

    /// Assert that every invariant holds within `timeout`; returns the report.
    pub async fn assert_invariants(&self, timeout: Duration) -> invariants::Report {
        let report = self.check(timeout).await;
        println!("{}", report.render());
        assert!(
            report.is_clean(),
            "invariants violated:\n{}\n{}",
            report.render(),
            self.members_state()
        );
        report
    }

    /// Each member's process, port and starts: what a failed check is read
    /// against (a member that was not running relays or applies nothing).
    pub fn members_state(&self) -> String {
        self.members()
            .iter()
            .map(|member| {
                let state = match member.pid() {
                    Some(pid) if member.running() => format!("running (pid {pid})"),
                    Some(pid) => format!("exited (pid {pid})"),
                    None => "not started".to_owned(),
                };
                format!(
                    "  {} on port {}: {state}, started {} time(s)",
                    member.label,
                    member.port,
                    member.starts.load(Ordering::Relaxed)
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// One request, retried with the same key like a real client until it
    /// gets a definitive answer: connection failures (order-api down), 5xx
    /// and 409 `idempotency_in_progress` are retried with backoff.
    pub async fn post(&self, path: &str, key: &str, body: &Value) -> (StatusCode, bool, Value) {
        let deadline = Instant::now() + Duration::from_secs(600);
        let mut delay = Duration::from_millis(50);
        let mut attempt = 0;
        loop {
            attempt += 1;
            if attempt > 1 {
                self.retries.fetch_add(1, Ordering::Relaxed);
            }
            let outcome = self
                .http
                .post(format!("{}{path}", self.api.base_url()))
                .bearer_auth(&self.key)
                .header("Idempotency-Key", key)
                .json(body)
                .timeout(Duration::from_secs(30))
                .send()
                .await;
            let last = match outcome {
                Ok(response) => {
                    let status = response.status();
                    let replayed = response
                        .headers()
                        .get("Idempotent-Replayed")
                        .is_some_and(|v| v == "true");
                    let bytes = response.bytes().await.unwrap_or_default();
                    let value: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
                    let in_progress = status == StatusCode::CONFLICT
                        && value["code"] == "idempotency_in_progress";
                    if !(status.is_server_error() || in_progress) {
                        if replayed {
                            self.replays.fetch_add(1, Ordering::Relaxed);
                        }
                        return (status, replayed, value);
                    }
                    format!("{status}: {value}")
                }
                Err(error) => error.to_string(),
            };
            assert!(
                Instant::now() < deadline,
                "{path} ({key}): no definitive answer after {attempt} attempts: {last}"
            );
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(Duration::from_secs(2));
        }
    }

    /// A POST that must end in 201 (first time or replayed).
    pub async fn post_created(&self, path: &str, key: &str, body: &Value) -> Value {
        let (status, _, value) = self.post(path, key, body).await;
        assert_eq!(status, StatusCode::CREATED, "{path} ({key}): {value}");
        value
    }

    /// Receive `qty` of `sku` at WH-1 (inventory's receipts endpoint).
    pub async fn receive(&self, sku: &str, qty: i64) {
        self.receive_for(&self.tenant, sku, qty).await;
    }

    /// A stock receipt for another `tenant` (e.g. a benchmark's raw loop)
    /// through this system's inventory consumer.
    pub async fn receive_for(&self, tenant: &str, sku: &str, qty: i64) {
        let inventory = self.consumer(Kind::Inventory);
        let response = self
            .http
            .post(format!("{}/stock/receipts", inventory.base_url()))
            .bearer_auth(TEST_TOKEN)
            .header("X-Tenant-Id", tenant)
            .json(&json!({"receipt_id": format!("rcpt-{sku}"), "sku": sku, "location": "WH-1", "qty": qty}))
            .send()
            .await
            .expect("receipt");
        assert!(
            response.status().is_success(),
            "receipt: {}",
            response.status()
        );
    }

    /// Plenty of stock of every generated SKU.
    pub async fn stock_up(&self) {
        for sku in skus() {
            self.receive(&sku, 100_000_000).await;
        }
    }

    /// Order `i`: placed, paid and delivered (3 events), every request
    /// retried until definitive. Returns (lines, loyalty points).
    pub async fn order_flow(&self, i: u64) -> (u64, u64) {
        let plan = OrderPlan::new(i);
        let order = self
            .post_created("/orders", &plan.keys[0], &plan.order)
            .await;
        let id = order["order_id"].as_str().expect("order id").to_owned();
        self.post_created(
            &format!("/orders/{id}/payments"),
            &plan.keys[1],
            &plan.payment,
        )
        .await;
        self.post_created(
            &format!("/orders/{id}/deliveries"),
            &plan.keys[2],
            &plan.delivery,
        )
        .await;
        (plan.line_count, plan.points)
    }

    /// Orders `range`, `concurrency` at a time.
    pub async fn drive(&self, range: std::ops::Range<u64>, concurrency: usize) -> Traffic {
        let orders = range.end - range.start;
        let results: Vec<(u64, u64)> = stream::iter(range)
            .map(|i| self.order_flow(i))
            .buffer_unordered(concurrency)
            .collect()
            .await;
        Traffic {
            orders,
            retries: self.retries.load(Ordering::Relaxed),
            replays: self.replays.load(Ordering::Relaxed),
            line_total: results.iter().map(|r| r.0).sum(),
            points_total: results.iter().map(|r| r.1).sum(),
        }
    }

    /// Requests retried and replays seen so far (all traffic of this system).
    pub fn client_counts(&self) -> (u64, u64) {
        (
            self.retries.load(Ordering::Relaxed),
            self.replays.load(Ordering::Relaxed),
        )
    }
}

/// The deterministic requests of order `i`: 1-3 lines over [`skus`], a
/// customer out of 50, the payment of the exact total and the delivery of
/// every line, with their idempotency keys.
pub struct OrderPlan {
    /// Idempotency keys of the order, payment and delivery requests.
    pub keys: [String; 3],
    pub order: Value,
    pub payment: Value,
    pub delivery: Value,
    pub line_count: u64,
    /// Loyalty points the delivery earns (whole units of merchandise).
    pub points: u64,
}

impl OrderPlan {
    pub fn new(i: u64) -> Self {
        let skus = skus();
        let r = mix(i + 1);
        let line_count = 1 + r % 3;
        let mut lines = Vec::new();
        let mut merchandise = 0;
        for l in 0..line_count {
            let x = mix(r + l);
            let qty = 1 + x % 3;
            let price = 100 + x % 9_900;
            let cost = price / 2;
            merchandise += qty * price;
            let sku = &skus[(r + l * 7) as usize % skus.len()];
            lines.push(json!({"sku": sku, "qty": qty, "unit_price": cents(price), "unit_cost": cents(cost)}));
        }
        let (shipping, tax) = (r % 1_000, merchandise / 10);
        let total = merchandise + shipping + tax;
        let delivered: Vec<Value> = lines
            .iter()
            .map(|l| json!({"sku": l["sku"], "qty": l["qty"]}))
            .collect();
        Self {
            keys: [
                format!("order-{i}"),
                format!("pay-{i}"),
                format!("deliver-{i}"),
            ],
            order: json!({"customer_id": format!("c-{}", r % 50), "checkout_id": format!("chk-{i}"),
                          "lines": lines, "shipping": cents(shipping), "tax": cents(tax),
                          "currency": "USD", "location": "WH-1"}),
            payment: json!({"payment_id": format!("p-{i}"), "amount": cents(total), "method": "card"}),
            delivery: json!({"delivery_id": format!("d-{i}"), "lines": delivered}),
            line_count,
            points: merchandise / 100,
        }
    }
}

/// Whether `status` is a death by SIGABRT (a fail point's `abort()`), not
/// an exit or a caught panic.
pub fn aborted(status: &ExitStatus) -> bool {
    use std::os::unix::process::ExitStatusExt;
    status.signal() == Some(6)
}
