//! The foundation against the real infrastructure: all four databases migrate,
//! the order-events exchange is declared as agreed, a routed confirmed
//! publish is confirmed (and an unroutable mandatory one is not), and every
//! service binary starts with no configuration but its port, serves
//! /healthz, /readyz and /metrics, and stops cleanly on SIGTERM.

use std::time::Duration;

use futures_util::StreamExt;
use kit::amqp::{check_confirmation, lapin, PublishRejected};
use lapin::{
    options::{
        BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions, QueueBindOptions,
        QueueDeclareOptions,
    },
    types::FieldTable,
    BasicProperties,
};
use system_tests::{amqp_url, free_port, pg, pg_url, pool, wait_for_ok, Database, Service};
use tokio_postgres::error::SqlState;

async fn tables(db: Database) -> Vec<String> {
    pg(db)
        .await
        .query(
            "SELECT table_name::text FROM information_schema.tables \
             WHERE table_schema = 'public' ORDER BY 1",
            &[],
        )
        .await
        .expect("list tables")
        .iter()
        .map(|row| row.get(0))
        .collect()
}

#[tokio::test]
async fn all_four_databases_are_migrated_and_migrations_are_idempotent() {
    for db in Database::ALL {
        // Twice, concurrently, on a new database (the shared ones are
        // migrated already, where both runs would apply nothing whether or
        // not they were serialised): the advisory lock serialises them, so
        // one applies every migration and the other nothing, without a
        // collision on a table or the history.
        let (fresh, url) = system_tests::create_database(db).await;
        let fresh_pool = system_tests::pool_of_url(db, &url);
        let (a, b) = tokio::join!(
            kit::migrations::run(&fresh_pool, db),
            kit::migrations::run(&fresh_pool, db)
        );
        let (a, b) = (a.expect("migrate"), b.expect("migrate"));
        let (all, none) = if a.is_empty() { (b, a) } else { (a, b) };
        assert!(
            none.is_empty(),
            "{}: both runs applied {all:?} / {none:?}",
            db.name()
        );
        let history = match db {
            Database::Orders => "SELECT count(*) FROM refinery_schema_history",
            _ => {
                "SELECT (SELECT count(*) FROM refinery_schema_history) \
                 + (SELECT count(*) FROM consumer_runtime_schema_history)"
            }
        };
        let recorded: i64 = fresh_pool
            .get()
            .await
            .expect("connection")
            .query_one(history, &[])
            .await
            .expect("history")
            .get(0);
        assert_eq!(recorded, all.len() as i64, "{}: {all:?}", db.name());
        assert!(all.len() >= 4, "{}: {all:?}", db.name());
        assert!(kit::migrations::run(&fresh_pool, db)
            .await
            .expect("migrate")
            .is_empty());
        drop(fresh_pool);
        system_tests::drop_database(db, &fresh).await;

        // The shared database: migrated, and a run applies nothing.
        let pool = pool(db);
        kit::migrations::run(&pool, db).await.expect("migrate");
        assert!(kit::migrations::run(&pool, db)
            .await
            .expect("migrate")
            .is_empty());

        let tables = tables(db).await;
        let expected: &[&str] = match db {
            Database::Orders => &[
                "api_keys",
                "deliveries",
                "idempotency_requests",
                "order_lines",
                "orders",
                "outbox_events",
                "payments",
                "tenants",
            ],
            _ => &["order_progress", "processed_events"],
        };
        for table in expected {
            assert!(
                tables.iter().any(|t| t == table),
                "{}: table {table} missing (has {tables:?})",
                db.name()
            );
        }
        // Indexes the contract steps dropped (nothing reads them; every
        // insert paid for them): ledger V6, loyalty V4.
        let dropped = match db {
            Database::Ledger => Some("journal_entries_tenant_posted_idx"),
            Database::Loyalty => Some("loyalty_entries_customer_idx"),
            _ => None,
        };
        if let Some(index) = dropped {
            let present: bool = pg(db)
                .await
                .query_one("SELECT to_regclass('public.' || $1) IS NOT NULL", &[&index])
                .await
                .expect("to_regclass")
                .get(0);
            assert!(!present, "{}: {index} still there", db.name());
        }
        // The queue-like tables are vacuumed as queues (orders V4, runtime V4).
        let queue = match db {
            Database::Orders => "outbox_events",
            _ => "processed_events",
        };
        let options: Vec<String> = pg(db)
            .await
            .query_one(
                "SELECT reloptions FROM pg_class \
                 WHERE relname = $1 AND relnamespace = 'public'::regnamespace",
                &[&queue],
            )
            .await
            .expect("reloptions")
            .get(0);
        for option in [
            "autovacuum_vacuum_scale_factor=0.01",
            "autovacuum_vacuum_threshold=5000",
        ] {
            assert!(options.iter().any(|o| o == option), "{queue}: {options:?}");
        }
    }
}

/// An older binary starting on a database a newer release migrated (a
/// rolling deploy, a rollback) starts, says so at INFO, and logs no ERROR
/// (refinery's "missing from the filesystem" line for each newer migration
/// is left out): on a database of its own, migrated, then given one more
/// applied migration in its history.
#[tokio::test]
async fn an_older_binary_starts_on_a_newer_schema_without_error_lines() {
    let admin = pg(Database::Orders).await;
    let name = format!("newer_{}", uuid::Uuid::now_v7().simple());
    admin
        .batch_execute(&format!("CREATE DATABASE {name}"))
        .await
        .expect("create the database");
    let orders = system_tests::pg_url(Database::Orders);
    let (base, query) = orders.split_once('?').unwrap_or((orders.as_str(), ""));
    let (server, _) = base.rsplit_once('/').expect("a database in the URL");
    let url = format!("{server}/{name}?{query}");
    let migrate = || async {
        let output = system_tests::output_within(
            tokio::process::Command::new(system_tests::bin("outbox-relay"))
                .arg("migrate")
                .env("OUTBOX_RELAY__DATABASE__URL", &url)
                .env_remove("RUST_LOG")
                .env("NO_COLOR", "1"),
        )
        .await
        .expect("run outbox-relay migrate");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        assert!(output.status.success(), "{text}");
        text
    };
    migrate().await;
    let (client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .expect("connect");
    tokio::spawn(connection);
    client
        .execute(
            "INSERT INTO refinery_schema_history (version, name, applied_on, checksum) \
             VALUES (9999, 'from_a_newer_release', '2026-12-07T00:00:00Z', '1')",
            &[],
        )
        .await
        .expect("a newer migration applied");
    drop(client);
    let output = migrate().await;
    assert!(
        output.contains("orders: 0 migration(s) applied"),
        "{output}"
    );
    assert!(
        output.contains("holds migrations newer than this binary's"),
        "{output}"
    );
    assert!(!output.contains("ERROR"), "{output}");
    admin
        .batch_execute(&format!("DROP DATABASE {name} WITH (FORCE)"))
        .await
        .expect("drop the database");
}

/// A migration's DDL waiting on an autovacuum's lock gets it: the server
/// cancels the autovacuum when `deadlock_timeout` runs out, before the
/// migration's lock timeout (`kit::migrations::bound_ddl_lock_waits`). With
/// both at 1 s the lock timeout came first and the cancel was never sent:
/// every attempt failed for as long as the vacuum ran (a large table's,
/// throttled), and the start-up after them. On a database of its own,
/// whose table's autovacuum is throttled to a crawl.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migration_s_ddl_cancels_an_autovacuum_in_its_way() {
    let (database, url) = system_tests::create_database(Database::Orders).await;
    let client = system_tests::connect_url(&url).await;
    client
        .batch_execute(
            "CREATE TABLE crawl (id int, pad text) WITH ( \
                 autovacuum_vacuum_cost_delay = 100, autovacuum_vacuum_cost_limit = 1, \
                 autovacuum_vacuum_threshold = 0, autovacuum_vacuum_scale_factor = 0, \
                 autovacuum_analyze_threshold = 1000000000); \
             INSERT INTO crawl SELECT g, repeat('x', 100) FROM generate_series(1, 50000) g; \
             DELETE FROM crawl",
        )
        .await
        .expect("a table for autovacuum");
    // The launcher visits each database every autovacuum_naptime (10 s
    // here: infra-up.sh), shared between the databases.
    system_tests::consumers::eventually(
        "autovacuum on the table",
        Duration::from_secs(120),
        || async {
            client
                .query_opt(
                    "SELECT 1 FROM pg_stat_progress_vacuum WHERE relid = 'crawl'::regclass",
                    &[],
                )
                .await
                .expect("pg_stat_progress_vacuum")
                .map(|_| ())
        },
    )
    .await;
    kit::migrations::bound_ddl_lock_waits(&client)
        .await
        .expect("lock timeout");
    client
        .batch_execute("ALTER TABLE crawl ADD COLUMN added int")
        .await
        .expect("the DDL gets its lock: the autovacuum is cancelled");
    drop(client);
    system_tests::drop_database(Database::Orders, &database).await;
}

