//! Seed 003's worked example as the consumers book it: the numbers `demo`
//! checks over HTTP and the system tests check in the databases.

/// The order's payment journal as the ledger posts it: (account, debit,
/// credit) in minor units.
pub const PAYMENT_JOURNAL: &[(&str, i64, i64)] =
    &[("clearing:card", 9300, 0), ("customer_deposits", 0, 9300)];

/// The order's delivery journal as the ledger posts it.
pub const DELIVERY_JOURNAL: &[(&str, i64, i64)] = &[
    ("customer_deposits", 9300, 0),
    ("sales", 0, 8000),
    ("shipping_income", 0, 500),
    ("tax_payable", 0, 800),
    ("cogs", 4400, 0),
    ("inventory", 0, 4400),
];

/// The stock movements of JKT-M at WH-1: (type, qty, on-hand delta,
/// reserved delta).
pub const MOVEMENTS: &[(&str, i64, i64, i64)] = &[
    ("receipt", 48, 48, 0),
    ("reserve", 2, 0, 2),
    ("sale", -2, -2, -2),
];
