//! tokio-postgres's statement logs (their bound parameters: idempotency
//! keys, customer ids, payloads) stay off inside a span that a span
//! directive of `RUST_LOG` turns up: such a directive enables every event in
//! its span before the plain directives (`tokio_postgres::query=off`) are
//! consulted. The logging runs in a child process (this test binary again,
//! `init` installs the global subscriber once per process), whose stderr is
//! read: what was written, not what a filter says it would let through.

use std::process::Command;

const CHILD: &str = "KIT_TELEMETRY_SPAN_FILTER_CHILD";

#[test]
fn a_span_directive_does_not_let_the_statements_parameters_through() {
    let output = Command::new(std::env::current_exe().expect("this test binary"))
        .args([
            "--exact",
            "child_logs_in_and_out_of_the_span",
            "--nocapture",
        ])
        .env(CHILD, "1")
        .env("RUST_LOG", "info,[leaky_operation]=trace")
        .env("LOG_FORMAT", "text")
        .env_remove("OTEL_TRACES_FILTER")
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .output()
        .expect("run the child");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    // The directive works (so the absences below are not for want of it).
    assert!(stderr.contains("app-debug-inside"), "{stderr}");
    assert!(!stderr.contains("app-debug-outside"), "{stderr}");
    // The statements' SQL text stays available.
    assert!(stderr.contains("prepare-text"), "{stderr}");
    for secret in ["query-parameters", "simple-query-text"] {
        assert!(!stderr.contains(secret), "{secret} logged: {stderr}");
    }
}

/// The child's part (does nothing in the test run itself).
#[test]
fn child_logs_in_and_out_of_the_span() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    let _guard = kit::telemetry::init("telemetry-span-filter-test");
    log::debug!(target: "app_module", "app-debug-outside");
    let span = tracing::info_span!("leaky_operation");
    let _entered = span.enter();
    log::debug!(target: "app_module", "app-debug-inside");
    log::debug!(target: "tokio_postgres::query", "query-parameters");
    log::debug!(target: "tokio_postgres::simple_query", "simple-query-text");
    log::debug!(target: "tokio_postgres::prepare", "prepare-text");
}
