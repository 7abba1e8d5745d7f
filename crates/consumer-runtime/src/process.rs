//! One message, one transaction of the consumer's database (DESIGN.md
//! section 8):
//!
//! 1. `INSERT INTO processed_events ... ON CONFLICT DO NOTHING RETURNING`:
//!    nothing returned = a duplicate (ack, count).
//! 2. The order's progress row, locked (`FOR UPDATE`): sequence <= last
//!    applied = stale (ack); parked behind a dead letter = straight to the DLQ;
//!    sequence > last + 1 = a gap: roll back, defer through retry tier 0 (not a
//!    failed attempt) up to `max_deferrals` times; past them each arrival
//!    still at the gap is a gap failure (`x-consumer-gap-failures`, counted
//!    apart from the handler's `x-consumer-attempts`) through the retry
//!    tiers, the event dead-lettered and its order parked after
//!    `max_attempts` of them.
//! 3. Advance `last_sequence` and run the domain handler, in the same
//!    transaction; commit; then ack.
//!
//! Steps 1 and 2 and the advance (conditional: only the next sequence of an
//! unparked order) are sent in one round trip ([`open_message`]); the
//! decisions are taken on their results, before the domain handler runs.
//!
//! A handler error rolls everything back and the message goes to the next
//! retry tier (published with a confirm, then acked); after `max_attempts`
//! failures it goes to the dead-letter queue and the order is parked, in the
//! transaction that records it. Poison (malformed body, unknown major schema
//! version) goes to the dead-letter queue at once.

use std::sync::Arc;
use std::time::{Duration, Instant};

use events::{DecodeError, Event, RawEnvelope};
use futures_util::FutureExt;
use kit::db::PgPool;
use lapin::{
    message::Delivery,
    options::BasicPublishOptions,
    types::{FieldTable, ShortString},
    BasicProperties, Channel,
};
use time::OffsetDateTime;

use crate::{
    metrics::Metrics,
    topology::{self, headers, Topology},
    Domain, HandlerError,
};

/// What happened to a message (it is acknowledged in every case).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Applied {
        event_type: String,
    },
    Duplicate,
    Stale,
    Deferred,
    Retried {
        tier: usize,
    },
    DeadLettered {
        reason: String,
    },
    /// Another tenant's event, outside `only_tenants`.
    Filtered,
}

/// Why a message could not be settled now. The message is not acknowledged.
#[derive(Debug, thiserror::Error)]
pub enum Infra {
    /// The database is unreachable or a runtime statement failed: try the same
    /// message again after a pause (it is not the event's fault).
    #[error("database: {0}")]
    Database(String),
    /// A publish was not confirmed or the channel failed: the same message
    /// is settled again in place on a renewed channel (a new connection
    /// only when the publishing connection is down).
    #[error("broker: {0}")]
    Broker(String),
}

impl From<tokio_postgres::Error> for Infra {
    fn from(error: tokio_postgres::Error) -> Self {
        Infra::Database(kit::db::describe(&error))
    }
}

impl From<deadpool_postgres::PoolError> for Infra {
    fn from(error: deadpool_postgres::PoolError) -> Self {
        Infra::Database(kit::db::describe(&error))
    }
}

/// Everything a partition worker needs.
pub struct Processor<D: Domain> {
    pub domain: Arc<D>,
    pub pool: PgPool,
    pub topology: Topology,
    pub metrics: Metrics,
    pub max_attempts: u32,
    pub max_deferrals: u32,
    /// `Some`: apply only these tenants' events (see `ConsumerSettings::only_tenants`).
    pub only_tenants: Option<Vec<String>>,
}

/// The facts about one message the decisions need.
#[derive(Clone, Copy)]
struct Incoming<'a> {
    delivery: &'a Delivery,
    attempts: u32,
    deferrals: u32,
    gap_failures: u32,
}

/// What failed: the domain handler, or the wait for an earlier event of the
/// order past `max_deferrals` (each counted on its own).
#[derive(Clone, Copy)]
enum Failure {
    Handler,
    Gap,
}

enum Decoded {
    /// A valid envelope; `None` event = an event type this build does not know.
    Ok(RawEnvelope, Option<Event>),
    /// A valid envelope whose payload is poison (unknown major version, invalid payload).
    PoisonPayload(RawEnvelope, DecodeError),
    /// Not an envelope at all.
    Malformed(DecodeError),
}

/// The event and order a message is about: from its envelope, or, when the
/// body cannot be read, from the AMQP metadata the relay sets from the
/// outbox row (`message_id`, headers `tenant_id`, `aggregate_id`,
/// `aggregate_sequence`). Enough to park the order behind the message.
#[derive(Clone, Copy, Debug)]
struct OrderRef<'a> {
    event_id: uuid::Uuid,
    tenant_id: &'a str,
    aggregate_id: &'a str,
    sequence: i64,
}

impl<'a> From<&'a RawEnvelope> for OrderRef<'a> {
    fn from(raw: &'a RawEnvelope) -> Self {
        OrderRef {
            event_id: raw.event_id,
            tenant_id: &raw.tenant_id,
            aggregate_id: &raw.aggregate_id,
            sequence: raw.aggregate_sequence,
        }
    }
}

/// What a message's metadata says about its event (see [`OrderRef`]):
/// `(event id, tenant, order, sequence)`, `None` when any of them is
/// missing or unusable.
fn named_by_metadata(delivery: &Delivery) -> Option<(uuid::Uuid, String, String, i64)> {
    let headers = delivery.properties.headers().as_ref();
    let event_id = delivery
        .properties
        .message_id()
        .as_ref()?
        .as_str()
        .parse()
        .ok()?;
    let tenant = topology::str_header(headers, events::headers::TENANT_ID)?;
    let order = topology::str_header(headers, events::headers::AGGREGATE_ID)?;
    let sequence = topology::int_header(headers, events::headers::AGGREGATE_SEQUENCE)
        .filter(|sequence| *sequence >= 1)?;
    Some((event_id, tenant, order, sequence))
}

