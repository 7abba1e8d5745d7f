//! The business operations, each run inside the idempotency owner's
//! transaction: the mutation, the next per-order event sequence (under the
//! order row's lock) and the outbox row commit together or not at all.

use std::collections::{BTreeMap, HashMap};

use deadpool_postgres::Transaction;
use events::{
    DeliveredLineV1, EventPayload, Money, OrderPlacedV1, ParcelDeliveredV1, PaymentReceivedV1,
};
use serde::Serialize;
use time::OffsetDateTime;
use tokio_postgres::types::Json;
use uuid::Uuid;

use crate::{
    error::{ApiError, Rejection},
    idempotency::Stored,
    request::{DeliveryRequest, NewOrder, PaymentRequest},
};

/// W3C trace context of the request's span, stored with the outbox row.
pub type TraceContext = HashMap<String, String>;

pub enum Operation {
    CreateOrder(NewOrder, TraceContext),
    Pay(Uuid, PaymentRequest, TraceContext),
    Deliver(Uuid, DeliveryRequest, TraceContext),
}

/// The order placed for `checkout_id` in `tenant`, if any.
pub async fn checkout_order(
    client: &impl deadpool_postgres::GenericClient,
    tenant: &str,
    checkout_id: &str,
) -> Result<Option<Uuid>, ApiError> {
    let find = client.prepare_cached(CHECKOUT_ORDER).await?;
    Ok(client
        .query_opt(&find, &[&tenant, &checkout_id])
        .await?
        .map(|row| row.get(0)))
}

pub async fn run(
    tx: &Transaction<'_>,
    tenant: &str,
    operation: Operation,
) -> Result<Result<Stored, Rejection>, ApiError> {
    match operation {
        Operation::CreateOrder(order, trace) => create_order(tx, tenant, order, &trace).await,
        Operation::Pay(order_id, payment, trace) => {
            pay(tx, tenant, order_id, payment, &trace).await
        }
        Operation::Deliver(order_id, delivery, trace) => {
            deliver(tx, tenant, order_id, delivery, &trace).await
        }
    }
}

fn created<T: Serialize>(body: &T, resource_id: Uuid) -> Result<Stored, ApiError> {
    Ok(Stored {
        status: 201,
        body: serde_json::to_vec(body).map_err(|e| ApiError::Internal(e.to_string()))?,
        resource_id: Some(resource_id),
    })
}

/// The event's outbox row (its durable intent).
pub const INSERT_OUTBOX: &str = "\
INSERT INTO outbox_events (event_id, tenant_id, aggregate_type, aggregate_id, aggregate_sequence,
                           event_type, schema_version, payload, traceparent, tracestate, occurred_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)";

/// Write the event's durable intent: one outbox row with a fresh, stable
/// event id (never changed on retry: the relay re-sends this row as is).
async fn write_outbox<P: EventPayload + std::fmt::Debug + Sync>(
    tx: &Transaction<'_>,
    tenant: &str,
    order_id: Uuid,
    sequence: i64,
    occurred_at: OffsetDateTime,
    payload: &P,
    trace: &TraceContext,
) -> Result<Uuid, ApiError> {
    // The window between the operation's own writes and its outbox row, in
    // one transaction: an error here drops the transaction (rolled back,
    // the connection back in the pool) and nothing of the request is
    // stored. `return` fails a statement here; `sleep(ms)` stretches the
    // transaction (the tests of both).
    if kit::failpoint::error_point("order_api.before_outbox") {
        tx.batch_execute(
            "DO $$ BEGIN RAISE EXCEPTION 'injected by fail point order_api.before_outbox'; END $$",
        )
        .await?;
    }
    let event_id = Uuid::now_v7();
    let statement = tx.prepare_cached(INSERT_OUTBOX).await?;
    let schema_version = i32::try_from(P::SCHEMA_VERSION).unwrap_or(i32::MAX);
    tx.execute(
        &statement,
        &[
            &event_id,
            &tenant,
            &events::AGGREGATE_TYPE_ORDER,
            &order_id.to_string(),
            &sequence,
            &P::EVENT_TYPE,
            &schema_version,
            &Json(payload),
            &trace.get(events::headers::TRACEPARENT),
            &trace.get(events::headers::TRACESTATE),
            &occurred_at,
        ],
    )
    .await?;
    Ok(event_id)
}

