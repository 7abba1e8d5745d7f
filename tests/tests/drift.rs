//! The drift check finds drift (and only drift): rows written by hand into the
//! real databases, checked with the real `drift-check` binary.

use std::process::Command;
use system_tests::OutputWithin;

use system_tests::{bin, pg, unique_tenant, Database};
use uuid::Uuid;

/// `drift-check --tenant <tenant> --grace-seconds 0`: every order checked,
/// however recently changed (the tests write them just before).
fn drift_check(tenant: &str) -> (i32, String) {
    drift_check_with(tenant, &["--grace-seconds", "0"])
}

fn drift_check_with(tenant: &str, args: &[&str]) -> (i32, String) {
    let output = Command::new(bin("drift-check"))
        .args(["--tenant", tenant])
        .args(args)
        .output_within()
        .expect("run drift-check");
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&output.stdout).into_owned(),
    )
}

#[tokio::test]
async fn drift_check_reports_missing_doubled_and_inconsistent_effects_and_exits_non_zero() {
    let tenant = unique_tenant("drift");
    let order = Uuid::now_v7();
    let orders = pg(Database::Orders).await;
    // Nothing of the tenant anywhere yet (a misspelt name): nothing compared
    // is not zero drift.
    assert_eq!(drift_check(&tenant).0, 2);
    system_tests::insert_seed_order(&orders, &tenant, order).await;
    plant_terms(&tenant, order, "USD").await;

    // Placed just now, inventory not reserved yet: at the default grace
    // (60 s) the order is in flight, skipped, zero drift...
    let (code, out) = drift_check_with(&tenant, &[]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("(0 paid, 0 delivered, 1 skipped in flight)"),
        "{out}"
    );
    // ... and every order is checked at 0: placed, never reserved: drift.
    let (code, out) = drift_check(&tenant);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("reservation missing"), "{out}");
    assert!(!out.contains("parked in"), "{out}");

    // The same, with the order's event quarantined in the outbox (no relay
    // claims it) and the order parked in the inventory consumer: the
    // finding says both (what to look at first).
    orders
        .execute(
            "INSERT INTO outbox_events (event_id, tenant_id, aggregate_type, aggregate_id, \
               aggregate_sequence, event_type, schema_version, payload, quarantined_at) \
             VALUES ($1, $2, 'order', $3, 1, 'OrderPlaced', 1, '{}', now())",
            &[&Uuid::now_v7(), &tenant, &order.to_string()],
        )
        .await
        .expect("quarantined row");
    let inventory = pg(Database::Inventory).await;
    inventory
        .execute(
            "INSERT INTO order_progress (consumer_name, aggregate_id, tenant_id, parked_at, \
               parked_reason) VALUES ('drift-test', $1, $2, now(), 'poison: test')",
            &[&order.to_string(), &tenant],
        )
        .await
        .expect("parked");
    let (code, out) = drift_check(&tenant);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains(
            "reservation missing: expected JKT-M@WH-1 2, found none \
             (1 event(s) unpublished, 1 quarantined; parked in drift-test: poison: test)"
        ),
        "{out}"
    );
    system_tests::delete_outbox_rows(
        &orders,
        "DELETE FROM outbox_events WHERE tenant_id = $1",
        &[&tenant],
    )
    .await;
    inventory
        .execute(
            "DELETE FROM order_progress WHERE consumer_name = 'drift-test' AND aggregate_id = $1",
            &[&order.to_string()],
        )
        .await
        .expect("unpark");

    // The reservation as the consumer writes it: zero drift.
    inventory
        .execute(
            "INSERT INTO stock_levels (tenant_id, sku, location, on_hand, reserved) VALUES ($1, 'JKT-M', 'WH-1', 48, 2)",
            &[&tenant],
        )
        .await
        .expect("level");
    inventory
        .execute(
            "INSERT INTO stock_movements (tenant_id, sku, location, movement_type, qty, on_hand_delta, reserved_delta, receipt_id) \
             VALUES ($1, 'JKT-M', 'WH-1', 'receipt', 48, 48, 0, 'r-1')",
            &[&tenant],
        )
        .await
        .expect("receipt");
    let reserve = "INSERT INTO stock_movements (tenant_id, sku, location, movement_type, qty, on_hand_delta, \
                   reserved_delta, order_id, event_id) VALUES ($1, 'JKT-M', 'WH-1', 'reserve', 2, 0, 2, $2, $3)";
    inventory
        .execute(reserve, &[&tenant, &order, &Uuid::now_v7()])
        .await
        .expect("reserve");
    let (code, out) = drift_check(&tenant);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("zero drift"), "{out}");

    // A second reservation for the same order (a double apply): drift.
    inventory
        .execute(reserve, &[&tenant, &order, &Uuid::now_v7()])
        .await
        .expect("second reserve");
    inventory
        .execute(
            "UPDATE stock_levels SET reserved = 4 WHERE tenant_id = $1",
            &[&tenant],
        )
        .await
        .expect("level");
    let (code, out) = drift_check(&tenant);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("reservation doubled"), "{out}");

    // A level that no longer equals its movements: drift.
    system_tests::repair_movements(
        &inventory,
        "DELETE FROM stock_movements WHERE tenant_id = $1 AND movement_type = 'reserve' \
         AND movement_id = (SELECT max(movement_id) FROM stock_movements WHERE tenant_id = $1)",
        &[&tenant],
    )
    .await;
    let (code, out) = drift_check(&tenant);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("stock level JKT-M@WH-1: on_hand 48 reserved 4, movements say 48 / 2"),
        "{out}"
    );

    // A reservation with the right qty but another effect (on hand taken,
    // nothing reserved) cannot be written (inventory V2: each type has its
    // one effect), nor can a written movement be changed, even by a repair
    // that lifts the immutability (the check holds for it too).
    let wrong_effect = inventory
        .execute(
            "INSERT INTO stock_movements (tenant_id, sku, location, movement_type, qty, \
               on_hand_delta, reserved_delta, order_id, event_id) \
             VALUES ($1, 'JKT-M', 'WH-1', 'reserve', 2, -2, 0, $2, $3)",
            &[&tenant, &order, &Uuid::now_v7()],
        )
        .await
        .expect_err("a reservation that takes stock off hand");
    assert_eq!(
        wrong_effect.as_db_error().and_then(|e| e.constraint()),
        Some("stock_movements_effect_of_its_type"),
        "{wrong_effect:?}"
    );
    let changed = inventory
        .execute(
            "UPDATE stock_movements SET on_hand_delta = -2, reserved_delta = 0 \
             WHERE tenant_id = $1 AND movement_type = 'reserve'",
            &[&tenant],
        )
        .await
        .expect_err("movements are immutable");
    assert!(
        changed
            .as_db_error()
            .is_some_and(|e| e.message().contains("stock_movements rows are immutable")),
        "{changed:?}"
    );
    let deleted = inventory
        .execute(
            "DELETE FROM stock_movements WHERE tenant_id = $1",
            &[&tenant],
        )
        .await
        .expect_err("movements are not deleted");
    assert!(
        deleted
            .as_db_error()
            .is_some_and(|e| e.message().contains("stock_movements rows are immutable")),
        "{deleted:?}"
    );
    // The level set back to what its movements say: zero drift.
    inventory
        .execute(
            "UPDATE stock_levels SET on_hand = 48, reserved = 2 WHERE tenant_id = $1",
            &[&tenant],
        )
        .await
        .expect("level");
    let (code, out) = drift_check(&tenant);
    assert_eq!(code, 0, "{out}");

    // A paid order without its payment journal: drift.
    inventory
        .execute(
            "UPDATE stock_levels SET reserved = 2 WHERE tenant_id = $1",
            &[&tenant],
        )
        .await
        .expect("level");
    orders
        .execute(
            "UPDATE orders SET status = 'paid' WHERE order_id = $1",
            &[&order],
        )
        .await
        .expect("paid");
    let (code, out) = drift_check(&tenant);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("payment journal missing"), "{out}");

    // Leave nothing behind.
    system_tests::repair_movements(
        &inventory,
        "DELETE FROM stock_movements WHERE tenant_id = $1",
        &[&tenant],
    )
    .await;
    inventory
        .execute("DELETE FROM stock_levels WHERE tenant_id = $1", &[&tenant])
        .await
        .expect("clean");
    orders
        .execute("DELETE FROM order_lines WHERE order_id = $1", &[&order])
        .await
        .expect("clean");
    orders
        .execute("DELETE FROM orders WHERE order_id = $1", &[&order])
        .await
        .expect("clean");
    orders
        .execute("DELETE FROM tenants WHERE tenant_id = $1", &[&tenant])
        .await
        .expect("clean");
}

