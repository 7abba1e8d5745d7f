//! Building the AMQP message of an outbox row and publishing a batch with
//! publisher confirms: every message of the batch is sent before any confirm
//! is awaited (pipelined), and the whole batch is bounded by a timeout.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use events::{headers, Envelope};
use futures_util::{stream::FuturesUnordered, FutureExt, StreamExt};
use lapin::{
    options::BasicPublishOptions,
    types::{AMQPValue, FieldTable},
    BasicProperties, Channel, Confirmation,
};
use uuid::Uuid;

use crate::claim::OutboxRow;

/// One message ready to go.
#[derive(Clone, Debug)]
pub struct Message {
    pub event_id: Uuid,
    pub routing_key: String,
    pub body: Vec<u8>,
    pub properties: BasicProperties,
}

/// The envelope of `row` (the JSON body every consumer reads). It borrows
/// the payload's text rather than copying it for every message. A negative
/// `schema_version` (the column has no CHECK) is no version the envelope
/// can carry: refused, never sent as another one.
pub fn envelope(row: &OutboxRow) -> Result<Envelope<&serde_json::value::RawValue>, String> {
    let schema_version = u32::try_from(row.schema_version).map_err(|_| {
        format!(
            "schema_version {} is not a version (the envelope's is unsigned)",
            row.schema_version
        )
    })?;
    Ok(Envelope {
        event_id: row.event_id,
        event_type: row.event_type.clone(),
        schema_version,
        tenant_id: row.tenant_id.clone(),
        aggregate_type: row.aggregate_type.clone(),
        aggregate_id: row.aggregate_id.clone(),
        aggregate_sequence: row.aggregate_sequence,
        occurred_at: row.occurred_at,
        payload: row.payload.get(),
    })
}

/// The message of `row`: body, routing key (= event type) and the
/// properties and headers of the wire contract (`events` crate docs).
/// `trace` is the W3C context to send (the publish span's own); `replayed`
/// adds the `replayed` header.
pub fn message(
    row: &OutboxRow,
    trace: &std::collections::HashMap<String, String>,
    replayed: bool,
) -> Result<Message, String> {
    // An AMQP short string (routing key, `type`) cannot hold a longer one:
    // the protocol library would panic converting it.
    if row.event_type.len() > SHORT_STRING_MAX {
        return Err(format!(
            "the event type is {} bytes long; AMQP allows at most {SHORT_STRING_MAX}",
            row.event_type.len()
        ));
    }
    let body = envelope(row)?
        .to_json_bytes()
        .map_err(|error| format!("cannot encode the envelope: {error}"))?;
    let mut table = FieldTable::default();
    let text = |s: &str| AMQPValue::LongString(s.into());
    table.insert(headers::AGGREGATE_ID.into(), text(&row.aggregate_id));
    table.insert(
        headers::AGGREGATE_SEQUENCE.into(),
        AMQPValue::LongLongInt(row.aggregate_sequence),
    );
    table.insert(
        headers::SCHEMA_VERSION.into(),
        AMQPValue::LongInt(row.schema_version),
    );
    table.insert(headers::TENANT_ID.into(), text(&row.tenant_id));
    table.insert(headers::EVENT_TYPE.into(), text(&row.event_type));
    for name in [headers::TRACEPARENT, headers::TRACESTATE] {
        if let Some(value) = trace.get(name).filter(|v| !v.is_empty()) {
            table.insert(name.into(), text(value));
        }
    }
    if replayed {
        table.insert(headers::REPLAYED.into(), AMQPValue::Boolean(true));
    }
    let timestamp = u64::try_from(row.occurred_at.unix_timestamp()).unwrap_or_default();
    let properties = BasicProperties::default()
        .with_message_id(row.event_id.to_string().into())
        .with_type(row.event_type.as_str().into())
        .with_content_type(events::CONTENT_TYPE.into())
        .with_delivery_mode(2)
        .with_timestamp(timestamp)
        .with_headers(table);
    Ok(Message {
        event_id: row.event_id,
        routing_key: row.event_type.clone(),
        body,
        properties,
    })
}

