//! `drift-check [--tenant T] [--grace-seconds N (60)]`: exits 0 on zero drift,
//! 1 on any drift, 2 when it cannot run (or `--tenant` names a tenant with
//! nothing in any database).

use std::time::Duration;

use clap::Parser;

#[derive(Parser)]
#[command(about = "Compare the four databases (read-only) and report drift per tenant")]
struct Cli {
    /// Only this tenant.
    #[arg(long)]
    tenant: Option<String>,
    /// Skip orders changed in the last N seconds (their events may be in
    /// flight). The default fits a running system, where an order's effects
    /// follow its commit by milliseconds, and an event still unpublished a
    /// minute after its commit is what OutboxOldestPendingTooOld watches; 0
    /// checks every order (a system at rest, or a test).
    /// At most a century (further back than PostgreSQL's timestamps reach
    /// makes the check's statement fail).
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(..=3_153_600_000))]
    grace_seconds: u64,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    kit::failpoint::init_from_env();
    let databases = ops::drift::Databases::from_env();
    match ops::drift::check(
        &databases,
        cli.tenant.as_deref(),
        Duration::from_secs(cli.grace_seconds),
    )
    .await
    {
        Ok(report) => {
            if let Some(tenant) = cli.tenant.as_deref() {
                if report.tenants.is_empty() && report.is_clean() {
                    // A misspelt tenant, or the wrong databases: nothing
                    // compared is not "zero drift" (not even printed as such).
                    eprintln!(
                        "drift-check: nothing of tenant {tenant} in any database: nothing was compared"
                    );
                    return std::process::ExitCode::from(2);
                }
            }
            ops::drift::print(&report);
            if report.is_clean() {
                std::process::ExitCode::SUCCESS
            } else {
                std::process::ExitCode::from(1)
            }
        }
        Err(error) => {
            eprintln!("drift-check failed: {error:#}");
            std::process::ExitCode::from(2)
        }
    }
}
