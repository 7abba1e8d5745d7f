-- What order-api decides under the order's row lock, enforced by the
-- database too (correctness lives in the database, not in one code path):
--
-- * one payment and one delivery per order (a second is 409
--   order_already_paid / order_already_delivered, stored with its key);
-- * a line, payment or delivery belongs to its order's tenant: each child
--   row's (order_id, tenant_id) must be its order's, not merely some tenant
--   (orders.tenant_id never changes).
--
-- The unique indexes are built in this transaction, blocking writes to the
-- table while they build: on a large live orders database, build them by
-- hand first (`CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS ...`, the
-- same names and columns), and this migration finds them. The foreign keys
-- are added NOT VALID (instant, enforced for new rows) and then validated,
-- which reads the old rows under a SHARE UPDATE EXCLUSIVE lock (writers
-- go on).
CREATE UNIQUE INDEX IF NOT EXISTS payments_one_per_order ON payments (order_id);
CREATE UNIQUE INDEX IF NOT EXISTS deliveries_one_per_order ON deliveries (order_id);
CREATE UNIQUE INDEX IF NOT EXISTS orders_order_tenant_uq ON orders (order_id, tenant_id);

ALTER TABLE order_lines ADD CONSTRAINT order_lines_order_tenant_fk
    FOREIGN KEY (order_id, tenant_id) REFERENCES orders (order_id, tenant_id) NOT VALID;
ALTER TABLE payments ADD CONSTRAINT payments_order_tenant_fk
    FOREIGN KEY (order_id, tenant_id) REFERENCES orders (order_id, tenant_id) NOT VALID;
ALTER TABLE deliveries ADD CONSTRAINT deliveries_order_tenant_fk
    FOREIGN KEY (order_id, tenant_id) REFERENCES orders (order_id, tenant_id) NOT VALID;
ALTER TABLE order_lines VALIDATE CONSTRAINT order_lines_order_tenant_fk;
ALTER TABLE payments VALIDATE CONSTRAINT payments_order_tenant_fk;
ALTER TABLE deliveries VALIDATE CONSTRAINT deliveries_order_tenant_fk;
