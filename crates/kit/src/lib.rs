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

/// Run `service`, the long-running command of a binary (`serve`: the
/// orchestrator's SIGTERM stops it), under the stop grace
/// ([`shutdown::GRACE`]), from its start-up on (a migration waiting for a
/// lock or running included); a signal during a start-up wait is a clean
/// stop. The one-shot commands (`migrate`, `replay`, ...) are neither: an
/// operator's signal during their start-up wait ends them with an error
/// (nothing was done), and a second signal ends them at once.
pub async fn serve(
    shutdown: &CancellationToken,
    service: impl std::future::Future<Output = anyhow::Result<()>>,
) -> anyhow::Result<()> {
    shutdown::exit_after_grace(shutdown.clone());
    match service.await {
        Err(error) if stopped_during_start_up(&error) => {
            tracing::info!(reason = %error, "stopped by a signal during start-up");
            Ok(())
        }
        result => result,
    }
}

/// Whether `error` is a start-up wait ended by the shutdown signal (for the
/// database, another instance's migration, the broker): a clean stop, not
/// a failure, so it logs no error and exits with status 0.
fn stopped_during_start_up(error: &anyhow::Error) -> bool {
    error.chain().any(|cause| {
        matches!(cause.downcast_ref(), Some(db::DbError::Cancelled))
            || matches!(
                cause.downcast_ref(),
                Some(migrations::MigrationError::Cancelled { .. })
            )
            || matches!(cause.downcast_ref(), Some(amqp::AmqpError::Cancelled))
    })
}
