//! The drift check. Zero drift is the normal state.
//!
//! Expected effects, from the `orders` database (the source of truth):
//! - every order: inventory reserve movements summing to the order's quantity
//!   per SKU; the terms the ledger and loyalty keep from its OrderPlaced
//!   (customer, currency, amounts, cost) there and equal to the order's
//!   (they post and award by them later); no journal entry or loyalty entry
//!   before payment or delivery;
//! - paid (or delivered): PaymentReceived journal entries netting, per
//!   account in the order's currency, to the total debited to the payment
//!   method's clearing account and credited to customer deposits (one entry,
//!   or a wrong one, its reversal and the right one: a correction by hand);
//! - delivered: sale movements summing to minus the quantity per SKU;
//!   ParcelDelivered journal entries netting to total + cost of goods,
//!   account by account as seed 003 books it (deposits debited the total;
//!   sales, shipping income and tax payable credited; cost of goods debited
//!   and inventory credited the cost); loyalty entries netting to the
//!   merchandise's whole units for the customer;
//! - not delivered: none of those (entries netting to zero are none);
//! - no entries in another currency, or under a type no event posts, that
//!   do not net to zero.
//!
//! Orders changed within `grace` are skipped (their events may be in flight).
//!
//! Tenant by tenant (every tenant with rows in any of the four databases,
//! or the one asked for), each in snapshots of its own: what is held in
//! memory, and how long a snapshot holds back the databases' vacuum, is one
//! tenant's, not the whole system's.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use tokio_postgres::Client;
use uuid::Uuid;

/// Where the four databases are.
#[derive(Clone, Debug)]
pub struct Databases {
    pub orders: String,
    pub inventory: String,
    pub ledger: String,
    pub loyalty: String,
}

impl Databases {
    /// `PG_URL_<DB>` from the environment, or the local defaults.
    pub fn from_env() -> Self {
        let url = |db: &str| {
            std::env::var(format!("PG_URL_{}", db.to_uppercase()))
                .unwrap_or_else(|_| kit::settings::DatabaseSettings::local(db).url)
        };
        Self {
            orders: url("orders"),
            inventory: url("inventory"),
            ledger: url("ledger"),
            loyalty: url("loyalty"),
        }
    }
}

/// One finding.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Drift {
    pub tenant: String,
    pub order_id: Option<Uuid>,
    pub what: String,
}

/// Per-tenant totals for the summary.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TenantSummary {
    pub orders: i64,
    pub paid: i64,
    pub delivered: i64,
    pub skipped_in_flight: i64,
    pub journal_entries: i64,
    pub loyalty_entries: i64,
    pub stock_levels: i64,
    /// Trial balance per currency: (debits, credits) in minor units.
    pub trial_balance: BTreeMap<String, (i128, i128)>,
}

#[derive(Clone, Debug, Default)]
pub struct Report {
    pub tenants: BTreeMap<String, TenantSummary>,
    pub drift: Vec<Drift>,
}

impl Report {
    pub fn is_clean(&self) -> bool {
        self.drift.is_empty()
    }
}

async fn connect(url: &str) -> anyhow::Result<Client> {
    let (client, connection) = kit::db::connect(url).await?;
    tokio::spawn(connection);
    // Read-only. Named after the process, so an operator (and the test of
    // the snapshot order) can tell its sessions in pg_stat_activity.
    client
        .batch_execute(&format!(
            "SET application_name = 'drift-check/{}'; \
             SET default_transaction_read_only = on",
            std::process::id()
        ))
        .await?;
    Ok(client)
}

/// One consistent snapshot of `client`'s database, taken now: a REPEATABLE
/// READ snapshot is taken at the transaction's first query, not at BEGIN.
async fn snapshot(client: &Client) -> anyhow::Result<()> {
    client
        .batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY; SELECT 1")
        .await?;
    Ok(())
}

/// The check's sessions, one per database.
struct Sessions {
    orders: Client,
    inventory: Client,
    ledger: Client,
    loyalty: Client,
}

/// The tenants with rows in `table`, found through its index that leads
/// with `tenant_id` (a skip scan: one probe per tenant, not a read of every
/// row).
fn tenants_of(table: &str) -> String {
    format!(
        "WITH RECURSIVE t(tenant_id) AS ( \
           (SELECT tenant_id FROM {table} ORDER BY tenant_id LIMIT 1) \
           UNION ALL \
           SELECT (SELECT x.tenant_id FROM {table} x WHERE x.tenant_id > t.tenant_id \
                    ORDER BY x.tenant_id LIMIT 1) \
             FROM t WHERE t.tenant_id IS NOT NULL) \
         SELECT tenant_id FROM t WHERE tenant_id IS NOT NULL"
    )
}

