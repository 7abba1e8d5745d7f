//! The inventory consumer: stock levels and movements, kept in step with order
//! events by the shared consumer runtime. This crate holds only the domain.
//!
//! - `OrderPlaced`: reserve each line at the order's location (`reserve`,
//!   qty n: reserved +n). A reservation beyond what is available is still
//!   recorded, flagged with its `shortage` and counted
//!   (`inventory_shortages_total`); on_hand never goes negative (CHECK).
//! - `ParcelDelivered`: the sale (`sale`, qty -n: on_hand -n, reserved -n,
//!   the reservation released).
//! - `POST /stock/receipts`: inventory owns receipts (`receipt`, qty +n,
//!   on_hand +n), idempotent by `(tenant, receipt_id)`.
//!
//! Each movement and its level change are written in one transaction.

// Endpoints return kit::http::Problem (problem+json) as their error type.
#![allow(clippy::result_large_err)]

use std::collections::BTreeMap;

use actix_web::{http::StatusCode, web, HttpResponse};
use consumer_runtime::{
    auth::{
        bad_request, database_error, next_after, no_control_characters, not_found, text_param,
        PageQuery,
    },
    HandlerError, TenantScope, Transaction,
};
use events::{Event, RawEnvelope};
use kit::{
    http::Problem,
    metrics::prometheus::{IntCounter, Registry},
    migrations::Database,
};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// The inventory domain.
pub struct Inventory {
    shortages: IntCounter,
}

