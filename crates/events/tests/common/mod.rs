//! The seed 003 story (order 1042 of tenant "acme") as typed values, and the
//! golden files that encode it.

#![allow(dead_code)]

use events::{
    Currency, DeliveredLineV1, Envelope, Money, OrderLineV1, OrderPlacedV1, ParcelDeliveredV1,
    PaymentReceivedV1,
};
use time::macros::datetime;
use uuid::{uuid, Uuid};

pub const ORDER_PLACED_JSON: &str = include_str!("../golden/v1/order_placed.json");
pub const PAYMENT_RECEIVED_JSON: &str = include_str!("../golden/v1/payment_received.json");
pub const PARCEL_DELIVERED_JSON: &str = include_str!("../golden/v1/parcel_delivered.json");

pub const TENANT: &str = "acme";
pub const ORDER_1042: Uuid = uuid!("00000000-0000-7000-8000-000000001042");
pub const EVT_5001: Uuid = uuid!("00000000-0000-7000-8000-000000005001");
pub const EVT_5002: Uuid = uuid!("00000000-0000-7000-8000-000000005002");
pub const EVT_5003: Uuid = uuid!("00000000-0000-7000-8000-000000005003");

pub fn money(s: &str) -> Money {
    Money::parse(s).expect("valid money literal")
}

pub fn order_placed() -> Envelope<OrderPlacedV1> {
    Envelope::new(
        EVT_5001,
        TENANT,
        ORDER_1042.to_string(),
        1,
        datetime!(2024-05-10 09:15:00 UTC),
        OrderPlacedV1 {
            order_id: ORDER_1042,
            customer_id: "77".to_owned(),
            checkout_id: None,
            lines: vec![OrderLineV1 {
                sku: "JKT-M".to_owned(),
                qty: 2,
                unit_price: money("40.00"),
                unit_cost: money("22.00"),
            }],
            shipping: money("5.00"),
            tax: money("8.00"),
            total: money("93.00"),
            currency: Currency::USD,
            location: "WH-1".to_owned(),
        },
    )
}

pub fn payment_received() -> Envelope<PaymentReceivedV1> {
    Envelope::new(
        EVT_5002,
        TENANT,
        ORDER_1042.to_string(),
        2,
        datetime!(2024-05-10 09:16:30 UTC),
        PaymentReceivedV1 {
            order_id: ORDER_1042,
            payment_id: "9001".to_owned(),
            amount: money("93.00"),
            currency: Currency::USD,
            method: "card".to_owned(),
        },
    )
}

pub fn parcel_delivered() -> Envelope<ParcelDeliveredV1> {
    Envelope::new(
        EVT_5003,
        TENANT,
        ORDER_1042.to_string(),
        3,
        datetime!(2024-05-13 14:02:10 UTC),
        ParcelDeliveredV1 {
            order_id: ORDER_1042,
            delivery_id: "311".to_owned(),
            delivered_at: datetime!(2024-05-13 14:00:00 UTC),
            lines: vec![DeliveredLineV1 {
                sku: "JKT-M".to_owned(),
                qty: 2,
            }],
        },
    )
}

/// The golden file's JSON text without its single trailing newline (the
/// files are `serde_json::to_string_pretty` output plus exactly one `\n`).
pub fn without_trailing_newline(file: &str) -> &str {
    let body = file
        .strip_suffix('\n')
        .expect("golden file ends with a newline");
    assert!(
        !body.ends_with('\n') && !body.ends_with('\r'),
        "golden file ends with exactly one \\n"
    );
    body
}
