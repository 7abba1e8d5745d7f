//! `<consumer> redrive [--order <id>]`: move dead letters back to the
//! consumer's hash exchange (so each returns to its partition), per order in
//! sequence order, after un-parking the order. A malformed body (never
//! applicable: moved, it would park its order again) and the letters of
//! other orders (with `--order`) stay in the dead-letter queue, as new
//! copies of themselves (see [`keep`]).

use std::collections::{BTreeMap, HashMap, HashSet};

use kit::{db::PgPool, CancellationToken};
use lapin::{
    message::Delivery,
    options::{BasicAckOptions, BasicGetOptions, BasicNackOptions, ConfirmSelectOptions},
    types::FieldTable,
    Channel,
};

use crate::{
    process::{confirmed, publish, send, the_event_s_own, Infra},
    topology::{self, headers, Topology},
};

/// The first key of the advisory lock one redrive of a consumer holds
/// (the second: the consumer's name, hashed): "rd".
pub const LOCK_CLASS: i32 = 0x7264;

/// Whether `order` is parked for `consumer` (no progress row: not parked).
pub async fn parked(pool: &PgPool, consumer: &str, order: &str) -> anyhow::Result<bool> {
    let client = pool.get().await?;
    let row = client
        .query_opt(
            "SELECT parked_at IS NOT NULL FROM order_progress \
             WHERE consumer_name = $1 AND aggregate_id = $2",
            &[&consumer, &order],
        )
        .await;
    match row {
        Ok(row) => Ok(row.is_some_and(|row| row.get(0))),
        // An id the database cannot store has no progress row.
        Err(error) if the_event_s_own(&error).is_some() => Ok(false),
        Err(error) => Err(error.into()),
    }
}

/// One dead letter moved back.
#[derive(Debug, Clone)]
pub struct Moved {
    pub order: String,
    pub sequence: i64,
    pub event_id: String,
    pub event_type: String,
    pub reason: String,
}

/// What a redrive did.
#[derive(Debug, Default)]
pub struct Report {
    pub moved: Vec<Moved>,
    pub unparked: Vec<String>,
    /// Messages left in the dead-letter queue, with why.
    pub kept: Vec<String>,
    /// Letters dropped: malformed ones whose sequence is applied or whose
    /// event moved as a readable copy, and exact copies of another letter
    /// read.
    pub discarded: Vec<String>,
}

struct Letter {
    delivery: Delivery,
    /// The body is an envelope (a malformed one never applies anywhere).
    readable: bool,
    order: Option<String>,
    /// The tenant its envelope or metadata names.
    tenant: Option<String>,
    sequence: i64,
    event_id: String,
    event_type: String,
    reason: String,
}

fn letter(delivery: Delivery) -> Letter {
    let headers = delivery.properties.headers().as_ref();
    let raw = events::RawEnvelope::parse_raw(&delivery.data).ok();
    let order = raw
        .as_ref()
        .map(|r| r.aggregate_id.clone())
        .or_else(|| topology::str_header(headers, events::headers::AGGREGATE_ID));
    let tenant = raw
        .as_ref()
        .map(|r| r.tenant_id.clone())
        .or_else(|| topology::str_header(headers, events::headers::TENANT_ID));
    let sequence = raw
        .as_ref()
        .map(|r| r.aggregate_sequence)
        .or_else(|| topology::int_header(headers, events::headers::AGGREGATE_SEQUENCE))
        .unwrap_or(0);
    let event_id = raw
        .as_ref()
        .map(|r| r.event_id.to_string())
        .or_else(|| {
            delivery
                .properties
                .message_id()
                .as_ref()
                .map(|m| m.to_string())
        })
        .unwrap_or_default();
    let event_type = raw
        .as_ref()
        .map(|r| r.event_type.clone())
        .or_else(|| delivery.properties.kind().as_ref().map(|k| k.to_string()))
        .unwrap_or_default();
    let reason = topology::str_header(headers, headers::DEAD_LETTER_REASON).unwrap_or_default();
    Letter {
        delivery,
        readable: raw.is_some(),
        order,
        tenant,
        sequence,
        event_id,
        event_type,
        reason,
    }
}

