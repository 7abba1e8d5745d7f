//! The loyalty consumer: loyalty points and their audit trail, kept in step
//! with order events by the shared consumer runtime. This crate holds only the
//! domain.
//!
//! - `OrderPlaced`: keeps the customer and the merchandise amount of the order
//!   (`ParcelDelivered` carries neither).
//! - `ParcelDelivered`: one `loyalty_entries` row: the customer earns one point
//!   per whole currency unit of merchandise (80.00 -> +80), referencing the
//!   order and the event that caused it.

// Endpoints return kit::http::Problem (problem+json) as their error type.
#![allow(clippy::result_large_err)]

use actix_web::{web, HttpResponse};
use consumer_runtime::{
    auth::{database_error, next_after, PageQuery},
    HandlerError, TenantScope, Transaction,
};
use events::{Event, Money, RawEnvelope};
use kit::{http::Problem, metrics::prometheus::Registry, migrations::Database};
use serde::Serialize;
use uuid::Uuid;

/// The loyalty domain.
pub struct Loyalty;

/// Points for a merchandise amount: one per whole currency unit.
pub fn points_for(merchandise: Money) -> i64 {
    merchandise.whole_units()
}

impl consumer_runtime::Domain for Loyalty {
    type Effects = ();
    const NAME: &'static str = "loyalty";
    const SERVICE: &'static str = "loyalty-consumer";
    const ENV_PREFIX: &'static str = "LOYALTY_CONSUMER";
    const DATABASE: Database = Database::Loyalty;
    const DEFAULT_PORT: u16 = 8083;
    const HANDLES: &'static [&'static str] = &[
        events::event_types::ORDER_PLACED,
        events::event_types::PARCEL_DELIVERED,
    ];

    fn new(_registry: &Registry) -> Self {
        Loyalty
    }

    async fn apply(
        &self,
        tx: &Transaction<'_>,
        event: &Event,
        envelope: &RawEnvelope,
    ) -> Result<(), HandlerError> {
        match event {
            Event::OrderPlaced(order) => {
                let merchandise = order
                    .merchandise()
                    .ok_or_else(|| HandlerError::new("merchandise overflows"))?;
                let placed = tx
                    .execute(
                        &tx.prepare_cached(
                            "INSERT INTO loyalty_orders \
                       (tenant_id, order_id, customer_id, currency, merchandise, placed_event_id) \
                     VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT DO NOTHING",
                        )
                        .await?,
                        &[
                            &envelope.tenant_id,
                            &order.order_id,
                            &order.customer_id,
                            &order.currency.as_str(),
                            &merchandise.minor(),
                            &envelope.event_id,
                        ],
                    )
                    .await?;
                if placed == 0 {
                    return Err(consumer_runtime::already_placed(
                        tx,
                        "SELECT placed_event_id FROM loyalty_orders WHERE tenant_id = $1 AND order_id = $2",
                        &envelope.tenant_id,
                        order.order_id,
                        "not taking its terms twice",
                    )
                    .await);
                }
                Ok(())
            }
            Event::ParcelDelivered(delivery) => {
                // The order's terms and an award it already has, asked
                // together (one round trip; both only read). One delivery
                // per order (order-api enforces it): never award twice.
                // LIMIT 1: a correction by hand leaves several entries (a
                // negative one and the right one) under the type.
                let terms = tx
                    .prepare_cached(
                        "SELECT customer_id, merchandise, currency FROM loyalty_orders \
                         WHERE tenant_id = $1 AND order_id = $2",
                    )
                    .await?;
                let award = tx
                    .prepare_cached(
                        "SELECT event_id FROM loyalty_entries WHERE tenant_id = $1 \
                         AND order_id = $2 AND event_type = $3 LIMIT 1",
                    )
                    .await?;
                let (row, awarded) = futures_util::future::join(
                    tx.query_opt(&terms, &[&envelope.tenant_id, &delivery.order_id]),
                    tx.query_opt(
                        &award,
                        &[
                            &envelope.tenant_id,
                            &delivery.order_id,
                            &envelope.event_type,
                        ],
                    ),
                )
                .await;
                let row = row?.ok_or_else(|| {
                    HandlerError::new(format!(
                        "order {} delivered but never placed here (no OrderPlaced)",
                        delivery.order_id
                    ))
                })?;
                // Its failure too, before anything returns: the transaction
                // is aborted, and a COMMIT of it would roll back silently.
                let awarded = awarded?;
                let customer: String = row.get(0);
                let merchandise = Money::from_minor(row.get(1));
                let currency: String = row.get(2);
                let points = points_for(merchandise);
                if points == 0 {
                    return Ok(());
                }
                if let Some(row) = awarded {
                    let first: Uuid = row.get(0);
                    return Err(HandlerError::new(format!(
                        "points for order {} were already awarded (event {first})",
                        delivery.order_id
                    )));
                }
                tx.execute(&tx.prepare_cached("INSERT INTO loyalty_entries (tenant_id, customer_id, order_id, points, \
                       event_id, event_type, reason, occurred_at) \
                     VALUES ($1, $2, $3, $4, $5, $6, $7, $8)").await?,
                    &[
                        &envelope.tenant_id,
                        &customer,
                        &delivery.order_id,
                        &points,
                        &envelope.event_id,
                        &envelope.event_type,
                        &format!(
                            "1 point per whole {currency} of merchandise: {merchandise} {currency} delivered (delivery {})",
                            delivery.delivery_id
                        ),
                        // When the parcel was delivered (the ledger dates the
                        // revenue so too), not when the API recorded it: a
                        // late report earns its points in the delivery's
                        // period. `recorded_at` keeps the writing time.
                        &delivery.delivered_at,
                    ],
                )
                .await?;
                Ok(())
            }
            _ => Ok(()),
        }
    }

    fn routes(cfg: &mut web::ServiceConfig) {
        cfg.service(kit::http::resource(
            "/customers/{id}/loyalty",
            kit::http::get_or_head().to(get_loyalty),
            "GET, HEAD",
        ));
    }
}