/// The inbox row: the event applied once per consumer name, with the
/// event's tenant (`$3`; DESIGN.md section 3: every row carries one).
pub const INSERT_INBOX: &str = "INSERT INTO processed_events (consumer_name, event_id, \
     tenant_id) VALUES ($1, $2, $3) ON CONFLICT DO NOTHING RETURNING event_id";
/// The order's progress row, created on its first event.
pub const INSERT_PROGRESS: &str = "INSERT INTO order_progress (consumer_name, aggregate_id, \
     tenant_id) VALUES ($1, $2, $3) ON CONFLICT DO NOTHING";
/// The order's progress, locked for the transaction; whether the order is
/// parked for sequence `$3` (at or after its lowest dead-lettered event;
/// a row parked without a sequence holds the whole order); the order's
/// tenant (its first applied event's; while nothing is applied, whatever
/// the event or dead letter that created the row named).
pub const LOCK_PROGRESS: &str = "SELECT last_sequence, parked_at IS NOT NULL \
     AND $3::bigint >= COALESCE(parked_sequence, 0), parked_event_id, parked_reason, tenant_id \
     FROM order_progress WHERE consumer_name = $1 AND aggregate_id = $2 FOR UPDATE";
/// The last applied sequence moves on, only if `$3` is the next one and the
/// order is not parked for it (it runs before the runtime has seen the
/// progress row: see [`open_message`]). The first applied event sets the
/// order's tenant (`$4`): a row a dead letter created (parked before any
/// event applied) holds that letter's tenant, which proves nothing.
pub const ADVANCE_PROGRESS: &str = "UPDATE order_progress SET last_sequence = $3, \
     tenant_id = CASE WHEN last_sequence = 0 THEN $4 ELSE tenant_id END, \
     updated_at = now() WHERE consumer_name = $1 AND aggregate_id = $2 \
     AND last_sequence = $3::bigint - 1 \
     AND (parked_at IS NULL OR $3::bigint < COALESCE(parked_sequence, 0))";

/// What the first four statements of a message's transaction found.
#[derive(Debug)]
pub struct Opened {
    /// The inbox row was new (false: a duplicate).
    pub new: bool,
    /// The order's last applied sequence before this event.
    pub last: i64,
    /// Parked behind a dead letter: (its event, the reason).
    pub parked: Option<(Option<uuid::Uuid>, Option<String>)>,
    /// The progress moved to this event's sequence (in order, not parked).
    pub advanced: bool,
    /// The order's tenant: its first applied event's (while nothing is
    /// applied, `last` = 0, whatever event created the row named).
    pub tenant: String,
}

/// Open a message's transaction: the inbox row, the order's progress row
/// (created on its first event), locked, and advanced if this event is the
/// next one. The four statements go out together and come back together:
/// one round trip instead of four (tokio-postgres pipelines requests that
/// are polled concurrently; `join4` polls them in this order, so they are
/// sent, and PostgreSQL runs them, in this order: each sees the ones
/// before). In every case but "new and in order" the caller rolls back or
/// only keeps the inbox row, and the conditional advance did nothing, so
/// running the later statements before looking at the earlier results
/// changes no outcome. One difference in timing: a duplicate now also
/// locks the order's progress row before it is rolled back, so it waits
/// while another transaction holds that order (another instance's message
/// in flight during a failover, a park waiting for its dead letter's
/// confirm); it used to be acknowledged without waiting. The statements
/// are prepared once per pooled connection (deadpool's statement cache).
pub async fn open_message(
    tx: &kit::db::Transaction<'_>,
    name: &str,
    raw: &RawEnvelope,
) -> Result<Opened, tokio_postgres::Error> {
    let insert_inbox = tx.prepare_cached(INSERT_INBOX).await?;
    let insert_progress = tx.prepare_cached(INSERT_PROGRESS).await?;
    let lock_progress = tx.prepare_cached(LOCK_PROGRESS).await?;
    let advance = tx.prepare_cached(ADVANCE_PROGRESS).await?;
    let sequence = raw.aggregate_sequence;
    let (inserted, ensured, progress, advanced) = futures_util::future::join4(
        tx.query_opt(&insert_inbox, &[&name, &raw.event_id, &raw.tenant_id]),
        tx.execute(
            &insert_progress,
            &[&name, &raw.aggregate_id, &raw.tenant_id],
        ),
        tx.query_one(&lock_progress, &[&name, &raw.aggregate_id, &sequence]),
        tx.execute(
            &advance,
            &[&name, &raw.aggregate_id, &sequence, &raw.tenant_id],
        ),
    )
    .await;
    // The first error is the cause (the later statements then fail with
    // "current transaction is aborted").
    let new = inserted?.is_some();
    ensured?;
    let progress = progress?;
    let advanced = advanced? == 1;
    let parked = progress
        .get::<_, bool>(1)
        .then(|| (progress.get(2), progress.get(3)));
    Ok(Opened {
        new,
        last: progress.get(0),
        parked,
        advanced,
        tenant: progress.get(4),
    })
}

/// The envelope, and the event when `handles` names its type. The payload of
/// a type the domain does not apply is not decoded: whatever its version or
/// content, it is acknowledged and advances the order's sequence like an
/// unknown type (DESIGN.md section 4: a change to a type must not require
/// touching a consumer that ignores it; a `PaymentReceived` v2 must not
/// park every order in the inventory consumer, which never reads payments).
fn decode(body: &[u8], handles: &[&str]) -> Decoded {
    match RawEnvelope::parse_raw(body) {
        Err(error) => Decoded::Malformed(error),
        Ok(raw) if !handles.contains(&raw.event_type.as_str()) => Decoded::Ok(raw, None),
        Ok(raw) => match raw.decode() {
            Ok(event) => Decoded::Ok(raw, Some(event)),
            Err(error) if error.is_unknown_event_type() => Decoded::Ok(raw, None),
            Err(error) => Decoded::PoisonPayload(raw, error),
        },
    }
}

