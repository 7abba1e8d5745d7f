//! The envelope every event travels in, and decoding into typed events.

use std::fmt;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use time::OffsetDateTime;
use uuid::Uuid;

use crate::v1::{OrderPlacedV1, ParcelDeliveredV1, PaymentReceivedV1};
use crate::{event_types, AGGREGATE_TYPE_ORDER};

/// A typed event payload: a payload struct bound to its event type and
/// schema (major) version.
///
/// Implementations must serialise as a JSON object and must not fail to
/// serialise for values built from valid input.
pub trait EventPayload: Serialize + DeserializeOwned {
    /// The `event_type` of envelopes carrying this payload (also the AMQP
    /// `type` property and the routing key).
    const EVENT_TYPE: &'static str;
    /// The `schema_version` (major version) of this payload.
    const SCHEMA_VERSION: u32;

    /// The rules of the version beyond its shape (amounts never negative,
    /// quantities at least 1, ...), as the producer enforces them: a
    /// payload breaking one is poison ([`DecodeError::InvalidPayload`]),
    /// dead-lettered at once rather than retried as a failing handler.
    fn check(&self) -> Result<(), String> {
        Ok(())
    }
}

/// The JSON body of every AMQP message. Field order on the wire is the
/// declaration order below.
///
/// Unknown envelope fields are ignored on read.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Envelope<P> {
    /// Unique id of the event; fixed when the outbox row is written and never
    /// changed on retry (the consumers' de-duplication key). Also the AMQP
    /// `message_id`.
    pub event_id: Uuid,
    /// What happened: `OrderPlaced`, ... (see [`crate::event_types`]).
    pub event_type: String,
    /// Major version of the payload schema for `event_type`.
    pub schema_version: u32,
    /// The tenant the event belongs to.
    pub tenant_id: String,
    /// The kind of aggregate: `"order"` for every current event.
    pub aggregate_type: String,
    /// The aggregate's id: the order id (UUID, hyphenated) for order events.
    pub aggregate_id: String,
    /// 1, 2, 3 ... per aggregate, with no gaps.
    pub aggregate_sequence: i64,
    /// When the event happened (RFC 3339).
    #[serde(with = "crate::timestamp")]
    pub occurred_at: OffsetDateTime,
    /// The event-specific payload.
    pub payload: P,
}

/// An envelope whose payload is not decoded yet. Every header field is
/// readable even when the event type or schema version is unknown to this
/// build.
///
/// The payload is kept as the text it was sent as ([`RawValue`]: checked to
/// be JSON, nothing built from it), so a payload this build cannot hold as a
/// JSON tree (nested deeper than serde_json's 128 levels, a number beyond
/// `f64`) is still a readable envelope: for a type a consumer ignores it is
/// acknowledged like any other, not poison (DESIGN.md section 4: a new type
/// must not need touching a consumer that ignores it). [`RawEnvelope::decode`]
/// reads it for the types this build knows.
pub type RawEnvelope = Envelope<Box<RawValue>>;

impl<P: EventPayload> Envelope<P> {
    /// Builds an envelope for `payload`, filling `event_type`,
    /// `schema_version` and `aggregate_type` (`"order"`) from the payload type.
    pub fn new(
        event_id: Uuid,
        tenant_id: impl Into<String>,
        aggregate_id: impl Into<String>,
        aggregate_sequence: i64,
        occurred_at: OffsetDateTime,
        payload: P,
    ) -> Self {
        Envelope {
            event_id,
            event_type: P::EVENT_TYPE.to_owned(),
            schema_version: P::SCHEMA_VERSION,
            tenant_id: tenant_id.into(),
            aggregate_type: AGGREGATE_TYPE_ORDER.to_owned(),
            aggregate_id: aggregate_id.into(),
            aggregate_sequence,
            occurred_at,
            payload,
        }
    }
}

