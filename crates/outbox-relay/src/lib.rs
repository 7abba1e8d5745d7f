//! outbox-relay: moves committed outbox rows from the `orders` database to the
//! `order-events` exchange, at least once, in per-order order.

pub mod cli;
pub mod settings;

use actix_web::{App, HttpServer};
use kit::{amqp::Connected, http::Health, migrations::Database, CancellationToken};

pub use settings::Settings;

pub const SERVICE: &str = "outbox-relay";

/// A built relay: database reachable and migrated, health listener bound.
pub struct Application {
    settings: Settings,
    server: actix_web::dev::Server,
    port: u16,
    connected: Connected,
}

impl Application {
    pub async fn build(settings: Settings, shutdown: &CancellationToken) -> anyhow::Result<Self> {
        let pool = kit::db::pool(&settings.database)?;
        kit::db::wait_until_ready(&pool, shutdown).await?;
        // The outbox table belongs to the orders schema; migrating here too (under
        // the advisory lock) means the relay does not depend on start order.
        kit::migrations::run(&pool, Database::Orders).await?;
        let connected = Connected::default();
        let health = Health {
            service: SERVICE,
            registry: kit::metrics::registry(SERVICE),
            database: Some(pool),
            broker: Some(connected.clone()),
        };
        let listener = std::net::TcpListener::bind(settings.http.addr())?;
        let port = listener.local_addr()?.port();
        let server =
            HttpServer::new(move || App::new().configure(kit::http::health_routes(health.clone())))
                .workers(1)
                .disable_signals()
                .shutdown_timeout(10)
                .listen(listener)?
                .run();
        tracing::info!(port, "health and metrics listening");
        Ok(Self {
            settings,
            server,
            port,
            connected,
        })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub async fn run_until_stopped(self, shutdown: CancellationToken) -> anyhow::Result<()> {
        let broker = {
            let shutdown = shutdown.clone();
            let settings = self.settings.amqp.clone();
            let connected = self.connected.clone();
            tokio::spawn(async move {
                kit::amqp::supervise(&settings, SERVICE, &connected, &shutdown, |connection| {
                    let shutdown = shutdown.clone();
                    async move {
                        let channel = connection.create_channel().await?;
                        kit::amqp::declare_order_events_exchange(&channel).await?;
                        tokio::select! {
                            _ = shutdown.cancelled() => Ok(()),
                            error = kit::amqp::closed(&connection) => Err(error),
                        }
                    }
                })
                .await;
            })
        };
        kit::http::run_until_stopped(self.server, shutdown).await?;
        broker.await?;
        Ok(())
    }
}
