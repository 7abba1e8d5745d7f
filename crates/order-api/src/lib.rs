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
pub mod wake;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use actix_web::{web, App, HttpServer};
use deadpool_postgres::Pool;
use kit::{http::Health, migrations::Database, CancellationToken};

pub use settings::Settings;

pub const SERVICE: &str = "order-api";

/// What every handler sees. Each HTTP worker has its own (see
/// [`Application::build`]); all but the pool are shared by every worker.
pub struct AppState {
    /// The worker's own pool (the process-wide one outside the workers).
    pub pool: Pool,
    pub settings: Settings,
    pub metrics: metrics::Metrics,
    pub in_flight: idempotency::InFlight,
    pub keys: Arc<auth::KeyCache>,
    /// Wakes the relay after a COMMIT that wrote an outbox row.
    pub relay_waker: wake::RelayWaker,
}

impl AppState {
    /// The same shared parts, with `pool`.
    fn with_pool(&self, pool: Pool) -> Self {
        AppState {
            pool,
            settings: self.settings.clone(),
            metrics: self.metrics.clone(),
            in_flight: self.in_flight.clone(),
            keys: Arc::clone(&self.keys),
            relay_waker: self.relay_waker.clone(),
        }
    }
}

/// The pool with the bounded lock wait on every session: a loser waits for
/// the key's owner at most `lock_timeout_ms`; nothing waits unboundedly. Its
/// outbox inserts do not NOTIFY from their transaction ([`wake`]).
pub fn pool(settings: &Settings) -> anyhow::Result<Pool> {
    let options = format!(
        "-c lock_timeout={} {} {}",
        settings.idempotency.lock_timeout_ms,
        kit::db::SESSION_LIMITS,
        wake::SESSION_OPTION
    );
    Ok(kit::db::pool_with_options(
        &settings.database,
        Some(&options),
    )?)
}

/// Connections of the process-wide pool (migrations, health, key cleanup).
const SHARED_POOL_SIZE: usize = 2;

/// [`pool`] with `size` connections at most.
fn pool_of_size(settings: &Settings, size: usize) -> anyhow::Result<Pool> {
    let mut settings = settings.clone();
    settings.database.pool_size = size;
    pool(&settings)
}

/// The pool size of each HTTP worker: `pool_size` split over `workers`, in
/// shares that add up to it exactly (16 over 3: 6, 5, 5), so the workers
/// never hold more than `database.pool_size` connections. Each worker needs
/// one of its own: never more workers than `pool_size` (the length of the
/// result is the number of workers to run).
fn worker_shares(pool_size: usize, workers: usize) -> Vec<usize> {
    let pool_size = pool_size.max(1);
    let workers = workers.clamp(1, pool_size);
    (0..workers)
        .map(|i| pool_size / workers + usize::from(i < pool_size % workers))
        .collect()
}

/// A built order-api: database migrated, listener bound.
pub struct Application {
    server: actix_web::dev::Server,
    port: u16,
    state: web::Data<AppState>,
}

