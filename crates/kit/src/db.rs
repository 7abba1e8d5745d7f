//! PostgreSQL connection pools (deadpool-postgres over tokio-postgres).

use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, QueueMode, RecyclingMethod, Runtime};
use tokio_postgres::NoTls;
use tokio_util::sync::CancellationToken;

use crate::settings::{redact_url, DatabaseSettings};

pub use deadpool_postgres::{
    Object as Client, Pool as PgPool, PoolError, TimeoutType, Transaction,
};

#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error("bad database url {url}: {source}")]
    BadUrl {
        url: String,
        source: tokio_postgres::Error,
    },
    #[error("building the pool: {0}")]
    Build(String),
    #[error("shut down while waiting for the database")]
    Cancelled,
}

/// The server-side bounds of a service's sessions: no statement runs longer
/// than 30 s, and a transaction left idle for 60 s (a client that hangs or
/// lost its network mid-transaction) is ended by the server, releasing its
/// row locks (claimed outbox rows, an order's progress row, stock levels)
/// for the other instances. The server probes an idle session's client
/// (TCP keepalive after 15 s, 3 probes 5 s apart, as the client does:
/// [`bound_network_waits`]): a session whose host vanished between
/// statements, holding a session-level advisory lock (the relay's cleanup, a
/// redrive) or not, ends within about 30 s, not the kernel's two hours.
pub const SESSION_LIMITS: &str =
    "-c statement_timeout=30000 -c idle_in_transaction_session_timeout=60000 \
     -c tcp_keepalives_idle=15 -c tcp_keepalives_interval=5 -c tcp_keepalives_count=3";

/// Bound how long a session can wait on a server it can no longer reach
/// (a network partition, a host that vanished without a reset): the
/// server-side limits ([`SESSION_LIMITS`]) cannot end a wait whose server
/// is gone, and the kernel's keepalive default notices after two hours. A
/// dead peer is found within about 30 s: TCP keepalive after 15 s idle, then
/// 3 probes 5 s apart; `tcp_user_timeout` 30 s for data sent and never
/// acknowledged; the socket's connect at most 5 s (the whole opening of a
/// connection outside a pool: [`CONNECT_LIMIT`]; a pool's: its create
/// timeout). A live server answers the probes,
/// so a long statement is not cut. Values given in the database URL
/// (`keepalives_idle`, `tcp_user_timeout`, ...) are kept, except a
/// `keepalives_idle` equal to the library's default (2 h), which cannot be
/// told from an absent one.
pub fn bound_network_waits(config: &mut tokio_postgres::Config) {
    if config.get_keepalives_idle() == tokio_postgres::Config::new().get_keepalives_idle() {
        config.keepalives_idle(Duration::from_secs(15));
    }
    if config.get_keepalives_interval().is_none() {
        config.keepalives_interval(Duration::from_secs(5));
    }
    if config.get_keepalives_retries().is_none() {
        config.keepalives_retries(3);
    }
    if config.get_tcp_user_timeout().is_none() {
        config.tcp_user_timeout(Duration::from_secs(30));
    }
    if config.get_connect_timeout().is_none() {
        config.connect_timeout(Duration::from_secs(5));
    }
}

/// This build connects without TLS (`NoTls`): a URL that requires it
/// (`sslmode=require`) could never connect, and a service would wait for
/// its database forever. A configuration error to stop on instead.
fn refuse_tls(config: &tokio_postgres::Config, url: &str) -> Result<(), DbError> {
    match config.get_ssl_mode() {
        tokio_postgres::config::SslMode::Disable | tokio_postgres::config::SslMode::Prefer => {
            Ok(())
        }
        _ => Err(DbError::Build(format!(
            "database url {}: sslmode requires TLS, which this build does not have \
             (use sslmode=prefer or disable on a trusted network)",
            redact_url(url)
        ))),
    }
}

