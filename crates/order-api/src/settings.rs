//! order-api settings: defaults for the local setup, overridden by
//! `ORDER_API__<SECTION>__<FIELD>` environment variables.

use kit::settings::{DatabaseSettings, HttpSettings};
use serde::{Deserialize, Serialize};

pub const ENV_PREFIX: &str = "ORDER_API";

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Settings {
    pub http: HttpSettings,
    pub database: DatabaseSettings,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            http: HttpSettings::local(8080),
            database: DatabaseSettings::local("orders"),
        }
    }
}

impl Settings {
    pub fn load() -> anyhow::Result<Self> {
        Ok(kit::settings::load(ENV_PREFIX, &Self::default())?)
    }
}
