WITH due AS (
    SELECT o.event_id, o.claimed_by AS previous_owner, o.available_at, o.own_failure_count,
           CASE WHEN o.claimed_by IS NULL THEN 0 ELSE o.lease_expiries + 1 END AS expiries,
           pg_column_size(o.payload) AS stored_bytes
    FROM outbox_events o
    WHERE o.published_at IS NULL
      AND o.quarantined_at IS NULL
      AND o.available_at >= $5
      AND o.available_at <= now()
      AND (o.claim_until IS NULL OR o.claim_until <= now())
      AND ($4 = '' OR o.tenant_id = $4)
      AND ($8 OR o.claimed_by IS NULL OR o.lease_expiries = 0)
      AND NOT coalesce(o.claimed_by = $1 AND o.claim_until = ANY($9), false)
      AND (o.aggregate_sequence = 1 OR NOT EXISTS (
          SELECT 1 FROM outbox_events earlier
          WHERE earlier.aggregate_id = o.aggregate_id
            AND earlier.aggregate_type = o.aggregate_type
            AND earlier.aggregate_sequence < o.aggregate_sequence
            AND earlier.published_at IS NULL))
    ORDER BY o.available_at
    LIMIT $3
    FOR UPDATE OF o SKIP LOCKED
),
ranked AS (
    SELECT event_id, previous_owner, own_failure_count, expiries,
           sum(stored_bytes) OVER in_order - stored_bytes AS bytes_before,
           count(*) FILTER (WHERE expiries >= 2) OVER in_order AS suspects_so_far,
           count(*) FILTER (WHERE expiries >= 2) OVER () AS suspects
    FROM due
    WINDOW in_order AS (ORDER BY available_at, event_id ROWS UNBOUNDED PRECEDING)
),
picked AS (
    SELECT event_id, previous_owner, expiries,
           expiries >= 3 AS counted,
           expiries >= 3 AND own_failure_count + 1 >= $7 AS quarantine
    FROM ranked
    WHERE CASE WHEN suspects = 0 THEN bytes_before < $6
               ELSE expiries >= 2 AND suspects_so_far = 1 END
)
UPDATE outbox_events t
SET claimed_by = CASE WHEN picked.quarantine THEN NULL ELSE $1 END,
    claim_until = CASE WHEN picked.quarantine THEN NULL
                       ELSE now() + $2::bigint * interval '1 millisecond' END,
    lease_expiries = picked.expiries,
    attempt_count = t.attempt_count + picked.counted::int,
    own_failure_count = t.own_failure_count + picked.counted::int,
    last_error = CASE WHEN picked.counted
                      THEN 'the lease of ' || picked.previous_owner
                           || ' ran out while it held this event alone: that relay died or stalled on it'
                      ELSE t.last_error END,
    quarantined_at = CASE WHEN picked.quarantine THEN now() END
FROM picked
WHERE t.event_id = picked.event_id
RETURNING t.event_id, t.tenant_id, t.aggregate_type, t.aggregate_id, t.aggregate_sequence,
          t.event_type, t.schema_version,
          CASE WHEN picked.quarantine THEN NULL ELSE t.payload END, t.traceparent, t.tracestate,
          t.occurred_at, t.attempt_count, picked.previous_owner, t.claim_until, picked.quarantine,
          t.last_error, picked.counted