/// The longest AMQP short string (the routing key and the `type` property
/// carry the event type).
const SHORT_STRING_MAX: usize = 255;

/// Refuse a body above `max_body` bytes (the broker's `max_message_size`)
/// before it is sent: the broker would close the channel, failing every
/// message in flight on it as an infrastructure failure and never
/// quarantining the one at fault. Likewise a content header frame above
/// `frame_max` (the connection's negotiated frame size): lapin sends the
/// properties and headers as one frame, and the broker closes the whole
/// connection on a larger one (501 FRAME_ERROR); and the consumers' copies
/// add up to [`events::CONSUMER_HEADER_ROOM`] bytes of headers, left free.
/// The headers carry the row's aggregate id, tenant and trace context,
/// which no column bounds. (An event type too long for AMQP is refused by
/// [`message`].)
pub fn check_limits(message: &Message, max_body: usize, frame_max: u32) -> Result<(), String> {
    if message.body.len() > max_body {
        return Err(format!(
            "the message is {} bytes; the broker takes at most {max_body} \
             (relay.max_message_bytes)",
            message.body.len()
        ));
    }
    let header = header_frame_bound(&message.properties);
    let room = events::CONSUMER_HEADER_ROOM;
    if header.saturating_add(room) > usize::try_from(frame_max).unwrap_or(usize::MAX) {
        return Err(format!(
            "the message's properties and headers take up to {header} bytes in one \
             frame, and the consumers' copies add up to {room}; the connection's frames \
             are at most {frame_max} bytes (frame_max)"
        ));
    }
    Ok(())
}

/// The size of the content header frame of `properties` (AMQP 0-9-1
/// sections 2.3.5 and 4.2.6), exact for every property and for the header
/// value types [`message`] sets; `usize::MAX` (refused) for a header value
/// of any other type, which no message here carries.
pub fn header_frame_bound(properties: &BasicProperties) -> usize {
    // Frame type, channel, size; class, weight, body size, property flags;
    // frame end.
    const FIXED: usize = 7 + 2 + 2 + 8 + 2 + 1;
    let short =
        |s: &Option<lapin::types::ShortString>| s.as_ref().map_or(0, |s| 1 + s.as_str().len());
    let mut size = FIXED
        + [
            properties.content_type(),
            properties.content_encoding(),
            properties.correlation_id(),
            properties.reply_to(),
            properties.expiration(),
            properties.message_id(),
            properties.kind(),
            properties.user_id(),
            properties.app_id(),
            properties.cluster_id(),
        ]
        .into_iter()
        .map(short)
        .sum::<usize>()
        + properties.delivery_mode().map_or(0, |_| 1)
        + properties.priority().map_or(0, |_| 1)
        + properties.timestamp().map_or(0, |_| 8);
    if let Some(table) = properties.headers() {
        size += 4;
        for (name, value) in table.inner() {
            size += 1 + name.as_str().len() + 1;
            size += match value {
                AMQPValue::LongString(text) => 4 + text.as_bytes().len(),
                AMQPValue::LongLongInt(_) => 8,
                AMQPValue::LongInt(_) => 4,
                AMQPValue::Boolean(_) => 1,
                _ => return usize::MAX,
            };
        }
    }
    size
}

/// The start of `last_error` for a row the relay could not make a message
/// of (not encodable, over a limit): it was not sent.
pub const NOT_SENDABLE: &str = "not sendable: ";

/// Why one message was not confirmed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PublishFailure {
    Returned(String),
    Nacked,
    Timeout,
    Channel(String),
    /// The row cannot become a message the broker takes (unreadable, not
    /// encodable, over a limit): the whole text for `last_error`.
    Encode(String),
}

