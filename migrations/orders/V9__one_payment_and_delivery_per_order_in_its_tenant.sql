-- What order-api decides under the order's row lock, enforced by the
-- database too (correctness lives in the database, not in one code path):
--
-- * one payment and one delivery per order (a second is 409
--   order_already_paid / order_already_delivered, stored with its key);
-- * a line, payment or delivery belongs to its order's tenant: each child
--   row's (order_id, tenant_id) must be its order's, not merely some tenant
--   (orders.tenant_id never changes).
--
-- Expand step (V10 validates the existing rows in its own transaction, as
-- V6/V7 do): the foreign keys are added NOT VALID, which takes brief SHARE
-- ROW EXCLUSIVE locks and enforces them for every new row at once. The
-- unique indexes are built here, blocking writes to their table while they
-- build: on a large live orders database build them by hand first
-- (`CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS ...`, these names and
-- columns), and this migration finds them. A concurrent build that failed
-- leaves an invalid index of the same name, which enforces nothing: the
-- check below refuses to go on with one (drop it and build it again).
CREATE UNIQUE INDEX IF NOT EXISTS payments_one_per_order ON payments (order_id);
CREATE UNIQUE INDEX IF NOT EXISTS deliveries_one_per_order ON deliveries (order_id);
CREATE UNIQUE INDEX IF NOT EXISTS orders_order_tenant_uq ON orders (order_id, tenant_id);
DO $$
DECLARE
    invalid text;
BEGIN
    SELECT string_agg(c.relname, ', ') INTO invalid
      FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
     WHERE c.relname IN ('payments_one_per_order', 'deliveries_one_per_order',
                         'orders_order_tenant_uq')
       AND NOT i.indisvalid;
    IF invalid IS NOT NULL THEN
        RAISE EXCEPTION 'invalid index(es) %: a failed CREATE INDEX CONCURRENTLY; drop and build again', invalid;
    END IF;
END
$$;

ALTER TABLE order_lines ADD CONSTRAINT order_lines_order_tenant_fk
    FOREIGN KEY (order_id, tenant_id) REFERENCES orders (order_id, tenant_id) NOT VALID;
ALTER TABLE payments ADD CONSTRAINT payments_order_tenant_fk
    FOREIGN KEY (order_id, tenant_id) REFERENCES orders (order_id, tenant_id) NOT VALID;
ALTER TABLE deliveries ADD CONSTRAINT deliveries_order_tenant_fk
    FOREIGN KEY (order_id, tenant_id) REFERENCES orders (order_id, tenant_id) NOT VALID;
