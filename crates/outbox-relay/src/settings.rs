//! outbox-relay settings: defaults for the local setup, overridden by
//! `OUTBOX_RELAY__<SECTION>__<FIELD>` environment variables, e.g.
//! `OUTBOX_RELAY__RELAY__BATCH_SIZE=200` or
//! `OUTBOX_RELAY__CLEANUP__RETENTION_SECS=86400` (the replay horizon;
//! `..._AUDIT_RETENTION_SECS` the audit horizon: published rows are deleted
//! past the later of the two).

use std::time::Duration;

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
    pub relay: RelaySettings,
    pub cleanup: CleanupSettings,
}

/// Claiming, publishing and retrying (`OUTBOX_RELAY__RELAY__*`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RelaySettings {
    /// This instance's name in `claimed_by`; empty: `<hostname>-<pid>-<uuid>`.
    pub instance_id: String,
    /// Restrict this instance to one tenant's rows (a dedicated relay for a
    /// large tenant, or a test sharing a database); empty: every tenant. Its
    /// pending gauges count that tenant's rows only. Not its cleanup: that
    /// is one job over the whole table (every tenant's published rows past
    /// this instance's horizon, whichever instance holds the lock), so a
    /// dedicated relay runs it with the same `cleanup` settings as the
    /// others, or with `cleanup.enabled = false`.
    pub only_tenant: String,
    /// The topic exchange events are published to (routing key = event
    /// type). Default `order-events`, the exchange of the wire contract; a
    /// staging environment or a test can use its own.
    pub exchange: String,
    /// Rows claimed (and messages in flight) per batch.
    pub batch_size: i64,
    /// Bound on a batch's payloads, in the bytes PostgreSQL stores them in
    /// (`pg_column_size`, after its compression, so the text can be several
    /// times larger): a claim takes rows while the payloads before them stay
    /// under it (a batch passes it by one payload at most), and always its
    /// first row, whatever its size. The relay holds a
    /// batch's payloads two or three times over (the rows, the envelopes,
    /// the frames); this keeps a run of large rows from coming 500 at a
    /// time, where `batch_size` alone would let them.
    pub batch_max_bytes: i64,
    /// Batches worked on at once by this instance (each on its own channel).
    pub workers: usize,
    /// How long a claim is owned before another instance may take it over.
    /// At least `confirm_timeout_ms` + 2000 (the part kept for writing a
    /// batch's outcome).
    pub lease_ms: u64,
    /// Fallback wake-up when no NOTIFY arrives (NOTIFY is the normal path).
    pub poll_interval_ms: u64,
    /// Bound on publishing a batch and receiving all its confirms.
    pub confirm_timeout_ms: u64,
    /// Failures of the message's own (returned, not encodable) after which a
    /// row is quarantined (it and the later events of its order stop until
    /// `outbox-relay requeue`). Infrastructure failures (timeouts, a broken
    /// channel, a nack: a queue refusing for its state) back off like them
    /// but never count. A lease that ran out while it held the row alone
    /// (its relay died or stalled on it) counts as one of its own: a row
    /// that kills every relay publishing it is stopped instead of
    /// crash-looping them all (see [`crate::claim::CLAIM_SQL`]).
    pub max_attempts: i32,
    /// Retry delay after the first failure; doubles per attempt, with jitter.
    pub backoff_base_ms: u64,
    /// Upper bound of the retry delay.
    pub backoff_cap_ms: u64,
    /// How often the gauges (pending, oldest age, quarantined, table size) are refreshed.
    pub metrics_interval_ms: u64,
    /// How often the claim's floor is recomputed (see [`crate::floor`]): a
    /// row that committed below the current floor (its transaction ran for
    /// longer than `claim_floor_margin_ms`) waits until the next refresh.
    pub claim_floor_refresh_ms: u64,
    /// The floor stays at least this far behind the database's clock, so an
    /// order transaction still running when the floor is computed (its row's
    /// `available_at` is the transaction's start) commits above it.
    pub claim_floor_margin_ms: u64,
    /// The largest message body the relay sends: the broker's
    /// `max_message_size` (RabbitMQ's default, 128 MiB). A larger one would
    /// make the broker close the channel (a failure of every message in
    /// flight on it, never the message's own); the relay fails it alone,
    /// as its own failure, instead.
    pub max_message_bytes: usize,
}