/// The consumers' snapshots are taken before the orders one, so an order
/// placed and applied while the check runs is at most "in flight", never
/// "movements for an unknown order". The check is held between its
/// snapshots (fail point `drift.between_snapshots`) while the test commits
/// an order and its reservation; taken the other way round (orders first),
/// the reservation shows as drift whatever the grace.
#[tokio::test]
async fn an_order_committed_between_the_snapshots_is_in_flight_not_drift() {
    let tenant = unique_tenant("drift-window");
    let order = Uuid::now_v7();
    let check = tokio::process::Command::new(bin("drift-check"))
        .args(["--tenant", &tenant, "--grace-seconds", "600"])
        .env("FAILPOINTS", "drift.between_snapshots=sleep(20000)")
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn drift-check");
    let name = format!("drift-check/{}", check.id().expect("pid"));

    // Wait until the check holds its three consumer snapshots and has not
    // taken the orders one (its session is open, idle, outside a
    // transaction: the check connects to all four first).
    let orders = pg(Database::Orders).await;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
    loop {
        let row = orders
            .query_one(
                "SELECT count(*) FILTER (WHERE datname IN ('inventory', 'ledger', 'loyalty') \
                                           AND state = 'idle in transaction'), \
                        count(*) FILTER (WHERE datname = 'orders' \
                                           AND state = 'idle in transaction') \
                   FROM pg_stat_activity WHERE application_name = $1",
                &[&name],
            )
            .await
            .expect("pg_stat_activity");
        let (consumers, orders_sessions): (i64, i64) = (row.get(0), row.get(1));
        assert_eq!(orders_sessions, 0, "the orders snapshot was taken first");
        if consumers == 3 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "drift-check never held its consumer snapshots ({consumers} of 3)"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }

    // An order placed and reserved now, between the snapshots.
    system_tests::insert_seed_order(&orders, &tenant, order).await;
    reserved_from_nothing(&tenant, order).await;

    let output = tokio::time::timeout(std::time::Duration::from_secs(60), check.wait_with_output())
        .await
        .expect("drift-check finishes")
        .expect("drift-check output");
    let out = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(0), "{out}");
    assert!(out.contains("zero drift"), "{out}");
    assert!(!out.contains("unknown order"), "{out}");
    // Seen by the orders snapshot only: in flight.
    assert!(
        out.contains("1 orders (0 paid, 0 delivered, 1 skipped in flight)"),
        "{out}"
    );
}