impl<P> Envelope<P> {
    /// The idempotency key of an external side effect this event causes
    /// (an email, a call to a payment provider): the order and the
    /// operation, `"<tenant_id>:<aggregate_type>:<aggregate_id>:<operation>"`
    /// (seed 004: a stable key from the order id and the operation type).
    /// A consumer's inbox only covers its own database; a remote call made
    /// from a handler can run again when the transaction that records the
    /// event rolls back or its commit's reply is lost, so the provider must
    /// de-duplicate on this key (DESIGN.md section 8).
    ///
    /// The same for every copy of the event (a redelivery, a retry, a
    /// replay) and for every event of the order doing the same operation:
    /// a corrective event (a new event id) cannot charge an order twice.
    /// That is the seed's key, stricter than DESIGN.md's event id +
    /// operation. An operation an order can need more than once names its
    /// instance in `operation` (`"refund:<refund_id>"`).
    pub fn downstream_key(&self, operation: &str) -> String {
        format!(
            "{}:{}:{}:{operation}",
            self.tenant_id, self.aggregate_type, self.aggregate_id
        )
    }
}

impl<P: Serialize> Envelope<P> {
    /// The compact JSON body of the AMQP message.
    ///
    /// Fails only for values that have no wire form (e.g. an `occurred_at`
    /// outside years 0000-9999 or with a seconds-precision UTC offset, which
    /// RFC 3339 cannot express).
    pub fn to_json_bytes(&self) -> Result<Vec<u8>, EncodeError> {
        serde_json::to_vec(self).map_err(|source| EncodeError {
            event_type: self.event_type.clone(),
            source,
        })
    }

    /// The envelope with its payload encoded (compact JSON), as
    /// [`RawEnvelope::parse_raw`] reads it. Fails like
    /// [`Envelope::to_json_bytes`].
    pub fn into_raw(self) -> Result<RawEnvelope, EncodeError> {
        let payload = match serde_json::value::to_raw_value(&self.payload) {
            Ok(payload) => payload,
            Err(source) => {
                return Err(EncodeError {
                    event_type: self.event_type,
                    source,
                })
            }
        };
        Ok(Envelope {
            event_id: self.event_id,
            event_type: self.event_type,
            schema_version: self.schema_version,
            tenant_id: self.tenant_id,
            aggregate_type: self.aggregate_type,
            aggregate_id: self.aggregate_id,
            aggregate_sequence: self.aggregate_sequence,
            occurred_at: self.occurred_at,
            payload,
        })
    }
}

impl RawEnvelope {
    /// Parses an AMQP message body into a raw envelope.
    ///
    /// Fails with [`DecodeError::Malformed`] when the bytes are not a JSON
    /// object, an envelope field is missing or has the wrong type, or a
    /// header field is invalid (`event_type`, `tenant_id`, `aggregate_type`
    /// or `aggregate_id` empty; an order's `aggregate_id` not its lower-case
    /// hyphenated UUID; `aggregate_sequence` below 1; `occurred_at` not
    /// RFC 3339 ([`crate::parse_rfc3339`]) or whose UTC value is outside
    /// years 0000-9999). A malformed
    /// message is poison.
    /// The payload is only checked to be JSON (of any depth, numbers of any
    /// size): see [`RawEnvelope::decode`].
    pub fn parse_raw(bytes: &[u8]) -> Result<RawEnvelope, DecodeError> {
        // serde's derive would also accept a JSON array of the fields in
        // order; the contract is an object.
        if let Some(&first) = bytes.iter().find(|b| !b.is_ascii_whitespace()) {
            if first != b'{' {
                return Err(DecodeError::Malformed(
                    "the message body must be a JSON object".to_owned(),
                ));
            }
        }
        let envelope: RawEnvelope =
            serde_json::from_slice(bytes).map_err(|e| DecodeError::Malformed(e.to_string()))?;
        envelope.check_header()?;
        Ok(envelope)
    }