impl PublishFailure {
    /// Every [`reason`](Self::reason), in declaration order (the metric's
    /// series start at zero from this list).
    pub const REASONS: [&'static str; 5] = ["returned", "nacked", "timeout", "channel", "encode"];

    /// The metric label.
    pub fn reason(&self) -> &'static str {
        match self {
            PublishFailure::Returned(_) => "returned",
            PublishFailure::Nacked => "nacked",
            PublishFailure::Timeout => "timeout",
            PublishFailure::Channel(_) => "channel",
            PublishFailure::Encode(_) => "encode",
        }
    }

    /// The text stored in `last_error`.
    pub fn describe(&self) -> String {
        match self {
            PublishFailure::Returned(text) => text.clone(),
            PublishFailure::Nacked => "negatively acknowledged by the broker".to_owned(),
            PublishFailure::Timeout => "no broker confirm within the confirm timeout".to_owned(),
            PublishFailure::Channel(error) => format!("channel error: {error}"),
            // The prefix tells an operator (and the runbook's replacement
            // guard) that the row never reached the broker this time.
            PublishFailure::Encode(why) => format!("{NOT_SENDABLE}{why}"),
        }
    }

    /// Whether the failure is the message's own (its route, its encoding),
    /// so that repeating it counts towards quarantine. A timeout, a broken
    /// channel or a nack is the infrastructure's: RabbitMQ nacks a message
    /// a queue refused for the queue's state (`x-overflow: reject-publish`
    /// on a full queue, as the consumers' partition queues are declared
    /// under a length limit; an internal queue error), hardly ever for the
    /// message itself (a byte-length policy below its size: that order is
    /// held, and alerted, until the policy changes). Retried with backoff,
    /// never quarantined, so a broker
    /// incident or a consumer down long enough to fill its queue cannot
    /// quarantine healthy orders; the publish-failure and oldest-pending-age
    /// alerts cover it.
    pub fn counts_towards_quarantine(&self) -> bool {
        matches!(
            self,
            PublishFailure::Returned(_) | PublishFailure::Encode(_)
        )
    }

    /// Whether the channel should be replaced after this failure.
    pub fn breaks_channel(&self) -> bool {
        matches!(self, PublishFailure::Timeout | PublishFailure::Channel(_))
    }
}

/// A confirm as the broker client reported it.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    Acked,
    Nacked,
    /// An ack (`acked`) or a nack with a returned message attached: the
    /// returned message's `message_id` as an event id (`None`: none
    /// readable), and the broker's reason.
    Returned {
        acked: bool,
        message_id: Option<Uuid>,
        text: String,
    },
    NotConfirmed,
}

fn verdict(confirmation: Confirmation) -> Verdict {
    let returned = |acked: bool, message: lapin::message::BasicReturnMessage| Verdict::Returned {
        acked,
        message_id: message
            .delivery
            .properties
            .message_id()
            .as_ref()
            .and_then(|id| Uuid::parse_str(id.as_str()).ok()),
        text: format!(
            "unroutable: returned by the broker ({} {})",
            message.reply_code, message.reply_text
        ),
    };
    match confirmation {
        Confirmation::Ack(None) => Verdict::Acked,
        Confirmation::Nack(None) => Verdict::Nacked,
        Confirmation::Ack(Some(message)) => returned(true, message),
        Confirmation::Nack(Some(message)) => returned(false, message),
        Confirmation::NotRequested => Verdict::NotConfirmed,
    }
}

