//! The inventory consumer: stock levels and movements, kept in step with order events by the shared
//! consumer runtime. This crate holds only the domain.

use actix_web::web;
use kit::migrations::Database;

/// The inventory domain.
pub struct Inventory;

impl consumer_runtime::Domain for Inventory {
    const NAME: &'static str = "inventory";
    const SERVICE: &'static str = "inventory-consumer";
    const ENV_PREFIX: &'static str = "INVENTORY_CONSUMER";
    const DATABASE: Database = Database::Inventory;
    const DEFAULT_PORT: u16 = 8081;

    fn routes(_cfg: &mut web::ServiceConfig) {}
}
