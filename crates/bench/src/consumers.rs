//! Phase 3: each consumer applying a filled queue, against the same inbox +
//! effect transaction run raw (the runtime's statements and the domain's
//! own `apply`, straight through tokio-postgres, no broker), at the same
//! concurrency (one sequential worker per partition).

use std::time::{Duration, Instant};

use consumer_runtime::process::{
    open_message, ADVANCE_PROGRESS, INSERT_INBOX, INSERT_PROGRESS, LOCK_PROGRESS,
};
use consumer_runtime::Domain;
use events::RawEnvelope;
use serde::Serialize;
use system_tests::{consumers::Kind, pg_url};
use tokio_postgres::{types::ToSql, Client};

use crate::stats::rate;

#[derive(Clone, Debug, Default, Serialize)]
pub struct Apply {
    pub events: u64,
    pub wall_seconds: f64,
    /// First to last `processed_at` (without the process's start-up).
    pub span_seconds: f64,
    pub per_second: f64,
    /// Events applied in each second from the run's start ([`timeline`];
    /// for the chart). Phase 3's measured halves only: the unprepared run,
    /// which the chart leaves out, has none.
    pub timeline: Vec<u64>,
}

impl Apply {
    /// This run followed by `next`, as one run: events over the sum of both
    /// spans (the pause between them, another side's turn, left out), the
    /// timelines one after the other.
    pub fn then(mut self, next: Apply) -> Apply {
        let events = self.events + next.events;
        let wall_seconds = self.wall_seconds + next.wall_seconds;
        let span_seconds = self.span_seconds + next.span_seconds;
        self.timeline.extend(next.timeline);
        Apply {
            events,
            wall_seconds,
            span_seconds,
            per_second: if span_seconds > 0.0 {
                crate::stats::rate(events, Duration::from_secs_f64(span_seconds))
            } else {
                crate::stats::rate(events, Duration::from_secs_f64(wall_seconds))
            },
            timeline: self.timeline,
        }
    }
}

pub async fn db(kind: Kind) -> Client {
    let (client, connection) =
        tokio_postgres::connect(&pg_url(kind.database()), tokio_postgres::NoTls)
            .await
            .expect("consumer database");
    tokio::spawn(connection);
    client
}

/// Vacuum (and analyze) the database's tables now, outside a measured
/// interval: each half of phase 3 starts with no vacuum debt, so an
/// autovacuum pass triggered by the writes of an earlier half (or phase)
/// does not land on whichever side happens to run next. (The bench's CPU
/// table showed it: 126 µs per event of autovacuum in one consumer half
/// against 28 in the raw halves of the same run.)
///
/// Except the empty tables. Vacuumed empty, a table is recorded as empty
/// (`reltuples` 0), and a session's generic plan of a prepared statement
/// made then finds every index equally cheap: on a fresh cluster the
/// ledger's check for an earlier posting walked all of the tenant's
/// entries (by `journal_entries_tenant_written_idx`, on the tenant alone)
/// for the consumer's whole first half, until its next sessions planned
/// with statistics; loyalty's and inventory's lookups by order likewise.
/// Only the service's first half ran so, on the tables the raw side then
/// found full: 731 against 572 µs of PostgreSQL per ledger event. A table
/// never vacuumed (`reltuples` -1) is planned as ten pages, and each of
/// these lookups takes the order's index: the state of a fresh deployment,
/// whose empty tables nothing vacuums (autovacuum waits for 50 changed
/// rows, and its ANALYZE then has the rows to plan by). A table emptied
/// by an earlier run's teardown is skipped too, its dead rows left to
/// autovacuum, which may then run during a half: vacuumed, it would be
/// planned as empty again.
pub async fn vacuum(db: &Client) {
    for table in user_tables(db).await {
        if !is_empty(db, &table).await {
            db.batch_execute(&format!("VACUUM ANALYZE {table}"))
                .await
                .expect("vacuum");
        }
    }
}