/// The ledger's accounts of the seed order's books (code, kind).
const CHART: &[(&str, &str)] = &[
    ("clearing:card", "asset"),
    ("customer_deposits", "liability"),
    ("sales", "revenue"),
    ("shipping_income", "revenue"),
    ("tax_payable", "liability"),
    ("cogs", "expense"),
    ("inventory", "asset"),
];

/// Ledger accounts (code, kind) of `tenant`, each named by its code.
async fn accounts(ledger: &tokio_postgres::Client, tenant: &str, accounts: &[(&str, &str)]) {
    for (code, kind) in accounts {
        ledger
            .execute(
                "INSERT INTO ledger_accounts (tenant_id, code, name, kind) VALUES ($1, $2, $2, $3)",
                &[&tenant, code, kind],
            )
            .await
            .expect("account");
    }
}

/// Stock of `tenant`: 2 x JKT-M at WH-1 reserved for `order` (nothing on
/// hand), the level equal to its one movement.
async fn reserved_from_nothing(tenant: &str, order: Uuid) {
    let inventory = pg(Database::Inventory).await;
    inventory
        .execute(
            "INSERT INTO stock_levels (tenant_id, sku, location, on_hand, reserved) \
             VALUES ($1, 'JKT-M', 'WH-1', 0, 2)",
            &[&tenant],
        )
        .await
        .expect("level");
    inventory
        .execute(
            "INSERT INTO stock_movements (tenant_id, sku, location, movement_type, qty, on_hand_delta, \
             reserved_delta, order_id, event_id) VALUES ($1, 'JKT-M', 'WH-1', 'reserve', 2, 0, 2, $2, $3)",
            &[&tenant, &order, &Uuid::now_v7()],
        )
        .await
        .expect("reserve");
}

