//! The `outbox-relay` command line.

use clap::{Args, Parser, Subcommand};
use kit::migrations::Database;
use time::{format_description::well_known::Rfc3339, OffsetDateTime};
use uuid::Uuid;

use crate::{cleanup, replay, requeue, Application, Settings, SERVICE};

#[derive(Debug, Parser)]
#[command(
    name = "outbox-relay",
    about = "The outbox relay (with no subcommand: serve)"
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Relay outbox rows to the broker (the default).
    Serve,
    /// Apply pending migrations of the `orders` database, then exit.
    Migrate,
    /// Release quarantined outbox rows (after repairing the cause) so they and
    /// the later events of their order flow again.
    Requeue(RequeueArgs),
    /// Delete published rows past the retention horizon once, in batches, then exit.
    Cleanup,
    /// Re-publish the retained, published events (optionally of a time
    /// range, one order or one tenant) to one consumer only, in per-order
    /// sequence order; a replay of everything purges its partition queues
    /// first (a filtered one does not: it would lose what it does not cover).
    Replay(ReplayArgs),
}

#[derive(Debug, Args)]
#[group(required = true, multiple = false)]
struct RequeueArgs {
    /// One quarantined event.
    #[arg(long)]
    event: Option<Uuid>,
    /// Every quarantined event of one order (aggregate id).
    #[arg(long)]
    order: Option<String>,
    /// Every quarantined event (of `relay.only_tenant` when it is set), e.g.
    /// after a broker incident quarantined many orders at once.
    #[arg(long, conflicts_with_all = ["event", "order"])]
    all: bool,
}

#[derive(Debug, Args)]
struct ReplayArgs {
    /// The consumer: its exchange `<name>.events` and queues `<name>.p<i>`.
    #[arg(long)]
    consumer: String,
    /// Only events that occurred at or after this time (RFC 3339).
    #[arg(long, value_parser = parse_time)]
    since: Option<OffsetDateTime>,
    /// Only events that occurred before this time (RFC 3339).
    #[arg(long, value_parser = parse_time)]
    until: Option<OffsetDateTime>,
    /// Only the events of this order (aggregate id).
    #[arg(long)]
    order: Option<String>,
    /// Only this tenant's events (default: `relay.only_tenant`, empty = every tenant).
    #[arg(long)]
    tenant: Option<String>,
    /// Events per database page and per pipelined publish.
    #[arg(long, default_value_t = 500)]
    page_size: i64,
    /// A replay of everything refuses to purge partitions in which messages
    /// wait (one whose outbox row the cleanup deleted would be lost): purge
    /// them anyway.
    #[arg(long)]
    purge_waiting: bool,
}

fn parse_time(value: &str) -> Result<OffsetDateTime, String> {
    let at = OffsetDateTime::parse(value, &Rfc3339)
        .map_err(|e| format!("{value:?} is not an RFC 3339 time: {e}"))?;
    // The database driver sends the time in UTC, and converting one whose
    // UTC falls past year 9999 (9999-12-31T23:59:59-01:00) panics there.
    match at.checked_to_offset(time::UtcOffset::UTC) {
        Some(utc) if (0..=9999).contains(&utc.year()) => Ok(at),
        _ => Err(format!("{value:?} is outside years 0 to 9999 in UTC")),
    }
}