// ------------------------------------------------------------------ orders

/// The order as the API shows it (POST /orders response and GET /orders/{id}).
#[derive(Debug, Serialize)]
pub struct OrderView {
    pub order_id: Uuid,
    pub status: String,
    pub customer_id: String,
    pub checkout_id: Option<String>,
    pub currency: String,
    pub location: String,
    pub lines: Vec<events::OrderLineV1>,
    pub merchandise: Money,
    pub shipping: Money,
    pub tax: Money,
    pub total: Money,
    #[serde(with = "time::serde::rfc3339")]
    pub created_at: OffsetDateTime,
    /// Its payment, once paid (GET only: the POST's answer, stored and
    /// replayed, is the order as placed).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub payment: Option<PaymentSummary>,
    /// Its delivery, once delivered (GET only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub delivery: Option<DeliverySummary>,
}

/// The payment an order has (one, orders V9): which provider payment paid
/// it, so that a client can reconcile a payment whose answer it lost.
#[derive(Debug, Serialize)]
pub struct PaymentSummary {
    pub payment_id: String,
    pub method: String,
    pub amount: Money,
}

/// The delivery an order has (one, orders V9).
#[derive(Debug, Serialize)]
pub struct DeliverySummary {
    pub delivery_id: String,
    #[serde(with = "time::serde::rfc3339")]
    pub delivered_at: OffsetDateTime,
}

/// The order row; the checkout id backstops a retry under a new key.
pub const INSERT_ORDER: &str = "\
INSERT INTO orders (order_id, tenant_id, customer_id, checkout_id, currency, location,
                    merchandise_minor, shipping_minor, tax_minor, total_minor, last_event_sequence)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, 1)
ON CONFLICT (tenant_id, checkout_id) WHERE checkout_id IS NOT NULL DO NOTHING
RETURNING created_at";

/// The order of the tenant's checkout (after [`INSERT_ORDER`] found one).
const CHECKOUT_ORDER: &str =
    "SELECT order_id FROM orders WHERE tenant_id = $1 AND checkout_id = $2";

/// All the order's lines in one statement (`$7`: the tenant).
pub const INSERT_LINES: &str = "\
INSERT INTO order_lines (order_id, line_no, sku, qty, unit_price_minor, unit_cost_minor, tenant_id)
SELECT $1, line_no, sku, qty, price, cost, $7
  FROM unnest($2::int[], $3::text[], $4::int[], $5::bigint[], $6::bigint[])
       AS l(line_no, sku, qty, price, cost)";