impl consumer_runtime::Domain for Inventory {
    /// Reservations short of stock, counted once committed.
    type Effects = u64;
    const NAME: &'static str = "inventory";
    const SERVICE: &'static str = "inventory-consumer";
    const ENV_PREFIX: &'static str = "INVENTORY_CONSUMER";
    const DATABASE: Database = Database::Inventory;
    const DEFAULT_PORT: u16 = 8081;
    const HANDLES: &'static [&'static str] = &[
        events::event_types::ORDER_PLACED,
        events::event_types::PARCEL_DELIVERED,
    ];

    fn new(registry: &Registry) -> Self {
        let shortages = IntCounter::new(
            "inventory_shortages_total",
            "Reservations beyond the available stock (order lines short)",
        )
        .expect("a valid metric definition");
        kit::metrics::register(registry, &shortages);
        Self { shortages }
    }

    async fn apply(
        &self,
        tx: &Transaction<'_>,
        event: &Event,
        envelope: &RawEnvelope,
    ) -> Result<u64, HandlerError> {
        match event {
            Event::OrderPlaced(order) => {
                let lines = by_sku(order.lines.iter().map(|l| (l.sku.as_str(), l.qty)));
                let skus: Vec<&str> = lines.keys().copied().collect();
                let qtys: Vec<i64> = lines.values().copied().collect();
                let reserve = tx.prepare_cached(RESERVE_ORDER).await?;
                let reserved = tx
                    .query(
                        &reserve,
                        &[
                            &envelope.tenant_id,
                            &order.order_id,
                            &order.location,
                            &skus,
                            &qtys,
                            &envelope.event_id,
                        ],
                    )
                    .await?;
                if reserved.is_empty() {
                    // Nothing reserved (an order has lines: the decoder
                    // refuses one without): the order was placed here before.
                    return Err(consumer_runtime::already_placed(
                        tx,
                        "SELECT event_id FROM inventory_orders WHERE tenant_id = $1 AND order_id = $2",
                        &envelope.tenant_id,
                        order.order_id,
                        "not reserving its stock twice",
                    )
                    .await);
                }
                if reserved.len() != lines.len() {
                    // Cannot happen (one movement per distinct sku); never
                    // commit a partial reservation if it does.
                    return Err(HandlerError::new(format!(
                        "reserved {} of {} skus of order {}",
                        reserved.len(),
                        lines.len(),
                        order.order_id
                    )));
                }
                let mut short = 0;
                for row in reserved {
                    let (sku, qty, shortage): (String, i64, i64) =
                        (row.get(0), row.get(1), row.get(2));
                    if shortage > 0 {
                        short += 1;
                        tracing::warn!(%sku, location = %order.location, qty, shortage, order = %order.order_id, "stock shortage");
                    }
                }
                // Counted once committed (`committed`): an attempt rolled
                // back and run again counts once.
                Ok(short)
            }
            Event::ParcelDelivered(delivery) => {
                // Where the order was placed and what it holds: asked
                // together (one round trip; both only read).
                let (location, held) = futures_util::future::join(
                    location_of(tx, &envelope.tenant_id, delivery.order_id),
                    holdings(tx, &envelope.tenant_id, delivery.order_id),
                )
                .await;
                let location = location?;
                let held = held?;
                let lines = by_sku(delivery.lines.iter().map(|l| (l.sku.as_str(), l.qty)));
                // One delivery per order, of what was ordered (order-api
                // enforces both; the ledger and loyalty refuse a second
                // delivery too, and book the order's own terms, stored at
                // placement, whatever lines a delivery names): a second one
                // would sell the stock again, and lines that differ would
                // leave a reservation held for good. Stop for a human
                // instead.
                if let Some(first) = held.values().find_map(|h| h.sold_by) {
                    return Err(HandlerError::new(format!(
                        "order {} was already delivered (event {first}); not selling its stock twice",
                        delivery.order_id
                    )));
                }
                let reserved: BTreeMap<&str, i64> = held
                    .iter()
                    .map(|(sku, h)| (sku.as_str(), h.reserved))
                    .collect();
                if reserved != lines {
                    return Err(HandlerError::new(format!(
                        "order {} delivered {lines:?}, but it reserved {reserved:?}",
                        delivery.order_id
                    )));
                }
                sell(tx, envelope, delivery.order_id, &location, &lines, &held).await?;
                Ok(0)
            }
            _ => Ok(0),
        }
    }

    fn committed(&self, shortages: u64) {
        self.shortages.inc_by(shortages);
    }

    fn routes(cfg: &mut web::ServiceConfig) {
        use kit::http::{get_or_head, resource};
        cfg.service(
            resource(
                "/stock/receipts",
                web::post().to(post_receipt),
                "GET, HEAD, POST",
            )
            .route(get_or_head().to(get_stock_of_receipts_sku)),
        )
        .service(resource(
            "/stock/{sku}",
            get_or_head().to(get_stock),
            "GET, HEAD",
        ))
        .service(resource(
            "/stock/{sku}/movements",
            get_or_head().to(get_movements),
            "GET, HEAD",
        ));
    }
}

/// An order's reservation in one statement (one round trip, however many
/// lines): the order's location row, each distinct sku's level upserted and
/// locked in sku byte order (`COLLATE "C"`: the order of the `BTreeMap` a
/// sale locks them in, whatever the database's collation; the same lock
/// order for every order: no deadlock between partitions), `reserved += qty`, and one `reserve` movement per sku
/// with its shortage: how much of `qty` exceeded what was available before
/// (`on_hand - reserved`, never below zero). `$1` tenant, `$2` order, `$3`
/// location, `$4` skus (distinct), `$5` their quantities, `$6` event id.
/// Returns (sku, qty, shortage) per sku; nothing, and nothing written, when
/// the order was already placed here (by another event: the inbox drops a
/// redelivery of the same one).
pub const RESERVE_ORDER: &str = "\
WITH lines AS (
    SELECT sku, qty FROM unnest($4::text[], $5::bigint[]) AS l(sku, qty)
), placed AS (
    INSERT INTO inventory_orders (tenant_id, order_id, location, event_id)
    VALUES ($1, $2, $3, $6) ON CONFLICT DO NOTHING
    RETURNING order_id
), levels AS (
    INSERT INTO stock_levels AS s (tenant_id, sku, location, reserved)
    SELECT $1, sku, $3, qty FROM lines WHERE EXISTS (SELECT FROM placed)
    ORDER BY sku COLLATE \"C\"
    ON CONFLICT (tenant_id, sku, location)
    DO UPDATE SET reserved = s.reserved + EXCLUDED.reserved, updated_at = now()
    RETURNING s.sku, s.on_hand, s.reserved
)
INSERT INTO stock_movements (tenant_id, sku, location, movement_type, qty, on_hand_delta,
                             reserved_delta, shortage, order_id, event_id)
