//! What the decoder refuses, and how it says so.

mod common;

use common::*;
use events::{DecodeError, Event, RawEnvelope};
use serde_json::{json, Value};
use time::macros::datetime;

const JSON_NUMBER: &str = "money must be a decimal string like \"40.00\", not a JSON number";

/// The golden file with `edit` applied to its JSON.
fn edited(file: &str, edit: impl FnOnce(&mut Value)) -> Vec<u8> {
    let mut value: Value = serde_json::from_str(file).expect("golden is JSON");
    edit(&mut value);
    serde_json::to_vec(&value).expect("encode")
}

/// Sets the JSON value at `pointer` (which must exist).
fn set(file: &str, pointer: &str, new: Value) -> Vec<u8> {
    edited(file, |v| {
        *v.pointer_mut(pointer)
            .unwrap_or_else(|| panic!("{pointer} not in golden")) = new;
    })
}

fn remove(file: &str, parent: &str, key: &str) -> Vec<u8> {
    edited(file, |v| {
        v.pointer_mut(parent)
            .and_then(Value::as_object_mut)
            .and_then(|o| o.remove(key))
            .unwrap_or_else(|| panic!("{parent}/{key} not in golden"));
    })
}

fn malformed(bytes: &[u8]) -> String {
    match RawEnvelope::parse_raw(bytes) {
        Err(e @ DecodeError::Malformed(_)) => {
            assert!(e.is_poison());
            assert!(!e.is_unknown_event_type());
            let text = e.to_string();
            assert!(text.starts_with("malformed event envelope: "), "{text}");
            text
        }
        other => panic!("expected Malformed, got {other:?}"),
    }
}

/// Parses (must succeed) then decodes (must fail with InvalidPayload);
/// returns the error text.
fn invalid_payload(bytes: &[u8]) -> String {
    let raw = RawEnvelope::parse_raw(bytes).expect("envelope is fine");
    match raw.decode() {
        Err(e @ DecodeError::InvalidPayload { .. }) => {
            assert!(e.is_poison());
            if let DecodeError::InvalidPayload {
                event_type,
                version,
                ..
            } = &e
            {
                assert_eq!(event_type, &raw.event_type);
                assert_eq!(*version, 1);
            }
            e.to_string()
        }
        other => panic!("expected InvalidPayload, got {other:?}"),
    }
}

fn assert_contains(text: &str, needle: &str) {
    assert!(
        text.contains(needle),
        "{text:?} does not contain {needle:?}"
    );
}

#[test]
fn malformed_json_is_malformed() {
    let text = malformed(b"{not json");
    assert_contains(&text, "key must be a string at line 1 column 2");
    assert_contains(&malformed(b""), "EOF while parsing a value");
    assert_contains(&malformed(b"[1, 2]"), "must be a JSON object");
    assert_contains(&malformed(b"null"), "must be a JSON object");
    assert_contains(&malformed(b" \n 42"), "must be a JSON object");
    let mut trailing = ORDER_PLACED_JSON.as_bytes().to_vec();
    trailing.extend_from_slice(b"{}");
    assert_contains(&malformed(&trailing), "trailing characters");
    assert_contains(&malformed(&[0xff, 0xfe, 0x00]), "must be a JSON object");
    assert_contains(
        &malformed(b"{\"event_id\": \"\xff\"}"),
        "invalid unicode code point",
    );
}

#[test]
fn missing_envelope_fields_are_malformed() {
    for field in [
        "event_id",
        "event_type",
        "schema_version",
        "tenant_id",
        "aggregate_type",
        "aggregate_id",
        "aggregate_sequence",
        "occurred_at",
        "payload",
    ] {
        let text = malformed(&remove(ORDER_PLACED_JSON, "", field));
        assert_contains(&text, &format!("missing field `{field}`"));
    }
}