    /// Same as [`RawEnvelope::parse_raw`].
    pub fn parse(bytes: &[u8]) -> Result<RawEnvelope, DecodeError> {
        RawEnvelope::parse_raw(bytes)
    }

    fn check_header(&self) -> Result<(), DecodeError> {
        let empty = |name: &str| DecodeError::Malformed(format!("{name} must not be empty"));
        if self.event_type.is_empty() {
            return Err(empty("event_type"));
        }
        if self.tenant_id.is_empty() {
            return Err(empty("tenant_id"));
        }
        if self.aggregate_type.is_empty() {
            return Err(empty("aggregate_type"));
        }
        if self.aggregate_id.is_empty() {
            return Err(empty("aggregate_id"));
        }
        // An order's id in its one spelling, for every event of an order,
        // also of a type a consumer does not decode: the consumers
        // sequence, deduplicate and partition by the aggregate_id text, so
        // another spelling of the same UUID would be another order to them
        // (a consumer that ignores the type advanced that phantom order's
        // sequence, one that decodes it refused it).
        if self.aggregate_type == AGGREGATE_TYPE_ORDER
            && Uuid::try_parse(&self.aggregate_id)
                .map(|id| id.hyphenated().to_string())
                .as_deref()
                != Ok(self.aggregate_id.as_str())
        {
            return Err(DecodeError::Malformed(format!(
                "aggregate_id of an order must be its id as a lower-case hyphenated UUID, got {:?}",
                self.aggregate_id
            )));
        }
        if self.aggregate_sequence < 1 {
            return Err(DecodeError::Malformed(format!(
                "aggregate_sequence must be 1 or more, got {}",
                self.aggregate_sequence
            )));
        }
        crate::timestamp::check_range("occurred_at", &self.occurred_at)
            .map_err(DecodeError::Malformed)?;
        Ok(())
    }

    /// Decodes the payload according to `event_type` and `schema_version`.
    ///
    /// - an event type this build does not know: [`DecodeError::UnknownEventType`]
    ///   (consumers acknowledge and ignore it);
    /// - a known type with a version this build does not know:
    ///   [`DecodeError::UnsupportedSchemaVersion`] (poison);
    /// - a payload that does not match the schema, or an order event whose
    ///   `aggregate_type` is not `"order"` or whose `order_id` differs from
    ///   `aggregate_id`: [`DecodeError::InvalidPayload`] (poison).
    pub fn decode(&self) -> Result<Event, DecodeError> {
        match self.event_type.as_str() {
            event_types::ORDER_PLACED => {
                self.decode_order_event::<OrderPlacedV1>(|p| p.order_id, Event::OrderPlaced)
            }
            event_types::PAYMENT_RECEIVED => {
                self.decode_order_event::<PaymentReceivedV1>(|p| p.order_id, Event::PaymentReceived)
            }
            event_types::PARCEL_DELIVERED => {
                self.decode_order_event::<ParcelDeliveredV1>(|p| p.order_id, Event::ParcelDelivered)
            }
            _ => Err(DecodeError::UnknownEventType {
                event_type: self.event_type.clone(),
            }),
        }
    }

