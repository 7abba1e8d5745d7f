-- V4 told "the transaction that posts its entry" by the entry row's xmin, a
-- 32-bit transaction id that comes round again: after 2^32 transactions a
-- new one can carry the id an old (frozen) entry's xmin still shows, and
-- could then add lines that balance each other to that posted entry.
-- `written_by` (V5: the 64-bit transaction id, set by its default) never
-- repeats. An entry without it (written before V5) is no transaction's of
-- today: it takes no more lines. An entry inserted inside a savepoint now
-- takes its lines (its `written_by` is the top-level transaction's).
CREATE OR REPLACE FUNCTION journal_line_of_a_new_entry() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    entry_tenant text;
    entry_writer xid8;
BEGIN
    SELECT e.tenant_id, e.written_by INTO entry_tenant, entry_writer
      FROM journal_entries e WHERE e.entry_id = NEW.entry_id;
    IF NOT FOUND THEN
        -- Not visible: no such entry, or another transaction's not yet
        -- committed (which the foreign key would accept once it commits).
        RAISE EXCEPTION 'journal line of entry %: no such entry posted by this transaction',
            NEW.entry_id
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    IF entry_writer IS DISTINCT FROM pg_current_xact_id() THEN
        RAISE EXCEPTION 'journal is immutable: entry % is posted; lines are added only '
                        'with their entry, in its transaction (post a reversing entry instead)',
            NEW.entry_id
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    IF entry_tenant <> NEW.tenant_id THEN
        RAISE EXCEPTION 'journal line of entry % names tenant %, its entry tenant %',
            NEW.entry_id, NEW.tenant_id, entry_tenant
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    RETURN NEW;
END;
$$;
