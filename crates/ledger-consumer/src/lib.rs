//! The ledger consumer: a double-entry journal and trial balance, kept in step
//! with order events by the shared consumer runtime. This crate holds only the
//! domain.
//!
//! - `OrderPlaced`: keeps the order terms (merchandise, shipping, tax, total,
//!   cost of goods) needed to post the delivery; no entry.
//! - `PaymentReceived`: Dr `<Method> clearing` / Cr Customer deposits (amount).
//! - `ParcelDelivered`: Dr Customer deposits (total) / Cr Sales (merchandise),
//!   Shipping income, Tax payable; Dr Cost of goods sold / Cr Inventory (sum of
//!   qty x unit_cost). Revenue is recognised on delivery (seed 003).
//!
//! Entries reference their event and order, are immutable and balanced: both
//! enforced by the database (triggers), not only by this code.

// Endpoints return kit::http::Problem (problem+json) as their error type.
#![allow(clippy::result_large_err)]

use actix_web::{web, HttpResponse};
use consumer_runtime::{
    auth::{bad_request, database_error, database_problem, next_after, PageQuery},
    HandlerError, TenantScope, Transaction,
};
use events::{Event, Money, RawEnvelope};
use kit::{http::Problem, metrics::prometheus::Registry, migrations::Database};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// The ledger domain.
pub struct Ledger;

/// The chart of accounts every tenant gets (clearing accounts per payment
/// method are added as methods appear).
pub const ACCOUNTS: &[(&str, &str, &str)] = &[
    ("customer_deposits", "Customer deposits", "liability"),
    ("sales", "Sales", "revenue"),
    ("shipping_income", "Shipping income", "revenue"),
    ("tax_payable", "Tax payable", "liability"),
    ("cogs", "Cost of goods sold", "expense"),
    ("inventory", "Inventory", "asset"),
];

/// The clearing account of a payment method: (`clearing:card`, `Card clearing`).
pub fn clearing_account(method: &str) -> (String, String) {
    let method = method.trim().to_lowercase();
    let mut chars = method.chars();
    let title = match chars.next() {
        Some(first) => first.to_uppercase().chain(chars).collect::<String>(),
        None => String::from("Unknown"),
    };
    (format!("clearing:{method}"), format!("{title} clearing"))
}

/// One journal line to post: (account code, debit, credit) in minor units.
type Line = (String, i64, i64);

/// The chart of accounts (plus `extra`) for the tenant, each account
/// created unless it exists: one statement (the accounts in a fixed order,
/// so two first postings of a tenant wait on each other's rows in the same
/// order, never in a cycle).
const ENSURE_ACCOUNTS: &str = "INSERT INTO ledger_accounts (tenant_id, code, name, kind) \
     SELECT $1, a.code, a.name, a.kind \
       FROM unnest($2::text[], $3::text[], $4::text[]) WITH ORDINALITY AS a (code, name, kind, n) \
      ORDER BY a.n \
     ON CONFLICT DO NOTHING";

const INSERT_ENTRY: &str = "INSERT INTO journal_entries \
     (entry_id, tenant_id, order_id, event_id, event_type, description, currency, effective_at) \
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8)";

/// An entry's lines, numbered from 1 in the order given: one statement.
const INSERT_LINES: &str = "INSERT INTO journal_lines \
     (entry_id, line_no, tenant_id, account_code, debit, credit) \
     SELECT $1, l.n::int, $2, l.account, l.debit, l.credit \
       FROM unnest($3::text[], $4::bigint[], $5::bigint[]) WITH ORDINALITY AS l (account, debit, credit, n) \
      ORDER BY l.n";

