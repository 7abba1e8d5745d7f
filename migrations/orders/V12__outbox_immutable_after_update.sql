-- The outbox row stays immutable (V8), now checked AFTER the update instead
-- of BEFORE it.
--
-- V8 said the relay's writes "pay nothing" because its `BEFORE UPDATE OF`
-- column list never names the relay's columns. Not so: when a table has any
-- BEFORE ROW UPDATE trigger, PostgreSQL locks every row an UPDATE changes
-- before it looks at the column list (ExecBRUpdateTriggers ->
-- GetTupleForTrigger), and that lock is a WAL record of its own. The mark
-- (`SET published_at = now(), claim_until = NULL`), which no FOR UPDATE
-- precedes, paid one per event: in `make bench-relay`'s drains 2.1 heap lock
-- records per event instead of 1 (the claim's FOR UPDATE); a PL/pgSQL loop
-- of the claim and the mark over a 100,000-row copy spent 39-40 µs of
-- PostgreSQL CPU per event with the trigger, 36 without it or with it AFTER.
--
-- An AFTER ROW trigger with the same column list does not lock the row
-- first, and fires only for an UPDATE naming one of the columns, as before.
-- Its exception still fails the statement (AFTER row triggers of a plain
-- trigger fire at the end of the statement, not of the transaction), with the
-- same error code and message: nothing of the row's content can change.
DROP TRIGGER outbox_events_immutable ON outbox_events;
CREATE TRIGGER outbox_events_immutable
    AFTER UPDATE OF event_id, tenant_id, aggregate_type, aggregate_id, aggregate_sequence,
                    event_type, schema_version, payload, occurred_at, traceparent, tracestate
    ON outbox_events
    FOR EACH ROW EXECUTE FUNCTION outbox_events_immutable();
