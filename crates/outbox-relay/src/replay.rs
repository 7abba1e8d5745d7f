//! `outbox-relay replay`: reset one consumer's queues and re-publish the
//! retained events to that consumer only.
//!
//! The consumer `<name>` owns (see DESIGN.md section 7) the consistent-hash
//! exchange `<name>.events` and the partition queues `<name>.p0` ..
//! `<name>.p{P-1}`. Replay discovers P (passive declares until the first
//! NOT_FOUND), purges the partitions (a replay of everything only, see
//! [`ReplayRequest::purges`]), then walks the published rows in
//! range in `(aggregate_type, aggregate_id, aggregate_sequence)` order
//! (keyset pages over the unique index: no sort, bounded memory, no long
//! transaction) and publishes them to `<name>.events` with the `replayed`
//! header, pipelined with confirms in waves: a page's first event of every
//! order, then its second of every order once the first wave is confirmed,
//! and so on. One order's events hash to one partition; an order's next
//! event is sent only once the broker confirmed the one before, and the
//! replay stops at the first failure. So a message the broker refuses (a
//! partition full under `x-overflow: reject-publish`, or over a byte
//! limit) is never overtaken by a later event of its order, as the relay's
//! claim never lets one be. The consumer's inbox makes re-delivery of
//! applied events a no-op.

use std::time::Instant;

use kit::{db::PgPool, settings::AmqpSettings, CancellationToken};
use lapin::{
    options::{ConfirmSelectOptions, ExchangeDeclareOptions, QueuePurgeOptions},
    types::FieldTable,
    Connection, ExchangeKind,
};
use time::OffsetDateTime;
use uuid::Uuid;

use crate::claim::OutboxRow;
use crate::publish;

/// What to replay.
#[derive(Clone, Debug)]
pub struct ReplayRequest {
    pub consumer: String,
    pub since: Option<OffsetDateTime>,
    pub until: Option<OffsetDateTime>,
    pub order: Option<String>,
    /// Only this tenant's events (empty: every tenant). A consumer serving
    /// some tenants only (a dedicated deployment, a test) must not get the
    /// others' events.
    pub only_tenant: String,
    pub page_size: i64,
    pub confirm_timeout: std::time::Duration,
    /// The broker's largest message (`relay.max_message_bytes`).
    pub max_message_bytes: usize,
    /// Purge the partitions even though messages wait in them (see
    /// [`waiting_guard`]).
    pub purge_waiting: bool,
    /// The cleanup's horizon ([`crate::settings::CleanupSettings::horizon_secs`]),
    /// for the guard's message.
    pub horizon_secs: u64,
}

impl ReplayRequest {
    /// Whether this replay purges the consumer's queues first: only when it
    /// re-publishes every retained event. A purge drops every message
    /// waiting in the partitions, of every order and tenant; those already
    /// marked published are sent again only if the replay covers them, so a
    /// filtered replay (`--since`, `--until`, `--order`, `--tenant`) that
    /// purged would lose the ones outside its filter. A filtered replay
    /// queues its events behind the waiting ones instead; the consumer's
    /// inbox and progress row make every stale copy a no-op.
    pub fn purges(&self) -> bool {
        self.since.is_none()
            && self.until.is_none()
            && self.order.is_none()
            && self.only_tenant.is_empty()
    }

    /// How to finish a replay that stopped part way: run it again. One
    /// that purges finds the copies it already sent waiting in the
    /// partitions, so its waiting guard refuses it without
    /// `--purge-waiting` (which the first run had, or found nothing
    /// waiting: the copies are this replay's own).
    fn again(&self) -> &'static str {
        if self.purges() {
            "run the replay again with --purge-waiting (the copies already sent wait in the \
             partitions; consumers de-duplicate)"
        } else {
            "run the replay again (consumers de-duplicate)"
        }
    }
}

#[derive(Clone, Debug, Default)]
pub struct ReplaySummary {
    pub partitions: Vec<String>,
    /// Whether the partitions were purged ([`ReplayRequest::purges`]).
    pub purged_queues: bool,
    pub purged: u64,
    pub republished: u64,
    pub orders: u64,
    /// In-flight rows that were never published and cannot be sent (an
    /// unreadable row, an event type too long for AMQP): not replayed.
    pub skipped: u64,
}

/// Partition queues of `consumer`, found by passive declares (a 404 closes
/// the channel, so each probe gets a fresh one; the first miss ends it).
pub async fn discover_partitions(
    connection: &Connection,
    consumer: &str,
) -> anyhow::Result<Vec<String>> {
    let mut partitions = Vec::new();
    for i in 0.. {
        let name = format!("{consumer}.p{i}");
        let channel = connection.create_channel().await?;
        match kit::amqp::passive_declare(&channel, &name).await {
            Ok(_) => {
                partitions.push(name);
                let _ = channel.close(200, "probe done".into()).await;
            }
            Err(_) => break,
        }
    }
    Ok(partitions)
}

