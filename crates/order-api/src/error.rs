//! The one error type of order-api and its one mapping to HTTP
//! (`application/problem+json` with a stable `code`).

use actix_web::{http::StatusCode, HttpResponse, ResponseError};
use kit::http::Problem;
use serde::Serialize;
use uuid::Uuid;

/// A deterministic business rejection decided inside the transaction. It is
/// stored with the idempotency key and replayed like a success.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rejection {
    /// `order_id`: the checkout's order, so that a client whose first
    /// response was lost can find it.
    CheckoutAlreadyOrdered {
        checkout_id: String,
        order_id: Uuid,
    },
    OrderNotFound,
    /// The order is paid, by the payment `payment_id` (none: no payment row,
    /// a hand repair), which is the request's own when `by_this_payment`:
    /// a payment retried after its key expired (or under another key) can
    /// tell that it was recorded from another payment of the same order.
    OrderAlreadyPaid {
        payment_id: Option<String>,
        by_this_payment: bool,
    },
    /// The payment id is recorded on another order of the tenant
    /// (`order_id`): one provider payment pays one order.
    PaymentAlreadyRecorded {
        payment_id: String,
        order_id: Uuid,
    },
    AmountMismatch {
        expected: String,
        got: String,
    },
    CurrencyMismatch {
        expected: String,
        got: String,
    },
    OrderNotPaid,
    OrderAlreadyDelivered,
    DeliveryLinesMismatch,
    /// A delivery's `delivered_at` before the order was placed: answered
    /// like a validation failure, and stored (a placement time never
    /// changes: the same request can never succeed).
    DeliveredBeforePlaced {
        placed_at: time::OffsetDateTime,
    },
    /// A delivery's `delivered_at` further ahead of the database's clock
    /// than `request::MAX_CLOCK_SKEW`: answered like a validation failure,
    /// not stored (the same request is valid once the time has come).
    DeliveredInTheFuture,
}

impl Rejection {
    /// Whether the rejection is stored with its key and replayed: the same
    /// request can never succeed later (DESIGN.md section 5: deterministic
    /// rejections decided inside the transaction are stored). `OrderNotPaid`
    /// is not final (the payment may come), so it is answered without being
    /// stored. `DeliveredBeforePlaced` is: the order's placement time never
    /// changes (before, it was not stored, and the same key with another
    /// time ran as a new request instead of 409 `idempotency_key_reused`).
    pub fn is_final(&self) -> bool {
        !matches!(
            self,
            Rejection::OrderNotPaid | Rejection::DeliveredInTheFuture
        )
    }

