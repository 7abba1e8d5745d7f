//! Prometheus metrics. Each service owns one [`prometheus::Registry`] (never the
//! global default registry, so several services can live in one test process)
//! and registers its collectors there; `/metrics` renders it.

use prometheus::{Encoder, Registry, TextEncoder};

pub use prometheus;

/// A registry whose metrics all carry the `service` label.
pub fn registry(service: &str) -> Registry {
    let labels = std::iter::once(("service".to_owned(), service.to_owned())).collect();
    Registry::new_custom(None, Some(labels)).unwrap_or_default()
}

/// Register a collector, logging (not panicking) on a duplicate registration.
pub fn register<C: prometheus::core::Collector + Clone + 'static>(
    registry: &Registry,
    collector: &C,
) {
    if let Err(error) = registry.register(Box::new(collector.clone())) {
        tracing::error!(%error, "metric registration failed");
    }
}

/// Render the registry in the Prometheus text exposition format.
pub fn render(registry: &Registry) -> String {
    let mut buffer = Vec::new();
    if let Err(error) = TextEncoder::new().encode(&registry.gather(), &mut buffer) {
        tracing::error!(%error, "encoding metrics");
    }
    String::from_utf8(buffer).unwrap_or_default()
}

/// Seconds since the Unix epoch now: the value of a `*_timestamp_seconds`
/// gauge (e.g. a cleanup's last success).
pub fn unix_now() -> f64 {
    unix_seconds(std::time::SystemTime::now())
}

/// Seconds since the Unix epoch at `at` (0 before it).
pub fn unix_seconds(at: std::time::SystemTime) -> f64 {
    at.duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}
