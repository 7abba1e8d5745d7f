//! The internal read endpoints: `Authorization: Bearer <SERVICE_TOKEN>` and a
//! tenant scope (`tenant` query parameter or `X-Tenant-Id` header), errors as
//! problem+json.

use std::collections::HashMap;
use std::future::{ready, Ready};

use actix_web::{dev::Payload, http::StatusCode, web, FromRequest, HttpRequest};
use kit::http::Problem;

/// The expected bearer token (app data).
#[derive(Clone, Debug)]
pub struct ServiceToken(pub String);

/// An authenticated request scoped to one tenant.
#[derive(Clone, Debug)]
pub struct TenantScope {
    pub tenant: String,
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn authorize(req: &HttpRequest) -> Result<TenantScope, Problem> {
    let Some(expected) = req.app_data::<web::Data<ServiceToken>>() else {
        return Err(Problem::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "auth_not_configured",
            "The service token is not configured",
        ));
    };
    let presented = kit::http::bearer_token(req);
    match presented {
        Some(token) if constant_time_eq(token.as_bytes(), expected.0.as_bytes()) => {}
        Some(_) => {
            return Err(Problem::new(
                StatusCode::UNAUTHORIZED,
                "invalid_token",
                "The bearer token is not valid",
            ))
        }
        None => {
            return Err(Problem::new(
                StatusCode::UNAUTHORIZED,
                "missing_token",
                "An `Authorization: Bearer <service token>` header is required",
            ))
        }
    }
    let query = web::Query::<HashMap<String, String>>::from_query(req.query_string())
        .map(web::Query::into_inner)
        .unwrap_or_default();
    let tenant = query
        .get("tenant")
        .cloned()
        .or_else(|| {
            req.headers()
                .get("X-Tenant-Id")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        })
        .map(|t| t.trim().to_owned())
        .filter(|t| !t.is_empty());
    match tenant {
        Some(tenant) if !valid_tenant(&tenant) => Err(bad_request(
            "tenant",
            "a tenant id is 1-63 characters: lowercase letters, digits, '_' and '-', \
             starting with a letter or digit",
        )),
        Some(tenant) => Ok(TenantScope { tenant }),
        None => Err(Problem::new(
            StatusCode::BAD_REQUEST,
            "tenant_required",
            "The `tenant` query parameter (or X-Tenant-Id header) is required",
        )
        .field("tenant")),
    }
}

/// The tenant id rule of the orders database (`tenants.tenant_id`'s CHECK):
/// anything else names no tenant, and must not reach a query (a NUL byte is
/// a database error, not an empty result).
fn valid_tenant(tenant: &str) -> bool {
    let mut chars = tenant.chars();
    tenant.len() <= 63
        && chars
            .next()
            .is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-')
}

/// A name a write stores (a receipt's sku, location, id): the rule order-api
/// checks the names of its events with (`events::name`), so that a receipt
/// can name every sku and location an order was accepted with.
pub fn text_param(field: &str, value: &str) -> Result<(), Problem> {
    events::name::check(value).map_err(|why| bad_request(field, format!("{field} {why}")))
}

/// A text parameter of a read (a sku, a location, a customer id, as order-api
/// accepted them): anything but control characters, which no stored value
/// has and PostgreSQL may reject outright (a NUL byte is an error, not an
/// empty result).
pub fn no_control_characters(field: &str, value: &str) -> Result<(), Problem> {
    if value.chars().any(char::is_control) {
        return Err(bad_request(
            field,
            format!("{field} must not contain control characters"),
        ));
    }
    Ok(())
}

impl FromRequest for TenantScope {
    type Error = Problem;
    type Future = Ready<Result<Self, Problem>>;

    fn from_request(req: &HttpRequest, _: &mut Payload) -> Self::Future {
        ready(authorize(req))
    }
}

/// A database error as a problem ([`database_problem`]), logged with its
/// causes (the server's message: tokio-postgres's own text is "db error").
pub fn database_error<E: std::error::Error + 'static>(error: E) -> Problem {
    database_problem(kit::db::describe(&error))
}

/// A database failure as a problem (logged; no internals in the body).
pub fn database_problem(error: impl std::fmt::Display) -> Problem {
    tracing::error!(%error, "database error in a read endpoint");
    Problem::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "database_unavailable",
        "The database is not available",
    )
    .retry_after(1)
}

/// A bad request parameter.
pub fn bad_request(field: &str, detail: impl Into<String>) -> Problem {
    Problem::new(
        StatusCode::BAD_REQUEST,
        "invalid_request",
        "Invalid request",
    )
    .detail(detail)
    .field(field)
}