/// Return the database's tables that hold no rows (an earlier run's
/// teardown emptied them) to the state of a fresh cluster: truncated, so
/// their files and indexes start empty and they are planned as never
/// vacuumed (`reltuples` -1). Left as the teardown left them, they keep
/// their heap and index pages, and once autovacuum has vacuumed them they
/// are planned as empty: the services' sessions then planned on them. A
/// second run on one cluster read `make bench-api` at 74.9 % (PostgreSQL
/// 841 against the raw side's 610 µs per order; first run 91.5 %, 658
/// against 630; rebuilding the indexes alone left it at 73.2 %, where
/// this reads 91.8 %). For the orders database (`Bench::start`); the
/// consumers' get [`compact_empty`]. Only tables with no row, checked
/// again under an exclusive lock in the truncating transaction: nothing of
/// anyone's is lost. The tables' own TRUNCATE guards (the outbox's) are
/// lifted for that transaction as the teardown lifts the journal's
/// (`session_replication_role = replica`, the local cluster's role being a
/// superuser); if that or the truncation is refused, the indexes are
/// rebuilt instead, and the run says so.
pub async fn reset_empty(db: &mut Client) {
    let empty = empty_tables(db).await;
    if empty.is_empty() {
        return;
    }
    let truncated = async {
        let tx = db.transaction().await?;
        tx.batch_execute(
            "SET LOCAL session_replication_role = replica; SET LOCAL lock_timeout = '2s'",
        )
        .await?;
        tx.batch_execute(&format!(
            "LOCK TABLE {} IN ACCESS EXCLUSIVE MODE",
            empty.join(", ")
        ))
        .await?;
        let mut still = Vec::new();
        for table in &empty {
            if is_empty(&tx, table).await {
                still.push(table.as_str());
            }
        }
        if !still.is_empty() {
            tx.batch_execute(&format!("TRUNCATE {}", still.join(", ")))
                .await?;
        }
        tx.commit().await
    }
    .await;
    if let Err(error) = truncated {
        println!("  (could not truncate the empty tables, rebuilding their indexes: {error})");
        compact_empty(db).await;
    }
}

/// Rebuild the indexes of the database's empty tables (an earlier run's
/// teardown emptied them): a B-tree keeps its pages when its rows are
/// deleted, and the planner costs an index scan by the index's pages. A
/// second run on one cluster found the ledger's indexes at 200-340 pages
/// over an empty table, and the service's first half, planning on them,
/// spent 765 against the raw side's 540 µs of PostgreSQL per event (a
/// first run: 551 against 536). Rebuilt, 568 against 546. Only empty
/// tables: nothing of another tenant's is touched, and the rebuild takes a
/// moment.
pub async fn compact_empty(db: &Client) {
    for table in empty_tables(db).await {
        db.batch_execute(&format!("REINDEX TABLE {table}"))
            .await
            .expect("reindex");
    }
}

/// The database's tables that hold no rows.
async fn empty_tables(db: &Client) -> Vec<String> {
    let mut empty = Vec::new();
    for table in user_tables(db).await {
        if is_empty(db, &table).await {
            empty.push(table);
        }
    }
    empty
}

async fn user_tables(db: &Client) -> Vec<String> {
    db.query(
        "SELECT format('%I.%I', schemaname, relname) FROM pg_stat_user_tables ORDER BY 1",
        &[],
    )
    .await
    .expect("tables")
    .iter()
    .map(|row| row.get(0))
    .collect()
}

async fn is_empty(db: &impl tokio_postgres::GenericClient, table: &str) -> bool {
    db.query_one(&format!("SELECT NOT EXISTS (SELECT FROM {table})"), &[])
        .await
        .expect("empty?")
        .get(0)
}

pub async fn now(db: &Client) -> time::OffsetDateTime {
    db.query_one("SELECT now()", &[]).await.expect("now").get(0)
}

async fn applied_since(db: &Client, name: &str, since: time::OffsetDateTime) -> (u64, f64) {
    let row = db
        .query_one(
            "SELECT count(*), EXTRACT(EPOCH FROM max(processed_at) - min(processed_at))::float8
               FROM processed_events WHERE consumer_name = $1 AND processed_at >= $2",
            &[&name, &since],
        )
        .await
        .expect("applied");
    (
        u64::try_from(row.get::<_, i64>(0)).unwrap_or_default(),
        row.get::<_, Option<f64>>(1).unwrap_or_default(),
    )
}