/// The `consumer.handler_error` fail point: when armed (`FAILPOINTS=
/// "consumer.handler_error=return"`, or `=3*return(<order or event id>)`), the
/// handler fails with an injected error instead of running, for every event or
/// only for the events of the named order (or the named event).
fn injected_handler_error(envelope: &RawEnvelope) -> Option<HandlerError> {
    #[cfg(feature = "failpoints")]
    {
        let target = fail::eval("consumer.handler_error", |arg| arg)?;
        let hit = match target.as_deref().map(str::trim) {
            None | Some("") => true,
            Some(t) => t == envelope.aggregate_id || t == envelope.event_id.to_string(),
        };
        if hit {
            return Some(HandlerError::new(
                "injected by fail point consumer.handler_error",
            ));
        }
    }
    let _ = envelope;
    None
}

/// The `consumer.handler_panic` fail point: like `consumer.handler_error`
/// (every event, or only the named order's or event's), but the handler
/// panics, as a bug in domain code would.
fn injected_handler_panic(envelope: &RawEnvelope) {
    #[cfg(feature = "failpoints")]
    {
        if let Some(target) = fail::eval("consumer.handler_panic", |arg| arg) {
            let hit = match target.as_deref().map(str::trim) {
                None | Some("") => true,
                Some(t) => t == envelope.aggregate_id || t == envelope.event_id.to_string(),
            };
            if hit {
                panic!("injected by fail point consumer.handler_panic");
            }
        }
    }
    let _ = envelope;
}

impl<D: Domain> Processor<D> {
    fn name(&self) -> &str {
        &self.topology.name
    }

    /// Settle one message. `Ok` means "acknowledge it now".
    pub async fn process(
        &self,
        publisher: &Channel,
        delivery: &Delivery,
    ) -> Result<Outcome, Infra> {
        let headers = delivery.properties.headers().as_ref();
        let incoming = Incoming {
            delivery,
            attempts: topology::int_header(headers, headers::ATTEMPTS)
                .and_then(|v| u32::try_from(v).ok())
                .unwrap_or(0),
            deferrals: topology::int_header(headers, headers::DEFERRALS)
                .and_then(|v| u32::try_from(v).ok())
                .unwrap_or(0),
            gap_failures: topology::int_header(headers, headers::GAP_FAILURES)
                .and_then(|v| u32::try_from(v).ok())
                .unwrap_or(0),
        };
        let decoded = decode(&delivery.data, D::HANDLES);
        let metadata = match &decoded {
            Decoded::Malformed(_) => named_by_metadata(delivery),
            _ => None,
        };
        let named = match (&decoded, &metadata) {
            (Decoded::Ok(raw, _) | Decoded::PoisonPayload(raw, _), _) => Some(OrderRef::from(raw)),
            (Decoded::Malformed(_), Some((event_id, tenant, order, sequence))) => Some(OrderRef {
                event_id: *event_id,
                tenant_id: tenant,
                aggregate_id: order,
                sequence: *sequence,
            }),
            (Decoded::Malformed(_), None) => None,
        };
        if let (Some(only), Some(named)) = (&self.only_tenants, &named) {
            if !only.iter().any(|tenant| tenant == named.tenant_id) {
                self.metrics.filtered.inc();
                return Ok(Outcome::Filtered);
            }
        }
        match (&decoded, named) {
            (Decoded::Ok(raw, event), _) => {
                self.apply(publisher, &incoming, raw, event.as_ref()).await
            }
            (Decoded::PoisonPayload(_, error) | Decoded::Malformed(error), Some(order)) => {
                self.poison(publisher, &incoming, order, format!("poison: {error}"))
                    .await
            }
            (Decoded::PoisonPayload(_, error) | Decoded::Malformed(error), None) => {
                // No order to hold: a body that is not an envelope, with no
                // usable metadata either.
                let reason = format!("poison: {error}");
                tracing::error!(%reason, "dead-lettering a malformed message");
                self.dead_letter(publisher, &incoming, &reason).await?;
                self.metrics
                    .dead_lettered
                    .with_label_values(&["poison"])
                    .inc();
                Ok(Outcome::DeadLettered { reason })
            }
        }
    }

    /// An event this build cannot apply (an unknown major version, an
    /// invalid payload, a body that is not an envelope but whose metadata
    /// names its order): dead-lettered, and its order parked behind it,
    /// unless it is a copy of an event applied here already.
    async fn poison(
        &self,
        publisher: &Channel,
        incoming: &Incoming<'_>,
        order: OrderRef<'_>,
        reason: String,
    ) -> Result<Outcome, Infra> {
        let progress = self.progress_of(order).await?;
        if let Some((last, owner)) = &progress {
            if *last > 0 && owner != order.tenant_id {
                // As in `apply` (checked before staleness there too):
                // parking would hold another tenant's order.
                return self.foreign_tenant(publisher, incoming, order, owner).await;
            }
            if *last >= order.sequence {
                // A copy of an event applied here before (a replay read by
                // a binary that cannot decode it): nothing to hold.
                self.metrics.stale.inc();
                tracing::info!(event_id = %order.event_id, sequence = order.sequence, "undecodable copy of an applied event acknowledged");
                return Ok(Outcome::Stale);
            }
        }
        if self
            .dead_letter_and_park(publisher, incoming, order, &reason)
            .await?
            == Letter::AppliedMeanwhile
        {
            return Ok(self.applied_meanwhile(order));
        }
        self.metrics
            .dead_lettered
            .with_label_values(&["poison"])
            .inc();
        Ok(Outcome::DeadLettered { reason })
    }

