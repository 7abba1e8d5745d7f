-- GET /customers/{id}/loyalty lists a customer's entries in the order of
-- the transactions that wrote them (`written_by`), up to the oldest
-- transaction still running (consumer-runtime auth::SETTLED_HORIZON):
-- entry ids are drawn at insert and commit in any order, so a page by id
-- could leave a late commit behind a reader's cursor for good. Rows from
-- before the column have none (NULL, listed as 0: long committed) and are
-- not rewritten (adding a column without a default is instant).
ALTER TABLE loyalty_entries ADD COLUMN written_by xid8;
ALTER TABLE loyalty_entries ALTER COLUMN written_by SET DEFAULT pg_current_xact_id();
-- Built in this transaction, blocking writes while it runs: on a large
-- table, build it first with CREATE INDEX CONCURRENTLY under this name.
CREATE INDEX IF NOT EXISTS loyalty_entries_customer_written_idx
    ON loyalty_entries (tenant_id, customer_id, (coalesce(written_by, '0'::xid8)), entry_id);
