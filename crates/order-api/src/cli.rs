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
            Command::CleanupKeys => {
                let pool = crate::pool(&settings)?;
                let deleted = crate::cleanup::delete_expired(
                    &pool,
                    settings.idempotency.cleanup_batch.max(1),
                    &shutdown,
                    |_| {},
                )
                .await?;
                println!("{deleted} expired idempotency key(s) deleted");
                Ok(())
            }
        }
    })
    .await
}