/// The order's progress: its last applied sequence (0: none, or no
/// progress row), once an event is applied its tenant (the first applied
/// event's), and whether it is parked now.
struct Progress {
    last: i64,
    owner: Option<String>,
    parked: bool,
}

async fn progress(pool: &PgPool, consumer: &str, order: &str) -> anyhow::Result<Progress> {
    let client = pool.get().await?;
    let row = match client
        .query_opt(
            "SELECT last_sequence, tenant_id, parked_at IS NOT NULL FROM order_progress \
             WHERE consumer_name = $1 AND aggregate_id = $2",
            &[&consumer, &order],
        )
        .await
    {
        Ok(row) => row,
        // An id the database cannot even compare (a NUL byte, too long to
        // index): its events were dead-lettered alone, it has no progress.
        Err(error) if the_event_s_own(&error).is_some() => None,
        Err(error) => return Err(error.into()),
    };
    Ok(row.map_or(
        Progress {
            last: 0,
            owner: None,
            parked: false,
        },
        |row| {
            let last: i64 = row.get(0);
            Progress {
                last,
                owner: (last > 0).then(|| row.get(1)),
                parked: row.get(2),
            }
        },
    ))
}

/// Which of an order's letters (their `sequences`, sorted) to move: how
/// many lead the list up to the first hole after `last`, and the missing
/// sequence if there is a hole. The letters past a hole would only wait at
/// it (deferred, then failed: about 41 minutes) and park the order again;
/// a letter that belongs to no run of the order (another tenant's event
/// dead-lettered alone, say) must not hold back the ones that continue it.
/// Letters at or below `last` (applied already) move as harmless stale
/// copies.
fn continuing(last: i64, sequences: &[i64]) -> (usize, Option<i64>) {
    let mut next = last + 1;
    for (i, &sequence) in sequences.iter().enumerate() {
        if sequence > next {
            return (i, Some(next));
        }
        next = next.max(sequence + 1);
    }
    (sequences.len(), None)
}

/// Acknowledge `delivery`; `lost` says what it means when the channel
/// closed first, or the acknowledgement could not be written (the broker
/// returns the message to the queue when the connection goes). Bounded by
/// [`kit::amqp::WRITE_WAIT`]: under an alarm (which the redrive's own
/// publishes may have tripped) the run ends with its report.
async fn acknowledge(delivery: &Delivery, lost: impl FnOnce() -> String) -> anyhow::Result<()> {
    let acknowledged = match tokio::time::timeout(
        kit::amqp::WRITE_WAIT,
        delivery.acker.ack(BasicAckOptions::default()),
    )
    .await
    {
        Ok(acknowledged) => acknowledged?,
        Err(_) => false,
    };
    anyhow::ensure!(acknowledged, "{}", lost());
    Ok(())
}

/// Acknowledge (drop) `letter`, no longer needed; `line` is its entry in
/// the report's `discarded`.
async fn discard(report: &mut Report, letter: Letter, line: String) -> anyhow::Result<()> {
    // Crash window: a crash before this acknowledgement leaves the letter
    // in the DLQ (unacknowledged, the broker returns it); the next redrive
    // finds it needless again (its sequence applied, its readable copy
    // moved, or an exact copy of it kept) and drops it then. After it, the
    // letter is gone: it could never have applied, or a copy stays.
    kit::failpoint::crash_point("consumer.redrive.before_discard");
    acknowledge(&letter.delivery, || {
        format!(
            "letter {} could not be acknowledged (the channel closed, or the broker blocks the \
             connection): it stays in the DLQ (unless a blocked acknowledgement is written \
             later); run redrive again",
            letter.event_id
        )
    })
    .await?;
    report.discarded.push(line);
    Ok(())
}

/// [`discard`] a malformed `letter` of `order`, saying `why`.
async fn discard_malformed(
    report: &mut Report,
    letter: Letter,
    order: &str,
    why: &str,
) -> anyhow::Result<()> {
    let line = format!(
        "{} ({} #{} of order {order}): malformed; {why}",
        letter.event_id, letter.event_type, letter.sequence
    );
    discard(report, letter, line).await
}

