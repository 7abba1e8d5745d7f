//! order-api: takes orders over HTTP and records each business mutation and its
//! event in one PostgreSQL transaction (the transactional outbox).

pub mod cli;
pub mod settings;

use actix_web::{web, App, HttpServer};
use kit::{http::Health, migrations::Database, CancellationToken};

pub use settings::Settings;

pub const SERVICE: &str = "order-api";

/// A built order-api: database migrated, listener bound.
pub struct Application {
    server: actix_web::dev::Server,
    port: u16,
}

impl Application {
    pub async fn build(settings: Settings, shutdown: &CancellationToken) -> anyhow::Result<Self> {
        let pool = kit::db::pool(&settings.database)?;
        kit::db::wait_until_ready(&pool, shutdown).await?;
        kit::migrations::run(&pool, Database::Orders).await?;
        let health = Health {
            service: SERVICE,
            registry: kit::metrics::registry(SERVICE),
            database: Some(pool.clone()),
            broker: None,
        };
        let listener = std::net::TcpListener::bind(settings.http.addr())?;
        let port = listener.local_addr()?.port();
        let server = HttpServer::new(move || {
            App::new()
                .app_data(web::Data::new(pool.clone()))
                .configure(kit::http::health_routes(health.clone()))
        })
        .disable_signals()
        .shutdown_timeout(10)
        .listen(listener)?
        .run();
        tracing::info!(port, "listening");
        Ok(Self { server, port })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub async fn run_until_stopped(self, shutdown: CancellationToken) -> anyhow::Result<()> {
        kit::http::run_until_stopped(self.server, shutdown).await?;
        Ok(())
    }
}