/// An operator command's session (`kit::db::pool`: migrate, requeue,
/// replay, redrive) ends a transaction left idle for 60 s (suspended, or its
/// network lost between a write and its COMMIT: its row locks released);
/// its statements are not bounded (a replay's page over a long history).
#[tokio::test]
async fn an_operator_command_s_session_cannot_hold_a_transaction_open() {
    let client = pool(Database::Orders).get().await.expect("connection");
    let row = client
        .query_one(
            "SELECT current_setting('idle_in_transaction_session_timeout'), \
                    current_setting('statement_timeout')",
            &[],
        )
        .await
        .expect("settings");
    assert_eq!(
        (row.get::<_, String>(0), row.get::<_, String>(1)),
        ("1min".to_owned(), "0".to_owned())
    );
}

/// Every session the services open asks the server to probe its client
/// (TCP keepalive after 15 s idle, 3 probes 5 s apart): a session whose
/// host vanished between statements ends within about 30 s, with the
/// session-level advisory lock it may hold (the relay's cleanup run, a
/// redrive), not after the kernel's two hours of every other instance
/// locked out. Pools (a service's and an operator command's) and the
/// sessions opened outside a pool (`bound_session`, `bound_command_session`).
#[tokio::test]
async fn every_session_asks_the_server_to_probe_its_client() {
    let keepalives = "SELECT current_setting('tcp_keepalives_idle'), \
                      current_setting('tcp_keepalives_interval'), \
                      current_setting('tcp_keepalives_count')";
    let expected = ("15".to_owned(), "5".to_owned(), "3".to_owned());
    let of = |row: tokio_postgres::Row| {
        (
            row.get::<_, String>(0),
            row.get::<_, String>(1),
            row.get::<_, String>(2),
        )
    };
    // Over TCP: on a Unix socket the server has no keepalive to set.
    assert!(pg_url(Database::Orders).contains("127.0.0.1"));
    let command = pool(Database::Orders).get().await.expect("connection");
    let row = command.query_one(keepalives, &[]).await.expect("settings");
    assert_eq!(of(row), expected, "an operator command's pool");
    let mut settings = kit::settings::DatabaseSettings::local(Database::Orders.name());
    settings.url = pg_url(Database::Orders);
    let service =
        kit::db::pool_with_options(&settings, Some(kit::db::SESSION_LIMITS)).expect("pool");
    let service = service.get().await.expect("connection");
    let row = service.query_one(keepalives, &[]).await.expect("settings");
    assert_eq!(of(row), expected, "a service's pool");
    for bound in [kit::db::bound_session, kit::db::bound_command_session] {
        let mut config: tokio_postgres::Config = pg_url(Database::Orders).parse().expect("url");
        bound(&mut config);
        let (client, connection) = kit::db::connect_with(&config).await.expect("connect");
        let driver = tokio::spawn(connection);
        let row = client.query_one(keepalives, &[]).await.expect("settings");
        assert_eq!(of(row), expected, "a session of its own");
        drop(client);
        let _ = driver.await;
    }
}

#[tokio::test]
async fn outbox_rows_enforce_the_seed_000_contract() {
    let mut client = pg(Database::Orders).await;
    kit::migrations::run(&pool(Database::Orders), Database::Orders)
        .await
        .expect("migrate");
    // In a transaction rolled back at the end: no relay (the zero-config one
    // of this binary has no tenant filter) ever sees, publishes or marks
    // the row while the test counts it.
    let mut tx = client.transaction().await.expect("begin");
    let aggregate = uuid::Uuid::now_v7().to_string();
    let insert = "INSERT INTO outbox_events (event_id, tenant_id, aggregate_type, aggregate_id, \
                  aggregate_sequence, event_type, schema_version, payload) \
                  VALUES ($1, 'acme', 'order', $2, $3, 'OrderPlaced', 1, '{}')";
    tx.execute(insert, &[&uuid::Uuid::now_v7(), &aggregate, &1_i64])
        .await
        .expect("first event");
    // Two events cannot take the same logical position of one order.
    let savepoint = tx.savepoint("duplicate").await.expect("savepoint");
    let duplicate = savepoint
        .execute(insert, &[&uuid::Uuid::now_v7(), &aggregate, &1_i64])
        .await
        .expect_err("same aggregate_sequence twice must be rejected");
    assert_eq!(
        duplicate.code(),
        Some(&tokio_postgres::error::SqlState::UNIQUE_VIOLATION)
    );
    savepoint.rollback().await.expect("rollback to savepoint");
    let pending: i64 = tx
        .query_one(
            "SELECT count(*) FROM outbox_events WHERE aggregate_id = $1 AND published_at IS NULL",
            &[&aggregate],
        )
        .await
        .expect("count")
        .get(0);
    assert_eq!(pending, 1);
    tx.rollback().await.expect("rollback");
}

/// orders V11: ANALYZE of the outbox (frequent: it is a queue) computes no
/// statistics of the columns no query filters on (the payload's were most
/// of its cost: a sort of 30,000 jsonb documents); every other column keeps
/// the default target.
#[tokio::test]
async fn the_outbox_keeps_no_statistics_of_its_payload() {
    let client = pg(Database::Orders).await;
    // NULL is the default target from PostgreSQL 17 on (-1 before).
    let targets: Vec<(String, i32)> = client
        .query(
            "SELECT attname::text, COALESCE(attstattarget, -1)::int FROM pg_attribute \
             WHERE attrelid = 'public.outbox_events'::regclass AND attnum > 0 \
               AND NOT attisdropped ORDER BY attnum",
            &[],
        )
        .await
        .expect("pg_attribute")
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let none = ["payload", "traceparent", "tracestate", "last_error"];
    for (column, target) in &targets {
        let expected = if none.contains(&column.as_str()) {
            0
        } else {
            -1
        };
        assert_eq!(*target, expected, "{column}: {targets:?}");
    }
    assert_eq!(targets.len(), 20, "{targets:?}");
}

/// The runbook's replacement of a quarantined row that could not be encoded
/// (deploy/README.md, "OutboxEventsQuarantined"), run as written there: the
/// corrective event takes the row's position, its `occurred_at` (the
/// ledger's effective date; a replay's `--since`) and trace context, and
/// commits (V14). A row that may not be replaced (it was sent) changes
/// nothing. On a database of its own: no relay sees the rows.
#[tokio::test]
async fn the_runbook_s_replacement_keeps_the_event_s_position_time_and_trace() {
    let runbook =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/README.md"))
            .expect("the runbook");
    let (_, after) = runbook
        .split_once("The replacement (for a row that could not be encoded")
        .expect("the replacement's paragraph");
    let (_, block) = after.split_once("```sql\n").expect("its SQL");
    let (sql, _) = block.split_once("```").expect("its end");
    let (database, url) = system_tests::create_database(Database::Orders).await;
    kit::migrations::run(
        &system_tests::pool_of_url(Database::Orders, &url),
        Database::Orders,
    )
    .await
    .expect("migrate");
    let client = system_tests::connect_url(&url).await;
    let order = uuid::Uuid::now_v7().to_string();
    let row = |event_id: uuid::Uuid, set: &'static str| {
        let (client, order) = (&client, order.clone());
        async move {
            client
                .execute(
                    "INSERT INTO outbox_events (event_id, tenant_id, aggregate_type, aggregate_id, \
                     aggregate_sequence, event_type, schema_version, payload, occurred_at, \
                     traceparent, tracestate) \
                     VALUES ($1, 'acme', 'order', $2, 2, 'PaymentReceived', 1, '{}', \
                             timestamptz '2026-11-02 10:00:00.123456Z', \
                             '00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01', 'acme=1')",
                    &[&event_id, &order],
                )
                .await
                .expect("the row");
            client
                .execute(
                    &format!("UPDATE outbox_events SET {set} WHERE event_id = $1"),
                    &[&event_id],
                )
                .await
                .expect("its state");
        }
    };
    let replace = |event_id: uuid::Uuid| {
        sql.replace("'<event_id>'", &format!("'{event_id}'"))
            .replace("'<event type>'", "'PaymentReceived'")
            .replace("<version>", "1")
            .replace("'<corrected payload>'", "'{\"corrected\": true}'")
    };
    let outbox = || async {
        client
            .query(
                "SELECT event_id, aggregate_sequence, payload::text, occurred_at::text, \
                        traceparent, tracestate, published_at IS NULL AND quarantined_at IS NULL \
                 FROM outbox_events WHERE aggregate_id = $1",
                &[&order],
            )
            .await
            .expect("outbox")
            .iter()
            .map(|r| {
                (
                    r.get::<_, uuid::Uuid>(0),
                    r.get::<_, i64>(1),
                    r.get::<_, String>(2),
                    r.get::<_, String>(3),
                    r.get::<_, String>(4),
                    r.get::<_, String>(5),
                    r.get::<_, bool>(6),
                )
            })
            .collect::<Vec<_>>()
    };
    client
        .batch_execute("SET TIME ZONE 'UTC'")
        .await
        .expect("time zone");
    // Sent once (unroutable): not replaced, nothing changes.
    let sent = uuid::Uuid::now_v7();
    row(
        sent,
        "attempt_count = 5, own_failure_count = 5, quarantined_at = now(), \
               last_error = 'unroutable: returned by the broker (312 NO_ROUTE)'",
    )
    .await;
    let before = outbox().await;
    client
        .batch_execute(&replace(sent))
        .await
        .expect("the runbook's statement");
    assert_eq!(outbox().await, before);
    client
        .batch_execute(
            "BEGIN; SET LOCAL outbox.allow_unpublished_delete = on; \
             DELETE FROM outbox_events; COMMIT",
        )
        .await
        .expect("clear");
    // Never sendable: replaced.
    let never_sent = uuid::Uuid::now_v7();
    row(
        never_sent,
        "attempt_count = 5, own_failure_count = 5, quarantined_at = now(), \
                     last_error = 'not sendable: the event type is 256 bytes long'",
    )
    .await;
    client
        .batch_execute(&replace(never_sent))
        .await
        .expect("the runbook's statement");
    let after = outbox().await;
    assert_eq!(after.len(), 1, "{after:?}");
    let (event_id, sequence, payload, occurred_at, traceparent, tracestate, pending) =
        after[0].clone();
    assert_ne!(event_id, never_sent, "a new event id");
    assert_eq!(
        (
            sequence,
            payload.as_str(),
            occurred_at.as_str(),
            traceparent.as_str(),
            tracestate.as_str(),
            pending
        ),
        (
            2,
            r#"{"corrected": true}"#,
            "2026-11-02 10:00:00.123456+00",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "acme=1",
            true
        )
    );
    drop(client);
    system_tests::drop_database(Database::Orders, &database).await;
}

