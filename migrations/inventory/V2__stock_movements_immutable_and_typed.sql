-- Stock movements are the inventory's journal (the levels are their sum,
-- `drift-check` compares the two): as the ledger's journal (ledger V1), a
-- movement once written is neither changed nor deleted, and each type has
-- the one effect it stands for. Before, both lived in the consumer's code
-- alone: a hand fix, or a handler writing half a pair, committed.
--
-- A repair by hand that must rewrite movements (an operator's, a test
-- planting drift) says so in its transaction or session:
--     SET LOCAL inventory.allow_movement_repair = on;
CREATE FUNCTION stock_movements_immutable() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('inventory.allow_movement_repair', true) = 'on' THEN
        IF TG_LEVEL = 'STATEMENT' THEN
            RETURN NULL;
        ELSIF TG_OP = 'DELETE' THEN
            RETURN OLD;
        END IF;
        RETURN NEW;
    END IF;
    RAISE EXCEPTION 'stock_movements rows are immutable (% refused): record a new movement instead',
        TG_OP
        USING ERRCODE = 'integrity_constraint_violation',
              HINT = 'a repair by hand: SET LOCAL inventory.allow_movement_repair = on';
END;
$$;
CREATE TRIGGER stock_movements_immutable BEFORE UPDATE OR DELETE ON stock_movements
    FOR EACH ROW EXECUTE FUNCTION stock_movements_immutable();
CREATE TRIGGER stock_movements_not_truncated BEFORE TRUNCATE ON stock_movements
    FOR EACH STATEMENT EXECUTE FUNCTION stock_movements_immutable();

-- The effect of each type: a receipt adds its qty on hand; a reservation
-- reserves its qty; a sale (qty negative) takes its qty off hand and
-- releases at most that much of the order's reservation. NOT VALID here
-- (no scan under this statement's lock); V3 validates the rows written
-- before.
ALTER TABLE stock_movements ADD CONSTRAINT stock_movements_effect_of_its_type CHECK (
       (movement_type = 'receipt' AND qty > 0 AND on_hand_delta = qty AND reserved_delta = 0)
    OR (movement_type = 'reserve' AND qty > 0 AND on_hand_delta = 0 AND reserved_delta = qty)
    OR (movement_type = 'sale' AND qty < 0 AND on_hand_delta = qty
        AND reserved_delta BETWEEN qty AND 0)
) NOT VALID;
