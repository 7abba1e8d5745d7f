//! The broker side: per connection, declare the topology, then one worker per
//! partition queue. Partitions run concurrently; within one partition messages
//! are processed one at a time, in delivery order. On shutdown a worker stops
//! taking messages, finishes (and acknowledges) the one in flight, and the
//! connection is closed (anything prefetched goes back to the queue).
//!
//! Acknowledgements are cumulative (`multiple`): a settled message (committed,
//! or republished with a confirm) is acknowledged together with the ones
//! before it when the partition has nothing more waiting, when half the
//! prefetch window is settled, when a later message is held (retried in
//! place), or before the worker stops. Every message is
//! still acknowledged only after it is settled; one that was settled but not
//! yet acknowledged when the process dies is redelivered and is a duplicate
//! for the inbox: at most half a prefetch window of them per partition. On a
//! quorum queue each acknowledgement is a Raft command, so one per batch
//! instead of one per message takes most of the broker's work off the path.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use futures_util::{FutureExt, StreamExt};
use lapin::{
    options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions, ConfirmSelectOptions},
    types::FieldTable,
    Connection,
};
use tokio::task::JoinSet;
use tracing::Instrument;

use crate::{
    process::{Infra, Processor},
    topology::DeclareError,
    Domain,
};
use kit::CancellationToken;

/// Work on one broker connection until shutdown (`Ok`) or a failure (`Err`:
/// the supervisor reconnects). A topology conflict (a configuration error,
/// which no reconnect repairs) is written to `fatal` and ends the
/// supervisor with `Ok`: the service then stops with that error.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn run_connection<D: Domain>(
    connection: Connection,
    amqp: kit::settings::AmqpSettings,
    publishing_name: String,
    processor: Arc<Processor<D>>,
    prefetch: u16,
    shutdown: CancellationToken,
    fatal: Arc<OnceLock<String>>,
    ready: kit::amqp::Connected,
) -> Result<(), lapin::Error> {
    let connection = Arc::new(connection);
    // A broker that stops answering here is found by the heartbeat
    // (minutes): a shutdown does not wait for it.
    let declared = tokio::select! {
        _ = shutdown.cancelled() => {
            kit::amqp::close_connection_bounded(&connection, "bye").await;
            return Ok(());
        }
        declared = processor.topology.check_and_declare(&connection, false) => declared,
    };
    let result = match declared {
        Ok(()) => {
            // The copies (retries, deferrals, dead letters) go out on a
            // connection of their own: under a memory or disk alarm the
            // broker blocks a connection that publishes, and lapin then
            // writes nothing on it, acknowledgements included. On one shared
            // connection, one partition's copy stopped every partition's
            // acknowledgements until the alarm ended (and after the
            // broker's consumer_timeout, their channels were closed and the
            // prefetched messages redelivered, counted against the delivery
            // limit). This one only consumes, and is never blocked. Shared
            // with the partition workers, which open a new publishing
            // channel on it when a publish fails (`Publisher::renew`).
            match kit::amqp::connect(&amqp, &publishing_name, &shutdown).await {
                Ok(publishing) => {
                    let publishing = Arc::new(publishing);
                    let consumed = consume(
                        &connection,
                        &publishing,
                        processor,
                        prefetch,
                        &shutdown,
                        &ready,
                    )
                    .await;
                    ready.set(false);
                    kit::amqp::close_connection_bounded(&publishing, "bye").await;
                    consumed
                }
                // Shut down while connecting.
                Err(_) => Ok(()),
            }
        }
        Err(DeclareError::Broker(error)) => Err(error),
        Err(DeclareError::Busy(why)) => {
            tracing::warn!(%why, "declaring the topology: reconnecting to try again");
            Err(lapin::Error::from(
                lapin::ErrorKind::InvalidConnectionState(lapin::ConnectionState::Error),
            ))
        }
        Err(DeclareError::Conflict(why)) => {
            tracing::error!(%why, "refusing to consume: consumer topology conflict");
            let _ = fatal.set(why);
            Ok(())
        }
    };
    kit::amqp::close_connection_bounded(&connection, "bye").await;
    result
}

