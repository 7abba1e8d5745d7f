-- The consumer runtime's tables, present in every consumer database
-- (inventory, ledger, loyalty). Written only in the transaction that applies an
-- event's effect, so "applied" and "recorded" commit together or not at all.

-- Seed 000's inbox: one row per (consumer, event) ever applied.
CREATE TABLE processed_events (
    consumer_name  text NOT NULL,
    event_id       uuid NOT NULL,
    processed_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_name, event_id)
);
CREATE INDEX processed_events_processed_at_idx ON processed_events (processed_at);

-- Per-order progress: the last aggregate_sequence applied, and whether the order
-- is parked behind a dead-lettered event. Outlives inbox cleanup, so stale
-- duplicates are still rejected after their inbox rows are gone.
CREATE TABLE order_progress (
    consumer_name    text NOT NULL,
    aggregate_id     text NOT NULL,
    tenant_id        text NOT NULL,
    last_sequence    bigint NOT NULL DEFAULT 0 CHECK (last_sequence >= 0),
    parked_at        timestamptz,
    parked_event_id  uuid,
    parked_reason    text,
    updated_at       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_name, aggregate_id)
);
CREATE INDEX order_progress_parked_idx ON order_progress (consumer_name) WHERE parked_at IS NOT NULL;
