//! Phase 2: the relay draining a backlog against a raw lapin confirm-publish
//! loop of the very same messages into the same topology (the system's
//! private topic exchange bound to one quorum queue, drained as it fills);
//! and the long backlog run (`make bench-backlog`).

use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::SystemTime,
    time::{Duration, Instant},
};

use futures_util::StreamExt;
use kit::amqp::{check_confirmation, lapin};
use lapin::{
    options::{
        BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions, QueueBindOptions,
        QueueDeclareOptions, QueueDeleteOptions,
    },
    types::{AMQPValue, FieldTable},
    Channel, Connection,
};
use outbox_relay::{claim::OutboxRow, publish};
use serde::Serialize;
use tokio_postgres::Client;

use crate::stats::{ms, rate};

/// A drain (or a raw publish loop) of `events` messages.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Drain {
    pub events: u64,
    /// From the relay's start (or the first publish) to the last row marked
    /// (or the last confirm).
    pub wall_seconds: f64,
    /// From the sink's first message to the last `published_at` (the
    /// relay, without its process start-up) or to the last confirm (the raw
    /// loop, without its channels' set-up); the rate is the events over it.
    pub span_seconds: f64,
    pub per_second: f64,
    /// Messages the sink received in each second of the run, the last
    /// second partial (for the chart).
    pub timeline: Vec<u64>,
    /// The raw loop's last confirm (the end of its span).
    #[serde(skip)]
    pub last_confirm: Option<SystemTime>,
}

impl Drain {
    /// Two runs of the same loop as one: events over the sum of their
    /// spans (and wall times), timelines one after the other.
    pub fn then(mut self, next: Drain) -> Drain {
        let events = self.events + next.events;
        let wall_seconds = self.wall_seconds + next.wall_seconds;
        let span_seconds = self.span_seconds + next.span_seconds;
        self.timeline.extend(next.timeline);
        Drain {
            events,
            wall_seconds,
            span_seconds,
            per_second: crate::stats::rate(events, Duration::from_secs_f64(span_seconds)),
            timeline: self.timeline,
            last_confirm: next.last_confirm,
        }
    }
}

/// PostgreSQL's write-ahead log over an interval: bytes from the WAL insert
/// position, records and full-page images from `pg_stat_wal`, checkpoints
/// from `pg_stat_bgwriter`, read before and after.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Wal {
    pub records: i64,
    pub bytes: i64,
    /// Full-page images: each page's first change after a checkpoint.
    pub full_pages: i64,
    /// Checkpoints started (a drain's: since the `CHECKPOINT` before its
    /// backlog was written).
    pub checkpoints: i64,
}