#[test]
fn wrongly_typed_or_invalid_envelope_fields_are_malformed() {
    let cases: [(&str, Value, &str); 13] = [
        ("/event_id", json!("evt_5001"), "UUID"),
        ("/event_type", json!(7), "invalid type: integer `7`"),
        ("/schema_version", json!(-1), "invalid value: integer `-1`"),
        ("/schema_version", json!("1"), "invalid type: string \"1\""),
        (
            "/aggregate_sequence",
            json!("1"),
            "invalid type: string \"1\"",
        ),
        (
            "/aggregate_sequence",
            json!(0),
            "aggregate_sequence must be 1 or more, got 0",
        ),
        (
            "/occurred_at",
            json!("yesterday"),
            "invalid RFC 3339 timestamp \"yesterday\"",
        ),
        (
            "/occurred_at",
            json!(1_715_332_500),
            "expected an RFC 3339 timestamp",
        ),
        // `time`'s parser takes any byte between date and time, and drops
        // fractional digits past the ninth: refused before it.
        (
            "/occurred_at",
            json!("2024-05-10X09:15:00Z"),
            "separated by \"T\", not 'X'",
        ),
        (
            "/occurred_at",
            json!("2024-05-10_09:15:00Z"),
            "separated by \"T\", not '_'",
        ),
        (
            "/occurred_at",
            json!("2024-05-10T09:15:00.1234567899Z"),
            "at most 9 fractional digits (a nanosecond), not 10",
        ),
        ("/tenant_id", json!(""), "tenant_id must not be empty"),
        ("/event_type", json!(""), "event_type must not be empty"),
    ];
    for (pointer, value, needle) in cases {
        let text = malformed(&set(ORDER_PLACED_JSON, pointer, value));
        assert_contains(&text, needle);
    }
    assert_contains(
        &malformed(&set(ORDER_PLACED_JSON, "/aggregate_id", json!(""))),
        "aggregate_id must not be empty",
    );
    // RFC 3339 allows a lower-case `t` (and, by agreement, a space), and
    // nine fractional digits.
    for occurred_at in [
        "2024-05-10t09:15:00Z",
        "2024-05-10 09:15:00Z",
        "2024-05-10T09:15:00.123456789Z",
    ] {
        let bytes = set(ORDER_PLACED_JSON, "/occurred_at", json!(occurred_at));
        RawEnvelope::parse_raw(&bytes).unwrap_or_else(|e| panic!("{occurred_at}: {e}"));
    }
}

#[test]
fn unknown_event_type_is_ignorable_and_headers_stay_readable() {
    let bytes = edited(PAYMENT_RECEIVED_JSON, |v| {
        v["event_type"] = json!("RefundIssued");
        v["schema_version"] = json!(3);
        v["aggregate_sequence"] = json!(4);
        v["payload"] = json!({ "refund_id": "r-1", "amount": 12.5, "whatever": [1, 2] });
    });
    let raw = RawEnvelope::parse_raw(&bytes).expect("headers of unknown types parse");
    assert_eq!(raw.event_id, EVT_5002);
    assert_eq!(raw.event_type, "RefundIssued");
    assert_eq!(raw.schema_version, 3);
    assert_eq!(raw.tenant_id, "acme");
    assert_eq!(raw.aggregate_type, "order");
    assert_eq!(raw.aggregate_id, ORDER_1042.to_string());
    assert_eq!(raw.aggregate_sequence, 4);
    assert_eq!(raw.occurred_at, datetime!(2024-05-10 09:16:30 UTC));
    assert_eq!(
        serde_json::from_str::<Value>(raw.payload.get()).expect("json"),
        json!({ "refund_id": "r-1", "amount": 12.5, "whatever": [1, 2] }),
        "the payload as sent"
    );

    let err = raw.decode().expect_err("unknown type");
    assert_eq!(
        err,
        DecodeError::UnknownEventType {
            event_type: "RefundIssued".to_owned()
        }
    );
    assert!(err.is_unknown_event_type());
    assert!(!err.is_poison());
    assert_eq!(err.to_string(), "unknown event type \"RefundIssued\"");
}

