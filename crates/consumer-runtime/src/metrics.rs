//! The consumer's Prometheus metrics (every one also carries the `service`
//! label of the registry and the `consumer` label = the consumer name).

use kit::metrics::prometheus::{
    self, Gauge, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry,
};

#[derive(Clone)]
pub struct Metrics {
    /// Events applied (effect committed), by event type (unknown types are
    /// acknowledged and counted as `ignored`).
    pub applied: IntCounterVec,
    /// Duplicates recognised by the inbox.
    pub duplicates: IntCounter,
    /// Copies of events already applied here, told by the order's progress
    /// rather than the inbox (at or below its last applied sequence): one
    /// whose inbox row was cleaned up since is acknowledged with a new
    /// inbox row; one applied meanwhile (found by a park) or that this build
    /// cannot decode is acknowledged without one.
    pub stale: IntCounter,
    /// Events that arrived ahead of a missing predecessor and were deferred.
    pub deferred: IntCounter,
    /// Handler failures sent to a retry tier, by tier.
    pub retried: IntCounterVec,
    /// Events sent to the dead-letter queue, by reason.
    pub dead_lettered: IntCounterVec,
    /// Orders parked behind a dead-lettered event.
    pub parked_orders: IntGauge,
    /// Messages waiting in the dead-letter queue.
    pub dlq_depth: IntGauge,
    /// Time in the domain handler.
    pub handler_seconds: Histogram,
    /// occurred_at -> applied.
    pub lag_seconds: Histogram,
    /// Inbox rows deleted by cleanup.
    pub inbox_cleaned: IntCounter,
    /// Inbox cleanup runs that failed (the rows stay until a later run).
    pub inbox_cleanup_failures: IntCounter,
    /// When this instance last completed an inbox cleanup run (Unix
    /// seconds; 0: never): a failing or dead cleanup shows as a value that
    /// stops moving while the inbox grows (alert ConsumerInboxCleanupStalled).
    pub inbox_cleanup_last_success: Gauge,
    /// Events of tenants outside `consumer.only_tenants`, acknowledged unapplied.
    pub filtered: IntCounter,
    /// Messages whose acknowledgement has been written to the broker's socket
    /// (a cumulative ack counts every message it covers). Settled minus this
    /// is what a crash now would redeliver as duplicates.
    pub acknowledged: IntCounter,
    /// Messages processed again in place because the database failed for
    /// the infrastructure's reasons (not counted as attempts). Rising for
    /// minutes means a partition is stuck on its database: nothing else
    /// shows it (no event is applied, so the lag is not even measured).
    pub retried_in_place: IntCounter,
}

fn opts(name: &str, help: &str, consumer: &str) -> Opts {
    Opts::new(name, help).const_label("consumer", consumer)
}

impl Metrics {
    /// Register the consumer's metrics; the labelled series that alerts rate()
    /// over (retry tiers, dead-letter reasons) start at zero rather than absent.
    pub fn new(
        registry: &Registry,
        consumer: &str,
        tiers: usize,
    ) -> Result<Self, prometheus::Error> {
        let metrics = Self {
            applied: IntCounterVec::new(
                opts(
                    "consumer_events_applied_total",
                    "Events applied, by event type",
                    consumer,
                ),
                &["event_type"],
            )?,
            duplicates: IntCounter::with_opts(opts(
                "consumer_duplicates_total",
                "Duplicate deliveries recognised by the inbox",
                consumer,
            ))?,
            stale: IntCounter::with_opts(opts(
                "consumer_stale_total",
                "Events at or below the order's last applied sequence",
                consumer,
            ))?,
            deferred: IntCounter::with_opts(opts(
                "consumer_deferred_total",
                "Events deferred because they arrived ahead of a predecessor",
                consumer,
            ))?,
            retried: IntCounterVec::new(
                opts(
                    "consumer_retried_total",
                    "Handler failures sent to a retry tier",
                    consumer,
                ),
                &["tier"],
            )?,
            dead_lettered: IntCounterVec::new(
                opts(
                    "consumer_dead_lettered_total",
                    "Events sent to the dead-letter queue, by reason",
                    consumer,
                ),
                &["reason"],
            )?,
            parked_orders: IntGauge::with_opts(opts(
                "consumer_parked_orders",
                "Orders parked behind a dead-lettered event",
                consumer,
            ))?,
            dlq_depth: IntGauge::with_opts(opts(
                "consumer_dlq_messages",
                "Messages in the dead-letter queue",
                consumer,
            ))?,
            handler_seconds: Histogram::with_opts(
                HistogramOpts::new(
                    "consumer_handler_duration_seconds",
                    "Time spent in the domain handler",
                )
                .const_label("consumer", consumer)
                .buckets(vec![
                    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                ]),
            )?,
            lag_seconds: Histogram::with_opts(
                HistogramOpts::new(
                    "consumer_lag_seconds",
                    "From the event's occurred_at to its effect being committed (live events only: not a replayed or redriven copy)",
                )
                .const_label("consumer", consumer)
                .buckets(vec![
                    0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0,
                    7200.0,
                ]),
            )?,
            inbox_cleaned: IntCounter::with_opts(opts(
                "consumer_inbox_cleaned_total",
                "Inbox rows deleted after the replay horizon",
                consumer,
            ))?,
            inbox_cleanup_failures: IntCounter::with_opts(opts(
                "consumer_inbox_cleanup_failures_total",
                "Inbox cleanup runs that failed (retried at the next interval)",
                consumer,
            ))?,
            inbox_cleanup_last_success: Gauge::with_opts(opts(
                "consumer_inbox_cleanup_last_success_timestamp_seconds",
                "When this instance last completed an inbox cleanup run (0: never)",
                consumer,
            ))?,
            filtered: IntCounter::with_opts(opts(
                "consumer_filtered_total",
                "Events of other tenants acknowledged without effect (consumer.only_tenants)",
                consumer,
            ))?,
            acknowledged: IntCounter::with_opts(opts(
                "consumer_messages_acknowledged_total",
                "Messages whose acknowledgement was written to the broker connection",
                consumer,
            ))?,
            retried_in_place: IntCounter::with_opts(opts(
                "consumer_retried_in_place_total",
                "Messages processed again in place because the database was unavailable or a publish of their copy failed",
                consumer,
            ))?,
        };
        for tier in 0..tiers {
            metrics.retried.with_label_values(&[&tier.to_string()]);
        }
        for reason in ["poison", "parked", "max_attempts"] {
            metrics.dead_lettered.with_label_values(&[reason]);
        }
        kit::metrics::register(registry, &metrics.applied);
        kit::metrics::register(registry, &metrics.duplicates);
        kit::metrics::register(registry, &metrics.stale);
        kit::metrics::register(registry, &metrics.deferred);
        kit::metrics::register(registry, &metrics.retried);
        kit::metrics::register(registry, &metrics.dead_lettered);
        kit::metrics::register(registry, &metrics.parked_orders);
        kit::metrics::register(registry, &metrics.dlq_depth);
        kit::metrics::register(registry, &metrics.handler_seconds);
        kit::metrics::register(registry, &metrics.lag_seconds);
        kit::metrics::register(registry, &metrics.inbox_cleaned);
        kit::metrics::register(registry, &metrics.inbox_cleanup_failures);
        kit::metrics::register(registry, &metrics.inbox_cleanup_last_success);
        kit::metrics::register(registry, &metrics.filtered);
        kit::metrics::register(registry, &metrics.acknowledged);
        kit::metrics::register(registry, &metrics.retried_in_place);
        Ok(metrics)
    }
}
