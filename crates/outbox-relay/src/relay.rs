//! The relay loop: claim a batch, publish it with confirms, mark it.
//!
//! Each worker owns one confirm-mode channel and runs
//! claim -> publish (all in flight) -> confirms -> one mark statement, then
//! claims again at once; when nothing is claimable it sleeps until a NOTIFY
//! (see [`crate::listen`]), the earliest backoff expiry or the poll interval,
//! whichever comes first. Rows are only claimed while the channel is open,
//! and a batch once claimed is always published, confirmed and settled, also
//! on shutdown (a claim still running 2 s into the process's shutdown is
//! given up: see `CLAIM_STOP_WAIT`).

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use kit::{db::PgPool, CancellationToken};
use lapin::{options::ConfirmSelectOptions, Channel, Connection};
use rand::Rng;
use tokio::sync::watch;
use uuid::Uuid;

use crate::claim::{self, Failure, OutboxRow};
use crate::metrics::Metrics;
use crate::publish::{self, PublishFailure};
use crate::settings::{backoff_ms, RelaySettings};

/// How long a stop waits for a claim in flight: one that commits in time
/// has its batch published and settled before the worker leaves, instead
/// of left under its lease for another relay to take over once it runs out.
const CLAIM_STOP_WAIT: Duration = Duration::from_secs(2);

/// The `outbox_publish_failures_total` reason of a row whose lease ran out
/// while its relay held it alone (the claim counts it: [`claim::CLAIM_SQL`]).
pub const LEASE_EXPIRED: &str = "lease_expired";

/// Everything a worker needs; cheap to clone.
#[derive(Clone)]
pub struct Relay {
    pub pool: PgPool,
    pub settings: RelaySettings,
    pub instance: String,
    pub metrics: Metrics,
    pub wake: watch::Receiver<u64>,
    /// The claim's floor, kept fresh by [`crate::floor::refresh_periodically`].
    pub floor: watch::Receiver<claim::Floor>,
    /// The leases whose batches the workers of this process are settling
    /// (marking, recording failures): the others' claims leave their rows
    /// alone even once the lease ran out (`$9` of [`claim::CLAIM_SQL`]), so
    /// that a write retried past the lease while the database is
    /// unreachable ([`retry_until`]) lands when it answers, instead of a
    /// takeover publishing the rows again and counting an expiry.
    pub settling: Arc<claim::SettlingLeases>,
    /// The process's shutdown. A worker's own stop is also cancelled when
    /// another worker fails (the connection is rebuilt and the process goes
    /// on): only this one gives up a claim in flight, or the writes that
    /// settle a batch past its lease while the database is unreachable.
    pub exiting: CancellationToken,
}

/// Why a worker left its channel.
enum ChannelEnd {
    Shutdown,
    /// The channel is unusable (a timed-out or failed publish); open another.
    Reopen,
}

impl Relay {
    /// Run `workers` workers on `connection` until shutdown (`Ok`) or the
    /// connection fails (`Err`: the supervisor reconnects). When one worker
    /// fails, the others stop as at a shutdown: after settling the batch
    /// they hold (publish, confirms, mark), never dropped half way, which
    /// would leave confirmed rows unmarked until their leases expire.
    pub async fn run_on(
        &self,
        connection: &Connection,
        shutdown: &CancellationToken,
    ) -> Result<(), lapin::Error> {
        let stop = shutdown.child_token();
        let workers = (0..self.settings.workers.max(1)).map(|worker| {
            let relay = self.clone();
            let stop = &stop;
            async move {
                let result = relay.worker(worker, connection, stop).await;
                if result.is_err() {
                    stop.cancel();
                }
                result
            }
        });
        futures_util::future::join_all(workers)
            .await
            .into_iter()
            .collect::<Result<Vec<()>, _>>()?;
        Ok(())
    }

