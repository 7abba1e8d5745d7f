//! order-api over HTTP against the real binary and PostgreSQL: the idempotency
//! contract of seed 004, payments and deliveries, tenants, malformed input.
//! Every test uses its own tenant and counts that tenant's rows.

use std::time::Duration;
use system_tests::OutputWithin;

use reqwest::{Client, Response, StatusCode};
use serde_json::{json, Value};
use system_tests::{
    api_key, api_key_command, blocked_by, consumers::eventually, free_port, lock_table, pg,
    unique_tenant, Database, OrderApi, Service,
};

const SEED_ORDER: &str = r#"{"customer_id":"77","lines":[{"sku":"JKT-M","qty":2,"unit_price":"40.00","unit_cost":"22.00"}],"shipping":"5.00","tax":"8.00","total":"93.00","currency":"USD","location":"WH-1"}"#;
/// The seed order's payment (its exact total) and delivery (its one line).
const SEED_PAYMENT: &str = r#"{"payment_id":"9001","amount":"93.00","method":"card"}"#;
const SEED_DELIVERY: &str = r#"{"delivery_id":"311","lines":[{"sku":"JKT-M","qty":2}]}"#;

struct Caller {
    client: Client,
    key: String,
    tenant: String,
}

impl Caller {
    fn new(prefix: &str) -> Self {
        let tenant = unique_tenant(prefix);
        let key = api_key(&tenant);
        Self {
            client: Client::new(),
            key,
            tenant,
        }
    }

    /// A caller of a tenant whose key is in `database`.
    fn in_database(prefix: &str, database: &OwnOrdersDatabase) -> Self {
        let tenant = unique_tenant(prefix);
        let key = database.api_key(&tenant);
        Self {
            client: Client::new(),
            key,
            tenant,
        }
    }

    async fn post(&self, url: &str, idempotency_key: &str, body: &str) -> Response {
        self.client
            .post(url)
            .bearer_auth(&self.key)
            .header("Idempotency-Key", idempotency_key)
            .header("Content-Type", "application/json")
            .body(body.to_owned())
            .timeout(Duration::from_secs(30))
            .send()
            .await
            .expect("request")
    }

    async fn get(&self, url: &str) -> Response {
        self.client
            .get(url)
            .bearer_auth(&self.key)
            .send()
            .await
            .expect("request")
    }
}

impl Drop for Caller {
    /// No relay runs in these tests, so the tenant's outbox rows would stay
    /// pending for good in a shared development database, and every claim
    /// of a tenant-scoped relay (other tests, `make bench`) walks all
    /// pending rows. Deleted when the test is done (or has failed); its
    /// orders stay for a look.
    fn drop(&mut self) {
        let tenant = std::mem::take(&mut self.tenant);
        let _ = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            runtime.block_on(async {
                system_tests::delete_outbox_rows(
                    &pg(Database::Orders).await,
                    "DELETE FROM outbox_events WHERE tenant_id = $1 AND published_at IS NULL",
                    &[&tenant],
                )
                .await
            })
        })
        .join();
    }
}

#[derive(Debug, PartialEq, Eq)]
struct Counts {
    orders: i64,
    lines: i64,
    keys: i64,
    outbox: i64,
}

impl Counts {
    /// Nothing stored.
    const NOTHING: Counts = Counts {
        orders: 0,
        lines: 0,
        keys: 0,
        outbox: 0,
    };
    /// One order of the seed (one line), its key and its event.
    const ONE_ORDER: Counts = Counts {
        orders: 1,
        lines: 1,
        keys: 1,
        outbox: 1,
    };
}

async fn counts(tenant: &str) -> Counts {
    counts_in(&pg(Database::Orders).await, tenant).await
}

/// [`counts`] in the database of `client`.
async fn counts_in(client: &tokio_postgres::Client, tenant: &str) -> Counts {
    let row = client
        .query_one(
            "SELECT (SELECT count(*) FROM orders WHERE tenant_id = $1),
                    (SELECT count(*) FROM order_lines l JOIN orders o USING (order_id) WHERE o.tenant_id = $1),
                    (SELECT count(*) FROM idempotency_requests WHERE tenant_id = $1),
                    (SELECT count(*) FROM outbox_events WHERE tenant_id = $1)",
            &[&tenant],
        )
        .await
        .expect("counts");
    Counts {
        orders: row.get(0),
        lines: row.get(1),
        keys: row.get(2),
        outbox: row.get(3),
    }
}

async fn stored_body(tenant: &str, endpoint: &str, key: &str) -> Option<(String, i32, Vec<u8>)> {
    pg(Database::Orders)
        .await
        .query_opt(
            "SELECT request_fingerprint, response_status, response_body FROM idempotency_requests \
             WHERE tenant_id = $1 AND endpoint = $2 AND idempotency_key = $3",
            &[&tenant, &endpoint, &key],
        )
        .await
        .expect("read key")
        .map(|r| (r.get(0), r.get(1), r.get(2)))
}

async fn json_of(response: Response) -> (StatusCode, Value) {
    let status = response.status();
    let body = response.bytes().await.expect("body");
    let value = serde_json::from_slice(&body)
        .unwrap_or_else(|e| panic!("{status}: body is not JSON ({e}): {body:?}"));
    (status, value)
}

fn is_replay(response: &Response) -> bool {
    response
        .headers()
        .get("Idempotent-Replayed")
        .is_some_and(|v| v == "true")
}

/// Settings of a test whose requests wait on purpose (for a transaction of
/// the test's, on a slow machine): a lock wait of 20 s, within a request
/// budget of 29 s (the default 10 s budget would end them first; 29,749 ms
/// is the largest).
fn patient() -> Vec<(&'static str, String)> {
    patient_with(&[])
}

