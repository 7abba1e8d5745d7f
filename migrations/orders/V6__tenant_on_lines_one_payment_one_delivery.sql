-- DESIGN.md section 3: every row carries tenant_id. order_lines did not.
-- Backfilled from the order; a line is always written with its order (same
-- transaction), and a binary from before this migration that inserts lines
-- without tenant_id gets it filled in from the order (the trigger fires only
-- for such rows: its WHEN clause is checked without calling the function).
ALTER TABLE order_lines ADD COLUMN tenant_id text;
UPDATE order_lines l SET tenant_id = o.tenant_id FROM orders o WHERE o.order_id = l.order_id;
ALTER TABLE order_lines ALTER COLUMN tenant_id SET NOT NULL;
ALTER TABLE order_lines ADD CONSTRAINT order_lines_tenant_fk
    FOREIGN KEY (tenant_id) REFERENCES tenants (tenant_id);

CREATE FUNCTION order_lines_tenant_from_order() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    SELECT o.tenant_id INTO NEW.tenant_id FROM orders o WHERE o.order_id = NEW.order_id;
    RETURN NEW;
END;
$$;
CREATE TRIGGER order_lines_tenant_from_order BEFORE INSERT ON order_lines
    FOR EACH ROW WHEN (NEW.tenant_id IS NULL)
    EXECUTE FUNCTION order_lines_tenant_from_order();

-- One payment and one delivery per order: order-api checks the order's status
-- under its row lock; the database now holds it too.
CREATE UNIQUE INDEX payments_one_per_order_uq ON payments (order_id);
CREATE UNIQUE INDEX deliveries_one_per_order_uq ON deliveries (order_id);
