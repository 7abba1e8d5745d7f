//! Schema version 1 of the order event payloads.
//!
//! Unknown payload fields are ignored (no `deny_unknown_fields`), so a
//! producer may add optional fields without bumping the version. Optional
//! fields use `#[serde(default)]` so that older producers stay readable.

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use uuid::Uuid;

use crate::{event_types, Currency, EventPayload, Money};

/// An order was accepted and committed (`OrderPlaced`, v1).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OrderPlacedV1 {
    /// The order id (also the envelope's `aggregate_id`).
    pub order_id: Uuid,
    /// The customer, in the tenant's own id space.
    pub customer_id: String,
    /// The client's checkout id, when it sent one (unique per tenant).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkout_id: Option<String>,
    /// The ordered lines.
    pub lines: Vec<OrderLineV1>,
    /// Shipping charged to the customer.
    pub shipping: Money,
    /// Tax charged to the customer.
    pub tax: Money,
    /// The amount the customer pays: merchandise + shipping + tax.
    pub total: Money,
    /// The currency of every amount in this payload.
    pub currency: Currency,
    /// The stock location the order is fulfilled from (e.g. `WH-1`).
    pub location: String,
}

/// One line of an [`OrderPlacedV1`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OrderLineV1 {
    /// Stock keeping unit.
    pub sku: String,
    /// Quantity ordered.
    pub qty: u32,
    /// Price per unit charged to the customer.
    pub unit_price: Money,
    /// Cost per unit to the business (for cost of goods sold).
    pub unit_cost: Money,
}

impl OrderLineV1 {
    /// `qty * unit_price`, or `None` on overflow.
    #[must_use]
    pub fn line_price(&self) -> Option<Money> {
        self.unit_price.checked_mul(i64::from(self.qty))
    }

    /// `qty * unit_cost`, or `None` on overflow.
    #[must_use]
    pub fn line_cost(&self) -> Option<Money> {
        self.unit_cost.checked_mul(i64::from(self.qty))
    }
}

impl OrderPlacedV1 {
    /// Sum of `qty * unit_price` over all lines, or `None` on overflow.
    #[must_use]
    pub fn merchandise(&self) -> Option<Money> {
        self.lines
            .iter()
            .try_fold(Money::ZERO, |acc, l| acc.checked_add(l.line_price()?))
    }

    /// Sum of `qty * unit_cost` over all lines, or `None` on overflow.
    #[must_use]
    pub fn cost_of_goods(&self) -> Option<Money> {
        self.lines
            .iter()
            .try_fold(Money::ZERO, |acc, l| acc.checked_add(l.line_cost()?))
    }

    /// `merchandise + shipping + tax`, or `None` on overflow. The decoder
    /// requires it to equal [`OrderPlacedV1::total`], as order-api does (a
    /// discount would be a v2 change: the ledger books the total as these
    /// three parts).
    #[must_use]
    pub fn computed_total(&self) -> Option<Money> {
        self.merchandise()?
            .checked_add(self.shipping)?
            .checked_add(self.tax)
    }
}

/// A payment for an order was received (`PaymentReceived`, v1).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PaymentReceivedV1 {
    /// The order paid for.
    pub order_id: Uuid,
    /// The payment's id.
    pub payment_id: String,
    /// The amount received.
    pub amount: Money,
    /// The currency of `amount`.
    pub currency: Currency,
    /// How it was paid: `card`, ...
    pub method: String,
}

/// An order's parcel was delivered (`ParcelDelivered`, v1).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParcelDeliveredV1 {
    /// The order delivered.
    pub order_id: Uuid,
    /// The delivery's id.
    pub delivery_id: String,
    /// When the parcel was delivered (RFC 3339): the business time (revenue
    /// is recognised on delivery, seed 003). It may be earlier than the
    /// envelope's `occurred_at`, when the delivery was recorded (a courier
    /// reporting late), never before the order was placed.
    #[serde(with = "crate::timestamp")]
    pub delivered_at: OffsetDateTime,
    /// What was delivered.
    pub lines: Vec<DeliveredLineV1>,
}

