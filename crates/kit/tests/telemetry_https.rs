//! An https OTLP endpoint is refused at start-up (the exporter's HTTP client
//! has no TLS): spans are not exported, and the service says so once,
//! instead of failing every export. A process of its own: `init` installs
//! the global subscriber once.

#[test]
fn an_https_otlp_endpoint_is_not_exported_to() {
    std::env::remove_var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT");
    std::env::set_var(
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "https://collector.example:4318",
    );
    let _guard = kit::telemetry::init("telemetry-https-test");
    assert!(!kit::telemetry::exporting());
}
