//! Request bodies: parsing (400 with the field path), validation (422 with the
//! field) and the canonical fingerprint of seed 004.
//!
//! The fingerprint is blake3 over a canonical encoding of the *validated*
//! business fields plus the endpoint version, never the raw bytes: JSON field
//! order, whitespace and defaulted fields (an absent `checkout_id` vs `null`,
//! an omitted vs an explicit correct `total`) do not change it.

use events::{Currency, Money};
use serde::{de::DeserializeOwned, Deserialize, Deserializer};
use time::{format_description::well_known::Rfc3339, OffsetDateTime, UtcOffset};
use uuid::Uuid;

use crate::error::ApiError;

/// Bounds that keep requests sane (and the canonical encoding small).
const MAX_LINES: usize = 100;
const MAX_QTY: u32 = 1_000_000;

/// Parse a JSON body into `T`; a failure names the JSON path at fault.
pub fn parse<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    if body.is_empty() {
        return Err(ApiError::invalid("body", "a JSON body is required"));
    }
    let mut deserializer = serde_json::Deserializer::from_slice(body);
    let value: T = serde_path_to_error::deserialize(&mut deserializer).map_err(|error| {
        let path = error.path().to_string();
        let inner = error.into_inner();
        // Not JSON at all (syntax, truncation): the whole body is at fault.
        let field = if inner.is_syntax() || inner.is_eof() || path == "." || path.contains('?') {
            "body".to_owned()
        } else {
            path
        };
        ApiError::invalid(field, inner.to_string())
    })?;
    deserializer
        .end()
        .map_err(|error| ApiError::invalid("body", error.to_string()))?;
    Ok(value)
}

/// Builds the canonical encoding: `name=<len>:<value>;` per field, in a fixed
/// order, after a version tag. Length prefixes make it unambiguous.
struct Canonical(Vec<u8>);

impl Canonical {
    fn new(endpoint_version: &str) -> Self {
        let mut c = Canonical(Vec::with_capacity(256));
        c.field("v", endpoint_version);
        c
    }

    fn field(&mut self, name: &str, value: &str) -> &mut Self {
        self.0.extend_from_slice(name.as_bytes());
        self.0.push(b'=');
        self.0.extend_from_slice(value.len().to_string().as_bytes());
        self.0.push(b':');
        self.0.extend_from_slice(value.as_bytes());
        self.0.push(b';');
        self
    }

    fn optional(&mut self, name: &str, value: Option<&str>) -> &mut Self {
        match value {
            Some(v) => self.field(name, v),
            None => self.field(name, "\u{0}absent"),
        }
    }

    fn finish(&self) -> String {
        blake3::hash(&self.0).to_hex().to_string()
    }
}

/// A name the order writes into its events: `events::name`'s rule (the same
/// the consumers' receipts check, so whatever an order names can be
/// received). See [`clear_name`] for the stricter rule of new requests.
fn text(field: &str, value: &str) -> Result<(), ApiError> {
    events::name::check(value).map_err(|why| ApiError::validation(field, why.to_string()))
}

/// The stricter rule of a new request's names: no white space at either end
/// (nor white space alone) and no invisible character: `"JKT-M "` or
/// `"chk-1\u{200B}"` look like `JKT-M` and `chk-1` to a person and are
/// other names to every database (stock reserved under an unknown sku, a
/// second order for one checkout). Checked after the key's stored record
/// is looked for (`idempotency::refuse`): a request an earlier release took
/// and stored with such a name still replays under its key. Events already
/// stored keep the receipts' rule. Not normalized: composed and decomposed
/// spellings stay two names.
fn clear_name(field: &str, value: &str) -> Result<(), ApiError> {
    if value.trim() != value {
        return Err(ApiError::validation(
            field,
            "must not begin or end with white space",
        ));
    }
    if let Some(c) = value.chars().find(|c| invisible(*c)) {
        return Err(ApiError::validation(
            field,
            format!(
                "must not contain invisible characters (U+{:04X})",
                u32::from(c)
            ),
        ));
    }
    if let Some(c) = stray_joiner(value) {
        return Err(ApiError::validation(
            field,
            format!(
                "must not contain a joiner (U+{:04X}) but between two letters of a \
                 script that spells with it",
                u32::from(c)
            ),
        ));
    }
    Ok(())
}