/// Deleting published rows past the retention horizon (`OUTBOX_RELAY__CLEANUP__*`).
///
/// Seed 000: published rows are deleted only after both the replay horizon
/// and the audit horizon. The horizon is the later of the two
/// ([`CleanupSettings::horizon_secs`]): a published row is deleted once its
/// `published_at` is older than both `retention_secs` and
/// `audit_retention_secs`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CleanupSettings {
    /// Run the periodic cleanup in `serve` (one instance at a time, by
    /// advisory lock; every tenant's rows, also on an instance restricted
    /// to one: give every instance the same horizons).
    pub enabled: bool,
    /// The replay horizon: how long a published row stays replayable at
    /// least (`outbox-relay replay`; the consumers' inboxes must remember
    /// an event at least this long). Default 7 days. A replay re-sends every
    /// row still in the table, so up to the audit horizon when that is
    /// later (`--since` bounds it).
    pub retention_secs: u64,
    /// The audit horizon: how long a published row is kept as the record
    /// of what was sent; unset (the default), the replay horizon. Rows are
    /// deleted only past the later of the two.
    pub audit_retention_secs: Option<u64>,
    /// Pause between cleanup runs.
    pub interval_ms: u64,
    /// Rows deleted per batch (one short transaction each).
    pub batch_size: i64,
    /// Pause between batches, to leave room for the claim and mark queries.
    pub batch_pause_ms: u64,
}

impl Default for RelaySettings {
    fn default() -> Self {
        Self {
            instance_id: String::new(),
            only_tenant: String::new(),
            exchange: events::EXCHANGE.to_owned(),
            batch_size: 500,
            batch_max_bytes: 4_194_304,
            workers: 2,
            lease_ms: 30_000,
            poll_interval_ms: 1_000,
            confirm_timeout_ms: 10_000,
            max_attempts: 10,
            backoff_base_ms: 500,
            backoff_cap_ms: 300_000,
            metrics_interval_ms: 5_000,
            claim_floor_refresh_ms: 1_000,
            claim_floor_margin_ms: 10_000,
            max_message_bytes: 134_217_728,
        }
    }
}

impl Default for CleanupSettings {
    fn default() -> Self {
        Self {
            enabled: true,
            retention_secs: 7 * 24 * 3600,
            audit_retention_secs: None,
            interval_ms: 300_000,
            batch_size: 1_000,
            batch_pause_ms: 20,
        }
    }
}

/// The longest horizon accepted: a century (so that `now()` minus it is a
/// valid PostgreSQL timestamp, and the interval cannot overflow).
pub const MAX_RETENTION_SECS: u64 = 100 * 365 * 24 * 3600;

impl CleanupSettings {
    /// The retention horizon in seconds: the later of the replay and audit
    /// horizons (the audit one defaulting to the replay one).
    pub fn horizon_secs(&self) -> u64 {
        self.retention_secs
            .max(self.audit_retention_secs.unwrap_or(self.retention_secs))
    }
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            http: HttpSettings::local(9100),
            database: DatabaseSettings::local("orders"),
            amqp: AmqpSettings::default(),
            relay: RelaySettings::default(),
            cleanup: CleanupSettings::default(),
        }
    }
}

impl Settings {
    pub fn load() -> anyhow::Result<Self> {
        let settings: Self = kit::settings::load(ENV_PREFIX, &Self::default())?;
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
        let r = &self.relay;
        anyhow::ensure!(
            !r.exchange.is_empty() && r.exchange.len() <= 255,
            "relay.exchange must be 1 to 255 bytes long"
        );
        anyhow::ensure!(r.batch_size >= 1, "relay.batch_size must be at least 1");
        anyhow::ensure!(
            r.batch_max_bytes >= 1,
            "relay.batch_max_bytes must be at least 1"
        );
        anyhow::ensure!(r.workers >= 1, "relay.workers must be at least 1");
        anyhow::ensure!(r.max_attempts >= 1, "relay.max_attempts must be at least 1");
        anyhow::ensure!(
            r.max_message_bytes >= 1,
            "relay.max_message_bytes must be at least 1"
        );
        // Bounded so that deadlines (now + lease) and the SQL interval of the
        // lease cannot overflow: a day is far beyond any sane lease.
        anyhow::ensure!(
            r.lease_ms <= 86_400_000,
            "relay.lease_ms must be at most a day (86400000)"
        );
        // The confirms are awaited at most the lease left less the mark's
        // margin (`relay::confirm_wait`): a lease shorter than the confirm
        // timeout plus the margin cut every batch's wait short (at 2000 /
        // 1000, to nothing: every batch timed out, was sent again and never
        // marked).
        let margin = crate::relay::MARK_MARGIN.as_millis();
        anyhow::ensure!(
            u128::from(r.lease_ms) >= u128::from(r.confirm_timeout_ms) + margin,
            "relay.lease_ms ({}) must be at least relay.confirm_timeout_ms ({}) + {margin} \
             (the part of a lease kept for writing a batch's outcome)",
            r.lease_ms,
            r.confirm_timeout_ms
        );
        anyhow::ensure!(
            r.backoff_base_ms >= 1
                && r.backoff_cap_ms >= r.backoff_base_ms
                && r.backoff_cap_ms <= 86_400_000,
            "need 1 <= relay.backoff_base_ms <= relay.backoff_cap_ms <= 86400000 (a day)"
        );
        anyhow::ensure!(
            r.claim_floor_refresh_ms >= 1,
            "relay.claim_floor_refresh_ms must be at least 1"
        );
        anyhow::ensure!(
            r.claim_floor_margin_ms <= 86_400_000,
            "relay.claim_floor_margin_ms must be at most a day (86400000)"
        );
        anyhow::ensure!(
            self.cleanup.batch_size >= 1,
            "cleanup.batch_size must be at least 1"
        );
        for (name, value) in [
            ("cleanup.retention_secs", Some(self.cleanup.retention_secs)),
            (
                "cleanup.audit_retention_secs",
                self.cleanup.audit_retention_secs,
            ),
        ] {
            anyhow::ensure!(
                value.is_none_or(|secs| secs <= MAX_RETENTION_SECS),
                "{name} must be at most a century ({MAX_RETENTION_SECS})"
            );
        }
        // 0 would turn the idle wait, the cleanup pause and the gauge refresh
        // into busy loops, and a 0 ms confirm timeout would fail every
        // publish (as the infrastructure's fault: retried forever).
        for (name, value) in [
            ("relay.poll_interval_ms", r.poll_interval_ms),
            ("relay.confirm_timeout_ms", r.confirm_timeout_ms),
            ("relay.metrics_interval_ms", r.metrics_interval_ms),
            ("cleanup.interval_ms", self.cleanup.interval_ms),
        ] {
            anyhow::ensure!(value >= 1, "{name} must be at least 1");
        }
        Ok(())
    }
}