SELECT $1, l.sku, $3, 'reserve', l.qty, 0, l.qty,
       LEAST(l.qty, GREATEST(0, l.qty - GREATEST(0, v.on_hand - (v.reserved - l.qty)))),
       $2, $6
FROM lines l JOIN levels v ON v.sku = l.sku
RETURNING sku, qty, shortage";

/// Quantities per sku (an order may list a sku twice).
fn by_sku<'a>(lines: impl Iterator<Item = (&'a str, u32)>) -> BTreeMap<&'a str, i64> {
    let mut map = BTreeMap::new();
    for (sku, qty) in lines {
        *map.entry(sku).or_insert(0) += i64::from(qty);
    }
    map
}

/// What an order's movements say of one sku: how many it reserved (the
/// ordered quantity), how many of them it still holds reserved, and the
/// event that sold it, if one did.
struct Holding {
    reserved: i64,
    outstanding: i64,
    sold_by: Option<Uuid>,
}

/// The order's [`Holding`] per sku, in one read of its movements (only its
/// own events move them, one at a time: no lock needed).
async fn holdings(
    tx: &Transaction<'_>,
    tenant: &str,
    order_id: Uuid,
) -> Result<BTreeMap<String, Holding>, HandlerError> {
    let rows = tx
        .query(
            &tx.prepare_cached(
                "SELECT sku, \
                        coalesce(sum(qty) FILTER (WHERE movement_type = 'reserve'), 0)::bigint, \
                        coalesce(sum(reserved_delta), 0)::bigint, \
                        (array_agg(event_id ORDER BY movement_id) \
                           FILTER (WHERE movement_type = 'sale'))[1] \
                 FROM stock_movements WHERE tenant_id = $1 AND order_id = $2 GROUP BY sku",
            )
            .await?,
            &[&tenant, &order_id],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|row| {
            (
                row.get(0),
                Holding {
                    reserved: row.get(1),
                    outstanding: row.get(2),
                    sold_by: row.get(3),
                },
            )
        })
        .collect())
}

/// Ensure the level row exists and lock it; returns (on_hand, reserved).
async fn lock_level(
    tx: &Transaction<'_>,
    tenant: &str,
    sku: &str,
    location: &str,
) -> Result<(i64, i64), tokio_postgres::Error> {
    let ensure = tx
        .prepare_cached(
            "INSERT INTO stock_levels (tenant_id, sku, location) VALUES ($1, $2, $3) \
             ON CONFLICT DO NOTHING",
        )
        .await?;
    tx.execute(&ensure, &[&tenant, &sku, &location]).await?;
    let lock = tx
        .prepare_cached(
            "SELECT on_hand, reserved FROM stock_levels \
             WHERE tenant_id = $1 AND sku = $2 AND location = $3 FOR UPDATE",
        )
        .await?;
    let row = tx.query_one(&lock, &[&tenant, &sku, &location]).await?;
    Ok((row.get(0), row.get(1)))
}

/// One movement and its level change.
struct Movement<'a> {
    tenant: &'a str,
    sku: &'a str,
    location: &'a str,
    kind: &'static str,
    qty: i64,
    on_hand_delta: i64,
    reserved_delta: i64,
    shortage: i64,
    order_id: Option<Uuid>,
    receipt_id: Option<&'a str>,
    event_id: Option<Uuid>,
}

