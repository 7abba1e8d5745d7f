//! order-api metrics (Prometheus names; rendered at `/metrics`).

use kit::metrics::prometheus::{Gauge, IntCounter, IntCounterVec, IntGauge, Opts, Registry};

#[derive(Clone)]
pub struct Metrics {
    pub registry: Registry,
    /// Requests that won the idempotency key and executed (by endpoint).
    pub claims: IntCounterVec,
    /// Requests answered from a stored response.
    pub replays: IntCounterVec,
    /// Key reused with a different fingerprint (409 idempotency_key_reused).
    pub key_conflicts: IntCounterVec,
    /// 409 idempotency_in_progress: the bounded wait on the winner ran out
    /// (or, hardly ever, the record vanished twice under the request).
    pub in_progress: IntCounterVec,
    /// Owner transactions rolled back by an infrastructure failure (nothing stored).
    pub rollbacks: IntCounterVec,
    /// Owner transactions whose COMMIT got no answer, or failed without
    /// saying it rolled back: maybe stored (a retry under the same key
    /// replays it if so).
    pub commit_unknown: IntCounterVec,
    /// Business rejections (by code): final ones are stored with the key and
    /// replayed; `order_not_paid` is answered without being stored.
    pub rejections: IntCounterVec,
    /// Expired idempotency rows deleted by the cleanup task.
    pub expired_deleted: IntCounter,
    /// Cleanup runs that failed (the database unreachable, a lock held past
    /// `lock_timeout`): expired keys stay until a later run deletes them.
    pub cleanup_failures: IntCounter,
    /// When this instance last completed a cleanup run (Unix seconds; 0:
    /// never): a stalled or dead cleanup task shows as a value that stops
    /// moving (alert IdempotencyCleanupStalled).
    pub cleanup_last_success: Gauge,
    /// Age of the oldest owner transaction still running in this process.
    pub oldest_incomplete_key_seconds: IntGauge,
}

/// The idempotent endpoints: their series start at zero (present before the
/// first event, so `rate()` and `absent()` see them).
const ENDPOINTS: [&str; 3] = [
    "POST /orders",
    "POST /orders/{id}/payments",
    "POST /orders/{id}/deliveries",
];

fn counter_vec(registry: &Registry, name: &str, help: &str, label: &str) -> IntCounterVec {
    let counter = IntCounterVec::new(Opts::new(name, help), &[label]).expect("valid metric");
    if label == "endpoint" {
        for endpoint in ENDPOINTS {
            counter.with_label_values(&[endpoint]);
        }
    }
    kit::metrics::register(registry, &counter);
    counter
}

impl Metrics {
    pub fn new(service: &str) -> Self {
        let registry = kit::metrics::registry(service);
        let expired_deleted = IntCounter::new(
            "idempotency_expired_keys_deleted_total",
            "Expired idempotency keys deleted by the cleanup task",
        )
        .expect("valid metric");
        kit::metrics::register(&registry, &expired_deleted);
        let cleanup_failures = IntCounter::new(
            "idempotency_cleanup_failures_total",
            "Runs of the expired-key cleanup that failed (retried at the next interval)",
        )
        .expect("valid metric");
        kit::metrics::register(&registry, &cleanup_failures);
        let cleanup_last_success = Gauge::new(
            "idempotency_cleanup_last_success_timestamp_seconds",
            "When this instance last completed a run of the expired-key cleanup (0: never)",
        )
        .expect("valid metric");
        kit::metrics::register(&registry, &cleanup_last_success);
        let oldest = IntGauge::new(
            "idempotency_oldest_incomplete_key_seconds",
            "Age of the oldest idempotency key whose owning transaction is still running here",
        )
        .expect("valid metric");
        kit::metrics::register(&registry, &oldest);
        Self {
            claims: counter_vec(
                &registry,
                "idempotency_claims_total",
                "Idempotency keys claimed (operation executed)",
                "endpoint",
            ),
            replays: counter_vec(
                &registry,
                "idempotency_replays_total",
                "Responses replayed from a stored idempotency record",
                "endpoint",
            ),
            key_conflicts: counter_vec(
                &registry,
                "idempotency_key_conflicts_total",
                "Idempotency keys reused with a different request",
                "endpoint",
            ),
            in_progress: counter_vec(
                &registry,
                "idempotency_in_progress_total",
                "Requests answered idempotency_in_progress (the wait for the key's owner ran out, or its record was deleted meanwhile)",
                "endpoint",
            ),
            rollbacks: counter_vec(
                &registry,
                "idempotency_rollbacks_total",
                "Owner transactions rolled back by an infrastructure failure",
                "endpoint",
            ),
            commit_unknown: counter_vec(
                &registry,
                "idempotency_commit_outcome_unknown_total",
                "Owner transactions whose COMMIT got no answer or failed without saying it rolled back (maybe stored; a retry under the same key replays it if so)",
                "endpoint",
            ),
            rejections: counter_vec(
                &registry,
                "order_business_rejections_total",
                "Business rejections (final ones stored and replayed; order_not_paid and a delivered_at in the future, counted as validation_failed, not stored)",
                "code",
            ),
            expired_deleted,
            cleanup_failures,
            cleanup_last_success,
            oldest_incomplete_key_seconds: oldest,
            registry,
        }
    }
}