/// One line of a [`ParcelDeliveredV1`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeliveredLineV1 {
    /// Stock keeping unit.
    pub sku: String,
    /// Quantity delivered.
    pub qty: u32,
}

/// `Err` naming `field` when `value` is negative.
fn not_negative(field: &str, value: Money) -> Result<(), String> {
    if value.is_negative() {
        return Err(format!("{field} must not be negative, got {value}"));
    }
    Ok(())
}

/// `Err` naming `field` when `value` breaks the rule for names
/// ([`crate::name::check`]), as order-api would have refused it.
fn named(field: &str, value: &str) -> Result<(), String> {
    crate::name::check(value).map_err(|why| format!("{field} {why}"))
}

/// `Err` naming `field` when `qty` is 0.
fn at_least_one(field: &str, qty: u32) -> Result<(), String> {
    if qty == 0 {
        return Err(format!("{field} must be at least 1"));
    }
    Ok(())
}

impl EventPayload for OrderPlacedV1 {
    const EVENT_TYPE: &'static str = event_types::ORDER_PLACED;
    const SCHEMA_VERSION: u32 = 1;

    fn check(&self) -> Result<(), String> {
        named("customer_id", &self.customer_id)?;
        if let Some(checkout) = &self.checkout_id {
            named("checkout_id", checkout)?;
        }
        named("location", &self.location)?;
        if self.lines.is_empty() {
            return Err("an order has at least one line".to_owned());
        }
        for (i, line) in self.lines.iter().enumerate() {
            named(&format!("lines[{i}].sku"), &line.sku)?;
            at_least_one(&format!("lines[{i}].qty"), line.qty)?;
            not_negative(&format!("lines[{i}].unit_price"), line.unit_price)?;
            not_negative(&format!("lines[{i}].unit_cost"), line.unit_cost)?;
        }
        not_negative("shipping", self.shipping)?;
        not_negative("tax", self.tax)?;
        not_negative("total", self.total)?;
        // Sums that overflow depend on the payload alone (order-api refuses
        // them, 422 "amount overflows"): poison, not a handler failure
        // retried through every tier.
        if self.merchandise().is_none() {
            return Err("the lines' prices overflow in sum".to_owned());
        }
        if self.cost_of_goods().is_none() {
            return Err("the lines' costs overflow in sum".to_owned());
        }
        let Some(computed) = self.computed_total() else {
            return Err("merchandise + shipping + tax overflows".to_owned());
        };
        // As order-api refuses them (422 on `total`): poison at placement in
        // every consumer, not an order that inventory and loyalty apply
        // and the ledger only refuses at its delivery, its payment booked.
        if computed != self.total {
            return Err(format!(
                "total {} does not equal merchandise + shipping + tax {computed}",
                self.total
            ));
        }
        if self.total.is_zero() {
            return Err("total must be positive".to_owned());
        }
        Ok(())
    }
}

impl EventPayload for PaymentReceivedV1 {
    const EVENT_TYPE: &'static str = event_types::PAYMENT_RECEIVED;
    const SCHEMA_VERSION: u32 = 1;

    fn check(&self) -> Result<(), String> {
        named("payment_id", &self.payment_id)?;
        if self.amount.is_negative() || self.amount.is_zero() {
            return Err(format!("amount must be positive, got {}", self.amount));
        }
        crate::name::check_method(&self.method).map_err(|why| format!("method {why}"))
    }
}

impl EventPayload for ParcelDeliveredV1 {
    const EVENT_TYPE: &'static str = event_types::PARCEL_DELIVERED;
    const SCHEMA_VERSION: u32 = 1;

    fn check(&self) -> Result<(), String> {
        named("delivery_id", &self.delivery_id)?;
        if self.lines.is_empty() {
            return Err("a delivery has at least one line".to_owned());
        }
        for (i, line) in self.lines.iter().enumerate() {
            named(&format!("lines[{i}].sku"), &line.sku)?;
            at_least_one(&format!("lines[{i}].qty"), line.qty)?;
        }
        crate::timestamp::check_range("delivered_at", &self.delivered_at)
    }
}