/// Post one journal entry of `lines`, effective at `effective_at` (the
/// business time of the event: when the parcel was delivered, when the
/// payment was recorded), with the accounts it needs (the chart, plus
/// `extra`). The accounts, the entry and its lines are three statements
/// sent together: one round trip instead of one per account and line
/// (tokio-postgres pipelines requests polled concurrently; `join3` polls
/// them in this order, so PostgreSQL runs them in this order, and the
/// lines find their accounts and their entry). The first error is the
/// cause: the later statements then fail with "current transaction is
/// aborted".
async fn post(
    tx: &Transaction<'_>,
    envelope: &RawEnvelope,
    (order_id, effective_at): (Uuid, time::OffsetDateTime),
    description: &str,
    currency: &str,
    extra: Option<(&str, &str, &str)>,
    lines: &[Line],
) -> Result<(), HandlerError> {
    let chart: Vec<(&str, &str, &str)> = ACCOUNTS.iter().copied().chain(extra).collect();
    let codes: Vec<&str> = chart.iter().map(|a| a.0).collect();
    let names: Vec<&str> = chart.iter().map(|a| a.1).collect();
    let kinds: Vec<&str> = chart.iter().map(|a| a.2).collect();
    // e.g. no shipping charged: no line.
    let lines: Vec<&Line> = lines
        .iter()
        .filter(|(_, debit, credit)| *debit != 0 || *credit != 0)
        .collect();
    let accounts: Vec<&str> = lines.iter().map(|l| l.0.as_str()).collect();
    let debits: Vec<i64> = lines.iter().map(|l| l.1).collect();
    let credits: Vec<i64> = lines.iter().map(|l| l.2).collect();
    let entry_id = Uuid::now_v7();
    let ensure = tx.prepare_cached(ENSURE_ACCOUNTS).await?;
    let insert_entry = tx.prepare_cached(INSERT_ENTRY).await?;
    let insert_lines = tx.prepare_cached(INSERT_LINES).await?;
    let (ensured, entry, lines) = futures_util::future::join3(
        tx.execute(&ensure, &[&envelope.tenant_id, &codes, &names, &kinds]),
        tx.execute(
            &insert_entry,
            &[
                &entry_id,
                &envelope.tenant_id,
                &order_id,
                &envelope.event_id,
                &envelope.event_type,
                &description,
                &currency,
                &effective_at,
            ],
        ),
        tx.execute(
            &insert_lines,
            &[&entry_id, &envelope.tenant_id, &accounts, &debits, &credits],
        ),
    )
    .await;
    ensured?;
    entry?;
    lines?;
    Ok(())
}

/// An order's terms as its OrderPlaced booked them (`ledger_orders`), in
/// minor units of `currency`.
struct Terms {
    currency: String,
    merchandise: i64,
    shipping: i64,
    tax: i64,
    total: i64,
    cogs: i64,
}

/// The terms of `order`, which was `what` (paid, delivered): a failure of
/// the event when the ledger never booked its OrderPlaced.
async fn terms(
    tx: &Transaction<'_>,
    tenant: &str,
    order: Uuid,
    what: &str,
) -> Result<Terms, HandlerError> {
    let row = tx
        .query_opt(
            &tx.prepare_cached(
                "SELECT currency, merchandise, shipping, tax, total, cost_of_goods \
                 FROM ledger_orders WHERE tenant_id = $1 AND order_id = $2",
            )
            .await?,
            &[&tenant, &order],
        )
        .await?
        .ok_or_else(|| {
            HandlerError::new(format!(
                "order {order} {what} but its terms are unknown (no OrderPlaced)"
            ))
        })?;
    Ok(Terms {
        currency: row.get(0),
        merchandise: row.get(1),
        shipping: row.get(2),
        tax: row.get(3),
        total: row.get(4),
        cogs: row.get(5),
    })
}

/// The event id of an entry of `event_type` the order already has, if any
/// (any one: a correction by hand leaves several, a reversal and the right
/// entry, under the type of the entry it corrects).
async fn already_posted(
    tx: &Transaction<'_>,
    tenant: &str,
    order: Uuid,
    event_type: &str,
) -> Result<Option<Uuid>, HandlerError> {
    let row = tx
        .query_opt(
            &tx.prepare_cached(
                "SELECT event_id FROM journal_entries WHERE tenant_id = $1 AND order_id = $2 \
                 AND event_type = $3 LIMIT 1",
            )
            .await?,
            &[&tenant, &order, &event_type],
        )
        .await?;
    Ok(row.map(|row| row.get(0)))
}

