//! Graceful shutdown: the first SIGTERM or SIGINT cancels the returned token
//! (services stop taking work, finish what is in flight, then exit); a second
//! signal exits the process at once.

use tokio::signal::unix::{signal, SignalKind};
use tokio_util::sync::CancellationToken;

/// Install the signal handlers and return the token they cancel.
/// Must be called inside a tokio runtime.
pub fn on_signals() -> std::io::Result<CancellationToken> {
    let token = CancellationToken::new();
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let cancel = token.clone();
    tokio::spawn(async move {
        let first = tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        };
        tracing::info!(
            signal = first,
            "shutting down: finishing in-flight work (signal again to exit at once)"
        );
        cancel.cancel();
        let second = tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        };
        tracing::warn!(signal = second, "second signal: exiting now");
        std::process::exit(130);
    });
    Ok(token)
}

/// Await `task`, a part of the service that runs until shutdown. If it ends
/// before (a panic: a bug), cancel `shutdown`, so the whole service stops
/// with an error and is restarted, instead of answering /readyz with that
/// part gone. Yields the task's result (its panic as an error).
pub async fn essential<T>(
    name: &'static str,
    task: tokio::task::JoinHandle<T>,
    shutdown: CancellationToken,
) -> Result<T, tokio::task::JoinError> {
    let joined = task.await;
    if !shutdown.is_cancelled() {
        tracing::error!(
            task = name,
            "a part of the service ended before shutdown: stopping the service"
        );
        shutdown.cancel();
    }
    joined
}