/// A payload no JSON tree of this build can hold (nested past serde_json's
/// 128 levels, a number beyond f64) is still a readable envelope: of a type
/// this build does not know it is ignorable like any other (a consumer that
/// ignores a new type needs no change); of a known type, such fields the
/// contract does not have are skipped (a newer producer's compatible
/// additions: the event decodes as without them), and a payload that lacks
/// the contract's is poison with a reason, never a panic.
#[test]
fn a_payload_too_deep_or_too_large_for_a_tree_is_ignorable_when_its_type_is_unknown() {
    let deep = format!("{}1{}", "[".repeat(300), "]".repeat(300));
    let payload = format!(r#"{{"refund_id":"r-1","grams":1e400,"nested":{deep}}}"#);
    let body = |event_type: &str| {
        let golden = String::from_utf8(edited(PAYMENT_RECEIVED_JSON, |v| {
            v["event_type"] = json!(event_type);
            v["payload"] = json!("PAYLOAD");
        }))
        .expect("utf-8");
        golden.replace(r#""PAYLOAD""#, &payload).into_bytes()
    };
    assert!(
        serde_json::from_slice::<Value>(&body("RefundIssued")).is_err(),
        "the body is beyond a JSON tree (else this test shows nothing)"
    );

    let raw =
        RawEnvelope::parse_raw(&body("RefundIssued")).expect("headers of unknown types parse");
    assert_eq!(raw.event_type, "RefundIssued");
    assert_eq!(raw.aggregate_sequence, 2);
    assert_eq!(raw.payload.get(), payload, "kept as sent");
    let err = raw.decode().expect_err("unknown type");
    assert!(err.is_unknown_event_type(), "{err:?}");
    assert!(!err.is_poison());

    let known = RawEnvelope::parse_raw(&body("PaymentReceived")).expect("the envelope parses");
    let err = known.decode().expect_err("a known type's payload is read");
    assert!(err.is_poison(), "{err:?}");
    assert!(
        matches!(&err, DecodeError::InvalidPayload { reason, .. } if reason.contains("missing field")),
        "{err}"
    );

    // The golden PaymentReceived with such fields added to its payload.
    let golden = String::from_utf8(edited(PAYMENT_RECEIVED_JSON, |_| {})).expect("utf-8");
    let extended = golden.replacen(
        r#""payload":{"#,
        &format!(r#""payload":{{"grams":1e400,"nested":{deep},"#),
        1,
    );
    assert_ne!(extended, golden);
    let event = RawEnvelope::parse_raw(extended.as_bytes())
        .expect("the envelope parses")
        .decode()
        .expect("the contract's fields decode, the others are skipped");
    let plain = RawEnvelope::parse_raw(golden.as_bytes())
        .expect("golden")
        .decode()
        .expect("golden decodes");
    assert_eq!(event, plain);
}

#[test]
fn unknown_schema_version_is_poison() {
    for (file, event_type) in [
        (ORDER_PLACED_JSON, "OrderPlaced"),
        (PAYMENT_RECEIVED_JSON, "PaymentReceived"),
        (PARCEL_DELIVERED_JSON, "ParcelDelivered"),
    ] {
        let raw = RawEnvelope::parse_raw(&set(file, "/schema_version", json!(2))).expect("parse");
        let err = raw.decode().expect_err("v2 is unknown");
        assert_eq!(
            err,
            DecodeError::UnsupportedSchemaVersion {
                event_type: event_type.to_owned(),
                version: 2,
                supported: &[1],
            }
        );
        assert!(err.is_poison());
        assert_eq!(
            err.to_string(),
            format!("unsupported schema version 2 of event type \"{event_type}\" (supported: 1)")
        );
    }
    let raw = RawEnvelope::parse_raw(&set(ORDER_PLACED_JSON, "/schema_version", json!(0)))
        .expect("parse");
    assert!(matches!(
        raw.decode(),
        Err(DecodeError::UnsupportedSchemaVersion { version: 0, .. })
    ));
}

#[test]
fn money_as_json_number_is_rejected() {
    for number in [json!(40.0), json!(40), json!(4000), json!(-1), json!(1e3)] {
        let text = invalid_payload(&set(
            ORDER_PLACED_JSON,
            "/payload/lines/0/unit_price",
            number.clone(),
        ));
        assert_contains(&text, JSON_NUMBER);
        assert_contains(&text, "invalid OrderPlaced v1 payload: ");
        let text = invalid_payload(&set(PAYMENT_RECEIVED_JSON, "/payload/amount", number));
        assert_contains(&text, JSON_NUMBER);
    }
    // Straight from the bytes too (not only via an edited Value).
    let text = ORDER_PLACED_JSON.replace("\"total\": \"93.00\"", "\"total\": 93.0");
    assert_contains(&invalid_payload(text.as_bytes()), JSON_NUMBER);
}

#[test]
fn malformed_money_strings_are_rejected() {
    let cases = [
        ("40", "no decimal point"),
        ("40.0", "exactly two decimal places, found 1"),
        ("40.000", "exactly two decimal places, found 3"),
        ("1e3", "exponent"),
        (" 40.00", "whitespace"),
        ("40.00 ", "whitespace"),
        ("+40.00", "'+'"),
        ("040.00", "leading zeros"),
        ("", "empty"),
        ("40,00", "invalid character ','"),
        ("92233720368547758.08", "out of range"),
        ("-92233720368547758.09", "out of range"),
    ];
    for (bad, needle) in cases {
        for pointer in [
            "/payload/lines/0/unit_price",
            "/payload/lines/0/unit_cost",
            "/payload/shipping",
            "/payload/tax",
            "/payload/total",
        ] {
            let text = invalid_payload(&set(ORDER_PLACED_JSON, pointer, json!(bad)));
            assert_contains(&text, &format!("invalid money {bad:?}"));
            assert_contains(&text, needle);
        }
        let text = invalid_payload(&set(PAYMENT_RECEIVED_JSON, "/payload/amount", json!(bad)));
        assert_contains(&text, needle);
    }
}

#[test]
fn boundary_money_is_accepted() {
    let bytes = set(
        PAYMENT_RECEIVED_JSON,
        "/payload/amount",
        json!("92233720368547758.07"),
    );
    let raw = RawEnvelope::parse_raw(&bytes).expect("parse");
    let Ok(Event::PaymentReceived(p)) = raw.decode() else {
        panic!("{:?}", raw.decode());
    };
    assert_eq!(p.amount.minor(), i64::MAX);
    // An order whose line total overflows is poison, not a panic:
    // sums_that_overflow_are_invalid_payload.
}

#[test]
fn unsupported_currencies_are_rejected() {
    let text = invalid_payload(&set(ORDER_PLACED_JSON, "/payload/currency", json!("XYZ")));
    assert_contains(&text, "unsupported currency \"XYZ\"");
    let text = invalid_payload(&set(
        PAYMENT_RECEIVED_JSON,
        "/payload/currency",
        json!("JPY"),
    ));
    assert_contains(&text, "unsupported currency \"JPY\"");
    assert_contains(&text, "0 decimal places");
    let text = invalid_payload(&set(
        PAYMENT_RECEIVED_JSON,
        "/payload/currency",
        json!("usd"),
    ));
    assert_contains(&text, "invalid currency \"usd\"");
    let text = invalid_payload(&remove(PAYMENT_RECEIVED_JSON, "/payload", "currency"));
    assert_contains(&text, "missing field `currency`");
}

#[test]
fn bad_quantities_are_rejected() {
    for (file, pointer) in [
        (ORDER_PLACED_JSON, "/payload/lines/0/qty"),
        (PARCEL_DELIVERED_JSON, "/payload/lines/0/qty"),
    ] {
        let text = invalid_payload(&set(file, pointer, json!(-1)));
        assert_contains(&text, "invalid value: integer `-1`, expected u32");
        let text = invalid_payload(&set(file, pointer, json!(1.5)));
        assert_contains(&text, "invalid type: floating point `1.5`, expected u32");
        let text = invalid_payload(&set(file, pointer, json!(4_294_967_296_u64)));
        assert_contains(&text, "expected u32");
        let text = invalid_payload(&set(file, pointer, json!("2")));
        assert_contains(&text, "invalid type: string \"2\", expected u32");
    }
}

#[test]
fn other_payload_errors_are_invalid_payload() {
    let text = invalid_payload(&remove(ORDER_PLACED_JSON, "/payload", "customer_id"));
    assert_contains(&text, "missing field `customer_id`");
    let text = invalid_payload(&set(ORDER_PLACED_JSON, "/payload", json!(null)));
    assert_contains(&text, "invalid type: null");
    let text = invalid_payload(&set(ORDER_PLACED_JSON, "/payload/order_id", json!("1042")));
    assert_contains(&text, "UUID");
    let text = invalid_payload(&set(
        PARCEL_DELIVERED_JSON,
        "/payload/delivered_at",
        json!("2024-05-13 14:00"),
    ));
    assert_contains(&text, "invalid ParcelDelivered v1 payload: ");
    assert_contains(&text, "invalid RFC 3339 timestamp \"2024-05-13 14:00\"");
    let text = invalid_payload(&set(PAYMENT_RECEIVED_JSON, "/payload/method", json!(null)));
    assert_contains(&text, "invalid type: null, expected a string");
}

/// The names an event carries and a payment's method, held to the rules
/// order-api refuses a request by (`events::name`): a payload written by
/// hand into the outbox (the runbook's repair) that breaks one is poison,
/// dead-lettered at once with the reason, instead of applied (an order at
/// location "" whose sale no receipt can ever serve) or failing its
/// handler through every retry tier (a sku holding NUL).
#[test]
fn names_and_methods_breaking_the_producer_s_rules_are_invalid_payload() {
    let long = "x".repeat(256);
    for (file, pointer, value, expected) in [
        (
            ORDER_PLACED_JSON,
            "/payload/customer_id",
            json!(""),
            "customer_id must not be empty",
        ),
        (
            ORDER_PLACED_JSON,
            "/payload/location",
            json!(""),
            "location must not be empty",
        ),
        (
            ORDER_PLACED_JSON,
            "/payload/location",
            json!(long),
            "location must be at most 255 bytes of UTF-8",
        ),
        (
            ORDER_PLACED_JSON,
            "/payload/lines/0/sku",
            json!("JKT\u{0}M"),
            "lines[0].sku must not contain control characters",
        ),
        (
            PAYMENT_RECEIVED_JSON,
            "/payload/payment_id",
            json!(""),
            "payment_id must not be empty",
        ),
        (
            PAYMENT_RECEIVED_JSON,
            "/payload/method",
            json!("Card"),
            "method must be a lowercase identifier",
        ),
        (
            PAYMENT_RECEIVED_JSON,
            "/payload/method",
            json!(""),
            "method must be a lowercase identifier",
        ),
        (
            PARCEL_DELIVERED_JSON,
            "/payload/delivery_id",
            json!("311\n"),
            "delivery_id must not contain control characters",
        ),
        (
            PARCEL_DELIVERED_JSON,
            "/payload/lines/0/sku",
            json!(""),
            "lines[0].sku must not be empty",
        ),
    ] {
        let text = invalid_payload(&set(file, pointer, value));
        assert_contains(&text, expected);
    }
    let text = invalid_payload(&edited(ORDER_PLACED_JSON, |v| {
        v["payload"]["checkout_id"] = json!("");
    }));
    assert_contains(&text, "checkout_id must not be empty");
    // At the limits order-api takes, still an event (85 Devanagari letters
    // are 255 bytes; white space alone is a name).
    for (file, pointer, value) in [
        (
            ORDER_PLACED_JSON,
            "/payload/location",
            json!("क".repeat(85)),
        ),
        (ORDER_PLACED_JSON, "/payload/lines/0/sku", json!("   ")),
        (
            PAYMENT_RECEIVED_JSON,
            "/payload/method",
            json!("bank_transfer"),
        ),
    ] {
        let bytes = set(file, pointer, value);
        assert!(
            RawEnvelope::parse_raw(&bytes)
                .expect("parse")
                .decode()
                .is_ok(),
            "{pointer}"
        );
    }
}

#[test]
fn payloads_breaking_the_version_s_rules_are_invalid_payload() {
    for (pointer, value, expected) in [
        (
            "/payload/shipping",
            json!("-5.00"),
            "shipping must not be negative, got -5.00",
        ),
        ("/payload/tax", json!("-0.01"), "tax must not be negative"),
        (
            "/payload/total",
            json!("-93.00"),
            "total must not be negative",
        ),
        (
            "/payload/lines/0/qty",
            json!(0),
            "lines[0].qty must be at least 1",
        ),
        (
            "/payload/lines/0/unit_price",
            json!("-40.00"),
            "lines[0].unit_price must not be negative",
        ),
        (
            "/payload/lines/0/unit_cost",
            json!("-22.00"),
            "lines[0].unit_cost must not be negative",
        ),
        (
            "/payload/lines",
            json!([]),
            "an order has at least one line",
        ),
    ] {
        let text = invalid_payload(&set(ORDER_PLACED_JSON, pointer, value));
        assert_contains(&text, "invalid OrderPlaced v1 payload: ");
        assert_contains(&text, expected);
    }
    // Every line is checked, not only the first: a valid first line, a
    // second that breaks a rule.
    for (file, field, value, expected) in [
        (
            ORDER_PLACED_JSON,
            "qty",
            json!(0),
            "lines[1].qty must be at least 1",
        ),
        (
            ORDER_PLACED_JSON,
            "unit_price",
            json!("-1.00"),
            "lines[1].unit_price must not be negative",
        ),
        (
            PARCEL_DELIVERED_JSON,
            "qty",
            json!(0),
            "lines[1].qty must be at least 1",
        ),
    ] {
        let bytes = edited(file, |v| {
            let mut second = v["payload"]["lines"][0].clone();
            second[field] = value;
            v["payload"]["lines"]
                .as_array_mut()
                .expect("lines")
                .push(second);
        });
        assert_contains(&invalid_payload(&bytes), expected);
    }
    for amount in ["0.00", "-93.00"] {
        let text = invalid_payload(&set(
            PAYMENT_RECEIVED_JSON,
            "/payload/amount",
            json!(amount),
        ));
        assert_contains(&text, &format!("amount must be positive, got {amount}"));
    }
    let text = invalid_payload(&set(
        PARCEL_DELIVERED_JSON,
        "/payload/lines/0/qty",
        json!(0),
    ));
    assert_contains(&text, "lines[0].qty must be at least 1");
    let text = invalid_payload(&set(PARCEL_DELIVERED_JSON, "/payload/lines", json!([])));
    assert_contains(&text, "a delivery has at least one line");
    // A delivery time whose UTC value `time` cannot hold (binding it would
    // panic) or RFC 3339 cannot write back: poison, like such an occurred_at.
    for delivered_at in [
        "9999-12-31T23:59:59-01:00",
        "9999-12-31T23:30:00-00:45",
        "0000-01-01T00:00:00+01:00",
    ] {
        let text = invalid_payload(&set(
            PARCEL_DELIVERED_JSON,
            "/payload/delivered_at",
            json!(delivered_at),
        ));
        assert_contains(&text, "invalid ParcelDelivered v1 payload: ");
        assert_contains(&text, "delivered_at ");
        assert_contains(
            &text,
            "is out of range: its UTC value is not in years 0000 to 9999",
        );
    }
    for delivered_at in ["9999-12-31T22:59:59-01:00", "0000-01-01T01:00:00+01:00"] {
        let edge = set(
            PARCEL_DELIVERED_JSON,
            "/payload/delivered_at",
            json!(delivered_at),
        );
        assert!(
            RawEnvelope::parse_raw(&edge)
                .expect("parse")
                .decode()
                .is_ok(),
            "{delivered_at}"
        );
    }
    // Zero amounts are allowed where the producer allows them.
    let free = edited(ORDER_PLACED_JSON, |v| {
        v["payload"]["shipping"] = json!("0.00");
        v["payload"]["tax"] = json!("0.00");
        v["payload"]["total"] = json!("80.00");
        v["payload"]["lines"][0]["unit_cost"] = json!("0.00");
    });
    assert!(RawEnvelope::parse_raw(&free)
        .expect("parse")
        .decode()
        .is_ok());
    // The total is the sum of its parts, and not zero, as order-api refuses
    // the rest: poison at placement (before, every consumer took it and the
    // ledger refused the order at its delivery, its payment booked).
    let off_by_a_cent = set(ORDER_PLACED_JSON, "/payload/total", json!("93.01"));
    assert_contains(
        &invalid_payload(&off_by_a_cent),
        "total 93.01 does not equal merchandise + shipping + tax 93.00",
    );
    let nothing = edited(ORDER_PLACED_JSON, |v| {
        v["payload"]["shipping"] = json!("0.00");
        v["payload"]["tax"] = json!("0.00");
        v["payload"]["total"] = json!("0.00");
        for line in v["payload"]["lines"].as_array_mut().expect("lines") {
            line["unit_price"] = json!("0.00");
        }
    });
    assert_contains(&invalid_payload(&nothing), "total must be positive");
}

/// A contract field given twice in a payload is poison, not last-wins (the
/// outbox's jsonb never holds one: only a foreign publisher can send it).
#[test]
fn a_payload_field_given_twice_is_invalid_payload() {
    let golden = String::from_utf8(edited(PAYMENT_RECEIVED_JSON, |_| {})).expect("utf-8");
    let twice = golden.replacen(r#""payload":{"#, r#""payload":{"amount":"1.00","#, 1);
    assert_ne!(twice, golden);
    assert_contains(
        &invalid_payload(twice.as_bytes()),
        "duplicate field `amount`",
    );
}

#[test]
fn payload_must_agree_with_the_envelope() {
    let text = invalid_payload(&set(
        PAYMENT_RECEIVED_JSON,
        "/payload/order_id",
        json!("00000000-0000-7000-8000-000000001043"),
    ));
    assert_contains(
        &text,
        "payload order_id 00000000-0000-7000-8000-000000001043 does not match aggregate_id \"00000000-0000-7000-8000-000000001042\"",
    );
    // Not an order id, or the same UUID spelt otherwise (another order to
    // the consumers: they key on the text): the envelope is refused, of a
    // type a consumer decodes or not (one that ignored the type advanced
    // that phantom order's sequence).
    for spelling in [
        "order-1042",
        "{00000000-0000-7000-8000-000000001042}",
        "urn:uuid:00000000-0000-7000-8000-000000001042",
        "00000000000070008000000000001042",
        "00000000-0000-7000-8000-00000000104A",
    ] {
        for event_type in ["OrderPlaced", "RefundIssued"] {
            let text = malformed(&edited(ORDER_PLACED_JSON, |v| {
                v["aggregate_id"] = json!(spelling);
                v["event_type"] = json!(event_type);
            }));
            assert_contains(
                &text,
                &format!(
                    "aggregate_id of an order must be its id as a lower-case hyphenated UUID, got {spelling:?}"
                ),
            );
        }
    }
    let text = invalid_payload(&set(
        ORDER_PLACED_JSON,
        "/aggregate_type",
        json!("customer"),
    ));
    assert_contains(&text, "aggregate_type must be \"order\", got \"customer\"");
}

#[test]
fn unknown_fields_are_ignored_additive_changes_stay_compatible() {
    let bytes = edited(ORDER_PLACED_JSON, |v| {
        v["x_routing_hint"] = json!("eu");
        v["payload"]["discount"] = json!("1.00");
        v["payload"]["lines"][0]["gift_wrap"] = json!(true);
    });
    let raw = RawEnvelope::parse_raw(&bytes).expect("parse");
    assert_eq!(raw.decode(), Ok(Event::OrderPlaced(order_placed().payload)));
}

#[test]
fn optional_checkout_id_is_read_when_present() {
    let bytes = edited(ORDER_PLACED_JSON, |v| {
        v["payload"]["checkout_id"] = json!("chk-9");
    });
    let Ok(Event::OrderPlaced(p)) = RawEnvelope::parse_raw(&bytes).expect("parse").decode() else {
        panic!("expected OrderPlaced");
    };
    assert_eq!(p.checkout_id.as_deref(), Some("chk-9"));
    let bytes = edited(ORDER_PLACED_JSON, |v| {
        v["payload"]["checkout_id"] = json!(null);
    });
    let Ok(Event::OrderPlaced(p)) = RawEnvelope::parse_raw(&bytes).expect("parse").decode() else {
        panic!("expected OrderPlaced");
    };
    assert_eq!(p.checkout_id, None);
}

#[test]
fn other_timezones_are_the_same_instant() {
    let bytes = set(
        ORDER_PLACED_JSON,
        "/occurred_at",
        json!("2024-05-10T14:45:00+05:30"),
    );
    let raw = RawEnvelope::parse_raw(&bytes).expect("parse");
    assert_eq!(raw.occurred_at, datetime!(2024-05-10 09:15:00 UTC));
}

/// Every prefix of every golden file, and every single-byte corruption of
/// it, yields a result (ok or error) and never a panic.
#[test]
fn never_panics_on_corrupted_input() {
    for file in [
        ORDER_PLACED_JSON,
        PAYMENT_RECEIVED_JSON,
        PARCEL_DELIVERED_JSON,
    ] {
        let bytes = file.as_bytes();
        for end in 0..bytes.len() {
            if let Ok(raw) = RawEnvelope::parse_raw(&bytes[..end]) {
                let _ = raw.decode();
            }
        }
        for i in 0..bytes.len() {
            for replacement in [b'0', b'9', b'-', b'"', b'.', b'e', b' ', b'{', 0xff] {
                let mut corrupted = bytes.to_vec();
                corrupted[i] = replacement;
                if let Ok(raw) = RawEnvelope::parse_raw(&corrupted) {
                    let _ = raw.decode();
                }
            }
        }
    }
}

/// Sums of an order that overflow (order-api refuses them, 422 "amount
/// overflows") depend on the payload alone: poison, dead-lettered at once
/// with the reason. Before, each amount parsed, the payload decoded, and
/// the ledger's and loyalty's handlers failed on the sum through every
/// retry tier (about 36 minutes) while inventory had reserved the stock.
#[test]
fn sums_that_overflow_are_invalid_payload() {
    const MAX: &str = "92233720368547758.07";
    let one_line = |price: &str, cost: &str, qty: u32, shipping: &str| {
        edited(ORDER_PLACED_JSON, |v| {
            let mut line = v["payload"]["lines"][0].clone();
            line["unit_price"] = json!(price);
            line["unit_cost"] = json!(cost);
            line["qty"] = json!(qty);
            v["payload"]["lines"] = json!([line]);
            v["payload"]["shipping"] = json!(shipping);
            v["payload"]["tax"] = json!("0.00");
        })
    };
    for (bytes, expected) in [
        (
            one_line(MAX, "1.00", 2, "0.00"),
            "the lines' prices overflow in sum",
        ),
        (
            one_line("1.00", MAX, 2, "0.00"),
            "the lines' costs overflow in sum",
        ),
        (
            one_line(MAX, "1.00", 1, "0.01"),
            "merchandise + shipping + tax overflows",
        ),
    ] {
        let text = invalid_payload(&bytes);
        assert_contains(&text, "invalid OrderPlaced v1 payload: ");
        assert_contains(&text, expected);
    }
    // Two lines whose prices overflow only together.
    let single = one_line(MAX, "1.00", 1, "0.00");
    let bytes = edited(std::str::from_utf8(&single).expect("utf-8"), |v| {
        let mut second = v["payload"]["lines"][0].clone();
        second["unit_price"] = json!("0.01");
        v["payload"]["lines"]
            .as_array_mut()
            .expect("lines")
            .push(second);
    });
    assert_contains(
        &invalid_payload(&bytes),
        "the lines' prices overflow in sum",
    );
    // At the limit, still an event.
    let limit = one_line(MAX, MAX, 1, "0.00");
    let bytes = edited(std::str::from_utf8(&limit).expect("utf-8"), |v| {
        v["payload"]["total"] = json!(MAX);
    });
    assert!(
        RawEnvelope::parse_raw(&bytes)
            .expect("parse")
            .decode()
            .is_ok(),
        "a total of exactly the largest amount decodes"
    );
}

/// serde's derive reads a struct from a JSON array of its fields in order:
/// a payload, or an order's line, sent as an array decoded as the event it
/// spells. The contract's payloads and lines are objects: poison, with the
/// place named.
#[test]
fn a_payload_or_a_line_given_as_an_array_is_invalid_payload() {
    let golden: Value = serde_json::from_str(ORDER_PLACED_JSON).expect("json");
    // The fields in the struct's order, so that the derive would read them.
    let payload = &golden["payload"];
    let fields = [
        "order_id",
        "customer_id",
        "checkout_id",
        "lines",
        "shipping",
        "tax",
        "total",
        "currency",
        "location",
    ];
    let ordered: Vec<Value> = fields
        .iter()
        .map(|f| payload.get(*f).cloned().unwrap_or(Value::Null))
        .collect();
    let text = invalid_payload(&set(ORDER_PLACED_JSON, "/payload", Value::Array(ordered)));
    assert_contains(&text, "payload must be a JSON object");
    let line = &payload["lines"][0];
    let line_fields = ["sku", "qty", "unit_price", "unit_cost"];
    let ordered_line: Vec<Value> = line_fields
        .iter()
        .map(|f| line.get(*f).cloned().expect("line field"))
        .collect();
    let text = invalid_payload(&set(
        ORDER_PLACED_JSON,
        "/payload/lines/0",
        Value::Array(ordered_line),
    ));
    assert_contains(&text, "payload.lines[0] must be a JSON object");
}
