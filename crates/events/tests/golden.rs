//! Golden JSON for schema version 1: the seed 003 story of order 1042.

mod common;

use common::*;
use events::{
    event_types, headers, DeliveredLineV1, Envelope, Event, EventPayload, OrderLineV1,
    OrderPlacedV1, ParcelDeliveredV1, PaymentReceivedV1, RawEnvelope, AGGREGATE_TYPE_ORDER,
    CONTENT_TYPE, EXCHANGE,
};
use serde::Serialize;
use time::macros::datetime;

/// Asserts that `expected` serialises to exactly the golden file, and that
/// the golden file parses back to `expected` through both the typed and the
/// raw path.
fn assert_golden<P>(file: &str, expected: &Envelope<P>)
where
    P: EventPayload + Serialize + PartialEq + Clone + std::fmt::Debug,
{
    let body = without_trailing_newline(file);
    let pretty = serde_json::to_string_pretty(expected).expect("serialise");
    assert_eq!(pretty, body, "re-serialised golden differs");

    let typed: Envelope<P> = serde_json::from_str(file).expect("typed parse");
    assert_eq!(&typed, expected);

    let compact = expected.to_json_bytes().expect("encode");
    let from_compact: Envelope<P> = serde_json::from_slice(&compact).expect("compact parse");
    assert_eq!(&from_compact, expected);
    let compact_value: serde_json::Value = serde_json::from_slice(&compact).expect("json");
    let golden_value: serde_json::Value = serde_json::from_str(file).expect("json");
    assert_eq!(compact_value, golden_value);

    // The raw envelope keeps the payload as sent: the compact body comes
    // back byte for byte, and the pretty golden file's payload is the typed
    // payload's JSON.
    let raw = RawEnvelope::parse_raw(&compact).expect("raw parse");
    assert_eq!(raw.to_json_bytes().expect("encode"), compact);
    let raw = RawEnvelope::parse_raw(file.as_bytes()).expect("raw parse");
    let from_typed = expected.clone().into_raw().expect("into_raw");
    let value = |raw: &RawEnvelope| -> serde_json::Value {
        serde_json::from_str(raw.payload.get()).expect("payload json")
    };
    assert_eq!(value(&raw), value(&from_typed));
    assert_eq!(
        value(&raw),
        serde_json::to_value(&expected.payload).expect("json")
    );
    assert_eq!(
        (
            raw.event_id,
            &raw.event_type,
            raw.schema_version,
            &raw.tenant_id
        ),
        (
            from_typed.event_id,
            &from_typed.event_type,
            from_typed.schema_version,
            &from_typed.tenant_id
        )
    );
    assert_eq!(
        (
            &raw.aggregate_type,
            &raw.aggregate_id,
            raw.aggregate_sequence,
            raw.occurred_at
        ),
        (
            &from_typed.aggregate_type,
            &from_typed.aggregate_id,
            from_typed.aggregate_sequence,
            from_typed.occurred_at
        )
    );
}

fn assert_seed_header(raw: &RawEnvelope, event_type: &str, sequence: i64) {
    assert_eq!(raw.event_type, event_type);
    assert_eq!(raw.schema_version, 1);
    assert_eq!(raw.tenant_id, "acme");
    assert_eq!(raw.aggregate_type, "order");
    assert_eq!(raw.aggregate_id, "00000000-0000-7000-8000-000000001042");
    assert_eq!(raw.aggregate_sequence, sequence);
}