/// [`system_tests::post_journal`], which must commit.
async fn post(
    ledger: &mut tokio_postgres::Client,
    tenant: &str,
    order: Uuid,
    event_type: &str,
    lines: &[(&str, i64, i64)],
) {
    system_tests::post_journal(ledger, tenant, order, event_type, lines)
        .await
        .expect("balanced entry");
}

/// The terms the ledger and loyalty keep from an order's OrderPlaced (they
/// post the payment and the delivery, and award the points, by them) are
/// compared with the order: a wrong customer, currency or amount is drift
/// before any payment or delivery shows it, and so are terms missing (its
/// OrderPlaced not applied there: parked, or a consumer added later without
/// the history replayed).
#[tokio::test]
async fn consumers_order_terms_that_differ_from_the_order_are_drift() {
    let tenant = unique_tenant("drift-terms");
    let (order, bare) = (Uuid::now_v7(), Uuid::now_v7());
    let orders = pg(Database::Orders).await;
    system_tests::insert_seed_order(&orders, &tenant, order).await;
    system_tests::insert_another_seed_order(&orders, &tenant, bare).await;
    // The seed order: customer 77, USD, merchandise 80.00, shipping 5.00,
    // tax 8.00, total 93.00, cost 44.00. The ledger kept another total, and
    // loyalty another customer.
    plant_terms_with(&tenant, order, ("USD", 9400, "78")).await;
    let (code, out) = drift_check(&tenant);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains(
            "the ledger's terms of the order differ: customer 77, USD merchandise 80.00, \
             shipping 5.00, tax 8.00, total 94.00, cost 44.00 (the order: customer 77, USD \
             merchandise 80.00, shipping 5.00, tax 8.00, total 93.00, cost 44.00)"
        ),
        "{out}"
    );
    assert!(
        out.contains(
            "the loyalty's terms of the order differ: customer 78, USD merchandise 80.00 \
             (the order: customer 77, USD merchandise 80.00)"
        ),
        "{out}"
    );
    for consumer in ["ledger", "loyalty"] {
        assert!(
            out.contains(&format!(
                "{bare}: the {consumer} has no terms of the order (its OrderPlaced not applied)"
            )),
            "{out}"
        );
        assert!(
            !out.contains(&format!("{order}: the {consumer} has no terms")),
            "{out}"
        );
    }
}

/// A journal entry without lines (the database refuses one; a header
/// written by hand with the triggers off, as a repair might, is not) is
/// drift, named as such. Before, the check joined entries to their lines
/// and never saw it.
#[tokio::test]
async fn a_journal_entry_without_lines_is_drift() {
    let tenant = unique_tenant("drift-no-lines");
    let order = Uuid::now_v7();
    let orders = pg(Database::Orders).await;
    system_tests::insert_seed_order(&orders, &tenant, order).await;
    let mut ledger = pg(Database::Ledger).await;
    let entry = Uuid::now_v7();
    let tx = ledger.transaction().await.expect("begin");
    tx.batch_execute("SET LOCAL session_replication_role = replica")
        .await
        .expect("the triggers off, for this transaction");
    system_tests::insert_journal_entry(&tx, entry, &tenant, order, "PaymentReceived").await;
    tx.commit().await.expect("a header alone");
    let (code, out) = drift_check(&tenant);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains(&format!("journal entry {entry} has no lines")),
        "{out}"
    );
}

/// The seed order's terms, as the ledger and loyalty keep them from its
/// OrderPlaced (in `currency`): what a consumer that applied it has.
async fn plant_terms(tenant: &str, order: Uuid, currency: &str) {
    plant_terms_with(tenant, order, (currency, 9300, "77")).await;
}