/// One connection outside a pool (a cleanup run holding an advisory lock,
/// an operator command), with [`bound_network_waits`]. Spawn the returned
/// connection to drive it.
pub async fn connect(
    url: &str,
) -> anyhow::Result<(
    tokio_postgres::Client,
    tokio_postgres::Connection<tokio_postgres::Socket, tokio_postgres::tls::NoTlsStream>,
)> {
    let mut config: tokio_postgres::Config = url.parse()?;
    bound_network_waits(&mut config);
    connect_with(&config).await
}

/// How long opening a connection outside a pool may take in all (at least;
/// longer when the URL's `connect_timeout` times its hosts asks for more):
/// the socket's connect is bounded by `connect_timeout`, but not the
/// startup and authentication exchange after it (a peer that accepts the
/// connection and never answers: a frozen server, a proxy whose upstream
/// hangs).
pub const CONNECT_LIMIT: Duration = Duration::from_secs(10);

/// `config.connect(NoTls)` within [`CONNECT_LIMIT`] (for `config`s that
/// need more than [`connect`]'s URL: an application name, session limits).
pub async fn connect_with(
    config: &tokio_postgres::Config,
) -> anyhow::Result<(
    tokio_postgres::Client,
    tokio_postgres::Connection<tokio_postgres::Socket, tokio_postgres::tls::NoTlsStream>,
)> {
    // A URL's own longer connect_timeout (a database that starts cold) is
    // kept: each of its hosts may take it, and the exchange 5 s more.
    let hosts = u32::try_from(config.get_hosts().len().max(1)).unwrap_or(u32::MAX);
    let limit = config
        .get_connect_timeout()
        .map_or(CONNECT_LIMIT, |per_host| {
            CONNECT_LIMIT.max(per_host.saturating_mul(hosts) + Duration::from_secs(5))
        });
    match tokio::time::timeout(limit, config.connect(NoTls)).await {
        Ok(connected) => Ok(connected?),
        Err(_) => anyhow::bail!("no answer from the database within {limit:?} of connecting"),
    }
}

/// Give a session opened outside a pool the services' server-side bounds
/// ([`SESSION_LIMITS`]); options the URL sets come after them, so they win.
pub fn bound_session(config: &mut tokio_postgres::Config) {
    let merged = merged_options(SESSION_LIMITS, config.get_options());
    config.options(&merged);
}

/// [`bound_session`] for an operator command's own session
/// ([`COMMAND_SESSION_LIMITS`]: no statement bound).
pub fn bound_command_session(config: &mut tokio_postgres::Config) {
    let merged = merged_options(COMMAND_SESSION_LIMITS, config.get_options());
    config.options(&merged);
}

/// The service's session options followed by the URL's own (`options=-c
/// search_path=...`): both apply, and a setting the URL names again wins
/// (PostgreSQL takes the last `-c` of a name), as URL values do in
/// [`bound_network_waits`].
fn merged_options(ours: &str, url: Option<&str>) -> String {
    match url.map(str::trim).filter(|url| !url.is_empty()) {
        Some(url) => format!("{ours} {url}"),
        None => ours.to_owned(),
    }
}

/// The bound of the operator commands' sessions (`migrate`, `requeue`,
/// `replay`, `redrive`): a transaction left idle 60 s (the command
/// suspended, its network lost between a write and its COMMIT) is ended by
/// the server, its row locks released. No statement bound: a replay's page
/// over a long retained history, a migration, may take longer than a
/// service's statement.
/// The server's keepalive probes as in [`SESSION_LIMITS`].
pub const COMMAND_SESSION_LIMITS: &str = "-c idle_in_transaction_session_timeout=60000 \
     -c tcp_keepalives_idle=15 -c tcp_keepalives_interval=5 -c tcp_keepalives_count=3";

/// Build a pool for an operator command ([`COMMAND_SESSION_LIMITS`]).
/// Connections are opened lazily, so this never touches the network; use
/// [`wait_until_ready`] to wait for the server.
pub fn pool(settings: &DatabaseSettings) -> Result<Pool, DbError> {
    pool_with_options(settings, Some(COMMAND_SESSION_LIMITS))
}

