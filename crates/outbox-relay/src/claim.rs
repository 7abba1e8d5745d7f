//! Claiming, marking and releasing outbox rows: every SQL statement of the
//! relay's hot path.
//!
//! The claim is one short transaction: select the due rows that are the
//! lowest unpublished sequence of their order, lock them `FOR UPDATE SKIP
//! LOCKED` (concurrent claimers skip each other's rows instead of waiting),
//! write the lease (`claimed_by`, `claim_until`), commit. Publishing happens
//! after the commit, outside any transaction; the lease keeps other
//! instances off the rows until it expires.

use std::error::Error;
use std::time::Duration;

use kit::db::PgPool;
use serde_json::value::RawValue;
use time::OffsetDateTime;
use tokio_postgres::types::{FromSql, ToSql, Type};
use uuid::Uuid;

pub use crate::floor::Floor;
use crate::settings::RelaySettings;

/// The leases (`claim_until` as each claim wrote it) whose batches the
/// workers of this process are settling: from the first write of a batch's
/// outcome (the mark, the failure write) until the last returns.
pub type SettlingLeases = std::sync::Mutex<Vec<OffsetDateTime>>;

/// One claimed outbox row, with everything needed to publish it.
#[derive(Clone, Debug)]
pub struct OutboxRow {
    pub event_id: Uuid,
    pub tenant_id: String,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub aggregate_sequence: i64,
    pub event_type: String,
    pub schema_version: i32,
    pub payload: Payload,
    pub traceparent: Option<String>,
    pub tracestate: Option<String>,
    pub occurred_at: OffsetDateTime,
    /// Failed attempts so far.
    pub attempt_count: i32,
}

impl OutboxRow {
    /// A row whose first twelve columns are, in this order: event_id,
    /// tenant_id, aggregate_type, aggregate_id, aggregate_sequence,
    /// event_type, schema_version, payload, traceparent, tracestate,
    /// occurred_at, attempt_count (the claim's RETURNING list; replay and the
    /// bench select the same).
    ///
    /// Fails for a row a writer other than order-api could have stored: an
    /// `occurred_at` outside the years the `time` crate supports (e.g.
    /// `'infinity'`, or past 9999) or a payload that is not JSON text. The
    /// relay records that as the event's own failure (it is quarantined with
    /// the reason, its order held), never a panic.
    pub fn try_from_row(row: &tokio_postgres::Row) -> Result<Self, tokio_postgres::Error> {
        Ok(OutboxRow {
            event_id: row.try_get(0)?,
            tenant_id: row.try_get(1)?,
            aggregate_type: row.try_get(2)?,
            aggregate_id: row.try_get(3)?,
            aggregate_sequence: row.try_get(4)?,
            event_type: row.try_get(5)?,
            schema_version: row.try_get(6)?,
            payload: row.try_get(7)?,
            traceparent: row.try_get(8)?,
            tracestate: row.try_get(9)?,
            occurred_at: row.try_get(10)?,
            attempt_count: row.try_get(11)?,
        })
    }
}

/// Why [`OutboxRow::try_from_row`] failed, with the cause (e.g. "error
/// deserializing column 10: value too large to decode").
pub fn unreadable(error: &tokio_postgres::Error) -> String {
    let cause = std::error::Error::source(error)
        .map(|cause| format!(": {cause}"))
        .unwrap_or_default();
    format!("cannot read the outbox row: {error}{cause}")
}

/// An outbox row's payload as the JSON text PostgreSQL stores, compacted,
/// and put into the envelope as it is.
///
/// The relay never looks inside a payload, so it does not build a JSON tree
/// for it: decoding the payload into a `serde_json::Value`, encoding it
/// again and dropping the tree took a quarter of the relay process's CPU
/// during a drain (`perf`, session 9). The key order is jsonb's (shorter
/// keys first): as valid as any, and the same on every publish of a row.
#[derive(Clone, Debug)]
pub struct Payload(Box<RawValue>);

impl Payload {
    /// The payload of `json`, which must be valid JSON.
    pub fn new(json: &str) -> Result<Self, serde_json::Error> {
        RawValue::from_string(compact(json)).map(Payload)
    }

