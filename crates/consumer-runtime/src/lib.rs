//! The consumer runtime: one implementation of "receive an order event, apply it
//! once, in order" shared by the inventory, ledger and loyalty consumers, which
//! supply only a [`Domain`] (names, database, `apply`, read routes).
//!
//! - [`topology`]: the consumer's own exchange and queues (hash exchange on
//!   `aggregate_id`, quorum partition queues with single active consumer,
//!   retry tiers dead-lettering back to the hash exchange, the DLQ);
//! - [`process`]: the per-message transaction (inbox, per-order progress,
//!   handler, retry / defer / dead letter / park);
//! - `worker`: partitions consumed concurrently, in order within each, with
//!   reconnect (kit::amqp::supervise) and graceful shutdown (the in-flight
//!   message is finished and acknowledged);
//! - [`redrive`]: the `redrive` subcommand; [`cleanup`]: inbox cleanup;
//! - [`metrics`], [`auth`] (service token + tenant scope of read endpoints),
//!   [`settings`].
//!
//! # Command line
//!
//! `<consumer>` or `<consumer> serve`: consume and serve HTTP;
//! `<consumer> migrate`; `<consumer> redrive [--order <order id>]`: move dead
//! letters back (per order, in sequence order) and un-park their orders.
//!
//! # Configuration (`<PREFIX>` = `INVENTORY_CONSUMER`, `LEDGER_CONSUMER`, `LOYALTY_CONSUMER`)
//!
//! | variable | default |
//! |---|---|
//! | `<PREFIX>__HTTP__PORT` | 8081 / 8082 / 8083 |
//! | `<PREFIX>__DATABASE__URL`, `__DATABASE__POOL_SIZE` (the sessions applying messages; the read endpoints and migrations have 4 more) | local `inventory` / `ledger` / `loyalty`, 16 |
//! | `<PREFIX>__AMQP__URL` | `amqp://app:app@127.0.0.1:5672/%2f` |
//! | `<PREFIX>__CONSUMER__NAME` (inbox key, queue prefix) | `inventory` / `ledger` / `loyalty` |
//! | `<PREFIX>__CONSUMER__PARTITIONS` | 4 |
//! | `<PREFIX>__CONSUMER__PREFETCH` (per partition) | 64 |
//! | `<PREFIX>__CONSUMER__RETRY_TIERS_MS` | `10000,60000,300000,1800000,7200000` |
//! | `<PREFIX>__CONSUMER__MAX_ATTEMPTS` | 5 |
//! | `<PREFIX>__CONSUMER__MAX_DEFERRALS` | 30 |
//! | `<PREFIX>__CONSUMER__DELIVERY_LIMIT` (crash-loop backstop) | 20 |
//! | `<PREFIX>__CONSUMER__BIND_ORDER_EVENTS` | true (tests: false) |
//! | `<PREFIX>__CONSUMER__ONLY_TENANTS` (test isolation; comma-separated) | empty = every tenant |
//! | `<PREFIX>__CLEANUP__INBOX_RETENTION_HOURS` (>= `__CLEANUP__MIN_RETENTION_HOURS`, 168) | 192 |
//! | `<PREFIX>__CLEANUP__INTERVAL_SECS`, `__CLEANUP__BATCH_SIZE` | 600, 1000 |
//! | `SERVICE_TOKEN` (or `<PREFIX>__AUTH__SERVICE_TOKEN`) | `local-dev-token` unless `<PREFIX>__AUTH__REQUIRE_TOKEN=true` |
//!
//! # Fail points (binaries built with the `failpoints` feature, `FAILPOINTS=...`)
//!
//! - `consumer.in_handler`: a crash point inside the transaction, before the
//!   handler (`return` aborts the process; `sleep(ms)` slows it down);
//! - `consumer.before_commit`: a crash point after the handler's writes (and
//!   the inbox row's), before the commit;
//! - `consumer.after_commit_before_ack`: a crash point after the commit,
//!   before the acknowledgement (`consumer.stale.after_commit`: the same
//!   for a stale copy's inbox row);
//! - `consumer.after_republish_before_ack`: a crash point after a retry or
//!   deferral copy is confirmed, before the message is acknowledged;
//! - `consumer.after_dead_letter_before_ack`, `..._before_park`,
//!   `consumer.after_park_before_ack`: crash points after a dead letter is
//!   confirmed (before the acknowledgement, or before the order's park
//!   commits) and after the park commits;
//! - `consumer.redrive.after_unpark_before_publish`,
//!   `..._after_unpark_without_letters`, `..._after_publish_before_ack`,
//!   `..._after_keep_before_ack`, `..._before_discard`,
//!   `..._after_first_pass`: crash points of
//!   `redrive` (README's crash table);
//! - `consumer.cleanup`: a crash point in the inbox cleanup, after a batch's
//!   delete, before its commit;
//! - `consumer.handler_error`: the handler fails (not a crash): `return` for
//!   every event, `return(<order id or event id>)` for one order or event,
//!   `N*return(...)` for the first N evaluations;
//! - `consumer.handler_panic`: the handler panics (a bug in domain code),
//!   with the same arguments: caught, a failed attempt of the event;
//! - `consumer.partition_set_up`: `return(<ms>)` delays the set-up after a
//!   partition's channels are open (not a crash: an interleaving a test
//!   makes certain).

