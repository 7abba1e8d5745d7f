//! The consumer's own RabbitMQ topology (DESIGN.md section 7), declared
//! idempotently at every (re)connect:
//!
//! ```text
//! order-events (topic) --#--> <name>.events (x-consistent-hash, hash-header aggregate_id)
//!     --weight "1"--> <name>.p0 .. <name>.p{P-1}  (quorum, single active consumer,
//!                                                  x-delivery-limit -> <name>.dlq)
//! <name>.retry.<i>  (quorum, x-message-ttl = tier i, dead-letters back to <name>.events,
//!                    so the message returns to its partition)
//! <name>.dlq        (quorum): dead letters, moved back by `redrive`
//! ```

use std::time::Duration;

use kit::amqp::reply_code;
pub(crate) use kit::amqp::{int_header, str_header};
use lapin::{
    options::{
        ExchangeBindOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
        QueueDeleteOptions,
    },
    types::{AMQPValue, FieldTable, LongString, ShortString},
    Channel, Connection, ExchangeKind,
};

/// Names and shape of one consumer's topology.
#[derive(Clone, Debug)]
pub struct Topology {
    pub name: String,
    pub partitions: u16,
    pub tiers: Vec<Duration>,
    pub delivery_limit: u32,
    /// Bind the hash exchange to `order-events` (see `ConsumerSettings`).
    pub bind_order_events: bool,
}

fn long_string(value: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(value.as_bytes()))
}

/// A quorum queue dead-lettering to `exchange` at least once (which needs
/// `x-overflow: reject-publish`, DESIGN.md section 13).
fn dead_lettering_quorum_args(exchange: &str) -> FieldTable {
    let mut args = FieldTable::default();
    args.insert("x-queue-type".into(), long_string("quorum"));
    args.insert("x-dead-letter-exchange".into(), long_string(exchange));
    args.insert(
        "x-dead-letter-strategy".into(),
        long_string("at-least-once"),
    );
    args.insert("x-overflow".into(), long_string("reject-publish"));
    args
}

impl Topology {
    /// The consistent-hash exchange of this consumer.
    pub fn exchange(&self) -> String {
        format!("{}.events", self.name)
    }

    pub fn partition_queue(&self, partition: u16) -> String {
        format!("{}.p{partition}", self.name)
    }

    pub fn retry_queue(&self, tier: usize) -> String {
        format!("{}.retry.{tier}", self.name)
    }

    pub fn dead_letter_queue(&self) -> String {
        format!("{}.dlq", self.name)
    }

    /// Check the broker's topology against this configuration, then declare
    /// everything (idempotent). A topology in another shape is a
    /// [`DeclareError::Conflict`]: the service refuses to run on it (see
    /// deploy/README.md, "Changing partitions, retry tiers or the delivery
    /// limit") instead of retrying a declaration the broker will never
    /// accept, or consuming while part of the orders go unconsumed. With
    /// `exact_partitions` (redrive, which publishes to the hash exchange and
    /// consumes nothing) a deployed consumer with fewer partitions is a
    /// conflict too: declaring the missing ones would add queues to the hash
    /// ring that nobody consumes.
    pub async fn check_and_declare(
        &self,
        connection: &Connection,
        exact_partitions: bool,
    ) -> Result<(), DeclareError> {
        let next = self.partition_queue(self.partitions);
        if shared_queue_exists(connection, &next).await? {
            return Err(DeclareError::Conflict(format!(
                "queue {next} exists but partitions = {}: the consumer had more partitions, \
                 and the events its hash exchange routes there would never be consumed. \
                 Set the partitions back, or drain the queues from {next} on and delete \
                 them first",
                self.partitions
            )));
        }
        if exact_partitions && self.partitions > 1 {
            let last = self.partition_queue(self.partitions - 1);
            // Each probe asks the way that closes no channel when the answer
            // is the usual one (a closed channel is an ERROR line of lapin's
            // in the operator's output): the last partition of a deployed
            // consumer exists; when it does not, the topology is usually new,
            // and its first partition does not exist either.
            if !shared_queue_expected(connection, &last).await?
                && shared_queue_exists(connection, &self.partition_queue(0)).await?
            {
                return Err(DeclareError::Conflict(format!(
                    "queue {last} does not exist but partitions = {}: the consumer runs \
                     with fewer partitions; run this with its configuration",
                    self.partitions
                )));
            }
        }
        let channel = connection.create_channel().await?;
        match self.declare(&channel).await {
            Err(error) if reply_code(&error) == Some(kit::amqp::PRECONDITION_FAILED) => {
                Err(DeclareError::Conflict(format!(
                    "the broker holds this consumer's topology with other arguments \
                     (a retry tier, the delivery limit or a queue type changed): {error}. \
                     Restore the setting, or drain and delete the queue named there first"
                )))
            }
            Err(error) => Err(error.into()),
            Ok(()) => {
                let _ = channel.close(200, "declared".into()).await;
                Ok(())
            }
        }
    }