/// The runbook's ledger V5 by hand (deploy/README.md, "Ledger V5 and
/// loyalty V3 by hand"), run as written there on a ledger database at V4:
/// the release then starts past it (V5 not run again: its `ADD COLUMN`
/// would fail on the column), and the column, its default and the index are
/// those of a database the release migrated itself; the concurrent build
/// waits out an older transaction longer than the `ALTER`s' lock bound. On
/// a database of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ledger_v5_applied_by_hand_is_skipped_by_the_release() {
    let file = |path: &str| {
        std::fs::read_to_string(format!("{}/../{path}", env!("CARGO_MANIFEST_DIR")))
            .unwrap_or_else(|e| panic!("{path}: {e}"))
    };
    let runbook = file("deploy/README.md");
    let (_, after) = runbook
        .split_once("### Ledger V5 and loyalty V3 by hand")
        .expect("the runbook's section");
    let (_, block) = after.split_once("```sql\n").expect("its SQL");
    let (sql, _) = block.split_once("```").expect("its end");
    let (database, url) = system_tests::create_database(Database::Ledger).await;
    let client = system_tests::connect_url(&url).await;
    // At V4, as an earlier release left it.
    migrated_by_hand(&client, "ledger", 4).await;
    // A transaction older than the build, open for 5 s (a drift check's
    // snapshot, say): the concurrent build waits for it, past the 2 s the
    // `ALTER`s are bounded by (the runbook resets the bound before it).
    let mut holder = system_tests::connect_url(&url).await;
    let (taken, snapshot_taken) = tokio::sync::oneshot::channel();
    let held = tokio::spawn(async move {
        let snapshot = holder.transaction().await.expect("begin");
        snapshot
            .batch_execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ; SELECT 1")
            .await
            .expect("a snapshot");
        let _ = taken.send(());
        tokio::time::sleep(Duration::from_secs(5)).await;
        snapshot.commit().await.expect("commit");
    });
    snapshot_taken.await.expect("the older snapshot");
    for statement in sql.split(";\n").map(str::trim).filter(|s| !s.is_empty()) {
        if statement.starts_with("CREATE INDEX CONCURRENTLY") {
            let started = std::time::Instant::now();
            client.batch_execute(statement).await.expect(statement);
            assert!(
                started.elapsed() >= Duration::from_secs(2),
                "the build waited for the older transaction, past 2 s: {:?}",
                started.elapsed()
            );
        } else if statement.starts_with("SELECT indisvalid") {
            let valid: bool = client
                .query_one(statement, &[])
                .await
                .expect(statement)
                .get(0);
            assert!(valid, "the index built by hand is valid");
        } else {
            client.batch_execute(statement).await.expect(statement);
        }
    }
    held.await.expect("the older transaction");
    let applied = kit::migrations::run(
        &system_tests::pool_of_url(Database::Ledger, &url),
        Database::Ledger,
    )
    .await
    .expect("the release migrates past the V5 applied by hand");
    let ledger: Vec<&String> = applied.iter().filter(|m| m.contains("journal")).collect();
    assert_eq!(
        ledger,
        [
            "V6__drop_journal_by_tenant_and_time",
            "V7__journal_lines_only_with_their_entry_by_written_by"
        ],
        "{applied:?}"
    );
    let shape = "SELECT pg_get_indexdef('journal_entries_tenant_written_idx'::regclass), \
                 (SELECT pg_get_expr(adbin, adrelid) FROM pg_attrdef d JOIN pg_attribute a \
                    ON a.attrelid = d.adrelid AND a.attnum = d.adnum \
                  WHERE d.adrelid = 'journal_entries'::regclass AND a.attname = 'written_by')";
    let of = |row: tokio_postgres::Row| (row.get::<_, String>(0), row.get::<_, String>(1));
    let by_hand = of(client.query_one(shape, &[]).await.expect("by hand"));
    let released = of(pg(Database::Ledger)
        .await
        .query_one(shape, &[])
        .await
        .expect("as released"));
    assert_eq!(by_hand, released);
    drop(client);
    system_tests::drop_database(Database::Ledger, &database).await;
}

/// Apply the migrations of set `set` (its directory under migrations/) up
/// to version `upto` on `client`'s database by hand, each with the history
/// row refinery would write (checksums from migrations/CHECKSUMS): the
/// database as a release that stopped there left it.
async fn migrated_by_hand(client: &tokio_postgres::Client, set: &str, upto: u32) {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
    let checksums = std::fs::read_to_string(format!("{root}/migrations/CHECKSUMS"))
        .expect("migrations/CHECKSUMS");
    client
        .batch_execute(
            "CREATE TABLE refinery_schema_history (version int4 PRIMARY KEY, \
             name VARCHAR(255), applied_on VARCHAR(255), checksum VARCHAR(255))",
        )
        .await
        .expect("history");
    for line in checksums
        .lines()
        .filter(|l| l.starts_with(&format!("{set} V")))
    {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let [_, version, name, hex] = fields[..] else {
            panic!("a CHECKSUMS line: {line}")
        };
        let version: i32 = version[1..].parse().expect("a version");
        if version > i32::try_from(upto).expect("a version") {
            continue;
        }
        let path = format!("{root}/migrations/{set}/V{version}__{name}.sql");
        let sql = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        client
            .batch_execute(&format!("BEGIN; {sql}; COMMIT"))
            .await
            .unwrap_or_else(|e| panic!("{set} V{version}: {e}"));
        let checksum = u64::from_str_radix(hex, 16).expect("hexadecimal");
        client
            .execute(
                "INSERT INTO refinery_schema_history VALUES ($1, $2, '2026-12-01T00:00:00Z', $3)",
                &[&version, &name, &checksum.to_string()],
            )
            .await
            .expect("history row");
    }
}

/// A migration that deadlocks with a live transaction is rolled back and
/// tried again by `kit::migrations::run` (as one that waited out its lock
/// timeout), not a failed start-up: orders V19, pending on a database at
/// V18, takes `orders` and waits for `tenants`, which a transaction holds
/// that then writes an order (the order of a tenant created in the same
/// transaction: the cycle). The server fails V19 (the transaction's
/// deadlock check waits longer); the transaction commits; the next try
/// applies V19. On a database of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migration_that_deadlocks_is_tried_again() {
    let (database, url) = system_tests::create_database(Database::Orders).await;
    let mut client = system_tests::connect_url(&url).await;
    migrated_by_hand(&client, "orders", 18).await;
    let deadlocks = "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()";
    let before: i64 = client
        .query_one(deadlocks, &[])
        .await
        .expect("deadlocks")
        .get(0);
    let tx = client.transaction().await.expect("begin");
    tx.batch_execute(
        "SET LOCAL deadlock_timeout = '20s'; INSERT INTO tenants (tenant_id) VALUES ('acme')",
    )
    .await
    .expect("a tenant");
    // The migration's session checks for a deadlock 5 s into a wait (its
    // lock bound follows: 5.5 s), time enough for the transaction's order
    // below on a slow machine.
    let separator = if url.contains('?') { '&' } else { '?' };
    let pool = system_tests::pool_of_url(
        Database::Orders,
        &format!("{url}{separator}options=-c%20deadlock_timeout%3D5s"),
    );
    let migration =
        tokio::spawn(async move { kit::migrations::run(&pool, Database::Orders).await });
    // V19 holds `orders` and waits for `tenants`.
    let observer = system_tests::connect_url(&url).await;
    system_tests::consumers::eventually(
        "V19 waiting for tenants",
        Duration::from_secs(30),
        || async {
            observer
                .query_opt(
                    "SELECT 1 FROM pg_locks WHERE relation = 'tenants'::regclass \
                   AND mode = 'AccessExclusiveLock' AND NOT granted",
                    &[],
                )
                .await
                .expect("pg_locks")
                .map(|_| ())
        },
    )
    .await;
    tx.execute(
        "INSERT INTO orders (order_id, tenant_id, customer_id, currency, location, \
         merchandise_minor, shipping_minor, tax_minor, total_minor, last_event_sequence) \
         VALUES ($1, 'acme', '77', 'USD', 'WH-1', 8000, 500, 800, 9300, 1)",
        &[&uuid::Uuid::now_v7()],
    )
    .await
    .expect("the order, once V19 gave way");
    tx.commit().await.expect("commit");
    let applied = migration
        .await
        .expect("the migration's task")
        .expect("V19 applied at a later try");
    assert_eq!(
        applied.iter().filter(|m| m.starts_with("V19__")).count(),
        1,
        "{applied:?}"
    );
    // Counted once the migration's session reports its statistics (within
    // about a second of going idle).
    let broken = system_tests::consumers::eventually(
        "the deadlock counted",
        Duration::from_secs(30),
        || async {
            let after: i64 = observer
                .query_one(deadlocks, &[])
                .await
                .expect("deadlocks")
                .get(0);
            (after > before).then_some(after - before)
        },
    )
    .await;
    assert_eq!(broken, 1, "the server broke one deadlock");
    drop((client, observer));
    system_tests::drop_database(Database::Orders, &database).await;
}