/// [`already_posted`] and [`terms`] of one order, asked together (one
/// round trip; both only read). An entry already posted is the answer even
/// when the terms are unknown, as when they were asked one after the other.
async fn posted_and_terms(
    tx: &Transaction<'_>,
    tenant: &str,
    order: Uuid,
    event_type: &str,
    what: &str,
) -> Result<(Option<Uuid>, Result<Terms, HandlerError>), HandlerError> {
    let (posted, terms) = futures_util::future::join(
        already_posted(tx, tenant, order, event_type),
        terms(tx, tenant, order, what),
    )
    .await;
    Ok((posted?, terms))
}

fn overflow(what: &str) -> HandlerError {
    HandlerError::new(format!("{what} overflows"))
}

impl consumer_runtime::Domain for Ledger {
    type Effects = ();
    const NAME: &'static str = "ledger";
    const SERVICE: &'static str = "ledger-consumer";
    const ENV_PREFIX: &'static str = "LEDGER_CONSUMER";
    const DATABASE: Database = Database::Ledger;
    const DEFAULT_PORT: u16 = 8082;
    const HANDLES: &'static [&'static str] = &[
        events::event_types::ORDER_PLACED,
        events::event_types::PAYMENT_RECEIVED,
        events::event_types::PARCEL_DELIVERED,
    ];

    fn new(_registry: &Registry) -> Self {
        Ledger
    }

    async fn apply(
        &self,
        tx: &Transaction<'_>,
        event: &Event,
        envelope: &RawEnvelope,
    ) -> Result<(), HandlerError> {
        let tenant = envelope.tenant_id.as_str();
        match event {
            Event::OrderPlaced(order) => {
                let merchandise = order.merchandise().ok_or_else(|| overflow("merchandise"))?;
                let cogs = order
                    .cost_of_goods()
                    .ok_or_else(|| overflow("cost of goods"))?;
                let placed = tx.execute(
                    &tx.prepare_cached(
                        "INSERT INTO ledger_orders (tenant_id, order_id, customer_id, currency, \
                       merchandise, shipping, tax, total, cost_of_goods, placed_event_id) \
                     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10) ON CONFLICT DO NOTHING",
                    )
                    .await?,
                    &[
                        &tenant,
                        &order.order_id,
                        &order.customer_id,
                        &order.currency.as_str(),
                        &merchandise.minor(),
                        &order.shipping.minor(),
                        &order.tax.minor(),
                        &order.total.minor(),
                        &cogs.minor(),
                        &envelope.event_id,
                    ],
                )
                .await?;
                if placed == 0 {
                    return Err(consumer_runtime::already_placed(
                        tx,
                        "SELECT placed_event_id FROM ledger_orders WHERE tenant_id = $1 AND order_id = $2",
                        tenant,
                        order.order_id,
                        "not taking its terms twice",
                    )
                    .await);
                }
                Ok(())
            }
            Event::PaymentReceived(payment) => {
                // One payment per order (order-api enforces it); a second
                // one would leave Customer deposits holding a balance the
                // delivery never clears: stop for a human instead.
                let (posted, terms) =
                    posted_and_terms(tx, tenant, payment.order_id, &envelope.event_type, "paid")
                        .await?;
                if let Some(first) = posted {
                    return Err(HandlerError::new(format!(
                        "order {} was already paid (event {first}); not booking a second payment",
                        payment.order_id
                    )));
                }
                // The order's total, in its currency (order-api refuses any
                // other payment): a payment that differs would leave
                // Customer deposits with a balance the delivery never
                // clears. Stop for a human instead.
                let Terms {
                    currency, total, ..
                } = terms?;
                if currency != payment.currency.as_str() || total != payment.amount.minor() {
                    return Err(HandlerError::new(format!(
                        "payment {} of {} {} differs from order {}'s total {} {currency}",
                        payment.payment_id,
                        payment.amount,
                        payment.currency.as_str(),
                        payment.order_id,
                        Money::from_minor(total)
                    )));
                }
                let (code, name) = clearing_account(&payment.method);
                let amount = payment.amount.minor();
                post(
                    tx,
                    envelope,
                    // A payment carries no business time of its own: it
                    // takes effect when order-api recorded it.
                    (payment.order_id, envelope.occurred_at),
                    &format!("Payment {} ({})", payment.payment_id, payment.method),
                    payment.currency.as_str(),
                    Some((&code, &name, "asset")),
                    &[
                        (code.clone(), amount, 0),
                        ("customer_deposits".to_owned(), 0, amount),
                    ],
                )
                .await
            }
            Event::ParcelDelivered(delivery) => {
                // One delivery per order (order-api enforces it); a second one
                // would book the revenue twice: stop for a human instead.
                let (posted, terms) = posted_and_terms(
                    tx,
                    tenant,
                    delivery.order_id,
                    &envelope.event_type,
                    "delivered",
                )
                .await?;
                if let Some(first) = posted {
                    return Err(HandlerError::new(format!(
                        "order {} was already delivered (event {first}); not posting revenue twice",
                        delivery.order_id
                    )));
                }
                let Terms {
                    currency,
                    merchandise,
                    shipping,
                    tax,
                    total,
                    cogs,
                } = terms?;
                let credits = Money::from_minor(merchandise)
                    .checked_add(Money::from_minor(shipping))
                    .and_then(|m| m.checked_add(Money::from_minor(tax)))
                    .ok_or_else(|| overflow("delivery credits"))?;
                if credits.minor() != total {
                    // The database would refuse the unbalanced entry anyway; say why.
                    // (OrderPlaced v1 whose total is not its parts is poison
                    // at decoding now; terms stored before could differ.)
                    return Err(HandlerError::new(format!(
                        "order total {} differs from merchandise + shipping + tax {}",
                        Money::from_minor(total),
                        credits
                    )));
                }
                post(
                    tx,
                    envelope,
                    // Revenue is recognised on delivery (seed 003).
                    (delivery.order_id, delivery.delivered_at),
                    &format!("Delivery {}", delivery.delivery_id),
                    &currency,
                    None,
                    &[
                        ("customer_deposits".to_owned(), total, 0),
                        ("sales".to_owned(), 0, merchandise),
                        ("shipping_income".to_owned(), 0, shipping),
                        ("tax_payable".to_owned(), 0, tax),
                        ("cogs".to_owned(), cogs, 0),
                        ("inventory".to_owned(), 0, cogs),
                    ],
                )
                .await
            }
            _ => Ok(()),
        }
    }

    fn routes(cfg: &mut web::ServiceConfig) {
        use kit::http::{get_or_head, resource};
        cfg.service(resource(
            "/journal",
            get_or_head().to(get_journal),
            "GET, HEAD",
        ))
        .service(resource(
            "/trial-balance",
            get_or_head().to(get_trial_balance),
            "GET, HEAD",
        ));
    }
}