// Endpoints return kit::http::Problem (problem+json) as their error type.
#![allow(clippy::result_large_err)]

pub mod auth;
pub mod cleanup;
pub mod metrics;
pub mod process;
pub mod redrive;
pub mod settings;
pub mod topology;
mod worker;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use actix_web::{web, App, HttpServer};
use events::{Event, RawEnvelope};
use kit::{amqp::Connected, http::Health, migrations::Database, CancellationToken};

pub use auth::TenantScope;
pub use settings::Settings;
pub use tokio_postgres;
pub use topology::Topology;

/// The database transaction a handler runs in (the runtime's inbox row and
/// progress update commit with the handler's rows, or none of them do). A
/// pooled connection's transaction: handlers prepare their hot statements
/// with `prepare_cached` (once per connection, then one round trip each).
pub type Transaction<'a> = kit::db::Transaction<'a>;

/// A domain handler failure: the transaction is rolled back and the event is
/// retried through the tiers, then dead-lettered. A *transient* failure (the
/// database connection dropped, a deadlock, a serialization failure) is not
/// the event's fault: the same message is retried in place, with backoff,
/// without counting an attempt.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct HandlerError {
    message: String,
    transient: bool,
    /// The failure belongs to the session (a prepared statement an online
    /// migration invalidated, a session on a standby): the connection is
    /// closed, not returned to the pool, so the retry gets a fresh one.
    fresh_session: bool,
}

impl HandlerError {
    /// A failure of this event (counted as a failed attempt).
    pub fn new(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            transient: false,
            fresh_session: false,
        }
    }

    /// A failure of the infrastructure, not of the event.
    pub fn transient(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            transient: true,
            fresh_session: false,
        }
    }

    pub fn is_transient(&self) -> bool {
        self.transient
    }

    /// Whether the retry needs another session than this one's.
    pub fn needs_fresh_session(&self) -> bool {
        self.fresh_session
    }
}

impl From<tokio_postgres::Error> for HandlerError {
    fn from(error: tokio_postgres::Error) -> Self {
        // The server's message and detail (e.g. which constraint), not just "db error".
        let message = match error.as_db_error() {
            Some(db) => format!(
                "database: {}{}",
                db.message(),
                db.detail().map(|d| format!(" ({d})")).unwrap_or_default()
            ),
            None => format!("database: {}", kit::db::describe(&error)),
        };
        let deployment = error
            .code()
            .is_some_and(|code| deployment_fault(code.code()));
        if kit::db::transient(&error) || deployment {
            Self {
                fresh_session: deployment,
                ..Self::transient(message)
            }
        } else {
            Self::new(message)
        }
    }
}

