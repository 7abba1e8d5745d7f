//! The ledger consumer: double-entry journal and trial balance, kept in step with order events by the shared
//! consumer runtime. This crate holds only the domain.

use actix_web::web;
use kit::migrations::Database;

/// The ledger domain.
pub struct Ledger;

impl consumer_runtime::Domain for Ledger {
    const NAME: &'static str = "ledger";
    const SERVICE: &'static str = "ledger-consumer";
    const ENV_PREFIX: &'static str = "LEDGER_CONSUMER";
    const DATABASE: Database = Database::Ledger;
    const DEFAULT_PORT: u16 = 8082;

    fn routes(_cfg: &mut web::ServiceConfig) {}
}
