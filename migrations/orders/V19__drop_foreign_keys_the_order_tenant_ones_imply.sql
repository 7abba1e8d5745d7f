-- The composite foreign keys of V9 (validated by V10) imply six older ones:
-- a line's, a payment's and a delivery's (order_id, tenant_id) must be an
-- order's, whose tenant must be a tenant (orders_tenant_id_fkey), and the
-- columns are NOT NULL. Each of the six was checked again on every write (a
-- lookup and a row lock on the order or the tenant: two more per order
-- line, per payment and per delivery) and guarded nothing more. A contract
-- step: every running release is past V10. Refused unless the four that
-- imply them are in place and validated. The tables are locked first, in
-- the order order-api's transactions take them (orders, then tenants by
-- the order's foreign-key check, then the order's lines, payment or
-- delivery): dropping a line's key takes order_lines, then orders, and
-- would deadlock with an order in flight that took orders and then wants
-- order_lines.
LOCK TABLE orders, tenants, order_lines, payments, deliveries IN ACCESS EXCLUSIVE MODE;
DO $$
BEGIN
    IF (SELECT count(*) FROM pg_constraint
         WHERE contype = 'f' AND convalidated
           AND (conrelid, conname) IN (('order_lines'::regclass, 'order_lines_order_tenant_fk'),
                                       ('payments'::regclass, 'payments_order_tenant_fk'),
                                       ('deliveries'::regclass, 'deliveries_order_tenant_fk'),
                                       ('orders'::regclass, 'orders_tenant_id_fkey'))) <> 4 THEN
        RAISE EXCEPTION 'the foreign keys that imply the ones V19 drops are not all in place and validated';
    END IF;
END
$$;
ALTER TABLE order_lines
    DROP CONSTRAINT IF EXISTS order_lines_order_id_fkey,
    DROP CONSTRAINT IF EXISTS order_lines_tenant_fk;
ALTER TABLE payments
    DROP CONSTRAINT IF EXISTS payments_order_id_fkey,
    DROP CONSTRAINT IF EXISTS payments_tenant_id_fkey;
ALTER TABLE deliveries
    DROP CONSTRAINT IF EXISTS deliveries_order_id_fkey,
    DROP CONSTRAINT IF EXISTS deliveries_tenant_id_fkey;
