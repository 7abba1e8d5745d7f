//! HTTP handlers. Order of checks: authentication (401), Idempotency-Key
//! (400), body (400/422), then the idempotent transaction.

use actix_web::{http::header::CONTENT_TYPE, web, HttpRequest, HttpResponse};
use futures_util::StreamExt;
use tracing::Instrument;
use uuid::Uuid;

use crate::{
    auth,
    error::{ApiError, RejectedError, Rejection},
    idempotency,
    operations::{self, Operation, TraceContext},
    request::{self, CreateOrderRequest, DeliveryRequest, PaymentRequest},
    AppState,
};

pub const OPENAPI: &str = include_str!("../openapi.json");

/// Where [`OPENAPI`]'s description states the key retention.
const RETENTION: &str = "{retention}";

/// The OpenAPI document as served: the key retention is this instance's
/// (`idempotency.ttl_seconds`), in the description and as
/// `info.x-idempotency-retention-seconds`.
pub fn openapi(ttl_seconds: u64) -> String {
    let mut doc: serde_json::Value =
        serde_json::from_str(OPENAPI).expect("openapi.json is valid JSON (unit tested)");
    let info = &mut doc["info"];
    let description = info["description"]
        .as_str()
        .unwrap_or_default()
        .replace(RETENTION, &retention(ttl_seconds));
    info["description"] = description.into();
    info["x-idempotency-retention-seconds"] = ttl_seconds.into();
    // The supported currencies, from the list the server checks against.
    doc["components"]["schemas"]["Currency"]["enum"] = events::SUPPORTED_CURRENCIES.into();
    doc.to_string()
}

/// `seconds` in the largest whole unit: "24 h", "90 min", "45 s".
fn retention(seconds: u64) -> String {
    match seconds {
        s if s % 3600 == 0 => format!("{} h", s / 3600),
        s if s % 60 == 0 => format!("{} min", s / 60),
        s => format!("{s} s"),
    }
}

/// Each resource answers any other method with a 405 naming its methods
/// (`kit::http::resource`, as every service's resources do).
pub fn configure(cfg: &mut web::ServiceConfig) {
    use kit::http::{get_or_head, resource};
    cfg.service(resource("/orders", web::post().to(create_order), "POST"))
        .service(resource(
            "/orders/{id}",
            get_or_head().to(get_order),
            "GET, HEAD",
        ))
        .service(resource(
            "/orders/{id}/payments",
            web::post().to(order_command::<PaymentRequest>),
            "POST",
        ))
        .service(resource(
            "/orders/{id}/deliveries",
            web::post().to(order_command::<DeliveryRequest>),
            "POST",
        ))
        .service(resource(
            "/openapi.json",
            get_or_head().to(openapi_document),
            "GET, HEAD",
        ));
}

/// The OpenAPI document, with this server's key retention. A GET resource
/// answers HEAD too (RFC 9110 section 9.1): actix sends the headers, with the
/// GET's Content-Length, and no body.
async fn openapi_document(state: web::Data<AppState>) -> HttpResponse {
    HttpResponse::Ok()
        .content_type("application/json")
        .body(openapi(state.settings.idempotency.ttl_seconds))
}

/// Read the body up to the configured limit; only JSON (or no content type).
async fn body(
    state: &AppState,
    request: &HttpRequest,
    mut payload: web::Payload,
) -> Result<Vec<u8>, ApiError> {
    if let Some(content_type) = request.headers().get(CONTENT_TYPE) {
        let content_type = content_type
            .to_str()
            .unwrap_or_default()
            .to_ascii_lowercase();
        let essence = content_type.split(';').next().unwrap_or_default().trim();
        if essence != "application/json" {
            return Err(ApiError::UnsupportedMediaType);
        }
    }
    let limit = state.settings.idempotency.max_body_bytes;
    let mut bytes = Vec::new();
    while let Some(chunk) = payload.next().await {
        let chunk = chunk.map_err(|e| ApiError::invalid("body", e.to_string()))?;
        if bytes.len() + chunk.len() > limit {
            return Err(ApiError::PayloadTooLarge { limit });
        }
        bytes.extend_from_slice(&chunk);
    }
    Ok(bytes)
}

fn order_id(path: &str) -> Result<Uuid, ApiError> {
    Uuid::parse_str(path).map_err(|_| ApiError::invalid("id", "the order id must be a UUID"))
}