/// A new outbox row of tenant acme, then `SET <set>` on it (none if empty).
async fn outbox_row(tx: &tokio_postgres::Transaction<'_>, set: &str) -> uuid::Uuid {
    let event_id = uuid::Uuid::now_v7();
    tx.execute(
        "INSERT INTO outbox_events (event_id, tenant_id, aggregate_type, aggregate_id, \
         aggregate_sequence, event_type, schema_version, payload) \
         VALUES ($1, 'acme', 'order', $2, 1, 'OrderPlaced', 1, '{}')",
        &[&event_id, &uuid::Uuid::now_v7().to_string()],
    )
    .await
    .expect("insert");
    if !set.is_empty() {
        tx.execute(
            &format!("UPDATE outbox_events SET {set} WHERE event_id = $1"),
            &[&event_id],
        )
        .await
        .expect(set);
    }
    event_id
}

/// A committed intent is never lost to a DELETE (orders V13, V14): an
/// unpublished row refuses one, quarantined or not, and fails the whole
/// statement, unless it is the runbook's replacement of a row that never
/// reached the broker (quarantined, every attempt its own `not sendable: `
/// failure; a row must hold its position again at commit) or the session
/// lifts the guard (`outbox.allow_unpublished_delete`, the tests' clean-up).
/// Published rows are the cleanup's to delete.
#[tokio::test]
async fn unpublished_outbox_rows_refuse_a_delete_but_the_runbook_s_replacement() {
    let mut client = pg(Database::Orders).await;
    // Rolled back at the end: no relay ever sees the rows.
    let mut tx = client.transaction().await.expect("begin");
    let refused = [
        "",
        "attempt_count = 5, own_failure_count = 5, quarantined_at = now(), \
         last_error = 'unroutable: returned by the broker (312 NO_ROUTE)'",
        "attempt_count = 6, own_failure_count = 5, quarantined_at = now(), \
         last_error = 'not sendable: the event type is 256 bytes long'",
        "attempt_count = 5, own_failure_count = 5, \
         last_error = 'not sendable: the event type is 256 bytes long'",
    ];
    for set in refused {
        let event_id = outbox_row(&tx, set).await;
        let savepoint = tx.savepoint("delete").await.expect("savepoint");
        let error = savepoint
            .execute(
                "DELETE FROM outbox_events WHERE event_id = $1",
                &[&event_id],
            )
            .await
            .expect_err(set);
        let db_error = error.as_db_error().expect("a database error");
        assert_eq!(db_error.code(), &SqlState::RESTRICT_VIOLATION, "{set}");
        assert_eq!(
            db_error.message(),
            format!(
                "outbox_events: row {event_id} is unpublished, a committed intent: it cannot \
                 be deleted"
            )
        );
        savepoint.rollback().await.expect("rollback to savepoint");
    }
    // One DELETE over a published and a pending row fails as a whole.
    let published = outbox_row(&tx, "published_at = now()").await;
    let pending = outbox_row(&tx, "").await;
    let both = vec![published, pending];
    let savepoint = tx.savepoint("mixed").await.expect("savepoint");
    let error = savepoint
        .execute(
            "DELETE FROM outbox_events WHERE event_id = ANY($1)",
            &[&both],
        )
        .await
        .expect_err("one pending row fails the statement");
    assert_eq!(error.code(), Some(&SqlState::RESTRICT_VIOLATION));
    savepoint.rollback().await.expect("rollback to savepoint");
    let left: i64 = tx
        .query_one(
            "SELECT count(*) FROM outbox_events WHERE event_id = ANY($1)",
            &[&both],
        )
        .await
        .expect("count")
        .get(0);
    assert_eq!(left, 2, "nothing deleted");

    // The runbook's replacement of a row that never reached the broker: the
    // DELETE passes, and at commit (V14; forced here by SET CONSTRAINTS
    // IMMEDIATE) a row must hold its position again.
    let never_sent = "attempt_count = 5, own_failure_count = 5, quarantined_at = now(), \
                      last_error = 'not sendable: the event type is 256 bytes long'";
    for replaced in [true, false] {
        let event_id = outbox_row(&tx, never_sent).await;
        let savepoint = tx.savepoint("replace").await.expect("savepoint");
        let aggregate: String = savepoint
            .query_one(
                "DELETE FROM outbox_events WHERE event_id = $1 RETURNING aggregate_id",
                &[&event_id],
            )
            .await
            .expect("the never-sent row may be deleted")
            .get(0);
        if replaced {
            savepoint
                .execute(
                    "INSERT INTO outbox_events (event_id, tenant_id, aggregate_type, \
                     aggregate_id, aggregate_sequence, event_type, schema_version, payload) \
                     VALUES ($1, 'acme', 'order', $2, 1, 'OrderPlaced', 1, '{}')",
                    &[&uuid::Uuid::now_v7(), &aggregate],
                )
                .await
                .expect("the corrective event");
        }
        let checked = savepoint
            .batch_execute("SET CONSTRAINTS outbox_events_replaced IMMEDIATE")
            .await;
        if replaced {
            checked.expect("replaced at its position");
        } else {
            let error = checked.expect_err("a bare DELETE fails at commit");
            let db_error = error.as_db_error().expect("a database error");
            assert_eq!(db_error.code(), &SqlState::RESTRICT_VIOLATION);
            assert_eq!(
                db_error.message(),
                format!(
                    "outbox_events: row {event_id} was deleted without a replacement at its \
                     position (order {aggregate}, sequence 1)"
                )
            );
        }
        savepoint.rollback().await.expect("rollback to savepoint");
        tx.batch_execute("SET CONSTRAINTS outbox_events_replaced DEFERRED")
            .await
            .expect("deferred again");
    }

    let deleted = |event_id: uuid::Uuid| {
        let tx = &tx;
        async move {
            tx.execute(
                "DELETE FROM outbox_events WHERE event_id = $1",
                &[&event_id],
            )
            .await
            .expect("deleted")
        }
    };
    assert_eq!(deleted(published).await, 1, "the cleanup's");
    tx.batch_execute("SET LOCAL outbox.allow_unpublished_delete = on")
        .await
        .expect("lift the guard");
    assert_eq!(deleted(pending).await, 1, "a session that lifts the guard");
    tx.batch_execute("SET CONSTRAINTS outbox_events_replaced IMMEDIATE")
        .await
        .expect("no replacement needed with the guard lifted");
    tx.rollback().await.expect("rollback");
}

