//! The idempotency contract of seed 004.
//!
//! One short transaction per request: claim `(tenant, endpoint, key)` with an
//! `INSERT ... ON CONFLICT DO NOTHING` (the unique primary key picks exactly
//! one owner; no SELECT-then-INSERT race; an expired record is taken over by
//! a conditional UPDATE); the owner runs the operation, stores status +
//! body + resource id in the same row and commits once; the response is sent
//! only after that commit. A loser waits on the owner's uncommitted row, at
//! most `lock_timeout` (set on every pooled session), then reads the committed
//! record: another fingerprint is 409 `idempotency_key_reused`; the same one is
//! the stored response byte for byte; a timeout is 409 `idempotency_in_progress`.
//!
//! Crash windows: before commit nothing is stored (the client retries and the
//! retry becomes the owner); after commit, before the response, the retry
//! replays the stored response. Both are fail points.

use std::{
    collections::BTreeMap,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use actix_web::{http::StatusCode, HttpRequest, HttpResponse};
use kit::failpoint::crash_point;
use uuid::Uuid;

use crate::{
    error::{ApiError, RejectedError, Rejection},
    operations,
    settings::SERVER_BACKSTOP_MS,
    AppState,
};

pub const HEADER: &str = "Idempotency-Key";
pub const REPLAYED_HEADER: &str = "Idempotent-Replayed";

/// The `Idempotency-Key` header: 1..=255 visible ASCII characters.
pub fn key(request: &HttpRequest) -> Result<String, ApiError> {
    let mut values = request.headers().get_all(HEADER);
    let value = values
        .next()
        .ok_or(ApiError::IdempotencyKey("the header is required"))?;
    if values.next().is_some() {
        return Err(ApiError::IdempotencyKey("send the header once"));
    }
    let bytes = value.as_bytes();
    if bytes.is_empty() {
        return Err(ApiError::IdempotencyKey("must not be empty"));
    }
    if bytes.len() > 255 {
        return Err(ApiError::IdempotencyKey("at most 255 characters"));
    }
    if !bytes.iter().all(|b| (0x21..=0x7e).contains(b)) {
        return Err(ApiError::IdempotencyKey(
            "only visible ASCII characters (no spaces or control characters)",
        ));
    }
    Ok(String::from_utf8_lossy(bytes).into_owned())
}

/// A response as stored with its key.
#[derive(Debug, Clone)]
pub struct Stored {
    pub status: u16,
    pub body: Vec<u8>,
    pub resource_id: Option<Uuid>,
}

impl Stored {
    /// A rejection's response: its problem, with the order it names.
    /// (Counted in `order_business_rejections_total` by its code.)
    fn of_rejection(metrics: &crate::metrics::Metrics, rejection: &Rejection) -> Stored {
        metrics
            .rejections
            .with_label_values(&[rejection.problem().code])
            .inc();
        Stored {
            status: rejection.problem().status,
            body: rejection.to_body(),
            resource_id: rejection.resource_id(),
        }
    }

    fn response(&self, replayed: bool) -> HttpResponse {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut response = HttpResponse::build(status);
        response.content_type(if status.is_success() {
            "application/json"
        } else {
            kit::http::PROBLEM_CONTENT_TYPE
        });
        // The created order, or the one a rejection points at (a checkout
        // already ordered under another key).
        if let Some(id) = self.resource_id {
            response.insert_header(("Location", format!("/orders/{id}")));
        }
        if replayed {
            response.insert_header((REPLAYED_HEADER, "true"));
        }
        response.body(self.body.clone())
    }
}

/// Requests whose owning transaction is running in this process, for the
/// "oldest incomplete key" gauge.
#[derive(Clone, Default)]
pub struct InFlight {
    next: Arc<AtomicU64>,
    started: Arc<Mutex<BTreeMap<u64, Instant>>>,
}

pub struct InFlightGuard {
    id: u64,
    started: Arc<Mutex<BTreeMap<u64, Instant>>>,
}

impl InFlight {
    fn enter(&self) -> InFlightGuard {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut started) = self.started.lock() {
            started.insert(id, Instant::now());
        }
        InFlightGuard {
            id,
            started: self.started.clone(),
        }
    }

    /// Age of the oldest running owner transaction.
    pub fn oldest(&self) -> Duration {
        self.started
            .lock()
            .ok()
            .and_then(|s| s.values().min().map(Instant::elapsed))
            .unwrap_or_default()
    }
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        if let Ok(mut started) = self.started.lock() {
            started.remove(&self.id);
        }
    }
}

