//! API keys: `Authorization: Bearer <key>`. Keys are stored as blake3 hashes,
//! each bound to one tenant; the tenant of a request comes only from its key.

use actix_web::HttpRequest;
use deadpool_postgres::Pool;
use rand::RngCore;

use crate::error::ApiError;

/// Prefix of every key, so a leaked key is recognisable (e.g. by secret scanners).
pub const KEY_PREFIX: &str = "oek_";

pub fn hash(key: &str) -> String {
    blake3::hash(key.as_bytes()).to_hex().to_string()
}

/// The caller's tenant, or 401.
pub async fn tenant(pool: &Pool, request: &HttpRequest) -> Result<String, ApiError> {
    let key = request
        .headers()
        .get(actix_web::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
        .filter(|k| !k.is_empty())
        .ok_or(ApiError::Unauthorized)?;
    let client = pool.get().await?;
    let statement = client
        .prepare_cached("SELECT tenant_id FROM api_keys WHERE key_hash = $1 AND revoked_at IS NULL")
        .await?;
    client
        .query_opt(&statement, &[&hash(key)])
        .await?
        .map(|row| row.get(0))
        .ok_or(ApiError::Unauthorized)
}

/// Create the tenant if needed and a new key for it; returns the key (shown once).
pub async fn create_key(pool: &Pool, tenant: &str) -> anyhow::Result<String> {
    let valid = !tenant.is_empty()
        && tenant.len() <= 63
        && tenant
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
        && tenant.as_bytes()[0].is_ascii_alphanumeric();
    anyhow::ensure!(
        valid,
        "tenant ids are 1-63 characters of a-z, 0-9, '-' and '_', starting with a letter or digit"
    );
    let mut secret = [0_u8; 24];
    rand::rng().fill_bytes(&mut secret);
    let key = format!(
        "{KEY_PREFIX}{}",
        secret
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    );
    let mut client = pool.get().await?;
    let tx = client.transaction().await?;
    tx.execute(
        "INSERT INTO tenants (tenant_id) VALUES ($1) ON CONFLICT DO NOTHING",
        &[&tenant],
    )
    .await?;
    tx.execute(
        "INSERT INTO api_keys (key_hash, tenant_id, key_prefix) VALUES ($1, $2, $3)",
        &[&hash(&key), &tenant, &&key[..KEY_PREFIX.len() + 6]],
    )
    .await?;
    tx.commit().await?;
    Ok(key)
}