/// The zero-width non-joiner or joiner (U+200C, U+200D) of `value` that
/// stands anywhere but between two non-ASCII characters, neither white
/// space nor a joiner: where Persian, the Indic scripts and emoji spell with
/// it. At either end, alone, or beside a Latin letter or digit it is as
/// invisible as any other (`"chk-1\u{200D}"` looks like `chk-1`).
fn stray_joiner(value: &str) -> Option<char> {
    let chars: Vec<char> = value.chars().collect();
    let spelling =
        |c: Option<&char>| c.is_some_and(|c| !c.is_ascii() && !c.is_whitespace() && !is_joiner(*c));
    chars.iter().enumerate().find_map(|(i, &c)| {
        let between = i > 0 && spelling(chars.get(i - 1)) && spelling(chars.get(i + 1));
        (is_joiner(c) && !between).then_some(c)
    })
}

fn is_joiner(c: char) -> bool {
    matches!(c, '\u{200C}' | '\u{200D}')
}

/// Lines' skus by their field (`lines[i].sku`).
fn skus<'a>(skus: impl Iterator<Item = &'a str>) -> impl Iterator<Item = (String, &'a str)> {
    skus.enumerate()
        .map(|(i, sku)| (format!("lines[{i}].sku"), sku))
}

/// The refusal of the first name of `names` (field, value) that breaks
/// [`clear_name`].
fn first_unclear(names: &[(String, &str)]) -> Option<ApiError> {
    names
        .iter()
        .find_map(|(field, value)| clear_name(field, value).err())
}

/// Unicode's format characters (general category Cf, Unicode 15: soft
/// hyphen, zero-width space and direction marks, the byte order mark, tags)
/// and its line and paragraph separators (Zl, Zp), but the zero-width
/// non-joiner and joiner (U+200C, U+200D: part of the spelling in Persian
/// and Indic scripts, and of emoji sequences). Control characters (Cc) are
/// `events::name`'s.
fn invisible(c: char) -> bool {
    matches!(
        c,
        '\u{00AD}'
            | '\u{0600}'..='\u{0605}'
            | '\u{061C}'
            | '\u{06DD}'
            | '\u{070F}'
            | '\u{0890}'..='\u{0891}'
            | '\u{08E2}'
            | '\u{180E}'
            | '\u{200B}'
            | '\u{200E}'..='\u{200F}'
            | '\u{2028}'..='\u{202E}'
            | '\u{2060}'..='\u{2064}'
            | '\u{2066}'..='\u{206F}'
            | '\u{FEFF}'
            | '\u{FFF9}'..='\u{FFFB}'
            | '\u{110BD}'
            | '\u{110CD}'
            | '\u{13430}'..='\u{1343F}'
            | '\u{1BCA0}'..='\u{1BCA3}'
            | '\u{1D173}'..='\u{1D17A}'
            | '\u{E0001}'
            | '\u{E0020}'..='\u{E007F}'
    )
}

fn non_negative(field: &str, value: Money) -> Result<(), ApiError> {
    if value.is_negative() {
        return Err(ApiError::validation(field, "must not be negative"));
    }
    Ok(())
}

fn overflow(field: &str) -> ApiError {
    ApiError::validation(field, "amount overflows")
}

