//! Money as integer minor units (cents), encoded on the wire as a decimal
//! string with exactly two places.

use std::fmt;
use std::str::FromStr;

use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Error text used when a JSON number is found where money is expected.
pub(crate) const JSON_NUMBER_MESSAGE: &str =
    "money must be a decimal string like \"40.00\", not a JSON number";

/// An amount of money in integer minor units (cents: two decimal places).
///
/// The currency is carried next to the amount (see [`crate::Currency`]); every
/// supported currency has exactly two minor-unit digits, so `Money` is the
/// same scale everywhere.
///
/// On the wire (HTTP and events) money is a JSON **string** with exactly two
/// decimal places, matching `^-?(0|[1-9][0-9]*)\.[0-9]{2}$`: `"40.00"`,
/// `"-2.50"`, `"0.05"`. Everything else is rejected with a [`MoneyError`]
/// that names the problem: JSON numbers (`40.0`, `40`), a wrong scale
/// (`"40"`, `"40.0"`, `"40.000"`), a leading `+`, whitespace, exponents,
/// leading zeros (`"040.00"`) and amounts outside the `i64` range of minor
/// units. `"-0.00"` is accepted and normalised to zero (it formats as
/// `"0.00"`).
///
/// Arithmetic is checked: there is no `Add`/`Mul` implementation that could
/// silently overflow.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Money(i64);

/// A total of amounts in minor units, as a decimal string with two places
/// (`"184467440737095516.14"`): the sums a report adds up can leave `i64`
/// (each amount fits; their sum need not).
#[must_use]
pub fn format_total(minor: i128) -> String {
    let sign = if minor < 0 { "-" } else { "" };
    let magnitude = minor.unsigned_abs();
    format!("{sign}{}.{:02}", magnitude / 100, magnitude % 100)
}

impl Money {
    /// Zero.
    pub const ZERO: Money = Money(0);
    /// The largest representable amount: `92233720368547758.07`.
    pub const MAX: Money = Money(i64::MAX);
    /// The smallest representable amount: `-92233720368547758.08`.
    pub const MIN: Money = Money(i64::MIN);

    /// Money from integer minor units (cents): `from_minor(4000)` is `40.00`.
    #[must_use]
    pub const fn from_minor(minor: i64) -> Money {
        Money(minor)
    }

    /// The amount in integer minor units (cents).
    #[must_use]
    pub const fn minor(self) -> i64 {
        self.0
    }

    /// The whole currency units, truncated toward zero: `80.99` gives `80`,
    /// `-2.50` gives `-2`.
    #[must_use]
    pub const fn whole_units(self) -> i64 {
        self.0 / 100
    }

    /// `true` if the amount is zero.
    #[must_use]
    pub const fn is_zero(self) -> bool {
        self.0 == 0
    }

    /// `true` if the amount is below zero.
    #[must_use]
    pub const fn is_negative(self) -> bool {
        self.0 < 0
    }

    /// `self + rhs`, or `None` on overflow.
    #[must_use]
    pub const fn checked_add(self, rhs: Money) -> Option<Money> {
        match self.0.checked_add(rhs.0) {
            Some(v) => Some(Money(v)),
            None => None,
        }
    }

    /// `self - rhs`, or `None` on overflow.
    #[must_use]
    pub const fn checked_sub(self, rhs: Money) -> Option<Money> {
        match self.0.checked_sub(rhs.0) {
            Some(v) => Some(Money(v)),
            None => None,
        }
    }

    /// `self * factor` (e.g. unit price times quantity), or `None` on overflow.
    #[must_use]
    pub const fn checked_mul(self, factor: i64) -> Option<Money> {
        match self.0.checked_mul(factor) {
            Some(v) => Some(Money(v)),
            None => None,
        }
    }

    /// `-self`, or `None` for [`Money::MIN`].
    #[must_use]
    pub const fn checked_neg(self) -> Option<Money> {
        match self.0.checked_neg() {
            Some(v) => Some(Money(v)),
            None => None,
        }
    }

    /// The sum of all amounts, or `None` if any partial sum overflows.
    pub fn checked_sum<I>(amounts: I) -> Option<Money>
    where
        I: IntoIterator<Item = Money>,
    {
        amounts
            .into_iter()
            .try_fold(Money::ZERO, |acc, m| acc.checked_add(m))
    }

