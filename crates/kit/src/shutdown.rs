//! Graceful shutdown: the first SIGTERM or SIGINT cancels the returned token
//! (services stop taking work, finish what is in flight, then exit); a second
//! signal exits the process at once, and so does, for a service
//! (`kit::serve`), the end of [`GRACE`].

use std::time::Duration;

use tokio::signal::unix::{signal, SignalKind};
use tokio_util::sync::CancellationToken;

/// How long a graceful stop may take: shorter than the 30 s
/// `stop_grace_period` of `deploy/docker-compose.yml`, so that a stop that
/// overruns is logged and ends with status 1 before the orchestrator's
/// SIGKILL, which would leave no trace.
pub const GRACE: Duration = Duration::from_secs(25);

/// Once `shutdown` is cancelled, exit the process (status 1, an error
/// logged) if it is still running [`GRACE`] later: a stop must end even when
/// something it waits for never answers (a broker that stopped reading, a
/// lock held elsewhere, a fail point holding a batch in a test). Work cut
/// off here is work a crash cuts off: every service resumes it from its
/// durable state (a claimed batch's lease runs out, an unacknowledged
/// message is redelivered), a migration's transaction rolled back. The
/// grace is timed by a thread, not a task: once the signal's task has
/// cancelled `shutdown` and this one has started the thread, the exit comes
/// even if every runtime worker is then blocked.
pub fn exit_after_grace(shutdown: CancellationToken) {
    tokio::spawn(async move {
        shutdown.cancelled().await;
        std::thread::spawn(|| {
            std::thread::sleep(GRACE);
            tracing::error!(
                grace_secs = GRACE.as_secs(),
                "shutdown did not finish in time: exiting"
            );
            std::process::exit(1);
        });
    });
}

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

/// `work`'s output, unless `shutdown` comes first and `work` does not end
/// within `patience` after it: then `None`, and `work` is dropped. For work
/// a stop may abandon as a crash there would (a read, a claim whose
/// committed lease is taken over once it runs out): a database step
/// blocked on a lock, or on a database partitioned away, is otherwise ended
/// only by the session's 30 s bounds, past [`GRACE`].
pub async fn unless_stopped<F: std::future::Future>(
    shutdown: &CancellationToken,
    patience: Duration,
    work: F,
) -> Option<F::Output> {
    tokio::pin!(work);
    tokio::select! {
        output = &mut work => Some(output),
        () = shutdown.cancelled() => tokio::time::timeout(patience, work).await.ok(),
    }
}