/// A span for the business operation of `tenant`, continuing the caller's
/// trace if it sent `traceparent`; its context is what the outbox row
/// stores. The tenant is on every line logged within it (a key reused with
/// another request, a rollback: the runbook's "tell the client's owners"
/// needs whose client it is; a tenant id is no personal data).
fn operation_span(
    request: &HttpRequest,
    name: &'static str,
    tenant: &str,
) -> (tracing::Span, TraceContext) {
    let span = tracing::info_span!("order_operation", operation = name, tenant);
    let header = |n: &str| request.headers().get(n).and_then(|v| v.to_str().ok());
    // W3C trace context: several `tracestate` fields are one list, joined
    // in order (RFC 9110 section 5.3); one that is not text drops the whole
    // list, as a malformed member does in the propagator (never a part).
    let tracestate: Option<Vec<&str>> = request
        .headers()
        .get_all(events::headers::TRACESTATE)
        .map(|v| v.to_str().ok())
        .collect();
    let tracestate = tracestate
        .filter(|fields| !fields.is_empty())
        .map(|fields| fields.join(","));
    kit::telemetry::set_remote_parent(
        &span,
        header(events::headers::TRACEPARENT),
        tracestate.as_deref(),
    );
    let mut trace = kit::telemetry::trace_headers(&span);
    if !trace.contains_key(events::headers::TRACEPARENT) {
        // The span records no context (OTEL_TRACES_FILTER leaves order-api
        // out): store the caller's, so that the events still continue it.
        trace = kit::telemetry::remote_trace_headers(
            header(events::headers::TRACEPARENT),
            tracestate.as_deref(),
        );
    }
    (span, trace)
}

async fn create_order(
    state: web::Data<AppState>,
    request: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let deadline = idempotency::Deadline::start(state.settings.idempotency.request_budget_ms);
    let tenant = auth::tenant(&state, &request, &deadline).await?;
    let key = idempotency::key(&request)?;
    let body = deadline.within(body(&state, &request, payload)).await?;
    let order = request::parse::<CreateOrderRequest>(&body)?.validate()?;
    let fingerprint = order.fingerprint();
    let (span, trace) = operation_span(&request, "create_order", &tenant);
    // A name only the stricter rule refuses: refused unless the key holds
    // this request, stored by an earlier release that took it.
    if let Some(refusal) = order.unclear_name() {
        return idempotency::refuse(
            &state,
            &tenant,
            "POST /orders",
            &key,
            (&fingerprint, &[]),
            (refusal, order.checkout_id),
            deadline,
        )
        .instrument(span)
        .await;
    }
    idempotency::execute(
        &state,
        &tenant,
        "POST /orders",
        &key,
        (&fingerprint, &[]),
        Operation::CreateOrder(order, trace),
        deadline,
    )
    .instrument(span)
    .await
}

/// A command on an existing order (payment, delivery): same checks, same
/// idempotent transaction, its own endpoint scope.
pub trait OrderCommand: serde::de::DeserializeOwned {
    const ENDPOINT: &'static str;
    const SPAN: &'static str;
    fn validate(&self) -> Result<(), ApiError>;
    /// Whether the request gives a value whose default comes from the order
    /// (read before the fingerprint, so that leaving a default out and
    /// giving its value are the same request: DESIGN.md section 5).
    fn defaults_from_order(&self) -> bool {
        false
    }
    /// Leave out what equals the order's default, or every value the order
    /// would decide when there is no such order (the answer is 404 whatever
    /// it says): the fingerprint is over the request without it (the seed's
    /// payment has no currency; a retry stored by a binary from before this
    /// rule keeps its fingerprint).
    fn omit_defaults(&mut self, _order: &OrderDefaults) {}
    fn fingerprint(&self, order_id: Uuid) -> String;
    /// A name the stricter rule of new requests refuses (see
    /// `request::clear_name`): answered only when the key holds no stored
    /// record of this request.
    fn unclear_name(&self) -> Option<ApiError>;
    /// The fingerprints the previous release computed for this request,
    /// where its canonical form has changed since (see
    /// [`idempotency::execute`]).
    fn earlier_fingerprints(&self, _order_id: Uuid) -> Vec<String> {
        Vec::new()
    }
    fn into_operation(self, order_id: Uuid, trace: TraceContext) -> Operation;
}