/// Refuse to purge partitions in which messages wait, unless the operator
/// said so (`--purge-waiting`). The replay re-sends only events whose
/// outbox rows are retained, and the cleanup deletes published rows past
/// its horizon: a message that waited longer than that (its consumer down
/// for days) would be purged and never sent again, lost for this consumer.
async fn waiting_guard(
    pool: &PgPool,
    channel: &lapin::Channel,
    request: &ReplayRequest,
    partitions: &[String],
) -> anyhow::Result<()> {
    let mut waiting = 0_u64;
    for queue in partitions {
        waiting += u64::from(
            kit::amqp::passive_declare(channel, queue)
                .await?
                .message_count(),
        );
    }
    if waiting == 0 || request.purge_waiting {
        return Ok(());
    }
    let client = pool.get().await?;
    let oldest: Option<OffsetDateTime> = client
        .query_one(
            "SELECT min(published_at) FROM outbox_events WHERE published_at IS NOT NULL",
            &[],
        )
        .await?
        .get(0);
    let retained = oldest.map_or_else(
        || "none is retained".to_owned(),
        |oldest| format!("the oldest retained was published at {oldest}"),
    );
    anyhow::bail!(
        "{waiting} message(s) wait in {}'s partitions, and a replay of everything purges them \
         first. It re-sends only the events whose outbox rows are retained ({retained}; the \
         cleanup deletes published rows after {} h): a waiting event published before that \
         would be lost for this consumer. Let the consumer drain its queues first, or replay \
         a range (--since, --order, --tenant: no purge), or pass --purge-waiting to purge \
         them anyway (safe when the consumer last consumed within those {} h: nothing \
         waiting is older)",
        request.consumer,
        request.horizon_secs / 3600,
        request.horizon_secs / 3600,
    )
}