    async fn worker(
        mut self,
        worker: usize,
        connection: &Connection,
        shutdown: &CancellationToken,
    ) -> Result<(), lapin::Error> {
        let mut broker_pause = Duration::from_millis(500);
        loop {
            if shutdown.is_cancelled() {
                // Stopped while replacing its channel: no new one.
                return Ok(());
            }
            // A blocked connection (a broker memory or disk alarm) answers
            // none of these until the alarm clears; holding no rows, the
            // worker leaves on shutdown without waiting for them, but not
            // without closing what it opened (bounded).
            let Some(channel) = kit::amqp::open_channel(connection, shutdown).await? else {
                return Ok(());
            };
            let setup = async {
                tracing::debug!(worker, "publishing channel open: setting it up");
                kit::failpoint::hold_task("relay.opening_channel").await;
                channel
                    .confirm_select(ConfirmSelectOptions::default())
                    .await?;
                kit::amqp::declare_topic_exchange(&channel, &self.settings.exchange).await
            };
            tokio::select! {
                _ = shutdown.cancelled() => {
                    kit::amqp::close_bounded(&channel, "shutting down").await;
                    return Ok(());
                }
                ready = setup => ready?,
            }
            tracing::info!(worker, instance = %self.instance, "relay worker ready");
            match self
                .work_channel(worker, &channel, connection, shutdown, &mut broker_pause)
                .await?
            {
                ChannelEnd::Shutdown => {
                    kit::amqp::close_bounded(&channel, "shutting down").await;
                    return Ok(());
                }
                ChannelEnd::Reopen => {
                    tracing::warn!(worker, "replacing the publishing channel");
                    kit::amqp::close_bounded(&channel, "replacing channel").await;
                }
            }
        }
    }

    async fn work_channel(
        &mut self,
        worker: usize,
        channel: &Channel,
        connection: &Connection,
        shutdown: &CancellationToken,
        broker_pause: &mut Duration,
    ) -> Result<ChannelEnd, lapin::Error> {
        let mut db_delay = Duration::from_millis(100);
        loop {
            if shutdown.is_cancelled() {
                return Ok(ChannelEnd::Shutdown);
            }
            if !connection.status().connected() {
                return Err(kit::amqp::closed(connection).await);
            }
            if !channel.status().connected() {
                return Ok(ChannelEnd::Reopen);
            }
            // Anything notified from here on wakes the next idle wait.
            self.wake.borrow_and_update();
            // The lease runs from the claim's transaction start (`now()` in
            // the claim statement), so the time the claim itself takes (a
            // slow commit) is already spent: the deadline starts here.
            let lease_deadline = tokio::time::Instant::now() + self.settings.lease();
            let floor = crate::floor::current(&self.floor);
            // Suspects (rows whose leases ran out twice) go to the first
            // worker only, one at a time: at most one in flight per process.
            // A claim blocked when the process stops (a lock on the table,
            // the database partitioned away) would hold the stop up to the
            // session's 30 s bounds, past the grace: it is given up after
            // `CLAIM_STOP_WAIT`, as a crash there would give it up (a lease
            // it committed runs out and is taken over). At a stop of the
            // workers alone (another one failed), it is waited for, and its
            // batch settled.
            let claiming = claim::claim(
                &self.pool,
                &self.instance,
                &self.settings,
                floor,
                worker == 0,
                &self.settling,
            );
            let Some(claimed) =
                kit::shutdown::unless_stopped(&self.exiting, CLAIM_STOP_WAIT, claiming).await
            else {
                return Ok(ChannelEnd::Shutdown);
            };
            let claimed = match claimed {
                Ok(claimed) => {
                    db_delay = Duration::from_millis(100);
                    claimed
                }
                Err(error) => {
                    tracing::warn!(error = format!("{error:#}"), "claim failed");
                    tokio::select! {
                        _ = shutdown.cancelled() => return Ok(ChannelEnd::Shutdown),
                        _ = tokio::time::sleep(db_delay) => {}
                    }
                    db_delay = (db_delay * 2).min(Duration::from_secs(5));
                    continue;
                }
            };
            self.metrics.claims.inc();
            self.metrics.expired_claims.inc_by(claimed.taken_over);
            // A relay died or stalled holding the row alone: a failed
            // attempt of the row's own that its relay could not count.
            self.metrics.attempts.inc_by(claimed.counted);
            self.metrics
                .failures
                .with_label_values(&[LEASE_EXPIRED])
                .inc_by(claimed.counted);
            self.log_quarantined(&claimed.quarantined);
            let Some(lease_until) = claimed.lease_until else {
                if claimed.quarantined.is_empty() {
                    self.idle(connection, shutdown).await?;
                }
                continue;
            };
            self.metrics
                .claimed
                .inc_by((claimed.rows.len() + claimed.undecodable.len()) as u64);
            kit::failpoint::crash_point("relay.before_publish");
            // A test holds the claimed batch here, the other workers running.
            kit::failpoint::hold_task("relay.holding_batch").await;
            if self
                .publish_and_settle(
                    channel,
                    connection.configuration().frame_max(),
                    claimed.rows,
                    claimed.undecodable,
                    (lease_until, lease_deadline),
                )
                .await
            {
                // A timeout or channel failure: the broker is in trouble (an
                // alarm, a restart). Pause before the next claim, growing
                // while it lasts, instead of cycling the rows through it.
                tracing::warn!(
                    pause_ms = broker_pause.as_millis() as u64,
                    "pausing after a broker failure"
                );
                tokio::select! {
                    // The batch is settled: nothing holds the exit (reopening
                    // first would wait on the broker in trouble).
                    _ = shutdown.cancelled() => return Ok(ChannelEnd::Shutdown),
                    _ = tokio::time::sleep(*broker_pause) => {}
                }
                *broker_pause = (*broker_pause * 2).min(Duration::from_secs(30));
                return Ok(ChannelEnd::Reopen);
            }
            *broker_pause = Duration::from_millis(500);
        }
    }

