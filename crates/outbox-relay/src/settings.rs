//! outbox-relay settings: defaults for the local setup, overridden by
//! `OUTBOX_RELAY__<SECTION>__<FIELD>` environment variables.

use kit::settings::{AmqpSettings, DatabaseSettings, HttpSettings};
use serde::{Deserialize, Serialize};

pub const ENV_PREFIX: &str = "OUTBOX_RELAY";

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Settings {
    /// Health and metrics only.
    pub http: HttpSettings,
    /// The `orders` database, where the outbox lives.
    pub database: DatabaseSettings,
    pub amqp: AmqpSettings,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            http: HttpSettings::local(9100),
            database: DatabaseSettings::local("orders"),
            amqp: AmqpSettings::default(),
        }
    }
}

impl Settings {
    pub fn load() -> anyhow::Result<Self> {
        Ok(kit::settings::load(ENV_PREFIX, &Self::default())?)
    }
}