// ---------------------------------------------------------------- HTTP

fn money(minor: i64) -> String {
    Money::from_minor(minor).to_string()
}

/// Totals are summed in i128 (`events::format_total` writes them): every
/// amount fits in i64 minor units, their sum need not (one order's total
/// and cost of goods on one entry already).
///
/// A `sum()` of bigint amounts, selected as `::text` (PostgreSQL sums bigint
/// into numeric, which a `::bigint` cast would overflow).
fn sum_column(row: &tokio_postgres::Row, index: usize) -> Result<i128, Problem> {
    let text: String = row.get(index);
    text.parse()
        .map_err(|e| database_problem(format!("sum {text:?}: {e}")))
}

#[derive(Debug, Deserialize)]
struct JournalQuery {
    order_id: Option<String>,
    #[serde(flatten)]
    page: PageQuery,
}

#[derive(Debug, Serialize)]
struct LineView {
    line_no: i32,
    account_code: String,
    account: String,
    debit: String,
    credit: String,
}

#[derive(Debug, Serialize)]
struct EntryView {
    entry_id: Uuid,
    order_id: Uuid,
    event_id: Uuid,
    event_type: String,
    description: String,
    currency: String,
    #[serde(with = "time::serde::rfc3339")]
    posted_at: time::OffsetDateTime,
    /// When the entry takes effect in the books (a delivery's
    /// `delivered_at`; `posted_at` for entries from before the column).
    #[serde(with = "time::serde::rfc3339")]
    effective_at: time::OffsetDateTime,
    total_debit: String,
    total_credit: String,
    lines: Vec<LineView>,
}