/// Events `name` applied in each second since `since`, by `processed_at`
/// (its transaction's start): every second to the last, the last partial,
/// so that the timeline sums to the events applied since `since`. Read
/// once the run is over, outside its CPU meter (the service's side and
/// the raw side alike: one measure for both), not by counting while it
/// runs, which competes with the consumer for the same PostgreSQL.
pub async fn timeline(db: &Client, name: &str, since: time::OffsetDateTime) -> Vec<u64> {
    let rows = db
        .query(
            "SELECT floor(EXTRACT(EPOCH FROM processed_at - $2))::bigint, count(*)
               FROM processed_events WHERE consumer_name = $1 AND processed_at >= $2
              GROUP BY 1 ORDER BY 1",
            &[&name, &since],
        )
        .await
        .expect("timeline");
    by_second(rows.iter().map(|row| (row.get(0), row.get(1))))
}

/// (second, count) pairs as a timeline from second 0: a second without
/// any is 0, not left out (a stall shows as one).
fn by_second(counts: impl IntoIterator<Item = (i64, i64)>) -> Vec<u64> {
    let mut timeline = Vec::new();
    for (second, count) in counts {
        let second = usize::try_from(second).unwrap_or_default();
        if timeline.len() <= second {
            timeline.resize(second + 1, 0);
        }
        timeline[second] += u64::try_from(count).unwrap_or_default();
    }
    timeline
}

/// Wait until `name` has applied `events` events since `since` (its
/// timeline is the caller's to read, once its CPU meter has stopped:
/// [`timeline`]).
pub async fn measure(
    db: &Client,
    name: &str,
    since: time::OffsetDateTime,
    events: u64,
    started: Instant,
) -> Apply {
    let mut last_print = Instant::now();
    let mut progress = crate::stats::Progress::new(0);
    loop {
        let (applied, span) = applied_since(db, name, since).await;
        if applied >= events {
            let wall = started.elapsed();
            return Apply {
                events: applied,
                wall_seconds: wall.as_secs_f64(),
                span_seconds: span,
                per_second: if span > 0.0 {
                    applied as f64 / span
                } else {
                    rate(applied, wall)
                },
                timeline: Vec::new(),
            };
        }
        if last_print.elapsed() > Duration::from_secs(5) {
            println!(
                "  {name}: {applied}/{events} applied after {:.0?}",
                started.elapsed()
            );
            last_print = Instant::now();
        }
        assert!(
            started.elapsed() < Duration::from_secs(1800),
            "{name}: {applied}/{events}"
        );
        if let Err(stalled) = progress.check(applied, format_args!("{name}: applied of {events}")) {
            panic!("{stalled}");
        }
        // Rarely: the count competes with the consumer for the same
        // PostgreSQL (the raw loop counts in-process), and the rate comes
        // from the `processed_at` span, not from when the count is seen.
        // Near the end more often: the caller's CPU meter stops when this
        // returns, and every idle second after the last event would count.
        let pause = if applied * 10 >= events * 9 {
            100
        } else {
            1000
        };
        tokio::time::sleep(Duration::from_millis(pause)).await;
    }
}