fn consumer_name_ok(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 200
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

pub async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    kit::service_main(SERVICE, |shutdown| async move {
        let settings = Settings::load()?;
        match cli.command.unwrap_or(Command::Serve) {
            Command::Serve => {
                kit::serve(&shutdown, async {
                    let app = Application::build(settings, &shutdown).await?;
                    app.run_until_stopped(shutdown.clone()).await
                })
                .await
            }
            Command::Migrate => {
                let pool = kit::db::pool(&settings.database)?;
                let applied = kit::migrations::run_until(&pool, Database::Orders, &shutdown).await?;
                println!("orders: {} migration(s) applied", applied.len());
                Ok(())
            }
            Command::Requeue(args) => {
                let target = match (args.event, args.order, args.all) {
                    (Some(event), _, _) => requeue::Target::Event(event),
                    (None, Some(order), _) => requeue::Target::Order(order),
                    (None, None, true) => requeue::Target::All {
                        tenant: settings.relay.only_tenant.clone(),
                    },
                    (None, None, false) => anyhow::bail!("give --event, --order or --all"),
                };
                let pool = kit::db::pool(&settings.database)?;
                let (released, held) = requeue::requeue(&pool, &target).await?;
                if released.is_empty() {
                    let why = requeue::describe_unreleased(&pool, &target).await?;
                    // `--all` with nothing quarantined has done its job.
                    if matches!(target, requeue::Target::All { .. }) {
                        println!("{why}: nothing to release");
                        return Ok(());
                    }
                    anyhow::bail!("nothing released for {target:?}: {why}");
                }
                for r in &released {
                    println!(
                        "released event {} ({} #{} of order {}), quarantined at {} after {} attempt(s); last error: {}",
                        r.event_id,
                        r.event_type,
                        r.aggregate_sequence,
                        r.aggregate_id,
                        r.quarantined_at.format(&Rfc3339).unwrap_or_default(),
                        r.attempt_count,
                        r.last_error.as_deref().unwrap_or("-"),
                    );
                }
                println!(
                    "released {} event(s); {} later event(s) of the same order(s) follow in sequence",
                    released.len(),
                    held
                );
                Ok(())
            }
            Command::Cleanup => {
                let report = cleanup::run_once(
                    &settings.database.url,
                    &cleanup::application_name("admin"),
                    &settings.cleanup,
                    &shutdown,
                    |_| {},
                )
                .await?;
                if report.locked_out {
                    println!("another instance is cleaning up; nothing done");
                } else {
                    println!(
                        "deleted {} published row(s) older than {} s in {} batch(es) of at most {}",
                        report.deleted,
                        settings.cleanup.horizon_secs(),
                        report.batches,
                        settings.cleanup.batch_size
                    );
                }
                // A signal ends the run between batches: what is past the
                // horizon is not all deleted (status 1; run it again).
                anyhow::ensure!(
                    !report.stopped_early,
                    "stopped by a signal before the end: run it again for the rest"
                );
                Ok(())
            }
            Command::Replay(args) => {
                anyhow::ensure!(
                    consumer_name_ok(&args.consumer),
                    "bad consumer name {:?}",
                    args.consumer
                );
                anyhow::ensure!(args.page_size >= 1, "--page-size must be at least 1");
                if let (Some(since), Some(until)) = (args.since, args.until) {
                    anyhow::ensure!(since < until, "--since must be before --until");
                }
                let pool = kit::db::pool(&settings.database)?;
                let request = replay::ReplayRequest {
                    consumer: args.consumer,
                    since: args.since,
                    until: args.until,
                    order: args.order,
                    only_tenant: args
                        .tenant
                        .unwrap_or_else(|| settings.relay.only_tenant.clone()),
                    page_size: args.page_size,
                    confirm_timeout: settings.relay.confirm_timeout(),
                    max_message_bytes: settings.relay.max_message_bytes,
                    purge_waiting: args.purge_waiting,
                    horizon_secs: settings.cleanup.horizon_secs(),
                };
                let summary = replay::replay(&pool, &settings.amqp, &request, &shutdown).await?;
                let purged = if summary.purged_queues {
                    format!("purged {} message(s) from", summary.purged)
                } else {
                    "purged nothing from (a filtered replay)".to_owned()
                };
                println!(
                    "replay of {}: {purged} {} partition(s) ({}), re-published {} event(s) of {} order(s)",
                    request.consumer,
                    summary.partitions.len(),
                    summary.partitions.join(", "),
                    summary.republished,
                    summary.orders
                );
                if summary.skipped > 0 {
                    println!(
                        "skipped {} in-flight event(s) that were never published and cannot be \
                         sent (listed above; the relay quarantines them)",
                        summary.skipped
                    );
                }
                Ok(())
            }
        }
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::parse_time;

    #[test]
    fn a_replay_window_past_the_drivers_range_is_a_usage_error() {
        assert!(parse_time("9999-12-31T22:59:59-01:00").is_ok());
        let error = parse_time("9999-12-31T23:59:59-01:00").expect_err("year 10000 in UTC");
        assert!(error.contains("outside years 0 to 9999"), "{error}");
        assert!(parse_time("0000-01-01T00:00:00+01:00").is_err());
        assert!(parse_time("yesterday").is_err());
    }
}