async fn record(tx: &Transaction<'_>, m: &Movement<'_>) -> Result<(), tokio_postgres::Error> {
    let insert = tx
        .prepare_cached(
            "INSERT INTO stock_movements (tenant_id, sku, location, movement_type, qty, \
               on_hand_delta, reserved_delta, shortage, order_id, receipt_id, event_id) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
        )
        .await?;
    tx.execute(
        &insert,
        &[
            &m.tenant,
            &m.sku,
            &m.location,
            &m.kind,
            &m.qty,
            &m.on_hand_delta,
            &m.reserved_delta,
            &m.shortage,
            &m.order_id,
            &m.receipt_id,
            &m.event_id,
        ],
    )
    .await?;
    let update = tx
        .prepare_cached(
            "UPDATE stock_levels SET on_hand = on_hand + $4, reserved = reserved + $5, \
             updated_at = now() WHERE tenant_id = $1 AND sku = $2 AND location = $3",
        )
        .await?;
    tx.execute(
        &update,
        &[
            &m.tenant,
            &m.sku,
            &m.location,
            &m.on_hand_delta,
            &m.reserved_delta,
        ],
    )
    .await?;
    Ok(())
}

/// The location of an order placed here: a failure of the event when its
/// OrderPlaced was never applied here.
async fn location_of(
    tx: &Transaction<'_>,
    tenant: &str,
    order_id: Uuid,
) -> Result<String, HandlerError> {
    tx.query_opt(
        &tx.prepare_cached(
            "SELECT location FROM inventory_orders WHERE tenant_id = $1 AND order_id = $2",
        )
        .await?,
        &[&tenant, &order_id],
    )
    .await?
    .map(|row| row.get(0))
    .ok_or_else(|| {
        HandlerError::new(format!(
            "order {order_id} was delivered but never placed here (no OrderPlaced)"
        ))
    })
}

/// Each sku's level locked, in sku byte order (the order of the
/// reservation's upsert and of a receipt's single lock: no deadlock), and
/// its stock on hand.
const LOCK_LEVELS: &str = "SELECT sku, on_hand FROM stock_levels \
     WHERE tenant_id = $1 AND location = $2 AND sku = ANY($3::text[]) \
     ORDER BY sku COLLATE \"C\" FOR UPDATE";

/// The sale: one `sale` movement per sku and its level's change (`$3`
/// skus, `$4` quantities sold, `$5` reservations released, `$6` order,
/// `$7` event). The levels are locked already ([`LOCK_LEVELS`]).
const RECORD_SALE: &str = "\
WITH sold AS (
    SELECT sku, qty, released FROM unnest($3::text[], $4::bigint[], $5::bigint[]) AS m (sku, qty, released)
), moved AS (
    INSERT INTO stock_movements (tenant_id, sku, location, movement_type, qty, on_hand_delta,
                                 reserved_delta, shortage, order_id, event_id)
    SELECT $1, sku, $2, 'sale', -qty, -qty, -released, 0, $6, $7
      FROM sold ORDER BY sku COLLATE \"C\"
)
UPDATE stock_levels s SET on_hand = s.on_hand - sold.qty, reserved = s.reserved - sold.released,
       updated_at = now()
  FROM sold WHERE s.tenant_id = $1 AND s.location = $2 AND s.sku = sold.sku";