/// The runtime's transaction (crates/consumer-runtime/src/process.rs) for
/// one in-order event, with the domain's own handler. `pipelined`: the
/// runtime's own opening of the transaction (`open_message`: its four
/// statements prepared and sent together), or, as the runtime sent them
/// before the benchmark, one at a time as text.
async fn apply_one<D: Domain>(
    client: &mut kit::db::Client,
    pipelined: bool,
    domain: &D,
    name: &str,
    body: &[u8],
) -> anyhow::Result<()> {
    let raw = RawEnvelope::parse_raw(body)?;
    // Like the runtime: only the types the domain applies are decoded.
    let event = D::HANDLES
        .contains(&raw.event_type.as_str())
        .then(|| raw.decode().ok())
        .flatten();
    let tx = client.transaction().await?;
    if pipelined {
        let opened = open_message(&tx, name, &raw).await?;
        anyhow::ensure!(opened.new, "raw events are new");
        anyhow::ensure!(opened.advanced, "in order");
    } else {
        sequential_open(&tx, name, &raw).await?;
    }
    if let Some(event) = &event {
        // What the service would hand on once committed (a metric) is no
        // part of the raw transaction.
        let _ = domain
            .apply(&tx, event, &raw)
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    tx.commit().await?;
    Ok(())
}

/// The runtime's opening statements as text, one round trip each.
async fn sequential_open(
    tx: &kit::db::Transaction<'_>,
    name: &str,
    raw: &RawEnvelope,
) -> anyhow::Result<()> {
    let inbox_args: [&(dyn ToSql + Sync); 3] = [&name, &raw.event_id, &raw.tenant_id];
    let inserted = tx.query_opt(INSERT_INBOX, &inbox_args).await?;
    anyhow::ensure!(inserted.is_some(), "raw events are new");
    let progress_args: [&(dyn ToSql + Sync); 3] = [&name, &raw.aggregate_id, &raw.tenant_id];
    tx.execute(INSERT_PROGRESS, &progress_args).await?;
    let lock_args: [&(dyn ToSql + Sync); 3] = [&name, &raw.aggregate_id, &raw.aggregate_sequence];
    let progress = tx.query_one(LOCK_PROGRESS, &lock_args).await?;
    let last: i64 = progress.get(0);
    anyhow::ensure!(raw.aggregate_sequence == last + 1, "in order");
    let advance_args: [&(dyn ToSql + Sync); 4] = [
        &name,
        &raw.aggregate_id,
        &raw.aggregate_sequence,
        &raw.tenant_id,
    ];
    tx.execute(ADVANCE_PROGRESS, &advance_args).await?;
    Ok(())
}

async fn raw_with<D: Domain>(
    kind: Kind,
    name: &str,
    bodies: &[(String, Vec<u8>)],
    workers: usize,
    pipelined: bool,
) -> Apply {
    let domain = std::sync::Arc::new(D::new(&kit::metrics::prometheus::Registry::new()));
    // Partition like the hash exchange does: one order, one worker.
    let mut shares: Vec<Vec<Vec<u8>>> = vec![Vec::new(); workers.max(1)];
    for (aggregate, body) in bodies {
        let h = aggregate
            .bytes()
            .fold(0_u64, |h, b| h.wrapping_mul(31).wrapping_add(u64::from(b)));
        shares[(h % workers.max(1) as u64) as usize].push(body.clone());
    }
    // Pooled connections like the service's (the domain prepares its
    // statements through the pool's statement cache; the same session
    // settings), one per worker: the pool holds exactly the workers'.
    let mut settings = kit::settings::DatabaseSettings::local(kind.database().name());
    settings.url = system_tests::pg_url(kind.database());
    settings.pool_size = shares.len();
    let pool = kit::db::pool_with_options(&settings, Some(&consumer_runtime::session_options()))
        .expect("pool");
    let mut clients = Vec::new();
    for _ in 0..shares.len() {
        clients.push(pool.get().await.expect("raw connection"));
    }
    let started = Instant::now();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for (client, share) in clients.into_iter().zip(shares) {
        let (domain, name, pool) = (domain.clone(), name.to_owned(), pool.clone());
        let done = done.clone();
        tasks.spawn(async move {
            // The worker's connection; `None` once the database closed it
            // and until the pool gives a new one.
            let mut held = Some(client);
            for body in share {
                // Retried on a new connection if the database went away (other
                // engineers' fault tests restart it); an event applied before
                // the failure counts as done. A duplicate without a failure
                // before it (left-over inbox rows) fails the run: it would
                // count an event not applied.
                let mut attempts = 0;
                loop {
                    let applied = match connection(&pool, &mut held).await {
                        Ok(client) => {
                            apply_one(client, pipelined, domain.as_ref(), &name, &body).await
                        }
                        Err(error) => Err(error),
                    };
                    let Err(error) = applied else { break };
                    if error.to_string().contains("raw events are new") {
                        assert!(
                            attempts > 0,
                            "raw apply: a duplicate with no failure before it: {error}"
                        );
                        break;
                    }
                    attempts += 1;
                    assert!(attempts < 50, "raw apply: {error}");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    // A connection the database closed is taken out of the
                    // pool (which frees its slot) before the next attempt
                    // asks the pool for another. The pool has one slot per
                    // worker, all held: kept, the closed connection left no
                    // slot for its replacement (each `get` waited out its
                    // 5 s and failed, and the worker retried on the closed
                    // connection until its attempts ran out).
                    if let Some(closed) = held.take_if(|client| client.is_closed()) {
                        drop(kit::db::Client::take(closed));
                    }
                }
                done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        });
    }
    let mut progress = tokio::time::interval_at(
        tokio::time::Instant::now() + Duration::from_secs(5),
        Duration::from_secs(5),
    );
    loop {
        tokio::select! {
            result = tasks.join_next() => match result {
                Some(result) => result.expect("raw worker"),
                None => break,
            },
            _ = progress.tick() => println!(
                "  raw {name}: {}/{} applied after {:.0?}",
                done.load(std::sync::atomic::Ordering::Relaxed),
                bodies.len(),
                started.elapsed()
            ),
        }
    }
    let wall = started.elapsed();
    Apply {
        events: bodies.len() as u64,
        wall_seconds: wall.as_secs_f64(),
        span_seconds: wall.as_secs_f64(),
        per_second: rate(bodies.len() as u64, wall),
        // The caller's to read, once its CPU meter has stopped ([`timeline`]).
        timeline: Vec::new(),
    }
}

/// The connection `held`, or when there is none, a new one from `pool`
/// (held from then on).
async fn connection<'a>(
    pool: &kit::db::PgPool,
    held: &'a mut Option<kit::db::Client>,
) -> anyhow::Result<&'a mut kit::db::Client> {
    let client = match held.take() {
        Some(client) => client,
        None => pool.get().await?,
    };
    Ok(held.insert(client))
}