impl Application {
    pub async fn build(settings: Settings, shutdown: &CancellationToken) -> anyhow::Result<Self> {
        for warning in settings.warnings() {
            tracing::warn!("{warning}");
        }
        // Migrations, health and the key cleanup: a small pool of their own,
        // so the process holds at most `database.pool_size` (the workers')
        // plus these connections.
        let shared_pool = pool_of_size(&settings, SHARED_POOL_SIZE)?;
        let drain_seconds = settings.drain_seconds();
        kit::db::wait_until_ready(&shared_pool, shutdown).await?;
        kit::migrations::run_until(&shared_pool, Database::Orders, shutdown).await?;
        let metrics = metrics::Metrics::new(SERVICE);
        let health = Health::new(
            SERVICE,
            metrics.registry.clone(),
            Some(shared_pool.clone()),
            None,
        );
        kit::http::watch_readiness(
            health.clone(),
            std::time::Duration::from_secs(5),
            shutdown.clone(),
        );
        let listener = std::net::TcpListener::bind(settings.http.addr())?;
        let port = listener.local_addr()?.port();
        let configured = match settings.http.workers {
            0 => std::thread::available_parallelism().map_or(1, usize::from),
            n => n,
        };
        let shares = worker_shares(settings.database.pool_size, configured);
        let workers = shares.len();
        if workers < configured {
            tracing::warn!(
                configured,
                workers,
                pool_size = settings.database.pool_size,
                "fewer HTTP workers than configured (or cores): each needs a connection of \
                 its own within database.pool_size"
            );
        }
        // One pool per HTTP worker, its share of `database.pool_size`. A
        // tokio-postgres connection is driven by a task on the runtime that
        // opened it, and each actix worker is a runtime (a thread) of its
        // own: with one pool shared by every worker, a statement could go
        // through another thread and back. Opened lazily, a worker's
        // connections are opened (and driven) by that worker alone. Three
        // alternating `bench api` pairs: order-api CPU per order 361-470 ->
        // 293-390 µs (0.30-0.31 -> 0.27-0.28 of PostgreSQL's).
        let worker_pools = shares
            .into_iter()
            .map(|share| pool_of_size(&settings, share))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let worker_pools = Arc::new(Mutex::new(worker_pools));
        let state = web::Data::new(AppState {
            pool: shared_pool,
            settings,
            metrics,
            in_flight: idempotency::InFlight::default(),
            keys: Arc::default(),
            relay_waker: wake::RelayWaker::default(),
        });
        let app_state = state.clone();
        let server = HttpServer::new(move || {
            // Called once per worker, on its thread; a worker that actix
            // restarts finds none left and uses the process-wide pool.
            let pool = worker_pools
                .lock()
                .ok()
                .and_then(|mut pools| pools.pop())
                .unwrap_or_else(|| app_state.pool.clone());
            App::new()
                .app_data(web::Data::new(app_state.with_pool(pool)))
                .configure(kit::http::health_routes(health.clone()))
                .configure(routes::configure)
                .default_service(web::to(kit::http::not_found))
        })
        .workers(workers);
        let server = server
            .disable_signals()
            .shutdown_timeout(drain_seconds)
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
        // Ends only on shutdown, unless it panicked (a bug): then the
        // service stops, instead of serving on with expired keys piling up
        // and the stuck-owner gauge frozen.
        let cleanup = tokio::spawn(kit::shutdown::essential(
            "key cleanup",
            tokio::spawn(cleanup::run(
                self.state.pool.clone(),
                self.state.metrics.clone(),
                self.state.in_flight.clone(),
                Duration::from_secs(settings.cleanup_interval_seconds.max(1)),
                settings.cleanup_batch.max(1),
                shutdown.clone(),
            )),
            shutdown.clone(),
        ));
        // Stopped once the server has drained (the requests it finished
        // have their wake-ups sent), not at the signal.
        let drained = CancellationToken::new();
        let waker = tokio::spawn(kit::shutdown::essential(
            "relay wake-up",
            tokio::spawn(wake::run(
                self.state.settings.database.url.clone(),
                self.state.relay_waker.clone(),
                drained.clone(),
            )),
            shutdown.clone(),
        ));
        let served = kit::http::run_until_stopped(self.server, shutdown).await;
        drained.cancel();
        served?;
        cleanup.await??;
        waker.await??;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::worker_shares;

    #[test]
    fn worker_pools_add_up_to_the_pool_size() {
        assert_eq!(worker_shares(16, 3), vec![6, 5, 5]);
        assert_eq!(worker_shares(16, 2), vec![8, 8]);
        assert_eq!(worker_shares(16, 1), vec![16]);
        // More workers (cores) than connections: one connection each.
        assert_eq!(worker_shares(16, 32), vec![1; 16]);
        assert_eq!(worker_shares(3, 0), vec![3]);
        for pool in 1..40 {
            for workers in 1..40 {
                let shares = worker_shares(pool, workers);
                assert_eq!(shares.iter().sum::<usize>(), pool, "{pool} over {workers}");
                assert!(shares.iter().all(|&n| n >= 1));
                assert_eq!(shares.len(), workers.min(pool));
            }
        }
    }
}