/// Drop the exact copies among the `letters` read (same event id, order,
/// tenant, sequence and body: a crash between a kept letter's copy and its
/// acknowledgement, or an event dead-lettered twice), keeping the first
/// read of each (only its other headers, such as the reason, are kept).
/// Done before anything else, so a copy is neither moved twice nor listed
/// as kept beside its own discard. Safe at any point: the first stays
/// unacknowledged until it is moved or kept, both confirmed first, so a
/// crash from here on leaves one copy in the DLQ (the broker returns it).
/// `past_max` is the letter read past `--max`, if any (also dropped if a
/// copy).
async fn drop_exact_copies(
    report: &mut Report,
    letters: Vec<Letter>,
    past_max: Option<Letter>,
) -> anyhow::Result<(Vec<Letter>, Option<Letter>)> {
    let mut first = HashSet::new();
    let mut unique = Vec::with_capacity(letters.len());
    let mut last = None;
    let count = letters.len();
    for (i, letter) in letters.into_iter().chain(past_max).enumerate() {
        let copy_of = (
            letter.event_id.clone(),
            letter.order.clone(),
            letter.tenant.clone(),
            letter.sequence,
            letter.delivery.data.clone(),
        );
        if !letter.event_id.is_empty() && !first.insert(copy_of) {
            let line = format!(
                "{} ({}): an exact copy of another letter read",
                letter.event_id, letter.event_type
            );
            discard(report, letter, line).await?;
        } else if i < count {
            unique.push(letter);
        } else {
            last = Some(letter);
        }
    }
    Ok((unique, last))
}

/// Put `letters` back in the dead-letter queue. Each is published there
/// again as a new message and the one read is acknowledged after the
/// broker's confirm (all published first, then the confirms awaited): a
/// nack with requeue would count a delivery against it every run, and a
/// quorum queue with a delivery limit (RabbitMQ 4's default is 20) drops a
/// message past it. (Exact copies were dropped before, by
/// [`drop_exact_copies`].) After a failed move the channel may be gone: the
/// letters are only returned (`broken`).
async fn keep(
    channel: &Channel,
    topology: &Topology,
    letters: Vec<Letter>,
    broken: bool,
) -> anyhow::Result<()> {
    let dlq = topology.dead_letter_queue();
    let mut sent = Vec::new();
    // Returns are written until one is not (a blocked connection): the
    // rest are left to the connection's close, which returns them too.
    let mut writable = true;
    for letter in letters {
        if broken {
            if !writable {
                continue;
            }
            // Best effort: on a closed channel the broker returns it anyway,
            // and the move's own error is the one to report.
            let returning = letter.delivery.acker.nack(BasicNackOptions {
                requeue: true,
                multiple: false,
            });
            match tokio::time::timeout(kit::amqp::WRITE_WAIT, returning).await {
                Ok(Ok(_)) => {}
                Ok(Err(error)) => {
                    tracing::debug!(%error, event_id = letter.event_id, "returning a letter failed");
                }
                Err(_) => {
                    tracing::debug!(
                        event_id = letter.event_id,
                        "returning a letter: not written (blocked?); the connection's close returns the rest"
                    );
                    writable = false;
                }
            }
            continue;
        }
        let mut table = letter
            .delivery
            .properties
            .headers()
            .as_ref()
            .map(|table| table.inner().clone())
            .unwrap_or_default();
        // The broker's count of this message's deliveries: the copy is a
        // new message.
        table.remove(headers::DELIVERY_COUNT);
        let confirm = send(
            channel,
            "",
            dlq.as_str(),
            &letter.delivery.data,
            &letter.delivery.properties,
            FieldTable::from(table),
        )
        .await
        .map_err(|error| anyhow::anyhow!("keeping {}: {error}", letter.event_id))?;
        sent.push((letter, confirm));
    }
    for (letter, confirm) in sent {
        confirmed(confirm, dlq.as_str())
            .await
            .map_err(|error| anyhow::anyhow!("keeping {}: {error}", letter.event_id))?;
        // Crash window: the copy is confirmed in the DLQ, the letter read
        // not yet acknowledged. A crash here returns it to the DLQ too: two
        // copies; a later redrive that reads both drops the copy before
        // anything else (`drop_exact_copies`), unless the letter has no
        // event id (neither an envelope nor a message id: nothing tells a
        // copy from another message of the same bytes): that one stays
        // twice, as it stays after such a crash in the consumer.
        kit::failpoint::crash_point("consumer.redrive.after_keep_before_ack");
        acknowledge(&letter.delivery, || {
            format!(
                "dead letter {} was kept as a copy but could not be acknowledged (the channel \
                 closed, or the broker blocks the connection): it is in the DLQ twice (unless a \
                 blocked acknowledgement is written later)",
                letter.event_id
            )
        })
        .await?;
    }
    Ok(())
}

