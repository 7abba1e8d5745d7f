-- Seed 000: the outbox row is immutable ("insert an immutable outbox row").
--
-- What an event says (its identity, order position, type, version, payload,
-- time and trace context) is fixed when the order's transaction inserts it:
-- the broker, the consumers' inboxes and a replay must all see the same
-- event under the same event_id. Only the relay's bookkeeping columns change
-- afterwards (claimed_by, claim_until, published_at, attempt_count,
-- own_failure_count, last_error, available_at, quarantined_at), and a
-- published row may be deleted (cleanup).
--
-- `BEFORE UPDATE OF <columns>` fires only for an UPDATE whose SET list names
-- one of them, so the relay's lease, mark and failure writes never call the
-- function: they pay nothing. A row that cannot be sent is requeued after
-- the repair of the broker side, or answered by a corrective event of the
-- same order (deploy/README.md, "An event that cannot be sent"); it is never
-- edited in place.
CREATE FUNCTION outbox_events_immutable() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'outbox_events rows are immutable: event % cannot be edited', OLD.event_id
        USING ERRCODE = 'restrict_violation',
              HINT = 'only the relay''s columns (claimed_by, claim_until, published_at, '
                     'attempt_count, own_failure_count, last_error, available_at, '
                     'quarantined_at) change; requeue the event or write a corrective one';
END;
$$;
CREATE TRIGGER outbox_events_immutable
    BEFORE UPDATE OF event_id, tenant_id, aggregate_type, aggregate_id, aggregate_sequence,
                     event_type, schema_version, payload, occurred_at, traceparent, tracestate
    ON outbox_events
    FOR EACH ROW EXECUTE FUNCTION outbox_events_immutable();
