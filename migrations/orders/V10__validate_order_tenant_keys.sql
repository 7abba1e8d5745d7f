-- V9, completed: the rows written before V9 are checked against their
-- order's tenant. VALIDATE CONSTRAINT takes a SHARE UPDATE EXCLUSIVE lock
-- on the child table (writers go on) and a ROW SHARE lock on orders, in a
-- transaction of its own (V9's brief locks are released by then).
ALTER TABLE order_lines VALIDATE CONSTRAINT order_lines_order_tenant_fk;
ALTER TABLE payments VALIDATE CONSTRAINT payments_order_tenant_fk;
ALTER TABLE deliveries VALIDATE CONSTRAINT deliveries_order_tenant_fk;
