//! Phase 1: `POST /orders` at a fixed concurrency for a fixed time, and the
//! same transaction (the same statements, in the same order, one round
//! trip each, prepared once per connection) straight through tokio-postgres.
//! Each side runs as [`Run`]s that [`Run::then`] joins into one [`Load`].

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use serde::Serialize;
use serde_json::{json, Value};
use system_tests::system::{cents, mix, skus};
use tokio_postgres::types::Json;
use uuid::Uuid;

use order_api::idempotency::{CLAIM, STORE};
use order_api::operations::{INSERT_LINES, INSERT_ORDER, INSERT_OUTBOX};

use crate::stats::{ms, rate, Latency};

/// Bound on one request (HTTP) or one transaction (raw): past it the request
/// counts as an error (and the error counts show in the table and verdicts).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// A pooled connection idle this long is dropped, below actix-web's 5 s
/// keep-alive: reusing one the server is closing at that moment fails the
/// request (`IncompleteMessage`, one error in session 21's paced run).
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(2);

/// The bench's HTTP client: `REQUEST_TIMEOUT` per request, pooled
/// connections dropped after `POOL_IDLE_TIMEOUT`, at most `max_idle` kept.
fn http_client(max_idle: usize) -> reqwest::Client {
    reqwest::Client::builder()
        .pool_max_idle_per_host(max_idle)
        .pool_idle_timeout(POOL_IDLE_TIMEOUT)
        .timeout(REQUEST_TIMEOUT)
        .build()
        .expect("http client")
}

/// Print "`label`: N done after T" every 5 s until the returned guard is
/// dropped (a run's progress).
fn progress(
    label: &'static str,
    done: Arc<std::sync::atomic::AtomicU64>,
    started: Instant,
) -> crate::AbortOnDrop {
    crate::AbortOnDrop(tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(5)).await;
            println!(
                "  {label}: {} done after {:.0?}",
                done.load(std::sync::atomic::Ordering::Relaxed),
                started.elapsed()
            );
        }
    }))
}

/// One side of the comparison.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Load {
    pub requests: u64,
    pub errors: u64,
    pub seconds: f64,
    pub per_second: f64,
    pub latency: Latency,
    /// Requests started in each whole second of the run (for the chart).
    pub timeline: Vec<u64>,
}

/// A realistic order: 1-5 lines over 20 SKUs, deterministic from `i`.
pub fn order_body(i: u64) -> Value {
    let skus = skus();
    let r = mix(i + 1);
    let line_count = 1 + (r % 5) as usize;
    let mut lines = Vec::new();
    let mut merchandise = 0;
    for l in 0..line_count {
        let x = mix(r + l as u64);
        let qty = 1 + x % 3;
        let price = 100 + x % 9_900;
        merchandise += qty * price;
        lines.push(
            json!({"sku": skus[(r as usize + l * 7) % skus.len()], "qty": qty,
                          "unit_price": cents(price), "unit_cost": cents(price / 2)}),
        );
    }
    let (shipping, tax) = (r % 1_000, merchandise / 10);
    json!({"customer_id": format!("c-{}", r % 50), "checkout_id": format!("chk-{i}"),
           "lines": lines, "shipping": cents(shipping), "tax": cents(tax),
           "currency": "USD", "location": "WH-1"})
}

/// The completions of one timed run: per request, when it started (from the
/// run's start) and how long it took.
pub struct Run {
    samples: Vec<(Duration, Duration)>,
    errors: u64,
    elapsed: Duration,
}

impl Run {
    /// This run followed by `next`, as one run of both durations (`next`'s
    /// start times shifted by this run's length).
    pub fn then(mut self, next: Run) -> Run {
        let offset = self.elapsed;
        self.samples.extend(
            next.samples
                .into_iter()
                .map(|(at, latency)| (at + offset, latency)),
        );
        Run {
            samples: self.samples,
            errors: self.errors + next.errors,
            elapsed: self.elapsed + next.elapsed,
        }
    }

    pub fn load(self) -> Load {
        summarize(self.samples, self.errors, self.elapsed)
    }
}

fn summarize(samples: Vec<(Duration, Duration)>, errors: u64, elapsed: Duration) -> Load {
    let secs = elapsed.as_secs() as usize + 1;
    let mut timeline = vec![0; secs];
    for (at, _) in &samples {
        if let Some(slot) = timeline.get_mut(at.as_secs() as usize) {
            *slot += 1;
        }
    }
    let requests = samples.len() as u64;
    Load {
        requests,
        errors,
        seconds: elapsed.as_secs_f64(),
        per_second: rate(requests, elapsed),
        latency: Latency::of(samples.iter().map(|(_, l)| ms(*l)).collect()),
        timeline,
    }
}