    /// The compact JSON text.
    pub fn get(&self) -> &RawValue {
        &self.0
    }
}

/// `json` without the whitespace between its tokens (jsonb's text form puts
/// a space after every `:` and `,`); strings are copied untouched.
fn compact(json: &str) -> String {
    let mut out = Vec::with_capacity(json.len());
    let (mut in_string, mut escaped) = (false, false);
    for &byte in json.as_bytes() {
        if in_string {
            if escaped {
                escaped = false;
            } else if byte == b'\\' {
                escaped = true;
            } else if byte == b'"' {
                in_string = false;
            }
        } else if byte == b'"' {
            in_string = true;
        } else if matches!(byte, b' ' | b'\n' | b'\r' | b'\t') {
            continue;
        }
        out.push(byte);
    }
    // Removing ASCII bytes from UTF-8 text leaves UTF-8 text.
    String::from_utf8(out).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
}

impl<'a> FromSql<'a> for Payload {
    fn from_sql(ty: &Type, raw: &'a [u8]) -> Result<Self, Box<dyn Error + Sync + Send>> {
        // jsonb's binary form is a version byte (1), then the text.
        let text = if *ty == Type::JSONB {
            match raw.split_first() {
                Some((1, text)) => text,
                _ => return Err("unsupported jsonb version".into()),
            }
        } else {
            raw
        };
        Ok(Payload::new(std::str::from_utf8(text)?)?)
    }

    fn accepts(ty: &Type) -> bool {
        *ty == Type::JSONB || *ty == Type::JSON
    }
}

/// The result of one claim.
#[derive(Debug, Default)]
pub struct Claimed {
    pub rows: Vec<OutboxRow>,
    /// Claimed rows that cannot be read ([`OutboxRow::try_from_row`]): event
    /// id, failed attempts so far, and why.
    pub undecodable: Vec<(Uuid, i32, String)>,
    /// How many of them had a lease that ran out (of any instance, this one
    /// included; quarantined ones too).
    pub taken_over: u64,
    /// How many of them were counted a failure of their own: the lease
    /// that ran out held the row alone (see [`CLAIM_SQL`]; quarantined ones
    /// too).
    pub counted: u64,
    /// Rows taken over whose own failures reached `max_attempts`: quarantined
    /// by the claim instead of leased (see [`CLAIM_SQL`]), with the reason.
    pub quarantined: Vec<(Uuid, String)>,
    /// The lease's end as written (one value for the whole claim: `now()`
    /// is the transaction's start). It names this claim: a later claim of
    /// the same rows, by another worker of the same instance, writes
    /// another. `None` when nothing was leased (nothing claimed, or only
    /// rows quarantined).
    pub lease_until: Option<OffsetDateTime>,
}