    pub fn problem(&self) -> Problem {
        use Rejection::*;
        match self {
            CheckoutAlreadyOrdered {
                checkout_id,
                order_id,
            } => Problem::new(
                StatusCode::CONFLICT,
                "checkout_already_ordered",
                "This checkout already has an order",
            )
            .detail(format!(
                "checkout_id {checkout_id} was ordered under another idempotency key: \
                 order {order_id} (GET /orders/{order_id})"
            ))
            .field("checkout_id"),
            OrderNotFound => {
                Problem::new(StatusCode::NOT_FOUND, "order_not_found", "No such order")
            }
            OrderAlreadyPaid {
                payment_id,
                by_this_payment,
            } => {
                let problem = Problem::new(
                    StatusCode::CONFLICT,
                    "order_already_paid",
                    "The order is already paid",
                );
                match (payment_id, by_this_payment) {
                    (Some(payment_id), true) => problem.detail(format!(
                        "the order is paid by this payment (payment_id {payment_id}), recorded \
                         before under another idempotency key or one that has expired"
                    )),
                    (Some(payment_id), false) => problem.detail(format!(
                        "the order is paid by payment_id {payment_id}; an order takes one payment"
                    )),
                    (None, _) => problem,
                }
            }
            PaymentAlreadyRecorded {
                payment_id,
                order_id,
            } => Problem::new(
                StatusCode::CONFLICT,
                "payment_already_recorded",
                "This payment is recorded on another order",
            )
            .detail(format!(
                "payment_id {payment_id} pays order {order_id} (GET /orders/{order_id}); \
                 one payment pays one order"
            ))
            .field("payment_id"),
            AmountMismatch { expected, got } => Problem::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "amount_mismatch",
                "The payment amount must equal the amount due",
            )
            .detail(format!("amount due is {expected}, got {got}"))
            .field("amount"),
            CurrencyMismatch { expected, got } => Problem::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "currency_mismatch",
                "The payment currency must be the order's currency",
            )
            .detail(format!("order currency is {expected}, got {got}"))
            .field("currency"),
            OrderNotPaid => Problem::new(
                StatusCode::CONFLICT,
                "order_not_paid",
                "An unpaid order cannot be delivered",
            )
            .detail("nothing was stored; retry with the same key once the order is paid"),
            OrderAlreadyDelivered => Problem::new(
                StatusCode::CONFLICT,
                "order_already_delivered",
                "The order is already delivered",
            ),
            DeliveryLinesMismatch => Problem::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "delivery_lines_mismatch",
                "The delivered lines must match the order's lines",
            )
            .field("lines"),
            DeliveredBeforePlaced { placed_at } => ApiError::validation(
                "delivered_at",
                format!(
                    "must not be before the order was placed ({})",
                    placed_at
                        .format(&time::format_description::well_known::Rfc3339)
                        .unwrap_or_default()
                ),
            )
            .problem(),
            DeliveredInTheFuture => ApiError::validation(
                "delivered_at",
                format!(
                    "must not be in the future (more than {} s ahead of the server's clock)",
                    crate::request::MAX_CLOCK_SKEW.whole_seconds()
                ),
            )
            .problem(),
        }
    }

    /// The order the rejection points at (sent as `Location` and stored as
    /// the key's resource id).
    pub fn resource_id(&self) -> Option<Uuid> {
        match self {
            Rejection::CheckoutAlreadyOrdered { order_id, .. }
            | Rejection::PaymentAlreadyRecorded { order_id, .. } => Some(*order_id),
            _ => None,
        }
    }

    /// The exact body: the problem, plus (RFC 9457 extension members)
    /// `order_id` where the rejection points at an order, and `payment_id`,
    /// the payment an already paid order has.
    pub fn to_body(&self) -> Vec<u8> {
        #[derive(Serialize)]
        struct WithMembers<'a> {
            #[serde(flatten)]
            problem: Problem,
            #[serde(skip_serializing_if = "Option::is_none")]
            order_id: Option<Uuid>,
            #[serde(skip_serializing_if = "Option::is_none")]
            payment_id: Option<&'a str>,
        }
        let payment_id = match self {
            Rejection::OrderAlreadyPaid { payment_id, .. } => payment_id.as_deref(),
            _ => None,
        };
        serde_json::to_vec(&WithMembers {
            problem: self.problem(),
            order_id: self.resource_id(),
            payment_id,
        })
        .unwrap_or_default()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("missing or invalid API key")]
    Unauthorized,
    #[error("invalid Idempotency-Key: {0}")]
    IdempotencyKey(&'static str),
    #[error("{field}: {message}")]
    Invalid { field: String, message: String },
    #[error("{field}: {message}")]
    Validation { field: String, message: String },
    #[error("unsupported content type")]
    UnsupportedMediaType,
    #[error("body larger than {limit} bytes")]
    PayloadTooLarge { limit: usize },
    #[error("idempotency key reused with a different request")]
    KeyReused,
    #[error("a request with this idempotency key is still in progress")]
    InProgress,
    #[error("order is busy")]
    Busy,
    /// The request's time budget (`idempotency.request_budget_ms`) ran out
    /// before COMMIT was sent: rolled back, nothing stored.
    #[error("the request's time budget of {budget_ms} ms ran out")]
    DeadlineExceeded { budget_ms: u64 },
    #[error(transparent)]
    Rejected(#[from] RejectedError),
    #[error("database: {}", kit::db::describe(.0))]
    Database(#[from] tokio_postgres::Error),
    /// COMMIT got no answer (the connection dropped): the transaction may
    /// or may not have committed.
    #[error("commit: {}", kit::db::describe(.0))]
    Commit(tokio_postgres::Error),
    /// COMMIT was sent but not answered within the request's budget and its
    /// backstop: the transaction may or may not have committed.
    #[error("commit: no answer within the request budget of {budget_ms} ms")]
    CommitUnanswered { budget_ms: u64 },
    #[error("database pool: {}", kit::db::describe(.0))]
    Pool(#[from] deadpool_postgres::PoolError),
    #[error("internal: {0}")]
    Internal(String),
}

/// Wrapper so a [`Rejection`] can travel as an error (used by GET, where
/// nothing is stored).
#[derive(Debug, thiserror::Error)]
#[error("{0:?}")]
pub struct RejectedError(pub Rejection);

impl ApiError {
    pub fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self::Invalid {
            field: field.into(),
            message: message.into(),
        }
    }

    pub fn validation(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self::Validation {
            field: field.into(),
            message: message.into(),
        }
    }

    /// The request field at fault, if any.
    pub fn field(&self) -> Option<&str> {
        match self {
            Self::Invalid { field, .. } | Self::Validation { field, .. } => Some(field),
            _ => None,
        }
    }

    /// SQLSTATE 55P03: a bounded lock wait (`lock_timeout`) ran out.
    pub fn is_lock_timeout(error: &tokio_postgres::Error) -> bool {
        error.code() == Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE)
    }

    /// The single mapping from errors to problems.
    pub fn problem(&self) -> Problem {
        match self {
            Self::Unauthorized => Problem::new(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "Missing or invalid API key",
            )
            .detail("send Authorization: Bearer <api key>"),
            Self::IdempotencyKey(why) => Problem::new(
                StatusCode::BAD_REQUEST,
                "invalid_idempotency_key",
                "The Idempotency-Key header is missing or malformed",
            )
            .detail(*why)
            .field("Idempotency-Key"),
            Self::Invalid { field, message } => Problem::new(
                StatusCode::BAD_REQUEST,
                "invalid_request",
                "The request is malformed",
            )
            .detail(message.clone())
            .field(field.clone()),
            Self::Validation { field, message } => Problem::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "validation_failed",
                "The request is not valid",
            )
            .detail(format!("{field} {message}"))
            .field(field.clone()),
            Self::UnsupportedMediaType => Problem::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "unsupported_media_type",
                "Send the body as application/json",
            ),
            Self::PayloadTooLarge { limit } => Problem::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "payload_too_large",
                "The request body is too large",
            )
            .detail(format!("at most {limit} bytes")),
            Self::KeyReused => Problem::new(
                StatusCode::CONFLICT,
                "idempotency_key_reused",
                "This Idempotency-Key was used with a different request",
            )
            .detail("use a new key for a new request; nothing was executed"),
            Self::InProgress => Problem::new(
                StatusCode::CONFLICT,
                "idempotency_in_progress",
                "A request with this Idempotency-Key is still being processed",
            )
            .detail("retry with the same key after the Retry-After delay")
            .retry_after(1),
            Self::Busy => Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "order_busy",
                "The order, its checkout or its payment id is being used by another request",
            )
            .detail("nothing was stored; retry with the same key")
            .retry_after(1),
            Self::DeadlineExceeded { budget_ms } => Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "deadline_exceeded",
                "The request did not complete within the service's time budget",
            )
            .detail(format!(
                "the request took longer than {budget_ms} ms from its start (reading it, \
                 waiting for a connection, the database work); nothing was stored; \
                 retry the request (a POST with the same Idempotency-Key)"
            ))
            .retry_after(1),
            Self::Rejected(RejectedError(rejection)) => rejection.problem(),
            // A session that cannot do the work for its life (on a standby
            // after a failover, 25006; a statement a migration changed,
            // 0A000) is closed (`idempotency::Held`): the retry gets
            // another, so it is the database's state, not an error.
            Self::Database(error)
                if !kit::db::transient(error) && !kit::db::session_fault(error) =>
            {
                Problem::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal_error",
                    "Internal error",
                )
            }
            Self::Database(_) | Self::Pool(_) => Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable",
                "The service cannot reach its database",
            )
            .detail("nothing was stored; retry with the same key")
            .retry_after(1),
            Self::Commit(_) | Self::CommitUnanswered { .. } => Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable",
                "The service cannot reach its database",
            )
            .detail(
                "the outcome is unknown; retry with the same key: it replays the result if \
                 it was stored, and runs the request if it was not",
            )
            .retry_after(1),
            Self::Internal(_) => Problem::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal_error",
                "Internal error",
            ),
        }
    }
}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        self.problem().status_code()
    }

    fn error_response(&self) -> HttpResponse {
        match self {
            Self::Database(_)
            | Self::Commit(_)
            | Self::CommitUnanswered { .. }
            | Self::Pool(_)
            | Self::Internal(_) => {
                tracing::error!(error = %self, "request failed")
            }
            // Not the client's doing (its budget ran out waiting for a
            // connection or a lock, the database or its session unusable,
            // the order busy): an operator's signal, never a quiet one.
            _ if self.status_code() == StatusCode::SERVICE_UNAVAILABLE => {
                tracing::warn!(error = %self, "request not served")
            }
            _ => tracing::debug!(error = %self, "request rejected"),
        }
        self.problem().error_response()
    }
}
