-- Parking holds an order from the dead-lettered event on, not before it.
--
-- parked_sequence: the lowest sequence dead-lettered while the order is
-- parked. Its earlier events (one waiting in a retry tier while a later one
-- turned out to be poison) still apply; this event and the later ones go to
-- the dead-letter queue until a redrive un-parks the order. NULL on a row
-- parked before this column existed: the whole order is held, as before.
-- A catalog-only change (no default, no rewrite).
ALTER TABLE order_progress ADD COLUMN parked_sequence bigint;
