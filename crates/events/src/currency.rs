//! ISO 4217 currency codes with two minor-unit digits.

use std::fmt;
use std::str::FromStr;

use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The ISO 4217 codes this system accepts. Every one has exactly two
/// minor-unit digits, which is what [`crate::Money`] assumes.
pub const SUPPORTED_CURRENCIES: &[&str] = &[
    "AED", "AUD", "BRL", "CAD", "CHF", "CNY", "CZK", "DKK", "EUR", "GBP", "HKD", "HUF", "ILS",
    "INR", "MXN", "MYR", "NOK", "NZD", "PHP", "PLN", "RON", "SAR", "SEK", "SGD", "THB", "TRY",
    "USD", "ZAR",
];

/// Real ISO 4217 codes whose minor unit is not two digits, with their
/// exponent, so the error can say why they are refused.
const OTHER_EXPONENTS: &[(&str, u8)] = &[
    ("BIF", 0),
    ("CLP", 0),
    ("DJF", 0),
    ("GNF", 0),
    ("ISK", 0),
    ("JPY", 0),
    ("KMF", 0),
    ("KRW", 0),
    ("PYG", 0),
    ("RWF", 0),
    ("UGX", 0),
    ("UYI", 0),
    ("VND", 0),
    ("VUV", 0),
    ("XAF", 0),
    ("XOF", 0),
    ("XPF", 0),
    ("BHD", 3),
    ("IQD", 3),
    ("JOD", 3),
    ("KWD", 3),
    ("LYD", 3),
    ("OMR", 3),
    ("TND", 3),
    ("CLF", 4),
    ("UYW", 4),
];

/// An ISO 4217 currency code with two minor-unit digits (see
/// [`SUPPORTED_CURRENCIES`]).
///
/// Serialised as the plain upper-case code (`"USD"`); validated when
/// deserialised. Codes are case-sensitive: `"usd"` is rejected.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Currency(&'static str);

impl Currency {
    /// US dollar.
    pub const USD: Currency = Currency("USD");
    /// Euro.
    pub const EUR: Currency = Currency("EUR");
    /// Pound sterling.
    pub const GBP: Currency = Currency("GBP");
    /// Indian rupee.
    pub const INR: Currency = Currency("INR");

    /// Number of minor-unit digits of every supported currency.
    pub const MINOR_UNIT_DIGITS: u32 = 2;

    /// Accepts a supported code (exact, upper case).
    pub fn parse(code: &str) -> Result<Currency, CurrencyError> {
        if let Some(&known) = SUPPORTED_CURRENCIES.iter().find(|&&c| c == code) {
            return Ok(Currency(known));
        }
        if let Some(&(_, exponent)) = OTHER_EXPONENTS.iter().find(|(c, _)| *c == code) {
            return Err(CurrencyError::UnsupportedMinorUnits {
                code: code.to_owned(),
                exponent,
            });
        }
        if code.len() == 3 && code.bytes().all(|b| b.is_ascii_uppercase()) {
            Err(CurrencyError::Unknown {
                code: code.to_owned(),
            })
        } else {
            Err(CurrencyError::Malformed {
                code: code.to_owned(),
            })
        }
    }

    /// The three-letter code.
    #[must_use]
    pub fn as_str(&self) -> &'static str {
        self.0
    }
}

impl fmt::Display for Currency {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0)
    }
}

impl FromStr for Currency {
    type Err = CurrencyError;

    fn from_str(s: &str) -> Result<Currency, CurrencyError> {
        Currency::parse(s)
    }
}

impl AsRef<str> for Currency {
    fn as_ref(&self) -> &str {
        self.0
    }
}

impl Serialize for Currency {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.0)
    }
}

impl<'de> Deserialize<'de> for Currency {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Currency, D::Error> {
        deserializer.deserialize_str(CurrencyVisitor)
    }
}

struct CurrencyVisitor;

impl Visitor<'_> for CurrencyVisitor {
    type Value = Currency;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an ISO 4217 currency code like \"USD\"")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Currency, E> {
        Currency::parse(v).map_err(E::custom)
    }
}

/// Why a currency code was rejected.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CurrencyError {
    /// Not three upper-case ASCII letters.
    Malformed {
        /// The rejected input.
        code: String,
    },
    /// A real ISO 4217 code whose minor unit is not two digits (JPY, KWD...).
    UnsupportedMinorUnits {
        /// The rejected code.
        code: String,
        /// Its ISO 4217 minor-unit exponent.
        exponent: u8,
    },
    /// Three letters, but not a supported currency.
    Unknown {
        /// The rejected code.
        code: String,
    },
}

impl fmt::Display for CurrencyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CurrencyError::Malformed { code } => write!(
                f,
                "invalid currency {code:?}: expected a three-letter upper-case ISO 4217 code like \"USD\""
            ),
            CurrencyError::UnsupportedMinorUnits { code, exponent } => write!(
                f,
                "unsupported currency {code:?}: it has {exponent} decimal places; only currencies with 2 decimal places are supported"
            ),
            CurrencyError::Unknown { code } => write!(
                f,
                "unsupported currency {code:?} (not an ISO 4217 code, or one this system does not take): supported codes are {}",
                SUPPORTED_CURRENCIES.join(", ")
            ),
        }
    }
}

impl std::error::Error for CurrencyError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_supported_codes() {
        for code in [
            "USD", "EUR", "GBP", "INR", "CAD", "AUD", "CHF", "SGD", "NZD", "SEK", "NOK", "DKK",
            "PLN", "CZK", "MXN", "BRL", "ZAR", "HKD", "CNY", "AED",
        ] {
            let c = Currency::parse(code).unwrap_or_else(|e| panic!("{code}: {e}"));
            assert_eq!(c.as_str(), code);
            assert_eq!(c.to_string(), code);
        }
        assert_eq!(Currency::parse("USD"), Ok(Currency::USD));
        for c in SUPPORTED_CURRENCIES {
            assert_eq!(c.parse::<Currency>().map(|c| c.as_str()), Ok(*c));
        }
    }

    #[test]
    fn rejects_other_exponents_with_reason() {
        let err = Currency::parse("JPY").unwrap_err();
        assert_eq!(
            err,
            CurrencyError::UnsupportedMinorUnits {
                code: "JPY".into(),
                exponent: 0
            }
        );
        assert!(err.to_string().contains("0 decimal places"), "{err}");
        let err = Currency::parse("KWD").unwrap_err();
        assert!(err.to_string().contains("3 decimal places"), "{err}");
        assert!(Currency::parse("KRW").is_err());
    }

    #[test]
    fn rejects_unknown_and_malformed() {
        let err = Currency::parse("XYZ").unwrap_err();
        assert_eq!(err, CurrencyError::Unknown { code: "XYZ".into() });
        assert!(
            err.to_string().contains("unsupported currency \"XYZ\""),
            "{err}"
        );
        assert!(err.to_string().contains("USD"), "{err}");
        for bad in ["usd", "US", "USDD", "", " USD", "U$D"] {
            assert_eq!(
                Currency::parse(bad),
                Err(CurrencyError::Malformed { code: bad.into() }),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn serde_is_the_plain_code() {
        assert_eq!(
            serde_json::to_string(&Currency::EUR).ok(),
            Some("\"EUR\"".to_owned())
        );
        assert_eq!(
            serde_json::from_str::<Currency>("\"GBP\"").ok(),
            Some(Currency::GBP)
        );
        let err = serde_json::from_str::<Currency>("\"JPY\"")
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("only currencies with 2 decimal places"),
            "{err}"
        );
        assert!(serde_json::from_str::<Currency>("840").is_err());
    }
}