/// Un-park `order`, on the run's lock session (`lock`): a run whose lock
/// session ended (a database restart: the lock with it, and another run may
/// hold it now) fails here instead of un-parking beside that run.
async fn unpark(
    lock: &tokio_postgres::Client,
    consumer: &str,
    order: &str,
) -> anyhow::Result<bool> {
    let updated = match lock
        .execute(
            "UPDATE order_progress SET parked_at = NULL, parked_event_id = NULL, parked_sequence = NULL, \
             parked_reason = NULL, updated_at = now() \
             WHERE consumer_name = $1 AND aggregate_id = $2 AND parked_at IS NOT NULL",
            &[&consumer, &order],
        )
        .await
    {
        Ok(updated) => updated,
        // An id the database cannot store has no progress row to un-park.
        Err(error) if the_event_s_own(&error).is_some() => 0,
        Err(error) => {
            return Err(anyhow::Error::new(error)
                .context("un-parking on the redrive's lock session (the run stops)"))
        }
    };
    Ok(updated > 0)
}

/// Drain the dead-letter queue (holding every message unacknowledged), move
/// the selected ones back in per-order sequence order, keep the others.
/// The report says what was done also when the run failed part way (the
/// letters not yet settled return to the DLQ when the connection closes).
pub async fn redrive(
    pool: &PgPool,
    lock: &tokio_postgres::Client,
    amqp: &kit::settings::AmqpSettings,
    topology: &Topology,
    only_order: Option<&str>,
    max: usize,
) -> (Report, anyhow::Result<()>) {
    let mut report = Report::default();
    let shutdown = CancellationToken::new();
    let connection =
        match kit::amqp::connect(amqp, &format!("{}-redrive", topology.name), &shutdown).await {
            Ok(connection) => connection,
            Err(error) => return (report, Err(error.into())),
        };
    let mut opened = None;
    let result = async {
        topology.check_and_declare(&connection, true).await?;
        let channel = opened.insert(connection.create_channel().await?);
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        move_in_passes(pool, lock, channel, topology, only_order, max, &mut report).await
    }
    .await;
    // Closed before the connection (dropped open, it made lapin log an ERROR
    // at the end of every redrive).
    if let Some(channel) = opened {
        kit::amqp::close_bounded(&channel, "redrive done").await;
    }
    kit::amqp::close_connection_bounded(&connection, "redrive done").await;
    (report, result)
}

/// The orders a follow-up pass handles: those the first pass un-parked,
/// each with the highest sequence it moved (0: none).
type FollowUp = HashMap<String, i64>;

