-- The contract step of V3's expand: GET /customers/{id}/loyalty pages by
-- (written_by, entry_id) on loyalty_entries_customer_written_idx since V3,
-- whose leading columns also serve the balance; the cursor's and the
-- after-check's reads go by the primary key. Nothing reads
-- loyalty_entries_customer_idx (V1) any more, and every award still paid a
-- random insert into it. A loyalty consumer of before V3 paged by it: this
-- migration belongs to a release after every instance runs V3's code.
-- DROP INDEX takes the table's lock only for the catalog change, no scan.
DROP INDEX IF EXISTS loyalty_entries_customer_idx;