/// [`patient`] and `extra` settings.
fn patient_with(extra: &[(&'static str, String)]) -> Vec<(&'static str, String)> {
    let mut env = vec![
        (
            "ORDER_API__IDEMPOTENCY__LOCK_TIMEOUT_MS",
            "20000".to_owned(),
        ),
        (
            "ORDER_API__IDEMPOTENCY__REQUEST_BUDGET_MS",
            "29000".to_owned(),
        ),
    ];
    env.extend(extra.iter().cloned());
    env
}

/// Seed 004: fifty concurrent requests with one key make one order and one
/// event, and every loser waits for the owner's commit and replays its
/// result. With a lock wait (and pool wait) far longer than the owner's
/// transaction none gives up: fifty 201s, exactly one executed, the same
/// body and `Location` byte for byte (with the default 2 s wait a loaded
/// machine may answer some 409 idempotency_in_progress, which
/// `the_wait_for_an_in_flight_owner_is_bounded` covers).
#[tokio::test]
async fn fifty_concurrent_requests_with_one_key_make_one_order_and_one_event() {
    let api = OrderApi::start(&patient_with(&[(
        "ORDER_API__DATABASE__ACQUIRE_TIMEOUT_MS",
        "20000".to_owned(),
    )]))
    .await;
    let caller = std::sync::Arc::new(Caller::new("conc"));
    let before = key_metrics(&api, "POST /orders").await;
    let answers = fifty_with_one_key(&caller, &api.url("/orders"), false).await;
    one_order_from_one_key(&answers, &caller.tenant).await;
    assert_eq!(
        key_metrics(&api, "POST /orders").await - before,
        KeyMetrics {
            claims: 1,
            replays: 49,
            ..KeyMetrics::default()
        }
    );
}

/// [`fifty_concurrent_requests_with_one_key_make_one_order_and_one_event`]
/// with the shipped defaults (a 2 s wait for the key's owner, the default
/// pool): a loaded machine may tell some of the fifty to retry (an answer
/// with Retry-After), and they do, as clients are told to. Still one order
/// and one event, and every client ends with the same 201, byte for byte.
#[tokio::test]
async fn fifty_concurrent_requests_with_one_key_and_the_defaults_still_make_one_order() {
    let api = OrderApi::start(&[]).await;
    let caller = std::sync::Arc::new(Caller::new("conc-defaults"));
    let before = key_metrics(&api, "POST /orders").await;
    let answers = fifty_with_one_key(&caller, &api.url("/orders"), true).await;
    one_order_from_one_key(&answers, &caller.tenant).await;
    let delta = key_metrics(&api, "POST /orders").await - before;
    assert_eq!(delta.claims, 1, "one owner: {delta:?}");
    assert_eq!(
        delta.replays, 49,
        "every other client replayed once: {delta:?}"
    );
}

/// A committed order wakes the relay from order-api's wake-up session after
/// its COMMIT, not from the request's transaction (orders V18): a NOTIFY in
/// the transaction took PostgreSQL's notification-queue lock, one for the
/// whole cluster, through the commit's WAL flush, so every order-api commit
/// waited for the one before. Notifications arrive in commit order: one
/// from the request's session would come before the wake-up's. The
/// sessions are told apart by the `application_name` the database URL gives
/// (the wake-up session's is `<it> wake-up`). When the wake-up arrives, the
/// order's outbox row is visible.
#[tokio::test]
async fn an_order_wakes_the_relay_after_its_commit_from_a_session_of_its_own() {
    use futures_util::StreamExt;
    let name = format!("wake-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let url = system_tests::pg_url(Database::Orders);
    let separator = if url.contains('?') { '&' } else { '?' };
    // Each request held 1.5 s before its COMMIT: a wake-up sent before it
    // would come while the row is not visible yet.
    let api = OrderApi::start(&[
        (
            "ORDER_API__DATABASE__URL",
            format!("{url}{separator}application_name={name}"),
        ),
        ("FAILPOINTS", "order_api.committing=return(1500)".to_owned()),
    ])
    .await;
    let (listener, mut connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .expect("connect");
    let (senders, mut notified) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
        while let Some(Ok(message)) = messages.next().await {
            if let tokio_postgres::AsyncMessage::Notification(n) = message {
                let _ = senders.send(n.process_id());
            }
        }
    });
    listener
        .batch_execute("LISTEN outbox_events")
        .await
        .expect("listen");
    let caller = std::sync::Arc::new(Caller::new("wake"));
    // In flight while the notifications are read: the row is counted as
    // the wake-up arrives, not once the answer is in.
    let post = {
        let (caller, url) = (caller.clone(), api.url("/orders"));
        tokio::spawn(async move { caller.post(&url, "wake-1", SEED_ORDER).await.status() })
    };
    let db = pg(Database::Orders).await;
    let wake_up = format!("{name} wake-up");
    // Every notification until the wake-up session's (other tests' among
    // them), by the name of its sender's session (None: ended since).
    let mut seen = Vec::new();
    loop {
        let pid = tokio::time::timeout(Duration::from_secs(30), notified.recv())
            .await
            .unwrap_or_else(|_| panic!("no wake-up from {wake_up:?}; seen {seen:?}"))
            .expect("listening");
        let sender: Option<String> = db
            .query_opt(
                "SELECT application_name FROM pg_stat_activity WHERE pid = $1",
                &[&pid],
            )
            .await
            .expect("pg_stat_activity")
            .map(|row| row.get(0));
        if sender.as_deref() == Some(wake_up.as_str()) {
            let rows: i64 = db
                .query_one(
                    "SELECT count(*) FROM outbox_events WHERE tenant_id = $1",
                    &[&caller.tenant],
                )
                .await
                .expect("outbox")
                .get(0);
            assert_eq!(rows, 1, "the wake-up came after the COMMIT");
            break;
        }
        seen.push(sender);
    }
    assert_eq!(post.await.expect("the request"), StatusCode::CREATED);
    assert!(
        !seen.contains(&Some(name.clone())),
        "the request's transaction sent a NOTIFY: {seen:?}"
    );
}

/// Fifty concurrent `POST {url}` of the seed order with the key `same-key`:
/// their answers (status, replayed, Location, body). With `retry`, a client
/// told to retry (an answer with Retry-After) does, up to 30 times.
async fn fifty_with_one_key(
    caller: &std::sync::Arc<Caller>,
    url: &str,
    retry: bool,
) -> Vec<(StatusCode, bool, Option<String>, Vec<u8>)> {
    let mut tasks = Vec::new();
    for _ in 0..50 {
        let caller = caller.clone();
        let url = url.to_owned();
        tasks.push(tokio::spawn(async move {
            let mut tries = 0;
            loop {
                let response = caller.post(&url, "same-key", SEED_ORDER).await;
                tries += 1;
                let told_to_retry = header(&response, "Retry-After").is_some();
                if !retry || !told_to_retry || tries == 30 {
                    let status = response.status();
                    let replayed = is_replay(&response);
                    let location = header(&response, "Location").map(str::to_owned);
                    let body = response.bytes().await.expect("body").to_vec();
                    break (status, replayed, location, body);
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }));
    }
    let mut answers = Vec::new();
    for task in tasks {
        answers.push(task.await.expect("task"));
    }
    answers
}

/// The answers of concurrent requests with the key `same-key` (status,
/// replayed, Location, body): all 201, one executed and the others
/// replayed, one body and Location byte for byte, which is the response
/// stored; one order and one event in `tenant`.
async fn one_order_from_one_key(
    answers: &[(StatusCode, bool, Option<String>, Vec<u8>)],
    tenant: &str,
) {
    for (status, _, _, body) in answers {
        assert_eq!(
            *status,
            StatusCode::CREATED,
            "{}",
            String::from_utf8_lossy(body)
        );
    }
    let executed = answers.iter().filter(|a| !a.1).count();
    assert_eq!(executed, 1, "one owner, the others replayed");
    let (_, _, location, body) = &answers[0];
    assert!(location.is_some());
    assert!(
        answers.iter().all(|a| (&a.2, &a.3) == (location, body)),
        "every 201 must carry the same body and Location byte for byte"
    );
    assert_eq!(counts(tenant).await, Counts::ONE_ORDER);
    let (_, _, stored) = stored_body(tenant, "POST /orders", "same-key")
        .await
        .expect("stored");
    assert_eq!(&stored, body, "the stored response is what was sent");
}

#[tokio::test]
async fn same_key_different_request_is_rejected_and_changes_nothing() {
    let api = OrderApi::start(&[]).await;
    let caller = Caller::new("reuse");
    let metrics = key_metrics(&api, "POST /orders").await;
    let first = caller.post(&api.url("/orders"), "k1", SEED_ORDER).await;
    assert_eq!(first.status(), StatusCode::CREATED);
    let claimed = key_metrics(&api, "POST /orders").await;
    let before = stored_body(&caller.tenant, "POST /orders", "k1").await;

    let other = SEED_ORDER
        .replace("\"5.00\"", "\"6.00\"")
        .replace("\"93.00\"", "\"94.00\"");
    let (status, problem) = json_of(caller.post(&api.url("/orders"), "k1", &other).await).await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert_eq!(problem["code"], "idempotency_key_reused");
    assert_eq!(
        stored_body(&caller.tenant, "POST /orders", "k1").await,
        before
    );
    let after = key_metrics(&api, "POST /orders").await;
    assert_eq!(
        (claimed - metrics, after - claimed),
        (
            KeyMetrics {
                claims: 1,
                ..KeyMetrics::default()
            },
            KeyMetrics {
                conflicts: 1,
                ..KeyMetrics::default()
            }
        ),
        "the first executes; the reuse is counted as a conflict, nothing else"
    );
    assert_eq!(counts(&caller.tenant).await, Counts::ONE_ORDER);
}

#[tokio::test]
async fn field_order_whitespace_and_defaults_replay_the_same_order() {
    let api = OrderApi::start(&[]).await;
    let caller = Caller::new("canon");
    let first = caller.post(&api.url("/orders"), "k", SEED_ORDER).await;
    assert_eq!(first.status(), StatusCode::CREATED);
    let location = header(&first, "Location").map(str::to_owned);
    let first_body = first.bytes().await.expect("body");
    let order_id: uuid::Uuid = serde_json::from_slice::<Value>(&first_body).expect("json")
        ["order_id"]
        .as_str()
        .expect("order_id")
        .parse()
        .expect("uuid");
    // The created order's URL, and its id stored with the key.
    assert_eq!(location, Some(format!("/orders/{order_id}")));
    assert_eq!(
        stored_resource_id(&caller.tenant, "POST /orders", "k").await,
        Some(order_id)
    );
    let same = r#"{ "location":"WH-1", "currency":"USD", "checkout_id": null,
        "tax":"8.00", "shipping":"5.00",
        "lines":[{"unit_cost":"22.00","sku":"JKT-M","unit_price":"40.00","qty":2}],
        "customer_id":"77" }"#;
    let before = key_metrics(&api, "POST /orders").await;
    let replay = caller.post(&api.url("/orders"), "k", same).await;
    assert_eq!(replay.status(), StatusCode::CREATED);
    assert!(is_replay(&replay));
    assert_eq!(
        header(&replay, "Location"),
        location.as_deref(),
        "the replay names the same order"
    );
    assert_eq!(replay.bytes().await.expect("body"), first_body);
    assert_eq!(
        key_metrics(&api, "POST /orders").await - before,
        KeyMetrics {
            replays: 1,
            ..KeyMetrics::default()
        }
    );
    assert_eq!(counts(&caller.tenant).await.orders, 1);
}

/// POST `body` to `path` under `key` on `api`, whose armed fail point
/// aborts the process before it answers: no answer, the process aborted.
async fn lost_to_a_crash(api: &mut OrderApi, caller: &Caller, path: &str, key: &str, body: &str) {
    let lost = caller
        .client
        .post(api.url(path))
        .bearer_auth(&caller.key)
        .header("Idempotency-Key", key)
        .header("Content-Type", "application/json")
        .body(body.to_owned())
        .send()
        .await;
    assert!(
        lost.is_err(),
        "the process aborts before answering: {lost:?}"
    );
    let status = api
        .service
        .wait_exit(Duration::from_secs(10))
        .expect("the fail point aborts the process");
    assert!(system_tests::system::aborted(&status), "{status:?}");
}

#[tokio::test]
async fn a_crash_after_commit_before_the_response_is_replayed_on_retry() {
    let caller = Caller::new("crash-after");
    let mut api =
        OrderApi::start(&[("FAILPOINTS", "order_api.after_commit=return".to_owned())]).await;
    lost_to_a_crash(&mut api, &caller, "/orders", "retry-me", SEED_ORDER).await;
    // Committed: exactly one order, one outbox row, one key with the response.
    assert_eq!(counts(&caller.tenant).await, Counts::ONE_ORDER);
    let (_, stored_status, stored) = stored_body(&caller.tenant, "POST /orders", "retry-me")
        .await
        .expect("stored");
    assert_eq!(stored_status, 201);

    let api = OrderApi::start(&[]).await;
    let retry = caller
        .post(&api.url("/orders"), "retry-me", SEED_ORDER)
        .await;
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert!(is_replay(&retry), "the retry replays the committed order");
    assert_eq!(retry.bytes().await.expect("body").to_vec(), stored);
    assert_eq!(counts(&caller.tenant).await.orders, 1);
}

/// A session that cannot write for its life (one on a standby after a
/// failover: here fail point `order_api.session_read_only` makes one so,
/// once) fails its request with 503 `unavailable` (nothing stored; retry)
/// and is closed, not pooled: the retry under the same key gets another
/// session and places the order. Pooled, the worker's pool (the last
/// connection returned first) handed it to the next request every time:
/// 500 after 500.
#[tokio::test]
async fn a_session_that_cannot_write_answers_503_and_is_not_pooled() {
    let caller = Caller::new("read-only");
    let api = OrderApi::start(&[
        (
            "FAILPOINTS",
            "order_api.session_read_only=1*return".to_owned(),
        ),
        ("ORDER_API__HTTP__WORKERS", "1".to_owned()),
    ])
    .await;
    let failed = caller.post(&api.url("/orders"), "k", SEED_ORDER).await;
    assert_eq!(header(&failed, "Retry-After"), Some("1"));
    let (status, problem) = json_of(failed).await;
    assert_eq!(
        (status, problem["code"].as_str()),
        (StatusCode::SERVICE_UNAVAILABLE, Some("unavailable")),
        "{problem}"
    );
    assert_eq!(counts(&caller.tenant).await, Counts::NOTHING);
    for replay in [false, true] {
        let response = caller.post(&api.url("/orders"), "k", SEED_ORDER).await;
        assert_eq!(response.status(), StatusCode::CREATED, "replay {replay}");
        assert_eq!(is_replay(&response), replay);
    }
    assert_eq!(counts(&caller.tenant).await, Counts::ONE_ORDER);
}

/// The same crash on a payment, whose event takes the order's next
/// sequence under the order's row lock: committed once (one payment, one
/// PaymentReceived at sequence 2, the order's last sequence 2), and the
/// retry replays it byte for byte instead of paying or sequencing again.
#[tokio::test]
async fn a_payment_crashing_after_its_commit_is_replayed_and_sequenced_once() {
    let caller = Caller::new("crash-after-pay");
    let placing = OrderApi::start(&[]).await;
    let order = place_seed_order(&placing, &caller).await;
    drop(placing);
    let mut api =
        OrderApi::start(&[("FAILPOINTS", "order_api.after_commit=return".to_owned())]).await;
    let path = format!("/orders/{order}/payments");
    lost_to_a_crash(&mut api, &caller, &path, "pay-once", SEED_PAYMENT).await;
    let committed = || async {
        let db = pg(Database::Orders).await;
        let payments: i64 = db
            .query_one(
                "SELECT count(*) FROM payments WHERE tenant_id = $1",
                &[&caller.tenant],
            )
            .await
            .expect("payments")
            .get(0);
        let last: i64 = db
            .query_one(
                "SELECT last_event_sequence FROM orders WHERE tenant_id = $1",
                &[&caller.tenant],
            )
            .await
            .expect("order")
            .get(0);
        (payments, last, outbox_of(&order).await)
    };
    let expected = (
        1,
        2,
        vec![
            (1, "OrderPlaced".to_owned()),
            (2, "PaymentReceived".to_owned()),
        ],
    );
    assert_eq!(committed().await, expected);
    let (_, stored_status, stored) =
        stored_body(&caller.tenant, "POST /orders/{id}/payments", "pay-once")
            .await
            .expect("stored");
    assert_eq!(stored_status, 201);

    let api = OrderApi::start(&[]).await;
    let retry = caller.post(&api.url(&path), "pay-once", SEED_PAYMENT).await;
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert!(is_replay(&retry), "the retry replays the committed payment");
    assert_eq!(retry.bytes().await.expect("body").to_vec(), stored);
    assert_eq!(
        committed().await,
        expected,
        "nothing paid or sequenced again"
    );
}

#[tokio::test]
async fn a_transaction_rolled_back_before_commit_stores_nothing_and_the_key_works_again() {
    let caller = Caller::new("crash-before");
    let mut api =
        OrderApi::start(&[("FAILPOINTS", "order_api.before_commit=return".to_owned())]).await;
    let lost = caller
        .client
        .post(api.url("/orders"))
        .bearer_auth(&caller.key)
        .header("Idempotency-Key", "again")
        .header("Content-Type", "application/json")
        .body(SEED_ORDER)
        .send()
        .await;
    assert!(lost.is_err(), "{lost:?}");
    let status = api
        .service
        .wait_exit(Duration::from_secs(10))
        .expect("the fail point aborts the process");
    assert!(system_tests::system::aborted(&status), "{status:?}");
    assert_eq!(
        counts(&caller.tenant).await,
        Counts::NOTHING,
        "a rolled-back mutation leaves no order, no key and no outbox intent"
    );

    let api = OrderApi::start(&[]).await;
    let retry = caller.post(&api.url("/orders"), "again", SEED_ORDER).await;
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert!(!is_replay(&retry), "the retry is the first execution");
    assert_eq!(counts(&caller.tenant).await, Counts::ONE_ORDER);
}

/// A statement that fails between the order's rows and its outbox row (the
/// `order_api.before_outbox` fail point, once): the transaction is rolled
/// back in the process, nothing of the request stays, the answer is a
/// problem+json, and the same key then runs the request on the returned
/// connections.
#[tokio::test]
async fn an_error_between_the_order_and_its_outbox_row_rolls_everything_back() {
    let caller = Caller::new("err-before-outbox");
    let api =
        OrderApi::start(&[("FAILPOINTS", "order_api.before_outbox=1*return".to_owned())]).await;
    let failed = caller.post(&api.url("/orders"), "once", SEED_ORDER).await;
    assert_eq!(failed.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(failed.headers()["content-type"], "application/problem+json");
    let problem: Value = failed.json().await.expect("problem");
    assert_eq!(problem["code"], "internal_error", "{problem}");
    assert_eq!(
        counts(&caller.tenant).await,
        Counts::NOTHING,
        "no order, no line, no outbox intent and no key"
    );
    for (key, replay) in [("once", false), ("once", true), ("another", false)] {
        let retry = caller.post(&api.url("/orders"), key, SEED_ORDER).await;
        assert_eq!(retry.status(), StatusCode::CREATED, "{key}");
        assert_eq!(is_replay(&retry), replay, "{key}");
    }
    assert_eq!(counts(&caller.tenant).await.orders, 2);
}

/// The key's retention counts from the stored outcome, not from the
/// transaction's start: a transaction longer than `ttl_seconds` (here 12 s
/// against 10, within a 20 s request budget) commits a record that is still
/// live, and the retry of a lost response replays it instead of running the
/// order again. The retry has the whole 10 s to arrive, even on a slow machine.
#[tokio::test]
async fn a_transaction_longer_than_the_ttl_still_stores_a_live_key() {
    let api = OrderApi::start(&[
        ("ORDER_API__IDEMPOTENCY__TTL_SECONDS", "10".to_owned()),
        (
            "ORDER_API__IDEMPOTENCY__REQUEST_BUDGET_MS",
            "20000".to_owned(),
        ),
        (
            "FAILPOINTS",
            "order_api.before_outbox=1*sleep(12000)".to_owned(),
        ),
    ])
    .await;
    let caller = Caller::new("long-tx");
    let started = std::time::Instant::now();
    let first = caller.post(&api.url("/orders"), "slow", SEED_ORDER).await;
    assert_eq!(first.status(), StatusCode::CREATED);
    assert!(!is_replay(&first));
    assert!(
        started.elapsed() >= Duration::from_secs(12),
        "the transaction was not held past the TTL (the fail point did not sleep): \
         this shows nothing"
    );
    let retry = caller.post(&api.url("/orders"), "slow", SEED_ORDER).await;
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert!(
        is_replay(&retry),
        "the record committed after its claim's TTL is replayed, not taken over"
    );
    assert_eq!(counts(&caller.tenant).await, Counts::ONE_ORDER);
}

#[tokio::test]
async fn after_expiry_a_key_is_new_but_the_checkout_backstop_holds() {
    let api = OrderApi::start(&[
        ("ORDER_API__IDEMPOTENCY__TTL_SECONDS", "1".to_owned()),
        (
            "ORDER_API__IDEMPOTENCY__CLEANUP_INTERVAL_SECONDS",
            "1".to_owned(),
        ),
    ])
    .await;
    let caller = Caller::new("expiry");
    let with_checkout = SEED_ORDER.replace(
        "{\"customer_id\"",
        "{\"checkout_id\":\"chk-1042\",\"customer_id\"",
    );
    let first = caller
        .post(&api.url("/orders"), "old-key", &with_checkout)
        .await;
    assert_eq!(first.status(), StatusCode::CREATED);
    let plain = caller
        .post(&api.url("/orders"), "plain-key", SEED_ORDER)
        .await;
    assert_eq!(plain.status(), StatusCode::CREATED);

    // The background task deletes expired keys.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while counts(&caller.tenant).await.keys > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "expired keys not cleaned up"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The rest against an instance with the default TTL: a key stored from
    // here on must not expire before its replay (with 1 s a slow machine
    // let it).
    drop(api);
    let api = OrderApi::start(&[]).await;

    // Same key, same checkout: a new operation, stopped by the permanent backstop.
    let (status, problem) = json_of(
        caller
            .post(&api.url("/orders"), "old-key", &with_checkout)
            .await,
    )
    .await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert_eq!(problem["code"], "checkout_already_ordered");
    // The rejection is stored and replayed like any deterministic outcome.
    let replay = caller
        .post(&api.url("/orders"), "old-key", &with_checkout)
        .await;
    assert_eq!(replay.status(), StatusCode::CONFLICT);
    assert!(is_replay(&replay));
    // Without a checkout id the expired key simply orders again.
    let again = caller
        .post(&api.url("/orders"), "plain-key", SEED_ORDER)
        .await;
    assert_eq!(again.status(), StatusCode::CREATED);
    assert!(!is_replay(&again));
    let c = counts(&caller.tenant).await;
    assert_eq!((c.orders, c.outbox), (3, 3));
}

/// An orders database of this test's own (created, migrated by the
/// order-api it is given to, dropped when done): the expired-key cleanup
/// of every order-api deletes every tenant's expired keys, so only an
/// instance alone on its database counts exactly the rows a test expired;
/// and a lock held on it (the migration's, a table's) holds up no other
/// test.
struct OwnOrdersDatabase {
    name: String,
    url: String,
}

impl OwnOrdersDatabase {
    async fn create() -> Self {
        let (name, url) = system_tests::create_database(Database::Orders).await;
        Self { name, url }
    }

    async fn connect(&self) -> tokio_postgres::Client {
        system_tests::connect_url(&self.url).await
    }

    /// The API key of `tenant`, created in this database.
    fn api_key(&self, tenant: &str) -> String {
        let output = api_key_command(tenant)
            .env("ORDER_API__DATABASE__URL", &self.url)
            .output_within()
            .expect("api-key create");
        assert!(output.status.success(), "api-key create failed");
        String::from_utf8(output.stdout)
            .expect("utf-8")
            .trim()
            .to_owned()
    }
}

/// order-api on the database of `url` with a request budget of 3 s (long
/// enough for a test's probe to see a request wait on a lock before the
/// budget ends it, on a slow machine too) and a `lock_timeout` of 20 s (so
/// that only the budget ends such a wait), plus `extra`.
async fn budget_of_3_s(url: &str, extra: &[(&str, String)]) -> OrderApi {
    let mut env = vec![
        ("ORDER_API__DATABASE__URL", url.to_owned()),
        (
            "ORDER_API__IDEMPOTENCY__REQUEST_BUDGET_MS",
            "3000".to_owned(),
        ),
        (
            "ORDER_API__IDEMPOTENCY__LOCK_TIMEOUT_MS",
            "20000".to_owned(),
        ),
    ];
    env.extend(extra.iter().cloned());
    OrderApi::start(&env).await
}

impl Drop for OwnOrdersDatabase {
    fn drop(&mut self) {
        let name = self.name.clone();
        let _ = std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime")
                .block_on(system_tests::drop_database(Database::Orders, &name))
        })
        .join();
    }
}

/// The expired-key cleanup counts what it deletes
/// (`idempotency_expired_keys_deleted_total`) and what fails
/// (`idempotency_cleanup_failures_total`): while this test holds the table
/// locked, runs fail (each after `lock_timeout`), are counted, and delete
/// nothing; the next run after the lock is gone deletes the expired key.
/// Unexpired keys stay.
#[tokio::test]
async fn the_key_cleanup_counts_deleted_keys_and_failed_runs() {
    let database = OwnOrdersDatabase::create().await;
    let api = OrderApi::start(&[
        ("ORDER_API__DATABASE__URL", database.url.clone()),
        (
            "ORDER_API__IDEMPOTENCY__CLEANUP_INTERVAL_SECONDS",
            "1".to_owned(),
        ),
        ("ORDER_API__IDEMPOTENCY__LOCK_TIMEOUT_MS", "200".to_owned()),
    ])
    .await;
    let deleted = || api_metric(&api, "idempotency_expired_keys_deleted_total", None);
    let failures = || api_metric(&api, "idempotency_cleanup_failures_total", None);
    let last_success = || {
        api_metric(
            &api,
            "idempotency_cleanup_last_success_timestamp_seconds",
            None,
        )
    };
    let mut db = database.connect().await;
    let keys = "SELECT count(*) FROM idempotency_requests";
    // Rows as order-api stores them, three expired (in one statement: no
    // run can see some of them only) and one not.
    let expire = |n: i64, key: &'static str| {
        format!(
            "INSERT INTO idempotency_requests (tenant_id, endpoint, idempotency_key, \
               request_fingerprint, response_status, response_body, expires_at) \
             SELECT 'cleanup', 'POST /orders', '{key}-' || i, 'f', 201, '{{}}', \
                    now() - interval '1 second' FROM generate_series(1, {n}) i"
        )
    };
    let (deleted_before, failures_before) = (deleted().await, failures().await);
    db.batch_execute(&format!(
        "{}; INSERT INTO idempotency_requests (tenant_id, endpoint, idempotency_key, \
           request_fingerprint, expires_at) \
         VALUES ('cleanup', 'POST /orders', 'live', 'f', now() + interval '1 hour')",
        expire(3, "old")
    ))
    .await
    .expect("keys");
    eventually(
        "expired keys not deleted",
        Duration::from_secs(30),
        || async { (deleted().await >= deleted_before + 3).then_some(()) },
    )
    .await;
    let count: i64 = db.query_one(keys, &[]).await.expect("count").get(0);
    assert_eq!(count, 1, "the unexpired key stays");
    assert_eq!(
        deleted().await,
        deleted_before + 3,
        "each deleted key counted once"
    );
    assert_eq!(failures().await, failures_before);

    let tx = db.transaction().await.expect("begin");
    tx.batch_execute(&format!(
        "LOCK TABLE idempotency_requests IN ACCESS EXCLUSIVE MODE; {}",
        expire(1, "locked")
    ))
    .await
    .expect("lock");
    eventually(
        "failed runs not counted",
        Duration::from_secs(30),
        || async { (failures().await >= failures_before + 2).then_some(()) },
    )
    .await;
    assert_eq!(
        deleted().await,
        deleted_before + 3,
        "nothing deleted while failing"
    );
    // A failed run is not a success: the gauge stands still while they fail.
    let stalled_at = last_success().await;
    assert!(stalled_at > 0, "runs completed before the lock");
    eventually(
        "another failed run not counted",
        Duration::from_secs(30),
        || async { (failures().await >= failures_before + 3).then_some(()) },
    )
    .await;
    assert_eq!(last_success().await, stalled_at);
    tx.commit().await.expect("commit");
    eventually(
        "the cleanup did not recover",
        Duration::from_secs(30),
        || async { (deleted().await >= deleted_before + 4).then_some(()) },
    )
    .await;
    let count: i64 = db.query_one(keys, &[]).await.expect("count").get(0);
    assert_eq!(count, 1);
    assert!(
        last_success().await > stalled_at,
        "a completed run moves it"
    );
    drop(api);
}

/// A body that arrives slower than the request budget is answered at the
/// budget, 503 `deadline_exceeded`, nothing stored: the budget counts from
/// the request's start, reading included (before, the server waited on the
/// body as long as the client kept the connection open).
#[tokio::test]
async fn a_body_slower_than_the_budget_is_answered_at_the_budget() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let tenant = unique_tenant("budget-body");
    let api = OrderApi::start(&[(
        "ORDER_API__IDEMPOTENCY__REQUEST_BUDGET_MS",
        "1000".to_owned(),
    )])
    .await;
    let key = api_key(&tenant);
    let address = api.base.trim_start_matches("http://").to_owned();
    let mut stream = tokio::net::TcpStream::connect(&address)
        .await
        .expect("connect");
    let head = format!(
        "POST /orders HTTP/1.1\r\nHost: {address}\r\nAuthorization: Bearer {key}\r\n\
         Idempotency-Key: slow-body\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n",
        SEED_ORDER.len()
    );
    stream.write_all(head.as_bytes()).await.expect("head");
    // A tenth of the body, then nothing: the rest never comes.
    stream
        .write_all(&SEED_ORDER.as_bytes()[..SEED_ORDER.len() / 10])
        .await
        .expect("part of the body");
    let mut answer = Vec::new();
    let mut buf = [0_u8; 4096];
    let read = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let n = stream.read(&mut buf).await.expect("read");
            answer.extend_from_slice(&buf[..n]);
            if n == 0 || String::from_utf8_lossy(&answer).contains("deadline_exceeded") {
                break;
            }
        }
    })
    .await;
    let answer = String::from_utf8_lossy(&answer);
    assert!(read.is_ok(), "no answer within 30 s: {answer:?}");
    assert!(
        answer.starts_with("HTTP/1.1 503"),
        "want 503 deadline_exceeded: {answer:?}"
    );
    assert!(answer.contains("deadline_exceeded"), "{answer:?}");
    assert_eq!(counts(&tenant).await, Counts::NOTHING);
}

/// A stop lets the requests in flight finish within their budget: a POST
/// held 13 s before its COMMIT (its budget 20 s, within the 23 s a stop lets
/// requests finish), the stop asked while it is
/// held, is answered 201 and committed more than 10 s after the stop, and
/// then the process stops cleanly. Before, a stop cut the requests still
/// running after 10 s whatever their budget: the client saw the connection
/// reset and the order rolled back. (The stop comes as soon as the hold is
/// seen, a poll after it began, so the answer comes about 13 s after it;
/// the work before the hold may take up to 6 s and the COMMIT still goes
/// out within the budget.)
/// On a database of its own, so that the probe sees only this POST.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_lets_a_request_in_flight_finish_within_its_budget() {
    let database = OwnOrdersDatabase::create().await;
    let tenant = unique_tenant("stop-drain");
    let key = database.api_key(&tenant);
    let log = std::env::temp_dir().join(format!("{tenant}.log"));
    let mut api = OrderApi::start_with_output(
        &[
            ("ORDER_API__DATABASE__URL", database.url.clone()),
            (
                "FAILPOINTS",
                "order_api.committing=return(13000)".to_owned(),
            ),
            (
                "ORDER_API__IDEMPOTENCY__REQUEST_BUDGET_MS",
                "20000".to_owned(),
            ),
            ("RUST_LOG", "info".to_owned()),
            ("LOG_FORMAT", "json".to_owned()),
        ],
        Some(&log),
    )
    .await;
    let observer = database.connect().await;
    let post = Client::new()
        .post(api.url("/orders"))
        .bearer_auth(&key)
        .header("Idempotency-Key", "drain-me")
        .header("Content-Type", "application/json")
        .body(SEED_ORDER)
        .timeout(Duration::from_secs(40))
        .send();
    let stop = async {
        // Held: its work done (the last statement stored the response),
        // COMMIT not yet sent.
        eventually(
            "the POST's transaction held before COMMIT",
            Duration::from_secs(6),
            || async {
                observer
                    .query_opt(
                        "SELECT 1 FROM pg_stat_activity
                          WHERE datname = current_database() AND state = 'idle in transaction'
                            AND query LIKE '%SET response_status%'",
                        &[],
                    )
                    .await
                    .expect("activity")
            },
        )
        .await;
        api.service.signal("TERM");
        std::time::Instant::now()
    };
    let (response, stopped) = tokio::join!(post, stop);
    let response = response.expect("an answer, not a reset");
    assert_eq!(response.status(), StatusCode::CREATED);
    assert!(
        stopped.elapsed() > Duration::from_secs(10),
        "answered {:?} after the stop: not past the old 10 s cut, so this shows nothing",
        stopped.elapsed()
    );
    assert_eq!(counts_in(&observer, &tenant).await, Counts::ONE_ORDER);
    let status = api
        .service
        .wait_exit(Duration::from_secs(30))
        .expect("stopped after answering");
    assert!(status.success(), "{status:?}");
    let output = system_tests::take_log(&log);
    let errors = system_tests::error_lines(&output);
    assert!(errors.is_empty(), "error lines: {errors:#?}");
    drop(observer);
}

/// Bytes no HTTP request can hold (`Content-Length: abc`, a chunked body
/// with a length too) are refused 400 by actix's own parser, before any
/// route runs, and log no ERROR line: before, each such connection logged
/// `stream error: request parse error` at ERROR (target
/// `actix_http::h1::dispatcher`), so any client could fill the logs with
/// ERROR lines at will. The service goes on serving.
#[tokio::test]
async fn requests_that_break_http_framing_are_refused_without_error_lines() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let log = std::env::temp_dir().join(format!("{}.log", unique_tenant("framing")));
    let api = OrderApi::start_with_output(
        &[
            ("RUST_LOG", "info".to_owned()),
            ("LOG_FORMAT", "json".to_owned()),
        ],
        Some(&log),
    )
    .await;
    let address = api.base.trim_start_matches("http://").to_owned();
    for head in [
        "POST /orders HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
        "POST /orders HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\
         Content-Length: 5\r\n\r\nx",
        "GET /healthz HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
    ] {
        let mut stream = tokio::net::TcpStream::connect(&address)
            .await
            .expect("connect");
        stream.write_all(head.as_bytes()).await.expect("write");
        let mut answer = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut answer))
            .await
            .expect("answered and closed within 10 s")
            .expect("read");
        let answer = String::from_utf8_lossy(&answer);
        assert!(answer.starts_with("HTTP/1.1 400"), "{head:?}: {answer:?}");
    }
    let health = reqwest::get(api.url("/healthz")).await.expect("healthz");
    assert!(health.status().is_success(), "still serving");
    drop(api);
    let output = system_tests::take_log(&log);
    let errors = system_tests::error_lines(&output);
    assert!(errors.is_empty(), "error lines: {errors:#?}");
}