    async fn apply(
        &self,
        publisher: &Channel,
        incoming: &Incoming<'_>,
        raw: &RawEnvelope,
        event: Option<&Event>,
    ) -> Result<Outcome, Infra> {
        let mut client = self.pool.get().await?;
        let tx = client.transaction().await?;
        let opened = match open_message(&tx, self.name(), raw).await {
            Ok(opened) => opened,
            Err(error) => {
                let Some(reason) = the_event_s_own(&error) else {
                    rollback(tx).await;
                    if error
                        .code()
                        .is_some_and(|code| crate::deployment_fault(code.code()))
                    {
                        // A session on a standby (25006: the inbox insert is
                        // the first write), a statement a migration
                        // invalidated (0A000): closed with its session, so
                        // the retry in place runs on a fresh one.
                        drop(deadpool_postgres::Object::take(client));
                    }
                    return Err(Infra::from(error));
                };
                rollback(tx).await;
                drop(client);
                return self
                    .failed(publisher, incoming, raw, &reason, Failure::Handler)
                    .await;
            }
        };
        if !opened.new {
            tx.rollback().await?;
            self.metrics.duplicates.inc();
            tracing::info!(event_id = %raw.event_id, "duplicate delivery acknowledged");
            return Ok(Outcome::Duplicate);
        }
        if opened.last > 0 && opened.tenant != raw.tenant_id {
            // An event naming another tenant's order (a producer bug, or a
            // message forged on the broker): applied, it would move that
            // order's sequence and book its effect under the wrong tenant,
            // and the order's genuine event would then be dropped as stale.
            // Only once an event is applied: before that the row may have
            // been created by a dead letter naming any tenant.
            tx.rollback().await?;
            drop(client);
            return self
                .foreign_tenant(publisher, incoming, raw.into(), &opened.tenant)
                .await;
        }
        let last = opened.last;
        let sequence = raw.aggregate_sequence;

        if sequence <= last {
            // Applied before (its inbox row may be gone after cleanup); keep the
            // inbox row so the next copy is a plain duplicate.
            tx.commit().await?;
            // Crash window: the inbox row is committed, the message not
            // acknowledged: redelivered, it is a duplicate.
            kit::failpoint::crash_point("consumer.stale.after_commit");
            self.metrics.stale.inc();
            tracing::info!(event_id = %raw.event_id, sequence, last, "stale event acknowledged");
            return Ok(Outcome::Stale);
        }
        if let Some((parked_event, parked_reason)) = opened.parked {
            let reason = format!(
                "order parked behind dead-lettered event {}: {}",
                parked_event.map(|e| e.to_string()).unwrap_or_default(),
                parked_reason.unwrap_or_default()
            );
            // The order's progress row stays locked until the letter is
            // confirmed in the DLQ: a redrive's un-park, which waits for
            // that lock, then finds in the DLQ every event dead-lettered
            // behind the park (its follow-up pass moves them). Released
            // first, a letter could land after the follow-up's drain. (The
            // publish is bounded by the send and confirm timeouts, 5 + 30 s,
            // within the session's idle-in-transaction limit, 60 s.) Crash window: a
            // death before the confirm ends the session and its transaction
            // and the message is redelivered and dead-lettered then; after
            // it, `consumer.after_dead_letter_before_ack` (in
            // `dead_letter`): a second copy of the letter, nothing lost.
            kit::failpoint::hold_point("consumer.parked.before_dead_letter");
            self.dead_letter(publisher, incoming, &reason).await?;
            // The letter is confirmed: a rollback that fails (the session
            // ended meanwhile, which ended the transaction too) changes
            // nothing, and must not send the message round again.
            rollback(tx).await;
            drop(client);
            self.metrics
                .dead_lettered
                .with_label_values(&["parked"])
                .inc();
            tracing::warn!(event_id = %raw.event_id, order = %raw.aggregate_id, "order parked: event dead-lettered behind it");
            return Ok(Outcome::DeadLettered { reason });
        }
        if sequence > last + 1 {
            tx.rollback().await?;
            drop(client);
            if incoming.deferrals < self.max_deferrals {
                let deferred = Incoming {
                    deferrals: incoming.deferrals + 1,
                    ..*incoming
                };
                self.republish(publisher, &deferred, 0).await?;
                self.metrics.deferred.inc();
                tracing::info!(event_id = %raw.event_id, sequence, last, "gap: event deferred");
                return Ok(Outcome::Deferred);
            }
            let error = format!(
                "sequence {sequence} still ahead of the last applied {last} after {} deferrals",
                incoming.deferrals
            );
            return self
                .failed(publisher, incoming, raw, &error, Failure::Gap)
                .await;
        }

        // In order: the progress was advanced with the inbox row (a handler
        // error rolls it back with everything else), before the domain
        // handler, so that the rows the handler locks (inventory's stock
        // levels, shared by every partition) are not held for one more
        // round trip.
        if !opened.advanced {
            // In order and not parked, so the conditional advance matched
            // the row it had just locked: anything else is a bug (retried in
            // place like a database failure, and said loudly).
            tx.rollback().await?;
            let error = format!(
                "progress of order {} not advanced to {sequence} (last {last})",
                raw.aggregate_id
            );
            tracing::error!(event_id = %raw.event_id, %error, "inconsistent progress row");
            return Err(Infra::Database(error));
        }
        let result = match event {
            // A type this consumer does not handle: no handler ran, nothing
            // to time (the sequence is still recorded).
            None => Ok(D::Effects::default()),
            Some(event) => {
                let started = Instant::now();
                kit::failpoint::crash_point("consumer.in_handler");
                let result = match injected_handler_error(raw) {
                    Some(error) => Err(error),
                    None => self.apply_contained(&tx, event, raw).await,
                };
                self.metrics
                    .handler_seconds
                    .observe(started.elapsed().as_secs_f64());
                result
            }
        };
        let effects = match result {
            Ok(effects) => effects,
            Err(error) => {
                // Dropping the transaction would roll back too; say it explicitly.
                if let Err(rollback) = tx.rollback().await {
                    tracing::warn!(%rollback, "rollback after a handler error");
                }
                if error.needs_fresh_session() {
                    // Closed with its session (its prepared statements, its
                    // server), not handed to the next message.
                    drop(deadpool_postgres::Object::take(client));
                } else {
                    drop(client);
                }
                if error.is_transient() {
                    return Err(Infra::Database(error.to_string()));
                }
                return self
                    .failed(
                        publisher,
                        incoming,
                        raw,
                        &error.to_string(),
                        Failure::Handler,
                    )
                    .await;
            }
        };
        // Crash window: the handler's effects, the inbox row and the
        // progress are written, not committed: the session ends with the
        // process, the server rolls all of it back, and the message is
        // redelivered and applied once (test
        // `consumer_crash_after_the_handler_before_commit`).
        kit::failpoint::crash_point("consumer.before_commit");
        if kit::failpoint::error_point("consumer.commit_fails") {
            // The fault of a COMMIT that never reaches the server (the
            // connection lost): rolled back, the message processed again in
            // place, its handler run again.
            rollback(tx).await;
            return Err(Infra::Database(
                "injected by fail point consumer.commit_fails".to_owned(),
            ));
        }
        if let Err(error) = tx.commit().await {
            // A deferred check (the ledger's balanced-entry trigger) fails
            // here, at COMMIT, for this event's rows.
            let reason = the_event_s_own(&error).ok_or_else(|| Infra::from(error))?;
            drop(client);
            return self
                .failed(publisher, incoming, raw, &reason, Failure::Handler)
                .await;
        }
        if kit::failpoint::error_point("consumer.commit_reply_lost") {
            // The fault of a COMMIT that reached the server, its reply lost
            // with the connection: the message is processed again in place
            // and its inbox row makes it a duplicate (`Domain::committed`'s
            // one miss).
            drop(client);
            return Err(Infra::Database(
                "injected by fail point consumer.commit_reply_lost".to_owned(),
            ));
        }
        self.domain.committed(effects);
        kit::failpoint::crash_point("consumer.after_commit_before_ack");

        let event_type = match event {
            Some(_) => raw.event_type.clone(),
            None => "ignored".to_owned(),
        };
        self.metrics.applied.with_label_values(&[&event_type]).inc();
        // Only a live event measures the lag: a replayed or redriven copy is
        // late by design (a new consumer's backfill re-sends days of
        // history), and would hold ConsumerLagHigh up for the whole replay.
        let late_by_design =
            incoming
                .delivery
                .properties
                .headers()
                .as_ref()
                .is_some_and(|headers| {
                    let headers = headers.inner();
                    headers.contains_key(events::headers::REPLAYED)
                        || headers.contains_key(topology::headers::REDRIVEN)
                });
        let lag = OffsetDateTime::now_utc() - raw.occurred_at;
        if lag.is_positive() && !late_by_design {
            self.metrics.lag_seconds.observe(lag.as_seconds_f64());
        }
        tracing::info!(event_id = %raw.event_id, event_type = %raw.event_type, order = %raw.aggregate_id, sequence, "applied");
        Ok(Outcome::Applied { event_type })
    }