    /// Sleep until a NOTIFY, the earliest backoff expiry, the poll interval
    /// or shutdown. `Err` when the broker connection is lost meanwhile.
    async fn idle(
        &mut self,
        connection: &Connection,
        shutdown: &CancellationToken,
    ) -> Result<(), lapin::Error> {
        let mut sleep = self.settings.poll_interval();
        let due = claim::next_due_in(&self.pool, &self.settings.only_tenant);
        match kit::shutdown::unless_stopped(shutdown, Duration::ZERO, due).await {
            None => return Ok(()),
            Some(Ok(Some(due))) => sleep = sleep.min(due + Duration::from_millis(1)),
            Some(Ok(None)) => {}
            Some(Err(error)) => tracing::debug!(error = format!("{error:#}"), "next due time"),
        }
        tokio::select! {
            _ = shutdown.cancelled() => Ok(()),
            _ = self.wake.changed() => Ok(()),
            _ = tokio::time::sleep(sleep) => Ok(()),
            error = kit::amqp::closed(connection) => Err(error),
        }
    }

    /// Publish a claimed batch and record the outcome, retrying the writes
    /// until `lease_deadline`, and past it while the database is unreachable
    /// ([`retry_until`]; only the process's stop, `exiting`, ends that).
    /// `lease_until` is the lease as the claim wrote it (it names the claim).
    /// Returns whether the channel should be replaced.
    async fn publish_and_settle(
        &self,
        channel: &Channel,
        frame_max: u32,
        rows: Vec<OutboxRow>,
        undecodable: Vec<(Uuid, i32, String)>,
        (lease_until, lease_deadline): (time::OffsetDateTime, tokio::time::Instant),
    ) -> bool {
        let attempts: HashMap<Uuid, i32> = rows
            .iter()
            .map(|r| (r.event_id, r.attempt_count))
            .chain(undecodable.iter().map(|(id, attempts, _)| (*id, *attempts)))
            .collect();
        let mut messages = Vec::with_capacity(rows.len());
        let claimed = rows.len() + undecodable.len();
        let mut failed: Vec<(Uuid, PublishFailure)> = undecodable
            .into_iter()
            .map(|(id, _, why)| (id, PublishFailure::Encode(why)))
            .collect();
        for row in &rows {
            // A row the relay dies on (modelled: a payload that exhausts its
            // memory, a bug it triggers): the batch is leased, nothing of it
            // published yet (see the claim's takeover rule).
            kit::failpoint::crash_point_for("relay.preparing_row", &row.aggregate_id);
            let prepared = publish::prepare(row, false).and_then(|prepared| {
                publish::check_limits(&prepared.0, self.settings.max_message_bytes, frame_max)
                    .map(|()| prepared)
            });
            match prepared {
                Ok(prepared) => messages.push(prepared),
                Err(why) => failed.push((row.event_id, PublishFailure::Encode(why))),
            }
        }
        let outcomes = publish::publish_batch(
            channel,
            &self.settings.exchange,
            messages,
            confirm_wait(
                self.settings.confirm_timeout(),
                lease_deadline.saturating_duration_since(tokio::time::Instant::now()),
            ),
        )
        .await;
        self.metrics.attempts.inc_by(claimed as u64);
        let mut acked = Vec::with_capacity(outcomes.len());
        for outcome in outcomes {
            match outcome.result {
                Ok(latency) => {
                    self.metrics.confirm_latency.observe(latency.as_secs_f64());
                    acked.push(outcome.event_id);
                }
                Err(failure) => failed.push((outcome.event_id, failure)),
            }
        }
        let reopen = failed.iter().any(|(_, f)| f.breaks_channel());
        // From here until the batch's outcome is written, this process's
        // other workers leave its rows alone, the lease run out or not.
        let _settling = Settling::new(&self.settling, lease_until);

        if !acked.is_empty() {
            // Crash window: before the mark commits, the confirmed rows stay
            // leased and unmarked; after the lease a claim takes them over
            // and publishes them again (duplicates the consumers drop; test
            // `a_crash_after_ack_before_mark_republishes_and_loses_nothing`).
            // After it, they are published under this lease: only this
            // process's metrics are lost, nothing is sent again
            // (`a_crash_after_the_mark_publishes_nothing_again`).
            kit::failpoint::crash_point("relay.after_ack_before_mark");
            let pool = &self.pool;
            let instance = self.instance.as_str();
            let acked_ref = &acked;
            let mut attempts = 0;
            match retry_until("mark published", lease_deadline, &self.exiting, || {
                attempts += 1;
                claim::mark_published(pool, instance, lease_until, acked_ref, attempts > 1)
            })
            .await
            {
                Some(marked) => {
                    kit::failpoint::crash_point("relay.after_mark");
                    self.metrics.published.inc_by(marked);
                    let lost = (acked.len() as u64).saturating_sub(marked);
                    if lost > 0 {
                        self.metrics.mark_lost.inc_by(lost);
                        tracing::warn!(
                            lost,
                            "confirmed rows no longer under this claim's lease: the claim that took them over publishes them again"
                        );
                    }
                }
                None => {
                    self.metrics.mark_lost.inc_by(acked.len() as u64);
                    tracing::error!(
                        rows = acked.len(),
                        "could not mark confirmed rows (their lease ran out, and the write failed with an error of its own or the relay is shutting down): they will be published again"
                    );
                }
            }
        }

        if !failed.is_empty() {
            let failures: Vec<Failure> = {
                let mut rng = rand::rng();
                failed
                    .iter()
                    .map(|(event_id, failure)| {
                        self.metrics
                            .failures
                            .with_label_values(&[failure.reason()])
                            .inc();
                        if matches!(failure, PublishFailure::Returned(_)) {
                            self.metrics.returned.inc();
                        }
                        let attempt = attempts.get(event_id).copied().unwrap_or(0) + 1;
                        let delay = backoff_ms(
                            self.settings.backoff_base_ms,
                            self.settings.backoff_cap_ms,
                            attempt,
                            |half| rng.random_range(0..=half),
                        );
                        tracing::warn!(
                            %event_id,
                            attempt,
                            reason = failure.reason(),
                            error = failure.describe(),
                            retry_in_ms = delay,
                            "publish failed"
                        );
                        Failure {
                            event_id: *event_id,
                            error: failure.describe(),
                            delay_ms: i64::try_from(delay).unwrap_or(i64::MAX),
                            quarantinable: failure.counts_towards_quarantine(),
                        }
                    })
                    .collect()
            };
            let pool = &self.pool;
            let instance = self.instance.as_str();
            let failures_ref = &failures;
            let max_attempts = self.settings.max_attempts;
            // Crash window: the rows stay leased with the attempt unrecorded
            // (no backoff, no count, no last_error); after the lease another
            // instance takes them over and tries again. After the write the
            // failure is recorded and the lease released: nothing is pending
            // (`a_crash_right_after_a_failure_is_recorded_counts_it_once`).
            kit::failpoint::crash_point("relay.before_mark_failed");
            let mut attempts = 0;
            if let Some(quarantined) =
                retry_until("record failures", lease_deadline, &self.exiting, || {
                    attempts += 1;
                    claim::mark_failed(
                        pool,
                        instance,
                        lease_until,
                        failures_ref,
                        max_attempts,
                        attempts > 1,
                    )
                })
                .await
            {
                kit::failpoint::crash_point("relay.after_mark_failed");
                let quarantined: Vec<(Uuid, String)> = quarantined
                    .into_iter()
                    .map(|id| (id, "its own publishing failures, logged above".to_owned()))
                    .collect();
                self.log_quarantined(&quarantined);
            }
        }
        reopen
    }