async fn create_order(
    tx: &Transaction<'_>,
    tenant: &str,
    order: NewOrder,
    trace: &TraceContext,
) -> Result<Result<Stored, Rejection>, ApiError> {
    let order_id = Uuid::now_v7();
    let insert = tx.prepare_cached(INSERT_ORDER).await?;
    let created_at: Option<OffsetDateTime> = tx
        .query_opt(
            &insert,
            &[
                &order_id,
                &tenant,
                &order.customer_id,
                &order.checkout_id,
                &order.currency.as_str(),
                &order.location,
                &order.merchandise.minor(),
                &order.shipping.minor(),
                &order.tax.minor(),
                &order.total.minor(),
            ],
        )
        .await?
        .map(|row| row.get(0));
    let Some(created_at) = created_at else {
        // The checkout's order committed (the insert waited for it): this
        // statement's snapshot sees it.
        let checkout_id = order.checkout_id.unwrap_or_default();
        let order_id = checkout_order(tx, tenant, &checkout_id)
            .await?
            .ok_or_else(|| {
                ApiError::Internal(format!(
                    "checkout {checkout_id} conflicted but has no order"
                ))
            })?;
        return Ok(Err(Rejection::CheckoutAlreadyOrdered {
            checkout_id,
            order_id,
        }));
    };

    let line_nos: Vec<i32> = (1..=order.lines.len())
        .map(|n| i32::try_from(n).unwrap_or(i32::MAX))
        .collect();
    let skus: Vec<&str> = order.lines.iter().map(|l| l.sku.as_str()).collect();
    let qtys: Vec<i32> = order
        .lines
        .iter()
        .map(|l| i32::try_from(l.qty).unwrap_or(i32::MAX))
        .collect();
    let prices: Vec<i64> = order.lines.iter().map(|l| l.unit_price.minor()).collect();
    let costs: Vec<i64> = order.lines.iter().map(|l| l.unit_cost.minor()).collect();
    let lines = tx.prepare_cached(INSERT_LINES).await?;
    tx.execute(
        &lines,
        &[&order_id, &line_nos, &skus, &qtys, &prices, &costs, &tenant],
    )
    .await?;

    let payload = OrderPlacedV1 {
        order_id,
        customer_id: order.customer_id.clone(),
        checkout_id: order.checkout_id.clone(),
        lines: order.lines.clone(),
        shipping: order.shipping,
        tax: order.tax,
        total: order.total,
        currency: order.currency.clone(),
        location: order.location.clone(),
    };
    write_outbox(tx, tenant, order_id, 1, created_at, &payload, trace).await?;

    let view = OrderView {
        order_id,
        status: "placed".to_owned(),
        customer_id: order.customer_id,
        checkout_id: order.checkout_id,
        currency: order.currency.as_str().to_owned(),
        location: order.location,
        lines: order.lines,
        merchandise: order.merchandise,
        shipping: order.shipping,
        tax: order.tax,
        total: order.total,
        created_at,
        payment: None,
        delivery: None,
    };
    Ok(Ok(created(&view, order_id)?))
}

/// Lock the order row (the per-order sequence is assigned under this lock)
/// and return (status, total, currency, placed at), or None if not the
/// tenant's order.
const LOCK_ORDER: &str = "\
SELECT status, total_minor, currency, created_at FROM orders
 WHERE order_id = $1 AND tenant_id = $2
   FOR UPDATE";

/// Advance the order: new status, the next event sequence and the event's
/// time, in one statement under the order's lock. The time is
/// `clock_timestamp()`, read with the lock held, not `now()` (the
/// transaction's start, before the lock): a request that began before a
/// concurrent one on the same order committed, and waited for its lock,
/// would otherwise date its later event before the earlier one.
const ADVANCE_ORDER: &str = "\
UPDATE orders SET status = $2, last_event_sequence = last_event_sequence + 1,
                  updated_at = clock_timestamp()
 WHERE order_id = $1
RETURNING last_event_sequence, updated_at";

struct LockedOrder {
    status: String,
    total: Money,
    currency: String,
    placed_at: OffsetDateTime,
}

/// The tenant's order, locked for the rest of the transaction.
async fn lock_order(
    tx: &Transaction<'_>,
    tenant: &str,
    order_id: Uuid,
) -> Result<Option<LockedOrder>, ApiError> {
    let lock = tx.prepare_cached(LOCK_ORDER).await?;
    Ok(tx
        .query_opt(&lock, &[&order_id, &tenant])
        .await?
        .map(|row| LockedOrder {
            status: row.get(0),
            total: Money::from_minor(row.get(1)),
            currency: row.get(2),
            placed_at: row.get(3),
        }))
}