async fn consume<D: Domain>(
    connection: &Arc<Connection>,
    publishing: &Arc<Connection>,
    processor: Arc<Processor<D>>,
    prefetch: u16,
    shutdown: &CancellationToken,
    ready: &kit::amqp::Connected,
) -> Result<(), lapin::Error> {
    // A token of this connection's workers: cancelled on shutdown or when one
    // of them fails (then all stop and the connection is rebuilt).
    let stop = shutdown.child_token();
    // A broker that stops answering during the set-up is found by the
    // heartbeat (minutes): a shutdown meanwhile does not wait for it. What
    // was opened is closed first either way (dropped open, a channel and
    // its consumer close in the background, racing the connection's close:
    // lapin logged an ERROR).
    let mut opened = SetUp::default();
    let outcome = tokio::select! {
        _ = shutdown.cancelled() => None,
        outcome = set_up(connection, publishing, &processor, prefetch, &mut opened) => Some(outcome),
    };
    let monitor_channel = match outcome {
        Some(Ok(channel)) => channel,
        cut_short => {
            opened.close().await;
            return match cut_short {
                Some(Err(error)) => Err(error),
                _ => Ok(()),
            };
        }
    };
    let mut workers = JoinSet::new();
    for (queue, consume_channel, mut publisher, mut consumer) in opened.partitions {
        let processor = processor.clone();
        let stop = stop.clone();
        workers.spawn(async move {
            let ack_batch = usize::from(prefetch / 2).max(1);
            let channels = Channels {
                consuming: &consume_channel,
                publisher: &mut publisher,
            };
            let result =
                partition_worker(processor, &queue, &mut consumer, channels, &stop, ack_batch)
                    .await;
            if result.is_err() {
                stop.cancel();
            }
            // Close both channels before the connection is closed: a dropped
            // channel closes itself in the background, and closing the
            // connection meanwhile made lapin log an ERROR on every clean
            // shutdown. (Unacknowledged prefetched messages are requeued.)
            kit::amqp::close_bounded(&consume_channel, "bye").await;
            kit::amqp::close_bounded(&publisher.channel, "bye").await;
            // Only now, with its channel closing (which marks the consumer
            // as cancelling), may the consumer go: dropping an active one sends a
            // basic.cancel in the background, and when that raced the channel
            // close, lapin failed it ("invalid channel state: Closing"), put
            // the whole connection in error and logged it at ERROR.
            drop(consumer);
            result
        });
    }
    tracing::info!(
        consumer = %processor.topology.name,
        partitions = processor.topology.partitions,
        "consuming"
    );
    // Ready once every partition consumes (the consuming connection is the
    // one watched: it never publishes, so an alarm does not block it).
    ready.watch(connection);
    ready.set(true);
    let mut monitor = tokio::spawn(watch_dead_letters(
        monitor_channel,
        processor.topology.dead_letter_queue(),
        processor.metrics.dlq_depth.clone(),
        stop.clone(),
    ));

    let mut failure = None;
    let mut monitor_ended = false;
    loop {
        tokio::select! {
            ended = &mut monitor, if !monitor_ended => {
                monitor_ended = true;
                if !stop.is_cancelled() {
                    // The depth gauge must not freeze (the dead-letter alert
                    // reads it): rebuild the connection, which declares the
                    // queue again (an operator may have deleted it).
                    tracing::warn!(?ended, "the dead-letter queue depth cannot be read: reconnecting");
                    failure.get_or_insert(lost("the dead-letter queue depth cannot be read"));
                    stop.cancel();
                }
            }
            joined = workers.join_next() => match joined {
                None => break,
                Some(Ok(Ok(()))) => {}
                Some(Ok(Err(error))) => {
                    failure.get_or_insert(error);
                    stop.cancel();
                }
                Some(Err(join_error)) => {
                    failure.get_or_insert(lost("a partition worker panicked"));
                    tracing::error!(%join_error, "a partition worker panicked");
                    stop.cancel();
                }
            },
            error = kit::amqp::closed(connection), if !stop.is_cancelled() => {
                failure.get_or_insert(error);
                stop.cancel();
            }
            error = kit::amqp::closed(publishing), if !stop.is_cancelled() => {
                failure.get_or_insert(error);
                stop.cancel();
            }
        }
    }
    // Let it finish a request in flight rather than cancel it half-way
    // (bounded), then stop it.
    if !monitor_ended {
        let _ = tokio::time::timeout(Duration::from_secs(2), &mut monitor).await;
        monitor.abort();
    }
    tracing::info!(failed = failure.is_some(), "partition workers stopped");
    match failure {
        Some(error) if !shutdown.is_cancelled() => Err(error),
        _ => Ok(()),
    }
}

/// A connection's channels, every one open before any worker starts.
#[derive(Default)]
struct SetUp {
    /// Per partition: its queue, consuming channel, publisher and consumer.
    partitions: Vec<(String, lapin::Channel, Publisher, lapin::Consumer)>,
    /// The channels of the partition being set up (until it is complete).
    loose: Vec<lapin::Channel>,
}