/// [`move_letters`], then, if it un-parked orders, one follow-up pass over
/// the DLQ for them. A live event of such an order that reached the
/// consumer between the first pass's drain and the un-park went to the DLQ
/// behind the park; the consumer holds the order's progress row locked
/// until that letter is confirmed there, and the un-park waits for the
/// lock, so the follow-up's drain finds every one of them. It moves them
/// after the letters the first pass moved (ahead of them in the order's
/// partition), instead of leaving them with the order un-parked and
/// waiting at its gap. Other letters it reads go back as they are, without
/// a report line (the first pass reported them, or a later run will). Its
/// drain reads at most `max` letters too, oldest first: on a DLQ holding
/// more, letters behind the park may lie past them (a later run moves
/// them).
async fn move_in_passes(
    pool: &PgPool,
    lock: &tokio_postgres::Client,
    channel: &Channel,
    topology: &Topology,
    only_order: Option<&str>,
    max: usize,
    report: &mut Report,
) -> anyhow::Result<()> {
    move_letters(pool, lock, channel, topology, only_order, max, None, report).await?;
    if report.unparked.is_empty() {
        return Ok(());
    }
    let follow_up: FollowUp = report
        .unparked
        .iter()
        .map(|order| {
            let through = report
                .moved
                .iter()
                .filter(|m| &m.order == order)
                .map(|m| m.sequence)
                .max()
                .unwrap_or(0);
            (order.clone(), through)
        })
        .collect();
    // Crash window: the first pass's un-parks, moves and acks stand; letters
    // dead-lettered behind the park during it stay in the DLQ, the order
    // un-parked, until a redrive is run again (which moves them; test
    // `a_redrive_killed_between_its_passes_leaves_letters_the_next_one_moves`).
    kit::failpoint::crash_point("consumer.redrive.after_first_pass");
    // Where a test holds the run between its passes, for an order it
    // un-parked to be parked again.
    kit::failpoint::hold_point("consumer.redrive.before_follow_up");
    let result = move_letters(
        pool,
        lock,
        channel,
        topology,
        None,
        max,
        Some(&follow_up),
        report,
    )
    .await;
    // A letter of these orders that the first pass kept is read again and
    // may be kept for the same reason: said once.
    let mut said = HashSet::new();
    report.kept.retain(|line| said.insert(line.clone()));
    result
}