/// Apply `bodies` (aggregate id, envelope) raw as consumer `name` of `kind`.
pub async fn raw(
    kind: Kind,
    name: &str,
    bodies: &[(String, Vec<u8>)],
    workers: usize,
    pipelined: bool,
) -> Apply {
    match kind {
        Kind::Inventory => {
            raw_with::<inventory_consumer::Inventory>(kind, name, bodies, workers, pipelined).await
        }
        Kind::Ledger => {
            raw_with::<ledger_consumer::Ledger>(kind, name, bodies, workers, pipelined).await
        }
        Kind::Loyalty => {
            raw_with::<loyalty_consumer::Loyalty>(kind, name, bodies, workers, pipelined).await
        }
    }
}

/// Remove a consumer name's inbox and progress rows.
pub async fn forget(kind: Kind, name: &str) {
    let db = db(kind).await;
    let _ = db
        .execute(
            "DELETE FROM processed_events WHERE consumer_name = $1",
            &[&name],
        )
        .await;
    let _ = db
        .execute(
            "DELETE FROM order_progress WHERE consumer_name = $1",
            &[&name],
        )
        .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn apply(events: u64, span_seconds: f64, timeline: &[u64]) -> Apply {
        Apply {
            events,
            wall_seconds: span_seconds + 1.0,
            span_seconds,
            per_second: events as f64 / span_seconds,
            timeline: timeline.to_vec(),
        }
    }

    #[test]
    fn two_halves_make_one_rate_over_both_spans() {
        // 5000 in 2 s, then 5000 in 8 s: 10000 in 10 s, not the mean of
        // 2500 and 625.
        let both = apply(5000, 2.0, &[3000, 2000]).then(apply(5000, 8.0, &[625; 8]));
        assert_eq!(both.events, 10_000);
        assert_eq!(both.span_seconds, 10.0);
        assert_eq!(both.wall_seconds, 12.0);
        assert_eq!(both.per_second, 1000.0);
        assert_eq!(both.timeline.len(), 10);
        assert_eq!(both.timeline.iter().sum::<u64>(), 10_000);
    }

    #[test]
    fn a_second_without_an_event_is_a_zero_in_the_timeline() {
        // Seconds 0 (the start-up) and 3 (a stall) had none.
        assert_eq!(
            by_second([(1, 900), (2, 1000), (4, 300)]),
            vec![0, 900, 1000, 0, 300]
        );
        assert_eq!(by_second([]), Vec::<u64>::new());
    }
}