/// The currency code of `order_id` in `tenant` (`None`: no such order).
pub async fn order_currency(
    client: &deadpool_postgres::Client,
    tenant: &str,
    order_id: Uuid,
) -> Result<Option<String>, ApiError> {
    let statement = client
        .prepare_cached("SELECT currency FROM orders WHERE order_id = $1 AND tenant_id = $2")
        .await?;
    Ok(client
        .query_opt(&statement, &[&order_id, &tenant])
        .await?
        .map(|row| row.get(0)))
}

async fn advance(
    tx: &Transaction<'_>,
    order_id: Uuid,
    status: &str,
) -> Result<(i64, OffsetDateTime), ApiError> {
    let statement = tx.prepare_cached(ADVANCE_ORDER).await?;
    let row = tx.query_one(&statement, &[&order_id, &status]).await?;
    Ok((row.get(0), row.get(1)))
}

// ---------------------------------------------------------------- payments

#[derive(Debug, Serialize)]
pub struct PaymentView {
    pub order_id: Uuid,
    pub payment_id: String,
    pub amount: Money,
    pub currency: String,
    pub method: String,
    pub order_status: &'static str,
    pub event_sequence: i64,
    #[serde(with = "time::serde::rfc3339")]
    pub received_at: OffsetDateTime,
}

async fn pay(
    tx: &Transaction<'_>,
    tenant: &str,
    order_id: Uuid,
    payment: PaymentRequest,
    trace: &TraceContext,
) -> Result<Result<Stored, Rejection>, ApiError> {
    let Some(LockedOrder {
        status,
        total,
        currency,
        ..
    }) = lock_order(tx, tenant, order_id).await?
    else {
        return Ok(Err(Rejection::OrderNotFound));
    };
    if status != "placed" {
        // Which payment the order has (one, orders V9): a retry of the
        // same payment whose key expired is told from another payment.
        let paid_by = tx
            .prepare_cached(
                "SELECT payment_id FROM payments WHERE order_id = $1 AND tenant_id = $2",
            )
            .await?;
        let payment_id: Option<String> = tx
            .query_opt(&paid_by, &[&order_id, &tenant])
            .await?
            .map(|row| row.get(0));
        return Ok(Err(Rejection::OrderAlreadyPaid {
            by_this_payment: payment_id.as_deref() == Some(payment.payment_id.as_str()),
            payment_id,
        }));
    }
    if let Some(given) = &payment.currency {
        if given.as_str() != currency {
            return Ok(Err(Rejection::CurrencyMismatch {
                expected: currency,
                got: given.as_str().to_owned(),
            }));
        }
    }
    if payment.amount != total {
        return Ok(Err(Rejection::AmountMismatch {
            expected: total.to_string(),
            got: payment.amount.to_string(),
        }));
    }
    // A payment id names one order of the tenant (orders V17's unique
    // index). Another order's request with the same id at the same time
    // holds no lock this one takes: the index decides, this insert waiting
    // for the other's COMMIT (or ROLLBACK, then it inserts).
    let insert = tx
        .prepare_cached(
            "INSERT INTO payments (order_id, payment_id, tenant_id, amount_minor, method) \
             VALUES ($1, $2, $3, $4, $5) \
             ON CONFLICT (tenant_id, payment_id) DO NOTHING",
        )
        .await?;
    let inserted = tx
        .execute(
            &insert,
            &[
                &order_id,
                &payment.payment_id,
                &tenant,
                &payment.amount.minor(),
                &payment.method,
            ],
        )
        .await?;
    if inserted == 0 {
        // The row that conflicted is committed and this statement (a new
        // snapshot) sees it, unless it was deleted or renamed by hand in
        // between (the runbook's repair before V17): then nothing is
        // decided, and a retry under the same key runs it again.
        let holder = tx
            .prepare_cached(
                "SELECT order_id FROM payments WHERE tenant_id = $1 AND payment_id = $2",
            )
            .await?;
        let Some(order) = tx
            .query_opt(&holder, &[&tenant, &payment.payment_id])
            .await?
        else {
            return Err(ApiError::Busy);
        };
        return Ok(Err(Rejection::PaymentAlreadyRecorded {
            payment_id: payment.payment_id,
            order_id: order.get(0),
        }));
    }
    let (sequence, at) = advance(tx, order_id, "paid").await?;
    let currency =
        events::Currency::parse(&currency).map_err(|e| ApiError::Internal(e.to_string()))?;
    let event = PaymentReceivedV1 {
        order_id,
        payment_id: payment.payment_id.clone(),
        amount: payment.amount,
        currency: currency.clone(),
        method: payment.method.clone(),
    };
    write_outbox(tx, tenant, order_id, sequence, at, &event, trace).await?;
    let view = PaymentView {
        order_id,
        payment_id: payment.payment_id,
        amount: payment.amount,
        currency: currency.as_str().to_owned(),
        method: payment.method,
        order_status: "paid",
        event_sequence: sequence,
        received_at: at,
    };
    Ok(Ok(created(&view, order_id)?))
}