impl SetUp {
    /// Close what a set-up cut short (a shutdown, an error) had opened, as a
    /// worker closes its own: the channels, then the consumers; all at once
    /// (each close waits up to 2 s for a broker that may not answer).
    async fn close(self) {
        let partitions = self.partitions.into_iter().map(
            |(_, consume_channel, publisher, consumer)| async move {
                kit::amqp::close_bounded(&consume_channel, "bye").await;
                kit::amqp::close_bounded(&publisher.channel, "bye").await;
                drop(consumer);
            },
        );
        let channels = self
            .loose
            .into_iter()
            .map(|channel| async move { kit::amqp::close_bounded(&channel, "bye").await });
        futures_util::future::join(
            futures_util::future::join_all(partitions),
            futures_util::future::join_all(channels),
        )
        .await;
    }
}

/// Open every partition's channels (and the monitor's) before any worker
/// starts: once a worker publishes a copy the broker's alarm holds, the
/// broker reads nothing more from the publishing connection, and a
/// publishing channel opened after that (another partition's) was never
/// answered: that partition never consumed. Returns the monitor's channel,
/// opened last; the partitions are in `opened`.
async fn set_up<D: Domain>(
    connection: &Connection,
    publishing: &Arc<Connection>,
    processor: &Processor<D>,
    prefetch: u16,
    opened: &mut SetUp,
) -> Result<lapin::Channel, lapin::Error> {
    for partition in 0..processor.topology.partitions {
        let queue = processor.topology.partition_queue(partition);
        let consume_channel = connection.create_channel().await?;
        opened.loose.push(consume_channel.clone());
        consume_channel
            .basic_qos(prefetch, BasicQosOptions::default())
            .await?;
        let publisher = Publisher::open(publishing.clone(), &mut opened.loose).await?;
        let tag = format!(
            "{}-{}-p{partition}",
            processor.topology.name,
            std::process::id()
        );
        let consumer = consume_channel
            .basic_consume(
                queue.as_str().into(),
                tag.as_str().into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        opened.loose.clear();
        opened
            .partitions
            .push((queue, consume_channel, publisher, consumer));
        // Fail point: a test delays the next partition's set-up here (the
        // first partition's messages were handled meanwhile when its worker
        // started before the others were set up).
        kit::failpoint::delay_point("consumer.partition_set_up").await;
    }
    connection.create_channel().await
}

async fn partition_worker<D: Domain>(
    processor: Arc<Processor<D>>,
    queue: &str,
    consumer: &mut lapin::Consumer,
    mut channels: Channels<'_>,
    stop: &CancellationToken,
    ack_batch: usize,
) -> Result<(), lapin::Error> {
    let mut acks = PendingAcks::new(processor.metrics.acknowledged.clone());
    loop {
        // Take what is already here without waiting; before waiting for the
        // broker, acknowledge everything settled so far.
        let next = match consumer.next().now_or_never() {
            Some(next) if !stop.is_cancelled() => next,
            _ => {
                acks.flush().await?;
                tokio::select! {
                    biased;
                    _ = stop.cancelled() => return Ok(()),
                    next = consumer.next() => next,
                }
            }
        };
        let delivery = match next {
            Some(Ok(delivery)) => delivery,
            Some(Err(error)) => return Err(error),
            None => {
                tracing::warn!(queue, "consumer stream ended");
                return Err(lost("consumer stream ended"));
            }
        };
        let span = tracing::info_span!("consume", queue, message_id = tracing::field::Empty,);
        if let Some(id) = delivery.properties.message_id() {
            span.record("message_id", id.as_str());
        }
        let headers = delivery.properties.headers().as_ref();
        kit::telemetry::set_remote_parent(
            &span,
            crate::topology::str_header(headers, events::headers::TRACEPARENT).as_deref(),
            crate::topology::str_header(headers, events::headers::TRACESTATE).as_deref(),
        );
        // The in-flight message is always finished: no cancellation inside.
        let settled = match settle(&processor, &mut channels, &delivery, stop, &mut acks)
            .instrument(span)
            .await
        {
            Ok(settled) => settled,
            Err(error) => {
                // The connection failed (or the broker refused the topology
                // on a new publishing channel); the consuming channel may
                // still take the acks of what was settled before (fewer
                // duplicates after the reconnect). This message is not
                // acknowledged.
                let _ = acks.flush().await;
                return Err(error);
            }
        };
        if !settled {
            // Not settled: never acknowledged (the broker redelivers it); the
            // ones settled before it are.
            acks.flush().await?;
            return Ok(());
        }
        acks.push(delivery.acker);
        if acks.len() >= ack_batch {
            acks.flush().await?;
        }
    }
}

/// Settled, not yet acknowledged deliveries of one channel (in delivery
/// order): one cumulative ack of the latest covers them all.
struct PendingAcks {
    latest: Option<lapin::Acker>,
    count: usize,
    /// `consumer_messages_acknowledged_total`.
    acknowledged: kit::metrics::prometheus::IntCounter,
}

impl PendingAcks {
    fn new(acknowledged: kit::metrics::prometheus::IntCounter) -> Self {
        Self {
            latest: None,
            count: 0,
            acknowledged,
        }
    }

    fn push(&mut self, acker: lapin::Acker) {
        self.latest = Some(acker);
        self.count += 1;
    }

    fn len(&self) -> usize {
        self.count
    }

    async fn flush(&mut self) -> Result<(), lapin::Error> {
        let count = std::mem::take(&mut self.count);
        if let Some(acker) = self.latest.take() {
            // Resolves once lapin has written the frame to the socket: from
            // then on it no longer depends on this process.
            if acker.ack(BasicAckOptions { multiple: true }).await? {
                self.acknowledged.inc_by(count as u64);
            } else {
                // lapin refused it: the channel is closed (or closing), or
                // the delivery was settled already. Unacknowledged messages
                // return to their queue and come back; the inbox or the
                // progress row recognises them.
                tracing::warn!(
                    count,
                    "acknowledgement not sent (channel closed, or already settled); unacknowledged messages are redelivered"
                );
            }
        }
        Ok(())
    }
}

/// Keep the dead-letter depth gauge current (the alert on dead letters reads it).
async fn watch_dead_letters(
    channel: lapin::Channel,
    queue: String,
    gauge: kit::metrics::prometheus::IntGauge,
    stop: CancellationToken,
) {
    loop {
        match kit::amqp::passive_declare(&channel, &queue).await {
            Ok(declared) => gauge.set(i64::from(declared.message_count())),
            Err(error) => {
                // Ends the connection's workers unless they are stopping
                // anyway (`run_connection`).
                tracing::debug!(%error, "reading the dead-letter queue depth");
                return;
            }
        }
        tokio::select! {
            _ = stop.cancelled() => {
                kit::amqp::close_bounded(&channel, "bye").await;
                return;
            }
            _ = tokio::time::sleep(Duration::from_secs(5)) => {}
        }
    }
}

fn lost(what: &str) -> lapin::Error {
    lapin::Error::from(std::io::Error::other(what.to_owned()))
}

/// A partition worker's channels: the one it consumes (and acknowledges)
/// on, and its publisher.
struct Channels<'a> {
    consuming: &'a lapin::Channel,
    publisher: &'a mut Publisher,
}

