-- When an entry takes effect in the books (seed 003: revenue is recognised
-- on delivery), next to when it was posted: a delivery's `delivered_at` (a
-- courier may report it late, into the next period), a payment's recording
-- time. Entries posted before this column have none: read them at their
-- `posted_at` (the journal is immutable, so they are not backfilled).
-- Adding a nullable column without a default touches only the catalog.
ALTER TABLE journal_entries ADD COLUMN effective_at timestamptz;
