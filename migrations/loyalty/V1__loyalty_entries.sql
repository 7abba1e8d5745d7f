-- Loyalty: points per customer, every entry tied to the event that caused it
-- (the audit trail: "why 80 points? ParcelDelivered <event id>").

-- The order terms from OrderPlaced (ParcelDelivered carries no prices or customer).
CREATE TABLE loyalty_orders (
    tenant_id        text   NOT NULL,
    order_id         uuid   NOT NULL,
    customer_id      text   NOT NULL,
    currency         text   NOT NULL,
    merchandise      bigint NOT NULL CHECK (merchandise >= 0),
    placed_event_id  uuid   NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, order_id)
);

CREATE TABLE loyalty_entries (
    entry_id     bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant_id    text   NOT NULL,
    customer_id  text   NOT NULL,
    order_id     uuid   NOT NULL,
    points       bigint NOT NULL CHECK (points <> 0),
    event_id     uuid   NOT NULL,
    event_type   text   NOT NULL,
    reason       text   NOT NULL,
    occurred_at  timestamptz NOT NULL,
    recorded_at  timestamptz NOT NULL DEFAULT now(),
    UNIQUE (tenant_id, event_id)
);
CREATE INDEX loyalty_entries_customer_idx ON loyalty_entries (tenant_id, customer_id, entry_id);