/// Sell `lines` (qty per sku) out of the order's reservations (`held`:
/// what the order still holds of each; other orders' reservations of the
/// same sku are theirs), in two statements whatever the number of skus:
/// the levels locked, then, once every sku has the stock, the movements
/// and the levels' changes. Every level exists: the caller checked that
/// the order reserved exactly these skus, and the reservation created
/// their levels (a level missing anyway has nothing on hand here, and
/// fails the check).
async fn sell(
    tx: &Transaction<'_>,
    envelope: &RawEnvelope,
    order_id: Uuid,
    location: &str,
    lines: &BTreeMap<&str, i64>,
    held: &BTreeMap<String, Holding>,
) -> Result<(), HandlerError> {
    let tenant = envelope.tenant_id.as_str();
    let skus: Vec<&str> = lines.keys().copied().collect();
    let lock = tx.prepare_cached(LOCK_LEVELS).await?;
    let on_hand: BTreeMap<String, i64> = tx
        .query(&lock, &[&tenant, &location, &skus])
        .await?
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect();
    let mut quantities = Vec::with_capacity(lines.len());
    let mut released = Vec::with_capacity(lines.len());
    for (sku, qty) in lines {
        let have = on_hand.get(*sku).copied().unwrap_or_default();
        if have < *qty {
            // Physically delivered but not on the books: a receipt is
            // missing. Never negative stock: fail (retry, then dead letter
            // for a human).
            return Err(HandlerError::new(format!(
                "cannot sell {qty} {sku} at {location}: only {have} on hand (missing receipt?)"
            )));
        }
        let outstanding = held.get(*sku).map_or(0, |h| h.outstanding);
        quantities.push(*qty);
        // Release this order's reservation (at most what was delivered).
        released.push((*qty).min(outstanding.max(0)));
    }
    let record = tx.prepare_cached(RECORD_SALE).await?;
    let changed = tx
        .execute(
            &record,
            &[
                &tenant,
                &location,
                &skus,
                &quantities,
                &released,
                &order_id,
                &envelope.event_id,
            ],
        )
        .await?;
    if changed != lines.len() as u64 {
        // Cannot happen (each level was locked above); never commit a
        // partial sale if it does.
        return Err(HandlerError::new(format!(
            "sold {changed} of {} skus of order {order_id}",
            lines.len()
        )));
    }
    Ok(())
}

// ---------------------------------------------------------------- HTTP

#[derive(Debug, Deserialize)]
struct ReceiptRequest {
    receipt_id: String,
    sku: String,
    location: String,
    qty: i64,
}

#[derive(Debug, Serialize)]
struct Level {
    sku: String,
    location: String,
    on_hand: i64,
    reserved: i64,
    available: i64,
}

#[derive(Debug, Serialize)]
struct MovementView {
    movement_id: i64,
    movement_type: String,
    qty: i64,
    on_hand_delta: i64,
    reserved_delta: i64,
    shortage: i64,
    order_id: Option<Uuid>,
    receipt_id: Option<String>,
    event_id: Option<Uuid>,
    #[serde(with = "time::serde::rfc3339")]
    created_at: time::OffsetDateTime,
}