    /// Log and count rows just quarantined (by the failure write, or by a
    /// claim taking over a row whose relays died on it alone `max_attempts`
    /// times).
    fn log_quarantined(&self, quarantined: &[(Uuid, String)]) {
        for (event_id, reason) in quarantined {
            tracing::error!(
                %event_id,
                max_attempts = self.settings.max_attempts,
                reason,
                "event quarantined: it and the later events of its order are held until `outbox-relay requeue`"
            );
        }
        self.metrics
            .quarantined_total
            .inc_by(quarantined.len() as u64);
        self.metrics
            .quarantined
            .add(i64::try_from(quarantined.len()).unwrap_or(0));
    }
}

/// How long a batch's confirms are awaited: `confirm_timeout`, but no
/// longer than the lease leaves (`lease_left`), less [`MARK_MARGIN`] for
/// the mark. A claim that took long (waiting on a lock) leaves less than the
/// whole lease; waiting past it, another instance could take the rows over
/// and publish them again, and count an expiry against each of them (two,
/// and healthy rows become suspects). Timed out instead, the batch is
/// written back as a failure of the broker's (retried, never counted
/// towards quarantine) while the lease still holds.
pub(crate) fn confirm_wait(confirm_timeout: Duration, lease_left: Duration) -> Duration {
    confirm_timeout.min(lease_left.saturating_sub(MARK_MARGIN))
}

