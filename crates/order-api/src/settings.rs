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
    /// The time budget of one POST (milliseconds, 1 to 29 749: with its
    /// 250 ms backstop it stays within the sessions' `statement_timeout` of
    /// 30 000), counted from the request's start: the pool wait, the
    /// transaction's statements and its lock waits all end within it (the
    /// statement running when it runs out is cancelled; the transaction
    /// runs with `statement_timeout` = the budget left plus 250 ms, a
    /// backstop should the cancel not reach the server). Past
    /// it, before COMMIT is sent, the transaction rolls back: 503
    /// `deadline_exceeded` + `Retry-After`, nothing stored, the key free
    /// (also for a loser still waiting for its key's owner: only
    /// `lock_timeout_ms` ending that wait first is 409
    /// `idempotency_in_progress`). Keep it below the clients' timeout, so that
    /// they get an answer rather than an unknown outcome. A lock wait ends at
    /// whichever of the two comes first; with `lock_timeout_ms` at or above
    /// the budget, the budget alone bounds it.
    pub request_budget_ms: u64,
    /// Key retention, from when the outcome is stored (`expires_at` =
    /// that moment + ttl); default 24 h.
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
                request_budget_ms: 10_000,
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
        let settings: Self = kit::settings::load(ENV_PREFIX, &Self::default())?;
        settings.validate()?;
        Ok(settings)
    }

    /// Settings that work but weaken a guarantee, said at start-up. A key
    /// retention not longer than the request budget lets a client that
    /// retries after its timeout find its key expired and run the request
    /// again (seed 004: the retention must cover the clients' longest retry
    /// window). Not refused: tests shorten the retention on purpose.
    pub fn warnings(&self) -> Vec<String> {
        let i = &self.idempotency;
        let mut warnings = Vec::new();
        if i.ttl_seconds.saturating_mul(1000) <= i.request_budget_ms {
            warnings.push(format!(
                "idempotency.ttl_seconds ({} s) is not longer than idempotency.request_budget_ms \
                 ({} ms): a client retrying after its timeout may find its key expired and \
                 have its request run again; keep the retention above the clients' longest \
                 retry window",
                i.ttl_seconds, i.request_budget_ms
            ));
        }
        if self.wanted_drain_seconds() > MAX_DRAIN_SECS {
            warnings.push(format!(
                "idempotency.request_budget_ms ({} ms) is longer than a stop lets requests \
                 finish ({MAX_DRAIN_SECS} s, within the stop's grace of {} s): a request in \
                 flight at a stop may be cut, its client seeing the connection reset instead \
                 of an answer (a retry with the same key is safe)",
                i.request_budget_ms,
                kit::shutdown::GRACE.as_secs()
            ));
        }
        warnings
    }

    /// How long a stop lets the requests in flight finish (actix's
    /// `shutdown_timeout`): a request's whole budget and the backstop
    /// behind it, so that one taken just before the stop still gets its
    /// answer (503 `deadline_exceeded` at worst) rather than a reset; at
    /// most [`MAX_DRAIN_SECS`].
    pub fn drain_seconds(&self) -> u64 {
        self.wanted_drain_seconds().min(MAX_DRAIN_SECS)
    }

    fn wanted_drain_seconds(&self) -> u64 {
        (self.idempotency.request_budget_ms + SERVER_BACKSTOP_MS).div_ceil(1000) + 1
    }

    /// Refuse values that would change what a setting means or fail every
    /// request later: `lock_timeout = 0` is *no* timeout in PostgreSQL (a
    /// waiting request would sit until `statement_timeout`), and so is in
    /// effect one at or above the sessions' `statement_timeout` (the wait
    /// ends as a cancelled statement, a 503, not 409
    /// `idempotency_in_progress`); a request budget of 0 would answer every
    /// POST 503, and one that with its backstop passes `statement_timeout`
    /// would raise the statements' limit it is meant to lower (`SET LOCAL
    /// statement_timeout` to the budget left plus the backstop); a key TTL
    /// beyond an interval's range fails every POST.
    pub fn validate(&self) -> anyhow::Result<()> {
        let i = &self.idempotency;
        anyhow::ensure!(
            (1..STATEMENT_TIMEOUT_MS).contains(&i.lock_timeout_ms),
            "idempotency.lock_timeout_ms must be 1 to {} (0 would mean no timeout; from the \
             sessions' statement_timeout of {STATEMENT_TIMEOUT_MS} ms on, that timeout ends the \
             wait first, and a request waiting for its key's owner would get 503 instead of \
             409 idempotency_in_progress)",
            STATEMENT_TIMEOUT_MS - 1
        );
        anyhow::ensure!(
            (1..=MAX_REQUEST_BUDGET_MS).contains(&i.request_budget_ms),
            "idempotency.request_budget_ms must be 1 to {MAX_REQUEST_BUDGET_MS} (the budget, \
             plus the server's {SERVER_BACKSTOP_MS} ms backstop behind the cancel at its end, \
             stays within the sessions' statement_timeout of {STATEMENT_TIMEOUT_MS} ms)"
        );
        anyhow::ensure!(
            (1..=MAX_TTL_SECONDS).contains(&i.ttl_seconds),
            "idempotency.ttl_seconds must be 1 to {MAX_TTL_SECONDS} (ten years)"
        );
        anyhow::ensure!(
            i.cleanup_batch >= 1,
            "idempotency.cleanup_batch must be at least 1"
        );
        // The cleanup's timer adds the interval to an Instant: a value past
        // its range (someone switching the cleanup "off") would panic there
        // at the first tick and stop the service with no word of the setting.
        anyhow::ensure!(
            (1..=86_400).contains(&i.cleanup_interval_seconds),
            "idempotency.cleanup_interval_seconds must be 1 to 86400 (a day)"
        );
        anyhow::ensure!(
            i.max_body_bytes >= 1,
            "idempotency.max_body_bytes must be at least 1"
        );
        anyhow::ensure!(
            self.auth.key_cache_ms <= 86_400_000,
            "auth.key_cache_ms must be at most a day (86400000)"
        );
        Ok(())
    }
}