impl RelaySettings {
    pub fn lease(&self) -> Duration {
        Duration::from_millis(self.lease_ms)
    }
    pub fn poll_interval(&self) -> Duration {
        Duration::from_millis(self.poll_interval_ms)
    }
    pub fn confirm_timeout(&self) -> Duration {
        Duration::from_millis(self.confirm_timeout_ms)
    }

    /// The configured instance id, or `<hostname>-<pid>-<uuid v4 prefix>`.
    pub fn resolved_instance_id(&self) -> String {
        if !self.instance_id.trim().is_empty() {
            return self.instance_id.trim().to_owned();
        }
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .ok()
            .or_else(|| std::env::var("HOSTNAME").ok())
            .map(|h| h.trim().to_owned())
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| "relay".to_owned());
        let unique = uuid::Uuid::new_v4().simple().to_string();
        format!("{host}-{}-{}", std::process::id(), &unique[..8])
    }
}

/// The retry delay after failed attempt number `attempt` (1 for the first
/// failure): `base * 2^(attempt-1)` capped at `cap`, with "equal jitter"
/// (uniform in the upper half), so retries of many rows spread out but the
/// delay still grows. Integer milliseconds throughout.
pub fn backoff_ms(base_ms: u64, cap_ms: u64, attempt: i32, jitter: impl FnOnce(u64) -> u64) -> u64 {
    let exponent = u32::try_from(attempt.saturating_sub(1).clamp(0, 40)).unwrap_or(0);
    let full = base_ms
        .saturating_mul(1_u64.checked_shl(exponent).unwrap_or(u64::MAX))
        .min(cap_ms);
    let half = full / 2;
    (full - half) + jitter(half).min(half)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_is_capped_and_jitters_in_the_upper_half() {
        let no_jitter = |_| 0;
        let max_jitter = |half| half;
        assert_eq!(backoff_ms(100, 10_000, 1, no_jitter), 50);
        assert_eq!(backoff_ms(100, 10_000, 1, max_jitter), 100);
        assert_eq!(backoff_ms(100, 10_000, 2, max_jitter), 200);
        assert_eq!(backoff_ms(100, 10_000, 3, no_jitter), 200);
        assert_eq!(backoff_ms(100, 10_000, 3, max_jitter), 400);
        assert_eq!(backoff_ms(100, 10_000, 20, max_jitter), 10_000);
        assert_eq!(backoff_ms(100, 10_000, 20, no_jitter), 5_000);
        assert_eq!(backoff_ms(100, 10_000, i32::MAX, max_jitter), 10_000);
        assert_eq!(backoff_ms(100, 10_000, 0, max_jitter), 100);
        // A jitter source out of range is clamped.
        assert_eq!(backoff_ms(100, 10_000, 1, |_| 1_000_000), 100);
        for attempt in 1..30 {
            let low = backoff_ms(100, 60_000, attempt, no_jitter);
            let high = backoff_ms(100, 60_000, attempt, max_jitter);
            assert!(low <= high && high <= 60_000);
            assert!(backoff_ms(100, 60_000, attempt + 1, no_jitter) >= low);
        }
    }

    #[test]
    fn defaults_are_valid_and_instance_ids_are_unique() {
        let settings = Settings::default();
        settings.validate().expect("defaults valid");
        assert_eq!(settings.cleanup.retention_secs, 604_800);
        let a = settings.relay.resolved_instance_id();
        let b = settings.relay.resolved_instance_id();
        assert_ne!(a, b);
        assert!(a.contains(&std::process::id().to_string()));
        let named = RelaySettings {
            instance_id: "relay-a".into(),
            ..RelaySettings::default()
        };
        assert_eq!(named.resolved_instance_id(), "relay-a");
    }

    #[test]
    fn the_cleanup_horizon_is_the_later_of_the_replay_and_audit_horizons() {
        let day = 86_400;
        let cleanup = |retention_secs, audit_retention_secs| CleanupSettings {
            retention_secs,
            audit_retention_secs,
            ..CleanupSettings::default()
        };
        // Unset: the replay horizon.
        assert_eq!(CleanupSettings::default().horizon_secs(), 7 * day);
        assert_eq!(cleanup(3 * day, None).horizon_secs(), 3 * day);
        // Set: whichever is later.
        assert_eq!(cleanup(7 * day, Some(90 * day)).horizon_secs(), 90 * day);
        assert_eq!(cleanup(30 * day, Some(day)).horizon_secs(), 30 * day);
        assert_eq!(cleanup(0, Some(0)).horizon_secs(), 0);
        assert_eq!(
            cleanup(MAX_RETENTION_SECS, Some(MAX_RETENTION_SECS)).horizon_secs(),
            MAX_RETENTION_SECS
        );
    }

    #[test]
    fn retention_horizons_beyond_a_century_are_rejected() {
        let with = |retention_secs, audit_retention_secs| Settings {
            cleanup: CleanupSettings {
                retention_secs,
                audit_retention_secs,
                ..CleanupSettings::default()
            },
            ..Settings::default()
        };
        let century = MAX_RETENTION_SECS;
        with(century, Some(century))
            .validate()
            .expect("a century is allowed");
        with(century, None).validate().expect("unset audit horizon");
        for (retention, audit, named) in [
            (century + 1, None, "cleanup.retention_secs"),
            (u64::MAX, None, "cleanup.retention_secs"),
            (604_800, Some(century + 1), "cleanup.audit_retention_secs"),
            (604_800, Some(u64::MAX), "cleanup.audit_retention_secs"),
        ] {
            let error = with(retention, audit)
                .validate()
                .expect_err("beyond a century");
            assert!(error.to_string().contains(named), "{error}");
        }
    }

    #[test]
    fn durations_that_would_overflow_a_deadline_are_rejected() {
        let with = |relay: RelaySettings| Settings {
            relay,
            ..Settings::default()
        };
        for relay in [
            RelaySettings {
                lease_ms: u64::MAX,
                ..RelaySettings::default()
            },
            RelaySettings {
                backoff_cap_ms: u64::MAX,
                ..RelaySettings::default()
            },
        ] {
            assert!(with(relay).validate().is_err());
        }
        let day = RelaySettings {
            lease_ms: 86_400_000,
            backoff_cap_ms: 86_400_000,
            ..RelaySettings::default()
        };
        with(day).validate().expect("a day is allowed");
    }

    #[test]
    fn http_workers_are_refused_not_ignored() {
        let mut settings = Settings::default();
        settings.http.workers = 4;
        let error = settings.validate().expect_err("not honoured here");
        assert!(error.to_string().contains("http.workers"), "{error}");
        settings.http.workers = 1;
        settings.validate().expect("what it does");
    }

    #[test]
    fn a_lease_leaves_the_whole_confirm_timeout_and_the_mark_s_margin() {
        let with = |lease_ms, confirm_timeout_ms| Settings {
            relay: RelaySettings {
                lease_ms,
                confirm_timeout_ms,
                ..RelaySettings::default()
            },
            ..Settings::default()
        };
        for (lease, confirm) in [(2_000, 1_000), (11_000, 10_000), (10_000, 10_000)] {
            let error = with(lease, confirm).validate().expect_err("too short");
            assert!(
                error.to_string().contains("relay.lease_ms"),
                "{lease}/{confirm}: {error}"
            );
        }
        for (lease, confirm) in [(12_000, 10_000), (30_000, 10_000), (5_000, 3_000)] {
            let settings = with(lease, confirm);
            settings.validate().expect("long enough");
            // A claim that took no time awaits the whole confirm timeout.
            assert_eq!(
                crate::relay::confirm_wait(
                    settings.relay.confirm_timeout(),
                    settings.relay.lease()
                ),
                settings.relay.confirm_timeout(),
                "{lease}/{confirm}"
            );
        }
    }
}