#[test]
fn order_placed_v1_golden() {
    let raw = RawEnvelope::parse_raw(ORDER_PLACED_JSON.as_bytes()).expect("parse");
    assert_seed_header(&raw, "OrderPlaced", 1);
    assert_eq!(raw.event_id, EVT_5001);
    assert_eq!(raw.occurred_at, datetime!(2024-05-10 09:15:00 UTC));

    let Ok(Event::OrderPlaced(p)) = raw.decode() else {
        panic!("expected OrderPlaced, got {:?}", raw.decode());
    };
    assert_eq!(p.order_id, ORDER_1042);
    assert_eq!(p.customer_id, "77");
    assert_eq!(p.checkout_id, None);
    assert_eq!(
        p.lines,
        vec![OrderLineV1 {
            sku: "JKT-M".to_owned(),
            qty: 2,
            unit_price: money("40.00"),
            unit_cost: money("22.00"),
        }]
    );
    assert_eq!(p.lines[0].unit_price.minor(), 4000);
    assert_eq!(p.lines[0].unit_cost.minor(), 2200);
    assert_eq!(p.shipping.minor(), 500);
    assert_eq!(p.tax.minor(), 800);
    assert_eq!(p.total.minor(), 9300);
    assert_eq!(p.currency.as_str(), "USD");
    assert_eq!(p.location, "WH-1");

    assert_eq!(p.merchandise(), Some(money("80.00")));
    assert_eq!(p.cost_of_goods(), Some(money("44.00")));
    assert_eq!(p.computed_total(), Some(money("93.00")));
    assert_eq!(p.computed_total(), Some(p.total));
    assert_eq!(p.merchandise().map(|m| m.whole_units()), Some(80));

    assert_eq!(&p, &order_placed().payload);
    assert_golden(ORDER_PLACED_JSON, &order_placed());
}

#[test]
fn payment_received_v1_golden() {
    let raw = RawEnvelope::parse_raw(PAYMENT_RECEIVED_JSON.as_bytes()).expect("parse");
    assert_seed_header(&raw, "PaymentReceived", 2);
    assert_eq!(raw.event_id, EVT_5002);
    assert_eq!(raw.occurred_at, datetime!(2024-05-10 09:16:30 UTC));

    let Ok(Event::PaymentReceived(p)) = raw.decode() else {
        panic!("expected PaymentReceived, got {:?}", raw.decode());
    };
    assert_eq!(p.order_id, ORDER_1042);
    assert_eq!(p.payment_id, "9001");
    assert_eq!(p.amount, money("93.00"));
    assert_eq!(p.currency.as_str(), "USD");
    assert_eq!(p.method, "card");

    assert_eq!(&p, &payment_received().payload);
    assert_golden(PAYMENT_RECEIVED_JSON, &payment_received());
}

#[test]
fn parcel_delivered_v1_golden() {
    let raw = RawEnvelope::parse_raw(PARCEL_DELIVERED_JSON.as_bytes()).expect("parse");
    assert_seed_header(&raw, "ParcelDelivered", 3);
    assert_eq!(raw.event_id, EVT_5003);
    assert_eq!(raw.occurred_at, datetime!(2024-05-13 14:02:10 UTC));

    let Ok(Event::ParcelDelivered(p)) = raw.decode() else {
        panic!("expected ParcelDelivered, got {:?}", raw.decode());
    };
    assert_eq!(p.order_id, ORDER_1042);
    assert_eq!(p.delivery_id, "311");
    assert_eq!(p.delivered_at, datetime!(2024-05-13 14:00:00 UTC));
    assert_eq!(
        p.lines,
        vec![DeliveredLineV1 {
            sku: "JKT-M".to_owned(),
            qty: 2,
        }]
    );

    assert_eq!(&p, &parcel_delivered().payload);
    assert_golden(PARCEL_DELIVERED_JSON, &parcel_delivered());
}

#[test]
fn ledger_entries_of_the_seed_balance() {
    // Seed 003: the delivery journal is 93.00 + 44.00 = 80.00 + 5.00 + 8.00 + 44.00.
    let order = order_placed().payload;
    let payment = payment_received().payload;
    let cogs = order.cost_of_goods().expect("cogs");
    let debits = payment.amount.checked_add(cogs).expect("debits");
    let credits = [
        order.merchandise().expect("merchandise"),
        order.shipping,
        order.tax,
        cogs,
    ];
    assert_eq!(debits, money("137.00"));
    assert_eq!(events::Money::checked_sum(credits), Some(debits));
}

