//! Schema migrations (refinery), embedded from `migrations/<database>/`.
//!
//! Each service migrates its own database at start-up (and `make migrate` runs
//! the same code through each service's `migrate` subcommand). Several instances
//! may start at once, so the run is serialised by a PostgreSQL advisory lock: the
//! crash window "two instances create the same table" does not exist.
//!
//! The consumer databases hold two independent migration sets: the consumer
//! runtime's own tables (inbox and per-order progress; `migrations/consumer-runtime/`,
//! history table `consumer_runtime_schema_history`) and the consumer's domain
//! tables (`migrations/<database>/`, refinery's default history table).

use deadpool_postgres::Pool;
use tokio_util::sync::CancellationToken;

mod embedded {
    pub mod orders {
        refinery::embed_migrations!("../../migrations/orders");
    }
    pub mod consumer_runtime {
        refinery::embed_migrations!("../../migrations/consumer-runtime");
    }
    pub mod inventory {
        refinery::embed_migrations!("../../migrations/inventory");
    }
    pub mod ledger {
        refinery::embed_migrations!("../../migrations/ledger");
    }
    pub mod loyalty {
        refinery::embed_migrations!("../../migrations/loyalty");
    }
}

/// The four databases of the system, one per service.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Database {
    Orders,
    Inventory,
    Ledger,
    Loyalty,
}