/// Every tenant with rows the check reads, in any of the four databases (a
/// tenant only a consumer knows is drift too).
async fn tenants(sessions: &Sessions) -> anyhow::Result<BTreeSet<String>> {
    let mut tenants = BTreeSet::new();
    for (client, tables) in [
        (&sessions.orders, &["orders"][..]),
        (
            &sessions.inventory,
            &["stock_levels", "stock_movements"][..],
        ),
        (&sessions.ledger, &["ledger_orders", "journal_entries"][..]),
        (
            &sessions.loyalty,
            &["loyalty_orders", "loyalty_entries"][..],
        ),
    ] {
        for table in tables {
            for row in client.query(&tenants_of(table), &[]).await? {
                tenants.insert(row.get(0));
            }
        }
    }
    Ok(tenants)
}

struct Order {
    tenant: String,
    status: String,
    customer: String,
    merchandise: i64,
    shipping: i64,
    tax: i64,
    total: i64,
    /// The sum of the lines' qty x unit_cost: in i128, since only each
    /// line's cost was bounded by releases before 2026-12-07 (two lines of
    /// 5e18 minor units each overflowed an i64 here: a panic of the whole
    /// check).
    cost: i128,
    /// Every amount of the order is in this currency, and so must be each
    /// of its journal entries.
    currency: String,
    /// The payment's method, once paid (its clearing account).
    method: Option<String>,
    qty_by_sku: BTreeMap<(String, String), i64>,
}

/// What a consumer keeps of an order from its OrderPlaced, to book or award
/// by later.
#[derive(Debug, PartialEq, Eq)]
struct Terms {
    customer: String,
    currency: String,
    merchandise: i64,
    /// The ledger's: shipping, tax, total, cost of goods.
    amounts: Option<(i64, i64, i64, i128)>,
}

impl Terms {
    /// The terms `order` implies (with the ledger's amounts or not).
    fn of(order: &Order, with_amounts: bool) -> Terms {
        Terms {
            customer: order.customer.clone(),
            currency: order.currency.clone(),
            merchandise: order.merchandise,
            amounts: with_amounts.then_some((order.shipping, order.tax, order.total, order.cost)),
        }
    }

    fn show(&self) -> String {
        let money = |minor: i128| events::format_total(minor);
        let mut text = format!(
            "customer {}, {} merchandise {}",
            self.customer,
            self.currency,
            money(self.merchandise.into())
        );
        if let Some((shipping, tax, total, cost)) = self.amounts {
            text += &format!(
                ", shipping {}, tax {}, total {}, cost {}",
                money(shipping.into()),
                money(tax.into()),
                money(total.into()),
                money(cost)
            );
        }
        text
    }
}

/// A consumer's order terms, read by `sql` (columns: tenant, order,
/// customer, currency, merchandise, then the ledger's shipping, tax, total
/// and cost of goods, if it has them).
async fn terms_of(db: &Client, sql: &str, tenant: &str) -> anyhow::Result<BTreeMap<Key, Terms>> {
    Ok(db
        .query(sql, &[&tenant])
        .await?
        .iter()
        .map(|row| {
            let amounts = (row.len() > 5).then(|| {
                (
                    row.get(5),
                    row.get(6),
                    row.get(7),
                    row.get::<_, i64>(8).into(),
                )
            });
            let terms = Terms {
                customer: row.get(2),
                currency: row.get(3),
                merchandise: row.get(4),
                amounts,
            };
            ((row.get(0), row.get(1)), terms)
        })
        .collect())
}

/// A journal's amounts per account: (debits, credits).
type Postings = BTreeMap<String, (i128, i128)>;

type Key = (String, Uuid);

/// Run the check, for one tenant or for every tenant, one after the other.
pub async fn check(
    dbs: &Databases,
    tenant: Option<&str>,
    grace: Duration,
) -> anyhow::Result<Report> {
    let sessions = Sessions {
        orders: connect(&dbs.orders).await?,
        inventory: connect(&dbs.inventory).await?,
        ledger: connect(&dbs.ledger).await?,
        loyalty: connect(&dbs.loyalty).await?,
    };
    let tenants = match tenant {
        Some(tenant) => BTreeSet::from([tenant.to_owned()]),
        None => tenants(&sessions).await?,
    };
    let mut report = Report::default();
    for tenant in &tenants {
        let one = check_tenant(&sessions, tenant, grace).await?;
        report.tenants.extend(one.tenants);
        report.drift.extend(one.drift);
    }
    report.drift.sort();
    Ok(report)
}

/// The check of one tenant, in snapshots of its own.
async fn check_tenant(
    sessions: &Sessions,
    tenant: &str,
    grace: Duration,
) -> anyhow::Result<Report> {
    let consumers = [&sessions.inventory, &sessions.ledger, &sessions.loyalty];
    // The consumers' snapshots first, the orders' last: every effect they
    // show comes from an event of an order committed before it, so the
    // orders snapshot has that order (and its payment or delivery); what the
    // orders snapshot has beyond them is in flight, within the grace.
    // The other way round, an order placed (or paid, or delivered) between
    // the two snapshots showed as an effect for an unknown order (or an
    // unexpected one) on any system taking orders.
    for client in consumers {
        snapshot(client).await?;
    }
    // Where the test of the snapshot order holds the check to commit an
    // order between the snapshots (the check writes nothing).
    kit::failpoint::hold_point("drift.between_snapshots");
    snapshot(&sessions.orders).await?;
    let report = compare(sessions, tenant, grace).await;
    for client in consumers.into_iter().chain([&sessions.orders]) {
        client.batch_execute("COMMIT").await?;
    }
    report
}

