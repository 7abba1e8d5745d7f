-- DESIGN.md section 3: every row carries tenant_id. order_lines did not.
--
-- Expand only, each step instant, so no write to order_lines waits behind
-- this migration: a nullable column (catalog only), its NOT NULL as a CHECK
-- and its foreign key both NOT VALID (enforced for every new row, existing
-- rows checked by V7, which backfills them without blocking writers).
-- order-api writes the tenant with each line; a binary from before this
-- migration does not, and gets the line's order's tenant filled in by the
-- trigger (its WHEN clause is checked without calling the function, so it
-- costs nothing when the tenant is given).
ALTER TABLE order_lines ADD COLUMN tenant_id text;

CREATE FUNCTION order_lines_tenant_from_order() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    SELECT o.tenant_id INTO NEW.tenant_id FROM orders o WHERE o.order_id = NEW.order_id;
    RETURN NEW;
END;
$$;
CREATE TRIGGER order_lines_tenant_from_order BEFORE INSERT ON order_lines
    FOR EACH ROW WHEN (NEW.tenant_id IS NULL)
    EXECUTE FUNCTION order_lines_tenant_from_order();

ALTER TABLE order_lines ADD CONSTRAINT order_lines_tenant_not_null
    CHECK (tenant_id IS NOT NULL) NOT VALID;
ALTER TABLE order_lines ADD CONSTRAINT order_lines_tenant_fk
    FOREIGN KEY (tenant_id) REFERENCES tenants (tenant_id) NOT VALID;