impl Wal {
    /// The counters now. A backend reports its WAL to `pg_stat_wal` at most
    /// once a second, and at its exit: this connection's own (the backlog's
    /// writes, `settle`'s VACUUM) is flushed first (PostgreSQL 15's
    /// `pg_stat_force_next_flush`, which takes effect when the statement
    /// ends), so that it lands before the interval, not inside it; read the
    /// end of an interval after its other connections have closed.
    /// PostgreSQL 15 or 16 (the project's is 15): `pg_stat_force_next_flush`
    /// came in 15, and 17 moved the checkpoint counters out of
    /// `pg_stat_bgwriter`.
    pub async fn read(db: &Client) -> anyhow::Result<Wal> {
        db.batch_execute("SELECT pg_stat_force_next_flush()")
            .await?;
        let row = db
            .query_one(
                "SELECT w.wal_records, w.wal_fpi,
                        (pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::bigint,
                        b.checkpoints_timed + b.checkpoints_req
                   FROM pg_stat_wal w, pg_stat_bgwriter b",
                &[],
            )
            .await?;
        Ok(Wal {
            records: row.get(0),
            full_pages: row.get(1),
            bytes: row.get(2),
            checkpoints: row.get(3),
        })
    }

    pub fn plus(self, other: Wal) -> Wal {
        Wal {
            records: self.records + other.records,
            bytes: self.bytes + other.bytes,
            full_pages: self.full_pages + other.full_pages,
            checkpoints: self.checkpoints + other.checkpoints,
        }
    }

    pub fn since(self, before: Wal) -> Wal {
        Wal {
            records: self.records - before.records,
            bytes: self.bytes - before.bytes,
            full_pages: self.full_pages - before.full_pages,
            checkpoints: self.checkpoints - before.checkpoints,
        }
    }

    /// "7.3 records, 565 bytes, 0.00 full-page images per event; 0
    /// checkpoints started"
    pub fn per_event(&self, events: u64) -> String {
        let (records, bytes, full_pages) = self.per_event_values(events);
        format!(
            "{records:.1} records, {bytes:.0} bytes, {full_pages:.2} full-page images per event; {} checkpoint(s) started",
            self.checkpoints
        )
    }

    /// (records, bytes, full-page images) per event.
    pub fn per_event_values(&self, events: u64) -> (f64, f64, f64) {
        let n = events.max(1) as f64;
        (
            self.records as f64 / n,
            self.bytes as f64 / n,
            self.full_pages as f64 / n,
        )
    }
}

/// Write the tenant's backlog again inside a fresh checkpoint cycle: every
/// row marked published (as a drain leaves them), `CHECKPOINT`, then every
/// row made unpublished again ([`reset`]). The reset then changes
/// `published_at`, so each row gets a new version and index entries written
/// after the checkpoint, whichever drain comes next (from rows still
/// unpublished, it would be a HOT update touching no index, and the
/// drain's marks would then write full-page images of the index pages).
/// Backlog and drain share one checkpoint cycle, as in steady traffic a
/// relay publishes rows milliseconds after their insert changed their
/// pages. Before, whether a checkpoint started inside a drain was chance;
/// one that did cost PostgreSQL 77 µs per event against 65 in the next
/// drain (session 16). The next checkpoint is then `checkpoint_timeout` (5
/// min) or ~0.5 GiB of WAL away: with the default 100,000 events the
/// rewrite, the settle and the drain take well under a minute and ~200 MB.
/// Returns the checkpoint counter read *before* the `CHECKPOINT` (the
/// checkpointer releases the waiting backend before it reports its count):
/// a drain that ends with a count above it plus one saw another.
pub async fn rewrite_in_a_fresh_checkpoint_cycle(db: &Client, tenant: &str) -> anyhow::Result<i64> {
    println!(
        "  backlog marked published, CHECKPOINT, backlog made unpublished again (backlog and \
         drain in one checkpoint cycle)"
    );
    mark_published(db, tenant, None).await?;
    let before = Wal::read(db).await?.checkpoints;
    db.batch_execute("CHECKPOINT").await?;
    reset(db, tenant).await;
    Ok(before)
}

/// Wait (at most 10 s) until no relay connection opened since `since` (the
/// database's clock: the bench's relays, not those of another run on the
/// same server) is left in `pg_stat_activity`: a backend reports the last
/// of its WAL counters at its exit.
pub async fn wait_relay_backends_gone(db: &Client, since: time::OffsetDateTime) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let left: i64 = match db
            .query_one(
                "SELECT count(*) FROM pg_stat_activity
                  WHERE application_name LIKE $1 AND backend_start >= $2",
                &[&outbox_relay::application_name("%"), &since],
            )
            .await
        {
            Ok(row) => row.get(0),
            Err(_) => return,
        };
        if left == 0 {
            return;
        }
        if Instant::now() > deadline {
            println!("  ({left} relay connections still open after 10 s: their last WAL counters may be missing)");
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The sink of the relay phase: a quorum queue bound `#` to the system's
/// exchange, drained without acks as fast as it fills.
pub struct Sink {
    pub connection: Connection,
    pub channel: Channel,
    pub queue: String,
    delivered: Arc<AtomicU64>,
    /// When the first message since [`Sink::arm`] arrived (microseconds
    /// since the Unix epoch; 0: none yet).
    first_at: Arc<AtomicU64>,
    /// The distinct `message_id`s received since [`Sink::arm`], and how many
    /// messages repeated one: a drain must deliver each event, once.
    received: Arc<std::sync::Mutex<Received>>,
}

/// What [`Sink`] received since it was armed.
#[derive(Default)]
struct Received {
    ids: std::collections::HashSet<String>,
    repeated: u64,
    without_id: u64,
}

impl Sink {
    pub async fn bind(exchange: &str) -> Sink {
        let connection = system_tests::consumers::connect().await;
        let channel = connection.create_channel().await.expect("channel");
        let queue = format!("{exchange}.sink");
        let mut args = FieldTable::default();
        args.insert(
            "x-queue-type".into(),
            AMQPValue::LongString("quorum".into()),
        );
        channel
            .queue_declare(
                queue.as_str().into(),
                QueueDeclareOptions {
                    durable: true,
                    ..QueueDeclareOptions::default()
                },
                args,
            )
            .await
            .expect("sink queue");
        channel
            .queue_bind(
                queue.as_str().into(),
                exchange.into(),
                "#".into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("bind sink");
        let delivered = Arc::new(AtomicU64::new(0));
        let mut consumer = channel
            .basic_consume(
                queue.as_str().into(),
                "bench-sink".into(),
                BasicConsumeOptions {
                    no_ack: true,
                    ..BasicConsumeOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .expect("consume sink");
        let counter = delivered.clone();
        let first_at = Arc::new(AtomicU64::new(0));
        let first = first_at.clone();
        let received = Arc::new(std::sync::Mutex::new(Received::default()));
        let ids = received.clone();
        tokio::spawn(async move {
            while let Some(Ok(delivery)) = consumer.next().await {
                if first.load(Ordering::Relaxed) == 0 {
                    first.store(unix_micros(SystemTime::now()), Ordering::Relaxed);
                }
                {
                    let mut received = ids.lock().expect("received");
                    match delivery.properties.message_id() {
                        Some(id) => {
                            if !received.ids.insert(id.to_string()) {
                                received.repeated += 1;
                            }
                        }
                        None => received.without_id += 1,
                    }
                }
                counter.fetch_add(1, Ordering::Relaxed);
            }
        });
        Sink {
            connection,
            channel,
            queue,
            delivered,
            first_at,
            received,
        }
    }

    /// Note when the next message arrives ([`Sink::first_since_armed`]),
    /// and count distinct messages from now ([`Sink::distinct`]).
    pub fn arm(&self) {
        self.first_at.store(0, Ordering::Relaxed);
        *self.received.lock().expect("received") = Received::default();
    }

    /// Since [`Sink::arm`]: distinct message ids received, messages that
    /// repeated one, and messages without an id.
    pub fn distinct(&self) -> (u64, u64, u64) {
        let received = self.received.lock().expect("received");
        (
            u64::try_from(received.ids.len()).unwrap_or(u64::MAX),
            received.repeated,
            received.without_id,
        )
    }

    /// When the first message since [`Sink::arm`] arrived, in seconds since
    /// the Unix epoch (the host's clock, which PostgreSQL's `now()` reads
    /// too); `None` before one has.
    pub fn first_since_armed(&self) -> Option<f64> {
        match self.first_at.load(Ordering::Relaxed) {
            0 => None,
            micros => Some(micros as f64 / 1e6),
        }
    }

    /// Messages received so far.
    pub fn delivered(&self) -> u64 {
        self.delivered.load(Ordering::Relaxed)
    }

    /// Count what the sink receives in each second from now until the
    /// returned recorder is finished.
    pub fn record(&self) -> Recorder {
        Recorder::start(self.delivered.clone())
    }

    /// Wait until the sink has received `want` messages in all; an error
    /// after `at_most`.
    pub async fn wait_delivered(&self, want: u64, at_most: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + at_most;
        let mut progress = crate::stats::Progress::new(self.delivered());
        while self.delivered() < want {
            anyhow::ensure!(
                Instant::now() < deadline,
                "the sink received {} of {want} messages in {at_most:?}",
                self.delivered()
            );
            progress.check(
                self.delivered(),
                format_args!("the sink, waiting for {want}"),
            )?;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(())
    }

    pub async fn delete(self) {
        let _ = self
            .channel
            .queue_delete(self.queue.as_str().into(), QueueDeleteOptions::default())
            .await;
        let _ = self.connection.close(200, "done".into()).await;
    }
}

/// Per-second counts of a [`Sink`] ([`Sink::record`]).
pub struct Recorder {
    task: tokio::task::JoinHandle<()>,
    counter: Arc<AtomicU64>,
    /// The counter when recording started.
    start: u64,
    seconds: Arc<std::sync::Mutex<Vec<u64>>>,
}

impl Recorder {
    /// Count the increments of `counter` in each second from now.
    fn start(counter: Arc<AtomicU64>) -> Recorder {
        let start = counter.load(Ordering::Relaxed);
        let seconds = Arc::new(std::sync::Mutex::new(Vec::new()));
        let (ticking, out) = (counter.clone(), seconds.clone());
        let task = tokio::spawn(async move {
            let mut last = start;
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            tick.tick().await;
            loop {
                tick.tick().await;
                let now = ticking.load(Ordering::Relaxed);
                out.lock().expect("timeline").push(now - last);
                last = now;
            }
        });
        Recorder {
            task,
            counter,
            start,
            seconds,
        }
    }

    /// Stop; the count of every full second so far, then that of the
    /// partial last second when it has any (one with none would draw as a
    /// stall): the timeline sums to what the counter gained while
    /// recording (before, a raw half of ~2.7 s kept its first 2 s alone,
    /// and the chart's raw line showed 72,031 of 100,000 messages). The
    /// partial second is the counter's gain less the full seconds', read
    /// under their lock: a tick the abort did not stop in time lands after
    /// the timeline was taken, and its messages are in the partial second.
    pub fn finish(self) -> Vec<u64> {
        self.task.abort();
        let mut seconds = self.seconds.lock().expect("timeline");
        let counted: u64 = seconds.iter().sum();
        let partial = self.counter.load(Ordering::Relaxed) - self.start - counted;
        if partial > 0 {
            seconds.push(partial);
        }
        std::mem::take(&mut *seconds)
    }
}

/// Add synthetic rows to the tenant's backlog until it holds `events`
/// unpublished rows: copies of the API's real rows (same payload shape and
/// size) under new order ids, `per_order` events per order (sequences 1 to
/// `per_order`, at most 3: `OrderPlaced`, `PaymentReceived`,
/// `ParcelDelivered`; every copy carries its template's `OrderPlaced`
/// payload, which only the relay and the sink see). Their `occurred_at` and
/// `available_at` are spread one microsecond apart, oldest first, ending
/// at the top-up's start (like rows arriving one after another, so the
/// claim walks them in order as it would a real backlog; 100,000 copies
/// span 0.1 s, after the API's real rows). An order's events are adjacent:
/// the claim's hardest case, every later event right behind the earlier one
/// that holds it back. Inserted in chunks, with progress printed. Fails
/// when the tenant has no row to copy.
pub async fn top_up(db: &Client, tenant: &str, events: i64, per_order: i64) -> anyhow::Result<i64> {
    anyhow::ensure!(
        (1..=3).contains(&per_order),
        "events per order must be 1, 2 or 3, not {per_order}"
    );
    const CHUNK: i64 = 50_000;
    let have: i64 = db
        .query_one(
            "SELECT count(*) FROM outbox_events WHERE tenant_id = $1 AND published_at IS NULL",
            &[&tenant],
        )
        .await?
        .get(0);
    let extra = events - have;
    anyhow::ensure!(
        extra <= 0 || have > 0,
        "tenant {tenant} has no unpublished outbox rows to copy into a backlog of {events} \
         (did the template orders fail?)"
    );
    if extra > 0 {
        // The templates, numbered once (the copies are pending rows too).
        db.batch_execute("DROP TABLE IF EXISTS bench_templates")
            .await?;
        db.execute(
            "CREATE TEMP TABLE bench_templates AS
                 SELECT row_number() OVER (ORDER BY occurred_at, event_id) - 1 AS n,
                        payload, traceparent
                   FROM outbox_events WHERE tenant_id = $1 AND published_at IS NULL",
            &[&tenant],
        )
        .await?;
        let base: time::OffsetDateTime = db.query_one("SELECT now()", &[]).await?.get(0);
        let salt = uuid::Uuid::new_v4().to_string();
        let started = Instant::now();
        let mut from = 0;
        while from < extra {
            let to = (from + CHUNK).min(extra);
            db.execute(
                // An order's id from the run's salt and the order's number:
                // the same for its events in every chunk.
                "WITH g AS (SELECT g, md5($7 || (g / $8::bigint)::text)::uuid AS id,
                                  g % $8::bigint + 1 AS seq
                              FROM generate_series($2::bigint, $3::bigint - 1) g)
                 INSERT INTO outbox_events (event_id, tenant_id, aggregate_type, aggregate_id,
                     aggregate_sequence, event_type, schema_version, payload, traceparent,
                     occurred_at, available_at)
                 SELECT gen_random_uuid(), $1, 'order', g.id::text, g.seq,
                        CASE g.seq WHEN 1 THEN 'OrderPlaced' WHEN 2 THEN 'PaymentReceived'
                                   ELSE 'ParcelDelivered' END, 1,
                        jsonb_set(jsonb_set(src.payload, '{order_id}', to_jsonb(g.id::text)),
                                  '{checkout_id}', to_jsonb('synthetic-' || g.id::text)),
                        src.traceparent,
                        $5::timestamptz - ($6::bigint - g.g) * interval '1 microsecond',
                        $5::timestamptz - ($6::bigint - g.g) * interval '1 microsecond'
                   FROM g JOIN bench_templates src ON src.n = g.g % $4::bigint",
                &[&tenant, &from, &to, &have, &base, &extra, &salt, &per_order],
            )
            .await?;
            from = to;
            println!(
                "  top-up: {from}/{extra} rows inserted after {:.0?}",
                started.elapsed()
            );
        }
        db.batch_execute("DROP TABLE bench_templates").await?;
    }
    println!("  VACUUM ANALYZE outbox_events");
    db.batch_execute("VACUUM ANALYZE outbox_events").await?;
    Ok(events.max(have))
}

/// Make every row of the tenant unpublished again (for the next drain).
pub async fn reset(db: &Client, tenant: &str) {
    db.execute(
        "UPDATE outbox_events SET published_at = NULL, claimed_by = NULL, claim_until = NULL,
                attempt_count = 0, last_error = NULL
          WHERE tenant_id = $1",
        &[&tenant],
    )
    .await
    .expect("reset");
    db.batch_execute("VACUUM ANALYZE outbox_events")
        .await
        .expect("vacuum");
}

/// The tenant's unpublished rows, counted from the pending rows' partial index
/// (`outbox_dispatch_idx`). Left to itself the planner may scan the whole
/// table (every retained published row: 40-70 ms on the bench's database,
/// seconds on the backlog run's), which on two shared cores took CPU from the
/// very drain being measured.
pub async fn unpublished(db: &Client, tenant: &str) -> i64 {
    let tenant = tenant.replace('\'', "''");
    let messages = db
        .simple_query(&format!(
            "BEGIN; SET LOCAL enable_seqscan = off;
             SELECT count(*) FROM outbox_events WHERE tenant_id = '{tenant}' AND published_at IS NULL;
             COMMIT"
        ))
        .await
        .expect("unpublished");
    messages
        .iter()
        .find_map(|message| match message {
            tokio_postgres::SimpleQueryMessage::Row(row) => row.get(0)?.parse().ok(),
            _ => None,
        })
        .expect("a count")
}

/// Wait until the tenant has no unpublished row (`started`: relays started).
/// While the drain runs only the sink's in-process counter is watched (no
/// query competes with the drain for the CPU); once the sink has received
/// `total` more messages than `delivered_before`, the database is asked until
/// the last rows are marked. An error once `deadline` has passed since
/// `started`.
#[allow(clippy::too_many_arguments)]
pub async fn measure_drain(
    db: &Client,
    tenant: &str,
    started: Instant,
    label: &str,
    sink: &Sink,
    delivered_before: u64,
    total: u64,
    deadline: Duration,
) -> anyhow::Result<Drain> {
    let mut last_print = Instant::now();
    let mut progress = crate::stats::Progress::new(0);
    loop {
        let delivered = sink.delivered().saturating_sub(delivered_before);
        if delivered >= total {
            break;
        }
        progress.check(delivered, format_args!("{label}: delivered of {total}"))?;
        if last_print.elapsed() > Duration::from_secs(5) {
            println!(
                "  {label}: {delivered}/{total} delivered after {:.0?}",
                started.elapsed()
            );
            last_print = Instant::now();
        }
        anyhow::ensure!(
            started.elapsed() < deadline,
            "{label}: {delivered}/{total} delivered after {deadline:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut progress = crate::stats::Progress::new(u64::MAX);
    loop {
        let left = unpublished(db, tenant).await;
        if left == 0 {
            break;
        }
        progress.check(
            u64::try_from(left).unwrap_or_default(),
            format_args!("{label}: rows left unpublished"),
        )?;
        anyhow::ensure!(
            started.elapsed() < deadline,
            "{label}: {left} rows left unpublished after {deadline:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let wall = started.elapsed();
    // From the sink's first message (the relays' first publish, after their
    // start-up and first claim) to the last mark: every event's work lies
    // in it, none before it, as on the raw side (first message to last
    // confirm). A span that started at the first mark instead would count
    // the other workers' first batches, published before it (+0.5 to 1.5 %).
    let row = db
        .query_one(
            "SELECT count(*), EXTRACT(EPOCH FROM max(published_at))::float8
               FROM outbox_events WHERE tenant_id = $1",
            &[&tenant],
        )
        .await?;
    let events = u64::try_from(row.get::<_, i64>(0))
        .unwrap_or_default()
        .max(total);
    // Every event reached the sink, once: the counter alone would have
    // passed a relay that published some rows twice and marked others
    // without publishing them. The last messages may still be on their
    // way to the sink after the last mark.
    loop {
        let (distinct, repeated, without_id) = sink.distinct();
        anyhow::ensure!(
            repeated == 0 && without_id == 0,
            "{label}: the sink received {repeated} messages twice and {without_id} without a message id"
        );
        if distinct == events {
            break;
        }
        anyhow::ensure!(
            distinct < events && started.elapsed() < deadline,
            "{label}: the sink received {distinct} distinct events of {events}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let last_mark: f64 = row.get::<_, Option<f64>>(1).unwrap_or_default();
    let first = sink
        .first_since_armed()
        .ok_or_else(|| anyhow::anyhow!("{label}: the sink was not armed or received nothing"))?;
    let span = last_mark - first;
    anyhow::ensure!(
        span > 0.0,
        "{label}: the last mark ({last_mark}) precedes the sink's first message ({first})"
    );
    Ok(Drain {
        events,
        wall_seconds: wall.as_secs_f64(),
        span_seconds: span,
        per_second: events as f64 / span,
        timeline: Vec::new(),
        last_confirm: None,
    })
}

/// Microseconds since the Unix epoch (the sink's atomic holds them).
fn unix_micros(at: SystemTime) -> u64 {
    (kit::metrics::unix_seconds(at) * 1e6) as u64
}

/// The raw loop's span on the relay's terms: from the sink's first message
/// to its last confirm, its rate the events over it.
pub fn span_from_first_message(raw: &mut Drain, sink: &Sink) -> anyhow::Result<()> {
    let first = sink
        .first_since_armed()
        .ok_or_else(|| anyhow::anyhow!("raw loop: the sink received nothing"))?;
    let last = raw
        .last_confirm
        .ok_or_else(|| anyhow::anyhow!("raw loop: no confirm recorded"))?;
    let span = kit::metrics::unix_seconds(last) - first;
    anyhow::ensure!(
        span > 0.0,
        "raw loop: the last confirm precedes the sink's first message"
    );
    raw.span_seconds = span;
    raw.per_second = raw.events as f64 / span;
    Ok(())
}

/// The tenant's rows as the relay claims them, written at or after `since`
/// (`occurred_at`; `None`: every row), at most `limit`, in the order they
/// were written (an order's events in their sequence).
pub async fn rows(
    db: &Client,
    tenant: &str,
    since: Option<time::OffsetDateTime>,
    limit: i64,
) -> Vec<OutboxRow> {
    db.query(
        "SELECT event_id, tenant_id, aggregate_type, aggregate_id, aggregate_sequence,
                event_type, schema_version, payload, traceparent, tracestate, occurred_at,
                attempt_count
           FROM outbox_events
          WHERE tenant_id = $1 AND ($2::timestamptz IS NULL OR occurred_at >= $2)
          ORDER BY occurred_at, aggregate_sequence, event_id LIMIT $3",
        &[&tenant, &since, &limit],
    )
    .await
    .expect("rows")
    .iter()
    .map(|row| OutboxRow::try_from_row(row).expect("a readable outbox row"))
    .collect()
}

/// Mark the tenant's unpublished rows written at or after `since`
/// (`occurred_at`; `None`: all of them) published, as if a relay had: how
/// many.
pub async fn mark_published(
    db: &Client,
    tenant: &str,
    since: Option<time::OffsetDateTime>,
) -> Result<u64, tokio_postgres::Error> {
    db.execute(
        "UPDATE outbox_events SET published_at = now()
          WHERE tenant_id = $1 AND published_at IS NULL
            AND ($2::timestamptz IS NULL OR occurred_at >= $2)",
        &[&tenant, &since],
    )
    .await
}

/// The relay's message of `row` (body, routing key, properties, headers).
pub fn message(row: &OutboxRow) -> publish::Message {
    let mut trace = HashMap::new();
    if let Some(traceparent) = &row.traceparent {
        trace.insert(events::headers::TRACEPARENT.to_owned(), traceparent.clone());
    }
    publish::message(row, &trace, false).expect("encode")
}

/// Confirm-publish each message to its exchange on `channels` confirm
/// channels spread over `connections`, `window` in flight on each: the raw
/// limit of what the relay does.
pub async fn raw_publish(
    connections: &[Connection],
    messages: Arc<Vec<(String, publish::Message)>>,
    channels: usize,
    window: usize,
) -> Drain {
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    let share = messages.len().div_ceil(channels.max(1));
    for c in 0..channels.max(1) {
        // Spread over the connections as relays spread their workers: each
        // relay process has one connection for all its channels.
        let connection = &connections[c % connections.len().max(1)];
        let channel = connection.create_channel().await.expect("channel");
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .expect("confirms");
        let messages = messages.clone();
        tasks.spawn(async move {
            let mine = messages
                .iter()
                .skip(c * share)
                .take(share)
                .collect::<Vec<_>>();
            for chunk in mine.chunks(window.max(1)) {
                // Like the relay (`publish_batch`): every publish of the
                // window handed to lapin before any is awaited.
                let sends = chunk.iter().map(|(exchange, message)| {
                    channel.basic_publish(
                        exchange.as_str().into(),
                        message.routing_key.as_str().into(),
                        BasicPublishOptions {
                            mandatory: true,
                            ..BasicPublishOptions::default()
                        },
                        &message.body,
                        message.properties.clone(),
                    )
                });
                // Bounded, the sends too (lapin writes nothing while the
                // broker blocks publishers under an alarm): the run fails
                // and tears down instead of hanging.
                let chunk = async {
                    for confirm in futures_util::future::join_all(sends).await {
                        let confirm = confirm.expect("publish");
                        check_confirmation(confirm.await.expect("confirm"))
                            .expect("routed and acked");
                    }
                };
                tokio::time::timeout(Duration::from_secs(60), chunk)
                    .await
                    .expect("a window published and confirmed within 60 s");
            }
            let last_confirm = SystemTime::now();
            let _ = channel.close(200, "done".into()).await;
            last_confirm
        });
    }
    let mut last_confirm = None;
    while let Some(result) = tasks.join_next().await {
        let at = result.expect("publisher task");
        last_confirm = last_confirm.max(Some(at));
    }
    let wall = started.elapsed();
    Drain {
        events: messages.len() as u64,
        wall_seconds: wall.as_secs_f64(),
        span_seconds: wall.as_secs_f64(),
        per_second: rate(messages.len() as u64, wall),
        timeline: Vec::new(),
        last_confirm,
    }
}

/// One sample of the long backlog run.
#[derive(Clone, Debug, Serialize)]
pub struct BacklogSample {
    pub seconds: f64,
    pub left: i64,
    pub claim_ms: f64,
    pub dead_tuples: i64,
    pub live_tuples: i64,
}

/// The claim statement (500 rows, the tenant only) timed in a transaction
/// that is rolled back, so it claims nothing; plus the outbox table's
/// dead and live tuples. (The rolled-back UPDATE leaves up to 500 dead
/// tuples itself per sample, 250/s against the drain's two per event.)
/// `left`: the events the sink has not received yet (counting the pending
/// rows themselves would read up to a million index entries and rows per
/// sample, on the cores the drain needs).
pub async fn backlog_sample(
    db: &mut Client,
    tenant: &str,
    started: Instant,
    left: i64,
) -> BacklogSample {
    let tx = db.transaction().await.expect("tx");
    let t = Instant::now();
    // From the start of the index (no floor): the walk a claim makes when
    // the floor is at the oldest pending row, as under a backlog.
    let floor = outbox_relay::claim::Floor::NegInfinity;
    let defaults = outbox_relay::settings::RelaySettings::default();
    tx.query(
        outbox_relay::claim::CLAIM_SQL,
        &[
            &"bench-probe",
            &30_000_i64,
            &500_i64,
            &tenant,
            &floor,
            &defaults.batch_max_bytes,
            &defaults.max_attempts,
            &true,
            &Vec::<time::OffsetDateTime>::new(),
        ],
    )
    .await
    .expect("claim probe");
    let claim_ms = ms(t.elapsed());
    tx.rollback().await.expect("rollback");
    let row = db
        .query_one(
            "SELECT n_dead_tup, n_live_tup FROM pg_stat_user_tables WHERE relname = 'outbox_events'",
            &[],
        )
        .await
        .expect("tuples");
    BacklogSample {
        seconds: started.elapsed().as_secs_f64(),
        left,
        claim_ms,
        dead_tuples: row.get(0),
        live_tuples: row.get(1),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_timeline_sums_to_what_arrived_while_recording() {
        // What arrived before the recording is not its.
        let counter = Arc::new(AtomicU64::new(100));
        // Shorter than a second: no full second, all of it partial.
        let recorder = Recorder::start(counter.clone());
        counter.fetch_add(7, Ordering::Relaxed);
        assert_eq!(recorder.finish(), vec![7]);
        // A full second, then part of the next: their sum, however the
        // ticks fell.
        let recorder = Recorder::start(counter.clone());
        counter.fetch_add(10, Ordering::Relaxed);
        tokio::time::sleep(Duration::from_millis(1300)).await;
        counter.fetch_add(5, Ordering::Relaxed);
        let timeline = recorder.finish();
        assert_eq!(timeline.iter().sum::<u64>(), 15, "{timeline:?}");
    }
}