/// Claim a new key (DESIGN.md section 5, seed 004: `INSERT ... ON CONFLICT
/// DO NOTHING RETURNING`). A key whose owner is in flight makes the insert
/// wait for that owner, at most the session's `lock_timeout`; a committed
/// key is left alone (not even locked: replays of one key run side by side).
pub const CLAIM: &str = "\
INSERT INTO idempotency_requests
    (tenant_id, endpoint, idempotency_key, request_fingerprint, expires_at)
VALUES ($1, $2, $3, $4, now() + ($5::bigint || ' seconds')::interval)
ON CONFLICT (tenant_id, endpoint, idempotency_key) DO NOTHING
RETURNING 1";

/// Take over an expired record the cleanup has not deleted yet (after expiry
/// a key is a new operation). Of concurrent takers, one updates the row; the
/// others wait for it (bounded by `lock_timeout`), find it no longer expired
/// and read what it stored. It is the owner's claim, in the owner's
/// transaction: a crash before its commit (`order_api.before_commit`) rolls
/// it back, and the record is expired again for the retry to take over.
pub const TAKE_OVER: &str = "\
UPDATE idempotency_requests
   SET request_fingerprint = $4, response_status = NULL, response_body = NULL,
       resource_id = NULL, created_at = now(),
       expires_at = now() + ($5::bigint || ' seconds')::interval
 WHERE tenant_id = $1 AND endpoint = $2 AND idempotency_key = $3
   AND expires_at <= now()
RETURNING 1";

/// Store the outcome with the key (same transaction as the operation). The
/// retention counts from here, the outcome's time (`clock_timestamp()`),
/// not from the transaction's start (`now()`, the claim's): a transaction
/// that ran longer than `ttl_seconds` (a short TTL against a long request
/// budget) would otherwise commit a record already expired, and the retry
/// of a lost response would take the key over and run the operation again
/// instead of replaying it.
pub const STORE: &str = "\
UPDATE idempotency_requests
   SET response_status = $4, response_body = $5, resource_id = $6,
       expires_at = clock_timestamp() + ($7::bigint || ' seconds')::interval
 WHERE tenant_id = $1 AND endpoint = $2 AND idempotency_key = $3";

const READ: &str = "\
SELECT request_fingerprint, response_status, response_body, resource_id,
       expires_at <= now()
  FROM idempotency_requests
 WHERE tenant_id = $1 AND endpoint = $2 AND idempotency_key = $3";

/// The time budget of one request (`idempotency.request_budget_ms`), taken
/// when the request starts: the pool wait and the whole transaction up to
/// COMMIT end within it.
#[derive(Clone, Copy, Debug)]
pub struct Deadline {
    at: tokio::time::Instant,
    budget_ms: u64,
}

/// How often the statement running past the budget is cancelled again, until
/// the transaction's work returns (a cancel that reaches the server between
/// two statements is ignored there).
const CANCEL_AGAIN: Duration = Duration::from_millis(100);

impl Deadline {
    pub fn start(budget_ms: u64) -> Self {
        Self {
            at: tokio::time::Instant::now() + Duration::from_millis(budget_ms),
            budget_ms,
        }
    }

    /// Whole milliseconds left (0: none).
    fn left_ms(&self) -> u64 {
        let left = self
            .at
            .saturating_duration_since(tokio::time::Instant::now());
        u64::try_from(left.as_millis()).unwrap_or(u64::MAX)
    }

    /// When work on the database past the deadline is given up on the
    /// client's side: [`SERVER_BACKSTOP_MS`] after it, when the server's
    /// own `statement_timeout` has ended the statement. Reached only when
    /// neither the cancel nor the server's answer gets through (a network
    /// partition, a server that froze): without it, the request waited for
    /// TCP to give up instead of answering at its budget.
    fn backstop(&self) -> tokio::time::Instant {
        self.at + Duration::from_millis(SERVER_BACKSTOP_MS)
    }

    fn passed(&self) -> bool {
        tokio::time::Instant::now() >= self.at
    }

    pub fn exceeded(&self) -> ApiError {
        ApiError::DeadlineExceeded {
            budget_ms: self.budget_ms,
        }
    }

