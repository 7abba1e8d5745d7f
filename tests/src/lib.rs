//! Shared helpers of the cross-service tests: connections to the real
//! PostgreSQL and RabbitMQ started by `scripts/infra-up.sh` (through `make
//! test`), and the service binaries run as child processes.

use std::{
    net::TcpListener,
    path::PathBuf,
    process::{Child, Command, ExitStatus, Stdio},
    time::{Duration, Instant},
};

pub use kit::migrations::Database;

/// How long a test lets a service's subcommand (migrate, replay, redrive,
/// requeue, check-invariants, ...) run before killing it and failing: far
/// above any run's length here, only so that a hang fails its test instead
/// of holding up the suite.
pub const SUBCOMMAND_LIMIT: Duration = Duration::from_secs(300);

/// `output()` bounded by [`SUBCOMMAND_LIMIT`] (stdin empty, stdout and
/// stderr captured, as `output()` does): past it the child is killed and
/// the test fails naming the program.
pub trait OutputWithin {
    fn output_within(&mut self) -> std::io::Result<std::process::Output>;
}

impl OutputWithin for Command {
    fn output_within(&mut self) -> std::io::Result<std::process::Output> {
        use std::io::Read;
        let mut child = self
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?;
        // Read both pipes while the child runs (a full pipe would stop it).
        fn drain(pipe: Option<impl Read + Send + 'static>) -> std::thread::JoinHandle<Vec<u8>> {
            std::thread::spawn(move || {
                let mut bytes = Vec::new();
                if let Some(mut pipe) = pipe {
                    let _ = pipe.read_to_end(&mut bytes);
                }
                bytes
            })
        }
        let (stdout, stderr) = (drain(child.stdout.take()), drain(child.stderr.take()));
        let deadline = Instant::now() + SUBCOMMAND_LIMIT;
        let status = loop {
            if let Some(status) = child.try_wait()? {
                break status;
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "{:?} {:?} did not finish within {SUBCOMMAND_LIMIT:?}",
                    self.get_program(),
                    self.get_args().collect::<Vec<_>>()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        Ok(std::process::Output {
            status,
            stdout: stdout.join().unwrap_or_default(),
            stderr: stderr.join().unwrap_or_default(),
        })
    }
}

/// [`OutputWithin`] for tokio's `Command` (killed when the limit drops it).
pub async fn output_within(
    command: &mut tokio::process::Command,
) -> std::io::Result<std::process::Output> {
    command.kill_on_drop(true);
    match tokio::time::timeout(SUBCOMMAND_LIMIT, command.output()).await {
        Ok(output) => output,
        Err(_) => panic!(
            "{:?} {:?} did not finish within {SUBCOMMAND_LIMIT:?}",
            command.as_std().get_program(),
            command.as_std().get_args().collect::<Vec<_>>()
        ),
    }
}

/// The database server's clock now (`clock_timestamp()`), as text for a
/// later `$n::text::timestamptz`: a moment to compare the server's own
/// times with (a commit's, a `published_at`), whatever the test's clock.
pub async fn db_clock(client: &impl tokio_postgres::GenericClient) -> String {
    client
        .query_one("SELECT clock_timestamp()::text", &[])
        .await
        .expect("the database's clock")
        .get(0)
}

/// Fails unless the server records commit times (`track_commit_timestamp`,
/// on in `make up`): for a test reading `pg_xact_commit_timestamp(xmin)`.
pub async fn require_commit_timestamps(client: &impl tokio_postgres::GenericClient) {
    let tracked: String = client
        .query_one("SHOW track_commit_timestamp", &[])
        .await
        .expect("track_commit_timestamp")
        .get(0);
    assert_eq!(
        tracked, "on",
        "this test needs PostgreSQL's track_commit_timestamp (scripts/infra-up.sh sets it)"
    );
}

/// URL of database `db`: `PG_URL_<DB>` (exported by `scripts/infra-env.sh`)
/// or the local default.
pub fn pg_url(db: Database) -> String {
    let var = format!("PG_URL_{}", db.name().to_uppercase());
    std::env::var(var).unwrap_or_else(|_| kit::settings::DatabaseSettings::local(db.name()).url)
}

/// `AMQP_URL` or the local default.
pub fn amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| kit::settings::AmqpSettings::default().url)
}

