//! HTTP plumbing shared by every service: `application/problem+json` errors
//! (RFC 9457) and the `/healthz`, `/readyz`, `/metrics` routes.

use std::time::Duration;

use actix_web::{
    dev::ServerHandle, http::StatusCode, web, HttpRequest, HttpResponse, HttpResponseBuilder,
    ResponseError,
};
use deadpool_postgres::Pool;
use prometheus::Registry;
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::amqp::Connected;

pub const PROBLEM_CONTENT_TYPE: &str = "application/problem+json";

/// An RFC 9457 problem. `code` is the stable, machine-readable identifier
/// clients match on; `title` and `detail` are for humans.
#[derive(Debug, Clone, Serialize)]
pub struct Problem {
    #[serde(rename = "type")]
    pub type_uri: String,
    pub title: String,
    pub status: u16,
    pub code: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// The request field at fault, for validation errors (e.g. `lines[0].qty`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
    /// Seconds, sent as the `Retry-After` header too.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retry_after: Option<u64>,
}

impl Problem {
    pub fn new(status: StatusCode, code: &'static str, title: impl Into<String>) -> Self {
        Self {
            type_uri: format!("/problems/{code}"),
            title: title.into(),
            status: status.as_u16(),
            code,
            detail: None,
            field: None,
            retry_after: None,
        }
    }

    pub fn detail(mut self, detail: impl Into<String>) -> Self {
        self.detail = Some(detail.into());
        self
    }

    pub fn field(mut self, field: impl Into<String>) -> Self {
        self.field = Some(field.into());
        self
    }

    pub fn retry_after(mut self, seconds: u64) -> Self {
        self.retry_after = Some(seconds);
        self
    }

    pub fn status_code(&self) -> StatusCode {
        StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }

    /// The exact bytes of the body (stored by the idempotency layer for replays).
    pub fn to_body(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.title, self.code)?;
        if let Some(detail) = &self.detail {
            write!(f, ": {detail}")?;
        }
        Ok(())
    }
}

impl ResponseError for Problem {
    fn status_code(&self) -> StatusCode {
        Problem::status_code(self)
    }

    fn error_response(&self) -> HttpResponse {
        let mut response = HttpResponseBuilder::new(self.status_code());
        response.content_type(PROBLEM_CONTENT_TYPE);
        if let Some(seconds) = self.retry_after {
            response.insert_header(("Retry-After", seconds.to_string()));
        }
        if self.status == StatusCode::UNAUTHORIZED.as_u16() {
            // RFC 9110 section 11.6.1: a 401 names the scheme it expects.
            response.insert_header(("WWW-Authenticate", "Bearer"));
        }
        response.body(self.to_body())
    }
}