/// The claim statement. `$1` instance id, `$2` lease in ms, `$3` batch
/// size, `$4` only this tenant (empty: all), `$5` the floor: the walk starts
/// there ([`crate::floor`]: a row below it waits for the next refresh;
/// `-infinity`: walk from the start), `$6` the batch's byte bound, `$7` the
/// quarantine threshold (`max_attempts`), `$8` whether this claim may take
/// a suspect (below), `$9` the leases of this instance whose rows to leave
/// alone even once they ran out ([`SettlingLeases`]: a worker of this
/// process is writing their batch's outcome, retrying past the lease while
/// the database is unreachable; the write lands when it answers, where a
/// takeover would publish the rows again and count an expiry).
///
/// A row is claimable when it is unpublished, not quarantined, due
/// (`available_at`), not under a live lease, and the lowest unpublished
/// sequence of its order (the `NOT EXISTS`: any earlier unpublished row,
/// whether leased by someone else, in backoff or quarantined, holds it
/// back; an order's first event has nothing before it and skips the
/// probe). The outer scan walks `outbox_dispatch_idx` in `available_at`
/// order (oldest first) and the `NOT EXISTS` probes
/// `outbox_pending_sequence_idx`; both are partial indexes on
/// `published_at IS NULL`, so published rows cost nothing once vacuum has
/// removed their entries (until then the walk steps over them: hence the
/// floor).
///
/// Of the rows it locks, the claim takes, in that order, those whose
/// payloads before them stay under the byte bound (`relay.batch_max_bytes`,
/// in the bytes PostgreSQL stores, after its compression; the first row
/// always). The rows it locked and did not take are free again at its
/// commit.
///
/// A row whose lease ran out unsettled (`claimed_by` set, unpublished: the
/// mark and the failure write settle a row, a shutdown settles its batch
/// first) was held by a relay that died or stalled, usually not because of
/// the row (a relay killed with its batch, a node lost, a database outage
/// longer than the lease), possibly because of it (a payload that exhausts
/// its memory, a bug it triggers). `lease_expiries` counts such expiries
/// one after the other (orders V15; the failure write and requeue reset
/// it):
/// - at the first, the row is taken over like any other, in a batch;
/// - from the second on it is a suspect, taken **alone**, and only by an
///   instance's first worker (`$8`; the others skip suspects and claim
///   the rows behind them): a claim that meets one takes that one and
///   nothing else, so at most one suspect is in flight per process, and a
///   row that kills its relay again does not drag healthy rows through
///   every crash;
/// - only the expiry of a lease that held the row alone (the third expiry
///   on) counts as a failure of its own (`attempt_count`,
///   `own_failure_count`, `last_error` naming that lease's owner), and when
///   the count reaches `max_attempts` the claim quarantines the row instead
///   of leasing it (no payload returned): it and its order's later events
///   stop, with the reason, until `outbox-relay requeue`.
///
/// So a single crash is recovered at full speed, a healthy row is not
/// counted for another suspect's crash (it is published once taken alone),
/// and a row that kills every relay holding it is stopped after
/// `max_attempts` + 2 deaths, where it used to be taken over after every
/// lease expiry for ever, uncounted, with every relay of the fleet
/// crash-looping on it. Not covered:
/// - a process killed by a row of another worker's *batch* while its first
///   worker holds a suspect counts that suspect (at most twice per such
///   row: by its third death the row is a suspect itself);
/// - a relay alive but cut off from the database for longer than its
///   lease goes on retrying its mark (`relay::retry_until`; its process's
///   other workers spare the batch meanwhile, `$9`), but another instance
///   may take the rows over first: that counts as an expiry, and as a
///   failure for a suspect it held;
/// - two unrelated crashes (or such outages) in a row make every row then
///   in flight a suspect, drained one per claim by each instance's first
///   worker (each such claim locks up to `batch_size` rows to lease one);
///   the other workers go on with the rows behind them;
/// - a relay dying while it *receives* the claim's rows (one payload too
///   large for its memory) rolls the claim back, so nothing is leased or
///   counted; only the relays' restarts show it.
pub const CLAIM_SQL: &str = include_str!("claim.sql");

fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