#[derive(Debug, Serialize)]
struct EntryView {
    entry_id: i64,
    points: i64,
    order_id: Uuid,
    event_id: Uuid,
    event_type: String,
    reason: String,
    #[serde(with = "time::serde::rfc3339")]
    occurred_at: time::OffsetDateTime,
    #[serde(with = "time::serde::rfc3339")]
    recorded_at: time::OffsetDateTime,
}

/// `GET /customers/{id}/loyalty?tenant=&after=&limit=`: the balance (of
/// every entry) and the entries with the event that caused each, oldest
/// first (in the order they were written: by their transactions' ids, then
/// their own), `limit` a page from the one after entry `after`; an entry
/// shows once every transaction that wrote before it is over
/// ([`consumer_runtime::auth::SETTLED_HORIZON`]), so a reader paging on
/// with `after` misses none. (By id alone it could: ids are drawn at insert
/// and committed in any order.)
async fn get_loyalty(
    scope: TenantScope,
    pool: web::Data<kit::db::PgPool>,
    customer: web::Path<String>,
    page: web::Query<PageQuery>,
) -> Result<HttpResponse, Problem> {
    let customer = customer.into_inner();
    consumer_runtime::auth::no_control_characters("customer_id", &customer)?;
    let limit = page.limit()?;
    let after: Option<i64> = page.after("an entry_id (an integer)")?;
    let client = pool.get().await.map_err(database_error)?;
    if let Some(after) = after {
        consumer_runtime::auth::known_cursor(
            &client,
            "SELECT 1 FROM loyalty_entries \
             WHERE tenant_id = $1 AND customer_id = $2 AND entry_id = $3",
            &[&scope.tenant, &customer, &after],
            || format!("after: no loyalty entry {after} of this customer in this tenant"),
        )
        .await?;
    }
    // In writing order, up to the oldest transaction still running
    // ([`consumer_runtime::auth::SETTLED_HORIZON`]).
    let rows = client
        .query(
            &format!(
                "SELECT entry_id, points, order_id, event_id, event_type, reason, occurred_at, \
                        recorded_at \
                 FROM loyalty_entries WHERE tenant_id = $1 AND customer_id = $2 \
                   AND ($3::bigint IS NULL OR (coalesce(written_by, '0'::xid8), entry_id) > \
                        (SELECT coalesce(c.written_by, '0'::xid8), c.entry_id \
                         FROM loyalty_entries c \
                         WHERE c.tenant_id = $1 AND c.customer_id = $2 AND c.entry_id = $3)) \
                   AND coalesce(written_by, '0'::xid8) < {horizon} \
                 ORDER BY coalesce(written_by, '0'::xid8), entry_id LIMIT $4",
                horizon = consumer_runtime::auth::SETTLED_HORIZON
            ),
            &[&scope.tenant, &customer, &after, &limit],
        )
        .await
        .map_err(database_error)?;
    let entries: Vec<EntryView> = rows
        .iter()
        .map(|row| EntryView {
            entry_id: row.get(0),
            points: row.get(1),
            order_id: row.get(2),
            event_id: row.get(3),
            event_type: row.get(4),
            reason: row.get(5),
            occurred_at: row.get(6),
            recorded_at: row.get(7),
        })
        .collect();
    // Over every entry, not the page. As text, then i128: each entry's
    // points fit in i64, their sum need not (written as a JSON number by
    // the serializer; `json!` would go through a `Value`, which cannot
    // hold it).
    let total: String = client
        .query_one(
            "SELECT COALESCE(sum(points), 0)::text FROM loyalty_entries \
             WHERE tenant_id = $1 AND customer_id = $2",
            &[&scope.tenant, &customer],
        )
        .await
        .map_err(database_error)?
        .get(0);
    let balance: i128 = total.parse().map_err(database_error)?;
    let next_after = next_after(entries.len(), limit, entries.last().map(|e| e.entry_id));
    Ok(HttpResponse::Ok().json(LoyaltyView {
        tenant: scope.tenant,
        customer_id: customer,
        balance,
        entries,
        next_after,
    }))
}

#[derive(Debug, Serialize)]
struct LoyaltyView {
    tenant: String,
    customer_id: String,
    balance: i128,
    entries: Vec<EntryView>,
    next_after: Option<i64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_point_per_whole_unit_of_merchandise() {
        assert_eq!(points_for(Money::from_minor(8000)), 80);
        assert_eq!(points_for(Money::from_minor(8099)), 80);
        assert_eq!(points_for(Money::from_minor(99)), 0);
    }
}
