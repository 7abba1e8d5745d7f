-- GET /journal pages a tenant's entries in (posted_at, entry_id) order
-- (keyset: after the cursor's entry, LIMIT n). Without this index each page
-- read and sorted all of the tenant's entries.
-- (A plain CREATE INDEX: refinery runs a migration in a transaction. On a
-- large live journal, build it by hand first with CREATE INDEX CONCURRENTLY
-- IF NOT EXISTS, as ARCHITECTURE.md says; the ledger consumer's writes wait
-- for the build, then go on.)
CREATE INDEX IF NOT EXISTS journal_entries_tenant_posted_idx
    ON journal_entries (tenant_id, posted_at, entry_id);