/// The credentials of `Authorization: Bearer <token>`, trimmed; `None` when
/// the header is missing, not text, of another scheme, or empty. The scheme
/// name is case-insensitive (RFC 9110 section 11.1).
pub fn bearer_token(request: &HttpRequest) -> Option<&str> {
    let value = request
        .headers()
        .get(actix_web::http::header::AUTHORIZATION)?
        .to_str()
        .ok()?
        .trim_start();
    let (scheme, token) = value.split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// What `/readyz` checks and what `/metrics` renders.
#[derive(Clone)]
pub struct Health {
    pub service: &'static str,
    pub registry: Registry,
    pub database: Option<Pool>,
    pub broker: Option<Connected>,
    /// The last database check, shared by every clone (each HTTP worker's,
    /// the readiness watch's): see [`DatabaseCheck`].
    checked: std::sync::Arc<tokio::sync::Mutex<Option<(std::time::Instant, DatabaseCheck)>>>,
}

impl Health {
    pub fn new(
        service: &'static str,
        registry: Registry,
        database: Option<Pool>,
        broker: Option<Connected>,
    ) -> Self {
        Self {
            service,
            registry,
            database,
            broker,
            checked: Default::default(),
        }
    }
}

/// How long a database check answers `/readyz` (and the readiness watch)
/// before the next is made. `/readyz` answers anyone who reaches the port
/// (order-api's is public), and a check takes a connection of the pool it
/// shares (order-api: two, with the key cleanup): a check per request
/// would let a flood of them queue the pool past the check's 2 s and fail
/// every probe. One check at a time, its answer reused for this long; the
/// requests arriving during a check wait for it.
const CHECK_REUSE: Duration = Duration::from_secs(1);

/// A database check's outcome: the error's text is kept for the log.
#[derive(Clone)]
enum DatabaseCheck {
    Ok,
    Unavailable(String),
    TimedOut,
}

/// A route for GET and HEAD (RFC 9110 section 9.1: a HEAD is answered with
/// the GET's status and headers; actix-web sends no body for it), for
/// every read endpoint of the services.
pub fn get_or_head() -> actix_web::Route {
    web::route().guard(actix_web::guard::Any(actix_web::guard::Get()).or(actix_web::guard::Head()))
}

/// Mount `/healthz` (liveness: the process serves HTTP), `/readyz` (the
/// database answers and the broker connection is up, not blocked) and `/metrics`, for
/// GET and HEAD (RFC 9110 section 9.1: the GET's headers, no body); any
/// other method is a 405 naming them.
pub fn health_routes(health: Health) -> impl FnOnce(&mut web::ServiceConfig) {
    move |cfg| {
        cfg.app_data(web::Data::new(health))
            .service(resource("/healthz", get_or_head().to(healthz), "GET, HEAD"))
            .service(resource("/readyz", get_or_head().to(readyz), "GET, HEAD"))
            .service(resource("/metrics", get_or_head().to(metrics), "GET, HEAD"));
    }
}

/// The resource at `path` answering `route`, and any other method with a
/// 405 naming `allow`, the methods `route` takes (RFC 9110 section
/// 15.5.6), as problem+json: the answer order-api's own resources give. (A
/// route mounted alone, by `ServiceConfig::route`, carries its method as the
/// resource's guard: another method matched no resource and got the App's
/// bare 404 without a body.)
pub fn resource(path: &str, route: actix_web::Route, allow: &'static str) -> actix_web::Resource {
    web::resource(path)
        .route(route)
        .default_service(web::to(move || {
            std::future::ready(method_not_allowed(allow))
        }))
}

/// 405 with `Allow: allow` and the `method_not_allowed` problem.
fn method_not_allowed(allow: &'static str) -> HttpResponse {
    let mut response = Problem::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        "Method not allowed on this resource",
    )
    .error_response();
    response.headers_mut().insert(
        actix_web::http::header::ALLOW,
        actix_web::http::header::HeaderValue::from_static(allow),
    );
    response
}

/// The answer of a path no resource has (an App's `default_service`): 404
/// with the `not_found` problem, as order-api answers.
pub async fn not_found() -> HttpResponse {
    Problem::new(StatusCode::NOT_FOUND, "not_found", "No such resource").error_response()
}

async fn healthz(health: web::Data<Health>) -> HttpResponse {
    HttpResponse::Ok().json(serde_json::json!({ "status": "ok", "service": health.service }))
}