/// The part of a lease kept for writing a batch's outcome.
pub(crate) const MARK_MARGIN: Duration = Duration::from_secs(2);

/// Retry a database write with capped backoff until it succeeds or
/// `deadline` passes (after which the lease may be someone else's). Past the
/// deadline a database that is unreachable ([`kit::db::unavailable`]) is
/// still retried, until shutdown (a live server reporting a lock or
/// statement timeout, say a session holding a row of the batch, is not: the
/// rows are left to a takeover, as before): both writes are guarded by the lease
/// (`claimed_by` and `claim_until`), so on rows another claim took over
/// they match nothing, and on rows nobody took over (the database was
/// unreachable to every relay, or the others did not get there first) they
/// land. Giving up there would leave confirmed rows to be published again,
/// and count a lease expiry against rows whose relay was alive (two in a row
/// make a suspect of a row).
async fn retry_until<T, F, Fut>(
    what: &str,
    deadline: tokio::time::Instant,
    shutdown: &CancellationToken,
    mut f: F,
) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = anyhow::Result<T>>,
{
    let mut delay = Duration::from_millis(50);
    let mut held = false;
    // Retries past the deadline until the next log line.
    let mut until_log: u32 = 0;
    loop {
        match f().await {
            Ok(value) => return Some(value),
            Err(error) => {
                let now = tokio::time::Instant::now();
                if now + delay >= deadline
                    && (shutdown.is_cancelled() || !kit::db::unavailable(error.as_ref()))
                {
                    tracing::error!(error = format!("{error:#}"), what, "giving up");
                    return None;
                }
                if now < deadline {
                    tracing::warn!(
                        error = format!("{error:#}"),
                        what,
                        retry_in_ms = delay.as_millis() as u64,
                        "retrying"
                    );
                } else {
                    // Once, then about every 30 s (15 retries 2 s apart).
                    if until_log == 0 {
                        until_log = 15;
                        tracing::error!(
                            error = format!("{error:#}"),
                            what,
                            "the lease ran out while the database was unreachable: \
                             retrying until it answers (rows another instance took \
                             over are left to it)"
                        );
                        if !held {
                            held = true;
                            // A test holds the first retry past the lease
                            // here: the database back, the other workers
                            // claiming meanwhile.
                            kit::failpoint::hold_task("relay.retrying_past_lease").await;
                        }
                    }
                    until_log -= 1;
                }
                tokio::select! {
                    // Past the deadline only: before it, shutdown waits for
                    // the batch to be settled, as it always did, within the
                    // process's stop grace (`kit::shutdown::GRACE`, 25 s,
                    // shorter than the default 30 s lease: a stop during a
                    // database outage may end first, leaving the batch to a
                    // takeover, as a crash there would).
                    _ = shutdown.cancelled(), if now >= deadline => {}
                    _ = tokio::time::sleep(delay) => {}
                }
                delay = (delay * 2).min(Duration::from_secs(2));
            }
        }
    }
}

/// A lease registered in [`Relay::settling`] while its batch is settled.
struct Settling<'a> {
    leases: &'a claim::SettlingLeases,
    lease: time::OffsetDateTime,
}

