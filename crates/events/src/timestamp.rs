//! RFC 3339 timestamps for serde, like `time::serde::rfc3339`, but with an
//! error that quotes the rejected text.

use std::fmt;

use serde::de::{self, Visitor};
use serde::{Deserializer, Serializer};
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;

/// Whether `value`'s UTC value lies in years 0000 to 9999. `time` parses
/// e.g. "9999-12-31T23:59:59-01:00", whose UTC value is in year 10000,
/// outside the range `time` supports: converting it to UTC (as binding it to
/// PostgreSQL does) would panic. And "0000-01-01T00:00:00+01:00" is in year
/// -1 in UTC: it would be stored, but RFC 3339 cannot write it back (a read
/// endpoint showing it would fail). Every timestamp of an event is checked.
pub(crate) fn in_utc_range(value: &OffsetDateTime) -> bool {
    value
        .checked_to_offset(time::UtcOffset::UTC)
        .is_some_and(|utc| (0..=9999).contains(&utc.year()))
}

/// `Err` naming `field` when `value` is out of [`in_utc_range`]'s range.
pub(crate) fn check_range(field: &str, value: &OffsetDateTime) -> Result<(), String> {
    if in_utc_range(value) {
        return Ok(());
    }
    Err(format!(
        "{field} {value} is out of range: its UTC value is not in years 0000 to 9999"
    ))
}

/// `text` as an RFC 3339 timestamp: `time`'s parser, which also takes any
/// one byte between the date and the time ("2024-05-10X09:15:00Z") and
/// drops fractional digits past the ninth, behind a check of those two:
/// `T` (or `t`, or a space, which RFC 3339 section 5.6 lets applications
/// use, and releases before took) there, at most nine fractional digits (a
/// nanosecond).
pub fn parse_rfc3339(text: &str) -> Result<OffsetDateTime, String> {
    // Parsed first, so that a wrong date or time is reported as such; then
    // what the parser let through.
    let at = OffsetDateTime::parse(text, &Rfc3339).map_err(|e| e.to_string())?;
    let bytes = text.as_bytes();
    if bytes.len() > 10 && !matches!(bytes[10], b'T' | b't' | b' ') {
        return Err(format!(
            "the date and the time must be separated by \"T\", not {:?}",
            char::from(bytes[10])
        ));
    }
    if let Some(fraction) = text.get(19..).and_then(|rest| rest.strip_prefix('.')) {
        let digits = fraction.bytes().take_while(u8::is_ascii_digit).count();
        if digits > 9 {
            return Err(format!(
                "at most 9 fractional digits (a nanosecond), not {digits}"
            ));
        }
    }
    Ok(at)
}

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
        parse_rfc3339(v)
            .map_err(|e| E::custom(format_args!("invalid RFC 3339 timestamp {v:?}: {e}")))
    }
}