    /// Work that is not the database's (reading the request's body) within
    /// the budget left: a body slower than that is answered at the
    /// deadline, 503 `deadline_exceeded`, not waited on for as long as the
    /// client keeps its connection open.
    pub async fn within<T>(
        &self,
        work: impl std::future::Future<Output = Result<T, ApiError>>,
    ) -> Result<T, ApiError> {
        tokio::time::timeout_at(self.at, work)
            .await
            .unwrap_or_else(|_| Err(self.exceeded()))
    }

    /// A pooled connection, waited for at most the budget left.
    pub async fn client(
        &self,
        pool: &deadpool_postgres::Pool,
    ) -> Result<deadpool_postgres::Client, ApiError> {
        match tokio::time::timeout_at(self.at, pool.get()).await {
            Ok(client) => Ok(client?),
            Err(_) => Err(self.exceeded()),
        }
    }

    /// A read before the request's transaction (the caller's key, an
    /// order's currency, a GET's order) on a pooled connection, within the
    /// budget as the transaction is: the pool's wait and the statements end
    /// at the deadline (the statement then running is cancelled:
    /// [`Self::bound`]), answered 503 `deadline_exceeded`. Without it such a
    /// read waited on a lock up to `lock_timeout` and `statement_timeout`,
    /// past the budget the client was promised an answer within. Should the
    /// cancel not reach the server, the read is given up
    /// [`SERVER_BACKSTOP_MS`] after the deadline (the transaction's backstop
    /// is the server's `statement_timeout`; a read has none). The
    /// connection is closed, not pooled ([`Held`]), after a cancel, after
    /// giving up, and when the request itself is dropped mid-read.
    pub async fn read<T>(
        &self,
        pool: &deadpool_postgres::Pool,
        work: impl AsyncFnOnce(&deadpool_postgres::Client) -> Result<T, ApiError>,
    ) -> Result<T, ApiError> {
        if self.passed() {
            return Err(self.exceeded());
        }
        let mut held = Held {
            client: Some(self.client(pool).await?),
            released: false,
        };
        let Some(client) = held.client.as_ref() else {
            return Err(self.exceeded());
        };
        let backstop = self.backstop();
        let cancel = client.cancel_token();
        let bounded = self.bound(&cancel, work(client));
        let Ok((outcome, cancelled)) = tokio::time::timeout_at(backstop, bounded).await else {
            // Given up with the statement maybe still running: `held`, not
            // released, closes the connection.
            return Err(self.exceeded());
        };
        // Ended by itself: the connection may serve another request.
        held.released = releasable(cancelled, &outcome);
        match outcome {
            Err(ApiError::Database(_)) if cancelled => Err(self.exceeded()),
            outcome => outcome,
        }
    }

    /// `work` (the transaction's statements), ended at the deadline: the
    /// statement running then is cancelled (a cancel request to the server,
    /// only on this path), again every [`CANCEL_AGAIN`] until `work`
    /// returns; the cancels are sent while `work` goes on being polled.
    /// The server bounds each statement by itself too, a little later
    /// (`statement_timeout`, see [`execute`]): this ends the sum. Also
    /// returns whether a cancel was sent: a cancel request is delivered to
    /// the session
    /// asynchronously (tokio-postgres does not wait for the server to act on
    /// it), so it may still reach the session after `work` returned, and
    /// that connection must not serve another request: the caller's
    /// [`Held`] is released only when no cancel was sent, and closes it
    /// otherwise (also when the request is dropped while the cancel is
    /// under way).
    async fn bound<T>(
        &self,
        cancel: &tokio_postgres::CancelToken,
        work: impl std::future::Future<Output = Result<T, ApiError>>,
    ) -> (Result<T, ApiError>, bool) {
        tokio::pin!(work);
        if let Ok(done) = tokio::time::timeout_at(self.at, &mut work).await {
            return (done, false);
        }
        loop {
            let cancel_then_pause = async {
                if let Err(error) = cancel.cancel_query(tokio_postgres::NoTls).await {
                    tracing::warn!(%error, "cancelling the statement past the request budget failed");
                }
                tokio::time::sleep(CANCEL_AGAIN).await;
            };
            tokio::select! {
                done = &mut work => return (done, true),
                () = cancel_then_pause => {}
            }
        }
    }
}