/// One pass: drain the DLQ, move and keep. In a `follow_up` pass only the
/// letters of its orders are considered (the rest go back, unreported), an
/// order parked again meanwhile is left alone, none is un-parked, and an
/// order's letters continue from its last applied sequence or from the
/// highest one the first pass moved (in its partition ahead of them, maybe
/// not applied yet), whichever is higher.
#[allow(clippy::too_many_arguments)]
async fn move_letters(
    pool: &PgPool,
    lock: &tokio_postgres::Client,
    channel: &Channel,
    topology: &Topology,
    only_order: Option<&str>,
    max: usize,
    follow_up: Option<&FollowUp>,
    report: &mut Report,
) -> anyhow::Result<()> {
    let mut letters = Vec::new();
    let mut drained = false;
    while letters.len() < max.max(1) {
        let Some(message) = channel
            .basic_get(
                topology.dead_letter_queue().as_str().into(),
                BasicGetOptions { no_ack: false },
            )
            .await?
        else {
            drained = true;
            break;
        };
        letters.push(letter(message.delivery));
    }
    let mut past_max = None;
    if !drained {
        // Exactly `max` letters, or more? One more get tells (the extra one
        // is returned with the others).
        match channel
            .basic_get(
                topology.dead_letter_queue().as_str().into(),
                BasicGetOptions { no_ack: false },
            )
            .await?
        {
            Some(message) => past_max = Some(letter(message.delivery)),
            None => drained = true,
        }
    }

    // Where a test holds the run after its (first) drain, to dead-letter
    // live events behind a park the run is about to lift.
    if follow_up.is_none() {
        kit::failpoint::hold_point("consumer.redrive.after_drain");
    }
    let (letters, past_max) = drop_exact_copies(report, letters, past_max).await?;

    let mut selected: BTreeMap<String, Vec<Letter>> = BTreeMap::new();
    let mut others: Vec<Letter> = past_max.into_iter().collect();
    for letter in letters {
        match &letter.order {
            Some(order) if follow_up.is_some_and(|f| !f.contains_key(order)) => others.push(letter),
            None if follow_up.is_some() => others.push(letter),
            Some(order) if only_order.is_some_and(|o| o != order) => others.push(letter),
            None => {
                report.kept.push(format!(
                    "{} ({}): no order id, cannot be routed: {}",
                    letter.event_id, letter.event_type, letter.reason
                ));
                others.push(letter);
            }
            Some(order) => selected.entry(order.clone()).or_default().push(letter),
        }
    }

    if let Some(order) = only_order {
        if !drained {
            // Some of the order's letters may lie past `max`: un-parked with
            // them left behind, it would only wait at the gap and be parked
            // again. Move none; all go back.
            report.kept.push(format!(
                "order {order}: the dead-letter queue holds more than --max {max} letters; \
                 nothing moved, not un-parked (raise --max)"
            ));
            for letters in std::mem::take(&mut selected).into_values() {
                others.extend(letters);
            }
        } else if !selected.contains_key(order) && unpark(lock, &topology.name, order).await? {
            // Crash window: the order is un-parked (the DLQ holds none of its
            // letters: nothing to move); the letters read stay in the DLQ,
            // and only this run's report is lost.
            kit::failpoint::crash_point("consumer.redrive.after_unpark_without_letters");
            report.unparked.push(order.to_owned());
        }
    }
    let mut failure = None;
    for (order, mut letters) in selected {
        letters.sort_by_key(|l| l.sequence);
        if failure.is_some() {
            others.extend(letters);
            continue;
        }
        // The lock session ended (the database restarted, say): another
        // run may hold the lock now. Stop; the letters not settled go back.
        anyhow::ensure!(
            !lock.is_closed(),
            "the redrive's lock session ended: stopped (run it again)"
        );
        let Progress {
            last,
            owner,
            parked,
        } = progress(pool, &topology.name, &order).await?;
        if follow_up.is_some() && parked {
            report.kept.push(format!(
                "order {order}: parked again during the redrive: its {} letter(s) read after \
                 the un-park stay (redrive again after the fix)",
                letters.len()
            ));
            others.extend(letters);
            continue;
        }
        // Every letter from the next sequence on, without a hole: the rest
        // of the order's letters may lie past `--max`, or its earliest was
        // lowered into the DLQ behind later ones.
        let last = last.max(follow_up.and_then(|f| f.get(&order)).copied().unwrap_or(0));
        // A malformed letter (its order named by its metadata) never
        // applies: moved, it would only park the order again. It is not a
        // letter of its sequence, so it leaves a hole there until a
        // readable copy of the same event (a replay of it, dead-lettered
        // behind the park: the same event id) is among the letters. It is
        // dropped once the order applied its sequence, or once that copy
        // has been moved (below), and kept otherwise.
        let (readable, malformed): (Vec<Letter>, Vec<Letter>) =
            letters.into_iter().partition(|l| l.readable);
        let mut letters = readable;
        let mut twins = Vec::new();
        let mut hole = None::<i64>;
        for letter in malformed {
            let foreign = owner.is_some() && letter.tenant != owner;
            if letter.sequence < 1 || foreign {
                // No usable sequence, or another tenant's (dead-lettered
                // alone, its order never parked for it): no hole of the
                // order's, and nothing to tell it is applied.
                report.kept.push(format!(
                    "{} ({} of order {order}): the body is not an event and its metadata \
                     names {}: {}",
                    letter.event_id,
                    letter.event_type,
                    if foreign {
                        "another tenant"
                    } else {
                        "no sequence"
                    },
                    letter.reason
                ));
                others.push(letter);
            } else if letter.sequence <= last {
                discard_malformed(report, letter, &order, "its sequence is applied").await?;
            } else if letters.iter().any(|l| l.event_id == letter.event_id) {
                twins.push(letter);
            } else {
                report.kept.push(format!(
                    "{} ({} #{} of order {order}): the body is not an event and never \
                     applies; replay the event (`outbox-relay replay --consumer <name> \
                     --order {order}`) and redrive again: {}",
                    letter.event_id, letter.event_type, letter.sequence, letter.reason
                ));
                hole = Some(hole.map_or(letter.sequence, |h| h.min(letter.sequence)));
                others.push(letter);
            }
        }
        if let Some(hole) = hole {
            // Nothing at or past the malformed letter's sequence can apply
            // before a readable copy of it does.
            let at = letters.partition_point(|l| l.sequence < hole);
            others.extend(letters.split_off(at));
        }
        let sequences: Vec<i64> = letters.iter().map(|l| l.sequence).collect();
        let (moving, missing) = continuing(last, &sequences);
        if let Some(missing) = missing {
            let held = letters.split_off(moving);
            report.kept.push(format!(
                "order {order}: applied up to sequence {last}; no letter read holds sequence \
                 {missing} (past --max {max}, or never dead-lettered): {} letter(s) from \
                 sequence {} kept (raise --max, or replay the missing event)",
                held.len(),
                held.first().map_or(0, |l| l.sequence)
            ));
            others.extend(held);
        }
        if (missing.is_some() || hole.is_some()) && !letters.iter().any(|l| l.sequence > last) {
            // Nothing continues the order before the hole (a missing
            // letter, or a malformed one): it stays parked, its letters
            // wait with it. (Without a hole, copies of applied events move
            // as harmless stale ones and the order is un-parked.)
            others.extend(letters);
            others.extend(twins);
            continue;
        }
        // Un-park first, or the moved events would go straight back to the
        // DLQ. (A follow-up's orders are un-parked already; one parked again
        // since stays parked.)
        if follow_up.is_none() && unpark(lock, &topology.name, &order).await? {
            report.unparked.push(order.clone());
        }
        // Crash window: the order is un-parked, its letters unacknowledged
        // (back in the DLQ when the process dies). Its next events wait at
        // the gap (deferred, then failed and parked again); the next redrive
        // moves the letters and the order flows.
        kit::failpoint::crash_point("consumer.redrive.after_unpark_before_publish");
        let mut letters = letters.into_iter();
        for letter in letters.by_ref() {
            let mut table = topology::clean_headers(letter.delivery.properties.headers().as_ref());
            topology::set_str(&mut table, headers::REDRIVEN, "true");
            let published = publish(
                channel,
                &topology.exchange(),
                "",
                &letter.delivery.data,
                &letter.delivery.properties,
                table,
            )
            .await;
            match published {
                Ok(()) => {
                    // Crash window: the copy is confirmed in the consumer's
                    // exchange, the dead letter not yet acknowledged. A crash
                    // here returns the letter to the DLQ; the next redrive
                    // moves it again and the inbox takes the second copy as
                    // a duplicate.
                    kit::failpoint::crash_point("consumer.redrive.after_publish_before_ack");
                    acknowledge(&letter.delivery, || {
                        format!(
                            "dead letter {} of order {order} was sent back but could not be \
                             acknowledged (the channel closed, or the broker blocks the \
                             connection): it stays in the DLQ (unless a blocked \
                             acknowledgement is written later); run \
                             redrive again (the copy already sent is a duplicate the inbox skips)",
                            letter.event_id
                        )
                    })
                    .await?;
                    report.moved.push(Moved {
                        order: order.clone(),
                        sequence: letter.sequence,
                        event_id: letter.event_id,
                        event_type: letter.event_type,
                        reason: letter.reason,
                    });
                }
                Err(Infra::Broker(error) | Infra::Database(error)) => {
                    failure = Some(anyhow::anyhow!("moving {}: {error}", letter.event_id));
                    others.push(letter);
                    break;
                }
            }
        }
        others.extend(letters);
        // A malformed twin goes only once its readable copy is confirmed in
        // the consumer's exchange (and acknowledged here).
        for twin in twins {
            let moved = report
                .moved
                .iter()
                .any(|m| m.order == order && m.event_id == twin.event_id);
            if moved && failure.is_none() {
                discard_malformed(report, twin, &order, "its event moved as a readable copy")
                    .await?;
            } else {
                others.push(twin);
            }
        }
    }
    keep(channel, topology, others, failure.is_some()).await?;
    failure.map_or(Ok(()), Err)
}

#[cfg(test)]
mod tests {
    use super::continuing;

    #[test]
    fn the_letters_that_continue_the_order_move_and_those_past_a_hole_stay() {
        assert_eq!(continuing(2, &[3, 4, 5]), (3, None));
        assert_eq!(
            continuing(2, &[2, 3, 3, 4]),
            (4, None),
            "applied and repeated letters"
        );
        assert_eq!(continuing(0, &[1]), (1, None));
        assert_eq!(
            continuing(2, &[4, 5]),
            (0, Some(3)),
            "the next one is missing"
        );
        assert_eq!(continuing(2, &[3, 5]), (1, Some(4)), "a hole after 3");
        assert_eq!(continuing(5, &[2, 3]), (2, None), "only applied ones");
        assert_eq!(
            continuing(5, &[6, 7, 9]),
            (2, Some(8)),
            "a stray 9 does not hold 6 and 7"
        );
    }
}