impl OrderCommand for PaymentRequest {
    const ENDPOINT: &'static str = "POST /orders/{id}/payments";
    const SPAN: &'static str = "receive_payment";
    fn validate(&self) -> Result<(), ApiError> {
        PaymentRequest::validate(self)
    }
    fn defaults_from_order(&self) -> bool {
        self.currency.is_some()
    }
    fn omit_defaults(&mut self, order: &OrderDefaults) {
        let moot = match order {
            OrderDefaults::NotRead => false,
            OrderDefaults::NoOrder => true,
            OrderDefaults::Order { currency } => {
                self.currency.as_ref().map(events::Currency::as_str) == Some(currency.as_str())
            }
        };
        if moot {
            self.currency = None;
        }
    }
    fn fingerprint(&self, order_id: Uuid) -> String {
        PaymentRequest::fingerprint(self, order_id)
    }
    fn unclear_name(&self) -> Option<ApiError> {
        PaymentRequest::unclear_name(self)
    }
    fn into_operation(self, order_id: Uuid, trace: TraceContext) -> Operation {
        Operation::Pay(order_id, self, trace)
    }
}

impl OrderCommand for DeliveryRequest {
    const ENDPOINT: &'static str = "POST /orders/{id}/deliveries";
    const SPAN: &'static str = "deliver_parcel";
    fn validate(&self) -> Result<(), ApiError> {
        DeliveryRequest::validate(self)
    }
    fn fingerprint(&self, order_id: Uuid) -> String {
        DeliveryRequest::fingerprint(self, order_id)
    }
    fn unclear_name(&self) -> Option<ApiError> {
        DeliveryRequest::unclear_name(self)
    }
    fn earlier_fingerprints(&self, order_id: Uuid) -> Vec<String> {
        vec![DeliveryRequest::fingerprint_in_line_order(self, order_id)]
    }
    fn into_operation(self, order_id: Uuid, trace: TraceContext) -> Operation {
        Operation::Deliver(order_id, self, trace)
    }
}

/// What the order says about a command's defaults, read before the
/// fingerprint (an order's currency never changes, and an order that is not
/// the tenant's now never will be: its id is the server's).
pub enum OrderDefaults {
    /// The command gives no value whose default comes from the order.
    NotRead,
    /// No such order in the caller's tenant.
    NoOrder,
    Order {
        currency: String,
    },
}

/// The fingerprint of `command` (its defaults from the order left out) and
/// the ones an earlier release computed for it (for [`idempotency::execute`]).
fn fingerprints<C: OrderCommand>(
    command: &mut C,
    order_id: Uuid,
    order: &OrderDefaults,
) -> (String, Vec<String>) {
    let mut earlier = command.earlier_fingerprints(order_id);
    if !matches!(order, OrderDefaults::NotRead) {
        // Until session 10 a given currency was hashed as sent; and when
        // there was no such order, until the rule above said it is moot.
        earlier.push(command.fingerprint(order_id));
        command.omit_defaults(order);
    }
    let fingerprint = command.fingerprint(order_id);
    earlier.retain(|f| *f != fingerprint);
    (fingerprint, earlier)
}

async fn order_command<C: OrderCommand>(
    state: web::Data<AppState>,
    request: HttpRequest,
    path: web::Path<String>,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let deadline = idempotency::Deadline::start(state.settings.idempotency.request_budget_ms);
    let tenant = auth::tenant(&state, &request, &deadline).await?;
    let key = idempotency::key(&request)?;
    let order_id = order_id(&path)?;
    let body = deadline.within(body(&state, &request, payload)).await?;
    let mut command = request::parse::<C>(&body)?;
    command.validate()?;
    let order = if command.defaults_from_order() {
        let currency = deadline
            .read(&state.pool, async |client| {
                operations::order_currency(client, &tenant, order_id).await
            })
            .await?;
        match currency {
            Some(currency) => OrderDefaults::Order { currency },
            None => OrderDefaults::NoOrder,
        }
    } else {
        OrderDefaults::NotRead
    };
    let (fingerprint, earlier) = fingerprints(&mut command, order_id, &order);
    let (span, trace) = operation_span(&request, C::SPAN, &tenant);
    if let Some(refusal) = command.unclear_name() {
        return idempotency::refuse(
            &state,
            &tenant,
            C::ENDPOINT,
            &key,
            (&fingerprint, &earlier),
            (refusal, None),
            deadline,
        )
        .instrument(span)
        .await;
    }
    idempotency::execute(
        &state,
        &tenant,
        C::ENDPOINT,
        &key,
        (&fingerprint, &earlier),
        command.into_operation(order_id, trace),
        deadline,
    )
    .instrument(span)
    .await
}

