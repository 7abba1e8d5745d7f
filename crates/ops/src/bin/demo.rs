//! `demo`: the order 1042 story of seed 003 through the real HTTP APIs of a
//! running system, then the rows it produced, read from the consumers' read
//! endpoints. Each run uses a fresh tenant so the numbers are the story's.
//!
//! Environment: `ORDER_API_URL` (http://127.0.0.1:8080), `INVENTORY_URL`
//! (:8081), `LEDGER_URL` (:8082), `LOYALTY_URL` (:8083), `SERVICE_TOKEN`
//! (local-dev-token), `ORDER_API_BIN` (target/debug/order-api, to create the
//! run's tenant and API key), or `DEMO_TENANT` and `DEMO_API_KEY` together:
//! a fresh tenant and its key made by the caller (the system test of the
//! demo runs it on a system of its own so).

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use reqwest::Client;
use serde_json::{json, Value};

fn env(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

struct Demo {
    http: Client,
    api: String,
    inventory: String,
    ledger: String,
    loyalty: String,
    api_key: String,
    token: String,
    tenant: String,
}

impl Demo {
    async fn post(&self, url: String, key: &str, body: Value) -> anyhow::Result<Value> {
        let response = self
            .http
            .post(&url)
            .bearer_auth(&self.api_key)
            .header("Idempotency-Key", key)
            .json(&body)
            .send()
            .await
            .with_context(|| format!("POST {url}"))?;
        let status = response.status();
        let value: Value = response.json().await?;
        if !status.is_success() {
            bail!("POST {url}: {status} {value}");
        }
        Ok(value)
    }

    async fn read(&self, url: String) -> anyhow::Result<Option<Value>> {
        let response = self
            .http
            .get(&url)
            .bearer_auth(&self.token)
            .header("X-Tenant-Id", self.tenant.as_str())
            .send()
            .await
            .with_context(|| format!("GET {url}"))?;
        if response.status().as_u16() == 404 {
            return Ok(None);
        }
        let status = response.status();
        let value: Value = response.json().await?;
        if !status.is_success() {
            bail!("GET {url}: {status} {value}");
        }
        Ok(Some(value))
    }
}

/// An entry as the demo compares it: its event and its lines (account,
/// debit, credit as the ledger's API shows them).
type Posting = (String, Vec<(String, String, String)>);

fn s(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => "-".to_owned(),
        other => other.to_string(),
    }
}