/// A plain tokio-postgres client to `db`, whose schema is migrated first (once
/// per test process): a test never depends on another test, or a service it
/// happens to start, having created the tables — CI runs on a fresh cluster.
/// A new, empty database on `db`'s server, for a test that alters its
/// tables or must be alone on them: (its name, its URL, with `db`'s
/// options). Drop it with [`drop_database`].
pub async fn create_database(db: Database) -> (String, String) {
    let name = format!(
        "{}_{}",
        db.name(),
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    );
    pg(db)
        .await
        .batch_execute(&format!("CREATE DATABASE {name}"))
        .await
        .expect("create database");
    let shared = pg_url(db);
    let (address, options) = shared.split_once('?').unwrap_or((&shared, ""));
    let (server, _) = address.rsplit_once('/').expect("a database URL");
    let url = match options {
        "" => format!("{server}/{name}"),
        options => format!("{server}/{name}?{options}"),
    };
    (name, url)
}

/// Drop a database [`create_database`] made (its sessions ended first).
pub async fn drop_database(db: Database, name: &str) {
    pg(db)
        .await
        .batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        .await
        .expect("drop database");
}

/// Lock `table` for the rest of `tx` (ACCESS EXCLUSIVE); the pid of its
/// session, for [`blocked_by`].
pub async fn lock_table(tx: &tokio_postgres::Transaction<'_>, table: &str) -> i32 {
    tx.batch_execute(&format!("LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE"))
        .await
        .expect("lock");
    backend_pid(tx).await
}

/// The pid of `client`'s session (a connection or a transaction on one),
/// for [`blocked_by`] and `pg_stat_activity`.
pub async fn backend_pid(client: &impl tokio_postgres::GenericClient) -> i32 {
    client
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .expect("pid")
        .get(0)
}

/// The pid of a session waiting on a lock the session `holder` holds, once
/// there is one (at most 30 s), as `observer` sees it.
pub async fn blocked_by(observer: &tokio_postgres::Client, holder: i32) -> i32 {
    consumers::eventually(
        "a backend waiting on the held lock",
        Duration::from_secs(30),
        || async {
            observer
                .query_opt(
                    "SELECT pid FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))",
                    &[&holder],
                )
                .await
                .expect("pg_stat_activity")
                .map(|row| row.get::<_, i32>(0))
        },
    )
    .await
}

/// A connection to `url`, driven in the background.
pub async fn connect_url(url: &str) -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .expect("connect to the database");
    tokio::spawn(connection);
    client
}

pub async fn pg(db: Database) -> tokio_postgres::Client {
    ensure_migrated(db).await;
    let (client, connection) = tokio_postgres::connect(&pg_url(db), tokio_postgres::NoTls)
        .await
        .unwrap_or_else(|e| panic!("connect to {}: {e} (is `make up` running?)", db.name()));
    tokio::spawn(connection);
    client
}