/// A pooled connection that goes back to the pool only when released: once
/// its statements ended by themselves, before the deadline
/// ([`Deadline::bound`] sent no cancel). Closed otherwise: after a cancel (it
/// reaches its session asynchronously and would end another request's
/// statement), and when the request is dropped mid-work (its client gone:
/// actix drops the handler), a statement maybe still running on the server
/// (the next request would queue behind it) or a cancel under way.
struct Held {
    client: Option<deadpool_postgres::Client>,
    released: bool,
}

/// Whether a [`Held`] connection may go back to the pool once its work
/// ended by itself: no cancel was sent (`cancelled`: it may still reach the
/// session), and the work did not fail in a way that stays with the
/// session ([`kit::db::session_fault`]: on a standby after a failover,
/// every write of the session fails for its life, and the pool, handing
/// out the last connection returned first, would give it to the next
/// request).
fn releasable<T>(cancelled: bool, outcome: &Result<T, ApiError>) -> bool {
    let session_fault = matches!(
        outcome,
        Err(ApiError::Database(error)) if kit::db::session_fault(error)
    );
    !cancelled && !session_fault
}

impl Drop for Held {
    fn drop(&mut self) {
        if let Some(client) = self.client.take() {
            if !self.released {
                discard(client);
            }
        }
    }
}

/// Close `client`'s connection instead of returning it to the pool (a
/// cancel sent to its session may still arrive).
fn discard(client: deadpool_postgres::Client) {
    drop(deadpool_postgres::Object::take(client));
}

/// What the transaction's work before COMMIT came to.
enum Step {
    /// A loser's answer (read-only; nothing to commit).
    Answer(HttpResponse),
    /// The owner's response to store, committed next.
    Owner(Stored, InFlightGuard),
}