/// order-api with a request budget of 3 s behind a pausable proxy in front
/// of a database of its own: one HTTP worker, so every request gets the
/// connection the last one used; the caller's key read once (a GET) and
/// cached, so a partition does not hold up its lookup; `extra` settings on
/// top. Fields drop in order: the service before the proxy and the
/// database.
struct BehindProxy {
    api: OrderApi,
    proxy: system_tests::PausableProxy,
    database: OwnOrdersDatabase,
    tenant: String,
    key: String,
    client: Client,
}

impl BehindProxy {
    async fn start(tenant: &str, extra: &[(&str, String)]) -> Self {
        let database = OwnOrdersDatabase::create().await;
        let proxy = system_tests::PausableProxy::start(&database.url).await;
        let mut settings = vec![
            ("ORDER_API__AUTH__KEY_CACHE_MS", "600000".to_owned()),
            ("ORDER_API__HTTP__WORKERS", "1".to_owned()),
        ];
        settings.extend(extra.iter().cloned());
        let api = budget_of_3_s(&proxy.url, &settings).await;
        let tenant = unique_tenant(tenant);
        let key = database.api_key(&tenant);
        let client = Client::new();
        let get = client
            .get(api.url(&format!("/orders/{}", uuid::Uuid::now_v7())))
            .bearer_auth(&key)
            .send()
            .await
            .expect("get");
        assert_eq!(
            get.status(),
            StatusCode::NOT_FOUND,
            "the key read and cached"
        );
        Self {
            api,
            proxy,
            database,
            tenant,
            key,
            client,
        }
    }

    /// POST the seed order under `idempotency_key` (waiting up to 30 s).
    fn post(
        &self,
        idempotency_key: &str,
    ) -> impl std::future::Future<Output = reqwest::Result<Response>> {
        self.client
            .post(self.api.url("/orders"))
            .bearer_auth(&self.key)
            .header("Idempotency-Key", idempotency_key)
            .header("Content-Type", "application/json")
            .body(SEED_ORDER)
            .timeout(Duration::from_secs(30))
            .send()
    }
}

/// Wait (up to 30 s) until the server process `pid` has ended, as
/// `observer` sees it: its connection was closed, not pooled.
async fn backend_gone(observer: &tokio_postgres::Client, pid: i32, what: &str) {
    eventually(what, Duration::from_secs(30), || async {
        observer
            .query_opt("SELECT 1 FROM pg_stat_activity WHERE pid = $1", &[&pid])
            .await
            .expect("pg_stat_activity")
            .is_none()
            .then_some(())
    })
    .await;
}

/// Assert a request started at `started` was answered within 10 s (its
/// budget is 3 s), not when the database answered again.
fn answered_at_the_budget(started: std::time::Instant, what: &str) {
    let waited = started.elapsed();
    assert!(
        waited < Duration::from_secs(10),
        "{what}: answered after {waited:?} (budget 3 s)"
    );
}

/// A POST whose database stops answering (a network partition: the proxy
/// in front of it holds every byte, the cancel request's included) is
/// answered at its budget, 503 `deadline_exceeded`, nothing stored: when
/// BEGIN gets no answer, and when the claim, waiting on a lock, gets none
/// (the server's `statement_timeout` ends it, but its error is held too).
/// Before, both waited until the database answered again (TCP gives up on
/// nothing here: the proxy's end acknowledges every byte), past the budget
/// the client was promised an answer within.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_post_whose_database_stops_answering_is_answered_at_the_budget() {
    let system = BehindProxy::start("partition", &[]).await;
    let (proxy, database, tenant) = (&system.proxy, &system.database, &system.tenant);
    let post = |idempotency_key| system.post(idempotency_key);

    // BEGIN gets no answer.
    proxy.pause();
    let started = std::time::Instant::now();
    let response = post("partition-begin")
        .await
        .expect("an answer before the database answers again");
    answered_at_the_budget(started, "BEGIN");
    expect_problem(
        response,
        StatusCode::SERVICE_UNAVAILABLE,
        "deadline_exceeded",
    )
    .await;
    proxy.resume();

    // The claim waits on a lock, then the database stops answering.
    let mut holder = database.connect().await;
    let tx = holder.transaction().await.expect("begin");
    let holder_pid = lock_table(&tx, "idempotency_requests").await;
    let observer = database.connect().await;
    let started = std::time::Instant::now();
    let partitioned = async {
        blocked_by(&observer, holder_pid).await;
        proxy.pause();
    };
    let (response, ()) = tokio::join!(post("partition-claim"), partitioned);
    let response = response.expect("an answer before the database answers again");
    answered_at_the_budget(started, "the claim");
    expect_problem(
        response,
        StatusCode::SERVICE_UNAVAILABLE,
        "deadline_exceeded",
    )
    .await;
    tx.rollback().await.expect("rollback");
    proxy.resume();

    // Nothing stored; the service goes on.
    assert_eq!(counts_in(&observer, tenant).await, Counts::NOTHING);
    let response = post("partition-after").await.expect("post");
    assert_eq!(response.status(), StatusCode::CREATED, "served again");
    assert_eq!(counts_in(&observer, tenant).await, Counts::ONE_ORDER);
}

/// A POST whose COMMIT gets no answer (the database partitioned away just
/// before it is sent: the proxy holds it) is answered at its budget, 503
/// `unavailable` saying the outcome is unknown, counted as such (not as a
/// rollback), and its connection is closed, not pooled. Once the partition
/// heals the held COMMIT arrives and commits: the retry under the same key
/// replays the stored response, and exactly one order exists. Before, the
/// POST waited until the database answered again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_post_whose_commit_gets_no_answer_is_answered_at_the_budget() {
    // Each POST waits 5 s just before its COMMIT: the window in which the
    // test partitions the database away (wide, for a slow machine), within
    // a budget of 8 s.
    let system = BehindProxy::start(
        "partition-commit",
        &[
            ("FAILPOINTS", "order_api.committing=return(5000)".to_owned()),
            (
                "ORDER_API__IDEMPOTENCY__REQUEST_BUDGET_MS",
                "8000".to_owned(),
            ),
        ],
    )
    .await;
    let (api, proxy, database, tenant) =
        (&system.api, &system.proxy, &system.database, &system.tenant);
    let post = || system.post("partition-commit");
    let before = key_metrics(api, "POST /orders").await;
    let observer = database.connect().await;
    let started = std::time::Instant::now();
    let partitioned = async {
        // The owner's work is done (its last statement stored the response)
        // and COMMIT not yet sent: held there. Between two statements of the
        // work the session is idle in a transaction too, so the state alone
        // would not say where it is.
        let held = eventually(
            "the POST's transaction idle before COMMIT",
            Duration::from_secs(10),
            || async {
                observer
                    .query_opt(
                        "SELECT pid FROM pg_stat_activity
                         WHERE datname = current_database() AND state = 'idle in transaction'
                           AND query LIKE '%SET response_status%'",
                        &[],
                    )
                    .await
                    .expect("activity")
                    .map(|row| row.get::<_, i32>(0))
            },
        )
        .await;
        // The session shows idle before its answer to the STORE has left
        // the server: let it pass the proxy (the hold lasts 5 s).
        tokio::time::sleep(Duration::from_secs(1)).await;
        proxy.pause();
        held
    };
    let (response, held) = tokio::join!(post(), partitioned);
    let response = response.expect("an answer before the database answers again");
    // At its budget (8 s and the backstop), not when the partition heals
    // (after the answer: the client would wait for its 30 s timeout).
    let waited = started.elapsed();
    assert!(
        waited < Duration::from_secs(20),
        "COMMIT: answered after {waited:?} (budget 8 s)"
    );
    let problem = expect_problem(response, StatusCode::SERVICE_UNAVAILABLE, "unavailable").await;
    assert!(
        problem["detail"]
            .as_str()
            .is_some_and(|detail| detail.contains("the outcome is unknown")),
        "{problem}"
    );
    assert_eq!(
        counts_in(&observer, tenant).await,
        Counts::NOTHING,
        "the COMMIT is held by the partition"
    );

    // The partition heals: the held COMMIT arrives and commits, and the
    // session ends (order-api closed the connection rather than pool it).
    proxy.resume();
    eventually(
        "the held COMMIT committed",
        Duration::from_secs(10),
        || async { (counts_in(&observer, tenant).await == Counts::ONE_ORDER).then_some(()) },
    )
    .await;
    backend_gone(&observer, held, "the held session closed, not pooled").await;
    assert_eq!(
        key_metrics(api, "POST /orders").await - before,
        KeyMetrics::default(),
        "an unknown outcome is no rollback"
    );
    assert_eq!(
        api_metric(
            api,
            "idempotency_commit_outcome_unknown_total",
            Some("POST /orders")
        )
        .await,
        1
    );
    let response = post().await.expect("retry");
    assert_eq!(response.status(), StatusCode::CREATED);
    assert!(is_replay(&response), "the stored response replayed");
    assert_eq!(counts_in(&observer, tenant).await, Counts::ONE_ORDER);
}

/// Reads before a request's transaction (the caller's key, a GET's order)
/// end at the request budget as the transaction does: behind a table locked
/// past it, the answer is 503 `deadline_exceeded` at about the budget, not
/// 503 `unavailable` after `lock_timeout` (20 s here). The cancelled
/// connections are closed, not pooled: the next request is served.
#[tokio::test]
async fn reads_before_the_transaction_end_at_the_request_budget() {
    let database = OwnOrdersDatabase::create().await;
    let api = budget_of_3_s(
        &database.url,
        &[("ORDER_API__AUTH__KEY_CACHE_MS", "0".to_owned())],
    )
    .await;
    let key = database.api_key(&unique_tenant("budget-read"));
    let client = Client::new();
    let get = || {
        client
            .get(api.url(&format!("/orders/{}", uuid::Uuid::now_v7())))
            .bearer_auth(&key)
            .timeout(Duration::from_secs(60))
            .send()
    };
    assert_eq!(get().await.expect("get").status(), StatusCode::NOT_FOUND);
    let observer = database.connect().await;
    for table in ["api_keys", "orders"] {
        let mut db = database.connect().await;
        let tx = db.transaction().await.expect("begin");
        let holder = lock_table(&tx, table).await;
        let blocked = blocked_by(&observer, holder);
        let (response, blocked) = tokio::join!(get(), blocked);
        let response = response.expect("get");
        // At the budget: `lock_timeout` (20 s) ending the wait would answer
        // `unavailable`, not `deadline_exceeded`.
        expect_problem(
            response,
            StatusCode::SERVICE_UNAVAILABLE,
            "deadline_exceeded",
        )
        .await;
        // The cancelled read's connection is closed, not pooled (its
        // backend ends while the lock is still held).
        backend_gone(&observer, blocked, "the cancelled read's connection closed").await;
        tx.rollback().await.expect("rollback");
        assert_eq!(
            get().await.expect("get").status(),
            StatusCode::NOT_FOUND,
            "{table}: served again once the lock is gone"
        );
    }
}

#[tokio::test]
async fn tenants_are_isolated_even_with_the_same_bare_key() {
    let api = OrderApi::start(&[]).await;
    let a = Caller::new("tenant-a");
    let b = Caller::new("tenant-b");
    let (status, order_a) = json_of(a.post(&api.url("/orders"), "shared", SEED_ORDER).await).await;
    assert_eq!(status, StatusCode::CREATED);
    // B uses the same bare key with the same body: its own new order, not A's replay.
    let response_b = b.post(&api.url("/orders"), "shared", SEED_ORDER).await;
    assert!(!is_replay(&response_b));
    let (status, order_b) = json_of(response_b).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_ne!(order_a["order_id"], order_b["order_id"]);
    // Another tenant with the same bare key and a different body: not A's
    // fingerprint (no 409 idempotency_key_reused), its own new order.
    let c = Caller::new("tenant-c");
    let other_body = SEED_ORDER.replace("\"customer_id\":\"77\"", "\"customer_id\":\"78\"");
    assert_ne!(other_body, SEED_ORDER);
    let response_c = c.post(&api.url("/orders"), "shared", &other_body).await;
    assert!(!is_replay(&response_c));
    let (status, order_c) = json_of(response_c).await;
    assert_eq!(status, StatusCode::CREATED, "{order_c}");
    assert_ne!(order_c["order_id"], order_a["order_id"]);
    assert_eq!(counts(&c.tenant).await.orders, 1);

    let a_id = order_a["order_id"].as_str().expect("id");
    let own = a.get(&api.url(&format!("/orders/{a_id}"))).await;
    assert_eq!(own.status(), StatusCode::OK);
    let (status, problem) = json_of(b.get(&api.url(&format!("/orders/{a_id}"))).await).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(problem["code"], "order_not_found");
    // B cannot pay A's order either.
    let (status, problem) = json_of(
        b.post(
            &api.url(&format!("/orders/{a_id}/payments")),
            "pay",
            SEED_PAYMENT,
        )
        .await,
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(problem["code"], "order_not_found");
    assert_eq!(counts(&a.tenant).await.orders, 1);
    assert_eq!(counts(&b.tenant).await.orders, 1);
}

/// The endpoint is part of a key's scope (seed 004: `(tenant_id, endpoint,
/// idempotency_key)`): one key on POST /orders, then on the order's payment,
/// then on its delivery, in one tenant, is three operations, each executed
/// (none the replay of another endpoint's response), with a record each.
#[tokio::test]
async fn one_key_on_three_endpoints_is_three_operations() {
    let api = OrderApi::start(&[]).await;
    let caller = Caller::new("scope");
    let placed = caller.post(&api.url("/orders"), "same", SEED_ORDER).await;
    assert!(!is_replay(&placed));
    let (status, order) = json_of(placed).await;
    assert_eq!(status, StatusCode::CREATED, "{order}");
    let id = order["order_id"].as_str().expect("id");
    for (path, body, event) in [
        ("payments", SEED_PAYMENT, "PaymentReceived"),
        ("deliveries", SEED_DELIVERY, "ParcelDelivered"),
    ] {
        let response = caller
            .post(&api.url(&format!("/orders/{id}/{path}")), "same", body)
            .await;
        assert!(!is_replay(&response), "{path}: executed, not replayed");
        let (status, answer) = json_of(response).await;
        assert_eq!(status, StatusCode::CREATED, "{path}: {answer}");
        assert_ne!(answer, order, "{path}: not the order's response");
        assert_eq!(
            outbox_of(id).await.last().map(|e| e.1.as_str()),
            Some(event)
        );
    }
    let records: Vec<(String, i32)> = pg(Database::Orders)
        .await
        .query(
            "SELECT endpoint, response_status FROM idempotency_requests \
              WHERE tenant_id = $1 AND idempotency_key = 'same' ORDER BY endpoint",
            &[&caller.tenant],
        )
        .await
        .expect("records")
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        records,
        [
            "POST /orders",
            "POST /orders/{id}/deliveries",
            "POST /orders/{id}/payments"
        ]
        .map(|e| (e.to_owned(), 201))
    );
    assert_eq!(outbox_of(id).await.len(), 3);
    assert_eq!(effects(&caller.tenant).await, (1, 1));
}

/// A replay returns the original result (seed 004), as the API documents:
/// the stored 201 of POST /orders is the order as created, so after the
/// payment its replay still says `placed`, byte for byte, while GET
/// /orders/{id} has the live state.
#[tokio::test]
async fn a_create_replay_after_a_payment_is_the_creation_snapshot() {
    let api = OrderApi::start(&[]).await;
    let caller = Caller::new("snapshot");
    let first = caller.post(&api.url("/orders"), "o", SEED_ORDER).await;
    assert_eq!(first.status(), StatusCode::CREATED);
    let first_body = first.bytes().await.expect("body");
    let order: Value = serde_json::from_slice(&first_body).expect("json");
    assert_eq!(order["status"], "placed");
    let id = order["order_id"].as_str().expect("id");
    let paid = caller
        .post(
            &api.url(&format!("/orders/{id}/payments")),
            "p",
            SEED_PAYMENT,
        )
        .await;
    assert_eq!(paid.status(), StatusCode::CREATED);

    let replay = caller.post(&api.url("/orders"), "o", SEED_ORDER).await;
    assert_eq!(replay.status(), StatusCode::CREATED);
    assert!(is_replay(&replay));
    assert_eq!(replay.bytes().await.expect("body"), first_body);
    let (status, live) = json_of(caller.get(&api.url(&format!("/orders/{id}"))).await).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(live["status"], "paid", "{live}");
    assert_eq!(live["payment"]["payment_id"], "9001", "{live}");
    assert!(live.get("delivery").is_none(), "{live}");
    let doc: Value = reqwest::get(api.url("/openapi.json"))
        .await
        .expect("openapi")
        .json()
        .await
        .expect("json");
    let documented = doc["paths"]["/orders"]["post"]["responses"]["201"]["description"]
        .as_str()
        .expect("201 description");
    assert!(
        documented.contains("snapshot") && documented.contains("GET /orders/{id}"),
        "{documented}"
    );
}

/// With order-api's spans turned off (`OTEL_TRACES_FILTER=off`) its
/// operation span records no context: the outbox row stores the caller's
/// own `traceparent` and `tracestate`, so the events still continue the
/// caller's trace (it stored none before); an invalid one is not stored.
/// Two `tracestate` fields are stored as one list, in order (W3C).
#[tokio::test]
async fn without_its_own_spans_the_api_stores_the_caller_s_trace_context() {
    let api = OrderApi::start(&[("OTEL_TRACES_FILTER", "off".to_owned())]).await;
    let caller = Caller::new("trace-off");
    let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let post = |key: &'static str, traceparent: &'static str| {
        caller
            .client
            .post(api.url("/orders"))
            .bearer_auth(&caller.key)
            .header("Idempotency-Key", key)
            .header("Content-Type", "application/json")
            .header("traceparent", traceparent)
            .header("tracestate", "vendor=1")
            .header("tracestate", "other=2")
            .body(SEED_ORDER)
            .timeout(Duration::from_secs(30))
            .send()
    };
    let valid = post("t-valid", traceparent).await.expect("request");
    assert_eq!(valid.status(), StatusCode::CREATED);
    let invalid = post("t-invalid", "00-zz-00f067aa0ba902b7-01")
        .await
        .expect("request");
    assert_eq!(invalid.status(), StatusCode::CREATED);
    let stored = pg(Database::Orders)
        .await
        .query(
            "SELECT traceparent, tracestate FROM outbox_events WHERE tenant_id = $1 \
             ORDER BY occurred_at",
            &[&caller.tenant],
        )
        .await
        .expect("outbox rows");
    let stored: Vec<(Option<String>, Option<String>)> =
        stored.iter().map(|r| (r.get(0), r.get(1))).collect();
    assert_eq!(
        stored,
        vec![
            (
                Some(traceparent.to_owned()),
                Some("vendor=1,other=2".to_owned())
            ),
            (None, None)
        ]
    );
}

