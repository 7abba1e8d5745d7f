//! The loyalty consumer: loyalty points and their audit trail, kept in step with order events by the shared
//! consumer runtime. This crate holds only the domain.

use actix_web::web;
use kit::migrations::Database;

/// The loyalty domain.
pub struct Loyalty;

impl consumer_runtime::Domain for Loyalty {
    const NAME: &'static str = "loyalty";
    const SERVICE: &'static str = "loyalty-consumer";
    const ENV_PREFIX: &'static str = "LOYALTY_CONSUMER";
    const DATABASE: Database = Database::Loyalty;
    const DEFAULT_PORT: u16 = 8083;

    fn routes(_cfg: &mut web::ServiceConfig) {}
}
