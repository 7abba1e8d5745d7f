//! Settings of a consumer service: `<ENV_PREFIX>__<SECTION>__<FIELD>`
//! environment variables over the zero-configuration local defaults.

use std::time::Duration;

use kit::settings::{AmqpSettings, DatabaseSettings, HttpSettings};
use serde::{Deserialize, Serialize};

use crate::Domain;

/// The token of the internal read endpoints when `SERVICE_TOKEN` is not set
/// (local mode only; see [`AuthSettings`]).
pub const LOCAL_DEV_TOKEN: &str = "local-dev-token";

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Settings {
    pub http: HttpSettings,
    pub database: DatabaseSettings,
    pub amqp: AmqpSettings,
    pub consumer: ConsumerSettings,
    pub cleanup: CleanupSettings,
    pub auth: AuthSettings,
}

/// The smallest `consumer.delivery_limit` accepted.
pub const MIN_DELIVERY_LIMIT: u32 = 5;

/// The longest inbox retention: a century (the relay's longest too).
const MAX_RETENTION_HOURS: u32 = 100 * 365 * 24;

/// How the consumer takes events off the broker.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ConsumerSettings {
    /// The consumer's name: its inbox key (`processed_events.consumer_name`,
    /// `order_progress.consumer_name`) and the prefix of its exchange and
    /// queues (`<name>.events`, `<name>.p0`, `<name>.retry.0`, `<name>.dlq`).
    /// Defaults to the domain's name (`inventory`, `ledger`, `loyalty`).
    pub name: String,
    /// Number of partition queues `<name>.p0 .. <name>.p{P-1}`.
    pub partitions: u16,
    /// Unacknowledged messages the broker may push per partition (they are
    /// still processed one at a time, in order). Settled messages are
    /// acknowledged cumulatively at half of it (or when the partition is
    /// idle), so a crash redelivers at most that many per partition, as
    /// inbox duplicates. Every ack is a Raft command of the quorum queue:
    /// 64 instead of 16 cut RabbitMQ's CPU per event from ~100-130 µs to
    /// ~55-85 µs (bench/findings.md, session 5). Not larger: each crash
    /// counts a delivery for every message in the window, so a crash loop
    /// (`delivery_limit`) dead-letters the whole window (ARCHITECTURE.md).
    pub prefetch: u16,
    /// Retry tier delays in milliseconds, comma separated (one queue
    /// `<name>.retry.<i>` per tier). Default 10 s, 1 min, 5 min, 30 min, 2 h.
    pub retry_tiers_ms: String,
    /// Failed attempts after which an event is dead-lettered (and its order
    /// parked). Attempt n+1 follows tier n: the default 5 attempts wait in
    /// the first four tiers (about 36 min in all), and the 2 h tier is used
    /// from a 6th attempt on; past the last tier, the last is used again.
    pub max_attempts: u32,
    /// How many times an event that arrives ahead of a missing predecessor is
    /// deferred (through retry tier 0, not counted as a failure) before each
    /// further wait counts as a gap failure (apart from the handler's
    /// attempts, up to `max_attempts` of them). 30 x 10 s covers a
    /// predecessor that is itself waiting in the early retry tiers; the gap
    /// failures cover the rest.
    pub max_deferrals: u32,
    /// `x-delivery-limit` of the partition queues: a backstop against a
    /// message that crashes the process every time it is delivered (it is
    /// then dead-lettered by the broker into `<name>.dlq`). At least
    /// [`MIN_DELIVERY_LIMIT`]: every stop or restart returns the unacked
    /// prefetch window, a delivery counted for each of its messages, so a
    /// smaller limit dead-letters (and parks the orders of) whole windows
    /// over a few deploys (and 0 does not mean "no limit").
    pub delivery_limit: u32,
    /// Bind `<name>.events` to `order-events` (`#`). Always on in a real
    /// deployment; tests turn it off to feed a private consumer only through
    /// its own hash exchange (isolated from every other event publisher).
    pub bind_order_events: bool,
    /// Comma-separated tenant ids: when set, events of any other tenant are
    /// acknowledged without effect (no inbox row, counted in
    /// `consumer_filtered_total`). For isolated test systems that share one
    /// broker and database with others; empty (every tenant) in production.
    pub only_tenants: String,
}

/// Inbox cleanup.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CleanupSettings {
    /// `processed_events` rows older than this are deleted. Must be at least
    /// `min_retention_hours` (the relay's outbox retention, 7 days): an event
    /// that can still be replayed must still be recognised as a duplicate.
    pub inbox_retention_hours: u32,
    /// The replay horizon of the relay; the retention may not be shorter.
    pub min_retention_hours: u32,
    /// Seconds between cleanup runs (the parked-order gauge is refreshed
    /// every `min(interval, 15 s)`).
    pub interval_secs: u64,
    /// Rows deleted per statement.
    pub batch_size: i64,
}