#[tokio::test]
async fn payments_and_deliveries_follow_the_order_and_number_its_events() {
    let api = OrderApi::start(&[]).await;
    let caller = Caller::new("flow");
    let id = place_seed_order(&api, &caller).await;
    let pay_url = api.url(&format!("/orders/{id}/payments"));
    let deliver_url = api.url(&format!("/orders/{id}/deliveries"));
    let delivery = SEED_DELIVERY;
    let payment = SEED_PAYMENT;

    // Delivering an unpaid order: 409, not stored (the payment may still
    // come), so the same key is free for the same delivery later.
    for _ in 0..2 {
        let early = caller.post(&deliver_url, "d", delivery).await;
        assert!(!is_replay(&early), "never stored, never replayed");
        let (status, problem) = json_of(early).await;
        assert_eq!(
            (status, problem["code"].as_str()),
            (StatusCode::CONFLICT, Some("order_not_paid"))
        );
    }

    // Wrong amount, wrong currency.
    expect_problem(
        caller
            .post(&pay_url, "p-wrong", &payment.replace("93.00", "90.00"))
            .await,
        StatusCode::UNPROCESSABLE_ENTITY,
        "amount_mismatch",
    )
    .await;
    expect_problem(
        caller
            .post(
                &pay_url,
                "p-eur",
                &payment.replace("\"method\"", "\"currency\":\"EUR\",\"method\""),
            )
            .await,
        StatusCode::UNPROCESSABLE_ENTITY,
        "currency_mismatch",
    )
    .await;

    // The payment, then its replay.
    let first = caller.post(&pay_url, "p", payment).await;
    assert_eq!(first.status(), StatusCode::CREATED);
    let first_body = first.bytes().await.expect("body");
    let replay = caller.post(&pay_url, "p", payment).await;
    assert!(is_replay(&replay));
    assert_eq!(replay.bytes().await.expect("body"), first_body);
    // The retry spells out the default currency (the order's): the same
    // request, replayed, not 409 idempotency_key_reused.
    let explicit = payment.replace("\"method\"", "\"currency\":\"USD\",\"method\"");
    let replay = caller.post(&pay_url, "p", &explicit).await;
    assert_eq!(replay.status(), StatusCode::CREATED);
    assert!(is_replay(&replay));
    assert_eq!(replay.bytes().await.expect("body"), first_body);
    expect_problem(
        caller
            .post(&pay_url, "p", &payment.replace("card", "cash"))
            .await,
        StatusCode::CONFLICT,
        "idempotency_key_reused",
    )
    .await;
    // The same payment again under another key (its first key lost or
    // expired) is told apart from another payment of the order: both 409
    // order_already_paid naming the payment the order has.
    let again = expect_problem(
        caller.post(&pay_url, "p-second", payment).await,
        StatusCode::CONFLICT,
        "order_already_paid",
    )
    .await;
    assert_eq!(again["payment_id"], "9001", "{again}");
    assert!(
        again["detail"]
            .as_str()
            .is_some_and(|d| d.starts_with("the order is paid by this payment (payment_id 9001)")),
        "{again}"
    );
    let other = expect_problem(
        caller
            .post(&pay_url, "p-other", &payment.replace("9001", "9002"))
            .await,
        StatusCode::CONFLICT,
        "order_already_paid",
    )
    .await;
    assert_eq!(other["payment_id"], "9001", "{other}");
    assert!(
        other["detail"]
            .as_str()
            .is_some_and(|d| d.starts_with("the order is paid by payment_id 9001;")),
        "{other}"
    );

    // Lines must match the order.
    let (status, problem) = json_of(
        caller
            .post(
                &deliver_url,
                "d-short",
                &delivery.replace("\"qty\":2", "\"qty\":1"),
            )
            .await,
    )
    .await;
    assert_eq!(
        (status, problem["code"].as_str()),
        (
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("delivery_lines_mismatch")
        )
    );
    // The key that was refused before the payment runs the delivery now.
    let delivered = caller.post(&deliver_url, "d", delivery).await;
    assert_eq!(delivered.status(), StatusCode::CREATED);
    assert!(!is_replay(&delivered));
    let delivered_body = delivered.bytes().await.expect("body");
    // The retry splits the SKU over two lines: the same delivery, replayed.
    let split =
        r#"{"delivery_id":"311","lines":[{"sku":"JKT-M","qty":1},{"sku":"JKT-M","qty":1}]}"#;
    let replay = caller.post(&deliver_url, "d", split).await;
    assert_eq!(replay.status(), StatusCode::CREATED);
    assert!(is_replay(&replay));
    assert_eq!(replay.bytes().await.expect("body"), delivered_body);
    expect_problem(
        caller.post(&deliver_url, "d-again", delivery).await,
        StatusCode::CONFLICT,
        "order_already_delivered",
    )
    .await;

    let (status, view) = json_of(caller.get(&api.url(&format!("/orders/{id}"))).await).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(view["status"], "delivered");
    // The order names its payment and its delivery (a client reconciling a
    // lost answer finds which provider payment paid it).
    assert_eq!(
        view["payment"],
        json!({"payment_id": "9001", "method": "card", "amount": "93.00"}),
        "{view}"
    );
    assert_eq!(view["delivery"]["delivery_id"], "311", "{view}");
    assert!(view["delivery"]["delivered_at"].is_string(), "{view}");

    // Exactly three events, numbered 1, 2, 3, with the seed's payloads.
    let rows = pg(Database::Orders)
        .await
        .query(
            "SELECT aggregate_sequence, event_type, payload FROM outbox_events \
             WHERE aggregate_id = $1 ORDER BY aggregate_sequence",
            &[&id],
        )
        .await
        .expect("outbox");
    let events: Vec<(i64, String, Value)> = rows
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    assert_eq!(events.len(), 3, "{events:?}");
    assert_eq!((events[0].0, events[0].1.as_str()), (1, "OrderPlaced"));
    assert_eq!((events[1].0, events[1].1.as_str()), (2, "PaymentReceived"));
    assert_eq!((events[2].0, events[2].1.as_str()), (3, "ParcelDelivered"));
    assert_eq!(events[0].2["total"], "93.00");
    assert_eq!(
        events[0].2["lines"],
        json!([{"sku":"JKT-M","qty":2,"unit_price":"40.00","unit_cost":"22.00"}])
    );
    assert_eq!(events[1].2["amount"], "93.00");
    assert_eq!(events[1].2["method"], "card");
    assert_eq!(events[2].2["lines"], json!([{"sku":"JKT-M","qty":2}]));
    // Each event decodes with the wire contract.
    for (sequence, event_type, payload) in &events {
        let envelope = json!({
            "event_id": uuid::Uuid::now_v7(), "event_type": event_type, "schema_version": 1,
            "tenant_id": caller.tenant, "aggregate_type": "order", "aggregate_id": id,
            "aggregate_sequence": sequence, "occurred_at": "2026-01-01T00:00:00Z", "payload": payload,
        });
        let raw = events::Envelope::parse_raw(envelope.to_string().as_bytes()).expect("envelope");
        raw.decode().unwrap_or_else(|e| panic!("{event_type}: {e}"));
    }
}

#[tokio::test]
async fn malformed_input_gets_a_clear_4xx_and_writes_nothing() {
    let api = OrderApi::start(&[]).await;
    let caller = Caller::new("bad");
    let client = Client::new();
    let url = api.url("/orders");
    let bad_bodies: &[(&str, String, u16, &str)] = &[
        (
            "float money",
            SEED_ORDER.replace("\"40.00\"", "40.0"),
            400,
            "lines[0].unit_price",
        ),
        (
            "bad scale",
            SEED_ORDER.replace("\"40.00\"", "\"40.0\""),
            400,
            "lines[0].unit_price",
        ),
        (
            "overflow",
            SEED_ORDER.replace("\"40.00\"", "\"92233720368547758.08\""),
            400,
            "lines[0].unit_price",
        ),
        (
            "qty 0",
            SEED_ORDER.replace("\"qty\":2", "\"qty\":0"),
            422,
            "lines[0].qty",
        ),
        (
            "qty negative",
            SEED_ORDER.replace("\"qty\":2", "\"qty\":-2"),
            400,
            "lines[0].qty",
        ),
        (
            "no lines",
            SEED_ORDER.replace(
                r#"[{"sku":"JKT-M","qty":2,"unit_price":"40.00","unit_cost":"22.00"}]"#,
                "[]",
            ),
            422,
            "lines",
        ),
        (
            "unsupported currency",
            SEED_ORDER.replace("USD", "XYZ"),
            400,
            "currency",
        ),
        (
            "wrong total",
            SEED_ORDER.replace("\"93.00\"", "\"90.00\""),
            422,
            "total",
        ),
        (
            "missing field",
            SEED_ORDER.replace(",\"location\":\"WH-1\"", ""),
            400,
            "body",
        ),
        (
            "unknown field",
            SEED_ORDER.replace("\"tax\"", "\"taxes\""),
            400,
            "taxes",
        ),
        (
            // 86 Devanagari letters: 258 bytes of UTF-8 (the rule counts
            // bytes; the inventory's receipts check the same `events::name`).
            "location over 255 bytes",
            SEED_ORDER.replace(
                "\"location\":\"WH-1\"",
                &format!("\"location\":\"{}\"", "\u{915}".repeat(86)),
            ),
            422,
            "location",
        ),
        ("not json", "{not json".to_owned(), 400, "body"),
        ("empty", String::new(), 400, "body"),
        (
            "huge line total",
            SEED_ORDER
                .replace("\"qty\":2", "\"qty\":1000000")
                .replace("\"40.00\"", "\"92233720368547.75\""),
            422,
            "lines[0]",
        ),
        (
            "101 lines",
            SEED_ORDER.replace(
                r#"[{"sku":"JKT-M","qty":2,"unit_price":"40.00","unit_cost":"22.00"}]"#,
                &format!(
                    "[{}]",
                    vec![r#"{"sku":"JKT-M","qty":1,"unit_price":"0.00","unit_cost":"0.00"}"#; 101]
                        .join(",")
                ),
            ),
            422,
            "lines",
        ),
        (
            "qty over the limit",
            SEED_ORDER.replace("\"qty\":2", "\"qty\":1000001"),
            422,
            "lines[0].qty",
        ),
        (
            "control character in a sku",
            SEED_ORDER.replace("JKT-M", "JKT\\nM"),
            422,
            "lines[0].sku",
        ),
        (
            "sku ending in white space",
            SEED_ORDER.replace("JKT-M", "JKT-M "),
            422,
            "lines[0].sku",
        ),
        (
            "customer id of white space alone",
            SEED_ORDER.replace("\"77\"", "\"   \""),
            422,
            "customer_id",
        ),
        (
            "invisible character in a checkout id",
            SEED_ORDER.replace(
                "{\"customer_id\"",
                "{\"checkout_id\":\"chk-1\\u200B\",\"customer_id\"",
            ),
            422,
            "checkout_id",
        ),
    ];
    // The same checks on a delivery (before the order is looked up: this
    // one does not exist).
    let delivery_url = api.url(&format!("/orders/{}/deliveries", uuid::Uuid::now_v7()));
    let bad_deliveries: &[(&str, String, &str)] = &[
        (
            "delivery of 101 lines",
            format!(
                r#"{{"delivery_id":"311","lines":[{}]}}"#,
                vec![r#"{"sku":"JKT-M","qty":1}"#; 101].join(",")
            ),
            "lines",
        ),
        (
            "delivery qty over the limit",
            SEED_DELIVERY.replace("\"qty\":2", "\"qty\":1000001"),
            "lines[0].qty",
        ),
        (
            "delivery sku with a control character",
            SEED_DELIVERY.replace("JKT-M", "JKT\\nM"),
            "lines[0].sku",
        ),
        (
            "delivery id with a zero-width space",
            SEED_DELIVERY.replace("\"311\"", "\"311\\u200B\""),
            "delivery_id",
        ),
    ];
    for (what, body, field) in bad_deliveries {
        let (got, problem) = json_of(
            caller
                .post(
                    &delivery_url,
                    &format!("k-{}", what.replace(' ', "-")),
                    body,
                )
                .await,
        )
        .await;
        assert_eq!(
            (got.as_u16(), problem["field"].as_str()),
            (422, Some(*field)),
            "{what}: {problem}"
        );
    }
    for (what, body, status, field) in bad_bodies {
        let (got, problem) = json_of(
            caller
                .post(&url, &format!("k-{}", what.replace(" ", "-")), body)
                .await,
        )
        .await;
        assert_eq!(got.as_u16(), *status, "{what}: {problem}");
        let got_field = problem["field"].as_str().unwrap_or_default();
        assert!(
            got_field.starts_with(field),
            "{what}: field {got_field}, want {field}"
        );
        assert!(
            problem["detail"].as_str().is_some_and(|d| !d.is_empty()),
            "{what}: {problem}"
        );
    }

    let post = |key: Option<&str>, auth: Option<&str>, content_type: &str| {
        let mut request = client
            .post(&url)
            .header("Content-Type", content_type.to_owned())
            .body(SEED_ORDER);
        if let Some(key) = key {
            request = request.header("Idempotency-Key", key.to_owned());
        }
        if let Some(auth) = auth {
            request = request.bearer_auth(auth.to_owned());
        }
        request.send()
    };
    let long_key = "k".repeat(256);
    // (what, Idempotency-Key, API key, content type, status, code)
    type Case<'a> = (
        &'a str,
        Option<&'a str>,
        Option<&'a str>,
        &'a str,
        u16,
        &'a str,
    );
    let cases: Vec<Case> = vec![
        (
            "no key",
            None,
            Some(&caller.key),
            "application/json",
            400,
            "invalid_idempotency_key",
        ),
        (
            "empty key",
            Some(""),
            Some(&caller.key),
            "application/json",
            400,
            "invalid_idempotency_key",
        ),
        (
            "long key",
            Some(&long_key),
            Some(&caller.key),
            "application/json",
            400,
            "invalid_idempotency_key",
        ),
        (
            "space in key",
            Some("a b"),
            Some(&caller.key),
            "application/json",
            400,
            "invalid_idempotency_key",
        ),
        (
            "no auth",
            Some("k"),
            None,
            "application/json",
            401,
            "unauthorized",
        ),
        (
            "bad auth",
            Some("k"),
            Some("oek_nope"),
            "application/json",
            401,
            "unauthorized",
        ),
        (
            "form body",
            Some("k"),
            Some(&caller.key),
            "application/x-www-form-urlencoded",
            415,
            "unsupported_media_type",
        ),
    ];
    for (what, key, auth, content_type, status, code) in cases {
        let response = post(key, auth, content_type).await.expect("request");
        assert_eq!(
            response
                .headers()
                .get("content-type")
                .and_then(|v| v.to_str().ok()),
            Some("application/problem+json"),
            "{what}"
        );
        let (got, problem) = json_of(response).await;
        assert_eq!(
            (got.as_u16(), problem["code"].as_str()),
            (status, Some(code)),
            "{what}"
        );
    }
    let (status, problem) = json_of(caller.get(&api.url("/orders/not-a-uuid")).await).await;
    assert_eq!(
        (status.as_u16(), problem["code"].as_str()),
        (400, Some("invalid_request"))
    );
    let (status, problem) = json_of(
        caller
            .get(&api.url(&format!("/orders/{}", uuid::Uuid::now_v7())))
            .await,
    )
    .await;
    assert_eq!(
        (status.as_u16(), problem["code"].as_str()),
        (404, Some("order_not_found"))
    );
    let (status, _) = json_of(client.delete(&url).send().await.expect("delete")).await;
    assert_eq!(status.as_u16(), 405);

    assert_eq!(
        counts(&caller.tenant).await,
        Counts::NOTHING,
        "no malformed request may store anything"
    );
}

/// A name the stricter rule of new requests refuses (white space at an end,
/// an invisible character) is refused only once the key holds no stored
/// record of the request: a request an earlier release took with such a
/// name, its response lost, still replays under its key byte for byte
/// (refused before the lookup, the retry got 422 "nothing stored" for an
/// order that exists, and a retry under a new key would place it again).
#[tokio::test]
async fn a_name_the_stricter_rule_refuses_still_replays_what_an_earlier_release_stored() {
    let api = OrderApi::start(&[]).await;
    let caller = Caller::new("legacy-name");
    let url = api.url("/orders");
    let padded = SEED_ORDER.replace("JKT-M", "JKT-M ");
    // As the earlier release stored it: the record under the request's
    // fingerprint, with its response.
    let fingerprint =
        order_api::request::parse::<order_api::request::CreateOrderRequest>(padded.as_bytes())
            .expect("parse")
            .validate()
            .expect("valid by the earlier rule")
            .fingerprint();
    let earlier_body = br#"{"order_id":"stored-by-an-earlier-release"}"#.to_vec();
    pg(Database::Orders)
        .await
        .execute(
            "INSERT INTO idempotency_requests (tenant_id, endpoint, idempotency_key, \
               request_fingerprint, response_status, response_body, expires_at) \
             VALUES ($1, 'POST /orders', 'legacy', $2, 201, $3, now() + interval '1 hour')",
            &[&caller.tenant, &fingerprint, &earlier_body],
        )
        .await
        .expect("the earlier release's record");
    let replay = caller.post(&url, "legacy", &padded).await;
    assert_eq!(replay.status(), StatusCode::CREATED);
    assert!(is_replay(&replay), "a replay");
    assert_eq!(
        replay.bytes().await.expect("body").as_ref(),
        &earlier_body[..]
    );
    // Another body under that key: the key's, as ever.
    let reused = caller.post(&url, "legacy", SEED_ORDER).await;
    expect_problem(reused, StatusCode::CONFLICT, "idempotency_key_reused").await;
    // A new key: refused, nothing stored, the key left free.
    let (status, problem) = json_of(caller.post(&url, "fresh", &padded).await).await;
    assert_eq!(
        (status, problem["code"].as_str(), problem["field"].as_str()),
        (
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("validation_failed"),
            Some("lines[0].sku")
        ),
        "{problem}"
    );
    assert_eq!(
        stored_body(&caller.tenant, "POST /orders", "fresh").await,
        None
    );
    let placed = caller.post(&url, "fresh", SEED_ORDER).await;
    assert_eq!(
        placed.status(),
        StatusCode::CREATED,
        "the key was left free"
    );
    // A checkout an earlier release ordered under such an id: named under a
    // new key as the order path names it (409 and the order), not refused
    // (a client trimming the id then would order the checkout again).
    let with_checkout =
        |checkout: &str| SEED_ORDER.replacen('{', &format!("{{\"checkout_id\":\"{checkout}\","), 1);
    let (status, first) = json_of(caller.post(&url, "chk", &with_checkout("chk-9")).await).await;
    assert_eq!(status, StatusCode::CREATED, "{first}");
    let order_id = first["order_id"].as_str().expect("order id").to_owned();
    pg(Database::Orders)
        .await
        .execute(
            "UPDATE orders SET checkout_id = 'chk-9 ' WHERE order_id = $1::text::uuid",
            &[&order_id],
        )
        .await
        .expect("as an earlier release stored it");
    let again = caller
        .post(&url, "chk-again", &with_checkout("chk-9 "))
        .await;
    assert_eq!(
        again
            .headers()
            .get("Location")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned),
        Some(format!("/orders/{order_id}"))
    );
    let problem = expect_problem(again, StatusCode::CONFLICT, "checkout_already_ordered").await;
    assert_eq!(problem["order_id"], order_id.as_str(), "{problem}");
    assert_eq!(
        stored_body(&caller.tenant, "POST /orders", "chk-again").await,
        None
    );
}