async fn post_receipt(
    scope: TenantScope,
    pool: web::Data<kit::db::PgPool>,
    body: web::Json<ReceiptRequest>,
) -> Result<HttpResponse, Problem> {
    let r = body.into_inner();
    for (field, value) in [
        ("receipt_id", &r.receipt_id),
        ("sku", &r.sku),
        ("location", &r.location),
    ] {
        text_param(field, value)?;
    }
    if r.qty <= 0 || r.qty > 1_000_000_000 {
        return Err(bad_request("qty", "qty must be a positive whole number"));
    }
    let mut client = pool.get().await.map_err(database_error)?;
    let tx = client.transaction().await.map_err(database_error)?;
    let inserted = tx
        .execute(
            "INSERT INTO stock_receipts (tenant_id, receipt_id, sku, location, qty) \
             VALUES ($1, $2, $3, $4, $5) ON CONFLICT DO NOTHING",
            &[&scope.tenant, &r.receipt_id, &r.sku, &r.location, &r.qty],
        )
        .await
        .map_err(database_error)?;
    if inserted == 0 {
        let row = tx
            .query_one(
                "SELECT sku, location, qty FROM stock_receipts WHERE tenant_id = $1 AND receipt_id = $2",
                &[&scope.tenant, &r.receipt_id],
            )
            .await
            .map_err(database_error)?;
        let same = row.get::<_, String>(0) == r.sku
            && row.get::<_, String>(1) == r.location
            && row.get::<_, i64>(2) == r.qty;
        tx.rollback().await.map_err(database_error)?;
        // Back to the pool before the level's read takes one: requests
        // holding one each while waiting for a second would stall the read
        // pool (4 receipts at once) until its wait timed out.
        drop(client);
        if !same {
            return Err(Problem::new(
                StatusCode::CONFLICT,
                "receipt_conflict",
                "This receipt id was already used with different contents",
            )
            .field("receipt_id"));
        }
        let level = level(&pool, &scope.tenant, &r.sku, &r.location).await?;
        return Ok(HttpResponse::Ok()
            .insert_header(("Idempotent-Replayed", "true"))
            .json(
                serde_json::json!({ "receipt_id": r.receipt_id, "replayed": true, "level": level }),
            ));
    }
    lock_level(&tx, &scope.tenant, &r.sku, &r.location)
        .await
        .map_err(database_error)?;
    record(
        &tx,
        &Movement {
            tenant: &scope.tenant,
            sku: &r.sku,
            location: &r.location,
            kind: "receipt",
            qty: r.qty,
            on_hand_delta: r.qty,
            reserved_delta: 0,
            shortage: 0,
            order_id: None,
            receipt_id: Some(&r.receipt_id),
            event_id: None,
        },
    )
    .await
    .map_err(database_error)?;
    tx.commit().await.map_err(database_error)?;
    // Crash window: the receipt is stored, the client has no answer. Its
    // retry with the same receipt id finds the row and is answered 200
    // `Idempotent-Replayed`: the stock counted once.
    kit::failpoint::crash_point("inventory.receipt.after_commit");
    drop(client);
    let level = level(&pool, &scope.tenant, &r.sku, &r.location).await?;
    Ok(HttpResponse::Created()
        .json(serde_json::json!({ "receipt_id": r.receipt_id, "replayed": false, "level": level })))
}

async fn level(
    pool: &kit::db::PgPool,
    tenant: &str,
    sku: &str,
    location: &str,
) -> Result<Level, Problem> {
    levels(pool, tenant, sku, Some(location))
        .await?
        .into_iter()
        .next()
        .ok_or_else(|| not_found(format!("no stock of {sku} at {location}")))
}

async fn levels(
    pool: &kit::db::PgPool,
    tenant: &str,
    sku: &str,
    location: Option<&str>,
) -> Result<Vec<Level>, Problem> {
    let client = pool.get().await.map_err(database_error)?;
    let rows = client
        .query(
            "SELECT sku, location, on_hand, reserved, available FROM stock_levels \
             WHERE tenant_id = $1 AND sku = $2 AND ($3::text IS NULL OR location = $3) \
             ORDER BY location",
            &[&tenant, &sku, &location],
        )
        .await
        .map_err(database_error)?;
    Ok(rows
        .iter()
        .map(|row| Level {
            sku: row.get(0),
            location: row.get(1),
            on_hand: row.get(2),
            reserved: row.get(3),
            available: row.get(4),
        })
        .collect())
}

#[derive(Debug, Deserialize)]
struct LocationQuery {
    location: Option<String>,
    #[serde(flatten)]
    page: PageQuery,
}

/// `GET /stock/{sku}?tenant=&location=`: the level(s) of one sku, with the
/// movements when a location is given (a page of them: `after`, `limit`,
/// `next_after`).
async fn get_stock(
    scope: TenantScope,
    pool: web::Data<kit::db::PgPool>,
    sku: web::Path<String>,
    query: web::Query<LocationQuery>,
) -> Result<HttpResponse, Problem> {
    stock(scope, pool, sku.into_inner(), query).await
}

/// `GET /stock/receipts`: the stock of the sku named `receipts` (any text
/// is a sku), whose path is also the receipts' resource.
async fn get_stock_of_receipts_sku(
    scope: TenantScope,
    pool: web::Data<kit::db::PgPool>,
    query: web::Query<LocationQuery>,
) -> Result<HttpResponse, Problem> {
    stock(scope, pool, "receipts".to_owned(), query).await
}

