//! The `order-api` command line.

use clap::{Parser, Subcommand};
use kit::migrations::Database;

use crate::{Application, Settings, SERVICE};

#[derive(Debug, Parser)]
#[command(
    name = "order-api",
    about = "The order API (with no subcommand: serve)"
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve the HTTP API (the default).
    Serve,
    /// Apply pending migrations of the `orders` database, then exit.
    Migrate,
    /// Manage API keys.
    #[command(subcommand, name = "api-key")]
    ApiKey(ApiKeyCommand),
    /// Delete expired idempotency keys now, then exit.
    CleanupKeys,
}

#[derive(Debug, Subcommand)]
enum ApiKeyCommand {
    /// Create a key for a tenant (and the tenant if new). Prints the key once,
    /// alone on stdout; only its blake3 hash is stored.
    Create {
        #[arg(long)]
        tenant: String,
    },
    /// Revoke a key (a leaked one: `--key`), or every key of a tenant
    /// (`--tenant`). Refused from the next lookup on: each order-api holds
    /// a key it verified for `auth.key_cache_ms` (1 s by default).
    #[command(group = clap::ArgGroup::new("which").required(true).multiple(false))]
    Revoke {
        /// The key itself.
        #[arg(long, group = "which")]
        key: Option<String>,
        /// Every key of this tenant.
        #[arg(long, group = "which")]
        tenant: Option<String>,
    },
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
                let pool = crate::pool(&settings)?;
                let applied =
                    kit::migrations::run_until(&pool, Database::Orders, &shutdown).await?;
                println!("orders: {} migration(s) applied", applied.len());
                Ok(())
            }
            Command::ApiKey(ApiKeyCommand::Create { tenant }) => {
                let pool = crate::pool(&settings)?;
                kit::migrations::run_until(&pool, Database::Orders, &shutdown).await?;
                let key = crate::auth::create_key(&pool, &tenant).await?;
                eprintln!("API key for tenant {tenant} (shown once; only its hash is stored):");
                println!("{key}");
                Ok(())
            }
            Command::ApiKey(ApiKeyCommand::Revoke { key, tenant }) => {
                let pool = crate::pool(&settings)?;
                let which = match (&key, &tenant) {
                    (Some(key), _) => crate::auth::Revoke::Key(key),
                    (None, Some(tenant)) => crate::auth::Revoke::Tenant(tenant),
                    (None, None) => anyhow::bail!("--key or --tenant"),
                };
                let revoked = crate::auth::revoke(&pool, which).await?;
                println!(
                    "{revoked} key(s) revoked (refused by every order-api within auth.key_cache_ms)"
                );
                anyhow::ensure!(
                    revoked > 0,
                    "no key revoked: none matches that is not revoked already"
                );
                Ok(())
            }
            Command::CleanupKeys => {
                let pool = crate::pool(&settings)?;
                let (deleted, stopped_early) = crate::cleanup::delete_expired(
                    &pool,
                    settings.idempotency.cleanup_batch.max(1),
                    &shutdown,
                    |_| {},
                )
                .await?;
                println!("{deleted} expired idempotency key(s) deleted");
                // A signal ends the run between batches: expired keys may
                // remain (status 1; run it again).
                anyhow::ensure!(
                    !stopped_early,
                    "stopped by a signal before the end: run it again for the rest"
                );
                Ok(())
            }
        }
    })
    .await
}