/// Claim up to `settings.batch_size` rows (and about `batch_max_bytes` of
/// payload: one payload past it at most) for `instance` with a lease of `settings.lease_ms`, walking the
/// pending rows (of `settings.only_tenant`, if set) from `floor` on.
/// `may_take_suspects`: this is the instance's first worker; `settling`:
/// the leases whose batches the workers of this process are settling (see
/// [`CLAIM_SQL`], `$8` and `$9`), read once the transaction has begun.
///
/// Each of the relay's writes runs through [`kit::db::on_session`]: a
/// session that cannot write for its life (on a standby after a failover)
/// is closed, not handed to the next claim.
pub async fn claim(
    pool: &PgPool,
    instance: &str,
    settings: &RelaySettings,
    floor: Floor,
    may_take_suspects: bool,
    settling: &SettlingLeases,
) -> anyhow::Result<Claimed> {
    kit::db::on_session(pool, async |client| {
        if kit::failpoint::error_point("relay.claim.session_read_only") {
            // A test's stand-in for a session on a standby: every write of the
            // session fails from here on (25006).
            client
                .batch_execute("SET SESSION default_transaction_read_only = on")
                .await?;
        }
        let tx = client.transaction().await?;
        // Read after the BEGIN's answer, not before: the claim's `now()` is the
        // BEGIN's, and a lease that has run out by then was registered as
        // settling before its end, so before that answer. Read earlier (or
        // before a wait for a connection), a BEGIN held up on the network past
        // the lease's end found the list without it, and took over rows whose
        // confirmed batch this process was still marking (a duplicate publish,
        // a lease expiry counted against healthy rows).
        let spared = settling
            .lock()
            .map(|leases| leases.clone())
            .unwrap_or_default();
        // One round trip (an unnamed statement parsed, bound and run at once),
        // planned with these parameters every time, like a first execution.
        let rows = tx
            .query_typed(
                CLAIM_SQL,
                &[
                    (&instance, Type::TEXT),
                    (&millis(settings.lease()), Type::INT8),
                    (&settings.batch_size, Type::INT8),
                    (&settings.only_tenant, Type::TEXT),
                    (&floor, Type::TIMESTAMPTZ),
                    (&settings.batch_max_bytes, Type::INT8),
                    (&settings.max_attempts, Type::INT4),
                    (&may_take_suspects, Type::BOOL),
                    (&spared, Type::TIMESTAMPTZ_ARRAY),
                ],
            )
            .await?;
        // Crash window (fail point `relay.claim`, test `relay_crash_during_claim`):
        // before the commit the whole claim rolls back: no lease, and no
        // takeover counted or row quarantined by it; the next claim after the
        // same lease expiry does it again, once. After the commit the leases,
        // counts and quarantines stand and only this process's log lines and
        // metrics for them are lost (the quarantined gauge is recounted from the
        // table every `metrics_interval_ms`); its leased rows are taken over at
        // expiry, one more expiry each.
        kit::failpoint::crash_point("relay.claim");
        tx.commit().await?;
        let mut claimed = Claimed::default();
        for row in rows {
            let event_id: Uuid = row.get(0); // uuid NOT NULL: always readable
            let previous_owner: Option<String> = row.get(12);
            if let Some(previous_owner) = &previous_owner {
                claimed.taken_over += 1;
                tracing::warn!(%event_id, previous_owner, "took over an expired claim");
            }
            if row.get::<_, bool>(16) {
                claimed.counted += 1;
            }
            if row.get::<_, bool>(14) {
                // Quarantined by the claim: the reason is its last_error.
                let reason: Option<String> = row.get(15);
                claimed
                    .quarantined
                    .push((event_id, reason.unwrap_or_default()));
                continue;
            }
            // now() + a lease in ms: always finite, always readable.
            claimed.lease_until = Some(row.get(13));
            match OutboxRow::try_from_row(&row) {
                Ok(decoded) => claimed.rows.push(decoded),
                Err(error) => {
                    let attempts: i32 = row.get(11); // integer NOT NULL
                    tracing::error!(%event_id, error = %error, "claimed an outbox row that cannot be read");
                    claimed
                        .undecodable
                        .push((event_id, attempts, unreadable(&error)));
                }
            }
        }
        Ok(claimed)
    })
    .await
}