    /// The domain handler, with a panic turned into a failed attempt of this
    /// event. Uncaught, the panic would end the partition worker, the
    /// consumer would reconnect and get the same message again: a loop in
    /// which every reconnect counts a delivery for each message in the
    /// prefetch window, until the broker's delivery limit dead-letters them
    /// all without parking their orders. Caught, it takes the normal path:
    /// rolled back, retried through the tiers, then dead-lettered with the
    /// panic's message and its order parked; other orders flow meanwhile.
    async fn apply_contained(
        &self,
        tx: &kit::db::Transaction<'_>,
        event: &Event,
        raw: &RawEnvelope,
    ) -> Result<D::Effects, HandlerError> {
        let handler = async {
            injected_handler_panic(raw);
            self.domain.apply(tx, event, raw).await
        };
        match std::panic::AssertUnwindSafe(handler).catch_unwind().await {
            Ok(result) => result,
            Err(panic) => {
                let message = panic
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "(no message)".to_owned());
                tracing::error!(event_id = %raw.event_id, order = %raw.aggregate_id, %message, "the handler panicked");
                Err(HandlerError::new(format!(
                    "the handler panicked: {message}"
                )))
            }
        }
    }

    /// A failed attempt: the next retry tier, or the DLQ (and park) after the
    /// last. The handler's failures and a gap's past its deferrals are
    /// counted apart (headers `ATTEMPTS`, `GAP_FAILURES`), each up to
    /// `max_attempts`: an event that waited out a gap still has its five
    /// attempts once in order (the gap's failures spent them: one handler
    /// failure then parked it), and a message in flight keeps its counts
    /// whatever `max_deferrals` the instance reading it has.
    async fn failed(
        &self,
        publisher: &Channel,
        incoming: &Incoming<'_>,
        raw: &RawEnvelope,
        error: &str,
        failure: Failure,
    ) -> Result<Outcome, Infra> {
        // This failure's count (1 for the first), and the message's counts
        // with it.
        let (failures, counted) = match failure {
            Failure::Handler => {
                let attempts = incoming.attempts.saturating_add(1);
                (
                    attempts,
                    Incoming {
                        attempts,
                        ..*incoming
                    },
                )
            }
            Failure::Gap => {
                let gap_failures = incoming.gap_failures.saturating_add(1);
                (
                    gap_failures,
                    Incoming {
                        gap_failures,
                        ..*incoming
                    },
                )
            }
        };
        if failures >= self.max_attempts {
            let reason = format!("failed {failures} times: {error}");
            // The letter's headers count this failure too, as its reason
            // does.
            if self
                .dead_letter_and_park(publisher, &counted, raw.into(), &reason)
                .await?
                == Letter::AppliedMeanwhile
            {
                return Ok(self.applied_meanwhile(raw.into()));
            }
            self.metrics
                .dead_lettered
                .with_label_values(&["max_attempts"])
                .inc();
            return Ok(Outcome::DeadLettered { reason });
        }
        let last_tier = self.topology.tiers.len().saturating_sub(1);
        let tier = usize::try_from(failures.saturating_sub(1))
            .unwrap_or(last_tier)
            .min(last_tier);
        self.republish(publisher, &counted, tier).await?;
        self.metrics
            .retried
            .with_label_values(&[&tier.to_string()])
            .inc();
        match failure {
            Failure::Handler => {
                tracing::warn!(event_id = %raw.event_id, order = %raw.aggregate_id, attempts = failures, tier, %error, "handler failed: retrying later");
            }
            Failure::Gap => {
                tracing::warn!(event_id = %raw.event_id, order = %raw.aggregate_id, gap_failures = failures, tier, %error, "gap not closed: retrying later");
            }
        }
        Ok(Outcome::Retried { tier })
    }

    /// To retry tier `tier` with `counted`'s counts.
    async fn republish(
        &self,
        publisher: &Channel,
        counted: &Incoming<'_>,
        tier: usize,
    ) -> Result<(), Infra> {
        let mut table = topology::clean_headers(counted.delivery.properties.headers().as_ref());
        topology::set_int(&mut table, headers::ATTEMPTS, i64::from(counted.attempts));
        topology::set_int(&mut table, headers::DEFERRALS, i64::from(counted.deferrals));
        if counted.gap_failures > 0 {
            topology::set_int(
                &mut table,
                headers::GAP_FAILURES,
                i64::from(counted.gap_failures),
            );
        }
        publish(
            publisher,
            "",
            &self.topology.retry_queue(tier),
            &counted.delivery.data,
            &counted.delivery.properties,
            table,
        )
        .await?;
        // Crash window: the copy is confirmed in the retry tier, the message
        // not yet acknowledged. A crash here redelivers the message as well:
        // two copies, the second a duplicate (inbox) or stale once the first
        // is applied; nothing lost.
        kit::failpoint::crash_point("consumer.after_republish_before_ack");
        Ok(())
    }

    /// Dead-letter the message alone (no park); the caller acknowledges it.
    async fn dead_letter(
        &self,
        publisher: &Channel,
        incoming: &Incoming<'_>,
        reason: &str,
    ) -> Result<(), Infra> {
        self.publish_dead_letter(publisher, incoming, reason)
            .await?;
        // Crash window: the letter is confirmed in the DLQ, the message not
        // acknowledged. It is redelivered and dead-lettered again: two
        // copies of the letter (a redrive moves one and drops the other as
        // its exact copy, `redrive::drop_exact_copies`; a letter that names
        // no order or event is kept, both copies), nothing lost.
        kit::failpoint::crash_point("consumer.after_dead_letter_before_ack");
        Ok(())
    }

    /// Publish the message to the DLQ with its reason (confirmed).
    async fn publish_dead_letter(
        &self,
        publisher: &Channel,
        incoming: &Incoming<'_>,
        reason: &str,
    ) -> Result<(), Infra> {
        let table = dead_letter_headers(
            incoming.delivery.properties.headers().as_ref(),
            self.name(),
            reason,
            (incoming.attempts, incoming.gap_failures),
        );
        publish(
            publisher,
            "",
            &self.topology.dead_letter_queue(),
            &incoming.delivery.data,
            &incoming.delivery.properties,
            table,
        )
        .await
    }

    /// The order's last applied sequence and tenant (see [`Opened::tenant`]),
    /// if it has a progress row here.
    async fn progress_of(&self, order: OrderRef<'_>) -> Result<Option<(i64, String)>, Infra> {
        let client = self.pool.get().await?;
        match client
            .query_opt(
                "SELECT last_sequence, tenant_id FROM order_progress \
                 WHERE consumer_name = $1 AND aggregate_id = $2",
                &[&self.name(), &order.aggregate_id],
            )
            .await
        {
            Ok(row) => Ok(row.map(|row| (row.get(0), row.get(1)))),
            // Ids the database cannot even compare: never seen here.
            Err(error) if the_event_s_own(&error).is_some() => Ok(None),
            Err(error) => Err(error.into()),
        }
    }

    /// An event naming an order that belongs to another tenant (`owner`,
    /// set by the order's first applied event): dead-lettered alone as
    /// poison, never applied, and the order not parked (parking would hold
    /// the genuine order for a message that is not its own).
    async fn foreign_tenant(
        &self,
        publisher: &Channel,
        incoming: &Incoming<'_>,
        order: OrderRef<'_>,
        owner: &str,
    ) -> Result<Outcome, Infra> {
        let reason = format!(
            "poison: order {} belongs to tenant {owner:?}, the event names tenant {:?}",
            order.aggregate_id, order.tenant_id
        );
        tracing::error!(event_id = %order.event_id, %reason, "dead-lettering an event of another tenant's order");
        self.dead_letter(publisher, incoming, &reason).await?;
        self.metrics
            .dead_lettered
            .with_label_values(&["poison"])
            .inc();
        Ok(Outcome::DeadLettered { reason })
    }

    /// Park the order and publish to the DLQ in one database transaction: the
    /// park commits only once the broker confirmed the dead letter. Neither
    /// happens if the order's progress is at or past the event by the time
    /// the park locks it ([`Letter::AppliedMeanwhile`]).
    async fn dead_letter_and_park(
        &self,
        publisher: &Channel,
        incoming: &Incoming<'_>,
        order: OrderRef<'_>,
        reason: &str,
    ) -> Result<Letter, Infra> {
        let mut client = self.pool.get().await?;
        let tx = client.transaction().await?;
        let parked = tx
            .query_opt(
                PARK,
                &[
                    &self.name(),
                    &order.aggregate_id,
                    &order.tenant_id,
                    &order.event_id,
                    &reason,
                    &order.sequence,
                ],
            )
            .await;
        let newly_parked: bool = match parked {
            Ok(Some(row)) => row.get(0),
            Ok(None) => {
                // The progress row is at or past the event: another copy of
                // it was applied since this one was found failing or
                // undecodable (two instances briefly on one partition, a
                // rolling deploy whose new binary decodes what this one
                // cannot). Parking would hold the order behind an applied
                // event; nothing to hold.
                rollback(tx).await;
                return Ok(Letter::AppliedMeanwhile);
            }
            Err(error) => {
                // The order cannot even be recorded (its id or tenant is not
                // storable): dead-letter the event alone. Its order's later
                // events fail the same way and follow it to the DLQ.
                let why = the_event_s_own(&error).ok_or_else(|| Infra::from(error))?;
                rollback(tx).await;
                drop(client);
                self.dead_letter(publisher, incoming, reason).await?;
                tracing::error!(event_id = %order.event_id, %reason, %why, "dead-lettered the event alone: its order cannot be parked");
                return Ok(Letter::Parked);
            }
        };
        self.publish_dead_letter(publisher, incoming, reason)
            .await?;
        // Crash window: the dead letter is confirmed, the park not committed
        // and the message not acknowledged. The message is redelivered,
        // dead-lettered again and the order parked then: a second copy of
        // the letter (a redrive moves one and drops the other as its exact
        // copy), nothing lost.
        kit::failpoint::crash_point("consumer.after_dead_letter_before_park");
        tx.commit().await?;
        // Crash window: the order is parked, the message not acknowledged.
        // It is redelivered and dead-lettered again: a poison event as
        // poison (its park again a no-op), an event whose handler failed as
        // held behind the park. A second copy of the letter (as above),
        // nothing lost.
        kit::failpoint::crash_point("consumer.after_park_before_ack");
        // A re-park (an earlier event of an order parked already) is no new
        // parked order; the gauge is recounted from the table every tick.
        if newly_parked {
            self.metrics.parked_orders.inc();
        }
        // Logged once it is so (a copy applied meanwhile is no letter).
        tracing::error!(event_id = %order.event_id, order = %order.aggregate_id, %reason, "dead-lettered and parked the order");
        Ok(Letter::Parked)
    }

    /// A copy of an event applied meanwhile, found by the park: stale.
    fn applied_meanwhile(&self, order: OrderRef<'_>) -> Outcome {
        self.metrics.stale.inc();
        tracing::info!(event_id = %order.event_id, sequence = order.sequence, "the event was applied meanwhile: not parking its order; acknowledged as stale");
        Outcome::Stale
    }
}

