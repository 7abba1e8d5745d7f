-- GET /journal lists a tenant's entries in the order of the transactions
-- that wrote them (`written_by`), then posted_at, up to the oldest
-- transaction still running (consumer-runtime auth::SETTLED_HORIZON):
-- entries commit in any order, so a page by posted_at could leave a late
-- commit behind a reader's cursor for good. Entries from before the column
-- have none (NULL, listed as 0: long committed); the journal is immutable
-- and they are not rewritten (adding a column without a default is
-- instant, and changes no row).
ALTER TABLE journal_entries ADD COLUMN written_by xid8;
ALTER TABLE journal_entries ALTER COLUMN written_by SET DEFAULT pg_current_xact_id();
-- Built in this transaction, blocking writes while it runs: on a large
-- table, build it first with CREATE INDEX CONCURRENTLY under this name.
CREATE INDEX IF NOT EXISTS journal_entries_tenant_written_idx
    ON journal_entries (tenant_id, (coalesce(written_by, '0'::xid8)), posted_at, entry_id);