#[tokio::test]
async fn the_openapi_document_lists_the_real_endpoints() {
    let api = OrderApi::start(&[]).await;
    let doc: Value = reqwest::get(api.url("/openapi.json"))
        .await
        .expect("openapi")
        .json()
        .await
        .expect("json");
    assert_eq!(doc["openapi"], "3.1.0");
    for (path, method) in [
        ("/orders", "post"),
        ("/orders/{id}", "get"),
        ("/orders/{id}/payments", "post"),
        ("/orders/{id}/deliveries", "post"),
    ] {
        assert!(
            doc["paths"][path][method].is_object(),
            "{method} {path} missing"
        );
    }
    // The headers the handlers send are declared: each 201 names its order
    // (Location), and each response a key can replay may say so.
    for path in [
        "/orders",
        "/orders/{id}/payments",
        "/orders/{id}/deliveries",
    ] {
        let responses = &doc["paths"][path]["post"]["responses"];
        let mut declared = vec![("201", "Location"), ("201", "Idempotent-Replayed")];
        declared.push(("409", "Idempotent-Replayed"));
        if path != "/orders/{id}/deliveries" {
            // checkout_already_ordered, payment_already_recorded: the order
            // that holds the checkout or the payment.
            declared.push(("409", "Location"));
        }
        if path != "/orders" {
            // A missing order and business rules are stored (an order's 422
            // is validation only: nothing stored).
            declared.extend([
                ("404", "Idempotent-Replayed"),
                ("422", "Idempotent-Replayed"),
            ]);
        }
        for (code, header) in declared {
            assert!(
                responses[code]["headers"][header].is_object(),
                "POST {path} {code}: {header} not declared"
            );
        }
    }
    // And the problems' headers, wherever the status is documented: a 503
    // and a POST's 409 (idempotency_in_progress) may say Retry-After
    // (/readyz's 503 does not), a 401 WWW-Authenticate, a 405 Allow.
    let mut checked = 0;
    for (path, operations) in doc["paths"].as_object().expect("paths") {
        for (method, operation) in operations.as_object().expect("operations") {
            let Some(responses) = operation["responses"].as_object() else {
                continue;
            };
            for (code, response) in responses {
                let header = match code.as_str() {
                    "503" if path != "/readyz" => "Retry-After",
                    "409" if method == "post" => "Retry-After",
                    "401" => "WWW-Authenticate",
                    "405" => "Allow",
                    _ => continue,
                };
                let reference = response["headers"][header]["$ref"].as_str();
                let name = reference.and_then(|r| r.strip_prefix("#/components/headers/"));
                assert!(
                    name.is_some_and(|n| doc["components"]["headers"][n].is_object()),
                    "{method} {path} {code}: {header} not declared"
                );
                checked += 1;
            }
        }
    }
    // 503: 4 operations; a POST's 409: 3; 401: 4; 405: 8 paths.
    assert_eq!(checked, 19, "responses checked");
    // Every documented path answers something other than the not-found fallback.
    let caller = Caller::new("openapi");
    for path in doc["paths"].as_object().expect("paths").keys() {
        let concrete = path.replace("{id}", &uuid::Uuid::now_v7().to_string());
        let response = caller.get(&api.url(&concrete)).await;
        if response.status() == StatusCode::NOT_FOUND {
            let (_, problem) = json_of(response).await;
            assert_ne!(
                problem["code"], "not_found",
                "{path} is documented but not routed"
            );
        }
    }
}

/// The served document states the key retention this instance applies
/// (`ORDER_API__IDEMPOTENCY__TTL_SECONDS`), not a fixed 24 h.
#[tokio::test]
async fn the_openapi_document_states_the_configured_key_retention() {
    for (ttl, text) in [(None, "24 h"), (Some(5_400), "90 min")] {
        let env: Vec<_> = ttl
            .map(|t: u64| ("ORDER_API__IDEMPOTENCY__TTL_SECONDS", t.to_string()))
            .into_iter()
            .collect();
        let api = OrderApi::start(&env).await;
        let doc: Value = reqwest::get(api.url("/openapi.json"))
            .await
            .expect("openapi")
            .json()
            .await
            .expect("json");
        let description = doc["info"]["description"].as_str().expect("description");
        assert!(
            description.contains(&format!("expire {text} after")),
            "{ttl:?}: {description}"
        );
        let other = if ttl.is_some() { "24 h" } else { "90 min" };
        assert!(!description.contains(other), "{ttl:?}: {description}");
        assert_eq!(
            doc["info"]["x-idempotency-retention-seconds"],
            ttl.unwrap_or(86_400),
            "{ttl:?}"
        );
    }
}

/// A lock timeout on the key table as a whole (an operator's `LOCK TABLE`,
/// a `REINDEX`) is no key owner in flight: 503 `unavailable` with
/// `Retry-After`, nothing stored, `idempotency_in_progress_total` unchanged.
/// Before, a key never used was answered 409 `idempotency_in_progress` and
/// counted as a wait for its owner. PostgreSQL tells the two apart: a wait
/// for a row's transaction carries a context, a wait for the table none.
#[tokio::test]
async fn a_lock_on_the_whole_key_table_is_unavailable_not_a_key_in_progress() {
    let database = OwnOrdersDatabase::create().await;
    let api = OrderApi::start(&[
        ("ORDER_API__DATABASE__URL", database.url.clone()),
        ("ORDER_API__IDEMPOTENCY__LOCK_TIMEOUT_MS", "300".to_owned()),
        // One worker, so the POST below gets the connection the first one
        // used, its claim prepared: the wait is the claim's, not the
        // preparation's.
        ("ORDER_API__HTTP__WORKERS", "1".to_owned()),
    ])
    .await;
    let tenant = unique_tenant("table-lock");
    let key = database.api_key(&tenant);
    let client = Client::new();
    let post = |idempotency_key: &'static str| {
        client
            .post(api.url("/orders"))
            .bearer_auth(&key)
            .header("Idempotency-Key", idempotency_key)
            .header("Content-Type", "application/json")
            .body(SEED_ORDER)
            .send()
    };
    let first = post("first").await.expect("post");
    assert_eq!(first.status(), StatusCode::CREATED);
    let before = key_metrics(&api, "POST /orders").await;
    let mut holder = database.connect().await;
    let tx = holder.transaction().await.expect("begin");
    lock_table(&tx, "idempotency_requests").await;
    let response = post("never-used").await.expect("post");
    assert_eq!(
        response
            .headers()
            .get("Retry-After")
            .and_then(|v| v.to_str().ok()),
        Some("1")
    );
    let problem = expect_problem(response, StatusCode::SERVICE_UNAVAILABLE, "unavailable").await;
    assert!(
        problem["detail"]
            .as_str()
            .is_some_and(|detail| detail.contains("nothing was stored")),
        "{problem}"
    );
    tx.rollback().await.expect("rollback");
    assert_eq!(
        key_metrics(&api, "POST /orders").await - before,
        KeyMetrics::default(),
        "no wait for a key's owner counted"
    );
    let observer = database.connect().await;
    assert_eq!(counts_in(&observer, &tenant).await, Counts::ONE_ORDER);
    let response = post("never-used").await.expect("post");
    assert_eq!(response.status(), StatusCode::CREATED, "served again");
    assert_eq!(
        counts_in(&observer, &tenant).await,
        Counts {
            orders: 2,
            lines: 2,
            keys: 2,
            outbox: 2
        }
    );
}

/// order-api with `settings` on a database of its own (no other test's
/// order-api runs a cleanup there; its own runs once, at its start, and is
/// waited for), and a
/// caller (tenant `prefix`-...) whose seed order under key "k" is placed and
/// its record made expired, as if its TTL had passed, without a cleanup
/// having deleted it.
async fn an_expired_record_of_key_k(
    prefix: &str,
    mut settings: Vec<(&'static str, String)>,
) -> (OwnOrdersDatabase, OrderApi, Caller) {
    let database = OwnOrdersDatabase::create().await;
    settings.push(("ORDER_API__DATABASE__URL", database.url.clone()));
    settings.push((
        "ORDER_API__IDEMPOTENCY__CLEANUP_INTERVAL_SECONDS",
        "3600".to_owned(),
    ));
    let api = OrderApi::start(&settings).await;
    let tenant = unique_tenant(prefix);
    let caller = Caller {
        client: Client::new(),
        key: database.api_key(&tenant),
        tenant,
    };
    let first = caller.post(&api.url("/orders"), "k", SEED_ORDER).await;
    assert_eq!(first.status(), StatusCode::CREATED);
    // Its cleanup's run at start is over before the record expires.
    eventually(
        "the cleanup's first run",
        Duration::from_secs(30),
        || async {
            (api_metric(
                &api,
                "idempotency_cleanup_last_success_timestamp_seconds",
                None,
            )
            .await
                > 0)
            .then_some(())
        },
    )
    .await;
    assert_eq!(
        database
            .connect()
            .await
            .execute(
                "UPDATE idempotency_requests SET expires_at = now() - interval '1 second' \
                 WHERE tenant_id = $1 AND idempotency_key = 'k'",
                &[&caller.tenant],
            )
            .await
            .expect("expire"),
        1
    );
    (database, api, caller)
}

/// A takeover of an expired record that waits for its row behind another
/// waiter (PostgreSQL queues it on the tuple lock, whose lock timeout
/// carries no error context) is a key owner in flight, as the first waiter
/// is: 409 `idempotency_in_progress`, counted. Only the transaction's first
/// claim may be waiting for the whole table (503, see
/// `a_lock_on_the_whole_key_table_is_unavailable_not_a_key_in_progress`).
#[tokio::test]
async fn a_takeover_queued_behind_another_waiter_is_in_progress() {
    let (database, api, caller) = an_expired_record_of_key_k(
        "tuple-lock",
        vec![("ORDER_API__IDEMPOTENCY__LOCK_TIMEOUT_MS", "300".to_owned())],
    )
    .await;
    let orders_db = database.connect().await;
    let the_key = "WHERE tenant_id = $1 AND idempotency_key = 'k'";
    // One session holds the expired record's row (uncommitted), a second
    // waits for it (holding the tuple lock): the POST's takeover queues
    // behind the second (and no cleanup deletes a locked row).
    let mut holder = database.connect().await;
    let holding = holder.transaction().await.expect("begin");
    holding
        .query_one(
            &format!("SELECT 1 FROM idempotency_requests {the_key} FOR UPDATE"),
            &[&caller.tenant],
        )
        .await
        .expect("lock the row");
    let holder_pid = system_tests::backend_pid(&holding).await;
    let waiter = database.connect().await;
    let tenant = caller.tenant.clone();
    let update = format!("UPDATE idempotency_requests SET expires_at = expires_at {the_key}");
    let waiting = tokio::spawn(async move { waiter.execute(&update, &[&tenant]).await });
    blocked_by(&orders_db, holder_pid).await;
    let fingerprint_before: String = orders_db
        .query_one(
            &format!("SELECT request_fingerprint FROM idempotency_requests {the_key}"),
            &[&caller.tenant],
        )
        .await
        .expect("the record")
        .get(0);
    let before = key_metrics(&api, "POST /orders").await;
    let other = SEED_ORDER.replace("\"77\"", "\"78\"");
    let response = caller.post(&api.url("/orders"), "k", &other).await;
    let problem = expect_problem(response, StatusCode::CONFLICT, "idempotency_in_progress").await;
    assert_eq!(problem["retry_after"], 1, "{problem}");
    assert_eq!(
        key_metrics(&api, "POST /orders").await - before,
        KeyMetrics {
            in_progress: 1,
            ..KeyMetrics::default()
        }
    );
    holding.rollback().await.expect("rollback");
    waiting
        .await
        .expect("waiter")
        .expect("the waiter's update, once the row is free");
    // Nothing of the second request stored: the first order, its record
    // (still the first request's, expired).
    assert_eq!(
        counts_in(&orders_db, &caller.tenant).await,
        Counts::ONE_ORDER
    );
    assert_eq!(
        orders_db
            .query_one(
                &format!("SELECT request_fingerprint, expires_at <= now() FROM idempotency_requests {the_key}"),
                &[&caller.tenant],
            )
            .await
            .map(|row| (row.get::<_, String>(0) == fingerprint_before, row.get::<_, bool>(1)))
            .expect("the record"),
        (true, true)
    );
}

#[tokio::test]
async fn the_wait_for_an_in_flight_owner_is_bounded() {
    let api =
        OrderApi::start(&[("ORDER_API__IDEMPOTENCY__LOCK_TIMEOUT_MS", "300".to_owned())]).await;
    let caller = Caller::new("inflight");
    // An owner that has claimed the key and not committed yet: this test's own
    // open transaction holding the uncommitted key row.
    let mut owner = pg(Database::Orders).await;
    let tx = owner.transaction().await.expect("begin");
    tx.execute(
        "INSERT INTO idempotency_requests (tenant_id, endpoint, idempotency_key, request_fingerprint, expires_at) \
         VALUES ($1, 'POST /orders', 'busy', 'in-flight', now() + interval '1 hour')",
        &[&caller.tenant],
    )
    .await
    .expect("claim");
    let before = key_metrics(&api, "POST /orders").await;
    let response = caller.post(&api.url("/orders"), "busy", SEED_ORDER).await;
    assert_eq!(response.status(), StatusCode::CONFLICT);
    assert_eq!(
        response
            .headers()
            .get("Retry-After")
            .and_then(|v| v.to_str().ok()),
        Some("1")
    );
    let (_, problem) = json_of(response).await;
    // The wait is bounded: an unbounded one would end in the client's
    // timeout, with no answer.
    assert_eq!(problem["code"], "idempotency_in_progress");
    assert_eq!(
        key_metrics(&api, "POST /orders").await - before,
        KeyMetrics {
            in_progress: 1,
            ..KeyMetrics::default()
        },
        "a wait timeout is counted, nothing else"
    );
    // The owner gives up (rolls back): the key is free and the retry executes.
    tx.rollback().await.expect("rollback");
    let retry = caller.post(&api.url("/orders"), "busy", SEED_ORDER).await;
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert!(!is_replay(&retry));
    assert_eq!(counts(&caller.tenant).await.orders, 1);
}

/// Seed 004: a loser waits for the first transaction, reads its record and
/// returns the original result (not 409, not a second order). This test's
/// open transaction is the owner of key "b": it holds b's row uncommitted,
/// as the API's own claim does, already carrying the response the API
/// stored for key "a" (same fingerprint, status, body and order). POST "b"
/// must wait for that transaction and, once it commits, replay a's 201.
#[tokio::test]
async fn a_loser_waits_for_the_owner_s_commit_and_replays_its_result() {
    let api = OrderApi::start(&patient()).await;
    let caller = std::sync::Arc::new(Caller::new("waitreplay"));
    let first = caller.post(&api.url("/orders"), "a", SEED_ORDER).await;
    assert_eq!(first.status(), StatusCode::CREATED);
    let location = header(&first, "Location").map(str::to_owned);
    let first_body = first.bytes().await.expect("body");

    let mut owner = pg(Database::Orders).await;
    let tx = owner.transaction().await.expect("begin");
    let claimed = tx
        .execute(
            "INSERT INTO idempotency_requests (tenant_id, endpoint, idempotency_key, \
               request_fingerprint, response_status, response_body, resource_id, expires_at) \
             SELECT tenant_id, endpoint, 'b', request_fingerprint, response_status, \
                    response_body, resource_id, expires_at \
               FROM idempotency_requests \
              WHERE tenant_id = $1 AND endpoint = 'POST /orders' AND idempotency_key = 'a'",
            &[&caller.tenant],
        )
        .await
        .expect("claim b");
    assert_eq!(claimed, 1);
    let owner_pid = system_tests::backend_pid(&tx).await;
    let before = key_metrics(&api, "POST /orders").await;
    let request = tokio::spawn({
        let caller = caller.clone();
        let url = api.url("/orders");
        async move { caller.post(&url, "b", SEED_ORDER).await }
    });
    let watcher = pg(Database::Orders).await;
    wait_until_blocked_by(&watcher, owner_pid, "POST b never waited for b's owner").await;
    assert!(
        !request.is_finished(),
        "answered while the owner is running"
    );
    tx.commit().await.expect("commit");

    let response = request.await.expect("request task");
    assert_eq!(response.status(), StatusCode::CREATED);
    assert!(is_replay(&response), "the owner's result, replayed");
    assert_eq!(header(&response, "Location"), location.as_deref());
    assert_eq!(response.bytes().await.expect("body"), first_body);
    assert_eq!(
        key_metrics(&api, "POST /orders").await - before,
        KeyMetrics {
            replays: 1,
            ..KeyMetrics::default()
        }
    );
    assert_eq!(
        counts(&caller.tenant).await,
        Counts {
            orders: 1,
            lines: 1,
            keys: 2,
            outbox: 1
        },
        "nothing executed for b"
    );
}

/// An owner transaction that is still running shows in
/// `idempotency_oldest_incomplete_key_seconds`; one that fails (its
/// statement cancelled, as by an operator or `statement_timeout`) is
/// counted in `idempotency_rollbacks_total`, answered 503 and stores
/// nothing, so the same key executes on retry. This test holds the order's
/// row lock: the payment's owner waits for it after claiming its key.
#[tokio::test]
async fn a_running_owner_is_the_oldest_incomplete_key_and_a_failed_one_a_rollback() {
    let api = OrderApi::start(&patient()).await;
    let caller = std::sync::Arc::new(Caller::new("rollback"));
    let id = place_seed_order(&api, &caller).await;
    let endpoint = "POST /orders/{id}/payments";
    let oldest = || api_metric(&api, "idempotency_oldest_incomplete_key_seconds", None);
    let mut holder = pg(Database::Orders).await;
    let tx = holder.transaction().await.expect("begin");
    let locked = tx
        .execute(
            "SELECT 1 FROM orders WHERE order_id = $1::text::uuid FOR UPDATE",
            &[&id],
        )
        .await
        .expect("lock the order");
    assert_eq!(locked, 1);
    let holder_pid = system_tests::backend_pid(&tx).await;
    let before = key_metrics(&api, endpoint).await;
    let pay_url = api.url(&format!("/orders/{id}/payments"));
    let request = tokio::spawn({
        let (caller, pay_url) = (caller.clone(), pay_url.clone());
        async move { caller.post(&pay_url, "p", SEED_PAYMENT).await }
    });
    let watcher = pg(Database::Orders).await;
    wait_until_blocked_by(
        &watcher,
        holder_pid,
        "the payment never waited for the order",
    )
    .await;
    // The gauge is refreshed every second, in whole seconds.
    eventually(
        "the waiting owner never showed in the gauge",
        Duration::from_secs(15),
        || async { (oldest().await >= 1).then_some(()) },
    )
    .await;
    let cancelled = watcher
        .execute(
            "SELECT pg_cancel_backend(pid) FROM pg_stat_activity \
              WHERE $1 = ANY(pg_blocking_pids(pid))",
            &[&holder_pid],
        )
        .await
        .expect("cancel");
    assert_eq!(cancelled, 1);
    let response = request.await.expect("request task");
    assert_eq!(header(&response, "Retry-After"), Some("1"));
    expect_problem(response, StatusCode::SERVICE_UNAVAILABLE, "unavailable").await;
    assert_eq!(
        key_metrics(&api, endpoint).await - before,
        KeyMetrics {
            rollbacks: 1,
            ..KeyMetrics::default()
        }
    );
    assert_eq!(
        stored_body(&caller.tenant, endpoint, "p").await,
        None,
        "nothing stored"
    );
    tx.rollback().await.expect("release the order");
    eventually(
        "the gauge stayed up after the owner ended",
        Duration::from_secs(15),
        || async { (oldest().await <= 0).then_some(()) },
    )
    .await;
    let retry = caller.post(&pay_url, "p", SEED_PAYMENT).await;
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert!(!is_replay(&retry), "the retry executes");
    assert_eq!(effects(&caller.tenant).await, (1, 0));
}

/// Logs never contain request bodies tied to a key (seed 004), not even at
/// debug level: order-api's output while it answers a 201, its replay, a
/// 422 and a 409 reuse, all carrying one distinctive string in the
/// customer id and the keys, does not contain that string (the logs name
/// a key by its hash).
#[tokio::test]
async fn debug_logs_hold_neither_request_bodies_nor_keys() {
    let secret = uuid::Uuid::new_v4().simple().to_string();
    let log = std::env::temp_dir().join(format!("order-api-{secret}.log"));
    let api = OrderApi::start_with_output(
        &[
            ("RUST_LOG", "debug".to_owned()),
            ("LOG_FORMAT", "json".to_owned()),
        ],
        Some(&log),
    )
    .await;
    let caller = Caller::new("nolog");
    let url = api.url("/orders");
    let order = SEED_ORDER.replace("\"77\"", &format!("\"cust-{secret}\""));
    let key = format!("{secret}-1");
    for _ in 0..2 {
        let created = caller.post(&url, &key, &order).await;
        assert_eq!(created.status(), StatusCode::CREATED);
    }
    expect_problem(
        caller
            .post(
                &url,
                &format!("{secret}-2"),
                &order.replace("93.00", "94.00"),
            )
            .await,
        StatusCode::UNPROCESSABLE_ENTITY,
        "validation_failed",
    )
    .await;
    expect_problem(
        caller
            .post(&url, &key, &order.replace(&secret, &format!("{secret}-2")))
            .await,
        StatusCode::CONFLICT,
        "idempotency_key_reused",
    )
    .await;
    drop(api);
    let text = std::fs::read_to_string(&log).expect("log");
    let _ = std::fs::remove_file(&log);
    // The output is the requests' (debug lines included), not empty.
    for expected in [
        "idempotency key claimed and committed",
        "idempotent replay",
        "idempotency key reused with another request",
        "\"level\":\"DEBUG\"",
        "\"key_hash\"",
    ] {
        assert!(text.contains(expected), "no {expected:?} in:\n{text}");
    }
    // Whose client reused the key (the runbook's "tell the client's owners").
    assert!(
        text.lines().any(
            |line| line.contains("idempotency key reused with another request")
                && line.contains(&format!("\"tenant\":\"{}\"", caller.tenant))
        ),
        "no tenant on the reused key's line:\n{text}"
    );
    let leaks: Vec<&str> = text.lines().filter(|l| l.contains(&secret)).collect();
    assert!(leaks.is_empty(), "logged: {leaks:#?}");
}

/// A verified API key is remembered for `ORDER_API__AUTH__KEY_CACHE_MS`: a key
/// revoked in the database stops working within that window (and at once
/// with the cache off); an unknown key is never remembered.
#[tokio::test]
async fn a_revoked_key_stops_working_within_the_key_cache_window() {
    for cache_ms in [0_u64, 500] {
        let api = OrderApi::start(&[("ORDER_API__AUTH__KEY_CACHE_MS", cache_ms.to_string())]).await;
        let caller = Caller::new("revoke");
        let missing = api.url(&format!("/orders/{}", uuid::Uuid::now_v7()));
        // Authenticated (404 for an unknown order), and now remembered.
        assert_eq!(caller.get(&missing).await.status(), StatusCode::NOT_FOUND);
        // The entry's age counts from before this instant (its lookup began
        // before the answer came).
        let answered = std::time::Instant::now();
        let revoked = pg(Database::Orders)
            .await
            .execute(
                "UPDATE api_keys SET revoked_at = now() WHERE tenant_id = $1",
                &[&caller.tenant],
            )
            .await
            .expect("revoke");
        assert_eq!(revoked, 1);
        if cache_ms == 0 {
            // No cache: the very next request is refused.
            assert_eq!(
                caller.get(&missing).await.status(),
                StatusCode::UNAUTHORIZED
            );
        } else {
            // Once the window has passed, the very next request is refused:
            // one request, no polling (a window stretched by the service,
            // say rounded up to a second, fails here however slow the
            // machine: only a shorter window could pass).
            let window = Duration::from_millis(cache_ms);
            tokio::time::sleep_until(tokio::time::Instant::from_std(
                answered + window + Duration::from_millis(100),
            ))
            .await;
            assert_eq!(
                caller.get(&missing).await.status(),
                StatusCode::UNAUTHORIZED,
                "cache {cache_ms} ms"
            );
        }
        // Refused from then on (a refusal is never remembered as valid).
        assert_eq!(
            caller.get(&missing).await.status(),
            StatusCode::UNAUTHORIZED
        );
    }
}

/// `order-api api-key revoke`: a leaked key by itself (`--key`), or every
/// key of a tenant (`--tenant`); refused from the next lookup on (the cache
/// off here); revoking again revokes nothing and says so (status 1).
#[tokio::test]
async fn api_key_revoke_refuses_a_key_or_a_tenant_s_keys() {
    let api = OrderApi::start(&[("ORDER_API__AUTH__KEY_CACHE_MS", "0".to_owned())]).await;
    let revoke = |args: &[&str]| {
        let mut command = std::process::Command::new(system_tests::bin("order-api"));
        command.args(["api-key", "revoke"]).args(args);
        let output = command.output_within().expect("api-key revoke");
        (
            output.status.code(),
            String::from_utf8_lossy(&output.stdout).into_owned()
                + &String::from_utf8_lossy(&output.stderr),
        )
    };
    let leaked = Caller::new("revoke-cli");
    let kept = Caller::new("revoke-cli");
    let url = api.url(&format!("/orders/{}", uuid::Uuid::now_v7()));
    assert_eq!(leaked.get(&url).await.status(), StatusCode::NOT_FOUND);
    let (code, output) = revoke(&["--key", &leaked.key]);
    assert_eq!(code, Some(0), "{output}");
    assert!(output.contains("1 key(s) revoked"), "{output}");
    assert_eq!(leaked.get(&url).await.status(), StatusCode::UNAUTHORIZED);
    // The rows: (revoked, keys) of each tenant.
    let keys = |tenant: String| async move {
        let row = pg(Database::Orders)
            .await
            .query_one(
                "SELECT count(*) FILTER (WHERE revoked_at IS NOT NULL), count(*) \
                   FROM api_keys WHERE tenant_id = $1",
                &[&tenant],
            )
            .await
            .expect("api_keys");
        (row.get::<_, i64>(0), row.get::<_, i64>(1))
    };
    assert_eq!(keys(leaked.tenant.clone()).await, (1, 1));
    assert_eq!(keys(kept.tenant.clone()).await, (0, 1));
    assert_eq!(
        kept.get(&url).await.status(),
        StatusCode::NOT_FOUND,
        "another tenant's key"
    );
    let (code, output) = revoke(&["--key", &leaked.key]);
    assert_eq!(code, Some(1), "{output}");
    assert!(output.contains("no key revoked"), "{output}");
    // A tenant's every key: a second one of the same tenant too.
    let second = system_tests::api_key(&kept.tenant);
    let (code, output) = revoke(&["--tenant", &kept.tenant]);
    assert_eq!(code, Some(0), "{output}");
    assert!(output.contains("2 key(s) revoked"), "{output}");
    assert_eq!(keys(kept.tenant.clone()).await, (2, 2));
    assert_eq!(keys(leaked.tenant.clone()).await, (1, 1), "untouched");
    assert_eq!(kept.get(&url).await.status(), StatusCode::UNAUTHORIZED);
    let with_second = Client::new()
        .get(&url)
        .bearer_auth(&second)
        .send()
        .await
        .expect("request");
    assert_eq!(with_second.status(), StatusCode::UNAUTHORIZED);
    // One of the two: a usage error.
    let (code, output) = revoke(&[]);
    assert_eq!(code, Some(2), "{output}");
}

/// `order-api cleanup-keys` while a snapshot older than its deletes is open
/// (a long report, a drift check): its batches read the expiry index from
/// where the last one stopped. From the start, each re-read every key the
/// run had deleted (still in the index, visible to that snapshot), a cost
/// growing with the run. 20,000 expired keys in batches of 100; on a
/// database of its own (the index's counters are the run's alone).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_cleanup_under_an_old_snapshot_reads_each_deleted_key_once() {
    let database = OwnOrdersDatabase::create().await;
    let run = |args: &[&str]| {
        let mut command = std::process::Command::new(system_tests::bin("order-api"));
        command
            .args(args)
            .env("ORDER_API__DATABASE__URL", &database.url)
            .env("ORDER_API__IDEMPOTENCY__CLEANUP_BATCH", "100");
        let output = command.output_within().expect("order-api");
        (
            output.status.success(),
            String::from_utf8_lossy(&output.stdout).into_owned()
                + &String::from_utf8_lossy(&output.stderr),
        )
    };
    let (ok, output) = run(&["migrate"]);
    assert!(ok, "{output}");
    let db = database.connect().await;
    db.batch_execute(
        "INSERT INTO idempotency_requests (tenant_id, endpoint, idempotency_key,
             request_fingerprint, expires_at)
         SELECT 'aged', 'POST /orders', 'k-' || g, 'f', now() - interval '1 day' + g * interval '1 ms'
         FROM generate_series(1, 20000) g;
         ANALYZE idempotency_requests;",
    )
    .await
    .expect("20,000 expired keys");
    let read = system_tests::index_reads_under_an_old_snapshot(
        &database.url,
        "idempotency_requests_expires_idx",
        async {
            let (ok, output) = run(&["cleanup-keys"]);
            assert!(ok, "{output}");
            assert!(
                output.contains("20000 expired idempotency key(s) deleted"),
                "{output}"
            );
        },
    )
    .await;
    assert!(
        read <= 3 * 20_000,
        "{read} index entries read to delete 20,000 keys (quadratic: ~2,000,000)"
    );
}