async fn stock(
    scope: TenantScope,
    pool: web::Data<kit::db::PgPool>,
    sku: String,
    query: web::Query<LocationQuery>,
) -> Result<HttpResponse, Problem> {
    no_control_characters("sku", &sku)?;
    match query.location.as_deref() {
        Some(location) => {
            no_control_characters("location", location)?;
            let level = level(&pool, &scope.tenant, &sku, location).await?;
            let (movements, next_after) =
                movements(&pool, &scope.tenant, &sku, location, &query.page).await?;
            Ok(HttpResponse::Ok().json(serde_json::json!({
                "tenant": scope.tenant,
                "sku": level.sku,
                "location": level.location,
                "on_hand": level.on_hand,
                "reserved": level.reserved,
                "available": level.available,
                "movements": movements,
                "next_after": next_after,
            })))
        }
        None => {
            let levels = levels(&pool, &scope.tenant, &sku, None).await?;
            if levels.is_empty() {
                return Err(not_found(format!("no stock of {sku}")));
            }
            Ok(HttpResponse::Ok()
                .json(serde_json::json!({ "tenant": scope.tenant, "sku": sku, "levels": levels })))
        }
    }
}

/// `GET /stock/{sku}/movements?tenant=&location=&after=&limit=`: a page of
/// movements, oldest first; a full page has a `Link: <...>; rel="next"`
/// header (RFC 8288) to the next one.
async fn get_movements(
    scope: TenantScope,
    request: actix_web::HttpRequest,
    pool: web::Data<kit::db::PgPool>,
    sku: web::Path<String>,
    query: web::Query<LocationQuery>,
) -> Result<HttpResponse, Problem> {
    let Some(location) = query.location.as_deref() else {
        return Err(bad_request("location", "location is required"));
    };
    no_control_characters("sku", &sku)?;
    no_control_characters("location", location)?;
    let (movements, next_after) =
        movements(&pool, &scope.tenant, &sku, location, &query.page).await?;
    let mut response = HttpResponse::Ok();
    if let Some(after) = next_after {
        let next = serde_urlencoded::to_string([
            ("tenant", scope.tenant.as_str()),
            ("location", location),
            ("after", &after.to_string()),
            ("limit", &query.page.limit()?.to_string()),
        ])
        .map_err(|e| bad_request("location", e.to_string()))?;
        response.insert_header(("Link", format!("<{}?{next}>; rel=\"next\"", request.path())));
    }
    Ok(response.json(movements))
}

/// A page of the movements of one stock level, and the cursor of the next.
async fn movements(
    pool: &kit::db::PgPool,
    tenant: &str,
    sku: &str,
    location: &str,
    page: &PageQuery,
) -> Result<(Vec<MovementView>, Option<i64>), Problem> {
    let limit = page.limit()?;
    let after: Option<i64> = page.after("a movement_id (an integer)")?;
    let client = pool.get().await.map_err(database_error)?;
    let rows = client
        .query(
            "SELECT movement_id, movement_type, qty, on_hand_delta, reserved_delta, shortage, \
                    order_id, receipt_id, event_id, created_at \
             FROM stock_movements WHERE tenant_id = $1 AND sku = $2 AND location = $3 \
               AND ($4::bigint IS NULL OR movement_id > $4) \
             ORDER BY movement_id LIMIT $5",
            &[&tenant, &sku, &location, &after, &limit],
        )
        .await
        .map_err(database_error)?;
    let views: Vec<MovementView> = rows
        .iter()
        .map(|row| MovementView {
            movement_id: row.get(0),
            movement_type: row.get(1),
            qty: row.get(2),
            on_hand_delta: row.get(3),
            reserved_delta: row.get(4),
            shortage: row.get(5),
            order_id: row.get(6),
            receipt_id: row.get(7),
            event_id: row.get(8),
            created_at: row.get(9),
        })
        .collect();
    let next = next_after(views.len(), limit, views.last().map(|m| m.movement_id));
    Ok((views, next))
}