async fn get_order(
    state: web::Data<AppState>,
    request: HttpRequest,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let deadline = idempotency::Deadline::start(state.settings.idempotency.request_budget_ms);
    let tenant = auth::tenant(&state, &request, &deadline).await?;
    let order_id = order_id(&path)?;
    let order = deadline
        .read(&state.pool, async |client| {
            operations::get_order(client, &tenant, order_id).await
        })
        .await?;
    match order {
        Some(order) => Ok(HttpResponse::Ok().json(order)),
        None => Err(RejectedError(Rejection::OrderNotFound).into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_served_document_lists_the_supported_currencies() {
        let doc: serde_json::Value = serde_json::from_str(&openapi(86_400)).expect("JSON");
        let listed: Vec<&str> = doc["components"]["schemas"]["Currency"]["enum"]
            .as_array()
            .expect("enum")
            .iter()
            .map(|c| c.as_str().expect("code"))
            .collect();
        assert_eq!(listed, events::SUPPORTED_CURRENCIES);
        assert_eq!(doc["info"]["x-idempotency-retention-seconds"], 86_400);
    }

    fn parse<C: OrderCommand>(body: &str) -> C {
        request::parse::<C>(body.as_bytes()).expect("parse")
    }

    #[test]
    fn a_retry_fingerprinted_by_the_previous_release_is_the_same_request() {
        let order_id = Uuid::nil();
        let usd = OrderDefaults::Order {
            currency: "USD".to_owned(),
        };
        let absent = r#"{"payment_id":"9001","amount":"93.00","method":"card"}"#;
        let spelled = r#"{"payment_id":"9001","amount":"93.00","currency":"USD","method":"card"}"#;
        // Session 9 hashed the payment as sent.
        let stored_then = parse::<PaymentRequest>(spelled).fingerprint(order_id);
        let (now, earlier) = fingerprints(&mut parse::<PaymentRequest>(spelled), order_id, &usd);
        let (without, _) = fingerprints(
            &mut parse::<PaymentRequest>(absent),
            order_id,
            &OrderDefaults::NotRead,
        );
        assert_eq!(now, without, "the currency of the order is left out");
        assert_eq!(earlier, vec![stored_then]);
        let eur = OrderDefaults::Order {
            currency: "EUR".to_owned(),
        };
        let (other, earlier) = fingerprints(&mut parse::<PaymentRequest>(spelled), order_id, &eur);
        assert_ne!(other, now, "another currency than the order's stays");
        assert!(earlier.is_empty());

        let sorted = r#"{"delivery_id":"311","lines":[{"sku":"A","qty":2},{"sku":"B","qty":1}]}"#;
        let reordered =
            r#"{"delivery_id":"311","lines":[{"sku":"B","qty":1},{"sku":"A","qty":2}]}"#;
        let stored_then = parse::<DeliveryRequest>(reordered).fingerprint_in_line_order(order_id);
        let not_read = OrderDefaults::NotRead;
        let (now, earlier) = fingerprints(
            &mut parse::<DeliveryRequest>(reordered),
            order_id,
            &not_read,
        );
        assert_eq!(
            now,
            fingerprints(&mut parse::<DeliveryRequest>(sorted), order_id, &not_read).0
        );
        assert_eq!(earlier, vec![stored_then]);
    }

    #[test]
    fn the_served_document_states_the_configured_retention() {
        assert_eq!(
            OPENAPI.matches(RETENTION).count(),
            1,
            "one place to fill in"
        );
        for (ttl, text) in [(86_400, "24 h"), (5_400, "90 min"), (45, "45 s")] {
            let doc: serde_json::Value = serde_json::from_str(&openapi(ttl)).expect("json");
            let description = doc["info"]["description"].as_str().expect("description");
            assert!(
                description.contains(&format!("expire {text} after")),
                "{description}"
            );
            assert!(!description.contains(RETENTION));
            assert_eq!(doc["info"]["x-idempotency-retention-seconds"], ttl);
        }
    }

    #[test]
    fn without_the_order_a_payment_s_currency_is_moot() {
        let order_id = Uuid::nil();
        let absent = r#"{"payment_id":"9001","amount":"93.00","method":"card"}"#;
        let (without, _) = fingerprints(
            &mut parse::<PaymentRequest>(absent),
            order_id,
            &OrderDefaults::NotRead,
        );
        for currency in ["USD", "EUR"] {
            let spelled = absent.replace(
                "\"method\"",
                &format!("\"currency\":\"{currency}\",\"method\""),
            );
            // The previous release hashed it as sent when there was no order.
            let stored_then = parse::<PaymentRequest>(&spelled).fingerprint(order_id);
            let (now, earlier) = fingerprints(
                &mut parse::<PaymentRequest>(&spelled),
                order_id,
                &OrderDefaults::NoOrder,
            );
            assert_eq!(now, without, "{currency}: the same 404 as without it");
            assert_eq!(earlier, vec![stored_then]);
        }
    }
}
