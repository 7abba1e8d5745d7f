-- V13 lets an unpublished row that never reached the broker be deleted, for
-- the runbook's replacement by a corrective event at its position. The
-- replacement must come in the same transaction: a bare DELETE (the
-- runbook's first statement alone, in autocommit) would let the claim
-- release the order's next sequence at once, and the consumers would wait
-- for the deleted one for good. Checked at commit (a deferred constraint
-- trigger), when the corrective row is in: some row must hold the deleted
-- row's (aggregate_type, aggregate_id, aggregate_sequence) again, unless
-- the session lifted the guard (`outbox.allow_unpublished_delete`).
--
-- TRUNCATE fires no DELETE trigger: it is refused too, unless the guard is
-- lifted (the ledger refuses it for its journal the same way, ledger V1).
CREATE FUNCTION outbox_events_replaced() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('outbox.allow_unpublished_delete', true) = 'on' THEN
        RETURN NULL;
    END IF;
    IF NOT EXISTS (
        SELECT 1 FROM outbox_events
         WHERE aggregate_type = OLD.aggregate_type
           AND aggregate_id = OLD.aggregate_id
           AND aggregate_sequence = OLD.aggregate_sequence) THEN
        RAISE EXCEPTION 'outbox_events: row % was deleted without a replacement at its position (% %, sequence %)',
                OLD.event_id, OLD.aggregate_type, OLD.aggregate_id, OLD.aggregate_sequence
            USING ERRCODE = 'restrict_violation',
                  HINT = 'insert the corrective event in the same transaction (deploy/README.md)';
    END IF;
    RETURN NULL;
END
$$;

CREATE CONSTRAINT TRIGGER outbox_events_replaced
    AFTER DELETE ON outbox_events
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW WHEN (OLD.published_at IS NULL)
    EXECUTE FUNCTION outbox_events_replaced();

CREATE FUNCTION outbox_events_no_truncate() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('outbox.allow_unpublished_delete', true) = 'on' THEN
        RETURN NULL;
    END IF;
    RAISE EXCEPTION 'outbox_events cannot be truncated: its unpublished rows are committed intents'
        USING ERRCODE = 'restrict_violation';
END
$$;

CREATE TRIGGER outbox_events_no_truncate
    BEFORE TRUNCATE ON outbox_events
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_events_no_truncate();
