//! Telemetry, set up once per process by [`init`].
//!
//! - Logs: `tracing` with JSON lines on stderr (stdout is left to command output) (`LOG_FORMAT=text` for
//!   human-readable lines, as `make run` uses), filtered by `RUST_LOG`
//!   (default `info`).
//! - Traces: an OpenTelemetry SDK tracer provider is always installed, so spans
//!   carry W3C trace context that can be stored (outbox `traceparent`) and
//!   propagated (AMQP headers). Spans are exported over OTLP/HTTP only when
//!   `OTEL_EXPORTER_OTLP_ENDPOINT` (or `..._TRACES_ENDPOINT`) is set; the other
//!   standard `OTEL_*` variables apply (`OTEL_SERVICE_NAME` overrides the name,
//!   `OTEL_BSP_SCHEDULE_DELAY` / `OTEL_BSP_MAX_EXPORT_BATCH_SIZE` tune the batch
//!   exporter; the protocol is `http/protobuf`). Pending spans are flushed when
//!   the [`TelemetryGuard`] is dropped at the end of `main`. [`exporting`]
//!   tells a hot path whether its spans would be seen at all (the relay skips
//!   its per-message span when not, and forwards the stored context).
//! - The log filter (`RUST_LOG`) applies to the log lines only: spans reach
//!   the OpenTelemetry layer at INFO whatever `RUST_LOG` says (noisy
//!   dependencies excluded; `OTEL_TRACES_FILTER` overrides, in `RUST_LOG`
//!   syntax), so the trace context stored and propagated never depends on the
//!   log level.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};

use opentelemetry::{propagation::TextMapPropagator, trace::TracerProvider as _};
use opentelemetry_sdk::{propagation::TraceContextPropagator, trace::SdkTracerProvider, Resource};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::{
    filter::{filter_fn, FilterExt, LevelFilter},
    layer::SubscriberExt,
    util::SubscriberInitExt,
    EnvFilter, Layer,
};

static EXPORTING: AtomicBool = AtomicBool::new(false);

/// Whether spans leave the process (an OTLP endpoint is configured and the
/// exporter started). Without it a span only serves the trace context it
/// carries; a hot path whose span nobody would see can skip it and forward
/// the context it received instead.
pub fn exporting() -> bool {
    EXPORTING.load(Ordering::Relaxed)
}

/// Keeps the tracer provider alive; flushes pending spans when dropped.
pub struct TelemetryGuard {
    provider: SdkTracerProvider,
}

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        // Within the second or two a stop keeps for the rest after its
        // drain (the SDK's default waits 5 s for a slow collector, which
        // could take a stop past its grace: exit 1, the spans lost all the
        // same).
        if let Err(error) = self
            .provider
            .shutdown_with_timeout(std::time::Duration::from_secs(1))
        {
            eprintln!("telemetry shutdown: {error}");
        }
    }
}

/// Spans (and the events inside them) the OpenTelemetry layer records:
/// the services' own at INFO; the libraries' (including the exporter's own
/// HTTP client, which would otherwise trace its exports) off.
const TRACE_FILTER: &str = "info,lapin=off,tokio_postgres=off,deadpool=off,refinery=off,\
actix_server=off,actix_http=off,h2=off,hyper=off,hyper_util=off,reqwest=off,\
opentelemetry=off,opentelemetry_sdk=off,opentelemetry_otlp=off,opentelemetry_http=off";

/// The OTLP endpoint spans go to, if one is configured: the traces
/// endpoint wins over the general one.
fn otlp_endpoint() -> Option<String> {
    [
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
    ]
    .iter()
    .filter_map(|name| std::env::var(name).ok())
    .find(|endpoint| !endpoint.trim().is_empty())
}