/// The failure of a second `OrderPlaced` of an order already placed here
/// (order-api writes one per order; the inbox drops a redelivery of the same
/// event): one hand-written, or replayed under a new event id, would
/// otherwise be absorbed (its terms dropped, or its stock reserved again).
/// It stops for a human, as a second payment or delivery does.
/// `placed_by_sql` reads the event that placed the order (`$1` tenant, `$2`
/// order); `refused` says what was not done.
pub async fn already_placed(
    tx: &Transaction<'_>,
    placed_by_sql: &str,
    tenant: &str,
    order_id: uuid::Uuid,
    refused: &str,
) -> HandlerError {
    match tx.query_opt(placed_by_sql, &[&tenant, &order_id]).await {
        Ok(row) => HandlerError::new(format!(
            "order {order_id} was already placed (event {}); {refused}",
            row.map_or_else(
                || "unknown".to_owned(),
                |row| row.get::<_, uuid::Uuid>(0).to_string()
            )
        )),
        Err(error) => error.into(),
    }
}

/// Connections of the read endpoints' and migrations' pool: a process
/// holds at most `DATABASE__POOL_SIZE` + 4 sessions.
const READ_POOL_SIZE: usize = 4;

/// The server settings of the sessions that apply messages (and of the
/// bench's raw loop of the same transactions): [`kit::db::SESSION_LIMITS`],
/// and no sequential scan where an index serves. Every statement applying
/// a message is a lookup by key, prepared once per session and run for the
/// session's life (the read endpoints and the migrations have sessions of
/// their own, planned as usual); PostgreSQL picks a prepared statement's generic plan from its
/// first runs, and on a table recorded as empty (vacuumed while empty: a
/// fresh deployment's, once anything vacuumed it) a whole-table scan is the
/// cheapest, kept as the table grows until an ANALYZE replans it. `make
/// bench` on a fresh cluster ran every progress statement so: 2 x the
/// database's CPU per event.
pub fn session_options() -> String {
    format!("{} -c enable_seqscan=off", kit::db::SESSION_LIMITS)
}

/// SQLSTATEs no event can cause, only the deployment: the handlers' SQL is
/// fixed text, so a missing table, column or function, a privilege revoked
/// (class `42`), a missing database or schema (`3D`, `3F`) is a migration
/// not run or botched, or a grant lost; a read-only transaction (`25006`)
/// is the pool on a standby after a failover; class `58` (an I/O error,
/// a missing file) and `XX001`/`XX002` (a corrupted page or index) are
/// the storage's, the same for any event that touches it (the runtime's
/// own statements retry them in place too, see `process::the_event_s_own`);
/// and `0A000` is a prepared
/// statement whose table an online migration changed (cached plan must not
/// change result type). `25006` and `0A000` stay with their session, so the
/// connection is closed, not pooled (`HandlerError::needs_fresh_session`
/// for a handler's statement; the runtime's inbox insert, a read-only
/// session's first write, likewise), and the retry runs on a new one (a cache of new statements, the primary
/// the name points to now). Retried in place (the message held,
/// alert `ConsumerRetryingInPlace`) until the deployment is repaired,
/// instead of each event counting its attempts and every order ending
/// dead-lettered and parked.
pub fn deployment_fault(code: &str) -> bool {
    code.starts_with("42")
        || code.starts_with("3D")
        || code.starts_with("3F")
        || code == "25006"
        || code == "0A000"
        || code.starts_with("58")
        || code == "XX001"
        || code == "XX002"
}

