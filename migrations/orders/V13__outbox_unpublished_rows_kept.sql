-- A committed intent is never lost to a DELETE. An unpublished outbox row
-- can be deleted only
--   * as the runbook's replacement of a row that could never be sent
--     (deploy/README.md, OutboxQuarantined: quarantined, every attempt its
--     own failure, `last_error` starting with `not sendable: `: it never
--     reached the broker, and a corrective event takes its position in the
--     same transaction), or
--   * in a session that says so (`SET outbox.allow_unpublished_delete = on`:
--     the tests' and the bench's clean-up of their own rows).
-- Published rows (the relay's cleanup past the horizon) are not affected.
--
-- AFTER, not BEFORE: a BEFORE ROW trigger makes PostgreSQL lock every row
-- the DELETE removes before it evaluates WHEN (a WAL record per row, see
-- V12), and the cleanup deletes published rows in bulk. An AFTER ROW
-- trigger whose WHEN is false queues nothing; its exception fails the
-- statement, which changes nothing.
CREATE FUNCTION outbox_events_keep_unpublished() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF OLD.quarantined_at IS NOT NULL
       AND OLD.attempt_count = OLD.own_failure_count
       AND OLD.last_error LIKE 'not sendable: %' THEN
        RETURN NULL;
    END IF;
    IF current_setting('outbox.allow_unpublished_delete', true) = 'on' THEN
        RETURN NULL;
    END IF;
    RAISE EXCEPTION 'outbox_events: row % is unpublished, a committed intent: it cannot be deleted',
            OLD.event_id
        USING ERRCODE = 'restrict_violation',
              HINT = 'a row that could never be sent is replaced as deploy/README.md shows; '
                     'anything else is published by the relay (requeue it if quarantined)';
END
$$;

CREATE TRIGGER outbox_events_keep_unpublished
    AFTER DELETE ON outbox_events
    FOR EACH ROW WHEN (OLD.published_at IS NULL)
    EXECUTE FUNCTION outbox_events_keep_unpublished();
