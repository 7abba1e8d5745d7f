//! API keys: `Authorization: Bearer <key>`. Keys are stored as blake3 hashes,
//! each bound to one tenant; the tenant of a request comes only from its key.

use std::time::{Duration, Instant};

use actix_web::HttpRequest;
use deadpool_postgres::Pool;
use rand::RngCore;

use crate::{error::ApiError, idempotency::Deadline, AppState};

/// Prefix of every key, so a leaked key is recognisable (e.g. by secret scanners).
pub const KEY_PREFIX: &str = "oek_";

pub fn hash(key: &str) -> String {
    blake3::hash(key.as_bytes()).to_hex().to_string()
}

/// Verified keys (by hash) and their tenants, each remembered for a short
/// time: one lookup per key per window instead of one per request (the
/// lookup was a statement and a commit in eight of an order's). Bounded:
/// emptied when it reaches `MAX_CACHED_KEYS`.
#[derive(Debug, Default)]
pub struct KeyCache {
    keys: std::sync::Mutex<std::collections::HashMap<String, (String, Instant)>>,
}

const MAX_CACHED_KEYS: usize = 10_000;

impl KeyCache {
    fn get(&self, hash: &str, ttl: Duration) -> Option<String> {
        self.get_at(hash, ttl, Instant::now())
    }

    /// [`Self::get`] as of `now`.
    fn get_at(&self, hash: &str, ttl: Duration, now: Instant) -> Option<String> {
        let keys = self.keys.lock().ok()?;
        keys.get(hash)
            .filter(|(_, at)| now.saturating_duration_since(*at) < ttl)
            .map(|(tenant, _)| tenant.clone())
    }

    /// Remember `tenant` for `hash` as of `asked`, when its lookup began:
    /// the answer is as old as its statement's snapshot, so a key revoked
    /// while a slow lookup ran is not held for a whole window after it.
    fn put(&self, hash: String, tenant: &str, asked: Instant) {
        if let Ok(mut keys) = self.keys.lock() {
            if keys.len() >= MAX_CACHED_KEYS {
                keys.clear();
            }
            keys.insert(hash, (tenant.to_owned(), asked));
        }
    }
}

/// The caller's tenant, or 401. A key verified less than
/// `auth.key_cache_ms` ago is not looked up again (see [`KeyCache`]).
/// The lookup runs within the request's `deadline`.
pub async fn tenant(
    state: &AppState,
    request: &HttpRequest,
    deadline: &Deadline,
) -> Result<String, ApiError> {
    let (cache, ttl) = (
        &state.keys,
        Duration::from_millis(state.settings.auth.key_cache_ms),
    );
    let key = kit::http::bearer_token(request).ok_or(ApiError::Unauthorized)?;
    // A token no key could be is refused without a lookup: any client could
    // otherwise spend a pooled connection and a round trip per request.
    if !key_shaped(key) {
        return Err(ApiError::Unauthorized);
    }
    let hash = hash(key);
    if let Some(tenant) = cache.get(&hash, ttl) {
        return Ok(tenant);
    }
    let asked = Instant::now();
    let tenant: String = deadline
        .read(&state.pool, async |client| {
            let statement = client
                .prepare_cached(
                    "SELECT tenant_id FROM api_keys WHERE key_hash = $1 AND revoked_at IS NULL",
                )
                .await?;
            Ok(client
                .query_opt(&statement, &[&hash])
                .await?
                .map(|row| row.get(0)))
        })
        .await?
        .ok_or(ApiError::Unauthorized)?;
    if !ttl.is_zero() {
        cache.put(hash, &tenant, asked);
    }
    Ok(tenant)
}

/// Whether `token` has the shape of the keys [`create_key`] makes: the
/// prefix and 48 lower-case hex digits.
fn key_shaped(token: &str) -> bool {
    token.strip_prefix(KEY_PREFIX).is_some_and(|secret| {
        secret.len() == 2 * SECRET_BYTES
            && secret
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    })
}

/// The random bytes of a key (48 hex digits).
const SECRET_BYTES: usize = 24;

/// Which keys [`revoke`] revokes.
pub enum Revoke<'a> {
    /// The key itself (found by its hash).
    Key(&'a str),
    /// Every key of the tenant.
    Tenant(&'a str),
}

/// Revoke keys not revoked yet; how many. One statement: nothing else to
/// keep consistent (a key is refused once its lookup sees `revoked_at`).
pub async fn revoke(pool: &Pool, which: Revoke<'_>) -> anyhow::Result<u64> {
    let client = pool.get().await?;
    let revoked = match which {
        Revoke::Key(key) => {
            client
                .execute(
                    "UPDATE api_keys SET revoked_at = now() \
                     WHERE key_hash = $1 AND revoked_at IS NULL",
                    &[&hash(key.trim())],
                )
                .await?
        }
        Revoke::Tenant(tenant) => {
            client
                .execute(
                    "UPDATE api_keys SET revoked_at = now() \
                     WHERE tenant_id = $1 AND revoked_at IS NULL",
                    &[&tenant],
                )
                .await?
        }
    };
    Ok(revoked)
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
    let mut secret = [0_u8; SECRET_BYTES];
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
    // Crash window: the tenant and the key's hash are committed, the key
    // is not printed yet. Lost, it is a row no one can present (only its
    // hash is stored); the next run makes a working key beside it.
    kit::failpoint::crash_point("order_api.api_key.after_commit");
    Ok(key)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An entry serves for `auth.key_cache_ms` after its lookup began, and
    /// not a moment longer (on a clock of the test's own: no stall of the
    /// machine between two lines can age an entry).
    #[test]
    fn only_a_token_shaped_like_a_key_is_looked_up() {
        let key = format!("{KEY_PREFIX}{}", "0123456789abcdef".repeat(3));
        assert!(key_shaped(&key));
        for other in [
            "x".to_owned(),
            KEY_PREFIX.to_owned(),
            key[..key.len() - 1].to_owned(),
            format!("{key}0"),
            key.to_uppercase(),
            key.replace("oek_", "oek-"),
            format!("{KEY_PREFIX}{}", "g".repeat(48)),
        ] {
            assert!(!key_shaped(&other), "{other}");
        }
    }

    #[test]
    fn a_cached_key_serves_for_the_configured_window_only() {
        let cache = KeyCache::default();
        let ttl = Duration::from_millis(500);
        let asked = Instant::now();
        cache.put("h".to_owned(), "acme", asked);
        let at = |age: Duration| cache.get_at("h", ttl, asked + age);
        assert_eq!(at(Duration::ZERO).as_deref(), Some("acme"));
        assert_eq!(at(Duration::from_millis(499)).as_deref(), Some("acme"));
        assert_eq!(at(ttl), None);
        assert_eq!(at(Duration::from_secs(10)), None);
        // A lookup that took longer than the window is stale when it is
        // put: its age counts from when it was asked.
        cache.put("slow".to_owned(), "acme", asked);
        assert_eq!(cache.get_at("slow", ttl, asked + ttl), None);
        assert_eq!(cache.get_at("h", Duration::ZERO, asked), None, "0: off");
        assert_eq!(cache.get_at("other", ttl, asked), None);
    }
}
