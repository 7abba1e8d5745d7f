//! Shared helpers of the cross-service tests.
