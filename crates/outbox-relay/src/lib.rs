//! outbox-relay: moves committed outbox rows from the `orders` database to the
//! `order-events` exchange, at least once, in per-order order.
//!
//! The cycle of each worker (several per instance, any number of instances):
//!
//! 1. **claim** (one short transaction): the due rows that are the lowest
//!    unpublished sequence of their order, `FOR UPDATE SKIP LOCKED`, get a
//!    lease (`claimed_by`, `claim_until`), as many as `batch_size` and
//!    `batch_max_bytes` allow; commit. A row whose leases ran out twice in
//!    a row is claimed alone (see [`claim::CLAIM_SQL`]).
//! 2. **publish** outside any transaction: the whole batch in flight on a
//!    confirm-mode channel, `mandatory`, bounded by the confirm timeout.
//! 3. **mark** the acked rows `published_at` in one statement (only while
//!    still under this claim's lease); record failures in one statement
//!    (`attempt_count + 1`, `last_error`, backoff with jitter in
//!    `available_at`, lease released; quarantine after the maximum attempts
//!    for failures of the message's own: returned, unencodable, and the
//!    relay dying while it held the row alone; a timeout, a broken channel
//!    or a nack is the infrastructure's and never counts).
//!
//! A crash between 2 and 3 republishes (a duplicate, never a loss); an
//! expired lease is taken over. Sequence k+1 is never claimed while k is
//! unpublished (leased elsewhere, in backoff or quarantined), so an order's
//! events reach the broker one confirmed event at a time, in order. Idle
//! workers sleep until a NOTIFY after an outbox commit (`listen`), the
//! earliest backoff expiry or the poll interval.
//!
//! - [`claim`]: leased claims (short transaction, `FOR UPDATE SKIP LOCKED`,
//!   only each order's lowest unpublished sequence), marking, failures.
//! - [`publish`]: the AMQP message of a row and pipelined confirmed publishing.
//! - [`relay`]: the worker loop; [`listen`]: LISTEN/NOTIFY wake-up;
//!   [`floor`]: where the claim's walk of the dispatch index starts.
//! - [`cleanup`], [`requeue`], [`replay`]: housekeeping and admin subcommands.
//! - [`metrics`]: the Prometheus metrics.

pub mod claim;
pub mod cleanup;
pub mod cli;
pub mod floor;
pub mod listen;
pub mod metrics;
pub mod publish;
pub mod relay;
pub mod replay;
pub mod requeue;
pub mod settings;

use std::sync::Arc;

use actix_web::{web, App, HttpServer};
use kit::{amqp::Connected, db::PgPool, http::Health, migrations::Database, CancellationToken};
use tokio::sync::watch;

pub use settings::Settings;

use crate::metrics::Metrics;
use crate::relay::Relay;

pub const SERVICE: &str = "outbox-relay";

/// The `application_name` of the pooled connections of `instance` (claims,
/// marks, failures, gauges, the floor) in `pg_stat_activity`; its LISTEN and
/// cleanup connections are `outbox-relay listen <instance>` and
/// `outbox-relay cleanup <instance>`.
pub fn application_name(instance: &str) -> String {
    format!("{SERVICE} {instance}")
}

/// A built relay: database reachable and migrated, health listener bound.
pub struct Application {
    settings: Settings,
    pool: PgPool,
    metrics: Metrics,
    instance: String,
    server: actix_web::dev::Server,
    port: u16,
    connected: Connected,
}