/// Run `statement`, a DELETE of outbox rows that may include unpublished
/// ones (a test's clean-up of its own rows), with orders V13's guard
/// lifted for it alone (`outbox.allow_unpublished_delete`, set and reset on
/// this session). Returns the rows deleted.
pub async fn delete_outbox_rows(
    db: &tokio_postgres::Client,
    statement: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> u64 {
    with_guard_lifted(db, "outbox.allow_unpublished_delete", statement, params).await
}

/// Run `statement` (an UPDATE or DELETE of stock movements, which inventory
/// V2 refuses) as a repair by hand: with `inventory.allow_movement_repair`
/// set for it alone. A test planting drift, or cleaning up its own rows.
pub async fn repair_movements(
    db: &tokio_postgres::Client,
    statement: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> u64 {
    with_guard_lifted(db, "inventory.allow_movement_repair", statement, params).await
}

/// Run `statement` with the guard `setting` set on for it alone (set and
/// reset on this session); the rows it changed.
async fn with_guard_lifted(
    db: &tokio_postgres::Client,
    setting: &str,
    statement: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> u64 {
    db.batch_execute(&format!("SET {setting} = on"))
        .await
        .expect("lift the guard");
    let changed = db.execute(statement, params).await;
    db.batch_execute(&format!("RESET {setting}"))
        .await
        .expect("restore the guard");
    changed.unwrap_or_else(|e| panic!("{statement}: {e}"))
}

/// Applies `db`'s migrations unless this process already did. Concurrent
/// callers are serialised by the migration advisory lock.
pub async fn ensure_migrated(db: Database) {
    static MIGRATED: std::sync::Mutex<Vec<&'static str>> = std::sync::Mutex::new(Vec::new());
    let done = |name| MIGRATED.lock().map(|m| m.contains(&name)).unwrap_or(false);
    if done(db.name()) {
        return;
    }
    kit::migrations::run(&pool(db), db)
        .await
        .unwrap_or_else(|e| panic!("migrate {}: {e} (is `make up` running?)", db.name()));
    if let Ok(mut m) = MIGRATED.lock() {
        m.push(db.name());
    }
}

/// A deadpool pool to `db` (what the services use, with kit's session
/// settings; the consumers' message sessions add
/// `consumer_runtime::session_options`).
pub fn pool(db: Database) -> kit::db::PgPool {
    pool_of_url(db, &pg_url(db))
}

/// [`pool`] to the database at `url` (one [`create_database`] made, or
/// `db`'s with other options), `db`'s other settings.
pub fn pool_of_url(db: Database, url: &str) -> kit::db::PgPool {
    let mut settings = kit::settings::DatabaseSettings::local(db.name());
    settings.url = url.to_owned();
    settings.pool_size = 4;
    kit::db::pool(&settings).expect("pool")
}

/// Relay settings for a relay that must not see its own lease run out or a
/// confirm time out (a republish, so a duplicate) because the machine
/// stalls: tests that count duplicates or spans exactly, where no crash of
/// this relay is involved. A takeover of a dead relay's rows depends on the
/// dead relay's lease, not on these.
pub const PATIENT_RELAY: [(&str, &str); 2] = [
    ("OUTBOX_RELAY__RELAY__LEASE_MS", "600000"),
    ("OUTBOX_RELAY__RELAY__CONFIRM_TIMEOUT_MS", "300000"),
];

/// A TCP port for a service to listen on: free now, and handed out once
/// per test process.
///
/// Not the kernel's pick (`bind(:0)`): that comes from the ephemeral range,
/// where it may be handed out again (to the next `bind(:0)`, or as the
/// source port of any outgoing connection) before the service binds it, and
/// two services on one port made a test talk to the wrong one (a relay that
/// never bound its port, so relayed nothing, "ready" through another
/// service's `/readyz`; a receipt answered 404 by another service). These ports lie
/// below the ephemeral range (no connection takes them as its source port)
/// and come from one counter, starting at an offset of the process id (the
/// test binaries run one after another; no reuse right away).
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);
    let (low, high) = service_port_range();
    let span = u32::from(high - low);
    let _ = NEXT.compare_exchange(
        u32::MAX,
        std::process::id().wrapping_mul(97) % span,
        Ordering::Relaxed,
        Ordering::Relaxed,
    );
    for _ in 0..span {
        let offset = NEXT.fetch_add(1, Ordering::Relaxed) % span;
        let port = low + u16::try_from(offset).expect("within the range");
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port in {low}..{high}");
}

/// Ports for the services under test: below the kernel's ephemeral range
/// (`ip_local_port_range`, by default 32768-60999), above the well-known
/// ones and the infrastructure's (PostgreSQL 5432, RabbitMQ 5672, 15672,
/// 25672).
fn service_port_range() -> (u16, u16) {
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    if ephemeral_low > 27000 {
        (26000, ephemeral_low - 1)
    } else {
        // An unusual ephemeral range starting low: above it.
        (61000, 65000)
    }
}

/// Path of a workspace binary, next to the test executable's directory
/// (`target/<profile>/`). `make test` builds them before running the tests.
/// `SERVICE_BIN_DIR` overrides the directory (the benchmark runs release
/// binaries from its own target directory).
pub fn bin(name: &str) -> PathBuf {
    if let Some(dir) = std::env::var_os("SERVICE_BIN_DIR") {
        return PathBuf::from(dir).join(name);
    }
    let exe = std::env::current_exe().expect("current exe");
    let dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target dir");
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} not built: run `make build` first (the binaries with their fail points; make test does)",
        path.display()
    );
    path
}

