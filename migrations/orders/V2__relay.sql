-- outbox-relay: indexes of the claim and cleanup queries.
--
-- The claim (crates/outbox-relay/src/claim.rs) walks outbox_dispatch_idx (V1)
-- in available_at order and, for each candidate, probes for an earlier
-- unpublished event of the same order ("only the lowest unpublished sequence
-- of an order is claimable"). This partial index answers that probe from the
-- pending rows alone, so it stays small however many rows are published.
CREATE INDEX outbox_pending_sequence_idx
    ON outbox_events (aggregate_id, aggregate_type, aggregate_sequence)
    WHERE published_at IS NULL;

-- Cleanup deletes published rows past the retention horizon, oldest first,
-- in bounded batches.
CREATE INDEX outbox_published_at_idx
    ON outbox_events (published_at)
    WHERE published_at IS NOT NULL;