/// The result of `event_id`'s own confirm.
///
/// lapin hands a returned message (`basic.return`, which RabbitMQ sends
/// before the confirm of the same message) to whichever confirm it
/// completes next, and completes the tags of a multiple ack in no set
/// order: a return can come attached to another message's confirm, and the
/// returned message's own confirm then looks like a plain ack. The returned
/// message carries its event id as `message_id`, so the return is counted
/// against that event (`returned_elsewhere`, applied once the batch's
/// confirms are in) and this confirm is judged on its own ack or nack. A
/// return without a readable id stays with the confirm it came with.
fn attribute(
    event_id: Uuid,
    verdict: Verdict,
    returned_elsewhere: &mut HashMap<Uuid, String>,
) -> Result<(), PublishFailure> {
    match verdict {
        Verdict::Acked => Ok(()),
        Verdict::Nacked => Err(PublishFailure::Nacked),
        Verdict::Returned {
            acked,
            message_id: Some(other),
            text,
        } if other != event_id => {
            returned_elsewhere.insert(other, text);
            if acked {
                Ok(())
            } else {
                Err(PublishFailure::Nacked)
            }
        }
        Verdict::Returned { text, .. } => Err(PublishFailure::Returned(text)),
        Verdict::NotConfirmed => Err(PublishFailure::Channel(
            "publisher confirms not enabled".to_owned(),
        )),
    }
}

/// The outcome of `event_id` from its confirm (`started`: when it was sent).
fn settle(
    event_id: Uuid,
    started: Instant,
    result: lapin::Result<Confirmation>,
    returned_elsewhere: &mut HashMap<Uuid, String>,
) -> Outcome {
    let result = match result {
        Ok(confirmation) => attribute(event_id, verdict(confirmation), returned_elsewhere)
            .map(|()| started.elapsed()),
        Err(error) => Err(PublishFailure::Channel(error.to_string())),
    };
    Outcome { event_id, result }
}

/// A returned message whose return came with another's confirm: its own
/// confirm may have looked like a plain ack, but it was not routed, so it
/// failed (never marked published).
fn attribute_returns(outcomes: &mut [Outcome], mut returned_elsewhere: HashMap<Uuid, String>) {
    for outcome in outcomes {
        if let Some(text) = returned_elsewhere.remove(&outcome.event_id) {
            if outcome.result.is_ok() {
                outcome.result = Err(PublishFailure::Returned(text));
            }
        }
    }
}

/// The outcome of one message of a batch.
#[derive(Debug)]
pub struct Outcome {
    pub event_id: Uuid,
    pub result: Result<Duration, PublishFailure>,
}