/// A service binary running as a child process; killed (SIGKILL) on drop.
pub struct Service {
    pub name: String,
    child: Child,
}

impl Service {
    /// Start `name` with `env` added to the inherited environment.
    pub fn start(name: &str, args: &[&str], env: &[(&str, String)]) -> Self {
        Self::start_with_output(name, args, env, None)
    }

    /// [`Service::start`], its stdout and stderr written to the file
    /// `output` (created) when given, instead of the test's own.
    pub fn start_with_output(
        name: &str,
        args: &[&str],
        env: &[(&str, String)],
        output: Option<&std::path::Path>,
    ) -> Self {
        let mut command = Command::new(bin(name));
        command
            .args(args)
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .stdin(Stdio::null());
        if let Some(path) = output {
            let file = std::fs::File::create(path)
                .unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
            command
                .stdout(file.try_clone().expect("output file"))
                .stderr(file);
        }
        let child = command
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {name}: {e}"));
        Self {
            name: name.to_owned(),
            child,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Send a signal by name (`TERM`, `KILL`, `INT`).
    pub fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(self.pid().to_string())
            .status()
            .expect("kill");
        assert!(status.success(), "kill -{signal} {}", self.pid());
    }

    /// Wait until `url` (one of this process's health routes) answers 200,
    /// at most `timeout`; then the answer must have come from this process:
    /// it fails when the process has exited with an error (it could not bind
    /// its port, say), which leaves the answer to some other process. Dying
    /// by a signal is a fail point's abort, which may fire this early.
    pub async fn wait_ready(&mut self, url: &str, timeout: Duration) -> Result<String, String> {
        let body = wait_for_ok(url, timeout).await?;
        match self.exited_with_code() {
            Some(status) => Err(format!(
                "{url} answered, but {} (pid {}) exited: {status}",
                self.name,
                self.pid()
            )),
            None => Ok(body),
        }
    }

    /// The exit status, if the process has exited with an exit code (not
    /// by a signal: that is a fail point's abort).
    pub fn exited_with_code(&mut self) -> Option<ExitStatus> {
        self.wait_exit(Duration::ZERO)
            .filter(|status| status.code().is_some())
    }

    /// Wait for the process to exit, at most `timeout`.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Poll `url` until it answers 200, at most `timeout`; returns the body.
pub async fn wait_for_ok(url: &str, timeout: Duration) -> Result<String, String> {
    let client = reqwest::Client::new();
    let deadline = Instant::now() + timeout;
    let mut last = String::from("never answered");
    while Instant::now() < deadline {
        match client.get(url).timeout(Duration::from_secs(2)).send().await {
            Ok(response) if response.status().is_success() => {
                return response.text().await.map_err(|e| e.to_string());
            }
            Ok(response) => {
                last = format!(
                    "{}: {}",
                    response.status(),
                    response.text().await.unwrap_or_default()
                )
            }
            Err(error) => last = error.to_string(),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(format!("{url} not OK after {timeout:?}: {last}"))
}

/// Seed 003's order 1042 written straight into the orders database under a
/// new `tenant` (as order-api would after its OrderPlaced: sequence 1), with
/// its one line written without a tenant, as a binary from before orders V6
/// did (the trigger fills in the order's).
pub async fn insert_seed_order(orders: &tokio_postgres::Client, tenant: &str, order: uuid::Uuid) {
    orders
        .execute("INSERT INTO tenants (tenant_id) VALUES ($1)", &[&tenant])
        .await
        .expect("tenant");
    insert_another_seed_order(orders, tenant, order).await;
}

/// [`insert_seed_order`] for a tenant that exists already.
pub async fn insert_another_seed_order(
    orders: &tokio_postgres::Client,
    tenant: &str,
    order: uuid::Uuid,
) {
    orders
        .execute(
            "INSERT INTO orders (order_id, tenant_id, customer_id, currency, location, \
             merchandise_minor, shipping_minor, tax_minor, total_minor, last_event_sequence) \
             VALUES ($1, $2, '77', 'USD', 'WH-1', 8000, 500, 800, 9300, 1)",
            &[&order, &tenant],
        )
        .await
        .expect("order");
    orders
        .execute(
            "INSERT INTO order_lines (order_id, line_no, sku, qty, unit_price_minor, unit_cost_minor) \
             VALUES ($1, 1, 'JKT-M', 2, 4000, 2200)",
            &[&order],
        )
        .await
        .expect("line");
}

/// The seed 003 order's payment and delivery journals as the ledger posts
/// them (`ops::seed`, which `demo` checks too).
pub use ops::seed::{
    DELIVERY_JOURNAL as SEED_DELIVERY_JOURNAL, PAYMENT_JOURNAL as SEED_PAYMENT_JOURNAL,
};

/// Insert the header of a journal entry `entry` of `event_type` for `order`
/// (no lines; description `test`, currency USD) in `tx`.
pub async fn insert_journal_entry(
    tx: &impl tokio_postgres::GenericClient,
    entry: uuid::Uuid,
    tenant: &str,
    order: uuid::Uuid,
    event_type: &str,
) {
    tx.execute(
        "INSERT INTO journal_entries (entry_id, tenant_id, order_id, event_id, event_type, \
           description, currency) VALUES ($1, $2, $3, $1, $4, 'test', 'USD')",
        &[&entry, &tenant, &order, &event_type],
    )
    .await
    .expect("journal entry");
}

/// Post a journal entry of `event_type` for `order` with `lines` (account,
/// debit, credit), as the ledger would: one transaction. Its id, or the
/// database's refusal at commit (an unbalanced entry).
pub async fn post_journal(
    ledger: &mut tokio_postgres::Client,
    tenant: &str,
    order: uuid::Uuid,
    event_type: &str,
    lines: &[(&str, i64, i64)],
) -> Result<uuid::Uuid, tokio_postgres::Error> {
    let entry = uuid::Uuid::now_v7();
    let tx = ledger.transaction().await.expect("tx");
    write_journal(&tx, entry, tenant, order, event_type, lines).await;
    tx.commit().await.map(|()| entry)
}

/// Write journal entry `entry` of `event_type` for `order` with `lines`
/// (account, debit, credit) in `tx`, not committed.
pub async fn write_journal(
    tx: &tokio_postgres::Transaction<'_>,
    entry: uuid::Uuid,
    tenant: &str,
    order: uuid::Uuid,
    event_type: &str,
    lines: &[(&str, i64, i64)],
) {
    insert_journal_entry(tx, entry, tenant, order, event_type).await;
    for (i, (account, debit, credit)) in lines.iter().enumerate() {
        let line_no = i32::try_from(i + 1).expect("line number");
        tx.execute(
            "INSERT INTO journal_lines (entry_id, line_no, tenant_id, account_code, debit, credit) \
             VALUES ($1, $2, $3, $4, $5, $6)",
            &[&entry, &line_no, &tenant, account, debit, credit],
        )
        .await
        .expect("journal line");
    }
}

/// Delete an order [`insert_seed_order`] made (its lines, then the order).
pub async fn delete_seed_order(orders: &tokio_postgres::Client, order: uuid::Uuid) {
    for table in ["order_lines", "orders"] {
        orders
            .execute(
                &format!("DELETE FROM {table} WHERE order_id = $1"),
                &[&order],
            )
            .await
            .expect("clean up");
    }
}

/// A tenant id no other test uses.
pub fn unique_tenant(prefix: &str) -> String {
    format!(
        "{prefix}-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    )
}

/// The real CLI's `order-api api-key create --tenant <tenant>`, not run.
pub fn api_key_command(tenant: &str) -> Command {
    let mut command = Command::new(bin("order-api"));
    command.args(["api-key", "create", "--tenant", tenant]);
    command
}

/// Create a tenant and an API key with the real CLI (`order-api api-key create`).
pub fn api_key(tenant: &str) -> String {
    let output = api_key_command(tenant)
        .output_within()
        .expect("run order-api api-key create");
    assert!(
        output.status.success(),
        "api-key create failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let key = String::from_utf8(output.stdout)
        .expect("utf-8")
        .trim()
        .to_owned();
    assert!(key.starts_with("oek_"), "unexpected key output {key:?}");
    key
}

/// A running order-api on a free port.
pub struct OrderApi {
    pub service: Service,
    pub base: String,
}

impl OrderApi {
    /// Start order-api with `env` (e.g. `FAILPOINTS`, idempotency settings) and
    /// wait until it is ready.
    pub async fn start(env: &[(&str, String)]) -> Self {
        Self::start_with_output(env, None).await
    }

    /// [`OrderApi::start`], its output (the logs) written to the file
    /// `output` when given.
    pub async fn start_with_output(
        env: &[(&str, String)],
        output: Option<&std::path::Path>,
    ) -> Self {
        let port = free_port();
        let mut all = vec![
            ("ORDER_API__HTTP__PORT", port.to_string()),
            ("RUST_LOG", "warn".to_owned()),
        ];
        all.extend(env.iter().cloned());
        let mut service = Service::start_with_output("order-api", &[], &all, output);
        let base = format!("http://127.0.0.1:{port}");
        service
            .wait_ready(&format!("{base}/readyz"), Duration::from_secs(60))
            .await
            .expect("order-api ready");
        Self { service, base }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }
}

/// The text of a service's output file, the file removed.
pub fn take_log(path: &std::path::Path) -> String {
    let output =
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let _ = std::fs::remove_file(path);
    output
}

/// The lines of a service's JSON log (`LOG_FORMAT=json`, the default) at
/// level ERROR: none on a clean stop (an alert on error lines must not fire
/// on every deploy).
pub fn error_lines(log: &str) -> Vec<&str> {
    log.lines()
        .filter(|line| line.contains("\"level\":\"ERROR\""))
        .collect()
}

/// Assert that a service's JSON log shows a clean stop: its `stopped`
/// message, and no line at level ERROR.
pub fn assert_clean_stop(log: &str, stopped: &str) {
    assert!(
        log.contains(&format!("\"{stopped}\"")),
        "no {stopped:?} in:\n{log}"
    );
    let errors = error_lines(log);
    assert!(
        errors.is_empty(),
        "error lines on a clean stop: {errors:#?}"
    );
}

pub mod consumers;
pub mod otlp;
pub mod system;

/// Other engineers' tests and benchmarks break when PostgreSQL or RabbitMQ
/// restart (or block publishers) under them: wait until no other test
/// binary (any cargo test executable, `.../deps/<name>-<hash>`, of any
/// checkout) and no benchmark runs on this machine; fail after 10 minutes
/// rather than break them. (`cargo test` runs its binaries one after
/// another, so within one `make test` this only waits for nothing.) A
/// system started by `make run` is not detected: it sees the fault too.
pub async fn wait_for_quiet_machine(own: &str) {
    const OTHERS: &str = r"/deps/[a-z0-9_]+-[0-9a-f]{16}( |$)|bench-release/bench( |$)";
    let me = std::process::id().to_string();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(600);
    loop {
        let output = std::process::Command::new("pgrep")
            .args(["-f", OTHERS])
            .output()
            .expect("pgrep");
        let others: Vec<String> = String::from_utf8_lossy(&output.stdout)
            .split_whitespace()
            .filter(|pid| *pid != me)
            .map(str::to_owned)
            .collect();
        if others.is_empty() {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{own}: other tests or benchmarks (pids {others:?}) still run after 10 minutes; \
             this test injects a fault into the shared PostgreSQL or RabbitMQ: run it alone"
        );
        println!("{own}: waiting for other tests or benchmarks (pids {others:?}) to finish before touching the infrastructure");
        tokio::time::sleep(std::time::Duration::from_secs(5)).await;
    }
}

/// `scripts/infra-restart.sh <args>` (restarts, the broker's memory alarm).
pub async fn infra_script(args: &[&str]) -> String {
    let script =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/infra-restart.sh");
    let output = tokio::process::Command::new("bash")
        .arg(script)
        .args(args)
        .output()
        .await
        .expect("infra-restart.sh");
    assert!(
        output.status.success(),
        "infra-restart {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).trim().to_owned()
}

/// A TCP proxy in front of a server (RabbitMQ, say) that a test can pause:
/// while paused, what either side sends is held, not forwarded, so to the
/// client the server stops answering (a stalled broker, a network stall)
/// without touching the shared server or anyone else's connections.
/// Resumed, the held bytes flow on in order. It can also cut the client off
/// (the server unreachable: open connections closed, new ones closed at
/// once) until it is restored.
pub struct PausableProxy {
    /// The server's URL with the proxy's host and port.
    pub url: String,
    paused: tokio::sync::watch::Sender<bool>,
    cut: tokio::sync::watch::Sender<bool>,
    accept: tokio::task::JoinHandle<()>,
}

impl PausableProxy {
    /// Listen on a free port and forward every connection to the server of
    /// `url` (`scheme://[user:password@]host:port[/rest]`).
    pub async fn start(url: &str) -> Self {
        let (scheme, rest) = url.split_once("://").expect("scheme://");
        let (user, after) = rest.rsplit_once('@').map_or(("", rest), |(u, a)| (u, a));
        let (upstream, path) = after.split_at(after.find('/').unwrap_or(after.len()));
        let upstream = upstream.to_owned();
        let port = free_port();
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
            .await
            .expect("proxy listener");
        let (paused, _) = tokio::sync::watch::channel(false);
        let (cut, _) = tokio::sync::watch::channel(false);
        let (gate, cutter) = (paused.clone(), cut.clone());
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                if *cutter.borrow() {
                    continue; // dropped: closed at once
                }
                let Ok(server) = tokio::net::TcpStream::connect(&upstream).await else {
                    continue;
                };
                let (client_read, client_write) = client.into_split();
                let (server_read, server_write) = server.into_split();
                tokio::spawn(pipe(
                    client_read,
                    server_write,
                    gate.subscribe(),
                    cutter.subscribe(),
                ));
                tokio::spawn(pipe(
                    server_read,
                    client_write,
                    gate.subscribe(),
                    cutter.subscribe(),
                ));
            }
        });
        let at = if user.is_empty() { "" } else { "@" };
        Self {
            url: format!("{scheme}://{user}{at}127.0.0.1:{port}{path}"),
            paused,
            cut,
            accept,
        }
    }

    pub fn pause(&self) {
        self.paused.send_replace(true);
    }

    pub fn resume(&self) {
        self.paused.send_replace(false);
    }

    /// Close every open connection, and every new one at once, until
    /// [`PausableProxy::restore`].
    pub fn cut(&self) {
        self.cut.send_replace(true);
    }

    pub fn restore(&self) {
        self.cut.send_replace(false);
    }
}

impl Drop for PausableProxy {
    fn drop(&mut self) {
        self.accept.abort();
        // Open connections end when either side closes them.
        self.resume();
    }
}

/// Copy `from` to `to`, holding each chunk while the proxy is paused, until
/// either side closes or the proxy is cut (both halves are then dropped: the
/// connection is closed).
async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut paused: tokio::sync::watch::Receiver<bool>,
    mut cut: tokio::sync::watch::Receiver<bool>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buffer = vec![0_u8; 64 * 1024];
    loop {
        let read = tokio::select! {
            read = from.read(&mut buffer) => match read {
                Ok(0) | Err(_) => break,
                Ok(read) => read,
            },
            Ok(_) = cut.wait_for(|cut| *cut) => return,
        };
        if paused.wait_for(|paused| !*paused).await.is_err()
            || to.write_all(&buffer[..read]).await.is_err()
        {
            break;
        }
    }
    let _ = to.shutdown().await;
}

/// Index entries `work` read from `index` (`pg_stat_user_indexes`), run
/// while a repeatable-read snapshot older than it is open on another
/// session of the database at `url` (a long report, a drift check: deleted
/// rows stay in the index for it). Counted once every other client session
/// of the database has ended: a backend saves its counters as it exits,
/// which may come after its client's.
pub async fn index_reads_under_an_old_snapshot(
    url: &str,
    index: &str,
    work: impl std::future::Future<Output = ()>,
) -> i64 {
    let db = connect_url(url).await;
    let mut holder = connect_url(url).await;
    let snapshot = holder.transaction().await.expect("begin");
    snapshot
        .batch_execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ; SELECT 1")
        .await
        .expect("snapshot");
    // The sessions open before the work (the caller's too) stay.
    let sessions = "SELECT pid FROM pg_stat_activity \
                    WHERE datname = current_database() AND backend_type = 'client backend'";
    let present: Vec<i32> = db
        .query(sessions, &[])
        .await
        .expect("pg_stat_activity")
        .iter()
        .map(|row| row.get(0))
        .collect();
    let reads = || async {
        db.batch_execute("SELECT pg_stat_clear_snapshot()")
            .await
            .expect("fresh counters");
        db.query_one(
            "SELECT idx_tup_read FROM pg_stat_user_indexes \
             WHERE schemaname = 'public' AND indexrelname = $1",
            &[&index],
        )
        .await
        .expect("index counters")
        .get::<_, i64>(0)
    };
    let before = reads().await;
    work.await;
    consumers::eventually(
        "the work's sessions ended",
        Duration::from_secs(30),
        || async {
            let left = db
                .query(sessions, &[])
                .await
                .expect("pg_stat_activity")
                .iter()
                .any(|row| !present.contains(&row.get(0)));
            (!left).then_some(())
        },
    )
    .await;
    let read = reads().await - before;
    snapshot.rollback().await.expect("rollback");
    read
}

/// After a cleanup of `rows` rows of `table` measured by
/// [`index_reads_under_an_old_snapshot`] (`read`): none of them is left,
/// and about one index entry was read per row deleted (batches of 100 that
/// each walked again from the start read about rows² / 200).
pub async fn deleted_each_row_once(db: &tokio_postgres::Client, table: &str, rows: i64, read: i64) {
    let left: i64 = db
        .query_one(&format!("SELECT count(*) FROM {table}"), &[])
        .await
        .expect("count")
        .get(0);
    assert_eq!(left, 0, "{table}: rows left");
    assert!(
        read <= 3 * rows,
        "{read} index entries read to delete {rows} rows of {table} (quadratic: ~{})",
        rows * rows / 200
    );
}
