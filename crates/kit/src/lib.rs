//! The shared service kit: everything the five services need that is not their
//! domain. Configuration ([`settings`]), telemetry ([`telemetry`]), PostgreSQL
//! pools and migrations ([`db`], [`migrations`]), the AMQP connection
//! ([`amqp`]), the health/metrics HTTP surface and problem+json errors
//! ([`http`]), Prometheus helpers ([`metrics`]), graceful shutdown
//! ([`shutdown`]) and crash fail points ([`failpoint`]).

pub mod amqp;
pub mod db;
pub mod failpoint;
pub mod http;
pub mod metrics;
pub mod migrations;
pub mod settings;
pub mod shutdown;
pub mod telemetry;

pub use tokio_util::sync::CancellationToken;

/// The start-up every service binary shares: telemetry, fail points, signal
/// handling; then `run` with the shutdown token. Keeps each `main.rs` thin.
pub async fn service_main<F, Fut>(service: &'static str, run: F) -> anyhow::Result<()>
where
    F: FnOnce(CancellationToken) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    let _telemetry = telemetry::init(service);
    failpoint::init_from_env();
    let shutdown = shutdown::on_signals()?;
    let result = run(shutdown).await;
    if let Err(error) = &result {
        tracing::error!(error = format!("{error:#}"), "exiting with an error");
    }
    result
}
