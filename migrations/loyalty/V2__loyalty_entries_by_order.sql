-- Entries by order: the handler checks that an order's delivery is awarded once.
CREATE INDEX loyalty_entries_order_idx ON loyalty_entries (tenant_id, order_id);