/// The other side of the key cache: within the window a verified key is
/// served from memory (revoking it in the database does not refuse the next
/// request), while a refusal is never remembered (a key refused once works as
/// soon as it is valid in the database).
#[tokio::test]
async fn a_verified_key_is_remembered_and_a_refused_one_is_not() {
    let api = OrderApi::start(&[("ORDER_API__AUTH__KEY_CACHE_MS", "600000".to_owned())]).await;
    let missing = api.url(&format!("/orders/{}", uuid::Uuid::now_v7()));
    let set_revoked = |tenant: String, revoked: bool| async move {
        let changed = pg(Database::Orders)
            .await
            .execute(
                "UPDATE api_keys SET revoked_at = CASE WHEN $2 THEN now() END WHERE tenant_id = $1",
                &[&tenant, &revoked],
            )
            .await
            .expect("update the key");
        assert_eq!(changed, 1);
    };

    let remembered = Caller::new("cached");
    assert_eq!(
        remembered.get(&missing).await.status(),
        StatusCode::NOT_FOUND
    );
    set_revoked(remembered.tenant.clone(), true).await;
    assert_eq!(
        remembered.get(&missing).await.status(),
        StatusCode::NOT_FOUND,
        "verified less than the window ago: not looked up again"
    );

    let refused = Caller::new("refused");
    set_revoked(refused.tenant.clone(), true).await;
    assert_eq!(
        refused.get(&missing).await.status(),
        StatusCode::UNAUTHORIZED
    );
    set_revoked(refused.tenant.clone(), false).await;
    assert_eq!(
        refused.get(&missing).await.status(),
        StatusCode::NOT_FOUND,
        "a refusal is not remembered"
    );
}

/// A start-up while another instance migrates waits for it: the migration
/// session is not bound by the request pool's 2 s `lock_timeout`. (It was:
/// order-api exited with "advisory lock: ... lock timeout" after 2 s, and
/// in production restarted in a loop behind a slow migration.)
#[tokio::test]
async fn a_start_up_waits_for_another_instance_s_migration() {
    let key = kit::migrations::MIGRATION_LOCK_KEY;
    // A database of its own: on the shared one, the lock would hold up every
    // other test's start-up and `api-key create` (each migrates first).
    let database = OwnOrdersDatabase::create().await;
    let holder = database.connect().await;
    holder
        .execute("SELECT pg_advisory_lock($1)", &[&key])
        .await
        .expect("lock");
    let port = free_port();
    // Its sessions named, to find this instance's wait.
    let application = format!("startup-{}", uuid::Uuid::new_v4().simple());
    let url = format!(
        "{}{}application_name={application}",
        database.url,
        if database.url.contains('?') { '&' } else { '?' }
    );
    let mut service = Service::start(
        "order-api",
        &[],
        &[
            ("ORDER_API__HTTP__PORT", port.to_string()),
            ("ORDER_API__DATABASE__URL", url),
            ("RUST_LOG", "warn".to_owned()),
        ],
    );
    // Until the new instance waits for the lock (pg_locks splits the key).
    let waiting = "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) \
                   WHERE l.locktype = 'advisory' AND NOT l.granted AND a.application_name = $2 \
                   AND l.classid = ($1::bigint >> 32)::oid \
                   AND l.objid = ($1::bigint & 4294967295)::oid";
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let n: i64 = holder
            .query_one(waiting, &[&key, &application])
            .await
            .expect("pg_locks")
            .get(0);
        if n > 0 {
            break;
        }
        assert!(
            service.wait_exit(Duration::ZERO).is_none(),
            "order-api exited before it waited for the migration lock"
        );
        assert!(
            std::time::Instant::now() < deadline,
            "order-api never waited for the migration lock"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Longer than the pool's lock_timeout (2 s): the instance still waits.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        service.wait_exit(Duration::from_millis(100)),
        None,
        "order-api gave up waiting for the other instance's migration"
    );
    holder
        .execute("SELECT pg_advisory_unlock($1)", &[&key])
        .await
        .expect("unlock");
    service
        .wait_ready(
            &format!("http://127.0.0.1:{port}/readyz"),
            Duration::from_secs(60),
        )
        .await
        .expect("order-api ready once the migration lock is free");
}

/// A replay reads the stored record without locking it (seed 004's `ON
/// CONFLICT DO NOTHING`): a transaction holding a share lock on the
/// committed key's row (another replay, the cleanup looking at it) does not
/// hold the replay up. The claim used to be `DO UPDATE ... WHERE expired`,
/// which locks the conflicting row even when nothing is updated: replays of
/// one key took turns, and past the lock timeout answered 409
/// idempotency_in_progress for work long done.
#[tokio::test]
async fn a_replay_takes_no_lock_on_the_stored_record() {
    // The default lock timeout (2 s): the old claim answered 409 after it.
    let api = OrderApi::start(&[]).await;
    let caller = Caller::new("replaylock");
    let first = caller.post(&api.url("/orders"), "k", SEED_ORDER).await;
    assert_eq!(first.status(), StatusCode::CREATED);
    let first_body = first.bytes().await.expect("body");

    let mut holder = pg(Database::Orders).await;
    let tx = holder.transaction().await.expect("begin");
    let locked = tx
        .execute(
            "SELECT 1 FROM idempotency_requests WHERE tenant_id = $1 AND idempotency_key = 'k' FOR SHARE",
            &[&caller.tenant],
        )
        .await
        .expect("share lock");
    assert_eq!(locked, 1);
    let replay = caller.post(&api.url("/orders"), "k", SEED_ORDER).await;
    assert_eq!(
        replay.status(),
        StatusCode::CREATED,
        "not held up by the lock"
    );
    assert!(is_replay(&replay));
    assert_eq!(replay.bytes().await.expect("body"), first_body);
    expect_problem(
        caller
            .post(
                &api.url("/orders"),
                "k",
                &SEED_ORDER.replace("\"77\"", "\"78\""),
            )
            .await,
        StatusCode::CONFLICT,
        "idempotency_key_reused",
    )
    .await;
    tx.rollback().await.expect("rollback");
    assert_eq!(counts(&caller.tenant).await.orders, 1);
}

/// An expired record the cleanup has not deleted yet is taken over: the key
/// is a new operation (another body is no longer 409). Ten concurrent
/// requests taking it over make exactly one order; the others replay it.
#[tokio::test]
async fn an_expired_record_not_yet_deleted_is_taken_over_once() {
    // Nine requests wait for the taker's commit: room for a slow machine.
    let (database, api, caller) = an_expired_record_of_key_k("takeover", patient_with(&[])).await;
    let other = SEED_ORDER.replace("\"77\"", "\"78\"");
    let url = api.url("/orders");
    // A request that waited for the taker is told to retry (409
    // idempotency_in_progress), as a client is.
    let responses = futures_util::future::join_all((0..10).map(|_| async {
        let mut tries = 0;
        loop {
            let response = caller.post(&url, "k", &other).await;
            tries += 1;
            // Only an answer saying "retry" (it carries Retry-After: 409
            // idempotency_in_progress, 503 order_busy or deadline_exceeded
            // on a slow machine) is retried; a 409 idempotency_key_reused
            // has none, and fails the test below.
            let retry = response
                .headers()
                .contains_key(reqwest::header::RETRY_AFTER);
            if !retry || tries == 20 {
                break response;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }))
    .await;
    let mut bodies = Vec::new();
    let mut replays = 0;
    for response in responses {
        assert_eq!(response.status(), StatusCode::CREATED);
        replays += usize::from(is_replay(&response));
        bodies.push(response.bytes().await.expect("body"));
    }
    assert_eq!(replays, 9, "one owner, nine replays");
    assert!(
        bodies.windows(2).all(|w| w[0] == w[1]),
        "one stored response"
    );
    let order: Value = serde_json::from_slice(&bodies[0]).expect("json");
    assert_eq!(order["customer_id"], "78");
    let c = counts_in(&database.connect().await, &caller.tenant).await;
    assert_eq!((c.orders, c.keys), (2, 1));
    // Taken over, not deleted first and claimed anew: no cleanup deleted it.
    assert_eq!(
        api_metric(&api, "idempotency_expired_keys_deleted_total", None).await,
        0
    );
}

/// The payments and deliveries rows of `tenant`.
async fn effects(tenant: &str) -> (i64, i64) {
    let row = pg(Database::Orders)
        .await
        .query_one(
            "SELECT (SELECT count(*) FROM payments WHERE tenant_id = $1),
                    (SELECT count(*) FROM deliveries WHERE tenant_id = $1)",
            &[&tenant],
        )
        .await
        .expect("effect counts");
    (row.get(0), row.get(1))
}

/// The order's outbox rows: (aggregate_sequence, event_type).
async fn outbox_of(order_id: &str) -> Vec<(i64, String)> {
    pg(Database::Orders)
        .await
        .query(
            "SELECT aggregate_sequence, event_type FROM outbox_events \
             WHERE aggregate_id = $1 ORDER BY aggregate_sequence",
            &[&order_id],
        )
        .await
        .expect("outbox")
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

fn header<'a>(response: &'a Response, name: &str) -> Option<&'a str> {
    response.headers().get(name).and_then(|v| v.to_str().ok())
}

/// A client whose first POST /orders succeeded but whose response was lost,
/// retrying under another key (its first expired, or it made a new one),
/// learns which order its checkout has: `order_id` and `Location`, and the
/// stored rejection replays byte for byte.
#[tokio::test]
async fn a_checkout_ordered_under_another_key_names_its_order() {
    let api = OrderApi::start(&[]).await;
    let caller = Caller::new("chk-names");
    let with_checkout = SEED_ORDER.replace(
        "{\"customer_id\"",
        "{\"checkout_id\":\"chk-1\",\"customer_id\"",
    );
    let (status, first) =
        json_of(caller.post(&api.url("/orders"), "k1", &with_checkout).await).await;
    assert_eq!(status, StatusCode::CREATED);
    let order_id = first["order_id"].as_str().expect("id").to_owned();

    let second = caller.post(&api.url("/orders"), "k2", &with_checkout).await;
    assert_eq!(second.status(), StatusCode::CONFLICT);
    assert!(!is_replay(&second));
    let location = format!("/orders/{order_id}");
    assert_eq!(header(&second, "Location"), Some(location.as_str()));
    assert_eq!(
        header(&second, "content-type"),
        Some("application/problem+json")
    );
    let second_body = second.bytes().await.expect("body");
    let problem: Value = serde_json::from_slice(&second_body).expect("problem");
    assert_eq!(problem["code"], "checkout_already_ordered");
    assert_eq!(problem["field"], "checkout_id");
    assert_eq!(problem["order_id"], order_id.as_str(), "{problem}");

    let replay = caller.post(&api.url("/orders"), "k2", &with_checkout).await;
    assert_eq!(replay.status(), StatusCode::CONFLICT);
    assert!(is_replay(&replay));
    assert_eq!(header(&replay, "Location"), Some(location.as_str()));
    assert_eq!(replay.bytes().await.expect("body"), second_body);
    let (_, stored_status, stored) = stored_body(&caller.tenant, "POST /orders", "k2")
        .await
        .expect("stored");
    assert_eq!((stored_status, stored), (409, second_body.to_vec()));

    let (status, found) = json_of(caller.get(&api.url(&location)).await).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(found["checkout_id"], "chk-1");
    assert_eq!(
        counts(&caller.tenant).await,
        Counts {
            orders: 1,
            lines: 1,
            keys: 2,
            outbox: 1
        }
    );
}

/// RFC 9110 section 15.5.6: a 405 names the resource's methods in `Allow`;
/// the body is the usual problem.
#[tokio::test]
async fn a_method_not_allowed_names_the_allowed_ones() {
    let api = OrderApi::start(&[]).await;
    let client = Client::new();
    let id = uuid::Uuid::now_v7();
    let expected = json!({
        "type": "/problems/method_not_allowed",
        "title": "Method not allowed on this resource",
        "status": 405,
        "code": "method_not_allowed",
    });
    for (method, path, allow) in [
        ("DELETE", "/orders".to_owned(), "POST"),
        ("GET", "/orders".to_owned(), "POST"),
        ("PUT", format!("/orders/{id}"), "GET, HEAD"),
        ("DELETE", format!("/orders/{id}"), "GET, HEAD"),
        ("GET", format!("/orders/{id}/payments"), "POST"),
        ("GET", format!("/orders/{id}/deliveries"), "POST"),
        ("POST", "/openapi.json".to_owned(), "GET, HEAD"),
        ("POST", "/healthz".to_owned(), "GET, HEAD"),
        ("DELETE", "/readyz".to_owned(), "GET, HEAD"),
        ("PUT", "/metrics".to_owned(), "GET, HEAD"),
    ] {
        let response = client
            .request(method.parse().expect("method"), api.url(&path))
            .send()
            .await
            .expect("request");
        assert_eq!(header(&response, "Allow"), Some(allow), "{method} {path}");
        assert_eq!(
            header(&response, "content-type"),
            Some("application/problem+json"),
            "{method} {path}"
        );
        let (status, problem) = json_of(response).await;
        assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED, "{method} {path}");
        assert_eq!(problem, expected, "{method} {path}");
    }
    // A GET resource answers HEAD (RFC 9110 section 9.1): the GET's status
    // and headers, no body.
    let caller = Caller::new("head");
    let (status, placed) = json_of(caller.post(&api.url("/orders"), "k1", SEED_ORDER).await).await;
    assert_eq!(status, StatusCode::CREATED);
    let order = format!("/orders/{}", placed["order_id"].as_str().expect("id"));
    for (path, authorised) in [(order.as_str(), true), ("/openapi.json", false)] {
        let request = |method: reqwest::Method| {
            let request = client.request(method, api.url(path));
            if authorised {
                request.bearer_auth(&caller.key)
            } else {
                request
            }
        };
        let get = request(reqwest::Method::GET).send().await.expect("GET");
        assert_eq!(get.status(), StatusCode::OK, "GET {path}");
        let get_type = header(&get, "content-type").map(str::to_owned);
        let get_body = get.bytes().await.expect("GET body");
        assert!(!get_body.is_empty(), "GET {path}");
        let head = request(reqwest::Method::HEAD).send().await.expect("HEAD");
        assert_eq!(head.status(), StatusCode::OK, "HEAD {path}");
        assert_eq!(
            header(&head, "content-type").map(str::to_owned),
            get_type,
            "HEAD {path}"
        );
        assert_eq!(
            header(&head, "content-length"),
            Some(get_body.len().to_string().as_str()),
            "HEAD {path}"
        );
        assert!(
            head.bytes().await.expect("HEAD body").is_empty(),
            "HEAD {path}"
        );
    }
    // HEAD of an order that is not there: the GET's 404, without its body.
    let missing = client
        .head(api.url(&format!("/orders/{id}")))
        .bearer_auth(&caller.key)
        .send()
        .await
        .expect("HEAD missing");
    assert_eq!(missing.status(), StatusCode::NOT_FOUND);
}

