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
-- columns), and this migration finds them. It checks that what it found is
-- what it would have built: a concurrent build that failed leaves an
-- invalid index of the same name, and a hand-built one may differ (not
-- unique, deferrable, other or INCLUDEd columns, partial); none would
-- enforce this or serve the foreign keys, so the migration
-- stops and says which (drop it and build it again).
CREATE UNIQUE INDEX IF NOT EXISTS payments_one_per_order ON payments (order_id);
CREATE UNIQUE INDEX IF NOT EXISTS deliveries_one_per_order ON deliveries (order_id);
CREATE UNIQUE INDEX IF NOT EXISTS orders_order_tenant_uq ON orders (order_id, tenant_id);
DO $$
DECLARE
    wanted record;
    as_built boolean;
BEGIN
    FOR wanted IN
        SELECT * FROM (VALUES
            ('payments_one_per_order', 'payments', ARRAY['order_id']),
            ('deliveries_one_per_order', 'deliveries', ARRAY['order_id']),
            ('orders_order_tenant_uq', 'orders', ARRAY['order_id', 'tenant_id'])
        ) AS w (index_name, table_name, columns)
    LOOP
        SELECT i.indisvalid AND i.indisunique AND i.indimmediate
               AND i.indnatts = i.indnkeyatts AND i.indpred IS NULL AND i.indexprs IS NULL
               AND i.indrelid = to_regclass(wanted.table_name)
               AND ARRAY(SELECT a.attname::text
                           FROM unnest(i.indkey::int2[]) WITH ORDINALITY AS k (attnum, n)
                           JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
                          ORDER BY k.n) = wanted.columns
          INTO as_built
          FROM pg_index i
         WHERE i.indexrelid = to_regclass(wanted.index_name);
        IF as_built IS DISTINCT FROM true THEN
            RAISE EXCEPTION 'index % is not a valid unique index on %(%): drop it and build it again',
                wanted.index_name, wanted.table_name, array_to_string(wanted.columns, ', ');
        END IF;
    END LOOP;
END
$$;

ALTER TABLE order_lines ADD CONSTRAINT order_lines_order_tenant_fk
    FOREIGN KEY (order_id, tenant_id) REFERENCES orders (order_id, tenant_id) NOT VALID;
ALTER TABLE payments ADD CONSTRAINT payments_order_tenant_fk
    FOREIGN KEY (order_id, tenant_id) REFERENCES orders (order_id, tenant_id) NOT VALID;
ALTER TABLE deliveries ADD CONSTRAINT deliveries_order_tenant_fk
    FOREIGN KEY (order_id, tenant_id) REFERENCES orders (order_id, tenant_id) NOT VALID;
