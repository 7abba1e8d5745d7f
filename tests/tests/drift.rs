//! The drift check finds drift (and only drift): rows written by hand into the
//! real databases, checked with the real `drift-check` binary.

use std::process::Command;

use system_tests::{bin, pg, unique_tenant, Database};
use uuid::Uuid;

fn drift_check(tenant: &str) -> (i32, String) {
    let output = Command::new(bin("drift-check"))
        .args(["--tenant", tenant])
        .output()
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
    system_tests::insert_seed_order(&orders, &tenant, order).await;

    // Placed, but inventory never reserved: drift.
    let (code, out) = drift_check(&tenant);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("reservation missing"), "{out}");

    // The reservation as the consumer writes it: zero drift.
    let inventory = pg(Database::Inventory).await;
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
    inventory
        .execute(
            "DELETE FROM stock_movements WHERE tenant_id = $1 AND movement_type = 'reserve' \
             AND movement_id = (SELECT max(movement_id) FROM stock_movements WHERE tenant_id = $1)",
            &[&tenant],
        )
        .await
        .expect("undo double");
    let (code, out) = drift_check(&tenant);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("stock level JKT-M@WH-1: on_hand 48 reserved 4, movements say 48 / 2"),
        "{out}"
    );

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
    inventory
        .execute(
            "DELETE FROM stock_movements WHERE tenant_id = $1",
            &[&tenant],
        )
        .await
        .expect("clean");
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
    // opened the orders one.
    let orders = pg(Database::Orders).await;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
    loop {
        let row = orders
            .query_one(
                "SELECT count(*) FILTER (WHERE datname IN ('inventory', 'ledger', 'loyalty') \
                                           AND state = 'idle in transaction'), \
                        count(*) FILTER (WHERE datname = 'orders') \
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
    let inventory = pg(Database::Inventory).await;
    inventory
        .execute(
            "INSERT INTO stock_levels (tenant_id, sku, location, on_hand, reserved) VALUES ($1, 'JKT-M', 'WH-1', 0, 2)",
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