/// A partition's confirm channel for its retry, deferral and dead-letter
/// copies, on the process's publishing connection (never the consuming
/// one: see `run_connection`).
struct Publisher {
    connection: Arc<Connection>,
    channel: lapin::Channel,
}

/// How long opening a publishing channel and declaring the topology on it
/// may take (a connection the broker blocks under an alarm never answers).
const RENEW_TIMEOUT: Duration = Duration::from_secs(10);

impl Publisher {
    /// A publisher on a new confirm channel of `connection`; the channel is
    /// also put in `opened` as soon as it exists (closed by the caller if
    /// the set-up is cut short).
    async fn open(
        connection: Arc<Connection>,
        opened: &mut Vec<lapin::Channel>,
    ) -> Result<Self, lapin::Error> {
        let channel = connection.create_channel().await?;
        opened.push(channel.clone());
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        Ok(Self {
            connection,
            channel,
        })
    }

    async fn confirm_channel(connection: &Connection) -> Result<lapin::Channel, lapin::Error> {
        let channel = connection.create_channel().await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        Ok(channel)
    }

    /// Make the next publish attempt possible after a failed one, on the
    /// same connection: a new channel if the broker closed this one, and
    /// the consumer's topology declared again (a copy returned unroutable
    /// means an operator deleted a tier queue or the dead-letter queue; the
    /// declarations are idempotent). `Err`: the broker refused, and the
    /// reconnect decides (a topology conflict stops the service there). No
    /// answer within [`RENEW_TIMEOUT`] (blocked by an alarm) is not an
    /// error: the caller tries again.
    async fn renew(&mut self, topology: &crate::topology::Topology) -> Result<(), lapin::Error> {
        let renewed = tokio::time::timeout(RENEW_TIMEOUT, async {
            if !self.channel.status().connected() {
                self.channel = Self::confirm_channel(&self.connection).await?;
            }
            topology.declare(&self.channel).await
        })
        .await;
        match renewed {
            Ok(result) => result,
            Err(_) => {
                tracing::warn!(
                    "the broker did not open a channel or declare the topology within {RENEW_TIMEOUT:?} (blocked by an alarm?): trying again"
                );
                Ok(())
            }
        }
    }
}

