SELECT count(*) FILTER (WHERE quarantined_at IS NULL AND NOT held),
       COALESCE(EXTRACT(EPOCH FROM now() - min(occurred_at)
                FILTER (WHERE quarantined_at IS NULL AND NOT held AND isfinite(occurred_at)))::float8, 0),
       count(*) FILTER (WHERE quarantined_at IS NOT NULL),
       pg_total_relation_size('outbox_events'),
       count(*) FILTER (WHERE quarantined_at IS NULL AND NOT held AND attempt_count > 0),
       COALESCE(max(attempt_count) FILTER (WHERE quarantined_at IS NULL AND NOT held), 0),
       COALESCE(EXTRACT(EPOCH FROM now() - min(quarantined_at))::float8, 0),
       count(*) FILTER (WHERE held)
FROM (SELECT quarantined_at, occurred_at, attempt_count,
             quarantined_at IS NULL
             AND coalesce(bool_or(quarantined_at IS NOT NULL) OVER earlier, false) AS held
      FROM outbox_events
      WHERE published_at IS NULL AND ($1 = '' OR tenant_id = $1)
      WINDOW earlier AS (PARTITION BY aggregate_id, aggregate_type ORDER BY aggregate_sequence
                         ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING)) unpublished
