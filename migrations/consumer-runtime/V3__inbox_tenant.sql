-- DESIGN.md section 3: every row carries tenant_id. The inbox row now holds
-- its event's tenant (the envelope's), written in the same statement as the
-- row itself.
--
-- Nullable, and no CHECK: an older binary still running during a rolling
-- deploy inserts without the column (migrations are additive so that it
-- keeps working), and rows written before this migration have no tenant to
-- give (the inbox alone does not say). Every row the runtime writes from
-- this release on carries it. A catalog-only change (no default, no rewrite).
ALTER TABLE processed_events ADD COLUMN tenant_id text;