/// Keep the `service_ready` gauge current: 1 when `/readyz` would answer
/// ready (the database answers, the broker connection is up and not
/// blocked), else 0,
/// checked every `every` until `shutdown`. `up` stays 1 while the process
/// serves `/metrics`, and the other gauges keep their last values when the
/// database is gone: this is what shows (and alerts on) a service that runs
/// but cannot work.
pub fn watch_readiness(health: Health, every: Duration, shutdown: CancellationToken) {
    let gauge = match prometheus::IntGauge::new(
        "service_ready",
        "1 when the service is ready (its database answers and its broker connection is up, not blocked by the broker), else 0",
    ) {
        Ok(gauge) => gauge,
        Err(error) => {
            tracing::error!(%error, "service_ready gauge");
            return;
        }
    };
    crate::metrics::register(&health.registry, &gauge);
    tokio::spawn(async move {
        // The state last logged: the words of `/readyz` for the database
        // and the broker (None before the first check).
        let mut last: Option<(serde_json::Value, serde_json::Value)> = None;
        let mut ever_ready = false;
        loop {
            let (ready, body, error) = readiness(&health).await;
            gauge.set(i64::from(ready));
            // The cause in the log when the state changes (`/readyz` says
            // only which side, in a fixed word): at WARN once the service
            // has been ready, at INFO before (the first checks run before
            // the service has connected to its broker).
            let state = (body["database"].clone(), body["broker"].clone());
            if last.as_ref() != Some(&state) {
                let (database, broker) = (&state.0, &state.1);
                let error = error.as_deref().unwrap_or("");
                match (ready, ever_ready) {
                    (true, false) => tracing::info!("ready"),
                    (true, true) => tracing::info!("ready again"),
                    (false, false) => tracing::info!(%database, %broker, error, "not ready yet"),
                    (false, true) => tracing::warn!(%database, %broker, error, "not ready"),
                }
                ever_ready |= ready;
                last = Some(state);
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(every) => {}
            }
        }
    });
}

async fn readyz(health: web::Data<Health>) -> HttpResponse {
    let (ready, body, _) = readiness(&health).await;
    if ready {
        HttpResponse::Ok().json(body)
    } else {
        HttpResponse::ServiceUnavailable().json(body)
    }
}

/// Whether the service is ready, the `/readyz` body saying why, and the
/// database's error, if any (for the log).
async fn readiness(health: &Health) -> (bool, serde_json::Value, Option<String>) {
    let mut failure = None;
    let database = match &health.database {
        None => None,
        Some(pool) => {
            let mut checked = health.checked.lock().await;
            let check = match checked.as_ref() {
                Some((at, check)) if at.elapsed() < CHECK_REUSE => check.clone(),
                _ => {
                    let check =
                        match tokio::time::timeout(Duration::from_secs(2), crate::db::ping(pool))
                            .await
                        {
                            Ok(Ok(())) => DatabaseCheck::Ok,
                            Ok(Err(error)) => DatabaseCheck::Unavailable(error),
                            Err(_) => DatabaseCheck::TimedOut,
                        };
                    *checked = Some((std::time::Instant::now(), check.clone()));
                    check
                }
            };
            // The body names the state in a fixed word: the error's text
            // (a server's FATAL message, a host name) is for the log, not
            // for whoever can reach the port (order-api's is public).
            Some(match check {
                DatabaseCheck::Ok => Ok(()),
                DatabaseCheck::Unavailable(error) => {
                    failure = Some(error);
                    Err("unavailable")
                }
                DatabaseCheck::TimedOut => Err("timed out"),
            })
        }
    };
    let broker = health.broker.as_ref().map(Connected::state);
    let ready = database.as_ref().is_none_or(Result::is_ok) && broker.is_none_or(|b| b == "ok");
    let body = serde_json::json!({
        "status": if ready { "ready" } else { "not_ready" },
        "service": health.service,
        "database": database.map(|r| r.err().unwrap_or("ok")),
        "broker": broker,
    });
    (ready, body, failure)
}

async fn metrics(health: web::Data<Health>) -> HttpResponse {
    HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4; charset=utf-8")
        .body(crate::metrics::render(&health.registry))
}

/// Run an actix server until `shutdown` is cancelled, then stop it gracefully
/// (in-flight requests finish; bounded by the server's shutdown timeout).
pub async fn run_until_stopped(
    server: actix_web::dev::Server,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let handle: ServerHandle = server.handle();
    let stopper = tokio::spawn(async move {
        shutdown.cancelled().await;
        handle.stop(true).await;
    });
    let result = server.await;
    stopper.abort();
    result
}

