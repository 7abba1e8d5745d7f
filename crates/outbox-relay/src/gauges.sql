-- The orders held by a quarantined row: their later events wait behind it
-- (the claim takes none while an earlier event is unpublished) and are
-- "held", not pending: counted apart, out of the pending count and age,
-- which would otherwise grow for as long as the quarantine lasts and keep
-- the pending-age alerts firing over it (OutboxEventsQuarantined pages for
-- it), hiding a real outage behind them. Few rows: a hash join.
WITH quarantined AS (
    SELECT aggregate_type, aggregate_id, min(aggregate_sequence) AS sequence
    FROM outbox_events
    WHERE published_at IS NULL AND quarantined_at IS NOT NULL AND ($1 = '' OR tenant_id = $1)
    GROUP BY aggregate_type, aggregate_id
),
unpublished AS (
    SELECT o.quarantined_at, o.occurred_at, o.attempt_count,
           q.sequence IS NOT NULL AND o.quarantined_at IS NULL
               AND o.aggregate_sequence > q.sequence AS held
    FROM outbox_events o
    LEFT JOIN quarantined q USING (aggregate_type, aggregate_id)
    WHERE o.published_at IS NULL AND ($1 = '' OR o.tenant_id = $1)
)
SELECT count(*) FILTER (WHERE quarantined_at IS NULL AND NOT held),
       -- isfinite: an 'infinity' occurred_at (a row the relay cannot read,
       -- soon quarantined) would make the subtraction fail.
       COALESCE(EXTRACT(EPOCH FROM now() - min(occurred_at)
                FILTER (WHERE quarantined_at IS NULL AND NOT held AND isfinite(occurred_at)))::float8, 0),
       count(*) FILTER (WHERE quarantined_at IS NOT NULL),
       pg_total_relation_size('outbox_events'),
       count(*) FILTER (WHERE quarantined_at IS NULL AND NOT held AND attempt_count > 0),
       COALESCE(max(attempt_count) FILTER (WHERE quarantined_at IS NULL AND NOT held), 0),
       -- How long the oldest quarantine has held its order (0: none).
       COALESCE(EXTRACT(EPOCH FROM now() - min(quarantined_at))::float8, 0),
       count(*) FILTER (WHERE held)
FROM unpublished