/// Publish `messages` to `exchange` on `channel` (publisher confirms
/// enabled, `mandatory`), all in flight at once, and wait for their confirms
/// until `deadline`. One outcome per message, in no particular order; on
/// success the confirm latency.
///
/// Every publish is handed to the connection before any is awaited: lapin
/// resolves a publish once its I/O thread has written the frames to the
/// socket, so awaiting them one by one cost a hand-off to that thread and
/// back per message. Each publish is polled once, in batch order, right
/// after it is created (that queues its frames and takes its delivery tag),
/// so the frames go out in batch order; then all are awaited together.
pub async fn publish_batch(
    channel: &Channel,
    exchange: &str,
    messages: Vec<(Message, tracing::Span)>,
    timeout: Duration,
) -> Vec<Outcome> {
    let deadline = tokio::time::Instant::now() + timeout;
    let ids: Vec<Uuid> = messages.iter().map(|(m, _)| m.event_id).collect();
    let mut outcomes = Vec::with_capacity(messages.len());
    let mut pending = FuturesUnordered::new();
    let mut sending = FuturesUnordered::new();
    type Sent = (
        Uuid,
        tracing::Span,
        Instant,
        lapin::Result<lapin::PublisherConfirm>,
    );
    let on_sent = |(event_id, span, started, send): Sent, outcomes: &mut Vec<Outcome>| match send {
        Ok(confirm) => {
            // The publish span (if any) lasts until the confirm: it is
            // closed when dropped. It is not entered around the awaits:
            // nothing the broker client logs is recorded into spans (see
            // kit::telemetry), so entering and leaving it on every poll of
            // 500 futures would be work for nothing.
            pending.push(async move {
                let result = confirm.await;
                drop(span);
                (event_id, started, result)
            });
        }
        Err(error) => outcomes.push(Outcome {
            event_id,
            result: Err(PublishFailure::Channel(error.to_string())),
        }),
    };
    for (message, span) in messages {
        let event_id = message.event_id;
        let started = Instant::now();
        let mut send = Box::pin(async move {
            let send = channel
                .basic_publish(
                    exchange.into(),
                    message.routing_key.as_str().into(),
                    BasicPublishOptions {
                        mandatory: true,
                        ..BasicPublishOptions::default()
                    },
                    &message.body,
                    message.properties,
                )
                .await;
            (event_id, span, started, send)
        });
        match (&mut send).now_or_never() {
            Some(done) => on_sent(done, &mut outcomes),
            None => sending.push(send),
        }
    }
    let all_sent = async {
        while let Some(done) = sending.next().await {
            on_sent(done, &mut outcomes);
        }
    };
    // Past the deadline, what is left gets no outcome here (see below).
    let _ = tokio::time::timeout_at(deadline, all_sent).await;
    // Returns that lapin attached to another message's confirm (below).
    let mut returned_elsewhere: HashMap<Uuid, String> = HashMap::new();
    let collect = async {
        while let Some((event_id, started, result)) = pending.next().await {
            outcomes.push(settle(event_id, started, result, &mut returned_elsewhere));
        }
    };
    let _ = tokio::time::timeout_at(deadline, collect).await;
    // One multiple ack completes several confirms at once; the deadline can
    // strike between collecting one of them and the next. Those resolved
    // already are collected too: a return attached to one of them may
    // belong to a message collected before.
    while let Some(Some((event_id, started, result))) = pending.next().now_or_never() {
        outcomes.push(settle(event_id, started, result, &mut returned_elsewhere));
    }
    attribute_returns(&mut outcomes, returned_elsewhere);
    if outcomes.len() < ids.len() {
        // Whatever has no outcome by the deadline timed out: not even
        // written to the socket (a blocked connection), or not confirmed.
        // The broker may still take it: a later retry is then a duplicate,
        // never a loss.
        let done: HashSet<Uuid> = outcomes.iter().map(|o| o.event_id).collect();
        for event_id in ids {
            if !done.contains(&event_id) {
                outcomes.push(Outcome {
                    event_id,
                    result: Err(PublishFailure::Timeout),
                });
            }
        }
    }
    outcomes
}