    fn decode_order_event<P: EventPayload>(
        &self,
        order_id: impl FnOnce(&P) -> Uuid,
        wrap: impl FnOnce(P) -> Event,
    ) -> Result<Event, DecodeError> {
        if self.schema_version != P::SCHEMA_VERSION {
            return Err(DecodeError::UnsupportedSchemaVersion {
                event_type: self.event_type.clone(),
                version: self.schema_version,
                supported: supported_versions(P::EVENT_TYPE),
            });
        }
        let invalid = |reason: String| DecodeError::InvalidPayload {
            event_type: self.event_type.clone(),
            version: self.schema_version,
            reason,
        };
        if self.aggregate_type != AGGREGATE_TYPE_ORDER {
            return Err(invalid(format!(
                "aggregate_type must be {AGGREGATE_TYPE_ORDER:?}, got {:?}",
                self.aggregate_type
            )));
        }
        // Read from the text as sent, not through a JSON tree of it: a field
        // the contract does not have (a newer producer's, ignored) is skipped
        // whatever it holds, a number beyond f64 or nesting past serde_json's
        // 128 levels included, which a tree of the payload could not hold
        // (the event was poison in every consumer).
        let payload: P =
            serde_json::from_str(self.payload.get()).map_err(|e| invalid(e.to_string()))?;
        // serde's derive also reads a struct from a JSON array of its fields
        // in order (the payload, a line); the contract's are objects.
        let typed = serde_json::to_value(&payload).map_err(|e| invalid(e.to_string()))?;
        objects_where_the_contract_has_them(&self.payload, &typed, "payload").map_err(invalid)?;
        payload.check().map_err(invalid)?;
        let order_id = order_id(&payload);
        // The order's id in its one spelling (lower-case, hyphenated, as
        // order-api writes it): the consumers sequence, deduplicate and
        // partition by the aggregate_id text, so another spelling of the
        // same UUID would be another order to them.
        if self.aggregate_id != order_id.hyphenated().to_string() {
            return Err(invalid(format!(
                "payload order_id {order_id} does not match aggregate_id {:?} \
                 (its lower-case hyphenated form)",
                self.aggregate_id
            )));
        }
        Ok(wrap(payload))
    }
}

/// `Err` naming the first place where `given` (the payload as sent) holds
/// something else than a JSON object where `typed` (the payload decoded and
/// encoded again, as the contract spells it) has one: a struct read from a
/// JSON array by position. Fields `given` lacks (defaults) are skipped.
/// `given` is read only where `typed` has an object or an array, each level
/// as raw values: nothing of a field the contract does not have is parsed.
fn objects_where_the_contract_has_them(
    given: &RawValue,
    typed: &serde_json::Value,
    path: &str,
) -> Result<(), String> {
    use serde_json::Value;
    match typed {
        Value::Object(typed) => {
            let given: std::collections::BTreeMap<String, Box<RawValue>> =
                serde_json::from_str(given.get())
                    .map_err(|_| format!("{path} must be a JSON object"))?;
            for (name, typed) in typed {
                if let Some(given) = given.get(name) {
                    objects_where_the_contract_has_them(given, typed, &format!("{path}.{name}"))?;
                }
            }
            Ok(())
        }
        Value::Array(typed) => {
            // Read as the payload's array already (the typed one came
            // from it); anything else has no object to check.
            let Ok(given) = serde_json::from_str::<Vec<Box<RawValue>>>(given.get()) else {
                return Ok(());
            };
            for (i, (given, typed)) in given.iter().zip(typed).enumerate() {
                objects_where_the_contract_has_them(given, typed, &format!("{path}[{i}]"))?;
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

/// The schema versions this build decodes for `event_type` (empty for an
/// unknown type).
#[must_use]
pub fn supported_versions(event_type: &str) -> &'static [u32] {
    match event_type {
        event_types::ORDER_PLACED
        | event_types::PAYMENT_RECEIVED
        | event_types::PARCEL_DELIVERED => &[1],
        _ => &[],
    }
}

/// A decoded event of a known type and version.
///
/// `#[non_exhaustive]`: new event types will be added, and a consumer must
/// handle the ones it does not care about with a `_` arm, so adding a type
/// never breaks it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Event {
    /// `OrderPlaced` v1.
    OrderPlaced(OrderPlacedV1),
    /// `PaymentReceived` v1.
    PaymentReceived(PaymentReceivedV1),
    /// `ParcelDelivered` v1.
    ParcelDelivered(ParcelDeliveredV1),
}

impl Event {
    /// The event type name (`OrderPlaced`, ...).
    #[must_use]
    pub fn event_type(&self) -> &'static str {
        match self {
            Event::OrderPlaced(_) => OrderPlacedV1::EVENT_TYPE,
            Event::PaymentReceived(_) => PaymentReceivedV1::EVENT_TYPE,
            Event::ParcelDelivered(_) => ParcelDeliveredV1::EVENT_TYPE,
        }
    }

    /// The schema version the event was decoded from.
    #[must_use]
    pub fn schema_version(&self) -> u32 {
        match self {
            Event::OrderPlaced(_) => OrderPlacedV1::SCHEMA_VERSION,
            Event::PaymentReceived(_) => PaymentReceivedV1::SCHEMA_VERSION,
            Event::ParcelDelivered(_) => ParcelDeliveredV1::SCHEMA_VERSION,
        }
    }

    /// The order the event is about.
    #[must_use]
    pub fn order_id(&self) -> Uuid {
        match self {
            Event::OrderPlaced(p) => p.order_id,
            Event::PaymentReceived(p) => p.order_id,
            Event::ParcelDelivered(p) => p.order_id,
        }
    }
}

impl From<OrderPlacedV1> for Event {
    fn from(p: OrderPlacedV1) -> Event {
        Event::OrderPlaced(p)
    }
}

impl From<PaymentReceivedV1> for Event {
    fn from(p: PaymentReceivedV1) -> Event {
        Event::PaymentReceived(p)
    }
}

impl From<ParcelDeliveredV1> for Event {
    fn from(p: ParcelDeliveredV1) -> Event {
        Event::ParcelDelivered(p)
    }
}

/// Why a message could not be decoded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DecodeError {
    /// Not JSON, not an envelope (a field missing or of the wrong type), or
    /// an invalid header field. Carries serde's message. Poison.
    Malformed(String),
    /// An event type this build does not know. Not an error for a consumer:
    /// acknowledge and ignore.
    UnknownEventType {
        /// The envelope's `event_type`.
        event_type: String,
    },
    /// A known event type in a schema version this build does not know. Poison.
    UnsupportedSchemaVersion {
        /// The envelope's `event_type`.
        event_type: String,
        /// The envelope's `schema_version`.
        version: u32,
        /// The versions this build decodes.
        supported: &'static [u32],
    },
    /// The payload does not match the schema of its known type and version
    /// (or contradicts the envelope). Poison.
    InvalidPayload {
        /// The envelope's `event_type`.
        event_type: String,
        /// The envelope's `schema_version`.
        version: u32,
        /// What is wrong, with serde's message where there is one.
        reason: String,
    },
}

