SELECT count(*) FILTER (WHERE quarantined_at IS NULL),
       -- isfinite: an 'infinity' occurred_at (a row the relay cannot read,
       -- soon quarantined) would make the subtraction fail.
       COALESCE(EXTRACT(EPOCH FROM now() - min(occurred_at)
                FILTER (WHERE quarantined_at IS NULL AND isfinite(occurred_at)))::float8, 0),
       count(*) FILTER (WHERE quarantined_at IS NOT NULL),
       pg_total_relation_size('outbox_events'),
       count(*) FILTER (WHERE quarantined_at IS NULL AND attempt_count > 0),
       COALESCE(max(attempt_count) FILTER (WHERE quarantined_at IS NULL), 0),
       -- How long the oldest quarantine has held its order (0: none).
       COALESCE(EXTRACT(EPOCH FROM now() - min(quarantined_at))::float8, 0)
FROM outbox_events
WHERE published_at IS NULL AND ($1 = '' OR tenant_id = $1)