impl Database {
    pub const ALL: [Database; 4] = [
        Database::Orders,
        Database::Inventory,
        Database::Ledger,
        Database::Loyalty,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Database::Orders => "orders",
            Database::Inventory => "inventory",
            Database::Ledger => "ledger",
            Database::Loyalty => "loyalty",
        }
    }

    /// The migration sets of this database. `abort_missing` is off: during a
    /// rolling deploy a newer instance may already have applied a migration
    /// this binary does not know (migrations are additive: expand, then
    /// contract in a later release), and the older binary must still start.
    fn runners(self) -> Vec<refinery::Runner> {
        self.migration_sets()
            .into_iter()
            .map(|runner| runner.set_abort_missing(false))
            .collect()
    }

    fn migration_sets(self) -> Vec<refinery::Runner> {
        let consumer = |domain: refinery::Runner| {
            let mut runtime = embedded::consumer_runtime::migrations::runner();
            runtime.set_migration_table_name("consumer_runtime_schema_history");
            vec![runtime, domain]
        };
        match self {
            Database::Orders => vec![embedded::orders::migrations::runner()],
            Database::Inventory => consumer(embedded::inventory::migrations::runner()),
            Database::Ledger => consumer(embedded::ledger::migrations::runner()),
            Database::Loyalty => consumer(embedded::loyalty::migrations::runner()),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum MigrationError {
    #[error("no database connection: {0}")]
    Pool(#[from] deadpool_postgres::PoolError),
    #[error("advisory lock: {0}")]
    Lock(#[from] tokio_postgres::Error),
    #[error("shut down while waiting for another instance's migration of {database}")]
    Cancelled { database: &'static str },
    #[error("migrating {database}: {source}")]
    Refinery {
        database: &'static str,
        source: refinery::Error,
    },
}

/// The longest a migration's statement waits for a table lock: shorter than
/// order-api's requests wait for theirs (2 s), so the writers queued behind a
/// waiting DDL statement are served, not failed. Unless the server's
/// `deadlock_timeout` is as long: see [`bound_ddl_lock_waits`].
pub const DDL_LOCK_TIMEOUT: std::time::Duration = std::time::Duration::from_millis(1500);

/// Bound the session's table-lock waits for DDL: [`DDL_LOCK_TIMEOUT`], and
/// at least 500 ms past the server's `deadlock_timeout`. A statement waiting
/// on an autovacuum's lock has the server cancel that autovacuum when
/// `deadlock_timeout` runs out; with both timeouts equal (1 s and the
/// default 1 s) the lock timeout's error came first, the cancel was never
/// sent, and every attempt failed while a long vacuum ran (a large table's,
/// throttled): start-up failed after two minutes of attempts.
pub async fn bound_ddl_lock_waits(
    client: &tokio_postgres::Client,
) -> Result<(), tokio_postgres::Error> {
    let floor = i64::try_from(DDL_LOCK_TIMEOUT.as_millis()).unwrap_or(i64::MAX);
    client
        .query_one(
            "SELECT set_config('lock_timeout', greatest($1::bigint, \
                 (SELECT setting::bigint FROM pg_settings WHERE name = 'deadlock_timeout') + 500)::text, \
                 false)",
            &[&floor],
        )
        .await?;
    Ok(())
}
/// Attempts of a migration set whose statement found its table lock busy
/// (a second apart).
const DDL_LOCK_ATTEMPTS: u32 = 60;

/// Say (INFO) when the database's history holds a migration newer than any
/// of `runner`'s: a newer release migrated it (a rolling deploy, or a
/// rollback). refinery's own line for each such migration is an ERROR
/// ("missing from the filesystem"), which `kit::telemetry` leaves out: a
/// deploy must not log errors.
async fn say_if_newer(
    runner: &refinery::Runner,
    client: &mut deadpool_postgres::Object,
    database: Database,
) {
    let ours = runner.get_migrations().iter().map(|m| m.version()).max();
    if let Ok(Some(newest)) = runner
        .get_last_applied_migration_async(&mut ***client)
        .await
    {
        if ours.is_none_or(|ours| newest.version() > ours) {
            tracing::info!(
                database = database.name(),
                applied = %newest,
                newest_known = ?ours,
                "the database holds migrations newer than this binary's (a newer release \
                 migrated it): starting on its schema"
            );
        }
    }
}

/// Whether refinery failed on a lock wait: a lock timeout (SQLSTATE 55P03)
/// or a deadlock the server broke by failing the migration (40P01: a
/// migration that locks tables in another order than the live
/// transactions); either rolled the migration back, and it is tried again.
fn lock_timeout(error: &refinery::Error) -> bool {
    sqlstate(error) == Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE)
        || deadlocked(error)
}

fn deadlocked(error: &refinery::Error) -> bool {
    sqlstate(error) == Some(&tokio_postgres::error::SqlState::T_R_DEADLOCK_DETECTED)
}

/// The SQLSTATE of the database error refinery failed on, if any.
fn sqlstate(error: &refinery::Error) -> Option<&tokio_postgres::error::SqlState> {
    database_error(error)?
        .downcast_ref::<tokio_postgres::Error>()
        .and_then(tokio_postgres::Error::code)
}

/// The database's error refinery failed on (applying a migration), if any.
fn database_error(
    error: &refinery::Error,
) -> Option<&(dyn std::error::Error + Send + Sync + 'static)> {
    match error.kind() {
        refinery::error::Kind::Connection(_, source) => Some(source.as_ref()),
        _ => None,
    }
}

/// Arbitrary constant shared by every service: the advisory lock key for migrations.
pub const MIGRATION_LOCK_KEY: i64 = 0x6f72_6465_725f_6d67; // "order_mg"

/// Apply every pending migration of `database`; returns the names applied.
///
/// The migration session waits as long as it takes for another instance's
/// migration (the advisory lock; the request pool's 2 s `lock_timeout` made
/// a start-up fail, and the service restart in a loop, behind it), and runs
/// without a statement timeout (a backfill may take long). Its DDL waits for
/// a table lock at most [`bound_ddl_lock_waits`]' bound: every write to that
/// table queues behind a waiting DDL statement, so behind a long transaction
/// elsewhere the migration gives way and tries again, as after a deadlock
/// (`DDL_LOCK_ATTEMPTS`, 60 attempts a second apart: up to two and a half
/// minutes with their lock waits at the default `deadlock_timeout`, then
/// the start-up fails) instead of stalling the table's writers. Migrations are written to take their
/// exclusive locks only for instants (expand in one, backfill and validate
/// in the next: orders V6 and V7).
pub async fn run(pool: &Pool, database: Database) -> Result<Vec<String>, MigrationError> {
    run_until(pool, database, &CancellationToken::new()).await
}

/// [`run`], except that a `shutdown` while it waits for another instance's
/// migration (the advisory lock) ends the wait at once
/// ([`MigrationError::Cancelled`]) instead of after that migration, which
/// may take long, or after the process's stop grace. Once the lock is
/// held, the migrations run to their end, unless a service's stop grace
/// ends the process first (`kit::serve`): each migration commits or rolls
/// back whole.
pub async fn run_until(
    pool: &Pool,
    database: Database,
    shutdown: &CancellationToken,
) -> Result<Vec<String>, MigrationError> {
    let mut client = pool.get().await?;
    let result = migrate(&mut client, database, shutdown).await;
    // The connection goes back to the pool only with the pool's own bounds.
    if result.is_err()
        || client
            .batch_execute("RESET lock_timeout; RESET statement_timeout")
            .await
            .is_err()
    {
        drop(deadpool_postgres::Object::take(client));
    }
    let applied = result?;
    if !applied.is_empty() {
        tracing::info!(database = database.name(), ?applied, "migrations applied");
    }
    Ok(applied)
}

async fn migrate(
    client: &mut deadpool_postgres::Object,
    database: Database,
    shutdown: &CancellationToken,
) -> Result<Vec<String>, MigrationError> {
    client
        .batch_execute("SET lock_timeout = 0; SET statement_timeout = 0")
        .await?;
    // Session-level lock on this connection; released explicitly below, or by the
    // server when the connection dies (a crash mid-migration releases it too, and
    // refinery's per-migration transactions leave no half-applied migration).
    tokio::select! {
        locked = client.execute("SELECT pg_advisory_lock($1)", &[&MIGRATION_LOCK_KEY]) => {
            locked?;
        }
        _ = shutdown.cancelled() => {
            // The server would keep this session queued for the lock, and
            // take it when granted, until it notices the connection gone
            // (`run` closes it): cancel the wait itself. Best effort; the
            // closed connection ends the session in any case.
            let cancel = client.cancel_token();
            let _ = tokio::time::timeout(
                std::time::Duration::from_secs(2),
                cancel.cancel_query(tokio_postgres::NoTls),
            )
            .await;
            return Err(MigrationError::Cancelled {
                database: database.name(),
            });
        }
    }
    bound_ddl_lock_waits(client).await?;
    let mut applied = Vec::new();
    let mut result = Ok(());
    'sets: for runner in database.runners() {
        let mut attempt = 1;
        loop {
            match runner.run_async(&mut ***client).await {
                Ok(report) => {
                    applied.extend(report.applied_migrations().iter().map(|m| m.to_string()));
                    say_if_newer(&runner, client, database).await;
                    break;
                }
                // A table lock not granted within DDL_LOCK_TIMEOUT (or a
                // deadlock): the migration's transaction rolled back; its
                // writers went on. Again, still holding the advisory lock.
                Err(source) if lock_timeout(&source) && attempt < DDL_LOCK_ATTEMPTS => {
                    let cause = database_error(&source)
                        .map_or_else(|| source.to_string(), |cause| crate::db::describe(cause));
                    if deadlocked(&source) {
                        // Not a wait: its lock order crosses the live
                        // transactions' (a migration to fix, though it
                        // may win a later try).
                        tracing::warn!(
                            database = database.name(),
                            attempt,
                            migration = %source,
                            error = %cause,
                            "a migration deadlocked with a live transaction (it takes its \
                             table locks in another order): trying again"
                        );
                    } else {
                        tracing::warn!(
                            database = database.name(),
                            attempt,
                            migration = %source,
                            error = %cause,
                            "a migration waited too long for a table lock: trying again"
                        );
                    }
                    attempt += 1;
                    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                }
                Err(source) => {
                    result = Err(MigrationError::Refinery {
                        database: database.name(),
                        source,
                    });
                    break 'sets;
                }
            }
        }
    }
    let unlock = client
        .execute("SELECT pg_advisory_unlock($1)", &[&MIGRATION_LOCK_KEY])
        .await;
    result?;
    unlock?;
    Ok(applied)
}

#[cfg(test)]
mod tests {
    use super::embedded;

    /// Every migration as its set's directory, version, name and refinery's
    /// checksum of it (what a database's history table keeps).
    fn written() -> Vec<String> {
        let sets = [
            ("orders", embedded::orders::migrations::runner()),
            (
                "consumer-runtime",
                embedded::consumer_runtime::migrations::runner(),
            ),
            ("inventory", embedded::inventory::migrations::runner()),
            ("ledger", embedded::ledger::migrations::runner()),
            ("loyalty", embedded::loyalty::migrations::runner()),
        ];
        let mut lines = Vec::new();
        for (directory, runner) in sets {
            let mut migrations: Vec<_> = runner.get_migrations().iter().collect();
            migrations.sort_by_key(|m| m.version());
            for m in migrations {
                lines.push(format!(
                    "{directory} V{} {} {:016x}",
                    m.version(),
                    m.name(),
                    m.checksum()
                ));
            }
        }
        lines
    }

    /// A migration applied anywhere is never edited, renamed or removed:
    /// refinery refuses to start against a database whose history holds
    /// another checksum for it (`abort_divergent`), in every instance of
    /// every service of that database. `migrations/CHECKSUMS` keeps each
    /// one's checksum as first committed; a new migration adds its line
    /// (the one this test prints), an edited one fails here: write a new
    /// migration instead.
    #[test]
    fn migrations_are_never_edited_once_written() {
        let manifest: Vec<&str> = include_str!("../../../migrations/CHECKSUMS")
            .lines()
            .filter(|line| !line.is_empty() && !line.starts_with('#'))
            .collect();
        let written = written();
        let changed: Vec<&String> = written
            .iter()
            .filter(|line| !manifest.contains(&line.as_str()))
            .collect();
        let gone: Vec<&&str> = manifest
            .iter()
            .filter(|line| !written.iter().any(|w| w == *line))
            .collect();
        assert!(
            changed.is_empty() && gone.is_empty(),
            "migrations/CHECKSUMS does not match the migrations: edited or renamed \
             (write a new migration instead), or new (add its line):\n{}\nno longer \
             written as recorded:\n{}",
            changed
                .iter()
                .map(|l| l.as_str())
                .collect::<Vec<_>>()
                .join("\n"),
            gone.iter().map(|l| **l).collect::<Vec<_>>().join("\n")
        );
    }
}
