-- V6, completed: the lines written before it get their order's tenant, then
-- both constraints are validated. The UPDATE locks only those old rows (no
-- writer touches a line after its order's transaction) and VALIDATE takes a
-- SHARE UPDATE EXCLUSIVE lock: new orders are written throughout.
UPDATE order_lines l SET tenant_id = o.tenant_id
  FROM orders o
 WHERE l.tenant_id IS NULL AND o.order_id = l.order_id;
ALTER TABLE order_lines VALIDATE CONSTRAINT order_lines_tenant_not_null;
ALTER TABLE order_lines VALIDATE CONSTRAINT order_lines_tenant_fk;
