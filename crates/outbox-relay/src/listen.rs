//! Wake-up by LISTEN/NOTIFY.
//!
//! Channel `outbox_events` is notified after the commits that wrote outbox
//! rows: by order-api's wake-up session (`order_api::wake`: coalesced, at
//! most one per 5 ms), or by the
//! outbox insert's statement trigger for any other writer (orders V18),
//! delivered at its commit. A pooled connection
//! hides notifications, so this holds a dedicated tokio-postgres connection,
//! polls its `Connection` for `AsyncMessage::Notification`, and bumps a
//! watch counter that idle workers wait on. When the connection drops it
//! reconnects and re-LISTENs (and wakes the workers once, for whatever was
//! inserted while nobody listened); the poll interval stays the fallback.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use kit::CancellationToken;
use tokio::sync::{mpsc, watch};
use tokio_postgres::AsyncMessage;

pub const CHANNEL: &str = "outbox_events";

/// A liveness probe on the listening connection this often (a half-open TCP
/// connection would otherwise never report an error).
const PROBE_EVERY: Duration = Duration::from_secs(30);

/// Wake every idle worker.
pub(crate) fn wake(sender: &watch::Sender<u64>) {
    sender.send_modify(|n| *n = n.wrapping_add(1));
}

/// The `application_name` of the listening connection of `instance` (in
/// `pg_stat_activity`).
pub fn application_name(instance: &str) -> String {
    format!("outbox-relay listen {instance}")
}

/// Listen until `shutdown`, reconnecting with capped backoff.
pub async fn listen(
    url: String,
    instance: String,
    sender: Arc<watch::Sender<u64>>,
    shutdown: CancellationToken,
) {
    let mut delay = Duration::from_millis(100);
    let mut config: tokio_postgres::Config = match url.parse() {
        Ok(config) => config,
        Err(error) => {
            // Not reached: the pool parsed the same URL at start-up. Were it,
            // the relay stops (the task is `essential`).
            tracing::error!(%error, "bad database url: no LISTEN");
            return;
        }
    };
    config.application_name(application_name(&instance));
    kit::db::bound_network_waits(&mut config);
    loop {
        match listen_once(&config, &sender, &shutdown, &mut delay).await {
            Ok(()) => return,
            Err(error) => tracing::warn!(
                error = format!("{error:#}"),
                retry_in_ms = delay.as_millis() as u64,
                "LISTEN connection lost; polling until it is back"
            ),
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(delay) => {}
        }
        delay = (delay * 2).min(Duration::from_secs(5));
    }
}

async fn listen_once(
    config: &tokio_postgres::Config,
    sender: &watch::Sender<u64>,
    shutdown: &CancellationToken,
    delay: &mut Duration,
) -> anyhow::Result<()> {
    let (client, mut connection) = kit::db::connect_with(config).await?;
    let (notified, mut notifications) = mpsc::unbounded_channel::<()>();
    let driver = tokio::spawn(async move {
        let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
        while let Some(message) = messages.next().await {
            match message {
                Ok(AsyncMessage::Notification(_)) => {
                    if notified.send(()).is_err() {
                        break;
                    }
                }
                Ok(_) => {}
                Err(error) => return Err(error),
            }
        }
        Ok(())
    });
    let result = async {
        client.batch_execute(&format!("LISTEN {CHANNEL}")).await?;
        tracing::info!(channel = CHANNEL, "listening for outbox notifications");
        *delay = Duration::from_millis(100);
        wake(sender);
        let mut probe = tokio::time::interval(PROBE_EVERY);
        probe.tick().await;
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                message = notifications.recv() => match message {
                    Some(()) => {
                        // Coalesce a burst of notifications into one wake-up.
                        while notifications.try_recv().is_ok() {}
                        wake(sender);
                    }
                    None => anyhow::bail!("the LISTEN connection closed"),
                },
                _ = probe.tick() => {
                    tokio::time::timeout(Duration::from_secs(10), client.simple_query("SELECT 1"))
                        .await
                        .map_err(|_| anyhow::anyhow!("the LISTEN connection stopped answering"))??;
                }
            }
        }
    }
    .await;
    drop(client);
    driver.abort();
    result
}
