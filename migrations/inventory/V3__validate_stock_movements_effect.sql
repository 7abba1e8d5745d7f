-- V2's check over the movements written before it (a scan that takes no
-- lock blocking writes: SHARE UPDATE EXCLUSIVE).
ALTER TABLE stock_movements VALIDATE CONSTRAINT stock_movements_effect_of_its_type;
