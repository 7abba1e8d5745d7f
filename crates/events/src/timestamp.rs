//! RFC 3339 timestamps for serde, like `time::serde::rfc3339`, but with an
//! error that quotes the rejected text.

use std::fmt;

use serde::de::{self, Visitor};
use serde::{Deserializer, Serializer};
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;

pub(crate) fn serialize<S: Serializer>(
    value: &OffsetDateTime,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    time::serde::rfc3339::serialize(value, serializer)
}

pub(crate) fn deserialize<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<OffsetDateTime, D::Error> {
    deserializer.deserialize_str(Rfc3339Visitor)
}

struct Rfc3339Visitor;

impl Visitor<'_> for Rfc3339Visitor {
    type Value = OffsetDateTime;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an RFC 3339 timestamp like \"2024-05-10T09:15:00Z\"")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<OffsetDateTime, E> {
        OffsetDateTime::parse(v, &Rfc3339)
            .map_err(|e| E::custom(format_args!("invalid RFC 3339 timestamp {v:?}: {e}")))
    }
}
