//! The installed subscriber states its maximum level, so that the `log`
//! crate's records below it (tokio-postgres logs each statement at debug)
//! are dropped at the level check instead of going through tracing-log and
//! every layer's filter. A process of its own: `init` installs the global
//! subscriber once.

#[test]
fn the_default_filters_cap_tracing_and_log_at_info() {
    std::env::remove_var("RUST_LOG");
    std::env::remove_var("OTEL_TRACES_FILTER");
    let _guard = kit::telemetry::init("telemetry-level-test");
    assert_eq!(
        tracing::level_filters::LevelFilter::current(),
        tracing::level_filters::LevelFilter::INFO
    );
    assert_eq!(log::max_level(), log::LevelFilter::Info);
    assert!(!log::log_enabled!(target: "tokio_postgres::query", log::Level::Debug));
}