/// Seed 000: the outbox row is immutable (migrations V8, V12). Every content
/// column refuses an UPDATE naming it, even one writing the same value; the
/// relay's columns (lease, mark, failures, quarantine) stay writable, and a
/// row may be deleted (cleanup). The check runs AFTER the update: a BEFORE
/// ROW trigger makes PostgreSQL lock every updated row first, a WAL record
/// per mark (V12).
#[tokio::test]
async fn outbox_rows_are_immutable_but_the_relays_columns_are_not() {
    let mut client = pg(Database::Orders).await;
    let triggers: Vec<String> = client
        .query(
            "SELECT pg_get_triggerdef(oid) FROM pg_trigger \
             WHERE tgrelid = 'public.outbox_events'::regclass AND NOT tgisinternal \
             ORDER BY tgname",
            &[],
        )
        .await
        .expect("pg_trigger")
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(
        triggers,
        [
            "CREATE TRIGGER outbox_events_immutable AFTER UPDATE OF event_id, tenant_id, \
             aggregate_type, aggregate_id, aggregate_sequence, event_type, schema_version, \
             payload, occurred_at, traceparent, tracestate ON public.outbox_events FOR EACH ROW \
             EXECUTE FUNCTION outbox_events_immutable()",
            "CREATE TRIGGER outbox_events_keep_unpublished AFTER DELETE ON public.outbox_events \
             FOR EACH ROW WHEN ((old.published_at IS NULL)) \
             EXECUTE FUNCTION outbox_events_keep_unpublished()",
            "CREATE TRIGGER outbox_events_no_truncate BEFORE TRUNCATE ON public.outbox_events \
             FOR EACH STATEMENT EXECUTE FUNCTION outbox_events_no_truncate()",
            "CREATE TRIGGER outbox_events_notify AFTER INSERT ON public.outbox_events \
             FOR EACH STATEMENT EXECUTE FUNCTION outbox_events_notify()",
            "CREATE CONSTRAINT TRIGGER outbox_events_replaced AFTER DELETE \
             ON public.outbox_events DEFERRABLE INITIALLY DEFERRED \
             FOR EACH ROW WHEN ((old.published_at IS NULL)) \
             EXECUTE FUNCTION outbox_events_replaced()",
        ],
        "no BEFORE ROW trigger on the outbox (each would lock every row the relay marks)"
    );
    // Rolled back at the end: no relay ever sees the row.
    let mut tx = client.transaction().await.expect("begin");
    let event_id = uuid::Uuid::now_v7();
    tx.execute(
        "INSERT INTO outbox_events (event_id, tenant_id, aggregate_type, aggregate_id, \
         aggregate_sequence, event_type, schema_version, payload, traceparent, tracestate) \
         VALUES ($1, 'acme', 'order', $2, 1, 'OrderPlaced', 1, '{\"total\": \"93.00\"}', \
                 '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01', 'k=v')",
        &[&event_id, &uuid::Uuid::now_v7().to_string()],
    )
    .await
    .expect("insert");

    let savepoint = tx.savepoint("edit").await.expect("savepoint");
    let edit = savepoint
        .execute(
            "UPDATE outbox_events SET payload = '{\"total\": \"0.00\"}' WHERE event_id = $1",
            &[&event_id],
        )
        .await
        .expect_err("an outbox row's payload cannot be edited");
    let db_error = edit.as_db_error().expect("a database error");
    assert_eq!(db_error.code(), &SqlState::RESTRICT_VIOLATION, "{db_error}");
    assert_eq!(
        db_error.message(),
        format!("outbox_events rows are immutable: event {event_id} cannot be edited")
    );
    // The hint names every column the relay's writes below change.
    let hint = db_error.hint().expect("a hint");
    for column in [
        "claimed_by",
        "claim_until",
        "published_at",
        "attempt_count",
        "own_failure_count",
        "lease_expiries",
        "last_error",
        "available_at",
        "quarantined_at",
    ] {
        assert!(hint.contains(column), "{column} in the hint: {hint}");
    }
    savepoint.rollback().await.expect("rollback to savepoint");

    for column in [
        "event_id",
        "tenant_id",
        "aggregate_type",
        "aggregate_id",
        "aggregate_sequence",
        "event_type",
        "schema_version",
        "payload",
        "occurred_at",
        "traceparent",
        "tracestate",
    ] {
        let savepoint = tx.savepoint("edit").await.expect("savepoint");
        let edit = savepoint
            .execute(
                &format!("UPDATE outbox_events SET {column} = {column} WHERE event_id = $1"),
                &[&event_id],
            )
            .await
            .expect_err(column);
        assert_eq!(
            edit.code(),
            Some(&SqlState::RESTRICT_VIOLATION),
            "{column}: {edit}"
        );
        savepoint.rollback().await.expect("rollback to savepoint");
    }

    // The relay's writes: the lease, then the failure bookkeeping, then the mark.
    for set in [
        "claimed_by = 'relay-a', claim_until = now() + interval '30 seconds', \
         lease_expiries = 1",
        "attempt_count = attempt_count + 1, own_failure_count = own_failure_count + 1, \
         last_error = 'returned', available_at = now(), quarantined_at = now(), \
         claimed_by = NULL, claim_until = NULL, lease_expiries = 0",
        "published_at = now(), quarantined_at = NULL",
    ] {
        let updated = tx
            .execute(
                &format!("UPDATE outbox_events SET {set} WHERE event_id = $1"),
                &[&event_id],
            )
            .await
            .unwrap_or_else(|e| panic!("{set}: {e}"));
        assert_eq!(updated, 1, "{set}");
    }
    let payload: serde_json::Value = tx
        .query_one(
            "SELECT payload FROM outbox_events WHERE event_id = $1",
            &[&event_id],
        )
        .await
        .expect("row")
        .get(0);
    assert_eq!(payload, serde_json::json!({"total": "93.00"}));
    let deleted = tx
        .execute(
            "DELETE FROM outbox_events WHERE event_id = $1",
            &[&event_id],
        )
        .await
        .expect("a published row may be deleted (cleanup)");
    assert_eq!(deleted, 1);
    tx.rollback().await.expect("rollback");
}

/// The tables of `db`'s database (but `exempt`) whose rows may lack a
/// tenant: no `tenant_id` column, or one that may be NULL without a
/// validated `CHECK (tenant_id IS NOT NULL)`, unless the table is in
/// `nullable`.
async fn tables_lacking_a_tenant(
    client: &tokio_postgres::Client,
    exempt: &[&str],
    nullable: &[&str],
) -> Vec<String> {
    client
        .query(
            "SELECT t.table_name::text FROM information_schema.tables t \
             WHERE t.table_schema = 'public' AND t.table_type = 'BASE TABLE' \
               AND t.table_name <> ALL($1::text[]) \
               AND NOT EXISTS (SELECT 1 FROM information_schema.columns c \
                   WHERE c.table_schema = 'public' AND c.table_name = t.table_name \
                     AND c.column_name = 'tenant_id' \
                     AND (c.is_nullable = 'NO' OR c.table_name = ANY($2::text[]) \
                          OR EXISTS (SELECT 1 FROM pg_constraint k \
                          WHERE k.conrelid = t.table_name::regclass AND k.contype = 'c' \
                            AND k.convalidated \
                            AND pg_get_constraintdef(k.oid) = 'CHECK ((tenant_id IS NOT NULL))'))) \
             ORDER BY 1",
            &[&exempt, &nullable],
        )
        .await
        .expect("columns")
        .iter()
        .map(|row| row.get(0))
        .collect()
}

/// DESIGN.md section 3: every row carries its tenant, in all four
/// databases. order_lines got it in migrations V6/V7 (its NOT NULL a
/// validated CHECK); a line written without it, by a binary from before,
/// gets its order's. The consumers' inbox got it in runtime V3, nullable
/// (rows from before it, or from an older binary during a rolling deploy,
/// have none); every other consumer table has it NOT NULL.
#[tokio::test]
async fn every_row_carries_its_tenant() {
    for db in [Database::Inventory, Database::Ledger, Database::Loyalty] {
        kit::migrations::run(&pool(db), db).await.expect("migrate");
        let without = tables_lacking_a_tenant(
            &pg(db).await,
            &["refinery_schema_history", "consumer_runtime_schema_history"],
            &["processed_events"],
        )
        .await;
        assert!(
            without.is_empty(),
            "{}: tables whose rows may lack a tenant_id: {without:?}",
            db.name()
        );
    }
    kit::migrations::run(&pool(Database::Orders), Database::Orders)
        .await
        .expect("migrate");
    let client = pg(Database::Orders).await;
    let without =
        tables_lacking_a_tenant(&client, &["tenants", "refinery_schema_history"], &[]).await;
    assert!(
        without.is_empty(),
        "tables whose rows may lack a tenant_id: {without:?}"
    );
    // (V6's order_lines_tenant_fk, validated by V7, dropped by V19: the
    // line's (order, tenant) must be an order's, whose tenant is a tenant.)
    assert_eq!(
        constraints_validated(
            &client,
            &["order_lines_order_tenant_fk", "order_lines_tenant_not_null"]
        )
        .await,
        ["order_lines_order_tenant_fk", "order_lines_tenant_not_null"]
            .map(|name| (name.to_owned(), true))
    );

    let tenant = system_tests::unique_tenant("rows");
    let order = uuid::Uuid::now_v7();
    system_tests::insert_seed_order(&client, &tenant, order).await;
    let line_tenant: String = client
        .query_one(
            "SELECT tenant_id FROM order_lines WHERE order_id = $1",
            &[&order],
        )
        .await
        .expect("line")
        .get(0);
    assert_eq!(line_tenant, tenant, "the order's tenant");
    system_tests::delete_seed_order(&client, order).await;
}