/// Like [`pool`], with server settings for every session of the pool, e.g.
/// `-c lock_timeout=2000 -c statement_timeout=10000` (bounds every lock wait).
pub fn pool_with_options(
    settings: &DatabaseSettings,
    options: Option<&str>,
) -> Result<Pool, DbError> {
    build_pool(settings, options, None)
}

/// Like [`pool_with_options`], every session named `application_name` (in
/// `pg_stat_activity`, the server's log), so that operators and tests find
/// the service's backends; an `application_name` the URL gives wins.
pub fn named_pool(
    settings: &DatabaseSettings,
    options: Option<&str>,
    application_name: &str,
) -> Result<Pool, DbError> {
    build_pool(settings, options, Some(application_name))
}

fn build_pool(
    settings: &DatabaseSettings,
    options: Option<&str>,
    application_name: Option<&str>,
) -> Result<Pool, DbError> {
    if settings.pool_size == 0 {
        return Err(DbError::Build(
            "database.pool_size must be at least 1".to_owned(),
        ));
    }
    // 0 would make every checkout fail at once whenever all connections are
    // busy (deadpool then only tries): a 503, or "database down", under any
    // burst.
    if settings.acquire_timeout_ms == 0 {
        return Err(DbError::Build(
            "database.acquire_timeout_ms must be at least 1 (0 would fail every wait for a busy pool at once)"
                .to_owned(),
        ));
    }
    let mut pg: tokio_postgres::Config =
        settings.url.parse().map_err(|source| DbError::BadUrl {
            url: redact_url(&settings.url),
            source,
        })?;
    refuse_tls(&pg, &settings.url)?;
    if let Some(options) = options {
        let merged = merged_options(options, pg.get_options());
        pg.options(&merged);
    }
    if let (Some(name), None) = (application_name, pg.get_application_name()) {
        pg.application_name(name);
    }
    bound_network_waits(&mut pg);
    let manager = Manager::from_config(
        pg,
        NoTls,
        ManagerConfig {
            // `Fast`: a connection whose socket the server closed (a restart,
            // an admin kill) is discarded at checkout, because its connection
            // task has ended (`is_closed`). `Verified` also sent a query on
            // every checkout: one more round trip per transaction, 1 in 8 of
            // the order transaction's (make bench). It never closed the race
            // anyway (the server can die between the check and the use); every
            // caller retries a statement that fails on a dead connection: the
            // relay's claim/mark retries, the consumers' in-place retry, the
            // API's 503 + Retry-After under the same Idempotency-Key.
            recycling_method: RecyclingMethod::Fast,
        },
    );
    Pool::builder(manager)
        .max_size(settings.pool_size)
        // The most recently returned connection first: a handful of hot
        // connections (and server backends) do the work instead of every
        // connection of the pool taking turns. Each statement round trip of a
        // consumer was ~40 µs faster (make bench-consumers: 68-76 % -> 78-81 %
        // of the raw transaction); idle connections are left alone.
        .queue_mode(QueueMode::Lifo)
        .wait_timeout(Some(Duration::from_millis(settings.acquire_timeout_ms)))
        .create_timeout(Some(Duration::from_secs(5)))
        .recycle_timeout(Some(Duration::from_secs(5)))
        .runtime(Runtime::Tokio1)
        .build()
        .map_err(|e| DbError::Build(e.to_string()))
}

/// SQLSTATEs that stay with the session that got them: a read-only
/// transaction (`25006`: the session reached a standby, through a name that
/// pointed there during a failover, and will write nowhere for its life)
/// and a cached plan whose result type a migration changed (`0A000`: every
/// run of that prepared statement on the session fails). The same work on
/// another session may succeed; on this one it fails until the session
/// ends, which a pool that checks only for a closed connection never does.
pub fn session_fault_sqlstate(code: &str) -> bool {
    code == "25006" || code == "0A000"
}