/// Run a replay, printing progress to stdout.
pub async fn replay(
    pool: &PgPool,
    amqp: &AmqpSettings,
    request: &ReplayRequest,
    shutdown: &CancellationToken,
) -> anyhow::Result<ReplaySummary> {
    let started = Instant::now();
    let connection = kit::amqp::connect(amqp, "outbox-relay replay", shutdown).await?;
    let exchange = format!("{}.events", request.consumer);
    {
        // The consumer's exchange must exist: it is the only route to its queues.
        let channel = connection.create_channel().await?;
        channel
            .exchange_declare(
                exchange.as_str().into(),
                ExchangeKind::Custom("x-consistent-hash".into()),
                ExchangeDeclareOptions {
                    passive: true,
                    ..ExchangeDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(|e| anyhow::anyhow!("consumer exchange {exchange} not found: {e}"))?;
        let _ = channel.close(200, "checked".into()).await;
    }
    let partitions = discover_partitions(&connection, &request.consumer).await?;
    anyhow::ensure!(
        !partitions.is_empty(),
        "consumer {:?} has no partition queues ({0}.p0 not found)",
        request.consumer
    );
    let channel = connection.create_channel().await?;
    let frame_max = connection.configuration().frame_max();
    let mut summary = ReplaySummary {
        partitions: partitions.clone(),
        ..ReplaySummary::default()
    };
    if request.purges() {
        waiting_guard(pool, &channel, request, &partitions).await?;
        for queue in &partitions {
            let purged = channel
                .queue_purge(queue.as_str().into(), QueuePurgeOptions::default())
                .await?;
            println!("purged {queue}: {purged} message(s)");
            summary.purged += u64::from(purged);
        }
        summary.purged_queues = true;
        // Crash window: the queues are empty and nothing is re-published
        // yet. The replay exits non-zero; running it again re-publishes
        // everything (the consumers de-duplicate).
        kit::failpoint::crash_point("replay.after_purge");
    } else {
        println!("a filtered replay: the queues are not purged");
    }
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;

    let client = pool.get().await?;
    let mut after: (String, String, i64) = (String::new(), String::new(), 0);
    // The last order sent (type, id), across pages.
    let mut last_order: Option<(String, String)> = None;
    loop {
        if shutdown.is_cancelled() {
            anyhow::bail!(
                "interrupted after {} event(s); {}",
                summary.republished,
                request.again()
            );
        }
        let rows = client
            .query(
                "SELECT event_id, tenant_id, aggregate_type, aggregate_id, aggregate_sequence,
                        event_type, schema_version, payload, traceparent, tracestate,
                        occurred_at, attempt_count, published_at IS NOT NULL
                 FROM outbox_events
                 WHERE (aggregate_type, aggregate_id, aggregate_sequence) > ($1, $2, $3)
                   -- Published, or in flight: leased by a relay that has
                   -- not marked it yet (its message may have been confirmed
                   -- and then purged above, and once marked nothing would
                   -- send it again), or whose relay died before marking it.
                   -- (A failed publish clears the lease; quarantined rows
                   -- were never published.)
                   AND (published_at IS NOT NULL
                        OR (claimed_by IS NOT NULL AND quarantined_at IS NULL))
                   AND ($4::timestamptz IS NULL OR occurred_at >= $4)
                   AND ($5::timestamptz IS NULL OR occurred_at < $5)
                   -- An order's type named too: with both, the walk of
                   -- the unique index starts and stays at the order's rows
                   -- (the id alone, second in the index, only filtered a
                   -- walk of every retained row).
                   AND ($6::text IS NULL OR (aggregate_type = $9 AND aggregate_id = $6))
                   AND ($8 = '' OR tenant_id = $8)
                 ORDER BY aggregate_type, aggregate_id, aggregate_sequence
                 LIMIT $7",
                &[
                    &after.0,
                    &after.1,
                    &after.2,
                    &request.since,
                    &request.until,
                    &request.order,
                    &request.page_size,
                    &request.only_tenant,
                    &events::AGGREGATE_TYPE_ORDER,
                ],
            )
            .await?;
        if rows.is_empty() {
            break;
        }
        if let Some(last) = rows.last() {
            after = (last.get(2), last.get(3), last.get(4));
        }
        // waves[i]: the i-th event of every order of the page, in order.
        let mut waves: Vec<Vec<_>> = Vec::new();
        let mut nth = 0;
        for row in &rows {
            let event_id: Uuid = row.get(0);
            let published: bool = row.get(12);
            let prepared = OutboxRow::try_from_row(row)
                .map_err(|error| crate::claim::unreadable(&error))
                .and_then(|decoded| {
                    let prepared = publish::prepare(&decoded, true)?;
                    publish::check_limits(&prepared.0, request.max_message_bytes, frame_max)?;
                    Ok((decoded.aggregate_id, prepared))
                });
            match prepared {
                Ok((order, prepared)) => {
                    let key = (row.get::<_, String>(2), order);
                    if last_order.as_ref() == Some(&key) {
                        // The order's next event: the next wave (the
                        // first of this page if the order began on the
                        // page before, whose waves are all confirmed).
                        nth = if waves.is_empty() { 0 } else { nth + 1 };
                    } else {
                        nth = 0;
                        summary.orders += 1;
                        last_order = Some(key);
                    }
                    if waves.len() <= nth {
                        waves.push(Vec::new());
                    }
                    waves[nth].push(prepared);
                }
                // In flight, never published: no relay can send it either
                // (it fails the same way there and is quarantined), so no
                // consumer has it to lose.
                Err(why) if !published => {
                    println!("skipped event {event_id}: never published ({why})");
                    summary.skipped += 1;
                }
                Err(why) => {
                    anyhow::bail!(
                    "published event {event_id} cannot be replayed: {why}; nothing of its page \
                     ({} rows from order {} on) was sent: replay around it in two runs split at \
                     its occurred_at (the runbook, under Adding a consumer); {} event(s) of the \
                     pages before were replayed",
                    rows.len(),
                    rows.first().map(|r| r.get::<_, String>(3)).unwrap_or_default(),
                    summary.republished
                )
                }
            }
        }
        for wave in waves {
            let sent = wave.len() as u64;
            let outcomes =
                publish::publish_batch(&channel, &exchange, wave, request.confirm_timeout).await;
            if let Some(failed) = outcomes.iter().find(|o| o.result.is_err()) {
                // Nothing later of the failed event's order has been sent:
                // its next event would be in the next wave.
                let reason = failed
                    .result
                    .as_ref()
                    .err()
                    .map(|f| f.describe())
                    .unwrap_or_default();
                let confirmed = outcomes.iter().filter(|o| o.result.is_ok()).count() as u64;
                anyhow::bail!(
                    "event {} was not confirmed ({reason}); {} event(s) replayed, none after it \
                     of its order; {}",
                    failed.event_id,
                    summary.republished + confirmed,
                    request.again()
                );
            }
            summary.republished += sent;
            // Crash window: this wave is confirmed, the next not sent (an
            // order's later events wait for their wave). The replay exits
            // non-zero; running it again sends everything again, a
            // purging one with --purge-waiting (`ReplayRequest::again`).
            kit::failpoint::crash_point("replay.after_wave");
        }
        println!(
            "replayed {} event(s) of {} order(s) so far ({} ms)",
            summary.republished,
            summary.orders,
            started.elapsed().as_millis()
        );
    }
    // Bounded: a replay that tripped the broker's alarm with its last wave
    // is done, and must not wait for the alarm to end to say so.
    kit::amqp::close_bounded(&channel, "replay done").await;
    kit::amqp::close_connection_bounded(&connection, "replay done").await;
    Ok(summary)
}