/// What [`Processor::dead_letter_and_park`] did.
#[derive(Debug, PartialEq, Eq)]
enum Letter {
    /// Dead-lettered (and the order parked, where it can be recorded).
    Parked,
    /// Nothing: the order's progress was at or past the event.
    AppliedMeanwhile,
}

/// Park the order at sequence `$6` (its event `$4`, for reason `$5`), or, if
/// it is parked already, at the lower of the two sequences, naming the
/// lower one's event. A row parked before `parked_sequence` existed (NULL)
/// holds the whole order and stays so. Returns whether this transaction
/// parked the order (`parked_at` is its `now()`), false for a re-park; no
/// row if the order's progress is at or past `$6` (the event applied
/// meanwhile: the row is then left as it was, locked until the rollback).
const PARK: &str = "INSERT INTO order_progress \
       (consumer_name, aggregate_id, tenant_id, parked_at, parked_event_id, parked_reason, \
        parked_sequence) \
     VALUES ($1, $2, $3, now(), $4, $5, $6) \
     ON CONFLICT (consumer_name, aggregate_id) DO UPDATE SET \
       parked_at = COALESCE(order_progress.parked_at, EXCLUDED.parked_at), \
       parked_event_id = CASE WHEN order_progress.parked_at IS NULL \
           OR EXCLUDED.parked_sequence < order_progress.parked_sequence \
           THEN EXCLUDED.parked_event_id ELSE order_progress.parked_event_id END, \
       parked_reason = CASE WHEN order_progress.parked_at IS NULL \
           OR EXCLUDED.parked_sequence < order_progress.parked_sequence \
           THEN EXCLUDED.parked_reason ELSE order_progress.parked_reason END, \
       parked_sequence = CASE WHEN order_progress.parked_at IS NULL \
           THEN EXCLUDED.parked_sequence \
           WHEN order_progress.parked_sequence IS NULL THEN NULL \
           ELSE LEAST(order_progress.parked_sequence, EXCLUDED.parked_sequence) END, \
       updated_at = now() \
     WHERE order_progress.last_sequence < EXCLUDED.parked_sequence \
     RETURNING parked_at = now()";