/// Whether `error`, or the first PostgreSQL error in its chain of sources,
/// is a [`session_fault_sqlstate`].
pub fn session_fault(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(error);
    while let Some(error) = next {
        if let Some(postgres) = error.downcast_ref::<tokio_postgres::Error>() {
            return postgres
                .code()
                .is_some_and(|code| session_fault_sqlstate(code.code()));
        }
        next = error.source();
    }
    false
}

/// `work` on a connection of `pool`, which is closed instead of going back
/// to the pool when the work failed with a [`session_fault`]: the retry
/// takes another session (a new one reaches the name's current primary),
/// where the pool, handing out the last connection returned first, would
/// give the failing one back every time.
pub async fn on_session<T>(
    pool: &Pool,
    work: impl AsyncFnOnce(&mut Client) -> anyhow::Result<T>,
) -> anyhow::Result<T> {
    let mut client = pool.get().await?;
    let result = work(&mut client).await;
    if let Err(error) = &result {
        if session_fault(error.as_ref()) {
            tracing::warn!(
                error = format!("{error:#}"),
                "closing the database session: it cannot do this work for its life"
            );
            drop(deadpool_postgres::Object::take(client));
        }
    }
    result
}

/// SQLSTATE classes and codes that say "try again", not "this request or
/// event is wrong": connection exceptions (`08`), insufficient resources
/// (`53`), an administrator or crash shutdown (`57P`), a statement cancelled
/// by `statement_timeout` or an operator (`57014`: a stalled disk, a lock
/// held by a hung session), a session ended by
/// `idle_in_transaction_session_timeout` (`25P03`, [`SESSION_LIMITS`]), a
/// serialization failure (`40001`), a deadlock (`40P01`), a `lock_timeout`
/// (`55P03`). The statement did nothing and may succeed again as it is.
pub fn transient_sqlstate(code: &str) -> bool {
    code.starts_with("08")
        || code.starts_with("53")
        || code.starts_with("57P")
        || code == "57014"
        || code == "25P03"
        || code == "40001"
        || code == "40P01"
        || code == "55P03"
}

/// Whether `error` may not happen again: a server error of a
/// [`transient_sqlstate`], or no answer from the server (the connection was
/// closed, or reading, writing or connecting failed). Not a constraint, a
/// trigger's exception or bad SQL, nor an error the client raised by itself
/// (a value that does not convert, a bad configuration, a failed
/// authentication): trying again would fail the same way.
pub fn transient(error: &tokio_postgres::Error) -> bool {
    match error.as_db_error() {
        Some(db) => transient_sqlstate(db.code().code()),
        // An I/O error of the connection, not one of tokio-postgres's own
        // checks that it reports as I/O (a value it cannot encode, a
        // message it cannot parse, a SCRAM exchange it refuses).
        None => {
            error.is_closed()
                || std::error::Error::source(error)
                    .and_then(|source| source.downcast_ref::<std::io::Error>())
                    .is_some_and(|io| {
                        !matches!(
                            io.kind(),
                            std::io::ErrorKind::InvalidInput | std::io::ErrorKind::InvalidData
                        )
                    })
        }
    }
}

/// Whether a failed database call failed because the database cannot be
/// reached or cannot serve now, as opposed to the call's own problem or a
/// contention a live server reports (a lock or statement timeout, a
/// deadlock, a serialization failure): the first pool or PostgreSQL error
/// in `error`'s chain of sources is a pool timeout, or no answer from the
/// server ([`transient`] without a SQLSTATE), or a connection exception
/// (`08`), insufficient resources (`53`) or a server shutting down or
/// starting (`57P`). An error with neither in its chain (e.g. an injected
/// fault) counts as unavailable.
pub fn unavailable(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(error);
    while let Some(error) = next {
        if let Some(pool) = error.downcast_ref::<deadpool_postgres::PoolError>() {
            match pool {
                deadpool_postgres::PoolError::Timeout(_) => return true,
                deadpool_postgres::PoolError::Closed
                | deadpool_postgres::PoolError::NoRuntimeSpecified => return false,
                // The backend's error, or the hook's: its source.
                deadpool_postgres::PoolError::Backend(_)
                | deadpool_postgres::PoolError::PostCreateHook(_) => {}
            }
        }
        if let Some(postgres) = error.downcast_ref::<tokio_postgres::Error>() {
            return match postgres.as_db_error() {
                None => transient(postgres),
                Some(db) => {
                    let code = db.code().code();
                    code.starts_with("08") || code.starts_with("53") || code.starts_with("57P")
                }
            };
        }
        next = error.source();
    }
    true
}