/// Orders V9 and V10: one payment and one delivery per order, and a line, payment
/// or delivery only in its order's tenant, refused by the database itself
/// (order-api decides both under the order's lock; a second path writing
/// these tables must not get around them). Each write runs in a
/// transaction rolled back after it.
#[tokio::test]
async fn payments_deliveries_and_lines_are_one_per_order_and_in_its_tenant() {
    kit::migrations::run(&pool(Database::Orders), Database::Orders)
        .await
        .expect("migrate");
    let mut client = pg(Database::Orders).await;
    assert_eq!(
        constraints_validated(
            &client,
            &[
                "deliveries_order_tenant_fk",
                "order_lines_order_tenant_fk",
                "payments_order_tenant_fk"
            ]
        )
        .await,
        [
            "deliveries_order_tenant_fk",
            "order_lines_order_tenant_fk",
            "payments_order_tenant_fk"
        ]
        .map(|name| (name.to_owned(), true)),
        "V9 adds them, V10 validates them"
    );
    // Only those (V19 dropped the six they imply, each checked again on
    // every write): a line's, payment's or delivery's one foreign key, and
    // the order's to its tenant.
    let foreign_keys: Vec<(String, String)> = client
        .query(
            "SELECT conrelid::regclass::text, pg_get_constraintdef(oid) FROM pg_constraint \
             WHERE contype = 'f' AND pg_table_is_visible(conrelid) \
               AND conrelid::regclass::text IN ('orders', 'order_lines', 'payments', 'deliveries') \
             ORDER BY 1",
            &[],
        )
        .await
        .expect("foreign keys")
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect();
    let to_order = "FOREIGN KEY (order_id, tenant_id) REFERENCES orders(order_id, tenant_id)";
    assert_eq!(
        foreign_keys,
        [
            ("deliveries", to_order),
            ("order_lines", to_order),
            (
                "orders",
                "FOREIGN KEY (tenant_id) REFERENCES tenants(tenant_id)"
            ),
            ("payments", to_order),
        ]
        .map(|(table, key)| (table.to_owned(), key.to_owned()))
    );
    let tenant = system_tests::unique_tenant("v9");
    let other = system_tests::unique_tenant("v9-other");
    let order = uuid::Uuid::now_v7();
    system_tests::insert_seed_order(&client, &tenant, order).await;
    client
        .execute("INSERT INTO tenants (tenant_id) VALUES ($1)", &[&other])
        .await
        .expect("other tenant");
    let payment = "INSERT INTO payments (order_id, payment_id, tenant_id, amount_minor, method) \
                   VALUES ($1, $2, $3, 9300, 'card')";
    let delivery = "INSERT INTO deliveries (order_id, delivery_id, tenant_id, delivered_at) \
                    VALUES ($1, $2, $3, now())";
    let line = "INSERT INTO order_lines (order_id, line_no, sku, qty, unit_price_minor, \
                unit_cost_minor, tenant_id) VALUES ($1, 2, $2, 1, 100, 50, $3)";
    // (first statement, second statement, the constraint the second breaks)
    let cases = [
        (
            Some((payment, "p1", &tenant)),
            (payment, "p2", &tenant),
            "payments_one_per_order",
        ),
        (
            Some((delivery, "d1", &tenant)),
            (delivery, "d2", &tenant),
            "deliveries_one_per_order",
        ),
        (None, (payment, "p1", &other), "payments_order_tenant_fk"),
        (None, (delivery, "d1", &other), "deliveries_order_tenant_fk"),
        (None, (line, "SKU-2", &other), "order_lines_order_tenant_fk"),
    ];
    for (first, (sql, id, owner), constraint) in cases {
        let tx = client.transaction().await.expect("begin");
        if let Some((sql, id, owner)) = first {
            tx.execute(sql, &[&order, &id, owner])
                .await
                .unwrap_or_else(|e| panic!("the first of {constraint}: {e}"));
        }
        let error = tx
            .execute(sql, &[&order, &id, owner])
            .await
            .expect_err(constraint);
        let db = error.as_db_error().expect("a database error");
        assert_eq!(db.constraint(), Some(constraint), "{db:?}");
        tx.rollback().await.expect("rollback");
    }
    // In its own tenant a line is taken (the check is not "no lines").
    let tx = client.transaction().await.expect("begin");
    tx.execute(line, &[&order, &"SKU-2", &tenant])
        .await
        .expect("a line in the order's tenant");
    tx.rollback().await.expect("rollback");
    system_tests::delete_seed_order(&client, order).await;
}

