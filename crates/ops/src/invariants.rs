//! The invariant checker (DESIGN.md section 12), read-only over the four
//! databases, for one tenant (or all) and a set of named consumers:
//!
//! 1. every committed order mutation has exactly one outbox row: an order
//!    `placed` has sequence 1 `OrderPlaced`, `paid` also sequence 2
//!    `PaymentReceived`, `delivered` also sequence 3 `ParcelDelivered`;
//!    `last_event_sequence` equals its number of outbox rows; `payments` and
//!    `deliveries` rows match the status;
//! 2. no outbox row without its committed mutation (an order of the same
//!    tenant, a sequence it reached, the type of that step);
//! 3. every outbox row is published (not pending, not quarantined) and every
//!    consumer has applied it: an inbox row per (consumer, event), the
//!    order's progress at the order's last sequence, nothing parked;
//! 4. each consumer applied each event exactly once: effect rows per event
//!    (inventory: the order row and one reserve movement per SKU for
//!    `OrderPlaced`, one sale movement per SKU for `ParcelDelivered`;
//!    ledger: the order terms, one journal entry per payment and delivery;
//!    loyalty: the order terms, one entry per delivery), each with its inbox
//!    row (same transaction), none for an event the outbox does not have;
//! 5. per order, each consumer applied the sequences in order: the inbox
//!    holds exactly 1..last (no gap, nothing beyond the progress row),
//!    `processed_at` does not decrease with the sequence, reserve movements
//!    precede sale movements, the payment entry precedes the delivery entry;
//! 6. every journal entry balances and stock levels equal their movements:
//!    [`crate::drift::check`], whose findings (missing, doubled or wrong
//!    effects) count too.
//!
//! Each consumer database is read in one snapshot taken before the orders
//! snapshot, so an event a consumer applied is always in the outbox read
//! (no false "unknown event"), and an effect and its inbox row (one
//! transaction) are seen together. [`check_until`] polls until clean or a
//! deadline: right after a recovery the system is allowed time to drain.
//!
//! Caveats: outbox rows deleted by the relay's cleanup (published, past the
//! replay horizon, 7 days by default) and inbox rows deleted by the
//! consumers' cleanup make older orders look broken: check recent tenants.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use time::OffsetDateTime;
use tokio_postgres::Client;
use uuid::Uuid;

use crate::drift::{self, Databases};

/// Which consumer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    Inventory,
    Ledger,
    Loyalty,
}

impl Kind {
    pub const ALL: [Kind; 3] = [Kind::Inventory, Kind::Ledger, Kind::Loyalty];

    /// The consumer's default name (its inbox key).
    pub fn default_name(self) -> &'static str {
        match self {
            Kind::Inventory => "inventory",
            Kind::Ledger => "ledger",
            Kind::Loyalty => "loyalty",
        }
    }

    pub fn parse(s: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.default_name() == s)
    }

    fn url(self, dbs: &Databases) -> &str {
        match self {
            Kind::Inventory => &dbs.inventory,
            Kind::Ledger => &dbs.ledger,
            Kind::Loyalty => &dbs.loyalty,
        }
    }
}

/// A consumer by kind and name (`processed_events.consumer_name`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConsumerRef {
    pub kind: Kind,
    pub name: String,
}

/// What to check.
#[derive(Clone, Debug)]
pub struct Scope {
    /// One tenant, or every tenant (`None`).
    pub tenant: Option<String>,
    /// The consumers that must have applied every event.
    pub consumers: Vec<ConsumerRef>,
}

impl Scope {
    /// One tenant, the three consumers under their default names.
    pub fn tenant(tenant: &str) -> Scope {
        Scope {
            tenant: Some(tenant.to_owned()),
            consumers: Kind::ALL
                .iter()
                .map(|k| ConsumerRef {
                    kind: *k,
                    name: k.default_name().to_owned(),
                })
                .collect(),
        }
    }