/// What a committed record of the key (a [`READ`] row) answers a request of
/// `fingerprint` (or of one of the `earlier` fingerprints of the same
/// request): its stored response, replayed, or 409
/// `idempotency_key_reused`. `None` for a record without a response, which
/// cannot be committed (claim and response are one transaction): defensive.
fn answer_of_record(
    metrics: &crate::metrics::Metrics,
    (endpoint, key_hash): (&'static str, &str),
    row: &tokio_postgres::Row,
    (fingerprint, earlier): (&str, &[String]),
) -> Option<Result<HttpResponse, ApiError>> {
    let stored_fingerprint: String = row.get(0);
    if stored_fingerprint != fingerprint && !earlier.contains(&stored_fingerprint) {
        metrics.key_conflicts.with_label_values(&[endpoint]).inc();
        tracing::info!(
            endpoint,
            key_hash,
            "idempotency key reused with another request"
        );
        return Some(Err(ApiError::KeyReused));
    }
    let (Some(status), Some(body)) = (row.get::<_, Option<i32>>(1), row.get(2)) else {
        return None;
    };
    metrics.replays.with_label_values(&[endpoint]).inc();
    tracing::info!(endpoint, key_hash, status, "idempotent replay");
    let stored = Stored {
        status: u16::try_from(status).unwrap_or(500),
        body,
        resource_id: row.get(3),
    };
    Some(Ok(stored.response(true)))
}

/// The first 16 hex digits of the key's hash: what the logs name it by.
fn key_hash(key: &str) -> String {
    blake3::hash(key.as_bytes()).to_hex().as_str()[..16].to_owned()
}

/// A request refused by a rule checked once its key is known to hold no
/// stored record of it (a name an earlier release took:
/// `request::clear_name`; called instead of [`execute`]): the key's record is only read
/// (nothing claimed, no row written, no wait behind an owner in flight). A
/// live record of the same request replays (an earlier release took it); of
/// another request, 409 `idempotency_key_reused`; an order whose checkout an
/// earlier release ordered is answered as the order path answers it (409
/// naming that order; not stored); anything else gets the refusal.
pub async fn refuse(
    state: &AppState,
    tenant: &str,
    endpoint: &'static str,
    key: &str,
    (fingerprint, earlier): (&str, &[String]),
    (refusal, checkout): (ApiError, Option<String>),
    deadline: Deadline,
) -> Result<HttpResponse, ApiError> {
    let metrics = &state.metrics;
    let (record, ordered) = deadline
        .read(&state.pool, async |client| {
            let read = client.prepare_cached(READ).await?;
            let record = client.query_opt(&read, &[&tenant, &endpoint, &key]).await?;
            let ordered = match &checkout {
                Some(checkout) => operations::checkout_order(client, tenant, checkout).await?,
                None => None,
            };
            Ok((record, ordered))
        })
        .await?;
    // An expired record is no longer the key's (the next claim takes it over).
    if let Some(row) = record.filter(|row| !row.get::<_, bool>(4)) {
        let key_hash = key_hash(key);
        return answer_of_record(metrics, (endpoint, &key_hash), &row, (fingerprint, earlier))
            .unwrap_or(Err(ApiError::InProgress));
    }
    if let (Some(checkout_id), Some(order_id)) = (checkout, ordered) {
        let rejection = Rejection::CheckoutAlreadyOrdered {
            checkout_id,
            order_id,
        };
        return Ok(Stored::of_rejection(metrics, &rejection).response(false));
    }
    Err(refusal)
}

/// Run `operation` at most once per `(tenant, endpoint, key)` and answer with
/// its response, or with the stored response of the run that did.
/// `earlier` are the fingerprints an earlier release computed for the same
/// request (its canonical form changed since): a record stored under one of
/// them is the same request, not a reused key. Everything up to COMMIT runs
/// within `deadline`; past it, the transaction rolls back and the answer is
/// 503 `deadline_exceeded` (409 `idempotency_in_progress` only when
/// `lock_timeout` ended a wait for the key's owner first).
pub async fn execute(
    state: &AppState,
    tenant: &str,
    endpoint: &'static str,
    key: &str,
    (fingerprint, earlier): (&str, &[String]),
    operation: operations::Operation,
    deadline: Deadline,
) -> Result<HttpResponse, ApiError> {
    let metrics = &state.metrics;
    let key_hash = &key_hash(key);
    let ttl = i64::try_from(state.settings.idempotency.ttl_seconds).unwrap_or(i64::MAX);

    let mut held = Held {
        client: Some(deadline.client(&state.pool).await?),
        released: false,
    };
    let Some(client) = held.client.as_mut() else {
        return Err(deadline.exceeded());
    };
    if kit::failpoint::error_point("order_api.session_read_only") {
        // A test's stand-in for a session on a standby: every write of the
        // session fails from here on (25006).
        client
            .batch_execute("SET SESSION default_transaction_read_only = on")
            .await?;
    }
    // BEGIN and the work are given up at the backstop (nothing committed:
    // COMMIT is not sent), the connection closed, not pooled (`held`).
    let backstop = deadline.backstop();
    let Ok(tx) = tokio::time::timeout_at(backstop, client.transaction()).await else {
        return Err(deadline.exceeded());
    };
    let tx = tx?;
    let in_progress = |why: &'static str| {
        metrics.in_progress.with_label_values(&[endpoint]).inc();
        tracing::info!(endpoint, key_hash, why, "idempotency key in progress");
        ApiError::InProgress
    };
    let rolled_back = |error: &ApiError| {
        metrics.rollbacks.with_label_values(&[endpoint]).inc();
        tracing::warn!(endpoint, key_hash, %error, "owner transaction rolled back");
    };
    // Whether the work became the key's owner (for the backstop's count).
    let owner = std::sync::atomic::AtomicBool::new(false);
    let work = async {
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 5] =
            [&tenant, &endpoint, &key, &fingerprint, &ttl];
        let claim = tx.prepare_cached(CLAIM).await?;
        // Each statement of the transaction ends by itself shortly after the
        // budget left now (`statement_timeout`, [`SERVER_BACKSTOP_MS`] past
        // it; settings.rs keeps that within the sessions' own; 0 would mean
        // none), should the cancel at the deadline not reach the server.
        // Sent with the claim, in one write: `join` polls the SET first, and
        // a request is queued on the connection when first polled; the
        // server runs them in order. No extra round trip.
        let left_ms = deadline.left_ms();
        if left_ms == 0 {
            return Err(deadline.exceeded());
        }
        let limit = format!(
            "SET LOCAL statement_timeout = {}",
            left_ms + 1 + SERVER_BACKSTOP_MS
        );
        // Whether a claim or a takeover won the key. A wait for the key's
        // owner that the lock_timeout ended: the owner is still in flight.
        // (A claim the budget ended, whether it waited for an owner or not,
        // is the budget's 503: only the lock timeout tells a wait for an
        // owner apart.)
        // `first`: the transaction's first statement on the table. A lock
        // timeout there may be a wait for the whole table (an operator's
        // LOCK TABLE: no owner in flight, 503); once it has run, the
        // transaction holds the table, and every later wait is for a row.
        let won = |statement: tokio_postgres::Statement, first: bool| {
            let (tx, params) = (&tx, &params);
            async move {
                match tx.query_opt(&statement, params).await {
                    Ok(row) => Ok(row.is_some()),
                    Err(error)
                        if ApiError::is_lock_timeout(&error)
                            && (!first || waited_on_a_row(&error)) =>
                    {
                        Err(in_progress("the wait for the key's owner ran out"))
                    }
                    Err(error) => Err(ApiError::from(error)),
                }
            }
        };
        let (limited, claimed) =
            futures_util::future::join(tx.batch_execute(&limit), won(claim.clone(), true)).await;
        limited?;
        let mut claimed = claimed?;
        // The key's record as committed now. Prepared only when read: an
        // owner never reads (on a fresh pooled connection the preparation
        // is a round trip).
        let read = || async {
            let read = tx.prepare_cached(READ).await?;
            tx.query_opt(&read, &[&tenant, &endpoint, &key]).await
        };
        let mut existing = None;
        if !claimed {
            existing = read().await?;
            if existing.as_ref().is_some_and(|row| row.get::<_, bool>(4)) {
                let take_over = tx.prepare_cached(TAKE_OVER).await?;
                claimed = won(take_over, false).await?;
                if !claimed {
                    // Another request took it over (and committed): its record.
                    existing = read().await?;
                }
            }
        }

        if !claimed && existing.is_none() {
            // The cleanup deleted the record between the claim and the read
            // (or under the takeover's lock wait). It deletes only expired
            // records, so the key is free, and its reuse is a new operation
            // (seed 004): claim it again, once.
            claimed = won(claim, false).await?;
            if !claimed {
                existing = read().await?;
            }
        }

        if !claimed {
            let Some(row) = existing else {
                // Deleted again under the second claim (another request
                // claimed it and the cleanup took it: hardly ever): ask for a
                // retry.
                return Err(in_progress(
                    "the record was deleted by the cleanup meanwhile",
                ));
            };
            return match answer_of_record(
                metrics,
                (endpoint, key_hash),
                &row,
                (fingerprint, earlier),
            ) {
                Some(answer) => answer.map(Step::Answer),
                None => Err(in_progress("the record has no response")),
            };
        }

        // The owner. Any error below drops `tx` uncommitted: nothing is stored.
        owner.store(true, std::sync::atomic::Ordering::Relaxed);
        let in_flight = state.in_flight.enter();
        let rollback = |error: ApiError| {
            let error = match &error {
                // The budget ended the statement (or the one after it).
                ApiError::Database(_) if deadline.passed() => deadline.exceeded(),
                ApiError::Database(db) if ApiError::is_lock_timeout(db) => ApiError::Busy,
                _ => error,
            };
            rolled_back(&error);
            error
        };
        let stored = match operations::run(&tx, tenant, operation).await {
            Ok(Ok(stored)) => stored,
            // A rejection by a state that can still change (a delivery before the
            // payment) is not stored: the transaction rolls back, the key stays
            // free, and the same request under the same key succeeds once the
            // state allows it. Only final rejections are replayed (seed 004:
            // "a deterministic business rejection").
            Ok(Err(rejection)) if !rejection.is_final() => {
                metrics
                    .rejections
                    .with_label_values(&[rejection.problem().code])
                    .inc();
                return Err(ApiError::Rejected(RejectedError(rejection)));
            }
            Ok(Err(rejection)) => Stored::of_rejection(metrics, &rejection),
            Err(error) => return Err(rollback(error)),
        };
        let status = i32::from(stored.status);
        let store = tx
            .prepare_cached(STORE)
            .await
            .map_err(|e| rollback(e.into()))?;
        let stored_rows = tx
            .execute(
                &store,
                &[
                    &tenant,
                    &endpoint,
                    &key,
                    &status,
                    &stored.body,
                    &stored.resource_id,
                    &ttl,
                ],
            )
            .await
            .map_err(|e| rollback(e.into()))?;
        // The claimed row is this transaction's (inserted or locked by it), so
        // exactly one row is updated; anything else would commit an operation
        // whose key has no stored response, and a retry would run it again.
        if stored_rows != 1 {
            return Err(rollback(ApiError::Internal(format!(
                "storing the response updated {stored_rows} idempotency rows, not 1"
            ))));
        }
        Ok(Step::Owner(stored, in_flight))
    };
    let Ok((outcome, cancelled)) =
        tokio::time::timeout_at(backstop, deadline.bound(&tx.cancel_token(), work)).await
    else {
        // The statement may still run on the server until its
        // statement_timeout; the transaction is never committed.
        let error = deadline.exceeded();
        if owner.load(std::sync::atomic::Ordering::Relaxed) {
            rolled_back(&error);
        } else {
            tracing::warn!(endpoint, key_hash, %error, "no answer from the database: given up");
        }
        return Err(error);
    };
    // The work ended by itself: from here (answers, COMMIT) the connection
    // may go back to the pool.
    held.released = releasable(cancelled, &outcome);
    if cancelled {
        // Past the deadline: nothing is committed, and the connection, which
        // a late cancel may still reach, is closed, not pooled (`held`).
        drop(tx);
        return match outcome {
            Ok(Step::Answer(response)) => Ok(response),
            Ok(Step::Owner(..)) => {
                let error = deadline.exceeded();
                rolled_back(&error);
                Err(error)
            }
            Err(ApiError::Database(_)) => Err(deadline.exceeded()),
            Err(error) => Err(error),
        };
    }
    let (stored, _in_flight) = match outcome {
        Ok(Step::Answer(response)) => return Ok(response),
        Ok(Step::Owner(stored, in_flight)) => (stored, in_flight),
        // A loser's read cancelled at the deadline.
        Err(ApiError::Database(_)) if deadline.passed() => return Err(deadline.exceeded()),
        Err(error) => return Err(error),
    };
    // The budget ran out before COMMIT is sent (the work ended just then, or
    // a cancel reached the server between two statements): the client is
    // told that nothing was stored, so nothing may be.
    if deadline.passed() {
        let error = deadline.exceeded();
        rolled_back(&error);
        return Err(error);
    }
    // From COMMIT sent until answered, a request dropped (its client gone)
    // must not pool the connection: the next request would queue behind the
    // pending COMMIT. Released again once COMMIT returns (no cancel was
    // sent: a cancelled transaction returned above).
    held.released = false;
    // A success wrote its event's outbox row: the relay is woken once its
    // COMMIT is answered, or may have been applied (the session's trigger
    // does not: `wake`).
    let wrote_an_event = (200..300).contains(&stored.status);
    crash_point("order_api.before_commit");
    // Where a test holds the request to partition the database away before
    // COMMIT is sent (a no-op unless armed).
    kit::failpoint::hold_task("order_api.committing").await;
    // COMMIT is bounded too, at the same backstop: should the database stop
    // answering once it is sent (a network partition, a server that froze),
    // the request is answered there, not when TCP gives up. The outcome is
    // then unknown (the COMMIT may be held on its way and still arrive), so
    // the answer says so: a retry under the same key replays the stored
    // response if it committed and runs the request if it did not. The
    // connection, a COMMIT maybe still pending on it, is closed, not pooled.
    let Ok(committed) = tokio::time::timeout_at(backstop, tx.commit()).await else {
        let error = ApiError::CommitUnanswered {
            budget_ms: deadline.budget_ms,
        };
        metrics.commit_unknown.with_label_values(&[endpoint]).inc();
        tracing::warn!(endpoint, key_hash, %error, "no answer to COMMIT: given up (a retry under the same key replays it if it committed)");
        // It may have committed: the wake-up costs nothing if it did not.
        if wrote_an_event {
            state.relay_waker.wake();
        }
        return Err(error);
    };
    // COMMIT answered (a failure included: a dropped connection is closed
    // and discarded by the pool's check).
    held.released = true;
    committed.map_err(|e| {
        // COMMIT takes no lock of its own since orders V18 (the outbox
        // trigger's NOTIFY, whose queue lock each committing writer held
        // through its WAL flush, is off in these sessions: `wake`); should
        // one time out here all the same (a trigger added by hand), it is
        // the database's, not the order's: a 503 unavailable, not
        // order_busy.
        // Unless the error says the transaction was rolled back, the server
        // may have committed (the connection dropped; the backend ended by
        // an administrator while it waited for a synchronous standby, after
        // its local commit): the answer must not say that nothing was stored.
        let error = if commit_surely_failed(e.code()) {
            metrics.rollbacks.with_label_values(&[endpoint]).inc();
            ApiError::from(e)
        } else {
            metrics.commit_unknown.with_label_values(&[endpoint]).inc();
            // It may have committed (see `wrote_an_event`).
            if wrote_an_event {
                state.relay_waker.wake();
            }
            ApiError::Commit(e)
        };
        tracing::warn!(endpoint, key_hash, %error, "commit failed (a retry under the same key replays it if it committed)");
        error
    })?;
    // (A crash here loses the wake-up, not the event: `wake`.)
    crash_point("order_api.after_commit");
    if wrote_an_event {
        state.relay_waker.wake();
    }
    metrics.claims.with_label_values(&[endpoint]).inc();
    let status = stored.status;
    tracing::info!(
        endpoint,
        key_hash,
        status,
        "idempotency key claimed and committed"
    );
    Ok(stored.response(false))
}