/// Compare the four snapshots of `tenant`'s rows.
async fn compare(sessions: &Sessions, tenant: &str, grace: Duration) -> anyhow::Result<Report> {
    let Sessions {
        orders: orders_db,
        inventory,
        ledger,
        loyalty,
    } = sessions;
    let grace_s = i64::try_from(grace.as_secs()).unwrap_or(i64::MAX);

    let mut report = Report::default();
    let mut orders: BTreeMap<Key, Order> = BTreeMap::new();
    let mut in_flight: BTreeSet<Key> = BTreeSet::new();
    for row in orders_db
        .query(
            "SELECT o.tenant_id, o.order_id, o.status, o.customer_id, o.location, o.merchandise_minor, \
                    o.total_minor, l.sku, l.qty::bigint, l.unit_cost_minor, \
                    o.updated_at > now() - ($2::bigint || ' seconds')::interval, \
                    o.shipping_minor, o.tax_minor, \
                    (SELECT min(p.method) FROM payments p WHERE p.order_id = o.order_id), \
                    o.currency \
               FROM orders o JOIN order_lines l USING (order_id) \
              WHERE o.tenant_id = $1",
            &[&tenant, &grace_s],
        )
        .await?
    {
        let key: Key = (row.get(0), row.get(1));
        if row.get::<_, bool>(10) {
            in_flight.insert(key.clone());
        }
        let location: String = row.get(4);
        let sku: String = row.get(7);
        let qty: i64 = row.get(8);
        let unit_cost: i64 = row.get(9);
        let order = orders.entry(key.clone()).or_insert_with(|| Order {
            tenant: key.0.clone(),
            status: row.get(2),
            customer: row.get(3),
            merchandise: row.get(5),
            shipping: row.get(11),
            tax: row.get(12),
            total: row.get(6),
            cost: 0,
            method: row.get(13),
            currency: row.get(14),
            qty_by_sku: BTreeMap::new(),
        });
        order.cost += i128::from(qty) * i128::from(unit_cost);
        *order.qty_by_sku.entry((sku, location)).or_default() += qty;
    }

    // Inventory: per order and movement type, quantity per (sku, location).
    let mut movements: BTreeMap<(Key, String), BTreeMap<(String, String), i64>> = BTreeMap::new();
    for row in inventory
        .query(
            "SELECT tenant_id, order_id, movement_type, sku, location, sum(qty)::bigint \
               FROM stock_movements \
              WHERE order_id IS NOT NULL AND tenant_id = $1 \
              GROUP BY 1, 2, 3, 4, 5",
            &[&tenant],
        )
        .await?
    {
        let key: Key = (row.get(0), row.get(1));
        movements
            .entry((key, row.get(2)))
            .or_default()
            .insert((row.get(3), row.get(4)), row.get(5));
    }
    // Ledger, in one scan: per order and event type, (entries, total
    // debits), and the debits and credits per account. Sums are read as text
    // into i128: every amount fits in i64, their sums need not (a `::bigint`
    // cast made the whole check fail on such a tenant).
    // And what they net to per account and currency (debits minus
    // credits, zeros left out): what the books say, however many entries
    // (a correction: a reversal and the right entry) make it up.
    let mut journals: BTreeMap<(Key, String), (i64, i128)> = BTreeMap::new();
    let mut postings: BTreeMap<(Key, String), Postings> = BTreeMap::new();
    let mut nets: BTreeMap<(Key, String), Net> = BTreeMap::new();
    for row in ledger
        .query(
            "SELECT e.tenant_id, e.order_id, e.event_type, l.account_code, e.currency, \
                    GROUPING(l.account_code, e.currency) = 3, count(DISTINCT e.entry_id), \
                    sum(l.debit)::text, sum(l.credit)::text \
               FROM journal_entries e JOIN journal_lines l USING (entry_id) \
              WHERE e.tenant_id = $1 \
              GROUP BY GROUPING SETS ((e.tenant_id, e.order_id, e.event_type, l.account_code, e.currency), \
                                      (e.tenant_id, e.order_id, e.event_type))",
            &[&tenant],
        )
        .await?
    {
        let journal = ((row.get(0), row.get(1)), row.get(2));
        if row.get::<_, bool>(5) {
            journals.insert(journal, (row.get(6), sum(&row, 7)?));
        } else {
            let (account, currency): (String, String) = (row.get(3), row.get(4));
            let (debit, credit) = (sum(&row, 7)?, sum(&row, 8)?);
            let gross = postings
                .entry(journal.clone())
                .or_default()
                .entry(account.clone())
                .or_default();
            gross.0 += debit;
            gross.1 += credit;
            if debit != credit {
                nets.entry(journal)
                    .or_default()
                    .insert((account, currency), debit - credit);
            }
        }
    }
    // The order terms the ledger and loyalty keep from OrderPlaced, as the
    // order's own are read above (loyalty's without the ledger's amounts).
    let ledger_terms = terms_of(
        ledger,
        "SELECT tenant_id, order_id, customer_id, currency, merchandise, shipping, tax, \
                total, cost_of_goods \
           FROM ledger_orders WHERE tenant_id = $1",
        tenant,
    )
    .await?;
    let loyalty_terms = terms_of(
        loyalty,
        "SELECT tenant_id, order_id, customer_id, currency, merchandise \
           FROM loyalty_orders WHERE tenant_id = $1",
        tenant,
    )
    .await?;
    // Loyalty: per order, entries and points (and the customers credited),
    // and the points each customer nets to.
    let mut points: BTreeMap<Key, (i64, i128, BTreeSet<String>)> = BTreeMap::new();
    let mut points_by_customer: BTreeMap<Key, BTreeMap<String, i128>> = BTreeMap::new();
    for row in loyalty
        .query(
            "SELECT tenant_id, order_id, customer_id, count(*), sum(points)::text \
               FROM loyalty_entries WHERE tenant_id = $1 GROUP BY 1, 2, 3",
            &[&tenant],
        )
        .await?
    {
        let key: Key = (row.get(0), row.get(1));
        let (customer, entries, net): (String, i64, i128) = (row.get(2), row.get(3), sum(&row, 4)?);
        let order = points.entry(key.clone()).or_default();
        order.0 += entries;
        order.1 += net;
        order.2.insert(customer.clone());
        if net != 0 {
            points_by_customer
                .entry(key)
                .or_default()
                .insert(customer, net);
        }
    }

    let mut drift = |tenant: &str, order: Option<Uuid>, what: String| {
        report.drift.push(Drift {
            tenant: tenant.to_owned(),
            order_id: order,
            what,
        })
    };
    for (key, order) in &orders {
        let summary = report.tenants.entry(order.tenant.clone()).or_default();
        summary.orders += 1;
        let paid = order.status == "paid" || order.status == "delivered";
        let delivered = order.status == "delivered";
        summary.paid += i64::from(paid);
        summary.delivered += i64::from(delivered);
        if in_flight.contains(key) {
            summary.skipped_in_flight += 1;
            continue;
        }
        let id = Some(key.1);
        let t = order.tenant.as_str();
        let empty = BTreeMap::new();
        let reserved = movements
            .get(&(key.clone(), "reserve".into()))
            .unwrap_or(&empty);
        if reserved != &order.qty_by_sku {
            drift(t, id, describe("reservation", &order.qty_by_sku, reserved));
        }
        let sold = movements
            .get(&(key.clone(), "sale".into()))
            .unwrap_or(&empty);
        let expected_sale: BTreeMap<_, _> = if delivered {
            order
                .qty_by_sku
                .iter()
                .map(|(k, q)| (k.clone(), -q))
                .collect()
        } else {
            BTreeMap::new()
        };
        if sold != &expected_sale {
            drift(t, id, describe("sale", &expected_sale, sold));
        }
        for (consumer, terms) in [("ledger", &ledger_terms), ("loyalty", &loyalty_terms)] {
            match terms.get(key) {
                Some(kept) => {
                    let expected = Terms::of(order, kept.amounts.is_some());
                    if kept != &expected {
                        drift(
                            t,
                            id,
                            format!(
                                "the {consumer}'s terms of the order differ: {} (the order: {})",
                                kept.show(),
                                expected.show()
                            ),
                        );
                    }
                }
                // Its OrderPlaced not applied there (parked, or a consumer
                // added later without the history replayed): seen now, not
                // when the payment or delivery it books fails.
                None => drift(
                    t,
                    id,
                    format!(
                        "the {consumer} has no terms of the order (its OrderPlaced not applied)"
                    ),
                ),
            }
        }
        // Every amount of the order's books in its currency: entries in
        // another that do not net to zero are drift (a right amount in the
        // wrong currency too).
        let other_currencies: BTreeSet<&str> = nets
            .range((key.clone(), String::new())..)
            .take_while(|((k, _), _)| k == key)
            .flat_map(|(_, net)| net.keys())
            .map(|(_, currency)| currency.as_str())
            .filter(|currency| *currency != order.currency)
            .collect();
        if !other_currencies.is_empty() {
            drift(
                t,
                id,
                format!(
                    "journal entries in {other_currencies:?}, the order is in {}",
                    order.currency
                ),
            );
        }
        // Entries of a type no v1 event posts (a correction posted under a
        // made-up type, a bug) that do not net to zero.
        for ((_, event_type), net) in nets
            .range((key.clone(), String::new())..)
            .take_while(|((k, _), _)| k == key)
        {
            if event_type != "PaymentReceived" && event_type != "ParcelDelivered" {
                drift(
                    t,
                    id,
                    format!(
                        "journal entries of type {event_type} net to {} (no event of the order posts them)",
                        describe_net(net)
                    ),
                );
            }
        }
        // A journal is right when its postings net, account by account, to
        // what the order implies, however many entries make them up: a
        // wrong entry corrected by hand (its reversal and the right entry,
        // under the same event type) is right. Otherwise the entries are
        // described by count and amount, then account by account.
        let payment = journals.get(&(key.clone(), "PaymentReceived".into()));
        let expected_payment = paid.then_some((1, i128::from(order.total)));
        // As the ledger posts a payment: its method's clearing account
        // debited, the customer's deposit credited. (The books are stated
        // here independently of the ledger's code, as the oracle they are;
        // only the account's name is the ledger's.)
        let expected = match (paid, &order.method) {
            (true, Some(method)) => Some(postings_of(&[
                (
                    ledger_consumer::clearing_account(method).0,
                    order.total.into(),
                    0,
                ),
                ("customer_deposits".to_owned(), 0, order.total.into()),
            ])),
            _ => None,
        };
        let journal = (key.clone(), "PaymentReceived".to_owned());
        let (found, found_net) = (postings.get(&journal), nets.get(&journal));
        let no_payment_row = paid && order.method.is_none();
        if no_payment_row && payment.copied() == expected_payment {
            drift(t, id, "paid, but the order has no payment row".into());
        } else if let Some(finding) = journal_finding(
            "payment",
            (expected_payment, expected.as_ref()),
            (payment.copied(), found, found_net),
            &order.currency,
            no_payment_row,
        ) {
            drift(t, id, finding);
        }
        let delivery = journals.get(&(key.clone(), "ParcelDelivered".into()));
        let expected_delivery = delivered.then_some((1, i128::from(order.total) + order.cost));
        // As the ledger posts a delivery (seed 003): the deposit released
        // into sales, shipping income and tax payable, and the goods' cost
        // moved from inventory to the cost of goods sold.
        let expected = delivered.then(|| {
            postings_of(&[
                ("customer_deposits".to_owned(), order.total.into(), 0),
                ("sales".to_owned(), 0, order.merchandise.into()),
                ("shipping_income".to_owned(), 0, order.shipping.into()),
                ("tax_payable".to_owned(), 0, order.tax.into()),
                ("cogs".to_owned(), order.cost, 0),
                ("inventory".to_owned(), 0, order.cost),
            ])
        });
        let journal = (key.clone(), "ParcelDelivered".to_owned());
        let (found, found_net) = (postings.get(&journal), nets.get(&journal));
        if let Some(finding) = journal_finding(
            "delivery",
            (expected_delivery, expected.as_ref()),
            (delivery.copied(), found, found_net),
            &order.currency,
            false,
        ) {
            drift(t, id, finding);
        }
        let loyalty = points.get(key);
        // One entry of the merchandise's whole units; none when that is 0
        // (the consumer writes no entry of 0 points). Right too when the
        // entries net to that per customer (one corrected by hand: its
        // reversal and the right entry).
        let points = crate::invariants::loyalty_points(order.merchandise);
        let expected_points = (delivered && points > 0).then_some((1, i128::from(points)));
        let expected_by_customer: BTreeMap<String, i128> = expected_points
            .map(|(_, p)| BTreeMap::from([(order.customer.clone(), p)]))
            .unwrap_or_default();
        let nets_out =
            points_by_customer.get(key).cloned().unwrap_or_default() == expected_by_customer;
        match (expected_points, loyalty) {
            _ if nets_out => {}
            (expected, got) => drift(
                t,
                id,
                format!(
                    "loyalty: expected {} entr{} for customer {}, found {}",
                    expected.map_or(0, |e| e.0),
                    if expected.is_some() {
                        format!("y of {} points", expected.map_or(0, |e| e.1))
                    } else {
                        "ies".into()
                    },
                    order.customer,
                    got.map_or("none".to_owned(), |g| format!(
                        "{} entr(ies), {} points, customers {:?}",
                        g.0, g.1, g.2
                    )),
                ),
            ),
        }
    }
    // Effects for orders the orders database does not have.
    let known = |key: &Key| orders.contains_key(key);
    for (key, _) in movements.keys().filter(|(k, _)| !known(k)) {
        drift(
            &key.0,
            Some(key.1),
            "stock movements for an unknown order".into(),
        );
    }
    for (key, _) in journals.keys().filter(|(k, _)| !known(k)) {
        drift(
            &key.0,
            Some(key.1),
            "journal entries for an unknown order".into(),
        );
    }
    for key in points.keys().filter(|k| !known(k)) {
        drift(
            &key.0,
            Some(key.1),
            "loyalty entries for an unknown order".into(),
        );
    }
    // The terms the ledger and loyalty keep from an OrderPlaced of an order
    // the orders database does not have (restored to an earlier point, or
    // an event written by hand): found even when no other effect of the
    // order was written (inventory restored too, or parked there).
    for (terms, consumer) in [(&ledger_terms, "the ledger"), (&loyalty_terms, "loyalty")] {
        for key in terms.keys().filter(|k| !known(k)) {
            drift(
                &key.0,
                Some(key.1),
                format!("{consumer} keeps order terms for an unknown order"),
            );
        }
    }

    // Every movement's effect on the level is its type's: a receipt adds to
    // on hand, a reservation to reserved, a sale takes its (negative) qty
    // from both. A movement with the right qty but another effect (a sale
    // that never releases its reservation) leaves a level that equals its
    // movements and an order whose quantities match: found only here.
    // (Inventory V2 refuses a receipt's or a reservation's wrong effect and
    // bounds a sale's; a sale releasing less than it sold passes it and is
    // found here.)
    for row in inventory
        .query(
            "SELECT tenant_id, order_id, movement_type, sku, location, qty, on_hand_delta, \
                    reserved_delta \
               FROM stock_movements \
              WHERE tenant_id = $1 \
                AND NOT ((movement_type = 'receipt' AND on_hand_delta = qty AND reserved_delta = 0) \
                      OR (movement_type = 'reserve' AND on_hand_delta = 0 AND reserved_delta = qty) \
                      OR (movement_type = 'sale' AND on_hand_delta = qty AND reserved_delta = qty)) \
              ORDER BY movement_id",
            &[&tenant],
        )
        .await?
    {
        let t: String = row.get(0);
        let (kind, sku, location): (String, String, String) = (row.get(2), row.get(3), row.get(4));
        let (qty, on_hand, reserved): (i64, i64, i64) = (row.get(5), row.get(6), row.get(7));
        drift(
            &t,
            row.get(1),
            format!(
                "{kind} of {qty} {sku}@{location} moved on hand by {on_hand} and reserved by \
                 {reserved}, not as a {kind} does"
            ),
        );
    }

    // Stock levels equal the sum of their movements.
    for row in inventory
        .query(
            "SELECT s.tenant_id, s.sku, s.location, s.on_hand, s.reserved, \
                    coalesce(m.on_hand, 0)::bigint, coalesce(m.reserved, 0)::bigint \
               FROM stock_levels s \
               LEFT JOIN (SELECT tenant_id, sku, location, sum(on_hand_delta) AS on_hand, \
                                 sum(reserved_delta) AS reserved \
                            FROM stock_movements GROUP BY 1, 2, 3) m USING (tenant_id, sku, location) \
              WHERE s.tenant_id = $1",
            &[&tenant],
        )
        .await?
    {
        let t: String = row.get(0);
        report.tenants.entry(t.clone()).or_default().stock_levels += 1;
        let (on_hand, reserved, m_on_hand, m_reserved): (i64, i64, i64, i64) =
            (row.get(3), row.get(4), row.get(5), row.get(6));
        if (on_hand, reserved) != (m_on_hand, m_reserved) {
            drift(
                &t,
                None,
                format!(
                    "stock level {}@{}: on_hand {on_hand} reserved {reserved}, movements say {m_on_hand} / {m_reserved}",
                    row.get::<_, String>(1),
                    row.get::<_, String>(2)
                ),
            );
        }
    }
    // Every journal entry balances.
    for row in ledger
        .query(
            // LEFT JOIN: an entry without lines is found too (the
            // database refuses one, unless written by hand with the
            // journal's triggers off).
            "SELECT e.tenant_id, e.order_id, e.entry_id, \
                    coalesce(sum(l.debit), 0)::text, coalesce(sum(l.credit), 0)::text, \
                    count(l.entry_id) \
               FROM journal_entries e LEFT JOIN journal_lines l USING (entry_id) \
              WHERE e.tenant_id = $1 \
              GROUP BY 1, 2, 3 HAVING count(l.entry_id) = 0 OR sum(l.debit) <> sum(l.credit)",
            &[&tenant],
        )
        .await?
    {
        let (debit, credit) = (sum(&row, 3)?, sum(&row, 4)?);
        let entry = row.get::<_, Uuid>(2);
        drift(
            &row.get::<_, String>(0),
            Some(row.get(1)),
            if row.get::<_, i64>(5) == 0 {
                format!("journal entry {entry} has no lines")
            } else {
                format!("journal entry {entry} unbalanced: {debit} debit vs {credit} credit")
            },
        );
    }
    // Trial balance per tenant and currency.
    for row in ledger
        .query(
            "SELECT e.tenant_id, e.currency, count(DISTINCT e.entry_id), \
                    sum(l.debit)::text, sum(l.credit)::text \
               FROM journal_entries e JOIN journal_lines l USING (entry_id) \
              WHERE e.tenant_id = $1 GROUP BY 1, 2",
            &[&tenant],
        )
        .await?
    {
        let t: String = row.get(0);
        let (debit, credit) = (sum(&row, 3)?, sum(&row, 4)?);
        let summary = report.tenants.entry(t.clone()).or_default();
        summary.journal_entries += row.get::<_, i64>(2);
        summary.trial_balance.insert(row.get(1), (debit, credit));
        if debit != credit {
            drift(
                &t,
                None,
                format!("trial balance off: {debit} debit vs {credit} credit"),
            );
        }
    }
    for row in loyalty
        .query(
            "SELECT tenant_id, count(*) FROM loyalty_entries WHERE tenant_id = $1 GROUP BY 1",
            &[&tenant],
        )
        .await?
    {
        report
            .tenants
            .entry(row.get(0))
            .or_default()
            .loyalty_entries = row.get(1);
    }
    annotate(&mut report, tenant, orders_db, [inventory, ledger, loyalty]).await?;
    report.drift.sort();
    Ok(report)
}