impl<'a> Settling<'a> {
    fn new(leases: &'a claim::SettlingLeases, lease: time::OffsetDateTime) -> Self {
        if let Ok(mut held) = leases.lock() {
            held.push(lease);
        }
        Self { leases, lease }
    }
}

impl Drop for Settling<'_> {
    fn drop(&mut self) {
        if let Ok(mut held) = self.leases.lock() {
            if let Some(at) = held.iter().position(|lease| *lease == self.lease) {
                held.swap_remove(at);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn confirms_are_awaited_no_longer_than_the_lease_leaves() {
        let s = Duration::from_secs;
        // A claim that took no time: the whole confirm timeout.
        assert_eq!(confirm_wait(s(10), s(30)), s(10));
        // One that waited 21 s on a lock: 9 s left, 2 s kept for the mark.
        assert_eq!(confirm_wait(s(10), s(9)), s(7));
        assert_eq!(confirm_wait(s(10), s(1)), Duration::ZERO);
    }

    fn unreachable() -> anyhow::Error {
        anyhow::Error::new(kit::db::PoolError::Timeout(kit::db::TimeoutType::Wait))
    }

    fn an_error_of_the_client() -> anyhow::Error {
        let error = "postgres://app@localhost:notaport/orders"
            .parse::<tokio_postgres::Config>()
            .expect_err("a bad port");
        anyhow::Error::new(error)
    }

    /// Calls `retry_until` with a write failing with `error()` `failures`
    /// times, then succeeding; the number of calls made and the result.
    async fn run(
        deadline_in: Duration,
        failures: u32,
        error: fn() -> anyhow::Error,
        shutdown: &CancellationToken,
    ) -> (u32, Option<u32>) {
        let deadline = tokio::time::Instant::now() + deadline_in;
        let mut calls = 0;
        let result = retry_until("test write", deadline, shutdown, || {
            calls += 1;
            let outcome = if calls > failures {
                Ok(calls)
            } else {
                Err(error())
            };
            async move { outcome }
        })
        .await;
        (calls, result)
    }

    #[tokio::test(start_paused = true)]
    async fn past_the_deadline_only_an_unreachable_database_is_retried() {
        let shutdown = CancellationToken::new();
        // 40 failures take over a minute at 2 s apart: far past a 1 s lease.
        let started = tokio::time::Instant::now();
        assert_eq!(
            run(Duration::from_secs(1), 40, unreachable, &shutdown).await,
            (41, Some(41))
        );
        assert!(started.elapsed() > Duration::from_secs(60));
        // An error of the write's own: retried until the deadline, no further.
        let started = tokio::time::Instant::now();
        let (calls, result) = run(
            Duration::from_secs(1),
            40,
            an_error_of_the_client,
            &shutdown,
        )
        .await;
        assert_eq!(result, None);
        assert!(calls < 10, "{calls} calls");
        assert!(started.elapsed() <= Duration::from_secs(1));
        // Before the deadline, an error of its own is retried too.
        assert_eq!(
            run(
                Duration::from_secs(30),
                3,
                an_error_of_the_client,
                &shutdown
            )
            .await,
            (4, Some(4))
        );
    }

    #[tokio::test(start_paused = true)]
    async fn shutdown_ends_the_retries_past_the_deadline_not_before() {
        let shutdown = CancellationToken::new();
        shutdown.cancel();
        // Before the deadline a shutdown waits for the write, backing off
        // as usual (50 + 100 + 200 ms).
        let started = tokio::time::Instant::now();
        assert_eq!(
            run(Duration::from_secs(30), 3, unreachable, &shutdown).await,
            (4, Some(4))
        );
        assert!(started.elapsed() >= Duration::from_millis(350));
        // Past it, the next failure gives up.
        let started = tokio::time::Instant::now();
        let (calls, result) = run(Duration::from_secs(1), 40, unreachable, &shutdown).await;
        assert_eq!(result, None);
        assert!(started.elapsed() <= Duration::from_secs(3), "{calls} calls");
        // A shutdown arriving while it waits past the deadline wakes it.
        let shutdown = CancellationToken::new();
        let waker = shutdown.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(20)).await;
            waker.cancel();
        });
        let started = tokio::time::Instant::now();
        let (_, result) = run(Duration::from_secs(1), 1_000, unreachable, &shutdown).await;
        assert_eq!(result, None);
        let elapsed = started.elapsed();
        assert!(
            elapsed >= Duration::from_secs(20) && elapsed < Duration::from_secs(21),
            "{elapsed:?}"
        );
    }
}
