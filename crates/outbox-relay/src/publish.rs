//! Building the AMQP message of an outbox row and publishing a batch with
//! publisher confirms: every message of the batch is sent before any confirm
//! is awaited (pipelined), and the whole batch is bounded by a timeout.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use events::{headers, RawEnvelope};
use futures_util::{stream::FuturesUnordered, StreamExt};
use kit::amqp::{check_confirmation, PublishRejected};
use lapin::{
    options::BasicPublishOptions,
    types::{AMQPValue, FieldTable},
    BasicProperties, Channel,
};
use tracing::Instrument;
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

/// The envelope of `row` (the JSON body every consumer reads).
pub fn envelope(row: &OutboxRow) -> RawEnvelope {
    RawEnvelope {
        event_id: row.event_id,
        event_type: row.event_type.clone(),
        schema_version: u32::try_from(row.schema_version).unwrap_or_default(),
        tenant_id: row.tenant_id.clone(),
        aggregate_type: row.aggregate_type.clone(),
        aggregate_id: row.aggregate_id.clone(),
        aggregate_sequence: row.aggregate_sequence,
        occurred_at: row.occurred_at,
        payload: row.payload.clone(),
    }
}

/// The message of `row`: body, routing key (= event type) and the
/// properties and headers of the wire contract (`events` crate docs).
/// `trace` is the W3C context to send (the publish span's own); `replayed`
/// adds the `replayed` header.
pub fn message(
    row: &OutboxRow,
    trace: &std::collections::HashMap<String, String>,
    replayed: bool,
) -> Result<Message, events::EncodeError> {
    let body = envelope(row).to_json_bytes()?;
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

/// Why one message was not confirmed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PublishFailure {
    Returned(String),
    Nacked,
    Timeout,
    Channel(String),
    Encode(String),
}

impl PublishFailure {
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
            PublishFailure::Encode(error) => format!("cannot encode the envelope: {error}"),
        }
    }

    /// Whether the channel should be replaced after this failure.
    pub fn breaks_channel(&self) -> bool {
        matches!(self, PublishFailure::Timeout | PublishFailure::Channel(_))
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
pub async fn publish_batch(
    channel: &Channel,
    exchange: &str,
    messages: Vec<(Message, tracing::Span)>,
    timeout: Duration,
) -> Vec<Outcome> {
    let deadline = tokio::time::Instant::now() + timeout;
    let mut outcomes = Vec::with_capacity(messages.len());
    let mut pending = FuturesUnordered::new();
    let mut broken: Option<String> = None;
    let mut sent = Vec::new();
    for (message, span) in messages {
        let event_id = message.event_id;
        if let Some(error) = &broken {
            outcomes.push(Outcome {
                event_id,
                result: Err(PublishFailure::Channel(error.clone())),
            });
            continue;
        }
        let started = Instant::now();
        let send = tokio::time::timeout_at(
            deadline,
            channel
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
                .instrument(span.clone()),
        )
        .await;
        match send {
            Ok(Ok(confirm)) => {
                sent.push(event_id);
                pending.push(async move {
                    let result = confirm.instrument(span).await;
                    (event_id, started, result)
                });
            }
            Ok(Err(error)) => {
                broken = Some(error.to_string());
                outcomes.push(Outcome {
                    event_id,
                    result: Err(PublishFailure::Channel(error.to_string())),
                });
            }
            Err(_) => {
                broken = Some("timed out sending".to_owned());
                outcomes.push(Outcome {
                    event_id,
                    result: Err(PublishFailure::Timeout),
                });
            }
        }
    }
    let collect = async {
        while let Some((event_id, started, result)) = pending.next().await {
            let result = match result {
                Ok(confirmation) => match check_confirmation(confirmation) {
                    Ok(()) => Ok(started.elapsed()),
                    Err(PublishRejected::Returned { code, text }) => Err(PublishFailure::Returned(
                        format!("unroutable: returned by the broker ({code} {text})"),
                    )),
                    Err(PublishRejected::Nacked) => Err(PublishFailure::Nacked),
                    Err(PublishRejected::NotConfirmed) => Err(PublishFailure::Channel(
                        "publisher confirms not enabled".to_owned(),
                    )),
                },
                Err(error) => Err(PublishFailure::Channel(error.to_string())),
            };
            outcomes.push(Outcome { event_id, result });
        }
    };
    if tokio::time::timeout_at(deadline, collect).await.is_err() {
        // Whatever has no confirm yet timed out (the broker may still take
        // it: a later retry is then a duplicate, never a loss).
        let done: HashSet<Uuid> = outcomes.iter().map(|o| o.event_id).collect();
        for event_id in sent {
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
pub fn prepare(
    row: &OutboxRow,
    replayed: bool,
) -> Result<(Message, tracing::Span), events::EncodeError> {
    let span = tracing::info_span!(
        "outbox.publish",
        otel.kind = "producer",
        event_id = %row.event_id,
        event_type = %row.event_type,
        aggregate_id = %row.aggregate_id,
        aggregate_sequence = row.aggregate_sequence,
        replayed,
    );
    kit::telemetry::set_remote_parent(&span, row.traceparent.as_deref(), row.tracestate.as_deref());
    let mut trace = kit::telemetry::trace_headers(&span);
    if !trace.contains_key(headers::TRACEPARENT) {
        // The span is disabled (e.g. RUST_LOG=warn): still continue the
        // producer's trace by forwarding its context unchanged.
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