impl DecodeError {
    /// `true` for [`DecodeError::UnknownEventType`]: the consumer should
    /// acknowledge and ignore the message.
    #[must_use]
    pub fn is_unknown_event_type(&self) -> bool {
        matches!(self, DecodeError::UnknownEventType { .. })
    }

    /// `true` for every other error: the message can never be processed by
    /// this build (dead-letter it, do not retry it).
    #[must_use]
    pub fn is_poison(&self) -> bool {
        !self.is_unknown_event_type()
    }
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DecodeError::Malformed(reason) => write!(f, "malformed event envelope: {reason}"),
            DecodeError::UnknownEventType { event_type } => {
                write!(f, "unknown event type {event_type:?}")
            }
            DecodeError::UnsupportedSchemaVersion {
                event_type,
                version,
                supported,
            } => {
                write!(
                    f,
                    "unsupported schema version {version} of event type {event_type:?} (supported:"
                )?;
                for v in *supported {
                    write!(f, " {v}")?;
                }
                f.write_str(")")
            }
            DecodeError::InvalidPayload {
                event_type,
                version,
                reason,
            } => write!(f, "invalid {event_type} v{version} payload: {reason}"),
        }
    }
}

impl std::error::Error for DecodeError {}

/// An envelope could not be serialised.
#[derive(Debug)]
pub struct EncodeError {
    event_type: String,
    source: serde_json::Error,
}

impl EncodeError {
    /// The event type of the envelope that failed to serialise.
    #[must_use]
    pub fn event_type(&self) -> &str {
        &self.event_type
    }
}

