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
