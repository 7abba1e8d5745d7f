WITH due AS (
    SELECT o.event_id, o.claimed_by AS previous_owner
    FROM outbox_events o
    WHERE o.published_at IS NULL
      AND o.quarantined_at IS NULL
      AND o.available_at >= $5
      AND o.available_at <= now()
      AND (o.claim_until IS NULL OR o.claim_until <= now())
      AND ($4 = '' OR o.tenant_id = $4)
      AND (o.aggregate_sequence = 1 OR NOT EXISTS (
          SELECT 1 FROM outbox_events earlier
          WHERE earlier.aggregate_id = o.aggregate_id
            AND earlier.aggregate_type = o.aggregate_type
            AND earlier.aggregate_sequence < o.aggregate_sequence
            AND earlier.published_at IS NULL))
    ORDER BY o.available_at
    LIMIT $3
    FOR UPDATE OF o SKIP LOCKED
)
UPDATE outbox_events t
SET claimed_by = $1, claim_until = now() + $2::bigint * interval '1 millisecond'
FROM due
WHERE t.event_id = due.event_id
RETURNING t.event_id, t.tenant_id, t.aggregate_type, t.aggregate_id, t.aggregate_sequence,
          t.event_type, t.schema_version, t.payload, t.traceparent, t.tracestate,
          t.occurred_at, t.attempt_count, due.previous_owner, t.claim_until