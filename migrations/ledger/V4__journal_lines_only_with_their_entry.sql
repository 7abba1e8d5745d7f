-- Journal entries are immutable against additions too: a line can be added
-- only by the transaction that posts its entry, and only under the entry's
-- tenant. V1 refused UPDATE, DELETE and TRUNCATE, but a later INSERT of two
-- lines that balance each other into a committed entry passed the balance
-- check and changed a posted entry; and nothing tied a line's tenant to its
-- entry's.
--
-- "The transaction that posts its entry": the entry row's xmin is this
-- transaction's id. An entry inserted inside a savepoint has the
-- subtransaction's id and is refused as well (fail closed; the ledger posts
-- entries in its one top-level transaction per event).
CREATE FUNCTION journal_line_of_a_new_entry() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    entry_tenant text;
    entry_xmin   xid;
BEGIN
    SELECT e.tenant_id, e.xmin INTO entry_tenant, entry_xmin
      FROM journal_entries e WHERE e.entry_id = NEW.entry_id;
    IF NOT FOUND THEN
        -- Not visible: no such entry, or another transaction's not yet
        -- committed (which the foreign key would accept once it commits).
        RAISE EXCEPTION 'journal line of entry %: no such entry posted by this transaction',
            NEW.entry_id
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    IF entry_xmin <> pg_current_xact_id()::xid THEN
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
CREATE TRIGGER journal_lines_only_with_their_entry BEFORE INSERT ON journal_lines
    FOR EACH ROW EXECUTE FUNCTION journal_line_of_a_new_entry();