/// `concurrency` clients posting orders back to back for `duration`.
/// Order numbers start at `first` (unique idempotency and checkout keys).
pub async fn http_load(
    base: &str,
    key: &str,
    first: u64,
    concurrency: usize,
    duration: Duration,
) -> Load {
    http_run(base, key, first, concurrency, duration)
        .await
        .load()
}

/// [`http_load`], as a [`Run`].
pub async fn http_run(
    base: &str,
    key: &str,
    first: u64,
    concurrency: usize,
    duration: Duration,
) -> Run {
    let client = http_client(concurrency);
    let next = Arc::new(std::sync::atomic::AtomicU64::new(first));
    let started = Instant::now();
    let deadline = started + duration;
    let done = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let _progress = progress("order-api", done.clone(), started);
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..concurrency {
        let (client, next, url, key, done) = (
            client.clone(),
            next.clone(),
            format!("{base}/orders"),
            key.to_owned(),
            done.clone(),
        );
        tasks.spawn(async move {
            let mut samples = Vec::new();
            let mut errors = 0;
            while Instant::now() < deadline {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let body = order_body(i);
                let sent = Instant::now();
                let response = client
                    .post(&url)
                    .bearer_auth(&key)
                    .header("Idempotency-Key", format!("bench-{i}"))
                    .json(&body)
                    .send()
                    .await;
                match response {
                    Ok(r) if r.status().as_u16() == 201 => {
                        let _ = r.bytes().await;
                        samples.push((sent - started, sent.elapsed()));
                        done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                    other => {
                        // The first failure of each client on stderr.
                        if errors == 0 {
                            eprintln!("order {i}: {:?}", other.map(|r| r.status()));
                        }
                        errors += 1;
                    }
                }
            }
            (samples, errors)
        });
    }
    let mut samples = Vec::new();
    let mut errors = 0;
    while let Some(result) = tasks.join_next().await {
        let (s, e) = result.expect("client task");
        samples.extend(s);
        errors += e;
    }
    Run {
        samples,
        errors,
        elapsed: started.elapsed(),
    }
}

/// Minor units of a decimal money string of the generated body.
fn minor(text: &Value) -> i64 {
    events::Money::parse(text.as_str().unwrap_or("0"))
        .map(|m| m.minor())
        .unwrap_or(0)
}

/// One create-order transaction, raw: BEGIN, claim the key, order, lines,
/// outbox row, store the response, COMMIT (7 round trips, like the API's).
/// The order's body and key are built before the caller's timer starts, as
/// the HTTP side's are; the fingerprint (the API hashes the request) and
/// everything after are timed.
async fn raw_order(
    client: &mut tokio_postgres::Client,
    statements: &[tokio_postgres::Statement; 5],
    tenant: &str,
    key: &str,
    body: &Value,
) -> Result<(), tokio_postgres::Error> {
    let fingerprint = blake_like(body);
    let tx = client.transaction().await?;
    // As order-api does: the request budget's statement timeout, sent in
    // the same write as the claim (crates/order-api/src/idempotency.rs).
    let (limited, claimed) = futures_util::future::join(
        tx.batch_execute("SET LOCAL statement_timeout = 10000"),
        tx.query_opt(
            &statements[0],
            &[&tenant, &"POST /orders", &key, &fingerprint, &86_400_i64],
        ),
    )
    .await;
    limited?;
    assert!(claimed?.is_some(), "raw keys are unique");
    let order_id = Uuid::now_v7();
    let lines = body["lines"].as_array().cloned().unwrap_or_default();
    let merchandise: i64 = lines
        .iter()
        .map(|l| l["qty"].as_i64().unwrap_or(0) * minor(&l["unit_price"]))
        .sum();
    let (shipping, tax) = (minor(&body["shipping"]), minor(&body["tax"]));
    let total = merchandise + shipping + tax;
    let checkout = body["checkout_id"].as_str().map(str::to_owned);
    let customer = body["customer_id"].as_str().unwrap_or_default().to_owned();
    let created_at: time::OffsetDateTime = tx
        .query_one(
            &statements[1],
            &[
                &order_id,
                &tenant,
                &customer,
                &checkout,
                &"USD",
                &"WH-1",
                &merchandise,
                &shipping,
                &tax,
                &total,
            ],
        )
        .await?
        .get(0);
    let line_nos: Vec<i32> = (1..=lines.len() as i32).collect();
    let skus: Vec<&str> = lines
        .iter()
        .map(|l| l["sku"].as_str().unwrap_or(""))
        .collect();
    let qtys: Vec<i32> = lines
        .iter()
        .map(|l| l["qty"].as_i64().unwrap_or(0) as i32)
        .collect();
    let prices: Vec<i64> = lines.iter().map(|l| minor(&l["unit_price"])).collect();
    let costs: Vec<i64> = lines.iter().map(|l| minor(&l["unit_cost"])).collect();
    tx.execute(
        &statements[2],
        &[&order_id, &line_nos, &skus, &qtys, &prices, &costs, &tenant],
    )
    .await?;
    let mut payload = body.clone();
    payload["order_id"] = json!(order_id);
    payload["total"] = json!(format!("{}.{:02}", total / 100, total % 100));
    let traceparent = Some(format!(
        "00-{}-{}-01",
        Uuid::new_v4().simple(),
        &Uuid::new_v4().simple().to_string()[..16]
    ));
    tx.execute(
        &statements[3],
        &[
            &Uuid::now_v7(),
            &tenant,
            &"order",
            &order_id.to_string(),
            &1_i64,
            &"OrderPlaced",
            &1_i32,
            &Json(&payload),
            &traceparent,
            &None::<String>,
            &created_at,
        ],
    )
    .await?;
    let mut view = payload;
    view["status"] = json!("placed");
    view["created_at"] = json!(created_at.unix_timestamp());
    let response = serde_json::to_vec(&view).unwrap_or_default();
    tx.execute(
        &statements[4],
        &[
            &tenant,
            &"POST /orders",
            &key,
            &201_i32,
            &response,
            &Some(order_id),
            &86_400_i64,
        ],
    )
    .await?;
    tx.commit().await
}

/// A request fingerprint of the same length as the API's (a blake3 hex digest).
fn blake_like(body: &Value) -> String {
    let text = body.to_string();
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in text.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
    }
    format!("{h:016x}").repeat(4)
}