#[cfg(test)]
mod tests {
    use actix_web::{http::header::AUTHORIZATION, test::TestRequest};

    use super::*;

    /// The health of a service whose database is on local `port` (a pool of
    /// 16: as many connections as checks may ask for), without a broker.
    fn health_of_database_on(port: u16) -> Health {
        let settings = crate::settings::DatabaseSettings {
            url: format!("postgres://app:secret@127.0.0.1:{port}/orders"),
            pool_size: 16,
            ..crate::settings::DatabaseSettings::local("orders")
        };
        Health::new(
            "test",
            Registry::new(),
            Some(crate::db::pool(&settings).expect("a pool")),
            None,
        )
    }

    /// A database that refuses the connection: not ready, `/readyz` says
    /// `unavailable` and nothing of the error (a host, a server's FATAL
    /// message), which the caller gets for the log.
    #[tokio::test]
    async fn readiness_names_the_database_s_state_in_a_word_and_keeps_its_error_for_the_log() {
        // Port 1: nothing listens there.
        let health = health_of_database_on(1);
        let (ready, body, error) = readiness(&health).await;
        assert!(!ready);
        // The whole body: nothing of the error in any field.
        assert_eq!(
            body,
            serde_json::json!({
                "status": "not_ready",
                "service": "test",
                "database": "unavailable",
                "broker": null,
            })
        );
        let error = error.expect("the error, for the log");
        assert!(!error.is_empty());
    }

    /// Requests at once share one database check: against a server that
    /// accepts connections and never answers (each check times out after
    /// 2 s), twenty concurrent `/readyz` make one connection attempt, not
    /// one each (a flood of them queued the shared pool past every probe's
    /// timeout).
    #[tokio::test]
    async fn concurrent_readiness_checks_share_one_database_check() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("listen");
        let port = listener.local_addr().expect("address").port();
        let accepted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = accepted.clone();
        let silent = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((socket, _)) = listener.accept().await {
                counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                held.push(socket);
            }
        });
        let health = health_of_database_on(port);
        let checks = futures_util::future::join_all((0..20).map(|_| readiness(&health))).await;
        for (ready, body, _) in &checks {
            assert!(!ready);
            assert_eq!(body["database"], "timed out", "{body}");
        }
        assert_eq!(
            accepted.load(std::sync::atomic::Ordering::SeqCst),
            1,
            "one check for all"
        );
        silent.abort();
    }

    fn token_of(header: Option<&str>) -> Option<String> {
        let mut request = TestRequest::default();
        if let Some(value) = header {
            request = request.insert_header((AUTHORIZATION, value));
        }
        bearer_token(&request.to_http_request()).map(str::to_owned)
    }

    #[test]
    fn the_bearer_scheme_is_matched_without_regard_to_case() {
        for header in ["Bearer k-1", "bearer k-1", "BEARER  k-1 ", " Bearer k-1"] {
            assert_eq!(token_of(Some(header)).as_deref(), Some("k-1"), "{header:?}");
        }
        for header in [
            None,
            Some("Basic k-1"),
            Some("Bearer"),
            Some("Bearer   "),
            Some("Bearerk-1"),
        ] {
            assert_eq!(token_of(header), None, "{header:?}");
        }
    }

    #[test]
    fn a_401_names_the_bearer_scheme_and_other_statuses_do_not() {
        let unauthorized =
            Problem::new(StatusCode::UNAUTHORIZED, "unauthorized", "no").error_response();
        assert_eq!(
            unauthorized
                .headers()
                .get("WWW-Authenticate")
                .map(|v| v.as_bytes()),
            Some(&b"Bearer"[..])
        );
        let forbidden = Problem::new(StatusCode::FORBIDDEN, "forbidden", "no").error_response();
        assert!(forbidden.headers().get("WWW-Authenticate").is_none());
    }
}