/// [`plant_terms`] with the ledger's total (minor units) and loyalty's
/// customer as given (the ledger's customer, amounts and cost the seed's).
async fn plant_terms_with(
    tenant: &str,
    order: Uuid,
    (currency, total, customer): (&str, i64, &str),
) {
    pg(Database::Ledger)
        .await
        .execute(
            "INSERT INTO ledger_orders (tenant_id, order_id, customer_id, currency, merchandise, \
               shipping, tax, total, cost_of_goods, placed_event_id) \
             VALUES ($1, $2, '77', $3, 8000, 500, 800, $4, 4400, $2)",
            &[&tenant, &order, &currency, &total],
        )
        .await
        .expect("the ledger's terms");
    pg(Database::Loyalty)
        .await
        .execute(
            "INSERT INTO loyalty_orders (tenant_id, order_id, customer_id, currency, merchandise, \
               placed_event_id) VALUES ($1, $2, $4, $3, 8000, $2)",
            &[&tenant, &order, &currency, &customer],
        )
        .await
        .expect("loyalty's terms");
}

/// Journals are checked account by account, as the ledger posts them (seed
/// 003): a balanced journal with the right number of entries and the right
/// total debits, on other accounts, is drift too. The payment's clearing
/// account is its method's (`Card` -> `clearing:card`).
#[tokio::test]
async fn journals_on_other_accounts_are_drift_even_when_balanced() {
    let tenant = unique_tenant("drift-accounts");
    let (right, wrong, no_payment) = (Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7());
    // Paid, its payment journal right but for the currency: the order is
    // in EUR, the entry in USD.
    let euro = Uuid::now_v7();
    // Delivered, its payment journal and its loyalty points posted wrong,
    // then corrected by hand: a reversal and the right entry each, under
    // the same event type. Its books net to the order's: no finding.
    let corrected = Uuid::now_v7();
    // Paid, its payment journal reversed without the right entry posted:
    // its books hold no payment.
    let reversed = Uuid::now_v7();
    let orders = pg(Database::Orders).await;
    system_tests::insert_seed_order(&orders, &tenant, right).await;
    for order in [wrong, no_payment, euro, corrected, reversed] {
        system_tests::insert_another_seed_order(&orders, &tenant, order).await;
    }
    for order in [right, wrong, no_payment, corrected, reversed] {
        plant_terms(&tenant, order, "USD").await;
    }
    plant_terms(&tenant, euro, "EUR").await;
    orders
        .execute(
            "UPDATE orders SET status = 'paid' WHERE order_id = $1",
            &[&reversed],
        )
        .await
        .expect("paid");
    orders
        .execute(
            "UPDATE orders SET currency = 'EUR', status = 'paid' WHERE order_id = $1",
            &[&euro],
        )
        .await
        .expect("a paid order in EUR");
    // Paid, with its journal, but without the payment row it came from.
    orders
        .execute(
            "UPDATE orders SET status = 'paid' WHERE order_id = $1",
            &[&no_payment],
        )
        .await
        .expect("paid");
    for order in [right, wrong, euro, corrected, reversed] {
        orders
            .execute(
                "INSERT INTO payments (order_id, payment_id, tenant_id, amount_minor, method) \
                 VALUES ($1, $3, $2, 9300, 'Card')",
                &[&order, &tenant, &format!("9001-{order}")],
            )
            .await
            .expect("payment");
        if order != euro && order != reversed {
            orders
                .execute(
                    "UPDATE orders SET status = 'delivered' WHERE order_id = $1",
                    &[&order],
                )
                .await
                .expect("delivered");
        }
    }
    let mut ledger = pg(Database::Ledger).await;
    accounts(&ledger, &tenant, CHART).await;
    // The seed's books for `right` (and `no_payment`'s payment); `wrong`:
    // the payment credited to sales, the delivery's shipping and tax booked
    // as sales. All balanced, all of the right total.
    let wrong_payment: &[(&str, i64, i64)] = &[("clearing:card", 9300, 0), ("sales", 0, 9300)];
    let wrong_delivery: &[(&str, i64, i64)] = &[
        ("customer_deposits", 9300, 0),
        ("sales", 0, 9300),
        ("cogs", 4400, 0),
        ("inventory", 0, 4400),
    ];
    for (order, event_type, journal) in [
        (right, "PaymentReceived", system_tests::SEED_PAYMENT_JOURNAL),
        (
            right,
            "ParcelDelivered",
            system_tests::SEED_DELIVERY_JOURNAL,
        ),
        (
            no_payment,
            "PaymentReceived",
            system_tests::SEED_PAYMENT_JOURNAL,
        ),
        (wrong, "PaymentReceived", wrong_payment),
        (wrong, "ParcelDelivered", wrong_delivery),
        (euro, "PaymentReceived", system_tests::SEED_PAYMENT_JOURNAL),
        (corrected, "PaymentReceived", wrong_payment),
        (
            corrected,
            "PaymentReceived",
            &[("sales", 9300, 0), ("clearing:card", 0, 9300)],
        ),
        (
            corrected,
            "PaymentReceived",
            system_tests::SEED_PAYMENT_JOURNAL,
        ),
        (
            corrected,
            "ParcelDelivered",
            system_tests::SEED_DELIVERY_JOURNAL,
        ),
        (
            reversed,
            "PaymentReceived",
            system_tests::SEED_PAYMENT_JOURNAL,
        ),
        (
            reversed,
            "PaymentReceived",
            &[("customer_deposits", 9300, 0), ("clearing:card", 0, 9300)],
        ),
        // Under a type no event posts: drift unless it nets to zero.
        (
            no_payment,
            "Adjustment",
            &[("sales", 100, 0), ("customer_deposits", 0, 100)],
        ),
    ] {
        post(&mut ledger, &tenant, order, event_type, journal).await;
    }

    let loyalty = pg(Database::Loyalty).await;
    for (customer, points) in [("99", 80_i64), ("99", -80), ("77", 80)] {
        loyalty
            .execute(
                "INSERT INTO loyalty_entries (tenant_id, customer_id, order_id, points, event_id, \
                 event_type, reason, occurred_at) \
                 VALUES ($1, $2, $3, $4, $5, 'ParcelDelivered', 'by hand', now())",
                &[&tenant, &customer, &corrected, &points, &Uuid::now_v7()],
            )
            .await
            .expect("loyalty entry");
    }

    let (code, out) = drift_check(&tenant);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains(&format!(
            "order {wrong}: payment journal posts other accounts or amounts: expected \
             clearing:card Dr 93.00, customer_deposits Cr 93.00, found clearing:card Dr 93.00, \
             sales Cr 93.00"
        )),
        "{out}"
    );
    assert!(
        out.contains(&format!(
            "order {wrong}: delivery journal posts other accounts or amounts: expected \
             cogs Dr 44.00, customer_deposits Dr 93.00, inventory Cr 44.00, sales Cr 80.00, \
             shipping_income Cr 5.00, tax_payable Cr 8.00, found cogs Dr 44.00, \
             customer_deposits Dr 93.00, inventory Cr 44.00, sales Cr 93.00"
        )),
        "{out}"
    );
    assert!(
        out.contains(&format!(
            "order {no_payment}: paid, but the order has no payment row"
        )),
        "{out}"
    );
    assert!(
        out.contains(&format!(
            "order {reversed}: payment journal reversed: expected 1 entr(ies) debiting 93.00, \
             found 2 entr(ies) debiting 186.00 netting to nothing"
        )),
        "{out}"
    );
    assert!(
        out.contains(&format!(
            "order {no_payment}: journal entries of type Adjustment net to customer_deposits \
             Cr 1.00 USD, sales Dr 1.00 USD (no event of the order posts them)"
        )),
        "{out}"
    );
    // `corrected` nets to its order's books: no journal or loyalty finding.
    let corrected_findings: Vec<&str> = out
        .lines()
        .filter_map(|line| line.split_once(&format!("order {corrected}: ")))
        .map(|(_, what)| what)
        .filter(|what| what.contains("journal") || what.contains("loyalty"))
        .collect();
    assert!(corrected_findings.is_empty(), "{out}");
    // `euro`'s payment journal is right but for its currency: that is its
    // one ledger finding.
    let euro_ledger_findings: Vec<&str> = out
        .lines()
        .filter_map(|line| line.split_once(&format!("order {euro}: ")))
        .map(|(_, what)| what)
        .filter(|what| what.contains("journal"))
        .collect();
    assert_eq!(
        euro_ledger_findings,
        vec![r#"journal entries in {"USD"}, the order is in EUR"#],
        "{out}"
    );
    // `right` has its books: its findings are exactly the missing
    // inventory and loyalty effects, none about its journals.
    let right_findings: Vec<&str> = out
        .lines()
        .filter_map(|line| line.split_once(&format!("order {right}: ")))
        .map(|(_, what)| what)
        .collect();
    assert_eq!(
        right_findings,
        vec![
            "loyalty: expected 1 entry of 80 points for customer 77, found none",
            "reservation missing: expected JKT-M@WH-1 2, found none",
            "sale missing: expected JKT-M@WH-1 -2, found none",
        ],
        "{out}"
    );
    // The trial balance is even: only the account check sees it.
    assert!(
        out.contains("trial balance USD: debits 1249.00 = credits 1249.00"),
        "{out}"
    );
}

