//! `check-invariants [--tenant T] [--consumer KIND=NAME]... [--wait-seconds N]
//! [--relay-metrics URL]... [--consumer-metrics NAME=URL]...`
//!
//! Checks the six invariants of DESIGN.md section 12 (see
//! `ops::invariants`) over the four databases, read-only, and prints a
//! summary: events, duplicates published and suppressed (when metrics
//! endpoints are given), lost (must be 0), double effects, ordering
//! violations, drift. Exits 0 when every invariant holds, 1 on any
//! violation, 2 when it cannot run.
//!
//! Its checks read the outbox and inbox rows, which the relay's and the
//! consumers' cleanups delete past their horizons (7 and 8 days by
//! default): an order older than that is reported as broken. Run it over a
//! tenant whose orders are all younger (a test, a soak, a staging run).

use std::time::Duration;

use clap::Parser;
use ops::invariants::{self, Kind, Scope};

#[derive(Parser)]
#[command(
    about = "Check the outbox invariants (read-only); exit 1 on any violation",
    long_about = "Check the outbox invariants (read-only); exit 1 on any violation.\n\n\
        The checks read the outbox and inbox rows, which the relay's and the consumers' \
        cleanups delete past their horizons (7 and 8 days by default): an order older than \
        that is reported as broken. Run it over a tenant whose orders are all younger \
        (a test, a soak, a staging run)."
)]
struct Cli {
    /// Only this tenant (recommended: every tenant's orders must have been
    /// consumed by the consumers named here).
    #[arg(long)]
    tenant: Option<String>,
    /// A consumer's name, e.g. `inventory=inventory-eu` (default: the
    /// default names inventory, ledger, loyalty).
    #[arg(long = "consumer", value_name = "KIND=NAME")]
    consumers: Vec<String>,
    /// Poll until every invariant holds or this many seconds have passed
    /// (the system may still be draining); at most a day.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(..=86_400))]
    wait_seconds: u64,
    /// A relay's /metrics URL: its republished messages are reported
    /// (outbox_expired_claims_total, leases taken over, and
    /// outbox_mark_lost_total, confirmed but not marked).
    #[arg(long = "relay-metrics", value_name = "URL")]
    relay_metrics: Vec<String>,
    /// A consumer's /metrics URL, e.g. `ledger=http://127.0.0.1:8082/metrics`:
    /// its suppressed duplicates are reported.
    #[arg(long = "consumer-metrics", value_name = "NAME=URL")]
    consumer_metrics: Vec<String>,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let mut scope = Scope::tenant(cli.tenant.as_deref().unwrap_or_default());
    scope.tenant = cli.tenant.clone();
    for spec in &cli.consumers {
        let Some((kind, name)) = spec.split_once('=') else {
            eprintln!("--consumer {spec}: expected KIND=NAME");
            return std::process::ExitCode::from(2);
        };
        let Some(kind) = Kind::parse(kind) else {
            eprintln!("--consumer {spec}: kind must be inventory, ledger or loyalty");
            return std::process::ExitCode::from(2);
        };
        scope = scope.with_consumer(kind, name);
    }
    let databases = ops::drift::Databases::from_env();
    let mut report =
        match invariants::check_until(&databases, &scope, Duration::from_secs(cli.wait_seconds))
            .await
        {
            Ok(report) => report,
            Err(error) => {
                eprintln!("check-invariants failed: {error:#}");
                return std::process::ExitCode::from(2);
            }
        };
    // A figure is reported only when every endpoint it sums answered: a
    // relay that did not is no measured 0 ("n/a", and a warning).
    if !cli.relay_metrics.is_empty() {
        let mut total = Some(0);
        for url in &cli.relay_metrics {
            let value = invariants::scrape(
                url,
                &["outbox_expired_claims_total", "outbox_mark_lost_total"],
            )
            .await;
            if value.is_none() {
                eprintln!("check-invariants: --relay-metrics {url}: no metrics read");
            }
            total = total.zip(value).map(|(total, value)| total + value);
        }
        report.duplicates_published = total;
    }
    for spec in &cli.consumer_metrics {
        let Some((name, url)) = spec.split_once('=') else {
            eprintln!("--consumer-metrics {spec}: expected NAME=URL");
            return std::process::ExitCode::from(2);
        };
        let Some(consumer) = report.consumers.iter_mut().find(|c| c.name == name) else {
            eprintln!(
                "--consumer-metrics {spec}: no consumer named {name} is checked (--consumer)"
            );
            return std::process::ExitCode::from(2);
        };
        let value =
            invariants::scrape(url, &["consumer_duplicates_total", "consumer_stale_total"]).await;
        if value.is_none() {
            eprintln!("check-invariants: --consumer-metrics {spec}: no metrics read");
        }
        consumer.duplicates_suppressed = value;
    }
    print!("{}", report.render());
    if cli.tenant.is_some()
        && report.orders == 0
        && report.events == 0
        && report.drift.tenants.is_empty()
        && report.is_clean()
    {
        // A misspelt tenant, or the wrong database: nothing checked is not
        // "every invariant holds".
        eprintln!(
            "check-invariants: no order and no event of tenant {} in scope: nothing was checked",
            cli.tenant.as_deref().unwrap_or_default()
        );
        return std::process::ExitCode::from(2);
    }
    if report.is_clean() {
        println!("every invariant holds");
        std::process::ExitCode::SUCCESS
    } else {
        println!("INVARIANTS VIOLATED");
        std::process::ExitCode::from(1)
    }
}
