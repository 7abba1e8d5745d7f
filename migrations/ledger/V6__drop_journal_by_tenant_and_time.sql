-- The contract step of V5's expand: GET /journal pages by (written_by,
-- posted_at, entry_id) on journal_entries_tenant_written_idx since V5, and
-- nothing reads journal_entries_tenant_posted_idx (V2) any more; every
-- entry still paid an insert into it. A ledger consumer of before V5 paged
-- by it: this migration belongs to a release after every instance runs V5's
-- code (a rolling deploy of V5 itself keeps both). DROP INDEX takes the
-- table's lock only for the catalog change, no scan.
DROP INDEX IF EXISTS journal_entries_tenant_posted_idx;
