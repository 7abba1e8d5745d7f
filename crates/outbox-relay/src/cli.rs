//! The `outbox-relay` command line.

use clap::{Parser, Subcommand};
use kit::migrations::Database;

use crate::{Application, Settings, SERVICE};

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
}

pub async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    kit::service_main(SERVICE, |shutdown| async move {
        let settings = Settings::load()?;
        match cli.command.unwrap_or(Command::Serve) {
            Command::Serve => {
                let app = Application::build(settings, &shutdown).await?;
                app.run_until_stopped(shutdown).await
            }
            Command::Migrate => {
                let pool = kit::db::pool(&settings.database)?;
                let applied = kit::migrations::run(&pool, Database::Orders).await?;
                println!("orders: {} migration(s) applied", applied.len());
                Ok(())
            }
        }
    })
    .await
}
