//! The rule for the names an event carries: a customer id, a location, a
//! sku, a checkout, payment, delivery or receipt id: 1 to 255 bytes of
//! UTF-8, no control characters; and for a payment's method
//! ([`check_method`]).
//!
//! order-api checks every name it writes into an event with [`check`], each
//! payload's `check` holds its names to it (a payload written by hand into
//! the outbox, the runbook's repair, is poison when it breaks it), and
//! the consumers' write endpoints (a stock receipt) check theirs with the
//! same function: whatever an order can name, a receipt can name too, so a
//! sale that waits for stock can always be given it (a receipt refused for a
//! location the order was accepted with would leave that sale dead-lettered
//! for good).
//!
//! order-api holds a new request's names to a stricter rule besides (no
//! white space at either end, no invisible character: its
//! `request::clear_name`); this rule, and the receipts', stay as they are,
//! so that what it took before can still be received and replayed.

use std::fmt;

/// The longest name, in bytes of UTF-8 (not characters: a Devanagari
/// character takes three).
pub const MAX_BYTES: usize = 255;

/// Why a name was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NameError {
    /// Empty.
    Empty,
    /// Longer than [`MAX_BYTES`].
    TooLong,
    /// Holds a control character (which no stored name has, and PostgreSQL
    /// refuses outright in the case of NUL).
    ControlCharacter,
}

impl fmt::Display for NameError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NameError::Empty => f.write_str("must not be empty"),
            NameError::TooLong => write!(f, "must be at most {MAX_BYTES} bytes of UTF-8"),
            NameError::ControlCharacter => f.write_str("must not contain control characters"),
        }
    }
}

impl std::error::Error for NameError {}

/// Checks one name against the rule.
pub fn check(value: &str) -> Result<(), NameError> {
    // White space alone is a name order-api took until its stricter rule
    // for new requests (it has stored some, and replays them under their
    // keys): a receipt takes it too.
    if value.is_empty() {
        return Err(NameError::Empty);
    }
    if value.len() > MAX_BYTES {
        return Err(NameError::TooLong);
    }
    if value.chars().any(char::is_control) {
        return Err(NameError::ControlCharacter);
    }
    Ok(())
}

/// The rule for a payment's `method`: a lowercase identifier (`card`,
/// `cash`, `bank_transfer`) of 1 to 32 bytes of `a-z`, `0-9` and `_`. The
/// ledger names the payment's clearing account after it.
pub fn check_method(value: &str) -> Result<(), &'static str> {
    let ok = !value.is_empty()
        && value.len() <= 32
        && value
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
    if ok {
        Ok(())
    } else {
        Err("must be a lowercase identifier such as card, cash or bank_transfer")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_method_is_a_short_lowercase_identifier() {
        for good in ["card", "cash", "bank_transfer", "upi2", &"a".repeat(32)] {
            assert_eq!(check_method(good), Ok(()), "{good}");
        }
        for bad in [
            "",
            "Card",
            "bank transfer",
            "card-1",
            "कार्ड",
            &"a".repeat(33),
        ] {
            assert!(check_method(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_limit_counts_bytes_not_characters() {
        // 85 Devanagari letters: 85 characters, 255 bytes.
        let at_limit = "क".repeat(85);
        assert_eq!(at_limit.len(), MAX_BYTES);
        assert_eq!(check(&at_limit), Ok(()));
        assert_eq!(check(&format!("{at_limit}a")), Err(NameError::TooLong));
        assert_eq!(check(&"a".repeat(MAX_BYTES)), Ok(()));
    }

    #[test]
    fn empty_names_and_control_characters_are_refused() {
        assert_eq!(check(""), Err(NameError::Empty));
        assert_eq!(check(" \t "), Err(NameError::ControlCharacter));
        assert_eq!(check("   "), Ok(()));
        assert_eq!(check("a\u{0}b"), Err(NameError::ControlCharacter));
        assert_eq!(check("a\nb"), Err(NameError::ControlCharacter));
        assert_eq!(check(" sku 7 "), Ok(()));
        assert_eq!(
            NameError::TooLong.to_string(),
            "must be at most 255 bytes of UTF-8"
        );
    }
}