/// Without `--tenant` the check runs tenant by tenant over every tenant
/// with rows in any database, a tenant only a consumer knows included: its
/// findings and summary are those of a check of that tenant alone.
#[tokio::test]
async fn an_unfiltered_check_covers_each_tenant_as_its_own_check_does() {
    let tenant = unique_tenant("drift-all");
    let stray = Uuid::now_v7();
    loyalty_entry_of(&tenant, stray).await;
    let databases = ops::drift::Databases::from_env();
    let alone = ops::drift::check(&databases, Some(&tenant), std::time::Duration::ZERO)
        .await
        .expect("the tenant's check");
    assert_eq!(
        alone
            .drift
            .iter()
            .map(|d| (d.order_id, d.what.as_str()))
            .collect::<Vec<_>>(),
        vec![(Some(stray), "loyalty entries for an unknown order")]
    );
    let all = ops::drift::check(&databases, None, std::time::Duration::ZERO)
        .await
        .expect("the unfiltered check");
    let of_tenant: Vec<_> = all.drift.iter().filter(|d| d.tenant == tenant).collect();
    assert_eq!(of_tenant, alone.drift.iter().collect::<Vec<_>>());
    assert_eq!(all.tenants.get(&tenant), alone.tenants.get(&tenant));
    assert!(all.tenants.len() > 1, "the other tenants too");
}

