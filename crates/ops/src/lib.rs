//! Operator tools. [`drift`] reads the four databases read-only and reports,
//! per tenant, every way the consumers' state can disagree with the orders:
//! missing or doubled effects, stock levels that differ from their movements,
//! unbalanced journal entries, and the trial balance. [`invariants`] checks
//! the six invariants of DESIGN.md section 12 (and runs the drift check).
//! [`seed`] holds seed 003's example as the consumers book it.

pub mod drift;
pub mod invariants;
pub mod seed;