/// Install logging and tracing for `service`. Call once, early in `main`.
pub fn init(service: &'static str) -> TelemetryGuard {
    let mut resource = Resource::builder();
    if std::env::var("OTEL_SERVICE_NAME").is_err() {
        resource = resource.with_service_name(service);
    }
    let mut provider = SdkTracerProvider::builder().with_resource(resource.build());
    let mut export_error = None;
    let endpoint = otlp_endpoint();
    let https = endpoint
        .as_deref()
        .filter(|endpoint| endpoint.trim().to_ascii_lowercase().starts_with("https:"));
    if let Some(endpoint) = https {
        // The exporter's HTTP client is built without TLS (no TLS stack in
        // the images): every export would fail. Say so once, at start-up.
        export_error = Some(format!(
            "OTLP endpoint {endpoint}: https is not supported by this build; \
             send to an http:// collector (e.g. a local OpenTelemetry Collector that forwards over TLS)"
        ));
    } else if endpoint.is_some() {
        match opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .build()
        {
            Ok(exporter) => provider = provider.with_batch_exporter(exporter),
            Err(error) => export_error = Some(error.to_string()),
        }
    }
    let provider = provider.build();
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    opentelemetry::global::set_tracer_provider(provider.clone());
    let tracer = provider.tracer(service);

    let filter = client_faults_unlogged(never_logged(filter_of(
        std::env::var("RUST_LOG").ok(),
        "info,lapin=error,actix_server=warn,tokio_postgres=warn",
    )))
    .and(not_never_logged());
    // Without an exporter the spans only carry the trace context (stored and
    // propagated): log events are not recorded into them.
    let exporting = endpoint.is_some() && export_error.is_none();
    EXPORTING.store(exporting, Ordering::Relaxed);
    // The closure filters by kind, not level: its level hint is TRACE, so the
    // combined hint is the EnvFilter's. Without a hint the subscriber's
    // maximum level was unknown, i.e. TRACE, and so was the `log` crate's
    // (tracing-log sets it from that hint): every `log::debug!` of
    // tokio-postgres, per statement, went through the bridge and every
    // layer's filter before being dropped.
    let trace_filter = never_logged(filter_of(
        std::env::var("OTEL_TRACES_FILTER").ok(),
        TRACE_FILTER,
    ))
    .and(not_never_logged())
    .and(
        filter_fn(move |metadata| exporting || metadata.is_span())
            .with_max_level_hint(LevelFilter::TRACE),
    );
    let text = std::env::var("LOG_FORMAT").is_ok_and(|f| f.eq_ignore_ascii_case("text"));
    let fmt_layer = if text {
        tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_target(false)
            .boxed()
    } else {
        tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_span_list(false)
            .boxed()
    };
    let init = tracing_subscriber::registry()
        .with(fmt_layer.with_filter(filter))
        .with(
            tracing_opentelemetry::layer()
                .with_tracer(tracer)
                // No busy/idle timing on every poll of an instrumented future.
                .with_tracked_inactivity(false)
                .with_filter(trace_filter),
        )
        .try_init();
    if let Err(error) = init {
        eprintln!("telemetry already initialised: {error}");
    }
    if let Some(error) = export_error {
        tracing::error!(%error, "OTLP exporter not started; spans are not exported");
    }
    tracing::info!(service, otlp_export = exporting, "telemetry ready");
    TelemetryGuard { provider }
}

/// A `RUST_LOG`-style filter from `value`: unset or blank, `default`
/// (before, a blank `RUST_LOG=` logged nothing at all, errors included);
/// otherwise its directives, each invalid one ignored with a line on stderr
/// naming it and the valid ones kept (before, one invalid directive, say
/// `lapin=warning`, silently replaced them all by the default), and
/// `default` when none is valid.
fn filter_of(value: Option<String>, default: &str) -> EnvFilter {
    // Each directive trimmed (a trailing space or newline from an env
    // file would make it invalid), empty ones dropped.
    let value = value
        .unwrap_or_default()
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .collect::<Vec<_>>()
        .join(",");
    if value.is_empty() {
        return EnvFilter::new(default);
    }
    let valid = value
        .split(',')
        .filter(|d| d.parse::<tracing_subscriber::filter::Directive>().is_ok())
        .count();
    if valid == 0 {
        eprintln!("no valid directive in {value:?}: logging with {default:?}");
        return EnvFilter::new(default);
    }
    EnvFilter::builder().parse_lossy(value)
}

/// Targets never logged (nor recorded into spans), whatever `RUST_LOG` or
/// `OTEL_TRACES_FILTER` say: at DEBUG, tokio-postgres logs every statement
/// with its bound parameters (`query`: idempotency keys, customer ids, event
/// payloads, stored responses) and every simple query's text, which may
/// hold literal values. Logs never contain request bodies tied to a key
/// (DESIGN.md section 5); the statements' SQL text alone stays available
/// (`tokio_postgres::prepare`). These targets log nothing else.
const NEVER_LOGGED: [&str; 2] = [
    "tokio_postgres::query=off",
    "tokio_postgres::simple_query=off",
];

/// `filter` with [`NEVER_LOGGED`] added (replacing any directive of the
/// same target it has).
fn never_logged(filter: EnvFilter) -> EnvFilter {
    NEVER_LOGGED.iter().fold(filter, |filter, directive| {
        filter.add_directive(directive.parse().expect("a valid directive"))
    })
}

/// [`NEVER_LOGGED`]'s targets refused by a filter of their own, combined
/// with the `EnvFilter`: its directives alone did not hold, since a span
/// directive (`RUST_LOG=info,[order_operation]=debug`) enables every event
/// inside its span before the plain directives are consulted, so the
/// statements' parameters were logged there. The level hint is TRACE (the
/// combined hint stays the `EnvFilter`'s).
fn not_never_logged<S>() -> impl tracing_subscriber::layer::Filter<S> {
    filter_fn(|metadata| {
        !NEVER_LOGGED
            .iter()
            .any(|directive| directive.strip_suffix("=off") == Some(metadata.target()))
    })
    .with_max_level_hint(LevelFilter::TRACE)
}

/// actix-http's connection dispatcher logs at ERROR what a client's bytes
/// cause before any route runs (`stream error: request parse error`: a
/// malformed header, `Content-Length: abc`; answered 400 by actix itself),
/// so any client could fill the logs with ERROR lines at will, and fire
/// whatever watches them. Off unless `RUST_LOG` names `actix_http` (to
/// debug a client's framing).
const CLIENT_FAULTS: &str = "actix_http::h1::dispatcher=off";