// -------------------------------------------------------------- deliveries

#[derive(Debug, Serialize)]
pub struct DeliveryView {
    pub order_id: Uuid,
    pub delivery_id: String,
    pub lines: Vec<DeliveredLineV1>,
    pub order_status: &'static str,
    pub event_sequence: i64,
    /// When the parcel was delivered: the request's `delivered_at`, or
    /// `recorded_at`.
    #[serde(with = "time::serde::rfc3339")]
    pub delivered_at: OffsetDateTime,
    /// When the API recorded the delivery (the event's `occurred_at`).
    #[serde(with = "time::serde::rfc3339")]
    pub recorded_at: OffsetDateTime,
}

async fn deliver(
    tx: &Transaction<'_>,
    tenant: &str,
    order_id: Uuid,
    delivery: DeliveryRequest,
    trace: &TraceContext,
) -> Result<Result<Stored, Rejection>, ApiError> {
    // Not in the future, on the database's clock (the one the event's own
    // time comes from), first as when the API host's clock judged it before
    // anything else: a refusal not stored (`is_final`), the key left free.
    if let Some(at) = delivery.delivered_at {
        let clock = tx.prepare_cached("SELECT clock_timestamp()").await?;
        let now: time::OffsetDateTime = tx.query_one(&clock, &[]).await?.get(0);
        if crate::request::in_the_future(at, now) {
            return Ok(Err(Rejection::DeliveredInTheFuture));
        }
    }
    let Some(order) = lock_order(tx, tenant, order_id).await? else {
        return Ok(Err(Rejection::OrderNotFound));
    };
    match order.status.as_str() {
        "placed" => return Ok(Err(Rejection::OrderNotPaid)),
        "delivered" => return Ok(Err(Rejection::OrderAlreadyDelivered)),
        _ => {}
    }
    // The delivered quantities per SKU must be exactly the order's.
    let lines = tx
        .prepare_cached(
            "SELECT sku, sum(qty)::bigint FROM order_lines \
              WHERE order_id = $1 AND tenant_id = $2 GROUP BY sku",
        )
        .await?;
    let ordered: BTreeMap<String, i64> = tx
        .query(&lines, &[&order_id, &tenant])
        .await?
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect();
    let mut delivered: BTreeMap<String, i64> = BTreeMap::new();
    for line in &delivery.lines {
        *delivered.entry(line.sku.clone()).or_default() += i64::from(line.qty);
    }
    if delivered != ordered {
        return Ok(Err(Rejection::DeliveryLinesMismatch));
    }
    if let Some(at) = delivery.delivered_at {
        if at < order.placed_at {
            return Ok(Err(Rejection::DeliveredBeforePlaced {
                placed_at: order.placed_at,
            }));
        }
    }
    // `at`: when the delivery is recorded (the event's occurred_at);
    // `delivered_at`: when the parcel was delivered, if the request says.
    let (sequence, at) = advance(tx, order_id, "delivered").await?;
    let delivered_at = delivery.delivered_at.unwrap_or(at);
    let insert = tx
        .prepare_cached(
            "INSERT INTO deliveries (order_id, delivery_id, tenant_id, delivered_at) VALUES ($1, $2, $3, $4)",
        )
        .await?;
    tx.execute(
        &insert,
        &[&order_id, &delivery.delivery_id, &tenant, &delivered_at],
    )
    .await?;
    let lines: Vec<DeliveredLineV1> = delivery
        .lines
        .iter()
        .map(|l| DeliveredLineV1 {
            sku: l.sku.clone(),
            qty: l.qty,
        })
        .collect();
    let event = ParcelDeliveredV1 {
        order_id,
        delivery_id: delivery.delivery_id.clone(),
        delivered_at,
        lines: lines.clone(),
    };
    write_outbox(tx, tenant, order_id, sequence, at, &event, trace).await?;
    let view = DeliveryView {
        order_id,
        delivery_id: delivery.delivery_id,
        lines,
        order_status: "delivered",
        event_sequence: sequence,
        delivered_at,
        recorded_at: at,
    };
    Ok(Ok(created(&view, order_id)?))
}