/// Mark confirmed rows published, in one statement. Only rows still under
/// the lease of the claim that published them (`claimed_by` = `instance`
/// and `claim_until` = `lease_until`, which the mark keeps, like
/// `claimed_by`: a published row names the lease that published it): a
/// row another claim took over after the lease ran out (another instance,
/// or another worker of this one) is left to that claim, which publishes
/// it again (a duplicate, never a loss) and marks it under its own lease.
/// Returns the number marked.
///
/// `retry`: an earlier attempt failed, and it may have committed with only
/// its reply lost (the connection broke). The rows marked so far are then
/// counted again after the update, in a statement of its own (a snapshot
/// taken after the update's row-lock waits: an earlier attempt still
/// running when the retry began has committed by then): published under
/// this lease. So `outbox_mark_lost_total` counts the rows another claim
/// took over (and, when the caller gives up, every confirmed row of the
/// batch, marked by a lost attempt or not). The first attempt needs no such
/// count.
pub async fn mark_published(
    pool: &PgPool,
    instance: &str,
    lease_until: OffsetDateTime,
    ids: &[Uuid],
    retry: bool,
) -> anyhow::Result<u64> {
    if ids.is_empty() {
        return Ok(0);
    }
    kit::db::on_session(pool, async |client| {
        let params: &[(&(dyn ToSql + Sync), Type)] = &[
            (&ids, Type::UUID_ARRAY),
            (&instance, Type::TEXT),
            (&lease_until, Type::TIMESTAMPTZ),
        ];
        let mut marked = client
            .execute_typed(
                "UPDATE outbox_events
                 SET published_at = now()
                 WHERE event_id = ANY($1) AND claimed_by = $2 AND claim_until = $3
                   AND published_at IS NULL",
                params,
            )
            .await?;
        if retry {
            let row = client
                .query_typed(
                    "SELECT count(*) FROM outbox_events
                     WHERE event_id = ANY($1) AND claimed_by = $2 AND claim_until = $3
                       AND published_at IS NOT NULL",
                    params,
                )
                .await?;
            marked = row
                .first()
                .map(|row| row.get::<_, i64>(0))
                .and_then(|n| u64::try_from(n).ok())
                .unwrap_or(marked);
        }
        // A committed mark whose reply is lost (the statement ran in its own
        // transaction): the caller retries it.
        anyhow::ensure!(
            !kit::failpoint::error_point("relay.mark.reply_lost"),
            "injected by fail point relay.mark.reply_lost: the mark committed, its reply was lost"
        );
        Ok(marked)
    })
    .await
}

/// A failed publish of one row.
#[derive(Clone, Debug)]
pub struct Failure {
    pub event_id: Uuid,
    pub error: String,
    /// Retry delay (backoff with jitter) in milliseconds.
    pub delay_ms: i64,
    /// Whether this failure counts towards quarantine (see
    /// [`crate::publish::PublishFailure::counts_towards_quarantine`]).
    pub quarantinable: bool,
}

/// Record failed attempts in one statement: `attempt_count + 1` (every
/// failure: it sets the backoff), `own_failure_count + 1` for a failure of
/// the message's own, `last_error`, `available_at = now() + delay`, lease
/// released; rows whose own failures reach `max_attempts` are quarantined
/// (infrastructure failures before them do not count).
/// Returns the event ids quarantined.
///
/// Only rows still under the lease of the claim that published them
/// (`claimed_by` and `claim_until` = `lease_until`): a write retried past
/// the lease must not release, back off and count a failure against a
/// later claim of the same rows (another worker of this instance, which may
/// be publishing them right now; its confirm could then no longer be
/// marked). The mark has the same guard ([`mark_published`]).
///
/// `retry`: an earlier attempt failed, and it may have committed with only
/// its reply lost. Its rows are then released, and the update matches none
/// of them (the statement is one transaction: all or none). The rows it
/// quarantined are read back (quarantined, released, unpublished, with this
/// write's error), so the quarantine is still logged and counted. Within
/// the lease no other claim can have touched them; past it (the caller
/// retries while the database is unreachable) another claim may have taken
/// a row over, failed it with the same error and quarantined it: counted
/// here too (the counter only; the gauge is recounted from the table).
pub async fn mark_failed(
    pool: &PgPool,
    instance: &str,
    lease_until: OffsetDateTime,
    failures: &[Failure],
    max_attempts: i32,
    retry: bool,
) -> anyhow::Result<Vec<Uuid>> {
    if failures.is_empty() {
        return Ok(Vec::new());
    }
    kit::db::on_session(pool, async |client| {
        let ids: Vec<Uuid> = failures.iter().map(|f| f.event_id).collect();
        let errors: Vec<&str> = failures.iter().map(|f| f.error.as_str()).collect();
        let delays: Vec<i64> = failures.iter().map(|f| f.delay_ms).collect();
        let quarantinable: Vec<bool> = failures.iter().map(|f| f.quarantinable).collect();
        let rows = client
            .query(
                "UPDATE outbox_events o
                 SET attempt_count = o.attempt_count + 1,
                     own_failure_count = o.own_failure_count + f.quarantinable::int,
                     last_error = f.error,
                     available_at = now() + f.delay_ms * interval '1 millisecond',
                     quarantined_at = CASE WHEN f.quarantinable AND o.own_failure_count + 1 >= $4
                                           THEN now() END,
                     claimed_by = NULL,
                     claim_until = NULL,
                     lease_expiries = 0
                 FROM unnest($1::uuid[], $2::text[], $3::bigint[], $6::bool[])
                      AS f(event_id, error, delay_ms, quarantinable)
                 WHERE o.event_id = f.event_id AND o.claimed_by = $5 AND o.claim_until = $7
                   AND o.published_at IS NULL
                 RETURNING o.event_id, o.quarantined_at IS NOT NULL",
                &[
                    &ids,
                    &errors,
                    &delays,
                    &max_attempts,
                    &instance,
                    &quarantinable,
                    &lease_until,
                ],
            )
            .await?;
        if retry && rows.is_empty() {
            let quarantined = client
                .query(
                    "SELECT o.event_id
                     FROM outbox_events o
                     JOIN unnest($1::uuid[], $2::text[]) AS f(event_id, error)
                       ON o.event_id = f.event_id
                     WHERE o.quarantined_at IS NOT NULL AND o.published_at IS NULL
                       AND o.claimed_by IS NULL AND o.last_error = f.error",
                    &[&ids, &errors],
                )
                .await?;
            return Ok(quarantined.iter().map(|row| row.get(0)).collect());
        }
        // A committed write whose reply is lost (the statement ran in its own
        // transaction): the caller retries it.
        anyhow::ensure!(
            !kit::failpoint::error_point("relay.mark_failed.reply_lost"),
            "injected by fail point relay.mark_failed.reply_lost: the failures were recorded, \
             the reply was lost"
        );
        Ok(rows
            .iter()
            .filter(|row| row.get::<_, bool>(1))
            .map(|row| row.get(0))
            .collect())
    })
    .await
}