/// A fresh tenant and its API key, made by `order-api api-key create`.
fn new_tenant() -> anyhow::Result<(String, String)> {
    let tenant = format!("story-{}", &uuid::Uuid::now_v7().simple().to_string()[20..]);
    let bin = env("ORDER_API_BIN", "target/debug/order-api");
    let output = std::process::Command::new(&bin)
        .args(["api-key", "create", "--tenant", &tenant])
        .output()
        .with_context(|| format!("running {bin}"))?;
    if !output.status.success() {
        bail!(
            "{bin} api-key create: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let key = String::from_utf8(output.stdout)?.trim().to_owned();
    Ok((tenant, key))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let (tenant, api_key) = match (std::env::var("DEMO_TENANT"), std::env::var("DEMO_API_KEY")) {
        (Ok(tenant), Ok(key)) => (tenant, key),
        (Err(_), Err(_)) => new_tenant()?,
        _ => bail!("set both DEMO_TENANT and DEMO_API_KEY, or neither"),
    };
    let demo = Demo {
        http: Client::builder().timeout(Duration::from_secs(10)).build()?,
        api: env("ORDER_API_URL", "http://127.0.0.1:8080"),
        inventory: env("INVENTORY_URL", "http://127.0.0.1:8081"),
        ledger: env("LEDGER_URL", "http://127.0.0.1:8082"),
        loyalty: env("LOYALTY_URL", "http://127.0.0.1:8083"),
        api_key,
        token: env("SERVICE_TOKEN", "local-dev-token"),
        tenant: tenant.clone(),
    };
    println!("== seed 003 story, tenant {tenant}");

    // Inventory owns receipts: 48 JKT-M arrive at WH-1.
    let response = demo
        .http
        .post(format!("{}/stock/receipts", demo.inventory))
        .bearer_auth(&demo.token)
        .header("X-Tenant-Id", tenant.as_str())
        .json(&json!({"receipt_id": "rcpt-1", "sku": "JKT-M", "location": "WH-1", "qty": 48}))
        .send()
        .await?;
    if !response.status().is_success() {
        bail!("receipt: {} {}", response.status(), response.text().await?);
    }
    println!("received 48 x JKT-M at WH-1");

    let order = demo
        .post(
            format!("{}/orders", demo.api),
            "order-1042",
            json!({"customer_id": "77", "checkout_id": "checkout-1042",
                   "lines": [{"sku": "JKT-M", "qty": 2, "unit_price": "40.00", "unit_cost": "22.00"}],
                   "shipping": "5.00", "tax": "8.00", "total": "93.00", "currency": "USD", "location": "WH-1"}),
        )
        .await?;
    let order_id = s(&order["order_id"]);
    println!(
        "order {order_id} placed: 2 x JKT-M at 40.00, shipping 5.00, tax 8.00, total {}",
        s(&order["total"])
    );
    demo.post(
        format!("{}/orders/{order_id}/payments", demo.api),
        "payment-9001",
        json!({"payment_id": "9001", "amount": "93.00", "method": "card"}),
    )
    .await?;
    println!("payment 9001 of 93.00 by card received");
    demo.post(
        format!("{}/orders/{order_id}/deliveries", demo.api),
        "delivery-311",
        json!({"delivery_id": "311", "lines": [{"sku": "JKT-M", "qty": 2}]}),
    )
    .await?;
    println!("parcel 311 delivered");

    // Wait for the three consumers.
    let deadline = Instant::now() + Duration::from_secs(60);
    let (stock, journal, loyalty) = loop {
        let stock = demo
            .read(format!("{}/stock/JKT-M?location=WH-1", demo.inventory))
            .await?;
        let journal = demo
            .read(format!("{}/journal?order_id={order_id}", demo.ledger))
            .await?;
        let loyalty = demo
            .read(format!("{}/customers/77/loyalty", demo.loyalty))
            .await?;
        let done = stock
            .as_ref()
            .is_some_and(|s| s["on_hand"] == 46 && s["reserved"] == 0)
            && journal
                .as_ref()
                .is_some_and(|j| j["entries"].as_array().is_some_and(|e| e.len() == 2))
            && loyalty.as_ref().is_some_and(|l| l["balance"] == 80);
        if done {
            break (
                stock.unwrap_or_default(),
                journal.unwrap_or_default(),
                loyalty.unwrap_or_default(),
            );
        }
        if Instant::now() > deadline {
            bail!("the consumers did not apply the story within 60 s: stock {stock:?} journal {journal:?} loyalty {loyalty:?}");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };

    println!("\n-- inventory: stock_movements (JKT-M @ WH-1)");
    println!("type       qty  on_hand  reserved  ref");
    for m in stock["movements"].as_array().into_iter().flatten() {
        println!(
            "{:<8} {:>5} {:>+8} {:>+9}  {}",
            s(&m["movement_type"]),
            s(&m["qty"]),
            m["on_hand_delta"].as_i64().unwrap_or_default(),
            m["reserved_delta"].as_i64().unwrap_or_default(),
            if m["order_id"].is_null() {
                format!("receipt {}", s(&m["receipt_id"]))
            } else {
                format!("order {}", s(&m["order_id"]))
            }
        );
    }
    println!(
        "level: on_hand {}, reserved {}, available {}",
        s(&stock["on_hand"]),
        s(&stock["reserved"]),
        s(&stock["available"])
    );

    println!("\n-- ledger: journal entries of the order");
    for entry in journal["entries"].as_array().into_iter().flatten() {
        println!(
            "{} ({}), event {}",
            s(&entry["event_type"]),
            s(&entry["description"]),
            s(&entry["event_id"])
        );
        for line in entry["lines"].as_array().into_iter().flatten() {
            let debit = s(&line["debit"]);
            let credit = s(&line["credit"]);
            if debit != "0.00" {
                println!("    Dr {:<22} {:>8}", s(&line["account"]), debit);
            } else {
                println!("        Cr {:<22} {:>8}", s(&line["account"]), credit);
            }
        }
        println!(
            "    debits {} = credits {}",
            s(&entry["total_debit"]),
            s(&entry["total_credit"])
        );
    }
    if let Some(Value::Object(tb)) = demo.read(format!("{}/trial-balance", demo.ledger)).await? {
        for c in tb
            .get("currencies")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            println!(
                "trial balance {}: debits {} credits {} balance {}",
                s(&c["currency"]),
                s(&c["total_debit"]),
                s(&c["total_credit"]),
                s(&c["balance"])
            );
        }
    }

    println!(
        "\n-- loyalty: customer 77, balance {}",
        s(&loyalty["balance"])
    );
    for e in loyalty["entries"].as_array().into_iter().flatten() {
        println!(
            "{:>+5} points  order {}  because {} {}",
            e["points"].as_i64().unwrap_or_default(),
            s(&e["order_id"]),
            s(&e["event_type"]),
            s(&e["event_id"])
        );
    }
    // The seed's rows, not only their totals: a wrong posting, movement or
    // award fails the demo (exit 1) after printing what it found.
    let postings: Vec<Posting> = journal["entries"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|e| {
            let lines = e["lines"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|l| (s(&l["account_code"]), s(&l["debit"]), s(&l["credit"])))
                .collect();
            (s(&e["event_type"]), lines)
        })
        .collect();
    let seed_postings: Vec<Posting> = [
        ("PaymentReceived", ops::seed::PAYMENT_JOURNAL),
        ("ParcelDelivered", ops::seed::DELIVERY_JOURNAL),
    ]
    .iter()
    .map(|(event, lines)| {
        let lines = lines
            .iter()
            .map(|(account, debit, credit)| {
                (
                    (*account).to_owned(),
                    events::format_total(i128::from(*debit)),
                    events::format_total(i128::from(*credit)),
                )
            })
            .collect();
        ((*event).to_owned(), lines)
    })
    .collect();
    if postings != seed_postings {
        bail!("the journal differs from seed 003's: {postings:?}, expected {seed_postings:?}");
    }
    let movements: Vec<(String, i64, i64, i64)> = stock["movements"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|m| {
            (
                s(&m["movement_type"]),
                m["qty"].as_i64().unwrap_or_default(),
                m["on_hand_delta"].as_i64().unwrap_or_default(),
                m["reserved_delta"].as_i64().unwrap_or_default(),
            )
        })
        .collect();
    let seed_movements: Vec<(String, i64, i64, i64)> = ops::seed::MOVEMENTS
        .iter()
        .map(|(kind, qty, on_hand, reserved)| ((*kind).to_owned(), *qty, *on_hand, *reserved))
        .collect();
    if movements != seed_movements {
        bail!("the stock movements differ from seed 003's: {movements:?}, expected {seed_movements:?}");
    }
    let level = (&stock["on_hand"], &stock["reserved"], &stock["available"]);
    if level != (&json!(46), &json!(0), &json!(46)) {
        bail!("stock level {level:?} instead of seed 003's on hand 46, reserved 0, available 46");
    }
    let awards: Vec<(i64, String, String)> = loyalty["entries"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|e| {
            (
                e["points"].as_i64().unwrap_or_default(),
                s(&e["order_id"]),
                s(&e["event_type"]),
            )
        })
        .collect();
    let seed_award = vec![(80, order_id.clone(), "ParcelDelivered".to_owned())];
    if awards != seed_award || loyalty["balance"] != 80 {
        bail!(
            "loyalty differs from seed 003's (80 points for the delivered order): balance {}, entries {awards:?}",
            loyalty["balance"]
        );
    }
    println!("\n== story complete (tenant {tenant}): the seed's rows; `make drift DRIFT_GRACE=0` checks all four databases now (by default it skips orders changed in the last minute as in flight)");
    Ok(())
}