/// refinery logs at ERROR each applied migration the binary does not have
/// ("missing from the filesystem"): in a rolling deploy or a rollback, an
/// older instance's every start, which a deploy must not show as errors.
/// `kit::migrations` says it at INFO instead. Off unless `RUST_LOG` names
/// `refinery`.
const NEWER_MIGRATIONS: &str = "refinery_core::traits::missing=off";

/// `filter` with [`CLIENT_FAULTS`] and [`NEWER_MIGRATIONS`] added, each
/// unless `RUST_LOG` names its crate.
fn client_faults_unlogged(filter: EnvFilter) -> EnvFilter {
    let spec = std::env::var("RUST_LOG").unwrap_or_default();
    [
        (CLIENT_FAULTS, "actix_http"),
        (NEWER_MIGRATIONS, "refinery"),
    ]
    .into_iter()
    .filter(|(_, named)| !spec.contains(named))
    .fold(filter, |filter, (directive, _)| {
        filter.add_directive(directive.parse().expect("a valid directive"))
    })
}

/// W3C trace-context headers (`traceparent`, and `tracestate` when non-empty)
/// of `span`, to store with an outbox row or send with a message.
pub fn trace_headers(span: &tracing::Span) -> HashMap<String, String> {
    let mut carrier = HashMap::new();
    TraceContextPropagator::new().inject_context(&span.context(), &mut carrier);
    // The propagator writes an empty `tracestate` when there is none.
    carrier.retain(|_, value| !value.is_empty());
    carrier
}

/// The W3C headers of the remote context carried by `traceparent` /
/// `tracestate`, as the propagator reads them: empty for a missing or
/// invalid `traceparent`, normalised otherwise. For when the local span
/// records no context (turned off by `OTEL_TRACES_FILTER`): the caller's
/// own context is then stored and forwarded instead of none.
pub fn remote_trace_headers(
    traceparent: Option<&str>,
    tracestate: Option<&str>,
) -> HashMap<String, String> {
    let mut carrier = HashMap::new();
    if let Some(context) = remote_context(traceparent, tracestate) {
        TraceContextPropagator::new().inject_context(&context, &mut carrier);
        carrier.retain(|_, value| !value.is_empty());
    }
    carrier
}

/// The remote context of `traceparent` / `tracestate` as the propagator
/// reads it (`None` without a `traceparent`).
fn remote_context(
    traceparent: Option<&str>,
    tracestate: Option<&str>,
) -> Option<opentelemetry::Context> {
    let traceparent = traceparent?;
    let mut carrier = HashMap::new();
    carrier.insert(
        events::headers::TRACEPARENT.to_owned(),
        traceparent.to_owned(),
    );
    if let Some(state) = tracestate {
        carrier.insert(events::headers::TRACESTATE.to_owned(), state.to_owned());
    }
    Some(TraceContextPropagator::new().extract(&carrier))
}

/// Make `span` a child of the remote context carried by `traceparent` /
/// `tracestate` (a malformed or missing header leaves the span a root).
pub fn set_remote_parent(
    span: &tracing::Span,
    traceparent: Option<&str>,
    tracestate: Option<&str>,
) {
    let Some(context) = remote_context(traceparent, tracestate) else {
        return;
    };
    if let Err(error) = span.set_parent(context) {
        tracing::debug!(?error, "could not set the remote parent");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_blank_or_invalid_filter_falls_back_and_a_partly_invalid_one_keeps_the_valid() {
        let default = "info,lapin=error";
        let of = |value: Option<&str>| filter_of(value.map(str::to_owned), default).to_string();
        let expected = EnvFilter::new(default).to_string();
        assert_eq!(of(None), expected);
        assert_eq!(of(Some("")), expected, "blank: the default, not nothing");
        assert_eq!(of(Some("  ")), expected);
        assert_eq!(of(Some("lapin=warning")), expected, "nothing valid");
        assert_eq!(
            of(Some("debug,lapin=warning")),
            EnvFilter::new("debug").to_string(),
            "the valid directive kept"
        );
        assert_eq!(
            of(Some("warn,outbox_relay=debug")),
            EnvFilter::new("warn,outbox_relay=debug").to_string()
        );
        assert_eq!(
            of(Some(" warn, outbox_relay=debug \n")),
            EnvFilter::new("warn,outbox_relay=debug").to_string(),
            "white space around directives"
        );
    }

    #[test]
    fn a_remote_context_is_kept_when_valid_and_dropped_when_not() {
        let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let headers = remote_trace_headers(Some(traceparent), Some("vendor=1"));
        assert_eq!(
            headers.get("traceparent").map(String::as_str),
            Some(traceparent)
        );
        assert_eq!(
            headers.get("tracestate").map(String::as_str),
            Some("vendor=1")
        );
        for invalid in [
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "not a traceparent",
        ] {
            assert!(
                remote_trace_headers(Some(invalid), None).is_empty(),
                "{invalid}"
            );
        }
        assert!(remote_trace_headers(None, Some("vendor=1")).is_empty());
    }
}