/// The message of `row` with its publish span: a child of the trace stored
/// with the row (the operation that caused the event), whose own context is
/// sent in the `traceparent`/`tracestate` headers.
///
/// When spans are not exported ([`kit::telemetry::exporting`]) there is no
/// publish span: nobody would see it, and building, propagating and closing
/// one per message was a quarter of the relay's CPU per event (make
/// bench-relay: 44-52 -> 33-36 µs). The stored context is then forwarded
/// unchanged, so the consumers still continue the producer's trace.
pub fn prepare(row: &OutboxRow, replayed: bool) -> Result<(Message, tracing::Span), String> {
    let (span, mut trace) = if kit::telemetry::exporting() {
        let span = tracing::info_span!(
            "outbox.publish",
            otel.kind = "producer",
            event_id = %row.event_id,
            event_type = %row.event_type,
            aggregate_id = %row.aggregate_id,
            aggregate_sequence = row.aggregate_sequence,
            replayed,
        );
        kit::telemetry::set_remote_parent(
            &span,
            row.traceparent.as_deref(),
            row.tracestate.as_deref(),
        );
        let trace = kit::telemetry::trace_headers(&span);
        (span, trace)
    } else {
        (tracing::Span::none(), std::collections::HashMap::new())
    };
    if !trace.contains_key(headers::TRACEPARENT) {
        // No publish span (not exporting, or disabled by the filter): still
        // continue the producer's trace by forwarding its context unchanged.
        for (name, value) in [
            (headers::TRACEPARENT, &row.traceparent),
            (headers::TRACESTATE, &row.tracestate),
        ] {
            if let Some(value) = value {
                trace.insert(name.to_owned(), value.clone());
            }
        }
    }
    let message = message(row, &trace, replayed)?;
    Ok((message, span))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row() -> OutboxRow {
        OutboxRow {
            event_id: Uuid::from_u128(0x0190_0000_0000_7000_8000_0000_0000_5001),
            tenant_id: "acme".into(),
            aggregate_type: "order".into(),
            aggregate_id: "00000000-0000-7000-8000-000000001042".into(),
            aggregate_sequence: 3,
            event_type: "PaymentReceived".into(),
            schema_version: 1,
            // jsonb's text form: shorter keys first, a space after `:` and `,`
            payload: crate::claim::Payload::new(
                r#"{"amount": "93.00", "order_id": "00000000-0000-7000-8000-000000001042", "note": "a, b: \"c\" \\"}"#,
            )
            .expect("valid JSON"),
            traceparent: Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into()),
            tracestate: Some("vendor=1".into()),
            occurred_at: time::macros::datetime!(2024-05-10 09:15:00 UTC),
            attempt_count: 0,
        }
    }

    #[test]
    fn the_message_follows_the_wire_contract() {
        let (message, _span) = prepare(&row(), false).expect("encodes");
        assert_eq!(message.routing_key, "PaymentReceived");
        assert_eq!(
            String::from_utf8(message.body).expect("utf-8"),
            "{\"event_id\":\"01900000-0000-7000-8000-000000005001\",\"event_type\":\"PaymentReceived\",\
             \"schema_version\":1,\"tenant_id\":\"acme\",\"aggregate_type\":\"order\",\
             \"aggregate_id\":\"00000000-0000-7000-8000-000000001042\",\"aggregate_sequence\":3,\
             \"occurred_at\":\"2024-05-10T09:15:00Z\",\
             \"payload\":{\"amount\":\"93.00\",\"order_id\":\"00000000-0000-7000-8000-000000001042\",\
             \"note\":\"a, b: \\\"c\\\" \\\\\"}}"
        );
        let p = &message.properties;
        assert_eq!(
            p.message_id().as_ref().map(|m| m.as_str()),
            Some("01900000-0000-7000-8000-000000005001")
        );
        assert_eq!(
            p.kind().as_ref().map(|k| k.as_str()),
            Some("PaymentReceived")
        );
        assert_eq!(
            p.content_type().as_ref().map(|c| c.as_str()),
            Some(events::CONTENT_TYPE)
        );
        assert_eq!(*p.delivery_mode(), Some(2));
        assert_eq!(*p.timestamp(), Some(1_715_332_500));
        let headers = p.headers().as_ref().expect("headers");
        let get = |name: &str| headers.inner().get(name).cloned();
        assert_eq!(
            get(headers::AGGREGATE_SEQUENCE),
            Some(AMQPValue::LongLongInt(3))
        );
        assert_eq!(get(headers::SCHEMA_VERSION), Some(AMQPValue::LongInt(1)));
        assert_eq!(
            get(headers::TENANT_ID),
            Some(AMQPValue::LongString("acme".into()))
        );
        assert_eq!(get(headers::REPLAYED), None);
        // Not exporting (and no subscriber here), so there is no publish span:
        // the stored context is forwarded unchanged rather than dropped.
        assert_eq!(
            get(headers::TRACEPARENT),
            Some(AMQPValue::LongString(
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into()
            ))
        );
        assert_eq!(
            get(headers::TRACESTATE),
            Some(AMQPValue::LongString("vendor=1".into()))
        );
        let (replayed, _) = prepare(&row(), true).expect("encodes");
        let headers = replayed.properties.headers().clone().expect("headers");
        assert_eq!(
            headers.inner().get(headers::REPLAYED),
            Some(&AMQPValue::Boolean(true))
        );
    }

    #[test]
    fn a_return_counts_against_the_message_it_names_not_the_confirm_it_came_with() {
        let (a, b) = (Uuid::from_u128(1), Uuid::from_u128(2));
        let returned = |acked, message_id| Verdict::Returned {
            acked,
            message_id,
            text: "unroutable: returned by the broker (312 NO_ROUTE)".to_owned(),
        };
        let mut elsewhere = HashMap::new();
        // b's return came with a's ack: a was routed, b was not.
        assert_eq!(
            attribute(a, returned(true, Some(b)), &mut elsewhere),
            Ok(())
        );
        assert_eq!(
            elsewhere.get(&b).map(String::as_str),
            Some("unroutable: returned by the broker (312 NO_ROUTE)")
        );
        // ... with a's nack: a failed as nacked, and b is still marked.
        let mut elsewhere = HashMap::new();
        assert_eq!(
            attribute(a, returned(false, Some(b)), &mut elsewhere),
            Err(PublishFailure::Nacked)
        );
        assert!(elsewhere.contains_key(&b));
        // Its own return, or one without a readable id: this message's failure.
        for id in [Some(a), None] {
            let mut elsewhere = HashMap::new();
            assert_eq!(
                attribute(a, returned(true, id), &mut elsewhere),
                Err(PublishFailure::Returned(
                    "unroutable: returned by the broker (312 NO_ROUTE)".to_owned()
                ))
            );
            assert!(elsewhere.is_empty());
        }
        let mut elsewhere = HashMap::new();
        assert_eq!(attribute(a, Verdict::Acked, &mut elsewhere), Ok(()));
        assert_eq!(
            attribute(a, Verdict::Nacked, &mut elsewhere),
            Err(PublishFailure::Nacked)
        );
        assert!(elsewhere.is_empty());
    }

    #[test]
    fn an_acked_message_whose_return_came_with_another_confirm_is_a_failure() {
        let (x, w, z) = (Uuid::from_u128(1), Uuid::from_u128(2), Uuid::from_u128(3));
        let ok = |event_id| Outcome {
            event_id,
            result: Ok(Duration::from_millis(1)),
        };
        // X's plain ack, W's ack carrying X's return, Z nacked.
        let mut outcomes = vec![
            ok(x),
            ok(w),
            Outcome {
                event_id: z,
                result: Err(PublishFailure::Nacked),
            },
        ];
        let returned = HashMap::from([
            (
                x,
                "unroutable: returned by the broker (312 NO_ROUTE)".to_owned(),
            ),
            (
                z,
                "unroutable: returned by the broker (312 NO_ROUTE)".to_owned(),
            ),
        ]);
        attribute_returns(&mut outcomes, returned);
        assert_eq!(
            outcomes[0].result,
            Err(PublishFailure::Returned(
                "unroutable: returned by the broker (312 NO_ROUTE)".to_owned()
            ))
        );
        assert!(outcomes[1].result.is_ok(), "W was routed");
        assert_eq!(
            outcomes[2].result,
            Err(PublishFailure::Nacked),
            "a failure stays"
        );
    }

    #[test]
    fn a_message_over_the_broker_s_limits_is_refused_before_it_is_sent() {
        let (message, _) = prepare(&row(), false).expect("encodes");
        let size = message.body.len();
        assert_eq!(check_limits(&message, size, 131_072), Ok(()));
        let error = check_limits(&message, size - 1, 131_072).expect_err("one byte over");
        assert!(error.contains("relay.max_message_bytes"), "{error}");
        // The header frame: exactly what lapin writes, within the bound.
        let frame = exact_header_frame(&message);
        let bound = header_frame_bound(&message.properties);
        assert_eq!(bound, frame, "the bound is exact for these types");
        // With the room the consumers' copies take.
        let frame_max = u32::try_from(frame + events::CONSUMER_HEADER_ROOM).expect("small");
        assert_eq!(check_limits(&message, size, frame_max), Ok(()));
        let error = check_limits(&message, size, frame_max - 1).expect_err("one byte over");
        assert!(error.contains("frame_max"), "{error}");
        assert!(
            error.contains("the consumers' copies add up to 2048"),
            "{error}"
        );
        // Every other property too (none of them set by `message`).
        let mut every = message.clone();
        every.properties = every
            .properties
            .with_content_encoding("identity".into())
            .with_correlation_id("c".into())
            .with_reply_to("r".into())
            .with_expiration("60000".into())
            .with_user_id("app".into())
            .with_app_id("outbox-relay".into())
            .with_cluster_id("x".into())
            .with_priority(1);
        assert_eq!(
            header_frame_bound(&every.properties),
            exact_header_frame(&every)
        );
        // A trace state no frame takes (the column has no bound).
        let mut traced = row();
        traced.tracestate = Some(format!("vendor={}", "a".repeat(200_000)));
        let (message, _) = prepare(&traced, false).expect("encodes");
        assert_eq!(
            header_frame_bound(&message.properties),
            exact_header_frame(&message)
        );
        let error = check_limits(&message, usize::MAX, 131_072).expect_err("too big a frame");
        assert!(
            error.contains("at most 131072 bytes (frame_max)"),
            "{error}"
        );
        let mut long = row();
        long.event_type = "E".repeat(256);
        let error = prepare(&long, false).expect_err("256 bytes");
        assert!(error.contains("at most 255"), "{error}");
        long.event_type.pop();
        let (message, _) = prepare(&long, false).expect("255 bytes encode");
        assert_eq!(message.routing_key.len(), 255);
    }

    /// The content header frame of `message` as lapin's protocol library
    /// writes it: frame type, channel, size (7), class, weight, body size
    /// (12), the properties with their flags, the frame end (1).
    fn exact_header_frame(message: &Message) -> usize {
        let properties = cookie_factory::gen_simple(
            lapin::protocol::basic::gen_properties(&message.properties),
            Vec::new(),
        )
        .expect("serialises");
        7 + 12 + properties.len() + 1
    }

    #[test]
    fn a_negative_schema_version_is_refused_not_sent_as_another() {
        let mut negative = row();
        negative.schema_version = -1;
        let error = prepare(&negative, false).expect_err("no such version");
        assert!(
            error.contains("schema_version -1 is not a version"),
            "{error}"
        );
        negative.schema_version = 0;
        let (message, _) = prepare(&negative, false).expect("0 is sent as 0");
        let sent: serde_json::Value = serde_json::from_slice(&message.body).expect("json");
        assert_eq!(sent["schema_version"], 0, "the consumers judge the version");
    }

    #[test]
    fn only_the_message_s_own_failures_count_towards_quarantine() {
        assert!(PublishFailure::Returned("312 NO_ROUTE".into()).counts_towards_quarantine());
        assert!(!PublishFailure::Nacked.counts_towards_quarantine());
        assert!(PublishFailure::Encode("x".into()).counts_towards_quarantine());
        assert!(!PublishFailure::Timeout.counts_towards_quarantine());
        assert!(!PublishFailure::Channel("closed".into()).counts_towards_quarantine());
        assert!(PublishFailure::Timeout.breaks_channel());
        assert!(!PublishFailure::Nacked.breaks_channel());
    }

    #[test]
    fn the_metric_s_reason_list_names_every_failure() {
        let reasons = [
            PublishFailure::Returned(String::new()),
            PublishFailure::Nacked,
            PublishFailure::Timeout,
            PublishFailure::Channel(String::new()),
            PublishFailure::Encode(String::new()),
        ]
        .map(|failure| failure.reason());
        assert_eq!(reasons, PublishFailure::REASONS);
    }
}
