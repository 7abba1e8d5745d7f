//! order-api: takes orders over HTTP and records each business mutation and its
//! event in one PostgreSQL transaction (the transactional outbox), idempotently
//! (seed 004's contract; see [`idempotency`]).

pub mod auth;
pub mod cleanup;
pub mod cli;
pub mod error;
pub mod idempotency;
pub mod metrics;
pub mod operations;
pub mod request;
pub mod routes;
pub mod settings;

use std::time::Duration;

use actix_web::{web, App, HttpServer};
use deadpool_postgres::Pool;
use kit::{http::Health, migrations::Database, CancellationToken};

pub use settings::Settings;

pub const SERVICE: &str = "order-api";

/// What every handler sees.
pub struct AppState {
    pub pool: Pool,
    pub settings: Settings,
    pub metrics: metrics::Metrics,
    pub in_flight: idempotency::InFlight,
    pub keys: auth::KeyCache,
}

/// The pool with the bounded lock wait on every session: a loser waits for
/// the key's owner at most `lock_timeout_ms`; nothing waits unboundedly.
pub fn pool(settings: &Settings) -> anyhow::Result<Pool> {
    let options = format!(
        "-c lock_timeout={} -c statement_timeout=30000 -c idle_in_transaction_session_timeout=60000",
        settings.idempotency.lock_timeout_ms
    );
    Ok(kit::db::pool_with_options(
        &settings.database,
        Some(&options),
    )?)
}

/// A built order-api: database migrated, listener bound.
pub struct Application {
    server: actix_web::dev::Server,
    port: u16,
    state: web::Data<AppState>,
}

impl Application {
    pub async fn build(settings: Settings, shutdown: &CancellationToken) -> anyhow::Result<Self> {
        let pool = pool(&settings)?;
        kit::db::wait_until_ready(&pool, shutdown).await?;
        kit::migrations::run(&pool, Database::Orders).await?;
        let metrics = metrics::Metrics::new(SERVICE);
        let health = Health {
            service: SERVICE,
            registry: metrics.registry.clone(),
            database: Some(pool.clone()),
            broker: None,
        };
        let listener = std::net::TcpListener::bind(settings.http.addr())?;
        let port = listener.local_addr()?.port();
        let workers = settings.http.workers;
        let state = web::Data::new(AppState {
            pool,
            settings,
            metrics,
            in_flight: idempotency::InFlight::default(),
            keys: auth::KeyCache::default(),
        });
        let app_state = state.clone();
        let mut server = HttpServer::new(move || {
            App::new()
                .app_data(app_state.clone())
                .configure(kit::http::health_routes(health.clone()))
                .configure(routes::configure)
                .default_service(web::to(routes::not_found))
        });
        if workers > 0 {
            server = server.workers(workers);
        }
        let server = server
            .disable_signals()
            .shutdown_timeout(10)
            .listen(listener)?
            .run();
        tracing::info!(port, "listening");
        Ok(Self {
            server,
            port,
            state,
        })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub async fn run_until_stopped(self, shutdown: CancellationToken) -> anyhow::Result<()> {
        let settings = &self.state.settings.idempotency;
        let cleanup = tokio::spawn(cleanup::run(
            self.state.pool.clone(),
            self.state.metrics.clone(),
            self.state.in_flight.clone(),
            Duration::from_secs(settings.cleanup_interval_seconds.max(1)),
            settings.cleanup_batch.max(1),
            shutdown.clone(),
        ));
        kit::http::run_until_stopped(self.server, shutdown).await?;
        cleanup.await?;
        Ok(())
    }
}