/// Authentication of the internal read endpoints.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct AuthSettings {
    /// The bearer token; the `SERVICE_TOKEN` environment variable wins over
    /// this. When neither is set: refused if `require_token`, otherwise
    /// [`LOCAL_DEV_TOKEN`] (local mode).
    pub service_token: String,
    pub require_token: bool,
}

impl Settings {
    pub fn defaults<D: Domain>() -> Self {
        Self::local(D::NAME, D::DATABASE.name(), D::DEFAULT_PORT)
    }

    /// The zero-configuration settings of consumer `name`.
    pub fn local(name: &str, database: &str, port: u16) -> Self {
        Self {
            http: HttpSettings::local(port),
            database: DatabaseSettings::local(database),
            amqp: AmqpSettings::default(),
            consumer: ConsumerSettings {
                name: name.to_owned(),
                partitions: 4,
                prefetch: 64,
                retry_tiers_ms: "10000,60000,300000,1800000,7200000".to_owned(),
                max_attempts: 5,
                max_deferrals: 30,
                delivery_limit: 20,
                bind_order_events: true,
                only_tenants: String::new(),
            },
            cleanup: CleanupSettings {
                inbox_retention_hours: 8 * 24,
                min_retention_hours: 7 * 24,
                interval_secs: 600,
                batch_size: 1000,
            },
            auth: AuthSettings {
                service_token: String::new(),
                require_token: false,
            },
        }
    }

    /// Defaults overridden by the environment (`<ENV_PREFIX>__HTTP__PORT`,
    /// `<ENV_PREFIX>__CONSUMER__NAME`, ...), then validated.
    pub fn load<D: Domain>() -> anyhow::Result<Self> {
        let settings: Self = kit::settings::load(D::ENV_PREFIX, &Self::defaults::<D>())?;
        settings.validate()?;
        Ok(settings)
    }

    pub fn validate(&self) -> anyhow::Result<()> {
        self.amqp.validate().map_err(anyhow::Error::msg)?;
        // Accepted by the shared HTTP settings, honoured by order-api only:
        // more than the one worker this server (health, metrics, reads)
        // runs on is refused rather than ignored (0, the default, and 1 say
        // what it does).
        anyhow::ensure!(
            self.http.workers <= 1,
            "http.workers applies to order-api only; this service serves HTTP on one worker \
             (0 or 1)"
        );
        let c = &self.consumer;
        anyhow::ensure!(
            !c.name.is_empty() && c.name.len() <= 200,
            "consumer.name must be 1..200 bytes"
        );
        anyhow::ensure!(c.partitions >= 1, "consumer.partitions must be at least 1");
        anyhow::ensure!(c.prefetch >= 1, "consumer.prefetch must be at least 1");
        anyhow::ensure!(
            c.delivery_limit >= MIN_DELIVERY_LIMIT,
            "consumer.delivery_limit must be at least {MIN_DELIVERY_LIMIT} (got {}): every stop \
             of the consumer counts a delivery for each unacknowledged message, so a smaller \
             limit dead-letters whole prefetch windows over a few restarts",
            c.delivery_limit
        );
        anyhow::ensure!(
            c.max_attempts >= 1,
            "consumer.max_attempts must be at least 1"
        );
        self.retry_tiers()?;
        anyhow::ensure!(
            self.cleanup.inbox_retention_hours >= self.cleanup.min_retention_hours,
            "cleanup.inbox_retention_hours ({}) must not be shorter than the relay's replay horizon ({} h)",
            self.cleanup.inbox_retention_hours,
            self.cleanup.min_retention_hours
        );
        // A century, as the relay's retention: further back, `now() -
        // interval` leaves PostgreSQL's timestamp range and every cleanup
        // run fails (the inbox would grow without bound).
        anyhow::ensure!(
            self.cleanup.inbox_retention_hours <= MAX_RETENTION_HOURS,
            "cleanup.inbox_retention_hours must be at most a century ({MAX_RETENTION_HOURS})"
        );
        anyhow::ensure!(
            self.cleanup.batch_size >= 1,
            "cleanup.batch_size must be at least 1"
        );
        anyhow::ensure!(
            self.cleanup.interval_secs >= 1,
            "cleanup.interval_secs must be at least 1 (0 would delete in a busy loop)"
        );
        Ok(())
    }