/// `error` and its causes, on one line. tokio-postgres writes only its
/// kind ("db error", "error connecting to server"): the server's message
/// (with its SQLSTATE), or the I/O error under a failed connection, is in
/// the chain of causes, which every log line and message of a database
/// failure needs.
pub fn describe(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut next = error.source();
    while let Some(cause) = next {
        let part = cause.to_string().replace('\n', "; ");
        if !text.ends_with(&part) {
            text.push_str(": ");
            text.push_str(&part);
        }
        if let Some(db) = cause.downcast_ref::<tokio_postgres::error::DbError>() {
            text.push_str(&format!(" (SQLSTATE {})", db.code().code()));
        }
        next = cause.source();
    }
    text
}

/// Wait (with capped exponential backoff) until the pool hands out a working
/// connection, or until `shutdown` is cancelled.
pub async fn wait_until_ready(pool: &Pool, shutdown: &CancellationToken) -> Result<(), DbError> {
    let mut delay = Duration::from_millis(100);
    loop {
        match ping(pool).await {
            Ok(()) => return Ok(()),
            Err(error) => {
                tracing::warn!(%error, retry_in_ms = delay.as_millis() as u64, "database not ready");
            }
        }
        tokio::select! {
            _ = shutdown.cancelled() => return Err(DbError::Cancelled),
            _ = tokio::time::sleep(delay) => {}
        }
        delay = (delay * 2).min(Duration::from_secs(5));
    }
}