    /// Use `name` for the consumer of `kind`.
    pub fn with_consumer(mut self, kind: Kind, name: &str) -> Scope {
        self.consumers.retain(|c| c.kind != kind);
        self.consumers.push(ConsumerRef {
            kind,
            name: name.to_owned(),
        });
        self.consumers.sort_by_key(|c| c.kind);
        self
    }
}

/// One broken invariant.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Violation {
    /// 1..=6, as in the module documentation.
    pub invariant: u8,
    pub consumer: Option<String>,
    pub order: Option<String>,
    pub what: String,
}

/// Per consumer figures.
#[derive(Clone, Debug)]
pub struct ConsumerSummary {
    pub kind: Kind,
    pub name: String,
    /// Events in scope with an inbox row of this consumer.
    pub applied: i64,
    /// Events in scope without one (lost, or not yet applied).
    pub missing: i64,
    /// Orders parked behind a dead-lettered event.
    pub parked: i64,
    /// Deliveries suppressed as duplicates (from the consumer's metrics,
    /// when the caller knows them: `consumer_duplicates_total` +
    /// `consumer_stale_total`).
    pub duplicates_suppressed: Option<u64>,
}

#[derive(Clone, Debug, Default)]
pub struct Report {
    pub tenant: Option<String>,
    pub orders: i64,
    pub events: i64,
    pub published: i64,
    pub pending: i64,
    pub quarantined: i64,
    pub consumers: Vec<ConsumerSummary>,
    /// An upper bound on messages published more than once (from the
    /// caller's observations: the relays' leases taken over plus rows
    /// confirmed but left unmarked; one copy confirmed, unmarked and then
    /// taken over counts in both, a takeover of a row never sent in one);
    /// `None` when not measured.
    pub duplicates_published: Option<u64>,
    pub violations: Vec<Violation>,
    pub drift: drift::Report,
}

impl Report {
    pub fn is_clean(&self) -> bool {
        self.violations.is_empty() && self.drift.is_clean()
    }

    /// Violations of invariant `n`.
    pub fn count(&self, n: u8) -> usize {
        self.violations.iter().filter(|v| v.invariant == n).count()
    }

    /// Events not published, or not applied by some consumer (invariant 3):
    /// must be 0 after a drain.
    pub fn lost(&self) -> i64 {
        self.pending + self.quarantined + self.consumers.iter().map(|c| c.missing).sum::<i64>()
    }

    /// Effects applied more than once, or without their inbox row.
    pub fn double_effects(&self) -> usize {
        self.count(4)
    }

    pub fn ordering_violations(&self) -> usize {
        self.count(5)
    }

    /// Invariant 6 violations plus drift findings.
    pub fn drift_findings(&self) -> usize {
        self.count(6) + self.drift.drift.len()
    }

    /// A one-paragraph human summary, then every violation.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "invariants over {}: {} orders, {} events ({} published, {} pending, {} quarantined)",
            self.tenant
                .as_deref()
                .map_or("every tenant".to_owned(), |t| format!("tenant {t}")),
            self.orders,
            self.events,
            self.published,
            self.pending,
            self.quarantined
        );
        for c in &self.consumers {
            let _ = writeln!(
                out,
                "  consumer {} ({}): applied {}/{}, missing {}, parked orders {}, duplicates suppressed {}",
                c.name,
                c.kind.default_name(),
                c.applied,
                self.events,
                c.missing,
                c.parked,
                c.duplicates_suppressed
                    .map_or("n/a".to_owned(), |d| d.to_string())
            );
        }
        let _ = writeln!(
            out,
            "  duplicates published, at most (leases taken over + confirmed but unmarked, as the relays counted since they started; one copy can count in both): {}",
            self.duplicates_published
                .map_or("n/a".to_owned(), |d| d.to_string())
        );
        let _ = writeln!(
            out,
            "  lost: {}  double effects: {}  ordering violations: {}  drift: {}  intent violations: {}",
            self.lost(),
            self.double_effects(),
            self.ordering_violations(),
            self.drift_findings(),
            self.count(1) + self.count(2)
        );
        for (n, what) in [
            (1, "each committed mutation has exactly one outbox row"),
            (2, "no outbox row without its mutation"),
            (3, "every event published and applied by every consumer"),
            (4, "each event applied exactly once"),
            (5, "per order, applied in sequence order"),
            (6, "journals balance, stock equals movements, zero drift"),
        ] {
            let count = if n == 6 {
                self.drift_findings()
            } else {
                self.count(n)
            };
            let _ = writeln!(
                out,
                "  ({n}) {what}: {}",
                if count == 0 {
                    "ok".to_owned()
                } else {
                    format!("{count} VIOLATION(S)")
                }
            );
        }
        const SHOWN: usize = 50;
        for v in self.violations.iter().take(SHOWN) {
            let _ = writeln!(
                out,
                "    [{}]{}{} {}",
                v.invariant,
                v.consumer
                    .as_deref()
                    .map_or(String::new(), |c| format!(" consumer {c}")),
                v.order
                    .as_deref()
                    .map_or(String::new(), |o| format!(" order {o}")),
                v.what
            );
        }
        if self.violations.len() > SHOWN {
            let _ = writeln!(out, "    ... and {} more", self.violations.len() - SHOWN);
        }
        for d in self.drift.drift.iter().take(SHOWN) {
            let _ = writeln!(
                out,
                "    [drift] [{}]{} {}",
                d.tenant,
                d.order_id.map_or(String::new(), |o| format!(" order {o}")),
                d.what
            );
        }
        out
    }
}