/// Whether the key claim's lock timeout ended a wait for a row's
/// transaction (the key's owner, in flight, inserted the key's row), not
/// for the whole table (an operator's `LOCK TABLE`, a `REINDEX`: no key
/// owner, a database that cannot serve, 503). PostgreSQL gives the error a
/// context ("while inserting index tuple ...", in the server's language)
/// when the insert waited for a row's transaction, none for a table lock.
fn waited_on_a_row(error: &tokio_postgres::Error) -> bool {
    error.as_db_error().is_some_and(|db| db.where_().is_some())
}

/// Whether a COMMIT that failed with SQLSTATE `code` certainly rolled its
/// transaction back: a transaction rollback (40001 serialization, 40002
/// integrity, 40P01 deadlock; not 40003, "statement completion unknown"),
/// an integrity check deferred to COMMIT (23), a lock not got in time
/// (55P03) or a statement cancelled (57014), all raised
/// before the commit record is written. Anything else (no SQLSTATE: the
/// connection dropped; 57P01: the backend terminated, possibly while
/// waiting for a synchronous standby after committing locally; 08: the
/// connection; 40003) leaves the outcome unknown.
fn commit_surely_failed(code: Option<&tokio_postgres::error::SqlState>) -> bool {
    code.map(tokio_postgres::error::SqlState::code)
        .is_some_and(|code| {
            ["40001", "40002", "40P01", "55P03", "57014"].contains(&code) || code.starts_with("23")
        })
}

