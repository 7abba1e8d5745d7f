//! order-api settings: defaults for the local setup, overridden by
//! `ORDER_API__<SECTION>__<FIELD>` environment variables.

use kit::settings::{DatabaseSettings, HttpSettings};
use serde::{Deserialize, Serialize};

pub const ENV_PREFIX: &str = "ORDER_API";

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Settings {
    pub http: HttpSettings,
    pub database: DatabaseSettings,
    pub idempotency: IdempotencySettings,
    #[serde(default)]
    pub auth: AuthSettings,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct AuthSettings {
    /// How long a verified API key is remembered in process (milliseconds; 0
    /// = look it up on every request). A key revoked in the database
    /// (`api_keys.revoked_at`) stops working within this window; unknown or
    /// revoked keys are never remembered, so a new key works at once.
    pub key_cache_ms: u64,
}

impl Default for AuthSettings {
    fn default() -> Self {
        Self {
            key_cache_ms: 1_000,
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct IdempotencySettings {
    /// How long a loser waits for the key's owner before 409 idempotency_in_progress
    /// (PostgreSQL `lock_timeout` of every session).
    pub lock_timeout_ms: u64,
    /// Key retention (`expires_at = created_at + ttl`); default 24 h.
    pub ttl_seconds: u64,
    /// How often expired keys are deleted, and how many per statement.
    pub cleanup_interval_seconds: u64,
    pub cleanup_batch: i64,
    /// Request body limit.
    pub max_body_bytes: usize,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            http: HttpSettings::local(8080),
            database: DatabaseSettings::local("orders"),
            idempotency: IdempotencySettings {
                lock_timeout_ms: 2_000,
                ttl_seconds: 24 * 60 * 60,
                cleanup_interval_seconds: 60,
                cleanup_batch: 1_000,
                max_body_bytes: 256 * 1024,
            },
            auth: AuthSettings::default(),
        }
    }
}

impl Settings {
    pub fn load() -> anyhow::Result<Self> {
        Ok(kit::settings::load(ENV_PREFIX, &Self::default())?)
    }
}