/// What a consumer service is, beyond the shared runtime: its names, its
/// database, its handler and its read endpoints.
pub trait Domain: Send + Sync + Sized + 'static {
    /// Default consumer name: the inbox key and the prefix of its queues
    /// (`inventory`); overridable by `<ENV_PREFIX>__CONSUMER__NAME`.
    const NAME: &'static str;
    /// Binary and service name (`inventory-consumer`).
    const SERVICE: &'static str;
    /// Environment prefix of its settings (`INVENTORY_CONSUMER`).
    const ENV_PREFIX: &'static str;
    /// Its own database.
    const DATABASE: Database;
    /// Default HTTP port (8081, 8082, 8083).
    const DEFAULT_PORT: u16;
    /// The event types [`Domain::apply`] applies (`events::event_types`).
    /// Any other type, in any version, only advances the order's sequence:
    /// its payload is not decoded, so a new major version of it is no
    /// poison here.
    const HANDLES: &'static [&'static str];

    /// What an apply hands on to [`Domain::committed`] once its transaction
    /// committed (`()` for a domain with nothing to count).
    type Effects: Default + Send;

    /// Build the domain (register its own metrics in `registry`).
    fn new(registry: &kit::metrics::prometheus::Registry) -> Self;

    /// Apply one decoded event inside the runtime's transaction. Events the
    /// domain does not need are simply `Ok(())`.
    ///
    /// Only what is written through `tx` is covered by the inbox: it commits
    /// with the event's inbox row or not at all. An external side effect (an
    /// email, a payment provider, a courier's API) is not: the transaction
    /// can roll back after the call, or its commit's reply be lost, and the
    /// event is then applied again. Such a call must carry
    /// [`events::Envelope::downstream_key`] (order + operation) as the
    /// provider's idempotency key, or be written here as a row of the
    /// domain's own outbox and sent by another process (DESIGN.md section 8).
    /// No current domain makes one.
    fn apply(
        &self,
        tx: &Transaction<'_>,
        event: &Event,
        envelope: &RawEnvelope,
    ) -> impl Future<Output = Result<Self::Effects, HandlerError>> + Send;

    /// Called once the transaction of an apply committed, with what that
    /// apply returned: where a domain counts what only a committed effect
    /// may count (a metric). Never for an attempt that rolled back (a
    /// handler error, a deadlock retried in place, a failed COMMIT), so
    /// nothing is counted twice. The one miss: a COMMIT that succeeded but
    /// whose reply was lost (the connection dropped) is retried as if it
    /// failed, and the redelivery is then a duplicate: not counted (the
    /// effect's own rows are the exact record). Default: nothing.
    fn committed(&self, effects: Self::Effects) {
        let _ = effects;
    }

    /// Mount the domain's read endpoints. App data available: `web::Data<PgPool>`
    /// (the read endpoints' pool, planned as usual: not [`session_options`]),
    /// `web::Data<Arc<Self>>`, and [`TenantScope`] as an extractor. Each
    /// path through [`kit::http::resource`], so that another method is a
    /// 405 naming the path's methods.
    fn routes(cfg: &mut web::ServiceConfig);
}

fn topology_of(settings: &Settings) -> anyhow::Result<Topology> {
    Ok(Topology {
        name: settings.consumer.name.clone(),
        partitions: settings.consumer.partitions,
        tiers: settings.retry_tiers()?,
        delivery_limit: settings.consumer.delivery_limit,
        bind_order_events: settings.consumer.bind_order_events,
    })
}

/// A built consumer: database migrated, HTTP listener bound.
pub struct Application<D: Domain> {
    settings: Settings,
    server: actix_web::dev::Server,
    port: u16,
    connected: Connected,
    processor: Arc<process::Processor<D>>,
}

