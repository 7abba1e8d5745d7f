-- GET /customers/{id}/loyalty pages a customer's entries in (recorded_at,
-- entry_id) order, up to the settled horizon (consumer-runtime
-- auth::SETTLED_HORIZON): recorded_at is the writing transaction's start,
-- and entry ids, drawn at insert, commit in any order, so a page by id
-- alone could leave a late commit behind a reader's cursor.
CREATE INDEX loyalty_entries_customer_time_idx
    ON loyalty_entries (tenant_id, customer_id, recorded_at, entry_id);
-- It serves the balance's sum by (tenant_id, customer_id) as well.
DROP INDEX loyalty_entries_customer_idx;