/// One round trip to the server.
pub async fn ping(pool: &Pool) -> Result<(), String> {
    let client = pool.get().await.map_err(|e| describe(&e))?;
    client
        .simple_query("SELECT 1")
        .await
        .map(|_| ())
        .map_err(|e| describe(&e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_and_lost_connections_are_transient_data_errors_are_not() {
        for code in [
            "08006", // connection failure
            "53300", // too many connections
            "57P01", // admin shutdown
            "57014", // statement_timeout, or a cancelled statement
            "25P03", // idle_in_transaction_session_timeout
            "40001", // serialization failure
            "40P01", // deadlock
            "55P03", // lock_timeout
        ] {
            assert!(transient_sqlstate(code), "{code} is transient");
        }
        for code in [
            "22P02", "23505", "23514", "42P01", "54000", "P0001", "XX000",
        ] {
            assert!(!transient_sqlstate(code), "{code} is a bug or bad data");
        }
    }

    #[test]
    fn a_url_that_requires_tls_is_refused_at_start() {
        let with = |url: &str| {
            build_pool(
                &DatabaseSettings {
                    url: url.to_owned(),
                    pool_size: 1,
                    acquire_timeout_ms: 100,
                },
                None,
                None,
            )
        };
        let Err(refused) = with("postgres://app:secret@127.0.0.1/orders?sslmode=require") else {
            panic!("sslmode=require is refused");
        };
        let message = refused.to_string();
        assert!(message.contains("sslmode requires TLS"), "{message}");
        assert!(!message.contains("secret"), "{message}");
        for url in [
            "postgres://app@127.0.0.1/orders",
            "postgres://app@127.0.0.1/orders?sslmode=prefer",
            "postgres://app@127.0.0.1/orders?sslmode=disable",
        ] {
            assert!(with(url).is_ok(), "{url}");
        }
    }

    #[test]
    fn a_pool_of_no_connections_or_no_wait_is_refused() {
        let with = |pool_size, acquire_timeout_ms| {
            build_pool(
                &DatabaseSettings {
                    url: "postgres://app@127.0.0.1/orders".to_owned(),
                    pool_size,
                    acquire_timeout_ms,
                },
                None,
                None,
            )
            .err()
            .map(|error| error.to_string())
        };
        assert!(with(0, 100).is_some_and(|e| e.contains("database.pool_size")));
        assert!(with(1, 0).is_some_and(|e| e.contains("database.acquire_timeout_ms")));
        assert_eq!(with(1, 1), None);
    }

    #[tokio::test]
    async fn a_refused_connection_is_unavailable_through_the_pool_s_error() {
        // Nothing listens on port 1: the pool's Backend error wraps the
        // connect error, which has no SQLSTATE.
        let settings = DatabaseSettings {
            url: "postgres://nobody@127.0.0.1:1/none".to_owned(),
            pool_size: 1,
            acquire_timeout_ms: 1_000,
        };
        let error = pool(&settings)
            .expect("pool")
            .get()
            .await
            .expect_err("nothing listens on port 1");
        // Its text names the cause, not only the kind ("error connecting
        // to server", all tokio-postgres's own Display says).
        let text = describe(&error);
        assert!(
            text.contains("error connecting to server") && text.contains("refused"),
            "{text}"
        );
        let error = anyhow::Error::new(error).context("mark published");
        assert!(unavailable(error.as_ref()), "{error:#}");
        assert!(unavailable(&std::io::Error::other("not a database error")));
        let waited = deadpool_postgres::PoolError::Timeout(deadpool_postgres::TimeoutType::Wait);
        assert!(unavailable(&waited));
        assert!(!unavailable(&deadpool_postgres::PoolError::Closed));
    }

    #[test]
    fn an_error_the_client_raises_by_itself_is_not_transient() {
        let error = "postgres://app@localhost:notaport/orders"
            .parse::<tokio_postgres::Config>()
            .expect_err("a bad port");
        assert!(
            error.as_db_error().is_none() && !transient(&error),
            "{error}"
        );
        let error = anyhow::Error::new(error).context("connecting");
        assert!(!unavailable(error.as_ref()), "{error:#}");
    }

    #[test]
    fn the_url_s_session_options_are_kept_after_the_service_s() {
        let url: tokio_postgres::Config = "postgres://u@h/db?options=-c%20search_path%3Dapp"
            .parse()
            .expect("url");
        assert_eq!(url.get_options(), Some("-c search_path=app"));
        assert_eq!(
            merged_options(SESSION_LIMITS, url.get_options()),
            format!("{SESSION_LIMITS} -c search_path=app")
        );
        assert_eq!(merged_options(SESSION_LIMITS, None), SESSION_LIMITS);
        assert_eq!(merged_options(SESSION_LIMITS, Some(" ")), SESSION_LIMITS);
    }

    #[test]
    fn network_waits_are_bounded_unless_the_url_says_otherwise() {
        let mut config: tokio_postgres::Config =
            "postgres://app@localhost/orders".parse().expect("url");
        bound_network_waits(&mut config);
        assert_eq!(config.get_keepalives_idle(), Duration::from_secs(15));
        assert_eq!(
            config.get_keepalives_interval(),
            Some(Duration::from_secs(5))
        );
        assert_eq!(config.get_keepalives_retries(), Some(3));
        assert_eq!(
            config.get_tcp_user_timeout(),
            Some(&Duration::from_secs(30))
        );
        assert_eq!(config.get_connect_timeout(), Some(&Duration::from_secs(5)));
        assert!(config.get_keepalives());

        let mut config: tokio_postgres::Config =
            "postgres://app@localhost/orders?keepalives_idle=60&tcp_user_timeout=90&connect_timeout=7"
                .parse()
                .expect("url");
        bound_network_waits(&mut config);
        assert_eq!(config.get_keepalives_idle(), Duration::from_secs(60));
        assert_eq!(
            config.get_tcp_user_timeout(),
            Some(&Duration::from_secs(90))
        );
        assert_eq!(config.get_connect_timeout(), Some(&Duration::from_secs(7)));
    }
}