// ---------------------------------------------------------------- POST /orders

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateOrderRequest {
    pub customer_id: String,
    #[serde(default)]
    pub checkout_id: Option<String>,
    pub lines: Vec<OrderLineRequest>,
    pub shipping: Money,
    pub tax: Money,
    /// Optional; when given it must equal lines + shipping + tax.
    #[serde(default)]
    pub total: Option<Money>,
    pub currency: Currency,
    pub location: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OrderLineRequest {
    pub sku: String,
    pub qty: u32,
    pub unit_price: Money,
    pub unit_cost: Money,
}

/// A validated order, with its server-computed amounts.
#[derive(Debug, Clone)]
pub struct NewOrder {
    pub customer_id: String,
    pub checkout_id: Option<String>,
    pub lines: Vec<events::OrderLineV1>,
    pub merchandise: Money,
    pub shipping: Money,
    pub tax: Money,
    pub total: Money,
    pub currency: Currency,
    pub location: String,
}

impl CreateOrderRequest {
    pub fn validate(self) -> Result<NewOrder, ApiError> {
        text("customer_id", &self.customer_id)?;
        if let Some(checkout) = &self.checkout_id {
            text("checkout_id", checkout)?;
        }
        text("location", &self.location)?;
        if self.lines.is_empty() {
            return Err(ApiError::validation(
                "lines",
                "an order needs at least one line",
            ));
        }
        if self.lines.len() > MAX_LINES {
            return Err(ApiError::validation(
                "lines",
                format!("at most {MAX_LINES} lines"),
            ));
        }
        let mut merchandise = Money::ZERO;
        // Not stored here, but consumers compute it (the ledger's cost of
        // goods): an order whose cost sum overflows must not be accepted.
        let mut cost_of_goods = Money::ZERO;
        let mut lines = Vec::with_capacity(self.lines.len());
        for (i, line) in self.lines.into_iter().enumerate() {
            text(&format!("lines[{i}].sku"), &line.sku)?;
            if line.qty == 0 || line.qty > MAX_QTY {
                return Err(ApiError::validation(
                    format!("lines[{i}].qty"),
                    format!("must be between 1 and {MAX_QTY}"),
                ));
            }
            non_negative(&format!("lines[{i}].unit_price"), line.unit_price)?;
            non_negative(&format!("lines[{i}].unit_cost"), line.unit_cost)?;
            let line_total = line
                .unit_price
                .checked_mul(i64::from(line.qty))
                .ok_or_else(|| overflow(&format!("lines[{i}]")))?;
            let line_cost = line
                .unit_cost
                .checked_mul(i64::from(line.qty))
                .ok_or_else(|| overflow(&format!("lines[{i}]")))?;
            merchandise = merchandise
                .checked_add(line_total)
                .ok_or_else(|| overflow("lines"))?;
            cost_of_goods = cost_of_goods
                .checked_add(line_cost)
                .ok_or_else(|| overflow("lines"))?;
            lines.push(events::OrderLineV1 {
                sku: line.sku,
                qty: line.qty,
                unit_price: line.unit_price,
                unit_cost: line.unit_cost,
            });
        }
        non_negative("shipping", self.shipping)?;
        non_negative("tax", self.tax)?;
        let total = merchandise
            .checked_add(self.shipping)
            .and_then(|t| t.checked_add(self.tax))
            .ok_or_else(|| overflow("total"))?;
        // An order is delivered only once paid, and a payment is a positive
        // amount equal to the total: an order of total 0.00 could never be
        // paid nor delivered (and the ledger books no zero amounts).
        if total == Money::ZERO {
            return Err(ApiError::validation(
                "total",
                "must be greater than 0.00: an order is paid before it is delivered",
            ));
        }
        if let Some(given) = self.total {
            if given != total {
                return Err(ApiError::validation(
                    "total",
                    format!("{given} does not equal lines + shipping + tax = {total}"),
                ));
            }
        }
        Ok(NewOrder {
            customer_id: self.customer_id,
            checkout_id: self.checkout_id,
            lines,
            merchandise,
            shipping: self.shipping,
            tax: self.tax,
            total,
            currency: self.currency,
            location: self.location,
        })
    }
}

impl NewOrder {
    /// [`clear_name`]'s refusal of the first of its names that breaks it.
    pub fn unclear_name(&self) -> Option<ApiError> {
        let mut names = vec![
            ("customer_id".to_owned(), self.customer_id.as_str()),
            ("location".to_owned(), self.location.as_str()),
        ];
        if let Some(checkout) = &self.checkout_id {
            names.insert(1, ("checkout_id".to_owned(), checkout.as_str()));
        }
        names.extend(skus(self.lines.iter().map(|line| line.sku.as_str())));
        first_unclear(&names)
    }

    pub fn fingerprint(&self) -> String {
        let mut c = Canonical::new("POST /orders v1");
        c.field("customer_id", &self.customer_id)
            .optional("checkout_id", self.checkout_id.as_deref())
            .field("currency", self.currency.as_str())
            .field("location", &self.location)
            .field("lines", &self.lines.len().to_string());
        for line in &self.lines {
            c.field("sku", &line.sku)
                .field("qty", &line.qty.to_string())
                .field("unit_price", &line.unit_price.minor().to_string())
                .field("unit_cost", &line.unit_cost.minor().to_string());
        }
        c.field("shipping", &self.shipping.minor().to_string())
            .field("tax", &self.tax.minor().to_string())
            .field("total", &self.total.minor().to_string());
        c.finish()
    }
}

// ---------------------------------------------------- POST /orders/{id}/payments

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PaymentRequest {
    pub payment_id: String,
    pub amount: Money,
    /// Optional; when given it must be the order's currency.
    #[serde(default)]
    pub currency: Option<Currency>,
    pub method: String,
}

impl PaymentRequest {
    /// [`clear_name`]'s refusal of its id, if it breaks it.
    pub fn unclear_name(&self) -> Option<ApiError> {
        first_unclear(&[("payment_id".to_owned(), self.payment_id.as_str())])
    }

    pub fn validate(&self) -> Result<(), ApiError> {
        text("payment_id", &self.payment_id)?;
        if self.amount.is_negative() || self.amount.is_zero() {
            return Err(ApiError::validation("amount", "must be positive"));
        }
        events::name::check_method(&self.method).map_err(|why| ApiError::validation("method", why))
    }

    pub fn fingerprint(&self, order_id: Uuid) -> String {
        let mut c = Canonical::new("POST /orders/{id}/payments v1");
        c.field("order_id", &order_id.to_string())
            .field("payment_id", &self.payment_id)
            .field("amount", &self.amount.minor().to_string())
            .optional("currency", self.currency.as_ref().map(Currency::as_str))
            .field("method", &self.method);
        c.finish()
    }
}

// -------------------------------------------------- POST /orders/{id}/deliveries

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeliveryRequest {
    pub delivery_id: String,
    pub lines: Vec<DeliveryLineRequest>,
    /// When the parcel was delivered (seed 003: revenue is recognised on
    /// delivery), if not now: RFC 3339 with an offset, kept in UTC. Absent
    /// (or null): the time the API records the delivery.
    #[serde(default, deserialize_with = "rfc3339_utc")]
    pub delivered_at: Option<OffsetDateTime>,
}

/// How far ahead of the database's clock a `delivered_at` may be (the
/// courier's clock may run ahead a little).
pub const MAX_CLOCK_SKEW: time::Duration = time::Duration::minutes(2);

/// Whether `delivered_at` is further ahead of `now`, the database's clock
/// in the request's transaction, than [`MAX_CLOCK_SKEW`]. Judged there, in the
/// request's transaction, never on the API host's clock before the key is
/// looked at: a retry of a recorded delivery (reaching a replica whose
/// clock is behind, or after the clock stepped back) is answered from its
/// record, and the limit is the clock the event's own time comes from.
pub fn in_the_future(delivered_at: OffsetDateTime, now: OffsetDateTime) -> bool {
    delivered_at > now + MAX_CLOCK_SKEW
}

/// An optional RFC 3339 timestamp (an offset required), in UTC.
fn rfc3339_utc<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<OffsetDateTime>, D::Error> {
    let Some(text) = Option::<String>::deserialize(deserializer)? else {
        return Ok(None);
    };
    // `time`'s parse, as releases before parsed it (it also takes any byte
    // between date and time, which the events' parser refuses): a request
    // an earlier release stored must parse to replay. What it yields is
    // written to ParcelDelivered in the one form.
    let at = OffsetDateTime::parse(&text, &Rfc3339).map_err(|error| {
        serde::de::Error::custom(format_args!(
            "expected an RFC 3339 timestamp with an offset like \"2024-05-13T14:00:00Z\", \
             got {text:?} ({error})"
        ))
    })?;
    // In UTC the value may leave the years 0000-9999 ("9999-12-31T23:30:00-01:00").
    at.checked_to_offset(UtcOffset::UTC)
        .map(Some)
        .ok_or_else(|| {
            serde::de::Error::custom(format_args!(
                "{text:?} is outside the years 0000-9999 in UTC"
            ))
        })
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeliveryLineRequest {
    pub sku: String,
    pub qty: u32,
}

impl DeliveryRequest {
    /// [`clear_name`]'s refusal of the first of its names that breaks it.
    pub fn unclear_name(&self) -> Option<ApiError> {
        let mut names = vec![("delivery_id".to_owned(), self.delivery_id.as_str())];
        names.extend(skus(self.lines.iter().map(|line| line.sku.as_str())));
        first_unclear(&names)
    }

    /// The request's own rules. (That `delivered_at` is neither before the
    /// order was placed nor in the future is judged in its transaction,
    /// on the database's clock: [`in_the_future`].)
    pub fn validate(&self) -> Result<(), ApiError> {
        if let Some(at) = self.delivered_at {
            if at.nanosecond() % 1_000 != 0 {
                return Err(ApiError::validation(
                    "delivered_at",
                    "has at most microsecond precision (6 fractional digits)",
                ));
            }
        }
        text("delivery_id", &self.delivery_id)?;
        if self.lines.is_empty() {
            return Err(ApiError::validation(
                "lines",
                "a delivery needs at least one line",
            ));
        }
        if self.lines.len() > MAX_LINES {
            return Err(ApiError::validation(
                "lines",
                format!("at most {MAX_LINES} lines"),
            ));
        }
        for (i, line) in self.lines.iter().enumerate() {
            text(&format!("lines[{i}].sku"), &line.sku)?;
            if line.qty == 0 || line.qty > MAX_QTY {
                return Err(ApiError::validation(
                    format!("lines[{i}].qty"),
                    format!("must be between 1 and {MAX_QTY}"),
                ));
            }
        }
        Ok(())
    }

    /// The fingerprint before session 10: over the lines in the order sent.
    pub fn fingerprint_in_line_order(&self, order_id: Uuid) -> String {
        let lines: Vec<(&str, u64)> = self
            .lines
            .iter()
            .map(|l| (l.sku.as_str(), u64::from(l.qty)))
            .collect();
        self.encode(order_id, &lines)
    }

    /// Over the quantity per SKU, in SKU order: what the delivery means
    /// (it must equal the order's quantity per SKU), so lines sent in
    /// another order, or one SKU split over two lines, are the same
    /// request. (Distinct SKUs already in order encode as before.)
    pub fn fingerprint(&self, order_id: Uuid) -> String {
        let mut per_sku: std::collections::BTreeMap<&str, u64> = std::collections::BTreeMap::new();
        for line in &self.lines {
            *per_sku.entry(line.sku.as_str()).or_default() += u64::from(line.qty);
        }
        let lines: Vec<(&str, u64)> = per_sku.into_iter().collect();
        self.encode(order_id, &lines)
    }

    fn encode(&self, order_id: Uuid, lines: &[(&str, u64)]) -> String {
        let mut c = Canonical::new("POST /orders/{id}/deliveries v1");
        c.field("order_id", &order_id.to_string())
            .field("delivery_id", &self.delivery_id)
            .field("lines", &lines.len().to_string());
        for (sku, qty) in lines {
            c.field("sku", sku).field("qty", &qty.to_string());
        }
        // The instant, whatever offset it was given in. Left out when absent
        // (the recording time): such a request keeps the fingerprint it had
        // before the field existed.
        if let Some(at) = self.delivered_at {
            c.field("delivered_at", &at.unix_timestamp_nanos().to_string());
        }
        c.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order(body: &str) -> NewOrder {
        parse::<CreateOrderRequest>(body.as_bytes())
            .expect("parse")
            .validate()
            .expect("valid")
    }

    const SEED: &str = r#"{"customer_id":"77","lines":[{"sku":"JKT-M","qty":2,"unit_price":"40.00","unit_cost":"22.00"}],"shipping":"5.00","tax":"8.00","currency":"USD","location":"WH-1"}"#;

    #[test]
    fn field_order_whitespace_and_defaults_do_not_change_the_fingerprint() {
        let base = order(SEED).fingerprint();
        let reordered = r#"
        {
            "location": "WH-1",  "currency": "USD", "tax": "8.00",
            "lines": [ { "unit_cost": "22.00", "qty": 2, "unit_price": "40.00", "sku": "JKT-M" } ],
            "shipping": "5.00",
            "customer_id": "77"
        }"#;
        assert_eq!(order(reordered).fingerprint(), base);
        let explicit_defaults = r#"{"customer_id":"77","checkout_id":null,"total":"93.00","lines":[{"sku":"JKT-M","qty":2,"unit_price":"40.00","unit_cost":"22.00"}],"shipping":"5.00","tax":"8.00","currency":"USD","location":"WH-1"}"#;
        assert_eq!(order(explicit_defaults).fingerprint(), base);
    }

    #[test]
    fn any_business_change_changes_the_fingerprint() {
        let base = order(SEED).fingerprint();
        for changed in [
            SEED.replace("\"77\"", "\"78\""),
            SEED.replace("\"qty\":2", "\"qty\":3"),
            SEED.replace("\"40.00\"", "\"40.01\""),
            SEED.replace("\"22.00\"", "\"21.00\""),
            SEED.replace("\"5.00\"", "\"6.00\""),
            SEED.replace("\"USD\"", "\"EUR\""),
            SEED.replace("WH-1", "WH-2"),
            SEED.replace("JKT-M", "JKT-L"),
            SEED.replace(
                "{\"customer_id\"",
                "{\"checkout_id\":\"c-1\",\"customer_id\"",
            ),
            // The same total: shipping and tax swapped.
            SEED.replace(
                "\"shipping\":\"5.00\",\"tax\":\"8.00\"",
                "\"shipping\":\"8.00\",\"tax\":\"5.00\"",
            ),
        ] {
            assert_ne!(order(&changed).fingerprint(), base, "{changed}");
        }
        // Two lines trading their prices (the same total): another order.
        let two = |a: &str, b: &str| {
            SEED.replace(
                r#"[{"sku":"JKT-M","qty":2,"unit_price":"40.00","unit_cost":"22.00"}]"#,
                &format!(
                    r#"[{{"sku":"A","qty":1,"unit_price":"{a}","unit_cost":"1.00"}},{{"sku":"B","qty":1,"unit_price":"{b}","unit_cost":"1.00"}}]"#
                ),
            )
        };
        assert_ne!(
            order(&two("10.00", "20.00")).fingerprint(),
            order(&two("20.00", "10.00")).fingerprint()
        );
    }

    #[test]
    fn any_change_of_a_payment_changes_its_fingerprint() {
        let payment = |body: &str| parse::<PaymentRequest>(body.as_bytes()).expect("parse");
        let base_body = r#"{"payment_id":"9001","amount":"93.00","method":"card"}"#;
        let base = payment(base_body).fingerprint(Uuid::nil());
        assert_ne!(payment(base_body).fingerprint(Uuid::max()), base, "order");
        for changed in [
            base_body.replace("9001", "9002"),
            base_body.replace("93.00", "93.01"),
            base_body.replace("card", "cash"),
            base_body.replace("\"card\"", "\"card\",\"currency\":\"USD\""),
        ] {
            assert_ne!(
                payment(&changed).fingerprint(Uuid::nil()),
                base,
                "{changed}"
            );
        }
    }

    #[test]
    fn names_padded_with_white_space_or_holding_invisible_characters_are_refused() {
        let text =
            |field: &str, value: &str| text(field, value).and_then(|()| clear_name(field, value));
        // The joiners are spelling between two letters (Indic scripts,
        // Persian, emoji).
        for good in [
            "JKT-M",
            "a b",
            "\u{915}\u{93F}",
            "WH-1",
            "x",
            "\u{915}\u{94D}\u{200D}\u{937}",
            "\u{645}\u{200C}\u{6CC}",
            "\u{1F468}\u{200D}\u{1F469}",
        ] {
            assert!(text("sku", good).is_ok(), "{good:?}");
        }
        for (bad, why) in [
            ("JKT-M ", "white space"),
            (" JKT-M", "white space"),
            ("   ", "white space"),
            ("a\u{00A0}", "white space"),
            ("chk-1\u{200B}", "U+200B"),
            ("\u{FEFF}77", "U+FEFF"),
            ("ab\u{202E}c", "U+202E"),
            ("a\u{2028}b", "U+2028"),
            ("a\u{00AD}b", "U+00AD"),
            ("a\u{E0041}", "U+E0041"),
            ("chk-1\u{200D}", "U+200D"),
            ("\u{200C}", "U+200C"),
            ("\u{200C}\u{645}", "U+200C"),
            ("JKT\u{200C}M", "U+200C"),
            ("\u{645}\u{200C}\u{200C}\u{6CC}", "U+200C"),
            ("a\nb", "control"),
            ("", "empty"),
        ] {
            let problem = text("sku", bad).expect_err(bad).problem();
            let detail = problem.detail.clone().unwrap_or_default();
            assert!(detail.contains(why), "{bad:?}: {detail}");
        }
    }

    fn delivery(lines: &[(&str, u32)]) -> DeliveryRequest {
        DeliveryRequest {
            delivered_at: None,
            delivery_id: "311".to_owned(),
            lines: lines
                .iter()
                .map(|(sku, qty)| DeliveryLineRequest {
                    sku: (*sku).to_owned(),
                    qty: *qty,
                })
                .collect(),
        }
    }

    #[test]
    fn a_delivery_s_fingerprint_is_its_quantity_per_sku() {
        let order_id = Uuid::nil();
        let base = delivery(&[("A", 2), ("B", 1)]).fingerprint(order_id);
        // The same delivery: lines in another order, a SKU split in two.
        assert_eq!(delivery(&[("B", 1), ("A", 2)]).fingerprint(order_id), base);
        assert_eq!(
            delivery(&[("A", 1), ("B", 1), ("A", 1)]).fingerprint(order_id),
            base
        );
        // Another delivery.
        let mut renamed = delivery(&[("A", 2), ("B", 1)]);
        renamed.delivery_id = "312".to_owned();
        assert_ne!(renamed.fingerprint(order_id), base, "delivery_id");
        for other in [
            delivery(&[("A", 2)]),
            delivery(&[("A", 2), ("B", 2)]),
            delivery(&[("A", 2), ("C", 1)]),
        ] {
            assert_ne!(other.fingerprint(order_id), base);
        }
        // Distinct SKUs in order: the encoding of before (a retry sent
        // across an upgrade is still the same request).
        let sorted = delivery(&[("A", 2), ("B", 1)]);
        assert_eq!(sorted.fingerprint_in_line_order(order_id), base);
        // In another order: the earlier encoding differs, and the route
        // accepts it too (`earlier_fingerprints`).
        let reordered = delivery(&[("B", 1), ("A", 2)]);
        assert_ne!(reordered.fingerprint_in_line_order(order_id), base);
    }

    #[test]
    fn a_delivery_s_time_is_an_instant_in_the_past_and_part_of_its_fingerprint() {
        let order_id = Uuid::nil();
        let at = |value: &str| {
            parse::<DeliveryRequest>(
                format!(r#"{{"delivery_id":"311","lines":[{{"sku":"A","qty":2}}],"delivered_at":{value}}}"#)
                    .as_bytes(),
            )
        };
        let absent = delivery(&[("A", 2)]);
        assert_eq!(
            at("null").expect("null").fingerprint(order_id),
            absent.fingerprint(order_id)
        );
        let utc = at(r#""2024-05-13T14:00:00Z""#).expect("utc");
        let offset = at(r#""2024-05-13T16:00:00.000+02:00""#).expect("offset");
        assert_eq!(utc.delivered_at, offset.delivered_at);
        assert_eq!(offset.delivered_at.expect("at").offset(), UtcOffset::UTC);
        assert_eq!(
            utc.fingerprint(order_id),
            offset.fingerprint(order_id),
            "one instant"
        );
        assert_ne!(utc.fingerprint(order_id), absent.fingerprint(order_id));
        let later = at(r#""2024-05-13T14:00:01Z""#).expect("later");
        assert_ne!(later.fingerprint(order_id), utc.fingerprint(order_id));
        // Parsed as releases before parsed it (`time`'s parser, which takes
        // any byte between date and time): a request they stored under
        // such a spelling is the same request, and replays.
        let odd = at(r#""2024-05-13X14:00:00Z""#).expect("parsed as before");
        assert_eq!(odd.delivered_at, utc.delivered_at);
        assert_eq!(odd.fingerprint(order_id), utc.fingerprint(order_id));

        for malformed in [
            r#""2024-05-13T14:00:00""#,
            r#""2024-05-13""#,
            r#""yesterday""#,
            "1715608800",
            // Year 10000 in UTC: refused, not a panic.
            r#""9999-12-31T23:30:00-01:00""#,
        ] {
            let error = at(malformed).expect_err(malformed);
            assert_eq!(error.problem().status, 400, "{malformed}");
            assert_eq!(error.field(), Some("delivered_at"), "{malformed}");
        }

        let now = OffsetDateTime::parse("2024-05-13T14:00:00Z", &Rfc3339).expect("now");
        assert!(utc.validate().is_ok());
        // No clock in the request's own rules: a time years ahead passes
        // them (the transaction judges it against the database's clock).
        let ahead = at(r#""2034-05-13T14:00:00Z""#).expect("ahead");
        assert!(ahead.validate().is_ok());
        let skewed = at(r#""2024-05-13T14:02:00Z""#).expect("skew");
        assert!(!in_the_future(skewed.delivered_at.expect("given"), now));
        let past_skew = at(r#""2024-05-13T14:02:00.000001Z""#).expect("past the skew");
        assert!(in_the_future(past_skew.delivered_at.expect("given"), now));
        for invalid in [
            r#""2024-05-13T14:00:00.0000001Z""#,
            // Past nine digits `time` keeps the first nine: refused here
            // for its precision (422), not in the parse (400).
            r#""2024-05-13T14:00:00.1234567891Z""#,
        ] {
            let error = at(invalid).expect("parses").validate().expect_err(invalid);
            assert_eq!(error.problem().status, 422, "{invalid}");
            assert_eq!(error.field(), Some("delivered_at"), "{invalid}");
        }
    }

    #[test]
    fn a_payment_s_currency_default_is_the_same_request_as_its_value() {
        let payment = |currency: Option<&str>| {
            parse::<PaymentRequest>(
                match currency {
                    Some(c) => format!(
                        r#"{{"payment_id":"9001","amount":"93.00","currency":"{c}","method":"card"}}"#
                    ),
                    None => r#"{"payment_id":"9001","amount":"93.00","method":"card"}"#.to_owned(),
                }
                .as_bytes(),
            )
            .expect("parse")
        };
        // The route leaves out a currency equal to the order's
        // (`OrderCommand::omit_defaults`); another one stays, and differs.
        let order_id = Uuid::nil();
        let absent = payment(None).fingerprint(order_id);
        let mut spelled_out = payment(Some("USD"));
        assert_ne!(spelled_out.fingerprint(order_id), absent);
        spelled_out.currency = None;
        assert_eq!(spelled_out.fingerprint(order_id), absent);
        assert_ne!(payment(Some("EUR")).fingerprint(order_id), absent);
    }

    #[test]
    fn the_canonical_encoding_is_unambiguous() {
        // "a" + "bc" and "ab" + "c" must differ: values are length-prefixed.
        let mut one = Canonical::new("v");
        one.field("x", "a").field("y", "bc");
        let mut two = Canonical::new("v");
        two.field("x", "ab").field("y", "c");
        assert_ne!(one.finish(), two.finish());
    }

    #[test]
    fn the_server_computes_and_checks_the_total() {
        let o = order(SEED);
        assert_eq!(o.merchandise, Money::from_minor(8000));
        assert_eq!(o.total, Money::from_minor(9300));
        let wrong = SEED.replace("{\"customer_id\"", "{\"total\":\"90.00\",\"customer_id\"");
        let error = parse::<CreateOrderRequest>(wrong.as_bytes())
            .expect("parse")
            .validate()
            .expect_err("wrong total");
        assert_eq!(error.field(), Some("total"));
    }

    #[test]
    fn parse_errors_name_the_field() {
        let cases = [
            (SEED.replace("\"40.00\"", "40.0"), "lines[0].unit_price"),
            (SEED.replace("\"40.00\"", "\"40.0\""), "lines[0].unit_price"),
            (SEED.replace("\"qty\":2", "\"qty\":-1"), "lines[0].qty"),
            (SEED.replace("\"qty\":2", "\"qty\":1.5"), "lines[0].qty"),
            (SEED.replace("\"USD\"", "\"XYZ\""), "currency"),
            (SEED.replace("\"tax\"", "\"taxes\""), "taxes"),
            ("not json".to_owned(), "body"),
            (format!("{SEED} trailing"), "body"),
        ];
        for (body, field) in cases {
            let error = parse::<CreateOrderRequest>(body.as_bytes()).expect_err(&body);
            let got = error.field().unwrap_or_default().to_owned();
            assert!(
                got == field || got.starts_with(field),
                "{body}: field {got}, want {field}"
            );
        }
    }

    /// Two lines whose amounts each fit but whose sum does not.
    fn two_lines(unit_price: &str, unit_cost: &str) -> String {
        let line = format!(
            r#"{{"sku":"JKT-M","qty":1,"unit_price":"{unit_price}","unit_cost":"{unit_cost}"}}"#
        );
        format!(
            r#"{{"customer_id":"77","lines":[{line},{line}],"shipping":"0.00","tax":"0.00","currency":"USD","location":"WH-1"}}"#
        )
    }

    /// Validates `body` (which must parse) and checks that it is rejected as
    /// an overflow: 422, "amount overflows"; returns the error.
    fn overflow_error(body: &str) -> ApiError {
        let error = parse::<CreateOrderRequest>(body.as_bytes())
            .expect("parse")
            .validate()
            .expect_err(body);
        assert_eq!(
            actix_web::ResponseError::status_code(&error),
            actix_web::http::StatusCode::UNPROCESSABLE_ENTITY,
            "{body}"
        );
        assert!(
            matches!(&error, ApiError::Validation { message, .. } if message == "amount overflows"),
            "{body}: {error:?}"
        );
        error
    }

    #[test]
    fn an_order_with_nothing_to_pay_is_rejected() {
        let body = two_lines("0.00", "1.00");
        let error = parse::<CreateOrderRequest>(body.as_bytes())
            .expect("parse")
            .validate()
            .expect_err(&body);
        assert_eq!(
            actix_web::ResponseError::status_code(&error),
            actix_web::http::StatusCode::UNPROCESSABLE_ENTITY
        );
        assert_eq!(error.field(), Some("total"));
        let paid_shipping = body.replacen("\"shipping\":\"0.00\"", "\"shipping\":\"0.01\"", 1);
        assert_ne!(paid_shipping, body);
        parse::<CreateOrderRequest>(paid_shipping.as_bytes())
            .expect("parse")
            .validate()
            .expect("free goods with a shipping charge are an order");
    }

    #[test]
    fn a_cost_sum_that_overflows_is_rejected() {
        let body = two_lines("1.00", "50000000000000000.00");
        assert_eq!(overflow_error(&body).field(), Some("lines"), "{body}");
    }

    #[test]
    fn merchandise_and_total_sums_that_overflow_are_rejected() {
        let body = two_lines("50000000000000000.00", "1.00");
        assert_eq!(overflow_error(&body).field(), Some("lines"), "{body}");
        let body = SEED.replace("\"5.00\"", &format!("\"{}\"", Money::MAX));
        assert_eq!(overflow_error(&body).field(), Some("total"), "{body}");
    }

    #[test]
    fn validation_errors_name_the_field() {
        let cases = [
            (SEED.replace("\"qty\":2", "\"qty\":0"), "lines[0].qty"),
            (SEED.replace("\"77\"", "\"\""), "customer_id"),
            (SEED.replace("\"5.00\"", "\"-5.00\""), "shipping"),
            (
                SEED.replace(
                    "[{\"sku\":\"JKT-M\",\"qty\":2,\"unit_price\":\"40.00\",\"unit_cost\":\"22.00\"}]",
                    "[]",
                ),
                "lines",
            ),
        ];
        for (body, field) in cases {
            let error = parse::<CreateOrderRequest>(body.as_bytes())
                .expect("parse")
                .validate()
                .expect_err(&body);
            assert_eq!(error.field(), Some(field), "{body}");
        }
    }
}