impl fmt::Display for EncodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "cannot encode {} event: {}",
            self.event_type, self.source
        )
    }
}

impl std::error::Error for EncodeError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.source)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn envelope_with_occurred_at(occurred_at: &str) -> String {
        format!(
            r#"{{"event_id":"6f1c2a4e-8b3d-4c5e-9f7a-0123456789ab","event_type":"OrderPlaced","schema_version":1,"tenant_id":"acme","aggregate_type":"order","aggregate_id":"6f1c2a4e-8b3d-4c5e-9f7a-0123456789ab","aggregate_sequence":1,"occurred_at":"{occurred_at}","payload":{{}}}}"#
        )
    }

    #[test]
    fn a_downstream_key_is_the_order_s_and_the_operation_s() {
        let body = envelope_with_occurred_at("2024-05-12T10:00:00Z");
        let first = RawEnvelope::parse_raw(body.as_bytes()).expect("valid");
        let copy = RawEnvelope::parse_raw(body.as_bytes()).expect("valid");
        assert_eq!(
            first.downstream_key("charge"),
            "acme:order:6f1c2a4e-8b3d-4c5e-9f7a-0123456789ab:charge"
        );
        assert_eq!(
            first.downstream_key("charge"),
            copy.downstream_key("charge")
        );
        // Another event of the same order (the first id in the body is the
        // event id): the same key, so it cannot charge the order again.
        let corrective =
            RawEnvelope::parse_raw(body.replacen("6f1c2a4e", "7f1c2a4e", 1).as_bytes())
                .expect("valid");
        assert_ne!(corrective.event_id, first.event_id);
        assert_eq!(
            corrective.downstream_key("charge"),
            first.downstream_key("charge")
        );
        assert_ne!(
            first.downstream_key("charge"),
            first.downstream_key("email")
        );
        let other_order = RawEnvelope::parse_raw(
            body.replace("\"aggregate_id\":\"6f1c2a4e", "\"aggregate_id\":\"8f1c2a4e")
                .as_bytes(),
        )
        .expect("valid");
        assert_ne!(
            other_order.downstream_key("charge"),
            first.downstream_key("charge")
        );
        let other_tenant =
            RawEnvelope::parse_raw(body.replace("\"acme\"", "\"globex\"").as_bytes())
                .expect("valid");
        assert_ne!(
            other_tenant.downstream_key("charge"),
            first.downstream_key("charge")
        );
    }

    #[test]
    fn occurred_at_whose_utc_value_is_out_of_range_is_malformed() {
        for occurred_at in [
            "9999-12-31T23:59:59-01:00",
            "9999-12-31T23:30:00-00:45",
            "0000-01-01T00:00:00+01:00",
        ] {
            let bytes = envelope_with_occurred_at(occurred_at);
            match RawEnvelope::parse_raw(bytes.as_bytes()) {
                Err(e @ DecodeError::Malformed(_)) => {
                    assert!(e.is_poison());
                    let text = e.to_string();
                    assert!(text.contains("occurred_at"), "{text}");
                    assert!(text.contains("out of range"), "{text}");
                }
                other => panic!("{occurred_at}: expected Malformed, got {other:?}"),
            }
        }
    }

    #[test]
    fn occurred_at_at_the_edges_of_the_utc_range_is_accepted() {
        for (occurred_at, year) in [
            ("9999-12-31T23:59:59Z", 9999),
            ("9999-12-31T22:59:59-01:00", 9999),
            ("0000-01-01T00:00:00Z", 0),
            ("0000-01-01T01:00:00+01:00", 0),
        ] {
            let bytes = envelope_with_occurred_at(occurred_at);
            let raw = RawEnvelope::parse_raw(bytes.as_bytes())
                .unwrap_or_else(|e| panic!("{occurred_at}: {e}"));
            assert_eq!(raw.occurred_at.to_offset(time::UtcOffset::UTC).year(), year);
        }
    }
}