/// `GET /journal?tenant=&order_id=&after=&limit=`: entries with their lines,
/// in the order they were written (by their transactions' ids, then
/// posted_at), `limit` entries a page from the one after entry `after`; an
/// entry shows once every transaction that wrote before it is over
/// ([`consumer_runtime::auth::SETTLED_HORIZON`]), so a reader paging on
/// with `after` misses none.
async fn get_journal(
    scope: TenantScope,
    pool: web::Data<kit::db::PgPool>,
    query: web::Query<JournalQuery>,
) -> Result<HttpResponse, Problem> {
    let order_id = match query.order_id.as_deref() {
        None => None,
        Some(id) => Some(
            Uuid::parse_str(id).map_err(|_| bad_request("order_id", "order_id must be a UUID"))?,
        ),
    };
    let limit = query.page.limit()?;
    let after: Option<Uuid> = query.page.after("an entry_id (a UUID)")?;
    let client = pool.get().await.map_err(database_error)?;
    if let Some(after) = after {
        consumer_runtime::auth::known_cursor(
            &client,
            "SELECT 1 FROM journal_entries WHERE tenant_id = $1 AND entry_id = $2",
            &[&scope.tenant, &after],
            || format!("after: no journal entry {after} in this tenant"),
        )
        .await?;
    }
    // In writing order, up to the oldest transaction still running: an
    // entry still being written may come before one a reader has paged
    // past ([`consumer_runtime::auth::SETTLED_HORIZON`]).
    let rows = client
        .query(
            &format!(
                "WITH page AS ( \
                     SELECT e.entry_id, e.posted_at, coalesce(e.written_by, '0'::xid8) AS written \
                     FROM journal_entries e \
                     WHERE e.tenant_id = $1 AND ($2::uuid IS NULL OR e.order_id = $2) \
                       AND ($3::uuid IS NULL OR \
                            (coalesce(e.written_by, '0'::xid8), e.posted_at, e.entry_id) > \
                            (SELECT coalesce(c.written_by, '0'::xid8), c.posted_at, c.entry_id \
                             FROM journal_entries c WHERE c.tenant_id = $1 AND c.entry_id = $3)) \
                       AND coalesce(e.written_by, '0'::xid8) < {horizon} \
                     ORDER BY coalesce(e.written_by, '0'::xid8), e.posted_at, e.entry_id \
                     LIMIT $4) \
                 SELECT e.entry_id, e.order_id, e.event_id, e.event_type, e.description, \
                        e.currency, e.posted_at, l.line_no, l.account_code, a.name, l.debit, \
                        l.credit, coalesce(e.effective_at, e.posted_at) \
                 FROM page p \
                 JOIN journal_entries e ON e.entry_id = p.entry_id \
                 JOIN journal_lines l ON l.entry_id = e.entry_id \
                 JOIN ledger_accounts a ON a.tenant_id = l.tenant_id AND a.code = l.account_code \
                 ORDER BY p.written, p.posted_at, p.entry_id, l.line_no",
                horizon = consumer_runtime::auth::SETTLED_HORIZON
            ),
            &[&scope.tenant, &order_id, &after, &limit],
        )
        .await
        .map_err(database_error)?;
    let mut entries: Vec<(EntryView, i128, i128)> = Vec::new();
    for row in &rows {
        let entry_id: Uuid = row.get(0);
        if entries
            .last()
            .is_none_or(|(e, _, _)| e.entry_id != entry_id)
        {
            entries.push((
                EntryView {
                    entry_id,
                    order_id: row.get(1),
                    event_id: row.get(2),
                    event_type: row.get(3),
                    description: row.get(4),
                    currency: row.get(5),
                    posted_at: row.get(6),
                    effective_at: row.get(12),
                    total_debit: String::new(),
                    total_credit: String::new(),
                    lines: Vec::new(),
                },
                0_i128,
                0_i128,
            ));
        }
        if let Some((entry, debits, credits)) = entries.last_mut() {
            let (debit, credit): (i64, i64) = (row.get(10), row.get(11));
            *debits += i128::from(debit);
            *credits += i128::from(credit);
            entry.lines.push(LineView {
                line_no: row.get(7),
                account_code: row.get(8),
                account: row.get(9),
                debit: money(debit),
                credit: money(credit),
            });
        }
    }
    let entries: Vec<EntryView> = entries
        .into_iter()
        .map(|(mut entry, debits, credits)| {
            entry.total_debit = events::format_total(debits);
            entry.total_credit = events::format_total(credits);
            entry
        })
        .collect();
    let next = next_after(entries.len(), limit, entries.last().map(|e| e.entry_id));
    Ok(HttpResponse::Ok().json(serde_json::json!({
        "tenant": scope.tenant,
        "order_id": order_id,
        "entries": entries,
        "next_after": next,
    })))
}