    /// Parses the wire form: `^-?(0|[1-9][0-9]*)\.[0-9]{2}$`.
    ///
    /// `"-0.00"` is accepted and is equal to [`Money::ZERO`].
    pub fn parse(input: &str) -> Result<Money, MoneyError> {
        if input.is_empty() {
            return Err(MoneyError::Empty);
        }
        if input.chars().any(char::is_whitespace) {
            return Err(MoneyError::Whitespace);
        }
        if input.starts_with('+') {
            return Err(MoneyError::LeadingPlus);
        }
        if input.contains(['e', 'E']) {
            return Err(MoneyError::Exponent);
        }
        let (negative, unsigned) = match input.strip_prefix('-') {
            Some(rest) => (true, rest),
            None => (false, input),
        };
        let Some((int_part, frac_part)) = unsigned.split_once('.') else {
            if let Some(c) = unsigned.chars().find(|c| !c.is_ascii_digit()) {
                return Err(MoneyError::InvalidCharacter(c));
            }
            return Err(MoneyError::MissingDecimalPoint);
        };
        if let Some(c) = int_part
            .chars()
            .chain(frac_part.chars())
            .find(|c| !c.is_ascii_digit())
        {
            return Err(MoneyError::InvalidCharacter(c));
        }
        if int_part.is_empty() {
            return Err(MoneyError::MissingIntegerPart);
        }
        if frac_part.len() != 2 {
            return Err(MoneyError::WrongScale {
                decimals: frac_part.len(),
            });
        }
        if int_part.len() > 1 && int_part.starts_with('0') {
            return Err(MoneyError::LeadingZero);
        }

        // Magnitude in minor units; all characters are ASCII digits here.
        let mut magnitude: u64 = 0;
        for b in int_part.bytes().chain(frac_part.bytes()) {
            let digit = u64::from(b - b'0');
            magnitude = magnitude
                .checked_mul(10)
                .and_then(|m| m.checked_add(digit))
                .ok_or(MoneyError::Overflow)?;
        }
        let minor = if negative {
            0i64.checked_sub_unsigned(magnitude)
        } else {
            i64::try_from(magnitude).ok()
        };
        minor.map(Money).ok_or(MoneyError::Overflow)
    }
}

impl fmt::Display for Money {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let sign = if self.0 < 0 { "-" } else { "" };
        let magnitude = self.0.unsigned_abs();
        write!(f, "{sign}{}.{:02}", magnitude / 100, magnitude % 100)
    }
}

impl FromStr for Money {
    type Err = MoneyError;

    fn from_str(s: &str) -> Result<Money, MoneyError> {
        Money::parse(s)
    }
}

impl Serialize for Money {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Money {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Money, D::Error> {
        // `deserialize_any`, not `deserialize_str`: self-describing formats
        // then hand numbers to the visitor, which rejects them with a
        // message that says what to send instead.
        deserializer.deserialize_any(MoneyVisitor)
    }
}

struct MoneyVisitor;

impl Visitor<'_> for MoneyVisitor {
    type Value = Money;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a decimal string with exactly two places, like \"40.00\"")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Money, E> {
        Money::parse(v).map_err(|e| E::custom(format_args!("invalid money {v:?}: {e}")))
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Money, E> {
        Err(E::custom(JSON_NUMBER_MESSAGE))
    }

    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Money, E> {
        Err(E::custom(JSON_NUMBER_MESSAGE))
    }

    fn visit_i128<E: de::Error>(self, _: i128) -> Result<Money, E> {
        Err(E::custom(JSON_NUMBER_MESSAGE))
    }

    fn visit_u128<E: de::Error>(self, _: u128) -> Result<Money, E> {
        Err(E::custom(JSON_NUMBER_MESSAGE))
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Money, E> {
        Err(E::custom(JSON_NUMBER_MESSAGE))
    }
}

/// Why a money string was rejected.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MoneyError {
    /// The string is empty.
    Empty,
    /// The string contains whitespace (leading, trailing or inside).
    Whitespace,
    /// The string starts with `+`.
    LeadingPlus,
    /// The string uses exponent notation (`1e3`).
    Exponent,
    /// A character other than an optional leading `-`, digits and one `.`.
    InvalidCharacter(char),
    /// No digits before the decimal point (`".50"`).
    MissingIntegerPart,
    /// No decimal point at all (`"40"`).
    MissingDecimalPoint,
    /// Not exactly two digits after the decimal point (`"40.0"`, `"40.000"`).
    WrongScale {
        /// How many digits followed the decimal point.
        decimals: usize,
    },
    /// The integer part has a leading zero (`"040.00"`).
    LeadingZero,
    /// The amount does not fit in a signed 64-bit number of minor units.
    Overflow,
}

