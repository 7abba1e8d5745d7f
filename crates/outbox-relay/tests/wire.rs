//! The bytes the relay actually sends decode to the wire contract's events.
//!
//! The golden files (crates/events/tests/golden) pin the typed encoder's
//! output; the relay does not use it: it publishes the payload as
//! PostgreSQL stores it (jsonb's text: keys reordered, other spacing) inside
//! an envelope of its own (`publish::message`). Each golden event, its
//! payload spelled another way, goes through the relay's message and must
//! decode to the golden event, with the contract's properties and headers.

use std::collections::HashMap;

use events::{headers, RawEnvelope};
use outbox_relay::{
    claim::{OutboxRow, Payload},
    publish,
};

const GOLDEN: [&str; 3] = [
    include_str!("../../events/tests/golden/v1/order_placed.json"),
    include_str!("../../events/tests/golden/v1/payment_received.json"),
    include_str!("../../events/tests/golden/v1/parcel_delivered.json"),
];

/// `payload` spelled as jsonb prints it: shorter keys first, `": "` and
/// `", "` between.
fn as_jsonb_prints(payload: &serde_json::Value) -> String {
    match payload {
        serde_json::Value::Object(fields) => {
            let mut keys: Vec<&String> = fields.keys().collect();
            keys.sort_by(|a, b| a.len().cmp(&b.len()).then(a.cmp(b)));
            let inner: Vec<String> = keys
                .into_iter()
                .map(|k| {
                    format!(
                        "{}: {}",
                        serde_json::Value::from(k.as_str()),
                        as_jsonb_prints(&fields[k])
                    )
                })
                .collect();
            format!("{{{}}}", inner.join(", "))
        }
        serde_json::Value::Array(items) => {
            let inner: Vec<String> = items.iter().map(as_jsonb_prints).collect();
            format!("[{}]", inner.join(", "))
        }
        other => other.to_string(),
    }
}

#[test]
fn the_relay_s_messages_decode_to_the_golden_events() {
    for golden in GOLDEN {
        let expected = RawEnvelope::parse_raw(golden.as_bytes()).expect("golden parses");
        let tree: serde_json::Value = serde_json::from_str(golden).expect("golden is JSON");
        let spelled = as_jsonb_prints(&tree["payload"]);
        assert_ne!(
            spelled,
            tree["payload"].to_string(),
            "the payload is spelled another way"
        );
        let row = OutboxRow {
            event_id: expected.event_id,
            tenant_id: expected.tenant_id.clone(),
            aggregate_type: expected.aggregate_type.clone(),
            aggregate_id: expected.aggregate_id.clone(),
            aggregate_sequence: expected.aggregate_sequence,
            event_type: expected.event_type.clone(),
            schema_version: i32::try_from(expected.schema_version).expect("version"),
            payload: Payload::new(&spelled).expect("payload"),
            traceparent: None,
            tracestate: None,
            occurred_at: expected.occurred_at,
            attempt_count: 0,
        };
        let message = publish::message(&row, &HashMap::new(), false).expect("message");
        let sent = RawEnvelope::parse_raw(&message.body).expect("the relay's body parses");
        assert_eq!(
            sent.decode().expect("the relay's body decodes"),
            expected.decode().expect("golden decodes"),
            "{}",
            expected.event_type
        );
        assert_eq!(
            (
                sent.event_id,
                &sent.tenant_id,
                &sent.aggregate_type,
                &sent.aggregate_id,
                sent.aggregate_sequence,
                sent.schema_version,
                sent.occurred_at,
            ),
            (
                expected.event_id,
                &expected.tenant_id,
                &expected.aggregate_type,
                &expected.aggregate_id,
                expected.aggregate_sequence,
                expected.schema_version,
                expected.occurred_at,
            )
        );
        let properties = &message.properties;
        assert_eq!(
            properties.message_id().as_ref().map(|id| id.to_string()),
            Some(expected.event_id.to_string())
        );
        assert_eq!(
            properties.kind().as_ref().map(|kind| kind.to_string()),
            Some(expected.event_type.clone())
        );
        assert_eq!(message.routing_key, expected.event_type);
        let table = properties.headers().as_ref().expect("headers");
        let header = |name: &str| table.inner().get(name).cloned();
        assert_eq!(
            header(headers::AGGREGATE_ID),
            Some(lapin::types::AMQPValue::LongString(
                expected.aggregate_id.as_str().into()
            ))
        );
        assert_eq!(
            header(headers::AGGREGATE_SEQUENCE),
            Some(lapin::types::AMQPValue::LongLongInt(
                expected.aggregate_sequence
            ))
        );
        assert_eq!(
            header(headers::TENANT_ID),
            Some(lapin::types::AMQPValue::LongString(
                expected.tenant_id.as_str().into()
            ))
        );
    }
}