/// Milliseconds until the earliest row in backoff becomes due, if any (to
/// sleep exactly that long instead of a whole poll interval).
pub async fn next_due_in(pool: &PgPool, only_tenant: &str) -> anyhow::Result<Option<Duration>> {
    let client = pool.get().await?;
    let row = client
        .query_typed_one(
            "SELECT (EXTRACT(EPOCH FROM min(available_at) - now()) * 1000)::bigint
             FROM outbox_events
             WHERE published_at IS NULL AND quarantined_at IS NULL AND available_at > now()
               AND ($1 = '' OR tenant_id = $1)",
            &[(&only_tenant, Type::TEXT)],
        )
        .await?;
    let ms: Option<i64> = row.get(0);
    Ok(ms.map(|ms| Duration::from_millis(u64::try_from(ms.max(0)).unwrap_or(0))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_payload_is_compacted_outside_its_strings_only() {
        let payload = Payload::new("{\"a\": [1, 2],\n\t\"b c\": \"x, y: \\\" z\\\\\", \"d\": {}}")
            .expect("valid JSON");
        assert_eq!(
            payload.get().get(),
            r#"{"a":[1,2],"b c":"x, y: \" z\\","d":{}}"#
        );
    }

    #[test]
    fn a_payload_nested_deeper_than_serde_json_s_recursion_limit_is_kept() {
        // A Value tree stops at 128 levels; the stored text has no limit, and
        // the relay carries it as it is (the consumer rejects it as poison).
        let deep = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
        assert!(serde_json::from_str::<serde_json::Value>(&deep).is_err());
        let payload = Payload::new(&deep).expect("kept");
        assert_eq!(payload.get().get(), deep);
    }

    #[test]
    fn the_jsonb_wire_form_is_a_version_byte_and_the_text() {
        let payload =
            Payload::from_sql(&Type::JSONB, b"\x01{\"k\": [true, null]}").expect("version 1");
        assert_eq!(payload.get().get(), r#"{"k":[true,null]}"#);
        assert!(Payload::from_sql(&Type::JSONB, b"\x02{}").is_err());
        assert!(Payload::from_sql(&Type::JSON, b"{\"k\": 1").is_err());
    }
}
