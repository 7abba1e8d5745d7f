-- The immutability error's hint (V8) lists the relay's columns, the ones an
-- UPDATE may change; V15 added lease_expiries to them. Same function, same
-- error code and message (V12's AFTER trigger calls it unchanged); only the
-- hint is completed.
CREATE OR REPLACE FUNCTION outbox_events_immutable() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'outbox_events rows are immutable: event % cannot be edited', OLD.event_id
        USING ERRCODE = 'restrict_violation',
              HINT = 'only the relay''s columns (claimed_by, claim_until, published_at, '
                     'attempt_count, own_failure_count, lease_expiries, last_error, '
                     'available_at, quarantined_at) change; requeue the event or write a '
                     'corrective one';
END;
$$;