/// How long a raw client waits after its connection closed before opening
/// another.
const RECONNECT_PAUSE: Duration = Duration::from_millis(200);

/// A connection of the raw loop, the transaction's statements prepared on it.
async fn raw_connection(
    url: &str,
) -> Result<(tokio_postgres::Client, [tokio_postgres::Statement; 5]), tokio_postgres::Error> {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls).await?;
    tokio::spawn(connection);
    // As order-api's sessions: the outbox insert does not NOTIFY from the
    // transaction (order-api wakes the relay after its COMMIT, from a
    // session of its own: part of the API's cost, not of the transaction).
    client
        .batch_execute(&format!("SET {} = off", order_api::wake::SETTING))
        .await?;
    let statements = [
        client.prepare(CLAIM).await?,
        client.prepare(INSERT_ORDER).await?,
        client.prepare(INSERT_LINES).await?,
        client.prepare(INSERT_OUTBOX).await?,
        client.prepare(STORE).await?,
    ];
    Ok((client, statements))
}

/// The same transaction at the same concurrency, one connection per client.
/// Order numbers start at `first`.
pub async fn raw_run(
    url: &str,
    tenant: &str,
    first: u64,
    concurrency: usize,
    duration: Duration,
) -> Run {
    let next = Arc::new(std::sync::atomic::AtomicU64::new(first));
    let mut clients = Vec::new();
    for _ in 0..concurrency {
        clients.push(raw_connection(url).await.expect("raw connection"));
    }
    // One transaction first: a raw loop whose statements are out of step
    // with order-api's (they are its constants) fails the run here, instead
    // of counting every transaction as an error and a 0 % ratio.
    if let Some((client, statements)) = clients.first_mut() {
        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (body, key) = (order_body(i), format!("raw-{i}"));
        if let Err(error) = raw_order(client, statements, tenant, &key, &body).await {
            panic!("the raw loop's transaction fails: {error:?}");
        }
    }
    let started = Instant::now();
    let deadline = started + duration;
    let done = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let _progress = progress("raw", done.clone(), started);
    let mut tasks = tokio::task::JoinSet::new();
    for (mut client, mut statements) in clients {
        let (next, tenant, done) = (next.clone(), tenant.to_owned(), done.clone());
        let url = url.to_owned();
        tasks.spawn(async move {
            let mut samples = Vec::new();
            let mut errors = 0;
            while Instant::now() < deadline {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let (body, key) = (order_body(i), format!("raw-{i}"));
                let sent = Instant::now();
                let order = raw_order(&mut client, &statements, &tenant, &key, &body);
                match tokio::time::timeout(REQUEST_TIMEOUT, order).await {
                    Ok(Ok(())) => {
                        samples.push((sent - started, sent.elapsed()));
                        done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                    Ok(Err(error)) => {
                        errors += 1;
                        eprintln!("raw order: {error}");
                        // A connection the database closed (a restart)
                        // fails every transaction at once: it is replaced,
                        // a moment after the failure, so that while the
                        // database is away the client tries a few times a
                        // second instead of erroring in a tight loop.
                        if client.is_closed() {
                            tokio::time::sleep(RECONNECT_PAUSE).await;
                            match raw_connection(&url).await {
                                Ok(fresh) => (client, statements) = fresh,
                                Err(error) => eprintln!("raw reconnect: {error}"),
                            }
                        }
                    }
                    Err(_) => {
                        // The connection is mid-transaction: this client
                        // stops (the error counts).
                        errors += 1;
                        eprintln!("raw order {i}: no answer in {REQUEST_TIMEOUT:?}");
                        break;
                    }
                }
            }
            (samples, errors)
        });
    }
    let mut samples = Vec::new();
    let mut errors = 0;
    while let Some(result) = tasks.join_next().await {
        let (s, e) = result.expect("raw task");
        samples.extend(s);
        errors += e;
    }
    Run {
        samples,
        errors,
        elapsed: started.elapsed(),
    }
}

/// An open-loop load: `per_second` orders started at even intervals for
/// `duration`, each on its own task (a slow answer does not slow the rate).
pub async fn paced_load(
    base: &str,
    key: &str,
    first: u64,
    per_second: f64,
    duration: Duration,
) -> Load {
    // (reqwest's default: no bound on idle connections.)
    let client = http_client(usize::MAX);
    let interval = Duration::from_secs_f64(1.0 / per_second.max(1.0));
    let started = Instant::now();
    let done = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let _progress = progress("paced order-api", done.clone(), started);
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut tasks = tokio::task::JoinSet::new();
    let mut i = first;
    while started.elapsed() < duration {
        ticker.tick().await;
        let (client, url, key, done) = (
            client.clone(),
            format!("{base}/orders"),
            key.to_owned(),
            done.clone(),
        );
        let n = i;
        i += 1;
        tasks.spawn(async move {
            let sent = Instant::now();
            let response = client
                .post(&url)
                .bearer_auth(&key)
                .header("Idempotency-Key", format!("bench-{n}"))
                .json(&order_body(n))
                .send()
                .await;
            match response {
                Ok(r) if r.status().as_u16() == 201 => {
                    let _ = r.bytes().await;
                    done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    Ok((sent - started, sent.elapsed()))
                }
                other => {
                    eprintln!("paced order {n}: {:?}", other.map(|r| r.status()));
                    Err(())
                }
            }
        });
    }
    let mut samples = Vec::new();
    let mut errors = 0;
    while let Some(result) = tasks.join_next().await {
        match result.expect("paced task") {
            Ok(s) => samples.push(s),
            Err(()) => errors += 1,
        }
    }
    summarize(samples, errors, started.elapsed())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(samples: &[(u64, u64)], errors: u64, elapsed_ms: u64) -> Run {
        Run {
            samples: samples
                .iter()
                .map(|&(at, took)| (Duration::from_millis(at), Duration::from_millis(took)))
                .collect(),
            errors,
            elapsed: Duration::from_millis(elapsed_ms),
        }
    }

    #[test]
    fn two_halves_make_one_run_of_both_lengths() {
        let first = run(&[(100, 10), (1_500, 20)], 1, 2_000);
        let second = run(&[(200, 30)], 2, 3_000);
        let joined = first.then(second);
        // The second half's start times follow the first half's length.
        let starts: Vec<u64> = joined
            .samples
            .iter()
            .map(|(at, _)| at.as_millis() as u64)
            .collect();
        assert_eq!(starts, vec![100, 1_500, 2_200]);
        assert_eq!(joined.errors, 3);
        assert_eq!(joined.elapsed, Duration::from_millis(5_000));
        let load = joined.load();
        assert_eq!(load.requests, 3);
        // 3 requests over 5 s, not over either half alone.
        assert!((load.per_second - 0.6).abs() < 1e-9, "{}", load.per_second);
        assert_eq!(load.timeline, vec![1, 1, 1, 0, 0, 0]);
    }
}