impl fmt::Display for MoneyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MoneyError::Empty => f.write_str("money is empty"),
            MoneyError::Whitespace => f.write_str("money must not contain whitespace"),
            MoneyError::LeadingPlus => f.write_str("money must not start with '+'"),
            MoneyError::Exponent => {
                f.write_str("money must not use exponent notation; write the plain decimal")
            }
            MoneyError::InvalidCharacter(c) => write!(
                f,
                "money contains invalid character {c:?}; only an optional leading '-', digits and one '.' are allowed"
            ),
            MoneyError::MissingIntegerPart => {
                f.write_str("money needs at least one digit before the decimal point")
            }
            MoneyError::MissingDecimalPoint => f.write_str(
                "money has no decimal point; exactly two decimal places are required, like \"40.00\"",
            ),
            MoneyError::WrongScale { decimals } => write!(
                f,
                "money must have exactly two decimal places, found {decimals}"
            ),
            MoneyError::LeadingZero => f.write_str("money must not have leading zeros"),
            MoneyError::Overflow => write!(
                f,
                "money is out of range; amounts must lie between {} and {}",
                Money::MIN,
                Money::MAX
            ),
        }
    }
}

impl std::error::Error for MoneyError {}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> Result<Money, MoneyError> {
        Money::parse(s)
    }

    #[test]
    fn parses_and_displays_round_trip() {
        for (text, minor) in [
            ("0.00", 0),
            ("0.05", 5),
            ("0.50", 50),
            ("1.00", 100),
            ("40.00", 4000),
            ("93.00", 9300),
            ("-2.50", -250),
            ("-0.01", -1),
            ("123456789.99", 12_345_678_999),
            ("92233720368547758.07", i64::MAX),
            ("-92233720368547758.08", i64::MIN),
        ] {
            let m = p(text).unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!(m.minor(), minor, "{text}");
            assert_eq!(m.to_string(), text);
            assert_eq!(Money::from_minor(minor).to_string(), text);
            assert_eq!(text.parse::<Money>(), Ok(m));
        }
    }

    #[test]
    fn negative_zero_is_normalised() {
        assert_eq!(p("-0.00"), Ok(Money::ZERO));
        assert_eq!(p("-0.00").map(|m| m.to_string()), Ok("0.00".to_owned()));
    }

    #[test]
    fn boundaries() {
        assert_eq!(Money::MAX.to_string(), "92233720368547758.07");
        assert_eq!(Money::MIN.to_string(), "-92233720368547758.08");
        assert_eq!(p(&Money::MAX.to_string()), Ok(Money::MAX));
        assert_eq!(p(&Money::MIN.to_string()), Ok(Money::MIN));
        assert_eq!(p("92233720368547758.08"), Err(MoneyError::Overflow));
        assert_eq!(p("-92233720368547758.09"), Err(MoneyError::Overflow));
        assert_eq!(p("184467440737095516.16"), Err(MoneyError::Overflow));
        assert_eq!(
            p("99999999999999999999999999999999.00"),
            Err(MoneyError::Overflow)
        );
        let msg = MoneyError::Overflow.to_string();
        assert!(msg.contains("out of range"), "{msg}");
        assert!(msg.contains("92233720368547758.07"), "{msg}");
    }

    #[test]
    fn rejects_malformed() {
        let cases: &[(&str, MoneyError)] = &[
            ("", MoneyError::Empty),
            ("40", MoneyError::MissingDecimalPoint),
            ("-40", MoneyError::MissingDecimalPoint),
            ("40.", MoneyError::WrongScale { decimals: 0 }),
            ("40.0", MoneyError::WrongScale { decimals: 1 }),
            ("40.000", MoneyError::WrongScale { decimals: 3 }),
            (".50", MoneyError::MissingIntegerPart),
            ("-.50", MoneyError::MissingIntegerPart),
            ("+40.00", MoneyError::LeadingPlus),
            (" 40.00", MoneyError::Whitespace),
            ("40.00 ", MoneyError::Whitespace),
            ("40 .00", MoneyError::Whitespace),
            ("\u{a0}40.00", MoneyError::Whitespace),
            ("1e3", MoneyError::Exponent),
            ("1.00E2", MoneyError::Exponent),
            ("040.00", MoneyError::LeadingZero),
            ("00.00", MoneyError::LeadingZero),
            ("-01.00", MoneyError::LeadingZero),
            ("--1.00", MoneyError::InvalidCharacter('-')),
            ("1.-1", MoneyError::InvalidCharacter('-')),
            ("1,00", MoneyError::InvalidCharacter(',')),
            ("1.0.0", MoneyError::InvalidCharacter('.')),
            ("$1.00", MoneyError::InvalidCharacter('$')),
            ("٤٠.٠٠", MoneyError::InvalidCharacter('٤')),
            ("NaN", MoneyError::InvalidCharacter('N')),
            ("inf", MoneyError::InvalidCharacter('i')),
            ("-", MoneyError::MissingDecimalPoint),
        ];
        for (text, expected) in cases {
            assert_eq!(p(text).as_ref(), Err(expected), "{text:?}");
        }
    }

    #[test]
    fn error_messages_name_the_problem() {
        let msg = |s: &str| p(s).map(|_| ()).unwrap_err().to_string();
        assert!(msg("40.0").contains("exactly two decimal places, found 1"));
        assert!(msg("40.000").contains("exactly two decimal places, found 3"));
        assert!(msg("40").contains("no decimal point"));
        assert!(msg("+1.00").contains("'+'"));
        assert!(msg(" 1.00").contains("whitespace"));
        assert!(msg("1e3").contains("exponent"));
        assert!(msg("040.00").contains("leading zeros"));
    }

    #[test]
    fn checked_arithmetic() {
        let a = Money::from_minor(4000);
        assert_eq!(
            a.checked_add(Money::from_minor(500)),
            Some(Money::from_minor(4500))
        );
        assert_eq!(
            a.checked_sub(Money::from_minor(5000)),
            Some(Money::from_minor(-1000))
        );
        assert_eq!(a.checked_mul(2), Some(Money::from_minor(8000)));
        assert_eq!(a.checked_mul(-1), Some(Money::from_minor(-4000)));
        assert_eq!(Money::MAX.checked_add(Money::from_minor(1)), None);
        assert_eq!(Money::MIN.checked_sub(Money::from_minor(1)), None);
        assert_eq!(Money::MAX.checked_mul(2), None);
        assert_eq!(Money::MIN.checked_mul(-1), None);
        assert_eq!(Money::MIN.checked_neg(), None);
        assert_eq!(Money::MAX.checked_neg(), Some(Money::from_minor(-i64::MAX)));
        assert_eq!(
            Money::checked_sum([a, a, Money::from_minor(1300)]),
            Some(Money::from_minor(9300))
        );
        assert_eq!(Money::checked_sum([Money::MAX, Money::from_minor(1)]), None);
        assert_eq!(Money::checked_sum([]), Some(Money::ZERO));
    }

    #[test]
    fn whole_units_truncate_toward_zero() {
        assert_eq!(Money::from_minor(8000).whole_units(), 80);
        assert_eq!(Money::from_minor(8099).whole_units(), 80);
        assert_eq!(Money::from_minor(-250).whole_units(), -2);
        assert_eq!(Money::ZERO.whole_units(), 0);
    }

    #[test]
    fn serde_uses_strings_only() {
        assert_eq!(
            serde_json::to_string(&Money::from_minor(-250)).ok(),
            Some("\"-2.50\"".to_owned())
        );
        assert_eq!(
            serde_json::from_str::<Money>("\"40.00\"").ok(),
            Some(Money::from_minor(4000))
        );
        for number in ["40.0", "40", "-40", "1e3", "18446744073709551616"] {
            let err = serde_json::from_str::<Money>(number)
                .map(|_| ())
                .unwrap_err()
                .to_string();
            assert!(err.contains(JSON_NUMBER_MESSAGE), "{number}: {err}");
        }
        let err = serde_json::from_str::<Money>("\"40.0\"")
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(err.contains("invalid money \"40.0\""), "{err}");
        assert!(err.contains("exactly two decimal places"), "{err}");
        let err = serde_json::from_str::<Money>("true")
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("a decimal string with exactly two places"),
            "{err}"
        );
        assert!(serde_json::from_str::<Money>("null").is_err());
    }
}