/// Whether a failed runtime statement (inbox, progress, park, COMMIT) is
/// the event's own fault, and why: SQLSTATE classes 22 (data exception: a
/// NUL byte, a value out of range), 23 (integrity violation: a deferred
/// check at COMMIT) and 54 (program limit: an id too long to index). Such
/// an event fails like a handler error (retry tiers, then the DLQ), never
/// retried in place, which would hold its partition forever. Anything else
/// (the connection, resources, a missing table) is the infrastructure's:
/// `None`, retried in place.
pub(crate) fn the_event_s_own(error: &tokio_postgres::Error) -> Option<String> {
    let db = error.as_db_error()?;
    let code = db.code().code();
    ["22", "23", "54"]
        .iter()
        .any(|class| code.starts_with(class))
        .then(|| {
            format!(
                "database rejected the event's data ({code}): {}",
                db.message()
            )
        })
}

/// Roll back after a failed statement; the connection is dropped anyway if
/// that fails too.
async fn rollback(tx: kit::db::Transaction<'_>) {
    if let Err(error) = tx.rollback().await {
        tracing::warn!(%error, "rollback after a rejected statement");
    }
}

/// A dead letter's reason is cut to this many bytes (at a character
/// boundary): with the consumer's name and the attempts, a letter's headers
/// stay within the room the relay leaves free in the frame
/// ([`events::CONSUMER_HEADER_ROOM`]).
const REASON_MAX_BYTES: usize = 1000;

/// `counts`: the handler's failed attempts and the gap's (the latter
/// written only when some).
pub(crate) fn dead_letter_headers(
    existing: Option<&FieldTable>,
    consumer: &str,
    reason: &str,
    (attempts, gap_failures): (u32, u32),
) -> FieldTable {
    let mut table = topology::clean_headers(existing);
    let mut end = reason.len().min(REASON_MAX_BYTES);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    topology::set_str(&mut table, headers::DEAD_LETTER_REASON, &reason[..end]);
    topology::set_str(&mut table, headers::DEAD_LETTERED_BY, consumer);
    topology::set_int(&mut table, headers::ATTEMPTS, i64::from(attempts));
    if gap_failures > 0 {
        topology::set_int(&mut table, headers::GAP_FAILURES, i64::from(gap_failures));
    }
    table
}