impl<D: Domain> Application<D> {
    /// Wait for the database, migrate it, bind the HTTP listener.
    pub async fn build(settings: Settings, shutdown: &CancellationToken) -> anyhow::Result<Self> {
        settings.validate()?;
        let topology = topology_of(&settings)?;
        let token = settings.service_token()?;
        // Sessions named `<service> <consumer name>` in pg_stat_activity, as
        // the relay's are by instance: an operator (or a test) finds which
        // consumer holds a lock.
        // The messages' sessions (`session_options`: keyed statements, no
        // sequential scan where an index serves) and the read endpoints' and
        // migrations' (planned as usual: a report may join or count whole
        // tables, where a sequential scan is the right plan).
        let pool = kit::db::named_pool(
            &settings.database,
            Some(&session_options()),
            &format!("{} {}", D::SERVICE, topology.name),
        )?;
        let reads = kit::db::named_pool(
            &kit::settings::DatabaseSettings {
                pool_size: READ_POOL_SIZE,
                ..settings.database.clone()
            },
            Some(kit::db::SESSION_LIMITS),
            &format!("{} {} reads", D::SERVICE, topology.name),
        )?;
        kit::db::wait_until_ready(&pool, shutdown).await?;
        kit::migrations::run_until(&reads, D::DATABASE, shutdown).await?;
        let registry = kit::metrics::registry(D::SERVICE);
        let metrics = metrics::Metrics::new(&registry, &topology.name, topology.tiers.len())?;
        let domain = Arc::new(D::new(&registry));
        let processor = Arc::new(process::Processor {
            domain: domain.clone(),
            pool: pool.clone(),
            topology,
            metrics,
            max_attempts: settings.consumer.max_attempts,
            max_deferrals: settings.consumer.max_deferrals,
            only_tenants: settings.only_tenants(),
        });
        let connected = Connected::default();
        let health = Health::new(
            D::SERVICE,
            registry,
            Some(pool.clone()),
            Some(connected.clone()),
        );
        kit::http::watch_readiness(
            health.clone(),
            std::time::Duration::from_secs(5),
            shutdown.clone(),
        );
        let listener = std::net::TcpListener::bind(settings.http.addr())?;
        let port = listener.local_addr()?.port();
        let token = auth::ServiceToken(token);
        let server =
            HttpServer::new(move || {
                App::new()
                    .app_data(web::Data::new(reads.clone()))
                    .app_data(web::Data::new(domain.clone()))
                    .app_data(web::Data::new(token.clone()))
                    .app_data(web::JsonConfig::default().limit(64 * 1024).error_handler(
                        |error, _| auth::bad_request("body", error.to_string()).into(),
                    ))
                    .app_data(web::QueryConfig::default().error_handler(|error, _| {
                        auth::bad_request("query", error.to_string()).into()
                    }))
                    .configure(kit::http::health_routes(health.clone()))
                    .configure(D::routes)
                    .default_service(web::to(kit::http::not_found))
            })
            .workers(1)
            .disable_signals()
            .shutdown_timeout(10)
            .listen(listener)?
            .run();
        tracing::info!(port, consumer = %settings.consumer.name, "listening");
        Ok(Self {
            settings,
            server,
            port,
            connected,
            processor,
        })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Serve until `shutdown`: HTTP, the partition workers (connection kept up,
    /// rebuilt when it drops) and the inbox cleanup.
    pub async fn run_until_stopped(self, shutdown: CancellationToken) -> anyhow::Result<()> {
        let broker = {
            let shutdown = shutdown.clone();
            let settings = self.settings.amqp.clone();
            let connected = self.connected.clone();
            let processor = self.processor.clone();
            let prefetch = self.settings.consumer.prefetch;
            // Named after the consumer, so an operator sees which one it is.
            let connection_name = format!("{}:{}", D::SERVICE, self.settings.consumer.name);
            let loop_ends = shutdown.clone();
            let fatal = Arc::new(std::sync::OnceLock::new());
            let broker = tokio::spawn(async move {
                // The supervisor's own flag says "connected"; /readyz reads
                // `connected`, which the worker sets once the topology is
                // declared: a ready consumer has its queues and bindings
                // (the relay starts after the consumers are ready).
                let socket = kit::amqp::Connected::default();
                kit::amqp::supervise(
                    &settings,
                    &connection_name,
                    &socket,
                    &shutdown,
                    |connection| {
                        worker::run_connection(
                            connection,
                            settings.clone(),
                            format!("{connection_name} (publishing)"),
                            processor.clone(),
                            prefetch,
                            shutdown.clone(),
                            fatal.clone(),
                            connected.clone(),
                        )
                    },
                )
                .await;
                match fatal.get() {
                    Some(why) => Err(anyhow::anyhow!("consumer topology conflict: {why}")),
                    None => Ok(()),
                }
            });
            // A panic outside a partition worker (they are watched by
            // `worker::run_connection`) stops the service instead of leaving
            // it answering /readyz while it consumes nothing.
            tokio::spawn(kit::shutdown::essential("consumer loop", broker, loop_ends))
        };
        // Ends only on shutdown, unless it panicked (a bug): then the
        // service stops, instead of consuming on with the inbox growing and
        // the parked-orders gauge frozen.
        let cleanup = tokio::spawn(kit::shutdown::essential(
            "inbox cleanup",
            tokio::spawn(cleanup::run(
                self.processor.pool.clone(),
                self.settings.consumer.name.clone(),
                self.settings.cleanup.inbox_retention_hours,
                self.settings.cleanup.batch_size,
                Duration::from_secs(self.settings.cleanup.interval_secs.max(1)),
                self.processor.metrics.clone(),
                shutdown.clone(),
            )),
            shutdown.clone(),
        ));
        let http = kit::http::run_until_stopped(self.server, shutdown.clone()).await;
        tracing::info!("http server stopped");
        // The workers finish their in-flight messages before this returns;
        // a stuck dependency is cut off by `kit::shutdown::GRACE`.
        broker.await???;
        tracing::info!("consumer stopped");
        // Returns at once on shutdown (a batch under way is dropped with its
        // transaction: rolled back, left to the next run).
        cleanup.await??;
        http?;
        Ok(())
    }
}

#[derive(Debug, clap::Parser)]
#[command(about = "An order-events consumer (with no subcommand: serve)")]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, clap::Subcommand)]
enum Command {
    /// Consume events and serve the read endpoints (the default).
    Serve,
    /// Apply pending database migrations, then exit.
    Migrate,
    /// Move dead letters back to the consumer (per order, in sequence order)
    /// and un-park their orders; prints what it moved.
    Redrive {
        /// Only this order (its aggregate id).
        #[arg(long)]
        order: Option<String>,
        /// At most this many dead letters are read per run (they are held
        /// unacknowledged while sorting); run again for the rest.
        #[arg(long, default_value_t = 10_000)]
        max: usize,
    },
}

/// The whole `main` of a consumer binary, run on tokio's default
/// multi-thread runtime (one worker per core). With a single worker the
/// partitions took turns on one thread: a partition holding stock-level row
/// locks waited for the thread while another partition ran, and the other
/// partition then waited for those locks (inventory +9 points against its
/// raw limit over five alternating `make bench-consumers` pairs, ledger and
/// loyalty within the noise, ~10 % more consumer CPU per event;
/// bench/findings.md, session 6).
pub async fn main<D: Domain>() -> anyhow::Result<()> {
    let cli = <Cli as clap::Parser>::parse();
    kit::service_main(D::SERVICE, |shutdown| async move {
        let settings = Settings::load::<D>()?;
        match cli.command.unwrap_or(Command::Serve) {
            Command::Serve => {
                kit::serve(&shutdown, async {
                    let app = Application::<D>::build(settings, &shutdown).await?;
                    app.run_until_stopped(shutdown.clone()).await
                })
                .await
            }
            Command::Redrive { order, max } => {
                let pool = kit::db::pool(&settings.database)?;
                kit::db::wait_until_ready(&pool, &shutdown).await?;
                kit::migrations::run(&pool, D::DATABASE).await?;
                let topology = topology_of(&settings)?;
                // One redrive of a consumer at a time: two drain its DLQ
                // between them, each deciding gaps and un-parks on the part
                // it holds (one kept letters as "never dead-lettered" that
                // the other held; one un-parked an order whose letters the
                // other held). A session-level advisory lock on a connection
                // of its own, for the whole run; its end (a crash too)
                // releases it.
                // Named, so that an operator finds it in pg_stat_activity;
                // the server's own keepalives end it within about 30 s of
                // its host dropping off the network (the default: two hours
                // of every redrive refused).
                let application = format!("{} redrive", settings.consumer.name);
                let mut config: tokio_postgres::Config = settings.database.url.parse()?;
                config.application_name(&application);
                kit::db::bound_command_session(&mut config);
                kit::db::bound_network_waits(&mut config);
                let (lock, connection) = kit::db::connect_with(&config).await?;
                let driver = tokio::spawn(connection);
                let locked: bool = lock
                    .query_one(
                        "SELECT pg_try_advisory_lock($1, hashtext($2))",
                        &[&redrive::LOCK_CLASS, &settings.consumer.name],
                    )
                    .await?
                    .get(0);
                if !locked {
                    // The lock's holder (not another refused run of the
                    // same name).
                    let holder: Option<i32> = lock
                        .query_opt(
                            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' \
                             AND classid = $1::int4::oid AND objid = hashtext($2)::oid \
                             AND objsubid = 2 AND granted AND database = \
                             (SELECT oid FROM pg_database WHERE datname = current_database())",
                            &[&redrive::LOCK_CLASS, &settings.consumer.name],
                        )
                        .await?
                        .map(|row| row.get(0));
                    anyhow::bail!(
                        "another redrive of {} is running (session {}, application_name {application:?}, \
                         holds the lock): let it finish, then run this again (a redrive whose \
                         host is gone: SELECT pg_terminate_backend(<pid>))",
                        settings.consumer.name,
                        holder.map_or("not found".to_owned(), |pid| format!("pid {pid}"))
                    );
                }
                let (report, result) =
                    redrive::redrive(&pool, &lock, &settings.amqp, &topology, order.as_deref(), max).await;
                drop(lock);
                let _ = driver.await;
                for moved in &report.moved {
                    println!(
                        "moved {} {} order {} seq {} (was: {})",
                        moved.event_id, moved.event_type, moved.order, moved.sequence, moved.reason
                    );
                }
                for order in &report.unparked {
                    println!("unparked order {order}");
                }
                for kept in &report.kept {
                    println!("kept {kept}");
                }
                for discarded in &report.discarded {
                    println!("discarded {discarded}");
                }
                println!(
                    "{}: {} dead letter(s) moved to {}, {} order(s) unparked",
                    topology.name,
                    report.moved.len(),
                    topology.exchange(),
                    report.unparked.len()
                );
                result?;
                // `--order X` asks for X to flow again: a run that did not
                // un-park it and leaves it parked (its letters past --max, a
                // gap, a malformed letter: the lines above say which) did
                // not do that. One that un-parked it did, whatever the
                // consumer then does with the moved letters (a letter that
                // fails again parks the order again, with a new letter).
                if let Some(order) = &order {
                    anyhow::ensure!(
                        report.unparked.contains(order)
                            || !redrive::parked(&pool, &settings.consumer.name, order).await?,
                        "order {order} is still parked (see the lines above)"
                    );
                }
                Ok(())
            }
            Command::Migrate => {
                let pool = kit::db::pool(&settings.database)?;
                let applied = kit::migrations::run_until(&pool, D::DATABASE, &shutdown).await?;
                println!(
                    "{}: {} migration(s) applied",
                    D::DATABASE.name(),
                    applied.len()
                );
                Ok(())
            }
        }
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::deployment_fault;

    #[test]
    fn only_what_the_deployment_causes_is_a_deployment_fault() {
        // undefined table, column, function; privilege; database; schema;
        // an I/O error, a missing file; a corrupted page or index
        for code in [
            "42P01", "42703", "42883", "42501", "3D000", "3F000", "25006", "0A000", "58030",
            "58P01", "XX001", "XX002",
        ] {
            assert!(deployment_fault(code), "{code}");
        }
        // what an event can cause (a constraint, a value, a trigger's
        // exception) or the infrastructure's transient states
        for code in [
            "23505", "23514", "22P02", "22003", "P0001", "40001", "XX000",
        ] {
            assert!(!deployment_fault(code), "{code}");
        }
    }
}