/// The `statement_timeout` of every session (`kit::db::SESSION_LIMITS`): a
/// lock wait must end before it, and a request's own limit never exceeds it.
const STATEMENT_TIMEOUT_MS: u64 = 30_000;

/// How long past a request's deadline the server ends a statement by
/// itself (`statement_timeout`): a backstop for a cancel that cannot reach
/// it. Were it the budget left exactly, the server could end a statement a
/// moment before the deadline (whole milliseconds, counted from the
/// statement's start) and the request would end one of two ways by a race;
/// this way the cancel sent at the deadline ends it, and its connection is
/// closed.
pub(crate) const SERVER_BACKSTOP_MS: u64 = 250;

/// The largest request budget: whole milliseconds rounded up, plus the
/// backstop, within the sessions' `statement_timeout`.
const MAX_REQUEST_BUDGET_MS: u64 = STATEMENT_TIMEOUT_MS - SERVER_BACKSTOP_MS - 1;

/// The longest a stop waits for the requests in flight: the stop's grace
/// (after which the process exits with an error) less 2 s for the rest of
/// the stop (the key cleanup, telemetry).
const MAX_DRAIN_SECS: u64 = kit::shutdown::GRACE.as_secs() - 2;

/// Ten years: far beyond any retention, far inside an interval's range.
const MAX_TTL_SECONDS: u64 = 10 * 366 * 24 * 3600;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defaults_are_valid_and_values_that_change_meaning_are_refused() {
        Settings::default().validate().expect("defaults");
        let with = |change: fn(&mut Settings)| {
            let mut settings = Settings::default();
            change(&mut settings);
            settings.validate()
        };
        assert!(with(|s| s.idempotency.lock_timeout_ms = 0).is_err());
        assert!(with(|s| s.idempotency.lock_timeout_ms = 1 << 31).is_err());
        assert!(with(|s| s.idempotency.lock_timeout_ms = 29_999).is_ok());
        let error =
            with(|s| s.idempotency.lock_timeout_ms = 30_000).expect_err("statement_timeout");
        assert!(
            error
                .to_string()
                .contains("idempotency.lock_timeout_ms must be 1 to 29999"),
            "{error}"
        );
        assert!(with(|s| s.idempotency.request_budget_ms = 0).is_err());
        assert!(with(|s| s.idempotency.request_budget_ms = 29_749).is_ok());
        assert!(with(|s| s.idempotency.request_budget_ms = 29_750).is_err());
        // A lock wait ends at whichever bound comes first.
        assert!(with(|s| {
            s.idempotency.request_budget_ms = 500;
            s.idempotency.lock_timeout_ms = 20_000;
        })
        .is_ok());
        assert!(with(|s| s.idempotency.ttl_seconds = 0).is_err());
        assert!(Settings::default().warnings().is_empty());
        let mut short = Settings::default();
        short.idempotency.ttl_seconds = 10;
        assert_eq!(short.warnings().len(), 1, "10 s against a 10 s budget");
        short.idempotency.ttl_seconds = 11;
        assert!(short.warnings().is_empty());
        // A stop waits for a whole request: 10 s + 250 ms, rounded up, + 1 s.
        assert_eq!(Settings::default().drain_seconds(), 12);
        let mut long = Settings::default();
        long.idempotency.request_budget_ms = 21_750;
        assert_eq!((long.drain_seconds(), long.warnings().len()), (23, 0));
        long.idempotency.request_budget_ms = 21_751;
        assert_eq!((long.drain_seconds(), long.warnings().len()), (23, 1));
        assert!(with(|s| s.idempotency.ttl_seconds = u64::MAX).is_err());
        assert!(with(|s| s.idempotency.cleanup_batch = 0).is_err());
        assert!(with(|s| s.idempotency.cleanup_interval_seconds = 0).is_err());
        assert!(with(|s| s.idempotency.cleanup_interval_seconds = 86_400).is_ok());
        assert!(with(|s| s.idempotency.cleanup_interval_seconds = 86_401).is_err());
        assert!(with(|s| s.idempotency.cleanup_interval_seconds = u64::MAX).is_err());
        assert!(with(|s| s.auth.key_cache_ms = u64::MAX).is_err());
    }

    #[test]
    fn the_lock_timeout_bound_is_the_sessions_statement_timeout() {
        assert!(
            kit::db::SESSION_LIMITS.contains(&format!("statement_timeout={STATEMENT_TIMEOUT_MS} ")),
            "{}",
            kit::db::SESSION_LIMITS
        );
    }
}
