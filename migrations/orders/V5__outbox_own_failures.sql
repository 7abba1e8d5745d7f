-- outbox-relay: quarantine counts the message's own failures only.
--
-- attempt_count counts every failed publish (it sets the backoff). A broker
-- timeout or a broken channel is the infrastructure's failure and never
-- quarantines an event (a broker incident must not stop healthy orders); but
-- when quarantine was decided on attempt_count, ten timeouts during an outage
-- followed by one unroutable return quarantined the order at once. The
-- decision now uses this count of failures of the message's own (returned,
-- nacked, not encodable). A constant default: no table rewrite.
ALTER TABLE outbox_events ADD COLUMN own_failure_count integer NOT NULL DEFAULT 0
    CHECK (own_failure_count >= 0);