/// Nothing there.
pub fn not_found(what: impl Into<String>) -> Problem {
    Problem::new(StatusCode::NOT_FOUND, "not_found", "Not found").detail(what)
}

/// Keyset pagination of a list in a read endpoint: `after` is the id of the
/// last item of the previous page (exclusive), `limit` the page size
/// (1..=[`MAX_PAGE`], default [`MAX_PAGE`]). A full page names the cursor of
/// the next one (`next_after`); a shorter page is the last. Lists were cut
/// at a fixed size, oldest first, so the newest items of a long list could
/// not be read at all.
#[derive(Debug, Default, serde::Deserialize)]
pub struct PageQuery {
    after: Option<String>,
    limit: Option<String>,
}

/// The largest (and default) page of a read endpoint's list.
pub const MAX_PAGE: i64 = 1000;

impl PageQuery {
    /// The page size, or a 400 naming `limit`.
    pub fn limit(&self) -> Result<i64, Problem> {
        match self.limit.as_deref() {
            None => Ok(MAX_PAGE),
            Some(text) => text
                .parse::<i64>()
                .ok()
                .filter(|n| (1..=MAX_PAGE).contains(n))
                .ok_or_else(|| {
                    bad_request(
                        "limit",
                        format!("limit must be an integer from 1 to {MAX_PAGE}"),
                    )
                }),
        }
    }

    /// The cursor, parsed as `T` (`what` names its form in the 400).
    pub fn after<T: std::str::FromStr>(&self, what: &str) -> Result<Option<T>, Problem> {
        self.after
            .as_deref()
            .map(|text| {
                text.parse::<T>()
                    .map_err(|_| bad_request("after", format!("after must be {what}")))
            })
            .transpose()
    }
}

/// Where a page of a list in writing order ends: the journal's entries and
/// loyalty entries carry `written_by`, the id of the transaction that wrote
/// them (`pg_current_xact_id()`, ledger V5 / loyalty V3; rows from before
/// the column count as 0), are listed by it, and a page stops at this
/// expression, the oldest transaction id still running in the page
/// statement's own snapshot.
///
/// Such rows commit in any order: a transaction that wrote first and
/// commits last would put its row behind a cursor a reader had already
/// moved past a later one, and no page would ever show it. Below the
/// horizon every row is final: every transaction with a lower id had ended
/// when the statement's snapshot was taken, so the snapshot sees its rows.
/// A transaction that writes later draws a higher id than any drawn so far,
/// so its row comes after every cursor given out. A long writer holds the
/// pages back while it runs; readers (a drift check, pg_dump) draw no id and
/// do not.
pub const SETTLED_HORIZON: &str = "pg_snapshot_xmin(pg_current_snapshot())";

/// Refuse a cursor `sql` (with `params`) finds no row of: an unknown cursor
/// is a 400 naming `after` (saying `unknown`), not an empty page, which
/// would read as the end of the list.
pub async fn known_cursor(
    client: &tokio_postgres::Client,
    sql: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    unknown: impl FnOnce() -> String,
) -> Result<(), Problem> {
    let known = client
        .query_opt(sql, params)
        .await
        .map_err(database_error)?;
    match known {
        Some(_) => Ok(()),
        None => Err(bad_request("after", unknown())),
    }
}

/// The cursor of the page after one of `len` items of at most `limit`
/// whose last item has id `last`: none once a page is short.
pub fn next_after<T>(len: usize, limit: i64, last: Option<T>) -> Option<T> {
    (i64::try_from(len).unwrap_or(i64::MAX) >= limit)
        .then_some(last)
        .flatten()
}

#[cfg(test)]
mod page_tests {
    use super::*;

    fn page(after: Option<&str>, limit: Option<&str>) -> PageQuery {
        PageQuery {
            after: after.map(str::to_owned),
            limit: limit.map(str::to_owned),
        }
    }

    #[test]
    fn limits_and_cursors_are_checked_and_full_pages_name_the_next() {
        assert_eq!(page(None, None).limit().ok(), Some(MAX_PAGE));
        assert_eq!(page(None, Some("1")).limit().ok(), Some(1));
        for bad in ["0", "-1", "1001", "ten", ""] {
            assert!(page(None, Some(bad)).limit().is_err(), "{bad}");
        }
        assert_eq!(
            page(Some("42"), None).after::<i64>("an id").ok(),
            Some(Some(42))
        );
        assert_eq!(page(None, None).after::<i64>("an id").ok(), Some(None));
        assert!(page(Some("x"), None).after::<i64>("an id").is_err());
        assert_eq!(next_after(2, 2, Some(7)), Some(7));
        assert_eq!(next_after(1, 2, Some(7)), None);
        assert_eq!(next_after::<i64>(0, 2, None), None);
    }
}