/// The order-events exchange is declared as agreed (declaring it again with
/// the kit's arguments succeeds), and the kit's confirmation check calls a
/// routed, confirmed publish a success and an unroutable mandatory one a
/// failure. The publishes go to a private topic exchange: on order-events
/// every consumer's `#` binding (a `make run` system on the same broker)
/// would take a test message as poison.
#[tokio::test]
async fn order_events_is_declared_and_only_a_routed_publish_is_confirmed() {
    let shutdown = kit::CancellationToken::new();
    let settings = kit::settings::AmqpSettings { url: amqp_url() };
    let connection = kit::amqp::connect(&settings, "foundation-test", &shutdown)
        .await
        .expect("connect");
    let channel = connection.create_channel().await.expect("channel");
    kit::amqp::declare_order_events_exchange(&channel)
        .await
        .expect("declare exchange");
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirms");
    let private = format!("foundation-test.{}", uuid::Uuid::now_v7());
    channel
        .exchange_declare(
            private.as_str().into(),
            lapin::ExchangeKind::Topic,
            lapin::options::ExchangeDeclareOptions {
                auto_delete: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("private exchange");

    // A private, exclusive queue bound to one routing key.
    let routing_key = format!("FoundationTest.{}", uuid::Uuid::now_v7());
    let queue = channel
        .queue_declare(
            "".into(),
            QueueDeclareOptions {
                exclusive: true,
                auto_delete: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("queue");
    channel
        .queue_bind(
            queue.name().clone(),
            private.as_str().into(),
            routing_key.as_str().into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("bind");

    let body = br#"{"hello":"order-events"}"#;
    let publish = |key: String| {
        let channel = channel.clone();
        let exchange = private.clone();
        async move {
            channel
                .basic_publish(
                    exchange.as_str().into(),
                    key.as_str().into(),
                    BasicPublishOptions {
                        mandatory: true,
                        ..BasicPublishOptions::default()
                    },
                    body,
                    BasicProperties::default().with_delivery_mode(2),
                )
                .await
                .expect("publish")
                .await
                .expect("confirmation")
        }
    };

    let routed = publish(routing_key.clone()).await;
    assert_eq!(check_confirmation(routed), Ok(()));

    // Unroutable + mandatory: lapin reports an Ack carrying the returned
    // message; the kit must call it a failure.
    let unroutable = publish("NoSuchEvent".to_owned()).await;
    match check_confirmation(unroutable) {
        Err(PublishRejected::Returned { code, .. }) => assert_eq!(code, 312),
        other => panic!("unroutable publish must be Returned(312), got {other:?}"),
    }

    // The routed message is in the queue, byte for byte.
    let mut consumer = channel
        .basic_consume(
            queue.name().clone(),
            "foundation-test".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..BasicConsumeOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("consume");
    let delivery = tokio::time::timeout(Duration::from_secs(10), consumer.next())
        .await
        .expect("a delivery within 10 s")
        .expect("stream open")
        .expect("delivery");
    assert_eq!(delivery.data, body);
    assert_eq!(delivery.routing_key.as_str(), routing_key);
    assert_eq!(delivery.exchange.as_str(), private);
    channel
        .exchange_delete(private.as_str().into(), Default::default())
        .await
        .expect("delete private exchange");
    connection.close(200, "done".into()).await.expect("close");
}

/// Every service binary: zero configuration except its HTTP port (given by
/// environment variable, which also proves the override path), healthy and
/// ready against the local PostgreSQL and RabbitMQ, then a clean SIGTERM exit.
#[tokio::test]
async fn every_service_starts_with_no_configuration_and_stops_on_sigterm() {
    let services = [
        ("order-api", "ORDER_API"),
        ("outbox-relay", "OUTBOX_RELAY"),
        ("inventory-consumer", "INVENTORY_CONSUMER"),
        ("ledger-consumer", "LEDGER_CONSUMER"),
        ("loyalty-consumer", "LOYALTY_CONSUMER"),
    ];
    // Consumers get a private name (their queues are deleted afterwards) and
    // stay unbound from order-events; the relay works on an orders database
    // of its own (with the default one, and no tenant filter, it would
    // claim and publish every other test's pending rows and its cleanup
    // delete their old ones); everything else is the zero-config default.
    let private = system_tests::consumers::unique("foundation");
    let (relay_database, relay_url) = system_tests::create_database(Database::Orders).await;
    let mut running = Vec::new();
    for (name, prefix) in services {
        let port = free_port();
        let mut env = vec![
            (format!("{prefix}__HTTP__PORT"), port.to_string()),
            ("RUST_LOG".to_owned(), "warn".to_owned()),
        ];
        if name.ends_with("-consumer") {
            env.push((
                format!("{prefix}__CONSUMER__NAME"),
                format!("{private}-{name}"),
            ));
            env.push((
                format!("{prefix}__CONSUMER__BIND_ORDER_EVENTS"),
                "false".to_owned(),
            ));
        }
        if name == "outbox-relay" {
            env.push((format!("{prefix}__DATABASE__URL"), relay_url.clone()));
        }
        let env: Vec<(&str, String)> = env.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
        let service = Service::start(name, &[], &env);
        running.push((service, port));
    }
    for (service, port) in &mut running {
        let base = format!("http://127.0.0.1:{port}");
        let health = service
            .wait_ready(&format!("{base}/healthz"), Duration::from_secs(60))
            .await
            .unwrap_or_else(|e| panic!("{}: {e}", service.name));
        assert!(
            health.contains(&format!("\"service\":\"{}\"", service.name)),
            "{health}"
        );
        let ready = wait_for_ok(&format!("{base}/readyz"), Duration::from_secs(60))
            .await
            .unwrap_or_else(|e| panic!("{}: {e}", service.name));
        assert!(
            ready.contains("\"status\":\"ready\""),
            "{}: {ready}",
            service.name
        );
        if service.name.ends_with("-consumer") {
            // Ready means its topology is declared: the relay may start.
            let last = format!("{private}-{}.p3", service.name);
            assert_eq!(system_tests::consumers::queue_depth(&last).await, 0);
        }
        let metrics = reqwest::get(format!("{base}/metrics"))
            .await
            .expect("metrics");
        assert!(metrics.status().is_success());
        assert!(metrics
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/plain")));
        // The readiness gauge the ServiceNotReady alert reads follows
        // /readyz (refreshed every 5 s).
        system_tests::consumers::wait_for_metric(
            &base,
            &service.name,
            "service_ready",
            &format!("service=\"{}\"", service.name),
            1.0,
            Duration::from_secs(30),
        )
        .await;
    }
    for (mut service, _) in running {
        service.signal("TERM");
        let status = service
            .wait_exit(Duration::from_secs(20))
            .unwrap_or_else(|| panic!("{} did not stop within 20 s of SIGTERM", service.name));
        assert!(status.success(), "{} exited with {status}", service.name);
        if service.name.ends_with("-consumer") {
            // Default partitions (4) and tiers (5).
            system_tests::consumers::teardown(&format!("{private}-{}", service.name), 4, 5).await;
        }
    }
    system_tests::drop_database(Database::Orders, &relay_database).await;
}

/// A consumer that runs but cannot reach its broker answers /readyz 503 and
/// exports `service_ready 0` (what ServiceNotReady alerts on), while its
/// /healthz and /metrics still answer.
#[tokio::test]
async fn a_service_without_its_broker_is_not_ready_and_says_so_in_its_metrics() {
    let port = free_port();
    let nowhere = free_port();
    let private = format!("notready-{}", uuid::Uuid::new_v4().simple());
    let mut service = Service::start(
        "ledger-consumer",
        &[],
        &[
            ("LEDGER_CONSUMER__HTTP__PORT", port.to_string()),
            (
                "LEDGER_CONSUMER__AMQP__URL",
                format!("amqp://app:app@127.0.0.1:{nowhere}/%2f"),
            ),
            ("LEDGER_CONSUMER__CONSUMER__NAME", private),
            ("RUST_LOG", "error".to_owned()),
        ],
    );
    let base = format!("http://127.0.0.1:{port}");
    service
        .wait_ready(&format!("{base}/healthz"), Duration::from_secs(60))
        .await
        .expect("healthz");
    let ready = reqwest::get(format!("{base}/readyz"))
        .await
        .expect("readyz");
    assert_eq!(ready.status().as_u16(), 503);
    let body = ready.text().await.expect("body");
    assert!(body.contains("\"broker\":\"disconnected\""), "{body}");
    let line = "service_ready{service=\"ledger-consumer\"} 0";
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let metrics = reqwest::get(format!("{base}/metrics"))
            .await
            .expect("metrics")
            .text()
            .await
            .expect("metrics body");
        if metrics.lines().any(|l| l == line) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no {line:?}: {metrics}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    service.signal("TERM");
    assert!(service.wait_exit(Duration::from_secs(20)).is_some());
}

/// A misspelled setting (one underscore: `ORDER_API__DATABASE_URL`) stops
/// every service at start-up, naming the variable, instead of running on the
/// default it meant to replace; text that looks like a number stays text
/// (checked in kit's own tests).
#[tokio::test]
async fn a_misspelled_setting_stops_the_service_and_names_it() {
    for (name, variable) in [
        ("order-api", "ORDER_API__DATABASE_URL"),
        ("outbox-relay", "OUTBOX_RELAY__RELAY__BATCHSIZE"),
        ("ledger-consumer", "LEDGER_CONSUMER__CONSUMER__PARTITION"),
    ] {
        let run = tokio::process::Command::new(system_tests::bin(name))
            .env(variable, "1")
            .env("RUST_LOG", "warn")
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true)
            .output();
        let output = tokio::time::timeout(Duration::from_secs(30), run)
            .await
            .unwrap_or_else(|_| panic!("{name} with {variable} is still running after 30 s"))
            .expect("run");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        assert_eq!(output.status.code(), Some(1), "{name}: {text}");
        assert!(
            text.contains(&format!("unknown setting(s) {variable}")),
            "{name}: {text}"
        );
    }
}

/// A SIGTERM while a service waits at start-up for another instance's
/// migration (the advisory lock, held here by the test) stops it at once,
/// as a clean stop: exit status 0, no error logged, and its session no
/// longer queued for the lock. Before, the wait ignored the signal: the
/// service stopped only once the other migration ended, or when the
/// orchestrator killed it. Each service on a database of its own kind, made
/// for the test (the lock is per database, so no other test waits on it).
/// A one-shot command (`migrate`) stopped there also stops at once, but
/// with an error: it did nothing (a script must not go on as if migrated).
#[tokio::test]
async fn a_sigterm_while_waiting_for_another_migration_stops_the_service_cleanly() {
    for (name, prefix, db, args) in [
        ("order-api", "ORDER_API", Database::Orders, &[][..]),
        ("outbox-relay", "OUTBOX_RELAY", Database::Orders, &[]),
        ("ledger-consumer", "LEDGER_CONSUMER", Database::Ledger, &[]),
        (
            "ledger-consumer",
            "LEDGER_CONSUMER",
            Database::Ledger,
            &["migrate"],
        ),
    ] {
        let (database, url) = system_tests::create_database(db).await;
        let holder = system_tests::connect_url(&url).await;
        holder
            .execute(
                "SELECT pg_advisory_lock($1)",
                &[&kit::migrations::MIGRATION_LOCK_KEY],
            )
            .await
            .expect("hold the migration lock");
        let log = std::env::temp_dir().join(format!("{database}.log"));
        let mut service = Service::start_with_output(
            name,
            args,
            &[
                (&format!("{prefix}__DATABASE__URL"), url.clone()),
                (&format!("{prefix}__HTTP__PORT"), free_port().to_string()),
                ("RUST_LOG", "info".to_owned()),
                ("LOG_FORMAT", "json".to_owned()),
            ],
            Some(&log),
        );
        let waiting = "SELECT count(*) FROM pg_locks l JOIN pg_database d ON d.oid = l.database
                       WHERE l.locktype = 'advisory' AND NOT l.granted AND d.datname = $1";
        let queued = |expected: i64| {
            let (holder, database) = (&holder, &database);
            move || async move {
                let row = holder
                    .query_one(waiting, &[database])
                    .await
                    .expect("pg_locks");
                (row.get::<_, i64>(0) == expected).then_some(())
            }
        };
        system_tests::consumers::eventually(
            &format!("{name} waiting for the migration lock"),
            Duration::from_secs(60),
            queued(1),
        )
        .await;
        service.signal("TERM");
        let status = tokio::task::spawn_blocking(move || {
            let status = service.wait_exit(Duration::from_secs(60));
            (status, service)
        })
        .await
        .expect("join");
        let (status, _service) = status;
        let status = status.unwrap_or_else(|| panic!("{name} still waiting 60 s after SIGTERM"));
        // Not ended by the stop grace (25 s, status 1 and an ERROR line):
        // the status, the clean stop and the line below say it stopped the
        // wait itself.
        let output = system_tests::take_log(&log);
        if args.is_empty() {
            assert!(status.success(), "{name}: {status}\n{output}");
            system_tests::assert_clean_stop(&output, "stopped by a signal during start-up");
        } else {
            assert_eq!(status.code(), Some(1), "{name} {args:?}: {output}");
        }
        assert!(
            output.contains("shut down while waiting for another instance's migration"),
            "{name}: {output}"
        );
        // Its wait cancelled, not left queued until the lock is released
        // (the server does not notice a closed connection while it waits).
        system_tests::consumers::eventually(
            &format!("{name}'s session no longer queued for the lock"),
            Duration::from_secs(10),
            queued(0),
        )
        .await;
        drop(holder);
        system_tests::drop_database(db, &database).await;
    }
}

/// Orders V6 and V7 on a database holding lines from before them: V6 (the
/// expand step) leaves the old lines as they are and fills in the tenant of
/// a line an older binary writes without one; V7 gives every old line its
/// order's tenant and validates both constraints. Run in a scratch schema
/// built by V1-V5, not on the shared tables (where no line predates V6).
/// The state after V6 is also the one a crash between V6 and V7 leaves
/// (each migration commits on its own): V7 runs at the next start.
#[tokio::test]
async fn orders_v6_and_v7_give_existing_lines_their_tenant() {
    let scratch = Scratch::new().await;
    let client = &scratch.client;
    let run = |version: u32| scratch.run_ok(version);
    let line_constraints = || async {
        let names = ["order_lines_tenant_fk", "order_lines_tenant_not_null"];
        let found = constraints_validated(client, &names).await;
        assert_eq!(
            found
                .iter()
                .map(|(name, _)| name.as_str())
                .collect::<Vec<_>>(),
            names
        );
        found
            .iter()
            .map(|(_, validated)| *validated)
            .collect::<Vec<_>>()
    };
    for version in 1..=5 {
        run(version).await;
    }
    let (a, b) = (uuid::Uuid::now_v7(), uuid::Uuid::now_v7());
    // Two orders of two tenants from before V6, a line each.
    system_tests::insert_seed_order(client, "acme", a).await;
    system_tests::insert_seed_order(client, "globex", b).await;
    run(6).await;
    assert_eq!(line_constraints().await, [false, false], "V6 adds them");
    client
        .execute(
            "INSERT INTO order_lines (order_id, line_no, sku, qty, unit_price_minor, unit_cost_minor) \
             VALUES ($1, 2, 'JKT-S', 1, 4000, 2200)",
            &[&b],
        )
        .await
        .expect("a line written without its tenant after V6");
    let (a, b) = (a.to_string(), b.to_string());
    let some = |t: &str| Some(t.to_owned());
    assert_eq!(
        line_tenants(client).await,
        vec![
            (a.clone(), 1, None),
            (b.clone(), 1, None),
            (b.clone(), 2, some("globex")),
        ]
    );

    run(7).await;
    assert_eq!(line_constraints().await, [true, true], "V7 validates them");
    assert_eq!(
        line_tenants(client).await,
        vec![
            (a, 1, some("acme")),
            (b.clone(), 1, some("globex")),
            (b, 2, some("globex")),
        ]
    );
    scratch.drop_schema().await;
}

/// Whether order_lines' tenant constraints are validated (NOT NULL, FK).
/// (name, validated) of the constraints `names` of the tables on the
/// session's search path (the V6/V7 test runs in a schema of its own), by
/// name.
async fn constraints_validated(
    client: &tokio_postgres::Client,
    names: &[&str],
) -> Vec<(String, bool)> {
    client
        .query(
            "SELECT conname::text, convalidated FROM pg_constraint \
             WHERE conname = ANY($1) AND pg_table_is_visible(conrelid) ORDER BY 1",
            &[&names],
        )
        .await
        .expect("constraints")
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect()
}

/// (order, line, tenant) of every line, in order.
async fn line_tenants(client: &tokio_postgres::Client) -> Vec<(String, i32, Option<String>)> {
    client
        .query(
            "SELECT order_id::text, line_no, tenant_id FROM order_lines ORDER BY 1, 2",
            &[],
        )
        .await
        .expect("lines")
        .iter()
        .map(|row| (row.get(0), row.get(1), row.get(2)))
        .collect()
}

/// A connection whose search path is a fresh scratch schema, to run the
/// orders migrations' SQL files there one by one (not on the shared tables).
struct Scratch {
    client: tokio_postgres::Client,
    schema: String,
    files: Vec<(u32, String)>,
}

impl Scratch {
    async fn new() -> Self {
        let client = pg(Database::Orders).await;
        let schema = format!("migration_test_{}", uuid::Uuid::new_v4().simple());
        client
            .batch_execute(&format!(
                "CREATE SCHEMA {schema}; SET search_path TO {schema}"
            ))
            .await
            .expect("scratch schema");
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../migrations/orders");
        let mut files: Vec<(u32, String)> = std::fs::read_dir(dir)
            .expect("migrations")
            .map(|entry| entry.expect("entry").path())
            .filter_map(|path| {
                let name = path.file_name()?.to_str()?.to_owned();
                let version = name.strip_prefix('V')?.split("__").next()?.parse().ok()?;
                Some((version, std::fs::read_to_string(&path).expect("read")))
            })
            .collect();
        files.sort_by_key(|(version, _)| *version);
        Self {
            client,
            schema,
            files,
        }
    }

    /// Migration `version`'s SQL, in one transaction as refinery runs it.
    async fn run(&self, version: u32) -> Result<(), tokio_postgres::Error> {
        let sql = self
            .files
            .iter()
            .find(|(v, _)| *v == version)
            .map(|(_, sql)| sql.clone())
            .unwrap_or_else(|| panic!("no V{version}"));
        let result = self
            .client
            .batch_execute(&format!("BEGIN; {sql}; COMMIT"))
            .await;
        if result.is_err() {
            let _ = self.client.batch_execute("ROLLBACK").await;
        }
        result
    }

    async fn run_ok(&self, version: u32) {
        self.run(version)
            .await
            .unwrap_or_else(|e| panic!("V{version}: {e}"));
    }

    async fn drop_schema(self) {
        self.client
            .batch_execute(&format!("DROP SCHEMA {} CASCADE", self.schema))
            .await
            .expect("drop the scratch schema");
    }
}

/// Orders V19 drops foreign keys under an order in flight without a
/// deadlock: it takes `orders` before the tables whose keys reference it,
/// as order-api's transactions do (the order, then its lines). Dropping
/// order_lines' key first took order_lines, then waited for `orders`, held
/// by the order's transaction, which then waited for order_lines: one of
/// the two failed with 40P01. In a scratch schema built by V1-V18.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orders_v19_beside_an_order_in_flight_does_not_deadlock() {
    let scratch = Scratch::new().await;
    for version in 1..=18 {
        scratch.run_ok(version).await;
    }
    let migrating: i32 = scratch
        .client
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .expect("pid")
        .get(0);
    let mut orders = pg(Database::Orders).await;
    orders
        .batch_execute(&format!("SET search_path TO {}", scratch.schema))
        .await
        .expect("the scratch schema");
    orders
        .execute("INSERT INTO tenants (tenant_id) VALUES ('acme')", &[])
        .await
        .expect("tenant");
    let order = uuid::Uuid::now_v7();
    let tx = orders.transaction().await.expect("begin");
    tx.execute(
        "INSERT INTO orders (order_id, tenant_id, customer_id, currency, location, \
         merchandise_minor, shipping_minor, tax_minor, total_minor, last_event_sequence) \
         VALUES ($1, 'acme', '77', 'USD', 'WH-1', 8000, 500, 800, 9300, 1)",
        &[&order],
    )
    .await
    .expect("the order");
    let migration = tokio::spawn(async move {
        let result = scratch.run(19).await;
        (scratch, result)
    });
    // V19 waits for the order's transaction.
    let observer = pg(Database::Orders).await;
    system_tests::consumers::eventually(
        "V19 waiting for a lock",
        Duration::from_secs(30),
        || async {
            observer
                .query_opt(
                    "SELECT 1 FROM pg_locks WHERE pid = $1 AND NOT granted",
                    &[&migrating],
                )
                .await
                .expect("pg_locks")
                .map(|_| ())
        },
    )
    .await;
    tx.execute(
        "INSERT INTO order_lines (order_id, line_no, sku, qty, unit_price_minor, \
         unit_cost_minor, tenant_id) VALUES ($1, 1, 'JKT-M', 2, 4000, 2200, 'acme')",
        &[&order],
    )
    .await
    .expect("the order's line, beside V19");
    tx.commit().await.expect("the order commits");
    let (scratch, result) = migration.await.expect("the migration's task");
    result.expect("V19 applies once the order committed");
    scratch.drop_schema().await;
}

/// Orders V9 finds the unique indexes built by hand before it (as its
/// header advises on a large live database) only when they are what it
/// would have built: an index of the same name that is not unique, on other
/// or INCLUDEd columns, or left invalid by a failed `CREATE INDEX CONCURRENTLY` stops
/// it with the index's name (each in a scratch schema built by V1-V8); one
/// built right is taken, and V10 validates.
#[tokio::test]
async fn orders_v9_refuses_a_hand_built_index_other_than_its_own() {
    let order = uuid::Uuid::now_v7();
    let cases = [
        (
            "CREATE INDEX payments_one_per_order ON payments (order_id)",
            Some("payments_one_per_order"),
        ),
        (
            "CREATE UNIQUE INDEX deliveries_one_per_order ON deliveries (delivery_id)",
            Some("deliveries_one_per_order"),
        ),
        (
            "CREATE UNIQUE INDEX orders_order_tenant_uq ON orders (order_id) INCLUDE (tenant_id)",
            Some("orders_order_tenant_uq"),
        ),
        (
            // Two payments of one order: the concurrent build fails and
            // leaves the index invalid.
            "INSERT INTO payments (order_id, payment_id, tenant_id, amount_minor, method) \
             VALUES ($ORDER, 'p1', 'acme', 9300, 'card'), ($ORDER, 'p2', 'acme', 9300, 'card')",
            Some("payments_one_per_order"),
        ),
        (
            "CREATE UNIQUE INDEX orders_order_tenant_uq ON orders (order_id, tenant_id)",
            None,
        ),
    ];
    for (setup, refused) in cases {
        let scratch = Scratch::new().await;
        for version in 1..=8 {
            scratch.run_ok(version).await;
        }
        system_tests::insert_seed_order(&scratch.client, "acme", order).await;
        let setup = setup.replace("$ORDER", &format!("'{order}'"));
        scratch.client.batch_execute(&setup).await.expect("set-up");
        if setup.starts_with("INSERT") {
            let failed = scratch
                .client
                .batch_execute("CREATE UNIQUE INDEX CONCURRENTLY payments_one_per_order ON payments (order_id)")
                .await;
            let error = failed.expect_err("the duplicate payments fail the build");
            assert_eq!(
                error.code(),
                Some(&tokio_postgres::error::SqlState::UNIQUE_VIOLATION),
                "{error:?}"
            );
        }
        match refused {
            Some(index) => {
                let error = scratch.run(9).await.expect_err(index);
                let message = error.as_db_error().map(|e| e.message().to_owned());
                assert!(
                    message.as_deref().is_some_and(
                        |m| m.contains(index) && m.contains("not a valid unique index")
                    ),
                    "{setup}: {error:?}"
                );
            }
            None => {
                scratch.run_ok(9).await;
                scratch.run_ok(10).await;
            }
        }
        scratch.drop_schema().await;
    }
}

/// A server error's text names the server's message and SQLSTATE
/// (`kit::db::describe`): tokio-postgres's own Display is "db error", all
/// the consumers' retry lines, order-api's 500s and the start-up wait
/// logged before.
#[tokio::test]
async fn a_database_error_is_described_by_the_server_s_message() {
    let client = pg(Database::Orders).await;
    let error = client
        .query_one("SELECT 1 / 0", &[])
        .await
        .expect_err("division by zero");
    assert_eq!(error.to_string(), "db error", "tokio-postgres's own text");
    let text = kit::db::describe(&error);
    assert!(
        text.contains("division by zero") && text.contains("(SQLSTATE 22012)"),
        "{text}"
    );
}