impl Application {
    pub async fn build(settings: Settings, shutdown: &CancellationToken) -> anyhow::Result<Self> {
        let instance = settings.relay.resolved_instance_id();
        let pool = kit::db::named_pool(
            &settings.database,
            Some(kit::db::SESSION_LIMITS),
            &application_name(&instance),
        )?;
        kit::db::wait_until_ready(&pool, shutdown).await?;
        // The outbox table belongs to the orders schema; migrating here too (under
        // the advisory lock) means the relay does not depend on start order.
        kit::migrations::run_until(&pool, Database::Orders, shutdown).await?;
        let connected = Connected::default();
        let registry = kit::metrics::registry(SERVICE);
        let metrics = Metrics::new(&registry);
        let health = Health::new(
            SERVICE,
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
        let server = HttpServer::new(move || {
            App::new()
                .configure(kit::http::health_routes(health.clone()))
                .default_service(web::to(kit::http::not_found))
        })
        .workers(1)
        .disable_signals()
        .shutdown_timeout(10)
        .listen(listener)?
        .run();
        tracing::info!(port, instance, "health and metrics listening");
        Ok(Self {
            settings,
            pool,
            metrics,
            instance,
            server,
            port,
            connected,
        })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn instance(&self) -> &str {
        &self.instance
    }

    /// Relay until `shutdown`: on SIGTERM stop claiming, finish (publish,
    /// confirm, mark) the batches in flight, then exit.
    pub async fn run_until_stopped(self, shutdown: CancellationToken) -> anyhow::Result<()> {
        let (wake_tx, wake_rx) = watch::channel(0_u64);
        let wake_tx = Arc::new(wake_tx);
        let listening = tokio::spawn(listen::listen(
            self.settings.database.url.clone(),
            self.instance.clone(),
            Arc::clone(&wake_tx),
            shutdown.clone(),
        ));
        let stop_listening = listening.abort_handle();
        // A LISTEN task that panicked (a bug) stops the service, instead of
        // leaving it to poll (every `poll_interval_ms`) with no alert. Not
        // awaited at the end: its reconnects are not bounded by a stop.
        let listener = tokio::spawn(kit::shutdown::essential(
            "LISTEN",
            listening,
            shutdown.clone(),
        ));
        let gauges = tokio::spawn(self.metrics.clone().refresh_periodically(
            self.pool.clone(),
            self.settings.relay.only_tenant.clone(),
            std::time::Duration::from_millis(self.settings.relay.metrics_interval_ms),
            shutdown.clone(),
        ));
        let cleanup = self.settings.cleanup.enabled.then(|| {
            tokio::spawn(cleanup::run_periodically(
                self.settings.database.url.clone(),
                self.instance.clone(),
                self.settings.cleanup.clone(),
                self.metrics.clone(),
                shutdown.clone(),
            ))
        });
        let (floor_tx, floor_rx) = watch::channel(floor::Floor::NegInfinity);
        let floor = tokio::spawn(floor::refresh_periodically(
            self.pool.clone(),
            self.settings.relay.only_tenant.clone(),
            std::time::Duration::from_millis(self.settings.relay.claim_floor_margin_ms),
            std::time::Duration::from_millis(self.settings.relay.claim_floor_refresh_ms),
            floor_tx,
            Arc::clone(&wake_tx),
            self.metrics.clone(),
            shutdown.clone(),
        ));
        let relay = Relay {
            pool: self.pool.clone(),
            settings: self.settings.relay.clone(),
            instance: self.instance.clone(),
            metrics: self.metrics.clone(),
            wake: wake_rx,
            floor: floor_rx,
            settling: Arc::default(),
            exiting: shutdown.clone(),
        };
        // Set when the broker refuses the exchange as declared: the service
        // stops with this error (reconnecting would never help).
        let fatal = Arc::new(std::sync::OnceLock::<String>::new());
        let broker = {
            let shutdown = shutdown.clone();
            let settings = self.settings.amqp.clone();
            let connected = self.connected.clone();
            let name = format!("{SERVICE} {}", self.instance);
            let exchange = self.settings.relay.exchange.clone();
            let fatal = Arc::clone(&fatal);
            tokio::spawn(async move {
                kit::amqp::supervise(&settings, &name, &connected, &shutdown, |connection| {
                    let shutdown = shutdown.clone();
                    let relay = relay.clone();
                    let exchange = exchange.clone();
                    let fatal = Arc::clone(&fatal);
                    async move {
                        match declare_or_refuse(&connection, &exchange, &shutdown).await {
                            Ok(true) => {}
                            Ok(false) => {
                                // Stopped first.
                                kit::amqp::close_connection_bounded(&connection, "relay stopping")
                                    .await;
                                return Ok(());
                            }
                            Err(error)
                                if kit::amqp::reply_code(&error)
                                    == Some(kit::amqp::PRECONDITION_FAILED) =>
                            {
                                let why = format!(
                                    "exchange {exchange} exists with another type or other \
                                     arguments than a durable topic exchange: {error}"
                                );
                                tracing::error!(%why, "refusing to publish");
                                let _ = fatal.set(why);
                                shutdown.cancel();
                                return Ok(());
                            }
                            Err(error) => return Err(error),
                        }
                        let result = relay.run_on(&connection, &shutdown).await;
                        kit::amqp::close_connection_bounded(&connection, "relay stopping").await;
                        result
                    }
                })
                .await;
            })
        };
        // Each part ends only on shutdown, unless it panicked (a bug): then
        // the whole service stops with an error, so that it is restarted and
        // seen, instead of answering /readyz while relaying nothing (or with
        // a frozen floor, silent gauges, no cleanup).
        let essential = |name, task| kit::shutdown::essential(name, task, shutdown.clone());
        let cleanup = async {
            match cleanup {
                Some(cleanup) => essential("outbox cleanup", cleanup).await,
                None => Ok(()),
            }
        };
        let server = kit::http::run_until_stopped(self.server, shutdown.clone());
        let (served, broker, floor, gauges, cleanup) = tokio::join!(
            server,
            essential("relay loop", broker),
            essential("claim floor", floor),
            essential("gauges", gauges),
            cleanup
        );
        stop_listening.abort();
        listener.abort();
        drop(wake_tx);
        served?;
        broker?;
        if let Some(why) = fatal.get() {
            anyhow::bail!("relay stopped: {why}");
        }
        floor?;
        gauges?;
        cleanup?;
        tracing::info!("relay stopped");
        Ok(())
    }
}

/// Declare the exchange the relay publishes to on a channel of its own
/// before the workers start, so that a refusal (406: it exists as another
/// type) is seen as what it is, not as a lost connection to retry forever.
/// `Ok(false)` when `shutdown` came first. A broker that stops answering
/// here is found by the heartbeat (minutes): a stop does not wait for it,
/// but closes the channel it opened, as [`kit::amqp::open_channel`] does.
async fn declare_or_refuse(
    connection: &lapin::Connection,
    exchange: &str,
    shutdown: &CancellationToken,
) -> Result<bool, lapin::Error> {
    let Some(channel) = kit::amqp::open_channel(connection, shutdown).await? else {
        return Ok(false);
    };
    let declared = kit::shutdown::unless_stopped(shutdown, std::time::Duration::ZERO, async {
        tracing::debug!(exchange, "declaring the exchange");
        // A test stops the relay here.
        kit::failpoint::hold_task("relay.declaring").await;
        kit::amqp::declare_topic_exchange(&channel, exchange).await
    })
    .await;
    kit::amqp::close_bounded(&channel, "declared").await;
    declared.transpose().map(|declared| declared.is_some())
}
