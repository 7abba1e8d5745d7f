//! Waking the relay after an outbox row commits (DESIGN section 6: LISTEN /
//! NOTIFY, with the relay's poll as the fallback).
//!
//! Not from the inserting transaction: a NOTIFY makes its transaction take,
//! at commit, PostgreSQL's notification-queue lock, one for the whole
//! cluster, and hold it through its WAL flush, so every order-api
//! transaction committed alone, one flush each (orders V18). The request
//! sessions turn the outbox trigger's NOTIFY off ([`SESSION_OPTION`]); after
//! a COMMIT that wrote an outbox row (or may have: its outcome unknown), the
//! request calls [`RelayWaker::wake`],
//! and one task of the process sends `pg_notify` on a session of its own
//! (its COMMIT not waiting for the WAL flush: nothing to make durable).
//! Wakes that arrive while one is being sent, or within 5 ms of its start,
//! are coalesced into the next: under load at most 200 NOTIFYs a second,
//! whatever the order rate; after a pause, one at once. (A relay that is
//! busy claims the rows committed meanwhile without one; an idle one waits
//! at most 5 ms more. At 1 ms the wake-ups cost `make bench-api` about 5 %
//! of its orders a second on two cores; at 5 ms, nothing measurable.)
//!
//! Crash window: a process that dies between its COMMIT and the NOTIFY
//! loses the wake-up, not the event: the relay's poll (1 s by default)
//! claims the row (fail point `order_api.after_commit`, which lies before
//! the wake; test `order_api_crash_after_commit_before_response`: every
//! event of the crashed traffic delivered). A NOTIFY that fails (the database restarting) is retried
//! with a backoff until sent or the process stops.

use std::sync::Arc;
use std::time::Duration;

use kit::CancellationToken;
use tokio::sync::Notify;

/// The setting that, `off` in a session, turns the outbox trigger's NOTIFY
/// off for that session's inserts (orders V18).
pub const SETTING: &str = "outbox.notify_on_insert";

/// The request sessions' option: [`SETTING`] off (this module sends the
/// NOTIFY after the COMMIT instead).
pub const SESSION_OPTION: &str = "-c outbox.notify_on_insert=off";

/// The `application_name` of the session that sends the wake-ups (`<the
/// database URL's application_name> wake-up` when the URL names one).
pub const APPLICATION_NAME: &str = "order-api wake-up";

const WAKE: &str = "SELECT pg_notify('outbox_events', '')";

/// The longest one wake-up (and the opening of its session) may take.
const WAKE_LIMIT: Duration = Duration::from_secs(2);

/// The least time between two wake-ups' starts (see the module's doc).
const SPACING: Duration = Duration::from_millis(5);

/// Tell the relay that outbox rows were committed. Cheap and never blocks:
/// wakes given while one is pending are one.
#[derive(Clone, Default)]
pub struct RelayWaker {
    pending: Arc<Notify>,
}

impl RelayWaker {
    pub fn wake(&self) {
        self.pending.notify_one();
    }
}

/// Send the wake-ups [`RelayWaker::wake`] asks for, until `stop`; then one
/// last, for the rows committed since the last one (each bounded by
/// [`WAKE_LIMIT`]).
pub async fn run(database_url: String, waker: RelayWaker, stop: CancellationToken) {
    let mut session = Session::new(database_url);
    loop {
        tokio::select! {
            () = waker.pending.notified() => {}
            () = stop.cancelled() => break,
        }
        // The wakes given meanwhile are this one (a relay woken claims
        // every due row): at most one NOTIFY per SPACING under load, one at
        // once after a pause.
        let sent = tokio::time::Instant::now() + SPACING;
        let mut backoff = Duration::from_millis(100);
        // Each try bounded: a database that stopped answering must not hold
        // the task (and a stop after the drain) for the session's 30 s.
        while let Err(error) = session.wake_within(WAKE_LIMIT).await {
            tracing::warn!(
                error,
                retry_in_ms = backoff.as_millis(),
                "waking the relay failed (its poll claims the events meanwhile)"
            );
            tokio::select! {
                () = tokio::time::sleep(backoff) => {}
                () = stop.cancelled() => return,
            }
            backoff = (backoff * 2).min(Duration::from_secs(5));
        }
        tokio::time::sleep_until(sent).await;
    }
    let _ = session.wake_within(WAKE_LIMIT).await;
}

/// The wake-up session, opened when first needed and again after a failure.
struct Session {
    url: String,
    client: Option<tokio_postgres::Client>,
}

impl Session {
    fn new(url: String) -> Self {
        Self { url, client: None }
    }

    /// [`Session::wake`] within `limit` (the session closed past it).
    async fn wake_within(&mut self, limit: Duration) -> Result<(), String> {
        match tokio::time::timeout(limit, self.wake()).await {
            Ok(result) => result,
            Err(_) => {
                // Its statement cancelled on the server (else the session
                // would run on there, to its statement_timeout, beside the
                // next try's), the session closed.
                if let Some(client) = self.client.take() {
                    let cancel = client.cancel_token();
                    tokio::spawn(async move {
                        let _ = tokio::time::timeout(
                            WAKE_LIMIT,
                            cancel.cancel_query(tokio_postgres::NoTls),
                        )
                        .await;
                    });
                }
                Err(format!("no answer within {} ms", limit.as_millis()))
            }
        }
    }

    async fn wake(&mut self) -> Result<(), String> {
        let result = async {
            if self.client.is_none() {
                let mut config: tokio_postgres::Config = self.url.parse()?;
                let name = config.get_application_name().map_or_else(
                    || APPLICATION_NAME.to_owned(),
                    |name| format!("{name} wake-up"),
                );
                config.application_name(&name);
                kit::db::bound_session(&mut config);
                // A wake-up has nothing to make durable: its COMMIT need
                // not wait for the WAL flush (the notification is delivered
                // at commit either way).
                let options = format!(
                    "{} -c synchronous_commit=off",
                    config.get_options().unwrap_or_default()
                );
                config.options(options.trim_start());
                kit::db::bound_network_waits(&mut config);
                let (client, connection) = kit::db::connect_with(&config).await?;
                tokio::spawn(connection);
                self.client = Some(client);
            }
            if let Some(client) = &self.client {
                client.batch_execute(WAKE).await?;
            }
            Ok::<_, anyhow::Error>(())
        }
        .await;
        result.map_err(|error| {
            self.client = None;
            let root: &(dyn std::error::Error + 'static) = error.as_ref();
            kit::db::describe(root)
        })
    }
}