#[cfg(test)]
mod tests {
    use actix_web::test::TestRequest;

    use super::*;

    fn check(value: Option<&[u8]>) -> Result<String, ApiError> {
        let mut request = TestRequest::default();
        if let Some(v) = value {
            request = request.insert_header((
                HEADER,
                actix_web::http::header::HeaderValue::from_bytes(v).expect("header"),
            ));
        }
        key(&request.to_http_request())
    }

    #[test]
    fn keys_are_one_to_255_visible_ascii_characters() {
        assert_eq!(check(Some(b"a")).expect("ok"), "a");
        assert!(check(Some("k".repeat(255).as_bytes())).is_ok());
        assert!(check(Some(b"order-1042:retry/1~")).is_ok());
        for bad in [
            None,
            Some(&b""[..]),
            Some("k".repeat(256).as_bytes()),
            Some(&b"has space"[..]),
            Some(&b"tab\there"[..]),
            Some("caf\u{e9}".as_bytes()),
        ] {
            let error = check(bad).expect_err("must be rejected");
            assert_eq!(error.problem().status, 400, "{bad:?}");
            assert_eq!(error.problem().code, "invalid_idempotency_key");
        }
    }

    #[test]
    fn only_a_commit_error_that_says_so_is_taken_for_a_rollback() {
        use tokio_postgres::error::SqlState;
        for rolled_back in [
            SqlState::T_R_SERIALIZATION_FAILURE,
            SqlState::T_R_DEADLOCK_DETECTED,
            SqlState::CHECK_VIOLATION,
            SqlState::LOCK_NOT_AVAILABLE,
            SqlState::QUERY_CANCELED,
        ] {
            assert!(commit_surely_failed(Some(&rolled_back)), "{rolled_back:?}");
        }
        for unknown in [
            SqlState::ADMIN_SHUTDOWN,
            SqlState::CRASH_SHUTDOWN,
            SqlState::CONNECTION_FAILURE,
            SqlState::IO_ERROR,
            SqlState::T_R_STATEMENT_COMPLETION_UNKNOWN,
        ] {
            assert!(!commit_surely_failed(Some(&unknown)), "{unknown:?}");
        }
        assert!(
            !commit_surely_failed(None),
            "no SQLSTATE: the connection dropped"
        );
    }
}