/// A read-only connection whose snapshot is taken now.
async fn snapshot(url: &str) -> anyhow::Result<Client> {
    let (client, connection) = kit::db::connect(url).await?;
    tokio::spawn(connection);
    client
        .batch_execute(
            "SET default_transaction_read_only = on; \
             BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY; SELECT 1",
        )
        .await?;
    Ok(client)
}

struct Event {
    event_id: Uuid,
    order: String,
    sequence: i64,
    event_type: String,
}

/// A consumer's view, read in one snapshot.
struct ConsumerView {
    consumer: ConsumerRef,
    inbox: HashMap<Uuid, OffsetDateTime>,
    /// order -> (last_sequence, parked reason)
    progress: HashMap<String, (i64, Option<String>)>,
    /// (event_id, effect name) -> (rows, order id, position for ordering)
    effects: BTreeMap<(Uuid, &'static str), (i64, Uuid, i64)>,
}

/// (sequence, effect name).
type Step = (i64, &'static str);

const EXPECTED_TYPES: [&str; 3] = ["OrderPlaced", "PaymentReceived", "ParcelDelivered"];

fn expected_events(status: &str) -> usize {
    match status {
        "placed" => 1,
        "paid" => 2,
        "delivered" => 3,
        _ => 0,
    }
}

async fn read_consumer(
    client: &Client,
    consumer: &ConsumerRef,
    tenant: Option<&str>,
    event_ids: &[Uuid],
) -> anyhow::Result<ConsumerView> {
    let mut inbox = HashMap::new();
    for row in client
        .query(
            "SELECT event_id, processed_at FROM processed_events \
              WHERE consumer_name = $1 AND event_id = ANY($2)",
            &[&consumer.name, &event_ids],
        )
        .await?
    {
        inbox.insert(row.get(0), row.get(1));
    }
    let mut progress = HashMap::new();
    for row in client
        .query(
            "SELECT aggregate_id, last_sequence, \
                    CASE WHEN parked_at IS NULL THEN NULL ELSE coalesce(parked_reason, 'parked') END \
               FROM order_progress WHERE consumer_name = $1 AND ($2::text IS NULL OR tenant_id = $2)",
            &[&consumer.name, &tenant],
        )
        .await?
    {
        progress.insert(row.get(0), (row.get(1), row.get(2)));
    }
    let mut effects = BTreeMap::new();
    let mut add = |event: Uuid, name: &'static str, rows: i64, order: Uuid, position: i64| {
        let entry = effects.entry((event, name)).or_insert((0, order, position));
        entry.0 += rows;
    };
    let sql: &[(&'static str, &str)] = match consumer.kind {
        Kind::Inventory => &[
            (
                "order",
                "SELECT event_id, order_id, 1::bigint, 0::bigint FROM inventory_orders \
                  WHERE $1::text IS NULL OR tenant_id = $1",
            ),
            (
                "reserve",
                "SELECT event_id, order_id, count(*), max(movement_id) FROM stock_movements \
                  WHERE movement_type = 'reserve' AND ($1::text IS NULL OR tenant_id = $1) GROUP BY 1, 2",
            ),
            (
                "sale",
                "SELECT event_id, order_id, count(*), min(movement_id) FROM stock_movements \
                  WHERE movement_type = 'sale' AND ($1::text IS NULL OR tenant_id = $1) GROUP BY 1, 2",
            ),
        ],
        Kind::Ledger => &[
            (
                "order",
                "SELECT placed_event_id, order_id, 1::bigint, 0::bigint FROM ledger_orders \
                  WHERE $1::text IS NULL OR tenant_id = $1",
            ),
            (
                "payment entry",
                "SELECT event_id, order_id, count(*), \
                        (extract(epoch FROM min(posted_at)) * 1000000)::bigint FROM journal_entries \
                  WHERE event_type = 'PaymentReceived' AND ($1::text IS NULL OR tenant_id = $1) GROUP BY 1, 2",
            ),
            (
                "delivery entry",
                "SELECT event_id, order_id, count(*), \
                        (extract(epoch FROM min(posted_at)) * 1000000)::bigint FROM journal_entries \
                  WHERE event_type = 'ParcelDelivered' AND ($1::text IS NULL OR tenant_id = $1) GROUP BY 1, 2",
            ),
            (
                "other entry",
                "SELECT event_id, order_id, count(*), 0::bigint FROM journal_entries \
                  WHERE event_type NOT IN ('PaymentReceived', 'ParcelDelivered') \
                    AND ($1::text IS NULL OR tenant_id = $1) GROUP BY 1, 2",
            ),
        ],
        Kind::Loyalty => &[
            (
                "order",
                "SELECT placed_event_id, order_id, 1::bigint, 0::bigint FROM loyalty_orders \
                  WHERE $1::text IS NULL OR tenant_id = $1",
            ),
            (
                "points entry",
                "SELECT event_id, order_id, count(*), 0::bigint FROM loyalty_entries \
                  WHERE $1::text IS NULL OR tenant_id = $1 GROUP BY 1, 2",
            ),
        ],
    };
    for (name, query) in sql {
        for row in client.query(*query, &[&tenant]).await? {
            add(row.get(0), name, row.get(2), row.get(1), row.get(3));
        }
    }
    Ok(ConsumerView {
        consumer: consumer.clone(),
        inbox,
        progress,
        effects,
    })
}

/// What of an order decides the effects its events have.
#[derive(Clone, Copy, Debug, Default)]
struct OrderShape {
    /// Distinct SKUs of its lines.
    skus: i64,
    /// Whether its delivery earns loyalty points: a merchandise of at least
    /// one whole unit (seed 003: one point per whole unit; no entry of 0).
    earns_points: bool,
}

fn earns_points(merchandise_minor: i64) -> bool {
    loyalty_points(merchandise_minor) > 0
}

/// Seed 003's points for a merchandise: its whole units, as the loyalty
/// consumer computes them (`loyalty_consumer::points_for`).
pub(crate) fn loyalty_points(merchandise_minor: i64) -> i64 {
    events::Money::from_minor(merchandise_minor).whole_units()
}

/// The effects (name, rows) consumer `kind` writes for an event of type
/// `event_type` of an order of shape `order`.
fn expected_effects(kind: Kind, event_type: &str, order: OrderShape) -> Vec<(&'static str, i64)> {
    let skus = order.skus;
    match (kind, event_type) {
        (Kind::Inventory, "OrderPlaced") => vec![("order", 1), ("reserve", skus)],
        (Kind::Inventory, "ParcelDelivered") => vec![("sale", skus)],
        (Kind::Ledger, "OrderPlaced") => vec![("order", 1)],
        (Kind::Ledger, "PaymentReceived") => vec![("payment entry", 1)],
        (Kind::Ledger, "ParcelDelivered") => vec![("delivery entry", 1)],
        (Kind::Loyalty, "OrderPlaced") => vec![("order", 1)],
        (Kind::Loyalty, "ParcelDelivered") if order.earns_points => vec![("points entry", 1)],
        _ => vec![],
    }
}

/// Check every invariant once.
pub async fn check(dbs: &Databases, scope: &Scope) -> anyhow::Result<Report> {
    let tenant = scope.tenant.as_deref();
    // Consumer snapshots first (see the module documentation).
    let mut consumer_clients = Vec::new();
    for consumer in &scope.consumers {
        consumer_clients.push((consumer, snapshot(consumer.kind.url(dbs)).await?));
    }
    let orders_db = snapshot(&dbs.orders).await?;

    let mut report = Report {
        tenant: scope.tenant.clone(),
        ..Report::default()
    };
    let mut violations = Vec::new();
    let mut violate = |invariant: u8, consumer: Option<&str>, order: Option<&str>, what: String| {
        violations.push(Violation {
            invariant,
            consumer: consumer.map(str::to_owned),
            order: order.map(str::to_owned),
            what,
        })
    };

    // order id -> (tenant, status, last_event_sequence, payments, deliveries,
    // its shape: distinct skus, whether it earns points)
    let mut orders: HashMap<String, (String, String, i64, i64, i64, OrderShape)> = HashMap::new();
    for row in orders_db
        .query(
            "SELECT o.order_id::text, o.tenant_id, o.status, o.last_event_sequence, \
                    (SELECT count(*) FROM payments p WHERE p.order_id = o.order_id), \
                    (SELECT count(*) FROM deliveries d WHERE d.order_id = o.order_id), \
                    (SELECT count(DISTINCT sku) FROM order_lines l WHERE l.order_id = o.order_id), \
                    o.merchandise_minor \
               FROM orders o WHERE $1::text IS NULL OR o.tenant_id = $1",
            &[&tenant],
        )
        .await?
    {
        orders.insert(
            row.get(0),
            (
                row.get(1),
                row.get(2),
                row.get(3),
                row.get(4),
                row.get(5),
                OrderShape {
                    skus: row.get(6),
                    earns_points: earns_points(row.get(7)),
                },
            ),
        );
    }
    report.orders = i64::try_from(orders.len()).unwrap_or(i64::MAX);

    let mut events: Vec<Event> = Vec::new();
    let mut by_order: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    for row in orders_db
        .query(
            "SELECT event_id, tenant_id, aggregate_type, aggregate_id, aggregate_sequence, event_type, \
                    published_at IS NOT NULL, quarantined_at IS NOT NULL \
               FROM outbox_events WHERE $1::text IS NULL OR tenant_id = $1 \
              ORDER BY aggregate_id, aggregate_sequence",
            &[&tenant],
        )
        .await?
    {
        let event = Event {
            event_id: row.get(0),
            order: row.get(3),
            sequence: row.get(4),
            event_type: row.get(5),
        };
        let event_tenant: String = row.get(1);
        let aggregate_type: String = row.get(2);
        if row.get::<_, bool>(6) {
            report.published += 1;
        } else if row.get::<_, bool>(7) {
            report.quarantined += 1;
            violate(
                3,
                None,
                Some(&event.order),
                format!("event {} (sequence {}) quarantined", event.event_id, event.sequence),
            );
        } else {
            report.pending += 1;
            violate(
                3,
                None,
                Some(&event.order),
                format!("event {} (sequence {}) not published", event.event_id, event.sequence),
            );
        }
        // Invariant 2: the mutation behind the row.
        match orders.get(&event.order) {
            _ if aggregate_type != "order" => violate(
                2,
                None,
                Some(&event.order),
                format!("event {} of aggregate type {aggregate_type:?}", event.event_id),
            ),
            None => violate(
                2,
                None,
                Some(&event.order),
                format!(
                    "outbox row {} ({} #{}) without a committed order",
                    event.event_id, event.event_type, event.sequence
                ),
            ),
            Some((order_tenant, status, last, ..)) => {
                let index = usize::try_from(event.sequence - 1).unwrap_or(usize::MAX);
                if order_tenant != &event_tenant {
                    violate(2, None, Some(&event.order), format!("outbox row {} of tenant {event_tenant}, order of {order_tenant}", event.event_id));
                }
                if event.sequence > *last || index >= expected_events(status) {
                    violate(
                        2,
                        None,
                        Some(&event.order),
                        format!(
                            "outbox row {} (sequence {}) beyond the order's last sequence {last} / status {status}",
                            event.event_id, event.sequence
                        ),
                    );
                } else if EXPECTED_TYPES.get(index) != Some(&event.event_type.as_str()) {
                    violate(
                        2,
                        None,
                        Some(&event.order),
                        format!(
                            "outbox row {} is {} at sequence {}, expected {}",
                            event.event_id,
                            event.event_type,
                            event.sequence,
                            EXPECTED_TYPES.get(index).unwrap_or(&"nothing")
                        ),
                    );
                }
            }
        }
        by_order
            .entry(event.order.clone())
            .or_default()
            .push(events.len());
        events.push(event);
    }
    report.events = i64::try_from(events.len()).unwrap_or(i64::MAX);

    // Invariant 1: each mutation has exactly one outbox row.
    for (order, (_, status, last, payments, deliveries, _)) in &orders {
        let expected = expected_events(status);
        let sequences: Vec<i64> = by_order
            .get(order)
            .map(|ix| ix.iter().map(|&i| events[i].sequence).collect())
            .unwrap_or_default();
        let wanted: Vec<i64> = (1..=i64::try_from(expected).unwrap_or(0)).collect();
        if sequences != wanted {
            violate(
                1,
                None,
                Some(order),
                format!("status {status}: outbox sequences {sequences:?}, expected {wanted:?}"),
            );
        }
        if *last != i64::try_from(expected).unwrap_or(-1) {
            violate(
                1,
                None,
                Some(order),
                format!("status {status} but last_event_sequence {last}"),
            );
        }
        let (want_payments, want_deliveries) = (i64::from(expected >= 2), i64::from(expected >= 3));
        if (*payments, *deliveries) != (want_payments, want_deliveries) {
            violate(
                1,
                None,
                Some(order),
                format!("status {status} with {payments} payment(s) and {deliveries} deliver(ies)"),
            );
        }
    }

    // Invariants 3, 4 and 5, per consumer.
    let event_ids: Vec<Uuid> = events.iter().map(|e| e.event_id).collect();
    let index: HashMap<Uuid, usize> = event_ids
        .iter()
        .enumerate()
        .map(|(i, id)| (*id, i))
        .collect();
    for (consumer, client) in &consumer_clients {
        let view = read_consumer(client, consumer, tenant, &event_ids).await?;
        let name = Some(view.consumer.name.as_str());
        let mut summary = ConsumerSummary {
            kind: consumer.kind,
            name: consumer.name.clone(),
            applied: 0,
            missing: 0,
            parked: 0,
            duplicates_suppressed: None,
        };
        for (order, ix) in &by_order {
            let last_event = ix.iter().map(|&i| events[i].sequence).max().unwrap_or(0);
            let mut applied: Vec<(i64, OffsetDateTime)> = Vec::new();
            for &i in ix {
                let event = &events[i];
                match view.inbox.get(&event.event_id) {
                    Some(at) => {
                        summary.applied += 1;
                        applied.push((event.sequence, *at));
                    }
                    None => {
                        summary.missing += 1;
                        violate(
                            3,
                            name,
                            Some(order),
                            format!(
                                "event {} ({} #{}) not applied",
                                event.event_id, event.event_type, event.sequence
                            ),
                        );
                    }
                }
            }
            let (last_applied, parked) = view.progress.get(order).cloned().unwrap_or((0, None));
            if let Some(reason) = parked {
                summary.parked += 1;
                violate(3, name, Some(order), format!("order parked: {reason}"));
            }
            if last_applied != last_event {
                violate(
                    3,
                    name,
                    Some(order),
                    format!("progress at sequence {last_applied}, the order is at {last_event}"),
                );
            }
            // Invariant 5: exactly 1..=last applied, in time order.
            let sequences: Vec<i64> = applied.iter().map(|a| a.0).collect();
            let contiguous: Vec<i64> = (1..=last_applied).collect();
            if sequences != contiguous {
                violate(
                    5,
                    name,
                    Some(order),
                    format!("applied sequences {sequences:?} with progress at {last_applied}"),
                );
            }
            if applied.windows(2).any(|w| w[1].1 < w[0].1) {
                violate(
                    5,
                    name,
                    Some(order),
                    format!(
                        "processed out of order: {:?}",
                        applied
                            .iter()
                            .map(|(s, t)| format!("#{s} at {t}"))
                            .collect::<Vec<_>>()
                    ),
                );
            }
        }
        for order in view.progress.keys() {
            if !by_order.contains_key(order) {
                violate(
                    2,
                    name,
                    Some(order),
                    "progress for an order without outbox events".to_owned(),
                );
            }
        }

        // Invariant 4: effects per event, exactly as expected, with their inbox rows.
        let mut seen: BTreeSet<(Uuid, &'static str)> = BTreeSet::new();
        for event in &events {
            let shape = orders.get(&event.order).map(|o| o.5).unwrap_or_default();
            let inboxed = view.inbox.contains_key(&event.event_id);
            for (effect, rows) in expected_effects(consumer.kind, &event.event_type, shape) {
                seen.insert((event.event_id, effect));
                let found = view
                    .effects
                    .get(&(event.event_id, effect))
                    .map_or(0, |e| e.0);
                let want = if inboxed { rows } else { 0 };
                if found != want {
                    let (n, kind) = if found > want {
                        (
                            4,
                            if inboxed {
                                "doubled"
                            } else {
                                "without its inbox row"
                            },
                        )
                    } else {
                        (4, "missing although the inbox records the event")
                    };
                    violate(
                        n,
                        name,
                        Some(&event.order),
                        format!(
                            "{effect} of event {} ({} #{}): {found} row(s), expected {want} ({kind})",
                            event.event_id, event.event_type, event.sequence
                        ),
                    );
                }
            }
        }
        for ((event_id, effect), (rows, order_id, _)) in &view.effects {
            match index.get(event_id) {
                None => violate(
                    4,
                    name,
                    Some(&order_id.to_string()),
                    format!(
                        "{rows} {effect} row(s) for event {event_id}, which is not in the outbox"
                    ),
                ),
                Some(&i) => {
                    let event = &events[i];
                    if !seen.contains(&(*event_id, effect)) {
                        violate(
                            4,
                            name,
                            Some(&event.order),
                            format!(
                                "{rows} unexpected {effect} row(s) for {} #{} ({event_id})",
                                event.event_type, event.sequence
                            ),
                        );
                    }
                    if order_id.to_string() != event.order {
                        violate(
                            4,
                            name,
                            Some(&event.order),
                            format!("{effect} of event {event_id} recorded for order {order_id}"),
                        );
                    }
                }
            }
        }
        // Invariant 5 on the effects: reserve before sale, payment before delivery.
        let position = |order: &str, sequence: i64, effect: &'static str| -> Option<i64> {
            let ix = by_order.get(order)?;
            let event = ix
                .iter()
                .map(|&i| &events[i])
                .find(|e| e.sequence == sequence)?;
            view.effects.get(&(event.event_id, effect)).map(|e| e.2)
        };
        for order in by_order.keys() {
            let pairs: &[(Step, Step)] = match consumer.kind {
                Kind::Inventory => &[((1, "reserve"), (3, "sale"))],
                Kind::Ledger => &[((2, "payment entry"), (3, "delivery entry"))],
                Kind::Loyalty => &[],
            };
            for ((s1, e1), (s2, e2)) in pairs {
                if let (Some(a), Some(b)) = (position(order, *s1, e1), position(order, *s2, e2)) {
                    if b < a {
                        violate(
                            5,
                            name,
                            Some(order),
                            format!("{e2} (sequence {s2}) written before {e1} (sequence {s1})"),
                        );
                    }
                }
            }
        }
        report.consumers.push(summary);
    }

    report.violations = violations;
    report.violations.sort();
    // Invariant 6 and the drift check.
    report.drift = drift::check(dbs, tenant, Duration::ZERO).await?;
    Ok(report)
}

/// Check until clean or `timeout` has passed (after a recovery the system
/// may still be draining); the last report either way.
pub async fn check_until(
    dbs: &Databases,
    scope: &Scope,
    timeout: Duration,
) -> anyhow::Result<Report> {
    let deadline = Instant::now() + timeout;
    loop {
        let report = check(dbs, scope).await?;
        if report.is_clean() || Instant::now() >= deadline {
            return Ok(report);
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// The sum over the series of metric `name` (any labels) in a Prometheus
/// text exposition, as an integer (counters).
pub fn metric_sum(body: &str, name: &str) -> u64 {
    body.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum()
}

/// Scrape `url` (a `/metrics` endpoint) and sum metric `name`; `None` when
/// the endpoint does not answer, or answers other than 2xx (a wrong path's
/// 404 holds no metric: it is no measured 0).
pub async fn scrape(url: &str, names: &[&str]) -> Option<u64> {
    let body = reqwest::Client::new()
        .get(url)
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .ok()?
        .error_for_status()
        .ok()?
        .text()
        .await
        .ok()?;
    Some(names.iter().map(|n| metric_sum(&body, n)).sum())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metric_sums_every_series_of_one_name_only() {
        let body = "# HELP consumer_duplicates_total x\n\
                    consumer_duplicates_total{consumer=\"a\"} 3\n\
                    consumer_duplicates_total{consumer=\"b\"} 4\n\
                    consumer_duplicates_total_other 100\n\
                    consumer_stale_total 2\n";
        assert_eq!(metric_sum(body, "consumer_duplicates_total"), 7);
        assert_eq!(metric_sum(body, "consumer_stale_total"), 2);
        assert_eq!(metric_sum(body, "absent"), 0);
    }

    #[test]
    fn expected_effects_follow_the_design_table() {
        let order = OrderShape {
            skus: 2,
            earns_points: earns_points(100),
        };
        assert_eq!(
            expected_effects(Kind::Inventory, "OrderPlaced", order),
            vec![("order", 1), ("reserve", 2)]
        );
        assert!(expected_effects(Kind::Inventory, "PaymentReceived", order).is_empty());
        assert_eq!(
            expected_effects(Kind::Loyalty, "ParcelDelivered", order),
            vec![("points entry", 1)]
        );
        // Merchandise under one whole unit: 0 points, no entry.
        let small = OrderShape {
            skus: 1,
            earns_points: earns_points(99),
        };
        assert!(expected_effects(Kind::Loyalty, "ParcelDelivered", small).is_empty());
        assert_eq!(
            expected_effects(Kind::Ledger, "ParcelDelivered", small),
            vec![("delivery entry", 1)]
        );
        assert_eq!(expected_events("delivered"), 3);
    }

    #[test]
    fn a_report_counts_lost_and_renders_each_invariant() {
        let mut report = Report {
            events: 3,
            pending: 1,
            ..Report::default()
        };
        report.violations.push(Violation {
            invariant: 4,
            consumer: Some("c".into()),
            order: None,
            what: "doubled".into(),
        });
        assert_eq!(report.lost(), 1);
        assert_eq!(report.double_effects(), 1);
        assert!(!report.is_clean());
        let text = report.render();
        assert!(
            text.contains("(4) each event applied exactly once: 1 VIOLATION(S)"),
            "{text}"
        );
        assert!(
            text.contains("(5) per order, applied in sequence order: ok"),
            "{text}"
        );
    }
}