/// Say, next to each finding on an order, what may explain it: the order's
/// events not yet published (pending or quarantined in the outbox: its
/// effects are still to come) or the order parked in a consumer (behind a
/// dead letter). Read in the same snapshots. A finding with neither is
/// drift in the strict sense: an event lost or applied wrongly.
async fn annotate(
    report: &mut Report,
    tenant: &str,
    orders_db: &Client,
    consumers: [&Client; 3],
) -> anyhow::Result<()> {
    if report.drift.iter().all(|d| d.order_id.is_none()) {
        return Ok(());
    }
    let mut notes: BTreeMap<(String, String), Vec<String>> = BTreeMap::new();
    for row in orders_db
        .query(
            "SELECT tenant_id, aggregate_id, count(*), count(*) FILTER (WHERE quarantined_at IS NOT NULL) \
               FROM outbox_events \
              WHERE published_at IS NULL AND tenant_id = $1 \
              GROUP BY 1, 2",
            &[&tenant],
        )
        .await?
    {
        let (pending, quarantined): (i64, i64) = (row.get(2), row.get(3));
        notes
            .entry((row.get(0), row.get(1)))
            .or_default()
            .push(if quarantined > 0 {
                format!("{pending} event(s) unpublished, {quarantined} quarantined")
            } else {
                format!("{pending} event(s) not yet published")
            });
    }
    for db in consumers {
        for row in db
            .query(
                "SELECT tenant_id, aggregate_id, consumer_name, coalesce(parked_reason, '') \
                   FROM order_progress \
                  WHERE parked_at IS NOT NULL AND tenant_id = $1",
                &[&tenant],
            )
            .await?
        {
            let (consumer, reason): (String, String) = (row.get(2), row.get(3));
            notes
                .entry((row.get(0), row.get(1)))
                .or_default()
                .push(format!("parked in {consumer}: {reason}"));
        }
    }
    for finding in &mut report.drift {
        let Some(order) = finding.order_id else {
            continue;
        };
        if let Some(notes) = notes.get(&(finding.tenant.clone(), order.to_string())) {
            finding.what = format!("{} ({})", finding.what, notes.join("; "));
        }
    }
    Ok(())
}