#[test]
fn event_accessors() {
    let events: [(Event, &str); 3] = [
        (order_placed().payload.into(), "OrderPlaced"),
        (payment_received().payload.into(), "PaymentReceived"),
        (parcel_delivered().payload.into(), "ParcelDelivered"),
    ];
    for (event, name) in events {
        assert_eq!(event.event_type(), name);
        assert_eq!(event.schema_version(), 1);
        assert_eq!(event.order_id(), ORDER_1042);
        assert_eq!(events::supported_versions(name), &[1]);
    }
    assert!(events::supported_versions("OrderCancelled").is_empty());
}

#[test]
fn constructor_fills_contract_fields() {
    let env = payment_received();
    assert_eq!(env.event_type, PaymentReceivedV1::EVENT_TYPE);
    assert_eq!(env.event_type, event_types::PAYMENT_RECEIVED);
    assert_eq!(env.schema_version, PaymentReceivedV1::SCHEMA_VERSION);
    assert_eq!(env.aggregate_type, AGGREGATE_TYPE_ORDER);
    assert_eq!(OrderPlacedV1::EVENT_TYPE, "OrderPlaced");
    assert_eq!(ParcelDeliveredV1::EVENT_TYPE, "ParcelDelivered");
}

#[test]
fn contract_names() {
    assert_eq!(EXCHANGE, "order-events");
    assert_eq!(AGGREGATE_TYPE_ORDER, "order");
    assert_eq!(CONTENT_TYPE, "application/json");
    assert_eq!(headers::AGGREGATE_ID, "aggregate_id");
    assert_eq!(headers::AGGREGATE_SEQUENCE, "aggregate_sequence");
    assert_eq!(headers::SCHEMA_VERSION, "schema_version");
    assert_eq!(headers::TENANT_ID, "tenant_id");
    assert_eq!(headers::TRACEPARENT, "traceparent");
    assert_eq!(headers::TRACESTATE, "tracestate");
    assert_eq!(headers::REPLAYED, "replayed");
    assert_eq!(headers::EVENT_TYPE, "event_type");
    assert_eq!(event_types::ORDER_PLACED, "OrderPlaced");
    assert_eq!(event_types::PAYMENT_RECEIVED, "PaymentReceived");
    assert_eq!(event_types::PARCEL_DELIVERED, "ParcelDelivered");
}

#[test]
fn compact_encoding_keeps_field_order() {
    let bytes = order_placed().to_json_bytes().expect("encode");
    let text = String::from_utf8(bytes).expect("utf-8");
    let keys = [
        "\"event_id\"",
        "\"event_type\"",
        "\"schema_version\"",
        "\"tenant_id\"",
        "\"aggregate_type\"",
        "\"aggregate_id\"",
        "\"aggregate_sequence\"",
        "\"occurred_at\"",
        "\"payload\"",
    ];
    let positions: Vec<usize> = keys
        .iter()
        .map(|k| {
            text.find(k)
                .unwrap_or_else(|| panic!("{k} missing in {text}"))
        })
        .collect();
    assert!(positions.windows(2).all(|w| w[0] < w[1]), "{text}");
    assert!(!text.contains('\n'));
    assert!(
        !text.contains("checkout_id"),
        "absent checkout_id is omitted"
    );
}

#[test]
fn checkout_id_round_trips_when_present() {
    let mut env = order_placed();
    env.payload.checkout_id = Some("chk-1042".to_owned());
    let bytes = env.to_json_bytes().expect("encode");
    let raw = RawEnvelope::parse_raw(&bytes).expect("parse");
    assert!(raw.payload.get().contains(r#""checkout_id":"chk-1042""#));
    assert_eq!(raw.decode(), Ok(Event::OrderPlaced(env.payload)));
}

#[test]
fn parse_aliases_agree() {
    let bytes = PAYMENT_RECEIVED_JSON.as_bytes();
    let a = Envelope::parse_raw(bytes).expect("Envelope::parse_raw");
    let b = RawEnvelope::parse(bytes).expect("RawEnvelope::parse");
    assert_eq!(
        a.to_json_bytes().expect("encode"),
        b.to_json_bytes().expect("encode")
    );
}