/// A loyalty entry of 80 points for customer 77 of `order` (a delivery's).
async fn loyalty_entry_of(tenant: &str, order: Uuid) {
    pg(Database::Loyalty)
        .await
        .execute(
            "INSERT INTO loyalty_entries (tenant_id, customer_id, order_id, points, event_id, \
             event_type, reason, occurred_at) \
             VALUES ($1, '77', $2, 80, $3, 'ParcelDelivered', 'test', now())",
            &[&tenant, &order, &Uuid::now_v7()],
        )
        .await
        .expect("loyalty entry");
}

/// Effects of an order the orders database does not have (a consumer fed
/// another system's events, or an order deleted by hand) are drift in each
/// consumer's database that holds one, and so are the order terms the
/// ledger and loyalty keep from its OrderPlaced (alone for another order:
/// no other effect of it anywhere).
#[tokio::test]
async fn effects_of_an_unknown_order_are_drift() {
    let tenant = unique_tenant("drift-unknown");
    let stray = Uuid::now_v7();
    reserved_from_nothing(&tenant, stray).await;
    let mut ledger = pg(Database::Ledger).await;
    // The payment's two accounts.
    accounts(&ledger, &tenant, &CHART[..2]).await;
    post(
        &mut ledger,
        &tenant,
        stray,
        "PaymentReceived",
        system_tests::SEED_PAYMENT_JOURNAL,
    )
    .await;
    loyalty_entry_of(&tenant, stray).await;
    let only_terms = Uuid::now_v7();
    plant_terms(&tenant, only_terms, "USD").await;

    let (code, out) = drift_check(&tenant);
    assert_eq!(code, 1, "{out}");
    for (order, what) in [
        (stray, "stock movements for an unknown order"),
        (stray, "journal entries for an unknown order"),
        (stray, "loyalty entries for an unknown order"),
        (
            only_terms,
            "the ledger keeps order terms for an unknown order",
        ),
        (only_terms, "loyalty keeps order terms for an unknown order"),
    ] {
        assert!(out.contains(&format!("order {order}: {what}")), "{out}");
    }
    assert!(
        out.lines().any(|line| line == "5 drift finding(s):"),
        "only these five: {out}"
    );
}