/// A payment's currency is moot without the order (another tenant's, or
/// none): with or without it, a retry under the same key is the same
/// request and replays the stored 404, not 409 idempotency_key_reused.
#[tokio::test]
async fn without_the_order_a_payment_retry_replays_its_404_whatever_its_currency() {
    let api = OrderApi::start(&[]).await;
    let owner = Caller::new("moot-a");
    let caller = Caller::new("moot-b");
    let (_, order) = json_of(owner.post(&api.url("/orders"), "o", SEED_ORDER).await).await;
    let others = order["order_id"].as_str().expect("id").to_owned();
    let missing = uuid::Uuid::now_v7().to_string();
    let absent = SEED_PAYMENT;
    let with = |currency: &str| {
        absent.replace(
            "\"method\"",
            &format!("\"currency\":\"{currency}\",\"method\""),
        )
    };
    for (what, order_id, first, retries) in [
        (
            "missing",
            &missing,
            absent.to_owned(),
            vec![with("USD"), with("EUR")],
        ),
        (
            "another tenant's",
            &others,
            with("USD"),
            vec![absent.to_owned(), with("EUR")],
        ),
    ] {
        let url = api.url(&format!("/orders/{order_id}/payments"));
        let key = format!("pay-{}", what.replace([' ', '\''], "-"));
        let response = caller.post(&url, &key, &first).await;
        assert_eq!(response.status(), StatusCode::NOT_FOUND, "{what}");
        assert!(!is_replay(&response));
        let body = response.bytes().await.expect("body");
        for retry in retries {
            let response = caller.post(&url, &key, &retry).await;
            assert_eq!(response.status(), StatusCode::NOT_FOUND, "{what}: {retry}");
            assert!(is_replay(&response), "{what}: {retry}");
            assert_eq!(
                response.bytes().await.expect("body"),
                body,
                "{what}: {retry}"
            );
        }
    }
    let c = counts(&caller.tenant).await;
    assert_eq!((c.orders, c.keys, c.outbox), (0, 2, 0));
    assert_eq!(effects(&owner.tenant).await, (0, 0));
    assert_eq!(
        outbox_of(&others).await,
        vec![(1, "OrderPlaced".to_owned())]
    );
}