    /// The retry tier delays.
    pub fn retry_tiers(&self) -> anyhow::Result<Vec<Duration>> {
        let tiers = self
            .consumer
            .retry_tiers_ms
            .split(',')
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .map(|t| {
                t.parse::<u64>()
                    .map(Duration::from_millis)
                    .map_err(|e| anyhow::anyhow!("consumer.retry_tiers_ms: {t:?}: {e}"))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        anyhow::ensure!(
            !tiers.is_empty(),
            "consumer.retry_tiers_ms needs at least one tier"
        );
        anyhow::ensure!(
            tiers.iter().all(|t| !t.is_zero()),
            "consumer.retry_tiers_ms: a tier of 0 ms would be a tight retry loop"
        );
        // Each tier is a queue's `x-message-ttl`, which RabbitMQ refuses
        // past 2^32 - 1 ms (406 PRECONDITION_FAILED, which start-up would
        // report as a topology conflict to be drained and deleted).
        anyhow::ensure!(
            tiers.iter().all(|t| t.as_millis() <= u128::from(u32::MAX)),
            "consumer.retry_tiers_ms: a tier may be at most 4294967295 ms (about 49 days, \
             RabbitMQ's largest message TTL): {:?}",
            self.consumer.retry_tiers_ms
        );
        // Backoff (seed 003): each retry waits at least as long as the one
        // before; a shorter later tier is a typo that would hammer a
        // struggling dependency harder the longer it struggles.
        anyhow::ensure!(
            tiers.windows(2).all(|pair| pair[0] <= pair[1]),
            "consumer.retry_tiers_ms must not decrease (each retry waits at least as long as the one before): {:?}",
            self.consumer.retry_tiers_ms
        );
        Ok(tiers)
    }

    /// The tenants this consumer applies (`None`: all of them).
    pub fn only_tenants(&self) -> Option<Vec<String>> {
        let tenants: Vec<String> = self
            .consumer
            .only_tenants
            .split(',')
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .map(str::to_owned)
            .collect();
        (!tenants.is_empty()).then_some(tenants)
    }

    /// The bearer token of the read endpoints (see [`AuthSettings`]).
    pub fn service_token(&self) -> anyhow::Result<String> {
        self.service_token_given(std::env::var("SERVICE_TOKEN").ok())
    }

    /// [`Self::service_token`], with `SERVICE_TOKEN`'s value.
    fn service_token_given(&self, environment: Option<String>) -> anyhow::Result<String> {
        if let Some(token) = environment {
            if !token.trim().is_empty() {
                return Ok(token.trim().to_owned());
            }
        }
        if !self.auth.service_token.trim().is_empty() {
            return Ok(self.auth.service_token.trim().to_owned());
        }
        anyhow::ensure!(
            !self.auth.require_token,
            "SERVICE_TOKEN is required (auth.require_token is set)"
        );
        // The development token is in this repository: it opens the read
        // endpoints (and stock receipts) of a server only this machine
        // reaches, never one listening on other interfaces.
        let host = self.http.host.trim_start_matches('[').trim_end_matches(']');
        anyhow::ensure!(
            host == "localhost"
                || host
                    .parse::<std::net::IpAddr>()
                    .is_ok_and(|ip| ip.is_loopback()),
            "SERVICE_TOKEN is required when http.host ({}) is not a loopback address: \
             without it the endpoints would take the public local development token",
            self.http.host
        );
        tracing::warn!(
            token = LOCAL_DEV_TOKEN,
            "SERVICE_TOKEN not set: the read endpoints accept the local development token"
        );
        Ok(LOCAL_DEV_TOKEN.to_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_the_seed_tiers_and_validate() {
        let settings = Settings::local("inventory", "inventory", 8081);
        settings.validate().expect("valid");
        let secs: Vec<u64> = settings
            .retry_tiers()
            .expect("tiers")
            .iter()
            .map(Duration::as_secs)
            .collect();
        assert_eq!(secs, vec![10, 60, 300, 1800, 7200]);
        assert_eq!(settings.consumer.max_attempts, 5);
        assert!(settings.cleanup.inbox_retention_hours >= 7 * 24);
    }

    #[test]
    fn http_workers_are_refused_not_ignored() {
        let mut settings = Settings::local("inventory", "inventory", 8081);
        settings.http.workers = 4;
        let error = settings.validate().expect_err("not honoured here");
        assert!(error.to_string().contains("http.workers"), "{error}");
        settings.http.workers = 1;
        settings.validate().expect("what it does");
    }

    #[test]
    fn environment_overrides_tiers_name_and_partitions() {
        // A prefix no other test uses.
        std::env::set_var("CRT_SETTINGS_TEST__CONSUMER__RETRY_TIERS_MS", "50, 100,150");
        std::env::set_var("CRT_SETTINGS_TEST__CONSUMER__NAME", "t-inv");
        std::env::set_var("CRT_SETTINGS_TEST__CONSUMER__PARTITIONS", "2");
        let loaded: Settings = kit::settings::load(
            "CRT_SETTINGS_TEST",
            &Settings::local("inventory", "inventory", 8081),
        )
        .expect("load");
        assert_eq!(
            loaded.retry_tiers().expect("tiers"),
            vec![
                Duration::from_millis(50),
                Duration::from_millis(100),
                Duration::from_millis(150)
            ]
        );
        assert_eq!(loaded.consumer.name, "t-inv");
        assert_eq!(loaded.consumer.partitions, 2);
    }

    #[test]
    fn a_single_tier_from_the_environment_parses_too() {
        std::env::set_var("CRT_SETTINGS_ONE__CONSUMER__RETRY_TIERS_MS", "250");
        let loaded: Settings = kit::settings::load(
            "CRT_SETTINGS_ONE",
            &Settings::local("ledger", "ledger", 8082),
        )
        .expect("load");
        assert_eq!(
            loaded.retry_tiers().expect("tiers"),
            vec![Duration::from_millis(250)]
        );
    }

    #[test]
    fn the_local_development_token_serves_on_loopback_only() {
        let mut settings = Settings::local("inventory", "inventory", 8081);
        for host in ["127.0.0.1", "localhost", "::1", "[::1]", "127.0.0.2"] {
            settings.http.host = host.to_owned();
            assert_eq!(
                settings.service_token_given(None).expect(host),
                LOCAL_DEV_TOKEN
            );
        }
        for host in ["0.0.0.0", "::", "10.0.0.7", "inventory"] {
            settings.http.host = host.to_owned();
            let error = settings.service_token_given(None).expect_err(host);
            assert!(
                error.to_string().contains("not a loopback address"),
                "{error}"
            );
            // A token given is taken on any interface.
            assert_eq!(
                settings
                    .service_token_given(Some("s3cret".into()))
                    .expect(host),
                "s3cret"
            );
            settings.auth.service_token = "from-config".into();
            assert_eq!(
                settings.service_token_given(None).expect(host),
                "from-config"
            );
            settings.auth.service_token.clear();
        }
    }

    #[test]
    fn a_retention_shorter_than_the_replay_horizon_is_refused() {
        let mut settings = Settings::local("loyalty", "loyalty", 8083);
        settings.cleanup.inbox_retention_hours = 24;
        assert!(settings.validate().is_err());
        settings.cleanup.inbox_retention_hours = 8 * 24;
        settings.consumer.retry_tiers_ms = "0".into();
        assert!(settings.validate().is_err());
    }

    #[test]
    fn values_beyond_what_the_database_or_broker_take_are_refused() {
        let mut settings = Settings::local("loyalty", "loyalty", 8083);
        settings.cleanup.inbox_retention_hours = MAX_RETENTION_HOURS;
        settings.validate().expect("a century");
        settings.cleanup.inbox_retention_hours = MAX_RETENTION_HOURS + 1;
        assert!(settings.validate().is_err());
        settings.cleanup.inbox_retention_hours = u32::MAX;
        assert!(settings.validate().is_err());
        settings.cleanup.inbox_retention_hours = 8 * 24;
        settings.consumer.retry_tiers_ms = "10000,4294967295".into();
        settings.validate().expect("RabbitMQ's largest TTL");
        settings.consumer.retry_tiers_ms = "10000,4294967296".into();
        let error = settings.validate().expect_err("past RabbitMQ's TTL");
        assert!(
            error.to_string().contains("at most 4294967295 ms"),
            "{error}"
        );
    }

    #[test]
    fn a_delivery_limit_below_the_minimum_is_refused() {
        let mut settings = Settings::local("ledger", "ledger", 8082);
        for limit in [0, 1, MIN_DELIVERY_LIMIT - 1] {
            settings.consumer.delivery_limit = limit;
            let error = settings.validate().expect_err("too small").to_string();
            assert!(
                error.contains("consumer.delivery_limit must be at least 5"),
                "{error}"
            );
        }
        settings.consumer.delivery_limit = MIN_DELIVERY_LIMIT;
        settings.validate().expect("the minimum");
    }

    #[test]
    fn decreasing_tiers_are_refused_and_equal_ones_allowed() {
        let mut settings = Settings::local("loyalty", "loyalty", 8083);
        settings.consumer.retry_tiers_ms = "10000,60000,5000".into();
        let error = settings.validate().expect_err("decreasing").to_string();
        assert!(error.contains("must not decrease"), "{error}");
        settings.consumer.retry_tiers_ms = "100,100,200".into();
        settings
            .validate()
            .expect("equal tiers are a valid backoff");
    }
}