/// `GET /trial-balance?tenant=`: debits and credits per account and currency;
/// the totals are equal (the balance column sums to zero).
async fn get_trial_balance(
    scope: TenantScope,
    pool: web::Data<kit::db::PgPool>,
) -> Result<HttpResponse, Problem> {
    let client = pool.get().await.map_err(database_error)?;
    let rows = client
        .query(
            "SELECT e.currency, l.account_code, a.name, a.kind, \
                    sum(l.debit)::text, sum(l.credit)::text \
             FROM journal_lines l \
             JOIN journal_entries e ON e.entry_id = l.entry_id \
             JOIN ledger_accounts a ON a.tenant_id = l.tenant_id AND a.code = l.account_code \
             WHERE l.tenant_id = $1 AND e.tenant_id = $1 \
             GROUP BY e.currency, l.account_code, a.name, a.kind \
             ORDER BY e.currency, l.account_code",
            &[&scope.tenant],
        )
        .await
        .map_err(database_error)?;
    let mut currencies: Vec<serde_json::Value> = Vec::new();
    let mut current: Option<(String, Vec<serde_json::Value>, i128, i128)> = None;
    let flush = |c: (String, Vec<serde_json::Value>, i128, i128)| {
        serde_json::json!({
            "currency": c.0,
            "accounts": c.1,
            "total_debit": events::format_total(c.2),
            "total_credit": events::format_total(c.3),
            "balance": events::format_total(c.2 - c.3),
        })
    };
    for row in &rows {
        let currency: String = row.get(0);
        if current.as_ref().is_some_and(|c| c.0 != currency) {
            if let Some(done) = current.take() {
                currencies.push(flush(done));
            }
        }
        let entry = current.get_or_insert_with(|| (currency.clone(), Vec::new(), 0, 0));
        let (debit, credit) = (sum_column(row, 4)?, sum_column(row, 5)?);
        entry.2 += debit;
        entry.3 += credit;
        entry.1.push(serde_json::json!({
            "account_code": row.get::<_, String>(1),
            "account": row.get::<_, String>(2),
            "kind": row.get::<_, String>(3),
            "debit": events::format_total(debit),
            "credit": events::format_total(credit),
            "balance": events::format_total(debit - credit),
        }));
    }
    if let Some(done) = current.take() {
        currencies.push(flush(done));
    }
    Ok(HttpResponse::Ok().json(serde_json::json!({
        "tenant": scope.tenant,
        "currencies": currencies,
    })))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn totals_are_written_like_amounts_and_may_exceed_one_amount() {
        for minor in [0, 5, 9300, -9300, -5, i64::MAX, i64::MIN] {
            assert_eq!(
                events::format_total(i128::from(minor)),
                money(minor),
                "{minor}"
            );
        }
        let two_max = 2 * i128::from(i64::MAX);
        assert_eq!(events::format_total(two_max), "184467440737095516.14");
        assert_eq!(events::format_total(-two_max), "-184467440737095516.14");
    }

    #[test]
    fn clearing_accounts_per_method() {
        assert_eq!(
            clearing_account("card"),
            ("clearing:card".to_owned(), "Card clearing".to_owned())
        );
        assert_eq!(
            clearing_account("Bank_Transfer"),
            (
                "clearing:bank_transfer".to_owned(),
                "Bank_transfer clearing".to_owned()
            )
        );
    }
}