    /// Declare everything (idempotent; the arguments never change for a
    /// name). Through [`Topology::check_and_declare`] on each connection,
    /// and again by a partition worker whose publish failed (after the
    /// connection's check: the partition count is not probed again).
    pub(crate) async fn declare(&self, channel: &Channel) -> Result<(), lapin::Error> {
        kit::amqp::declare_order_events_exchange(channel).await?;
        let durable_exchange = ExchangeDeclareOptions {
            durable: true,
            ..ExchangeDeclareOptions::default()
        };
        let mut hash_args = FieldTable::default();
        hash_args.insert(
            "hash-header".into(),
            long_string(events::headers::AGGREGATE_ID),
        );
        channel
            .exchange_declare(
                self.exchange().into(),
                ExchangeKind::Custom("x-consistent-hash".to_owned()),
                durable_exchange,
                hash_args,
            )
            .await?;
        if self.bind_order_events {
            channel
                .exchange_bind(
                    self.exchange().into(),
                    events::EXCHANGE.into(),
                    "#".into(),
                    ExchangeBindOptions::default(),
                    FieldTable::default(),
                )
                .await?;
        }

        let durable = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        let dlq = self.dead_letter_queue();
        let mut dlq_args = FieldTable::default();
        dlq_args.insert("x-queue-type".into(), long_string("quorum"));
        channel
            .queue_declare(dlq.as_str().into(), durable, dlq_args)
            .await?;

        for partition in 0..self.partitions {
            let queue = self.partition_queue(partition);
            // A message over the delivery limit (a crash loop) is not dropped:
            // it lands in the dead-letter queue (default exchange), at least once.
            let mut args = dead_lettering_quorum_args("");
            args.insert("x-dead-letter-routing-key".into(), long_string(&dlq));
            args.insert("x-single-active-consumer".into(), AMQPValue::Boolean(true));
            args.insert(
                "x-delivery-limit".into(),
                AMQPValue::LongLongInt(i64::from(self.delivery_limit)),
            );
            channel
                .queue_declare(queue.as_str().into(), durable, args)
                .await?;
            channel
                .queue_bind(
                    queue.as_str().into(),
                    self.exchange().into(),
                    "1".into(),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await?;
        }

        for (tier, delay) in self.tiers.iter().enumerate() {
            let queue = self.retry_queue(tier);
            // Expired messages go back to the hash exchange: their partition.
            let mut args = dead_lettering_quorum_args(&self.exchange());
            args.insert(
                "x-message-ttl".into(),
                AMQPValue::LongLongInt(i64::try_from(delay.as_millis()).unwrap_or(i64::MAX)),
            );
            channel
                .queue_declare(queue.as_str().into(), durable, args)
                .await?;
        }
        Ok(())
    }
}

/// Whether a shared (durable) queue named `queue` exists.
///
/// AMQP asks "does it exist" only with a passive declaration, which the
/// broker answers with a 404 that closes the channel (and lapin logs at
/// ERROR, on every start). Instead: declare the name as an exclusive classic
/// queue of this connection and delete it again. A refusal (405, or 406 on
/// other arguments) means a queue of that name exists: a shared one, or
/// another connection's exclusive probe (another instance starting, or one
/// that died mid-probe, until the broker notices); only then a passive
/// declaration tells them apart, as it succeeds on a shared queue alone.
async fn shared_queue_exists(connection: &Connection, queue: &str) -> Result<bool, DeclareError> {
    let exclusive = QueueDeclareOptions {
        exclusive: true,
        auto_delete: true,
        ..QueueDeclareOptions::default()
    };
    let mut classic = FieldTable::default();
    classic.insert("x-queue-type".into(), long_string("classic"));
    for _ in 0..PROBE_TRIES {
        let probe = connection.create_channel().await?;
        match probe
            .queue_declare(queue.into(), exclusive, classic.clone())
            .await
        {
            Ok(_) => {
                probe
                    .queue_delete(queue.into(), QueueDeleteOptions::default())
                    .await?;
                let _ = probe.close(200, "probed".into()).await;
                return Ok(false);
            }
            Err(error)
                if matches!(
                    reply_code(&error),
                    Some(RESOURCE_LOCKED | kit::amqp::PRECONDITION_FAILED)
                ) =>
            {
                match passive_probe(connection, queue).await {
                    Ok(()) => return Ok(true),
                    // Another connection's exclusive queue, or gone since.
                    Err(error)
                        if matches!(reply_code(&error), Some(RESOURCE_LOCKED | NOT_FOUND)) =>
                    {
                        tracing::info!(queue, "another connection is probing this queue name");
                    }
                    Err(error) => return Err(error.into()),
                }
            }
            Err(error) => return Err(error.into()),
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // Still another connection's: try again on the next connection (the
    // supervisor's backoff, and a shutdown, apply).
    Err(DeclareError::Busy(format!(
        "queue {queue} is held exclusively by another connection"
    )))
}

/// [`shared_queue_exists`] for a queue that normally exists (a partition of
/// a deployed consumer): a passive declaration first, which answers a
/// shared queue without closing a channel, where the exclusive probe's
/// refusal (405) would close one, which lapin logs at ERROR (once per
/// probed queue on every redrive). Absent (404, logged likewise): `false`.
/// Refused (405: another connection's exclusive queue of that name, a
/// probe): the exclusive probe tells them apart, as for any queue.
async fn shared_queue_expected(connection: &Connection, queue: &str) -> Result<bool, DeclareError> {
    match passive_probe(connection, queue).await {
        Ok(()) => Ok(true),
        Err(error) if reply_code(&error) == Some(NOT_FOUND) => Ok(false),
        Err(error) if reply_code(&error) == Some(RESOURCE_LOCKED) => {
            shared_queue_exists(connection, queue).await
        }
        Err(error) => Err(error.into()),
    }
}

/// A passive declaration of `queue` on a channel of its own (a refusal
/// closes the channel; after a success it is closed here): `Ok` when a
/// shared queue of that name exists, else the broker's refusal (its reply
/// code says why) or a broken connection.
async fn passive_probe(connection: &Connection, queue: &str) -> Result<(), lapin::Error> {
    let check = connection.create_channel().await?;
    kit::amqp::passive_declare(&check, queue).await?;
    let _ = check.close(200, "probed".into()).await;
    Ok(())
}

/// Why the topology could not be declared.
#[derive(Debug, thiserror::Error)]
pub enum DeclareError {
    /// The broker holds the topology in a shape this configuration cannot
    /// use: a configuration error, not retried.
    #[error("consumer topology conflict: {0}")]
    Conflict(String),
    /// The connection or a channel failed: reconnect and try again.
    #[error(transparent)]
    Broker(#[from] lapin::Error),
    /// A queue name is held by another connection's probe (another instance
    /// starting, or a dead one until the broker notices): try again later.
    #[error("{0}")]
    Busy(String),
}

const NOT_FOUND: u16 = 404;
const RESOURCE_LOCKED: u16 = 405;
/// Tries of the queue probe, 500 ms apart, before it gives the connection
/// up (and the supervisor tries on a new one).
const PROBE_TRIES: u32 = 10;

/// Header names the runtime adds to the messages it re-publishes.
pub mod headers {
    /// Failed attempts so far (handler errors).
    pub const ATTEMPTS: &str = "x-consumer-attempts";
    /// Times the event was deferred because it arrived ahead of a predecessor.
    pub const DEFERRALS: &str = "x-consumer-deferrals";
    /// Failed attempts of the event still ahead of a predecessor after its
    /// deferrals (counted apart from the handler's `ATTEMPTS`).
    pub const GAP_FAILURES: &str = "x-consumer-gap-failures";
    /// Why the event is in the dead-letter queue.
    pub const DEAD_LETTER_REASON: &str = "x-dead-letter-reason";
    /// Which consumer dead-lettered it.
    pub const DEAD_LETTERED_BY: &str = "x-dead-lettered-by";
    /// Set on events moved back from the dead-letter queue by `redrive`.
    pub const REDRIVEN: &str = "x-redriven";
    /// Set by a quorum queue on a message it delivers again: its earlier
    /// deliveries. A message the runtime publishes is a new one.
    pub const DELIVERY_COUNT: &str = "x-delivery-count";
}

/// Headers of `existing` without the runtime's bookkeeping and the broker's
/// (the `x-death` history, which would otherwise grow with every retry, and
/// the delivery count). The relay's headers stay, and so does the redrive's
/// mark: a retried copy of a redriven event is late by design too (the lag
/// histogram skips it).
pub(crate) fn clean_headers(existing: Option<&FieldTable>) -> FieldTable {
    let mut table = FieldTable::default();
    if let Some(existing) = existing {
        for (key, value) in existing.inner() {
            let k = key.as_str();
            let drop = k == "x-death"
                || k == headers::DELIVERY_COUNT
                || k.starts_with("x-first-death")
                || k.starts_with("x-last-death")
                || k == headers::ATTEMPTS
                || k == headers::DEFERRALS
                || k == headers::GAP_FAILURES
                || k == headers::DEAD_LETTER_REASON
                || k == headers::DEAD_LETTERED_BY;
            if !drop {
                table.insert(key.clone(), value.clone());
            }
        }
    }
    table
}

pub(crate) fn set_int(table: &mut FieldTable, name: &str, value: i64) {
    table.insert(ShortString::from(name), AMQPValue::LongLongInt(value));
}

pub(crate) fn set_str(table: &mut FieldTable, name: &str, value: &str) {
    table.insert(ShortString::from(name), long_string(value));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_agreed_shape() {
        let t = Topology {
            name: "inventory".into(),
            partitions: 4,
            tiers: vec![Duration::from_secs(10)],
            delivery_limit: 20,
            bind_order_events: true,
        };
        assert_eq!(t.exchange(), "inventory.events");
        assert_eq!(t.partition_queue(3), "inventory.p3");
        assert_eq!(t.retry_queue(0), "inventory.retry.0");
        assert_eq!(t.dead_letter_queue(), "inventory.dlq");
    }

    #[test]
    fn cleaned_headers_drop_bookkeeping_and_keep_the_relay_headers() {
        let mut h = FieldTable::default();
        set_str(&mut h, "aggregate_id", "a");
        set_int(&mut h, headers::ATTEMPTS, 3);
        set_int(&mut h, headers::GAP_FAILURES, 2);
        set_str(&mut h, "x-first-death-queue", "q");
        h.insert("x-death".into(), AMQPValue::Boolean(true));
        set_int(&mut h, headers::DELIVERY_COUNT, 2);
        let cleaned = clean_headers(Some(&h));
        assert_eq!(
            str_header(Some(&cleaned), "aggregate_id").as_deref(),
            Some("a")
        );
        assert_eq!(cleaned.inner().len(), 1);
        // The redrive's mark stays on a copy (a retry of a redriven event).
        set_str(&mut h, headers::REDRIVEN, "true");
        let cleaned = clean_headers(Some(&h));
        assert_eq!(
            str_header(Some(&cleaned), headers::REDRIVEN).as_deref(),
            Some("true")
        );
        assert_eq!(cleaned.inner().len(), 2);
        assert_eq!(int_header(Some(&h), headers::ATTEMPTS), Some(3));
    }
}