// --------------------------------------------------------------------- read

/// GET /orders/{id}, scoped to the caller's tenant.
pub async fn get_order(
    client: &deadpool_postgres::Client,
    tenant: &str,
    order_id: Uuid,
) -> Result<Option<OrderView>, ApiError> {
    let statement = client
        .prepare_cached(
            // Its payment and delivery in the same statement, so in the
            // same snapshot as its status (one each: orders V9).
            "SELECT o.status, o.customer_id, o.checkout_id, o.currency, o.location, \
                    o.merchandise_minor, o.shipping_minor, o.tax_minor, o.total_minor, \
                    o.created_at, p.payment_id, p.method, p.amount_minor, d.delivery_id, \
                    d.delivered_at \
               FROM orders o \
               LEFT JOIN payments p ON p.order_id = o.order_id AND p.tenant_id = o.tenant_id \
               LEFT JOIN deliveries d ON d.order_id = o.order_id AND d.tenant_id = o.tenant_id \
              WHERE o.order_id = $1 AND o.tenant_id = $2",
        )
        .await?;
    let Some(row) = client.query_opt(&statement, &[&order_id, &tenant]).await? else {
        return Ok(None);
    };
    let lines = client
        .prepare_cached(
            "SELECT sku, qty, unit_price_minor, unit_cost_minor FROM order_lines \
              WHERE order_id = $1 AND tenant_id = $2 ORDER BY line_no",
        )
        .await?;
    let lines = client
        .query(&lines, &[&order_id, &tenant])
        .await?
        .iter()
        .map(|l| events::OrderLineV1 {
            sku: l.get(0),
            qty: u32::try_from(l.get::<_, i32>(1)).unwrap_or_default(),
            unit_price: Money::from_minor(l.get(2)),
            unit_cost: Money::from_minor(l.get(3)),
        })
        .collect();
    let payment = row
        .get::<_, Option<String>>(10)
        .map(|payment_id| PaymentSummary {
            payment_id,
            method: row.get(11),
            amount: Money::from_minor(row.get(12)),
        });
    let delivery = row
        .get::<_, Option<String>>(13)
        .map(|delivery_id| DeliverySummary {
            delivery_id,
            delivered_at: row.get(14),
        });
    Ok(Some(OrderView {
        order_id,
        status: row.get(0),
        customer_id: row.get(1),
        checkout_id: row.get(2),
        currency: row.get(3),
        location: row.get(4),
        lines,
        merchandise: Money::from_minor(row.get(5)),
        shipping: Money::from_minor(row.get(6)),
        tax: Money::from_minor(row.get(7)),
        total: Money::from_minor(row.get(8)),
        created_at: row.get(9),
        payment,
        delivery,
    }))
}