/// Publish with a confirm; only a plain Ack counts.
pub(crate) async fn publish(
    channel: &Channel,
    exchange: &str,
    routing_key: &str,
    body: &[u8],
    properties: &BasicProperties,
    headers: FieldTable,
) -> Result<(), Infra> {
    let confirm = send(channel, exchange, routing_key, body, properties, headers).await?;
    confirmed(confirm, routing_key).await
}

/// Publish (persistent, mandatory) without waiting for the confirm: its
/// future, for [`confirmed`]. Fails when the frames are not written within
/// [`kit::amqp::WRITE_WAIT`] (under an alarm only the first copy is
/// written; without the bound, a second partition's copy waited for the
/// end of the alarm, uncounted): the worker then holds the message until
/// the connection is unblocked (`worker::settle`), and the queued copy,
/// written when the alarm ends, is one the inbox, the progress row or the
/// redrive recognises as any other.
pub(crate) async fn send(
    channel: &Channel,
    exchange: &str,
    routing_key: &str,
    body: &[u8],
    properties: &BasicProperties,
    headers: FieldTable,
) -> Result<lapin::PublisherConfirm, Infra> {
    let properties = properties
        .clone()
        .with_headers(headers)
        .with_delivery_mode(2);
    let publish = channel.basic_publish(
        ShortString::from(exchange),
        ShortString::from(routing_key),
        BasicPublishOptions {
            mandatory: true,
            ..BasicPublishOptions::default()
        },
        body,
        properties,
    );
    tokio::time::timeout(kit::amqp::WRITE_WAIT, publish)
        .await
        .map_err(|_| {
            Infra::Broker(format!(
                "a copy for {routing_key} not written within {:?} (the broker blocks the connection?)",
                kit::amqp::WRITE_WAIT
            ))
        })?
        .map_err(|e| Infra::Broker(e.to_string()))
}

/// Wait (at most 30 s) for the broker's confirm of a message [`send`] sent
/// to `routing_key`; only a plain Ack counts.
pub(crate) async fn confirmed(
    confirm: lapin::PublisherConfirm,
    routing_key: &str,
) -> Result<(), Infra> {
    let confirmation = tokio::time::timeout(Duration::from_secs(30), confirm)
        .await
        .map_err(|_| Infra::Broker(format!("no confirm from the broker for {routing_key}")))?
        .map_err(|e| Infra::Broker(e.to_string()))?;
    kit::amqp::check_confirmation(confirmation)
        .map_err(|e| Infra::Broker(format!("publish to {routing_key}: {e}")))?;
    // The broker took the copy, but its confirm is lost to this process (as
    // when the confirm timed out under an alarm).
    if kit::failpoint::error_point("consumer.publish.unconfirmed") {
        return Err(Infra::Broker(format!(
            "injected by fail point consumer.publish.unconfirmed: no confirm for {routing_key}"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::types::AMQPValue;

    /// The content header frame lapin writes for `properties`.
    fn frame(properties: &BasicProperties) -> usize {
        let written = cookie_factory::gen_simple(
            lapin::protocol::basic::gen_properties(properties),
            Vec::new(),
        )
        .expect("serialises");
        7 + 12 + written.len() + 1
    }

    /// The most a copy adds to the message's header frame is within the
    /// room the relay leaves free: a dead letter with the longest reason (in
    /// characters of two bytes, cut to 1,000 bytes), the longest consumer
    /// name (200 bytes) and the most attempts; a retry or deferral copy's
    /// counts; a redriven copy's mark. The broker's own headers on the
    /// delivery (its `x-death` history) are dropped from every copy built
    /// here (a redrive keeping a letter in the DLQ copies them as they are:
    /// they take from the same room, see `events::CONSUMER_HEADER_ROOM`).
    #[test]
    fn a_copy_adds_at_most_the_room_the_relay_leaves_in_the_frame() {
        let mut relayed = FieldTable::default();
        topology::set_str(&mut relayed, events::headers::AGGREGATE_ID, "order-1");
        topology::set_int(&mut relayed, events::headers::AGGREGATE_SEQUENCE, 1);
        topology::set_str(&mut relayed, events::headers::TENANT_ID, "tenant-1");
        let delivered = {
            let mut table = relayed.clone();
            topology::set_str(&mut table, "x-first-death-queue", &"q".repeat(5_000));
            topology::set_int(&mut table, headers::DELIVERY_COUNT, 7);
            // A redriven event: its copies keep the mark.
            topology::set_str(&mut table, headers::REDRIVEN, "true");
            table
        };
        let properties = BasicProperties::default().with_message_id("event-1".into());
        let sent = frame(&properties.clone().with_headers(relayed));
        let added = |table: FieldTable| frame(&properties.clone().with_headers(table)) - sent;

        let letter = dead_letter_headers(
            Some(&delivered),
            &"n".repeat(200),
            &"é".repeat(5_000),
            (u32::MAX, u32::MAX),
        );
        let letter_added = added(letter.clone());
        assert!(
            letter_added <= events::CONSUMER_HEADER_ROOM,
            "a dead letter adds {letter_added} bytes"
        );
        match letter.inner().get(headers::DEAD_LETTER_REASON) {
            Some(AMQPValue::LongString(reason)) => {
                assert_eq!(
                    reason.as_bytes().len(),
                    REASON_MAX_BYTES,
                    "cut at a character boundary"
                );
            }
            other => panic!("no reason: {other:?}"),
        }

        let mut retry = topology::clean_headers(Some(&delivered));
        topology::set_int(&mut retry, headers::ATTEMPTS, i64::MAX);
        topology::set_int(&mut retry, headers::DEFERRALS, i64::MAX);
        topology::set_int(&mut retry, headers::GAP_FAILURES, i64::MAX);
        assert!(added(retry) <= events::CONSUMER_HEADER_ROOM);

        let mut redriven = topology::clean_headers(Some(&letter));
        topology::set_str(&mut redriven, headers::REDRIVEN, "true");
        assert!(added(redriven) <= events::CONSUMER_HEADER_ROOM);
    }
}
