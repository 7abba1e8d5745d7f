//! The consumer runtime: one implementation of "receive an order event, apply it
//! once, in order" shared by the inventory, ledger and loyalty consumers, which
//! supply only a [`Domain`].
//!
//! This is the foundation: settings, database (inbox and progress tables are
//! migrated from `migrations/consumer-runtime/`), the broker connection with
//! reconnect, `/healthz`, `/readyz`, `/metrics` and the domain's read routes.

use actix_web::{web, App, HttpServer};
use kit::{
    amqp::Connected,
    http::Health,
    migrations::Database,
    settings::{AmqpSettings, DatabaseSettings, HttpSettings},
    CancellationToken,
};
use serde::{Deserialize, Serialize};

/// What a consumer service is, beyond the shared runtime.
pub trait Domain: Send + Sync + 'static {
    /// Consumer name: the inbox key and the prefix of its queues (`inventory`).
    const NAME: &'static str;
    /// Binary and service name (`inventory-consumer`).
    const SERVICE: &'static str;
    /// Environment prefix of its settings (`INVENTORY_CONSUMER`).
    const ENV_PREFIX: &'static str;
    /// Its own database.
    const DATABASE: Database;
    /// Default HTTP port (8081, 8082, 8083).
    const DEFAULT_PORT: u16;

    /// Mount the domain's read endpoints.
    fn routes(cfg: &mut web::ServiceConfig);
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Settings {
    pub http: HttpSettings,
    pub database: DatabaseSettings,
    pub amqp: AmqpSettings,
}

impl Settings {
    pub fn defaults<D: Domain>() -> Self {
        Self {
            http: HttpSettings::local(D::DEFAULT_PORT),
            database: DatabaseSettings::local(D::DATABASE.name()),
            amqp: AmqpSettings::default(),
        }
    }

    /// Defaults overridden by the environment (`<ENV_PREFIX>__HTTP__PORT`, ...).
    pub fn load<D: Domain>() -> anyhow::Result<Self> {
        Ok(kit::settings::load(D::ENV_PREFIX, &Self::defaults::<D>())?)
    }
}

/// A built consumer: database migrated, HTTP listener bound.
pub struct Application {
    settings: Settings,
    server: actix_web::dev::Server,
    port: u16,
    connected: Connected,
    service: &'static str,
}

impl Application {
    /// Wait for the database, migrate it, bind the HTTP listener.
    pub async fn build<D: Domain>(
        settings: Settings,
        shutdown: &CancellationToken,
    ) -> anyhow::Result<Self> {
        let pool = kit::db::pool(&settings.database)?;
        kit::db::wait_until_ready(&pool, shutdown).await?;
        kit::migrations::run(&pool, D::DATABASE).await?;
        let connected = Connected::default();
        let health = Health {
            service: D::SERVICE,
            registry: kit::metrics::registry(D::SERVICE),
            database: Some(pool.clone()),
            broker: Some(connected.clone()),
        };
        let listener = std::net::TcpListener::bind(settings.http.addr())?;
        let port = listener.local_addr()?.port();
        let server = HttpServer::new(move || {
            App::new()
                .app_data(web::Data::new(pool.clone()))
                .configure(kit::http::health_routes(health.clone()))
                .configure(D::routes)
        })
        .workers(1)
        .disable_signals()
        .shutdown_timeout(10)
        .listen(listener)?
        .run();
        tracing::info!(port, consumer = D::NAME, "listening");
        Ok(Self {
            settings,
            server,
            port,
            connected,
            service: D::SERVICE,
        })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Serve until `shutdown`: HTTP, and the broker connection (kept up, rebuilt
    /// when it drops).
    pub async fn run_until_stopped(self, shutdown: CancellationToken) -> anyhow::Result<()> {
        let broker = {
            let shutdown = shutdown.clone();
            let settings = self.settings.amqp.clone();
            let connected = self.connected.clone();
            let service = self.service;
            tokio::spawn(async move {
                kit::amqp::supervise(&settings, service, &connected, &shutdown, |connection| {
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
}

/// The whole `main` of a consumer binary.
pub async fn main<D: Domain>() -> anyhow::Result<()> {
    let cli = <Cli as clap::Parser>::parse();
    kit::service_main(D::SERVICE, |shutdown| async move {
        let settings = Settings::load::<D>()?;
        match cli.command.unwrap_or(Command::Serve) {
            Command::Serve => {
                let app = Application::build::<D>(settings, &shutdown).await?;
                app.run_until_stopped(shutdown).await
            }
            Command::Migrate => {
                let pool = kit::db::pool(&settings.database)?;
                let applied = kit::migrations::run(&pool, D::DATABASE).await?;
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
