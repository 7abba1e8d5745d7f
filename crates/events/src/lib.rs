//! The wire contract of the order-events system: the envelope, the event
//! payloads and their schema versions, money and currency encoding, and the
//! names of the exchange, AMQP properties and headers. No IO.
//!
//! # Envelope
//!
//! Every AMQP message body is one JSON [`Envelope`], fields in this order:
//!
//! ```text
//! event_id, event_type, schema_version, tenant_id, aggregate_type ("order"),
//! aggregate_id, aggregate_sequence (1, 2, 3 ... per order), occurred_at, payload
//! ```
//!
//! - `event_id` is a UUID fixed when the outbox row is written and never
//!   changed on retry; consumers de-duplicate on it.
//! - `aggregate_id` is the order id (lower-case hyphenated UUID, its only
//!   accepted spelling) and
//!   `aggregate_sequence` numbers that order's events 1, 2, 3 ... without gaps.
//! - `occurred_at` (and every other timestamp) is RFC 3339.
//! - Unknown envelope and payload fields are ignored on read.
//!
//! # AMQP message
//!
//! Published to the topic exchange [`EXCHANGE`] with routing key =
//! `event_type`, persistent (delivery mode 2), with the properties
//! `message_id` = `event_id`, `type` = `event_type`, `content_type` =
//! [`CONTENT_TYPE`], and the headers named in [`headers`]: `aggregate_id`
//! (consumers hash on it to partition by order), `aggregate_sequence`,
//! `schema_version`, `tenant_id`, `event_type`, `traceparent` (and
//! `tracestate` when present, W3C trace context), and `replayed` on
//! messages re-published by a replay. The headers duplicate envelope fields
//! for routing and tracing; the body is authoritative.
//!
//! # Money
//!
//! [`Money`] is an integer of minor units (`i64` cents) in code and in the
//! databases. On the wire it is a JSON **string** with exactly two decimal
//! places (`"40.00"`, `"-2.50"`, `"0.05"`), always next to a [`Currency`]
//! (an ISO 4217 code with two minor-unit digits). JSON numbers are rejected,
//! as are other scales, signs other than a leading `-`, whitespace, exponents
//! and leading zeros. Never a float.
//!
//! # Versioning
//!
//! `schema_version` is the payload's **major** version for its `event_type`.
//!
//! - Additive, optional fields stay in the same version: older readers
//!   ignore fields they do not know, and newer readers default fields that
//!   older producers do not send.
//! - A breaking change (removing, renaming or retyping a field, changing a
//!   meaning) bumps the version. A consumer decodes every version it knows
//!   and rejects an unknown version of a known type as poison
//!   ([`DecodeError::UnsupportedSchemaVersion`]): never silently.
//! - A new `event_type` needs no consumer change: an unknown type decodes to
//!   [`DecodeError::UnknownEventType`], which consumers acknowledge and
//!   ignore (they still read its header fields from the [`RawEnvelope`]),
//!   and [`Event`] is `#[non_exhaustive]`.
//!
//! Golden JSON files for every version live in `tests/golden/v<N>/`.
//!
//! # Decoding
//!
//! ```
//! # fn handle(body: &[u8]) -> Result<(), events::DecodeError> {
//! use events::{Event, RawEnvelope};
//!
//! let raw = RawEnvelope::parse_raw(body)?; // Malformed: poison
//! match raw.decode() {
//!     Ok(Event::OrderPlaced(order)) => { /* ... */ }
//!     Ok(_) => { /* a known event this consumer does not need */ }
//!     Err(e) if e.is_unknown_event_type() => { /* acknowledge, ignore */ }
//!     Err(e) => return Err(e), // unsupported version or invalid payload: poison
//! }
//! # Ok(())
//! # }
//! ```

mod currency;
mod envelope;
mod money;
mod timestamp;
pub mod v1;

pub mod name;

pub use currency::{Currency, CurrencyError, SUPPORTED_CURRENCIES};
pub use envelope::{
    supported_versions, DecodeError, EncodeError, Envelope, Event, EventPayload, RawEnvelope,
};
pub use money::{format_total, Money, MoneyError};
pub use timestamp::parse_rfc3339;
pub use v1::{DeliveredLineV1, OrderLineV1, OrderPlacedV1, ParcelDeliveredV1, PaymentReceivedV1};

/// The topic exchange every order event is published to (routing key =
/// `event_type`).
pub const EXCHANGE: &str = "order-events";

/// `aggregate_type` of every order event.
pub const AGGREGATE_TYPE_ORDER: &str = "order";

/// The AMQP `content_type` of every event message.
pub const CONTENT_TYPE: &str = "application/json";

/// Bytes of a message's AMQP content header frame that its producer leaves
/// free for the consumers: a consumer's copy of a message (to a retry tier,
/// a deferral, its dead-letter queue, a redrive) carries the message's
/// properties and headers plus its own, at most this many bytes (a dead
/// letter's: its reason, cut to 1,000 bytes, the consumer's name, at most
/// 200, the attempts, and a redriven event's mark). The broker's own headers on a delivery (its
/// `x-death` history of a retry and a dead-lettering, up to about 1.6 KB
/// with a retry's counts, which a redrive keeping a letter in the DLQ
/// copies as it is) take from the same room. A header frame over the
/// connection's `frame_max` makes the broker close the whole connection
/// (501 FRAME_ERROR), so a message the producer sent just under it would
/// come back as a copy no consumer can publish, the same on every
/// redelivery.
pub const CONSUMER_HEADER_ROOM: usize = 2048;

/// AMQP header names of event messages.
///
/// Besides these headers, the AMQP **properties** carry `message_id` =
/// `event_id`, `type` = `event_type` and `content_type` = [`CONTENT_TYPE`]
/// (delivery mode 2, persistent).
pub mod headers {
    /// The order id; the consistent-hash exchanges partition on it.
    pub const AGGREGATE_ID: &str = "aggregate_id";
    /// The per-order sequence number (1, 2, 3 ...).
    pub const AGGREGATE_SEQUENCE: &str = "aggregate_sequence";
    /// The payload's major schema version.
    pub const SCHEMA_VERSION: &str = "schema_version";
    /// The tenant the event belongs to.
    pub const TENANT_ID: &str = "tenant_id";
    /// W3C trace context `traceparent` of the operation that caused the event.
    pub const TRACEPARENT: &str = "traceparent";
    /// W3C trace context `tracestate`, when present.
    pub const TRACESTATE: &str = "tracestate";
    /// Set (to `true`) on messages re-published by a replay.
    pub const REPLAYED: &str = "replayed";
    /// The event type (also the AMQP `type` property and the routing key).
    pub const EVENT_TYPE: &str = "event_type";
}

/// `event_type` names (also the routing keys).
pub mod event_types {
    /// An order was placed: [`crate::OrderPlacedV1`].
    pub const ORDER_PLACED: &str = "OrderPlaced";
    /// A payment was received: [`crate::PaymentReceivedV1`].
    pub const PAYMENT_RECEIVED: &str = "PaymentReceived";
    /// A parcel was delivered: [`crate::ParcelDeliveredV1`].
    pub const PARCEL_DELIVERED: &str = "ParcelDelivered";
}