/// Settle one delivery (the caller acknowledges it). `Ok(false)`: stopped
/// before it could be settled (never acknowledged: the broker redelivers it).
/// `acks` (the partition's settled deliveries before this one) are
/// acknowledged as soon as this one is held.
///
/// A failure the database or a publish of a copy (retry, deferral, dead
/// letter) reports while the connection stays up is retried in place, with
/// the message held: it is not returned to its queue, so no delivery is
/// counted against the queue's delivery limit. Returning it (the reconnect)
/// counted one per attempt for every message prefetched on the partitions,
/// and a broker alarm lasting 20 of them had the broker dead-letter good
/// messages itself, with no reason and no order parked. Re-running
/// `process` after a publish whose confirm was lost can only add a copy the
/// inbox or the redrive recognises, as the reconnect's redelivery did.
///
/// Held only while the delivery is still this worker's: once the consuming
/// channel is gone (the broker's `consumer_timeout` closes it when a
/// delivery stays unacknowledged for 30 minutes, and returns the message)
/// the worker reconnects instead.
async fn settle<D: Domain>(
    processor: &Processor<D>,
    channels: &mut Channels<'_>,
    delivery: &lapin::message::Delivery,
    stop: &CancellationToken,
    acks: &mut PendingAcks,
) -> Result<bool, lapin::Error> {
    let mut pause = Duration::from_millis(100);
    loop {
        if !channels.consuming.status().connected() {
            return Err(lost(
                "the consuming channel closed while its message was retried in place",
            ));
        }
        let publisher = &mut *channels.publisher;
        match processor.process(&publisher.channel, delivery).await {
            Ok(outcome) => {
                tracing::debug!(?outcome, "settled");
                return Ok(true);
            }
            Err(Infra::Database(error)) => {
                tracing::warn!(%error, retry_in_ms = pause.as_millis() as u64, "database unavailable: retrying the message");
                if stop.is_cancelled() {
                    return Ok(false);
                }
                processor.metrics.retried_in_place.inc();
                // The messages settled before this one are acknowledged
                // while it is held (on the consuming channel, which an
                // alarm does not block), not only once it settles.
                acks.flush().await?;
                tokio::select! {
                    _ = stop.cancelled() => return Ok(false),
                    _ = tokio::time::sleep(pause) => {}
                }
                pause = (pause * 2).min(Duration::from_secs(5));
            }
            Err(Infra::Broker(error)) => {
                if stop.is_cancelled() {
                    return Ok(false);
                }
                if !publisher.connection.status().connected() {
                    tracing::warn!(%error, "publish failed and the connection is gone: reconnecting (the message will be redelivered)");
                    return Err(lost(&error));
                }
                tracing::warn!(%error, retry_in_ms = pause.as_millis() as u64, "publish failed: retrying the message in place");
                processor.metrics.retried_in_place.inc();
                acks.flush().await?;
                tokio::select! {
                    _ = stop.cancelled() => return Ok(false),
                    _ = tokio::time::sleep(pause) => {}
                }
                // A blocked connection (a memory or disk alarm) writes
                // nothing: a publish now would wait, unbounded and deaf to
                // shutdown, until the alarm ends. Wait for the end here
                // instead, counted every 5 s (ConsumerRetryingInPlace).
                while publisher.connection.status().blocked() {
                    if pause < Duration::from_secs(5) {
                        tracing::warn!("the broker blocks this connection (an alarm): holding the message until it unblocks");
                        pause = Duration::from_secs(5);
                    }
                    tokio::select! {
                        _ = stop.cancelled() => return Ok(false),
                        _ = tokio::time::sleep(Duration::from_secs(5)) => {}
                    }
                    processor.metrics.retried_in_place.inc();
                }
                tokio::select! {
                    _ = stop.cancelled() => return Ok(false),
                    renewed = publisher.renew(&processor.topology) => renewed?,
                }
                pause = (pause * 2).min(Duration::from_secs(5));
            }
        }
    }
}