/// An event's time is taken under the order's lock: a delivery whose
/// transaction began before a payment of the same order committed (it
/// waited, here on its key's in-flight owner, this test's uncommitted row)
/// is dated after the payment, as its sequence is. With `now()` (the
/// transaction's start) it was dated before.
#[tokio::test]
async fn a_delivery_that_began_before_the_payment_is_dated_after_it() {
    let api = OrderApi::start(&patient()).await;
    let caller = std::sync::Arc::new(Caller::new("dated"));
    let id = place_seed_order(&api, &caller).await;

    let mut holder = pg(Database::Orders).await;
    let tx = holder.transaction().await.expect("begin");
    tx.execute(
        "INSERT INTO idempotency_requests (tenant_id, endpoint, idempotency_key, request_fingerprint, expires_at) \
         VALUES ($1, 'POST /orders/{id}/deliveries', 'd', 'in-flight', now() + interval '1 hour')",
        &[&caller.tenant],
    )
    .await
    .expect("claim");
    let holder_pid = system_tests::backend_pid(&tx).await;
    let delivery = tokio::spawn({
        let caller = caller.clone();
        let url = api.url(&format!("/orders/{id}/deliveries"));
        async move { json_of(caller.post(&url, "d", SEED_DELIVERY).await).await }
    });
    // Until the delivery's transaction waits for this one.
    let watcher = pg(Database::Orders).await;
    wait_until_blocked_by(&watcher, holder_pid, "the delivery never waited").await;
    let (status, paid) = json_of(
        caller
            .post(
                &api.url(&format!("/orders/{id}/payments")),
                "p",
                SEED_PAYMENT,
            )
            .await,
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{paid}");
    tx.rollback().await.expect("rollback");
    let (status, delivered) = delivery.await.expect("delivery task");
    assert_eq!(status, StatusCode::CREATED, "{delivered}");
    assert_eq!(delivered["event_sequence"], 3);

    let received_at = paid["received_at"].as_str().expect("received_at");
    let delivered_at = delivered["delivered_at"].as_str().expect("delivered_at");
    let row = watcher
        .query_one(
            "SELECT $1::text::timestamptz > $2::text::timestamptz,
                    (SELECT occurred_at FROM outbox_events WHERE aggregate_id = $3 AND aggregate_sequence = 3)
                  > (SELECT occurred_at FROM outbox_events WHERE aggregate_id = $3 AND aggregate_sequence = 2)",
            &[&delivered_at, &received_at, &id],
        )
        .await
        .expect("compare");
    let (later, event_later): (bool, bool) = (row.get(0), row.get(1));
    assert!(
        later && event_later,
        "delivered_at {delivered_at} must be after received_at {received_at} (events too: {event_later})"
    );
}

/// Seed 004, follow-up 1: the endpoint's execution is bounded below the
/// client's timeout, not only each lock wait. With a lock timeout far above
/// the request budget, a POST /orders whose checkout is held by this test's
/// uncommitted order waits on it until the budget runs out: 503
/// `deadline_exceeded` + Retry-After (not `order_busy` at the lock
/// timeout), nothing stored (no key, no order, no event), and the same key
/// succeeds once the checkout is free. The connection whose statement was
/// cancelled is closed, not returned to the pool (a late cancel would hit
/// the next request on it): its backend ends.
#[tokio::test]
async fn a_request_past_its_budget_is_rolled_back_and_its_key_stays_free() {
    let api = OrderApi::start(&[
        (
            "ORDER_API__IDEMPOTENCY__LOCK_TIMEOUT_MS",
            "25000".to_owned(),
        ),
        (
            // Room for a cold connection on a slow machine before the claim,
            // and for the test to see the request's backend waiting.
            "ORDER_API__IDEMPOTENCY__REQUEST_BUDGET_MS",
            "3000".to_owned(),
        ),
    ])
    .await;
    let caller = Caller::new("budget");
    let with_checkout = SEED_ORDER.replace(
        "{\"customer_id\"",
        "{\"checkout_id\":\"chk-held\",\"customer_id\"",
    );
    let nothing = Counts::NOTHING;

    let mut holder = pg(Database::Orders).await;
    let tx = holder.transaction().await.expect("begin");
    tx.execute(
        "INSERT INTO orders (order_id, tenant_id, customer_id, checkout_id, currency, location, \
                             merchandise_minor, shipping_minor, tax_minor, total_minor) \
         VALUES (gen_random_uuid(), $1, '77', 'chk-held', 'USD', 'WH-1', 0, 0, 0, 0)",
        &[&caller.tenant],
    )
    .await
    .expect("hold the checkout");
    let holder_pid = system_tests::backend_pid(&tx).await;
    let observer = pg(Database::Orders).await;
    let blocked = blocked_by(&observer, holder_pid);
    let url = api.url("/orders");
    let (response, blocked_pid) = tokio::join!(caller.post(&url, "o", &with_checkout), blocked);
    assert_eq!(header(&response, "Retry-After"), Some("1"));
    let problem = expect_problem(
        response,
        StatusCode::SERVICE_UNAVAILABLE,
        "deadline_exceeded",
    )
    .await;
    assert!(
        problem["detail"]
            .as_str()
            .is_some_and(|d| d.contains("3000 ms") && d.contains("nothing was stored")),
        "{problem}"
    );
    assert_eq!(counts(&caller.tenant).await, nothing, "while held");
    backend_gone(&observer, blocked_pid, "the cancelled connection closed").await;
    tx.rollback().await.expect("release");
    assert_eq!(counts(&caller.tenant).await, nothing, "released");

    let (status, order) =
        json_of(caller.post(&api.url("/orders"), "o", &with_checkout).await).await;
    assert_eq!(status, StatusCode::CREATED, "{order}");
    assert_eq!(counts(&caller.tenant).await, Counts::ONE_ORDER);
}

/// Seed 003: revenue is recognised on delivery, so ParcelDelivered carries
/// when the parcel was delivered, which the courier may report later than
/// it happened. A delivery's `delivered_at` (RFC 3339, any offset): in the
/// future is 422 and malformed is 400, each naming the field and storing
/// nothing; before the order was placed is 422 too, decided under the
/// order's lock and stored (DESIGN.md section 5: the placement time never
/// changes), so its key replays it and refuses another body; the order's
/// placement time itself is accepted, and the event carries it while
/// `occurred_at` stays the recording time; the same key with the same
/// instant in another offset replays, with another time or none it is 409
/// idempotency_key_reused.
#[tokio::test]
async fn a_delivery_carries_the_given_delivered_at_and_its_fingerprint() {
    use time::format_description::well_known::Rfc3339;
    let api = OrderApi::start(&[]).await;
    let caller = Caller::new("delivered-at");
    let id = place_seed_order(&api, &caller).await;
    let url = api.url(&format!("/orders/{id}/deliveries"));
    let paid = caller
        .post(
            &api.url(&format!("/orders/{id}/payments")),
            "p",
            SEED_PAYMENT,
        )
        .await;
    assert_eq!(paid.status(), StatusCode::CREATED);
    let (_, order) = json_of(caller.get(&api.url(&format!("/orders/{id}"))).await).await;
    let placed_text = order["created_at"].as_str().expect("created_at");
    let placed = time::OffsetDateTime::parse(placed_text, &Rfc3339).expect("placed");
    let at = |t: time::OffsetDateTime| t.format(&Rfc3339).expect("format");
    let delivered_at =
        |value: &str| SEED_DELIVERY.replacen('{', &format!("{{\"delivered_at\":\"{value}\","), 1);
    let endpoint = "POST /orders/{id}/deliveries";
    let before = vec![
        (1, "OrderPlaced".to_owned()),
        (2, "PaymentReceived".to_owned()),
    ];

    // Whole seconds: a finer time than PostgreSQL keeps is refused too.
    let future = (time::OffsetDateTime::now_utc() + time::Duration::hours(1))
        .replace_nanosecond(0)
        .expect("whole second");
    // Before placement: stored under its key, replayed byte for byte.
    let early = delivered_at(&at(placed - time::Duration::microseconds(1)));
    let response = caller.post(&url, "d-early", &early).await;
    assert!(!is_replay(&response));
    let first = response.bytes().await.expect("body");
    let problem: Value = serde_json::from_slice(&first).expect("problem");
    assert_eq!(
        (problem["code"].as_str(), problem["field"].as_str()),
        (Some("validation_failed"), Some("delivered_at")),
        "{problem}"
    );
    assert!(
        problem["detail"]
            .as_str()
            .is_some_and(|d| d.contains("before the order was placed")),
        "{problem}"
    );
    let (_, stored_status, stored) = stored_body(&caller.tenant, endpoint, "d-early")
        .await
        .expect("the rejection is stored");
    assert_eq!((stored_status, stored.as_slice()), (422, &first[..]));
    let again = caller.post(&url, "d-early", &early).await;
    assert_eq!(again.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert!(is_replay(&again), "the stored rejection replays");
    assert_eq!(again.bytes().await.expect("body"), first);
    let corrected = caller
        .post(&url, "d-early", &delivered_at(placed_text))
        .await;
    expect_problem(corrected, StatusCode::CONFLICT, "idempotency_key_reused").await;
    assert_eq!(effects(&caller.tenant).await, (1, 0));
    assert_eq!(outbox_of(&id).await, before);

    for (value, status, code, why) in [
        (
            at(future),
            StatusCode::UNPROCESSABLE_ENTITY,
            "validation_failed",
            "in the future",
        ),
        (
            at(placed + time::Duration::nanoseconds(1)),
            StatusCode::UNPROCESSABLE_ENTITY,
            "validation_failed",
            "microsecond precision",
        ),
        (
            "2024-05-13 14:00".to_owned(),
            StatusCode::BAD_REQUEST,
            "invalid_request",
            "RFC 3339",
        ),
        (
            "2024-05-13T14:00:00".to_owned(),
            StatusCode::BAD_REQUEST,
            "invalid_request",
            "with an offset",
        ),
    ] {
        let response = caller.post(&url, "d", &delivered_at(&value)).await;
        let problem = expect_problem(response, status, code).await;
        assert_eq!(problem["field"], "delivered_at", "{value}: {problem}");
        assert!(
            problem["detail"].as_str().is_some_and(|d| d.contains(why)),
            "{value}: {why}: {problem}"
        );
        assert_eq!(
            stored_body(&caller.tenant, endpoint, "d").await,
            None,
            "{value}"
        );
        assert_eq!(effects(&caller.tenant).await, (1, 0), "{value}");
        assert_eq!(outbox_of(&id).await, before, "{value}");
    }

    // The placement time itself (as GET shows it, in UTC), under the key
    // that the rejected attempts left free.
    let (status, delivered) =
        json_of(caller.post(&url, "d", &delivered_at(placed_text)).await).await;
    assert_eq!(status, StatusCode::CREATED, "{delivered}");
    let recorded = delivered["recorded_at"].as_str().expect("recorded_at");
    let row = pg(Database::Orders)
        .await
        .query_one(
            "SELECT (e.payload->>'delivered_at')::timestamptz = $2::text::timestamptz,
                    e.occurred_at = $3::text::timestamptz,
                    e.occurred_at > $2::text::timestamptz,
                    $4::text::timestamptz = $2::text::timestamptz,
                    (SELECT d.delivered_at FROM deliveries d WHERE d.order_id = e.aggregate_id::uuid)
                      = $2::text::timestamptz
               FROM outbox_events e
              WHERE e.aggregate_id = $1 AND e.event_type = 'ParcelDelivered'",
            &[&id, &placed_text, &recorded, &delivered["delivered_at"].as_str().expect("delivered_at")],
        )
        .await
        .expect("event");
    let checks: (bool, bool, bool, bool, bool) =
        (row.get(0), row.get(1), row.get(2), row.get(3), row.get(4));
    assert_eq!(
        checks,
        (true, true, true, true, true),
        "payload delivered_at, occurred_at = recorded_at, recorded after, response, row: {delivered}"
    );

    let plus_two = at(placed.to_offset(time::macros::offset!(+2)));
    let replay = caller.post(&url, "d", &delivered_at(&plus_two)).await;
    assert!(is_replay(&replay), "the same instant in another offset");
    for other in [
        delivered_at(&at(placed + time::Duration::seconds(1))),
        SEED_DELIVERY.to_owned(),
    ] {
        let response = caller.post(&url, "d", &other).await;
        expect_problem(response, StatusCode::CONFLICT, "idempotency_key_reused").await;
    }
    assert_eq!(effects(&caller.tenant).await, (1, 1));
}

/// A record the cleanup deletes while a request is about to take it over
/// (expired, not yet deleted): the key is free, and the request claims it
/// again and executes as a new operation (seed 004: reusing a key after
/// cleanup is a new operation). It used to be told to retry (409
/// idempotency_in_progress), counted as a wait that ran out. This test's
/// transaction is the cleanup: it locks the record before it expires (so
/// before the request reads it), and deletes it while the takeover waits
/// for that lock.
#[tokio::test]
async fn a_record_deleted_under_a_takeover_frees_the_key_for_a_new_operation() {
    // On a database of its own: every other order-api's cleanup deletes
    // every tenant's expired keys, and could take this one between its
    // expiry's commit and the lock below on a stalled machine.
    let database = OwnOrdersDatabase::create().await;
    let api = OrderApi::start(&patient_with(&[
        (
            "ORDER_API__IDEMPOTENCY__CLEANUP_INTERVAL_SECONDS",
            "3600".to_owned(),
        ),
        ("ORDER_API__DATABASE__URL", database.url.clone()),
    ]))
    .await;
    let caller = std::sync::Arc::new(Caller::in_database("vanish", &database));
    let first = caller.post(&api.url("/orders"), "k", SEED_ORDER).await;
    assert_eq!(first.status(), StatusCode::CREATED);
    let filter = "WHERE tenant_id = $1 AND idempotency_key = 'k'";
    let watcher = database.connect().await;
    // Expiring in six seconds, and locked before that: its order-api's
    // cleanup (`FOR UPDATE SKIP LOCKED`, hourly) cannot take it first.
    let expiring = watcher
        .execute(
            &format!(
                "UPDATE idempotency_requests SET expires_at = now() + interval '6 seconds' {filter}"
            ),
            &[&caller.tenant],
        )
        .await
        .expect("expire soon");
    assert_eq!(expiring, 1);
    let mut cleanup = database.connect().await;
    let tx = cleanup.transaction().await.expect("begin");
    let locked = tx
        .execute(
            &format!("SELECT 1 FROM idempotency_requests {filter} FOR UPDATE"),
            &[&caller.tenant],
        )
        .await
        .expect("lock");
    assert_eq!(locked, 1);
    loop {
        let expired: bool = tx
            .query_one(
                &format!(
                    "SELECT expires_at <= clock_timestamp() FROM idempotency_requests {filter}"
                ),
                &[&caller.tenant],
            )
            .await
            .expect("expired yet")
            .get(0);
        if expired {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let cleanup_pid = system_tests::backend_pid(&tx).await;
    let before = key_metrics(&api, "POST /orders").await;
    let request = tokio::spawn({
        let caller = caller.clone();
        let url = api.url("/orders");
        let other = SEED_ORDER.replace("\"77\"", "\"78\"");
        async move { caller.post(&url, "k", &other).await }
    });
    // Until the takeover waits for this transaction's lock.
    wait_until_blocked_by(&watcher, cleanup_pid, "the takeover never waited").await;
    let deleted = tx
        .execute(
            &format!("DELETE FROM idempotency_requests {filter}"),
            &[&caller.tenant],
        )
        .await
        .expect("delete");
    assert_eq!(deleted, 1);
    tx.commit().await.expect("commit");

    let response = request.await.expect("request task");
    assert!(!is_replay(&response));
    let (status, order) = json_of(response).await;
    assert_eq!(status, StatusCode::CREATED, "{order}");
    assert_eq!(
        order["customer_id"], "78",
        "the new request's order: {order}"
    );
    assert_eq!(
        key_metrics(&api, "POST /orders").await - before,
        KeyMetrics {
            claims: 1,
            ..KeyMetrics::default()
        },
        "claimed, not in progress"
    );
    let c = counts_in(&watcher, &caller.tenant).await;
    assert_eq!(
        (c.orders, c.keys),
        (2, 1),
        "a second order, and its key stored"
    );
    // Replayed from now on, as any key.
    let again = caller
        .post(
            &api.url("/orders"),
            "k",
            &SEED_ORDER.replace("\"77\"", "\"78\""),
        )
        .await;
    assert!(is_replay(&again));
    let (status, replayed) = json_of(again).await;
    assert_eq!((status, &replayed), (StatusCode::CREATED, &order));
}

/// Two different keys racing on one checkout: exactly one order and one
/// event; every other answer is the stored 409 naming that order (or 503
/// order_busy if a wait for the winner ran past lock_timeout).
#[tokio::test]
async fn different_keys_racing_on_one_checkout_make_one_order() {
    let api = OrderApi::start(&[]).await;
    let caller = std::sync::Arc::new(Caller::new("chk-race"));
    let with_checkout = SEED_ORDER.replace(
        "{\"customer_id\"",
        "{\"checkout_id\":\"chk-race\",\"customer_id\"",
    );
    let url = api.url("/orders");
    let answers = futures_util::future::join_all((0..6).map(|n| {
        let caller = caller.clone();
        let (url, body) = (url.clone(), with_checkout.clone());
        async move {
            let response = caller.post(&url, &format!("race-{n}"), &body).await;
            let retry_after = header(&response, "Retry-After").map(str::to_owned);
            let location = header(&response, "Location").map(str::to_owned);
            let (status, body) = json_of(response).await;
            (status, body, location, retry_after)
        }
    }))
    .await;
    let created: Vec<&Value> = answers
        .iter()
        .filter(|a| a.0 == StatusCode::CREATED)
        .map(|a| &a.1)
        .collect();
    assert_eq!(created.len(), 1, "{answers:?}");
    let order_id = created[0]["order_id"].as_str().expect("id");
    let mut stored = 1;
    for (status, body, location, retry_after) in &answers {
        match *status {
            StatusCode::CREATED => {}
            StatusCode::CONFLICT => {
                stored += 1;
                assert_eq!(body["code"], "checkout_already_ordered", "{body}");
                assert_eq!(body["order_id"], order_id, "{body}");
                assert_eq!(location.as_deref(), Some(&*format!("/orders/{order_id}")));
            }
            StatusCode::SERVICE_UNAVAILABLE => {
                assert_eq!(body["code"], "order_busy", "{body}");
                assert_eq!(retry_after.as_deref(), Some("1"));
            }
            other => panic!("unexpected {other}: {body}"),
        }
    }
    assert_eq!(
        counts(&caller.tenant).await,
        Counts {
            orders: 1,
            lines: 1,
            keys: stored,
            outbox: 1
        }
    );
}

/// Two payments for one order under different keys at once: one pays, the
/// other is 409 order_already_paid (stored) or, if its wait for the order's
/// lock ran out, 503 order_busy with nothing stored. One PaymentReceived,
/// sequence 2.
#[tokio::test]
async fn concurrent_payments_under_different_keys_pay_once() {
    let api = OrderApi::start(&[]).await;
    let caller = Caller::new("pay-race");
    let id = place_seed_order(&api, &caller).await;
    let pay_url = api.url(&format!("/orders/{id}/payments"));
    let pay = |key: &'static str, payment_id: &'static str| {
        let body = format!(r#"{{"payment_id":"{payment_id}","amount":"93.00","method":"card"}}"#);
        let caller = &caller;
        let pay_url = &pay_url;
        async move {
            let response = caller.post(pay_url, key, &body).await;
            let retry_after = header(&response, "Retry-After").map(str::to_owned);
            let (status, body) = json_of(response).await;
            (key, status, body, retry_after)
        }
    };
    let (a, b) = tokio::join!(pay("pay-a", "9001"), pay("pay-b", "9002"));
    let (winner, loser) = match (a.1, b.1) {
        (StatusCode::CREATED, _) => (a, b),
        (_, StatusCode::CREATED) => (b, a),
        _ => panic!("no payment succeeded: {a:?} {b:?}"),
    };
    assert_eq!(winner.2["event_sequence"], 2);
    let loser_stored = stored_body(&caller.tenant, "POST /orders/{id}/payments", loser.0).await;
    match loser.1 {
        StatusCode::CONFLICT => {
            assert_eq!(loser.2["code"], "order_already_paid", "{:?}", loser.2);
            assert_eq!(loser_stored.map(|s| s.1), Some(409));
        }
        StatusCode::SERVICE_UNAVAILABLE => {
            assert_eq!(loser.2["code"], "order_busy", "{:?}", loser.2);
            assert_eq!(loser.3.as_deref(), Some("1"));
            assert!(loser_stored.is_none(), "a busy answer stores nothing");
        }
        other => panic!("unexpected {other}: {:?}", loser.2),
    }
    assert_eq!(
        outbox_of(&id).await,
        vec![
            (1, "OrderPlaced".to_owned()),
            (2, "PaymentReceived".to_owned())
        ]
    );
    assert_eq!(effects(&caller.tenant).await, (1, 0));
    let last: i64 = pg(Database::Orders)
        .await
        .query_one(
            "SELECT last_event_sequence FROM orders WHERE order_id = $1::text::uuid",
            &[&id],
        )
        .await
        .expect("order")
        .get(0);
    assert_eq!(last, 2);
}

/// A provider's payment pays one order of its tenant: the same `payment_id`
/// on another order is 409 `payment_already_recorded` naming the order that
/// holds it (`order_id`, `Location`), stored and replayed byte for byte,
/// nothing else written; another tenant may use the id. Two at once on
/// different orders take no lock in common: the database's unique index
/// decides. A payment waiting on another order's uncommitted row with its id
/// is that 409 once the other commits, and pays once it rolls back.
#[tokio::test]
async fn a_payment_id_pays_one_order_of_its_tenant() {
    let api = OrderApi::start(&patient()).await;
    let caller = std::sync::Arc::new(Caller::new("pay-id"));
    let place = |key| place_seed_order_under(&api, &caller, key);
    let pay = |order: &str, key: &'static str, payment_id: &'static str| {
        let (caller, url) = (
            caller.clone(),
            api.url(&format!("/orders/{order}/payments")),
        );
        async move {
            let body =
                format!(r#"{{"payment_id":"{payment_id}","amount":"93.00","method":"card"}}"#);
            caller.post(&url, key, &body).await
        }
    };
    let (a, b, c, d) = (
        place("o-a").await,
        place("o-b").await,
        place("o-c").await,
        place("o-d").await,
    );
    assert_eq!(pay(&a, "p-a", "9001").await.status(), StatusCode::CREATED);

    let refused = pay(&b, "p-b", "9001").await;
    let location = header(&refused, "Location").map(str::to_owned);
    assert!(!is_replay(&refused));
    let first = refused.bytes().await.expect("body");
    let problem: Value = serde_json::from_slice(&first).expect("json");
    assert_eq!(problem["status"], 409, "{problem}");
    assert_eq!(problem["code"], "payment_already_recorded", "{problem}");
    assert_eq!(problem["order_id"], a.as_str(), "{problem}");
    assert_eq!(problem["field"], "payment_id", "{problem}");
    assert_eq!(location, Some(format!("/orders/{a}")));
    let again = pay(&b, "p-b", "9001").await;
    assert!(is_replay(&again));
    assert_eq!(again.bytes().await.expect("body"), first, "byte for byte");
    let stored = stored_body(&caller.tenant, "POST /orders/{id}/payments", "p-b").await;
    assert_eq!(stored.map(|s| (s.1, s.2)), Some((409, first.to_vec())));
    assert_eq!(outbox_of(&b).await, vec![(1, "OrderPlaced".to_owned())]);
    assert_eq!(effects(&caller.tenant).await, (1, 0), "one payment row");

    let other = Caller::new("pay-id-other");
    let theirs = place_seed_order(&api, &other).await;
    let response = other
        .post(
            &api.url(&format!("/orders/{theirs}/payments")),
            "p",
            SEED_PAYMENT,
        )
        .await;
    assert_eq!(
        response.status(),
        StatusCode::CREATED,
        "another tenant's 9001"
    );

    // Another order's payment with the id, not committed yet: this one
    // waits on the index, then answers by the other's outcome.
    let watcher = pg(Database::Orders).await;
    for (holder_order, key, payment_id, commit) in
        [(&c, "p-b2", "9100", true), (&d, "p-b3", "9200", false)]
    {
        let mut holder = pg(Database::Orders).await;
        let tx = holder.transaction().await.expect("begin");
        tx.execute(
            "INSERT INTO payments (order_id, payment_id, tenant_id, amount_minor, method) \
             VALUES ($1::text::uuid, $2, $3, 9300, 'card')",
            &[holder_order, &payment_id, &caller.tenant],
        )
        .await
        .expect("the other order's payment");
        let holder_pid = system_tests::backend_pid(&tx).await;
        let request = tokio::spawn(pay(&b, key, payment_id));
        wait_until_blocked_by(
            &watcher,
            holder_pid,
            "the payment never waited on the index",
        )
        .await;
        if commit {
            tx.commit().await.expect("commit");
            let problem = expect_problem(
                request.await.expect("request task"),
                StatusCode::CONFLICT,
                "payment_already_recorded",
            )
            .await;
            assert_eq!(problem["order_id"], holder_order.as_str(), "{problem}");
        } else {
            tx.rollback().await.expect("rollback");
            let (status, paid) = json_of(request.await.expect("request task")).await;
            assert_eq!(status, StatusCode::CREATED, "{paid}");
            assert_eq!(paid["payment_id"], payment_id);
        }
    }
    assert_eq!(
        outbox_of(&b).await,
        vec![
            (1, "OrderPlaced".to_owned()),
            (2, "PaymentReceived".to_owned())
        ]
    );
    assert_eq!(outbox_of(&c).await, vec![(1, "OrderPlaced".to_owned())]);
    assert_eq!(outbox_of(&d).await, vec![(1, "OrderPlaced".to_owned())]);
    assert_eq!(
        effects(&caller.tenant).await,
        (3, 0),
        "a's, c's by hand, b's"
    );
}

/// Rejected attempts (a payment of the wrong amount, stored; a delivery
/// before the payment, not stored) use no sequence number: the events are
/// 1, 2, 3.
#[tokio::test]
async fn rejected_attempts_leave_no_gap_in_the_sequence() {
    let api = OrderApi::start(&[]).await;
    let caller = Caller::new("no-gap");
    let id = place_seed_order(&api, &caller).await;
    let pay_url = api.url(&format!("/orders/{id}/payments"));
    let deliver_url = api.url(&format!("/orders/{id}/deliveries"));
    let payment = SEED_PAYMENT;
    let delivery = SEED_DELIVERY;

    expect_problem(
        caller
            .post(&pay_url, "p-wrong", &payment.replace("93.00", "92.00"))
            .await,
        StatusCode::UNPROCESSABLE_ENTITY,
        "amount_mismatch",
    )
    .await;
    expect_problem(
        caller.post(&deliver_url, "d-early", delivery).await,
        StatusCode::CONFLICT,
        "order_not_paid",
    )
    .await;
    let (status, paid) = json_of(caller.post(&pay_url, "p", payment).await).await;
    assert_eq!(
        (status, &paid["event_sequence"]),
        (StatusCode::CREATED, &json!(2))
    );
    let (status, delivered) = json_of(caller.post(&deliver_url, "d", delivery).await).await;
    assert_eq!(
        (status, &delivered["event_sequence"]),
        (StatusCode::CREATED, &json!(3))
    );
    assert_eq!(
        outbox_of(&id).await,
        vec![
            (1, "OrderPlaced".to_owned()),
            (2, "PaymentReceived".to_owned()),
            (3, "ParcelDelivered".to_owned())
        ]
    );
    assert_eq!(effects(&caller.tenant).await, (1, 1));
}

/// Malformed JSON, a path id that is no UUID and an oversized body on the
/// payment and delivery POSTs: a 4xx problem, nothing stored.
#[tokio::test]
async fn malformed_payments_and_deliveries_get_a_4xx_and_store_nothing() {
    let api =
        OrderApi::start(&[("ORDER_API__IDEMPOTENCY__MAX_BODY_BYTES", "1024".to_owned())]).await;
    let caller = Caller::new("bad-cmd");
    let (status, order) = json_of(caller.post(&api.url("/orders"), "o", SEED_ORDER).await).await;
    assert_eq!(status, StatusCode::CREATED);
    let id = order["order_id"].as_str().expect("id").to_owned();
    let payment = SEED_PAYMENT;
    let delivery = SEED_DELIVERY;
    let padded = |body: &str| format!("{body}{}", " ".repeat(2048));
    for (resource, good) in [("payments", payment), ("deliveries", delivery)] {
        let url = api.url(&format!("/orders/{id}/{resource}"));
        let cases: Vec<(&str, String, String, u16, &str, &str)> = vec![
            (
                "not json",
                url.clone(),
                "{not json".to_owned(),
                400,
                "invalid_request",
                "body",
            ),
            (
                "empty",
                url.clone(),
                String::new(),
                400,
                "invalid_request",
                "body",
            ),
            (
                "an array",
                url.clone(),
                "[]".to_owned(),
                400,
                "invalid_request",
                "body",
            ),
            (
                "unknown field",
                url.clone(),
                good.replacen('{', "{\"extra\":1,", 1),
                400,
                "invalid_request",
                "extra",
            ),
            (
                "id not a UUID",
                api.url(&format!("/orders/not-a-uuid/{resource}")),
                good.to_owned(),
                400,
                "invalid_request",
                "id",
            ),
            (
                "oversized",
                url.clone(),
                padded(good),
                413,
                "payload_too_large",
                "",
            ),
        ];
        for (what, url, body, status, code, field) in cases {
            let key = format!("k-{resource}-{}", what.replace(' ', "-"));
            let response = caller.post(&url, &key, &body).await;
            assert_eq!(
                header(&response, "content-type"),
                Some("application/problem+json"),
                "{resource}: {what}"
            );
            let (got, problem) = json_of(response).await;
            assert_eq!(
                (got.as_u16(), problem["code"].as_str()),
                (status, Some(code)),
                "{resource}: {what}: {problem}"
            );
            if field.is_empty() {
                // Too large to read: no field to name.
                assert!(
                    problem.get("field").is_none(),
                    "{resource}: {what}: {problem}"
                );
            } else {
                assert!(
                    problem["field"]
                        .as_str()
                        .is_some_and(|named| named.starts_with(field)),
                    "{resource}: {what}: {problem}"
                );
            }
        }
    }
    assert_eq!(
        counts(&caller.tenant).await,
        Counts::ONE_ORDER,
        "only the order's own key and event"
    );
    assert_eq!(effects(&caller.tenant).await, (0, 0));
    assert_eq!(outbox_of(&id).await, vec![(1, "OrderPlaced".to_owned())]);
}

/// Wait (at most 15 s) until some session waits for a lock held by the
/// backend `pid`; panics with `never` otherwise.
async fn wait_until_blocked_by(watcher: &tokio_postgres::Client, pid: i32, never: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    loop {
        let waiting: i64 = watcher
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))",
                &[&pid],
            )
            .await
            .expect("pg_stat_activity")
            .get(0);
        if waiting > 0 {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "{never}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The problem+json answer of `response`, after asserting its status and
/// `code`.
async fn expect_problem(response: reqwest::Response, status: StatusCode, code: &str) -> Value {
    let (got, problem) = json_of(response).await;
    assert_eq!(
        (got, problem["code"].as_str()),
        (status, Some(code)),
        "{problem}"
    );
    problem
}

/// The seed order placed by `caller` under key "o" (201 asserted); its id.
async fn place_seed_order(api: &OrderApi, caller: &Caller) -> String {
    place_seed_order_under(api, caller, "o").await
}

/// [`place_seed_order`] under `key` (another order of the same caller).
async fn place_seed_order_under(api: &OrderApi, caller: &Caller, key: &str) -> String {
    let (status, order) = json_of(caller.post(&api.url("/orders"), key, SEED_ORDER).await).await;
    assert_eq!(status, StatusCode::CREATED, "{order}");
    order["order_id"].as_str().expect("id").to_owned()
}

/// order-api's idempotency counters of one endpoint (`key_metrics`), or the
/// difference of two readings.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct KeyMetrics {
    claims: i64,
    replays: i64,
    conflicts: i64,
    in_progress: i64,
    rollbacks: i64,
}

impl std::ops::Sub for KeyMetrics {
    type Output = KeyMetrics;
    fn sub(self, before: KeyMetrics) -> KeyMetrics {
        KeyMetrics {
            claims: self.claims - before.claims,
            replays: self.replays - before.replays,
            conflicts: self.conflicts - before.conflicts,
            in_progress: self.in_progress - before.in_progress,
            rollbacks: self.rollbacks - before.rollbacks,
        }
    }
}

/// `api`'s metric `name` (of `endpoint`, when given), scraped now.
async fn api_metric(api: &OrderApi, name: &str, endpoint: Option<&str>) -> i64 {
    let labels = endpoint.map_or_else(String::new, |e| format!("endpoint=\"{e}\""));
    let value = system_tests::consumers::scrape_metric(&api.base, name, &labels).await;
    // Counters and gauges of whole numbers.
    value as i64
}

/// The idempotency counters `api` reports for `endpoint` now.
async fn key_metrics(api: &OrderApi, endpoint: &str) -> KeyMetrics {
    let metric = |name| api_metric(api, name, Some(endpoint));
    KeyMetrics {
        claims: metric("idempotency_claims_total").await,
        replays: metric("idempotency_replays_total").await,
        conflicts: metric("idempotency_key_conflicts_total").await,
        in_progress: metric("idempotency_in_progress_total").await,
        rollbacks: metric("idempotency_rollbacks_total").await,
    }
}

/// The stored resource id of `(tenant, endpoint, key)`.
async fn stored_resource_id(tenant: &str, endpoint: &str, key: &str) -> Option<uuid::Uuid> {
    pg(Database::Orders)
        .await
        .query_one(
            "SELECT resource_id FROM idempotency_requests \
             WHERE tenant_id = $1 AND endpoint = $2 AND idempotency_key = $3",
            &[&tenant, &endpoint, &key],
        )
        .await
        .expect("read key")
        .get(0)
}

/// Crash window of `order-api api-key create` (fail point
/// `order_api.api_key.after_commit`): the tenant and the key's hash are
/// committed, the key not printed. The process dies without a key on its
/// output; the lost key is a stored row no one can present (only its hash
/// is stored), and the next run prints a key that is stored beside it and
/// authenticates the tenant.
#[tokio::test]
async fn an_api_key_lost_to_a_crash_after_its_commit_is_replaced_by_the_next_run() {
    let tenant = unique_tenant("keycrash");
    let crashed = system_tests::api_key_command(&tenant)
        .env("FAILPOINTS", "order_api.api_key.after_commit=return")
        .output_within()
        .expect("run order-api api-key create");
    assert!(
        system_tests::system::aborted(&crashed.status),
        "aborted at the fail point: {:?}\n{}",
        crashed.status,
        String::from_utf8_lossy(&crashed.stderr)
    );
    assert!(crashed.stdout.is_empty(), "no key printed: {crashed:?}");
    let db = pg(Database::Orders).await;
    let keys = || async {
        db.query(
            "SELECT key_prefix FROM api_keys WHERE tenant_id = $1 AND revoked_at IS NULL \
             ORDER BY created_at",
            &[&tenant],
        )
        .await
        .expect("keys")
        .iter()
        .map(|row| row.get::<_, String>(0))
        .collect::<Vec<_>>()
    };
    let lost = keys().await;
    assert_eq!(lost.len(), 1, "the lost key's row is committed: {lost:?}");

    let key = api_key(&tenant);
    let stored = keys().await;
    assert_eq!(stored.len(), 2, "{stored:?}");
    assert_eq!(stored[1], key[..10], "the printed key is the new row");
    let api = OrderApi::start(&[]).await;
    let response = Client::new()
        .get(api.url(&format!("/orders/{}", uuid::Uuid::now_v7())))
        .bearer_auth(&key)
        .send()
        .await
        .expect("request");
    assert_eq!(
        response.status(),
        StatusCode::NOT_FOUND,
        "the new key authenticates (an unknown order, not 401)"
    );
}