fn describe(
    what: &str,
    expected: &BTreeMap<(String, String), i64>,
    found: &BTreeMap<(String, String), i64>,
) -> String {
    let show = |m: &BTreeMap<(String, String), i64>| {
        if m.is_empty() {
            "none".to_owned()
        } else {
            m.iter()
                .map(|((sku, loc), q)| format!("{sku}@{loc} {q}"))
                .collect::<Vec<_>>()
                .join(", ")
        }
    };
    let kind = if found.is_empty() {
        "missing"
    } else if expected.is_empty() {
        "unexpected"
    } else if found.values().map(|q| q.abs()).sum::<i64>()
        > expected.values().map(|q| q.abs()).sum::<i64>()
    {
        "doubled"
    } else {
        "wrong"
    };
    format!(
        "{what} {kind}: expected {}, found {}",
        show(expected),
        show(found)
    )
}

/// The postings of `lines` (account, debit, credit), without the lines of
/// zero (the ledger posts none).
fn postings_of(lines: &[(String, i128, i128)]) -> Postings {
    lines
        .iter()
        .filter(|(_, debit, credit)| *debit != 0 || *credit != 0)
        .map(|(account, debit, credit)| (account.clone(), (*debit, *credit)))
        .collect()
}

fn describe_postings(what: &str, expected: &Postings, found: Option<&Postings>) -> String {
    let show = |p: &Postings| {
        p.iter()
            .map(|(account, (debit, credit))| {
                let mut sides = Vec::new();
                if *debit != 0 {
                    sides.push(format!("Dr {}", events::format_total(*debit)));
                }
                if *credit != 0 {
                    sides.push(format!("Cr {}", events::format_total(*credit)));
                }
                format!("{account} {}", sides.join(" "))
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    format!(
        "{what} journal posts other accounts or amounts: expected {}, found {}",
        show(expected),
        found.map_or("none".to_owned(), show)
    )
}

/// A `sum()` of bigint amounts, selected as `::text`.
fn sum(row: &tokio_postgres::Row, index: usize) -> anyhow::Result<i128> {
    let text: String = row.get(index);
    text.parse()
        .map_err(|e| anyhow::anyhow!("sum {text:?} in column {index}: {e}"))
}

/// What is off in an order's journal of one event type, if anything:
/// nothing when its entries net, per account in the order's `currency`, to
/// the `expected` postings (unless `suspect`: they are wrong whatever they
/// net to); else the entries by count and amount when those differ, else
/// account by account (nothing when only the currency is wrong: the
/// currency finding says so).
fn journal_finding(
    what: &str,
    (expected_entries, expected): (Option<(i64, i128)>, Option<&Postings>),
    (found_entries, found, found_net): (Option<(i64, i128)>, Option<&Postings>, Option<&Net>),
    currency: &str,
    suspect: bool,
) -> Option<String> {
    if !suspect && found_net.cloned().unwrap_or_default() == net_of(expected, currency) {
        return None;
    }
    if found_entries != expected_entries {
        return Some(describe_journal(
            what,
            expected_entries,
            found_entries,
            found_net,
        ));
    }
    expected
        .filter(|e| found != Some(*e))
        .map(|expected| describe_postings(what, expected, found))
}

/// What a journal nets to per (account, currency): debits minus credits,
/// the zeros left out.
type Net = BTreeMap<(String, String), i128>;

/// The net of the postings an order implies, in its currency.
fn net_of(postings: Option<&Postings>, currency: &str) -> Net {
    postings
        .into_iter()
        .flatten()
        .filter(|(_, (debit, credit))| debit != credit)
        .map(|(account, (debit, credit))| ((account.clone(), currency.to_owned()), debit - credit))
        .collect()
}

fn describe_net(net: &Net) -> String {
    if net.is_empty() {
        return "nothing".to_owned();
    }
    net.iter()
        .map(|((account, currency), amount)| {
            let side = if *amount > 0 { "Dr" } else { "Cr" };
            format!(
                "{account} {side} {} {currency}",
                events::format_total(amount.abs())
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

fn describe_journal(
    what: &str,
    expected: Option<(i64, i128)>,
    found: Option<(i64, i128)>,
    found_net: Option<&Net>,
) -> String {
    let show = |j: Option<(i64, i128)>| match j {
        None => "no entry".to_owned(),
        Some((n, debit)) => format!("{n} entr(ies) debiting {}", events::format_total(debit)),
    };
    let empty = Net::new();
    let found_net = found_net.unwrap_or(&empty);
    let kind = match (expected, found) {
        (Some(_), None) => "missing",
        (None, Some(_)) => "unexpected",
        // Entries that cancel out: a reversal without its right entry.
        (Some(_), Some((m, _))) if m > 1 && found_net.is_empty() => "reversed",
        // More entries whose amounts grow with their number: the same
        // entry posted again (not a correction that is still off).
        (Some((n, d)), Some((m, fd))) if m > n && fd * i128::from(n) == d * i128::from(m) => {
            "doubled"
        }
        _ => "wrong",
    };
    // Several entries (a correction among them): what they come to.
    let nets_to = match found {
        Some((m, _)) if m > 1 => format!(" netting to {}", describe_net(found_net)),
        _ => String::new(),
    };
    format!(
        "{what} journal {kind}: expected {}, found {}{nets_to}",
        show(expected),
        show(found)
    )
}

/// Print the report for a person.
pub fn print(report: &Report) {
    println!("drift check over orders, inventory, ledger, loyalty (read-only)");
    for (tenant, s) in &report.tenants {
        println!(
            "tenant {tenant}: {} orders ({} paid, {} delivered, {} skipped in flight), {} journal entries, {} loyalty entries, {} stock levels",
            s.orders, s.paid, s.delivered, s.skipped_in_flight, s.journal_entries, s.loyalty_entries, s.stock_levels
        );
        for (currency, (debit, credit)) in &s.trial_balance {
            println!(
                "  trial balance {currency}: debits {} = credits {}{}",
                events::format_total(*debit),
                events::format_total(*credit),
                if debit == credit {
                    ""
                } else {
                    "  <-- UNBALANCED"
                }
            );
        }
    }
    if report.drift.is_empty() {
        println!("zero drift");
    } else {
        println!("{} drift finding(s):", report.drift.len());
        for d in &report.drift {
            match d.order_id {
                Some(order) => println!("  [{}] order {order}: {}", d.tenant, d.what),
                None => println!("  [{}] {}", d.tenant, d.what),
            }
        }
    }
}
